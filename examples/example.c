/* SPDX-License-Identifier: MIT */
/*
 * A small libgmlake program: create a context and a stream, allocate
 * a few blocks, copy a pattern in and out of them, free them, and
 * print how much device memory was held at the peak.
 *
 * Build: cc -o example example.c $(pkg-config --cflags --libs gmlake)
 * Without a GPU, use the emulated device: GMLAKE_BACKEND=emu ./example
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <gmlake.h>

#define MiB ((size_t)1 << 20)
#define NBLOCKS 4

/* Report a failed libgmlake call with the library's message. */
static void fail(const char *what, int err)
{
	fprintf(stderr, "%s: %s: %s\n", what, strerror(-err),
		gmlake_last_error());
}

/* Free a block (NULL is a no-op, as with free(3)); 1 if that failed. */
static int free_block(gmlake_ctx *ctx, void *ptr)
{
	int ret = gmlake_free(ctx, ptr);

	if (ret < 0)
		fail("gmlake_free", ret);
	return ret < 0;
}

/* Copy a pattern into the block at dptr and back; 0 if it is intact. */
static int check_block(gmlake_ctx *ctx, void *dptr, size_t size,
		       gmlake_stream_t stream, unsigned seed)
{
	unsigned char *in, *out;
	int ret = -1;

	in = malloc(size);
	out = malloc(size);
	if (!in || !out) {
		fprintf(stderr, "out of host memory\n");
		goto out_free;
	}
	for (size_t i = 0; i < size; i++)
		in[i] = (unsigned char)(i * 31 + seed);

	ret = gmlake_memcpy_htod(ctx, dptr, in, size, stream);
	if (ret < 0) {
		fail("gmlake_memcpy_htod", ret);
		goto out_free;
	}
	ret = gmlake_memcpy_dtoh(ctx, out, dptr, size, stream);
	if (ret < 0) {
		fail("gmlake_memcpy_dtoh", ret);
		goto out_free;
	}
	if (memcmp(in, out, size) != 0) {
		fprintf(stderr, "%zu-byte block: data differ\n", size);
		ret = -1;
	}
out_free:
	free(out);
	free(in);
	return ret;
}

int main(void)
{
	static const size_t sizes[NBLOCKS] = {
		4000, 8 * MiB, 8 * MiB, 8 * MiB,
	};
	void *blocks[NBLOCKS] = { NULL };
	struct gmlake_config cfg;
	struct gmlake_stats st;
	gmlake_stream_t stream;
	gmlake_ctx *ctx;
	void *big = NULL;
	int i, ret, status = 1;

	ret = gmlake_config_init(&cfg);
	if (ret < 0) {
		fail("gmlake_config_init", ret);
		return 1;
	}
	ret = gmlake_ctx_init(&ctx, &cfg);
	if (ret < 0) {
		fail("gmlake_ctx_init", ret);
		/* No GPU or no driver: 77 is "skipped" to automake. */
		return ret == -ENODEV ? 77 : 1;
	}
	ret = gmlake_stream_create(ctx, &stream);
	if (ret < 0) {
		fail("gmlake_stream_create", ret);
		goto out_ctx;
	}

	for (i = 0; i < NBLOCKS; i++) {
		ret = gmlake_alloc(ctx, &blocks[i], sizes[i], stream);
		if (ret < 0) {
			fail("gmlake_alloc", ret);
			goto out_free;
		}
		ret = check_block(ctx, blocks[i], sizes[i], stream, i);
		if (ret < 0)
			goto out_free;
	}

	/*
	 * Free two blocks that the third one separates, then ask for
	 * their total: the free chunks can be stitched into one range.
	 */
	for (i = 1; i < NBLOCKS; i += 2) {
		ret = free_block(ctx, blocks[i]);
		blocks[i] = NULL;
		if (ret)
			goto out_free;
	}
	ret = gmlake_alloc(ctx, &big, 16 * MiB, stream);
	if (ret < 0) {
		fail("gmlake_alloc", ret);
		goto out_free;
	}
	if (check_block(ctx, big, 16 * MiB, stream, 7) < 0 ||
	    check_block(ctx, blocks[0], sizes[0], stream, 9) < 0)
		goto out_free;

	st.version = GMLAKE_STATS_VERSION;
	st.size = sizeof(st);
	ret = gmlake_stats_get(ctx, &st);
	if (ret < 0) {
		fail("gmlake_stats_get", ret);
		goto out_free;
	}
	printf("peak reserved: %" PRId64 " bytes (chunks of %" PRIu64
	       " bytes), stitched ranges made: %" PRIu64 "\n",
	       st.reserved_bytes.peak, st.chunk_size, st.stitches);
	status = 0;

out_free:
	if (free_block(ctx, big))
		status = 1;
	for (i = 0; i < NBLOCKS; i++)
		if (free_block(ctx, blocks[i]))
			status = 1;
	ret = gmlake_stream_destroy(ctx, stream);
	if (ret < 0) {
		fail("gmlake_stream_destroy", ret);
		status = 1;
	}
out_ctx:
	ret = gmlake_ctx_destroy(ctx, false);
	if (ret < 0) {
		fail("gmlake_ctx_destroy", ret);
		status = 1;
	}
	return status;
}
