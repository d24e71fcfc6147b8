/* SPDX-License-Identifier: MIT */
/*
 * check_fault: every error path of the allocator, reached by failing the
 * Nth driver call of one kind (gml_dev_fail_nth) on the emulated device.
 *
 * For each call kind the allocation paths use, and for nth = 1, 2, ... until
 * the scenario runs through without the fault firing, a fixed scenario runs
 * with the fault armed: grow, stitch, stitched reuse, cross-stream reuse,
 * free, trim, grow again, out of memory. Every public call must succeed or
 * return a negative errno; afterwards the invariants hold, live blocks keep
 * their bytes, the next allocation works, and freeing everything plus a
 * trim leaves no chunk, mapping or reservation on the device.
 *
 * Every call kind is walked, the copies and waits included: a failed
 * copy leaves its block's bytes undefined (the block is filled again once
 * the fault is disarmed), and even after a failed wait the copy must be
 * over when the call returns (the host buffer is freed at once).
 *
 * The kinds walked include the device layer's own (gml_dev_call): stream
 * create and destroy, the memory query and entering the device's context,
 * which every public call does.
 *
 * Further cases fail calls inside gmlake_ctx_destroy and check that the
 * process is left with no descriptor and no mapping of the device; fail
 * stream create and destroy once each; walk the offload manager's life
 * (its set-up with two copy streams, a spill and a fetch, its tear-down);
 * and make gmlake_ctx_init fail at each of its steps. Each walk prints its
 * number of fault sites.
 */
#include <pthread.h>
#include <sys/resource.h>
#include <time.h>

#include "gmlake-offload.h"
#include "helpers.h"
#include "error.h"

#define CAP_CHUNKS(n) ((size_t)(n) * TH_CHUNK)
#define F_BLOCKS 32
#define F_MAX_NTH 400

/* Let a held stream go after a while, from another thread. */
struct f_unhold {
	gmlake_ctx *ctx;
	gmlake_stream_t s;
	pthread_t thread;
};

static void *f_unhold_later(void *arg)
{
	struct f_unhold *u = arg;
	struct timespec ts = { 0, 50 * 1000 * 1000 };

	nanosleep(&ts, NULL);
	gml_emu_stream_hold(gml_ctx_dev(u->ctx)->priv, u->s, false);
	return NULL;
}

/* Every call kind: the allocation paths, the waits and the copies. */
static const int fault_kinds[] = {
	GMLAKE_CALL_mem_create,	  GMLAKE_CALL_va_reserve,
	GMLAKE_CALL_mem_map,	  GMLAKE_CALL_set_access,
	GMLAKE_CALL_mem_unmap,	  GMLAKE_CALL_mem_release,
	GMLAKE_CALL_va_free,	  GMLAKE_CALL_event_create,
	GMLAKE_CALL_event_record, GMLAKE_CALL_event_query,
	GMLAKE_CALL_event_sync,	  GMLAKE_CALL_stream_sync,
	GMLAKE_CALL_memcpy,	  GMLAKE_CALL_stream_wait,
	GML_CALL_stream_create,
	GML_CALL_stream_destroy,  GML_CALL_mem_info,
	GML_CALL_enter,
};
#define N_KINDS ((int)(sizeof(fault_kinds) / sizeof(fault_kinds[0])))

static const int fault_errs[] = { ENOMEM, EIO };

/* The fault of the run in progress, for messages: "mem_map nth 3 EIO". */
static char site[64];

/* The invariants, with the fault site and step in the message. */
static void f_check(gmlake_ctx *ctx, const char *step)
{
	int ret = gml_ctx_check(ctx);

	ck_assert_msg(ret == 0, "%s, after %s: gml_ctx_check: %d (%s)", site,
		      step, ret, gmlake_last_error());
}

struct fblk {
	void *p;
	size_t size;
	uint64_t seed;
	gmlake_stream_t s;
	bool live;
	bool dirty;	/* a copy into it failed: its bytes are undefined */
};

struct fs {
	gmlake_ctx *ctx;
	gmlake_stream_t a, b, c;	/* c: made and destroyed mid-way */
	struct fblk blk[F_BLOCKS];
	int n;
	int failed;		/* public calls that returned an error */
	int lost;		/* frees that failed yet ended the block */
	char trace[64];		/* the step that runs, for messages */
};

/* A public call's result: 0, or a negative errno. Never anything else. */
static bool f_ok(struct fs *f, int ret, const char *what)
{
	ck_assert_msg(ret <= 0 && ret > -4096, "%s: %s: %s returned %d",
		      site, f->trace, what, ret);
	f_check(f->ctx, f->trace);
	if (ret) {
		ck_assert_msg(*gmlake_last_error(), "%s: %s: %s returned %d "
			      "without a message", site, f->trace, what, ret);
		f->failed++;
	}
	return ret == 0;
}

/* Keep p (size bytes on s) as a new slot and fill it; the slot. */
static int f_keep(struct fs *f, void *p, size_t size, gmlake_stream_t s)
{
	struct fblk *b;
	int ret;

	ck_assert_int_lt(f->n, F_BLOCKS);
	b = &f->blk[f->n];
	b->p = p;
	b->size = size;
	b->seed = 0xf000 + (uint64_t)f->n;
	b->s = s;
	b->live = true;
	b->dirty = false;
	snprintf(f->trace, sizeof(f->trace), "fill %zu", size);
	ret = th_fill(f->ctx, p, size, b->seed, s);
	if (!f_ok(f, ret, "gmlake_memcpy_htod"))
		b->dirty = true;	/* filled again after the fault */
	return f->n++;
}

/* Allocate and fill; the slot, or -1 when the allocation failed. */
static int f_alloc(struct fs *f, size_t size, gmlake_stream_t s)
{
	void *p = NULL;
	int ret;

	snprintf(f->trace, sizeof(f->trace), "alloc %zu", size);
	ret = gmlake_alloc(f->ctx, &p, size, s);
	if (!f_ok(f, ret, "gmlake_alloc"))
		return -1;
	return f_keep(f, p, size, s);
}

/* A live block keeps its bytes (unless a failed copy left them undefined). */
static void f_verify(struct fs *f, const struct fblk *b)
{
	size_t diff = 0;
	int ret;

	if (b->dirty)
		return;
	snprintf(f->trace, sizeof(f->trace), "read %zu", b->size);
	ret = th_verify(f->ctx, b->p, b->size, b->seed, b->s, &diff);
	ck_assert_msg(ret != 1, "%s: block %p (%zu bytes) corrupt at "
		      "offset %zu", site, b->p, b->size, diff);
	f_ok(f, ret, "gmlake_memcpy_dtoh");
}

/* Free; a failed free must leave the block whole or gone. */
static void f_release(struct fs *f, struct fblk *b)
{
	size_t sz;
	int ret;

	snprintf(f->trace, sizeof(f->trace), "free %zu", b->size);
	ret = gmlake_free(f->ctx, b->p);
	if (f_ok(f, ret, "gmlake_free")) {
		b->live = false;
		return;
	}
	ret = gmlake_block_size(f->ctx, b->p, &sz);
	if (ret == 0) {
		ck_assert_uint_eq(sz, b->size);
		return;		/* still live: checked and freed later */
	}
	ck_assert_int_eq(ret, -EINVAL);
	b->live = false;
	f->lost++;
}

/* Verify and free. */
static void f_free(struct fs *f, int i)
{
	if (i < 0 || !f->blk[i].live)
		return;
	f_verify(f, &f->blk[i]);
	f_release(f, &f->blk[i]);
}

static void f_trim(struct fs *f)
{
	snprintf(f->trace, sizeof(f->trace), "trim");
	f_ok(f, gmlake_trim(f->ctx), "gmlake_trim");
}

static void f_sync(struct fs *f, gmlake_stream_t s)
{
	snprintf(f->trace, sizeof(f->trace), "sync");
	f_ok(f, gmlake_stream_synchronize(f->ctx, s),
	     "gmlake_stream_synchronize");
}

/*
 * Verify block i (on a), hold a, free it, and allocate size on b while a
 * is held; a is let go 50 ms later by a thread, and b's block is filled
 * once a ran. The new block joins the others.
 */
static void f_free_held(struct fs *f, int i, size_t size)
{
	struct f_unhold u = { f->ctx, f->a, 0 };
	void *p = NULL;
	int ret;

	if (i < 0 || !f->blk[i].live || f->blk[i].s != f->a)
		return;
	f_verify(f, &f->blk[i]);
	th_hold(f->ctx, f->a, true);
	ck_assert_int_eq(pthread_create(&u.thread, NULL, f_unhold_later, &u),
			 0);
	f_release(f, &f->blk[i]);
	snprintf(f->trace, sizeof(f->trace), "alloc %zu on b, a held", size);
	ret = gmlake_alloc(f->ctx, &p, size, f->b);
	ck_assert_int_eq(pthread_join(u.thread, NULL), 0);
	if (f_ok(f, ret, "gmlake_alloc"))
		f_keep(f, p, size, f->b);
}

/* The fixed scenario; runs with a fault armed. */
static void scenario(struct fs *f)
{
	int i0, i1, i3, i5, i6, i7, i9, s0, s1;
	void *p = NULL;

	/* Grow: large blocks and small ones, on two streams. */
	i0 = f_alloc(f, 4 * TH_MiB, f->a);
	i1 = f_alloc(f, 2 * TH_MiB, f->a);
	f_alloc(f, 2 * TH_MiB, f->a);
	i3 = f_alloc(f, 2 * TH_MiB, f->a);
	f_alloc(f, 2 * TH_MiB, f->a);
	i5 = f_alloc(f, 6 * TH_MiB, f->a);
	s0 = f_alloc(f, 3000, f->a);
	s1 = f_alloc(f, 70000, f->a);
	f_alloc(f, 100, f->b);

	/*
	 * Cross-stream ordering: the 6 MiB block is freed on a while a's
	 * work is held, and b takes its chunks (the budget is full), waiting
	 * for a on the device. If a fault sends the request down another
	 * path that waits on the host, a thread lets a go after 50 ms.
	 */
	f_free_held(f, i5, 6 * TH_MiB);

	/* Stitch two non-adjacent free chunks, then reuse the range. */
	f_free(f, i1);
	f_free(f, i3);
	i6 = f_alloc(f, 4 * TH_MiB, f->a);
	f_free(f, i6);
	i7 = f_alloc(f, 4 * TH_MiB, f->a);

	/* Cross-stream reuse: freed on a, synchronized, taken on b. */
	f_free(f, i0);
	f_sync(f, f->a);
	f_alloc(f, 4 * TH_MiB, f->b);

	/* A stream made, used and destroyed with freed blocks on it. */
	snprintf(f->trace, sizeof(f->trace), "stream create");
	if (f_ok(f, gmlake_stream_create(f->ctx, &f->c),
		 "gmlake_stream_create")) {
		int c0 = f_alloc(f, 2 * TH_MiB, f->c), c1 = f_alloc(f, 500, f->c);

		f_free(f, c0);
		f_free(f, c1);
		snprintf(f->trace, sizeof(f->trace), "stream destroy");
		if (f_ok(f, gmlake_stream_destroy(f->ctx, f->c),
			 "gmlake_stream_destroy"))
			f->c = NULL;
	}

	/* Free and trim twice around a workspace, as cuDNN's benchmark
	 * does; grow again, ahead of need after the burst (with slabs: a
	 * 2 MiB block regrows a whole handle); out of memory; free and
	 * trim. */
	f_free(f, s0);
	f_free(f, i7);
	f_trim(f);
	f_free(f, f_alloc(f, 2 * TH_MiB, f->b));
	f_trim(f);
	f_alloc(f, 2 * TH_MiB, f->b);
	f_alloc(f, 2 * TH_MiB, f->b);
	i9 = f_alloc(f, 8 * TH_MiB, f->b);
	f_alloc(f, 1000, f->b);
	snprintf(f->trace, sizeof(f->trace), "alloc 64 MiB");
	ck_assert_int_lt(gmlake_alloc(f->ctx, &p, 64 * TH_MiB, f->a), 0);
	f_check(f->ctx, f->trace);
	f_free(f, i9);
	f_free(f, s1);
	f_trim(f);
}

/* After the scenario, with the fault disarmed: all must be well. */
static void aftermath(struct fs *f, const struct gml_emu_info *base)
{
	struct gml_emu_info info;
	struct gmlake_stats st;
	void *p = NULL;
	int i, ret;

	f_check(f->ctx, "the scenario");
	if (f->c) {
		TH_OK(f->ctx, gmlake_stream_destroy(f->ctx, f->c));
		f->c = NULL;
	}
	for (i = 0; i < f->n; i++) {
		struct fblk *b = &f->blk[i];

		if (b->live && b->s != f->a && b->s != f->b)
			b->s = NULL;	/* its stream was destroyed */
		if (b->live && b->dirty)
			th_fill_ok(f->ctx, b->p, b->size, b->seed, b->s);
		b->dirty = false;
		if (b->live)
			th_verify_ok(f->ctx, b->p, b->size, b->seed, b->s);
	}

	/* The next allocations work. */
	ret = gmlake_alloc(f->ctx, &p, 4 * TH_MiB, f->a);
	ck_assert_msg(ret == 0, "%s: alloc after the fault: %d (%s)", site,
		      ret, gmlake_last_error());
	th_fill_ok(f->ctx, p, 4 * TH_MiB, 1, f->a);
	th_verify_ok(f->ctx, p, 4 * TH_MiB, 1, f->a);
	th_free(f->ctx, p);
	p = th_alloc(f->ctx, 512, f->b);
	th_free(f->ctx, p);

	/* Everything freed and trimmed: nothing left on the device. */
	for (i = 0; i < f->n; i++) {
		if (!f->blk[i].live)
			continue;
		th_verify_ok(f->ctx, f->blk[i].p, f->blk[i].size,
			     f->blk[i].seed, f->blk[i].s);
		th_free(f->ctx, f->blk[i].p);
		f->blk[i].live = false;
	}
	th_sync(f->ctx, f->a);
	th_sync(f->ctx, f->b);
	ret = gmlake_trim(f->ctx);
	ck_assert_msg(ret == 0, "%s: trim after the fault: %d (%s)", site,
		      ret, gmlake_last_error());
	f_check(f->ctx, "the last trim");
	th_stats(f->ctx, &st);
	ck_assert_int_eq(st.active_blocks.current, 0);
	ck_assert_int_eq(st.requested_bytes.current, 0);
	ck_assert_msg(st.reserved_bytes.current == 0 && st.chunks.current == 0,
		      "%s: all freed and trimmed, %" PRId64 " chunks, %" PRId64
		      " bytes reserved", site, st.chunks.current,
		      st.reserved_bytes.current);
	th_emu_info(f->ctx, &info);
	ck_assert_msg(info.live_handles == 0, "%s: %" PRIu64 " chunks leaked",
		      site, info.live_handles);
	ck_assert_msg(info.live_mappings == 0, "%s: %" PRIu64
		      " mappings leaked", site, info.live_mappings);
	ck_assert_msg(info.live_reservations <= base->live_reservations,
		      "%s: %" PRIu64 " reservations, %" PRIu64 " at the start",
		      site, info.live_reservations, base->live_reservations);
	ck_assert_msg(info.used == 0, "%s: %zu device bytes held", site,
		      info.used);
}

/*
 * One run: a fresh context, the fault (kind, nth, err) armed, the scenario,
 * the checks. Whether the fault fired.
 */
static bool run_one(int kind, uint64_t nth, int err, size_t grow_handle,
		    int *failed, int *lost)
{
	struct gmlake_config cfg;
	struct fs f;
	struct gml_emu_info base;
	struct gml_dev *dev;
	uint64_t before;
	bool fired;

	memset(&f, 0, sizeof(f));
	th_config(&cfg, CAP_CHUNKS(16));
	cfg.grow_handle = grow_handle;
	f.ctx = th_ctx_cfg(&cfg);
	ck_assert(th_is_emu(f.ctx));
	f.a = th_stream(f.ctx);
	f.b = th_stream(f.ctx);
	th_emu_info(f.ctx, &base);
	dev = th_dev(f.ctx);
	before = dev->call_failures[kind];
	snprintf(site, sizeof(site), "%s nth %" PRIu64 " %s%s",
		 gml_dev_call_name(kind), nth, err == EIO ? "EIO" : "ENOMEM",
		 grow_handle ? ", 4 MiB growth handles" : "");
	gml_dev_fail_nth(dev, kind, nth, err);

	scenario(&f);

	fired = dev->call_failures[kind] > before;
	gml_dev_fail_nth(dev, -1, 0, 0);
	ck_assert_msg(fired || f.failed == 0,
		      "%s nth %" PRIu64 ": %d calls failed, no fault fired",
		      gml_dev_call_name(kind), nth, f.failed);
	aftermath(&f, &base);
	TH_OK(f.ctx, gmlake_stream_destroy(f.ctx, f.a));
	TH_OK(f.ctx, gmlake_stream_destroy(f.ctx, f.b));
	th_destroy(f.ctx);
	*failed += f.failed;
	*lost += f.lost;
	return fired;
}

/*
 * Every fault site of one call kind; _i past N_KINDS: with growth
 * handles (slabs) of two chunks, so that the scenario's blocks of 4 MiB
 * and more grow, stitch, spill and release them; below, growth by chunks
 * (the default 20 MiB handles are more than its blocks).
 */
START_TEST(test_fault_walk)
{
	int kind = fault_kinds[_i % N_KINDS];
	size_t grow_handle = _i >= N_KINDS ? 4 * TH_MiB : 0;
	int e, sites = 0, failed = 0, lost = 0;
	int fds = th_count_fds(), maps = th_count_memfd_maps();
	uint64_t nth;

	for (e = 0; e < 2; e++) {
		for (nth = 1; nth <= F_MAX_NTH; nth++) {
			if (!run_one(kind, nth, fault_errs[e], grow_handle,
				     &failed, &lost))
				break;
			sites++;
		}
		ck_assert_msg(nth <= F_MAX_NTH, "%s: still firing at nth %d",
			      gml_dev_call_name(kind), F_MAX_NTH);
	}
	printf("fault sites exercised: %s%s: %d (kind, nth, errno) runs, %d "
	       "public calls failed, %d failed frees ended their block\n",
	       gml_dev_call_name(kind), grow_handle ? " (slabs)" : "", sites,
	       failed, lost);
	/* The scenario maps, unmaps and releases memory: those must fire. */
	switch (kind) {
	case GMLAKE_CALL_mem_create:
	case GMLAKE_CALL_va_reserve:
	case GMLAKE_CALL_mem_map:
	case GMLAKE_CALL_set_access:
	case GMLAKE_CALL_mem_unmap:
	case GMLAKE_CALL_mem_release:
	case GMLAKE_CALL_va_free:
	case GMLAKE_CALL_stream_sync:
	case GMLAKE_CALL_memcpy:
	case GMLAKE_CALL_stream_wait:
	case GML_CALL_stream_create:
	case GML_CALL_stream_destroy:
	case GML_CALL_mem_info:
	case GML_CALL_enter:
		ck_assert_msg(sites > 0, "%s never called by the scenario",
			      gml_dev_call_name(kind));
		break;
	default:
		break;
	}
	ck_assert_int_eq(th_count_fds(), fds);
	ck_assert_int_eq(th_count_memfd_maps(), maps);
}
END_TEST

/* Frees must be stream-ordered: some event call must be in the scenario. */
START_TEST(test_fault_events_used)
{
	struct fs f;
	struct gmlake_stats st;

	memset(&f, 0, sizeof(f));
	snprintf(site, sizeof(site), "no fault");
	f.ctx = th_ctx(CAP_CHUNKS(16));
	f.a = th_stream(f.ctx);
	f.b = th_stream(f.ctx);
	scenario(&f);
	ck_assert_int_eq(f.failed, 0);
	th_stats(f.ctx, &st);
	printf("scenario calls:");
	{
		int k;

		for (k = 0; k < GMLAKE_CALL_COUNT; k++)
			printf(" %s=%" PRIu64, gmlake_call_name(k),
			       st.calls[k]);
	}
	printf("\n");
	ck_assert_uint_gt(st.calls[GMLAKE_CALL_event_record] +
				  st.calls[GMLAKE_CALL_event_query],
			  0);
	ck_assert_uint_eq(st.call_failures[GMLAKE_CALL_mem_map], 0);
	/* b took the held block's chunks, ordered after a on the device. */
	ck_assert_uint_ge(st.calls[GMLAKE_CALL_stream_wait], 1);
	aftermath(&f, &(struct gml_emu_info){ .live_reservations = ~0ull });
	TH_OK(f.ctx, gmlake_stream_destroy(f.ctx, f.a));
	TH_OK(f.ctx, gmlake_stream_destroy(f.ctx, f.b));
	th_destroy(f.ctx);
}
END_TEST

/* The call counters follow injected failures. */
START_TEST(test_fault_counted)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(16));
	struct gmlake_stats s0, s1;
	void *p = NULL;
	int ret;

	th_stats(ctx, &s0);
	gml_dev_fail_nth(th_dev(ctx), GMLAKE_CALL_mem_create, 1, EIO);
	ret = gmlake_alloc(ctx, &p, 4 * TH_MiB, NULL);
	th_check(ctx);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.call_failures[GMLAKE_CALL_mem_create],
			  s0.call_failures[GMLAKE_CALL_mem_create] + 1);
	if (ret == 0) {
		/* Retried: fine, the block must be whole. */
		th_fill_ok(ctx, p, 4 * TH_MiB, 1, NULL);
		th_free(ctx, p);
	} else {
		ck_assert_int_lt(ret, 0);
		ck_assert_str_ne(gmlake_last_error(), "");
		th_stats(ctx, &s1);
		ck_assert_int_eq(s1.active_blocks.current, 0);
	}
	p = th_alloc(ctx, 4 * TH_MiB, NULL);
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Faults inside gmlake_ctx_destroy.                                      */

#define D_MAX_NTH 12

static gmlake_ctx *destroy_state(bool leave_live)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(16));
	gmlake_stream_t a = th_stream(ctx);
	void *p[8], *big, *sm;
	int i;

	for (i = 0; i < 8; i++)
		p[i] = th_alloc(ctx, 2 * TH_MiB, a);
	sm = th_alloc(ctx, 5000, a);
	for (i = 0; i < 8; i += 2)
		th_free(ctx, p[i]);
	big = th_alloc(ctx, 8 * TH_MiB, a);	/* stitched */
	th_free(ctx, big);			/* cached */
	if (!leave_live) {
		for (i = 1; i < 8; i += 2)
			th_free(ctx, p[i]);
		th_free(ctx, sm);
		th_sync(ctx, a);
		TH_OK(ctx, gmlake_stream_destroy(ctx, a));
	}
	return ctx;
}

START_TEST(test_fault_destroy)
{
	int kind = fault_kinds[_i];
	int fds = th_count_fds(), maps = th_count_memfd_maps();
	int force, nth, errors = 0;

	for (force = 0; force < 2; force++) {
		for (nth = 1; nth <= D_MAX_NTH; nth++) {
			gmlake_ctx *ctx = destroy_state(force);
			int ret;

			gml_dev_fail_nth(th_dev(ctx), kind, (uint64_t)nth,
					 EIO);
			ret = gmlake_ctx_destroy(ctx, force);
			ck_assert_msg(ret == 0 || ret == -EIO,
				      "destroy (%s nth %d): %d",
				      gml_dev_call_name(kind), nth, ret);
			ck_assert_msg(ret != -EBUSY, "destroy refused");
			errors += ret != 0;
			/* It could not enter the device's context: nothing
			 * was destroyed, and the next try does it. */
			if (ret && kind == GML_CALL_enter)
				ret = gmlake_ctx_destroy(ctx, force);
			ck_assert_msg(ret == 0, "destroy (%s nth %d) once "
				      "more: %d", gml_dev_call_name(kind), nth,
				      ret);
			ck_assert_msg(th_count_fds() == fds &&
					      th_count_memfd_maps() == maps,
				      "destroy with %s nth %d failing (force "
				      "%d) left %d descriptors, %d device "
				      "mappings (before: %d, %d)",
				      gml_dev_call_name(kind), nth, force,
				      th_count_fds(), th_count_memfd_maps(),
				      fds, maps);
		}
	}
	printf("destroy with %s failing: %d of %d destroys reported it\n",
	       gml_dev_call_name(kind), errors, 2 * D_MAX_NTH);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Stream create and destroy failing once each                            */

START_TEST(test_fault_stream_ops)
{
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(16));
	struct gml_dev *dev = th_dev(ctx);
	struct gml_emu_info base, info;
	gmlake_stream_t s = NULL, t = NULL;
	void *p;
	int ret, sites = 0;

	th_emu_info(ctx, &base);

	/* Create fails: an error, nothing made, the next create works. */
	gml_dev_fail_nth(dev, GML_CALL_stream_create, 1, ENOMEM);
	ret = gmlake_stream_create(ctx, &s);
	ck_assert_int_eq(ret, -ENOMEM);
	ck_assert_str_ne(gmlake_last_error(), "");
	th_check(ctx);
	th_emu_info(ctx, &info);
	ck_assert_uint_eq(info.live_streams, base.live_streams);
	sites++;
	s = th_stream(ctx);

	/* Destroy fails: an error, the stream still works, destroy again. */
	p = th_alloc(ctx, 4 * TH_MiB, s);
	th_fill_ok(ctx, p, 4 * TH_MiB, 7, s);
	th_free(ctx, p);
	gml_dev_fail_nth(dev, GML_CALL_stream_destroy, 1, EIO);
	ret = gmlake_stream_destroy(ctx, s);
	ck_assert_int_eq(ret, -EIO);
	th_check(ctx);
	sites++;
	p = th_alloc(ctx, 4 * TH_MiB, s);
	th_fill_ok(ctx, p, 4 * TH_MiB, 8, s);
	th_verify_ok(ctx, p, 4 * TH_MiB, 8, s);
	t = th_stream(ctx);
	TH_OK(ctx, gmlake_record_stream(ctx, p, t));
	th_free(ctx, p);
	TH_OK(ctx, gmlake_stream_destroy(ctx, s));
	TH_OK(ctx, gmlake_stream_destroy(ctx, t));

	/* Everything gone: no stream, chunk or mapping left behind. */
	TH_OK(ctx, gmlake_trim(ctx));
	th_emu_info(ctx, &info);
	ck_assert_uint_eq(info.live_streams, base.live_streams);
	ck_assert_uint_eq(info.live_handles, 0);
	ck_assert_uint_eq(info.live_mappings, 0);
	printf("fault sites exercised: stream_create/stream_destroy: %d\n",
	       sites);
	th_destroy(ctx);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* The offload manager's life: set-up, a round trip, tear-down            */

#define O_MAX_NTH 60

/* One request through ring, waited for: its completion's res. */
static int o_move(struct gmlake_offload *ring, int op, void *p)
{
	struct gmlake_offload_sqe *sqe = gmlake_offload_get_sqe(ring);
	struct gmlake_offload_cqe *cqe;
	int ret, res;

	ck_assert_ptr_nonnull(sqe);
	if (op == GMLAKE_OFFLOAD_SPILL)
		gmlake_offload_prep_spill(sqe, p);
	else
		gmlake_offload_prep_fetch(sqe, p);
	ck_assert_int_eq(gmlake_offload_submit(ring), 1);
	ret = gmlake_offload_wait_cqe(ring, &cqe);
	ck_assert_msg(ret == 0, "%s: wait_cqe: %d", site, ret);
	res = cqe->res;
	gmlake_offload_cqe_seen(ring, cqe);
	ck_assert_msg(res <= 0 && res > -4096, "%s: res %d", site, res);
	return res;
}

/*
 * One run with the fault armed: at set-up (the first ring starts the
 * manager: its copy streams, eventfd and engine thread) and through one
 * spill and fetch; or (teardown) only while the context, whose manager
 * ran, is destroyed. Every call succeeds or fails with -errno, the block
 * keeps its bytes, the next round trip works, and nothing is left: no
 * descriptor (eventfd, io_uring) and no mapping of the device.
 */
static bool o_run(int kind, uint64_t nth, bool teardown, int *failed)
{
	int fds = th_count_fds(), maps = th_count_memfd_maps();
	gmlake_ctx *ctx = th_ctx(CAP_CHUNKS(16));
	struct gml_dev *dev = th_dev(ctx);
	uint64_t before = dev->call_failures[kind];
	struct gmlake_offload ring;
	void *p = th_alloc_filled(ctx, 4 * TH_MiB, 0x0ff, NULL);
	bool fired = false;
	int ret;

	snprintf(site, sizeof(site), "offload %s: %s nth %" PRIu64,
		 teardown ? "teardown" : "setup", gml_dev_call_name(kind), nth);
	if (!teardown)
		gml_dev_fail_nth(dev, kind, nth, EIO);
	ret = gmlake_offload_init(&ring, ctx, 4, 0);
	ck_assert_msg(ret <= 0, "%s: offload_init: %d", site, ret);
	if (ret) {
		ck_assert_str_ne(gmlake_last_error(), "");
		(*failed)++;
		gml_dev_fail_nth(dev, -1, 0, 0);
		TH_OK(ctx, gmlake_offload_init(&ring, ctx, 4, 0));
	}
	*failed += o_move(&ring, GMLAKE_OFFLOAD_SPILL, p) != 0;
	th_check(ctx);
	if (gmlake_offload_state(ctx, p) == GMLAKE_BLOCK_SPILLED &&
	    o_move(&ring, GMLAKE_OFFLOAD_FETCH, p)) {
		(*failed)++;
		gml_dev_fail_nth(dev, -1, 0, 0);	/* fired: try again */
		ck_assert_int_eq(o_move(&ring, GMLAKE_OFFLOAD_FETCH, p), 0);
	}
	th_check(ctx);
	if (!teardown) {
		fired = dev->call_failures[kind] > before;
		gml_dev_fail_nth(dev, -1, 0, 0);
	}
	th_verify_ok(ctx, p, 4 * TH_MiB, 0x0ff, NULL);
	ck_assert_int_eq(o_move(&ring, GMLAKE_OFFLOAD_SPILL, p), 0);
	ck_assert_int_eq(o_move(&ring, GMLAKE_OFFLOAD_FETCH, p), 0);
	th_verify_ok(ctx, p, 4 * TH_MiB, 0x0ff, NULL);
	TH_OK(ctx, gmlake_offload_exit(&ring));
	th_free(ctx, p);
	if (teardown) {
		/* The device closes with the context, and its counters: the
		 * injected fault's message tells whether it fired (destroy
		 * runs the tear-down in this thread). */
		gml_clear_error();
		gml_dev_fail_nth(dev, kind, nth, EIO);
		ret = gmlake_ctx_destroy(ctx, false);
		ck_assert_msg(ret == 0 || ret == -EIO, "%s: destroy: %d", site,
			      ret);
		fired = strstr(gmlake_last_error(), "injected fault") != NULL;
		if (ret) {
			/* It could not enter: nothing destroyed. */
			ck_assert_int_eq(kind, GML_CALL_enter);
			(*failed)++;
			th_destroy(ctx);
		}
	} else {
		th_destroy(ctx);
	}
	ck_assert_msg(th_count_fds() == fds && th_count_memfd_maps() == maps,
		      "%s: %d descriptors, %d device mappings left (before: "
		      "%d, %d)", site, th_count_fds(), th_count_memfd_maps(),
		      fds, maps);
	return fired;
}

/* Set-up and a round trip: nth = 1, 2, ... until the fault no longer
 * fires. */
START_TEST(test_fault_offload_setup)
{
	int kind = fault_kinds[_i];
	int sites = 0, failed = 0;
	uint64_t nth;

	for (nth = 1; nth <= O_MAX_NTH; nth++) {
		if (!o_run(kind, nth, false, &failed))
			break;
		sites++;
	}
	ck_assert_msg(nth <= O_MAX_NTH, "offload set-up: %s still firing at "
		      "nth %d", gml_dev_call_name(kind), O_MAX_NTH);
	printf("fault sites exercised: offload set-up: %s: %d runs, %d "
	       "calls failed\n", gml_dev_call_name(kind), sites, failed);
	if (kind == GML_CALL_stream_create || kind == GML_CALL_enter)
		ck_assert_msg(sites > 0, "offload set-up never calls %s",
			      gml_dev_call_name(kind));
}
END_TEST

/* Tear-down: the first calls of each kind that destroy makes (the
 * counters go with the device, so a fixed number of them). */
#define O_TEARDOWN_NTH 8

START_TEST(test_fault_offload_teardown)
{
	int kind = fault_kinds[_i];
	int sites = 0, failed = 0;

	for (uint64_t nth = 1; nth <= O_TEARDOWN_NTH; nth++)
		sites += o_run(kind, nth, true, &failed);
	printf("fault sites exercised: offload tear-down: %s: %d runs, %d "
	       "calls failed\n", gml_dev_call_name(kind), sites, failed);
	if (kind == GMLAKE_CALL_stream_sync ||
	    kind == GML_CALL_stream_destroy || kind == GML_CALL_enter)
		ck_assert_msg(sites > 0, "offload tear-down never calls %s",
			      gml_dev_call_name(kind));
}
END_TEST

/* ---------------------------------------------------------------------- */
/* gmlake_ctx_init failing at each of its steps.                          */

static void init_fails(const struct gmlake_config *cfg, int want,
		       const char *what)
{
	int fds = th_count_fds(), maps = th_count_memfd_maps();
	gmlake_ctx *ctx = NULL;
	int ret = gmlake_ctx_init(&ctx, cfg);

	ck_assert_msg(ret == want, "%s: gmlake_ctx_init = %d, expected %d",
		      what, ret, want);
	ck_assert_ptr_null(ctx);
	ck_assert_str_ne(gmlake_last_error(), "");
	ck_assert_int_eq(th_count_fds(), fds);
	ck_assert_int_eq(th_count_memfd_maps(), maps);
	/* The next context works. */
	ctx = th_ctx(CAP_CHUNKS(4));
	th_destroy(ctx);
}

START_TEST(test_fault_init)
{
	struct gmlake_config cfg;
	struct rlimit rl, none;
	int fds, maps, ret, sites = 0;
	gmlake_ctx *ctx = NULL;

	th_config(&cfg, CAP_CHUNKS(4));
	cfg.backend = GMLAKE_BACKEND_EMU;
	cfg.emu_granularity = 3 * 4096;		/* not a power of two */
	init_fails(&cfg, -EINVAL, "granularity");
	sites++;

	th_config(&cfg, 4096);			/* below the granularity */
	cfg.backend = GMLAKE_BACKEND_EMU;
	init_fails(&cfg, -EINVAL, "capacity");
	sites++;

	th_config(&cfg, CAP_CHUNKS(4));
	cfg.backend = GMLAKE_BACKEND_EMU;
	cfg.chunk_size = 3 * TH_CHUNK;		/* not a power of two */
	init_fails(&cfg, -EINVAL, "chunk size");
	sites++;

	th_config(&cfg, CAP_CHUNKS(4));
	cfg.backend = GMLAKE_BACKEND_EMU;
	cfg.small_size = 2 * TH_CHUNK;		/* above the chunk size */
	init_fails(&cfg, -EINVAL, "small size");
	sites++;

	th_config(&cfg, CAP_CHUNKS(4));
	cfg.version = 0;
	init_fails(&cfg, -EINVAL, "config version");
	sites++;

	/* No descriptor left for the device memory: memfd_create fails. */
	th_config(&cfg, CAP_CHUNKS(4));
	cfg.backend = GMLAKE_BACKEND_EMU;
	fds = th_count_fds();
	maps = th_count_memfd_maps();
	ck_assert_int_eq(getrlimit(RLIMIT_NOFILE, &rl), 0);
	none = rl;
	none.rlim_cur = 0;
	ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &none), 0);
	ret = gmlake_ctx_init(&ctx, &cfg);
	ck_assert_int_eq(setrlimit(RLIMIT_NOFILE, &rl), 0);
	ck_assert_msg(ret == -EMFILE, "ctx_init without descriptors: %d", ret);
	ck_assert_ptr_null(ctx);
	ck_assert_int_eq(th_count_fds(), fds);
	ck_assert_int_eq(th_count_memfd_maps(), maps);
	sites++;
	ctx = th_ctx(CAP_CHUNKS(4));
	th_destroy(ctx);
	printf("fault sites exercised: ctx_init: %d\n", sites);
}
END_TEST

static Suite *fault_suite(void)
{
	Suite *s = suite_create("fault");
	TCase *tc;

	tc = th_tcase(s, "Walk");
	tcase_add_loop_test(tc, test_fault_walk, 0, 2 * N_KINDS);
	tc = th_tcase(s, "Basics");
	tcase_add_test(tc, test_fault_events_used);
	tcase_add_test(tc, test_fault_counted);
	tc = th_tcase(s, "Destroy");
	tcase_add_loop_test(tc, test_fault_destroy, 0, N_KINDS);
	tc = th_tcase(s, "Streams");
	tcase_add_test(tc, test_fault_stream_ops);
	tc = th_tcase(s, "Offload");
	tcase_add_loop_test(tc, test_fault_offload_setup, 0, N_KINDS);
	tcase_add_loop_test(tc, test_fault_offload_teardown, 0, N_KINDS);
	tc = th_tcase(s, "Init");
	tcase_add_test(tc, test_fault_init);
	return s;
}

int main(void)
{
	int probe = th_probe();

	if (probe)
		return probe;
	/* Fault injection needs sizes the emulated device can promise. */
	if (!th_env_is_emu()) {
		fprintf(stderr, "check_fault runs on the emulated device\n");
		return 77;
	}
	return th_run_suite(fault_suite());
}
