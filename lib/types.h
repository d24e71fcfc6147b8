/* SPDX-License-Identifier: MIT */
/*
 * The object hierarchy of a context, bottom up:
 *
 *   chunk   one physical allocation of chunk_size bytes (one driver handle).
 *           It is free or owned by exactly one live block, and carries the
 *           guard of its last free: (stream, event sequence).
 *   view    a virtual range with a chunk mapped at each position. A segment
 *           is the view made when chunks are created (it maps them in
 *           creation order); a stitched view maps chunks that already exist
 *           in segments, in whatever order they were free. A chunk is mapped
 *           by its segment and by any number of stitched views.
 *   block   what the caller holds: a run of positions of one view (large)
 *           or a piece of a small chunk (small, below small_size).
 *   small chunk  a one-chunk large block cut into small pieces for one
 *           stream.
 *
 *   spilled block  a live large block whose bytes the offload manager
 *           (offload/) moved to the host. It owns no chunk: the positions
 *           of its run are holes (no chunk, unmapped; or host memory mapped
 *           in place, which the block itself records), and it still counts
 *           as live on its view, so the view and its range stay reserved
 *           and nobody else is handed that range. Fetching fills the holes
 *           with chunks again, at the same address.
 *   span    one driver handle under a whole block's run, made when a block
 *           that cycles is fetched again (lib/span.c): its positions have
 *           chunk structs (spanned) that never leave the block.
 *   slab    one driver handle under several positions of a segment, made
 *           when a segment grows for a block (lib/slab.c): its chunks are
 *           free or owned one by one, but are never stitched or moved and
 *           go back to the driver together.
 *
 * Invariants (lib/check.c verifies them): a live resident large block
 * owns every chunk under its run; a spilled one owns none and its run is
 * all holes, but for the kept positions at its ends (a slab another block
 * holds part of, which the driver unmaps only whole); no chunk has two owners; a free chunk has no owner; a cached
 * stitched view has holes only while it has live blocks (under a spilled
 * block, or left by a freed spilled or span block; it leaves the cache
 * with its last live block).
 */
#ifndef GML_TYPES_H
#define GML_TYPES_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "drv.h"
#include "error.h"
#include "gmlake.h"
#include "ptrmap.h"
#include "tier.h"

struct gml_block;
struct gml_view;

#define GML_RUN_UNKNOWN UINT32_MAX
#define GML_ALIGN 512		/* blocks start and end on it, as PyTorch's */
/* A size as blocks hand it out: rounded up to GML_ALIGN. */
static inline size_t gml_align_up(size_t size)
{
	return (size + GML_ALIGN - 1) & ~(size_t)(GML_ALIGN - 1);
}
#define GML_SLAB_MAX 1024	/* chunks in one growth handle, at most */

/* A run of free chunks in a view, for best fit. */
struct gml_free_run {
	uint32_t pos, len;
};

/*
 * A moment in a stream's work: seq 0 means "before the stream barrier";
 * stream -1 means no work at all (a new chunk).
 */
struct gml_guard {
	int stream;		/* index in ctx->streams */
	uint64_t seq;
};

struct gml_chunk {
	gml_handle handle;
	struct gml_block *owner;	/* NULL when free */
	struct gml_view *seg;		/* the segment that created it */
	uint32_t seg_pos;
	struct gml_guard guard;		/* last free */
	struct gml_view **views;	/* stitched views mapping it */
	uint32_t nviews, cap_views;
	bool spanned;			/* one position of a span (span.c):
					   its handle maps the whole run */
	uint32_t span_len;		/* a span's first chunk: its positions
					   (the structs are one array) */
	uint16_t slab_len;		/* a slab's positions (slab.c); 0: the
					   chunk is a handle of its own */
	uint16_t slab_off;		/* this position within the slab */
};

struct gml_view {
	gml_va va;
	uint32_t n;			/* positions */
	uint32_t cap;			/* positions the range reserves: a
					   segment grows at its end up to it */
	struct gml_chunk **chunks;	/* NULL: a released position */
	uint8_t *mapped;		/* per position: still mapped */
	bool stitched;
	bool dying;			/* evicted, on ctx->dying */
	uint32_t live;			/* live blocks on this view */
	uint32_t maxfree;		/* longest run of free chunks, or
					   GML_RUN_UNKNOWN after a change */
	struct gml_free_run *runs;	/* free runs by (len, pos), valid
					   while maxfree is known */
	uint32_t nruns, cap_runs;
	uint32_t nstale;		/* segment: entries in ctx->stale */
	uint32_t holes;			/* stitched: positions emptied by a
					   spill (offload/) */
	uint64_t last_use;		/* LRU clock of stitched views */
	uint32_t fix_n;			/* stitched: the request its last
					   repair served (0: none yet) */
	uint32_t fix_lo, fix_hi;	/* the positions it remapped */
	struct gml_guard *guards;	/* last free per stream, for unmap */
	uint32_t nguards;
	struct gml_view *prev, *next;	/* ctx->segs or ctx->stitched */
};

struct gml_stream {
	gmlake_stream_t handle;
	bool dead;			/* destroyed: all its work is done */
	uint64_t next_seq;		/* last sequence recorded */
	uint64_t done_seq;		/* all up to here completed */
	uint64_t barrier;		/* covers seq 0 guards; 0: none yet */
	uint64_t open_seq;		/* handed to frees, not recorded yet
					   (the next record covers it); 0:
					   none */
	uint64_t poll_gen;		/* ctx->poll_gen when last polled */
	uint64_t order_gen, order_seq;	/* gml_stream_order_run's pass */
	struct { uint64_t seq; gml_event ev; } *pending;
	size_t head, count, cap;	/* ring of recorded events */
};

struct gml_schunk;

/* A segment position whose chunk moved to a fetched block before the work
 * that used it here completed: still mapped (to no chunk of its own) until
 * that work is done, then unmapped. */
struct gml_stale {
	struct gml_view *seg;
	uint32_t pos;
	struct gml_guard guard;
	uint32_t n;			/* a freed span's positions (span.c);
					   0: the one position pos */
	gml_handle span_h;		/* that span's handle */
};

/* An unmapped span kept for the next fetch of its size (span.c). */
struct gml_span_spare {
	gml_handle h;
	uint32_t n;
};

/* Where a large block's bytes are (offload/). */
enum gml_off_state {
	GML_OFF_RESIDENT = 0,	/* on the device */
	GML_OFF_SPILLING,	/* a copy to the host is in flight */
	GML_OFF_SPILLED,	/* on the host; the run is holes */
	GML_OFF_FETCHING,	/* chunks mapped again, copy in flight */
};

struct gml_block {
	uintptr_t ptr;
	size_t size;			/* asked for */
	size_t alloc_size;		/* handed out: the size rounded up to
					   GML_ALIGN (large blocks too, whose
					   positions span whole chunks) */
	int stream;
	bool small;
	struct gml_view *view;		/* large: positions [pos, pos + n) */
	uint32_t pos, n;
	uint32_t off;			/* large: ptr's offset in position pos
					   (pack.c); 0 but in a segment */
	struct gml_block *lo_nb, *hi_nb; /* pack.c: the blocks sharing its
					   first and its last chunk, next to
					   it by address; NULL: none */
	struct gml_schunk *sc;		/* small: the piece [ptr, +alloc_size) */
	bool free;			/* small piece free (in the pool) */
	struct gml_block *prev, *next;	/* small: neighbours by address */
	struct gml_guard *extra;	/* record_stream streams, and at
					   free the guards to wait for */
	uint32_t nextra;
	struct gml_block *lprev, *lnext; /* ctx->live / ctx->deferred */

	/* Offload (offload/), large blocks only. */
	uint8_t off_state;		/* enum gml_off_state */
	bool exported;			/* gmlake_ipc_export: another process
					   may map its memory, so it stays */
	bool offloadable;		/* gmlake_advise: may spill by LRU */
	uint32_t off_refs;		/* offload requests bound to it, queued
					   or in flight: it may not be freed */
	bool on_lru;			/* on the offload manager's LRU */
	bool inplace;			/* spilled: host memory mapped at ptr */
	void *host;			/* spilled: the copy in the host arena */
	size_t host_size;
	gml_handle host_h;		/* in place: host memory handle, */
	gml_va host_va;			/* and its second mapping; */
	bool inplace_mapped;		/* also mapped at ptr */
	struct gml_block *oprev, *onext; /* that LRU, oldest first */
	uint32_t fetches;		/* fetched so often: from the second
					   fetch, into a span (span.c) */
	uint32_t kept_lo, kept_hi;	/* spilled: positions at the start and
					   end of the run that stayed mapped
					   and owned, in a slab another block
					   holds part of (resident.c) */
	bool stuck;			/* spilled, its host copy the good
					   one, but still holding its chunks:
					   the driver refused their unmap
					   when a fetch failed; the next
					   fetch fills them */
};

struct gml_schunk {
	struct gml_block *backing;	/* the one-chunk large block */
	struct gml_block *first;	/* pieces by address */
	int stream;
	size_t used;
};

/* Free small pieces of one stream, sorted by (alloc_size, ptr). */
struct gml_spool {
	struct gml_block **free;
	size_t count, cap;
	struct gml_schunk *idle;	/* emptied, kept for the next request */
	struct gml_guard idle_guard;	/* of the free that emptied it */
};

struct gmlake_ctx {
	pthread_mutex_t lock;
	struct gmlake_config cfg;
	struct gml_dev dev;
	size_t chunk;			/* chunk size in bytes */
	size_t dev_total;		/* device memory, for absurd sizes */
	uint32_t chunk_shift;
	uint32_t slab;			/* chunks per growth handle (slab.c);
					   0 or 1: growth by chunks */

	struct gml_view *segs;		/* segments, oldest first */
	struct gml_view *stitched;	/* cached stitched views */
	struct gml_view *dying;		/* evicted, waiting for guards */
	uint32_t nstitched;
	uint64_t clock;

	gmlake_stream_t *created;	/* by gmlake_stream_create */
	int ncreated, cap_created;
	struct gml_stream *streams;
	int nstreams, cap_streams;
	struct gml_spool *spools;	/* one per stream index */
	bool mark_always;		/* frees record events on one stream
					   too (the offload manager runs) */
	uint64_t poll_gen;		/* one event query per stream per
					   allocation or free */
	int order_for;			/* stream index + 1 whose fit may take
					   memory other streams' work covers
					   (gml_stream_order_run); 0: none */
	uint64_t order_pass;		/* gml_stream_order_run's passes */
	atomic_int order_off;		/* > 0: never order streams on the
					   device (a CUDA graph captures) */

	struct gml_ptrmap blocks;	/* ptr -> live block */
	struct gml_block *live;		/* live blocks */
	struct gml_block *deferred;	/* freed, waiting for extra streams */
	gml_event *event_pool;
	size_t nevent_pool, cap_event_pool;

	/* A tier below the device (offload/, lib/tier.h): NULL until the
	 * tier is first used and registers itself. */
	const struct gml_tier_ops *tier;
	void *tier_priv;		/* the tier's state */
	gml_handle *zombies;		/* chunks whose release failed */
	uint32_t nzombies, cap_zombies;
	struct gml_stale *stale;	/* positions a moved chunk still maps */
	uint32_t nstale, cap_stale;
	gml_handle *spares;		/* unmapped chunks kept for reuse */
	uint32_t nspares, cap_spares;
	struct gml_span_spare *span_spares; /* unmapped spans, likewise */
	uint32_t nspan_spares, cap_span_spares;
	uint64_t spare_ns;		/* when spares last changed */
	uint32_t long_lived;		/* gmlake_long_lived() calls on, less
					   off: large growth takes spans */
	struct gml_import *imports;	/* ranges gmlake_ipc_import mapped */
	int peers[GML_MAX_PEERS];	/* granted over every mapping */
	uint32_t npeers;
	/* The most requested at once since creation or the last
	 * gmlake_trim(), and the most reserved ever: the policy's measures
	 * (the stats' peaks are the user's to reset). */
	int64_t requested_top;
	int64_t reserved_top;
	/* Since a user's gmlake_trim() that came within GML_REGROW_WINDOW
	 * allocations of the one before (none by the library's own since):
	 * growth regrows what it gave back (alloc.c's regrowing), from
	 * regrow_from reserved bytes. trim_allocs: st.allocs at the last
	 * user trim that released memory, 0 before one. */
#define GML_REGROW_WINDOW 1024
	bool regrow;
	int64_t regrow_from;
	uint64_t trim_allocs;

	struct gmlake_stats st;
};

/* stream.c */
int gml_stream_find(gmlake_ctx *ctx, gmlake_stream_t handle);
int gml_stream_index(gmlake_ctx *ctx, gmlake_stream_t handle, int *idx);
/* How a free marks its stream's work (gml_stream_mark). */
enum gml_mark {
	GML_MARK_LAZY,		/* nothing on a single stream, else the
				   open seq */
	GML_MARK_FORCE,		/* an event now unless two are in flight
				   after a poll, else the open seq */
	GML_MARK_NOW,		/* an event now */
};
int gml_stream_mark(gmlake_ctx *ctx, int idx, enum gml_mark how,
		    uint64_t *seq);
void gml_streams_mark_always(gmlake_ctx *ctx);
bool gml_stream_done(gmlake_ctx *ctx, int idx, uint64_t seq);
/* The seq that covers every free on stream idx so far. */
uint64_t gml_stream_last(gmlake_ctx *ctx, int idx);
int gml_stream_wait(gmlake_ctx *ctx, int idx, uint64_t seq);
bool gml_guard_ready(gmlake_ctx *ctx, const struct gml_guard *g, int want);
/* The same, polling each stream at most once per allocation: for fits
 * that look at many chunks. */
bool gml_guard_ready_scan(gmlake_ctx *ctx, const struct gml_guard *g,
			  int want);
int gml_stream_order_run(gmlake_ctx *ctx, struct gml_chunk *const *chunks,
			 uint32_t n, int to);
void gml_events_trim(gmlake_ctx *ctx);
void gml_streams_fini(gmlake_ctx *ctx);

/* ipc.c: whether [ptr, ptr + size) lies in one block gmlake_ipc_import
 * mapped; unmap what imports left mapped (destroy) */
bool gml_ipc_holds(const gmlake_ctx *ctx, uintptr_t ptr, size_t size);
/* Whether the process is out of descriptors; then its soft limit is
 * raised to the hard one if it can be (*raised). */
bool gml_ipc_out_of_fds(bool *raised);
void gml_ipc_fini(gmlake_ctx *ctx);
/* Set-access over every imported range (peer.c). */
int gml_ipc_grant(gmlake_ctx *ctx);

/* alloc.c: large blocks, views and chunks */
int gml_large_alloc(gmlake_ctx *ctx, size_t size, int stream,
		    struct gml_block **out);
void gml_large_free(gmlake_ctx *ctx, struct gml_block *b,
		    const struct gml_guard *g);
int gml_release_cached(gmlake_ctx *ctx, bool all);
uint32_t gml_release_free_chunks(gmlake_ctx *ctx, uint32_t want);
/* The pressure ladder (lib/pressure.c): give up one more rung's memory
 * (*rung from 0) for a request that found none, never keep; true when
 * the request should be tried again. */
bool gml_pressure_relieve(gmlake_ctx *ctx, unsigned *rung,
			  struct gml_block *keep);
void gml_reap_dying(gmlake_ctx *ctx, bool wait);
void gml_views_fini(gmlake_ctx *ctx);
bool gml_chunk_in_view(const struct gml_chunk *c, const struct gml_view *v);
/*
 * Device access an attach left to its caller (gml_large_attach with
 * defer): [va, va + size), over handles mappings. The caller grants it
 * with gml_dev_set_access, with no lock needed (the call takes 0.4-1 ms
 * while copies run both ways on an H200, and allocations wait for the
 * context lock), and counts it with gml_large_granted under the lock; if
 * the grant fails, gml_large_detach takes the chunks back.
 */
struct gml_access {
	gml_va va;
	size_t size;
	uint64_t handles;
};

/* Offload: take a block's chunks away, its range kept (0, -EBUSY, -errno);
 * whether a detach would keep positions of it; map chunks at its range
 * again (with defer, granting no access); count a deferred access once
 * granted; free a spilled block's run. */
int gml_large_detach(gmlake_ctx *ctx, struct gml_block *b, bool check);
bool gml_large_keeps(const struct gml_block *b);
int gml_large_attach(gmlake_ctx *ctx, struct gml_block *b,
		     struct gml_access *defer);
void gml_large_granted(gmlake_ctx *ctx, const struct gml_access *a);
void gml_large_free_spilled(gmlake_ctx *ctx, struct gml_block *b,
			    const struct gml_guard *g);
void gml_zombies_reap(gmlake_ctx *ctx);
/* The bytes a resident large block's positions map (whole chunks), which
 * a spill or fetch maps and grants; its ptr is then their start. */
static inline size_t gml_large_bytes(const gmlake_ctx *ctx,
				     const struct gml_block *b)
{
	return (size_t)b->n << ctx->chunk_shift;
}
/* Spilled chunks and spans kept for the next fetch or segment, released
 * after cfg.spare_keep_ms unused, on trim, under pressure and at destroy. */
void gml_spares_release(gmlake_ctx *ctx);
void gml_log_peak_slack_now(gmlake_ctx *ctx, const char *what, size_t size);
/* At debug level, after a request that raised the reserved peak: what free
 * chunks stayed behind (gml_log_peak_slack_now); nothing otherwise. */
static inline void gml_log_peak_slack(gmlake_ctx *ctx, const char *what,
				      size_t size, int64_t peak_before)
{
	if (gml_log_level >= GMLAKE_LOG_DEBUG &&
	    ctx->st.reserved_bytes.peak > peak_before)
		gml_log_peak_slack_now(ctx, what, size);
}
/* Unmap the stale positions whose work completed (all: every one, the
 * caller having waited for all streams). */
void gml_stale_reap(gmlake_ctx *ctx, bool all);
/* Wait for the work queued so far on every stream; 0 or the first error. */
int gml_streams_wait_all(gmlake_ctx *ctx);

/* tier.c: what a tier below the device (offload/) asks of the allocator
 * instead of reading its fields; ctx lock held. */
/* Stream indices run from 0 to gml_stream_count() - 1; the handle of a
 * live one, false for an index out of range or a destroyed stream. */
int gml_stream_count(gmlake_ctx *ctx);
bool gml_stream_handle(gmlake_ctx *ctx, int idx, gmlake_stream_t *s);
/* Whether segment positions still wait to be unmapped (gml_stale_reap). */
bool gml_stale_pending(gmlake_ctx *ctx);
/* The chunk timer, run by a tier's thread: unmap the stale positions
 * whose work completed, give back spare chunks unused for
 * cfg.spare_keep_ms. Milliseconds until the next look is due, -1: none. */
int gml_chunks_tend(gmlake_ctx *ctx);
const struct gmlake_config *gml_ctx_config(const gmlake_ctx *ctx);

/* small.c */
int gml_small_alloc(gmlake_ctx *ctx, size_t size, int stream,
		    struct gml_block **out);
void gml_small_free(gmlake_ctx *ctx, struct gml_block *b,
		    const struct gml_guard *g);
/* Give the idle small chunk of stream (-1: of every stream) back to the
 * large pool. */
void gml_small_trim(gmlake_ctx *ctx, int stream);
void gml_spools_fini(gmlake_ctx *ctx);

/* ctx.c (the context lock is in lock.h) */
void gml_block_release(gmlake_ctx *ctx, struct gml_block *b,
		       const struct gml_guard *g);
void gml_release_deferred(gmlake_ctx *ctx, bool wait);
/* gmlake_trim(); restart false keeps requested_top (a trim the library
 * makes itself: an out-of-memory retry, a lowered limit). */
int gml_trim(gmlake_ctx *ctx, bool restart);

/* check.c: the invariant checker, lock held */
int gml_ctx_check_locked(gmlake_ctx *ctx);

/* stats.c */
void gml_gauge_add(struct gmlake_stat *g, int64_t delta);
/* Reserved memory changed by delta bytes: its gauge and reserved_top. */
void gml_reserved_add(gmlake_ctx *ctx, int64_t delta);
void gml_stats_at_destroy(gmlake_ctx *ctx);
/* The figures gmlake_stats_get() returns; ctx->lock held (lib/shm.c). */
void gml_stats_snapshot_locked(gmlake_ctx *ctx, struct gmlake_stats *st);

#endif
