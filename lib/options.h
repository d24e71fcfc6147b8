/* SPDX-License-Identifier: MIT */
/* Parsing of GMLAKE_* options, shared with the tools. */
#ifndef GML_OPTIONS_H
#define GML_OPTIONS_H

#include <stdbool.h>
#include <stddef.h>

#include "gmlake.h"

void gml_config_defaults(struct gmlake_config *cfg);
/* The backend a context on cfg opens: cfg->backend, or for
 * GMLAKE_BACKEND_DEFAULT the one GMLAKE_BACKEND names (a bad name warns),
 * else the backend table's default (lib/drv.h). */
int gml_config_backend(const struct gmlake_config *cfg);
int gml_parse_size(const char *s, size_t *out);
int gml_parse_bool(const char *s, bool *out);

#endif
