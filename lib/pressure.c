/* SPDX-License-Identifier: MIT */
/*
 * What the allocator gives up under memory pressure, and in what order:
 * the one ladder that allocation and fetch climb (gml_pressure_relieve).
 * First what the cache holds unused: it waits for every stream, releases
 * the blocks freed while other streams used them, unmaps stale positions,
 * releases spare chunks, gives idle small chunks back and unmaps unused
 * stitched views. Then, one block at a time, what a tier
 * below the device (offload/) can spill. Trim (gmlake_trim, and the
 * PyTorch entry point's last retry) also gives every free chunk back to
 * the driver.
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

int gml_streams_wait_all(gmlake_ctx *ctx)
{
	int ret = 0, err;

	for (int s = 0; s < ctx->nstreams; s++) {
		err = gml_stream_wait(ctx, s, gml_stream_last(ctx, s));
		if (err && !ret)
			ret = err;
	}
	return ret;
}

/*
 * Wait for every stream, unmap every unused stitched view and every
 * position whose unmap failed before (the memory of its released handle
 * comes back with it) and, with all, give every free chunk back to the
 * driver (trim). 0 or the first error.
 */
int gml_release_cached(gmlake_ctx *ctx, bool all)
{
	struct gml_view *v, *next;
	int ret, err;

	ret = gml_streams_wait_all(ctx);
	/* Blocks freed while other streams used them: their memory too. */
	gml_release_deferred(ctx, false);
	if (ret)
		return ret;
	gml_stale_reap(ctx, true);
	gml_spares_release(ctx);
	gml_small_trim(ctx, -1);
	for (v = ctx->stitched; v; v = next) {
		next = v->next;
		if (!v->live)
			gml_view_evict(ctx, v, true);
	}
	gml_reap_dying(ctx, true);
	for (v = ctx->segs; v; v = next) {
		next = v->next;
		for (uint32_t i = 0; i < v->n; i++) {
			/* A position whose unmap failed earlier: again (every
			 * stream's work is done). */
			if (!v->chunks[i] && v->mapped[i] &&
			    !gml_view_unmap_run(ctx, v, i, 1))
				v->maxfree = GML_RUN_UNKNOWN;
			if (!all || !gml_chunk_releasable(v->chunks[i]))
				continue;
			err = gml_chunk_release(ctx, v, i);
			if (err < 0 && err != -EBUSY && !ret)
				ret = err;
		}
		if (all)
			gml_seg_drop_if_empty(ctx, v);
	}
	return ret;
}

/*
 * Give back up to want free segment chunks whose work is done, without
 * waiting: those no cached stitched view maps first, then those of unused
 * views (evicted), from the newest segment's top down, so that first fit's
 * low positions stay. For a request that needs one handle of a size (a
 * span) when the device's room sits in the cache. Returns how many went.
 */
uint32_t gml_release_free_chunks(gmlake_ctx *ctx, uint32_t want)
{
	uint32_t got = 0;

	for (int pass = 0; pass < 2 && got < want; pass++) {
		struct gml_view *v = gml_list_last(ctx->segs), *prev;

		for (; v && got < want; v = prev) {
			prev = v->prev;
			for (uint32_t i = v->n; i-- > 0 && got < want;) {
				struct gml_chunk *c = v->chunks[i];
				int k;

				if (!gml_chunk_releasable(c) ||
				    (!pass && c->nviews) ||
				    !(c->slab_len ? gml_slab_done(ctx, v, i) :
				      gml_guard_ready(ctx, &c->guard, -1)))
					continue;
				k = gml_chunk_release(ctx, v, i);
				if (k > 0)
					got += (uint32_t)k;
			}
			gml_seg_drop_if_empty(ctx, v);
		}
	}
	return got;
}

/*
 * One more rung of the ladder for a request that found no memory: *rung
 * starts at 0 and counts the rungs climbed. Rung 0 gives up the cache's
 * unused memory; every later rung has the tier spill one block (never
 * keep). True when something was given up, so the caller tries again;
 * false at the bottom.
 */
bool gml_pressure_relieve(gmlake_ctx *ctx, unsigned *rung,
			  struct gml_block *keep)
{
	if ((*rung)++ == 0) {
		/* What it could not give up (a stream that fails its wait)
		 * stays; the next rung may still find memory. */
		gml_release_cached(ctx, false);
		return true;
	}
	return ctx->tier && ctx->tier->reclaim(ctx, keep);
}
