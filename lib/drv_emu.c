/* SPDX-License-Identifier: MIT */
/*
 * The emulated device: the primitive layer on plain Linux, for tests, CI and
 * trace replay. Nothing here is a stand-in that only counts: the memory is
 * real and so are the mappings.
 *
 *  - Device memory is one sparse memfd of the emulated capacity. A chunk is
 *    an offset range in it, taken first fit from a sorted list of free
 *    extents (in granularity units). When a chunk dies, a hole is punched
 *    over its range, so the memory really goes back to the system.
 *  - A virtual reservation is an anonymous PROT_NONE, MAP_NORESERVE mapping.
 *    Mapping a chunk puts the memfd range at the address (MAP_SHARED |
 *    MAP_FIXED, still PROT_NONE); set_access makes it read-write. Several
 *    chunks mapped side by side really show as one contiguous buffer.
 *    Unmapping puts anonymous PROT_NONE memory back, so the range stays
 *    reserved.
 *  - A stream is a worker thread running a FIFO of copies and event markers.
 *    The worker starts with the first item queued. The default stream (NULL)
 *    is built in.
 *  - An event counts records (rec_gen) and completions (done_gen); it is
 *    complete when every record has been reached by its stream's worker; a
 *    record on an idle stream completes at once.
 *  - With cfg->emu_lag the workers take no item until the host waits for
 *    the device (stream_sync, event_sync): then every stream runs all it
 *    has queued, as a GPU running behind its host catches up when the host
 *    synchronizes. Replay's --lag, for policies that must hold while the
 *    device has not finished the work on freed memory.
 *
 * Handles of chunks, streams and events are slot ids with a generation
 * (gen << 32 | index + 1), so a stale or made-up handle is found out and
 * refused with -EINVAL instead of being dereferenced.
 *
 * Locking: dev->lock guards the tables, extents, mappings and reservations.
 * Each stream's lock guards its queue and state; dev->ev_lock guards every
 * event's generations and reference count. Order: dev->lock, then a stream's
 * lock or ev_lock. Workers never take dev->lock.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

#include <stdatomic.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "drv.h"
#include "drv.h"
#include "drv_emu.h"
#include "error.h"

/* ------------------------------------------------------------------ */
/* Device                                                              */

/*
 * Forks seen by this process and its ancestors: a child's count is one
 * higher than its parent's was, so a device opened before the fork shows
 * an older count. A getpid() per entry point would be a system call on
 * every allocation.
 */
static atomic_uint emu_forks;
static pthread_once_t emu_atfork_once = PTHREAD_ONCE_INIT;

static void emu_forked(void)
{
	atomic_fetch_add_explicit(&emu_forks, 1, memory_order_relaxed);
}

static void emu_atfork_init(void)
{
	/* Failing (ENOMEM) leaves children unchecked, nothing worse. */
	(void)pthread_atfork(NULL, NULL, emu_forked);
}

/*
 * Every entry point of a context enters first. A child made by fork() has
 * a copy of the device without its stream workers (threads do not survive
 * fork), so a stream of the parent would never finish there, and the
 * device memory it shares with the parent is not its own: refuse, as CUDA
 * refuses a context the parent made.
 */
static int emu_enter(void *priv)
{
	struct emu_dev *dev = priv;

	if (dev->forks != atomic_load_explicit(&emu_forks,
					       memory_order_relaxed))
		return gml_set_error(-EIO, "emu: the device was opened by process "
				     "%ld; a child made by fork() cannot use it "
				     "(open a context in the child instead)",
				     (long)dev->pid);
	return 0;
}

static void emu_leave(void *priv)
{
	(void)priv;
}

static int emu_granularity(void *priv, size_t *gran)
{
	struct emu_dev *dev = priv;

	if (!gran)
		return gml_set_error(-EINVAL, "emu: granularity: NULL result");
	*gran = dev->gran;
	return 0;
}

static int emu_mem_info(void *priv, size_t *free_bytes, size_t *total)
{
	struct emu_dev *dev = priv;

	if (!free_bytes || !total)
		return gml_set_error(-EINVAL, "emu: mem_info: NULL result");
	pthread_mutex_lock(&dev->lock);
	*free_bytes = dev->capacity - dev->used;
	*total = dev->capacity;
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

/* Granularity and capacity from cfg, with defaults; 0 or -EINVAL. */
static int emu_sizes(const struct gmlake_config *cfg, size_t *gran,
		     size_t *cap)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE);

	*gran = cfg->emu_granularity ? cfg->emu_granularity : EMU_DEFAULT_GRAN;
	if (*gran < page || (*gran & (*gran - 1)))
		return gml_set_error(-EINVAL,
			"emu: granularity %zu is not a power of two multiple of the page size %zu",
			*gran, page);
	*cap = cfg->emu_capacity ? cfg->emu_capacity : EMU_DEFAULT_CAPACITY;
	if (*cap > (size_t)INT64_MAX)
		*cap = (size_t)INT64_MAX;
	*cap -= *cap % *gran;
	if (!*cap)
		return gml_set_error(-EINVAL,
			"emu: capacity %zu is smaller than the granularity %zu",
			cfg->emu_capacity, *gran);
	return 0;
}

/* The memfd behind device memory, one free extent over all of it. */
static int emu_open_memory(struct emu_dev *dev)
{
	struct emu_extent all = { 0, dev->capacity / dev->gran };
	int ret;

	dev->fd = memfd_create("gmlake-emu", MFD_CLOEXEC);
	if (dev->fd < 0)
		return gml_set_error(-errno, "emu: memfd_create: %s",
				     strerror(errno));
	if (ftruncate(dev->fd, (off_t)dev->capacity)) {
		ret = gml_set_error(-errno,
			"emu: cannot size device memory to %zu bytes: %s",
				    dev->capacity, strerror(errno));
		goto out_close;
	}
	ret = gml_emu_vec_insert(&dev->extents, sizeof(all), 0, &all);
	if (ret) {
		gml_set_error(ret, "emu: open: out of host memory");
		goto out_close;
	}
	return 0;

out_close:
	close(dev->fd);
	return ret;
}

static int emu_locks_init(struct emu_dev *dev)
{
	if (pthread_mutex_init(&dev->lock, NULL))
		goto out_fail;
	if (pthread_mutex_init(&dev->ev_lock, NULL))
		goto out_destroy_lock;
	if (pthread_cond_init(&dev->ev_cond, NULL))
		goto out_destroy_ev_lock;
	return 0;

out_destroy_ev_lock:
	pthread_mutex_destroy(&dev->ev_lock);
out_destroy_lock:
	pthread_mutex_destroy(&dev->lock);
out_fail:
	return gml_set_error(-ENOMEM, "emu: open: cannot create locks");
}

static void emu_locks_destroy(struct emu_dev *dev)
{
	pthread_cond_destroy(&dev->ev_cond);
	pthread_mutex_destroy(&dev->ev_lock);
	pthread_mutex_destroy(&dev->lock);
}

static int emu_open(const struct gmlake_config *cfg, void **priv)
{
	struct emu_dev *dev;
	size_t gran, cap;
	int ret;

	if (!cfg || !priv)
		return gml_set_error(-EINVAL, "emu: open: NULL %s",
				     cfg ? "result" : "config");
	if (cfg->device < 0)
		return gml_set_error(-ENODEV, "emu: open: no device %d",
				     cfg->device);
	ret = emu_sizes(cfg, &gran, &cap);
	if (ret)
		return ret;
	dev = calloc(1, sizeof(*dev));
	if (!dev)
		return gml_set_error(-ENOMEM, "emu: open: out of host memory");
	dev->magic = EMU_MAGIC;
	pthread_once(&emu_atfork_once, emu_atfork_init);
	dev->pid = getpid();
	dev->forks = atomic_load_explicit(&emu_forks, memory_order_relaxed);
	dev->host_fd = -1;
	dev->exportable = cfg->exportable;
	dev->host_numa = -1;
	dev->ordinal = cfg->device;
	dev->lag = cfg->emu_lag;
	dev->gran = gran;
	dev->capacity = cap;
	gml_emu_table_init(&dev->chunks);
	gml_emu_table_init(&dev->events);
	gml_emu_table_init(&dev->streams);
	ret = emu_locks_init(dev);
	if (ret)
		goto out_free;
	ret = emu_open_memory(dev);
	if (ret)
		goto out_destroy_locks;
	ret = gml_emu_stream_new(dev, &dev->null_stream);
	if (ret) {
		gml_set_error(ret, "emu: open: out of host memory");
		goto out_close_memory;
	}
	*priv = dev;
	return 0;

out_close_memory:
	close(dev->fd);
	gml_emu_vec_free(&dev->extents);
out_destroy_locks:
	emu_locks_destroy(dev);
out_free:
	free(dev);
	return ret;
}

/* Stop every worker (queued work runs), then drop all objects and memory. */
static void emu_close(void *priv)
{
	struct emu_dev *dev = priv;
	struct emu_resv *r;
	uint32_t i;
	size_t j;

	if (!dev)
		return;
	/* Queued work runs now; a worker may wait on another's event. */
	pthread_mutex_lock(&dev->lock);
	gml_emu_catch_up_begin(dev);
	pthread_mutex_unlock(&dev->lock);
	for (i = 0; i < dev->streams.len; i++) {
		if (!dev->streams.slot[i].obj)
			continue;
		gml_emu_stream_stop(dev->streams.slot[i].obj);
		gml_emu_stream_free(dev->streams.slot[i].obj);
	}
	gml_emu_stream_stop(dev->null_stream);
	gml_emu_stream_free(dev->null_stream);
	for (i = 0; i < dev->events.len; i++)
		free(dev->events.slot[i].obj);
	r = dev->resvs.v;
	for (j = 0; j < dev->resvs.len; j++)
		munmap((void *)(uintptr_t)r[j].va, r[j].size);
	for (i = 0; i < dev->chunks.len; i++)
		free(dev->chunks.slot[i].obj);
	close(dev->fd);
	if (dev->host_fd >= 0)
		close(dev->host_fd);
	free(dev->streams.slot);
	free(dev->events.slot);
	free(dev->chunks.slot);
	gml_emu_vec_free(&dev->extents);
	gml_emu_vec_free(&dev->maps);
	gml_emu_vec_free(&dev->resvs);
	emu_locks_destroy(dev);
	free(dev);
}

/* priv as an emulated device, or NULL when it belongs to another backend. */
static struct emu_dev *emu_dev_of(void *priv)
{
	struct emu_dev *dev = priv;

	return dev && dev->magic == EMU_MAGIC ? dev : NULL;
}

int gml_emu_info(void *priv, struct gml_emu_info *info)
{
	struct emu_dev *dev = emu_dev_of(priv);

	if (!dev)
		return gml_set_error(-EOPNOTSUPP,
			"emu_info: not an emulated device");
	if (!info)
		return gml_set_error(-EINVAL, "emu_info: NULL result");
	pthread_mutex_lock(&dev->lock);
	info->capacity = dev->capacity;
	info->used = dev->used;
	info->live_handles = dev->live_handles;
	info->live_mappings = dev->maps.len;
	info->live_reservations = dev->resvs.len;
	info->live_events = dev->events.live;
	info->live_streams = dev->streams.live;
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

int gml_emu_stream_hold(void *priv, gmlake_stream_t h, bool hold)
{
	struct emu_dev *dev = emu_dev_of(priv);
	struct emu_stream *s;

	if (!dev)
		return gml_set_error(-EOPNOTSUPP,
			"emu_stream_hold: not an emulated device");
	pthread_mutex_lock(&dev->lock);
	s = gml_emu_stream_get(dev, h, "emu_stream_hold");
	if (s) {
		pthread_mutex_lock(&s->lock);
		s->hold = hold;
		if (!hold)
			pthread_cond_signal(&s->work);
		pthread_mutex_unlock(&s->lock);
	}
	pthread_mutex_unlock(&dev->lock);
	return s ? 0 : -EINVAL;
}

const struct gml_drv_ops gml_drv_emu = {
	.name = "emu",
	.open = emu_open,
	.close = emu_close,
	.enter = emu_enter,
	.leave = emu_leave,
	.granularity = emu_granularity,
	.mem_info = emu_mem_info,
	.mem_create = gml_emu_mem_create,
	.mem_release = gml_emu_mem_release,
	.va_reserve = gml_emu_va_reserve,
	.va_free = gml_emu_va_free,
	.mem_map = gml_emu_mem_map,
	.mem_unmap = gml_emu_mem_unmap,
	.set_access = gml_emu_set_access,
	.peer_check = gml_emu_peer_check,
	.stream_create = gml_emu_stream_create,
	.stream_destroy = gml_emu_stream_destroy,
	.stream_sync = gml_emu_stream_sync,
	.event_create = gml_emu_event_create,
	.event_destroy = gml_emu_event_destroy,
	.event_record = gml_emu_event_record,
	.event_query = gml_emu_event_query,
	.event_sync = gml_emu_event_sync,
	.memcpy_async = gml_emu_memcpy_async,
	.stream_wait = gml_emu_stream_wait,
	.host_func = gml_emu_host_func,
	.host_register = gml_emu_host_register,
	.host_unregister = gml_emu_host_unregister,
	.host_numa = gml_emu_host_numa,
	.mem_create_host = gml_emu_mem_create_host,
	.mem_export = gml_emu_mem_export,
	.mem_import = gml_emu_mem_import,
};
