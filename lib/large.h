/* SPDX-License-Identifier: MIT */
/*
 * Inside the large-block allocator: what its files (view.c, fit.c, chunk.c,
 * stitch.c, resident.c, pressure.c, alloc.c) call of each other. Callers
 * outside use the gml_large_* functions of types.h. The context lock is
 * held throughout.
 */
#ifndef GML_LARGE_H
#define GML_LARGE_H

#include <stdbool.h>
#include <stdint.h>

#include "types.h"

/* A run of n positions of a view, from pos (a fit, or a new stitch). */
struct run {
	struct gml_view *view;
	uint32_t pos, len;
};

/* view.c */
void gml_list_add(struct gml_view **head, struct gml_view *v);
struct gml_view *gml_list_last(struct gml_view *head);
void gml_list_append(struct gml_view **head, struct gml_view *v);
void gml_list_del(struct gml_view **head, struct gml_view *v);
int gml_add_view_ref(struct gml_chunk *c, struct gml_view *v);
void gml_del_view_ref(struct gml_chunk *c, struct gml_view *v);
struct gml_view *gml_view_new(uint32_t n, bool stitched);
void gml_count_mapping(gmlake_ctx *ctx, int64_t positions);
int gml_view_teardown(gmlake_ctx *ctx, struct gml_view *v);
uint32_t gml_mapping_start(const struct gml_view *v, uint32_t p);
uint32_t gml_mapping_len(const struct gml_view *v, uint32_t p);
int gml_view_map_run(gmlake_ctx *ctx, struct gml_view *v, uint32_t p,
		     uint32_t n, gml_handle h);
int gml_view_map_pos(gmlake_ctx *ctx, struct gml_view *v, uint32_t p,
		     gml_handle h);
void gml_count_access(gmlake_ctx *ctx, size_t bytes, uint64_t handles);
/* A fetch's access to [va, va + size): granted and counted now, or, with
 * defer, left to the caller in *defer (struct gml_access). */
int gml_fetch_access(gmlake_ctx *ctx, gml_va va, size_t size,
		     uint64_t handles, struct gml_access *defer);
int gml_view_reserve(gmlake_ctx *ctx, struct gml_view *v);
int gml_view_unmap_run(gmlake_ctx *ctx, struct gml_view *v, uint32_t p,
		       uint32_t n);
int gml_view_map(gmlake_ctx *ctx, struct gml_view *v);
void gml_view_discard(gmlake_ctx *ctx, struct gml_view *v);
void gml_seg_drop_if_empty(gmlake_ctx *ctx, struct gml_view *s);
bool gml_guards_done(gmlake_ctx *ctx, struct gml_view *v);
int gml_guards_wait(gmlake_ctx *ctx, struct gml_view *v);
void gml_view_guard(struct gml_view *v, const struct gml_guard *g);

/* fit.c */
bool gml_usable(gmlake_ctx *ctx, const struct gml_chunk *c, int stream);
void gml_chunk_touch(struct gml_chunk *c);
void gml_run_touch(struct gml_view *v, uint32_t p, uint32_t n, bool taken);
bool gml_first_fit(gmlake_ctx *ctx, uint32_t n, int stream,
		   struct run *first);
bool gml_best_fit(gmlake_ctx *ctx, struct gml_view *list, uint32_t n,
		  int stream, struct run *best);
bool gml_pack_first_fit(gmlake_ctx *ctx, size_t size, int stream,
			struct run *r, uint32_t *off);

/* pack.c: segment blocks at 512-byte offsets, sharing end chunks */
bool gml_pack_wanted(const gmlake_ctx *ctx, size_t size);
bool gml_pack_place(const gmlake_ctx *ctx, struct gml_view *v, uint32_t pos,
		    uint32_t len, size_t size, int stream, bool top,
		    uint32_t *grow, struct run *r, uint32_t *off);
void gml_pack_take(struct gml_block *b, const struct run *r, uint32_t off,
		   uint32_t *lo, uint32_t *hi);
void gml_pack_leave(struct gml_block *b, uint32_t *lo, uint32_t *hi);
bool gml_pack_shares(const struct gml_block *b);

/* chunk.c; slabs: growth in handles of several chunks for a block */
int gml_seg_extend(gmlake_ctx *ctx, struct gml_view *v, uint32_t k,
		   uint32_t g);
int gml_grow(gmlake_ctx *ctx, uint32_t k, bool slabs, struct run *got);
int gml_chunk_unview(gmlake_ctx *ctx, struct gml_chunk *c);
int gml_chunk_release(gmlake_ctx *ctx, struct gml_view *seg, uint32_t i);
bool gml_chunk_releasable(const struct gml_chunk *c);
void gml_chunk_handle_release(gmlake_ctx *ctx, gml_handle h);
void gml_spare_put(gmlake_ctx *ctx, gml_handle h);
int gml_chunk_handle_get(gmlake_ctx *ctx, gml_handle *h);

int gml_over_device_limit(gmlake_ctx *ctx, uint32_t n);
int gml_seg_add_holes(struct gml_view *v, uint32_t k);

/* slab.c: one handle under several positions of a segment */
uint32_t gml_slab_chunks(const gmlake_ctx *ctx);
bool gml_slab_avoid(const gmlake_ctx *ctx);
bool gml_chunk_single(const struct gml_chunk *c);
int gml_slab_new(gmlake_ctx *ctx, struct gml_view *v, uint32_t p, uint32_t n);
int gml_slab_drop(gmlake_ctx *ctx, struct gml_view *v, uint32_t p);
bool gml_slab_done(gmlake_ctx *ctx, const struct gml_view *v, uint32_t i);
bool gml_slab_held(const struct gml_view *v, uint32_t i);
int gml_slab_release(gmlake_ctx *ctx, struct gml_view *v, uint32_t i);

/* resident.c: a position (n 0) or a freed span (n positions, handle h)
 * to unmap once the work g covers is done; 0 or -ENOMEM. */
int gml_stale_add(gmlake_ctx *ctx, struct gml_view *s, uint32_t pos,
		  uint32_t n, gml_handle h, const struct gml_guard *g);

/* span.c: one handle under the run of a block that cycles */
#define GML_SPAN_MIN 16		/* chunks: 32 MiB at the default size */
bool gml_span_wanted(const struct gml_block *b);
int gml_span_grow(gmlake_ctx *ctx, uint32_t n, struct gml_block *b);
int gml_span_attach(gmlake_ctx *ctx, struct gml_block *b,
		    struct gml_access *defer);
int gml_span_detach(gmlake_ctx *ctx, struct gml_block *b);
void gml_span_free(gmlake_ctx *ctx, struct gml_block *b,
		   const struct gml_guard *g);
bool gml_span_stale_unmap(gmlake_ctx *ctx, const struct gml_stale *e);
void gml_span_put(gmlake_ctx *ctx, gml_handle h, uint32_t n);
bool gml_span_release(gmlake_ctx *ctx, gml_handle h, uint32_t n);
void gml_span_spares_release(gmlake_ctx *ctx);
void gml_span_spares_fini(gmlake_ctx *ctx);

/* stitch.c */
int gml_view_evict(gmlake_ctx *ctx, struct gml_view *v, bool wait);
void gml_cache_trim(gmlake_ctx *ctx, uint32_t limit);
int gml_stitch(gmlake_ctx *ctx, uint32_t n, int stream, struct run *got);
int gml_repair(gmlake_ctx *ctx, uint32_t n, int stream, struct run *got);

#endif
