/* SPDX-License-Identifier: MIT */
/*
 * Views: the virtual ranges of segments and stitched views. Their lists,
 * a view's life (new, mapped, torn down), its mapped-position count, and
 * the stream guards that say when the last work on it completed.
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

void gml_list_add(struct gml_view **head, struct gml_view *v)
{
	v->prev = NULL;
	v->next = *head;
	if (*head)
		(*head)->prev = v;
	*head = v;
}

/* The newest segment: stitching and repairs take chunks from the top. */
struct gml_view *gml_list_last(struct gml_view *head)
{
	while (head && head->next)
		head = head->next;
	return head;
}

/* At the end: segments stay in creation order, oldest first. */
void gml_list_append(struct gml_view **head, struct gml_view *v)
{
	struct gml_view **link = head, *prev = NULL;

	while (*link) {
		prev = *link;
		link = &prev->next;
	}
	v->prev = prev;
	v->next = NULL;
	*link = v;
}

void gml_list_del(struct gml_view **head, struct gml_view *v)
{
	if (v->prev)
		v->prev->next = v->next;
	else
		*head = v->next;
	if (v->next)
		v->next->prev = v->prev;
	v->prev = v->next = NULL;
}

int gml_add_view_ref(struct gml_chunk *c, struct gml_view *v)
{
	if (c->nviews == c->cap_views) {
		uint32_t cap = c->cap_views ? c->cap_views * 2 : 4;
		struct gml_view **views = realloc(c->views, cap * sizeof(*views));

		if (!views)
			return -ENOMEM;
		c->views = views;
		c->cap_views = cap;
	}
	c->views[c->nviews++] = v;
	return 0;
}

void gml_del_view_ref(struct gml_chunk *c, struct gml_view *v)
{
	for (uint32_t i = 0; i < c->nviews; i++) {
		if (c->views[i] == v) {
			c->views[i] = c->views[--c->nviews];
			return;
		}
	}
}

struct gml_view *gml_view_new(uint32_t n, bool stitched)
{
	struct gml_view *v = calloc(1, sizeof(*v));

	if (!v)
		return NULL;
	v->chunks = calloc(n, sizeof(*v->chunks));
	v->mapped = calloc(n, 1);
	if (!v->chunks || !v->mapped) {
		free(v->chunks);
		free(v->mapped);
		free(v);
		return NULL;
	}
	v->n = v->cap = n;
	v->stitched = stitched;
	v->maxfree = GML_RUN_UNKNOWN;
	return v;
}

void gml_count_mapping(gmlake_ctx *ctx, int64_t positions)
{
	gml_gauge_add(&ctx->st.mapped_bytes, positions * (int64_t)ctx->chunk);
}

/*
 * Undo as much of a view as the driver lets us: unmap each mapped position,
 * release the chunks a segment created, free the range. 0 when all is
 * gone and v freed; -EAGAIN when something failed and v must be retried.
 */
int gml_view_teardown(gmlake_ctx *ctx, struct gml_view *v)
{
	bool done = true;
	uint32_t len;

	v->maxfree = GML_RUN_UNKNOWN;
	for (uint32_t i = 0; i < v->n; i += len) {
		struct gml_chunk *c = v->chunks[i];

		len = gml_mapping_len(v, i);
		if (c && c->slab_len && !v->stitched) {
			if (gml_slab_drop(ctx, v, i))
				done = false;
			continue;
		}
		if (v->mapped[i] && gml_view_unmap_run(ctx, v, i, len)) {
			done = false;
			continue;
		}
		if (!c)
			continue;
		if (v->stitched) {
			for (uint32_t k = i; k < i + len; k++) {
				gml_del_view_ref(v->chunks[k], v);
				v->chunks[k] = NULL;
			}
			continue;
		}
		if (c->nviews || gml_dev_mem_release(&ctx->dev, c->handle)) {
			done = false;
			continue;
		}
		free(c->views);
		free(c);
		v->chunks[i] = NULL;
		gml_gauge_add(&ctx->st.chunks, -1);
		gml_reserved_add(ctx, -(int64_t)ctx->chunk);
		ctx->st.releases++;
	}
	if (!done || (v->va && gml_dev_va_free(&ctx->dev, v->va,
					   (size_t)v->cap * ctx->chunk)))
		return -EAGAIN;
	free(v->guards);
	free(v->runs);
	free(v->chunks);
	free(v->mapped);
	free(v);
	return 0;
}

/* The first position of the mapping of v that holds position p: a
 * slab's first, else p. */
uint32_t gml_mapping_start(const struct gml_view *v, uint32_t p)
{
	const struct gml_chunk *c = v->chunks[p];

	return c && c->slab_len ? p - c->slab_off : p;
}

/* Positions from p to the end of the mapping that holds it: the rest of
 * a slab, or one. */
uint32_t gml_mapping_len(const struct gml_view *v, uint32_t p)
{
	const struct gml_chunk *c = v->chunks[p];

	return c && c->slab_len ? (uint32_t)(c->slab_len - c->slab_off) : 1;
}

/* Unmap n positions of v from p that one mapping covers (a chunk: n 1; a
 * span: its length), their mapped bits and count in step. 0, or -errno
 * with nothing changed. */
int gml_view_unmap_run(gmlake_ctx *ctx, struct gml_view *v, uint32_t p,
		       uint32_t n)
{
	int ret = gml_dev_mem_unmap(&ctx->dev, v->va + (gml_va)p * ctx->chunk,
				    (size_t)n * ctx->chunk);

	if (ret)
		return ret;
	memset(v->mapped + p, 0, n);
	gml_count_mapping(ctx, -(int64_t)n);
	return 0;
}

/* Map handle h of n chunks at positions [p, p + n) of v, their mapped
 * bits and count in step. */
int gml_view_map_run(gmlake_ctx *ctx, struct gml_view *v, uint32_t p,
		     uint32_t n, gml_handle h)
{
	int ret = gml_dev_mem_map(&ctx->dev, v->va + (gml_va)p * ctx->chunk,
				  (size_t)n * ctx->chunk, h);

	if (ret)
		return ret;
	memset(v->mapped + p, 1, n);
	gml_count_mapping(ctx, n);
	return 0;
}

/* Map chunk handle h at position p of v. */
int gml_view_map_pos(gmlake_ctx *ctx, struct gml_view *v, uint32_t p,
		     gml_handle h)
{
	return gml_view_map_run(ctx, v, p, 1, h);
}

/* A set-access over bytes that covered handles handles, in the stats. */
void gml_count_access(gmlake_ctx *ctx, size_t bytes, uint64_t handles)
{
	ctx->st.access_bytes += bytes;
	ctx->st.access_handles += handles;
}

/*
 * Reserve a range of v->cap positions for stitched view v and map its n
 * chunks (a slab's whole, as one mapping), one set-access call for all.
 */
int gml_view_map(gmlake_ctx *ctx, struct gml_view *v)
{
	size_t bytes = (size_t)v->n * ctx->chunk;
	uint64_t handles = 0;
	uint32_t len;
	int ret;

	ret = gml_view_reserve(ctx, v);
	if (ret)
		return ret;
	for (uint32_t i = 0; i < v->n; i += len, handles++) {
		len = gml_mapping_len(v, i);
		ret = gml_view_map_run(ctx, v, i, len, v->chunks[i]->handle);
		if (ret)
			return ret;
	}
	ret = gml_dev_set_access(&ctx->dev, v->va, bytes);
	if (ret)
		return ret;
	gml_count_access(ctx, bytes, handles);
	return 0;
}

/* The range of v's cap positions, or of only n if the driver refuses that
 * much address space. */
int gml_view_reserve(gmlake_ctx *ctx, struct gml_view *v)
{
	int ret = gml_dev_va_reserve(&ctx->dev, (size_t)v->cap * ctx->chunk,
				     ctx->chunk, &v->va);

	if (ret && v->cap > v->n) {
		v->cap = v->n;
		ret = gml_dev_va_reserve(&ctx->dev, (size_t)v->n * ctx->chunk,
					 ctx->chunk, &v->va);
	}
	return ret;
}

/* Drop a view that failed half-way; keep it for a retry if the driver
 * refuses to let go. */
void gml_view_discard(gmlake_ctx *ctx, struct gml_view *v)
{
	if (gml_view_teardown(ctx, v)) {
		v->dying = true;
		gml_list_add(&ctx->dying, v);
	}
}

/* A segment with no live block, no chunk and no stale position left is
 * only a range: free it. */
void gml_seg_drop_if_empty(gmlake_ctx *ctx, struct gml_view *s)
{
	if (s->live || s->nstale || memchr(s->mapped, 1, s->n))
		return;
	for (uint32_t i = 0; i < s->n; i++)
		if (s->chunks[i])
			return;
	gml_list_del(&ctx->segs, s);
	gml_view_discard(ctx, s);
}

bool gml_guards_done(gmlake_ctx *ctx, struct gml_view *v)
{
	for (uint32_t i = 0; i < v->nguards; i++)
		if (!gml_stream_done(ctx, v->guards[i].stream, v->guards[i].seq))
			return false;
	return true;
}

/* Wait for the work that used v, or -errno. */
int gml_guards_wait(gmlake_ctx *ctx, struct gml_view *v)
{
	int ret;

	for (uint32_t i = 0; i < v->nguards; i++) {
		ret = gml_stream_wait(ctx, v->guards[i].stream,
				      v->guards[i].seq);
		if (ret)
			return ret;
	}
	return 0;
}

bool gml_chunk_in_view(const struct gml_chunk *c, const struct gml_view *v)
{
	for (uint32_t i = 0; i < c->nviews; i++)
		if (c->views[i] == v)
			return true;
	return false;
}

void gml_view_guard(struct gml_view *v, const struct gml_guard *g)
{
	struct gml_guard *grown;

	if (g->stream < 0)
		return;		/* the work is known complete */
	for (uint32_t i = 0; i < v->nguards; i++) {
		if (v->guards[i].stream == g->stream) {
			v->guards[i].seq = g->seq;
			return;
		}
	}
	grown = realloc(v->guards, (v->nguards + 1) * sizeof(*grown));
	if (!grown) {
		/* Forget nothing: without room, fall back to "never done". */
		for (uint32_t i = 0; i < v->nguards; i++)
			v->guards[i].seq = UINT64_MAX;
		return;
	}
	v->guards = grown;
	v->guards[v->nguards++] = *g;
}
