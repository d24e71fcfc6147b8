/* SPDX-License-Identifier: MIT */
/*
 * Inside the emulated device (drv_emu.c, drv_emu_mem.c, drv_emu_stream.c):
 * its objects and what its files call of each other. Locking as drv_emu.c
 * says.
 */
#ifndef GML_DRV_EMU_H
#define GML_DRV_EMU_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "drv.h"

#define EMU_MAGIC		0x676d6c2d656d7531ULL	/* "gml-emu1" */
#define EMU_DEFAULT_CAPACITY	((size_t)64 << 30)
#define EMU_DEFAULT_GRAN	((size_t)2 << 20)
#define EMU_NO_SLOT		UINT32_MAX

/* A table of objects addressed by ids that carry a generation. */
struct emu_slot {
	void *obj;		/* NULL while the slot is free */
	uint32_t gen;		/* bumped each time the slot is freed */
	uint32_t next_free;
};

struct emu_table {
	struct emu_slot *slot;
	uint32_t len;
	uint32_t cap;
	uint32_t free_head;
	uint64_t live;
};

/*
 * A growable array, kept sorted by its elements' first field. v is element
 * 0, and free room may lie before it as well as after: adding or taking at
 * either end is O(1) and a change in the middle moves the shorter side.
 * Mappings are torn down in address order, which with a plain array moved
 * every remaining element each time (quadratic: 13.8 s for 256 GiB).
 */
struct emu_vec {
	void *v;		/* element 0, inside base */
	void *base;		/* the allocation */
	size_t off;		/* free elements before v */
	size_t len;
	size_t cap;		/* elements base holds */
};

struct emu_extent {		/* free memfd range, in granularity units */
	uint64_t start;
	uint64_t len;
};

struct emu_chunk {
	uint64_t id;
	uint64_t start;		/* in granularity units */
	uint64_t units;
	uint64_t maps;		/* live mappings of it */
	bool released;		/* handle gone; memory stays if mapped */
	bool host;		/* host memory (mem_create_host), host_fd */
	bool imported;		/* mem_import: import_off of import_fd, */
	int import_fd;		/* this chunk's own descriptor */
	uint64_t import_off;	/* in bytes */
};

/* Device ordinals the emulated device knows (any opens). */
#define EMU_DEVICES 128

struct emu_map {
	gml_va va;		/* first: the arrays are sorted by it */
	size_t size;
	struct emu_chunk *chunk;
	bool access;
	uint64_t peers[EMU_DEVICES / 64];	/* ordinals given access too */
};

struct emu_resv {
	gml_va va;
	size_t size;
	uint64_t maps;
};

struct emu_event {
	uint64_t id;
	uint64_t rec_gen;	/* records so far */
	uint64_t done_gen;	/* highest record reached by a worker */
	unsigned refs;		/* table, queued markers, waiters */
};

enum emu_item_kind {
	EMU_ITEM_COPY,
	EMU_ITEM_MARK,		/* an event record reached */
	EMU_ITEM_WAIT,		/* wait until ev reaches gen */
	EMU_ITEM_FUNC,		/* call fn(arg) */
};

struct emu_item {
	struct emu_item *next;
	enum emu_item_kind kind;
	struct emu_event *ev;	/* MARK and WAIT */
	uint64_t gen;
	void *dst;
	const void *src;
	size_t size;
	void (*fn)(void *);
	void *arg;
};

struct emu_dev;

struct emu_stream {
	uint64_t id;		/* 0 for the default stream */
	struct emu_dev *dev;
	pthread_mutex_t lock;
	pthread_cond_t work;	/* the worker waits for items */
	pthread_cond_t idle;	/* syncers wait for an empty queue */
	struct emu_item *head;
	struct emu_item **tail;
	bool busy;		/* the worker runs an item */
	bool hold;		/* the worker takes no item */
	bool stop;		/* drain, then exit */
	bool started;
	pthread_t thread;
	unsigned refs;		/* table and syncers; under dev->lock */
};

struct emu_dev {
	uint64_t magic;
	pid_t pid;		/* the process that opened it */
	unsigned forks;		/* emu_forks when it opened */
	pthread_mutex_t lock;
	int fd;
	size_t capacity;
	size_t gran;
	size_t used;		/* bytes held by chunks, released or not */
	uint64_t live_handles;	/* chunks not released yet */
	struct emu_vec extents;
	struct emu_vec maps;
	struct emu_vec resvs;
	struct emu_table chunks;
	struct emu_table events;
	struct emu_table streams;
	struct emu_stream *null_stream;
	pthread_mutex_t ev_lock;
	pthread_cond_t ev_cond;	/* broadcast when any event completes */
	int host_fd;		/* host memory of mem_create_host, -1 */
	bool exportable;	/* cfg->exportable: mem_export works */
	uint64_t host_next;	/* next free offset in host_fd, in units */
	int host_numa;		/* reported host NUMA node */
	int ordinal;		/* cfg->device */
	bool lag;		/* cfg->emu_lag: work waits for a host wait */
	atomic_uint catching;	/* host waits in progress (lag) */
};

/* Whether a lagging device's workers must leave queued work alone now. */
static inline bool gml_emu_lagging(struct emu_dev *dev)
{
	return dev->lag &&
	       !atomic_load_explicit(&dev->catching, memory_order_acquire);
}

/* drv_emu_stream.c: a host wait on a lagging device (cfg->emu_lag) lets
 * every stream run from begin to end; dev->lock held for begin. */
void gml_emu_catch_up_begin(struct emu_dev *dev);
void gml_emu_catch_up_end(struct emu_dev *dev);

/* drv_emu_mem.c */
bool gml_emu_dev_range_ok(struct emu_dev *dev, const void *p, size_t size);
int gml_emu_host_numa(void *priv, int *node);
int gml_emu_host_register(void *priv, void *p, size_t size);
int gml_emu_host_unregister(void *priv, void *p);
int gml_emu_mem_create(void *priv, size_t size, gml_handle *h);
int gml_emu_mem_create_host(void *priv, size_t size, int numa,
			    gml_handle *h);
int gml_emu_mem_map(void *priv, gml_va va, size_t size, gml_handle h);
int gml_emu_mem_export(void *priv, gml_handle h, int *fd, uint64_t *off);
int gml_emu_mem_import(void *priv, int fd, uint64_t off, size_t size,
		       gml_handle *h);
int gml_emu_mem_release(void *priv, gml_handle h);
int gml_emu_mem_unmap(void *priv, gml_va va, size_t size);
int gml_emu_set_access(void *priv, gml_va va, size_t size, const int *peers,
		       int npeers);
int gml_emu_peer_check(void *priv, int peer);
/* For tests: whether device ordinal peer was given access to all of
 * [va, va+size), mapped without gaps. */
bool gml_emu_peer_has_access(void *priv, gml_va va, size_t size, int peer);
int gml_emu_table_add(struct emu_table *t, void *obj, uint64_t *id);
void gml_emu_table_del(struct emu_table *t, uint64_t id);
void *gml_emu_table_get(const struct emu_table *t, uint64_t id);
void gml_emu_table_init(struct emu_table *t);
int gml_emu_va_free(void *priv, gml_va va, size_t size);
int gml_emu_va_reserve(void *priv, size_t size, size_t align, gml_va *va);
void gml_emu_vec_free(struct emu_vec *a);
int gml_emu_vec_insert(struct emu_vec *a, size_t elsz, size_t at,
		       const void *el);

/* drv_emu_stream.c */
int gml_emu_event_create(void *priv, gml_event *out);
int gml_emu_event_destroy(void *priv, gml_event h);
int gml_emu_event_query(void *priv, gml_event h);
int gml_emu_event_record(void *priv, gml_event h, gmlake_stream_t sh);
int gml_emu_event_sync(void *priv, gml_event h);
int gml_emu_host_func(void *priv, gmlake_stream_t sh, void (*fn)(void *),
		      void *arg);
int gml_emu_memcpy_async(void *priv, void *dst, const void *src,
			 size_t size, enum gml_copy_kind kind,
			 gmlake_stream_t sh);
int gml_emu_stream_create(void *priv, gmlake_stream_t *out);
int gml_emu_stream_destroy(void *priv, gmlake_stream_t h);
void gml_emu_stream_free(struct emu_stream *s);
struct emu_stream *gml_emu_stream_get(struct emu_dev *dev,
				      gmlake_stream_t h, const char *op);
int gml_emu_stream_new(struct emu_dev *dev, struct emu_stream **out);
void gml_emu_stream_stop(struct emu_stream *s);
int gml_emu_stream_sync(void *priv, gmlake_stream_t h);
int gml_emu_stream_wait(void *priv, gmlake_stream_t sh, gml_event h);

#endif
