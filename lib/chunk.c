/* SPDX-License-Identifier: MIT */
/*
 * Physical chunks: handles created within the device limit, spares kept
 * for the next request, zombies the driver would not release yet, and
 * segments, which own chunks and grow at the end of their reserved range.
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

/* Whether n more chunks would take reserved memory past cfg.device_limit. */
int gml_over_device_limit(gmlake_ctx *ctx, uint32_t n)
{
	uint64_t want = (uint64_t)ctx->st.reserved_bytes.current +
			(uint64_t)n * ctx->chunk;

	if (!ctx->cfg.device_limit || want <= ctx->cfg.device_limit)
		return 0;
	return gml_set_error(-ENOMEM, "%u more chunks would pass the device "
			     "limit of %zu bytes", n, ctx->cfg.device_limit);
}

/* Append h to a growing list of handles; false when there is no room. */
static bool handle_push(gml_handle **list, uint32_t *n, uint32_t *cap,
			gml_handle h)
{
	if (*n == *cap) {
		uint32_t want = *cap ? *cap * 2 : 64;
		gml_handle *grown = realloc(*list, want * sizeof(*grown));

		if (!grown)
			return false;
		*list = grown;
		*cap = want;
	}
	(*list)[(*n)++] = h;
	return true;
}

/* Give a chunk handle back, or keep it for a later try (still counted). */
void gml_chunk_handle_release(gmlake_ctx *ctx, gml_handle h)
{
	if (!gml_dev_mem_release(&ctx->dev, h)) {
		gml_gauge_add(&ctx->st.chunks, -1);
		gml_reserved_add(ctx, -(int64_t)ctx->chunk);
		ctx->st.releases++;
		return;
	}
	if (!handle_push(&ctx->zombies, &ctx->nzombies, &ctx->cap_zombies, h))
		gml_log(GMLAKE_LOG_WARN, "leaking a chunk the driver would not "
			"release");
}

/* Retry the release of chunks the driver refused before. */
void gml_zombies_reap(gmlake_ctx *ctx)
{
	uint32_t n = ctx->nzombies;

	ctx->nzombies = 0;
	for (uint32_t i = 0; i < n; i++)
		gml_chunk_handle_release(ctx, ctx->zombies[i]);
	if (!ctx->nzombies) {
		free(ctx->zombies);
		ctx->zombies = NULL;
		ctx->cap_zombies = 0;
	}
}

/*
 * Keep an unmapped chunk for the next one this context needs (a fetch, a
 * new segment) rather than release it: on the H200 a release and the
 * create that follows cost about 30 us a chunk, as much as the mapping.
 * It stays counted in reserved_bytes until gml_spares_release.
 */
void gml_spare_put(gmlake_ctx *ctx, gml_handle h)
{
	if (!handle_push(&ctx->spares, &ctx->nspares, &ctx->cap_spares, h)) {
		gml_chunk_handle_release(ctx, h);
		return;
	}
	ctx->spare_ns = gml_now_ns();
}

void gml_spares_release(gmlake_ctx *ctx)
{
	while (ctx->nspares)
		gml_chunk_handle_release(ctx, ctx->spares[--ctx->nspares]);
	free(ctx->spares);
	ctx->spares = NULL;
	ctx->cap_spares = 0;
	gml_span_spares_release(ctx);
}

/* A chunk handle: a spare, else a new one within the device limit. */
int gml_chunk_handle_get(gmlake_ctx *ctx, gml_handle *h)
{
	int ret;

	if (ctx->nspares) {
		*h = ctx->spares[--ctx->nspares];
		ctx->spare_ns = gml_now_ns();
		return 0;
	}
	ret = gml_over_device_limit(ctx, 1);
	if (!ret)
		ret = gml_dev_mem_create(&ctx->dev, ctx->chunk, h);
	if (ret)
		return ret;
	gml_gauge_add(&ctx->st.chunks, 1);
	gml_reserved_add(ctx, (int64_t)ctx->chunk);
	return 0;
}

/* A new chunk for position i of segment v, not mapped yet. */
static int seg_chunk_new(gmlake_ctx *ctx, struct gml_view *v, uint32_t i)
{
	struct gml_chunk *c = calloc(1, sizeof(*c));
	int ret;

	if (!c)
		return gml_set_error(-ENOMEM, "no host memory for a chunk");
	ret = gml_chunk_handle_get(ctx, &c->handle);
	if (ret) {
		free(c);
		return ret;
	}
	c->seg = v;
	c->seg_pos = i;
	c->guard.stream = -1;
	v->chunks[i] = c;
	return 0;
}

/*
 * A new segment of n new chunks, in handles of g chunks where it can (as
 * gml_seg_extend).
 * Its range reserves room for the whole device, so that it can grow at
 * its end (seg_extend) the way PyTorch's expandable segments do: free runs
 * then stay contiguous across growths instead of ending at the edge of
 * each shortfall-sized segment.
 */
static int seg_create(gmlake_ctx *ctx, uint32_t n, uint32_t g,
		      struct gml_view **out)
{
	uint64_t room = ctx->dev_total >> ctx->chunk_shift;
	struct gml_view *v;
	int ret;

	if (n > ctx->nspares && gml_over_device_limit(ctx, n - ctx->nspares))
		return -ENOMEM;
	v = gml_view_new(n, false);
	if (!v)
		return gml_set_error(-ENOMEM, "no host memory for a segment");
	if (room > n && room < UINT32_MAX / 2)
		v->cap = (uint32_t)room;
	ret = gml_view_reserve(ctx, v);
	if (!ret) {
		v->n = 0;	/* the positions come with the growth */
		ret = gml_seg_extend(ctx, v, n, g);
	}
	if (ret) {
		gml_view_discard(ctx, v);
		return ret;
	}
	gml_list_append(&ctx->segs, v);
	*out = v;
	return 0;
}

/*
 * A slab of a failed growth that the driver will not unmap: with access
 * granted it stays, a free slab at the segment's end (trim gives it back
 * later); else its positions stay mapped with no chunk, unusable, and the
 * handle is released (the driver frees it once unmapped).
 */
static void slab_keep(gmlake_ctx *ctx, struct gml_view *v, uint32_t p)
{
	struct gml_chunk *first = v->chunks[p];
	uint32_t n = first->slab_len;
	gml_handle h = first->handle;

	v->n = p + n;
	if (!gml_dev_set_access(&ctx->dev, v->va + (gml_va)p * ctx->chunk,
				(size_t)n * ctx->chunk)) {
		gml_count_access(ctx, (size_t)n * ctx->chunk, 1);
		return;
	}
	gml_log(GMLAKE_LOG_ERROR, "cannot unmap or grant access to a slab "
		"after a failed growth; its %u positions stay unusable", n);
	for (uint32_t i = p; i < p + n; i++) {
		free(v->chunks[i]);
		v->chunks[i] = NULL;
	}
	gml_span_release(ctx, h, n);	/* refused: counted still, lost */
}

/* Undo a failed seg_extend of v from position n on: v keeps n. */
static void seg_extend_undo(gmlake_ctx *ctx, struct gml_view *v, uint32_t n,
			    uint32_t k)
{
	for (uint32_t i = n; i < n + k; i++) {
		struct gml_chunk *c = v->chunks[i];

		if (c && c->slab_len) {
			uint32_t len = c->slab_len;

			if (gml_slab_drop(ctx, v, i))
				slab_keep(ctx, v, i);
			i += len - 1;
			continue;
		}
		/* A position the driver will not unmap stays mapped with
		 * no chunk, as after a failed release: trim tries again. */
		if (v->mapped[i] && gml_view_unmap_run(ctx, v, i, 1))
			v->n = i + 1;
		if (!c)
			continue;
		gml_chunk_handle_release(ctx, c->handle);
		free(c);
		v->chunks[i] = NULL;
	}
}

/* Room for k positions more after v's n, empty (no chunk, unmapped);
 * v->n unchanged. 0 or -ENOMEM. */
static int seg_positions(struct gml_view *v, uint32_t k)
{
	uint32_t n = v->n;
	struct gml_chunk **chunks;
	uint8_t *mapped;

	chunks = realloc(v->chunks, (size_t)(n + k) * sizeof(*chunks));
	if (!chunks)
		return gml_set_error(-ENOMEM, "no host memory to grow");
	v->chunks = chunks;
	mapped = realloc(v->mapped, n + k);
	if (!mapped)
		return gml_set_error(-ENOMEM, "no host memory to grow");
	v->mapped = mapped;
	memset(v->chunks + n, 0, k * sizeof(*chunks));
	memset(v->mapped + n, 0, k);
	return 0;
}

/*
 * k new chunks at the end of segment v, inside its reserved range: in
 * handles of g chunks (0 or 1: single chunks) while k leaves room for
 * one, then of gml_slab_chunks(), then single chunks. One set-access for
 * all of them.
 */
int gml_seg_extend(gmlake_ctx *ctx, struct gml_view *v, uint32_t k,
		   uint32_t g)
{
	uint32_t n = v->n, std = g > 1 ? gml_slab_chunks(ctx) : 0, i;
	uint64_t handles = 0;
	int ret;

	if (k > v->cap - n)
		return -ENOSPC;
	if (k > ctx->nspares && gml_over_device_limit(ctx, k - ctx->nspares))
		return -ENOMEM;
	ret = seg_positions(v, k);
	if (ret)
		return ret;
	if (g > GML_SLAB_MAX)
		g = GML_SLAB_MAX;
	for (i = n; i < n + k; handles++) {
		if (g > 1 && n + k - i < g)
			g = std < g && n + k - i >= std ? std : 0;
		if (g > 1) {
			ret = gml_slab_new(ctx, v, i, g);
			if (!ret) {
				i += g;
				continue;
			}
			if (ret != -ENOMEM)
				goto out_undo;
			g = 0;	/* spare chunks, or smaller handles, may fit */
		}
		ret = seg_chunk_new(ctx, v, i);
		if (ret)
			goto out_undo;
		ret = gml_view_map_pos(ctx, v, i, v->chunks[i]->handle);
		if (ret)
			goto out_undo;
		i++;
	}
	ret = gml_dev_set_access(&ctx->dev, v->va + (gml_va)n * ctx->chunk,
			     (size_t)k * ctx->chunk);
	if (ret)
		goto out_undo;
	gml_count_access(ctx, (size_t)k * ctx->chunk, handles);
	v->n = n + k;
	v->maxfree = GML_RUN_UNKNOWN;
	ctx->st.grows++;
	return 0;
out_undo:
	seg_extend_undo(ctx, v, n, k);
	return ret;
}

/*
 * k positions more at v's end, holes (no chunk, unmapped) for a span to
 * fill; 0, -ENOSPC past the range, or -ENOMEM without host memory.
 */
int gml_seg_add_holes(struct gml_view *v, uint32_t k)
{
	int ret;

	if (k > v->cap - v->n)
		return -ENOSPC;
	ret = seg_positions(v, k);
	if (ret)
		return ret;
	v->n += k;
	v->maxfree = GML_RUN_UNKNOWN;
	return 0;
}

/*
 * k new chunks, into *got: at the end of the newest segment while its
 * range has room, else in a new segment; slabs as for gml_seg_extend.
 */
int gml_grow(gmlake_ctx *ctx, uint32_t k, bool slabs, struct run *got)
{
	struct gml_view *v = gml_list_last(ctx->segs);
	uint32_t n, g = slabs ? gml_slab_chunks(ctx) : 0;
	int ret;

	if (v && v->cap - v->n >= k) {
		n = v->n;
		ret = gml_seg_extend(ctx, v, k, g);
		if (ret != -ENOSPC) {
			if (!ret)
				*got = (struct run){ v, n, k };
			return ret;
		}
	}
	ret = seg_create(ctx, k, g, &v);
	if (!ret)
		*got = (struct run){ v, 0, k };
	return ret;
}

/* Unmap the unused stitched views that map free chunk c (waiting for
 * their work): 0, -EAGAIN while one stays dying, or -errno. */
int gml_chunk_unview(gmlake_ctx *ctx, struct gml_chunk *c)
{
	int ret;

	while (c->nviews) {
		ret = gml_view_evict(ctx, c->views[0], true);
		if (ret)
			return ret;
		if (c->nviews && c->views[0]->dying)
			return -EAGAIN;
	}
	return 0;
}

/*
 * Give a segment's free chunk back to the driver; a slab's goes with the
 * rest of its slab, once all of it is free. The number of chunks that
 * went, or -errno (-EBUSY: the slab is not all free).
 */
int gml_chunk_release(gmlake_ctx *ctx, struct gml_view *seg, uint32_t i)
{
	struct gml_chunk *c = seg->chunks[i];
	int ret;

	if (c->slab_len)
		return gml_slab_release(ctx, seg, i);
	ret = gml_chunk_unview(ctx, c);
	if (ret)
		return ret;
	ret = gml_dev_mem_release(&ctx->dev, c->handle);
	if (ret)
		return ret;
	free(c->views);
	free(c);
	seg->chunks[i] = NULL;
	seg->maxfree = GML_RUN_UNKNOWN;
	gml_gauge_add(&ctx->st.chunks, -1);
	gml_reserved_add(ctx, -(int64_t)ctx->chunk);
	ctx->st.releases++;
	gml_view_unmap_run(ctx, seg, i, 1);	/* else trim tries again */
	return 1;
}

bool gml_chunk_releasable(const struct gml_chunk *c)
{
	if (!c || c->owner)
		return false;
	for (uint32_t i = 0; i < c->nviews; i++)
		if (c->views[i]->live || c->views[i]->dying)
			return false;
	return true;
}

