/* SPDX-License-Identifier: MIT */
/*
 * Private pools of the PyTorch entry points: the memory of CUDA graphs
 * (beginAllocateToPool, endAllocateToPool, releasePool) and of
 * torch.cuda.MemPool, as include/gmlake-torch.h describes.
 *
 * A captured graph writes its blocks again at every replay, so a block
 * allocated into a pool must not serve anyone outside the pool while the
 * pool lives, even after PyTorch freed it. Such a block stays live in the
 * allocator and is parked in its pool; an allocation into the same pool
 * on the same stream takes a parked block that fits (the graph's kernels
 * on one stream are ordered as they were captured; across streams they
 * are not, so a block a second stream used is never reused here). The
 * parked blocks are freed for real when the pool's last user releases
 * it, after the owner's device-wide sync hook, since a replay may still
 * run on a stream the allocator never saw.
 *
 * A pool with an allocator of its own (gmlake_torch_pool_set_source,
 * torch.cuda.MemPool(allocator=...)) takes no memory from libgmlake: each
 * of its blocks is a segment of its own from that allocator (NCCL
 * registers such a segment whole), parked and reused like any pool block,
 * so it keeps its address while the pool lives. The source is shared by
 * the pool and each of its segments, and done is called when the last of
 * them goes.
 *
 * One lock per device guards its pools and the map from pointer to pool
 * entry; it is never held across an allocator call, a source's alloc or
 * free, or a history event (whose hooks may take Python's lock). A free
 * on a device without pool entries costs one atomic load.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "gmlake-torch.h"
#include "error.h"
#include "ptrmap.h"
#include "torch.h"
#include "types.h"

struct pool;

/* Segments from a pool's own allocator are rounded up to this. */
#define SOURCE_ROUND ((size_t)2 << 20)

/* A pool's own allocator; refs: the pool and each segment it made. */
struct source {
	struct gmlake_torch_pool_source s;
	atomic_int refs;
};

/* A block allocated into a pool. */
struct entry {
	uintptr_t ptr;
	size_t size;			/* asked for when it was allocated */
	size_t alloc_size;		/* handed out by the allocator */
	gmlake_stream_t stream;
	struct pool *pool;
	struct source *src;		/* its segment's allocator, or NULL */
	bool parked;
	bool multi;			/* record_stream named another stream */
};

struct pool {
	uint64_t id[2];
	int users;
	int routes;			/* begins not yet ended */
	struct source *src;		/* its own allocator, or NULL */
	struct entry **parked;		/* by (stream, size, ptr) */
	size_t nparked, cap_parked;
	size_t nlive;
	struct pool *next;
};

struct pool_dev {
	pthread_mutex_t lock;
	struct pool *pools;
	struct gml_ptrmap entries;	/* ptr -> struct entry */
	atomic_size_t nentries;
	atomic_int routes;
	int64_t nparked, parked_req, parked_alloc;
	/* Segments of pools' own allocators: count, bytes, asked for. */
	struct gmlake_stat src_segs, src_bytes, src_req;
	atomic_int nsrc;
};

/* Source segments on every device: frees by pointer alone look for one
 * only when there are some. */
static atomic_int src_total;

static struct pool_dev pdev[GML_TORCH_MAX_DEVICES] = {
	[0 ... GML_TORCH_MAX_DEVICES - 1] = {
		.lock = PTHREAD_MUTEX_INITIALIZER,
	},
};

static _Atomic(int (*)(int)) pool_sync;

GML_EXPORT void gmlake_torch_set_sync_hook(int (*sync)(int device))
{
	atomic_store(&pool_sync, sync);
}

static int check_dev(int device, const char *fn)
{
	if (device < 0 || device >= GML_TORCH_MAX_DEVICES)
		return gml_set_error(-EINVAL, "%s: device %d out of range", fn,
				     device);
	return 0;
}

/* The pool (id0, id1) of pd, or NULL; pd->lock held. */
static struct pool *pool_find(struct pool_dev *pd, uint64_t id0, uint64_t id1)
{
	for (struct pool *p = pd->pools; p; p = p->next)
		if (p->id[0] == id0 && p->id[1] == id1)
			return p;
	return NULL;
}

static struct pool *pool_get(struct pool_dev *pd, uint64_t id0, uint64_t id1)
{
	struct pool *p = pool_find(pd, id0, id1);

	if (p)
		return p;
	p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	p->id[0] = id0;
	p->id[1] = id1;
	p->next = pd->pools;
	pd->pools = p;
	return p;
}

/* One reference to src less; done and the free at the last. */
static void source_put(struct source *src)
{
	if (!src || atomic_fetch_sub(&src->refs, 1) != 1)
		return;
	if (src->s.done)
		src->s.done(src->s.user);
	free(src);
}

/* Drop p once nothing refers to it; pd->lock held. */
static void pool_maybe_drop(struct pool_dev *pd, struct pool *p)
{
	struct pool **link;

	if (p->users || p->routes || p->nlive || p->nparked)
		return;
	for (link = &pd->pools; *link != p; link = &(*link)->next)
		;
	*link = p->next;
	source_put(p->src);
	free(p->parked);
	free(p);
}

/* A source segment came into pd's map (sign 1) or left it (-1). */
static void source_count(struct pool_dev *pd, const struct entry *e, int sign)
{
	if (!e->src)
		return;
	gml_gauge_add(&pd->src_segs, sign);
	gml_gauge_add(&pd->src_bytes, sign * (int64_t)e->alloc_size);
	gml_gauge_add(&pd->src_req, sign * (int64_t)e->size);
	atomic_fetch_add(&pd->nsrc, sign);
	atomic_fetch_add(&src_total, sign);
}

static bool parked_less(const struct entry *a, gmlake_stream_t stream,
			size_t size, uintptr_t ptr)
{
	if (a->stream != stream)
		return (uintptr_t)a->stream < (uintptr_t)stream;
	if (a->size != size)
		return a->size < size;
	return a->ptr < ptr;
}

/* First parked index not less than (stream, size, ptr). */
static size_t parked_bound(const struct pool *p, gmlake_stream_t stream,
			   size_t size, uintptr_t ptr)
{
	size_t lo = 0, hi = p->nparked;

	while (lo < hi) {
		size_t mid = (lo + hi) / 2;

		if (parked_less(p->parked[mid], stream, size, ptr))
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static void parked_count(struct pool_dev *pd, const struct entry *e, int sign)
{
	pd->nparked += sign;
	pd->parked_req += sign * (int64_t)e->size;
	pd->parked_alloc += sign * (int64_t)e->alloc_size;
}

static int park(struct pool_dev *pd, struct entry *e)
{
	struct pool *p = e->pool;
	size_t i;

	if (p->nparked == p->cap_parked) {
		size_t cap = p->cap_parked ? p->cap_parked * 2 : 16;
		struct entry **grown = realloc(p->parked, cap * sizeof(*grown));

		if (!grown)
			return -ENOMEM;
		p->parked = grown;
		p->cap_parked = cap;
	}
	i = parked_bound(p, e->stream, e->size, e->ptr);
	memmove(&p->parked[i + 1], &p->parked[i],
		(p->nparked - i) * sizeof(*p->parked));
	p->parked[i] = e;
	p->nparked++;
	p->nlive--;
	e->parked = true;
	parked_count(pd, e, 1);
	return 0;
}

static void unpark_at(struct pool_dev *pd, struct pool *p, size_t i)
{
	struct entry *e = p->parked[i];

	memmove(&p->parked[i], &p->parked[i + 1],
		(p->nparked - i - 1) * sizeof(*p->parked));
	p->nparked--;
	p->nlive++;
	e->parked = false;
	parked_count(pd, e, -1);
}

/*
 * A parked block of p on stream for size bytes: the smallest of at least
 * size and at most twice that, never one another stream used. NULL if none;
 * pd->lock held.
 */
static struct entry *take_parked(struct pool_dev *pd, struct pool *p,
				 gmlake_stream_t stream, size_t size)
{
	for (size_t i = parked_bound(p, stream, size, 0); i < p->nparked;
	     i++) {
		struct entry *e = p->parked[i];

		if (e->stream != stream || e->size / 2 > size)
			break;
		if (e->multi)
			continue;
		unpark_at(pd, p, i);
		return e;
	}
	return NULL;
}

/*
 * Take every parked block out of p and out of the map: what the caller
 * frees once the lock is dropped (*out, malloc'd; NULL when none).
 */
static size_t take_all_parked(struct pool_dev *pd, struct pool *p,
			      struct entry ***out)
{
	size_t n = p->nparked;

	*out = p->parked;
	p->parked = NULL;
	p->nparked = p->cap_parked = 0;
	for (size_t i = 0; i < n; i++) {
		struct entry *e = (*out)[i];

		gml_ptrmap_del(&pd->entries, e->ptr);
		atomic_fetch_sub(&pd->nentries, 1);
		parked_count(pd, e, -1);
		source_count(pd, e, -1);
	}
	return n;
}

/* The owner's device-wide sync before pool memory goes back. */
static void pool_sync_device(int device)
{
	int (*sync)(int) = atomic_load(&pool_sync);

	if (sync && sync(device))
		gml_log(GMLAKE_LOG_WARN, "torch: device %d: the sync before "
			"freeing a pool's memory failed; freeing anyway",
			device);
}

/* Give source segment e (out of the map) back to its allocator, and the
 * entry; no lock held, the device's work on it done. */
static void source_free(int device, const uint64_t id[2], struct entry *e)
{
	struct source *src = e->src;

	if (gml_history_on() && !e->parked) {
		gml_history_add(device, GMLAKE_TORCH_FREE_REQUESTED, e->ptr,
				e->size, NULL, id[0], id[1]);
		gml_history_add(device, GMLAKE_TORCH_FREE_COMPLETED, e->ptr,
				e->size, NULL, id[0], id[1]);
	}
	src->s.free((void *)e->ptr, e->alloc_size, device, e->stream,
		    src->s.user);
	if (gml_history_on())
		gml_history_add(device, GMLAKE_TORCH_SEGMENT_FREE, e->ptr,
				e->alloc_size, e->stream, id[0], id[1]);
	source_put(src);
	free(e);
}

/* Free the block of entry e (out of the map) for real, and e; no lock
 * held. A pool's own segment goes back to its allocator. */
static void entry_free_now(int device, const uint64_t id[2], struct entry *e)
{
	if (e->src) {
		source_free(device, id, e);
		return;
	}
	gml_torch_free_now((void *)e->ptr, e->size, device, id);
	free(e);
}

/* Free blocks taken out of pool id on device for real; no lock held. */
static void free_taken(int device, const uint64_t id[2], struct entry **v,
		       size_t n)
{
	if (n)
		pool_sync_device(device);
	for (size_t i = 0; i < n; i++)
		entry_free_now(device, id, v[i]);
	free(v);
}

GML_EXPORT int gmlake_torch_pool_begin(int device, uint64_t id0, uint64_t id1)
{
	struct pool_dev *pd;
	struct pool *p;
	int ret = check_dev(device, "gmlake_torch_pool_begin");

	if (ret)
		return ret;
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_get(pd, id0, id1);
	if (p) {
		p->users++;
		p->routes++;
		atomic_fetch_add(&pd->routes, 1);
	}
	pthread_mutex_unlock(&pd->lock);
	if (!p)
		return gml_set_error(-ENOMEM, "no host memory for a pool");
	return 0;
}

GML_EXPORT int gmlake_torch_pool_end(int device, uint64_t id0, uint64_t id1)
{
	struct pool_dev *pd;
	struct pool *p;
	int ret = check_dev(device, "gmlake_torch_pool_end");

	if (ret)
		return ret;
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_find(pd, id0, id1);
	if (!p || !p->routes) {
		ret = gml_set_error(p ? -EINVAL : -ENOENT, "device %d: pool "
				    "(%llu, %llu) %s", device,
				    (unsigned long long)id0,
				    (unsigned long long)id1, p ?
				    "takes no allocations" : "is unknown");
	} else {
		p->routes--;
		atomic_fetch_sub(&pd->routes, 1);
		pool_maybe_drop(pd, p);
	}
	pthread_mutex_unlock(&pd->lock);
	return ret;
}

GML_EXPORT int gmlake_torch_pool_incref(int device, uint64_t id0, uint64_t id1)
{
	struct pool_dev *pd;
	struct pool *p;
	int ret = check_dev(device, "gmlake_torch_pool_incref");

	if (ret)
		return ret;
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_get(pd, id0, id1);
	if (p)
		p->users++;
	pthread_mutex_unlock(&pd->lock);
	if (!p)
		return gml_set_error(-ENOMEM, "no host memory for a pool");
	return 0;
}

GML_EXPORT int gmlake_torch_pool_release(int device, uint64_t id0,
					 uint64_t id1)
{
	const uint64_t id[2] = { id0, id1 };
	struct entry **taken = NULL;
	struct pool_dev *pd;
	struct pool *p;
	size_t n = 0;
	int ret = check_dev(device, "gmlake_torch_pool_release");

	if (ret)
		return ret;
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_find(pd, id0, id1);
	if (!p || p->users <= 0) {
		pthread_mutex_unlock(&pd->lock);
		return gml_set_error(-ENOENT, "device %d: pool (%llu, %llu) "
				     "has no users to release", device,
				     (unsigned long long)id0,
				     (unsigned long long)id1);
	}
	ret = --p->users;
	if (!ret) {
		n = take_all_parked(pd, p, &taken);
		pool_maybe_drop(pd, p);
	}
	pthread_mutex_unlock(&pd->lock);
	free_taken(device, id, taken, n);
	return ret;
}

GML_EXPORT int gmlake_torch_pool_set_source(
	int device, uint64_t id0, uint64_t id1,
	const struct gmlake_torch_pool_source *src)
{
	struct source *own;
	struct pool_dev *pd;
	struct pool *p;
	int ret = check_dev(device, "gmlake_torch_pool_set_source");

	if (ret)
		return ret;
	if (!src || !src->alloc || !src->free)
		return gml_set_error(-EINVAL, "gmlake_torch_pool_set_source: "
				     "%s is NULL", !src ? "src" :
				     !src->alloc ? "src->alloc" : "src->free");
	own = calloc(1, sizeof(*own));
	if (!own)
		return gml_set_error(-ENOMEM, "no host memory for a pool's "
				     "allocator");
	own->s = *src;
	atomic_init(&own->refs, 1);
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_find(pd, id0, id1);
	if (!p || p->users <= 0)
		ret = gml_set_error(-ENOENT, "device %d: pool (%llu, %llu) "
				    "has no users to give an allocator",
				    device, (unsigned long long)id0,
				    (unsigned long long)id1);
	else if (p->src)
		ret = 1;
	else if (p->nlive || p->nparked)
		ret = gml_set_error(-EBUSY, "device %d: pool (%llu, %llu) "
				    "already holds libgmlake's blocks; its "
				    "allocator must come before them", device,
				    (unsigned long long)id0,
				    (unsigned long long)id1);
	else
		p->src = own;
	pthread_mutex_unlock(&pd->lock);
	if (ret)
		free(own);
	return ret;
}

GML_EXPORT int gmlake_torch_pool_use_count(int device, uint64_t id0,
					   uint64_t id1)
{
	struct pool_dev *pd;
	struct pool *p;
	int ret = check_dev(device, "gmlake_torch_pool_use_count");

	if (ret)
		return ret;
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_find(pd, id0, id1);
	ret = p ? p->users : 0;
	pthread_mutex_unlock(&pd->lock);
	return ret;
}

GML_EXPORT int gmlake_torch_pool_empty(int device, uint64_t id0, uint64_t id1)
{
	const uint64_t id[2] = { id0, id1 };
	struct entry **taken = NULL;
	struct pool_dev *pd;
	struct pool *p;
	size_t n = 0;
	int ret = check_dev(device, "gmlake_torch_pool_empty");

	if (ret)
		return ret;
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_find(pd, id0, id1);
	if (p && !p->users) {
		n = take_all_parked(pd, p, &taken);
		pool_maybe_drop(pd, p);
	}
	pthread_mutex_unlock(&pd->lock);
	free_taken(device, id, taken, n);
	return 0;
}

void gml_pool_empty_unused(int device)
{
	struct pool_dev *pd = &pdev[device];
	struct pool *p;

	for (;;) {
		struct entry **taken = NULL;
		uint64_t id[2];
		size_t n = 0;

		pthread_mutex_lock(&pd->lock);
		for (p = pd->pools; p; p = p->next)
			if (!p->users && p->nparked)
				break;
		if (p) {
			id[0] = p->id[0];
			id[1] = p->id[1];
			n = take_all_parked(pd, p, &taken);
			pool_maybe_drop(pd, p);
		}
		pthread_mutex_unlock(&pd->lock);
		if (!p)
			return;
		free_taken(device, id, taken, n);
	}
}

GML_EXPORT bool gmlake_torch_pool_routing(int device)
{
	if (device < 0 || device >= GML_TORCH_MAX_DEVICES)
		return false;
	return atomic_load_explicit(&pdev[device].routes,
				    memory_order_relaxed) > 0;
}

/* Record a new block of pool id in the map; false if the pool went. */
static bool entry_add(struct pool_dev *pd, const uint64_t id[2],
		      struct entry *e)
{
	struct pool *p;
	bool ok = false;

	pthread_mutex_lock(&pd->lock);
	p = pool_find(pd, id[0], id[1]);
	if (p && p->users && !gml_ptrmap_put(&pd->entries, e->ptr, e)) {
		e->pool = p;
		p->nlive++;
		atomic_fetch_add(&pd->nentries, 1);
		source_count(pd, e, 1);
		ok = true;
	}
	pthread_mutex_unlock(&pd->lock);
	return ok;
}

/*
 * A new block of pool id from its own allocator src, whose reference
 * (taken by the caller) the block keeps: the block with *out its entry,
 * or NULL with the error set, *out NULL and the reference dropped.
 */
static void *source_alloc(int device, gmlake_stream_t stream, size_t size,
			  const uint64_t id[2], struct source *src,
			  struct entry **out)
{
	struct pool_dev *pd = &pdev[device];
	struct entry *e;
	gmlake_ctx *ctx;
	size_t asz;
	void *ptr;

	*out = NULL;
	if (size > SIZE_MAX - SOURCE_ROUND) {
		source_put(src);
		gml_torch_oom(device, size, "too large for any segment");
		return NULL;
	}
	/* The device gets its context, holding nothing of this: frees by
	 * pointer alone then find a segment's device as any block's
	 * (gmlake_torch_raw_delete's shortcut for one context). */
	if (gml_torch_ctx_need(device, &ctx)) {
		source_put(src);
		return NULL;
	}
	asz = (size + SOURCE_ROUND - 1) & ~(SOURCE_ROUND - 1);
	e = calloc(1, sizeof(*e));
	ptr = e ? src->s.alloc(asz, device, stream, src->s.user) : NULL;
	if (!ptr) {
		free(e);
		source_put(src);
		gml_torch_oom(device, size, e ? "the pool's own allocator "
			      "returned no memory" : "no host memory");
		return NULL;
	}
	*e = (struct entry){ .ptr = (uintptr_t)ptr, .size = size,
			     .alloc_size = asz, .stream = stream, .src = src };
	if (!entry_add(pd, id, e)) {
		src->s.free(ptr, asz, device, stream, src->s.user);
		free(e);
		source_put(src);
		gml_set_error(-ENOENT, "device %d: pool (%llu, %llu) went, or "
			      "no host memory to record its segment", device,
			      (unsigned long long)id[0],
			      (unsigned long long)id[1]);
		return NULL;
	}
	if (gml_history_on())
		gml_history_add(device, GMLAKE_TORCH_SEGMENT_ALLOC, e->ptr, asz,
				stream, id[0], id[1]);
	*out = e;
	return ptr;
}

GML_EXPORT void *gmlake_torch_pool_alloc(size_t size, int device,
					 gmlake_stream_t stream, uint64_t id0,
					 uint64_t id1)
{
	const uint64_t id[2] = { id0, id1 };
	struct source *src = NULL;
	struct entry *e = NULL;
	struct pool_dev *pd;
	struct pool *p;
	size_t asz = size;
	void *ptr;

	if (!size || check_dev(device, "gmlake_torch_pool_alloc"))
		return size ? gmlake_torch_alloc(size, device, stream) : NULL;
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_find(pd, id0, id1);
	if (p)
		e = take_parked(pd, p, stream, size);
	if (p && !e && p->src) {
		src = p->src;
		atomic_fetch_add(&src->refs, 1);
	}
	pthread_mutex_unlock(&pd->lock);
	if (src) {
		ptr = source_alloc(device, stream, size, id, src, &e);
		goto out_event;
	}
	if (!p)
		gml_log(GMLAKE_LOG_WARN, "torch: device %d: allocation into "
			"unknown pool (%llu, %llu); made outside any pool",
			device, (unsigned long long)id0,
			(unsigned long long)id1);
	if (e) {
		ptr = (void *)e->ptr;
		goto out_event;
	}
	ptr = gml_torch_alloc_in(size, device, stream, &asz);
	if (!ptr || !p)
		goto out_event;
	e = calloc(1, sizeof(*e));
	if (e)
		*e = (struct entry){ .ptr = (uintptr_t)ptr, .size = size,
				     .alloc_size = asz, .stream = stream };
	if (!e || !entry_add(pd, id, e)) {
		/* No host memory, or the pool went meanwhile: a plain block. */
		free(e);
		e = NULL;
	}
out_event:
	if (ptr && gml_history_on())
		gml_history_add(device, GMLAKE_TORCH_ALLOC, (uintptr_t)ptr,
				size, stream, e ? id0 : 0, e ? id1 : 0);
	return ptr;
}

bool gml_pool_free(int device, void *ptr)
{
	struct pool_dev *pd = &pdev[device];
	struct entry *e;
	uint64_t id[2];
	bool parked = false;
	size_t size;

	if (!atomic_load_explicit(&pd->nentries, memory_order_acquire))
		return false;
	pthread_mutex_lock(&pd->lock);
	e = gml_ptrmap_get(&pd->entries, (uintptr_t)ptr);
	if (!e) {
		pthread_mutex_unlock(&pd->lock);
		return false;
	}
	id[0] = e->pool->id[0];
	id[1] = e->pool->id[1];
	size = e->size;
	if (e->parked) {
		pthread_mutex_unlock(&pd->lock);
		gml_log(GMLAKE_LOG_WARN, "torch: device %d: free of %p, "
			"already free in pool (%llu, %llu); ignored", device,
			ptr, (unsigned long long)id[0],
			(unsigned long long)id[1]);
		return true;
	}
	if (e->pool->users && !park(pd, e)) {
		parked = true;
	} else {
		struct pool *p = e->pool;

		gml_ptrmap_del(&pd->entries, e->ptr);
		atomic_fetch_sub(&pd->nentries, 1);
		source_count(pd, e, -1);
		p->nlive--;
		pool_maybe_drop(pd, p);
	}
	pthread_mutex_unlock(&pd->lock);
	if (parked) {
		if (gml_history_on()) {
			gml_history_add(device, GMLAKE_TORCH_FREE_REQUESTED,
					(uintptr_t)ptr, size, NULL, id[0],
					id[1]);
			gml_history_add(device, GMLAKE_TORCH_FREE_COMPLETED,
					(uintptr_t)ptr, size, NULL, id[0],
					id[1]);
		}
		return true;
	}
	/* A segment's pool is gone, but a graph's replay or another
	 * stream may still use it: after the owner's sync, as at release. */
	if (e->src)
		pool_sync_device(device);
	entry_free_now(device, id, e);
	return true;
}

int gml_pool_source_device(const void *ptr)
{
	if (!atomic_load_explicit(&src_total, memory_order_acquire))
		return -1;
	for (int d = 0; d < GML_TORCH_MAX_DEVICES; d++) {
		struct pool_dev *pd = &pdev[d];
		struct entry *e;

		if (!atomic_load_explicit(&pd->nsrc, memory_order_acquire))
			continue;
		pthread_mutex_lock(&pd->lock);
		e = gml_ptrmap_get(&pd->entries, (uintptr_t)ptr);
		pthread_mutex_unlock(&pd->lock);
		if (e && e->src)
			return d;
	}
	return -1;
}

GML_EXPORT int gmlake_torch_pool_segments(int device, uint64_t id0,
					  uint64_t id1,
					  struct gmlake_torch_pool_segment *segs,
					  size_t n)
{
	bool all = !id0 && !id1;
	struct pool_dev *pd;
	size_t k = 0;
	int ret = check_dev(device, "gmlake_torch_pool_segments");

	if (ret)
		return ret;
	if (n && !segs)
		return gml_set_error(-EINVAL, "gmlake_torch_pool_segments: "
				     "segs is NULL");
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	for (size_t i = 0; i < pd->entries.cap; i++) {
		const struct gml_ptrmap_slot *s = &pd->entries.slots[i];
		const struct entry *e = s->val;

		if (s->key <= 1 || !e->src ||
		    (!all && (e->pool->id[0] != id0 || e->pool->id[1] != id1)))
			continue;
		if (k < n)
			segs[k] = (struct gmlake_torch_pool_segment){
				.address = e->ptr, .size = e->alloc_size,
				.requested = e->size,
				.pool_id = { e->pool->id[0], e->pool->id[1] },
				.stream = e->stream, .parked = e->parked };
		k++;
	}
	pthread_mutex_unlock(&pd->lock);
	return k > INT32_MAX ? INT32_MAX : (int)k;
}

void gml_pool_source_stats(int device, struct gmlake_stat *segs,
			   struct gmlake_stat *bytes, struct gmlake_stat *req)
{
	struct pool_dev *pd = &pdev[device];

	pthread_mutex_lock(&pd->lock);
	*segs = pd->src_segs;
	*bytes = pd->src_bytes;
	*req = pd->src_req;
	pthread_mutex_unlock(&pd->lock);
}

void gml_pool_source_reset_peaks(int device)
{
	struct pool_dev *pd = &pdev[device];

	pthread_mutex_lock(&pd->lock);
	pd->src_segs.peak = pd->src_segs.current;
	pd->src_bytes.peak = pd->src_bytes.current;
	pd->src_req.peak = pd->src_req.current;
	pthread_mutex_unlock(&pd->lock);
}

GML_EXPORT int gmlake_torch_pool_of(int device, const void *ptr, uint64_t id[2])
{
	struct pool_dev *pd;
	struct entry *e;
	int ret = check_dev(device, "gmlake_torch_pool_of");

	if (ret)
		return ret;
	if (!id)
		return gml_set_error(-EINVAL, "gmlake_torch_pool_of: id is "
				     "NULL");
	id[0] = id[1] = 0;
	pd = &pdev[device];
	if (!atomic_load_explicit(&pd->nentries, memory_order_acquire))
		return 0;
	pthread_mutex_lock(&pd->lock);
	e = gml_ptrmap_get(&pd->entries, (uintptr_t)ptr);
	if (e) {
		id[0] = e->pool->id[0];
		id[1] = e->pool->id[1];
		ret = e->parked ? 2 : 1;
	}
	pthread_mutex_unlock(&pd->lock);
	return ret;
}

void gml_pool_record_stream(int device, void *ptr)
{
	struct pool_dev *pd = &pdev[device];
	struct entry *e;

	if (!atomic_load_explicit(&pd->nentries, memory_order_acquire))
		return;
	pthread_mutex_lock(&pd->lock);
	e = gml_ptrmap_get(&pd->entries, (uintptr_t)ptr);
	if (e)
		e->multi = true;
	pthread_mutex_unlock(&pd->lock);
}

static int ptr_cmp(const void *x, const void *y)
{
	uintptr_t a = (uintptr_t)*(void *const *)x;
	uintptr_t b = (uintptr_t)*(void *const *)y;

	return a < b ? -1 : a > b;
}

static bool ptr_in(void *const *sorted, size_t n, uintptr_t key)
{
	size_t lo = 0, hi = n;

	while (lo < hi) {
		size_t mid = (lo + hi) / 2;

		if ((uintptr_t)sorted[mid] < key)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo < n && (uintptr_t)sorted[lo] == key;
}

GML_EXPORT int gmlake_torch_pool_check_live(int device, uint64_t id0,
					    uint64_t id1,
					    void *const *expected, size_t n)
{
	struct pool_dev *pd;
	struct pool *p;
	size_t nuniq = 0, found = 0;
	void **sorted = NULL;
	int ret = check_dev(device, "gmlake_torch_pool_check_live");

	if (ret)
		return ret;
	if (n && !expected)
		return gml_set_error(-EINVAL, "gmlake_torch_pool_check_live: "
				     "expected is NULL");
	if (n) {
		sorted = malloc(n * sizeof(*sorted));
		if (!sorted)
			return gml_set_error(-ENOMEM, "no host memory");
		memcpy(sorted, expected, n * sizeof(*sorted));
		qsort(sorted, n, sizeof(*sorted), ptr_cmp);
		for (size_t i = 0; i < n; i++)
			if (!nuniq || sorted[nuniq - 1] != sorted[i])
				sorted[nuniq++] = sorted[i];
	}
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_find(pd, id0, id1);
	ret = 1;
	for (size_t i = 0; p && ret && i < pd->entries.cap; i++) {
		const struct gml_ptrmap_slot *s = &pd->entries.slots[i];
		const struct entry *e = s->val;

		if (s->key <= 1 || e->pool != p || e->parked)
			continue;
		if (ptr_in(sorted, nuniq, e->ptr))
			found++;
		else
			ret = 0;
	}
	if (found != nuniq)
		ret = 0;
	pthread_mutex_unlock(&pd->lock);
	free(sorted);
	return ret;
}

/* The live entries of p into ptrs (at most n); how many there are.
 * pd->lock held. */
static size_t live_of(struct pool_dev *pd, const struct pool *p, void **ptrs,
		      size_t n)
{
	size_t k = 0;

	for (size_t i = 0; p && i < pd->entries.cap; i++) {
		const struct gml_ptrmap_slot *s = &pd->entries.slots[i];
		const struct entry *e = s->val;

		if (s->key <= 1 || e->pool != p || e->parked)
			continue;
		if (k < n)
			ptrs[k] = (void *)e->ptr;
		k++;
	}
	return k;
}

GML_EXPORT int gmlake_torch_pool_live(int device, uint64_t id0, uint64_t id1,
				      void **ptrs, size_t n)
{
	struct pool_dev *pd;
	size_t k;
	int ret = check_dev(device, "gmlake_torch_pool_live");

	if (ret)
		return ret;
	if (n && !ptrs)
		return gml_set_error(-EINVAL, "gmlake_torch_pool_live: ptrs "
				     "is NULL");
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	k = live_of(pd, pool_find(pd, id0, id1), ptrs, n);
	pthread_mutex_unlock(&pd->lock);
	return k > INT32_MAX ? INT32_MAX : (int)k;
}

/* Make the parked entry e live again; pd->lock held. */
static void unpark(struct pool_dev *pd, struct entry *e)
{
	struct pool *p = e->pool;
	size_t i = parked_bound(p, e->stream, e->size, e->ptr);

	if (i < p->nparked && p->parked[i] == e)
		unpark_at(pd, p, i);
}

GML_EXPORT int gmlake_torch_pool_restore(int device, uint64_t id0,
					 uint64_t id1, void *const *keep,
					 size_t nkeep, void **freed,
					 size_t cap)
{
	struct pool_dev *pd;
	struct pool *p;
	size_t nlive, i;
	int ret = check_dev(device, "gmlake_torch_pool_restore");

	if (ret)
		return ret;
	if ((nkeep && !keep) || (cap && !freed))
		return gml_set_error(-EINVAL, "gmlake_torch_pool_restore: a "
				     "pointer array is NULL");
	pd = &pdev[device];
	pthread_mutex_lock(&pd->lock);
	p = pool_find(pd, id0, id1);
	if (!p) {
		ret = gml_set_error(-ENOENT, "device %d: pool (%llu, %llu) is "
				    "unknown", device, (unsigned long long)id0,
				    (unsigned long long)id1);
		goto out_unlock;
	}
	for (i = 0; i < nkeep; i++) {
		struct entry *e = gml_ptrmap_get(&pd->entries,
						 (uintptr_t)keep[i]);

		if (!e || e->pool != p) {
			ret = gml_set_error(-ENOENT, "device %d: %p is no block "
					    "of pool (%llu, %llu) any more",
					    device, keep[i],
					    (unsigned long long)id0,
					    (unsigned long long)id1);
			goto out_unlock;
		}
	}
	nlive = live_of(pd, p, freed, cap);
	if (nlive > cap) {
		ret = gml_set_error(-ENOSPC, "gmlake_torch_pool_restore: %zu "
				    "live blocks, room for %zu", nlive, cap);
		goto out_unlock;
	}
	for (i = 0; i < nlive; i++) {
		struct entry *e = gml_ptrmap_get(&pd->entries,
						 (uintptr_t)freed[i]);

		if (park(pd, e)) {
			ret = gml_set_error(-ENOMEM, "no host memory to park a "
					    "block");
			goto out_unlock;
		}
	}
	for (i = 0; i < nkeep; i++) {
		struct entry *e = gml_ptrmap_get(&pd->entries,
						 (uintptr_t)keep[i]);

		if (e->parked)
			unpark(pd, e);
	}
	ret = nlive > INT32_MAX ? INT32_MAX : (int)nlive;
out_unlock:
	pthread_mutex_unlock(&pd->lock);
	return ret;
}

void gml_pool_parked(int device, int64_t *n, int64_t *requested,
		     int64_t *allocated)
{
	struct pool_dev *pd = &pdev[device];

	pthread_mutex_lock(&pd->lock);
	*n = pd->nparked;
	*requested = pd->parked_req;
	*allocated = pd->parked_alloc;
	pthread_mutex_unlock(&pd->lock);
}

void gml_pool_reset(void)
{
	for (int d = 0; d < GML_TORCH_MAX_DEVICES; d++) {
		struct pool_dev *pd = &pdev[d];
		struct pool *p, *next;

		/* Source segments go back to their allocators: a test's
		 * sources count them. */
		pthread_mutex_lock(&pd->lock);
		for (size_t i = 0; i < pd->entries.cap; i++) {
			struct entry *e = pd->entries.slots[i].val;

			if (pd->entries.slots[i].key <= 1)
				continue;
			if (e->src) {
				e->src->s.free((void *)e->ptr, e->alloc_size,
					       d, e->stream, e->src->s.user);
				source_put(e->src);
			}
			free(e);
		}
		gml_ptrmap_fini(&pd->entries);
		memset(&pd->entries, 0, sizeof(pd->entries));
		for (p = pd->pools; p; p = next) {
			next = p->next;
			source_put(p->src);
			free(p->parked);
			free(p);
		}
		pd->pools = NULL;
		atomic_store(&pd->nentries, 0);
		atomic_store(&pd->routes, 0);
		atomic_store(&pd->nsrc, 0);
		pd->nparked = pd->parked_req = pd->parked_alloc = 0;
		memset(&pd->src_segs, 0, sizeof(pd->src_segs));
		memset(&pd->src_bytes, 0, sizeof(pd->src_bytes));
		memset(&pd->src_req, 0, sizeof(pd->src_req));
		pthread_mutex_unlock(&pd->lock);
	}
	atomic_store(&src_total, 0);
	atomic_store(&pool_sync, NULL);
}
