/* SPDX-License-Identifier: MIT */
/*
 * The emulated device's memory (drv_emu.c says how it works): the tables
 * that hand out handles, device memory as extents of one memfd, virtual
 * reservations and the mappings in them, and host memory for in-place
 * mappings.
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
#include <sys/stat.h>
#include <unistd.h>

#include "drv.h"
#include "drv.h"
#include "drv_emu.h"
#include "error.h"

/* ------------------------------------------------------------------ */
/* Tables and sorted arrays                                           */

void gml_emu_table_init(struct emu_table *t)
{
	memset(t, 0, sizeof(*t));
	t->free_head = EMU_NO_SLOT;
}

/* Put obj in a free slot and return its id. */
int gml_emu_table_add(struct emu_table *t, void *obj, uint64_t *id)
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
void *gml_emu_table_get(const struct emu_table *t, uint64_t id)
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
void gml_emu_table_del(struct emu_table *t, uint64_t id)
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
int gml_emu_vec_insert(struct emu_vec *a, size_t elsz, size_t at,
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

void gml_emu_vec_free(struct emu_vec *a)
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
		gml_emu_vec_insert(&dev->extents, sizeof(*e), next, &add);
	}
}

/* The descriptor and offset a chunk's memory lies at. */
static int emu_chunk_fd(const struct emu_dev *dev, const struct emu_chunk *c,
			off_t *off)
{
	if (c->imported) {
		*off = (off_t)c->import_off;
		return c->import_fd;
	}
	*off = (off_t)(c->start * dev->gran);
	return c->host ? dev->host_fd : dev->fd;
}

/* The chunk's memory goes back: hole punched, extent freed, id dead (an
 * import: its descriptor closed). */
static void emu_chunk_free(struct emu_dev *dev, struct emu_chunk *c)
{
	size_t off = c->start * dev->gran;
	size_t len = c->units * dev->gran;

	/* Another process's memory: only our descriptor of it goes. */
	if (c->imported) {
		close(c->import_fd);
		gml_emu_table_del(&dev->chunks, c->id);
		free(c);
		return;
	}
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
	gml_emu_table_del(&dev->chunks, c->id);
	free(c);
}

int gml_emu_mem_create(void *priv, size_t size, gml_handle *h)
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
	ret = gml_emu_table_add(&dev->chunks, c, &c->id);
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
	struct emu_chunk *c = gml_emu_table_get(&dev->chunks, h);

	if (!c)
		gml_set_error(-EINVAL, "emu: %s: unknown handle %#llx", op,
			      (unsigned long long)h);
	else if (c->released)
		gml_set_error(-EINVAL, "emu: %s: handle %#llx was released",
			      op, (unsigned long long)h);
	return c && !c->released ? c : NULL;
}

/* Like cuMemRelease: the memory goes once the last mapping of it goes. */
int gml_emu_mem_release(void *priv, gml_handle h)
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

int gml_emu_va_reserve(void *priv, size_t size, size_t align, gml_va *va)
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
	ret = gml_emu_vec_insert(&dev->resvs, sizeof(r),
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

int gml_emu_va_free(void *priv, gml_va va, size_t size)
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

int gml_emu_mem_map(void *priv, gml_va va, size_t size, gml_handle h)
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
	m = (struct emu_map){ .va = va, .size = size, .chunk = c };
	ret = gml_emu_vec_insert(&dev->maps, sizeof(m), at, &m);
	if (ret) {
		gml_set_error(ret, "emu: mem_map: out of host memory");
		goto out_unlock;
	}
	{
		off_t off;
		int fd = emu_chunk_fd(dev, c, &off);

		p = mmap((void *)(uintptr_t)va, size, PROT_NONE,
			 MAP_SHARED | MAP_FIXED, fd, off);
	}
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

int gml_emu_mem_unmap(void *priv, gml_va va, size_t size)
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

/* Read-write over whole mappings that cover [va, va+size) without a gap;
 * the peers are recorded (one address space serves every ordinal). */
int gml_emu_set_access(void *priv, gml_va va, size_t size, const int *peers,
		       int npeers)
{
	struct emu_dev *dev = priv;
	struct emu_map *m;
	size_t first = 0, i;
	gml_va end = va + size;
	int ret = 0;

	for (int k = 0; k < npeers; k++)
		if (peers[k] < 0 || peers[k] >= EMU_DEVICES ||
		    peers[k] == dev->ordinal)
			return gml_set_error(-EINVAL, "emu: set_access: bad "
					     "peer %d", peers[k]);
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
	for (i = first; i < dev->maps.len && m[i].va < end; i++) {
		m[i].access = true;
		for (int k = 0; k < npeers; k++)
			m[i].peers[peers[k] / 64] |= 1ull << (peers[k] % 64);
	}
out_unlock:
	pthread_mutex_unlock(&dev->lock);
	return ret;
}

int gml_emu_peer_check(void *priv, int peer)
{
	const struct emu_dev *dev = priv;

	if (peer < 0 || peer >= EMU_DEVICES || peer == dev->ordinal)
		return gml_set_error(-EINVAL, "emu: device %d cannot be a peer "
				     "of device %d (ordinals 0-%d)", peer,
				     dev->ordinal, EMU_DEVICES - 1);
	return 0;
}

bool gml_emu_peer_has_access(void *priv, gml_va va, size_t size, int peer)
{
	struct emu_dev *dev = priv;
	struct emu_map *m;
	size_t first = 0, i;
	gml_va end = va + size;
	bool ok;

	if (peer < 0 || peer >= EMU_DEVICES)
		return false;
	pthread_mutex_lock(&dev->lock);
	m = dev->maps.v;
	ok = size && emu_maps_reach(dev, va, end, true, &first) >= end;
	for (i = first; ok && i < dev->maps.len && m[i].va < end; i++)
		ok = m[i].peers[peer / 64] & (1ull << (peer % 64));
	pthread_mutex_unlock(&dev->lock);
	return ok;
}

/* Whether [p, p+size) is mapped and accessible on this device. */
bool gml_emu_dev_range_ok(struct emu_dev *dev, const void *p, size_t size)
{
	gml_va va = (uintptr_t)p;
	size_t first;

	if (va + size < va)
		return false;
	return emu_maps_reach(dev, va, va + size, true, &first) >= va + size;
}

/* Host memory needs no pinning here; the arguments are still checked. */
int gml_emu_host_register(void *priv, void *p, size_t size)
{
	(void)priv;
	if (!p || !size)
		return gml_set_error(-EINVAL,
			"emu: host_register: empty range %p +%zu", p, size);
	return 0;
}

int gml_emu_host_unregister(void *priv, void *p)
{
	(void)priv;
	if (!p)
		return gml_set_error(-EINVAL, "emu: host_unregister: NULL");
	return 0;
}

int gml_emu_host_numa(void *priv, int *node)
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
int gml_emu_mem_create_host(void *priv, size_t size, int numa,
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
		ret = gml_emu_table_add(&dev->chunks, c, &c->id);
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
/* Sharing with other processes                                        */

/*
 * Like cuMemExportToShareableHandle: a descriptor of the device memfd
 * (the chunk's own one, for an import) and where the chunk lies in it. A
 * real driver's descriptor names one allocation; the emulated device has
 * one file, hence the offset.
 */
int gml_emu_mem_export(void *priv, gml_handle h, int *fd, uint64_t *off)
{
	struct emu_dev *dev = priv;
	struct emu_chunk *c;
	off_t at = 0;
	int got, ret = 0;

	if (!fd || !off)
		return gml_set_error(-EINVAL, "emu: mem_export: NULL argument");
	pthread_mutex_lock(&dev->lock);
	c = emu_chunk_get(dev, h, "mem_export");
	if (!c)
		ret = -EINVAL;
	else if (c->host)
		ret = gml_set_error(-EOPNOTSUPP, "emu: mem_export: handle "
				    "%#llx is host memory",
				    (unsigned long long)h);
	else if (!dev->exportable)
		ret = gml_set_error(-EOPNOTSUPP, "emu: mem_export: the device "
				    "makes unexportable memory (GMLAKE_EXPORTABLE "
				    "is off)");
	if (!ret) {
		got = fcntl(emu_chunk_fd(dev, c, &at), F_DUPFD_CLOEXEC, 0);
		if (got < 0)
			ret = gml_set_error(-errno, "emu: mem_export: %s",
					    strerror(errno));
		else {
			*fd = got;
			*off = (uint64_t)at;
		}
	}
	pthread_mutex_unlock(&dev->lock);
	return ret;
}

/* Like cuMemImportFromShareableHandle; the chunk keeps a descriptor of
 * its own, so the caller may close fd. */
int gml_emu_mem_import(void *priv, int fd, uint64_t off, size_t size,
		       gml_handle *h)
{
	struct emu_dev *dev = priv;
	struct emu_chunk *c;
	struct stat st;
	int ret;

	if (!h || fd < 0)
		return gml_set_error(-EINVAL, "emu: mem_import: %s",
				     h ? "bad descriptor" : "NULL handle");
	if (!size || size % dev->gran || off % dev->gran)
		return gml_set_error(-EINVAL, "emu: mem_import: size %zu or "
				     "offset %llu is not a multiple of the "
				     "granularity %zu", size,
				     (unsigned long long)off, dev->gran);
	if (fstat(fd, &st))
		return gml_set_error(-errno, "emu: mem_import: %s",
				     strerror(errno));
	if (!S_ISREG(st.st_mode) || off + size > (uint64_t)st.st_size ||
	    off + size < off)
		return gml_set_error(-EINVAL, "emu: mem_import: descriptor %d "
				     "holds no %zu bytes at %llu", fd, size,
				     (unsigned long long)off);
	c = calloc(1, sizeof(*c));
	if (!c)
		return gml_set_error(-ENOMEM, "emu: mem_import: out of host "
				     "memory");
	c->units = size / dev->gran;
	c->imported = true;
	c->import_off = off;
	c->import_fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (c->import_fd < 0) {
		ret = gml_set_error(-errno, "emu: mem_import: %s",
				    strerror(errno));
		free(c);
		return ret;
	}
	pthread_mutex_lock(&dev->lock);
	ret = gml_emu_table_add(&dev->chunks, c, &c->id);
	if (!ret) {
		dev->live_handles++;
		*h = c->id;
	}
	pthread_mutex_unlock(&dev->lock);
	if (ret) {
		close(c->import_fd);
		free(c);
		return gml_set_error(ret, "emu: mem_import: out of host memory");
	}
	return 0;
}
