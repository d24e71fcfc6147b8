#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train and run real models on the GPU with each allocator in turn:
PyTorch's default, PyTorch's expandable segments, and libgmlake.

An allocator cannot be changed once CUDA is initialized, so every
allocator runs in its own child process (this script with --child), with
the same seeds, shapes and steps. A round runs every allocator once, in
the order --allocators gives in odd rounds and reversed in even ones.
Every round goes into --out's results.json (per-step times and shapes,
libgmlake's driver calls per step), which is rewritten after each child,
with results.md (every round there merged, see benchlib.py for each
figure) and chart.png (needs matplotlib). --out defaults to a new folder
bench/out/<date-time>, never the committed bench/results.

Workloads (--workloads, comma-separated names or groups):
  gpt  the default: GPT, LoRA, generation and activation offload
       (workloads.py);
  offload  activation offload: GPT's save_on_cpu and offload, and the
       same two on transformers' Llama without checkpointing
       (llama_save_on_cpu, llama_offload; only in this group and all);
  eco  models from the ecosystem (ecosystem.py): timm ViT-L, torchvision
       Mask R-CNN, torch_geometric GraphSAGE, transformers Llama under
       FSDP2, torch.compile; one --fresh round of them, three
       allocators, took 4-5 minutes on an H100;
  eco_extra  two more from the ecosystem: peft LoRA on transformers'
       Llama (eco_lora) and timm ResNet-50 under cudnn.benchmark
       (eco_convnet);
  dist  distributed training over NCCL (distributed.py): the bench's GPT
       under DDP, transformers Llama under FSDP2, the same with peft LoRA,
       and all_reduce/all_gather bandwidth over stitched tensors; with
       --nproc N each allocator's child runs as N processes, one per GPU
       (torch.distributed.run), and its figures are rank 0's step times
       and loss with the highest peaks of any rank;
  all  all of them.

On the GPU machine, after `tools/gpu.sh build` on the build machine, run
each round as its own invocation, K = 1, 2, 3 (at least three rounds):

  GML_GPU_OUT=DIR tools/gpu.sh bench --workloads eco --round K

writes DIR/bench/results.json with round K. Then, anywhere (no torch
needed), merge the rounds:

  python3 bench/bench.py --report R1 R2 R3 --out bench/results/eco-COMMIT

where R1 R2 R3 are the results.json files (or their folders) of the
rounds. A round may also come in parts, one invocation each with the same
--round K and different workloads (--workloads eco_vit,eco_maskrcnn,
eco_sage, then --workloads eco_llama_fsdp,eco_compile): the report joins
them. The same by hand, and other uses:

  python3 bench/bench.py --lib BUILD/libgmlake.so --workloads eco \\
      --round K --out DIR       # round K, added to DIR/results.json
  python3 bench/bench.py --report --out DIR      # DIR/results.md again
  python3 bench/bench.py --lib ... --quick --workloads eco   # smoke test
  python3 bench/bench.py --lib ...              # the gpt workloads
  python3 bench/bench.py --lib ... --rounds 3   # rounds 1-3 in one call
  python3 bench/bench.py --lib ... --sweep      # also the capacity sweep
  python3 bench/bench.py --lib ... --fresh --workloads eco --round K
                                # a process per workload and allocator

While a child runs, a line on stderr says what it is doing (on a
terminal only). bench.py exits 0 when every workload ran, 1 when one
failed (the results say which), 2 when it could not start (no PyTorch, a
module a workload needs, a bad option).

Environment: BENCH_VERBOSE=1 prints each step's time on stderr (for
libgmlake with the memory peaks and the driver calls that took longest in
the step); BENCH_PROBE=1 makes gpt_offload under the same-address
offloader record its records at backward's largest resident_bytes
(results.json, offload.probe); BENCH_OFFLOAD='{"budget": 1073741824}'
gives gpt_offload's and llama_offload's offload_activations() those
options ('{"same_address": true, "lag": 2}': the same-address one);
BENCH_TRACE=DIR records each workload's allocations in every child
(its own allocator's history, a 977-byte marker before each step and
the long-lived markers around an optimizer's first state,
benchlib.mark_long_lived) into
DIR/WORKLOAD-ALLOCATOR.trace.gz for gmlake-replay: the run the bench
measured, which a bench/capture_eco.py run may not be (an earlier
workload in the same process, other settings);
BENCH_CHILD_TIMEOUT (seconds a child may run; default from its
workloads, child_timeout()); a child still running after BENCH_DUMP_AFTER
seconds (default: 20 s before its timeout) prints every thread's Python
stack there; BENCH_COMPILE_CACHE (torch.compile's cache folder, warmed
once per machine before the first round that runs eco_compile, so that
every allocator compiles from the same warm cache); BENCH_COMMIT (the
commit the results name, where git cannot tell); BENCH_CPUS (host CPUs
every child runs on, as taskset takes them, e.g. "0-7": the same cores
for every allocator, since a host-bound step's time follows its core;
each step's result keeps the CPU it ended on, step_cpus, either way, and
the process's host speed after it, step_host_ns: results.md's host speed
table); BENCH_CUDNN_EMPTY_CACHE=0 keeps cuDNN's benchmark in eco_convnet
from calling empty_cache after each search (PyTorch's own default: it
does), to tell that cost from the rest.
"""

import argparse
import datetime
import gc
import importlib.util
import json
import os
import queue
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "python"))

import benchlib  # noqa: E402
import distributed  # noqa: E402
import ecosystem  # noqa: E402

MARK = "BENCH-RESULT "
# Steps of each workload. gpt_*, lora, generate: measured steps after a
# warm-up round (one step per distinct shape, workloads.SHAPE_COUNT, or
# one step at fixed shapes). eco_*: all steps, settling steps included
# (ecosystem.STEPS).
STEPS = {"full": dict({"gpt_ckpt": 12, "gpt_plain": 10, "lora": 12,
                       "gpt_keep": 12, "gpt_save_on_cpu": 12,
                       "gpt_offload": 12, "generate": 16,
                       "llama_save_on_cpu": 8, "llama_offload": 8},
                      **ecosystem.STEPS["full"],
                      **distributed.STEPS["full"]),
         "quick": dict({"gpt_ckpt": 4, "gpt_plain": 3, "lora": 4,
                        "gpt_keep": 4, "gpt_save_on_cpu": 4,
                        "gpt_offload": 4, "generate": 4,
                        "llama_save_on_cpu": 3, "llama_offload": 3},
                       **ecosystem.STEPS["quick"],
                       **distributed.STEPS["quick"])}
# gpt_offload last: a child that fails there has done the rest.
GPT = ("gpt_ckpt", "gpt_plain", "lora", "gpt_keep", "gpt_save_on_cpu",
       "generate", "gpt_offload")
# Activation offload on transformers' Llama (not in the default group).
LLAMA = ("llama_save_on_cpu", "llama_offload")
WORKLOADS = GPT + LLAMA + ecosystem.WORKLOADS + distributed.WORKLOADS
GROUPS = {"gpt": GPT, "eco": ecosystem.CORE,
          "eco_extra": ecosystem.EXTRA,
          "dist": distributed.WORKLOADS, "all": WORKLOADS,
          "offload": ("gpt_save_on_cpu", "gpt_offload") + LLAMA}
# Seconds a workload may take in a child, building included (the child's
# timeout is their sum, child_timeout()).
# The offloading GPTs' four settling steps took 36-41 s on an H100 (the
# host memory they pin), and their first child on a cold machine passed
# 45 + 70 s before its first step (act-offload/h100-a4df062).
BUDGET = {"full": dict(dict.fromkeys(GPT, 70), **dict.fromkeys(LLAMA, 90),
                       gpt_save_on_cpu=150, gpt_offload=150,
                       eco_vit=60, eco_maskrcnn=60,
                       eco_sage=45, eco_llama_fsdp=75, eco_compile=150,
                       eco_lora=90, eco_convnet=75,
                       dist_gpt_ddp=90, dist_llama_fsdp=90,
                       dist_lora_fsdp=90, dist_collectives=60),
          "quick": dict(dict.fromkeys(GPT + LLAMA, 10),
                        **dict.fromkeys(ecosystem.WORKLOADS +
                                        distributed.WORKLOADS, 40))}
# A child's start (imports, CUDA) and the most any child may take.
CHILD_START, CHILD_MAX = 45, 480
# Capacity sweep: per workload, the memory cap; each trial is one round of
# its sequence lengths at one batch (workloads.build_sweep).
SWEEP = {"full": dict(caps_gib={"gpt_ckpt": 24.0, "lora": 12.0}, limit=1024),
         "quick": dict(caps_gib={"gpt_ckpt": 0.5, "lora": 0.5}, limit=64)}
# libgmlake's host budget in the benchmark (its default is 16 GiB, less
# than the largest offload step spills), and what it pins at set-up, so
# that the first step's spills do not wait for pinning (save_on_cpu pins
# as it goes, in its warm-up too); GMLAKE_HOST_LIMIT and GMLAKE_HOST_PIN
# override.
HOST_LIMIT, HOST_PIN = "64G", "32G"


def child_timeout(size, names, sweep=False):
    """Seconds a child running workloads `names` (or their capacity
    sweep: the most a child may take) may take."""
    if os.environ.get("BENCH_CHILD_TIMEOUT"):
        return int(os.environ["BENCH_CHILD_TIMEOUT"])
    if sweep:
        return CHILD_MAX
    return min(CHILD_MAX, CHILD_START + sum(BUDGET[size][n] for n in names))


def expand_workloads(spec):
    """The workload names of a --workloads value (names and groups), in
    order, each once; ValueError on an unknown one."""
    if not spec:
        return list(GPT)
    names = []
    for item in spec.split(","):
        item = item.strip()
        if item in GROUPS:
            new = GROUPS[item]
        elif item in WORKLOADS:
            new = (item,)
        else:
            raise ValueError("unknown workload %r (known: %s; groups: %s)" %
                             (item, ", ".join(WORKLOADS),
                              ", ".join(GROUPS)))
        names += [n for n in new if n not in names]
    return names


def requires(names):
    """The Python modules the workloads need: torch, and each ecosystem
    workload's library."""
    mods = ["torch"]
    for n in names:
        need = ecosystem.REQUIRES.get(n, ()) + distributed.REQUIRES.get(n, ())
        mods += [m for m in need if m not in mods]
    return mods


def missing_modules(mods):
    """Those of mods this Python cannot import (not imported here)."""
    return [m for m in mods if importlib.util.find_spec(m) is None]


def compile_cache_dir():
    """torch.compile's cache folder for every child (Inductor's and
    Triton's), kept on the machine between runs."""
    return os.environ.get("BENCH_COMPILE_CACHE") or os.path.join(
        tempfile.gettempdir(), "gmlake-bench-compile")


# ---------------------------------------------------------------------------
# Child: one allocator, several workloads (or the sweep), results on stdout.

def emit(kind, data):
    """A record for the parent; under torchrun rank 0's only."""
    if os.environ.get("RANK", "0") != "0":
        return
    data = dict(data, kind=kind)
    sys.stdout.write(MARK + json.dumps(data) + "\n")
    sys.stdout.flush()


def jsonable(shape):
    """A step's shape as results.json keeps it (tuples as lists)."""
    return json.loads(json.dumps(shape))


def call_delta(old, new):
    """libgmlake's driver calls between two Memory.snapshot()s:
    {kind: [calls, ns]} of the kinds that made calls."""
    d = {}
    for kind, (n, ns) in new.items():
        n0, ns0 = old.get(kind, (0, 0))
        if n != n0 or ns != ns0:
            d[kind] = [n - n0, ns - ns0]
    return d


class Memory:
    """Peaks of the allocator in use, and the driver's view."""

    def __init__(self, allocator):
        import torch
        self.torch = torch
        self.allocator = allocator
        self.device = torch.cuda.current_device()
        self.last_ns = {}   # driver call_ns at the last now()
        if allocator == "gmlake":
            import gmlake
            self.gmlake = gmlake

    def driver_used(self):
        free, total = self.torch.cuda.mem_get_info(self.device)
        return total - free

    def snapshot(self):
        """libgmlake: {kind: (calls, ns)} of its driver calls so far;
        PyTorch: (num_device_alloc, num_device_free)."""
        if self.allocator == "gmlake":
            try:
                st = self.gmlake.stats(self.device)
            except RuntimeError:
                return {}   # nothing allocated through libgmlake yet
            return {k[len("call_ns."):]: (st["calls." + k[len("call_ns."):]],
                                          v)
                    for k, v in st.items() if k.startswith("call_ns.")}
        st = self.torch.cuda.memory_stats(self.device)
        return (st.get("num_device_alloc", 0), st.get("num_device_free", 0))

    def delta(self, old, new):
        if self.allocator == "gmlake":
            return call_delta(old, new)
        return [new[0] - old[0], new[1] - old[1]]

    def now(self):
        """GiB reserved now and at peak, and the peak of live blocks on
        the device (allocated for PyTorch), for the verbose step lines."""
        driver = ""
        if self.allocator == "gmlake":
            st = self.gmlake.stats(self.device)
            r = (st["reserved_bytes.current"], st["reserved_bytes.peak"],
                 st["resident_bytes.peak"])
            # Driver time since the last line, the three largest kinds.
            ns = {k[len("call_ns."):]: v for k, v in st.items()
                  if k.startswith("call_ns.")}
            last, self.last_ns = self.last_ns, ns
            top = sorted(((v - last.get(k, 0), k) for k, v in ns.items()),
                         reverse=True)[:3]
            driver = "; driver ms " + ", ".join(
                "%s %.0f" % (k, d / 1e6) for d, k in top if d)
        else:
            t = self.torch.cuda
            r = (t.memory_reserved(self.device),
                 t.max_memory_reserved(self.device),
                 t.max_memory_allocated(self.device))
        return "reserved %.2f peak %.2f, blocks on the device peak %.2f " \
            "GiB%s" % (tuple(x / 2**30 for x in r) + (driver,))

    def reset(self):
        gc.collect()
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
        if self.allocator != "gmlake":
            self.torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            self.gmlake.reset_peak_stats(self.device)
        except RuntimeError:
            pass    # nothing allocated through libgmlake yet

    def peaks(self):
        """(peak allocated, peak reserved, extra figures) since reset()."""
        if self.allocator == "gmlake":
            st = self.gmlake.stats(self.device)
            return (st["requested_bytes.peak"], st["reserved_bytes.peak"],
                    {"gmlake_allocated_peak": st["allocated_bytes.peak"],
                     "spilled_peak": st["spilled_bytes.peak"],
                     "resident_peak": st["resident_bytes.peak"],
                     "host_peak": st["host_bytes.peak"],
                     "stitches": st["stitches"],
                     "stitch_reuses": st["stitch_reuses"],
                     "stitch_repairs": st.get("stitch_repairs"),
                     "map_calls": st["calls.mem_map"],
                     "driver_ms": sum(v for k, v in st.items()
                                      if k.startswith("call_ns.")) / 1e6,
                     # driver call: [calls, ms], both threads together
                     "driver_calls": {
                         k[len("call_ns."):]: [
                             st["calls." + k[len("call_ns."):]],
                             round(v / 1e6, 1)]
                         for k, v in st.items()
                         if k.startswith("call_ns.") and v}})
        st = self.torch.cuda.memory_stats(self.device)
        alloc = st.get("requested_bytes.all.peak",
                       st.get("allocated_bytes.all.peak"))
        return (alloc, st.get("reserved_bytes.all.peak"),
                {"torch_allocated_peak": st.get("allocated_bytes.all.peak"),
                 "num_alloc_retries": st.get("num_alloc_retries"),
                 "num_device_alloc": st.get("num_device_alloc")})


def is_oom(torch, exc):
    if isinstance(exc, getattr(torch.cuda, "OutOfMemoryError", ())):
        return True
    return "out of memory" in str(exc).lower()


def guard(allocator):
    """A context manager turning libgmlake failures into clear errors."""
    if allocator == "gmlake":
        import gmlake.torch
        return gmlake.torch.translate_errors()
    import contextlib
    return contextlib.nullcontext()


def cuda_ok(torch):
    try:
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


def build_workload(name, size, seed):
    """The workload's state and how many steps to run."""
    if name in ecosystem.WORKLOADS:
        state = ecosystem.build(name, size, seed, STEPS[size][name])
        return state, state["steps"]
    if name in distributed.WORKLOADS:
        state = distributed.build(name, size, seed, STEPS[size][name])
        return state, state["steps"]
    import workloads
    state = workloads.build(name, size, seed)
    return state, state["warmup"] + STEPS[size][name]


def run_steps(name, args, mem, state, total, r):
    """Run and time the workload's steps into r: step_times (s),
    step_shapes, step_host_ns (benchlib.host_view_ns() after each step,
    untimed), step_gc_ms (the Python garbage collector's time inside
    the step, benchlib.GcClock), and per step libgmlake's driver calls
    (step_calls) or PyTorch's device allocations and frees
    (step_segments); the highest driver-side use seen (returned). With
    args.warmup, one step at each of the workload's shapes, nothing else
    recorded."""
    torch = mem.torch
    used = mem.driver_used()
    if args.warmup:
        for shape in state["shapes"]:
            state["step_at"](shape)
        torch.cuda.synchronize()
        return used
    gc_clock = benchlib.GcClock()
    gc.callbacks.append(gc_clock)
    # The bench's own bookkeeping between steps differs by allocator
    # (torch.cuda.memory_stats()'s dicts or libgmlake's stats), and so
    # decides in which step Python's next full collection falls: a scan
    # of everything the imports and the model left, 250-370 ms on FSDP2,
    # in step 0 under PyTorch's allocators and in steady step 2 under
    # libgmlake (eco-35acfe9-h100). Freezing the heap built before the
    # steps leaves full collections only what the steps keep, for every
    # allocator alike.
    gc.collect()
    gc.freeze()
    try:
        return _timed_steps(name, args, mem, state, total, r, used,
                            gc_clock)
    finally:
        gc.callbacks.remove(gc_clock)
        gc.unfreeze()


def _timed_steps(name, args, mem, state, total, r, used, gc_clock):
    """run_steps()'s loop, with gc_clock counting collections."""
    torch = mem.torch
    times, shapes, per_step = r["step_times"], r["step_shapes"], []
    cpus = r["step_cpus"] = []
    host = r["step_host_ns"] = []
    gc_ms = r["step_gc_ms"] = []
    probe = torch.empty((64, 64), device="cpu")  # no allocator of ours
    r["step_calls" if args.allocator == "gmlake" else "step_segments"] = \
        per_step
    snap = mem.snapshot()
    for i in range(total):
        torch.cuda.synchronize()
        if os.environ.get("BENCH_TRACE"):
            # the step's line in the recorded trace (trace_end)
            torch.empty(benchlib.STEP_MARK, dtype=torch.uint8,
                        device="cuda")
        gc0 = gc_clock.ns
        t0 = time.perf_counter()
        shape = state["step"]()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        gc_ms.append((gc_clock.ns - gc0) / 1e6)
        cpus.append(current_cpu())
        host.append(benchlib.host_view_ns(probe))
        shapes.append(jsonable(shape))
        new = mem.snapshot()
        per_step.append(mem.delta(snap, new))
        snap = new
        used = max(used, mem.driver_used())
        emit("progress", dict(workload=name, step=i + 1, steps=total))
        if os.environ.get("BENCH_VERBOSE"):
            sys.stderr.write("bench: %s %s step %d %s: %.1f ms, %s\n"
                             % (args.allocator, name, len(times),
                                json.dumps(shapes[-1]), times[-1] * 1000,
                                mem.now()))
    return used


def trace_start(torch):
    """With BENCH_TRACE=DIR, record the workload's allocations (from
    before its build, as bench/capture_eco.py does)."""
    if os.environ.get("BENCH_TRACE"):
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python",
            max_entries=8_000_000)
        benchlib.mark_long_lived(torch)


def trace_end(torch, name, args, r):
    """With BENCH_TRACE=DIR, write what this child's allocator was asked
    for to DIR/NAME-ALLOCATOR.trace.gz, a step line per step, for
    gmlake-replay: the exact run the bench measured, whatever differs
    from a capture_eco.py run (its process's earlier workloads, its
    settings)."""
    out = os.environ.get("BENCH_TRACE")
    if not out or args.warmup:
        return
    from gmlake import snapshot_to_trace as s2t
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    settle = benchlib.settle_flags(r)
    events, peak_alloc, peak_reserved = s2t.convert(
        snap["device_traces"][torch.cuda.current_device()],
        step_mark=benchlib.STEP_MARK, settle=settle,
        long_lived_marks=benchlib.LONG_LIVED_MARKS,
        trims=args.allocator != "gmlake")
    header = ["pytorch %s" % torch.__version__, "workload=%s" % name,
              "steps=%d" % len(settle), "peak_alloc=%d" % peak_alloc]
    # gmlake-replay reads peak_reserved as PyTorch's (its torch% column):
    # under libgmlake the history's segments are libgmlake's own.
    if args.allocator != "gmlake":
        header.append("peak_reserved=%d" % peak_reserved)
    os.makedirs(out, exist_ok=True)
    s2t.write(os.path.join(out, "%s-%s.trace.gz" % (name, args.allocator)),
              events, header)


def run_workload(name, index, args, mem):
    import torch
    r = dict(workload=name, index=index, allocator=args.allocator,
             ok=False, oom=False, step_times=[], step_shapes=[])
    if not benchlib.applies(name, args.allocator):
        r.update(skipped=benchlib.ONLY[name][1], steps_done=0)
        return r
    mem.reset()
    base = used = mem.driver_used()
    state = None
    emit("progress", dict(workload=name, step=0, steps=None))
    try:
        with guard(args.allocator):
            trace_start(torch)
            state, total = build_workload(name, args.size, args.seed)
            r["note"] = state["note"]
            r["steps"] = total
            if state.get("warmup"):
                r["warmup"] = state["warmup"]
            used = run_steps(name, args, mem, state, total, r)
            trace_end(torch, name, args, r)
        r["ok"] = True
    except Exception as e:  # report, go on with the next workload
        r["oom"] = is_oom(torch, e)
        r["error"] = "%s: %s" % (type(e).__name__, str(e)[:2000])
    if state and state.get("stats"):
        r["offload"] = state["stats"]()
    if state and state.get("figures"):
        r.update(state["figures"]())
    if state and state.get("close"):
        try:
            state["close"]()
        except Exception as e:
            r.setdefault("error", "closing: %s: %s" % (type(e).__name__,
                                                       str(e)[:500]))
    r["steps_done"] = len(r["step_times"])
    del state
    if not cuda_ok(torch):
        r["cuda_broken"] = True
        return r
    alloc, reserved, extra = mem.peaks()
    r.update(peak_allocated=alloc, peak_reserved=reserved,
             driver_used=used - base, **extra)
    r["fragmentation"] = benchlib.fragmentation(alloc, reserved)
    across_ranks(r)
    return r


def across_ranks(r):
    """Under several ranks: each rank's peaks in r["ranks"], and the
    highest of them (the GPU that needs the most) in r's."""
    dist = sys.modules.get("torch.distributed")   # no group without it
    if dist is None or not dist.is_initialized() or \
            dist.get_world_size() == 1:
        return
    mine = {k: r.get(k) for k in ("peak_allocated", "peak_reserved",
                                  "driver_used", "fragmentation")}
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    r["ranks"] = ranks
    for k in ("peak_allocated", "peak_reserved", "driver_used"):
        vals = [x[k] for x in ranks if x[k] is not None]
        if vals:
            r[k] = max(vals)
    frags = [x["fragmentation"] for x in ranks
             if x["fragmentation"] is not None]
    if frags:
        r["fragmentation"] = max(frags)


def run_sweep(name, args, mem):
    """The largest batch of workload `name` that fits under its cap."""
    import torch
    import workloads
    cfg = SWEEP[args.size]
    total = torch.cuda.get_device_properties(mem.device).total_memory
    cap = min(int(cfg["caps_gib"][name] * benchlib.GiB), total)
    # The same call for every allocator; libgmlake gets it through its
    # memory-fraction hook.
    torch.cuda.set_per_process_memory_fraction(cap / total, mem.device)
    s = dict(workload=name, allocator=args.allocator, cap_bytes=cap,
             trials=[], limit=cfg["limit"])
    mem.reset()
    state = None
    try:
        with guard(args.allocator):
            state = workloads.build_sweep(name, args.size, args.seed)
    except Exception as e:
        s["error"] = "building %s: %s: %s" % (name, type(e).__name__,
                                              str(e)[:1000])
        return s
    s["seq"] = state["seq"]
    while True:
        b = benchlib.next_batch(s["trials"], cfg["limit"])
        if b is None:
            break
        fits = True
        t0 = time.perf_counter()
        try:
            with guard(args.allocator):
                state["step"](b)
                torch.cuda.synchronize()
        except Exception as e:
            if not is_oom(torch, e):
                s["error"] = "batch %d: %s: %s" % (b, type(e).__name__,
                                                    str(e)[:1000])
                break
            fits = False
        # Every trial starts from an empty cache, as a fresh run would.
        state["reset"]()
        mem.reset()
        s["trials"].append((b, fits))
        if os.environ.get("BENCH_VERBOSE"):
            sys.stderr.write("bench: %s sweep %s batch %d: %s, %.1f s\n" % (
                args.allocator, name, b, "fits" if fits else "out of memory",
                time.perf_counter() - t0))
        if not cuda_ok(torch):
            s["cuda_broken"] = True
            break
    s["best"], s["failed"] = benchlib.sweep_summary(s["trials"])
    alloc, reserved, _ = mem.peaks()
    s.update(peak_allocated=alloc, peak_reserved=reserved)
    del state
    torch.cuda.set_per_process_memory_fraction(1.0, mem.device)
    return s


def cpu_list(text):
    """The CPUs of a list like "0-3,8,10-11"; ValueError if malformed."""
    cpus = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        lo, hi = int(lo), int(hi or lo)
        if lo < 0 or hi < lo:
            raise ValueError("bad CPU range %r" % part)
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError("no CPUs in %r" % text)
    return cpus


def current_cpu():
    """The CPU this process last ran on (/proc/self/stat's processor
    field), or None where there is no such file."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        # Fields after the command, which is in parentheses and may
        # hold spaces: the processor is field 39 of the whole line.
        return int(stat[stat.rindex(")") + 2:].split()[36])
    except (OSError, ValueError, IndexError):
        return None


def child(args):
    sweep = args.child == "sweep"
    if os.environ.get("BENCH_CPUS"):
        try:
            os.sched_setaffinity(0, cpu_list(os.environ["BENCH_CPUS"]))
        except (ValueError, OSError) as e:
            emit("fatal", dict(error="BENCH_CPUS=%r: %s" %
                               (os.environ["BENCH_CPUS"], e)))
            return 1
    items = [] if sweep else [item.split(":")
                              for item in args.workloads.split(",")]
    # A child that hangs shows where, on stderr, before the parent's
    # timeout kills it.
    import faulthandler
    faulthandler.dump_traceback_later(
        float(os.environ.get("BENCH_DUMP_AFTER", child_timeout(
            args.size, [n for _, n in items], sweep) - 20)),
        exit=False)
    if args.allocator == "gmlake":
        import gmlake.torch
        gmlake.torch.enable(args.lib)
    import torch
    if not torch.cuda.is_available():
        emit("fatal", dict(error="no CUDA device visible to PyTorch"))
        return 1
    # torchrun's rank of this process: its GPU.
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    mem = Memory(args.allocator)
    props = torch.cuda.get_device_properties(mem.device)
    emit("meta", dict(allocator=args.allocator, torch=torch.__version__,
                      cuda=torch.version.cuda, gpu=props.name,
                      gpu_bytes=props.total_memory,
                      alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                ""),
                      world=int(os.environ.get("WORLD_SIZE", "1")),
                      cpus=sorted(os.sched_getaffinity(0))))
    if args.child == "sweep":
        for name in args.workloads.split(","):
            s = run_sweep(name, args, mem)
            emit("sweep", s)
            if s.get("cuda_broken"):
                return 3
        return 0
    for index, name in items:
        r = run_workload(name, int(index), args, mem)
        emit("result", r)
        if r.get("cuda_broken"):
            return 3    # the parent restarts a child for the rest
    return 0


# ---------------------------------------------------------------------------
# Parent: a child per allocator, restarts, rounds, the report.

def gmlake_settings():
    """The settings the libgmlake child runs with: the offload budgets,
    and any other GMLAKE_* option set (GMLAKE_PACK, ...), for the report."""
    settings = {k: os.environ.get(k, v) for k, v in
                (("GMLAKE_HOST_LIMIT", HOST_LIMIT),
                 ("GMLAKE_HOST_PIN", HOST_PIN))}
    for k, v in sorted(os.environ.items()):
        if k.startswith("GMLAKE_") and k not in settings and k not in (
                "GMLAKE_LIBRARY", "GMLAKE_BACKEND", "GMLAKE_CACHE_DIR"):
            settings[k] = v
    return settings


def child_env(allocator, lib):
    env = dict(os.environ)
    for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(k, None)
    if allocator == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if allocator == "gmlake":
        env["GMLAKE_LIBRARY"] = lib
        env["GMLAKE_BACKEND"] = "cuda"
        # save_on_cpu pins what it needs; give the offloader room alike.
        env.update(gmlake_settings())
    # Every child compiles from the same caches (see warm_compile_cache).
    cache = compile_cache_dir()
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", cache)
    env.setdefault("TRITON_CACHE_DIR", os.path.join(cache, "triton"))
    env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE, os.path.join(REPO, "python")] +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


class Progress:
    """One line on stream, rewritten in place while a child runs; nothing
    at all when stream is not a terminal."""

    def __init__(self, stream):
        self.stream = stream
        self.on = hasattr(stream, "isatty") and stream.isatty()
        self.shown = False

    def show(self, text):
        if self.on:
            self.stream.write("\r" + text[:150] + "\x1b[K")
            self.stream.flush()
            self.shown = True

    def clear(self):
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self.shown = False


def progress_text(label, record, seconds):
    """The progress line: what runs, its step, seconds so far."""
    what = label
    if record:
        what += ": " + record["workload"]
        if record.get("steps"):
            what += " step %d/%d" % (record["step"], record["steps"])
        else:
            what += " building"
    return "%s, %d s" % (what, seconds)


def _kill(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_process(cmd, env, timeout, label, stderr=None):
    """Run cmd (in a session of its own, so that a timeout kills what it
    started too) until it exits or `timeout` seconds pass. Returns (rc or
    "timeout", the records of its MARK lines); other lines of its stdout
    are printed, indented. Progress records update a progress line on
    stderr (a terminal only) and are not returned."""
    stderr = stderr or sys.stderr
    progress = Progress(stderr)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True,
                            bufsize=1, start_new_session=True)
    lines = queue.Queue()

    def reader():
        with proc.stdout:
            for line in proc.stdout:
                lines.put(line)
        lines.put(None)
    threading.Thread(target=reader, daemon=True).start()
    start = time.monotonic()
    records, last, rc, quiet = [], None, None, 0
    try:
        while True:
            waited = time.monotonic() - start
            if rc is None and waited > timeout:
                _kill(proc)
                proc.wait()
                rc = "timeout"
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                # Done once the child is gone and its pipe stays quiet
                # (something it started may hold the pipe open).
                if rc is None:
                    rc = proc.poll()
                quiet = quiet + 1 if rc is not None else 0
                if quiet >= 4:
                    break
                progress.show(progress_text(label, last, waited))
                continue
            if line is None:
                break
            if line.startswith(MARK):
                r = json.loads(line[len(MARK):])
                if r.get("kind") == "progress":
                    last = r
                    progress.show(progress_text(label, last, waited))
                else:
                    records.append(r)
                continue
            progress.clear()
            print("   " + line.rstrip("\n"), flush=True)
    except BaseException:
        _kill(proc)
        raise
    finally:
        progress.clear()
    if rc is None:
        rc = proc.wait()
    return rc, records


def result_line(r):
    """One line of a child's result, for the terminal."""
    s = benchlib.step_summary(r.get("step_times") or [],
                              benchlib.settle_flags(r))
    return "   %-16s %-14s mean %s ms, median %s ms, %d settling steps " \
        "%s ms; reserved %s GiB, fragmentation %s %%" % (
            r["workload"], benchlib.status(r),
            benchlib._cell(s["mean_ms"], "%.1f"),
            benchlib._cell(s["median_ms"], "%.1f"), s["settle_steps"],
            benchlib._cell(s["settle_ms"], "%.0f"),
            benchlib._cell(benchlib.gib(r.get("peak_reserved"))),
            benchlib._cell(r.get("fragmentation"), "%.1f"))


def child_command(args, allocator, what, extra):
    """The child's command line: this script, under torch.distributed.run
    with --nproc above 1 (one process per GPU)."""
    cmd = [os.path.abspath(__file__), "--child", what,
           "--allocator", allocator, "--size", args.size,
           "--seed", str(args.seed), "--lib", args.lib] + extra
    if args.nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run",
                "--standalone", "--nproc_per_node", str(args.nproc)] + cmd
    return [sys.executable] + cmd


def run_child(args, allocator, what, extra, names=(), label=None):
    cmd = child_command(args, allocator, what, extra)
    label = label or benchlib.ALLOCATOR_NAMES[allocator]
    print("== %s: %s %s" % (label, what, ",".join(names)), flush=True)
    rc, out = run_process(cmd, child_env(allocator, args.lib),
                          child_timeout(args.size, names, what == "sweep"),
                          label)
    for r in out:
        if r["kind"] == "result":
            print(result_line(r), flush=True)
    return rc, out


def note_meta(meta, r):
    """The machine and versions from a child's meta record."""
    for k in ("gpu", "gpu_bytes", "torch", "cuda"):
        meta.setdefault(k, r[k])


def run_allocator(args, allocator, todo, meta, notes):
    """Run the (index, name) workloads of todo under allocator in one
    child, again in a new child from the first one not done if a child
    dies; their results."""
    todo = list(todo)
    results = []
    for _attempt in range(len(todo) + 1):
        if not todo:
            break
        spec = ",".join("%d:%s" % (i, n) for i, n in todo)
        rc, out = run_child(args, allocator, "workloads",
                            ["--workloads", spec], [n for _, n in todo])
        done, fatal = set(), False
        for r in out:
            if r["kind"] == "meta":
                note_meta(meta, r)
            elif r["kind"] == "result":
                results.append(r)
                done.add(r["index"])
            elif r["kind"] == "fatal":
                notes.append("%s: %s" % (allocator, r["error"]))
                fatal = True
        if rc == 0 and len(done) == len(todo):
            break
        if fatal:
            results += [dict(workload=n, index=i, allocator=allocator,
                             ok=False, oom=False, error="not run")
                        for i, n in todo if i not in done]
            break
        # The child died or broke CUDA: note it, skip the culprit.
        left = [(i, n) for i, n in todo if i not in done]
        if left and rc != 3:
            i, n = left[0]
            results.append(dict(workload=n, index=i, allocator=allocator,
                                ok=False, oom=False,
                                error="child exited with %s" % rc))
            notes.append("%s, %s: the child process exited with %s" %
                         (benchlib.ALLOCATOR_NAMES[allocator], n, rc))
            left = left[1:]
        todo = left
    return results


def warm_compile_cache(args, names, rnd):
    """Before the first round on this machine that runs eco_compile: one
    step at each of its shapes under PyTorch's default allocator, not
    measured, so that every allocator's child compiles from the same warm
    caches (else the first child of the round would compile cold)."""
    if "eco_compile" not in names:
        return
    stamp = os.path.join(compile_cache_dir(), "bench-warm-%s-%d" %
                         (args.size, args.seed))
    if os.path.exists(stamp):
        rnd["notes"].append("torch.compile's caches were warm from an "
                            "earlier run on this machine")
        return
    t0 = time.time()
    rc, out = run_child(args, "default", "workloads",
                        ["--workloads", "%d:eco_compile" %
                         names.index("eco_compile"), "--warmup"],
                        ["eco_compile"], "torch.compile warm-up")
    ok = rc == 0 and any(r["kind"] == "result" and r.get("ok")
                         for r in out)
    if ok:
        os.makedirs(os.path.dirname(stamp), exist_ok=True)
        with open(stamp, "w") as f:
            f.write("warmed %s\n" % datetime.datetime.now().isoformat())
    rnd["notes"].append(
        "before the allocators, torch.compile's caches were warmed by one "
        "step at each eco_compile shape under PyTorch's default "
        "allocator, not measured (%.0f s)%s" % (
            time.time() - t0, "" if ok else "; that failed (exit %s), so "
            "the round's first child compiled cold" % rc))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", help="libgmlake.so (default: GMLAKE_LIBRARY, "
                   "then the usual places)")
    p.add_argument("--quick", action="store_true",
                   help="tiny models and few steps: a smoke test")
    p.add_argument("--sweep", action="store_true",
                   help="also the capacity sweep under a memory cap")
    p.add_argument("--only-sweep", action="store_true",
                   help="the capacity sweep only")
    p.add_argument("--workloads", help="comma-separated names or groups "
                   "(%s); default gpt. Names: %s" %
                   (", ".join(GROUPS), ", ".join(WORKLOADS)))
    p.add_argument("--allocators", default=",".join(benchlib.ALLOCATORS),
                   help="comma-separated subset of: %s; odd rounds run "
                   "them in this order, even rounds in reverse" %
                   ",".join(benchlib.ALLOCATORS))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fresh", action="store_true",
                   help="each workload in a child process of its own, as "
                   "a job that starts with it (default: one child per "
                   "allocator runs the round's workloads one after "
                   "another)")
    p.add_argument("--nproc", type=int, default=1, metavar="N",
                   help="processes (GPUs) per allocator for the dist "
                   "workloads, under torch.distributed.run (default 1; "
                   "above 1 only dist workloads may run)")
    rounds = p.add_mutually_exclusive_group()
    rounds.add_argument("--round", type=int, metavar="K",
                        help="run round K (1, 2, ...) only, into --out's "
                        "results.json (replacing round K's run of the same "
                        "workloads there)")
    rounds.add_argument("--rounds", type=int, metavar="N",
                        help="run rounds 1 to N in this call (default 1)")
    p.add_argument("--report", nargs="*", metavar="RESULTS",
                   help="run nothing: merge the rounds of every RESULTS (a "
                   "results.json or its folder; default --out's) into "
                   "--out's results.json and results.md")
    p.add_argument("--out", help="folder for results.json, results.md and "
                   "chart.png (default: a new folder bench/out/<date-time>)")
    p.add_argument("--child", choices=("workloads", "sweep"),
                   help=argparse.SUPPRESS)
    p.add_argument("--allocator", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--warmup", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.child:
        args.size = "quick" if args.quick else "full"
    return args


def default_out(now=None):
    """A new folder name under bench/out for this run's results."""
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    path = os.path.join(HERE, "out", stamp)
    n = 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(HERE, "out", "%s-%d" % (stamp, n))
    return path


def shown_path(path):
    """path as the results show it: relative to the repository, or only
    its name when outside (no machine's folders in committed results)."""
    if not path:
        return path
    full = os.path.abspath(path)
    if full.startswith(REPO + os.sep):
        return os.path.relpath(full, REPO)
    return os.path.basename(full)


def shown_command(argv):
    """The command that made the results, to rerun from the repository
    root: paths shown as shown_path() does, --out left out."""
    words, skip = ["python3", "bench/bench.py"], False
    for i, a in enumerate(argv[1:], 1):
        if skip:
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        if a.startswith("--out="):
            continue
        if argv[i - 1] == "--lib":
            a = shown_path(a)
        elif a.startswith("--lib="):
            a = "--lib=" + shown_path(a[len("--lib="):])
        words.append(a)
    return " ".join(shlex.quote(w) for w in words)


def source_commit():
    """The commit of the sources that ran (BENCH_COMMIT, else git's HEAD,
    "-dirty" with changes to tracked files); None where neither tells."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        head = subprocess.run(["git", "-C", REPO, "rev-parse", "--short=7",
                               "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


class Store:
    """--out's results.json and results.md, written again after every
    child, so that a run cut short keeps what it did."""

    def __init__(self, out):
        self.out = out
        self.path = os.path.join(out, "results.json")
        self.data = None
        if os.path.exists(self.path):
            self.data = benchlib.as_rounds(benchlib.load_json(self.path))

    def has(self, k, names):
        """Whether round k's run of any of workloads `names` is here."""
        probe = dict(round=k, results=[dict(workload=n) for n in names])
        return any(benchlib.clash(r, probe)
                   for r in (self.data or {}).get("rounds", []))

    def put(self, rnd):
        os.makedirs(self.out, exist_ok=True)
        self.data, _ = benchlib.add_round(self.data, rnd)
        write_report(self.out, self.data, self.path)


def write_report(out, data, json_path=None):
    """results.json (unless json_path is None), results.md, chart.png."""
    os.makedirs(out, exist_ok=True)
    if json_path:
        benchlib.write_json(json_path, data)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(benchlib.results_markdown(data))
    return benchlib.chart(benchlib.merge(data["rounds"]),
                          os.path.join(out, "chart.png"))


def run_round(args, k, names, allocators, store, argv, sweep):
    """Round k: every allocator's child in the round's order, then the
    capacity sweep if `sweep`; returns the round's record (also in the
    store)."""
    start = time.time()
    rnd = dict(round=k, order=benchlib.round_order(allocators, k),
               complete=False, command=shown_command(argv), mode=args.size,
               seed=args.seed, library=shown_path(args.lib),
               commit=source_commit(),
               gmlake_env=" ".join("%s=%s" % kv
                                   for kv in gmlake_settings().items()),
               date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
               fresh=bool(args.fresh), notes=[], results=[], sweeps=[])
    if store.has(k, [] if args.only_sweep else names):
        rnd["notes"].append("replaces an earlier round %d of these "
                            "workloads in this results.json" % k)
    print("== round %d: %s" % (k, ", ".join(
        benchlib.ALLOCATOR_NAMES[a] for a in rnd["order"])), flush=True)
    if not args.only_sweep:
        warm_compile_cache(args, names, rnd)
        # --fresh: a child per workload, as a job that starts with it
        # (what one workload leaves cached does not serve the next).
        todo = list(enumerate(names))
        groups = [[w] for w in todo] if args.fresh else [todo]
        for a in rnd["order"]:
            for group in groups:
                rnd["results"] += run_allocator(args, a, group, rnd,
                                                rnd["notes"])
                rnd["wall_s"] = round(time.time() - start, 1)
                store.put(rnd)
    if sweep:
        run_sweeps(args, names, allocators, rnd)
    for r in rnd["results"]:
        if r.get("error"):
            rnd["notes"].append("%s, %s: %s" % (benchlib.ALLOCATOR_NAMES.get(
                r["allocator"]), r["workload"], r["error"][:300]))
    rnd["complete"] = True
    rnd["wall_s"] = round(time.time() - start, 1)
    store.put(rnd)
    return rnd


def run_sweeps(args, names, allocators, rnd):
    todo = [n for n in SWEEP[args.size]["caps_gib"]
            if not args.workloads or n in names]
    if not todo:
        rnd["notes"].append("no capacity sweep: it runs %s only" %
                            ", ".join(SWEEP[args.size]["caps_gib"]))
        return
    for a in allocators:
        rc, out = run_child(args, a, "sweep",
                            ["--workloads", ",".join(todo)], todo)
        got = [r for r in out if r["kind"] == "sweep"]
        rnd["sweeps"] += got
        for r in out:
            if r["kind"] == "meta":
                note_meta(rnd, r)
        if len(got) < len(todo):
            rnd["notes"].append("%s sweep: the child exited with %s after "
                                "%d of %d workloads" % (a, rc, len(got),
                                                        len(todo)))


def failed(rnd):
    """Whether anything of round rnd failed: a workload that did not run
    to its end, a sweep that stopped."""
    if any(benchlib.status(r) in ("error", "out of memory")
           for r in rnd["results"]):
        return True
    return any(s.get("error") or s.get("cuda_broken")
               for s in rnd["sweeps"]) or any(
        "sweep: the child exited" in n for n in rnd["notes"])


def report(args):
    """--report: merge rounds from results.json files into --out."""
    inputs = args.report or ([args.out] if args.out else [])
    if not inputs:
        sys.stderr.write("bench.py: --report needs results to read: "
                         "--report RESULTS... or --out DIR\n")
        return 2
    try:
        datas = [benchlib.load_json(p) for p in inputs]
        data = benchlib.merge_data(datas)
    except (OSError, ValueError) as e:
        sys.stderr.write("bench.py: %s\n" % e)
        return 2
    out = args.out or default_out()
    json_path = os.path.join(out, "results.json")
    same = [p for p in inputs if os.path.abspath(
        os.path.join(p, "results.json") if os.path.isdir(p) else p) ==
        os.path.abspath(json_path)]
    msg = write_report(out, data, None if same else json_path)
    print(benchlib.console_summary(data))
    n = len(benchlib.round_ids(data["rounds"]))
    print("%s; %d round%s; report in %s" % (msg, n, "" if n == 1 else "s",
                                            out))
    return 0


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.child:
        return child(args)
    try:
        names = expand_workloads(args.workloads)
    except ValueError as e:
        sys.stderr.write("bench.py: %s\n" % e)
        return 2
    if args.nproc < 1 or (args.nproc > 1 and
                          set(names) - set(distributed.WORKLOADS)):
        sys.stderr.write("bench.py: --nproc %d: %s\n" % (
            args.nproc, "must be at least 1" if args.nproc < 1 else
            "above 1 runs only dist workloads, one process per GPU"))
        return 2
    allocators = args.allocators.split(",")
    for a in allocators:
        if a not in benchlib.ALLOCATORS:
            sys.stderr.write("bench.py: unknown allocator %r\n" % a)
            return 2
    for opt in ("round", "rounds"):
        if getattr(args, opt) is not None and getattr(args, opt) < 1:
            sys.stderr.write("bench.py: --%s must be at least 1, not %d\n"
                             % (opt, getattr(args, opt)))
            return 2
    if args.report is not None:
        return report(args)
    missing = missing_modules(requires(names))
    if missing:
        sys.stderr.write(
            "bench.py: cannot run: %s not importable by %s. The benchmark "
            "runs on a GPU machine with PyTorch%s (--report needs neither)."
            "\n" % (", ".join(missing), sys.executable,
                    " and the ecosystem workloads' libraries"
                    if missing != ["torch"] else ""))
        return 2
    import gmlake
    try:
        args.lib = gmlake.find_library(args.lib)
    except gmlake.LibraryNotFoundError as e:
        sys.stderr.write("bench.py: %s\n" % e)
        return 2
    args.out = args.out or default_out()
    try:
        store = Store(args.out)
    except (OSError, ValueError) as e:
        sys.stderr.write("bench.py: %s: %s\n" % (args.out, e))
        return 2
    ks = [args.round] if args.round else list(range(1, (args.rounds or 1)
                                                     + 1))
    start = time.time()
    bad = False
    for k in ks:
        bad |= failed(run_round(args, k, names, allocators, store,
                                [sys.argv[0]] + argv,
                                (args.sweep or args.only_sweep) and
                                k == ks[-1]))
    print(benchlib.console_summary(store.data))
    offload = benchlib.offload_table(benchlib.merge(store.data["rounds"]))
    if offload:
        print(offload)
    sweeps = [s for r in store.data["rounds"] for s in r.get("sweeps", [])]
    if sweeps:
        print(benchlib.sweep_table(sweeps))
    print("wall time %.0f s; results in %s%s" % (
        time.time() - start, args.out,
        "; some workloads failed" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
