#!/bin/sh
# SPDX-License-Identifier: MIT
#
# Every symbol that the version script exports has a man page.
#
# Reads the global symbols of lib/libgmlake.map and checks, for each, that
# man/SYMBOL.3 exists (a one-line ".so man3/OTHER.3" alias counts, and its
# target is checked instead) and has the sections NAME, SYNOPSIS,
# DESCRIPTION, RETURN VALUE and ERRORS. When the shared library has been
# built, its dynamic symbol table must match the map both ways. gmlake(7)'s
# EXAMPLES must be examples/example.c.
#
# Environment: srcdir (default: the directory above this script),
# top_builddir (default: .). Exit 0 when all pass, 1 otherwise; the last
# line is "N passed, M failed".

LC_ALL=C
export LC_ALL

: "${srcdir:=$(dirname "$0")/..}"
: "${top_builddir:=.}"

map="$srcdir/lib/libgmlake.map"
mandir="$srcdir/man"
lib="$top_builddir/lib/.libs/libgmlake.so"
sections="NAME SYNOPSIS DESCRIPTION RETURN_VALUE ERRORS"

passed=0
failed=0
tmp=$(mktemp -d) || exit 99
trap 'rm -rf "$tmp"' EXIT

fail() {
	echo "FAIL: $*"
	failed=$((failed + 1))
}

if [ ! -r "$map" ]; then
	echo "ERROR: cannot read $map"
	exit 99
fi

# The map's global symbols, one a line: drop comments, split at ';', '{'
# and '}', then keep the names that follow a "global:" up to a "local:"
# or the end of the node.
sed -e 's,/\*.*\*/,,g' -e 's,#.*,,' "$map" |
	sed -e '/\/\*/,/\*\//d' |
	sed -e 's/[;{]/\n/g' -e 's/}/\n}\n/g' |
	awk '
		{ gsub(/^[ \t]+|[ \t]+$/, "") }
		/^}/ { in_global = 0; next }
		/^global:/ { in_global = 1; sub(/^global:[ \t]*/, "") }
		/^local:/ { in_global = 0; next }
		/^$/ { next }
		in_global && /^[A-Za-z_][A-Za-z0-9_]*$/ { print }
	' | sort -u >"$tmp/map"

if [ ! -s "$tmp/map" ]; then
	echo "ERROR: no global symbols found in $map"
	exit 99
fi

# The page that holds the text of man/NAME.3, following ".so" aliases (at
# most a few hops, so a loop cannot hang us). Prints nothing when missing.
resolve_page() {
	page="$mandir/$1.3"
	hops=0
	while [ -r "$page" ] && [ $hops -lt 5 ]; do
		target=$(awk 'NF && !/^\.\\"/ { if ($1 == ".so") print $2; exit }' "$page")
		[ -n "$target" ] || { echo "$page"; return; }
		page="$mandir/$(basename "$target")"
		hops=$((hops + 1))
	done
}

has_section() {
	# $1: page, $2: section with '_' for space
	want=$(echo "$2" | tr '_' ' ')
	grep -Eq "^\\.SH[[:space:]]+\"?$want\"?[[:space:]]*\$" "$1"
}

while read -r sym; do
	if [ ! -e "$mandir/$sym.3" ]; then
		fail "$sym: no man page man/$sym.3"
		continue
	fi
	page=$(resolve_page "$sym")
	if [ -z "$page" ]; then
		fail "$sym: man/$sym.3 is an alias whose target does not exist"
		continue
	fi
	missing=""
	for s in $sections; do
		has_section "$page" "$s" || missing="$missing $(echo "$s" | tr '_' ' '),"
	done
	if [ -n "$missing" ]; then
		fail "$sym: $(basename "$page") lacks section(s):${missing%,}"
		continue
	fi
	passed=$((passed + 1))
done <"$tmp/map"

# gmlake(7)'s EXAMPLES shows examples/example.c (tabs expanded, groff's
# escapes for '-' and '\\'): the two must not drift apart.
sed -n '/^\.SH EXAMPLES/,/^\.SH SEE ALSO/p' "$mandir/gmlake.7" |
	sed -n '/^\.EX/,/^\.EE/p' | sed '1d;$d' |
	sed 's/\\-/-/g; s/\\e/\\/g' >"$tmp/example.7"
expand "$srcdir/examples/example.c" >"$tmp/example.c"
if cmp -s "$tmp/example.7" "$tmp/example.c"; then
	passed=$((passed + 1))
else
	fail "gmlake.7: EXAMPLES is not examples/example.c; diff:"
	diff "$tmp/example.7" "$tmp/example.c" | head -20
fi

# Cross-check with what the built library really exports.
if [ -f "$lib" ]; then
	if ! command -v nm >/dev/null 2>&1; then
		echo "note: nm not found; not checking $lib"
	elif ! nm -D --defined-only "$lib" >"$tmp/nm"; then
		fail "nm -D --defined-only $lib failed"
	else
		# Skip the version node names (absolute symbols, type A).
		awk '$2 != "A" { sub(/@.*/, "", $3); print $3 }' "$tmp/nm" |
			sort -u >"$tmp/exported"
		for sym in $(comm -13 "$tmp/map" "$tmp/exported"); do
			fail "$sym: exported by libgmlake.so but not in lib/libgmlake.map"
		done
		for sym in $(comm -23 "$tmp/map" "$tmp/exported"); do
			fail "$sym: listed in lib/libgmlake.map but not exported by libgmlake.so (GML_EXPORT missing?)"
		done
	fi
else
	echo "note: $lib not built; checked the map only"
fi

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
