/* SPDX-License-Identifier: MIT */
/*
 * The primitive layer: everything that touches a device goes through one
 * table of operations, filled by a backend (drv_cuda.c: the real driver,
 * drv_emu.c: the emulated device). Every operation returns 0 or -errno; a
 * backend keeps the raw driver code for the message in gml_set_error().
 *
 * Callers never use the table directly: dev.c wraps each operation, as
 * gml_dev_<operation>(), to count and time it, and to inject faults ("fail
 * the Nth call of kind K") on any backend, so tests reach every error path
 * without a GPU. The gml_dev_ prefix tells the layer: gml_stream_* (stream
 * ordering, lib/stream.c) and gml_host_* (the pinned arena, offload/) are
 * the layers above.
 */
#ifndef GML_DRV_H
#define GML_DRV_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gmlake.h"

typedef uint64_t gml_handle;	/* a physical chunk (CUmemGenericAllocationHandle) */
typedef uint64_t gml_va;	/* a device virtual address (CUdeviceptr) */
typedef void *gml_event;	/* CUevent */

enum gml_copy_kind {
	GML_COPY_HTOD,
	GML_COPY_DTOH,
	GML_COPY_DTOD,
};

struct gml_drv_ops {
	const char *name;
	/* Open device cfg->device; *priv is the backend's state. */
	int (*open)(const struct gmlake_config *cfg, void **priv);
	void (*close)(void *priv);
	/* Make the device's context current in this thread / undo it. */
	int (*enter)(void *priv);
	void (*leave)(void *priv);
	int (*granularity)(void *priv, size_t *gran);
	int (*mem_info)(void *priv, size_t *free, size_t *total);

	int (*mem_create)(void *priv, size_t size, gml_handle *h);
	int (*mem_release)(void *priv, gml_handle h);
	int (*va_reserve)(void *priv, size_t size, size_t align, gml_va *va);
	int (*va_free)(void *priv, gml_va va, size_t size);
	/* Map all of h (size bytes) at va; unmap exactly one earlier map. */
	int (*mem_map)(void *priv, gml_va va, size_t size, gml_handle h);
	int (*mem_unmap)(void *priv, gml_va va, size_t size);
	/* Read-write access over [va, va+size) for the device and for the
	 * npeers devices of peers (other ordinals; unlisted devices keep
	 * what access they had). */
	int (*set_access)(void *priv, gml_va va, size_t size,
			  const int *peers, int npeers);
	/* Whether device ordinal peer may be given access to this device's
	 * memory: 0, -EINVAL (this device, or no ordinal), -ENODEV (it
	 * cannot access it). */
	int (*peer_check)(void *priv, int peer);

	int (*stream_create)(void *priv, gmlake_stream_t *s);
	int (*stream_destroy)(void *priv, gmlake_stream_t s);
	int (*stream_sync)(void *priv, gmlake_stream_t s);
	int (*event_create)(void *priv, gml_event *e);
	int (*event_destroy)(void *priv, gml_event e);
	int (*event_record)(void *priv, gml_event e, gmlake_stream_t s);
	/* 0 when complete, -EBUSY while pending. */
	int (*event_query)(void *priv, gml_event e);
	int (*event_sync)(void *priv, gml_event e);
	int (*memcpy_async)(void *priv, void *dst, const void *src,
			    size_t size, enum gml_copy_kind kind,
			    gmlake_stream_t s);

	/* Offload primitives. Stream s waits (on the device) for e. */
	int (*stream_wait)(void *priv, gmlake_stream_t s, gml_event e);
	/* Run fn(arg) on a driver thread once s reaches this point; fn must
	 * not call the driver. */
	int (*host_func)(void *priv, gmlake_stream_t s, void (*fn)(void *),
			 void *arg);
	/* Page-lock [p, p+size) for async copies; undo with unregister. */
	int (*host_register)(void *priv, void *p, size_t size);
	int (*host_unregister)(void *priv, void *p);
	/* Host NUMA node nearest the device, -1 when unknown. */
	int (*host_numa)(void *priv, int *node);
	/* Host memory on NUMA node numa (-1: any) as a handle that maps
	 * into device ranges like a chunk (in-place spill). */
	int (*mem_create_host)(void *priv, size_t size, int numa,
			       gml_handle *h);

	/* Sharing with other processes (ipc.c). A file descriptor for h
	 * (*fd, the caller's to close) and where h's memory starts in it
	 * (*off: 0 on CUDA); -EOPNOTSUPP where h was not made exportable. */
	int (*mem_export)(void *priv, gml_handle h, int *fd, uint64_t *off);
	/* A handle for size bytes at off of fd, a mem_export of this or
	 * another process (fd stays the caller's). */
	int (*mem_import)(void *priv, int fd, uint64_t off, size_t size,
			  gml_handle *h);
};

extern const struct gml_drv_ops gml_drv_cuda;
extern const struct gml_drv_ops gml_drv_emu;

/*
 * The backends, one row each: its enum gmlake_backend value, the name
 * GMLAKE_BACKEND gives it, its table. The one table that the options
 * (names), gmlake_ctx_init (which values are valid, which is the default)
 * and gml_dev_open (which table to open) all read.
 */
struct gml_backend {
	int id;				/* enum gmlake_backend */
	const char *name;		/* GMLAKE_BACKEND=name */
	const struct gml_drv_ops *ops;
};

/* The row of id, or NULL (GMLAKE_BACKEND_DEFAULT has none). */
const struct gml_backend *gml_backend_by_id(int id);
/* The row named name (any case), or NULL. */
const struct gml_backend *gml_backend_by_name(const char *name);
/* The row GMLAKE_BACKEND_DEFAULT opens when GMLAKE_BACKEND names none. */
const struct gml_backend *gml_backend_default(void);

/*
 * Call kinds of the device layer beyond the published ones (enum
 * gmlake_call of gmlake-stats.h): counted and fault-injectable like them,
 * but not in struct gmlake_stats, whose layout (and version) would change.
 * gml_dev_call_name() names every kind.
 */
enum gml_dev_call {
	GML_CALL_stream_create = GMLAKE_CALL_COUNT,
	GML_CALL_stream_destroy,
	GML_CALL_mem_info,
	GML_CALL_enter,
	GML_CALL_mem_export,
	GML_CALL_mem_import,
	GML_CALL_COUNT
};

/*
 * Fault plan: fail the nth call (1-based) of kind call from the arming
 * on, once. A test arms it from its own thread while the offload engine
 * makes driver calls, without the context lock: so every field is atomic,
 * and the arming publishes left and err before call.
 */
struct gml_fault {
	atomic_int call;	/* enum gmlake_call or gml_dev_call; -1: none */
	atomic_uint_fast64_t left;	/* calls of that kind until it fires */
	atomic_int err;		/* errno to return (positive), ENOMEM by default */
};

/* An open device: the backend plus the counters of its calls. */
/* Devices given access besides the device itself (gml_dev_peer_add). */
#define GML_MAX_PEERS 31

struct gml_dev {
	const struct gml_drv_ops *ops;
	void *priv;
	size_t granularity;
	/* Appended under the owner's lock, never removed; read by every
	 * set_access without one (offload's threads too). */
	int peers[GML_MAX_PEERS];
	atomic_int npeers;
	uint64_t calls[GML_CALL_COUNT];
	uint64_t call_ns[GML_CALL_COUNT];
	uint64_t call_failures[GML_CALL_COUNT];
	struct gml_fault fault;
	struct gml_fault lasting;	/* gml_dev_fail_from */
};

int gml_dev_open(struct gml_dev *dev, const struct gmlake_config *cfg);
void gml_dev_close(struct gml_dev *dev);
/* Arm a fault: call kind `call` fails with -err on its nth call from now. */
void gml_dev_fail_nth(struct gml_dev *dev, int call, uint64_t nth, int err);
/* Arm a lasting fault, beside the one above: call kind `call` fails with
 * -err on its nth call from now and every one after, until disarmed
 * (call -1): a driver that keeps refusing. */
void gml_dev_fail_from(struct gml_dev *dev, int call, uint64_t nth, int err);
/* The name of a call kind, published or not ("enter"); NULL if none. */
const char *gml_dev_call_name(int call);

/* The device's context made current in this thread (CUDA), and undone;
 * enter is counted and fault-injectable, neither is timed: they run on
 * every public call, and two clock reads would cost about what the push
 * and pop of a context cost. */
int gml_dev_enter(struct gml_dev *dev);
void gml_dev_leave(struct gml_dev *dev);
int gml_dev_mem_info(struct gml_dev *dev, size_t *free, size_t *total);
int gml_dev_stream_create(struct gml_dev *dev, gmlake_stream_t *s);
int gml_dev_stream_destroy(struct gml_dev *dev, gmlake_stream_t s);

int gml_dev_mem_create(struct gml_dev *dev, size_t size, gml_handle *h);
int gml_dev_mem_release(struct gml_dev *dev, gml_handle h);
int gml_dev_va_reserve(struct gml_dev *dev, size_t size, size_t align,
		   gml_va *va);
int gml_dev_va_free(struct gml_dev *dev, gml_va va, size_t size);
int gml_dev_mem_map(struct gml_dev *dev, gml_va va, size_t size, gml_handle h);
int gml_dev_mem_unmap(struct gml_dev *dev, gml_va va, size_t size);
/* Access for the device and its peers (gml_dev_peer_add). */
int gml_dev_set_access(struct gml_dev *dev, gml_va va, size_t size);
/* Every later set_access also grants device ordinal peer: 0, 1 when it
 * was already listed, -ENOSPC (GML_MAX_PEERS listed), or peer_check's
 * error. The caller serializes adds. */
int gml_dev_peer_add(struct gml_dev *dev, int peer);
int gml_dev_event_create(struct gml_dev *dev, gml_event *e);
void gml_dev_event_destroy(struct gml_dev *dev, gml_event e);
int gml_dev_event_record(struct gml_dev *dev, gml_event e, gmlake_stream_t s);
int gml_dev_event_query(struct gml_dev *dev, gml_event e);
int gml_dev_event_sync(struct gml_dev *dev, gml_event e);
int gml_dev_stream_sync(struct gml_dev *dev, gmlake_stream_t s);
int gml_dev_memcpy(struct gml_dev *dev, void *dst, const void *src, size_t size,
	       enum gml_copy_kind kind, gmlake_stream_t s);
int gml_dev_stream_wait_event(struct gml_dev *dev, gmlake_stream_t s, gml_event e);
int gml_dev_host_func(struct gml_dev *dev, gmlake_stream_t s, void (*fn)(void *),
		  void *arg);
int gml_dev_host_register(struct gml_dev *dev, void *p, size_t size);
int gml_dev_host_unregister(struct gml_dev *dev, void *p);
int gml_dev_host_numa(struct gml_dev *dev, int *node);
int gml_dev_mem_create_host(struct gml_dev *dev, size_t size, int numa,
			gml_handle *h);
int gml_dev_mem_export(struct gml_dev *dev, gml_handle h, int *fd,
		       uint64_t *off);
int gml_dev_mem_import(struct gml_dev *dev, int fd, uint64_t off, size_t size,
		       gml_handle *h);

/* Emulated device only: the bytes behind it, for tests (NULL elsewhere). */
struct gml_emu_info {
	size_t capacity;
	size_t used;		/* bytes held by live chunks */
	uint64_t live_handles;
	uint64_t live_mappings;
	uint64_t live_reservations;
	uint64_t live_events;
	uint64_t live_streams;
};
int gml_emu_info(void *priv, struct gml_emu_info *info);
/* Emulated device only: hold a stream's worker (queued work waits) or let
 * it go, so tests can stall a stream on purpose. -EOPNOTSUPP elsewhere. */
int gml_emu_stream_hold(void *priv, gmlake_stream_t s, bool hold);
/* CLOCK_MONOTONIC in nanoseconds, for the call timers and the stats. */
uint64_t gml_now_ns(void);
/* Whether dev opened the emulated backend. */
bool gml_dev_is_emu(const struct gml_dev *dev);

#endif
