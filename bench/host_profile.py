#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Where a workload's host time goes, per allocator.

    LD_LIBRARY_PATH=build-gpu/runtime-libs python3 bench/host_profile.py \\
        --lib build-gpu/libgmlake.so --workload eco_compile [--steps 12]

--workload is an eco workload or one of the bench's GPT ones that do not
offload (LoRA, generation, ...). For each allocator (PyTorch default,
expandable segments, libgmlake), in a process of its own: one step at
each of the workload's shapes (not measured: compiles and growth), then
--steps steady steps timed two ways, sync to sync (the step time) and
from the start of the step until its Python code returns (the host's issue time: when it is close to the
step time, the step is bound by the host, and every microsecond an
allocation costs shows in it). Then the same steps again under
torch.profiler, CPU only, and the operators with the most self time.
Prints one markdown section per allocator; --json FILE keeps it all.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import bench
import ecosystem

ALLOCATORS = ("default", "expandable", "gmlake")
TOP = 20


def timed_steps(torch, state, steps):
    """(sync-to-sync ms, issue ms) of each of `steps` steps."""
    total, issue = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        state["step"]()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        issue.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    return total, issue


def profiled_ops(torch, state, steps):
    """The operators with the most host self time over `steps` steps: a
    list of (name, calls per step, self us per step, self us per call)."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            state["step"]()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        rows.append((e.key, e.count / steps,
                     e.self_cpu_time_total / steps,
                     e.self_cpu_time_total / max(e.count, 1)))
    rows.sort(key=lambda r: -r[2])
    return rows[:TOP]


def driver_calls(allocator):
    """libgmlake's driver calls and their time so far, by kind."""
    if allocator != "gmlake":
        return {}
    import gmlake
    return {k: v for k, v in gmlake.stats().items()
            if k.startswith(("calls.", "call_ns."))}


def warmed_state(torch, name, steps):
    """The workload's state, every shape stepped once (not measured), with
    at least `steps` more steps to come."""
    if name in ecosystem.WORKLOADS:
        state = ecosystem.build(name, "full", 1234,
                                len(ecosystem.shape_set(name, "full", 1234))
                                + steps)
        for shape in state["shapes"]:
            state["step_at"](shape)
        torch.cuda.synchronize()
        # Steps of the seeded sequence, its first ones the shape set's.
        for _ in state["shapes"]:
            state["step"]()
        return state
    import workloads
    state = workloads.build(name, "full", 1234)
    # The GPT workloads cycle through their shapes without end.
    for _ in range(state["warmup"]):
        state["step"]()
    torch.cuda.synchronize()
    return state


def child(args):
    if args.child == "gmlake":
        import gmlake.torch
        gmlake.torch.enable(args.lib)
    import torch
    state = warmed_state(torch, args.workload, 3 * args.steps)
    before = driver_calls(args.child)
    total, issue = timed_steps(torch, state, args.steps)
    after = driver_calls(args.child)
    ops = profiled_ops(torch, state, args.steps)
    out = dict(allocator=args.child, step_ms=total, issue_ms=issue, ops=ops,
               driver={k: (after[k] - before.get(k, 0)) / args.steps
                       for k in after if after[k] != before.get(k, 0)})
    if state.get("close"):
        state["close"]()
    print(json.dumps(out))
    return 0


def section(r):
    lines = ["## %s" % r["allocator"], "",
             "step ms: mean %.2f, median %.2f; host issue ms: mean %.2f, "
             "median %.2f (%d steps)" % (
                 statistics.mean(r["step_ms"]),
                 statistics.median(r["step_ms"]),
                 statistics.mean(r["issue_ms"]),
                 statistics.median(r["issue_ms"]), len(r["step_ms"])), "",
             "| operator | calls per step | self us per step | "
             "self us per call |", "|---|---|---|---|"]
    if r["driver"]:
        lines[3:3] = ["libgmlake's driver calls per timed step: " +
                      ", ".join("%s %.1f" % kv for kv in
                                sorted(r["driver"].items())), ""]
    for name, calls, per_step, per_call in r["ops"]:
        lines.append("| %s | %.1f | %.0f | %.2f |" % (name, calls, per_step,
                                                       per_call))
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", default=os.path.join(bench.REPO, "build-gpu",
                                                  "libgmlake.so"))
    p.add_argument("--workload", default="eco_compile",
                   choices=ecosystem.WORKLOADS + tuple(
                       w for w in bench.GPT
                       if w not in bench.GROUPS["offload"]))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", help="write every figure here")
    p.add_argument("--child", choices=ALLOCATORS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    out = []
    for a in ALLOCATORS:
        r = subprocess.run([sys.executable, os.path.abspath(__file__),
                            "--lib", args.lib, "--workload", args.workload,
                            "--steps", str(args.steps), "--child", a],
                           env=bench.child_env(a, args.lib),
                           stdout=subprocess.PIPE, timeout=900)
        if r.returncode:
            sys.stderr.write("host_profile: the %s child failed (exit %d)\n"
                             % (a, r.returncode))
            return 1
        out.append(json.loads(r.stdout.decode().strip().splitlines()[-1]))
        print(section(out[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
