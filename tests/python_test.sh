#!/bin/sh
# SPDX-License-Identifier: MIT
#
# The Python side: python/tests (the gmlake package: library discovery,
# stats through ctypes on the emulated device, struct layouts against C,
# the offload ring and the activation hooks on the emulated device,
# gmlake.torch.enable with a fake torch; test_torch.py: PyTorch's stats
# names, the version check, python -m gmlake.run, private pools and
# snapshots through the C API, the snapshot-to-trace converter, the
# adapter's build logic) and bench/tests (the benchmark's pure parts).
# Needs python3 only (no torch, no GPU); skips (77) without it.
#
# Environment: srcdir, top_builddir (as make check sets them).

: "${srcdir:=$(dirname "$0")/..}"
: "${top_builddir:=.}"

if ! command -v python3 >/dev/null 2>&1; then
	echo "python3 not found; skipping the Python tests"
	exit 77
fi

lib="$top_builddir/lib/.libs/libgmlake.so"
if [ -f "$lib" ]; then
	GMLAKE_LIBRARY="$lib"
	export GMLAKE_LIBRARY
else
	echo "note: $lib not built (--disable-shared?); library tests skip"
	unset GMLAKE_LIBRARY
fi
# A library built with AddressSanitizer (configure --enable-sanitizer) needs
# the ASan runtime loaded first, before python3's own libraries; Python's
# interpreter keeps memory to the end, so leak reports are off here (last,
# so that it overrides the caller's ASAN_OPTIONS).
if [ -n "${GMLAKE_LIBRARY:-}" ]; then
	asan=$(ldd "$GMLAKE_LIBRARY" 2>/dev/null |
		awk '$1 ~ /^libasan\.so/ { print $3 }')
	if [ -n "$asan" ]; then
		LD_PRELOAD="$asan${LD_PRELOAD:+ $LD_PRELOAD}"
		ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
		export LD_PRELOAD ASAN_OPTIONS
	fi
fi
GMLAKE_STATS_LAYOUT="$top_builddir/tests/stats_layout"
GMLAKE_OFFLOAD_LAYOUT="$top_builddir/tests/offload_layout"
GMLAKE_EMU_CAPACITY=512M
PYTHONDONTWRITEBYTECODE=1
export GMLAKE_STATS_LAYOUT GMLAKE_OFFLOAD_LAYOUT GMLAKE_EMU_CAPACITY PYTHONDONTWRITEBYTECODE

status=0
# Syntax of every Python file (without writing bytecode into srcdir).
python3 - "$srcdir"/python/gmlake/*.py "$srcdir"/bench/*.py <<'PY' || status=1
import ast, sys
for path in sys.argv[1:]:
    with open(path) as f:
        ast.parse(f.read(), path)
print("syntax ok: %d files" % (len(sys.argv) - 1))
PY
for dir in "$srcdir/python/tests" "$srcdir/bench/tests"; do
	[ -d "$dir" ] || continue
	python3 -m unittest discover -v -s "$dir" -p 'test_*.py' || status=1
done
exit $status
