#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Make new step orders of a recorded allocation trace, for replay.

A trace (NAME.trace.gz, tools/gmlake-replay) records one run's shapes in
one order. Where each step after the first two frees everything it
allocates, its events depend only on its shape, so steps drawn at random
from the recording (with replacement) make a trace of another run of the
same workload: the same shapes, another order, as a data loader with
another seed would give. Replaying several of them shows whether a
policy holds beyond the order that was recorded.

    python3 bench/trace_shuffle.py tests/data/eco_sage.trace.gz OUTDIR \\
        --steps 40 --seeds 1,2,3
    tools/gmlake-replay OUTDIR/*.trace.gz

Steps 0 and 1 (warm-up: parameters, optimizer state) are kept first, as
recorded. A step's settle flag is set again for the new order: 1 at the
first step of each shape (its allocation sizes), else 0. Each output
NAME_sSEED.trace.gz gets a sidecar NAME_sSEED.trace.json, the recorded
one's with the workload name, steps and events changed. Exit status 1
when a step after the first two does not free what it allocates (the
trace cannot be reordered), 2 on bad arguments.
"""

import argparse
import gzip
import json
import os
import random
import sys

KEEP = 2        # warm-up steps kept first, in their order


def split_steps(lines):
    """The lines before the first step line, and each step's lines (its
    step line first)."""
    head, steps, cur = [], [], None
    for line in lines:
        if line.startswith("step "):
            cur = [line]
            steps.append(cur)
        elif cur is None:
            head.append(line)
        else:
            cur.append(line)
    return head, steps


def left_live(step):
    """Addresses the step allocates and does not free."""
    live = set()
    for line in step[1:]:
        f = line.split()
        if f[0] == "alloc":
            live.add(f[1])
        elif f[0] == "free_requested":
            live.discard(f[1])
    return live


def shape_key(step):
    """The step's allocation sizes: equal for steps of one shape."""
    return tuple(line.split()[2] for line in step[1:]
                 if line.startswith("alloc "))


def shuffled(head, steps, count, seed):
    rng = random.Random(seed)
    order = steps[:KEEP] + [rng.choice(steps[KEEP:]) for _ in range(count)]
    seen, out = set(), list(head)
    for i, step in enumerate(order):
        key = shape_key(step)
        f = step[0].split()
        out.append("step %d %d %s" % (i, key not in seen, f[3]))
        seen.add(key)
        out.extend(step[1:])
    return out, len(order)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="NAME.trace.gz, its NAME.trace.json beside")
    ap.add_argument("outdir")
    ap.add_argument("--steps", type=int, default=40,
                    help="steps drawn after the warm-up (default 40)")
    ap.add_argument("--seeds", default="1,2,3",
                    help="one output per seed, comma-separated")
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error("--seeds: integers separated by commas")
    if args.steps < 1:
        ap.error("--steps: at least 1")
    if not args.trace.endswith(".trace.gz"):
        ap.error("%s: not a NAME.trace.gz" % args.trace)
    with gzip.open(args.trace, "rt") as f:
        head, steps = split_steps(f.read().splitlines())
    if len(steps) <= KEEP:
        sys.exit("%s: %d steps, nothing to draw from after the first %d" %
                 (args.trace, len(steps), KEEP))
    for step in steps[KEEP:]:
        live = left_live(step)
        if live:
            sys.exit("%s: %s leaves %d blocks live; steps cannot be "
                     "reordered" % (args.trace, step[0], len(live)))
    stem = args.trace[:-len(".trace.gz")]
    with open(stem + ".trace.json") as f:
        sidecar = json.load(f)
    name = os.path.basename(stem)
    os.makedirs(args.outdir, exist_ok=True)
    for seed in seeds:
        out, nsteps = shuffled(head, steps, args.steps, seed)
        new = "%s_s%d" % (name, seed)
        path = os.path.join(args.outdir, new)
        with gzip.open(path + ".trace.gz", "wt") as f:
            f.write("\n".join(out) + "\n")
        side = dict(sidecar, workload=new, steps=nsteps,
                    events=sum(1 for line in out
                               if line and not line.startswith("#")))
        with open(path + ".trace.json", "w") as f:
            json.dump(side, f)
        print(path + ".trace.gz")


if __name__ == "__main__":
    main()
