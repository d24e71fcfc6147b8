/* SPDX-License-Identifier: MIT */
/*
 * The offload manager (offload/): spill and fetch through the rings, with
 * stable addresses, the host budget, device memory running out during a
 * fetch, fault injection on every driver call a spill or fetch makes, a
 * sticky device error under a copy in flight (the request must complete,
 * not hang, and lose nothing), a random workload under memory pressure,
 * automatic offload, and calls from several threads. Every block's bytes
 * are checked against its pattern after each round trip, and the
 * allocator's invariants after each operation.
 *
 * Run with the argument "thread" (tests/check_offload_thread.sh) it
 * expects the plain thread engine (GMLAKE_OFFLOAD_ENGINE=thread);
 * otherwise whichever engine the probe picks.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <dirent.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "error.h"
#include "gmlake-offload.h"
#include "helpers.h"
#include "types.h"

static bool want_thread_engine;

/* A context on the emulated device with capacity and host limit. */
static gmlake_ctx *off_ctx(size_t capacity, size_t host_limit,
			   size_t device_limit)
{
	struct gmlake_config cfg;

	th_config(&cfg, capacity);
	cfg.host_limit = host_limit;
	cfg.device_limit = device_limit;
	return th_ctx_cfg(&cfg);
}

/*
 * A context for the span tests, sized in chunks: spans are for blocks of
 * 16 chunks and more, so on the emulated device the chunks are 64 KiB
 * (the sanitizer builds copy and check every byte); where the backend
 * refuses that (a GPU's granularity is 2 MiB), the default chunk.
 * *chunk: the chunk size it has.
 */
static gmlake_ctx *span_ctx(uint32_t chunks, uint32_t host_chunks,
			    size_t *chunk)
{
	struct gmlake_config cfg;
	gmlake_ctx *ctx = NULL;

	th_config(&cfg, 0);
	cfg.chunk_size = cfg.emu_granularity = 64 << 10;
	cfg.small_size = 16 << 10;
	cfg.emu_capacity = (size_t)chunks * cfg.chunk_size;
	cfg.host_limit = (size_t)host_chunks * cfg.chunk_size;
	if (gmlake_ctx_init(&ctx, &cfg)) {
		th_config(&cfg, 0);
		cfg.host_limit = (size_t)host_chunks * (2 * TH_MiB);
		ctx = th_ctx_cfg(&cfg);
	}
	*chunk = ctx->chunk;
	return ctx;
}

static void ring_init(struct gmlake_offload *ring, gmlake_ctx *ctx,
		      unsigned entries)
{
	int ret = gmlake_offload_init(ring, ctx, entries, 0);

	ck_assert_msg(ret == 0, "gmlake_offload_init: %d (%s)", ret,
		      gmlake_last_error());
}

/* Wait for the next completion (of tag, unless ANY_TAG); its res. */
#define ANY_TAG UINT64_MAX
static int next_res(struct gmlake_offload *ring, uint64_t tag)
{
	struct gmlake_offload_cqe *cqe;
	int ret, res;

	ret = gmlake_offload_wait_cqe(ring, &cqe);
	ck_assert_msg(ret == 0, "wait_cqe: %d (%s)", ret, gmlake_last_error());
	if (tag != ANY_TAG)
		ck_assert_uint_eq(gmlake_offload_cqe_get_data(cqe), tag);
	res = cqe->res;
	gmlake_offload_cqe_seen(ring, cqe);
	return res;
}

/* Submit one request and wait for its completion; its res. */
static int one(struct gmlake_offload *ring, int op, void *p, uint64_t tag)
{
	struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(ring);

	ck_assert_ptr_nonnull(sqe);
	if (op == GMLAKE_OFFLOAD_SPILL)
		gmlake_offload_prep_spill(sqe, p);
	else if (op == GMLAKE_OFFLOAD_FETCH)
		gmlake_offload_prep_fetch(sqe, p);
	else
		gmlake_offload_prep_prefetch(sqe, p);
	gmlake_offload_sqe_set_data(sqe, tag);
	ck_assert_int_eq(gmlake_offload_submit(ring), 1);
	return next_res(ring, tag);
}

static int spill(struct gmlake_offload *ring, void *p)
{
	return one(ring, GMLAKE_OFFLOAD_SPILL, p, (uintptr_t)p ^ 1);
}

static int fetch(struct gmlake_offload *ring, void *p)
{
	return one(ring, GMLAKE_OFFLOAD_FETCH, p, (uintptr_t)p ^ 2);
}

/* Submit a fetch of p; back once its chunks are mapped (the copy may
 * still wait). */
static void fetch_attached(gmlake_ctx *ctx, struct gmlake_offload *ring,
			   void *p)
{
	struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(ring);

	ck_assert_ptr_nonnull(sqe);
	gmlake_offload_prep_fetch(sqe, p);
	ck_assert_int_eq(gmlake_offload_submit(ring), 1);
	while (gmlake_offload_state(ctx, p) != GMLAKE_BLOCK_FETCHING)
		usleep(1000);
}

/*
 * Block p (seed) spilled, with a ring and a second stream s: the start of
 * the tests where a fetch takes chunks whose last work, on s, is held.
 */
struct held {
	gmlake_ctx *ctx;
	gmlake_stream_t s;
	struct gmlake_offload ring;
	void *p;
};

static void held_init(struct held *h, uint64_t seed)
{
	h->ctx = off_ctx(64 * TH_MiB, 64 * TH_MiB, 0);
	h->s = th_stream(h->ctx);
	h->p = th_alloc_filled(h->ctx, 8 * TH_MiB, seed, NULL);
	ring_init(&h->ring, h->ctx, 8);
	ck_assert_int_eq(spill(&h->ring, h->p), 0);
}

static void held_fini(struct held *h)
{
	TH_OK(h->ctx, gmlake_offload_exit(&h->ring));
	th_free(h->ctx, h->p);
	TH_OK(h->ctx, gmlake_stream_destroy(h->ctx, h->s));
	th_destroy(h->ctx);
}

/* ---------------------------------------------------------------------- */
/* Core                                                                   */

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
}

START_TEST(test_spill_fetch_segment)
{
	enum { KEEP_MS = 1000 };
	struct gmlake_config cfg;
	gmlake_ctx *ctx;
	struct gmlake_offload ring;
	struct gmlake_stats st0, st;
	size_t size = 8 * TH_MiB - 4096;
	uint64_t t0;
	void *p;
	char byte;

	th_config(&cfg, 64 * TH_MiB);
	cfg.host_limit = 64 * TH_MiB;
	cfg.spare_keep_ms = KEEP_MS;
	ctx = th_ctx_cfg(&cfg);
	p = th_alloc(ctx, size, NULL);

	th_fill_ok(ctx, p, size, 11, NULL);
	ring_init(&ring, ctx, 8);
	th_stats(ctx, &st0);
	ck_assert_int_eq(spill(&ring, p), 0);
	th_check(ctx);
	ck_assert_int_eq(gmlake_offload_state(ctx, p), GMLAKE_BLOCK_SPILLED);
	th_stats(ctx, &st);
	/* The chunks are kept a while for the next fetch, not released. */
	ck_assert_int_eq(st.reserved_bytes.current, st0.reserved_bytes.current);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_release],
			  st0.calls[GMLAKE_CALL_mem_release]);
	ck_assert_int_eq(st.spilled_bytes.current, (int64_t)size);
	ck_assert_int_eq(st.spilled_blocks.current, 1);
	/* Still allocated, no longer on the device. */
	ck_assert_int_eq(st.allocated_bytes.current,
			 st0.allocated_bytes.current);
	/* (resident counts the bytes handed out, the size in 512s) */
	ck_assert_int_eq(st.resident_bytes.current,
			 st0.resident_bytes.current - (int64_t)size);
	ck_assert_int_ge(st.host_bytes.current, (int64_t)size);
	ck_assert_int_ge(st.host_pinned.current, st.host_bytes.current);
	ck_assert_uint_eq(st.spills, 1);
	ck_assert_uint_eq(st.d2h_bytes, size);
	ck_assert_int_eq(st.offload_engine, want_thread_engine ?
			 GMLAKE_OFFLOAD_ENGINE_THREAD : st.offload_engine);
	ck_assert_int_ne(st.offload_engine, GMLAKE_OFFLOAD_ENGINE_NONE);
	/* A copy from a spilled block is refused, not a fault. */
	TH_ERR(ctx, gmlake_memcpy_dtoh(ctx, &byte, p, 1, NULL), -EFAULT);
	/* Spilling again is nothing to do. */
	ck_assert_int_eq(spill(&ring, p), 0);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_check(ctx);
	ck_assert_int_eq(gmlake_offload_state(ctx, p), GMLAKE_BLOCK_RESIDENT);
	th_verify_ok(ctx, p, size, 11, NULL);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.spilled_bytes.current, 0);
	ck_assert_int_eq(st.host_bytes.current, 0);
	ck_assert_int_eq(st.resident_bytes.current,
			 st0.resident_bytes.current);
	ck_assert_uint_eq(st.fetches, 1);
	ck_assert_uint_eq(st.h2d_bytes, size);
	/* ... and the fetch took them: no chunk made, none given back. */
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_create],
			  st0.calls[GMLAKE_CALL_mem_create]);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_release],
			  st0.calls[GMLAKE_CALL_mem_release]);
	ck_assert_int_eq(st.reserved_bytes.current, st0.reserved_bytes.current);
	ck_assert_int_eq(fetch(&ring, p), 0);	/* resident: nothing to do */

	/* Unused for spare_keep_ms, they go back to the driver: reserved
	 * memory falls. */
	t0 = now_ms();
	ck_assert_int_eq(spill(&ring, p), 0);
	for (int ms = 0;; ms++) {
		th_stats(ctx, &st);
		if (st.reserved_bytes.current ==
		    st0.reserved_bytes.current - 8 * (int64_t)TH_MiB)
			break;
		ck_assert_msg(ms < 10000, "spilled chunks kept after 10 s: "
			      "%lld bytes reserved",
			      (long long)st.reserved_bytes.current);
		usleep(1000);
	}
	ck_assert_uint_ge(now_ms() - t0, KEEP_MS);
	ck_assert_uint_lt(now_ms() - t0, KEEP_MS + 2500);
	th_check(ctx);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_release],
			  st0.calls[GMLAKE_CALL_mem_release] + 4);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_verify_ok(ctx, p, size, 11, NULL);
	/* gmlake_trim gives them back at once. */
	ck_assert_int_eq(spill(&ring, p), 0);
	TH_OK(ctx, gmlake_trim(ctx));
	th_stats(ctx, &st);
	ck_assert_int_eq(st.reserved_bytes.current,
			 st0.reserved_bytes.current - 8 * (int64_t)TH_MiB);
	th_check(ctx);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_verify_ok(ctx, p, size, 11, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/* A block stitched from non-contiguous chunks moves whole, same address. */
/* 64 MiB of device and of host memory, growth handles of 4 chunks. */
static gmlake_ctx *slab_tier_ctx(void)
{
	struct gmlake_config cfg;

	th_config(&cfg, 64 * TH_MiB);
	cfg.host_limit = 64 * TH_MiB;
	cfg.grow_handle = 4 * TH_CHUNK;
	cfg.top_fit = 0;	/* the tests place blocks by position */
	return th_ctx_cfg(&cfg);
}

/*
 * Blocks made before the ring, on growth handles (slabs) of 4 chunks: a
 * block whose slabs lie inside it spills (each slab unmapped whole, a
 * spare) and comes back with its bytes; one that shares a slab with
 * another live block is refused with -EBUSY and stays as it was; once
 * the rest of its slab is free, it spills and takes the slab along.
 */
START_TEST(test_spill_slabs)
{
	struct gmlake_offload ring;
	struct gmlake_stats st0, st;
	gmlake_ctx *ctx;
	void *a, *b, *x, *y;

	ctx = slab_tier_ctx();
	a = th_alloc_filled(ctx, 9 * TH_CHUNK, 1, NULL);   /* 2 slabs, a chunk */
	b = th_alloc_filled(ctx, 4 * TH_CHUNK, 2, NULL);   /* a slab */
	th_verify_free(ctx, b, 4 * TH_CHUNK, 2, NULL);
	x = th_alloc_filled(ctx, 2 * TH_CHUNK, 3, NULL);   /* half b's slab */
	y = th_alloc_filled(ctx, 2 * TH_CHUNK, 4, NULL);   /* the other half */
	ck_assert_ptr_eq(x, b);
	ck_assert_ptr_eq(y, (char *)b + 2 * TH_CHUNK);
	ring_init(&ring, ctx, 8);
	th_stats(ctx, &st0);
	ck_assert_int_eq(spill(&ring, a), 0);
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_int_eq(gmlake_offload_state(ctx, a), GMLAKE_BLOCK_SPILLED);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_unmap] -
			  st0.calls[GMLAKE_CALL_mem_unmap], 3);
	ck_assert_int_eq(st.resident_bytes.current,
			 st0.resident_bytes.current - 9 * (int64_t)TH_CHUNK);
	ck_assert_int_eq(spill(&ring, x), -EBUSY);
	ck_assert_int_eq(gmlake_offload_state(ctx, x), GMLAKE_BLOCK_RESIDENT);
	th_verify_ok(ctx, x, 2 * TH_CHUNK, 3, NULL);
	th_verify_free(ctx, y, 2 * TH_CHUNK, 4, NULL);
	th_sync(ctx, NULL);
	ck_assert_int_eq(spill(&ring, x), 0);
	th_check(ctx);
	ck_assert_int_eq(fetch(&ring, x), 0);
	th_verify_ok(ctx, x, 2 * TH_CHUNK, 3, NULL);
	ck_assert_int_eq(fetch(&ring, a), 0);
	th_check(ctx);
	th_verify_ok(ctx, a, 9 * TH_CHUNK, 1, NULL);
	/* Spilled and fetched again: a's run is chunks now, and spills. */
	ck_assert_int_eq(spill(&ring, a), 0);
	ck_assert_int_eq(fetch(&ring, a), 0);
	th_verify_free(ctx, a, 9 * TH_CHUNK, 1, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_verify_free(ctx, x, 2 * TH_CHUNK, 3, NULL);
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/*
 * Under a tier, growth still takes slabs (one handle per 4 chunks), but a
 * long-lived block (an optimizer's state) stays off them: made while the
 * freed slabs of another block are the lowest free memory, it lands
 * elsewhere and spills. An ordinary block takes the slab and, lying in it
 * beside live memory, cannot spill (-EBUSY), as in test_spill_slabs.
 */
START_TEST(test_long_lived_off_slabs)
{
	struct gmlake_offload ring;
	struct gmlake_stats st0, st;
	gmlake_ctx *ctx;
	void *a, *s, *x, *y;

	ctx = slab_tier_ctx();
	ring_init(&ring, ctx, 8);
	th_stats(ctx, &st0);
	a = th_alloc_filled(ctx, 8 * TH_CHUNK, 1, NULL);   /* 2 slabs */
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_create] -
			  st0.calls[GMLAKE_CALL_mem_create], 2);
	th_verify_free(ctx, a, 8 * TH_CHUNK, 1, NULL);
	TH_OK(ctx, gmlake_long_lived(ctx, true));
	s = th_alloc_filled(ctx, 2 * TH_CHUNK, 2, NULL);
	TH_OK(ctx, gmlake_long_lived(ctx, false));
	ck_assert_msg((char *)s + 2 * TH_CHUNK <= (char *)a ||
		      (char *)s >= (char *)a + 8 * TH_CHUNK,
		      "a long-lived block took a slab's positions");
	th_check(ctx);
	ck_assert_int_eq(spill(&ring, s), 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, s), GMLAKE_BLOCK_SPILLED);
	x = th_alloc_filled(ctx, 2 * TH_CHUNK, 3, NULL);
	y = th_alloc_filled(ctx, 2 * TH_CHUNK, 4, NULL);
	ck_assert_ptr_eq(x, a);				/* first fit: a slab */
	ck_assert_ptr_eq(y, (char *)a + 2 * TH_CHUNK);	/* and its rest */
	ck_assert_int_eq(spill(&ring, x), -EBUSY);
	ck_assert_int_eq(gmlake_offload_state(ctx, x), GMLAKE_BLOCK_RESIDENT);
	th_check(ctx);
	ck_assert_int_eq(fetch(&ring, s), 0);
	th_check(ctx);
	th_verify_free(ctx, s, 2 * TH_CHUNK, 2, NULL);
	th_verify_free(ctx, y, 2 * TH_CHUNK, 4, NULL);
	th_verify_free(ctx, x, 2 * TH_CHUNK, 3, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/*
 * Blocks of 6 chunks made in the freed slabs (4 chunks each) of a larger
 * block, one after the other: each shares a slab with its neighbour, so a
 * spill unmaps its own slab and keeps its positions in the shared one
 * mapped (the driver unmaps a handle only whole). All four spill, two
 * slabs stay for four blocks; they come back with their bytes; a spilled
 * block freed gives its kept chunks back to the free pool, and once the
 * neighbour is gone too, the other spills with all of that slab. In place (host memory
 * mapped over the whole run), a block that would keep chunks is refused.
 */
START_TEST(test_spill_keeps_shared_slab)
{
	struct gmlake_offload ring, inplace;
	struct gmlake_stats st0, st;
	gmlake_ctx *ctx;
	void *big, *p[4];

	ctx = slab_tier_ctx();
	ring_init(&ring, ctx, 8);
	big = th_alloc_filled(ctx, 24 * TH_CHUNK, 39, NULL);	/* 6 slabs */
	th_verify_free(ctx, big, 24 * TH_CHUNK, 39, NULL);
	for (int i = 0; i < 4; i++)
		p[i] = th_alloc_filled(ctx, 6 * TH_CHUNK, 40 + i, NULL);
	for (int i = 0; i < 4; i++)	/* first fit: back to back */
		ck_assert_ptr_eq(p[i], (char *)big + 6 * i * TH_CHUNK);
	ck_assert_int_eq(gmlake_offload_init(&inplace, ctx, 4,
					     GMLAKE_OFFLOAD_INPLACE), 0);
	ck_assert_int_eq(spill(&inplace, p[0]), -EBUSY);
	ck_assert_int_eq(gmlake_offload_state(ctx, p[0]), GMLAKE_BLOCK_RESIDENT);
	TH_OK(ctx, gmlake_offload_exit(&inplace));
	th_check(ctx);
	th_stats(ctx, &st0);
	for (int i = 0; i < 4; i++) {
		ck_assert_int_eq(spill(&ring, p[i]), 0);
		ck_assert_int_eq(gmlake_offload_state(ctx, p[i]),
				 GMLAKE_BLOCK_SPILLED);
		th_check(ctx);
	}
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_unmap] -
			  st0.calls[GMLAKE_CALL_mem_unmap], 4);
	ck_assert_int_eq(st.spilled_blocks.current, 4);
	ck_assert_int_eq(fetch(&ring, p[1]), 0);
	th_check(ctx);
	th_verify_ok(ctx, p[1], 6 * TH_CHUNK, 41, NULL);
	ck_assert_int_eq(fetch(&ring, p[0]), 0);
	th_check(ctx);
	th_verify_ok(ctx, p[0], 6 * TH_CHUNK, 40, NULL);
	th_free(ctx, p[3]);				/* spilled, freed */
	th_check(ctx);
	ck_assert_int_eq(fetch(&ring, p[2]), 0);
	th_verify_ok(ctx, p[2], 6 * TH_CHUNK, 42, NULL);
	th_stats(ctx, &st0);
	/* p[2] holds 4 single chunks now (a fetch maps no slab) and 2 of a
	 * slab whose rest is free: 4 unmaps, and one for the slab whole. */
	ck_assert_int_eq(spill(&ring, p[2]), 0);
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_unmap] -
			  st0.calls[GMLAKE_CALL_mem_unmap], 5);
	ck_assert_int_eq(fetch(&ring, p[2]), 0);
	th_check(ctx);
	for (int i = 0; i < 3; i++)
		th_verify_free(ctx, p[i], 6 * TH_CHUNK, 40 + i, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/*
 * Blocks of 5 chunks made one after another at the top, under a tier, on
 * slabs of 4 (rounding up to whole slabs allowed by an earlier peak): a
 * block that would take the free top of its neighbour's last slab and
 * less than a slab new would hold only the ends of two slabs, nothing a
 * spill can unmap once the next block takes the rest; each grows whole
 * instead, and every one spills and comes back.
 */
START_TEST(test_tail_blocks_spill)
{
	struct gmlake_offload ring;
	struct gmlake_config cfg;
	gmlake_ctx *ctx;
	void *big, *p[4];

	th_config(&cfg, 128 * TH_MiB);
	cfg.host_limit = 64 * TH_MiB;
	cfg.grow_handle = 4 * TH_CHUNK;
	ctx = th_ctx_cfg(&cfg);
	ring_init(&ring, ctx, 8);
	big = th_alloc_filled(ctx, 40 * TH_CHUNK, 9, NULL);	/* the peak */
	th_free(ctx, big);
	TH_OK(ctx, gmlake_trim(ctx));
	for (int i = 0; i < 4; i++)
		p[i] = th_alloc_filled(ctx, 5 * TH_CHUNK, 50 + i, NULL);
	for (int i = 0; i < 4; i++) {
		int ret = spill(&ring, p[i]);

		ck_assert_msg(ret == 0, "block %d: spill %d (%s)", i, ret,
			      gmlake_last_error());
		ck_assert_int_eq(gmlake_offload_state(ctx, p[i]),
				 GMLAKE_BLOCK_SPILLED);
		th_check(ctx);
	}
	for (int i = 0; i < 4; i++) {
		ck_assert_int_eq(fetch(&ring, p[i]), 0);
		th_check(ctx);
		th_verify_free(ctx, p[i], 5 * TH_CHUNK, 50 + i, NULL);
	}
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/*
 * A cached stitched range of 8 chunks over two free slabs, A and C (4
 * chunks each, filled with 1 and 3 before), and between them a live chunk
 * *b (filled with 2); returns the range (freed, filled with 4).
 */
static void *stitched_slabs(gmlake_ctx *ctx, void **a, void **b, void **c)
{
	struct gmlake_stats st0, st;
	void *e;

	*a = th_alloc_filled(ctx, 4 * TH_CHUNK, 1, NULL);   /* slab A */
	*b = th_alloc_filled(ctx, TH_CHUNK, 2, NULL);       /* a chunk */
	*c = th_alloc_filled(ctx, 4 * TH_CHUNK, 3, NULL);   /* slab C */
	th_free(ctx, *a);
	th_free(ctx, *c);
	th_stats(ctx, &st0);
	e = th_alloc_filled(ctx, 8 * TH_CHUNK, 4, NULL);    /* over A, C */
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.stitches, st0.stitches + 1);
	th_free(ctx, e);
	return e;
}

/*
 * A block that a cached stitched range over two slabs serves, smaller
 * than the range, covers only part of its second slab; the rest of that
 * slab is free, so the spill takes the slab's mapping in the range along
 * (those positions become holes) and the block comes back with its bytes.
 */
START_TEST(test_spill_part_of_stitched_slab)
{
	struct gmlake_offload ring;
	gmlake_ctx *ctx;
	void *a, *b, *c, *e, *p;

	ctx = slab_tier_ctx();
	ring_init(&ring, ctx, 8);
	e = stitched_slabs(ctx, &a, &b, &c);
	p = th_alloc_filled(ctx, 6 * TH_CHUNK, 5, NULL);
	ck_assert_ptr_eq(p, e);				/* best fit: the range */
	th_check(ctx);
	ck_assert_int_eq(spill(&ring, p), 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, p), GMLAKE_BLOCK_SPILLED);
	th_check(ctx);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_check(ctx);
	th_verify_free(ctx, p, 6 * TH_CHUNK, 5, NULL);
	th_verify_free(ctx, b, TH_CHUNK, 2, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/*
 * A block stitched from the free ends of two slabs that other blocks hold
 * the rest of (C's top, A's bottom; each slab mapped whole at an end of
 * the range): while both slabs are shared, all of the block stays on the
 * device (-EBUSY, unchanged); once C's other block is freed, a spill takes
 * C's slab along and keeps the positions in A; the block comes back with
 * its bytes, and the neighbours keep theirs throughout.
 */
START_TEST(test_spill_stitched_ends)
{
	struct gmlake_offload ring;
	struct gmlake_stats st0, st;
	struct th_slab_ends l;
	gmlake_ctx *ctx;
	void *e;

	ctx = slab_tier_ctx();
	ring_init(&ring, ctx, 8);
	th_slab_ends(ctx, &l);
	th_stats(ctx, &st0);
	e = th_alloc_filled(ctx, 4 * TH_CHUNK, 8, NULL);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.stitches, st0.stitches + 1);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_create] -
			  st0.calls[GMLAKE_CALL_mem_create], 0);
	th_check(ctx);
	ck_assert_int_eq(spill(&ring, e), -EBUSY);
	ck_assert_int_eq(gmlake_offload_state(ctx, e), GMLAKE_BLOCK_RESIDENT);
	th_check(ctx);
	th_verify_ok(ctx, e, 4 * TH_CHUNK, 8, NULL);
	th_verify_free(ctx, l.z, 2 * TH_CHUNK, 7, NULL);
	ck_assert_int_eq(spill(&ring, e), 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, e), GMLAKE_BLOCK_SPILLED);
	th_check(ctx);
	th_verify_ok(ctx, l.y, 2 * TH_CHUNK, 6, NULL);
	ck_assert_int_eq(fetch(&ring, e), 0);
	th_check(ctx);
	th_verify_free(ctx, e, 4 * TH_CHUNK, 8, NULL);
	th_verify_free(ctx, l.y, 2 * TH_CHUNK, 6, NULL);
	th_verify_free(ctx, l.b, TH_CHUNK, 2, NULL);
	th_verify_free(ctx, l.d, TH_CHUNK, 4, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/*
 * The same for a cached stitched range over two slabs: a long-lived block
 * of its size is not served from it (nor stitched or repaired onto
 * slabs) and spills; an ordinary block of that size then takes the range
 * again.
 */
START_TEST(test_long_lived_off_stitched_slabs)
{
	struct gmlake_offload ring;
	gmlake_ctx *ctx;
	void *a, *b, *c, *e, *s, *p;

	ctx = slab_tier_ctx();
	ring_init(&ring, ctx, 8);
	e = stitched_slabs(ctx, &a, &b, &c);
	TH_OK(ctx, gmlake_long_lived(ctx, true));
	s = th_alloc_filled(ctx, 8 * TH_CHUNK, 5, NULL);
	TH_OK(ctx, gmlake_long_lived(ctx, false));
	ck_assert_ptr_ne(s, e);
	ck_assert_msg((char *)s + 8 * TH_CHUNK <= (char *)a ||
		      (char *)s >= (char *)c + 4 * TH_CHUNK,
		      "a long-lived block took a slab's positions");
	th_check(ctx);
	ck_assert_int_eq(spill(&ring, s), 0);
	p = th_alloc_filled(ctx, 8 * TH_CHUNK, 6, NULL);
	ck_assert_ptr_eq(p, e);				/* best fit: the range */
	ck_assert_int_eq(fetch(&ring, s), 0);
	th_check(ctx);
	th_verify_free(ctx, s, 8 * TH_CHUNK, 5, NULL);
	th_verify_free(ctx, p, 8 * TH_CHUNK, 6, NULL);
	th_verify_free(ctx, b, TH_CHUNK, 2, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/*
 * A fetch takes free chunks the cache holds before it makes new ones:
 * backward frees memory as it fetches, and new chunks would lift reserved
 * memory to where it was without offloading. The positions it empties are
 * unmapped.
 */
START_TEST(test_fetch_takes_cached_chunks)
{
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 64 * TH_MiB, 0);
	struct gmlake_offload ring;
	struct gmlake_stats st0, st;
	void *p = th_alloc_filled(ctx, 8 * TH_MiB, 21, NULL);
	void *q;

	ring_init(&ring, ctx, 8);
	ck_assert_int_eq(spill(&ring, p), 0);
	/* q's segment is made of p's chunks; freed, they sit in the cache. */
	q = th_alloc_filled(ctx, 8 * TH_MiB, 22, NULL);
	th_verify_free(ctx, q, 8 * TH_MiB, 22, NULL);
	TH_OK(ctx, gmlake_stream_synchronize(ctx, NULL));
	th_stats(ctx, &st0);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_check(ctx);
	th_verify_ok(ctx, p, 8 * TH_MiB, 21, NULL);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_create],
			  st0.calls[GMLAKE_CALL_mem_create]);
	ck_assert_int_eq(st.reserved_bytes.current, st0.reserved_bytes.current);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_unmap],
			  st0.calls[GMLAKE_CALL_mem_unmap] + 4);
	/* Memory for more is made as before. */
	q = th_alloc_filled(ctx, 8 * TH_MiB, 23, NULL);
	th_check(ctx);
	th_verify_free(ctx, q, 8 * TH_MiB, 23, NULL);
	th_verify_ok(ctx, p, 8 * TH_MiB, 21, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/*
 * ... even chunks whose last work has not run yet: the fetch's copy waits
 * for all work, and the chunk's old position stays mapped until that work
 * is done, then goes.
 */
START_TEST(test_fetch_takes_busy_chunks)
{
	struct held h;
	struct gmlake_offload_cqe *cqe;
	struct gmlake_stats st0, st;
	void *q;

	held_init(&h, 41);
	q = th_alloc_filled(h.ctx, 8 * TH_MiB, 42, h.s);	/* p's chunks */
	th_hold(h.ctx, h.s, true);
	th_free(h.ctx, q);		/* its guard waits behind the hold */
	th_stats(h.ctx, &st0);
	fetch_attached(h.ctx, &h.ring, h.p);
	th_check(h.ctx);
	th_stats(h.ctx, &st);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_create],
			  st0.calls[GMLAKE_CALL_mem_create]);
	/* q's old positions are still mapped while its work is held. */
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_unmap],
			  st0.calls[GMLAKE_CALL_mem_unmap]);
	ck_assert_int_eq(gmlake_offload_peek_cqe(&h.ring, &cqe), -EAGAIN);
	th_hold(h.ctx, h.s, false);
	ck_assert_int_eq(next_res(&h.ring, ANY_TAG), 0);
	th_verify_ok(h.ctx, h.p, 8 * TH_MiB, 41, NULL);
	for (int ms = 0;; ms++) {
		th_stats(h.ctx, &st);
		if (st.calls[GMLAKE_CALL_mem_unmap] ==
		    st0.calls[GMLAKE_CALL_mem_unmap] + 4)
			break;
		ck_assert_msg(ms < 10000, "stale positions still mapped "
			      "after 10 s");
		usleep(1000);
	}
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_unmap],
			  st0.calls[GMLAKE_CALL_mem_unmap] + 4);
	ck_assert_int_eq(st.reserved_bytes.current, st0.reserved_bytes.current);
	th_check(h.ctx);
	held_fini(&h);
}
END_TEST

/*
 * A stale position whose unmap fails stays listed; the trim's own retry
 * may unmap it meanwhile, and the segment must outlive the entry (the
 * nth unmap of the trim fails, for each n).
 */
START_TEST(test_stale_unmap_fails)
{
	struct held h;
	void *q;

	held_init(&h, 43);
	q = th_alloc_filled(h.ctx, 8 * TH_MiB, 44, h.s);
	th_hold(h.ctx, h.s, true);
	th_free(h.ctx, q);
	fetch_attached(h.ctx, &h.ring, h.p);
	th_hold(h.ctx, h.s, false);
	gml_dev_fail_nth(th_dev(h.ctx), GMLAKE_CALL_mem_unmap, 1 + _i, EIO);
	(void)gmlake_trim(h.ctx);	/* may report the failed unmap */
	th_check(h.ctx);
	gml_dev_fail_nth(th_dev(h.ctx), -1, 0, 0);
	TH_OK(h.ctx, gmlake_trim(h.ctx));
	ck_assert_int_eq(next_res(&h.ring, ANY_TAG), 0);
	th_verify_ok(h.ctx, h.p, 8 * TH_MiB, 43, NULL);
	held_fini(&h);
}
END_TEST

/*
 * A fetch that fails after taking chunks whose last work is still queued
 * (here: a copy into the block they belonged to) must not hand them out
 * before that work ran: a block allocated next on another stream keeps
 * its bytes.
 */
START_TEST(test_failed_fetch_keeps_taken_chunks_back)
{
	struct held h;
	struct gmlake_offload_sqe *sqe;
	struct gmlake_offload_cqe *cqe;
	void *q, *r;
	char *buf = malloc(8 * TH_MiB);

	ck_assert_ptr_nonnull(buf);
	held_init(&h, 45);
	q = th_alloc(h.ctx, 8 * TH_MiB, h.s);
	th_hold(h.ctx, h.s, true);
	memset(buf, 0x5a, 8 * TH_MiB);
	ck_assert_int_eq(gml_dev_memcpy(th_dev(h.ctx), q, buf, 8 * TH_MiB,
				    GML_COPY_HTOD, h.s), 0);
	th_free(h.ctx, q);		/* the copy into it is still queued */
	gml_dev_fail_nth(th_dev(h.ctx), GMLAKE_CALL_set_access, 1, EIO);
	sqe = gmlake_offload_get_sqe(&h.ring);
	gmlake_offload_prep_fetch(sqe, h.p);
	ck_assert_int_eq(gmlake_offload_submit(&h.ring), 1);
	/* The failed fetch waits for s before its chunks serve again. */
	usleep(100 * 1000);
	ck_assert_int_eq(gmlake_offload_peek_cqe(&h.ring, &cqe), -EAGAIN);
	th_hold(h.ctx, h.s, false);
	ck_assert_int_lt(next_res(&h.ring, ANY_TAG), 0);
	gml_dev_fail_nth(th_dev(h.ctx), -1, 0, 0);
	ck_assert_int_eq(gmlake_offload_state(h.ctx, h.p),
			 GMLAKE_BLOCK_SPILLED);
	r = th_alloc_filled(h.ctx, 8 * TH_MiB, 46, NULL);
	TH_OK(h.ctx, gmlake_stream_synchronize(h.ctx, h.s));
	th_verify_ok(h.ctx, r, 8 * TH_MiB, 46, NULL);
	th_check(h.ctx);
	ck_assert_int_eq(fetch(&h.ring, h.p), 0);
	th_verify_ok(h.ctx, h.p, 8 * TH_MiB, 45, NULL);
	th_free(h.ctx, r);
	free(buf);
	held_fini(&h);
}
END_TEST

/*
 * With offload running, frees record events even on a single stream;
 * nothing else polls such a stream, so recording must let go of the
 * completed ones rather than grow the list without end.
 */
START_TEST(test_events_do_not_pile_up)
{
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 64 * TH_MiB, 0);
	struct gmlake_offload ring;

	ring_init(&ring, ctx, 4);
	for (int i = 0; i < 4000; i++) {
		void *p = th_alloc(ctx, 4 * TH_MiB, NULL);

		th_free(ctx, p);
	}
	ck_assert_msg(ctx->nstreams == 1 && ctx->streams[0].count < 1024,
		      "%zu events pending on the one stream",
		      ctx->streams[0].count);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}
END_TEST

/* ... chunks an unused cached stitched view maps too, evicting it. */
START_TEST(test_fetch_evicts_unused_stitched)
{
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 64 * TH_MiB, 0);
	struct gmlake_offload ring;
	struct gmlake_stats st0, st;
	void *p = th_alloc_filled(ctx, 8 * TH_MiB, 31, NULL);
	void *x1, *x2, *m, *y;

	ring_init(&ring, ctx, 8);
	ck_assert_int_eq(spill(&ring, p), 0);
	/* Two free runs apart (m between them stays), then one view
	 * stitched over both: growing would pass the budget. */
	x1 = th_alloc(ctx, 4 * TH_MiB, NULL);
	m = th_alloc(ctx, 4 * TH_MiB, NULL);
	x2 = th_alloc(ctx, 4 * TH_MiB, NULL);
	th_free(ctx, x1);
	th_free(ctx, x2);
	y = th_alloc_filled(ctx, 8 * TH_MiB, 32, NULL);
	th_verify_free(ctx, y, 8 * TH_MiB, 32, NULL);
	TH_OK(ctx, gmlake_stream_synchronize(ctx, NULL));
	th_stats(ctx, &st0);
	ck_assert_int_eq(st0.stitched_cached.current, 1);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_check(ctx);
	th_verify_ok(ctx, p, 8 * TH_MiB, 31, NULL);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.stitched_cached.current, 0);
	ck_assert_uint_eq(st.calls[GMLAKE_CALL_mem_create],
			  st0.calls[GMLAKE_CALL_mem_create]);
	ck_assert_int_eq(st.reserved_bytes.current, st0.reserved_bytes.current);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, m);
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

START_TEST(test_spill_fetch_stitched)
{
	gmlake_ctx *ctx = off_ctx(20 * TH_MiB, 64 * TH_MiB, 0);
	static const size_t sizes[4] = { 4 * TH_MiB, 2 * TH_MiB, 4 * TH_MiB,
					 2 * TH_MiB };
	struct gmlake_offload ring;
	struct gmlake_stats st;
	void *blk[4], *b, *d, *s, *x, *y;

	th_two_holes(ctx, sizes, blk);
	b = blk[1], d = blk[3];
	th_stats(ctx, &st);
	s = th_alloc(ctx, 14 * TH_MiB, NULL);	/* 4 + 4 free + 6 new */
	th_stats(ctx, &st);
	ck_assert_int_eq(st.stitched_live.current, 1);
	th_fill_ok(ctx, s, 14 * TH_MiB, 7, NULL);
	ring_init(&ring, ctx, 4);
	ck_assert_int_eq(spill(&ring, s), 0);
	th_check(ctx);
	/* Its chunks are free again: others may use them, not its range. */
	x = th_alloc(ctx, 8 * TH_MiB, NULL);
	y = th_alloc(ctx, 4 * TH_MiB, NULL);
	ck_assert(!th_overlap(x, 8 * TH_MiB, s, 14 * TH_MiB));
	ck_assert(!th_overlap(y, 4 * TH_MiB, s, 14 * TH_MiB));
	th_fill_ok(ctx, x, 8 * TH_MiB, 8, NULL);
	th_fill_ok(ctx, y, 4 * TH_MiB, 9, NULL);
	/* No room to fetch: -ENOMEM, still spilled. */
	ck_assert_int_eq(fetch(&ring, s), -ENOMEM);
	ck_assert_int_eq(gmlake_offload_state(ctx, s), GMLAKE_BLOCK_SPILLED);
	th_check(ctx);
	th_free(ctx, x);
	th_free(ctx, y);
	ck_assert_int_eq(fetch(&ring, s), 0);
	th_check(ctx);
	th_verify_ok(ctx, s, 14 * TH_MiB, 7, NULL);
	th_verify_ok(ctx, b, 2 * TH_MiB, 2, NULL);
	th_verify_ok(ctx, d, 2 * TH_MiB, 4, NULL);
	/* Spill, then free while spilled: the host copy goes too. */
	ck_assert_int_eq(spill(&ring, s), 0);
	th_free(ctx, s);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.spilled_blocks.current, 0);
	ck_assert_int_eq(st.host_bytes.current, 0);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, b);
	th_free(ctx, d);
	TH_OK(ctx, gmlake_trim(ctx));
	th_destroy(ctx);
}
END_TEST

/*
 * The engine starts a batch's spills and fetches in turn, but requests on
 * one block in the order they came: with x resident, spill(a), spill(x),
 * fetch(x) has the fetch find x moving (-EBUSY), where a fetch started
 * before x's spill would have found it resident (0) and x would end
 * spilled behind a successful fetch.
 */
START_TEST(test_batch_keeps_block_order)
{
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 64 * TH_MiB, 0);
	struct gmlake_offload ring;
	struct gmlake_offload_sqe *sqe;
	struct gmlake_offload_cqe *cqe;
	void *p[2];
	int res[3];

	for (int i = 0; i < 2; i++)
		p[i] = th_alloc_filled(ctx, 2 * TH_CHUNK, 60 + i, NULL);
	ring_init(&ring, ctx, 4);
	for (int i = 0; i < 3; i++) {
		sqe = gmlake_offload_get_sqe(&ring);
		ck_assert_ptr_nonnull(sqe);
		if (i < 2)
			gmlake_offload_prep_spill(sqe, p[i]);
		else
			gmlake_offload_prep_fetch(sqe, p[1]);
		gmlake_offload_sqe_set_data(sqe, (uint64_t)i);
	}
	ck_assert_int_eq(gmlake_offload_submit(&ring), 3);
	for (int got = 0; got < 3; got++) {
		uint64_t i;

		ck_assert_int_eq(gmlake_offload_wait_cqe(&ring, &cqe), 0);
		i = gmlake_offload_cqe_get_data(cqe);
		ck_assert_uint_lt(i, 3);
		res[i] = cqe->res;
		gmlake_offload_cqe_seen(&ring, cqe);
	}
	ck_assert_int_eq(res[0], 0);
	ck_assert_int_eq(res[1], 0);
	ck_assert_int_eq(res[2], -EBUSY);
	ck_assert_int_eq(gmlake_offload_state(ctx, p[1]), GMLAKE_BLOCK_SPILLED);
	th_check(ctx);
	for (int i = 0; i < 2; i++) {
		ck_assert_int_eq(fetch(&ring, p[i]), 0);
		th_verify_free(ctx, p[i], 2 * TH_CHUNK, 60 + i, NULL);
	}
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}
END_TEST

/* Many requests in flight, both directions at once, any order. */
START_TEST(test_many_in_flight)
{
	enum { N = 16 };
	gmlake_ctx *ctx = off_ctx(256 * TH_MiB, 256 * TH_MiB, 0);
	struct gmlake_offload ring;
	struct gmlake_offload_sqe *sqe;
	struct gmlake_offload_cqe *cqe;
	bool seen[2 * N] = { false };
	void *p[2 * N];
	int i, got;

	for (i = 0; i < 2 * N; i++) {
		p[i] = th_alloc(ctx, (size_t)(1 + i % 3) * 2 * TH_MiB, NULL);
		th_fill_ok(ctx, p[i], (size_t)(1 + i % 3) * 2 * TH_MiB,
			   100 + i, NULL);
	}
	ring_init(&ring, ctx, 2 * N);
	for (i = 0; i < N; i++)
		ck_assert_int_eq(spill(&ring, p[i]), 0);
	/* Fetch the first half while spilling the second. */
	for (i = 0; i < 2 * N; i++) {
		sqe = gmlake_offload_get_sqe(&ring);
		ck_assert_ptr_nonnull(sqe);
		if (i < N)
			gmlake_offload_prep_fetch(sqe, p[i]);
		else
			gmlake_offload_prep_spill(sqe, p[i]);
		gmlake_offload_sqe_set_data(sqe, (uint64_t)i);
	}
	ck_assert_ptr_null(gmlake_offload_get_sqe(&ring));
	ck_assert_int_eq(gmlake_offload_submit(&ring), 2 * N);
	for (got = 0; got < 2 * N; got++) {
		ck_assert_int_eq(gmlake_offload_wait_cqe(&ring, &cqe), 0);
		i = (int)gmlake_offload_cqe_get_data(cqe);
		ck_assert_int_lt(i, 2 * N);
		ck_assert(!seen[i]);
		seen[i] = true;
		ck_assert_msg(cqe->res == 0, "request %d: %d", i, cqe->res);
		gmlake_offload_cqe_seen(&ring, cqe);
	}
	ck_assert_int_eq(gmlake_offload_peek_cqe(&ring, &cqe), -EAGAIN);
	ck_assert_int_eq(gmlake_offload_wait_cqe(&ring, &cqe), -EAGAIN);
	th_check(ctx);
	for (i = N; i < 2 * N; i++)
		ck_assert_int_eq(fetch(&ring, p[i]), 0);
	for (i = 0; i < 2 * N; i++) {
		th_verify_ok(ctx, p[i], (size_t)(1 + i % 3) * 2 * TH_MiB,
			     100 + i, NULL);
		th_free(ctx, p[i]);
	}
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}
END_TEST

/* Bad requests complete with -errno; a block in motion cannot be freed. */
START_TEST(test_ring_errors)
{
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 64 * TH_MiB, 0);
	struct gmlake_offload ring, bad = { 0 };
	struct gmlake_offload_sqe *sqe;
	struct gmlake_offload_cqe *cqe;
	gmlake_stream_t s = th_stream(ctx);
	void *small = th_alloc(ctx, 4096, NULL);
	void *p = th_alloc(ctx, 4 * TH_MiB, s);

	ck_assert_int_eq(gmlake_offload_init(&ring, ctx, 0, 0), -EINVAL);
	ck_assert_int_eq(gmlake_offload_init(&ring, ctx, 8, 0x80), -EINVAL);
	ck_assert_int_eq(gmlake_offload_init(NULL, ctx, 8, 0), -EINVAL);
	ck_assert_int_eq(gmlake_offload_submit(&bad), -EINVAL);
	ck_assert_ptr_null(gmlake_offload_get_sqe(&bad));
	ck_assert_int_eq(gmlake_advise(ctx, p, 7), -EINVAL);
	ck_assert_int_eq(gmlake_advise(ctx, (char *)p + 1,
				       GMLAKE_ADVISE_OFFLOADABLE), -EINVAL);
	ck_assert_int_eq(gmlake_advise(ctx, small, GMLAKE_ADVISE_OFFLOADABLE),
			 -EOPNOTSUPP);
	ck_assert_int_eq(gmlake_offload_state(ctx, (char *)p + 1), -EINVAL);
	ring_init(&ring, ctx, 4);
	ck_assert_int_eq(gmlake_offload_submit(&ring), 0);
	/* A failed completion brings its own message to the reaper, not
	 * the last one of this thread (the unknown advice above). */
	ck_assert_int_eq(spill(&ring, (char *)p + 4096), -EINVAL);
	ck_assert_msg(strstr(gmlake_last_error(), "offload: 0x") &&
		      strstr(gmlake_last_error(), "not a live block"),
		      "message: %s", gmlake_last_error());
	ck_assert_int_eq(spill(&ring, small), -EOPNOTSUPP);
	ck_assert_msg(strstr(gmlake_last_error(), "small block"),
		      "message: %s", gmlake_last_error());
	ck_assert_int_eq(fetch(&ring, small), -EOPNOTSUPP);
	sqe = gmlake_offload_get_sqe(&ring);	/* a NOP completes with 0 */
	gmlake_offload_sqe_set_data(sqe, 77);
	ck_assert_int_eq(gmlake_offload_submit(&ring), 1);
	ck_assert_int_eq(gmlake_offload_wait_cqe(&ring, &cqe), 0);
	ck_assert_int_eq(cqe->res, 0);
	ck_assert_uint_eq(cqe->user_data, 77);
	gmlake_offload_cqe_seen(&ring, cqe);

	/* The spill waits for the block's stream: hold it there. */
	th_fill_ok(ctx, p, 4 * TH_MiB, 5, s);
	th_hold(ctx, s, true);
	sqe = gmlake_offload_get_sqe(&ring);
	gmlake_offload_prep_spill(sqe, p);
	ck_assert_int_eq(gmlake_offload_submit(&ring), 1);
	while (gmlake_offload_state(ctx, p) != GMLAKE_BLOCK_SPILLING)
		usleep(1000);
	TH_ERR(ctx, gmlake_free(ctx, p), -EBUSY);
	ck_assert_int_eq(gmlake_offload_peek_cqe(&ring, &cqe), -EAGAIN);
	ck_assert_int_eq(fetch(&ring, p), -EBUSY);
	ck_assert_msg(strstr(gmlake_last_error(), "is moving"), "message: %s",
		      gmlake_last_error());
	th_hold(ctx, s, false);
	ck_assert_int_eq(gmlake_offload_wait_cqe(&ring, &cqe), 0);
	ck_assert_int_eq(cqe->res, 0);
	gmlake_offload_cqe_seen(&ring, cqe);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_verify_ok(ctx, p, 4 * TH_MiB, 5, s);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, p);
	th_free(ctx, small);
	th_destroy(ctx);
}
END_TEST

/* The engine thread has a name (top -H, gdb, perf show it). */
START_TEST(test_engine_named)
{
	gmlake_ctx *ctx = off_ctx(16 * TH_MiB, 16 * TH_MiB, 0);
	struct gmlake_offload ring;
	int ms;

	ck_assert(!th_thread_named("gmlake-offload"));
	ring_init(&ring, ctx, 2);
	/* It names itself when it starts. */
	for (ms = 0; !th_thread_named("gmlake-offload") && ms < 5000; ms++)
		usleep(1000);
	ck_assert_msg(ms < 5000, "no thread named gmlake-offload");
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Limits                                                                 */

/*
 * The engine held where it pins host memory, outside the context lock:
 * once armed (gate_at), that host_register waits until gate_open. The
 * wrapper goes in before the engine starts and stays (as sticky_ctx's).
 */
static const struct gml_drv_ops *gate_real;
static struct gml_drv_ops gate_ops;
static atomic_int gate_calls, gate_at, gate_held, gate_open;

static int gate_host_register(void *priv, void *p, size_t size)
{
	if (atomic_fetch_add(&gate_calls, 1) + 1 == atomic_load(&gate_at)) {
		atomic_store(&gate_held, 1);
		while (!atomic_load(&gate_open))
			usleep(1000);
	}
	return gate_real->host_register(priv, p, size);
}

/* The wrapper on ctx, the gate not armed: it counts the pinnings that
 * reach the backend (gate_calls; an injected fault never does). */
static void gate_install(gmlake_ctx *ctx)
{
	struct gml_dev *dev = th_dev(ctx);

	gate_real = dev->ops;
	gate_ops = *dev->ops;
	gate_ops.host_register = gate_host_register;
	atomic_store(&gate_calls, 0);
	atomic_store(&gate_at, 0);
	atomic_store(&gate_held, 0);
	atomic_store(&gate_open, 0);
	dev->ops = &gate_ops;
}


/* More than the host budget: -ENOMEM, the block stays on the device. */
START_TEST(test_host_budget)
{
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 6 * TH_MiB, 0);
	struct gmlake_offload ring;
	struct gmlake_stats st;
	void *p = th_alloc(ctx, 8 * TH_MiB, NULL);
	void *q = th_alloc(ctx, 4 * TH_MiB, NULL);
	void *r = th_alloc(ctx, 4 * TH_MiB, NULL);

	th_fill_ok(ctx, p, 8 * TH_MiB, 1, NULL);
	th_fill_ok(ctx, q, 4 * TH_MiB, 2, NULL);
	th_fill_ok(ctx, r, 4 * TH_MiB, 3, NULL);
	ring_init(&ring, ctx, 4);
	ck_assert_int_eq(spill(&ring, p), -ENOMEM);
	ck_assert_int_eq(gmlake_offload_state(ctx, p), GMLAKE_BLOCK_RESIDENT);
	th_check(ctx);
	th_verify_ok(ctx, p, 8 * TH_MiB, 1, NULL);
	ck_assert_int_eq(spill(&ring, q), 0);
	ck_assert_int_eq(spill(&ring, r), -ENOMEM);	/* budget spent */
	th_stats(ctx, &st);
	ck_assert_int_le(st.host_pinned.current, (int64_t)(6 * TH_MiB));
	ck_assert_uint_ge(st.offload_failures, 2);
	ck_assert_int_eq(fetch(&ring, q), 0);
	ck_assert_int_eq(spill(&ring, r), 0);		/* room again */
	ck_assert_int_eq(fetch(&ring, r), 0);
	th_verify_ok(ctx, q, 4 * TH_MiB, 2, NULL);
	th_verify_ok(ctx, r, 4 * TH_MiB, 3, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, p);
	th_free(ctx, q);
	th_free(ctx, r);
	th_destroy(ctx);
}
END_TEST

/*
 * host_pin: what the arena pins when offload starts. Nothing asked: one
 * growth step (a quarter of this budget); more: all of it at once, so a
 * spill of that size pins nothing more; past the budget: the budget.
 */
START_TEST(test_host_pin)
{
	static const struct { size_t pin, pinned; } cases[] = {
		{ 0, 8 * TH_MiB },
		{ 20 * TH_MiB, 20 * TH_MiB },
		{ 1024 * TH_MiB, 32 * TH_MiB },
	};
	struct gmlake_config cfg;
	struct gmlake_offload ring;
	struct gmlake_stats st;
	gmlake_ctx *ctx;
	void *p;

	th_config(&cfg, 64 * TH_MiB);
	cfg.host_limit = 32 * TH_MiB;
	cfg.host_pin = cases[_i].pin;
	ctx = th_ctx_cfg(&cfg);
	p = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_fill_ok(ctx, p, 16 * TH_MiB, 7, NULL);
	ring_init(&ring, ctx, 4);
	/* The engine pins more than a step before its first request. */
	for (int ms = 0;; ms++) {
		th_stats(ctx, &st);
		if (st.host_pinned.current == (int64_t)cases[_i].pinned)
			break;
		ck_assert_msg(ms < 10000, "%lld bytes pinned, not %zu",
			      (long long)st.host_pinned.current,
			      cases[_i].pinned);
		usleep(1000);
	}
	ck_assert_int_eq(spill(&ring, p), 0);
	th_stats(ctx, &st);
	if (cases[_i].pinned >= 16 * TH_MiB)	/* it fitted: no growth */
		ck_assert_int_eq(st.host_pinned.current,
				 (int64_t)cases[_i].pinned);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_verify_ok(ctx, p, 16 * TH_MiB, 7, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/* The device fills up while a segment block is out: -ENOMEM, no loss. */
START_TEST(test_fetch_oom)
{
	gmlake_ctx *ctx = off_ctx(16 * TH_MiB, 64 * TH_MiB, 0);
	struct gmlake_offload ring;
	void *p = th_alloc(ctx, 8 * TH_MiB, NULL), *big;

	th_fill_ok(ctx, p, 8 * TH_MiB, 21, NULL);
	ring_init(&ring, ctx, 2);
	ck_assert_int_eq(spill(&ring, p), 0);
	big = th_alloc(ctx, 16 * TH_MiB, NULL);
	ck_assert(!th_overlap(big, 16 * TH_MiB, p, 8 * TH_MiB));
	th_fill_ok(ctx, big, 16 * TH_MiB, 22, NULL);
	ck_assert_int_eq(fetch(&ring, p), -ENOMEM);
	ck_assert_int_eq(gmlake_offload_state(ctx, p), GMLAKE_BLOCK_SPILLED);
	th_check(ctx);
	th_verify_ok(ctx, big, 16 * TH_MiB, 22, NULL);
	th_free(ctx, big);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_check(ctx);
	th_verify_ok(ctx, p, 8 * TH_MiB, 21, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/*
 * Fault injection: each driver call a spill or a fetch makes fails once,
 * at its first to third use. The completion carries 0 or -errno, and
 * whatever happened, the block's bytes come back intact.
 */
static const int fault_calls[] = {
	GMLAKE_CALL_memcpy, GMLAKE_CALL_stream_wait, GMLAKE_CALL_host_func,
	GMLAKE_CALL_event_create, GMLAKE_CALL_event_record,
	GMLAKE_CALL_event_query, GMLAKE_CALL_event_sync,
	GMLAKE_CALL_stream_sync, GMLAKE_CALL_mem_map, GMLAKE_CALL_mem_unmap,
	GMLAKE_CALL_set_access, GMLAKE_CALL_mem_create,
	GMLAKE_CALL_mem_release, GMLAKE_CALL_host_register,
};

/*
 * A block to move: size bytes filled from seed (on stream s), after a
 * free 2 MiB hole when stitched, so that it is stitched across it; and a
 * ring of 4 entries with flags.
 */
struct mover {
	gmlake_ctx *ctx;
	struct gmlake_offload ring;
	void *p, *keep;
	size_t size;
	gmlake_stream_t s;	/* the block's stream, or NULL */
};

static void mover_init(struct mover *m, gmlake_ctx *ctx, size_t size,
		       bool stitched, int seed, gmlake_stream_t s,
		       unsigned flags)
{
	int ret;

	m->ctx = ctx;
	m->size = size;
	m->s = s;
	m->keep = NULL;
	if (stitched) {
		void *hole = th_alloc(ctx, 2 * TH_MiB, NULL);

		m->keep = th_alloc(ctx, 2 * TH_MiB, NULL);
		th_free(ctx, hole);
	}
	m->p = th_alloc(ctx, size, s);
	th_fill_ok(ctx, m->p, size, seed, s);
	ret = gmlake_offload_init(&m->ring, ctx, 4, flags);
	ck_assert_msg(ret == 0, "gmlake_offload_init: %d (%s)", ret,
		      gmlake_last_error());
}

/* After a failure: the block spills and comes back with the bytes of
 * seed (read on stream s), the context consistent. */
static void mover_cycles(struct mover *m, int seed, gmlake_stream_t s)
{
	ck_assert_int_eq(spill(&m->ring, m->p), 0);
	ck_assert_int_eq(fetch(&m->ring, m->p), 0);
	th_check(m->ctx);
	th_verify_ok(m->ctx, m->p, m->size, seed, s);
}

/* Free all of it (the stream too), and the context. */
static void mover_fini(struct mover *m)
{
	TH_OK(m->ctx, gmlake_offload_exit(&m->ring));
	th_free(m->ctx, m->p);
	if (m->keep)
		th_free(m->ctx, m->keep);
	if (m->s)
		TH_OK(m->ctx, gmlake_stream_destroy(m->ctx, m->s));
	th_destroy(m->ctx);
}

/* Driver calls of kind k since the statistics in *mark. */
static uint64_t calls_since(gmlake_ctx *ctx, const struct gmlake_stats *mark,
			    int k)
{
	struct gmlake_stats st;

	th_stats(ctx, &st);
	return st.calls[k] - mark->calls[k];
}

/*
 * One failing driver call (the nth of its kind) in a spill and then in a
 * fetch: each completes or fails cleanly, the block keeps its bytes, and
 * the next spill and fetch work. With span, a block of 16 chunks that
 * cycled once already, so the fetch goes into a span (lib/span.c) and the
 * spill takes a span away.
 */
static void fault_round(int call, uint64_t nth, bool stitched, bool span)
{
	size_t size = 6 * TH_MiB, chunk;
	struct mover m;
	struct gml_dev *dev;
	gmlake_ctx *ctx;
	int res;

	if (span) {
		ctx = span_ctx(128, 96, &chunk);
		size = 16 * chunk;
	} else {
		ctx = off_ctx(32 * TH_MiB, 32 * TH_MiB, 0);
	}
	mover_init(&m, ctx, size, stitched, 31, NULL, 0);
	if (span) {
		struct gmlake_stats mark;

		ck_assert_int_eq(spill(&m.ring, m.p), 0);
		ck_assert_int_eq(fetch(&m.ring, m.p), 0);
		ck_assert_int_eq(spill(&m.ring, m.p), 0);
		th_stats(m.ctx, &mark);
		ck_assert_int_eq(fetch(&m.ring, m.p), 0);
		ck_assert_uint_eq(calls_since(m.ctx, &mark,
					      GMLAKE_CALL_mem_map), 1);
	}
	dev = th_dev(m.ctx);
	gml_dev_fail_nth(dev, call, nth, call == GMLAKE_CALL_mem_create ?
			 ENOMEM : EIO);
	res = spill(&m.ring, m.p);
	ck_assert_msg(res == 0 || res < 0, "spill: %d", res);
	th_check(m.ctx);
	if (res == 0) {
		ck_assert_int_eq(gmlake_offload_state(m.ctx, m.p),
				 GMLAKE_BLOCK_SPILLED);
		gml_dev_fail_nth(dev, call, nth, call == GMLAKE_CALL_mem_create ?
				 ENOMEM : EIO);
		res = fetch(&m.ring, m.p);
		ck_assert_msg(res == 0 || res < 0, "fetch: %d", res);
		th_check(m.ctx);
		gml_dev_fail_nth(dev, -1, 0, 0);
		if (res)
			ck_assert_int_eq(fetch(&m.ring, m.p), 0);
	} else {
		ck_assert_int_eq(gmlake_offload_state(m.ctx, m.p),
				 GMLAKE_BLOCK_RESIDENT);
	}
	gml_dev_fail_nth(dev, -1, 0, 0);
	th_check(m.ctx);
	th_verify_ok(m.ctx, m.p, m.size, 31, NULL);
	mover_cycles(&m, 31, NULL);	/* the machinery still works */
	mover_fini(&m);
}

#define NFAULT_CALLS ((int)(sizeof(fault_calls) / sizeof(fault_calls[0])))

/* _i: the call kind, then chunks or stitched, then chunks or a span. */
START_TEST(test_faults)
{
	int call = fault_calls[_i % NFAULT_CALLS];
	bool stitched = _i / NFAULT_CALLS % 2;
	bool span = _i >= 2 * NFAULT_CALLS;

	for (uint64_t nth = 1; nth <= 3; nth++)
		fault_round(call, nth, stitched, span);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* A sticky device error while a copy is in flight                        */

/*
 * After a sticky error (an illegal address in a user kernel, say) every
 * event query and sync of the context fails, so the engine can
 * never learn how its copy ended. The fault hooks of lib/dev.c fail one
 * call of one kind, once; this needs two kinds, every time. So the test
 * wraps the emulated backend's operation table, as check_fault does for
 * stream create. The wrapper goes in before the engine thread starts
 * (ring_init) and stays: the engine reads dev->ops without a lock.
 *
 * A dead CUDA context runs nothing more; the emulated device still runs
 * what is queued. STICKY_NOW fails at once and leaves a copy held back by
 * th_hold truly in flight: fine for a spill, whose copy only reads the
 * block and writes a buffer the engine must leak. STICKY_DRAIN lets the
 * stream drain before failing: a fetch's copy must not land in chunks
 * the engine gave back after the failure.
 */
enum { STICKY_OFF, STICKY_NOW, STICKY_DRAIN };

static const struct gml_drv_ops *sticky_real;
static struct gml_drv_ops sticky_ops;
static atomic_int sticky_mode;
static atomic_int sticky_queries;	/* event queries seen, failed or not */

static int sticky_event_query(void *priv, gml_event e)
{
	atomic_fetch_add(&sticky_queries, 1);
	if (atomic_load(&sticky_mode) != STICKY_OFF)
		return gml_set_error(-EIO, "event_query: sticky device error");
	return sticky_real->event_query(priv, e);
}

/* A wait's answer: the real one while healthy, else -EIO (after the real
 * wait ran, in STICKY_DRAIN; without waiting, in STICKY_NOW). */
static int sticky_wait(int mode, int real, const char *what)
{
	if (mode == STICKY_OFF)
		return real;
	return gml_set_error(-EIO, "%s: sticky device error", what);
}

static int sticky_event_sync(void *priv, gml_event e)
{
	int mode = atomic_load(&sticky_mode);

	return sticky_wait(mode, mode == STICKY_NOW ? 0 :
			   sticky_real->event_sync(priv, e), "event_sync");
}

static int sticky_stream_sync(void *priv, gmlake_stream_t s)
{
	int mode = atomic_load(&sticky_mode);

	return sticky_wait(mode, mode == STICKY_NOW ? 0 :
			   sticky_real->stream_sync(priv, s), "stream_sync");
}

/* off_ctx() with the wrapper installed, healthy for now. */
static gmlake_ctx *sticky_ctx(size_t capacity, size_t host_limit)
{
	gmlake_ctx *ctx = off_ctx(capacity, host_limit, 0);
	struct gml_dev *dev = th_dev(ctx);

	sticky_real = dev->ops;
	sticky_ops = *dev->ops;
	sticky_ops.event_query = sticky_event_query;
	sticky_ops.stream_sync = sticky_stream_sync;
	sticky_ops.event_sync = sticky_event_sync;
	atomic_store(&sticky_mode, STICKY_OFF);
	atomic_store(&sticky_queries, 0);
	dev->ops = &sticky_ops;
	return ctx;
}

static void submit_one(struct gmlake_offload *ring, int op, void *p)
{
	struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(ring);

	ck_assert_ptr_nonnull(sqe);
	if (op == GMLAKE_OFFLOAD_SPILL)
		gmlake_offload_prep_spill(sqe, p);
	else
		gmlake_offload_prep_fetch(sqe, p);
	gmlake_offload_sqe_set_data(sqe, (uintptr_t)p);
	ck_assert_int_eq(gmlake_offload_submit(ring), 1);
}

/* The one completion's res, within 10 s: a hang fails, it does not wait
 * for check's timeout. */
static int reap_bounded(struct gmlake_offload *ring, void *p)
{
	struct gmlake_offload_cqe *cqe;
	int res;

	for (int ms = 0; gmlake_offload_peek_cqe(ring, &cqe); ms++) {
		ck_assert_msg(ms < 10000, "no completion in 10 s: the engine "
			      "hangs on a failed copy");
		usleep(1000);
	}
	ck_assert_uint_eq(gmlake_offload_cqe_get_data(cqe), (uintptr_t)p);
	res = cqe->res;
	gmlake_offload_cqe_seen(ring, cqe);
	return res;
}

/*
 * A spill whose copy is in flight when the device goes bad: the completion
 * comes with -EIO, the block is resident with its bytes, its host buffer
 * stays taken (the copy may still write it), and the failure is counted.
 * _i: bit 0 in place, bit 1 a stitched block.
 */
START_TEST(test_sticky_spill)
{
	bool inplace = _i & 1, stitched = _i & 2;
	gmlake_ctx *ctx = sticky_ctx(32 * TH_MiB, 32 * TH_MiB);
	gmlake_stream_t s = th_stream(ctx);
	struct gmlake_stats st0, st;
	struct mover m;
	int queries;

	mover_init(&m, ctx, 6 * TH_MiB - 4096, stitched, 81, s,
		   inplace ? GMLAKE_OFFLOAD_INPLACE : 0);
	th_stats(ctx, &st0);

	/* The spill's copy waits for the block's stream: hold it there
	 * until the engine has polled the copy, so it is in flight. */
	th_hold(ctx, s, true);
	queries = atomic_load(&sticky_queries);
	submit_one(&m.ring, GMLAKE_OFFLOAD_SPILL, m.p);
	for (int ms = 0; atomic_load(&sticky_queries) == queries; ms++) {
		ck_assert_msg(ms < 10000, "the engine never polled the copy");
		usleep(1000);
	}
	ck_assert_int_eq(gmlake_offload_state(ctx, m.p), GMLAKE_BLOCK_SPILLING);
	atomic_store(&sticky_mode, STICKY_NOW);
	ck_assert_int_eq(reap_bounded(&m.ring, m.p), -EIO);
	atomic_store(&sticky_mode, STICKY_OFF);

	ck_assert_int_eq(gmlake_offload_state(ctx, m.p), GMLAKE_BLOCK_RESIDENT);
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.offload_failures, st0.offload_failures + 1);
	ck_assert_uint_eq(st.spills, st0.spills);
	ck_assert_int_eq(st.spilled_blocks.current, 0);
	ck_assert_int_eq(st.spilled_bytes.current, 0);
	ck_assert_int_eq(st.reserved_bytes.current, st0.reserved_bytes.current);
	/* Leaked, not given back: nothing may reuse what the copy writes. */
	ck_assert_int_ge(st.host_bytes.current,
			 st0.host_bytes.current + (int64_t)m.size);

	/* The copy still runs, into the leaked buffer; the block is as it
	 * was, and the machinery still works. */
	th_hold(ctx, s, false);
	th_verify_ok(ctx, m.p, m.size, 81, s);
	mover_cycles(&m, 81, s);
	mover_fini(&m);
}
END_TEST

/*
 * A fetch whose copy is in flight when the device goes bad: the completion
 * comes with -EIO, the block is spilled again with its host copy (never
 * freed: the only good one), its chunks went back, and a later fetch
 * brings the same bytes. _i: bit 0 in place, bit 1 a stitched block.
 */
START_TEST(test_sticky_fetch)
{
	bool inplace = _i & 1, stitched = _i & 2;
	gmlake_ctx *ctx = sticky_ctx(32 * TH_MiB, 32 * TH_MiB);
	struct gmlake_stats st0, st;
	struct mover m;
	int queries;

	mover_init(&m, ctx, 6 * TH_MiB - 4096, stitched, 82, NULL,
		   inplace ? GMLAKE_OFFLOAD_INPLACE : 0);
	ck_assert_int_eq(spill(&m.ring, m.p), 0);
	th_stats(ctx, &st0);

	queries = atomic_load(&sticky_queries);
	atomic_store(&sticky_mode, STICKY_DRAIN);
	submit_one(&m.ring, GMLAKE_OFFLOAD_FETCH, m.p);
	ck_assert_int_eq(reap_bounded(&m.ring, m.p), -EIO);
	atomic_store(&sticky_mode, STICKY_OFF);
	/* It failed in the engine's poll of the copy, not before. */
	ck_assert_int_gt(atomic_load(&sticky_queries), queries);

	ck_assert_int_eq(gmlake_offload_state(ctx, m.p), GMLAKE_BLOCK_SPILLED);
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.offload_failures, st0.offload_failures + 1);
	ck_assert_uint_eq(st.fetches, st0.fetches);
	ck_assert_int_eq(st.spilled_blocks.current, 1);
	ck_assert_int_eq(st.spilled_bytes.current, (int64_t)m.size);
	ck_assert_int_eq(st.host_bytes.current, st0.host_bytes.current);
	ck_assert_int_eq(st.reserved_bytes.current, st0.reserved_bytes.current);
	if (inplace)	/* mapped again at the block, bytes and all */
		ck_assert_uint_eq(th_pattern_diff(m.p, m.size, 82), SIZE_MAX);

	ck_assert_int_eq(fetch(&m.ring, m.p), 0);
	th_check(ctx);
	th_verify_ok(ctx, m.p, m.size, 82, NULL);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.spilled_blocks.current, 0);
	ck_assert_int_eq(st.host_bytes.current, 0);
	mover_fini(&m);
}
END_TEST

/*
 * A fetch whose copy fails while the driver refuses every unmap: its
 * chunks cannot go back, so the block stays spilled holding them
 * (stuck), its host copy the good one; the checker and the counts agree.
 * Then, with the driver well again, a fetch fills those chunks and
 * brings the same bytes, or (bit 2) a free gives the chunks and the host
 * copy back. _i: bit 0 in place, bit 1 a stitched block, bit 2 the free.
 */
START_TEST(test_fetch_stuck)
{
	bool inplace = _i & 1, stitched = _i & 2, free_it = _i & 4;
	gmlake_ctx *ctx = off_ctx(32 * TH_MiB, 32 * TH_MiB, 0);
	struct gml_dev *dev = th_dev(ctx);
	struct gmlake_stats st0, st;
	struct mover m;
	void *again;

	mover_init(&m, ctx, 6 * TH_MiB - 4096, stitched, 83, NULL,
		   inplace ? GMLAKE_OFFLOAD_INPLACE : 0);
	ck_assert_int_eq(spill(&m.ring, m.p), 0);
	th_stats(ctx, &st0);
	/* In place, the fetch first unmaps the host memory at the block. */
	gml_dev_fail_from(dev, GMLAKE_CALL_mem_unmap, inplace ? 2 : 1, EIO);
	gml_dev_fail_nth(dev, GMLAKE_CALL_memcpy, 1, EIO);
	ck_assert_int_lt(fetch(&m.ring, m.p), 0);
	gml_dev_fail_nth(dev, -1, 0, 0);
	th_stats(ctx, &st);
	/* Both detaches of the undo were refused: the chunks stayed. */
	ck_assert_uint_ge(st.call_failures[GMLAKE_CALL_mem_unmap],
			  st0.call_failures[GMLAKE_CALL_mem_unmap] + 2);
	gml_dev_fail_from(dev, -1, 0, 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, m.p), GMLAKE_BLOCK_SPILLED);
	th_check(ctx);
	ck_assert_uint_eq(st.offload_failures, st0.offload_failures + 1);
	ck_assert_int_eq(st.spilled_blocks.current, 1);
	ck_assert_int_eq(st.spilled_bytes.current, (int64_t)m.size);
	ck_assert_int_eq(st.resident_bytes.current,
			 st0.resident_bytes.current);

	if (free_it) {
		th_free(ctx, m.p);
		th_check(ctx);
		th_stats(ctx, &st);
		ck_assert_int_eq(st.spilled_blocks.current, 0);
		ck_assert_int_eq(st.spilled_bytes.current, 0);
		/* The stuck chunks serve the next block like any others. */
		again = th_alloc(ctx, m.size, NULL);
		th_fill_ok(ctx, again, m.size, 84, NULL);
		th_check(ctx);
		m.p = again;
	} else {
		ck_assert_int_eq(fetch(&m.ring, m.p), 0);
		th_check(ctx);
		th_verify_ok(ctx, m.p, m.size, 83, NULL);
		th_stats(ctx, &st);
		ck_assert_int_eq(st.spilled_blocks.current, 0);
		ck_assert_int_eq(st.resident_bytes.current,
				 st0.resident_bytes.current +
				 (int64_t)m.size);
		mover_cycles(&m, 83, NULL);	/* and again */
	}
	mover_fini(&m);
}
END_TEST

/*
 * The poll of a copy fails once but the copy stream drains: the copy ran
 * to its end, so the spill and the fetch complete normally, uncounted.
 */
START_TEST(test_query_fails_stream_drains)
{
	gmlake_ctx *ctx = off_ctx(32 * TH_MiB, 32 * TH_MiB, 0);
	struct gml_dev *dev = th_dev(ctx);
	struct gmlake_offload ring;
	struct gmlake_stats st0, st;
	size_t size = 6 * TH_MiB;
	void *p = th_alloc(ctx, size, NULL);

	th_fill_ok(ctx, p, size, 83, NULL);
	ring_init(&ring, ctx, 4);
	th_stats(ctx, &st0);
	/* Nothing else queries events meanwhile: the engine's poll fails. */
	gml_dev_fail_nth(dev, GMLAKE_CALL_event_query, 1, EIO);
	ck_assert_int_eq(spill(&ring, p), 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, p), GMLAKE_BLOCK_SPILLED);
	gml_dev_fail_nth(dev, GMLAKE_CALL_event_query, 1, EIO);
	ck_assert_int_eq(fetch(&ring, p), 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, p), GMLAKE_BLOCK_RESIDENT);
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.call_failures[GMLAKE_CALL_event_query],
			  st0.call_failures[GMLAKE_CALL_event_query] + 2);
	ck_assert_uint_eq(st.offload_failures, st0.offload_failures);
	ck_assert_uint_eq(st.spills, st0.spills + 1);
	ck_assert_uint_eq(st.fetches, st0.fetches + 1);
	th_verify_ok(ctx, p, size, 83, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/*
 * A wake-up slow to run holds up no copy. The engine's host functions are
 * gated here: none runs until the test opens the gate. Two spills and then
 * two fetches, each pair in one submission, all complete with the gate
 * shut (the engine finds the copies done at its heartbeat), so no copy
 * waited behind a host function; a host function on the copy stream
 * itself would hold the second copy until the gate opened. The wrapper
 * goes in before the engine thread starts and stays, as sticky_ctx's.
 */
static const struct gml_drv_ops *wake_real;
static struct gml_drv_ops wake_ops;
static pthread_mutex_t wake_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake_cond = PTHREAD_COND_INITIALIZER;
static bool wake_open;
static atomic_int wake_queued;

struct wake_gated {
	void (*fn)(void *);
	void *arg;
};

/* Runs on the stream's thread: the real function once the gate opens. */
static void wake_run(void *p)
{
	struct wake_gated g = *(struct wake_gated *)p;

	free(p);
	pthread_mutex_lock(&wake_lock);
	while (!wake_open)
		pthread_cond_wait(&wake_cond, &wake_lock);
	pthread_mutex_unlock(&wake_lock);
	g.fn(g.arg);
}

static int wake_host_func(void *priv, gmlake_stream_t s, void (*fn)(void *),
			  void *arg)
{
	struct wake_gated *g = malloc(sizeof(*g));
	int ret;

	if (!g)
		return gml_set_error(-ENOMEM, "host_func: no memory");
	g->fn = fn;
	g->arg = arg;
	ret = wake_real->host_func(priv, s, wake_run, g);
	if (ret)
		free(g);
	else
		atomic_fetch_add(&wake_queued, 1);
	return ret;
}

static void wake_gate_set(bool open)
{
	pthread_mutex_lock(&wake_lock);
	wake_open = open;
	pthread_cond_broadcast(&wake_cond);
	pthread_mutex_unlock(&wake_lock);
}

/* Submit op on p[0..n) at once, each tagged with its index. */
static void submit_n(struct gmlake_offload *ring, int op, void **p, int n)
{
	for (int i = 0; i < n; i++) {
		struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(ring);

		ck_assert_ptr_nonnull(sqe);
		if (op == GMLAKE_OFFLOAD_SPILL)
			gmlake_offload_prep_spill(sqe, p[i]);
		else
			gmlake_offload_prep_fetch(sqe, p[i]);
		gmlake_offload_sqe_set_data(sqe, (uintptr_t)i);
	}
	ck_assert_int_eq(gmlake_offload_submit(ring), n);
}

/* Submit op on both blocks at once; both complete with 0 within 10 s. */
static void pair_completes(struct gmlake_offload *ring, int op, void **p)
{
	struct gmlake_offload_cqe *cqe;
	int seen = 0;

	submit_n(ring, op, p, 2);
	for (int ms = 0; seen != 3; ms++) {
		if (gmlake_offload_peek_cqe(ring, &cqe)) {
			ck_assert_msg(ms < 10000, "a %s waits for a host "
				      "function", op == GMLAKE_OFFLOAD_SPILL ?
				      "spill" : "fetch");
			usleep(1000);
			continue;
		}
		ck_assert_int_eq(cqe->res, 0);
		seen |= 1 << gmlake_offload_cqe_get_data(cqe);
		gmlake_offload_cqe_seen(ring, cqe);
	}
}

START_TEST(test_wakeups_hold_no_copy)
{
	gmlake_ctx *ctx = off_ctx(32 * TH_MiB, 32 * TH_MiB, 0);
	struct gml_dev *dev = th_dev(ctx);
	struct gmlake_offload ring;
	size_t size = 4 * TH_MiB;
	void *p[2];

	wake_real = dev->ops;
	wake_ops = *dev->ops;
	wake_ops.host_func = wake_host_func;
	dev->ops = &wake_ops;
	wake_gate_set(false);
	atomic_store(&wake_queued, 0);
	for (int i = 0; i < 2; i++)
		p[i] = th_alloc_filled(ctx, size, 90 + i, NULL);
	ring_init(&ring, ctx, 4);

	pair_completes(&ring, GMLAKE_OFFLOAD_SPILL, p);
	for (int i = 0; i < 2; i++)
		ck_assert_int_eq(gmlake_offload_state(ctx, p[i]),
				 GMLAKE_BLOCK_SPILLED);
	pair_completes(&ring, GMLAKE_OFFLOAD_FETCH, p);
	ck_assert_int_ge(atomic_load(&wake_queued), 4);
	wake_gate_set(true);
	th_check(ctx);
	for (int i = 0; i < 2; i++)
		th_verify_free(ctx, p[i], size, 90 + i, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}
END_TEST

/* Submit op on p[0..n) at once; the results, in completion order. */
static void submit_each(struct gmlake_offload *ring, int op, void **p, int n,
			int *res)
{
	submit_n(ring, op, p, n);
	for (int i = 0; i < n; i++)
		res[i] = next_res(ring, ANY_TAG);
}

/*
 * Fetches of adjacent blocks submitted together get their device access
 * in one set-access call, not one a block, and the copy stream is ordered
 * after the other streams' work once for the batch. _i 1: the set-access
 * fails; every fetch of the run fails, its block still spilled with its
 * bytes, and a fetch after it succeeds.
 */
START_TEST(test_fetch_batch_one_access)
{
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 64 * TH_MiB, 0);
	const size_t size = 4 * TH_MiB;
	struct gmlake_offload ring;
	struct gmlake_stats m;
	enum { N = 4 };
	int res[N];
	void *p[N];

	for (int i = 0; i < N; i++)
		p[i] = th_alloc_filled(ctx, size, 110 + i, NULL);
	for (int i = 1; i < N; i++)	/* the premise: one range */
		ck_assert_ptr_eq(p[i], (char *)p[i - 1] + size);
	ring_init(&ring, ctx, 8);
	submit_each(&ring, GMLAKE_OFFLOAD_SPILL, p, N, res);
	for (int i = 0; i < N; i++)
		ck_assert_int_eq(res[i], 0);
	th_stats(ctx, &m);
	if (_i == 1)
		gml_dev_fail_nth(th_dev(ctx), GMLAKE_CALL_set_access, 1, EIO);
	submit_each(&ring, GMLAKE_OFFLOAD_FETCH, p, N, res);
	gml_dev_fail_nth(th_dev(ctx), -1, 0, 0);
	ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_set_access), 1);
	/* One ordering for the batch (one stream has work), and one done
	 * event a copy (none when the grant failed). */
	ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_event_record),
			  _i == 1 ? 1 : N + 1);
	for (int i = 0; i < N; i++) {
		if (_i == 1) {
			ck_assert_int_eq(res[i], -EIO);
			ck_assert_int_eq(gmlake_offload_state(ctx, p[i]),
					 GMLAKE_BLOCK_SPILLED);
		} else {
			ck_assert_int_eq(res[i], 0);
		}
	}
	th_check(ctx);
	if (_i == 1) {
		submit_each(&ring, GMLAKE_OFFLOAD_FETCH, p, N, res);
		for (int i = 0; i < N; i++)
			ck_assert_int_eq(res[i], 0);
	}
	for (int i = 0; i < N; i++)
		th_verify_free(ctx, p[i], size, 110 + i, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}
END_TEST

/*
 * The application allocates while the engine is stuck in a driver call
 * that can take a millisecond (issuing a copy into a full copy stream's
 * queue, a fetch's set-access while copies run both ways): the allocation
 * does not wait for it, since the engine makes those calls with the
 * context lock let go. The wrapper holds, while armed, the calls of one
 * kind: _i 0 a spill's copy, 1 a fetch's set-access, 2 a fetch's copy.
 */
enum { HOLD_SPILL_COPY, HOLD_FETCH_ACCESS, HOLD_FETCH_COPY };

static const struct gml_drv_ops *issue_real;
static struct gml_drv_ops issue_ops;
static atomic_int issue_armed = -1, issue_held, issue_go;

/* Hold this call while the test armed what, on the engine's thread only
 * (the side allocation may call set-access too). */
static void issue_hold(int what)
{
	char name[16] = "";

	if (atomic_load(&issue_armed) != what ||
	    pthread_getname_np(pthread_self(), name, sizeof(name)) ||
	    strcmp(name, "gmlake-offload"))
		return;
	atomic_fetch_add(&issue_held, 1);
	while (!atomic_load(&issue_go))
		usleep(1000);
}

static int issue_memcpy(void *priv, void *dst, const void *src, size_t size,
			enum gml_copy_kind kind, gmlake_stream_t s)
{
	if (kind == GML_COPY_DTOH)
		issue_hold(HOLD_SPILL_COPY);
	else if (kind == GML_COPY_HTOD)
		issue_hold(HOLD_FETCH_COPY);
	return issue_real->memcpy_async(priv, dst, src, size, kind, s);
}

static int issue_set_access(void *priv, gml_va va, size_t size,
			    const int *peers, int npeers)
{
	issue_hold(HOLD_FETCH_ACCESS);
	return issue_real->set_access(priv, va, size, peers, npeers);
}

struct side_alloc {
	gmlake_ctx *ctx;
	atomic_int done;
	int ret;
};

static void *side_alloc_main(void *arg)
{
	struct side_alloc *a = arg;
	void *q = NULL;

	a->ret = gmlake_alloc(a->ctx, &q, 2 * TH_MiB, NULL);
	if (!a->ret)
		a->ret = gmlake_free(a->ctx, q);
	atomic_store(&a->done, 1);
	return NULL;
}

START_TEST(test_engine_holds_no_alloc)
{
	gmlake_ctx *ctx = off_ctx(32 * TH_MiB, 32 * TH_MiB, 0);
	struct gml_dev *dev = th_dev(ctx);
	struct side_alloc a = { .ctx = ctx };
	int op = _i == HOLD_SPILL_COPY ? GMLAKE_OFFLOAD_SPILL :
					 GMLAKE_OFFLOAD_FETCH;
	struct gmlake_offload ring;
	size_t size = 6 * TH_MiB;
	bool alloc_waited = true;
	pthread_t t;
	void *p;

	issue_real = dev->ops;
	issue_ops = *dev->ops;
	issue_ops.memcpy_async = issue_memcpy;
	issue_ops.set_access = issue_set_access;
	dev->ops = &issue_ops;
	atomic_store(&issue_armed, -1);
	atomic_store(&issue_held, 0);
	atomic_store(&issue_go, 0);
	p = th_alloc_filled(ctx, size, 95, NULL);
	ring_init(&ring, ctx, 4);
	if (op == GMLAKE_OFFLOAD_FETCH)
		ck_assert_int_eq(spill(&ring, p), 0);

	atomic_store(&issue_armed, _i);
	submit_one(&ring, op, p);
	for (int ms = 0; !atomic_load(&issue_held); ms++) {
		ck_assert_msg(ms < 10000, "the engine never made the call");
		usleep(1000);
	}
	ck_assert_int_eq(pthread_create(&t, NULL, side_alloc_main, &a), 0);
	for (int ms = 0; ms < 5000 && alloc_waited; ms++) {
		alloc_waited = !atomic_load(&a.done);
		if (alloc_waited)
			usleep(1000);
	}
	atomic_store(&issue_armed, -1);
	atomic_store(&issue_go, 1);
	pthread_join(t, NULL);
	ck_assert_msg(!alloc_waited, "an allocation waited for the engine's "
		      "call (case %d)", _i);
	ck_assert_int_eq(a.ret, 0);
	ck_assert_int_eq(reap_bounded(&ring, p), 0);
	if (op == GMLAKE_OFFLOAD_SPILL) {
		ck_assert_int_eq(gmlake_offload_state(ctx, p),
				 GMLAKE_BLOCK_SPILLED);
		ck_assert_int_eq(fetch(&ring, p), 0);
	}
	ck_assert_int_eq(gmlake_offload_state(ctx, p), GMLAKE_BLOCK_RESIDENT);
	th_check(ctx);
	th_verify_free(ctx, p, size, 95, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}
END_TEST

/* The arena cannot grow (pinning fails): a clean -errno, block intact. */
START_TEST(test_pin_failure)
{
	gmlake_ctx *ctx = off_ctx(32 * TH_MiB, 8 * TH_MiB, 0);
	struct gmlake_offload ring;
	void *p = th_alloc(ctx, 4 * TH_MiB, NULL);
	int res;

	th_fill_ok(ctx, p, 4 * TH_MiB, 41, NULL);
	gate_install(ctx);
	/* Set-up pins the first region: make it fail. The engine then pins
	 * a step ahead (too small for p): only once it has, fail the growth
	 * the spill needs, or the pinning ahead could take the fault. */
	gml_dev_fail_nth(th_dev(ctx), GMLAKE_CALL_host_register, 1, EIO);
	ring_init(&ring, ctx, 2);
	for (int ms = 0; atomic_load(&gate_calls) < 1; ms++) {
		ck_assert_msg(ms < 10000, "the engine never pinned ahead");
		usleep(1000);
	}
	gml_dev_fail_nth(th_dev(ctx), GMLAKE_CALL_host_register, 1, EIO);
	res = spill(&ring, p);
	ck_assert_int_lt(res, 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, p), GMLAKE_BLOCK_RESIDENT);
	th_check(ctx);
	ck_assert_int_eq(spill(&ring, p), 0);	/* pins now */
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_verify_ok(ctx, p, 4 * TH_MiB, 41, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Automatic offload                                                      */

/* Passing the device limit spills the least recently used first. */
START_TEST(test_auto_device_limit)
{
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 64 * TH_MiB, 24 * TH_MiB);
	struct gmlake_offload ring;
	struct gmlake_stats st;
	void *a = th_alloc(ctx, 8 * TH_MiB, NULL);
	void *b = th_alloc(ctx, 8 * TH_MiB, NULL);
	void *c;

	th_fill_ok(ctx, a, 8 * TH_MiB, 51, NULL);
	th_fill_ok(ctx, b, 8 * TH_MiB, 52, NULL);
	TH_OK(ctx, gmlake_advise(ctx, a, GMLAKE_ADVISE_OFFLOADABLE));
	TH_OK(ctx, gmlake_advise(ctx, b, GMLAKE_ADVISE_OFFLOADABLE));
	c = th_alloc(ctx, 12 * TH_MiB, NULL);
	th_stats(ctx, &st);
	ck_assert_uint_ge(st.auto_spills, 1);
	ck_assert_int_le(st.reserved_bytes.current, (int64_t)(24 * TH_MiB));
	ck_assert_int_eq(gmlake_offload_state(ctx, a), GMLAKE_BLOCK_SPILLED);
	ck_assert_int_eq(gmlake_offload_state(ctx, b), GMLAKE_BLOCK_RESIDENT);
	th_fill_ok(ctx, c, 12 * TH_MiB, 53, NULL);
	th_verify_ok(ctx, b, 8 * TH_MiB, 52, NULL);
	/* Fetch on demand: b goes out to make room for a. */
	ring_init(&ring, ctx, 2);
	ck_assert_int_eq(fetch(&ring, a), 0);
	th_check(ctx);
	ck_assert_int_eq(gmlake_offload_state(ctx, b), GMLAKE_BLOCK_SPILLED);
	th_verify_ok(ctx, a, 8 * TH_MiB, 51, NULL);
	th_verify_ok(ctx, c, 12 * TH_MiB, 53, NULL);
	/* Not offloadable: stays. */
	TH_OK(ctx, gmlake_advise(ctx, a, GMLAKE_ADVISE_NOT_OFFLOADABLE));
	TH_OK(ctx, gmlake_advise(ctx, b, GMLAKE_ADVISE_NOT_OFFLOADABLE));
	th_free(ctx, c);
	ck_assert_int_eq(fetch(&ring, b), 0);
	th_verify_ok(ctx, b, 8 * TH_MiB, 52, NULL);
	c = NULL;
	ck_assert_int_eq(gmlake_alloc(ctx, &c, 12 * TH_MiB, NULL), -ENOMEM);
	ck_assert_int_eq(gmlake_offload_state(ctx, a), GMLAKE_BLOCK_RESIDENT);
	th_check(ctx);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, a);
	th_free(ctx, b);
	th_destroy(ctx);
}
END_TEST

/*
 * A block that cycles (its second fetch and on) comes back into one span:
 * one map and one set-access per fetch, one unmap per spill, and after the
 * first no handle made; its bytes intact each time. A freed span block
 * leaves holes and its span serves the next block of its size; a small
 * block keeps its chunks; a live span block goes at destroy.
 */
START_TEST(test_span_cycle)
{
	size_t chunk;
	gmlake_ctx *ctx = span_ctx(128, 128, &chunk);
	const size_t n = 32, size = n * chunk;
	struct gmlake_offload ring;
	struct gmlake_stats m;
	void *p, *q, *s;

	ring_init(&ring, ctx, 8);
	p = th_alloc_filled(ctx, size, 71, NULL);
	ck_assert_int_eq(spill(&ring, p), 0);
	th_stats(ctx, &m);
	ck_assert_int_eq(fetch(&ring, p), 0);		/* first: chunks */
	ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_map), n);
	th_verify_ok(ctx, p, size, 71, NULL);
	for (uint64_t round = 0, seed = 71; round < 3; round++) {
		ck_assert_int_eq(spill(&ring, p), 0);
		th_check(ctx);
		th_stats(ctx, &m);
		ck_assert_int_eq(fetch(&ring, p), 0);
		ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_map), 1);
		ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_set_access),
				  1);
		ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_create),
				  round == 0 ? 1 : 0);
		th_check(ctx);
		th_verify_ok(ctx, p, size, seed, NULL);
		seed = 72 + round;
		th_fill_ok(ctx, p, size, seed, NULL);
	}
	th_stats(ctx, &m);
	ck_assert_int_eq(spill(&ring, p), 0);
	ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_unmap), 1);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_verify_ok(ctx, p, size, 74, NULL);
	/* Freed: the run becomes holes, the span a spare. */
	th_free(ctx, p);
	th_check(ctx);
	/* The next block of that size takes it at its second fetch. */
	q = th_alloc_filled(ctx, size, 81, NULL);
	ck_assert_int_eq(spill(&ring, q), 0);
	ck_assert_int_eq(fetch(&ring, q), 0);
	ck_assert_int_eq(spill(&ring, q), 0);
	th_stats(ctx, &m);
	ck_assert_int_eq(fetch(&ring, q), 0);
	ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_create), 0);
	ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_map), 1);
	th_verify_ok(ctx, q, size, 81, NULL);
	/* Below GML_SPAN_MIN chunks: chunks, each fetch. */
	s = th_alloc_filled(ctx, 4 * chunk, 91, NULL);
	for (int round = 0; round < 2; round++) {
		ck_assert_int_eq(spill(&ring, s), 0);
		th_stats(ctx, &m);
		ck_assert_int_eq(fetch(&ring, s), 0);
		ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_map), 4);
	}
	th_verify_ok(ctx, s, 4 * chunk, 91, NULL);
	th_free(ctx, s);
	/* The spare span and the chunk cache give way to a request that
	 * needs their room. */
	ck_assert_int_eq(spill(&ring, q), 0);
	p = th_alloc_filled(ctx, 120 * chunk, 95, NULL);
	th_verify_ok(ctx, p, 120 * chunk, 95, NULL);
	th_free(ctx, p);
	ck_assert_int_eq(fetch(&ring, q), 0);
	th_verify_ok(ctx, q, size, 81, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_check(ctx);
	/* q lives on, in its span: a forced destroy frees it with the rest
	 * (no leak under ASan, no driver refusal logged). */
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
}
END_TEST

/*
 * A stitched block cycles into a span too: its range stays the stitched
 * view's, the span fills its holes, and a free (which waits for the
 * block's work) leaves holes that take the view out of the cache.
 */
/*
 * A block that cycles is fetched into a span even when the device's free
 * memory sits in the chunk cache: the fetch gives back as many cached
 * free chunks as it needs, then makes the span (one map), where it would
 * otherwise move those chunks into the block's run (one map each). With
 * call >= 0, the nth call of that kind fails in that fetch: it completes
 * or fails cleanly, the block keeping its bytes, and the next works.
 */
static void cached_span_round(int call, uint64_t nth)
{
	size_t chunk;
	gmlake_ctx *ctx = span_ctx(64, 128, &chunk);	/* the device: 64 */
	const size_t n = 32, size = n * chunk;
	struct gmlake_offload ring;
	struct gmlake_stats m, s1;
	void *p, *x, *y;
	int res;

	ring_init(&ring, ctx, 8);
	p = th_alloc_filled(ctx, size, 61, NULL);
	ck_assert_int_eq(spill(&ring, p), 0);
	ck_assert_int_eq(fetch(&ring, p), 0);		/* first: chunks */
	ck_assert_int_eq(spill(&ring, p), 0);
	/* All of the device taken, then given back to the cache. */
	x = th_alloc_filled(ctx, 2 * size, 62, NULL);
	th_free(ctx, x);
	th_check(ctx);
	th_stats(ctx, &m);
	ck_assert_uint_eq(m.chunks.current, 2 * n);
	if (call >= 0) {
		gml_dev_fail_nth(th_dev(ctx), call, nth,
				 call == GMLAKE_CALL_mem_create ? ENOMEM : EIO);
		res = fetch(&ring, p);
		ck_assert_msg(res == 0 || res < 0, "fetch: %d", res);
		gml_dev_fail_nth(th_dev(ctx), -1, 0, 0);
		th_check(ctx);
		if (res)
			ck_assert_int_eq(fetch(&ring, p), 0);
		th_verify_ok(ctx, p, size, 61, NULL);
		goto out;
	}
	ck_assert_int_eq(fetch(&ring, p), 0);
	ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_map), 1);
	/* The device refused the first try; the span came after the
	 * release. */
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_create] -
			  m.calls[GMLAKE_CALL_mem_create] -
			  (s1.call_failures[GMLAKE_CALL_mem_create] -
			   m.call_failures[GMLAKE_CALL_mem_create]), 1);
	ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_release), n);
	th_check(ctx);
	th_verify_ok(ctx, p, size, 61, NULL);
	th_stats(ctx, &m);
	ck_assert_uint_eq(m.chunks.current, 2 * n);
	/* The cached chunks left still serve, with no driver call. */
	y = th_alloc_filled(ctx, size, 63, NULL);
	ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_create), 0);
	th_verify_ok(ctx, y, size, 63, NULL);
	th_free(ctx, y);
out:
	/* And the block cycles on. */
	ck_assert_int_eq(spill(&ring, p), 0);
	ck_assert_int_eq(fetch(&ring, p), 0);
	th_check(ctx);
	th_verify_ok(ctx, p, size, 61, NULL);
	th_free(ctx, p);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}

START_TEST(test_span_from_cached_chunks)
{
	cached_span_round(-1, 0);
}
END_TEST

START_TEST(test_faults_span_from_cached_chunks)
{
	static const int calls[] = {
		GMLAKE_CALL_mem_release, GMLAKE_CALL_mem_create,
		GMLAKE_CALL_mem_unmap, GMLAKE_CALL_mem_map,
		GMLAKE_CALL_set_access,
	};

	for (uint64_t nth = 1; nth <= 3; nth++)
		cached_span_round(calls[_i], nth);
}
END_TEST

START_TEST(test_span_stitched)
{
	size_t u;	/* the chunk size */
	gmlake_ctx *ctx = span_ctx(128, 128, &u);
	const size_t sizes[4] = { 16 * u, 16 * u, 16 * u, 16 * u };
	struct gmlake_offload ring;
	struct gmlake_stats st, m;
	void *blk[4], *b, *d, *s;

	th_two_holes(ctx, sizes, blk);
	b = blk[1], d = blk[3];
	/* Room for a new handle of s's size stays: a span is made only
	 * where the device has the room (else the fetch takes cached
	 * chunks). */
	s = th_alloc(ctx, 32 * u, NULL);		/* a's and c's chunks */
	th_stats(ctx, &st);
	ck_assert_int_eq(st.stitched_live.current, 1);
	th_fill_ok(ctx, s, 32 * u, 7, NULL);
	ring_init(&ring, ctx, 4);
	ck_assert_int_eq(spill(&ring, s), 0);
	ck_assert_int_eq(fetch(&ring, s), 0);		/* chunks */
	for (int round = 0; round < 2; round++) {
		ck_assert_int_eq(spill(&ring, s), 0);
		th_check(ctx);
		th_stats(ctx, &m);
		ck_assert_int_eq(fetch(&ring, s), 0);	/* a span */
		ck_assert_uint_eq(calls_since(ctx, &m, GMLAKE_CALL_mem_map), 1);
		th_check(ctx);
		th_verify_ok(ctx, s, 32 * u, 7, NULL);
	}
	th_verify_ok(ctx, b, 16 * u, 2, NULL);
	th_verify_ok(ctx, d, 16 * u, 4, NULL);
	th_free(ctx, s);
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.stitched_live.current, 0);
	ck_assert_int_eq(st.stitched_cached.current, 0);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, b);
	th_free(ctx, d);
	TH_OK(ctx, gmlake_trim(ctx));
	th_stats(ctx, &st);
	ck_assert_int_eq(st.reserved_bytes.current, 0);
	th_destroy(ctx);
}
END_TEST

/* An allocation that would fail on a full device spills instead. */
START_TEST(test_auto_oom)
{
	gmlake_ctx *ctx = off_ctx(24 * TH_MiB, 64 * TH_MiB, 0);
	struct gmlake_stats st;
	void *a = th_alloc(ctx, 10 * TH_MiB, NULL);
	void *b = th_alloc(ctx, 10 * TH_MiB, NULL);
	void *c;

	th_fill_ok(ctx, a, 10 * TH_MiB, 61, NULL);
	th_fill_ok(ctx, b, 10 * TH_MiB, 62, NULL);
	TH_OK(ctx, gmlake_advise(ctx, a, GMLAKE_ADVISE_OFFLOADABLE));
	TH_OK(ctx, gmlake_advise(ctx, b, GMLAKE_ADVISE_OFFLOADABLE));
	TH_OK(ctx, gmlake_advise(ctx, a, GMLAKE_ADVISE_OFFLOADABLE)); /* a: newest */
	c = th_alloc(ctx, 8 * TH_MiB, NULL);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.auto_spills, 1);
	ck_assert_int_eq(gmlake_offload_state(ctx, b), GMLAKE_BLOCK_SPILLED);
	th_fill_ok(ctx, c, 8 * TH_MiB, 63, NULL);
	th_verify_ok(ctx, a, 10 * TH_MiB, 61, NULL);
	th_free(ctx, c);
	th_free(ctx, a);
	th_free(ctx, b);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.host_bytes.current, 0);
	th_destroy(ctx);
}
END_TEST

/* Let a held stream go after a while, from another thread. */
struct later_release {
	gmlake_ctx *ctx;
	gmlake_stream_t s;
};

static void *release_later(void *arg)
{
	struct later_release *r = arg;
	struct timespec ts = { 0, 100 * 1000 * 1000 };

	nanosleep(&ts, NULL);
	th_hold(r->ctx, r->s, false);
	return NULL;
}

/*
 * A block freed while another stream's work on it is pending is no longer
 * the caller's: it leaves the offload LRU at its free, and the allocation
 * path's first rung, which waits for every stream, releases it, so a
 * request that needs its memory spills nothing. Before, it stayed on the
 * LRU until its release, and the allocation path spilled it: a copy of
 * dead bytes, counted off the device twice (found by fuzz_api).
 */
START_TEST(test_auto_skips_freed)
{
	gmlake_ctx *ctx = off_ctx(24 * TH_MiB, 64 * TH_MiB, 0);
	gmlake_stream_t other = th_stream(ctx);
	struct later_release rel = { ctx, other };
	struct gmlake_stats st;
	void *a = th_alloc(ctx, 8 * TH_MiB, NULL);
	void *b = th_alloc(ctx, 10 * TH_MiB, NULL);
	pthread_t t;
	void *c;

	th_fill_ok(ctx, a, 8 * TH_MiB, 71, NULL);
	TH_OK(ctx, gmlake_advise(ctx, b, GMLAKE_ADVISE_OFFLOADABLE));
	TH_OK(ctx, gmlake_advise(ctx, a, GMLAKE_ADVISE_OFFLOADABLE));
	/* b is the least recently used; its free waits for other. */
	TH_OK(ctx, gmlake_record_stream(ctx, b, other));
	th_hold(ctx, other, true);
	th_free(ctx, b);		/* checks: b on no LRU */
	ck_assert_int_eq(pthread_create(&t, NULL, release_later, &rel), 0);
	c = th_alloc(ctx, 8 * TH_MiB, NULL);
	ck_assert_int_eq(pthread_join(t, NULL), 0);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.auto_spills, 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, a), GMLAKE_BLOCK_RESIDENT);
	ck_assert_int_eq(st.resident_bytes.current, 16 * TH_MiB);
	th_fill_ok(ctx, c, 8 * TH_MiB, 73, NULL);
	th_verify_ok(ctx, a, 8 * TH_MiB, 71, NULL);
	th_free(ctx, a);
	th_free(ctx, c);
	TH_OK(ctx, gmlake_stream_destroy(ctx, other));
	th_destroy(ctx);
}
END_TEST

/*
 * The allocation path's own spill (the tier's reclaim hook) on a device
 * gone bad: the allocation fails, the block stays resident with its bytes,
 * and the host buffer its copy may still write stays taken.
 */
START_TEST(test_sticky_auto)
{
	gmlake_ctx *ctx = sticky_ctx(24 * TH_MiB, 64 * TH_MiB);
	struct gmlake_offload ring;
	struct gmlake_stats st0, st;
	void *a = th_alloc(ctx, 10 * TH_MiB, NULL);
	void *b = th_alloc(ctx, 10 * TH_MiB, NULL);
	void *c = NULL;
	int ret;

	th_fill_ok(ctx, a, 10 * TH_MiB, 84, NULL);
	th_fill_ok(ctx, b, 10 * TH_MiB, 85, NULL);
	TH_OK(ctx, gmlake_advise(ctx, b, GMLAKE_ADVISE_OFFLOADABLE));
	th_stats(ctx, &st0);
	atomic_store(&sticky_mode, STICKY_NOW);
	ck_assert_int_lt(gmlake_alloc(ctx, &c, 8 * TH_MiB, NULL), 0);
	atomic_store(&sticky_mode, STICKY_OFF);
	ck_assert_int_eq(gmlake_offload_state(ctx, b), GMLAKE_BLOCK_RESIDENT);
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.auto_spills, st0.auto_spills);
	ck_assert_uint_eq(st.offload_failures, st0.offload_failures + 1);
	ck_assert_int_ge(st.host_bytes.current,
			 st0.host_bytes.current + (int64_t)(10 * TH_MiB));
	th_verify_ok(ctx, a, 10 * TH_MiB, 84, NULL);
	th_verify_ok(ctx, b, 10 * TH_MiB, 85, NULL);
	/*
	 * Healthy again: an allocation spills b. The leaked buffer took
	 * room in the arena, and the allocation path spills only into free
	 * pinned memory: it may fail until the engine, woken by it, has
	 * pinned more.
	 */
	for (int ms = 0; (ret = gmlake_alloc(ctx, &c, 8 * TH_MiB, NULL)) ==
	     -ENOMEM; ms++) {
		ck_assert_msg(ms < 10000, "the arena never grew: %s",
			      gmlake_last_error());
		usleep(1000);
	}
	ck_assert_int_eq(ret, 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, b), GMLAKE_BLOCK_SPILLED);
	th_free(ctx, c);
	ring_init(&ring, ctx, 2);
	ck_assert_int_eq(fetch(&ring, b), 0);
	th_verify_ok(ctx, b, 10 * TH_MiB, 85, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, a);
	th_free(ctx, b);
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* A request is bound to a block, not to an address                      */

/* A context whose engine pins one 64 MiB region at start (more than a
 * growth step of its 128 MiB budget); the gate not armed yet. */
static gmlake_ctx *gate_ctx(void)
{
	struct gmlake_config cfg;
	gmlake_ctx *ctx;

	th_config(&cfg, 192 * TH_MiB);
	cfg.host_limit = 128 * TH_MiB;
	cfg.host_pin = 64 * TH_MiB;
	ctx = th_ctx_cfg(&cfg);
	gate_install(ctx);
	return ctx;
}

/* The engine holds at its next host_register: wait until it does. */
static void gate_hold(void)
{
	atomic_store(&gate_at, atomic_load(&gate_calls) + 1);
}

static void gate_wait_held(void)
{
	for (int ms = 0; !atomic_load(&gate_held); ms++) {
		ck_assert_msg(ms < 10000, "the engine never reached the gate");
		usleep(1000);
	}
}

/* Reap n completions, each of a tag below n; their res by tag. */
static void reap_tags(struct gmlake_offload *ring, int n, int *res)
{
	struct gmlake_offload_cqe *cqe;

	for (int i = 0; i < n; i++) {
		for (int ms = 0; gmlake_offload_peek_cqe(ring, &cqe); ms++) {
			ck_assert_msg(ms < 10000, "no completion in 10 s");
			usleep(1000);
		}
		ck_assert_uint_lt(gmlake_offload_cqe_get_data(cqe), n);
		res[gmlake_offload_cqe_get_data(cqe)] = cqe->res;
		gmlake_offload_cqe_seen(ring, cqe);
	}
}

/*
 * A spill (_i 0) or a fetch (_i 1) of p waits in the queue behind the
 * spill of r, which holds the engine while it pins a region for r (a
 * first spill, of p or of f, left too little of the first one); then
 * gmlake_free(p) must refuse with -EBUSY. Were it to succeed, the next
 * allocation would get p's address and the queued request would move that
 * new, unrelated block (a spill unmaps it under its owner's feet). Once
 * the requests completed, the free works, and the block allocated next at
 * the address is left alone.
 */
START_TEST(test_free_with_request_queued)
{
	bool fetch_queued = _i == 1;
	size_t size = 28 * TH_MiB;
	gmlake_ctx *ctx = gate_ctx();
	struct gmlake_offload_sqe *sqe;
	struct gmlake_offload ring;
	void *f, *p, *q, *r;
	int ret, res[2], where;

	p = th_alloc_filled(ctx, size, 91, NULL);
	f = th_alloc_filled(ctx, size, 94, NULL);
	r = th_alloc_filled(ctx, 40 * TH_MiB, 93, NULL);
	ring_init(&ring, ctx, 4);
	/* After the set-up's pinning: r does not fit in what the first spill
	 * leaves of the first region. */
	ck_assert_int_eq(spill(&ring, fetch_queued ? p : f), 0);
	gate_hold();
	sqe = gmlake_offload_get_sqe(&ring);
	gmlake_offload_prep_spill(sqe, r);
	gmlake_offload_sqe_set_data(sqe, 0);
	sqe = gmlake_offload_get_sqe(&ring);
	if (fetch_queued)
		gmlake_offload_prep_fetch(sqe, p);
	else
		gmlake_offload_prep_spill(sqe, p);
	gmlake_offload_sqe_set_data(sqe, 1);
	ck_assert_int_eq(gmlake_offload_submit(&ring), 2);
	gate_wait_held();

	ret = gmlake_free(ctx, p);
	if (ret == 0) {
		q = th_alloc_filled(ctx, size, 92, NULL);
		atomic_store(&gate_open, 1);
		reap_tags(&ring, 2, res);
		where = gmlake_offload_state(ctx, q);
		ck_assert_msg(0, "gmlake_free(p) with a %s queued returned 0; "
			      "the next block, at %p (p was %p), is then in "
			      "state %d (the %s completed with %d)",
			      fetch_queued ? "fetch" : "spill", q, p, where,
			      fetch_queued ? "fetch" : "spill", res[1]);
	}
	ck_assert_int_eq(ret, -EBUSY);
	ck_assert_str_ne(gmlake_last_error(), "");
	th_check(ctx);
	atomic_store(&gate_open, 1);
	reap_tags(&ring, 2, res);
	ck_assert_int_eq(res[0], 0);
	ck_assert_int_eq(res[1], 0);
	ck_assert_int_eq(gmlake_offload_state(ctx, p), fetch_queued ?
			 GMLAKE_BLOCK_RESIDENT : GMLAKE_BLOCK_SPILLED);
	if (fetch_queued)
		th_verify_ok(ctx, p, size, 91, NULL);
	TH_OK(ctx, gmlake_free(ctx, p));

	/* Nothing bound to p is left to act on what comes next. */
	q = th_alloc_filled(ctx, size, 92, NULL);
	usleep(20000);
	ck_assert_int_eq(gmlake_offload_state(ctx, q), GMLAKE_BLOCK_RESIDENT);
	th_verify_ok(ctx, q, size, 92, NULL);
	th_check(ctx);
	ck_assert_int_eq(fetch(&ring, r), 0);
	th_verify_ok(ctx, r, 40 * TH_MiB, 93, NULL);
	if (!fetch_queued) {
		ck_assert_int_eq(fetch(&ring, f), 0);
		th_verify_ok(ctx, f, size, 94, NULL);
	}
	th_free(ctx, q);
	th_free(ctx, r);
	th_free(ctx, f);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Stress: random spill, fetch, alloc and free under memory pressure      */

enum blk_state { B_FREE, B_RES, B_OUT, B_MOVING };

struct blk {
	void *p;
	size_t size;
	uint64_t seed;
	enum blk_state st;
	int op;
};

/* Bring a block home if it was spilled (by us or automatically). */
static int settle(gmlake_ctx *ctx, struct gmlake_offload *ring,
		  struct blk *b)
{
	int where = gmlake_offload_state(ctx, b->p);

	if (where == GMLAKE_BLOCK_RESIDENT)
		return 0;
	ck_assert_int_eq(where, GMLAKE_BLOCK_SPILLED);
	return fetch(ring, b->p);
}

static void reap_one(gmlake_ctx *ctx, struct gmlake_offload *ring,
		     struct blk *blks, bool wait, unsigned *inflight)
{
	struct gmlake_offload_cqe *cqe;
	struct blk *b;
	int ret;

	ret = wait ? gmlake_offload_wait_cqe(ring, &cqe) :
		     gmlake_offload_peek_cqe(ring, &cqe);
	if (ret == -EAGAIN)
		return;
	ck_assert_int_eq(ret, 0);
	b = &blks[gmlake_offload_cqe_get_data(cqe)];
	ck_assert_int_eq(b->st, B_MOVING);
	ck_assert_msg(cqe->res == 0 || cqe->res == -ENOMEM ||
		      cqe->res == -EBUSY || (cqe->res == -EOPNOTSUPP &&
					      b->size < TH_MiB),
		      "op %d: %d", b->op, cqe->res);
	b->st = B_RES;
	gmlake_offload_cqe_seen(ring, cqe);
	(*inflight)--;
	(void)ctx;
}

/* Submit what is prepared and reap everything in flight. */
static void drain(gmlake_ctx *ctx, struct gmlake_offload *ring,
		  struct blk *blks, unsigned *inflight)
{
	while (gmlake_offload_submit(ring) > 0)
		;
	while (*inflight)
		reap_one(ctx, ring, blks, true, inflight);
}

START_TEST(test_stress)
{
	enum { NB = 24, OPS = 3000 };
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 40 * TH_MiB, 0);
	struct gmlake_offload ring;
	struct th_rng rng = { 0x5eed + (uint64_t)_i };
	struct blk blks[NB];
	struct gmlake_stats st;
	unsigned inflight = 0;
	uint64_t seed = 1000;

	memset(blks, 0, sizeof(blks));
	ring_init(&ring, ctx, 32);
	for (int op = 0; op < OPS; op++) {
		struct blk *b = &blks[th_range(&rng, 0, NB - 1)];
		struct gmlake_offload_sqe *sqe;
		int dice = (int)th_range(&rng, 0, 99);

		if (b->st == B_MOVING) {
			/* Wait rather than peek: how many operations run must
			 * not depend on how fast the engine is. */
			drain(ctx, &ring, blks, &inflight);
			continue;
		}
		if (b->st == B_FREE) {
			b->size = th_range(&rng, 0, 9) ? th_range(&rng, 1, 12) *
				  TH_MiB - th_range(&rng, 0, 3) * 4096 :
				  th_range(&rng, 1, 64) * 1024;
			b->p = NULL;
			if (gmlake_alloc(ctx, &b->p, b->size, NULL))
				continue;	/* full: fine */
			b->seed = seed++;
			ck_assert_int_eq(th_fill(ctx, b->p, b->size, b->seed,
						 NULL), 0);
			b->st = B_RES;
			if (th_range(&rng, 0, 2) == 0 && b->size >= TH_MiB)
				TH_OK(ctx, gmlake_advise(ctx, b->p,
					GMLAKE_ADVISE_OFFLOADABLE));
			continue;
		}
		if (dice < 25)
			drain(ctx, &ring, blks, &inflight);
		if (dice < 15) {
			/* verify and free */
			ck_assert_int_eq(settle(ctx, &ring, b) == 0 ||
					 gmlake_offload_state(ctx, b->p) ==
					 GMLAKE_BLOCK_SPILLED, 1);
			if (gmlake_offload_state(ctx, b->p) ==
			    GMLAKE_BLOCK_RESIDENT)
				th_verify_ok(ctx, b->p, b->size, b->seed, NULL);
			th_free(ctx, b->p);
			b->st = B_FREE;
			continue;
		}
		if (dice < 25) {
			if (settle(ctx, &ring, b) == 0)
				th_verify_ok(ctx, b->p, b->size, b->seed, NULL);
			continue;
		}
		if (inflight >= 32) {
			reap_one(ctx, &ring, blks, true, &inflight);
			continue;
		}
		sqe = gmlake_offload_get_sqe(&ring);
		if (!sqe) {
			ck_assert_int_gt(gmlake_offload_submit(&ring), 0);
			continue;
		}
		b->op = dice < 60 ? GMLAKE_OFFLOAD_SPILL : dice < 90 ?
			GMLAKE_OFFLOAD_FETCH : GMLAKE_OFFLOAD_PREFETCH;
		if (b->op == GMLAKE_OFFLOAD_SPILL)
			gmlake_offload_prep_spill(sqe, b->p);
		else if (b->op == GMLAKE_OFFLOAD_FETCH)
			gmlake_offload_prep_fetch(sqe, b->p);
		else
			gmlake_offload_prep_prefetch(sqe, b->p);
		gmlake_offload_sqe_set_data(sqe, (uint64_t)(b - blks));
		b->st = B_MOVING;
		inflight++;
		if (th_range(&rng, 0, 3) == 0)
			ck_assert_int_ge(gmlake_offload_submit(&ring), 1);
		if (op % 64 == 0)
			th_check(ctx);
	}
	drain(ctx, &ring, blks, &inflight);
	th_check(ctx);
	th_stats(ctx, &st);
	printf("stress: %" PRIu64 " spills, %" PRIu64 " fetches\n", st.spills, st.fetches);
	ck_assert_uint_gt(st.spills, 100);
	ck_assert_uint_gt(st.fetches, 50);
	/* Resident blocks first, to make room; then the spilled ones. */
	for (int pass = 0; pass < 2; pass++) {
		for (int i = 0; i < NB; i++) {
			if (blks[i].st == B_FREE ||
			    (!pass && gmlake_offload_state(ctx, blks[i].p) !=
			     GMLAKE_BLOCK_RESIDENT))
				continue;
			ck_assert_int_eq(settle(ctx, &ring, &blks[i]), 0);
			th_verify_ok(ctx, blks[i].p, blks[i].size,
				     blks[i].seed, NULL);
			th_free(ctx, blks[i].p);
			blks[i].st = B_FREE;
		}
	}
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.spilled_blocks.current, 0);
	ck_assert_int_eq(st.host_bytes.current, 0);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Threads: rings and calls from any thread                               */

struct worker {
	gmlake_ctx *ctx;
	int id;
	int failures;
};

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct gmlake_offload ring;
	void *p[4] = { NULL };
	int i, round;

	if (gmlake_offload_init(&ring, w->ctx, 8, 0)) {
		w->failures++;
		return NULL;
	}
	for (i = 0; i < 4; i++)
		if (gmlake_alloc(w->ctx, &p[i], 2 * TH_MiB, NULL) ||
		    th_fill(w->ctx, p[i], 2 * TH_MiB, w->id * 10 + i, NULL))
			w->failures++;
	for (round = 0; round < 20 && !w->failures; round++) {
		for (i = 0; i < 4; i++) {
			struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(&ring);

			if (round % 2)
				gmlake_offload_prep_fetch(sqe, p[i]);
			else
				gmlake_offload_prep_spill(sqe, p[i]);
			gmlake_offload_sqe_set_data(sqe, i);
		}
		if (gmlake_offload_submit(&ring) != 4)
			w->failures++;
		for (i = 0; i < 4; i++) {
			struct gmlake_offload_cqe *cqe;

			if (gmlake_offload_wait_cqe(&ring, &cqe) || cqe->res)
				w->failures++;
			else
				gmlake_offload_cqe_seen(&ring, cqe);
		}
	}
	for (i = 0; i < 4; i++) {
		if (th_verify(w->ctx, p[i], 2 * TH_MiB, w->id * 10 + i, NULL,
			      NULL))
			w->failures++;
		gmlake_free(w->ctx, p[i]);
	}
	if (gmlake_offload_exit(&ring))
		w->failures++;
	return NULL;
}

START_TEST(test_threads)
{
	enum { NT = 4 };
	gmlake_ctx *ctx = off_ctx(128 * TH_MiB, 128 * TH_MiB, 0);
	struct worker w[NT];
	pthread_t t[NT];

	for (int i = 0; i < NT; i++) {
		w[i] = (struct worker){ ctx, i + 1, 0 };
		ck_assert_int_eq(pthread_create(&t[i], NULL, worker_main,
						&w[i]), 0);
	}
	for (int i = 0; i < NT; i++) {
		pthread_join(t[i], NULL);
		ck_assert_int_eq(w[i].failures, 0);
	}
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/*
 * In place: while spilled, host memory is mapped at the block's own
 * address, so a stray access (here a CPU read of the emulated device's
 * mapping) sees the block's bytes instead of faulting.
 */
START_TEST(test_inplace)
{
	gmlake_ctx *ctx = off_ctx(32 * TH_MiB, 64 * TH_MiB, 0);
	struct gmlake_offload ring;
	struct gmlake_stats st0, st;
	size_t size = 6 * TH_MiB - 512;
	void *p, *q, *hole, *keep;

	hole = th_alloc(ctx, 2 * TH_MiB, NULL);
	keep = th_alloc(ctx, 2 * TH_MiB, NULL);
	th_free(ctx, hole);
	p = th_alloc(ctx, size, NULL);			/* segment */
	q = th_alloc(ctx, 20 * TH_MiB, NULL);		/* stitched */
	th_fill_ok(ctx, p, size, 71, NULL);
	th_fill_ok(ctx, q, 20 * TH_MiB, 72, NULL);
	ck_assert_int_eq(gmlake_offload_init(&ring, ctx, 4,
					     GMLAKE_OFFLOAD_INPLACE), 0);
	th_stats(ctx, &st0);
	ck_assert_int_eq(spill(&ring, p), 0);
	ck_assert_int_eq(spill(&ring, q), 0);
	th_check(ctx);
	TH_OK(ctx, gmlake_trim(ctx));	/* the spares go at once */
	th_stats(ctx, &st);
	ck_assert_int_lt(st.reserved_bytes.current, st0.reserved_bytes.current);
	ck_assert_int_ge(st.host_bytes.current, (int64_t)(26 * TH_MiB));
	ck_assert_int_eq(st.spilled_blocks.current, 2);
	ck_assert_uint_eq(th_pattern_diff(p, size, 71), SIZE_MAX);
	ck_assert_uint_eq(th_pattern_diff(q, 20 * TH_MiB, 72), SIZE_MAX);
	ck_assert_int_eq(fetch(&ring, q), 0);
	th_check(ctx);
	th_verify_ok(ctx, q, 20 * TH_MiB, 72, NULL);
	th_free(ctx, p);			/* freed while in place */
	th_stats(ctx, &st);
	ck_assert_int_eq(st.host_bytes.current, 0);
	ck_assert_int_eq(st.spilled_blocks.current, 0);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, q);
	th_free(ctx, keep);
	th_destroy(ctx);
}
END_TEST

/* Destroying a context with spilled blocks (force) leaves nothing. */
START_TEST(test_destroy_spilled)
{
	gmlake_ctx *ctx = off_ctx(32 * TH_MiB, 32 * TH_MiB, 0);
	struct gmlake_offload ring;
	struct gml_emu_info info;
	void *p = th_alloc(ctx, 4 * TH_MiB, NULL);

	ring_init(&ring, ctx, 2);
	ck_assert_int_eq(spill(&ring, p), 0);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_emu_info(ctx, &info);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, false), -EBUSY);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
}
END_TEST

/*
 * Rings still open when their context goes, forced with a spilled block
 * live (_i 0) or unforced with no block left (_i 1): the destroy works;
 * a request still queued completes (cancelled, or done) and can be reaped
 * afterwards; submit then fails with -EBADF, and gmlake_offload_exit
 * frees each ring. Before, exit took the freed context's lock and submit
 * used the freed manager (heap use after free in the sanitizer build).
 */
START_TEST(test_destroy_rings_open)
{
	bool force = _i == 0;
	gmlake_ctx *ctx = off_ctx(64 * TH_MiB, 64 * TH_MiB, 0);
	struct gmlake_offload a, b;
	struct gmlake_offload_sqe *sqe;
	struct gmlake_offload_cqe *cqe;
	void *p;

	p = th_alloc_filled(ctx, 8 * TH_MiB, 5, NULL);
	ring_init(&a, ctx, 4);
	ring_init(&b, ctx, 4);
	ck_assert_int_eq(spill(&a, p), 0);
	if (!force) {
		ck_assert_int_eq(fetch(&a, p), 0);
		th_verify_ok(ctx, p, 8 * TH_MiB, 5, NULL);
		th_free(ctx, p);
	}
	/* Left unreaped: a spill of a spilled block (done at once) or of a
	 * freed address (not a live block), unless cancelled first. */
	submit_one(&b, GMLAKE_OFFLOAD_SPILL, p);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, force), 0);

	ck_assert_int_eq(gmlake_offload_wait_cqe(&b, &cqe), 0);
	ck_assert_uint_eq(gmlake_offload_cqe_get_data(cqe), (uintptr_t)p);
	ck_assert_msg(cqe->res == (force ? 0 : -EINVAL) ||
		      cqe->res == -ECANCELED, "res %d", cqe->res);
	gmlake_offload_cqe_seen(&b, cqe);
	ck_assert_int_eq(gmlake_offload_peek_cqe(&b, &cqe), -EAGAIN);
	ck_assert_int_eq(gmlake_offload_wait_cqe(&b, &cqe), -EAGAIN);
	sqe = gmlake_offload_get_sqe(&a);
	ck_assert_ptr_nonnull(sqe);
	gmlake_offload_prep_fetch(sqe, p);
	ck_assert_int_eq(gmlake_offload_submit(&a), -EBADF);
	ck_assert_str_ne(gmlake_last_error(), "");
	ck_assert_int_eq(gmlake_offload_exit(&a), 0);
	ck_assert_int_eq(gmlake_offload_exit(&b), 0);
}
END_TEST

static Suite *offload_suite(void)
{
	Suite *s = suite_create("offload");
	TCase *tc;

	tc = th_tcase(s, "Core");
	tcase_add_test(tc, test_spill_fetch_segment);
	tcase_add_test(tc, test_spill_slabs);
	tcase_add_test(tc, test_long_lived_off_slabs);
	tcase_add_test(tc, test_spill_keeps_shared_slab);
	tcase_add_test(tc, test_tail_blocks_spill);
	tcase_add_test(tc, test_spill_part_of_stitched_slab);
	tcase_add_test(tc, test_spill_stitched_ends);
	tcase_add_test(tc, test_long_lived_off_stitched_slabs);
	tcase_add_test(tc, test_span_cycle);
	tcase_add_test(tc, test_span_stitched);
	tcase_add_test(tc, test_span_from_cached_chunks);
	tcase_add_loop_test(tc, test_faults_span_from_cached_chunks, 0, 5);
	tcase_add_test(tc, test_spill_fetch_stitched);
	tcase_add_test(tc, test_fetch_takes_cached_chunks);
	tcase_add_test(tc, test_fetch_evicts_unused_stitched);
	tcase_add_test(tc, test_fetch_takes_busy_chunks);
	tcase_add_test(tc, test_many_in_flight);
	tcase_add_test(tc, test_batch_keeps_block_order);
	tcase_add_test(tc, test_ring_errors);
	tcase_add_test(tc, test_destroy_spilled);
	tcase_add_loop_test(tc, test_destroy_rings_open, 0, 2);
	tcase_add_test(tc, test_inplace);
	tcase_add_test(tc, test_engine_named);

	tc = th_tcase(s, "Limits");
	tcase_add_test(tc, test_host_budget);
	tcase_add_loop_test(tc, test_host_pin, 0, 3);
	tcase_add_test(tc, test_fetch_oom);
	tcase_add_test(tc, test_pin_failure);
	tcase_add_loop_test(tc, test_stale_unmap_fails, 0, 4);
	tcase_add_test(tc, test_failed_fetch_keeps_taken_chunks_back);
	tcase_add_test(tc, test_events_do_not_pile_up);
	tcase_add_loop_test(tc, test_sticky_spill, 0, 4);
	tcase_add_loop_test(tc, test_sticky_fetch, 0, 4);
	tcase_add_loop_test(tc, test_fetch_stuck, 0, 8);
	tcase_add_test(tc, test_query_fails_stream_drains);
	tcase_add_test(tc, test_wakeups_hold_no_copy);
	tcase_add_loop_test(tc, test_fetch_batch_one_access, 0, 2);
	tcase_add_loop_test(tc, test_engine_holds_no_alloc, 0, 3);
	tcase_add_loop_test(tc, test_faults, 0, 4 * NFAULT_CALLS);

	tc = th_tcase(s, "Auto");
	tcase_add_test(tc, test_auto_device_limit);
	tcase_add_test(tc, test_auto_oom);
	tcase_add_test(tc, test_auto_skips_freed);
	tcase_add_test(tc, test_sticky_auto);

	tc = th_tcase(s, "Bound");
	tcase_add_loop_test(tc, test_free_with_request_queued, 0, 2);

	tc = th_tcase(s, "Stress");
	tcase_add_loop_test(tc, test_stress, 0, 2);
	tcase_add_test(tc, test_threads);
	return s;
}

int main(int argc, char **argv)
{
	int probe;

	want_thread_engine = argc > 1 && !strcmp(argv[1], "thread");
	/* The emulated device only: these tests set its capacity. */
	if (!th_env_is_emu()) {
		fprintf(stderr, "check_offload: emulated device only\n");
		return 77;
	}
	probe = th_probe();
	if (probe)
		return probe;
	return th_run_suite(offload_suite());
}
