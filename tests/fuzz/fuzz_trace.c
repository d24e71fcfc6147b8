/* SPDX-License-Identifier: MIT */
/*
 * fuzz_trace: the trace reader's line parsers on arbitrary bytes.
 *
 * The input is split at newlines. Every line goes, in a heap buffer of
 * exactly its length (so that ASan sees any read past its end), to
 * gml_trace_parse_line(), and comment lines to gml_trace_parse_comment();
 * the whole input, NULs and newlines included, goes through once more as
 * one line. The results must keep trace.h's promises: 1 with a known kind,
 * 0, or -EINVAL with a message; nothing else.
 */
#include <errno.h>
#include <stdbool.h>

#include "fuzz.h"
#include "trace.h"

static void one_line(const uint8_t *data, size_t len, bool first,
		     struct gml_trace_header *hdr)
{
	struct gml_trace_event ev;
	const char *why = NULL;
	char *line = malloc(len ? len : 1);
	int ret;

	if (!line)
		return;
	if (len)
		memcpy(line, data, len);
	memset(&ev, 0, sizeof(ev));
	ret = gml_trace_parse_line(line, len, &ev, &why);
	if (ret == 1) {
		if ((unsigned)ev.kind >= GML_TRACE_KIND_COUNT ||
		    !gml_trace_kind_name((int)ev.kind))
			fz_fail("parse_line: event of kind %d", (int)ev.kind);
	} else if (ret == -EINVAL) {
		if (!why || !*why)
			fz_fail("parse_line: -EINVAL without a message");
	} else if (ret != 0) {
		fz_fail("parse_line returned %d", ret);
	}
	/* NULL for why must be accepted too. */
	if (gml_trace_parse_line(line, len, &ev, NULL) != ret)
		fz_fail("parse_line: a different result without why");

	if (len && line[0] == '#') {
		why = NULL;
		ret = gml_trace_parse_comment(line, len, first, hdr, &why);
		if (ret == -EINVAL && (!why || !*why))
			fz_fail("parse_comment: -EINVAL without a message");
		if (ret != 0 && ret != -EINVAL)
			fz_fail("parse_comment returned %d", ret);
		if (strnlen(hdr->producer, sizeof(hdr->producer)) ==
			    sizeof(hdr->producer) ||
		    strnlen(hdr->workload, sizeof(hdr->workload)) ==
			    sizeof(hdr->workload))
			fz_fail("parse_comment: header string not terminated");
	}
	free(line);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct gml_trace_header hdr;
	size_t start = 0, i;
	bool first = true;

	memset(&hdr, 0, sizeof(hdr));
	for (i = 0; i <= size; i++) {
		if (i < size && data[i] != '\n')
			continue;
		one_line(data + start, i - start, first, &hdr);
		first = false;
		start = i + 1;
	}
	one_line(data, size, true, &hdr);
	return 0;
}
