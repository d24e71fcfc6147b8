/* SPDX-License-Identifier: MIT */
/*
 * PyTorch's pluggable allocator on top of the public API.
 *
 * PyTorch calls alloc and free by name, from whatever thread runs the
 * operator: the Python thread, autograd's device threads (backward),
 * DataLoader pin threads. Every call may come from a thread that has never
 * seen CUDA; each context operation makes the device's primary context
 * current for its duration (drv_cuda.c enter/leave), so a fresh thread
 * works like any other.
 *
 * One context per device, created by the first allocation on that device
 * and kept for the life of the process: PyTorch frees tensors until the
 * very end, so there is no safe moment to destroy it.
 *
 * PyTorch does not check what alloc returns: a NULL for a non-zero size
 * becomes a tensor without data, and the user sees "The tensor has a
 * non-zero number of elements, but its data is not allocated yet" at its
 * first use. So every failure here is logged to stderr at once, with the
 * request size and the allocator's state, and kept for gmlake_torch_error()
 * (any thread) so that the Python side can name the real cause.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gmlake-torch.h"
#include "error.h"
#include "torch.h"
#include "types.h"

/* Device ordinals served; PyTorch's DeviceIndex is an int8_t. */
#define GML_TORCH_MAX_DEVICES 128

static _Atomic(gmlake_ctx *) torch_ctx[GML_TORCH_MAX_DEVICES];
/* Serializes context creation and fractions set before it. */
static pthread_mutex_t torch_lock = PTHREAD_MUTEX_INITIALIZER;
static double torch_fraction[GML_TORCH_MAX_DEVICES];
static bool torch_fraction_set[GML_TORCH_MAX_DEVICES];
static atomic_int torch_device_count = -1;
static atomic_bool torch_exiting;
static pthread_once_t torch_atexit_once = PTHREAD_ONCE_INIT;

/* The last failure of any entry point, for every thread. */
static pthread_mutex_t torch_err_lock = PTHREAD_MUTEX_INITIALIZER;
static char torch_err[768];
static int torch_nerr;

/*
 * Record a failure: the calling thread's gmlake_last_error(), the shared
 * record, and stderr at level. Returns err.
 */
__attribute__((format(printf, 3, 4)))
static int torch_fail(int err, int level, const char *fmt, ...)
{
	char msg[sizeof(torch_err)];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	gml_set_error(err, "%s", msg);
	pthread_mutex_lock(&torch_err_lock);
	memcpy(torch_err, msg, sizeof(torch_err));
	if (torch_nerr < INT32_MAX)
		torch_nerr++;
	pthread_mutex_unlock(&torch_err_lock);
	gml_log(level, "%s", msg);
	return err;
}

/* "1.50 GiB": bytes for people. */
static const char *fmt_bytes(char *buf, size_t len, double v)
{
	static const char *const unit[] = { "B", "KiB", "MiB", "GiB", "TiB" };
	int u = 0;

	while (v >= 1024 && u < 4) {
		v /= 1024;
		u++;
	}
	snprintf(buf, len, u ? "%.2f %s" : "%.0f %s", v, unit[u]);
	return buf;
}

/*
 * At exit: PyTorch may still free tensors afterwards, while the driver
 * shuts down; failures then are expected and logged only for debugging.
 * Print each context's summary if GMLAKE_SHOW_STATS asked for it (the
 * contexts are never destroyed, so gmlake_ctx_destroy never prints it).
 */
static void torch_atexit(void)
{
	atomic_store(&torch_exiting, true);
	for (int i = 0; i < GML_TORCH_MAX_DEVICES; i++) {
		gmlake_ctx *ctx = atomic_load(&torch_ctx[i]);

		if (ctx && ctx->cfg.show_stats)
			gmlake_stats_print(ctx, 2, false);
	}
}

static void torch_register_atexit(void)
{
	if (atexit(torch_atexit))
		gml_log(GMLAKE_LOG_WARN, "torch: atexit failed; stats at exit "
			"will be missing");
}

static int check_device(int device)
{
	if (device < 0 || device >= GML_TORCH_MAX_DEVICES)
		return gml_set_error(-EINVAL, "device %d out of range [0, %d)",
				     device, GML_TORCH_MAX_DEVICES);
	return 0;
}

/*
 * Set ctx's device limit to fraction of its memory, under its lock; a
 * cache left over the new limit is given back at once.
 */
static void apply_fraction(gmlake_ctx *ctx, double fraction)
{
	size_t limit;
	bool over;

	pthread_mutex_lock(&ctx->lock);
	limit = (size_t)(fraction * (double)ctx->dev_total);
	__atomic_store_n(&ctx->cfg.device_limit, limit ? limit : 1,
			 __ATOMIC_RELAXED);
	over = (size_t)ctx->st.reserved_bytes.current > limit;
	pthread_mutex_unlock(&ctx->lock);
	if (over && gmlake_trim(ctx))
		gml_log(GMLAKE_LOG_WARN, "torch: giving the cache back under "
			"the new device limit: %s", gmlake_last_error());
}

/* Create device's context, or find it created by another thread. */
static int ctx_create(int device, gmlake_ctx **out)
{
	struct gmlake_config cfg;
	gmlake_ctx *ctx;
	int ret;

	pthread_mutex_lock(&torch_lock);
	ctx = atomic_load_explicit(&torch_ctx[device], memory_order_acquire);
	if (ctx)
		goto out_unlock;
	ret = gmlake_config_init(&cfg);
	if (ret)
		goto out_fail;
	cfg.device = device;
	ret = gmlake_ctx_init(&ctx, &cfg);
	if (ret)
		goto out_fail;
	if (torch_fraction_set[device])
		apply_fraction(ctx, torch_fraction[device]);
	atomic_store_explicit(&torch_ctx[device], ctx, memory_order_release);
	gml_log(GMLAKE_LOG_DEBUG, "torch: device %d: context created", device);
out_unlock:
	pthread_mutex_unlock(&torch_lock);
	pthread_once(&torch_atexit_once, torch_register_atexit);
	*out = ctx;
	return 0;
out_fail:
	pthread_mutex_unlock(&torch_lock);
	return ret;
}

/* device's context; created on first use when create is true. */
static int get_ctx(int device, bool create, gmlake_ctx **out)
{
	gmlake_ctx *ctx;
	int ret = check_device(device);

	if (ret)
		return ret;
	ctx = atomic_load_explicit(&torch_ctx[device], memory_order_acquire);
	if (ctx) {
		*out = ctx;
		return 0;
	}
	if (!create)
		return gml_set_error(-ENOENT, "device %d: nothing was allocated "
				     "through libgmlake on it yet", device);
	return ctx_create(device, out);
}

GML_EXPORT int gmlake_torch_ctx_get(int device, gmlake_ctx **ctx)
{
	if (!ctx)
		return gml_set_error(-EINVAL, "gmlake_torch_ctx_get: ctx is "
				     "NULL");
	return get_ctx(device, false, ctx);
}

/* A snapshot of what the OOM message reports, under the context's lock. */
struct torch_state {
	size_t limit;
	int64_t allocated, reserved, reserved_peak;
};

static void get_state(gmlake_ctx *ctx, struct torch_state *s)
{
	pthread_mutex_lock(&ctx->lock);
	s->limit = ctx->cfg.device_limit;
	s->allocated = ctx->st.allocated_bytes.current;
	s->reserved = ctx->st.reserved_bytes.current;
	s->reserved_peak = ctx->st.reserved_bytes.peak;
	pthread_mutex_unlock(&ctx->lock);
}

/*
 * gmlake_alloc under the context's device limit (cfg.device_limit, from
 * GMLAKE_DEVICE_LIMIT or the memory fraction), which the allocator never
 * grows past. A request that cannot fit beside what is allocated fails at
 * once; out of memory gets one retry after a trim, as in PyTorch.
 */
static int alloc_limited(gmlake_ctx *ctx, size_t size, gmlake_stream_t stream,
			 void **p)
{
	struct torch_state s;
	int ret;

	if (__atomic_load_n(&ctx->cfg.device_limit, __ATOMIC_RELAXED)) {
		get_state(ctx, &s);
		if (s.limit && (size > s.limit ||
				(size_t)s.allocated > s.limit - size))
			return gml_set_error(-ENOMEM, "the device limit cannot "
					     "hold it next to what is "
					     "allocated");
	}
	ret = gmlake_alloc(ctx, p, size, stream);
	if (ret == -ENOMEM && !gmlake_trim(ctx))
		ret = gmlake_alloc(ctx, p, size, stream);
	return ret;
}

/* Log an out-of-memory failure with the allocator's state. */
static void report_oom(gmlake_ctx *ctx, int device, size_t size)
{
	char cause[256], req[32], alloc[32], res[32], peak[32], lim[32];
	struct torch_state s;

	snprintf(cause, sizeof(cause), "%s", gmlake_last_error());
	get_state(ctx, &s);
	if (s.limit)
		fmt_bytes(lim, sizeof(lim), (double)s.limit);
	else
		snprintf(lim, sizeof(lim), "none");
	torch_fail(-ENOMEM, GMLAKE_LOG_ERROR,
		   "device %d: out of memory allocating %s (%zu bytes): %s "
		   "allocated, %s reserved (peak %s), device limit %s; cause: "
		   "%s", device, fmt_bytes(req, sizeof(req), (double)size), size,
		   fmt_bytes(alloc, sizeof(alloc), (double)s.allocated),
		   fmt_bytes(res, sizeof(res), (double)s.reserved),
		   fmt_bytes(peak, sizeof(peak), (double)s.reserved_peak), lim,
		   cause);
}

GML_EXPORT void *gmlake_torch_alloc(size_t size, int device,
				    gmlake_stream_t stream)
{
	gmlake_ctx *ctx;
	void *p = NULL;
	int ret;

	/* PyTorch's own allocator gives size 0 no memory either. */
	if (!size)
		return NULL;
	ret = get_ctx(device, true, &ctx);
	if (ret) {
		torch_fail(ret, GMLAKE_LOG_ERROR, "device %d: no libgmlake "
			   "context to allocate %zu bytes: %s", device, size,
			   gmlake_last_error());
		return NULL;
	}
	ret = alloc_limited(ctx, size, stream, &p);
	if (ret == -ENOMEM)
		report_oom(ctx, device, size);
	else if (ret)
		torch_fail(ret, GMLAKE_LOG_ERROR, "device %d: allocating %zu "
			   "bytes failed: %s", device, size, gmlake_last_error());
	return ret ? NULL : p;
}

GML_EXPORT void gmlake_torch_free(void *ptr, size_t size, int device,
				  gmlake_stream_t stream)
{
	int level = atomic_load(&torch_exiting) ? GMLAKE_LOG_DEBUG :
						   GMLAKE_LOG_WARN;
	gmlake_ctx *ctx;
	int ret;

	(void)stream;	/* the block remembers its own */
	if (!ptr)
		return;
	ret = get_ctx(device, false, &ctx);
	if (ret) {
		torch_fail(ret, level, "device %d: free of %p (%zu bytes) "
			   "ignored: %s", device, ptr, size, gmlake_last_error());
		return;
	}
	ret = gmlake_free(ctx, ptr);
	if (ret)
		torch_fail(ret, level, "device %d: free of %p (%zu bytes) "
			   "ignored: %s", device, ptr, size, gmlake_last_error());
}

GML_EXPORT void gmlake_torch_init(int device_count)
{
	atomic_store(&torch_device_count, device_count);
	gml_log(GMLAKE_LOG_DEBUG, "torch: init, %d devices", device_count);
}

GML_EXPORT void gmlake_torch_empty_cache(void)
{
	for (int i = 0; i < GML_TORCH_MAX_DEVICES; i++) {
		gmlake_ctx *ctx = atomic_load_explicit(&torch_ctx[i],
						       memory_order_acquire);

		if (ctx && gmlake_trim(ctx))
			torch_fail(-EIO, GMLAKE_LOG_WARN, "device %d: "
				   "empty_cache: %s", i, gmlake_last_error());
	}
}

GML_EXPORT void gmlake_torch_memory_fraction(double fraction, int device)
{
	gmlake_ctx *ctx;

	if (check_device(device)) {
		torch_fail(-EINVAL, GMLAKE_LOG_ERROR, "memory fraction: %s",
			   gmlake_last_error());
		return;
	}
	if (!(fraction >= 0 && fraction <= 1)) {
		torch_fail(-EINVAL, GMLAKE_LOG_ERROR, "device %d: memory "
			   "fraction %g is not within [0, 1]; ignored", device,
			   fraction);
		return;
	}
	pthread_mutex_lock(&torch_lock);
	ctx = atomic_load_explicit(&torch_ctx[device], memory_order_acquire);
	if (ctx)
		apply_fraction(ctx, fraction);
	else {
		torch_fraction[device] = fraction;
		torch_fraction_set[device] = true;
	}
	pthread_mutex_unlock(&torch_lock);
}

GML_EXPORT void gmlake_torch_record_stream(void *ptr, gmlake_stream_t stream)
{
	size_t size;

	for (int i = 0; i < GML_TORCH_MAX_DEVICES; i++) {
		gmlake_ctx *ctx = atomic_load_explicit(&torch_ctx[i],
						       memory_order_acquire);

		if (!ctx || gmlake_block_size(ctx, ptr, &size))
			continue;
		if (gmlake_record_stream(ctx, ptr, stream))
			torch_fail(-EINVAL, GMLAKE_LOG_WARN, "device %d: "
				   "record_stream(%p): %s", i, ptr,
				   gmlake_last_error());
		return;
	}
	torch_fail(-EINVAL, GMLAKE_LOG_WARN, "record_stream: %p is not a live "
		   "libgmlake block; ignored", ptr);
}

GML_EXPORT int gmlake_torch_error(char *buf, size_t size)
{
	int n;

	if (!buf || !size)
		return gml_set_error(-EINVAL, "gmlake_torch_error: %s",
				     buf ? "size 0" : "buf is NULL");
	pthread_mutex_lock(&torch_err_lock);
	snprintf(buf, size, "%s", torch_err);
	n = torch_nerr;
	pthread_mutex_unlock(&torch_err_lock);
	return n;
}

int gml_torch_device_count(void)
{
	return atomic_load(&torch_device_count);
}

int gml_torch_reset(void)
{
	int ret = 0;

	pthread_mutex_lock(&torch_lock);
	for (int i = 0; i < GML_TORCH_MAX_DEVICES; i++) {
		gmlake_ctx *ctx = atomic_exchange(&torch_ctx[i], NULL);

		if (ctx && gmlake_ctx_destroy(ctx, true))
			ret = -EIO;
		torch_fraction[i] = 0;
		torch_fraction_set[i] = false;
	}
	pthread_mutex_unlock(&torch_lock);
	pthread_mutex_lock(&torch_err_lock);
	torch_err[0] = '\0';
	torch_nerr = 0;
	pthread_mutex_unlock(&torch_err_lock);
	atomic_store(&torch_device_count, -1);
	return ret;
}
