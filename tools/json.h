/* SPDX-License-Identifier: MIT */
#ifndef GML_TOOLS_JSON_H
#define GML_TOOLS_JSON_H

#include <stdio.h>

/*
 * s as a JSON string, quotes included: valid UTF-8 passes through,
 * quotes, backslashes and control characters are escaped, and a byte that
 * is not UTF-8 becomes U+FFFD.
 */
void gml_json_str(FILE *f, const char *s);

#endif
