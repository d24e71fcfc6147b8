/* SPDX-License-Identifier: MIT */
/*
 * The emulated device's streams and events (drv_emu.c says how they
 * work): a worker thread per stream running its queue of copies, event
 * records, waits and host functions in order.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif

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
/* Streams and events                                                  */

static void emu_event_put(struct emu_dev *dev, struct emu_event *ev)
{
	pthread_mutex_lock(&dev->ev_lock);
	if (!--ev->refs)
		free(ev);
	pthread_mutex_unlock(&dev->ev_lock);
}

static void emu_item_run(struct emu_dev *dev, struct emu_item *it)
{
	switch (it->kind) {
	case EMU_ITEM_COPY:
		memmove(it->dst, it->src, it->size);
		return;
	case EMU_ITEM_FUNC:
		it->fn(it->arg);
		return;
	case EMU_ITEM_WAIT:
		pthread_mutex_lock(&dev->ev_lock);
		while (it->ev->done_gen < it->gen)
			pthread_cond_wait(&dev->ev_cond, &dev->ev_lock);
		if (!--it->ev->refs)
			free(it->ev);
		pthread_mutex_unlock(&dev->ev_lock);
		return;
	case EMU_ITEM_MARK:
		break;
	}
	pthread_mutex_lock(&dev->ev_lock);
	if (it->gen > it->ev->done_gen)
		it->ev->done_gen = it->gen;
	pthread_cond_broadcast(&dev->ev_cond);
	if (!--it->ev->refs)
		free(it->ev);
	pthread_mutex_unlock(&dev->ev_lock);
}

/* A stream's worker: run items in order until stopped and drained. */
static void *emu_worker(void *arg)
{
	struct emu_stream *s = arg;
	struct emu_item *it;

	pthread_setname_np(pthread_self(), "gmlake-emu");	/* for top -H */
	pthread_mutex_lock(&s->lock);
	for (;;) {
		while (!s->stop &&
		       (s->hold || gml_emu_lagging(s->dev) || !s->head))
			pthread_cond_wait(&s->work, &s->lock);
		it = s->head;
		if (!it)
			break;
		s->head = it->next;
		if (!s->head)
			s->tail = &s->head;
		s->busy = true;
		pthread_mutex_unlock(&s->lock);

		emu_item_run(s->dev, it);
		free(it);

		pthread_mutex_lock(&s->lock);
		s->busy = false;
		if (!s->head)
			pthread_cond_broadcast(&s->idle);
	}
	pthread_mutex_unlock(&s->lock);
	return NULL;
}

int gml_emu_stream_new(struct emu_dev *dev, struct emu_stream **out)
{
	struct emu_stream *s = calloc(1, sizeof(*s));

	if (!s)
		return -ENOMEM;
	if (pthread_mutex_init(&s->lock, NULL))
		goto out_free;
	if (pthread_cond_init(&s->work, NULL))
		goto out_destroy_lock;
	if (pthread_cond_init(&s->idle, NULL))
		goto out_destroy_work;
	s->dev = dev;
	s->tail = &s->head;
	s->refs = 1;
	*out = s;
	return 0;

out_destroy_work:
	pthread_cond_destroy(&s->work);
out_destroy_lock:
	pthread_mutex_destroy(&s->lock);
out_free:
	free(s);
	return -ENOMEM;
}

/* Let go of any hold, run what is queued, and join the worker. */
void gml_emu_stream_stop(struct emu_stream *s)
{
	bool started;

	pthread_mutex_lock(&s->lock);
	s->stop = true;
	s->hold = false;
	started = s->started;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->lock);
	if (started)
		pthread_join(s->thread, NULL);
}

void gml_emu_stream_free(struct emu_stream *s)
{
	pthread_cond_destroy(&s->idle);
	pthread_cond_destroy(&s->work);
	pthread_mutex_destroy(&s->lock);
	free(s);
}

/* Drop a reference to a stopped (or built-in) stream; dev->lock held. */
static void emu_stream_put(struct emu_stream *s)
{
	if (!--s->refs)
		gml_emu_stream_free(s);
}

/* The stream behind a handle (NULL: the default one), or NULL. */
struct emu_stream *gml_emu_stream_get(struct emu_dev *dev,
				      gmlake_stream_t h, const char *op)
{
	struct emu_stream *s;

	if (!h)
		return dev->null_stream;
	s = gml_emu_table_get(&dev->streams, (uintptr_t)h);
	if (!s)
		gml_set_error(-EINVAL, "emu: %s: unknown stream %p", op,
			      (void *)h);
	return s;
}

/* Start the worker if need be, then queue it; dev->lock held. */
static int emu_enqueue(struct emu_stream *s, struct emu_item *it)
{
	int err;

	pthread_mutex_lock(&s->lock);
	if (!s->started) {
		err = pthread_create(&s->thread, NULL, emu_worker, s);
		if (err) {
			pthread_mutex_unlock(&s->lock);
			return gml_set_error(-err,
				"emu: cannot start a stream worker: %s",
				strerror(err));
		}
		s->started = true;
	}
	it->next = NULL;
	*s->tail = it;
	s->tail = &it->next;
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->lock);
	return 0;
}

int gml_emu_stream_create(void *priv, gmlake_stream_t *out)
{
	struct emu_dev *dev = priv;
	struct emu_stream *s;
	int ret;

	if (!out)
		return gml_set_error(-EINVAL,
			"emu: stream_create: NULL stream");
	if (gml_emu_stream_new(dev, &s))
		return gml_set_error(-ENOMEM,
			"emu: stream_create: out of host memory");
	pthread_mutex_lock(&dev->lock);
	ret = gml_emu_table_add(&dev->streams, s, &s->id);
	pthread_mutex_unlock(&dev->lock);
	if (ret) {
		gml_emu_stream_free(s);
		return gml_set_error(ret,
			"emu: stream_create: out of host memory");
	}
	*out = (gmlake_stream_t)(uintptr_t)s->id;
	return 0;
}

/* Queued work still runs (even on a held stream) before the stream goes. */
int gml_emu_stream_destroy(void *priv, gmlake_stream_t h)
{
	struct emu_dev *dev = priv;
	struct emu_stream *s;

	if (!h)
		return gml_set_error(-EINVAL,
			"emu: stream_destroy: the default stream cannot be destroyed");
	pthread_mutex_lock(&dev->lock);
	s = gml_emu_stream_get(dev, h, "stream_destroy");
	if (!s) {
		pthread_mutex_unlock(&dev->lock);
		return -EINVAL;
	}
	/* Its queued work may wait on other streams' events. */
	gml_emu_catch_up_begin(dev);
	gml_emu_table_del(&dev->streams, s->id);
	pthread_mutex_unlock(&dev->lock);

	gml_emu_stream_stop(s);

	pthread_mutex_lock(&dev->lock);
	gml_emu_catch_up_end(dev);
	emu_stream_put(s);
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

/* Wake stream s's worker to look at its queue again; dev->lock held. */
static void emu_wake(struct emu_stream *s)
{
	pthread_mutex_lock(&s->lock);
	pthread_cond_signal(&s->work);
	pthread_mutex_unlock(&s->lock);
}

/*
 * A host wait on a lagging device (emu_lag) lets every stream run until
 * the wait returns: the one waited for may wait on another's event.
 * Workers take no new item once the last wait ends. dev->lock held.
 */
void gml_emu_catch_up_begin(struct emu_dev *dev)
{
	if (!dev->lag)
		return;
	atomic_fetch_add_explicit(&dev->catching, 1, memory_order_release);
	emu_wake(dev->null_stream);
	for (uint32_t i = 0; i < dev->streams.len; i++)
		if (dev->streams.slot[i].obj)
			emu_wake(dev->streams.slot[i].obj);
}

void gml_emu_catch_up_end(struct emu_dev *dev)
{
	if (dev->lag)
		atomic_fetch_sub_explicit(&dev->catching, 1,
					  memory_order_release);
}

int gml_emu_stream_sync(void *priv, gmlake_stream_t h)
{
	struct emu_dev *dev = priv;
	struct emu_stream *s;

	pthread_mutex_lock(&dev->lock);
	s = gml_emu_stream_get(dev, h, "stream_sync");
	if (s) {
		s->refs++;
		gml_emu_catch_up_begin(dev);
	}
	pthread_mutex_unlock(&dev->lock);
	if (!s)
		return -EINVAL;

	pthread_mutex_lock(&s->lock);
	while (s->head || s->busy)
		pthread_cond_wait(&s->idle, &s->lock);
	pthread_mutex_unlock(&s->lock);

	pthread_mutex_lock(&dev->lock);
	gml_emu_catch_up_end(dev);
	emu_stream_put(s);
	pthread_mutex_unlock(&dev->lock);
	return 0;
}

int gml_emu_event_create(void *priv, gml_event *out)
{
	struct emu_dev *dev = priv;
	struct emu_event *ev;
	int ret;

	if (!out)
		return gml_set_error(-EINVAL, "emu: event_create: NULL event");
	ev = calloc(1, sizeof(*ev));
	if (!ev)
		return gml_set_error(-ENOMEM,
			"emu: event_create: out of host memory");
	ev->refs = 1;
	pthread_mutex_lock(&dev->lock);
	ret = gml_emu_table_add(&dev->events, ev, &ev->id);
	pthread_mutex_unlock(&dev->lock);
	if (ret) {
		free(ev);
		return gml_set_error(ret,
			"emu: event_create: out of host memory");
	}
	*out = (gml_event)(uintptr_t)ev->id;
	return 0;
}

static struct emu_event *emu_event_get(struct emu_dev *dev, gml_event h,
				       const char *op)
{
	struct emu_event *ev = gml_emu_table_get(&dev->events, (uintptr_t)h);

	if (!ev)
		gml_set_error(-EINVAL, "emu: %s: unknown event %p", op, h);
	return ev;
}

/* Like cuEventDestroy: a pending record still completes, unseen. */
int gml_emu_event_destroy(void *priv, gml_event h)
{
	struct emu_dev *dev = priv;
	struct emu_event *ev;

	pthread_mutex_lock(&dev->lock);
	ev = emu_event_get(dev, h, "event_destroy");
	if (ev)
		gml_emu_table_del(&dev->events, ev->id);
	pthread_mutex_unlock(&dev->lock);
	if (!ev)
		return -EINVAL;
	emu_event_put(dev, ev);
	return 0;
}

/*
 * A new item of kind about event h for stream sh, with dev->lock taken
 * and *s set; NULL with the lock let go and *err set when the memory, the
 * event or the stream is missing.
 */
static struct emu_item *emu_item_for(struct emu_dev *dev, int kind,
				     gml_event h, gmlake_stream_t sh,
				     const char *op, struct emu_stream **s,
				     int *err)
{
	struct emu_item *it = calloc(1, sizeof(*it));

	if (!it) {
		*err = gml_set_error(-ENOMEM, "emu: %s: out of host memory",
				     op);
		return NULL;
	}
	it->kind = kind;
	pthread_mutex_lock(&dev->lock);
	it->ev = emu_event_get(dev, h, op);
	*s = gml_emu_stream_get(dev, sh, op);
	if (!it->ev || !*s) {
		pthread_mutex_unlock(&dev->lock);
		free(it);
		*err = -EINVAL;
		return NULL;
	}
	return it;
}

int gml_emu_event_record(void *priv, gml_event h, gmlake_stream_t sh)
{
	struct emu_dev *dev = priv;
	struct emu_item *it;
	struct emu_stream *s;
	int ret;

	it = emu_item_for(dev, EMU_ITEM_MARK, h, sh, "event_record", &s, &ret);
	if (!it)
		return ret;
	/*
	 * An idle stream reaches the marker at once, as an idle GPU does:
	 * completing it here keeps runs without device work deterministic.
	 * Records happen under dev->lock, so nothing is queued meanwhile.
	 */
	pthread_mutex_lock(&s->lock);
	if (!s->head && !s->busy && !s->hold && !dev->lag) {
		pthread_mutex_lock(&dev->ev_lock);
		it->ev->done_gen = ++it->ev->rec_gen;
		pthread_cond_broadcast(&dev->ev_cond);
		pthread_mutex_unlock(&dev->ev_lock);
		pthread_mutex_unlock(&s->lock);
		pthread_mutex_unlock(&dev->lock);
		free(it);
		return 0;
	}
	pthread_mutex_unlock(&s->lock);
	/* Hold a marker's reference before the worker can drop it. */
	pthread_mutex_lock(&dev->ev_lock);
	it->gen = ++it->ev->rec_gen;
	it->ev->refs++;
	pthread_mutex_unlock(&dev->ev_lock);
	ret = emu_enqueue(s, it);
	if (!ret) {
		pthread_mutex_unlock(&dev->lock);
		return 0;
	}
	/* Records happen under dev->lock only, so no later one exists. */
	pthread_mutex_lock(&dev->ev_lock);
	it->ev->rec_gen--;
	it->ev->refs--;
	pthread_mutex_unlock(&dev->ev_lock);
	pthread_mutex_unlock(&dev->lock);
	free(it);
	return ret;
}

int gml_emu_event_query(void *priv, gml_event h)
{
	struct emu_dev *dev = priv;
	struct emu_event *ev;
	int ret;

	pthread_mutex_lock(&dev->lock);
	ev = emu_event_get(dev, h, "event_query");
	if (ev) {
		pthread_mutex_lock(&dev->ev_lock);
		ret = ev->done_gen >= ev->rec_gen ? 0 : -EBUSY;
		pthread_mutex_unlock(&dev->ev_lock);
	} else {
		ret = -EINVAL;
	}
	pthread_mutex_unlock(&dev->lock);
	return ret;
}

/* Wait for the last record made before the call. */
int gml_emu_event_sync(void *priv, gml_event h)
{
	struct emu_dev *dev = priv;
	struct emu_event *ev;
	uint64_t target;

	pthread_mutex_lock(&dev->lock);
	ev = emu_event_get(dev, h, "event_sync");
	if (!ev) {
		pthread_mutex_unlock(&dev->lock);
		return -EINVAL;
	}
	gml_emu_catch_up_begin(dev);
	pthread_mutex_lock(&dev->ev_lock);
	pthread_mutex_unlock(&dev->lock);
	target = ev->rec_gen;
	ev->refs++;
	while (ev->done_gen < target)
		pthread_cond_wait(&dev->ev_cond, &dev->ev_lock);
	if (!--ev->refs)
		free(ev);
	pthread_mutex_unlock(&dev->ev_lock);
	gml_emu_catch_up_end(dev);
	return 0;
}

/* Device sides must be mapped with access when the copy is queued. */
static int emu_memcpy_check(struct emu_dev *dev, void *dst, const void *src,
			    size_t size, enum gml_copy_kind kind)
{
	bool dst_dev = kind == GML_COPY_HTOD || kind == GML_COPY_DTOD;
	bool src_dev = kind == GML_COPY_DTOH || kind == GML_COPY_DTOD;

	if (dst_dev && !gml_emu_dev_range_ok(dev, dst, size))
		return gml_set_error(-EINVAL,
			"emu: memcpy: destination [%p, +%zu) is not accessible device memory",
			dst, size);
	if (src_dev && !gml_emu_dev_range_ok(dev, src, size))
		return gml_set_error(-EINVAL,
			"emu: memcpy: source [%p, +%zu) is not accessible device memory",
			src, size);
	return 0;
}

int gml_emu_memcpy_async(void *priv, void *dst, const void *src,
			 size_t size, enum gml_copy_kind kind,
			 gmlake_stream_t sh)
{
	struct emu_dev *dev = priv;
	struct emu_stream *s;
	struct emu_item *it;
	int ret;

	if (kind != GML_COPY_HTOD && kind != GML_COPY_DTOH &&
	    kind != GML_COPY_DTOD)
		return gml_set_error(-EINVAL,
			"emu: memcpy: unknown copy kind %d",
				     (int)kind);
	if (size && (!dst || !src))
		return gml_set_error(-EINVAL, "emu: memcpy: NULL %s",
				     dst ? "source" : "destination");
	it = calloc(1, sizeof(*it));
	if (!it)
		return gml_set_error(-ENOMEM,
			"emu: memcpy: out of host memory");
	it->kind = EMU_ITEM_COPY;
	it->dst = dst;
	it->src = src;
	it->size = size;

	pthread_mutex_lock(&dev->lock);
	s = gml_emu_stream_get(dev, sh, "memcpy");
	if (!s) {
		ret = -EINVAL;
		goto out_unlock;
	}
	ret = size ? emu_memcpy_check(dev, dst, src, size, kind) : 0;
	if (ret || !size)
		goto out_unlock;
	ret = emu_enqueue(s, it);
	if (ret)
		goto out_unlock;
	pthread_mutex_unlock(&dev->lock);
	return 0;

out_unlock:
	pthread_mutex_unlock(&dev->lock);
	free(it);
	return ret;
}

/* Like cuStreamWaitEvent: wait for the last record made before the call. */
int gml_emu_stream_wait(void *priv, gmlake_stream_t sh, gml_event h)
{
	struct emu_dev *dev = priv;
	struct emu_item *it;
	struct emu_stream *s;
	int ret;

	it = emu_item_for(dev, EMU_ITEM_WAIT, h, sh, "stream_wait", &s, &ret);
	if (!it)
		return ret;
	pthread_mutex_lock(&dev->ev_lock);
	it->gen = it->ev->rec_gen;
	/*
	 * A wait for work already done orders nothing, as on a GPU: queued,
	 * it would keep the stream busy until its worker got to it, and a
	 * record meanwhile would complete on the worker's time instead of at
	 * once, which made replays differ from run to run.
	 */
	if (it->ev->done_gen >= it->gen) {
		pthread_mutex_unlock(&dev->ev_lock);
		pthread_mutex_unlock(&dev->lock);
		free(it);
		return 0;
	}
	it->ev->refs++;
	pthread_mutex_unlock(&dev->ev_lock);
	ret = emu_enqueue(s, it);
	if (!ret) {
		pthread_mutex_unlock(&dev->lock);
		return 0;
	}
	pthread_mutex_lock(&dev->ev_lock);
	it->ev->refs--;
	pthread_mutex_unlock(&dev->ev_lock);
	pthread_mutex_unlock(&dev->lock);
	free(it);
	return ret;
}

/* Like cuLaunchHostFunc: the stream's worker calls fn(arg) in order. */
int gml_emu_host_func(void *priv, gmlake_stream_t sh, void (*fn)(void *),
		      void *arg)
{
	struct emu_dev *dev = priv;
	struct emu_item *it;
	struct emu_stream *s;
	int ret;

	if (!fn)
		return gml_set_error(-EINVAL, "emu: host_func: NULL function");
	it = calloc(1, sizeof(*it));
	if (!it)
		return gml_set_error(-ENOMEM,
			"emu: host_func: out of host memory");
	it->kind = EMU_ITEM_FUNC;
	it->fn = fn;
	it->arg = arg;
	pthread_mutex_lock(&dev->lock);
	s = gml_emu_stream_get(dev, sh, "host_func");
	ret = s ? emu_enqueue(s, it) : -EINVAL;
	pthread_mutex_unlock(&dev->lock);
	if (ret)
		free(it);
	return ret;
}
