#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""What whole chunks cost a trace's live blocks at its peak, without a GPU.

libgmlake gives a large request (above GMLAKE_SMALL_SIZE, 1 MiB) whole
chunks (2 MiB); PyTorch's expandable segments splits its segment at 512
bytes. Where libgmlake's peak reserved memory is above expandable
segments' (gmlake-replay against expandable_sim.py on the same trace),
this says how much of the difference that rounding alone explains: at the
moment the live blocks ask for the most bytes (a block is live from its
alloc to its free_requested, as libgmlake counts requested bytes), the
bytes their chunks hold beyond their 512-byte sizes, and the request
sizes that lose the most. The rest of a gap is layout: free chunks the
policy could not use at its peak (gmlake-replay with
GMLAKE_LOG_LEVEL=debug says where they were at each growth).

    python3 bench/peak_waste.py tests/data/eco_vit.trace.gz
    python3 bench/peak_waste.py --json --top 3 tests/data/*.trace.gz

Exit status 1 when a trace cannot be read (a free of an address that is
not live, a line it cannot parse), 2 on bad arguments.
"""

import argparse
import json
import sys

from expandable_sim import TraceError, name_of, trace_lines

MiB = 1 << 20
GiB = 1 << 30


def round_up(n, to):
    return (n + to - 1) // to * to


def peak_live(path):
    """(peak requested bytes, {addr: size} live at that moment): the first
    moment the live blocks' sizes reach their largest sum."""
    live, cur, peak, at_peak = {}, 0, 0, {}
    for n, fld in trace_lines(path):
        try:
            if fld[0] == "alloc":
                addr, size = int(fld[1]), int(fld[2])
                if addr in live:
                    raise TraceError("alloc of address %d, which is live"
                                     % addr)
                live[addr] = size
                cur += size
                if cur > peak:
                    # copied at the next free: a run of allocations
                    # copies the live set once, not once each
                    peak, at_peak = cur, None
            elif fld[0] == "free_requested":
                addr = int(fld[1])
                if addr not in live:
                    raise TraceError("free of address %d, which is not "
                                     "live" % addr)
                if at_peak is None:
                    at_peak = dict(live)
                cur -= live.pop(addr)
        except (ValueError, IndexError, TraceError) as e:
            raise TraceError("%s:%d: %s" % (path, n, e))
    if at_peak is None:
        at_peak = dict(live)
    return peak, at_peak


def waste(live, chunk, small):
    """What live blocks above small lose to whole chunks: a dict of the
    totals and, per request size, (count, bytes lost) in `sizes`."""
    sizes = {}
    large = held = lost = 0
    for size in live.values():
        if size <= small:
            continue
        large += 1
        h = round_up(size, chunk)
        held += h
        loss = h - round_up(size, 512)
        lost += loss
        if loss:
            c, b = sizes.get(size, (0, 0))
            sizes[size] = (c + 1, b + loss)
    return {"large_blocks": large, "chunk_bytes": held,
            "rounding_bytes": lost, "sizes": sizes}


def size_arg(text):
    """A size in bytes, or with a K, M or G suffix (powers of 1024)."""
    mult = {"K": 1 << 10, "M": MiB, "G": GiB}
    t = text.strip().upper()
    try:
        n = int(t[:-1]) * mult[t[-1]] if t[-1:] in mult else int(t)
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError("not a size: %r" % text)
    if n <= 0:
        raise argparse.ArgumentTypeError("not a positive size: %r" % text)
    return n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", metavar="TRACE")
    ap.add_argument("--chunk", type=size_arg, default=2 * MiB,
                    help="chunk size (default 2M)")
    ap.add_argument("--small", type=size_arg, default=MiB,
                    help="largest request of the small pool, which packs "
                         "(default 1M)")
    ap.add_argument("--top", type=int, default=5,
                    help="request sizes listed, those losing most first")
    ap.add_argument("--json", action="store_true",
                    help="one JSON object per trace and line")
    args = ap.parse_args(argv)
    if args.top < 0:
        ap.error("--top must be 0 or more")
    if args.small >= args.chunk:
        ap.error("--small must be under --chunk")
    if not args.json:
        print("%-22s %9s %6s %9s %8s  %s" % (
            "trace", "req_GiB", "large", "chunk_GiB", "lost_MiB",
            "most lost: size MiB x count = MiB"))
    for path in args.traces:
        try:
            peak, live = peak_live(path)
        except (OSError, EOFError, UnicodeDecodeError, TraceError) as e:
            print("peak_waste: %s" % e, file=sys.stderr)
            return 1
        w = waste(live, args.chunk, args.small)
        top = sorted(w["sizes"].items(), key=lambda kv: (-kv[1][1], kv[0]))
        top = top[:args.top]
        if args.json:
            print(json.dumps({
                "trace": name_of(path), "peak_requested": peak,
                "large_blocks": w["large_blocks"],
                "chunk_bytes": w["chunk_bytes"],
                "rounding_bytes": w["rounding_bytes"],
                "top": [{"size": s, "count": c, "lost": b}
                        for s, (c, b) in top]}))
        else:
            print("%-22s %9.2f %6d %9.2f %8.0f  %s" % (
                name_of(path), peak / GiB, w["large_blocks"],
                w["chunk_bytes"] / GiB, w["rounding_bytes"] / MiB,
                ", ".join("%.2f x %d = %.0f" % (s / MiB, c, b / MiB)
                          for s, (c, b) in top)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
