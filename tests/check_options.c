/* SPDX-License-Identifier: MIT */
/*
 * check_options: the GMLAKE_* environment options (lib/options.c) and the
 * validation of a configuration in gmlake_ctx_init().
 *
 * Runs on the emulated device whatever GMLAKE_BACKEND says: each case
 * starts from an environment without GMLAKE_* variables (checked fixture)
 * and sets what it tests.
 */
#include "helpers.h"

#include <stddef.h>

extern char **environ;

#define ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

/* Drop every GMLAKE_* variable. */
static void clear_env(void)
{
	char name[128];
	bool again = true;

	while (again) {
		char **e;

		again = false;
		for (e = environ; *e; e++) {
			const char *eq = strchr(*e, '=');
			size_t len = eq ? (size_t)(eq - *e) : strlen(*e);

			if (strncmp(*e, "GMLAKE_", 7) || len >= sizeof(name))
				continue;
			memcpy(name, *e, len);
			name[len] = 0;
			unsetenv(name);
			again = true;
			break;
		}
	}
}

static void setup(void)
{
	clear_env();
}

/* gmlake_config_init() with var=val; what it wrote to stderr. */
static char *init_with(const char *var, const char *val,
		       struct gmlake_config *cfg)
{
	struct th_capture c;
	char *err;
	int ret;

	if (var)
		ck_assert_int_eq(setenv(var, val, 1), 0);
	memset(cfg, 0xee, sizeof(*cfg));
	th_capture_begin(&c, STDERR_FILENO);
	ret = gmlake_config_init(cfg);
	err = th_capture_end(&c);
	if (var)
		unsetenv(var);
	ck_assert_msg(ret == 0, "gmlake_config_init with %s=%s: %d", var, val,
		      ret);
	return err;
}

static void expect_quiet(char *err, const char *var, const char *val)
{
	ck_assert_msg(!strstr(err, var), "%s=%s is valid, yet: %s", var, val,
		      err);
	free(err);
}

static void expect_warning(char *err, const char *var, const char *val)
{
	ck_assert_msg(strstr(err, var), "%s='%s' is invalid; stderr does not "
		      "name the variable: '%s'", var, val, err);
	free(err);
}

static void defaults(struct gmlake_config *d)
{
	free(init_with(NULL, NULL, d));
}

/* ---------------------------------------------------------------------- */

START_TEST(test_defaults)
{
	struct gmlake_config cfg;
	char *err = init_with(NULL, NULL, &cfg);
	int i;

	ck_assert_str_eq(err, "");
	free(err);
	ck_assert_uint_eq(cfg.version, GMLAKE_CONFIG_VERSION);
	ck_assert_uint_eq(cfg.size, sizeof(cfg));
	ck_assert(cfg.backend == GMLAKE_BACKEND_DEFAULT ||
		  cfg.backend == GMLAKE_BACKEND_CUDA);
	ck_assert_int_eq(cfg.device, 0);
	ck_assert_uint_eq(cfg.chunk_size, 0);
	ck_assert_uint_eq(cfg.small_size, TH_MiB);
	ck_assert_uint_eq(cfg.stitch_cache_max, 256);
	ck_assert_uint_eq(cfg.emu_capacity, 64 * TH_GiB);
	ck_assert_uint_eq(cfg.emu_granularity, 2 * TH_MiB);
	ck_assert_uint_eq(cfg.stitch_min, 2 * TH_MiB);
	ck_assert_int_eq(cfg.log_level, GMLAKE_LOG_WARN);
	ck_assert(!cfg.show_stats);
	ck_assert(cfg.publish);
	ck_assert_uint_eq(cfg.device_limit, 0);
	ck_assert_uint_eq(cfg.host_limit, 16 * TH_GiB);
	ck_assert_int_eq(cfg.offload_engine, GMLAKE_OFFLOAD_ENGINE_NONE);
	ck_assert_uint_eq(cfg.host_pin, 0);
	ck_assert_uint_eq(cfg.spare_keep_ms, 5000);
	ck_assert(cfg.stream_order);
	ck_assert(cfg.exportable);
	ck_assert(!cfg.pack);
	ck_assert(!cfg.emu_lag);
	ck_assert_uint_eq(cfg.top_fit, GMLAKE_TOP_FIT_AUTO);
	ck_assert_uint_eq(cfg.grow_handle, 20 * TH_MiB);
	ck_assert_uint_eq(cfg.grow_slack, 20);
	ck_assert_uint_eq(cfg.reserved32, 0);
	for (i = 0; i < (int)ARRAY_SIZE(cfg.reserved); i++)
		ck_assert_uint_eq(cfg.reserved[i], 0);
	ck_assert_int_eq(gmlake_config_init(NULL), -EINVAL);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* An option, its field, and the values it takes or refuses.              */

/*
 * The field at off as an int64_t, by its type: so one pair of helpers below
 * checks every option.
 */
static int64_t size_at(const struct gmlake_config *cfg, size_t off)
{
	size_t v;

	memcpy(&v, (const char *)cfg + off, sizeof(v));
	return (int64_t)v;
}

static int64_t int_at(const struct gmlake_config *cfg, size_t off)
{
	int v;

	memcpy(&v, (const char *)cfg + off, sizeof(v));
	return v;
}

static int64_t uint_at(const struct gmlake_config *cfg, size_t off)
{
	unsigned v;

	memcpy(&v, (const char *)cfg + off, sizeof(v));
	return v;
}

static int64_t bool_at(const struct gmlake_config *cfg, size_t off)
{
	bool v;

	memcpy(&v, (const char *)cfg + off, sizeof(v));
	return v;
}

/* A GMLAKE_* variable and the field of the configuration it sets. */
struct opt {
	const char *var;
	size_t off;		/* of its field in struct gmlake_config */
	int64_t (*get)(const struct gmlake_config *cfg, size_t off);
};

#define OPT(var, field, get) \
	{ var, offsetof(struct gmlake_config, field), get }

/* A string and the value it must give. */
struct val {
	const char *s;
	int64_t v;
};

/* Each good string gives its value and draws no warning. */
static void expect_values(const struct opt *o, const struct val *good,
			  size_t n)
{
	struct gmlake_config cfg;
	size_t j;

	for (j = 0; j < n; j++) {
		char *err = init_with(o->var, good[j].s, &cfg);
		int64_t got = o->get(&cfg, o->off);

		ck_assert_msg(got == good[j].v,
			      "%s=%s gives %" PRId64 ", not %" PRId64,
			      o->var, good[j].s, got, good[j].v);
		expect_quiet(err, o->var, good[j].s);
	}
}

/* Each bad string keeps the default dflt and draws a warning. */
static void expect_rejected(const struct opt *o, const char *const *bad,
			    size_t n, int64_t dflt)
{
	struct gmlake_config cfg;
	size_t j;

	for (j = 0; j < n; j++) {
		char *err = init_with(o->var, bad[j], &cfg);
		int64_t got = o->get(&cfg, o->off);

		ck_assert_msg(got == dflt,
			      "%s='%s' gives %" PRId64 ", not the default %"
			      PRId64, o->var, bad[j], got, dflt);
		expect_warning(err, o->var, bad[j]);
	}
}

/* ---------------------------------------------------------------------- */
/* Sizes.                                                                 */

static const struct opt size_opts[] = {
	OPT("GMLAKE_CHUNK_SIZE", chunk_size, size_at),
	OPT("GMLAKE_SMALL_SIZE", small_size, size_at),
	OPT("GMLAKE_STITCH_MIN", stitch_min, size_at),
	OPT("GMLAKE_EMU_CAPACITY", emu_capacity, size_at),
	OPT("GMLAKE_EMU_GRANULARITY", emu_granularity, size_at),
	OPT("GMLAKE_DEVICE_LIMIT", device_limit, size_at),
	OPT("GMLAKE_HOST_LIMIT", host_limit, size_at),
	OPT("GMLAKE_HOST_PIN", host_pin, size_at),
	OPT("GMLAKE_TOP_FIT", top_fit, size_at),
};
#define N_SIZE_OPTS ((int)ARRAY_SIZE(size_opts))

START_TEST(test_size_values)
{
	static const struct val good[] = {
		{ "4194304", 4 * TH_MiB },
		{ "4M", 4 * TH_MiB },
		{ "64K", 64 * TH_KiB },
		{ "2048K", 2 * TH_MiB },
		{ "1G", TH_GiB },
		{ "3G", 3 * TH_GiB },
		{ "1M", TH_MiB },
		{ "512", 512 },
	};

	expect_values(&size_opts[_i], good, ARRAY_SIZE(good));
}
END_TEST

START_TEST(test_size_invalid)
{
	static const char *const bad[] = {
		"abc", "12X", "-1", "-4M", "4MM", "M", "4.5M", "0x",
		"99999999999999999999", "20000000000G", "18446744073709551616",
	};
	const struct opt *o = &size_opts[_i];
	struct gmlake_config d;

	defaults(&d);
	expect_rejected(o, bad, ARRAY_SIZE(bad), o->get(&d, o->off));
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Counts, names, booleans.                                               */

START_TEST(test_stitch_cache)
{
	static const struct opt o =
		OPT("GMLAKE_STITCH_CACHE", stitch_cache_max, uint_at);
	static const struct val good[] = {
		{ "17", 17 }, { "0", 0 }, { "100000", 100000 },
	};
	static const char *const bad[] = {
		"x", "-3", "4294967296", "99999999999999999999", "1.5", "7z",
	};

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), 256);
}
END_TEST

/* GMLAKE_TOP_FIT takes a size or auto (the default, the share rule). */
START_TEST(test_top_fit_auto)
{
	static const struct opt o = OPT("GMLAKE_TOP_FIT", top_fit, size_at);
	static const struct val good[] = {
		{ "auto", (int64_t)GMLAKE_TOP_FIT_AUTO },
		{ "AUTO", (int64_t)GMLAKE_TOP_FIT_AUTO },
		{ "0", 0 }, { "48M", 48 * TH_MiB },
	};
	static const char *const bad[] = { "automatic", "aut", "auto1" };

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad),
			(int64_t)GMLAKE_TOP_FIT_AUTO);
}
END_TEST

START_TEST(test_spare_keep)
{
	static const struct opt o =
		OPT("GMLAKE_SPARE_KEEP_MS", spare_keep_ms, uint_at);
	static const struct val good[] = {
		{ "0", 0 }, { "250", 250 }, { "3600000", 3600000 },
	};
	static const char *const bad[] = {
		"x", "-1", "1s", "2147483648", "4294967296",
	};

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), 5000);
}
END_TEST

/* GMLAKE_GROW_SLACK: per mille, at most GMLAKE_GROW_SLACK_MAX (a larger
 * one would let the context refuse every allocation; it warns instead). */
START_TEST(test_grow_slack)
{
	static const struct opt o =
		OPT("GMLAKE_GROW_SLACK", grow_slack, uint_at);
	static const struct val good[] = {
		{ "0", 0 }, { "5", 5 }, { "1000", 1000 },
	};
	static const char *const bad[] = {
		"x", "-1", "1001", "0.5", "5%", "4294967296",
	};

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), 20);
}
END_TEST

START_TEST(test_device)
{
	static const struct opt o = OPT("GMLAKE_DEVICE", device, int_at);
	static const struct val good[] = { { "3", 3 }, { "0", 0 } };
	static const char *const bad[] = { "x", "-1", "1x", "99999999999" };

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), 0);
}
END_TEST

START_TEST(test_backend)
{
	static const struct opt o = OPT("GMLAKE_BACKEND", backend, int_at);
	static const struct val good[] = {
		{ "cuda", GMLAKE_BACKEND_CUDA }, { "emu", GMLAKE_BACKEND_EMU },
	};
	static const char *const bad[] = { "opencl", "emulated", "2", "cud" };
	struct gmlake_config d;

	defaults(&d);
	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), d.backend);
}
END_TEST

START_TEST(test_log_level)
{
	static const struct opt o = OPT("GMLAKE_LOG_LEVEL", log_level, int_at);
	static const struct val good[] = {
		{ "error", GMLAKE_LOG_ERROR }, { "warn", GMLAKE_LOG_WARN },
		{ "info", GMLAKE_LOG_INFO },   { "debug", GMLAKE_LOG_DEBUG },
		{ "0", 0 }, { "1", 1 }, { "2", 2 }, { "3", 3 },
	};
	static const char *const bad[] = { "loud", "4", "-1", "9", "warnx" };
	struct gmlake_config d;

	defaults(&d);
	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), d.log_level);
}
END_TEST

START_TEST(test_show_stats)
{
	static const struct opt o =
		OPT("GMLAKE_SHOW_STATS", show_stats, bool_at);
	static const struct val good[] = {	/* yes and no, in turn */
		{ "1", true },    { "0", false },
		{ "true", true }, { "false", false },
		{ "yes", true },  { "no", false },
		{ "on", true },   { "off", false },
	};
	static const char *const bad[] = { "maybe", "2", "onn", "-1" };

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), false);
}
END_TEST

START_TEST(test_publish)
{
	static const struct opt o = OPT("GMLAKE_PUBLISH", publish, bool_at);
	static const struct val good[] = { { "off", false }, { "1", true } };
	static const char *const bad[] = { "sometimes" };

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), true);	/* the default */
}
END_TEST

START_TEST(test_exportable)
{
	static const struct opt o =
		OPT("GMLAKE_EXPORTABLE", exportable, bool_at);
	static const struct val good[] = { { "off", false }, { "1", true } };
	static const char *const bad[] = { "maybe" };

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), true);	/* the default */
}
END_TEST

START_TEST(test_pack)
{
	static const struct opt o = OPT("GMLAKE_PACK", pack, bool_at);
	static const struct val good[] = { { "1", true }, { "off", false } };
	static const char *const bad[] = { "tight" };

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), false);	/* the default */
}
END_TEST

START_TEST(test_emu_lag)
{
	static const struct opt o = OPT("GMLAKE_EMU_LAG", emu_lag, bool_at);
	static const struct val good[] = { { "yes", true }, { "0", false } };
	static const char *const bad[] = { "slow" };

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), false);	/* the default */
}
END_TEST

START_TEST(test_stream_order)
{
	static const struct opt o =
		OPT("GMLAKE_STREAM_ORDER", stream_order, bool_at);
	static const struct val good[] = { { "0", false }, { "on", true } };
	static const char *const bad[] = { "later" };

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), true);	/* the default */
}
END_TEST

START_TEST(test_offload_engine)
{
	static const struct opt o =
		OPT("GMLAKE_OFFLOAD_ENGINE", offload_engine, int_at);
	static const struct val good[] = {
		{ "auto", GMLAKE_OFFLOAD_ENGINE_NONE },
		{ "uring", GMLAKE_OFFLOAD_ENGINE_URING },
		{ "io_uring", GMLAKE_OFFLOAD_ENGINE_URING },
		{ "THREAD", GMLAKE_OFFLOAD_ENGINE_THREAD },
	};
	static const char *const bad[] = { "epoll", "1", "", "threads" };

	expect_values(&o, good, ARRAY_SIZE(good));
	expect_rejected(&o, bad, ARRAY_SIZE(bad), GMLAKE_OFFLOAD_ENGINE_NONE);
}
END_TEST

/* Several at once: the good ones apply, only the bad one is named. */
START_TEST(test_several)
{
	struct gmlake_config cfg;
	struct th_capture c;
	char *err;

	setenv("GMLAKE_BACKEND", "emu", 1);
	setenv("GMLAKE_CHUNK_SIZE", "4M", 1);
	setenv("GMLAKE_SMALL_SIZE", "oops", 1);
	setenv("GMLAKE_EMU_CAPACITY", "1G", 1);
	setenv("GMLAKE_SHOW_STATS", "yes", 1);
	setenv("GMLAKE_STITCH_CACHE", "5", 1);
	th_capture_begin(&c, STDERR_FILENO);
	ck_assert_int_eq(gmlake_config_init(&cfg), 0);
	err = th_capture_end(&c);
	ck_assert_int_eq(cfg.backend, GMLAKE_BACKEND_EMU);
	ck_assert_uint_eq(cfg.chunk_size, 4 * TH_MiB);
	ck_assert_uint_eq(cfg.small_size, TH_MiB);
	ck_assert_uint_eq(cfg.emu_capacity, TH_GiB);
	ck_assert(cfg.show_stats);
	ck_assert_uint_eq(cfg.stitch_cache_max, 5);
	ck_assert_msg(strstr(err, "GMLAKE_SMALL_SIZE"), "stderr: %s", err);
	ck_assert_msg(!strstr(err, "GMLAKE_CHUNK_SIZE"), "stderr: %s", err);
	ck_assert_msg(!strstr(err, "GMLAKE_EMU_CAPACITY"), "stderr: %s", err);
	free(err);
}
END_TEST

/* ---------------------------------------------------------------------- */
/* Validation in gmlake_ctx_init().                                       */

static void emu_config(struct gmlake_config *cfg)
{
	ck_assert_int_eq(gmlake_config_init(cfg), 0);
	cfg->backend = GMLAKE_BACKEND_EMU;
	cfg->emu_capacity = 64 * TH_MiB;
}

static void expect_init_fails(const struct gmlake_config *cfg, int err,
			      const char *what)
{
	gmlake_ctx *ctx = NULL;
	int ret = gmlake_ctx_init(&ctx, cfg);

	if (ret == 0)
		gmlake_ctx_destroy(ctx, true);
	ck_assert_msg(ret == err, "%s: gmlake_ctx_init = %d, expected %d",
		      what, ret, err);
	ck_assert_msg(gmlake_last_error()[0], "%s: no message", what);
}

/* A misspelled name warns, naming the nearest known one; names read
 * outside the table (the Python package's) do not. */
START_TEST(test_unknown_name)
{
	struct gmlake_config cfg;
	char *err;

	ck_assert_int_eq(setenv("GMLAKE_LIBRARY", "/nowhere", 1), 0);
	ck_assert_int_eq(setenv("GMLAKE_TORCH_SETTLE_OPTIMIZER", "1", 1), 0);
	err = init_with("GMLAKE_CHUNK_SZIE", "4M", &cfg);
	ck_assert_msg(strstr(err, "GMLAKE_CHUNK_SZIE: unknown variable") &&
		      strstr(err, "did you mean GMLAKE_CHUNK_SIZE?"),
		      "stderr: %s", err);
	ck_assert_msg(!strstr(err, "GMLAKE_LIBRARY"), "stderr: %s", err);
	ck_assert_msg(!strstr(err, "GMLAKE_TORCH_SETTLE_OPTIMIZER"),
		      "stderr: %s", err);
	ck_assert_int_eq(unsetenv("GMLAKE_TORCH_SETTLE_OPTIMIZER"), 0);
	free(err);
	ck_assert_uint_eq(cfg.chunk_size, 0);	/* the default stays */
}
END_TEST

/* GMLAKE_STRICT turns a bad value or an unknown name into -EINVAL, from
 * gmlake_config_init and so from gmlake_ctx_init without a config. */
START_TEST(test_strict)
{
	struct gmlake_config cfg;
	gmlake_ctx *ctx = NULL;

	ck_assert_int_eq(setenv("GMLAKE_STRICT", "1", 1), 0);
	ck_assert_int_eq(setenv("GMLAKE_SMALL_SIZE", "64K", 1), 0);
	ck_assert_int_eq(gmlake_config_init(&cfg), 0);
	ck_assert_uint_eq(cfg.small_size, 64 << 10);
	ck_assert_int_eq(setenv("GMLAKE_SMALL_SIZE", "lots", 1), 0);
	ck_assert_int_eq(gmlake_config_init(&cfg), -EINVAL);
	ck_assert_msg(strstr(gmlake_last_error(), "GMLAKE_SMALL_SIZE") &&
		      strstr(gmlake_last_error(), "'lots'"),
		      "error: %s", gmlake_last_error());
	ck_assert_int_eq(setenv("GMLAKE_BACKEND", "emu", 1), 0);
	ck_assert_int_eq(gmlake_ctx_init(&ctx, NULL), -EINVAL);
	ck_assert_ptr_null(ctx);
	unsetenv("GMLAKE_SMALL_SIZE");
	ck_assert_int_eq(setenv("GMLAKE_PUBLSH", "0", 1), 0);
	ck_assert_int_eq(gmlake_config_init(&cfg), -EINVAL);
	ck_assert_msg(strstr(gmlake_last_error(), "GMLAKE_PUBLSH") &&
		      strstr(gmlake_last_error(), "GMLAKE_PUBLISH"),
		      "error: %s", gmlake_last_error());
	/* Off again: a warning, and the defaults. */
	ck_assert_int_eq(setenv("GMLAKE_STRICT", "0", 1), 0);
	ck_assert_int_eq(gmlake_config_init(&cfg), 0);
}
END_TEST

START_TEST(test_init_validation)
{
	struct gmlake_config cfg;

	emu_config(&cfg);
	cfg.version = 0;
	expect_init_fails(&cfg, -EINVAL, "version 0");
	emu_config(&cfg);
	cfg.version = GMLAKE_CONFIG_VERSION + 1;
	expect_init_fails(&cfg, -EINVAL, "version + 1");
	emu_config(&cfg);
	cfg.size = sizeof(cfg) - 8;
	expect_init_fails(&cfg, -EINVAL, "size - 8");
	emu_config(&cfg);
	cfg.size = sizeof(cfg) + 8;
	expect_init_fails(&cfg, -EINVAL, "size + 8");
	emu_config(&cfg);
	cfg.size = 0;
	expect_init_fails(&cfg, -EINVAL, "size 0");
	emu_config(&cfg);
	cfg.chunk_size = 3 * TH_MiB;
	expect_init_fails(&cfg, -EINVAL, "chunk 3 MiB, granularity 2 MiB");
	emu_config(&cfg);
	cfg.chunk_size = TH_MiB;
	expect_init_fails(&cfg, -EINVAL, "chunk 1 MiB, granularity 2 MiB");
	emu_config(&cfg);
	cfg.chunk_size = 2 * TH_MiB + 4096;
	expect_init_fails(&cfg, -EINVAL, "chunk 2 MiB + 4 KiB");
	emu_config(&cfg);
	cfg.chunk_size = 6 * TH_MiB;
	expect_init_fails(&cfg, -EINVAL, "chunk 6 MiB: not a power of two");
	emu_config(&cfg);
	cfg.emu_granularity = 4 * TH_MiB;
	cfg.chunk_size = 2 * TH_MiB;
	expect_init_fails(&cfg, -EINVAL, "chunk 2 MiB, granularity 4 MiB");
	emu_config(&cfg);
	cfg.small_size = 4 * TH_MiB;
	expect_init_fails(&cfg, -EINVAL, "small size above the chunk size");
	emu_config(&cfg);
	cfg.chunk_size = 4 * TH_MiB;
	cfg.small_size = 8 * TH_MiB;
	expect_init_fails(&cfg, -EINVAL, "small 8 MiB, chunk 4 MiB");
	emu_config(&cfg);
	cfg.device = -1;
	expect_init_fails(&cfg, -EINVAL, "device -1");
	emu_config(&cfg);
	cfg.backend = 3;
	expect_init_fails(&cfg, -EINVAL, "backend 3");
	emu_config(&cfg);
	cfg.backend = -1;
	expect_init_fails(&cfg, -EINVAL, "backend -1");
	emu_config(&cfg);
	cfg.backend = 1000;
	expect_init_fails(&cfg, -EINVAL, "backend 1000");
}
END_TEST

/*
 * Fill p (seed) and q (seed + 1), read p back, free both and destroy ctx:
 * blocks cut with the chunk size under test carry data.
 */
static void fill_check_destroy(gmlake_ctx *ctx, void *p, size_t np, void *q,
			       size_t nq, uint64_t seed)
{
	th_fill_ok(ctx, p, np, seed, NULL);
	th_fill_ok(ctx, q, nq, seed + 1, NULL);
	th_verify_free(ctx, p, np, seed, NULL);
	th_free(ctx, q);
	th_destroy(ctx);
}

START_TEST(test_chunk_size_used)
{
	struct gmlake_config cfg;
	gmlake_ctx *ctx;
	struct gmlake_stats st;
	void *p, *q;

	emu_config(&cfg);
	cfg.chunk_size = 4 * TH_MiB;
	ctx = th_ctx_cfg(&cfg);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.chunk_size, 4 * TH_MiB);
	p = th_alloc(ctx, 2 * TH_MiB, NULL);
	q = th_alloc(ctx, 6 * TH_MiB, NULL);
	ck_assert_uint_eq((uintptr_t)p % (4 * TH_MiB), 0);
	ck_assert_uint_eq((uintptr_t)q % (4 * TH_MiB), 0);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.reserved_bytes.current, (int64_t)(12 * TH_MiB));
	ck_assert_int_eq(st.chunks.current, 3);
	fill_check_destroy(ctx, p, 2 * TH_MiB, q, 6 * TH_MiB, 1);

	/* chunk_size 0: the granularity. */
	emu_config(&cfg);
	cfg.emu_granularity = 64 * TH_KiB;
	cfg.chunk_size = 0;
	cfg.small_size = 32 * TH_KiB;
	ctx = th_ctx_cfg(&cfg);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.chunk_size, 64 * TH_KiB);
	p = th_alloc_small(ctx, 200 * TH_KiB, NULL, 32 * TH_KiB);
	q = th_alloc_small(ctx, 1000, NULL, 32 * TH_KiB);
	fill_check_destroy(ctx, p, 200 * TH_KiB, q, 1000, 3);

	/* A larger small size with larger chunks is fine. */
	emu_config(&cfg);
	cfg.chunk_size = 8 * TH_MiB;
	cfg.small_size = 4 * TH_MiB;
	ctx = th_ctx_cfg(&cfg);
	p = th_alloc_small(ctx, 3 * TH_MiB, NULL, 4 * TH_MiB);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 1);
	th_free(ctx, p);
	th_destroy(ctx);

	/* From the environment. */
	setenv("GMLAKE_BACKEND", "emu", 1);
	setenv("GMLAKE_CHUNK_SIZE", "8M", 1);
	setenv("GMLAKE_EMU_CAPACITY", "64M", 1);
	ctx = NULL;
	ck_assert_int_eq(gmlake_ctx_init(&ctx, NULL), 0);
	th_stats(ctx, &st);
	ck_assert_uint_eq(st.chunk_size, 8 * TH_MiB);
	th_destroy(ctx);
}
END_TEST

START_TEST(test_env_capacity)
{
	gmlake_ctx *ctx = NULL;
	struct gml_emu_info info;
	void *p = NULL;

	setenv("GMLAKE_BACKEND", "emu", 1);
	setenv("GMLAKE_EMU_CAPACITY", "8M", 1);
	ck_assert_int_eq(gmlake_ctx_init(&ctx, NULL), 0);
	ck_assert(th_is_emu(ctx));
	th_emu_info(ctx, &info);
	ck_assert_uint_eq(info.capacity, 8 * TH_MiB);
	TH_ERR(ctx, gmlake_alloc(ctx, &p, 10 * TH_MiB, NULL), -ENOMEM);
	p = th_alloc(ctx, 8 * TH_MiB, NULL);
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/*
 * gmlake_ctx_init(cfg) on what must be the cuda backend: a context that is
 * not the emulated device (destroyed), or -ENODEV / -EOPNOTSUPP, then with
 * a message when want_msg.
 */
static void expect_cuda_or_none(const struct gmlake_config *cfg,
				bool want_msg, const char *what)
{
	gmlake_ctx *ctx = NULL;
	int ret = gmlake_ctx_init(&ctx, cfg);

	if (ret == 0) {
		ck_assert_msg(!th_is_emu(ctx), "%s: the emulated device", what);
		th_destroy(ctx);
		return;
	}
	ck_assert_msg(ret == -ENODEV || ret == -EOPNOTSUPP, "%s: %d (%s)",
		      what, ret, gmlake_last_error());
	if (want_msg)
		ck_assert_msg(gmlake_last_error()[0], "%s: no message", what);
}

/* The cuda backend is the cuda backend: a device, or -ENODEV; never emu. */
START_TEST(test_cuda_no_fallback)
{
	struct gmlake_config cfg;

	emu_config(&cfg);
	cfg.backend = GMLAKE_BACKEND_CUDA;
	expect_cuda_or_none(&cfg, true, "cuda backend");

	/* Named by the environment, with the default in the config. */
	setenv("GMLAKE_BACKEND", "cuda", 1);
	expect_cuda_or_none(NULL, false, "GMLAKE_BACKEND=cuda");

	/* No GMLAKE_BACKEND at all: the default is cuda, not emu. */
	unsetenv("GMLAKE_BACKEND");
	expect_cuda_or_none(NULL, false, "default backend");
}
END_TEST

START_TEST(test_small_size_used)
{
	struct gmlake_config cfg;
	struct gmlake_stats st;
	gmlake_ctx *ctx;
	void *p;

	/* Default: 128 KiB is small, packed. */
	emu_config(&cfg);
	ctx = th_ctx_cfg(&cfg);
	p = th_alloc(ctx, 128 * TH_KiB, NULL);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 1);
	th_free(ctx, p);
	th_destroy(ctx);

	/* GMLAKE_SMALL_SIZE=64K: 128 KiB is large, chunk aligned. */
	setenv("GMLAKE_SMALL_SIZE", "64K", 1);
	emu_config(&cfg);
	ck_assert_uint_eq(cfg.small_size, 64 * TH_KiB);
	ctx = th_ctx_cfg(&cfg);
	p = th_alloc_small(ctx, 128 * TH_KiB, NULL, 64 * TH_KiB);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 0);
	ck_assert_uint_eq((uintptr_t)p % (2 * TH_MiB), 0);
	th_free(ctx, p);
	p = th_alloc_small(ctx, 32 * TH_KiB, NULL, 64 * TH_KiB);
	th_stats(ctx, &st);
	ck_assert_int_eq(st.small_chunks.current, 1);
	th_free(ctx, p);
	th_destroy(ctx);
}
END_TEST

/* 16 chunks, the odd ones freed: 8 free chunks, none adjacent. */
static gmlake_ctx *fragmented(struct gmlake_config *cfg, void *p[16])
{
	gmlake_ctx *ctx;
	int i;

	cfg->emu_capacity = 32 * 2 * TH_MiB;
	ctx = th_ctx_cfg(cfg);
	for (i = 0; i < 16; i++)
		p[i] = th_alloc(ctx, 2 * TH_MiB, NULL);
	for (i = 1; i < 16; i += 2)
		th_free(ctx, p[i]);
	return ctx;
}

/* Free what fragmented() kept, then destroy ctx: each such case ends so. */
static void destroy_fragmented(gmlake_ctx *ctx, void *p[16])
{
	int i;

	for (i = 0; i < 16; i += 2)
		th_free(ctx, p[i]);
	th_destroy(ctx);
}

/* th_alloc() between two stats reads: what the allocation did. */
static void *alloc_measured(gmlake_ctx *ctx, size_t size,
			    struct gmlake_stats *before,
			    struct gmlake_stats *after)
{
	void *p;

	th_stats(ctx, before);
	p = th_alloc(ctx, size, NULL);
	th_stats(ctx, after);
	return p;
}

START_TEST(test_stitch_min_used)
{
	struct gmlake_config cfg;
	struct gmlake_stats s0, s1;
	gmlake_ctx *ctx;
	void *p[16], *q;

	/* Below stitch_min: grow instead of stitching. */
	emu_config(&cfg);
	cfg.stitch_min = 32 * TH_MiB;
	ctx = fragmented(&cfg, p);
	q = alloc_measured(ctx, 4 * TH_MiB, &s0, &s1);
	ck_assert_uint_eq(s1.stitches, s0.stitches);
	ck_assert_uint_eq(s1.grows, s0.grows + 1);
	ck_assert_int_eq(s1.chunks.current, s0.chunks.current + 2);
	th_free(ctx, q);
	destroy_fragmented(ctx, p);

	/* At or above it: stitch. */
	emu_config(&cfg);
	cfg.stitch_min = 4 * TH_MiB;
	ctx = fragmented(&cfg, p);
	q = alloc_measured(ctx, 4 * TH_MiB, &s0, &s1);
	ck_assert_uint_eq(s1.stitches, s0.stitches + 1);
	ck_assert_int_eq(s1.chunks.current, s0.chunks.current);
	th_free(ctx, q);
	destroy_fragmented(ctx, p);
}
END_TEST

START_TEST(test_stitch_cache_used)
{
	struct gmlake_config cfg;
	struct gmlake_stats s0, s1;
	gmlake_ctx *ctx;
	void *p[16], *a, *b;

	/* Bound 1: two stitched ranges freed, one stays cached. */
	emu_config(&cfg);
	cfg.stitch_cache_max = 1;
	ctx = fragmented(&cfg, p);
	th_stats(ctx, &s0);
	a = th_alloc(ctx, 4 * TH_MiB, NULL);
	b = th_alloc(ctx, 6 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_uint_eq(s1.stitches, s0.stitches + 2);
	th_free(ctx, a);
	th_free(ctx, b);
	th_stats(ctx, &s1);
	ck_assert_int_le(s1.stitched_cached.current, 1);
	ck_assert_uint_ge(s1.evictions, s0.evictions + 1);
	a = th_alloc(ctx, 16 * TH_MiB, NULL);
	th_stats(ctx, &s1);
	ck_assert_int_le(s1.stitched_cached.current, 1);
	th_free(ctx, a);
	th_stats(ctx, &s1);
	ck_assert_int_le(s1.stitched_cached.current, 1);
	destroy_fragmented(ctx, p);

	/* Bound 0: nothing is kept. */
	emu_config(&cfg);
	cfg.stitch_cache_max = 0;
	ctx = fragmented(&cfg, p);
	a = th_alloc_filled(ctx, 8 * TH_MiB, 1, NULL);
	th_free(ctx, a);
	th_stats(ctx, &s1);
	ck_assert_int_eq(s1.stitched_cached.current, 0);
	destroy_fragmented(ctx, p);
}
END_TEST

/*
 * A context from the environment serves a 4 MiB block and is destroyed
 * with stdout and stderr captured: what destroy printed on each.
 */
static void use_and_destroy_printing(char **out, char **err)
{
	struct th_capture co, ce;
	gmlake_ctx *ctx = NULL;
	int ret = gmlake_ctx_init(&ctx, NULL);
	void *p;

	ck_assert_msg(ret == 0, "gmlake_ctx_init: %d (%s)", ret,
		      gmlake_last_error());
	p = th_alloc(ctx, 4 * TH_MiB, NULL);
	th_free(ctx, p);
	th_capture_begin(&co, STDOUT_FILENO);
	th_capture_begin(&ce, STDERR_FILENO);
	th_destroy(ctx);
	*err = th_capture_end(&ce);
	*out = th_capture_end(&co);
}

START_TEST(test_show_stats_used)
{
	char *o, *e;

	/* Off: destroy prints nothing. */
	setenv("GMLAKE_BACKEND", "emu", 1);
	setenv("GMLAKE_EMU_CAPACITY", "64M", 1);
	use_and_destroy_printing(&o, &e);
	ck_assert_msg(!o[0] && !e[0], "printed at destroy: '%s' '%s'", o, e);
	free(o);
	free(e);

	/* On: a summary. */
	setenv("GMLAKE_SHOW_STATS", "1", 1);
	use_and_destroy_printing(&o, &e);
	ck_assert_msg(strlen(o) + strlen(e) > 20,
		      "GMLAKE_SHOW_STATS=1: nothing printed at destroy");
	free(o);
	free(e);
}
END_TEST

/* ---------------------------------------------------------------------- */

/*
 * A test case of the suite, each test starting without GMLAKE_* variables;
 * not th_tcase(): these run on the emulated device whatever the backend.
 */
static TCase *options_tcase(Suite *s, const char *name)
{
	TCase *tc = tcase_create(name);

	tcase_set_timeout(tc, TH_TIMEOUT);
	tcase_add_checked_fixture(tc, setup, NULL);
	suite_add_tcase(s, tc);
	return tc;
}

static Suite *options_suite(void)
{
	Suite *s = suite_create("options");
	TCase *tc;

	tc = options_tcase(s, "Parse");
	tcase_add_test(tc, test_defaults);
	tcase_add_loop_test(tc, test_size_values, 0, N_SIZE_OPTS);
	tcase_add_loop_test(tc, test_size_invalid, 0, N_SIZE_OPTS);
	tcase_add_test(tc, test_stitch_cache);
	tcase_add_test(tc, test_top_fit_auto);
	tcase_add_test(tc, test_spare_keep);
	tcase_add_test(tc, test_grow_slack);
	tcase_add_test(tc, test_device);
	tcase_add_test(tc, test_backend);
	tcase_add_test(tc, test_log_level);
	tcase_add_test(tc, test_show_stats);
	tcase_add_test(tc, test_publish);
	tcase_add_test(tc, test_stream_order);
	tcase_add_test(tc, test_exportable);
	tcase_add_test(tc, test_pack);
	tcase_add_test(tc, test_emu_lag);
	tcase_add_test(tc, test_offload_engine);
	tcase_add_test(tc, test_several);

	tc = options_tcase(s, "Validate");
	tcase_add_test(tc, test_unknown_name);
	tcase_add_test(tc, test_strict);
	tcase_add_test(tc, test_init_validation);
	tcase_add_test(tc, test_chunk_size_used);
	tcase_add_test(tc, test_env_capacity);
	tcase_add_test(tc, test_cuda_no_fallback);

	tc = options_tcase(s, "Effect");
	tcase_add_test(tc, test_small_size_used);
	tcase_add_test(tc, test_stitch_min_used);
	tcase_add_test(tc, test_stitch_cache_used);
	tcase_add_test(tc, test_show_stats_used);
	return s;
}

int main(void)
{
	return th_run_suite(options_suite());
}
