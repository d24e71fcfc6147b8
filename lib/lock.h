/* SPDX-License-Identifier: MIT */
/*
 * The context lock: ctx->lock, taken with the device's context made
 * current in the calling thread (CUDA), so that every driver call under it
 * runs against the right device. Inline beside the mutex, so the layers
 * above the allocator (offload/) take it without calling into the public
 * entry points of ctx.c.
 */
#ifndef GML_LOCK_H
#define GML_LOCK_H

#include <pthread.h>

#include "types.h"

/* 0 with the lock held, or -errno with it not held. */
static inline int gml_ctx_lock(gmlake_ctx *ctx)
{
	int ret;

	pthread_mutex_lock(&ctx->lock);
	ret = gml_dev_enter(&ctx->dev);
	if (ret)
		pthread_mutex_unlock(&ctx->lock);
	return ret;
}

static inline void gml_ctx_unlock(gmlake_ctx *ctx)
{
	gml_dev_leave(&ctx->dev);
	pthread_mutex_unlock(&ctx->lock);
}

#endif
