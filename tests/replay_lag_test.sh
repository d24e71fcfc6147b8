#!/bin/bash
# SPDX-License-Identifier: MIT
#
# gmlake-replay --lag: the emulated device runs queued work only while the
# host waits (GMLAKE_EMU_LAG), and the replay waits for every stream at
# step lines. On the GraphSAGE trace of tests/data (stitched ranges freed
# and asked for again within a step) the allocator must see that lag: the
# lagged replay runs to the end with the same peak bound, reports lag 1,
# and its driver work differs from the plain replay's (a replay that
# ignored --lag, or a device that ran work on its own, gives the same
# work). GMLAKE_EMU_LAG alone lags the same way. --lag with --touch or
# with --backend cuda is a usage error (exit 2); under GMLAKE_BACKEND=cuda
# the trace fails (exit 1) before any device is opened.
#
# Automake test: exit 0 pass, 1 fail, 99 hard error. $srcdir is the source
# directory, $top_builddir the build directory (both default to '.').

srcdir=${srcdir:-.}
trace=$srcdir/tests/data/eco_sage.trace.gz

# $replay on the emulated device, replay_setup, result, value, at_most,
# run_json and the counts.
# shellcheck source=tests/replay_lib.sh
. "$srcdir/tests/replay_lib.sh" || exit 99

replay_setup replay_lag_test

# work LINE: the driver work of a JSON line, as one comparable string.
work() {
	local k s=
	for k in creates maps unmaps stitches; do
		s="$s $k=$(value "$k" "$1")"
	done
	echo "$s"
}

# runs OPTION...: the replay of the trace, in $out; one case.
runs() {
	run_json "$@" "$trace"
	if [ $rc -eq 0 ]; then
		result OK "replay${*:+ $*} runs to the end"
	else
		result FAIL "replay${*:+ $*} exits $rc: $(cat "$tmp/err")"
	fi
}

runs
plain=$out
runs --lag
lagged=$out

if [ "$(value lag "$plain")" = 0 ] && [ "$(value lag "$lagged")" = 1 ]; then
	result OK "JSON lag is 0, then 1 with --lag"
else
	result FAIL "JSON lag: '$(value lag "$plain")' and '$(value lag "$lagged")'"
fi

if [ "$(work "$plain")" != "$(work "$lagged")" ]; then
	result OK "the lag reaches the allocator:$(work "$lagged") against$(work "$plain")"
else
	result FAIL "the same driver work with and without --lag:$(work "$plain")"
fi

frag=$(value fragmentation_pct "$lagged")
if at_most "$frag" 3; then
	result OK "lagged fragmentation $frag% at most 3%"
else
	result FAIL "lagged fragmentation '$frag'% over 3%"
fi

GMLAKE_EMU_LAG=1 run_json "$trace"
env_lag=$out
if [ "$(value lag "$env_lag")" = 1 ] &&
	[ "$(work "$env_lag")" = "$(work "$lagged")" ]; then
	result OK "GMLAKE_EMU_LAG=1 lags as --lag does"
else
	result FAIL "GMLAKE_EMU_LAG=1: lag '$(value lag "$env_lag")',$(work "$env_lag") against$(work "$lagged")"
fi

for bad in "--touch" "--backend cuda"; do
	# shellcheck disable=SC2086
	"$replay" --quiet --lag $bad "$trace" >/dev/null 2>"$tmp/err"
	rc=$?
	if [ $rc -eq 2 ] && grep -q -- "--lag" "$tmp/err"; then
		result OK "--lag $bad refused (exit 2, naming --lag)"
	else
		result FAIL "--lag $bad: exit $rc: $(cat "$tmp/err")"
	fi
done

GMLAKE_BACKEND=cuda "$replay" --quiet --lag "$trace" >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 1 ] && grep -q -- "--lag is the emulated device's" "$tmp/err"; then
	result OK "--lag under GMLAKE_BACKEND=cuda fails naming --lag"
else
	result FAIL "--lag under GMLAKE_BACKEND=cuda: exit $rc: $(cat "$tmp/err")"
fi

replay_finish
