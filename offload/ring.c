/* SPDX-License-Identifier: MIT */
/*
 * Rings shaped like io_uring's, for the callers of the offload manager.
 *
 * The submission queue is an array of entries between sq_head (the next
 * one submit hands in) and sq_tail (the next one get_sqe gives out). The
 * completion queue holds twice as many entries, between cq_head (the next
 * to reap) and cq_tail (the next the engine fills). submit never lets the
 * requests in flight plus the completions not yet seen pass the completion
 * queue's size, so the engine never finds it full and a completion stays
 * where wait_cqe pointed until cqe_seen.
 *
 * A ring's lock is innermost (offload.h): the engine posts completions
 * with the context lock held, and nothing here takes the context lock, or
 * any other lock, with the ring's lock held.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "offload.h"

#define RING_MAX_ENTRIES 4096

struct gml_ring {
	pthread_mutex_t lock;
	pthread_cond_t cond;		/* a completion was posted */
	/* Both NULL once the context was destroyed (ring_orphan). */
	gmlake_ctx *ctx;
	struct gml_offload *off;
	struct gml_off_user user;	/* on off->users while open */
	unsigned flags;
	unsigned sq_entries, sq_head, sq_tail;
	unsigned cq_entries, cq_head, cq_tail;
	unsigned inflight;		/* submitted, not completed */
	struct gmlake_offload_sqe *sqes;
	struct gmlake_offload_cqe *cqes;
	/* Per completion slot, the message of a failure (or NULL), handed
	 * to the reaper's gmlake_last_error by wait_cqe and peek_cqe. */
	char **msgs;
};

static struct gml_ring *ring_of(struct gmlake_offload *ring, const char *fn)
{
	if (!ring || !ring->priv) {
		gml_set_error(-EINVAL, "%s: ring is %s", fn,
			      ring ? "not initialised" : "NULL");
		return NULL;
	}
	return ring->priv;
}

/* The context goes while the ring is open: its requests are all over;
 * from now on the ring touches neither the context nor the manager. */
static void ring_orphan(struct gml_off_user *u)
{
	struct gml_ring *r = (struct gml_ring *)((char *)u -
						 offsetof(struct gml_ring, user));

	pthread_mutex_lock(&r->lock);
	r->ctx = NULL;
	r->off = NULL;
	pthread_mutex_unlock(&r->lock);
}

GML_EXPORT int gmlake_offload_init(struct gmlake_offload *ring,
				   gmlake_ctx *ctx, unsigned entries,
				   unsigned flags)
{
	struct gml_offload *off;
	struct gml_ring *r;
	unsigned n = 1;
	int ret;

	if (!ring || !ctx)
		return gml_set_error(-EINVAL, "gmlake_offload_init: %s is NULL",
				     ring ? "ctx" : "ring");
	if (!entries || entries > RING_MAX_ENTRIES)
		return gml_set_error(-EINVAL, "gmlake_offload_init: %u entries "
				     "(1 to %u)", entries, RING_MAX_ENTRIES);
	if (flags & ~GMLAKE_OFFLOAD_INPLACE)
		return gml_set_error(-EINVAL, "gmlake_offload_init: unknown "
				     "flags %#x", flags);
	while (n < entries)
		n <<= 1;
	r = calloc(1, sizeof(*r));
	if (!r)
		return gml_set_error(-ENOMEM, "no host memory for a ring");
	r->sqes = calloc(n, sizeof(*r->sqes));
	r->cqes = calloc(2 * n, sizeof(*r->cqes));
	r->msgs = calloc(2 * n, sizeof(*r->msgs));
	if (!r->sqes || !r->cqes || !r->msgs) {
		ret = gml_set_error(-ENOMEM, "no host memory for a ring");
		goto out_free;
	}
	r->sq_entries = n;
	r->cq_entries = 2 * n;
	r->flags = flags;
	r->ctx = ctx;
	r->user.orphan = ring_orphan;
	pthread_mutex_init(&r->lock, NULL);
	pthread_cond_init(&r->cond, NULL);
	ret = gml_ctx_lock(ctx);
	if (!ret) {
		ret = gml_off_get(ctx, &off);
		if (!ret) {
			r->off = off;
			gml_off_attach(off, &r->user);
		}
		gml_ctx_unlock(ctx);
	}
	if (ret)
		goto out_destroy;
	memset(ring, 0, sizeof(*ring));
	ring->priv = r;
	return 0;
out_destroy:
	pthread_cond_destroy(&r->cond);
	pthread_mutex_destroy(&r->lock);
out_free:
	free(r->sqes);
	free(r->cqes);
	free(r->msgs);
	free(r);
	return ret;
}

GML_EXPORT int gmlake_offload_exit(struct gmlake_offload *ring)
{
	struct gml_ring *r = ring_of(ring, "gmlake_offload_exit");
	gmlake_ctx *ctx;

	if (!r)
		return -EINVAL;
	pthread_mutex_lock(&r->lock);
	while (r->inflight)
		pthread_cond_wait(&r->cond, &r->lock);
	ctx = r->ctx;
	pthread_mutex_unlock(&r->lock);
	/* Off the manager's list, unless the context went first. */
	if (ctx) {
		pthread_mutex_lock(&ctx->lock);
		gml_off_detach(r->off, &r->user);
		pthread_mutex_unlock(&ctx->lock);
	}
	pthread_cond_destroy(&r->cond);
	pthread_mutex_destroy(&r->lock);
	for (unsigned i = 0; i < r->cq_entries; i++)
		free(r->msgs[i]);
	free(r->msgs);
	free(r->sqes);
	free(r->cqes);
	free(r);
	ring->priv = NULL;
	return 0;
}

GML_EXPORT struct gmlake_offload_sqe *
gmlake_offload_get_sqe(struct gmlake_offload *ring)
{
	struct gml_ring *r = ring_of(ring, "gmlake_offload_get_sqe");
	struct gmlake_offload_sqe *sqe = NULL;

	if (!r)
		return NULL;
	pthread_mutex_lock(&r->lock);
	if (r->sq_tail - r->sq_head < r->sq_entries) {
		sqe = &r->sqes[r->sq_tail++ & (r->sq_entries - 1)];
		memset(sqe, 0, sizeof(*sqe));
	}
	pthread_mutex_unlock(&r->lock);
	return sqe;
}

static void prep(struct gmlake_offload_sqe *sqe, uint8_t op, void *ptr)
{
	if (!sqe)
		return;
	sqe->opcode = op;
	sqe->addr = (uint64_t)(uintptr_t)ptr;
}

GML_EXPORT void gmlake_offload_prep_spill(struct gmlake_offload_sqe *sqe,
					  void *ptr)
{
	prep(sqe, GMLAKE_OFFLOAD_SPILL, ptr);
}

GML_EXPORT void gmlake_offload_prep_fetch(struct gmlake_offload_sqe *sqe,
					  void *ptr)
{
	prep(sqe, GMLAKE_OFFLOAD_FETCH, ptr);
}

GML_EXPORT void gmlake_offload_prep_prefetch(struct gmlake_offload_sqe *sqe,
					     void *ptr)
{
	prep(sqe, GMLAKE_OFFLOAD_PREFETCH, ptr);
}

GML_EXPORT void gmlake_offload_sqe_set_data(struct gmlake_offload_sqe *sqe,
					    uint64_t user_data)
{
	if (sqe)
		sqe->user_data = user_data;
}

GML_EXPORT uint64_t
gmlake_offload_cqe_get_data(const struct gmlake_offload_cqe *cqe)
{
	return cqe ? cqe->user_data : 0;
}

/* Post a completion into r, with the message of a failure (res < 0);
 * r->lock held. */
static void post(struct gml_ring *r, uint64_t user_data, int res,
		 const char *msg)
{
	unsigned slot = r->cq_tail++ & (r->cq_entries - 1);
	struct gmlake_offload_cqe *cqe = &r->cqes[slot];

	cqe->user_data = user_data;
	cqe->res = res;
	cqe->flags = 0;
	free(r->msgs[slot]);
	r->msgs[slot] = res < 0 && msg && *msg ? strdup(msg) : NULL;
	pthread_cond_broadcast(&r->cond);
}

static const char *op_name(uint8_t op)
{
	return op == GMLAKE_OFFLOAD_SPILL ? "spill" :
	       op == GMLAKE_OFFLOAD_FETCH ? "fetch" : "prefetch";
}

/*
 * A request's completion callback: post to its ring and free it. A
 * failure's message is the engine thread's last error, which the engine
 * clears before each step of a request (or names the errno when empty).
 */
static void ring_complete(struct gml_off_req *req, int res)
{
	struct gml_ring *r = req->ring;
	char msg[256];

	msg[0] = '\0';
	if (res < 0) {
		snprintf(msg, sizeof(msg), "%s", gmlake_last_error());
		if (!msg[0])
			snprintf(msg, sizeof(msg), "offload: the %s of %#lx "
				 "failed: %s", op_name(req->op),
				 (unsigned long)req->ptr, strerror(-res));
		gml_log(GMLAKE_LOG_DEBUG, "offload: request on %#lx: %d (%s)",
			(unsigned long)req->ptr, res, msg);
	}
	pthread_mutex_lock(&r->lock);
	post(r, req->user_data, res, msg);
	r->inflight--;
	pthread_mutex_unlock(&r->lock);
	free(req);
}

/* Turn the submitted entries into requests; r->lock held. */
static int take_entries(struct gml_ring *r, struct gml_off_req **list)
{
	unsigned room = r->cq_entries - (r->cq_tail - r->cq_head) - r->inflight;
	struct gml_off_req **tail = list;
	int count = 0;

	while (r->sq_head != r->sq_tail && room) {
		struct gmlake_offload_sqe *sqe;
		struct gml_off_req *req;

		sqe = &r->sqes[r->sq_head & (r->sq_entries - 1)];
		if (sqe->opcode == GMLAKE_OFFLOAD_NOP ||
		    sqe->opcode > GMLAKE_OFFLOAD_PREFETCH || !sqe->addr) {
			post(r, sqe->user_data, sqe->opcode == GMLAKE_OFFLOAD_NOP ?
			     0 : -EINVAL, "gmlake_offload_submit: an entry with "
			     "an unknown operation or no address");
			goto next;
		}
		req = calloc(1, sizeof(*req));
		if (!req)
			break;
		req->complete = ring_complete;
		req->ring = r;
		req->op = sqe->opcode;
		req->inplace = (sqe->flags & GMLAKE_OFFLOAD_SQE_INPLACE) ||
			       (r->flags & GMLAKE_OFFLOAD_INPLACE);
		req->ptr = (uintptr_t)sqe->addr;
		req->user_data = sqe->user_data;
		*tail = req;
		tail = &req->next;
		r->inflight++;
next:
		r->sq_head++;
		room--;
		count++;
	}
	if (!count && r->sq_head != r->sq_tail)
		return gml_set_error(room ? -ENOMEM : -EBUSY, "gmlake_offload_"
				     "submit: %s", room ? "no host memory for "
				     "a request" : "the completion queue is "
				     "full; reap completions first");
	return count;
}

GML_EXPORT int gmlake_offload_submit(struct gmlake_offload *ring)
{
	struct gml_ring *r = ring_of(ring, "gmlake_offload_submit");
	struct gml_off_req *list = NULL;
	int count;

	if (!r)
		return -EINVAL;
	pthread_mutex_lock(&r->lock);
	if (!r->ctx) {
		pthread_mutex_unlock(&r->lock);
		return gml_set_error(-EBADF, "gmlake_offload_submit: the ring's "
				     "context was destroyed; only "
				     "gmlake_offload_exit is left to call");
	}
	count = take_entries(r, &list);
	pthread_mutex_unlock(&r->lock);
	if (list) {
		gml_off_bind(r->ctx, list);	/* to the blocks there now */
		gml_off_queue(r->off, list);
	}
	return count;
}

/*
 * The completion at the head; a failed one also sets the caller's
 * gmlake_last_error to its message, so that it says why this request
 * failed rather than whatever failed last in this thread.
 */
static int next_cqe(struct gml_ring *r, bool wait,
		    struct gmlake_offload_cqe **cqe)
{
	unsigned slot;
	char msg[256];
	int ret = 0;

	msg[0] = '\0';
	pthread_mutex_lock(&r->lock);
	while (r->cq_head == r->cq_tail && wait && r->inflight)
		pthread_cond_wait(&r->cond, &r->lock);
	if (r->cq_head == r->cq_tail) {
		ret = -EAGAIN;
	} else {
		slot = r->cq_head & (r->cq_entries - 1);
		*cqe = &r->cqes[slot];
		if ((*cqe)->res < 0)
			snprintf(msg, sizeof(msg), "%s", r->msgs[slot] ?
				 r->msgs[slot] : "offload: a request failed");
	}
	pthread_mutex_unlock(&r->lock);
	if (msg[0])
		gml_set_error(0, "%s", msg);
	return ret;
}

GML_EXPORT int gmlake_offload_wait_cqe(struct gmlake_offload *ring,
				       struct gmlake_offload_cqe **cqe)
{
	struct gml_ring *r = ring_of(ring, "gmlake_offload_wait_cqe");
	int ret;

	if (!r || !cqe)
		return r ? gml_set_error(-EINVAL, "gmlake_offload_wait_cqe: "
					 "cqe is NULL") : -EINVAL;
	ret = next_cqe(r, true, cqe);
	if (ret)
		return gml_set_error(ret, "gmlake_offload_wait_cqe: nothing "
				     "in flight and no completion to reap");
	return 0;
}

GML_EXPORT int gmlake_offload_peek_cqe(struct gmlake_offload *ring,
				       struct gmlake_offload_cqe **cqe)
{
	struct gml_ring *r = ring_of(ring, "gmlake_offload_peek_cqe");

	if (!r || !cqe)
		return r ? gml_set_error(-EINVAL, "gmlake_offload_peek_cqe: "
					 "cqe is NULL") : -EINVAL;
	return next_cqe(r, false, cqe);
}

GML_EXPORT void gmlake_offload_cqe_seen(struct gmlake_offload *ring,
					struct gmlake_offload_cqe *cqe)
{
	struct gml_ring *r = ring_of(ring, "gmlake_offload_cqe_seen");

	if (!r || !cqe)
		return;
	pthread_mutex_lock(&r->lock);
	if (r->cq_head != r->cq_tail)
		r->cq_head++;
	pthread_mutex_unlock(&r->lock);
}
