/* SPDX-License-Identifier: MIT */
/*
 * Publication of every context's statistics in one shared-memory segment
 * per process, GMLAKE_SHM_DIR/gmlake.PID (default /dev/shm), for gmlake-top.
 *
 * Update policy: the allocation path does nothing at all. A publisher
 * thread, started with the first published context, wakes every
 * PUBLISH_NS, takes each context's lock with trylock (a busy context is
 * simply published on a later round), snapshots its figures and writes
 * them under the segment's seqlock. Destroying a context frees its slot
 * (under the seqlock); the last one removes the segment, and
 * an atexit handler removes it when contexts are never destroyed.
 *
 * Locks: life serialises register/unregister (creating and removing the
 * segment, starting and joining the thread); lock guards the slots and is
 * the seqlock's writer lock. Order: ctx->lock, then life, then lock; the
 * thread takes lock and only trylocks a context, so it never waits on one.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "error.h"
#include "shm.h"
#include "types.h"

#define PUBLISH_NS 10000000ull		/* 10 ms */
#define SEG_SIZE (GML_SHM_HEADER_V1 + GMLAKE_SHM_SLOTS * GML_SHM_SLOT_V1)

_Static_assert(sizeof(struct gmlake_shm_header) == GML_SHM_HEADER_V1,
	       "layout 1 header is 256 bytes");
_Static_assert(sizeof(struct gmlake_shm_slot) == GML_SHM_SLOT_V1,
	       "layout 1 slot is 512 bytes");
_Static_assert(offsetof(struct gmlake_shm_header, seq) % 8 == 0,
	       "seq is naturally aligned");

static struct {
	pthread_mutex_t life;
	pthread_mutex_t lock;
	pthread_cond_t wake;
	pthread_t thread;
	bool running, stop;
	pid_t owner;			/* the process that created seg */
	char path[PATH_MAX];
	struct gmlake_shm_header *seg;
	gmlake_ctx *ctx[GMLAKE_SHM_SLOTS];
	unsigned nctx;
	uint64_t next_id;
	uint64_t ids[GMLAKE_SHM_SLOTS];
} shm = {
	.life = PTHREAD_MUTEX_INITIALIZER,
	.lock = PTHREAD_MUTEX_INITIALIZER,
};

static pthread_once_t shm_once = PTHREAD_ONCE_INIT;

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static struct gmlake_shm_slot *slot_at(unsigned i)
{
	return (struct gmlake_shm_slot *)((char *)shm.seg +
					  GML_SHM_HEADER_V1 +
					  (size_t)i * GML_SHM_SLOT_V1);
}

/* Seqlock writer, shm.lock held: odd, then the data, then even (release). */
static void seq_begin(void)
{
	uint64_t s = atomic_load_explicit((_Atomic uint64_t *)&shm.seg->seq,
					  memory_order_relaxed);

	atomic_store_explicit((_Atomic uint64_t *)&shm.seg->seq, s + 1,
			      memory_order_relaxed);
	atomic_thread_fence(memory_order_release);
}

static void seq_end(void)
{
	uint64_t s = atomic_load_explicit((_Atomic uint64_t *)&shm.seg->seq,
					  memory_order_relaxed);

	atomic_store_explicit((_Atomic uint64_t *)&shm.seg->seq, s + 1,
			      memory_order_release);
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

/* One round, shm.lock held: every context whose lock is free now. */
static void publish_round(void)
{
	struct gmlake_shm_slot tmp[GMLAKE_SHM_SLOTS];
	bool got[GMLAKE_SHM_SLOTS] = { false };
	uint64_t t = now_ns();

	for (unsigned i = 0; i < GMLAKE_SHM_SLOTS; i++) {
		gmlake_ctx *ctx = shm.ctx[i];

		if (!ctx || pthread_mutex_trylock(&ctx->lock))
			continue;
		fill_slot(&tmp[i], ctx, shm.ids[i], t);
		pthread_mutex_unlock(&ctx->lock);
		got[i] = true;
	}
	seq_begin();
	for (unsigned i = 0; i < GMLAKE_SHM_SLOTS; i++)
		if (got[i])
			memcpy(slot_at(i), &tmp[i], sizeof(tmp[i]));
	shm.seg->publish_ns = t;
	seq_end();
}

static void *publisher(void *arg)
{
	struct timespec ts;

	pthread_mutex_lock(&shm.lock);
	while (!shm.stop) {
		clock_gettime(CLOCK_MONOTONIC, &ts);
		ts.tv_nsec += PUBLISH_NS;
		if (ts.tv_nsec >= 1000000000) {
			ts.tv_sec++;
			ts.tv_nsec -= 1000000000;
		}
		while (!shm.stop &&
		       pthread_cond_timedwait(&shm.wake, &shm.lock, &ts) == 0)
			;
		if (!shm.stop)
			publish_round();
	}
	pthread_mutex_unlock(&shm.lock);
	return NULL;
}

static void at_exit(void)
{
	if (shm.seg && shm.owner == getpid() && shm.path[0])
		unlink(shm.path);
}

/*
 * fork(): the child has no publisher thread and must not write or remove
 * the parent's segment; it starts afresh (its own gmlake.PID if it makes
 * contexts). The parent's locks are held across fork so the child's
 * copies are consistent.
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

static void fork_child(void)
{
	shm.seg = NULL;		/* the parent's mapping stays, unused */
	shm.path[0] = '\0';
	shm.running = false;
	shm.stop = false;
	shm.nctx = 0;
	memset(shm.ctx, 0, sizeof(shm.ctx));
	pthread_mutex_init(&shm.lock, NULL);
	pthread_mutex_init(&shm.life, NULL);
}

static void once_init(void)
{
	pthread_condattr_t ca;

	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&shm.wake, &ca);
	pthread_condattr_destroy(&ca);
	if (pthread_atfork(fork_prepare, fork_parent, fork_child))
		gml_log(GMLAKE_LOG_WARN, "shm: pthread_atfork failed");
	if (atexit(at_exit))
		gml_log(GMLAKE_LOG_WARN, "shm: atexit failed; a segment may "
			"outlive the process");
}

/*
 * Open path exclusively. A file already there carries our pid, so it is a
 * dead process's (pid reuse): remove it when it is ours, then retry once.
 */
static int open_excl(const char *path)
{
	const int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
	struct stat st;
	int fd = open(path, flags, 0600);

	if (fd >= 0 || errno != EEXIST)
		return fd >= 0 ? fd : gml_set_error(-errno, "shm: %s: %s",
						    path, strerror(errno));
	if (lstat(path, &st) || !S_ISREG(st.st_mode) ||
	    st.st_uid != geteuid())
		return gml_set_error(-EEXIST, "shm: %s exists and is not a "
				     "segment of ours", path);
	if (unlink(path))
		return gml_set_error(-errno, "shm: removing stale %s: %s",
				     path, strerror(errno));
	fd = open(path, flags, 0600);
	return fd >= 0 ? fd : gml_set_error(-errno, "shm: %s: %s", path,
					    strerror(errno));
}

static void fill_header(struct gmlake_shm_header *h, uint64_t start,
			const char *comm)
{
	h->version = GMLAKE_SHM_VERSION;
	h->compat_version = 1;
	h->size = SEG_SIZE;
	h->header_size = GML_SHM_HEADER_V1;
	h->slot_size = GML_SHM_SLOT_V1;
	h->nslots = GMLAKE_SHM_SLOTS;
	h->pid = (int32_t)getpid();
	h->uid = (uint32_t)geteuid();
	h->start_time = start;
	h->interval_ns = PUBLISH_NS;
	h->publish_ns = now_ns();
	snprintf(h->comm, sizeof(h->comm), "%s", comm);
	/* The magic last: a reader seeing it sees a whole header. */
	atomic_store_explicit((_Atomic uint64_t *)&h->magic, GMLAKE_SHM_MAGIC,
			      memory_order_release);
}

/* Create, size and map the segment; shm.life held. */
static int seg_create(void)
{
	char comm[GMLAKE_SHM_COMM_LEN];
	uint64_t start;
	void *p;
	int fd, ret, n;

	ret = gml_proc_stat(getpid(), &start, comm, sizeof(comm));
	if (ret)
		return gml_set_error(ret, "shm: /proc/self/stat: %s",
				     strerror(-ret));
	n = snprintf(shm.path, sizeof(shm.path), "%s/gmlake.%d",
		     gmlake_shm_dir(), (int)getpid());
	if (n < 0 || (size_t)n >= sizeof(shm.path))
		return gml_set_error(-ENAMETOOLONG, "shm: directory name too "
				     "long");
	fd = open_excl(shm.path);
	if (fd < 0)
		return fd;
	if (ftruncate(fd, SEG_SIZE)) {
		ret = gml_set_error(-errno, "shm: sizing %s: %s", shm.path,
				    strerror(errno));
		goto out_unlink;
	}
	p = mmap(NULL, SEG_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		ret = gml_set_error(-errno, "shm: mapping %s: %s", shm.path,
				    strerror(errno));
		goto out_unlink;
	}
	close(fd);
	fill_header(p, start, comm);
	shm.seg = p;
	shm.owner = getpid();
	return 0;
out_unlink:
	unlink(shm.path);
	close(fd);
	shm.path[0] = '\0';
	return ret;
}

static void seg_remove(void)
{
	unlink(shm.path);
	shm.path[0] = '\0';
	munmap(shm.seg, SEG_SIZE);
	shm.seg = NULL;
}

/* The segment and its thread, when the first context comes; life held. */
static int seg_start(void)
{
	sigset_t all, old;
	int ret;

	if (shm.seg)
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
	if (!shm.seg)
		goto out;
	pthread_mutex_lock(&shm.lock);
	for (i = 0; ctx && i < GMLAKE_SHM_SLOTS; i++) {
		if (shm.ctx[i] != ctx)
			continue;
		seq_begin();
		memset(slot_at(i), 0, GML_SHM_SLOT_V1);
		seq_end();
		shm.ctx[i] = NULL;
		shm.nctx--;
		break;
	}
	pthread_mutex_unlock(&shm.lock);
	if (!shm.nctx)
		seg_stop();
out:
	pthread_mutex_unlock(&shm.life);
}
