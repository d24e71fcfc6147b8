/* SPDX-License-Identifier: MIT */
/*
 * The engine thread: one per context, it starts the requests submitted
 * through the rings (move.c does each one's work) and reaps their copies,
 * and it drives the allocator's chunk timer. Here too its set-up and
 * tear-down, and the hooks registered with the context (lib/tier.h).
 *
 * It sleeps on an eventfd that submitters and the copy streams' host
 * functions write. With io_uring (probed once at set-up, unless
 * cfg.offload_engine says otherwise) it waits for a read of that eventfd
 * through liburing; otherwise with poll(2): the plain thread engine. A
 * request whose host function could not be queued is polled every
 * millisecond instead.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "error.h"
#include "offload.h"

void gml_off_wake(struct gml_offload *off)
{
	uint64_t one = 1;

	if (write(off->efd, &one, sizeof(one)) < 0)
		gml_log(GMLAKE_LOG_DEBUG, "offload: cannot wake the engine");
}

/* ---------------------------------------------------------------------- */
/* The engine thread                                                       */

/* The request is over: its block may be freed again, and it completes.
 * locked: the ctx lock is held already. */
static void finish(struct gml_offload *off, struct gml_off_req *req, int res,
		   bool locked)
{
	if (!locked)
		pthread_mutex_lock(&off->ctx->lock);	/* no driver call */
	gml_off_unbind(req);
	if (!locked)
		pthread_mutex_unlock(&off->ctx->lock);
	req->complete(req, res);
}

/* A request's start returned ret: in flight (0), or over. */
static void started(struct gml_offload *off, struct gml_off_req *req, int ret)
{
	if (ret) {
		finish(off, req, ret > 0 ? 0 : ret, false);
		return;
	}
	req->next = off->inflight;
	off->inflight = req;
}

static void start_spill(struct gml_offload *off, struct gml_off_req *req)
{
	gml_clear_error();	/* a failure's message is this request's */
	started(off, req, gml_off_spill_start(off, req));
}

/* Finish every request whose copy completed. */
static void reap(struct gml_offload *off)
{
	gmlake_ctx *ctx = off->ctx;
	struct gml_off_req **pp, *req;
	int ret;

	if (!off->inflight || gml_ctx_lock(ctx))
		return;
	for (pp = &off->inflight; (req = *pp);) {
		gml_clear_error();
		if (!gml_off_move_reap(off, req, &ret)) {
			pp = &req->next;
			continue;
		}
		*pp = req->next;
		gml_off_sync_gauges(ctx);
		finish(off, req, ret, true);
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

/* A FIFO of requests, linked through next. */
struct req_fifo {
	struct gml_off_req *head, **tail;
};

static void fifo_push(struct req_fifo *q, struct gml_off_req *req)
{
	req->next = NULL;
	*q->tail = req;
	q->tail = &req->next;
}

static struct gml_off_req *fifo_pop(struct req_fifo *q)
{
	struct gml_off_req *req = q->head;

	q->head = req->next;
	if (!q->head)
		q->tail = &q->head;
	return req;
}

/* Whether a request in q came before req for req's block. */
static bool fifo_has_earlier(const struct req_fifo *q,
			     const struct gml_off_req *req)
{
	for (const struct gml_off_req *r = q->head; r; r = r->next)
		if (r->b && r->b == req->b && r->seq < req->seq)
			return true;
	return false;
}

/* Whether q's head must wait for an earlier request in other. */
static bool fifo_head_waits(const struct req_fifo *q,
			    const struct req_fifo *other)
{
	return other && other->head && q->head->seq > other->head->seq &&
	       fifo_has_earlier(other, q->head);
}

/*
 * Fetches prepared together, whose device access was granted with one
 * set-access per run of adjacent ranges (offload_bench's blocks, an
 * optimizer's state tensors: allocated one after another), and whose
 * copies start one a turn.
 */
#define FETCH_BATCH 16

struct fetch_batch {
	struct gml_off_req *req[FETCH_BATCH];
	struct gml_access acc[FETCH_BATCH];
	int granted[FETCH_BATCH];	/* 0, or the grant's -errno */
	int n, next;
};

/* Take up to FETCH_BATCH fetches from q (not past one that must wait
 * for a request in other), prepare them and grant their access. */
static void fetch_batch_fill(struct gml_offload *off, struct req_fifo *q,
			     const struct req_fifo *other,
			     struct fetch_batch *fb)
{
	int ret;

	fb->n = fb->next = 0;
	while (q->head && fb->n < FETCH_BATCH && !fifo_head_waits(q, other)) {
		struct gml_off_req *req = fifo_pop(q);

		gml_clear_error();
		ret = gml_off_fetch_prepare(off, req, &fb->acc[fb->n]);
		if (ret)
			started(off, req, ret);
		else
			fb->req[fb->n++] = req;
	}
	/* One ordering for the batch, before any of its copies: it covers
	 * what the chunks each prepare took were last used by. */
	if (fb->n) {
		gml_clear_error();
		ret = gml_off_fetch_order(off);
		for (int k = 0; ret && k < fb->n; k++) {
			started(off, fb->req[k], gml_off_fetch_copy(
				off, fb->req[k], &fb->acc[k], ret));
			fb->req[k] = NULL;
		}
	}
	for (int i = 0, j; i < fb->n && fb->req[i]; i = j) {
		struct gml_access run = fb->acc[i];

		for (j = i + 1; j < fb->n && run.size && fb->acc[j].size &&
		     fb->acc[j].va == run.va + run.size; j++) {
			run.size += fb->acc[j].size;
			run.handles += fb->acc[j].handles;
		}
		gml_clear_error();
		ret = gml_off_fetch_grant(off, &run);
		/* A failed grant fails its run's fetches now, while the
		 * error's message is theirs. */
		for (int k = i; k < j; k++) {
			fb->granted[k] = ret;
			if (ret) {
				started(off, fb->req[k], gml_off_fetch_copy(
					off, fb->req[k], &fb->acc[k], ret));
				fb->req[k] = NULL;
			}
		}
	}
}

/* Start the next prepared fetch's copy, if one is left. */
static void fetch_batch_next(struct gml_offload *off, struct fetch_batch *fb)
{
	while (fb->next < fb->n) {
		int i = fb->next++;

		if (!fb->req[i])
			continue;	/* failed with its run's grant */
		gml_clear_error();
		started(off, fb->req[i], gml_off_fetch_copy(off, fb->req[i],
							    &fb->acc[i],
							    fb->granted[i]));
		return;
	}
}

/*
 * Requests handed in: spills and fetches first, then prefetches. Spills
 * and fetches start in turn, one copy of each, so that both copy streams
 * get work at once (issuing a large copy can block the thread until the
 * copy engine takes it: a batch's spills started before its fetches left
 * the host-to-device stream idle meanwhile); fetches are prepared and
 * granted a batch at a time (struct fetch_batch). Requests on one block
 * start in the order they came (seq): a request waits while the other
 * queue holds an earlier one on its block, and the two cannot both wait.
 */
static void start_incoming(struct gml_offload *off, struct gml_off_req *list)
{
	struct req_fifo q[3] = { { NULL, &q[0].head }, { NULL, &q[1].head },
				 { NULL, &q[2].head } };
	struct gml_off_req *req, *next;
	struct fetch_batch fb = { .n = 0 };
	uint32_t seq = 0;
	bool spill_turn = false;	/* toggled first: spills start */

	for (req = list; req; req = next) {
		next = req->next;
		req->seq = seq++;
		fifo_push(&q[req->op == GMLAKE_OFFLOAD_PREFETCH ? 2 :
			     req->op == GMLAKE_OFFLOAD_FETCH], req);
	}
	while (q[0].head || q[1].head || fb.next < fb.n) {
		spill_turn = !spill_turn;
		if (!spill_turn) {
			if (fb.next == fb.n)
				fetch_batch_fill(off, &q[1], &q[0], &fb);
			fetch_batch_next(off, &fb);
		} else if (q[0].head && !fifo_head_waits(&q[0], &q[1])) {
			start_spill(off, fifo_pop(&q[0]));
		}
	}
	while (q[2].head || fb.next < fb.n) {
		if (fb.next == fb.n)
			fetch_batch_fill(off, &q[2], NULL, &fb);
		fetch_batch_next(off, &fb);
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

/*
 * The engine needs no timeout to see what it waits for. Every wake-up is
 * a write of the eventfd made after the state it announces: gml_off_queue
 * appends under off->lock, then writes; off_quiesce sets stop under it,
 * then writes; a copy's host function is queued on the copy stream after
 * the copy's done event, so it runs once that event is complete. And the
 * eventfd keeps a write made before the engine sleeps: poll(2) finds it
 * readable, the armed io_uring read completes at once and its completion
 * waits in the ring. So no wake-up is lost between looking at the queues
 * and sleeping (there is no condition to test apart from the eventfd),
 * and none sent before the engine sleeps. The 5 ms timeout that stood
 * here while copies were in flight, for "an in-place round trip seen to
 * miss a wake-up", hid no such loss: with it at 1 s, and every timed-out
 * sleep with a copy in flight reported, neither this suite (both engines)
 * nor four threads making 1,200 in-place and pinned round trips on the
 * emulated device ever slept past a finished copy, at the commit that
 * added it or now. It goes.
 *
 * What remains is a heartbeat: requests whose host function could not be
 * queued, and a stop, are polled every millisecond; otherwise the engine
 * looks every HEARTBEAT_MS, for two things nobody wakes it for: the
 * arena's pinning ahead after spills made in callers' threads
 * (gml_host_grow_ahead), and copies on a device in a sticky error state,
 * which may never run the host functions queued behind them.
 */
#define HEARTBEAT_MS 200

static void *engine_main(void *arg)
{
	struct gml_offload *off = arg;
	struct gml_off_req *list, *req;
	bool stop, poll_needed;
	int timeout, spares_ms;

	/* For top, gdb and perf; 15 characters at most. A failure costs
	 * nothing but the name. */
	pthread_setname_np(pthread_self(), "gmlake-offload");
	gml_host_prepin(&off->host);
	if (!gml_ctx_lock(off->ctx)) {
		/* Else the next sync counts what was pinned. */
		if (gml_off_of(off->ctx) == off)
			gml_off_sync_gauges(off->ctx);
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
				gml_set_error(-ECANCELED, "offload: the %s of "
					      "%#lx was cancelled: the context "
					      "is being destroyed",
					      list->op == GMLAKE_OFFLOAD_SPILL ?
					      "spill" : "fetch",
					      (unsigned long)list->ptr);
				finish(off, list, -ECANCELED, false);
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
		timeout = poll_needed || stop ? 1 : HEARTBEAT_MS;
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
	gml_off_wake(off);
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
	gmlake_stream_t *streams[] = { &off->d2h, &off->h2d, &off->wake_d2h,
				       &off->wake_h2d };
	size_t n = sizeof(streams) / sizeof(streams[0]);

	/* Host functions still queued write the eventfd: let them run (a
	 * failed wait is tried once more, before the eventfd closes). The
	 * wake streams wait for the copy streams' events: theirs last. */
	for (size_t i = 0; i < n; i++)
		if (*streams[i] && gml_dev_stream_sync(&ctx->dev, *streams[i]))
			gml_dev_stream_sync(&ctx->dev, *streams[i]);
	if (off->engine == GMLAKE_OFFLOAD_ENGINE_URING)
		io_uring_queue_exit(&off->uring);
	if (off->efd >= 0)
		close(off->efd);
	for (size_t i = n; i-- > 0;)
		if (*streams[i] &&
		    gml_dev_stream_destroy(&ctx->dev, *streams[i]))
			gml_dev_stream_destroy(&ctx->dev, *streams[i]);
	gml_host_fini(&off->host);
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
	gml_off_wake(off);
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
	if (gml_dev_host_numa(&ctx->dev, &off->numa))
		off->numa = -1;
	ret = gml_host_init(&off->host, &ctx->dev, off->numa,
			    gml_ctx_config(ctx)->host_limit,
			    gml_ctx_config(ctx)->host_pin);
	if (ret)
		goto out_free;
	ret = gml_dev_stream_create(&ctx->dev, &off->d2h);
	if (!ret)
		ret = gml_dev_stream_create(&ctx->dev, &off->h2d);
	if (!ret)
		ret = gml_dev_stream_create(&ctx->dev, &off->wake_d2h);
	if (!ret)
		ret = gml_dev_stream_create(&ctx->dev, &off->wake_h2d);
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
	gml_off_sync_gauges(ctx);
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

void gml_off_attach(struct gml_offload *off, struct gml_off_user *u)
{
	u->prev = NULL;
	u->next = off->users;
	if (off->users)
		off->users->prev = u;
	off->users = u;
}

void gml_off_detach(struct gml_offload *off, struct gml_off_user *u)
{
	if (u->prev)
		u->prev->next = u->next;
	else
		off->users = u->next;
	if (u->next)
		u->next->prev = u->prev;
	u->prev = u->next = NULL;
}

/*
 * The tier's fini hook: after every block is gone; ctx lock held. Rings
 * still open (a forced destroy, or one with no block left) outlive the
 * manager: with the engine stopped their requests are all over, and each
 * is orphaned, so that nothing it does later touches freed memory.
 */
static void off_fini(gmlake_ctx *ctx)
{
	struct gml_offload *off = gml_off_of(ctx);
	struct gml_off_user *u;

	off_quiesce(off);
	while ((u = off->users)) {
		gml_off_detach(off, u);
		u->orphan(u);
	}
	gml_off_sync_gauges(ctx);
	off_free(ctx, off);
}

const struct gml_tier_ops gml_off_tier = {
	.reclaim = gml_off_reclaim,
	.block_gone = gml_off_block_gone,
	.quiesce = off_tier_quiesce,
	.fini = off_fini,
};
