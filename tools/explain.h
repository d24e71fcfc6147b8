/* SPDX-License-Identifier: MIT */
#ifndef GML_TOOLS_EXPLAIN_H
#define GML_TOOLS_EXPLAIN_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include <gmlake.h>

/*
 * gmlake-replay --explain: what each call of a replay did, one line on f
 * per event worth a look. An allocation is shown when it asked for at
 * least min bytes or called the driver: the trace line, the size, the
 * pointer, the steps of the policy it went through (the counters of
 * struct gmlake_stats that moved: fit, cached stitch, repair, stitch,
 * grow, ...) and its driver calls by kind. A free is shown only when it
 * called the driver. before and after are the context's statistics
 * around the call.
 */
void gml_explain_alloc(FILE *f, const char *trace, uint64_t line,
		       uint64_t size, const void *ptr, uint64_t min,
		       const struct gmlake_stats *before,
		       const struct gmlake_stats *after);
void gml_explain_free(FILE *f, const char *trace, uint64_t line,
		      const void *ptr, const struct gmlake_stats *before,
		      const struct gmlake_stats *after);
/* A trim line: what gmlake_trim() gave back, and its driver calls. */
void gml_explain_trim(FILE *f, const char *trace, uint64_t line,
		      const struct gmlake_stats *before,
		      const struct gmlake_stats *after);
/* A step line of the trace: step k begins, a settling or a steady one. */
void gml_explain_step(FILE *f, const char *trace, uint64_t k, bool settling);

#endif
