/* SPDX-License-Identifier: MIT */
/*
 * Residency, for the offload tier: a block's chunks taken away while its
 * range stays reserved (detach), and chunks mapped at the same range again
 * (attach), moving free chunks the cache holds before making new ones.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "large.h"
#include "types.h"

/*
 * A segment block's chunk leaves its home (the block's range) and is given
 * back to the driver, so no stitched view may map it: unmap the unused
 * ones (waiting for their work). -EBUSY when a view in use maps it.
 */
static int unshare_chunk(gmlake_ctx *ctx, struct gml_chunk *c)
{
	uint32_t k = 0;

	while (k < c->nviews) {
		struct gml_view *w = c->views[k];

		if (w->live || w->dying || gml_view_evict(ctx, w, true)) {
			k++;
			continue;
		}
	}
	if (c->nviews)
		return gml_set_error(-EBUSY, "a chunk of the block is also "
				     "mapped by a stitched range in use");
	return 0;
}

/* Whether the mapping that starts at position p of v holds memory in use
 * outside b's run (another block's positions of a slab). */
static bool mapping_shared(const struct gml_view *v, const struct gml_block *b,
			   uint32_t p)
{
	uint32_t end = p + gml_mapping_len(v, p);

	for (uint32_t q = p; q < end; q++)
		if ((q < b->pos || q >= b->pos + b->n) && v->chunks[q] &&
		    v->chunks[q]->owner)
			return true;
	return false;
}

/*
 * The positions [lo, hi) a detach of b unmaps: its run, and the slabs at
 * its ends whole; but a slab at an end that another block holds part of
 * stays mapped, with b's positions in it (kept_lo at the start, kept_hi
 * at the end of the run): the driver unmaps a handle only whole. lo >= hi
 * when nothing of the run could go.
 */
static void detach_range(const struct gml_view *v, const struct gml_block *b,
			 uint32_t *lo, uint32_t *hi, uint32_t *kept_lo,
			 uint32_t *kept_hi)
{
	uint32_t end = b->pos + b->n, last = end - 1;
	uint32_t first_map = gml_mapping_start(v, b->pos);
	uint32_t last_map = gml_mapping_start(v, last);

	*lo = first_map;
	*hi = last + gml_mapping_len(v, last);
	*kept_lo = *kept_hi = 0;
	if (mapping_shared(v, b, first_map)) {
		*lo = first_map + gml_mapping_len(v, first_map);
		if (*lo > end)
			*lo = end;
		*kept_lo = *lo - b->pos;
	}
	if (last_map >= *lo && mapping_shared(v, b, last_map)) {
		*hi = last_map;
		*kept_hi = end - last_map;
	}
	if (*kept_lo + *kept_hi >= b->n)
		*hi = *lo = end;	/* all of the run stays */
}

/* Whether a detach of b now would keep positions of its run mapped. */
bool gml_large_keeps(const struct gml_block *b)
{
	uint32_t lo, hi, klo, khi;

	if (b->view->chunks[b->pos]->spanned)
		return false;
	detach_range(b->view, b, &lo, &hi, &klo, &khi);
	return klo || khi;
}

/* Map [lo, to) of v back after a failed detach (best effort). */
static void detach_undo(gmlake_ctx *ctx, struct gml_view *v, uint32_t lo,
			uint32_t to)
{
	uint32_t len;
	bool ok = true;

	for (uint32_t p = lo; p < to; p += len) {
		len = gml_mapping_len(v, p);
		if (gml_view_map_run(ctx, v, p, len, v->chunks[p]->handle))
			ok = false;
	}
	if (!ok || (to > lo && gml_dev_set_access(&ctx->dev, v->va +
					      (gml_va)lo * ctx->chunk,
					      (size_t)(to - lo) * ctx->chunk)))
		gml_log(GMLAKE_LOG_ERROR, "cannot map %#llx back after a "
			"failed spill", (unsigned long long)(v->va +
			(gml_va)lo * ctx->chunk));
}

/*
 * Whether what a detach of b unmaps, [lo, hi), may go: past the run only
 * free chunks of the slabs at its ends (they go with it, without check
 * after their last work is done: in a segment their positions are
 * released, in a stitched view they become holes, the chunks staying
 * free in their segment). 0, -EBUSY when no position of the run could go
 * (it lies in a slab another block holds part of), or -errno of the wait.
 */
static int slabs_detachable(gmlake_ctx *ctx, const struct gml_view *v,
			    const struct gml_block *b, uint32_t lo, uint32_t hi,
			    bool check)
{
	int ret;

	if (lo >= hi)
		return gml_set_error(-EBUSY, "the block lies in a growth "
				     "handle (slab) that memory in use shares, "
				     "and the driver unmaps a handle only "
				     "whole");
	for (uint32_t p = lo; p < hi; p++) {
		const struct gml_chunk *c = v->chunks[p];

		if (p >= b->pos && p < b->pos + b->n)
			continue;
		if (!check && !gml_guard_ready(ctx, &c->guard, -1)) {
			ret = gml_stream_wait(ctx, c->guard.stream,
					      c->guard.seq);
			if (ret)
				return ret;
		}
	}
	return 0;
}

/*
 * Take the chunks of resident large block b away while its range stays
 * reserved: unmap its run; chunks of a stitched view go back to the free
 * pool of their segments, chunks of a segment (whose home is this range)
 * go back to the driver as spares, and the slabs under it whole, as
 * spare spans (with the free chunks of theirs beyond the run). A slab at
 * an end of the run that another block holds part of stays, with b's
 * positions in it kept (b->kept_lo, b->kept_hi; detach_range). The caller
 * has the bytes elsewhere and the work on the block is complete. With
 * check, only see whether it would work. 0, -EBUSY (a chunk is shared
 * with a stitched range in use, or the whole run lies in a slab shared
 * with memory in use), or -errno with the block intact.
 */
int gml_large_detach(gmlake_ctx *ctx, struct gml_block *b, bool check)
{
	static const struct gml_guard none = { -1, 0 };
	struct gml_view *v = b->view;
	uint32_t i, p, lo, hi, len, klo, khi;
	int ret;

	if (b->exported)
		return gml_set_error(-EBUSY, "the block is shared with another "
				     "process (gmlake_ipc_export), which maps "
				     "its memory");
	if (gml_pack_shares(b) || b->off)
		return gml_set_error(-EBUSY, "the block shares its end chunks "
				     "with neighbouring blocks (lib/pack.c)");
	if (ctx->nzombies)
		gml_zombies_reap(ctx);
	v->maxfree = GML_RUN_UNKNOWN;
	if (v->chunks[b->pos]->spanned)
		return check ? 0 : gml_span_detach(ctx, b);
	detach_range(v, b, &lo, &hi, &klo, &khi);
	ret = slabs_detachable(ctx, v, b, lo, hi, check);
	if (ret)
		return ret;
	if ((klo || khi) && b->inplace)	/* host memory goes over all of it */
		return gml_set_error(-EBUSY, "the block shares a growth handle "
				     "with memory in use, and an in-place spill "
				     "needs its whole run");
	for (i = klo; !v->stitched && i < b->n - khi; i++) {
		ret = unshare_chunk(ctx, v->chunks[b->pos + i]);
		if (ret)
			return ret;
	}
	if (check)
		return 0;
	for (p = lo; p < hi; p += len) {
		len = gml_mapping_len(v, p);
		ret = gml_view_unmap_run(ctx, v, p, len);
		if (ret) {
			detach_undo(ctx, v, lo, p);
			return ret;
		}
	}
	for (p = lo; p < hi; p++) {
		struct gml_chunk *c = v->chunks[p];

		/* Past the run, a free chunk of a slab: its position is
		 * released (maxfree, unknown above, finds the runs again). */
		v->chunks[p] = NULL;
		c->owner = NULL;
		c->guard = none;
		gml_chunk_touch(c);
		if (v->stitched) {
			gml_del_view_ref(c, v);
			v->holes++;
			continue;
		}
		if (!c->slab_len)
			gml_spare_put(ctx, c->handle);
		else if (!c->slab_off)
			gml_span_put(ctx, c->handle, c->slab_len);
		free(c->views);
		free(c);
	}
	b->kept_lo = klo;
	b->kept_hi = khi;
	return 0;
}

/*
 * Free chunks mapped by their segment, not by v (alone: by no stitched
 * view either). Their last work may still run: the caller orders its
 * copy after every stream (mapping a chunk elsewhere disturbs nothing).
 */
static uint32_t free_chunks(gmlake_ctx *ctx, struct gml_view *v,
			    struct gml_chunk **out, uint32_t want, bool alone)
{
	uint32_t got = 0;

	for (struct gml_view *s = ctx->segs; s && got < want; s = s->next)
		for (uint32_t i = 0; i < s->n && got < want; i++) {
			struct gml_chunk *c = s->chunks[i];

			if (gml_chunk_single(c) && s->mapped[i] && !c->owner &&
			    (!alone || !c->nviews) && !gml_chunk_in_view(c, v))
				out[got++] = c;
		}
	return got;
}

/* The positions of spilled block b a fetch maps: its run but the kept
 * ones (gml_large_detach). */
struct fetch_run {
	uint32_t pos, n;
	uintptr_t ptr;
};

static struct fetch_run fetch_run_of(const gmlake_ctx *ctx,
				     const struct gml_block *b)
{
	struct fetch_run r = {
		.pos = b->pos + b->kept_lo,
		.n = b->n - b->kept_lo - b->kept_hi,
		.ptr = b->ptr + (uintptr_t)b->kept_lo * ctx->chunk,
	};

	return r;
}

/* Unmap [0, k) of got from run r of b after a failed attach. */
static void attach_undo(gmlake_ctx *ctx, struct gml_block *b,
			const struct fetch_run *r, uint32_t k)
{
	struct gml_view *v = b->view;

	for (uint32_t i = 0; i < k; i++) {
		uint32_t p = r->pos + i;

		/* Twice: a spilled run must stay holes, and the caller
		 * gives the chunks back. */
		if (v->mapped[p] && gml_view_unmap_run(ctx, v, p, 1))
			gml_view_unmap_run(ctx, v, p, 1);
	}
}

/* Stitched run: free chunks of any segment, new ones for the shortfall. */
static int attach_stitched(gmlake_ctx *ctx, struct gml_block *b,
			   const struct fetch_run *r, struct gml_chunk **got,
			   struct gml_access *defer)
{
	struct gml_view *v = b->view;
	struct run grown;
	uint32_t k, i;
	int ret;

	k = free_chunks(ctx, v, got, r->n, true);
	k += free_chunks(ctx, v, got + k, r->n - k, false);
	/* the second pass may list a chunk of the first again */
	for (i = 0; i < k; i++)
		for (uint32_t j = 0; j < i; j++)
			if (got[j] == got[i]) {
				got[i--] = got[--k];
				break;
			}
	if (k < r->n) {
		ret = gml_grow(ctx, r->n - k, false, &grown);
		if (ret)
			return ret;
		for (i = 0; k < r->n; i++)
			got[k++] = grown.view->chunks[grown.pos + i];
	}
	for (i = 0; i < r->n; i++) {
		uint32_t p = r->pos + i;

		ret = gml_view_map_pos(ctx, v, p, got[i]->handle);
		if (ret)
			goto out_undo;
	}
	ret = gml_fetch_access(ctx, r->ptr, (size_t)r->n * ctx->chunk, r->n,
			       defer);
	if (ret)
		goto out_undo;
	for (i = 0; i < r->n; i++) {
		ret = gml_add_view_ref(got[i], v);
		if (ret) {
			while (i--)
				gml_del_view_ref(got[i], v);
			gml_set_error(ret, "no host memory to fetch a block");
			goto out_undo;
		}
	}
	for (i = 0; i < r->n; i++)
		v->chunks[r->pos + i] = got[i];
	v->holes -= r->n;
	return 0;
out_undo:
	attach_undo(ctx, b, r, r->n);
	return ret;
}

void gml_stale_reap(gmlake_ctx *ctx, bool all)
{
	uint32_t k = 0;

	for (uint32_t i = 0; i < ctx->nstale; i++) {
		struct gml_stale *e = &ctx->stale[i];
		struct gml_view *s = e->seg;

		if (!all && !gml_guard_ready(ctx, &e->guard, -1)) {
			ctx->stale[k++] = *e;
			continue;
		}
		/* A position unmapped already (by gml_release_cached's
		 * retry) needs nothing; one that fails is tried later. */
		if (e->n) {		/* a freed span */
			if (s->mapped[e->pos] && !gml_span_stale_unmap(ctx, e)) {
				ctx->stale[k++] = *e;
				continue;
			}
		} else if (s->mapped[e->pos] && !s->chunks[e->pos] &&
			   gml_view_unmap_run(ctx, s, e->pos, 1)) {
			ctx->stale[k++] = *e;
			continue;
		}
		/* s stays while other entries name it (nstale). */
		s->nstale--;
		gml_seg_drop_if_empty(ctx, s);
	}
	ctx->nstale = k;
}

/* Queue a stale entry (large.h). */
int gml_stale_add(gmlake_ctx *ctx, struct gml_view *s, uint32_t pos,
		  uint32_t n, gml_handle h, const struct gml_guard *g)
{
	if (ctx->nstale == ctx->cap_stale) {
		uint32_t cap = ctx->cap_stale ? 2 * ctx->cap_stale : 64;
		struct gml_stale *grown = realloc(ctx->stale,
						  cap * sizeof(*grown));

		if (!grown)
			return -ENOMEM;
		ctx->stale = grown;
		ctx->cap_stale = cap;
	}
	ctx->stale[ctx->nstale++] = (struct gml_stale){ s, pos, *g, n, h };
	s->nstale++;
	return 0;
}

/*
 * Take free chunk c out of its segment, to live elsewhere. Its home
 * position is unmapped now if the work that used it there completed;
 * otherwise later (gml_stale_reap): the caller orders its own use after
 * all work queued so far, and until then nothing reads the old address.
 */
static int chunk_unhome(gmlake_ctx *ctx, struct gml_chunk *c)
{
	struct gml_view *s = c->seg;
	int ret;

	if (!gml_guard_ready(ctx, &c->guard, -1)) {
		ret = gml_stale_add(ctx, s, c->seg_pos, 0, 0, &c->guard);
		if (ret)
			return ret;
	} else {
		ret = gml_view_unmap_run(ctx, s, c->seg_pos, 1);
		if (ret)
			return ret;
	}
	s->maxfree = GML_RUN_UNKNOWN;
	s->chunks[c->seg_pos] = NULL;
	gml_seg_drop_if_empty(ctx, s);
	return 0;
}

/* A free chunk of another segment, moved once its work completed (the
 * last resort when the device is full). */
static struct gml_chunk *move_chunk(gmlake_ctx *ctx, struct gml_view *dst)
{
	struct gml_chunk *c;

	if (!free_chunks(ctx, dst, &c, 1, true))
		return NULL;
	if (c->guard.stream >= 0 &&
	    gml_stream_wait(ctx, c->guard.stream, c->guard.seq))
		return NULL;
	return chunk_unhome(ctx, c) ? NULL : c;
}

/* Free, mapped by its segment alone (no stitched view). */
static bool chunk_movable(const struct gml_view *s, uint32_t i)
{
	const struct gml_chunk *c = s->chunks[i];

	return gml_chunk_single(c) && s->mapped[i] && !c->owner &&
	       !c->nviews;
}

/* Whether every stitched view mapping c is unused and done with. */
static bool views_evictable(gmlake_ctx *ctx, const struct gml_chunk *c)
{
	for (uint32_t i = 0; i < c->nviews; i++)
		if (c->views[i]->live || c->views[i]->dying ||
		    !gml_guards_done(ctx, c->views[i]))
			return false;
	return true;
}

static uint32_t collect_movable(gmlake_ctx *ctx, struct gml_chunk **out,
				uint32_t want)
{
	uint32_t got = 0;

	for (int idle = 1; idle >= 0; idle--)
		for (struct gml_view *s = ctx->segs; s && got < want;
		     s = s->next) {
			if ((s->live == 0) != idle)
				continue;
			for (uint32_t i = 0; i < s->n && got < want; i++)
				if (chunk_movable(s, i))
					out[got++] = s->chunks[i];
		}
	return got;
}

/*
 * Up to want free chunks of the segments, segments with no live block
 * first; then, if that is not enough, chunks that unused cached stitched
 * views map, evicting those views. A fetch moves these rather than
 * creating chunks: backward frees memory as it fetches, and chunks made
 * while freed ones sit in the cache would lift reserved memory back to
 * what it was without offloading. A move also costs one unmap where a
 * new chunk costs a create now and a release later.
 */
static uint32_t cached_chunks(gmlake_ctx *ctx, struct gml_chunk **out,
			      uint32_t want)
{
	uint32_t got = collect_movable(ctx, out, want), freed = 0;

	for (struct gml_view *s = ctx->segs; s && got + freed < want;
	     s = s->next)
		for (uint32_t i = 0; i < s->n && got + freed < want; i++) {
			struct gml_chunk *c = s->chunks[i];

			if (!gml_chunk_single(c) || !s->mapped[i] ||
			    c->owner || !c->nviews ||
			    !views_evictable(ctx, c))
				continue;
			while (c->nviews) {
				struct gml_view *w = c->views[0];
				uint32_t n = w->n;

				/* Evictable: unmapped at once, not dying. */
				if (gml_view_evict(ctx, w, false) ||
				    (c->nviews && c->views[0] == w))
					break;
				freed += n;
			}
		}
	return freed ? collect_movable(ctx, out, want) : got;
}

/* One chunk for position p of segment v: a spare, a free chunk of the
 * cache (ready[0..*nready)), a new one, else a moved one. */
static int seg_chunk(gmlake_ctx *ctx, struct gml_view *v, uint32_t p,
		     struct gml_chunk **ready, uint32_t *nready,
		     struct gml_chunk **out)
{
	struct gml_chunk *c = NULL;
	int ret = 0;

	while (!ctx->nspares && !c && *nready)
		if (chunk_unhome(ctx, ready[--*nready]) == 0)
			c = ready[*nready];
	if (!c) {
		c = calloc(1, sizeof(*c));
		if (!c)
			return gml_set_error(-ENOMEM, "no host memory for a "
					     "chunk");
		ret = gml_chunk_handle_get(ctx, &c->handle);
		if (ret) {
			free(c);
			c = NULL;
		}
		if (!c && ret == -ENOMEM)
			c = move_chunk(ctx, v);
	}
	if (!c)
		return ret ? ret : -ENOMEM;
	c->seg = v;
	c->seg_pos = p;
	c->guard.stream = -1;
	c->guard.seq = 0;
	*out = c;
	return 0;
}

/* Segment run: chunks made (or moved) to live at their new home. */
static int attach_segment(gmlake_ctx *ctx, struct gml_block *b,
			  const struct fetch_run *r, struct gml_chunk **got,
			  struct gml_access *defer)
{
	struct gml_view *v = b->view;
	struct gml_chunk **ready = NULL;
	uint32_t k, nready = 0, stale0 = ctx->nstale;
	bool settled;
	int ret;

	if (r->n > ctx->nspares) {
		ready = calloc(r->n - ctx->nspares, sizeof(*ready));
		if (ready)	/* without: new chunks only */
			nready = cached_chunks(ctx, ready,
					       r->n - ctx->nspares);
	}
	for (k = 0; k < r->n; k++) {
		uint32_t p = r->pos + k;

		ret = seg_chunk(ctx, v, p, ready, &nready, &got[k]);
		if (ret)
			goto out_undo;
		ret = gml_view_map_pos(ctx, v, p, got[k]->handle);
		if (ret) {
			k++;
			goto out_undo;
		}
	}
	ret = gml_fetch_access(ctx, r->ptr, (size_t)r->n * ctx->chunk, r->n,
			       defer);
	if (ret)
		goto out_undo;
	for (k = 0; k < r->n; k++)
		v->chunks[r->pos + k] = got[k];
	free(ready);
	return 0;
out_undo:
	free(ready);
	attach_undo(ctx, b, r, k);
	/* Chunks taken before their last work ran serve elsewhere only
	 * once it has; released, their memory lives while mapped. */
	settled = ctx->nstale == stale0 || !gml_streams_wait_all(ctx);
	for (uint32_t i = 0; i < k; i++) {
		/* Only an unmapped chunk may serve elsewhere. */
		if (v->mapped[r->pos + i] || !settled)
			gml_chunk_handle_release(ctx, got[i]->handle);
		else
			gml_spare_put(ctx, got[i]->handle);
		free(got[i]->views);
		free(got[i]);
	}
	return ret;
}

/*
 * A fetch's access to [va, va + size) over handles mappings: granted and
 * counted now, or with defer left to the caller (struct gml_access).
 */
int gml_fetch_access(gmlake_ctx *ctx, gml_va va, size_t size,
		     uint64_t handles, struct gml_access *defer)
{
	int ret;

	if (defer) {
		*defer = (struct gml_access){ va, size, handles };
		return 0;
	}
	ret = gml_dev_set_access(&ctx->dev, va, size);
	if (!ret)
		gml_count_access(ctx, size, handles);
	return ret;
}

void gml_large_granted(gmlake_ctx *ctx, const struct gml_access *a)
{
	gml_count_access(ctx, a->size, a->handles);
}

/*
 * Map chunks at spilled block b's run again (same address), but at the
 * positions the spill kept: free chunks for a stitched run, chunks at
 * their new home for a segment run. The block owns them afterwards; its
 * bytes are for the caller to bring back. A stuck block (its chunks
 * never went) only gets its access again. With defer, the caller grants
 * the access (struct gml_access). 0, or -ENOMEM / -errno with the block
 * still spilled.
 */
int gml_large_attach(gmlake_ctx *ctx, struct gml_block *b,
		     struct gml_access *defer)
{
	struct fetch_run r;
	struct gml_chunk **got;
	int ret;

	if (b->stuck) {
		/* Its chunks are still mapped as the failed fetch mapped them
		 * (a span whole, else chunk by chunk): access again (a failed
		 * grant may be why it failed), and the caller copies. */
		ret = gml_fetch_access(ctx, b->ptr, gml_large_bytes(ctx, b),
				       b->view->chunks[b->pos]->spanned ?
				       1 : b->n, defer);
		if (!ret)
			b->stuck = false;
		return ret;
	}
	r = fetch_run_of(ctx, b);
	got = calloc(r.n, sizeof(*got));
	if (!got)
		return gml_set_error(-ENOMEM, "no host memory to fetch a block");
	if (ctx->nzombies)
		gml_zombies_reap(ctx);
	if (ctx->nstale)
		gml_stale_reap(ctx, false);
	b->view->maxfree = GML_RUN_UNKNOWN;
	if (r.n == b->n && gml_span_wanted(b) &&
	    gml_span_attach(ctx, b, defer) == 0) {
		b->fetches++;
		free(got);
		return 0;
	}
	if (b->view->stitched)
		ret = attach_stitched(ctx, b, &r, got, defer);
	else
		ret = attach_segment(ctx, b, &r, got, defer);
	for (uint32_t i = 0; !ret && i < r.n; i++) {
		got[i]->owner = b;
		gml_chunk_touch(got[i]);
	}
	if (!ret) {
		b->fetches++;
		b->kept_lo = b->kept_hi = 0;
	}
	free(got);
	return ret;
}

/* Free a spilled block: its run stays holes, but its kept positions free
 * chunks guarded by g; a stitched view with holes and no live block
 * leaves the cache. */
void gml_large_free_spilled(gmlake_ctx *ctx, struct gml_block *b,
			    const struct gml_guard *g)
{
	struct gml_view *v = b->view;
	uint32_t tail = b->pos + b->n - b->kept_hi;

	for (uint32_t p = b->pos; p < b->pos + b->kept_lo; p++) {
		v->chunks[p]->owner = NULL;
		v->chunks[p]->guard = *g;
	}
	for (uint32_t p = tail; p < b->pos + b->n; p++) {
		v->chunks[p]->owner = NULL;
		v->chunks[p]->guard = *g;
	}
	if (b->kept_lo)
		gml_run_touch(v, b->pos, b->kept_lo, false);
	if (b->kept_hi)
		gml_run_touch(v, tail, b->kept_hi, false);
	v->live--;
	free(b);
	if (!v->stitched)
		return;
	gml_gauge_add(&ctx->st.stitched_live, -1);
	if (!v->live && !v->dying)
		gml_view_evict(ctx, v, false);
}
