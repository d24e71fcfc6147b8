/* SPDX-License-Identifier: MIT */
/*
 * check_ipc: blocks shared with other processes (lib/ipc.c).
 *
 * A block exported on one context and imported on another (a second
 * emulated device has its own memory file, as a second process would)
 * must show the same bytes both ways, whatever the block is made of:
 * single chunks, growth handles it uses part of, a stitch, a small block's
 * shared chunk. The fork case imports in a real second process from
 * inherited descriptors. Bad descriptions and failed driver calls must
 * leave nothing mapped, no handle and no descriptor behind.
 */
#include "helpers.h"

#include <sys/resource.h>

#include "gmlake-ipc.h"
#include "gmlake-offload.h"
#include "types.h"

#define CHUNKS(n) ((size_t)(n) * TH_CHUNK)

/* The structure every export must have: the block inside its pieces,
 * the last piece needed, whole granules. */
static void expect_well_formed(const struct gmlake_ipc_block *blk,
			       size_t size)
{
	uint64_t sum = 0;

	ck_assert_uint_ge(blk->npieces, 1);
	ck_assert_uint_ge(blk->size, size);
	ck_assert_uint_lt(blk->start, blk->pieces[0].size);
	for (uint32_t i = 0; i < blk->npieces; i++) {
		ck_assert_int_ge(blk->pieces[i].fd, 0);
		ck_assert_uint_eq(blk->pieces[i].size % TH_CHUNK, 0);
		sum += blk->pieces[i].size;
	}
	ck_assert_uint_le(blk->start + blk->size, sum);
	ck_assert_uint_gt(blk->start + blk->size,
			  sum - blk->pieces[blk->npieces - 1].size);
}

/*
 * Export ptr (size bytes, holding seed's pattern) from a, import it on b,
 * and check both directions: b reads the pattern, a reads what b wrote.
 * Returns the number of pieces.
 */
static uint32_t roundtrip(gmlake_ctx *a, gmlake_ctx *b, void *ptr, size_t size,
			  uint64_t seed)
{
	struct gmlake_ipc_block blk;
	uint64_t blk_size;
	uint32_t n;
	void *q = NULL;

	TH_OK(a, gmlake_ipc_export(a, ptr, &blk));
	expect_well_formed(&blk, size);
	blk_size = blk.size;
	TH_OK(b, gmlake_ipc_import(b, &blk, &q));
	ck_assert_ptr_nonnull(q);
	n = blk.npieces;
	/* The descriptors are the exporter's to close, the mapping stays. */
	gmlake_ipc_block_free(&blk);
	ck_assert_uint_eq(blk.npieces, 0);
	/* The public copies take the imported block, and only the block. */
	th_verify_ok(b, q, size, seed, NULL);
	th_fill_ok(b, q, size, seed + 1, NULL);
	th_verify_ok(a, ptr, size, seed + 1, NULL);
	{
		char c[2];

		TH_ERR(b, gmlake_memcpy_dtoh(b, c, (char *)q + blk_size - 1,
					     2, NULL), -EINVAL);
	}
	TH_OK(b, gmlake_ipc_close(b, q));
	TH_ERR(b, gmlake_memcpy_dtoh(b, &n, q, 1, NULL), -EINVAL);
	return n;
}

START_TEST(test_single_chunks)
{
	gmlake_ctx *a, *b;
	void *p = NULL;
	int fds;

	/* The CUDA driver opens descriptors of its own on the process's
	 * first context and keeps them: count after one came and went. */
	th_destroy(th_ctx(0));
	fds = th_count_fds();
	a = th_ctx(0);
	b = th_ctx(0);

	p = th_alloc_filled(a, CHUNKS(3), 1, NULL);
	ck_assert_uint_ge(roundtrip(a, b, p, CHUNKS(3), 1), 1);
	TH_OK(a, gmlake_free(a, p));
	th_destroy(b);
	th_destroy(a);
	ck_assert_int_eq(th_count_fds(), fds);
}
END_TEST

/* A block of growth handles, and one that begins inside a handle: the
 * importer maps that handle whole and starts past its front. */
START_TEST(test_growth_handles)
{
	gmlake_ctx *a = th_ctx(0), *b = th_ctx(0);
	void *big = NULL, *front = NULL, *back = NULL;
	struct gmlake_ipc_block blk;

	big = th_alloc_filled(a, CHUNKS(15), 2, NULL);
	roundtrip(a, b, big, CHUNKS(15), 2);
	TH_OK(a, gmlake_free(a, big));
	/* Two blocks of half a growth handle: the second lies in the back
	 * half of the handle the first holds the front of. */
	front = th_alloc_filled(a, CHUNKS(5), 3, NULL);
	back = th_alloc_filled(a, CHUNKS(5), 4, NULL);
	TH_OK(a, gmlake_ipc_export(a, back, &blk));
	ck_assert_uint_eq(blk.npieces, 1);
	ck_assert_uint_eq(blk.pieces[0].size, CHUNKS(10));
	ck_assert_uint_eq(blk.start, CHUNKS(5));
	gmlake_ipc_block_free(&blk);
	roundtrip(a, b, back, CHUNKS(5), 4);
	roundtrip(a, b, front, CHUNKS(5), 3);
	TH_OK(a, gmlake_free(a, front));
	TH_OK(a, gmlake_free(a, back));
	th_destroy(b);
	th_destroy(a);
}
END_TEST

/* A stitched block: chunks of two freed blocks under one range. */
START_TEST(test_stitched)
{
	gmlake_ctx *a, *b = th_ctx(0);
	void *p[4] = { NULL }, *s = NULL;
	struct gmlake_stats st;

	if (!th_env_is_emu()) {
		th_destroy(b);
		return;		/* needs a device this small */
	}
	a = th_ctx(CHUNKS(8));
	for (int i = 0; i < 4; i++)
		TH_OK(a, gmlake_alloc(a, &p[i], CHUNKS(i % 2 ? 1 : 3), NULL));
	TH_OK(a, gmlake_free(a, p[0]));
	TH_OK(a, gmlake_free(a, p[2]));
	s = th_alloc_filled(a, CHUNKS(6), 4, NULL);
	th_stats(a, &st);
	ck_assert_uint_ge(st.stitches, 1);
	ck_assert_uint_ge(roundtrip(a, b, s, CHUNKS(6), 4), 2);
	TH_OK(a, gmlake_free(a, s));
	TH_OK(a, gmlake_free(a, p[1]));
	TH_OK(a, gmlake_free(a, p[3]));
	th_destroy(b);
	th_destroy(a);
}
END_TEST

/* A long-lived block that grew as one handle (a span) is one piece. */
START_TEST(test_span)
{
	gmlake_ctx *a = th_ctx(0), *b = th_ctx(0);
	struct gmlake_ipc_block blk;
	void *first = NULL, *p;

	/* A span grows at the end of a segment: make one first. */
	TH_OK(a, gmlake_alloc(a, &first, CHUNKS(1), NULL));
	TH_OK(a, gmlake_long_lived(a, true));
	p = th_alloc_filled(a, CHUNKS(20), 31, NULL);
	TH_OK(a, gmlake_long_lived(a, false));
	TH_OK(a, gmlake_ipc_export(a, p, &blk));
	ck_assert_uint_eq(blk.npieces, 1);
	ck_assert_uint_eq(blk.pieces[0].size, CHUNKS(20));
	ck_assert_uint_eq(blk.start, 0);
	gmlake_ipc_block_free(&blk);
	ck_assert_uint_eq(roundtrip(a, b, p, CHUNKS(20), 31), 1);
	TH_OK(a, gmlake_free(a, p));
	TH_OK(a, gmlake_free(a, first));
	th_destroy(b);
	th_destroy(a);
}
END_TEST

/* A small block is its place in a shared chunk. */
START_TEST(test_small_block)
{
	gmlake_ctx *a = th_ctx(0), *b = th_ctx(0);
	void *x = NULL, *y = NULL;

	x = th_alloc_filled(a, 4096, 5, NULL);
	y = th_alloc_filled(a, 4096, 6, NULL);
	ck_assert_uint_eq(roundtrip(a, b, y, 4096, 6), 1);
	/* Its neighbour is untouched. */
	th_verify_ok(a, x, 4096, 5, NULL);
	TH_OK(a, gmlake_free(a, x));
	TH_OK(a, gmlake_free(a, y));
	th_destroy(b);
	th_destroy(a);
}
END_TEST

/* A second process imports from descriptors it inherited. */
START_TEST(test_fork_child_imports)
{
	gmlake_ctx *a;
	struct gmlake_ipc_block blk;
	void *p = NULL;
	int status;
	pid_t pid;

	if (!th_env_is_emu())
		return;		/* CUDA state does not survive fork() */
	a = th_ctx(0);
	p = th_alloc_filled(a, CHUNKS(5), 7, NULL);
	TH_OK(a, gmlake_ipc_export(a, p, &blk));
	fflush(NULL);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		struct gmlake_config cfg;
		gmlake_ctx *c = NULL;
		void *q = NULL;
		int ok = !th_config_init(&cfg) &&
			 !gmlake_ctx_init(&c, &cfg) &&
			 !gmlake_ipc_import(c, &blk, &q) &&
			 !th_verify(c, q, CHUNKS(5), 7, NULL, NULL) &&
			 !th_fill(c, q, CHUNKS(5), 8, NULL) &&
			 !gmlake_ipc_close(c, q) &&
			 !gmlake_ctx_destroy(c, false);

		if (!ok)
			fprintf(stderr, "child: %s\n", gmlake_last_error());
		_exit(ok ? 0 : 1);
	}
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
		      "the importing child failed (status %#x)", status);
	th_verify_ok(a, p, CHUNKS(5), 8, NULL);
	gmlake_ipc_block_free(&blk);
	TH_OK(a, gmlake_free(a, p));
	th_destroy(a);
}
END_TEST

START_TEST(test_bad_input)
{
	gmlake_ctx *a = th_ctx(0), *b = th_ctx(0);
	struct gmlake_ipc_block blk, bad;
	struct gmlake_ipc_piece pc;
	void *p = NULL, *q = (void *)0x1;

	TH_OK(a, gmlake_alloc(a, &p, CHUNKS(2), NULL));
	TH_ERR(a, gmlake_ipc_export(NULL, p, &blk), -EINVAL);
	TH_ERR(a, gmlake_ipc_export(a, NULL, &blk), -EINVAL);
	TH_ERR(a, gmlake_ipc_export(a, p, NULL), -EINVAL);
	TH_ERR(a, gmlake_ipc_export(a, (char *)p + 4096, &blk), -EINVAL);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "start of a live"));
	ck_assert_uint_eq(blk.npieces, 0);
	ck_assert_ptr_null(blk.pieces);
	gmlake_ipc_block_free(NULL);

	TH_OK(a, gmlake_ipc_export(a, p, &blk));
	TH_ERR(b, gmlake_ipc_import(b, NULL, &q), -EINVAL);
	TH_ERR(b, gmlake_ipc_import(b, &blk, NULL), -EINVAL);
	bad = blk;
	bad.npieces = 0;
	TH_ERR(b, gmlake_ipc_import(b, &bad, &q), -EINVAL);
	bad = blk;
	bad.size = blk.size + TH_CHUNK * 64;
	TH_ERR(b, gmlake_ipc_import(b, &bad, &q), -EINVAL);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "does not fit"));
	bad = blk;
	bad.start = blk.pieces[0].size;
	TH_ERR(b, gmlake_ipc_import(b, &bad, &q), -EINVAL);
	pc = blk.pieces[0];
	pc.size = 4096;
	bad = blk;
	bad.npieces = 1;
	bad.pieces = &pc;
	bad.size = 4096;
	TH_ERR(b, gmlake_ipc_import(b, &bad, &q), -EINVAL);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "granules"));
	pc = blk.pieces[0];
	pc.fd = -1;
	TH_ERR(b, gmlake_ipc_import(b, &bad, &q), -EINVAL);
	ck_assert_ptr_eq(q, (void *)0x1);	/* untouched on failure */
	TH_ERR(b, gmlake_ipc_close(b, p), -EINVAL);
	TH_ERR(b, gmlake_ipc_close(NULL, p), -EINVAL);
	gmlake_ipc_block_free(&blk);
	TH_OK(a, gmlake_free(a, p));
	th_destroy(b);
	th_destroy(a);
}
END_TEST

/*
 * In a child with few descriptors left: export raises the soft limit to
 * the hard one and goes on; where the hard limit is as low, it fails with
 * -EMFILE, saying so, and leaves nothing open.
 */
static int export_limited(rlim_t soft, rlim_t hard)
{
	struct gmlake_config cfg;
	gmlake_ctx *a = NULL;
	struct gmlake_ipc_block blk;
	struct rlimit rl;
	void *p = NULL;
	int fds, ret;

	if (th_config_init(&cfg) || gmlake_ctx_init(&a, &cfg) ||
	    gmlake_alloc(a, &p, CHUNKS(6), NULL))
		return 10;
	fds = th_count_fds();
	rl.rlim_cur = (rlim_t)fds + soft;
	rl.rlim_max = (rlim_t)fds + hard;
	if (setrlimit(RLIMIT_NOFILE, &rl))
		return 11;
	ret = gmlake_ipc_export(a, p, &blk);
	if (ret == -EMFILE) {
		if (!strstr(gmlake_last_error(), "ulimit") || blk.npieces ||
		    th_count_fds() != fds)
			return 12;
		return 2;
	}
	if (ret || blk.npieces != 6)
		return 13;
	gmlake_ipc_block_free(&blk);
	return th_count_fds() == fds ? 0 : 14;
}

START_TEST(test_descriptor_limit)
{
	static const struct { rlim_t soft, hard; int want; } cases[] = {
		{ 3, 64, 0 },	/* raised, then enough */
		{ 3, 3, 2 },	/* the hard limit: -EMFILE */
	};

	if (!th_env_is_emu())
		return;		/* CUDA state does not survive fork() */
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		int status;
		pid_t pid;

		fflush(NULL);
		pid = fork();
		ck_assert_int_ge(pid, 0);
		if (pid == 0)
			_exit(export_limited(cases[i].soft, cases[i].hard));
		ck_assert_int_eq(waitpid(pid, &status, 0), pid);
		ck_assert(WIFEXITED(status));
		ck_assert_int_eq(WEXITSTATUS(status), cases[i].want);
	}
}
END_TEST

/* With exportable memory off, export says so. */
START_TEST(test_unexportable)
{
	struct gmlake_config cfg;
	struct gmlake_ipc_block blk;
	gmlake_ctx *a;
	void *p = NULL;

	th_config(&cfg, 0);
	cfg.exportable = false;
	a = th_ctx_cfg(&cfg);
	TH_OK(a, gmlake_alloc(a, &p, CHUNKS(2), NULL));
	TH_ERR(a, gmlake_ipc_export(a, p, &blk), -EOPNOTSUPP);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "unexportable"));
	ck_assert_uint_eq(blk.npieces, 0);
	TH_OK(a, gmlake_free(a, p));
	th_destroy(a);
}
END_TEST

/* An exported block stays where it is: no spill takes its memory. */
START_TEST(test_exported_stays)
{
	gmlake_ctx *a = th_ctx(0);
	struct gmlake_ipc_block blk;
	struct gml_block *b;
	void *p = NULL;

	TH_OK(a, gmlake_alloc(a, &p, CHUNKS(3), NULL));
	b = gml_ptrmap_get(&a->blocks, (uintptr_t)p);
	ck_assert_ptr_nonnull(b);
	ck_assert_int_eq(gml_large_detach(a, b, true), 0);
	TH_OK(a, gmlake_ipc_export(a, p, &blk));
	ck_assert_int_eq(gml_large_detach(a, b, true), -EBUSY);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "gmlake_ipc_export"));
	gmlake_ipc_block_free(&blk);
	TH_OK(a, gmlake_free(a, p));
	th_destroy(a);
}
END_TEST

/* Through an offload ring: the exported block's spill completes with
 * -EBUSY and it stays; a block beside it that was not exported spills. */
START_TEST(test_exported_ring_spill)
{
	gmlake_ctx *a = th_ctx(0);
	struct gmlake_offload ring;
	struct gmlake_ipc_block blk;
	void *p[2];
	int res[2] = { 1, 1 };

	p[0] = th_alloc_filled(a, CHUNKS(3), 21, NULL);
	p[1] = th_alloc_filled(a, CHUNKS(3), 22, NULL);
	TH_OK(a, gmlake_ipc_export(a, p[0], &blk));
	TH_OK(a, gmlake_offload_init(&ring, a, 8, 0));
	for (int i = 0; i < 2; i++) {
		struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(&ring);

		ck_assert_ptr_nonnull(sqe);
		gmlake_offload_prep_spill(sqe, p[i]);
		gmlake_offload_sqe_set_data(sqe, (uint64_t)i);
	}
	ck_assert_int_eq(gmlake_offload_submit(&ring), 2);
	for (int i = 0; i < 2; i++) {
		struct gmlake_offload_cqe *cqe;

		TH_OK(a, gmlake_offload_wait_cqe(&ring, &cqe));
		res[gmlake_offload_cqe_get_data(cqe)] = cqe->res;
		gmlake_offload_cqe_seen(&ring, cqe);
	}
	ck_assert_int_eq(res[0], -EBUSY);
	ck_assert_int_eq(res[1], 0);
	th_verify_ok(a, p[0], CHUNKS(3), 21, NULL);	/* still on the device */
	TH_OK(a, gmlake_offload_exit(&ring));
	gmlake_ipc_block_free(&blk);
	TH_OK(a, gmlake_free(a, p[0]));
	TH_OK(a, gmlake_free(a, p[1]));
	th_destroy(a);
}
END_TEST

/* Every driver call of an export or import failing in turn: the error
 * comes back, and nothing stays mapped, held or open. */
START_TEST(test_faults_leave_nothing)
{
	static const int calls[] = {
		GML_CALL_mem_export, GML_CALL_mem_import, GMLAKE_CALL_va_reserve,
		GMLAKE_CALL_mem_map, GMLAKE_CALL_set_access,
		GMLAKE_CALL_mem_release,
	};
	gmlake_ctx *a, *b;
	struct gml_emu_info before, after;
	void *p = NULL;

	if (!th_env_is_emu())
		return;		/* counts the emulated device's objects */
	a = th_ctx(0);
	b = th_ctx(0);
	p = th_alloc_filled(a, CHUNKS(3), 9, NULL);
	for (size_t k = 0; k < sizeof(calls) / sizeof(calls[0]); k++) {
		for (uint64_t nth = 1; nth <= 3; nth++) {
			struct gmlake_ipc_block blk;
			gmlake_ctx *who = calls[k] == GML_CALL_mem_export ?
					  a : b;
			int fds, ret;
			void *q = NULL;

			if (calls[k] == GML_CALL_mem_export) {
				fds = th_count_fds();
				gml_dev_fail_nth(th_dev(a), calls[k], nth, EIO);
				ret = gmlake_ipc_export(a, p, &blk);
				gml_dev_fail_nth(th_dev(a), -1, 0, 0);
				ck_assert_int_eq(ret, -EIO);
				ck_assert_int_eq(th_count_fds(), fds);
				ck_assert_uint_eq(blk.npieces, 0);
				th_check(a);
				continue;
			}
			TH_OK(a, gmlake_ipc_export(a, p, &blk));
			fds = th_count_fds();
			th_emu_info(b, &before);
			gml_dev_fail_nth(th_dev(who), calls[k], nth, EIO);
			ret = gmlake_ipc_import(b, &blk, &q);
			gml_dev_fail_nth(th_dev(who), -1, 0, 0);
			th_emu_info(b, &after);
			if (ret == 0) {
				/* fewer calls of that kind than nth */
				th_verify_ok(b, q, CHUNKS(3), 9, NULL);
				TH_OK(b, gmlake_ipc_close(b, q));
				th_emu_info(b, &after);
			} else {
				ck_assert_int_eq(ret, -EIO);
				ck_assert_ptr_nonnull(strstr(
					gmlake_last_error(), "injected"));
			}
			ck_assert_uint_eq(after.live_mappings,
					  before.live_mappings);
			ck_assert_uint_eq(after.live_reservations,
					  before.live_reservations);
			ck_assert_uint_eq(after.live_handles,
					  before.live_handles);
			ck_assert_int_eq(th_count_fds(), fds);
			th_check(b);
			gmlake_ipc_block_free(&blk);
		}
	}
	/* A close the driver refuses keeps its record: the next one ends it. */
	for (int k = 0; k < 2; k++) {
		int call = k ? GMLAKE_CALL_va_free : GMLAKE_CALL_mem_unmap;
		struct gmlake_ipc_block blk;
		void *q = NULL;

		TH_OK(a, gmlake_ipc_export(a, p, &blk));
		th_emu_info(b, &before);
		TH_OK(b, gmlake_ipc_import(b, &blk, &q));
		gml_dev_fail_nth(th_dev(b), call, 1, EIO);
		TH_ERR(b, gmlake_ipc_close(b, q), -EIO);
		gml_dev_fail_nth(th_dev(b), -1, 0, 0);
		TH_OK(b, gmlake_ipc_close(b, q));
		TH_ERR(b, gmlake_ipc_close(b, q), -EINVAL);
		th_emu_info(b, &after);
		ck_assert_uint_eq(after.live_mappings, before.live_mappings);
		ck_assert_uint_eq(after.live_reservations,
				  before.live_reservations);
		gmlake_ipc_block_free(&blk);
	}
	TH_OK(a, gmlake_free(a, p));
	th_destroy(b);
	th_destroy(a);
}
END_TEST

/* Destroy unmaps what an importer left mapped, and closes its copies of
 * the descriptors. */
START_TEST(test_destroy_unmaps_imports)
{
	gmlake_ctx *a = th_ctx(0), *b;
	struct gmlake_ipc_block blk;
	void *p = NULL, *q = NULL;
	int fds;

	TH_OK(a, gmlake_alloc(a, &p, CHUNKS(2), NULL));
	TH_OK(a, gmlake_ipc_export(a, p, &blk));
	fds = th_count_fds();
	b = th_ctx(0);
	TH_OK(b, gmlake_ipc_import(b, &blk, &q));
	TH_OK(b, gmlake_ipc_import(b, &blk, &q));	/* twice is fine */
	th_destroy(b);
	ck_assert_int_eq(th_count_fds(), fds);
	gmlake_ipc_block_free(&blk);
	TH_OK(a, gmlake_free(a, p));
	th_destroy(a);
}
END_TEST

static Suite *ipc_suite(void)
{
	Suite *s = suite_create("ipc");
	TCase *tc = th_tcase(s, "ipc");

	tcase_add_test(tc, test_single_chunks);
	tcase_add_test(tc, test_growth_handles);
	tcase_add_test(tc, test_stitched);
	tcase_add_test(tc, test_small_block);
	tcase_add_test(tc, test_span);
	tcase_add_test(tc, test_fork_child_imports);
	tcase_add_test(tc, test_bad_input);
	tcase_add_test(tc, test_exported_stays);
	tcase_add_test(tc, test_exported_ring_spill);
	tcase_add_test(tc, test_unexportable);
	tcase_add_test(tc, test_descriptor_limit);
	tcase_add_test(tc, test_faults_leave_nothing);
	tcase_add_test(tc, test_destroy_unmaps_imports);
	return s;
}

int main(void)
{
	int probe = th_probe();

	if (probe)
		return probe;
	return th_run_suite(ipc_suite());
}
