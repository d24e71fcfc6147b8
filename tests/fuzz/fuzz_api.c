/* SPDX-License-Identifier: MIT */
/*
 * fuzz_api: random sequences of public calls on a small emulated device.
 *
 * The first bytes choose the context (granularity, chunk and small sizes,
 * capacity of 4 to 32 chunks, stitched-range cache); then each byte picks
 * one of FZ_NOPS operations and the following bytes its arguments, until
 * the input runs out. Allocations of every kind of size (0, small, about a
 * chunk, several chunks, past the capacity, absurd), frees of good and bad
 * pointers, record_stream, trim, peer access, stream create/destroy/
 * synchronize, copies in and out (good and out of bounds), block_size,
 * stats, and an armed driver fault (gml_dev_fail_nth) that makes one
 * later driver call fail.
 * The block_size slot also exports a block and imports it on the same
 * context (gmlake_ipc_*): the imported range must read the block's
 * pattern, and an exported block's spill must never succeed.
 *
 * Every block is filled with a pattern of its own and checked before it is
 * freed and whenever it is read back; blocks must never overlap. After
 * every call: the result is one the API allows (while a fault is armed,
 * any negative errno), and gml_ctx_check() holds. At the end everything is
 * freed and trimmed, and the device must hold nothing: no chunk, mapping
 * or device byte; LeakSanitizer checks host memory.
 *
 * The offload manager (slots "offload submit" and "offload reap"): the
 * first of them sets up a ring on the context (1 to 8 entries, in place or
 * not; the host budget cfg.host_limit and a device limit cfg.device_limit,
 * both small against the capacity, are chosen then, so the context header
 * keeps its bytes). Spills, fetches and prefetches of live blocks (small
 * ones must complete with -EOPNOTSUPP), requests on freed, interior or host
 * pointers, NULL and unknown opcodes, NOPs, batches up to a full
 * submission queue, peeks and waits for completions, gmlake_advise and
 * allocations that spill offloadable blocks automatically, the ring torn
 * down and set up again. The target tracks every request: submit must
 * take exactly the entries the completion queue has room for, each
 * completion must be one its request allows (0, -ENOMEM from the host
 * budget or a full device, -EBUSY when another request moves the block or,
 * for a spill, a stitched range in use shares its chunks; any errno under
 * a fault), and a block with nothing in flight must be
 * resident or spilled as its last completion says. Copies to a block that
 * is not on the device must fail with -EFAULT and never succeed; a block
 * with a request in flight is freed only by an attempt that may say
 * -EBUSY (the block stays) or 0 (its requests then end with -EINVAL or
 * their result). At the end every completion is reaped, every spilled
 * block is fetched back and its bytes checked.
 *
 * Adding an operation: write op_NAME(struct fz *f, struct fz_in *in) and
 * put it in a free slot of fz_ops[] (none is left: give an existing slot
 * sub-operations instead, as the offload slots do); slots keep their
 * numbers so that saved inputs keep meaning.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdbool.h>

#include "fuzz.h"
#include "gmlake.h"
#include "gmlake-ipc.h"
#include "gmlake-offload.h"
#include "ctx.h"
#include "drv.h"
#include "types.h"

#define FZ_BLOCKS  64
#define FZ_STREAMS 5	/* the default stream and up to 4 created */
#define FZ_FREED   16	/* recently freed pointers, for double frees */
#define FZ_MAX_OPS 512
#define FZ_REQS    32	/* offload requests not yet reaped: 8 + 2 * 8 */

struct fz_blk {
	void *p;
	size_t size;
	uint64_t seed;
	int s;		/* stream index it is used on */
	/* Offload: */
	int npend;	/* requests naming it, not yet reaped */
	bool multi;	/* more than one of them at once since npend was 0 */
	bool spilled;	/* on the host (exact while npend is 0 and it is
			   not offloadable; offloadable ones may spill) */
	bool offloadable;
	bool exported;	/* gmlake_ipc_export said 0: it never spills */
	uint8_t last_op;	/* the last request to complete, and how */
	int last_res;
	bool last_relaxed;
};

/* What a request names. */
enum fz_req_kind {
	FZ_REQ_BLOCK,	/* a live block (small: -EOPNOTSUPP) */
	FZ_REQ_BAD,	/* no live block's start: -EINVAL */
	FZ_REQ_NOP,	/* 0 */
	FZ_REQ_INVAL,	/* NULL address or unknown opcode: -EINVAL */
};

struct fz_req {
	uint64_t tag;
	void *p;
	uint8_t op;
	int kind;
	bool small;
	bool submitted;
	bool relaxed;	/* a fault was armed while it was in flight */
	bool freed;	/* its block was freed while it was in flight */
	bool before_export;	/* its block exported since: it had completed
				   (export refuses a block with requests in
				   flight), only its completion was not read */
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
	/* Offload: */
	bool ring_live;
	struct gmlake_offload ring;
	unsigned entries;	/* the ring's, rounded up */
	bool off_setup;		/* limits chosen, manager started */
	struct fz_req req[FZ_REQS];
	int nreq;
	uint64_t tags;
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

/*
 * A copy on block i returned ret: true when that is -EFAULT and allowed
 * because the block is not on the device (spilled, moving, or spilled
 * automatically, being offloadable).
 */
static bool not_on_device(struct fz *f, int i, int ret)
{
	struct fz_blk *b = &f->blk[i];
	int st;

	if (ret != -EFAULT)
		return false;
	if (b->npend)
		return true;
	if (!b->spilled && !b->offloadable)
		return false;	/* the caller's expect() fails */
	st = gmlake_offload_state(f->ctx, b->p);
	if (st != GMLAKE_BLOCK_SPILLED)
		fz_fail("%s: a copy on block %p said -EFAULT, its state is %d",
			f->op, b->p, st);
	b->spilled = true;
	return true;
}

/* A copy on block i worked: it must have been on the device. */
static void on_device(struct fz *f, int i)
{
	if (f->blk[i].spilled && !f->blk[i].npend)
		fz_fail("%s: a copy on spilled block %p worked", f->op,
			f->blk[i].p);
}

/* buf, read from [off, off+len) of the block at p (or a mapping of it,
 * at), holds the block's pattern (seed's), or the run fails. */
static void pat_check(struct fz *f, const uint8_t *buf, size_t off,
		      size_t len, uint64_t seed, const void *p, const void *at)
{
	uint8_t *want = malloc(len ? len : 1);
	size_t k = 0;

	if (!want)
		fz_fail("out of host memory");
	pat_fill(want, off, len, seed);
	if (memcmp(buf, want, len)) {
		while (buf[k] == want[k])
			k++;
		fz_fail("%s: block %p read at %p corrupt at offset %zu",
			f->op, p, at, off + k);
	}
	free(want);
}

/* Read [off, off+len) of block i back and compare with its pattern;
 * false when the block is not on the device (see not_on_device). */
static bool verify(struct fz *f, int i, size_t off, size_t len, int s)
{
	struct fz_blk *b = &f->blk[i];
	uint8_t *buf = malloc(len ? len : 1);
	bool done = false;
	int ret;

	if (!buf)
		fz_fail("out of host memory");
	memset(buf, 0xa5, len);
	ret = gmlake_memcpy_dtoh(f->ctx, buf, (uint8_t *)b->p + off, len,
				 stream_of(f, s));
	if (not_on_device(f, i, ret))
		goto out;
	expect(f, "gmlake_memcpy_dtoh", ret, 0);
	/* A fault fires once: the second read must work. */
	if (ret) {
		ret = gmlake_memcpy_dtoh(f->ctx, buf, (uint8_t *)b->p + off,
					 len, stream_of(f, s));
		if (not_on_device(f, i, ret))
			goto out;
		if (ret)
			fz_fail("%s: the read failed twice: %s", f->op,
				gmlake_last_error());
	}
	on_device(f, i);
	pat_check(f, buf, off, len, b->seed, b->p, b->p);
	done = true;
out:
	free(buf);
	return done;
}

/* Write block i's pattern over [off, off+len). 0 or the copy's error;
 * 0 as well when the block is not on the device. */
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
	if (not_on_device(f, i, ret)) {
		ret = 0;
	} else {
		expect(f, "gmlake_memcpy_htod", ret, 0);
		if (!ret)
			on_device(f, i);
	}
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
	memset(b, 0, sizeof(*b));
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

static void off_free_busy(struct fz *f, struct fz_in *in, int i);
static void off_fetch_sync(struct fz *f, int i);

/* Check block i's bytes (when it is on the device) and free it. */
static void free_block(struct fz *f, int i)
{
	size_t sz;
	int ret;

	if (!f->blk[i].spilled)
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

/* A block with requests in flight is freed only by off_free_busy; a
 * spilled one is freed as it is, or fetched back and checked first. */
static void op_free(struct fz *f, struct fz_in *in)
{
	int i = pick_block(f, in);

	if (i < 0)
		return;
	if (f->blk[i].npend) {
		off_free_busy(f, in, i);
		return;
	}
	if (f->blk[i].spilled && fz_u8(in) & 1)
		off_fetch_sync(f, i);
	free_block(f, i);
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

/* A trim, or now and then a peer device's access to everything mapped
 * (peers 1-8, never the 31 the driver layer holds; the device itself and
 * an ordinal past the emulated ones fail), or a new growth budget, any
 * in range (the policy then grows or stitches by it), one out of range
 * refused. */
static void op_trim(struct fz *f, struct fz_in *in)
{
	unsigned k = fz_u8(in);

	if (k % 4) {
		expect(f, "gmlake_trim", gmlake_trim(f->ctx), 0);
	} else if (k % 32 == 8) {
		int old = gmlake_grow_slack(f->ctx, -1);
		int want = (int)(fz_u32(in) % (GMLAKE_GROW_SLACK_MAX + 2));

		if (old < 0 || old > GMLAKE_GROW_SLACK_MAX)
			fz_fail("%s: gmlake_grow_slack(-1) returned %d (%s)",
				f->op, old, gmlake_last_error());
		expect(f, "gmlake_grow_slack", gmlake_grow_slack(f->ctx, want),
		       want > GMLAKE_GROW_SLACK_MAX ? -EINVAL : old);
	} else if (k % 32 == 4) {
		expect(f, "gmlake_peer_access(bad peer)",
		       gmlake_peer_access(f->ctx, k % 64 == 4 ? 0 : 200),
		       -EINVAL);
	} else {
		expect(f, "gmlake_peer_access",
		       gmlake_peer_access(f->ctx, 1 + (int)(k / 4) % 8), 0);
	}
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

/*
 * The block exported and imported again on the same context (a second
 * mapping of its memory, as another process would make): the imported
 * range reads the block's pattern. A block on the device with nothing in
 * flight exports; one that may be moving may say -EBUSY.
 */
static void ipc_roundtrip(struct fz *f, int i)
{
	struct fz_blk *b = &f->blk[i];
	struct gmlake_ipc_block blk;
	bool settled = !b->npend && !b->spilled && !b->offloadable;
	uint8_t *buf;
	void *q = NULL;
	int ret;

	ret = gmlake_ipc_export(f->ctx, b->p, &blk);
	if (ret) {
		if (!f->relaxed && (settled || ret != -EBUSY))
			fz_fail("gmlake_ipc_export(%p): %d (%s)", b->p, ret,
				gmlake_last_error());
		check(f);
		return;
	}
	b->exported = true;
	for (int k = 0; k < f->nreq; k++)
		if (f->req[k].p == b->p)
			f->req[k].before_export = true;
	if (blk.size < b->size || !blk.npieces)
		fz_fail("gmlake_ipc_export(%p): %" PRIu64 " bytes in %u "
			"pieces for a block of %zu", b->p, blk.size,
			blk.npieces, b->size);
	ret = gmlake_ipc_import(f->ctx, &blk, &q);
	gmlake_ipc_block_free(&blk);
	expect(f, "gmlake_ipc_import", ret, 0);
	if (ret) {
		check(f);
		return;
	}
	buf = malloc(b->size ? b->size : 1);
	if (!buf)
		fz_fail("out of host memory");
	ret = gmlake_memcpy_dtoh(f->ctx, buf, q, b->size, NULL);
	expect(f, "gmlake_memcpy_dtoh(imported)", ret, 0);
	if (!ret)
		pat_check(f, buf, 0, b->size, b->seed, b->p, q);
	free(buf);
	ret = gmlake_ipc_close(f->ctx, q);
	expect(f, "gmlake_ipc_close", ret, 0);
	if (ret) {
		/* Once more, unarmed: nothing may stay mapped. */
		gml_dev_fail_nth(f->dev, -1, 0, 0);
		f->relaxed = false;
		expect(f, "gmlake_ipc_close(again)",
		       gmlake_ipc_close(f->ctx, q), 0);
	}
	check(f);
}

static void op_block_size(struct fz *f, struct fz_in *in)
{
	int i = pick_block(f, in), local;
	uint8_t how = fz_u8(in);
	size_t sz = 0;

	if (i >= 0 && how % 8 == 7 && !f->blk[i].spilled) {
		ipc_roundtrip(f, i);
	} else if (i >= 0 && how % 4) {
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
	/* The engine thread may meet it while it runs these. */
	for (int k = 0; k < f->nreq; k++)
		f->req[k].relaxed = true;
}

/* ---------------------------------------------------------------------- */
/* Offload: a ring on the context, and a model of its requests.           */

static int find_block(struct fz *f, const void *p)
{
	for (int i = 0; i < f->n; i++)
		if (f->blk[i].p == p)
			return i;
	return -1;
}

static bool is_small(struct fz *f, int i)
{
	return f->blk[i].size < f->small;
}

/* Spilled blocks first, when there are any: they are what fetches want. */
static int pick_spilled(struct fz *f, struct fz_in *in)
{
	int idx[FZ_BLOCKS], n = 0;

	for (int i = 0; i < f->n; i++)
		if (f->blk[i].spilled)
			idx[n++] = i;
	if (!n)
		return pick_block(f, in);
	return idx[fz_pick(in, (unsigned)n)];
}

/*
 * The first offload operation chooses the host budget (none, a quarter,
 * half or all of the device's capacity, or four times it) and a device
 * limit (none, or 7/8, 3/4, 5/8 of the capacity) before the manager
 * starts, the way gmlake_torch's memory fraction sets the limit of a
 * running context; then the ring: 1 to 8 entries, in place or not.
 */
static bool off_ring(struct fz *f, struct fz_in *in)
{
	unsigned entries, flags;
	int ret;

	if (f->ring_live)
		return true;
	if (!f->off_setup) {
		unsigned h = fz_pick(in, 5), d = fz_pick(in, 4);
		size_t host = h == 0 ? 0 : h == 4 ? 4 * f->capacity :
			      f->capacity >> (3 - h);

		pthread_mutex_lock(&f->ctx->lock);
		f->ctx->cfg.host_limit = host;
		f->ctx->cfg.device_limit = d ? f->capacity - d * f->capacity / 8
					     : 0;
		pthread_mutex_unlock(&f->ctx->lock);
		f->off_setup = true;
	}
	entries = 1u << fz_pick(in, 4);
	flags = fz_u8(in) % 4 == 0 ? GMLAKE_OFFLOAD_INPLACE : 0;
	ret = gmlake_offload_init(&f->ring, f->ctx, entries, flags);
	check(f);
	expect(f, "gmlake_offload_init", ret, 0);
	if (ret)
		return false;
	f->ring_live = true;
	f->entries = entries;
	return true;
}

static int off_count(struct fz *f, bool submitted)
{
	int n = 0;

	for (int k = 0; k < f->nreq; k++)
		n += f->req[k].submitted == submitted;
	return n;
}

/* A submission entry: NULL exactly when the submission queue is full. */
static struct gmlake_offload_sqe *off_sqe(struct fz *f)
{
	struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(&f->ring);
	int queued = off_count(f, false);

	check(f);
	if (!sqe != (queued == (int)f->entries))
		fz_fail("%s: get_sqe gave %p with %d of %u entries queued",
			f->op, (void *)sqe, queued, f->entries);
	if (sqe && f->nreq == FZ_REQS)
		fz_fail("%s: more than %d requests", f->op, FZ_REQS);
	return sqe;
}

static struct fz_req *off_prep(struct fz *f, struct gmlake_offload_sqe *sqe,
			       uint8_t op, void *p, int kind, bool inplace)
{
	struct fz_req *r = &f->req[f->nreq++];

	memset(r, 0, sizeof(*r));
	r->tag = ++f->tags;
	r->p = p;
	r->op = op;
	r->kind = kind;
	r->relaxed = f->relaxed;
	switch (op) {
	case GMLAKE_OFFLOAD_SPILL:
		gmlake_offload_prep_spill(sqe, p);
		break;
	case GMLAKE_OFFLOAD_FETCH:
		gmlake_offload_prep_fetch(sqe, p);
		break;
	case GMLAKE_OFFLOAD_PREFETCH:
		gmlake_offload_prep_prefetch(sqe, p);
		break;
	default:
		sqe->opcode = op;
		sqe->addr = (uint64_t)(uintptr_t)p;
		break;
	}
	if (inplace)
		sqe->flags |= GMLAKE_OFFLOAD_SQE_INPLACE;
	gmlake_offload_sqe_set_data(sqe, r->tag);
	if (kind == FZ_REQ_BLOCK) {
		int i = find_block(f, p);

		r->small = is_small(f, i);
		if (f->blk[i].npend++)
			f->blk[i].multi = true;
	}
	return r;
}

/* Submit: it must take exactly the entries the completion queue has
 * room for, or say -EBUSY when it has none. */
static int off_submit(struct fz *f)
{
	int queued = off_count(f, false), busy = off_count(f, true);
	int room = 2 * (int)f->entries - busy, want, ret;

	want = queued < room ? queued : room;
	ret = gmlake_offload_submit(&f->ring);
	check(f);
	if (queued && !want)
		expect(f, "gmlake_offload_submit (completion queue full)", ret,
		       -EBUSY);
	else
		expect(f, "gmlake_offload_submit", ret, want);
	for (int k = 0, n = ret; k < f->nreq && n > 0; k++) {
		if (f->req[k].submitted)
			continue;
		f->req[k].submitted = true;
		n--;
	}
	return ret;
}

/* Block i has nothing in flight any more: where is it? */
static void off_settle(struct fz *f, int i)
{
	struct fz_blk *b = &f->blk[i];
	int st = gmlake_offload_state(f->ctx, b->p);

	if (st != GMLAKE_BLOCK_RESIDENT && st != GMLAKE_BLOCK_SPILLED)
		fz_fail("%s: block %p is in state %d with nothing in flight",
			f->op, b->p, st);
	if (is_small(f, i) && st != GMLAKE_BLOCK_RESIDENT)
		fz_fail("%s: small block %p in state %d", f->op, b->p, st);
	if (!is_small(f, i) && !b->multi && !b->last_relaxed) {
		bool spill = b->last_op == GMLAKE_OFFLOAD_SPILL, want;

		/* -EBUSY without another request: a spill of a block whose
		 * chunks a stitched range in use maps as well. */
		if (b->last_res == -EBUSY && !spill)
			fz_fail("%s: fetch of %p: -EBUSY with no other request",
				f->op, b->p);
		/* A failed spill leaves the block on the device, a failed
		 * fetch on the host; an offloadable one may spill anyway. */
		want = spill == (b->last_res == 0);
		if (want != (st == GMLAKE_BLOCK_SPILLED) &&
		    !(b->offloadable && st == GMLAKE_BLOCK_SPILLED))
			fz_fail("%s: block %p is in state %d after a %s that "
				"said %d", f->op, b->p, st, spill ? "spill" :
				"fetch", b->last_res);
	}
	b->spilled = st == GMLAKE_BLOCK_SPILLED;
	b->multi = false;
	b->last_relaxed = false;
}

static const char *op_name(uint8_t op)
{
	switch (op) {
	case GMLAKE_OFFLOAD_NOP: return "nop";
	case GMLAKE_OFFLOAD_SPILL: return "spill";
	case GMLAKE_OFFLOAD_FETCH: return "fetch";
	case GMLAKE_OFFLOAD_PREFETCH: return "prefetch";
	default: return "unknown opcode";
	}
}

/* Request k completed with res: one its request allows? */
static void off_complete(struct fz *f, int k, int res)
{
	struct fz_req r = f->req[k];
	bool ok;

	memmove(&f->req[k], &f->req[k + 1],
		(size_t)(f->nreq - k - 1) * sizeof(f->req[0]));
	f->nreq--;
	switch (r.kind) {
	case FZ_REQ_NOP:
		ok = res == 0;
		break;
	case FZ_REQ_BAD:
	case FZ_REQ_INVAL:
		ok = res == -EINVAL;
		break;
	default:
		if (r.small)
			ok = res == -EOPNOTSUPP;
		else
			ok = res == 0 || res == -ENOMEM || res == -EBUSY;
		ok |= r.freed && res == -EINVAL;
		/* An exported block's memory is mapped elsewhere. */
		if (!r.freed && !r.before_export &&
		    r.op == GMLAKE_OFFLOAD_SPILL && res == 0) {
			int i = find_block(f, r.p);

			ok &= i < 0 || !f->blk[i].exported;
		}
		break;
	}
	if (res > 0 || res <= -4096 || (!ok && !(r.relaxed && res < 0)))
		fz_fail("%s: %s of %p (request %d%s%s) completed with %d",
			f->op, op_name(r.op), r.p, r.kind,
			r.freed ? ", block freed" : "",
			r.relaxed ? ", under a fault" : "", res);
	if (r.kind == FZ_REQ_BLOCK && !r.freed) {
		int i = find_block(f, r.p);

		if (i < 0)
			fz_fail("%s: a request's block %p is gone", f->op, r.p);
		f->blk[i].last_op = r.op;
		f->blk[i].last_res = res;
		f->blk[i].last_relaxed |= r.relaxed;
		if (!--f->blk[i].npend)
			off_settle(f, i);
	}
}

/* Reap one completion (wait: block for it); false when there was none. */
static bool off_reap_one(struct fz *f, bool wait)
{
	struct gmlake_offload_cqe *cqe = NULL;
	int busy = off_count(f, true), ret, res;
	uint64_t tag;

	ret = wait ? gmlake_offload_wait_cqe(&f->ring, &cqe) :
		     gmlake_offload_peek_cqe(&f->ring, &cqe);
	check(f);
	if (ret == -EAGAIN) {
		if (wait && busy)
			fz_fail("%s: wait_cqe: -EAGAIN with %d requests "
				"submitted", f->op, busy);
		return false;
	}
	if (ret || !cqe)
		fz_fail("%s: %s_cqe: %d (%s)", f->op, wait ? "wait" : "peek",
			ret, gmlake_last_error());
	tag = gmlake_offload_cqe_get_data(cqe);
	res = cqe->res;
	if (cqe->flags)
		fz_fail("%s: completion flags %#x", f->op, cqe->flags);
	gmlake_offload_cqe_seen(&f->ring, cqe);
	check(f);
	for (int k = 0; k < f->nreq; k++) {
		if (f->req[k].tag != tag)
			continue;
		if (!f->req[k].submitted)
			fz_fail("%s: a completion for request %" PRIu64
				" not submitted", f->op, tag);
		off_complete(f, k, res);
		return true;
	}
	fz_fail("%s: a completion for unknown request %" PRIu64, f->op, tag);
}

/* Submit and reap until request tag is done. */
static void off_wait_for(struct fz *f, uint64_t tag)
{
	for (;;) {
		int k = 0;

		while (k < f->nreq && f->req[k].tag != tag)
			k++;
		if (k == f->nreq)
			return;
		if (!f->req[k].submitted && off_submit(f) > 0)
			continue;
		off_reap_one(f, true);
	}
}

/* Everything submitted and reaped. */
static void off_drain(struct fz *f)
{
	while (f->nreq)
		off_wait_for(f, f->req[0].tag);
}

/* Spill, fetch or prefetch of a live block (small: -EOPNOTSUPP); the
 * entry is submitted at once, or left for a later submit. */
static void off_block_req(struct fz *f, struct fz_in *in, uint8_t op)
{
	int i = op == GMLAKE_OFFLOAD_SPILL ? pick_block(f, in) :
					     pick_spilled(f, in);
	bool inplace = fz_u8(in) % 4 == 0, now = fz_u8(in) % 4 != 0;
	struct gmlake_offload_sqe *sqe;

	if (i < 0)
		return;
	sqe = off_sqe(f);
	if (sqe)
		off_prep(f, sqe, op, f->blk[i].p, FZ_REQ_BLOCK,
			 inplace && op == GMLAKE_OFFLOAD_SPILL);
	if (now || !sqe)
		off_submit(f);
}

/* Entries that must fail (or, NOP, do nothing), each waited for at once:
 * a freed pointer may not be handed out again while it is in flight. */
static void off_bad_req(struct fz *f, struct fz_in *in)
{
	unsigned k = fz_pick(in, 6);
	uint32_t v = fz_u32(in);
	int i = pick_block(f, in), kind = FZ_REQ_BAD;
	uint8_t op = (uint8_t)(1 + fz_pick(in, 3));
	struct gmlake_offload_sqe *sqe;
	void *p;

	switch (k) {
	case 0:
		if (!f->nfreed)
			return;
		p = f->freed[v % (f->nfreed < FZ_FREED ? f->nfreed : FZ_FREED)];
		break;
	case 1:
		if (i < 0 || f->blk[i].size < 2)
			return;
		p = (uint8_t *)f->blk[i].p + 1 + v % (f->blk[i].size - 1);
		break;
	case 2:
		p = &f->tags;		/* host memory */
		break;
	case 3:
		p = NULL;
		kind = FZ_REQ_INVAL;
		break;
	case 4:
		p = i >= 0 ? f->blk[i].p : NULL;
		op = GMLAKE_OFFLOAD_NOP;
		kind = FZ_REQ_NOP;
		break;
	default:
		p = i >= 0 ? f->blk[i].p : &f->tags;
		op = (uint8_t)(GMLAKE_OFFLOAD_PREFETCH + 1 + v % 250);
		kind = FZ_REQ_INVAL;
		break;
	}
	if (kind == FZ_REQ_BAD && is_live_start(f, p))
		return;
	sqe = off_sqe(f);
	if (!sqe) {
		off_submit(f);
		return;
	}
	off_wait_for(f, off_prep(f, sqe, op, p, kind, false)->tag);
}

/* Up to a full submission queue of requests on live blocks, one submit. */
static void off_batch(struct fz *f, struct fz_in *in)
{
	unsigned n = 1 + fz_pick(in, 2 * f->entries);

	for (unsigned k = 0; k < n && f->n; k++) {
		int i = pick_block(f, in);
		uint8_t op = (uint8_t)(1 + fz_pick(in, 3));
		struct gmlake_offload_sqe *sqe = off_sqe(f);

		if (!sqe)
			break;
		off_prep(f, sqe, op, f->blk[i].p, FZ_REQ_BLOCK, false);
	}
	off_submit(f);
}

static void off_advise(struct fz *f, struct fz_in *in)
{
	int i = pick_block(f, in), ret, local = 0;
	unsigned k = fz_pick(in, 4);

	if (k == 3 || i < 0) {
		expect(f, "gmlake_advise(bad advice)",
		       i >= 0 ? gmlake_advise(f->ctx, f->blk[i].p, 7) : -EINVAL,
		       -EINVAL);
		expect(f, "gmlake_advise(host pointer)",
		       gmlake_advise(f->ctx, &local, GMLAKE_ADVISE_OFFLOADABLE),
		       -EINVAL);
		expect(f, "gmlake_advise(NULL)",
		       gmlake_advise(f->ctx, NULL, GMLAKE_ADVISE_OFFLOADABLE),
		       -EINVAL);
		check(f);
		return;
	}
	if (k < 2) {
		ret = gmlake_advise(f->ctx, f->blk[i].p,
				    GMLAKE_ADVISE_OFFLOADABLE);
		check(f);
		expect(f, "gmlake_advise(offloadable)", ret,
		       is_small(f, i) ? -EOPNOTSUPP : 0);
		if (!ret)
			f->blk[i].offloadable = true;
		return;
	}
	ret = gmlake_advise(f->ctx, f->blk[i].p, GMLAKE_ADVISE_NOT_OFFLOADABLE);
	check(f);
	expect(f, "gmlake_advise(not offloadable)", ret, 0);
	if (ret)
		return;
	/* Nothing spills it behind our back now: learn where it is. Its
	 * requests in flight may have finished before an automatic spill,
	 * so their results no longer say where it is. */
	if (f->blk[i].npend && f->blk[i].offloadable)
		f->blk[i].last_relaxed = true;
	f->blk[i].offloadable = false;
	if (!f->blk[i].npend) {
		int st = gmlake_offload_state(f->ctx, f->blk[i].p);

		if (f->blk[i].spilled && st != GMLAKE_BLOCK_SPILLED)
			fz_fail("%s: spilled block %p in state %d", f->op,
				f->blk[i].p, st);
		f->blk[i].spilled = st == GMLAKE_BLOCK_SPILLED;
	}
}

/* Offloadable blocks, then an allocation that may spill them. */
static void off_pressure(struct fz *f, struct fz_in *in)
{
	for (int i = 0; i < f->n; i++) {
		int ret;

		if (is_small(f, i) || !(fz_u8(in) & 1))
			continue;
		ret = gmlake_advise(f->ctx, f->blk[i].p,
				    GMLAKE_ADVISE_OFFLOADABLE);
		check(f);
		expect(f, "gmlake_advise(offloadable)", ret, 0);
		f->blk[i].offloadable |= ret == 0;
	}
	op_alloc(f, in);
}

/*
 * Spilled blocks freed while other streams' work on them is pending: the
 * manager holds their bytes on the host until that work completes, and
 * they count as spilled until then (gmlake_stats_get(3)).
 */
static int freed_spilled(struct fz *f)
{
	int n = 0;

	pthread_mutex_lock(&f->ctx->lock);	/* no driver call: no enter */
	for (struct gml_block *b = f->ctx->deferred; b; b = b->lnext)
		n += !b->small && b->off_state == GML_OFF_SPILLED;
	pthread_mutex_unlock(&f->ctx->lock);
	return n;
}

/* A block's state against the model; the spilled counters. */
static void off_state(struct fz *f, struct fz_in *in)
{
	int i = pick_block(f, in), local = 0, st, spilled = 0;
	struct gmlake_stats stats;
	bool exact = !f->nreq;

	expect(f, "gmlake_offload_state(host pointer)",
	       gmlake_offload_state(f->ctx, &local), -EINVAL);
	expect(f, "gmlake_offload_state(NULL ctx)",
	       gmlake_offload_state(NULL, &local), -EINVAL);
	if (i >= 0) {
		struct fz_blk *b = &f->blk[i];

		st = gmlake_offload_state(f->ctx, b->p);
		if (st < GMLAKE_BLOCK_RESIDENT || st > GMLAKE_BLOCK_FETCHING)
			fz_fail("%s: gmlake_offload_state(%p): %d", f->op,
				b->p, st);
		if (!b->npend) {
			bool sp = st == GMLAKE_BLOCK_SPILLED;

			if (st != GMLAKE_BLOCK_RESIDENT && !sp)
				fz_fail("%s: block %p in state %d with nothing "
					"in flight", f->op, b->p, st);
			if (sp != b->spilled && !(sp && b->offloadable))
				fz_fail("%s: block %p in state %d, spilled %d",
					f->op, b->p, st, b->spilled);
			b->spilled = sp;
		}
	}
	for (int k = 0; k < f->n; k++) {
		exact &= !f->blk[k].offloadable;
		spilled += f->blk[k].spilled;
	}
	spilled += freed_spilled(f);
	memset(&stats, 0, sizeof(stats));
	stats.version = GMLAKE_STATS_VERSION;
	stats.size = sizeof(stats);
	if (gmlake_stats_get(f->ctx, &stats))
		fz_fail("gmlake_stats_get: %s", gmlake_last_error());
	if (exact && stats.spilled_blocks.current != spilled)
		fz_fail("%s: stats: %" PRId64 " blocks spilled, expected %d",
			f->op, stats.spilled_blocks.current, spilled);
	check(f);
}

/* Everything reaped, the ring torn down (twice: the second must fail),
 * bad set-ups refused, and a new ring. */
static void off_reinit(struct fz *f, struct fz_in *in)
{
	int ret;

	off_drain(f);
	ret = gmlake_offload_exit(&f->ring);
	check(f);
	expect(f, "gmlake_offload_exit", ret, 0);
	if (ret)
		return;
	f->ring_live = false;
	expect(f, "gmlake_offload_exit(again)",
	       gmlake_offload_exit(&f->ring), -EINVAL);
	if (gmlake_offload_get_sqe(&f->ring))
		fz_fail("%s: get_sqe on a ring that was torn down", f->op);
	expect(f, "gmlake_offload_submit(torn down)",
	       gmlake_offload_submit(&f->ring), -EINVAL);
	expect(f, "gmlake_offload_init(0 entries)",
	       gmlake_offload_init(&f->ring, f->ctx, 0, 0), -EINVAL);
	expect(f, "gmlake_offload_init(4097 entries)",
	       gmlake_offload_init(&f->ring, f->ctx, 4097, 0), -EINVAL);
	expect(f, "gmlake_offload_init(bad flags)",
	       gmlake_offload_init(&f->ring, f->ctx, 4, 1u << 7), -EINVAL);
	expect(f, "gmlake_offload_init(NULL ctx)",
	       gmlake_offload_init(&f->ring, NULL, 4, 0), -EINVAL);
	check(f);
	off_ring(f, in);
}

/* Free block i while requests on it are in flight (or leave it): -EBUSY
 * keeps it; 0 ends it, and its requests are reaped at once, before the
 * address can be handed out again. */
static void off_free_busy(struct fz *f, struct fz_in *in, int i)
{
	void *p = f->blk[i].p;
	size_t sz = 0;
	int ret;

	if (fz_u8(in) & 1)
		return;
	ret = gmlake_free(f->ctx, p);
	check(f);
	if (ret == -EBUSY || (ret && f->relaxed)) {
		if (ret != -EBUSY)
			failure_ok(f, "gmlake_free", ret);
		ret = gmlake_block_size(f->ctx, p, &sz);
		if (ret == 0 && sz != f->blk[i].size)
			fz_fail("block %p changed size after a failed free", p);
		if (ret == 0)
			return;
	} else if (ret) {
		fz_fail("%s: gmlake_free of a block in flight: %d (%s)", f->op,
			ret, gmlake_last_error());
	}
	for (int k = 0; k < f->nreq; k++)
		if (f->req[k].kind == FZ_REQ_BLOCK && f->req[k].p == p)
			f->req[k].freed = true;
	forget_block(f, i);
	for (int k = 0; k < f->nreq;) {
		if (f->req[k].freed) {
			off_wait_for(f, f->req[k].tag);
			k = 0;
		} else {
			k++;
		}
	}
}

/* Fetch block i back and wait for it (its completion updates it). */
static void off_fetch_sync(struct fz *f, int i)
{
	struct gmlake_offload_sqe *sqe;

	while (!(sqe = off_sqe(f))) {
		/* The queue is full of entries that found no room. */
		if (off_submit(f) <= 0)
			off_reap_one(f, true);
	}
	off_wait_for(f, off_prep(f, sqe, GMLAKE_OFFLOAD_FETCH, f->blk[i].p,
				 FZ_REQ_BLOCK, false)->tag);
}

/* Slot "offload submit". */
static void op_off_submit(struct fz *f, struct fz_in *in)
{
	unsigned what = fz_pick(in, 8);

	if (!off_ring(f, in))
		return;
	switch (what) {
	case 0:
	case 1:
	case 2:
		off_block_req(f, in, GMLAKE_OFFLOAD_SPILL);
		break;
	case 3:
		off_block_req(f, in, fz_u8(in) & 1 ? GMLAKE_OFFLOAD_FETCH :
				     GMLAKE_OFFLOAD_PREFETCH);
		break;
	case 4:
		off_bad_req(f, in);
		break;
	case 5:
		off_advise(f, in);
		break;
	case 6:
		off_batch(f, in);
		break;
	default:
		off_pressure(f, in);
		break;
	}
}

/* Slot "offload reap". */
static void op_off_reap(struct fz *f, struct fz_in *in)
{
	unsigned what = fz_pick(in, 8), n;

	if (!off_ring(f, in))
		return;
	switch (what) {
	case 0:
	case 1:
		off_block_req(f, in, GMLAKE_OFFLOAD_FETCH);
		break;
	case 2:
		off_block_req(f, in, GMLAKE_OFFLOAD_PREFETCH);
		break;
	case 3:
	case 4:
		n = 1 + fz_pick(in, 4);
		while (n-- && off_reap_one(f, false))
			;
		break;
	case 5:
		off_drain(f);
		break;
	case 6:
		off_state(f, in);
		break;
	default:
		off_reinit(f, in);
		break;
	}
}

/* The end: nothing in flight, nothing offloadable, no device limit; the
 * blocks on the device are checked and freed, then each spilled block is
 * fetched back, checked and freed. */
static void off_end(struct fz *f)
{
	if (!f->off_setup)
		return;
	if (f->ring_live)
		off_drain(f);
	for (int i = 0; i < f->n; i++) {
		int st;

		expect(f, "gmlake_advise(not offloadable)",
		       gmlake_advise(f->ctx, f->blk[i].p,
				     GMLAKE_ADVISE_NOT_OFFLOADABLE), 0);
		f->blk[i].offloadable = false;
		st = gmlake_offload_state(f->ctx, f->blk[i].p);
		if (st != GMLAKE_BLOCK_SPILLED && st != GMLAKE_BLOCK_RESIDENT)
			fz_fail("%s: block %p in state %d", f->op, f->blk[i].p,
				st);
		f->blk[i].spilled = st == GMLAKE_BLOCK_SPILLED;
	}
	check(f);
	pthread_mutex_lock(&f->ctx->lock);
	f->ctx->cfg.device_limit = 0;
	pthread_mutex_unlock(&f->ctx->lock);
	for (int i = f->n - 1; i >= 0; i--) {
		if (f->blk[i].spilled)
			continue;
		if (!verify(f, i, 0, f->blk[i].size, f->blk[i].s))
			fz_fail("%s: block %p is not on the device", f->op,
				f->blk[i].p);
		expect(f, "gmlake_free", gmlake_free(f->ctx, f->blk[i].p), 0);
		forget_block(f, i);
		check(f);
	}
	if (f->n && !f->ring_live) {
		expect(f, "gmlake_offload_init",
		       gmlake_offload_init(&f->ring, f->ctx, 4, 0), 0);
		f->ring_live = true;
		f->entries = 4;
	}
	while (f->n) {
		off_fetch_sync(f, 0);
		if (f->blk[0].spilled)
			fz_fail("%s: block %p (%zu bytes) cannot be fetched "
				"back: %d", f->op, f->blk[0].p, f->blk[0].size,
				f->blk[0].last_res);
		if (!verify(f, 0, 0, f->blk[0].size, f->blk[0].s))
			fz_fail("%s: block %p is not on the device after its "
				"fetch", f->op, f->blk[0].p);
		expect(f, "gmlake_free", gmlake_free(f->ctx, f->blk[0].p), 0);
		forget_block(f, 0);
		check(f);
	}
	if (f->ring_live)
		expect(f, "gmlake_offload_exit", gmlake_offload_exit(&f->ring),
		       0);
	f->ring_live = false;
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
	{ "offload submit", op_off_submit },
	{ "offload reap", op_off_reap },
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
	cfg.pack = fz_pick(in, 2);	/* blocks sharing end chunks */
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
	off_end(f);
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
