/* SPDX-License-Identifier: MIT */
/* The thread-local message behind gmlake_last_error(), and logging. */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <stdarg.h>
#include <stdio.h>

#include "error.h"

static _Thread_local char last_error[256];

atomic_int gml_log_level = GMLAKE_LOG_WARN;

void gml_log_set_level(int level)
{
	atomic_store_explicit(&gml_log_level, level, memory_order_relaxed);
}

int gml_set_error(int err, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(last_error, sizeof(last_error), fmt, ap);
	va_end(ap);
	gml_log(GMLAKE_LOG_DEBUG, "%s", last_error);
	return err;
}

void gml_clear_error(void)
{
	last_error[0] = '\0';
}

GML_EXPORT const char *gmlake_last_error(void)
{
	return last_error;
}

void gml_log(int level, const char *fmt, ...)
{
	static const char *const names[] = { "error", "warning", "info",
					     "debug" };
	va_list ap;

	if (level < 0 || !gml_log_on(level))
		return;
	fprintf(stderr, "gmlake: %s: ", names[level]);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
}
