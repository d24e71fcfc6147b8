/* SPDX-License-Identifier: MIT */
/*
 * The device wrapper: every driver operation of the library (allocator,
 * context and offload manager) goes through here to be counted, timed, and
 * failed on purpose when a test armed a fault.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "drv.h"
#include "error.h"

uint64_t gml_now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The first row is the default: a real user without a GPU gets -ENODEV
 * from the driver, never a silent emulation. */
static const struct gml_backend backends[] = {
	{ GMLAKE_BACKEND_CUDA, "cuda", &gml_drv_cuda },
	{ GMLAKE_BACKEND_EMU, "emu", &gml_drv_emu },
};

#define NBACKENDS (sizeof(backends) / sizeof(backends[0]))

const struct gml_backend *gml_backend_by_id(int id)
{
	for (size_t i = 0; i < NBACKENDS; i++)
		if (backends[i].id == id)
			return &backends[i];
	return NULL;
}

const struct gml_backend *gml_backend_by_name(const char *name)
{
	for (size_t i = 0; i < NBACKENDS; i++)
		if (!strcasecmp(backends[i].name, name))
			return &backends[i];
	return NULL;
}

const struct gml_backend *gml_backend_default(void)
{
	return &backends[0];
}

/* Open the backend cfg->backend names (a row of the table, never the
 * default: gmlake_ctx_init resolves that first). */
int gml_dev_open(struct gml_dev *dev, const struct gmlake_config *cfg)
{
	const struct gml_backend *be = gml_backend_by_id(cfg->backend);
	int ret;

	memset(dev, 0, sizeof(*dev));
	atomic_init(&dev->fault.call, -1);
	atomic_init(&dev->lasting.call, -1);
	if (!be)
		return gml_set_error(-EINVAL, "unknown backend %d",
				     cfg->backend);
	dev->ops = be->ops;
	ret = dev->ops->open(cfg, &dev->priv);
	if (ret)
		return ret;
	ret = dev->ops->granularity(dev->priv, &dev->granularity);
	if (ret)
		goto out_close;
	if (!dev->granularity || (dev->granularity & (dev->granularity - 1))) {
		ret = gml_set_error(-EIO, "device reports granularity %zu",
				    dev->granularity);
		goto out_close;
	}
	return 0;
out_close:
	dev->ops->close(dev->priv);
	dev->priv = NULL;
	return ret;
}

void gml_dev_close(struct gml_dev *dev)
{
	if (dev->priv)
		dev->ops->close(dev->priv);
	dev->priv = NULL;
}

bool gml_dev_is_emu(const struct gml_dev *dev)
{
	return dev->ops == &gml_drv_emu;
}

static void fault_arm(struct gml_fault *f, int call, uint64_t nth, int err)
{
	if (call < 0 || call >= GML_CALL_COUNT || !nth)
		call = -1;
	atomic_store_explicit(&f->call, -1, memory_order_relaxed);
	atomic_store_explicit(&f->left, nth, memory_order_relaxed);
	atomic_store_explicit(&f->err, err ? err : ENOMEM,
			      memory_order_relaxed);
	atomic_store_explicit(&f->call, call, memory_order_release);
}

void gml_dev_fail_nth(struct gml_dev *dev, int call, uint64_t nth, int err)
{
	fault_arm(&dev->fault, call, nth, err);
}

void gml_dev_fail_from(struct gml_dev *dev, int call, uint64_t nth, int err)
{
	fault_arm(&dev->lasting, call, nth, err);
}

const char *gml_dev_call_name(int call)
{
	static const char *const names[] = {
		[GML_CALL_stream_create - GMLAKE_CALL_COUNT] = "stream_create",
		[GML_CALL_stream_destroy - GMLAKE_CALL_COUNT] = "stream_destroy",
		[GML_CALL_mem_info - GMLAKE_CALL_COUNT] = "mem_info",
		[GML_CALL_enter - GMLAKE_CALL_COUNT] = "enter",
		[GML_CALL_mem_export - GMLAKE_CALL_COUNT] = "mem_export",
		[GML_CALL_mem_import - GMLAKE_CALL_COUNT] = "mem_import",
	};

	if (call >= GMLAKE_CALL_COUNT && call < GML_CALL_COUNT)
		return names[call - GMLAKE_CALL_COUNT];
	return gmlake_call_name(call);
}

/* Count the call; true when an armed fault says this one fails. */
static bool counted(struct gml_dev *dev, int call)
{
	int armed = call;

	/* Atomic: the offload engine copies without the context lock
	 * while the stats publisher reads the counters under it. */
	__atomic_fetch_add(&dev->calls[call], 1, __ATOMIC_RELAXED);
	if (atomic_load_explicit(&dev->lasting.call, memory_order_acquire) ==
	    call) {
		uint_fast64_t left = atomic_load(&dev->lasting.left);

		/* Counts down to 1, then every call fails. */
		while (left > 1 && !atomic_compare_exchange_weak(
			       &dev->lasting.left, &left, left - 1))
			;
		if (left <= 1)
			return true;
	}
	if (atomic_load_explicit(&dev->fault.call, memory_order_acquire) !=
	    call)
		return false;
	if (atomic_fetch_sub_explicit(&dev->fault.left, 1,
				      memory_order_relaxed) != 1)
		return false;
	/* Once: only the call that disarms the plan fails. */
	return atomic_compare_exchange_strong(&dev->fault.call, &armed, -1);
}

/*
 * Count the call and start its clock; true when an armed fault says this
 * one fails (the caller then returns injected()).
 */
static bool begin(struct gml_dev *dev, int call, uint64_t *t0)
{
	*t0 = gml_now_ns();
	return counted(dev, call);
}

static int end(struct gml_dev *dev, int call, uint64_t t0, int ret)
{
	__atomic_fetch_add(&dev->call_ns[call], gml_now_ns() - t0,
			   __ATOMIC_RELAXED);
	if (ret && ret != -EBUSY)
		__atomic_fetch_add(&dev->call_failures[call], 1,
				   __ATOMIC_RELAXED);
	return ret;
}

static int injected(struct gml_dev *dev, int call)
{
	const struct gml_fault *f = atomic_load(&dev->lasting.call) == call ?
				    &dev->lasting : &dev->fault;

	__atomic_fetch_add(&dev->call_failures[call], 1, __ATOMIC_RELAXED);
	return gml_set_error(-atomic_load(&f->err),
			     "%s: injected fault", gml_dev_call_name(call));
}

int gml_dev_enter(struct gml_dev *dev)
{
	int ret;

	if (counted(dev, GML_CALL_enter))
		return injected(dev, GML_CALL_enter);
	ret = dev->ops->enter(dev->priv);
	if (ret)
		__atomic_fetch_add(&dev->call_failures[GML_CALL_enter], 1,
				   __ATOMIC_RELAXED);
	return ret;
}

void gml_dev_leave(struct gml_dev *dev)
{
	dev->ops->leave(dev->priv);
}

int gml_dev_mem_info(struct gml_dev *dev, size_t *free, size_t *total)
{
	uint64_t t0;

	if (begin(dev, GML_CALL_mem_info, &t0))
		return injected(dev, GML_CALL_mem_info);
	return end(dev, GML_CALL_mem_info, t0,
		   dev->ops->mem_info(dev->priv, free, total));
}

int gml_dev_stream_create(struct gml_dev *dev, gmlake_stream_t *s)
{
	uint64_t t0;

	if (begin(dev, GML_CALL_stream_create, &t0))
		return injected(dev, GML_CALL_stream_create);
	return end(dev, GML_CALL_stream_create, t0,
		   dev->ops->stream_create(dev->priv, s));
}

int gml_dev_stream_destroy(struct gml_dev *dev, gmlake_stream_t s)
{
	uint64_t t0;

	if (begin(dev, GML_CALL_stream_destroy, &t0))
		return injected(dev, GML_CALL_stream_destroy);
	return end(dev, GML_CALL_stream_destroy, t0,
		   dev->ops->stream_destroy(dev->priv, s));
}

int gml_dev_mem_create(struct gml_dev *dev, size_t size, gml_handle *h)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_mem_create, &t0))
		return injected(dev, GMLAKE_CALL_mem_create);
	return end(dev, GMLAKE_CALL_mem_create, t0, dev->ops->mem_create(dev->priv, size, h));
}

int gml_dev_mem_release(struct gml_dev *dev, gml_handle h)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_mem_release, &t0))
		return injected(dev, GMLAKE_CALL_mem_release);
	return end(dev, GMLAKE_CALL_mem_release, t0, dev->ops->mem_release(dev->priv, h));
}

int gml_dev_va_reserve(struct gml_dev *dev, size_t size, size_t align, gml_va *va)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_va_reserve, &t0))
		return injected(dev, GMLAKE_CALL_va_reserve);
	return end(dev, GMLAKE_CALL_va_reserve, t0, dev->ops->va_reserve(dev->priv, size, align, va));
}

int gml_dev_va_free(struct gml_dev *dev, gml_va va, size_t size)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_va_free, &t0))
		return injected(dev, GMLAKE_CALL_va_free);
	return end(dev, GMLAKE_CALL_va_free, t0, dev->ops->va_free(dev->priv, va, size));
}

int gml_dev_mem_map(struct gml_dev *dev, gml_va va, size_t size, gml_handle h)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_mem_map, &t0))
		return injected(dev, GMLAKE_CALL_mem_map);
	return end(dev, GMLAKE_CALL_mem_map, t0, dev->ops->mem_map(dev->priv, va, size, h));
}

int gml_dev_mem_unmap(struct gml_dev *dev, gml_va va, size_t size)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_mem_unmap, &t0))
		return injected(dev, GMLAKE_CALL_mem_unmap);
	return end(dev, GMLAKE_CALL_mem_unmap, t0, dev->ops->mem_unmap(dev->priv, va, size));
}

int gml_dev_set_access(struct gml_dev *dev, gml_va va, size_t size)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_set_access, &t0))
		return injected(dev, GMLAKE_CALL_set_access);
	return end(dev, GMLAKE_CALL_set_access, t0,
		   dev->ops->set_access(dev->priv, va, size, dev->peers,
					atomic_load_explicit(&dev->npeers,
							     memory_order_acquire)));
}

int gml_dev_peer_add(struct gml_dev *dev, int peer)
{
	int n = atomic_load_explicit(&dev->npeers, memory_order_relaxed);
	int ret;

	for (int i = 0; i < n; i++)
		if (dev->peers[i] == peer)
			return 1;
	if (n == GML_MAX_PEERS)
		return gml_set_error(-ENOSPC, "device peers: %d listed already, "
				     "the most there can be", n);
	ret = dev->ops->peer_check(dev->priv, peer);
	if (ret)
		return ret;
	dev->peers[n] = peer;
	atomic_store_explicit(&dev->npeers, n + 1, memory_order_release);
	return 0;
}

int gml_dev_event_create(struct gml_dev *dev, gml_event *e)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_event_create, &t0))
		return injected(dev, GMLAKE_CALL_event_create);
	return end(dev, GMLAKE_CALL_event_create, t0, dev->ops->event_create(dev->priv, e));
}

void gml_dev_event_destroy(struct gml_dev *dev, gml_event e)
{
	dev->ops->event_destroy(dev->priv, e);
}

int gml_dev_event_record(struct gml_dev *dev, gml_event e, gmlake_stream_t s)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_event_record, &t0))
		return injected(dev, GMLAKE_CALL_event_record);
	return end(dev, GMLAKE_CALL_event_record, t0, dev->ops->event_record(dev->priv, e, s));
}

int gml_dev_event_query(struct gml_dev *dev, gml_event e)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_event_query, &t0))
		return injected(dev, GMLAKE_CALL_event_query);
	return end(dev, GMLAKE_CALL_event_query, t0, dev->ops->event_query(dev->priv, e));
}

int gml_dev_event_sync(struct gml_dev *dev, gml_event e)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_event_sync, &t0))
		return injected(dev, GMLAKE_CALL_event_sync);
	return end(dev, GMLAKE_CALL_event_sync, t0, dev->ops->event_sync(dev->priv, e));
}

int gml_dev_stream_sync(struct gml_dev *dev, gmlake_stream_t s)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_stream_sync, &t0))
		return injected(dev, GMLAKE_CALL_stream_sync);
	return end(dev, GMLAKE_CALL_stream_sync, t0, dev->ops->stream_sync(dev->priv, s));
}

int gml_dev_memcpy(struct gml_dev *dev, void *dst, const void *src, size_t size,
	       enum gml_copy_kind kind, gmlake_stream_t s)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_memcpy, &t0))
		return injected(dev, GMLAKE_CALL_memcpy);
	return end(dev, GMLAKE_CALL_memcpy, t0, dev->ops->memcpy_async(dev->priv, dst, src, size, kind, s));
}

int gml_dev_stream_wait_event(struct gml_dev *dev, gmlake_stream_t s, gml_event e)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_stream_wait, &t0))
		return injected(dev, GMLAKE_CALL_stream_wait);
	return end(dev, GMLAKE_CALL_stream_wait, t0, dev->ops->stream_wait(dev->priv, s, e));
}

int gml_dev_host_func(struct gml_dev *dev, gmlake_stream_t s, void (*fn)(void *),
		  void *arg)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_host_func, &t0))
		return injected(dev, GMLAKE_CALL_host_func);
	return end(dev, GMLAKE_CALL_host_func, t0, dev->ops->host_func(dev->priv, s, fn, arg));
}

int gml_dev_host_register(struct gml_dev *dev, void *p, size_t size)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_host_register, &t0))
		return injected(dev, GMLAKE_CALL_host_register);
	return end(dev, GMLAKE_CALL_host_register, t0, dev->ops->host_register(dev->priv, p, size));
}

int gml_dev_host_unregister(struct gml_dev *dev, void *p)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_host_unregister, &t0))
		return injected(dev, GMLAKE_CALL_host_unregister);
	return end(dev, GMLAKE_CALL_host_unregister, t0, dev->ops->host_unregister(dev->priv, p));
}

/* A query at set-up, not counted as a call kind of its own. */
int gml_dev_host_numa(struct gml_dev *dev, int *node)
{
	return dev->ops->host_numa(dev->priv, node);
}

int gml_dev_mem_create_host(struct gml_dev *dev, size_t size, int numa,
			gml_handle *h)
{
	uint64_t t0;

	if (begin(dev, GMLAKE_CALL_mem_create_host, &t0))
		return injected(dev, GMLAKE_CALL_mem_create_host);
	return end(dev, GMLAKE_CALL_mem_create_host, t0, dev->ops->mem_create_host(dev->priv, size, numa, h));
}

int gml_dev_mem_export(struct gml_dev *dev, gml_handle h, int *fd,
		       uint64_t *off)
{
	uint64_t t0;

	if (begin(dev, GML_CALL_mem_export, &t0))
		return injected(dev, GML_CALL_mem_export);
	return end(dev, GML_CALL_mem_export, t0,
		   dev->ops->mem_export(dev->priv, h, fd, off));
}

int gml_dev_mem_import(struct gml_dev *dev, int fd, uint64_t off, size_t size,
		       gml_handle *h)
{
	uint64_t t0;

	if (begin(dev, GML_CALL_mem_import, &t0))
		return injected(dev, GML_CALL_mem_import);
	return end(dev, GML_CALL_mem_import, t0,
		   dev->ops->mem_import(dev->priv, fd, off, size, h));
}
