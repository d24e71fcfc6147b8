/* SPDX-License-Identifier: MIT */
/*
 * check_alloc: the allocator (lib/alloc.c, lib/small.c) through the public
 * API, with the invariant checker after every operation.
 *
 * Runs on the backend GMLAKE_BACKEND names (emu under make check); exits 77
 * when that backend has no device. Cases that need a small device (out of
 * memory, exact chunk counts) run on the emulated device only.
 */
#include <pthread.h>

#include <gmlake-snapshot.h>

#include "helpers.h"

#define CAP_CHUNKS(n) ((size_t)(n) * TH_CHUNK)

/* ---------------------------------------------------------------------- */
/* Integrity: a random workload, every block checked until it is freed.   */

#define RW_SLOTS 40
#define RW_OPS 500

struct blk {
	void *p;
	size_t size;
	uint64_t seed;
};

static size_t rw_size(struct th_rng *r)
{
	uint64_t k = th_range(r, 0, 99);

	if (k < 25)
		return th_range(r, 1, 4 * TH_KiB);
	if (k < 45)
		return th_range(r, 4 * TH_KiB, TH_MiB - 1);
	if (k < 85)
		return th_range(r, TH_MiB, 6 * TH_MiB);
	return th_range(r, 6 * TH_MiB, 20 * TH_MiB);
}

static void rw_verify_all(gmlake_ctx *ctx, struct blk *b, int n)
{
	int i;

	for (i = 0; i < n; i++)
		th_verify_ok(ctx, b[i].p, b[i].size, b[i].seed, NULL);
}

static void rw_free_one(gmlake_ctx *ctx, struct blk *b, int *n, int j)
{
	th_verify_ok(ctx, b[j].p, b[j].size, b[j].seed, NULL);
	th_free(ctx, b[j].p);
	b[j] = b[--*n];
}

/* A fresh block must not overlap any live one in the address space. */
static void rw_no_overlap(struct blk *b, int n, void *p, size_t size)
{
	int i;

	for (i = 0; i < n; i++)
		ck_assert_msg(!th_overlap(b[i].p, b[i].size, p, size),
			      "new block %p+%zu overlaps live %p+%zu", p,
			      size, b[i].p, b[i].size);
}

static void random_workload(uint64_t seed, size_t capacity)
{
	gmlake_ctx *ctx = th_ctx(capacity);
	struct th_rng r = { seed };
	struct blk b[RW_SLOTS];
	struct gmlake_stats st, st1;
	int n = 0, op, ooms = 0;

	for (op = 0; op < RW_OPS; op++) {
		bool do_alloc = n == 0 ||
				(n < RW_SLOTS && th_range(&r, 0, 99) < 55);

		if (do_alloc) {
			size_t size = rw_size(&r);
			void *p = NULL;
			int ret;

			th_stats(ctx, &st);
			ret = gmlake_alloc(ctx, &p, size, NULL);
			th_check(ctx);
			if (ret == -ENOMEM && th_is_emu(ctx)) {
				/* The device is full: state must be intact. */
				th_stats(ctx, &st1);
				ck_assert_uint_eq(st1.ooms, st.ooms + 1);
				ck_assert_int_eq(st1.active_blocks.current,
						 st.active_blocks.current);
				ck_assert_int_eq(st1.requested_bytes.current,
						 st.requested_bytes.current);
				ooms++;
				if (n)
					rw_free_one(ctx, b, &n,
						    (int)th_range(&r, 0, n - 1));
				continue;
			}
			ck_assert_msg(ret == 0, "op %d: alloc %zu: %d (%s)",
				      op, size, ret, gmlake_last_error());
			ck_assert_msg((uintptr_t)p % 512 == 0, "%p", p);
			rw_no_overlap(b, n, p, size);
			b[n].p = p;
			b[n].size = size;
			b[n].seed = seed * 1000003u + (uint64_t)op;
			th_fill_ok(ctx, p, size, b[n].seed, NULL);
			th_check(ctx);
			n++;
		} else {
			rw_free_one(ctx, b, &n, (int)th_range(&r, 0, n - 1));
		}
		if (op % 25 == 24)
			rw_verify_all(ctx, b, n);
	}
	rw_verify_all(ctx, b, n);
	while (n)
		rw_free_one(ctx, b, &n, n - 1);

	th_stats(ctx, &st);
	ck_assert_int_eq(st.active_blocks.current, 0);
	ck_assert_int_eq(st.requested_bytes.current, 0);
	ck_assert_int_eq(st.allocated_bytes.current, 0);
	ck_assert_int_eq(st.stitched_live.current, 0);
	if (th_is_emu(ctx)) {
		/* A device this small fragments: stitching must have served. */
		ck_assert_msg(st.stitches > 0, "no stitch in %d ops", RW_OPS);
		ck_assert_int_le(st.reserved_bytes.peak, (int64_t)capacity);
	}
	printf("random workload seed %" PRIu64 ": %" PRIu64 " allocs, %"
	       PRIu64 " fits, %" PRIu64 " stitches, %" PRIu64
	       " stitch reuses, %" PRIu64 " grows, %d ooms\n", seed,
	       st.allocs, st.fits, st.stitches, st.stitch_reuses, st.grows,
	       ooms);
	TH_OK(ctx, gmlake_trim(ctx));
	th_destroy(ctx);
}

START_TEST(test_random_workload)
{
	random_workload(1 + (uint64_t)_i, CAP_CHUNKS(48));
}
END_TEST

/* Blocks filled one after another; each new block must leave all others. */
START_TEST(test_fill_all_verify_all)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(64));
	static const size_t sizes[] = {
		512, 1, 777, 4096, 65536, 1000000, TH_MiB, TH_MiB + 1,
		3 * TH_MiB, 2 * TH_MiB, 5 * TH_MiB + 512, 300, 8 * TH_MiB,
	};
	enum { N = sizeof(sizes) / sizeof(sizes[0]) };
	void *p[N];
	int i, j;

	for (i = 0; i < N; i++) {
		p[i] = th_alloc(ctx, sizes[i], NULL);
		for (j = 0; j < i; j++)
			ck_assert(!th_overlap(p[i], sizes[i], p[j], sizes[j]));
		th_fill_ok(ctx, p[i], sizes[i], 500 + i, NULL);
		for (j = 0; j <= i; j++)
			th_verify_ok(ctx, p[j], sizes[j], 500 + j, NULL);
	}
	for (i = 0; i < N; i += 2)
		th_free(ctx, p[i]);
	for (i = 1; i < N; i += 2)
		th_verify_ok(ctx, p[i], sizes[i], 500 + i, NULL);
	for (i = 1; i < N; i += 2)
		th_free(ctx, p[i]);
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Small requests are packed.                                             */

static int cmp_ptr(const void *a, const void *b)
{
	uintptr_t x = (uintptr_t)((const struct blk *)a)->p;
	uintptr_t y = (uintptr_t)((const struct blk *)b)->p;

	return x < y ? -1 : x > y;
}

START_TEST(test_small_packing)
{
	enum { N = 1000 };
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(64));
	struct th_rng r = { 7 };
	struct blk *b = calloc(N, sizeof(*b));
	struct gmlake_stats st;
	size_t total = 0;
	int i;

	ck_assert_ptr_nonnull(b);
	for (i = 0; i < N; i++) {
		b[i].size = th_range(&r, 1, 8000);
		b[i].seed = 9000 + i;
		b[i].p = th_alloc(ctx, b[i].size, NULL);
		total += b[i].size;
		th_fill_ok(ctx, b[i].p, b[i].size, b[i].seed, NULL);
	}
	th_stats(ctx, &st);
	printf("%d small blocks, %zu bytes: %" PRId64 " small chunks, %"
	       PRId64 " bytes reserved\n", N, total, st.small_chunks.current,
	       st.reserved_bytes.current);
	ck_assert_int_eq(st.active_blocks.current, N);
	ck_assert_int_eq(st.requested_bytes.current, (int64_t)total);
	ck_assert_int_ge(st.allocated_bytes.current, (int64_t)total);
	/* About 4 MB asked for: a handful of chunks, not one per block. */
	ck_assert_int_ge(st.small_chunks.current, 1);
	ck_assert_int_le(st.small_chunks.current, 8);
	ck_assert_int_le(st.reserved_bytes.current, (int64_t)(16 * TH_MiB));

	/* No two small blocks overlap, and each kept its own bytes. */
	qsort(b, N, sizeof(*b), cmp_ptr);
	for (i = 0; i + 1 < N; i++)
		ck_assert_msg((uintptr_t)b[i].p + b[i].size <=
				      (uintptr_t)b[i + 1].p,
			      "%p+%zu overlaps %p", b[i].p, b[i].size,
			      b[i + 1].p);
	for (i = 0; i < N; i++)
		th_verify_ok(ctx, b[i].p, b[i].size, b[i].seed, NULL);

	/* Free every other one; the rest stay intact; holes are reused. */
	for (i = 0; i < N; i += 2)
		th_free(ctx, b[i].p);
	th_stats(ctx, &st);
	{
		int64_t chunks = st.small_chunks.current;

		for (i = 0; i < N; i += 2) {
			b[i].p = th_alloc(ctx, b[i].size, NULL);
			th_fill_ok(ctx, b[i].p, b[i].size, b[i].seed, NULL);
		}
		th_stats(ctx, &st);
		ck_assert_int_le(st.small_chunks.current, chunks + 1);
	}
	for (i = 0; i < N; i++)
		th_verify_ok(ctx, b[i].p, b[i].size, b[i].seed, NULL);
	for (i = 0; i < N; i++)
		th_free(ctx, b[i].p);

	th_stats(ctx, &st);
	ck_assert_int_eq(st.active_blocks.current, 0);
	ck_assert_int_eq(st.requested_bytes.current, 0);
	TH_OK(ctx, gmlake_trim(ctx));
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 0);
	ck_assert_int_eq(st.reserved_bytes.current, 0);
	free(b);
	th_destroy(ctx);
}
END_TEST

/*
 * One emptied small chunk per stream stays for the next small request
 * instead of going back to the large pool; a second one goes back, and
 * trim and the stream's end give the idle one back.
 */
START_TEST(test_small_idle_chunk)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(64));
	/* Two to a chunk: four fill two chunks. */
	size_t half = TH_MiB - 512;
	struct gmlake_stats st, st0;
	gmlake_stream_t s;
	void *p[4], *first;
	int i;

	first = th_alloc(ctx, 4096, NULL);
	th_free(ctx, first);
	th_stats(ctx, &st0);
	ck_assert_int_eq(st0.small_chunks.current, 1);		/* kept */
	for (i = 0; i < 100; i++) {
		void *q = th_alloc(ctx, 4096, NULL);

		ck_assert_ptr_eq(q, first);
		th_free(ctx, q);
	}
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 1);
	ck_assert_int_eq(st.chunks.current, st0.chunks.current);
	ck_assert_int_eq(st.allocated_bytes.current, 0);

	for (i = 0; i < 4; i++)
		p[i] = th_alloc(ctx, half, NULL);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 2);
	for (i = 0; i < 4; i++)
		th_free(ctx, p[i]);
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 1);	/* one stays */

	TH_OK(ctx, gmlake_trim(ctx));
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 0);
	ck_assert_int_eq(st.reserved_bytes.current, 0);

	/* A stream's idle chunk goes when the stream does. */
	TH_OK(ctx, gmlake_stream_create(ctx, &s));
	th_free(ctx, th_alloc(ctx, 4096, s));
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 1);
	TH_OK(ctx, gmlake_stream_destroy(ctx, s));
	th_check(ctx);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 0);
	/* So does one emptied after its stream is gone. */
	TH_OK(ctx, gmlake_stream_create(ctx, &s));
	p[0] = th_alloc(ctx, 4096, s);
	TH_OK(ctx, gmlake_stream_destroy(ctx, s));
	th_free(ctx, p[0]);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 0);
	th_destroy(ctx);
}
END_TEST

/* Small and large blocks side by side; large ones stay chunk aligned. */
START_TEST(test_small_and_large_mixed)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(64));
	size_t cs = th_chunk_size(ctx);
	void *s1, *s2, *l1, *l2, *l3;

	s1 = th_alloc(ctx, 100, NULL);
	l1 = th_alloc(ctx, TH_MiB, NULL);	/* == small_size: large */
	s2 = th_alloc(ctx, TH_MiB - 1, NULL);	/* just below: small */
	l2 = th_alloc(ctx, 3 * TH_MiB + 5, NULL);
	l3 = th_alloc(ctx, 2 * TH_MiB, NULL);
	ck_assert_uint_eq((uintptr_t)l1 % cs, 0);
	ck_assert_uint_eq((uintptr_t)l2 % cs, 0);
	ck_assert_uint_eq((uintptr_t)l3 % cs, 0);
	th_fill_ok(ctx, s1, 100, 1, NULL);
	th_fill_ok(ctx, l1, TH_MiB, 2, NULL);
	th_fill_ok(ctx, s2, TH_MiB - 1, 3, NULL);
	th_fill_ok(ctx, l2, 3 * TH_MiB + 5, 4, NULL);
	th_fill_ok(ctx, l3, 2 * TH_MiB, 5, NULL);
	th_verify_ok(ctx, s1, 100, 1, NULL);
	th_verify_ok(ctx, l1, TH_MiB, 2, NULL);
	th_verify_ok(ctx, s2, TH_MiB - 1, 3, NULL);
	th_verify_ok(ctx, l2, 3 * TH_MiB + 5, 4, NULL);
	th_verify_ok(ctx, l3, 2 * TH_MiB, 5, NULL);
	th_free(ctx, l2);
	th_free(ctx, s1);
	th_free(ctx, l1);
	th_free(ctx, s2);
	th_free(ctx, l3);
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* First fit, split, coalesce.                                            */

static void expect_no_driver_work(const struct gmlake_stats *s0,
				  const struct gmlake_stats *s1)
{
	ck_assert_int_eq(s1->chunks.current, s0->chunks.current);
	ck_assert_uint_eq(s1->grows, s0->grows);
	ck_assert_uint_eq(s1->stitches, s0->stitches);
	ck_assert_uint_eq(s1->calls[GMLAKE_CALL_mem_map],
			  s0->calls[GMLAKE_CALL_mem_map]);
	ck_assert_uint_eq(s1->calls[GMLAKE_CALL_mem_create],
			  s0->calls[GMLAKE_CALL_mem_create]);
}

/* Driver calls of kind k between two readings. */
static uint64_t calls_between(const struct gmlake_stats *s0,
			      const struct gmlake_stats *s1, int k)
{
	return s1->calls[k] - s0->calls[k];
}

/*
 * gmlake_long_lived: a block of 16 chunks or more takes one new handle
 * (one create, map and set-access) at the end of the segment; smaller
 * ones take chunks, free memory is still reused first, and with it off
 * growth is by handles again. Calls nest; off without on is refused.
 */
START_TEST(test_long_lived)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(128));
	const size_t c = TH_CHUNK;
	struct gmlake_stats s0, s1;
	void *a, *b, *d, *e;

	ck_assert_int_eq(gmlake_long_lived(ctx, false), -EINVAL);
	ck_assert_int_eq(gmlake_long_lived(NULL, true), -EINVAL);
	b = th_alloc_filled(ctx, 4 * c, 1, NULL);	/* the segment */
	TH_OK(ctx, gmlake_long_lived(ctx, true));
	TH_OK(ctx, gmlake_long_lived(ctx, true));
	th_stats(ctx, &s0);
	a = th_alloc_filled(ctx, 32 * c, 2, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_map), 1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_set_access), 1);
	ck_assert_int_eq(s1.chunks.current - s0.chunks.current, 32);
	/* Below 16 chunks: chunks; free memory first, with no call. */
	th_stats(ctx, &s0);
	d = th_alloc_filled(ctx, 8 * c, 3, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 8);
	th_free(ctx, d);
	th_stats(ctx, &s0);
	d = th_alloc_filled(ctx, 8 * c, 4, NULL);
	th_stats(ctx, &s1);
	expect_no_driver_work(&s0, &s1);
	/* Freed, its range is holes and, with no tier to fetch into a
	 * spare span, its handle goes back to the driver once its work is
	 * done: here by the next allocation, a chunk's. */
	th_stats(ctx, &s0);
	th_verify_free(ctx, a, 32 * c, 2, NULL);
	th_free(ctx, d);
	d = th_alloc_filled(ctx, 8 * c, 4, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_release), 1);
	ck_assert_int_eq(s0.reserved_bytes.current - s1.reserved_bytes.current,
			 (int64_t)(32 * c));
	ck_assert_int_eq(s0.chunks.current - s1.chunks.current, 32);
	/* The next one is a span again, a new handle. */
	th_stats(ctx, &s0);
	a = th_alloc_filled(ctx, 32 * c, 5, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_map), 1);
	TH_OK(ctx, gmlake_long_lived(ctx, false));
	TH_OK(ctx, gmlake_long_lived(ctx, false));
	ck_assert_int_eq(gmlake_long_lived(ctx, false), -EINVAL);
	/* Off: growth handles again, three 20 MiB slabs and two chunks. */
	th_stats(ctx, &s0);
	e = th_alloc_filled(ctx, 32 * c, 6, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 5);
	th_verify_free(ctx, a, 32 * c, 5, NULL);
	th_verify_free(ctx, b, 4 * c, 1, NULL);
	th_verify_free(ctx, d, 8 * c, 4, NULL);
	th_verify_free(ctx, e, 32 * c, 6, NULL);
	th_destroy(ctx);
}
END_TEST

/*
 * A long-lived block of 16 chunks or more (an optimizer's state, made
 * after backward freed the activations) passes over the holes
 * shorter-lived blocks left and takes a handle at the end of the segment;
 * a smaller one takes a hole as usual. The large hole stays the next
 * step's: with the mode off, the same request takes it with no driver
 * call.
 */
START_TEST(test_long_lived_past_holes)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(256));
	const size_t c = TH_CHUNK;
	struct gmlake_stats s0, s1;
	void *act, *act2, *keep, *x, *y, *v;

	/* keep, the model, makes the requests below too small for top fit
	 * (a quarter of the requested peak). */
	act = th_alloc_filled(ctx, 8 * c, 1, NULL);
	act2 = th_alloc_filled(ctx, 20 * c, 2, NULL);
	keep = th_alloc_filled(ctx, 100 * c, 3, NULL);
	th_verify_free(ctx, act, 8 * c, 1, NULL);
	th_verify_free(ctx, act2, 20 * c, 2, NULL);
	TH_OK(ctx, gmlake_long_lived(ctx, true));
	th_stats(ctx, &s0);
	y = th_alloc_filled(ctx, 20 * c, 4, NULL);
	th_stats(ctx, &s1);
	x = th_alloc_filled(ctx, 8 * c, 5, NULL);
	TH_OK(ctx, gmlake_long_lived(ctx, false));
	ck_assert((char *)y >= (char *)keep + 100 * c);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 1);
	ck_assert_ptr_eq(x, act);
	/* The large hole is the next step's activations', as it was. */
	th_stats(ctx, &s0);
	v = th_alloc_filled(ctx, 20 * c, 6, NULL);
	th_stats(ctx, &s1);
	expect_no_driver_work(&s0, &s1);
	ck_assert_ptr_eq(v, act2);
	th_verify_free(ctx, x, 8 * c, 5, NULL);
	th_verify_free(ctx, y, 20 * c, 4, NULL);
	th_verify_free(ctx, v, 20 * c, 6, NULL);
	th_verify_free(ctx, keep, 100 * c, 3, NULL);
	th_destroy(ctx);
}
END_TEST

/* A failing call while a long-lived block is made: it takes chunks
 * instead, and nothing leaks. _i: the call kind; nth 1 and 2. */
START_TEST(test_long_lived_faults)
{
	static const int calls[] = {
		GMLAKE_CALL_mem_create, GMLAKE_CALL_mem_map,
		GMLAKE_CALL_set_access, GMLAKE_CALL_mem_unmap,
		GMLAKE_CALL_mem_release,
	};

	for (uint64_t nth = 1; nth <= 2; nth++) {
		gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(64));
		void *a, *b;

		b = th_alloc_filled(ctx, 2 * TH_CHUNK, 1, NULL);
		TH_OK(ctx, gmlake_long_lived(ctx, true));
		gml_dev_fail_nth(th_dev(ctx), calls[_i], nth,
				 calls[_i] == GMLAKE_CALL_mem_create ? ENOMEM :
								       EIO);
		a = NULL;
		if (gmlake_alloc(ctx, &a, 32 * TH_CHUNK, NULL))
			a = NULL;
		gml_dev_fail_nth(th_dev(ctx), -1, 0, 0);
		th_check(ctx);
		if (!a)
			a = th_alloc(ctx, 32 * TH_CHUNK, NULL);
		th_fill_ok(ctx, a, 32 * TH_CHUNK, 2, NULL);
		TH_OK(ctx, gmlake_long_lived(ctx, false));
		th_verify_free(ctx, a, 32 * TH_CHUNK, 2, NULL);
		th_verify_free(ctx, b, 2 * TH_CHUNK, 1, NULL);
		th_destroy(ctx);
	}
}
END_TEST

/*
 * A freed long-lived block with no tier: a failing call on the way back
 * to the driver (the event marking its work, its query, the unmap, the
 * release) loses nothing: the free succeeds, the next allocation works,
 * and a trim leaves reserved memory where it was before the block. _i:
 * the call kind.
 */
START_TEST(test_long_lived_free_faults)
{
	static const int calls[] = {
		GMLAKE_CALL_event_record, GMLAKE_CALL_event_query,
		GMLAKE_CALL_mem_unmap, GMLAKE_CALL_mem_release,
	};
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(64));
	struct gmlake_stats s0, s1, sa, sb;
	void *a, *b, *d;

	b = th_alloc_filled(ctx, 2 * TH_CHUNK, 1, NULL);
	TH_OK(ctx, gmlake_trim(ctx));
	th_stats(ctx, &s0);
	TH_OK(ctx, gmlake_long_lived(ctx, true));
	a = th_alloc_filled(ctx, 32 * TH_CHUNK, 2, NULL);
	TH_OK(ctx, gmlake_long_lived(ctx, false));
	th_verify_ok(ctx, a, 32 * TH_CHUNK, 2, NULL);
	th_stats(ctx, &sa);
	gml_dev_fail_nth(th_dev(ctx), calls[_i], 1, EIO);
	TH_OK(ctx, gmlake_free(ctx, a));
	d = th_alloc(ctx, 4 * TH_CHUNK, NULL);	/* reaps the freed span */
	gml_dev_fail_nth(th_dev(ctx), -1, 0, 0);
	th_stats(ctx, &sb);
	ck_assert_uint_ge(calls_between(&sa, &sb, calls[_i]), 1);	/* fired */
	th_fill_ok(ctx, d, 4 * TH_CHUNK, 3, NULL);
	th_verify_free(ctx, d, 4 * TH_CHUNK, 3, NULL);
	TH_OK(ctx, gmlake_trim(ctx));
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.reserved_bytes.current, s0.reserved_bytes.current);
	ck_assert_int_eq(s1.chunks.current, s0.chunks.current);
	th_verify_free(ctx, b, 2 * TH_CHUNK, 1, NULL);
	th_destroy(ctx);
}
END_TEST

/*
 * The growth budget (cfg.grow_slack, gmlake_grow_slack): 982 of 992
 * chunks live, the 10 free in two runs of 5. A request of 10 grows the
 * segment while reserved memory stays within the budget over the most
 * requested (20 per mille: 1002 <= 992 + 19.8 chunks), and stitches the
 * two runs under a budget too small for it (5: 4.96 chunks). _i: 0 the
 * default, 1 the budget set at run time, 2 through GMLAKE_GROW_SLACK.
 */
START_TEST(test_grow_slack)
{
	struct gmlake_config cfg;
	struct gmlake_stats s0, s1;
	gmlake_ctx *ctx;
	void *x, *a, *b, *c, *d, *y;
	bool tight = _i > 0;

	if (_i == 2)
		ck_assert_int_eq(setenv("GMLAKE_GROW_SLACK", "5", 1), 0);
	th_config(&cfg, CAP_CHUNKS(1100));
	if (_i == 2)
		ck_assert_int_eq(unsetenv("GMLAKE_GROW_SLACK"), 0);
	ck_assert_uint_eq(cfg.grow_slack, _i == 2 ? 5 : 20);
	cfg.top_fit = 0;
	cfg.grow_handle = 0;	/* growth by chunks: every run stitches */
	ctx = th_ctx_cfg(&cfg);
	if (_i == 1)
		ck_assert_int_eq(gmlake_grow_slack(ctx, 5), 20);
	ck_assert_int_eq(gmlake_grow_slack(ctx, -1), tight ? 5 : 20);

	x = th_alloc_filled(ctx, 980 * TH_CHUNK, 1, NULL);
	a = th_alloc_filled(ctx, 5 * TH_CHUNK, 2, NULL);
	b = th_alloc_filled(ctx, TH_CHUNK, 3, NULL);
	c = th_alloc_filled(ctx, 5 * TH_CHUNK, 4, NULL);
	d = th_alloc_filled(ctx, TH_CHUNK, 5, NULL);
	th_free(ctx, a);
	th_free(ctx, c);
	th_stats(ctx, &s0);
	ck_assert_int_eq(s0.reserved_bytes.current, 992 * (int64_t)TH_CHUNK);

	y = th_alloc_filled(ctx, 10 * TH_CHUNK, 6, NULL);
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.reserved_bytes.current,
			 (tight ? 992 : 1002) * (int64_t)TH_CHUNK);
	ck_assert_uint_eq(s1.stitches, s0.stitches + tight);
	ck_assert_uint_eq(s1.grows, s0.grows + !tight);
	th_check(ctx);

	th_verify_free(ctx, y, 10 * TH_CHUNK, 6, NULL);
	th_verify_free(ctx, x, 980 * TH_CHUNK, 1, NULL);
	th_verify_free(ctx, b, TH_CHUNK, 3, NULL);
	th_verify_free(ctx, d, TH_CHUNK, 5, NULL);
	th_destroy(ctx);
}
END_TEST

/* A context for packing (cfg.pack; _i 1: from GMLAKE_PACK, 2: off), no top
 * fit and growth by chunks, so that every chunk is counted. */
static gmlake_ctx *pack_ctx(int mode)
{
	struct gmlake_config cfg;

	if (mode == 1)
		ck_assert_int_eq(setenv("GMLAKE_PACK", "1", 1), 0);
	th_config(&cfg, CAP_CHUNKS(64));
	if (mode == 1)
		ck_assert_int_eq(unsetenv("GMLAKE_PACK"), 0);
	ck_assert(cfg.pack == (mode == 1));
	if (mode == 0)
		cfg.pack = true;
	cfg.top_fit = 0;
	cfg.grow_handle = 0;
	return th_ctx_cfg(&cfg);
}

/* A block holding pattern seed, which packing may place off a chunk's
 * start (th_alloc asserts chunk alignment for large blocks). */
static void *pack_alloc(gmlake_ctx *ctx, size_t size, uint64_t seed,
			gmlake_stream_t s)
{
	void *p = th_alloc_small(ctx, size, s, 0);

	th_fill_ok(ctx, p, size, seed, s);
	return p;
}

/*
 * A snapshot's pieces tile each range without a gap or an overlap, and
 * every block of p[0..n) (NULL: freed) shows as an allocated piece at its
 * address with its size asked for.
 */
static void pack_snapshot_ok(gmlake_ctx *ctx, void *const *p, size_t n,
			     size_t size)
{
	struct gmlake_snapshot *snap = NULL;
	size_t found = 0, live = 0;

	ck_assert_int_eq(gmlake_snapshot_take(ctx, &snap), 0);
	for (size_t r = 0; r < snap->nranges; r++) {
		const struct gmlake_snap_range *rg = &snap->ranges[r];
		uint64_t at = rg->address, sum = 0;

		for (uint32_t k = rg->first; k < rg->first + rg->count; k++) {
			const struct gmlake_snap_piece *pc = &snap->pieces[k];

			ck_assert_uint_eq(pc->address, at);
			at += pc->size;
			sum += pc->size;
			if (pc->state != GMLAKE_PIECE_ALLOCATED)
				continue;
			for (size_t i = 0; i < n; i++)
				if (p[i] && pc->address == (uintptr_t)p[i]) {
					ck_assert_uint_eq(pc->requested, size);
					found++;
				}
		}
		ck_assert_uint_eq(sum, rg->size);
	}
	for (size_t i = 0; i < n; i++)
		live += p[i] != NULL;
	ck_assert_uint_eq(found, live);
	gmlake_snapshot_free(snap);
}

/* The context reserves that many chunks, and its snapshot shows p. */
static void pack_layout_ok(gmlake_ctx *ctx, void *const *p, size_t n,
			   size_t size, int64_t chunks)
{
	struct gmlake_stats st;

	th_stats(ctx, &st);
	ck_assert_int_eq(st.reserved_bytes.current, chunks * (int64_t)TH_CHUNK);
	pack_snapshot_ok(ctx, p, n, size);
}

/*
 * Packing: blocks of 1.5 chunks take 3 chunks a pair, at 512-byte offsets
 * inside them, each keeping its own bytes; a freed one leaves a hole the
 * next of its size takes; the snapshot shows each. Off, each takes 2.
 */
START_TEST(test_pack)
{
	const size_t size = 3 * TH_MiB;
	gmlake_ctx *ctx = pack_ctx(_i);
	struct gmlake_stats st;
	bool on = _i < 2;
	void *p[6];

	for (int i = 0; i < 6; i++) {
		p[i] = pack_alloc(ctx, size, 10 + i, NULL);
		ck_assert_uint_eq((uintptr_t)p[i] % 512, 0);
		for (int j = 0; j < i; j++)
			ck_assert(!th_overlap(p[i], size, p[j], size));
	}
	pack_layout_ok(ctx, p, 6, size, on ? 9 : 12);

	th_verify_free(ctx, p[1], size, 11, NULL);
	th_verify_free(ctx, p[4], size, 14, NULL);
	p[1] = p[4] = NULL;
	pack_snapshot_ok(ctx, p, 6, size);
	p[1] = pack_alloc(ctx, size, 21, NULL);
	pack_layout_ok(ctx, p, 6, size, on ? 9 : 12);

	th_verify_free(ctx, p[0], size, 10, NULL);
	th_verify_free(ctx, p[1], size, 21, NULL);
	th_verify_free(ctx, p[5], size, 15, NULL);
	th_verify_free(ctx, p[2], size, 12, NULL);
	th_verify_free(ctx, p[3], size, 13, NULL);
	ck_assert_int_eq(gmlake_trim(ctx), 0);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.reserved_bytes.current, 0);
	th_destroy(ctx);
}
END_TEST

/* Only blocks of one stream share a chunk: the bytes one frees are then
 * reused in stream order, with no event. */
START_TEST(test_pack_streams)
{
	const size_t size = 3 * TH_MiB;
	gmlake_ctx *ctx = pack_ctx(0);
	gmlake_stream_t s1, s2;
	void *a, *b, *c;

	TH_OK(ctx, gmlake_stream_create(ctx, &s1));
	TH_OK(ctx, gmlake_stream_create(ctx, &s2));
	a = pack_alloc(ctx, size, 1, s1);
	b = pack_alloc(ctx, size, 2, s2);
	c = pack_alloc(ctx, size, 3, s2);
	/* b does not start in a's last chunk; c does in b's. */
	ck_assert_uint_ge((uintptr_t)b, (uintptr_t)a + 2 * TH_CHUNK);
	ck_assert_uint_eq((uintptr_t)c, (uintptr_t)b + size);
	th_verify_free(ctx, a, size, 1, s1);
	th_verify_free(ctx, b, size, 2, s2);
	th_verify_free(ctx, c, size, 3, s2);
	TH_OK(ctx, gmlake_stream_destroy(ctx, s1));
	TH_OK(ctx, gmlake_stream_destroy(ctx, s2));
	th_destroy(ctx);
}
END_TEST

/* A request that rounds up to whole chunks is not packed: it gains
 * nothing by sharing and would straddle one chunk more. */
START_TEST(test_pack_whole_after_align)
{
	const size_t half = 3 * TH_MiB, whole = 2 * TH_CHUNK - 100;
	gmlake_ctx *ctx = pack_ctx(0);
	void *a, *b, *x, *y;

	/* a leaves the top of its last chunk free, below x's free run. */
	a = pack_alloc(ctx, half, 1, NULL);
	x = pack_alloc(ctx, 2 * TH_CHUNK, 2, NULL);
	y = pack_alloc(ctx, TH_CHUNK, 3, NULL);
	th_verify_free(ctx, x, 2 * TH_CHUNK, 2, NULL);
	b = pack_alloc(ctx, whole, 4, NULL);
	ck_assert_ptr_eq(b, x);
	pack_layout_ok(ctx, (void *[]){ a }, 1, half, 5);
	th_verify_free(ctx, a, half, 1, NULL);
	th_verify_free(ctx, b, whole, 4, NULL);
	th_verify_free(ctx, y, TH_CHUNK, 3, NULL);
	th_destroy(ctx);
}
END_TEST

/* Budgets out of range: the call and the context refuse them, clearly. */
START_TEST(test_grow_slack_bad)
{
	struct gmlake_config cfg;
	gmlake_ctx *ctx = NULL;

	ck_assert_int_eq(gmlake_grow_slack(NULL, 5), -EINVAL);
	th_config(&cfg, CAP_CHUNKS(8));
	cfg.grow_slack = GMLAKE_GROW_SLACK_MAX + 1;
	ck_assert_int_eq(gmlake_ctx_init(&ctx, &cfg), -EINVAL);
	ck_assert_ptr_null(ctx);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "grow_slack"));
	cfg.grow_slack = GMLAKE_GROW_SLACK_MAX;
	ctx = th_ctx_cfg(&cfg);
	ck_assert_int_eq(gmlake_grow_slack(ctx, GMLAKE_GROW_SLACK_MAX + 1),
			 -EINVAL);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "per mille"));
	ck_assert_int_eq(gmlake_grow_slack(ctx, -2), -EINVAL);
	ck_assert_int_eq(gmlake_grow_slack(ctx, 0), GMLAKE_GROW_SLACK_MAX);
	ck_assert_int_eq(gmlake_grow_slack(ctx, -1), 0);
	th_destroy(ctx);
}
END_TEST

/* Every request by first fit (top_fit off): for tests that place blocks
 * by position. */
static gmlake_ctx *first_fit_ctx(size_t capacity)
{
	struct gmlake_config cfg;

	th_config(&cfg, capacity);
	cfg.top_fit = 0;
	return th_ctx_cfg(&cfg);
}

START_TEST(test_first_fit)
{
	gmlake_ctx *ctx = first_fit_ctx(CAP_CHUNKS(32));
	static const size_t sizes[4] = { 6 * TH_MiB, 2 * TH_MiB, 4 * TH_MiB,
					 2 * TH_MiB };
	struct gmlake_stats s0, s1;
	void *blk[4], *a, *b, *c, *d, *w, *x, *y, *z;

	/* Each grows a segment of its own, in this order. */
	th_two_holes(ctx, sizes, blk);
	a = blk[0], b = blk[1], c = blk[2], d = blk[3];

	/* Free: a (6 MiB) and c (4 MiB). 4 MiB goes to the oldest: a. */
	th_stats(ctx, &s0);
	x = th_alloc(ctx, 4 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_ptr_eq(x, a);
	ck_assert_uint_eq(s1.fits, s0.fits + 1);
	expect_no_driver_work(&s0, &s1);

	/* 2 MiB: split from the rest of a, at its lowest free position. */
	y = th_alloc(ctx, 2 * TH_MiB, NULL);
	ck_assert_ptr_eq(y, (char *)a + 4 * TH_MiB);
	/* a is full: 4 MiB now goes to c, the next oldest with room. */
	w = th_alloc(ctx, 4 * TH_MiB, NULL);
	ck_assert_ptr_eq(w, c);
	th_stats(ctx, &s1);
	expect_no_driver_work(&s0, &s1);
	th_fill_ok(ctx, y, 2 * TH_MiB, 20, NULL);
	th_fill_ok(ctx, x, 4 * TH_MiB, 30, NULL);
	th_fill_ok(ctx, w, 4 * TH_MiB, 50, NULL);

	/* Freed, x and y coalesce: 6 MiB fits at a again. */
	th_free(ctx, y);
	th_free(ctx, x);
	z = th_alloc(ctx, 6 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_ptr_eq(z, a);
	expect_no_driver_work(&s0, &s1);
	th_fill_ok(ctx, z, 6 * TH_MiB, 40, NULL);

	th_verify_ok(ctx, b, 2 * TH_MiB, 2, NULL);
	th_verify_ok(ctx, d, 2 * TH_MiB, 4, NULL);
	th_verify_ok(ctx, w, 4 * TH_MiB, 50, NULL);
	th_verify_ok(ctx, z, 6 * TH_MiB, 40, NULL);
	th_free(ctx, b);
	th_free(ctx, d);
	th_free(ctx, w);
	th_free(ctx, z);
	th_destroy(ctx);
}
END_TEST

/*
 * With top_fit, a request of at least that size takes the top end of the
 * newest segment's highest free run, smaller ones still the lowest
 * position: large and small blocks fill memory from opposite ends.
 */
START_TEST(test_top_fit)
{
	struct gmlake_config cfg;
	struct gmlake_stats s0, s1;
	gmlake_ctx *ctx;
	char *base, *small, *small2, *big, *big2, *mid;
	size_t ch;

	th_config(&cfg, CAP_CHUNKS(32));
	cfg.top_fit = 16 * TH_MiB;
	ctx = th_ctx_cfg(&cfg);
	ch = th_chunk_size(ctx);
	ck_assert_uint_eq(ch, 2 * TH_MiB);
	base = th_alloc(ctx, 32 * ch, NULL);	/* one segment, then free */
	th_free(ctx, base);
	th_stats(ctx, &s0);
	small = th_alloc(ctx, 2 * ch, NULL);
	ck_assert_ptr_eq(small, base);
	big = th_alloc(ctx, 8 * ch, NULL);
	ck_assert_ptr_eq(big, base + 24 * ch);
	small2 = th_alloc(ctx, ch, NULL);
	ck_assert_ptr_eq(small2, base + 2 * ch);
	/* Below the threshold: the lowest free position, as ever. */
	mid = th_alloc(ctx, 7 * ch, NULL);
	ck_assert_ptr_eq(mid, base + 3 * ch);
	th_fill_ok(ctx, big, 8 * ch, 61, NULL);
	th_fill_ok(ctx, mid, 7 * ch, 62, NULL);
	/* The highest run is now [10, 24): a larger one takes its top. */
	big2 = th_alloc(ctx, 9 * ch, NULL);
	ck_assert_ptr_eq(big2, base + 15 * ch);
	th_stats(ctx, &s1);
	expect_no_driver_work(&s0, &s1);
	th_fill_ok(ctx, big2, 9 * ch, 63, NULL);
	th_verify_ok(ctx, big, 8 * ch, 61, NULL);
	th_verify_ok(ctx, mid, 7 * ch, 62, NULL);
	th_free(ctx, big);
	th_free(ctx, big2);
	th_free(ctx, mid);
	th_free(ctx, small);
	th_free(ctx, small2);
	th_destroy(ctx);
}
END_TEST

/*
 * By default (GMLAKE_TOP_FIT_AUTO) a request of at least a quarter of the
 * most ever requested at once takes the top of the highest free run;
 * smaller ones the lowest position, also after gmlake_stats_reset_peaks.
 * With top_fit 0 every request takes the lowest position.
 */
START_TEST(test_top_fit_auto)
{
	struct gmlake_config cfg;
	gmlake_ctx *ctx;
	char *base, *small, *big, *mid;
	size_t ch;

	for (int off = 0; off < 2; off++) {
		th_config(&cfg, CAP_CHUNKS(32));
		ck_assert_uint_eq(cfg.top_fit, GMLAKE_TOP_FIT_AUTO);
		if (off)
			cfg.top_fit = 0;
		ctx = th_ctx_cfg(&cfg);
		ch = th_chunk_size(ctx);
		/* The peak: 32 chunks, so a quarter is 8. */
		base = th_alloc(ctx, 32 * ch, NULL);
		th_free(ctx, base);
		small = th_alloc(ctx, 2 * ch, NULL);
		ck_assert_ptr_eq(small, base);
		mid = th_alloc(ctx, 7 * ch, NULL);	/* under a quarter */
		ck_assert_ptr_eq(mid, base + 2 * ch);
		big = th_alloc(ctx, 8 * ch, NULL);
		ck_assert_ptr_eq(big, off ? base + 9 * ch : base + 24 * ch);
		th_fill_ok(ctx, big, 8 * ch, 71, NULL);
		th_fill_ok(ctx, mid, 7 * ch, 72, NULL);
		th_verify_ok(ctx, big, 8 * ch, 71, NULL);
		th_free(ctx, big);
		th_free(ctx, mid);
		th_free(ctx, small);
		/* The user's reset of the peaks leaves the measure alone:
		 * 7 chunks are still under a quarter of the most ever. */
		TH_OK(ctx, gmlake_stats_reset_peaks(ctx));
		mid = th_alloc(ctx, 7 * ch, NULL);
		ck_assert_ptr_eq(mid, base);
		th_free(ctx, mid);
		/* A trim starts the measure again: after a phase of 16
		 * chunks, 4 are a quarter and take the top. */
		TH_OK(ctx, gmlake_trim(ctx));
		base = th_alloc(ctx, 16 * ch, NULL);
		th_free(ctx, base);
		small = th_alloc(ctx, 2 * ch, NULL);
		ck_assert_ptr_eq(small, base);
		big = th_alloc(ctx, 4 * ch, NULL);
		ck_assert_ptr_eq(big, off ? base + 2 * ch : base + 12 * ch);
		th_free(ctx, big);
		th_free(ctx, small);
		th_destroy(ctx);
	}
}
END_TEST

START_TEST(test_split_coalesce)
{
	static const int order[] = { 1, 3, 0, 2 };
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(32));
	struct gmlake_stats s0, s1;
	void *x, *q[4], *z;
	int i, j;

	x = th_alloc(ctx, 8 * TH_MiB, NULL);
	th_free(ctx, x);
	th_stats(ctx, &s0);
	for (i = 0; i < 4; i++) {
		q[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
		ck_assert_msg((uintptr_t)q[i] >= (uintptr_t)x &&
				      (uintptr_t)q[i] + 2 * TH_MiB <=
					      (uintptr_t)x + 8 * TH_MiB,
			      "piece %d at %p outside the free 8 MiB at %p",
			      i, q[i], x);
		for (j = 0; j < i; j++)
			ck_assert_ptr_ne(q[i], q[j]);
		th_fill_ok(ctx, q[i], 2 * TH_MiB, 60 + i, NULL);
	}
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.chunks.current, s0.chunks.current);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_map],
			  s0.calls[GMLAKE_CALL_mem_map]);
	ck_assert_uint_eq(s1.fits, s0.fits + 4);
	for (i = 0; i < 4; i++)
		th_verify_ok(ctx, q[i], 2 * TH_MiB, 60 + i, NULL);

	/* Freed out of order, the pieces coalesce into the 8 MiB again. */
	for (i = 0; i < 4; i++)
		th_free(ctx, q[order[i]]);
	z = th_alloc(ctx, 8 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_ptr_eq(z, x);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	ck_assert_uint_eq(s1.grows, s0.grows);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_map],
			  s0.calls[GMLAKE_CALL_mem_map]);
	ck_assert_int_eq(s1.chunks.current, s0.chunks.current);
	th_fill_ok(ctx, z, 8 * TH_MiB, 70, NULL);
	th_verify_ok(ctx, z, 8 * TH_MiB, 70, NULL);
	th_free(ctx, z);
	th_destroy(ctx);
}
END_TEST

/* A size that is no multiple of the chunk takes whole chunks; allocated
 * memory counts the bytes handed out (the size in 512-byte units, as
 * PyTorch counts), reserved memory the chunks. */
START_TEST(test_rounding)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(32));
	const size_t size = 3 * TH_MiB + 100;	/* 3 MiB + 512 handed out */
	struct gmlake_stats st;
	void *a, *b;

	a = th_alloc(ctx, size, NULL);
	b = th_alloc(ctx, size, NULL);
	ck_assert(!th_overlap(a, 4 * TH_MiB, b, 4 * TH_MiB));
	th_stats(ctx, &st);
	ck_assert_int_eq(st.requested_bytes.current, (int64_t)(2 * size));
	ck_assert_int_eq(st.allocated_bytes.current,
			 (int64_t)(2 * (3 * TH_MiB + 512)));
	ck_assert_int_eq(st.resident_bytes.current,
			 st.allocated_bytes.current);
	ck_assert_int_eq(st.reserved_bytes.current, (int64_t)(8 * TH_MiB));
	/* Past the bytes handed out is no part of the block. */
	ck_assert_int_eq(gmlake_free(ctx, (char *)a + 3 * TH_MiB + 512),
			 -EINVAL);
	th_fill_ok(ctx, a, size, 1, NULL);
	th_fill_ok(ctx, b, size, 2, NULL);
	th_verify_ok(ctx, a, size, 1, NULL);
	th_free(ctx, a);
	th_verify_ok(ctx, b, size, 2, NULL);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.allocated_bytes.current,
			 (int64_t)(3 * TH_MiB + 512));
	th_free(ctx, b);
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Stitching.                                                             */

/*
 * 16 blocks of one chunk on a 16-chunk device; the odd ones freed: 8 free
 * chunks, none adjacent to another. Returns the context; p[] the blocks.
 */
static gmlake_ctx *fragmented(void *p[16], size_t capacity_chunks)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(capacity_chunks));
	struct gmlake_stats st;
	int i;

	for (i = 0; i < 16; i++) {
		p[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
		th_fill_ok(ctx, p[i], 2 * TH_MiB, 100 + i, NULL);
	}
	th_stats(ctx, &st);
	ck_assert_int_eq(st.chunks.current, 16);
	ck_assert_int_eq(st.reserved_bytes.current, (int64_t)(32 * TH_MiB));
	for (i = 1; i < 16; i += 2)
		th_free(ctx, p[i]);
	return ctx;
}

static void verify_even(gmlake_ctx *ctx, void *p[16])
{
	int i;

	for (i = 0; i < 16; i += 2)
		th_verify_ok(ctx, p[i], 2 * TH_MiB, 100 + i, NULL);
}

/* The end of a fragmented() case: the even blocks kept their bytes, and
 * go with the context. */
static void fragmented_done(gmlake_ctx *ctx, void *p[16])
{
	verify_even(ctx, p);
	for (int i = 0; i < 16; i += 2)
		th_free(ctx, p[i]);
	th_destroy(ctx);
}

static void check_no_overlap_even(void *p[16], void *big, size_t size)
{
	int i;

	for (i = 0; i < 16; i += 2)
		ck_assert_msg(!th_overlap(p[i], 2 * TH_MiB, big, size),
			      "block %p+%zu overlaps live %p", big, size, p[i]);
}

START_TEST(test_stitch_fragmented)
{
	void *p[16], *big, *big2;
	struct gmlake_stats s0, s1;
	gmlake_ctx *ctx = fragmented(p, 16);
	int i;

	th_stats(ctx, &s0);
	big = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.chunks.current, 16);
	ck_assert_int_eq(s1.reserved_bytes.current, (int64_t)(32 * TH_MiB));
	ck_assert_uint_eq(s1.stitches, s0.stitches + 1);
	ck_assert_uint_eq(s1.grows, s0.grows);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_create],
			  s0.calls[GMLAKE_CALL_mem_create]);
	ck_assert_int_eq(s1.stitched_live.current, 1);
	check_no_overlap_even(p, big, 16 * TH_MiB);

	/* Real bytes behind the stitched range; no aliasing of neighbours. */
	th_fill_ok(ctx, big, 16 * TH_MiB, 999, NULL);
	th_verify_ok(ctx, big, 16 * TH_MiB, 999, NULL);
	verify_even(ctx, p);
	for (i = 0; i < 16; i += 2)
		th_fill_ok(ctx, p[i], 2 * TH_MiB, 100 + i, NULL);
	th_verify_ok(ctx, big, 16 * TH_MiB, 999, NULL);

	/* Freed and asked for again: the cached stitched range, no map. */
	th_free(ctx, big);
	th_stats(ctx, &s0);
	ck_assert_int_eq(s0.stitched_live.current, 0);
	big2 = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.stitch_reuses, s0.stitch_reuses + 1);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_map],
			  s0.calls[GMLAKE_CALL_mem_map]);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_create],
			  s0.calls[GMLAKE_CALL_mem_create]);
	ck_assert_int_eq(s1.chunks.current, 16);
	ck_assert_int_eq(s1.stitched_live.current, 1);
	check_no_overlap_even(p, big2, 16 * TH_MiB);
	th_fill_ok(ctx, big2, 16 * TH_MiB, 1000, NULL);
	th_verify_ok(ctx, big2, 16 * TH_MiB, 1000, NULL);
	verify_even(ctx, p);

	/*
	 * A smaller request: no free block of segments fits (the free
	 * chunks are apart), a free run of the cached range does.
	 */
	th_free(ctx, big2);
	th_stats(ctx, &s0);
	big = th_alloc(ctx, 8 * TH_MiB, NULL);
	th_fill_ok(ctx, big, 8 * TH_MiB, 1001, NULL);
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.chunks.current, 16);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_map],
			  s0.calls[GMLAKE_CALL_mem_map]);
	ck_assert_uint_eq(s1.stitch_reuses, s0.stitch_reuses + 1);
	th_verify_ok(ctx, big, 8 * TH_MiB, 1001, NULL);
	th_free(ctx, big);
	fragmented_done(ctx, p);
}
END_TEST

/*
 * Two request sizes taking turns with one cached view must not undo each
 * other's repair step after step: a request of another size that would
 * remap what the view's last repair remapped stitches a view of its own,
 * which its next turn then reuses with no driver call.
 */
START_TEST(test_repair_other_size_stitches)
{
	void *p[16], *t[8], *big, *x, *y, *six;
	struct gmlake_stats s0, s1;
	gmlake_ctx *ctx = fragmented(p, 32);
	int i;

	/* V: the 8 odd chunks, positions 0-7. x takes position 3 (p[7]'s
	 * chunk, fourth in first-fit order). */
	big = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_free(ctx, big);
	for (i = 0; i < 3; i++)
		t[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
	x = th_alloc(ctx, 2 * TH_MiB, NULL);
	for (i = 0; i < 3; i++)
		th_free(ctx, t[i]);

	/* 8 chunks repair V: position 3 gets a new chunk G. */
	th_stats(ctx, &s0);
	big = th_alloc_filled(ctx, 16 * TH_MiB, 1, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.stitch_repairs, s0.stitch_repairs + 1);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	th_free(ctx, big);
	th_free(ctx, x);

	/* y takes G: first fit gives the 8 free chunks of the first
	 * segment (p[7]'s now outside V) before it. */
	for (i = 0; i < 8; i++)
		t[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
	y = th_alloc_filled(ctx, 2 * TH_MiB, 2, NULL);
	for (i = 0; i < 8; i++)
		th_free(ctx, t[i]);

	/* 6 chunks: every window of V holds position 3, which the repair
	 * for 8 remapped: a stitch of its own, not a repair. */
	th_stats(ctx, &s0);
	six = th_alloc_filled(ctx, 12 * TH_MiB, 3, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.stitch_repairs, s0.stitch_repairs);
	ck_assert_uint_eq(s1.stitches, s0.stitches + 1);
	th_check(ctx);
	th_verify_ok(ctx, y, 2 * TH_MiB, 2, NULL);
	th_verify_ok(ctx, six, 12 * TH_MiB, 3, NULL);

	/* Its next turn reuses that view: no driver call. */
	th_free(ctx, six);
	th_stats(ctx, &s0);
	six = th_alloc_filled(ctx, 12 * TH_MiB, 4, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.stitch_reuses, s0.stitch_reuses + 1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_map), 0);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_unmap), 0);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_set_access), 0);
	th_verify_free(ctx, six, 12 * TH_MiB, 4, NULL);
	th_verify_free(ctx, y, 2 * TH_MiB, 2, NULL);
	fragmented_done(ctx, p);
}
END_TEST

/*
 * A cached stitched range whose chunk went to another block must not be
 * handed out: its tail would alias that block.
 */
START_TEST(test_stitch_cache_no_alias)
{
	void *p[16], *big, *small, *big2;
	gmlake_ctx *ctx = fragmented(p, 24);

	big = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_fill_ok(ctx, big, 16 * TH_MiB, 7, NULL);
	th_free(ctx, big);

	/* One chunk of the cached range goes to a 2 MiB block. */
	small = th_alloc(ctx, 2 * TH_MiB, NULL);
	th_fill_ok(ctx, small, 2 * TH_MiB, 8, NULL);

	big2 = th_alloc(ctx, 16 * TH_MiB, NULL);
	ck_assert(!th_overlap(big2, 16 * TH_MiB, small, 2 * TH_MiB));
	check_no_overlap_even(p, big2, 16 * TH_MiB);
	th_fill_ok(ctx, big2, 16 * TH_MiB, 9, NULL);
	th_verify_ok(ctx, small, 2 * TH_MiB, 8, NULL);
	verify_even(ctx, p);
	th_verify_ok(ctx, big2, 16 * TH_MiB, 9, NULL);

	th_free(ctx, small);
	th_free(ctx, big2);
	fragmented_done(ctx, p);
}
END_TEST

/* Not enough free chunks: grow only the shortfall and stitch. */
START_TEST(test_grow_shortfall)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(16));
	struct gmlake_stats s0, s1;
	void *p[4], *big;
	int i;

	for (i = 0; i < 4; i++) {
		p[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
		th_fill_ok(ctx, p[i], 2 * TH_MiB, 200 + i, NULL);
	}
	th_free(ctx, p[0]);
	th_free(ctx, p[2]);
	th_stats(ctx, &s0);
	ck_assert_int_eq(s0.chunks.current, 4);

	big = th_alloc(ctx, 8 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_msg(s1.chunks.current == 6,
		      "8 MiB with 2 free chunks: %" PRId64 " chunks, not 6",
		      s1.chunks.current);
	ck_assert_uint_eq(s1.grows, s0.grows + 1);
	ck_assert_int_eq(s1.reserved_bytes.current, (int64_t)(12 * TH_MiB));
	ck_assert(!th_overlap(big, 8 * TH_MiB, p[1], 2 * TH_MiB));
	ck_assert(!th_overlap(big, 8 * TH_MiB, p[3], 2 * TH_MiB));
	th_fill_ok(ctx, big, 8 * TH_MiB, 210, NULL);
	th_verify_ok(ctx, p[1], 2 * TH_MiB, 201, NULL);
	th_verify_ok(ctx, p[3], 2 * TH_MiB, 203, NULL);
	th_verify_ok(ctx, big, 8 * TH_MiB, 210, NULL);
	th_free(ctx, big);
	th_free(ctx, p[1]);
	th_free(ctx, p[3]);
	th_destroy(ctx);
}
END_TEST

/*
 * A request the free run at the end of the newest segment cannot hold
 * grows the segment there, within the budget: the block starts in that
 * run and runs on into the new chunks, with no new range and no stitch.
 */
START_TEST(test_grow_at_end)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(16));
	struct gmlake_stats s0, s1;
	void *a, *b, *c;

	a = th_alloc(ctx, 4 * TH_MiB, NULL);
	b = th_alloc(ctx, 4 * TH_MiB, NULL);
	ck_assert_ptr_eq(b, (char *)a + 4 * TH_MiB);
	th_fill_ok(ctx, a, 4 * TH_MiB, 220, NULL);
	th_free(ctx, b);
	th_stats(ctx, &s0);
	c = th_alloc(ctx, 8 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_ptr_eq(c, b);
	ck_assert_int_eq(s1.chunks.current, s0.chunks.current + 2);
	ck_assert_uint_eq(s1.grows, s0.grows + 1);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_va_reserve],
			  s0.calls[GMLAKE_CALL_va_reserve]);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_map],
			  s0.calls[GMLAKE_CALL_mem_map] + 2);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_set_access],
			  s0.calls[GMLAKE_CALL_set_access] + 1);
	th_fill_ok(ctx, c, 8 * TH_MiB, 221, NULL);
	th_verify_ok(ctx, a, 4 * TH_MiB, 220, NULL);
	th_verify_ok(ctx, c, 8 * TH_MiB, 221, NULL);
	th_free(ctx, c);
	/* Freed, the end's run is whole again: one block over all of it. */
	c = th_alloc(ctx, 8 * TH_MiB, NULL);
	ck_assert_ptr_eq(c, b);
	th_free(ctx, c);
	th_free(ctx, a);
	th_destroy(ctx);
}
END_TEST

/* A context whose growth handles are four chunks. */
/* Slabs of grow_handle; every request by first fit (top_fit off): the
 * tests place blocks by position. */
static gmlake_ctx *slab_ctx_grow(size_t capacity, size_t grow_handle)
{
	struct gmlake_config cfg;

	th_config(&cfg, capacity);
	cfg.grow_handle = grow_handle;
	cfg.top_fit = 0;
	return th_ctx_cfg(&cfg);
}

static gmlake_ctx *slab_ctx(size_t capacity)
{
	return slab_ctx_grow(capacity, 4 * TH_CHUNK);
}

/*
 * A chunk released while its unmap failed leaves its position mapped, the
 * memory held by the mapping. An allocation that needs that memory climbs
 * the pressure ladder, whose first rung unmaps the position again: it must
 * not take a trim for the memory to come back.
 */
START_TEST(test_failed_unmap_retried_under_pressure)
{
	struct gml_emu_info info;
	gmlake_ctx *ctx;
	void *p;

	if (!th_env_is_emu())
		return;		/* the emulated device's size, and its faults */
	ctx = slab_ctx_grow(8 * TH_CHUNK, TH_CHUNK);
	p = th_alloc(ctx, 8 * TH_CHUNK, NULL);
	th_free(ctx, p);
	gml_dev_fail_nth(th_dev(ctx), GMLAKE_CALL_mem_unmap, 1, EIO);
	gmlake_trim(ctx);	/* seven chunks go, one keeps its mapping */
	gml_dev_fail_nth(th_dev(ctx), -1, 0, 0);
	th_emu_info(ctx, &info);
	ck_assert_uint_eq(info.live_handles, 0);
	ck_assert_uint_eq(info.live_mappings, 1);
	ck_assert_uint_eq(info.used, TH_CHUNK);
	p = th_alloc_filled(ctx, 8 * TH_CHUNK, 5, NULL);
	th_verify_free(ctx, p, 8 * TH_CHUNK, 5, NULL);
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/*
 * The debug log of a request that raised peak reserved counts the free
 * chunks left in growth handles blocks hold part of, which no stitch can
 * map: here the middle two of a 4-chunk handle whose ends two blocks
 * hold.
 */
START_TEST(test_peak_slack_held_slab)
{
	struct gmlake_config cfg;
	struct th_capture cap;
	gmlake_ctx *ctx;
	void *x, *w, *y1, *m, *y2, *z;
	char *text;

	th_config(&cfg, CAP_CHUNKS(32));
	cfg.grow_handle = 4 * TH_CHUNK;
	cfg.log_level = GMLAKE_LOG_DEBUG;
	cfg.top_fit = 0;	/* positions by first fit */
	ctx = th_ctx_cfg(&cfg);
	x = th_alloc(ctx, 4 * TH_CHUNK, NULL);
	w = th_alloc(ctx, 4 * TH_CHUNK, NULL);
	th_free(ctx, x);
	y1 = th_alloc(ctx, TH_CHUNK, NULL);
	m = th_alloc(ctx, 2 * TH_CHUNK, NULL);
	y2 = th_alloc(ctx, TH_CHUNK, NULL);
	ck_assert_ptr_eq(y1, x);	/* the premise: x's handle, in order */
	ck_assert_ptr_eq(y2, (char *)x + 3 * TH_CHUNK);
	th_free(ctx, m);
	th_capture_begin(&cap, STDERR_FILENO);
	z = th_alloc(ctx, 8 * TH_CHUNK, NULL);
	text = th_capture_end(&cap);
	ck_assert_msg(strstr(text, "raised reserved to 32 MiB with 2 free "
			      "chunks left (0 in cached stitched ranges, ") &&
		      strstr(text, "2 in growth handles blocks hold part "
			     "of)"), "stderr: %s", text);
	free(text);
	th_free(ctx, z);
	th_free(ctx, y2);
	th_free(ctx, y1);
	th_free(ctx, w);
	th_destroy(ctx);
}
END_TEST

/* Reserved memory, in chunks. */
static int64_t reserved_chunks(gmlake_ctx *ctx)
{
	struct gmlake_stats st;

	th_stats(ctx, &st);
	return st.reserved_bytes.current / (int64_t)TH_CHUNK;
}

/*
 * Growth for a block takes growth handles (slabs), mapped whole, and
 * chunks for the rest: one create, map and handle covered by set-access
 * per slab. Their chunks split by first fit; sizes up to a chunk mean
 * chunks, and a size past 1024 chunks is taken as 1024.
 */
START_TEST(test_slab_growth)
{
	gmlake_ctx *ctx = slab_ctx(CAP_CHUNKS(64));
	struct gmlake_config cfg;
	struct gmlake_stats s0, s1;
	void *a, *b, *x, *y;

	th_stats(ctx, &s0);
	a = th_alloc_filled(ctx, 10 * TH_CHUNK, 1, NULL);   /* 4 + 4 + 1 + 1 */
	th_stats(ctx, &s1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 4);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_map), 4);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_set_access), 1);
	ck_assert_uint_eq(s1.access_handles - s0.access_handles, 4);
	ck_assert_uint_eq(s1.access_bytes - s0.access_bytes, 10 * TH_CHUNK);
	ck_assert_int_eq(s1.chunks.current - s0.chunks.current, 10);
	th_check(ctx);
	/* Freed, its slabs split like chunks: no driver call. */
	th_verify_free(ctx, a, 10 * TH_CHUNK, 1, NULL);
	th_stats(ctx, &s0);
	x = th_alloc_filled(ctx, 3 * TH_CHUNK, 2, NULL);
	y = th_alloc_filled(ctx, 3 * TH_CHUNK, 3, NULL);
	b = th_alloc_filled(ctx, 4 * TH_CHUNK, 4, NULL);
	th_stats(ctx, &s1);
	expect_no_driver_work(&s0, &s1);
	ck_assert_ptr_eq(x, a);
	ck_assert_ptr_eq(y, (char *)a + 3 * TH_CHUNK);
	th_check(ctx);
	th_verify_free(ctx, x, 3 * TH_CHUNK, 2, NULL);
	th_verify_free(ctx, y, 3 * TH_CHUNK, 3, NULL);
	th_verify_free(ctx, b, 4 * TH_CHUNK, 4, NULL);
	TH_OK(ctx, gmlake_trim(ctx));
	ck_assert_int_eq(reserved_chunks(ctx), 0);
	th_destroy(ctx);

	/* 0 and sizes up to a chunk: growth by chunks. */
	th_config(&cfg, CAP_CHUNKS(16));
	cfg.grow_handle = TH_CHUNK + TH_CHUNK / 2;	/* one chunk, rounded */
	ctx = th_ctx_cfg(&cfg);
	th_stats(ctx, &s0);
	a = th_alloc_filled(ctx, 4 * TH_CHUNK, 5, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 4);
	ck_assert_uint_eq(s1.access_handles - s0.access_handles, 4);
	th_verify_free(ctx, a, 4 * TH_CHUNK, 5, NULL);
	th_destroy(ctx);
	/* More than 1024 chunks: 1024 (with 4 KiB chunks, the default's 20
	 * MiB would be 5120). Only the emulated device has 4 KiB chunks: a
	 * GPU keeps its granularity (2 MiB), where 1030 pages are 2 chunks. */
	th_config(&cfg, 64 * TH_MiB);
	cfg.emu_granularity = 4096;
	cfg.small_size = 4096;
	cfg.grow_handle = 1025 * 4096;
	ctx = th_ctx_cfg(&cfg);
	if (th_is_emu(ctx)) {
		ck_assert_uint_eq(th_chunk_size(ctx), 4096);
		th_stats(ctx, &s0);
		a = th_alloc_filled(ctx, 1030 * 4096, 6, NULL);
		th_stats(ctx, &s1);
		ck_assert_uint_eq(calls_between(&s0, &s1,
						GMLAKE_CALL_mem_create), 7);
		th_verify_free(ctx, a, 1030 * 4096, 6, NULL);
	}
	th_destroy(ctx);
	th_config(&cfg, 64 * TH_MiB);
	cfg.emu_granularity = 4096;
	cfg.small_size = 4096;
	ctx = th_ctx_cfg(&cfg);		/* the default 20 MiB */
	a = th_alloc_filled(ctx, 1030 * 4096, 7, NULL);
	th_verify_free(ctx, a, 1030 * 4096, 7, NULL);
	th_destroy(ctx);
}
END_TEST

/* n chunks filled with seed, which must take one new stitch; the
 * readings before and after into *s0 and *s1. */
static void *alloc_stitching(gmlake_ctx *ctx, size_t n, uint64_t seed,
			     struct gmlake_stats *s0, struct gmlake_stats *s1)
{
	void *p;

	th_stats(ctx, s0);
	p = th_alloc_filled(ctx, n * TH_CHUNK, seed, NULL);
	th_stats(ctx, s1);
	ck_assert_uint_eq(s1->stitches, s0->stitches + 1);
	return p;
}

/*
 * A stitch maps a free slab whole, one mapping; a slab partly taken goes
 * in only at an end of the view, mapped whole, its free positions in the
 * block and its taken ones outside (the shortfall grows); its taken
 * chunks keep it from the driver at a trim until the last one is free.
 */
START_TEST(test_slab_stitch)
{
	gmlake_ctx *ctx = slab_ctx(CAP_CHUNKS(64));
	struct gmlake_stats s0, s1;
	void *a, *b, *c, *d, *e, *f, *x;

	a = th_alloc_filled(ctx, 4 * TH_CHUNK, 1, NULL);	/* a slab */
	b = th_alloc_filled(ctx, 1 * TH_CHUNK, 2, NULL);	/* a chunk */
	c = th_alloc_filled(ctx, 4 * TH_CHUNK, 3, NULL);	/* a slab */
	d = th_alloc_filled(ctx, 1 * TH_CHUNK, 4, NULL);	/* a chunk */
	ck_assert_ptr_eq(c, (char *)a + 5 * TH_CHUNK);
	ck_assert_int_eq(reserved_chunks(ctx), 10);
	th_verify_free(ctx, a, 4 * TH_CHUNK, 1, NULL);
	th_verify_free(ctx, c, 4 * TH_CHUNK, 3, NULL);

	/* 8 chunks: the two free slabs, stitched. */
	e = alloc_stitching(ctx, 8, 5, &s0, &s1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 0);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_map), 2);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_set_access), 1);
	ck_assert_uint_eq(s1.access_handles - s0.access_handles, 2);
	th_check(ctx);
	th_verify_free(ctx, e, 8 * TH_CHUNK, 5, NULL);

	/* Half of a's slab taken: the stitch takes c's slab and the free
	 * top of a's, and grows two chunks (before: a slab of four). Maps:
	 * the two slabs, and each new chunk in its segment and the view. */
	x = th_alloc_filled(ctx, 2 * TH_CHUNK, 6, NULL);
	ck_assert_ptr_eq(x, a);
	f = alloc_stitching(ctx, 8, 7, &s0, &s1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 2);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_map), 6);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_set_access), 2);
	ck_assert_int_eq(reserved_chunks(ctx), 12);
	th_check(ctx);
	th_verify_ok(ctx, x, 2 * TH_CHUNK, 6, NULL);
	th_verify_free(ctx, f, 8 * TH_CHUNK, 7, NULL);

	/* Trim: every slab all free goes, with the views over it; a's
	 * stays while x holds part of it. */
	TH_OK(ctx, gmlake_trim(ctx));
	ck_assert_int_eq(reserved_chunks(ctx), 6);
	th_check(ctx);
	th_verify_free(ctx, x, 2 * TH_CHUNK, 6, NULL);
	TH_OK(ctx, gmlake_trim(ctx));
	ck_assert_int_eq(reserved_chunks(ctx), 2);
	th_verify_free(ctx, b, 1 * TH_CHUNK, 2, NULL);
	th_verify_free(ctx, d, 1 * TH_CHUNK, 4, NULL);
	TH_OK(ctx, gmlake_trim(ctx));
	ck_assert_int_eq(reserved_chunks(ctx), 0);
	th_destroy(ctx);
}
END_TEST

/*
 * Slabs A and C with two chunks taken in each, A's free at its bottom and
 * C's at its top: a block of four stitches C's free top and A's free
 * bottom, each slab mapped whole at an end of the view, with no new
 * memory, and the blocks in the slabs keep their bytes. nth > 0: that
 * mem_map or set_access call fails (_i), and the request fails or
 * grows instead, nothing lost.
 */
static void slab_ends_case(int call, uint64_t nth, bool *fired)
{
	gmlake_ctx *ctx = slab_ctx(CAP_CHUNKS(64));
	struct gmlake_stats s0, s1;
	struct th_slab_ends l;
	void *e = NULL;
	uint64_t before;
	int ret;

	th_slab_ends(ctx, &l);	/* A: bottom free; C: top free */
	before = th_dev(ctx)->call_failures[call];
	if (nth)
		gml_dev_fail_nth(th_dev(ctx), call, nth, EIO);
	th_stats(ctx, &s0);
	ret = gmlake_alloc(ctx, &e, 4 * TH_CHUNK, NULL);
	th_stats(ctx, &s1);
	*fired = th_dev(ctx)->call_failures[call] > before;
	gml_dev_fail_nth(th_dev(ctx), -1, 0, 0);
	if (!nth) {
		ck_assert_int_eq(ret, 0);
		ck_assert_uint_eq(s1.stitches, s0.stitches + 1);
		ck_assert_uint_eq(calls_between(&s0, &s1,
						GMLAKE_CALL_mem_create), 0);
		ck_assert_uint_eq(calls_between(&s0, &s1,
						GMLAKE_CALL_mem_map), 2);
		ck_assert_uint_eq(calls_between(&s0, &s1,
						GMLAKE_CALL_set_access), 1);
		ck_assert_int_eq(reserved_chunks(ctx), 10);
	}
	if (ret)
		e = NULL;
	th_check(ctx);
	if (e)
		th_fill_ok(ctx, e, 4 * TH_CHUNK, 8, NULL);
	th_verify_ok(ctx, l.y, 2 * TH_CHUNK, 6, NULL);
	th_verify_ok(ctx, l.z, 2 * TH_CHUNK, 7, NULL);
	if (e)
		th_verify_free(ctx, e, 4 * TH_CHUNK, 8, NULL);
	th_verify_free(ctx, l.y, 2 * TH_CHUNK, 6, NULL);
	th_verify_free(ctx, l.z, 2 * TH_CHUNK, 7, NULL);
	th_verify_free(ctx, l.b, 1 * TH_CHUNK, 2, NULL);
	th_verify_free(ctx, l.d, 1 * TH_CHUNK, 4, NULL);
	th_check(ctx);
	TH_OK(ctx, gmlake_trim(ctx));
	ck_assert_int_eq(reserved_chunks(ctx), 0);
	th_destroy(ctx);
}

START_TEST(test_slab_stitch_ends)
{
	static const int calls[] = {
		GMLAKE_CALL_mem_map, GMLAKE_CALL_set_access,
	};
	bool fired;
	uint64_t nth;

	slab_ends_case(calls[_i], 0, &fired);
	for (nth = 1; nth <= 4; nth++) {
		slab_ends_case(calls[_i], nth, &fired);
		if (!fired)
			break;
	}
	ck_assert_msg(nth > 1, "%s never failed", gmlake_call_name(calls[_i]));
}
END_TEST

/*
 * A failing driver call while a slab is made or stitched: the request
 * fails or takes chunks, nothing leaks, the invariants hold. _i: the
 * call kind; nth from 1 while the fault fires.
 */
START_TEST(test_slab_faults)
{
	static const int calls[] = {
		GMLAKE_CALL_mem_create, GMLAKE_CALL_mem_map,
		GMLAKE_CALL_set_access, GMLAKE_CALL_mem_unmap,
		GMLAKE_CALL_mem_release,
	};

	uint64_t nth;

	for (nth = 1; nth <= 8; nth++) {
		gmlake_ctx *ctx = slab_ctx(CAP_CHUNKS(64));
		struct gmlake_stats st;
		void *a, *b, *c, *e;
		uint64_t before;
		bool fired;

		a = th_alloc_filled(ctx, 4 * TH_CHUNK, 1, NULL);
		b = th_alloc_filled(ctx, TH_CHUNK, 2, NULL);
		c = th_alloc_filled(ctx, 4 * TH_CHUNK, 3, NULL);
		th_free(ctx, a);
		th_free(ctx, c);
		before = th_dev(ctx)->call_failures[calls[_i]];
		gml_dev_fail_nth(th_dev(ctx), calls[_i], nth,
				 calls[_i] == GMLAKE_CALL_mem_create ? ENOMEM :
								       EIO);
		e = NULL;
		if (gmlake_alloc(ctx, &e, 10 * TH_CHUNK, NULL))
			e = NULL;	/* a stitch and a growth */
		if (e)
			th_fill_ok(ctx, e, 10 * TH_CHUNK, 4, NULL);
		if (e)
			th_free(ctx, e);
		gmlake_trim(ctx);	/* may fail: the fault is armed */
		fired = th_dev(ctx)->call_failures[calls[_i]] > before;
		gml_dev_fail_nth(th_dev(ctx), -1, 0, 0);
		th_check(ctx);
		e = th_alloc_filled(ctx, 10 * TH_CHUNK, 5, NULL);
		th_verify_free(ctx, e, 10 * TH_CHUNK, 5, NULL);
		TH_OK(ctx, gmlake_trim(ctx));
		th_stats(ctx, &st);
		ck_assert_msg(st.reserved_bytes.current == (int64_t)TH_CHUNK,
			      "%s nth %" PRIu64 ": %" PRId64 " bytes reserved "
			      "with one chunk live", gmlake_call_name(calls[_i]),
			      nth, st.reserved_bytes.current);
		th_verify_free(ctx, b, TH_CHUNK, 2, NULL);
		th_destroy(ctx);
		if (!fired)
			break;
	}
	ck_assert_msg(nth > 1, "%s never failed", gmlake_call_name(calls[_i]));
}
END_TEST

/* A block a repair layout leaves live around its cached view. */
struct held {
	void *p;
	size_t size;
	uint64_t seed;
};

static void *hold(gmlake_ctx *ctx, struct held *h, size_t chunks,
		  uint64_t seed)
{
	*h = (struct held){ th_alloc_filled(ctx, chunks * TH_CHUNK, seed, NULL),
			    chunks * TH_CHUNK, seed };
	return h->p;
}

/*
 * Slabs A, C and F free, a stitched view over A and C cached, then part
 * of A taken: the layout of a step whose shapes moved. Returns the view's
 * address; h[0] is the block in A, h[1..3] the single chunks between.
 */
static void *slab_view_broken(gmlake_ctx *ctx, struct held *h)
{
	struct gmlake_stats s0, s1;
	void *a, *c, *e, *f;

	a = th_alloc_filled(ctx, 4 * TH_CHUNK, 1, NULL);	/* A 0-3 */
	hold(ctx, &h[1], 1, 2);
	c = th_alloc_filled(ctx, 4 * TH_CHUNK, 3, NULL);	/* C 5-8 */
	hold(ctx, &h[2], 1, 4);
	f = th_alloc_filled(ctx, 4 * TH_CHUNK, 5, NULL);	/* F 10-13 */
	hold(ctx, &h[3], 1, 6);
	ck_assert_int_eq(reserved_chunks(ctx), 15);
	th_free(ctx, a);
	th_free(ctx, c);
	e = alloc_stitching(ctx, 8, 7, &s0, &s1);	/* over A and C */
	th_free(ctx, e);
	th_free(ctx, f);
	ck_assert_ptr_eq(hold(ctx, &h[0], 2, 8), a);
	return e;
}

/*
 * A cached view whose slab another block took part of is repaired by
 * swapping that slab whole for a free one (one unmap, one map, one
 * set-access), not stitched anew; data in both stays intact.
 */
START_TEST(test_slab_repair)
{
	gmlake_ctx *ctx = slab_ctx(CAP_CHUNKS(64));
	struct gmlake_stats s0, s1;
	struct held h[4];
	void *x, *e, *p, *y, *z;

	e = slab_view_broken(ctx, h);
	x = h[0].p;
	th_stats(ctx, &s0);
	p = th_alloc_filled(ctx, 8 * TH_CHUNK, 9, NULL);
	th_stats(ctx, &s1);
	ck_assert_ptr_eq(p, e);
	ck_assert_uint_eq(s1.stitch_repairs, s0.stitch_repairs + 1);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 0);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_unmap), 1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_map), 1);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_set_access), 1);
	ck_assert_uint_eq(s1.access_handles - s0.access_handles, 1);
	ck_assert_int_eq(reserved_chunks(ctx), 15);
	th_check(ctx);
	th_verify_ok(ctx, x, 2 * TH_CHUNK, 8, NULL);
	th_verify_free(ctx, p, 8 * TH_CHUNK, 9, NULL);

	/* The view maps F and C now. A taken whole and part of C: no free
	 * slab is left outside the view, so the next 8 chunks stitch F and
	 * growth instead. */
	th_free(ctx, x);
	y = th_alloc_filled(ctx, 4 * TH_CHUNK, 10, NULL);
	z = th_alloc_filled(ctx, 2 * TH_CHUNK, 11, NULL);
	ck_assert_ptr_eq(y, x);
	ck_assert_ptr_eq(z, (char *)x + 5 * TH_CHUNK);
	p = alloc_stitching(ctx, 8, 12, &s0, &s1);
	ck_assert_uint_eq(s1.stitch_repairs, s0.stitch_repairs);
	ck_assert_ptr_ne(p, e);
	th_check(ctx);
	th_verify_free(ctx, p, 8 * TH_CHUNK, 12, NULL);
	th_verify_free(ctx, y, 4 * TH_CHUNK, 10, NULL);
	th_verify_free(ctx, z, 2 * TH_CHUNK, 11, NULL);
	for (int i = 1; i < 4; i++)
		th_verify_free(ctx, h[i].p, h[i].size, h[i].seed, NULL);
	th_destroy(ctx);
}
END_TEST

/*
 * A driver failure at each call number of one kind while an 8-chunk
 * request repairs the layout's cached view: the request fails or is
 * served another way, the view goes, nothing leaks, and the blocks the
 * layout holds keep their data. nholds: how many it holds.
 */
static void repair_fault_walk(gmlake_ctx *(*make)(void),
			      void *(*layout)(gmlake_ctx *, struct held *),
			      int nholds, int call)
{
	uint64_t nth;

	for (nth = 1; nth <= 4; nth++) {
		gmlake_ctx *ctx = make();
		struct held h[5];
		uint64_t before;
		bool fired;
		void *p;

		(void)layout(ctx, h);
		before = th_dev(ctx)->call_failures[call];
		gml_dev_fail_nth(th_dev(ctx), call, nth, EIO);
		if (gmlake_alloc(ctx, &p, 8 * TH_CHUNK, NULL))
			p = NULL;
		if (p) {
			th_fill_ok(ctx, p, 8 * TH_CHUNK, 9, NULL);
			th_free(ctx, p);
		}
		fired = th_dev(ctx)->call_failures[call] > before;
		gml_dev_fail_nth(th_dev(ctx), -1, 0, 0);
		th_check(ctx);
		for (int i = 0; i < nholds; i++)
			th_verify_ok(ctx, h[i].p, h[i].size, h[i].seed, NULL);
		p = th_alloc_filled(ctx, 8 * TH_CHUNK, 11, NULL);
		th_verify_free(ctx, p, 8 * TH_CHUNK, 11, NULL);
		for (int i = 0; i < nholds; i++)
			th_verify_free(ctx, h[i].p, h[i].size, h[i].seed, NULL);
		TH_OK(ctx, gmlake_trim(ctx));
		ck_assert_int_eq(reserved_chunks(ctx), 0);
		th_destroy(ctx);
		if (!fired)
			break;
	}
	ck_assert_msg(nth > 1, "%s never failed", gmlake_call_name(call));
}

static gmlake_ctx *slab4_ctx(void)
{
	return slab_ctx(CAP_CHUNKS(64));
}

/* A driver failure in each call of a slab swap. */
START_TEST(test_slab_repair_faults)
{
	static const int calls[] = {
		GMLAKE_CALL_mem_unmap, GMLAKE_CALL_mem_map,
		GMLAKE_CALL_set_access,
	};

	repair_fault_walk(slab4_ctx, slab_view_broken, 4, calls[_i]);
}
END_TEST

/*
 * Slabs of 2 chunks A, C, D, E with taken single chunks h[1..4] between
 * them; a stitched view over the four slabs, cached; then h[0] takes A's
 * first chunk. No free slab is left outside the view: its repair must
 * remap A's positions to single chunks. Returns the view.
 */
static void *slab_view_short(gmlake_ctx *ctx, struct held *h)
{
	struct gmlake_stats s0, s1;
	void *big[4], *e;

	for (int i = 0; i < 4; i++) {
		big[i] = th_alloc_filled(ctx, 2 * TH_CHUNK, 20 + i, NULL);
		hold(ctx, &h[1 + i], 1, 30 + i);
	}
	ck_assert_int_eq(reserved_chunks(ctx), 12);
	for (int i = 0; i < 4; i++)
		th_free(ctx, big[i]);
	e = alloc_stitching(ctx, 8, 40, &s0, &s1);	/* the four slabs */
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 0);
	th_free(ctx, e);
	ck_assert_ptr_eq(hold(ctx, &h[0], 1, 41), big[0]);
	return e;
}

static gmlake_ctx *slab2_ctx(void)
{
	return slab_ctx_grow(CAP_CHUNKS(64), 2 * TH_CHUNK);
}

/*
 * A cached view needs a slab swapped but no free slab is left: that
 * slab's positions are remapped to single chunks (grown here, none being
 * free), one unmap and a map per chunk, where a new stitch would map the
 * whole view; the request gets the view's address again.
 */
START_TEST(test_slab_repair_singles)
{
	gmlake_ctx *ctx = slab2_ctx();
	struct gmlake_stats s0, s1;
	struct held h[5];
	void *e, *p;

	e = slab_view_short(ctx, h);
	th_stats(ctx, &s0);
	p = th_alloc_filled(ctx, 8 * TH_CHUNK, 42, NULL);
	th_stats(ctx, &s1);
	ck_assert_ptr_eq(p, e);
	ck_assert_uint_eq(s1.stitch_repairs, s0.stitch_repairs + 1);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_create), 2);
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_mem_unmap), 1);
	/* One set-access where the new chunks grew (their segment), one over
	 * the view's remapped run: two handles each. */
	ck_assert_uint_eq(calls_between(&s0, &s1, GMLAKE_CALL_set_access), 2);
	ck_assert_uint_eq(s1.access_handles - s0.access_handles, 4);
	th_check(ctx);
	th_verify_free(ctx, p, 8 * TH_CHUNK, 42, NULL);
	for (int i = 0; i < 5; i++)
		th_verify_free(ctx, h[i].p, h[i].size, h[i].seed, NULL);
	th_check(ctx);
	TH_OK(ctx, gmlake_trim(ctx));
	ck_assert_int_eq(reserved_chunks(ctx), 0);
	th_destroy(ctx);
}
END_TEST

/* A driver failure in each call of that repair, the growth's create too. */
START_TEST(test_slab_repair_singles_faults)
{
	static const int calls[] = {
		GMLAKE_CALL_mem_create, GMLAKE_CALL_mem_unmap,
		GMLAKE_CALL_mem_map, GMLAKE_CALL_set_access,
	};

	repair_fault_walk(slab2_ctx, slab_view_short, 5, calls[_i]);
}
END_TEST

/* The whole device in one block after fragmentation, then pieces again. */
START_TEST(test_stitch_whole_device)
{
	void *p[16], *big;
	gmlake_ctx *ctx = fragmented(p, 16);
	int i;

	big = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_free(ctx, big);
	for (i = 0; i < 16; i += 2)
		th_free(ctx, p[i]);
	/* Everything free, one cached stitched range: all 32 MiB at once. */
	big = th_alloc(ctx, 32 * TH_MiB, NULL);
	th_fill_ok(ctx, big, 32 * TH_MiB, 1, NULL);
	th_verify_ok(ctx, big, 32 * TH_MiB, 1, NULL);
	th_free(ctx, big);
	for (i = 0; i < 16; i++) {
		p[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
		th_fill_ok(ctx, p[i], 2 * TH_MiB, 300 + i, NULL);
	}
	for (i = 0; i < 16; i++)
		th_verify_ok(ctx, p[i], 2 * TH_MiB, 300 + i, NULL);
	for (i = 0; i < 16; i++)
		th_free(ctx, p[i]);
	big = th_alloc(ctx, 10 * TH_MiB, NULL);
	th_free(ctx, big);
	big = th_alloc(ctx, 22 * TH_MiB, NULL);
	th_free(ctx, big);
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Out of memory.                                                         */

static void expect_oom(gmlake_ctx *ctx, size_t size)
{
	struct gmlake_stats s0, s1;
	void *p = NULL;
	int ret;

	th_stats(ctx, &s0);
	ret = gmlake_alloc(ctx, &p, size, NULL);
	ck_assert_msg(ret == -ENOMEM, "alloc %zu: %d, expected -ENOMEM",
		      size, ret);
	th_check(ctx);
	ck_assert_str_ne(gmlake_last_error(), "");
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.ooms, s0.ooms + 1);
	ck_assert_int_eq(s1.active_blocks.current, s0.active_blocks.current);
	ck_assert_int_eq(s1.requested_bytes.current,
			 s0.requested_bytes.current);
	ck_assert_int_eq(s1.allocated_bytes.current,
			 s0.allocated_bytes.current);
	ck_assert_int_eq(s1.stitched_live.current, s0.stitched_live.current);
}

START_TEST(test_oom_full)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(8));
	void *a, *b[8];
	int i;

	a = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_fill_ok(ctx, a, 16 * TH_MiB, 1, NULL);
	expect_oom(ctx, 2 * TH_MiB);
	expect_oom(ctx, 4096);		/* no chunk left for small blocks */
	expect_oom(ctx, 16 * TH_MiB);
	th_verify_ok(ctx, a, 16 * TH_MiB, 1, NULL);
	th_free(ctx, a);

	/* Recovery: the device is whole again. */
	for (i = 0; i < 8; i++) {
		b[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
		th_fill_ok(ctx, b[i], 2 * TH_MiB, 10 + i, NULL);
	}
	expect_oom(ctx, 1);
	for (i = 0; i < 8; i++)
		th_verify_ok(ctx, b[i], 2 * TH_MiB, 10 + i, NULL);
	for (i = 0; i < 8; i += 2)
		th_free(ctx, b[i]);
	expect_oom(ctx, 10 * TH_MiB);	/* 8 MiB free, fragmented */
	a = th_alloc(ctx, 8 * TH_MiB, NULL);	/* stitched */
	th_fill_ok(ctx, a, 8 * TH_MiB, 2, NULL);
	for (i = 1; i < 8; i += 2)
		th_verify_ok(ctx, b[i], 2 * TH_MiB, 10 + i, NULL);
	th_free(ctx, a);
	for (i = 1; i < 8; i += 2)
		th_free(ctx, b[i]);
	a = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_free(ctx, a);
	th_destroy(ctx);
}
END_TEST

START_TEST(test_oom_absurd)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(8));
	struct gmlake_stats st;
	void *a;

	expect_oom(ctx, SIZE_MAX);
	expect_oom(ctx, SIZE_MAX / 2);
	expect_oom(ctx, SIZE_MAX - 4095);
	expect_oom(ctx, (size_t)1 << 62);
	expect_oom(ctx, CAP_CHUNKS(8) + 1);
	expect_oom(ctx, CAP_CHUNKS(9));
	th_stats(ctx, &st);
	ck_assert_int_le(st.reserved_bytes.current, (int64_t)CAP_CHUNKS(8));
	/* Whatever it kept, the whole device is still there to use. */
	a = th_alloc(ctx, CAP_CHUNKS(8), NULL);
	th_fill_ok(ctx, a, CAP_CHUNKS(8), 3, NULL);
	th_verify_ok(ctx, a, CAP_CHUNKS(8), 3, NULL);
	expect_oom(ctx, SIZE_MAX);
	th_free(ctx, a);
	th_destroy(ctx);
}
END_TEST

/* Small blocks until the device is full; freed, their chunks come back. */
START_TEST(test_oom_small)
{
	enum { MAX = 4096 };
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(4));
	void **p = calloc(MAX, sizeof(*p));
	int n, i, ret = 0;
	void *big;

	ck_assert_ptr_nonnull(p);
	for (n = 0; n < MAX; n++) {
		ret = gmlake_alloc(ctx, &p[n], 64 * TH_KiB, NULL);
		if (ret)
			break;
	}
	ck_assert_msg(ret == -ENOMEM, "small alloc %d: %d", n, ret);
	th_check(ctx);
	printf("%d blocks of 64 KiB on an 8 MiB device\n", n);
	ck_assert_int_ge(n, 64);	/* at least half the device usable */
	ck_assert_int_le(n, 128);
	th_fill_ok(ctx, p[0], 64 * TH_KiB, 1, NULL);
	th_fill_ok(ctx, p[n - 1], 64 * TH_KiB, 2, NULL);
	expect_oom(ctx, 2 * TH_MiB);
	th_verify_ok(ctx, p[0], 64 * TH_KiB, 1, NULL);
	th_verify_ok(ctx, p[n - 1], 64 * TH_KiB, 2, NULL);
	for (i = 0; i < n; i++)
		th_free(ctx, p[i]);
	/* Empty small chunks must go back for a large block. */
	big = th_alloc(ctx, CAP_CHUNKS(4), NULL);
	th_fill_ok(ctx, big, CAP_CHUNKS(4), 3, NULL);
	th_free(ctx, big);
	free(p);
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Misuse: documented errors, no crash, state intact.                     */

START_TEST(test_bad_free)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(32));
	void *big, *sm, *other;
	size_t sz;
	int local = 0;

	big = th_alloc(ctx, 4 * TH_MiB, NULL);
	sm = th_alloc(ctx, 1000, NULL);
	other = th_alloc(ctx, 3000, NULL);
	th_fill_ok(ctx, big, 4 * TH_MiB, 1, NULL);
	th_fill_ok(ctx, sm, 1000, 2, NULL);
	th_fill_ok(ctx, other, 3000, 3, NULL);

	TH_OK(ctx, gmlake_free(ctx, NULL));
	TH_ERR(ctx, gmlake_free(ctx, &local), -EINVAL);
	TH_ERR(ctx, gmlake_free(ctx, (void *)(uintptr_t)4096), -EINVAL);
	TH_ERR(ctx, gmlake_free(ctx, (char *)big + 512), -EINVAL);
	TH_ERR(ctx, gmlake_free(ctx, (char *)big + 2 * TH_MiB), -EINVAL);
	TH_ERR(ctx, gmlake_free(ctx, (char *)big + 4 * TH_MiB - 512),
	       -EINVAL);
	TH_ERR(ctx, gmlake_free(ctx, (char *)big + 1), -EINVAL);
	TH_ERR(ctx, gmlake_free(ctx, (char *)sm + 1), -EINVAL);
	TH_ERR(ctx, gmlake_free(ctx, (char *)sm + 512), -EINVAL);
	TH_ERR(ctx, gmlake_free(ctx, (char *)other + 2048), -EINVAL);
	ck_assert_str_ne(gmlake_last_error(), "");
	TH_ERR(ctx, gmlake_block_size(ctx, (char *)big + 512, &sz), -EINVAL);
	TH_ERR(ctx, gmlake_block_size(ctx, &local, &sz), -EINVAL);
	TH_ERR(ctx, gmlake_block_size(ctx, (char *)sm + 512, &sz), -EINVAL);
	TH_ERR(ctx, gmlake_record_stream(ctx, &local, NULL), -EINVAL);
	TH_ERR(ctx, gmlake_record_stream(ctx, (char *)big + 512, NULL),
	       -EINVAL);
	TH_OK(ctx, gmlake_record_stream(ctx, big, NULL));

	/* Nothing was freed by the bad calls. */
	th_verify_ok(ctx, big, 4 * TH_MiB, 1, NULL);
	th_verify_ok(ctx, sm, 1000, 2, NULL);
	th_verify_ok(ctx, other, 3000, 3, NULL);
	TH_OK(ctx, gmlake_block_size(ctx, big, &sz));
	ck_assert_uint_eq(sz, 4 * TH_MiB);

	/* Double frees. */
	th_free(ctx, big);
	TH_ERR(ctx, gmlake_free(ctx, big), -EINVAL);
	TH_ERR(ctx, gmlake_block_size(ctx, big, &sz), -EINVAL);
	TH_ERR(ctx, gmlake_record_stream(ctx, big, NULL), -EINVAL);
	th_free(ctx, sm);
	TH_ERR(ctx, gmlake_free(ctx, sm), -EINVAL);
	th_verify_ok(ctx, other, 3000, 3, NULL);

	/* Still works. */
	big = th_alloc(ctx, 4 * TH_MiB, NULL);
	th_fill_ok(ctx, big, 4 * TH_MiB, 4, NULL);
	th_verify_ok(ctx, big, 4 * TH_MiB, 4, NULL);
	th_free(ctx, big);
	th_free(ctx, other);
	TH_ERR(ctx, gmlake_free(ctx, other), -EINVAL);
	th_destroy(ctx);
}
END_TEST

START_TEST(test_bad_args)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(32));
	void *p = (void *)(uintptr_t)0x1234;
	size_t sz;

	ck_assert_int_eq(gmlake_alloc(NULL, &p, 4096, NULL), -EINVAL);
	ck_assert_int_eq(gmlake_free(NULL, p), -EINVAL);
	ck_assert_int_eq(gmlake_block_size(NULL, p, &sz), -EINVAL);
	ck_assert_int_eq(gmlake_record_stream(NULL, p, NULL), -EINVAL);
	ck_assert_int_eq(gmlake_trim(NULL), -EINVAL);
	ck_assert_int_eq(gmlake_ctx_destroy(NULL, false), 0);	/* as free */
	ck_assert_int_eq(gmlake_ctx_init(NULL, NULL), -EINVAL);
	TH_ERR(ctx, gmlake_alloc(ctx, NULL, 4096, NULL), -EINVAL);
	TH_ERR(ctx, gmlake_alloc(ctx, NULL, 4 * TH_MiB, NULL), -EINVAL);
	TH_ERR(ctx, gmlake_alloc(ctx, &p, 0, NULL), -EINVAL);
	TH_ERR(ctx, gmlake_alloc(ctx, &p, SIZE_MAX, NULL), -ENOMEM);
	TH_ERR(ctx, gmlake_alloc(ctx, &p, SIZE_MAX / 2, NULL), -ENOMEM);
	TH_ERR(ctx, gmlake_alloc(ctx, &p, SIZE_MAX / 2 + 1, NULL), -ENOMEM);
	{
		struct gmlake_stats st;

		th_stats(ctx, &st);
		ck_assert_int_eq(st.active_blocks.current, 0);
		ck_assert_int_eq(st.requested_bytes.current, 0);
		ck_assert_uint_eq(st.frees, 0);
	}
	p = th_alloc(ctx, 4096, NULL);
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/* Streams the context does not know (emulated device: it can tell). */
START_TEST(test_bad_stream)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(32));
	gmlake_ctx *ctx2 = th_ctx(CAP_CHUNKS(8));
	gmlake_stream_t bogus = (gmlake_stream_t)(uintptr_t)0xdeadbee0;
	gmlake_stream_t other = th_stream(ctx2), dead = th_stream(ctx);
	void *p = NULL, *q;

	TH_OK(ctx, gmlake_stream_destroy(ctx, dead));
	TH_ERR(ctx, gmlake_alloc(ctx, &p, 4 * TH_MiB, bogus), -EINVAL);
	{
		/* The message says it once, with its cause after it. */
		const char *m = gmlake_last_error(), *at;

		at = strstr(m, "cannot be used: ");
		ck_assert_msg(at && !strstr(at + 1, "cannot be used"),
			      "message repeats itself: %s", m);
		ck_assert_msg(strlen(at) > strlen("cannot be used: "),
			      "no cause: %s", m);
	}
	TH_ERR(ctx, gmlake_alloc(ctx, &p, 4096, bogus), -EINVAL);
	TH_ERR(ctx, gmlake_alloc(ctx, &p, 4 * TH_MiB, other), -EINVAL);
	TH_ERR(ctx, gmlake_alloc(ctx, &p, 4096, other), -EINVAL);
	TH_ERR(ctx, gmlake_alloc(ctx, &p, 4 * TH_MiB, dead), -EINVAL);
	q = th_alloc(ctx, 4 * TH_MiB, NULL);
	TH_ERR(ctx, gmlake_record_stream(ctx, q, bogus), -EINVAL);
	TH_ERR(ctx, gmlake_record_stream(ctx, q, other), -EINVAL);
	th_fill_ok(ctx, q, 4 * TH_MiB, 5, NULL);
	th_free(ctx, q);
	TH_OK(ctx, gmlake_stream_destroy(ctx2, other));
	th_destroy(ctx2);
	th_destroy(ctx);
}
END_TEST

/* A pointer from another context is no block of this one. */
START_TEST(test_foreign_pointer)
{
	gmlake_ctx *a = th_ctx(CAP_CHUNKS(16));
	gmlake_ctx *b = th_ctx(CAP_CHUNKS(16));
	void *pa, *pb, *sb;
	size_t sz;

	pa = th_alloc(a, 4 * TH_MiB, NULL);
	pb = th_alloc(b, 4 * TH_MiB, NULL);
	sb = th_alloc(b, 100, NULL);
	th_fill_ok(a, pa, 4 * TH_MiB, 1, NULL);
	th_fill_ok(b, pb, 4 * TH_MiB, 2, NULL);
	th_fill_ok(b, sb, 100, 3, NULL);
	TH_ERR(a, gmlake_free(a, pb), -EINVAL);
	TH_ERR(a, gmlake_free(a, sb), -EINVAL);
	TH_ERR(a, gmlake_block_size(a, pb, &sz), -EINVAL);
	TH_ERR(b, gmlake_free(b, pa), -EINVAL);
	th_check(b);
	th_verify_ok(a, pa, 4 * TH_MiB, 1, NULL);
	th_verify_ok(b, pb, 4 * TH_MiB, 2, NULL);
	th_verify_ok(b, sb, 100, 3, NULL);
	th_free(b, pb);
	th_free(b, sb);
	th_free(a, pa);
	th_destroy(a);
	th_destroy(b);
}
END_TEST

START_TEST(test_destroy_busy)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(16));
	void *p = th_alloc(ctx, 4 * TH_MiB, NULL);
	void *s = th_alloc(ctx, 64, NULL);

	th_fill_ok(ctx, p, 4 * TH_MiB, 1, NULL);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, false), -EBUSY);
	th_check(ctx);
	th_verify_ok(ctx, p, 4 * TH_MiB, 1, NULL);
	th_free(ctx, p);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, false), -EBUSY);
	th_check(ctx);
	th_free(ctx, s);
	th_destroy(ctx);
}
END_TEST

/* Forced destroy with live blocks leaves nothing of the device behind. */
START_TEST(test_destroy_force)
{
	int fds = th_count_fds(), maps = th_count_memfd_maps();
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(16));
	gmlake_stream_t s = th_stream(ctx);
	void *p[16], *big;
	int i;

	for (i = 0; i < 16; i++)
		p[i] = th_alloc(ctx, i % 3 ? 2 * TH_MiB : 4000, s);
	for (i = 1; i < 16; i += 2)
		th_free(ctx, p[i]);
	big = th_alloc(ctx, 8 * TH_MiB, s);
	th_fill_ok(ctx, big, 8 * TH_MiB, 1, s);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
	ck_assert_int_eq(th_count_fds(), fds);
	ck_assert_int_eq(th_count_memfd_maps(), maps);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Many threads on one context.                                           */

#define TW_THREADS 8
#define TW_LIVE 6
#define TW_ITER 150

struct tw {
	gmlake_ctx *ctx;
	int id;
	int ooms;
	int ops;
	char err[256];
};

static void *tw_main(void *arg)
{
	struct tw *t = arg;
	struct th_rng r = { 0x1000 + (uint64_t)t->id };
	struct blk b[TW_LIVE];
	gmlake_stream_t s = NULL;
	int n = 0, i, ret;
	size_t diff = 0;

	ret = gmlake_stream_create(t->ctx, &s);
	if (ret) {
		snprintf(t->err, sizeof(t->err), "stream_create: %d", ret);
		return NULL;
	}
	for (i = 0; i < TW_ITER; i++) {
		if (n < TW_LIVE && (n == 0 || th_range(&r, 0, 1))) {
			size_t size = th_range(&r, 0, 9) < 6 ?
				th_range(&r, 16, 64 * TH_KiB) :
				th_range(&r, TH_MiB, 4 * TH_MiB);
			void *p = NULL;

			ret = gmlake_alloc(t->ctx, &p, size, s);
			if (ret == -ENOMEM) {
				t->ooms++;
				continue;
			}
			if (ret || !p || (uintptr_t)p % 512) {
				snprintf(t->err, sizeof(t->err),
					 "alloc %zu: %d %p", size, ret, p);
				break;
			}
			b[n].p = p;
			b[n].size = size;
			b[n].seed = ((uint64_t)t->id << 32) + (uint64_t)i;
			ret = th_fill(t->ctx, p, size, b[n].seed, s);
			if (ret) {
				snprintf(t->err, sizeof(t->err),
					 "fill: %d", ret);
				break;
			}
			n++;
		} else {
			int j = (int)th_range(&r, 0, n - 1);

			ret = th_verify(t->ctx, b[j].p, b[j].size, b[j].seed,
					s, &diff);
			if (ret) {
				snprintf(t->err, sizeof(t->err),
					 "block %p+%zu: verify %d at %zu",
					 b[j].p, b[j].size, ret, diff);
				break;
			}
			ret = gmlake_free(t->ctx, b[j].p);
			if (ret) {
				snprintf(t->err, sizeof(t->err),
					 "free %p: %d", b[j].p, ret);
				break;
			}
			b[j] = b[--n];
		}
		t->ops++;
	}
	for (i = 0; i < n; i++) {
		ret = th_verify(t->ctx, b[i].p, b[i].size, b[i].seed, s,
				&diff);
		if (ret && !t->err[0])
			snprintf(t->err, sizeof(t->err),
				 "block %p+%zu: verify %d at %zu at the end",
				 b[i].p, b[i].size, ret, diff);
		ret = gmlake_free(t->ctx, b[i].p);
		if (ret && !t->err[0])
			snprintf(t->err, sizeof(t->err), "free: %d", ret);
	}
	ret = gmlake_stream_destroy(t->ctx, s);
	if (ret && !t->err[0])
		snprintf(t->err, sizeof(t->err), "stream_destroy: %d", ret);
	return NULL;
}

START_TEST(test_threads)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(96));
	struct tw t[TW_THREADS];
	pthread_t tid[TW_THREADS];
	struct gmlake_stats st;
	int i, ops = 0, ooms = 0;

	for (i = 0; i < TW_THREADS; i++) {
		memset(&t[i], 0, sizeof(t[i]));
		t[i].ctx = ctx;
		t[i].id = i;
		ck_assert_int_eq(pthread_create(&tid[i], NULL, tw_main, &t[i]),
				 0);
	}
	/* The checker takes the context's lock: run it while they work. */
	for (i = 0; i < 200; i++) {
		th_check(ctx);
		usleep(1000);
	}
	for (i = 0; i < TW_THREADS; i++)
		ck_assert_int_eq(pthread_join(tid[i], NULL), 0);
	for (i = 0; i < TW_THREADS; i++) {
		ck_assert_msg(!t[i].err[0], "thread %d: %s", i, t[i].err);
		ops += t[i].ops;
		ooms += t[i].ooms;
	}
	th_check(ctx);
	th_stats(ctx, &st);
	printf("%d threads: %d ops, %d ooms, %" PRIu64 " stitches, %" PRIu64
	       " cross-stream waits\n", TW_THREADS, ops, ooms, st.stitches,
	       st.cross_stream_waits);
	ck_assert_int_eq(st.active_blocks.current, 0);
	ck_assert_int_eq(st.requested_bytes.current, 0);
	ck_assert_int_eq(st.allocated_bytes.current, 0);
	ck_assert_uint_ge(st.frees, (uint64_t)ops / 2);
	TH_OK(ctx, gmlake_trim(ctx));
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Trim and leaks.                                                        */

START_TEST(test_trim)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(32));
	struct gml_emu_info i0, i1, i2;
	struct gmlake_stats s0, s1;
	void *big[8], *keep, *sm[10], *st;
	int i;

	th_emu_info(ctx, &i0);
	for (i = 0; i < 8; i++)
		big[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
	keep = th_alloc(ctx, 4 * TH_MiB, NULL);
	th_fill_ok(ctx, keep, 4 * TH_MiB, 1, NULL);
	for (i = 0; i < 10; i++) {
		sm[i] = th_alloc(ctx, 4096, NULL);
		th_fill_ok(ctx, sm[i], 4096, 10 + i, NULL);
	}
	/* A cached stitched range too. */
	for (i = 0; i < 8; i += 2)
		th_free(ctx, big[i]);
	st = th_alloc(ctx, 8 * TH_MiB, NULL);
	th_free(ctx, st);
	for (i = 1; i < 8; i += 2)
		th_free(ctx, big[i]);

	th_stats(ctx, &s0);
	th_emu_info(ctx, &i1);
	ck_assert_int_ge(s0.reserved_bytes.current, (int64_t)(20 * TH_MiB));
	ck_assert_uint_eq(i1.used, (uint64_t)s0.reserved_bytes.current);

	TH_OK(ctx, gmlake_trim(ctx));
	th_stats(ctx, &s1);
	th_emu_info(ctx, &i2);
	ck_assert_int_eq(s1.reserved_bytes.current,
			 (int64_t)(4 * TH_MiB) +
				 s1.small_chunks.current *
					 (int64_t)s1.chunk_size);
	ck_assert_int_eq(s1.chunks.current, 2 + s1.small_chunks.current);
	ck_assert_int_ge(s1.small_chunks.current, 1);
	ck_assert_int_eq(s1.stitched_cached.current, 0);
	ck_assert_uint_gt(s1.releases, s0.releases);
	ck_assert_uint_eq(i2.used, (uint64_t)s1.reserved_bytes.current);
	ck_assert_uint_lt(i2.used, i1.used);
	ck_assert_uint_eq(i2.live_handles, (uint64_t)s1.chunks.current);

	th_verify_ok(ctx, keep, 4 * TH_MiB, 1, NULL);
	for (i = 0; i < 10; i++)
		th_verify_ok(ctx, sm[i], 4096, 10 + i, NULL);
	/* Trimmed, it grows again. */
	big[0] = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_fill_ok(ctx, big[0], 16 * TH_MiB, 2, NULL);
	th_verify_ok(ctx, keep, 4 * TH_MiB, 1, NULL);
	th_free(ctx, big[0]);

	th_free(ctx, keep);
	for (i = 0; i < 10; i++)
		th_free(ctx, sm[i]);
	TH_OK(ctx, gmlake_trim(ctx));
	th_stats(ctx, &s1);
	th_emu_info(ctx, &i2);
	ck_assert_int_eq(s1.reserved_bytes.current, 0);
	ck_assert_int_eq(s1.chunks.current, 0);
	ck_assert_int_eq(s1.small_chunks.current, 0);
	ck_assert_int_eq(s1.mapped_bytes.current, 0);
	ck_assert_uint_eq(i2.used, 0);
	ck_assert_uint_eq(i2.live_handles, 0);
	ck_assert_uint_eq(i2.live_mappings, 0);
	ck_assert_uint_le(i2.live_reservations, i0.live_reservations);
	th_destroy(ctx);
}
END_TEST

/* A full life on the device, then nothing left before destroy. */
START_TEST(test_no_leak)
{
	int fds = th_count_fds(), maps = th_count_memfd_maps();
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(48));
	struct gml_emu_info info, i0;

	th_emu_info(ctx, &i0);
	random_workload(99, CAP_CHUNKS(48));	/* its own context */
	{
		gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
		void *p[16], *big;
		int i;

		for (i = 0; i < 16; i++)
			p[i] = th_alloc(ctx, i % 4 ? 2 * TH_MiB : 5000,
					i % 2 ? a : b);
		for (i = 1; i < 16; i += 2)
			th_free(ctx, p[i]);
		th_sync(ctx, a);
		big = th_alloc(ctx, 6 * TH_MiB, b);
		th_free(ctx, big);
		for (i = 0; i < 16; i += 2)
			th_free(ctx, p[i]);
		th_sync(ctx, b);
		TH_OK(ctx, gmlake_stream_destroy(ctx, a));
		TH_OK(ctx, gmlake_stream_destroy(ctx, b));
	}
	TH_OK(ctx, gmlake_trim(ctx));
	th_emu_info(ctx, &info);
	ck_assert_uint_eq(info.live_handles, 0);
	ck_assert_uint_eq(info.live_mappings, 0);
	ck_assert_uint_eq(info.used, 0);
	ck_assert_uint_le(info.live_reservations, i0.live_reservations);
	ck_assert_uint_le(info.live_streams, i0.live_streams);
	printf("live events after trim: %" PRIu64 " (%" PRIu64 " at the "
	       "start)\n", info.live_events, i0.live_events);
	th_destroy(ctx);
	ck_assert_int_eq(th_count_fds(), fds);
	ck_assert_int_eq(th_count_memfd_maps(), maps);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Statistics.                                                            */

START_TEST(test_stats_gauges)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(32));
	struct gmlake_stats s0, s1;
	void *p, *q;

	th_stats(ctx, &s0);
	ck_assert_uint_eq(s0.version, GMLAKE_STATS_VERSION);
	ck_assert_uint_eq(s0.size, sizeof(s0));
	ck_assert_uint_eq(s0.chunk_size, TH_CHUNK);
	ck_assert_int_eq(s0.requested_bytes.current, 0);
	ck_assert_int_eq(s0.active_blocks.current, 0);
	ck_assert_uint_eq(s0.allocs, 0);

	p = th_alloc(ctx, 1000, NULL);
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.requested_bytes.current, 1000);
	ck_assert_int_ge(s1.allocated_bytes.current, 1000);
	ck_assert_int_ge(s1.reserved_bytes.current,
			 s1.allocated_bytes.current);
	ck_assert_int_eq(s1.active_blocks.current, 1);
	ck_assert_uint_eq(s1.allocs, 1);

	th_stats(ctx, &s0);
	q = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.requested_bytes.current, 1000 + 16 * TH_MiB);
	ck_assert_int_ge(s1.allocated_bytes.current, 1000 + 16 * TH_MiB);
	ck_assert_int_ge(s1.reserved_bytes.current,
			 s1.allocated_bytes.current);
	ck_assert_int_ge(s1.mapped_bytes.current, (int64_t)(16 * TH_MiB));
	ck_assert_int_eq(s1.active_blocks.current, 2);
	ck_assert_int_eq(s1.chunks.current, s0.chunks.current + 8);
	ck_assert_uint_eq(s1.grows, s0.grows + 1);
	/* Driver calls counted; one set_access per mapped range. */
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_create],
			  s0.calls[GMLAKE_CALL_mem_create] + 8);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_mem_map],
			  s0.calls[GMLAKE_CALL_mem_map] + 8);
	/* Growth maps at the end of the segment's reserved range. */
	ck_assert_uint_le(s1.calls[GMLAKE_CALL_va_reserve],
			  s0.calls[GMLAKE_CALL_va_reserve] + 1);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_set_access],
			  s0.calls[GMLAKE_CALL_set_access] + 1);
	ck_assert_uint_ge(s1.access_bytes, s0.access_bytes + 16 * TH_MiB);

	th_free(ctx, q);
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.requested_bytes.current, 1000);
	ck_assert_int_eq(s1.requested_bytes.peak, 1000 + 16 * TH_MiB);
	ck_assert_int_ge(s1.requested_bytes.total, 1000 + 16 * TH_MiB);
	ck_assert_int_ge(s1.allocated_bytes.peak, 1000 + 16 * TH_MiB);
	ck_assert_int_eq(s1.active_blocks.peak, 2);
	ck_assert_uint_eq(s1.frees, 1);
	ck_assert_int_ge(s1.reserved_bytes.current, (int64_t)(16 * TH_MiB));

	TH_OK(ctx, gmlake_stats_reset_peaks(ctx));
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.requested_bytes.peak, s1.requested_bytes.current);
	ck_assert_int_eq(s1.allocated_bytes.peak, s1.allocated_bytes.current);
	ck_assert_int_eq(s1.reserved_bytes.peak, s1.reserved_bytes.current);
	ck_assert_int_eq(s1.mapped_bytes.peak, s1.mapped_bytes.current);
	ck_assert_int_eq(s1.active_blocks.peak, 1);
	ck_assert_int_eq(s1.chunks.peak, s1.chunks.current);
	/* Totals are not peaks: they stay. */
	ck_assert_int_ge(s1.requested_bytes.total, 1000 + 16 * TH_MiB);

	th_free(ctx, p);
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.requested_bytes.current, 0);
	ck_assert_int_eq(s1.allocated_bytes.current, 0);
	ck_assert_int_eq(s1.active_blocks.current, 0);
	ck_assert_int_eq(s1.requested_bytes.peak, 1000);
	th_destroy(ctx);
}
END_TEST

START_TEST(test_stats_bad_version)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(8));
	struct gmlake_stats st;

	memset(&st, 0, sizeof(st));
	st.size = sizeof(st);
	st.version = GMLAKE_STATS_VERSION + 1;
	ck_assert_int_eq(gmlake_stats_get(ctx, &st), -EINVAL);
	st.version = 0;
	ck_assert_int_eq(gmlake_stats_get(ctx, &st), -EINVAL);
	st.version = GMLAKE_STATS_VERSION;
	st.size = sizeof(st) - 8;
	ck_assert_int_eq(gmlake_stats_get(ctx, &st), -EINVAL);
	st.size = sizeof(st) + 8;
	ck_assert_int_eq(gmlake_stats_get(ctx, &st), -EINVAL);
	st.size = 0;
	ck_assert_int_eq(gmlake_stats_get(ctx, &st), -EINVAL);
	ck_assert_int_eq(gmlake_stats_get(ctx, NULL), -EINVAL);
	st.size = sizeof(st);
	ck_assert_int_eq(gmlake_stats_get(NULL, &st), -EINVAL);
	ck_assert_int_eq(gmlake_stats_get(ctx, &st), 0);
	ck_assert_int_eq(gmlake_stats_reset_peaks(NULL), -EINVAL);
	th_destroy(ctx);
}
END_TEST

/* Nothing but whitespace after the last '}', braces balanced. */
static void check_json_object(const char *s)
{
	int depth = 0, closed = 0;
	bool str = false, esc = false;
	const char *c;

	while (*s == ' ' || *s == '\n' || *s == '\t')
		s++;
	ck_assert_msg(*s == '{', "JSON does not start with '{': %.40s", s);
	for (c = s; *c; c++) {
		if (str) {
			if (esc)
				esc = false;
			else if (*c == '\\')
				esc = true;
			else if (*c == '"')
				str = false;
			continue;
		}
		if (closed) {
			ck_assert_msg(*c == ' ' || *c == '\n' || *c == '\t',
				      "text after the JSON object: %.40s", c);
			continue;
		}
		if (*c == '"')
			str = true;
		else if (*c == '{' || *c == '[')
			depth++;
		else if (*c == '}' || *c == ']')
			closed = --depth == 0;
		ck_assert_int_ge(depth, 0);
	}
	ck_assert_msg(closed && !str, "JSON object not closed");
}

START_TEST(test_stats_print)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(16));
	void *p[16], *big;
	char *text, *json;
	int i;

	for (i = 0; i < 16; i++)
		p[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
	for (i = 1; i < 16; i += 2)
		th_free(ctx, p[i]);
	big = th_alloc(ctx, 16 * TH_MiB, NULL);
	text = th_stats_text(ctx, false);
	json = th_stats_text(ctx, true);
	ck_assert_msg(strlen(text) > 20, "text: '%s'", text);
	ck_assert_msg(strstr(text, "stitch"), "no stitch count in '%s'", text);
	check_json_object(json);
	ck_assert_msg(strstr(json, "\"stitches\""), "json: %s", json);
	ck_assert_msg(strstr(json, "\"mem_map\""), "json: %s", json);
	ck_assert_msg(strstr(json, "\"allocs\""), "json: %s", json);
	ck_assert_int_lt(gmlake_stats_print(ctx, -1, false), 0);
	ck_assert_int_lt(gmlake_stats_print(ctx, -1, true), 0);
	ck_assert_int_eq(gmlake_stats_print(NULL, 1, false), -EINVAL);
	free(text);
	free(json);
	th_free(ctx, big);
	for (i = 0; i < 16; i += 2)
		th_free(ctx, p[i]);
	th_destroy(ctx);
}
END_TEST

START_TEST(test_names_versions)
{
	const char *seen[GMLAKE_CALL_COUNT];
	int i, j;

	for (i = 0; i < GMLAKE_CALL_COUNT; i++) {
		seen[i] = gmlake_call_name(i);
		ck_assert_ptr_nonnull(seen[i]);
		for (j = 0; j < i; j++)
			ck_assert_str_ne(seen[i], seen[j]);
	}
	ck_assert_str_eq(gmlake_call_name(GMLAKE_CALL_mem_map), "mem_map");
	ck_assert_str_eq(gmlake_call_name(GMLAKE_CALL_event_query),
			 "event_query");
	ck_assert_ptr_null(gmlake_call_name(-1));
	ck_assert_ptr_null(gmlake_call_name(GMLAKE_CALL_COUNT));
	ck_assert_int_eq(gmlake_version_major(), GMLAKE_VERSION_MAJOR);
	ck_assert_int_eq(gmlake_version_minor(), GMLAKE_VERSION_MINOR);
	ck_assert(gmlake_check_version(GMLAKE_VERSION_MAJOR,
				       GMLAKE_VERSION_MINOR));
	ck_assert(gmlake_check_version(0, 0));
	ck_assert(!gmlake_check_version(GMLAKE_VERSION_MAJOR,
					GMLAKE_VERSION_MINOR + 1));
	ck_assert(!gmlake_check_version(GMLAKE_VERSION_MAJOR + 1, 0));
}
END_TEST

/* ---------------------------------------------------------------------- */

static Suite *alloc_suite(bool emu)
{
	Suite *s = suite_create("alloc");
	TCase *tc;

	tc = th_tcase(s, "Integrity");
	tcase_add_loop_test(tc, test_random_workload, 0, 3);
	tcase_add_test(tc, test_fill_all_verify_all);

	tc = th_tcase(s, "Small");
	tcase_add_test(tc, test_small_packing);
	tcase_add_test(tc, test_small_and_large_mixed);
	tcase_add_test(tc, test_small_idle_chunk);

	tc = th_tcase(s, "Fit");
	tcase_add_test(tc, test_first_fit);
	tcase_add_test(tc, test_long_lived);
	tcase_add_test(tc, test_long_lived_past_holes);
	tcase_add_loop_test(tc, test_grow_slack, 0, 3);
	tcase_add_test(tc, test_grow_slack_bad);
	tcase_add_loop_test(tc, test_pack, 0, 3);
	tcase_add_test(tc, test_pack_streams);
	tcase_add_test(tc, test_pack_whole_after_align);
	tcase_add_loop_test(tc, test_long_lived_faults, 0, 5);
	tcase_add_loop_test(tc, test_long_lived_free_faults, 0, 4);
	tcase_add_test(tc, test_top_fit);
	tcase_add_test(tc, test_top_fit_auto);
	tcase_add_test(tc, test_split_coalesce);
	tcase_add_test(tc, test_rounding);

	tc = th_tcase(s, "Stitch");
	tcase_add_test(tc, test_stitch_fragmented);
	tcase_add_test(tc, test_stitch_cache_no_alias);
	tcase_add_test(tc, test_repair_other_size_stitches);
	tcase_add_test(tc, test_grow_shortfall);
	tcase_add_test(tc, test_grow_at_end);
	tcase_add_test(tc, test_slab_growth);
	tcase_add_test(tc, test_peak_slack_held_slab);
	tcase_add_test(tc, test_slab_stitch);
	tcase_add_loop_test(tc, test_slab_stitch_ends, 0, 2);
	tcase_add_test(tc, test_slab_repair);
	tcase_add_loop_test(tc, test_slab_repair_faults, 0, 3);
	tcase_add_test(tc, test_slab_repair_singles);
	tcase_add_loop_test(tc, test_slab_repair_singles_faults, 0, 4);
	tcase_add_loop_test(tc, test_slab_faults, 0, 5);
	if (emu)
		tcase_add_test(tc, test_stitch_whole_device);

	if (emu) {
		tc = th_tcase(s, "OOM");
		tcase_add_test(tc, test_oom_full);
		tcase_add_test(tc, test_oom_absurd);
		tcase_add_test(tc, test_oom_small);
		tcase_add_test(tc, test_failed_unmap_retried_under_pressure);
	}

	tc = th_tcase(s, "Misuse");
	tcase_add_test(tc, test_bad_free);
	tcase_add_test(tc, test_bad_args);
	if (emu)
		tcase_add_test(tc, test_bad_stream);
	tcase_add_test(tc, test_foreign_pointer);
	tcase_add_test(tc, test_destroy_busy);
	if (emu)
		tcase_add_test(tc, test_destroy_force);

	tc = th_tcase(s, "Threads");
	tcase_add_test(tc, test_threads);

	if (emu) {
		tc = th_tcase(s, "Trim");
		tcase_add_test(tc, test_trim);
		tcase_add_test(tc, test_no_leak);
	}

	tc = th_tcase(s, "Stats");
	tcase_add_test(tc, test_stats_gauges);
	tcase_add_test(tc, test_stats_bad_version);
	tcase_add_test(tc, test_stats_print);
	tcase_add_test(tc, test_names_versions);
	return s;
}

int main(void)
{
	int probe = th_probe();

	if (probe)
		return probe;
	return th_run_suite(alloc_suite(th_env_is_emu()));
}
