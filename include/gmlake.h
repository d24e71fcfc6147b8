/* SPDX-License-Identifier: MIT */
/*
 * libgmlake: a GPU memory allocator on CUDA's virtual-memory API that keeps
 * physical memory as small chunks and stitches non-contiguous free chunks
 * into one contiguous virtual range when no single free block fits.
 *
 * Conventions: every function that can fail returns 0 (or a count) on
 * success and a negative errno on failure; gmlake_last_error() then holds a
 * message naming the problem. Nothing here exits or aborts.
 */
#ifndef GMLAKE_H
#define GMLAKE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GMLAKE_VERSION_MAJOR 0
#define GMLAKE_VERSION_MINOR 1

/* The same type as CUDA's CUstream, without needing cuda.h. */
struct CUstream_st;
typedef struct CUstream_st *gmlake_stream_t;

/* One allocator over one device. Opaque; every init has its destroy. */
typedef struct gmlake_ctx gmlake_ctx;

enum gmlake_backend {
	GMLAKE_BACKEND_DEFAULT = 0,	/* GMLAKE_BACKEND, else cuda */
	GMLAKE_BACKEND_CUDA = 1,	/* the real driver, libcuda.so.1 */
	GMLAKE_BACKEND_EMU = 2,		/* the emulated device (tests, replay) */
};

enum gmlake_log_level {
	GMLAKE_LOG_ERROR = 0,
	GMLAKE_LOG_WARN = 1,
	GMLAKE_LOG_INFO = 2,
	GMLAKE_LOG_DEBUG = 3,
};

#define GMLAKE_CONFIG_VERSION 1

/* top_fit's default: requests of at least a quarter of the most memory
 * the live blocks ever requested at once (gmlake_config_init(3)). */
#define GMLAKE_TOP_FIT_AUTO SIZE_MAX

/* grow_slack's largest value: growth up to twice the most requested. */
#define GMLAKE_GROW_SLACK_MAX 1000

/*
 * Settings of a context. gmlake_config_init() fills the defaults and then
 * applies the GMLAKE_* environment options; change fields after that.
 */
struct gmlake_config {
	uint32_t version;		/* GMLAKE_CONFIG_VERSION */
	uint32_t size;			/* sizeof(struct gmlake_config) */
	int backend;			/* enum gmlake_backend */
	int device;			/* device ordinal */
	size_t chunk_size;		/* physical chunk; 0: the granularity */
	size_t small_size;		/* requests below are packed; 1 MiB */
	size_t stitch_min;		/* smallest request that may stitch */
	unsigned stitch_cache_max;	/* cached stitched ranges kept */
	size_t emu_capacity;		/* emulated device memory in bytes */
	size_t emu_granularity;		/* emulated allocation granularity */
	int log_level;			/* enum gmlake_log_level; one for
					   the process: the last
					   gmlake_config_init or
					   gmlake_ctx_init sets it */
	bool show_stats;		/* print a summary at destroy/exit */
	bool publish;			/* stats in /dev/shm for gmlake-top */
	size_t device_limit;		/* device bytes to stay under; 0: none */
	size_t host_limit;		/* pinned host bytes for offload */
	int offload_engine;		/* enum gmlake_offload_engine; 0: probe */
	size_t host_pin;		/* host bytes pinned when offload
					   starts; 0: one growth step */
	unsigned spare_keep_ms;		/* spilled chunks kept this long
					   unused for a fetch; 5000 */
	bool stream_order;		/* a request may wait on the device
					   for memory other streams' work
					   still covers; true */
	bool exportable;		/* chunks made exportable as file
					   descriptors, so blocks can be
					   shared (gmlake_ipc_export); true */
	bool pack;			/* segment blocks share the chunks
					   at their ends (placed at 512
					   bytes, as PyTorch's expandable
					   segments); false */
	bool emu_lag;			/* emulated device: queued work
					   waits until the host waits for
					   the device, as a GPU behind its
					   host does; false */
	size_t top_fit;			/* requests of at least this many
					   bytes take the highest free run,
					   its top end; GMLAKE_TOP_FIT_AUTO
					   (default): a quarter of the
					   requested peak; 0: off */
	size_t grow_handle;		/* a segment grows for a block in
					   handles of this size; 20 MiB, 0
					   or chunk_size: by chunks */
	uint32_t grow_slack;		/* growth's budget over the most
					   requested at once, per mille; 20,
					   at most GMLAKE_GROW_SLACK_MAX */
	uint32_t reserved32;
	uint64_t reserved[3];
};

int gmlake_config_init(struct gmlake_config *cfg);

/* Version of the library in use, and whether it is at least major.minor. */
int gmlake_version_major(void);
int gmlake_version_minor(void);
bool gmlake_check_version(int major, int minor);

/* Message for the last failure in the calling thread ("" when none). */
const char *gmlake_last_error(void);

/*
 * Contexts. cfg may be NULL for gmlake_config_init()'s settings.
 * Destroy releases every chunk and mapping; it fails with -EBUSY while
 * blocks are live unless force is true (then their pointers die with it).
 * Destroying NULL does nothing and returns 0.
 */
int gmlake_ctx_init(gmlake_ctx **ctx, const struct gmlake_config *cfg);
int gmlake_ctx_destroy(gmlake_ctx *ctx, bool force);

/*
 * Streams of the context's device (a CUDA stream on the cuda backend, a
 * worker thread on the emulated one). NULL is the default stream.
 */
int gmlake_stream_create(gmlake_ctx *ctx, gmlake_stream_t *stream);
int gmlake_stream_destroy(gmlake_ctx *ctx, gmlake_stream_t stream);
int gmlake_stream_synchronize(gmlake_ctx *ctx, gmlake_stream_t stream);

/*
 * Allocation. A block is used on its stream; freeing it makes it reusable
 * at once on that stream and on others once the stream's work queued before
 * the free has completed, or sooner by a stream made to wait for that work
 * on the device (cfg.stream_order). record_stream adds a stream whose work
 * must also complete before the block is reused.
 */
int gmlake_alloc(gmlake_ctx *ctx, void **ptr, size_t size,
		 gmlake_stream_t stream);
int gmlake_free(gmlake_ctx *ctx, void *ptr);
int gmlake_record_stream(gmlake_ctx *ctx, void *ptr, gmlake_stream_t stream);
/*
 * Long-lived allocations (model parameters, optimizer state): while on
 * (calls nest), a block of 32 MiB or more takes one new physical handle of
 * its size at the end of the device's memory, past free memory that
 * shorter-lived blocks left (with an offload ring: only when nothing held
 * fits it), instead of one per 2 MiB chunk. -EINVAL for off without on.
 */
int gmlake_long_lived(gmlake_ctx *ctx, bool on);
/*
 * The growth budget (cfg.grow_slack) from now on: permille in 0 ..
 * GMLAKE_GROW_SLACK_MAX, or -1 to leave it. Returns the budget it had, or
 * -EINVAL.
 */
int gmlake_grow_slack(gmlake_ctx *ctx, int permille);
/*
 * Peer access: device ordinal peer may read and write every block of ctx,
 * now and later (a kernel on peer reading this device's tensors, as
 * PyTorch's enablePeerAccess asks). Off unless asked: each peer lengthens
 * every later set-access. 0 (also when granted before); -EINVAL (ctx
 * NULL, peer this device or no device), -ENODEV (peer cannot access this
 * device), -ENOSPC (31 peers already), or the driver's error, with later
 * mappings granted but some of the present ones perhaps not: call again.
 */
int gmlake_peer_access(gmlake_ctx *ctx, int peer);
/* Size the block at ptr was asked for, or -EINVAL if ptr is no block. */
int gmlake_block_size(gmlake_ctx *ctx, const void *ptr, size_t *size);

/* Give cached mappings and free chunks back to the driver. */
int gmlake_trim(gmlake_ctx *ctx);

/*
 * Copies between host and the context's device, ordered on a stream, for
 * programs that do not use the CUDA runtime (and for tests).
 */
int gmlake_memcpy_htod(gmlake_ctx *ctx, void *dst, const void *src,
		       size_t size, gmlake_stream_t stream);
int gmlake_memcpy_dtoh(gmlake_ctx *ctx, void *dst, const void *src,
		       size_t size, gmlake_stream_t stream);

#ifdef __cplusplus
}
#endif

#include <gmlake-stats.h>

#endif
