/* SPDX-License-Identifier: MIT */
/*
 * Blocks shared with other processes (include/gmlake-ipc.h).
 *
 * The driver maps a handle only whole and from its start, so a block is
 * exported as the handles its positions lie in, in order: a position of a
 * slab or span stands for the whole handle, of which the block may use
 * only the end (its first handle) or the beginning (its last). The
 * importer maps each handle whole, one after another, in a range of its
 * own, and the block begins where it began in the first. That holds for
 * every block because a slab or span lies whole and in order at
 * consecutive positions of every view that maps it (check.c checks it).
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "error.h"
#include "gmlake-ipc.h"
#include "large.h"
#include "lock.h"
#include "types.h"

/* A range gmlake_ipc_import mapped: its pieces, still mapped from the
 * first to mapped - 1, and their handles where the driver refused to
 * release one (0: released; the mapping holds the memory). */
struct gml_import {
	struct gml_import *next;
	uintptr_t ptr;			/* what the caller got */
	size_t size;			/* the block's bytes from ptr */
	gml_va va;
	size_t total;
	uint32_t npieces, mapped;
	struct {
		size_t size;
		gml_handle held;
	} piece[];
};

/* The handle that position p of v lies in: its first position *first and
 * its length *len in positions. */
static void handle_at(const struct gml_view *v, uint32_t p, uint32_t *first,
		      uint32_t *len)
{
	const struct gml_chunk *c = v->chunks[p];

	if (c->spanned) {
		/* A span's chunk structs are one array, in order. */
		uint32_t q = p;

		while (q > 0 && v->chunks[q - 1] &&
		       v->chunks[q - 1]->spanned &&
		       v->chunks[q - 1]->handle == c->handle &&
		       v->chunks[q - 1] == c - (p - q + 1))
			q--;
		*first = q;
		*len = v->chunks[q]->span_len;
	} else {
		/* A slab's mapping, or the chunk's own (view.c). */
		*first = gml_mapping_start(v, p);
		*len = p - *first + gml_mapping_len(v, p);
	}
}

/* The large block that holds b's memory: b, or a small block's chunk. */
static struct gml_block *large_of(struct gml_block *b)
{
	return b->small ? b->sc->backing : b;
}

GML_EXPORT void gmlake_ipc_block_free(struct gmlake_ipc_block *blk)
{
	if (!blk)
		return;
	for (uint32_t i = 0; i < blk->npieces && blk->pieces; i++)
		if (blk->pieces[i].fd >= 0)
			close(blk->pieces[i].fd);
	free(blk->pieces);
	memset(blk, 0, sizeof(*blk));
}

/*
 * Whether the process has run out of descriptors (an export takes one a
 * handle, and a stitched block of 2 MiB chunks has hundreds): a probe
 * open fails with EMFILE. Then the soft limit is raised to the hard one,
 * once, as a program that needs many descriptors is expected to; *raised
 * says whether that happened now.
 */
bool gml_ipc_out_of_fds(bool *raised)
{
	struct rlimit rl;
	int fd = open("/", O_RDONLY | O_CLOEXEC);

	*raised = false;
	if (fd >= 0) {
		close(fd);
		return false;
	}
	if (errno != EMFILE)
		return false;
	if (!getrlimit(RLIMIT_NOFILE, &rl) && rl.rlim_cur < rl.rlim_max) {
		rlim_t was = rl.rlim_cur;

		rl.rlim_cur = rl.rlim_max;
		if (!setrlimit(RLIMIT_NOFILE, &rl)) {
			gml_log(GMLAKE_LOG_INFO, "ipc: raised "
				"the descriptor limit from %llu to its hard "
				"limit %llu", (unsigned long long)was,
				(unsigned long long)rl.rlim_max);
			*raised = true;
		}
	}
	return true;
}

/* The pieces of large block b, from its view; out->pieces and the
 * descriptors are new. */
static int export_large(gmlake_ctx *ctx, const struct gml_block *b,
			struct gmlake_ipc_block *out)
{
	const struct gml_view *v = b->view;
	uint32_t p = b->pos, end = b->pos + b->n, first, len;
	bool tried = false, raised;
	int ret;

	out->pieces = calloc(b->n, sizeof(*out->pieces));
	if (!out->pieces)
		return gml_set_error(-ENOMEM, "gmlake_ipc_export: out of host "
				     "memory");
	while (p < end) {
		struct gmlake_ipc_piece *pc = &out->pieces[out->npieces];

		handle_at(v, p, &first, &len);
		if (p == b->pos)
			out->start = (uint64_t)(p - first) * ctx->chunk +
				     b->off;
		else if (first != p)
			return gml_set_error(-EFAULT, "gmlake_ipc_export: "
					     "position %u of view %#llx lies "
					     "inside a handle", p,
					     (unsigned long long)v->va);
		pc->fd = -1;
		pc->size = (uint64_t)len * ctx->chunk;
		ret = gml_dev_mem_export(&ctx->dev, v->chunks[p]->handle,
					 &pc->fd, &pc->offset);
		if (ret && gml_ipc_out_of_fds(&raised)) {
			if (raised && !tried) {
				tried = true;
				continue;	/* this piece again */
			}
			return gml_set_error(-EMFILE, "gmlake_ipc_export: out "
					     "of file descriptors after %u of "
					     "the block's handles (one each; "
					     "raise ulimit -n)", out->npieces);
		}
		if (ret)
			return ret;
		out->npieces++;
		p = first + len;
	}
	return 0;
}

GML_EXPORT int gmlake_ipc_export(gmlake_ctx *ctx, const void *ptr,
				 struct gmlake_ipc_block *out)
{
	struct gml_block *b, *lb;
	int ret;

	if (!ctx || !ptr || !out)
		return gml_set_error(-EINVAL, "gmlake_ipc_export: %s is NULL",
				     !ctx ? "ctx" : !ptr ? "ptr" : "out");
	memset(out, 0, sizeof(*out));
	ret = gml_ctx_lock(ctx);
	if (ret)
		return ret;
	b = gml_ptrmap_get(&ctx->blocks, (uintptr_t)ptr);
	if (!b) {
		ret = gml_set_error(-EINVAL, "gmlake_ipc_export: %p is not the "
				    "start of a live block of this context",
				    ptr);
		goto out;
	}
	lb = large_of(b);
	if (lb->off_state != GML_OFF_RESIDENT || lb->off_refs) {
		ret = gml_set_error(-EBUSY, "gmlake_ipc_export: the block at "
				    "%p %s", ptr, lb->off_state ==
				    GML_OFF_RESIDENT ? "has offload requests "
				    "queued or in flight" : "is spilled to the "
				    "host or moving");
		goto out;
	}
	ret = export_large(ctx, lb, out);
	if (ret)
		goto out;
	out->start += (uint64_t)(b->ptr - lb->ptr);
	out->size = b->alloc_size;
	/* Its memory is mapped elsewhere now: it must not move. */
	lb->exported = true;
out:
	if (ret)
		gmlake_ipc_block_free(out);
	gml_ctx_unlock(ctx);
	return ret;
}

/* Whether blk holds together; its pieces' bytes in *total. */
static int import_check(gmlake_ctx *ctx, const struct gmlake_ipc_block *blk,
			size_t *total)
{
	size_t gran = ctx->dev.granularity, sum = 0;

	if (!blk->npieces || !blk->pieces || !blk->size)
		return gml_set_error(-EINVAL, "gmlake_ipc_import: the block "
				     "has %s", !blk->size ? "no size" :
				     "no pieces");
	for (uint32_t i = 0; i < blk->npieces; i++) {
		const struct gmlake_ipc_piece *pc = &blk->pieces[i];

		if (pc->fd < 0 || !pc->size || pc->size % gran ||
		    pc->size > SIZE_MAX - sum)
			return gml_set_error(-EINVAL, "gmlake_ipc_import: "
					     "piece %u (descriptor %d, %llu "
					     "bytes) is not a handle of whole "
					     "granules of %zu bytes", i, pc->fd,
					     (unsigned long long)pc->size,
					     gran);
		sum += pc->size;
	}
	if (blk->start >= blk->pieces[0].size || blk->size > sum ||
	    blk->start > sum - blk->size)
		return gml_set_error(-EINVAL, "gmlake_ipc_import: a block of "
				     "%llu bytes at %llu does not fit its "
				     "pieces' %zu bytes",
				     (unsigned long long)blk->size,
				     (unsigned long long)blk->start, sum);
	*total = sum;
	return 0;
}

/* Unmap what im maps, last piece first, and free its range: 0, or the
 * driver's error with im still describing what is left. */
static int import_unmap(gmlake_ctx *ctx, struct gml_import *im)
{
	int ret;

	while (im->mapped) {
		uint32_t last = im->mapped - 1;
		size_t off = 0;

		for (uint32_t i = 0; i < last; i++)
			off += im->piece[i].size;
		ret = gml_dev_mem_unmap(&ctx->dev, im->va + off,
					im->piece[last].size);
		if (ret)
			return ret;
		im->mapped--;
	}
	for (uint32_t i = 0; i < im->npieces; i++) {
		if (!im->piece[i].held)
			continue;
		ret = gml_dev_mem_release(&ctx->dev, im->piece[i].held);
		if (ret)
			return ret;
		im->piece[i].held = 0;
	}
	if (im->va) {
		ret = gml_dev_va_free(&ctx->dev, im->va, im->total);
		if (ret)
			return ret;
		im->va = 0;
	}
	return 0;
}

/* Map blk's pieces one after another at im's range, and grant access. */
static int import_map(gmlake_ctx *ctx, const struct gmlake_ipc_block *blk,
		      struct gml_import *im)
{
	size_t off = 0;
	int ret;

	for (uint32_t i = 0; i < blk->npieces; i++) {
		const struct gmlake_ipc_piece *pc = &blk->pieces[i];
		gml_handle h;
		int rel;

		ret = gml_dev_mem_import(&ctx->dev, pc->fd, pc->offset,
					 pc->size, &h);
		if (ret)
			return ret;
		ret = gml_dev_mem_map(&ctx->dev, im->va + off, pc->size, h);
		if (!ret)
			im->mapped++;
		/* A mapping holds the memory; the handle can go. */
		rel = gml_dev_mem_release(&ctx->dev, h);
		if (rel)
			im->piece[i].held = h;	/* import_unmap tries again */
		if (ret || rel)
			return ret ? ret : rel;
		off += pc->size;
	}
	return gml_dev_set_access(&ctx->dev, im->va, im->total);
}

int gml_ipc_grant(gmlake_ctx *ctx)
{
	for (struct gml_import *im = ctx->imports; im; im = im->next) {
		int ret;

		if (im->mapped < im->npieces)
			continue;	/* being set up or torn down */
		ret = gml_dev_set_access(&ctx->dev, im->va, im->total);
		if (ret)
			return ret;
	}
	return 0;
}

GML_EXPORT int gmlake_ipc_import(gmlake_ctx *ctx,
				 const struct gmlake_ipc_block *blk,
				 void **ptr)
{
	struct gml_import *im;
	size_t total = 0;
	int ret;

	if (!ctx || !blk || !ptr)
		return gml_set_error(-EINVAL, "gmlake_ipc_import: %s is NULL",
				     !ctx ? "ctx" : !blk ? "blk" : "ptr");
	ret = import_check(ctx, blk, &total);
	if (ret)
		return ret;
	im = calloc(1, sizeof(*im) + blk->npieces * sizeof(im->piece[0]));
	if (!im)
		return gml_set_error(-ENOMEM, "gmlake_ipc_import: out of host "
				     "memory");
	im->total = total;
	im->npieces = blk->npieces;
	for (uint32_t i = 0; i < blk->npieces; i++)
		im->piece[i].size = blk->pieces[i].size;
	ret = gml_ctx_lock(ctx);
	if (ret) {
		free(im);
		return ret;
	}
	ret = gml_dev_va_reserve(&ctx->dev, total, ctx->dev.granularity,
				 &im->va);
	if (ret)
		im->va = 0;
	else
		ret = import_map(ctx, blk, im);
	if (ret) {
		char msg[256];

		/* Unwinding may fail too; the caller hears the first. */
		snprintf(msg, sizeof(msg), "%s", gmlake_last_error());
		if (import_unmap(ctx, im)) {
			/* Kept, under no address, for destroy to try again. */
			gml_log(GMLAKE_LOG_WARN, "gmlake_ipc_import: a "
				"failed import left %u mappings: %s",
				im->mapped, gmlake_last_error());
			im->next = ctx->imports;
			ctx->imports = im;
		} else {
			free(im);
		}
		gml_set_error(ret, "%s", msg);
	} else {
		im->ptr = (uintptr_t)(im->va + blk->start);
		im->size = blk->size;
		im->next = ctx->imports;
		ctx->imports = im;
		*ptr = (void *)im->ptr;
	}
	gml_ctx_unlock(ctx);
	return ret;
}

GML_EXPORT int gmlake_ipc_close(gmlake_ctx *ctx, void *ptr)
{
	struct gml_import **pp, *im;
	int ret;

	if (!ctx)
		return gml_set_error(-EINVAL, "gmlake_ipc_close: ctx is NULL");
	ret = gml_ctx_lock(ctx);
	if (ret)
		return ret;
	for (pp = &ctx->imports; (im = *pp); pp = &im->next)
		if (im->ptr == (uintptr_t)ptr)
			break;
	if (!im)
		ret = gml_set_error(-EINVAL, "gmlake_ipc_close: %p is no "
				    "range gmlake_ipc_import mapped", ptr);
	else if (!(ret = import_unmap(ctx, im))) {
		*pp = im->next;
		free(im);
	}
	gml_ctx_unlock(ctx);
	return ret;
}

bool gml_ipc_holds(const gmlake_ctx *ctx, uintptr_t ptr, size_t size)
{
	for (const struct gml_import *im = ctx->imports; im; im = im->next)
		if (im->ptr && ptr >= im->ptr && size <= im->size &&
		    ptr - im->ptr <= im->size - size)
			return true;
	return false;
}

/* At destroy: unmap what importers left mapped. */
void gml_ipc_fini(gmlake_ctx *ctx)
{
	struct gml_import *im;

	while ((im = ctx->imports)) {
		ctx->imports = im->next;
		if (import_unmap(ctx, im))
			gml_log(GMLAKE_LOG_WARN, "gmlake_ctx_destroy: an "
				"imported range stays mapped: %s",
				gmlake_last_error());
		free(im);
	}
}
