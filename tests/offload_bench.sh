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
exec "$top_builddir/tools/offload_bench" -s 4 -t 16 -i 1 -v -q
