/* SPDX-License-Identifier: MIT */
/*
 * libgmlake: blocks shared with other processes.
 *
 * A block is physical memory (chunks, growth handles of several chunks)
 * mapped at one virtual range, stitched or not. gmlake_ipc_export
 * describes it as the file descriptors of those handles, in the order the
 * block's range maps them, and where the block begins in the first; a
 * process that has the descriptors (passed over a Unix socket, inherited,
 * or taken with pidfd_getfd) maps the same memory with gmlake_ipc_import,
 * on its own context, at an address of its own, which gmlake_memcpy_htod
 * and gmlake_memcpy_dtoh take like a block. Writes on either side are
 * seen by the other once the writing stream's work completed.
 *
 * The exporting process keeps the block allocated while an importer uses
 * it: the driver keeps an imported handle's memory, but libgmlake reuses a
 * freed block's chunks for other blocks at once. An exported block does not
 * spill to the host (the importer maps its memory, which a spill gives
 * back): gmlake_offload_* answers -EBUSY for it.
 */
#ifndef GMLAKE_IPC_H
#define GMLAKE_IPC_H

#include <stdint.h>

#include <gmlake.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One physical handle of a block, mapped whole by the importer. */
struct gmlake_ipc_piece {
	int fd;			/* a descriptor of the handle's memory */
	uint64_t offset;	/* where that memory starts in fd (0 on a
				   GPU; the emulated device has one file) */
	uint64_t size;		/* its bytes */
};

/* A block as its handles: [start, start + size) of the pieces mapped one
 * after another. */
struct gmlake_ipc_block {
	uint64_t size;		/* the block's bytes (gmlake_alloc's size
				   rounded up to 512, what it handed
				   out) */
	uint64_t start;		/* where the block begins in the first piece */
	uint32_t npieces;
	struct gmlake_ipc_piece *pieces;
};

/*
 * Describe the live block at ptr (its start) into *out: new descriptors,
 * the caller's to close with gmlake_ipc_block_free. A small block (under
 * 1 MiB) is described as its place in the 2 MiB chunk it shares, so an
 * importer maps the whole chunk. -EINVAL for a pointer that is no block's
 * start, -EOPNOTSUPP where the device did not make the memory exportable,
 * -EBUSY for a block spilled to the host or moving.
 */
int gmlake_ipc_export(gmlake_ctx *ctx, const void *ptr,
		      struct gmlake_ipc_block *out);
/* Close the descriptors of an export and free its pieces; NULL is fine. */
void gmlake_ipc_block_free(struct gmlake_ipc_block *blk);

/*
 * Map the memory blk describes (from this or another process, with
 * descriptors valid in this one) at a new range of ctx's device, readable
 * and writable there, and give the block's address in *ptr. The
 * descriptors stay the caller's. -EINVAL for a description that does not
 * hold together (no piece, sizes off the granularity, a block past its
 * pieces), -errno of the driver otherwise, with nothing left mapped.
 */
int gmlake_ipc_import(gmlake_ctx *ctx, const struct gmlake_ipc_block *blk,
		      void **ptr);
/* Unmap what gmlake_ipc_import mapped at ptr, once the work that uses it
 * on this side has completed (the caller's to wait for, as with
 * cudaIpcCloseMemHandle). -EINVAL for another ptr. */
int gmlake_ipc_close(gmlake_ctx *ctx, void *ptr);

#ifdef __cplusplus
}
#endif

#endif
