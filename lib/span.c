/* SPDX-License-Identifier: MIT */
/*
 * Spans: one physical handle under the whole run of a segment block that
 * goes back and forth between the device and the host (offload/).
 *
 * The driver charges its mapping calls per handle, not per byte: on the
 * H200 cuMemSetAccess costs 25-40 us per handle (120-220 us while kernels
 * run) and cuMemUnmap 15-19 us, whatever the handle's size, so a 2 MiB
 * chunk costs as much to map and unmap as it takes to copy. A block that
 * is fetched for the second time (one that cycles: optimizer state, a
 * parameter shard; a saved activation is fetched once and freed) of at
 * least GML_SPAN_MIN chunks is therefore fetched into one handle of its
 * whole size: one map and one set-access, and one unmap at its next
 * spill, where chunks cost one of each per 2 MiB. After the spill the
 * handle is a spare span, and the next fetch of a block of that size maps
 * it again: a steady cycle creates and releases nothing.
 *
 * A span's positions have chunk structs (all with the span's handle; the
 * first has span_len set) so the rest of the allocator sees an ordinary
 * resident block. They are owned by their block from the fetch to its
 * spill or free, so they are never free chunks: no stitched view maps
 * them and nothing releases them one by one. At the free the run becomes
 * holes, as a spilled block's run is, once the work that used it is done
 * (a stale entry, unmapped by gml_stale_reap), and the handle a spare,
 * or, with no tier, the driver's again (span_keep).
 * Spare spans go with the spare chunks (gml_spares_release: the spare
 * timer, trim, memory pressure, destroy). When the device has no room for
 * a new span, the spare chunks go first, then free chunks of the chunk
 * cache (gml_release_free_chunks): a fetch that moved them into the run
 * would pay a map and an access per chunk at every cycle.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdlib.h>

#include "error.h"
#include "large.h"
#include "types.h"

/* Whether b's next fetch should be into a span (ctx lock held). */
bool gml_span_wanted(const struct gml_block *b)
{
	return b->n >= GML_SPAN_MIN && b->fetches > 0;
}

/* Give a handle of n chunks (a span, a slab) back to the driver; false if
 * it refused (the handle is still the caller's, and still counted). */
bool gml_span_release(gmlake_ctx *ctx, gml_handle h, uint32_t n)
{
	if (gml_dev_mem_release(&ctx->dev, h))
		return false;
	gml_gauge_add(&ctx->st.chunks, -(int64_t)n);
	gml_reserved_add(ctx, -(int64_t)n * (int64_t)ctx->chunk);
	ctx->st.releases += n;
	return true;
}

/* Keep an unmapped span for the next fetch of its size; with no memory
 * for the list, give it back (or, refused, lose it, said in the log). */
void gml_span_put(gmlake_ctx *ctx, gml_handle h, uint32_t n)
{
	if (ctx->nspan_spares == ctx->cap_span_spares) {
		uint32_t cap = ctx->cap_span_spares ? 2 * ctx->cap_span_spares : 8;
		struct gml_span_spare *grown = realloc(ctx->span_spares,
						       cap * sizeof(*grown));

		if (!grown) {
			if (!gml_span_release(ctx, h, n))
				gml_log(GMLAKE_LOG_WARN, "leaking a span of %u "
					"chunks the driver would not release",
					n);
			return;
		}
		ctx->span_spares = grown;
		ctx->cap_span_spares = cap;
	}
	ctx->span_spares[ctx->nspan_spares++] = (struct gml_span_spare){ h, n };
	ctx->spare_ns = gml_now_ns();
}

/* Release the spare spans; one the driver refuses stays a spare, for the
 * next release (destroy: gml_span_spares_fini). */
void gml_span_spares_release(gmlake_ctx *ctx)
{
	uint32_t k = 0;

	for (uint32_t i = 0; i < ctx->nspan_spares; i++)
		if (!gml_span_release(ctx, ctx->span_spares[i].h,
				  ctx->span_spares[i].n))
			ctx->span_spares[k++] = ctx->span_spares[i];
	ctx->nspan_spares = k;
	if (!k) {
		free(ctx->span_spares);
		ctx->span_spares = NULL;
		ctx->cap_span_spares = 0;
	}
}

/* Destroy: what the driver still refuses is lost (said in the log). */
void gml_span_spares_fini(gmlake_ctx *ctx)
{
	gml_span_spares_release(ctx);
	if (ctx->nspan_spares)
		gml_log(GMLAKE_LOG_WARN, "leaking %u spans the driver would "
			"not release", ctx->nspan_spares);
	free(ctx->span_spares);
	ctx->span_spares = NULL;
	ctx->nspan_spares = ctx->cap_span_spares = 0;
}

/* A new handle of n chunks, within the device limit. */
static int span_create(gmlake_ctx *ctx, uint32_t n, gml_handle *h)
{
	int ret = gml_over_device_limit(ctx, n);

	return ret ? ret : gml_dev_mem_create(&ctx->dev,
					      (size_t)n * ctx->chunk, h);
}

/* A handle of n chunks: a spare span of that size, or a new one. */
static int span_get(gmlake_ctx *ctx, uint32_t n, gml_handle *h)
{
	int ret;

	for (uint32_t i = 0; i < ctx->nspan_spares; i++)
		if (ctx->span_spares[i].n == n) {
			*h = ctx->span_spares[i].h;
			ctx->span_spares[i] =
				ctx->span_spares[--ctx->nspan_spares];
			ctx->spare_ns = gml_now_ns();
			return 0;
		}
	ret = span_create(ctx, n, h);
	if (ret == -ENOMEM && (ctx->nspares || ctx->nspan_spares)) {
		/* Spare chunks of other sizes hold the room: give them back. */
		gml_spares_release(ctx);
		ret = span_create(ctx, n, h);
	}
	if (ret == -ENOMEM && gml_release_free_chunks(ctx, n) == n) {
		/* The room sat in the chunk cache: n free chunks went back,
		 * since moving them into the run would cost a map and an
		 * access each, at every fetch, where the span costs one. */
		ret = span_create(ctx, n, h);
	}
	if (ret)
		return ret;
	gml_gauge_add(&ctx->st.chunks, n);
	gml_reserved_add(ctx, (int64_t)n * (int64_t)ctx->chunk);
	return 0;
}

/*
 * Map one span at spilled block b's run (its holes), of a segment or of a
 * stitched view: 0 with b owning the span's chunks (their home is the
 * run itself), or -errno with b still spilled and nothing held (the
 * caller then fetches into chunks). With defer, no access yet
 * (gml_fetch_access).
 */
int gml_span_attach(gmlake_ctx *ctx, struct gml_block *b,
		    struct gml_access *defer)
{
	struct gml_view *v = b->view;
	size_t size = (size_t)b->n * ctx->chunk;
	struct gml_chunk *c;
	gml_handle h;
	uint32_t i;
	int ret;

	c = calloc(b->n, sizeof(*c));
	if (!c)
		return gml_set_error(-ENOMEM, "no host memory for a span");
	ret = span_get(ctx, b->n, &h);
	if (ret)
		goto out_free;
	ret = gml_dev_mem_map(&ctx->dev, b->ptr, size, h);
	if (ret)
		goto out_put;
	ret = gml_fetch_access(ctx, b->ptr, size, 1, defer);
	if (ret) {
		if (gml_dev_mem_unmap(&ctx->dev, b->ptr, size)) {
			/* Still mapped: released, the memory lives while it
			 * is, and the count goes with the handle. */
			gml_log(GMLAKE_LOG_ERROR, "cannot unmap a span at %#lx "
				"after a failed fetch", (unsigned long)b->ptr);
			if (!gml_span_release(ctx, h, b->n))
				gml_span_put(ctx, h, b->n);
			goto out_free;
		}
		goto out_put;
	}
	gml_count_mapping(ctx, b->n);
	for (i = 0; i < b->n; i++) {
		uint32_t p = b->pos + i;

		c[i].handle = h;
		c[i].owner = b;
		c[i].seg = v;
		c[i].seg_pos = p;
		c[i].guard.stream = -1;
		c[i].spanned = true;
		gml_chunk_touch(&c[i]);
		v->chunks[p] = &c[i];
		v->mapped[p] = 1;
	}
	c[0].span_len = b->n;
	if (v->stitched)
		v->holes -= b->n;
	return 0;
out_put:
	gml_span_put(ctx, h, b->n);
out_free:
	free(c);
	return ret;
}

/*
 * A new block of n chunks under one span, at the end of the newest
 * segment (gmlake_long_lived): its positions are added as holes and the
 * span mapped there, one create, map and set-access for the whole block
 * where growth by chunks costs one of each per chunk. It cycles through
 * spans from then on (fetches 1). 0 with b set up and owning the span,
 * -ENOENT where the newest segment's range has no room, or -errno; with
 * nothing held but the positions, which stay holes at the range's end.
 */
int gml_span_grow(gmlake_ctx *ctx, uint32_t n, struct gml_block *b)
{
	struct gml_view *v;
	uint32_t pos;
	int ret;

	/* Freed spans whose work is done become spares first (a segment
	 * this empties goes, so the newest is found after). */
	if (ctx->nstale)
		gml_stale_reap(ctx, false);
	v = gml_list_last(ctx->segs);
	if (!v || v->cap - v->n < n)
		return -ENOENT;
	pos = v->n;
	ret = gml_seg_add_holes(v, n);
	if (ret)
		return ret;
	b->view = v;
	b->pos = pos;
	b->n = n;
	b->ptr = (uintptr_t)(v->va + (gml_va)pos * ctx->chunk);
	v->live++;
	ret = gml_span_attach(ctx, b, NULL);
	if (ret) {
		v->live--;
		if (v->n == pos + n)	/* nothing came after: take them back */
			v->n = pos;
		v->maxfree = GML_RUN_UNKNOWN;
		b->view = NULL;
		return ret;
	}
	b->fetches = 1;
	ctx->st.grows++;
	return 0;
}

/* Drop the chunk structs of the span at v's position p (its first). */
static void span_forget(struct gml_view *v, uint32_t p)
{
	struct gml_chunk *first = v->chunks[p];
	uint32_t n = first->span_len;

	for (uint32_t i = 0; i < n; i++)
		v->chunks[p + i] = NULL;
	free(first);
}

/*
 * An unmapped span's handle: a spare for the next fetch of its size
 * under a tier, whose thread's timer gives spares back. With no tier no
 * fetch comes and no timer runs, so a freed long-lived block's handle (an
 * optimizer's state, gmlake_long_lived) goes back to the driver now
 * instead of staying reserved until memory pressure or destroy; kept
 * where the driver refuses it.
 */
static void span_keep(gmlake_ctx *ctx, gml_handle h, uint32_t n)
{
	if (ctx->tier || !gml_span_release(ctx, h, n))
		gml_span_put(ctx, h, n);
}

/* Unmap a span's run now and keep its handle (span_keep); 0, or -errno
 * with the run still mapped. */
static int span_unmap(gmlake_ctx *ctx, struct gml_view *s, uint32_t pos,
		      uint32_t n, gml_handle h)
{
	int ret = gml_view_unmap_run(ctx, s, pos, n);

	if (!ret)
		span_keep(ctx, h, n);
	return ret;
}

/*
 * Spill: unmap resident span block b's run (its work complete, its bytes
 * elsewhere) and keep the handle. 0, or -errno with b intact.
 */
int gml_span_detach(gmlake_ctx *ctx, struct gml_block *b)
{
	struct gml_view *v = b->view;
	int ret;

	ret = span_unmap(ctx, v, b->pos, b->n, v->chunks[b->pos]->handle);
	if (ret)
		return ret;
	span_forget(v, b->pos);
	if (v->stitched)
		v->holes += b->n;
	return 0;
}

/*
 * Free resident span block b (ctx lock held; b itself is the caller's):
 * its run becomes holes. Unmapped now when the work g covers is done,
 * else, on a segment, once it is (a stale entry of the whole span). On a
 * stitched view, or with no memory for the entry, the work is waited for
 * here: a block that cycled is rarely freed (optimizer state lives as
 * long as its optimizer).
 */
void gml_span_free(gmlake_ctx *ctx, struct gml_block *b,
		   const struct gml_guard *g)
{
	struct gml_view *v = b->view;
	gml_handle h = v->chunks[b->pos]->handle;
	uint32_t pos = b->pos, n = b->n;
	struct gml_guard when = *g;
	uint64_t seq;

	span_forget(v, pos);
	v->maxfree = GML_RUN_UNKNOWN;
	if (v->stitched)
		v->holes += n;
	if (gml_guard_ready(ctx, g, -1) && !span_unmap(ctx, v, pos, n, h))
		return;
	/* With no tier the stale entry is reaped at a later allocation
	 * (gml_large_alloc), by polling: a single stream's seq 0 guard never
	 * completes, so an event marks the work now. */
	if (!ctx->tier && g->stream >= 0 && !g->seq &&
	    !gml_stream_mark(ctx, g->stream, GML_MARK_FORCE, &seq))
		when.seq = seq;
	if (!v->stitched && gml_stale_add(ctx, v, pos, n, h, &when) == 0)
		return;
	if (g->stream >= 0 && gml_stream_wait(ctx, g->stream, g->seq))
		gml_log(GMLAKE_LOG_ERROR, "cannot wait for the work on a freed "
			"span at %#lx", (unsigned long)b->ptr);
	if (span_unmap(ctx, v, pos, n, h))
		gml_log(GMLAKE_LOG_ERROR, "leaking a span at %#lx the driver "
			"would not unmap", (unsigned long)b->ptr);
}

/* A stale span's work is done: unmap it (the stale reap). */
bool gml_span_stale_unmap(gmlake_ctx *ctx, const struct gml_stale *e)
{
	return !span_unmap(ctx, e->seg, e->pos, e->n, e->span_h);
}
