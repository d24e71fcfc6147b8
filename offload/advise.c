/* SPDX-License-Identifier: MIT */
/*
 * Advice and state: which blocks may move, and where a block is.
 *
 * Blocks advised offloadable (gmlake_advise) sit on off->lru, least
 * recently used first. When an allocation (or a fetch) would fail, or pass
 * cfg.device_limit, the tier's reclaim hook (gml_off_reclaim) spills from
 * the head of that list synchronously, in the caller's thread, with the
 * context lock held. A freed block leaves the list and its host copy goes
 * (the block_gone hook). gmlake_offload_state tells where a block is.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>

#include "error.h"
#include "offload.h"

/* ---------------------------------------------------------------------- */
/* LRU of offloadable resident blocks                                      */

void gml_off_lru_del(struct gml_offload *off, struct gml_block *b)
{
	if (!b->on_lru)
		return;
	if (b->oprev)
		b->oprev->onext = b->onext;
	else
		off->lru = b->onext;
	if (b->onext)
		b->onext->oprev = b->oprev;
	else
		off->lru_tail = b->oprev;
	b->oprev = b->onext = NULL;
	b->on_lru = false;
}

/* Most recently used: to the tail. */
void gml_off_lru_touch(struct gml_offload *off, struct gml_block *b)
{
	gml_off_lru_del(off, b);
	if (!b->offloadable || b->off_state != GML_OFF_RESIDENT)
		return;
	b->oprev = off->lru_tail;
	b->onext = NULL;
	if (off->lru_tail)
		off->lru_tail->onext = b;
	else
		off->lru = b;
	off->lru_tail = b;
	b->on_lru = true;
}

/* The tier's reclaim hook: spill one offloadable block, least recently
 * used first, never keep. */
bool gml_off_reclaim(gmlake_ctx *ctx, struct gml_block *keep)
{
	struct gml_offload *off = gml_off_of(ctx);
	struct gml_block *b, *next;
	uint32_t freed = 0;

	if (!off)
		return false;
	/* One block a call: the caller tries again after each. */
	for (b = off->lru; b && !freed; b = next) {
		next = b->onext;
		if (b == keep || b->off_state != GML_OFF_RESIDENT)
			continue;
		if (gml_off_spill_sync(ctx, off, b))
			continue;
		freed += b->n;
		ctx->st.auto_spills++;
	}
	return freed > 0;
}

/* The tier's block_gone hook: a block is freed, its host side goes with
 * it. ctx lock held. */
void gml_off_block_gone(gmlake_ctx *ctx, struct gml_block *b)
{
	struct gml_offload *off = gml_off_of(ctx);

	gml_off_lru_del(off, b);
	if (b->off_state != GML_OFF_SPILLED)
		return;
	if (b->host)
		gml_host_free(&off->host, b->host, b->host_size);
	if (b->inplace)
		gml_off_inplace_drop(ctx, off, b);
	b->host = NULL;
	gml_gauge_add(&ctx->st.spilled_bytes, -(int64_t)b->size);
	gml_gauge_add(&ctx->st.spilled_blocks, -1);
	gml_off_sync_gauges(ctx);
}

/* ---------------------------------------------------------------------- */
/* Public calls on blocks                                                  */

GML_EXPORT int gmlake_advise(gmlake_ctx *ctx, void *ptr, int advice)
{
	struct gml_offload *off;
	struct gml_block *b;
	int ret;

	if (!ctx || !ptr)
		return gml_set_error(-EINVAL, "gmlake_advise: %s is NULL",
				     ctx ? "ptr" : "ctx");
	if (advice != GMLAKE_ADVISE_OFFLOADABLE &&
	    advice != GMLAKE_ADVISE_NOT_OFFLOADABLE)
		return gml_set_error(-EINVAL, "gmlake_advise: unknown advice %d",
				     advice);
	ret = gml_ctx_lock(ctx);
	if (ret)
		return ret;
	b = gml_ptrmap_get(&ctx->blocks, (uintptr_t)ptr);
	if (!b) {
		ret = gml_set_error(-EINVAL, "gmlake_advise: %p is not a live "
				    "block", ptr);
		goto out_unlock;
	}
	if (advice == GMLAKE_ADVISE_NOT_OFFLOADABLE) {
		b->offloadable = false;
		if (b->on_lru)	/* only while the manager exists */
			gml_off_lru_del(gml_off_of(ctx), b);
		goto out_unlock;
	}
	if (b->small) {
		ret = gml_set_error(-EOPNOTSUPP, "gmlake_advise: %p is a small "
				    "block; only large blocks can move", ptr);
		goto out_unlock;
	}
	ret = gml_off_get(ctx, &off);
	if (ret)
		goto out_unlock;
	b->offloadable = true;
	gml_off_lru_touch(off, b);
out_unlock:
	gml_ctx_unlock(ctx);
	return ret;
}

GML_EXPORT int gmlake_offload_state(gmlake_ctx *ctx, const void *ptr)
{
	struct gml_block *b;
	int ret;

	if (!ctx)
		return gml_set_error(-EINVAL, "gmlake_offload_state: ctx is "
				     "NULL");
	pthread_mutex_lock(&ctx->lock);
	b = gml_ptrmap_get(&ctx->blocks, (uintptr_t)ptr);
	if (!b)
		ret = gml_set_error(-EINVAL, "gmlake_offload_state: %p is not "
				    "a live block", ptr);
	else
		ret = b->small ? GMLAKE_BLOCK_RESIDENT : b->off_state;
	pthread_mutex_unlock(&ctx->lock);
	return ret;
}
