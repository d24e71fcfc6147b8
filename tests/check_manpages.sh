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
# EXAMPLES must be examples/example.c. gmlake_config_init(3) must show
# struct gmlake_config with the fields of include/gmlake.h, in order; the
# ENVIRONMENT sections of gmlake_config_init(3) and gmlake(7), and the
# table of README.md's "Environment" section, must name every GMLAKE_*
# variable of lib/options.c's table and no variable the library does not
# read.
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

# A page's EXAMPLES shows a program of examples/ (tabs expanded, groff's
# escapes for '-' and '\\'): the two must not drift apart. gmlake(7)
# shows examples/example.c, gmlake_ipc_export(3) examples/ipc.c.
same_example() {
	page=$1 prog=$2 name=$(basename "$1")
	sed -n '/^\.SH EXAMPLES/,/^\.SH SEE ALSO/p' "$page" |
		sed -n '/^\.EX/,/^\.EE/p' | sed '1d;$d' |
		sed 's/\\-/-/g; s/\\e/\\/g' >"$tmp/$name.ex"
	expand "$prog" >"$tmp/$name.c"
	if cmp -s "$tmp/$name.ex" "$tmp/$name.c"; then
		passed=$((passed + 1))
	else
		fail "$name: EXAMPLES is not $(basename "$prog"); diff:"
		diff "$tmp/$name.ex" "$tmp/$name.c" | head -20
	fi
}
same_example "$mandir/gmlake.7" "$srcdir/examples/example.c"
same_example "$mandir/gmlake_ipc_export.3" "$srcdir/examples/ipc.c"

# The fields of struct gmlake_config, one a line ("reserved[6]" with its
# size), from a C declaration; comments, also over several lines, dropped.
config_fields() {
	awk '
		/struct gmlake_config \{/ { on = 1; next }
		on && /^[[:space:]]*\};/ { exit }
		!on { next }
		{
			line = $0; code = ""
			while (line != "") {
				if (incomment) {
					i = index(line, "*/")
					if (!i) { line = ""; break }
					line = substr(line, i + 2); incomment = 0
					continue
				}
				i = index(line, "/*")
				if (!i) { code = code line; break }
				code = code substr(line, 1, i - 1)
				line = substr(line, i + 2); incomment = 1
			}
			n = split(code, decl, ";")
			for (k = 1; k < n; k++) {
				f = decl[k]; gsub(/[[:space:]]*\[[[:space:]]*/, "[", f)
				gsub(/[[:space:]]*\]/, "]", f)
				m = split(f, w, /[[:space:]*]+/)
				while (m > 0 && w[m] == "") m--
				if (m > 0) print w[m]
			}
		}' "$1"
}
config_fields "$srcdir/include/gmlake.h" >"$tmp/fields.h"
config_fields "$mandir/gmlake_config_init.3" >"$tmp/fields.3"
if [ ! -s "$tmp/fields.h" ]; then
	fail "no struct gmlake_config found in include/gmlake.h"
elif cmp -s "$tmp/fields.h" "$tmp/fields.3"; then
	passed=$((passed + 1))
else
	fail "gmlake_config_init.3: struct gmlake_config is not include/gmlake.h's; diff:"
	diff "$tmp/fields.3" "$tmp/fields.h" | head -20
fi

# The GMLAKE_* variables: lib/options.c's table (its { "NAME", OPT_...
# entries), and any other the library reads with getenv().
grep -o '{ "GMLAKE_[A-Z0-9_]*", OPT_' "$srcdir/lib/options.c" |
	sed 's/{ "\(.*\)", OPT_/\1/' | sort -u >"$tmp/env.table"
cat "$srcdir"/lib/*.c "$srcdir"/offload/*.c |
	grep -o 'getenv("GMLAKE_[A-Z0-9_]*")' |
	sed 's/getenv("\(.*\)")/\1/' | sort -u >"$tmp/env.getenv"
sort -u "$tmp/env.table" "$tmp/env.getenv" >"$tmp/env.read"

# The variables a page's ENVIRONMENT section gives a paragraph of its own
# (".TP" followed by ".B NAME").
env_documented() {
	sed -n '/^\.SH ENVIRONMENT/,/^\.SH /p' "$1" |
		awk 'tp && $1 == ".B" && $2 ~ /^GMLAKE_/ { print $2 }
		     { tp = ($1 == ".TP") }' | sort -u
}
env_check() {
	# $1: what, $2: documented list, $3: list that must all be there
	missing=$(comm -23 "$3" "$2" | tr '\n' ' ')
	unknown=$(comm -13 "$tmp/env.read" "$2" | tr '\n' ' ')
	if [ -n "$missing" ]; then
		fail "$1 does not document: $missing"
	elif [ -n "$unknown" ]; then
		fail "$1 documents variables the library does not read: $unknown"
	else
		passed=$((passed + 1))
	fi
}
if [ ! -s "$tmp/env.table" ]; then
	fail "no GMLAKE_* names found in lib/options.c"
else
	env_documented "$mandir/gmlake_config_init.3" >"$tmp/env.config_init"
	env_check "gmlake_config_init.3 ENVIRONMENT" "$tmp/env.config_init" \
		"$tmp/env.table"
	env_documented "$mandir/gmlake.7" >"$tmp/env.7"
	env_check "gmlake.7 ENVIRONMENT" "$tmp/env.7" "$tmp/env.read"
	# README.md: the rows of the table in its "Environment" section.
	sed -n '/^## Environment/,/^## /p' "$srcdir/README.md" |
		sed -n 's/^| `\(GMLAKE_[A-Z0-9_]*\)` |.*/\1/p' |
		sort -u >"$tmp/env.readme"
	env_check "README.md's environment table" "$tmp/env.readme" \
		"$tmp/env.read"
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
