/* SPDX-License-Identifier: MIT */
/*
 * Small blocks (below small_size): packed into one-chunk large blocks, one
 * pool per stream, with best fit, split and coalesce in 512-byte units, as
 * caching allocators do. A small chunk that empties goes back to the large
 * pool, guarded by its stream, so it costs no driver call to move memory
 * between small and large use; but one emptied chunk per stream stays
 * (idle) until another empties or the cache is trimmed, since a tensor
 * allocated and freed over and over would otherwise take and give back a
 * large block each time (on the H200, through PyTorch, such a small
 * request cost about 2 us more than a 1 MiB one: bench/results/
 * alloc_cost.md).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "types.h"

static bool piece_less(const struct gml_block *a, const struct gml_block *b)
{
	return a->alloc_size < b->alloc_size ||
	       (a->alloc_size == b->alloc_size && a->ptr < b->ptr);
}

/* First index whose piece is not less than key. */
static size_t lower_bound(const struct gml_spool *sp, const struct gml_block *key)
{
	size_t lo = 0, hi = sp->count;

	while (lo < hi) {
		size_t mid = (lo + hi) / 2;

		if (piece_less(sp->free[mid], key))
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static int pool_insert(struct gml_spool *sp, struct gml_block *p)
{
	size_t i;

	if (sp->count == sp->cap) {
		size_t cap = sp->cap ? sp->cap * 2 : 64;
		struct gml_block **grown = realloc(sp->free, cap * sizeof(*grown));

		if (!grown)
			return -ENOMEM;
		sp->free = grown;
		sp->cap = cap;
	}
	i = lower_bound(sp, p);
	memmove(&sp->free[i + 1], &sp->free[i],
		(sp->count - i) * sizeof(*sp->free));
	sp->free[i] = p;
	sp->count++;
	p->free = true;
	return 0;
}

static void pool_remove(struct gml_spool *sp, struct gml_block *p)
{
	size_t i = lower_bound(sp, p);

	if (i < sp->count && sp->free[i] == p) {
		memmove(&sp->free[i], &sp->free[i + 1],
			(sp->count - i - 1) * sizeof(*sp->free));
		sp->count--;
	}
	p->free = false;
}

/* A new small chunk for stream: one free piece over all of it. */
static int schunk_new(gmlake_ctx *ctx, int stream)
{
	struct gml_schunk *sc = calloc(1, sizeof(*sc));
	struct gml_block *p = calloc(1, sizeof(*p));
	int ret;

	if (!sc || !p) {
		ret = gml_set_error(-ENOMEM, "no host memory for a small chunk");
		goto out_free;
	}
	ret = gml_large_alloc(ctx, ctx->chunk, stream, &sc->backing);
	if (ret)
		goto out_free;
	sc->stream = stream;
	sc->first = p;
	p->small = true;
	p->sc = sc;
	p->stream = stream;
	p->ptr = sc->backing->ptr;
	p->alloc_size = ctx->chunk;
	ret = pool_insert(&ctx->spools[stream], p);
	if (ret) {
		struct gml_guard g = { stream, 0 };

		gml_large_free(ctx, sc->backing, &g);
		gml_set_error(ret, "no host memory for a small chunk");
		goto out_free;
	}
	gml_gauge_add(&ctx->st.small_chunks, 1);
	return 0;
out_free:
	free(p);
	free(sc);
	return ret;
}

/* Give an empty chunk back to the large pool, its one piece with it. */
static void schunk_release(gmlake_ctx *ctx, struct gml_spool *sp,
			   struct gml_schunk *sc, const struct gml_guard *g)
{
	pool_remove(sp, sc->first);
	gml_large_free(ctx, sc->backing, g);
	free(sc->first);
	free(sc);
	gml_gauge_add(&ctx->st.small_chunks, -1);
}

/*
 * sc is empty (its one piece sc->first): it becomes its stream's idle chunk
 * under guard g, or goes back when the stream has one already or is
 * destroyed (nothing asks it again). Whether it went.
 */
static bool schunk_emptied(gmlake_ctx *ctx, struct gml_spool *sp,
			   struct gml_schunk *sc, const struct gml_guard *g)
{
	if (sp->idle || ctx->streams[sc->stream].dead) {
		schunk_release(ctx, sp, sc, g);
		return true;
	}
	sp->idle = sc;
	sp->idle_guard = *g;
	return false;
}

int gml_small_alloc(gmlake_ctx *ctx, size_t size, int stream,
		    struct gml_block **out)
{
	struct gml_spool *sp = &ctx->spools[stream];
	size_t rsize = gml_align_up(size);
	struct gml_block key = { .alloc_size = rsize, .ptr = 0 };
	struct gml_block *p, *rest;
	size_t i;
	int ret;

	ctx->poll_gen++;
	i = lower_bound(sp, &key);
	if (i == sp->count) {
		ret = schunk_new(ctx, stream);
		if (ret)
			return ret;
		i = lower_bound(sp, &key);
	}
	p = sp->free[i];
	if (p->alloc_size - rsize >= GML_ALIGN) {
		rest = calloc(1, sizeof(*rest));
		if (!rest) {
			/* A chunk just made for this request stays idle or
			 * goes: never empty and unaccounted for. */
			if (!p->sc->used && p->sc != sp->idle) {
				struct gml_guard own = { stream, 0 };

				schunk_emptied(ctx, sp, p->sc, &own);
			}
			return gml_set_error(-ENOMEM, "no host memory for a block");
		}
		pool_remove(sp, p);
		rest->small = true;
		rest->sc = p->sc;
		rest->stream = stream;
		rest->ptr = p->ptr + rsize;
		rest->alloc_size = p->alloc_size - rsize;
		rest->prev = p;
		rest->next = p->next;
		if (p->next)
			p->next->prev = rest;
		p->next = rest;
		p->alloc_size = rsize;
		if (pool_insert(sp, rest)) {
			/* Keep it out of the pool: it merges back on free. */
			rest->free = true;
		}
	} else {
		pool_remove(sp, p);
	}
	if (p->sc == sp->idle)
		sp->idle = NULL;
	p->free = false;
	p->size = size;
	p->sc->used += p->alloc_size;
	*out = p;
	return 0;
}

/* Merge b's free neighbour next into b. */
static void absorb(struct gml_spool *sp, struct gml_block *b,
		   struct gml_block *next)
{
	pool_remove(sp, next);
	b->alloc_size += next->alloc_size;
	b->next = next->next;
	if (next->next)
		next->next->prev = b;
	free(next);
}

/*
 * The guard under which an emptied chunk leaves its stream: all the work
 * queued there so far, for its other pieces were freed on that stream with
 * work of theirs maybe still queued. g covers it when the free was on the
 * chunk's stream; a deferred free (g: no stream) marks the stream now.
 */
static struct gml_guard leaving_guard(gmlake_ctx *ctx, struct gml_schunk *sc,
				      const struct gml_guard *g)
{
	struct gml_guard own = { sc->stream, 0 };

	if (g->stream == sc->stream)
		return *g;
	gml_stream_mark(ctx, sc->stream, GML_MARK_FORCE, &own.seq);
	return own;
}

void gml_small_free(gmlake_ctx *ctx, struct gml_block *b,
		    const struct gml_guard *g)
{
	struct gml_spool *sp = &ctx->spools[b->stream];
	struct gml_schunk *sc = b->sc;

	sc->used -= b->alloc_size;
	free(b->extra);
	b->extra = NULL;
	b->nextra = 0;
	b->size = 0;
	if (b->next && b->next->free)
		absorb(sp, b, b->next);
	if (b->prev && b->prev->free) {
		struct gml_block *prev = b->prev;

		pool_remove(sp, prev);
		absorb(sp, prev, b);
		b = prev;
	}
	if (sc->used == 0) {
		struct gml_guard leave = leaving_guard(ctx, sc, g);

		if (schunk_emptied(ctx, sp, sc, &leave))
			return;
	}
	if (pool_insert(sp, b))
		b->free = true;
}

void gml_small_trim(gmlake_ctx *ctx, int stream)
{
	for (int s = stream < 0 ? 0 : stream;
	     s < (stream < 0 ? ctx->nstreams : stream + 1); s++) {
		struct gml_spool *sp = &ctx->spools[s];
		struct gml_schunk *sc = sp->idle;

		if (!sc)
			continue;
		sp->idle = NULL;
		schunk_release(ctx, sp, sc, &sp->idle_guard);
	}
}

void gml_spools_fini(gmlake_ctx *ctx)
{
	for (int s = 0; s < ctx->nstreams; s++)
		free(ctx->spools[s].free);
	free(ctx->spools);
	ctx->spools = NULL;
}
