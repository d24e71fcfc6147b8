#!/bin/bash
# SPDX-License-Identifier: MIT
#
# gmlake-replay --explain: on stderr, a line at each step line, one for
# each allocation of at least SIZE bytes and one for each allocation or
# free that called the driver, naming the policy's steps and the calls;
# stdout's report unchanged. The trace is made here: a 64 MiB block in
# step 0 (settling: the allocator grows), freed and allocated again in
# step 1 (steady: a fit, no driver call), with a 1 MiB block in each.
#
# Automake test: exit 0 pass, 1 fail, 99 hard error. $srcdir is the source
# directory, $top_builddir the build directory (both default to '.').

srcdir=${srcdir:-.}

# $replay on the emulated device, replay_setup, result, value, run_json and the
# counts.
# shellcheck source=tests/replay_lib.sh
. "$srcdir/tests/replay_lib.sh" || exit 99

replay_setup replay_explain_test

MIB=1048576
{
	echo "# gmlake-replay test workload=explain steps=2"
	echo "# action addr size stream"
	echo "step 0 1 0"
	echo "alloc 4194304 $((64 * MIB)) 0"
	echo "alloc 1048576 $MIB 0"
	echo "free_completed 4194304 $((64 * MIB)) 0"
	echo "free_completed 1048576 $MIB 0"
	echo "step 1 0 0"
	echo "alloc 4194304 $((64 * MIB)) 0"
	echo "alloc 1048576 $MIB 0"
	echo "free_completed 4194304 $((64 * MIB)) 0"
	echo "free_completed 1048576 $MIB 0"
} >"$tmp/t.trace"

# The report alone, then with --explain (the default size, 64M).
run_json "$tmp/t.trace"
plain=$out
if [ $rc -eq 0 ] && [ ! -s "$tmp/err" ]; then
	result OK "no --explain: nothing on stderr"
else
	result FAIL "no --explain: status $rc, stderr $(head -c 300 "$tmp/err")"
fi
run_json --explain "$tmp/t.trace"
cp "$tmp/err" "$tmp/explain"
if [ $rc -eq 0 ]; then
	result OK "--explain ran"
else
	result FAIL "--explain: status $rc: $(head -c 300 "$tmp/err")"
fi
for key in peak_reserved fragmentation_pct creates maps stitches; do
	was=$(value "$key" "$plain")
	if [ -n "$was" ] && [ "$(value "$key" "$out")" = "$was" ]; then
		result OK "--explain leaves $key as it was"
	else
		result FAIL "--explain changed $key: $(value "$key" "$plain") -> $(value "$key" "$out")"
	fi
done

# expect PATTERN WHAT: a line of $tmp/explain matches the extended regex.
expect() {
	if grep -Eq "$1" "$tmp/explain"; then
		result OK "$2"
	else
		result FAIL "$2: no line matching '$1' in: $(head -c 600 "$tmp/explain")"
	fi
}

expect '^t: step 0 \(settling\)$' "step 0's line, settling"
expect '^t: step 1 \(steady\)$' "step 1's line, steady"
# Step 0's block grows the device: a policy step and mem_create calls.
expect "^t:4: alloc $((64 * MIB)) -> 0x[0-9a-f]+: .*grow.*; .*mem_create [1-9]" \
	"step 0's 64 MiB block: grow, with its driver calls"
# Step 1's comes from what is mapped: a fit, no driver call.
expect "^t:9: alloc $((64 * MIB)) -> 0x[0-9a-f]+: fit$" \
	"step 1's 64 MiB block: a fit, no driver call"
if grep -q "^t:10: alloc" "$tmp/explain"; then
	result FAIL "step 1's 1 MiB block shown (under 64M, no driver call)"
else
	result OK "step 1's 1 MiB block not shown"
fi
# Lines in trace order: step 0, its block, step 1, its block.
order=$(grep -Eo '^t(: step [01]|:4:|:9:)' "$tmp/explain" | tr '\n' ' ')
if [ "$order" = "t: step 0 t:4: t: step 1 t:9: " ]; then
	result OK "lines in the trace's order"
else
	result FAIL "lines out of order: $order"
fi

# A size: above 64 MiB the fit of step 1 is no longer shown; step 0's
# growth still is (it called the driver).
run_json --explain=1G "$tmp/t.trace"
if [ $rc -eq 0 ] && grep -q "^t:4: alloc" "$tmp/err" &&
	! grep -q "^t:9: alloc" "$tmp/err"; then
	result OK "--explain=1G: the growth shown, the fit not"
else
	result FAIL "--explain=1G: status $rc: $(head -c 600 "$tmp/err")"
fi

# A bad size is a usage error naming it.
"$replay" --quiet --explain=lots "$tmp/t.trace" >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 2 ] && grep -q "bad size 'lots'" "$tmp/err"; then
	result OK "--explain=lots: usage error"
else
	result FAIL "--explain=lots: status $rc: $(cat "$tmp/err")"
fi

replay_finish
