#!/bin/sh
# SPDX-License-Identifier: MIT
#
# tools/offload_bench runs (on the emulated device: small sizes, one round;
# the figures mean nothing there, only that the benchmark works), and with
# -v every block's bytes are checked after every round trip: a difference
# exits 1.

: "${top_builddir:=.}"
GMLAKE_BACKEND=${GMLAKE_BACKEND:-emu}
export GMLAKE_BACKEND
[ "$GMLAKE_BACKEND" = emu ] || exit 77
"$top_builddir/tools/offload_bench" -s 4 -t 16 -i 1 -v -q || exit 1
# Blocks of 1-16 chunks on growth handles of 3 chunks, so that blocks lie
# across handles: under the ring every one must spill and come back with
# its bytes (lib/slab.c), else offload_bench exits 1.
GMLAKE_GROW_HANDLE=6M "$top_builddir/tools/offload_bench" -s 32 -t 128 -i 1 -v -q
