/* SPDX-License-Identifier: MIT */
/*
 * The invariant checker. It walks every segment, stitched view and block
 * and recounts what the allocator keeps incrementally; any difference is a
 * bug, reported as -EFAULT with the broken invariant in the message.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdlib.h>

#include "ctx.h"
#include "error.h"
#include "types.h"

struct tally {
	uint64_t chunks, owned, mapped, blocks_n, schunks;
	int64_t requested;
	int64_t resident;		/* live blocks not spilled */
	struct gml_ptrmap seen;		/* small chunks already counted */
	struct gml_ptrmap view_live;	/* view -> blocks counted on it */
	struct gml_ptrmap holes;	/* cached view -> holes found */
	struct gml_ptrmap spilled;	/* view -> holes of spilled blocks */
	struct gml_ptrmap stale;	/* segment -> its stale entries */
	int64_t spilled_bytes, spilled_blocks;
};

/* Best fit's sorted free runs of v, when known, are v's free runs. */
static int check_runs(const struct gml_view *v)
{
	uint32_t len = 0, k = 0;
	bool *seen;
	int ret = 0;

	if (v->maxfree == GML_RUN_UNKNOWN)
		return 0;
	seen = calloc(v->nruns + 1, sizeof(*seen));
	if (!seen)
		return 0;	/* no host memory: check the rest */
	for (uint32_t i = 0; i <= v->n && !ret; i++) {
		const struct gml_chunk *c = i < v->n ? v->chunks[i] : NULL;
		uint32_t j;

		if (c && !c->owner && v->mapped[i]) {
			len++;
			continue;
		}
		if (!len)
			continue;
		for (j = 0; j < v->nruns; j++)
			if (v->runs[j].pos == i - len && v->runs[j].len == len)
				break;
		if (j == v->nruns || seen[j])
			ret = gml_set_error(-EFAULT, "view %#llx: free run at "
					    "%u of %u chunks unknown to best "
					    "fit", (unsigned long long)v->va,
					    i - len, len);
		else
			seen[j] = true, k++;
		len = 0;
	}
	if (!ret && k != v->nruns)
		ret = gml_set_error(-EFAULT, "view %#llx: best fit lists %u "
				    "free runs, there are %u",
				    (unsigned long long)v->va, v->nruns, k);
	free(seen);
	return ret;
}

/* Add n to the count kept for key in m. */
static int map_add(struct gml_ptrmap *m, const void *key, uintptr_t n)
{
	uintptr_t old = (uintptr_t)gml_ptrmap_del(m, (uintptr_t)key);

	return gml_ptrmap_put(m, (uintptr_t)key, (void *)(old + n));
}

static int check_segments(gmlake_ctx *ctx, struct tally *t)
{
	for (struct gml_view *v = ctx->segs; v; v = v->next) {
		if (v->stitched)
			return gml_set_error(-EFAULT, "stitched view on the "
					     "segment list");
		if (check_runs(v))
			return -EFAULT;
		for (uint32_t i = 0; i < v->n; i++) {
			struct gml_chunk *c = v->chunks[i];

			t->mapped += v->mapped[i];
			if (!c)
				continue;
			if (c->seg != v || c->seg_pos != i)
				return gml_set_error(-EFAULT, "chunk at position "
						     "%u of segment %#llx has a "
						     "wrong back reference", i,
						     (unsigned long long)v->va);
			if (!v->mapped[i])
				return gml_set_error(-EFAULT, "chunk of segment "
						     "%#llx unmapped at %u",
						     (unsigned long long)v->va,
						     i);
			t->chunks++;
			t->owned += c->owner != NULL;
			for (uint32_t k = 0; k < c->nviews; k++)
				if (!c->views[k]->stitched)
					return gml_set_error(-EFAULT, "chunk "
							     "lists a segment "
							     "as a stitch");
		}
	}
	return 0;
}

/*
 * A stale entry names a segment on the list, at a position with no chunk
 * (still mapped, or unmapped by a retry since); each segment counts its
 * entries.
 */
static int check_stale(gmlake_ctx *ctx, struct tally *t)
{
	for (uint32_t i = 0; i < ctx->nstale; i++) {
		const struct gml_stale *e = &ctx->stale[i];
		struct gml_view *v = ctx->segs;

		while (v && v != e->seg)
			v = v->next;
		if (!v || e->pos >= v->n || v->chunks[e->pos])
			return gml_set_error(-EFAULT, "stale entry %u names no "
					     "segment position without a chunk",
					     i);
		if (map_add(&t->stale, v, 1))
			return -ENOMEM;
	}
	for (struct gml_view *v = ctx->segs; v; v = v->next)
		if ((uintptr_t)gml_ptrmap_get(&t->stale, (uintptr_t)v) !=
		    v->nstale)
			return gml_set_error(-EFAULT, "segment %#llx counts %u "
					     "stale entries",
					     (unsigned long long)v->va,
					     v->nstale);
	return 0;
}

/* A slab's positions, in its segment or a stitched view: one handle,
 * consecutive and in order, mapped. */
static int check_slab(const struct gml_view *v, uint32_t i)
{
	const struct gml_chunk *c = v->chunks[i], *first;

	first = c->slab_off <= i ? v->chunks[i - c->slab_off] : NULL;
	if (c->slab_off >= c->slab_len || !first || first->slab_off ||
	    first->slab_len != c->slab_len || first->handle != c->handle ||
	    i - c->slab_off + c->slab_len > v->n)
		return gml_set_error(-EFAULT, "view %#llx: position %u "
				     "is not in a whole slab",
				     (unsigned long long)v->va, i);
	if (!v->mapped[i] || c->spanned)
		return gml_set_error(-EFAULT, "view %#llx: slab position %u "
				     "unmapped or spanned",
				     (unsigned long long)v->va, i);
	return 0;
}

static int check_views(gmlake_ctx *ctx, struct gml_view *list, bool cached,
		       struct tally *t)
{
	uint32_t count = 0;

	for (struct gml_view *v = list; v; v = v->next, count++) {
		/* Segments reach the dying list when the driver refused
		 * part of their teardown. */
		if ((cached && !v->stitched) || v->dying == cached)
			return gml_set_error(-EFAULT, "view %#llx on the wrong "
					     "list", (unsigned long long)v->va);
		if (cached && check_runs(v))
			return -EFAULT;
		for (uint32_t i = 0; i < v->n; i++) {
			struct gml_chunk *c = v->chunks[i];

			t->mapped += v->mapped[i];
			if (cached && !c && !v->mapped[i]) {
				/* Allowed under a spilled block only:
				 * check_holes() counts them. */
				if (map_add(&t->holes, v, 1))
					return -ENOMEM;
				continue;
			}
			if (cached && (!c || !v->mapped[i]))
				return gml_set_error(-EFAULT, "cached stitched "
						     "view %#llx has a hole at "
						     "%u", (unsigned long long)
						     v->va, i);
			if (c && !v->stitched) {
				if (c->slab_len && check_slab(v, i))
					return -EFAULT;
				t->chunks++;
				continue;
			}
			if (c && c->spanned) {	/* a span's home is here */
				t->chunks++;
				t->owned += c->owner != NULL;
				continue;
			}
			if (c && c->slab_len && check_slab(v, i))
				return -EFAULT;
			if (c && !gml_chunk_in_view(c, v))
				return gml_set_error(-EFAULT, "chunk does not "
						     "know stitched view %#llx",
						     (unsigned long long)v->va);
		}
		if (!cached && v->live)
			return gml_set_error(-EFAULT, "evicted view has %u live "
					     "blocks", v->live);
	}
	if (cached && count != ctx->nstitched)
		return gml_set_error(-EFAULT, "%u cached stitched views, "
				     "counted %u", ctx->nstitched, count);
	return 0;
}

static int view_count(struct tally *t, struct gml_view *v)
{
	uintptr_t n = (uintptr_t)gml_ptrmap_del(&t->view_live, (uintptr_t)v);

	return gml_ptrmap_put(&t->view_live, (uintptr_t)v, (void *)(n + 1));
}

/*
 * A spilled block's run is holes (no chunk, unmapped), so nobody else can
 * be handed its range, and it keeps a copy on the host; but it owns the
 * chunks it kept at its ends (a slab shared with memory in use), mapped,
 * and never all of them.
 */
static int check_spilled(gmlake_ctx *ctx, struct gml_block *b,
			 struct tally *t)
{
	struct gml_view *v = b->view;
	uint32_t kept = b->kept_lo + b->kept_hi;

	if (kept >= b->n)
		return gml_set_error(-EFAULT, "spilled block %#lx keeps its "
				     "whole run", (unsigned long)b->ptr);
	for (uint32_t i = 0; i < b->n; i++) {
		const struct gml_chunk *c = v->chunks[b->pos + i];
		bool mapped = v->mapped[b->pos + i];

		if (i < b->kept_lo || i >= b->n - b->kept_hi) {
			if (!c || c->owner != b || !mapped || !c->slab_len)
				return gml_set_error(-EFAULT, "spilled block "
						     "%#lx lost a kept slab "
						     "chunk at +%u",
						     (unsigned long)b->ptr, i);
		} else if (c || mapped) {
			return gml_set_error(-EFAULT, "spilled block %#lx still "
					     "maps a chunk at +%u",
					     (unsigned long)b->ptr, i);
		}
	}
	t->blocks_n += kept;
	if (!b->host && !b->inplace)
		return gml_set_error(-EFAULT, "spilled block %#lx has no host "
				     "copy", (unsigned long)b->ptr);
	if (b->on_lru)
		return gml_set_error(-EFAULT, "spilled block %#lx is on the "
				     "offload LRU", (unsigned long)b->ptr);
	t->spilled_bytes += (int64_t)b->size;
	t->spilled_blocks++;
	if (v->stitched && map_add(&t->spilled, v, b->n - kept))
		return -ENOMEM;
	return view_count(t, v);
}

/*
 * A packed block's links (pack.c): each neighbour links back, shares the
 * end position it is linked at and lies next to it by address, on the
 * same segment and stream; a block off a chunk start lies in a segment.
 */
static int check_packed(gmlake_ctx *ctx, const struct gml_block *b)
{
	const struct gml_block *l = b->lo_nb, *h = b->hi_nb;

	if (b->off >= ctx->chunk || (b->off && b->view->stitched))
		return gml_set_error(-EFAULT, "block %#lx starts %u bytes into "
				     "a position", (unsigned long)b->ptr,
				     b->off);
	if (l && (l->hi_nb != b || l->view != b->view ||
		  l->stream != b->stream || l->pos + l->n - 1 != b->pos ||
		  l->ptr + l->alloc_size > b->ptr))
		return gml_set_error(-EFAULT, "block %#lx and the block below "
				     "it sharing a chunk disagree",
				     (unsigned long)b->ptr);
	if (h && (h->lo_nb != b || h->view != b->view ||
		  h->stream != b->stream || h->pos != b->pos + b->n - 1 ||
		  b->ptr + b->alloc_size > h->ptr))
		return gml_set_error(-EFAULT, "block %#lx and the block above "
				     "it sharing a chunk disagree",
				     (unsigned long)b->ptr);
	return 0;
}

/* A large block owns every chunk of its run, but for ends it shares with
 * its neighbours (pack.c), and its address matches. */
static int check_large(gmlake_ctx *ctx, struct gml_block *b, struct tally *t)
{
	struct gml_view *v = b->view;

	if (!v || b->pos + b->n > v->n || b->ptr != v->va + (gml_va)b->pos *
	    ctx->chunk + b->off || b->ptr + b->alloc_size > v->va +
	    (gml_va)(b->pos + b->n) * ctx->chunk)
		return gml_set_error(-EFAULT, "block %#lx lies outside its "
				     "view", (unsigned long)b->ptr);
	if (check_packed(ctx, b))
		return -EFAULT;
	if ((b->lo_nb || b->hi_nb) && b->off_state != GML_OFF_RESIDENT)
		return gml_set_error(-EFAULT, "block %#lx shares a chunk but is "
				     "not resident", (unsigned long)b->ptr);
	if (b->off_state == GML_OFF_SPILLED && !b->stuck)
		return check_spilled(ctx, b, t);
	if (b->on_lru && !b->offloadable)
		return gml_set_error(-EFAULT, "block %#lx is on the offload LRU "
				     "but may not spill", (unsigned long)b->ptr);
	if (b->stuck && (b->off_state != GML_OFF_SPILLED || b->on_lru ||
			 (!b->host && !b->inplace)))
		return gml_set_error(-EFAULT, "stuck block %#lx is not spilled "
				     "with a host copy off the LRU",
				     (unsigned long)b->ptr);
	if (b->off_state == GML_OFF_FETCHING || b->stuck) {
		/* Mapped (again), its host copy still counted. */
		t->spilled_bytes += (int64_t)b->size;
		t->spilled_blocks++;
	}
	for (uint32_t i = 0; i < b->n; i++) {
		struct gml_chunk *c = v->chunks[b->pos + i];
		bool shared = (i == 0 && b->lo_nb) ||
			      (i == b->n - 1 && b->hi_nb);

		if (!c || (c->owner != b && !(shared && c->owner)))
			return gml_set_error(-EFAULT, "block %#lx maps a chunk "
					     "it does not own at +%u", (unsigned
					     long)b->ptr, i);
		if (!v->mapped[b->pos + i])
			return gml_set_error(-EFAULT, "block %#lx is not "
					     "mapped at +%u",
					     (unsigned long)b->ptr, i);
	}
	/* A shared position counts once: at the block above's first. */
	t->blocks_n += b->n - (b->hi_nb != NULL);
	return view_count(t, v);
}

static int check_block(gmlake_ctx *ctx, struct gml_block *b, struct tally *t)
{
	struct gml_schunk *sc = b->sc;
	int ret;

	if (!b->small)
		return check_large(ctx, b, t);
	if (!sc || b->ptr < sc->backing->ptr || b->ptr + b->alloc_size >
	    sc->backing->ptr + sc->backing->alloc_size)
		return gml_set_error(-EFAULT, "small block %#lx outside its "
				     "chunk", (unsigned long)b->ptr);
	if (gml_ptrmap_get(&t->seen, (uintptr_t)sc))
		return 0;
	ret = gml_ptrmap_put(&t->seen, (uintptr_t)sc, sc);
	if (ret)
		return ret;
	t->schunks++;
	return check_large(ctx, sc->backing, t);
}

/* The idle small chunks: empty, and counted like those of live blocks. */
static int check_idle_small(gmlake_ctx *ctx, struct tally *t)
{
	int ret;

	for (int s = 0; s < ctx->nstreams; s++) {
		struct gml_schunk *sc = ctx->spools[s].idle;

		if (!sc)
			continue;
		if (sc->used || !sc->first || sc->first->next ||
		    !sc->first->free || sc->first->alloc_size != ctx->chunk)
			return gml_set_error(-EFAULT, "idle small chunk %#lx of "
					     "stream %d is not empty",
					     (unsigned long)sc->backing->ptr, s);
		if (gml_ptrmap_get(&t->seen, (uintptr_t)sc))
			return gml_set_error(-EFAULT, "idle small chunk %#lx "
					     "holds a live block",
					     (unsigned long)sc->backing->ptr);
		ret = gml_ptrmap_put(&t->seen, (uintptr_t)sc, sc);
		if (ret)
			return ret;
		t->schunks++;
		ret = check_large(ctx, sc->backing, t);
		if (ret)
			return ret;
	}
	return 0;
}

static int check_blocks(gmlake_ctx *ctx, struct tally *t)
{
	struct gml_block *lists[2] = { ctx->live, ctx->deferred };
	int ret;

	for (int l = 0; l < 2; l++) {
		for (struct gml_block *b = lists[l]; b; b = b->lnext) {
			if (l == 0 && gml_ptrmap_get(&ctx->blocks, b->ptr) != b)
				return gml_set_error(-EFAULT, "live block %#lx "
						     "missing from the map",
						     (unsigned long)b->ptr);
			if (l == 0)
				t->requested += (int64_t)b->size;
			if (l == 0 && (b->small ||
				       b->off_state != GML_OFF_SPILLED))
				t->resident += (int64_t)b->alloc_size;
			if (l == 1 && b->on_lru)
				return gml_set_error(-EFAULT, "freed block %#lx "
						     "is on the offload LRU",
						     (unsigned long)b->ptr);
			ret = check_block(ctx, b, t);
			if (ret)
				return ret;
		}
	}
	return 0;
}

static int check_view_live(struct tally *t, struct gml_view *list)
{
	for (struct gml_view *v = list; v; v = v->next) {
		uintptr_t n = (uintptr_t)gml_ptrmap_get(&t->view_live,
							(uintptr_t)v);

		if (n != v->live)
			return gml_set_error(-EFAULT, "view %#llx counts %u "
					     "live blocks, found %lu",
					     (unsigned long long)v->va, v->live,
					     (unsigned long)n);
	}
	return 0;
}

/*
 * Every hole of a cached stitched view was made by a spill and is counted;
 * the spilled blocks on it cover no more than that, and a view with holes
 * stays cached only while it has live blocks.
 */
static int check_holes(gmlake_ctx *ctx, struct tally *t)
{
	for (struct gml_view *v = ctx->stitched; v; v = v->next) {
		uintptr_t h = (uintptr_t)gml_ptrmap_get(&t->holes, (uintptr_t)v);
		uintptr_t s = (uintptr_t)gml_ptrmap_get(&t->spilled, (uintptr_t)v);

		if (h != v->holes || s > h || (h && !v->live))
			return gml_set_error(-EFAULT, "cached stitched view "
					     "%#llx has %lu holes (%u counted, "
					     "%u live blocks), spilled blocks "
					     "cover %lu", (unsigned long long)
					     v->va, (unsigned long)h, v->holes,
					     v->live, (unsigned long)s);
	}
	return 0;
}

static int check_totals(gmlake_ctx *ctx, struct tally *t)
{
	const struct gmlake_stats *st = &ctx->st;

	t->chunks += ctx->nzombies;	/* released later, still counted */
	t->chunks += ctx->nspares;	/* kept for reuse, still counted */
	for (uint32_t i = 0; i < ctx->nspan_spares; i++)
		t->chunks += ctx->span_spares[i].n;
	for (uint32_t i = 0; i < ctx->nstale; i++)
		t->chunks += ctx->stale[i].n;	/* freed spans, mapped still */
	if (t->spilled_bytes != st->spilled_bytes.current ||
	    t->spilled_blocks != st->spilled_blocks.current)
		return gml_set_error(-EFAULT, "%lld spilled blocks of %lld "
				     "bytes found, %lld of %lld counted",
				     (long long)t->spilled_blocks,
				     (long long)t->spilled_bytes,
				     (long long)st->spilled_blocks.current,
				     (long long)st->spilled_bytes.current);

	if (t->owned != t->blocks_n)
		return gml_set_error(-EFAULT, "%llu chunks have owners, blocks "
				     "hold %llu", (unsigned long long)t->owned,
				     (unsigned long long)t->blocks_n);
	if ((int64_t)t->chunks != st->chunks.current ||
	    st->reserved_bytes.current != st->chunks.current *
	    (int64_t)ctx->chunk)
		return gml_set_error(-EFAULT, "%llu chunks found, %lld counted",
				     (unsigned long long)t->chunks,
				     (long long)st->chunks.current);
	if ((int64_t)t->schunks != st->small_chunks.current)
		return gml_set_error(-EFAULT, "%llu small chunks found, %lld "
				     "counted", (unsigned long long)t->schunks,
				     (long long)st->small_chunks.current);
	if (t->resident != st->resident_bytes.current)
		return gml_set_error(-EFAULT, "%lld bytes of live blocks on "
				     "the device, %lld counted",
				     (long long)t->resident,
				     (long long)st->resident_bytes.current);
	if (t->requested != st->requested_bytes.current)
		return gml_set_error(-EFAULT, "%lld bytes requested by live "
				     "blocks, %lld counted",
				     (long long)t->requested,
				     (long long)st->requested_bytes.current);
	if ((int64_t)(t->mapped * ctx->chunk) != st->mapped_bytes.current)
		return gml_set_error(-EFAULT, "%llu positions mapped, %lld "
				     "bytes counted", (unsigned long long)
				     t->mapped, (long long)
				     st->mapped_bytes.current);
	return 0;
}

int gml_ctx_check_locked(gmlake_ctx *ctx)
{
	struct tally t = { 0 };
	int ret;

	ret = check_segments(ctx, &t);
	if (!ret)
		ret = check_stale(ctx, &t);
	if (!ret)
		ret = check_views(ctx, ctx->stitched, true, &t);
	if (!ret)
		ret = check_views(ctx, ctx->dying, false, &t);
	if (!ret)
		ret = check_blocks(ctx, &t);
	if (!ret)
		ret = check_idle_small(ctx, &t);
	if (!ret)
		ret = check_view_live(&t, ctx->segs);
	if (!ret)
		ret = check_view_live(&t, ctx->stitched);
	if (!ret)
		ret = check_holes(ctx, &t);
	if (!ret)
		ret = check_totals(ctx, &t);
	gml_ptrmap_fini(&t.seen);
	gml_ptrmap_fini(&t.view_live);
	gml_ptrmap_fini(&t.holes);
	gml_ptrmap_fini(&t.spilled);
	gml_ptrmap_fini(&t.stale);
	return ret;
}

int gml_ctx_check(gmlake_ctx *ctx)
{
	int ret;

	if (!ctx)
		return gml_set_error(-EINVAL, "gml_ctx_check: ctx is NULL");
	pthread_mutex_lock(&ctx->lock);
	ret = gml_ctx_check_locked(ctx);
	pthread_mutex_unlock(&ctx->lock);
	return ret;
}
