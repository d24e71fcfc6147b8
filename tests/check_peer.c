/* SPDX-License-Identifier: MIT */
/*
 * check_peer: other devices given access to a context's memory
 * (lib/peer.c, gmlake_peer_access).
 *
 * On the emulated device every mapping records the devices its
 * set-access named (gml_emu_peer_has_access): after gmlake_peer_access,
 * every block mapped then (segment runs, growth handles, a stitched view,
 * a small block's chunk, an imported range) and every block mapped later
 * must name the peer; a context that was not asked must not. A failed
 * grant must say so, keep the data, and succeed when called again. The
 * real driver needs two GPUs: those cases run on the emulated device only.
 */
#include "helpers.h"

#include "drv_emu.h"
#include "gmlake-ipc.h"
#include "types.h"

#define CHUNKS(n) ((size_t)(n) * TH_CHUNK)

static bool peer_has(gmlake_ctx *ctx, const void *p, size_t size, int peer)
{
	return gml_emu_peer_has_access(th_dev(ctx)->priv, (uintptr_t)p, size,
				       peer);
}

static uint64_t access_calls(gmlake_ctx *ctx)
{
	struct gmlake_stats st;

	th_stats(ctx, &st);
	return st.calls[GMLAKE_CALL_set_access];
}

START_TEST(test_bad_input)
{
	gmlake_ctx *ctx = th_ctx(0);

	ck_assert_int_eq(gmlake_peer_access(NULL, 1), -EINVAL);
	TH_ERR(ctx, gmlake_peer_access(ctx, 0), -EINVAL);   /* itself */
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "peer"));
	TH_ERR(ctx, gmlake_peer_access(ctx, -1), -EINVAL);
	if (th_env_is_emu())
		TH_ERR(ctx, gmlake_peer_access(ctx, 128), -EINVAL);
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

/* What is mapped when the peer is added, and what is mapped after. */
START_TEST(test_grants_mapped_and_later)
{
	gmlake_ctx *ctx, *other;
	struct gmlake_ipc_block blk;
	struct gmlake_stats st;
	void *p[4], *s, *small, *imp = NULL, *late, *theirs;
	uint64_t calls;

	if (!th_env_is_emu())
		return;		/* two devices, and the emulated one's record */
	ctx = th_ctx(CHUNKS(16));
	other = th_ctx(0);
	for (int i = 0; i < 4; i++)
		TH_OK(ctx, gmlake_alloc(ctx, &p[i], CHUNKS(i % 2 ? 1 : 3),
					NULL));
	th_fill_ok(ctx, p[1], CHUNKS(1), 1, NULL);
	th_fill_ok(ctx, p[3], CHUNKS(1), 3, NULL);
	TH_OK(ctx, gmlake_free(ctx, p[0]));
	TH_OK(ctx, gmlake_free(ctx, p[2]));
	s = th_alloc_filled(ctx, CHUNKS(6), 6, NULL);	/* both holes */
	th_stats(ctx, &st);
	ck_assert_uint_ge(st.stitches, 1);
	small = th_alloc_filled(ctx, 4096, 7, NULL);
	theirs = th_alloc_filled(other, CHUNKS(2), 8, NULL);
	TH_OK(other, gmlake_ipc_export(other, theirs, &blk));
	TH_OK(ctx, gmlake_ipc_import(ctx, &blk, &imp));
	ck_assert(!peer_has(ctx, s, CHUNKS(6), 1));
	ck_assert(!peer_has(ctx, p[1], CHUNKS(1), 1));

	TH_OK(ctx, gmlake_peer_access(ctx, 1));
	ck_assert(peer_has(ctx, s, CHUNKS(6), 1));
	ck_assert(peer_has(ctx, p[1], CHUNKS(1), 1));
	ck_assert(peer_has(ctx, p[3], CHUNKS(1), 1));
	ck_assert(peer_has(ctx, small, 4096, 1));
	ck_assert(peer_has(ctx, imp, CHUNKS(2), 1));
	ck_assert(!peer_has(ctx, s, CHUNKS(6), 2));
	ck_assert(!peer_has(other, theirs, CHUNKS(2), 1));
	/* Granted already: nothing to do. */
	calls = access_calls(ctx);
	TH_OK(ctx, gmlake_peer_access(ctx, 1));
	ck_assert_uint_eq(access_calls(ctx), calls);

	/* Mapped later: growth, and the peer named with it. */
	late = th_alloc_filled(ctx, CHUNKS(3), 9, NULL);
	ck_assert(peer_has(ctx, late, CHUNKS(3), 1));
	TH_OK(ctx, gmlake_peer_access(ctx, 2));
	ck_assert(peer_has(ctx, late, CHUNKS(3), 2));
	ck_assert(peer_has(ctx, late, CHUNKS(3), 1));

	th_verify_ok(ctx, imp, CHUNKS(2), 8, NULL);
	TH_OK(ctx, gmlake_ipc_close(ctx, imp));
	gmlake_ipc_block_free(&blk);
	th_verify_free(ctx, s, CHUNKS(6), 6, NULL);
	th_verify_free(ctx, p[1], CHUNKS(1), 1, NULL);
	th_verify_free(ctx, p[3], CHUNKS(1), 3, NULL);
	th_verify_free(ctx, small, 4096, 7, NULL);
	th_verify_free(ctx, late, CHUNKS(3), 9, NULL);
	th_verify_free(other, theirs, CHUNKS(2), 8, NULL);
	th_check(ctx);
	th_destroy(ctx);
	th_destroy(other);
}
END_TEST

/* A grant that fails part way, at each of its set-access calls: the
 * error says so, the data stays, later mappings have the peer, and a
 * second call grants the rest. */
START_TEST(test_fault_then_again)
{
	gmlake_ctx *ctx;
	void *a, *b, *hole, *c;
	int ret;

	if (!th_env_is_emu())
		return;
	ctx = th_ctx(CHUNKS(16));
	a = th_alloc_filled(ctx, CHUNKS(2), 1, NULL);
	hole = th_alloc(ctx, CHUNKS(1), NULL);
	b = th_alloc_filled(ctx, CHUNKS(2), 2, NULL);
	th_free(ctx, hole);
	TH_OK(ctx, gmlake_trim(ctx));	/* two mapped runs, a gap between */
	gml_dev_fail_nth(th_dev(ctx), GMLAKE_CALL_set_access, 1 + _i, EIO);
	ret = gmlake_peer_access(ctx, 3);
	gml_dev_fail_nth(th_dev(ctx), -1, 0, 0);
	ck_assert_int_eq(ret, -EIO);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "call again"));
	ck_assert(peer_has(ctx, a, CHUNKS(2), 3) == (_i == 1));
	ck_assert(!peer_has(ctx, b, CHUNKS(2), 3));
	c = th_alloc_filled(ctx, CHUNKS(2), 3, NULL);
	ck_assert(peer_has(ctx, c, CHUNKS(2), 3));
	TH_OK(ctx, gmlake_peer_access(ctx, 3));
	ck_assert(peer_has(ctx, a, CHUNKS(2), 3));
	ck_assert(peer_has(ctx, b, CHUNKS(2), 3));
	th_verify_free(ctx, a, CHUNKS(2), 1, NULL);
	th_verify_free(ctx, b, CHUNKS(2), 2, NULL);
	th_verify_free(ctx, c, CHUNKS(2), 3, NULL);
	th_check(ctx);
	th_destroy(ctx);
}
END_TEST

START_TEST(test_peer_limit)
{
	gmlake_ctx *ctx;

	if (!th_env_is_emu())
		return;
	ctx = th_ctx(0);
	for (int peer = 1; peer <= GML_MAX_PEERS; peer++)
		TH_OK(ctx, gmlake_peer_access(ctx, peer));
	TH_ERR(ctx, gmlake_peer_access(ctx, GML_MAX_PEERS + 1), -ENOSPC);
	TH_OK(ctx, gmlake_peer_access(ctx, GML_MAX_PEERS));
	th_free(ctx, th_alloc_filled(ctx, CHUNKS(1), 1, NULL));
	th_destroy(ctx);
}
END_TEST

static Suite *peer_suite(void)
{
	Suite *s = suite_create("peer");
	TCase *tc = th_tcase(s, "Peers");

	tcase_add_test(tc, test_bad_input);
	tcase_add_test(tc, test_grants_mapped_and_later);
	tcase_add_loop_test(tc, test_fault_then_again, 0, 2);
	tcase_add_test(tc, test_peer_limit);
	return s;
}

int main(void)
{
	int probe = th_probe();

	if (probe)
		return probe;
	return th_run_suite(peer_suite());
}
