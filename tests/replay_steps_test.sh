#!/bin/bash
# SPDX-License-Identifier: MIT
#
# gmlake-replay prices the steady steps of a trace with step lines, and the
# second half of one without. The traces are made here: set-up, then six
# steps, of which only step 1, steady and in the first half, allocates a
# block larger than any before it and so makes the allocator grow; the
# second half makes no driver calls. With step lines the priced driver
# work must be above 0; the same trace without them must price 0. Also:
# settling steps and the set-up are not priced, the events after the last
# step line are the last step's, drv% is set against steady steps x
# steady_step_ms (or step_ms), and bad step lines fail naming the line.
#
# Automake test: exit 0 pass, 1 fail, 99 hard error. $srcdir is the source
# directory, $top_builddir the build directory (both default to '.').

srcdir=${srcdir:-.}

# $replay on the emulated device, replay_setup, result, value, run_json and the
# counts.
# shellcheck source=tests/replay_lib.sh
. "$srcdir/tests/replay_lib.sh" || exit 99

# is_num VALUE OP LIMIT: VALUE is a number and VALUE OP LIMIT (gt, eq).
is_num() {
	awk -v v="$1" -v op="$2" -v lim="$3" 'BEGIN {
		if (v !~ /^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$/)
			exit 1
		if (op == "gt")
			exit !(v + 0 > lim + 0)
		exit !(v + 0 == lim + 0)
	}'
}

# near A B: two numbers within 0.002 of each other.
near() {
	awk -v a="$1" -v b="$2" 'BEGIN {
		if (a !~ /^[0-9.]+$/ || b !~ /^[0-9.]+$/)
			exit 1
		d = a - b
		exit !(d <= 0.002 && d >= -0.002)
	}'
}

replay_setup replay_steps_test

MIB=1048576

# make_trace FILE BIG_STEP SETTLE_STEP...: set-up (one 2 MiB block kept
# live), then steps 0-5 each allocating and freeing an 8 MiB block, but
# step BIG_STEP a 64 MiB one. Steps 0 and SETTLE_STEP... are settling.
make_trace() {
	local file=$1 big=$2 k s size
	shift 2
	{
		echo "# gmlake-replay test workload=steps steps=6"
		echo "# action addr size stream"
		echo "alloc 1048576 $((2 * MIB)) 0"
		for k in 0 1 2 3 4 5; do
			s=0
			for settle in 0 "$@"; do
				[ "$k" = "$settle" ] && s=1
			done
			size=$((8 * MIB))
			[ "$k" = "$big" ] && size=$((64 * MIB))
			echo "step $k $s 0"
			echo "alloc 4194304 $size 0"
			echo "free_completed 4194304 $size 0"
		done
	} >"$file"
}

# Step 1 grows: with step lines, and the same trace without them.
make_trace "$tmp/steps.trace" 1
grep -v '^step ' "$tmp/steps.trace" >"$tmp/nosteps.trace"

run_json "$tmp/steps.trace"
ms=$(value driver_ms_second_half "$out")
if [ $rc -eq 0 ] && [ "$(value priced "$out")" = steady_steps ] &&
	[ "$(value steady_steps "$out")" = 5 ] &&
	[ "$(value unknown_actions "$out")" = 0 ]; then
	result OK "step lines: priced steady_steps, 5 steady steps"
else
	result FAIL "step lines: status $rc: $out $(cat "$tmp/err")"
fi
if is_num "$ms" gt 0 &&
	is_num "$(value creates_second_half "$out")" gt 0; then
	result OK "step lines: the growth of steady step 1 priced ($ms ms)"
else
	result FAIL "step lines: driver_ms_second_half $ms, wanted > 0: $out"
fi

run_json "$tmp/nosteps.trace"
ms=$(value driver_ms_second_half "$out")
if [ $rc -eq 0 ] && [ "$(value priced "$out")" = second_half ] &&
	[ "$(value steady_steps "$out")" = 0 ]; then
	result OK "no step lines: priced second_half, 0 steady steps"
else
	result FAIL "no step lines: status $rc: $out $(cat "$tmp/err")"
fi
# The replay did grow; only not in the second half.
if is_num "$ms" eq 0 && is_num "$(value creates_second_half "$out")" eq 0 &&
	is_num "$(value creates "$out")" gt 0; then
	result OK "no step lines: second half priced 0 ms"
else
	result FAIL "no step lines: driver_ms_second_half $ms, wanted 0: $out"
fi

# --per-step: one line a step under the row; after step 0's first block,
# the driver work is step 1's growth alone.
lines=$("$replay" --quiet --per-step "$tmp/steps.trace" 2>"$tmp/err")
rc=$?
if [ $rc -eq 0 ] &&
	[ "$(grep -c '^  step ' <<<"$lines")" = 6 ] &&
	grep -Eq '^  step 0 +settling +drv_ms' <<<"$lines" &&
	grep -Eq '^  step 1 +steady +drv_ms' <<<"$lines" &&
	awk '$1 == "step" && $2 > 0 { grew = $5 + 0 > 0
		if (grew != ($2 == 1)) bad = 1 } END { exit bad }' <<<"$lines"; then
	result OK "--per-step: six steps, after step 0 the work in step 1 alone"
else
	result FAIL "--per-step: status $rc: $lines $(cat "$tmp/err")"
fi

# Settling steps are not priced: step 1 marked settling.
make_trace "$tmp/settle.trace" 1 1
run_json "$tmp/settle.trace"
ms=$(value driver_ms_second_half "$out")
if [ $rc -eq 0 ] && [ "$(value steady_steps "$out")" = 4 ] &&
	is_num "$ms" eq 0; then
	result OK "a settling step's growth is not priced"
else
	result FAIL "settling step 1: status $rc, $ms ms: $out"
fi

# The events after the last step line are the last step's.
make_trace "$tmp/tail.trace" 5
run_json "$tmp/tail.trace"
ms=$(value driver_ms_second_half "$out")
if [ $rc -eq 0 ] && is_num "$ms" gt 0; then
	result OK "the last step's growth priced ($ms ms)"
else
	result FAIL "growth in the last step: status $rc, $ms ms: $out"
fi

# drv%: against steady steps x steady_step_ms, else x step_ms.
# check_pct SIDECAR PER_STEP WHAT: drv% with that sidecar is the priced
# ms over 5 steady steps x PER_STEP ms.
check_pct() {
	echo "$1" >"$tmp/side.trace.json"
	run_json "$tmp/side.trace"
	ms=$(value driver_ms_second_half "$out")
	pct=$(value driver_pct_second_half "$out")
	want=$(awk -v ms="$ms" -v d="$2" \
		'BEGIN { printf "%.4f", 100 * ms / (5 * d) }')
	if [ $rc -eq 0 ] && near "$pct" "$want"; then
		result OK "drv% $pct against 5 x $3"
	else
		result FAIL "drv% $pct, wanted $want (5 x $3): $out"
	fi
}
cp "$tmp/steps.trace" "$tmp/side.trace"
check_pct '{"steps": 6, "step_ms": 100.0, "steady_step_ms": 50.0}' 50 \
	"steady_step_ms 50"
check_pct '{"steps": 6, "step_ms": 100.0}' 100 \
	"step_ms 100 without steady_step_ms"

# Bad step lines fail before the replay, naming the line.
# check_refused NAME SED WANT WHAT: the trace with SED applied fails, and
# its error says WANT.
check_refused() {
	make_trace "$tmp/$1.trace" 1
	sed -i "$2" "$tmp/$1.trace"
	run_json "$tmp/$1.trace"
	if [ $rc -eq 1 ] && [ -z "$out" ] && grep -q "$3" "$tmp/err"; then
		result OK "$4 is refused, naming its line"
	else
		result FAIL "$4: status $rc: $(cat "$tmp/err")"
	fi
}
check_refused order 's/^step 3 0 0$/step 4 0 0/' \
	"order.trace:13: step 4 where step 3 was due" "a step out of order"
check_refused flag 's/^step 2 0 0$/step 2 2 0/' \
	"flag.trace:10: step's settle flag" "a settle flag of 2"

replay_finish
