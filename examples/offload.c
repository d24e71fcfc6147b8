/* SPDX-License-Identifier: MIT */
/*
 * Offload with libgmlake's rings: allocate a few blocks, fill them, spill
 * them to host memory, fetch them back at the same addresses, and check
 * that every byte came back.
 *
 * A spilled block gives its device memory back while its address stays
 * reserved, so every pointer into it stays valid; the fetch maps memory
 * at that address again. Requests go through a ring shaped like
 * io_uring's: get an entry, prepare it, tag it, submit, then wait for the
 * completions (in any order) and mark each one seen.
 *
 * Build: cc -o offload offload.c $(pkg-config --cflags --libs gmlake)
 * Without a GPU, use the emulated device: GMLAKE_BACKEND=emu ./offload
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gmlake-offload.h>

#define MiB ((size_t)1 << 20)
#define NBLOCKS 4
#define BLOCK_SIZE (6 * MiB + 12345)

static void fail(const char *what, int err)
{
	fprintf(stderr, "%s: %s: %s\n", what, strerror(-err),
		gmlake_last_error());
}

static unsigned char pattern(int block, size_t i)
{
	return (unsigned char)(i * 7 + (size_t)block * 131 + (i >> 12));
}

/* Copy block's pattern to the device (fill) or compare it (check). */
static int fill_or_check(gmlake_ctx *ctx, void *dptr, int block, bool check)
{
	unsigned char *buf = malloc(BLOCK_SIZE);
	int ret = -1;

	if (!buf) {
		fprintf(stderr, "out of host memory\n");
		return -1;
	}
	if (!check) {
		for (size_t i = 0; i < BLOCK_SIZE; i++)
			buf[i] = pattern(block, i);
		ret = gmlake_memcpy_htod(ctx, dptr, buf, BLOCK_SIZE, NULL);
		if (ret < 0)
			fail("gmlake_memcpy_htod", ret);
		goto out_free;
	}
	ret = gmlake_memcpy_dtoh(ctx, buf, dptr, BLOCK_SIZE, NULL);
	if (ret < 0) {
		fail("gmlake_memcpy_dtoh", ret);
		goto out_free;
	}
	for (size_t i = 0; i < BLOCK_SIZE; i++) {
		if (buf[i] != pattern(block, i)) {
			fprintf(stderr, "block %d: byte %zu is %#x, not %#x\n",
				block, i, buf[i], pattern(block, i));
			ret = -1;
			break;
		}
	}
out_free:
	free(buf);
	return ret;
}

/*
 * Spill (or fetch) every block through ring and wait for all of the
 * completions; each one is tagged with its block's index. 0 when every
 * request completed with res 0.
 */
static int move_all(struct gmlake_offload *ring, void **blocks, bool spill)
{
	struct gmlake_offload_cqe *cqe;
	int i, ret, status = 0;

	for (i = 0; i < NBLOCKS; i++) {
		struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(ring);

		if (!sqe) {
			fprintf(stderr, "the submission queue is full\n");
			return -1;
		}
		if (spill)
			gmlake_offload_prep_spill(sqe, blocks[i]);
		else
			gmlake_offload_prep_fetch(sqe, blocks[i]);
		gmlake_offload_sqe_set_data(sqe, (uint64_t)i);
	}
	ret = gmlake_offload_submit(ring);
	if (ret != NBLOCKS) {
		if (ret < 0)
			fail("gmlake_offload_submit", ret);
		else
			fprintf(stderr, "submitted %d of %d\n", ret, NBLOCKS);
		return -1;
	}
	/* Completions arrive in any order: the tag says whose each is. */
	for (i = 0; i < NBLOCKS; i++) {
		ret = gmlake_offload_wait_cqe(ring, &cqe);
		if (ret < 0) {
			fail("gmlake_offload_wait_cqe", ret);
			return -1;
		}
		if (cqe->res < 0) {
			/* -ENOMEM: a spill found the host budget used up (the
			 * block stays on the device) or a fetch found no
			 * device memory (it stays on the host). */
			fprintf(stderr, "%s of block %" PRIu64 ": %s\n",
				spill ? "spill" : "fetch",
				gmlake_offload_cqe_get_data(cqe),
				strerror(-cqe->res));
			status = -1;
		}
		gmlake_offload_cqe_seen(ring, cqe);
	}
	return status;
}

/* 0 when every block is where it should be. */
static int check_where(gmlake_ctx *ctx, void **blocks, int where)
{
	for (int i = 0; i < NBLOCKS; i++) {
		int ret = gmlake_offload_state(ctx, blocks[i]);

		if (ret != where) {
			fprintf(stderr, "block %d: state %d, not %d\n", i, ret,
				where);
			return -1;
		}
	}
	return 0;
}

int main(void)
{
	void *blocks[NBLOCKS] = { NULL };
	struct gmlake_offload ring;
	struct gmlake_stats st;
	gmlake_ctx *ctx;
	int i, ret, status = 1;

	ret = gmlake_ctx_init(&ctx, NULL);
	if (ret < 0) {
		fail("gmlake_ctx_init", ret);
		/* No GPU or no driver: 77 is "skipped" to automake. */
		return ret == -ENODEV ? 77 : 1;
	}
	for (i = 0; i < NBLOCKS; i++) {
		ret = gmlake_alloc(ctx, &blocks[i], BLOCK_SIZE, NULL);
		if (ret < 0) {
			fail("gmlake_alloc", ret);
			goto out_free;
		}
		if (fill_or_check(ctx, blocks[i], i, false) < 0)
			goto out_free;
	}

	ret = gmlake_offload_init(&ring, ctx, 8, 0);
	if (ret < 0) {
		fail("gmlake_offload_init", ret);
		goto out_free;
	}
	if (move_all(&ring, blocks, true) < 0 ||
	    check_where(ctx, blocks, GMLAKE_BLOCK_SPILLED) < 0)
		goto out_exit;
	/* The pointers are not changed: a fetch maps the same addresses. */
	if (move_all(&ring, blocks, false) < 0 ||
	    check_where(ctx, blocks, GMLAKE_BLOCK_RESIDENT) < 0)
		goto out_exit;
	for (i = 0; i < NBLOCKS; i++)
		if (fill_or_check(ctx, blocks[i], i, true) < 0)
			goto out_exit;

	st.version = GMLAKE_STATS_VERSION;
	st.size = sizeof(st);
	ret = gmlake_stats_get(ctx, &st);
	if (ret < 0) {
		fail("gmlake_stats_get", ret);
		goto out_exit;
	}
	printf("spills %" PRIu64 ", fetches %" PRIu64 ", %" PRIu64
	       " bytes out and %" PRIu64 " back, every byte intact\n",
	       st.spills, st.fetches, st.d2h_bytes, st.h2d_bytes);
	status = 0;

out_exit:
	/* The ring goes before the context; exit waits for its requests. */
	ret = gmlake_offload_exit(&ring);
	if (ret < 0) {
		fail("gmlake_offload_exit", ret);
		status = 1;
	}
out_free:
	for (i = 0; i < NBLOCKS; i++) {
		if (!blocks[i])
			continue;
		ret = gmlake_free(ctx, blocks[i]);
		if (ret < 0) {
			fail("gmlake_free", ret);
			status = 1;
		}
	}
	ret = gmlake_ctx_destroy(ctx, false);
	if (ret < 0) {
		fail("gmlake_ctx_destroy", ret);
		status = 1;
	}
	return status;
}
