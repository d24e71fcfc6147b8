/* SPDX-License-Identifier: MIT */
/*
 * Check suite "trace": the allocation-trace reader in tools/trace.c. Line
 * parsing (good and every malformed form), step lines, header comments,
 * plain and gzip files, long lines, truncated files and the JSON sidecars.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <check.h>
#include <zlib.h>

#include "trace.h"

/* A temporary file holding len bytes of text, gzip-compressed if gz. */
static char *write_temp(const char *text, size_t len, bool gz)
{
	const char *dir = getenv("TMPDIR");
	char *path;
	gzFile f;
	FILE *fp;
	int fd;

	if (!dir || !*dir)
		dir = "/tmp";
	path = malloc(strlen(dir) + sizeof("/check_trace.XXXXXX"));
	ck_assert_ptr_nonnull(path);
	sprintf(path, "%s/check_trace.XXXXXX", dir);
	fd = mkstemp(path);
	ck_assert_int_ge(fd, 0);
	if (gz) {
		f = gzdopen(fd, "wb");
		ck_assert_ptr_nonnull(f);
		if (len)
			ck_assert_int_eq(gzwrite(f, text, (unsigned)len),
					 (int)len);
		ck_assert_int_eq(gzclose(f), Z_OK);
	} else {
		fp = fdopen(fd, "w");
		ck_assert_ptr_nonnull(fp);
		ck_assert_uint_eq(fwrite(text, 1, len, fp), len);
		ck_assert_int_eq(fclose(fp), 0);
	}
	return path;
}

static void drop_temp(char *path)
{
	unlink(path);
	free(path);
}

static int parse(const char *line, struct gml_trace_event *ev, const char **why)
{
	return gml_trace_parse_line(line, strlen(line), ev, why);
}

/* Expect line to be rejected, with a message containing want. */
static void expect_bad(const char *line, size_t len, const char *want)
{
	struct gml_trace_event ev;
	const char *why = NULL;

	ck_assert_msg(gml_trace_parse_line(line, len, &ev, &why) == -EINVAL,
		      "accepted \"%.*s\"", (int)len, line);
	ck_assert_ptr_nonnull(why);
	ck_assert_msg(strstr(why, want), "\"%.*s\": \"%s\", wanted \"%s\"",
		      (int)len, line, why, want);
}

START_TEST(test_line_alloc)
{
	struct gml_trace_event ev;
	const char *why;

	ck_assert_int_eq(parse("alloc 139861348581376 262144000 0", &ev, &why),
			 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_ALLOC);
	ck_assert_uint_eq(ev.addr, 139861348581376ull);
	ck_assert_uint_eq(ev.size, 262144000);
	ck_assert_uint_eq(ev.stream, 0);
	ck_assert_str_eq(why, "");
}
END_TEST

START_TEST(test_line_kinds)
{
	struct gml_trace_event ev;
	char line[64];
	int k;

	/* Size 1: a step line's settle flag is 0 or 1; a trim's fields
	 * are 0. */
	for (k = 0; k < GML_TRACE_OTHER; k++) {
		snprintf(line, sizeof(line),
			 k == GML_TRACE_TRIM ? "%s 0 0 0" : "%s 1 1 3",
			 gml_trace_kind_name(k));
		ck_assert_int_eq(parse(line, &ev, NULL), 1);
		ck_assert_int_eq(ev.kind, k);
	}
	ck_assert_ptr_null(gml_trace_kind_name(-1));
	ck_assert_ptr_null(gml_trace_kind_name(GML_TRACE_KIND_COUNT));
}
END_TEST

START_TEST(test_line_unknown_action)
{
	struct gml_trace_event ev;

	ck_assert_int_eq(parse("snapshot 0 0 0", &ev, NULL), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_OTHER);
	ck_assert_int_eq(parse("oom 1 2 3", &ev, NULL), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_OTHER);
	/* Case matters, and a prefix is not the action. */
	ck_assert_int_eq(parse("Alloc 1 2 3", &ev, NULL), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_OTHER);
	ck_assert_int_eq(parse("allocx 1 2 3", &ev, NULL), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_OTHER);
	ck_assert_int_eq(parse("a_1 1 2 3", &ev, NULL), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_OTHER);
}
END_TEST

START_TEST(test_line_blanks)
{
	struct gml_trace_event ev;

	ck_assert_int_eq(parse("  free_completed\t7  8 \t9  ", &ev, NULL), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_FREE_COMPLETED);
	ck_assert_uint_eq(ev.addr, 7);
	ck_assert_uint_eq(ev.size, 8);
	ck_assert_uint_eq(ev.stream, 9);
	ck_assert_int_eq(parse("alloc 1 2 3\r", &ev, NULL), 1);
	ck_assert_uint_eq(ev.stream, 3);
	ck_assert_int_eq(parse("alloc 1 2 3\r\r", &ev, NULL), 1);
	ck_assert_int_eq(parse("alloc 0 0 0", &ev, NULL), 1);
	ck_assert_int_eq(parse("alloc 007 0010 00", &ev, NULL), 1);
	ck_assert_uint_eq(ev.addr, 7);
	ck_assert_uint_eq(ev.size, 10);
}
END_TEST

/* step K S 0: K the step's index, S 1 when settling, 0 when steady. */
START_TEST(test_line_step)
{
	struct gml_trace_event ev;
	const char *why;

	ck_assert_str_eq(gml_trace_kind_name(GML_TRACE_STEP), "step");
	ck_assert_int_eq(parse("step 0 1 0", &ev, &why), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_STEP);
	ck_assert_uint_eq(ev.addr, 0);
	ck_assert_uint_eq(ev.size, 1);
	ck_assert_uint_eq(ev.stream, 0);
	ck_assert_str_eq(why, "");
	ck_assert_int_eq(parse("step 27 0 0", &ev, &why), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_STEP);
	ck_assert_uint_eq(ev.addr, 27);
	ck_assert_uint_eq(ev.size, 0);
	ck_assert_int_eq(parse(" step\t18446744073709551615 0 0\r", &ev, NULL),
			 1);
	ck_assert_uint_eq(ev.addr, UINT64_MAX);
	/* Only "step" itself is a step line. */
	ck_assert_int_eq(parse("steps 1 7 0", &ev, NULL), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_OTHER);
	ck_assert_int_eq(parse("Step 1 7 0", &ev, NULL), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_OTHER);

	expect_bad("step 3 2 0", 10, "settle flag");
	expect_bad("step 3 18446744073709551615 0", 29, "settle flag");
	expect_bad("step 3 1", 8, "too few fields");
	expect_bad("step 3 1 0 0", 12, "too many fields");
	expect_bad("step x 1 0", 10, "not an unsigned decimal");
}
END_TEST

/* long_lived F 0 0: F 1 turns gmlake_long_lived() on, 0 off. */
START_TEST(test_line_long_lived)
{
	struct gml_trace_event ev;
	const char *why;

	ck_assert_str_eq(gml_trace_kind_name(GML_TRACE_LONG_LIVED),
			 "long_lived");
	ck_assert_int_eq(parse("long_lived 1 0 0", &ev, &why), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_LONG_LIVED);
	ck_assert_uint_eq(ev.addr, 1);
	ck_assert_str_eq(why, "");
	ck_assert_int_eq(parse("long_lived 0 0 0", &ev, &why), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_LONG_LIVED);
	ck_assert_uint_eq(ev.addr, 0);
	ck_assert_int_eq(parse("long_live 1 0 0", &ev, NULL), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_OTHER);

	expect_bad("long_lived 2 0 0", 16, "long_lived's flag");
	expect_bad("long_lived 18446744073709551615 0 0", 35,
		   "long_lived's flag");
	expect_bad("long_lived 1 0", 14, "too few fields");
}
END_TEST

/* trim 0 0 0: the cache given back; any other field is malformed. */
START_TEST(test_line_trim)
{
	struct gml_trace_event ev;
	const char *why;

	ck_assert_str_eq(gml_trace_kind_name(GML_TRACE_TRIM), "trim");
	ck_assert_int_eq(parse("trim 0 0 0", &ev, &why), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_TRIM);
	ck_assert_str_eq(why, "");
	expect_bad("trim 1 0 0", 10, "trim's fields");
	expect_bad("trim 0 4096 0", 13, "trim's fields");
	expect_bad("trim 0 0 7", 10, "trim's fields");
	expect_bad("trim 0 0", 8, "too few fields");
}
END_TEST

/* Step lines in a file: each a STEP event; a bad flag names its line. */
START_TEST(test_file_steps)
{
	static const char text[] = "# pytorch 2.11.0 workload=steps steps=2\n"
				   "alloc 4096 1024 0\n"
				   "step 0 1 0\n"
				   "alloc 8192 2048 0\n"
				   "step 1 0 0\n"
				   "free_completed 8192 2048 0\n"
				   "step 2 2 0\n"
				   "free_completed 4096 1024 0\n";
	static const enum gml_trace_kind want[] = {
		GML_TRACE_ALLOC, GML_TRACE_STEP,	   GML_TRACE_ALLOC,
		GML_TRACE_STEP,	 GML_TRACE_FREE_COMPLETED,
	};
	const struct gml_trace_info *info;
	struct gml_trace_event ev;
	struct gml_trace *t;
	uint64_t k = 0;
	char *path;
	size_t n;

	path = write_temp(text, sizeof(text) - 1, true);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	info = gml_trace_info(t);
	for (n = 0; n < sizeof(want) / sizeof(want[0]); n++) {
		ck_assert_int_eq(gml_trace_next(t, &ev), 1);
		ck_assert_int_eq(ev.kind, want[n]);
		if (ev.kind != GML_TRACE_STEP)
			continue;
		ck_assert_uint_eq(ev.addr, k);
		ck_assert_uint_eq(ev.size, k == 0 ? 1 : 0);
		k++;
	}
	ck_assert_int_eq(gml_trace_next(t, &ev), -EINVAL);
	ck_assert_ptr_nonnull(strstr(gml_trace_error(t), ":7: step's settle"));
	ck_assert_ptr_nonnull(strstr(gml_trace_error(t), path));
	ck_assert_int_eq(gml_trace_next(t, &ev), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_FREE_COMPLETED);
	ck_assert_int_eq(gml_trace_next(t, &ev), 0);
	ck_assert_uint_eq(info->kinds[GML_TRACE_STEP], 2);
	ck_assert_uint_eq(info->kinds[GML_TRACE_OTHER], 0);
	ck_assert_uint_eq(info->errors, 1);
	gml_trace_close(t);
	drop_temp(path);
}
END_TEST

START_TEST(test_line_limits)
{
	struct gml_trace_event ev;

	ck_assert_int_eq(parse("alloc 18446744073709551615 "
			       "18446744073709551615 18446744073709551615",
			       &ev, NULL),
			 1);
	ck_assert_uint_eq(ev.addr, UINT64_MAX);
	ck_assert_uint_eq(ev.size, UINT64_MAX);
	ck_assert_uint_eq(ev.stream, UINT64_MAX);
	ck_assert_int_eq(
		parse("alloc 0000000000000000000000000000001 1 1", &ev, NULL),
		1);
	ck_assert_uint_eq(ev.addr, 1);
}
END_TEST

START_TEST(test_line_comment_blank)
{
	struct gml_trace_event ev;
	const char *why;

	ck_assert_int_eq(parse("", &ev, &why), 0);
	ck_assert_int_eq(parse("   \t ", &ev, &why), 0);
	ck_assert_int_eq(parse("\r", &ev, &why), 0);
	ck_assert_int_eq(parse("# action addr size stream", &ev, &why), 0);
	ck_assert_int_eq(parse("  #alloc 1 2 3", &ev, &why), 0);
	ck_assert_int_eq(parse("#", &ev, &why), 0);
	ck_assert_int_eq(gml_trace_parse_line(NULL, 0, &ev, &why), 0);
}
END_TEST

START_TEST(test_line_malformed)
{
	static const char nul_action[] = "al\0oc 1 2 3";
	static const char nul_field[] = "alloc 1\0002 3";
	static const char nul_end[] = "alloc 1 2 3\0";
	char long_action[64];

	expect_bad("alloc", 5, "too few fields");
	expect_bad("alloc 1", 7, "too few fields");
	expect_bad("alloc 1 2", 9, "too few fields");
	expect_bad("alloc 1 2 ", 10, "too few fields");
	expect_bad("alloc 1 2 3 4", 13, "too many fields");
	expect_bad("alloc 1 2 3 #", 13, "too many fields");
	expect_bad("alloc x 2 3", 11, "not an unsigned decimal");
	expect_bad("alloc 1 2x 3", 12, "not an unsigned decimal");
	expect_bad("alloc 1 2 3x", 12, "not an unsigned decimal");
	expect_bad("alloc -1 2 3", 12, "not an unsigned decimal");
	expect_bad("alloc +1 2 3", 12, "not an unsigned decimal");
	expect_bad("alloc 0x10 2 3", 14, "not an unsigned decimal");
	expect_bad("alloc 1.5 2 3", 13, "not an unsigned decimal");
	expect_bad("alloc 1,2 3 4", 13, "not an unsigned decimal");
	expect_bad("alloc 18446744073709551616 2 3", 30, "out of range");
	expect_bad("alloc 1 99999999999999999999 3", 30, "out of range");
	expect_bad("alloc 1 2 184467440737095516150", 31, "out of range");
	expect_bad("1alloc 1 2 3", 12, "start with a letter");
	expect_bad("_alloc 1 2 3", 12, "start with a letter");
	expect_bad("12 1 2 3", 8, "start with a letter");
	expect_bad("all-oc 1 2 3", 12, "bad character");
	expect_bad("alloc: 1 2 3", 12, "bad character");
	expect_bad("\xff\xfe 1 2 3", 9, "start with a letter");
	expect_bad("alloc\xc3\xa9 1 2 3", 13, "bad character");
	expect_bad(nul_action, sizeof(nul_action) - 1, "bad character");
	expect_bad(nul_field, sizeof(nul_field) - 1, "not an unsigned");
	expect_bad(nul_end, sizeof(nul_end) - 1, "not an unsigned");
	expect_bad("alloc 1 2 3\r4", 13, "not an unsigned");
	expect_bad("alloc\v1 2 3", 11, "bad character");
	memset(long_action, 'a', sizeof(long_action) - 1);
	long_action[sizeof(long_action) - 1] = '\0';
	expect_bad(long_action, strlen(long_action), "action too long");
}
END_TEST

/* The length given is honoured: bytes past it are never read. */
START_TEST(test_line_length_bound)
{
	struct gml_trace_event ev;
	char *buf;

	buf = malloc(12);
	ck_assert_ptr_nonnull(buf);
	memcpy(buf, "alloc 1 2 34", 12); /* no NUL */
	ck_assert_int_eq(gml_trace_parse_line(buf, 12, &ev, NULL), 1);
	ck_assert_uint_eq(ev.stream, 34);
	ck_assert_int_eq(gml_trace_parse_line(buf, 11, &ev, NULL), 1);
	ck_assert_uint_eq(ev.stream, 3);
	ck_assert_int_eq(gml_trace_parse_line(buf, 10, &ev, NULL), -EINVAL);
	ck_assert_int_eq(gml_trace_parse_line(buf, 9, &ev, NULL), -EINVAL);
	ck_assert_int_eq(gml_trace_parse_line(buf + 12, 0, &ev, NULL), 0);
	free(buf);
}
END_TEST

/* Random bytes: every answer is one of the three, never a crash. */
START_TEST(test_line_random)
{
	static const char alphabet[] = "alocfre_0123456789 \t\r#-x\0\xff";
	struct gml_trace_event ev;
	const char *why;
	uint64_t seed = 0x9e3779b97f4a7c15ull;
	char line[96];
	int i, ret;
	size_t j, len;

	for (i = 0; i < 200000; i++) {
		seed = seed * 6364136223846793005ull + 1442695040888963407ull;
		len = (seed >> 33) % sizeof(line);
		for (j = 0; j < len; j++) {
			seed = seed * 6364136223846793005ull + 1;
			line[j] = alphabet[(seed >> 40) % (sizeof(alphabet))];
		}
		ret = gml_trace_parse_line(line, len, &ev, &why);
		ck_assert(ret == 1 || ret == 0 || ret == -EINVAL);
		ck_assert_ptr_nonnull(why);
		if (ret == 1)
			ck_assert(ev.kind >= 0 &&
				  ev.kind < GML_TRACE_KIND_COUNT);
	}
}
END_TEST

START_TEST(test_header_first_line)
{
	static const char line[] =
		"# pytorch 2.11.0+cu130 workload=plain "
		"steps=12 peak_alloc=17388220416 peak_reserved=19631439872";
	struct gml_trace_header hdr = {0};
	const char *why;

	ck_assert_int_eq(
		gml_trace_parse_comment(line, strlen(line), true, &hdr, &why),
		0);
	ck_assert_uint_eq(hdr.have, GML_TRACE_HAVE_PRODUCER |
					    GML_TRACE_HAVE_WORKLOAD |
					    GML_TRACE_HAVE_STEPS |
					    GML_TRACE_HAVE_PEAK_ALLOC |
					    GML_TRACE_HAVE_PEAK_RESERVED);
	ck_assert_str_eq(hdr.producer, "pytorch 2.11.0+cu130");
	ck_assert_str_eq(hdr.workload, "plain");
	ck_assert_uint_eq(hdr.steps, 12);
	ck_assert_uint_eq(hdr.peak_alloc, 17388220416ull);
	ck_assert_uint_eq(hdr.peak_reserved, 19631439872ull);
}
END_TEST

START_TEST(test_header_other_comments)
{
	struct gml_trace_header hdr = {0};
	const char *line;

	/* Not the first line: words without '=' are no producer. */
	line = "# action addr size stream";
	ck_assert_int_eq(
		gml_trace_parse_comment(line, strlen(line), false, &hdr, NULL),
		0);
	ck_assert_uint_eq(hdr.have, 0);
	/* Unknown keys are ignored; later values replace earlier ones. */
	line = "#steps=3 foo=bar =x y= steps=4";
	ck_assert_int_eq(
		gml_trace_parse_comment(line, strlen(line), false, &hdr, NULL),
		0);
	ck_assert_uint_eq(hdr.have, GML_TRACE_HAVE_STEPS);
	ck_assert_uint_eq(hdr.steps, 4);
	/* The producer stops at the first key=value word. */
	line = "# tool 1 steps=5 more words";
	memset(&hdr, 0, sizeof(hdr));
	ck_assert_int_eq(
		gml_trace_parse_comment(line, strlen(line), true, &hdr, NULL),
		0);
	ck_assert_str_eq(hdr.producer, "tool 1");
	ck_assert_uint_eq(hdr.steps, 5);
}
END_TEST

START_TEST(test_header_malformed)
{
	static const char *const bad[] = {
		"# steps=abc",
		"# steps=",
		"# steps=-1",
		"# steps=1x",
		"# peak_alloc=99999999999999999999",
		"# peak_reserved=1.5",
		"# workload=",
		"# workload=a\x01",
		("# workload=aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
		 "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"),
		"alloc 1 2 3",
		"",
	};
	struct gml_trace_header hdr;
	const char *why;
	size_t i;

	for (i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		memset(&hdr, 0, sizeof(hdr));
		why = NULL;
		ck_assert_msg(gml_trace_parse_comment(bad[i], strlen(bad[i]),
						      true, &hdr,
						      &why) == -EINVAL,
			      "accepted \"%s\"", bad[i]);
		ck_assert_ptr_nonnull(why);
		ck_assert_str_ne(why, "");
	}
}
END_TEST

START_TEST(test_header_long_producer)
{
	struct gml_trace_header hdr = {0};
	char line[400];

	memset(line, 'p', sizeof(line));
	line[0] = '#';
	line[1] = ' ';
	ck_assert_int_eq(
		gml_trace_parse_comment(line, sizeof(line), true, &hdr, NULL),
		0);
	ck_assert_uint_eq(strlen(hdr.producer), sizeof(hdr.producer) - 1);
}
END_TEST

static const char small_trace[] =
	"# pytorch 2.11.0+cu130 workload=small steps=2 peak_alloc=3072 "
	"peak_reserved=2097152\n"
	"# action addr size stream\n"
	"segment_alloc 4096 2097152 0\n"
	"alloc 4096 1024 0\n"
	"alloc 5120 2048 7\n"
	"\n"
	"snapshot 0 0 0\n"
	"free_requested 4096 1024 0\n"
	"free_completed 4096 1024 0\n"
	"# steps=99 a late comment is no header\n"
	"free_completed 5120 2048 7"; /* no final newline */

/* Read small_trace back from a plain or a gzip file. */
static void check_small(bool gz)
{
	static const enum gml_trace_kind want[] = {
		GML_TRACE_SEGMENT_ALLOC,  GML_TRACE_ALLOC,
		GML_TRACE_ALLOC,	  GML_TRACE_OTHER,
		GML_TRACE_FREE_REQUESTED, GML_TRACE_FREE_COMPLETED,
		GML_TRACE_FREE_COMPLETED,
	};
	const struct gml_trace_info *info;
	struct gml_trace_event ev;
	struct gml_trace *t;
	char *path;
	size_t n = 0;
	int ret;

	path = write_temp(small_trace, sizeof(small_trace) - 1, gz);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	info = gml_trace_info(t);
	while ((ret = gml_trace_next(t, &ev)) == 1) {
		ck_assert_uint_lt(n, sizeof(want) / sizeof(want[0]));
		ck_assert_int_eq(ev.kind, want[n]);
		n++;
	}
	ck_assert_int_eq(ret, 0);
	ck_assert_uint_eq(n, sizeof(want) / sizeof(want[0]));
	ck_assert_uint_eq(ev.addr, 5120);
	ck_assert_uint_eq(ev.size, 2048);
	ck_assert_uint_eq(ev.stream, 7);
	ck_assert_str_eq(info->header.workload, "small");
	ck_assert_uint_eq(info->header.steps, 2);
	ck_assert_uint_eq(info->header.peak_alloc, 3072);
	ck_assert_uint_eq(info->header.peak_reserved, 2097152);
	ck_assert_uint_eq(info->lines, 11);
	ck_assert_uint_eq(info->comments, 3);
	ck_assert_uint_eq(info->events, 7);
	ck_assert_uint_eq(info->kinds[GML_TRACE_ALLOC], 2);
	ck_assert_uint_eq(info->kinds[GML_TRACE_FREE_COMPLETED], 2);
	ck_assert_uint_eq(info->kinds[GML_TRACE_OTHER], 1);
	ck_assert_uint_eq(info->errors, 0);
	/* The end stays the end. */
	ck_assert_int_eq(gml_trace_next(t, &ev), 0);
	/* A second pass reads the same, counters afresh. */
	ck_assert_int_eq(gml_trace_rewind(t), 0);
	ck_assert_uint_eq(info->events, 0);
	for (n = 0; (ret = gml_trace_next(t, &ev)) == 1; n++)
		ck_assert_int_eq(ev.kind, want[n]);
	ck_assert_int_eq(ret, 0);
	ck_assert_uint_eq(n, sizeof(want) / sizeof(want[0]));
	ck_assert_uint_eq(info->lines, 11);
	ck_assert_uint_eq(info->header.peak_reserved, 2097152);
	gml_trace_close(t);
	drop_temp(path);
}

START_TEST(test_file_plain)
{
	check_small(false);
}
END_TEST

START_TEST(test_file_gzip)
{
	check_small(true);
}
END_TEST

/* read_header stops before the first event, which next then returns. */
START_TEST(test_file_read_header)
{
	const struct gml_trace_info *info;
	struct gml_trace_event ev;
	struct gml_trace *t;
	char *path;

	path = write_temp(small_trace, sizeof(small_trace) - 1, true);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	ck_assert_int_eq(gml_trace_read_header(t), 0);
	info = gml_trace_info(t);
	ck_assert_str_eq(info->header.producer, "pytorch 2.11.0+cu130");
	ck_assert_uint_eq(info->header.peak_reserved, 2097152);
	ck_assert_int_eq(gml_trace_read_header(t), 0);
	ck_assert_int_eq(gml_trace_next(t, &ev), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_SEGMENT_ALLOC);
	ck_assert_int_eq(gml_trace_next(t, &ev), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_ALLOC);
	ck_assert_uint_eq(ev.addr, 4096);
	gml_trace_close(t);
	drop_temp(path);
}
END_TEST

START_TEST(test_file_empty)
{
	struct gml_trace_event ev;
	struct gml_trace *t;
	char *path;
	int gz;

	for (gz = 0; gz < 2; gz++) {
		path = write_temp("", 0, gz);
		ck_assert_int_eq(gml_trace_open(path, &t), 0);
		ck_assert_int_eq(gml_trace_read_header(t), 0);
		ck_assert_int_eq(gml_trace_next(t, &ev), 0);
		ck_assert_uint_eq(gml_trace_info(t)->header.have, 0);
		gml_trace_close(t);
		drop_temp(path);
	}
	path = write_temp("# only steps=1\n\n", 16, true);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	ck_assert_int_eq(gml_trace_read_header(t), 0);
	ck_assert_int_eq(gml_trace_next(t, &ev), 0);
	ck_assert_uint_eq(gml_trace_info(t)->header.steps, 1);
	gml_trace_close(t);
	drop_temp(path);
}
END_TEST

START_TEST(test_file_missing)
{
	struct gml_trace *t = NULL;

	ck_assert_int_eq(gml_trace_open("/nonexistent/dir/x.trace.gz", &t),
			 -ENOENT);
	ck_assert_ptr_null(t);
	ck_assert_int_eq(gml_trace_open(NULL, &t), -EINVAL);
	gml_trace_close(NULL);
}
END_TEST

/* A malformed line is reported with its number; reading goes on. */
START_TEST(test_file_malformed_line)
{
	static const char text[] =
		"# x\nalloc 1 2 3\nalloc 1 2\n"
		"free_completed 1 2 3\nalloc 1 2 -3\nalloc 4 5 6\n";
	struct gml_trace_event ev;
	struct gml_trace *t;
	char *path;

	path = write_temp(text, sizeof(text) - 1, true);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	ck_assert_str_eq(gml_trace_error(t), "");
	ck_assert_int_eq(gml_trace_next(t, &ev), 1);
	ck_assert_int_eq(gml_trace_next(t, &ev), -EINVAL);
	ck_assert_ptr_nonnull(strstr(gml_trace_error(t), ":3: too few"));
	ck_assert_ptr_nonnull(strstr(gml_trace_error(t), path));
	ck_assert_int_eq(gml_trace_next(t, &ev), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_FREE_COMPLETED);
	ck_assert_str_eq(gml_trace_error(t), "");
	ck_assert_int_eq(gml_trace_next(t, &ev), -EINVAL);
	ck_assert_ptr_nonnull(strstr(gml_trace_error(t), ":5: "));
	ck_assert_int_eq(gml_trace_next(t, &ev), 1);
	ck_assert_uint_eq(ev.addr, 4);
	ck_assert_int_eq(gml_trace_next(t, &ev), 0);
	ck_assert_uint_eq(gml_trace_info(t)->errors, 2);
	gml_trace_close(t);
	drop_temp(path);
}
END_TEST

START_TEST(test_file_malformed_header)
{
	static const char text[] = "# pytorch steps=zz\nalloc 1 2 3\n";
	struct gml_trace_event ev;
	struct gml_trace *t;
	char *path;

	path = write_temp(text, sizeof(text) - 1, false);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	ck_assert_int_eq(gml_trace_read_header(t), -EINVAL);
	ck_assert_ptr_nonnull(strstr(gml_trace_error(t), ":1: bad number"));
	ck_assert_int_eq(gml_trace_read_header(t), 0);
	ck_assert_int_eq(gml_trace_next(t, &ev), 1);
	ck_assert_int_eq(gml_trace_next(t, &ev), 0);
	gml_trace_close(t);
	drop_temp(path);
}
END_TEST

/* Lines of LINE_MAX bytes pass; longer ones fail and are skipped. */
static void check_long(size_t over, bool gz)
{
	struct gml_trace_event ev;
	struct gml_trace *t;
	size_t n, len = 0;
	char *text, *path;

	text = malloc(3 * GML_TRACE_LINE_MAX + over + 64);
	ck_assert_ptr_nonnull(text);
	/* Line 1: a comment of exactly LINE_MAX bytes. */
	text[len++] = '#';
	memset(text + len, 'c', GML_TRACE_LINE_MAX - 1);
	len += GML_TRACE_LINE_MAX - 1;
	text[len++] = '\n';
	/* Line 2: an event padded with blanks to exactly LINE_MAX bytes. */
	n = (size_t)sprintf(text + len, "alloc 1 2 3");
	memset(text + len + n, ' ', GML_TRACE_LINE_MAX - n);
	len += GML_TRACE_LINE_MAX;
	text[len++] = '\n';
	/* Line 3: LINE_MAX + over bytes. */
	memset(text + len, '9', GML_TRACE_LINE_MAX + over);
	len += GML_TRACE_LINE_MAX + over;
	text[len++] = '\n';
	len += (size_t)sprintf(text + len, "free_completed 1 2 3\n");

	path = write_temp(text, len, gz);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	ck_assert_int_eq(gml_trace_next(t, &ev), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_ALLOC);
	ck_assert_int_eq(gml_trace_next(t, &ev), -EINVAL);
	ck_assert_ptr_nonnull(strstr(gml_trace_error(t), ":3: line too long"));
	ck_assert_int_eq(gml_trace_next(t, &ev), 1);
	ck_assert_int_eq(ev.kind, GML_TRACE_FREE_COMPLETED);
	ck_assert_uint_eq(gml_trace_info(t)->lines, 4);
	ck_assert_int_eq(gml_trace_next(t, &ev), 0);
	gml_trace_close(t);
	drop_temp(path);
	free(text);
}

START_TEST(test_file_long_lines)
{
	check_long(1, false);
	check_long(1, true);
	/* Longer than the reader's whole buffer. */
	check_long(300000, false);
	check_long(300000, true);
}
END_TEST

/* An overlong last line without a newline, and one of NUL bytes. */
START_TEST(test_file_long_tail)
{
	struct gml_trace_event ev;
	struct gml_trace *t;
	char *text, *path;
	size_t len = 100000;

	text = calloc(1, len);
	ck_assert_ptr_nonnull(text);
	path = write_temp(text, len, true);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	ck_assert_int_eq(gml_trace_next(t, &ev), -EINVAL);
	ck_assert_ptr_nonnull(strstr(gml_trace_error(t), ":1: line too long"));
	ck_assert_int_eq(gml_trace_next(t, &ev), 0);
	gml_trace_close(t);
	drop_temp(path);
	free(text);
}
END_TEST

/* A gzip file cut short gives -EIO, never a made-up last line. */
START_TEST(test_file_truncated_gzip)
{
	struct gml_trace_event ev;
	struct gml_trace *t;
	char *text, *path, *cut;
	size_t i, len = 0;
	FILE *fp;
	long size;
	int ret;

	text = malloc(64 * 1024);
	ck_assert_ptr_nonnull(text);
	for (i = 0; i < 2000; i++)
		len += (size_t)sprintf(text + len, "alloc %zu %zu 0\n",
				       i * 4096, i + 1);
	path = write_temp(text, len, true);
	fp = fopen(path, "r");
	ck_assert_ptr_nonnull(fp);
	ck_assert_int_eq(fseek(fp, 0, SEEK_END), 0);
	size = ftell(fp);
	ck_assert_int_gt(size, 100);
	cut = malloc((size_t)size);
	ck_assert_ptr_nonnull(cut);
	rewind(fp);
	ck_assert_uint_eq(fread(cut, 1, (size_t)size, fp), (size_t)size);
	fclose(fp);
	drop_temp(path);

	/* Raw bytes, so write them through a plain temp file. */
	path = write_temp(cut, (size_t)size / 2, false);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	while ((ret = gml_trace_next(t, &ev)) == 1)
		ck_assert_uint_eq(ev.addr, (ev.size - 1) * 4096);
	ck_assert_int_eq(ret, -EIO);
	ck_assert_ptr_nonnull(strstr(gml_trace_error(t), "unexpected end"));
	ck_assert_int_eq(gml_trace_next(t, &ev), -EIO);
	ck_assert_int_eq(gml_trace_read_header(t), -EIO);
	gml_trace_close(t);
	drop_temp(path);
	free(cut);
	free(text);
}
END_TEST

/* A file that claims gzip but is not. */
START_TEST(test_file_corrupt_gzip)
{
	static const char junk[] =
		"\x1f\x8b\x08\x00garbage that is not deflate";
	struct gml_trace_event ev;
	struct gml_trace *t;
	char *path;
	int ret;

	path = write_temp(junk, sizeof(junk) - 1, false);
	ck_assert_int_eq(gml_trace_open(path, &t), 0);
	do {
		ret = gml_trace_next(t, &ev);
	} while (ret == 1 || ret == -EINVAL);
	ck_assert_int_eq(ret, -EIO);
	ck_assert_str_ne(gml_trace_error(t), "");
	gml_trace_close(t);
	drop_temp(path);
}
END_TEST

/* Random files: reading them ends, whatever they hold. */
START_TEST(test_file_random)
{
	uint64_t seed = 12345;
	char *text, *path;
	struct gml_trace_event ev;
	struct gml_trace *t;
	size_t i, len = 200000;
	int round, ret, guard;

	text = malloc(len);
	ck_assert_ptr_nonnull(text);
	for (round = 0; round < 4; round++) {
		for (i = 0; i < len; i++) {
			seed = seed * 6364136223846793005ull + 1;
			if (round & 1)
				text[i] = "a 1\n#="[(seed >> 40) % 6];
			else
				text[i] = (char)(seed >> 40);
		}
		path = write_temp(text, len, round >= 2);
		ck_assert_int_eq(gml_trace_open(path, &t), 0);
		gml_trace_read_header(t);
		guard = 0;
		do {
			ret = gml_trace_next(t, &ev);
			ck_assert_int_lt(++guard, 1000000);
		} while (ret != 0 && ret != -EIO);
		gml_trace_close(t);
		drop_temp(path);
	}
	free(text);
}
END_TEST

START_TEST(test_sidecar_path)
{
	char buf[64];

	ck_assert_int_eq(gml_trace_sidecar_path("d/plain.trace.gz",
						".trace.json", buf,
						sizeof(buf)),
			 0);
	ck_assert_str_eq(buf, "d/plain.trace.json");
	ck_assert_int_eq(gml_trace_sidecar_path("d/plain.trace.gz",
						".expandable.json", buf,
						sizeof(buf)),
			 0);
	ck_assert_str_eq(buf, "d/plain.expandable.json");
	ck_assert_int_eq(gml_trace_sidecar_path("plain.trace", ".trace.json",
						buf, sizeof(buf)),
			 0);
	ck_assert_str_eq(buf, "plain.trace.json");
	ck_assert_int_eq(
		gml_trace_sidecar_path("x.gz", ".trace.json", buf, sizeof(buf)),
		0);
	ck_assert_str_eq(buf, "x.trace.json");
	ck_assert_int_eq(gml_trace_sidecar_path("gz", ".j", buf, sizeof(buf)),
			 0);
	ck_assert_str_eq(buf, "gz.j");
	ck_assert_int_eq(gml_trace_sidecar_path("plain.trace.gz", ".trace.json",
						buf, 16),
			 -ENAMETOOLONG);
	ck_assert_int_eq(gml_trace_sidecar_path("plain.trace.gz", ".trace.json",
						buf, 17),
			 0);
}
END_TEST

START_TEST(test_sidecar_parse)
{
	static const char text[] =
		"{\"workload\": \"plain\", \"mode\": "
		"\"trace\", \"steps\": 12, \"step_ms\": 233.3, \"peak_alloc\": "
		"17388220416, \"peak_reserved\": 19631439872, \"nested\": "
		"{\"a\": [1, \"}\", {}]}, \"ok\": true, \"no\": null, "
		"\"frag_pct\": 11.4, \"steady_step_ms\": 221.5}\n";
	struct gml_trace_sidecar sc;
	const char *why;

	ck_assert_int_eq(
		gml_trace_sidecar_parse(text, sizeof(text) - 1, &sc, &why), 0);
	ck_assert_uint_eq(sc.have, GML_SIDECAR_HAVE_STEPS |
					   GML_SIDECAR_HAVE_STEP_MS |
					   GML_SIDECAR_HAVE_PEAK_ALLOC |
					   GML_SIDECAR_HAVE_PEAK_RESERVED |
					   GML_SIDECAR_HAVE_FRAG_PCT |
					   GML_SIDECAR_HAVE_STEADY_STEP_MS);
	ck_assert_double_eq(sc.steps, 12);
	ck_assert_double_eq_tol(sc.step_ms, 233.3, 1e-9);
	ck_assert_double_eq(sc.peak_alloc, 17388220416.0);
	ck_assert_double_eq(sc.peak_reserved, 19631439872.0);
	ck_assert_double_eq_tol(sc.frag_pct, 11.4, 1e-9);
	ck_assert_double_eq_tol(sc.steady_step_ms, 221.5, 1e-9);
	/* steady_step_ms is optional, and alone is enough. */
	ck_assert_int_eq(
		gml_trace_sidecar_parse("{\"step_ms\": 9}", 14, &sc, &why), 0);
	ck_assert_uint_eq(sc.have, GML_SIDECAR_HAVE_STEP_MS);
	ck_assert_int_eq(gml_trace_sidecar_parse("{\"steady_step_ms\": 8}", 21,
						 &sc, &why),
			 0);
	ck_assert_uint_eq(sc.have, GML_SIDECAR_HAVE_STEADY_STEP_MS);
	ck_assert_double_eq(sc.steady_step_ms, 8);
	ck_assert_int_eq(gml_trace_sidecar_parse("{}", 2, &sc, &why), 0);
	ck_assert_uint_eq(sc.have, 0);
	ck_assert_int_eq(
		gml_trace_sidecar_parse(" {\"steps\": null} ", 17, &sc, &why),
		0);
	ck_assert_uint_eq(sc.have, 0);
}
END_TEST

START_TEST(test_sidecar_malformed)
{
	static const char *const bad[] = {
		"",
		"[]",
		"{",
		"{\"steps\"}",
		"{\"steps\": }",
		"{\"steps\": 1",
		"{\"steps\": 1,}",
		"{\"steps\": 1} x",
		"{steps: 1}",
		"{\"steps\": 1e999}",
		"{\"steps\": --1}",
		"{\"a\": \"x}",
		"{\"a\": [1, 2}",
		"{\"steps\": 1 \"step_ms\": 2}",
		"{\"steady_step_ms\": 1e999}",
		"{\"steady_step_ms\": 2,}",
		"{\"a\": tru}",
		"{\"a\\",
		"{\"a\": \"\x01\"}",
	};
	struct gml_trace_sidecar sc;
	const char *why;
	size_t i;

	for (i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		why = NULL;
		ck_assert_msg(gml_trace_sidecar_parse(bad[i], strlen(bad[i]),
						      &sc, &why) == -EINVAL,
			      "accepted '%s'", bad[i]);
		ck_assert_ptr_nonnull(why);
		ck_assert_str_ne(why, "");
		ck_assert_uint_eq(sc.have, 0);
	}
}
END_TEST

START_TEST(test_sidecar_load)
{
	static const char text[] = "{\"steps\": 24, \"step_ms\": 246.9}";
	struct gml_trace_sidecar sc;
	const char *why;
	char *path;

	path = write_temp(text, sizeof(text) - 1, false);
	ck_assert_int_eq(gml_trace_sidecar_load(path, &sc, &why), 0);
	ck_assert_double_eq(sc.steps, 24);
	ck_assert_double_eq_tol(sc.step_ms, 246.9, 1e-9);
	drop_temp(path);
	ck_assert_int_eq(
		gml_trace_sidecar_load("/nonexistent/x.json", &sc, &why),
		-ENOENT);
	ck_assert_uint_eq(sc.have, 0);
}
END_TEST

static Suite *trace_suite(void)
{
	Suite *s = suite_create("trace");
	TCase *tc;

	tc = tcase_create("lines");
	tcase_add_test(tc, test_line_alloc);
	tcase_add_test(tc, test_line_kinds);
	tcase_add_test(tc, test_line_unknown_action);
	tcase_add_test(tc, test_line_blanks);
	tcase_add_test(tc, test_line_step);
	tcase_add_test(tc, test_line_long_lived);
	tcase_add_test(tc, test_line_trim);
	tcase_add_test(tc, test_line_limits);
	tcase_add_test(tc, test_line_comment_blank);
	tcase_add_test(tc, test_line_length_bound);
	suite_add_tcase(s, tc);

	tc = tcase_create("malformed");
	tcase_add_test(tc, test_line_malformed);
	tcase_add_test(tc, test_line_random);
	tcase_set_timeout(tc, 30);
	suite_add_tcase(s, tc);

	tc = tcase_create("header");
	tcase_add_test(tc, test_header_first_line);
	tcase_add_test(tc, test_header_other_comments);
	tcase_add_test(tc, test_header_malformed);
	tcase_add_test(tc, test_header_long_producer);
	suite_add_tcase(s, tc);

	tc = tcase_create("files");
	tcase_add_test(tc, test_file_plain);
	tcase_add_test(tc, test_file_gzip);
	tcase_add_test(tc, test_file_read_header);
	tcase_add_test(tc, test_file_empty);
	tcase_add_test(tc, test_file_missing);
	tcase_add_test(tc, test_file_malformed_line);
	tcase_add_test(tc, test_file_malformed_header);
	tcase_add_test(tc, test_file_steps);
	tcase_add_test(tc, test_file_long_lines);
	tcase_add_test(tc, test_file_long_tail);
	tcase_add_test(tc, test_file_truncated_gzip);
	tcase_add_test(tc, test_file_corrupt_gzip);
	tcase_add_test(tc, test_file_random);
	tcase_set_timeout(tc, 30);
	suite_add_tcase(s, tc);

	tc = tcase_create("sidecar");
	tcase_add_test(tc, test_sidecar_path);
	tcase_add_test(tc, test_sidecar_parse);
	tcase_add_test(tc, test_sidecar_malformed);
	tcase_add_test(tc, test_sidecar_load);
	suite_add_tcase(s, tc);

	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(trace_suite());
	int failed;

	srunner_run_all(sr, CK_ENV);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
