/* SPDX-License-Identifier: MIT */
/*
 * offload_bench: spill and fetch bandwidth of the offload manager.
 *
 * For each block size from 1 MiB up to the maximum (doubling), it
 * allocates enough blocks to move about TOTAL bytes, then times, through
 * one ring with every request in flight at once:
 *   spill  all blocks to the host (device to host),
 *   fetch  all blocks back (host to device),
 *   both   half the blocks out while the other half comes back.
 * Each figure is the best of ITER rounds, after one warm-up round that
 * pins the host arena. GB/s is 1e9 bytes per second of wall time, from
 * submit to the last completion, mapping and unmapping included.
 *
 * The bytes are checked, always outside the timed region: each block is
 * filled with a pattern of its index and the round before the round's
 * first spill, read back after the round's last fetch and compared; any
 * difference names the block and offset, and the exit status is 1. By
 * default only the warm-up round (never timed) is checked: per size,
 * TOTAL written and read back once more and the pattern made and compared
 * on the CPU, where the rounds move TOTAL across the bus 4 * (ITER + 1)
 * times. That costs little and catches a fetch that maps the wrong chunks
 * or copies the wrong bytes. -v checks every round, twice: after the
 * fetch of all blocks, then, filled anew, after the mixed spill and fetch.
 *
 * -c prints, after each size's row, the driver calls each phase made per
 * block over the timed rounds, by kind, with their mean time: where the
 * engine's time goes when a size is slower than the bus.
 *
 *   tools/offload_bench [-s MAX_MiB] [-t TOTAL_MiB] [-i ITER] [-v] [-c] [-q]
 *
 * The backend comes from GMLAKE_BACKEND (cuda by default); on the
 * emulated device the figures only show that it runs.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <gmlake.h>
#include <gmlake-offload.h>

#define MiB ((size_t)1 << 20)

static double now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Word w of the pattern of block idx in round (and phase) r. */
static uint64_t pattern(int idx, int r, size_t w)
{
	uint64_t seed = (uint64_t)r << 32 | (uint32_t)idx;
	uint64_t z = seed * 0x9e3779b97f4a7c15ull + w;

	z = (z ^ (z >> 31)) * 0xbf58476d1ce4e5b9ull;
	return z ^ (z >> 29);
}

/* Fill blocks [0, n) with their pattern of round r; buf: size bytes. */
static int fill(gmlake_ctx *ctx, void **p, int n, size_t size, int r,
		uint64_t *buf)
{
	int ret;

	for (int i = 0; i < n; i++) {
		for (size_t w = 0; w < size / 8; w++)
			buf[w] = pattern(i, r, w);
		ret = gmlake_memcpy_htod(ctx, p[i], buf, size, NULL);
		if (ret)
			return ret;
	}
	return 0;
}

/* Read blocks [0, n) back and compare: 0, 1 when any differs (each one
 * reported), or -errno. */
static int verify(gmlake_ctx *ctx, void **p, int n, size_t size, int r,
		  uint64_t *buf)
{
	int bad = 0, ret;

	for (int i = 0; i < n; i++) {
		ret = gmlake_memcpy_dtoh(ctx, buf, p[i], size, NULL);
		if (ret)
			return ret;
		for (size_t w = 0; w < size / 8; w++) {
			uint64_t want = pattern(i, r, w);

			if (buf[w] == want)
				continue;
			fprintf(stderr, "offload_bench: block %d of %zu MiB, "
				"round %d%s: offset %zu holds %#018" PRIx64
				", not %#018" PRIx64 "\n", i, size / MiB,
				r / 2, r % 2 ? " (mixed)" : "", w * 8, buf[w],
				want);
			bad = 1;
			break;
		}
	}
	return bad;
}

/* Driver calls and their time, by kind, summed over a phase's rounds. */
struct calls {
	uint64_t n[GMLAKE_CALL_COUNT], ns[GMLAKE_CALL_COUNT];
	uint64_t blocks;
};

/* gmlake_stats_get() of this build's layout: 0 or -errno. */
static int stats_now(gmlake_ctx *ctx, struct gmlake_stats *st)
{
	st->version = GMLAKE_STATS_VERSION;
	st->size = sizeof(*st);
	return gmlake_stats_get(ctx, st);
}

/* Add what the driver did since *mark to c, for blocks blocks. */
static int calls_add(gmlake_ctx *ctx, const struct gmlake_stats *mark,
		     struct calls *c, int blocks)
{
	struct gmlake_stats st;
	int ret = stats_now(ctx, &st);

	if (ret)
		return ret;
	for (int k = 0; k < GMLAKE_CALL_COUNT; k++) {
		c->n[k] += st.calls[k] - mark->calls[k];
		c->ns[k] += st.call_ns[k] - mark->call_ns[k];
	}
	c->blocks += (uint64_t)blocks;
	return 0;
}

/* "# SIZE MiB PHASE kind calls/block (us/call) ..." for the kinds seen. */
static void calls_print(size_t size, const char *phase, const struct calls *c)
{
	printf("# %8zu MiB %-5s", size / MiB, phase);
	for (int k = 0; k < GMLAKE_CALL_COUNT; k++)
		if (c->n[k])
			printf(" %s %.2f (%.1f us)", gmlake_call_name(k),
			       (double)c->n[k] / (double)c->blocks,
			       (double)c->ns[k] / (double)c->n[k] / 1e3);
	printf("\n");
}

/* Submit op on blocks [from, to) with op2 on [to, end), reap all; with
 * c, add the driver calls they made to it. */
static int run(gmlake_ctx *ctx, struct gmlake_offload *ring, void **p,
	       int from, int to, int end, int op, int op2, double *secs,
	       struct calls *c)
{
	struct gmlake_offload_cqe *cqe;
	struct gmlake_stats mark;
	double t0;
	int n = 0, ret;

	if (c) {
		ret = stats_now(ctx, &mark);
		if (ret)
			return ret;
	}
	t0 = now();

	for (int i = from; i < end; i++) {
		struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(ring);

		if (!sqe)
			return -EBUSY;
		if ((i < to ? op : op2) == GMLAKE_OFFLOAD_SPILL)
			gmlake_offload_prep_spill(sqe, p[i]);
		else
			gmlake_offload_prep_fetch(sqe, p[i]);
		gmlake_offload_sqe_set_data(sqe, (uint64_t)i);
		n++;
	}
	ret = gmlake_offload_submit(ring);
	if (ret != n)
		return ret < 0 ? ret : -EIO;
	/* Reap every completion, so no block is in flight when the caller
	 * frees them; report the first failure. */
	ret = 0;
	while (n--) {
		int err = gmlake_offload_wait_cqe(ring, &cqe);

		if (err)
			return err;
		if (cqe->res && !ret) {
			ret = cqe->res;
			fprintf(stderr, "offload_bench: block %d: %s\n",
				(int)gmlake_offload_cqe_get_data(cqe),
				strerror(-ret));
		}
		gmlake_offload_cqe_seen(ring, cqe);
	}
	*secs = now() - t0;
	if (c && !ret)
		ret = calls_add(ctx, &mark, c, end - from);
	return ret;
}

/*
 * 0, -errno, or 1 when a block came back wrong. Round it fills its
 * blocks with pattern 2 * it (and, with every, 2 * it + 1 in its
 * second half); every: check each round, not only the warm-up.
 */
static int bench_size(gmlake_ctx *ctx, struct gmlake_offload *ring,
		      size_t size, size_t total, int iters, bool every,
		      bool show_calls)
{
	int n = (int)(total / size), ret = 0, half;
	double best[3] = { 1e30, 1e30, 1e30 }, t;
	struct calls calls[3];
	uint64_t *buf;
	void **p;

	if (n < 2)
		n = 2;
	if (n > 256)
		n = 256;
	half = n / 2;
	p = calloc((size_t)n, sizeof(*p));
	if (!p)
		return -ENOMEM;
	buf = malloc(size);
	if (!buf) {
		free(p);
		return -ENOMEM;
	}
	for (int i = 0; i < n && !ret; i++)
		ret = gmlake_alloc(ctx, &p[i], size, NULL);
	memset(calls, 0, sizeof(calls));
	for (int it = 0; it <= iters && !ret; it++) {
		bool check = every || !it;
		/* The timed rounds' calls, with -c. */
		struct calls *c = show_calls && it ? calls : NULL;

		if (check)
			ret = fill(ctx, p, n, size, 2 * it, buf);
		if (!ret)
			ret = run(ctx, ring, p, 0, n, n,
				  GMLAKE_OFFLOAD_SPILL, 0, &t, c);
		if (!ret && it && t < best[0])
			best[0] = t;
		if (!ret)
			ret = run(ctx, ring, p, 0, n, n,
				  GMLAKE_OFFLOAD_FETCH, 0, &t, c ? c + 1 : NULL);
		if (!ret && it && t < best[1])
			best[1] = t;
		if (!ret && every) {
			ret = verify(ctx, p, n, size, 2 * it, buf);
			if (!ret)
				ret = fill(ctx, p, n, size, 2 * it + 1, buf);
		}
		/* both ways: the first half out, then back while the
		 * second half goes out */
		if (!ret)
			ret = run(ctx, ring, p, 0, half, half,
				  GMLAKE_OFFLOAD_SPILL, 0, &t, NULL);
		if (!ret)
			ret = run(ctx, ring, p, 0, half, n,
				  GMLAKE_OFFLOAD_FETCH, GMLAKE_OFFLOAD_SPILL,
				  &t, c ? c + 2 : NULL);
		if (!ret && it && t < best[2])
			best[2] = t;
		if (!ret)
			ret = run(ctx, ring, p, half, n, n,
				  GMLAKE_OFFLOAD_FETCH, 0, &t, NULL);
		if (!ret && check)
			ret = verify(ctx, p, n, size, 2 * it + every, buf);
	}
	if (!ret)
		printf("%10zu %6d %12.2f %12.2f %12.2f\n", size / MiB, n,
		       (double)n * size / best[0] / 1e9,
		       (double)n * size / best[1] / 1e9,
		       (double)n * size / best[2] / 1e9);
	if (!ret && show_calls) {
		calls_print(size, "spill", &calls[0]);
		calls_print(size, "fetch", &calls[1]);
		calls_print(size, "both", &calls[2]);
	}
	for (int i = 0; i < n; i++)
		if (p[i])
			gmlake_free(ctx, p[i]);
	free(buf);
	free(p);
	return ret;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: offload_bench [-s MAX_MiB] [-t TOTAL_MiB] "
		"[-i ITER] [-v] [-c] [-q]\n"
		"  -s  largest block, MiB (default 1024; 16 on emu)\n"
		"  -t  bytes moved per size, MiB (default 8192; 64 on emu)\n"
		"  -i  timed rounds per size, best taken (default 3)\n"
		"  -v  check the bytes of every round (default: the warm-up "
		"round only)\n"
		"  -c  driver calls per block of each phase, by kind\n"
		"  -q  no statistics at the end\n");
}

int main(int argc, char **argv)
{
	struct gmlake_config cfg;
	struct gmlake_offload ring;
	struct gmlake_stats st;
	size_t max = 0, total = 0;
	int iters = 3, opt, ret;
	bool quiet = false, every = false, show_calls = false;
	gmlake_ctx *ctx;

	while ((opt = getopt(argc, argv, "s:t:i:vcqh")) != -1) {
		switch (opt) {
		case 's': max = strtoull(optarg, NULL, 0) * MiB; break;
		case 't': total = strtoull(optarg, NULL, 0) * MiB; break;
		case 'i': iters = atoi(optarg); break;
		case 'v': every = true; break;
		case 'c': show_calls = true; break;
		case 'q': quiet = true; break;
		case 'h': usage(stdout); return 0;
		default: usage(stderr); return 2;
		}
	}
	gmlake_config_init(&cfg);
	if (cfg.backend == GMLAKE_BACKEND_EMU) {
		max = max ? max : 16 * MiB;
		total = total ? total : 64 * MiB;
		cfg.emu_capacity = 4 * total + 4 * max;
	}
	max = max ? max : 1024 * MiB;
	total = total ? total : 8192 * MiB;
	if (iters < 1 || max < MiB || total < max) {
		usage(stderr);
		return 2;
	}
	/* The host arena holds everything spilled, plus in-flight slack. */
	if (cfg.host_limit < total + 2 * max)
		cfg.host_limit = total + 2 * max;
	ret = gmlake_ctx_init(&ctx, &cfg);
	if (ret) {
		fprintf(stderr, "offload_bench: %s\n", gmlake_last_error());
		return ret == -ENODEV || ret == -EOPNOTSUPP ? 77 : 1;
	}
	ret = gmlake_offload_init(&ring, ctx, 512, 0);
	if (ret) {
		fprintf(stderr, "offload_bench: %s\n", gmlake_last_error());
		gmlake_ctx_destroy(ctx, true);
		return 1;
	}
	ret = stats_now(ctx, &st);
	if (ret) {
		fprintf(stderr, "offload_bench: %s\n", gmlake_last_error());
		gmlake_offload_exit(&ring);
		gmlake_ctx_destroy(ctx, true);
		return 1;
	}
	printf("# offload_bench: engine %s, best of %d, GB/s (1e9 B/s)\n",
	       st.offload_engine == GMLAKE_OFFLOAD_ENGINE_URING ? "io_uring" :
	       "thread", iters);
	printf("%10s %6s %12s %12s %12s\n", "block_MiB", "blocks", "spill",
	       "fetch", "both");
	for (size_t size = MiB; size <= max && !ret; size *= 2)
		ret = bench_size(ctx, &ring, size, total, iters, every,
				 show_calls);
	if (ret > 0)
		fprintf(stderr, "offload_bench: blocks came back wrong\n");
	else if (ret)
		fprintf(stderr, "offload_bench: %d: %s\n", ret,
			gmlake_last_error());
	gmlake_offload_exit(&ring);
	if (!quiet)
		gmlake_stats_print(ctx, STDOUT_FILENO, false);
	gmlake_ctx_destroy(ctx, true);
	return ret ? 1 : 0;
}
