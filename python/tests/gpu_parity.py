# SPDX-License-Identifier: MIT
"""PyTorch parity on a GPU: what works under PyTorch's allocator must work
under libgmlake (issue 15's table), each case in a child process of its
own, once under each allocator.

    python3 python/tests/gpu_parity.py --lib build-gpu/libgmlake.so
        [--rows a,b,...] [--slow] [--backend adapter|ctypes|auto]
        [--timeout S] [--json FILE]

Rows: enable (libgmlake's backend, and the adapter's build on first use),
memory_stats (memory_allocated, max_memory_reserved, memory_stats,
memory_summary; under libgmlake memory_allocated() must equal libgmlake's
allocated bytes), reset_peak, memory_history (_record_memory_history,
_snapshot, _dump_snapshot), cudnn_benchmark (a Conv2d forward and
backward), compile_reduce_overhead (a 20-step training loop against the
same loop run eagerly), graph_pool (free inside a capture, allocate
outside afterwards, replay, nothing outside overwritten; a second graph
sharing the pool), ipc (CUDA tensors through a pipe to a spawned
process that reads them and writes to them), mempool (torch.cuda.MemPool
and use_mem_pool), nccl_mempool (a one-rank NCCL group: a MemPool on
the backend's mem_allocator, register_mem_pool, all_reduce on tensors
allocated before and after the registration, the pool's segments in
the snapshot, deregistration), mempool_allocator (a MemPool on a
CUDAPluggableAllocator of cuMemAlloc built here: its tensors, its
segments in the snapshot, every segment given back once the pool is
gone), oom_linear (out
of memory inside a Linear caught as torch.cuda.OutOfMemoryError, then
the process goes on), oom_400g (torch.empty(400 GiB) + 1 raises
OutOfMemoryError; CUDA still works), cross_stream (memory freed on a
busy stream and allocated on another: the second stream's writes land
after the first's reads; under libgmlake it says how often the memory
was taken and the stream made to wait). --slow adds compile_max_autotune;
--rows alloc_cost measures an allocation and free through PyTorch
(run it with --backend ctypes too, to compare the adapter's cost).
ipc, nccl_mempool and mempool_allocator must work, but under the ctypes
backend (PyTorch's pluggable allocator, which shares nothing and keeps
no pools) a refusal passes. A row whose need is missing under PyTorch's
own allocator too (a PyTorch whose NCCL has no mem allocator, no C
compiler) is skipped.

Prints a table and, last, "N passed, M failed, K skipped"; exit 1 on any
failure.
Needs torch with CUDA; the library's Python package is taken from this
source tree (python/).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
MARK = "GMLAKE_PARITY_RESULT "
GiB = 1 << 30
MiB = 1 << 20

ROWS = ("enable", "memory_stats", "reset_peak", "memory_history",
        "cudnn_benchmark", "compile_reduce_overhead", "graph_pool", "ipc",
        "mempool", "nccl_mempool", "mempool_allocator", "oom_linear",
        "oom_400g", "cross_stream")
SLOW_ROWS = ("compile_max_autotune",)
# Rows that measure and always pass (--rows to run them).
EXTRA_ROWS = ("alloc_cost",)
# Messages that make a refusal a pass (documented, says what to do).
IPC_REFUSAL = "PluggableAllocator"


class RowFailed(Exception):
    pass


class RowSkipped(Exception):
    """What the row needs is missing from this PyTorch or machine, under
    PyTorch's own allocator too: neither a pass nor a failure."""


def check(cond, msg):
    if not cond:
        raise RowFailed(msg)


# ---------------------------------------------------------------------------
# The rows, run in a child process. Each returns a short detail string.

def row_enable(torch, ctx):
    if ctx["mode"] != "gmlake":
        return "PyTorch's allocator (%s)" % \
            torch.cuda.memory.get_allocator_backend()
    import gmlake.torch
    check(gmlake.torch.backend() == "adapter",
          "libgmlake runs through %s, not the adapter" %
          gmlake.torch.backend())
    x = torch.ones(1 << 20, device="cuda")
    check(float(x.sum()) == float(1 << 20), "a first tensor is wrong")
    return "backend %s, enable took %.1f s" % (gmlake.torch.backend(),
                                               ctx["enable_s"])


def gmlake_allocated(ctx, dev):
    if ctx["mode"] != "gmlake":
        return None
    import gmlake
    return gmlake.stats(dev)["allocated_bytes.current"]


def row_memory_stats(torch, ctx):
    dev = torch.cuda.current_device()
    keep = [torch.empty(n, dtype=torch.uint8, device="cuda")
            for n in (3 * MiB + 5, 64 * MiB, 1000, 300 * MiB)]
    del keep[1]
    torch.cuda.synchronize()
    alloc = torch.cuda.memory_allocated()
    st = torch.cuda.memory_stats()
    for key in ("allocated_bytes.all.current", "reserved_bytes.all.peak",
                "active_bytes.all.current", "requested_bytes.all.current",
                "inactive_split_bytes.all.current", "num_alloc_retries",
                "num_ooms", "num_device_alloc", "num_device_free"):
        check(key in st, "memory_stats() lacks %s" % key)
    check(alloc == st["allocated_bytes.all.current"],
          "memory_allocated %d != memory_stats %d" %
          (alloc, st["allocated_bytes.all.current"]))
    check(alloc >= 303 * MiB, "memory_allocated() %d is too small" % alloc)
    check(torch.cuda.max_memory_reserved() >= torch.cuda.memory_reserved()
          >= alloc, "reserved figures are inconsistent")
    check(torch.cuda.max_memory_allocated() >= alloc,
          "max_memory_allocated() < memory_allocated()")
    check(st["requested_bytes.all.current"] ==
          3 * MiB + 5 + 1000 + 300 * MiB,
          "requested_bytes %d" % st["requested_bytes.all.current"])
    text = torch.cuda.memory_summary()
    check("Allocated memory" in text, "memory_summary() has no table")
    g = gmlake_allocated(ctx, dev)
    if g is not None:
        check(g == alloc, "memory_allocated() %d != libgmlake's %d" %
              (alloc, g))
    return "allocated %d, reserved %d%s" % (
        alloc, torch.cuda.memory_reserved(),
        "" if g is None else ", libgmlake allocated %d" % g)


def row_reset_peak(torch, ctx):
    x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del x
    torch.cuda.synchronize()
    check(torch.cuda.max_memory_allocated() >= 512 * MiB, "no peak")
    torch.cuda.reset_peak_memory_stats()
    now = torch.cuda.memory_allocated()
    check(torch.cuda.max_memory_allocated() == now,
          "peak %d after reset, current %d" %
          (torch.cuda.max_memory_allocated(), now))
    torch.cuda.reset_accumulated_memory_stats()
    st = torch.cuda.memory_stats()
    check(st["num_ooms"] == 0, "num_ooms not reset")
    return "peak back to %d" % now


def row_memory_history(torch, ctx):
    import pickle
    torch.cuda.memory._record_memory_history(max_entries=100000)
    a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
    ptr = b.data_ptr()
    del b
    snap = torch.cuda.memory._snapshot()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snap.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            dumped = pickle.load(f)
    torch.cuda.memory._record_memory_history(enabled=None)
    # A stop drops the trace, as PyTorch's allocator does: a recording
    # after it holds only its own events.
    torch.cuda.memory._record_memory_history(max_entries=100000)
    c = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    again = torch.cuda.memory._snapshot()["device_traces"]
    torch.cuda.memory._record_memory_history(enabled=None)
    check([e["addr"] for e in again[torch.cuda.current_device()]
           if e["action"] == "alloc"] == [c.data_ptr()],
          "a recording after a stop kept the earlier trace")
    del c
    check(snap["segments"], "the snapshot has no segments")
    for seg in snap["segments"]:
        addr = seg["address"]
        for blk in seg["blocks"]:
            check(blk["address"] == addr, "blocks do not tile a segment")
            addr += blk["size"]
    dev = torch.cuda.current_device()
    trace = snap["device_traces"][dev]
    acts = {(e["action"], e["addr"]) for e in trace}
    check(("alloc", ptr) in acts, "no alloc event for the freed tensor")
    check(("free_completed", ptr) in acts, "no free_completed event")
    check(any(e["action"] == "alloc" and e["addr"] == a.data_ptr()
              for e in trace), "no alloc event for the live tensor")
    check(dumped.get("segments") and dumped.get("device_traces"),
          "_dump_snapshot wrote no segments or traces")
    frames = sum(1 for e in trace if e.get("frames"))
    stitched = sum(1 for s in snap["segments"] if s.get("is_expandable"))
    return "%d segments (%d stitched), %d events, %d with stacks" % (
        len(snap["segments"]), stitched, len(trace), frames)


def row_cudnn_benchmark(torch, ctx):
    torch.backends.cudnn.benchmark = True
    conv = torch.nn.Conv2d(64, 128, 3, padding=1).cuda()
    x = torch.randn(32, 64, 112, 112, device="cuda", requires_grad=True)
    y = conv(x)
    y.float().mean().backward()
    torch.cuda.synchronize()
    check(torch.isfinite(y).all().item(), "non-finite output")
    check(x.grad is not None and torch.isfinite(x.grad).all().item(),
          "bad gradient")
    return "conv out %s" % (tuple(y.shape),)


def _train(torch, mode, steps=20):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 512), torch.nn.GELU(),
        torch.nn.Linear(512, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device="cuda").manual_seed(1)
    xs = torch.randn(steps, 64, 256, device="cuda", generator=g)
    ys = torch.randint(0, 10, (steps, 64), device="cuda", generator=g)
    step_fn = model if mode is None else torch.compile(model, mode=mode)
    losses = []
    for i in range(steps):
        if mode is not None:
            torch.compiler.cudagraph_mark_step_begin()
        loss = torch.nn.functional.cross_entropy(step_fn(xs[i]), ys[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


def _compile_row(torch, mode):
    eager = _train(torch, None)
    t0 = time.time()
    compiled = _train(torch, mode)
    dt = time.time() - t0
    for i, (e, c) in enumerate(zip(eager, compiled)):
        check(abs(e - c) <= 2e-2 * max(1.0, abs(e)),
              "step %d: loss %.5f compiled, %.5f eager" % (i, c, e))
    check(compiled[-1] < compiled[0], "the loss did not go down")
    return "loss %.4f -> %.4f (eager %.4f), %.0f s" % (
        compiled[0], compiled[-1], eager[-1], dt)


def row_compile_reduce_overhead(torch, ctx):
    return _compile_row(torch, "reduce-overhead")


def row_compile_max_autotune(torch, ctx):
    return _compile_row(torch, "max-autotune")


def row_graph_pool(torch, ctx):
    n = 16 * MiB // 4
    static_in = torch.randn(n, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            (static_in * 2 + 1).mul(3).sum()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        tmp = static_in * 2 + 1        # in the graph's pool
        tmp2 = tmp * 3
        del tmp                        # freed inside the capture
        out = tmp2.sum()
    # Allocated outside afterwards, the size of what was freed inside.
    outside = [torch.full((n,), 7.0, device="cuda") for _ in range(6)]
    g2 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g2, pool=g.pool()):
        out2 = (static_in - 1).abs().sum()
    more = [torch.full((n,), 9.0, device="cuda") for _ in range(4)]
    torch.cuda.synchronize()
    for _ in range(5):
        static_in.copy_(torch.randn(n, device="cuda"))
        g.replay()
        g2.replay()
        torch.cuda.synchronize()
        want = ((static_in * 2 + 1) * 3).sum()
        check(torch.allclose(out, want, rtol=1e-4, atol=1e-2),
              "replayed result %.3f, expected %.3f" % (out, want))
        want2 = (static_in - 1).abs().sum()
        check(torch.allclose(out2, want2, rtol=1e-4, atol=1e-2),
              "second graph's result is wrong")
    for t in outside:
        check(bool((t == 7.0).all()), "a replay overwrote a tensor "
              "allocated outside the graph")
    for t in more:
        check(bool((t == 9.0).all()), "a replay overwrote a tensor "
              "allocated after the second capture")
    del g, g2, out, out2, tmp2
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return "6+4 outside tensors intact over 5 replays of 2 graphs"


def row_cross_stream(torch, ctx):
    """x is allocated and freed on s1 while s1 still has to read it (the
    read queued behind matmuls); z is allocated at once on s2 and filled.
    Whoever z's memory is, y = x * 2 must be all 2s."""
    n = 256 * MiB // 4
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda")
    gm = None
    if ctx["mode"] == "gmlake":
        import gmlake
        gm = gmlake
        waits0 = gm.stats(0)["calls.stream_wait"]
    reused = bad = 0
    for _ in range(8):
        s1.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            x = torch.ones(n, device="cuda")
            for _ in range(30):
                b = a @ a
            y = x * 2
            xp = x.data_ptr()
            del x                   # freed on s1, its read still queued
        with torch.cuda.stream(s2):
            z = torch.full((n,), 7.0, device="cuda")
            reused += z.data_ptr() <= xp < z.data_ptr() + 4 * n
        torch.cuda.synchronize()
        bad += int((y != 2).sum())
        del y, z, b
    check(bad == 0, "%d elements read after another stream overwrote "
          "them" % bad)
    detail = "y intact over 8 rounds; z took x's memory %d times" % reused
    if gm is not None:
        detail += ", %d stream waits" % (gm.stats(0)["calls.stream_wait"] -
                                         waits0)
    return detail


def _gmlake_backend():
    """The backend serving PyTorch in this process, or None."""
    mod = sys.modules.get("gmlake.torch")
    return mod.backend() if mod else None


def _ipc_child(conn, lib, backend):
    if lib:                 # the receiver runs libgmlake too
        sys.path.insert(0, PYDIR)
        import gmlake.torch
        gmlake.torch.enable(library=lib, backend=backend)
    import torch
    tensors = conn.recv()
    sums = [float(t.double().sum()) for t in tensors]
    for t in tensors:       # seen by the sender once synchronized
        t.add_(1)
    torch.cuda.synchronize()
    conn.send(sums)
    conn.recv()             # keep the tensors until the sender has looked


def row_ipc(torch, ctx):
    """Tensors of several kinds (a small block in a shared chunk, a block
    of growth handles, a large one allocated where two freed blocks left
    holes, which libgmlake may stitch) through a pipe to a spawned
    process, which reads them and adds 1 in place."""
    import torch.multiprocessing as mp
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    lib = ctx["lib"] if ctx["mode"] == "gmlake" else None
    p = spawn.Process(target=_ipc_child,
                      args=(child, lib, ctx.get("backend", "auto")))
    p.start()
    a = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    c = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda")
    del a, c                # two holes for one block that needs both
    tensors = [torch.arange(1000, device="cuda", dtype=torch.float32),
               torch.arange(5 * MiB, device="cuda", dtype=torch.float32),
               torch.ones(48 * MiB, device="cuda", dtype=torch.float32)]
    del b
    want = [float(t.double().sum()) for t in tensors]
    try:
        parent.send(tensors)
    except RuntimeError as e:
        p.kill()
        p.join()
        # PyTorch's pluggable allocator (the ctypes backend) shares
        # nothing; the adapter must.
        check(_gmlake_backend() == "ctypes" and IPC_REFUSAL in str(e),
              "sharing failed: %s" % e)
        return "refused under the ctypes backend: %s" % str(e)[:120]
    got = parent.recv()
    torch.cuda.synchronize()
    after = [float(t.double().sum()) for t in tensors]
    parent.send("done")
    p.join(60)
    check(got == want, "the other process read %s, not %s" % (got, want))
    added = [x - w for x, w in zip(after, want)]
    check(added == [float(t.numel()) for t in tensors],
          "the other process's writes came back as %s" % added)
    return ("the other process read %d tensors (up to %d MiB) and its "
            "writes came back" % (len(tensors),
                                  tensors[-1].numel() * 4 // MiB))


def row_mempool(torch, ctx):
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        x = torch.full((4 * MiB,), 3.0, device="cuda")
        y = x * 2
    z = torch.full((4 * MiB,), 5.0, device="cuda")   # outside the pool
    check(bool((y == 6.0).all()) and bool((z == 5.0).all()), "wrong values")
    uses = pool.use_count()
    del x, y
    del pool
    torch.cuda.synchronize()
    check(bool((z == 5.0).all()), "a tensor outside the pool changed")
    return "MemPool() works (use_count %d)" % uses


def _pool_segments(torch, pool):
    """(address, size) of each segment the snapshot gives pool."""
    return [(s["address"], s["total_size"])
            for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool.id)]


def row_nccl_mempool(torch, ctx):
    """NCCL's user-buffer registration on one rank: the pool's memory
    comes from the backend's allocator (ncclMemAlloc), a segment per
    block, registered whole."""
    import torch.distributed as dist
    dev = torch.device("cuda", 0)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method="file://%s/store" % tmp,
                                rank=0, world_size=1, device_id=dev)
        try:
            backend = dist.group.WORLD._get_backend(dev)
            try:
                pool = torch.cuda.MemPool(backend.mem_allocator)
            except RuntimeError as e:
                if "not supported in this NCCL" in str(e):
                    raise RowSkipped("this PyTorch's NCCL has no mem "
                                     "allocator: %s" % str(e)[:120])
                check(_gmlake_backend() == "ctypes",
                      "MemPool(mem_allocator) failed: %s" % e)
                return "refused under the ctypes backend: %s" % str(e)[:120]
            reserved0 = torch.cuda.memory_reserved()
            with torch.cuda.use_mem_pool(pool):
                a = torch.full((16 * MiB,), 2.0, device=dev)
            backend.register_mem_pool(pool)
            with torch.cuda.use_mem_pool(pool):     # after: the hook's
                b = torch.full((3 * MiB,), 5.0, device=dev)
            dist.all_reduce(a)
            dist.all_reduce(b)
            torch.cuda.synchronize()
            check(bool((a == 2.0).all()) and bool((b == 5.0).all()),
                  "all_reduce on one rank changed the values")
            segs = _pool_segments(torch, pool)
            sizes = sorted(size for _, size in segs)
            check(len(segs) == 2 and sizes[0] >= 12 * MiB and
                  sizes[1] >= 64 * MiB,
                  "the pool's segments in the snapshot: %s" % sizes)
            grown = torch.cuda.memory_reserved() - reserved0
            check(grown >= 76 * MiB, "memory_reserved grew by %d bytes, "
                  "not by the pool's segments" % grown)
            del a, b
            backend.deregister_mem_pool(pool)
            del pool
            torch.cuda.synchronize()
        finally:
            dist.destroy_process_group()
    return ("registered a pool of %d segments (%s MiB) from NCCL's "
            "allocator; all_reduce right" %
            (len(segs), "+".join(str(x // MiB) for x in sizes)))


# A pool allocator of the simplest kind, as a user would pass to MemPool:
# cuMemAlloc and cuMemFree from the driver (dlopen: no CUDA headers or
# libraries needed to build it), with counts to check the frees against.
PLAIN_ALLOCATOR_C = r"""
#include <dlfcn.h>
#include <stddef.h>
typedef unsigned long long dptr;
static int (*mem_alloc)(dptr *, size_t);
static int (*mem_free)(dptr);
static long allocs, frees;
static int load(void)
{
    void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        h = dlopen("libcuda.so.1", RTLD_NOW);
    if (h && !mem_alloc) {
        mem_alloc = (int (*)(dptr *, size_t))dlsym(h, "cuMemAlloc_v2");
        mem_free = (int (*)(dptr))dlsym(h, "cuMemFree_v2");
    }
    return mem_alloc && mem_free;
}
void *plain_alloc(size_t size, int device, void *stream)
{
    dptr p = 0;
    (void)device; (void)stream;
    if (!load() || mem_alloc(&p, size))
        return NULL;
    __atomic_add_fetch(&allocs, 1, __ATOMIC_RELAXED);
    return (void *)p;
}
void plain_free(void *p, size_t size, int device, void *stream)
{
    (void)size; (void)device; (void)stream;
    if (load() && !mem_free((dptr)p))
        __atomic_add_fetch(&frees, 1, __ATOMIC_RELAXED);
}
long plain_allocs(void) { return allocs; }
long plain_frees(void) { return frees; }
"""


def _plain_allocator(tmp):
    """PLAIN_ALLOCATOR_C built into tmp: its path, or RowSkipped."""
    import shutil
    src = os.path.join(tmp, "plain_alloc.c")
    so = os.path.join(tmp, "plain_alloc.so")
    with open(src, "w") as f:
        f.write(PLAIN_ALLOCATOR_C)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise RowSkipped("no C compiler to build a pool allocator")
    p = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", so, src,
                        "-ldl"], capture_output=True, text=True)
    check(p.returncode == 0, "building the pool allocator failed: %s" %
          p.stderr[-300:])
    return so


def row_mempool_allocator(torch, ctx):
    """A MemPool on an allocator of the user's (CUDAPluggableAllocator):
    under libgmlake each block is a segment of that allocator's, and
    all of them go back once the pool is gone."""
    import ctypes
    with tempfile.TemporaryDirectory() as tmp:
        so = _plain_allocator(tmp)
        counts = ctypes.CDLL(so)
        counts.plain_allocs.restype = ctypes.c_long
        counts.plain_frees.restype = ctypes.c_long
        alloc = torch.cuda.memory.CUDAPluggableAllocator(so, "plain_alloc",
                                                         "plain_free")
        try:
            pool = torch.cuda.MemPool(alloc.allocator())
        except RuntimeError as e:
            check(_gmlake_backend() == "ctypes",
                  "MemPool(allocator) failed: %s" % e)
            return "refused under the ctypes backend: %s" % str(e)[:120]
        with torch.cuda.use_mem_pool(pool):
            a = torch.full((16 * MiB,), 2.0, device="cuda")
            b = torch.full((3 * MiB,), 5.0, device="cuda")
        z = torch.full((MiB,), 7.0, device="cuda")     # outside the pool
        c = a[:MiB] + b[:MiB] + z
        torch.cuda.synchronize()
        check(bool((c == 14.0).all()), "wrong values")
        made = counts.plain_allocs()
        check(made >= 1, "the pool's allocator was never called")
        segs = _pool_segments(torch, pool)
        for t in (a, b):
            check(any(addr <= t.data_ptr() < addr + size
                      for addr, size in segs),
                  "a pool tensor at %#x in none of the pool's segments %s" %
                  (t.data_ptr(), segs))
        del a, b, c, t      # t, the loop's, still held b
        torch.cuda.synchronize()
        del pool
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        gone = counts.plain_frees()
        check(gone == made, "the allocator made %d segments and got %d "
              "back after the pool's end" % (made, gone))
        check(bool((z == 7.0).all()), "a tensor outside the pool changed")
    return ("a pool of %d segments (%s MiB) from a user's allocator; all "
            "given back at its end" %
            (len(segs), "+".join(str(s // MiB) for _, s in segs)))


def row_oom_linear(torch, ctx):
    total = torch.cuda.get_device_properties(0).total_memory
    lin = torch.nn.Linear(16, 65536).cuda()
    rows = int(1.25 * total / (65536 * 4))
    x = torch.randn(rows, 16, device="cuda")
    try:
        y = lin(x)
        torch.cuda.synchronize()
        raise RowFailed("a %d GiB output was allocated" %
                        (rows * 65536 * 4 // GiB))
    except torch.cuda.OutOfMemoryError as e:
        msg = str(e)
    check("out of memory" in msg, "message: %s" % msg[:200])
    y = lin(x[:1024])
    torch.cuda.synchronize()
    check(torch.isfinite(y).all().item(), "after the OOM: bad values")
    z = torch.randn(1 << 20, device="cuda").sum().item()
    check(z == z, "after the OOM: CUDA broken")
    return "caught: %s" % msg.split(".")[0][:100]


def row_oom_400g(torch, ctx):
    try:
        y = torch.empty(400 * GiB, dtype=torch.uint8, device="cuda") + 1
        torch.cuda.synchronize()
        raise RowFailed("no exception; data_ptr %#x" % y.data_ptr())
    except torch.cuda.OutOfMemoryError as e:
        msg = str(e)
    torch.cuda.synchronize()
    check(float(torch.ones(10, device="cuda").sum()) == 10.0,
          "CUDA does not work after the OOM")
    return "OutOfMemoryError: %s" % msg[:80]


def row_alloc_cost(torch, ctx):
    """Not a parity check: the cost of an allocation and free through
    PyTorch (torch.empty, then dropping it), for the adapter against the
    ctypes backend (--backend ctypes) and PyTorch's allocator."""
    out = []
    for size in (1024, 4 * MiB, 64 * MiB):
        for _ in range(200):
            torch.empty(size, dtype=torch.uint8, device="cuda")
        n = 20000 if size < 64 * MiB else 5000
        t0 = time.perf_counter()
        for _ in range(n):
            torch.empty(size, dtype=torch.uint8, device="cuda")
        dt = (time.perf_counter() - t0) / n * 1e6
        out.append("%s %.2f us" % ("1 KiB" if size == 1024 else
                                   "%d MiB" % (size // MiB), dt))
    torch.cuda.synchronize()
    return "alloc+free: " + ", ".join(out)


# ---------------------------------------------------------------------------

def child(ns):
    """Run one row; print its result as a MARK line."""
    res = {"row": ns.row, "mode": ns.child, "ok": False, "detail": ""}
    ctx = {"mode": ns.child, "lib": ns.lib, "backend": ns.backend,
           "enable_s": 0.0}
    try:
        if ns.child == "gmlake":
            sys.path.insert(0, PYDIR)
            t0 = time.time()
            import gmlake.torch
            gmlake.torch.enable(library=ns.lib, backend=ns.backend)
            ctx["enable_s"] = time.time() - t0
        import torch
        if not torch.cuda.is_available():
            raise RowFailed("no CUDA device")
        res["detail"] = globals()["row_" + ns.row](torch, ctx)
        res["ok"] = True
    except RowFailed as e:
        res["detail"] = str(e)
    except RowSkipped as e:
        res["skipped"] = True
        res["detail"] = "skipped: %s" % e
    except Exception as e:
        res["detail"] = "%s: %s" % (type(e).__name__, str(e)[:400])
        traceback.print_exc()
    sys.stdout.flush()
    print(MARK + json.dumps(res))
    sys.stdout.flush()
    return 0


def status(res):
    """pass, FAIL or skip: a row's result in the table."""
    if res["ok"]:
        return "pass"
    return "skip" if res.get("skipped") else "FAIL"


def run_row(ns, mode, row):
    env = dict(os.environ)
    if mode == "gmlake":
        env["GMLAKE_LIBRARY"] = os.path.abspath(ns.lib)
        env["GMLAKE_BACKEND"] = "cuda"      # tensors need the real device
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        env["PYTHONPATH"] = os.pathsep.join(
            [PYDIR] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                       if p])
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode,
           "--row", row, "--backend", ns.backend]
    if ns.lib:
        cmd += ["--lib", os.path.abspath(ns.lib)]
    limit = ns.timeout * (3 if row.startswith("compile") or
                          row == "enable" else 1)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                           timeout=limit)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else \
            (e.stdout or "")
        err = "timed out after %d s" % limit
        rc = -1
    res = None
    for line in out.splitlines():
        if line.startswith(MARK):
            res = json.loads(line[len(MARK):])
    if res is None:
        tail = (err or out).strip().splitlines()[-3:]
        res = {"row": row, "mode": mode, "ok": False,
               "detail": "no result (exit %s): %s" % (rc, " | ".join(tail))}
    res["seconds"] = round(time.time() - t0, 1)
    if not res["ok"] and ns.verbose:
        sys.stderr.write(err[-4000:])
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", help="libgmlake.so (build-gpu/libgmlake.so)")
    ap.add_argument("--rows", help="comma-separated rows (default: all)")
    ap.add_argument("--slow", action="store_true",
                    help="also " + ", ".join(SLOW_ROWS))
    ap.add_argument("--backend", default="adapter",
                    choices=("adapter", "ctypes", "auto"),
                    help="libgmlake's backend (default: adapter)")
    ap.add_argument("--timeout", type=int, default=300,
                    help="seconds per row and allocator (x3 for enable "
                    "and compile rows; default 300)")
    ap.add_argument("--only", choices=("torch", "gmlake"),
                    help="run under one allocator only")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="print a failing child's stderr")
    ap.add_argument("--child", choices=("torch", "gmlake"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--row", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        return child(ns)
    modes = [ns.only] if ns.only else ["torch", "gmlake"]
    if "gmlake" in modes and not ns.lib:
        ap.error("--lib PATH (libgmlake.so) is needed")
    rows = ns.rows.split(",") if ns.rows else \
        list(ROWS) + (list(SLOW_ROWS) if ns.slow else [])
    for r in rows:
        if r not in ROWS + SLOW_ROWS + EXTRA_ROWS:
            ap.error("unknown row %s" % r)
    results = {}
    for mode in modes:
        for row in rows:
            r = run_row(ns, mode, row)
            results[(row, mode)] = r
            print("%-24s %-7s %-4s %6.1fs  %s" % (
                row, mode, status(r).replace("pass", "ok"), r["seconds"],
                r["detail"]), flush=True)
    print()
    print("| %-24s | %-6s | %-6s | %s" % ("row", "torch", "gmlake",
                                           "libgmlake's detail"))
    print("|" + "-" * 26 + "|--------|--------|" + "-" * 40)
    for row in rows:
        cells = []
        for mode in ("torch", "gmlake"):
            r = results.get((row, mode))
            cells.append("-" if r is None else status(r))
        r = results.get((row, "gmlake")) or results.get((row, "torch"))
        print("| %-24s | %-6s | %-6s | %s" % (row, cells[0], cells[1],
                                               r["detail"][:110]))
    counts = {"pass": 0, "FAIL": 0, "skip": 0}
    for r in results.values():
        counts[status(r)] += 1
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump([results[k] for k in sorted(results)], f, indent=1)
    print("%d passed, %d failed, %d skipped" % (counts["pass"],
                                                counts["FAIL"],
                                                counts["skip"]))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
