/* SPDX-License-Identifier: MIT */
/*
 * PyTorch's CUDA IPC (torch.multiprocessing) over libgmlake blocks.
 *
 * PyTorch asks the allocator of the sending process for a handle string
 * (shareIpcHandle), pickles it, and gives it to the receiving process's
 * allocator (getIpcDevPtr). A string cannot carry file descriptors, so it
 * carries the sender's pid and its descriptor numbers, and the receiver
 * copies them with pidfd_getfd(2), as PyTorch's expandable segments do:
 * that needs ptrace access to the sender (the same user, and Yama's
 * ptrace_scope 0, or CAP_SYS_PTRACE), and says so when refused.
 *
 * The sender keeps its descriptors open until the block is freed: it
 * cannot know when a receiver has copied them, and PyTorch keeps a shared
 * block allocated until every receiver let go of it (its reference-counted
 * "limbo"), so a receiver always copies them before the free.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "error.h"
#include "gmlake-ipc.h"
#include "gmlake-torch.h"
#include "torch.h"
#include "types.h"

#define WIRE_MAGIC "gmlkIPC1"

/* The handle string: this header, then npieces of struct wire_piece. */
struct wire_head {
	char magic[8];
	uint32_t pid;
	uint32_t npieces;
	uint64_t size;
	uint64_t start;
};

struct wire_piece {
	int32_t fd;
	uint32_t pad;
	uint64_t offset;
	uint64_t size;
};

/* Blocks shared so far, with the descriptors they keep open. */
struct shared {
	struct shared *next;
	uintptr_t ptr;
	struct gmlake_ipc_block blk;
};

static pthread_mutex_t shared_lock = PTHREAD_MUTEX_INITIALIZER;
static struct shared *shared_list;
static atomic_uint shared_count;	/* frees look only when not 0 */

/* The export of ptr, made on its first share; shared_lock held. */
static int shared_get(gmlake_ctx *ctx, const void *ptr,
		      const struct gmlake_ipc_block **out)
{
	struct shared *s;
	int ret;

	for (s = shared_list; s; s = s->next)
		if (s->ptr == (uintptr_t)ptr) {
			*out = &s->blk;
			return 0;
		}
	s = calloc(1, sizeof(*s));
	if (!s)
		return gml_set_error(-ENOMEM, "gmlake_torch_ipc_share: out of "
				     "host memory");
	ret = gmlake_ipc_export(ctx, ptr, &s->blk);
	if (ret) {
		free(s);
		return ret;
	}
	s->ptr = (uintptr_t)ptr;
	s->next = shared_list;
	shared_list = s;
	atomic_fetch_add(&shared_count, 1);
	*out = &s->blk;
	return 0;
}

void gml_torch_ipc_forget(const void *ptr)
{
	struct shared **pp, *s;

	if (!atomic_load_explicit(&shared_count, memory_order_relaxed))
		return;
	pthread_mutex_lock(&shared_lock);
	for (pp = &shared_list; (s = *pp); pp = &s->next)
		if (s->ptr == (uintptr_t)ptr)
			break;
	if (s) {
		*pp = s->next;
		atomic_fetch_sub(&shared_count, 1);
	}
	pthread_mutex_unlock(&shared_lock);
	if (s) {
		gmlake_ipc_block_free(&s->blk);
		free(s);
	}
}

void gml_torch_ipc_reset(void)
{
	struct shared *s;

	pthread_mutex_lock(&shared_lock);
	while ((s = shared_list)) {
		shared_list = s->next;
		gmlake_ipc_block_free(&s->blk);
		free(s);
	}
	atomic_store(&shared_count, 0);
	pthread_mutex_unlock(&shared_lock);
}

GML_EXPORT int gmlake_torch_ipc_share(int device, const void *ptr, void *buf,
				      size_t cap, size_t *len)
{
	const struct gmlake_ipc_block *blk = NULL;
	struct wire_head h;
	gmlake_ctx *ctx;
	size_t need;
	int ret;

	if (!ptr || !len || (cap && !buf))
		return gml_set_error(-EINVAL, "gmlake_torch_ipc_share: NULL "
				     "argument");
	ret = gmlake_torch_ctx_get(device, &ctx);
	if (ret)
		return ret;
	pthread_mutex_lock(&shared_lock);
	ret = shared_get(ctx, ptr, &blk);
	if (ret)
		goto out;
	need = sizeof(h) + blk->npieces * sizeof(struct wire_piece);
	*len = need;
	if (cap < need) {
		ret = gml_set_error(-ENOSPC, "gmlake_torch_ipc_share: the "
				    "handle needs %zu bytes, not %zu", need,
				    cap);
		goto out;
	}
	memcpy(h.magic, WIRE_MAGIC, sizeof(h.magic));
	h.pid = (uint32_t)getpid();
	h.npieces = blk->npieces;
	h.size = blk->size;
	h.start = blk->start;
	memcpy(buf, &h, sizeof(h));
	for (uint32_t i = 0; i < blk->npieces; i++) {
		struct wire_piece w = {
			.fd = blk->pieces[i].fd,
			.offset = blk->pieces[i].offset,
			.size = blk->pieces[i].size,
		};

		memcpy((char *)buf + sizeof(h) + i * sizeof(w), &w, sizeof(w));
	}
out:
	pthread_mutex_unlock(&shared_lock);
	return ret;
}

/* This process's copy of descriptor fd of process pid; pidfd is that
 * process's (or -1 for this one). */
static int take_fd(int pidfd, pid_t pid, int fd)
{
	int got;

	if (pidfd < 0) {
		got = dup(fd);
		if (got < 0)
			return gml_set_error(-errno, "gmlake_torch_ipc_open: "
					     "descriptor %d: %s", fd,
					     strerror(errno));
		return got;
	}
#ifdef SYS_pidfd_getfd
	got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
	if (got < 0 && errno == EMFILE) {
		bool raised;

		if (gml_ipc_out_of_fds(&raised) && raised)
			got = (int)syscall(SYS_pidfd_getfd, pidfd, fd, 0);
		if (got < 0 && errno == EMFILE)
			return gml_set_error(-EMFILE, "gmlake_torch_ipc_open: "
					     "out of file descriptors (one a "
					     "handle of the block; raise "
					     "ulimit -n)");
	}
	if (got >= 0)
		return got;
	if (errno == EPERM)
		return gml_set_error(-EPERM, "gmlake_torch_ipc_open: process "
				     "%d refuses its memory's descriptors "
				     "(pidfd_getfd: %s): the receiving "
				     "process needs ptrace access to the "
				     "sending one (the same user and "
				     "kernel.yama.ptrace_scope 0, or "
				     "CAP_SYS_PTRACE)", (int)pid,
				     strerror(errno));
	return gml_set_error(-errno, "gmlake_torch_ipc_open: descriptor %d "
			     "of process %d: pidfd_getfd: %s", fd, (int)pid,
			     strerror(errno));
#else
	(void)pid;
	(void)fd;
	return gml_set_error(-ENOSYS, "gmlake_torch_ipc_open: built without "
			     "pidfd_getfd(2)");
#endif
}

/* The sender's process, or -1 when it is this one. */
static int open_sender(pid_t pid)
{
	int pidfd;

	if (pid == getpid())
		return -1;
#ifdef SYS_pidfd_open
	pidfd = (int)syscall(SYS_pidfd_open, pid, 0);
	if (pidfd < 0)
		return gml_set_error(-errno, "gmlake_torch_ipc_open: the "
				     "sending process %d: pidfd_open: %s%s",
				     (int)pid, strerror(errno),
				     errno == ESRCH ? " (it exited, or lives "
				     "in another PID namespace)" : "");
	return pidfd;
#else
	return gml_set_error(-ENOSYS, "gmlake_torch_ipc_open: built without "
			     "pidfd_open(2)");
#endif
}

/* Parse a handle string into *h and its pieces (malloc'd, descriptors
 * still the sender's numbers). */
static int wire_parse(const void *buf, size_t len, struct wire_head *h,
		      struct gmlake_ipc_piece **pieces)
{
	if (!buf || len < sizeof(*h))
		return gml_set_error(-EINVAL, "gmlake_torch_ipc_open: a handle "
				     "of %zu bytes is no libgmlake handle",
				     len);
	memcpy(h, buf, sizeof(*h));
	if (memcmp(h->magic, WIRE_MAGIC, sizeof(h->magic)))
		return gml_set_error(-EINVAL, "gmlake_torch_ipc_open: not a "
				     "libgmlake handle (the sending process "
				     "uses another CUDA allocator?)");
	if (!h->npieces || h->npieces > (len - sizeof(*h)) /
	    sizeof(struct wire_piece) || len != sizeof(*h) +
	    (size_t)h->npieces * sizeof(struct wire_piece))
		return gml_set_error(-EINVAL, "gmlake_torch_ipc_open: a handle "
				     "of %zu bytes cannot hold %u pieces",
				     len, h->npieces);
	*pieces = calloc(h->npieces, sizeof(**pieces));
	if (!*pieces)
		return gml_set_error(-ENOMEM, "gmlake_torch_ipc_open: out of "
				     "host memory");
	for (uint32_t i = 0; i < h->npieces; i++) {
		struct wire_piece w;

		memcpy(&w, (const char *)buf + sizeof(*h) + i * sizeof(w),
		       sizeof(w));
		(*pieces)[i] = (struct gmlake_ipc_piece){ w.fd, w.offset,
							  w.size };
	}
	return 0;
}

GML_EXPORT int gmlake_torch_ipc_open(int device, const void *buf, size_t len,
				     void **ptr)
{
	struct gmlake_ipc_block blk = { 0 };
	struct wire_head h;
	gmlake_ctx *ctx = NULL;
	uint32_t taken = 0;
	int pidfd = -1, ret;

	if (!ptr)
		return gml_set_error(-EINVAL, "gmlake_torch_ipc_open: ptr is "
				     "NULL");
	ret = wire_parse(buf, len, &h, &blk.pieces);
	if (ret)
		return ret;
	blk.npieces = h.npieces;
	blk.size = h.size;
	blk.start = h.start;
	/* A receiver may not have allocated on the device yet. */
	ret = gml_torch_ctx_need(device, &ctx);
	if (!ret) {
		pidfd = open_sender((pid_t)h.pid);
		if (pidfd < -1)
			ret = pidfd;
	}
	while (!ret && taken < h.npieces) {
		int fd = take_fd(pidfd, (pid_t)h.pid, blk.pieces[taken].fd);

		if (fd < 0)
			ret = fd;
		else
			blk.pieces[taken++].fd = fd;
	}
	if (!ret)
		ret = gmlake_ipc_import(ctx, &blk, ptr);
	if (pidfd >= 0)
		close(pidfd);
	/* The mappings hold the memory: our copies of the descriptors go
	 * (and only ours: the rest are the sender's numbers). */
	blk.npieces = taken;
	gmlake_ipc_block_free(&blk);
	return ret;
}

GML_EXPORT int gmlake_torch_ipc_close(int device, void *ptr)
{
	gmlake_ctx *ctx;
	int ret = gmlake_torch_ctx_get(device, &ctx);

	return ret ? ret : gmlake_ipc_close(ctx, ptr);
}
