#!/usr/bin/env python3
# SPDX-License-Identifier: MIT
"""Replay an allocation trace through a model of PyTorch's expandable
segments, for the peak it would reserve, without a GPU.

Issue 14 asks libgmlake's peak reserved memory to be at most PyTorch's
with expandable_segments:True on every workload; gmlake-replay gives
libgmlake's peak for a trace on the emulated device, and this gives the
other side. The model follows c10/cuda/CUDACachingAllocator.cpp (PyTorch
2.x) with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and nothing
else set:

- sizes rounded up to 512 bytes; up to 1 MiB from the small pool, above
  from the large pool; a pool per stream;
- each (stream, pool) has one expandable segment: a range mapped from its
  start in pages of 2 MiB (small) or 20 MiB (large), never unmapped (no
  empty_cache, no out-of-memory retry);
- a request takes the best fit among the free mapped blocks of its pool
  (smallest size, then lowest address), passing over a block whose
  unmapped neighbour would make it grow when a block of smaller such size
  follows (get_free_block); else the segment maps the pages the request
  lacks at its mapped end, merged with a free block there
  (try_allocate_expandable_block);
- the rest of a block is split off when 512 bytes or more; a freed block
  merges with free mapped neighbours. A block is freed at the trace's
  free_completed (when PyTorch's events said its work was done).

Reserved memory is the mapped pages of every segment; its peak is what
max_memory_reserved() reports. With --default, the default allocator
instead (expandable segments off), to check that a trace is read as
PyTorch ran it. On the traces in tests/data the default model gives the
recorded peak to the byte on six of nine, and the expandable model the
H200's expandable peak to the byte where the H200 ran the recorded
events (ViT, LoRA); it is above the H200 on GraphSAGE (by 50%), FSDP2,
compile and Mask R-CNN, not explained yet
(bench/results/expandable-sim-8d87a47.md).

    python3 bench/expandable_sim.py tests/data/eco_vit.trace.gz
    python3 bench/expandable_sim.py --json tests/data/*.trace.gz

Exit status 1 when a trace cannot be read (an event for an address that
is not live), 2 on bad arguments.
"""

import argparse
import bisect
import gzip
import json
import sys

ALIGN = 512                  # kMinBlockSize
SMALL = 1 << 20              # kSmallSize: the small pool's largest request
PAGE_SMALL = 2 << 20         # kSmallBuffer
PAGE_LARGE = 20 << 20        # kLargeBuffer
VA = 1 << 44                 # a segment's range: more than any device


class Block:
    __slots__ = ("addr", "size", "mapped", "used", "prev", "next")

    def __init__(self, addr, size, mapped):
        self.addr, self.size, self.mapped = addr, size, mapped
        self.used = False
        self.prev = self.next = None


class TraceError(Exception):
    pass


class Pool:
    """One stream's small or large pool: its segment and free blocks."""

    def __init__(self, sim, base, page):
        self.sim, self.page = sim, page
        self.free = []              # (size, addr, block), sorted
        self.tail = Block(base, VA, False)  # the unmapped rest

    def _add(self, b):
        bisect.insort(self.free, (b.size, b.addr, b))

    def _drop(self, b):
        i = bisect.bisect_left(self.free, (b.size, b.addr))
        assert self.free[i][2] is b
        del self.free[i]

    @staticmethod
    def _grows(b):
        n = b.next
        return b.size + (n.size if n and not n.mapped else 0)

    def _best_fit(self, size):
        i = bisect.bisect_left(self.free, (size, 0))
        if i == len(self.free):
            return None
        while (i + 1 < len(self.free) and
               self._grows(self.free[i + 1][2]) < self._grows(self.free[i][2])):
            i += 1
        b = self.free[i][2]
        del self.free[i]
        return b

    def _merge(self, b):
        """b (free, mapped) takes in its free mapped neighbours."""
        p = b.prev
        if p and not p.used and p.mapped:
            self._drop(p)
            b.addr, b.size, b.prev = p.addr, b.size + p.size, p.prev
            if b.prev:
                b.prev.next = b
        n = b.next
        if n and not n.used and n.mapped:
            self._drop(n)
            b.size += n.size
            b.next = n.next
            if b.next:
                b.next.prev = b

    def _grow(self, size):
        """Map pages at the segment's end for size bytes, merged with a
        free block before them; the block, out of the free list."""
        t = self.tail
        have = t.prev.size if t.prev and not t.prev.used else 0
        want = -(-(size - have) // self.page) * self.page
        b = Block(t.addr, want, True)
        b.prev, b.next = t.prev, t
        if t.prev:
            t.prev.next = b
        t.prev = b
        t.addr += want
        t.size -= want
        self.sim.reserve(want)
        self._merge(b)
        return b

    def _take(self, b, size, split):
        """b in use for size bytes; with split, its rest a free block."""
        if split:
            rest = Block(b.addr + size, b.size - size, True)
            rest.prev, rest.next = b, b.next
            if b.next:
                b.next.prev = rest
            b.next = rest
            b.size = size
            self._add(rest)
        b.used = True
        return b

    def alloc(self, size):
        b = self._best_fit(size) or self._grow(size)
        return self._take(b, size, b.size - size >= ALIGN)

    def free_block(self, b):
        b.used = False
        self._merge(b)
        self._add(b)


class DefaultPool(Pool):
    """The default allocator's pool (expandable_segments off), to check
    that a trace is read as PyTorch ran it: a block that no free block
    fits gets a segment of its own from cudaMalloc (2 MiB for the small
    pool, 20 MiB up to 10 MiB, else the size in 2 MiB), the rest of a
    large block is split off only above 1 MiB, and segments never
    merge."""

    def __init__(self, sim, small):
        self.sim, self.small, self.free = sim, small, []

    def _grow(self, size):
        if self.small:
            want = PAGE_SMALL
        elif size < 10 << 20:
            want = PAGE_LARGE
        else:
            want = -(-size // PAGE_SMALL) * PAGE_SMALL
        self.sim.reserve(want)
        self.sim.base += VA     # segments lie apart: they never merge
        return Block(self.sim.base, want, True)

    def alloc(self, size):
        i = bisect.bisect_left(self.free, (size, 0))
        if i < len(self.free):
            b = self.free.pop(i)[2]
        else:
            b = self._grow(size)
        rest = b.size - size
        return self._take(b, size, rest >= ALIGN if self.small
                          else rest > SMALL)


class Sim:
    def __init__(self, default=False):
        self.default = default
        self.base = 0               # the last cudaMalloc'd segment's
        self.pools = {}
        self.live = {}              # trace address -> (pool, block, size)
        self.reserved = self.reserved_peak = 0
        self.requested = self.requested_peak = 0

    def reserve(self, n):
        self.reserved += n
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def alloc(self, addr, size, stream):
        if addr in self.live:
            raise TraceError("address %d allocated twice" % addr)
        rsize = max(ALIGN, -(-size // ALIGN) * ALIGN)
        small = rsize <= SMALL
        key = (stream, small)
        pool = self.pools.get(key)
        if pool is None:
            if self.default:
                pool = DefaultPool(self, small)
            else:
                pool = Pool(self, len(self.pools) * (VA << 1),
                            PAGE_SMALL if small else PAGE_LARGE)
            self.pools[key] = pool
        self.live[addr] = (pool, pool.alloc(rsize), size)
        self.requested += size
        self.requested_peak = max(self.requested_peak, self.requested)

    def free(self, addr):
        got = self.live.pop(addr, None)
        if got is None:
            raise TraceError("free of address %d, which is not live" % addr)
        pool, b, size = got
        pool.free_block(b)
        self.requested -= size


def trace_lines(path):
    """(line number, fields) of each event line of a trace, gzipped or
    not; comments and blank lines are skipped."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        for n, line in enumerate(f, 1):
            fld = line.split()
            if fld and not fld[0].startswith("#"):
                yield n, fld


def replay(path, default=False):
    sim = Sim(default)
    for n, fld in trace_lines(path):
        try:
            if fld[0] == "alloc":
                sim.alloc(int(fld[1]), int(fld[2]), fld[3])
            elif fld[0] == "free_completed":
                sim.free(int(fld[1]))
        except TraceError as e:
            raise TraceError("%s:%d: %s" % (path, n, e))
    return sim


def name_of(path):
    base = path.rsplit("/", 1)[-1]
    for ext in (".trace.gz", ".trace", ".gz"):
        if base.endswith(ext):
            return base[:-len(ext)]
    return base


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", metavar="TRACE")
    ap.add_argument("--json", action="store_true",
                    help="one JSON object per trace and line")
    ap.add_argument("--default", action="store_true",
                    help="model PyTorch's default allocator instead")
    args = ap.parse_args(argv)
    if not args.json:
        print("%-22s %9s %9s %6s" % ("trace", "req_GiB", "res_GiB", "frag%"))
    for path in args.traces:
        try:
            sim = replay(path, args.default)
        except (OSError, TraceError, ValueError, IndexError) as e:
            print("expandable_sim: %s" % e, file=sys.stderr)
            return 1
        req, res = sim.requested_peak, sim.reserved_peak
        frag = 100.0 * (1 - req / res) if res else 0.0
        if args.json:
            print(json.dumps({"trace": name_of(path),
                              "allocator": "default" if args.default
                              else "expandable",
                              "peak_requested": req, "peak_reserved": res,
                              "fragmentation_pct": round(frag, 2)}))
        else:
            print("%-22s %9.2f %9.2f %6.2f" % (name_of(path), req / 2**30,
                                                res / 2**30, frag))
    return 0


if __name__ == "__main__":
    sys.exit(main())
