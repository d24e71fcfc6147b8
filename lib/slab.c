/* SPDX-License-Identifier: MIT */
/*
 * Slabs: a segment grown for a block in handles of several chunks.
 *
 * The driver charges cuMemSetAccess and cuMemUnmap per handle, whatever
 * its size (bench/results/offload.md: 25-40 us a handle idle, about 36 us
 * a chunk in training), so growth by 2 MiB chunks costs a create and an
 * access per chunk: ViT's second step at its largest shape grew by 817
 * chunks and spent 40 ms of driver time doing it. Growth for a block
 * (alloc.c's tail growth, a new segment, a stitch's shortfall) therefore
 * takes handles of ctx->slab chunks (GMLAKE_GROW_HANDLE, 20 MiB by default
 * as the large pool of PyTorch's expandable segments), each mapped whole,
 * and only the remainder as chunks. Regrowth after a burst of trims takes
 * handles of several growth handles (alloc.c's REGROW_HANDLES): slabs
 * are not all of one length, and a repair swaps only those of a growth
 * handle's (stitch.c).
 *
 * A slab's positions have chunk structs like any other: first fit splits
 * them, owners and guards are per position. But the driver maps a handle
 * only whole (cuMemMap refuses an offset) and unmaps a mapping only whole,
 * so a stitch maps a slab as one mapping at consecutive positions, and
 * takes a slab only when all of it is free, or, at an end of its view,
 * the free positions at one end of a slab another block holds the rest
 * of, whose taken positions the view maps outside the block (stitch.c);
 * a repair swaps a slab that another block holds part of whole, for a
 * slab free whole elsewhere or, where none is left, for single chunks
 * (stitch.c); a fetch never moves a slab's chunk; a spill takes a slab
 * whole with its block, and only where the rest of the slab is free, else
 * the block keeps its positions in it mapped (resident.c); and a slab goes
 * back to the driver whole, once every chunk of it is free. Repairs and
 * fetches grow by chunks, which they map one by one elsewhere; so does all
 * growth while gmlake_long_lived() is on.
 *
 * So a block spills all but its positions in slabs at its ends that
 * another block holds part of, and a block that lies inside such a slab
 * cannot spill (-EBUSY). Slabs are shared all the same: keeping a slab for
 * one block at a time under a tier raised fragmentation on the replayed
 * traces from 1.2-3.3% to 8.6-15.4%. Long-lived blocks, what an offload
 * tier parks (an optimizer's state), take no slab position at all then
 * (gml_slab_avoid): they live in single chunks and spans, and spill whole.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdlib.h>

#include "error.h"
#include "large.h"
#include "types.h"

/* Chunks per growth handle for a block now; 0 where growth is by chunks. */
uint32_t gml_slab_chunks(const gmlake_ctx *ctx)
{
	if (ctx->slab < 2 || ctx->long_lived)
		return 0;
	return ctx->slab;
}

/* Whether a request now must not take a slab's position: a long-lived
 * block while a tier is registered, so that it can spill. */
bool gml_slab_avoid(const gmlake_ctx *ctx)
{
	return ctx->tier && ctx->long_lived;
}

/* Whether c is a handle of its own: mapped elsewhere, moved or released
 * alone. */
bool gml_chunk_single(const struct gml_chunk *c)
{
	return c && !c->slab_len && !c->spanned;
}

/*
 * A new slab of n chunks (2 to GML_SLAB_MAX) at positions [p, p + n) of
 * segment v (empty, inside its range), mapped; set-access is the
 * caller's, over the whole growth. 0, or -errno with the positions still
 * empty.
 */
int gml_slab_new(gmlake_ctx *ctx, struct gml_view *v, uint32_t p, uint32_t n)
{
	uint32_t i;
	struct gml_chunk *c[GML_SLAB_MAX];
	gml_handle h;
	int ret;

	for (i = 0; i < n; i++) {
		c[i] = calloc(1, sizeof(*c[i]));
		if (!c[i]) {
			ret = gml_set_error(-ENOMEM, "no host memory for a "
					    "slab");
			goto out_free;
		}
	}
	ret = gml_over_device_limit(ctx, n);
	if (!ret)
		ret = gml_dev_mem_create(&ctx->dev, (size_t)n * ctx->chunk, &h);
	if (ret)
		goto out_free;
	ret = gml_view_map_run(ctx, v, p, n, h);
	if (ret) {
		if (gml_dev_mem_release(&ctx->dev, h))
			gml_log(GMLAKE_LOG_WARN, "leaking a slab the driver "
				"would not release");
		goto out_free;
	}
	gml_gauge_add(&ctx->st.chunks, n);
	gml_reserved_add(ctx, (int64_t)n * (int64_t)ctx->chunk);
	for (i = 0; i < n; i++) {
		c[i]->handle = h;
		c[i]->seg = v;
		c[i]->seg_pos = p + i;
		c[i]->guard.stream = -1;
		c[i]->slab_len = (uint16_t)n;
		c[i]->slab_off = (uint16_t)i;
		v->chunks[p + i] = c[i];
	}
	return 0;
out_free:
	while (i-- > 0)
		free(c[i]);
	return ret;
}

/*
 * Unmap and release the slab whose first position is p of segment v,
 * every chunk of it free (or the segment going: teardown) and mapped by
 * no stitched view. A handle the driver will not release stays counted as
 * a spare span of its size, which the spares' release tries again. 0, or
 * -errno (-EBUSY: a view maps it) with the slab intact.
 */
int gml_slab_drop(gmlake_ctx *ctx, struct gml_view *v, uint32_t p)
{
	struct gml_chunk *first = v->chunks[p];
	uint32_t n = first->slab_len;
	gml_handle h = first->handle;
	int ret;

	for (uint32_t i = p; i < p + n; i++)
		if (v->chunks[i]->nviews)
			return -EBUSY;	/* a stitched view maps it still */
	if (v->mapped[p]) {
		ret = gml_view_unmap_run(ctx, v, p, n);
		if (ret)
			return ret;
	}
	for (uint32_t i = 0; i < n; i++) {
		free(v->chunks[p + i]->views);
		free(v->chunks[p + i]);
		v->chunks[p + i] = NULL;
	}
	v->maxfree = GML_RUN_UNKNOWN;
	if (!gml_span_release(ctx, h, n))
		gml_span_put(ctx, h, n);
	return 0;
}

/* The first position of the slab holding position i of v. */
static uint32_t slab_first(const struct gml_view *v, uint32_t i)
{
	return i - v->chunks[i]->slab_off;
}

/* Whether position i of segment v lies in a slab a block holds part of,
 * so that no stitch can map it. */
bool gml_slab_held(const struct gml_view *v, uint32_t i)
{
	uint32_t p, n;

	if (!v->chunks[i] || !v->chunks[i]->slab_len)
		return false;
	p = slab_first(v, i);
	n = v->chunks[i]->slab_len;
	for (uint32_t k = p; k < p + n && k < v->n; k++)
		if (v->chunks[k] && v->chunks[k]->owner)
			return true;
	return false;
}

/* Whether the work on every chunk of the slab holding position i of v is
 * done, without waiting. */
bool gml_slab_done(gmlake_ctx *ctx, const struct gml_view *v, uint32_t i)
{
	uint32_t p = slab_first(v, i), n = v->chunks[p]->slab_len;

	for (uint32_t k = p; k < p + n; k++)
		if (!gml_guard_ready(ctx, &v->chunks[k]->guard, -1))
			return false;
	return true;
}

/*
 * Give the slab holding position i of segment v back to the driver when
 * every chunk of it is free (the caller knows their work is done), after
 * the unused stitched views that map it: the number of chunks that went,
 * -EBUSY while one is taken, or -errno.
 */
int gml_slab_release(gmlake_ctx *ctx, struct gml_view *v, uint32_t i)
{
	uint32_t p = slab_first(v, i), n = v->chunks[p]->slab_len;
	int ret;

	for (uint32_t k = p; k < p + n; k++)
		if (!gml_chunk_releasable(v->chunks[k]))
			return -EBUSY;
	for (uint32_t k = p; k < p + n; k++) {
		ret = gml_chunk_unview(ctx, v->chunks[k]);
		if (ret)
			return ret;
	}
	ret = gml_slab_drop(ctx, v, p);
	return ret ? ret : (int)n;
}
