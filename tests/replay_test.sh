#!/bin/bash
# SPDX-License-Identifier: MIT
#
# Replay the PyTorch traces in tests/data on the emulated device and hold
# libgmlake to its goals on each: fragmentation at most 2.5% of reserved
# memory, and driver work of the steady-state half at most 1% of GPU time.
# A second, shorter run writes and checks a pattern in every block
# (--touch), which catches two live blocks sharing memory.
#
# Automake test: exit 0 pass, 1 fail, 99 hard error. $srcdir is the source
# directory, $top_builddir the build directory (both default to '.').
# REPLAY_MAX_FRAG_PCT and REPLAY_MAX_DRIVER_PCT override the limits.

srcdir=${srcdir:-.}
top_builddir=${top_builddir:-.}
replay=$top_builddir/tools/gmlake-replay
max_frag=${REPLAY_MAX_FRAG_PCT:-2.5}
max_driver=${REPLAY_MAX_DRIVER_PCT:-1.0}
# Traces that do not meet the driver goal yet, as name:ceiling (none now;
# a ceiling still fails the test on a regression).
known_gaps=${REPLAY_KNOWN_GAPS:-}

GMLAKE_BACKEND=emu
export GMLAKE_BACKEND

keys="trace events peak_allocated peak_reserved fragmentation_pct
torch_fragmentation_pct expandable_fragmentation_pct driver_ms_second_half
driver_pct_second_half measured_driver_ms_second_half creates maps set_access
unmaps releases stitches alloc_p50_us alloc_p99_us skipped_frees backend"

passed=0
failed=0

result() {
	# result OK|FAIL message
	if [ "$1" = OK ]; then
		passed=$((passed + 1))
		echo "ok - $2"
	else
		failed=$((failed + 1))
		echo "FAIL - $2"
	fi
}

# The value of a key in a one-line JSON object (numbers, null, strings).
value() {
	awk -v key="$1" '{
		pat = "\"" key "\": "
		i = index($0, pat)
		if (!i)
			exit 1
		s = substr($0, i + length(pat))
		if (substr(s, 1, 1) == "\"") {
			s = substr(s, 2)
			print substr(s, 1, index(s, "\"") - 1)
		} else {
			match(s, /^[^,}]*/)
			print substr(s, 1, RLENGTH)
		}
	}' <<<"$2"
}

# at_most VALUE LIMIT: true when VALUE is a number no greater than LIMIT.
at_most() {
	awk -v v="$1" -v max="$2" 'BEGIN {
		if (v !~ /^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$/)
			exit 1
		exit !(v + 0 <= max + 0)
	}'
}

if [ ! -x "$replay" ]; then
	echo "replay_test: $replay not built" >&2
	exit 99
fi
shopt -s nullglob
traces=("$srcdir"/tests/data/*.trace.gz)
if [ ${#traces[@]} -eq 0 ]; then
	echo "replay_test: no traces in $srcdir/tests/data" >&2
	exit 99
fi

out=$("$replay" --json --quiet "${traces[@]}")
rc=$?
if [ $rc -eq 0 ]; then
	result OK "gmlake-replay --json ran (${#traces[@]} traces)"
else
	result FAIL "gmlake-replay --json exited with status $rc"
fi

for path in "${traces[@]}"; do
	name=${path##*/}
	name=${name%.trace.gz}
	line=$(grep -F "\"trace\": \"$name\"," <<<"$out" | head -n 1)
	if [ -z "$line" ]; then
		result FAIL "$name: no result"
		continue
	fi

	missing=
	for key in $keys; do
		value "$key" "$line" >/dev/null || missing="$missing $key"
	done
	if [ -z "$missing" ]; then
		result OK "$name: all keys present"
	else
		result FAIL "$name: keys missing:$missing"
	fi

	frag=$(value fragmentation_pct "$line")
	if at_most "$frag" "$max_frag"; then
		result OK "$name: fragmentation_pct $frag <= $max_frag"
	else
		result FAIL "$name: fragmentation_pct $frag, limit $max_frag"
	fi

	pct=$(value driver_pct_second_half "$line")
	ms=$(value driver_ms_second_half "$line")
	limit=$max_driver
	note=
	for gap in $known_gaps; do
		if [ "${gap%%:*}" = "$name" ]; then
			limit=${gap#*:}
			note=" (known gap: the goal is $max_driver)"
		fi
	done
	if at_most "$pct" "$limit"; then
		result OK "$name: driver_pct_second_half $pct <= $limit ($ms ms)$note"
	else
		result FAIL "$name: driver_pct_second_half $pct ($ms ms), limit $limit$note"
	fi
done

# --touch on the smallest trace: every block keeps its own bytes.
small=
for path in "${traces[@]}"; do
	if [ -z "$small" ] || [ "$(stat -c %s "$path")" -lt \
		"$(stat -c %s "$small")" ]; then
		small=$path
	fi
done
name=${small##*/}
if "$replay" --json --quiet --touch "$small" >/dev/null; then
	result OK "${name%.trace.gz}: --touch patterns intact"
else
	result FAIL "${name%.trace.gz}: --touch run failed"
fi

# Bounds: what a trace makes the replayer spend. A scratch directory for
# the traces made here.
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT

# elapsed START: seconds since START (date +%s.%N).
elapsed() {
	awk -v a="$1" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }'
}

# One 256 GiB block, allocated and freed: 131072 chunks mapped, then torn
# down. The emulated device's mapping list took 13.8 s (quadratic).
big=$((256 << 30))
printf 'alloc 4096 %s 0\nfree_completed 4096 %s 0\n' $big $big >"$tmp/big.trace"
start=$(date +%s.%N)
timeout 60 "$replay" --json --quiet "$tmp/big.trace" >/dev/null
rc=$?
secs=$(elapsed "$start")
if [ $rc -eq 0 ] && at_most "$secs" 8; then
	result OK "256 GiB block: replayed in $secs s (at most 8)"
else
	result FAIL "256 GiB block: status $rc after $secs s (at most 8)"
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ] || exit 1
exit 0
