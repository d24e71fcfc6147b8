/* SPDX-License-Identifier: MIT */
/*
 * gmlake-replay --explain: each interesting call of a replay on a line of
 * its own, with the policy steps it took and the driver calls it made,
 * from the difference of the statistics around it. It answers "which
 * allocation of which step called the driver, and why" without a debug
 * build.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <inttypes.h>

#include "explain.h"

/* The counters that say which step of the policy served a call. */
static const struct {
	size_t off;
	const char *name;
} paths[] = {
	{ offsetof(struct gmlake_stats, fits), "fit" },
	{ offsetof(struct gmlake_stats, stitch_reuses), "cached stitch" },
	{ offsetof(struct gmlake_stats, stitch_repairs), "repair" },
	{ offsetof(struct gmlake_stats, stitches), "stitch" },
	{ offsetof(struct gmlake_stats, grows), "grow" },
	{ offsetof(struct gmlake_stats, evictions), "evict" },
	{ offsetof(struct gmlake_stats, releases), "release" },
	{ offsetof(struct gmlake_stats, cross_stream_waits),
	  "chunks passed over (other streams' work)" },
	{ offsetof(struct gmlake_stats, ooms), "out of memory" },
};

static uint64_t counter(const struct gmlake_stats *s, size_t off)
{
	return *(const uint64_t *)((const char *)s + off);
}

static uint64_t driver_calls(const struct gmlake_stats *a,
			     const struct gmlake_stats *b)
{
	uint64_t n = 0;

	for (int k = 0; k < GMLAKE_CALL_COUNT; k++)
		n += b->calls[k] - a->calls[k];
	return n;
}

/* ": path, path; call N, call N (H handles)" after what the line named. */
static void tail(FILE *f, const struct gmlake_stats *a,
		 const struct gmlake_stats *b)
{
	const char *sep = ": ";

	for (size_t i = 0; i < sizeof(paths) / sizeof(paths[0]); i++) {
		uint64_t d = counter(b, paths[i].off) - counter(a, paths[i].off);

		if (!d)
			continue;
		if (d == 1)
			fprintf(f, "%s%s", sep, paths[i].name);
		else
			fprintf(f, "%s%s x%" PRIu64, sep, paths[i].name, d);
		sep = ", ";
	}
	sep = "; ";
	for (int k = 0; k < GMLAKE_CALL_COUNT; k++) {
		uint64_t d = b->calls[k] - a->calls[k];

		if (!d)
			continue;
		fprintf(f, "%s%s %" PRIu64, sep, gmlake_call_name(k), d);
		if (k == GMLAKE_CALL_set_access)
			fprintf(f, " (%" PRIu64 " handles)",
				b->access_handles - a->access_handles);
		sep = ", ";
	}
	fputc('\n', f);
}

void gml_explain_alloc(FILE *f, const char *trace, uint64_t line,
		       uint64_t size, const void *ptr, uint64_t min,
		       const struct gmlake_stats *before,
		       const struct gmlake_stats *after)
{
	if (size < min && !driver_calls(before, after))
		return;
	fprintf(f, "%s:%" PRIu64 ": alloc %" PRIu64 " -> %p", trace, line,
		size, ptr);
	tail(f, before, after);
}

void gml_explain_free(FILE *f, const char *trace, uint64_t line,
		      const void *ptr, const struct gmlake_stats *before,
		      const struct gmlake_stats *after)
{
	if (!driver_calls(before, after))
		return;
	fprintf(f, "%s:%" PRIu64 ": free %p", trace, line, ptr);
	tail(f, before, after);
}

void gml_explain_trim(FILE *f, const char *trace, uint64_t line,
		      const struct gmlake_stats *before,
		      const struct gmlake_stats *after)
{
	fprintf(f, "%s:%" PRIu64 ": trim, %" PRId64 " MiB released", trace,
		line, (before->reserved_bytes.current -
		       after->reserved_bytes.current) >> 20);
	tail(f, before, after);
}

void gml_explain_step(FILE *f, const char *trace, uint64_t k, bool settling)
{
	fprintf(f, "%s: step %" PRIu64 " (%s)\n", trace, k,
		settling ? "settling" : "steady");
}
