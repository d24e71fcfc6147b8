/* SPDX-License-Identifier: MIT */
/*
 * Spill and fetch, the completion engine, and automatic offload.
 *
 * A spill records an event on each stream of the block, makes the
 * device-to-host copy stream wait for them, copies the block into the host
 * arena, queues a host function that wakes the engine, and records a
 * "done" event. When that event completes, the engine unmaps the block's
 * run and gives its chunks back (alloc.c, gml_large_detach); the range
 * stays reserved, so the address stays valid. A fetch maps chunks at the
 * run again (gml_large_attach, stitching free chunks if need be), copies
 * host to device on the other copy stream, and completes the same way.
 * Spills and fetches use separate streams, so both directions run at once.
 *
 * One engine thread per context starts requests and reaps their copies.
 * It sleeps on an eventfd that submitters and the copy streams' host
 * functions write. With io_uring (probed once at set-up, unless
 * cfg.offload_engine says otherwise) it waits for a read of that eventfd
 * through liburing; otherwise with poll(2): the plain thread engine. A
 * request whose host function could not be queued is polled every
 * millisecond instead.
 *
 * Automatic offload: blocks advised offloadable sit on off->lru, least
 * recently used first. When an allocation (or a fetch) would fail, or pass
 * cfg.device_limit, the tier's reclaim hook (off_reclaim) spills from the
 * head of that list synchronously, in the caller's thread, with the
 * context lock held.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "error.h"
#include "offload.h"

/* Move the arena's byte counts into the context's gauges; ctx lock held. */
static void sync_gauges(gmlake_ctx *ctx)
{
	struct gml_host *h = &gml_off_of(ctx)->host;

	pthread_mutex_lock(&h->lock);
	gml_gauge_add(&ctx->st.host_bytes, h->d_used);
	gml_gauge_add(&ctx->st.host_pinned, h->d_pinned);
	h->d_used = 0;
	h->d_pinned = 0;
	pthread_mutex_unlock(&h->lock);
}

static void wake(struct gml_offload *off)
{
	uint64_t one = 1;

	if (write(off->efd, &one, sizeof(one)) < 0)
		gml_log(GMLAKE_LOG_DEBUG, "offload: cannot wake the engine");
}

/* The host function queued after each copy: runs on a driver thread. */
static void notify(void *arg)
{
	wake(arg);
}

/* ---------------------------------------------------------------------- */
/* LRU of offloadable resident blocks                                      */

static void lru_del(struct gml_offload *off, struct gml_block *b)
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
static void lru_touch(struct gml_offload *off, struct gml_block *b)
{
	lru_del(off, b);
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

/* ---------------------------------------------------------------------- */
/* Copies                                                                  */

/* Make copy stream cs wait for the work queued so far on stream idx. */
static int after_stream(gmlake_ctx *ctx, int idx, gmlake_stream_t cs)
{
	gmlake_stream_t s;
	gml_event e;
	int ret;

	if (!gml_stream_handle(ctx, idx, &s))
		return 0;
	ret = gml_event_create(&ctx->dev, &e);
	if (ret)
		return ret;
	ret = gml_event_record(&ctx->dev, e, s);
	if (!ret)
		ret = gml_stream_wait_event(&ctx->dev, cs, e);
	gml_event_destroy(&ctx->dev, e);
	return ret;
}

/* ... for the work on b's streams (its own and record_stream's). */
static int after_block(gmlake_ctx *ctx, struct gml_block *b, gmlake_stream_t cs)
{
	int ret = 0;

	for (uint32_t i = 0; i <= b->nextra && !ret; i++)
		ret = after_stream(ctx, i < b->nextra ? b->extra[i].stream :
				   b->stream, cs);
	return ret;
}

/* ... for all work: free chunks a fetch takes may still be in use. */
static int after_all(gmlake_ctx *ctx, gmlake_stream_t cs)
{
	int n = gml_stream_count(ctx), ret = 0;

	for (int i = 0; i < n && !ret; i++)
		ret = after_stream(ctx, i, cs);
	return ret;
}

/*
 * Queue one block copy on cs, then the done event, then the engine's
 * wake-up (after the event, so a woken engine finds it complete; the
 * copy streams are drained before the eventfd closes). 0: req->done tells
 * when the copy finished, or has_done is false and the copy already
 * finished. -errno: nothing of the copy is pending.
 */
static int queue_copy(gmlake_ctx *ctx, struct gml_offload *off,
		      struct gml_off_req *req, gmlake_stream_t cs, void *dst,
		      const void *src, enum gml_copy_kind kind, bool wake_engine)
{
	int ret;

	req->t0 = gml_now_ns();
	ret = gml_memcpy(&ctx->dev, dst, src, req->size, kind, cs);
	if (ret)
		return ret;
	req->has_done = false;
	if (!gml_event_create(&ctx->dev, &req->done)) {
		if (!gml_event_record(&ctx->dev, req->done, cs)) {
			req->has_done = true;
			req->notified = wake_engine &&
					!gml_host_func(&ctx->dev, cs, notify,
						       off);
			return 0;
		}
		gml_event_destroy(&ctx->dev, req->done);
	}
	/* No event to wait on: wait for the whole stream now. */
	ret = gml_stream_sync(&ctx->dev, cs);
	if (ret) {
		/* The copy may still run into the buffer: never reuse it. */
		gml_log(GMLAKE_LOG_ERROR, "offload: lost track of a copy: %s",
			gmlake_last_error());
		req->host = NULL;
	}
	return ret;
}

/*
 * Whether req's copy finished; ctx lock held. 0: not yet; 1: done; -errno:
 * neither its event nor its stream answers (a sticky device error, say),
 * so the copy may have run in full, in part or not at all. An event that
 * fails while the stream drains is fine: the copy ran to its end.
 */
static int copy_done(gmlake_ctx *ctx, struct gml_off_req *req,
		     gmlake_stream_t cs)
{
	int ret;

	if (!req->has_done)
		return 1;
	ret = gml_event_query(&ctx->dev, req->done);
	if (ret == -EBUSY)
		return 0;
	if (ret)
		ret = gml_stream_sync(&ctx->dev, cs);
	gml_event_destroy(&ctx->dev, req->done);
	req->has_done = false;
	if (!ret)
		return 1;
	/* Once: the request completes with the error, it is not polled. */
	gml_log(GMLAKE_LOG_ERROR, "offload: the %s copy of block %#lx failed "
		"or cannot be waited for: %s",
		req->op == GMLAKE_OFFLOAD_SPILL ? "spill" : "fetch",
		(unsigned long)req->ptr, gmlake_last_error());
	return ret < 0 ? ret : -EIO;
}

/* ---------------------------------------------------------------------- */
/* In place: host memory mapped at the block's own range while spilled    */

/*
 * Host memory for b as a driver handle on the device's NUMA node, mapped
 * at a second range the copies use. ctx lock held.
 */
static int inplace_prepare(gmlake_ctx *ctx, struct gml_offload *off,
			   struct gml_block *b)
{
	size_t size = b->alloc_size;
	int ret;

	ret = gml_host_charge(&off->host, (int64_t)size);
	if (ret)
		return ret;
	ret = gml_mem_create_host(&ctx->dev, size, off->numa, &b->host_h);
	if (ret)
		goto out_uncharge;
	ret = gml_va_reserve(&ctx->dev, size, ctx->chunk, &b->host_va);
	if (ret)
		goto out_release;
	ret = gml_mem_map(&ctx->dev, b->host_va, size, b->host_h);
	if (ret)
		goto out_free_va;
	ret = gml_set_access(&ctx->dev, b->host_va, size);
	if (ret)
		goto out_unmap;
	b->inplace = true;
	return 0;
out_unmap:
	gml_mem_unmap(&ctx->dev, b->host_va, size);
out_free_va:
	gml_va_free(&ctx->dev, b->host_va, size);
out_release:
	gml_mem_release(&ctx->dev, b->host_h);
out_uncharge:
	gml_host_charge(&off->host, -(int64_t)size);
	b->host_va = 0;
	return ret;
}

/* Undo inplace_prepare (and the mapping at the block's range). */
static void inplace_drop(gmlake_ctx *ctx, struct gml_offload *off,
			 struct gml_block *b)
{
	size_t size = b->alloc_size;
	bool leak = false;

	/* Each step is tried twice: a driver call failing once must not
	 * leak the host memory, its mapping and its range for good. */
	if (b->inplace_mapped && (!gml_mem_unmap(&ctx->dev, b->ptr, size) ||
				  !gml_mem_unmap(&ctx->dev, b->ptr, size)))
		b->inplace_mapped = false;
	if (b->inplace_mapped ||
	    (gml_mem_unmap(&ctx->dev, b->host_va, size) &&
	     gml_mem_unmap(&ctx->dev, b->host_va, size)))
		leak = true;
	if (!leak && gml_va_free(&ctx->dev, b->host_va, size) &&
	    gml_va_free(&ctx->dev, b->host_va, size))
		leak = true;
	if (!leak && gml_mem_release(&ctx->dev, b->host_h) &&
	    gml_mem_release(&ctx->dev, b->host_h))
		leak = true;
	if (leak)
		gml_log(GMLAKE_LOG_WARN, "offload: leaking in-place host "
			"memory of block %#lx: %s", (unsigned long)b->ptr,
			gmlake_last_error());
	gml_host_charge(&off->host, -(int64_t)size);
	b->inplace = false;
	b->inplace_mapped = false;
	b->host_va = 0;
}

/* After the chunks left: the host memory at the block's own range, so a
 * stray access reads the right bytes. Best effort. */
static void inplace_map(gmlake_ctx *ctx, struct gml_block *b)
{
	if (gml_mem_map(&ctx->dev, b->ptr, b->alloc_size, b->host_h))
		return;
	if (gml_set_access(&ctx->dev, b->ptr, b->alloc_size)) {
		gml_mem_unmap(&ctx->dev, b->ptr, b->alloc_size);
		return;
	}
	b->inplace_mapped = true;
}

/*
 * A copy whose fate is unknown may still write b's in-place host memory:
 * forget it rather than give it back (it stays charged against the host
 * limit). ctx lock held.
 */
static void inplace_leak(struct gml_block *b)
{
	gml_log(GMLAKE_LOG_ERROR, "offload: leaking %zu bytes of in-place "
		"host memory of block %#lx: a copy may still write them",
		b->alloc_size, (unsigned long)b->ptr);
	b->inplace = false;
	b->inplace_mapped = false;
	b->host_h = 0;
	b->host_va = 0;
}

/* ---------------------------------------------------------------------- */
/* Spill                                                                   */

static void spill_done(gmlake_ctx *ctx, struct gml_block *b, void *host,
		       size_t size, uint64_t t0)
{
	b->off_state = GML_OFF_SPILLED;
	b->host = host;
	b->host_size = size;
	lru_del(gml_off_of(ctx), b);
	gml_gauge_add(&ctx->st.spilled_bytes, (int64_t)b->size);
	gml_gauge_add(&ctx->st.spilled_blocks, 1);
	gml_gauge_add(&ctx->st.resident_bytes, -(int64_t)b->alloc_size);
	ctx->st.spills++;
	ctx->st.d2h_bytes += size;
	ctx->st.d2h_ns += gml_now_ns() - t0;
}

/* A copy whose fate is unknown may still write req's host buffer: never
 * give it back to the arena. */
static void leak_host(struct gml_off_req *req, struct gml_block *b)
{
	if (!req->host)
		return;
	gml_log(GMLAKE_LOG_ERROR, "offload: leaking %zu bytes of the host "
		"arena: the copy of block %#lx may still write them",
		req->size, (unsigned long)b->ptr);
	req->host = NULL;
}

/* The block req names, if it may take part; ctx lock held. */
static int req_block(gmlake_ctx *ctx, struct gml_off_req *req)
{
	struct gml_block *b = gml_ptrmap_get(&ctx->blocks, req->ptr);

	if (!b)
		return gml_set_error(-EINVAL, "offload: %#lx is not a live "
				     "block", (unsigned long)req->ptr);
	if (b->small)
		return gml_set_error(-EOPNOTSUPP, "offload: %#lx is a small "
				     "block (below the small size); only large "
				     "blocks move", (unsigned long)req->ptr);
	req->b = b;
	return 0;
}

/*
 * Lock the context and find req's block. 0 with the lock held when the
 * block is in state from; otherwise the lock is let go and the result is
 * 1 when the block already is where the request would put it (done), or
 * -errno (-EBUSY while it moves).
 */
static int req_begin(gmlake_ctx *ctx, struct gml_off_req *req, int from,
		     int done)
{
	int ret;

	ret = gml_ctx_lock(ctx);
	if (ret)
		return ret;
	ret = req_block(ctx, req);
	if (!ret && req->b->off_state == done)
		ret = 1;		/* nothing to do */
	else if (!ret && req->b->off_state != from)
		ret = gml_set_error(-EBUSY, "offload: block %#lx is moving",
				    (unsigned long)req->b->ptr);
	if (ret < 0)
		ctx->st.offload_failures++;
	if (ret)
		gml_ctx_unlock(ctx);
	return ret;
}

/* First half of a spill: checks, a host buffer, the copy queued. */
static int spill_start(struct gml_offload *off, struct gml_off_req *req)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_block *b;
	int ret;

	ret = req_begin(ctx, req, GML_OFF_RESIDENT, GML_OFF_SPILLED);
	if (ret)
		return ret;
	b = req->b;
	ret = gml_large_detach(ctx, b, true);
	if (ret)
		goto out_unlock;
	b->off_state = GML_OFF_SPILLING;
	req->size = b->size;
	gml_ctx_unlock(ctx);

	/* Pinning may take long: never with the context lock held. */
	if (!req->inplace)
		ret = gml_host_alloc(&off->host, req->size, true, &req->host);

	if (gml_ctx_lock(ctx)) {
		/* Cannot happen once the device opened; keep the block. */
		b->off_state = GML_OFF_RESIDENT;
		return -EIO;
	}
	if (req->inplace)
		ret = inplace_prepare(ctx, off, b);
	if (!ret)
		ret = after_block(ctx, b, off->d2h);
	if (!ret && req->inplace)
		ret = queue_copy(ctx, off, req, off->d2h,
				 (void *)(uintptr_t)b->host_va, (void *)b->ptr,
				 GML_COPY_DTOD, true);
	else if (!ret)
		ret = queue_copy(ctx, off, req, off->d2h, req->host,
				 (void *)b->ptr, GML_COPY_DTOH, true);
	if (ret) {
		b->off_state = GML_OFF_RESIDENT;
		if (req->host)
			gml_host_free(&off->host, req->host, req->size);
		req->host = NULL;
		if (b->inplace)
			inplace_drop(ctx, off, b);
	}
	sync_gauges(ctx);
out_unlock:
	if (ret < 0)
		ctx->st.offload_failures++;
	gml_ctx_unlock(ctx);
	return ret;
}

/* Second half: the copy is done; give the chunks back. ctx lock held. */
static int spill_finish(struct gml_offload *off, struct gml_off_req *req)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_block *b = req->b;
	int ret;

	ret = req->host || b->inplace ? gml_large_detach(ctx, b, false) : -EIO;
	if (ret) {
		b->off_state = GML_OFF_RESIDENT;
		if (req->host)
			gml_host_free(&off->host, req->host, req->size);
		if (b->inplace)
			inplace_drop(ctx, off, b);
		ctx->st.offload_failures++;
		return ret;
	}
	if (b->inplace)
		inplace_map(ctx, b);
	spill_done(ctx, b, req->host, req->host ? req->size : 0, req->t0);
	ctx->st.d2h_bytes += req->host ? 0 : req->size;
	return 0;
}

/*
 * The copy failed or nobody can tell: the block stays on the device, as it
 * was before the spill (its chunks never left), and the host side the copy
 * may still write is leaked, never reused. ctx lock held.
 */
static int spill_fail(struct gml_offload *off, struct gml_off_req *req,
		      int err)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_block *b = req->b;

	b->off_state = GML_OFF_RESIDENT;
	leak_host(req, b);
	if (b->inplace)
		inplace_leak(b);
	ctx->st.offload_failures++;
	return err;
}

/*
 * Spill b now, in this thread, from the arena's free space only: the
 * allocation path under pressure. ctx lock held. 0 or -errno, b intact.
 */
static int spill_sync(gmlake_ctx *ctx, struct gml_offload *off,
		      struct gml_block *b)
{
	struct gml_off_req req;
	int ret;

	memset(&req, 0, sizeof(req));
	req.size = b->size;
	ret = gml_large_detach(ctx, b, true);
	if (ret)
		return ret;
	ret = gml_host_alloc(&off->host, req.size, false, &req.host);
	if (ret) {
		wake(off);		/* the engine pins more, ahead */
		return ret;
	}
	ret = after_block(ctx, b, off->d2h);
	if (!ret)
		ret = queue_copy(ctx, off, &req, off->d2h, req.host,
				 (void *)b->ptr, GML_COPY_DTOH, false);
	if (!ret && req.has_done) {
		ret = gml_event_sync(&ctx->dev, req.done);
		if (ret)
			ret = gml_stream_sync(&ctx->dev, off->d2h);
		gml_event_destroy(&ctx->dev, req.done);
		if (ret) {
			gml_log(GMLAKE_LOG_ERROR, "offload: the automatic "
				"spill of block %#lx failed or cannot be "
				"waited for: %s", (unsigned long)b->ptr,
				gmlake_last_error());
			leak_host(&req, b);
			ctx->st.offload_failures++;
		}
	}
	if (!ret)
		ret = gml_large_detach(ctx, b, false);
	if (ret) {
		if (req.host)
			gml_host_free(&off->host, req.host, req.size);
		sync_gauges(ctx);
		return ret;
	}
	spill_done(ctx, b, req.host, req.size, req.t0);
	sync_gauges(ctx);
	return 0;
}

/* The tier's reclaim hook: spill one offloadable block, least recently
 * used first, never keep. */
static bool off_reclaim(gmlake_ctx *ctx, uint32_t chunks,
			struct gml_block *keep)
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
		if (spill_sync(ctx, off, b))
			continue;
		freed += b->n;
		ctx->st.auto_spills++;
	}
	(void)chunks;
	return freed > 0;
}

/* ---------------------------------------------------------------------- */
/* Fetch                                                                   */

/*
 * No fetch after all: b is spilled again with its host copy, which the
 * copy only read, and the chunks it took go back. ctx lock held.
 */
static void fetch_undo(gmlake_ctx *ctx, struct gml_block *b)
{
	/* The fetch may have taken chunks whose last work elsewhere is
	 * still queued; as spares they would serve at once. */
	if (gml_stale_pending(ctx) && gml_streams_wait_all(ctx))
		gml_log(GMLAKE_LOG_ERROR, "offload: cannot wait for the work "
			"on the chunks of block %#lx: %s", (unsigned long)b->ptr,
			gmlake_last_error());
	if (gml_large_detach(ctx, b, false)) {
		/* The chunks stay; the bytes on the host are still right. */
		gml_log(GMLAKE_LOG_ERROR, "offload: block %#lx holds chunks "
			"it could not fill", (unsigned long)b->ptr);
	}
	b->off_state = GML_OFF_SPILLED;
	gml_gauge_add(&ctx->st.resident_bytes, -(int64_t)b->alloc_size);
	if (b->inplace)
		inplace_map(ctx, b);
}

static int fetch_start(struct gml_offload *off, struct gml_off_req *req)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_block *b;
	int64_t peak;
	int ret;

	ret = req_begin(ctx, req, GML_OFF_SPILLED, GML_OFF_RESIDENT);
	if (ret)
		return ret;
	b = req->b;
	peak = ctx->st.reserved_bytes.peak;
	if (b->inplace_mapped) {
		ret = gml_mem_unmap(&ctx->dev, b->ptr, b->alloc_size);
		if (ret)
			goto out_unlock;
		b->inplace_mapped = false;
	}
	ret = gml_large_attach(ctx, b);
	while (ret == -ENOMEM && off_reclaim(ctx, b->n, b))
		ret = gml_large_attach(ctx, b);
	if (ret) {
		if (b->inplace)
			inplace_map(ctx, b);
		goto out_unlock;
	}
	b->off_state = GML_OFF_FETCHING;
	gml_gauge_add(&ctx->st.resident_bytes, (int64_t)b->alloc_size);
	gml_log_peak_slack(ctx, "a fetch", b->alloc_size, peak);
	req->size = b->size;
	ret = after_all(ctx, off->h2d);
	if (!ret && b->inplace)
		ret = queue_copy(ctx, off, req, off->h2d, (void *)b->ptr,
				 (void *)(uintptr_t)b->host_va, GML_COPY_DTOD,
				 true);
	else if (!ret)
		ret = queue_copy(ctx, off, req, off->h2d, (void *)b->ptr,
				 b->host, GML_COPY_HTOD, true);
	if (ret)
		fetch_undo(ctx, b);
out_unlock:
	if (ret < 0)
		ctx->st.offload_failures++;
	gml_ctx_unlock(ctx);
	return ret;
}

/* The copy is done: the block is resident again. ctx lock held. */
static int fetch_finish(struct gml_offload *off, struct gml_off_req *req)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_block *b = req->b;

	if (b->inplace)
		inplace_drop(ctx, off, b);
	else
		gml_host_free(&off->host, b->host, b->host_size);
	b->host = NULL;
	b->host_size = 0;
	b->off_state = GML_OFF_RESIDENT;
	gml_gauge_add(&ctx->st.spilled_bytes, -(int64_t)b->size);
	gml_gauge_add(&ctx->st.spilled_blocks, -1);
	ctx->st.fetches++;
	ctx->st.h2d_bytes += req->size;
	ctx->st.h2d_ns += gml_now_ns() - req->t0;
	lru_touch(off, b);
	sync_gauges(ctx);
	return 0;
}

/* The copy failed or nobody can tell: never free the host copy, the only
 * one known good. ctx lock held. */
static int fetch_fail(struct gml_offload *off, struct gml_off_req *req,
		      int err)
{
	gmlake_ctx *ctx = off->ctx;

	fetch_undo(ctx, req->b);
	ctx->st.offload_failures++;
	return err;
}

/* ---------------------------------------------------------------------- */
/* The engine thread                                                       */

static void start(struct gml_offload *off, struct gml_off_req *req)
{
	int ret;

	switch (req->op) {
	case GMLAKE_OFFLOAD_SPILL:
		ret = spill_start(off, req);
		break;
	case GMLAKE_OFFLOAD_FETCH:
	case GMLAKE_OFFLOAD_PREFETCH:
		ret = fetch_start(off, req);
		break;
	default:
		ret = gml_set_error(-EINVAL, "offload: unknown operation %u",
				    req->op);
		break;
	}
	if (ret) {
		req->complete(req, ret > 0 ? 0 : ret);
		return;
	}
	req->next = off->inflight;
	off->inflight = req;
}

/* Finish every request whose copy completed. */
static void reap(struct gml_offload *off)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_off_req **pp, *req;
	int ret, done;

	if (!off->inflight || gml_ctx_lock(ctx))
		return;
	for (pp = &off->inflight; (req = *pp);) {
		bool spill = req->op == GMLAKE_OFFLOAD_SPILL;

		done = copy_done(ctx, req, spill ? off->d2h : off->h2d);
		if (!done) {
			pp = &req->next;
			continue;
		}
		*pp = req->next;
		if (done < 0)
			ret = spill ? spill_fail(off, req, done) :
				      fetch_fail(off, req, done);
		else
			ret = spill ? spill_finish(off, req) :
				      fetch_finish(off, req);
		sync_gauges(ctx);
		req->complete(req, ret);
	}
	gml_ctx_unlock(ctx);
}

/*
 * The allocator's chunk timer (gml_chunks_tend: stale positions, spare
 * chunks kept for fetches), which only offload makes work for, runs on
 * the engine thread. The milliseconds until its next look, or -1.
 */
static int tend_chunks(struct gml_offload *off)
{
	gmlake_ctx *ctx = off->ctx;
	int ms;

	if (gml_ctx_lock(ctx))
		return -1;
	ms = gml_chunks_tend(ctx);
	gml_ctx_unlock(ctx);
	return ms;
}

/* Requests handed in: spills and fetches first, then prefetches. */
static void start_incoming(struct gml_offload *off, struct gml_off_req *list)
{
	struct gml_off_req *later = NULL, **tail = &later, *req, *next;

	for (req = list; req; req = next) {
		next = req->next;
		if (req->op == GMLAKE_OFFLOAD_PREFETCH) {
			req->next = NULL;
			*tail = req;
			tail = &req->next;
			continue;
		}
		start(off, req);
	}
	for (req = later; req; req = next) {
		next = req->next;
		start(off, req);
	}
}

/* Sleep until woken (or timeout_ms passes; -1: no limit). */
static void sleep_uring(struct gml_offload *off, int timeout_ms)
{
	struct io_uring_cqe *cqe = NULL;
	struct io_uring_sqe *sqe;
	int ret;

	if (!off->uring_armed) {
		sqe = io_uring_get_sqe(&off->uring);
		if (!sqe)
			return;
		io_uring_prep_read(sqe, off->efd, &off->efd_buf,
				   sizeof(off->efd_buf), 0);
		if (io_uring_submit(&off->uring) < 1)
			return;
		off->uring_armed = true;
	}
	if (timeout_ms < 0) {
		ret = io_uring_wait_cqe(&off->uring, &cqe);
	} else {
		struct __kernel_timespec ts = {
			.tv_sec = timeout_ms / 1000,
			.tv_nsec = (long long)(timeout_ms % 1000) * 1000000,
		};

		ret = io_uring_wait_cqe_timeout(&off->uring, &cqe, &ts);
	}
	if (!ret && cqe) {
		io_uring_cqe_seen(&off->uring, cqe);
		off->uring_armed = false;
	}
}

static void sleep_thread(struct gml_offload *off, int timeout_ms)
{
	struct pollfd p = { .fd = off->efd, .events = POLLIN };
	uint64_t v;

	if (poll(&p, 1, timeout_ms) > 0 &&
	    read(off->efd, &v, sizeof(v)) < 0)
		gml_log(GMLAKE_LOG_DEBUG, "offload: eventfd read failed");
}

static void *engine_main(void *arg)
{
	struct gml_offload *off = arg;
	struct gml_off_req *list, *req;
	bool stop, poll_needed;
	int timeout, spares_ms;

	gml_host_prepin(&off->host);
	if (!gml_ctx_lock(off->ctx)) {
		/* Else the next sync counts what was pinned. */
		if (gml_off_of(off->ctx) == off)
			sync_gauges(off->ctx);
		gml_ctx_unlock(off->ctx);
	}
	for (;;) {
		pthread_mutex_lock(&off->lock);
		list = off->incoming;
		off->incoming = NULL;
		stop = off->stop;
		pthread_mutex_unlock(&off->lock);
		if (stop) {
			/* Not started: cancelled. In flight: waited for. */
			for (; list; list = req) {
				req = list->next;
				list->complete(list, -ECANCELED);
			}
		}
		start_incoming(off, list);
		reap(off);
		if (stop && !off->inflight)
			break;
		gml_host_grow_ahead(&off->host);
		poll_needed = false;
		for (req = off->inflight; req; req = req->next)
			poll_needed |= !req->notified;
		/*
		 * Woken by submitters and by each copy's host function; while
		 * copies are in flight a 5 ms timeout as well, as a safety net
		 * (an in-place round trip on the emulated device was seen to
		 * miss a wake-up, not understood yet).
		 */
		timeout = poll_needed || stop ? 1 : off->inflight ? 5 : 200;
		spares_ms = tend_chunks(off);
		if (spares_ms >= 0 && spares_ms < timeout)
			timeout = spares_ms;
		if (off->engine == GMLAKE_OFFLOAD_ENGINE_URING)
			sleep_uring(off, timeout);
		else
			sleep_thread(off, timeout);
	}
	return NULL;
}

void gml_off_queue(struct gml_offload *off, struct gml_off_req *list)
{
	struct gml_off_req **tail;

	pthread_mutex_lock(&off->lock);
	for (tail = &off->incoming; *tail; tail = &(*tail)->next)
		;
	*tail = list;
	pthread_mutex_unlock(&off->lock);
	wake(off);
}

/* ---------------------------------------------------------------------- */
/* Set-up and tear-down                                                    */

/* io_uring unless told otherwise and if the kernel lets us. */
static int pick_engine(gmlake_ctx *ctx, struct gml_offload *off)
{
	int want = gml_ctx_config(ctx)->offload_engine, ret;

	if (want == GMLAKE_OFFLOAD_ENGINE_THREAD)
		return GMLAKE_OFFLOAD_ENGINE_THREAD;
	ret = io_uring_queue_init(4, &off->uring, 0);
	if (!ret)
		return GMLAKE_OFFLOAD_ENGINE_URING;
	gml_log(want == GMLAKE_OFFLOAD_ENGINE_URING ? GMLAKE_LOG_WARN :
		GMLAKE_LOG_INFO, "offload: io_uring unavailable (%s), using "
		"the thread engine", strerror(-ret));
	return GMLAKE_OFFLOAD_ENGINE_THREAD;
}

static void off_free(gmlake_ctx *ctx, struct gml_offload *off)
{
	/* Host functions still queued write the eventfd: let them run. */
	if (off->d2h)
		ctx->dev.ops->stream_sync(ctx->dev.priv, off->d2h);
	if (off->h2d)
		ctx->dev.ops->stream_sync(ctx->dev.priv, off->h2d);
	if (off->engine == GMLAKE_OFFLOAD_ENGINE_URING)
		io_uring_queue_exit(&off->uring);
	if (off->efd >= 0)
		close(off->efd);
	if (off->h2d)
		ctx->dev.ops->stream_destroy(ctx->dev.priv, off->h2d);
	if (off->d2h)
		ctx->dev.ops->stream_destroy(ctx->dev.priv, off->d2h);
	gml_host_fini(&off->host);
	pthread_cond_destroy(&off->idle);
	pthread_mutex_destroy(&off->lock);
	free(off);
}

/* Stop the engine: requests not started are cancelled, copies in flight
 * finish. No lock held. */
static void off_quiesce(struct gml_offload *off)
{
	if (!off->started)
		return;
	pthread_mutex_lock(&off->lock);
	off->stop = true;
	pthread_mutex_unlock(&off->lock);
	wake(off);
	pthread_join(off->thread, NULL);
	off->started = false;
}

int gml_off_get(gmlake_ctx *ctx, struct gml_offload **out)
{
	struct gml_offload *off;
	int ret;

	if (gml_off_of(ctx)) {
		*out = gml_off_of(ctx);
		return 0;
	}
	off = calloc(1, sizeof(*off));
	if (!off)
		return gml_set_error(-ENOMEM, "no host memory for the offload "
				     "manager");
	off->ctx = ctx;
	off->efd = -1;
	pthread_mutex_init(&off->lock, NULL);
	pthread_cond_init(&off->idle, NULL);
	if (gml_host_numa(&ctx->dev, &off->numa))
		off->numa = -1;
	ret = gml_host_init(&off->host, &ctx->dev, off->numa,
			    gml_ctx_config(ctx)->host_limit,
			    gml_ctx_config(ctx)->host_pin);
	if (ret)
		goto out_free;
	ret = ctx->dev.ops->stream_create(ctx->dev.priv, &off->d2h);
	if (!ret)
		ret = ctx->dev.ops->stream_create(ctx->dev.priv, &off->h2d);
	if (ret)
		goto out_free;
	off->efd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	if (off->efd < 0) {
		ret = gml_set_error(-errno, "offload: eventfd: %s",
				    strerror(errno));
		goto out_free;
	}
	off->engine = pick_engine(ctx, off);
	ret = -pthread_create(&off->thread, NULL, engine_main, off);
	if (ret) {
		gml_set_error(ret, "offload: cannot start the engine thread");
		goto out_free;
	}
	off->started = true;
	ctx->st.offload_engine = off->engine;
	ret = gml_tier_register(ctx, &gml_off_tier, off);
	if (ret) {
		off_quiesce(off);
		goto out_free;
	}
	gml_streams_mark_always(ctx);
	sync_gauges(ctx);
	*out = off;
	return 0;
out_free:
	off_free(ctx, off);
	return ret;
}

/* The tier's quiesce hook. */
static void off_tier_quiesce(gmlake_ctx *ctx)
{
	off_quiesce(gml_off_of(ctx));
}

/* The tier's fini hook: after every block is gone; ctx lock held. */
static void off_fini(gmlake_ctx *ctx)
{
	struct gml_offload *off = gml_off_of(ctx);

	off_quiesce(off);
	sync_gauges(ctx);
	off_free(ctx, off);
}

/* The tier's block_gone hook: a block is freed, its host side goes with
 * it. ctx lock held. */
static void off_block_gone(gmlake_ctx *ctx, struct gml_block *b)
{
	struct gml_offload *off = gml_off_of(ctx);

	lru_del(off, b);
	if (b->off_state != GML_OFF_SPILLED)
		return;
	if (b->host)
		gml_host_free(&off->host, b->host, b->host_size);
	if (b->inplace)
		inplace_drop(ctx, off, b);
	b->host = NULL;
	gml_gauge_add(&ctx->st.spilled_bytes, -(int64_t)b->size);
	gml_gauge_add(&ctx->st.spilled_blocks, -1);
	sync_gauges(ctx);
}

const struct gml_tier_ops gml_off_tier = {
	.reclaim = off_reclaim,
	.block_gone = off_block_gone,
	.quiesce = off_tier_quiesce,
	.fini = off_fini,
};

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
			lru_del(gml_off_of(ctx), b);
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
	lru_touch(off, b);
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
