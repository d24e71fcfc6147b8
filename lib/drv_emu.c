/* SPDX-License-Identifier: MIT */
/*
 * The emulated device: the primitive layer on plain Linux, for tests, CI and
 * trace replay. Nothing here is a stand-in that only counts: the memory is
 * real and so are the mappings.
 *
 *  - Device memory is one sparse memfd of the emulated capacity. A chunk is
 *    an offset range in it, taken first fit from a sorted list of free
 *    extents (in granularity units). When a chunk dies, a hole is punched
 *    over its range, so the memory really goes back to the system.
 *  - A virtual reservation is an anonymous PROT_NONE, MAP_NORESERVE mapping.
 *    Mapping a chunk puts the memfd range at the address (MAP_SHARED |
 *    MAP_FIXED, still PROT_NONE); set_access makes it read-write. Several
 *    chunks mapped side by side really show as one contiguous buffer.
 *    Unmapping puts anonymous PROT_NONE memory back, so the range stays
 *    reserved.
 *  - A stream is a worker thread running a FIFO of copies and event markers.
 *    The worker starts with the first item queued. The default stream (NULL)
 *    is built in.
 *  - An event counts records (rec_gen) and completions (done_gen); it is
 *    complete when every record has been reached by its stream's worker; a
 *    record on an idle stream completes at once.
 *
 * Handles of chunks, streams and events are slot ids with a generation
 * (gen << 32 | index + 1), so a stale or made-up handle is found out and
 * refused with -EINVAL instead of being dereferenced.
 *
 * Locking: dev->lock guards the tables, extents, mappings and reservations.
 * Each stream's lock guards its queue and state; dev->ev_lock guards every
 * event's generations and reference count. Order: dev->lock, then a stream's
 * lock or ev_lock. Workers never take dev->lock.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "drv.h"
#include "error.h"

#define EMU_MAGIC		0x676d6c2d656d7531ULL	/* "gml-emu1" */
#define EMU_DEFAULT_CAPACITY	((size_t)64 << 30)
#define EMU_DEFAULT_GRAN	((size_t)2 << 20)
#define EMU_NO_SLOT		UINT32_MAX

/* A table of objects addressed by ids that carry a generation. */
struct emu_slot {
	void *obj;		/* NULL while the slot is free */
	uint32_t gen;		/* bumped each time the slot is freed */
	uint32_t next_free;
};

struct emu_table {
	struct emu_slot *slot;
	uint32_t len;
	uint32_t cap;
	uint32_t free_head;
	uint64_t live;
};

/*
 * A growable array, kept sorted by its elements' first field. v is element
 * 0, and free room may lie before it as well as after: adding or taking at
 * either end is O(1) and a change in the middle moves the shorter side.
 * Mappings are torn down in address order, which with a plain array moved
 * every remaining element each time (quadratic: 13.8 s for 256 GiB).
 */
struct emu_vec {
	void *v;		/* element 0, inside base */
	void *base;		/* the allocation */
	size_t off;		/* free elements before v */
	size_t len;
	size_t cap;		/* elements base holds */
};

struct emu_extent {		/* free memfd range, in granularity units */
	uint64_t start;
	uint64_t len;
};

struct emu_chunk {
	uint64_t id;
	uint64_t start;		/* in granularity units */
	uint64_t units;
	uint64_t maps;		/* live mappings of it */
	bool released;		/* handle gone; memory stays if mapped */
	bool host;		/* host memory (mem_create_host), host_fd */
};

struct emu_map {
	gml_va va;		/* first: the arrays are sorted by it */
	size_t size;
	struct emu_chunk *chunk;
	bool access;
};

struct emu_resv {
	gml_va va;
	size_t size;
	uint64_t maps;
};

struct emu_event {
	uint64_t id;
	uint64_t rec_gen;	/* records so far */
	uint64_t done_gen;	/* highest record reached by a worker */
	unsigned refs;		/* table, queued markers, waiters */
};

enum emu_item_kind {
	EMU_ITEM_COPY,
	EMU_ITEM_MARK,		/* an event record reached */
	EMU_ITEM_WAIT,		/* wait until ev reaches gen */
	EMU_ITEM_FUNC,		/* call fn(arg) */
};

struct emu_item {
	struct emu_item *next;
	enum emu_item_kind kind;
	struct emu_event *ev;	/* MARK and WAIT */
	uint64_t gen;
	void *dst;
	const void *src;
	size_t size;
	void (*fn)(void *);
	void *arg;
};

struct emu_dev;

struct emu_stream {
	uint64_t id;		/* 0 for the default stream */
	struct emu_dev *dev;
	pthread_mutex_t lock;
	pthread_cond_t work;	/* the worker waits for items */
	pthread_cond_t idle;	/* syncers wait for an empty queue */
	struct emu_item *head;
	struct emu_item **tail;
	bool busy;		/* the worker runs an item */
	bool hold;		/* the worker takes no item */
	bool stop;		/* drain, then exit */
	bool started;
	pthread_t thread;
	unsigned refs;		/* table and syncers; under dev->lock */
};

struct emu_dev {
	uint64_t magic;
	pid_t pid;		/* the process that opened it */
	pthread_mutex_t lock;
	int fd;
	size_t capacity;
	size_t gran;
	size_t used;		/* bytes held by chunks, released or not */
	uint64_t live_handles;	/* chunks not released yet */
	struct emu_vec extents;
	struct emu_vec maps;
	struct emu_vec resvs;
	struct emu_table chunks;
	struct emu_table events;
	struct emu_table streams;
	struct emu_stream *null_stream;
	pthread_mutex_t ev_lock;
	pthread_cond_t ev_cond;	/* broadcast when any event completes */
	int host_fd;		/* host memory of mem_create_host, -1 */
	uint64_t host_next;	/* next free offset in host_fd, in units */
	int host_numa;		/* reported host NUMA node */
};

/* ------------------------------------------------------------------ */
/* Tables and sorted arrays                                           */

static void emu_table_init(struct emu_table *t)
{
	memset(t, 0, sizeof(*t));
	t->free_head = EMU_NO_SLOT;
}

/* Put obj in a free slot and return its id. */
static int emu_table_add(struct emu_table *t, void *obj, uint64_t *id)
{
	struct emu_slot *slot;
	uint32_t i;

	if (t->free_head != EMU_NO_SLOT) {
		i = t->free_head;
		t->free_head = t->slot[i].next_free;
	} else {
		if (t->len == t->cap) {
			uint32_t cap = t->cap ? t->cap * 2 : 64;

			if (t->cap >= EMU_NO_SLOT / 2)
				return -ENOMEM;
			slot = realloc(t->slot, cap * sizeof(*slot));
			if (!slot)
				return -ENOMEM;
			t->slot = slot;
			t->cap = cap;
		}
		i = t->len++;
		t->slot[i].gen = 1;
	}
	t->slot[i].obj = obj;
	t->live++;
	*id = (uint64_t)t->slot[i].gen << 32 | (i + 1);
	return 0;
}

/* The object behind id, or NULL when id is not a live one. */
static void *emu_table_get(const struct emu_table *t, uint64_t id)
{
	uint32_t i = (uint32_t)id;

	if (i == 0 || i > t->len)
		return NULL;
	i--;
	if (t->slot[i].gen != (uint32_t)(id >> 32))
		return NULL;
	return t->slot[i].obj;
}

/* Free the slot of a live id; later lookups of id fail. */
static void emu_table_del(struct emu_table *t, uint64_t id)
{
	uint32_t i = (uint32_t)id - 1;

	t->slot[i].obj = NULL;
	if (++t->slot[i].gen == 0)
		t->slot[i].gen = 1;
	t->slot[i].next_free = t->free_head;
	t->free_head = i;
	t->live--;
}

/*
 * Room for n elements from v on. Slides the elements to the front of the
 * allocation when they fill at most half of it (each slide follows at least
 * cap / 2 removals at the front, so it costs O(1) amortised), else grows.
 */
static int emu_vec_reserve(struct emu_vec *a, size_t elsz, size_t n)
{
	size_t cap = a->cap ? a->cap : 16;
	char *nb;

	if (a->off + n <= a->cap)
		return 0;
	if (n <= a->cap / 2) {
		memmove(a->base, a->v, a->len * elsz);
		a->v = a->base;
		a->off = 0;
		return 0;
	}
	while (cap < n || cap <= a->cap)
		cap *= 2;
	nb = malloc(cap * elsz);
	if (!nb)
		return -ENOMEM;
	if (a->len)
		memcpy(nb, a->v, a->len * elsz);
	free(a->base);
	a->base = a->v = nb;
	a->off = 0;
	a->cap = cap;
	return 0;
}

/* Insert el at index at; never allocates while len < cap. */
static int emu_vec_insert(struct emu_vec *a, size_t elsz, size_t at,
			  const void *el)
{
	bool back_full = a->off + a->len == a->cap;
	bool front = a->off && (at < a->len / 2 || back_full);
	char *v;

	if (back_full && !front && emu_vec_reserve(a, elsz, a->len + 1))
		return -ENOMEM;
	v = a->v;
	if (front) {
		v -= elsz;
		memmove(v, v + elsz, at * elsz);
		a->v = v;
		a->off--;
	} else {
		memmove(v + (at + 1) * elsz, v + at * elsz,
			(a->len - at) * elsz);
	}
	memcpy(v + at * elsz, el, elsz);
	a->len++;
	return 0;
}

/* Remove the element at index at, moving the shorter side over it. */
static void emu_vec_remove(struct emu_vec *a, size_t elsz, size_t at)
{
	char *v = a->v;

	if (at < a->len / 2) {
		memmove(v + elsz, v, at * elsz);
		a->v = v + elsz;
		a->off++;
	} else {
		memmove(v + at * elsz, v + (at + 1) * elsz,
			(a->len - at - 1) * elsz);
	}
	if (!--a->len) {
		a->v = a->base;
		a->off = 0;
	}
}

static void emu_vec_free(struct emu_vec *a)
{
	free(a->base);
	memset(a, 0, sizeof(*a));
}

/* Index of the last element whose key (its first uint64_t) is <= key, or -1. */
static ptrdiff_t emu_vec_floor(const struct emu_vec *a, size_t elsz,
			       uint64_t key)
{
	size_t lo = 0, hi = a->len;

	while (lo < hi) {
		size_t mid = lo + (hi - lo) / 2;
		uint64_t k;

		memcpy(&k, (const char *)a->v + mid * elsz, sizeof(k));
		if (k <= key)
			lo = mid + 1;
		else
			hi = mid;
	}
	return (ptrdiff_t)lo - 1;
}

/* ------------------------------------------------------------------ */
/* Device memory: extents and chunks                                   */

/* First fit: take units from the lowest free extent that holds them. */
static int emu_extent_take(struct emu_dev *dev, uint64_t units,
			   uint64_t *start)
{
	struct emu_extent *e = dev->extents.v;
	size_t i;

	for (i = 0; i < dev->extents.len; i++) {
		if (e[i].len < units)
			continue;
		*start = e[i].start;
		e[i].start += units;
		e[i].len -= units;
		if (!e[i].len)
			emu_vec_remove(&dev->extents, sizeof(*e), i);
		return 0;
	}
	return -ENOMEM;
}

/*
 * Give a range back, merged with its neighbours. Cannot fail: mem_create
 * keeps room for one extent more than there are chunks, which bounds the
 * number of free extents.
 */
static void emu_extent_give(struct emu_dev *dev, uint64_t start,
			    uint64_t units)
{
	struct emu_extent *e = dev->extents.v;
	struct emu_extent add = { start, units };
	ptrdiff_t i = emu_vec_floor(&dev->extents, sizeof(*e), start);
	size_t next = (size_t)(i + 1);
	bool prev_adj = i >= 0 && e[i].start + e[i].len == start;
	bool next_adj = next < dev->extents.len &&
			start + units == e[next].start;

	if (prev_adj && next_adj) {
		e[i].len += units + e[next].len;
		emu_vec_remove(&dev->extents, sizeof(*e), next);
	} else if (prev_adj) {
		e[i].len += units;
	} else if (next_adj) {
		e[next].start = start;
		e[next].len += units;
	} else {
		emu_vec_insert(&dev->extents, sizeof(*e), next, &add);
	}
}

/* The chunk's memory goes back: hole punched, extent freed, id dead. */
static void emu_chunk_free(struct emu_dev *dev, struct emu_chunk *c)
{
	size_t off = c->start * dev->gran;
	size_t len = c->units * dev->gran;

	if (fallocate(c->host ? dev->host_fd : dev->fd,
		      FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE,
		      (off_t)off, (off_t)len))
		gml_log(GMLAKE_LOG_WARN,
			"emu: cannot punch a hole over a released chunk: %s",
			strerror(errno));
	if (!c->host) {
		emu_extent_give(dev, c->start, c->units);
		dev->used -= len;
	}
	emu_table_del(&dev->chunks, c->id);
	free(c);
}

static int emu_mem_create(void *priv, size_t size, gml_handle *h)
{
	struct emu_dev *dev = priv;
	struct emu_chunk *c;
	int ret;

	if (!h)
		return gml_set_error(-EINVAL, "emu: mem_create: NULL handle");
	if (!size || size % dev->gran)
		return gml_set_error(-EINVAL,
			"emu: mem_create: size %zu is not a non-zero multiple of the granularity %zu",
			size, dev->gran);
	c = calloc(1, sizeof(*c));
	if (!c)
		return gml_set_error(-ENOMEM,
			"emu: mem_create: out of host memory");
	c->units = size / dev->gran;

	pthread_mutex_lock(&dev->lock);
	ret = emu_vec_reserve(&dev->extents, sizeof(struct emu_extent),
			      dev->chunks.live + 2);
	if (ret) {
		gml_set_error(ret, "emu: mem_create: out of host memory");
		goto out_unlock;
	}
	ret = emu_extent_take(dev, c->units, &c->start);
	if (ret) {
		gml_set_error(ret,
			"emu: mem_create: no free range of %zu bytes (capacity %zu, used %zu)",
			size, dev->capacity, dev->used);
		goto out_unlock;
	}
	ret = emu_table_add(&dev->chunks, c, &c->id);
	if (ret) {
		gml_set_error(ret, "emu: mem_create: out of host memory");
		goto out_give;
	}
	dev->used += size;
	dev->live_handles++;
	*h = c->id;
	pthread_mutex_unlock(&dev->lock);
	return 0;

out_give:
	emu_extent_give(dev, c->start, c->units);
out_unlock:
	pthread_mutex_unlock(&dev->lock);
	free(c);
	return ret;
}

/* The chunk behind a handle that was not released yet, or NULL. */
static struct emu_chunk *emu_chunk_get(struct emu_dev *dev, gml_handle h,
				       const char *op)
{
	struct emu_chunk *c = emu_table_get(&dev->chunks, h);

	if (!c)
		gml_set_error(-EINVAL, "emu: %s: unknown handle %#llx", op,
			      (unsigned long long)h);
	else if (c->released)
		gml_set_error(-EINVAL, "emu: %s: handle %#llx was released",
			      op, (unsigned long long)h);
	return c && !c->released ? c : NULL;
}

/* Like cuMemRelease: the memory goes once the last mapping of it goes. */
static int emu_mem_release(void *priv, gml_handle h)
{
	struct emu_dev *dev = priv;
	struct emu_chunk *c;

	pthread_mutex_lock(&dev->lock);
	c = emu_chunk_get(dev, h, "mem_release");
	if (!c) {
		pthread_mutex_unlock(&dev->lock);
		return -EINVAL;
	}
	c->released = true;
	dev->live_handles--;
	if (!c->maps)
		emu_chunk_free(dev, c);
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

/* ------------------------------------------------------------------ */
/* Virtual ranges and mappings                                         */

static int emu_va_reserve(void *priv, size_t size, size_t align, gml_va *va)
{
	struct emu_dev *dev = priv;
	struct emu_resv r;
	uintptr_t base, start, end;
	size_t len;
	void *p;
	int ret;

	if (!va)
		return gml_set_error(-EINVAL, "emu: va_reserve: NULL address");
	if (!size || size % dev->gran)
		return gml_set_error(-EINVAL,
			"emu: va_reserve: size %zu is not a non-zero multiple of the granularity %zu",
			size, dev->gran);
	if (align & (align - 1))
		return gml_set_error(-EINVAL,
			"emu: va_reserve: alignment %zu is not a power of two",
			align);
	if (align < dev->gran)
		align = dev->gran;
	if (size > SIZE_MAX - align)
		return gml_set_error(-EINVAL,
			"emu: va_reserve: size %zu too large",
				     size);
	len = size + align;
	p = mmap(NULL, len, PROT_NONE,
		 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (p == MAP_FAILED)
		return gml_set_error(-ENOMEM,
			"emu: va_reserve: cannot reserve %zu bytes: %s",
			size, strerror(errno));
	base = (uintptr_t)p;
	start = (base + align - 1) & ~(uintptr_t)(align - 1);
	end = start + size;
	if (start > base)
		munmap(p, start - base);
	if (base + len > end)
		munmap((void *)end, base + len - end);

	r.va = start;
	r.size = size;
	r.maps = 0;
	pthread_mutex_lock(&dev->lock);
	ret = emu_vec_insert(&dev->resvs, sizeof(r),
			     emu_vec_floor(&dev->resvs, sizeof(r), start) + 1,
			     &r);
	pthread_mutex_unlock(&dev->lock);
	if (ret) {
		munmap((void *)start, size);
		return gml_set_error(ret,
			"emu: va_reserve: out of host memory");
	}
	*va = start;
	return 0;
}

/* The reservation holding [va, va+size) whole, or NULL. */
static struct emu_resv *emu_resv_find(struct emu_dev *dev, gml_va va,
				      size_t size)
{
	struct emu_resv *r = dev->resvs.v;
	ptrdiff_t i = emu_vec_floor(&dev->resvs, sizeof(*r), va);

	if (i < 0 || va - r[i].va >= r[i].size ||
	    size > r[i].size - (va - r[i].va))
		return NULL;
	return &r[i];
}

static int emu_va_free(void *priv, gml_va va, size_t size)
{
	struct emu_dev *dev = priv;
	struct emu_resv *r;
	ptrdiff_t i;
	int ret = 0;

	pthread_mutex_lock(&dev->lock);
	i = emu_vec_floor(&dev->resvs, sizeof(*r), va);
	r = i >= 0 ? (struct emu_resv *)dev->resvs.v + i : NULL;
	if (!r || r->va != va || r->size != size) {
		ret = gml_set_error(-EINVAL,
			"emu: va_free: [%#llx, +%zu) is no reservation",
			(unsigned long long)va, size);
	} else if (r->maps) {
		ret = gml_set_error(-EBUSY,
			"emu: va_free: reservation %#llx still has %llu mappings",
			(unsigned long long)va, (unsigned long long)r->maps);
	} else {
		munmap((void *)(uintptr_t)va, size);
		emu_vec_remove(&dev->resvs, sizeof(*r), i);
	}
	pthread_mutex_unlock(&dev->lock);
	return ret;
}

/* Whether [va, va+size) overlaps a mapping; at: where to insert one. */
static bool emu_map_overlaps(struct emu_dev *dev, gml_va va, size_t size,
			     size_t *at)
{
	struct emu_map *m = dev->maps.v;
	ptrdiff_t i = emu_vec_floor(&dev->maps, sizeof(*m), va);

	*at = (size_t)(i + 1);
	if (i >= 0 && m[i].va + m[i].size > va)
		return true;
	return *at < dev->maps.len && m[*at].va < va + size;
}

/* Check a mem_map request; 0 or -EINVAL with a message. */
static int emu_map_check(struct emu_dev *dev, gml_va va, size_t size,
			 struct emu_chunk *c, size_t *at)
{
	if (size != c->units * dev->gran)
		return gml_set_error(-EINVAL,
			"emu: mem_map: size %zu differs from the chunk's %llu",
			size, (unsigned long long)(c->units * dev->gran));
	if (va % dev->gran || va + size < va)
		return gml_set_error(-EINVAL,
			"emu: mem_map: address %#llx is not aligned to the granularity",
			(unsigned long long)va);
	if (!emu_resv_find(dev, va, size))
		return gml_set_error(-EINVAL,
			"emu: mem_map: [%#llx, +%zu) is not inside one reservation",
			(unsigned long long)va, size);
	if (emu_map_overlaps(dev, va, size, at))
		return gml_set_error(-EINVAL,
			"emu: mem_map: [%#llx, +%zu) overlaps a mapping",
			(unsigned long long)va, size);
	return 0;
}

static int emu_mem_map(void *priv, gml_va va, size_t size, gml_handle h)
{
	struct emu_dev *dev = priv;
	struct emu_chunk *c;
	struct emu_map m;
	size_t at = 0;
	void *p;
	int ret;

	pthread_mutex_lock(&dev->lock);
	c = emu_chunk_get(dev, h, "mem_map");
	if (!c) {
		ret = -EINVAL;
		goto out_unlock;
	}
	ret = emu_map_check(dev, va, size, c, &at);
	if (ret)
		goto out_unlock;
	m.va = va;
	m.size = size;
	m.chunk = c;
	m.access = false;
	ret = emu_vec_insert(&dev->maps, sizeof(m), at, &m);
	if (ret) {
		gml_set_error(ret, "emu: mem_map: out of host memory");
		goto out_unlock;
	}
	p = mmap((void *)(uintptr_t)va, size, PROT_NONE, MAP_SHARED | MAP_FIXED,
		 c->host ? dev->host_fd : dev->fd, (off_t)(c->start * dev->gran));
	if (p == MAP_FAILED) {
		ret = gml_set_error(-errno, "emu: mem_map: mmap: %s",
				    strerror(errno));
		goto out_remove;
	}
	c->maps++;
	emu_resv_find(dev, va, size)->maps++;
	pthread_mutex_unlock(&dev->lock);
	return 0;

out_remove:
	emu_vec_remove(&dev->maps, sizeof(m), at);
	/* A failed MAP_FIXED may have dropped the old pages: reserve again. */
	mmap((void *)(uintptr_t)va, size, PROT_NONE,
	     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
out_unlock:
	pthread_mutex_unlock(&dev->lock);
	return ret;
}

static int emu_mem_unmap(void *priv, gml_va va, size_t size)
{
	struct emu_dev *dev = priv;
	struct emu_map *m;
	struct emu_chunk *c;
	ptrdiff_t i;
	void *p;
	int ret = 0;

	pthread_mutex_lock(&dev->lock);
	m = dev->maps.v;
	i = emu_vec_floor(&dev->maps, sizeof(*m), va);
	if (i < 0 || m[i].va != va || m[i].size != size) {
		ret = gml_set_error(-EINVAL,
			"emu: mem_unmap: [%#llx, +%zu) is no mapping",
			(unsigned long long)va, size);
		goto out_unlock;
	}
	p = mmap((void *)(uintptr_t)va, size, PROT_NONE, MAP_PRIVATE |
		 MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
	if (p == MAP_FAILED) {
		ret = gml_set_error(-errno, "emu: mem_unmap: mmap: %s",
				    strerror(errno));
		goto out_unlock;
	}
	c = m[i].chunk;
	emu_resv_find(dev, va, size)->maps--;
	emu_vec_remove(&dev->maps, sizeof(*m), i);
	if (!--c->maps && c->released)
		emu_chunk_free(dev, c);
out_unlock:
	pthread_mutex_unlock(&dev->lock);
	return ret;
}

/*
 * Walk the mappings from the one holding va while they touch each other;
 * return where the walk ended (>= end when [va, end) is covered), 0 when
 * va is not mapped. With access, stop at a mapping without access too.
 * *first: the index of the mapping holding va.
 */
static gml_va emu_maps_reach(struct emu_dev *dev, gml_va va, gml_va end,
			     bool access, size_t *first)
{
	struct emu_map *m = dev->maps.v;
	ptrdiff_t i = emu_vec_floor(&dev->maps, sizeof(*m), va);
	gml_va at;

	if (i < 0 || m[i].va + m[i].size <= va)
		return 0;
	*first = (size_t)i;
	for (at = m[i].va; (size_t)i < dev->maps.len && at < end; i++) {
		if (m[i].va != at || (access && !m[i].access))
			break;
		at = m[i].va + m[i].size;
	}
	return at;
}

/* Read-write over whole mappings that cover [va, va+size) without a gap. */
static int emu_set_access(void *priv, gml_va va, size_t size)
{
	struct emu_dev *dev = priv;
	struct emu_map *m;
	size_t first = 0, i;
	gml_va end = va + size;
	int ret = 0;

	pthread_mutex_lock(&dev->lock);
	m = dev->maps.v;
	if (!size || end < va ||
	    emu_maps_reach(dev, va, end, false, &first) != end ||
	    m[first].va != va) {
		ret = gml_set_error(-EINVAL,
			"emu: set_access: [%#llx, +%zu) is not whole mappings without gaps",
			(unsigned long long)va, size);
		goto out_unlock;
	}
	if (mprotect((void *)(uintptr_t)va, size, PROT_READ | PROT_WRITE)) {
		ret = gml_set_error(-errno, "emu: set_access: mprotect: %s",
				    strerror(errno));
		goto out_unlock;
	}
	for (i = first; i < dev->maps.len && m[i].va < end; i++)
		m[i].access = true;
out_unlock:
	pthread_mutex_unlock(&dev->lock);
	return ret;
}

/* Whether [p, p+size) is mapped and accessible on this device. */
static bool emu_dev_range_ok(struct emu_dev *dev, const void *p, size_t size)
{
	gml_va va = (uintptr_t)p;
	size_t first;

	if (va + size < va)
		return false;
	return emu_maps_reach(dev, va, va + size, true, &first) >= va + size;
}

/* ------------------------------------------------------------------ */
/* Streams and events                                                  */

static void emu_event_put(struct emu_dev *dev, struct emu_event *ev)
{
	pthread_mutex_lock(&dev->ev_lock);
	if (!--ev->refs)
		free(ev);
	pthread_mutex_unlock(&dev->ev_lock);
}

static void emu_item_run(struct emu_dev *dev, struct emu_item *it)
{
	switch (it->kind) {
	case EMU_ITEM_COPY:
		memmove(it->dst, it->src, it->size);
		return;
	case EMU_ITEM_FUNC:
		it->fn(it->arg);
		return;
	case EMU_ITEM_WAIT:
		pthread_mutex_lock(&dev->ev_lock);
		while (it->ev->done_gen < it->gen)
			pthread_cond_wait(&dev->ev_cond, &dev->ev_lock);
		if (!--it->ev->refs)
			free(it->ev);
		pthread_mutex_unlock(&dev->ev_lock);
		return;
	case EMU_ITEM_MARK:
		break;
	}
	pthread_mutex_lock(&dev->ev_lock);
	if (it->gen > it->ev->done_gen)
		it->ev->done_gen = it->gen;
	pthread_cond_broadcast(&dev->ev_cond);
	if (!--it->ev->refs)
		free(it->ev);
	pthread_mutex_unlock(&dev->ev_lock);
}

/* A stream's worker: run items in order until stopped and drained. */
static void *emu_worker(void *arg)
{
	struct emu_stream *s = arg;
	struct emu_item *it;

	pthread_mutex_lock(&s->lock);
	for (;;) {
		while (!s->stop && (s->hold || !s->head))
			pthread_cond_wait(&s->work, &s->lock);
		it = s->head;
		if (!it)
			break;
		s->head = it->next;
		if (!s->head)
			s->tail = &s->head;
		s->busy = true;
		pthread_mutex_unlock(&s->lock);

		emu_item_run(s->dev, it);
		free(it);

		pthread_mutex_lock(&s->lock);
		s->busy = false;
		if (!s->head)
			pthread_cond_broadcast(&s->idle);
	}
	pthread_mutex_unlock(&s->lock);
	return NULL;
}

static int emu_stream_new(struct emu_dev *dev, struct emu_stream **out)
{
	struct emu_stream *s = calloc(1, sizeof(*s));

	if (!s)
		return -ENOMEM;
	if (pthread_mutex_init(&s->lock, NULL))
		goto out_free;
	if (pthread_cond_init(&s->work, NULL))
		goto out_destroy_lock;
	if (pthread_cond_init(&s->idle, NULL))
		goto out_destroy_work;
	s->dev = dev;
	s->tail = &s->head;
	s->refs = 1;
	*out = s;
	return 0;

out_destroy_work:
	pthread_cond_destroy(&s->work);
out_destroy_lock:
	pthread_mutex_destroy(&s->lock);
out_free:
	free(s);
	return -ENOMEM;
}

/* Let go of any hold, run what is queued, and join the worker. */
static void emu_stream_stop(struct emu_stream *s)
{
	bool started;

	pthread_mutex_lock(&s->lock);
	s->stop = true;
	s->hold = false;
	started = s->started;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->lock);
	if (started)
		pthread_join(s->thread, NULL);
}

static void emu_stream_free(struct emu_stream *s)
{
	pthread_cond_destroy(&s->idle);
	pthread_cond_destroy(&s->work);
	pthread_mutex_destroy(&s->lock);
	free(s);
}

/* Drop a reference to a stopped (or built-in) stream; dev->lock held. */
static void emu_stream_put(struct emu_stream *s)
{
	if (!--s->refs)
		emu_stream_free(s);
}

/* The stream behind a handle (NULL: the default one), or NULL. */
static struct emu_stream *emu_stream_get(struct emu_dev *dev,
					 gmlake_stream_t h, const char *op)
{
	struct emu_stream *s;

	if (!h)
		return dev->null_stream;
	s = emu_table_get(&dev->streams, (uintptr_t)h);
	if (!s)
		gml_set_error(-EINVAL, "emu: %s: unknown stream %p", op,
			      (void *)h);
	return s;
}

/* Start the worker if need be, then queue it; dev->lock held. */
static int emu_enqueue(struct emu_stream *s, struct emu_item *it)
{
	int err;

	pthread_mutex_lock(&s->lock);
	if (!s->started) {
		err = pthread_create(&s->thread, NULL, emu_worker, s);
		if (err) {
			pthread_mutex_unlock(&s->lock);
			return gml_set_error(-err,
				"emu: cannot start a stream worker: %s",
				strerror(err));
		}
		s->started = true;
	}
	it->next = NULL;
	*s->tail = it;
	s->tail = &it->next;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->lock);
	return 0;
}

static int emu_stream_create(void *priv, gmlake_stream_t *out)
{
	struct emu_dev *dev = priv;
	struct emu_stream *s;
	int ret;

	if (!out)
		return gml_set_error(-EINVAL,
			"emu: stream_create: NULL stream");
	if (emu_stream_new(dev, &s))
		return gml_set_error(-ENOMEM,
			"emu: stream_create: out of host memory");
	pthread_mutex_lock(&dev->lock);
	ret = emu_table_add(&dev->streams, s, &s->id);
	pthread_mutex_unlock(&dev->lock);
	if (ret) {
		emu_stream_free(s);
		return gml_set_error(ret,
			"emu: stream_create: out of host memory");
	}
	*out = (gmlake_stream_t)(uintptr_t)s->id;
	return 0;
}

/* Queued work still runs (even on a held stream) before the stream goes. */
static int emu_stream_destroy(void *priv, gmlake_stream_t h)
{
	struct emu_dev *dev = priv;
	struct emu_stream *s;

	if (!h)
		return gml_set_error(-EINVAL,
			"emu: stream_destroy: the default stream cannot be destroyed");
	pthread_mutex_lock(&dev->lock);
	s = emu_stream_get(dev, h, "stream_destroy");
	if (!s) {
		pthread_mutex_unlock(&dev->lock);
		return -EINVAL;
	}
	emu_table_del(&dev->streams, s->id);
	pthread_mutex_unlock(&dev->lock);

	emu_stream_stop(s);

	pthread_mutex_lock(&dev->lock);
	emu_stream_put(s);
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

static int emu_stream_sync(void *priv, gmlake_stream_t h)
{
	struct emu_dev *dev = priv;
	struct emu_stream *s;

	pthread_mutex_lock(&dev->lock);
	s = emu_stream_get(dev, h, "stream_sync");
	if (s)
		s->refs++;
	pthread_mutex_unlock(&dev->lock);
	if (!s)
		return -EINVAL;

	pthread_mutex_lock(&s->lock);
	while (s->head || s->busy)
		pthread_cond_wait(&s->idle, &s->lock);
	pthread_mutex_unlock(&s->lock);

	pthread_mutex_lock(&dev->lock);
	emu_stream_put(s);
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

static int emu_event_create(void *priv, gml_event *out)
{
	struct emu_dev *dev = priv;
	struct emu_event *ev;
	int ret;

	if (!out)
		return gml_set_error(-EINVAL, "emu: event_create: NULL event");
	ev = calloc(1, sizeof(*ev));
	if (!ev)
		return gml_set_error(-ENOMEM,
			"emu: event_create: out of host memory");
	ev->refs = 1;
	pthread_mutex_lock(&dev->lock);
	ret = emu_table_add(&dev->events, ev, &ev->id);
	pthread_mutex_unlock(&dev->lock);
	if (ret) {
		free(ev);
		return gml_set_error(ret,
			"emu: event_create: out of host memory");
	}
	*out = (gml_event)(uintptr_t)ev->id;
	return 0;
}

static struct emu_event *emu_event_get(struct emu_dev *dev, gml_event h,
				       const char *op)
{
	struct emu_event *ev = emu_table_get(&dev->events, (uintptr_t)h);

	if (!ev)
		gml_set_error(-EINVAL, "emu: %s: unknown event %p", op, h);
	return ev;
}

/* Like cuEventDestroy: a pending record still completes, unseen. */
static int emu_event_destroy(void *priv, gml_event h)
{
	struct emu_dev *dev = priv;
	struct emu_event *ev;

	pthread_mutex_lock(&dev->lock);
	ev = emu_event_get(dev, h, "event_destroy");
	if (ev)
		emu_table_del(&dev->events, ev->id);
	pthread_mutex_unlock(&dev->lock);
	if (!ev)
		return -EINVAL;
	emu_event_put(dev, ev);
	return 0;
}

/*
 * A new item of kind about event h for stream sh, with dev->lock taken
 * and *s set; NULL with the lock let go and *err set when the memory, the
 * event or the stream is missing.
 */
static struct emu_item *emu_item_for(struct emu_dev *dev, int kind,
				     gml_event h, gmlake_stream_t sh,
				     const char *op, struct emu_stream **s,
				     int *err)
{
	struct emu_item *it = calloc(1, sizeof(*it));

	if (!it) {
		*err = gml_set_error(-ENOMEM, "emu: %s: out of host memory",
				     op);
		return NULL;
	}
	it->kind = kind;
	pthread_mutex_lock(&dev->lock);
	it->ev = emu_event_get(dev, h, op);
	*s = emu_stream_get(dev, sh, op);
	if (!it->ev || !*s) {
		pthread_mutex_unlock(&dev->lock);
		free(it);
		*err = -EINVAL;
		return NULL;
	}
	return it;
}

static int emu_event_record(void *priv, gml_event h, gmlake_stream_t sh)
{
	struct emu_dev *dev = priv;
	struct emu_item *it;
	struct emu_stream *s;
	int ret;

	it = emu_item_for(dev, EMU_ITEM_MARK, h, sh, "event_record", &s, &ret);
	if (!it)
		return ret;
	/*
	 * An idle stream reaches the marker at once, as an idle GPU does:
	 * completing it here keeps runs without device work deterministic.
	 * Records happen under dev->lock, so nothing is queued meanwhile.
	 */
	pthread_mutex_lock(&s->lock);
	if (!s->head && !s->busy && !s->hold) {
		pthread_mutex_lock(&dev->ev_lock);
		it->ev->done_gen = ++it->ev->rec_gen;
		pthread_cond_broadcast(&dev->ev_cond);
		pthread_mutex_unlock(&dev->ev_lock);
		pthread_mutex_unlock(&s->lock);
		pthread_mutex_unlock(&dev->lock);
		free(it);
		return 0;
	}
	pthread_mutex_unlock(&s->lock);
	/* Hold a marker's reference before the worker can drop it. */
	pthread_mutex_lock(&dev->ev_lock);
	it->gen = ++it->ev->rec_gen;
	it->ev->refs++;
	pthread_mutex_unlock(&dev->ev_lock);
	ret = emu_enqueue(s, it);
	if (!ret) {
		pthread_mutex_unlock(&dev->lock);
		return 0;
	}
	/* Records happen under dev->lock only, so no later one exists. */
	pthread_mutex_lock(&dev->ev_lock);
	it->ev->rec_gen--;
	it->ev->refs--;
	pthread_mutex_unlock(&dev->ev_lock);
	pthread_mutex_unlock(&dev->lock);
	free(it);
	return ret;
}

static int emu_event_query(void *priv, gml_event h)
{
	struct emu_dev *dev = priv;
	struct emu_event *ev;
	int ret;

	pthread_mutex_lock(&dev->lock);
	ev = emu_event_get(dev, h, "event_query");
	if (ev) {
		pthread_mutex_lock(&dev->ev_lock);
		ret = ev->done_gen >= ev->rec_gen ? 0 : -EBUSY;
		pthread_mutex_unlock(&dev->ev_lock);
	} else {
		ret = -EINVAL;
	}
	pthread_mutex_unlock(&dev->lock);
	return ret;
}

/* Wait for the last record made before the call. */
static int emu_event_sync(void *priv, gml_event h)
{
	struct emu_dev *dev = priv;
	struct emu_event *ev;
	uint64_t target;

	pthread_mutex_lock(&dev->lock);
	ev = emu_event_get(dev, h, "event_sync");
	if (!ev) {
		pthread_mutex_unlock(&dev->lock);
		return -EINVAL;
	}
	pthread_mutex_lock(&dev->ev_lock);
	pthread_mutex_unlock(&dev->lock);
	target = ev->rec_gen;
	ev->refs++;
	while (ev->done_gen < target)
		pthread_cond_wait(&dev->ev_cond, &dev->ev_lock);
	if (!--ev->refs)
		free(ev);
	pthread_mutex_unlock(&dev->ev_lock);
	return 0;
}

/* Device sides must be mapped with access when the copy is queued. */
static int emu_memcpy_check(struct emu_dev *dev, void *dst, const void *src,
			    size_t size, enum gml_copy_kind kind)
{
	bool dst_dev = kind == GML_COPY_HTOD || kind == GML_COPY_DTOD;
	bool src_dev = kind == GML_COPY_DTOH || kind == GML_COPY_DTOD;

	if (dst_dev && !emu_dev_range_ok(dev, dst, size))
		return gml_set_error(-EINVAL,
			"emu: memcpy: destination [%p, +%zu) is not accessible device memory",
			dst, size);
	if (src_dev && !emu_dev_range_ok(dev, src, size))
		return gml_set_error(-EINVAL,
			"emu: memcpy: source [%p, +%zu) is not accessible device memory",
			src, size);
	return 0;
}

static int emu_memcpy_async(void *priv, void *dst, const void *src,
			    size_t size, enum gml_copy_kind kind,
			    gmlake_stream_t sh)
{
	struct emu_dev *dev = priv;
	struct emu_stream *s;
	struct emu_item *it;
	int ret;

	if (kind != GML_COPY_HTOD && kind != GML_COPY_DTOH &&
	    kind != GML_COPY_DTOD)
		return gml_set_error(-EINVAL,
			"emu: memcpy: unknown copy kind %d",
				     (int)kind);
	if (size && (!dst || !src))
		return gml_set_error(-EINVAL, "emu: memcpy: NULL %s",
				     dst ? "source" : "destination");
	it = calloc(1, sizeof(*it));
	if (!it)
		return gml_set_error(-ENOMEM,
			"emu: memcpy: out of host memory");
	it->kind = EMU_ITEM_COPY;
	it->dst = dst;
	it->src = src;
	it->size = size;

	pthread_mutex_lock(&dev->lock);
	s = emu_stream_get(dev, sh, "memcpy");
	if (!s) {
		ret = -EINVAL;
		goto out_unlock;
	}
	ret = size ? emu_memcpy_check(dev, dst, src, size, kind) : 0;
	if (ret || !size)
		goto out_unlock;
	ret = emu_enqueue(s, it);
	if (ret)
		goto out_unlock;
	pthread_mutex_unlock(&dev->lock);
	return 0;

out_unlock:
	pthread_mutex_unlock(&dev->lock);
	free(it);
	return ret;
}

/* Like cuStreamWaitEvent: wait for the last record made before the call. */
static int emu_stream_wait(void *priv, gmlake_stream_t sh, gml_event h)
{
	struct emu_dev *dev = priv;
	struct emu_item *it;
	struct emu_stream *s;
	int ret;

	it = emu_item_for(dev, EMU_ITEM_WAIT, h, sh, "stream_wait", &s, &ret);
	if (!it)
		return ret;
	pthread_mutex_lock(&dev->ev_lock);
	it->gen = it->ev->rec_gen;
	it->ev->refs++;
	pthread_mutex_unlock(&dev->ev_lock);
	ret = emu_enqueue(s, it);
	if (!ret) {
		pthread_mutex_unlock(&dev->lock);
		return 0;
	}
	pthread_mutex_lock(&dev->ev_lock);
	it->ev->refs--;
	pthread_mutex_unlock(&dev->ev_lock);
	pthread_mutex_unlock(&dev->lock);
	free(it);
	return ret;
}

/* Like cuLaunchHostFunc: the stream's worker calls fn(arg) in order. */
static int emu_host_func(void *priv, gmlake_stream_t sh, void (*fn)(void *),
			 void *arg)
{
	struct emu_dev *dev = priv;
	struct emu_item *it;
	struct emu_stream *s;
	int ret;

	if (!fn)
		return gml_set_error(-EINVAL, "emu: host_func: NULL function");
	it = calloc(1, sizeof(*it));
	if (!it)
		return gml_set_error(-ENOMEM,
			"emu: host_func: out of host memory");
	it->kind = EMU_ITEM_FUNC;
	it->fn = fn;
	it->arg = arg;
	pthread_mutex_lock(&dev->lock);
	s = emu_stream_get(dev, sh, "host_func");
	ret = s ? emu_enqueue(s, it) : -EINVAL;
	pthread_mutex_unlock(&dev->lock);
	if (ret)
		free(it);
	return ret;
}

/* Host memory needs no pinning here; the arguments are still checked. */
static int emu_host_register(void *priv, void *p, size_t size)
{
	(void)priv;
	if (!p || !size)
		return gml_set_error(-EINVAL,
			"emu: host_register: empty range %p +%zu", p, size);
	return 0;
}

static int emu_host_unregister(void *priv, void *p)
{
	(void)priv;
	if (!p)
		return gml_set_error(-EINVAL, "emu: host_unregister: NULL");
	return 0;
}

static int emu_host_numa(void *priv, int *node)
{
	struct emu_dev *dev = priv;

	if (!node)
		return gml_set_error(-EINVAL, "emu: host_numa: NULL result");
	*node = dev->host_numa;
	return 0;
}

/* The memfd behind host handles, made on first use. dev->lock held. */
static int emu_host_fd(struct emu_dev *dev)
{
	if (dev->host_fd >= 0)
		return 0;
	dev->host_fd = memfd_create("gmlake-emu-host", MFD_CLOEXEC);
	if (dev->host_fd < 0)
		return gml_set_error(-errno, "emu: memfd_create: %s",
				     strerror(errno));
	/* Sparse: offsets are never reused, holes are punched on release. */
	if (ftruncate(dev->host_fd, (off_t)1 << 46)) {
		int err = -errno;

		close(dev->host_fd);
		dev->host_fd = -1;
		return gml_set_error(err, "emu: cannot size host memory: %s",
				     strerror(-err));
	}
	return 0;
}

/* Host pages mappable into device ranges, like cuMemCreate on HOST_NUMA. */
static int emu_mem_create_host(void *priv, size_t size, int numa,
			       gml_handle *h)
{
	struct emu_dev *dev = priv;
	struct emu_chunk *c;
	int ret;

	if (!h || !size || size % dev->gran)
		return gml_set_error(-EINVAL,
			"emu: mem_create_host: size %zu is not a non-zero multiple of the granularity %zu",
			size, dev->gran);
	if (numa < -1 || (numa >= 0 && dev->host_numa >= 0 &&
			  numa != dev->host_numa))
		return gml_set_error(-EINVAL,
			"emu: mem_create_host: no host NUMA node %d", numa);
	c = calloc(1, sizeof(*c));
	if (!c)
		return gml_set_error(-ENOMEM,
			"emu: mem_create_host: out of host memory");
	c->units = size / dev->gran;
	c->host = true;
	pthread_mutex_lock(&dev->lock);
	ret = emu_host_fd(dev);
	if (!ret && (dev->host_next + c->units) * dev->gran > ((size_t)1 << 46))
		ret = gml_set_error(-ENOMEM,
			"emu: mem_create_host: host address space used up");
	if (!ret)
		ret = emu_table_add(&dev->chunks, c, &c->id);
	if (ret) {
		pthread_mutex_unlock(&dev->lock);
		free(c);
		return ret;
	}
	c->start = dev->host_next;
	dev->host_next += c->units;
	dev->live_handles++;
	*h = c->id;
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

/* ------------------------------------------------------------------ */
/* Device                                                              */

/*
 * Every entry point of a context enters first. A child made by fork() has
 * a copy of the device without its stream workers (threads do not survive
 * fork), so a stream of the parent would never finish there, and the
 * device memory it shares with the parent is not its own: refuse, as CUDA
 * refuses a context the parent made.
 */
static int emu_enter(void *priv)
{
	struct emu_dev *dev = priv;

	if (dev->pid != getpid())
		return gml_set_error(-EIO, "emu: the device was opened by process "
				     "%ld; a child made by fork() cannot use it "
				     "(open a context in the child instead)",
				     (long)dev->pid);
	return 0;
}

static void emu_leave(void *priv)
{
	(void)priv;
}

static int emu_granularity(void *priv, size_t *gran)
{
	struct emu_dev *dev = priv;

	if (!gran)
		return gml_set_error(-EINVAL, "emu: granularity: NULL result");
	*gran = dev->gran;
	return 0;
}

static int emu_mem_info(void *priv, size_t *free_bytes, size_t *total)
{
	struct emu_dev *dev = priv;

	if (!free_bytes || !total)
		return gml_set_error(-EINVAL, "emu: mem_info: NULL result");
	pthread_mutex_lock(&dev->lock);
	*free_bytes = dev->capacity - dev->used;
	*total = dev->capacity;
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

/* Granularity and capacity from cfg, with defaults; 0 or -EINVAL. */
static int emu_sizes(const struct gmlake_config *cfg, size_t *gran,
		     size_t *cap)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE);

	*gran = cfg->emu_granularity ? cfg->emu_granularity : EMU_DEFAULT_GRAN;
	if (*gran < page || (*gran & (*gran - 1)))
		return gml_set_error(-EINVAL,
			"emu: granularity %zu is not a power of two multiple of the page size %zu",
			*gran, page);
	*cap = cfg->emu_capacity ? cfg->emu_capacity : EMU_DEFAULT_CAPACITY;
	if (*cap > (size_t)INT64_MAX)
		*cap = (size_t)INT64_MAX;
	*cap -= *cap % *gran;
	if (!*cap)
		return gml_set_error(-EINVAL,
			"emu: capacity %zu is smaller than the granularity %zu",
			cfg->emu_capacity, *gran);
	return 0;
}

/* The memfd behind device memory, one free extent over all of it. */
static int emu_open_memory(struct emu_dev *dev)
{
	struct emu_extent all = { 0, dev->capacity / dev->gran };
	int ret;

	dev->fd = memfd_create("gmlake-emu", MFD_CLOEXEC);
	if (dev->fd < 0)
		return gml_set_error(-errno, "emu: memfd_create: %s",
				     strerror(errno));
	if (ftruncate(dev->fd, (off_t)dev->capacity)) {
		ret = gml_set_error(-errno,
			"emu: cannot size device memory to %zu bytes: %s",
				    dev->capacity, strerror(errno));
		goto out_close;
	}
	ret = emu_vec_insert(&dev->extents, sizeof(all), 0, &all);
	if (ret) {
		gml_set_error(ret, "emu: open: out of host memory");
		goto out_close;
	}
	return 0;

out_close:
	close(dev->fd);
	return ret;
}

static int emu_locks_init(struct emu_dev *dev)
{
	if (pthread_mutex_init(&dev->lock, NULL))
		goto out_fail;
	if (pthread_mutex_init(&dev->ev_lock, NULL))
		goto out_destroy_lock;
	if (pthread_cond_init(&dev->ev_cond, NULL))
		goto out_destroy_ev_lock;
	return 0;

out_destroy_ev_lock:
	pthread_mutex_destroy(&dev->ev_lock);
out_destroy_lock:
	pthread_mutex_destroy(&dev->lock);
out_fail:
	return gml_set_error(-ENOMEM, "emu: open: cannot create locks");
}

static void emu_locks_destroy(struct emu_dev *dev)
{
	pthread_cond_destroy(&dev->ev_cond);
	pthread_mutex_destroy(&dev->ev_lock);
	pthread_mutex_destroy(&dev->lock);
}

static int emu_open(const struct gmlake_config *cfg, void **priv)
{
	struct emu_dev *dev;
	size_t gran, cap;
	int ret;

	if (!cfg || !priv)
		return gml_set_error(-EINVAL, "emu: open: NULL %s",
				     cfg ? "result" : "config");
	if (cfg->device < 0)
		return gml_set_error(-ENODEV, "emu: open: no device %d",
				     cfg->device);
	ret = emu_sizes(cfg, &gran, &cap);
	if (ret)
		return ret;
	dev = calloc(1, sizeof(*dev));
	if (!dev)
		return gml_set_error(-ENOMEM, "emu: open: out of host memory");
	dev->magic = EMU_MAGIC;
	dev->pid = getpid();
	dev->host_fd = -1;
	dev->host_numa = -1;
	dev->gran = gran;
	dev->capacity = cap;
	emu_table_init(&dev->chunks);
	emu_table_init(&dev->events);
	emu_table_init(&dev->streams);
	ret = emu_locks_init(dev);
	if (ret)
		goto out_free;
	ret = emu_open_memory(dev);
	if (ret)
		goto out_destroy_locks;
	ret = emu_stream_new(dev, &dev->null_stream);
	if (ret) {
		gml_set_error(ret, "emu: open: out of host memory");
		goto out_close_memory;
	}
	*priv = dev;
	return 0;

out_close_memory:
	close(dev->fd);
	emu_vec_free(&dev->extents);
out_destroy_locks:
	emu_locks_destroy(dev);
out_free:
	free(dev);
	return ret;
}

/* Stop every worker (queued work runs), then drop all objects and memory. */
static void emu_close(void *priv)
{
	struct emu_dev *dev = priv;
	struct emu_resv *r;
	uint32_t i;
	size_t j;

	if (!dev)
		return;
	for (i = 0; i < dev->streams.len; i++) {
		if (!dev->streams.slot[i].obj)
			continue;
		emu_stream_stop(dev->streams.slot[i].obj);
		emu_stream_free(dev->streams.slot[i].obj);
	}
	emu_stream_stop(dev->null_stream);
	emu_stream_free(dev->null_stream);
	for (i = 0; i < dev->events.len; i++)
		free(dev->events.slot[i].obj);
	r = dev->resvs.v;
	for (j = 0; j < dev->resvs.len; j++)
		munmap((void *)(uintptr_t)r[j].va, r[j].size);
	for (i = 0; i < dev->chunks.len; i++)
		free(dev->chunks.slot[i].obj);
	close(dev->fd);
	if (dev->host_fd >= 0)
		close(dev->host_fd);
	free(dev->streams.slot);
	free(dev->events.slot);
	free(dev->chunks.slot);
	emu_vec_free(&dev->extents);
	emu_vec_free(&dev->maps);
	emu_vec_free(&dev->resvs);
	emu_locks_destroy(dev);
	free(dev);
}

/* priv as an emulated device, or NULL when it belongs to another backend. */
static struct emu_dev *emu_dev_of(void *priv)
{
	struct emu_dev *dev = priv;

	return dev && dev->magic == EMU_MAGIC ? dev : NULL;
}

int gml_emu_info(void *priv, struct gml_emu_info *info)
{
	struct emu_dev *dev = emu_dev_of(priv);

	if (!dev)
		return gml_set_error(-EOPNOTSUPP,
			"emu_info: not an emulated device");
	if (!info)
		return gml_set_error(-EINVAL, "emu_info: NULL result");
	pthread_mutex_lock(&dev->lock);
	info->capacity = dev->capacity;
	info->used = dev->used;
	info->live_handles = dev->live_handles;
	info->live_mappings = dev->maps.len;
	info->live_reservations = dev->resvs.len;
	info->live_events = dev->events.live;
	info->live_streams = dev->streams.live;
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

int gml_emu_stream_hold(void *priv, gmlake_stream_t h, bool hold)
{
	struct emu_dev *dev = emu_dev_of(priv);
	struct emu_stream *s;

	if (!dev)
		return gml_set_error(-EOPNOTSUPP,
			"emu_stream_hold: not an emulated device");
	pthread_mutex_lock(&dev->lock);
	s = emu_stream_get(dev, h, "emu_stream_hold");
	if (s) {
		pthread_mutex_lock(&s->lock);
		s->hold = hold;
		if (!hold)
			pthread_cond_signal(&s->work);
		pthread_mutex_unlock(&s->lock);
	}
	pthread_mutex_unlock(&dev->lock);
	return s ? 0 : -EINVAL;
}

const struct gml_drv_ops gml_drv_emu = {
	.name = "emu",
	.open = emu_open,
	.close = emu_close,
	.enter = emu_enter,
	.leave = emu_leave,
	.granularity = emu_granularity,
	.mem_info = emu_mem_info,
	.mem_create = emu_mem_create,
	.mem_release = emu_mem_release,
	.va_reserve = emu_va_reserve,
	.va_free = emu_va_free,
	.mem_map = emu_mem_map,
	.mem_unmap = emu_mem_unmap,
	.set_access = emu_set_access,
	.stream_create = emu_stream_create,
	.stream_destroy = emu_stream_destroy,
	.stream_sync = emu_stream_sync,
	.event_create = emu_event_create,
	.event_destroy = emu_event_destroy,
	.event_record = emu_event_record,
	.event_query = emu_event_query,
	.event_sync = emu_event_sync,
	.memcpy_async = emu_memcpy_async,
	.stream_wait = emu_stream_wait,
	.host_func = emu_host_func,
	.host_register = emu_host_register,
	.host_unregister = emu_host_unregister,
	.host_numa = emu_host_numa,
	.mem_create_host = emu_mem_create_host,
};
