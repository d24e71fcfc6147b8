/* SPDX-License-Identifier: MIT */
/*
 * Peer access: another device of the process given access to a context's
 * memory (gmlake_peer_access), as PyTorch's enablePeerAccess asks before a
 * kernel on one device reads another device's tensors. A virtual-memory
 * mapping is accessible only to the devices its set-access named, so the
 * peer joins the driver layer's list, which every later set-access names
 * (dev.c), and is granted over what is mapped now: each run of mapped
 * positions of the segments and of the cached and dying stitched views,
 * and the ranges IPC imported. Never by default: each peer makes every
 * set-access longer, and persistent peer mappings slow kernel launches.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdio.h>

#include "error.h"
#include "lock.h"
#include "types.h"

/* Set-access over every run of v's mapped positions. */
static int grant_view(gmlake_ctx *ctx, const struct gml_view *v)
{
	uint32_t p = 0, q;
	int ret;

	while (p < v->n) {
		if (!v->mapped[p]) {
			p++;
			continue;
		}
		for (q = p; q < v->n && v->mapped[q]; q++)
			;
		ret = gml_dev_set_access(&ctx->dev,
					 v->va + (gml_va)p * ctx->chunk,
					 (size_t)(q - p) * ctx->chunk);
		if (ret)
			return ret;
		p = q;
	}
	return 0;
}

/* Everything ctx maps now, with the device's current peers. */
static int grant_mapped(gmlake_ctx *ctx)
{
	struct gml_view *const lists[] = { ctx->segs, ctx->stitched,
					   ctx->dying };
	int ret;

	for (size_t i = 0; i < sizeof(lists) / sizeof(lists[0]); i++)
		for (const struct gml_view *v = lists[i]; v; v = v->next) {
			ret = grant_view(ctx, v);
			if (ret)
				return ret;
		}
	return gml_ipc_grant(ctx);
}

GML_EXPORT int gmlake_peer_access(gmlake_ctx *ctx, int peer)
{
	char why[256];
	int ret;

	if (!ctx)
		return gml_set_error(-EINVAL, "gmlake_peer_access: ctx is NULL");
	ret = gml_ctx_lock(ctx);
	if (ret)
		return ret;
	for (uint32_t i = 0; i < ctx->npeers; i++)
		if (ctx->peers[i] == peer)
			goto out_unlock;	/* granted already */
	ret = gml_dev_peer_add(&ctx->dev, peer);
	if (ret < 0)
		goto out_unlock;
	ret = grant_mapped(ctx);
	if (ret) {
		snprintf(why, sizeof(why), "%s", gmlake_last_error());
		gml_set_error(ret, "gmlake_peer_access: device %d: what is "
			      "mapped now was not all granted (%s); mappings "
			      "made from now on are: call again", peer, why);
		goto out_unlock;
	}
	ctx->peers[ctx->npeers++] = peer;
out_unlock:
	gml_ctx_unlock(ctx);
	return ret;
}
