#!/bin/sh
# SPDX-License-Identifier: MIT
#
# tests/check_offload once more, with the offload manager's plain thread
# engine forced (the default probes io_uring and uses it when it can), so
# both completion engines run under make check.

: "${top_builddir:=.}"
GMLAKE_OFFLOAD_ENGINE=thread
export GMLAKE_OFFLOAD_ENGINE
exec "$top_builddir/tests/check_offload" thread
