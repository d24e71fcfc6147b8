#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""What one allocation and free cost through PyTorch, per allocator.

    LD_LIBRARY_PATH=build-gpu/runtime-libs \
        python3 bench/alloc_cost.py --lib build-gpu/libgmlake.so

Each allocator (PyTorch default, expandable segments, libgmlake through
the pluggable-allocator hook, and bench/null_alloc.c through the same hook:
the least an allocator there can cost, which tells PyTorch's share of
libgmlake's figure from libgmlake's own; built with cc when one is found)
runs in a process of its own: torch.empty
and del of the same sizes, in two patterns, timed on the host (no kernel
runs, so the figures are the allocators' host cost alone plus PyTorch's
tensor creation, the same for all):

  loop    one size at a time, allocated and freed at once (the cache's
          best case);
  window  a window of 64 live tensors of mixed sizes (4 KiB to 8 MiB,
          seeded), the oldest freed as each new one comes: the pattern of
          a decode step with a growing KV cache;
  view    x.t() of a live tensor, no allocation at all: the control. It
          is the process's host speed, which moves with the core the
          process landed on (a host-bound step's time follows it), not
          with the allocator; a figure above is only the allocator's where
          the view columns of the rows agree.

Each row also says the CPU its process ended on.

Prints a markdown table of nanoseconds per allocation + free (median of
5 rounds).
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import bench  # each allocator's environment, as the benchmark sets it

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ALLOCATORS = (("default", "PyTorch default"),
              ("expandable", "PyTorch expandable segments"),
              ("gmlake", "libgmlake"),
              ("null", "null allocator, same hook"))
LOOP_SIZES = (512, 64 << 10, 1 << 20, 8 << 20, 64 << 20)
N = 20000
ROUNDS = 5


def per_op(fn, n):
    """Median over ROUNDS of ns per iteration of fn(n)."""
    fn(n // 10)     # warm the cache and the code
    times = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter_ns()
        fn(n)
        times.append((time.perf_counter_ns() - t0) / n)
    return statistics.median(times)


def child():
    import torch
    dev = torch.device("cuda")
    torch.empty(1, device=dev)
    out = {}
    for size in LOOP_SIZES:
        def loop(n, size=size):
            for _ in range(n):
                t = torch.empty(size, dtype=torch.uint8, device=dev)
                del t
        out["loop %s" % size] = per_op(loop, N)
    rng = random.Random(1)
    sizes = [rng.choice((4 << 10, 64 << 10, 256 << 10, 1 << 20, 3 << 20,
                         8 << 20)) for _ in range(4096)]

    def window(n):
        live = [None] * 64
        for i in range(n):
            live[i % 64] = torch.empty(sizes[i % len(sizes)],
                                       dtype=torch.uint8, device=dev)
        live.clear()
    out["window"] = per_op(window, N)
    x = torch.empty((64, 64), device=dev)

    def view(n):
        for _ in range(n):
            y = x.t()
        del y
    out["view"] = per_op(view, N)
    torch.cuda.synchronize()
    out["cpu"] = bench.current_cpu()
    print(json.dumps(out))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lib", default=os.path.join(REPO, "build-gpu",
                                                  "libgmlake.so"),
                   help="libgmlake.so to test (default: %(default)s)")
    p.add_argument("--child", choices=[a for a, _ in ALLOCATORS],
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        if args.child == "gmlake":
            import gmlake.torch
            gmlake.torch.enable(args.lib)
        elif args.child == "null":
            import torch
            alloc = torch.cuda.memory.CUDAPluggableAllocator(
                args.lib, "null_alloc", "null_free")
            torch.cuda.memory.change_current_allocator(alloc)
        return child()
    rows = {}
    tmp = tempfile.mkdtemp(prefix="alloc_cost.")
    null = os.path.join(tmp, "null_alloc.so")
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or subprocess.call([cc, "-shared", "-fPIC", "-O2", "-o", null,
                                  os.path.join(HERE, "null_alloc.c"),
                                  "-ldl"]):
        sys.stderr.write("alloc_cost: no C compiler built null_alloc.c; "
                         "its row is left out\n")
        null = None
    for name, label in ALLOCATORS:
        if name == "null" and not null:
            continue
        lib = null if name == "null" else args.lib
        r = subprocess.run([sys.executable, os.path.abspath(__file__),
                            "--lib", lib, "--child", name],
                           env=bench.child_env(name, lib),
                           stdout=subprocess.PIPE, timeout=600)
        if r.returncode:
            sys.stderr.write("alloc_cost: the %s child failed (exit %d)\n" %
                             (label, r.returncode))
            return 1
        rows[label] = json.loads(r.stdout.decode().strip().splitlines()[-1])
    shutil.rmtree(tmp, ignore_errors=True)
    cols = list(next(iter(rows.values())))
    print("| allocator | " + " | ".join(c + (" ns" if c != "cpu" else "")
                                        for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for label, r in rows.items():
        print("| %s | %s |" % (label, " | ".join("%.0f" % r[c] if c != "cpu"
                                                  else str(r[c])
                                                  for c in cols)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
