/* SPDX-License-Identifier: MIT */
/*
 * Share a block with another process: the parent fills a block, exports
 * it and sends the description with its file descriptors over a Unix
 * socket (SCM_RIGHTS); the child imports the block on a context of its
 * own, reads it back and checks it. The parent frees the block only once
 * the child is done with it.
 *
 * Build: cc -o ipc ipc.c $(pkg-config --cflags --libs gmlake)
 * Without a GPU, use the emulated device: GMLAKE_BACKEND=emu ./ipc
 */
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmlake-ipc.h>

#define SIZE ((size_t)8 << 20)
#define MAXFDS 64

/* The description; its descriptors travel beside it (SCM_RIGHTS). */
struct msg {
	struct gmlake_ipc_block blk;
	struct gmlake_ipc_piece pieces[MAXFDS];
};
union cbuf {
	char buf[CMSG_SPACE(MAXFDS * sizeof(int))];
	struct cmsghdr align;
};
static unsigned char buf[SIZE];

static int fail(const char *what, int err)
{
	fprintf(stderr, "%s: %s: %s\n", what, strerror(-err),
		gmlake_last_error());
	return 1;
}

static int send_block(int sock, const struct gmlake_ipc_block *blk)
{
	struct msg m = { .blk = *blk };
	union cbuf c;
	struct iovec iov = { &m, sizeof(m) };
	struct msghdr h = { .msg_iov = &iov, .msg_iovlen = 1,
			    .msg_control = c.buf };
	struct cmsghdr *cm;

	if (blk->npieces > MAXFDS)
		return -1;
	h.msg_controllen = CMSG_SPACE(blk->npieces * sizeof(int));
	cm = CMSG_FIRSTHDR(&h);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(blk->npieces * sizeof(int));
	for (uint32_t i = 0; i < blk->npieces; i++) {
		m.pieces[i] = blk->pieces[i];
		memcpy(CMSG_DATA(cm) + i * sizeof(int), &blk->pieces[i].fd,
		       sizeof(int));
	}
	return sendmsg(sock, &h, 0) == sizeof(m) ? 0 : -1;
}

/* The block the parent sent, with descriptors valid in this process. */
static int recv_block(int sock, struct msg *m)
{
	union cbuf c;
	struct iovec iov = { m, sizeof(*m) };
	struct msghdr h = { .msg_iov = &iov, .msg_iovlen = 1,
			    .msg_control = c.buf,
			    .msg_controllen = sizeof(c.buf) };
	struct cmsghdr *cm;

	if (recvmsg(sock, &h, MSG_CMSG_CLOEXEC) != sizeof(*m))
		return -1;
	cm = CMSG_FIRSTHDR(&h);
	if (!cm || cm->cmsg_type != SCM_RIGHTS || m->blk.npieces > MAXFDS ||
	    cm->cmsg_len != CMSG_LEN(m->blk.npieces * sizeof(int)))
		return -1;
	m->blk.pieces = m->pieces;
	for (uint32_t i = 0; i < m->blk.npieces; i++)
		memcpy(&m->pieces[i].fd, CMSG_DATA(cm) + i * sizeof(int),
		       sizeof(int));
	return 0;
}

static int child(int sock)
{
	struct msg m;
	gmlake_ctx *ctx;
	void *q;
	int ret, status = 1;

	if (recv_block(sock, &m) < 0) {
		fprintf(stderr, "child: no block came\n");
		return 1;
	}
	ret = gmlake_ctx_init(&ctx, NULL);
	if (ret < 0) {
		fail("gmlake_ctx_init", ret);
		goto out_fds;
	}
	ret = gmlake_ipc_import(ctx, &m.blk, &q);
	if (ret < 0) {
		fail("gmlake_ipc_import", ret);
		goto out_ctx;
	}
	ret = gmlake_memcpy_dtoh(ctx, buf, q, SIZE, NULL);
	if (ret < 0)
		fail("gmlake_memcpy_dtoh", ret);
	else if (buf[0] == 0x5a && !memcmp(buf, buf + 1, SIZE - 1))
		status = 0;
	else
		fprintf(stderr, "child: the block holds other bytes\n");
	ret = gmlake_ipc_close(ctx, q);
	if (ret < 0)
		status = fail("gmlake_ipc_close", ret);
out_ctx:
	ret = gmlake_ctx_destroy(ctx, false);
	if (ret < 0)
		status = fail("gmlake_ctx_destroy", ret);
out_fds:
	/* The import took no descriptor: they stay ours to close. */
	for (uint32_t i = 0; i < m.blk.npieces; i++)
		close(m.pieces[i].fd);
	return status;
}

/* Fill a block, send it, and keep it until the child has exited. */
static int parent(int sock, pid_t pid)
{
	struct gmlake_ipc_block blk;
	gmlake_ctx *ctx;
	void *p = NULL;
	int ret, ws, status = 1;

	ret = gmlake_ctx_init(&ctx, NULL);
	if (ret < 0)
		return fail("gmlake_ctx_init", ret);
	memset(buf, 0x5a, SIZE);
	if ((ret = gmlake_alloc(ctx, &p, SIZE, NULL)) < 0 ||
	    (ret = gmlake_memcpy_htod(ctx, p, buf, SIZE, NULL)) < 0 ||
	    (ret = gmlake_ipc_export(ctx, p, &blk)) < 0) {
		fail("parent", ret);
		goto out;
	}
	ret = send_block(sock, &blk);
	gmlake_ipc_block_free(&blk);	/* the child has its own copies */
	if (ret < 0)
		perror("sendmsg");
	else if (waitpid(pid, &ws, 0) == pid && WIFEXITED(ws) &&
		 WEXITSTATUS(ws) == 0)
		status = 0;
out:
	ret = p ? gmlake_free(ctx, p) : 0;
	if (ret < 0)
		status = fail("gmlake_free", ret);
	ret = gmlake_ctx_destroy(ctx, false);
	if (ret < 0)
		status = fail("gmlake_ctx_destroy", ret);
	return status;
}

int main(void)
{
	int sv[2], status;
	pid_t pid;

	/* Fork before any CUDA call: a child of a process that has
	 * initialized CUDA cannot use it. */
	if (socketpair(AF_UNIX, SOCK_SEQPACKET, 0, sv) < 0 ||
	    (pid = fork()) < 0) {
		perror("socketpair or fork");
		return 1;
	}
	if (pid == 0) {
		close(sv[0]);
		_exit(child(sv[1]));
	}
	close(sv[1]);
	status = parent(sv[0], pid);
	close(sv[0]);		/* a child still waiting sees EOF */
	waitpid(pid, NULL, 0);
	return status;
}
