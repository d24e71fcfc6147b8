/* SPDX-License-Identifier: MIT */
/*
 * What a context holds, range by range: a snapshot for memory
 * visualizers (PyTorch's torch.cuda.memory._snapshot() format is made
 * from it by the PyTorch adapter) and for tests.
 *
 * A range is a run of virtual addresses backed by the context: a piece of
 * a segment (the virtual range made when chunks were created) or of a
 * stitched view (a second mapping of chunks that segments own), cut where
 * positions have no chunk (given back to the driver). Its pieces tile it
 * in address order: blocks the caller holds, free chunks, and positions
 * whose chunks serve a block through another range (a stitched view), so
 * that a chunk's bytes are counted as allocated exactly once. Small blocks
 * show as the pieces of their small chunk.
 */
#ifndef GMLAKE_SNAPSHOT_H
#define GMLAKE_SNAPSHOT_H

#include <stddef.h>
#include <stdint.h>

#include <gmlake.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GMLAKE_SNAPSHOT_VERSION 1

enum gmlake_range_kind {
	GMLAKE_RANGE_SEGMENT = 0,	/* chunks mapped where created */
	GMLAKE_RANGE_STITCHED = 1,	/* free chunks mapped side by side */
};

enum gmlake_piece_state {
	GMLAKE_PIECE_FREE = 0,		/* free: reusable at once */
	GMLAKE_PIECE_ALLOCATED = 1,	/* a live block */
	GMLAKE_PIECE_PENDING_FREE = 2,	/* freed, waiting for the streams
					   record_stream named */
	GMLAKE_PIECE_SPILLED = 3,	/* a live block held on the host */
	GMLAKE_PIECE_ELSEWHERE = 4,	/* chunks in use through another
					   range (a block on a stitched view) */
};

/* Piece flags. */
#define GMLAKE_PIECE_SMALL 0x1u		/* inside a small chunk */

struct gmlake_snap_range {
	uint64_t address;
	uint64_t size;
	uint32_t kind;			/* enum gmlake_range_kind */
	uint32_t first;			/* its pieces: pieces[first], */
	uint32_t count;			/* ... count of them */
	uint32_t pad0;
	gmlake_stream_t stream;		/* of its first block, else NULL */
};

struct gmlake_snap_piece {
	uint64_t address;
	uint64_t size;			/* bytes of the range it covers */
	uint64_t requested;		/* a block's asked-for size, else 0 */
	uint32_t state;			/* enum gmlake_piece_state */
	uint32_t flags;			/* GMLAKE_PIECE_* */
	gmlake_stream_t stream;		/* a block's stream, else NULL */
};

struct gmlake_snapshot {
	uint32_t version;		/* GMLAKE_SNAPSHOT_VERSION */
	uint32_t size;			/* sizeof(struct gmlake_snapshot) */
	uint64_t chunk_size;
	struct gmlake_snap_range *ranges;	/* by kind, then address */
	size_t nranges;
	struct gmlake_snap_piece *pieces;
	size_t npieces;
};

/*
 * Take a snapshot of ctx under its lock (no driver call); *snap is owned
 * by the caller and goes with gmlake_snapshot_free(). 0, -EINVAL or
 * -ENOMEM.
 */
int gmlake_snapshot_take(gmlake_ctx *ctx, struct gmlake_snapshot **snap);
void gmlake_snapshot_free(struct gmlake_snapshot *snap);

/*
 * The cache: bytes of free chunks and free small pieces (*free_bytes), and
 * the largest request the context can serve from them without asking the
 * driver for memory (*largest; free chunks stitch, so above the stitching
 * threshold that is all of the free chunks). Either pointer may be NULL.
 * 0 or -EINVAL.
 */
int gmlake_cache_info(gmlake_ctx *ctx, size_t *free_bytes, size_t *largest);

#ifdef __cplusplus
}
#endif

#endif
