/* SPDX-License-Identifier: MIT */
/*
 * The host tier: a pinned arena on the NUMA node nearest the device.
 *
 * Pinning costs 0.2-0.5 s per GiB and synchronizes the device, so it never
 * happens on the caller's path: the arena pins one region at set-up and
 * the engine thread pins more ahead of need, in steps, until the byte
 * budget (cfg.host_limit) is spent. Regions are anonymous memory bound to
 * the node (libnuma's numa_alloc_onnode, else plain mmap) and registered
 * with the driver; blocks are carved out of them first fit, in 64 KiB
 * units, and freed ranges merge with their neighbours. A request the arena
 * cannot serve within the budget fails with -ENOMEM.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <numa.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "error.h"
#include "offload.h"

#define HOST_UNIT	((size_t)64 << 10)
#define HOST_STEP	((size_t)256 << 20)

struct host_ext {
	size_t off, len;
};

struct gml_host_region {
	char *base;
	size_t size;
	bool numa;			/* from numa_alloc_onnode */
	struct host_ext *free;		/* sorted by offset */
	size_t nfree, cap;
	struct gml_host_region *next;
};

static size_t round_unit(size_t n)
{
	return (n + HOST_UNIT - 1) & ~(HOST_UNIT - 1);
}

static void region_unmap(struct gml_host_region *r)
{
	if (r->numa)
		numa_free(r->base, r->size);
	else
		munmap(r->base, r->size);
}

/* Map, bind and pin a region of size bytes; h->lock not held. */
static int region_new(struct gml_host *h, size_t size,
		      struct gml_host_region **out)
{
	struct gml_host_region *r = calloc(1, sizeof(*r));
	int ret;

	if (!r)
		return gml_set_error(-ENOMEM, "no host memory for a region");
	r->size = size;
	r->free = malloc(sizeof(*r->free));
	if (!r->free) {
		ret = gml_set_error(-ENOMEM, "no host memory for a region");
		goto out_free;
	}
	r->cap = 1;
	if (h->node >= 0 && numa_available() >= 0) {
		r->base = numa_alloc_onnode(size, h->node);
		r->numa = r->base != NULL;
	}
	if (!r->base) {
		r->base = mmap(NULL, size, PROT_READ | PROT_WRITE,
			       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (r->base == MAP_FAILED) {
			r->base = NULL;
			ret = gml_set_error(-ENOMEM, "cannot map %zu bytes of "
					    "host memory for the arena", size);
			goto out_free;
		}
	}
	ret = gml_dev_host_register(h->dev, r->base, size);
	if (ret)
		goto out_unmap;
	r->free[0] = (struct host_ext){ 0, size };
	r->nfree = 1;
	*out = r;
	return 0;
out_unmap:
	region_unmap(r);
out_free:
	free(r->free);
	free(r);
	return ret;
}

static void region_free(struct gml_host *h, struct gml_host_region *r)
{
	if (gml_dev_host_unregister(h->dev, r->base))
		gml_log(GMLAKE_LOG_WARN, "host arena: unregister failed: %s",
			gmlake_last_error());
	region_unmap(r);
	free(r->free);
	free(r);
}

/* First fit in r; h->lock held. */
static void *region_take(struct gml_host_region *r, size_t size)
{
	for (size_t i = 0; i < r->nfree; i++) {
		struct host_ext *e = &r->free[i];
		void *p;

		if (e->len < size)
			continue;
		p = r->base + e->off;
		e->off += size;
		e->len -= size;
		if (!e->len) {
			memmove(e, e + 1, (r->nfree - i - 1) * sizeof(*e));
			r->nfree--;
		}
		return p;
	}
	return NULL;
}

/* Give [off, off+len) back to r, merging; h->lock held. 0 or -ENOMEM. */
static int region_give(struct gml_host_region *r, size_t off, size_t len)
{
	size_t i = 0;

	while (i < r->nfree && r->free[i].off < off)
		i++;
	if (i > 0 && r->free[i - 1].off + r->free[i - 1].len == off) {
		r->free[i - 1].len += len;
		if (i < r->nfree && off + len == r->free[i].off) {
			r->free[i - 1].len += r->free[i].len;
			memmove(&r->free[i], &r->free[i + 1],
				(r->nfree - i - 1) * sizeof(*r->free));
			r->nfree--;
		}
		return 0;
	}
	if (i < r->nfree && off + len == r->free[i].off) {
		r->free[i].off = off;
		r->free[i].len += len;
		return 0;
	}
	if (r->nfree == r->cap) {
		struct host_ext *grown = realloc(r->free, r->cap * 2 *
						 sizeof(*grown));

		if (!grown)
			return -ENOMEM;
		r->free = grown;
		r->cap *= 2;
	}
	memmove(&r->free[i + 1], &r->free[i], (r->nfree - i) * sizeof(*r->free));
	r->free[i] = (struct host_ext){ off, len };
	r->nfree++;
	return 0;
}

/*
 * Unpin regions with nothing in them, so that a request larger than any
 * region finds room under the limit; h->lock held, the regions go to
 * *idle for region_free() without the lock.
 */
static void drop_idle(struct gml_host *h, struct gml_host_region **idle)
{
	struct gml_host_region **pr = &h->regions, *r;

	while ((r = *pr)) {
		if (r->nfree != 1 || r->free[0].len != r->size) {
			pr = &r->next;
			continue;
		}
		*pr = r->next;
		r->next = *idle;
		*idle = r;
		h->pinned -= r->size;
		h->d_pinned -= (int64_t)r->size;
	}
}

/* Pin one more region for at least size bytes; h->lock not held. */
static int grow(struct gml_host *h, size_t size)
{
	struct gml_host_region *r = NULL, *idle = NULL, *next;
	size_t want, pinned;
	int ret;

	pthread_mutex_lock(&h->lock);
	pinned = h->pinned;	/* for the message: read under the lock */
	want = size > h->step ? size : h->step;
	if (size > h->limit - h->pinned - h->inplace)
		drop_idle(h, &idle);
	if (want > h->limit - h->pinned - h->inplace)
		want = h->limit - h->pinned - h->inplace;
	pthread_mutex_unlock(&h->lock);
	for (; idle; idle = next) {
		next = idle->next;
		region_free(h, idle);
	}
	if (want < size || !want)
		return gml_set_error(-ENOMEM, "host arena: %zu bytes would pass "
				     "the host limit of %zu bytes (%zu pinned)",
				     size, h->limit, pinned);
	ret = region_new(h, want, &r);
	if (ret)
		return ret;
	pthread_mutex_lock(&h->lock);
	if (h->pinned + h->inplace + want > h->limit) {	/* raced */
		pthread_mutex_unlock(&h->lock);
		region_free(h, r);
		return 0;
	}
	r->next = h->regions;
	h->regions = r;
	h->pinned += want;
	h->d_pinned += (int64_t)want;
	pthread_mutex_unlock(&h->lock);
	return 0;
}

int gml_host_init(struct gml_host *h, struct gml_dev *dev, int node,
		  size_t limit, size_t pin)
{
	memset(h, 0, sizeof(*h));
	if (pthread_mutex_init(&h->lock, NULL))
		return gml_set_error(-ENOMEM, "host arena: no lock");
	h->dev = dev;
	h->node = node;
	h->limit = limit & ~(HOST_UNIT - 1);
	/* Regions of a quarter of the budget at most, leaving room for
	 * larger ones and for in-place spills; one at set-up, so the first
	 * spills never wait for pinning. */
	h->step = h->limit / 4 < HOST_STEP ? (h->limit / 4) & ~(HOST_UNIT - 1) :
					     HOST_STEP;
	/* Asked for more than a step: the engine thread pins it, as one
	 * region, before it takes any request (not here: the caller holds
	 * the context lock, and pinning takes 0.2-0.5 s a GiB). Growing step
	 * by step as spills need it would make them wait, so a first large
	 * step would run with most of its blocks still on the device. */
	if (pin > h->limit) {
		gml_log(GMLAKE_LOG_WARN, "host arena: pinning the host limit of "
			"%zu bytes, not the %zu asked for", h->limit, pin);
		pin = h->limit;
	}
	if (pin > h->step) {
		h->want = round_unit(pin);
		return 0;
	}
	if (h->step && grow(h, h->step))
		gml_log(GMLAKE_LOG_WARN, "host arena: cannot pin at set-up: %s",
			gmlake_last_error());
	return 0;
}

void gml_host_prepin(struct gml_host *h)
{
	size_t want = h->want;

	h->want = 0;
	if (want && grow(h, want) && grow(h, h->step))
		gml_log(GMLAKE_LOG_WARN, "host arena: cannot pin %zu bytes at "
			"set-up: %s", want, gmlake_last_error());
}

void gml_host_fini(struct gml_host *h)
{
	struct gml_host_region *r, *next;

	for (r = h->regions; r; r = next) {
		next = r->next;
		region_free(h, r);
	}
	h->regions = NULL;
	pthread_mutex_destroy(&h->lock);
}

static void *take(struct gml_host *h, size_t size)
{
	void *p = NULL;

	pthread_mutex_lock(&h->lock);
	for (struct gml_host_region *r = h->regions; r && !p; r = r->next)
		p = region_take(r, size);
	if (p) {
		h->used += size;
		h->d_used += (int64_t)size;
	}
	pthread_mutex_unlock(&h->lock);
	return p;
}

int gml_host_alloc(struct gml_host *h, size_t size, bool may_grow, void **out)
{
	void *p;
	int ret;

	size = round_unit(size ? size : 1);
	p = take(h, size);
	if (!p && may_grow) {
		ret = grow(h, size);
		if (ret)
			return ret;
		p = take(h, size);
	}
	if (!p) {
		size_t used, pinned;

		/* The engine grows the arena under h->lock meanwhile. */
		pthread_mutex_lock(&h->lock);
		used = h->used;
		pinned = h->pinned;
		pthread_mutex_unlock(&h->lock);
		return gml_set_error(-ENOMEM, "host arena: no %zu bytes free "
				     "(%zu of %zu used, limit %zu)", size,
				     used, pinned, h->limit);
	}
	*out = p;
	return 0;
}

void gml_host_free(struct gml_host *h, void *p, size_t size)
{
	size = round_unit(size ? size : 1);
	pthread_mutex_lock(&h->lock);
	for (struct gml_host_region *r = h->regions; r; r = r->next) {
		if ((char *)p < r->base || (char *)p >= r->base + r->size)
			continue;
		if (region_give(r, (size_t)((char *)p - r->base), size))
			gml_log(GMLAKE_LOG_WARN, "host arena: losing %zu bytes "
				"(no memory to track them)", size);
		h->used -= size;
		h->d_used -= (int64_t)size;
		break;
	}
	pthread_mutex_unlock(&h->lock);
}

int gml_host_charge(struct gml_host *h, int64_t size)
{
	int ret = 0;

	pthread_mutex_lock(&h->lock);
	if (size > 0 && h->pinned + h->inplace + (size_t)size > h->limit) {
		ret = gml_set_error(-ENOMEM, "host limit of %zu bytes reached "
				    "(%zu pinned, %zu in place)", h->limit,
				    h->pinned, h->inplace);
	} else {
		h->inplace += size;
		h->d_used += size;
		h->d_pinned += size;
	}
	pthread_mutex_unlock(&h->lock);
	return ret;
}

void gml_host_grow_ahead(struct gml_host *h)
{
	bool want;

	pthread_mutex_lock(&h->lock);
	want = h->pinned - h->used < h->step / 2 &&
	       h->pinned + h->inplace + h->step / 2 <= h->limit;
	pthread_mutex_unlock(&h->lock);
	if (want && grow(h, 1))
		gml_log(GMLAKE_LOG_DEBUG, "host arena: no growth: %s",
			gmlake_last_error());
}
