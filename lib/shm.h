/* SPDX-License-Identifier: MIT */
/* Publication of a context's statistics in the shared-memory segment. */
#ifndef GML_SHM_H
#define GML_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "gmlake.h"
#include "gmlake-shm.h"

/* Layout 1 sizes; a reader accepts parts at least this large. */
#define GML_SHM_HEADER_V1 256u
#define GML_SHM_SLOT_V1 512u

/*
 * Start publishing ctx (a slot in this process's segment, created with the
 * first context). Failure is not fatal to the caller: a warning is logged
 * and the context runs unpublished. Call without ctx->lock held.
 */
int gml_shm_register(gmlake_ctx *ctx);
/*
 * Free ctx's slot (the segment is written at once without it); the last
 * context removes the segment. May be called with ctx->lock held.
 */
void gml_shm_unregister(gmlake_ctx *ctx);

/*
 * shm_read.c: /proc/PID/stat's start time (field 22) and command name;
 * pid 0 reads /proc/self, which is right in any PID namespace.
 */
int gml_proc_stat(pid_t pid, uint64_t *start_time, char *comm, size_t len);
/* The inode of this process's PID namespace, 0 when /proc cannot say. */
uint64_t gml_pidns(void);
/*
 * True when base is a canonical segment name, "gmlake.PID.TOKEN": PID in
 * decimal from 1 to the kernel's limit, no sign or leading zero; TOKEN 16
 * lowercase hex digits, not all zero. Then *pid and *token hold them.
 */
bool gml_shm_name_parse(const char *base, int32_t *pid, uint64_t *token);

#endif
