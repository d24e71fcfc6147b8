/* SPDX-License-Identifier: MIT */
/*
 * offload_layout: print the layout of the offload ring's structs as the C
 * compiler sees it, one "struct.field offset size" line per field, then
 * "sizeof.struct N" lines and "const.NAME value" lines for the constants,
 * for python/tests to compare with the ctypes structs of
 * python/gmlake/offload.py.
 */
#include <stddef.h>
#include <stdio.h>

#include "gmlake-offload.h"

#define FIELD(type, name)						\
	printf("%s.%s %zu %zu\n", #type, #name,				\
	       offsetof(struct gmlake_##type, name),			\
	       sizeof(((struct gmlake_##type *)0)->name))
#define SIZE(type)							\
	printf("sizeof.%s %zu\n", #type, sizeof(struct gmlake_##type))
#define CONST(name) printf("const.%s %ld\n", #name, (long)(name))

int main(void)
{
	FIELD(offload_sqe, opcode);
	FIELD(offload_sqe, flags);
	FIELD(offload_sqe, pad0);
	FIELD(offload_sqe, pad1);
	FIELD(offload_sqe, addr);
	FIELD(offload_sqe, user_data);
	FIELD(offload_sqe, reserved);
	SIZE(offload_sqe);
	FIELD(offload_cqe, user_data);
	FIELD(offload_cqe, res);
	FIELD(offload_cqe, flags);
	SIZE(offload_cqe);
	FIELD(offload, priv);
	FIELD(offload, reserved);
	SIZE(offload);
	CONST(GMLAKE_OFFLOAD_NOP);
	CONST(GMLAKE_OFFLOAD_SPILL);
	CONST(GMLAKE_OFFLOAD_FETCH);
	CONST(GMLAKE_OFFLOAD_PREFETCH);
	CONST(GMLAKE_OFFLOAD_INPLACE);
	CONST(GMLAKE_OFFLOAD_SQE_INPLACE);
	CONST(GMLAKE_ADVISE_NOT_OFFLOADABLE);
	CONST(GMLAKE_ADVISE_OFFLOADABLE);
	CONST(GMLAKE_BLOCK_RESIDENT);
	CONST(GMLAKE_BLOCK_SPILLING);
	CONST(GMLAKE_BLOCK_SPILLED);
	CONST(GMLAKE_BLOCK_FETCHING);
	return fflush(stdout) ? 1 : 0;
}
