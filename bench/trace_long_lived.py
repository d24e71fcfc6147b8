#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Add long_lived lines to a trace recorded before captures marked them.

    python3 bench/trace_long_lived.py IN.trace.gz OUTDIR [--step 0]

A run under libgmlake turns gmlake_long_lived() on around an optimizer's
_init_group in its first step (gmlake/optimizer_state.py); captures now
record that as "long_lived 1 0 0" / "long_lived 0 0 0" lines
(benchlib.mark_long_lived), which gmlake-replay replays. Traces recorded
before have none, so their replays place the optimizer's state where the
hooks would not. This guesses the window: in step --step (the first
optimizer step, 0 by default) the blocks allocated there that stay live
to the trace's end, from the first of four such blocks in a row (an
optimizer makes its state in one run: AdamW's exp_avg and exp_avg_sq for
each parameter; a lone survivor before it, such as a cuBLAS workspace,
is not its) to the last. Only for workloads whose optimizer the hooks
wrap (Adam, AdamW, ...; not SGD, whose momentum is made outside
_init_group, nor FSDP2's DTensor optimizer). Writes OUTDIR/NAME.trace.gz
and copies NAME.trace.json beside it. Exit status 1 when the step has no
such run (nothing to mark), 2 on bad arguments.
"""

import argparse
import gzip
import os
import shutil
import sys

RUN = 4         # survivors in a row that start the window


def window(lines, step):
    """(first, last) line indexes of the window, or None."""
    cur, live = -1, {}
    for i, line in enumerate(lines):
        p = line.split()
        if not p or p[0].startswith("#"):
            continue
        if p[0] == "step":
            cur = int(p[1])
        elif p[0] == "alloc":
            live[p[1]] = (i, cur)
        elif p[0] == "free_completed":
            live.pop(p[1], None)
    surv = sorted(i for i, s in live.values() if s == step)
    allocs = [i for i, line in enumerate(lines) if line.startswith("alloc ")]
    pos = {i: k for k, i in enumerate(allocs)}
    kept = set(surv)
    for i in surv:
        k = pos[i]
        if all(k + d < len(allocs) and allocs[k + d] in kept
               for d in range(1, RUN)):
            return i, surv[-1]
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("outdir")
    ap.add_argument("--step", type=int, default=0)
    ns = ap.parse_args(argv)
    if not ns.trace.endswith(".trace.gz"):
        ap.error("%s: not a NAME.trace.gz" % ns.trace)
    stem = ns.trace[:-len(".trace.gz")]
    with gzip.open(ns.trace, "rt") as f:
        lines = f.read().splitlines()
    if any(line.startswith("long_lived ") for line in lines):
        print("%s: already has long_lived lines" % ns.trace, file=sys.stderr)
        return 1
    w = window(lines, ns.step)
    if w is None:
        print("%s: no run of %d blocks made in step %d lives to the end" %
              (ns.trace, RUN, ns.step), file=sys.stderr)
        return 1
    a, b = w
    out = (lines[:a] + ["long_lived 1 0 0"] + lines[a:b + 1] +
           ["long_lived 0 0 0"] + lines[b + 1:])
    os.makedirs(ns.outdir, exist_ok=True)
    name = os.path.basename(ns.trace)
    with gzip.open(os.path.join(ns.outdir, name), "wt") as f:
        f.write("\n".join(out) + "\n")
    side = stem + ".trace.json"
    if os.path.exists(side):
        shutil.copy(side, os.path.join(ns.outdir, os.path.basename(side)))
    n = sum(1 for line in lines[a:b + 1] if line.startswith("alloc "))
    print("%s: window of %d allocations in step %d" % (name, n, ns.step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
