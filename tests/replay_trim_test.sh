#!/bin/bash
# SPDX-License-Identifier: MIT
#
# gmlake-replay calls gmlake_trim() at a trace's trim lines (where the
# traced run emptied its cache, as PyTorch's cuDNN benchmark does after
# each search), and after a burst of trims the allocator regrows what they
# gave back ahead of need. The trace made here: a 2 MiB block kept; in
# settling step 0, sixty 8 MiB activations (four chunks each, under a
# growth handle) live at once, then freed; trims; steady step 1 the same
# activations again. Without trim lines step 1 reuses step 0's memory (no
# driver call). After a burst (a trim, a 4 MiB block allocated and freed
# as a search's workspace, a trim) step 1 regrows 480 MiB ahead of need by
# a quarter, in whole handles once the budget allows one (18 set-access
# calls over 42 handles; at most 20 and 60 pass), where one growth per
# activation took 60 over 240; the peak no higher than before the trims.
# After a lone trim (between two workloads, say) growth is as before: one
# per activation. Regrowth maps handles of four growth handles: the
# captured eco_convnet trace's steady steps create at most 500 (338;
# 1118 in growth handles), with --touch. Also: trims are counted, shown
# by --explain, and a trim line with a field other than 0 fails naming
# its line.
#
# Automake test: exit 0 pass, 1 fail, 99 hard error. $srcdir is the source
# directory, $top_builddir the build directory (both default to '.').

srcdir=${srcdir:-.}

# $replay on the emulated device, replay_setup, result, value, run_json,
# the counts and replay_finish.
# shellcheck source=tests/replay_lib.sh
. "$srcdir/tests/replay_lib.sh" || exit 99

replay_setup replay_trim_test

MIB=1048576
ACT=$((8 * MIB))

# make_trace FILE TRIM...: the trace above; the TRIM lines come between
# the steps (none: no line).
make_trace() {
	local k i f=$1

	shift
	{
		echo "# gmlake-replay test workload=trim steps=2"
		echo "alloc 1048576 $((2 * MIB)) 0"
		for k in 0 1; do
			if [ $k = 1 ]; then
				for i in "$@"; do
					echo "$i"
				done
			fi
			echo "step $k $((1 - k)) 0"
			for i in $(seq 1 60); do
				echo "alloc $((i * 16 * MIB)) $ACT 0"
			done
			for i in $(seq 60 -1 1); do
				echo "free_completed $((i * 16 * MIB)) $ACT 0"
			done
		done
	} >"$f"
}

WORKSPACE="alloc 4194304 $((4 * MIB)) 0
free_completed 4194304 $((4 * MIB)) 0"

make_trace "$tmp/kept.trace"
make_trace "$tmp/lone.trace" "trim 0 0 0"
make_trace "$tmp/trim.trace" "trim 0 0 0" "$WORKSPACE" "trim 0 0 0"

run_json "$tmp/kept.trace"
kept=$out
if [ $rc -eq 0 ] && [ "$(value trims "$kept")" = 0 ] &&
	[ "$(value creates_second_half "$kept")" = 0 ]; then
	result OK "no trim: the steady step reuses the first step's memory"
else
	result FAIL "no trim: status $rc: $kept $(cat "$tmp/err")"
fi

run_json "$tmp/trim.trace"
trimmed=$out
if [ $rc -eq 0 ] && [ "$(value trims "$trimmed")" = 2 ] &&
	[ "$(value unknown_actions "$trimmed")" = 0 ] &&
	[ "$(value releases "$trimmed")" -gt 0 ] 2>/dev/null; then
	result OK "trim lines are replayed, counted, and give memory back"
else
	result FAIL "trim: status $rc: $trimmed $(cat "$tmp/err")"
fi

# growth JSON: the steady step's set-access calls and new handles, less
# those of the trace without trims (set-up and step 0 are the same).
growth() {
	calls=$(($(value set_access "$1") - $(value set_access "$kept")))
	handles=$(value creates_second_half "$1")
}

growth "$trimmed"
if [ "$calls" -gt 0 ] && [ "$calls" -le 20 ] && [ "$handles" -gt 0 ] &&
	[ "$handles" -le 60 ]; then
	result OK "after a burst, regrowth goes ahead: $calls set-access calls, $handles handles"
else
	result FAIL "burst: $calls set-access calls, $handles handles (wanted 1-20 and 1-60)"
fi
if [ "$(value peak_reserved "$trimmed")" = \
	"$(value peak_reserved "$kept")" ]; then
	result OK "regrowth stays under the peak held before the trims"
else
	result FAIL "peak reserved $(value peak_reserved "$trimmed") with the trims, $(value peak_reserved "$kept") without"
fi

run_json "$tmp/lone.trace"
growth "$out"
if [ $rc -eq 0 ] && [ "$(value trims "$out")" = 1 ] && [ "$calls" = 60 ] &&
	[ "$handles" = 240 ]; then
	result OK "after a lone trim, one growth per activation"
else
	result FAIL "lone trim: status $rc, $calls set-access calls, $handles handles (wanted 60 and 240)"
fi

run_json --explain "$tmp/trim.trace"
if [ $rc -eq 0 ] &&
	grep -q "^trim:124: trim, [0-9]* MiB released: .*mem_release" \
		"$tmp/err"; then
	result OK "--explain shows the trim, what it released and its calls"
else
	result FAIL "--explain: status $rc: $(head -c 600 "$tmp/err")"
fi

# The captured trace of a ResNet-50 under cudnn.benchmark (211 trims):
# regrowth in handles of four growth handles takes its steady steps from
# 1118 new handles (one growth handle each) to 338; with --touch, every
# block keeps its bytes through the repairs of views over those handles.
conv=$srcdir/tests/data/eco_convnet.trace.gz
run_json --touch "$conv"
if [ $rc -eq 0 ] && [ "$(value trims "$out")" = 211 ] &&
	at_most "$(value creates_second_half "$out")" 500; then
	result OK "eco_convnet: $(value creates_second_half "$out") handles in its steady steps, patterns intact"
else
	result FAIL "eco_convnet: status $rc, $(value creates_second_half "$out") handles in its steady steps (at most 500): $(head -c 600 "$tmp/err")"
fi

make_trace "$tmp/bad.trace" "trim 0 4096 0"
run_json "$tmp/bad.trace"
if [ $rc -eq 1 ] && [ -z "$out" ] &&
	grep -q "bad.trace:124: trim's fields are not 0" "$tmp/err"; then
	result OK "a trim line with a size is refused, naming its line"
else
	result FAIL "bad trim: status $rc: $(cat "$tmp/err")"
fi

replay_finish
