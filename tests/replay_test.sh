#!/bin/bash
# SPDX-License-Identifier: MIT
#
# Replay the PyTorch traces in tests/data on the emulated device and hold
# libgmlake to its goals on each: fragmentation at most 2.5% of reserved
# memory, driver work of the steady-state half at most 1% of GPU time, and
# peak reserved memory at most PyTorch's with expandable segments on the
# same events (bench/expandable_sim.py; skipped without python3).
# A second, shorter run writes and checks a pattern in every block
# (--touch), which catches two live blocks sharing memory.
#
# Automake test: exit 0 pass, 1 fail, 99 hard error. $srcdir is the source
# directory, $top_builddir the build directory (both default to '.').
# REPLAY_MAX_FRAG_PCT and REPLAY_MAX_DRIVER_PCT override the limits.

srcdir=${srcdir:-.}
max_frag=${REPLAY_MAX_FRAG_PCT:-2.5}
max_driver=${REPLAY_MAX_DRIVER_PCT:-1.0}
# Traces that do not meet the driver goal yet, as name:ceiling (a ceiling
# still fails the test on a regression).
#
# eco_sage (torch_geometric GraphSAGE on random graphs, bench/capture_eco.py):
# each step allocates and frees a message tensor of 500-1,700 chunks per
# layer (20-65% of the peak), between node tensors a tenth that size.
# Top fit (lib/fit.c: a quarter of the requested peak or more) keeps the
# node tensors off the message tensor's place; what remains is a stitch
# at the second visit of the largest shape and a few small repairs
# (1.37% of their time at H200 prices, priced per handle; 2.77% by first
# fit, 4.35% with no remap to single chunks, 8.5% before slab swaps).
#
# eco_compile_bench (torch.compile, recorded in the bench's own libgmlake
# run, BENCH_TRACE): its 10 ms steady steps pay one-time work at the
# second visit of a shape (steps 1 and 3: 3.6 ms in all, 1.72%). Before a
# repair stopped undoing the last repair of another request size, two
# requests took turns repairing one view every step (2.88%): the ceiling
# catches that coming back.
#
# eco_convnet (timm ResNet-50 under cudnn.benchmark, whose searches empty
# the cache; trim lines): five steady steps regrow what the trims gave
# back (1.75%). Regrowth ahead after a burst of trims (lib/alloc.c) cut
# it on the GPU from 170 to 71-84 ms of steady driver time, and the mean
# step to the default allocator's (bench/results/regrow-ffb21fc-h100/);
# regrowth in handles of four growth handles, from 5.43% to 1.75% here.
# PyTorch's allocators regrow it too; the handles are what remains.
#
# known_frag_gaps takes the same form for fragmentation. Growth handles
# (slabs, lib/slab.c; GMLAKE_GROW_HANDLE=20M) cut the priced steady driver
# time 3-50x (eco_vit 51.7 -> 6.7 ms, eco_fsdp 45.6 -> 0.5, eco_maskrcnn
# 65.2 -> 6.5), but a slab partly taken is stitched only by its free end
# at an end of a view (lib/stitch.c), and eco_sage ends above 2.5% at
# 2.69% (2.92 by first fit; eco_maskrcnn and plain, 2.68 and 2.92% before
# the ends, are at 2.36 and 2.23).
known_gaps=${REPLAY_KNOWN_GAPS:-eco_sage:1.6 eco_compile_bench:2.0 eco_convnet:2.0}
known_frag_gaps=${REPLAY_KNOWN_FRAG_GAPS:-eco_sage:2.8}
# known_peak_gaps, as peak reserved over the expandable model's: eco_vit's
# blocks leave 287 MiB of their last 2 MiB chunks unused at its peak,
# where expandable segments splits at 512 bytes (1.013x; the H200 gave
# the same, bench/results/expandable-sim-8d87a47.md).
known_peak_gaps=${REPLAY_KNOWN_PEAK_GAPS:-eco_vit:1.015}

keys="trace events peak_allocated peak_reserved fragmentation_pct
torch_fragmentation_pct expandable_fragmentation_pct driver_ms_second_half
driver_pct_second_half measured_driver_ms_second_half creates maps set_access
unmaps releases stitches alloc_p50_us alloc_p99_us skipped_frees backend"

# $replay on the emulated device, replay_setup, result, value and the counts.
# shellcheck source=tests/replay_lib.sh
. "$srcdir/tests/replay_lib.sh" || exit 99

# gap_limit NAME GOAL GAP...: sets limit (GOAL, or NAME's ceiling among the
# name:ceiling GAPs) and note (what the goal is, for a known gap).
gap_limit() {
	local name=$1 goal=$2 gap
	shift 2
	limit=$goal
	note=
	for gap in "$@"; do
		if [ "${gap%%:*}" = "$name" ]; then
			limit=${gap#*:}
			note=" (known gap: the goal is $goal)"
		fi
	done
}

replay_setup replay_test
shopt -s nullglob
traces=("$srcdir"/tests/data/*.trace.gz)
if [ ${#traces[@]} -eq 0 ]; then
	echo "replay_test: no traces in $srcdir/tests/data" >&2
	exit 99
fi

model=
if command -v python3 >/dev/null &&
	[ -f "$srcdir/bench/expandable_sim.py" ]; then
	model=$(python3 "$srcdir/bench/expandable_sim.py" --json "${traces[@]}") ||
		result FAIL "bench/expandable_sim.py failed on the traces"
else
	echo "# no python3 or bench/: peaks not compared with expandable segments'"
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
	line=$(line_of "$name" "$out")
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
	gap_limit "$name" "$max_frag" $known_frag_gaps
	if at_most "$frag" "$limit"; then
		result OK "$name: fragmentation_pct $frag <= $limit$note"
	else
		result FAIL "$name: fragmentation_pct $frag, limit $limit$note"
	fi

	pct=$(value driver_pct_second_half "$line")
	ms=$(value driver_ms_second_half "$line")
	gap_limit "$name" "$max_driver" $known_gaps
	if at_most "$pct" "$limit"; then
		result OK "$name: driver_pct_second_half $pct <= $limit ($ms ms)$note"
	else
		result FAIL "$name: driver_pct_second_half $pct ($ms ms), limit $limit$note"
	fi

	[ -n "$model" ] || continue
	exp=$(value peak_reserved "$(line_of "$name" "$model")")
	res=$(value peak_reserved "$line")
	ratio=$(awk -v a="$res" -v b="$exp" 'BEGIN { if (b > 0) printf "%.4f", a / b }')
	gap_limit "$name" 1.0 $known_peak_gaps
	if at_most "$ratio" "$limit"; then
		result OK "$name: peak reserved $ratio x expandable segments' <= $limit$note"
	else
		result FAIL "$name: peak reserved $ratio x expandable segments' ($res / ${exp:-none}), limit $limit$note"
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

# Bounds: what a trace makes the replayer spend, on traces made in $tmp.

# --touch on blocks of 9-15 bytes (a pattern of 8 at their start): the
# replayer once copied their whole size into an 8-byte buffer.
{
	echo "# pytorch test workload=touch_small steps=1 peak_alloc=25600"
	echo "# action addr size stream"
	echo "alloc 1000 24576 0"
	echo "alloc 30000 12 0"
	echo "alloc 40000 15 0"
	echo "alloc 50000 9 0"
	for b in 30000:12 40000:15 50000:9 1000:24576; do
		echo "free_requested ${b%:*} ${b#*:} 0"
		echo "free_completed ${b%:*} ${b#*:} 0"
	done
} | gzip > "$tmp/touch_small.trace.gz"
if "$replay" --json --quiet --touch "$tmp/touch_small.trace.gz" >/dev/null; then
	result OK "touch_small: --touch patterns of 9-15-byte blocks intact"
else
	result FAIL "touch_small: --touch failed on 9-15-byte blocks"
fi

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

# maxrss CMD...: the command's peak resident memory in KiB, -1 when it
# failed, empty without python3.
maxrss() {
	command -v python3 >/dev/null 2>&1 || return 0
	python3 -c 'import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
      if r.returncode == 0 else -1)' "$@"
}

# Memory follows the blocks live at once, not the trace's length: a
# million events of one block cost what one does (the whole trace was
# held, 47 bytes an event: 940 MB for 20 M).
printf 'alloc 4096 512 0\nfree_completed 4096 512 0\n' >"$tmp/one.trace"
awk 'BEGIN { for (i = 0; i < 500000; i++)
	print "alloc 4096 512 0\nfree_completed 4096 512 0" }' |
	gzip -1 >"$tmp/million.trace.gz"
base=$(maxrss "$replay" --json --quiet "$tmp/one.trace")
big=$(maxrss "$replay" --json --quiet "$tmp/million.trace.gz")
if [ -z "$base" ]; then
	echo "skip - memory bound (no python3)"
elif case ${GML_TEST_CFLAGS:-} in *-fsanitize*) true ;; *) false ;; esac; then
	# The sanitizers' quarantine keeps freed memory: not the replayer's.
	echo "skip - memory bound (sanitizer build: $big KiB, $base KiB)"
elif [ "$base" -gt 0 ] && [ "$big" -gt 0 ] &&
	[ $((big - base)) -lt 16384 ]; then
	result OK "1 M events: $big KiB at most, $base KiB for 2 events"
else
	result FAIL "1 M events: $big KiB at most, $base KiB for 2 events"
fi

# What a header can ask for is bounded: 1 PiB of peak is refused at once.
printf '# pytorch 2.11.0 peak_reserved=1125899906842624\nalloc 4096 1024 0\n' \
	>"$tmp/pib.trace"
start=$(date +%s.%N)
"$replay" --json --quiet "$tmp/pib.trace" >/dev/null 2>"$tmp/err"
rc=$?
secs=$(elapsed "$start")
if [ $rc -eq 1 ] && grep -q "past the replayer's bound" "$tmp/err" &&
	at_most "$secs" 5; then
	result OK "1 PiB header refused in $secs s"
else
	result FAIL "1 PiB header: status $rc after $secs s: $(cat "$tmp/err")"
fi

# And so are the blocks live at once (--max-live).
awk 'BEGIN { for (i = 1; i <= 101; i++) print "alloc " i * 4096 " 512 0" }' \
	>"$tmp/live.trace"
"$replay" --json --max-live=100 "$tmp/live.trace" >/dev/null 2>"$tmp/err"
rc=$?
if [ $rc -eq 1 ] && grep -q "live.trace:101: more than 100 blocks" "$tmp/err"
then
	result OK "101 live blocks refused past --max-live=100"
else
	result FAIL "--max-live: status $rc: $(cat "$tmp/err")"
fi
if "$replay" --json --max-live=101 "$tmp/live.trace" >/dev/null 2>&1; then
	result OK "101 live blocks replayed with --max-live=101"
else
	result FAIL "101 live blocks not replayed with --max-live=101"
fi

# Progress: nothing on stderr when it is not a terminal; a line on one.
"$replay" --json "$small" >/dev/null 2>"$tmp/err"
if [ ! -s "$tmp/err" ]; then
	result OK "no progress line off a terminal"
else
	result FAIL "stderr off a terminal: $(head -c 200 "$tmp/err")"
fi
if command -v script >/dev/null 2>&1; then
	script -qfec "'$replay' --json '$tmp/million.trace.gz' >/dev/null" \
		/dev/null </dev/null >"$tmp/tty" 2>&1
	if grep -q "million: replaying [0-9]* of 1000000 events" "$tmp/tty"
	then
		result OK "progress line on a terminal"
	else
		result FAIL "no progress line on a terminal: $(head -c 200 "$tmp/tty")"
	fi
else
	echo "skip - progress on a terminal (no script)"
fi

replay_finish
