/* SPDX-License-Identifier: MIT */
/*
 * Packing (cfg.pack, GMLAKE_PACK; off by default): blocks of a segment
 * placed at 512-byte offsets, sharing their end chunks with their
 * neighbours, as PyTorch's expandable segments place blocks in their
 * pages. On the replayed traces it cut peak reserved memory by 30-130
 * MiB on 9 of 15 and raised the priced driver time where shapes change
 * (bench/results/pack-experiment/).
 *
 * Whole chunks cost a block what its size lacks of a chunk multiple: on
 * the replayed ViT, kept-activation GPT and generation traces, 1 MiB a
 * block on average, 49-249 MiB at their peaks (bench/results/
 * traces-1ffc003-h100/). A packed block starts in the free top of the
 * chunk below its free run, where the highest block of that chunk ends,
 * and may end in the free bottom of the chunk above, below the lowest
 * block there. Stitched views still take only whole free chunks: a chunk
 * with any block in it is taken.
 *
 * A shared chunk's owner is one of its blocks; the blocks sharing chunks
 * are linked by address (lo_nb, hi_nb), so a free hands the chunk to a
 * neighbour. Only blocks of one stream share a chunk, so that the bytes
 * one frees are reused in stream order with no event; only resident
 * blocks of a segment, without a tier (a block sharing a chunk cannot
 * spill: gml_large_detach refuses it) and outside gmlake_long_lived();
 * only sizes that are not chunk multiples (a small chunk's block, a
 * chunk, keeps its own). The fits that take whole chunks (top fit, best
 * fit in stitched views, repair, stitch) are unchanged.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include "large.h"
#include "types.h"

bool gml_pack_wanted(const gmlake_ctx *ctx, size_t size)
{
	return ctx->cfg.pack && !ctx->tier && !ctx->long_lived &&
	       (size & (ctx->chunk - 1));
}

/* The highest block with bytes in position p of segment v, taken. */
static struct gml_block *highest_in(const struct gml_view *v, uint32_t p)
{
	struct gml_block *b = v->chunks[p]->owner;

	while (b->hi_nb && b->hi_nb->pos == p)
		b = b->hi_nb;
	return b;
}

/* The lowest block with bytes in position p of segment v, taken. */
static struct gml_block *lowest_in(const struct gml_view *v, uint32_t p)
{
	struct gml_block *b = v->chunks[p]->owner;

	while (b->lo_nb && b->lo_nb->pos + b->lo_nb->n - 1 == p)
		b = b->lo_nb;
	return b;
}

/* Whether position p of segment v holds blocks a packed request on
 * stream may share: its own chunk, mapped, taken by resident blocks of v
 * on that stream. */
static bool sharable(const struct gml_view *v, uint32_t p, int stream)
{
	const struct gml_chunk *c = v->chunks[p];
	const struct gml_block *o;

	if (!c || !v->mapped[p] || !c->owner || c->seg != v ||
	    c->seg_pos != p || c->spanned)
		return false;
	o = c->owner;
	return o->view == v && !o->small && o->stream == stream &&
	       o->off_state == GML_OFF_RESIDENT && !o->exported;
}

/* Free bytes at the top of position p of segment v, above its highest
 * block, for a request on stream; 0 where it may not be shared. */
static size_t room_top(const gmlake_ctx *ctx, const struct gml_view *v,
		       uint32_t p, int stream)
{
	const struct gml_block *h;
	gml_va end;

	if (!sharable(v, p, stream))
		return 0;
	h = highest_in(v, p);
	if (h->pos + h->n - 1 != p)
		return 0;	/* it goes on past p */
	end = h->ptr + h->alloc_size - (v->va + (gml_va)p * ctx->chunk);
	return ctx->chunk - (size_t)end;
}

/* Free bytes at the bottom of position p of segment v, below its lowest
 * block; 0 where it may not be shared. */
static size_t room_bottom(const gmlake_ctx *ctx, const struct gml_view *v,
			  uint32_t p, int stream)
{
	const struct gml_block *l;

	if (!sharable(v, p, stream))
		return 0;
	l = lowest_in(v, p);
	if (l->pos != p)
		return 0;
	return (size_t)(l->ptr - (v->va + (gml_va)p * ctx->chunk));
}

/*
 * A packed place for size bytes (512-aligned) in the free run [pos, pos +
 * len) of segment v, every position of which the request may use: from
 * the free top of position pos - 1 where there is one, into the free
 * bottom of position pos + len where the run falls short. On success *r
 * (its len: the positions the block covers) and *off (the block's offset
 * in r's first); top false: no growth after the run is possible (it ends
 * below the segment's end), true: the run is the segment's top, and
 * *grow gets the new positions the place needs after it.
 */
bool gml_pack_place(const gmlake_ctx *ctx, struct gml_view *v, uint32_t pos,
		    uint32_t len, size_t size, int stream, bool top,
		    uint32_t *grow, struct run *r, uint32_t *off_out)
{
	size_t below = pos ? room_top(ctx, v, pos - 1, stream) : 0;
	size_t chunk = ctx->chunk, off = below ? chunk - below : 0;
	uint32_t start = below ? pos - 1 : pos;
	uint64_t end = off + size;	/* bytes from start's base */
	uint32_t n = (uint32_t)((end + chunk - 1) / chunk);
	uint32_t avail = pos + len - start;	/* positions free or shared */

	if (grow)
		*grow = 0;
	if (n > avail) {
		size_t last = (size_t)(end - (uint64_t)(n - 1) * chunk);

		if (top) {
			*grow = n - avail;
		} else if (n - avail > 1 || pos + len >= v->n ||
			   room_bottom(ctx, v, pos + len, stream) < last) {
			return false;
		}
	}
	*r = (struct run){ v, start, n };
	*off_out = (uint32_t)off;
	return true;
}

/*
 * Take r (a packed place, b at off in its first position) for b: its
 * positions shared at its ends keep their owner and link b to the blocks
 * there; the caller makes the others b's. Returns how many of r's first
 * and last positions were shared (*lo, *hi).
 */
void gml_pack_take(struct gml_block *b, const struct run *r, uint32_t off,
		   uint32_t *lo, uint32_t *hi)
{
	struct gml_view *v = r->view;
	uint32_t last = r->pos + r->len - 1;

	*lo = off > 0;
	*hi = (r->len > 1 || !*lo) && v->chunks[last]->owner;
	b->off = off;
	b->lo_nb = b->hi_nb = NULL;
	if (*lo) {
		struct gml_block *h = highest_in(v, r->pos);

		h->hi_nb = b;
		b->lo_nb = h;
	}
	if (*hi) {
		struct gml_block *l = lowest_in(v, last);

		l->lo_nb = b;
		b->hi_nb = l;
	}
}

/*
 * b is going: position i of its run (first or last) is shared when a
 * neighbour still has bytes there. Hand such positions to that
 * neighbour, unlink b; returns how many of its first and last positions
 * stay taken (*lo, *hi).
 */
void gml_pack_leave(struct gml_block *b, uint32_t *lo, uint32_t *hi)
{
	struct gml_view *v = b->view;
	struct gml_block *l = b->lo_nb, *h = b->hi_nb;

	*lo = l != NULL;
	*hi = h != NULL && (b->n > 1 || !l);
	if (l)
		v->chunks[b->pos]->owner = l;
	if (*hi)
		v->chunks[b->pos + b->n - 1]->owner = h;
	if (l && h && b->n == 1) {	/* both still share that chunk */
		l->hi_nb = h;
		h->lo_nb = l;
	} else {
		if (l)
			l->hi_nb = NULL;
		if (h)
			h->lo_nb = NULL;
	}
	b->lo_nb = b->hi_nb = NULL;
}

bool gml_pack_shares(const struct gml_block *b)
{
	return b->lo_nb || b->hi_nb;
}
