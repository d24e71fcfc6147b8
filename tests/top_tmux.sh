#!/bin/sh
# SPDX-License-Identifier: MIT
#
# gmlake-top's screen in a real terminal: starts a process that holds a
# known allocation pattern (tests/shm_workload), runs gmlake-top against
# it inside a detached tmux session, sends keys (sort, detail view, help,
# resize, quit) and checks what the captured pane shows: the htop and top
# habits (M memory, P activity, N pid, F1 help, F10 quit, / search,
# \ filter, d delay, q closing the help) and every column at 80 columns.
#
# Skips (77) when tmux is missing, or gmlake-top was not built (no
# ncursesw at configure time). Environment: top_builddir (default .).
# GML_TOP_CAPTURE=FILE keeps the main screen's capture (for README).

LC_ALL=C
export LC_ALL

: "${top_builddir:=.}"
top="$top_builddir/tools/gmlake-top"
workload="$top_builddir/tests/shm_workload"

if ! command -v tmux >/dev/null 2>&1; then
	echo "SKIP: tmux not installed"
	exit 77
fi
if [ ! -x "$top" ]; then
	echo "SKIP: $top not built (configure found no ncursesw)"
	exit 77
fi

dir=$(mktemp -d) || exit 99
sock="gmltop$$"
wpid=""
cleanup() {
	tmux -L "$sock" kill-server >/dev/null 2>&1
	[ -n "$wpid" ] && kill "$wpid" 2>/dev/null && wait "$wpid" 2>/dev/null
	rm -rf "$dir"
}
trap cleanup EXIT

fail() {
	echo "FAIL: $*"
	echo "--- pane:"
	cat "$dir/pane" 2>/dev/null
	exit 1
}

# The process to watch: it prints "ready PID" once published.
GMLAKE_SHM_DIR="$dir" GMLAKE_BACKEND=emu "$workload" 60 >"$dir/ready" &
wpid=$!
i=0
while ! grep -q ready "$dir/ready" 2>/dev/null; do
	i=$((i + 1))
	[ $i -gt 100 ] && fail "shm_workload never got ready"
	sleep 0.1
done
ls "$dir"/gmlake.$wpid.* >/dev/null 2>&1 || fail "no segment $dir/gmlake.$wpid.TOKEN"

capture() {
	sleep "${1:-0.6}"
	tmux -L "$sock" capture-pane -p -t top >"$dir/pane" ||
		fail "capture-pane"
}

expect() {
	grep -q -- "$1" "$dir/pane" || fail "screen lacks '$1' ($2)"
}

tmux -L "$sock" -f /dev/null new-session -d -s top -x 132 -y 40 \
	"TERM=xterm-256color '$top' -d 0.2 --dir '$dir'; echo top-exited; sleep 30" ||
	fail "tmux new-session"

# The main screen: the process's row with its figures.
capture 1.2
expect "gmlake-top" "title"
expect "PID" "column header"
expect "RES" "column header"
expect "$wpid" "process row"
expect "shm_workload" "command"
expect "44.0M" "allocated: 4 blocks of 5+9+13+17 MiB, in 512s"
expect "88.0M" "reserved"
expect "50.0" "fragmentation: 1 - 44/88"
expect "emulated" "GPU header without NVML"
expect "sort: RES desc" "default sort"
[ -n "$GML_TOP_CAPTURE" ] && cp "$dir/pane" "$GML_TOP_CAPTURE"

# Sorting as in htop: P the busiest, M memory, N pid; then reversed, then
# one column right with '>'.
tmux -L "$sock" send-keys -t top P
capture
expect "sort: MAP/s desc" "P sorts by activity"
tmux -L "$sock" send-keys -t top M
capture
expect "sort: RES desc" "M sorts by memory"
tmux -L "$sock" send-keys -t top N
capture
expect "sort: PID desc" "N sorts by pid"
tmux -L "$sock" send-keys -t top r
capture
expect "sort: PID asc" "r reverses"
tmux -L "$sock" send-keys -t top '>'
capture
expect "sort: USER asc" "> moves right"

# The detail view with the history chart.
tmux -L "$sock" send-keys -t top Enter
capture 1
expect "PID $wpid  shm_workload" "detail title"
expect "allocated (#) vs reserved (:)" "chart legend"
expect "allocs/frees *8/4" "counters"
grep -q '#' "$dir/pane" || fail "no allocated bars in the chart"
tmux -L "$sock" send-keys -t top Escape
capture
expect "sort: USER asc" "Esc returns to the list"

# Help, then back with any key; F1 opens it, and q closes it (not quit).
tmux -L "$sock" send-keys -t top h
capture
expect "this help" "help screen"
expect "Sort keys" "help screen"
tmux -L "$sock" send-keys -t top x
capture
expect "Enter details" "back from help"
tmux -L "$sock" send-keys -t top F1
capture
expect "this help" "F1 opens the help"
tmux -L "$sock" send-keys -t top q
capture
expect "Enter details" "q closes the help"

# Filter (\): a text nothing matches hides the row, an empty one shows all.
tmux -L "$sock" send-keys -t top '\' nomatch Enter
capture
expect "no row matches the filter" "filter hides"
expect "filter: nomatch" "filter shown"
tmux -L "$sock" send-keys -t top '\' Enter
capture
expect "shm_workload" "filter cleared"
tmux -L "$sock" send-keys -t top '\' "$wpid" Enter
capture
expect "shm_workload" "filter by pid"
tmux -L "$sock" send-keys -t top '\' Enter

# Search (/): a text nothing matches says so.
tmux -L "$sock" send-keys -t top / zzz Enter
capture
expect 'no row matches "zzz"' "search without a match"

# d: the delay.
tmux -L "$sock" send-keys -t top d 0.5 Enter
capture
expect "every 0.5s" "d sets the delay"

# 80 columns: every column header and the figures still show.
tmux -L "$sock" resize-window -t top -x 80 -y 20 2>/dev/null ||
	tmux -L "$sock" resize-pane -t top -x 80 -y 20
capture 1
expect "$wpid" "row after resize"
for col in PID USER DEV ALLOC RES PEAK FRAG% STITCH MAP/s SPILL OFF/s COMM; do
	expect "$col" "column $col at 80 columns"
done
expect "50.0" "fragmentation at 80 columns"

# F10 quits.
tmux -L "$sock" send-keys -t top F10
capture 1
expect "top-exited" "F10 quits"

echo "PASS: gmlake-top screen shows pid $wpid; sort, detail, help, filter, search, delay, 80 columns, quit"
exit 0
