/* SPDX-License-Identifier: MIT */
/*
 * stress: many threads allocating and freeing at once, in the manner of
 * mimalloc's test/test-stress.c.
 *
 *	stress [THREADS [SCALE [ITER]]]
 *
 * Each of ITER rounds runs two phases: THREADS threads on one shared
 * context, then THREADS threads spread over STRESS_CTXS contexts. Every
 * thread has a stream of its own and runs SCALE * 10 random operations:
 * allocations of small, medium and chunk-sized blocks (on its stream or the
 * default one), frees, record_stream on another stream and free, trims, and
 * hand-overs through a shared array: a block allocated by one thread on its
 * stream is taken by another, recorded on that thread's stream and freed
 * there (a cross-stream free), and asynchronous use: a block written and
 * read back by copies queued on the stream and freed while they are still
 * queued, the read checked after the stream ran (memory reused too early
 * by another stream shows there). Every block is filled with a pattern of its
 * own (through gmlake_memcpy_htod, so the same code runs on a GPU) and
 * checked (gmlake_memcpy_dtoh) before it is freed or handed over. After
 * each phase every block is freed and the invariant checker must hold with
 * nothing allocated; at the end a trim must leave no chunk.
 *
 * Without arguments it runs a bounded round for make check (smaller under
 * the sanitizers). A deterministic PRNG seeds each thread from the round
 * and its number. Exit status: 0 pass, 1 failure, 77 no device.
 *
 * Offload: every thread has a ring of its own on its context and spills
 * blocks to the host (the host budget is small, so some spills find no
 * room: -ENOMEM; a block whose chunks a stitched range in use maps as
 * well stays: -EBUSY) and fetches spilled ones back (-ENOMEM when the device is
 * full), waiting for each completion; a block is checked after its fetch.
 * A spilled block that is freed, recorded on a stream or handed over is
 * fetched back first and checked (the receiver of a hand-over fetches it
 * on its own ring); when the device has no room for it, it is freed as it
 * is. small blocks must complete with -EOPNOTSUPP.
 *
 * Extension point: add an operation to stress_ops[] with its weight;
 * op_run() dispatches on it.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gmlake.h"
#include "gmlake-offload.h"
#include "ctx.h"
#include "drv.h"
#include "sanitized.h"

#ifdef TH_ASAN
#define DEF_THREADS 4
#define DEF_SCALE   6
#define DEF_ITER    2
#else
#define DEF_THREADS 4
#define DEF_SCALE   30
#define DEF_ITER    3
#endif

#define STRESS_CTXS	3	/* contexts of the second phase */
#define STRESS_LIVE	32	/* blocks a thread holds at most */
#define STRESS_SLOTS	64	/* hand-over slots per context */
#define KiB		((size_t)1 << 10)
#define MiB		((size_t)1 << 20)

static int threads = DEF_THREADS, scale = DEF_SCALE, iters = DEF_ITER;
static atomic_bool failed;

/* What was done, over all threads. */
static atomic_uint_fast64_t n_ops, n_alloc, n_free, n_cross, n_record, n_trim,
	n_oom, n_bytes, n_spill, n_fetch, n_spill_oom, n_fetch_oom, n_unmovable,
	n_free_spilled, n_spill_busy, n_async, n_waits;

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

static void fail(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("stress: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	atomic_store(&failed, true);
}

/* ---------------------------------------------------------------------- */
/* PRNG (splitmix64) and the per-block pattern.                           */

static uint64_t rnd(uint64_t *s)
{
	uint64_t z = (*s += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint64_t cookie_word(uint64_t cookie, size_t i)
{
	uint64_t z = cookie * 0x9e3779b97f4a7c15ull + i;

	return (z ^ (z >> 29)) * 0xbf58476d1ce4e5b9ull;
}

static void cookie_fill(uint8_t *buf, size_t size, uint64_t cookie)
{
	size_t i;

	for (i = 0; i + 8 <= size; i += 8) {
		uint64_t w = cookie_word(cookie, i / 8);

		memcpy(buf + i, &w, 8);
	}
	if (i < size) {
		uint64_t w = cookie_word(cookie, i / 8);

		memcpy(buf + i, &w, size - i);
	}
}

/* ---------------------------------------------------------------------- */
/* Contexts, blocks, threads.                                             */

struct sblock {
	void *p;
	size_t size;
	uint64_t cookie;
	bool spilled;			/* on the host */
};

/* A context and the hand-over slots of the threads that share it. */
struct sctx {
	gmlake_ctx *ctx;
	pthread_mutex_t lock;		/* guards slot[] */
	struct sblock slot[STRESS_SLOTS];
};

struct sthread {
	struct sctx *sc;
	int id;
	uint64_t rng;
	gmlake_stream_t stream;
	gmlake_stream_t other;		/* op_async's second stream */
	struct gmlake_offload ring;
	bool ring_live;
	struct sblock live[STRESS_LIVE];
	int n;
	uint8_t *buf;			/* host staging, STRESS_MAX bytes */
	uint8_t *abuf_in, *abuf_out;	/* op_async's copies, likewise */
	size_t async_size;		/* a read-back to check; 0: none */
	uint64_t async_cookie;
};

#define STRESS_MAX (6 * MiB)
#define STRESS_SMALL MiB		/* cfg.small_size: smaller ones stay */

/* Small (packed), medium (packed or one chunk), large (stitched). */
static size_t pick_size(uint64_t *rng)
{
	uint64_t r = rnd(rng), pct = r % 100;

	r >>= 8;
	if (pct < 70)
		return 16 + r % (64 * KiB);
	if (pct < 95)
		return 64 * KiB + r % MiB;
	return 2 * MiB + r % (STRESS_MAX - 2 * MiB + 1);
}

static int fill(struct sthread *t, const struct sblock *b, gmlake_stream_t s)
{
	int ret;

	cookie_fill(t->buf, b->size, b->cookie);
	ret = gmlake_memcpy_htod(t->sc->ctx, b->p, t->buf, b->size, s);
	if (ret)
		fail("thread %d: fill %p+%zu: %d (%s)", t->id, b->p, b->size,
		     ret, gmlake_last_error());
	return ret;
}

/* Check a block's pattern, read on stream s. */
/* The first offset of buf that is not cookie's pattern, or SIZE_MAX. */
static size_t cookie_mismatch(const uint8_t *buf, size_t size,
			      uint64_t cookie)
{
	for (size_t i = 0; i < size; i += 8) {
		uint64_t w = cookie_word(cookie, i / 8), got = 0;
		size_t n = size - i < 8 ? size - i : 8;

		memcpy(&got, buf + i, n);
		if (memcmp(&got, &w, n))
			return i;
	}
	return SIZE_MAX;
}

static int verify(struct sthread *t, const struct sblock *b, gmlake_stream_t s)
{
	size_t off;
	int ret;

	memset(t->buf, 0x5a, b->size);
	ret = gmlake_memcpy_dtoh(t->sc->ctx, t->buf, b->p, b->size, s);
	if (ret) {
		fail("thread %d: read %p+%zu: %d (%s)", t->id, b->p, b->size,
		     ret, gmlake_last_error());
		return ret;
	}
	off = cookie_mismatch(t->buf, b->size, b->cookie);
	if (off != SIZE_MAX) {
		fail("thread %d: block %p (%zu bytes, cookie %#" PRIx64
		     ") corrupt at offset %zu", t->id, b->p, b->size,
		     b->cookie, off);
		return -EFAULT;
	}
	n_bytes += b->size;
	return 0;
}

static int do_free(struct sthread *t, struct sblock *b)
{
	int ret = gmlake_free(t->sc->ctx, b->p);

	if (ret)
		fail("thread %d: free %p: %d (%s)", t->id, b->p, ret,
		     gmlake_last_error());
	n_free++;
	return ret;
}

/* One request on the thread's ring, waited for: its result. */
static int offload_one(struct sthread *t, uint8_t op, struct sblock *b)
{
	struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(&t->ring);
	struct gmlake_offload_cqe *cqe;
	uint64_t tag = (uintptr_t)b->p ^ op;
	int ret, res;

	if (!sqe) {
		fail("thread %d: get_sqe: no entry on an idle ring", t->id);
		return -EIO;
	}
	if (op == GMLAKE_OFFLOAD_SPILL)
		gmlake_offload_prep_spill(sqe, b->p);
	else
		gmlake_offload_prep_fetch(sqe, b->p);
	gmlake_offload_sqe_set_data(sqe, tag);
	ret = gmlake_offload_submit(&t->ring);
	if (ret != 1) {
		fail("thread %d: submit: %d (%s)", t->id, ret,
		     gmlake_last_error());
		return -EIO;
	}
	ret = gmlake_offload_wait_cqe(&t->ring, &cqe);
	if (ret) {
		fail("thread %d: wait_cqe: %d (%s)", t->id, ret,
		     gmlake_last_error());
		return -EIO;
	}
	res = cqe->res;
	if (gmlake_offload_cqe_get_data(cqe) != tag) {
		fail("thread %d: a completion for %#" PRIx64 ", expected %#"
		     PRIx64, t->id, gmlake_offload_cqe_get_data(cqe), tag);
		res = -EIO;
	}
	gmlake_offload_cqe_seen(&t->ring, cqe);
	return res;
}

/* The block's state must be what the thread thinks. */
static void check_where(struct sthread *t, const struct sblock *b)
{
	int st = gmlake_offload_state(t->sc->ctx, b->p);
	int want = b->spilled ? GMLAKE_BLOCK_SPILLED : GMLAKE_BLOCK_RESIDENT;

	if (st != want)
		fail("thread %d: block %p is in state %d, expected %d", t->id,
		     b->p, st, want);
}

/* Spill b: 0 (spilled), -ENOMEM (host budget: stays), -EBUSY (a stitched
 * range in use maps its chunks too: stays) or -EOPNOTSUPP (small). */
static int spill(struct sthread *t, struct sblock *b)
{
	int res = offload_one(t, GMLAKE_OFFLOAD_SPILL, b);

	if (b->size < STRESS_SMALL) {
		if (res != -EOPNOTSUPP)
			fail("thread %d: spill of small block %p: %d", t->id,
			     b->p, res);
		n_unmovable++;
		return res;
	}
	if (res == 0) {
		b->spilled = true;
		n_spill++;
	} else if (res == -ENOMEM) {
		n_spill_oom++;
	} else if (res == -EBUSY) {
		n_spill_busy++;		/* a stitched range in use shares it */
	} else if (res != -EIO) {
		fail("thread %d: spill %p+%zu: %d", t->id, b->p, b->size, res);
	}
	check_where(t, b);
	return res;
}

/* Bring b back to the device (if it is spilled) and check its bytes:
 * 0, or -ENOMEM when the device has no room for it (still spilled). */
static int fetch_check(struct sthread *t, struct sblock *b, gmlake_stream_t s)
{
	int res;

	if (b->spilled) {
		res = offload_one(t, GMLAKE_OFFLOAD_FETCH, b);
		if (res == -ENOMEM) {
			n_fetch_oom++;
			check_where(t, b);
			return res;
		}
		if (res) {
			if (res != -EIO)
				fail("thread %d: fetch %p+%zu: %d", t->id,
				     b->p, b->size, res);
			return -EIO;
		}
		b->spilled = false;
		n_fetch++;
		check_where(t, b);
	}
	return verify(t, b, s);
}

/* Check and free b; a spilled block is fetched back first, or freed as
 * it is when the device has no room. */
static int check_free(struct sthread *t, struct sblock *b, gmlake_stream_t s)
{
	int ret = fetch_check(t, b, s);

	if (ret == -ENOMEM)
		n_free_spilled++;
	else if (ret)
		return ret;
	return do_free(t, b);
}

static void op_spill(struct sthread *t)
{
	int i, k;

	if (!t->n)
		return;
	/* A large block on the device if there is one, else any. */
	i = (int)(rnd(&t->rng) % (uint64_t)t->n);
	for (k = 0; k < t->n; k++) {
		struct sblock *b = &t->live[(i + k) % t->n];

		if (!b->spilled && b->size >= STRESS_SMALL)
			break;
	}
	if (k < t->n)
		i = (i + k) % t->n;
	if (!t->live[i].spilled)
		spill(t, &t->live[i]);
}

static void op_fetch(struct sthread *t)
{
	int i, k;

	if (!t->n)
		return;
	i = (int)(rnd(&t->rng) % (uint64_t)t->n);
	for (k = 0; k < t->n && !t->live[(i + k) % t->n].spilled; k++)
		;
	if (k < t->n)
		fetch_check(t, &t->live[(i + k) % t->n], t->stream);
}

/* An allocation on s, counted; false when it failed (out of memory is
 * counted, anything else fails the run). */
static bool alloc_counted(struct sthread *t, void **p, size_t size,
			  gmlake_stream_t s)
{
	int ret = gmlake_alloc(t->sc->ctx, p, size, s);

	if (ret == -ENOMEM) {
		n_oom++;
		return false;
	}
	if (ret) {
		fail("thread %d: alloc %zu: %d (%s)", t->id, size, ret,
		     gmlake_last_error());
		return false;
	}
	n_alloc++;
	return true;
}

static void op_alloc(struct sthread *t)
{
	struct sblock b;
	gmlake_stream_t s = rnd(&t->rng) % 4 ? t->stream : NULL;

	if (t->n == STRESS_LIVE)
		return;
	b.size = pick_size(&t->rng);
	b.cookie = rnd(&t->rng) | 1;
	if (!alloc_counted(t, &b.p, b.size, s))
		return;
	b.spilled = false;
	if (fill(t, &b, s))
		return;
	t->live[t->n++] = b;
}

/* Take block i off the thread's list. */
static struct sblock take(struct sthread *t, int i)
{
	struct sblock b = t->live[i];

	t->live[i] = t->live[--t->n];
	return b;
}

static void op_free(struct sthread *t)
{
	struct sblock b;

	if (!t->n)
		return;
	b = take(t, (int)(rnd(&t->rng) % (uint64_t)t->n));
	check_free(t, &b, t->stream);
}

/* Used on the default stream as well: record it, then free. */
static void op_record(struct sthread *t)
{
	struct sblock b;
	int ret;

	if (!t->n)
		return;
	b = take(t, (int)(rnd(&t->rng) % (uint64_t)t->n));
	/* Recorded while spilled, then fetched and checked on the stream. */
	ret = gmlake_record_stream(t->sc->ctx, b.p, NULL);
	if (ret) {
		fail("thread %d: record_stream %p: %d (%s)", t->id, b.p, ret,
		     gmlake_last_error());
		return;
	}
	n_record++;
	check_free(t, &b, NULL);
}

/*
 * Swap one of our blocks with a hand-over slot. A block found there was
 * allocated by another thread on its stream: record ours, check it on ours
 * and free it (a cross-stream free), or keep it.
 */
static void op_handover(struct sthread *t)
{
	struct sctx *sc = t->sc;
	unsigned k = (unsigned)(rnd(&t->rng) % STRESS_SLOTS);
	struct sblock mine = { 0 }, got;
	int ret;

	if (t->n) {
		mine = take(t, (int)(rnd(&t->rng) % (uint64_t)t->n));
		/* Handed over spilled (as it is) or checked on the device. */
		if (!mine.spilled && verify(t, &mine, t->stream))
			return;
	}
	pthread_mutex_lock(&sc->lock);
	got = sc->slot[k];
	sc->slot[k] = mine;
	pthread_mutex_unlock(&sc->lock);
	if (!got.p)
		return;
	ret = gmlake_record_stream(sc->ctx, got.p, t->stream);
	if (ret) {
		fail("thread %d: record_stream %p: %d (%s)", t->id, got.p, ret,
		     gmlake_last_error());
		return;
	}
	/* A spilled block is fetched on this thread's ring before the check;
	 * with no room on the device it stays spilled. */
	ret = fetch_check(t, &got, t->stream);
	if (ret && ret != -ENOMEM)
		return;
	if (rnd(&t->rng) % 2 == 0 && t->n < STRESS_LIVE) {
		t->live[t->n++] = got;
		return;
	}
	if (ret == -ENOMEM)
		n_free_spilled++;
	if (!do_free(t, &got))
		n_cross++;
}

/* Queued ahead of op_async's copies: the stream is busy for 2 ms. */
static void async_stall(void *arg)
{
	struct timespec ts = { 0, 2 * 1000 * 1000 };

	(void)arg;
	nanosleep(&ts, NULL);
}

/* The read-back op_async queued, once its stream ran: the pattern. */
static void async_check(struct sthread *t)
{
	size_t off;
	int ret;

	if (!t->async_size)
		return;
	ret = gmlake_stream_synchronize(t->sc->ctx, t->stream);
	if (ret) {
		fail("thread %d: stream_synchronize: %d (%s)", t->id, ret,
		     gmlake_last_error());
		return;
	}
	off = cookie_mismatch(t->abuf_out, t->async_size, t->async_cookie);
	if (off != SIZE_MAX)
		fail("thread %d: a read queued before its block's free saw "
		     "other data at offset %zu of %zu: the memory was reused "
		     "before the read ran", t->id, off, t->async_size);
	n_bytes += t->async_size;
	t->async_size = 0;
}

/*
 * Asynchronous, as a training step is: a new block is written and read
 * back by copies queued on the thread's stream, and freed while they are
 * still queued; the read is checked later. If the allocator hands the
 * memory to another stream before the read ran (without that stream
 * waiting for it), the other stream's writes show up here. A host
 * function that sleeps 2 ms goes first, so the copies are still queued
 * when the same size is asked for at once on the thread's second stream
 * and written there.
 */
static void op_async(struct sthread *t)
{
	struct gml_dev *dev = gml_ctx_dev(t->sc->ctx);
	/* Large: small blocks stay in their stream's own chunks. */
	size_t size = 2 * MiB + rnd(&t->rng) % (STRESS_MAX - 2 * MiB + 1);
	uint64_t cookie = rnd(&t->rng) | 1;
	void *p;
	int ret;

	async_check(t);
	if (!alloc_counted(t, &p, size, t->stream))
		return;
	cookie_fill(t->abuf_in, size, cookie);
	memset(t->abuf_out, 0x5a, size);
	ret = gml_dev_host_func(dev, t->stream, async_stall, NULL);
	if (!ret)
		ret = gml_dev_memcpy(dev, p, t->abuf_in, size, GML_COPY_HTOD,
				     t->stream);
	if (!ret)
		ret = gml_dev_memcpy(dev, t->abuf_out, p, size, GML_COPY_DTOH,
				     t->stream);
	if (ret)
		fail("thread %d: queued copy of %zu: %d (%s)", t->id, size, ret,
		     gmlake_last_error());
	else
		t->async_size = size, t->async_cookie = cookie;
	if (do_free(t, &(struct sblock){ .p = p, .size = size }))
		return;
	n_async++;
	/* At once, the same size on another stream, written there: it must
	 * not land before the queued read. */
	if (!alloc_counted(t, &p, size, t->other))
		return;
	cookie_fill(t->buf, size, cookie + 2);
	ret = gmlake_memcpy_htod(t->sc->ctx, p, t->buf, size, t->other);
	if (ret)
		fail("thread %d: fill %p+%zu: %d (%s)", t->id, p, size, ret,
		     gmlake_last_error());
	do_free(t, &(struct sblock){ .p = p, .size = size });
}

static void op_trim(struct sthread *t)
{
	int ret = gmlake_trim(t->sc->ctx);

	if (ret)
		fail("thread %d: trim: %d (%s)", t->id, ret,
		     gmlake_last_error());
	n_trim++;
}

struct stress_op {
	const char *name;
	unsigned weight;	/* out of the sum of weights */
	void (*run)(struct sthread *t);
};

static const struct stress_op stress_ops[] = {
	{ "alloc", 46, op_alloc },
	{ "free", 30, op_free },
	{ "record_stream", 6, op_record },
	{ "handover", 16, op_handover },
	{ "trim", 2, op_trim },
	{ "spill", 8, op_spill },
	{ "fetch", 5, op_fetch },
	{ "async", 10, op_async },
};
#define N_OPS (sizeof(stress_ops) / sizeof(stress_ops[0]))

static void op_run(struct sthread *t)
{
	unsigned total = 0, r;
	size_t i;

	for (i = 0; i < N_OPS; i++)
		total += stress_ops[i].weight;
	r = (unsigned)(rnd(&t->rng) % total);
	for (i = 0; r >= stress_ops[i].weight; i++)
		r -= stress_ops[i].weight;
	stress_ops[i].run(t);
	n_ops++;
}

static void *thread_main(void *arg)
{
	struct sthread *t = arg;
	int ret, k;

	ret = gmlake_stream_create(t->sc->ctx, &t->stream);
	if (ret) {
		fail("thread %d: stream_create: %d (%s)", t->id, ret,
		     gmlake_last_error());
		return NULL;
	}
	ret = gmlake_stream_create(t->sc->ctx, &t->other);
	if (ret) {
		fail("thread %d: stream_create: %d (%s)", t->id, ret,
		     gmlake_last_error());
		gmlake_stream_destroy(t->sc->ctx, t->stream);
		return NULL;
	}
	ret = gmlake_offload_init(&t->ring, t->sc->ctx, 4, 0);
	if (ret) {
		fail("thread %d: offload_init: %d (%s)", t->id, ret,
		     gmlake_last_error());
		gmlake_stream_destroy(t->sc->ctx, t->other);
		gmlake_stream_destroy(t->sc->ctx, t->stream);
		return NULL;
	}
	t->abuf_in = malloc(STRESS_MAX);
	t->abuf_out = malloc(STRESS_MAX);
	if (!t->abuf_in || !t->abuf_out)
		fail("thread %d: no host memory for copies", t->id);
	for (k = 0; k < scale * 10 && !atomic_load(&failed); k++) {
		op_run(t);
		if (k % 64 == 63 && (ret = gml_ctx_check(t->sc->ctx)))
			fail("thread %d: gml_ctx_check: %d (%s)", t->id, ret,
			     gmlake_last_error());
	}
	while (t->n) {
		struct sblock b = take(t, t->n - 1);

		check_free(t, &b, t->stream);
	}
	async_check(t);
	free(t->abuf_in);
	free(t->abuf_out);
	ret = gmlake_offload_exit(&t->ring);
	if (ret)
		fail("thread %d: offload_exit: %d (%s)", t->id, ret,
		     gmlake_last_error());
	ret = gmlake_stream_destroy(t->sc->ctx, t->stream);
	if (!ret)
		ret = gmlake_stream_destroy(t->sc->ctx, t->other);
	if (ret)
		fail("thread %d: stream_destroy: %d (%s)", t->id, ret,
		     gmlake_last_error());
	return NULL;
}

/* ---------------------------------------------------------------------- */
/* Phases.                                                                */

static int sctx_open(struct sctx *sc, size_t capacity)
{
	struct gmlake_config cfg;
	int ret;

	memset(sc, 0, sizeof(*sc));
	pthread_mutex_init(&sc->lock, NULL);
	ret = gmlake_config_init(&cfg);
	if (ret)
		return ret;
	cfg.emu_capacity = capacity;
	cfg.small_size = STRESS_SMALL;
	/* Less host memory than the device's: some spills find no room. */
	cfg.host_limit = capacity / 2;
	cfg.show_stats = false;
	return gmlake_ctx_init(&sc->ctx, &cfg);
}

/* Free what was left in the hand-over slots; check nothing is live. */
static void sctx_drain(struct sctx *sc, uint8_t *buf)
{
	struct sthread t = { .sc = sc, .id = -1, .buf = buf };
	struct gmlake_stats st;
	int ret;

	ret = gmlake_offload_init(&t.ring, sc->ctx, 1, 0);
	if (ret) {
		fail("offload_init: %d (%s)", ret, gmlake_last_error());
		return;
	}
	for (int k = 0; k < STRESS_SLOTS; k++) {
		struct sblock b = sc->slot[k];

		sc->slot[k].p = NULL;
		if (b.p)
			check_free(&t, &b, NULL);
	}
	ret = gmlake_offload_exit(&t.ring);
	if (ret)
		fail("offload_exit: %d (%s)", ret, gmlake_last_error());
	ret = gml_ctx_check(sc->ctx);
	if (ret)
		fail("gml_ctx_check: %d (%s)", ret, gmlake_last_error());
	memset(&st, 0, sizeof(st));
	st.version = GMLAKE_STATS_VERSION;
	st.size = sizeof(st);
	ret = gmlake_stats_get(sc->ctx, &st);
	if (ret || st.active_blocks.current || st.requested_bytes.current ||
	    st.spilled_blocks.current || st.host_bytes.current)
		fail("after a phase: stats %d, %" PRId64 " blocks, %" PRId64
		     " bytes live, %" PRId64 " blocks and %" PRId64 " bytes on "
		     "the host", ret, st.active_blocks.current,
		     st.requested_bytes.current, st.spilled_blocks.current,
		     st.host_bytes.current);
}

static void sctx_close(struct sctx *sc)
{
	struct gmlake_stats st;
	int ret = gmlake_trim(sc->ctx);

	if (ret)
		fail("trim: %d (%s)", ret, gmlake_last_error());
	memset(&st, 0, sizeof(st));
	st.version = GMLAKE_STATS_VERSION;
	st.size = sizeof(st);
	if (!gmlake_stats_get(sc->ctx, &st) && st.chunks.current)
		fail("after the last trim: %" PRId64 " chunks held",
		     st.chunks.current);
	n_waits += st.calls[GMLAKE_CALL_stream_wait];
	if (gml_dev_is_emu(gml_ctx_dev(sc->ctx))) {
		struct gml_emu_info info;

		if (gml_emu_info(gml_ctx_dev(sc->ctx)->priv, &info) ||
		    info.live_handles || info.live_mappings || info.used)
			fail("the emulated device still holds %" PRIu64
			     " chunks, %" PRIu64 " mappings, %zu bytes",
			     info.live_handles, info.live_mappings, info.used);
	}
	ret = gmlake_ctx_destroy(sc->ctx, false);
	if (ret)
		fail("ctx_destroy: %d (%s)", ret, gmlake_last_error());
	pthread_mutex_destroy(&sc->lock);
}

/* One phase: every thread on contexts[id % nctx]. */
static int phase(struct sctx *sc, int nctx, int iter, uint8_t **bufs)
{
	struct sthread *ts = calloc((size_t)threads, sizeof(*ts));
	pthread_t *tids = calloc((size_t)threads, sizeof(*tids));
	int i, started = 0;

	if (!ts || !tids) {
		free(ts);
		free(tids);
		fail("no host memory for %d threads", threads);
		return -ENOMEM;
	}
	for (i = 0; i < threads; i++) {
		ts[i].sc = &sc[i % nctx];
		ts[i].id = i;
		ts[i].rng = ((uint64_t)iter << 32) ^ ((uint64_t)nctx << 24) ^
			    (uint64_t)i;
		ts[i].buf = bufs[i];
		if (pthread_create(&tids[i], NULL, thread_main, &ts[i])) {
			fail("pthread_create failed");
			break;
		}
		started++;
	}
	for (i = 0; i < started; i++)
		pthread_join(tids[i], NULL);
	for (i = 0; i < nctx; i++)
		sctx_drain(&sc[i], bufs[0]);
	free(ts);
	free(tids);
	return 0;
}

static int parse_args(int argc, char **argv)
{
	int *vals[] = { &threads, &scale, &iters };

	for (int i = 1; i < argc && i <= 3; i++) {
		char *end;
		long v = strtol(argv[i], &end, 10);

		if (*end || v < 1 || v > 100000) {
			fprintf(stderr, "usage: stress [THREADS [SCALE [ITER]]]"
				" (positive numbers)\n");
			return -EINVAL;
		}
		*vals[i - 1] = (int)v;
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct sctx shared, multi[STRESS_CTXS];
	struct timespec t0, t1;
	uint8_t **bufs;
	int i, it, ret;
	double secs;

	if (parse_args(argc, argv))
		return 1;
	ret = sctx_open(&shared, (size_t)threads * 10 * MiB);
	if (ret == -ENODEV || ret == -EOPNOTSUPP) {
		fprintf(stderr, "stress: no device: %s\n", gmlake_last_error());
		return 77;
	}
	if (ret) {
		fprintf(stderr, "stress: ctx_init: %d (%s)\n", ret,
			gmlake_last_error());
		return 1;
	}
	for (i = 0; i < STRESS_CTXS; i++) {
		ret = sctx_open(&multi[i], (size_t)threads * 6 * MiB);
		if (ret) {
			fprintf(stderr, "stress: ctx_init: %d (%s)\n", ret,
				gmlake_last_error());
			return 1;
		}
	}
	bufs = calloc((size_t)threads, sizeof(*bufs));
	for (i = 0; bufs && i < threads; i++)
		if (!(bufs[i] = malloc(STRESS_MAX)))
			return 1;
	if (!bufs)
		return 1;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (it = 0; it < iters && !atomic_load(&failed); it++) {
		phase(&shared, 1, it, bufs);
		if (!atomic_load(&failed))
			phase(multi, STRESS_CTXS, it, bufs);
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	sctx_close(&shared);
	for (i = 0; i < STRESS_CTXS; i++)
		sctx_close(&multi[i]);
	for (i = 0; i < threads; i++)
		free(bufs[i]);
	free(bufs);
	secs = (double)(t1.tv_sec - t0.tv_sec) +
	       (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
	printf("stress: %d threads, scale %d, %d rounds: %" PRIu64
	       " operations (%" PRIu64 " allocs, %" PRIu64 " frees, %" PRIu64
	       " cross-stream frees, %" PRIu64 " record_stream, %" PRIu64
	       " trims, %" PRIu64 " out of memory; %" PRIu64 " spills and %"
	       PRIu64 " fetches, %" PRIu64 " spills over the host budget, %"
	       PRIu64 " spills of blocks sharing chunks, %"
	       PRIu64 " fetches with no room, %" PRIu64 " small blocks "
	       "refused, %" PRIu64 " spilled blocks freed as they were, %"
	       PRIu64 " freed with copies queued, %" PRIu64 " streams made "
	       "to wait for another), %"
	       PRIu64 " MiB checked, in %.1f s: %s\n", threads, scale, iters,
	       (uint64_t)n_ops,
	       (uint64_t)n_alloc, (uint64_t)n_free, (uint64_t)n_cross,
	       (uint64_t)n_record, (uint64_t)n_trim, (uint64_t)n_oom,
	       (uint64_t)n_spill, (uint64_t)n_fetch, (uint64_t)n_spill_oom,
	       (uint64_t)n_spill_busy,
	       (uint64_t)n_fetch_oom, (uint64_t)n_unmovable,
	       (uint64_t)n_free_spilled, (uint64_t)n_async, (uint64_t)n_waits,
	       (uint64_t)(n_bytes >> 20), secs,
	       atomic_load(&failed) ? "FAILED" : "ok");
	return atomic_load(&failed) ? 1 : 0;
}
