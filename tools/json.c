/* SPDX-License-Identifier: MIT */
/*
 * The JSON string writer of the tools (gmlake-top --json, gmlake-replay
 * --json): one escaper, so every output treats names the same way. The
 * library's own JSON (gmlake_stats_print) holds only fixed names.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <stdint.h>
#include <stdio.h>

#include "json.h"

/* Bytes of a valid UTF-8 sequence at s (1 to 4), or 0 when it is not. */
static int utf8_len(const unsigned char *s)
{
	int n = s[0] >= 0xf0 ? 4 : s[0] >= 0xe0 ? 3 : s[0] >= 0xc2 ? 2 : 0;
	uint32_t cp;

	if (s[0] >= 0xf5 || !n)
		return 0;
	for (int i = 1; i < n; i++)
		if ((s[i] & 0xc0) != 0x80)
			return 0;
	cp = n == 2 ? (s[0] & 0x1fu) << 6 | (s[1] & 0x3f) :
	     n == 3 ? (s[0] & 0x0fu) << 12 | (s[1] & 0x3fu) << 6 |
			      (s[2] & 0x3f) :
		      (s[0] & 0x07u) << 18 | (s[1] & 0x3fu) << 12 |
			      (s[2] & 0x3fu) << 6 | (s[3] & 0x3f);
	/* overlong forms, surrogates, past U+10FFFF */
	if ((n == 3 && cp < 0x800) || (n == 4 && cp < 0x10000) ||
	    (cp >= 0xd800 && cp <= 0xdfff) || cp > 0x10ffff)
		return 0;
	return n;
}

/*
 * A JSON string: valid UTF-8 passes through as it is, control characters
 * and quotes are escaped, and a byte that is not UTF-8 becomes U+FFFD (it
 * was written as \u00XX, which turned each byte of a UTF-8 name into a
 * Latin-1 character).
 */
void gml_json_str(FILE *f, const char *str)
{
	const unsigned char *s = (const unsigned char *)str;
	int n;

	fputc('"', f);
	while (*s) {
		if (*s == '"' || *s == '\\') {
			fprintf(f, "\\%c", *s++);
		} else if (*s < 0x20 || *s == 0x7f) {
			fprintf(f, "\\u%04x", *s++);
		} else if (*s < 0x80) {
			fputc(*s++, f);
		} else if ((n = utf8_len(s))) {
			fwrite(s, 1, (size_t)n, f);
			s += n;
		} else {
			fputs("\\ufffd", f);
			s++;
		}
	}
	fputc('"', f);
}
