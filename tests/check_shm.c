/* SPDX-License-Identifier: MIT */
/*
 * check_shm: publication of the statistics in GMLAKE_SHM_DIR/gmlake.PID.TOKEN
 * (lib/shm.c), the checking reader (lib/shm_read.c), and gmlake-top's JSON
 * snapshots against a live and a killed process.
 *
 * Runs on the emulated device whatever GMLAKE_BACKEND says; each case
 * works in a directory of its own (checked fixture), never in /dev/shm.
 * The cases that need root for a mount or a PID namespace (a full tmpfs,
 * two containers) say so on stderr and pass without it.
 *
 * With GML_SHM_WRITE_CORPUS=DIR the "corpus" case writes the seed inputs
 * of tests/fuzz/corpus/fuzz_shm/ there (how they were made).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE	/* unshare */
#endif
#include "helpers.h"

#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>

#include "gmlake-offload.h"
#include "gmlake-shm.h"
#include "shm.h"
#include "json.h"
#include "top.h"

static char dir[256];

static void setup(void)
{
	const char *tmp = getenv("TMPDIR");

	snprintf(dir, sizeof(dir), "%s/check_shm.XXXXXX", tmp ? tmp : "/tmp");
	ck_assert_ptr_nonnull(mkdtemp(dir));
	ck_assert_int_eq(setenv("GMLAKE_SHM_DIR", dir, 1), 0);
	ck_assert_int_eq(setenv("GMLAKE_BACKEND", "emu", 1), 0);
	unsetenv("GMLAKE_PUBLISH");
}

static void teardown(void)
{
	char cmd[300];

	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	if (system(cmd))
		fprintf(stderr, "check_shm: could not remove %s\n", dir);
}

static void path_of(char *buf, size_t len, const char *name)
{
	snprintf(buf, len, "%s/%s", dir, name);
}

/* The segment of pid in d (gmlake.PID.TOKEN); false when there is none. */
static bool seg_path_in(const char *d, int pid, char *buf, size_t len)
{
	char prefix[32];
	struct dirent *de;
	bool found = false;
	DIR *dp = opendir(d);

	ck_assert_ptr_nonnull(dp);
	snprintf(prefix, sizeof(prefix), "gmlake.%d.", pid);
	while (!found && (de = readdir(dp)))
		if (!strncmp(de->d_name, prefix, strlen(prefix))) {
			snprintf(buf, len, "%s/%s", d, de->d_name);
			found = true;
		}
	closedir(dp);
	return found;
}

static void own_path(char *buf, size_t len)
{
	ck_assert_msg(seg_path_in(dir, (int)getpid(), buf, len),
		      "no segment of pid %d in %s", (int)getpid(), dir);
}

/* Entries of d whose name starts with prefix. */
static int count_prefix(const char *d, const char *prefix)
{
	struct dirent *de;
	DIR *dp = opendir(d);
	int n = 0;

	ck_assert_ptr_nonnull(dp);
	while ((de = readdir(dp)))
		n += !strncmp(de->d_name, prefix, strlen(prefix));
	closedir(dp);
	return n;
}

static void snap_init(struct gmlake_shm_snapshot *snap)
{
	memset(snap, 0x5a, sizeof(*snap));
	snap->version = GMLAKE_SHM_SNAPSHOT_VERSION;
	snap->size = sizeof(*snap);
}

static int read_seg(const char *path, uint32_t uid,
		    struct gmlake_shm_snapshot *snap)
{
	snap_init(snap);
	return gmlake_shm_read(path, uid, snap);
}

static void sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000 };

	nanosleep(&ts, NULL);
}

/* Wait (2 s at most) until the segment shows the context's allocs/frees. */
static void wait_published(gmlake_ctx *ctx, struct gmlake_shm_snapshot *snap)
{
	struct gmlake_stats st;
	char path[512];
	int ret = 0;

	own_path(path, sizeof(path));
	th_stats(ctx, &st);
	for (int i = 0; i < 200; i++) {
		ret = read_seg(path, (uint32_t)geteuid(), snap);
		for (uint32_t s = 0; !ret && s < snap->nslots; s++)
			if (snap->slots[s].allocs == st.allocs &&
			    snap->slots[s].frees == st.frees)
				return;
		sleep_ms(10);
	}
	ck_abort_msg("segment never caught up: %d (%s)", ret,
		     gmlake_last_error());
}

/* A fixed pattern: 6 blocks of 1, 3, 5, ... MiB, the odd ones freed. */
static void pattern(gmlake_ctx *ctx, void **p)
{
	for (int i = 0; i < 6; i++)
		ck_assert_int_eq(gmlake_alloc(ctx, &p[i],
					      (size_t)(1 + 2 * i) * TH_MiB,
					      NULL), 0);
	for (int i = 1; i < 6; i += 2)
		ck_assert_int_eq(gmlake_free(ctx, p[i]), 0);
}

static void assert_slot_matches(const struct gmlake_shm_slot *s,
				const struct gmlake_stats *st)
{
	ck_assert_int_eq(s->state, GMLAKE_SHM_SLOT_LIVE);
	ck_assert_int_eq(s->backend, GMLAKE_BACKEND_EMU);
	ck_assert_int_eq(s->allocated_bytes, st->allocated_bytes.current);
	ck_assert_int_eq(s->allocated_peak, st->allocated_bytes.peak);
	ck_assert_int_eq(s->reserved_bytes, st->reserved_bytes.current);
	ck_assert_int_eq(s->reserved_peak, st->reserved_bytes.peak);
	ck_assert_int_eq(s->requested_bytes, st->requested_bytes.current);
	ck_assert_int_eq(s->active_blocks, st->active_blocks.current);
	ck_assert_int_eq(s->stitched_live, st->stitched_live.current);
	ck_assert_int_eq(s->chunks, st->chunks.current);
	ck_assert_int_eq(s->spilled_bytes, st->spilled_bytes.current);
	ck_assert_uint_eq(s->allocs, st->allocs);
	ck_assert_uint_eq(s->frees, st->frees);
	ck_assert_uint_eq(s->stitches, st->stitches);
	ck_assert_uint_eq(s->d2h_bytes, st->d2h_bytes);
	ck_assert_uint_eq(s->h2d_bytes, st->h2d_bytes);
	ck_assert_uint_eq(s->map_calls, st->calls[GMLAKE_CALL_mem_map]);
	ck_assert_uint_eq(s->unmap_calls, st->calls[GMLAKE_CALL_mem_unmap]);
	ck_assert_uint_eq(s->chunk_size, st->chunk_size);
}

/* ---------------------------------------------------------------------- */
/* Publication                                                            */

START_TEST(publish_matches_stats)
{
	struct gmlake_shm_snapshot snap;
	struct gmlake_stats st;
	gmlake_ctx *ctx = th_ctx(256 * TH_MiB);
	char path[512];
	struct stat sb;
	void *p[6];

	own_path(path, sizeof(path));
	ck_assert_int_eq(lstat(path, &sb), 0);
	ck_assert_int_eq(sb.st_mode & 0777, 0600);
	ck_assert(S_ISREG(sb.st_mode));
	pattern(ctx, p);
	wait_published(ctx, &snap);
	th_stats(ctx, &st);
	ck_assert_int_eq(snap.pid, getpid());
	ck_assert_uint_eq(snap.uid, geteuid());
	ck_assert_uint_eq(snap.layout_version, GMLAKE_SHM_VERSION);
	ck_assert_uint_eq(snap.nslots, 1);
	ck_assert_str_eq(snap.comm, "check_shm");
	ck_assert(!gmlake_shm_stale(&snap));
	assert_slot_matches(&snap.slots[0], &st);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
	ck_assert_int_eq(lstat(path, &sb), -1);
	ck_assert_int_eq(errno, ENOENT);
}
END_TEST

START_TEST(contexts_share_one_segment)
{
	struct gmlake_shm_snapshot snap;
	gmlake_ctx *a = th_ctx(64 * TH_MiB), *b = th_ctx(64 * TH_MiB);
	char path[512];
	void *pa, *pb, *pc;
	int ret;

	own_path(path, sizeof(path));
	ck_assert_int_eq(gmlake_alloc(a, &pa, 4 * TH_MiB, NULL), 0);
	ck_assert_int_eq(gmlake_alloc(b, &pb, 6 * TH_MiB, NULL), 0);
	/* Counts of b's own, so that a's slot alone cannot pass for it. */
	ck_assert_int_eq(gmlake_alloc(b, &pc, TH_MiB, NULL), 0);
	ck_assert_int_eq(gmlake_free(b, pc), 0);
	wait_published(b, &snap);
	wait_published(a, &snap);
	ck_assert_uint_eq(snap.nslots, 2);
	ck_assert_uint_ne(snap.slots[0].ctx_id, snap.slots[1].ctx_id);
	ck_assert_int_eq(gmlake_ctx_destroy(a, true), 0);
	ret = read_seg(path, (uint32_t)geteuid(), &snap);
	ck_assert_msg(ret == 0, "%d %s", ret, gmlake_last_error());
	ck_assert_uint_eq(snap.nslots, 1);
	ck_assert_int_eq(snap.slots[0].allocated_bytes, 6 * TH_MiB);
	ck_assert_int_eq(gmlake_ctx_destroy(b, true), 0);
	ck_assert_int_eq(access(path, F_OK), -1);
}
END_TEST

START_TEST(publish_off)
{
	struct gmlake_config cfg;
	gmlake_ctx *ctx;
	char path[512];

	ck_assert_int_eq(setenv("GMLAKE_PUBLISH", "0", 1), 0);
	th_config(&cfg, 64 * TH_MiB);
	ck_assert(!cfg.publish);
	ctx = th_ctx_cfg(&cfg);
	ck_assert(!seg_path_in(dir, (int)getpid(), path, sizeof(path)));
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, false), 0);
}
END_TEST

/*
 * Files that carry our pid (another namespace's process, or a leftover of
 * pid reuse) are not ours to remove: the new segment takes a name of its
 * own and both stay.
 */
START_TEST(leftover_left_alone)
{
	struct gmlake_shm_snapshot snap;
	char path[512], old[512];
	gmlake_ctx *ctx;
	int fd;

	snprintf(old, sizeof(old), "%s/gmlake.%d", dir, (int)getpid());
	fd = open(old, O_CREAT | O_WRONLY, 0600);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(write(fd, "junk", 4), 4);
	close(fd);
	ctx = th_ctx(64 * TH_MiB);
	wait_published(ctx, &snap);
	ck_assert_int_eq(snap.pid, getpid());
	own_path(path, sizeof(path));
	ck_assert_int_eq(access(old, F_OK), 0);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, false), 0);
	ck_assert_int_eq(access(path, F_OK), -1);
	ck_assert_int_eq(access(old, F_OK), 0);
}
END_TEST

/*
 * The name is gmlake.PID.TOKEN with the header's token, nothing is left
 * under the hidden creation name, and the publisher holds its lock.
 */
START_TEST(name_token_lock)
{
	struct gmlake_shm_snapshot snap;
	gmlake_ctx *ctx = th_ctx(64 * TH_MiB);
	char path[512], want[512];
	int fd;

	wait_published(ctx, &snap);
	own_path(path, sizeof(path));
	ck_assert_uint_ne(snap.token, 0);
	snprintf(want, sizeof(want), "%s/gmlake.%d.%016llx", dir,
		 (int)getpid(), (unsigned long long)snap.token);
	ck_assert_str_eq(path, want);
	ck_assert_int_eq(count_prefix(dir, ".gmlake"), 0);
	ck_assert_uint_eq(snap.flags, GMLAKE_SHM_SNAP_LOCK_CHECKED);
	ck_assert(!gmlake_shm_stale(&snap));
	fd = open(path, O_RDONLY);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(flock(fd, LOCK_SH | LOCK_NB), -1);
	ck_assert_int_eq(errno, EWOULDBLOCK);
	close(fd);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, false), 0);
}
END_TEST

/* A child of fork() must not remove its parent's segment at exit. */
START_TEST(fork_child_leaves_segment)
{
	gmlake_ctx *ctx = th_ctx(64 * TH_MiB);
	char path[512];
	int status;
	pid_t pid;

	own_path(path, sizeof(path));
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		/* exit() after fork() in a threaded process may hang in a
		 * lock another thread held at the fork (the sanitizers'
		 * leak check at exit, say): our atexit handler runs first,
		 * and a stuck child is killed rather than stall the test.
		 * By the default action: Check's own SIGALRM handler, which
		 * the child inherits, kills the whole process group, the
		 * test with it. */
		signal(SIGALRM, SIG_DFL);
		alarm(20);
		exit(0);	/* atexit handlers run */
	}
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert_int_eq(access(path, F_OK), 0);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, false), 0);
	ck_assert_int_eq(access(path, F_OK), -1);
}
END_TEST

/*
 * A child of fork() makes and destroys a context of its own while the
 * parent's publisher waits: the child's copy of the publisher's condition
 * variable must not count that waiter (its first signal would block for
 * good). A stuck child is killed by its alarm, and the test fails.
 */
START_TEST(fork_child_publishes)
{
	gmlake_ctx *ctx = th_ctx(64 * TH_MiB);

	/* Forks at several points of the publisher's waits. */
	for (int i = 0; i < 8; i++) {
		gmlake_ctx *mine = th_ctx(64 * TH_MiB);	/* a kick */
		int status;
		pid_t pid;

		usleep(5000 * (unsigned)i);
		pid = fork();
		ck_assert_int_ge(pid, 0);
		if (pid == 0) {
			gmlake_ctx *c = NULL;

			/* See fork_child_leaves_segment. */
			signal(SIGALRM, SIG_DFL);
			alarm(20);
			if (gmlake_ctx_init(&c, NULL))
				_exit(1);
			usleep(30000);	/* its own publisher waits too */
			_exit(gmlake_ctx_destroy(c, false) ? 1 : 0);
		}
		ck_assert_int_eq(waitpid(pid, &status, 0), pid);
		ck_assert_msg(WIFEXITED(status) && WEXITSTATUS(status) == 0,
			      "the child's context failed or hung (status "
			      "%#x)", status);
		ck_assert_int_eq(gmlake_ctx_destroy(mine, false), 0);
	}
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, false), 0);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* A publisher that never kills or stops its program                      */

/*
 * A tmpfs of 16 pages at dir/tiny with room left for `pages` pages, in a
 * mount namespace of this (forked) test process; GMLAKE_SHM_DIR points at
 * it. False, with a note, where mounting is not allowed.
 */
static bool tiny_tmpfs(char *tiny, size_t len, unsigned pages)
{
	static const char zeros[4096];
	char fill[600];
	struct statvfs vs;
	size_t n;
	int fd;

	snprintf(tiny, len, "%s/tiny", dir);
	ck_assert_int_eq(mkdir(tiny, 0700), 0);
	if (unshare(CLONE_NEWNS) ||
	    mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) ||
	    mount("tmpfs", tiny, "tmpfs", 0, "size=64k,mode=0700")) {
		fprintf(stderr, "check_shm: cannot mount a tmpfs (%s); a full "
			"directory is not tried\n", strerror(errno));
		return false;
	}
	snprintf(fill, sizeof(fill), "%s/fill", tiny);
	fd = open(fill, O_CREAT | O_WRONLY, 0600);
	ck_assert_int_ge(fd, 0);
	for (n = 0; n < 16 - pages; n++)
		ck_assert_int_eq(write(fd, zeros, 4096) == 4096 ||
					 errno == ENOSPC, 1);
	close(fd);
	ck_assert_int_eq(statvfs(tiny, &vs), 0);
	ck_assert_uint_eq(vs.f_bavail * vs.f_bsize / 4096, pages);
	ck_assert_int_eq(setenv("GMLAKE_SHM_DIR", tiny, 1), 0);
	return true;
}

/* Contexts on a directory with `pages` free: they work, unpublished. */
static void run_unpublished(unsigned pages)
{
	gmlake_ctx *ctx[10];
	char tiny[300], path[600];
	void *p;

	if (!tiny_tmpfs(tiny, sizeof(tiny), pages))
		return;
	/* ten contexts: the publisher died at the eighth */
	for (int i = 0; i < 10; i++) {
		ctx[i] = th_ctx(64 * TH_MiB);
		ck_assert_int_eq(gmlake_alloc(ctx[i], &p, 3 * TH_MiB, NULL), 0);
	}
	sleep_ms(100);		/* publisher rounds, if any */
	ck_assert(!seg_path_in(tiny, (int)getpid(), path, sizeof(path)));
	ck_assert_int_eq(count_prefix(tiny, ".gmlake"), 0);
	for (int i = 0; i < 10; i++)
		ck_assert_int_eq(gmlake_ctx_destroy(ctx[i], true), 0);
	ck_assert_int_eq(umount2(tiny, MNT_DETACH), 0);
}

START_TEST(full_dir_only_warns)
{
	run_unpublished(0);
}
END_TEST

START_TEST(one_page_left_only_warns)
{
	run_unpublished(1);
}
END_TEST

/*
 * RLIMIT_FSIZE below the segment's size, met when the segment must grow
 * back after a truncation: the writes fail, and SIGXFSZ (whose default
 * action ends the process) must not reach the program, neither from the
 * publisher nor from gmlake_ctx_destroy's own write. In a child, so that
 * Check's files are not limited; the emulated device sizes its memory
 * before the limit is set.
 */
START_TEST(file_size_limit_only_warns)
{
	int status;
	pid_t pid = fork();

	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		struct rlimit rl = { 4096, 4096 };
		gmlake_ctx *a = NULL, *b = NULL;
		char path[512];
		void *p;

		if (gmlake_ctx_init(&a, NULL) || gmlake_ctx_init(&b, NULL) ||
		    !seg_path_in(dir, (int)getpid(), path, sizeof(path)) ||
		    truncate(path, 0) || setrlimit(RLIMIT_FSIZE, &rl))
			_exit(2);
		if (gmlake_ctx_destroy(b, true) ||
		    gmlake_alloc(a, &p, TH_MiB, NULL))
			_exit(3);
		sleep_ms(100);
		_exit(gmlake_ctx_destroy(a, true) ? 4 : 0);
	}
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert_msg(WIFEXITED(status), "child killed by signal %d",
		      WTERMSIG(status));
	ck_assert_int_eq(WEXITSTATUS(status), 0);
}
END_TEST

/*
 * Another process truncates the live segment over and over: the program
 * goes on (it died of SIGBUS within 10 ms), and the segment is whole again
 * once that stops.
 */
START_TEST(truncated_segment_survives)
{
	struct gmlake_shm_snapshot snap;
	gmlake_ctx *ctx = th_ctx(64 * TH_MiB);
	char path[512];
	void *p;

	wait_published(ctx, &snap);
	own_path(path, sizeof(path));
	for (int i = 0; i < 60; i++) {
		ck_assert_int_eq(truncate(path, i % 3 ? 0 : 300), 0);
		ck_assert_int_eq(gmlake_alloc(ctx, &p, TH_MiB, NULL), 0);
		sleep_ms(5);
		ck_assert_int_eq(gmlake_free(ctx, p), 0);
	}
	ck_assert_int_eq(truncate(path, 0), 0);
	wait_published(ctx, &snap);	/* written whole again */
	ck_assert_int_eq(snap.pid, getpid());
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
}
END_TEST

/* The publisher thread's id, found by its name; 0 when none has it. */
static int publisher_tid(void)
{
	char path[300], name[32];
	struct dirent *de;
	int tid = 0;
	DIR *d = opendir("/proc/self/task");
	FILE *f;

	ck_assert_ptr_nonnull(d);
	while (!tid && (de = readdir(d))) {
		if (de->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/self/task/%s/comm",
			 de->d_name);
		f = fopen(path, "r");
		if (!f)
			continue;
		if (fgets(name, sizeof(name), f) &&
		    !strcmp(name, "gmlake-pub\n"))
			tid = atoi(de->d_name);
		fclose(f);
	}
	closedir(d);
	return tid;
}

static long voluntary_switches(int tid)
{
	char path[64], line[128];
	long n = -1;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/self/task/%d/status", tid);
	f = fopen(path, "r");
	ck_assert_ptr_nonnull(f);
	while (fgets(line, sizeof(line), f))
		sscanf(line, "voluntary_ctxt_switches: %ld", &n);
	fclose(f);
	ck_assert_int_ge(n, 0);
	return n;
}

/*
 * An idle process: the publisher, named gmlake-pub, sleeps while nothing
 * changes (it woke 100 times a second), and a change still shows soon.
 */
START_TEST(idle_publisher_sleeps)
{
	struct gmlake_shm_snapshot snap;
	gmlake_ctx *ctx = th_ctx(64 * TH_MiB);
	long before, after;
	int tid;
	void *p;

	tid = publisher_tid();
	ck_assert_msg(tid > 0, "no thread named gmlake-pub");
	sleep_ms(1300);		/* the period has grown to its longest */
	before = voluntary_switches(tid);
	sleep_ms(1000);
	after = voluntary_switches(tid);
	ck_assert_msg(after - before <= 4, "%ld wake-ups in an idle second",
		      after - before);
	ck_assert_int_eq(gmlake_alloc(ctx, &p, TH_MiB, NULL), 0);
	wait_published(ctx, &snap);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* gmlake-top against a live and a killed process                         */

static bool top_path(char *buf, size_t len)
{
	const char *b = getenv("top_builddir");

	snprintf(buf, len, "%s/tools/gmlake-top", b ? b : ".");
	if (access(buf, X_OK) == 0)
		return true;
	fprintf(stderr, "check_shm: %s not built (no ncursesw); case "
		"passes without it\n", buf);
	return false;
}

/* gmlake-top -b --json -n 1 --dir DIR; its output (malloc'd). */
static char *run_top(const char *top)
{
	char cmd[1024], *out = calloc(1, 1 << 16);
	size_t n = 0, got;
	FILE *f;

	ck_assert_ptr_nonnull(out);
	snprintf(cmd, sizeof(cmd), "'%s' --json -n 1 -d 0.1 --dir '%s'", top,
		 dir);
	f = popen(cmd, "r");
	ck_assert_ptr_nonnull(f);
	while ((got = fread(out + n, 1, (1 << 16) - 1 - n, f)) > 0)
		n += got;
	ck_assert_int_eq(pclose(f), 0);
	ck_assert_msg(n > 0 && out[n - 1] == '\n', "no JSON line: %s", out);
	return out;
}

/* The process object of pid in gmlake-top's JSON, cut at its end. */
static char *json_proc(char *out, int pid)
{
	char key[32], *p, *end;

	snprintf(key, sizeof(key), "{\"pid\":%d,", pid);
	p = strstr(out, key);
	ck_assert_msg(p != NULL, "pid %d not in %s", pid, out);
	end = strstr(p + 1, "{\"pid\":");
	if (!end)
		end = strstr(p, "]}");
	ck_assert_ptr_nonnull(end);
	*end = '\0';
	return p;
}

static long long json_int(const char *obj, const char *name)
{
	char key[64];
	const char *p;

	snprintf(key, sizeof(key), "\"%s\":", name);
	p = strstr(obj, key);
	ck_assert_msg(p != NULL, "%s not in %s", name, obj);
	return strtoll(p + strlen(key), NULL, 10);
}

START_TEST(top_json_matches_stats)
{
	struct gmlake_shm_snapshot snap;
	struct gmlake_stats st;
	gmlake_ctx *ctx;
	char top[512], *out, *obj;
	void *p[6];

	if (!top_path(top, sizeof(top)))
		return;
	ctx = th_ctx(256 * TH_MiB);
	for (int round = 0; round < 2; round++) {
		if (round == 0)
			pattern(ctx, p);
		else
			for (int i = 0; i < 6; i += 2)
				ck_assert_int_eq(gmlake_free(ctx, p[i]), 0);
		wait_published(ctx, &snap);
		th_stats(ctx, &st);
		out = run_top(top);
		obj = json_proc(out, getpid());
		ck_assert_ptr_nonnull(strstr(obj, "\"state\":\"live\""));
		ck_assert_ptr_nonnull(strstr(obj, "\"command\":\"check_shm\""));
		ck_assert_ptr_nonnull(strstr(obj, "\"backend\":\"emu\""));
		/* the units of the other outputs: percent, engine by name */
		ck_assert_ptr_nonnull(strstr(obj,
					     "\"offload_engine\":\"none\""));
		ck_assert_ptr_nonnull(strstr(obj, "\"fragmentation_pct\":"));
		ck_assert_int_eq(json_int(obj, "resident_bytes"),
				 st.resident_bytes.current);
		ck_assert_int_eq(json_int(obj, "allocated_bytes"),
				 st.allocated_bytes.current);
		ck_assert_int_eq(json_int(obj, "reserved_bytes"),
				 st.reserved_bytes.current);
		ck_assert_int_eq(json_int(obj, "reserved_peak"),
				 st.reserved_bytes.peak);
		ck_assert_int_eq(json_int(obj, "active_blocks"),
				 st.active_blocks.current);
		ck_assert_int_eq(json_int(obj, "allocs"), (long long)st.allocs);
		ck_assert_int_eq(json_int(obj, "frees"), (long long)st.frees);
		ck_assert_int_eq(json_int(obj, "map_calls"),
				 (long long)st.calls[GMLAKE_CALL_mem_map]);
		ck_assert_int_eq(json_int(obj, "spilled_bytes"),
				 st.spilled_bytes.current);
		free(out);
	}
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
}
END_TEST

/* A child with a context, killed with SIGKILL: its segment stays. */
static pid_t killed_child(char *path, size_t len)
{
	int fds[2], status;
	char c;
	pid_t pid;

	ck_assert_int_eq(pipe(fds), 0);
	pid = fork();
	ck_assert_int_ge(pid, 0);
	if (pid == 0) {
		gmlake_ctx *ctx = NULL;
		void *ptr;

		close(fds[0]);
		if (gmlake_ctx_init(&ctx, NULL) ||
		    gmlake_alloc(ctx, &ptr, 8 * TH_MiB, NULL))
			_exit(1);
		sleep_ms(50);	/* one publish round */
		if (write(fds[1], "r", 1) != 1)
			_exit(1);
		for (;;)
			pause();
	}
	close(fds[1]);
	ck_assert_int_eq(read(fds[0], &c, 1), 1);
	close(fds[0]);
	ck_assert_int_eq(kill(pid, SIGKILL), 0);
	ck_assert_int_eq(waitpid(pid, &status, 0), pid);
	ck_assert(WIFSIGNALED(status));
	ck_assert(seg_path_in(dir, (int)pid, path, len));
	return pid;
}

START_TEST(killed_is_stale)
{
	struct gmlake_shm_snapshot snap;
	char path[512];
	int ret;

	killed_child(path, sizeof(path));
	ret = read_seg(path, (uint32_t)geteuid(), &snap);
	ck_assert_msg(ret == 0, "%d %s", ret, gmlake_last_error());
	ck_assert_uint_eq(snap.nslots, 1);
	ck_assert_int_eq(snap.slots[0].allocated_bytes, 8 * TH_MiB);
	ck_assert(gmlake_shm_stale(&snap));
}
END_TEST

START_TEST(top_cleans_killed)
{
	char top[512], path[512], *out, *obj;
	pid_t pid;

	if (!top_path(top, sizeof(top)))
		return;
	pid = killed_child(path, sizeof(path));
	out = run_top(top);
	obj = json_proc(out, pid);
	ck_assert_msg(strstr(obj, "\"state\":\"gone\"") != NULL, "%s", obj);
	ck_assert_msg(strstr(obj, "\"removed\":true") != NULL, "%s", obj);
	ck_assert_int_eq(access(path, F_OK), -1);
	free(out);
	/* The next snapshot does not list it any more. */
	out = run_top(top);
	ck_assert_ptr_nonnull(strstr(out, "\"processes\":[]"));
	free(out);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Rejection of bad segments                                              */

#define IMG_MAX 65536

/* A real segment image, from this process's own publication. */
static size_t valid_image(unsigned char *img)
{
	struct gmlake_shm_snapshot snap;
	gmlake_ctx *ctx = th_ctx(64 * TH_MiB);
	char path[512];
	ssize_t n = 0;
	void *p;
	int fd;

	ck_assert_int_eq(gmlake_alloc(ctx, &p, 5 * TH_MiB, NULL), 0);
	wait_published(ctx, &snap);
	own_path(path, sizeof(path));
	for (int i = 0; i < 100; i++) {
		fd = open(path, O_RDONLY);
		ck_assert_int_ge(fd, 0);
		n = read(fd, img, IMG_MAX);
		close(fd);
		snap_init(&snap);
		if (n > 0 && gmlake_shm_parse(img, (size_t)n, &snap) == 0)
			break;
		n = 0;
	}
	ck_assert_int_gt(n, 0);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
	return (size_t)n;
}

static void write_file(const char *path, const void *buf, size_t len,
		       mode_t mode)
{
	int fd;

	unlink(path);
	fd = open(path, O_CREAT | O_EXCL | O_WRONLY, mode);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(fchmod(fd, mode), 0);
	ck_assert_int_eq(write(fd, buf, len), (ssize_t)len);
	close(fd);
}

/* Write img as gmlake.PID (the pid in it) and read it back. */
static int try_image(const void *img, size_t len, mode_t mode)
{
	struct gmlake_shm_snapshot snap;
	char path[512];
	int ret;

	path_of(path, sizeof(path), "image.seg");
	write_file(path, img, len, mode);
	ret = read_seg(path, (uint32_t)geteuid(), &snap);
	ck_assert_int_le(ret, 0);
	if (ret)
		ck_assert_msg(gmlake_last_error()[0], "no message for %d", ret);
	return ret;
}

static struct gmlake_shm_header *hdr(unsigned char *img)
{
	return (struct gmlake_shm_header *)img;
}

static struct gmlake_shm_slot *slot0(unsigned char *img)
{
	return (struct gmlake_shm_slot *)(img + hdr(img)->header_size);
}

START_TEST(reject_bad_images)
{
	static unsigned char img[IMG_MAX], bad[IMG_MAX];
	size_t len = valid_image(img);

	ck_assert_int_eq(try_image(img, len, 0600), 0);
	/* truncated: no header, half a slot, one byte short */
	ck_assert_int_eq(try_image(img, 100, 0600), -EBADMSG);
	ck_assert_int_eq(try_image(img, len - 256, 0600), -EBADMSG);
	ck_assert_int_eq(try_image(img, len - 1, 0600), -EBADMSG);
	ck_assert_int_eq(try_image(img, 0, 0600), -EAGAIN);
#define MUTATE(stmt, want)						\
	do {								\
		memcpy(bad, img, len);					\
		stmt;							\
		ck_assert_int_eq(try_image(bad, len, 0600), want);	\
	} while (0)
	MUTATE(hdr(bad)->magic ^= 1, -EBADMSG);
	MUTATE(hdr(bad)->magic = 0, -EAGAIN);
	MUTATE(hdr(bad)->compat_version = 3; hdr(bad)->version = 3,
	       -EPROTONOSUPPORT);
	MUTATE(hdr(bad)->compat_version = 3, -EBADMSG);
	MUTATE(hdr(bad)->token = 0, -EBADMSG);
	MUTATE(slot0(bad)->resident_bytes = -1, -EBADMSG);
	MUTATE(hdr(bad)->version = 0, -EBADMSG);
	MUTATE(hdr(bad)->size += 8, -EBADMSG);
	MUTATE(hdr(bad)->header_size = 8, -EBADMSG);
	MUTATE(hdr(bad)->header_size = (uint32_t)len, -EBADMSG);
	MUTATE(hdr(bad)->slot_size = 4096, -EBADMSG);
	MUTATE(hdr(bad)->slot_size = 7, -EBADMSG);
	MUTATE(hdr(bad)->nslots = UINT32_MAX, -EBADMSG);
	MUTATE(hdr(bad)->nslots = 0, -EBADMSG);
	MUTATE(hdr(bad)->pid = -1, -EBADMSG);
	MUTATE(hdr(bad)->flags = 1, -EBADMSG);
	MUTATE(hdr(bad)->seq |= 1, -EAGAIN);
	MUTATE(memset(hdr(bad)->comm, 'x', GMLAKE_SHM_COMM_LEN), -EBADMSG);
	MUTATE(hdr(bad)->uid += 1, -EBADMSG);
	MUTATE(slot0(bad)->state = 7, -EBADMSG);
	MUTATE(slot0(bad)->device = -3, -EBADMSG);
	MUTATE(slot0(bad)->backend = 9, -EBADMSG);
	MUTATE(slot0(bad)->ctx_id = 0, -EBADMSG);
	MUTATE(slot0(bad)->chunk_size = 3, -EBADMSG);
	MUTATE(slot0(bad)->allocated_bytes = -5, -EBADMSG);
	MUTATE(slot0(bad)->reserved_peak = 0, -EBADMSG);
	/* A newer layout a layout-1 reader can still read. */
	MUTATE(hdr(bad)->version = 5, 0);
	/* Control bytes in the command name are made printable. */
	MUTATE(hdr(bad)->comm[0] = '\033', 0);
#undef MUTATE
}
END_TEST

/* A newer writer with larger slots: the known prefix is read. */
START_TEST(newer_layout_read)
{
	static unsigned char img[IMG_MAX], big[2 * IMG_MAX];
	struct gmlake_shm_snapshot snap;
	size_t len = valid_image(img), hs = hdr(img)->header_size;
	uint32_t n = hdr(img)->nslots, ss = 2 * GML_SHM_SLOT_V1;
	size_t blen = hs + (size_t)n * ss;

	memset(big, 0xff, sizeof(big));
	memcpy(big, img, hs);
	for (uint32_t i = 0; i < n; i++)
		memcpy(big + hs + i * ss, img + hs + i * GML_SHM_SLOT_V1,
		       GML_SHM_SLOT_V1);
	hdr(big)->version = GMLAKE_SHM_VERSION + 1;
	hdr(big)->slot_size = ss;
	hdr(big)->size = blen;
	snap_init(&snap);
	ck_assert_int_eq(gmlake_shm_parse(big, blen, &snap), 0);
	ck_assert_uint_eq(snap.layout_version, GMLAKE_SHM_VERSION + 1);
	ck_assert_uint_eq(snap.nslots, 1);
	ck_assert_int_eq(snap.slots[0].allocated_bytes,
			 slot0(img)->allocated_bytes);
	ck_assert(len > 0);
}
END_TEST

/* The canonical name of a segment with the image's pid and token. */
static void canon_path(char *buf, size_t len, const unsigned char *img,
		       int pid)
{
	snprintf(buf, len, "%s/gmlake.%d.%016llx", dir, pid,
		 (unsigned long long)((const struct gmlake_shm_header *)img)
			 ->token);
}

START_TEST(reject_files)
{
	static unsigned char img[IMG_MAX];
	struct gmlake_shm_snapshot snap;
	size_t len = valid_image(img);
	char path[512], link[512];
	int ret;

	canon_path(path, sizeof(path), img, hdr(img)->pid);
	write_file(path, img, len, 0600);
	ck_assert_int_eq(read_seg(path, (uint32_t)geteuid(), &snap), 0);
	ck_assert_int_eq(read_seg(path, GMLAKE_SHM_ANY_UID, &snap), 0);
	/* another owner expected (the injectable uid) */
	ret = read_seg(path, (uint32_t)geteuid() + 1, &snap);
	ck_assert_int_eq(ret, -EPERM);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "owned by uid"));
	/* open to other users */
	ck_assert_int_eq(chmod(path, 0644), 0);
	ck_assert_int_eq(read_seg(path, (uint32_t)geteuid(), &snap), -EPERM);
	ck_assert_int_eq(chmod(path, 0600), 0);
	/* a symbolic link to a good segment */
	canon_path(link, sizeof(link), img, 1);
	ck_assert_int_eq(symlink(path, link), 0);
	ck_assert_int_eq(read_seg(link, (uint32_t)geteuid(), &snap), -ELOOP);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "symbolic link"));
	/* the name says another pid */
	canon_path(link, sizeof(link), img, 2);
	write_file(link, img, len, 0600);
	ck_assert_int_eq(read_seg(link, (uint32_t)geteuid(), &snap), -EBADMSG);
	/* a FIFO (must not block) and a directory */
	path_of(link, sizeof(link), "seg.3");
	ck_assert_int_eq(mkfifo(link, 0600), 0);
	ck_assert_int_eq(read_seg(link, (uint32_t)geteuid(), &snap), -EINVAL);
	path_of(link, sizeof(link), "seg.4");
	ck_assert_int_eq(mkdir(link, 0700), 0);
	ck_assert_int_eq(read_seg(link, (uint32_t)geteuid(), &snap), -EINVAL);
	/* too large */
	path_of(link, sizeof(link), "seg.5");
	write_file(link, img, len, 0600);
	ck_assert_int_eq(truncate(link, GMLAKE_SHM_MAX_SIZE + 1), 0);
	ck_assert_int_eq(read_seg(link, (uint32_t)geteuid(), &snap), -EFBIG);
	/* not a segment: the magic is refused before the whole is read */
	path_of(link, sizeof(link), "seg.6");
	write_file(link, "not a segment at all, not at all", 32, 0600);
	ck_assert_int_eq(truncate(link, 4096), 0);
	ck_assert_int_eq(read_seg(link, (uint32_t)geteuid(), &snap), -EBADMSG);
	ck_assert_ptr_nonnull(strstr(gmlake_last_error(), "bad magic"));
	/* bad arguments */
	ck_assert_int_eq(gmlake_shm_read(NULL, 0, &snap), -EINVAL);
	ck_assert_int_eq(gmlake_shm_read(path, 0, NULL), -EINVAL);
	snap.version = 99;
	ck_assert_int_eq(gmlake_shm_read(path, GMLAKE_SHM_ANY_UID, &snap),
			 -EINVAL);
	ck_assert_int_eq(gmlake_shm_parse(NULL, 10, &snap), -EINVAL);
}
END_TEST

/*
 * Names that would pass for a live pid (gmlake.+PID, gmlake.0PID), the
 * old gmlake.PID, and other near misses: refused, whatever they hold.
 */
START_TEST(reject_noncanonical_names)
{
	static unsigned char img[IMG_MAX];
	struct gmlake_shm_snapshot snap;
	size_t len = valid_image(img);
	unsigned long long tok = hdr(img)->token;
	int pid = hdr(img)->pid;
	char path[512], name[128];
	const char *const fmts[] = {
		"gmlake.+%d.%016llx", "gmlake.0%d.%016llx", "gmlake.%d",
		"gmlake.%d.%016llX", "gmlake.%d.%016llx.x", "gmlake.%d.%015llx",
		"gmlake.%d.%017llx", "gmlake. %d.%016llx", "gmlake.%d.+%015llx",
	};

	for (size_t i = 0; i < sizeof(fmts) / sizeof(fmts[0]); i++) {
		/* 15 digits: drop one */
		snprintf(name, sizeof(name), fmts[i], pid,
			 strstr(fmts[i], "015") ? tok >> 4 : tok);
		path_of(path, sizeof(path), name);
		write_file(path, img, len, 0600);
		ck_assert_msg(read_seg(path, (uint32_t)geteuid(), &snap) ==
				      -EBADMSG, "%s read", name);
		ck_assert_uint_eq(snap.flags, 0);
		unlink(path);
	}
	canon_path(path, sizeof(path), img, pid);
	write_file(path, img, len, 0600);
	ck_assert_int_eq(read_seg(path, (uint32_t)geteuid(), &snap), 0);
	/* the token in the name must be the header's */
	snprintf(name, sizeof(name), "gmlake.%d.%016llx", pid, tok ^ 1);
	path_of(path, sizeof(path), name);
	write_file(path, img, len, 0600);
	ck_assert_int_eq(read_seg(path, (uint32_t)geteuid(), &snap), -EBADMSG);
}
END_TEST

/* Really another owner: chown to nobody (only root can). */
START_TEST(reject_foreign_owner)
{
	static unsigned char img[IMG_MAX];
	struct gmlake_shm_snapshot snap;
	size_t len = valid_image(img);
	char path[512];

	if (geteuid() != 0)
		return;		/* the injectable uid case covers it */
	canon_path(path, sizeof(path), img, hdr(img)->pid);
	write_file(path, img, len, 0600);
	ck_assert_int_eq(chown(path, 65534, 65534), 0);
	ck_assert_int_eq(read_seg(path, 0, &snap), -EPERM);
	/* as root with any owner: the header's uid disagrees with the file */
	ck_assert_int_eq(read_seg(path, GMLAKE_SHM_ANY_UID, &snap), -EBADMSG);
}
END_TEST

START_TEST(stale_by_start_time)
{
	static unsigned char img[IMG_MAX];
	struct gmlake_shm_snapshot snap;
	size_t len = valid_image(img);

	snap_init(&snap);
	ck_assert_int_eq(gmlake_shm_parse(img, len, &snap), 0);
	ck_assert_int_eq(snap.pid, getpid());
	ck_assert(!gmlake_shm_stale(&snap));
	snap.start_time += 1;	/* the pid was reused */
	ck_assert(gmlake_shm_stale(&snap));
	snap.pid = 4194304;	/* no such process */
	ck_assert(gmlake_shm_stale(&snap));
	ck_assert(!gmlake_shm_stale(NULL));
}
END_TEST

/* Random byte flips and truncations of a valid image: never a crash. */
START_TEST(corruption_flips)
{
	static unsigned char img[IMG_MAX], bad[IMG_MAX];
	struct th_rng rng = { 0x5eed };
	struct gmlake_shm_snapshot snap;
	size_t len = valid_image(img);
	unsigned accepted = 0, rejected = 0;

	for (int it = 0; it < 20000; it++) {
		size_t blen = len;
		int ret;

		memcpy(bad, img, len);
		if (th_range(&rng, 0, 3) == 0)
			blen = th_range(&rng, 0, len);
		for (uint64_t k = th_range(&rng, 1, 8); k; k--) {
			/* header bytes are hit more often */
			size_t at = th_range(&rng, 0, 1) ?
				th_range(&rng, 0, GML_SHM_HEADER_V1 - 1) :
				th_range(&rng, 0, len - 1);

			bad[at] ^= (unsigned char)th_range(&rng, 1, 255);
		}
		if (it % 50 == 0) {
			ret = try_image(bad, blen, 0600);
		} else {
			snap_init(&snap);
			ret = gmlake_shm_parse(bad, blen, &snap);
		}
		ck_assert_int_le(ret, 0);
		if (ret) {
			rejected++;
			ck_assert(gmlake_last_error()[0]);
			continue;
		}
		accepted++;
		if (it % 50)
			ck_assert_uint_le(snap.nslots, GMLAKE_SHM_SLOTS);
	}
	ck_assert_uint_gt(rejected, 1000);
	ck_assert_uint_gt(accepted, 10);
}
END_TEST

/* GML_SHM_WRITE_CORPUS=DIR: the fuzzer's seeds. */
START_TEST(corpus)
{
	static unsigned char img[IMG_MAX], bad[IMG_MAX];
	const char *out = getenv("GML_SHM_WRITE_CORPUS");
	char path[512];
	size_t len;

	if (!out)
		return;
	len = valid_image(img);
	snprintf(path, sizeof(path), "%s/valid", out);
	write_file(path, img, len, 0644);
	snprintf(path, sizeof(path), "%s/truncated", out);
	write_file(path, img, len / 3, 0644);
	memcpy(bad, img, len);
	hdr(bad)->version = hdr(bad)->compat_version = 9;
	snprintf(path, sizeof(path), "%s/bad-version", out);
	write_file(path, bad, len, 0644);
	memcpy(bad, img, len);
	hdr(bad)->seq |= 1;
	snprintf(path, sizeof(path), "%s/odd-seq", out);
	write_file(path, bad, len, 0644);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* PID namespaces sharing the directory                                   */

/*
 * A publisher that is PID 1 of a PID namespace of its own (a container's
 * main process): *pid is its pid here. False when namespaces are not
 * allowed. It holds a context with 8 MiB allocated until killed.
 */
static bool ns_publisher(pid_t *pid, pid_t *outer)
{
	int ready[2], pids[2], status;
	char c = 0;

	ck_assert_int_eq(pipe(ready), 0);
	ck_assert_int_eq(pipe(pids), 0);
	*outer = fork();
	ck_assert_int_ge(*outer, 0);
	if (*outer == 0) {
		pid_t inner;

		if (unshare(CLONE_NEWPID))
			_exit(write(ready[1], "n", 1) == 1 ? 0 : 1);
		inner = fork();
		if (inner == 0) {
			gmlake_ctx *ctx = NULL;
			void *ptr;

			if (getpid() != 1 || gmlake_ctx_init(&ctx, NULL) ||
			    gmlake_alloc(ctx, &ptr, 8 * TH_MiB, NULL) ||
			    write(ready[1], "r", 1) != 1)
				_exit(1);
			for (;;)
				pause();
		}
		if (inner < 0 ||
		    write(pids[1], &inner, sizeof(inner)) != sizeof(inner))
			_exit(1);
		waitpid(inner, &status, 0);
		_exit(0);
	}
	close(ready[1]);
	close(pids[1]);
	ck_assert_int_eq(read(ready[0], &c, 1), 1);
	if (c == 'n') {
		waitpid(*outer, &status, 0);
		fprintf(stderr, "check_shm: unshare(CLONE_NEWPID) refused; two "
			"PID namespaces are not tried\n");
	} else {
		ck_assert_int_eq(c, 'r');
		ck_assert_int_eq(read(pids[0], pid, sizeof(*pid)),
				 (ssize_t)sizeof(*pid));
	}
	close(ready[0]);
	close(pids[0]);
	return c == 'r';
}

static void ns_stop(pid_t pid, pid_t outer)
{
	int status;

	kill(pid, SIGKILL);
	ck_assert_int_eq(waitpid(outer, &status, 0), outer);
}

/*
 * Two containers' PID 1 share the directory: each keeps its own segment,
 * and gmlake-top here (another namespace, where pid 1 is someone else)
 * reads both and removes neither; once one dies, only its own goes.
 */
START_TEST(two_pid_namespaces)
{
	struct gmlake_shm_snapshot snap;
	pid_t a, a_outer, b, b_outer;
	char path[512], top[512], *out;
	struct dirent *de;
	int live = 0;
	DIR *d;

	if (!ns_publisher(&a, &a_outer))
		return;
	ck_assert(ns_publisher(&b, &b_outer));
	ck_assert_int_eq(count_prefix(dir, "gmlake.1."), 2);
	d = opendir(dir);
	ck_assert_ptr_nonnull(d);
	while ((de = readdir(d))) {
		if (strncmp(de->d_name, "gmlake.1.", 9))
			continue;
		path_of(path, sizeof(path), de->d_name);
		for (int i = 0; i < 200; i++) {	/* its first publication */
			ck_assert_int_eq(read_seg(path, (uint32_t)geteuid(),
						  &snap), 0);
			if (snap.nslots)
				break;
			sleep_ms(10);
		}
		ck_assert_int_eq(snap.pid, 1);
		ck_assert_uint_eq(snap.nslots, 1);
		ck_assert(!gmlake_shm_stale(&snap));
		live++;
	}
	closedir(d);
	ck_assert_int_eq(live, 2);
	if (top_path(top, sizeof(top))) {
		out = run_top(top);
		ck_assert_ptr_null(strstr(out, "\"removed\":true"));
		free(out);
		ck_assert_int_eq(count_prefix(dir, "gmlake.1."), 2);
	}
	ns_stop(a, a_outer);
	if (top_path(top, sizeof(top))) {
		out = run_top(top);
		ck_assert_ptr_nonnull(strstr(out, "\"removed\":true"));
		free(out);
		ck_assert_int_eq(count_prefix(dir, "gmlake.1."), 1);
	}
	ns_stop(b, b_outer);
}
END_TEST

/*
 * A hand-made segment whose header pid is no process here, but whose lock
 * a live process holds (a publisher in another namespace): not stale, not
 * removed. When the holder dies: stale, removed.
 */
START_TEST(locked_segment_kept)
{
	static unsigned char img[IMG_MAX];
	struct gmlake_shm_snapshot snap;
	char path[512], top[512], *out, c;
	int fds[2], status;
	size_t len = valid_image(img);
	pid_t holder;

	hdr(img)->pid = 4194000;	/* no such process here */
	canon_path(path, sizeof(path), img, hdr(img)->pid);
	write_file(path, img, len, 0600);
	ck_assert_int_eq(pipe(fds), 0);
	holder = fork();
	ck_assert_int_ge(holder, 0);
	if (holder == 0) {
		int fd = open(path, O_RDONLY);

		if (fd < 0 || flock(fd, LOCK_EX) || write(fds[1], "l", 1) != 1)
			_exit(1);
		for (;;)
			pause();
	}
	ck_assert_int_eq(read(fds[0], &c, 1), 1);
	ck_assert_int_eq(read_seg(path, (uint32_t)geteuid(), &snap), 0);
	ck_assert_uint_eq(snap.flags, GMLAKE_SHM_SNAP_LOCK_CHECKED);
	ck_assert(!gmlake_shm_stale(&snap));
	if (top_path(top, sizeof(top))) {
		out = run_top(top);
		ck_assert_ptr_nonnull(strstr(out, "\"pid\":4194000,"));
		ck_assert_ptr_null(strstr(out, "\"removed\":true"));
		free(out);
		ck_assert_int_eq(access(path, F_OK), 0);
	}
	kill(holder, SIGKILL);
	ck_assert_int_eq(waitpid(holder, &status, 0), holder);
	ck_assert_int_eq(read_seg(path, (uint32_t)geteuid(), &snap), 0);
	ck_assert(gmlake_shm_stale(&snap));
	if (top_path(top, sizeof(top))) {
		out = run_top(top);
		ck_assert_ptr_nonnull(strstr(out, "\"removed\":true"));
		free(out);
		ck_assert_int_eq(access(path, F_OK), -1);
	}
}
END_TEST

/* ---------------------------------------------------------------------- */
/* gmlake-top's data layer (tools/top-data.c, linked in)                  */

static char *memout(void (*fn)(FILE *, const void *), const void *arg)
{
	char *buf = NULL;
	size_t len = 0;
	FILE *f = open_memstream(&buf, &len);

	ck_assert_ptr_nonnull(f);
	fn(f, arg);
	ck_assert_int_eq(fclose(f), 0);
	return buf;
}

static void json_str_to(FILE *f, const void *s)
{
	gml_json_str(f, s);
}

/* UTF-8 passes through; what is not UTF-8 becomes U+FFFD, never \u00XX. */
START_TEST(top_json_utf8)
{
	static const struct {
		const char *in, *out;
	} cases[] = {
		{ "j\xc3\xbcrgen", "\"j\xc3\xbcrgen\"" },
		{ "\xe2\x86\x92\xf0\x9f\x98\x80", "\"\xe2\x86\x92\xf0\x9f\x98\x80\"" },
		{ "a\"b\\c\x01\x7f", "\"a\\\"b\\\\c\\u0001\\u007f\"" },
		{ "\xff", "\"\\ufffd\"" },
		{ "\xc0\xaf", "\"\\ufffd\\ufffd\"" },		/* overlong */
		{ "\xed\xa0\x80", "\"\\ufffd\\ufffd\\ufffd\"" },	/* surrogate */
		{ "\xe2\x86", "\"\\ufffd\\ufffd\"" },		/* cut short */
		{ "\xf4\x90\x80\x80", "\"\\ufffd\\ufffd\\ufffd\\ufffd\"" },
	};

	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char *out = memout(json_str_to, cases[i].in);

		ck_assert_str_eq(out, cases[i].out);
		free(out);
	}
}
END_TEST

static void live_row(struct top_row *r, int pid, int64_t alloc,
		     int64_t resident, int64_t reserved)
{
	memset(r, 0, sizeof(*r));
	r->pid = pid;
	r->token = (uint64_t)pid;
	r->state = TOP_LIVE;
	r->s.state = GMLAKE_SHM_SLOT_LIVE;
	r->s.backend = GMLAKE_BACKEND_EMU;
	r->s.ctx_id = 1;
	r->s.allocated_bytes = alloc;
	r->s.resident_bytes = resident;
	r->s.reserved_bytes = reserved;
	r->s.reserved_peak = reserved;
	snprintf(r->comm, sizeof(r->comm), "shm_workload");
	snprintf(r->user, sizeof(r->user), "root");
}

/* One definition, 1 - resident/reserved, never negative (was -400%). */
START_TEST(top_frag_never_negative)
{
	struct top_row r;
	bool v;

	/* 10 MiB allocated, 8 of them spilled, 2 MiB reserved */
	live_row(&r, 1, 10 * TH_MiB, 2 * TH_MiB, 2 * TH_MiB);
	ck_assert(top_frag(&r, &v) == 0.0 && v);
	live_row(&r, 1, 4 * TH_MiB, TH_MiB, 4 * TH_MiB);
	ck_assert(top_frag(&r, &v) == 75.0 && v);
	live_row(&r, 1, 4 * TH_MiB, 5 * TH_MiB, 4 * TH_MiB);
	ck_assert(top_frag(&r, &v) == 0.0 && v);
	live_row(&r, 1, 0, 0, 0);
	top_frag(&r, &v);
	ck_assert(!v);
}
END_TEST

/* A spilled block whose chunks went back: FRAG% stays in 0..100. */
START_TEST(top_frag_spilled)
{
	struct gmlake_shm_snapshot snap;
	struct gmlake_offload ring;
	struct gmlake_offload_sqe *sqe;
	struct gmlake_offload_cqe *cqe;
	struct gmlake_config cfg;
	struct gmlake_stats st;
	struct top_state ts;
	gmlake_ctx *ctx;
	void *big, *small;
	bool v;

	th_config(&cfg, 64 * TH_MiB);
	cfg.host_limit = 64 * TH_MiB;
	cfg.spare_keep_ms = 1;
	ctx = th_ctx_cfg(&cfg);
	ck_assert_int_eq(gmlake_alloc(ctx, &big, 8 * TH_MiB, NULL), 0);
	ck_assert_int_eq(gmlake_alloc(ctx, &small, 2 * TH_MiB, NULL), 0);
	ck_assert_int_eq(gmlake_offload_init(&ring, ctx, 8, 0), 0);
	sqe = gmlake_offload_get_sqe(&ring);
	ck_assert_ptr_nonnull(sqe);
	gmlake_offload_prep_spill(sqe, big);
	ck_assert_int_eq(gmlake_offload_submit(&ring), 1);
	ck_assert_int_eq(gmlake_offload_wait_cqe(&ring, &cqe), 0);
	ck_assert_int_eq(cqe->res, 0);
	gmlake_offload_cqe_seen(&ring, cqe);
	for (int i = 0; i < 300; i++) {	/* the spare chunks go back */
		th_stats(ctx, &st);
		if (st.reserved_bytes.current < st.allocated_bytes.current)
			break;
		sleep_ms(10);
	}
	ck_assert_int_lt(st.reserved_bytes.current, st.allocated_bytes.current);
	wait_published(ctx, &snap);
	ck_assert_int_eq(top_init(&ts, dir), 0);
	for (int i = 0; i < 200; i++) {	/* the spill published */
		ck_assert_int_eq(top_refresh(&ts), 0);
		ck_assert_uint_eq(ts.nview, 1);
		if (ts.rows[0].s.resident_bytes == st.resident_bytes.current)
			break;
		sleep_ms(10);
	}
	ck_assert_int_eq(ts.rows[0].s.resident_bytes,
			 st.resident_bytes.current);
	/* Spilled chunks may still be kept as spares (counted reserved)
	 * when the row is read: reserved is then at most allocated. */
	ck_assert_int_le(ts.rows[0].s.reserved_bytes,
			 ts.rows[0].s.allocated_bytes);
	ck_assert(top_frag(&ts.rows[0], &v) >= 0.0 && v);
	top_fini(&ts);
	ck_assert_int_eq(gmlake_offload_exit(&ring), 0);
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
}
END_TEST

static void gpu_line(void *arg, const char *s)
{
	if (strstr(s, "emulated"))
		snprintf(arg, 256, "%s", s);
}

/* The emulated device's line is the same whatever the rows' order. */
START_TEST(top_gpu_line_stable)
{
	struct top_row rows[2];
	struct top_state ts;
	char a[256] = "", b[256] = "";

	ck_assert_int_eq(top_init(&ts, dir), 0);
	live_row(&rows[0], 10, TH_MiB, TH_MiB, 4 * TH_MiB);
	live_row(&rows[1], 20, TH_MiB, TH_MiB, 2 * TH_MiB);
	rows[0].s.device_total = TH_GiB;
	rows[1].s.device_total = 4 * TH_GiB;
	ts.rows = rows;
	ts.nrows = 2;
	top_gpu_lines(&ts, gpu_line, a);
	rows[0] = rows[1];
	live_row(&rows[1], 10, TH_MiB, TH_MiB, 4 * TH_MiB);
	rows[1].s.device_total = TH_GiB;
	top_gpu_lines(&ts, gpu_line, b);
	ck_assert_str_eq(a, b);
	ck_assert_ptr_nonnull(strstr(a, "total 1.00G..4.00G"));
	ck_assert_ptr_nonnull(strstr(a, "reserved 6.00M"));
	ts.rows = NULL;
	ts.nrows = 0;
	top_fini(&ts);
}
END_TEST

static void text_to(FILE *f, const void *st)
{
	top_print_text((struct top_state *)st, f);
}

/* [gone] and long names do not move the figures: COMMAND comes last. */
START_TEST(top_gone_keeps_columns)
{
	struct top_row *rows = calloc(2, sizeof(*rows));
	struct top_state ts;
	char *out, *line, *hdr_line = NULL;
	size_t at = 0, res_end = 0;
	int lines = 0;

	ck_assert_ptr_nonnull(rows);
	ck_assert_int_eq(top_init(&ts, dir), 0);
	live_row(&rows[0], 10, TH_MiB, TH_MiB, 4 * TH_MiB);
	live_row(&rows[1], 20, TH_MiB, TH_MiB, 2 * TH_MiB);
	rows[1].state = TOP_GONE;
	snprintf(rows[1].user, sizeof(rows[1].user), "averylongusername");
	ts.rows = rows;
	ts.nrows = ts.cap = 2;
	top_sort(&ts);
	out = memout(text_to, &ts);
	for (line = strtok(out, "\n"); line; line = strtok(NULL, "\n")) {
		char *cmd = strstr(line, "COMMAND");

		if (cmd) {
			hdr_line = line;
			at = (size_t)(cmd - line);
			res_end = (size_t)(strstr(line, " RES ") - line) + 4;
			continue;
		}
		if (!hdr_line || !strstr(line, "shm_workload"))
			continue;
		ck_assert_msg(strlen(line) > at &&
				      (!strncmp(line + at, "shm_workload", 12) ||
				       !strncmp(line + at, "[gone] shm", 10)),
			      "command not at column %zu: %s", at, line);
		/* the reserved figure ends where its header does */
		ck_assert_msg(line[res_end - 1] == 'M', "RES moved: %s", line);
		lines++;
	}
	ck_assert_int_eq(lines, 2);
	ck_assert_uint_le(at, 72);	/* 80 columns leave 8 for it */
	free(out);
	top_fini(&ts);
}
END_TEST

/*
 * Another user's junk costs nothing: 20,000 symbolic links with segment
 * names (each was a row: 6.2 s and 189 MB a refresh), the old names, and
 * refused files of our own, of which TOP_MAX_BAD make rows.
 */
START_TEST(top_many_entries)
{
	struct top_state ts;
	char path[512], target[512];
	struct timespec t0, t1;
	double secs;

	path_of(target, sizeof(target), "elsewhere");
	for (int i = 1; i <= 20000; i++) {
		snprintf(path, sizeof(path), "%s/gmlake.%d.%016x", dir, i,
			 0xabc000u + (unsigned)i);
		ck_assert_int_eq(symlink(target, path), 0);
		snprintf(path, sizeof(path), "%s/gmlake.%d", dir, i);
		if (i % 10 == 0)
			ck_assert_int_eq(symlink(target, path), 0);
	}
	for (int i = 1; i <= 40; i++) {
		snprintf(path, sizeof(path), "%s/gmlake.%d.%016x", dir, i,
			 0xdef000u + (unsigned)i);
		write_file(path, "junk", 4, 0644);	/* refused, kept */
	}
	ck_assert_int_eq(top_init(&ts, dir), 0);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	ck_assert_int_eq(top_refresh(&ts), 0);
	clock_gettime(CLOCK_MONOTONIC, &t1);
	secs = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
	ck_assert_uint_le(ts.nrows, TOP_MAX_BAD);
	ck_assert_uint_eq(ts.skipped, 20000 + 40 - TOP_MAX_BAD);
	ck_assert_msg(secs < 2.0, "a refresh took %.2f s", secs);
	ck_assert_int_eq(top_refresh(&ts), 0);	/* and again: no growth */
	ck_assert_uint_le(ts.nrows, TOP_MAX_BAD);
	top_fini(&ts);
}
END_TEST

/* --sort, --reverse and --pid in the JSON mode; a bad key is refused. */
START_TEST(top_sort_and_pid_options)
{
	struct gmlake_shm_snapshot snap;
	gmlake_ctx *ctx = th_ctx(64 * TH_MiB);
	char top[512], cmd[1200], key[32], buf[1 << 14];
	size_t n;
	FILE *f;

	wait_published(ctx, &snap);
	if (!top_path(top, sizeof(top)))
		goto out;
	snprintf(key, sizeof(key), "{\"pid\":%d,", (int)getpid());
	snprintf(cmd, sizeof(cmd), "'%s' --json -n 1 --dir '%s' --sort=pid "
		 "--reverse --pid=%d", top, dir, (int)getpid());
	f = popen(cmd, "r");
	ck_assert_ptr_nonnull(f);
	n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = '\0';
	ck_assert_int_eq(pclose(f), 0);
	ck_assert_ptr_nonnull(strstr(buf, "\"sort\":\"PID\",\"reverse\":true"));
	ck_assert_ptr_nonnull(strstr(buf, key));
	snprintf(cmd, sizeof(cmd), "'%s' --json -n 1 --dir '%s' --pid=1",
		 top, dir);
	f = popen(cmd, "r");
	ck_assert_ptr_nonnull(f);
	n = fread(buf, 1, sizeof(buf) - 1, f);
	buf[n] = '\0';
	ck_assert_int_eq(pclose(f), 0);
	ck_assert_ptr_nonnull(strstr(buf, "\"processes\":[]"));
	snprintf(cmd, sizeof(cmd), "'%s' --json -n 1 --dir '%s' --sort=nope "
		 "2>/dev/null", top, dir);
	f = popen(cmd, "r");
	ck_assert_ptr_nonnull(f);
	ck_assert_int_eq(WEXITSTATUS(pclose(f)), 2);
	ck_assert_int_eq(top_sort_key("MEM"), COL_RES);
	ck_assert_int_eq(top_sort_key("command"), COL_CMD);
	ck_assert_int_eq(top_sort_key("x"), -EINVAL);
out:
	ck_assert_int_eq(gmlake_ctx_destroy(ctx, true), 0);
}
END_TEST

static Suite *shm_suite(void)
{
	Suite *s = suite_create("shm");
	TCase *tc;

	tc = tcase_create("Publish");
	tcase_set_timeout(tc, TH_TIMEOUT);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, publish_matches_stats);
	tcase_add_test(tc, contexts_share_one_segment);
	tcase_add_test(tc, publish_off);
	tcase_add_test(tc, leftover_left_alone);
	tcase_add_test(tc, name_token_lock);
	tcase_add_test(tc, fork_child_leaves_segment);
#ifndef TH_ASAN
	/* A child of a threaded process may find AddressSanitizer's
	 * allocator locked by a thread that did not survive the fork (gcc
	 * 12's does not reset its locks at fork, as glibc's malloc does):
	 * its publisher thread then hangs in malloc at start, whatever the
	 * library does. The plain build runs this test. */
	tcase_add_test(tc, fork_child_publishes);
#endif
	suite_add_tcase(s, tc);

	tc = tcase_create("Robust");
	tcase_set_timeout(tc, TH_TIMEOUT);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, full_dir_only_warns);
	tcase_add_test(tc, one_page_left_only_warns);
	tcase_add_test(tc, file_size_limit_only_warns);
	tcase_add_test(tc, truncated_segment_survives);
	tcase_add_test(tc, idle_publisher_sleeps);
	suite_add_tcase(s, tc);

	tc = tcase_create("Namespaces");
	tcase_set_timeout(tc, TH_TIMEOUT);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, two_pid_namespaces);
	tcase_add_test(tc, locked_segment_kept);
	suite_add_tcase(s, tc);

	tc = tcase_create("Top");
	tcase_set_timeout(tc, TH_TIMEOUT);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, top_json_matches_stats);
	tcase_add_test(tc, killed_is_stale);
	tcase_add_test(tc, top_cleans_killed);
	suite_add_tcase(s, tc);

	tc = tcase_create("TopData");
	tcase_set_timeout(tc, TH_TIMEOUT);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, top_json_utf8);
	tcase_add_test(tc, top_frag_never_negative);
	tcase_add_test(tc, top_frag_spilled);
	tcase_add_test(tc, top_gpu_line_stable);
	tcase_add_test(tc, top_gone_keeps_columns);
	tcase_add_test(tc, top_many_entries);
	tcase_add_test(tc, top_sort_and_pid_options);
	suite_add_tcase(s, tc);

	tc = tcase_create("Reject");
	tcase_set_timeout(tc, TH_TIMEOUT);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, reject_bad_images);
	tcase_add_test(tc, newer_layout_read);
	tcase_add_test(tc, reject_files);
	tcase_add_test(tc, reject_noncanonical_names);
	tcase_add_test(tc, reject_foreign_owner);
	tcase_add_test(tc, stale_by_start_time);
	tcase_add_test(tc, corruption_flips);
	tcase_add_test(tc, corpus);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run_suite(shm_suite());
}
