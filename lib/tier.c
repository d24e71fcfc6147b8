/* SPDX-License-Identifier: MIT */
/*
 * The tier interface (tier.h), both ways: how a tier below the device
 * registers its hooks with a context (the allocator calls a registered
 * tier through ctx->tier only, and a context with none, offload never
 * used, never leaves lib/), and the few questions a tier asks of the
 * allocator instead of reading its fields: the streams to order copies
 * after, whether stale positions wait, the chunk timer, the settings.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <limits.h>

#include "error.h"
#include "tier.h"
#include "types.h"

int gml_tier_register(gmlake_ctx *ctx, const struct gml_tier_ops *ops,
		      void *priv)
{
	if (ctx->tier && ctx->tier != ops)
		return gml_set_error(-EBUSY, "a tier is already registered "
				     "with this context");
	ctx->tier = ops;
	ctx->tier_priv = priv;
	return 0;
}

int gml_stream_count(gmlake_ctx *ctx)
{
	return ctx->nstreams;
}

bool gml_stream_handle(gmlake_ctx *ctx, int idx, gmlake_stream_t *s)
{
	if (idx < 0 || idx >= ctx->nstreams || ctx->streams[idx].dead)
		return false;
	*s = ctx->streams[idx].handle;
	return true;
}

bool gml_stale_pending(gmlake_ctx *ctx)
{
	return ctx->nstale > 0;
}

/*
 * Spilled chunks wait cfg.spare_keep_ms for a fetch or an allocation to
 * take them, then go back to the driver: reserved memory falls once the
 * spills and fetches end. The wait is long (5 s) because with 100 ms the
 * chunks went back between training steps and were made again at the
 * next large one: on the H200 the 5 s wait cut the offload benchmark's
 * cuMemCreate calls from 20,446 to 7,359, its cuMemRelease calls to none
 * and its step times by 12-15% (bench/results/offload.md). Stale
 * positions (a fetch moved their chunk before its work there completed)
 * are unmapped once it did, looked at every STALE_LOOK_MS.
 */
#define STALE_LOOK_MS 10

int gml_chunks_tend(gmlake_ctx *ctx)
{
	uint64_t age, keep;
	int ms = -1;

	if (ctx->nstale) {
		gml_stale_reap(ctx, false);
		if (ctx->nstale)
			ms = STALE_LOOK_MS;
	}
	if (ctx->nspares || ctx->nspan_spares) {
		keep = (uint64_t)ctx->cfg.spare_keep_ms * 1000000;
		age = gml_now_ns() - ctx->spare_ns;
		if (age >= keep) {
			gml_spares_release(ctx);
		} else {
			uint64_t left = (keep - age) / 1000000 + 1;
			int due = left > INT_MAX ? INT_MAX : (int)left;

			if (ms < 0 || due < ms)
				ms = due;
		}
	}
	return ms;
}

const struct gmlake_config *gml_ctx_config(const gmlake_ctx *ctx)
{
	return &ctx->cfg;
}
