# SPDX-License-Identifier: MIT
#
# Helpers of the replay tests (replay_test.sh, replay_steps_test.sh,
# replay_orders_test.sh, replay_long_lived_test.sh, replay_lag_test.sh,
# replay_explain_test.sh, replay_trim_test.sh), sourced: the tool and its
# device, their set-up, a pass/fail count, one trace's replay as JSON, the
# values of gmlake-replay's JSON lines, a bound on them, and the
# test's end.

# The tool under test, built in $top_builddir (default '.'), on the
# emulated device: every replay test runs there, whatever the caller's
# GMLAKE_BACKEND.
top_builddir=${top_builddir:-.}
replay=$top_builddir/tools/gmlake-replay
GMLAKE_BACKEND=emu
export GMLAKE_BACKEND

passed=0
failed=0

# result OK|FAIL message
result() {
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

# line_of NAME TEXT: the JSON line of trace NAME among TEXT's lines.
line_of() {
	grep -F "\"trace\": \"$1\"," <<<"$2" | head -n 1
}

# at_most VALUE LIMIT: true when VALUE is a number no greater than LIMIT.
at_most() {
	awk -v v="$1" -v max="$2" 'BEGIN {
		if (v !~ /^-?[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?$/)
			exit 1
		exit !(v + 0 <= max + 0)
	}'
}

# replay_setup NAME: exit 99 (hard error, naming test NAME) unless
# $replay is built; a scratch directory $tmp, removed at exit.
replay_setup() {
	if [ ! -x "$replay" ]; then
		echo "$1: $replay not built" >&2
		exit 99
	fi
	tmp=$(mktemp -d) || exit 99
	trap 'rm -rf "$tmp"' EXIT
}

# run_json [OPTION...] TRACE: gmlake-replay's JSON line for TRACE in $out,
# its status in $rc, its stderr in $tmp/err ($replay and $tmp set by the
# caller).
run_json() {
	out=$("$replay" --json --quiet "$@" 2>"$tmp/err")
	rc=$?
}

# replay_finish: the counts, then the test's exit: 0 when every case
# passed, else 1.
replay_finish() {
	echo "$passed passed, $failed failed"
	[ "$failed" -eq 0 ] || exit 1
	exit 0
}
