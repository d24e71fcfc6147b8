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
 * (any thread) so that the Python side can name the real cause. The C++
 * adapter (python/gmlake/csrc) turns it into PyTorch's OutOfMemoryError.
 *
 * Statistics under PyTorch's names (gmlake_torch_stats_get) come from the
 * context's counters and the few this file keeps (retries, out-of-memory
 * failures, trims). Allocations into a private pool go through
 * torch_pool.c; every entry point records its events in history.c while
 * PyTorch's memory history is on.
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

#include "gmlake-snapshot.h"
#include "gmlake-torch.h"
#include "error.h"
#include "torch.h"
#include "lock.h"
#include "types.h"

static _Atomic(gmlake_ctx *) torch_ctx[GML_TORCH_MAX_DEVICES];
/* Serializes context creation and fractions set before it. */
static pthread_mutex_t torch_lock = PTHREAD_MUTEX_INITIALIZER;
static double torch_fraction[GML_TORCH_MAX_DEVICES];
static bool torch_fraction_set[GML_TORCH_MAX_DEVICES];
static atomic_int torch_device_count = -1;
/* Contexts made, and the highest device that has one, for frees by
 * pointer alone (gmlake_torch_raw_delete). */
static atomic_int torch_nctx;
static atomic_int torch_ctx_top = -1;
static atomic_bool torch_exiting;
static pthread_once_t torch_atexit_once = PTHREAD_ONCE_INIT;

/* What PyTorch counts that a context does not, and where
 * reset_accumulated_memory_stats left every figure. */
struct torch_counts {
	atomic_llong retries, ooms, trims;
};
static struct torch_counts torch_counts[GML_TORCH_MAX_DEVICES];
/* Raw figures at the last reset (allocated: total, freed: total -
 * current), under torch_lock. */
static struct gmlake_torch_stats torch_base[GML_TORCH_MAX_DEVICES];

/* The last failure of any entry point, for every thread. */
static pthread_mutex_t torch_err_lock = PTHREAD_MUTEX_INITIALIZER;
/* Where allocation failures are logged (gmlake_torch_set_fail_level). */
static atomic_int torch_fail_level = GMLAKE_LOG_ERROR;
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
	if (over && gml_trim(ctx, false))
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
	atomic_fetch_add(&torch_nctx, 1);
	if (device > atomic_load(&torch_ctx_top))
		atomic_store(&torch_ctx_top, device);
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

gmlake_ctx *gml_torch_ctx_peek(int device)
{
	if (device < 0 || device >= GML_TORCH_MAX_DEVICES)
		return NULL;
	return atomic_load_explicit(&torch_ctx[device], memory_order_acquire);
}

int gml_torch_ctx_need(int device, gmlake_ctx **ctx)
{
	return get_ctx(device, true, ctx);
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
static int alloc_limited(gmlake_ctx *ctx, int device, size_t size,
			 gmlake_stream_t stream, void **p)
{
	struct torch_state s;
	bool routing;
	int ret;

	if (__atomic_load_n(&ctx->cfg.device_limit, __ATOMIC_RELAXED)) {
		get_state(ctx, &s);
		if (s.limit && (size > s.limit ||
				(size_t)s.allocated > s.limit - size))
			return gml_set_error(-ENOMEM, "the device limit cannot "
					     "hold it next to what is "
					     "allocated");
	}
	/* While a graph captures its streams may not wait on events from
	 * outside the capture: no cross-stream ordering then. */
	routing = gmlake_torch_pool_routing(device);
	if (routing)
		atomic_fetch_add(&ctx->order_off, 1);
	ret = gmlake_alloc(ctx, p, size, stream);
	if (routing)
		atomic_fetch_sub(&ctx->order_off, 1);
	/* A trim waits for every stream: never while a graph captures. */
	if (ret != -ENOMEM || routing)
		return ret;
	atomic_fetch_add(&torch_counts[device].retries, 1);
	atomic_fetch_add(&torch_counts[device].trims, 1);
	if (!gml_trim(ctx, false))
		ret = gmlake_alloc(ctx, p, size, stream);
	return ret;
}

/* Log an out-of-memory failure with the allocator's state. */
static void report_oom(gmlake_ctx *ctx, int device, size_t size)
{
	char cause[256], req[32], alloc[32], res[32], peak[32], lim[32];
	struct torch_state s;

	snprintf(cause, sizeof(cause), "%s", gmlake_last_error());
	atomic_fetch_add(&torch_counts[device].ooms, 1);
	if (gml_history_on()) {
		size_t free_b = 0, total = 0;

		/* With the device's context current: any thread. */
		if (!gml_ctx_lock(ctx)) {
			ctx->dev.ops->mem_info(ctx->dev.priv, &free_b, &total);
			gml_ctx_unlock(ctx);
		}
		gml_history_add(device, GMLAKE_TORCH_OOM, free_b, size, NULL,
				0, 0);
	}
	get_state(ctx, &s);
	if (s.limit)
		fmt_bytes(lim, sizeof(lim), (double)s.limit);
	else
		snprintf(lim, sizeof(lim), "none");
	torch_fail(-ENOMEM, atomic_load(&torch_fail_level),
		   "device %d: out of memory allocating %s (%zu bytes): %s "
		   "allocated, %s reserved (peak %s), device limit %s; cause: "
		   "%s", device, fmt_bytes(req, sizeof(req), (double)size), size,
		   fmt_bytes(alloc, sizeof(alloc), (double)s.allocated),
		   fmt_bytes(res, sizeof(res), (double)s.reserved),
		   fmt_bytes(peak, sizeof(peak), (double)s.reserved_peak), lim,
		   cause);
}

int gml_torch_oom(int device, size_t size, const char *cause)
{
	char req[32];

	atomic_fetch_add(&torch_counts[device].ooms, 1);
	if (gml_history_on())
		gml_history_add(device, GMLAKE_TORCH_OOM, 0, size, NULL, 0, 0);
	return torch_fail(-ENOMEM, atomic_load(&torch_fail_level),
			  "device %d: out of memory allocating %s (%zu bytes): "
			  "%s", device, fmt_bytes(req, sizeof(req),
						  (double)size), size, cause);
}

/* The allocator's size for the block at p (what it handed out). */
static size_t handed_out(gmlake_ctx *ctx, void *p, size_t size)
{
	const struct gml_block *b;

	pthread_mutex_lock(&ctx->lock);
	b = gml_ptrmap_get(&ctx->blocks, (uintptr_t)p);
	if (b)
		size = b->alloc_size;
	pthread_mutex_unlock(&ctx->lock);
	return size;
}

void *gml_torch_alloc_in(size_t size, int device, gmlake_stream_t stream,
			 size_t *alloc_size)
{
	int level = atomic_load(&torch_fail_level);
	gmlake_ctx *ctx;
	void *p = NULL;
	int ret;

	/* PyTorch's own allocator gives size 0 no memory either. */
	if (!size)
		return NULL;
	ret = get_ctx(device, true, &ctx);
	if (ret) {
		torch_fail(ret, level, "device %d: no libgmlake context to "
			   "allocate %zu bytes: %s", device, size,
			   gmlake_last_error());
		return NULL;
	}
	ret = alloc_limited(ctx, device, size, stream, &p);
	if (ret == -ENOMEM)
		report_oom(ctx, device, size);
	else if (ret)
		torch_fail(ret, level, "device %d: allocating %zu bytes "
			   "failed: %s", device, size, gmlake_last_error());
	if (ret)
		return NULL;
	if (alloc_size)
		*alloc_size = handed_out(ctx, p, size);
	if (gml_history_on())
		gml_history_segments(device, ctx);
	return p;
}

GML_EXPORT void *gmlake_torch_alloc(size_t size, int device,
				    gmlake_stream_t stream)
{
	void *p = gml_torch_alloc_in(size, device, stream, NULL);

	if (p && gml_history_on())
		gml_history_add(device, GMLAKE_TORCH_ALLOC, (uintptr_t)p,
				size, stream, 0, 0);
	return p;
}

void gml_torch_free_now(void *ptr, size_t size, int device,
			const uint64_t pool[2])
{
	int level = atomic_load(&torch_exiting) ? GMLAKE_LOG_DEBUG :
						   GMLAKE_LOG_WARN;
	gmlake_ctx *ctx;
	size_t asked = size;
	int ret;

	ret = get_ctx(device, false, &ctx);
	if (ret) {
		torch_fail(ret, level, "device %d: free of %p (%zu bytes) "
			   "ignored: %s", device, ptr, size, gmlake_last_error());
		return;
	}
	if (gml_history_on() && gmlake_block_size(ctx, ptr, &asked))
		asked = size;
	gml_torch_ipc_forget(ptr);
	ret = gmlake_free(ctx, ptr);
	if (ret) {
		torch_fail(ret, level, "device %d: free of %p (%zu bytes) "
			   "ignored: %s", device, ptr, size, gmlake_last_error());
		return;
	}
	if (gml_history_on()) {
		gml_history_add(device, GMLAKE_TORCH_FREE_REQUESTED,
				(uintptr_t)ptr, asked, NULL, pool[0], pool[1]);
		gml_history_add(device, GMLAKE_TORCH_FREE_COMPLETED,
				(uintptr_t)ptr, asked, NULL, pool[0], pool[1]);
		gml_history_segments(device, ctx);
	}
}

GML_EXPORT void gmlake_torch_free(void *ptr, size_t size, int device,
				  gmlake_stream_t stream)
{
	static const uint64_t no_pool[2];

	(void)stream;	/* the block remembers its own */
	if (!ptr)
		return;
	if (check_device(device)) {
		torch_fail(-EINVAL, GMLAKE_LOG_WARN, "free of %p ignored: %s",
			   ptr, gmlake_last_error());
		return;
	}
	if (gml_pool_free(device, ptr))
		return;
	gml_torch_free_now(ptr, size, device, no_pool);
}

/*
 * The device whose context holds the block at ptr, or -1: with one
 * context, that one (its free says if ptr is no block); else a lookup
 * in each context's block map (no scan of its blocks).
 */
static int owner_device(const void *ptr)
{
	int top = atomic_load(&torch_ctx_top);

	for (int d = 0; d <= top; d++) {
		gmlake_ctx *ctx = gml_torch_ctx_peek(d);
		bool found;

		if (!ctx)
			continue;
		if (atomic_load(&torch_nctx) == 1)
			return d;
		pthread_mutex_lock(&ctx->lock);
		found = gml_ptrmap_get(&ctx->blocks, (uintptr_t)ptr) != NULL;
		pthread_mutex_unlock(&ctx->lock);
		if (found)
			return d;
	}
	return -1;
}

GML_EXPORT void gmlake_torch_raw_delete(void *ptr)
{
	int level = atomic_load(&torch_exiting) ? GMLAKE_LOG_DEBUG :
						   GMLAKE_LOG_WARN;
	int device;

	if (!ptr)
		return;
	device = owner_device(ptr);
	if (device < 0)		/* a pool's own segment, or nothing */
		device = gml_pool_source_device(ptr);
	if (device < 0) {
		torch_fail(-EINVAL, level, "free of %p ignored: no device's "
			   "context holds it (never allocated here, or already "
			   "freed)", ptr);
		return;
	}
	gmlake_torch_free(ptr, 0, device, NULL);
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

		if (!ctx)
			continue;
		if (gmlake_torch_pool_routing(i)) {
			gml_log(GMLAKE_LOG_DEBUG, "torch: device %d: "
				"empty_cache skipped while a private pool "
				"takes allocations (graph capture)", i);
			continue;
		}
		gml_pool_empty_unused(i);
		atomic_fetch_add(&torch_counts[i].trims, 1);
		if (gmlake_trim(ctx))
			torch_fail(-EIO, GMLAKE_LOG_WARN, "device %d: "
				   "empty_cache: %s", i, gmlake_last_error());
		if (gml_history_on())
			gml_history_segments(i, ctx);
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
	int src_dev;

	for (int i = 0; i < GML_TORCH_MAX_DEVICES; i++) {
		gmlake_ctx *ctx = atomic_load_explicit(&torch_ctx[i],
						       memory_order_acquire);

		if (!ctx || gmlake_block_size(ctx, ptr, &size))
			continue;
		gml_pool_record_stream(i, ptr);
		if (gmlake_record_stream(ctx, ptr, stream))
			torch_fail(-EINVAL, GMLAKE_LOG_WARN, "device %d: "
				   "record_stream(%p): %s", i, ptr,
				   gmlake_last_error());
		return;
	}
	src_dev = gml_pool_source_device(ptr);
	if (src_dev >= 0) {
		/* A pool's own segment: never reused inside its pool. */
		gml_pool_record_stream(src_dev, ptr);
		return;
	}
	torch_fail(-EINVAL, GMLAKE_LOG_WARN, "record_stream: %p is not a live "
		   "libgmlake block; ignored", ptr);
}

GML_EXPORT int gmlake_torch_long_lived(int device, int on)
{
	gmlake_ctx *ctx;
	int ret = get_ctx(device, true, &ctx);

	return ret ? ret : gmlake_long_lived(ctx, on != 0);
}

GML_EXPORT int gmlake_torch_grow_slack(int device, int permille)
{
	gmlake_ctx *ctx;
	int ret = get_ctx(device, true, &ctx);

	return ret ? ret : gmlake_grow_slack(ctx, permille);
}

GML_EXPORT int gmlake_torch_peer_access(int device, int peer)
{
	gmlake_ctx *ctx;
	int ret = get_ctx(device, true, &ctx);

	return ret ? ret : gmlake_peer_access(ctx, peer);
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

/* Every context destroyed, fractions and errors forgotten. */
static int torch_reset_contexts(void)
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
	atomic_store(&torch_nctx, 0);
	atomic_store(&torch_ctx_top, -1);
	return ret;
}

int gml_torch_reset(void)
{
	int ret;

	gml_history_reset();
	gml_pool_reset();
	gml_torch_ipc_reset();
	ret = torch_reset_contexts();
	atomic_store(&torch_fail_level, GMLAKE_LOG_ERROR);
	for (int i = 0; i < GML_TORCH_MAX_DEVICES; i++) {
		atomic_store(&torch_counts[i].retries, 0);
		atomic_store(&torch_counts[i].ooms, 0);
		atomic_store(&torch_counts[i].trims, 0);
		memset(&torch_base[i], 0, sizeof(torch_base[i]));
	}
	return ret;
}

GML_EXPORT void gmlake_torch_set_fail_level(int level)
{
	if (level < GMLAKE_LOG_ERROR)
		level = GMLAKE_LOG_ERROR;
	if (level > GMLAKE_LOG_DEBUG)
		level = GMLAKE_LOG_DEBUG;
	atomic_store(&torch_fail_level, level);
}

GML_EXPORT int gmlake_torch_memory_fraction_get(int device, double *fraction)
{
	int ret = check_device(device);

	if (ret)
		return ret;
	if (!fraction)
		return gml_set_error(-EINVAL, "gmlake_torch_memory_fraction_get"
				     ": fraction is NULL");
	pthread_mutex_lock(&torch_lock);
	*fraction = torch_fraction_set[device] ? torch_fraction[device] : 1.0;
	pthread_mutex_unlock(&torch_lock);
	return 0;
}

/*
 * One of PyTorch's Stats from a gauge: current and peak less adj (bytes
 * or blocks parked in private pools, free to PyTorch's eyes), allocated
 * and freed since the last reset (base).
 */
static void torch_stat(struct gmlake_torch_stat *out,
		       const struct gmlake_stat *g,
		       const struct gmlake_torch_stat *base, int64_t adj)
{
	out->current = g->current - adj;
	out->peak = g->peak > out->current ? g->peak : out->current;
	out->allocated = g->total - base->allocated;
	out->freed = g->total - g->current - base->freed + adj;
}

/* The raw figures reset_accumulated starts again from. */
static void torch_raw(const struct gmlake_stats *g,
		      struct gmlake_torch_stats *raw, int64_t retries,
		      int64_t ooms, int64_t trims)
{
#define RAW(dst, src)							\
	raw->dst.allocated = g->src.total;				\
	raw->dst.freed = g->src.total - g->src.current;
	RAW(allocation, active_blocks)
	RAW(segment, chunks)
	RAW(active, active_blocks)
	RAW(allocated_bytes, allocated_bytes)
	RAW(reserved_bytes, reserved_bytes)
	RAW(active_bytes, allocated_bytes)
	RAW(requested_bytes, requested_bytes)
#undef RAW
	raw->num_alloc_retries = retries;
	raw->num_ooms = ooms;
	raw->num_sync_all_streams = trims;
	raw->num_device_alloc = (int64_t)g->calls[GMLAKE_CALL_mem_create];
	raw->num_device_free = (int64_t)g->calls[GMLAKE_CALL_mem_release];
}

static void stat_add(struct gmlake_stat *g, const struct gmlake_stat *more)
{
	g->current += more->current;
	g->peak += more->peak;		/* at most: peaks of two gauges */
	g->total += more->total;
}

/* device's figures: its context's, if it has one, and those of the
 * segments pools' own allocators gave (one block each). */
static int torch_figures(int device, struct gmlake_stats *g)
{
	struct gmlake_stat segs, bytes, req;
	gmlake_ctx *ctx = gml_torch_ctx_peek(device);
	int ret = ctx ? gmlake_stats_get(ctx, g) : 0;

	if (ret)
		return ret;
	gml_pool_source_stats(device, &segs, &bytes, &req);
	stat_add(&g->active_blocks, &segs);
	stat_add(&g->chunks, &segs);
	stat_add(&g->allocated_bytes, &bytes);
	stat_add(&g->reserved_bytes, &bytes);
	stat_add(&g->requested_bytes, &req);
	return 0;
}

GML_EXPORT int gmlake_torch_stats_get(int device,
				      struct gmlake_torch_stats *st)
{
	struct gmlake_stats g = { .version = GMLAKE_STATS_VERSION,
				  .size = sizeof(g) };
	struct gmlake_torch_stats base;
	int64_t nparked, preq, palloc;
	int ret = check_device(device);

	if (ret)
		return ret;
	if (!st || st->version != GMLAKE_TORCH_STATS_VERSION ||
	    st->size != sizeof(*st))
		return gml_set_error(-EINVAL, "gmlake_torch_stats_get: %s; "
				     "this library has version %u size %zu",
				     st ? "version or size unknown" :
				     "st is NULL", GMLAKE_TORCH_STATS_VERSION,
				     sizeof(*st));
	memset((char *)st + 8, 0, sizeof(*st) - 8);
	ret = torch_figures(device, &g);
	if (ret)
		return ret;
	pthread_mutex_lock(&torch_lock);
	base = torch_base[device];
	pthread_mutex_unlock(&torch_lock);
	gml_pool_parked(device, &nparked, &preq, &palloc);
	torch_stat(&st->allocation, &g.active_blocks, &base.allocation,
		   nparked);
	torch_stat(&st->segment, &g.chunks, &base.segment, 0);
	torch_stat(&st->active, &g.active_blocks, &base.active, nparked);
	torch_stat(&st->allocated_bytes, &g.allocated_bytes,
		   &base.allocated_bytes, palloc);
	torch_stat(&st->reserved_bytes, &g.reserved_bytes,
		   &base.reserved_bytes, 0);
	torch_stat(&st->active_bytes, &g.allocated_bytes, &base.active_bytes,
		   palloc);
	torch_stat(&st->requested_bytes, &g.requested_bytes,
		   &base.requested_bytes, preq);
	st->num_alloc_retries = atomic_load(&torch_counts[device].retries) -
				base.num_alloc_retries;
	st->num_ooms = atomic_load(&torch_counts[device].ooms) -
		       base.num_ooms;
	st->num_sync_all_streams = atomic_load(&torch_counts[device].trims) -
				   base.num_sync_all_streams;
	st->num_device_alloc = (int64_t)g.calls[GMLAKE_CALL_mem_create] -
			       base.num_device_alloc;
	st->num_device_free = (int64_t)g.calls[GMLAKE_CALL_mem_release] -
			      base.num_device_free;
	return 0;
}

GML_EXPORT int gmlake_torch_stats_reset_peaks(int device)
{
	int ret = check_device(device);
	gmlake_ctx *ctx;

	if (ret)
		return ret;
	gml_pool_source_reset_peaks(device);
	ctx = gml_torch_ctx_peek(device);
	return ctx ? gmlake_stats_reset_peaks(ctx) : 0;
}

GML_EXPORT int gmlake_torch_stats_reset_accumulated(int device)
{
	struct gmlake_stats g = { .version = GMLAKE_STATS_VERSION,
				  .size = sizeof(g) };
	struct gmlake_torch_stats raw;
	int ret = check_device(device);

	if (ret)
		return ret;
	ret = torch_figures(device, &g);
	if (ret)
		return ret;
	memset(&raw, 0, sizeof(raw));
	torch_raw(&g, &raw, atomic_load(&torch_counts[device].retries),
		  atomic_load(&torch_counts[device].ooms),
		  atomic_load(&torch_counts[device].trims));
	pthread_mutex_lock(&torch_lock);
	torch_base[device] = raw;
	pthread_mutex_unlock(&torch_lock);
	return 0;
}

GML_EXPORT int gmlake_torch_cache_info(int device, size_t *largest)
{
	int ret = check_device(device);
	gmlake_ctx *ctx;

	if (ret)
		return ret;
	if (!largest)
		return gml_set_error(-EINVAL, "gmlake_torch_cache_info: "
				     "largest is NULL");
	*largest = 0;
	ctx = gml_torch_ctx_peek(device);
	return ctx ? gmlake_cache_info(ctx, NULL, largest) : 0;
}
