/* SPDX-License-Identifier: MIT */
/* Internal hooks on a context, for tests and tools built in this tree. */
#ifndef GML_CTX_H
#define GML_CTX_H

#include "drv.h"
#include "gmlake.h"

/* The device under a context (fault injection, emulated-device hooks). */
struct gml_dev *gml_ctx_dev(gmlake_ctx *ctx);
/*
 * The invariant checker: chunk ownership, no two live blocks sharing a
 * chunk, every live block's range mapped to its own chunks, accounting
 * equal to the sum of its parts. 0, or -EFAULT with a message naming the
 * broken invariant. Debug builds run it after every operation.
 */
int gml_ctx_check(gmlake_ctx *ctx);

#endif
