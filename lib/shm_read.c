/* SPDX-License-Identifier: MIT */
/*
 * Reading a published segment: the seqlock copy, and a parser that checks
 * every field against the image size and the layout version before it
 * believes it. Whatever the bytes, the reader returns a negative errno and
 * a message; it never trusts an offset or count it has not bounded. The
 * file is checked (type, owner, mode, size, then the header's magic and
 * size) before anything is allocated for it. The publisher's lock tells
 * whether it lives: a pid means nothing in another PID namespace.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "error.h"
#include "shm.h"

#define PID_LIMIT 4194304		/* the kernel's PID_MAX_LIMIT */
#define READ_TRIES 100

GML_EXPORT const char *gmlake_shm_dir(void)
{
	const char *d = getenv("GMLAKE_SHM_DIR");

	return d && *d ? d : "/dev/shm";
}

/*
 * /proc/PID/stat: "pid (comm) state ppid ... starttime ...". comm may hold
 * spaces and parentheses, so fields are counted after the last ')'.
 */
int gml_proc_stat(pid_t pid, uint64_t *start_time, char *comm, size_t len)
{
	char path[64], buf[1024], *open_paren, *close_paren, *p;
	unsigned long long v;
	ssize_t n;
	int fd, field;

	if (pid)
		snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	else
		snprintf(path, sizeof(path), "/proc/self/stat");
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -errno;
	n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return n < 0 ? -errno : -EIO;
	buf[n] = '\0';
	open_paren = strchr(buf, '(');
	close_paren = strrchr(buf, ')');
	if (!open_paren || !close_paren || close_paren < open_paren)
		return -EIO;
	if (comm && len) {
		size_t c = (size_t)(close_paren - open_paren - 1);

		if (c >= len)
			c = len - 1;
		memcpy(comm, open_paren + 1, c);
		comm[c] = '\0';
	}
	/* Field 3 (state) follows ") "; starttime is field 22. */
	p = close_paren + 1;
	for (field = 2; field < 21 && p; field++)
		p = strchr(p + 1, ' ');
	if (!p || sscanf(p, " %llu", &v) != 1)
		return -EIO;
	*start_time = v;
	return 0;
}

uint64_t gml_pidns(void)
{
	struct stat st;

	return stat("/proc/self/ns/pid", &st) ? 0 : (uint64_t)st.st_ino;
}

static int hex_digit(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	return -1;
}

bool gml_shm_name_parse(const char *base, int32_t *pid, uint64_t *token)
{
	const char *p = base;
	uint64_t v = 0;
	int d;

	if (strncmp(p, "gmlake.", 7))
		return false;
	p += 7;
	if (*p < '1' || *p > '9')
		return false;
	for (; *p >= '0' && *p <= '9'; p++) {
		v = v * 10 + (uint64_t)(*p - '0');
		if (v > PID_LIMIT)
			return false;
	}
	if (*p++ != '.')
		return false;
	*pid = (int32_t)v;
	v = 0;
	for (int i = 0; i < 16; i++, p++) {
		d = hex_digit(*p);
		if (d < 0)
			return false;
		v = v << 4 | (uint64_t)d;
	}
	if (*p || !v)
		return false;
	*token = v;
	return true;
}

__attribute__((format(printf, 1, 2)))
static int bad(const char *fmt, ...)
{
	char msg[160];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(msg, sizeof(msg), fmt, ap);
	va_end(ap);
	return gml_set_error(-EBADMSG, "shm segment: %s", msg);
}

/* Check the header; *h is an aligned copy of its first bytes. */
static int check_header(const struct gmlake_shm_header *h, size_t len)
{
	if (h->magic == 0)
		return gml_set_error(-EAGAIN, "shm segment: not initialised "
				     "yet (no magic)");
	if (h->magic != GMLAKE_SHM_MAGIC)
		return bad("bad magic %#llx", (unsigned long long)h->magic);
	if (!h->version || !h->compat_version ||
	    h->compat_version > h->version)
		return bad("bad version %u compat %u", h->version,
			   h->compat_version);
	if (h->compat_version > GMLAKE_SHM_VERSION)
		return gml_set_error(-EPROTONOSUPPORT, "shm segment: layout "
				     "%u needs a reader of layout %u, this "
				     "one reads %u", h->version,
				     h->compat_version, GMLAKE_SHM_VERSION);
	if (h->size != len)
		return bad("size field %llu, image has %zu bytes",
			   (unsigned long long)h->size, len);
	if (h->header_size < GML_SHM_HEADER_V1 || h->header_size % 8 ||
	    h->header_size > len)
		return bad("header size %u (image %zu bytes)",
			   h->header_size, len);
	if (h->slot_size < GML_SHM_SLOT_V1 || h->slot_size % 8 ||
	    h->slot_size > 65536)
		return bad("slot size %u", h->slot_size);
	if (!h->nslots || h->nslots > 1024 ||
	    (uint64_t)h->nslots * h->slot_size > len - h->header_size)
		return bad("%u slots do not fit in %zu bytes", h->nslots,
			   len);
	if (h->flags)
		return bad("unknown flags %#x", h->flags);
	if (h->pid <= 0 || h->pid > PID_LIMIT)
		return bad("pid %d", (int)h->pid);
	if (!memchr(h->comm, '\0', sizeof(h->comm)))
		return bad("command name not terminated");
	if (h->version >= 2 && !h->token)
		return bad("token 0");
	if (h->seq & 1)
		return gml_set_error(-EAGAIN, "shm segment: being written "
				     "(seq %llu)", (unsigned long long)h->seq);
	return 0;
}

static int check_slot(const struct gmlake_shm_slot *s, unsigned i)
{
	const int64_t gauges[] = {
		s->requested_bytes, s->requested_peak, s->allocated_bytes,
		s->allocated_peak, s->reserved_bytes, s->reserved_peak,
		s->mapped_bytes, s->active_blocks, s->stitched_live,
		s->stitched_cached, s->chunks, s->spilled_bytes,
		s->spilled_blocks, s->host_bytes, s->host_pinned,
		s->resident_bytes,
	};

	if (s->state > GMLAKE_SHM_SLOT_LIVE)
		return bad("slot %u: state %u", i, s->state);
	if (s->state == GMLAKE_SHM_SLOT_FREE)
		return 0;
	if (s->device < 0 || s->device > 4095)
		return bad("slot %u: device %d", i, (int)s->device);
	if (s->backend < GMLAKE_BACKEND_CUDA || s->backend > GMLAKE_BACKEND_EMU)
		return bad("slot %u: backend %d", i, (int)s->backend);
	if (s->offload_engine < 0 || s->offload_engine > 15)
		return bad("slot %u: offload engine %d", i,
			   (int)s->offload_engine);
	if (!s->ctx_id)
		return bad("slot %u: context id 0", i);
	if (!s->chunk_size || (s->chunk_size & (s->chunk_size - 1)))
		return bad("slot %u: chunk size %llu", i,
			   (unsigned long long)s->chunk_size);
	for (unsigned g = 0; g < sizeof(gauges) / sizeof(gauges[0]); g++)
		if (gauges[g] < 0)
			return bad("slot %u: gauge %u is negative", i, g);
	if (s->allocated_peak < s->allocated_bytes ||
	    s->reserved_peak < s->reserved_bytes ||
	    s->requested_peak < s->requested_bytes)
		return bad("slot %u: a peak below its current value", i);
	return 0;
}

/*
 * Copy the live slots; a slot larger than ours is cut, a smaller
 * zero-filled. Layout 1 has no resident bytes: allocated less spilled.
 */
static int copy_slots(const unsigned char *img,
		      const struct gmlake_shm_header *h,
		      struct gmlake_shm_snapshot *snap)
{
	size_t take = h->slot_size < sizeof(struct gmlake_shm_slot) ?
			      h->slot_size : sizeof(struct gmlake_shm_slot);
	struct gmlake_shm_slot s;
	int ret;

	for (uint32_t i = 0; i < h->nslots; i++) {
		memset(&s, 0, sizeof(s));
		memcpy(&s, img + h->header_size + (size_t)i * h->slot_size,
		       take);
		ret = check_slot(&s, i);
		if (ret)
			return ret;
		if (s.state != GMLAKE_SHM_SLOT_LIVE ||
		    snap->nslots == GMLAKE_SHM_SLOTS)
			continue;
		if (h->version < 2)
			s.resident_bytes = s.allocated_bytes > s.spilled_bytes ?
				s.allocated_bytes - s.spilled_bytes : 0;
		snap->slots[snap->nslots++] = s;
	}
	return 0;
}

GML_EXPORT int gmlake_shm_parse(const void *buf, size_t len,
				struct gmlake_shm_snapshot *snap)
{
	struct gmlake_shm_header h;
	uint32_t version, size;
	int ret;

	if (!buf || !snap)
		return gml_set_error(-EINVAL, "gmlake_shm_parse: %s is NULL",
				     buf ? "snap" : "buf");
	if (snap->version != GMLAKE_SHM_SNAPSHOT_VERSION ||
	    snap->size != sizeof(*snap))
		return gml_set_error(-EINVAL, "gmlake_shm_parse: snapshot "
				     "version %u size %u, this library has "
				     "version %u size %zu", snap->version,
				     snap->size, GMLAKE_SHM_SNAPSHOT_VERSION,
				     sizeof(*snap));
	if (len < GML_SHM_HEADER_V1)
		return bad("truncated: %zu bytes, the header alone is %u",
			   len, GML_SHM_HEADER_V1);
	memcpy(&h, buf, sizeof(h));
	ret = check_header(&h, len);
	if (ret)
		return ret;
	version = snap->version;
	size = snap->size;
	memset(snap, 0, sizeof(*snap));
	snap->version = version;
	snap->size = size;
	snap->layout_version = h.version;
	snap->uid = h.uid;
	snap->pid = h.pid;
	snap->start_time = h.start_time;
	snap->seq = h.seq;
	snap->publish_ns = h.publish_ns;
	snap->interval_ns = h.interval_ns;
	if (h.version >= 2) {
		snap->token = h.token;
		snap->pidns = h.pidns;
	}
	for (size_t i = 0; i < sizeof(snap->comm) && h.comm[i]; i++)
		snap->comm[i] = h.comm[i] >= 0x20 && h.comm[i] < 0x7f ?
					h.comm[i] : '?';
	ret = copy_slots(buf, &h, snap);
	if (ret)
		snap->nslots = 0;
	return ret;
}

/*
 * A name starting with "gmlake." must be canonical (gmlake.PID.TOKEN) and
 * hold the header's pid and token: "gmlake.+1.T" or "gmlake.01.T" would
 * pass for another process. Other names (copies, tests) are not checked.
 */
static int check_name(const char *path,
		      const struct gmlake_shm_snapshot *snap)
{
	const char *base = strrchr(path, '/');
	uint64_t token;
	int32_t pid;

	base = base ? base + 1 : path;
	if (strncmp(base, "gmlake.", 7))
		return 0;
	if (!gml_shm_name_parse(base, &pid, &token))
		return gml_set_error(-EBADMSG, "%s: not a segment name "
				     "(gmlake.PID.TOKEN)", path);
	if (pid != snap->pid || token != snap->token)
		return gml_set_error(-EBADMSG, "%s: the header says pid %d "
				     "token %016llx, the file name another",
				     path, (int)snap->pid,
				     (unsigned long long)snap->token);
	return 0;
}

static int check_file(const char *path, const struct stat *st,
		      uint32_t expect_uid)
{
	if (!S_ISREG(st->st_mode))
		return gml_set_error(-EINVAL, "%s: not a regular file", path);
	if (expect_uid != GMLAKE_SHM_ANY_UID && st->st_uid != expect_uid)
		return gml_set_error(-EPERM, "%s: owned by uid %u, expected "
				     "uid %u", path, (unsigned)st->st_uid,
				     (unsigned)expect_uid);
	if (st->st_mode & 077)
		return gml_set_error(-EPERM, "%s: mode %03o lets other users "
				     "in (segments are 0600)", path,
				     (unsigned)(st->st_mode & 0777));
	if (st->st_size == 0)
		return gml_set_error(-EAGAIN, "%s: empty (being created)",
				     path);
	if (st->st_size > GMLAKE_SHM_MAX_SIZE)
		return gml_set_error(-EFBIG, "%s: %lld bytes, more than %u",
				     path, (long long)st->st_size,
				     GMLAKE_SHM_MAX_SIZE);
	return 0;
}

/*
 * The seqlock copy with pread (never mmap: a file truncated under a
 * mapping would raise SIGBUS): copy everything, then read seq again; keep
 * the copy when both are equal and even.
 */
static int copy_stable(int fd, const char *path, unsigned char *buf,
		       size_t len, size_t *got)
{
	const off_t seq_off = offsetof(struct gmlake_shm_header, seq);
	uint64_t s1, s2;
	ssize_t n;

	for (int i = 0; i < READ_TRIES; i++) {
		n = pread(fd, buf, len, 0);
		if (n < 0)
			return gml_set_error(-errno, "%s: read: %s", path,
					     strerror(errno));
		*got = (size_t)n;
		if ((size_t)n < seq_off + sizeof(s1))
			return 0;	/* the parser reports it */
		memcpy(&s1, buf + seq_off, sizeof(s1));
		if (pread(fd, &s2, sizeof(s2), seq_off) != sizeof(s2))
			return gml_set_error(-EIO, "%s: shrank while read",
					     path);
		if (s1 == s2 && !(s1 & 1))
			return 0;
		sched_yield();
	}
	return gml_set_error(-EAGAIN, "%s: still being written after %d "
			     "tries", path, READ_TRIES);
}

/*
 * The header alone first, so that a file that is no segment costs one
 * small read and no allocation: its magic, and a size field that is the
 * file's size. A short or unstarted file is left to the parser.
 */
static int precheck(int fd, const char *path, const struct stat *st)
{
	struct gmlake_shm_header h;
	ssize_t n = pread(fd, &h, sizeof(h), 0);

	if (n < 0)
		return gml_set_error(-errno, "%s: read: %s", path,
				     strerror(errno));
	if ((size_t)n < sizeof(h) || !h.magic)
		return 0;
	if (h.magic != GMLAKE_SHM_MAGIC)
		return bad("%s: bad magic %#llx", path,
			   (unsigned long long)h.magic);
	if (h.size != (uint64_t)st->st_size)
		return bad("%s: size field %llu, file has %lld bytes", path,
			   (unsigned long long)h.size, (long long)st->st_size);
	return 0;
}

/*
 * Whether the publisher holds its lock. Only for a canonical name: only
 * publishers that lock for their whole life give one (a layout 1 writer,
 * which did not lock, named its file gmlake.PID). A shared lock taken is
 * dropped at once (and with the descriptor anyway).
 */
static uint32_t lock_state(int fd, const char *path)
{
	const char *base = strrchr(path, '/');
	uint64_t token;
	int32_t pid;

	base = base ? base + 1 : path;
	if (!gml_shm_name_parse(base, &pid, &token))
		return 0;
	if (!flock(fd, LOCK_SH | LOCK_NB)) {
		flock(fd, LOCK_UN);
		return GMLAKE_SHM_SNAP_LOCK_CHECKED | GMLAKE_SHM_SNAP_UNLOCKED;
	}
	return errno == EWOULDBLOCK ? GMLAKE_SHM_SNAP_LOCK_CHECKED : 0;
}

/* Copy, parse and check the file's image against its name and owner. */
static int read_image(int fd, const char *path, const struct stat *st,
		      struct gmlake_shm_snapshot *snap)
{
	unsigned char *buf;
	size_t got = 0;
	int ret;

	ret = precheck(fd, path, st);
	if (ret)
		return ret;
	buf = malloc((size_t)st->st_size);
	if (!buf)
		return gml_set_error(-ENOMEM, "%s: no memory for %lld bytes",
				     path, (long long)st->st_size);
	ret = copy_stable(fd, path, buf, (size_t)st->st_size, &got);
	if (!ret)
		ret = gmlake_shm_parse(buf, got, snap);
	free(buf);
	if (!ret)
		ret = check_name(path, snap);
	if (!ret && snap->uid != (uint32_t)st->st_uid)
		ret = gml_set_error(-EBADMSG, "%s: header uid %u, file owner "
				    "%u", path, snap->uid,
				    (unsigned)st->st_uid);
	return ret;
}

GML_EXPORT int gmlake_shm_read(const char *path, uint32_t expect_uid,
			       struct gmlake_shm_snapshot *snap)
{
	struct stat st;
	uint32_t flags;
	int fd, ret;

	if (!path || !snap)
		return gml_set_error(-EINVAL, "gmlake_shm_read: %s is NULL",
				     path ? "snap" : "path");
	if (snap->version != GMLAKE_SHM_SNAPSHOT_VERSION ||
	    snap->size != sizeof(*snap))
		return gml_set_error(-EINVAL, "gmlake_shm_read: snapshot "
				     "version %u size %u, this library has "
				     "version %u size %zu", snap->version,
				     snap->size, GMLAKE_SHM_SNAPSHOT_VERSION,
				     sizeof(*snap));
	snap->nslots = 0;
	snap->flags = 0;
	fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
	if (fd < 0 && errno == ELOOP)
		return gml_set_error(-ELOOP, "%s: a symbolic link, refused",
				     path);
	if (fd < 0)
		return gml_set_error(-errno, "%s: %s", path, strerror(errno));
	if (fstat(fd, &st)) {
		ret = gml_set_error(-errno, "%s: fstat: %s", path,
				    strerror(errno));
		goto out_close;
	}
	ret = check_file(path, &st, expect_uid);
	if (ret)
		goto out_close;
	flags = lock_state(fd, path);
	ret = read_image(fd, path, &st, snap);
	if (!ret)
		snap->uid = (uint32_t)st.st_uid;
	else
		snap->nslots = 0;
	/* Also on failure: a refused image's file may still be proven dead. */
	snap->flags = flags;
	snap->file_dev = (uint64_t)st.st_dev;
	snap->file_ino = (uint64_t)st.st_ino;
out_close:
	close(fd);
	return ret;
}

/*
 * Proof only. The lock test is one; without it (an image parsed from a
 * buffer), a pid and start time prove something only in our own PID
 * namespace, which layout 1 does not record.
 */
GML_EXPORT bool gmlake_shm_stale(const struct gmlake_shm_snapshot *snap)
{
	uint64_t start, ns;
	int ret;

	if (!snap || snap->pid <= 0)
		return false;
	if (snap->flags & GMLAKE_SHM_SNAP_LOCK_CHECKED)
		return snap->flags & GMLAKE_SHM_SNAP_UNLOCKED;
	ns = gml_pidns();
	if (!snap->pidns || !ns || snap->pidns != ns)
		return false;
	ret = gml_proc_stat(snap->pid, &start, NULL, 0);
	if (ret == -ENOENT || ret == -ESRCH)
		return true;
	if (ret)
		return false;	/* unsure: never call a live process gone */
	return start != snap->start_time;
}
