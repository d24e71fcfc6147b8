/* SPDX-License-Identifier: MIT */
/* The thread-local message behind gmlake_last_error(), and logging. */
#ifndef GML_ERROR_H
#define GML_ERROR_H

#include "gmlake.h"

/* Marks the functions the library exports; everything else is hidden. */
#ifndef GML_EXPORT
#define GML_EXPORT __attribute__((visibility("default")))
#endif

/* Store a message for gmlake_last_error(); returns err (a negative errno). */
int gml_set_error(int err, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
void gml_clear_error(void);

extern int gml_log_level;
void gml_log(int level, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

#endif
