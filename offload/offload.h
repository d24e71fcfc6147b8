/* SPDX-License-Identifier: MIT */
/*
 * The offload manager's insides, one section per file: host.c (the pinned
 * host arena), move.c (one request's mechanics: spill and fetch of a
 * block), engine.c (the engine thread, set-up and tear-down), advise.c
 * (advice, the LRU and automatic offload, where a block is) and ring.c
 * (the io_uring-shaped rings of include/gmlake-offload.h).
 *
 * Locking: the context lock is outermost. Under it one more may be taken:
 * a ring's lock (the engine posts completions with the context lock
 * held), off->lock (the engine's queues) or the arena's lock (h->lock);
 * these three never nest in one another, and no code takes the context
 * lock while holding any of them. The engine thread takes the context lock
 * with no other lock held, and waits for device work while holding it
 * only in the allocation path's synchronous spill (gml_off_reclaim, which
 * the caller asked for, in the caller's thread or for a fetch) and on
 * error paths (a copy whose event fails, a fetch undone).
 */
#ifndef GML_OFFLOAD_H
#define GML_OFFLOAD_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <liburing.h>

#include "gmlake-offload.h"
#include "lock.h"
#include "types.h"

/* ---- host.c: the pinned host arena ---- */

struct gml_host_region;

struct gml_host {
	pthread_mutex_t lock;
	struct gml_dev *dev;
	int node;			/* NUMA node, -1: none */
	size_t limit;			/* bytes that may be pinned */
	size_t step;			/* growth unit */
	size_t want;			/* to pin before the first spill */
	size_t pinned, used;
	size_t inplace;			/* host handles of in-place spills */
	int64_t d_pinned, d_used;	/* not yet in the context's gauges */
	struct gml_host_region *regions;
};

int gml_host_init(struct gml_host *h, struct gml_dev *dev, int node,
		  size_t limit, size_t pin);
void gml_host_fini(struct gml_host *h);
/* size bytes of pinned memory; -ENOMEM when none is free (grow: pin a
 * new region first when the budget allows). */
int gml_host_alloc(struct gml_host *h, size_t size, bool grow, void **p);
void gml_host_free(struct gml_host *h, void *p, size_t size);
/* Charge (or with a negative size, refund) in-place host memory against
 * the budget; -ENOMEM when it would pass it. */
int gml_host_charge(struct gml_host *h, int64_t size);
/* Pin ahead: a region when less than a step is free (engine thread). */
void gml_host_grow_ahead(struct gml_host *h);
/* Pin what set-up asked for (engine thread, before any request). */
void gml_host_prepin(struct gml_host *h);

/* ---- the manager and its requests ---- */

struct gml_ring;

struct gml_off_req {
	struct gml_off_req *next;
	/* Called once when the request is over, res 0 or -errno; frees req.
	 * Set by whoever made the request (ring.c), any lock may be held. */
	void (*complete)(struct gml_off_req *req, int res);
	struct gml_ring *ring;		/* complete's: the ring to post to */
	uint8_t op;			/* enum gmlake_offload_op */
	bool inplace;
	uint32_t seq;			/* the engine's: order in its batch */
	uintptr_t ptr;
	uint64_t user_data;
	/* Bound at submit (gml_off_bind) to the block at ptr then, which
	 * cannot be freed until the request is over; or err says why not. */
	struct gml_block *b;
	int err;
	gml_event done;			/* after the copy and the notify */
	bool has_done;
	bool notified;			/* no host_func: poll the event */
	void *host;			/* spill: the arena buffer */
	size_t size;
	uint64_t t0;
};

/*
 * What holds on to the manager from above (a ring): told, once its
 * requests are all over, that the context goes (ctx lock held), so that
 * it never calls into the manager or the context again.
 */
struct gml_off_user {
	struct gml_off_user *prev, *next;	/* off->users; ctx lock */
	void (*orphan)(struct gml_off_user *u);
};

struct gml_offload {
	gmlake_ctx *ctx;
	struct gml_host host;
	gmlake_stream_t d2h, h2d;	/* the two copy streams */
	/* Each copy stream's wake-ups: a host function holds its stream
	 * until it has run, so it waits for the copy's event here, never on
	 * the copy stream, and the next copy starts at once. */
	gmlake_stream_t wake_d2h, wake_h2d;
	int engine;			/* enum gmlake_offload_engine */
	int numa;

	/* Offloadable resident blocks, least recently used first; ctx lock. */
	struct gml_block *lru, *lru_tail;
	struct gml_off_user *users;	/* open rings; ctx lock */

	pthread_mutex_t lock;		/* the queues below */
	struct gml_off_req *incoming;	/* submitted, not started */
	struct gml_off_req *inflight;	/* copies under way (engine only) */
	bool stop;
	bool started;
	pthread_t thread;
	int efd;			/* eventfd that wakes the engine */
	struct io_uring uring;		/* the io_uring engine's ring */
	bool uring_armed;
	uint64_t efd_buf;
};

/* ---- engine.c: the engine thread ---- */

/* The offload manager's hooks, registered with the context on first use
 * (lib/tier.h). */
extern const struct gml_tier_ops gml_off_tier;

/* The context's manager, or NULL before its first use; ctx lock held. */
static inline struct gml_offload *gml_off_of(gmlake_ctx *ctx)
{
	return ctx->tier == &gml_off_tier ? ctx->tier_priv : NULL;
}

/* The context's manager, made on first use; ctx lock held. */
int gml_off_get(gmlake_ctx *ctx, struct gml_offload **out);
/* Queue requests for the engine (any thread, no lock held). */
void gml_off_queue(struct gml_offload *off, struct gml_off_req *list);
/* Wake the engine (any thread, any lock held; a driver thread too). */
void gml_off_wake(struct gml_offload *off);
/* A user comes and goes; ctx lock held. */
void gml_off_attach(struct gml_offload *off, struct gml_off_user *u);
void gml_off_detach(struct gml_offload *off, struct gml_off_user *u);

/* ---- move.c: one request's mechanics ---- */

/* Bind each request of list to the block at its address now (a
 * reference that gmlake_free honours), or note why it cannot move; takes
 * the ctx lock. Unbind when the request is over, ctx lock held. */
void gml_off_bind(gmlake_ctx *ctx, struct gml_off_req *list);
void gml_off_unbind(struct gml_off_req *req);

/* Start spill req (ctx lock not held; taken here): 0 with its copy in
 * flight, 1 when the block already is spilled, -errno when it failed
 * (the block as it was). */
int gml_off_spill_start(struct gml_offload *off, struct gml_off_req *req);
/*
 * A fetch (or prefetch) in four calls, no lock held across them, so that
 * the engine orders the copy stream and grants device access once for a
 * batch: one driver call instead of one a block. (While copies run both
 * ways the set-access's time grows with the run's length, so on the H200
 * the time spent stayed the same; offload_bench -c, 07a1f5d.)
 *   prepare: the block's chunks mapped at its range, the access left in
 *	*acc; 0 (the block fetching), 1 (already resident) or -errno (the
 *	block as it was). After 0, gml_off_fetch_copy must follow.
 *   order: the host-to-device stream after all work queued so far, which
 *	may still use the chunks the batch's prepares took; once, after the
 *	batch's last prepare and before its first copy.
 *   grant: set-access over run, the union of adjacent prepared ranges.
 *   copy: after grant's result for req's range (0 or -errno): its copy
 *	queued, 0; or -errno, the fetch undone, the block spilled as it was.
 */
int gml_off_fetch_prepare(struct gml_offload *off, struct gml_off_req *req,
			  struct gml_access *acc);
int gml_off_fetch_order(struct gml_offload *off);
int gml_off_fetch_grant(struct gml_offload *off, const struct gml_access *run);
int gml_off_fetch_copy(struct gml_offload *off, struct gml_off_req *req,
		       const struct gml_access *acc, int granted);
/* Whether the copy of req (started, 0 above) is over: then the move is
 * finished or undone and *res is req's result. ctx lock held. */
bool gml_off_move_reap(struct gml_offload *off, struct gml_off_req *req,
		       int *res);
/* Spill b now, in this thread, from the arena's free space only: the
 * allocation path under pressure. ctx lock held. 0 or -errno, b intact. */
int gml_off_spill_sync(gmlake_ctx *ctx, struct gml_offload *off,
		       struct gml_block *b);
/* Free a spilled block's in-place host memory (and its mappings). */
void gml_off_inplace_drop(gmlake_ctx *ctx, struct gml_offload *off,
			  struct gml_block *b);
/* Move the arena's byte counts into the context's gauges; ctx lock held. */
void gml_off_sync_gauges(gmlake_ctx *ctx);

/* ---- advise.c: advice, the LRU, automatic offload ---- */

/* Off the LRU; to its tail (most recently used, if offloadable and
 * resident). ctx lock held. */
void gml_off_lru_del(struct gml_offload *off, struct gml_block *b);
void gml_off_lru_touch(struct gml_offload *off, struct gml_block *b);
/* The tier's hooks (lib/tier.h): spill one block, least recently used
 * first, never keep; a freed block's host side goes. ctx lock held. */
bool gml_off_reclaim(gmlake_ctx *ctx, struct gml_block *keep);
void gml_off_block_gone(gmlake_ctx *ctx, struct gml_block *b);

#endif
