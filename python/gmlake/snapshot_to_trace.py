# SPDX-License-Identifier: MIT
"""Turn a memory snapshot's trace into a gmlake-replay trace.

    python -m gmlake.snapshot_to_trace SNAPSHOT.pickle OUT.trace[.gz]
        [--device N] [--workload NAME] [--steps N] [--keep-unmatched]
        [--trims]

SNAPSHOT.pickle is what torch.cuda.memory._dump_snapshot() (or
gmlake.torch.dump_snapshot()) wrote after
torch.cuda.memory._record_memory_history(): its "device_traces" hold the
allocator's events. The output is the text format gmlake-replay reads
(tools/trace.h): comment lines with key=value words, then one event a
line, "action addr size stream", e.g.

    # pytorch snapshot workload=mine steps=12 peak_alloc=N peak_reserved=N
    # action addr size stream
    segment_alloc 139861348581376 262144000 0
    alloc 139861348581376 262144000 0
    free_completed 139861348581376 262144000 0

Only the allocator's actions go over (alloc, free_requested,
free_completed, segment_alloc/free/map/unmap); snapshot and oom markers
do not. Frees of blocks allocated before recording began are dropped
unless --keep-unmatched, since a replay has nothing to free then.
peak_alloc and peak_reserved in the header are the peaks of the trace's
own running sums. Output ending in .gz is compressed.

Step markers: convert(trace, step_mark=SIZE, settle=FLAGS) turns a run's
marker allocations into step lines. A capture that allocates (and frees)
one block of exactly SIZE bytes right before each training step, a size
no workload asks for, gets each marker's alloc replaced by the line

    step K S 0

where K counts the markers from 0 and S is 1 when settle[K] is true (a
settling step, the first at its shape), else 0 (always 0 when settle is
None). The markers' frees are dropped and their bytes count in no peak.
A step line comes before its step's first event; gmlake-replay prices
the steady steps' driver work (gmlake-replay(1)). With settle given, a
number of markers other than len(settle) is a ValueError: the size was
not the capture's alone, or the trace lost its start.

Long-lived markers: convert(..., long_lived_marks=(ON, OFF)) turns
allocations of exactly ON and OFF bytes into the lines "long_lived 1 0 0"
and "long_lived 0 0 0", which make gmlake-replay call
gmlake_long_lived() as libgmlake's optimizer hooks do around an
optimizer's _init_group (gmlake/optimizer_state.py); their frees are
dropped and their bytes count in no peak. An OFF marker without an ON
before it is a ValueError.

Trim lines: convert(..., trims=True) writes "trim 0 0 0" before each run
of segment_free and segment_unmap events, which make gmlake-replay call
gmlake_trim() there. For the history of PyTorch's own allocators: they
give segments back only when the cache is emptied (torch.cuda.empty_cache,
which PyTorch's cuDNN benchmark calls after each search, or the release
before an out-of-memory retry). libgmlake's history also holds segment
events of its own, which no user asked for: no trims for it.
"""

import argparse
import gzip
import pickle
import sys

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc",
           "segment_free", "segment_map", "segment_unmap")
FREES = ("free_requested", "free_completed")


def _stream(value):
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0


def convert(trace, keep_unmatched=False, step_mark=None, settle=None,
            long_lived_marks=None, trims=False):
    """(events, peak_alloc, peak_reserved) from one device's trace entries
    (dicts with action, addr, size, stream). events: (action, addr, size,
    stream) tuples in order. step_mark: the size of the step markers,
    whose allocs become ("step", k, settle[k] or 0, 0) and whose frees go
    (see the module's doc); None: no markers. long_lived_marks: the sizes
    (ON, OFF) of the long-lived markers, whose allocs become
    ("long_lived", 1 or 0, 0, 0); None: none. trims: a ("trim", 0, 0,
    0) before each run of segment frees and unmaps."""
    if settle is not None and step_mark is None:
        raise ValueError("settle flags without step_mark")
    ll_on, ll_off = long_lived_marks or (None, None)
    if long_lived_marks is not None and \
            len({ll_on, ll_off, step_mark}) != 3:
        raise ValueError("long-lived marker sizes %r must differ from each "
                         "other and from step_mark" % (long_lived_marks,))
    live = {}
    marks = set()   # addresses of the markers live now
    steps = 0
    depth = 0       # long_lived on lines without their off yet
    alloc = reserved = peak_alloc = peak_reserved = 0
    out = []
    releasing = False   # the last event kept was a segment free or unmap
    for e in trace:
        action = e.get("action")
        if action not in ACTIONS:
            continue
        addr, size = int(e.get("addr", 0)), int(e.get("size", 0))
        if action == "alloc" and step_mark is not None and \
                size == step_mark:
            if settle is not None and steps >= len(settle):
                raise ValueError("step marker %d of %d bytes, but %d "
                                 "settle flags" % (steps, size,
                                                   len(settle)))
            flag = 1 if settle is not None and settle[steps] else 0
            out.append(("step", steps, flag, 0))
            marks.add(addr)
            steps += 1
            continue
        if action == "alloc" and long_lived_marks is not None and \
                size in (ll_on, ll_off):
            if size == ll_off and not depth:
                raise ValueError("long-lived off marker (%d bytes) without "
                                 "an on marker before it" % size)
            depth += 1 if size == ll_on else -1
            out.append(("long_lived", 1 if size == ll_on else 0, 0, 0))
            marks.add(addr)
            continue
        if action in FREES and addr in marks:
            if action == "free_completed":
                marks.discard(addr)
            continue
        if action == "alloc":
            marks.discard(addr)     # a marker whose free went unrecorded
            live[addr] = size
            alloc += size
            peak_alloc = max(peak_alloc, alloc)
        elif action in FREES:
            if addr not in live and not keep_unmatched:
                continue
            if action == "free_completed":
                alloc -= live.pop(addr, 0)
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
            peak_reserved = max(peak_reserved, reserved)
        else:
            reserved -= size
            if trims and not releasing:
                out.append(("trim", 0, 0, 0))
        releasing = action in ("segment_free", "segment_unmap")
        out.append((action, addr, size, _stream(e.get("stream"))))
    if settle is not None and steps != len(settle):
        raise ValueError("%d step markers of %d bytes for %d settle flags" %
                         (steps, step_mark, len(settle)))
    return out, peak_alloc, peak_reserved


def write(path, events, header):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        f.write("# %s\n" % " ".join(header))
        f.write("# action addr size stream\n")
        for ev in events:
            f.write("%s %d %d %d\n" % ev)


def load_snapshot(path):
    with open(path, "rb") as f:
        snap = pickle.load(f)
    if not isinstance(snap, dict) or "device_traces" not in snap:
        raise ValueError("%s is not a memory snapshot with a trace (no "
                         "device_traces); record one with "
                         "torch.cuda.memory._record_memory_history() and "
                         "torch.cuda.memory._dump_snapshot()" % path)
    return snap


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m gmlake.snapshot_to_trace",
        description="A memory snapshot's trace as a gmlake-replay trace.")
    p.add_argument("snapshot", help="pickle from _dump_snapshot()")
    p.add_argument("output", help="trace file to write (.gz: compressed)")
    p.add_argument("--device", type=int, default=None,
                   help="which device's trace (default: the first with "
                   "events)")
    p.add_argument("--workload", default="snapshot",
                   help="workload name for the header")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps the trace covers, for the header")
    p.add_argument("--producer", default="pytorch snapshot",
                   help="first words of the header (default: %(default)s)")
    p.add_argument("--keep-unmatched", action="store_true",
                   help="keep frees of blocks allocated before recording")
    p.add_argument("--trims", action="store_true",
                   help="a trim line before each run of segment frees "
                   "(a snapshot of PyTorch's own allocators)")
    ns = p.parse_args(argv)
    try:
        snap = load_snapshot(ns.snapshot)
    except (OSError, ValueError, pickle.UnpicklingError) as e:
        sys.stderr.write("snapshot_to_trace: %s\n" % e)
        return 1
    traces = snap["device_traces"]
    device = ns.device
    if device is None:
        device = next((d for d, t in enumerate(traces) if t), 0)
    if device >= len(traces) or not traces[device]:
        sys.stderr.write("snapshot_to_trace: device %d has no trace events "
                         "in %s\n" % (device, ns.snapshot))
        return 1
    events, peak_alloc, peak_reserved = convert(traces[device],
                                                ns.keep_unmatched,
                                                trims=ns.trims)
    header = [ns.producer, "workload=%s" % ns.workload]
    if ns.steps is not None:
        header.append("steps=%d" % ns.steps)
    header += ["peak_alloc=%d" % peak_alloc,
               "peak_reserved=%d" % peak_reserved]
    write(ns.output, events, header)
    sys.stderr.write("snapshot_to_trace: %d events of device %d to %s\n" %
                     (len(events), device, ns.output))
    return 0


if __name__ == "__main__":
    sys.exit(main())
