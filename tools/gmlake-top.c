/* SPDX-License-Identifier: MIT */
/*
 * gmlake-top: shows the GPU memory of every process using libgmlake, from
 * the segments they publish (see gmlake-shm.h), like top or nvtop; or, in
 * batch mode, prints plain-text or JSON snapshots for scripts.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gmlake.h"
#include "top.h"

static void usage(FILE *f)
{
	fprintf(f,
"usage: gmlake-top [options]\n"
"Show the GPU memory of the processes that use libgmlake.\n"
"\n"
"  -d, --delay=SECONDS     refresh interval (default 1.0)\n"
"  -b, --batch             print snapshots as text instead of the screen\n"
"  -n, --iterations=COUNT  snapshots to print in batch mode (default: no end)\n"
"  -j, --json              batch mode, one JSON document per snapshot and line\n"
"  -D, --dir=DIR           read segments from DIR (default: GMLAKE_SHM_DIR,\n"
"                          else /dev/shm)\n"
"  -o, --sort=COLUMN       sort by COLUMN: pid, user, dev, alloc, res (mem),\n"
"                          peak, frag, stitch, maps, spill, offload, command\n"
"                          (default res; figures largest first)\n"
"  -r, --reverse           reverse the sort order\n"
"  -p, --pid=PID[,PID...]  show only these processes\n"
"  -h, --help              this help\n"
"  -V, --version           version\n");
}

static int parse_delay(const char *s, double *out)
{
	char *end;
	double v;

	errno = 0;
	v = strtod(s, &end);
	if (errno || *end || !(v >= 0.05) || v > 86400)
		return -EINVAL;
	*out = v;
	return 0;
}

static void sleep_s(double s)
{
	struct timespec ts = { (time_t)s, (long)((s - (time_t)s) * 1e9) };

	while (nanosleep(&ts, &ts) && errno == EINTR)
		;
}

static int batch(struct top_state *st, long count, double delay, bool json)
{
	for (long i = 0; count < 0 || i < count; i++) {
		int ret = top_refresh(st);

		if (ret) {
			fprintf(stderr, "gmlake-top: %s: %s\n", st->dir,
				strerror(-ret));
			return 1;
		}
		if (json)
			top_print_json(st, stdout);
		else
			top_print_text(st, stdout);
		if (fflush(stdout) == EOF)
			return 1;
		if (count < 0 || i + 1 < count)
			sleep_s(delay);
	}
	return 0;
}

int main(int argc, char **argv)
{
	static const struct option longopts[] = {
		{ "delay", required_argument, NULL, 'd' },
		{ "batch", no_argument, NULL, 'b' },
		{ "iterations", required_argument, NULL, 'n' },
		{ "json", no_argument, NULL, 'j' },
		{ "dir", required_argument, NULL, 'D' },
		{ "sort", required_argument, NULL, 'o' },
		{ "sort-key", required_argument, NULL, 'o' },
		{ "reverse", no_argument, NULL, 'r' },
		{ "pid", required_argument, NULL, 'p' },
		{ "help", no_argument, NULL, 'h' },
		{ "version", no_argument, NULL, 'V' },
		{ NULL, 0, NULL, 0 },
	};
	bool is_batch = false, json = false, reverse = false;
	const char *dir = NULL, *pids = NULL;
	int sort_col = COL_RES;
	struct top_state st;
	double delay = 1.0;
	long count = -1;
	char *end;
	int c, ret;

	while ((c = getopt_long(argc, argv, "d:bn:jD:o:rp:hV", longopts, NULL)) !=
	       -1) {
		switch (c) {
		case 'd':
			if (parse_delay(optarg, &delay)) {
				fprintf(stderr, "gmlake-top: -d %s: seconds "
					"from 0.05 to 86400 expected\n",
					optarg);
				return 2;
			}
			break;
		case 'b':
			is_batch = true;
			break;
		case 'n':
			errno = 0;
			count = strtol(optarg, &end, 10);
			if (errno || *end || count < 1) {
				fprintf(stderr, "gmlake-top: -n %s: a count "
					"of 1 or more expected\n", optarg);
				return 2;
			}
			break;
		case 'j':
			json = is_batch = true;
			break;
		case 'D':
			dir = optarg;
			break;
		case 'o':
			sort_col = top_sort_key(optarg);
			if (sort_col < 0) {
				fprintf(stderr, "gmlake-top: --sort %s: one "
					"of pid, user, dev, alloc, res, peak, "
					"frag, stitch, maps, spill, offload, "
					"command expected\n", optarg);
				return 2;
			}
			break;
		case 'r':
			reverse = true;
			break;
		case 'p':
			pids = optarg;
			break;
		case 'h':
			usage(stdout);
			return 0;
		case 'V':
			printf("gmlake-top %s (libgmlake %d.%d)\n",
			       PACKAGE_VERSION, gmlake_version_major(),
			       gmlake_version_minor());
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind < argc) {
		fprintf(stderr, "gmlake-top: unexpected argument %s\n",
			argv[optind]);
		return 2;
	}
	ret = top_init(&st, dir);
	if (ret) {
		fprintf(stderr, "gmlake-top: %s\n", strerror(-ret));
		return 1;
	}
	st.sort_col = sort_col;
	st.sort_reverse = reverse;
	if (pids && top_parse_pids(&st, pids)) {
		fprintf(stderr, "gmlake-top: --pid %s: pids from 1 to 4194304, "
			"separated by commas (%d at most), expected\n", pids,
			TOP_MAX_PIDS);
		top_fini(&st);
		return 2;
	}
	if (is_batch) {
		ret = batch(&st, count, delay, json);
	} else if (!isatty(STDIN_FILENO) || !isatty(STDOUT_FILENO)) {
		fprintf(stderr, "gmlake-top: not a terminal; use -b or "
			"--json for snapshots\n");
		ret = 2;
	} else {
		ret = top_ui_run(&st, delay) ? 1 : 0;
	}
	top_fini(&st);
	return ret;
}
