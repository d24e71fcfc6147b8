/* SPDX-License-Identifier: MIT */
/*
 * Internals of the PyTorch entry points: torch.c (contexts, allocation,
 * statistics), torch_pool.c (private pools) and history.c (the event
 * rings), for each other and for tests.
 */
#ifndef GML_TORCH_H
#define GML_TORCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gmlake.h"
#include "gmlake-stats.h"
#include "gmlake-torch.h"

/* Device ordinals served; PyTorch's DeviceIndex is an int8_t. */
#define GML_TORCH_MAX_DEVICES 128

/* "torch.c" */
/* The device count PyTorch gave gmlake_torch_init(), or -1. */
int gml_torch_device_count(void);
/*
 * Destroy every device's context (live blocks die with it) and forget the
 * fractions, errors, pools and history: the state of a fresh process, so
 * that tests can run one after another in one process (CK_FORK=no). 0, or
 * -EIO if a context did not destroy cleanly.
 */
int gml_torch_reset(void);
/* device's context, made now if it has none yet. 0 or -errno. */
int gml_torch_ctx_need(int device, gmlake_ctx **ctx);
/* device's context if it has one (no error set), else NULL. */
gmlake_ctx *gml_torch_ctx_peek(int device);
/* gmlake_torch_alloc() that also says the context and what was handed out
 * (alloc_size may be NULL). */
void *gml_torch_alloc_in(size_t size, int device, gmlake_stream_t stream,
			 size_t *alloc_size);
/* An allocation of size on device failed for want of memory (cause):
 * counted as PyTorch counts it, and the error set; -ENOMEM. */
int gml_torch_oom(int device, size_t size, const char *cause);
/* Free ptr for real (no pool), with its history events and errors. */
void gml_torch_free_now(void *ptr, size_t size, int device,
			const uint64_t pool[2]);

/* "torch_ipc.c" */
/* ptr is being freed: close the descriptors its shares kept open. */
void gml_torch_ipc_forget(const void *ptr);
/* Close every share's descriptors (gml_torch_reset). */
void gml_torch_ipc_reset(void);

/* "torch_pool.c" */
/* ptr was allocated into a live or released pool: parked or freed, and
 * true; false for any other pointer. */
bool gml_pool_free(int device, void *ptr);
/* record_stream on ptr: if it is a pool block, it is never reused inside
 * its pool (its other stream's work is not ordered with the pool's). */
void gml_pool_record_stream(int device, void *ptr);
/* What parked blocks of device hold: count, asked-for and handed-out bytes. */
void gml_pool_parked(int device, int64_t *n, int64_t *requested,
		     int64_t *allocated);
/* The device of the pool segment from a pool's own allocator at ptr, or
 * -1 (gmlake_torch_pool_set_source). */
int gml_pool_source_device(const void *ptr);
/* What the segments of pools' own allocators on device hold: segments,
 * bytes, bytes asked for (gauges with their peaks). */
void gml_pool_source_stats(int device, struct gmlake_stat *segs,
			   struct gmlake_stat *bytes, struct gmlake_stat *req);
void gml_pool_source_reset_peaks(int device);
/* Free the parked blocks of device's pools without users; for emptyCache. */
void gml_pool_empty_unused(int device);
void gml_pool_reset(void);

/* "history.c" */
bool gml_history_on(void);
void gml_history_add(int device, int action, uint64_t addr, uint64_t size,
		     gmlake_stream_t stream, uint64_t id0, uint64_t id1);
/* After an operation on ctx: segment events for ranges that came or went. */
void gml_history_segments(int device, gmlake_ctx *ctx);
void gml_history_reset(void);

#endif
