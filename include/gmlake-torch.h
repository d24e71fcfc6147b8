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

#include <stddef.h>

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

/* Optional hooks (CUDAPluggableAllocator.allocator().set_*_fn). */
void gmlake_torch_init(int device_count);
/* torch.cuda.empty_cache(): gmlake_trim() on every device's context. */
void gmlake_torch_empty_cache(void);
/* torch.cuda.set_per_process_memory_fraction(): a device limit of
 * fraction times the device's memory (0 < fraction <= 1). */
void gmlake_torch_memory_fraction(double fraction, int device);
/* Tensor.record_stream(): gmlake_record_stream() on the owning context. */
void gmlake_torch_record_stream(void *ptr, gmlake_stream_t stream);

/*
 * The context serving device (for gmlake_stats_get() and friends; owned
 * by the library, never destroy it). -ENOENT when nothing was allocated
 * on device yet, -EINVAL for a bad device.
 */
int gmlake_torch_ctx_get(int device, gmlake_ctx **ctx);
/*
 * The message of the last failure of any gmlake_torch_* call, in any
 * thread, copied to buf (cut to size, NUL-terminated). Returns how many
 * failures there have been so far (0: none, buf gets ""), or -EINVAL.
 */
int gmlake_torch_error(char *buf, size_t size);

#ifdef __cplusplus
}
#endif

#endif
