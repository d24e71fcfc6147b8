/* SPDX-License-Identifier: MIT */
/*
 * Snapshots: what a context holds, range by range and piece by piece,
 * read under the context's lock without a driver call (include/
 * gmlake-snapshot.h says what the ranges and pieces are), and the size of
 * the cache.
 *
 * A view's positions are walked in order. A block that lives on the view
 * (live, freed and waiting for other streams, or the one-chunk block
 * behind a small chunk) covers its run; a position without such a block
 * is free when its chunk has no owner and "elsewhere" when the chunk's
 * owner lives on another view. Positions without a chunk end a range,
 * except under a spilled block, which keeps its run (offload/). Blocks
 * that share a chunk (lib/pack.c) each show their own bytes, the free
 * bytes between them a free piece.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "gmlake-snapshot.h"
#include "error.h"
#include "types.h"

/* A block found on a view, with what it shows as. */
struct owner {
	const struct gml_block *b;
	const struct gml_schunk *sc;	/* b backs this small chunk */
	uint32_t state;			/* enum gmlake_piece_state */
};

struct builder {
	gmlake_ctx *ctx;
	struct owner *owners;
	size_t nowners, cap_owners;
	struct gmlake_snap_range *ranges;
	size_t nranges, cap_ranges;
	struct gmlake_snap_piece *pieces;
	size_t npieces, cap_pieces;
	struct gmlake_snap_range *cur;	/* the range being filled, or NULL */
};

/* Room for one more element of size elem in *arr (of *cap). */
static int reserve(void **arr, size_t *cap, size_t n, size_t elem)
{
	size_t want;
	void *grown;

	if (n < *cap)
		return 0;
	want = *cap ? *cap * 2 : 64;
	grown = realloc(*arr, want * elem);
	if (!grown)
		return gml_set_error(-ENOMEM, "snapshot: no host memory");
	*arr = grown;
	*cap = want;
	return 0;
}

static int add_owner(struct builder *bd, const struct gml_block *b,
		     const struct gml_schunk *sc, uint32_t state)
{
	if (reserve((void **)&bd->owners, &bd->cap_owners, bd->nowners,
		    sizeof(*bd->owners)))
		return -ENOMEM;
	bd->owners[bd->nowners++] = (struct owner){ b, sc, state };
	return 0;
}

static int owner_cmp(const void *x, const void *y)
{
	const struct gml_block *a = ((const struct owner *)x)->b;
	const struct gml_block *b = ((const struct owner *)y)->b;

	if (a->view != b->view)
		return (uintptr_t)a->view < (uintptr_t)b->view ? -1 : 1;
	return a->ptr < b->ptr ? -1 : a->ptr > b->ptr;	/* pos order too */
}

static int sc_cmp(const void *x, const void *y)
{
	uintptr_t a = (uintptr_t)*(struct gml_schunk *const *)x;
	uintptr_t b = (uintptr_t)*(struct gml_schunk *const *)y;

	return a < b ? -1 : a > b;
}

/* The small chunks in use or kept idle, each once, in *out (malloc'd). */
static int small_chunks(gmlake_ctx *ctx, struct gml_schunk ***out, size_t *n)
{
	struct gml_schunk **scs = NULL;
	size_t count = 0, cap = 0, i, j;
	struct gml_block *b;
	int pass;

	for (pass = 0; pass < 2; pass++)
		for (b = pass ? ctx->deferred : ctx->live; b; b = b->lnext) {
			if (!b->small)
				continue;
			if (reserve((void **)&scs, &cap, count, sizeof(*scs)))
				goto out_nomem;
			scs[count++] = b->sc;
		}
	for (int s = 0; s < ctx->nstreams; s++) {
		struct gml_spool *sp = &ctx->spools[s];

		for (i = 0; i <= sp->count; i++) {
			struct gml_schunk *sc = i < sp->count ?
						sp->free[i]->sc : sp->idle;

			if (!sc)
				continue;
			if (reserve((void **)&scs, &cap, count, sizeof(*scs)))
				goto out_nomem;
			scs[count++] = sc;
		}
	}
	if (count)
		qsort(scs, count, sizeof(*scs), sc_cmp);
	for (i = j = 0; i < count; i++)
		if (!j || scs[j - 1] != scs[i])
			scs[j++] = scs[i];
	*out = scs;
	*n = j;
	return 0;
out_nomem:
	free(scs);
	return -ENOMEM;
}

/* Every block that covers positions of a view, sorted by (view, pos). */
static int collect_owners(struct builder *bd)
{
	gmlake_ctx *ctx = bd->ctx;
	struct gml_schunk **scs = NULL;
	const struct gml_block *b;
	size_t nsc = 0;
	int ret;

	for (b = ctx->live; b; b = b->lnext) {
		if (b->small)
			continue;
		ret = add_owner(bd, b, NULL,
				b->off_state == GML_OFF_SPILLED ?
				GMLAKE_PIECE_SPILLED : GMLAKE_PIECE_ALLOCATED);
		if (ret)
			return ret;
	}
	for (b = ctx->deferred; b; b = b->lnext)
		if (!b->small &&
		    add_owner(bd, b, NULL, GMLAKE_PIECE_PENDING_FREE))
			return -ENOMEM;
	ret = small_chunks(ctx, &scs, &nsc);
	for (size_t i = 0; !ret && i < nsc; i++)
		ret = add_owner(bd, scs[i]->backing, scs[i],
				GMLAKE_PIECE_ALLOCATED);
	free(scs);
	if (ret)
		return ret;
	if (bd->nowners)
		qsort(bd->owners, bd->nowners, sizeof(*bd->owners), owner_cmp);
	return 0;
}

/* The first owner on view v, or nowners. */
static size_t owners_of(const struct builder *bd, const struct gml_view *v)
{
	size_t lo = 0, hi = bd->nowners;

	while (lo < hi) {
		size_t mid = (lo + hi) / 2;

		if ((uintptr_t)bd->owners[mid].b->view < (uintptr_t)v)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

static gmlake_stream_t stream_handle(gmlake_ctx *ctx, int idx)
{
	if (idx < 0 || idx >= ctx->nstreams)
		return NULL;
	return ctx->streams[idx].handle;
}

/* Start a range at addr unless one is open. */
static int range_open(struct builder *bd, uint64_t addr, uint32_t kind)
{
	if (bd->cur)
		return 0;
	if (reserve((void **)&bd->ranges, &bd->cap_ranges, bd->nranges,
		    sizeof(*bd->ranges)))
		return -ENOMEM;
	bd->cur = &bd->ranges[bd->nranges++];
	*bd->cur = (struct gmlake_snap_range){
		.address = addr, .kind = kind, .first = (uint32_t)bd->npieces,
	};
	return 0;
}

static void range_close(struct builder *bd)
{
	bd->cur = NULL;
}

/*
 * Append a piece to the open range; a free or elsewhere piece right after
 * one of the same kind grows it instead.
 */
static int piece_add(struct builder *bd, uint64_t addr, uint64_t size,
		     uint64_t requested, uint32_t state, uint32_t flags,
		     gmlake_stream_t stream)
{
	struct gmlake_snap_range *r = bd->cur;
	struct gmlake_snap_piece *last = r->count ?
		&bd->pieces[bd->npieces - 1] : NULL;

	if (last && !requested && !last->requested && last->state == state &&
	    last->flags == flags && last->address + last->size == addr &&
	    (state == GMLAKE_PIECE_FREE || state == GMLAKE_PIECE_ELSEWHERE)) {
		last->size += size;
		r->size += size;
		return 0;
	}
	if (reserve((void **)&bd->pieces, &bd->cap_pieces, bd->npieces,
		    sizeof(*bd->pieces)))
		return -ENOMEM;
	bd->pieces[bd->npieces++] = (struct gmlake_snap_piece){
		.address = addr, .size = size, .requested = requested,
		.state = state, .flags = flags, .stream = stream,
	};
	r->count++;
	r->size += size;
	if (!r->stream && stream && state != GMLAKE_PIECE_FREE)
		r->stream = stream;
	return 0;
}

/* The pieces of a small chunk, in address order. */
static int small_pieces(struct builder *bd, const struct gml_schunk *sc)
{
	gmlake_ctx *ctx = bd->ctx;

	for (const struct gml_block *p = sc->first; p; p = p->next) {
		uint32_t state;
		uint64_t req = 0;

		if (p->free)
			state = GMLAKE_PIECE_FREE;
		else if (gml_ptrmap_get(&ctx->blocks, p->ptr) == p)
			state = GMLAKE_PIECE_ALLOCATED;
		else
			state = GMLAKE_PIECE_PENDING_FREE;
		if (state != GMLAKE_PIECE_FREE)
			req = p->size;
		if (piece_add(bd, p->ptr, p->alloc_size, req, state,
			      GMLAKE_PIECE_SMALL, state == GMLAKE_PIECE_FREE ?
			      NULL : stream_handle(ctx, p->stream)))
			return -ENOMEM;
	}
	return 0;
}

/* The pieces an owner covers from *at (where the last piece ended; free
 * bytes of a shared chunk before it): its small chunk's, or itself to the
 * end of its last chunk, or to its own end where the block above shares
 * that chunk. *at becomes the end. */
static int owner_pieces(struct builder *bd, const struct owner *o,
			uint64_t *at)
{
	const struct gml_block *b = o->b;
	uint64_t end = b->view->va +
		       (uint64_t)(b->pos + b->n) * bd->ctx->chunk;
	int ret = 0;

	if (b->hi_nb)
		end = b->ptr + b->alloc_size;
	if (*at < b->ptr)
		ret = piece_add(bd, *at, b->ptr - *at, 0, GMLAKE_PIECE_FREE, 0,
				NULL);
	*at = end;
	if (ret)
		return ret;
	if (o->sc)
		return small_pieces(bd, o->sc);
	return piece_add(bd, b->ptr, end - b->ptr, b->size, o->state, 0,
			 stream_handle(bd->ctx, b->stream));
}

/* The ranges and pieces of one view. */
static int walk_view(struct builder *bd, const struct gml_view *v)
{
	uint32_t kind = v->stitched ? GMLAKE_RANGE_STITCHED :
				      GMLAKE_RANGE_SEGMENT;
	size_t o = owners_of(bd, v);
	size_t chunk = bd->ctx->chunk;
	uint32_t pos = 0;
	uint64_t at = v->va;
	int ret = 0;

	while (!ret && pos < v->n) {
		uint64_t addr = v->va + (uint64_t)pos * chunk;
		const struct gml_chunk *c = v->chunks[pos];
		const struct gml_block *b = o < bd->nowners ?
					    bd->owners[o].b : NULL;

		/* A block here, or in the chunk the last one shares. */
		if (b && b->view == v && b->pos <= pos) {
			if (at < addr)
				at = addr;
			ret = range_open(bd, addr, kind);
			if (!ret)
				ret = owner_pieces(bd, &bd->owners[o], &at);
			pos = b->pos + (b->n ? b->n : 1) - (b->hi_nb != NULL);
			o++;
			continue;
		}
		if (!c) {
			range_close(bd);
			pos++;
			continue;
		}
		ret = range_open(bd, addr, kind);
		if (!ret)
			ret = piece_add(bd, addr, chunk, 0, c->owner ?
					GMLAKE_PIECE_ELSEWHERE :
					GMLAKE_PIECE_FREE, 0, NULL);
		pos++;
	}
	range_close(bd);
	return ret;
}

static void builder_free(struct builder *bd)
{
	free(bd->owners);
	free(bd->ranges);
	free(bd->pieces);
}

GML_EXPORT int gmlake_snapshot_take(gmlake_ctx *ctx,
				    struct gmlake_snapshot **snap)
{
	struct builder bd = { .ctx = ctx };
	struct gmlake_snapshot *s;
	const struct gml_view *v;
	int ret;

	if (!ctx || !snap)
		return gml_set_error(-EINVAL, "gmlake_snapshot_take: %s is "
				     "NULL", ctx ? "snap" : "ctx");
	s = calloc(1, sizeof(*s));
	if (!s)
		return gml_set_error(-ENOMEM, "snapshot: no host memory");
	pthread_mutex_lock(&ctx->lock);
	ret = collect_owners(&bd);
	for (v = ctx->segs; !ret && v; v = v->next)
		ret = walk_view(&bd, v);
	for (v = ctx->stitched; !ret && v; v = v->next)
		ret = walk_view(&bd, v);
	s->chunk_size = ctx->chunk;
	pthread_mutex_unlock(&ctx->lock);
	if (ret) {
		builder_free(&bd);
		free(s);
		return gml_set_error(-ENOMEM, "snapshot: no host memory");
	}
	free(bd.owners);
	s->version = GMLAKE_SNAPSHOT_VERSION;
	s->size = sizeof(*s);
	s->ranges = bd.ranges;
	s->nranges = bd.nranges;
	s->pieces = bd.pieces;
	s->npieces = bd.npieces;
	*snap = s;
	return 0;
}

GML_EXPORT void gmlake_snapshot_free(struct gmlake_snapshot *snap)
{
	if (!snap)
		return;
	free(snap->ranges);
	free(snap->pieces);
	free(snap);
}

/* Longest run of free chunks of v, and its free chunks if a segment. */
static void view_free(const struct gml_view *v, uint32_t *longest,
		      uint64_t *nfree)
{
	uint32_t run = 0;

	for (uint32_t i = 0; i < v->n; i++) {
		const struct gml_chunk *c = v->chunks[i];

		if (!c || c->owner) {
			run = 0;
			continue;
		}
		if (++run > *longest)
			*longest = run;
		if (!v->stitched)
			(*nfree)++;
	}
}

GML_EXPORT int gmlake_cache_info(gmlake_ctx *ctx, size_t *free_bytes,
				 size_t *largest)
{
	uint64_t nfree = 0, small_free = 0, small_max = 0, big;
	uint32_t longest = 0;
	const struct gml_view *v;

	if (!ctx)
		return gml_set_error(-EINVAL, "gmlake_cache_info: ctx is NULL");
	pthread_mutex_lock(&ctx->lock);
	for (v = ctx->segs; v; v = v->next)
		view_free(v, &longest, &nfree);
	for (v = ctx->stitched; v; v = v->next)
		view_free(v, &longest, &nfree);
	for (int s = 0; s < ctx->nstreams; s++) {
		const struct gml_spool *sp = &ctx->spools[s];

		for (size_t i = 0; i < sp->count; i++) {
			small_free += sp->free[i]->alloc_size;
			if (sp->free[i]->alloc_size > small_max)
				small_max = sp->free[i]->alloc_size;
		}
	}
	big = (uint64_t)longest * ctx->chunk;
	if (nfree * ctx->chunk >= ctx->cfg.stitch_min &&
	    nfree * ctx->chunk > big)
		big = nfree * ctx->chunk;
	if (free_bytes)
		*free_bytes = (size_t)(nfree * ctx->chunk + small_free);
	if (largest)
		*largest = (size_t)(big > small_max ? big : small_max);
	pthread_mutex_unlock(&ctx->lock);
	return 0;
}
