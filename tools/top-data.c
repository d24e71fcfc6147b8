/* SPDX-License-Identifier: MIT */
/*
 * gmlake-top's data sources and the plain-text and JSON snapshots.
 *
 * shm: every GMLAKE_SHM_DIR/gmlake.PID.TOKEN segment, read with the
 * library's checking reader; a segment proven gone (its publisher's lock is
 * free: a pid proves nothing across PID namespaces) is shown as gone and,
 * when it belongs to our user, removed. The directory is anyone's: an entry
 * that is not a canonical name, not a regular file, not the expected
 * owner's or too large costs one fstatat at most and makes no row; refused
 * segments make at most TOP_MAX_BAD rows; rows are found by hash. nvml:
 * libnvidia-ml.so.1 loaded with dlopen (never linked), for each GPU's total
 * and used memory.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gmlake.h"
#include "json.h"
#include "top.h"

/* ---------------------------------------------------------------------- */
/* nvml                                                                   */

struct nvml_memory {
	unsigned long long total, free, used;
};

typedef int (*nvml_init_fn)(void);
typedef int (*nvml_count_fn)(unsigned *);
typedef int (*nvml_handle_fn)(unsigned, void **);
typedef int (*nvml_mem_fn)(void *, struct nvml_memory *);
typedef int (*nvml_name_fn)(void *, char *, unsigned);

static struct {
	void *lib;
	nvml_count_fn count;
	nvml_handle_fn handle;
	nvml_mem_fn mem;
	nvml_name_fn name;
} nvml;

/* Load NVML (.so.1, then .so); the reason it is unavailable in st. */
static void nvml_open(struct top_state *st)
{
	nvml_init_fn init;
	int ret;

	nvml.lib = dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!nvml.lib)
		nvml.lib = dlopen("libnvidia-ml.so", RTLD_NOW | RTLD_LOCAL);
	if (!nvml.lib) {
		snprintf(st->nvml_msg, sizeof(st->nvml_msg),
			 "NVML unavailable (libnvidia-ml.so.1 not loaded)");
		return;
	}
	init = (nvml_init_fn)dlsym(nvml.lib, "nvmlInit_v2");
	nvml.count = (nvml_count_fn)dlsym(nvml.lib, "nvmlDeviceGetCount_v2");
	nvml.handle = (nvml_handle_fn)dlsym(nvml.lib,
					    "nvmlDeviceGetHandleByIndex_v2");
	nvml.mem = (nvml_mem_fn)dlsym(nvml.lib, "nvmlDeviceGetMemoryInfo");
	nvml.name = (nvml_name_fn)dlsym(nvml.lib, "nvmlDeviceGetName");
	if (!init || !nvml.count || !nvml.handle || !nvml.mem) {
		snprintf(st->nvml_msg, sizeof(st->nvml_msg),
			 "NVML unavailable (symbols missing)");
		goto out_close;
	}
	ret = init();
	if (ret) {
		snprintf(st->nvml_msg, sizeof(st->nvml_msg),
			 "NVML unavailable (nvmlInit: error %d)", ret);
		goto out_close;
	}
	st->nvml_ok = true;
	return;
out_close:
	dlclose(nvml.lib);
	nvml.lib = NULL;
}

static void nvml_refresh(struct top_state *st)
{
	unsigned n = 0;

	st->ngpus = 0;
	if (!st->nvml_ok || nvml.count(&n))
		return;
	if (n > TOP_MAX_GPUS)
		n = TOP_MAX_GPUS;
	for (unsigned i = 0; i < n; i++) {
		struct top_gpu *g = &st->gpus[i];
		struct nvml_memory m;
		void *h;

		memset(g, 0, sizeof(*g));
		if (nvml.handle(i, &h) || nvml.mem(h, &m))
			continue;
		g->valid = true;
		g->total = m.total;
		g->used = m.used;
		if (!nvml.name || nvml.name(h, g->name, sizeof(g->name)))
			snprintf(g->name, sizeof(g->name), "GPU %u", i);
		g->name[sizeof(g->name) - 1] = '\0';
	}
	st->ngpus = n;
}

/* ---------------------------------------------------------------------- */
/* shm                                                                    */

static double mono_now(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int top_init(struct top_state *st, const char *dir)
{
	memset(st, 0, sizeof(*st));
	st->dir = dir ? dir : gmlake_shm_dir();
	st->expect_uid = geteuid() == 0 ? GMLAKE_SHM_ANY_UID :
					  (uint32_t)geteuid();
	st->sort_col = COL_RES;
	nvml_open(st);
	return 0;
}

void top_fini(struct top_state *st)
{
	free(st->rows);
	free(st->index);
	free(st->view);
	st->rows = NULL;
	st->index = NULL;
	st->view = NULL;
	st->nrows = st->cap = st->index_cap = st->nview = st->view_cap = 0;
	if (nvml.lib)
		dlclose(nvml.lib);
	nvml.lib = NULL;
}

static void user_name(uint32_t uid, char *buf, size_t len)
{
	struct passwd pw, *res = NULL;
	char tmp[1024];

	if (!getpwuid_r((uid_t)uid, &pw, tmp, sizeof(tmp), &res) && res)
		snprintf(buf, len, "%s", pw.pw_name);
	else
		snprintf(buf, len, "%u", (unsigned)uid);
}

/* ---- the row index: (token, ctx_id) -> row, open addressing ---- */

static size_t key_hash(uint64_t token, uint64_t ctx_id)
{
	uint64_t x = token ^ (ctx_id * 0x9e3779b97f4a7c15ull);

	x ^= x >> 33;
	x *= 0xff51afd7ed558ccdull;
	x ^= x >> 33;
	return (size_t)x;
}

static void index_put(struct top_state *st, size_t row)
{
	const struct top_row *r = &st->rows[row];
	size_t mask = st->index_cap - 1;
	size_t i = key_hash(r->token, r->s.ctx_id) & mask;

	while (st->index[i])
		i = (i + 1) & mask;
	st->index[i] = (uint32_t)(row + 1);
}

/* Index every row again, in a table of at least 2 * want slots. */
static int index_rebuild(struct top_state *st, size_t want)
{
	size_t cap = st->index_cap ? st->index_cap : 64;
	uint32_t *t;

	while (cap < 2 * want + 2)
		cap *= 2;
	if (cap != st->index_cap) {
		t = calloc(cap, sizeof(*t));
		if (!t)
			return -ENOMEM;
		free(st->index);
		st->index = t;
		st->index_cap = cap;
	} else {
		memset(st->index, 0, cap * sizeof(*st->index));
	}
	for (size_t i = 0; i < st->nrows; i++)
		index_put(st, i);
	return 0;
}

static struct top_row *row_find(struct top_state *st, uint64_t token,
				uint64_t ctx_id)
{
	size_t mask = st->index_cap - 1, i;
	struct top_row *r;

	if (!st->index_cap)
		return NULL;
	for (i = key_hash(token, ctx_id) & mask; st->index[i];
	     i = (i + 1) & mask) {
		r = &st->rows[st->index[i] - 1];
		if (r->token == token && r->s.ctx_id == ctx_id)
			return r;
	}
	return NULL;
}

/* The row of (token, ctx_id), made when new (pid as published). */
static struct top_row *row_get(struct top_state *st, uint64_t token, int pid,
			       uint64_t ctx_id)
{
	struct top_row *r = row_find(st, token, ctx_id);

	if (r)
		return r;
	if (st->nrows == st->cap) {
		size_t cap = st->cap ? st->cap * 2 : 16;
		struct top_row *grown = realloc(st->rows, cap * sizeof(*r));

		if (!grown)
			return NULL;
		st->rows = grown;
		st->cap = cap;
	}
	if (2 * (st->nrows + 1) + 2 > st->index_cap &&
	    index_rebuild(st, st->nrows + 1))
		return NULL;
	r = &st->rows[st->nrows];
	memset(r, 0, sizeof(*r));
	r->pid = pid;
	r->token = token;
	r->s.ctx_id = ctx_id;
	index_put(st, st->nrows++);
	return r;
}

static void push_history(struct top_row *r)
{
	r->hist_alloc[r->hist_head] = r->s.allocated_bytes;
	r->hist_res[r->hist_head] = r->s.reserved_bytes;
	r->hist_head = (r->hist_head + 1) % TOP_HISTORY;
	if (r->hist_len < TOP_HISTORY)
		r->hist_len++;
}

/* New figures for a live row: rates against the previous sample. */
static void row_update(struct top_state *st, struct top_row *r,
		       const struct gmlake_shm_slot *s)
{
	uint64_t offload = s->d2h_bytes + s->h2d_bytes;
	double dt = st->now - r->prev_t;

	r->rates_valid = r->prev_t > 0 && dt > 0 &&
			 s->map_calls >= r->prev_maps &&
			 offload >= r->prev_offload;
	if (r->rates_valid) {
		r->maps_per_s = (double)(s->map_calls - r->prev_maps) / dt;
		r->offload_bps = (double)(offload - r->prev_offload) / dt;
	}
	r->prev_t = st->now;
	r->prev_maps = s->map_calls;
	r->prev_offload = offload;
	r->s = *s;
	push_history(r);
}

/*
 * Remove a dead process's segment, only when it is our user's and the name
 * still holds the file whose lock was found free.
 */
static void remove_stale(struct top_row *r, uint32_t owner,
			 const struct gmlake_shm_snapshot *snap)
{
	struct stat sb;

	if (owner != (uint32_t)geteuid()) {
		snprintf(r->msg, sizeof(r->msg), "process gone; segment of "
			 "uid %u left in place", (unsigned)owner);
		return;
	}
	if (lstat(r->path, &sb) || (uint64_t)sb.st_dev != snap->file_dev ||
	    (uint64_t)sb.st_ino != snap->file_ino) {
		snprintf(r->msg, sizeof(r->msg), "process gone; segment "
			 "replaced meanwhile, left in place");
		return;
	}
	if (unlink(r->path) && errno != ENOENT) {
		snprintf(r->msg, sizeof(r->msg), "process gone; removing "
			 "segment: %s", strerror(errno));
		return;
	}
	r->removed = true;
	snprintf(r->msg, sizeof(r->msg), "process gone; segment removed");
}

static void mark_gone(struct top_row *r)
{
	if (r->state != TOP_GONE)
		r->gone_passes = 0;
	r->state = TOP_GONE;
	r->rates_valid = false;
}

static void scan_good(struct top_state *st, const char *path,
		      const struct gmlake_shm_snapshot *snap)
{
	bool stale = gmlake_shm_stale(snap);
	struct top_row *r = NULL, *o;

	for (uint32_t i = 0; i < snap->nslots; i++) {
		r = row_get(st, snap->token, snap->pid, snap->slots[i].ctx_id);
		if (!r)
			return;
		r->seen = true;
		r->start_time = snap->start_time;
		r->uid = snap->uid;
		user_name(r->uid, r->user, sizeof(r->user));
		snprintf(r->comm, sizeof(r->comm), "%s", snap->comm);
		snprintf(r->path, sizeof(r->path), "%s", path);
		r->msg[0] = '\0';
		r->state = TOP_LIVE;
		row_update(st, r, &snap->slots[i]);
		if (stale)
			mark_gone(r);
	}
	if (!stale)
		return;
	if (!r) {
		/* No rows to show it on. */
		struct top_row tmp = { 0 };

		snprintf(tmp.path, sizeof(tmp.path), "%s", path);
		remove_stale(&tmp, snap->uid, snap);
		return;
	}
	remove_stale(r, snap->uid, snap);
	for (uint32_t i = 0; i + 1 < snap->nslots; i++) {
		o = row_find(st, snap->token, snap->slots[i].ctx_id);
		if (!o)
			continue;
		o->removed = r->removed;
		memcpy(o->msg, r->msg, sizeof(r->msg));
	}
}

/*
 * A segment the reader refused: shown with the reason (TOP_MAX_BAD rows at
 * most; the others are counted as skipped). Removed only when ours and its
 * lock proves no publisher holds it.
 */
static void scan_bad(struct top_state *st, const char *path, uint64_t token,
		     int pid, const struct gmlake_shm_snapshot *snap)
{
	struct top_row *r = row_find(st, token, 0);
	struct stat sb;

	if (!r && st->nbroken >= TOP_MAX_BAD) {
		st->skipped++;
		return;
	}
	if (!r) {
		r = row_get(st, token, pid, 0);
		if (!r)
			return;
		st->nbroken++;
	}
	r->seen = true;
	r->state = TOP_BROKEN;
	snprintf(r->path, sizeof(r->path), "%s", path);
	snprintf(r->msg, sizeof(r->msg), "%s", gmlake_last_error());
	if (lstat(path, &sb))
		return;
	r->uid = (uint32_t)sb.st_uid;
	user_name(r->uid, r->user, sizeof(r->user));
	snprintf(r->comm, sizeof(r->comm), "?");
	if (S_ISREG(sb.st_mode) &&
	    (snap->flags & GMLAKE_SHM_SNAP_LOCK_CHECKED) &&
	    (snap->flags & GMLAKE_SHM_SNAP_UNLOCKED)) {
		mark_gone(r);
		remove_stale(r, r->uid, snap);
	}
}

/*
 * A canonical segment name, gmlake.PID.TOKEN, as the library makes and
 * checks it (no sign, no leading zero, 16 lowercase hex digits): anything
 * else in the directory is not looked at.
 */
static bool seg_name(const char *name, long *pid, uint64_t *token)
{
	const char *p = name + 7;
	uint64_t t = 0;
	long v = 0;
	int n = 0;

	if (strncmp(name, "gmlake.", 7) || *p < '1' || *p > '9')
		return false;
	for (; *p >= '0' && *p <= '9' && v <= 4194304; p++)
		v = v * 10 + (*p - '0');
	if (v > 4194304 || *p++ != '.')
		return false;
	for (; n < 17 && ((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'));
	     p++, n++)
		t = t << 4 | (uint64_t)(*p <= '9' ? *p - '0' : *p - 'a' + 10);
	if (*p || n != 16 || !t)
		return false;
	*pid = v;
	*token = t;
	return true;
}

/*
 * What the reader would refuse before reading, from the directory entry
 * and one fstatat: not a regular file (a symbolic link, say), another
 * owner than expected, too large. Such an entry makes no row.
 */
static bool entry_ok(const struct top_state *st, int dfd,
		     const struct dirent *de)
{
	struct stat sb;

	if (de->d_type != DT_REG && de->d_type != DT_UNKNOWN)
		return false;
	if (fstatat(dfd, de->d_name, &sb, AT_SYMLINK_NOFOLLOW))
		return false;
	if (!S_ISREG(sb.st_mode) || sb.st_size > GMLAKE_SHM_MAX_SIZE)
		return false;
	return st->expect_uid == GMLAKE_SHM_ANY_UID ||
	       (uint32_t)sb.st_uid == st->expect_uid;
}

static bool pending(const struct top_state *st, uint64_t token)
{
	for (unsigned i = 0; i < st->npending; i++)
		if (st->pending[i] == token)
			return true;
	return false;
}

static void scan_one(struct top_state *st, int dfd, const struct dirent *de)
{
	struct gmlake_shm_snapshot snap;
	char path[512];
	uint64_t token;
	long pid;
	int ret;

	if (!seg_name(de->d_name, &pid, &token))
		return;
	if (!entry_ok(st, dfd, de)) {
		st->skipped++;
		return;
	}
	if ((size_t)snprintf(path, sizeof(path), "%s/%s", st->dir,
			     de->d_name) >= sizeof(path))
		return;
	memset(&snap, 0, sizeof(snap));
	snap.version = GMLAKE_SHM_SNAPSHOT_VERSION;
	snap.size = sizeof(snap);
	ret = gmlake_shm_read(path, st->expect_uid, &snap);
	if (ret == -ENOENT || ret == -EACCES)
		return;		/* gone since readdir; another user's */
	if (ret == -EAGAIN && !(snap.flags & GMLAKE_SHM_SNAP_UNLOCKED)) {
		/* Being written: keep what was shown. */
		if (st->npending < TOP_MAX_PENDING)
			st->pending[st->npending++] = token;
		return;
	}
	if (ret)
		scan_bad(st, path, token, (int)pid, &snap);
	else
		scan_good(st, path, &snap);
}

/* Rows not seen: their segment went away (exit); dropped after a while. */
static void sweep(struct top_state *st)
{
	size_t out = 0;

	st->nbroken = 0;
	for (size_t i = 0; i < st->nrows; i++) {
		struct top_row *r = &st->rows[i];

		if (!r->seen && pending(st, r->token))
			r->seen = true;
		if (!r->seen && r->state == TOP_LIVE) {
			mark_gone(r);
			snprintf(r->msg, sizeof(r->msg), "exited");
		}
		if (r->state == TOP_GONE && ++r->gone_passes > TOP_GONE_KEEP)
			continue;
		if (!r->seen && r->state == TOP_BROKEN)
			continue;
		st->nbroken += r->state == TOP_BROKEN;
		if (out != i)
			st->rows[out] = *r;
		out++;
	}
	st->nrows = out;
}

int top_refresh(struct top_state *st)
{
	struct dirent *de;
	DIR *d;

	st->now = mono_now();
	nvml_refresh(st);
	for (size_t i = 0; i < st->nrows; i++)
		st->rows[i].seen = false;
	st->skipped = 0;
	st->npending = 0;
	d = opendir(st->dir);
	if (!d)
		return -errno;
	while ((de = readdir(d)))
		scan_one(st, dirfd(d), de);
	closedir(d);
	sweep(st);
	top_sort(st);
	return 0;
}

/* ---------------------------------------------------------------------- */
/* Columns, sorting and filtering                                         */

static const char *const col_names[COL_COUNT] = {
	"PID", "USER", "DEV", "ALLOC", "RES", "PEAK", "FRAG%", "STITCH",
	"MAP/s", "SPILL", "OFF/s", "COMMAND",
};

/* Names for --sort (the column names, lower case, and longer words). */
static const struct {
	const char *name;
	int col;
} sort_names[] = {
	{ "pid", COL_PID }, { "user", COL_USER }, { "dev", COL_DEV },
	{ "device", COL_DEV }, { "alloc", COL_ALLOC },
	{ "allocated", COL_ALLOC }, { "res", COL_RES },
	{ "reserved", COL_RES }, { "mem", COL_RES }, { "peak", COL_PEAK },
	{ "frag", COL_FRAG }, { "fragmentation", COL_FRAG },
	{ "stitch", COL_STITCH }, { "maps", COL_MAPS }, { "map/s", COL_MAPS },
	{ "spill", COL_SPILL }, { "spilled", COL_SPILL },
	{ "off/s", COL_BW }, { "offload", COL_BW }, { "command", COL_CMD },
	{ "cmd", COL_CMD }, { "frag%", COL_FRAG },
};

const char *top_col_name(int col)
{
	return col >= 0 && col < COL_COUNT ? col_names[col] : "?";
}

/* The column --sort=name means, or -EINVAL. */
int top_sort_key(const char *name)
{
	for (size_t i = 0; i < sizeof(sort_names) / sizeof(sort_names[0]); i++)
		if (!strcasecmp(name, sort_names[i].name))
			return sort_names[i].col;
	return -EINVAL;
}

/* --pid=PID[,PID...]: 0, or -EINVAL for a bad or too long list. */
int top_parse_pids(struct top_state *st, const char *list)
{
	const char *p = list;
	char *end;
	long v;

	st->npids = 0;
	do {
		errno = 0;
		v = strtol(p, &end, 10);
		if (errno || end == p || v < 1 || v > 4194304 ||
		    (*end && *end != ',') || st->npids == TOP_MAX_PIDS)
			return -EINVAL;
		st->pids[st->npids++] = (int)v;
		p = end + 1;
	} while (*end);
	return 0;
}

/*
 * FRAG%, the live view of fragmentation: 1 - resident/reserved bytes now,
 * in percent, never below 0. Resident is allocated less spilled blocks
 * (a spilled block is allocated but holds no device memory); with the
 * spilled chunks given back, allocated/reserved went to -400%. The replay
 * and the README use peaks instead: 1 - requested.peak/reserved.peak.
 */
double top_frag(const struct top_row *r, bool *valid)
{
	double f;

	*valid = r->state != TOP_BROKEN && r->s.reserved_bytes > 0;
	if (!*valid)
		return 0;
	f = 100.0 * (1.0 - (double)r->s.resident_bytes /
				   (double)r->s.reserved_bytes);
	return f > 0 ? f : 0;
}

static double col_value(const struct top_row *r, int col)
{
	bool v;

	switch (col) {
	case COL_PID: return r->pid;
	case COL_DEV: return r->s.device;
	case COL_ALLOC: return (double)r->s.allocated_bytes;
	case COL_RES: return (double)r->s.reserved_bytes;
	case COL_PEAK: return (double)r->s.reserved_peak;
	case COL_FRAG: return top_frag(r, &v);
	case COL_STITCH: return (double)r->s.stitched_live;
	case COL_MAPS: return r->rates_valid ? r->maps_per_s : -1;
	case COL_SPILL: return (double)r->s.spilled_bytes;
	case COL_BW: return r->rates_valid ? r->offload_bps : -1;
	}
	return 0;
}

static struct top_state *sort_st;

/* Text columns ascending, figures largest first; r reverses. */
static int row_cmp(const void *pa, const void *pb)
{
	const struct top_row *a = pa, *b = pb;
	int col = sort_st->sort_col, c;

	if (col == COL_USER)
		c = strcmp(a->user, b->user);
	else if (col == COL_CMD)
		c = strcmp(a->comm, b->comm);
	else if (col == COL_PID || col == COL_DEV)
		c = (col_value(a, col) > col_value(b, col)) -
		    (col_value(a, col) < col_value(b, col));
	else
		c = (col_value(a, col) < col_value(b, col)) -
		    (col_value(a, col) > col_value(b, col));
	if (!c)
		c = (a->pid > b->pid) - (a->pid < b->pid);
	if (!c)
		c = (a->token > b->token) - (a->token < b->token);
	if (!c)
		c = (a->s.ctx_id > b->s.ctx_id) - (a->s.ctx_id < b->s.ctx_id);
	return sort_st->sort_reverse ? -c : c;
}

/* --pid and the filter: the pid listed, or the text in pid or command. */
static bool row_shown(const struct top_state *st, const struct top_row *r)
{
	char pid[16];
	bool in = !st->npids;

	for (unsigned i = 0; i < st->npids && !in; i++)
		in = st->pids[i] == r->pid;
	if (!in)
		return false;
	if (!st->filter[0])
		return true;
	snprintf(pid, sizeof(pid), "%d", r->pid);
	return strstr(pid, st->filter) || strcasestr(r->comm, st->filter);
}

/* Sort the rows, index them again and list those the filter lets through. */
void top_sort(struct top_state *st)
{
	sort_st = st;
	if (st->nrows > 1)
		qsort(st->rows, st->nrows, sizeof(st->rows[0]), row_cmp);
	/* Out of memory: no index (row_get makes one again), never a stale
	   one pointing at moved rows. */
	if (index_rebuild(st, st->nrows)) {
		free(st->index);
		st->index = NULL;
		st->index_cap = 0;
	}
	if (st->view_cap < st->nrows) {
		size_t *v = realloc(st->view, st->nrows * sizeof(*v));

		if (!v) {
			st->nview = 0;
			return;
		}
		st->view = v;
		st->view_cap = st->nrows;
	}
	st->nview = 0;
	for (size_t i = 0; i < st->nrows; i++)
		if (row_shown(st, &st->rows[i]))
			st->view[st->nview++] = i;
}

/* ---------------------------------------------------------------------- */
/* Plain text and JSON                                                    */

void top_fmt_bytes(char *buf, size_t len, double v)
{
	static const char units[] = "BKMGTP";
	int u = 0;

	while (v >= 1024 && u < 5) {
		v /= 1024;
		u++;
	}
	if (u == 0)
		snprintf(buf, len, "%.0fB", v);
	else
		snprintf(buf, len, "%.*f%c", v < 10 ? 2 : v < 100 ? 1 : 0, v,
			 units[u]);
}

/* A count in at most 6 characters: 123456, then 1235K, 12.3M. */
static void fmt_count(char *buf, size_t len, double v)
{
	if (v < 999999.5)
		snprintf(buf, len, "%.0f", v);
	else if (v < 9999.5e3)
		snprintf(buf, len, "%.0fK", v / 1e3);
	else if (v < 999.5e6)
		snprintf(buf, len, "%.1fM", v / 1e6);
	else
		snprintf(buf, len, "%.1fG", v / 1e9);
}

/* The cells of one row, as both the screen and the batch text show them. */
void top_row_cells(const struct top_row *r, char cells[][TOP_CELL])
{
	size_t n = strlen(r->user);
	bool v;

	snprintf(cells[COL_PID], TOP_CELL, "%d", r->pid);
	/* a cut name ends in '+', as in top */
	if (n > (size_t)top_col_width[COL_USER])
		snprintf(cells[COL_USER], TOP_CELL, "%.*s+",
			 top_col_width[COL_USER] - 1, r->user);
	else
		snprintf(cells[COL_USER], TOP_CELL, "%s", r->user);
	snprintf(cells[COL_CMD], TOP_CELL, "%s%s", r->state == TOP_GONE ?
		 "[gone] " : r->state == TOP_BROKEN ? "[bad] " : "", r->comm);
	for (int c = COL_DEV; c < COL_CMD; c++)
		snprintf(cells[c], TOP_CELL, "-");
	if (r->state == TOP_BROKEN)
		return;
	snprintf(cells[COL_DEV], TOP_CELL, "%s%d",
		 r->s.backend == GMLAKE_BACKEND_EMU ? "e" : "", r->s.device);
	top_fmt_bytes(cells[COL_ALLOC], TOP_CELL, (double)r->s.allocated_bytes);
	top_fmt_bytes(cells[COL_RES], TOP_CELL, (double)r->s.reserved_bytes);
	top_fmt_bytes(cells[COL_PEAK], TOP_CELL, (double)r->s.reserved_peak);
	if (top_frag(r, &v), v)
		snprintf(cells[COL_FRAG], TOP_CELL, "%.1f", top_frag(r, &v));
	else
		snprintf(cells[COL_FRAG], TOP_CELL, "N/A");
	fmt_count(cells[COL_STITCH], TOP_CELL, (double)r->s.stitched_live);
	if (r->rates_valid)
		fmt_count(cells[COL_MAPS], TOP_CELL, r->maps_per_s);
	else
		snprintf(cells[COL_MAPS], TOP_CELL, "N/A");
	top_fmt_bytes(cells[COL_SPILL], TOP_CELL, (double)r->s.spilled_bytes);
	if (r->rates_valid)
		top_fmt_bytes(cells[COL_BW], TOP_CELL, r->offload_bps);
	else
		snprintf(cells[COL_BW], TOP_CELL, "N/A");
}

/* Byte cells are at most 5 wide (1023K, 9.99M); COMMAND has what is left. */
const int top_col_width[COL_COUNT] = { 7, 8, 4, 5, 5, 5, 5, 6, 6, 5, 5, 7 };

/*
 * One header line per GPU: NVML's figures, else what gmlake knows, one
 * line per (backend, device) in that order, whatever the rows' order.
 * Emulated devices are per context and may differ in size: the line gives
 * the range of totals.
 */
void top_gpu_lines(struct top_state *st, void (*line)(void *, const char *),
		   void *arg)
{
	char buf[256], a[32], b[32], c[32];

	for (unsigned i = 0; i < st->ngpus; i++) {
		struct top_gpu *g = &st->gpus[i];

		if (!g->valid) {
			snprintf(buf, sizeof(buf), "GPU %u: N/A", i);
		} else {
			top_fmt_bytes(a, sizeof(a), (double)g->used);
			top_fmt_bytes(b, sizeof(b), (double)g->total);
			snprintf(buf, sizeof(buf), "GPU %u %-24.24s used %s "
				 "of %s (%.0f%%)", i, g->name, a, b,
				 g->total ? 100.0 * g->used / g->total : 0.0);
		}
		line(arg, buf);
	}
	if (!st->nvml_ok)
		line(arg, st->nvml_msg);
	for (int be = GMLAKE_BACKEND_CUDA; be <= GMLAKE_BACKEND_EMU; be++) {
		if (st->nvml_ok && be == GMLAKE_BACKEND_CUDA)
			continue;
		for (int dev = -1;;) {
			int next = INT32_MAX;
			uint64_t lo = UINT64_MAX, hi = 0;
			int64_t res = 0;

			/* the next device after dev with live rows */
			for (size_t i = 0; i < st->nrows; i++) {
				const struct top_row *r = &st->rows[i];

				if (r->state == TOP_LIVE &&
				    r->s.backend == be && r->s.device > dev &&
				    r->s.device < next)
					next = r->s.device;
			}
			if (next == INT32_MAX)
				break;
			dev = next;
			for (size_t i = 0; i < st->nrows; i++) {
				const struct top_row *r = &st->rows[i];

				if (r->state != TOP_LIVE || r->s.backend != be ||
				    r->s.device != dev)
					continue;
				res += r->s.reserved_bytes;
				lo = r->s.device_total < lo ?
					     r->s.device_total : lo;
				hi = r->s.device_total > hi ?
					     r->s.device_total : hi;
			}
			top_fmt_bytes(a, sizeof(a), (double)res);
			top_fmt_bytes(b, sizeof(b), (double)lo);
			top_fmt_bytes(c, sizeof(c), (double)hi);
			snprintf(buf, sizeof(buf), "GPU %d (%s): total %s%s%s, "
				 "used N/A; gmlake reserved %s", dev,
				 be == GMLAKE_BACKEND_EMU ? "emulated" :
							    "no NVML",
				 lo == hi ? "" : b, lo == hi ? "" : "..", c, a);
			line(arg, buf);
		}
	}
}

static void text_line(void *arg, const char *s)
{
	fprintf(arg, "%s\n", s);
}

void top_print_text(struct top_state *st, FILE *f)
{
	char cells[COL_COUNT][TOP_CELL];
	time_t t = time(NULL);
	struct tm tm;
	char when[32];

	localtime_r(&t, &tm);
	strftime(when, sizeof(when), "%Y-%m-%d %H:%M:%S", &tm);
	fprintf(f, "gmlake-top %s - %s, %zu rows, segments in %s",
		PACKAGE_VERSION, when, st->nview, st->dir);
	if (st->skipped)
		fprintf(f, ", %llu entries skipped",
			(unsigned long long)st->skipped);
	fputc('\n', f);
	top_gpu_lines(st, text_line, f);
	for (int c = 0; c < COL_CMD; c++)
		fprintf(f, c == COL_USER ? "%-*s " : "%*s ", top_col_width[c],
			col_names[c]);
	fprintf(f, "%s\n", col_names[COL_CMD]);
	for (size_t k = 0; k < st->nview; k++) {
		const struct top_row *r = &st->rows[st->view[k]];

		top_row_cells(r, cells);
		for (int c = 0; c < COL_CMD; c++)
			fprintf(f, c == COL_USER ? "%-*s " : "%*s ",
				top_col_width[c], cells[c]);
		fputs(cells[COL_CMD], f);
		if (r->msg[0])
			fprintf(f, "  %s", r->msg);
		fputc('\n', f);
	}
	fputc('\n', f);
}

static void json_num(FILE *f, const char *name, bool valid, int prec,
		     double v)
{
	if (valid)
		fprintf(f, ",\"%s\":%.*f", name, prec, v);
	else
		fprintf(f, ",\"%s\":null", name);
}

static const char *engine_name(int engine)
{
	switch (engine) {
	case GMLAKE_OFFLOAD_ENGINE_URING:
		return "io_uring";
	case GMLAKE_OFFLOAD_ENGINE_THREAD:
		return "thread";
	default:
		return "none";
	}
}

static void json_row(FILE *f, const struct top_row *r)
{
	static const char *const states[] = { "live", "gone", "bad" };
	const struct gmlake_shm_slot *s = &r->s;
	bool ok = r->state != TOP_BROKEN, fv;
	double frag = top_frag(r, &fv);

	fprintf(f, "{\"pid\":%d,\"uid\":%u,\"user\":", r->pid, r->uid);
	gml_json_str(f, r->user);
	fprintf(f, ",\"command\":");
	gml_json_str(f, r->comm);
	fprintf(f, ",\"state\":\"%s\",\"removed\":%s,\"message\":",
		states[r->state], r->removed ? "true" : "false");
	if (r->msg[0])
		gml_json_str(f, r->msg);
	else
		fprintf(f, "null");
	fprintf(f, ",\"path\":");
	gml_json_str(f, r->path);
	if (!ok) {
		fprintf(f, "}");
		return;
	}
	fprintf(f, ",\"device\":%d,\"backend\":\"%s\",\"ctx_id\":%llu",
		s->device, s->backend == GMLAKE_BACKEND_EMU ? "emu" : "cuda",
		(unsigned long long)s->ctx_id);
#define U(name) fprintf(f, ",\"" #name "\":%llu", (unsigned long long)s->name);
#define I(name) fprintf(f, ",\"" #name "\":%lld", (long long)s->name);
	U(device_total) U(chunk_size)
	I(requested_bytes) I(requested_peak) I(allocated_bytes)
	I(allocated_peak) I(resident_bytes) I(reserved_bytes)
	I(reserved_peak) I(mapped_bytes)
	I(active_blocks) I(stitched_live) I(stitched_cached) I(chunks)
	I(spilled_bytes) I(spilled_blocks) I(host_bytes) I(host_pinned)
	U(allocs) U(frees) U(fits) U(stitch_reuses) U(stitches)
	U(stitch_repairs) U(grows) U(evictions) U(releases) U(ooms)
	U(spills) U(fetches) U(offload_failures) U(d2h_bytes) U(d2h_ns)
	U(h2d_bytes) U(h2d_ns) U(map_calls) U(map_ns) U(unmap_calls)
	U(create_calls) U(release_calls) U(set_access_calls)
	U(call_failures)
#undef U
#undef I
	fprintf(f, ",\"offload_engine\":\"%s\"", engine_name(s->offload_engine));
	json_num(f, "fragmentation_pct", fv, 2, frag);
	json_num(f, "maps_per_s", r->rates_valid, 3, r->maps_per_s);
	json_num(f, "offload_bytes_per_s", r->rates_valid, 3, r->offload_bps);
	json_num(f, "d2h_bytes_per_s", s->d2h_ns > 0, 3,
		 s->d2h_ns ? s->d2h_bytes * 1e9 / s->d2h_ns : 0);
	json_num(f, "h2d_bytes_per_s", s->h2d_ns > 0, 3,
		 s->h2d_ns ? s->h2d_bytes * 1e9 / s->h2d_ns : 0);
	fprintf(f, "}");
}

void top_print_json(struct top_state *st, FILE *f)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	fprintf(f, "{\"version\":\"%s\",\"time\":%.3f,\"dir\":",
		PACKAGE_VERSION, ts.tv_sec + ts.tv_nsec / 1e9);
	gml_json_str(f, st->dir);
	fprintf(f, ",\"sort\":\"%s\",\"reverse\":%s,\"skipped\":%llu",
		col_names[st->sort_col], st->sort_reverse ? "true" : "false",
		(unsigned long long)st->skipped);
	fprintf(f, ",\"nvml\":{\"available\":%s,\"message\":",
		st->nvml_ok ? "true" : "false");
	if (st->nvml_ok)
		fprintf(f, "null");
	else
		gml_json_str(f, st->nvml_msg);
	fprintf(f, "},\"gpus\":[");
	for (unsigned i = 0; i < st->ngpus; i++) {
		struct top_gpu *g = &st->gpus[i];

		fprintf(f, "%s{\"index\":%u,\"name\":", i ? "," : "", i);
		gml_json_str(f, g->valid ? g->name : "");
		if (g->valid)
			fprintf(f, ",\"total\":%llu,\"used\":%llu}",
				(unsigned long long)g->total,
				(unsigned long long)g->used);
		else
			fprintf(f, ",\"total\":null,\"used\":null}");
	}
	fprintf(f, "],\"processes\":[");
	for (size_t k = 0; k < st->nview; k++) {
		if (k)
			fputc(',', f);
		json_row(f, &st->rows[st->view[k]]);
	}
	fprintf(f, "]}\n");
}
