/* SPDX-License-Identifier: MIT */
/*
 * gmlake-replay: replay PyTorch allocation traces through libgmlake and
 * report fragmentation, driver work and allocation latency.
 *
 * Each trace is read whole first (so a malformed trace fails before any
 * replay and parsing stays out of the timings), then replayed into a
 * fresh context: alloc events become gmlake_alloc() on the event's stream,
 * free_completed events gmlake_free(). Driver work of the second half of
 * the trace (from alloc number nalloc / 2 on, the steady state) is priced
 * at measured H200 costs per 2 MiB chunk and set against that half's GPU
 * time from the trace's sidecar (steps x step_ms / 2).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include <gmlake.h>

#include "trace.h"

#define MIB	    (1ull << 20)
#define GIB	    (1ull << 30)
#define PRICE_CHUNK (2 * MIB)

/* H200 driver costs per call on one chunk (2 MiB when measured), in
 * microseconds. */
#define COST_CREATE_US	17.0
#define COST_MAP_US	2.0
#define COST_ACCESS_US	40.0
#define COST_UNMAP_US	23.0
#define COST_RELEASE_US 37.0

/* Exit statuses. */
#define EXIT_TRACE_FAILED 1
#define EXIT_USAGE	  2

struct options {
	int backend;	   /* enum gmlake_backend; DEFAULT: not given */
	size_t chunk_size; /* 0: not given */
	size_t capacity;   /* 0: not given */
	bool json;
	bool touch;
	bool quiet;
};

/* The events that are replayed, in trace order. */
struct rev {
	uint64_t addr;
	uint64_t size;
	uint64_t stream;
	uint64_t line;
	bool alloc; /* else free_completed */
};

/* A live block: trace address -> our pointer (open addressing). */
struct slot {
	uint64_t addr;
	void *ptr;
	uint64_t size;
	uint64_t cookie; /* --touch pattern */
	gmlake_stream_t stream;
	bool used;
};

struct blockmap {
	struct slot *slots;
	size_t cap; /* a power of two */
	size_t n;
};

/* Trace ids of streams and the streams made for them. */
struct streammap {
	uint64_t *ids;
	gmlake_stream_t *streams;
	size_t n, cap;
};

/* One trace: what was read, and what the replay measured. */
struct replay {
	const char *path;
	char name[256];
	struct gml_trace_header hdr;
	struct gml_trace_sidecar sc;  /* NAME.trace.json */
	struct gml_trace_sidecar exp; /* NAME.expandable.json */
	struct rev *ev;
	size_t nev, evcap;
	uint64_t events; /* every event line of the trace */
	uint64_t nalloc, nfree, unknown;
	uint64_t trace_peak_live; /* sum of live sizes, from the trace */

	const char *backend;
	size_t capacity;
	struct gmlake_stats mid, end;
	uint64_t *lat_ns; /* one per alloc */
	uint64_t done_allocs;
	uint64_t skipped_frees, dup_allocs, touch_errors;
	double replay_ms;
};

static const char *prog = "gmlake-replay";

static void errmsg(const char *fmt, ...)
{
	va_list ap;

	fprintf(stderr, "%s: ", prog);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- block map ---- */

static uint64_t hash64(uint64_t x)
{
	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	x *= 0xc4ceb9fe1a85ec53ull;
	x ^= x >> 33;
	return x;
}

static struct slot *bm_find(struct blockmap *m, uint64_t addr)
{
	size_t i;

	if (!m->cap)
		return NULL;
	for (i = hash64(addr) & (m->cap - 1); m->slots[i].used;
	     i = (i + 1) & (m->cap - 1)) {
		if (m->slots[i].addr == addr)
			return &m->slots[i];
	}
	return NULL;
}

static int bm_grow(struct blockmap *m)
{
	struct blockmap bigger = {0};
	size_t i, j;

	bigger.cap = m->cap ? m->cap * 2 : 1024;
	bigger.slots = calloc(bigger.cap, sizeof(*bigger.slots));
	if (!bigger.slots)
		return -ENOMEM;
	for (i = 0; i < m->cap; i++) {
		if (!m->slots[i].used)
			continue;
		j = hash64(m->slots[i].addr) & (bigger.cap - 1);
		while (bigger.slots[j].used)
			j = (j + 1) & (bigger.cap - 1);
		bigger.slots[j] = m->slots[i];
	}
	bigger.n = m->n;
	free(m->slots);
	*m = bigger;
	return 0;
}

/* Insert addr (not present); *out is its slot. 0 or -ENOMEM. */
static int bm_insert(struct blockmap *m, uint64_t addr, struct slot **out)
{
	size_t i;
	int ret;

	if ((m->n + 1) * 2 > m->cap) {
		ret = bm_grow(m);
		if (ret)
			return ret;
	}
	i = hash64(addr) & (m->cap - 1);
	while (m->slots[i].used)
		i = (i + 1) & (m->cap - 1);
	memset(&m->slots[i], 0, sizeof(m->slots[i]));
	m->slots[i].used = true;
	m->slots[i].addr = addr;
	m->n++;
	*out = &m->slots[i];
	return 0;
}

/* Remove a slot, shifting back the probe chain behind it. */
static void bm_remove(struct blockmap *m, struct slot *s)
{
	size_t i = (size_t)(s - m->slots), j = i, home;

	for (;;) {
		j = (j + 1) & (m->cap - 1);
		if (!m->slots[j].used)
			break;
		home = hash64(m->slots[j].addr) & (m->cap - 1);
		/* Move j into the hole at i unless home lies in (i, j]. */
		if ((j > i && (home <= i || home > j)) ||
		    (j < i && (home <= i && home > j))) {
			m->slots[i] = m->slots[j];
			i = j;
		}
	}
	m->slots[i].used = false;
	m->n--;
}

/* ---- streams ---- */

/* The stream for trace stream id: 0 is the default, others made once. */
static int stream_get(gmlake_ctx *ctx, struct streammap *sm, uint64_t id,
		      gmlake_stream_t *s)
{
	void *p;
	size_t i;
	int ret;

	if (id == 0) {
		*s = NULL;
		return 0;
	}
	for (i = 0; i < sm->n; i++) {
		if (sm->ids[i] == id) {
			*s = sm->streams[i];
			return 0;
		}
	}
	if (sm->n == sm->cap) {
		sm->cap = sm->cap ? sm->cap * 2 : 8;
		p = realloc(sm->ids, sm->cap * sizeof(*sm->ids));
		if (!p)
			return -ENOMEM;
		sm->ids = p;
		p = realloc(sm->streams, sm->cap * sizeof(*sm->streams));
		if (!p)
			return -ENOMEM;
		sm->streams = p;
	}
	ret = gmlake_stream_create(ctx, s);
	if (ret)
		return ret;
	sm->ids[sm->n] = id;
	sm->streams[sm->n++] = *s;
	return 0;
}

/* ---- reading ---- */

static int push_event(struct replay *r, const struct gml_trace_event *e,
		      uint64_t line)
{
	struct rev *p;

	if (r->nev == r->evcap) {
		r->evcap = r->evcap ? r->evcap * 2 : 65536;
		p = realloc(r->ev, r->evcap * sizeof(*r->ev));
		if (!p)
			return -ENOMEM;
		r->ev = p;
	}
	p = &r->ev[r->nev++];
	p->addr = e->addr;
	p->size = e->size;
	p->stream = e->stream;
	p->line = line;
	p->alloc = e->kind == GML_TRACE_ALLOC;
	return 0;
}

/* The trace's name: its file name without .gz and .trace. */
static void trace_name(struct replay *r)
{
	const char *base = strrchr(r->path, '/');
	size_t n;

	base = base ? base + 1 : r->path;
	snprintf(r->name, sizeof(r->name), "%s", base);
	n = strlen(r->name);
	if (n > 3 && !strcmp(r->name + n - 3, ".gz"))
		r->name[n -= 3] = '\0';
	if (n > 6 && !strcmp(r->name + n - 6, ".trace"))
		r->name[n - 6] = '\0';
}

/* Optional sidecar: absent is fine, unreadable or malformed is an error. */
static int load_sidecar(struct replay *r, const char *suffix,
			struct gml_trace_sidecar *sc)
{
	char path[4096];
	const char *why;
	int ret;

	if (gml_trace_sidecar_path(r->path, suffix, path, sizeof(path)))
		return 0;
	ret = gml_trace_sidecar_load(path, sc, &why);
	if (ret == -ENOENT)
		return 0;
	if (ret)
		errmsg("%s: %s", path, why);
	return ret;
}

/* Read the whole trace into r; the live-size peak comes with it. */
static int read_trace(struct replay *r)
{
	const struct gml_trace_info *info;
	struct gml_trace_event e;
	struct gml_trace *t;
	struct blockmap live = {0};
	struct slot *s;
	uint64_t cur = 0;
	int ret;

	ret = gml_trace_open(r->path, &t);
	if (ret) {
		errmsg("%s: %s", r->path, strerror(-ret));
		return ret;
	}
	info = gml_trace_info(t);
	ret = gml_trace_read_header(t);
	while (!ret && (ret = gml_trace_next(t, &e)) == 1) {
		ret = 0;
		if (e.kind == GML_TRACE_OTHER)
			r->unknown++;
		if (e.kind != GML_TRACE_ALLOC &&
		    e.kind != GML_TRACE_FREE_COMPLETED)
			continue;
		ret = push_event(r, &e, info->lines);
		if (ret)
			break;
		s = bm_find(&live, e.addr);
		if (e.kind == GML_TRACE_ALLOC) {
			r->nalloc++;
			if (!s)
				ret = bm_insert(&live, e.addr, &s);
			else
				cur -= s->size;
			if (ret)
				break;
			s->size = e.size;
			cur += e.size;
			if (cur > r->trace_peak_live)
				r->trace_peak_live = cur;
		} else {
			r->nfree++;
			if (s) {
				cur -= s->size;
				bm_remove(&live, s);
			}
		}
	}
	if (ret == -ENOMEM)
		errmsg("%s: out of memory", r->path);
	else if (ret < 0)
		errmsg("%s", gml_trace_error(t));
	r->hdr = info->header;
	r->events = info->events;
	gml_trace_close(t);
	free(live.slots);
	if (ret < 0)
		return ret;
	ret = load_sidecar(r, ".trace.json", &r->sc);
	if (ret)
		return ret;
	return load_sidecar(r, ".expandable.json", &r->exp);
}

/* ---- replay ---- */

static const char *backend_name(int backend)
{
	switch (backend) {
	case GMLAKE_BACKEND_CUDA:
		return "cuda";
	case GMLAKE_BACKEND_EMU:
		return "emu";
	default:
		return "default";
	}
}

/*
 * Emulated capacity: --capacity, else GMLAKE_EMU_CAPACITY, else twice
 * PyTorch's peak reserved (or the trace's own peak) in whole GiB, at
 * least 4 GiB. The emulated device is sparse; unused capacity is free.
 */
static size_t pick_capacity(const struct replay *r, const struct options *o,
			    size_t cfg_capacity)
{
	const char *env = getenv("GMLAKE_EMU_CAPACITY");
	uint64_t base = r->trace_peak_live, cap;

	if (o->capacity)
		return o->capacity;
	if (env && *env)
		return cfg_capacity;
	if (r->hdr.have & GML_TRACE_HAVE_PEAK_RESERVED)
		base = r->hdr.peak_reserved;
	else if (r->sc.have & GML_SIDECAR_HAVE_PEAK_RESERVED)
		base = (uint64_t)r->sc.peak_reserved;
	if (base < r->trace_peak_live)
		base = r->trace_peak_live;
	if (base > UINT64_MAX / 4)
		return SIZE_MAX;
	cap = (2 * base + GIB - 1) / GIB * GIB;
	if (cap < 4 * GIB)
		cap = 4 * GIB;
	return cap > SIZE_MAX ? SIZE_MAX : (size_t)cap;
}

static int new_ctx(struct replay *r, const struct options *o, gmlake_ctx **ctx)
{
	struct gmlake_config cfg;
	int ret;

	ret = gmlake_config_init(&cfg);
	if (ret) {
		errmsg("gmlake_config_init: %s: %s", strerror(-ret),
		       gmlake_last_error());
		return ret;
	}
	if (o->backend != GMLAKE_BACKEND_DEFAULT)
		cfg.backend = o->backend;
	else if (cfg.backend == GMLAKE_BACKEND_DEFAULT)
		cfg.backend = GMLAKE_BACKEND_EMU;
	if (o->chunk_size)
		cfg.chunk_size = o->chunk_size;
	cfg.emu_capacity = pick_capacity(r, o, cfg.emu_capacity);
	r->capacity = cfg.emu_capacity;
	r->backend = backend_name(cfg.backend);
	ret = gmlake_ctx_init(ctx, &cfg);
	if (ret)
		errmsg("%s: gmlake_ctx_init (backend %s): %s: %s", r->name,
		       r->backend, strerror(-ret), gmlake_last_error());
	return ret;
}

static int snapshot(struct replay *r, gmlake_ctx *ctx, struct gmlake_stats *st)
{
	int ret;

	memset(st, 0, sizeof(*st));
	st->version = GMLAKE_STATS_VERSION;
	st->size = sizeof(*st);
	ret = gmlake_stats_get(ctx, st);
	if (ret)
		errmsg("%s: gmlake_stats_get: %s: %s", r->name, strerror(-ret),
		       gmlake_last_error());
	return ret;
}

/* The --touch pattern goes at the first and the last bytes of a block. */
static size_t touch_len(uint64_t size)
{
	return size < 16 ? (size_t)size : 8;
}

static int touch_write(struct replay *r, gmlake_ctx *ctx, struct slot *s)
{
	size_t n = touch_len(s->size);
	char *p = s->ptr;
	int ret;

	if (!n)
		return 0;
	ret = gmlake_memcpy_htod(ctx, p, &s->cookie, n, s->stream);
	if (!ret && s->size >= 16)
		ret = gmlake_memcpy_htod(ctx, p + s->size - n, &s->cookie, n,
					 s->stream);
	/* The source is on our stack: wait for the copies. */
	if (!ret)
		ret = gmlake_stream_synchronize(ctx, s->stream);
	if (ret)
		errmsg("%s: --touch write: %s: %s", r->name, strerror(-ret),
		       gmlake_last_error());
	return ret;
}

static int touch_check(struct replay *r, gmlake_ctx *ctx, struct slot *s,
		       uint64_t line)
{
	size_t n = touch_len(s->size);
	uint64_t head = 0, tail = s->cookie;
	char *p = s->ptr;
	int ret;

	if (!n)
		return 0;
	ret = gmlake_memcpy_dtoh(ctx, &head, p, n, s->stream);
	if (!ret && s->size >= 16)
		ret = gmlake_memcpy_dtoh(ctx, &tail, p + s->size - n, n,
					 s->stream);
	if (!ret)
		ret = gmlake_stream_synchronize(ctx, s->stream);
	if (ret) {
		errmsg("%s: --touch read: %s: %s", r->name, strerror(-ret),
		       gmlake_last_error());
		return ret;
	}
	if (memcmp(&head, &s->cookie, n) || memcmp(&tail, &s->cookie, n)) {
		r->touch_errors++;
		errmsg("%s:%" PRIu64 ": block at trace address %" PRIu64
		       " (%" PRIu64 " bytes) lost its pattern",
		       r->name, line, s->addr, s->size);
		return -EFAULT;
	}
	return 0;
}

static int do_alloc(struct replay *r, gmlake_ctx *ctx, struct blockmap *bm,
		    struct streammap *sm, const struct rev *e,
		    const struct options *o)
{
	gmlake_stream_t stream;
	struct slot *s;
	uint64_t t0, t1;
	void *ptr;
	int ret;

	ret = stream_get(ctx, sm, e->stream, &stream);
	if (ret) {
		errmsg("%s:%" PRIu64 ": stream %" PRIu64 ": %s: %s", r->name,
		       e->line, e->stream, strerror(-ret), gmlake_last_error());
		return ret;
	}
	if (e->size > SIZE_MAX) {
		errmsg("%s:%" PRIu64 ": size %" PRIu64 " too large", r->name,
		       e->line, e->size);
		return -EINVAL;
	}
	t0 = now_ns();
	ret = gmlake_alloc(ctx, &ptr, (size_t)e->size, stream);
	t1 = now_ns();
	if (ret) {
		errmsg("%s:%" PRIu64 ": gmlake_alloc(%" PRIu64 "): %s: %s",
		       r->name, e->line, e->size, strerror(-ret),
		       gmlake_last_error());
		return ret;
	}
	r->lat_ns[r->done_allocs++] = t1 - t0;
	ret = bm_insert(bm, e->addr, &s);
	if (ret) {
		gmlake_free(ctx, ptr);
		errmsg("%s: out of memory", r->name);
		return ret;
	}
	s->ptr = ptr;
	s->size = e->size;
	s->stream = stream;
	s->cookie = hash64(e->line) | 1;
	return o->touch ? touch_write(r, ctx, s) : 0;
}

static int free_slot(struct replay *r, gmlake_ctx *ctx, struct blockmap *bm,
		     struct slot *s, uint64_t line, const struct options *o)
{
	int ret;

	if (o->touch) {
		ret = touch_check(r, ctx, s, line);
		if (ret)
			return ret;
	}
	ret = gmlake_free(ctx, s->ptr);
	if (ret) {
		errmsg("%s:%" PRIu64 ": gmlake_free: %s: %s", r->name, line,
		       strerror(-ret), gmlake_last_error());
		return ret;
	}
	bm_remove(bm, s);
	return 0;
}

/* Replay every event; the mid snapshot goes before alloc nalloc / 2. */
static int run_events(struct replay *r, gmlake_ctx *ctx, struct blockmap *bm,
		      struct streammap *sm, const struct options *o)
{
	const struct rev *e;
	struct slot *s;
	size_t i;
	int ret;

	if (!r->nalloc) {
		ret = snapshot(r, ctx, &r->mid);
		if (ret)
			return ret;
	}
	for (i = 0; i < r->nev; i++) {
		e = &r->ev[i];
		s = bm_find(bm, e->addr);
		if (!e->alloc) {
			if (!s) {
				r->skipped_frees++;
				continue;
			}
			ret = free_slot(r, ctx, bm, s, e->line, o);
			if (ret)
				return ret;
			continue;
		}
		if (r->done_allocs == r->nalloc / 2) {
			ret = snapshot(r, ctx, &r->mid);
			if (ret)
				return ret;
		}
		/* A live address again: its free is missing; free it now. */
		if (s) {
			r->dup_allocs++;
			ret = free_slot(r, ctx, bm, s, e->line, o);
			if (ret)
				return ret;
		}
		ret = do_alloc(r, ctx, bm, sm, e, o);
		if (ret)
			return ret;
	}
	return snapshot(r, ctx, &r->end);
}

/* Free what is still live, drop the streams, destroy the context. */
static int teardown(struct replay *r, gmlake_ctx *ctx, struct blockmap *bm,
		    struct streammap *sm, bool clean)
{
	int ret, first = 0;
	size_t i;

	for (i = 0; clean && i < bm->cap; i++) {
		if (!bm->slots[i].used)
			continue;
		ret = gmlake_free(ctx, bm->slots[i].ptr);
		if (ret && !first) {
			errmsg("%s: gmlake_free at the end: %s: %s", r->name,
			       strerror(-ret), gmlake_last_error());
			first = ret;
		}
	}
	for (i = 0; i < sm->n; i++) {
		ret = gmlake_stream_destroy(ctx, sm->streams[i]);
		if (ret && clean && !first) {
			errmsg("%s: gmlake_stream_destroy: %s: %s", r->name,
			       strerror(-ret), gmlake_last_error());
			first = ret;
		}
	}
	/* After a failure, live blocks may remain: force then. */
	ret = gmlake_ctx_destroy(ctx, !clean || first);
	if (ret && !first) {
		errmsg("%s: gmlake_ctx_destroy: %s: %s", r->name,
		       strerror(-ret), gmlake_last_error());
		first = ret;
	}
	return first;
}

static int replay(struct replay *r, const struct options *o)
{
	struct blockmap bm = {0};
	struct streammap sm = {0};
	gmlake_ctx *ctx;
	uint64_t t0;
	int ret, ret2;

	r->lat_ns = calloc(r->nalloc ? r->nalloc : 1, sizeof(*r->lat_ns));
	if (!r->lat_ns) {
		errmsg("%s: out of memory", r->name);
		return -ENOMEM;
	}
	ret = new_ctx(r, o, &ctx);
	if (ret)
		return ret;
	t0 = now_ns();
	ret = run_events(r, ctx, &bm, &sm, o);
	r->replay_ms = (double)(now_ns() - t0) / 1e6;
	ret2 = teardown(r, ctx, &bm, &sm, !ret);
	free(bm.slots);
	free(sm.ids);
	free(sm.streams);
	return ret ? ret : ret2;
}

/* ---- results ---- */

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;

	return x < y ? -1 : x > y;
}

/* Nearest-rank percentile q (0..100) of sorted v[n], in microseconds. */
static double pct_us(const uint64_t *v, uint64_t n, unsigned q)
{
	uint64_t k;

	if (!n)
		return NAN;
	k = (q * n + 99) / 100; /* ceil(q / 100 * n), no libm */
	if (k)
		k--;
	if (k >= n)
		k = n - 1;
	return (double)v[k] / 1e3;
}

/* Everything reported for one trace; NAN where unknown. */
struct result {
	double frag_pct, torch_frag_pct, exp_frag_pct;
	double half_ms, half_pct, measured_half_ms;
	double p50_us, p99_us, max_us;
	double steps, step_ms;
	uint64_t creates, maps, set_access, unmaps, releases;
	uint64_t h_creates, h_maps, h_access_bytes, h_unmaps, h_releases;
	uint64_t h_stitches, h_reuses;
};

#define DELTA(field) (r->end.field - r->mid.field)

static double frag(double used, double reserved)
{
	return reserved > 0 ? 100.0 * (1.0 - used / reserved) : NAN;
}

/*
 * Driver time of the second half at H200 prices, in microseconds. Each
 * call costs the same whatever the chunk size (bench/vmm_probe.c measured
 * set-access and unmap per handle, not per byte), and set-access is paid
 * once per chunk of the range it covers.
 */
static double price_us(const struct replay *r, const struct result *x)
{
	double handles = (double)x->h_access_bytes /
			 (double)(r->end.chunk_size ? r->end.chunk_size :
						     PRICE_CHUNK);

	return (double)x->h_creates * COST_CREATE_US +
	       (double)x->h_maps * COST_MAP_US +
	       (double)x->h_unmaps * COST_UNMAP_US +
	       (double)x->h_releases * COST_RELEASE_US +
	       handles * COST_ACCESS_US;
}

static void compute(struct replay *r, struct result *x)
{
	static const int vmm[] = {
		GMLAKE_CALL_mem_create, GMLAKE_CALL_mem_release,
		GMLAKE_CALL_va_reserve, GMLAKE_CALL_va_free,
		GMLAKE_CALL_mem_map,	GMLAKE_CALL_mem_unmap,
		GMLAKE_CALL_set_access,
	};
	const struct gmlake_stats *e = &r->end;
	uint64_t ns = 0;
	size_t i;

	memset(x, 0, sizeof(*x));
	x->frag_pct = frag((double)e->requested_bytes.peak,
			   (double)e->reserved_bytes.peak);
	x->torch_frag_pct = NAN;
	if ((r->hdr.have & GML_TRACE_HAVE_PEAK_ALLOC) &&
	    (r->hdr.have & GML_TRACE_HAVE_PEAK_RESERVED))
		x->torch_frag_pct = frag((double)r->hdr.peak_alloc,
					 (double)r->hdr.peak_reserved);
	x->exp_frag_pct = NAN;
	if ((r->exp.have & GML_SIDECAR_HAVE_PEAK_ALLOC) &&
	    (r->exp.have & GML_SIDECAR_HAVE_PEAK_RESERVED))
		x->exp_frag_pct = frag(r->exp.peak_alloc, r->exp.peak_reserved);
	else if (r->exp.have & GML_SIDECAR_HAVE_FRAG_PCT)
		x->exp_frag_pct = r->exp.frag_pct;

	x->creates = e->calls[GMLAKE_CALL_mem_create];
	x->maps = e->calls[GMLAKE_CALL_mem_map];
	x->set_access = e->calls[GMLAKE_CALL_set_access];
	x->unmaps = e->calls[GMLAKE_CALL_mem_unmap];
	x->releases = e->calls[GMLAKE_CALL_mem_release];
	x->h_creates = DELTA(calls[GMLAKE_CALL_mem_create]);
	x->h_maps = DELTA(calls[GMLAKE_CALL_mem_map]);
	x->h_unmaps = DELTA(calls[GMLAKE_CALL_mem_unmap]);
	x->h_releases = DELTA(calls[GMLAKE_CALL_mem_release]);
	x->h_access_bytes = DELTA(access_bytes);
	x->h_stitches = DELTA(stitches);
	x->h_reuses = DELTA(stitch_reuses);
	for (i = 0; i < sizeof(vmm) / sizeof(vmm[0]); i++)
		ns += DELTA(call_ns[vmm[i]]);
	x->measured_half_ms = (double)ns / 1e6;
	x->half_ms = price_us(r, x) / 1e3;

	x->steps = x->step_ms = x->half_pct = NAN;
	if (r->sc.have & GML_SIDECAR_HAVE_STEPS)
		x->steps = r->sc.steps;
	else if (r->hdr.have & GML_TRACE_HAVE_STEPS)
		x->steps = (double)r->hdr.steps;
	if (r->sc.have & GML_SIDECAR_HAVE_STEP_MS)
		x->step_ms = r->sc.step_ms;
	if (x->steps > 0 && x->step_ms > 0)
		x->half_pct = 100.0 * x->half_ms / (x->steps * x->step_ms / 2);

	qsort(r->lat_ns, r->done_allocs, sizeof(*r->lat_ns), cmp_u64);
	x->p50_us = pct_us(r->lat_ns, r->done_allocs, 50);
	x->p99_us = pct_us(r->lat_ns, r->done_allocs, 99);
	x->max_us = pct_us(r->lat_ns, r->done_allocs, 100);
}

#undef DELTA

static void json_str(const char *key, const char *s)
{
	printf("\"%s\": \"", key);
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			printf("\\%c", *s);
		else if ((unsigned char)*s < 0x20)
			printf("\\u%04x", (unsigned char)*s);
		else
			putchar(*s);
	}
	printf("\", ");
}

static void json_u64(const char *key, uint64_t v)
{
	printf("\"%s\": %" PRIu64 ", ", key, v);
}

static void json_num(const char *key, double v, int prec)
{
	if (isfinite(v))
		printf("\"%s\": %.*f, ", key, prec, v);
	else
		printf("\"%s\": null, ", key);
}

static void print_json(const struct replay *r, const struct result *x)
{
	const struct gmlake_stats *e = &r->end;

	putchar('{');
	json_str("trace", r->name);
	json_str("path", r->path);
	json_str("backend", r->backend);
	json_u64("events", r->events);
	json_u64("allocs", r->nalloc);
	json_u64("frees", r->nfree);
	json_u64("unknown_actions", r->unknown);
	json_u64("skipped_frees", r->skipped_frees);
	json_u64("duplicate_allocs", r->dup_allocs);
	json_u64("chunk_size", e->chunk_size);
	json_u64("capacity", r->capacity);
	json_u64("peak_requested", (uint64_t)e->requested_bytes.peak);
	json_u64("peak_allocated", (uint64_t)e->allocated_bytes.peak);
	json_u64("peak_reserved", (uint64_t)e->reserved_bytes.peak);
	json_num("fragmentation_pct", x->frag_pct, 2);
	if (r->hdr.have & GML_TRACE_HAVE_PEAK_ALLOC)
		json_u64("torch_peak_alloc", r->hdr.peak_alloc);
	else
		printf("\"torch_peak_alloc\": null, ");
	if (r->hdr.have & GML_TRACE_HAVE_PEAK_RESERVED)
		json_u64("torch_peak_reserved", r->hdr.peak_reserved);
	else
		printf("\"torch_peak_reserved\": null, ");
	json_num("torch_fragmentation_pct", x->torch_frag_pct, 2);
	json_num("expandable_fragmentation_pct", x->exp_frag_pct, 2);
	json_num("steps", x->steps, 0);
	json_num("step_ms", x->step_ms, 1);
	json_u64("creates", x->creates);
	json_u64("maps", x->maps);
	json_u64("set_access", x->set_access);
	json_u64("access_bytes", e->access_bytes);
	json_u64("unmaps", x->unmaps);
	json_u64("releases", x->releases);
	json_u64("fits", e->fits);
	json_u64("stitches", e->stitches);
	json_u64("stitch_reuses", e->stitch_reuses);
	json_u64("grows", e->grows);
	json_u64("evictions", e->evictions);
	json_u64("ooms", e->ooms);
	json_u64("creates_second_half", x->h_creates);
	json_u64("maps_second_half", x->h_maps);
	json_u64("access_bytes_second_half", x->h_access_bytes);
	json_u64("unmaps_second_half", x->h_unmaps);
	json_u64("releases_second_half", x->h_releases);
	json_u64("stitches_second_half", x->h_stitches);
	json_u64("stitch_reuses_second_half", x->h_reuses);
	json_num("driver_ms_second_half", x->half_ms, 3);
	json_num("driver_pct_second_half", x->half_pct, 3);
	json_num("measured_driver_ms_second_half", x->measured_half_ms, 3);
	json_num("alloc_p50_us", x->p50_us, 3);
	json_num("alloc_p99_us", x->p99_us, 3);
	json_num("alloc_max_us", x->max_us, 3);
	printf("\"replay_ms\": %.1f}\n", r->replay_ms);
}

/* A number for the table: "-" when unknown. */
static const char *cell(char *buf, size_t len, double v, int prec)
{
	if (isfinite(v))
		snprintf(buf, len, "%.*f", prec, v);
	else
		snprintf(buf, len, "-");
	return buf;
}

static void print_table_header(void)
{
	printf("%-12s %8s %8s %8s %6s %6s %6s %8s %6s %8s %7s %7s %7s "
	       "%7s %7s %7s %7s %8s %8s %7s\n",
	       "trace", "events", "req_GiB", "res_GiB", "frag%", "torch%",
	       "expnd%", "drv_ms", "drv%", "meas_ms", "creates", "maps",
	       "access", "unmaps", "release", "stitch", "reuses", "p50_us",
	       "p99_us", "skipped");
}

static void print_row(const struct replay *r, const struct result *x)
{
	const struct gmlake_stats *e = &r->end;
	char b[8][32];

	printf("%-12s %8" PRIu64 " %8.2f %8.2f %6s %6s %6s %8s %6s %8s "
	       "%7" PRIu64 " %7" PRIu64 " %7" PRIu64 " %7" PRIu64 " %7" PRIu64
	       " %7" PRIu64 " %7" PRIu64 " %8s %8s %7" PRIu64 "\n",
	       r->name, r->events, (double)e->requested_bytes.peak / GIB,
	       (double)e->reserved_bytes.peak / GIB,
	       cell(b[0], 32, x->frag_pct, 2),
	       cell(b[1], 32, x->torch_frag_pct, 2),
	       cell(b[2], 32, x->exp_frag_pct, 2),
	       cell(b[3], 32, x->half_ms, 1), cell(b[4], 32, x->half_pct, 2),
	       cell(b[5], 32, x->measured_half_ms, 1), x->creates, x->maps,
	       x->set_access, x->unmaps, x->releases, e->stitches,
	       e->stitch_reuses, cell(b[6], 32, x->p50_us, 1),
	       cell(b[7], 32, x->p99_us, 1), r->skipped_frees);
}

/* ---- main ---- */

/* A size with an optional K, M, G or T suffix (powers of 1024). */
static int parse_size(const char *s, size_t *out)
{
	unsigned long long v;
	unsigned shift = 0;
	char *end;

	if (!*s || *s == '-')
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 0);
	if (errno || end == s)
		return -EINVAL;
	switch (*end) {
	case 'k':
	case 'K':
		shift = 10;
		break;
	case 'm':
	case 'M':
		shift = 20;
		break;
	case 'g':
	case 'G':
		shift = 30;
		break;
	case 't':
	case 'T':
		shift = 40;
		break;
	}
	if (shift)
		end++;
	if (shift && (*end == 'i' || *end == 'I'))
		end++;
	if (*end == 'b' || *end == 'B')
		end++;
	if (*end || !v || v > (SIZE_MAX >> shift))
		return -EINVAL;
	*out = (size_t)(v << shift);
	return 0;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: %s [options] TRACE...\n"
		"Replay PyTorch allocation traces (NAME.trace.gz) through libgmlake.\n"
		"\n"
		"  -b, --backend=emu|cuda  device to replay on (default: emu, or GMLAKE_BACKEND)\n"
		"  -j, --json              one JSON object per trace and line\n"
		"  -t, --touch             write and check a pattern in every block\n"
		"  -c, --chunk-size=SIZE   physical chunk size (K, M, G suffixes)\n"
		"  -C, --capacity=SIZE     emulated device memory (default: 2x the peak)\n"
		"  -q, --quiet             no progress messages\n"
		"  -h, --help              this help\n"
		"  -V, --version           library version\n",
		prog);
}

static int parse_args(int argc, char **argv, struct options *o)
{
	static const struct option longopts[] = {
		{"backend", required_argument, NULL, 'b'},
		{"json", no_argument, NULL, 'j'},
		{"touch", no_argument, NULL, 't'},
		{"chunk-size", required_argument, NULL, 'c'},
		{"capacity", required_argument, NULL, 'C'},
		{"quiet", no_argument, NULL, 'q'},
		{"help", no_argument, NULL, 'h'},
		{"version", no_argument, NULL, 'V'},
		{NULL, 0, NULL, 0},
	};
	int c;

	while ((c = getopt_long(argc, argv, "b:jtc:C:qhV", longopts, NULL)) !=
	       -1) {
		switch (c) {
		case 'b':
			if (!strcasecmp(optarg, "emu")) {
				o->backend = GMLAKE_BACKEND_EMU;
			} else if (!strcasecmp(optarg, "cuda")) {
				o->backend = GMLAKE_BACKEND_CUDA;
			} else {
				errmsg("unknown backend '%s' (emu or cuda)",
				       optarg);
				return -EINVAL;
			}
			break;
		case 'j':
			o->json = true;
			break;
		case 't':
			o->touch = true;
			break;
		case 'c':
		case 'C':
			if (parse_size(optarg, c == 'c' ? &o->chunk_size :
							  &o->capacity)) {
				errmsg("bad size '%s'", optarg);
				return -EINVAL;
			}
			break;
		case 'q':
			o->quiet = true;
			break;
		case 'h':
			usage(stdout);
			exit(EXIT_SUCCESS);
		case 'V':
			printf("%s (libgmlake %d.%d)\n", prog,
			       gmlake_version_major(), gmlake_version_minor());
			exit(EXIT_SUCCESS);
		default:
			usage(stderr);
			return -EINVAL;
		}
	}
	if (optind == argc) {
		errmsg("no trace given");
		usage(stderr);
		return -EINVAL;
	}
	return 0;
}

/* Read, replay and report one trace. 0 or -errno (already reported). */
static int one_trace(const char *path, const struct options *o,
		     bool *header_done)
{
	struct replay r = {.path = path};
	struct result x;
	int ret;

	trace_name(&r);
	if (!o->quiet)
		fprintf(stderr, "%s: replaying %s\n", prog, path);
	ret = read_trace(&r);
	if (!ret)
		ret = replay(&r, o);
	if (!ret) {
		compute(&r, &x);
		if (o->json) {
			print_json(&r, &x);
		} else {
			if (!*header_done)
				print_table_header();
			*header_done = true;
			print_row(&r, &x);
		}
		fflush(stdout);
	}
	free(r.ev);
	free(r.lat_ns);
	return ret;
}

int main(int argc, char **argv)
{
	struct options o = {.backend = GMLAKE_BACKEND_DEFAULT};
	bool header_done = false;
	int i, failed = 0;

	if (parse_args(argc, argv, &o))
		return EXIT_USAGE;
	if (!gmlake_check_version(GMLAKE_VERSION_MAJOR, GMLAKE_VERSION_MINOR)) {
		errmsg("libgmlake %d.%d is older than this tool (%d.%d)",
		       gmlake_version_major(), gmlake_version_minor(),
		       GMLAKE_VERSION_MAJOR, GMLAKE_VERSION_MINOR);
		return EXIT_TRACE_FAILED;
	}
	for (i = optind; i < argc; i++) {
		if (one_trace(argv[i], &o, &header_done))
			failed++;
	}
	if (failed)
		errmsg("%d of %d traces failed", failed, argc - optind);
	return failed ? EXIT_TRACE_FAILED : EXIT_SUCCESS;
}
