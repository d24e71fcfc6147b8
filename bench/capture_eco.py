# SPDX-License-Identifier: MIT
"""Record the ecosystem workloads' allocation traces for gmlake-replay.

    python3 bench/capture_eco.py OUTDIR [--workloads eco_vit,...]
        [--size full|quick] [--seed 1234] [--expandable]

Each workload (bench/ecosystem.py, the bench's own seeds, shapes and
steps) runs in a child process under PyTorch's default allocator with
torch.cuda.memory._record_memory_history() on; its trace goes to
OUTDIR/NAME.trace.gz (the format of tools/trace.h, through
gmlake.snapshot_to_trace) with NAME.trace.json beside it (steps, mean
step, mean steady step, PyTorch's peaks). Each step is marked in the
trace by a step line ("step K S 0", S 1 for a settling step: the first
at its shape), so that gmlake-replay prices the steady steps wherever
they fall. An optimizer's first state is marked the same way, with
"long_lived 1 0 0" before and "long_lived 0 0 0" after each call of its
_init_group in the step that made state, where gmlake.torch.enable()'s
hooks turn gmlake_long_lived() on (gmlake/optimizer_state.py), so that
the replay places the state as libgmlake does under PyTorch (the hooks'
choice of optimizers: plain tensor parameters only; FSDP2's DTensor
optimizer is not marked). With --expandable a second child runs the same
steps under expandable_segments:True, unrecorded, for
NAME.expandable.json: the figure gmlake-replay compares against.

A replay of these traces is how the allocator's policy is tuned without a
GPU: the same sizes, in the same order, on the same streams as the bench
runs them. Names lose their "eco_" prefix (eco_vit -> vit).
"""

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import benchlib  # noqa: E402
import ecosystem  # noqa: E402

STEP_MARK = benchlib.STEP_MARK
LONG_LIVED_MARKS = benchlib.LONG_LIVED_MARKS


def short(name):
    return name[4:] if name.startswith("eco_") else name


def settle_flags(name, size, seed, steps):
    """For each step, whether it settles: its shape (the bench's seeded
    sequence, as build() runs it) did not occur in an earlier step."""
    seen, flags = set(), []
    for shape in ecosystem.sequence(name, size, seed, steps):
        key = benchlib.shape_key(shape)
        flags.append(key not in seen)
        seen.add(key)
    return flags


def child(ns):
    import torch
    from gmlake import snapshot_to_trace as s2t

    record = ns.mode == "trace"
    steps = ecosystem.STEPS[ns.size][ns.child]
    # The bench's settings (bench.py child()), so that the trace is of
    # the run the bench measures: eco_compile recorded without them made
    # 8,456 allocations, the bench's run 7,674
    # (bench/results/eco-4f4695f/COMMAND.md).
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    # From before the model is built: the replay must place the model and
    # its optimizer where the bench's run does, or first fit lays out the
    # steps differently (a trace recorded after the build disagreed with
    # the H200 on eco_sage).
    if record:
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python",
            max_entries=8_000_000)
    benchlib.mark_long_lived(torch)
    state = ecosystem.build(ns.child, ns.size, ns.seed, steps)
    settle = settle_flags(ns.child, ns.size, ns.seed, steps)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        # The step's line in the trace; the expandable run makes it too,
        # so that both runs allocate alike.
        mark = torch.empty(STEP_MARK, dtype=torch.uint8, device="cuda")
        del mark
        t0 = time.perf_counter()
        state["step"]()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    st = torch.cuda.memory_stats()
    base = os.path.join(ns.out, short(ns.child))
    steady = [t for t, s in zip(times, settle) if not s]
    side = dict(workload=short(ns.child), mode=ns.mode, steps=steps,
                step_ms=round(1000 * sum(times) / len(times), 1),
                steady_step_ms=(round(1000 * sum(steady) / len(steady), 1)
                                if steady else None),
                peak_alloc=st["allocated_bytes.all.peak"],
                peak_reserved=st["reserved_bytes.all.peak"],
                num_alloc_retries=st["num_alloc_retries"],
                num_device_alloc=st["num_device_alloc"])
    side["frag_pct"] = round(100.0 * (1 - side["peak_alloc"] /
                                      max(1, side["peak_reserved"])), 1)
    if record:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        dev = torch.cuda.current_device()
        events, peak_alloc, peak_reserved = s2t.convert(
            snap["device_traces"][dev], step_mark=STEP_MARK, settle=settle,
            long_lived_marks=LONG_LIVED_MARKS, trims=True)
        s2t.write(base + ".trace.gz", events,
                  ["pytorch %s" % torch.__version__,
                   "workload=%s" % short(ns.child), "steps=%d" % steps,
                   "peak_alloc=%d" % peak_alloc,
                   "peak_reserved=%d" % peak_reserved])
        side["events"] = len(events)
    with open(base + (".trace.json" if record else ".expandable.json"),
              "w") as f:
        json.dump(side, f)
        f.write("\n")
    if state.get("close"):
        state["close"]()
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="folder for NAME.trace.gz and its json")
    p.add_argument("--workloads", default=",".join(ecosystem.WORKLOADS))
    p.add_argument("--size", default="full", choices=("full", "quick"))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--expandable", action="store_true",
                   help="also NAME.expandable.json from an unrecorded run")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="trace", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    if ns.child:
        return child(ns)
    names = [n for n in ns.workloads.split(",") if n]
    for n in names:
        if n not in ecosystem.WORKLOADS:
            p.error("unknown workload %r (known: %s)" %
                    (n, ", ".join(ecosystem.WORKLOADS)))
    os.makedirs(ns.out, exist_ok=True)
    failed = 0
    for n in names:
        for mode in ("trace", "expandable") if ns.expandable else ("trace",):
            env = dict(os.environ)
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
            if mode == "expandable":
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            t0 = time.time()
            rc = subprocess.call(
                [sys.executable, os.path.abspath(__file__), ns.out,
                 "--child", n, "--mode", mode, "--size", ns.size,
                 "--seed", str(ns.seed)], env=env)
            sys.stderr.write("capture_eco: %s %s: %s in %.0f s\n" %
                             (n, mode, "ok" if rc == 0 else "FAILED rc=%d"
                              % rc, time.time() - t0))
            failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
