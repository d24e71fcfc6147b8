/* SPDX-License-Identifier: MIT */
/*
 * The tier interface (tier.h): how a tier below the device registers its
 * hooks with a context. The allocator calls a registered tier through
 * ctx->tier only, and a context with none (offload never used) never
 * leaves lib/.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>

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
