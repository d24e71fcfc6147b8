/* SPDX-License-Identifier: MIT */
/*
 * GMLAKE_* environment options: one table, each entry naming the variable,
 * its parser and the config field it sets. An invalid value gets a warning
 * naming the variable and leaves the default in place; so does a GMLAKE_*
 * name nothing reads (once a process), with the nearest known name. With
 * GMLAKE_STRICT set to a true value either is an error instead, as PyTorch
 * refuses a bad PYTORCH_CUDA_ALLOC_CONF.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "drv.h"
#include "error.h"
#include "options.h"

extern char **environ;

enum opt_type {
	OPT_SIZE, OPT_UINT, OPT_BOOL, OPT_BACKEND, OPT_LOG, OPT_ENGINE,
	OPT_TOP_FIT
};

struct option_def {
	const char *name;
	enum opt_type type;
	size_t offset;
	unsigned max;		/* OPT_UINT: the largest value; 0: any */
};

#define FIELD(f) offsetof(struct gmlake_config, f)

static const struct option_def options[] = {
	{ "GMLAKE_BACKEND", OPT_BACKEND, FIELD(backend), 0 },
	{ "GMLAKE_DEVICE", OPT_UINT, FIELD(device), 0 },
	{ "GMLAKE_CHUNK_SIZE", OPT_SIZE, FIELD(chunk_size), 0 },
	{ "GMLAKE_SMALL_SIZE", OPT_SIZE, FIELD(small_size), 0 },
	{ "GMLAKE_STITCH_MIN", OPT_SIZE, FIELD(stitch_min), 0 },
	{ "GMLAKE_STITCH_CACHE", OPT_UINT, FIELD(stitch_cache_max), 0 },
	{ "GMLAKE_EMU_CAPACITY", OPT_SIZE, FIELD(emu_capacity), 0 },
	{ "GMLAKE_EMU_GRANULARITY", OPT_SIZE, FIELD(emu_granularity), 0 },
	{ "GMLAKE_EMU_LAG", OPT_BOOL, FIELD(emu_lag), 0 },
	{ "GMLAKE_LOG_LEVEL", OPT_LOG, FIELD(log_level), 0 },
	{ "GMLAKE_SHOW_STATS", OPT_BOOL, FIELD(show_stats), 0 },
	{ "GMLAKE_PUBLISH", OPT_BOOL, FIELD(publish), 0 },
	{ "GMLAKE_DEVICE_LIMIT", OPT_SIZE, FIELD(device_limit), 0 },
	{ "GMLAKE_HOST_LIMIT", OPT_SIZE, FIELD(host_limit), 0 },
	{ "GMLAKE_HOST_PIN", OPT_SIZE, FIELD(host_pin), 0 },
	{ "GMLAKE_SPARE_KEEP_MS", OPT_UINT, FIELD(spare_keep_ms), 0 },
	{ "GMLAKE_STREAM_ORDER", OPT_BOOL, FIELD(stream_order), 0 },
	{ "GMLAKE_EXPORTABLE", OPT_BOOL, FIELD(exportable), 0 },
	{ "GMLAKE_PACK", OPT_BOOL, FIELD(pack), 0 },
	{ "GMLAKE_TOP_FIT", OPT_TOP_FIT, FIELD(top_fit), 0 },
	{ "GMLAKE_GROW_HANDLE", OPT_SIZE, FIELD(grow_handle), 0 },
	{ "GMLAKE_GROW_SLACK", OPT_UINT, FIELD(grow_slack),
	  GMLAKE_GROW_SLACK_MAX },
	{ "GMLAKE_OFFLOAD_ENGINE", OPT_ENGINE, FIELD(offload_engine), 0 },
};

/* "64", "2M", "1GiB", "512k": bytes with an optional binary suffix. */
int gml_parse_size(const char *s, size_t *out)
{
	unsigned long long v;
	unsigned shift = 0;
	char *end;

	if (!s || *s < '0' || *s > '9')
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno)
		return -EINVAL;
	switch (*end) {
	case 'k': case 'K': shift = 10; end++; break;
	case 'm': case 'M': shift = 20; end++; break;
	case 'g': case 'G': shift = 30; end++; break;
	case 't': case 'T': shift = 40; end++; break;
	}
	if (shift && (*end == 'i' || *end == 'I'))
		end++;
	if (shift && (*end == 'b' || *end == 'B'))
		end++;
	if (*end != '\0' || (shift && v > (SIZE_MAX >> shift)))
		return -EINVAL;
	*out = (size_t)v << shift;
	return 0;
}

int gml_parse_bool(const char *s, bool *out)
{
	static const char *const yes[] = { "1", "true", "yes", "on" };
	static const char *const no[] = { "0", "false", "no", "off" };

	for (size_t i = 0; i < 4; i++) {
		if (!strcasecmp(s, yes[i]))
			return *out = true, 0;
		if (!strcasecmp(s, no[i]))
			return *out = false, 0;
	}
	return -EINVAL;
}

/* A name of the backend table (lib/dev.c). */
static int parse_backend(const char *s, int *out)
{
	const struct gml_backend *be = gml_backend_by_name(s);

	if (!be)
		return -EINVAL;
	*out = be->id;
	return 0;
}

static int parse_log(const char *s, int *out)
{
	static const char *const names[] = { "error", "warn", "info", "debug" };

	for (int i = 0; i < 4; i++) {
		if (!strcasecmp(s, names[i]) ||
		    (s[0] == '0' + i && s[1] == '\0'))
			return *out = i, 0;
	}
	if (!strcasecmp(s, "warning"))
		return *out = GMLAKE_LOG_WARN, 0;
	return -EINVAL;
}

static int parse_engine(const char *s, int *out)
{
	if (!strcasecmp(s, "auto"))
		*out = GMLAKE_OFFLOAD_ENGINE_NONE;
	else if (!strcasecmp(s, "uring") || !strcasecmp(s, "io_uring"))
		*out = GMLAKE_OFFLOAD_ENGINE_URING;
	else if (!strcasecmp(s, "thread"))
		*out = GMLAKE_OFFLOAD_ENGINE_THREAD;
	else
		return -EINVAL;
	return 0;
}

static int parse_uint(const char *s, unsigned *out)
{
	unsigned long v;
	char *end;

	if (*s < '0' || *s > '9')
		return -EINVAL;
	errno = 0;
	v = strtoul(s, &end, 10);
	if (errno || *end != '\0' || v > INT32_MAX)
		return -EINVAL;
	*out = (unsigned)v;
	return 0;
}

static int apply(const struct option_def *o, const char *val,
		 struct gmlake_config *cfg)
{
	char *field = (char *)cfg + o->offset;
	unsigned u;

	switch (o->type) {
	case OPT_SIZE:
		return gml_parse_size(val, (size_t *)field);
	case OPT_UINT:
		if (parse_uint(val, &u) || (o->max && u > o->max))
			return -EINVAL;
		if (o->offset == FIELD(device))
			*(int *)field = (int)u;
		else
			*(unsigned *)field = u;
		return 0;
	case OPT_BOOL:
		return gml_parse_bool(val, (bool *)field);
	case OPT_BACKEND:
		return parse_backend(val, (int *)field);
	case OPT_LOG:
		return parse_log(val, (int *)field);
	case OPT_ENGINE:
		return parse_engine(val, (int *)field);
	case OPT_TOP_FIT:	/* a size, or auto */
		if (!strcasecmp(val, "auto"))
			return *(size_t *)field = GMLAKE_TOP_FIT_AUTO, 0;
		return gml_parse_size(val, (size_t *)field);
	}
	return -EINVAL;
}

void gml_config_defaults(struct gmlake_config *cfg)
{
	memset(cfg, 0, sizeof(*cfg));
	cfg->version = GMLAKE_CONFIG_VERSION;
	cfg->size = sizeof(*cfg);
	cfg->backend = GMLAKE_BACKEND_DEFAULT;
	cfg->small_size = 1 << 20;
	cfg->stitch_min = 2 << 20;
	cfg->stitch_cache_max = 256;
	cfg->emu_capacity = (size_t)64 << 30;
	cfg->emu_granularity = 2 << 20;
	cfg->log_level = GMLAKE_LOG_WARN;
	cfg->publish = true;
	cfg->host_limit = (size_t)16 << 30;
	cfg->spare_keep_ms = 5000;
	cfg->stream_order = true;
	cfg->exportable = true;
	cfg->grow_handle = 20 << 20;
	cfg->grow_slack = 20;
	cfg->top_fit = GMLAKE_TOP_FIT_AUTO;
}

/*
 * GMLAKE_* names read outside this table: by the stats reader (lib/
 * shm_read.c), the Python package and the tests; GMLAKE_STRICT here.
 */
static const char *const other_names[] = {
	"GMLAKE_STRICT", "GMLAKE_SHM_DIR",
	"GMLAKE_LIBRARY", "GMLAKE_CACHE_DIR", "GMLAKE_TORCH_BACKEND",
	"GMLAKE_TORCH_SETTLE_OPTIMIZER", "GMLAKE_SKIP_VERSION_CHECK",
	"GMLAKE_INCLUDE_DIR", "GMLAKE_STATS_LAYOUT", "GMLAKE_OFFLOAD_LAYOUT",
};

#define NOPTIONS (sizeof(options) / sizeof(options[0]))
#define NOTHER (sizeof(other_names) / sizeof(other_names[0]))

static const char *known_name(size_t i)
{
	return i < NOPTIONS ? options[i].name : other_names[i - NOPTIONS];
}

/* Edit distance of a and b, capped at 3 (names are short). */
static unsigned name_distance(const char *a, size_t la, const char *b)
{
	unsigned row[64], prev, tmp;
	size_t lb = strlen(b);

	if (la >= 64 || lb >= 64)
		return 3;
	for (size_t j = 0; j <= lb; j++)
		row[j] = (unsigned)j;
	for (size_t i = 1; i <= la; i++) {
		prev = row[0];
		row[0] = (unsigned)i;
		for (size_t j = 1; j <= lb; j++) {
			unsigned best = prev + (a[i - 1] != b[j - 1]);

			if (row[j] + 1 < best)
				best = row[j] + 1;
			if (row[j - 1] + 1 < best)
				best = row[j - 1] + 1;
			tmp = row[j];
			row[j] = best;
			prev = tmp;
		}
	}
	return row[lb] < 3 ? row[lb] : 3;
}

/*
 * Every GMLAKE_* variable of the environment that nothing reads: a warning
 * naming it and the nearest known name, once a process (warned), or with
 * strict the error for the first one.
 */
static int check_unknown_names(bool strict)
{
	static atomic_bool warned;
	int ret = 0;

	if (!strict && atomic_exchange(&warned, true))
		return 0;
	for (char **e = environ; e && *e; e++) {
		const char *eq = strchr(*e, '='), *near = NULL;
		size_t len = eq ? (size_t)(eq - *e) : strlen(*e);
		unsigned best = 3;

		if (strncmp(*e, "GMLAKE_", 7))
			continue;
		for (size_t i = 0; i < NOPTIONS + NOTHER; i++) {
			const char *k = known_name(i);
			unsigned d;

			if (strlen(k) == len && !strncmp(k, *e, len))
				break;
			d = name_distance(*e, len, k);
			if (d < best)
				best = d, near = k;
			if (i + 1 < NOPTIONS + NOTHER)
				continue;
			if (strict && !ret)
				ret = gml_set_error(-EINVAL, "%.*s: unknown "
						    "variable (GMLAKE_STRICT)%s%s%s",
						    (int)len, *e,
						    near ? "; did you mean " : "",
						    near ? near : "",
						    near ? "?" : "");
			else if (!strict)
				gml_log(GMLAKE_LOG_WARN, "%.*s: unknown "
					"variable, ignored%s%s%s", (int)len, *e,
					near ? "; did you mean " : "",
					near ? near : "", near ? "?" : "");
		}
	}
	return ret;
}

/* Apply the environment's value of option o, if set, to cfg; a bad value
 * warns and leaves cfg as it was, or with strict fails (-EINVAL). */
static int apply_env(const struct option_def *o, struct gmlake_config *cfg,
		     bool strict)
{
	const char *val = getenv(o->name);

	if (!val || !apply(o, val, cfg))
		return 0;
	if (strict)
		return gml_set_error(-EINVAL, "%s: invalid value '%s' "
				     "(GMLAKE_STRICT)", o->name, val);
	gml_log(GMLAKE_LOG_WARN, "%s: invalid value '%s', using the default",
		o->name, val);
	return 0;
}

/* GMLAKE_STRICT: a true value; anything else, unset included, is off. */
static bool strict_mode(void)
{
	const char *s = getenv("GMLAKE_STRICT");
	bool on = false;

	return s && !gml_parse_bool(s, &on) && on;
}

GML_EXPORT int gmlake_config_init(struct gmlake_config *cfg)
{
	bool strict = strict_mode();
	int ret;

	if (!cfg)
		return gml_set_error(-EINVAL, "gmlake_config_init: cfg is NULL");
	gml_config_defaults(cfg);
	for (size_t i = 0; i < NOPTIONS; i++) {
		ret = apply_env(&options[i], cfg, strict);
		if (ret)
			return ret;
	}
	ret = check_unknown_names(strict);
	if (ret)
		return ret;
	gml_log_set_level(cfg->log_level);	/* the process's, not cfg's */
	return 0;
}

int gml_config_backend(const struct gmlake_config *cfg)
{
	struct gmlake_config env = { .backend = GMLAKE_BACKEND_DEFAULT };

	if (cfg->backend != GMLAKE_BACKEND_DEFAULT)
		return cfg->backend;
	for (size_t i = 0; i < sizeof(options) / sizeof(options[0]); i++)
		if (options[i].offset == FIELD(backend))
			apply_env(&options[i], &env, false);
	if (env.backend != GMLAKE_BACKEND_DEFAULT)
		return env.backend;
	return gml_backend_default()->id;
}
