/* SPDX-License-Identifier: MIT */
/*
 * Entry points for PyTorch's pluggable allocator
 * (torch.cuda.memory.CUDAPluggableAllocator). PyTorch loads libgmlake.so
 * with ctypes and calls these by name; their signatures are PyTorch's
 * (gmlake_stream_t is cudaStream_t), so alloc returns a pointer and the
 * hooks return nothing. A failure is logged to stderr, kept for
 * gmlake_last_error() in the calling thread and for gmlake_torch_error()
 * in every thread.
 *
 * One context per device is created on its first allocation, from
 * gmlake_config_init()'s settings (the GMLAKE_* environment) with the
 * device set to PyTorch's. The contexts live as long as the process.
 * The python/gmlake package installs all of this: gmlake.torch.enable().
 */
#ifndef GMLAKE_TORCH_H
#define GMLAKE_TORCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <gmlake.h>

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The allocator: size bytes on device for use on stream. NULL for size 0
 * (as PyTorch's own allocator) and on failure (then see above).
 */
void *gmlake_torch_alloc(size_t size, int device, gmlake_stream_t stream);
/* Free ptr; an unknown or already freed pointer is logged and ignored. */
void gmlake_torch_free(void *ptr, size_t size, int device,
		       gmlake_stream_t stream);

/* Free ptr on whichever device's context holds it (PyTorch's raw_delete,
 * whose deleter gets the pointer alone); otherwise as gmlake_torch_free. */
void gmlake_torch_raw_delete(void *ptr);

/* Optional hooks (CUDAPluggableAllocator.allocator().set_*_fn). */
void gmlake_torch_init(int device_count);
/* torch.cuda.empty_cache(): gmlake_trim() on every device's context. */
void gmlake_torch_empty_cache(void);
/* torch.cuda.set_per_process_memory_fraction(): a device limit of
 * fraction times the device's memory (0 < fraction <= 1). */
void gmlake_torch_memory_fraction(double fraction, int device);
/* torch.cuda.get_per_process_memory_fraction(): the fraction set last
 * (1 when none was). 0 or -EINVAL. */
int gmlake_torch_memory_fraction_get(int device, double *fraction);
/* Tensor.record_stream(): gmlake_record_stream() on the owning context. */
void gmlake_torch_record_stream(void *ptr, gmlake_stream_t stream);
/* gmlake_long_lived() on device's context (made if need be); 0 or
 * -errno. */
int gmlake_torch_long_lived(int device, int on);
/* gmlake_grow_slack() on device's context (made if need be): the budget
 * it had, or -errno. */
int gmlake_torch_grow_slack(int device, int permille);

/*
 * The log level of allocation failures (enum gmlake_log_level; default
 * GMLAKE_LOG_ERROR, since PyTorch's pluggable allocator drops them). A
 * caller that raises them itself (the C++ adapter) lowers it.
 */
void gmlake_torch_set_fail_level(int level);

/*
 * The context serving device (for gmlake_stats_get() and friends; owned
 * by the library, never destroy it). -ENOENT when nothing was allocated
 * on device yet, -EINVAL for a bad device.
 */
int gmlake_torch_ctx_get(int device, gmlake_ctx **ctx);
/*
 * CUDA IPC (torch.multiprocessing) for the adapter's shareIpcHandle and
 * getIpcDevPtr. share writes the handle of the block at ptr (its start)
 * into buf (*len: its bytes; -ENOSPC when cap is short) and keeps the
 * block's descriptors open until it is freed; open maps a handle from
 * another process (or this one) on device, copying the sender's
 * descriptors with pidfd_getfd(2) (-EPERM without ptrace access to it),
 * and close unmaps what open mapped. See gmlake_ipc_export(3).
 */
int gmlake_torch_ipc_share(int device, const void *ptr, void *buf,
			   size_t cap, size_t *len);
int gmlake_torch_ipc_open(int device, const void *buf, size_t len,
			  void **ptr);
int gmlake_torch_ipc_close(int device, void *ptr);

/*
 * The message of the last failure of any gmlake_torch_* call, in any
 * thread, copied to buf (cut to size, NUL-terminated). Returns how many
 * failures there have been so far (0: none, buf gets ""), or -EINVAL.
 */
int gmlake_torch_error(char *buf, size_t size);

/*
 * Statistics under PyTorch's names (torch.cuda.memory_stats(): the
 * "all" aggregate of its StatArrays, and its counters), made from the
 * device's gmlake_stats and the counts these entry points keep. A device
 * with nothing allocated yet reads all zeros. Blocks parked in a private
 * pool (below) count as free here, as PyTorch counts its pools' free
 * blocks. The caller sets version and size.
 */
#define GMLAKE_TORCH_STATS_VERSION 1

/* Stat arrays of PyTorch's DeviceStats, in its order. */
#define GMLAKE_TORCH_FOREACH_STAT(X)					\
	X(allocation)		/* live blocks */			\
	X(segment)		/* physical chunks */			\
	X(active)		/* live blocks */			\
	X(inactive_split)	/* always 0: every free chunk can go */	\
	X(allocated_bytes)						\
	X(reserved_bytes)						\
	X(active_bytes)							\
	X(inactive_split_bytes)						\
	X(requested_bytes)

/* Counters of PyTorch's DeviceStats. */
#define GMLAKE_TORCH_FOREACH_COUNT(X)					\
	X(num_alloc_retries)	/* allocations retried after a trim */	\
	X(num_ooms)		/* allocations that failed */		\
	X(num_sync_all_streams)	/* trims (they wait for all streams) */	\
	X(num_device_alloc)	/* chunks created */			\
	X(num_device_free)	/* chunks released */

/* PyTorch's struct Stat: allocated - freed == current. */
struct gmlake_torch_stat {
	int64_t current;
	int64_t peak;
	int64_t allocated;
	int64_t freed;
};

struct gmlake_torch_stats {
	uint32_t version;	/* GMLAKE_TORCH_STATS_VERSION */
	uint32_t size;		/* sizeof(struct gmlake_torch_stats) */
#define GMLAKE_TORCH_STATS_STAT(name) struct gmlake_torch_stat name;
	GMLAKE_TORCH_FOREACH_STAT(GMLAKE_TORCH_STATS_STAT)
#undef GMLAKE_TORCH_STATS_STAT
#define GMLAKE_TORCH_STATS_COUNT(name) int64_t name;
	GMLAKE_TORCH_FOREACH_COUNT(GMLAKE_TORCH_STATS_COUNT)
#undef GMLAKE_TORCH_STATS_COUNT
	uint64_t reserved[16];
};

/* Fill *st for device. 0, or -EINVAL (device, version or size). */
int gmlake_torch_stats_get(int device, struct gmlake_torch_stats *st);
/* torch.cuda.reset_peak_memory_stats(): gmlake_stats_reset_peaks(). */
int gmlake_torch_stats_reset_peaks(int device);
/* torch.cuda.reset_accumulated_memory_stats(): the allocated and freed
 * figures and the counters start again from 0. */
int gmlake_torch_stats_reset_accumulated(int device);
/* gmlake_peer_access() on device's context (made now if it has none):
 * device peer may access device's memory (PyTorch's enablePeerAccess
 * (peer, device)). 0 or -errno. */
int gmlake_torch_peer_access(int device, int peer);

/* The largest request the device's cache serves without asking the
 * driver for memory (gmlake_cache_info()), as PyTorch's cacheInfo answers
 * for cuDNN's workspace; 0 before the first allocation. 0 or -EINVAL. */
int gmlake_torch_cache_info(int device, size_t *largest);

/*
 * Private pools (CUDA graphs, torch.cuda.MemPool), named by PyTorch's MempoolId_t (id0, id1). Memory allocated
 * into a pool belongs to it: freed, it is parked in the pool (still held
 * from the allocator, so nothing outside the pool is handed those bytes,
 * which a captured graph writes again at each replay) and serves later
 * allocations into the same pool on the same stream; it goes back to the
 * allocator when the pool's last user releases it. While any pool takes
 * allocations on a device the entry points neither trim nor wait for
 * streams there (graph capture forbids it).
 *
 * begin: the pool is created or gains a user, and allocations the caller
 * routes to it (gmlake_torch_pool_alloc) begin; end: they end on this
 * routing (the pool stays); incref: a user without routing (MemPool,
 * ensureExistsAndIncrefPool); release: one user less; at none the
 * parked blocks are freed, after the sync hook if one is set, and live
 * ones are freed for real when they are freed. 0 (release: the users
 * left) or -errno: -EINVAL for a bad device, -ENOENT for an unknown pool,
 * -ENOMEM.
 */
int gmlake_torch_pool_begin(int device, uint64_t id0, uint64_t id1);
int gmlake_torch_pool_end(int device, uint64_t id0, uint64_t id1);
int gmlake_torch_pool_incref(int device, uint64_t id0, uint64_t id1);
int gmlake_torch_pool_release(int device, uint64_t id0, uint64_t id1);
/* Users of the pool (0 for an unknown one), or -EINVAL. */
int gmlake_torch_pool_use_count(int device, uint64_t id0, uint64_t id1);
/* gmlake_torch_alloc() into a pool: a parked block of the pool on stream
 * that fits (at most twice size) first. NULL on failure, as there. */
void *gmlake_torch_pool_alloc(size_t size, int device, gmlake_stream_t stream,
			      uint64_t id0, uint64_t id1);
/* Whether the pool's live (not parked) blocks are exactly the n pointers
 * of expected (in any order, repeats ignored): 1 or 0; -EINVAL, -ENOMEM. */
int gmlake_torch_pool_check_live(int device, uint64_t id0, uint64_t id1,
				 void *const *expected, size_t n);
/*
 * Checkpoints (torch.compile's CUDA graph trees): the pool's live blocks
 * (at most n into ptrs; returns how many there are), and their restore:
 * every live block of the pool is parked (its pointer stored in freed, of
 * room cap) and exactly the nkeep blocks of keep, which must still belong
 * to the pool, are live again. Returns the number parked, -ENOSPC (cap too
 * small; nothing changed), -ENOENT (pool, or a block of keep, unknown;
 * nothing changed), -EINVAL.
 */
int gmlake_torch_pool_live(int device, uint64_t id0, uint64_t id1,
			   void **ptrs, size_t n);
int gmlake_torch_pool_restore(int device, uint64_t id0, uint64_t id1,
			      void *const *keep, size_t nkeep, void **freed,
			      size_t cap);
/* Give the parked blocks of a pool without users back (emptyCache of a
 * pool); a pool in use keeps them. 0 or -EINVAL. */
int gmlake_torch_pool_empty(int device, uint64_t id0, uint64_t id1);
/* The pool ptr (a block's start) was allocated into: 1 live, 2 parked, 0
 * none (id gets 0, 0); -EINVAL. */
int gmlake_torch_pool_of(int device, const void *ptr, uint64_t id[2]);
/* Whether allocations go to some pool on device now. */
bool gmlake_torch_pool_routing(int device);
/*
 * A pool's own allocator (torch.cuda.MemPool(allocator=...), NCCL's
 * ncclMemAlloc for buffers it registers): every block allocated into the
 * pool is then a segment of its own from alloc, of the request rounded up
 * to 2 MiB, never libgmlake's memory. A freed block is parked and reused
 * as any pool block is, so a segment keeps its address (and a
 * registration) while the pool lives; free gives it back after the sync
 * hook, when the pool's last user has released it, or at the block's own
 * free once the pool is gone. alloc runs on the allocating thread and
 * returns NULL for no memory; free gets what alloc returned, its size
 * and device; done(user) follows the last free and the pool's end, and
 * may run with a pool lock held. None of them may call libgmlake's pool
 * functions. The segments count in gmlake_torch_stats_get's figures and
 * are listed by gmlake_torch_pool_segments, not by gmlake_stats_get or a
 * context's snapshot.
 *
 * set_source: for a pool with users and no blocks yet; 0 when src is
 * now the pool's (copied), 1 when the pool already has a source (src is
 * not used and done not called for it), or -errno: -EINVAL (bad device,
 * NULL src, alloc or free), -ENOENT (unknown pool, or no users), -EBUSY
 * (the pool holds libgmlake blocks already), -ENOMEM.
 */
struct gmlake_torch_pool_source {
	void *(*alloc)(size_t size, int device, gmlake_stream_t stream,
		       void *user);
	void (*free)(void *ptr, size_t size, int device,
		     gmlake_stream_t stream, void *user);
	void (*done)(void *user);	/* may be NULL */
	void *user;
};
int gmlake_torch_pool_set_source(int device, uint64_t id0, uint64_t id1,
				 const struct gmlake_torch_pool_source *src);

/* A segment from a pool's own allocator, for snapshots. */
struct gmlake_torch_pool_segment {
	uint64_t address;
	uint64_t size;		/* as alloc gave it */
	uint64_t requested;	/* what the block in it asked for */
	uint64_t pool_id[2];
	gmlake_stream_t stream;
	int parked;		/* 1: free to PyTorch's eyes, kept by the pool */
	int reserved;
};
/* The segments of pool (id0, id1) from its own allocator, or of every
 * pool with (0, 0): at most n into segs; returns how many there are, or
 * -EINVAL. */
int gmlake_torch_pool_segments(int device, uint64_t id0, uint64_t id1,
			       struct gmlake_torch_pool_segment *segs,
			       size_t n);

/* Called before the blocks of a released pool are freed: the caller's
 * device-wide synchronize (kernels of a replayed graph may run on any
 * stream). NULL: none; the emulated device needs none. */
void gmlake_torch_set_sync_hook(int (*sync)(int device));

/*
 * Allocation history for memory visualizers (PyTorch's
 * torch.cuda.memory._record_memory_history()): a ring per device of the
 * events of the entry points, PyTorch's trace actions in its order.
 */
enum gmlake_torch_action {
	GMLAKE_TORCH_ALLOC = 0,
	GMLAKE_TORCH_FREE_REQUESTED = 1,
	GMLAKE_TORCH_FREE_COMPLETED = 2,
	GMLAKE_TORCH_SEGMENT_ALLOC = 3,	/* a snapshot range appeared */
	GMLAKE_TORCH_SEGMENT_FREE = 4,	/* ... went */
	GMLAKE_TORCH_SEGMENT_MAP = 5,	/* a range grew by [addr, +size) */
	GMLAKE_TORCH_SEGMENT_UNMAP = 6,	/* a range lost [addr, +size) */
	GMLAKE_TORCH_SNAPSHOT = 7,
	GMLAKE_TORCH_OOM = 8,		/* addr: free device bytes */
	GMLAKE_TORCH_ACTION_COUNT
};

struct gmlake_torch_event {
	uint32_t action;	/* enum gmlake_torch_action */
	int32_t device;
	uint64_t addr;
	uint64_t size;
	gmlake_stream_t stream;
	uint64_t pool_id[2];	/* the private pool, or 0, 0 */
	uint64_t time;		/* hooks.clock(), else CLOCK_REALTIME ns */
	void *context;		/* hooks.context(), or NULL */
};

/* Optional hooks of a history's owner, called without library locks. */
struct gmlake_torch_history_hooks {
	uint64_t (*clock)(void);
	void *(*context)(int action);	/* e.g. a stack trace, or NULL */
	void *(*context_dup)(void *context);	/* for history_read */
	void (*context_free)(void *context);
};

/*
 * Start recording on every device, max_entries events each (older ones
 * drop), leaving out the actions whose bits (1 << action) skip_mask has;
 * clear drops what was recorded. hooks may be NULL; it is copied. Started
 * again, the settings change and the events stay. 0, -EINVAL, -ENOMEM.
 */
int gmlake_torch_history_start(size_t max_entries, uint32_t skip_mask,
			       const struct gmlake_torch_history_hooks *hooks,
			       bool clear);
/* Stop recording (clear: and drop the events). */
void gmlake_torch_history_stop(bool clear);
bool gmlake_torch_history_enabled(void);
/*
 * Copy device's events, oldest first, into ev (n of them at most; their
 * contexts through context_dup, which the caller frees); ev NULL: count
 * only. Returns how many (there are), or -EINVAL.
 */
int gmlake_torch_history_read(int device, struct gmlake_torch_event *ev,
			      size_t n);
/* Record a SNAPSHOT event on device (a snapshot was taken). */
void gmlake_torch_history_mark(int device);

#ifdef __cplusplus
}
#endif

#endif
