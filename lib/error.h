/* SPDX-License-Identifier: MIT */
/* The thread-local message behind gmlake_last_error(), and logging. */
#ifndef GML_ERROR_H
#define GML_ERROR_H

#include <stdatomic.h>
#include <stdbool.h>

#include "gmlake.h"

/* Marks the functions the library exports; everything else is hidden. */
#ifndef GML_EXPORT
#define GML_EXPORT __attribute__((visibility("default")))
#endif

/* Store a message for gmlake_last_error(); returns err (a negative errno). */
int gml_set_error(int err, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));
void gml_clear_error(void);

/*
 * The log level: one for the process (enum gmlake_log_level), set by
 * gmlake_config_init and gmlake_ctx_init while other threads log, hence
 * atomic. Read it with gml_log_on(); set it with gml_log_set_level().
 */
extern atomic_int gml_log_level;
void gml_log_set_level(int level);
static inline bool gml_log_on(int level)
{
	return level <= atomic_load_explicit(&gml_log_level,
					     memory_order_relaxed);
}
void gml_log(int level, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

#endif
