#!/bin/bash
# SPDX-License-Identifier: MIT
#
# gmlake-replay turns gmlake_long_lived() on and off at a trace's
# long_lived lines, as the optimizer hooks do in a run under libgmlake.
# The trace made here: a 2 MiB block kept, then in settling step 0 a
# 64 MiB activation allocated and freed and a 64 MiB block that stays
# (an optimizer's state); steps 1-3 allocate and free the activation
# again. With the state inside a long_lived window it takes new memory
# past the activation's hole, so the steady steps reuse the hole and make
# no driver call; without the window the state takes the hole and step 1
# must grow. Also: the window is counted, and an off without an on, or a
# flag other than 0 or 1, fails naming the line.
#
# Automake test: exit 0 pass, 1 fail, 99 hard error. $srcdir is the source
# directory, $top_builddir the build directory (both default to '.').

srcdir=${srcdir:-.}

# $replay on the emulated device, replay_setup, result, value, run_json and the
# counts.
# shellcheck source=tests/replay_lib.sh
. "$srcdir/tests/replay_lib.sh" || exit 99

replay_setup replay_long_lived_test

MIB=1048576
ACT=$((64 * MIB))

# make_trace FILE ON OFF: the trace above; ON and OFF are the lines around
# the state's allocation (empty: none).
make_trace() {
	local k
	{
		echo "# gmlake-replay test workload=long_lived steps=4"
		echo "alloc 1048576 $((2 * MIB)) 0"
		echo "step 0 1 0"
		echo "alloc 4194304 $ACT 0"
		echo "free_completed 4194304 $ACT 0"
		[ -n "$2" ] && echo "$2"
		echo "alloc 8388608 $ACT 0"
		[ -n "$3" ] && echo "$3"
		for k in 1 2 3; do
			echo "step $k 0 0"
			echo "alloc 4194304 $ACT 0"
			echo "free_completed 4194304 $ACT 0"
		done
	} >"$1"
}

make_trace "$tmp/window.trace" "long_lived 1 0 0" "long_lived 0 0 0"
make_trace "$tmp/plain.trace"

run_json "$tmp/window.trace"
if [ $rc -eq 0 ] && [ "$(value long_lived_windows "$out")" = 1 ] &&
	[ "$(value unknown_actions "$out")" = 0 ]; then
	result OK "a long_lived window is read and counted"
else
	result FAIL "window: status $rc: $out $(cat "$tmp/err")"
fi
if [ "$(value creates_second_half "$out")" = 0 ] &&
	[ "$(value driver_ms_second_half "$out")" = 0.000 ]; then
	result OK "state in the window: the steady steps reuse the hole"
else
	result FAIL "state in the window: steady steps grew: $out"
fi

run_json "$tmp/plain.trace"
if [ $rc -eq 0 ] && [ "$(value long_lived_windows "$out")" = 0 ] &&
	[ "$(value creates_second_half "$out")" -gt 0 ] 2>/dev/null; then
	result OK "state without the window: it takes the hole, step 1 grows"
else
	result FAIL "no window: status $rc, wanted growth in step 1: $out"
fi

# check_refused NAME ON OFF WANT WHAT: the trace fails, saying WANT.
check_refused() {
	make_trace "$tmp/$1.trace" "$2" "$3"
	run_json "$tmp/$1.trace"
	if [ $rc -eq 1 ] && [ -z "$out" ] && grep -q "$4" "$tmp/err"; then
		result OK "$5 is refused, naming its line"
	else
		result FAIL "$5: status $rc: $(cat "$tmp/err")"
	fi
}
check_refused off "" "long_lived 0 0 0" \
	"off.trace:7: gmlake_long_lived: off without an on" "an off before any on"
check_refused flag "long_lived 2 0 0" "" \
	"flag.trace:6: long_lived's flag" "a flag of 2"

replay_finish
