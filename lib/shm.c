/* SPDX-License-Identifier: MIT */
/*
 * Publication of every context's statistics in one segment per process,
 * GMLAKE_SHM_DIR/gmlake.PID.TOKEN (default /dev/shm), for gmlake-top.
 *
 * Publication can never raise a signal in the program. The segment is
 * never mapped: tmpfs reserves no pages for a sized file, and a file that
 * someone truncates under a shared mapping raises SIGBUS at the next store
 * (a full /dev/shm killed programs inside gmlake_ctx_init). The image lives
 * in this process's memory and goes into the file with pwrite, which fails
 * with ENOSPC instead, and after a truncation writes the file whole again.
 * posix_fallocate reserves the pages at creation, so a full directory is
 * found there and the context runs unpublished, with a warning. SIGXFSZ
 * (RLIMIT_FSIZE) is blocked around every write, so an over-limit write
 * fails with EFBIG instead of ending the process.
 *
 * Names and liveness (see gmlake-shm.h): the random token in the name keeps
 * processes of different PID namespaces apart, so creation never meets
 * another process's file and never removes one. The file is made under a
 * hidden name, locked (flock LOCK_EX, held until the process ends), sized
 * and written whole, and only then renamed to its name: a reader never sees
 * a named segment half made, nor unlocked while its publisher lives.
 *
 * Update policy: the allocation path does nothing at all. A publisher
 * thread ("gmlake-pub"), started with the first published context, takes
 * each context's lock with trylock (a busy one is published on a later
 * round), snapshots its figures and writes the image when they changed.
 * It wakes every PUBLISH_NS while figures change; while they do not, its
 * period doubles up to PUBLISH_IDLE_NS, at which the image is written again
 * anyway (so a truncated file comes back). A new context wakes it at once;
 * destroying one frees its slot at once; the last one removes the segment,
 * and an atexit handler removes it when contexts are never destroyed.
 *
 * Locks: life serialises register/unregister (creating and removing the
 * segment, starting and joining the thread); lock guards the image, the
 * slots and the writes, and is the seqlock's writer lock. Order: ctx->lock,
 * then life, then lock; the thread takes lock and only trylocks a context,
 * so it never waits on one.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "error.h"
#include "shm.h"
#include "types.h"

#define PUBLISH_NS 10000000ull		/* 10 ms while figures change */
#define PUBLISH_IDLE_NS 500000000ull	/* the longest sleep, when they don't */
#define SEG_SIZE (GML_SHM_HEADER_V1 + GMLAKE_SHM_SLOTS * GML_SHM_SLOT_V1)
#define NAME_TRIES 4

_Static_assert(sizeof(struct gmlake_shm_header) == GML_SHM_HEADER_V1,
	       "the header is 256 bytes");
_Static_assert(sizeof(struct gmlake_shm_slot) == GML_SHM_SLOT_V1,
	       "a slot is 512 bytes");
_Static_assert(offsetof(struct gmlake_shm_header, seq) % 8 == 0,
	       "seq is naturally aligned");

/* What the file holds, kept here and copied there. */
struct seg_image {
	struct gmlake_shm_header h;
	struct gmlake_shm_slot s[GMLAKE_SHM_SLOTS];
};

_Static_assert(sizeof(struct seg_image) == SEG_SIZE, "no padding");

static struct {
	pthread_mutex_t life;
	pthread_mutex_t lock;
	pthread_cond_t wake;
	pthread_t thread;
	bool running, stop;
	bool kick;			/* publish now: a context came */
	bool write_failed;		/* warned once; cleared on success */
	pid_t owner;			/* the process that created the file */
	int fd;				/* the segment, locked; -1 when none */
	uint64_t interval;		/* the thread's period now */
	uint64_t written_ns;		/* the last successful write */
	char path[PATH_MAX];
	struct seg_image img;
	gmlake_ctx *ctx[GMLAKE_SHM_SLOTS];
	unsigned nctx;
	uint64_t next_id;
	uint64_t ids[GMLAKE_SHM_SLOTS];
} shm = {
	.life = PTHREAD_MUTEX_INITIALIZER,
	.lock = PTHREAD_MUTEX_INITIALIZER,
	.fd = -1,
};

static pthread_once_t shm_once = PTHREAD_ONCE_INIT;

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/*
 * SIGXFSZ blocked in this thread around a write to the file; a SIGXFSZ the
 * write raised is taken back before the mask is restored, so RLIMIT_FSIZE
 * gives EFBIG and never ends the program.
 */
struct xfsz_guard {
	sigset_t old;
	bool was_pending;
};

static void xfsz_block(struct xfsz_guard *g)
{
	sigset_t set, pend;

	sigemptyset(&set);
	sigaddset(&set, SIGXFSZ);
	pthread_sigmask(SIG_BLOCK, &set, &g->old);
	g->was_pending = !sigpending(&pend) && sigismember(&pend, SIGXFSZ) == 1;
}

static void xfsz_restore(struct xfsz_guard *g)
{
	const struct timespec zero = { 0, 0 };
	sigset_t set, pend;

	sigemptyset(&set);
	sigaddset(&set, SIGXFSZ);
	if (!g->was_pending && !sigpending(&pend) &&
	    sigismember(&pend, SIGXFSZ) == 1)
		sigtimedwait(&set, NULL, &zero);
	pthread_sigmask(SIG_SETMASK, &g->old, NULL);
}

static int pwrite_all(int fd, const void *buf, size_t len, off_t off)
{
	const char *p = buf;
	ssize_t n;

	while (len) {
		n = pwrite(fd, p, len, off);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0)
			return -errno;
		if (n == 0)
			return -EIO;
		p += n;
		len -= (size_t)n;
		off += n;
	}
	return 0;
}

/*
 * The image into the file under the seqlock, shm.lock held: seq odd, the
 * whole image, seq even. Each pwrite ends by unlocking the pages it wrote,
 * which orders them for a reader's pread. Whole each time, so a file
 * truncated meanwhile is whole again. 0 or -errno (the file's contents are
 * then unknown: a reader refuses them until the next success).
 */
static int seg_write(uint64_t t)
{
	const off_t seq_off = offsetof(struct gmlake_shm_header, seq);
	struct gmlake_shm_header *h = &shm.img.h;
	struct xfsz_guard g;
	int ret;

	h->publish_ns = t;
	h->interval_ns = shm.interval;
	xfsz_block(&g);
	h->seq++;
	ret = pwrite_all(shm.fd, &h->seq, sizeof(h->seq), seq_off);
	if (!ret)
		ret = pwrite_all(shm.fd, &shm.img, sizeof(shm.img), 0);
	h->seq++;
	if (!ret)
		ret = pwrite_all(shm.fd, &h->seq, sizeof(h->seq), seq_off);
	xfsz_restore(&g);
	if (!ret)
		shm.written_ns = t;
	return ret;
}

/* seg_write for the thread and unregister: a failure is warned of once. */
static void publish(uint64_t t)
{
	int ret = seg_write(t);

	if (ret && !shm.write_failed)
		gml_log(GMLAKE_LOG_WARN, "shm: writing %s: %s; statistics are "
			"not published until a write succeeds", shm.path,
			strerror(-ret));
	if (!ret && shm.write_failed)
		gml_log(GMLAKE_LOG_INFO, "shm: %s written again", shm.path);
	shm.write_failed = ret != 0;
}

/* The slot's figures from a stats snapshot; ctx fields need its lock. */
static void fill_slot(struct gmlake_shm_slot *s, gmlake_ctx *ctx,
		      uint64_t id, uint64_t t)
{
	struct gmlake_stats st;

	gml_stats_snapshot_locked(ctx, &st);
	memset(s, 0, sizeof(*s));
	s->state = GMLAKE_SHM_SLOT_LIVE;
	s->device = ctx->cfg.device;
	s->backend = ctx->cfg.backend;
	s->offload_engine = st.offload_engine;
	s->ctx_id = id;
	s->publish_ns = t;
	s->device_total = ctx->dev_total;
	s->chunk_size = st.chunk_size;
#define GAUGE(slot_name) \
	s->slot_name##_bytes = st.slot_name##_bytes.current; \
	s->slot_name##_peak = st.slot_name##_bytes.peak;
	GAUGE(requested)
	GAUGE(allocated)
	GAUGE(reserved)
#undef GAUGE
	s->resident_bytes = st.resident_bytes.current;
	s->mapped_bytes = st.mapped_bytes.current;
	s->active_blocks = st.active_blocks.current;
	s->stitched_live = st.stitched_live.current;
	s->stitched_cached = st.stitched_cached.current;
	s->chunks = st.chunks.current;
	s->spilled_bytes = st.spilled_bytes.current;
	s->spilled_blocks = st.spilled_blocks.current;
	s->host_bytes = st.host_bytes.current;
	s->host_pinned = st.host_pinned.current;
#define COUNTER(name) s->name = st.name;
	COUNTER(allocs) COUNTER(frees) COUNTER(fits) COUNTER(stitch_reuses)
	COUNTER(stitches) COUNTER(stitch_repairs) COUNTER(grows)
	COUNTER(evictions) COUNTER(releases) COUNTER(ooms) COUNTER(spills)
	COUNTER(fetches) COUNTER(offload_failures) COUNTER(d2h_bytes)
	COUNTER(d2h_ns) COUNTER(h2d_bytes) COUNTER(h2d_ns)
#undef COUNTER
	s->map_calls = st.calls[GMLAKE_CALL_mem_map];
	s->map_ns = st.call_ns[GMLAKE_CALL_mem_map];
	s->unmap_calls = st.calls[GMLAKE_CALL_mem_unmap];
	s->create_calls = st.calls[GMLAKE_CALL_mem_create];
	s->release_calls = st.calls[GMLAKE_CALL_mem_release];
	s->set_access_calls = st.calls[GMLAKE_CALL_set_access];
	for (int i = 0; i < GMLAKE_CALL_COUNT; i++)
		s->call_failures += st.call_failures[i];
}

/*
 * Snapshot every context whose lock is free now into the image, shm.lock
 * held. A slot keeps its publish_ns while its figures stay the same. True
 * when a slot changed, or a busy context may have.
 */
static bool collect(uint64_t t)
{
	struct gmlake_shm_slot tmp;
	bool changed = false;

	for (unsigned i = 0; i < GMLAKE_SHM_SLOTS; i++) {
		gmlake_ctx *ctx = shm.ctx[i];

		if (!ctx)
			continue;
		if (pthread_mutex_trylock(&ctx->lock)) {
			changed = true;
			continue;
		}
		fill_slot(&tmp, ctx, shm.ids[i], shm.img.s[i].publish_ns);
		pthread_mutex_unlock(&ctx->lock);
		if (!memcmp(&tmp, &shm.img.s[i], sizeof(tmp)))
			continue;
		tmp.publish_ns = t;
		shm.img.s[i] = tmp;
		changed = true;
	}
	return changed;
}

static void deadline(struct timespec *ts, uint64_t ns)
{
	clock_gettime(CLOCK_MONOTONIC, ts);
	ts->tv_sec += (time_t)(ns / 1000000000ull);
	ts->tv_nsec += (long)(ns % 1000000000ull);
	if (ts->tv_nsec >= 1000000000) {
		ts->tv_sec++;
		ts->tv_nsec -= 1000000000;
	}
}

static void *publisher(void *arg)
{
	struct timespec ts;
	uint64_t t;
	bool changed;

	(void)arg;
	pthread_mutex_lock(&shm.lock);
	while (!shm.stop) {
		t = now_ns();
		changed = collect(t);
		if (changed || t - shm.written_ns >= PUBLISH_IDLE_NS)
			publish(t);
		if (changed)
			shm.interval = PUBLISH_NS;
		else if (shm.interval < PUBLISH_IDLE_NS)
			shm.interval = shm.interval * 2 < PUBLISH_IDLE_NS ?
					       shm.interval * 2 : PUBLISH_IDLE_NS;
		deadline(&ts, shm.interval);
		while (!shm.stop && !shm.kick &&
		       pthread_cond_timedwait(&shm.wake, &shm.lock, &ts) == 0)
			;
		shm.kick = false;
	}
	pthread_mutex_unlock(&shm.lock);
	return NULL;
}

static void at_exit(void)
{
	if (shm.fd >= 0 && shm.owner == getpid() && shm.path[0])
		unlink(shm.path);
}

/*
 * fork(): the child has no publisher thread and must not write or remove
 * the parent's segment, nor keep its lock alive: it closes its copy of the
 * descriptor and starts afresh (its own segment if it makes contexts). The
 * parent's locks are held across fork so the child's copies are consistent.
 */
static void fork_prepare(void)
{
	pthread_mutex_lock(&shm.life);
	pthread_mutex_lock(&shm.lock);
}

static void fork_parent(void)
{
	pthread_mutex_unlock(&shm.lock);
	pthread_mutex_unlock(&shm.life);
}

/* The publisher's wake-up, on the monotonic clock its waits use. */
static void wake_init(void)
{
	pthread_condattr_t ca;

	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&shm.wake, &ca);
	pthread_condattr_destroy(&ca);
}

static void fork_child(void)
{
	if (shm.fd >= 0)
		close(shm.fd);
	shm.fd = -1;
	shm.path[0] = '\0';
	shm.running = false;
	shm.stop = false;
	shm.kick = false;
	shm.write_failed = false;
	shm.nctx = 0;
	memset(shm.ctx, 0, sizeof(shm.ctx));
	pthread_mutex_init(&shm.lock, NULL);
	pthread_mutex_init(&shm.life, NULL);
	/* The parent's publisher may be waiting on it: a copy with that
	 * waiter counted would block the child's first signal for good. */
	wake_init();
}

static void once_init(void)
{
	wake_init();
	if (pthread_atfork(fork_prepare, fork_parent, fork_child))
		gml_log(GMLAKE_LOG_WARN, "shm: pthread_atfork failed");
	if (atexit(at_exit))
		gml_log(GMLAKE_LOG_WARN, "shm: atexit failed; a segment may "
			"outlive the process");
}

/* A random token, never 0: getrandom, else the clock and pid, mixed. */
static uint64_t new_token(void)
{
	uint64_t v = 0;

	if (getrandom(&v, sizeof(v), GRND_NONBLOCK) != (ssize_t)sizeof(v))
		v = now_ns() ^ ((uint64_t)getpid() << 32) ^ (uintptr_t)&v;
	/* splitmix64's finaliser, so a fallback value looks random too */
	v ^= v >> 30;
	v *= 0xbf58476d1ce4e5b9ull;
	v ^= v >> 27;
	v *= 0x94d049bb133111ebull;
	v ^= v >> 31;
	return v ? v : 1;
}

/*
 * Make the file under its hidden name (.gmlake.PID.TOKEN.new, which no
 * reader looks at) and set shm.path to its final name. A name already
 * taken is never touched: another token is drawn. fd, or -errno.
 */
static int seg_open(char *tmp, size_t len, uint64_t *token)
{
	const int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
	const char *dir = gmlake_shm_dir();
	int fd, n;

	for (int i = 0; i < NAME_TRIES; i++) {
		*token = new_token();
		n = snprintf(shm.path, sizeof(shm.path), "%s/gmlake.%d.%016llx",
			     dir, (int)getpid(), (unsigned long long)*token);
		if (n < 0 || (size_t)n >= sizeof(shm.path) ||
		    (size_t)snprintf(tmp, len, "%s/.gmlake.%d.%016llx.new", dir,
				     (int)getpid(),
				     (unsigned long long)*token) >= len)
			return gml_set_error(-ENAMETOOLONG, "shm: directory "
					     "name too long");
		fd = open(tmp, flags, 0600);
		if (fd >= 0)
			return fd;
		if (errno != EEXIST)
			return gml_set_error(-errno, "shm: %s: %s", tmp,
					     strerror(errno));
	}
	return gml_set_error(-EEXIST, "shm: %d names in %s taken already",
			     NAME_TRIES, dir);
}

/* The hidden file gets its name, never replacing another file. */
static int seg_link(const char *tmp)
{
	if (!renameat2(AT_FDCWD, tmp, AT_FDCWD, shm.path, RENAME_NOREPLACE))
		return 0;
	if (errno != EINVAL && errno != ENOSYS)
		return gml_set_error(-errno, "shm: naming %s: %s", shm.path,
				     strerror(errno));
	/* No RENAME_NOREPLACE here: link does not replace either. */
	if (link(tmp, shm.path))
		return gml_set_error(-errno, "shm: naming %s: %s", shm.path,
				     strerror(errno));
	if (unlink(tmp))
		gml_log(GMLAKE_LOG_WARN, "shm: removing %s: %s", tmp,
			strerror(errno));
	return 0;
}

static void fill_header(uint64_t start, const char *comm, uint64_t token)
{
	struct gmlake_shm_header *h = &shm.img.h;

	memset(&shm.img, 0, sizeof(shm.img));
	h->magic = GMLAKE_SHM_MAGIC;
	h->version = GMLAKE_SHM_VERSION;
	h->compat_version = 1;
	h->size = SEG_SIZE;
	h->header_size = GML_SHM_HEADER_V1;
	h->slot_size = GML_SHM_SLOT_V1;
	h->nslots = GMLAKE_SHM_SLOTS;
	h->pid = (int32_t)getpid();
	h->uid = (uint32_t)geteuid();
	h->start_time = start;
	h->token = token;
	h->pidns = gml_pidns();
	snprintf(h->comm, sizeof(h->comm), "%s", comm);
}

/* Reserve the file's pages: a full directory fails here, not later. */
static int seg_reserve(int fd, const char *tmp)
{
	struct xfsz_guard g;
	int err;

	xfsz_block(&g);
	err = posix_fallocate(fd, 0, SEG_SIZE);
	xfsz_restore(&g);
	if (err)
		return gml_set_error(-err, "shm: reserving %u bytes for %s: %s",
				     SEG_SIZE, tmp, strerror(err));
	return 0;
}

/* Create, lock, reserve, write and name the segment; shm.life held. */
static int seg_create(void)
{
	char comm[GMLAKE_SHM_COMM_LEN], tmp[PATH_MAX];
	uint64_t start, token;
	int fd, ret;

	ret = gml_proc_stat(0, &start, comm, sizeof(comm));
	if (ret)
		return gml_set_error(ret, "shm: /proc/self/stat: %s",
				     strerror(-ret));
	fd = seg_open(tmp, sizeof(tmp), &token);
	if (fd < 0)
		return fd;
	if (flock(fd, LOCK_EX | LOCK_NB)) {
		ret = gml_set_error(-errno, "shm: locking %s: %s", tmp,
				    strerror(errno));
		goto out_unlink;
	}
	ret = seg_reserve(fd, tmp);
	if (ret)
		goto out_unlink;
	shm.fd = fd;
	shm.interval = PUBLISH_NS;
	fill_header(start, comm, token);
	ret = seg_write(now_ns());
	if (ret) {
		gml_set_error(ret, "shm: writing %s: %s", tmp, strerror(-ret));
		goto out_unlink;
	}
	ret = seg_link(tmp);
	if (ret)
		goto out_unlink;
	shm.owner = getpid();
	shm.write_failed = false;
	return 0;
out_unlink:
	unlink(tmp);
	close(fd);
	shm.fd = -1;
	shm.path[0] = '\0';
	return ret;
}

/* Unlink first: a named segment is locked for as long as it is named. */
static void seg_remove(void)
{
	if (shm.path[0] && unlink(shm.path) && errno != ENOENT)
		gml_log(GMLAKE_LOG_WARN, "shm: removing %s: %s", shm.path,
			strerror(errno));
	shm.path[0] = '\0';
	if (shm.fd >= 0)
		close(shm.fd);
	shm.fd = -1;
}

/* The segment and its thread, when the first context comes; life held. */
static int seg_start(void)
{
	sigset_t all, old;
	int ret;

	if (shm.fd >= 0)
		return 0;
	ret = seg_create();
	if (ret)
		return ret;
	shm.stop = false;
	/* The thread takes no signals: the application's handlers run in
	   its own threads. */
	sigfillset(&all);
	pthread_sigmask(SIG_SETMASK, &all, &old);
	ret = pthread_create(&shm.thread, NULL, publisher, NULL);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (ret) {
		seg_remove();
		return gml_set_error(-ret, "shm: publisher thread: %s",
				     strerror(ret));
	}
	shm.running = true;
	ret = pthread_setname_np(shm.thread, "gmlake-pub");
	if (ret)
		gml_log(GMLAKE_LOG_DEBUG, "shm: naming the publisher thread: "
			"%s", strerror(ret));
	return 0;
}

int gml_shm_register(gmlake_ctx *ctx)
{
	unsigned i;
	int ret;

	if (!ctx->cfg.publish)
		return 0;
	pthread_once(&shm_once, once_init);
	pthread_mutex_lock(&shm.life);
	ret = seg_start();
	if (ret)
		goto out_warn;
	pthread_mutex_lock(&shm.lock);
	for (i = 0; i < GMLAKE_SHM_SLOTS && shm.ctx[i]; i++)
		;
	if (i < GMLAKE_SHM_SLOTS) {
		shm.ctx[i] = ctx;
		shm.ids[i] = ++shm.next_id;
		shm.nctx++;
		shm.kick = true;
		pthread_cond_signal(&shm.wake);
	}
	pthread_mutex_unlock(&shm.lock);
	if (i == GMLAKE_SHM_SLOTS)
		ret = gml_set_error(-ENOSPC, "shm: all %d slots in use",
				    GMLAKE_SHM_SLOTS);
out_warn:
	pthread_mutex_unlock(&shm.life);
	if (ret)
		gml_log(GMLAKE_LOG_WARN, "statistics not published: %s",
			gmlake_last_error());
	return ret;
}

/* Stop and join the thread, remove the segment; life held, lock not. */
static void seg_stop(void)
{
	pthread_mutex_lock(&shm.lock);
	shm.stop = true;
	pthread_cond_signal(&shm.wake);
	pthread_mutex_unlock(&shm.lock);
	if (shm.running)
		pthread_join(shm.thread, NULL);
	shm.running = false;
	seg_remove();
}

void gml_shm_unregister(gmlake_ctx *ctx)
{
	unsigned i;

	pthread_mutex_lock(&shm.life);
	if (shm.fd < 0)
		goto out;
	pthread_mutex_lock(&shm.lock);
	for (i = 0; ctx && i < GMLAKE_SHM_SLOTS; i++) {
		if (shm.ctx[i] != ctx)
			continue;
		memset(&shm.img.s[i], 0, sizeof(shm.img.s[i]));
		shm.ctx[i] = NULL;
		shm.nctx--;
		if (shm.nctx)
			publish(now_ns());
		break;
	}
	pthread_mutex_unlock(&shm.lock);
	if (!shm.nctx)
		seg_stop();
out:
	pthread_mutex_unlock(&shm.life);
}
