/* SPDX-License-Identifier: MIT */
/*
 * Helpers shared by the unit tests (check_alloc, check_stream, check_fault,
 * check_options). Header only: every function is static and may go unused.
 *
 * - th_probe(): find out in a throwaway child whether the backend named by
 *   GMLAKE_BACKEND opens (77 when there is no GPU), so main never touches
 *   CUDA itself (CUDA state does not survive fork()).
 * - th_ctx()/th_ctx_cfg(): a context for that backend, with a given capacity
 *   when the backend is the emulated device; th_config() the environment's
 *   settings but for the growth handle (TH_GROW_HANDLE).
 * - th_fill()/th_verify(): write and check a per-block pattern through
 *   gmlake_memcpy_htod/dtoh, so the same tests run on a real GPU;
 *   th_alloc_filled()/th_verify_free() pair them with th_alloc/th_free.
 * - TH_OK()/TH_ERR()/th_check(): assert a result and then that the
 *   allocator's invariant checker (gml_ctx_check) still holds.
 */
#ifndef GML_TEST_HELPERS_H
#define GML_TEST_HELPERS_H

#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gmlake.h"
#include "ctx.h"
#include "drv.h"
#include "sanitized.h"

#define TH_UNUSED __attribute__((unused))

#define TH_KiB ((size_t)1 << 10)
#define TH_MiB ((size_t)1 << 20)
#define TH_GiB ((size_t)1 << 30)
#define TH_CHUNK (2 * TH_MiB)	/* the emulated device's default granularity */

/* Generous per-case limit; each case is meant to take well under 5 s. */
#define TH_TIMEOUT 60

/* ---------------------------------------------------------------------- */
/* A deterministic PRNG (splitmix64): the same seed, the same workload.   */

struct th_rng {
	uint64_t s;
};

static inline uint64_t th_rand(struct th_rng *r)
{
	uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

/* Uniform in [lo, hi]. */
static inline uint64_t th_range(struct th_rng *r, uint64_t lo, uint64_t hi)
{
	return lo + th_rand(r) % (hi - lo + 1);
}

/* ---------------------------------------------------------------------- */
/* Backend, probe, contexts.                                              */

/* The backend gmlake_config_init() picks from the environment. */
static TH_UNUSED int th_env_backend(void)
{
	struct gmlake_config cfg;

	if (gmlake_config_init(&cfg))
		return -1;
	return cfg.backend;
}

static TH_UNUSED bool th_env_is_emu(void)
{
	return th_env_backend() == GMLAKE_BACKEND_EMU;
}

/*
 * Open and close a context for the environment's backend in a child
 * process. 0: it works; 77: no device (-ENODEV) or no virtual memory
 * management (-EOPNOTSUPP); 99: anything else.
 */
static TH_UNUSED int th_probe(void)
{
	int status;
	pid_t pid;

	fflush(NULL);
	pid = fork();
	if (pid < 0)
		return 99;
	if (pid == 0) {
		gmlake_ctx *ctx = NULL;
		int ret = gmlake_ctx_init(&ctx, NULL);

		if (ret == -ENODEV || ret == -EOPNOTSUPP) {
			fprintf(stderr, "no device for the backend: %s\n",
				gmlake_last_error());
			_exit(77);
		}
		if (ret) {
			fprintf(stderr, "gmlake_ctx_init: %d (%s)\n", ret,
				gmlake_last_error());
			_exit(99);
		}
		_exit(gmlake_ctx_destroy(ctx, false) ? 99 : 0);
	}
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
		return 99;
	return WEXITSTATUS(status);
}

/* Run a suite the standard way; the exit status of main. */
static TH_UNUSED int th_run_suite(Suite *s)
{
	SRunner *sr = srunner_create(s);
	int failed;

	srunner_run_all(sr, CK_ENV);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

/* A test case with the usual timeout; tagged gpu on the cuda backend. */
static TH_UNUSED TCase *th_tcase(Suite *s, const char *name)
{
	TCase *tc = tcase_create(name);

	tcase_set_timeout(tc, TH_TIMEOUT);
	if (!th_env_is_emu())
		tcase_set_tags(tc, "gpu");
	suite_add_tcase(s, tc);
	return tc;
}

static TH_UNUSED gmlake_ctx *th_ctx_cfg(const struct gmlake_config *cfg)
{
	gmlake_ctx *ctx = NULL;
	int ret = gmlake_ctx_init(&ctx, cfg);

	ck_assert_msg(ret == 0, "gmlake_ctx_init: %d (%s)", ret,
		      gmlake_last_error());
	ck_assert_ptr_nonnull(ctx);
	return ctx;
}

/*
 * The growth handle the tests' expectations are written for (driver call
 * counts, out-of-memory cases on small emulated devices, IPC pieces):
 * 20 MiB, whatever the library's default or GMLAKE_GROW_HANDLE says. A
 * test that means another size sets cfg.grow_handle itself.
 */
#define TH_GROW_HANDLE (20 * TH_MiB)

/* The environment's configuration with the tests' growth handle; 0 or
 * gmlake_config_init()'s error, for children that cannot assert. */
static TH_UNUSED int th_config_init(struct gmlake_config *cfg)
{
	int ret = gmlake_config_init(cfg);

	cfg->grow_handle = TH_GROW_HANDLE;
	return ret;
}

/* th_config_init(), asserted, with the emulated capacity set. */
static TH_UNUSED void th_config(struct gmlake_config *cfg, size_t capacity)
{
	ck_assert_int_eq(th_config_init(cfg), 0);
	if (capacity)
		cfg->emu_capacity = capacity;
}

/* A context on the environment's backend; capacity 0 keeps the default. */
static TH_UNUSED gmlake_ctx *th_ctx(size_t capacity)
{
	struct gmlake_config cfg;

	th_config(&cfg, capacity);
	return th_ctx_cfg(&cfg);
}

static TH_UNUSED struct gml_dev *th_dev(gmlake_ctx *ctx)
{
	struct gml_dev *dev = gml_ctx_dev(ctx);

	ck_assert_ptr_nonnull(dev);
	return dev;
}

static TH_UNUSED bool th_is_emu(gmlake_ctx *ctx)
{
	return gml_dev_is_emu(th_dev(ctx));
}

static TH_UNUSED void th_emu_info(gmlake_ctx *ctx, struct gml_emu_info *info)
{
	memset(info, 0, sizeof(*info));
	ck_assert_msg(th_is_emu(ctx), "emulated device expected");
	ck_assert_int_eq(gml_emu_info(th_dev(ctx)->priv, info), 0);
}

static TH_UNUSED void th_hold(gmlake_ctx *ctx, gmlake_stream_t s, bool hold)
{
	int ret = gml_emu_stream_hold(th_dev(ctx)->priv, s, hold);

	ck_assert_msg(ret == 0, "gml_emu_stream_hold: %d", ret);
}

static TH_UNUSED void th_stats(gmlake_ctx *ctx, struct gmlake_stats *st)
{
	int ret;

	memset(st, 0, sizeof(*st));
	st->version = GMLAKE_STATS_VERSION;
	st->size = sizeof(*st);
	ret = gmlake_stats_get(ctx, st);
	ck_assert_msg(ret == 0, "gmlake_stats_get: %d (%s)", ret,
		      gmlake_last_error());
}

static TH_UNUSED void th_destroy(gmlake_ctx *ctx)
{
	int ret = gmlake_ctx_destroy(ctx, false);

	ck_assert_msg(ret == 0, "gmlake_ctx_destroy: %d (%s)", ret,
		      gmlake_last_error());
}

static TH_UNUSED gmlake_stream_t th_stream(gmlake_ctx *ctx)
{
	gmlake_stream_t s = NULL;
	int ret = gmlake_stream_create(ctx, &s);

	ck_assert_msg(ret == 0, "gmlake_stream_create: %d (%s)", ret,
		      gmlake_last_error());
	return s;
}

static TH_UNUSED void th_sync(gmlake_ctx *ctx, gmlake_stream_t s)
{
	int ret = gmlake_stream_synchronize(ctx, s);

	ck_assert_msg(ret == 0, "gmlake_stream_synchronize: %d (%s)", ret,
		      gmlake_last_error());
}

/* ---------------------------------------------------------------------- */
/* The invariant checker after every operation.                           */

#define th_check(ctx)							\
	do {								\
		int th_chk_ = gml_ctx_check(ctx);			\
		ck_assert_msg(th_chk_ == 0, "gml_ctx_check: %d (%s)",	\
			      th_chk_, gmlake_last_error());		\
	} while (0)

/* expr must return 0; then the invariants must hold. */
#define TH_OK(ctx, expr)						\
	do {								\
		int th_rc_ = (expr);					\
		ck_assert_msg(th_rc_ == 0, "%s = %d (%s)", #expr,	\
			      th_rc_, gmlake_last_error());		\
		th_check(ctx);						\
	} while (0)

/* expr must return err (a negative errno); then the invariants hold. */
#define TH_ERR(ctx, expr, err)						\
	do {								\
		int th_rc_ = (expr);					\
		ck_assert_msg(th_rc_ == (err), "%s = %d, expected %s",	\
			      #expr, th_rc_, #err);			\
		th_check(ctx);						\
	} while (0)

/* ---------------------------------------------------------------------- */
/* Patterns: word i of a block with seed s; distinct seeds, distinct data. */

static inline uint64_t th_word(uint64_t seed, size_t i)
{
	uint64_t z = (seed + 1) * 0x9e3779b97f4a7c15ull + i;

	return (z ^ (z >> 29)) * 0xbf58476d1ce4e5b9ull;
}

static TH_UNUSED void th_pattern(void *buf, size_t size, uint64_t seed)
{
	uint64_t *w = buf;
	size_t n = size / 8, i;

	for (i = 0; i < n; i++)
		w[i] = th_word(seed, i);
	if (size % 8) {
		uint64_t last = th_word(seed, n);

		memcpy((char *)buf + n * 8, &last, size % 8);
	}
}

/* Offset of the first byte that differs from the pattern, or SIZE_MAX. */
static TH_UNUSED size_t th_pattern_diff(const void *buf, size_t size,
					uint64_t seed)
{
	const uint64_t *w = buf;
	size_t n = size / 8, i;

	for (i = 0; i < n; i++)
		if (w[i] != th_word(seed, i))
			return i * 8;
	if (size % 8) {
		uint64_t last = th_word(seed, n);

		if (memcmp((const char *)buf + n * 8, &last, size % 8))
			return n * 8;
	}
	return SIZE_MAX;
}

/*
 * Write the pattern into the device block [p, p+size) on stream s and wait
 * for it. 0 or a negative errno (no assertions: usable from threads).
 */
static TH_UNUSED int th_fill(gmlake_ctx *ctx, void *p, size_t size,
			     uint64_t seed, gmlake_stream_t s)
{
	void *buf = malloc(size ? size : 1);
	int ret;

	if (!buf)
		return -ENOMEM;
	th_pattern(buf, size, seed);
	ret = gmlake_memcpy_htod(ctx, p, buf, size, s);
	if (!ret)
		ret = gmlake_stream_synchronize(ctx, s);
	free(buf);
	return ret;
}

/*
 * Read [p, p+size) back on stream s and compare with the pattern.
 * 0: intact; 1: different (*diff: the first differing offset); or a
 * negative errno from the copy.
 */
static TH_UNUSED int th_verify(gmlake_ctx *ctx, const void *p, size_t size,
			       uint64_t seed, gmlake_stream_t s, size_t *diff)
{
	void *buf = malloc(size ? size : 1);
	size_t off;
	int ret;

	if (!buf)
		return -ENOMEM;
	memset(buf, 0xa5, size);
	ret = gmlake_memcpy_dtoh(ctx, buf, p, size, s);
	if (!ret)
		ret = gmlake_stream_synchronize(ctx, s);
	if (!ret) {
		off = th_pattern_diff(buf, size, seed);
		if (off != SIZE_MAX) {
			if (diff)
				*diff = off;
			ret = 1;
		}
	}
	free(buf);
	return ret;
}

static TH_UNUSED void th_fill_ok(gmlake_ctx *ctx, void *p, size_t size,
				 uint64_t seed, gmlake_stream_t s)
{
	int ret = th_fill(ctx, p, size, seed, s);

	ck_assert_msg(ret == 0, "fill %p+%zu: %d (%s)", p, size, ret,
		      gmlake_last_error());
}

static TH_UNUSED void th_verify_ok(gmlake_ctx *ctx, const void *p,
				   size_t size, uint64_t seed,
				   gmlake_stream_t s)
{
	size_t diff = 0;
	int ret = th_verify(ctx, p, size, seed, s, &diff);

	ck_assert_msg(ret != 1, "block %p (%zu bytes, seed %" PRIu64
		      ") corrupt at offset %zu", p, size, seed, diff);
	ck_assert_msg(ret == 0, "verify %p+%zu: %d (%s)", p, size, ret,
		      gmlake_last_error());
}

/* ---------------------------------------------------------------------- */
/* Blocks with assertions.                                                */

/* The chunk size the context uses (stats.chunk_size). */
static TH_UNUSED size_t th_chunk_size(gmlake_ctx *ctx)
{
	struct gmlake_stats st;

	th_stats(ctx, &st);
	ck_assert_uint_gt(st.chunk_size, 0);
	return st.chunk_size;
}

/*
 * Allocate size bytes on s; assert success, 512-byte alignment, chunk
 * alignment for sizes >= small (when small is not 0), block_size, and the
 * invariants.
 */
static TH_UNUSED void *th_alloc_small(gmlake_ctx *ctx, size_t size,
				      gmlake_stream_t s, size_t small)
{
	void *p = NULL;
	size_t got = 0;
	int ret = gmlake_alloc(ctx, &p, size, s);

	ck_assert_msg(ret == 0, "gmlake_alloc(%zu): %d (%s)", size, ret,
		      gmlake_last_error());
	ck_assert_ptr_nonnull(p);
	ck_assert_msg((uintptr_t)p % 512 == 0, "%p: not 512-aligned", p);
	if (small && size >= small) {
		size_t cs = th_chunk_size(ctx);

		ck_assert_msg((uintptr_t)p % cs == 0,
			      "%p (%zu bytes): not aligned to the chunk "
			      "size %zu", p, size, cs);
	}
	ck_assert_int_eq(gmlake_block_size(ctx, p, &got), 0);
	ck_assert_uint_eq(got, size);
	th_check(ctx);
	return p;
}

/* th_alloc_small() with the default small size (1 MiB). */
static TH_UNUSED void *th_alloc(gmlake_ctx *ctx, size_t size,
				gmlake_stream_t s)
{
	return th_alloc_small(ctx, size, s, TH_MiB);
}

static TH_UNUSED void th_free(gmlake_ctx *ctx, void *p)
{
	int ret = gmlake_free(ctx, p);

	ck_assert_msg(ret == 0, "gmlake_free(%p): %d (%s)", p, ret,
		      gmlake_last_error());
	th_check(ctx);
}

/* th_alloc() then th_fill_ok(): most cases want a block holding a pattern. */
static TH_UNUSED void *th_alloc_filled(gmlake_ctx *ctx, size_t size,
				       uint64_t seed, gmlake_stream_t s)
{
	void *p = th_alloc(ctx, size, s);

	th_fill_ok(ctx, p, size, seed, s);
	return p;
}

/*
 * Free memory in two holes: blocks of sizes[0..3] in turn, the second and
 * fourth filled (patterns 2 and 4) and kept, the first and third freed.
 * out[0..3] are the four addresses; what a test then allocates decides
 * whether it fits a hole, stitches both or grows.
 */
static TH_UNUSED void th_two_holes(gmlake_ctx *ctx, const size_t sizes[4],
				   void *out[4])
{
	for (int i = 0; i < 4; i++)
		out[i] = th_alloc(ctx, sizes[i], NULL);
	th_fill_ok(ctx, out[1], sizes[1], 2, NULL);
	th_fill_ok(ctx, out[3], sizes[3], 4, NULL);
	th_free(ctx, out[0]);
	th_free(ctx, out[2]);
}

/*
 * Two growth handles (slabs) of 4 chunks, each half taken, free at
 * opposite ends (a context whose GMLAKE_GROW_HANDLE is 4 chunks): slab A
 * (l->a) with its bottom two chunks free and its top held by l->y
 * (pattern 6), single chunk l->b (2), slab C (l->c) with its bottom held
 * by l->z (7) and its top free, single chunk l->d (4).
 */
struct th_slab_ends {
	void *a, *b, *c, *d, *y, *z;
};

static TH_UNUSED void th_slab_ends(gmlake_ctx *ctx, struct th_slab_ends *l)
{
	void *x;

	l->a = th_alloc_filled(ctx, 4 * TH_CHUNK, 1, NULL);
	l->b = th_alloc_filled(ctx, TH_CHUNK, 2, NULL);
	l->c = th_alloc_filled(ctx, 4 * TH_CHUNK, 3, NULL);
	l->d = th_alloc_filled(ctx, TH_CHUNK, 4, NULL);
	th_free(ctx, l->a);
	th_free(ctx, l->c);
	x = th_alloc_filled(ctx, 2 * TH_CHUNK, 5, NULL);
	l->y = th_alloc_filled(ctx, 2 * TH_CHUNK, 6, NULL);
	l->z = th_alloc_filled(ctx, 2 * TH_CHUNK, 7, NULL);
	ck_assert_ptr_eq(x, l->a);
	ck_assert_ptr_eq(l->y, (char *)l->a + 2 * TH_CHUNK);
	ck_assert_ptr_eq(l->z, l->c);
	th_free(ctx, x);
}

/* th_verify_ok() then th_free(): a block is checked one last time. */
static TH_UNUSED void th_verify_free(gmlake_ctx *ctx, void *p, size_t size,
				     uint64_t seed, gmlake_stream_t s)
{
	th_verify_ok(ctx, p, size, seed, s);
	th_free(ctx, p);
}

/* Whether [a, a+na) and [b, b+nb) overlap. */
static TH_UNUSED bool th_overlap(const void *a, size_t na, const void *b,
				 size_t nb)
{
	uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;

	return x < y + nb && y < x + na;
}

/* ---------------------------------------------------------------------- */
/* Capturing what a call writes to a file descriptor (stderr, stdout).    */

struct th_capture {
	int fd;		/* the descriptor captured */
	int saved;	/* its original, to restore */
	int tmp;	/* the temporary file it writes to */
};

static TH_UNUSED void th_capture_begin(struct th_capture *c, int fd)
{
	char name[] = "/tmp/gmlake-test-XXXXXX";

	fflush(NULL);
	c->fd = fd;
	c->tmp = mkstemp(name);
	ck_assert_int_ge(c->tmp, 0);
	unlink(name);
	c->saved = dup(fd);
	ck_assert_int_ge(c->saved, 0);
	ck_assert_int_ge(dup2(c->tmp, fd), 0);
}

/* Restore the descriptor; the captured text (malloc'd, NUL-terminated). */
static TH_UNUSED char *th_capture_end(struct th_capture *c)
{
	off_t len;
	char *text;
	ssize_t n;

	fflush(NULL);
	ck_assert_int_ge(dup2(c->saved, c->fd), 0);
	close(c->saved);
	len = lseek(c->tmp, 0, SEEK_END);
	ck_assert_int_ge(len, 0);
	text = calloc(1, (size_t)len + 1);
	ck_assert_ptr_nonnull(text);
	n = pread(c->tmp, text, (size_t)len, 0);
	ck_assert_int_eq(n, len);
	close(c->tmp);
	return text;
}

/* Everything written to fd by gmlake_stats_print(ctx, fd, json). */
static TH_UNUSED char *th_stats_text(gmlake_ctx *ctx, bool json)
{
	char name[] = "/tmp/gmlake-test-XXXXXX";
	int fd = mkstemp(name), ret;
	off_t len;
	char *text;

	ck_assert_int_ge(fd, 0);
	unlink(name);
	ret = gmlake_stats_print(ctx, fd, json);
	ck_assert_msg(ret == 0, "gmlake_stats_print: %d", ret);
	len = lseek(fd, 0, SEEK_END);
	ck_assert_int_ge(len, 0);
	text = calloc(1, (size_t)len + 1);
	ck_assert_ptr_nonnull(text);
	ck_assert_int_eq(pread(fd, text, (size_t)len, 0), len);
	close(fd);
	return text;
}

/* ---------------------------------------------------------------------- */
/* Process resources, to see that a destroyed context left nothing.      */

/* Whether a thread of this process is named name (/proc/self/task). */
static TH_UNUSED bool th_thread_named(const char *name)
{
	char path[300], comm[32];
	struct dirent *e;
	bool found = false;
	DIR *d = opendir("/proc/self/task");

	if (!d)
		return false;
	while (!found && (e = readdir(d))) {
		FILE *f;

		if (e->d_name[0] == '.')
			continue;
		snprintf(path, sizeof(path), "/proc/self/task/%s/comm",
			 e->d_name);
		f = fopen(path, "r");
		if (!f)
			continue;
		if (fgets(comm, sizeof(comm), f))
			found = !strncmp(comm, name, strlen(name)) &&
				comm[strlen(name)] == '\n';
		fclose(f);
	}
	closedir(d);
	return found;
}

static TH_UNUSED int th_count_fds(void)
{
	DIR *d = opendir("/proc/self/fd");
	struct dirent *e;
	int n = 0;

	if (!d)
		return -1;
	while ((e = readdir(d)))
		if (e->d_name[0] != '.')
			n++;
	closedir(d);
	return n - 1;	/* the directory's own descriptor */
}

/* Mappings of memfd files (the emulated device memory) in this process. */
static TH_UNUSED int th_count_memfd_maps(void)
{
	FILE *f = fopen("/proc/self/maps", "r");
	char line[512];
	int n = 0;

	if (!f)
		return -1;
	while (fgets(line, sizeof(line), f))
		if (strstr(line, "/memfd:"))
			n++;
	fclose(f);
	return n;
}

#endif
