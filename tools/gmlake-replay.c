/* SPDX-License-Identifier: MIT */
/*
 * gmlake-replay: replay PyTorch allocation traces through libgmlake and
 * report fragmentation, driver work and allocation latency.
 *
 * Each trace is read twice, streamed, never held: a first pass checks
 * every line (so a malformed trace fails before any replay), counts the
 * allocations and finds the peak of live bytes; the second replays into a
 * fresh context: alloc events become gmlake_alloc() on the event's stream,
 * free_completed events gmlake_free(), long_lived lines
 * gmlake_long_lived(). Memory is bounded by the blocks
 * live at once (at most --max-live) and a latency histogram, not by the
 * trace's length; the emulated capacity a trace can ask for is bounded too
 * (MAX_CHUNKS chunks). Driver work of the steady state is priced at
 * measured H200 costs per 2 MiB chunk and set against its GPU time from
 * the trace's sidecar. The steady state is the trace's steady steps when
 * it has step lines (each step at a shape an earlier step had: steady
 * steps x steady_step_ms, or step_ms), else its second half (from alloc
 * number nalloc / 2 on: steps x step_ms / 2).
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
#include <unistd.h>

#include <gmlake.h>

#include "explain.h"
#include "json.h"
#include "trace.h"

#define MIB	    (1ull << 20)
#define GIB	    (1ull << 30)
#define EMU_CHUNK   (2 * MIB)	/* the emulated device's granularity */

/*
 * Bounds on what a trace can make the replayer hold: blocks live at once
 * (--max-live; each costs about 200 bytes here and in the library) and the
 * emulated capacity in chunks (1 TiB of chunks is 512 Ki of them, about
 * 100 MB and 2.6 s of mapping; the bound is twice that).
 */
#define DEFAULT_MAX_LIVE (1ull << 20)
#define MAX_CHUNKS	 (1ull << 20)

/* Latency histogram: exact below 256 ns, then 128 steps per power of 2. */
#define LAT_SUB	    128u
#define LAT_BUCKETS (2 * LAT_SUB + 56 * LAT_SUB)

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
	uint64_t max_live; /* blocks live at once */
	bool json;
	bool touch;
	bool quiet;
	bool per_step; /* each step's driver work after the trace's row */
	bool lag;      /* the emulated device runs behind, synced per step */
	bool progress; /* a progress line: stderr is a terminal */
	bool explain;  /* each step line and interesting call on stderr */
	size_t explain_min; /* allocations this large always shown */
};

#define DEFAULT_EXPLAIN_MIN (64 * MIB)

/* An event that is replayed. */
struct rev {
	uint64_t addr;
	uint64_t size;
	uint64_t stream;
	uint64_t line;
	bool alloc; /* else free_completed */
};

/* Allocation latencies, counted by bucket: a bounded percentile. */
struct lat_hist {
	uint64_t n[LAT_BUCKETS];
	uint64_t count, max;
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

/*
 * Driver work over the priced window, as deltas of the statistics: the
 * steady steps' spans summed, or the second half.
 */
struct window {
	uint64_t calls[GMLAKE_CALL_COUNT];
	uint64_t call_ns[GMLAKE_CALL_COUNT];
	uint64_t access_bytes, access_handles;
	uint64_t stitches, stitch_reuses;
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
	struct gml_trace *t;	      /* open for both passes */
	uint64_t events; /* every event line of the trace */
	uint64_t nalloc, nfree, unknown;
	uint64_t long_lived_on; /* long_lived lines turning it on, replayed */
	uint64_t trims;		/* trim lines replayed */
	uint64_t nsteps, steady_steps; /* step lines; those with S == 0 */
	uint64_t trace_peak_live; /* sum of live sizes, from the trace */

	const char *backend;
	size_t capacity;
	bool lag;		/* the emulated device lags (--lag, GMLAKE_EMU_LAG) */
	struct gmlake_stats mid, end;
	struct gmlake_stats step_start; /* at the last step line replayed */
	bool in_step, step_steady; /* a step line was replayed; its S == 0 */
	struct window steady;	   /* the steady steps' work so far */
	struct window *steps_w;	   /* with --per-step: each step's work */
	bool *steps_settle;	   /* and whether it settled */
	size_t nsteps_w, cap_steps_w;
	struct lat_hist lat;
	uint64_t done_allocs;
	uint64_t skipped_frees, dup_allocs, touch_errors;
	double replay_ms;
};

static const char *prog = "gmlake-replay";
static bool progress_shown; /* a progress line is on the terminal */

static void progress_clear(void)
{
	if (progress_shown)
		fputs("\r\033[K", stderr);
	progress_shown = false;
}

static void errmsg(const char *fmt, ...)
{
	va_list ap;

	progress_clear();
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

/*
 * The progress line, on a terminal only, at most four times a second
 * and at once when a pass starts: what is done of total events (total 0:
 * not known yet).
 */
static void progress(const struct replay *r, const struct options *o,
		     const char *what, uint64_t done, uint64_t total)
{
	static const char *last_what;
	static uint64_t next_ns;
	uint64_t t;

	if (!o->progress || (done & 0xfff))
		return;
	t = now_ns();
	if (t < next_ns && what == last_what)
		return;
	last_what = what;
	next_ns = t + 250000000ull;
	if (total)
		fprintf(stderr, "\r%s: %s: %s %" PRIu64 " of %" PRIu64
			" events (%.0f%%)\033[K", prog, r->name, what, done,
			total, 100.0 * (double)done / (double)total);
	else
		fprintf(stderr, "\r%s: %s: %s %" PRIu64 " events\033[K",
			prog, r->name, what, done);
	progress_shown = true;
}

/* ---- latency histogram ---- */

static unsigned lat_bucket(uint64_t v)
{
	unsigned shift;

	if (v < 2 * LAT_SUB)
		return (unsigned)v;
	shift = 63u - (unsigned)__builtin_clzll(v) - 7u;
	return 2 * LAT_SUB + (shift - 1) * LAT_SUB +
	       (unsigned)((v >> shift) - LAT_SUB);
}

/* The smallest value of bucket b. */
static uint64_t lat_value(unsigned b)
{
	unsigned shift;

	if (b < 2 * LAT_SUB)
		return b;
	shift = (b - 2 * LAT_SUB) / LAT_SUB + 1;
	return (uint64_t)(LAT_SUB + (b - 2 * LAT_SUB) % LAT_SUB) << shift;
}

static void lat_add(struct lat_hist *h, uint64_t ns)
{
	h->n[lat_bucket(ns)]++;
	h->count++;
	if (ns > h->max)
		h->max = ns;
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

/*
 * Track one event of the first pass in the live map: the live bytes and
 * their peak. -ENOMEM, or -E2BIG past o->max_live blocks.
 */
static int scan_event(struct replay *r, const struct options *o,
		      struct blockmap *live, const struct gml_trace_event *e,
		      uint64_t *cur, uint64_t line)
{
	struct slot *s = bm_find(live, e->addr);
	int ret;

	if (e->kind == GML_TRACE_FREE_COMPLETED) {
		r->nfree++;
		if (s) {
			*cur -= s->size;
			bm_remove(live, s);
		}
		return 0;
	}
	r->nalloc++;
	if (s) {
		*cur -= s->size;
	} else {
		if (live->n >= o->max_live) {
			errmsg("%s:%" PRIu64 ": more than %" PRIu64 " blocks "
			       "live at once, the replayer's bound "
			       "(--max-live)", r->path, line, o->max_live);
			return -E2BIG;
		}
		ret = bm_insert(live, e->addr, &s);
		if (ret) {
			errmsg("%s: out of memory", r->path);
			return ret;
		}
	}
	s->size = e->size;
	*cur += e->size;
	if (*cur > r->trace_peak_live)
		r->trace_peak_live = *cur;
	return 0;
}

/*
 * A step line of the first pass: K must be the count of step lines before
 * it, so that the steps the replay prices are the ones the capture timed.
 * -EINVAL otherwise.
 */
static int scan_step(struct replay *r, const struct gml_trace_event *e,
		     uint64_t line)
{
	if (e->addr != r->nsteps) {
		errmsg("%s:%" PRIu64 ": step %" PRIu64 " where step %" PRIu64
		       " was due (steps count from 0, one line each)",
		       r->path, line, e->addr, r->nsteps);
		return -EINVAL;
	}
	r->nsteps++;
	if (!e->size)
		r->steady_steps++;
	return 0;
}

/*
 * The first pass: every line checked, allocations and frees counted, the
 * peak of live bytes found; nothing kept but the live map. The trace stays
 * open in r->t for the second pass.
 */
static int read_trace(struct replay *r, const struct options *o)
{
	const struct gml_trace_info *info;
	struct gml_trace_event e;
	struct blockmap live = {0};
	bool reported = false; /* by scan_event() or scan_step() */
	uint64_t cur = 0;
	int ret;

	ret = gml_trace_open(r->path, &r->t);
	if (ret) {
		errmsg("%s: %s", r->path, strerror(-ret));
		return ret;
	}
	info = gml_trace_info(r->t);
	ret = gml_trace_read_header(r->t);
	while (!ret && (ret = gml_trace_next(r->t, &e)) == 1) {
		ret = 0;
		progress(r, o, "reading", info->events, 0);
		if (e.kind == GML_TRACE_OTHER)
			r->unknown++;
		if (e.kind == GML_TRACE_ALLOC ||
		    e.kind == GML_TRACE_FREE_COMPLETED)
			ret = scan_event(r, o, &live, &e, &cur, info->lines);
		else if (e.kind == GML_TRACE_STEP)
			ret = scan_step(r, &e, info->lines);
		reported = ret < 0;
	}
	if (ret < 0 && !reported)
		errmsg("%s", gml_trace_error(r->t));
	r->hdr = info->header;
	r->events = info->events;
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

/*
 * The emulated capacity is at most MAX_CHUNKS chunks: a trace (its header's
 * peak, or a single event) can ask for any size, and every chunk of it
 * costs host memory and time to map. -EFBIG past it.
 */
static int check_capacity(const struct replay *r,
			  const struct gmlake_config *cfg)
{
	uint64_t chunk = cfg->chunk_size ? cfg->chunk_size : EMU_CHUNK;

	if (cfg->backend != GMLAKE_BACKEND_EMU ||
	    cfg->emu_capacity / chunk <= MAX_CHUNKS)
		return 0;
	errmsg("%s: an emulated capacity of %.0f GiB (twice the peak the "
	       "trace claims, or --capacity) is past the replayer's bound of "
	       "%llu chunks of %" PRIu64 " MiB (%.0f GiB)", r->path,
	       (double)cfg->emu_capacity / GIB, (unsigned long long)MAX_CHUNKS,
	       chunk / MIB, (double)MAX_CHUNKS * (double)chunk / GIB);
	return -EFBIG;
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
	if (o->lag)
		cfg.emu_lag = true;
	cfg.emu_capacity = pick_capacity(r, o, cfg.emu_capacity);
	r->capacity = cfg.emu_capacity;
	if (o->lag && cfg.backend != GMLAKE_BACKEND_EMU) {
		errmsg("%s: --lag is the emulated device's, not backend %s's",
		       r->name, backend_name(cfg.backend));
		return -EINVAL;
	}
	r->lag = cfg.emu_lag && cfg.backend == GMLAKE_BACKEND_EMU;
	r->backend = backend_name(cfg.backend);
	ret = check_capacity(r, &cfg);
	if (ret)
		return ret;
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

/* The --touch pattern (8 bytes, the cookie's) goes at the first and,
 * from 16 bytes, the last bytes of a block. */
static size_t touch_len(uint64_t size)
{
	return size < 8 ? (size_t)size : 8;
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
	struct gmlake_stats before, after;
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
	if (o->explain) {
		ret = snapshot(r, ctx, &before);
		if (ret)
			return ret;
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
	if (o->explain) {
		ret = snapshot(r, ctx, &after);
		if (ret) {
			gmlake_free(ctx, ptr);
			return ret;
		}
		gml_explain_alloc(stderr, r->name, e->line, e->size, ptr,
				  o->explain_min, &before, &after);
	}
	lat_add(&r->lat, t1 - t0);
	r->done_allocs++;
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
	struct gmlake_stats before, after;
	void *ptr = s->ptr;
	int ret;

	if (o->touch) {
		ret = touch_check(r, ctx, s, line);
		if (ret)
			return ret;
	}
	if (o->explain) {
		ret = snapshot(r, ctx, &before);
		if (ret)
			return ret;
	}
	ret = gmlake_free(ctx, ptr);
	if (ret) {
		errmsg("%s:%" PRIu64 ": gmlake_free: %s: %s", r->name, line,
		       strerror(-ret), gmlake_last_error());
		return ret;
	}
	bm_remove(bm, s);
	if (o->explain) {
		ret = snapshot(r, ctx, &after);
		if (ret)
			return ret;
		gml_explain_free(stderr, r->name, line, ptr, &before, &after);
	}
	return 0;
}

/* One replayed event; the mid snapshot goes before alloc nalloc / 2. */
static int run_event(struct replay *r, gmlake_ctx *ctx, struct blockmap *bm,
		     struct streammap *sm, const struct rev *e,
		     const struct options *o)
{
	struct slot *s = bm_find(bm, e->addr);
	int ret;

	if (!e->alloc) {
		if (!s) {
			r->skipped_frees++;
			return 0;
		}
		return free_slot(r, ctx, bm, s, e->line, o);
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
	return do_alloc(r, ctx, bm, sm, e, o);
}

/* Add the driver work from *from to *to to the window. */
static void window_add(struct window *w, const struct gmlake_stats *from,
		       const struct gmlake_stats *to)
{
	size_t i;

	for (i = 0; i < GMLAKE_CALL_COUNT; i++) {
		w->calls[i] += to->calls[i] - from->calls[i];
		w->call_ns[i] += to->call_ns[i] - from->call_ns[i];
	}
	w->access_bytes += to->access_bytes - from->access_bytes;
	w->access_handles += to->access_handles - from->access_handles;
	w->stitches += to->stitches - from->stitches;
	w->stitch_reuses += to->stitch_reuses - from->stitch_reuses;
}

/* With --per-step, keep the work of the step that ends at *now. */
static int step_keep(struct replay *r, const struct options *o,
		     const struct gmlake_stats *now)
{
	if (!o->per_step || !r->in_step)
		return 0;
	if (r->nsteps_w == r->cap_steps_w) {
		size_t cap = r->cap_steps_w ? 2 * r->cap_steps_w : 64;
		struct window *w = realloc(r->steps_w, cap * sizeof(*w));
		bool *f;

		if (!w) {
			errmsg("%s: out of memory for --per-step", r->path);
			return -ENOMEM;
		}
		r->steps_w = w;
		f = realloc(r->steps_settle, cap * sizeof(*f));
		if (!f) {
			errmsg("%s: out of memory for --per-step", r->path);
			return -ENOMEM;
		}
		r->steps_settle = f;
		r->cap_steps_w = cap;
	}
	memset(&r->steps_w[r->nsteps_w], 0, sizeof(r->steps_w[0]));
	window_add(&r->steps_w[r->nsteps_w], &r->step_start, now);
	r->steps_settle[r->nsteps_w++] = !r->step_steady;
	return 0;
}

/* --lag: the device catches up at a step line, as it does when a
 * training loop synchronizes between steps; every stream the trace
 * made, then the default one. */
static int step_sync(struct replay *r, gmlake_ctx *ctx,
		     const struct streammap *sm)
{
	int ret = 0;

	for (size_t i = 0; i < sm->n && !ret; i++)
		ret = gmlake_stream_synchronize(ctx, sm->streams[i]);
	if (!ret)
		ret = gmlake_stream_synchronize(ctx, NULL);
	if (ret)
		errmsg("%s: step line: gmlake_stream_synchronize: %s: %s",
		       r->name, strerror(-ret), gmlake_last_error());
	return ret;
}

/*
 * A step line: the step it ends goes into the priced window when steady,
 * and the one it begins is measured from here.
 */
static int step_line(struct replay *r, gmlake_ctx *ctx,
		     const struct streammap *sm,
		     const struct gml_trace_event *ev, const struct options *o)
{
	struct gmlake_stats now;
	int ret;

	if (r->lag) {
		ret = step_sync(r, ctx, sm);
		if (ret)
			return ret;
	}
	ret = snapshot(r, ctx, &now);
	if (ret)
		return ret;
	if (r->in_step && r->step_steady)
		window_add(&r->steady, &r->step_start, &now);
	ret = step_keep(r, o, &now);
	if (ret)
		return ret;
	r->step_start = now;
	r->in_step = true;
	r->step_steady = ev->size == 0;
	if (o->explain)
		gml_explain_step(stderr, r->name, ev->addr, ev->size != 0);
	return 0;
}

/* A long_lived line: gmlake_long_lived() on or off, as the optimizer's
 * hooks do around its state in a run under libgmlake (the traces come
 * from PyTorch's allocator, which has no such call). */
static int long_lived_line(struct replay *r, gmlake_ctx *ctx,
			   const struct gml_trace_event *ev, uint64_t line)
{
	int ret = gmlake_long_lived(ctx, ev->addr == 1);

	if (ret) {
		errmsg("%s:%" PRIu64 ": %s", r->path, line,
		       gmlake_last_error());
		return ret;
	}
	r->long_lived_on += ev->addr == 1;
	return 0;
}

/* A trim line: the run's allocator gave its cache back there
 * (torch.cuda.empty_cache()), so the replay calls gmlake_trim(), as the
 * PyTorch adapter does for it. */
static int trim_line(struct replay *r, gmlake_ctx *ctx, uint64_t line,
		     const struct options *o)
{
	struct gmlake_stats before, after;
	int ret;

	if (o->explain) {
		ret = snapshot(r, ctx, &before);
		if (ret)
			return ret;
	}
	ret = gmlake_trim(ctx);
	if (ret) {
		errmsg("%s:%" PRIu64 ": gmlake_trim: %s: %s", r->path, line,
		       strerror(-ret), gmlake_last_error());
		return ret;
	}
	r->trims++;
	if (o->explain) {
		ret = snapshot(r, ctx, &after);
		if (ret)
			return ret;
		gml_explain_trim(stderr, r->name, line, &before, &after);
	}
	return 0;
}

/*
 * The second pass: the trace from the start again, each event replayed as
 * it is read. A trace that changed since the first pass fails here.
 */
static int run_events(struct replay *r, gmlake_ctx *ctx, struct blockmap *bm,
		      struct streammap *sm, const struct options *o)
{
	const struct gml_trace_info *info = gml_trace_info(r->t);
	struct gml_trace_event ev;
	struct rev e;
	int ret;

	if (!r->nalloc) {
		ret = snapshot(r, ctx, &r->mid);
		if (ret)
			return ret;
	}
	ret = gml_trace_rewind(r->t);
	if (!ret)
		ret = gml_trace_read_header(r->t);
	while (!ret && (ret = gml_trace_next(r->t, &ev)) == 1) {
		ret = 0;
		progress(r, o, "replaying", info->events, r->events);
		if (ev.kind == GML_TRACE_STEP) {
			ret = step_line(r, ctx, sm, &ev, o);
			if (ret)
				return ret;
			continue;
		}
		if (ev.kind == GML_TRACE_LONG_LIVED) {
			ret = long_lived_line(r, ctx, &ev, info->lines);
			if (ret)
				return ret;
			continue;
		}
		if (ev.kind == GML_TRACE_TRIM) {
			ret = trim_line(r, ctx, info->lines, o);
			if (ret)
				return ret;
			continue;
		}
		if (ev.kind != GML_TRACE_ALLOC &&
		    ev.kind != GML_TRACE_FREE_COMPLETED)
			continue;
		e.addr = ev.addr;
		e.size = ev.size;
		e.stream = ev.stream;
		e.line = info->lines;
		e.alloc = ev.kind == GML_TRACE_ALLOC;
		ret = run_event(r, ctx, bm, sm, &e, o);
		if (ret)
			return ret;
	}
	if (ret < 0) {
		errmsg("%s (second pass)", gml_trace_error(r->t));
		return ret;
	}
	ret = snapshot(r, ctx, &r->end);
	if (ret)
		return ret;
	/* The events after the last step line are the last step's. */
	if (r->in_step && r->step_steady)
		window_add(&r->steady, &r->step_start, &r->end);
	return step_keep(r, o, &r->end);
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

/*
 * Nearest-rank percentile q (0..100), in microseconds, from the histogram:
 * within 1/128 below the exact value (exact under 256 ns); 100 is the
 * exact maximum.
 */
static double pct_us(const struct lat_hist *h, unsigned q)
{
	uint64_t k, seen = 0;

	if (!h->count)
		return NAN;
	if (q >= 100)
		return (double)h->max / 1e3;
	k = (q * h->count + 99) / 100; /* ceil(q / 100 * n), no libm */
	if (k)
		k--;
	for (unsigned b = 0; b < LAT_BUCKETS; b++) {
		seen += h->n[b];
		if (seen > k)
			return (double)lat_value(b) / 1e3;
	}
	return (double)h->max / 1e3;
}

/*
 * Everything reported for one trace; NAN where unknown. The h_ and half_
 * figures are the priced window's (see compute()).
 */
struct result {
	double frag_pct, torch_frag_pct, exp_frag_pct;
	double half_ms, half_pct, measured_half_ms;
	double p50_us, p99_us, max_us;
	double steps, step_ms;
	uint64_t creates, maps, set_access, unmaps, releases;
	uint64_t h_creates, h_maps, h_access_bytes, h_access_handles;
	uint64_t h_unmaps, h_releases;
	uint64_t h_stitches, h_reuses;
};

static double frag(double used, double reserved)
{
	return reserved > 0 ? 100.0 * (1.0 - used / reserved) : NAN;
}

/* Handles a window's set-access calls covered. */
static double access_handles(const struct window *w)
{
	return (double)w->access_handles;
}

/*
 * Driver time of the priced window at H200 prices, in microseconds. Each
 * call costs the same whatever the handle's size (bench/vmm_probe.c
 * measured set-access and unmap per handle, not per byte), and set-access
 * is paid once per handle of the range it covers.
 */
static double price_us(const struct replay *r, const struct window *w)
{
	(void)r;
	return (double)w->calls[GMLAKE_CALL_mem_create] * COST_CREATE_US +
	       (double)w->calls[GMLAKE_CALL_mem_map] * COST_MAP_US +
	       (double)w->calls[GMLAKE_CALL_mem_unmap] * COST_UNMAP_US +
	       (double)w->calls[GMLAKE_CALL_mem_release] * COST_RELEASE_US +
	       access_handles(w) * COST_ACCESS_US;
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
	struct window half = {0};
	const struct window *w = &half;
	double per_step;
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
	/* The steady steps when the trace marks them, else the second half. */
	if (r->nsteps)
		w = &r->steady;
	else
		window_add(&half, &r->mid, e);
	x->h_creates = w->calls[GMLAKE_CALL_mem_create];
	x->h_maps = w->calls[GMLAKE_CALL_mem_map];
	x->h_unmaps = w->calls[GMLAKE_CALL_mem_unmap];
	x->h_releases = w->calls[GMLAKE_CALL_mem_release];
	x->h_access_bytes = w->access_bytes;
	x->h_access_handles = w->access_handles;
	x->h_stitches = w->stitches;
	x->h_reuses = w->stitch_reuses;
	for (i = 0; i < sizeof(vmm) / sizeof(vmm[0]); i++)
		ns += w->call_ns[vmm[i]];
	x->measured_half_ms = (double)ns / 1e6;
	x->half_ms = price_us(r, w) / 1e3;

	x->steps = x->step_ms = x->half_pct = NAN;
	if (r->sc.have & GML_SIDECAR_HAVE_STEPS)
		x->steps = r->sc.steps;
	else if (r->hdr.have & GML_TRACE_HAVE_STEPS)
		x->steps = (double)r->hdr.steps;
	if (r->sc.have & GML_SIDECAR_HAVE_STEP_MS)
		x->step_ms = r->sc.step_ms;
	if (r->nsteps) {
		/* The steady steps' own mean: settling steps are slower. */
		per_step = x->step_ms;
		if (r->sc.have & GML_SIDECAR_HAVE_STEADY_STEP_MS)
			per_step = r->sc.steady_step_ms;
		if (r->steady_steps && per_step > 0)
			x->half_pct = 100.0 * x->half_ms /
				      ((double)r->steady_steps * per_step);
	} else if (x->steps > 0 && x->step_ms > 0) {
		x->half_pct = 100.0 * x->half_ms / (x->steps * x->step_ms / 2);
	}

	x->p50_us = pct_us(&r->lat, 50);
	x->p99_us = pct_us(&r->lat, 99);
	x->max_us = pct_us(&r->lat, 100);
}

static void json_str(const char *key, const char *s)
{
	printf("\"%s\": ", key);
	gml_json_str(stdout, s);
	printf(", ");
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
	json_u64("long_lived_windows", r->long_lived_on);
	json_u64("trims", r->trims);
	json_u64("skipped_frees", r->skipped_frees);
	json_u64("duplicate_allocs", r->dup_allocs);
	json_u64("chunk_size", e->chunk_size);
	json_u64("capacity", r->capacity);
	json_u64("lag", r->lag);
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
	json_str("priced", r->nsteps ? "steady_steps" : "second_half");
	json_u64("steady_steps", r->steady_steps);
	json_u64("creates", x->creates);
	json_u64("maps", x->maps);
	json_u64("set_access", x->set_access);
	json_u64("access_bytes", e->access_bytes);
	json_u64("access_handles", e->access_handles);
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
	json_u64("access_handles_second_half", x->h_access_handles);
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

/* --per-step: each step's driver work, one line a step under its row. */
static void print_steps(const struct replay *r)
{
	for (size_t i = 0; i < r->nsteps_w; i++) {
		const struct window *w = &r->steps_w[i];

		printf("  step %-4zu %-8s drv_ms %8.1f creates %6" PRIu64
		       " maps %6" PRIu64 " access %6.0f unmaps %6" PRIu64
		       " release %6" PRIu64 " stitch %4" PRIu64 "\n", i,
		       r->steps_settle[i] ? "settling" : "steady",
		       price_us(r, w) / 1e3,
		       w->calls[GMLAKE_CALL_mem_create],
		       w->calls[GMLAKE_CALL_mem_map], access_handles(w),
		       w->calls[GMLAKE_CALL_mem_unmap],
		       w->calls[GMLAKE_CALL_mem_release], w->stitches);
	}
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

/* A count from 1 to 2^40. */
static int parse_count(const char *s, uint64_t *out)
{
	unsigned long long v;
	char *end;

	if (!*s || *s == '-')
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || *end || !v || v > (1ull << 40))
		return -EINVAL;
	*out = v;
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
		"  -m, --max-live=COUNT    blocks live at once before the trace is refused\n"
		"                          (default 1048576)\n"
		"  -q, --quiet             no progress line (shown only on a terminal)\n"
		"  -s, --per-step          each step's driver work (traces with step lines)\n"
		"  -l, --lag               emulated device behind the host: queued work runs\n"
		"                          only at step lines and other host waits\n"
		"  -e, --explain[=SIZE]    on stderr: each step line, each allocation of SIZE\n"
		"                          or more (default 64M) and each call that called\n"
		"                          the driver, with the policy steps it took\n"
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
		{"max-live", required_argument, NULL, 'm'},
		{"quiet", no_argument, NULL, 'q'},
		{"per-step", no_argument, NULL, 's'},
		{"lag", no_argument, NULL, 'l'},
		{"explain", optional_argument, NULL, 'e'},
		{"help", no_argument, NULL, 'h'},
		{"version", no_argument, NULL, 'V'},
		{NULL, 0, NULL, 0},
	};
	int c;

	o->explain_min = DEFAULT_EXPLAIN_MIN;
	while ((c = getopt_long(argc, argv, "b:jtc:C:m:qsle::hV", longopts,
				NULL)) != -1) {
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
		case 'm':
			if (parse_count(optarg, &o->max_live)) {
				errmsg("bad count '%s'", optarg);
				return -EINVAL;
			}
			break;
		case 'q':
			o->quiet = true;
			break;
		case 's':
			o->per_step = true;
			break;
		case 'l':
			o->lag = true;
			break;
		case 'e':
			o->explain = true;
			if (optarg && parse_size(optarg, &o->explain_min)) {
				errmsg("bad size '%s'", optarg);
				return -EINVAL;
			}
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
	if (o->lag && o->backend == GMLAKE_BACKEND_CUDA) {
		errmsg("--lag is the emulated device's; a GPU lags by itself");
		return -EINVAL;
	}
	if (o->lag && o->touch) {
		errmsg("--lag cannot go with --touch, whose copies wait for "
		       "the device at every block");
		return -EINVAL;
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
	ret = read_trace(&r, o);
	if (!ret)
		ret = replay(&r, o);
	progress_clear();
	if (!ret) {
		compute(&r, &x);
		if (o->json) {
			print_json(&r, &x);
		} else {
			if (!*header_done)
				print_table_header();
			*header_done = true;
			print_row(&r, &x);
			print_steps(&r);
		}
		fflush(stdout);
	}
	free(r.steps_w);
	free(r.steps_settle);
	gml_trace_close(r.t);
	return ret;
}

int main(int argc, char **argv)
{
	struct options o = {.backend = GMLAKE_BACKEND_DEFAULT,
			    .max_live = DEFAULT_MAX_LIVE};
	bool header_done = false;
	int i, failed = 0;

	if (parse_args(argc, argv, &o))
		return EXIT_USAGE;
	/* --explain's lines would break into the progress line */
	o.progress = !o.quiet && !o.explain && isatty(STDERR_FILENO);
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
