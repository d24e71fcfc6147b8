/* SPDX-License-Identifier: MIT */
/*
 * Allocation history of the PyTorch entry points: one ring of events per
 * device, for memory visualizers (include/gmlake-torch.h,
 * gmlake_torch_history_start).
 *
 * Off, recording costs one relaxed load per event. On, an event takes the
 * history lock for the copy into the ring; the hooks (clock, context) run
 * before, without any lock, since a context hook may gather a Python
 * stack. Segment events come from comparing the device's snapshot ranges
 * with those seen last, and only after an operation that moved the
 * allocator's growth, release or stitching counters.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gmlake-snapshot.h"
#include "gmlake-torch.h"
#include "error.h"
#include "torch.h"
#include "types.h"

struct range_seen {
	uint64_t addr, size;
	gmlake_stream_t stream;
};

struct ring {
	struct gmlake_torch_event *ev;
	size_t cap, head, count;	/* oldest at head */
	struct range_seen *ranges;	/* last snapshot's, by address */
	size_t nranges;
	uint64_t gen;			/* counters behind those ranges */
	bool ranges_known;
};

static pthread_mutex_t hist_lock = PTHREAD_MUTEX_INITIALIZER;
static atomic_bool hist_on;
static struct ring *rings[GML_TORCH_MAX_DEVICES];
static size_t hist_max;
static uint32_t hist_skip;
static struct gmlake_torch_history_hooks hist_hooks;
/* Devices whose context existed when recording started: their ranges
 * then are the baseline, not events. */
static bool hist_baseline[GML_TORCH_MAX_DEVICES];

bool gml_history_on(void)
{
	return atomic_load_explicit(&hist_on, memory_order_relaxed);
}

GML_EXPORT bool gmlake_torch_history_enabled(void)
{
	return gml_history_on();
}

static void free_context(const struct gmlake_torch_history_hooks *h,
			 void *ctx)
{
	if (ctx && h->context_free)
		h->context_free(ctx);
}

/*
 * Contexts to free once hist_lock is dropped: freeing one may take
 * Python's lock, which a thread waiting for hist_lock may hold.
 */
struct graveyard {
	void **ctx;
	size_t n, cap;
	void (*context_free)(void *context);
};

/* hist_lock held. */
static void bury(struct graveyard *g, void *ctx)
{
	void **grown;

	if (!ctx || !hist_hooks.context_free)
		return;
	g->context_free = hist_hooks.context_free;
	if (g->n == g->cap) {
		size_t cap = g->cap ? g->cap * 2 : 16;

		grown = realloc(g->ctx, cap * sizeof(*grown));
		if (!grown)
			return;		/* leaked rather than freed locked */
		g->ctx = grown;
		g->cap = cap;
	}
	g->ctx[g->n++] = ctx;
}

/* hist_lock not held. */
static void graveyard_free(struct graveyard *g)
{
	for (size_t i = 0; i < g->n; i++)
		g->context_free(g->ctx[i]);
	free(g->ctx);
	g->ctx = NULL;
	g->n = g->cap = 0;
}

/* Drop every event of r; hist_lock held. */
static void ring_clear(struct ring *r, struct graveyard *g)
{
	for (size_t i = 0; i < r->count; i++)
		bury(g, r->ev[(r->head + i) % r->cap].context);
	r->head = r->count = 0;
}

/* Resize r to cap events, keeping the newest; hist_lock held. */
static int ring_resize(struct ring *r, size_t cap, struct graveyard *g)
{
	struct gmlake_torch_event *ev;
	size_t keep = r->count < cap ? r->count : cap;

	if (cap == r->cap)
		return 0;
	ev = calloc(cap, sizeof(*ev));
	if (!ev)
		return -ENOMEM;
	for (size_t i = 0; i < r->count; i++) {
		struct gmlake_torch_event *e = &r->ev[(r->head + i) % r->cap];

		if (i < r->count - keep)
			bury(g, e->context);
		else
			ev[i - (r->count - keep)] = *e;
	}
	free(r->ev);
	r->ev = ev;
	r->cap = cap;
	r->head = 0;
	r->count = keep;
	return 0;
}

GML_EXPORT int gmlake_torch_history_start(
	size_t max_entries, uint32_t skip_mask,
	const struct gmlake_torch_history_hooks *hooks, bool clear)
{
	struct graveyard g = { 0 };
	int ret = 0;

	if (!max_entries)
		return gml_set_error(-EINVAL, "gmlake_torch_history_start: "
				     "max_entries is 0");
	pthread_mutex_lock(&hist_lock);
	for (int d = 0; d < GML_TORCH_MAX_DEVICES && !ret; d++) {
		if (!rings[d])
			continue;
		if (clear)
			ring_clear(rings[d], &g);
		ret = ring_resize(rings[d], max_entries, &g);
	}
	if (hooks)
		hist_hooks = *hooks;
	else
		memset(&hist_hooks, 0, sizeof(hist_hooks));
	hist_max = max_entries;
	hist_skip = skip_mask;
	for (int d = 0; d < GML_TORCH_MAX_DEVICES; d++)
		hist_baseline[d] = gml_torch_ctx_peek(d) != NULL;
	if (!ret)
		atomic_store(&hist_on, true);
	pthread_mutex_unlock(&hist_lock);
	graveyard_free(&g);
	if (ret)
		return gml_set_error(ret, "history: no host memory for %zu "
				     "events", max_entries);
	for (int d = 0; d < GML_TORCH_MAX_DEVICES; d++)
		if (hist_baseline[d])
			gml_history_segments(d, gml_torch_ctx_peek(d));
	return 0;
}

GML_EXPORT void gmlake_torch_history_stop(bool clear)
{
	struct graveyard g = { 0 };

	pthread_mutex_lock(&hist_lock);
	atomic_store(&hist_on, false);
	for (int d = 0; clear && d < GML_TORCH_MAX_DEVICES; d++) {
		if (!rings[d])
			continue;
		ring_clear(rings[d], &g);
		free(rings[d]->ranges);
		rings[d]->ranges = NULL;
		rings[d]->nranges = 0;
		rings[d]->ranges_known = false;
	}
	pthread_mutex_unlock(&hist_lock);
	graveyard_free(&g);
}

/* device's ring, made on first use; hist_lock held. NULL without memory. */
static struct ring *ring_get(int device)
{
	struct ring *r = rings[device];

	if (r)
		return r;
	r = calloc(1, sizeof(*r));
	if (!r)
		return NULL;
	r->ev = calloc(hist_max, sizeof(*r->ev));
	if (!r->ev) {
		free(r);
		return NULL;
	}
	r->cap = hist_max;
	rings[device] = r;
	return r;
}

static uint64_t clock_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

void gml_history_add(int device, int action, uint64_t addr, uint64_t size,
		     gmlake_stream_t stream, uint64_t id0, uint64_t id1)
{
	struct gmlake_torch_history_hooks h;
	struct gmlake_torch_event e = {
		.action = (uint32_t)action, .device = device, .addr = addr,
		.size = size, .stream = stream, .pool_id = { id0, id1 },
	};
	void (*free_old)(void *context);
	void *old = NULL;
	struct ring *r;

	if (!gml_history_on() || device < 0 ||
	    device >= GML_TORCH_MAX_DEVICES)
		return;
	pthread_mutex_lock(&hist_lock);
	h = hist_hooks;
	if (hist_skip & (1u << action)) {
		pthread_mutex_unlock(&hist_lock);
		return;
	}
	pthread_mutex_unlock(&hist_lock);
	e.time = h.clock ? h.clock() : clock_ns();
	e.context = h.context ? h.context(action) : NULL;
	pthread_mutex_lock(&hist_lock);
	r = atomic_load(&hist_on) ? ring_get(device) : NULL;
	if (!r) {
		pthread_mutex_unlock(&hist_lock);
		free_context(&h, e.context);
		return;
	}
	if (r->count == r->cap) {
		old = r->ev[r->head].context;
		r->ev[r->head] = e;
		r->head = (r->head + 1) % r->cap;
	} else {
		r->ev[(r->head + r->count) % r->cap] = e;
		r->count++;
	}
	free_old = hist_hooks.context_free;
	pthread_mutex_unlock(&hist_lock);
	if (old && free_old)
		free_old(old);
}

GML_EXPORT void gmlake_torch_history_mark(int device)
{
	gml_history_add(device, GMLAKE_TORCH_SNAPSHOT, 0, 0, NULL, 0, 0);
}

GML_EXPORT int gmlake_torch_history_read(int device,
					 struct gmlake_torch_event *ev,
					 size_t n)
{
	struct ring *r;
	size_t count;

	if (device < 0 || device >= GML_TORCH_MAX_DEVICES)
		return gml_set_error(-EINVAL, "history: device %d out of "
				     "range", device);
	pthread_mutex_lock(&hist_lock);
	r = rings[device];
	count = r ? r->count : 0;
	if (ev) {
		if (count > n)
			count = n;
		for (size_t i = 0; i < count; i++) {
			ev[i] = r->ev[(r->head + i) % r->cap];
			if (ev[i].context)
				ev[i].context = hist_hooks.context_dup ?
					hist_hooks.context_dup(ev[i].context) :
					NULL;
		}
	}
	pthread_mutex_unlock(&hist_lock);
	return count > INT32_MAX ? INT32_MAX : (int)count;
}

/* What moves when ranges may have come or gone; ctx->lock not held. */
static uint64_t range_gen(gmlake_ctx *ctx)
{
	uint64_t gen;

	pthread_mutex_lock(&ctx->lock);
	gen = ctx->st.grows + ctx->st.releases + ctx->st.stitches +
	      ctx->st.evictions + ctx->st.stitch_repairs + ctx->st.spills +
	      ctx->st.fetches;
	pthread_mutex_unlock(&ctx->lock);
	return gen;
}

static int seen_cmp(const void *x, const void *y)
{
	const struct range_seen *a = x, *b = y;

	if (a->addr != b->addr)
		return a->addr < b->addr ? -1 : 1;
	return a->size < b->size ? -1 : a->size > b->size;
}

/* The ranges of snap as range_seen, by address; NULL without memory. */
static struct range_seen *seen_of(const struct gmlake_snapshot *snap)
{
	struct range_seen *s = calloc(snap->nranges + 1, sizeof(*s));

	if (!s)
		return NULL;
	for (size_t i = 0; i < snap->nranges; i++)
		s[i] = (struct range_seen){ snap->ranges[i].address,
					    snap->ranges[i].size,
					    snap->ranges[i].stream };
	qsort(s, snap->nranges, sizeof(*s), seen_cmp);
	return s;
}

/* Whether [a, a + n) and [b, b + m) share a byte. */
static bool overlap(uint64_t a, uint64_t n, uint64_t b, uint64_t m)
{
	return a < b + m && b < a + n;
}

/*
 * The parts of each range of from that no range of by covers, as events:
 * whole ranges as whole_action, parts of covered ones as part_action.
 * Both lists are sorted by address and hold disjoint ranges.
 */
static void emit_uncovered(int device, const struct range_seen *from,
			   size_t nfrom, const struct range_seen *by,
			   size_t nby, int whole_action, int part_action)
{
	size_t j = 0;

	for (size_t i = 0; i < nfrom; i++) {
		uint64_t pos = from[i].addr, end = from[i].addr + from[i].size;
		bool touched = false;

		while (j < nby && by[j].addr + by[j].size <= pos)
			j++;
		for (size_t k = j; k < nby && by[k].addr < end; k++) {
			if (!overlap(pos, end - pos, by[k].addr, by[k].size))
				continue;
			touched = true;
			if (by[k].addr > pos)
				gml_history_add(device, part_action, pos,
						by[k].addr - pos,
						from[i].stream, 0, 0);
			pos = by[k].addr + by[k].size;
			if (pos >= end)
				break;
		}
		if (!touched)
			gml_history_add(device, whole_action, from[i].addr,
					from[i].size, from[i].stream, 0, 0);
		else if (pos < end)
			gml_history_add(device, part_action, pos, end - pos,
					from[i].stream, 0, 0);
	}
}

/*
 * The segment events from old ranges to new ones: ranges that went
 * (SEGMENT_FREE) or shrank (SEGMENT_UNMAP of the part), then ranges that
 * came (SEGMENT_ALLOC) or grew, as segments grow at their end
 * (SEGMENT_MAP of the part), as PyTorch's expandable segments report.
 */
static void emit_diff(int device, const struct range_seen *old, size_t nold,
		      const struct range_seen *cur, size_t ncur)
{
	emit_uncovered(device, old, nold, cur, ncur,
		       GMLAKE_TORCH_SEGMENT_FREE, GMLAKE_TORCH_SEGMENT_UNMAP);
	emit_uncovered(device, cur, ncur, old, nold,
		       GMLAKE_TORCH_SEGMENT_ALLOC, GMLAKE_TORCH_SEGMENT_MAP);
}

void gml_history_segments(int device, gmlake_ctx *ctx)
{
	struct range_seen *old, *cur;
	struct gmlake_snapshot *snap;
	size_t nold, ncur;
	uint64_t gen;
	struct ring *r;

	if (!gml_history_on() || !ctx)
		return;
	gen = range_gen(ctx);
	pthread_mutex_lock(&hist_lock);
	r = ring_get(device);
	if (!r || (r->ranges_known && r->gen == gen)) {
		pthread_mutex_unlock(&hist_lock);
		return;
	}
	pthread_mutex_unlock(&hist_lock);
	if (gmlake_snapshot_take(ctx, &snap))
		return;
	cur = seen_of(snap);
	ncur = snap->nranges;
	gmlake_snapshot_free(snap);
	if (!cur)
		return;
	pthread_mutex_lock(&hist_lock);
	old = r->ranges;
	nold = r->nranges;
	r->ranges = cur;
	r->nranges = ncur;
	r->gen = gen;
	if (!r->ranges_known) {
		r->ranges_known = true;
		if (hist_baseline[device]) {
			/* The ranges when recording started. */
			pthread_mutex_unlock(&hist_lock);
			free(old);
			return;
		}
		nold = 0;	/* a context made since: it had none */
	}
	pthread_mutex_unlock(&hist_lock);
	emit_diff(device, old, nold, cur, ncur);
	free(old);
}

void gml_history_reset(void)
{
	gmlake_torch_history_stop(true);
	pthread_mutex_lock(&hist_lock);
	for (int d = 0; d < GML_TORCH_MAX_DEVICES; d++) {
		if (!rings[d])
			continue;
		free(rings[d]->ev);
		free(rings[d]->ranges);
		free(rings[d]);
		rings[d] = NULL;
	}
	pthread_mutex_unlock(&hist_lock);
}
