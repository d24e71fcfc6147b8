#!/bin/sh
# SPDX-License-Identifier: MIT
#
# A static program links with what pkg-config --static says: gmlake.pc's
# Libs.private must name every library that libgmlake.a needs (liburing
# and libnuma for the offload manager, libdl, libpthread).
#
# Uses the build tree's gmlake.pc with libdir and includedir pointed at
# the build (the same file make install puts in $(libdir)/pkgconfig),
# links examples/example.c with -static and runs it on the emulated
# device.
#
# Environment: srcdir, top_builddir (as make check sets them), CC,
# PKG_CONFIG, GML_TEST_CFLAGS (the build's sanitizer flags). Exit 0 on
# success, 1 on failure, 77 (skipped) without pkg-config, without
# libgmlake.a (configure --disable-static), or when $CC cannot link a
# static program at all (no libc.a, or a sanitizer build).

: "${srcdir:=$(dirname "$0")/..}"
: "${top_builddir:=.}"
: "${CC:=cc}"
: "${PKG_CONFIG:=pkg-config}"

libdir=$(cd "$top_builddir/lib/.libs" 2>/dev/null && pwd)
includedir=$(cd "$srcdir/include" && pwd)

if ! command -v "$PKG_CONFIG" >/dev/null 2>&1; then
	echo "SKIP: $PKG_CONFIG not found"
	exit 77
fi
if [ -z "$libdir" ] || [ ! -f "$libdir/libgmlake.a" ]; then
	echo "SKIP: no libgmlake.a in $top_builddir/lib/.libs (--disable-static?)"
	exit 77
fi

tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT

printf 'int main(void) { return 0; }\n' >"$tmp/probe.c"
# shellcheck disable=SC2086
if ! $CC $GML_TEST_CFLAGS -static -o "$tmp/probe" "$tmp/probe.c" \
	>"$tmp/probe.out" 2>&1; then
	echo "SKIP: $CC $GML_TEST_CFLAGS -static cannot link a static program:"
	sed 's/^/    /' "$tmp/probe.out"
	exit 77
fi

PKG_CONFIG_PATH="$top_builddir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export PKG_CONFIG_PATH
pc="$PKG_CONFIG --define-variable=libdir=$libdir --define-variable=includedir=$includedir"
if ! cflags=$($pc --cflags gmlake) || ! libs=$($pc --static --libs gmlake); then
	echo "FAIL: $PKG_CONFIG cannot read $top_builddir/gmlake.pc"
	exit 1
fi
echo "pkg-config --static --libs gmlake: $libs"

# shellcheck disable=SC2086
if ! $CC $GML_TEST_CFLAGS -static -o "$tmp/example" \
	"$srcdir/examples/example.c" $cflags $libs >"$tmp/link.out" 2>&1; then
	sed 's/^/    /' "$tmp/link.out" | tail -n 20
	echo "FAIL: a static program does not link with $libs"
	exit 1
fi
if ! GMLAKE_BACKEND=emu GMLAKE_PUBLISH=0 "$tmp/example"; then
	echo "FAIL: the statically linked example failed"
	exit 1
fi
echo "PASS: linked and ran a static program with pkg-config --static"
