/* SPDX-License-Identifier: MIT */
/*
 * Allocator statistics: a transparent, versioned struct. The caller sets
 * version and size; gmlake_stats_get() rejects a struct it does not know.
 */
#ifndef GMLAKE_STATS_H
#define GMLAKE_STATS_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GMLAKE_STATS_VERSION 2

/* Driver call kinds, counted and timed one by one. */
#define GMLAKE_FOREACH_CALL(X)						\
	X(mem_create)							\
	X(mem_release)							\
	X(va_reserve)							\
	X(va_free)							\
	X(mem_map)							\
	X(mem_unmap)							\
	X(set_access)							\
	X(event_create)							\
	X(event_record)							\
	X(event_query)							\
	X(event_sync)							\
	X(stream_sync)							\
	X(memcpy)							\
	X(stream_wait)							\
	X(host_func)							\
	X(host_register)						\
	X(host_unregister)						\
	X(mem_create_host)

enum gmlake_call {
#define GMLAKE_CALL_ENUM(name) GMLAKE_CALL_##name,
	GMLAKE_FOREACH_CALL(GMLAKE_CALL_ENUM)
#undef GMLAKE_CALL_ENUM
	GMLAKE_CALL_COUNT
};

/* Current, peak and running total of one quantity. */
struct gmlake_stat {
	int64_t current;
	int64_t peak;
	int64_t total;
};

/* Byte and object gauges, with their peaks. */
#define GMLAKE_FOREACH_GAUGE(X)						\
	X(requested_bytes)	/* sum of sizes asked for */		\
	X(allocated_bytes)	/* bytes handed out, sizes in 512s */	\
	X(resident_bytes)	/* allocated, less spilled blocks */	\
	X(reserved_bytes)	/* physical chunks held */		\
	X(mapped_bytes)		/* virtual bytes mapped */		\
	X(active_blocks)	/* live blocks */			\
	X(stitched_live)	/* live blocks on stitched ranges */	\
	X(stitched_cached)	/* stitched ranges kept mapped */	\
	X(chunks)		/* physical chunks held */		\
	X(small_chunks)		/* chunks packing small blocks */	\
	X(spilled_bytes)	/* block bytes held on the host */	\
	X(spilled_blocks)	/* blocks held on the host */		\
	X(host_bytes)		/* host arena bytes in use */		\
	X(host_pinned)		/* host arena bytes pinned */

/* Event counters. */
#define GMLAKE_FOREACH_COUNTER(X)					\
	X(allocs)							\
	X(frees)							\
	X(fits)			/* segment first fit, no driver work */\
	X(stitch_reuses)	/* best fit in a cached stitched range */\
	X(stitches)		/* new stitched ranges mapped */	\
	X(stitch_repairs)	/* cached ranges partly remapped */	\
	X(grows)		/* growths by new chunks */		\
	X(evictions)		/* stitched ranges unmapped */		\
	X(releases)		/* chunks given back to the driver */	\
	X(ooms)			/* allocations that failed -ENOMEM */	\
	X(cross_stream_waits)	/* blocks skipped: other stream busy */	\
	X(spills)		/* blocks copied out to the host */	\
	X(fetches)		/* blocks brought back */		\
	X(auto_spills)		/* spills made by memory pressure */	\
	X(offload_failures)	/* spills or fetches that failed */	\
	X(d2h_bytes)		/* bytes copied device to host */	\
	X(d2h_ns)		/* time those copies took */		\
	X(h2d_bytes)		/* bytes copied host to device */	\
	X(h2d_ns)		/* time those copies took */

/* How the offload manager waits for copies (0 until it is set up). */
enum gmlake_offload_engine {
	GMLAKE_OFFLOAD_ENGINE_NONE = 0,
	GMLAKE_OFFLOAD_ENGINE_URING = 1,	/* io_uring (liburing) */
	GMLAKE_OFFLOAD_ENGINE_THREAD = 2,	/* plain threads */
};

struct gmlake_stats {
	uint32_t version;	/* GMLAKE_STATS_VERSION, set by the caller */
	uint32_t size;		/* sizeof(struct gmlake_stats), likewise */
	uint64_t chunk_size;
#define GMLAKE_STATS_GAUGE(name) struct gmlake_stat name;
	GMLAKE_FOREACH_GAUGE(GMLAKE_STATS_GAUGE)
#undef GMLAKE_STATS_GAUGE
#define GMLAKE_STATS_COUNTER(name) uint64_t name;
	GMLAKE_FOREACH_COUNTER(GMLAKE_STATS_COUNTER)
#undef GMLAKE_STATS_COUNTER
	uint64_t calls[GMLAKE_CALL_COUNT];	/* driver calls by kind */
	uint64_t call_ns[GMLAKE_CALL_COUNT];	/* time spent in them */
	uint64_t call_failures[GMLAKE_CALL_COUNT];
	uint64_t access_bytes;			/* bytes covered by set_access */
	int32_t offload_engine;			/* enum gmlake_offload_engine */
	int32_t pad0;
	uint64_t access_handles;		/* handles covered by set_access */
	uint64_t reserved[31];
};

struct gmlake_ctx;

/* Fill *stats; -EINVAL on a version or size this library does not know. */
int gmlake_stats_get(struct gmlake_ctx *ctx, struct gmlake_stats *stats);
/* Set every peak to its current value. */
int gmlake_stats_reset_peaks(struct gmlake_ctx *ctx);
/* Print a human-readable summary (json: one JSON object) to fd. */
int gmlake_stats_print(struct gmlake_ctx *ctx, int fd, bool json);
/* Name of a driver call kind ("mem_map"), or NULL when out of range. */
const char *gmlake_call_name(int call);

#ifdef __cplusplus
}
#endif

#endif
