#!/bin/bash
# SPDX-License-Identifier: MIT
#
# Build here, then check and time everything on a GPU machine in one call.
#
#   tools/gpu.sh build [CONFIGURE-ARGS...]
#	On the build machine (Debian, with the packages of
#	tools/setup-debian.sh). Configures a static build (--disable-shared,
#	so no libtool wrapper scripts) in build-gpu/, builds the library, the
#	tools and every check program without running them, and copies the
#	shared libraries they need that a bare GPU machine lacks (Check's
#	libsubunit, ...) into build-gpu/runtime-libs/.
#
#	It also links build-gpu/libgmlake.so from the same (position-
#	independent) objects, for Python and the benchmarks.
#
#   tools/gpu.sh variant NAME CPP-FLAGS...
#	On the build machine, after build: the library again, from the same
#	sources and configure arguments plus CPP-FLAGS (an experiment kept
#	behind an #ifdef in lib/; settings a context reads, such as
#	GMLAKE_GROW_SLACK, need no variant), linked as
#	build-gpu/variants/NAME/libgmlake.so and nothing else, so that one
#	GPU call can run main's library and the variant side by side:
#	    tools/gpu.sh bench --lib $PWD/build-gpu/variants/NAME/libgmlake.so ...
#	(the later --lib wins; the tools and tests stay main's).
#
#   tools/gpu.sh bench [BENCH-ARGS...]
#	On the GPU machine: python3 bench/bench.py with build-gpu/libgmlake.so
#	(PyTorch's allocators against libgmlake on real models), writing to
#	${GML_GPU_OUT:-/tmp}/bench (results.json, results.md); BENCH-ARGS go
#	to bench.py (--workloads gpt|eco|all|NAMES, --round K, --rounds N,
#	--fresh, --quick, --sweep, --report ...). One round of the ecosystem
#	workloads in one call (K = 1, 2, 3, each call its own):
#	    GML_GPU_OUT=DIR tools/gpu.sh bench --workloads eco --round K
#	then merge the rounds' results.json anywhere, without a GPU:
#	    python3 bench/bench.py --report R1 R2 R3 --out DIR
#	With --report, bench needs no build: it reads the results in
#	${GML_GPU_OUT:-/tmp}/bench (or those named) and runs nothing.
#
#   tools/gpu.sh ipc
#	On the GPU machine, after build: sharing blocks between processes
#	(check_ipc, check_torch's IPC case, examples/ipc with
#	GMLAKE_BACKEND=cuda; vmm_probe's export question, what exportable
#	handles cost; check_peer, which needs two GPUs; gpu_parity's enable,
#	ipc, mempool, nccl_mempool and mempool_allocator rows:
#	torch.multiprocessing, NCCL's buffer registration and pools on a
#	user's allocator through the adapter). Writes gpu-ipc.log,
#	gpu-ipc-summary.log,
#	gpu-vmm-export.txt and gpu-parity-ipc.json to ${GML_GPU_OUT:-/tmp}.
#
#   tools/gpu.sh capture [CAPTURE-ARGS...]
#	On the GPU machine: python3 bench/capture_eco.py into
#	${GML_GPU_OUT:-/tmp}/traces, the ecosystem workloads' allocation
#	traces with their step lines, for tests/data and gmlake-replay
#	(CAPTURE-ARGS go to capture_eco.py: --workloads, --expandable, ...).
#	It needs PyTorch, not the build.
#
#   tools/gpu.sh run
#	On the GPU machine, in the repository root, with build-gpu/ copied
#	beside the sources (no compiler, libtool or Check needed there).
#	Runs every tests/check_* program and examples/example with
#	GMLAKE_BACKEND=cuda and then =emu, then replays tests/data/*.trace.gz
#	with gmlake-replay on both backends, timing each step. Writes four
#	files to ${GML_GPU_OUT:-/tmp}: gpu-summary.log (machine, timings, results;
#	its last line is "N passed, M failed, K skipped"), gpu-tests.log (every
#	step's output, in order), gpu-replay-{cuda,emu}.json, gpu-offload.txt
#	and gpu-offload-32m.txt (tools/offload_bench on the GPU, default and
#	32 MiB chunks), gpu-vmm.txt (bench/vmm_probe: the
#	driver's mapping calls, per chunk and per thread) and gpu-top.txt (gmlake-top watching
#	a live process). It also checks that activation offload under
#	PyTorch gives a plain run's gradients (python/tests/
#	gpu_offload_check.py). Exit 1 if any step failed.
#
# Environment for run: CK_DEFAULT_TIMEOUT (default 120 s per test case),
# GML_STEP_TIMEOUT (default 300 s per program), GML_GPU_OUT (log folder).

set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
build=build-gpu

usage() {
	awk 'NR < 4 { next } !/^#/ { exit } { sub(/^# ?/, ""); print }' \
		"${BASH_SOURCE[0]}"
	exit 2
}

now() {
	date +%s.%N
}

# Seconds between two now() readings, 3 decimals.
elapsed() {
	awk -v a="$1" -v b="$2" 'BEGIN { printf "%.3f", b - a }'
}

# ---------------------------------------------------------------------------
# build (here)
# ---------------------------------------------------------------------------

# Shared libraries that every Linux machine has; the rest are copied.
is_system_lib() {
	case "$1" in
	linux-vdso.so.* | ld-linux*.so.* | libc.so.* | libm.so.* | \
	libdl.so.* | libpthread.so.* | librt.so.* | libresolv.so.* | \
	libgcc_s.so.* | libstdc++.so.* | libz.so.*)
		return 0 ;;
	esac
	return 1
}

# The shared library from a build's static objects (build dir, sources,
# output): what libtool would link, without its wrapper scripts.
link_shared() {
	${CC:-gcc} -shared -o "$3" -Wl,-soname,libgmlake.so \
		-Wl,--whole-archive "$1/lib/.libs/libgmlake-internal.a" \
		-Wl,--no-whole-archive -Wl,--version-script="$2/lib/libgmlake.map" \
		-Wl,-z,defs $(sed -n 's/^\(LIBS\|LIBURING_LIBS\|NUMA_LIBS\) = //p' \
			"$1/Makefile") -ldl -lpthread
}

do_build() {
	local t0 src progs p lib
	t0=$(now)

	# Build from a pristine copy of the sources, so that an in-tree
	# ./configure of the checkout does not block this VPATH build.
	if git -C "$root" rev-parse --is-inside-work-tree >/dev/null 2>&1; then
		src="$build/src"
		rm -rf "$src"
		mkdir -p "$src"
		git -C "$root" ls-files -z --cached --others --exclude-standard |
			(cd "$root" && xargs -0 tar -cf - --) |
			tar -xf - -C "$src"
		(cd "$src" && autoreconf -fi)
		src="$(cd "$src" && pwd)"
	else
		if [ -f "$root/config.status" ]; then
			echo "gpu.sh: $root is configured in-tree; run 'make distclean' there first" >&2
			exit 1
		fi
		[ -x "$root/configure" ] || (cd "$root" && autoreconf -fi)
		src="$root"
	fi

	mkdir -p "$build"
	(cd "$build" && "$src/configure" --disable-shared --enable-static \
		CFLAGS="${CFLAGS:--O2 -g} -fPIC" "$@")
	make -C "$build" -j"$(nproc)"
	# TESTS= builds check_PROGRAMS without running anything.
	make -C "$build" -j"$(nproc)" check TESTS=
	link_shared "$build" "$src" "$build/libgmlake.so"

	# The driver-cost probe links the toolkit's stub libcuda (the real
	# one is the GPU machine's); skipped where there is no toolkit.
	local cuda_dir
	cuda_dir=$(sed -n 's/^CUDA_DIR = //p' "$build/Makefile")
	rm -f "$build/vmm_probe"
	if [ -n "$cuda_dir" ] && [ -f "$cuda_dir/lib64/stubs/libcuda.so" ]; then
		${CC:-gcc} -O2 -Wall -o "$build/vmm_probe" "$src/bench/vmm_probe.c" \
			-I"$cuda_dir/include" -L"$cuda_dir/lib64/stubs" -lcuda -lpthread
	fi

	rm -rf "$build/runtime-libs"
	mkdir -p "$build/runtime-libs"
	progs=$(find "$build/tests" "$build/examples" "$build/tools" \
		-maxdepth 1 -type f -perm -u+x ! -name '*.*' 2>/dev/null)
	for p in $progs "$build/libgmlake.so"; do
		[ "$(head -c 4 "$p" | tail -c 3)" = ELF ] || continue
		ldd "$p" | awk '$2 == "=>" && $3 ~ /^\// { print $3 }'
	done | sort -u | while read -r lib; do
		is_system_lib "$(basename "$lib")" && continue
		cp -L "$lib" "$build/runtime-libs/"
		echo "gpu.sh: runtime lib $(basename "$lib")"
	done
	rm -rf "$build/src/autom4te.cache"
	echo "gpu.sh: built in $build/ in $(elapsed "$t0" "$(now)") s; programs:"
	echo "$progs" | sed 's/^/  /'
}

do_variant() {
	local name=${1:-} dir cfg flags srcabs
	[ $# -ge 2 ] || usage
	shift
	flags="$*"
	case $name in
	"" | .* | */*)
		echo "gpu.sh: variant name '$name': a plain file name, please" >&2
		exit 2 ;;
	esac
	if [ ! -f "$build/config.status" ] || [ ! -d "$build/src" ]; then
		echo "gpu.sh: $build/ not built; run 'tools/gpu.sh build' first" >&2
		exit 1
	fi
	dir="$build/variants/$name"
	rm -rf "$dir"
	mkdir -p "$dir/tree"
	# The build's own configure arguments, then the variant's flags.
	cfg=$("$build/config.status" --config)
	srcabs=$(cd "$build/src" && pwd)
	(cd "$dir/tree" && eval "set -- $cfg" &&
		"$srcabs/configure" "$@" CPPFLAGS="$flags" >/dev/null)
	make -C "$dir/tree" -j"$(nproc)" lib/libgmlake-internal.la >/dev/null
	link_shared "$dir/tree" "$build/src" "$dir/libgmlake.so"
	rm -rf "$dir/tree"
	echo "gpu.sh: $dir/libgmlake.so built with $flags"
}

# ---------------------------------------------------------------------------
# run (on the GPU machine)
# ---------------------------------------------------------------------------

out=${GML_GPU_OUT:-/tmp}
logdir=""
steps=()
summary=()
n_pass=0
n_fail=0
n_skip=0

# step NAME CMD...: run CMD with its output in a log of its own, time it,
# record the result.
step() {
	local name=$1 log t0 t1 rc result secs
	shift
	log="$logdir/$(printf '%03d' ${#steps[@]}).log"
	steps+=("$name")
	t0=$(now)
	set +e
	timeout "${GML_STEP_TIMEOUT:-300}" "$@" >"$log" 2>&1
	rc=$?
	set -e
	t1=$(now)
	secs=$(elapsed "$t0" "$t1")
	case $rc in
	0) result=PASS; n_pass=$((n_pass + 1)) ;;
	77) result=SKIP; n_skip=$((n_skip + 1)) ;;
	124) result="FAIL (timeout)"; n_fail=$((n_fail + 1)) ;;
	*) result="FAIL (rc $rc)"; n_fail=$((n_fail + 1)) ;;
	esac
	summary+=("$(printf '%-40s %9s s  %s' "$name" "$secs" "$result")")
	printf '%-40s %9s s  %s\n' "$name" "$secs" "$result"
	# Check's own summary line, e.g. "100%: Checks: 9, Failures: 0, Errors: 0"
	grep -E '^[0-9]+%: Checks: ' "$log" | sed 's/^/    /' || true
	case $result in
	FAIL*) tail -n 20 "$log" | sed 's/^/    | /' ;;
	esac
}

# Before the steps of run and ipc: the output folder, a folder for each
# step's log, and the environment the check programs need.
steps_begin() {
	mkdir -p "$out"
	logdir=$(mktemp -d)
	trap 'rm -rf "$logdir"' EXIT
	export LD_LIBRARY_PATH="$root/$build/runtime-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
	export CK_DEFAULT_TIMEOUT="${CK_DEFAULT_TIMEOUT:-120}"
	# Test data is found through srcdir, relative to the repository root.
	export srcdir=. top_srcdir=. top_builddir="$build"
}

# Every step's output, in order, into file $1.
steps_log() {
	local i
	for i in "${!steps[@]}"; do
		echo "===== ${steps[$i]}"
		cat "$logdir/$(printf '%03d' "$i").log"
	done >"$1"
}

xid_count() {
	dmesg 2>/dev/null | grep -c 'NVRM: Xid' || true
}

do_run() {
	local t0 backend t name xid0 xid1 traces
	if [ ! -d "$build/tests" ]; then
		echo "gpu.sh: $build/tests missing; run 'tools/gpu.sh build' first" >&2
		exit 1
	fi
	steps_begin
	t0=$(now)

	{
		echo "host: $(uname -n) $(uname -r)"
		if command -v nvidia-smi >/dev/null 2>&1; then
			nvidia-smi -L || true
			nvidia-smi --query-gpu=name,driver_version,memory.total \
				--format=csv,noheader || true
		else
			echo "nvidia-smi: not found"
		fi
	} 2>&1 | tee "$logdir/machine"
	xid0=$(xid_count)

	for backend in cuda emu; do
		echo "== GMLAKE_BACKEND=$backend"
		for t in "$build"/tests/check_* "$build"/examples/example \
			 "$build"/examples/ipc; do
			name=$(basename "$t")
			case $name in *.*) continue ;; esac
			[ -f "$t" ] && [ -x "$t" ] || continue
			step "$name ($backend)" \
				env GMLAKE_BACKEND="$backend" "$t"
		done
	done

	traces=(tests/data/*.trace.gz)
	for backend in cuda emu; do
		echo "== gmlake-replay --backend $backend"
		step "gmlake-replay ($backend)" \
			sh -c '"$@" >"$0"' "$out/gpu-replay-$backend.json" \
			"$build/tools/gmlake-replay" --backend "$backend" --json \
			"${traces[@]}"
	done

	# PyTorch with offload_activations(): same gradients as a plain run.
	echo "== activation offload under PyTorch (cuda)"
	step "gpu_offload_check (cuda)" \
		env GMLAKE_LIBRARY="$root/$build/libgmlake.so" \
		GMLAKE_BACKEND=cuda python3 python/tests/gpu_offload_check.py

	echo "== offload bandwidth (cuda)"
	step "offload_bench (cuda)" \
		bash -c 'set -o pipefail; "$@" | tee "$0"' "$out/gpu-offload.txt" \
		env GMLAKE_BACKEND=cuda "$build/tools/offload_bench"
	# Mapping costs per chunk, whatever its size: the same with 32 MiB.
	step "offload_bench 32 MiB chunks (cuda)" \
		bash -c 'set -o pipefail; "$@" | tee "$0"' "$out/gpu-offload-32m.txt" \
		env GMLAKE_BACKEND=cuda GMLAKE_CHUNK_SIZE=32M \
		"$build/tools/offload_bench" -q -s 1024 -t 4096

	if [ -x "$build/vmm_probe" ]; then
		echo "== driver mapping costs (cuda)"
		step "vmm_probe (cuda)" \
			bash -c 'set -o pipefail; "$@" | tee "$0"' "$out/gpu-vmm.txt" "$build/vmm_probe"
	fi

	# gmlake-top against a live process on the GPU, with NVML.
	echo "== gmlake-top (cuda)"
	step "gmlake-top --json (cuda)" sh -c '
		GMLAKE_BACKEND=cuda "$1/tests/shm_workload" 8 wave >"$0.w" &
		sleep 3
		"$1/tools/gmlake-top" -b -n 2 -d 1 >"$0" &&
			"$1/tools/gmlake-top" -b -n 1 --json >>"$0"
		rc=$?
		wait
		cat "$0"
		exit $rc' "$out/gpu-top.txt" "$build"

	xid1=$(xid_count)
	steps_log "$out/gpu-tests.log"
	{
		cat "$logdir/machine"
		echo "== summary ($(elapsed "$t0" "$(now)") s in all)"
		printf '%s\n' "${summary[@]}"
		if [ "$xid1" != "$xid0" ]; then
			echo "warning: $((xid1 - xid0)) new 'NVRM: Xid' lines in dmesg"
		fi
		echo "output of each step: $out/gpu-tests.log; replay JSON: $out/gpu-replay-*.json"
		echo "$n_pass passed, $n_fail failed, $n_skip skipped"
	} | tee "$out/gpu-summary.log"
	[ "$n_fail" -eq 0 ]
}

do_bench() {
	local a
	for a in "$@"; do
		if [ "$a" = --report ]; then
			python3 bench/bench.py --out "$out/bench" "$@"
			return
		fi
	done
	if [ ! -f "$build/libgmlake.so" ]; then
		echo "gpu.sh: $build/libgmlake.so missing; run 'tools/gpu.sh build' first" >&2
		exit 1
	fi
	export LD_LIBRARY_PATH="$root/$build/runtime-libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
	mkdir -p "$out/bench"
	python3 bench/bench.py --lib "$root/$build/libgmlake.so" \
		--out "$out/bench" "$@"
}

# Sharing blocks between processes on the GPU, in one short call: the C
# suites' IPC cases, examples/ipc, what exportable handles cost
# (vmm_probe's export question), peer access, and torch.multiprocessing,
# NCCL's buffer registration and pools on a user's allocator through the
# adapter (gpu_parity's enable, ipc, mempool, nccl_mempool and
# mempool_allocator rows; enable builds the adapter).
do_ipc() {
	local t0
	if [ ! -x "$build/tests/check_ipc" ]; then
		echo "gpu.sh: $build/tests/check_ipc missing; run 'tools/gpu.sh build' first" >&2
		exit 1
	fi
	steps_begin
	t0=$(now)
	echo "ptrace_scope: $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo none)"
	step "check_ipc (cuda)" env GMLAKE_BACKEND=cuda "$build/tests/check_ipc"
	step "check_torch IPC (cuda)" \
		env GMLAKE_BACKEND=cuda CK_RUN_CASE=IPC "$build/tests/check_torch"
	step "examples/ipc (cuda)" env GMLAKE_BACKEND=cuda "$build/examples/ipc"
	step "check_peer (cuda)" env GMLAKE_BACKEND=cuda "$build/tests/check_peer"
	if [ -x "$build/vmm_probe" ]; then
		step "vmm_probe export (cuda)" \
			bash -c 'set -o pipefail; "$@" | tee "$0"' "$out/gpu-vmm-export.txt" \
			"$build/vmm_probe" 256 export
	fi
	step "gpu_parity enable,ipc,mempool,nccl_mempool,mempool_allocator (cuda)" \
		python3 python/tests/gpu_parity.py --lib "$root/$build/libgmlake.so" \
		--rows enable,ipc,mempool,nccl_mempool,mempool_allocator \
		--json "$out/gpu-parity-ipc.json"
	steps_log "$out/gpu-ipc.log"
	{
		echo "== summary ($(elapsed "$t0" "$(now)") s in all)"
		printf '%s\n' "${summary[@]}"
		echo "output of each step: $out/gpu-ipc.log"
		echo "$n_pass passed, $n_fail failed, $n_skip skipped"
	} | tee "$out/gpu-ipc-summary.log"
	[ "$n_fail" -eq 0 ]
}

do_capture() {
	mkdir -p "$out/traces"
	python3 bench/capture_eco.py "$out/traces" "$@"
}

mode=${1:-}
[ $# -gt 0 ] && shift
case $mode in
build) do_build "$@" ;;
variant) do_variant "$@" ;;
run) do_run ;;
bench) do_bench "$@" ;;
capture) do_capture "$@" ;;
ipc) do_ipc ;;
*) usage ;;
esac
