/* SPDX-License-Identifier: MIT */
/*
 * fuzz_sidecar: the trace reader's JSON sidecar parser on arbitrary bytes.
 *
 * gmlake-replay reads NAME.trace.json and NAME.expandable.json beside a
 * trace with gml_trace_sidecar_load(), which reads the file and hands it
 * to gml_trace_sidecar_parse(). The input goes, in a heap buffer of
 * exactly its length (so that ASan sees any read past its end), to the
 * parser, and through a memfd to the loader. The results must keep
 * trace.h's promises:
 *   - 0, or -EINVAL with a message and no field marked valid;
 *   - only known bits in have, every valid field finite;
 *   - the same result with why NULL, and from the loader as from the
 *     parser;
 *   - what was parsed, written back as a flat object, parses to the same
 *     fields.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fuzz.h"
#include "trace.h"

#define HAVE_ALL                                                        \
	(GML_SIDECAR_HAVE_STEPS | GML_SIDECAR_HAVE_STEP_MS |            \
	 GML_SIDECAR_HAVE_PEAK_ALLOC | GML_SIDECAR_HAVE_PEAK_RESERVED | \
	 GML_SIDECAR_HAVE_FRAG_PCT | GML_SIDECAR_HAVE_STEADY_STEP_MS)

static const struct {
	const char *key;
	unsigned bit;
	size_t off;
} fields[] = {
	{"steps", GML_SIDECAR_HAVE_STEPS,
	 offsetof(struct gml_trace_sidecar, steps)},
	{"step_ms", GML_SIDECAR_HAVE_STEP_MS,
	 offsetof(struct gml_trace_sidecar, step_ms)},
	{"peak_alloc", GML_SIDECAR_HAVE_PEAK_ALLOC,
	 offsetof(struct gml_trace_sidecar, peak_alloc)},
	{"peak_reserved", GML_SIDECAR_HAVE_PEAK_RESERVED,
	 offsetof(struct gml_trace_sidecar, peak_reserved)},
	{"frag_pct", GML_SIDECAR_HAVE_FRAG_PCT,
	 offsetof(struct gml_trace_sidecar, frag_pct)},
	{"steady_step_ms", GML_SIDECAR_HAVE_STEADY_STEP_MS,
	 offsetof(struct gml_trace_sidecar, steady_step_ms)},
};
#define NFIELDS (sizeof(fields) / sizeof(fields[0]))

static double field(const struct gml_trace_sidecar *sc, size_t i)
{
	double v;

	memcpy(&v, (const char *)sc + fields[i].off, sizeof(v));
	return v;
}

/* The valid fields of a and b are the same, bit for bit. */
static bool same(const struct gml_trace_sidecar *a,
		 const struct gml_trace_sidecar *b)
{
	if (a->have != b->have)
		return false;
	for (size_t i = 0; i < NFIELDS; i++) {
		double x = field(a, i), y = field(b, i);

		if ((a->have & fields[i].bit) && memcmp(&x, &y, sizeof(x)))
			return false;
	}
	return true;
}

static void check_result(const char *what, int ret, const char *why,
			 const struct gml_trace_sidecar *sc)
{
	if (ret == -EINVAL) {
		if (!why || !*why)
			fz_fail("%s: -EINVAL without a message", what);
		if (sc->have)
			fz_fail("%s: -EINVAL with fields marked valid (%#x)",
				what, sc->have);
		return;
	}
	if (ret != 0)
		fz_fail("%s returned %d", what, ret);
	if (sc->have & ~HAVE_ALL)
		fz_fail("%s: unknown bits in have (%#x)", what, sc->have);
	for (size_t i = 0; i < NFIELDS; i++)
		if ((sc->have & fields[i].bit) && !isfinite(field(sc, i)))
			fz_fail("%s: %s is not finite", what, fields[i].key);
}

/* Write sc's valid fields as a flat object and parse that again. */
static void round_trip(const struct gml_trace_sidecar *sc)
{
	struct gml_trace_sidecar again;
	const char *why = NULL;
	char text[512];
	size_t n = 0;
	int ret;

	text[n++] = '{';
	for (size_t i = 0; i < NFIELDS; i++) {
		if (!(sc->have & fields[i].bit))
			continue;
		n += (size_t)snprintf(text + n, sizeof(text) - n,
				      "%s\"%s\": %.17g", n > 1 ? ", " : "",
				      fields[i].key, field(sc, i));
	}
	text[n++] = '}';
	ret = gml_trace_sidecar_parse(text, n, &again, &why);
	if (ret != 0)
		fz_fail("round trip: %.*s: %d (%s)", (int)n, text, ret,
			why ? why : "");
	if (!same(sc, &again))
		fz_fail("round trip: %.*s parses to other fields", (int)n,
			text);
}

/* The loader on the same bytes, through a memfd: the same result. */
static void load(const char *text, size_t len, int want,
		 const struct gml_trace_sidecar *sc)
{
	struct gml_trace_sidecar loaded;
	const char *why = NULL;
	char path[64];
	int fd, ret;

	if (len >= (1 << 20))
		return; /* past the loader's limit: -EFBIG, on purpose */
	fd = memfd_create("fuzz_sidecar", MFD_CLOEXEC);
	if (fd < 0)
		return;
	if (len && write(fd, text, len) != (ssize_t)len) {
		close(fd);
		return;
	}
	snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
	ret = gml_trace_sidecar_load(path, &loaded, &why);
	close(fd);
	if (ret == -ENOENT || ret == -EACCES)
		return; /* no /proc here */
	check_result("sidecar_load", ret, why, &loaded);
	if (ret != want)
		fz_fail("sidecar_load gives %d, sidecar_parse %d", ret, want);
	if (!ret && !same(sc, &loaded))
		fz_fail("sidecar_load and sidecar_parse differ");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct gml_trace_sidecar sc, sc2;
	const char *why = NULL;
	char *text = malloc(size ? size : 1);
	int ret;

	if (!text)
		return 0;
	if (size)
		memcpy(text, data, size);
	ret = gml_trace_sidecar_parse(text, size, &sc, &why);
	check_result("sidecar_parse", ret, why, &sc);
	/* NULL for why must be accepted too, with the same result. */
	if (gml_trace_sidecar_parse(text, size, &sc2, NULL) != ret ||
	    !same(&sc, &sc2))
		fz_fail("sidecar_parse: a different result without why");
	if (!ret)
		round_trip(&sc);
	load(text, size, ret, &sc);
	free(text);
	return 0;
}
