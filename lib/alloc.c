/* SPDX-License-Identifier: MIT */
/*
 * Large blocks: chunks, views and the allocation policy.
 *
 * A request of n chunks is served, in order, by
 *   1. first fit among free runs of segments: the oldest segment, the
 *      lowest position (split; no driver call),
 *   2. best fit among free runs of cached stitched views (no driver call),
 *   3. the free run at the end of the newest segment and new chunks
 *      mapped after it, while reserved memory stays within a small budget
 *      over the most ever requested (grow_in_budget),
 *   4. repair of a cached stitched view: remap only its positions whose
 *      chunks are taken, when that costs well under a new stitch,
 *   5. a new stitched view over free chunks, after growing the newest
 *      segment by only the shortfall when too few chunks are free,
 *   6. after waiting for other streams and dropping unused stitched views,
 *      steps 1-5 once more,
 * and otherwise fails with -ENOMEM, the state unchanged.
 *
 * A segment's range reserves room for the whole device and grows at its
 * end, as PyTorch's expandable segments do, so its free runs stay
 * contiguous across growths; its runs (by position) follow every change
 * in place. Step 3 is what keeps steady-state training with changing
 * shapes off the driver: a new, larger shape grows the end once, where a
 * stitch made for it would be broken and repaired whenever the shapes
 * change again. Step 2 finds the views that remain in later steps, and
 * step 1's order keeps them whole: each step's activations fill the
 * oldest chunks from the bottom, in the same places whatever the batch's
 * shape. Views that leave the cache are unmapped only once the stream
 * work that used them completed.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "error.h"
#include "types.h"

/*
 * Growth's budget over the most device memory the live blocks needed at
 * once, in thousandths: on the replayed traces 20 (2%) took the priced
 * driver time of the second half from 10-16% to 3-6% on the traces whose
 * shapes change every step, fragmentation staying under 2.5%.
 */
#define GROW_SLACK_PERMILLE 20

struct run {
	struct gml_view *view;
	uint32_t pos, len;
};

static void list_add(struct gml_view **head, struct gml_view *v)
{
	v->prev = NULL;
	v->next = *head;
	if (*head)
		(*head)->prev = v;
	*head = v;
}

/* The newest segment: stitching and repairs take chunks from the top. */
static struct gml_view *list_last(struct gml_view *head)
{
	while (head && head->next)
		head = head->next;
	return head;
}

/* At the end: segments stay in creation order, oldest first. */
static void list_append(struct gml_view **head, struct gml_view *v)
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

static void list_del(struct gml_view **head, struct gml_view *v)
{
	if (v->prev)
		v->prev->next = v->next;
	else
		*head = v->next;
	if (v->next)
		v->next->prev = v->prev;
	v->prev = v->next = NULL;
}

static bool usable(gmlake_ctx *ctx, const struct gml_chunk *c, int stream)
{
	if (!c || c->owner)
		return false;
	if (gml_guard_ready_scan(ctx, &c->guard, stream))
		return true;
	ctx->st.cross_stream_waits++;
	return false;
}

static int free_run_cmp(const void *a, const void *b)
{
	const struct gml_free_run *x = a, *y = b;

	if (x->len != y->len)
		return x->len < y->len ? -1 : 1;
	return x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* Find v's free runs again after a change; false without host memory. */
static bool view_runs(struct gml_view *v)
{
	uint32_t len = 0;

	v->nruns = 0;
	for (uint32_t i = 0; i <= v->n; i++) {
		const struct gml_chunk *c = i < v->n ? v->chunks[i] : NULL;

		if (c && !c->owner && v->mapped[i]) {
			len++;
			continue;
		}
		if (!len)
			continue;
		if (v->nruns == v->cap_runs) {
			uint32_t cap = v->cap_runs ? v->cap_runs * 2 : 4;
			struct gml_free_run *runs;

			runs = realloc(v->runs, cap * sizeof(*runs));
			if (!runs)
				return false;
			v->runs = runs;
			v->cap_runs = cap;
		}
		v->runs[v->nruns++] = (struct gml_free_run){ i - len, len };
		len = 0;
	}
	v->maxfree = 0;
	for (uint32_t k = 0; k < v->nruns; k++)
		if (v->runs[k].len > v->maxfree)
			v->maxfree = v->runs[k].len;
	/* Segments keep their runs by position (first fit, and the
	 * updates below); stitched views by length (best fit). */
	if (v->stitched && v->nruns > 1)
		qsort(v->runs, v->nruns, sizeof(*v->runs), free_run_cmp);
	return true;
}

static bool position_free(const struct gml_view *v, uint32_t i)
{
	const struct gml_chunk *c = v->chunks[i];

	return c && !c->owner && v->mapped[i];
}

/* Room for one more run in v; false without host memory. */
static bool runs_reserve(struct gml_view *v)
{
	struct gml_free_run *runs;
	uint32_t cap;

	if (v->nruns < v->cap_runs)
		return true;
	cap = v->cap_runs ? v->cap_runs * 2 : 4;
	runs = realloc(v->runs, cap * sizeof(*runs));
	if (!runs)
		return false;
	v->runs = runs;
	v->cap_runs = cap;
	return true;
}

static void runs_insert(struct gml_view *v, uint32_t k, uint32_t pos,
			uint32_t len)
{
	memmove(&v->runs[k + 1], &v->runs[k],
		(v->nruns - k) * sizeof(*v->runs));
	v->runs[k] = (struct gml_free_run){ pos, len };
	v->nruns++;
}

static void runs_remove(struct gml_view *v, uint32_t k)
{
	memmove(&v->runs[k], &v->runs[k + 1],
		(v->nruns - k - 1) * sizeof(*v->runs));
	v->nruns--;
}

/*
 * Position i of segment v may have become free or taken: update its runs
 * (by position) in place, without the whole scan view_runs makes: a
 * segment grown to the size of the device has tens of thousands of
 * positions, and every allocation and free changes some. maxfree stays
 * an upper bound when a run shrinks (the fit that finds no run that long
 * sets it right).
 */
static void seg_position_changed(struct gml_view *v, uint32_t i)
{
	uint32_t lo = 0, hi = v->nruns, k;
	struct gml_free_run *r;
	bool inside, left, right;

	if (v->maxfree == GML_RUN_UNKNOWN)
		return;
	while (lo < hi) {		/* first run ending at or after i */
		uint32_t mid = lo + (hi - lo) / 2;

		if (v->runs[mid].pos + v->runs[mid].len < i)
			lo = mid + 1;
		else
			hi = mid;
	}
	k = lo;
	r = k < v->nruns ? &v->runs[k] : NULL;
	inside = r && r->pos <= i && i < r->pos + r->len;
	if (!position_free(v, i)) {
		uint32_t end;

		if (!inside)
			return;
		end = r->pos + r->len;
		if (r->pos < i && i + 1 < end) {
			if (!runs_reserve(v)) {
				v->maxfree = GML_RUN_UNKNOWN;
				return;
			}
			r = &v->runs[k];
			r->len = i - r->pos;
			runs_insert(v, k + 1, i + 1, end - i - 1);
		} else if (r->pos < i) {
			r->len = i - r->pos;
		} else if (i + 1 < end) {
			r->pos = i + 1;
			r->len = end - i - 1;
		} else {
			runs_remove(v, k);
		}
		return;
	}
	if (inside)
		return;
	left = r && r->pos + r->len == i;
	right = k + left < v->nruns && v->runs[k + left].pos == i + 1;
	if (left && right) {
		r->len += 1 + v->runs[k + 1].len;
		runs_remove(v, k + 1);
	} else if (left) {
		r->len++;
	} else if (right) {
		r->pos--;
		r->len++;
	} else {
		if (!runs_reserve(v)) {
			v->maxfree = GML_RUN_UNKNOWN;
			return;
		}
		runs_insert(v, k, i, 1);
	}
	r = &v->runs[k];
	if (r->len > v->maxfree)
		v->maxfree = r->len;
}

/*
 * A chunk changed owner or mapping (called after the change): its
 * segment's runs follow at once; a stitched view mapping it finds its
 * runs again when next asked. The fits skip views whose known longest
 * run is too short, which keeps allocation from scanning every chunk of
 * every segment.
 */
static void chunk_touch(struct gml_chunk *c)
{
	seg_position_changed(c->seg, c->seg_pos);
	for (uint32_t i = 0; i < c->nviews; i++)
		c->views[i]->maxfree = GML_RUN_UNKNOWN;
}

/*
 * Whether v's free runs are known (found again after a change) and the
 * longest holds n. Without host memory to list them v is skipped this
 * time, its runs still unknown.
 */
static bool view_may_fit(struct gml_view *v, uint32_t n)
{
	if (v->maxfree == GML_RUN_UNKNOWN && !view_runs(v))
		return false;
	return v->maxfree >= n;
}

/*
 * Smallest usable run of at least n positions inside the free run r of v,
 * lowest position first, into *found.
 */
static void run_best_fit(gmlake_ctx *ctx, struct gml_view *v,
			 const struct gml_free_run *r, uint32_t n, int stream,
			 struct run *found)
{
	uint32_t start = r->pos, len = 0;

	for (uint32_t i = r->pos; i <= r->pos + r->len; i++) {
		if (i < r->pos + r->len && usable(ctx, v->chunks[i], stream)) {
			if (!len++)
				start = i;
			continue;
		}
		if (len >= n && (!found->view || len < found->len ||
				 (len == found->len && start < found->pos))) {
			found->view = v;
			found->pos = start;
			found->len = len;
		}
		len = 0;
	}
}

/*
 * Smallest usable run of at least n positions in v, into *best (which a
 * run of another view keeps on a tie). Every usable run lies inside one
 * free run; with one stream every free chunk is usable, so the first
 * sorted free run long enough is the answer. With several streams a free
 * chunk may still wait for another stream's work: each long enough free
 * run is searched.
 */
static void view_best_fit(gmlake_ctx *ctx, struct gml_view *v, uint32_t n,
			  int stream, struct run *best)
{
	struct run found = { 0 };
	uint32_t lo = 0, hi;

	if (!view_may_fit(v, n))
		return;
	hi = v->nruns;
	while (lo < hi) {
		uint32_t mid = lo + (hi - lo) / 2;

		if (v->runs[mid].len < n)
			lo = mid + 1;
		else
			hi = mid;
	}
	for (uint32_t k = lo; k < v->nruns; k++) {
		if (ctx->nstreams == 1) {
			found = (struct run){ v, v->runs[k].pos, v->runs[k].len };
			break;
		}
		run_best_fit(ctx, v, &v->runs[k], n, stream, &found);
		if (found.view && found.len == n)
			break;
	}
	if (found.view && (!best->view || found.len < best->len))
		*best = found;
}

/*
 * First usable run of at least n positions in segment v, lowest position
 * first, into *found. Every usable run lies inside one free run.
 */
static void view_first_fit(gmlake_ctx *ctx, struct gml_view *v, uint32_t n,
			   int stream, struct run *found)
{
	uint32_t longest = 0;

	memset(found, 0, sizeof(*found));
	if (!view_may_fit(v, n))
		return;
	for (uint32_t k = 0; k < v->nruns; k++) {
		const struct gml_free_run *r = &v->runs[k];
		uint32_t start = r->pos, len = 0;

		if (r->len > longest)
			longest = r->len;
		if (r->len < n)
			continue;
		if (ctx->nstreams == 1) {
			*found = (struct run){ v, r->pos, r->len };
			return;
		}
		for (uint32_t i = r->pos; i < r->pos + r->len; i++) {
			if (!usable(ctx, v->chunks[i], stream)) {
				len = 0;
				continue;
			}
			if (!len++)
				start = i;
			if (len == n) {
				*found = (struct run){ v, start, r->len };
				return;
			}
		}
	}
	v->maxfree = longest;	/* exact again: every run was seen */
}

/*
 * Step 1: the oldest segment with a usable run of n, its lowest one
 * (ctx->segs is in creation order).
 */
static bool first_fit(gmlake_ctx *ctx, uint32_t n, int stream,
		      struct run *first)
{
	for (struct gml_view *v = ctx->segs; v; v = v->next) {
		if (v->n < n)
			continue;
		view_first_fit(ctx, v, n, stream, first);
		if (first->view)
			return true;
	}
	return false;
}

static bool best_fit(gmlake_ctx *ctx, struct gml_view *list, uint32_t n,
		     int stream, struct run *best)
{
	memset(best, 0, sizeof(*best));
	for (struct gml_view *v = list; v; v = v->next) {
		if (v->n < n || !v->mapped)
			continue;
		view_best_fit(ctx, v, n, stream, best);
		if (best->view && best->len == n)
			break;
	}
	return best->view != NULL;
}

static int add_view_ref(struct gml_chunk *c, struct gml_view *v)
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

static void del_view_ref(struct gml_chunk *c, struct gml_view *v)
{
	for (uint32_t i = 0; i < c->nviews; i++) {
		if (c->views[i] == v) {
			c->views[i] = c->views[--c->nviews];
			return;
		}
	}
}

static struct gml_view *view_new(uint32_t n, bool stitched)
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

static void count_mapping(gmlake_ctx *ctx, int64_t positions)
{
	gml_gauge_add(&ctx->st.mapped_bytes, positions * (int64_t)ctx->chunk);
}

/*
 * Undo as much of a view as the driver lets us: unmap each mapped position,
 * release the chunks a segment created, free the range. 0 when all is
 * gone and v freed; -EAGAIN when something failed and v must be retried.
 */
static int view_teardown(gmlake_ctx *ctx, struct gml_view *v)
{
	bool done = true;

	v->maxfree = GML_RUN_UNKNOWN;
	for (uint32_t i = 0; i < v->n; i++) {
		struct gml_chunk *c = v->chunks[i];

		if (v->mapped[i]) {
			if (gml_mem_unmap(&ctx->dev, v->va + (gml_va)i * ctx->chunk,
					  ctx->chunk)) {
				done = false;
				continue;
			}
			v->mapped[i] = 0;
			count_mapping(ctx, -1);
		}
		if (!c)
			continue;
		if (v->stitched) {
			del_view_ref(c, v);
			v->chunks[i] = NULL;
			continue;
		}
		if (c->nviews || gml_mem_release(&ctx->dev, c->handle)) {
			done = false;
			continue;
		}
		free(c->views);
		free(c);
		v->chunks[i] = NULL;
		gml_gauge_add(&ctx->st.chunks, -1);
		gml_gauge_add(&ctx->st.reserved_bytes, -(int64_t)ctx->chunk);
		ctx->st.releases++;
	}
	if (!done || (v->va && gml_va_free(&ctx->dev, v->va,
					   (size_t)v->cap * ctx->chunk)))
		return -EAGAIN;
	free(v->guards);
	free(v->runs);
	free(v->chunks);
	free(v->mapped);
	free(v);
	return 0;
}

/*
 * Reserve a range of v->cap positions for v and map its n chunks, one
 * set-access call for all. A segment asks for room to grow at its end;
 * if the driver refuses that much address space, it gets only n.
 */
static int view_map(gmlake_ctx *ctx, struct gml_view *v)
{
	size_t bytes = (size_t)v->n * ctx->chunk;
	int ret;

	ret = gml_va_reserve(&ctx->dev, (size_t)v->cap * ctx->chunk,
			     ctx->chunk, &v->va);
	if (ret && v->cap > v->n) {
		v->cap = v->n;
		ret = gml_va_reserve(&ctx->dev, bytes, ctx->chunk, &v->va);
	}
	if (ret)
		return ret;
	for (uint32_t i = 0; i < v->n; i++) {
		ret = gml_mem_map(&ctx->dev, v->va + (gml_va)i * ctx->chunk,
				  ctx->chunk, v->chunks[i]->handle);
		if (ret)
			return ret;
		v->mapped[i] = 1;
		count_mapping(ctx, 1);
	}
	ret = gml_set_access(&ctx->dev, v->va, bytes);
	if (ret)
		return ret;
	ctx->st.access_bytes += bytes;
	return 0;
}

/* Drop a view that failed half-way; keep it for a retry if the driver
 * refuses to let go. */
static void view_discard(gmlake_ctx *ctx, struct gml_view *v)
{
	if (view_teardown(ctx, v)) {
		v->dying = true;
		list_add(&ctx->dying, v);
	}
}

/* A segment with no live block, no chunk and no stale position left is
 * only a range: free it. */
static void seg_drop_if_empty(gmlake_ctx *ctx, struct gml_view *s)
{
	if (s->live || s->nstale || memchr(s->mapped, 1, s->n))
		return;
	for (uint32_t i = 0; i < s->n; i++)
		if (s->chunks[i])
			return;
	list_del(&ctx->segs, s);
	view_discard(ctx, s);
}

static int over_device_limit(gmlake_ctx *ctx, uint32_t n);
static int chunk_handle_get(gmlake_ctx *ctx, gml_handle *h);
static void chunk_handle_release(gmlake_ctx *ctx, gml_handle h);

/* A new chunk for position i of segment v, not mapped yet. */
static int seg_chunk_new(gmlake_ctx *ctx, struct gml_view *v, uint32_t i)
{
	struct gml_chunk *c = calloc(1, sizeof(*c));
	int ret;

	if (!c)
		return gml_set_error(-ENOMEM, "no host memory for a chunk");
	ret = chunk_handle_get(ctx, &c->handle);
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
 * A new segment of n new chunks. Its range reserves room for the whole
 * device, so that it can grow at its end (seg_extend) the way PyTorch's
 * expandable segments do: free runs then stay contiguous across growths
 * instead of ending at the edge of each shortfall-sized segment.
 */
static int seg_create(gmlake_ctx *ctx, uint32_t n, struct gml_view **out)
{
	uint64_t room = ctx->dev_total >> ctx->chunk_shift;
	struct gml_view *v;
	int ret;

	if (n > ctx->nspares && over_device_limit(ctx, n - ctx->nspares))
		return -ENOMEM;
	v = view_new(n, false);
	if (!v)
		return gml_set_error(-ENOMEM, "no host memory for a segment");
	if (room > n && room < UINT32_MAX / 2)
		v->cap = (uint32_t)room;
	for (uint32_t i = 0; i < n; i++) {
		ret = seg_chunk_new(ctx, v, i);
		if (ret)
			goto out_discard;
	}
	ret = view_map(ctx, v);
	if (ret)
		goto out_discard;
	list_append(&ctx->segs, v);
	ctx->st.grows++;
	*out = v;
	return 0;
out_discard:
	view_discard(ctx, v);
	return ret;
}

/* Undo a failed seg_extend of v from position n on: v keeps n. */
static void seg_extend_undo(gmlake_ctx *ctx, struct gml_view *v, uint32_t n,
			    uint32_t k)
{
	for (uint32_t i = n; i < n + k; i++) {
		struct gml_chunk *c = v->chunks[i];

		/* A position the driver will not unmap stays mapped with
		 * no chunk, as after a failed release: trim tries again. */
		if (v->mapped[i] && gml_mem_unmap(&ctx->dev, v->va + (gml_va)i *
						  ctx->chunk, ctx->chunk))
			v->n = i + 1;
		else if (v->mapped[i]) {
			v->mapped[i] = 0;
			count_mapping(ctx, -1);
		}
		if (!c)
			continue;
		chunk_handle_release(ctx, c->handle);
		free(c);
		v->chunks[i] = NULL;
	}
}

/* k new chunks at the end of segment v, inside its reserved range. */
static int seg_extend(gmlake_ctx *ctx, struct gml_view *v, uint32_t k)
{
	uint32_t n = v->n, i;
	struct gml_chunk **chunks;
	uint8_t *mapped;
	int ret;

	if (k > v->cap - n)
		return -ENOSPC;
	if (k > ctx->nspares && over_device_limit(ctx, k - ctx->nspares))
		return -ENOMEM;
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
	for (i = n; i < n + k; i++) {
		ret = seg_chunk_new(ctx, v, i);
		if (ret)
			goto out_undo;
		ret = gml_mem_map(&ctx->dev, v->va + (gml_va)i * ctx->chunk,
				  ctx->chunk, v->chunks[i]->handle);
		if (ret)
			goto out_undo;
		v->mapped[i] = 1;
		count_mapping(ctx, 1);
	}
	ret = gml_set_access(&ctx->dev, v->va + (gml_va)n * ctx->chunk,
			     (size_t)k * ctx->chunk);
	if (ret)
		goto out_undo;
	ctx->st.access_bytes += (size_t)k * ctx->chunk;
	v->n = n + k;
	v->maxfree = GML_RUN_UNKNOWN;
	ctx->st.grows++;
	return 0;
out_undo:
	seg_extend_undo(ctx, v, n, k);
	return ret;
}

/*
 * k new chunks, into *got: at the end of the newest segment while its
 * range has room, else in a new segment.
 */
static int grow(gmlake_ctx *ctx, uint32_t k, struct run *got)
{
	struct gml_view *v = list_last(ctx->segs);
	uint32_t n;
	int ret;

	if (v && v->cap - v->n >= k) {
		n = v->n;
		ret = seg_extend(ctx, v, k);
		if (ret != -ENOSPC) {
			if (!ret)
				*got = (struct run){ v, n, k };
			return ret;
		}
	}
	ret = seg_create(ctx, k, &v);
	if (!ret)
		*got = (struct run){ v, 0, k };
	return ret;
}

static bool guards_done(gmlake_ctx *ctx, struct gml_view *v)
{
	for (uint32_t i = 0; i < v->nguards; i++)
		if (!gml_stream_done(ctx, v->guards[i].stream, v->guards[i].seq))
			return false;
	return true;
}

/* Wait for the work that used v, or -errno. */
static int guards_wait(gmlake_ctx *ctx, struct gml_view *v)
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

/*
 * Take a stitched view nobody uses out of the cache. It is unmapped at
 * once if the work that used it is complete (or wait says to wait for it);
 * otherwise it goes to the dying list, its guards turned into recorded
 * events, and gml_reap_dying() unmaps it later without blocking.
 */
static int view_evict(gmlake_ctx *ctx, struct gml_view *v, bool wait)
{
	if (wait && !guards_done(ctx, v)) {
		int ret = guards_wait(ctx, v);

		if (ret)
			return ret;
	}
	list_del(&ctx->stitched, v);
	ctx->nstitched--;
	gml_gauge_add(&ctx->st.stitched_cached, -1);
	ctx->st.evictions++;
	if (guards_done(ctx, v)) {
		view_discard(ctx, v);
		return 0;
	}
	for (uint32_t i = 0; i < v->nguards; i++)
		if (v->guards[i].seq == 0)
			gml_stream_mark(ctx, v->guards[i].stream, true,
					&v->guards[i].seq);
	v->dying = true;
	list_add(&ctx->dying, v);
	return 0;
}

/* Keep the stitched cache under its limit, least recently used first. */
static void cache_trim(gmlake_ctx *ctx, uint32_t limit)
{
	struct gml_view *v, *lru;

	while (ctx->nstitched > limit) {
		lru = NULL;
		for (v = ctx->stitched; v; v = v->next)
			if (!v->live && (!lru || v->last_use < lru->last_use))
				lru = v;
		if (!lru || view_evict(ctx, lru, false))
			return;
	}
}

static int run_cmp_len(const void *a, const void *b)
{
	const struct run *x = a, *y = b;

	return x->len < y->len ? -1 : x->len > y->len ? 1 : 0;
}

/* Every free run of the segments usable on stream; returns the chunks. */
static int collect_runs(gmlake_ctx *ctx, int stream, struct run **out,
			size_t *nruns, uint64_t *nfree)
{
	struct run *runs = NULL, *grown;
	size_t count = 0, cap = 0;

	*nfree = 0;
	for (struct gml_view *v = list_last(ctx->segs); v; v = v->prev) {
		uint32_t start = 0, len = 0;

		for (uint32_t i = 0; i <= v->n; i++) {
			if (i < v->n && v->mapped[i] &&
			    usable(ctx, v->chunks[i], stream)) {
				if (!len++)
					start = i;
				continue;
			}
			if (!len)
				continue;
			if (count == cap) {
				cap = cap ? cap * 2 : 64;
				grown = realloc(runs, cap * sizeof(*runs));
				if (!grown) {
					free(runs);
					return -ENOMEM;
				}
				runs = grown;
			}
			runs[count++] = (struct run){ v, start, len };
			*nfree += len;
			len = 0;
		}
	}
	if (count)
		qsort(runs, count, sizeof(*runs), run_cmp_len);
	*out = runs;
	*nruns = count;
	return 0;
}

/*
 * A new stitched view of n chunks: the free runs, smallest first, and a new
 * segment for the shortfall. Stitching maps no new physical memory. Small
 * runs go first so that large free runs stay whole for step 1: taking
 * the largest first made big views overlap the segments that hold other
 * big blocks, and each step repaired them.
 */
static int stitch(gmlake_ctx *ctx, uint32_t n, int stream, struct run *got)
{
	struct run grown = { 0 };
	struct gml_view *v;
	struct run *runs;
	size_t nruns;
	uint64_t nfree;
	uint32_t k = 0;
	int ret;

	ret = collect_runs(ctx, stream, &runs, &nruns, &nfree);
	if (ret)
		return gml_set_error(ret, "no host memory to stitch");
	if (nfree == 0 || n * ctx->chunk < ctx->cfg.stitch_min) {
		free(runs);
		return grow(ctx, n, got);
	}
	if (nfree < n) {
		ret = grow(ctx, n - (uint32_t)nfree, &grown);
		if (ret)
			goto out_free;
	}
	v = view_new(n, true);
	if (!v) {
		ret = gml_set_error(-ENOMEM, "no host memory to stitch");
		goto out_free;
	}
	for (size_t r = 0; r < nruns && k < n; r++)
		for (uint32_t i = 0; i < runs[r].len && k < n; i++)
			v->chunks[k++] = runs[r].view->chunks[runs[r].pos + i];
	for (uint32_t i = 0; grown.view && k < n; i++)
		v->chunks[k++] = grown.view->chunks[grown.pos + i];
	for (uint32_t i = 0; i < n; i++) {
		ret = add_view_ref(v->chunks[i], v);
		if (ret) {
			for (uint32_t j = i; j < n; j++)
				v->chunks[j] = NULL;
			gml_set_error(ret, "no host memory to stitch");
			goto out_discard;
		}
	}
	ret = view_map(ctx, v);
	if (ret)
		goto out_discard;
	free(runs);
	list_add(&ctx->stitched, v);
	ctx->nstitched++;
	gml_gauge_add(&ctx->st.stitched_cached, 1);
	ctx->st.stitches++;
	*got = (struct run){ v, 0, n };
	return 0;
out_discard:
	view_discard(ctx, v);
out_free:
	free(runs);
	return ret;
}

bool gml_chunk_in_view(const struct gml_chunk *c, const struct gml_view *v)
{
	for (uint32_t i = 0; i < c->nviews; i++)
		if (c->views[i] == v)
			return true;
	return false;
}

/* The window of n positions of v with the fewest taken chunks. */
static uint32_t best_window(gmlake_ctx *ctx, struct gml_view *v, uint32_t n,
			    int stream, uint8_t *bad, uint32_t *pos)
{
	uint32_t count = 0, best;

	for (uint32_t i = 0; i < v->n; i++)
		bad[i] = !usable(ctx, v->chunks[i], stream);
	for (uint32_t i = 0; i < n; i++)
		count += bad[i];
	best = count;
	*pos = 0;
	for (uint32_t i = n; i < v->n; i++) {
		count += bad[i] - bad[i - n];
		if (count < best) {
			best = count;
			*pos = i - n + 1;
		}
	}
	return best;
}

/* Up to want free chunks usable on stream that v does not map, those no
 * other stitched view maps first, so repairs keep other views whole. */
static uint32_t spare_chunks(gmlake_ctx *ctx, struct gml_view *v, int stream,
			     struct gml_chunk **out, uint32_t want)
{
	uint32_t got = 0;

	for (int pass = 0; pass < 2; pass++)
		for (struct gml_view *s = list_last(ctx->segs); s && got < want;
		     s = s->prev)
			for (uint32_t i = 0; i < s->n && got < want; i++) {
				struct gml_chunk *c = s->chunks[i];

				if (c && s->mapped[i] && !c->owner &&
				    (pass || !c->nviews) &&
				    (!pass || c->nviews) &&
				    gml_guard_ready(ctx, &c->guard, stream) &&
				    !gml_chunk_in_view(c, v))
					out[got++] = c;
			}
	return got;
}

/* Swap the chunk at position i of v for c: unmap, map, no access yet. */
static int remap_position(gmlake_ctx *ctx, struct gml_view *v, uint32_t i,
			  struct gml_chunk *c)
{
	gml_va va = v->va + (gml_va)i * ctx->chunk;
	int ret;

	v->maxfree = GML_RUN_UNKNOWN;
	ret = gml_mem_unmap(&ctx->dev, va, ctx->chunk);
	if (ret)
		return ret;
	v->mapped[i] = 0;
	count_mapping(ctx, -1);
	del_view_ref(v->chunks[i], v);
	v->chunks[i] = NULL;
	ret = add_view_ref(c, v);
	if (ret)
		return gml_set_error(ret, "no host memory to repair a view");
	v->chunks[i] = c;
	ret = gml_mem_map(&ctx->dev, va, ctx->chunk, c->handle);
	if (ret)
		return ret;
	v->mapped[i] = 1;
	count_mapping(ctx, 1);
	return 0;
}

/* Remap the bad positions of [pos, pos + n), one set-access per run. */
static int repair_window(gmlake_ctx *ctx, struct gml_view *v, uint32_t pos,
			 uint32_t n, const uint8_t *bad, struct gml_chunk **spare)
{
	uint32_t k = 0, start = 0;
	int ret;

	for (uint32_t i = pos; i <= pos + n; i++) {
		if (i < pos + n && bad[i]) {
			ret = remap_position(ctx, v, i, spare[k++]);
			if (ret)
				return ret;
			continue;
		}
		if (start < i && bad[i - 1] && i > pos) {
			uint32_t first = i;

			while (first > pos && bad[first - 1])
				first--;
			ret = gml_set_access(&ctx->dev, v->va + (gml_va)first *
					     ctx->chunk, (size_t)(i - first) *
					     ctx->chunk);
			if (ret)
				return ret;
			ctx->st.access_bytes += (size_t)(i - first) * ctx->chunk;
		}
		start = i + 1;
	}
	return 0;
}

/*
 * Step 3: a cached stitched view that nobody uses and whose last work is
 * complete, with a window where few chunks are taken, is repaired instead
 * of stitching anew: when shapes drift from one training step to the next,
 * most of yesterday's stitch is still free. -ENOENT when a repair would
 * cost more than a new stitch (at H200 prices a repaired chunk costs about
 * 65 us for unmap, map and access, a stitched one 42 us for map and
 * access), so the caller stitches.
 */
static int repair(gmlake_ctx *ctx, uint32_t n, int stream, struct run *got)
{
	struct gml_view *best = NULL;
	struct run grown;
	uint32_t pos, best_pos = 0, nbad, best_bad = UINT32_MAX, k;
	struct gml_chunk **spare;
	uint8_t *bad, *best_mask = NULL;
	int ret = -ENOENT;

	for (struct gml_view *v = ctx->stitched; v; v = v->next) {
		if (v->live || v->n < n || !guards_done(ctx, v))
			continue;
		bad = malloc(v->n);
		if (!bad)
			break;
		nbad = best_window(ctx, v, n, stream, bad, &pos);
		if (nbad < best_bad) {
			free(best_mask);
			best = v, best_pos = pos, best_bad = nbad, best_mask = bad;
		} else {
			free(bad);
		}
	}
	if (!best || (uint64_t)best_bad * 65 >= (uint64_t)n * 42)
		goto out_free_mask;
	spare = malloc((best_bad + 1) * sizeof(*spare));
	if (!spare)
		goto out_free_mask;
	k = spare_chunks(ctx, best, stream, spare, best_bad);
	if (k < best_bad) {
		ret = grow(ctx, best_bad - k, &grown);
		if (ret)
			goto out_free_spare;
		for (uint32_t i = 0; k < best_bad; i++)
			spare[k++] = grown.view->chunks[grown.pos + i];
	}
	ret = repair_window(ctx, best, best_pos, n, best_mask, spare);
	if (ret) {
		/* A view with a hole cannot stay cached. */
		view_evict(ctx, best, true);
		goto out_free_spare;
	}
	best->last_use = ++ctx->clock;
	ctx->st.stitch_repairs++;
	*got = (struct run){ best, best_pos, n };
out_free_spare:
	free(spare);
out_free_mask:
	free(best_mask);
	return ret;
}

static void take(gmlake_ctx *ctx, struct gml_block *b, const struct run *r,
		 uint32_t n)
{
	for (uint32_t i = 0; i < n; i++) {
		r->view->chunks[r->pos + i]->owner = b;
		chunk_touch(r->view->chunks[r->pos + i]);
	}
	r->view->live++;
	if (r->view->stitched) {
		r->view->last_use = ++ctx->clock;
		gml_gauge_add(&ctx->st.stitched_live, 1);
	}
	b->view = r->view;
	b->pos = r->pos;
	b->n = n;
	b->ptr = (uintptr_t)(r->view->va + (gml_va)r->pos * ctx->chunk);
	b->alloc_size = (size_t)n * ctx->chunk;
}

/*
 * Whether growing by k chunks keeps reserved memory within the slack over
 * the most memory requested at once (less what is spilled to the host,
 * which holds no device memory), the fragmentation budget. Growing costs
 * the driver once; a stitch or repair may cost it again every time the
 * shapes change, so growth is worth a little memory.
 */
static bool grow_in_budget(gmlake_ctx *ctx, uint32_t n, uint32_t k)
{
	int64_t want = ctx->st.requested_bytes.current +
		       (int64_t)n * (int64_t)ctx->chunk;
	int64_t after = ctx->st.reserved_bytes.current +
			(int64_t)k * (int64_t)ctx->chunk;

	if (want < ctx->st.requested_bytes.peak)
		want = ctx->st.requested_bytes.peak;
	want -= ctx->st.spilled_bytes.current;
	return after <= want + want / 1000 * GROW_SLACK_PERMILLE;
}

/*
 * Step 3: the free run at the end of the newest segment, and as many new
 * chunks after it as the request lacks, within the budget. -ENOENT when
 * this cannot serve.
 */
static int tail_grow(gmlake_ctx *ctx, uint32_t n, int stream, struct run *got)
{
	struct gml_view *v = list_last(ctx->segs);
	uint32_t len = 0, k;

	if (!v)
		return -ENOENT;
	while (len < v->n && len < n) {
		uint32_t i = v->n - 1 - len;

		if (!v->mapped[i] || !usable(ctx, v->chunks[i], stream))
			break;
		len++;
	}
	k = n - len;
	if (!k || k > v->cap - v->n || !grow_in_budget(ctx, n, k))
		return -ENOENT;
	if (seg_extend(ctx, v, k))
		return -ENOENT;
	*got = (struct run){ v, v->n - n, n };
	return 0;
}

/* Steps 1-4 of the policy. */
static int try_alloc(gmlake_ctx *ctx, uint32_t n, int stream,
		     struct gml_block *b)
{
	struct run r;
	int ret;

	if (first_fit(ctx, n, stream, &r)) {
		ctx->st.fits++;
	} else if (best_fit(ctx, ctx->stitched, n, stream, &r)) {
		ctx->st.stitch_reuses++;
	} else if (tail_grow(ctx, n, stream, &r) == 0) {
		/* counted in grows */
	} else {
		ret = repair(ctx, n, stream, &r);
		if (ret == -ENOENT)
			ret = stitch(ctx, n, stream, &r);
		if (ret)
			return ret;
	}
	take(ctx, b, &r, n);
	if (ctx->nstitched > ctx->cfg.stitch_cache_max)
		cache_trim(ctx, ctx->cfg.stitch_cache_max);
	return 0;
}

int gml_large_alloc(gmlake_ctx *ctx, size_t size, int stream,
		    struct gml_block **out)
{
	size_t chunks = (size >> ctx->chunk_shift) +
			!!(size & (ctx->chunk - 1));
	struct gml_block *b;
	int ret;

	if (chunks > UINT32_MAX / 2 || size > ctx->dev_total)
		return gml_set_error(-ENOMEM, "%zu bytes is more than any "
				     "device holds", size);
	b = calloc(1, sizeof(*b));
	if (!b)
		return gml_set_error(-ENOMEM, "no host memory for a block");
	ctx->poll_gen++;
	gml_reap_dying(ctx, false);
	ret = try_alloc(ctx, (uint32_t)chunks, stream, b);
	if (ret == -ENOMEM) {
		gml_release_cached(ctx, false);
		ret = try_alloc(ctx, (uint32_t)chunks, stream, b);
	}
	/* Offload: spill offloadable blocks, least recently used first. */
	while (ret == -ENOMEM && ctx->tier && ctx->tier->reclaim(ctx, NULL))
		ret = try_alloc(ctx, (uint32_t)chunks, stream, b);
	if (ret) {
		free(b);
		return ret;
	}
	b->stream = stream;
	*out = b;
	return 0;
}

static void view_guard(struct gml_view *v, const struct gml_guard *g)
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

void gml_large_free(gmlake_ctx *ctx, struct gml_block *b,
		    const struct gml_guard *g)
{
	struct gml_view *v = b->view;

	for (uint32_t i = 0; i < b->n; i++) {
		v->chunks[b->pos + i]->owner = NULL;
		v->chunks[b->pos + i]->guard = *g;
		chunk_touch(v->chunks[b->pos + i]);
	}
	view_guard(v, g);
	v->live--;
	free(b);
	if (!v->stitched)
		return;
	gml_gauge_add(&ctx->st.stitched_live, -1);
	if (v->holes && !v->live && !v->dying) {
		view_evict(ctx, v, false);	/* offload: holes leave */
		return;
	}
	if (ctx->nstitched > ctx->cfg.stitch_cache_max)
		cache_trim(ctx, ctx->cfg.stitch_cache_max);
}

/* Retry the teardown of views the driver did not let go of. */
void gml_reap_dying(gmlake_ctx *ctx, bool wait)
{
	struct gml_view *v = ctx->dying, *next;

	for (; v; v = next) {
		next = v->next;
		if (!guards_done(ctx, v) && (!wait || guards_wait(ctx, v)))
			continue;
		list_del(&ctx->dying, v);
		if (view_teardown(ctx, v))
			list_add(&ctx->dying, v);
	}
}

/* Give a segment's free chunk back to the driver. */
static int chunk_release(gmlake_ctx *ctx, struct gml_view *seg, uint32_t i)
{
	struct gml_chunk *c = seg->chunks[i];
	int ret;

	while (c->nviews) {
		ret = view_evict(ctx, c->views[0], true);
		if (ret)
			return ret;
		if (c->nviews && c->views[0]->dying)
			return -EAGAIN;
	}
	ret = gml_mem_release(&ctx->dev, c->handle);
	if (ret)
		return ret;
	free(c->views);
	free(c);
	seg->chunks[i] = NULL;
	seg->maxfree = GML_RUN_UNKNOWN;
	gml_gauge_add(&ctx->st.chunks, -1);
	gml_gauge_add(&ctx->st.reserved_bytes, -(int64_t)ctx->chunk);
	ctx->st.releases++;
	if (!gml_mem_unmap(&ctx->dev, seg->va + (gml_va)i * ctx->chunk,
			   ctx->chunk)) {
		seg->mapped[i] = 0;
		count_mapping(ctx, -1);
	}
	return 0;
}

static bool chunk_releasable(const struct gml_chunk *c)
{
	if (!c || c->owner)
		return false;
	for (uint32_t i = 0; i < c->nviews; i++)
		if (c->views[i]->live || c->views[i]->dying)
			return false;
	return true;
}

int gml_streams_wait_all(gmlake_ctx *ctx)
{
	int ret = 0, err;

	for (int s = 0; s < ctx->nstreams; s++) {
		err = gml_stream_wait(ctx, s, gml_stream_last(ctx, s));
		if (err && !ret)
			ret = err;
	}
	return ret;
}

/*
 * Wait for every stream, unmap every unused stitched view and, with all,
 * give every free chunk back to the driver (trim). 0 or the first error.
 */
int gml_release_cached(gmlake_ctx *ctx, bool all)
{
	struct gml_view *v, *next;
	int ret, err;

	ret = gml_streams_wait_all(ctx);
	if (ret)
		return ret;
	gml_stale_reap(ctx, true);
	gml_spares_release(ctx);
	gml_small_trim(ctx, -1);
	for (v = ctx->stitched; v; v = next) {
		next = v->next;
		if (!v->live)
			view_evict(ctx, v, true);
	}
	gml_reap_dying(ctx, true);
	for (v = ctx->segs; all && v; v = next) {
		next = v->next;
		for (uint32_t i = 0; i < v->n; i++) {
			/* A position whose unmap failed earlier: again. */
			if (!v->chunks[i] && v->mapped[i] &&
			    !gml_mem_unmap(&ctx->dev, v->va + (gml_va)i *
					   ctx->chunk, ctx->chunk)) {
				v->mapped[i] = 0;
				v->maxfree = GML_RUN_UNKNOWN;
				count_mapping(ctx, -1);
			}
			if (!chunk_releasable(v->chunks[i]))
				continue;
			err = chunk_release(ctx, v, i);
			if (err && !ret)
				ret = err;
		}
		seg_drop_if_empty(ctx, v);
	}
	return ret;
}

/* Tear down everything (destroy): stitched views, then segments. */
void gml_views_fini(gmlake_ctx *ctx)
{
	struct gml_view *v, *next;

	for (v = ctx->stitched; v; v = next) {
		next = v->next;
		list_del(&ctx->stitched, v);
		gml_gauge_add(&ctx->st.stitched_cached, -1);
		view_discard(ctx, v);
	}
	ctx->nstitched = 0;
	for (v = ctx->segs; v; v = next) {
		next = v->next;
		list_del(&ctx->segs, v);
		view_discard(ctx, v);
	}
	free(ctx->stale);
	ctx->stale = NULL;
	ctx->nstale = ctx->cap_stale = 0;
	/* Stitched views first, then the segments they pinned; twice, so a
	 * call that failed once is tried again. */
	for (int pass = 0; pass < 2 && ctx->dying; pass++)
		gml_reap_dying(ctx, true);
	for (v = ctx->dying; v; v = next) {
		next = v->next;
		list_del(&ctx->dying, v);
		gml_log(GMLAKE_LOG_WARN, "leaking a range the driver would "
			"not unmap at %#llx", (unsigned long long)v->va);
	}
}

/* ---------------------------------------------------------------------- */
/* Offload support: a block's chunks go and come back, its range stays.    */

/* Whether n more chunks would take reserved memory past cfg.device_limit. */
static int over_device_limit(gmlake_ctx *ctx, uint32_t n)
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
static void chunk_handle_release(gmlake_ctx *ctx, gml_handle h)
{
	if (!gml_mem_release(&ctx->dev, h)) {
		gml_gauge_add(&ctx->st.chunks, -1);
		gml_gauge_add(&ctx->st.reserved_bytes, -(int64_t)ctx->chunk);
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
		chunk_handle_release(ctx, ctx->zombies[i]);
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
static void spare_put(gmlake_ctx *ctx, gml_handle h)
{
	if (!handle_push(&ctx->spares, &ctx->nspares, &ctx->cap_spares, h)) {
		chunk_handle_release(ctx, h);
		return;
	}
	ctx->spare_ns = gml_now_ns();
}

void gml_spares_release(gmlake_ctx *ctx)
{
	while (ctx->nspares)
		chunk_handle_release(ctx, ctx->spares[--ctx->nspares]);
	free(ctx->spares);
	ctx->spares = NULL;
	ctx->cap_spares = 0;
}

/* A chunk handle: a spare, else a new one within the device limit. */
static int chunk_handle_get(gmlake_ctx *ctx, gml_handle *h)
{
	int ret;

	if (ctx->nspares) {
		*h = ctx->spares[--ctx->nspares];
		ctx->spare_ns = gml_now_ns();
		return 0;
	}
	ret = over_device_limit(ctx, 1);
	if (!ret)
		ret = gml_mem_create(&ctx->dev, ctx->chunk, h);
	if (ret)
		return ret;
	gml_gauge_add(&ctx->st.chunks, 1);
	gml_gauge_add(&ctx->st.reserved_bytes, (int64_t)ctx->chunk);
	return 0;
}

/*
 * Debug log, after a request served by new chunks raised the peak of
 * reserved memory: the free chunks the cache still holds, and why they
 * did not serve it (cached stitched ranges map them, or their last work
 * is still queued). What to read when reserved memory climbs past what
 * the live blocks need.
 */
void gml_log_peak_slack_now(gmlake_ctx *ctx, const char *what, size_t size)
{
	uint64_t free_n = 0, in_views = 0, busy = 0;

	for (struct gml_view *v = ctx->segs; v; v = v->next)
		for (uint32_t i = 0; i < v->n; i++) {
			struct gml_chunk *c = v->chunks[i];

			if (!c || c->owner)
				continue;
			free_n++;
			in_views += c->nviews > 0;
			busy += c->guard.stream >= 0 &&
				!gml_stream_done(ctx, c->guard.stream,
						 c->guard.seq);
		}
	if (free_n)
		gml_log(GMLAKE_LOG_DEBUG, "%s of %zu bytes raised reserved to "
			"%lld MiB with %llu free chunks left (%llu in cached "
			"stitched ranges, %llu with work queued), %u stale",
			what, size,
			(long long)(ctx->st.reserved_bytes.peak >> 20),
			(unsigned long long)free_n,
			(unsigned long long)in_views,
			(unsigned long long)busy, ctx->nstale);
}

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

		if (w->live || w->dying || view_evict(ctx, w, true)) {
			k++;
			continue;
		}
	}
	if (c->nviews)
		return gml_set_error(-EBUSY, "a chunk of the block is also "
				     "mapped by a stitched range in use");
	return 0;
}

/* Map [from, to) of b's run back after a failed detach (best effort). */
static void detach_undo(gmlake_ctx *ctx, struct gml_block *b, uint32_t to)
{
	struct gml_view *v = b->view;
	bool ok = true;

	for (uint32_t i = 0; i < to; i++) {
		uint32_t p = b->pos + i;

		if (gml_mem_map(&ctx->dev, v->va + (gml_va)p * ctx->chunk,
				ctx->chunk, v->chunks[p]->handle)) {
			ok = false;
			continue;
		}
		v->mapped[p] = 1;
		count_mapping(ctx, 1);
	}
	if (!ok || (to && gml_set_access(&ctx->dev, b->ptr,
					 (size_t)to * ctx->chunk)))
		gml_log(GMLAKE_LOG_ERROR, "cannot map block %#lx back after a "
			"failed spill", (unsigned long)b->ptr);
}

/*
 * Take the chunks of resident large block b away while its range stays
 * reserved: unmap its run; chunks of a stitched view go back to the free
 * pool of their segments, chunks of a segment (whose home is this range)
 * go back to the driver. The caller has the bytes elsewhere and the work
 * on the block is complete. With check, only see whether it would work.
 * 0, -EBUSY (a chunk is shared with a stitched range in use), or -errno
 * with the block intact.
 */
int gml_large_detach(gmlake_ctx *ctx, struct gml_block *b, bool check)
{
	static const struct gml_guard none = { -1, 0 };
	struct gml_view *v = b->view;
	uint32_t i;
	int ret;

	if (ctx->nzombies)
		gml_zombies_reap(ctx);
	v->maxfree = GML_RUN_UNKNOWN;
	for (i = 0; !v->stitched && i < b->n; i++) {
		ret = unshare_chunk(ctx, v->chunks[b->pos + i]);
		if (ret)
			return ret;
	}
	if (check)
		return 0;
	for (i = 0; i < b->n; i++) {
		uint32_t p = b->pos + i;

		ret = gml_mem_unmap(&ctx->dev, v->va + (gml_va)p * ctx->chunk,
				    ctx->chunk);
		if (ret) {
			detach_undo(ctx, b, i);
			return ret;
		}
		v->mapped[p] = 0;
		count_mapping(ctx, -1);
	}
	for (i = 0; i < b->n; i++) {
		struct gml_chunk *c = v->chunks[b->pos + i];

		v->chunks[b->pos + i] = NULL;
		c->owner = NULL;
		c->guard = none;
		chunk_touch(c);
		if (v->stitched) {
			del_view_ref(c, v);
			v->holes++;
			continue;
		}
		spare_put(ctx, c->handle);
		free(c->views);
		free(c);
	}
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

			if (c && s->mapped[i] && !c->owner &&
			    (!alone || !c->nviews) && !gml_chunk_in_view(c, v))
				out[got++] = c;
		}
	return got;
}

/* Unmap [0, k) of got from b's run after a failed attach. */
static void attach_undo(gmlake_ctx *ctx, struct gml_block *b, uint32_t k)
{
	struct gml_view *v = b->view;

	for (uint32_t i = 0; i < k; i++) {
		uint32_t p = b->pos + i;
		gml_va va = v->va + (gml_va)p * ctx->chunk;

		/* Twice: a spilled run must stay holes, and the caller
		 * gives the chunks back. */
		if (v->mapped[p] &&
		    (!gml_mem_unmap(&ctx->dev, va, ctx->chunk) ||
		     !gml_mem_unmap(&ctx->dev, va, ctx->chunk))) {
			v->mapped[p] = 0;
			count_mapping(ctx, -1);
		}
	}
}

/* Stitched run: free chunks of any segment, new ones for the shortfall. */
static int attach_stitched(gmlake_ctx *ctx, struct gml_block *b,
			   struct gml_chunk **got)
{
	struct gml_view *v = b->view;
	struct run grown;
	uint32_t k, i;
	int ret;

	k = free_chunks(ctx, v, got, b->n, true);
	k += free_chunks(ctx, v, got + k, b->n - k, false);
	/* the second pass may list a chunk of the first again */
	for (i = 0; i < k; i++)
		for (uint32_t j = 0; j < i; j++)
			if (got[j] == got[i]) {
				got[i--] = got[--k];
				break;
			}
	if (k < b->n) {
		ret = grow(ctx, b->n - k, &grown);
		if (ret)
			return ret;
		for (i = 0; k < b->n; i++)
			got[k++] = grown.view->chunks[grown.pos + i];
	}
	for (i = 0; i < b->n; i++) {
		uint32_t p = b->pos + i;

		ret = gml_mem_map(&ctx->dev, v->va + (gml_va)p * ctx->chunk,
				  ctx->chunk, got[i]->handle);
		if (ret)
			goto out_undo;
		v->mapped[p] = 1;
		count_mapping(ctx, 1);
	}
	ret = gml_set_access(&ctx->dev, b->ptr, (size_t)b->n * ctx->chunk);
	if (ret)
		goto out_undo;
	for (i = 0; i < b->n; i++) {
		ret = add_view_ref(got[i], v);
		if (ret) {
			while (i--)
				del_view_ref(got[i], v);
			gml_set_error(ret, "no host memory to fetch a block");
			goto out_undo;
		}
	}
	ctx->st.access_bytes += (size_t)b->n * ctx->chunk;
	for (i = 0; i < b->n; i++)
		v->chunks[b->pos + i] = got[i];
	v->holes -= b->n;
	return 0;
out_undo:
	attach_undo(ctx, b, b->n);
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
		/* Unmapped already: by gml_release_cached's retry. */
		if (s->mapped[e->pos] && !s->chunks[e->pos]) {
			if (gml_mem_unmap(&ctx->dev, s->va + (gml_va)e->pos *
					  ctx->chunk, ctx->chunk)) {
				ctx->stale[k++] = *e;	/* again later */
				continue;
			}
			s->mapped[e->pos] = 0;
			count_mapping(ctx, -1);
		}
		/* s stays while other entries name it (nstale). */
		s->nstale--;
		seg_drop_if_empty(ctx, s);
	}
	ctx->nstale = k;
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
	struct gml_stale *grown;
	int ret;

	if (!gml_guard_ready(ctx, &c->guard, -1)) {
		if (ctx->nstale == ctx->cap_stale) {
			uint32_t cap = ctx->cap_stale ? 2 * ctx->cap_stale : 64;

			grown = realloc(ctx->stale, cap * sizeof(*grown));
			if (!grown)
				return -ENOMEM;
			ctx->stale = grown;
			ctx->cap_stale = cap;
		}
		ctx->stale[ctx->nstale++] = (struct gml_stale){
			s, c->seg_pos, c->guard };
		s->nstale++;
	} else {
		ret = gml_mem_unmap(&ctx->dev, s->va + (gml_va)c->seg_pos *
				    ctx->chunk, ctx->chunk);
		if (ret)
			return ret;
		s->mapped[c->seg_pos] = 0;
		count_mapping(ctx, -1);
	}
	s->maxfree = GML_RUN_UNKNOWN;
	s->chunks[c->seg_pos] = NULL;
	seg_drop_if_empty(ctx, s);
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

	return c && s->mapped[i] && !c->owner && !c->nviews;
}

/* Whether every stitched view mapping c is unused and done with. */
static bool views_evictable(gmlake_ctx *ctx, const struct gml_chunk *c)
{
	for (uint32_t i = 0; i < c->nviews; i++)
		if (c->views[i]->live || c->views[i]->dying ||
		    !guards_done(ctx, c->views[i]))
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

			if (!c || !s->mapped[i] || c->owner || !c->nviews ||
			    !views_evictable(ctx, c))
				continue;
			while (c->nviews) {
				struct gml_view *w = c->views[0];
				uint32_t n = w->n;

				/* Evictable: unmapped at once, not dying. */
				if (view_evict(ctx, w, false) ||
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
		ret = chunk_handle_get(ctx, &c->handle);
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
			  struct gml_chunk **got)
{
	struct gml_view *v = b->view;
	struct gml_chunk **ready = NULL;
	uint32_t k, nready = 0, stale0 = ctx->nstale;
	bool settled;
	int ret;

	if (b->n > ctx->nspares) {
		ready = calloc(b->n - ctx->nspares, sizeof(*ready));
		if (ready)	/* without: new chunks only */
			nready = cached_chunks(ctx, ready,
					       b->n - ctx->nspares);
	}
	for (k = 0; k < b->n; k++) {
		uint32_t p = b->pos + k;

		ret = seg_chunk(ctx, v, p, ready, &nready, &got[k]);
		if (ret)
			goto out_undo;
		ret = gml_mem_map(&ctx->dev, v->va + (gml_va)p * ctx->chunk,
				  ctx->chunk, got[k]->handle);
		if (ret) {
			k++;
			goto out_undo;
		}
		v->mapped[p] = 1;
		count_mapping(ctx, 1);
	}
	ret = gml_set_access(&ctx->dev, b->ptr, (size_t)b->n * ctx->chunk);
	if (ret)
		goto out_undo;
	ctx->st.access_bytes += (size_t)b->n * ctx->chunk;
	for (k = 0; k < b->n; k++)
		v->chunks[b->pos + k] = got[k];
	free(ready);
	return 0;
out_undo:
	free(ready);
	attach_undo(ctx, b, k);
	/* Chunks taken before their last work ran serve elsewhere only
	 * once it has; released, their memory lives while mapped. */
	settled = ctx->nstale == stale0 || !gml_streams_wait_all(ctx);
	for (uint32_t i = 0; i < k; i++) {
		/* Only an unmapped chunk may serve elsewhere. */
		if (v->mapped[b->pos + i] || !settled)
			chunk_handle_release(ctx, got[i]->handle);
		else
			spare_put(ctx, got[i]->handle);
		free(got[i]->views);
		free(got[i]);
	}
	return ret;
}

/*
 * Map chunks at spilled block b's run again (same address): free chunks
 * for a stitched run, chunks at their new home for a segment run. The
 * block owns them afterwards; its bytes are for the caller to bring back.
 * 0, or -ENOMEM / -errno with the block still spilled.
 */
int gml_large_attach(gmlake_ctx *ctx, struct gml_block *b)
{
	struct gml_chunk **got = calloc(b->n, sizeof(*got));
	int ret;

	if (!got)
		return gml_set_error(-ENOMEM, "no host memory to fetch a block");
	if (ctx->nzombies)
		gml_zombies_reap(ctx);
	if (ctx->nstale)
		gml_stale_reap(ctx, false);
	b->view->maxfree = GML_RUN_UNKNOWN;
	if (b->view->stitched)
		ret = attach_stitched(ctx, b, got);
	else
		ret = attach_segment(ctx, b, got);
	if (ret == -ENOMEM) {
		/* Unused stitched views keep chunks from moving: drop them. */
		gml_release_cached(ctx, false);
		if (b->view->stitched)
			ret = attach_stitched(ctx, b, got);
		else
			ret = attach_segment(ctx, b, got);
	}
	for (uint32_t i = 0; !ret && i < b->n; i++) {
		got[i]->owner = b;
		chunk_touch(got[i]);
	}
	free(got);
	return ret;
}

/* Free a spilled block: its run stays holes; a stitched view with holes
 * and no live block leaves the cache. */
void gml_large_free_spilled(gmlake_ctx *ctx, struct gml_block *b)
{
	struct gml_view *v = b->view;

	v->live--;
	free(b);
	if (!v->stitched)
		return;
	gml_gauge_add(&ctx->st.stitched_live, -1);
	if (!v->live && !v->dying)
		view_evict(ctx, v, false);
}
