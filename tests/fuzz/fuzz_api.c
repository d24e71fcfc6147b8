/* SPDX-License-Identifier: MIT */
/*
 * fuzz_api: random sequences of public calls on a small emulated device.
 *
 * The first bytes choose the context (granularity, chunk and small sizes,
 * capacity of 4 to 32 chunks, stitched-range cache); then each byte picks
 * one of FZ_NOPS operations and the following bytes its arguments, until
 * the input runs out. Allocations of every kind of size (0, small, about a
 * chunk, several chunks, past the capacity, absurd), frees of good and bad
 * pointers, record_stream, trim, stream create/destroy/synchronize, copies
 * in and out (good and out of bounds), block_size, stats, and an armed
 * driver fault (gml_dev_fail_nth) that makes one later driver call fail.
 *
 * Every block is filled with a pattern of its own and checked before it is
 * freed and whenever it is read back; blocks must never overlap. After
 * every call: the result is one the API allows (while a fault is armed,
 * any negative errno), and gml_ctx_check() holds. At the end everything is
 * freed and trimmed, and the device must hold nothing: no chunk, mapping
 * or device byte; LeakSanitizer checks host memory.
 *
 * Adding an operation (spill and fetch, when the offload manager lands):
 * write op_NAME(struct fz *f, struct fz_in *in) and put it in a free slot
 * of fz_ops[]; slots keep their numbers so that saved inputs keep meaning.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>

#include "fuzz.h"
#include "gmlake.h"
#include "ctx.h"
#include "drv.h"

#define FZ_BLOCKS  64
#define FZ_STREAMS 5	/* the default stream and up to 4 created */
#define FZ_FREED   16	/* recently freed pointers, for double frees */
#define FZ_MAX_OPS 512

struct fz_blk {
	void *p;
	size_t size;
	uint64_t seed;
	int s;		/* stream index it is used on */
};

struct fz {
	gmlake_ctx *ctx;
	struct gml_dev *dev;
	size_t chunk, small, capacity;
	gmlake_stream_t st[FZ_STREAMS];
	bool st_live[FZ_STREAMS];
	struct fz_blk blk[FZ_BLOCKS];
	int n;
	void *freed[FZ_FREED];
	unsigned nfreed;
	uint64_t seeds;
	bool relaxed;	/* a fault is armed: any call may fail */
	const char *op;	/* the operation running, for messages */
};

/* ---------------------------------------------------------------------- */
/* Patterns: byte k of a block with seed s, so any subrange can be made.  */

static uint8_t pat_byte(uint64_t seed, size_t k)
{
	uint64_t z = (seed + 1) * 0x9e3779b97f4a7c15ull + (k >> 3);

	z = (z ^ (z >> 29)) * 0xbf58476d1ce4e5b9ull;
	return (uint8_t)(z >> ((k & 7) * 8));
}

static void pat_fill(uint8_t *buf, size_t off, size_t len, uint64_t seed)
{
	size_t k = 0;

	for (; k < len && (off + k) & 7; k++)
		buf[k] = pat_byte(seed, off + k);
	for (; k + 8 <= len; k += 8) {
		uint64_t z = (seed + 1) * 0x9e3779b97f4a7c15ull +
			     ((off + k) >> 3);

		z = (z ^ (z >> 29)) * 0xbf58476d1ce4e5b9ull;
		memcpy(buf + k, &z, 8);	/* little-endian, as pat_byte */
	}
	for (; k < len; k++)
		buf[k] = pat_byte(seed, off + k);
}

/* ---------------------------------------------------------------------- */
/* Results and invariants.                                                */

static void check(struct fz *f)
{
	int ret = gml_ctx_check(f->ctx);

	if (ret)
		fz_fail("%s: gml_ctx_check: %d (%s)", f->op, ret,
			gmlake_last_error());
}

/* A failure must be a negative errno with a message. */
static void failure_ok(struct fz *f, const char *what, int ret)
{
	if (ret >= 0 || ret <= -4096)
		fz_fail("%s: %s returned %d", f->op, what, ret);
	if (!*gmlake_last_error())
		fz_fail("%s: %s returned %d without a message", f->op, what,
			ret);
}

/* ret must be want, or (under a fault) any negative errno. */
static void expect(struct fz *f, const char *what, int ret, int want)
{
	if (ret == want)
		return;
	if (f->relaxed && ret < 0) {
		failure_ok(f, what, ret);
		return;
	}
	fz_fail("%s: %s returned %d, expected %d (%s)", f->op, what, ret, want,
		gmlake_last_error());
}

static gmlake_stream_t stream_of(struct fz *f, int s)
{
	return f->st_live[s] ? f->st[s] : NULL;
}

/* A live stream index (0, the default stream, is always live). */
static int pick_stream(struct fz *f, struct fz_in *in)
{
	int s = (int)fz_pick(in, FZ_STREAMS);

	return f->st_live[s] ? s : 0;
}

static int pick_block(struct fz *f, struct fz_in *in)
{
	return f->n ? (int)fz_pick(in, (unsigned)f->n) : -1;
}

static bool is_live_start(struct fz *f, const void *p)
{
	for (int i = 0; i < f->n; i++)
		if (f->blk[i].p == p)
			return true;
	return false;
}

/* Read [off, off+len) of block i back and compare with its pattern. */
static void verify(struct fz *f, int i, size_t off, size_t len, int s)
{
	struct fz_blk *b = &f->blk[i];
	uint8_t *buf = malloc(len ? len : 1), *want = malloc(len ? len : 1);
	int ret;

	if (!buf || !want)
		fz_fail("out of host memory");
	memset(buf, 0xa5, len);
	ret = gmlake_memcpy_dtoh(f->ctx, buf, (uint8_t *)b->p + off, len,
				 stream_of(f, s));
	expect(f, "gmlake_memcpy_dtoh", ret, 0);
	/* A fault fires once: the second read must work. */
	if (ret && gmlake_memcpy_dtoh(f->ctx, buf, (uint8_t *)b->p + off, len,
				      stream_of(f, s)))
		fz_fail("%s: the read failed twice: %s", f->op,
			gmlake_last_error());
	pat_fill(want, off, len, b->seed);
	if (memcmp(buf, want, len)) {
		size_t k = 0;

		while (buf[k] == want[k])
			k++;
		fz_fail("%s: block %p (%zu bytes) corrupt at offset %zu",
			f->op, b->p, b->size, off + k);
	}
	free(want);
	free(buf);
}

/* Write block i's pattern over [off, off+len). 0 or the copy's error. */
static int write_pattern(struct fz *f, int i, size_t off, size_t len, int s)
{
	struct fz_blk *b = &f->blk[i];
	uint8_t *buf = malloc(len ? len : 1);
	int ret;

	if (!buf)
		fz_fail("out of host memory");
	pat_fill(buf, off, len, b->seed);
	ret = gmlake_memcpy_htod(f->ctx, (uint8_t *)b->p + off, buf, len,
				 stream_of(f, s));
	expect(f, "gmlake_memcpy_htod", ret, 0);
	free(buf);
	return ret;
}

static void forget_block(struct fz *f, int i)
{
	f->freed[f->nfreed++ % FZ_FREED] = f->blk[i].p;
	f->blk[i] = f->blk[--f->n];
}

/* ---------------------------------------------------------------------- */
/* Operations.                                                            */

/* A size of one of six kinds; *must_fail when no device could serve it. */
static size_t pick_size(struct fz *f, struct fz_in *in, bool *must_fail)
{
	uint32_t v = fz_u32(in);
	static const size_t absurd[] = {
		SIZE_MAX, SIZE_MAX - 4095, (size_t)1 << 62,
		(size_t)INT64_MAX + 1, (size_t)1 << 40,
	};
	size_t size;

	switch (fz_pick(in, 8)) {
	case 0:
		return 0;
	case 1:
	case 2:
		size = 1 + v % f->small;
		break;
	case 3:
		size = f->small + v % (2 * f->chunk);
		break;
	case 4:
	case 5:
		size = (1 + v % 8) * f->chunk - (v >> 16) % 3 * 512;
		break;
	case 6:
		size = 1 + v % (2 * f->capacity);
		break;
	default:
		size = absurd[v % (sizeof(absurd) / sizeof(absurd[0]))];
		break;
	}
	*must_fail = size > f->capacity;
	return size;
}

static void op_alloc(struct fz *f, struct fz_in *in)
{
	bool must_fail = false;
	size_t size = pick_size(f, in, &must_fail), got = 0;
	int s = pick_stream(f, in), ret;
	struct fz_blk *b;
	void *p = NULL;

	if (f->n == FZ_BLOCKS)
		return;
	ret = gmlake_alloc(f->ctx, &p, size, stream_of(f, s));
	check(f);
	if (size == 0) {
		expect(f, "gmlake_alloc(0)", ret, -EINVAL);
		return;
	}
	if (ret) {
		failure_ok(f, "gmlake_alloc", ret);
		if (ret != -ENOMEM && !must_fail && !f->relaxed)
			fz_fail("gmlake_alloc(%zu): %d", size, ret);
		return;
	}
	if (must_fail)
		fz_fail("gmlake_alloc(%zu) succeeded on a device of %zu bytes",
			size, f->capacity);
	if (!p || (uintptr_t)p % 512)
		fz_fail("gmlake_alloc(%zu) gave %p", size, p);
	for (int i = 0; i < f->n; i++) {
		uintptr_t a = (uintptr_t)p, c = (uintptr_t)f->blk[i].p;

		if (a < c + f->blk[i].size && c < a + size)
			fz_fail("block %p+%zu overlaps block %p+%zu", p, size,
				f->blk[i].p, f->blk[i].size);
	}
	ret = gmlake_block_size(f->ctx, p, &got);
	if (ret || got != size)
		fz_fail("gmlake_block_size(%p): %d, %zu bytes, asked %zu", p,
			ret, got, size);
	b = &f->blk[f->n++];
	b->p = p;
	b->size = size;
	b->seed = ++f->seeds;
	b->s = s;
	/* A fault fires once: a failed fill must work the second time. */
	if (write_pattern(f, f->n - 1, 0, size, s) &&
	    write_pattern(f, f->n - 1, 0, size, s))
		fz_fail("%s: the fill failed twice: %s", f->op,
			gmlake_last_error());
}

static void op_free(struct fz *f, struct fz_in *in)
{
	int i = pick_block(f, in), ret;
	size_t sz;

	if (i < 0)
		return;
	verify(f, i, 0, f->blk[i].size, f->blk[i].s);
	ret = gmlake_free(f->ctx, f->blk[i].p);
	check(f);
	expect(f, "gmlake_free", ret, 0);
	if (ret == 0) {
		forget_block(f, i);
		return;
	}
	/* A failed free leaves the block whole or ends it. */
	ret = gmlake_block_size(f->ctx, f->blk[i].p, &sz);
	if (ret == 0 && sz != f->blk[i].size)
		fz_fail("block %p changed size after a failed free",
			f->blk[i].p);
	if (ret)
		forget_block(f, i);
}

/* Pointers that are no live block's start: each free must say -EINVAL. */
static void op_free_bad(struct fz *f, struct fz_in *in)
{
	uint32_t v = fz_u32(in);
	int local = 0, i = pick_block(f, in), want = -EINVAL;
	void *p;

	switch (fz_pick(in, 5)) {
	case 0:
		p = NULL;
		want = 0;
		break;
	case 1:
		if (i < 0 || f->blk[i].size < 2)
			return;
		p = (uint8_t *)f->blk[i].p + 1 + v % (f->blk[i].size - 1);
		break;
	case 2:
		if (!f->nfreed)
			return;
		p = f->freed[v % (f->nfreed < FZ_FREED ? f->nfreed : FZ_FREED)];
		break;
	case 3:
		p = &local;
		break;
	default:
		p = (void *)(uintptr_t)((uint64_t)v << (v % 20));
		want = p ? -EINVAL : 0;
		break;
	}
	if (p && is_live_start(f, p))
		return;
	expect(f, "gmlake_free(bad pointer)", gmlake_free(f->ctx, p), want);
	check(f);
}

static void op_record_stream(struct fz *f, struct fz_in *in)
{
	int i = pick_block(f, in), s = pick_stream(f, in), local;

	if (fz_u8(in) % 8 == 0) {
		expect(f, "gmlake_record_stream(bad pointer)",
		       gmlake_record_stream(f->ctx, &local, stream_of(f, s)),
		       -EINVAL);
	} else if (i >= 0) {
		expect(f, "gmlake_record_stream",
		       gmlake_record_stream(f->ctx, f->blk[i].p,
					    stream_of(f, s)), 0);
	}
	check(f);
}

static void op_trim(struct fz *f, struct fz_in *in)
{
	expect(f, "gmlake_trim", gmlake_trim(f->ctx), 0);
	check(f);
}

static void op_stream_create(struct fz *f, struct fz_in *in)
{
	int s = 1 + (int)fz_pick(in, FZ_STREAMS - 1), ret;

	if (f->st_live[s])
		return;
	ret = gmlake_stream_create(f->ctx, &f->st[s]);
	check(f);
	expect(f, "gmlake_stream_create", ret, 0);
	f->st_live[s] = ret == 0;
}

static void op_stream_destroy(struct fz *f, struct fz_in *in)
{
	int s = 1 + (int)fz_pick(in, FZ_STREAMS - 1), ret;

	if (fz_u8(in) % 8 == 0) {
		int local;

		expect(f, "gmlake_stream_destroy(bad)",
		       gmlake_stream_destroy(f->ctx,
					     (gmlake_stream_t)(void *)&local),
		       -EINVAL);
		expect(f, "gmlake_stream_destroy(NULL)",
		       gmlake_stream_destroy(f->ctx, NULL), -EINVAL);
		check(f);
		return;
	}
	if (!f->st_live[s])
		return;
	ret = gmlake_stream_destroy(f->ctx, f->st[s]);
	check(f);
	expect(f, "gmlake_stream_destroy", ret, 0);
	if (ret)
		return;
	f->st_live[s] = false;
	/* Its blocks stay live; they are used on the default stream now. */
	for (int i = 0; i < f->n; i++)
		if (f->blk[i].s == s)
			f->blk[i].s = 0;
}

/* Rewrite part of a block (on any stream) and read all of it back. */
static void op_copy(struct fz *f, struct fz_in *in)
{
	int i = pick_block(f, in), s = pick_stream(f, in);
	uint32_t a = fz_u32(in), b = fz_u32(in);
	size_t off, len;

	if (i < 0)
		return;
	off = a % f->blk[i].size;
	len = 1 + b % (f->blk[i].size - off);
	/* After a failed write (a fault) the range is written again. */
	if (write_pattern(f, i, off, len, s) &&
	    write_pattern(f, i, off, len, s))
		fz_fail("%s: the write failed twice: %s", f->op,
			gmlake_last_error());
	verify(f, i, 0, f->blk[i].size, s);
	check(f);
}

/* Copies that must be refused: past a block's end, outside every block. */
static void op_copy_bad(struct fz *f, struct fz_in *in)
{
	int i = pick_block(f, in), local = 0;
	uint8_t buf[64], *big;
	size_t len;

	memset(buf, 0, sizeof(buf));
	switch (fz_pick(in, 4)) {
	case 0:
		/* Past the end of what was handed out: the size rounded up
		 * to whole chunks, and one chunk more. */
		if (i < 0)
			return;
		len = (f->blk[i].size + 2 * f->chunk - 1) / f->chunk * f->chunk;
		big = calloc(1, len);
		if (!big)
			fz_fail("out of host memory");
		expect(f, "gmlake_memcpy_htod(past the end)",
		       gmlake_memcpy_htod(f->ctx, f->blk[i].p, big, len, NULL),
		       -EINVAL);
		free(big);
		break;
	case 1:
		expect(f, "gmlake_memcpy_dtoh(host source)",
		       gmlake_memcpy_dtoh(f->ctx, buf, &local, sizeof(local),
					  NULL), -EINVAL);
		break;
	case 2:
		if (i < 0)
			return;
		expect(f, "gmlake_memcpy_htod(NULL source)",
		       gmlake_memcpy_htod(f->ctx, f->blk[i].p, NULL, 1, NULL),
		       -EINVAL);
		break;
	default:
		if (i < 0)
			return;
		expect(f, "gmlake_memcpy_dtoh(0 bytes)",
		       gmlake_memcpy_dtoh(f->ctx, buf, f->blk[i].p, 0, NULL),
		       0);
		break;
	}
	check(f);
}

static void op_sync(struct fz *f, struct fz_in *in)
{
	int s = pick_stream(f, in);

	expect(f, "gmlake_stream_synchronize",
	       gmlake_stream_synchronize(f->ctx, stream_of(f, s)), 0);
	check(f);
}

static void op_block_size(struct fz *f, struct fz_in *in)
{
	int i = pick_block(f, in), local;
	size_t sz = 0;

	if (i >= 0 && fz_u8(in) % 4) {
		int ret = gmlake_block_size(f->ctx, f->blk[i].p, &sz);

		if (ret || sz != f->blk[i].size)
			fz_fail("gmlake_block_size(%p): %d, %zu, expected %zu",
				f->blk[i].p, ret, sz, f->blk[i].size);
	} else {
		expect(f, "gmlake_block_size(bad)",
		       gmlake_block_size(f->ctx, &local, &sz), -EINVAL);
	}
}

/* The counters agree with the blocks this program holds. */
static void op_stats(struct fz *f, struct fz_in *in)
{
	struct gmlake_stats st;
	int64_t bytes = 0;
	int ret;

	memset(&st, 0, sizeof(st));
	st.version = GMLAKE_STATS_VERSION;
	st.size = sizeof(st);
	ret = gmlake_stats_get(f->ctx, &st);
	if (ret)
		fz_fail("gmlake_stats_get: %d (%s)", ret, gmlake_last_error());
	for (int i = 0; i < f->n; i++)
		bytes += (int64_t)f->blk[i].size;
	if (st.active_blocks.current != f->n ||
	    st.requested_bytes.current != bytes)
		fz_fail("stats: %" PRId64 " blocks of %" PRId64 " bytes, "
			"expected %d of %" PRId64, st.active_blocks.current,
			st.requested_bytes.current, f->n, bytes);
	if (st.reserved_bytes.current > (int64_t)f->capacity)
		fz_fail("stats: %" PRId64 " bytes reserved on a device of %zu",
			st.reserved_bytes.current, f->capacity);
}

/* Arm a fault: one of the next few driver calls of one kind fails. */
static void op_fault(struct fz *f, struct fz_in *in)
{
	int kind = (int)fz_pick(in, GMLAKE_CALL_COUNT);
	uint64_t nth = 1 + fz_pick(in, 8);

	gml_dev_fail_nth(f->dev, kind, nth, fz_u8(in) & 1 ? EIO : ENOMEM);
}

struct fz_op {
	const char *name;
	void (*run)(struct fz *f, struct fz_in *in);
};

/* Fixed slots: a saved input means the same calls as long as slots stay. */
static const struct fz_op fz_ops[] = {
	{ "alloc", op_alloc },
	{ "free", op_free },
	{ "free bad pointer", op_free_bad },
	{ "record_stream", op_record_stream },
	{ "trim", op_trim },
	{ "stream create", op_stream_create },
	{ "stream destroy", op_stream_destroy },
	{ "copy", op_copy },
	{ "bad copy", op_copy_bad },
	{ "sync", op_sync },
	{ "block_size", op_block_size },
	{ "stats", op_stats },
	{ "fault", op_fault },
	{ "alloc", op_alloc },
	{ "spill (free slot: offload manager)", NULL },
	{ "fetch (free slot: offload manager)", NULL },
};
#define FZ_NOPS (sizeof(fz_ops) / sizeof(fz_ops[0]))

/* ---------------------------------------------------------------------- */

static void open_ctx(struct fz *f, struct fz_in *in)
{
	struct gmlake_config cfg;
	size_t gran;
	int ret;

	if (gmlake_config_init(&cfg))
		fz_fail("gmlake_config_init: %s", gmlake_last_error());
	gran = (size_t)4096 << fz_pick(in, 5);		/* 4 KiB .. 64 KiB */
	cfg.backend = GMLAKE_BACKEND_EMU;
	cfg.emu_granularity = gran;
	cfg.chunk_size = gran << fz_pick(in, 2);
	cfg.small_size = cfg.chunk_size >> (1 + fz_pick(in, 4));
	cfg.stitch_min = cfg.chunk_size * (1 + fz_pick(in, 2));
	cfg.stitch_cache_max = fz_pick(in, 5);
	cfg.emu_capacity = cfg.chunk_size * (4 + fz_pick(in, 29));
	cfg.log_level = GMLAKE_LOG_ERROR;
	cfg.show_stats = false;
	cfg.publish = false;
	ret = gmlake_ctx_init(&f->ctx, &cfg);
	if (ret)
		fz_fail("gmlake_ctx_init: %d (%s)", ret, gmlake_last_error());
	f->dev = gml_ctx_dev(f->ctx);
	f->chunk = cfg.chunk_size;
	f->small = cfg.small_size ? cfg.small_size : 1;
	f->capacity = cfg.emu_capacity;
	f->st_live[0] = true;
}

/* Free everything; the device must then hold nothing. */
static void close_ctx(struct fz *f)
{
	struct gml_emu_info info;
	int ret;

	gml_dev_fail_nth(f->dev, -1, 0, 0);
	f->relaxed = false;
	f->op = "the end";
	while (f->n) {
		verify(f, 0, 0, f->blk[0].size, f->blk[0].s);
		expect(f, "gmlake_free", gmlake_free(f->ctx, f->blk[0].p), 0);
		forget_block(f, 0);
	}
	for (int s = 1; s < FZ_STREAMS; s++)
		if (f->st_live[s])
			expect(f, "gmlake_stream_destroy",
			       gmlake_stream_destroy(f->ctx, f->st[s]), 0);
	expect(f, "gmlake_trim", gmlake_trim(f->ctx), 0);
	check(f);
	ret = gml_emu_info(f->dev->priv, &info);
	if (ret)
		fz_fail("gml_emu_info: %d", ret);
	if (info.live_handles || info.live_mappings || info.used)
		fz_fail("after freeing all and a trim: %" PRIu64 " chunks, %"
			PRIu64 " mappings, %zu bytes held", info.live_handles,
			info.live_mappings, info.used);
	ret = gmlake_ctx_destroy(f->ctx, false);
	if (ret)
		fz_fail("gmlake_ctx_destroy: %d (%s)", ret, gmlake_last_error());
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct fz_in in = { data, size };
	struct fz f;

	memset(&f, 0, sizeof(f));
	f.op = "init";
	open_ctx(&f, &in);
	for (int k = 0; k < FZ_MAX_OPS && in.n; k++) {
		const struct fz_op *op = &fz_ops[fz_u8(&in) % FZ_NOPS];

		if (!op->run)
			continue;
		f.op = op->name;
		f.relaxed = f.dev->fault.call >= 0;
		op->run(&f, &in);
	}
	close_ctx(&f);
	return 0;
}
