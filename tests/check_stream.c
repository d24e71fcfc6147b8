/* SPDX-License-Identifier: MIT */
/*
 * check_stream: stream-ordered reuse (lib/stream.c with lib/alloc.c).
 *
 * A block freed on stream A is reusable at once on A, and on another stream
 * only once the work queued on A before the free has completed;
 * gmlake_record_stream() adds streams whose work must complete too.
 *
 * Most cases stall a stream on purpose with gml_emu_stream_hold() and so
 * run on the emulated device only. The trick that makes reuse visible: a
 * copy from the block to the host is queued on the held stream before the
 * free; if the allocator hands the block's chunks to another stream too
 * early, that stream's writes land first and the held copy reads them.
 */
#include "helpers.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define CAP_CHUNKS(n) ((size_t)(n) * TH_CHUNK)

/*
 * A context whose requests pass over memory other streams' work still
 * covers (stream_order off): the cases that show the pass-over. With it
 * on, such memory is taken and the request's stream waits on the device
 * instead (the Ordered cases).
 */
static gmlake_ctx *ctx_pass_over(size_t capacity)
{
	struct gmlake_config cfg;

	th_config(&cfg, capacity);
	cfg.stream_order = false;
	return th_ctx_cfg(&cfg);
}

/*
 * Queue a copy on stream s without waiting (gmlake_memcpy_* wait for the
 * copy, which a held stream never finishes): the device layer's copy.
 */
static int queue_copy(gmlake_ctx *ctx, void *dst, const void *src,
		      size_t size, enum gml_copy_kind kind, gmlake_stream_t s)
{
	return gml_dev_memcpy(th_dev(ctx), dst, src, size, kind, s);
}

/* A device-to-host copy queued on a (held) stream, checked later. */
struct pending {
	void *host;
	size_t size;
	uint64_t seed;
};

static void pending_queue(gmlake_ctx *ctx, struct pending *pd,
			  const void *p, size_t size, uint64_t seed,
			  gmlake_stream_t s)
{
	int ret;

	pd->host = malloc(size);
	ck_assert_ptr_nonnull(pd->host);
	memset(pd->host, 0x5a, size);
	pd->size = size;
	pd->seed = seed;
	ret = queue_copy(ctx, pd->host, p, size, GML_COPY_DTOH, s);
	ck_assert_msg(ret == 0, "queued dtoh: %d (%s)", ret,
		      gmlake_last_error());
}

/* After the stream completed: the copy saw the block's own pattern. */
static void pending_check(struct pending *pd, const char *what)
{
	size_t off = th_pattern_diff(pd->host, pd->size, pd->seed);

	ck_assert_msg(off == SIZE_MAX,
		      "%s: queued read saw foreign data at offset %zu: the "
		      "block was reused before its stream's work completed",
		      what, off);
	free(pd->host);
	pd->host = NULL;
}

static void expect_alloc(gmlake_ctx *ctx, void **p, size_t size,
			 gmlake_stream_t s, const char *why)
{
	int ret = gmlake_alloc(ctx, p, size, s);

	ck_assert_msg(ret == 0, "%s: alloc %zu: %d (%s)", why, size, ret,
		      gmlake_last_error());
	th_check(ctx);
}

/* expect_alloc() then th_fill_ok(): the new block is written on its stream. */
static void expect_alloc_filled(gmlake_ctx *ctx, void **p, size_t size,
				uint64_t seed, gmlake_stream_t s,
				const char *why)
{
	expect_alloc(ctx, p, size, s, why);
	th_fill_ok(ctx, *p, size, seed, s);
}

/*
 * expect_alloc(), and what came back is none of the n blocks in freed (of
 * size bytes each): they were freed with work still pending.
 */
static void expect_alloc_apart(gmlake_ctx *ctx, void **p, size_t size,
			       gmlake_stream_t s, void *const *freed, int n,
			       const char *why)
{
	int i;

	expect_alloc(ctx, p, size, s, why);
	for (i = 0; i < n; i++)
		ck_assert_msg(!th_overlap(freed[i], size, *p, size),
			      "%s: got %p, inside the block at %p freed with "
			      "work pending", why, *p, freed[i]);
}

/* Queue a read of p on (held) s, then free p: freed with work pending. */
static void read_then_free(gmlake_ctx *ctx, struct pending *pd, void *p,
			   size_t size, uint64_t seed, gmlake_stream_t s)
{
	pending_queue(ctx, pd, p, size, seed, s);
	th_free(ctx, p);
}

/* Let held s go and wait: its n queued reads must have seen their blocks. */
static void release_and_check(gmlake_ctx *ctx, gmlake_stream_t s,
			      struct pending *pd, int n, const char *what)
{
	int i;

	th_hold(ctx, s, false);
	th_sync(ctx, s);
	for (i = 0; i < n; i++)
		pending_check(&pd[i], what);
}

/* Destroy stream a, stream b unless NULL, then ctx: how every case ends. */
static void destroy_all(gmlake_ctx *ctx, gmlake_stream_t a,
			gmlake_stream_t b)
{
	TH_OK(ctx, gmlake_stream_destroy(ctx, a));
	if (b)
		TH_OK(ctx, gmlake_stream_destroy(ctx, b));
	th_destroy(ctx);
}

/* ---------------------------------------------------------------------- */

/* Freed on A while A is busy: A may take it back at once. */
START_TEST(test_same_stream_at_once)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(2));
	gmlake_stream_t a = th_stream(ctx);
	struct pending pd;
	struct gmlake_stats s0, s1;
	void *x, *y;

	x = th_alloc_filled(ctx, 4 * TH_MiB, 1, a);
	th_hold(ctx, a, true);
	read_then_free(ctx, &pd, x, 4 * TH_MiB, 1, a);
	th_stats(ctx, &s0);
	/* The device holds only x's chunks: a must get them. */
	expect_alloc(ctx, &y, 4 * TH_MiB, a, "same stream, stream busy");
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.grows, s0.grows);
	ck_assert_int_eq(s1.chunks.current, 2);
	/* Stream order: a write queued now runs after the queued read. */
	{
		void *buf = malloc(4 * TH_MiB);

		ck_assert_ptr_nonnull(buf);
		th_pattern(buf, 4 * TH_MiB, 2);
		ck_assert_int_eq(queue_copy(ctx, y, buf, 4 * TH_MiB,
					    GML_COPY_HTOD, a), 0);
		th_hold(ctx, a, false);
		th_sync(ctx, a);
		free(buf);
	}
	pending_check(&pd, "same stream");
	th_verify_free(ctx, y, 4 * TH_MiB, 2, a);
	destroy_all(ctx, a, NULL);
}
END_TEST

/*
 * A block on a stitched view freed while two of its stream's events are
 * in flight gets an event of its own at once: after the host waited for
 * the stream, the view is repaired although work queued later is still
 * pending. An event recorded only when the repair asks would cover that
 * later work too and leave the request to a new stitch.
 */
START_TEST(test_stitched_free_marks_at_once)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(32));
	gmlake_stream_t a = th_stream(ctx);
	struct gmlake_stats s0, s1;
	struct pending pd;
	void *p[16], *v, *x, *big;
	int i;

	for (i = 0; i < 16; i++)
		p[i] = th_alloc_filled(ctx, 2 * TH_MiB, 100 + i, a);
	for (i = 1; i < 16; i += 2)
		th_free(ctx, p[i]);
	big = th_alloc(ctx, 16 * TH_MiB, a);	/* V: the 8 odd chunks */
	th_free(ctx, big);

	/* Two frees on stitched memory while a is held: two events in
	 * flight, then V's own free. */
	th_hold(ctx, a, true);
	for (i = 0; i < 2; i++) {
		v = th_alloc(ctx, 4 * TH_MiB, a);
		th_free(ctx, v);
	}
	big = th_alloc(ctx, 16 * TH_MiB, a);
	th_free(ctx, big);
	th_hold(ctx, a, false);
	th_sync(ctx, a);

	/* a busy again: a read queued and held; x takes one of V's chunks. */
	th_hold(ctx, a, true);
	pending_queue(ctx, &pd, p[0], 2 * TH_MiB, 100, a);
	x = th_alloc(ctx, 2 * TH_MiB, a);
	th_stats(ctx, &s0);
	expect_alloc(ctx, &big, 16 * TH_MiB, a, "V's size while a is busy");
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.stitch_repairs, s0.stitch_repairs + 1);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	ck_assert_uint_eq(s1.grows, s0.grows + 1);	/* x's chunk anew */
	release_and_check(ctx, a, &pd, 1, "read queued before the repair");
	th_fill_ok(ctx, big, 16 * TH_MiB, 7, a);
	for (i = 0; i < 16; i += 2)
		th_verify_ok(ctx, p[i], 2 * TH_MiB, 100 + i, a);
	th_verify_free(ctx, big, 16 * TH_MiB, 7, a);
	th_free(ctx, x);
	for (i = 0; i < 16; i += 2)
		th_free(ctx, p[i]);
	destroy_all(ctx, a, NULL);
}
END_TEST

/* Freed on A while A is held: not for B until A completes; then it is. */
START_TEST(test_cross_stream_pending)
{
	gmlake_ctx *ctx = ctx_pass_over(CAP_CHUNKS(4));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct gmlake_stats s0, s1;
	struct pending pd;
	void *x, *y, *z, *w;

	x = th_alloc_filled(ctx, 4 * TH_MiB, 1, a);
	th_hold(ctx, a, true);
	read_then_free(ctx, &pd, x, 4 * TH_MiB, 1, a);

	th_stats(ctx, &s0);
	expect_alloc_apart(ctx, &y, 4 * TH_MiB, b, &x, 1,
			   "other stream, 2 chunks left");
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.chunks.current, 4);	/* new chunks, not x's */
	ck_assert_uint_ge(s1.cross_stream_waits, s0.cross_stream_waits);
	printf("cross-stream waits: %" PRIu64 " -> %" PRIu64 "\n",
	       s0.cross_stream_waits, s1.cross_stream_waits);
	th_fill_ok(ctx, y, 4 * TH_MiB, 2, b);

	/* A itself may take x back: only x's chunks are free. */
	expect_alloc(ctx, &z, 4 * TH_MiB, a, "same stream while busy");
	th_free(ctx, z);

	release_and_check(ctx, a, &pd, 1, "freed on A, allocated on B");
	th_verify_ok(ctx, y, 4 * TH_MiB, 2, b);

	/* A's work is done: B may have the chunks now, and must. */
	expect_alloc_filled(ctx, &w, 4 * TH_MiB, 3, b,
			    "other stream after sync");
	th_verify_ok(ctx, y, 4 * TH_MiB, 2, b);
	th_verify_free(ctx, w, 4 * TH_MiB, 3, b);
	th_free(ctx, y);
	destroy_all(ctx, a, b);
}
END_TEST

/*
 * Top fit (cfg.top_fit) with several streams: the top of a free run that
 * another stream's queued work still covers is passed over, and the
 * highest usable window below it is taken.
 */
START_TEST(test_top_fit_pending)
{
	struct gmlake_config cfg;
	gmlake_ctx *ctx;
	gmlake_stream_t a, b;
	struct pending pd;
	char *base, *x, *y;

	th_config(&cfg, CAP_CHUNKS(16));
	cfg.stream_order = false;
	cfg.top_fit = 4 * TH_CHUNK;
	ctx = th_ctx_cfg(&cfg);
	a = th_stream(ctx);
	b = th_stream(ctx);
	base = th_alloc(ctx, 16 * TH_CHUNK, a);	/* one segment */
	/* Used on b too: its free records both streams' work, which the
	 * syncs below complete, so b may take its chunks. */
	TH_OK(ctx, gmlake_record_stream(ctx, base, b));
	th_free(ctx, base);
	th_sync(ctx, b);
	x = th_alloc_filled(ctx, 4 * TH_CHUNK, 1, a);
	ck_assert_ptr_eq(x, base + 12 * TH_CHUNK);	/* the top */
	th_sync(ctx, a);
	th_hold(ctx, a, true);
	read_then_free(ctx, &pd, x, 4 * TH_CHUNK, 1, a);
	y = th_alloc(ctx, 4 * TH_CHUNK, b);
	ck_assert_ptr_eq(y, base + 8 * TH_CHUNK);	/* below x's */
	th_fill_ok(ctx, y, 4 * TH_CHUNK, 2, b);
	release_and_check(ctx, a, &pd, 1, "top fit on another stream");
	th_verify_ok(ctx, y, 4 * TH_CHUNK, 2, b);
	th_free(ctx, y);
	destroy_all(ctx, a, b);
}
END_TEST

/*
 * A small chunk emptied by a deferred free (a block another stream used)
 * leaves its stream only after the work queued there: another piece of it,
 * freed on that stream, may still be read by a held copy.
 */
START_TEST(test_small_deferred_empty)
{
	gmlake_ctx *ctx = ctx_pass_over(CAP_CHUNKS(4));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	size_t half = TH_MiB - 512;	/* two to a chunk */
	struct pending pd;
	void *x, *y, *p, *q, *z;

	x = th_alloc_filled(ctx, half, 1, a);
	y = th_alloc_filled(ctx, half, 2, a);		/* x's chunk */
	p = th_alloc(ctx, half, a);
	q = th_alloc(ctx, half, a);			/* a second chunk */
	TH_OK(ctx, gmlake_record_stream(ctx, x, b));
	th_hold(ctx, b, true);
	th_free(ctx, x);			/* deferred: b is busy */
	th_free(ctx, p);
	th_free(ctx, q);			/* idle: a's spare chunk */
	th_hold(ctx, a, true);
	read_then_free(ctx, &pd, y, half, 2, a);
	th_hold(ctx, b, false);
	th_sync(ctx, b);
	/* x's release empties its chunk: not b's while a reads y there. */
	expect_alloc_apart(ctx, &z, 2 * TH_MiB, b, &y, 1,
			   "chunk emptied by a deferred free");
	release_and_check(ctx, a, &pd, 1, "read of y");
	th_free(ctx, z);
	destroy_all(ctx, a, b);
}
END_TEST

/*
 * At debug level, a request that raises reserved memory while free chunks
 * stay behind says so, and why they did not serve (here: their work on A
 * is still queued).
 */
START_TEST(test_peak_slack_logged)
{
	struct gmlake_config cfg;
	struct th_capture cap;
	gmlake_ctx *ctx;
	gmlake_stream_t a, b;
	struct pending pd;
	void *x, *y;
	char *text;

	th_config(&cfg, CAP_CHUNKS(4));
	cfg.log_level = GMLAKE_LOG_DEBUG;
	cfg.stream_order = false;
	ctx = th_ctx_cfg(&cfg);
	a = th_stream(ctx);
	b = th_stream(ctx);
	x = th_alloc_filled(ctx, 4 * TH_MiB, 1, a);
	th_hold(ctx, a, true);
	read_then_free(ctx, &pd, x, 4 * TH_MiB, 1, a);
	th_capture_begin(&cap, STDERR_FILENO);
	expect_alloc_apart(ctx, &y, 4 * TH_MiB, b, &x, 1, "raises the peak");
	text = th_capture_end(&cap);
	ck_assert_msg(strstr(text, "an allocation of 4194304 bytes raised "
			      "reserved to 8 MiB with 2 free chunks left (0 in "
			      "cached stitched ranges, 2 with work queued, 0 "
			      "in growth handles blocks hold part of)"),
		      "stderr: %s", text);
	free(text);
	/* No new peak, nothing said. */
	th_free(ctx, y);
	th_capture_begin(&cap, STDERR_FILENO);
	expect_alloc_apart(ctx, &y, 4 * TH_MiB, b, &x, 1, "the same again");
	text = th_capture_end(&cap);
	ck_assert_msg(!strstr(text, "raised reserved"), "stderr: %s", text);
	free(text);
	release_and_check(ctx, a, &pd, 1, "freed on A, allocated on B");
	th_free(ctx, y);
	destroy_all(ctx, a, b);
}
END_TEST

/* The same for small blocks, which share chunks. */
START_TEST(test_cross_stream_small)
{
	gmlake_ctx *ctx = ctx_pass_over(CAP_CHUNKS(4));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct pending pd[8];
	void *x[8], *y[8];
	int i;

	for (i = 0; i < 8; i++)
		x[i] = th_alloc_filled(ctx, 64 * TH_KiB, 10 + i, a);
	th_hold(ctx, a, true);
	for (i = 0; i < 8; i++)
		read_then_free(ctx, &pd[i], x[i], 64 * TH_KiB, 10 + i, a);
	for (i = 0; i < 8; i++) {
		expect_alloc_apart(ctx, &y[i], 64 * TH_KiB, b, x, 8,
				   "small on B");
		th_fill_ok(ctx, y[i], 64 * TH_KiB, 20 + i, b);
	}
	release_and_check(ctx, a, pd, 8, "small block");
	for (i = 0; i < 8; i++)
		th_verify_free(ctx, y[i], 64 * TH_KiB, 20 + i, b);
	destroy_all(ctx, a, b);
}
END_TEST

/* Stitching must not take chunks whose last stream is still busy. */
START_TEST(test_cross_stream_stitch)
{
	gmlake_ctx *ctx = ctx_pass_over(CAP_CHUNKS(6));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct pending p0, p2;
	void *x[4], *y, *z, *w;
	int i;

	for (i = 0; i < 4; i++)
		x[i] = th_alloc_filled(ctx, 2 * TH_MiB, 30 + i, a);
	th_hold(ctx, a, true);
	pending_queue(ctx, &p0, x[0], 2 * TH_MiB, 30, a);
	pending_queue(ctx, &p2, x[2], 2 * TH_MiB, 32, a);
	th_free(ctx, x[0]);
	th_free(ctx, x[2]);

	/* B: two new chunks, never x[0] and x[2] stitched. */
	expect_alloc_filled(ctx, &y, 4 * TH_MiB, 40, b, "4 MiB on B");
	/* A: the device is full but for x[0] and x[2]: stitch them. */
	expect_alloc(ctx, &z, 4 * TH_MiB, a, "4 MiB on busy A");
	th_free(ctx, z);

	release_and_check(ctx, a, &p0, 1, "x[0]");
	pending_check(&p2, "x[2]");
	th_verify_ok(ctx, y, 4 * TH_MiB, 40, b);
	th_verify_ok(ctx, x[1], 2 * TH_MiB, 31, b);
	th_verify_ok(ctx, x[3], 2 * TH_MiB, 33, b);

	expect_alloc_filled(ctx, &w, 4 * TH_MiB, 41, b,
			    "4 MiB on B after sync");
	th_verify_ok(ctx, y, 4 * TH_MiB, 40, b);
	th_verify_ok(ctx, x[1], 2 * TH_MiB, 31, b);
	th_verify_ok(ctx, x[3], 2 * TH_MiB, 33, b);
	th_free(ctx, w);
	th_free(ctx, y);
	th_free(ctx, x[1]);
	th_free(ctx, x[3]);
	destroy_all(ctx, a, b);
}
END_TEST

/* A cached stitched range freed on busy A is not for B either. */
START_TEST(test_cross_stream_stitched_reuse)
{
	gmlake_ctx *ctx = ctx_pass_over(CAP_CHUNKS(12));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct pending pd;
	void *x[4], *big, *y;
	int i;

	for (i = 0; i < 4; i++)
		x[i] = th_alloc(ctx, 2 * TH_MiB, a);
	th_free(ctx, x[0]);
	th_free(ctx, x[2]);
	big = th_alloc_filled(ctx, 4 * TH_MiB, 50, a);	/* stitched */
	th_hold(ctx, a, true);
	read_then_free(ctx, &pd, big, 4 * TH_MiB, 50, a);

	expect_alloc_apart(ctx, &y, 4 * TH_MiB, b, &big, 1, "4 MiB on B");
	th_fill_ok(ctx, y, 4 * TH_MiB, 51, b);
	release_and_check(ctx, a, &pd, 1, "stitched block");
	th_verify_free(ctx, y, 4 * TH_MiB, 51, b);
	th_free(ctx, x[1]);
	th_free(ctx, x[3]);
	destroy_all(ctx, a, b);
}
END_TEST

/*
 * B asks for 4 MiB while A holds the read queued before x's free: it must
 * get x's chunks, ordered after A's work (one stream wait, no growth);
 * the stats before and after, in *s0 and *s1.
 */
static void *expect_ordered_take(gmlake_ctx *ctx, void *x, gmlake_stream_t b,
				 struct gmlake_stats *s0,
				 struct gmlake_stats *s1)
{
	void *y;

	th_stats(ctx, s0);
	expect_alloc(ctx, &y, 4 * TH_MiB, b, "B while A holds x's work");
	th_stats(ctx, s1);
	ck_assert_ptr_eq(y, x);
	ck_assert_uint_eq(s1->grows, s0->grows);
	ck_assert_uint_eq(s1->calls[GMLAKE_CALL_stream_wait],
			  s0->calls[GMLAKE_CALL_stream_wait] + 1);
	return y;
}

/* A write to y queued on B must not overtake A's held read: A's read
 * still sees its data once let go, and y holds the write. */
static void write_after_held_read(gmlake_ctx *ctx, gmlake_stream_t a,
				  gmlake_stream_t b, struct pending *pd,
				  void *y, const char *what)
{
	void *buf = malloc(4 * TH_MiB);

	ck_assert_ptr_nonnull(buf);
	th_pattern(buf, 4 * TH_MiB, 2);
	ck_assert_int_eq(queue_copy(ctx, y, buf, 4 * TH_MiB, GML_COPY_HTOD,
				    b), 0);
	release_and_check(ctx, a, pd, 1, what);
	th_sync(ctx, b);
	free(buf);
	th_verify_free(ctx, y, 4 * TH_MiB, 2, b);
}

/*
 * Ordered (stream_order, the default): B's request could otherwise be
 * served only by driver work, so it takes the chunks A freed while A is
 * held and B waits on the device for A's work. Nothing grows, A's queued
 * read still sees A's data, and B's write lands after it.
 */
START_TEST(test_ordered_takes_pending)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(2));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct gmlake_stats s0, s1;
	struct pending pd;
	void *x, *y;

	x = th_alloc_filled(ctx, 4 * TH_MiB, 1, a);
	th_hold(ctx, a, true);
	read_then_free(ctx, &pd, x, 4 * TH_MiB, 1, a);
	y = expect_ordered_take(ctx, x, b, &s0, &s1);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	ck_assert_int_eq(s1.chunks.current, 2);
	write_after_held_read(ctx, a, b, &pd, y, "ordered: A's read");
	destroy_all(ctx, a, b);
}
END_TEST

/*
 * 4 MiB x filled on A, 4 MiB more allocated and freed (the most ever
 * reserved 8 MiB over what lives), a trim, then x freed while A holds a
 * read of it: x's chunks are reserved, free, and A's work covers them.
 */
static void *trim_then_free_pending(gmlake_ctx *ctx, gmlake_stream_t a,
				    struct pending *pd)
{
	void *x = th_alloc_filled(ctx, 4 * TH_MiB, 1, a);
	void *w = th_alloc(ctx, 4 * TH_MiB, a);

	th_free(ctx, w);
	th_sync(ctx, a);
	TH_OK(ctx, gmlake_trim(ctx));
	th_hold(ctx, a, true);
	read_then_free(ctx, pd, x, 4 * TH_MiB, 1, a);
	return x;
}

/*
 * Ordered, but growth within the budget and under the most ever reserved
 * comes first: after a trim the most ever reserved (248 MiB) is above
 * what is reserved (244 MiB), and the budget (2% over the most live
 * since the trim, 244 MiB) allows 4 MiB more, so B gets new chunks and
 * waits for nothing. With 4 MiB live instead of 250 (test_trim_restarts)
 * the budget refuses and B waits.
 */
START_TEST(test_ordered_growth_first)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(128));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct gmlake_stats s0, s1;
	struct pending pd;
	void *big, *x, *y;

	big = th_alloc(ctx, 240 * TH_MiB, a);
	x = trim_then_free_pending(ctx, a, &pd);
	th_stats(ctx, &s0);
	ck_assert_int_eq(s0.reserved_bytes.current, 244 * TH_MiB);
	expect_alloc_apart(ctx, &y, 4 * TH_MiB, b, &x, 1, "4 MiB on B");
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.grows, s0.grows + 1);
	ck_assert_uint_eq(s1.calls[GMLAKE_CALL_stream_wait],
			  s0.calls[GMLAKE_CALL_stream_wait]);
	th_fill_ok(ctx, y, 4 * TH_MiB, 2, b);	/* B waits for nothing */
	release_and_check(ctx, a, &pd, 1, "growth first: A's read");
	th_verify_free(ctx, y, 4 * TH_MiB, 2, b);
	th_free(ctx, big);
	destroy_all(ctx, a, b);
}
END_TEST

/*
 * A trim starts growth's budget over from what is live: 8 MiB were live
 * before it, 4 after, so once that block is freed with A's work pending,
 * growing for B would double what the phase ever needed, and B takes the
 * freed chunks after A's work instead (one event wait).
 */
START_TEST(test_trim_restarts)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(8));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct gmlake_stats s0, s1;
	struct pending pd;
	void *x, *y;

	x = trim_then_free_pending(ctx, a, &pd);
	y = expect_ordered_take(ctx, x, b, &s0, &s1);
	ck_assert_int_eq(s1.reserved_bytes.current, 4 * TH_MiB);
	write_after_held_read(ctx, a, b, &pd, y, "after a trim: A's read");
	destroy_all(ctx, a, b);
}
END_TEST

/*
 * Ordered before growth that raises peak reserved: with room on the
 * device and growth within its budget (2% over the most requested: 4 MiB
 * over 250), B still takes the chunks A freed and waits for A's work on
 * the device, because new chunks would raise the most ever reserved
 * (test_ordered_growth_first: growth that stays under that peak comes
 * first).
 */
START_TEST(test_ordered_before_peak)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(128));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct gmlake_stats s0, s1;
	struct pending pd;
	void *big, *x, *y;

	big = th_alloc(ctx, 246 * TH_MiB, a);
	x = th_alloc_filled(ctx, 4 * TH_MiB, 1, a);
	th_hold(ctx, a, true);
	read_then_free(ctx, &pd, x, 4 * TH_MiB, 1, a);
	y = expect_ordered_take(ctx, x, b, &s0, &s1);
	ck_assert_int_eq(s0.reserved_bytes.peak, 250 * TH_MiB);
	ck_assert_int_eq(s0.reserved_bytes.current, 250 * TH_MiB);
	ck_assert_int_eq(s1.reserved_bytes.peak, 250 * TH_MiB);
	write_after_held_read(ctx, a, b, &pd, y,
			      "ordered before the peak: A's read");
	th_free(ctx, big);
	destroy_all(ctx, a, b);
}
END_TEST

/* record_stream(B): freed, the block waits for B too, even on A. */
START_TEST(test_record_stream)
{
	gmlake_ctx *ctx = ctx_pass_over(CAP_CHUNKS(4));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct pending pd;
	void *x, *y, *w;

	x = th_alloc_filled(ctx, 4 * TH_MiB, 60, a);
	th_hold(ctx, b, true);
	pending_queue(ctx, &pd, x, 4 * TH_MiB, 60, b);
	TH_OK(ctx, gmlake_record_stream(ctx, x, b));
	TH_OK(ctx, gmlake_record_stream(ctx, x, a));	/* its own: no-op */
	th_free(ctx, x);

	expect_alloc_apart(ctx, &y, 4 * TH_MiB, a, &x, 1,
			   "4 MiB on A, B busy");
	th_fill_ok(ctx, y, 4 * TH_MiB, 61, a);

	release_and_check(ctx, b, &pd, 1, "recorded stream");
	th_verify_ok(ctx, y, 4 * TH_MiB, 61, a);
	/* B done: the chunks are free for A, and the device has no more. */
	expect_alloc_filled(ctx, &w, 4 * TH_MiB, 62, a, "4 MiB on A after B");
	th_verify_ok(ctx, y, 4 * TH_MiB, 61, a);
	th_free(ctx, w);
	th_free(ctx, y);
	destroy_all(ctx, a, b);
}
END_TEST

/* record_stream on a small block. */
START_TEST(test_record_stream_small)
{
	gmlake_ctx *ctx = ctx_pass_over(CAP_CHUNKS(4));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	struct pending pd;
	void *x, *y[4];
	int i;

	x = th_alloc_filled(ctx, 4096, 70, a);
	th_hold(ctx, b, true);
	pending_queue(ctx, &pd, x, 4096, 70, b);
	TH_OK(ctx, gmlake_record_stream(ctx, x, b));
	th_free(ctx, x);
	for (i = 0; i < 4; i++) {
		expect_alloc_apart(ctx, &y[i], 4096, a, &x, 1,
				   "small on A, B busy");
		th_fill_ok(ctx, y[i], 4096, 71 + i, a);
	}
	release_and_check(ctx, b, &pd, 1, "recorded stream, small block");
	for (i = 0; i < 4; i++)
		th_verify_free(ctx, y[i], 4096, 71 + i, a);
	destroy_all(ctx, a, b);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Cases that need no hold (any backend).                                 */

/* Freed on A, A synchronized: B gets the memory. */
START_TEST(test_sync_then_other_stream)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(2));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	void *x, *y;
	int i;

	for (i = 0; i < 4; i++) {
		x = th_alloc_filled(ctx, 4 * TH_MiB, 80 + i, a);
		th_verify_free(ctx, x, 4 * TH_MiB, 80 + i, a);
		th_sync(ctx, a);
		expect_alloc_filled(ctx, &y, 4 * TH_MiB, 90 + i, b,
				    "B after A synced");
		th_verify_free(ctx, y, 4 * TH_MiB, 90 + i, b);
		th_sync(ctx, b);
	}
	destroy_all(ctx, a, b);
}
END_TEST

/* The default stream and created streams side by side. */
START_TEST(test_default_stream)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(4));
	gmlake_stream_t a = th_stream(ctx);
	void *x, *y;

	x = th_alloc_filled(ctx, 4 * TH_MiB, 1, NULL);
	th_free(ctx, x);
	th_sync(ctx, NULL);
	expect_alloc_filled(ctx, &y, 4 * TH_MiB, 2, a,
			    "A after the default stream");
	th_free(ctx, y);
	th_sync(ctx, a);
	expect_alloc_filled(ctx, &x, 8 * TH_MiB, 3, NULL, "default after A");
	th_verify_free(ctx, x, 8 * TH_MiB, 3, NULL);
	destroy_all(ctx, a, NULL);
}
END_TEST

/* A stream destroyed after a free: its blocks become free for others. */
START_TEST(test_destroyed_stream)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(2));
	gmlake_stream_t a = th_stream(ctx), b = th_stream(ctx);
	void *x, *y;

	x = th_alloc_filled(ctx, 4 * TH_MiB, 1, a);
	th_free(ctx, x);
	TH_OK(ctx, gmlake_stream_destroy(ctx, a));
	expect_alloc_filled(ctx, &y, 4 * TH_MiB, 2, b, "B after A destroyed");
	th_verify_free(ctx, y, 4 * TH_MiB, 2, b);
	destroy_all(ctx, b, NULL);
}
END_TEST

START_TEST(test_stream_api)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(4));
	gmlake_stream_t s[4];
	struct gml_emu_info i0, i1;
	int i;

	if (th_is_emu(ctx))
		th_emu_info(ctx, &i0);
	for (i = 0; i < 4; i++) {
		s[i] = th_stream(ctx);
		ck_assert_ptr_nonnull(s[i]);
	}
	if (th_is_emu(ctx)) {
		th_emu_info(ctx, &i1);
		ck_assert_uint_eq(i1.live_streams, i0.live_streams + 4);
	}
	for (i = 0; i < 4; i++)
		th_sync(ctx, s[i]);
	th_sync(ctx, NULL);
	ck_assert_int_eq(gmlake_stream_create(ctx, NULL), -EINVAL);
	ck_assert_int_eq(gmlake_stream_create(NULL, &s[0]), -EINVAL);
	ck_assert_int_eq(gmlake_stream_synchronize(NULL, s[0]), -EINVAL);
	ck_assert_int_eq(gmlake_stream_destroy(NULL, s[0]), -EINVAL);
	if (th_is_emu(ctx)) {
		gmlake_stream_t bogus = (gmlake_stream_t)(uintptr_t)0x8000;

		ck_assert_int_eq(gmlake_stream_destroy(ctx, bogus), -EINVAL);
		ck_assert_int_eq(gmlake_stream_synchronize(ctx, bogus),
				 -EINVAL);
	}
	for (i = 0; i < 4; i++)
		TH_OK(ctx, gmlake_stream_destroy(ctx, s[i]));
	if (th_is_emu(ctx)) {
		th_emu_info(ctx, &i1);
		ck_assert_uint_eq(i1.live_streams, i0.live_streams);
	}
	th_destroy(ctx);
}
END_TEST

/*
 * Copies queued on a held stream wait, run in order when let go, and the
 * public copy waits for the stream's earlier work.
 */
START_TEST(test_copy_order)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(4));
	gmlake_stream_t a = th_stream(ctx);
	size_t n = 2 * TH_MiB + 100;
	void *x = th_alloc(ctx, n, a);
	char *src = malloc(n), *dst = malloc(n);

	ck_assert_ptr_nonnull(src);
	ck_assert_ptr_nonnull(dst);
	th_pattern(src, n, 5);
	memset(dst, 0, n);
	th_hold(ctx, a, true);
	ck_assert_int_eq(queue_copy(ctx, x, src, n, GML_COPY_HTOD, a), 0);
	ck_assert_int_eq(queue_copy(ctx, dst, x, n, GML_COPY_DTOH, a), 0);
	usleep(20000);
	ck_assert_int_eq(dst[0], 0);	/* not run while held */
	th_hold(ctx, a, false);
	th_sync(ctx, a);
	ck_assert_uint_eq(th_pattern_diff(dst, n, 5), SIZE_MAX);
	th_hold(ctx, a, true);
	th_pattern(src, n, 6);
	ck_assert_int_eq(queue_copy(ctx, x, src, n, GML_COPY_HTOD, a), 0);
	th_hold(ctx, a, false);
	th_verify_ok(ctx, x, n, 6, a);
	free(src);
	free(dst);
	th_free(ctx, x);
	destroy_all(ctx, a, NULL);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Random: three streams held and let go at random, every block checked.  */

#define RS_STREAMS 3
#define RS_LIVE 16
#define RS_OPS 400
#define RS_PENDING 256

struct rs_blk {
	void *p;
	size_t size;
	uint64_t seed;
	int s;
};

struct rs {
	gmlake_ctx *ctx;
	gmlake_stream_t st[RS_STREAMS];
	bool held[RS_STREAMS];
	struct pending pd[RS_STREAMS][RS_PENDING];
	int npd[RS_STREAMS];
	struct rs_blk b[RS_LIVE];
	int n;
};

static void rs_release(struct rs *r, int s)
{
	release_and_check(r->ctx, r->st[s], r->pd[s], r->npd[s],
			  "random streams");
	r->held[s] = false;
	r->npd[s] = 0;
}

static int rs_unheld(struct rs *r, struct th_rng *g)
{
	int k = (int)th_range(g, 0, RS_STREAMS - 1), i;

	for (i = 0; i < RS_STREAMS; i++, k = (k + 1) % RS_STREAMS)
		if (!r->held[k])
			return k;
	return -1;
}

static void rs_free(struct rs *r, struct th_rng *g, int j)
{
	struct rs_blk *b = &r->b[j];
	int h = (int)th_range(g, 0, RS_STREAMS - 1);

	if (r->held[b->s]) {
		ck_assert_int_lt(r->npd[b->s], RS_PENDING);
		pending_queue(r->ctx, &r->pd[b->s][r->npd[b->s]++], b->p,
			      b->size, b->seed, r->st[b->s]);
	} else {
		th_verify_ok(r->ctx, b->p, b->size, b->seed, r->st[b->s]);
	}
	/* Sometimes a held stream reads it too, and is recorded. */
	if (h != b->s && r->held[h] && th_range(g, 0, 1)) {
		ck_assert_int_lt(r->npd[h], RS_PENDING);
		pending_queue(r->ctx, &r->pd[h][r->npd[h]++], b->p, b->size,
			      b->seed, r->st[h]);
		TH_OK(r->ctx, gmlake_record_stream(r->ctx, b->p, r->st[h]));
	}
	th_free(r->ctx, b->p);
	*b = r->b[--r->n];
}

START_TEST(test_random_streams)
{
	struct rs *r = calloc(1, sizeof(*r));
	struct th_rng g = { 77 + (uint64_t)_i };
	int op, s, ooms = 0;

	ck_assert_ptr_nonnull(r);
	/* Every fill and check waits for its stream, which must not wait
	 * on a held one: pass over. */
	r->ctx = ctx_pass_over(CAP_CHUNKS(64));
	for (s = 0; s < RS_STREAMS; s++)
		r->st[s] = th_stream(r->ctx);
	for (op = 0; op < RS_OPS; op++) {
		uint64_t k = th_range(&g, 0, 99);

		if (k < 10) {
			s = (int)th_range(&g, 0, RS_STREAMS - 1);
			if (r->held[s]) {
				rs_release(r, s);
			} else {
				th_hold(r->ctx, r->st[s], true);
				r->held[s] = true;
			}
		} else if (k < 55 && r->n < RS_LIVE &&
			   (s = rs_unheld(r, &g)) >= 0) {
			struct rs_blk *b = &r->b[r->n];
			size_t size = th_range(&g, 0, 2) ?
				th_range(&g, 2 * TH_MiB, 6 * TH_MiB) :
				th_range(&g, 1, 256 * TH_KiB);
			int ret = gmlake_alloc(r->ctx, &b->p, size, r->st[s]);

			th_check(r->ctx);
			if (ret == -ENOMEM) {
				ooms++;
				continue;
			}
			ck_assert_msg(ret == 0, "alloc: %d", ret);
			b->size = size;
			b->seed = 1000 + (uint64_t)op;
			b->s = s;
			th_fill_ok(r->ctx, b->p, size, b->seed, r->st[s]);
			r->n++;
		} else if (r->n) {
			rs_free(r, &g, (int)th_range(&g, 0, r->n - 1));
		}
	}
	for (s = 0; s < RS_STREAMS; s++)
		if (r->held[s])
			rs_release(r, s);
	while (r->n)
		rs_free(r, &g, r->n - 1);
	printf("random streams: %d ooms\n", ooms);
	for (s = 0; s < RS_STREAMS; s++)
		TH_OK(r->ctx, gmlake_stream_destroy(r->ctx, r->st[s]));
	TH_OK(r->ctx, gmlake_trim(r->ctx));
	th_destroy(r->ctx);
	free(r);
}
END_TEST

/* ---------------------------------------------------------------------- */

/*
 * A child made by fork() gets an error from its parent's context, never a
 * hang: the parent's stream workers do not exist in the child (before the
 * fix gmlake_stream_synchronize waited forever there). The parent's
 * context goes on working.
 */
START_TEST(test_fork_child_errors)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(8));
	gmlake_stream_t s = th_stream(ctx);
	void *p = th_alloc(ctx, 4 * TH_MiB, s), *q = NULL;
	int status;
	pid_t pid;

	th_fill_ok(ctx, p, 4 * TH_MiB, 91, s);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		int a, b;

		signal(SIGALRM, SIG_DFL);
		alarm(10);	/* a hang ends the child by the signal */
		a = gmlake_stream_synchronize(ctx, s);
		b = gmlake_alloc(ctx, &q, 4096, s);
		_exit(a < 0 && b < 0 && strstr(gmlake_last_error(), "fork") ?
		      0 : 1);
	}
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "the child %s (status %#x)", WIFSIGNALED(status) ?
		      "hung or crashed" : "got no error", status);
	th_verify_ok(ctx, p, 4 * TH_MiB, 91, s);
	th_free(ctx, p);
	TH_OK(ctx, gmlake_stream_destroy(ctx, s));
	th_destroy(ctx);
}
END_TEST

/* The emulated device's stream workers carry a name (top -H, gdb). */
START_TEST(test_emu_worker_named)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(8));
	gmlake_stream_t s = th_stream(ctx);
	void *p = th_alloc(ctx, 4 * TH_MiB, s);

	th_fill_ok(ctx, p, 4 * TH_MiB, 92, s);	/* starts the worker */
	ck_assert(th_thread_named("gmlake-emu"));
	th_free(ctx, p);
	TH_OK(ctx, gmlake_stream_destroy(ctx, s));
	th_destroy(ctx);
}
END_TEST

static Suite *stream_suite(bool emu)
{
	Suite *s = suite_create("stream");
	TCase *tc;

	tc = th_tcase(s, "Basic");
	tcase_add_test(tc, test_sync_then_other_stream);
	tcase_add_test(tc, test_default_stream);
	tcase_add_test(tc, test_destroyed_stream);
	tcase_add_test(tc, test_stream_api);

	if (!emu)	/* the rest stall streams with the emulated hold */
		return s;

	tc = th_tcase(s, "SameStream");
	tcase_add_test(tc, test_same_stream_at_once);
	tcase_add_test(tc, test_copy_order);
	tcase_add_test(tc, test_stitched_free_marks_at_once);

	tc = th_tcase(s, "CrossStream");
	tcase_add_test(tc, test_cross_stream_pending);
	tcase_add_test(tc, test_top_fit_pending);
	tcase_add_test(tc, test_peak_slack_logged);
	tcase_add_test(tc, test_small_deferred_empty);
	tcase_add_test(tc, test_cross_stream_small);
	tcase_add_test(tc, test_cross_stream_stitch);
	tcase_add_test(tc, test_cross_stream_stitched_reuse);

	tc = th_tcase(s, "Ordered");
	tcase_add_test(tc, test_ordered_takes_pending);
	tcase_add_test(tc, test_ordered_growth_first);
	tcase_add_test(tc, test_trim_restarts);
	tcase_add_test(tc, test_ordered_before_peak);

	tc = th_tcase(s, "RecordStream");
	tcase_add_test(tc, test_record_stream);
	tcase_add_test(tc, test_record_stream_small);

	if (emu) {
		tc = th_tcase(s, "Process");
		tcase_add_test(tc, test_fork_child_errors);
		tcase_add_test(tc, test_emu_worker_named);
	}

	tc = th_tcase(s, "Random");
	tcase_add_loop_test(tc, test_random_streams, 0, 3);
	return s;
}

int main(void)
{
	int probe = th_probe();

	if (probe)
		return probe;
	return th_run_suite(stream_suite(th_env_is_emu()));
}
