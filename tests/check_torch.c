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
		tcase_add_test(tc, test_record_stream);
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
