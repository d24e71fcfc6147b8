/* SPDX-License-Identifier: MIT */
/*
 * One request's mechanics: how a block moves to the host and back.
 *
 * A spill records an event on each stream of the block, makes the
 * device-to-host copy stream wait for them, copies the block into the host
 * arena, records a "done" event and queues a host function that wakes the
 * engine on a wake stream behind it; the engine issues copies with the
 * context lock let go (queue_copy_unlocked). When the event completes,
 * the engine (engine.c) unmaps the block's run and gives its chunks back
 * (gml_large_detach); the range stays reserved, so the address stays
 * valid. A fetch maps chunks at the run again (gml_large_attach,
 * stitching free chunks if need be), leaving their device access to the
 * engine, which grants it once for a run of adjacent fetched blocks
 * (gml_off_fetch_grant), then copies host to device on the other copy
 * stream, and completes the same way. Spills and fetches use
 * separate streams, so both directions run at once.
 * In place, the host side is host memory made as a driver handle and
 * mapped at the block's own range while it is spilled. A copy whose fate
 * is unknown (a device gone bad) never lets its buffer be reused.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <string.h>

#include "error.h"
#include "offload.h"

/* Move the arena's byte counts into the context's gauges; ctx lock held. */
void gml_off_sync_gauges(gmlake_ctx *ctx)
{
	struct gml_host *h = &gml_off_of(ctx)->host;

	pthread_mutex_lock(&h->lock);
	gml_gauge_add(&ctx->st.host_bytes, h->d_used);
	gml_gauge_add(&ctx->st.host_pinned, h->d_pinned);
	h->d_used = 0;
	h->d_pinned = 0;
	pthread_mutex_unlock(&h->lock);
}

/* The host function queued after each copy: runs on a driver thread. */
static void notify(void *arg)
{
	gml_off_wake(arg);
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
	ret = gml_dev_event_create(&ctx->dev, &e);
	if (ret)
		return ret;
	ret = gml_dev_event_record(&ctx->dev, e, s);
	if (!ret)
		ret = gml_dev_stream_wait_event(&ctx->dev, cs, e);
	gml_dev_event_destroy(&ctx->dev, e);
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
 * Queue the engine's wake-up for req's copy on the wake stream of its copy
 * stream cs, behind the copy's done event: a woken engine finds the event
 * complete, and the copy stream goes on to its next copy without waiting
 * for the host function to run (a host function holds its stream until
 * it has). The wake streams are drained before the eventfd closes.
 * false: nothing will wake the engine; it polls the copy.
 */
static bool queue_wake(gmlake_ctx *ctx, struct gml_offload *off,
		       struct gml_off_req *req, gmlake_stream_t cs)
{
	gmlake_stream_t ws = cs == off->d2h ? off->wake_d2h : off->wake_h2d;

	return !gml_dev_stream_wait_event(&ctx->dev, ws, req->done) &&
	       !gml_dev_host_func(&ctx->dev, ws, notify, off);
}

/*
 * Queue one block copy on cs, then the done event, then the engine's
 * wake-up (queue_wake). 0: req->done tells when the copy finished, or
 * has_done is false and the copy already finished. -errno: nothing of the
 * copy is pending.
 */
static int queue_copy(gmlake_ctx *ctx, struct gml_offload *off,
		      struct gml_off_req *req, gmlake_stream_t cs, void *dst,
		      const void *src, enum gml_copy_kind kind, bool wake_engine)
{
	int ret;

	req->t0 = gml_now_ns();
	ret = gml_dev_memcpy(&ctx->dev, dst, src, req->size, kind, cs);
	if (ret)
		return ret;
	req->has_done = false;
	if (!gml_dev_event_create(&ctx->dev, &req->done)) {
		if (!gml_dev_event_record(&ctx->dev, req->done, cs)) {
			req->has_done = true;
			req->notified = wake_engine &&
					queue_wake(ctx, off, req, cs);
			return 0;
		}
		gml_dev_event_destroy(&ctx->dev, req->done);
	}
	/* No event to wait on: wait for the whole stream now. */
	ret = gml_dev_stream_sync(&ctx->dev, cs);
	if (ret) {
		/* The copy may still run into the buffer: never reuse it. */
		gml_log(GMLAKE_LOG_ERROR, "offload: lost track of a copy: %s",
			gmlake_last_error());
		req->host = NULL;
	}
	return ret;
}

/*
 * queue_copy() for the engine, with the context lock let go around it: on
 * the H200 issuing a copy blocks 0.3-0.7 ms while the copy stream's queue
 * is full (offload_bench -c), and the application's allocations wait for
 * that lock. req's block is spilling or fetching and bound to req, so
 * nothing else moves or frees it meanwhile. ctx lock held on entry and on
 * return.
 */
static int queue_copy_unlocked(gmlake_ctx *ctx, struct gml_offload *off,
			       struct gml_off_req *req, gmlake_stream_t cs,
			       void *dst, const void *src,
			       enum gml_copy_kind kind)
{
	/* Entered once more, the device's context stays current past the
	 * unlock; the lock is taken back without entering again. */
	int ret = gml_dev_enter(&ctx->dev);

	if (ret)
		return ret;
	gml_ctx_unlock(ctx);
	ret = queue_copy(ctx, off, req, cs, dst, src, kind, true);
	pthread_mutex_lock(&ctx->lock);
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
	ret = gml_dev_event_query(&ctx->dev, req->done);
	if (ret == -EBUSY)
		return 0;
	if (ret)
		ret = gml_dev_stream_sync(&ctx->dev, cs);
	gml_dev_event_destroy(&ctx->dev, req->done);
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
	size_t size = gml_large_bytes(ctx, b);
	int ret;

	ret = gml_host_charge(&off->host, (int64_t)size);
	if (ret)
		return ret;
	ret = gml_dev_mem_create_host(&ctx->dev, size, off->numa, &b->host_h);
	if (ret)
		goto out_uncharge;
	ret = gml_dev_va_reserve(&ctx->dev, size, ctx->chunk, &b->host_va);
	if (ret)
		goto out_release;
	ret = gml_dev_mem_map(&ctx->dev, b->host_va, size, b->host_h);
	if (ret)
		goto out_free_va;
	ret = gml_dev_set_access(&ctx->dev, b->host_va, size);
	if (ret)
		goto out_unmap;
	b->inplace = true;
	return 0;
out_unmap:
	gml_dev_mem_unmap(&ctx->dev, b->host_va, size);
out_free_va:
	gml_dev_va_free(&ctx->dev, b->host_va, size);
out_release:
	gml_dev_mem_release(&ctx->dev, b->host_h);
out_uncharge:
	gml_host_charge(&off->host, -(int64_t)size);
	b->host_va = 0;
	return ret;
}

/* Undo inplace_prepare (and the mapping at the block's range); ctx lock
 * held. */
void gml_off_inplace_drop(gmlake_ctx *ctx, struct gml_offload *off,
			  struct gml_block *b)
{
	size_t size = gml_large_bytes(ctx, b);
	bool leak = false;

	/* Each step is tried twice: a driver call failing once must not
	 * leak the host memory, its mapping and its range for good. */
	if (b->inplace_mapped && (!gml_dev_mem_unmap(&ctx->dev, b->ptr, size) ||
				  !gml_dev_mem_unmap(&ctx->dev, b->ptr, size)))
		b->inplace_mapped = false;
	if (b->inplace_mapped ||
	    (gml_dev_mem_unmap(&ctx->dev, b->host_va, size) &&
	     gml_dev_mem_unmap(&ctx->dev, b->host_va, size)))
		leak = true;
	if (!leak && gml_dev_va_free(&ctx->dev, b->host_va, size) &&
	    gml_dev_va_free(&ctx->dev, b->host_va, size))
		leak = true;
	if (!leak && gml_dev_mem_release(&ctx->dev, b->host_h) &&
	    gml_dev_mem_release(&ctx->dev, b->host_h))
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
	size_t size = gml_large_bytes(ctx, b);

	if (gml_dev_mem_map(&ctx->dev, b->ptr, size, b->host_h))
		return;
	if (gml_dev_set_access(&ctx->dev, b->ptr, size)) {
		gml_dev_mem_unmap(&ctx->dev, b->ptr, size);
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
	gml_log(GMLAKE_LOG_ERROR, "offload: leaking the in-place host "
		"memory of block %#lx (%u chunks): a copy may still write them",
		(unsigned long)b->ptr, b->n);
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
	gml_off_lru_del(gml_off_of(ctx), b);
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

/*
 * A request is bound to the block at its address when it is submitted,
 * not when the engine starts it: by then the caller may have freed that
 * block and allocated another at the same address. The binding is a
 * count on the block (off_refs) that makes gmlake_free refuse with -EBUSY
 * until the request is over.
 */
void gml_off_bind(gmlake_ctx *ctx, struct gml_off_req *list)
{
	pthread_mutex_lock(&ctx->lock);	/* no driver call: no enter */
	for (struct gml_off_req *req = list; req; req = req->next) {
		struct gml_block *b = gml_ptrmap_get(&ctx->blocks, req->ptr);

		if (!b) {
			req->err = -EINVAL;
		} else if (b->small) {
			req->err = -EOPNOTSUPP;
		} else {
			b->off_refs++;
			req->b = b;
		}
	}
	pthread_mutex_unlock(&ctx->lock);
}

void gml_off_unbind(struct gml_off_req *req)
{
	if (req->b)
		req->b->off_refs--;
	req->b = NULL;
}

/* Whether req is bound to a block that may take part. */
static int req_block(const struct gml_off_req *req)
{
	if (req->err == -EOPNOTSUPP)
		return gml_set_error(-EOPNOTSUPP, "offload: %#lx is a small "
				     "block (below the small size); only large "
				     "blocks move", (unsigned long)req->ptr);
	if (req->err || !req->b)
		return gml_set_error(-EINVAL, "offload: %#lx is not a live "
				     "block", (unsigned long)req->ptr);
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
	ret = req_block(req);
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
int gml_off_spill_start(struct gml_offload *off, struct gml_off_req *req)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_block *b;
	int ret;

	ret = req_begin(ctx, req, GML_OFF_RESIDENT, GML_OFF_SPILLED);
	if (ret)
		return ret;
	b = req->b;
	ret = gml_large_detach(ctx, b, true);
	if (!ret && req->inplace && gml_large_keeps(b))
		ret = gml_set_error(-EBUSY, "offload: block %#lx shares a "
				    "growth handle with memory in use, and an "
				    "in-place spill maps host memory over all "
				    "of it", (unsigned long)b->ptr);
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
		ret = queue_copy_unlocked(ctx, off, req, off->d2h,
					  (void *)(uintptr_t)b->host_va,
					  (void *)b->ptr, GML_COPY_DTOD);
	else if (!ret)
		ret = queue_copy_unlocked(ctx, off, req, off->d2h, req->host,
					  (void *)b->ptr, GML_COPY_DTOH);
	if (ret) {
		b->off_state = GML_OFF_RESIDENT;
		if (req->host)
			gml_host_free(&off->host, req->host, req->size);
		req->host = NULL;
		if (b->inplace)
			gml_off_inplace_drop(ctx, off, b);
	}
	gml_off_sync_gauges(ctx);
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
			gml_off_inplace_drop(ctx, off, b);
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
 * Spill b now, in this thread: the allocation path under pressure. The
 * arena grows here if it must (pinning under the context lock is slow,
 * but the request would fail otherwise). ctx lock held. 0 or -errno, b
 * intact.
 */
int gml_off_spill_sync(gmlake_ctx *ctx, struct gml_offload *off,
		       struct gml_block *b)
{
	struct gml_off_req req;
	int ret;

	memset(&req, 0, sizeof(req));
	req.size = b->size;
	ret = gml_large_detach(ctx, b, true);
	if (ret)
		return ret;
	ret = gml_host_alloc(&off->host, req.size, true, &req.host);
	gml_off_wake(off);		/* the engine pins more, ahead */
	if (ret)
		return ret;
	ret = after_block(ctx, b, off->d2h);
	if (!ret)
		ret = queue_copy(ctx, off, &req, off->d2h, req.host,
				 (void *)b->ptr, GML_COPY_DTOH, false);
	if (!ret && req.has_done) {
		ret = gml_dev_event_sync(&ctx->dev, req.done);
		if (ret)
			ret = gml_dev_stream_sync(&ctx->dev, off->d2h);
		gml_dev_event_destroy(&ctx->dev, req.done);
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
		gml_off_sync_gauges(ctx);
		return ret;
	}
	spill_done(ctx, b, req.host, req.size, req.t0);
	gml_off_sync_gauges(ctx);
	return 0;
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
	/* A spilled block holds no chunks: an unmap the driver refused
	 * once (the block is left intact) is tried again; refused again,
	 * the block stays spilled with its chunks (stuck), its host copy
	 * the good one, and the next fetch fills them where they are. */
	b->stuck = gml_large_detach(ctx, b, false) &&
		   gml_large_detach(ctx, b, false);
	if (b->stuck)
		gml_log(GMLAKE_LOG_ERROR, "offload: block %#lx keeps chunks "
			"the driver would not unmap: %s; its bytes are on the "
			"host until a fetch", (unsigned long)b->ptr,
			gmlake_last_error());
	b->off_state = GML_OFF_SPILLED;
	gml_gauge_add(&ctx->st.resident_bytes, -(int64_t)b->alloc_size);
	if (b->inplace && !b->stuck)
		inplace_map(ctx, b);
}

int gml_off_fetch_prepare(struct gml_offload *off, struct gml_off_req *req,
			  struct gml_access *acc)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_block *b;
	int64_t peak;
	int ret;

	*acc = (struct gml_access){ 0 };
	ret = req_begin(ctx, req, GML_OFF_SPILLED, GML_OFF_RESIDENT);
	if (ret)
		return ret;
	b = req->b;
	peak = ctx->st.reserved_bytes.peak;
	if (b->inplace_mapped) {
		ret = gml_dev_mem_unmap(&ctx->dev, b->ptr,
					gml_large_bytes(ctx, b));
		if (ret)
			goto out_unlock;
		b->inplace_mapped = false;
	}
	ret = gml_large_attach(ctx, b, acc);
	for (unsigned rung = 0;
	     ret == -ENOMEM && gml_pressure_relieve(ctx, &rung, b);)
		ret = gml_large_attach(ctx, b, acc);
	if (ret) {
		if (b->inplace)
			inplace_map(ctx, b);
		goto out_unlock;
	}
	b->off_state = GML_OFF_FETCHING;
	gml_gauge_add(&ctx->st.resident_bytes, (int64_t)b->alloc_size);
	gml_log_peak_slack(ctx, "a fetch", b->alloc_size, peak);
	req->size = b->size;
	/* Held until gml_off_fetch_copy: its lock then needs no enter. */
	ret = gml_dev_enter(&ctx->dev);
	if (ret)
		fetch_undo(ctx, b);
out_unlock:
	if (ret < 0)
		ctx->st.offload_failures++;
	gml_ctx_unlock(ctx);
	return ret;
}

int gml_off_fetch_order(struct gml_offload *off)
{
	gmlake_ctx *ctx = off->ctx;
	int ret = gml_ctx_lock(ctx);

	if (ret)
		return ret;
	ret = after_all(ctx, off->h2d);
	gml_ctx_unlock(ctx);
	return ret;
}

int gml_off_fetch_grant(struct gml_offload *off, const struct gml_access *run)
{
	gmlake_ctx *ctx = off->ctx;
	int ret;

	if (!run->size)
		return 0;
	ret = gml_dev_enter(&ctx->dev);
	if (ret)
		return ret;
	ret = gml_dev_set_access(&ctx->dev, run->va, run->size);
	gml_dev_leave(&ctx->dev);
	return ret;
}

int gml_off_fetch_copy(struct gml_offload *off, struct gml_off_req *req,
		       const struct gml_access *acc, int granted)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_block *b = req->b;
	int ret = granted;

	/* The context entered by gml_off_fetch_prepare: a lock alone. */
	pthread_mutex_lock(&ctx->lock);
	if (!ret && acc->size)
		gml_large_granted(ctx, acc);
	if (!ret && b->inplace)
		ret = queue_copy_unlocked(ctx, off, req, off->h2d,
					  (void *)b->ptr,
					  (void *)(uintptr_t)b->host_va,
					  GML_COPY_DTOD);
	else if (!ret)
		ret = queue_copy_unlocked(ctx, off, req, off->h2d,
					  (void *)b->ptr, b->host,
					  GML_COPY_HTOD);
	if (ret) {
		fetch_undo(ctx, b);
		ctx->st.offload_failures++;
	}
	gml_ctx_unlock(ctx);
	return ret;
}

/* The copy is done: the block is resident again. ctx lock held. */
static int fetch_finish(struct gml_offload *off, struct gml_off_req *req)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_block *b = req->b;

	if (b->inplace)
		gml_off_inplace_drop(ctx, off, b);
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
	gml_off_lru_touch(off, b);
	gml_off_sync_gauges(ctx);
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
/* A request from start to end                                            */

bool gml_off_move_reap(struct gml_offload *off, struct gml_off_req *req,
		       int *res)
{
	bool spill = req->op == GMLAKE_OFFLOAD_SPILL;
	int done;

	done = copy_done(off->ctx, req, spill ? off->d2h : off->h2d);
	if (!done)
		return false;
	if (done < 0)
		*res = spill ? spill_fail(off, req, done) :
			       fetch_fail(off, req, done);
	else
		*res = spill ? spill_finish(off, req) : fetch_finish(off, req);
	return true;
}
