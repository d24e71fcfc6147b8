/* SPDX-License-Identifier: MIT */
/*
 * check_torch: the PyTorch pluggable-allocator entry points (lib/torch.c),
 * called the way PyTorch calls them: by signature, from any thread.
 *
 * Runs on the backend GMLAKE_BACKEND names (emu under make check); exits 77
 * when that backend has no device. Cases that need a small device (out of
 * memory, limits) or a held stream run on the emulated device only. Each
 * case starts from a fresh state (gml_torch_reset), so the suite also runs
 * with CK_FORK=no.
 */
#include <pthread.h>
#include <stdarg.h>

#include "helpers.h"
#include "gmlake-snapshot.h"
#include "gmlake-torch.h"
#include "torch.h"

static bool on_emu;

/* Device d on the emulated device (any ordinal opens), else device 0. */
static int dev(int d)
{
	return on_emu ? d : 0;
}

static void setup(void)
{
	on_emu = th_env_is_emu();
	/* The contexts come from gmlake_config_init(): the environment. */
	ck_assert_int_eq(setenv("GMLAKE_EMU_CAPACITY", "256M", 1), 0);
	ck_assert_int_eq(unsetenv("GMLAKE_DEVICE_LIMIT"), 0);
	ck_assert_int_eq(gml_torch_reset(), 0);
}

static void teardown(void)
{
	ck_assert_int_eq(gml_torch_reset(), 0);
}

static gmlake_ctx *torch_ctx(int device)
{
	gmlake_ctx *ctx = NULL;
	int ret = gmlake_torch_ctx_get(device, &ctx);

	ck_assert_msg(ret == 0, "gmlake_torch_ctx_get(%d): %d (%s)", device,
		      ret, gmlake_last_error());
	ck_assert_ptr_nonnull(ctx);
	return ctx;
}

static void *torch_alloc_ok(size_t size, int device, gmlake_stream_t s)
{
	void *p = gmlake_torch_alloc(size, device, s);

	ck_assert_msg(p != NULL, "gmlake_torch_alloc(%zu, %d): NULL (%s)",
		      size, device, gmlake_last_error());
	return p;
}

static int nerrors(char *buf, size_t size)
{
	int n = gmlake_torch_error(buf, size);

	ck_assert_int_ge(n, 0);
	return n;
}

static void stats_of(int device, struct gmlake_stats *st)
{
	th_stats(torch_ctx(device), st);
}

/* ---------------------------------------------------------------------- */
/* Contexts                                                               */

/* No context until the first allocation on a device; one per device. */
START_TEST(test_lazy_ctx)
{
	gmlake_ctx *ctx = NULL, *c0, *c1;
	size_t size = 0;
	char msg[512];
	void *p, *q;

	ck_assert_int_eq(gmlake_torch_ctx_get(0, &ctx), -ENOENT);
	ck_assert_ptr_null(ctx);
	ck_assert_int_eq(gmlake_torch_ctx_get(0, NULL), -EINVAL);
	ck_assert_int_eq(gmlake_torch_ctx_get(-1, &ctx), -EINVAL);
	ck_assert_int_eq(gmlake_torch_ctx_get(128, &ctx), -EINVAL);

	p = torch_alloc_ok(TH_MiB, 0, NULL);
	c0 = torch_ctx(0);
	ck_assert_int_eq(gmlake_torch_ctx_get(1, &ctx), -ENOENT);
	q = torch_alloc_ok(3 * TH_MiB, dev(1), NULL);
	c1 = torch_ctx(dev(1));
	if (dev(1))
		ck_assert_ptr_ne(c0, c1);
	ck_assert_ptr_eq(torch_ctx(0), c0);
	ck_assert_int_eq(gmlake_block_size(c0, p, &size), 0);
	ck_assert_uint_eq(size, TH_MiB);
	ck_assert_int_eq(gmlake_block_size(c1, q, &size), 0);
	ck_assert_uint_eq(size, 3 * TH_MiB);
	th_fill_ok(c0, p, TH_MiB, 1, NULL);
	th_verify_ok(c0, p, TH_MiB, 1, NULL);
	gmlake_torch_free(p, TH_MiB, 0, NULL);
	gmlake_torch_free(q, 3 * TH_MiB, dev(1), NULL);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 0);
}
END_TEST

/* A device PyTorch cannot have: NULL, a message, no context. */
START_TEST(test_bad_device)
{
	char msg[512];

	ck_assert_ptr_null(gmlake_torch_alloc(TH_MiB, -1, NULL));
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 1);
	ck_assert_msg(strstr(msg, "device -1") != NULL, "message: %s", msg);
	ck_assert_ptr_null(gmlake_torch_alloc(TH_MiB, 128, NULL));
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 2);
	ck_assert_msg(strstr(gmlake_last_error(), "device 128") != NULL,
		      "last error: %s", gmlake_last_error());
	ck_assert_int_eq(gmlake_torch_error(NULL, 8), -EINVAL);
	ck_assert_int_eq(gmlake_torch_error(msg, 0), -EINVAL);
}
END_TEST

/* PyTorch allocates 0 bytes for empty tensors: NULL, and nothing else. */
START_TEST(test_size_zero)
{
	gmlake_ctx *ctx = NULL;
	char msg[64];

	ck_assert_ptr_null(gmlake_torch_alloc(0, 0, NULL));
	ck_assert_int_eq(gmlake_torch_ctx_get(0, &ctx), -ENOENT);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 0);
	ck_assert_str_eq(msg, "");
	gmlake_torch_free(NULL, 0, 0, NULL);	/* what it may free later */
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 0);
}
END_TEST

/* The init hook records the count and creates nothing. */
START_TEST(test_init)
{
	gmlake_ctx *ctx = NULL;

	ck_assert_int_eq(gml_torch_device_count(), -1);
	gmlake_torch_init(4);
	ck_assert_int_eq(gml_torch_device_count(), 4);
	ck_assert_int_eq(gmlake_torch_ctx_get(0, &ctx), -ENOENT);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Misuse: never a crash, always a message                                */

/* Free of a pointer libgmlake never gave out: logged, ignored. */
START_TEST(test_unknown_pointer)
{
	struct th_capture cap;
	struct gmlake_stats before, after;
	char msg[512], *text;
	void *p, *bogus = (void *)(uintptr_t)0x7000beef0000ull;

	/* On a device without a context. */
	th_capture_begin(&cap, 2);
	gmlake_torch_free(bogus, 4096, 3, NULL);
	text = th_capture_end(&cap);
	ck_assert_msg(strstr(text, "ignored") && strstr(text, "device 3"),
		      "stderr: %s", text);
	free(text);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 1);

	/* On a device with one: its blocks stay as they are. */
	p = torch_alloc_ok(2 * TH_MiB, 0, NULL);
	stats_of(0, &before);
	th_capture_begin(&cap, 2);
	gmlake_torch_free(bogus, 4096, 0, NULL);
	gmlake_torch_free((char *)p + 512, 4096, 0, NULL);	/* inside */
	text = th_capture_end(&cap);
	ck_assert_msg(strstr(text, "0x7000beef0000") &&
		      strstr(text, "not a live block"), "stderr: %s", text);
	ck_assert_msg(strstr(text, "not its start"), "stderr: %s", text);
	free(text);
	stats_of(0, &after);
	ck_assert_int_eq(after.frees, before.frees);
	ck_assert_int_eq(after.active_blocks.current, 1);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 3);
	th_fill_ok(torch_ctx(0), p, 2 * TH_MiB, 5, NULL);
	th_verify_ok(torch_ctx(0), p, 2 * TH_MiB, 5, NULL);
	gmlake_torch_free(p, 2 * TH_MiB, 0, NULL);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 3);
}
END_TEST

START_TEST(test_double_free)
{
	struct th_capture cap;
	struct gmlake_stats st;
	char msg[512], *text;
	void *p = torch_alloc_ok(5 * TH_MiB, 0, NULL);

	gmlake_torch_free(p, 5 * TH_MiB, 0, NULL);
	th_capture_begin(&cap, 2);
	gmlake_torch_free(p, 5 * TH_MiB, 0, NULL);
	text = th_capture_end(&cap);
	ck_assert_msg(strstr(text, "already freed"), "stderr: %s", text);
	free(text);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 1);
	ck_assert_msg(strstr(msg, "ignored"), "message: %s", msg);
	stats_of(0, &st);
	ck_assert_uint_eq(st.allocs, 1);
	ck_assert_uint_eq(st.frees, 1);
	ck_assert_int_eq(st.active_blocks.current, 0);
	th_check(torch_ctx(0));
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Out of memory and limits (emulated device)                             */

/* The message names the request, the allocator's state and the cause. */
START_TEST(test_oom_message)
{
	struct th_capture cap;
	char msg[1024], *text;
	void *p = torch_alloc_ok(64 * TH_MiB, 0, NULL), *q;

	th_capture_begin(&cap, 2);
	q = gmlake_torch_alloc(TH_GiB, 0, NULL);
	text = th_capture_end(&cap);
	ck_assert_ptr_null(q);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 1);
	ck_assert_msg(strstr(text, msg) != NULL, "stderr '%s' lacks '%s'",
		      text, msg);
	free(text);
	ck_assert_msg(strstr(msg, "device 0: out of memory allocating "
			     "1.00 GiB (1073741824 bytes)"), "message: %s", msg);
	ck_assert_msg(strstr(msg, "64.00 MiB allocated"), "message: %s", msg);
	ck_assert_msg(strstr(msg, "64.00 MiB reserved"), "message: %s", msg);
	ck_assert_msg(strstr(msg, "device limit none"), "message: %s", msg);
	ck_assert_msg(strstr(msg, "cause: "), "message: %s", msg);
	/* The calling thread's error starts the same way. */
	ck_assert_msg(!strncmp(gmlake_last_error(), msg, 100),
		      "last error: %s", gmlake_last_error());
	/* The allocator is fine afterwards. */
	q = torch_alloc_ok(64 * TH_MiB, 0, NULL);
	th_check(torch_ctx(0));
	gmlake_torch_free(q, 64 * TH_MiB, 0, NULL);
	gmlake_torch_free(p, 64 * TH_MiB, 0, NULL);
}
END_TEST

/* A fraction set before the first allocation and changed afterwards. */
START_TEST(test_memory_fraction)
{
	struct gmlake_stats st;
	char msg[1024];
	void *a, *b, *c;

	gmlake_torch_memory_fraction(0.25, 0);	/* 64 MiB of 256 */
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 0);
	a = torch_alloc_ok(40 * TH_MiB, 0, NULL);
	ck_assert_ptr_null(gmlake_torch_alloc(32 * TH_MiB, 0, NULL));
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 1);
	ck_assert_msg(strstr(msg, "device limit 64.00 MiB"), "message: %s",
		      msg);
	stats_of(0, &st);
	ck_assert_int_le(st.reserved_bytes.current, 64 * TH_MiB);
	ck_assert_int_le(st.reserved_bytes.peak, 64 * TH_MiB);
	b = torch_alloc_ok(20 * TH_MiB, 0, NULL);	/* 60 MiB: fits */

	gmlake_torch_memory_fraction(0.5, 0);	/* now 128 MiB */
	c = torch_alloc_ok(60 * TH_MiB, 0, NULL);
	stats_of(0, &st);
	ck_assert_int_le(st.reserved_bytes.current, 128 * TH_MiB);

	/* Out of range: logged, the limit stays. */
	gmlake_torch_memory_fraction(1.5, 0);
	gmlake_torch_memory_fraction(0.5, -2);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 3);
	ck_assert_ptr_null(gmlake_torch_alloc(64 * TH_MiB, 0, NULL));
	gmlake_torch_free(a, 0, 0, NULL);
	gmlake_torch_free(b, 0, 0, NULL);
	gmlake_torch_free(c, 0, 0, NULL);
	th_check(torch_ctx(0));
}
END_TEST

/*
 * Memory cached before the limit was lowered does not stay over it: the
 * next allocation gives the cache back and is retried.
 */
START_TEST(test_limit_trims)
{
	struct gmlake_stats st;
	void *p[40], *q;
	int i;

	for (i = 0; i < 40; i++)
		p[i] = torch_alloc_ok(i & 1 ? 512 * TH_KiB : 2 * TH_MiB, 0, NULL);
	for (i = 0; i < 40; i++)
		gmlake_torch_free(p[i], 0, 0, NULL);
	stats_of(0, &st);
	ck_assert_int_ge(st.reserved_bytes.current, 40 * TH_MiB);
	gmlake_torch_memory_fraction(0.125, 0);	/* 32 MiB */
	q = torch_alloc_ok(4 * TH_MiB, 0, NULL);
	stats_of(0, &st);
	ck_assert_int_le(st.reserved_bytes.current, 32 * TH_MiB);
	ck_assert_uint_gt(st.releases, 0);	/* the cache was given back */
	th_fill_ok(torch_ctx(0), q, 4 * TH_MiB, 9, NULL);
	th_verify_ok(torch_ctx(0), q, 4 * TH_MiB, 9, NULL);
	gmlake_torch_free(q, 0, 0, NULL);
	th_check(torch_ctx(0));
}
END_TEST

/* GMLAKE_DEVICE_LIMIT sets the limit of every context. */
START_TEST(test_limit_env)
{
	char msg[1024];
	void *p;

	ck_assert_int_eq(setenv("GMLAKE_DEVICE_LIMIT", "32M", 1), 0);
	p = torch_alloc_ok(30 * TH_MiB, 1, NULL);
	ck_assert_ptr_null(gmlake_torch_alloc(4 * TH_MiB, 1, NULL));
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 1);
	ck_assert_msg(strstr(msg, "device 1: out of memory allocating 4.00 "
			     "MiB") && strstr(msg, "device limit 32.00 MiB"),
		      "message: %s", msg);
	gmlake_torch_free(p, 0, 1, NULL);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Hooks                                                                  */

/* empty_cache gives every device's free chunks back. */
START_TEST(test_empty_cache)
{
	struct gmlake_stats st;
	void *a = torch_alloc_ok(30 * TH_MiB, 0, NULL);
	void *b = torch_alloc_ok(10 * TH_MiB, 1, NULL);
	void *keep = torch_alloc_ok(2 * TH_MiB, 1, NULL);

	gmlake_torch_free(a, 0, 0, NULL);
	gmlake_torch_free(b, 0, 1, NULL);
	stats_of(0, &st);
	ck_assert_int_ge(st.reserved_bytes.current, 30 * TH_MiB);
	gmlake_torch_empty_cache();
	stats_of(0, &st);
	ck_assert_int_eq(st.reserved_bytes.current, 0);
	stats_of(1, &st);
	ck_assert_int_eq(st.reserved_bytes.current, 2 * TH_MiB);
	th_verify_ok(torch_ctx(1), keep, 0, 0, NULL);
	gmlake_torch_free(keep, 0, 1, NULL);
	th_check(torch_ctx(1));
}
END_TEST

/* Allocate n blocks of size on device 0, free them; the set-access calls
 * the allocations made. */
static uint64_t regrow_round(void **p, int n, size_t size)
{
	struct gmlake_stats a, b;
	int i;

	stats_of(0, &a);
	for (i = 0; i < n; i++)
		p[i] = torch_alloc_ok(size, 0, NULL);
	stats_of(0, &b);
	for (i = 0; i < n; i++)
		gmlake_torch_free(p[i], 0, 0, NULL);
	return b.calls[GMLAKE_CALL_set_access] -
	       a.calls[GMLAKE_CALL_set_access];
}

/*
 * After a burst of empty_cache calls, as cuDNN's benchmark makes them,
 * the memory given back is regrown ahead of need: fewer growths than
 * blocks, never more reserved than before. A lowered limit that gives
 * the cache back (the library's own trim) ends that: one growth a block.
 */
START_TEST(test_empty_cache_burst)
{
	struct gmlake_stats st;
	void *p[24];
	int64_t top;

	/* The device's context, made by a first (small) allocation. */
	gmlake_torch_free(torch_alloc_ok(4096, 0, NULL), 0, 0, NULL);
	ck_assert_uint_eq(regrow_round(p, 24, 8 * TH_MiB), 24);
	stats_of(0, &st);
	top = st.reserved_bytes.peak;
	gmlake_torch_empty_cache();
	gmlake_torch_free(torch_alloc_ok(2 * TH_MiB, 0, NULL), 0, 0, NULL);
	gmlake_torch_empty_cache();
	ck_assert_uint_le(regrow_round(p, 24, 8 * TH_MiB), 16);	/* 14 */
	stats_of(0, &st);
	ck_assert_int_le(st.reserved_bytes.peak, top);
	ck_assert_int_ge(st.reserved_bytes.current, 24 * 8 * TH_MiB);

	gmlake_torch_memory_fraction(0.25, 0);	/* 64 MiB: given back */
	stats_of(0, &st);
	ck_assert_int_le(st.reserved_bytes.current, 64 * TH_MiB);
	gmlake_torch_memory_fraction(1.0, 0);
	ck_assert_uint_ge(regrow_round(p, 24, 8 * TH_MiB), 20);
	th_check(torch_ctx(0));
}
END_TEST

/* record_stream: freed, the block waits for the recorded stream too. */
START_TEST(test_record_stream)
{
	gmlake_ctx *ctx;
	gmlake_stream_t b;
	char msg[512];
	void *x, *y;

	x = torch_alloc_ok(4 * TH_MiB, 0, NULL);
	ctx = torch_ctx(0);
	b = th_stream(ctx);
	th_hold(ctx, b, true);
	gmlake_torch_record_stream(x, b);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 0);
	gmlake_torch_free(x, 4 * TH_MiB, 0, NULL);
	y = torch_alloc_ok(4 * TH_MiB, 0, NULL);
	ck_assert_msg(!th_overlap(x, 4 * TH_MiB, y, 4 * TH_MiB),
		      "%p reused while recorded stream is busy", x);
	th_hold(ctx, b, false);
	th_sync(ctx, b);
	gmlake_torch_free(y, 4 * TH_MiB, 0, NULL);

	/* Unknown pointer: logged, ignored. */
	gmlake_torch_record_stream(x, b);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 1);
	ck_assert_msg(strstr(msg, "not a live"), "message: %s", msg);
	ck_assert_int_eq(gmlake_stream_destroy(ctx, b), 0);
	th_check(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Threads: PyTorch calls from any thread, fresh ones included            */

#define TH_THREADS 8
#define TH_ROUNDS 12
#define TH_OPS 24
#define RACE_DEVICE 3

struct worker {
	pthread_barrier_t *start;
	int id, round;
	gmlake_ctx *seen;	/* the context RACE_DEVICE had for it */
	int err;
	char why[160];
};

__attribute__((format(printf, 3, 4)))
static int worker_fail(struct worker *w, int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(w->why, sizeof(w->why), fmt, ap);
	va_end(ap);
	w->err = err ? err : -EIO;
	return w->err;
}

/* First call of a fresh thread, on a device nobody used yet. */
static int worker_race(struct worker *w)
{
	size_t got = 0;
	void *p;

	pthread_barrier_wait(w->start);
	p = gmlake_torch_alloc(TH_MiB + w->id * 4096, dev(RACE_DEVICE), NULL);
	if (!p)
		return worker_fail(w, -ENOMEM, "race alloc: %s",
				   gmlake_last_error());
	if (gmlake_torch_ctx_get(dev(RACE_DEVICE), &w->seen))
		return worker_fail(w, 0, "race ctx: %s", gmlake_last_error());
	if (gmlake_block_size(w->seen, p, &got) ||
	    got != TH_MiB + w->id * 4096)
		return worker_fail(w, 0, "race block %p not in %p", p,
				   (void *)w->seen);
	gmlake_torch_free(p, got, dev(RACE_DEVICE), NULL);
	return 0;
}

static void *worker_main(void *arg)
{
	struct worker *w = arg;
	struct th_rng rng = { (uint64_t)(w->round * 100 + w->id) };
	void *held[4] = { NULL };
	size_t sizes[4] = { 0 };
	int i, k, ret;

	if (w->round == 0 && worker_race(w))
		return NULL;
	for (i = 0; i < TH_OPS; i++) {
		gmlake_ctx *ctx;
		int d;

		k = (int)th_range(&rng, 0, 3);
		if (held[k]) {
			gmlake_torch_free(held[k], sizes[k], dev(k & 1), NULL);
			held[k] = NULL;
			continue;
		}
		d = dev(k & 1);	/* slot k lives on device k & 1 */
		sizes[k] = (size_t)th_range(&rng, 1, 6 * TH_MiB);
		held[k] = gmlake_torch_alloc(sizes[k], d, NULL);
		if (!held[k])
			return worker_fail(w, -ENOMEM, "alloc %zu on %d: %s",
					   sizes[k], d, gmlake_last_error()),
			       NULL;
		if (gmlake_torch_ctx_get(d, &ctx))
			return worker_fail(w, 0, "ctx %d", d), NULL;
		ret = th_fill(ctx, held[k], sizes[k], (uint64_t)i, NULL);
		if (!ret)
			ret = th_verify(ctx, held[k], sizes[k], (uint64_t)i,
					NULL, NULL);
		if (ret)
			return worker_fail(w, ret < 0 ? ret : -EIO, "block "
					   "%p+%zu: %d", held[k], sizes[k],
					   ret), NULL;
	}
	for (k = 0; k < 4; k++)
		gmlake_torch_free(held[k], sizes[k], dev(k & 1), NULL);
	return NULL;
}

/*
 * Rounds of fresh threads (none has ever made a context current), each
 * allocating, writing, reading back and freeing on two devices; the first
 * round starts by racing to create a third device's context.
 */
START_TEST(test_threads)
{
	struct worker w[TH_THREADS];
	gmlake_ctx *raced = NULL;
	pthread_t t[TH_THREADS];
	pthread_barrier_t start;
	struct gmlake_stats st;
	char msg[512];
	int round, i;

	ck_assert_int_eq(setenv("GMLAKE_EMU_CAPACITY", "1G", 1), 0);
	ck_assert_int_eq(pthread_barrier_init(&start, NULL, TH_THREADS), 0);
	for (round = 0; round < TH_ROUNDS; round++) {
		for (i = 0; i < TH_THREADS; i++) {
			w[i] = (struct worker){ .start = &start, .id = i,
						.round = round };
			ck_assert_int_eq(pthread_create(&t[i], NULL,
							worker_main, &w[i]), 0);
		}
		for (i = 0; i < TH_THREADS; i++)
			ck_assert_int_eq(pthread_join(t[i], NULL), 0);
		for (i = 0; i < TH_THREADS; i++) {
			ck_assert_msg(w[i].err == 0, "round %d thread %d: %s",
				      round, i, w[i].why);
			if (round == 0)
				ck_assert_ptr_eq(w[i].seen, w[0].seen);
		}
		if (round == 0)
			raced = w[0].seen;
	}
	pthread_barrier_destroy(&start);
	ck_assert_ptr_nonnull(raced);
	ck_assert_ptr_eq(torch_ctx(dev(RACE_DEVICE)), raced);
	for (i = 0; i < 2; i++) {
		stats_of(dev(i), &st);
		ck_assert_int_eq(st.active_blocks.current, 0);
		ck_assert_uint_eq(st.allocs, st.frees);
		th_check(torch_ctx(dev(i)));
	}
	if (on_emu) {
		stats_of(RACE_DEVICE, &st);
		ck_assert_uint_eq(st.allocs, TH_THREADS);
	}
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 0);
}
END_TEST


/* Frees by pointer alone find the device; a pool block is parked. */
START_TEST(test_raw_delete)
{
	struct gmlake_stats st;
	char msg[512];
	void *p, *q, *r;

	gmlake_torch_raw_delete(NULL);
	p = torch_alloc_ok(TH_MiB, 0, NULL);
	gmlake_torch_raw_delete(p);		/* one context */
	stats_of(0, &st);
	ck_assert_int_eq(st.active_blocks.current, 0);
	p = torch_alloc_ok(TH_MiB, 0, NULL);
	q = torch_alloc_ok(2 * TH_MiB, dev(1), NULL);
	ck_assert_int_eq(gmlake_torch_pool_begin(dev(1), 3, 0), 0);
	r = gmlake_torch_pool_alloc(TH_MiB, dev(1), NULL, 3, 0);
	gmlake_torch_raw_delete(q);
	gmlake_torch_raw_delete(r);
	gmlake_torch_raw_delete(p);
	ck_assert_int_eq(gmlake_torch_pool_of(dev(1), r, (uint64_t[2]){ 0 }),
			 2);
	stats_of(0, &st);
	ck_assert_int_eq(st.active_blocks.current, dev(1) ? 0 : 1);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 0);
	gmlake_torch_raw_delete((void *)(uintptr_t)0x7000beef0000ull);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 1);
	ck_assert_int_eq(gmlake_torch_pool_end(dev(1), 3, 0), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(dev(1), 3, 0), 0);
	stats_of(dev(1), &st);
	ck_assert_int_eq(st.active_blocks.current, 0);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Private pools (CUDA graphs, MemPool)                                   */

#define POOL_A 7, 0
#define POOL_B 0, 9

static bool overlaps(const void *a, size_t na, const void *b, size_t nb)
{
	uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;

	return x < y + nb && y < x + na;
}

static int pool_of(int device, const void *p)
{
	uint64_t id[2];
	int ret = gmlake_torch_pool_of(device, p, id);

	ck_assert_int_ge(ret, 0);
	return ret;
}

/*
 * The graph-pool corruption case: a block freed inside a capture stays
 * the pool's, an allocation outside never gets its bytes, an allocation
 * into the pool does; the pool's release frees it for real.
 */
START_TEST(test_pool_park)
{
	struct gmlake_stats st;
	char msg[512];
	void *p, *q, *r, *outside;

	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	ck_assert(gmlake_torch_pool_routing(0));
	ck_assert_int_eq(gmlake_torch_pool_use_count(0, POOL_A), 1);
	p = gmlake_torch_pool_alloc(4 * TH_MiB, 0, NULL, POOL_A);
	ck_assert_ptr_nonnull(p);
	ck_assert_int_eq(pool_of(0, p), 1);
	th_fill_ok(torch_ctx(0), p, 4 * TH_MiB, 3, NULL);
	gmlake_torch_free(p, 4 * TH_MiB, 0, NULL);	/* inside the capture */
	ck_assert_int_eq(pool_of(0, p), 2);
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);
	ck_assert(!gmlake_torch_pool_routing(0));

	/* Outside: never the parked bytes, and the pattern stays. */
	outside = torch_alloc_ok(4 * TH_MiB, 0, NULL);
	ck_assert(!overlaps(outside, 4 * TH_MiB, p, 4 * TH_MiB));
	q = torch_alloc_ok(2 * TH_MiB, 0, NULL);
	ck_assert(!overlaps(q, 2 * TH_MiB, p, 4 * TH_MiB));
	th_fill_ok(torch_ctx(0), outside, 4 * TH_MiB, 9, NULL);
	th_verify_ok(torch_ctx(0), p, 4 * TH_MiB, 3, NULL);

	/* Into the pool again (the next capture): the parked block. */
	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	ck_assert_int_eq(gmlake_torch_pool_use_count(0, POOL_A), 2);
	r = gmlake_torch_pool_alloc(4 * TH_MiB - 4096, 0, NULL, POOL_A);
	ck_assert_ptr_eq(r, p);
	ck_assert_int_eq(pool_of(0, r), 1);
	gmlake_torch_free(r, 4 * TH_MiB, 0, NULL);
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);

	/* Two users; the second release frees the parked block. */
	stats_of(0, &st);
	ck_assert_int_eq(st.active_blocks.current, 3);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 1);
	stats_of(0, &st);
	ck_assert_int_eq(st.active_blocks.current, 3);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 0);
	ck_assert_int_eq(pool_of(0, p), 0);
	stats_of(0, &st);
	ck_assert_int_eq(st.active_blocks.current, 2);
	ck_assert_int_eq(gmlake_torch_pool_use_count(0, POOL_A), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), -ENOENT);
	gmlake_torch_free(outside, 4 * TH_MiB, 0, NULL);
	gmlake_torch_free(q, 2 * TH_MiB, 0, NULL);
	stats_of(0, &st);
	ck_assert_int_eq(st.active_blocks.current, 0);
	ck_assert_int_eq(nerrors(msg, sizeof(msg)), 0);
	th_check(torch_ctx(0));
}
END_TEST

/* Reuse inside a pool: same stream, at most twice the size, never a block
 * another stream used. */
START_TEST(test_pool_reuse_rules)
{
	gmlake_stream_t s2;
	void *p, *big, *q, *m, *n;

	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_B), 0);
	p = gmlake_torch_pool_alloc(2 * TH_MiB, 0, NULL, POOL_B);
	big = gmlake_torch_pool_alloc(16 * TH_MiB, 0, NULL, POOL_B);
	ck_assert_ptr_nonnull(p);
	ck_assert_ptr_nonnull(big);
	ck_assert_int_eq(gmlake_stream_create(torch_ctx(0), &s2), 0);
	gmlake_torch_free(p, 2 * TH_MiB, 0, NULL);
	gmlake_torch_free(big, 16 * TH_MiB, 0, NULL);

	/* Another stream: a new block. */
	q = gmlake_torch_pool_alloc(2 * TH_MiB, 0, s2, POOL_B);
	ck_assert(q != p && q != big);
	/* 4 MiB: p (2 MiB) is too small, big (16 MiB) over twice. */
	m = gmlake_torch_pool_alloc(4 * TH_MiB, 0, NULL, POOL_B);
	ck_assert(m != p && m != big);
	/* 9 MiB: big. */
	n = gmlake_torch_pool_alloc(9 * TH_MiB, 0, NULL, POOL_B);
	ck_assert_ptr_eq(n, big);

	/* record_stream: that block is never handed out again. */
	gmlake_torch_record_stream(m, s2);
	gmlake_torch_free(m, 4 * TH_MiB, 0, NULL);
	ck_assert_int_eq(pool_of(0, m), 2);
	n = gmlake_torch_pool_alloc(4 * TH_MiB, 0, NULL, POOL_B);
	ck_assert(n != m);

	gmlake_torch_free(n, 4 * TH_MiB, 0, NULL);
	gmlake_torch_free(big, 9 * TH_MiB, 0, NULL);
	gmlake_torch_free(q, 2 * TH_MiB, 0, NULL);
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_B), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_B), 0);
	ck_assert_int_eq(gmlake_stream_destroy(torch_ctx(0), s2), 0);
	gmlake_torch_empty_cache();
	th_check(torch_ctx(0));
}
END_TEST

/* checkPoolLiveAllocations, and a live block outliving its pool. */
START_TEST(test_pool_live)
{
	struct gmlake_torch_stats ts = {
		.version = GMLAKE_TORCH_STATS_VERSION, .size = sizeof(ts) };
	struct gmlake_stats st;
	void *a, *b, *exp[3];

	ck_assert_int_eq(gmlake_torch_pool_incref(0, POOL_A), 0);
	ck_assert(!gmlake_torch_pool_routing(0));
	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	a = gmlake_torch_pool_alloc(3 * TH_MiB, 0, NULL, POOL_A);
	b = gmlake_torch_pool_alloc(1000, 0, NULL, POOL_A);
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 1);
	exp[0] = b;
	exp[1] = a;
	exp[2] = a;
	ck_assert_int_eq(gmlake_torch_pool_check_live(0, POOL_A, exp, 3), 1);
	ck_assert_int_eq(gmlake_torch_pool_check_live(0, POOL_A, exp, 1), 0);
	ck_assert_int_eq(gmlake_torch_pool_check_live(0, POOL_B, exp, 1), 0);
	ck_assert_int_eq(gmlake_torch_pool_check_live(0, POOL_B, NULL, 0), 1);
	ck_assert_int_eq(gmlake_torch_pool_check_live(0, POOL_A, NULL, 2),
			 -EINVAL);

	/* Parked b is free in PyTorch's figures, allocated in gmlake's. */
	gmlake_torch_free(b, 1000, 0, NULL);
	ck_assert_int_eq(gmlake_torch_pool_check_live(0, POOL_A, exp + 1, 2),
			 1);
	ck_assert_int_eq(gmlake_torch_stats_get(0, &ts), 0);
	stats_of(0, &st);
	ck_assert_int_eq(st.active_blocks.current, 2);
	ck_assert_int_eq(ts.allocation.current, 1);
	ck_assert_int_eq(ts.requested_bytes.current, 3 * TH_MiB);
	ck_assert_int_eq(ts.allocated_bytes.current,
			 st.allocated_bytes.current - 1024);

	/* The last user goes: b is freed, a stays until it is freed. */
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 0);
	ck_assert_int_eq(pool_of(0, a), 1);
	stats_of(0, &st);
	ck_assert_int_eq(st.active_blocks.current, 1);
	gmlake_torch_free(a, 3 * TH_MiB, 0, NULL);
	ck_assert_int_eq(pool_of(0, a), 0);
	stats_of(0, &st);
	ck_assert_int_eq(st.active_blocks.current, 0);
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), -ENOENT);
	th_check(torch_ctx(0));
}
END_TEST

/* While a pool routes (a graph captures), no trim and no stream waits:
 * an allocation that does not fit fails without the retry, empty_cache
 * keeps the cache. */
START_TEST(test_pool_no_trim)
{
	struct gmlake_torch_stats ts = {
		.version = GMLAKE_TORCH_STATS_VERSION, .size = sizeof(ts) };
	struct gmlake_stats st;
	void *p, *q;

	q = torch_alloc_ok(32 * TH_MiB, 0, NULL);
	gmlake_torch_free(q, 32 * TH_MiB, 0, NULL);
	p = torch_alloc_ok(64 * TH_MiB, 0, NULL);
	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	gmlake_torch_empty_cache();
	stats_of(0, &st);
	ck_assert_int_ge(st.reserved_bytes.current, 64 * TH_MiB);
	ck_assert_ptr_null(gmlake_torch_pool_alloc(250 * TH_MiB, 0, NULL,
						   POOL_A));
	ck_assert_int_eq(gmlake_torch_stats_get(0, &ts), 0);
	ck_assert_int_eq(ts.num_alloc_retries, 0);
	ck_assert_int_eq(ts.num_ooms, 1);
	ck_assert_int_eq(ts.num_sync_all_streams, 0);
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);
	ck_assert_ptr_null(gmlake_torch_alloc(250 * TH_MiB, 0, NULL));
	ck_assert_int_eq(gmlake_torch_stats_get(0, &ts), 0);
	ck_assert_int_eq(ts.num_alloc_retries, 1);
	ck_assert_int_eq(ts.num_ooms, 2);
	gmlake_torch_free(p, 64 * TH_MiB, 0, NULL);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 0);
	gmlake_torch_empty_cache();
	stats_of(0, &st);
	ck_assert_int_eq(st.reserved_bytes.current, 0);
}
END_TEST

/*
 * While a private pool takes allocations (a CUDA graph captures, whose
 * streams may not wait on events from outside the capture), a request
 * never takes memory another stream's work still covers: no stream wait,
 * new chunks instead. After the routing ends the same request is ordered.
 */
static void order_case(bool routing, uint64_t *waits, bool *same)
{
	struct gmlake_stats s0, s1;
	gmlake_ctx *ctx;
	gmlake_stream_t a, b;
	void *x, *y;

	ck_assert_int_eq(gml_torch_reset(), 0);
	ck_assert_int_eq(setenv("GMLAKE_EMU_CAPACITY", "16M", 1), 0);
	y = torch_alloc_ok(4096, 0, NULL);		/* makes the context */
	gmlake_torch_free(y, 4096, 0, NULL);
	ctx = torch_ctx(0);
	a = th_stream(ctx);
	b = th_stream(ctx);
	x = torch_alloc_ok(4 * TH_MiB, 0, a);
	th_hold(ctx, a, true);
	gmlake_torch_free(x, 4 * TH_MiB, 0, a);	/* pending: a is held */
	if (routing)
		ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	stats_of(0, &s0);
	y = torch_alloc_ok(4 * TH_MiB, 0, b);
	stats_of(0, &s1);
	*waits = s1.calls[GMLAKE_CALL_stream_wait] -
		 s0.calls[GMLAKE_CALL_stream_wait];
	*same = y == x;
	th_hold(ctx, a, false);
	if (routing) {
		ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);
		ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 0);
	}
	gmlake_torch_free(y, 4 * TH_MiB, 0, b);
	TH_OK(ctx, gmlake_stream_synchronize(ctx, a));
	TH_OK(ctx, gmlake_stream_synchronize(ctx, b));
	TH_OK(ctx, gmlake_stream_destroy(ctx, a));
	TH_OK(ctx, gmlake_stream_destroy(ctx, b));
	ck_assert_int_eq(setenv("GMLAKE_EMU_CAPACITY", "256M", 1), 0);
}

START_TEST(test_no_order_while_routing)
{
	uint64_t waits;
	bool same;

	order_case(true, &waits, &same);
	ck_assert_uint_eq(waits, 0);
	ck_assert(!same);
	order_case(false, &waits, &same);
	ck_assert_uint_eq(waits, 1);
	ck_assert(same);
}
END_TEST

/* A checkpoint of the pool's live blocks, and its restore. */
START_TEST(test_pool_checkpoint)
{
	void *a, *b, *c, *state[4], *freed[4], *bogus = (void *)0x1000;
	int n;

	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	a = gmlake_torch_pool_alloc(2 * TH_MiB, 0, NULL, POOL_A);
	c = gmlake_torch_pool_alloc(3 * TH_MiB, 0, NULL, POOL_A);
	gmlake_torch_free(c, 3 * TH_MiB, 0, NULL);
	n = gmlake_torch_pool_live(0, POOL_A, state, 4);
	ck_assert_int_eq(n, 1);
	ck_assert_ptr_eq(state[0], a);
	ck_assert_int_eq(gmlake_torch_pool_live(0, POOL_A, NULL, 0), 1);

	/* After the checkpoint: a dies, b is made (it takes c's block). */
	gmlake_torch_free(a, 2 * TH_MiB, 0, NULL);
	b = gmlake_torch_pool_alloc(3 * TH_MiB, 0, NULL, POOL_A);
	ck_assert_ptr_eq(b, c);
	ck_assert_int_eq(gmlake_torch_pool_restore(0, POOL_A, state, 1,
						   freed, 0), -ENOSPC);
	ck_assert_int_eq(gmlake_torch_pool_restore(0, POOL_A, &bogus, 1,
						   freed, 4), -ENOENT);
	ck_assert_int_eq(pool_of(0, b), 1);
	ck_assert_int_eq(gmlake_torch_pool_restore(0, POOL_A, state, 1,
						   freed, 4), 1);
	ck_assert_ptr_eq(freed[0], b);
	ck_assert_int_eq(pool_of(0, a), 1);
	ck_assert_int_eq(pool_of(0, b), 2);
	ck_assert_int_eq(gmlake_torch_pool_check_live(0, POOL_A, state, 1), 1);

	gmlake_torch_free(a, 2 * TH_MiB, 0, NULL);
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 0);
	ck_assert_int_eq(pool_of(0, a), 0);
	ck_assert_int_eq(gmlake_torch_pool_restore(0, POOL_A, NULL, 0, NULL,
						   0), -ENOENT);
	th_check(torch_ctx(0));
}
END_TEST

static int nsyncs;

static int count_sync(int device)
{
	ck_assert_int_eq(device, 0);
	nsyncs++;
	return 0;
}

/* The sync hook runs once before a released pool's blocks go. */
START_TEST(test_pool_sync_hook)
{
	void *p;

	nsyncs = 0;
	gmlake_torch_set_sync_hook(count_sync);
	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	p = gmlake_torch_pool_alloc(TH_MiB, 0, NULL, POOL_A);
	gmlake_torch_free(p, TH_MiB, 0, NULL);
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);
	ck_assert_int_eq(nsyncs, 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 0);
	ck_assert_int_eq(nsyncs, 1);
	gmlake_torch_set_sync_hook(NULL);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Pools with an allocator of their own (MemPool(allocator=...))          */

/* A pool allocator on host memory (libgmlake never touches its bytes)
 * that remembers what it handed out, to check each free against it. */
struct fake_src {
	int allocs, frees, dones;
	int fail;			/* allocations left before NULL; <0 none */
	size_t last_size;
	int last_dev;
	gmlake_stream_t last_stream;
	void *ptr[16];
	size_t size[16];
	int n;
};

static void *fake_alloc(size_t size, int device, gmlake_stream_t s, void *u)
{
	struct fake_src *f = u;
	void *p;

	f->last_size = size;
	f->last_dev = device;
	f->last_stream = s;
	if (!f->fail || f->n == 16)
		return NULL;
	if (f->fail > 0)
		f->fail--;
	p = malloc(size);
	ck_assert_ptr_nonnull(p);
	f->ptr[f->n] = p;
	f->size[f->n++] = size;
	f->allocs++;
	return p;
}

static void fake_free(void *ptr, size_t size, int device, gmlake_stream_t s,
		      void *u)
{
	struct fake_src *f = u;
	int i;

	(void)s;
	ck_assert_int_eq(device, f->last_dev);	/* one device a test */
	for (i = 0; i < f->n && f->ptr[i] != ptr; i++)
		;
	ck_assert_msg(i < f->n, "free of %p, never allocated or freed twice",
		      ptr);
	ck_assert_uint_eq(size, f->size[i]);
	f->ptr[i] = f->ptr[--f->n];
	f->size[i] = f->size[f->n];
	free(ptr);
	f->frees++;
}

static void fake_done(void *u)
{
	struct fake_src *f = u;

	ck_assert_int_eq(f->n, 0);	/* after every segment went back */
	f->dones++;
}

static void set_fake_source(int device, uint64_t id0, uint64_t id1,
			    struct fake_src *f, int expect)
{
	struct gmlake_torch_pool_source src = {
		.alloc = fake_alloc, .free = fake_free, .done = fake_done,
		.user = f };

	ck_assert_int_eq(gmlake_torch_pool_set_source(device, id0, id1, &src),
			 expect);
}

static void torch_figures(int device, struct gmlake_torch_stats *ts)
{
	*ts = (struct gmlake_torch_stats){
		.version = GMLAKE_TORCH_STATS_VERSION, .size = sizeof(*ts) };
	ck_assert_int_eq(gmlake_torch_stats_get(device, ts), 0);
}

START_TEST(test_pool_source_bad)
{
	struct fake_src f = { .fail = -1 }, g = { .fail = -1 };
	struct gmlake_torch_pool_source src = {
		.alloc = fake_alloc, .free = fake_free, .user = &f };
	struct gmlake_torch_pool_segment seg;
	void *p;

	ck_assert_int_eq(gmlake_torch_pool_set_source(-1, POOL_A, &src),
			 -EINVAL);
	ck_assert_int_eq(gmlake_torch_pool_set_source(0, POOL_A, NULL),
			 -EINVAL);
	src.free = NULL;
	ck_assert_int_eq(gmlake_torch_pool_set_source(0, POOL_A, &src),
			 -EINVAL);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "src->free"));
	/* No pool, or one without users. */
	set_fake_source(0, POOL_A, &f, -ENOENT);
	/* A pool with libgmlake's blocks cannot change its memory. */
	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_B), 0);
	p = gmlake_torch_pool_alloc(TH_MiB, 0, NULL, POOL_B);
	ck_assert_ptr_nonnull(p);
	set_fake_source(0, POOL_B, &f, -EBUSY);
	gmlake_torch_free(p, TH_MiB, 0, NULL);
	set_fake_source(0, POOL_B, &f, -EBUSY);	/* parked still counts */
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_B), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_B), 0);
	/* The first source stays; a second is not used. */
	ck_assert_int_eq(gmlake_torch_pool_incref(0, POOL_A), 0);
	set_fake_source(0, POOL_A, &f, 0);
	set_fake_source(0, POOL_A, &g, 1);
	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	p = gmlake_torch_pool_alloc(TH_MiB, 0, NULL, POOL_A);
	ck_assert_ptr_nonnull(p);
	ck_assert_int_eq(f.allocs, 1);
	ck_assert_int_eq(g.allocs, 0);
	ck_assert_int_eq(gmlake_torch_pool_segments(-1, POOL_A, &seg, 1),
			 -EINVAL);
	ck_assert_int_eq(gmlake_torch_pool_segments(0, POOL_A, NULL, 1),
			 -EINVAL);
	gmlake_torch_free(p, TH_MiB, 0, NULL);
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 1);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 0);
	ck_assert_int_eq(f.frees, 1);
	ck_assert_int_eq(f.dones, 1);
	ck_assert_int_eq(g.dones, 0);	/* never the pool's */
}
END_TEST

/*
 * Each block of a pool with its own allocator is a segment of its own
 * from it (rounded up to 2 MiB), none of libgmlake's memory; freed, it is
 * parked and reused at the same address by the pool's rules; the pool's
 * end gives every segment back after the sync hook, then calls done.
 */
START_TEST(test_pool_source_park)
{
	gmlake_stream_t s2 = (gmlake_stream_t)(uintptr_t)0x1000;
	struct gmlake_torch_pool_segment seg[4];
	struct gmlake_torch_stats ts;
	struct fake_src f = { .fail = -1 };
	struct gmlake_stats st;
	void *p, *q, *r;

	nsyncs = 0;
	gmlake_torch_set_sync_hook(count_sync);
	ck_assert_int_eq(gmlake_torch_pool_incref(0, POOL_A), 0);
	set_fake_source(0, POOL_A, &f, 0);
	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	p = gmlake_torch_pool_alloc(3 * TH_MiB + 5, 0, NULL, POOL_A);
	ck_assert_ptr_nonnull(p);
	ck_assert_int_eq(f.allocs, 1);
	ck_assert_uint_eq(f.last_size, 4 * TH_MiB);
	ck_assert_int_eq(f.last_dev, 0);
	ck_assert_ptr_eq(f.ptr[0], p);
	stats_of(0, &st);			/* nothing of ours */
	ck_assert_int_eq(st.chunks.current, 0);
	ck_assert_uint_eq(st.allocs, 0);
	ck_assert_int_eq(pool_of(0, p), 1);

	torch_figures(0, &ts);
	ck_assert_int_eq(ts.reserved_bytes.current, 4 * TH_MiB);
	ck_assert_int_eq(ts.allocated_bytes.current, 4 * TH_MiB);
	ck_assert_int_eq(ts.requested_bytes.current, 3 * TH_MiB + 5);
	ck_assert_int_eq(ts.segment.current, 1);
	ck_assert_int_eq(ts.allocation.current, 1);
	ck_assert_int_eq(gmlake_torch_pool_segments(0, POOL_A, seg, 4), 1);
	ck_assert_uint_eq(seg[0].address, (uintptr_t)p);
	ck_assert_uint_eq(seg[0].size, 4 * TH_MiB);
	ck_assert_uint_eq(seg[0].requested, 3 * TH_MiB + 5);
	ck_assert_uint_eq(seg[0].pool_id[0], 7);
	ck_assert_int_eq(seg[0].parked, 0);
	ck_assert_int_eq(gmlake_torch_pool_segments(0, POOL_B, seg, 4), 0);
	ck_assert_int_eq(gmlake_torch_pool_segments(0, 0, 0, seg, 4), 1);

	/* Freed: parked, free to PyTorch's eyes, reserved still. */
	gmlake_torch_free(p, 3 * TH_MiB + 5, 0, NULL);
	ck_assert_int_eq(f.frees, 0);
	ck_assert_int_eq(pool_of(0, p), 2);
	torch_figures(0, &ts);
	ck_assert_int_eq(ts.allocated_bytes.current, 0);
	ck_assert_int_eq(ts.reserved_bytes.current, 4 * TH_MiB);
	ck_assert_int_eq(gmlake_torch_pool_segments(0, POOL_A, seg, 4), 1);
	ck_assert_int_eq(seg[0].parked, 1);

	/* Same stream, fits: the same segment, no new one. */
	q = gmlake_torch_pool_alloc(3 * TH_MiB, 0, NULL, POOL_A);
	ck_assert_ptr_eq(q, p);
	ck_assert_int_eq(f.allocs, 1);
	/* Another stream: a segment of its own. */
	r = gmlake_torch_pool_alloc(3 * TH_MiB, 0, s2, POOL_A);
	ck_assert_ptr_nonnull(r);
	ck_assert_ptr_ne(r, p);
	ck_assert_int_eq(f.allocs, 2);
	ck_assert_ptr_eq(f.last_stream, s2);
	/* Used on another stream: never reused in the pool. */
	gmlake_torch_record_stream(q, s2);
	gmlake_torch_free(q, 3 * TH_MiB, 0, NULL);
	p = gmlake_torch_pool_alloc(3 * TH_MiB, 0, NULL, POOL_A);
	ck_assert_ptr_ne(p, q);
	ck_assert_int_eq(f.allocs, 3);
	/* By pointer alone, as PyTorch's deleter frees. */
	gmlake_torch_raw_delete(p);
	gmlake_torch_raw_delete(r);
	ck_assert_int_eq(pool_of(0, p), 2);
	ck_assert_int_eq(f.frees, 0);
	torch_figures(0, &ts);
	ck_assert_int_eq(ts.reserved_bytes.current, 12 * TH_MiB);
	ck_assert_int_eq(ts.reserved_bytes.peak, 12 * TH_MiB);
	ck_assert_int_eq(ts.allocated_bytes.current, 0);
	/* As for libgmlake's pool blocks, the peak counts parked ones. */
	ck_assert_int_eq(ts.allocated_bytes.peak, 12 * TH_MiB);

	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 1);
	ck_assert_int_eq(nsyncs, 0);
	ck_assert_int_eq(f.frees, 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 0);
	ck_assert_int_eq(nsyncs, 1);
	ck_assert_int_eq(f.frees, 3);
	ck_assert_int_eq(f.dones, 1);
	torch_figures(0, &ts);
	ck_assert_int_eq(ts.reserved_bytes.current, 0);
	ck_assert_int_eq(ts.segment.current, 0);
	ck_assert_int_eq(gmlake_torch_pool_segments(0, 0, 0, seg, 4), 0);
	stats_of(0, &st);
	ck_assert_int_eq(st.chunks.peak, 0);
	ck_assert_uint_eq(st.allocs, 0);
	gmlake_torch_set_sync_hook(NULL);
}
END_TEST

/* A segment outliving its pool goes back at its own free, after the sync
 * hook, and done follows it; an allocator with no memory is PyTorch's
 * out of memory. */
START_TEST(test_pool_source_outlives)
{
	struct gmlake_torch_stats ts;
	struct fake_src f = { .fail = 1 };
	void *p;

	nsyncs = 0;
	gmlake_torch_set_sync_hook(count_sync);
	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_B), 0);
	set_fake_source(0, POOL_B, &f, 0);
	p = gmlake_torch_pool_alloc(TH_MiB, 0, NULL, POOL_B);
	ck_assert_ptr_nonnull(p);
	ck_assert_uint_eq(f.last_size, 2 * TH_MiB);
	ck_assert_ptr_null(gmlake_torch_pool_alloc(TH_MiB, 0, NULL, POOL_B));
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "out of memory"));
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "own allocator"));
	ck_assert_int_eq(f.allocs, 1);
	torch_figures(0, &ts);
	ck_assert_int_eq(ts.num_ooms, 1);
	ck_assert_int_eq(ts.allocation.current, 1);

	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_B), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_B), 0);
	ck_assert_int_eq(f.frees, 0);
	ck_assert_int_eq(f.dones, 0);
	ck_assert_int_eq(pool_of(0, p), 1);
	gmlake_torch_raw_delete(p);
	ck_assert_int_eq(nsyncs, 1);
	ck_assert_int_eq(f.frees, 1);
	ck_assert_int_eq(f.dones, 1);
	ck_assert_int_eq(pool_of(0, p), 0);
	torch_figures(0, &ts);
	ck_assert_int_eq(ts.allocation.current, 0);
	ck_assert_int_eq(ts.reserved_bytes.current, 0);
	gmlake_torch_set_sync_hook(NULL);
}
END_TEST

/* A pool allocator for threads: counts only. */
struct count_src {
	atomic_int allocs, frees, dones;
};

static void *count_alloc(size_t size, int device, gmlake_stream_t s,
			 void *u)
{
	struct count_src *c = u;

	(void)device;
	(void)s;
	atomic_fetch_add(&c->allocs, 1);
	return malloc(size);
}

static void count_free(void *ptr, size_t size, int device,
		       gmlake_stream_t s, void *u)
{
	struct count_src *c = u;

	(void)size;
	(void)device;
	(void)s;
	free(ptr);
	atomic_fetch_add(&c->frees, 1);
}

static void count_done(void *u)
{
	struct count_src *c = u;

	atomic_fetch_add(&c->dones, 1);
}

struct src_worker {
	pthread_barrier_t *start;
	int id;
	void *kept;		/* live when its thread ends */
	int err;
};

static void *src_worker_main(void *arg)
{
	struct src_worker *w = arg;
	gmlake_stream_t s = (gmlake_stream_t)(uintptr_t)(0x1000 * (w->id + 1));

	pthread_barrier_wait(w->start);
	for (int i = 0; i < 200; i++) {
		size_t size = (size_t)(1 + (i + w->id) % 5) * TH_MiB;
		void *p = gmlake_torch_pool_alloc(size, 0, s, POOL_A);

		if (!p) {
			w->err = 1;
			return NULL;
		}
		if (i % 7 == 3)
			gmlake_torch_record_stream(p, NULL);
		if (i == 199)
			w->kept = p;
		else
			gmlake_torch_raw_delete(p);
	}
	return NULL;
}

/* Threads allocate into a pool with its own allocator and free by
 * pointer; the pool ends while each still holds a block, which goes
 * back at its free: every segment returns once, done once, after. */
START_TEST(test_pool_source_threads)
{
	struct count_src c = { 0 };
	struct gmlake_torch_pool_source src = {
		.alloc = count_alloc, .free = count_free, .done = count_done,
		.user = &c };
	struct src_worker w[TH_THREADS];
	pthread_t t[TH_THREADS];
	pthread_barrier_t start;
	struct gmlake_torch_stats ts;

	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	ck_assert_int_eq(gmlake_torch_pool_set_source(0, POOL_A, &src), 0);
	ck_assert_int_eq(pthread_barrier_init(&start, NULL, TH_THREADS), 0);
	for (int i = 0; i < TH_THREADS; i++) {
		w[i] = (struct src_worker){ .start = &start, .id = i };
		ck_assert_int_eq(pthread_create(&t[i], NULL, src_worker_main,
						&w[i]), 0);
	}
	for (int i = 0; i < TH_THREADS; i++)
		ck_assert_int_eq(pthread_join(t[i], NULL), 0);
	pthread_barrier_destroy(&start);
	for (int i = 0; i < TH_THREADS; i++)
		ck_assert_msg(!w[i].err, "thread %d: %s", i,
			      gmlake_last_error());
	ck_assert_int_eq(gmlake_torch_pool_end(0, POOL_A), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(0, POOL_A), 0);
	ck_assert_int_eq(atomic_load(&c.dones), 0);
	ck_assert_int_eq(atomic_load(&c.frees),
			 atomic_load(&c.allocs) - TH_THREADS);
	for (int i = 0; i < TH_THREADS; i++)
		gmlake_torch_raw_delete(w[i].kept);
	ck_assert_int_eq(atomic_load(&c.frees), atomic_load(&c.allocs));
	ck_assert_int_eq(atomic_load(&c.dones), 1);
	torch_figures(0, &ts);
	ck_assert_int_eq(ts.segment.current, 0);
	ck_assert_int_eq(ts.reserved_bytes.current, 0);
}
END_TEST

/* A segment on a device where libgmlake allocated nothing else, beside a
 * context on another: freed by pointer alone, it is found on its own
 * device (the device gets a context with its first segment). */
START_TEST(test_pool_source_other_device)
{
	struct fake_src f = { .fail = -1 };
	void *a, *p;

	a = torch_alloc_ok(TH_MiB, dev(0), NULL);
	ck_assert_int_eq(gmlake_torch_pool_begin(dev(1), POOL_B), 0);
	set_fake_source(dev(1), POOL_B, &f, 0);
	p = gmlake_torch_pool_alloc(TH_MiB, dev(1), NULL, POOL_B);
	ck_assert_ptr_nonnull(p);
	gmlake_torch_raw_delete(p);
	ck_assert_int_eq(pool_of(dev(1), p), 2);
	ck_assert_int_eq(f.frees, 0);
	ck_assert_int_eq(gmlake_torch_pool_end(dev(1), POOL_B), 0);
	ck_assert_int_eq(gmlake_torch_pool_release(dev(1), POOL_B), 0);
	ck_assert_int_eq(f.frees, 1);
	gmlake_torch_raw_delete(a);
	th_check(torch_ctx(dev(0)));
}
END_TEST

/* A process's reset (and so the tests' teardown) gives segments back. */
START_TEST(test_pool_source_reset)
{
	struct fake_src f = { .fail = -1 };

	ck_assert_int_eq(gmlake_torch_pool_incref(0, POOL_A), 0);
	set_fake_source(0, POOL_A, &f, 0);
	ck_assert_int_eq(gmlake_torch_pool_begin(0, POOL_A), 0);
	ck_assert_ptr_nonnull(gmlake_torch_pool_alloc(5 * TH_MiB, 0, NULL,
						      POOL_A));
	ck_assert_int_eq(gml_torch_reset(), 0);
	ck_assert_int_eq(f.frees, 1);
	ck_assert_int_eq(f.dones, 1);
	ck_assert_int_eq(gml_pool_source_device(f.ptr[0]), -1);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* PyTorch's statistics, snapshots, history                               */

START_TEST(test_torch_stats)
{
	struct gmlake_torch_stats ts = {
		.version = GMLAKE_TORCH_STATS_VERSION, .size = sizeof(ts) };
	struct gmlake_torch_stats bad = { .version = 99, .size = sizeof(bad) };
	struct gmlake_stats st;
	void *p, *q;

	/* No context yet: zeros. */
	ck_assert_int_eq(gmlake_torch_stats_get(0, &ts), 0);
	ck_assert_int_eq(ts.allocated_bytes.current, 0);
	ck_assert_int_eq(gmlake_torch_stats_get(0, &bad), -EINVAL);
	ck_assert_int_eq(gmlake_torch_stats_get(-1, &ts), -EINVAL);

	p = torch_alloc_ok(8 * TH_MiB, 0, NULL);
	q = torch_alloc_ok(100, 0, NULL);
	gmlake_torch_free(q, 100, 0, NULL);
	ck_assert_int_eq(gmlake_torch_stats_get(0, &ts), 0);
	stats_of(0, &st);
	ck_assert_int_eq(ts.allocated_bytes.current, st.allocated_bytes.current);
	ck_assert_int_eq(ts.allocated_bytes.peak, st.allocated_bytes.peak);
	ck_assert_int_eq(ts.allocated_bytes.allocated - ts.allocated_bytes.freed,
			 ts.allocated_bytes.current);
	ck_assert_int_eq(ts.reserved_bytes.current, st.reserved_bytes.current);
	ck_assert_int_eq(ts.requested_bytes.current, 8 * TH_MiB);
	ck_assert_int_eq(ts.allocation.current, 1);
	ck_assert_int_eq(ts.allocation.allocated, 2);
	ck_assert_int_eq(ts.allocation.freed, 1);
	ck_assert_int_eq(ts.segment.current, st.chunks.current);
	ck_assert_int_eq(ts.num_device_alloc,
			 (int64_t)st.calls[GMLAKE_CALL_mem_create]);
	ck_assert_int_eq(ts.num_ooms, 0);

	/* Out of memory counts; accumulated figures start again from 0. */
	ck_assert_ptr_null(gmlake_torch_alloc(64 * TH_GiB, 0, NULL));
	ck_assert_int_eq(gmlake_torch_stats_get(0, &ts), 0);
	ck_assert_int_eq(ts.num_ooms, 1);
	ck_assert_int_eq(gmlake_torch_stats_reset_accumulated(0), 0);
	ck_assert_int_eq(gmlake_torch_stats_get(0, &ts), 0);
	ck_assert_int_eq(ts.num_ooms, 0);
	ck_assert_int_eq(ts.allocation.allocated, 0);
	ck_assert_int_eq(ts.allocation.freed, 0);
	ck_assert_int_eq(ts.allocation.current, 1);
	gmlake_torch_free(p, 8 * TH_MiB, 0, NULL);
	ck_assert_int_eq(gmlake_torch_stats_get(0, &ts), 0);
	ck_assert_int_eq(ts.allocation.freed, 1);
	ck_assert_int_eq(ts.allocated_bytes.peak, 8 * TH_MiB + 512);
	ck_assert_int_eq(gmlake_torch_stats_reset_peaks(0), 0);
	ck_assert_int_eq(gmlake_torch_stats_get(0, &ts), 0);
	ck_assert_int_eq(ts.allocated_bytes.peak, 0);
}
END_TEST

/* The pieces tile each range; allocated pieces are the live blocks. */
static void check_snapshot(gmlake_ctx *ctx, int64_t *requested,
			   size_t *nstitched)
{
	struct gmlake_snapshot *snap = NULL;

	ck_assert_int_eq(gmlake_snapshot_take(ctx, &snap), 0);
	ck_assert_uint_eq(snap->version, GMLAKE_SNAPSHOT_VERSION);
	*requested = 0;
	*nstitched = 0;
	for (size_t i = 0; i < snap->nranges; i++) {
		const struct gmlake_snap_range *r = &snap->ranges[i];
		uint64_t addr = r->address, sum = 0;

		ck_assert_uint_gt(r->count, 0);
		ck_assert_uint_le(r->first + r->count, snap->npieces);
		if (r->kind == GMLAKE_RANGE_STITCHED)
			(*nstitched)++;
		for (uint32_t j = 0; j < r->count; j++) {
			const struct gmlake_snap_piece *p =
				&snap->pieces[r->first + j];

			ck_assert_uint_eq(p->address, addr);
			addr += p->size;
			sum += p->size;
			if (p->state == GMLAKE_PIECE_ALLOCATED)
				*requested += (int64_t)p->requested;
		}
		ck_assert_uint_eq(sum, r->size);
	}
	gmlake_snapshot_free(snap);
}

START_TEST(test_snapshot)
{
	struct gmlake_stats st;
	size_t nstitched, cached = 0, largest = 0;
	int64_t requested;
	void *a[8];
	int i;

	ck_assert_int_eq(gmlake_snapshot_take(NULL, NULL), -EINVAL);
	for (i = 0; i < 8; i++)
		a[i] = torch_alloc_ok(i % 2 ? 6 * TH_MiB : 3000, 0, NULL);
	/* Holes between live blocks, then a request that must stitch. */
	for (i = 1; i < 8; i += 4)
		gmlake_torch_free(a[i], 6 * TH_MiB, 0, NULL);
	a[1] = torch_alloc_ok(10 * TH_MiB, 0, NULL);
	a[5] = NULL;
	check_snapshot(torch_ctx(0), &requested, &nstitched);
	stats_of(0, &st);
	ck_assert_int_eq(requested, st.requested_bytes.current);
	ck_assert_int_eq(gmlake_cache_info(torch_ctx(0), &cached, &largest), 0);
	ck_assert_int_eq(gmlake_torch_cache_info(0, &largest), 0);
	ck_assert_uint_gt(largest, 0);
	for (i = 0; i < 8; i++)
		if (a[i])
			gmlake_torch_free(a[i], 0, 0, NULL);
	check_snapshot(torch_ctx(0), &requested, &nstitched);
	ck_assert_int_eq(requested, 0);
	gmlake_torch_empty_cache();
	ck_assert_int_eq(gmlake_cache_info(torch_ctx(0), &cached, NULL), 0);
	ck_assert_uint_eq(cached, 0);
}
END_TEST

static int count_events(int device, int action)
{
	struct gmlake_torch_event ev[256];
	int n = gmlake_torch_history_read(device, ev, 256), k = 0;

	ck_assert_int_ge(n, 0);
	for (int i = 0; i < n; i++)
		k += ev[i].action == (uint32_t)action;
	return k;
}

START_TEST(test_history)
{
	struct gmlake_torch_event ev[8];
	void *p, *q;

	ck_assert(!gmlake_torch_history_enabled());
	p = torch_alloc_ok(TH_MiB, 0, NULL);	/* before: not recorded */
	ck_assert_int_eq(gmlake_torch_history_start(0, 0, NULL, false),
			 -EINVAL);
	ck_assert_int_eq(gmlake_torch_history_start(100, 0, NULL, true), 0);
	ck_assert(gmlake_torch_history_enabled());
	q = torch_alloc_ok(32 * TH_MiB, 0, NULL);
	gmlake_torch_free(q, 32 * TH_MiB, 0, NULL);
	gmlake_torch_free(p, TH_MiB, 0, NULL);
	ck_assert_ptr_null(gmlake_torch_alloc(64 * TH_GiB, 0, NULL));
	gmlake_torch_empty_cache();
	gmlake_torch_history_mark(0);
	ck_assert_int_eq(count_events(0, GMLAKE_TORCH_ALLOC), 1);
	ck_assert_int_eq(count_events(0, GMLAKE_TORCH_FREE_REQUESTED), 2);
	ck_assert_int_eq(count_events(0, GMLAKE_TORCH_FREE_COMPLETED), 2);
	ck_assert_int_eq(count_events(0, GMLAKE_TORCH_OOM), 1);
	/* q's memory came as a new segment or as a segment's growth. */
	ck_assert_int_ge(count_events(0, GMLAKE_TORCH_SEGMENT_ALLOC) +
			 count_events(0, GMLAKE_TORCH_SEGMENT_MAP), 1);
	ck_assert_int_ge(count_events(0, GMLAKE_TORCH_SEGMENT_FREE) +
			 count_events(0, GMLAKE_TORCH_SEGMENT_UNMAP), 1);
	ck_assert_int_eq(count_events(0, GMLAKE_TORCH_SNAPSHOT), 1);
	ck_assert_int_eq(gmlake_torch_history_read(0, ev, 1), 1);
	ck_assert_msg(ev[0].action == GMLAKE_TORCH_SEGMENT_ALLOC ||
		      ev[0].action == GMLAKE_TORCH_SEGMENT_MAP,
		      "first event %u", ev[0].action);
	ck_assert_int_eq(gmlake_torch_history_read(0, ev, 2), 2);
	ck_assert_uint_eq(ev[1].action, GMLAKE_TORCH_ALLOC);
	ck_assert_uint_eq(ev[1].addr, (uintptr_t)q);
	ck_assert_uint_eq(ev[1].size, 32 * TH_MiB);

	/* A small ring keeps the newest; skipped actions are left out. */
	ck_assert_int_eq(gmlake_torch_history_start(
				 2, 1u << GMLAKE_TORCH_FREE_REQUESTED, NULL,
				 true), 0);
	p = torch_alloc_ok(TH_MiB, 0, NULL);
	gmlake_torch_free(p, TH_MiB, 0, NULL);
	ck_assert_int_eq(gmlake_torch_history_read(0, NULL, 0), 2);
	ck_assert_int_eq(count_events(0, GMLAKE_TORCH_FREE_REQUESTED), 0);
	ck_assert_int_eq(count_events(0, GMLAKE_TORCH_FREE_COMPLETED), 1);
	gmlake_torch_history_stop(true);
	ck_assert(!gmlake_torch_history_enabled());
	ck_assert_int_eq(gmlake_torch_history_read(0, NULL, 0), 0);
	ck_assert_int_eq(gmlake_torch_history_read(-1, NULL, 0), -EINVAL);
}
END_TEST

/* Contexts from the owner's hooks: each made is freed once. */
static int ctx_made, ctx_freed;
static uint64_t ticks;

static uint64_t test_clock(void)
{
	return ++ticks;
}

static void *test_context(int action)
{
	int *c = malloc(sizeof(*c));

	ck_assert_ptr_nonnull(c);
	*c = action;
	ctx_made++;
	return c;
}

static void *test_context_dup(void *c)
{
	return test_context(*(int *)c);
}

static void test_context_free(void *c)
{
	ctx_freed++;
	free(c);
}

START_TEST(test_history_hooks)
{
	const struct gmlake_torch_history_hooks hooks = {
		.clock = test_clock, .context = test_context,
		.context_dup = test_context_dup,
		.context_free = test_context_free,
	};
	struct gmlake_torch_event ev[4];
	int n;

	ctx_made = ctx_freed = 0;
	ticks = 0;
	ck_assert_int_eq(gmlake_torch_history_start(4, 0, &hooks, true), 0);
	for (int i = 0; i < 5; i++) {
		void *p = torch_alloc_ok(TH_MiB, 0, NULL);

		gmlake_torch_free(p, TH_MiB, 0, NULL);
	}
	/* The ring kept the newest 4; older contexts were freed. */
	ck_assert_int_eq(ctx_made - ctx_freed, 4);
	n = gmlake_torch_history_read(0, ev, 4);
	ck_assert_int_eq(n, 4);
	ck_assert_int_eq(ctx_made - ctx_freed, 8);
	for (int i = 0; i < n; i++) {
		ck_assert_int_eq(*(int *)ev[i].context, (int)ev[i].action);
		if (i)
			ck_assert_uint_gt(ev[i].time, ev[i - 1].time);
		test_context_free(ev[i].context);
	}
	ck_assert_uint_eq(ev[3].action, GMLAKE_TORCH_FREE_COMPLETED);
	gmlake_torch_history_stop(true);
	ck_assert_int_eq(ctx_made, ctx_freed);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* CUDA IPC (torch.multiprocessing)                                       */

/* A block shared and opened again (on another device's context where
 * the emulated device has one): the same bytes; the sender's descriptors
 * stay open until the block is freed, one set however often it is shared. */
START_TEST(test_ipc_share_open)
{
	size_t size = 5 * TH_CHUNK, len = 0, len2 = 0;
	char h[512], h2[512];
	void *p, *q = NULL;
	int fds;

	p = torch_alloc_ok(size, dev(0), NULL);
	th_fill_ok(torch_ctx(dev(0)), p, size, 11, NULL);
	(void)torch_alloc_ok(1, dev(1), NULL);	/* the receiver's context */
	fds = th_count_fds();
	ck_assert_int_eq(gmlake_torch_ipc_share(dev(0), p, h, sizeof(h),
						&len), 0);
	ck_assert_int_gt(th_count_fds(), fds);
	ck_assert_int_eq(gmlake_torch_ipc_share(dev(0), p, h2, sizeof(h2),
						&len2), 0);
	ck_assert_uint_eq(len2, len);
	ck_assert_mem_eq(h, h2, len);
	ck_assert_int_eq(gmlake_torch_ipc_share(dev(0), p, h2, 8, &len2),
			 -ENOSPC);
	ck_assert_uint_eq(len2, len);
	ck_assert_int_eq(gmlake_torch_ipc_open(dev(1), h, len, &q), 0);
	ck_assert_ptr_nonnull(q);
	th_verify_ok(torch_ctx(dev(1)), q, size, 11, NULL);
	ck_assert_int_eq(gmlake_torch_ipc_close(dev(1), q), 0);
	ck_assert_int_eq(gmlake_torch_ipc_close(dev(1), q), -EINVAL);
	gmlake_torch_free(p, size, dev(0), NULL);
	ck_assert_int_eq(th_count_fds(), fds);
}
END_TEST

/* A child process opens the parent's handle with pidfd_getfd, or is told
 * clearly why it may not (no ptrace access: exit 3). */
START_TEST(test_ipc_child_opens)
{
	size_t size = 3 * TH_CHUNK, len = 0;
	char h[512];
	int status;
	void *p;
	pid_t pid;

	if (!on_emu)
		return;		/* CUDA state does not survive fork() */
	p = torch_alloc_ok(size, 0, NULL);
	th_fill_ok(torch_ctx(0), p, size, 12, NULL);
	ck_assert_int_eq(gmlake_torch_ipc_share(0, p, h, sizeof(h), &len), 0);
	fflush(NULL);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		void *q = NULL;
		int ret;

		/* Device 1: a context of the child's own (the parent's
		 * device 0 context is a copy it must not use). */
		ret = gmlake_torch_ipc_open(1, h, len, &q);
		if (ret == -EPERM && strstr(gmlake_last_error(), "ptrace"))
			_exit(3);
		if (ret) {
			fprintf(stderr, "child: %d %s\n", ret,
				gmlake_last_error());
			_exit(1);
		}
		_exit(!th_verify(torch_ctx(1), q, size, 12, NULL, NULL) &&
		      !gmlake_torch_ipc_close(1, q) ? 0 : 4);
	}
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFEXITED(status));
	ck_assert_msg(WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == 3,
		      "the child failed: status %d", WEXITSTATUS(status));
	gmlake_torch_free(p, size, 0, NULL);
}
END_TEST

START_TEST(test_ipc_bad_handles)
{
	char h[512], bad[512];
	size_t len = 0;
	void *p, *q = NULL;

	ck_assert_int_eq(gmlake_torch_ipc_open(dev(0), "short", 5, &q),
			 -EINVAL);
	memset(bad, 'x', sizeof(bad));
	ck_assert_int_eq(gmlake_torch_ipc_open(dev(0), bad, sizeof(bad), &q),
			 -EINVAL);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "another CUDA "
				     "allocator"));
	p = torch_alloc_ok(TH_CHUNK, dev(0), NULL);
	ck_assert_int_eq(gmlake_torch_ipc_share(dev(0), p, h, sizeof(h),
						&len), 0);
	/* One byte short of its pieces. */
	ck_assert_int_eq(gmlake_torch_ipc_open(dev(0), h, len - 1, &q),
			 -EINVAL);
	ck_assert_int_eq(gmlake_torch_ipc_open(dev(0), h, len, NULL),
			 -EINVAL);
	ck_assert_int_eq(gmlake_torch_ipc_share(dev(0), (char *)p + 512, h,
						sizeof(h), &len), -EINVAL);
	ck_assert_ptr_null(q);
	gmlake_torch_free(p, TH_CHUNK, dev(0), NULL);
}
END_TEST

static Suite *torch_suite(void)
{
	Suite *s = suite_create("torch");
	TCase *tc;

	tc = th_tcase(s, "Contexts");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_lazy_ctx);
	tcase_add_test(tc, test_bad_device);
	tcase_add_test(tc, test_size_zero);
	tcase_add_test(tc, test_init);

	tc = th_tcase(s, "Misuse");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_unknown_pointer);
	tcase_add_test(tc, test_double_free);

	tc = th_tcase(s, "IPC");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_ipc_share_open);
	tcase_add_test(tc, test_ipc_child_opens);
	tcase_add_test(tc, test_ipc_bad_handles);

	tc = th_tcase(s, "Threads");
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_threads);

	if (th_env_is_emu()) {
		tc = th_tcase(s, "Limits");
		tcase_add_checked_fixture(tc, setup, teardown);
		tcase_add_test(tc, test_oom_message);
		tcase_add_test(tc, test_memory_fraction);
		tcase_add_test(tc, test_limit_trims);
		tcase_add_test(tc, test_limit_env);

		tc = th_tcase(s, "Hooks");
		tcase_add_checked_fixture(tc, setup, teardown);
		tcase_add_test(tc, test_empty_cache);
		tcase_add_test(tc, test_empty_cache_burst);
		tcase_add_test(tc, test_record_stream);

		tc = th_tcase(s, "Pools");
		tcase_add_checked_fixture(tc, setup, teardown);
		tcase_add_test(tc, test_pool_park);
		tcase_add_test(tc, test_pool_reuse_rules);
		tcase_add_test(tc, test_pool_live);
		tcase_add_test(tc, test_pool_sync_hook);
		tcase_add_test(tc, test_pool_no_trim);
		tcase_add_test(tc, test_no_order_while_routing);
		tcase_add_test(tc, test_pool_checkpoint);
		tcase_add_test(tc, test_raw_delete);
		tcase_add_test(tc, test_pool_source_bad);
		tcase_add_test(tc, test_pool_source_park);
		tcase_add_test(tc, test_pool_source_outlives);
		tcase_add_test(tc, test_pool_source_reset);
		tcase_add_test(tc, test_pool_source_threads);
		tcase_add_test(tc, test_pool_source_other_device);

		tc = th_tcase(s, "Figures");
		tcase_add_checked_fixture(tc, setup, teardown);
		tcase_add_test(tc, test_torch_stats);
		tcase_add_test(tc, test_snapshot);
		tcase_add_test(tc, test_history);
		tcase_add_test(tc, test_history_hooks);
	}
	return s;
}

int main(void)
{
	int probe = th_probe();

	if (probe)
		return probe;
	return th_run_suite(torch_suite());
}
