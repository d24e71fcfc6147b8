/* SPDX-License-Identifier: MIT */
/*
 * Large blocks: chunks, views and the allocation policy.
 *
 * A request of n chunks is served, in order, by
 *   0. while gmlake_long_lived() is on, no offload ring exists and n is
 *      GML_SPAN_MIN or more: one new handle at the end of the newest
 *      segment, past free memory (long_lived_grow),
 *   1. first fit among free runs of segments: the oldest segment, the
 *      lowest position (split; no driver call); a request of a quarter
 *      of the requested peak or more the newest segment's highest run,
 *      its top end (fit.c, cfg.top_fit),
 *   2. best fit among free runs of cached stitched views (no driver call),
 *   3. the free run at the end of the newest segment and new chunks
 *      mapped after it, in growth handles of several chunks (slab.c),
 *      while reserved memory stays within a small budget over the most
 *      ever requested (grow_in_budget) and, until step 4 has looked,
 *      under the most ever reserved (ahead of need, after the user gave
 *      the cache back: regrow_ahead); or, while
 *      gmlake_long_lived() is on under an offload ring and for
 *      GML_SPAN_MIN chunks or more, one new handle for the whole block at
 *      the segment's end (span.c),
 *   4. steps 1 and 2 again over memory other streams' queued work still
 *      covers, the request's stream ordered after that work on the
 *      device (order_fit: an event wait, no driver mapping), then step
 *      3's growth that raises the most ever reserved,
 *   5. repair of a cached stitched view: remap only its positions whose
 *      chunks are taken (a slab partly taken: swapped whole for a free
 *      one, or remapped to single chunks where no free one is left),
 *      when that costs well under a new stitch,
 *   6. a new stitched view over free chunks, after growing the newest
 *      segment by only the shortfall when too few chunks are free,
 *   7. steps 1-6 again after each rung of the pressure ladder (pressure.c:
 *      what the cache holds unused, then one spilled block at a time
 *      where a tier is registered),
 * and otherwise fails with -ENOMEM, the live blocks unchanged.
 *
 * A segment's range reserves room for the whole device and grows at its
 * end, as PyTorch's expandable segments do, so its free runs stay
 * contiguous across growths; its runs (by position) follow every change
 * in place. Step 3 is what keeps steady-state training with changing
 * shapes off the driver: a new, larger shape grows the end once, where a
 * stitch made for it would be broken and repaired whenever the shapes
 * change again. Step 2 finds the views that remain in later steps, and
 * step 1's order keeps them whole: each step's activations fill the
 * oldest chunks from the bottom, in the same places whatever the batch's
 * shape. Views that leave the cache are unmapped only once the stream
 * work that used them completed.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "large.h"
#include "types.h"

/* b takes n positions of r; packed (pack.c), b starts at off into the
 * first. */
static void take(gmlake_ctx *ctx, struct gml_block *b, const struct run *r,
		 uint32_t n, bool packed, uint32_t off)
{
	uint32_t lo = 0, hi = 0;

	if (packed)
		gml_pack_take(b, r, off, &lo, &hi);
	for (uint32_t i = lo; i < n - hi; i++)
		r->view->chunks[r->pos + i]->owner = b;
	if (n > lo + hi)
		gml_run_touch(r->view, r->pos + lo, n - lo - hi, true);
	r->view->live++;
	if (r->view->stitched) {
		r->view->last_use = ++ctx->clock;
		gml_gauge_add(&ctx->st.stitched_live, 1);
	}
	b->view = r->view;
	b->pos = r->pos;
	b->n = n;
	b->ptr = (uintptr_t)(r->view->va + (gml_va)r->pos * ctx->chunk) +
		 b->off;
}

/*
 * Regrowth after the user gave the cache back (gmlake_trim(); PyTorch's
 * empty_cache, which its cuDNN benchmark calls after every search). The
 * steps after it need again what went back, and regrown one request at a
 * time, each growth a set-access over new handles of single chunks,
 * ResNet-50 under cudnn.benchmark on an H100 spent 25-39 ms of driver
 * calls in each step after a search (123 set-access calls over 480 new
 * handles in one), where PyTorch's allocators regrew in a few
 * (bench/results/eco-extra-5521aaa-h100/). So after such a burst of
 * trims (ctx.c's trim_regrow), while reserved memory stays at or under
 * its peak, which the process held before, growth goes ahead of the
 * request in whole handles, by a quarter of what was regrown since the
 * trim, and the budget's slack is a quarter: a step regrows in a number
 * of growths that rises with the logarithm of what it regrows, holding at
 * most a quarter more than it asked for, and never more than it held
 * before. A trim the library makes itself (out of memory, a lower limit)
 * ends it.
 */
#define REGROW_SHARE 4
/* Regrowth maps handles of this many growth handles (80 MiB by default;
 * the remainder in growth handles): the driver charges create, map and
 * set-access by the handle, and what regrows is most of what the steps
 * had. A repair swaps only slabs of the growth handle's size
 * (stitch.c); the larger ones it remaps to single chunks. */
#define REGROW_HANDLES 4

/* Whether k chunks more keep reserved memory at or under its peak. */
static bool under_top(const gmlake_ctx *ctx, uint32_t k)
{
	return ctx->st.reserved_bytes.current +
	       (int64_t)k * (int64_t)ctx->chunk <= ctx->reserved_top;
}

/* Whether growing by k chunks regrows memory given back by the user. */
static bool regrowing(const gmlake_ctx *ctx, uint32_t k)
{
	return ctx->regrow && !ctx->tier && gml_slab_chunks(ctx) &&
	       under_top(ctx, k);
}

/*
 * How many chunks growth may add for a request of n chunks, within the
 * budget over the most memory requested at once (less what is spilled to
 * the host, which holds no device memory): cfg.grow_slack per mille, a
 * quarter while regrowing (regrow). Growing costs the driver once; a
 * stitch or repair may cost it again every time the shapes change, so
 * growth is worth a little memory. On the replayed traces 20 (2%, the
 * default) took the priced driver time of the second half from 10-16% to
 * 3-6% on the traces whose shapes change every step, fragmentation
 * staying under 2.5%; 5 cut the GPT traces' peaks and cost ViT's driver
 * time (bench/results/replay-tried-08b9f2b.md); on an H100, 5 saved the
 * GPT workloads 20-50 MiB at 1.5x their steady driver time and put
 * activation offload's peak under save_on_cpu's
 * (bench/results/ab-1ffc003-h100/).
 */
static int64_t budget_chunks(const gmlake_ctx *ctx, uint32_t n, bool regrow)
{
	int64_t want = ctx->st.requested_bytes.current +
		       (int64_t)n * (int64_t)ctx->chunk;
	int64_t slack = ctx->cfg.grow_slack;

	if (regrow && slack < 1000 / REGROW_SHARE)
		slack = 1000 / REGROW_SHARE;
	if (want < ctx->requested_top)
		want = ctx->requested_top;
	want -= ctx->st.spilled_bytes.current;
	return (want + want / 1000 * slack - ctx->st.reserved_bytes.current) >>
	       ctx->chunk_shift;
}

static bool grow_in_budget(gmlake_ctx *ctx, uint32_t n, uint32_t k)
{
	return (int64_t)k <= budget_chunks(ctx, n, regrowing(ctx, k));
}

/* While regrowing, the chunks to grow past k: a quarter of what was
 * regrown since the trim, at least a handle, within the budget and
 * under the peak, the whole growth in whole handles. */
static uint32_t regrow_ahead(const gmlake_ctx *ctx, uint32_t n, uint32_t k)
{
	int64_t cur = ctx->st.reserved_bytes.current;
	int64_t g = gml_slab_chunks(ctx), want = 0, cap;

	if (!regrowing(ctx, k))
		return 0;
	if (cur > ctx->regrow_from)
		want = ((cur - ctx->regrow_from) >> ctx->chunk_shift) /
		       REGROW_SHARE;
	if (want < g)
		want = g;
	cap = (ctx->reserved_top - cur) >> ctx->chunk_shift;
	if (want > cap)
		want = cap;
	cap = budget_chunks(ctx, n, true);
	if (want > cap)
		want = cap;
	want = want / g * g;
	return want > (int64_t)k ? (uint32_t)(want - k) : 0;
}

/* How many positions at the end of segment v, up to n, are free and
 * usable on stream. */
static uint32_t top_free(gmlake_ctx *ctx, const struct gml_view *v,
			 uint32_t n, int stream)
{
	uint32_t len = 0;

	while (len < v->n && len < n) {
		uint32_t i = v->n - 1 - len;

		if (!v->mapped[i] || !gml_usable(ctx, v->chunks[i], stream))
			break;
		len++;
	}
	return len;
}

/*
 * Grow segment v by the k positions a request of n chunks lacks, within
 * the budget; with raise_peak false, only while reserved memory stays at
 * or under its peak. A block of a growth handle or more grows by whole
 * handles where the budget allows: the rest stays free at the top, where
 * the next growth starts (*extra positions). (Rounding small blocks up
 * too left more slabs partly used, which no stitch can take, on the
 * replayed traces.) While regrowing, any block grows ahead
 * (regrow_ahead). 0 or -ENOENT.
 */
static int grow_top(gmlake_ctx *ctx, struct gml_view *v, uint32_t n,
		    uint32_t k, bool raise_peak, uint32_t *extra)
{
	uint32_t g = gml_slab_chunks(ctx), room = v->cap - v->n;
	/* Past k: regrowth's share, else whole handles for a block of a
	 * handle or more, else nothing; the first the budget allows. */
	uint32_t tries[3] = { regrow_ahead(ctx, n, k),
			      g && n >= g ? (g - k % g) % g : 0, 0 };
	uint32_t handle = regrowing(ctx, k) ? g * REGROW_HANDLES : g;

	if (!k || k > room || !grow_in_budget(ctx, n, k))
		return -ENOENT;
	for (int i = 0; i < 3; i++) {
		*extra = tries[i];
		if (i < 2 && (!*extra || *extra > room - k ||
			      !grow_in_budget(ctx, n, k + *extra)))
			continue;
		if (!raise_peak && !under_top(ctx, k + *extra))
			return -ENOENT;
		/* Regrowth past k the device cannot hold: k alone. */
		if (!gml_seg_extend(ctx, v, k + *extra, handle))
			return 0;
		if (i)
			return -ENOENT;
	}
	return -ENOENT;
}

/*
 * Step 3: the free run at the end of the newest segment, and as many new
 * chunks after it as the request lacks (grow_top). -ENOENT when this
 * cannot serve.
 */
static int tail_grow(gmlake_ctx *ctx, uint32_t n, int stream, bool raise_peak,
		     struct run *got)
{
	struct gml_view *v = gml_list_last(ctx->segs);
	uint32_t len, g = gml_slab_chunks(ctx), extra;

	if (!v)
		return -ENOENT;
	len = top_free(ctx, v, n, stream);
	/* Under a tier, a block of a handle or more that would hold only
	 * the ends of two handles (the free top of one another block holds
	 * part of, and less than a handle new) leaves nothing a spill can
	 * unmap once the next block takes the rest: it grows whole where
	 * the budget allows, and the free top serves smaller blocks. */
	if (ctx->tier && g && n >= g && len < g && n - len < g &&
	    n <= v->cap - v->n && grow_in_budget(ctx, n, n))
		len = 0;
	if (grow_top(ctx, v, n, n - len, raise_peak, &extra))
		return -ENOENT;
	*got = (struct run){ v, v->n - extra - n, n };
	return 0;
}

/*
 * Step 0, while gmlake_long_lived() is on and no offload ring exists: a
 * block of GML_SPAN_MIN chunks or more, one that lives as long as the
 * model (an optimizer's state), takes one new handle of its size at the
 * end of the newest segment (span.c), past the memory shorter-lived
 * blocks freed. Put in the holes a step's activations left, it makes the
 * next step's activations grow the segment: on the replayed GPT traces,
 * with the state made this way, the second step's growth fell from 207
 * handles to 58 and peak reserved from 17.11 to 16.90 GiB (gpt_plain,
 * bench/results/replay-long-lived.md). Smaller blocks take the usual
 * order, which keeps the growth budget: growing for them too raised the
 * peaks (17.08 GiB). true: b owns its span.
 */
static bool long_lived_grow(gmlake_ctx *ctx, uint32_t n, struct gml_block *b)
{
	return ctx->long_lived && !ctx->tier && n >= GML_SPAN_MIN &&
	       gml_span_grow(ctx, n, b) == 0;
}

/*
 * Step 3 for a packed request of size bytes (pack.c): the free run at the
 * end of the newest segment from the free top of the chunk below it, and
 * the new chunks the rest needs (grow_top).
 */
static int pack_tail_grow(gmlake_ctx *ctx, size_t size, int stream,
			  bool raise_peak, struct run *got, uint32_t *off)
{
	struct gml_view *v = gml_list_last(ctx->segs);
	uint32_t n = (uint32_t)((size + ctx->chunk - 1) >> ctx->chunk_shift);
	uint32_t len, k, extra;
	struct run r;

	if (!v)
		return -ENOENT;
	len = top_free(ctx, v, n, stream);
	if (!gml_pack_place(ctx, v, v->n - len, len, size, stream, true, &k,
			    &r, off) ||
	    grow_top(ctx, v, n, k, raise_peak, &extra))
		return -ENOENT;	/* k 0: it fits without growth, step 1's */
	*got = r;
	return 0;
}

/*
 * Step 4: steps 1 and 2 again, now taking memory that other streams'
 * queued work still covers, the request's stream ordered after that work
 * on the device (one event wait per stream). A wait costs microseconds
 * where the remapping of steps 5 and 6 costs milliseconds; it is what
 * FSDP's all-gather and compute streams need, whose frees the GPU has
 * not caught up with when the other stream asks. Never while a CUDA
 * graph captures (ctx->order_off), whose streams may not wait on events
 * from outside the capture.
 */
static bool order_fit(gmlake_ctx *ctx, uint32_t n, int stream, struct run *r)
{
	bool found;

	if (ctx->nstreams < 2 || !ctx->cfg.stream_order ||
	    atomic_load_explicit(&ctx->order_off, memory_order_relaxed))
		return false;
	ctx->order_for = stream + 1;
	found = gml_first_fit(ctx, n, stream, r) ||
		gml_best_fit(ctx, ctx->stitched, n, stream, r);
	ctx->order_for = 0;
	return found && !gml_stream_order_run(ctx, r->view->chunks + r->pos,
					      n, stream);
}

/* Why a request took the slow path: what to look at when steady steps
 * still call the driver (GMLAKE_LOG_LEVEL=debug). */
static void slow_path_log(uint32_t n, int stream, const char *how,
			  uint64_t passed)
{
	gml_log(GMLAKE_LOG_DEBUG, "%" PRIu32 " chunks on stream %d: %s; %"
		PRIu64 " free chunks passed over as other streams' pending "
		"work", n, stream, how, passed);
}

/* Steps 0-6 of the policy, for size bytes in n chunks. */
static int try_alloc(gmlake_ctx *ctx, size_t size, uint32_t n, int stream,
		     struct gml_block *b)
{
	uint64_t passed = ctx->st.cross_stream_waits;
	bool pack, packed = false;
	uint32_t off = 0;
	struct run r;
	int ret;

	/* Asked after rounding: a request just under a chunk multiple
	 * fills its chunks once aligned and gains nothing by sharing. */
	size = gml_align_up(size);
	pack = gml_pack_wanted(ctx, size);
	if (long_lived_grow(ctx, n, b)) {
		return 0;	/* b owns its span already */
	} else if (pack && gml_pack_first_fit(ctx, size, stream, &r, &off)) {
		packed = true;
		ctx->st.fits++;
	} else if (gml_first_fit(ctx, n, stream, &r)) {
		ctx->st.fits++;
	} else if (gml_best_fit(ctx, ctx->stitched, n, stream, &r)) {
		ctx->st.stitch_reuses++;
	} else if (ctx->long_lived && n >= GML_SPAN_MIN &&
		   gml_span_grow(ctx, n, b) == 0) {
		return 0;	/* b owns its span already */
	} else if (pack && pack_tail_grow(ctx, size, stream, false, &r,
					  &off) == 0) {
		packed = true;	/* counted in grows */
	} else if (!pack && tail_grow(ctx, n, stream, false, &r) == 0) {
		/* counted in grows */
	} else if (order_fit(ctx, n, stream, &r)) {
		/* An event wait before memory the peak never held: in the
		 * replayed trace of the bench's gpt_offload, 38 MiB blocks
		 * on its second stream, with the other stream's frees still
		 * queued, grew peak reserved from 13.38 to 13.42 GiB. */
		ctx->st.fits++;
		slow_path_log(n, stream, "ordered after other streams' work",
			      ctx->st.cross_stream_waits - passed);
	} else if (pack && pack_tail_grow(ctx, size, stream, true, &r,
					  &off) == 0) {
		packed = true;	/* counted in grows */
	} else if (tail_grow(ctx, n, stream, true, &r) == 0) {
		/* counted in grows */
	} else {
		const char *how = "repaired a stitched range";

		ret = gml_repair(ctx, n, stream, &r);
		if (ret == -ENOENT) {
			ret = gml_stitch(ctx, n, stream, &r);
			how = "stitched";
		}
		if (ret)
			return ret;
		slow_path_log(n, stream, how,
			      ctx->st.cross_stream_waits - passed);
	}
	take(ctx, b, &r, packed ? r.len : n, packed, off);
	if (ctx->nstitched > ctx->cfg.stitch_cache_max)
		gml_cache_trim(ctx, ctx->cfg.stitch_cache_max);
	return 0;
}

int gml_large_alloc(gmlake_ctx *ctx, size_t size, int stream,
		    struct gml_block **out)
{
	size_t chunks = (size >> ctx->chunk_shift) +
			!!(size & (ctx->chunk - 1));
	struct gml_block *b;
	int ret;

	if (chunks > UINT32_MAX / 2 || size > ctx->dev_total)
		return gml_set_error(-ENOMEM, "%zu bytes is more than any "
				     "device holds", size);
	b = calloc(1, sizeof(*b));
	if (!b)
		return gml_set_error(-ENOMEM, "no host memory for a block");
	ctx->poll_gen++;
	gml_reap_dying(ctx, false);
	/* With no tier, whose thread's timer reaps them, freed spans whose
	 * work is done go back to the driver here (span.c's span_keep). */
	if (ctx->nstale && !ctx->tier)
		gml_stale_reap(ctx, false);
	ret = try_alloc(ctx, size, (uint32_t)chunks, stream, b);
	for (unsigned rung = 0;
	     ret == -ENOMEM && gml_pressure_relieve(ctx, &rung, NULL);)
		ret = try_alloc(ctx, size, (uint32_t)chunks, stream, b);
	if (ret) {
		free(b);
		return ret;
	}
	b->stream = stream;
	b->alloc_size = gml_align_up(size);
	*out = b;
	return 0;
}

void gml_large_free(gmlake_ctx *ctx, struct gml_block *b,
		    const struct gml_guard *g)
{
	struct gml_view *v = b->view;
	uint32_t lo, hi;

	if (v->chunks[b->pos]->spanned) {	/* its run becomes holes */
		gml_span_free(ctx, b, g);
		v->live--;
		free(b);
		if (!v->stitched) {
			gml_seg_drop_if_empty(ctx, v);
			return;
		}
		gml_gauge_add(&ctx->st.stitched_live, -1);
		if (!v->live && !v->dying)
			gml_view_evict(ctx, v, false);	/* holes leave */
		return;
	}
	gml_pack_leave(b, &lo, &hi);	/* shared ends stay taken */
	for (uint32_t i = lo; i < b->n - hi; i++) {
		v->chunks[b->pos + i]->owner = NULL;
		v->chunks[b->pos + i]->guard = *g;
	}
	if (b->n > lo + hi)
		gml_run_touch(v, b->pos + lo, b->n - lo - hi, false);
	gml_view_guard(v, g);
	v->live--;
	free(b);
	if (!v->stitched)
		return;
	gml_gauge_add(&ctx->st.stitched_live, -1);
	if (v->holes && !v->live && !v->dying) {
		gml_view_evict(ctx, v, false);	/* offload: holes leave */
		return;
	}
	if (ctx->nstitched > ctx->cfg.stitch_cache_max)
		gml_cache_trim(ctx, ctx->cfg.stitch_cache_max);
}

/* Tear down everything (destroy): stitched views, then segments. */
void gml_views_fini(gmlake_ctx *ctx)
{
	struct gml_view *v, *next;

	/* The caller waited for every stream: freed spans go now. */
	gml_stale_reap(ctx, true);
	for (v = ctx->stitched; v; v = next) {
		next = v->next;
		gml_list_del(&ctx->stitched, v);
		gml_gauge_add(&ctx->st.stitched_cached, -1);
		gml_view_discard(ctx, v);
	}
	ctx->nstitched = 0;
	for (v = ctx->segs; v; v = next) {
		next = v->next;
		gml_list_del(&ctx->segs, v);
		gml_view_discard(ctx, v);
	}
	free(ctx->stale);
	ctx->stale = NULL;
	ctx->nstale = ctx->cap_stale = 0;
	/* Stitched views first, then the segments they pinned; twice, so a
	 * call that failed once is tried again. */
	for (int pass = 0; pass < 2 && ctx->dying; pass++)
		gml_reap_dying(ctx, true);
	for (v = ctx->dying; v; v = next) {
		next = v->next;
		gml_list_del(&ctx->dying, v);
		gml_log(GMLAKE_LOG_WARN, "leaking a range the driver would "
			"not unmap at %#llx", (unsigned long long)v->va);
	}
	gml_span_spares_fini(ctx);
}

/*
 * Debug log, after a request served by new chunks raised the peak of
 * reserved memory: the free chunks the cache still holds, and why they
 * did not serve it (cached stitched ranges map them, their last work is
 * still queued, or they lie in growth handles blocks hold part of, which
 * only a fit in their segment can use). What to read when reserved
 * memory climbs past what the live blocks need.
 */
void gml_log_peak_slack_now(gmlake_ctx *ctx, const char *what, size_t size)
{
	uint64_t free_n = 0, in_views = 0, busy = 0, held = 0;

	for (struct gml_view *v = ctx->segs; v; v = v->next)
		for (uint32_t i = 0; i < v->n; i++) {
			struct gml_chunk *c = v->chunks[i];

			if (!c || c->owner)
				continue;
			free_n++;
			in_views += c->nviews > 0;
			busy += c->guard.stream >= 0 &&
				!gml_stream_done(ctx, c->guard.stream,
						 c->guard.seq);
			held += gml_slab_held(v, i);
		}
	if (free_n)
		gml_log(GMLAKE_LOG_DEBUG, "%s of %zu bytes raised reserved to "
			"%lld MiB with %llu free chunks left (%llu in cached "
			"stitched ranges, %llu with work queued, %llu in growth "
			"handles blocks hold part of), %u stale",
			what, size,
			(long long)(ctx->st.reserved_bytes.peak >> 20),
			(unsigned long long)free_n,
			(unsigned long long)in_views,
			(unsigned long long)busy, (unsigned long long)held,
			ctx->nstale);
}
