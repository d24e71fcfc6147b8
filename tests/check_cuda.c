/* SPDX-License-Identifier: MIT */
/*
 * Checks of the CUDA backend (lib/drv_cuda.c), through its operations table.
 *
 * Without a GPU only the "open" case runs: opening a device must fail
 * cleanly with -ENODEV and a message, and the program returns its result.
 * With a GPU, the cases tagged "gpu" drive the real driver too: the
 * granularity, a stitched range of two chunks with copies through it and
 * events, context entry from a fresh thread, and error paths that must
 * return -errno without crashing.
 *
 * CUDA state does not survive fork(), and Check forks every test, so CUDA
 * is only initialised inside tests (checked fixtures) and in a throwaway
 * probe child, never in main.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "drv.h"
#include "error.h"
#include "gmlake.h"

/* GPU setup (cuInit, primary context) can take seconds on a cold device. */
#define GPU_TIMEOUT 60

static const struct gml_drv_ops *ops = &gml_drv_cuda;
static void *dev;
static size_t gran;

/* The message of the last failure names op. */
static void assert_error_names(const char *op)
{
	const char *msg = gmlake_last_error();

	ck_assert_ptr_nonnull(msg);
	ck_assert_msg(strstr(msg, op), "message \"%s\" does not name %s", msg, op);
}

/*
 * Open device 0 without a GPU: -ENODEV (or -EOPNOTSUPP for a driver too
 * old or a device without VMM) and a message, each time open is called.
 * With a usable GPU, open succeeds. Either way a device that does not
 * exist is -ENODEV.
 */
START_TEST(test_open)
{
	struct gmlake_config cfg;
	void *priv = NULL;
	int ret;

	memset(&cfg, 0, sizeof(cfg));
	ret = ops->open(&cfg, &priv);
	if (ret == 0) {
		ck_assert_ptr_nonnull(priv);
		ops->close(priv);
	} else {
		ck_assert_msg(ret == -ENODEV || ret == -EOPNOTSUPP,
			      "open: %d (%s)", ret, gmlake_last_error());
		ck_assert_str_ne(gmlake_last_error(), "");
		gml_clear_error();
		ck_assert_int_eq(ops->open(&cfg, &priv), ret);
		ck_assert_str_ne(gmlake_last_error(), "");
	}

	cfg.device = 1 << 20;
	ret = ops->open(&cfg, &priv);
	ck_assert_msg(ret == -ENODEV || ret == -EOPNOTSUPP,
		      "open device %d: %d (%s)", cfg.device, ret, gmlake_last_error());
	ck_assert_str_ne(gmlake_last_error(), "");
	cfg.device = -1;
	ret = ops->open(&cfg, &priv);
	ck_assert_msg(ret == -ENODEV || ret == -EOPNOTSUPP,
		      "open device %d: %d (%s)", cfg.device, ret, gmlake_last_error());
}
END_TEST

/* Checked fixture: device 0 open and its context current. */
static void gpu_setup(void)
{
	struct gmlake_config cfg;

	memset(&cfg, 0, sizeof(cfg));
	ck_assert_int_eq(ops->open(&cfg, &dev), 0);
	ck_assert_int_eq(ops->enter(dev), 0);
	ck_assert_int_eq(ops->granularity(dev, &gran), 0);
}

static void gpu_teardown(void)
{
	ops->leave(dev);
	ops->close(dev);
}

START_TEST(test_granularity)
{
	size_t avail = 0, total = 0;
	gml_handle h;

	ck_assert_uint_ge(gran, 4096);
	ck_assert_uint_eq(gran & (gran - 1), 0);
	ck_assert_int_eq(ops->mem_info(dev, &avail, &total), 0);
	ck_assert_uint_gt(avail, gran);
	ck_assert_uint_ge(total, avail);

	ck_assert_int_eq(ops->mem_create(dev, gran, &h), 0);
	ck_assert_int_eq(ops->mem_release(dev, h), 0);
}
END_TEST

static void fill(uint32_t *w, size_t n)
{
	size_t i;

	for (i = 0; i < n; i++)
		w[i] = (uint32_t)i * 2654435761u ^ 0x5a5aa5a5u;
}

/*
 * Stitch: two chunks created apart (a third, released, between them) are
 * mapped in reverse order into one reserved range, with one set_access.
 * A pattern goes in across the chunk boundary, a device-to-device copy
 * moves part of it, and it comes back out, ordered on one stream and
 * waited for with an event. Then the first-created chunk alone is mapped
 * at a new address and shows the bytes it held in the second half.
 */
START_TEST(test_stitch)
{
	size_t n = 2 * gran, half = gran / 2;
	gml_handle h0, h1, spacer;
	unsigned char *in, *out;
	gmlake_stream_t s = NULL;
	gml_va va, va2;
	gml_event ev;
	int ret;

	in = malloc(n);
	out = malloc(n);
	ck_assert_ptr_nonnull(in);
	ck_assert_ptr_nonnull(out);
	fill((uint32_t *)in, n / sizeof(uint32_t));
	memset(out, 0, n);

	ck_assert_int_eq(ops->mem_create(dev, gran, &h0), 0);
	ck_assert_int_eq(ops->mem_create(dev, gran, &spacer), 0);
	ck_assert_int_eq(ops->mem_create(dev, gran, &h1), 0);
	ck_assert_int_eq(ops->mem_release(dev, spacer), 0);

	ck_assert_int_eq(ops->va_reserve(dev, n, gran, &va), 0);
	ck_assert_uint_eq(va % gran, 0);
	ck_assert_int_eq(ops->mem_map(dev, va, gran, h1), 0);
	ck_assert_int_eq(ops->mem_map(dev, va + gran, gran, h0), 0);
	ck_assert_int_eq(ops->set_access(dev, va, n, NULL, 0), 0);

	ck_assert_int_eq(ops->stream_create(dev, &s), 0);
	ck_assert_ptr_nonnull(s);
	ck_assert_int_eq(ops->event_create(dev, &ev), 0);

	/* in -> [va, va+n); [va, va+half) -> [va+n-half, va+n); back out. */
	ck_assert_int_eq(ops->memcpy_async(dev, (void *)(uintptr_t)va, in, n,
					   GML_COPY_HTOD, s), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, (void *)(uintptr_t)(va + n - half),
					   (void *)(uintptr_t)va, half, GML_COPY_DTOD, s), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, out, (void *)(uintptr_t)va, n,
					   GML_COPY_DTOH, s), 0);
	ck_assert_int_eq(ops->event_record(dev, ev, s), 0);
	ret = ops->event_query(dev, ev);
	ck_assert_msg(ret == 0 || ret == -EBUSY, "event_query: %d", ret);
	ck_assert_int_eq(ops->event_sync(dev, ev), 0);
	ck_assert_int_eq(ops->event_query(dev, ev), 0);
	ck_assert_int_eq(memcmp(out, in, n - half), 0);
	ck_assert_int_eq(memcmp(out + n - half, in, half), 0);

	ck_assert_int_eq(ops->mem_unmap(dev, va, gran), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, va + gran, gran), 0);

	/* h0 alone, elsewhere: in[gran, gran+half) then in[0, half). */
	memset(out, 0, n);
	ck_assert_int_eq(ops->va_reserve(dev, gran, gran, &va2), 0);
	ck_assert_int_eq(ops->mem_map(dev, va2, gran, h0), 0);
	ck_assert_int_eq(ops->set_access(dev, va2, gran, NULL, 0), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, out, (void *)(uintptr_t)va2, gran,
					   GML_COPY_DTOH, s), 0);
	ck_assert_int_eq(ops->stream_sync(dev, s), 0);
	ck_assert_int_eq(ops->stream_sync(dev, NULL), 0);
	ck_assert_int_eq(memcmp(out, in + gran, half), 0);
	ck_assert_int_eq(memcmp(out + half, in, half), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, va2, gran), 0);
	ck_assert_int_eq(ops->va_free(dev, va2, gran), 0);

	ck_assert_int_eq(ops->event_destroy(dev, ev), 0);
	ck_assert_int_eq(ops->stream_destroy(dev, s), 0);
	ck_assert_int_eq(ops->mem_release(dev, h0), 0);
	ck_assert_int_eq(ops->mem_release(dev, h1), 0);
	ck_assert_int_eq(ops->va_free(dev, va, n), 0);
	free(out);
	free(in);
}
END_TEST

/* What a fresh thread sees around enter/leave; see test_enter_thread. */
struct enter_result {
	int before, enter, inside, nested, after_inner, after;
	char msg[256];
};

static void *enter_thread(void *arg)
{
	struct enter_result *res = arg;
	size_t avail, total;

	res->before = ops->mem_info(dev, &avail, &total);
	snprintf(res->msg, sizeof(res->msg), "%s", gmlake_last_error());
	res->enter = ops->enter(dev);
	if (res->enter)
		return NULL;
	res->inside = ops->mem_info(dev, &avail, &total);
	res->nested = ops->enter(dev);
	if (!res->nested)
		ops->leave(dev);
	res->after_inner = ops->mem_info(dev, &avail, &total);
	ops->leave(dev);
	res->after = ops->mem_info(dev, &avail, &total);
	return NULL;
}

/*
 * A thread without a context cannot call the driver; enter makes the
 * context current, a nested enter/leave keeps it, the outer leave pops it.
 */
START_TEST(test_enter_thread)
{
	size_t avail, total;
	struct enter_result res;
	pthread_t t;

	memset(&res, 0, sizeof(res));
	ck_assert_int_eq(pthread_create(&t, NULL, enter_thread, &res), 0);
	ck_assert_int_eq(pthread_join(t, NULL), 0);
	ck_assert_int_lt(res.before, 0);
	ck_assert_msg(strstr(res.msg, "cuMemGetInfo"), "message: %s", res.msg);
	ck_assert_int_eq(res.enter, 0);
	ck_assert_int_eq(res.inside, 0);
	ck_assert_int_eq(res.nested, 0);
	ck_assert_int_eq(res.after_inner, 0);
	ck_assert_int_lt(res.after, 0);

	/* This thread is inside (fixture); a nested pair changes nothing. */
	ck_assert_int_eq(ops->enter(dev), 0);
	ops->leave(dev);
	ck_assert_int_eq(ops->mem_info(dev, &avail, &total), 0);
}
END_TEST

/* Misuse gives -errno and a message naming the call, and harms nothing. */
START_TEST(test_errors)
{
	gml_handle h;
	gml_va va;
	int ret;

	ret = ops->mem_create(dev, gran + 1, &h);
	ck_assert_int_eq(ret, -EINVAL);
	assert_error_names("cuMemCreate");

	/* Map into, and free again, a range reserved and freed. */
	ck_assert_int_eq(ops->mem_create(dev, gran, &h), 0);
	ck_assert_int_eq(ops->va_reserve(dev, gran, gran, &va), 0);
	ck_assert_int_eq(ops->va_free(dev, va, gran), 0);
	ret = ops->mem_map(dev, va, gran, h);
	ck_assert_int_eq(ret, -EINVAL);
	assert_error_names("cuMemMap");
	ret = ops->va_free(dev, va, gran);
	ck_assert_int_eq(ret, -EINVAL);
	assert_error_names("cuMemAddressFree");

	/* Release twice. */
	ck_assert_int_eq(ops->mem_release(dev, h), 0);
	ret = ops->mem_release(dev, h);
	ck_assert_int_eq(ret, -EINVAL);
	assert_error_names("cuMemRelease");

	ret = ops->stream_destroy(dev, NULL);
	ck_assert_int_eq(ret, -EINVAL);
	ret = ops->memcpy_async(dev, NULL, NULL, 0, (enum gml_copy_kind)42, NULL);
	ck_assert_int_eq(ret, -EINVAL);

	/* The device still works. */
	ck_assert_int_eq(ops->mem_create(dev, gran, &h), 0);
	ck_assert_int_eq(ops->mem_release(dev, h), 0);
}
END_TEST

static Suite *cuda_suite(void)
{
	Suite *s = suite_create("cuda");
	TCase *tc;

	tc = tcase_create("open");
	tcase_set_timeout(tc, GPU_TIMEOUT);
	tcase_add_test(tc, test_open);
	suite_add_tcase(s, tc);

	tc = tcase_create("vmm");
	tcase_set_tags(tc, "gpu");
	tcase_set_timeout(tc, GPU_TIMEOUT);
	tcase_add_checked_fixture(tc, gpu_setup, gpu_teardown);
	tcase_add_test(tc, test_granularity);
	tcase_add_test(tc, test_stitch);
	suite_add_tcase(s, tc);

	tc = tcase_create("context");
	tcase_set_tags(tc, "gpu");
	tcase_set_timeout(tc, GPU_TIMEOUT);
	tcase_add_checked_fixture(tc, gpu_setup, gpu_teardown);
	tcase_add_test(tc, test_enter_thread);
	suite_add_tcase(s, tc);

	tc = tcase_create("errors");
	tcase_set_tags(tc, "gpu");
	tcase_set_timeout(tc, GPU_TIMEOUT);
	tcase_add_checked_fixture(tc, gpu_setup, gpu_teardown);
	tcase_add_test(tc, test_errors);
	suite_add_tcase(s, tc);
	return s;
}

/* Whether device 0 opens, asked in a child so no CUDA state stays here. */
static bool have_gpu(void)
{
	struct gmlake_config cfg;
	void *priv;
	int status;
	pid_t pid;

	pid = fork();
	if (pid < 0)
		return false;
	if (pid == 0) {
		memset(&cfg, 0, sizeof(cfg));
		if (ops->open(&cfg, &priv))
			_exit(1);
		ops->close(priv);
		_exit(0);
	}
	if (waitpid(pid, &status, 0) != pid)
		return false;
	return WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

int main(void)
{
	bool gpu = have_gpu();
	SRunner *sr;
	int failed;

	sr = srunner_create(cuda_suite());
	if (gpu) {
		srunner_run_all(sr, CK_ENV);
	} else {
		printf("check_cuda: no usable GPU, running only the cases without one\n");
		srunner_run_tagged(sr, NULL, NULL, NULL, "gpu", CK_ENV);
	}
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
