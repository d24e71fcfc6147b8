/* SPDX-License-Identifier: MIT */
/*
 * stats_layout: print the layout of struct gmlake_stats as the C compiler
 * sees it, one "name offset size" line per field and "sizeof N" last, for
 * python/tests to compare with the ctypes struct of python/gmlake.
 */
#include <stddef.h>
#include <stdio.h>

#include "gmlake.h"

#define FIELD(name)							\
	printf("%s %zu %zu\n", #name,					\
	       offsetof(struct gmlake_stats, name),			\
	       sizeof(((struct gmlake_stats *)0)->name))

int main(void)
{
	printf("stats_version %d\n", GMLAKE_STATS_VERSION);
	FIELD(version);
	FIELD(size);
	FIELD(chunk_size);
#define GAUGE(name) FIELD(name);
	GMLAKE_FOREACH_GAUGE(GAUGE)
#undef GAUGE
#define COUNTER(name) FIELD(name);
	GMLAKE_FOREACH_COUNTER(COUNTER)
#undef COUNTER
	FIELD(calls);
	FIELD(call_ns);
	FIELD(call_failures);
	FIELD(access_bytes);
	FIELD(offload_engine);
	FIELD(pad0);
	FIELD(access_handles);
	FIELD(reserved);
	printf("sizeof %zu\n", sizeof(struct gmlake_stats));
	return fflush(stdout) ? 1 : 0;
}
