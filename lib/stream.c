/* SPDX-License-Identifier: MIT */
/*
 * Stream-ordered reuse. Each stream the context has seen gets an index and
 * a ring of recorded events with increasing sequence numbers; a guard
 * (stream, seq) is complete once the event of seq has completed, which we
 * learn by querying the ring in order.
 *
 * While a context has seen only one stream no other stream can reuse its
 * memory, so frees record nothing (seq 0). When a second stream appears,
 * one barrier event per existing stream covers every seq 0 guard before it.
 *
 * Events stay few, as FSDP's many frees on several streams need: a free
 * records nothing and queries nothing. It gets its stream's open seq,
 * which the stream's next event covers, recorded on demand by whoever
 * asks about that seq; an event recorded later completes later, which is
 * safe. Frees that must be waited for by seq record at once: blocks on
 * stitched views always (a few per step; their repair must not wait for
 * the next step's work), blocks other streams used while fewer than two
 * of the stream's events are in flight. A fit looking at many chunks polls
 * each stream once per allocation (ctx->poll_gen, gml_guard_ready_scan),
 * not once per chunk.
 *
 * When a request would otherwise cost the driver work, the allocator may
 * take memory another stream's work still covers and order the request's
 * stream after that work on the device (gml_stream_order_run: one event
 * wait per stream), as a caller of cudaStreamWaitEvent would; the host
 * never waits for it.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "types.h"

/* Never complete: for guards whose event could not be recorded. */
#define SEQ_NEVER UINT64_MAX

static int event_get(gmlake_ctx *ctx, gml_event *e)
{
	if (ctx->nevent_pool) {
		*e = ctx->event_pool[--ctx->nevent_pool];
		return 0;
	}
	return gml_dev_event_create(&ctx->dev, e);
}

static void event_put(gmlake_ctx *ctx, gml_event e)
{
	size_t cap = ctx->cap_event_pool ? ctx->cap_event_pool * 2 : 16;
	gml_event *pool;

	if (ctx->nevent_pool == ctx->cap_event_pool) {
		pool = realloc(ctx->event_pool, cap * sizeof(*pool));
		if (!pool) {
			gml_dev_event_destroy(&ctx->dev, e);
			return;
		}
		ctx->event_pool = pool;
		ctx->cap_event_pool = cap;
	}
	ctx->event_pool[ctx->nevent_pool++] = e;
}

static void poll_stream(gmlake_ctx *ctx, struct gml_stream *s);

/* Record an event on stream idx; *seq is its sequence number. */
static int record(gmlake_ctx *ctx, int idx, uint64_t *seq)
{
	struct gml_stream *s = &ctx->streams[idx];
	size_t cap, tail;
	gml_event e;
	int ret;

	/* Nothing else may look at a stream whose memory only it reuses:
	 * let go of what completed before growing. */
	if (s->count && s->count == s->cap)
		poll_stream(ctx, s);
	if (s->count == s->cap) {
		cap = s->cap ? s->cap * 2 : 16;
		void *ring = malloc(cap * sizeof(*s->pending));

		if (!ring)
			return gml_set_error(-ENOMEM, "no memory for events");
		for (size_t i = 0; i < s->count; i++)
			memcpy((char *)ring + i * sizeof(*s->pending),
			       &s->pending[(s->head + i) % (s->cap ? s->cap : 1)],
			       sizeof(*s->pending));
		free(s->pending);
		s->pending = ring;
		s->cap = cap;
		s->head = 0;
	}
	ret = event_get(ctx, &e);
	if (ret)
		return ret;
	ret = gml_dev_event_record(&ctx->dev, e, s->handle);
	if (ret) {
		event_put(ctx, e);
		return ret;
	}
	tail = (s->head + s->count) % s->cap;
	s->pending[tail].seq = ++s->next_seq;
	s->pending[tail].ev = e;
	s->count++;
	if (s->open_seq && s->open_seq <= s->next_seq)
		s->open_seq = 0;	/* this event covers it */
	*seq = s->next_seq;
	return 0;
}

/* Query events in order, advancing done_seq past completed ones. */
static void poll_stream(gmlake_ctx *ctx, struct gml_stream *s)
{
	while (s->count) {
		gml_event e = s->pending[s->head].ev;

		if (gml_dev_event_query(&ctx->dev, e))
			break;
		s->done_seq = s->pending[s->head].seq;
		event_put(ctx, e);
		s->head = (s->head + 1) % s->cap;
		s->count--;
	}
}

/* At most one poll of s per allocation or free. */
static void poll_stream_once(gmlake_ctx *ctx, struct gml_stream *s)
{
	if (s->poll_gen == ctx->poll_gen)
		return;
	s->poll_gen = ctx->poll_gen;
	poll_stream(ctx, s);
}

static bool stream_done(gmlake_ctx *ctx, int idx, uint64_t seq, bool scan)
{
	struct gml_stream *s = &ctx->streams[idx];
	uint64_t rec;

	if (s->dead)
		return true;
	if (seq == SEQ_NEVER)
		return false;
	if (seq == 0) {
		if (!s->barrier)
			return false;
		seq = s->barrier;
	}
	if (s->done_seq >= seq)
		return true;
	if (seq > s->next_seq) {
		/* The open seq: its event is recorded now, so it cannot
		 * have completed yet. */
		if (!record(ctx, idx, &rec))
			s->poll_gen = ctx->poll_gen;
		return false;
	}
	if (scan)
		poll_stream_once(ctx, s);
	else
		poll_stream(ctx, s);
	return s->done_seq >= seq;
}

/*
 * Whether stream `to` can be ordered after guard g on the device, so that
 * its memory may be taken before g's work is known complete: g names an
 * event that exists or can be recorded now.
 */
static bool guard_orderable(gmlake_ctx *ctx, const struct gml_guard *g)
{
	const struct gml_stream *s = &ctx->streams[g->stream];

	if (s->dead)
		return true;	/* its work is done */
	if (g->seq == SEQ_NEVER)
		return false;
	if (g->seq == 0)
		return s->barrier && s->barrier != SEQ_NEVER;
	return true;
}

bool gml_stream_done(gmlake_ctx *ctx, int idx, uint64_t seq)
{
	return stream_done(ctx, idx, seq, false);
}

bool gml_guard_ready_scan(gmlake_ctx *ctx, const struct gml_guard *g,
			  int want)
{
	if (g->stream < 0 || g->stream == want)
		return true;
	if (ctx->order_for == want + 1)
		return guard_orderable(ctx, g);
	return stream_done(ctx, g->stream, g->seq, true);
}

uint64_t gml_stream_last(gmlake_ctx *ctx, int idx)
{
	struct gml_stream *s = &ctx->streams[idx];

	return s->open_seq ? s->open_seq : s->next_seq;
}

/* Block until guard (idx, seq) completed: by its event, else the stream. */
int gml_stream_wait(gmlake_ctx *ctx, int idx, uint64_t seq)
{
	struct gml_stream *s = &ctx->streams[idx];
	int ret;

	if (s->dead || gml_stream_done(ctx, idx, seq))
		return 0;
	if (seq != SEQ_NEVER && seq > s->next_seq && !record(ctx, idx, &seq))
		seq = s->next_seq;	/* the open seq's event, just made */
	while (s->count && s->pending[s->head].seq <= seq &&
	       seq != SEQ_NEVER && seq != 0) {
		ret = gml_dev_event_sync(&ctx->dev, s->pending[s->head].ev);
		if (ret)
			break;
		poll_stream(ctx, s);
	}
	if (gml_stream_done(ctx, idx, seq))
		return 0;
	/* seq 0 without a barrier, or an event that failed: the stream. */
	ret = gml_dev_stream_sync(&ctx->dev, s->handle);
	if (ret)
		return ret;
	while (s->count) {
		event_put(ctx, s->pending[s->head].ev);
		s->head = (s->head + 1) % s->cap;
		s->count--;
	}
	/* The whole stream is done, the open seq with it. */
	if (s->open_seq) {
		s->next_seq = s->open_seq;
		s->open_seq = 0;
	}
	s->done_seq = s->next_seq;
	return 0;
}

bool gml_guard_ready(gmlake_ctx *ctx, const struct gml_guard *g, int want)
{
	return g->stream < 0 || g->stream == want ||
	       gml_stream_done(ctx, g->stream, g->seq);
}

/*
 * A guard for "now" on stream idx. Single-stream contexts record nothing
 * unless forced or marking always. If no event can be recorded the guard
 * never completes, so the memory stays with its own stream: safe, and the
 * free succeeds.
 */
int gml_stream_mark(gmlake_ctx *ctx, int idx, enum gml_mark how,
		    uint64_t *seq)
{
	struct gml_stream *s = &ctx->streams[idx];
	bool force = how != GML_MARK_LAZY;

	if (s->dead) {
		*seq = s->done_seq;
		return 0;
	}
	if (ctx->nstreams == 1 && !force && !ctx->mark_always) {
		*seq = 0;
		return 0;
	}
	/* No query here: a free on its own stream needs no answer, and the
	 * open seq costs nothing until another stream asks about it. A
	 * forced mark is waited for by seq: its event is recorded now unless
	 * two are still in flight after one poll. A mark made NOW is an
	 * event whatever is in flight: an open seq recorded when asked about
	 * would also cover the work queued after the free. */
	if (force && s->count >= 2) {
		ctx->poll_gen++;
		poll_stream_once(ctx, s);
	}
	if (!force || (how == GML_MARK_FORCE && s->count >= 2)) {
		s->open_seq = s->next_seq + 1;
		*seq = s->open_seq;
		return 0;
	}
	if (record(ctx, idx, seq)) {
		*seq = SEQ_NEVER;
		return -EIO;
	}
	return 0;
}

/*
 * Order stream `to` after the work guard (from, seq) covers: a wait on
 * the device for the event of seq (recorded now for an open seq), so the
 * caller may reuse the memory at once. Never a wait on the host: without
 * an event to wait on it fails, and the caller passes the memory over.
 */
static int stream_order(gmlake_ctx *ctx, int from, uint64_t seq, int to)
{
	struct gml_stream *s = &ctx->streams[from];

	if (stream_done(ctx, from, seq, true))
		return 0;
	if (seq == SEQ_NEVER || seq > s->next_seq)
		return -EAGAIN;		/* no event covers it */
	for (size_t i = 0; i < s->count; i++) {
		size_t k = (s->head + i) % s->cap;

		if (s->pending[k].seq >= seq)
			return gml_dev_stream_wait_event(&ctx->dev,
						       ctx->streams[to].handle,
						       s->pending[k].ev);
	}
	return 0;	/* every event up to seq completed in the meantime */
}

/*
 * After a fit in ordering mode (gml_guard_ready_scan with ctx->order_for
 * set): order stream `to` after every other stream's guard on the n
 * chunks, one wait per stream, the latest seq of each. On failure the
 * memory must not be used; the waits made stay, which only delays `to`.
 */
int gml_stream_order_run(gmlake_ctx *ctx, struct gml_chunk *const *chunks,
			 uint32_t n, int to)
{
	uint64_t gen = ++ctx->order_pass;
	int ret = 0;

	for (uint32_t i = 0; i < n; i++) {
		const struct gml_guard *g = &chunks[i]->guard;
		struct gml_stream *s;
		uint64_t seq;

		if (g->stream < 0 || g->stream == to)
			continue;
		s = &ctx->streams[g->stream];
		seq = g->seq ? g->seq : s->barrier;	/* seq 0: the barrier */
		if (s->order_gen != gen || s->order_seq < seq) {
			s->order_gen = gen;
			s->order_seq = seq;
		}
	}
	for (int i = 0; i < ctx->nstreams && !ret; i++)
		if (ctx->streams[i].order_gen == gen)
			ret = stream_order(ctx, i, ctx->streams[i].order_seq,
					   to);
	return ret;
}

static int add_stream(gmlake_ctx *ctx, gmlake_stream_t handle)
{
	struct gml_stream *s;
	struct gml_spool *sp;
	int cap;

	if (ctx->nstreams == ctx->cap_streams) {
		cap = ctx->cap_streams ? ctx->cap_streams * 2 : 4;
		s = realloc(ctx->streams, cap * sizeof(*s));
		if (!s)
			return -ENOMEM;
		ctx->streams = s;
		sp = realloc(ctx->spools, cap * sizeof(*sp));
		if (!sp)
			return -ENOMEM;
		ctx->spools = sp;
		ctx->cap_streams = cap;
	}
	memset(&ctx->streams[ctx->nstreams], 0, sizeof(*ctx->streams));
	memset(&ctx->spools[ctx->nstreams], 0, sizeof(*ctx->spools));
	ctx->streams[ctx->nstreams].handle = handle;
	return ctx->nstreams++;
}

/* Index of a stream the context has seen, or -1. */
int gml_stream_find(gmlake_ctx *ctx, gmlake_stream_t handle)
{
	for (int i = 0; i < ctx->nstreams; i++)
		if (ctx->streams[i].handle == handle)
			return i;
	return -1;
}

/*
 * The index of a stream, registering it on first sight. Registration
 * records an event on it, which also proves the handle valid. The second
 * stream to appear puts a barrier on the first.
 */
int gml_stream_index(gmlake_ctx *ctx, gmlake_stream_t handle, int *idx)
{
	uint64_t seq;
	int i, ret;

	i = gml_stream_find(ctx, handle);
	if (i >= 0) {
		*idx = i;
		return 0;
	}
	i = add_stream(ctx, handle);
	if (i < 0)
		return gml_set_error(-ENOMEM, "no memory for a stream");
	ret = record(ctx, i, &seq);
	if (ret) {
		/* The cause lives in the buffer the new message goes to. */
		char cause[128];

		snprintf(cause, sizeof(cause), "%s", gmlake_last_error());
		free(ctx->streams[i].pending);
		ctx->nstreams--;
		return gml_set_error(ret == -ENOMEM ? -ENOMEM : -EINVAL,
				     "stream %p cannot be used: %s",
				     (void *)handle, cause);
	}
	/* A destroyed first stream needs no barrier: its work is done. */
	if (ctx->nstreams == 2 && !ctx->streams[0].dead)
		ctx->streams[0].barrier = record(ctx, 0, &seq) ? SEQ_NEVER : seq;
	*idx = i;
	return 0;
}

/*
 * From now on frees record events even on a single stream, and a barrier
 * covers the unrecorded guards so far: the offload engine moves free
 * chunks between ranges, which it may do only once their work is done,
 * and a guard that says nothing would never let it.
 */
void gml_streams_mark_always(gmlake_ctx *ctx)
{
	uint64_t seq;

	if (ctx->mark_always)
		return;
	ctx->mark_always = true;
	if (ctx->nstreams == 1 && !ctx->streams[0].dead &&
	    !ctx->streams[0].barrier)
		ctx->streams[0].barrier = record(ctx, 0, &seq) ? SEQ_NEVER : seq;
}

/* Destroy the pooled events (trim); recorded ones stay. */
void gml_events_trim(gmlake_ctx *ctx)
{
	for (size_t k = 0; k < ctx->nevent_pool; k++)
		gml_dev_event_destroy(&ctx->dev, ctx->event_pool[k]);
	ctx->nevent_pool = 0;
}

void gml_streams_fini(gmlake_ctx *ctx)
{
	for (int i = 0; i < ctx->nstreams; i++) {
		struct gml_stream *s = &ctx->streams[i];

		for (size_t k = 0; k < s->count; k++)
			gml_dev_event_destroy(&ctx->dev,
					  s->pending[(s->head + k) % s->cap].ev);
		free(s->pending);
	}
	gml_events_trim(ctx);
	free(ctx->event_pool);
	free(ctx->streams);
	ctx->event_pool = NULL;
	ctx->streams = NULL;
	ctx->nstreams = 0;
}
