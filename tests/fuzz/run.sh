#!/bin/bash
# SPDX-License-Identifier: MIT
#
# Run one libFuzzer target for a bounded time:
#	run.sh TARGET SEED_CORPUS SECONDS
# New inputs go to tests/fuzz/found/NAME/ (the seed corpus may be read-only);
# crashes, leaks and timeouts are written as tests/fuzz/crash-NAME-* etc.
# and fail the run. The last line gives the executions done.
#
# A target may need options of its own (below); FUZZ_ARGS in the
# environment is added after them, for every target (a later option wins).

set -euo pipefail

target=$1
seeds=$2
seconds=$3
name=$(basename "$target")
dir=$(dirname "$target")
found=$dir/found/$name
log=$dir/$name.log

if [ ! -x "$target" ]; then
	echo "fuzz: $target not built (make fuzz-build)" >&2
	exit 1
fi
if [ ! -d "$seeds" ]; then
	echo "fuzz: no seed corpus $seeds" >&2
	exit 1
fi
mkdir -p "$found"

# fuzz_api's input is a program of up to 512 calls, a few bytes each.
# libFuzzer's length control keeps inputs at the longest seed (167 bytes,
# a dozen calls) while new coverage keeps coming, which it does for the
# whole of a one-minute run: let them grow to 4 KiB at once.
case $name in
fuzz_api) opts="-max_len=4096 -len_control=0" ;;
*) opts="" ;;
esac
# shellcheck disable=SC2086
set -- $opts ${FUZZ_ARGS:-}

echo "fuzz: $name for $seconds s${*:+ ($*)} (log: $log)"
status=0
"$target" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
	-print_final_stats=1 -artifact_prefix="$dir/" "$@" \
	"$found" "$seeds" >"$log" 2>&1 || status=$?

execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
if [ "$status" -ne 0 ]; then
	echo "fuzz: $name FAILED (exit $status); the end of $log:" >&2
	tail -n 60 "$log" >&2
	ls "$dir"/crash-* "$dir"/leak-* "$dir"/timeout-* "$dir"/oom-* \
		2>/dev/null >&2 || true
	exit 1
fi
if grep -qE 'ERROR: (Address|Leak|UndefinedBehavior)Sanitizer|runtime error:' "$log"; then
	echo "fuzz: $name: a sanitizer report in $log" >&2
	exit 1
fi
echo "fuzz: $name: ${execs:-?} executions in $seconds s, no crash"
