/* SPDX-License-Identifier: MIT */
/*
 * shm_workload: a process that allocates and frees a known pattern through
 * the public API, then checks that its published segment says the same as
 * gmlake_stats_get(). With a number of seconds it then stays alive that
 * long (printing "ready PID" on stdout first), for the tests that watch a
 * live process with gmlake-top; with none it exits (a test of its own).
 * "shm_workload SECONDS wave" also grows and shrinks a block of 0 to 60
 * MiB while it waits, so gmlake-top's history chart has a shape.
 *
 * Pattern: 8 blocks of 3, 5, 7, ... MiB, then every other one freed.
 * Exit: 0 pass, 77 no device, 1 failure.
 */
#include <dirent.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gmlake.h"
#include "gmlake-shm.h"

#define MiB ((size_t)1 << 20)
#define NBLOCKS 8

static int fail(const char *what, int ret)
{
	fprintf(stderr, "shm_workload: %s: %d (%s)\n", what, ret,
		gmlake_last_error());
	return 1;
}

/* This process's segment, gmlake.PID.TOKEN: 0, or -ENOENT. */
static int find_segment(char *path, size_t len)
{
	const char *dir = gmlake_shm_dir();
	char prefix[32];
	struct dirent *de;
	int ret = -ENOENT;
	DIR *d = opendir(dir);

	if (!d)
		return -errno;
	snprintf(prefix, sizeof(prefix), "gmlake.%d.", (int)getpid());
	while (ret && (de = readdir(d)))
		if (!strncmp(de->d_name, prefix, strlen(prefix)) &&
		    (size_t)snprintf(path, len, "%s/%s", dir, de->d_name) < len)
			ret = 0;
	closedir(d);
	return ret;
}

/* Wait until the segment shows allocs/frees as the process counts them. */
static int check_published(gmlake_ctx *ctx)
{
	struct gmlake_shm_snapshot snap;
	struct gmlake_stats st;
	char path[4096];
	int ret = -EAGAIN;

	if ((ret = find_segment(path, sizeof(path))))
		return fail("no segment of this process", ret);
	memset(&st, 0, sizeof(st));
	st.version = GMLAKE_STATS_VERSION;
	st.size = sizeof(st);
	if ((ret = gmlake_stats_get(ctx, &st)))
		return fail("gmlake_stats_get", ret);
	for (int i = 0; i < 500; i++) {
		struct timespec ts = { 0, 10000000 };

		memset(&snap, 0, sizeof(snap));
		snap.version = GMLAKE_SHM_SNAPSHOT_VERSION;
		snap.size = sizeof(snap);
		ret = gmlake_shm_read(path, (uint32_t)geteuid(), &snap);
		if (!ret && snap.nslots == 1 &&
		    snap.slots[0].allocs == st.allocs &&
		    snap.slots[0].frees == st.frees)
			break;
		nanosleep(&ts, NULL);
	}
	if (ret)
		return fail(path, ret);
	if (snap.nslots != 1 || snap.pid != getpid() ||
	    snap.slots[0].allocated_bytes != st.allocated_bytes.current ||
	    snap.slots[0].reserved_bytes != st.reserved_bytes.current ||
	    snap.slots[0].reserved_peak != st.reserved_bytes.peak ||
	    snap.slots[0].map_calls != st.calls[GMLAKE_CALL_mem_map]) {
		fprintf(stderr, "shm_workload: the segment disagrees with "
			"gmlake_stats_get\n");
		return 1;
	}
	return 0;
}

int main(int argc, char **argv)
{
	struct gmlake_config cfg;
	void *p[NBLOCKS] = { NULL };
	gmlake_ctx *ctx = NULL;
	int hold = argc > 1 ? atoi(argv[1]) : 0;
	int ret;

	if ((ret = gmlake_config_init(&cfg)))
		return fail("gmlake_config_init", ret);
	cfg.backend = GMLAKE_BACKEND_EMU;
	cfg.emu_capacity = 1024 * MiB;
	cfg.publish = true;
	ret = gmlake_ctx_init(&ctx, &cfg);
	if (ret == -ENODEV || ret == -EOPNOTSUPP)
		return 77;
	if (ret)
		return fail("gmlake_ctx_init", ret);
	for (int i = 0; i < NBLOCKS; i++)
		if ((ret = gmlake_alloc(ctx, &p[i], (size_t)(3 + 2 * i) * MiB,
					NULL)))
			return fail("gmlake_alloc", ret);
	for (int i = 0; i < NBLOCKS; i += 2)
		if ((ret = gmlake_free(ctx, p[i])))
			return fail("gmlake_free", ret);
	if (check_published(ctx))
		return 1;
	if (hold > 0) {
		printf("ready %d\n", (int)getpid());
		fflush(stdout);
		bool wave = argc > 2 && !strcmp(argv[2], "wave");
		void *w = NULL;

		for (int i = 0; i < hold * 10; i++) {
			struct timespec ts = { 0, 100000000 };
			size_t mib = (size_t)(i % 20 < 10 ? i % 20 : 20 - i % 20);

			if (wave && (ret = gmlake_free(ctx, w)))
				return fail("gmlake_free", ret);
			w = NULL;
			if (wave && mib && (ret = gmlake_alloc(ctx, &w,
							       6 * mib * MiB,
							       NULL)))
				return fail("gmlake_alloc", ret);
			nanosleep(&ts, NULL);
		}
	}
	ret = gmlake_ctx_destroy(ctx, true);
	return ret ? fail("gmlake_ctx_destroy", ret) : 0;
}
