#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Train and run real models on the GPU with each allocator in turn:
PyTorch's default, PyTorch's expandable segments, and libgmlake.

An allocator cannot be changed once CUDA is initialized, so every
allocator runs in its own child process (this script with --child), with
the same seeds, shapes and steps. The parent collects what the children
print and writes, under --out (default bench/results):
  results.md    the table, the exact command, GPU and versions;
  results.json  the raw numbers;
  chart.png     peak reserved and fragmentation (needs matplotlib).

  python3 bench/bench.py --lib BUILD/lib/.libs/libgmlake.so            # full
  python3 bench/bench.py --lib BUILD/lib/.libs/libgmlake.so --quick    # smoke
  python3 bench/bench.py --lib ... --sweep      # also the capacity sweep

The definitions of every figure are in benchlib.py. BENCH_VERBOSE=1
prints each step's time on stderr (for libgmlake with the memory peaks
and the driver calls that took longest in the step); BENCH_PROBE=1 makes
gpt_offload record the offloader's records at backward's largest
resident_bytes (results.json, offload.probe); BENCH_OFFLOAD='{"lag": 2}'
gives gpt_offload's offload_activations() those options. A child still
running after
BENCH_DUMP_AFTER seconds (default: 20 s before its timeout,
BENCH_CHILD_TIMEOUT, 480 s in full mode) prints every thread's Python
stack there.
"""

import argparse
import datetime
import gc
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "python"))

import benchlib  # noqa: E402

MARK = "BENCH-RESULT "
# Measured steps of each workload, after its warm-up round (one step per
# distinct shape, workloads.SHAPE_COUNT, or one step at fixed shapes).
STEPS = {"full": {"gpt_ckpt": 12, "gpt_plain": 10, "lora": 12,
                  "gpt_keep": 12, "gpt_save_on_cpu": 12, "gpt_offload": 12,
                  "generate": 16},
         "quick": {"gpt_ckpt": 4, "gpt_plain": 3, "lora": 4, "gpt_keep": 4,
                   "gpt_save_on_cpu": 4, "gpt_offload": 4, "generate": 4}}
# gpt_offload last: a child that fails there has done the rest.
WORKLOADS = ("gpt_ckpt", "gpt_plain", "lora", "gpt_keep",
             "gpt_save_on_cpu",
             "generate", "gpt_offload")
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
# Seconds a child may run (BENCH_CHILD_TIMEOUT overrides).
TIMEOUT = {"full": 480, "quick": 100}
if os.environ.get("BENCH_CHILD_TIMEOUT"):
    TIMEOUT = dict.fromkeys(TIMEOUT, int(os.environ["BENCH_CHILD_TIMEOUT"]))


# ---------------------------------------------------------------------------
# Child: one allocator, several workloads (or the sweep), results on stdout.

def emit(kind, data):
    data = dict(data, kind=kind)
    sys.stdout.write(MARK + json.dumps(data) + "\n")
    sys.stdout.flush()


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


def run_workload(name, index, args, mem):
    import torch
    import workloads
    steps = STEPS[args.size][name]
    r = dict(workload=name, index=index, allocator=args.allocator,
             steps=steps, ok=False, oom=False)
    if not benchlib.applies(name, args.allocator):
        r.update(skipped=benchlib.ONLY[name][1], steps_done=0,
                 step_times=[], step_ms=None)
        return r
    mem.reset()
    base = mem.driver_used()
    used = base
    times = []
    state = None
    try:
        with guard(args.allocator):
            state = workloads.build(name, args.size, args.seed)
            r["note"] = state["note"]
            r["warmup"] = warmup = state["warmup"]
            for _ in range(warmup + steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                state["step"]()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                used = max(used, mem.driver_used())
                if os.environ.get("BENCH_VERBOSE"):
                    sys.stderr.write("bench: %s %s step %d: %.1f ms, %s\n"
                                     % (args.allocator, name, len(times),
                                        times[-1] * 1000, mem.now()))
        r["ok"] = True
    except Exception as e:  # report, go on with the next workload
        r["oom"] = is_oom(torch, e)
        r["error"] = "%s: %s" % (type(e).__name__, str(e)[:2000])
    if state and state.get("stats"):
        r["offload"] = state["stats"]()
    r["steps_done"] = len(times)
    r["step_times"] = times
    r["step_ms"] = benchlib.median_ms(times, skip=r.get("warmup", 1))
    del state
    if not cuda_ok(torch):
        r["cuda_broken"] = True
        return r
    alloc, reserved, extra = mem.peaks()
    r.update(peak_allocated=alloc, peak_reserved=reserved,
             driver_used=used - base, **extra)
    r["fragmentation"] = benchlib.fragmentation(alloc, reserved)
    return r


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


def child(args):
    # A child that hangs shows where, on stderr, before the parent's
    # timeout kills it.
    import faulthandler
    faulthandler.dump_traceback_later(
        float(os.environ.get("BENCH_DUMP_AFTER", TIMEOUT[args.size] - 20)),
        exit=False)
    if args.allocator == "gmlake":
        import gmlake.torch
        gmlake.torch.enable(args.lib)
    import torch
    if not torch.cuda.is_available():
        emit("fatal", dict(error="no CUDA device visible to PyTorch"))
        return 1
    torch.backends.cuda.matmul.allow_tf32 = True
    mem = Memory(args.allocator)
    props = torch.cuda.get_device_properties(mem.device)
    emit("meta", dict(allocator=args.allocator, torch=torch.__version__,
                      cuda=torch.version.cuda, gpu=props.name,
                      gpu_bytes=props.total_memory,
                      alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                "")))
    if args.child == "sweep":
        for name in args.workloads.split(","):
            s = run_sweep(name, args, mem)
            emit("sweep", s)
            if s.get("cuda_broken"):
                return 3
        return 0
    for item in args.workloads.split(","):
        index, name = item.split(":")
        r = run_workload(name, int(index), args, mem)
        emit("result", r)
        if r.get("cuda_broken"):
            return 3    # the parent restarts a child for the rest
    return 0


# ---------------------------------------------------------------------------
# Parent: a child per allocator, restarts, the report.

def gmlake_settings():
    """The offload settings the libgmlake child runs with."""
    return {k: os.environ.get(k, v) for k, v in
            (("GMLAKE_HOST_LIMIT", HOST_LIMIT), ("GMLAKE_HOST_PIN", HOST_PIN))}


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
    env["PYTHONPATH"] = os.pathsep.join(
        [HERE, os.path.join(REPO, "python")] +
        ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def run_child(args, allocator, what, extra):
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what,
           "--allocator", allocator, "--size", args.size,
           "--seed", str(args.seed), "--lib", args.lib] + extra
    out = []
    print("== %s: %s" % (benchlib.ALLOCATOR_NAMES[allocator], what),
          flush=True)
    try:
        proc = subprocess.run(cmd, env=child_env(allocator, args.lib),
                              stdout=subprocess.PIPE, text=True,
                              timeout=TIMEOUT[args.size])
        rc, text = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else \
            (e.stdout or "")
    for line in text.splitlines():
        if line.startswith(MARK):
            out.append(json.loads(line[len(MARK):]))
        else:
            print("   " + line)
    for r in out:
        if r["kind"] == "result":
            print("   %-16s ok=%s oom=%s reserved=%s frag=%s step=%s ms" % (
                r["workload"], r["ok"], r["oom"],
                benchlib._cell(benchlib.gib(r.get("peak_reserved"))),
                benchlib._cell(r.get("fragmentation"), "%.1f"),
                benchlib._cell(r.get("step_ms"), "%.1f")), flush=True)
    return rc, out


def note_meta(meta, r):
    """The machine and versions from a child's meta record."""
    for k in ("gpu", "gpu_bytes", "torch", "cuda"):
        meta.setdefault(k, r[k])


def run_allocator(args, allocator, names, meta, notes):
    todo = list(enumerate(names))
    results = []
    for _attempt in range(len(todo) + 1):
        if not todo:
            break
        spec = ",".join("%d:%s" % (i, n) for i, n in todo)
        rc, out = run_child(args, allocator, "workloads",
                            ["--workloads", spec])
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
    p.add_argument("--workloads", help="comma-separated subset of: %s" %
                   ",".join(WORKLOADS))
    p.add_argument("--allocators", default=",".join(benchlib.ALLOCATORS),
                   help="comma-separated subset of: %s" %
                   ",".join(benchlib.ALLOCATORS))
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rounds", type=int, default=1,
                   help="run every allocator this many times, the order "
                   "reversed every other round; step times are the median "
                   "of the rounds' (for workloads whose times vary from "
                   "run to run)")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--child", choices=("workloads", "sweep"),
                   help=argparse.SUPPRESS)
    p.add_argument("--allocator", help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.child:
        args.size = "quick" if args.quick else "full"
    return args


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


def main(argv=None):
    args = parse(argv if argv is not None else sys.argv[1:])
    if args.child:
        return child(args)
    import gmlake
    try:
        args.lib = gmlake.find_library(args.lib)
    except gmlake.LibraryNotFoundError as e:
        sys.stderr.write("bench.py: %s\n" % e)
        return 2
    allocators = args.allocators.split(",")
    for a in allocators:
        if a not in benchlib.ALLOCATORS:
            sys.stderr.write("bench.py: unknown allocator %r\n" % a)
            return 2
    if args.rounds < 1:
        sys.stderr.write("bench.py: --rounds must be at least 1, not %d\n" %
                         args.rounds)
        return 2
    names = args.workloads.split(",") if args.workloads else \
        list(WORKLOADS)
    for n in names:
        if n not in WORKLOADS:
            sys.stderr.write("bench.py: unknown workload %r (known: %s)\n" %
                             (n, ", ".join(WORKLOADS)))
            return 2
    start = time.time()
    meta = dict(command=shown_command(sys.argv),
                mode=args.size, library=shown_path(args.lib),
                gmlake_env=" ".join("%s=%s" % kv
                                    for kv in gmlake_settings().items()),
                rounds=args.rounds,
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))
    notes, results, sweeps = [], [], []
    if not args.only_sweep:
        for k in range(args.rounds):
            for a in allocators if k % 2 == 0 else allocators[::-1]:
                results += run_allocator(args, a, names, meta, notes)
        results = benchlib.merge_rounds(results)
    if args.sweep or args.only_sweep:
        todo = [n for n in SWEEP[args.size]["caps_gib"]
                if not args.workloads or n in names]
        for a in allocators:
            rc, out = run_child(args, a, "sweep",
                                ["--workloads", ",".join(todo)])
            got = [r for r in out if r["kind"] == "sweep"]
            sweeps += got
            for r in out:
                if r["kind"] == "meta":
                    note_meta(meta, r)
            if len(got) < len(todo):
                notes.append("%s sweep: the child exited with %s after %d "
                             "of %d workloads" % (a, rc, len(got), len(todo)))
    for r in results:
        if r.get("error"):
            notes.append("%s, %s: %s" % (benchlib.ALLOCATOR_NAMES.get(
                r["allocator"]), r["workload"], r["error"][:300]))
        if r.get("note") and r["allocator"] == allocators[0]:
            notes.append("%s: %s" % (r["workload"], r["note"]))
    meta["notes"] = notes
    meta["wall_s"] = round(time.time() - start, 1)
    os.makedirs(args.out, exist_ok=True)
    benchlib.write_json(os.path.join(args.out, "results.json"),
                        dict(meta=meta, results=results, sweeps=sweeps))
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(benchlib.results_markdown(meta, results, sweeps))
    print(benchlib.chart(results, os.path.join(args.out, "chart.png")))
    print(benchlib.results_table(results))
    offload = benchlib.offload_table(results)
    if offload:
        print(offload)
    if sweeps:
        print(benchlib.sweep_table(sweeps))
    print("wall time %.0f s; results in %s" % (meta["wall_s"], args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
