/* SPDX-License-Identifier: MIT */
/* Statistics: gauges, the versioned copy-out, and the printed summary. */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "error.h"
#include "types.h"

static const char *const call_names[] = {
#define CALL_NAME(name) #name,
	GMLAKE_FOREACH_CALL(CALL_NAME)
#undef CALL_NAME
};

GML_EXPORT const char *gmlake_call_name(int call)
{
	if (call < 0 || call >= GMLAKE_CALL_COUNT)
		return NULL;
	return call_names[call];
}

void gml_gauge_add(struct gmlake_stat *g, int64_t delta)
{
	g->current += delta;
	if (delta > 0)
		g->total += delta;
	if (g->current > g->peak)
		g->peak = g->current;
}

void gml_reserved_add(gmlake_ctx *ctx, int64_t delta)
{
	gml_gauge_add(&ctx->st.reserved_bytes, delta);
	if (ctx->st.reserved_bytes.current > ctx->reserved_top)
		ctx->reserved_top = ctx->st.reserved_bytes.current;
}

/* The context's figures, with the device's call counters; lock held. */
static void snapshot(gmlake_ctx *ctx, struct gmlake_stats *st)
{
	*st = ctx->st;
	st->version = GMLAKE_STATS_VERSION;
	st->size = sizeof(*st);
	/* One by one: the device layer adds to them atomically, also from
	 * threads that do not hold the lock (lib/dev.c). */
	for (int i = 0; i < GMLAKE_CALL_COUNT; i++) {
		st->calls[i] = __atomic_load_n(&ctx->dev.calls[i],
					       __ATOMIC_RELAXED);
		st->call_ns[i] = __atomic_load_n(&ctx->dev.call_ns[i],
						 __ATOMIC_RELAXED);
		st->call_failures[i] = __atomic_load_n(
			&ctx->dev.call_failures[i], __ATOMIC_RELAXED);
	}
}

void gml_stats_snapshot_locked(gmlake_ctx *ctx, struct gmlake_stats *st)
{
	snapshot(ctx, st);
}

GML_EXPORT int gmlake_stats_get(gmlake_ctx *ctx, struct gmlake_stats *stats)
{
	if (!ctx || !stats)
		return gml_set_error(-EINVAL, "gmlake_stats_get: %s is NULL",
				     ctx ? "stats" : "ctx");
	if (stats->version != GMLAKE_STATS_VERSION ||
	    stats->size != sizeof(*stats))
		return gml_set_error(-EINVAL, "gmlake_stats_get: version %u "
				     "size %u, this library has version %u "
				     "size %zu", stats->version, stats->size,
				     GMLAKE_STATS_VERSION, sizeof(*stats));
	pthread_mutex_lock(&ctx->lock);
	snapshot(ctx, stats);
	pthread_mutex_unlock(&ctx->lock);
	return 0;
}

GML_EXPORT int gmlake_stats_reset_peaks(gmlake_ctx *ctx)
{
	if (!ctx)
		return gml_set_error(-EINVAL, "gmlake_stats_reset_peaks: ctx "
				     "is NULL");
	pthread_mutex_lock(&ctx->lock);
#define RESET_PEAK(name) ctx->st.name.peak = ctx->st.name.current;
	GMLAKE_FOREACH_GAUGE(RESET_PEAK)
#undef RESET_PEAK
	pthread_mutex_unlock(&ctx->lock);
	return 0;
}

/* Append to a fixed buffer; output that does not fit is cut. */
struct out {
	char buf[8192];
	size_t len;
};

__attribute__((format(printf, 2, 3)))
static void put(struct out *o, const char *fmt, ...)
{
	va_list ap;
	int n;

	if (o->len >= sizeof(o->buf))
		return;
	va_start(ap, fmt);
	n = vsnprintf(o->buf + o->len, sizeof(o->buf) - o->len, fmt, ap);
	va_end(ap);
	if (n > 0)
		o->len += (size_t)n;
	if (o->len > sizeof(o->buf))
		o->len = sizeof(o->buf);
}

static const char *engine_name(int engine)
{
	switch (engine) {
	case GMLAKE_OFFLOAD_ENGINE_URING:
		return "io_uring";
	case GMLAKE_OFFLOAD_ENGINE_THREAD:
		return "thread";
	default:
		return "none";
	}
}

static void format_text(const struct gmlake_stats *st, struct out *o)
{
	put(o, "%-18s %16s %16s %16s\n", "gmlake", "current", "peak", "total");
#define TEXT_GAUGE(name)						\
	put(o, "%-18s %16lld %16lld %16lld\n", #name,			\
	    (long long)st->name.current, (long long)st->name.peak,	\
	    (long long)st->name.total);
	GMLAKE_FOREACH_GAUGE(TEXT_GAUGE)
#undef TEXT_GAUGE
#define TEXT_COUNTER(name)						\
	put(o, "%-18s %16llu\n", #name, (unsigned long long)st->name);
	GMLAKE_FOREACH_COUNTER(TEXT_COUNTER)
#undef TEXT_COUNTER
	put(o, "%-18s %16s\n", "offload_engine",
	    engine_name(st->offload_engine));
	if (st->d2h_ns || st->h2d_ns)
		/* per request: copies in flight together each count */
		put(o, "%-18s %16.2f %16.2f\n", "GB/s d2h h2d (1)",
		    st->d2h_ns ? st->d2h_bytes / (double)st->d2h_ns : 0.0,
		    st->h2d_ns ? st->h2d_bytes / (double)st->h2d_ns : 0.0);
	put(o, "%-18s %16s %16s %16s\n", "driver call", "count", "ms",
	    "failed");
	for (int i = 0; i < GMLAKE_CALL_COUNT; i++)
		put(o, "%-18s %16llu %16.3f %16llu\n", call_names[i],
		    (unsigned long long)st->calls[i], st->call_ns[i] / 1e6,
		    (unsigned long long)st->call_failures[i]);
}

static void format_json(const struct gmlake_stats *st, struct out *o)
{
	put(o, "{\"chunk_size\":%llu", (unsigned long long)st->chunk_size);
#define JSON_GAUGE(name)						\
	put(o, ",\"" #name "\":{\"current\":%lld,\"peak\":%lld,"	\
	    "\"total\":%lld}", (long long)st->name.current,		\
	    (long long)st->name.peak, (long long)st->name.total);
	GMLAKE_FOREACH_GAUGE(JSON_GAUGE)
#undef JSON_GAUGE
#define JSON_COUNTER(name)						\
	put(o, ",\"" #name "\":%llu", (unsigned long long)st->name);
	GMLAKE_FOREACH_COUNTER(JSON_COUNTER)
#undef JSON_COUNTER
	put(o, ",\"offload_engine\":\"%s\"", engine_name(st->offload_engine));
	put(o, ",\"access_bytes\":%llu,\"access_handles\":%llu,"
	    "\"calls\":{", (unsigned long long)st->access_bytes,
	    (unsigned long long)st->access_handles);
	for (int i = 0; i < GMLAKE_CALL_COUNT; i++)
		put(o, "%s\"%s\":{\"count\":%llu,\"ns\":%llu,\"failed\":%llu}",
		    i ? "," : "", call_names[i],
		    (unsigned long long)st->calls[i],
		    (unsigned long long)st->call_ns[i],
		    (unsigned long long)st->call_failures[i]);
	put(o, "}}\n");
}

static int write_all(int fd, const char *p, size_t len)
{
	while (len) {
		ssize_t n = write(fd, p, len);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return gml_set_error(-errno, "gmlake_stats_print: "
					     "write: %s", strerror(errno));
		p += n;
		len -= (size_t)n;
	}
	return 0;
}

static int print_locked(gmlake_ctx *ctx, int fd, bool json)
{
	static _Thread_local struct out o;
	struct gmlake_stats st;

	snapshot(ctx, &st);
	o.len = 0;
	if (json)
		format_json(&st, &o);
	else
		format_text(&st, &o);
	return write_all(fd, o.buf, o.len);
}

GML_EXPORT int gmlake_stats_print(gmlake_ctx *ctx, int fd, bool json)
{
	int ret;

	if (!ctx || fd < 0)
		return gml_set_error(-EINVAL, "gmlake_stats_print: %s",
				     ctx ? "bad file descriptor" : "ctx is NULL");
	pthread_mutex_lock(&ctx->lock);
	ret = print_locked(ctx, fd, json);
	pthread_mutex_unlock(&ctx->lock);
	return ret;
}

/* GMLAKE_SHOW_STATS: the summary on stderr when a context goes. */
void gml_stats_at_destroy(gmlake_ctx *ctx)
{
	print_locked(ctx, STDERR_FILENO, false);
}
