/* SPDX-License-Identifier: MIT */
/*
 * libgmlake offload manager: moves whole blocks between the device and a
 * pinned host arena while their device addresses stay reserved, so every
 * pointer into a block stays valid across a spill and the fetch after it.
 *
 * Requests go through rings shaped like io_uring's: take a submission
 * entry (get_sqe), prepare it (prep_spill, prep_fetch, prep_prefetch), tag
 * it (sqe_set_data), submit, then reap completions (wait_cqe or peek_cqe,
 * then cqe_seen). A completion's res is 0 or -errno; completions arrive in
 * any order. Every function may be called from any thread: a ring has its
 * own lock.
 */
#ifndef GMLAKE_OFFLOAD_H
#define GMLAKE_OFFLOAD_H

#include <stdint.h>

#include <gmlake.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Operations of a submission entry. */
enum gmlake_offload_op {
	GMLAKE_OFFLOAD_NOP = 0,
	GMLAKE_OFFLOAD_SPILL = 1,	/* device -> host, chunks given back */
	GMLAKE_OFFLOAD_FETCH = 2,	/* host -> device, same address */
	GMLAKE_OFFLOAD_PREFETCH = 3,	/* a fetch after the others */
};

/* gmlake_offload_init flags. */
#define GMLAKE_OFFLOAD_INPLACE	(1u << 0)	/* spill in place: host memory
						   stays mapped at the block */

/* Submission entry flags (sqe->flags). */
#define GMLAKE_OFFLOAD_SQE_INPLACE (1u << 0)	/* this spill in place */

struct gmlake_offload_sqe {
	uint8_t opcode;			/* enum gmlake_offload_op */
	uint8_t flags;			/* GMLAKE_OFFLOAD_SQE_* */
	uint16_t pad0;
	uint32_t pad1;
	uint64_t addr;			/* the block's start */
	uint64_t user_data;		/* copied to the completion */
	uint64_t reserved[2];
};

struct gmlake_offload_cqe {
	uint64_t user_data;
	int32_t res;			/* 0 or -errno */
	uint32_t flags;
};

/*
 * A ring. The caller owns the struct; gmlake_offload_init fills it and
 * gmlake_offload_exit empties it. The fields are the library's.
 */
struct gmlake_offload {
	void *priv;
	uint64_t reserved[3];
};

/* Advice for gmlake_advise. */
enum gmlake_advice {
	GMLAKE_ADVISE_NOT_OFFLOADABLE = 0,	/* stays on the device */
	GMLAKE_ADVISE_OFFLOADABLE = 1,		/* may spill under pressure */
};

/* Where a block is (gmlake_offload_state). */
enum gmlake_offload_where {
	GMLAKE_BLOCK_RESIDENT = 0,
	GMLAKE_BLOCK_SPILLING = 1,
	GMLAKE_BLOCK_SPILLED = 2,
	GMLAKE_BLOCK_FETCHING = 3,
};

/*
 * Rings. entries (1 to 4096, rounded up to a power of two) bounds the
 * submissions not yet submitted; up to twice as many completions wait to
 * be reaped. exit waits for the ring's requests in flight. A ring left
 * open when its context is destroyed is closed for it (submit: -EBADF);
 * exit still frees it.
 */
int gmlake_offload_init(struct gmlake_offload *ring, gmlake_ctx *ctx,
			unsigned entries, unsigned flags);
int gmlake_offload_exit(struct gmlake_offload *ring);

/* A free submission entry, or NULL when the submission queue is full. */
struct gmlake_offload_sqe *gmlake_offload_get_sqe(struct gmlake_offload *ring);
void gmlake_offload_prep_spill(struct gmlake_offload_sqe *sqe, void *ptr);
void gmlake_offload_prep_fetch(struct gmlake_offload_sqe *sqe, void *ptr);
void gmlake_offload_prep_prefetch(struct gmlake_offload_sqe *sqe, void *ptr);
void gmlake_offload_sqe_set_data(struct gmlake_offload_sqe *sqe,
				 uint64_t user_data);
uint64_t gmlake_offload_cqe_get_data(const struct gmlake_offload_cqe *cqe);

/* Hand the prepared entries to the engine: their count, or -errno. */
int gmlake_offload_submit(struct gmlake_offload *ring);
/* The next completion (wait: block until there is one; peek: -EAGAIN). */
int gmlake_offload_wait_cqe(struct gmlake_offload *ring,
			    struct gmlake_offload_cqe **cqe);
int gmlake_offload_peek_cqe(struct gmlake_offload *ring,
			    struct gmlake_offload_cqe **cqe);
/* Done with the completion wait_cqe or peek_cqe returned. */
void gmlake_offload_cqe_seen(struct gmlake_offload *ring,
			     struct gmlake_offload_cqe *cqe);

/* Mark a block offloadable (spilled least recently used first under
 * memory pressure) or not. */
int gmlake_advise(gmlake_ctx *ctx, void *ptr, int advice);
/* enum gmlake_offload_where of the block at ptr, or -errno. */
int gmlake_offload_state(gmlake_ctx *ctx, const void *ptr);

#ifdef __cplusplus
}
#endif

#endif
