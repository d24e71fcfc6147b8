/* SPDX-License-Identifier: MIT */
/*
 * gmlake-top's data layer, apart from the drawing: the "shm" source
 * (gmlake segments, one row per process and context) and the "nvml" source
 * (each GPU's memory, when libnvidia-ml.so.1 loads), merged for display.
 * A value that could not be had carries no validity bit and shows as N/A.
 */
#ifndef GML_TOP_H
#define GML_TOP_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#include "gmlake-shm.h"

#define TOP_HISTORY 512		/* samples kept per row */
#define TOP_MAX_GPUS 64
#define TOP_GONE_KEEP 3		/* refreshes a gone process stays shown */
#define TOP_MAX_BAD 16		/* refused segments shown; the rest counted */
#define TOP_MAX_PENDING 64	/* segments being written, kept as they were */
#define TOP_MAX_PIDS 64		/* --pid list */
#define TOP_CELL 48

enum top_row_state {
	TOP_LIVE = 0,
	TOP_GONE = 1,		/* publisher dead; segment removed if ours */
	TOP_BROKEN = 2,		/* segment refused by the reader */
};

/*
 * Columns, in display order; also the sort keys. COMMAND comes last and
 * takes what is left of the line, as in top and htop, so the figures stay
 * in place whatever the name or mark ([gone], [bad]) and fit 80 columns.
 */
enum top_col {
	COL_PID, COL_USER, COL_DEV, COL_ALLOC, COL_RES, COL_PEAK, COL_FRAG,
	COL_STITCH, COL_MAPS, COL_SPILL, COL_BW, COL_CMD, COL_COUNT
};

struct top_row {
	int pid;			/* as published (its own namespace) */
	uint64_t token;			/* the segment's: rows are per
					   (token, ctx_id) */
	uint32_t uid;
	char user[33];
	char comm[GMLAKE_SHM_COMM_LEN];
	char path[512];
	enum top_row_state state;
	char msg[160];			/* why broken, or what was removed */
	bool removed;			/* a stale segment deleted */
	int gone_passes;
	uint64_t start_time;
	struct gmlake_shm_slot s;	/* zero when broken */
	bool rates_valid;		/* a previous sample exists */
	double maps_per_s;
	double offload_bps;		/* d2h + h2d bytes per second */
	double prev_t;
	uint64_t prev_maps, prev_offload;
	int64_t hist_alloc[TOP_HISTORY];
	int64_t hist_res[TOP_HISTORY];
	unsigned hist_len, hist_head;	/* ring: head is the next write */
	bool seen;			/* mark of the current scan */
};

struct top_gpu {
	bool valid;			/* NVML answered for it */
	char name[96];
	uint64_t total, used;
};

struct top_state {
	const char *dir;
	uint32_t expect_uid;		/* GMLAKE_SHM_ANY_UID as root */
	struct top_row *rows;
	size_t nrows, cap;
	uint32_t *index;		/* (token, ctx_id) -> row + 1 */
	size_t index_cap;		/* a power of two, > 2 * nrows */
	size_t *view;			/* rows shown, in order (filter) */
	size_t nview, view_cap;
	size_t nbroken;			/* TOP_BROKEN rows */
	uint64_t skipped;		/* entries refused unread, last scan */
	uint64_t pending[TOP_MAX_PENDING];
	unsigned npending;
	bool nvml_ok;
	char nvml_msg[160];
	unsigned ngpus;
	struct top_gpu gpus[TOP_MAX_GPUS];
	double now;			/* seconds, CLOCK_MONOTONIC */
	int sort_col;
	bool sort_reverse;
	int pids[TOP_MAX_PIDS];		/* --pid: only these (none: all) */
	unsigned npids;
	char filter[64];		/* pid or command substring */
};

/* top-data.c */
int top_init(struct top_state *st, const char *dir);
void top_fini(struct top_state *st);
int top_refresh(struct top_state *st);
void top_sort(struct top_state *st);
int top_sort_key(const char *name);
int top_parse_pids(struct top_state *st, const char *list);
double top_frag(const struct top_row *r, bool *valid);
const char *top_col_name(int col);
void top_fmt_bytes(char *buf, size_t len, double v);
void top_row_cells(const struct top_row *r, char cells[][TOP_CELL]);
extern const int top_col_width[COL_COUNT];
void top_gpu_lines(struct top_state *st, void (*line)(void *, const char *),
		   void *arg);
void top_print_text(struct top_state *st, FILE *f);
void top_print_json(struct top_state *st, FILE *f);

/* top-ui.c */
int top_ui_run(struct top_state *st, double delay);

#endif
