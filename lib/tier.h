/* SPDX-License-Identifier: MIT */
/*
 * A memory tier below the device (the offload manager in offload/). The
 * allocator reaches a tier only through the hooks it registered on first
 * use, as mimalloc's deferred-free hook lets its allocator call out, so
 * lib/ never names offload/. Every hook runs with the context lock held,
 * but quiesce: a tier's own thread may need that lock to finish.
 */
#ifndef GML_TIER_H
#define GML_TIER_H

#include <stdbool.h>

#include "gmlake.h"

struct gml_block;

struct gml_tier_ops {
	/* Move one block out of the device, never keep; true when one
	 * moved (the caller tries again, one block at a time). */
	bool (*reclaim)(gmlake_ctx *ctx, struct gml_block *keep);
	/* b was freed: the tier forgets it, once (a block on the device
	 * at gmlake_free, a spilled one when its memory is released). */
	void (*block_gone)(gmlake_ctx *ctx, struct gml_block *b);
	/* Stop moving and wait for what is in flight; no lock held. */
	void (*quiesce)(gmlake_ctx *ctx);
	/* The context goes: free the tier's state. The context forgets
	 * the registration afterwards. */
	void (*fini)(gmlake_ctx *ctx);
};

/*
 * Register ops with ctx, priv being the tier's state (ctx->tier_priv);
 * ctx lock held. 0, or -EBUSY when another tier is registered already.
 * The registration lasts until the context is destroyed.
 */
int gml_tier_register(gmlake_ctx *ctx, const struct gml_tier_ops *ops,
		      void *priv);
#endif
