#!/bin/bash
# SPDX-License-Identifier: MIT
#
# The policy beyond the recorded order: bench/trace_shuffle.py draws the
# GraphSAGE trace's steps again in six seeded orders (40 steps each), and
# each replays within its goals for that workload: priced steady driver
# time at most 1.3% (top fit, lib/fit.c, gave 0.81-1.08%; first fit
# 1.54-2.62%) and fragmentation at most 3.2% (2.55-3.10%; first fit
# 2.92-3.54%). replay_test.sh holds the recorded order itself.
#
# Automake test: exit 0 pass, 1 fail, 77 skip (no python3), 99 hard
# error. $srcdir is the source directory, $top_builddir the build
# directory (both default to '.').

srcdir=${srcdir:-.}
max_driver=${REPLAY_ORDERS_MAX_DRIVER_PCT:-1.3}
max_frag=${REPLAY_ORDERS_MAX_FRAG_PCT:-3.2}

# shellcheck source=tests/replay_lib.sh
. "$srcdir/tests/replay_lib.sh" || exit 99

replay_setup replay_orders_test
if ! command -v python3 >/dev/null 2>&1; then
	echo "skip - replay_orders_test: no python3"
	exit 77
fi

if ! python3 "$srcdir/bench/trace_shuffle.py" \
	"$srcdir/tests/data/eco_sage.trace.gz" "$tmp" --steps 40 \
	--seeds 1,2,3,4,5,6 >/dev/null; then
	echo "replay_orders_test: trace_shuffle.py failed" >&2
	exit 99
fi
out=$("$replay" --json --quiet "$tmp"/*.trace.gz) || {
	echo "replay_orders_test: gmlake-replay failed" >&2
	exit 99
}
for seed in 1 2 3 4 5 6; do
	name=eco_sage_s$seed
	line=$(line_of "$name" "$out")
	if [ -z "$line" ]; then
		result FAIL "$name: no result"
		continue
	fi
	pct=$(value driver_pct_second_half "$line")
	frag=$(value fragmentation_pct "$line")
	if at_most "$pct" "$max_driver"; then
		result OK "$name: driver_pct_second_half $pct <= $max_driver"
	else
		result FAIL \
			"$name: driver_pct_second_half $pct, limit $max_driver"
	fi
	if at_most "$frag" "$max_frag"; then
		result OK "$name: fragmentation_pct $frag <= $max_frag"
	else
		result FAIL "$name: fragmentation_pct $frag, limit $max_frag"
	fi
done

replay_finish
