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
top_builddir=${top_builddir:-.}
replay=$top_builddir/tools/gmlake-replay
trace=$srcdir/tests/data/eco_sage.trace.gz

GMLAKE_BACKEND=emu
export GMLAKE_BACKEND

# result, value, at_most and the counts.
# shellcheck source=tests/replay_lib.sh
. "$srcdir/tests/replay_lib.sh" || exit 99

if [ ! -x "$replay" ]; then
	echo "replay_lag_test: $replay not built" >&2
	exit 99
fi
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT

# work LINE: the driver work of a JSON line, as one comparable string.
work() {
	local k s=
	for k in creates maps unmaps stitches; do
		s="$s $k=$(value "$k" "$1")"
	done
	echo "$s"
}

plain=$("$replay" --json --quiet "$trace" 2>"$tmp/err")
rc=$?
lagged=$("$replay" --json --quiet --lag "$trace" 2>>"$tmp/err")
rc2=$?
if [ $rc -ne 0 ] || [ $rc2 -ne 0 ]; then
	result FAIL "replays exit $rc and $rc2: $(cat "$tmp/err")"
else
	result OK "plain and lagged replays run to the end"
fi

[ "$(value lag "$plain")" = 0 ] && [ "$(value lag "$lagged")" = 1 ] &&
	result OK "JSON lag is 0, then 1 with --lag" ||
	result FAIL "JSON lag: '$(value lag "$plain")' and '$(value lag "$lagged")'"

if [ "$(work "$plain")" != "$(work "$lagged")" ]; then
	result OK "the lag reaches the allocator:$(work "$lagged") against$(work "$plain")"
else
	result FAIL "the same driver work with and without --lag:$(work "$plain")"
fi

frag=$(value fragmentation_pct "$lagged")
at_most "$frag" 3 &&
	result OK "lagged fragmentation $frag% at most 3%" ||
	result FAIL "lagged fragmentation '$frag'% over 3%"

env_lag=$(GMLAKE_EMU_LAG=1 "$replay" --json --quiet "$trace" 2>"$tmp/err")
[ "$(value lag "$env_lag")" = 1 ] &&
	[ "$(work "$env_lag")" = "$(work "$lagged")" ] &&
	result OK "GMLAKE_EMU_LAG=1 lags as --lag does" ||
	result FAIL "GMLAKE_EMU_LAG=1: lag '$(value lag "$env_lag")',$(work "$env_lag") against$(work "$lagged")"

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

echo "replay_lag_test: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
