/* SPDX-License-Identifier: MIT */
/*
 * The free-run index and the fits. A segment keeps its free runs by
 * position and updates them in place as its chunks change; a stitched
 * view keeps them by length and finds them again when next asked. First
 * fit goes over segments, best fit over cached stitched views.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "large.h"
#include "types.h"

bool gml_usable(gmlake_ctx *ctx, const struct gml_chunk *c, int stream)
{
	if (!c || c->owner || (c->slab_len && gml_slab_avoid(ctx)))
		return false;
	if (gml_guard_ready_scan(ctx, &c->guard, stream))
		return true;
	ctx->st.cross_stream_waits++;
	return false;
}

/* Whether every free chunk is usable for the request now (one stream, no
 * slab to avoid), so that a free run needs no scan. */
static bool every_free_usable(const gmlake_ctx *ctx)
{
	return ctx->nstreams == 1 && !gml_slab_avoid(ctx);
}

static int free_run_cmp(const void *a, const void *b)
{
	const struct gml_free_run *x = a, *y = b;

	if (x->len != y->len)
		return x->len < y->len ? -1 : 1;
	return x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* Find v's free runs again after a change; false without host memory. */
static bool view_runs(struct gml_view *v)
{
	uint32_t len = 0;

	v->nruns = 0;
	for (uint32_t i = 0; i <= v->n; i++) {
		const struct gml_chunk *c = i < v->n ? v->chunks[i] : NULL;

		if (c && !c->owner && v->mapped[i]) {
			len++;
			continue;
		}
		if (!len)
			continue;
		if (v->nruns == v->cap_runs) {
			uint32_t cap = v->cap_runs ? v->cap_runs * 2 : 4;
			struct gml_free_run *runs;

			runs = realloc(v->runs, cap * sizeof(*runs));
			if (!runs)
				return false;
			v->runs = runs;
			v->cap_runs = cap;
		}
		v->runs[v->nruns++] = (struct gml_free_run){ i - len, len };
		len = 0;
	}
	v->maxfree = 0;
	for (uint32_t k = 0; k < v->nruns; k++)
		if (v->runs[k].len > v->maxfree)
			v->maxfree = v->runs[k].len;
	/* Segments keep their runs by position (first fit, and the
	 * updates below); stitched views by length (best fit). */
	if (v->stitched && v->nruns > 1)
		qsort(v->runs, v->nruns, sizeof(*v->runs), free_run_cmp);
	return true;
}

static bool position_free(const struct gml_view *v, uint32_t i)
{
	const struct gml_chunk *c = v->chunks[i];

	return c && !c->owner && v->mapped[i];
}

/* Room for one more run in v; false without host memory. */
static bool runs_reserve(struct gml_view *v)
{
	struct gml_free_run *runs;
	uint32_t cap;

	if (v->nruns < v->cap_runs)
		return true;
	cap = v->cap_runs ? v->cap_runs * 2 : 4;
	runs = realloc(v->runs, cap * sizeof(*runs));
	if (!runs)
		return false;
	v->runs = runs;
	v->cap_runs = cap;
	return true;
}

static void runs_insert(struct gml_view *v, uint32_t k, uint32_t pos,
			uint32_t len)
{
	memmove(&v->runs[k + 1], &v->runs[k],
		(v->nruns - k) * sizeof(*v->runs));
	v->runs[k] = (struct gml_free_run){ pos, len };
	v->nruns++;
}

static void runs_remove(struct gml_view *v, uint32_t k)
{
	memmove(&v->runs[k], &v->runs[k + 1],
		(v->nruns - k - 1) * sizeof(*v->runs));
	v->nruns--;
}

/* The first run of v ending at or after position i. */
static uint32_t run_at(const struct gml_view *v, uint32_t i)
{
	uint32_t lo = 0, hi = v->nruns;

	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (v->runs[mid].pos + v->runs[mid].len < i)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

/*
 * Positions [p, p + n) of segment v, each its own chunk's home, all
 * became taken (inside one free run) or all free (next to no run): update
 * its runs (by position) in place, without the whole scan view_runs
 * makes: a segment grown to the size of the device has tens of thousands
 * of positions, and every allocation and free changes some. maxfree
 * stays an upper bound when a run shrinks (the fit that finds no run
 * that long sets it right). False when the change is not of that shape
 * (nothing changed; for one position: its runs were right already).
 */
static bool seg_run_changed(struct gml_view *v, uint32_t p, uint32_t n,
			    bool taken)
{
	uint32_t k = run_at(v, p), end;
	struct gml_free_run *r = k < v->nruns ? &v->runs[k] : NULL;
	bool left, right;

	if (taken) {
		if (!r || r->pos > p || r->pos + r->len < p + n)
			return false;
		end = r->pos + r->len;
		if (r->pos < p && p + n < end) {
			if (!runs_reserve(v)) {
				v->maxfree = GML_RUN_UNKNOWN;
				return true;
			}
			r = &v->runs[k];
			r->len = p - r->pos;
			runs_insert(v, k + 1, p + n, end - p - n);
		} else if (r->pos < p) {
			r->len = p - r->pos;
		} else if (p + n < end) {
			r->pos = p + n;
			r->len = end - p - n;
		} else {
			runs_remove(v, k);
		}
		return true;
	}
	for (uint32_t i = p; i < p + n; i++)
		if (!position_free(v, i))
			return false;
	left = r && r->pos + r->len == p;
	if (r && !left && r->pos < p + n)
		return false;		/* a run overlaps: not of that shape */
	right = k + left < v->nruns && v->runs[k + left].pos == p + n;
	if (left && right) {
		r->len += n + v->runs[k + 1].len;
		runs_remove(v, k + 1);
	} else if (left) {
		r->len += n;
	} else if (right) {
		v->runs[k].pos = p;
		v->runs[k].len += n;
	} else {
		if (!runs_reserve(v)) {
			v->maxfree = GML_RUN_UNKNOWN;
			return true;
		}
		runs_insert(v, k, p, n);
	}
	r = &v->runs[k];
	if (r->len > v->maxfree)
		v->maxfree = r->len;
	return true;
}

/* Position i of segment v may have become free or taken. */
static void seg_position_changed(struct gml_view *v, uint32_t i)
{
	if (v->maxfree != GML_RUN_UNKNOWN)
		seg_run_changed(v, i, 1, !position_free(v, i));
}

/*
 * A chunk changed owner or mapping (called after the change): its
 * segment's runs follow at once; a stitched view mapping it finds its
 * runs again when next asked. The fits skip views whose known longest
 * run is too short, which keeps allocation from scanning every chunk of
 * every segment.
 */
void gml_chunk_touch(struct gml_chunk *c)
{
	seg_position_changed(c->seg, c->seg_pos);
	for (uint32_t i = 0; i < c->nviews; i++)
		c->views[i]->maxfree = GML_RUN_UNKNOWN;
}

/*
 * Positions [p, p + n) of v (a block's run) all changed owner, to taken
 * or to free: gml_chunk_touch for each, in one update of the segment's
 * runs where v is their segment.
 */
void gml_run_touch(struct gml_view *v, uint32_t p, uint32_t n, bool taken)
{
	bool home = !v->stitched && v->maxfree != GML_RUN_UNKNOWN;

	for (uint32_t i = 0; home && i < n; i++) {
		const struct gml_chunk *c = v->chunks[p + i];

		home = c->seg == v && c->seg_pos == p + i;
	}
	if (home && seg_run_changed(v, p, n, taken)) {
		for (uint32_t i = 0; i < n; i++) {
			const struct gml_chunk *c = v->chunks[p + i];

			for (uint32_t j = 0; j < c->nviews; j++)
				c->views[j]->maxfree = GML_RUN_UNKNOWN;
		}
		return;
	}
	for (uint32_t i = 0; i < n; i++)
		gml_chunk_touch(v->chunks[p + i]);
}

/*
 * Whether v's free runs are known (found again after a change) and the
 * longest holds n. Without host memory to list them v is skipped this
 * time, its runs still unknown.
 */
static bool view_may_fit(struct gml_view *v, uint32_t n)
{
	if (v->maxfree == GML_RUN_UNKNOWN && !view_runs(v))
		return false;
	return v->maxfree >= n;
}

/*
 * Smallest usable run of at least n positions inside the free run r of v,
 * lowest position first, into *found.
 */
static void run_best_fit(gmlake_ctx *ctx, struct gml_view *v,
			 const struct gml_free_run *r, uint32_t n, int stream,
			 struct run *found)
{
	uint32_t start = r->pos, len = 0;

	for (uint32_t i = r->pos; i <= r->pos + r->len; i++) {
		if (i < r->pos + r->len && gml_usable(ctx, v->chunks[i], stream)) {
			if (!len++)
				start = i;
			continue;
		}
		if (len >= n && (!found->view || len < found->len ||
				 (len == found->len && start < found->pos))) {
			found->view = v;
			found->pos = start;
			found->len = len;
		}
		len = 0;
	}
}

/*
 * Smallest usable run of at least n positions in v, into *best (which a
 * run of another view keeps on a tie). Every usable run lies inside one
 * free run; with one stream every free chunk is usable, so the first
 * sorted free run long enough is the answer. With several streams a free
 * chunk may still wait for another stream's work, and a long-lived
 * request under a tier avoids slabs: each long enough free run is
 * searched then.
 */
static void view_best_fit(gmlake_ctx *ctx, struct gml_view *v, uint32_t n,
			  int stream, struct run *best)
{
	struct run found = { 0 };
	uint32_t lo = 0, hi;

	if (!view_may_fit(v, n))
		return;
	hi = v->nruns;
	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (v->runs[mid].len < n)
			lo = mid + 1;
		else
			hi = mid;
	}
	for (uint32_t k = lo; k < v->nruns; k++) {
		if (every_free_usable(ctx)) {
			found = (struct run){ v, v->runs[k].pos, v->runs[k].len };
			break;
		}
		run_best_fit(ctx, v, &v->runs[k], n, stream, &found);
		if (found.view && found.len == n)
			break;
	}
	if (found.view && (!best->view || found.len < best->len))
		*best = found;
}

/*
 * First usable run of at least n positions in segment v, lowest position
 * first, into *found. Every usable run lies inside one free run.
 */
static void view_first_fit(gmlake_ctx *ctx, struct gml_view *v, uint32_t n,
			   int stream, struct run *found)
{
	uint32_t longest = 0;

	memset(found, 0, sizeof(*found));
	if (!view_may_fit(v, n))
		return;
	for (uint32_t k = 0; k < v->nruns; k++) {
		const struct gml_free_run *r = &v->runs[k];
		uint32_t start = r->pos, len = 0;

		if (r->len > longest)
			longest = r->len;
		if (r->len < n)
			continue;
		if (every_free_usable(ctx)) {
			*found = (struct run){ v, r->pos, r->len };
			return;
		}
		for (uint32_t i = r->pos; i < r->pos + r->len; i++) {
			if (!gml_usable(ctx, v->chunks[i], stream)) {
				len = 0;
				continue;
			}
			if (!len++)
				start = i;
			if (len == n) {
				*found = (struct run){ v, start, r->len };
				return;
			}
		}
	}
	v->maxfree = longest;	/* exact again: every run was seen */
}

/*
 * The usable window of n positions highest in segment v, at the top end
 * of its free run, into *found.
 */
static void view_top_fit(gmlake_ctx *ctx, struct gml_view *v, uint32_t n,
			 int stream, struct run *found)
{
	memset(found, 0, sizeof(*found));
	if (!view_may_fit(v, n))
		return;
	for (uint32_t k = v->nruns; k-- > 0;) {
		const struct gml_free_run *r = &v->runs[k];
		uint32_t len = 0;

		if (r->len < n)
			continue;
		if (every_free_usable(ctx)) {
			*found = (struct run){ v, r->pos + r->len - n, r->len };
			return;
		}
		for (uint32_t i = r->pos + r->len; i-- > r->pos;) {
			if (!gml_usable(ctx, v->chunks[i], stream)) {
				len = 0;
				continue;
			}
			if (++len == n) {
				*found = (struct run){ v, i, r->len };
				return;
			}
		}
	}
}

/*
 * Whether a request of n chunks takes the top of its free run (step 1):
 * at least cfg.top_fit bytes, or by default (GMLAKE_TOP_FIT_AUTO) a
 * quarter of the most the live blocks ever requested at once (not the
 * stats' peak, which gmlake_stats_reset_peaks lowers). A block
 * that large shapes the layout of everything else: from the top, the
 * small blocks of one step do not land where it was in the last, which
 * it would have to stitch. On the replayed GraphSAGE trace, whose
 * message tensor is 20-65% of the peak, the second half's driver time
 * fell from 2.77% to 1.37%; any share from a half to a fifth gave the
 * same on every trace, where an eighth made FSDP's worse. A fixed size
 * hit blocks that were not large for their workload: 48 MiB made the
 * GraphSAGE bench 15% slower on an H200, 512 MiB cost FSDP's trace a
 * stitch.
 */
static bool top_fit_wanted(const gmlake_ctx *ctx, uint32_t n)
{
	uint64_t bytes = (uint64_t)n * ctx->chunk;

	if (ctx->cfg.top_fit == GMLAKE_TOP_FIT_AUTO)
		return bytes >= (uint64_t)ctx->requested_top / 4;
	return ctx->cfg.top_fit && bytes >= (uint64_t)ctx->cfg.top_fit;
}

/*
 * Step 1: the oldest segment with a usable run of n, its lowest one
 * (ctx->segs is in creation order); a large request (top_fit_wanted)
 * takes the newest segment's highest run instead, its top end, so that
 * large and small blocks fill memory from opposite ends.
 */
bool gml_first_fit(gmlake_ctx *ctx, uint32_t n, int stream,
		   struct run *first)
{
	if (top_fit_wanted(ctx, n)) {
		for (struct gml_view *v = gml_list_last(ctx->segs); v;
		     v = v->prev) {
			if (v->n < n)
				continue;
			view_top_fit(ctx, v, n, stream, first);
			if (first->view)
				return true;
		}
		return false;
	}
	for (struct gml_view *v = ctx->segs; v; v = v->next) {
		if (v->n < n)
			continue;
		view_first_fit(ctx, v, n, stream, first);
		if (first->view)
			return true;
	}
	return false;
}

bool gml_best_fit(gmlake_ctx *ctx, struct gml_view *list, uint32_t n,
		  int stream, struct run *best)
{
	memset(best, 0, sizeof(*best));
	for (struct gml_view *v = list; v; v = v->next) {
		if (v->n < n || !v->mapped)
			continue;
		view_best_fit(ctx, v, n, stream, best);
		if (best->view && best->len == n)
			break;
	}
	return best->view != NULL;
}

/*
 * Step 1 for a packed request (pack.c) of size bytes: the oldest segment's
 * lowest free run, every position of it usable, where the request fits
 * with the free top of the chunk below and the free bottom of the chunk
 * above. Requests top fit wants go to gml_first_fit.
 */
bool gml_pack_first_fit(gmlake_ctx *ctx, size_t size, int stream,
			struct run *r, uint32_t *off)
{
	uint32_t n = (uint32_t)((size + ctx->chunk - 1) >> ctx->chunk_shift);
	uint32_t need = n > 2 ? n - 2 : 1;	/* two shared ends at most */
	bool scan = !every_free_usable(ctx);

	if (top_fit_wanted(ctx, n))
		return false;
	for (struct gml_view *v = ctx->segs; v; v = v->next) {
		if (v->n < need || !view_may_fit(v, need))
			continue;
		for (uint32_t k = 0; k < v->nruns; k++) {
			const struct gml_free_run *fr = &v->runs[k];
			bool usable = true;

			if (fr->len < need)
				continue;
			for (uint32_t i = fr->pos; scan && usable &&
			     i < fr->pos + fr->len; i++)
				usable = gml_usable(ctx, v->chunks[i], stream);
			if (usable && gml_pack_place(ctx, v, fr->pos, fr->len,
						     size, stream, false, NULL,
						     r, off))
				return true;
		}
	}
	return false;
}
