# SPDX-License-Identifier: MIT
"""The benchmark's pure parts: no torch, tested in make check
(bench/tests/test_benchlib.py).

Definitions used in every table:
  peak allocated  the largest sum of bytes the tensors asked for at one
                  moment (PyTorch: requested_bytes.all.peak; libgmlake:
                  requested_bytes.peak): the same quantity for every
                  allocator, before any rounding;
  peak reserved   the largest device memory the allocator held at one
                  moment (PyTorch: max_memory_reserved(); libgmlake:
                  reserved_bytes.peak, its physical chunks);
  fragmentation   1 - peak allocated / peak reserved, in percent: the
                  share of the reserved peak that no tensor used at the
                  allocated peak. (The two peaks may fall at different
                  moments; both are highs of the same run.)
  driver used     the highest device memory in use seen by the driver
                  (total - free from cudaMemGetInfo, sampled after every
                  step) minus what was in use before the workload began:
                  a cross-check of peak reserved from outside the
                  allocator (it also counts cuBLAS workspaces and other
                  memory the allocator does not serve).
"""

import json
import math
import os
import statistics

ALLOCATORS = ("default", "expandable", "gmlake")
ALLOCATOR_NAMES = {
    "default": "PyTorch default",
    "expandable": "PyTorch expandable segments",
    "gmlake": "libgmlake",
}
GiB = float(1 << 30)

# Workloads that only some allocators can run: name -> (allocators, why).
ONLY = {
    "gpt_offload": (("gmlake",), "gmlake.torch.offload_activations() moves "
                    "libgmlake blocks; not applicable to PyTorch's "
                    "allocators"),
}

# The activation-offload comparison: workload -> how it offloads
# (gpt_keep, the same shapes without offload, is the reference).
OFFLOAD_METHODS = (
    ("gpt_keep", "none: activations kept on the device"),
    ("gpt_save_on_cpu", "torch save_on_cpu(pin_memory=True)"),
    ("gpt_offload", "gmlake offload_activations()"),
)


def applies(workload, allocator):
    """Whether the workload runs under the allocator (see ONLY)."""
    only = ONLY.get(workload)
    return only is None or allocator in only[0]


def fragmentation(peak_allocated, peak_reserved):
    """Percent of the reserved peak not allocated at the allocated peak;
    None when either figure is missing or reserved is 0."""
    if peak_allocated is None or not peak_reserved:
        return None
    if peak_allocated < 0 or peak_reserved < 0:
        raise ValueError("negative memory figures")
    return (1.0 - float(peak_allocated) / float(peak_reserved)) * 100.0


def on_device_peak(r):
    """Peak bytes of live blocks holding device memory: libgmlake's
    resident_bytes peak, else peak allocated where nothing was spilled."""
    if r.get("resident_peak") is not None:
        return r["resident_peak"]
    return None if r.get("spilled_peak") else r.get("peak_allocated")


def result_fragmentation(r):
    """fragmentation() of a result, None where blocks were spilled: a
    spilled block stays allocated while it holds no device memory, so
    allocated over reserved says nothing there."""
    if r.get("spilled_peak"):
        return None
    return fragmentation(r.get("peak_allocated"), r.get("peak_reserved"))


class ShapeCycle:
    """A few shapes drawn once, then visited round after round, each round
    in a new seeded order. Training with variable shapes sees a bounded set
    of them (buckets of batch and sequence length) again and again; the
    first round, where every allocator meets each shape for the first time,
    is the warm-up, and step times are taken from the later rounds."""

    def __init__(self, rng, draw, count):
        self.rng = rng
        self.shapes = distinct_shapes(draw, count)
        self.order = []

    def __len__(self):
        return len(self.shapes)

    def next(self):
        if not self.order:
            self.order = list(self.shapes)
            self.rng.shuffle(self.order)
        return self.order.pop()


def distinct_shapes(draw, count, tries=10000):
    """count different shapes from draw() (a seeded function), in the
    order first drawn; ValueError when draw() does not give that many."""
    shapes = []
    for _ in range(tries):
        if len(shapes) == count:
            break
        shape = draw()
        if shape not in shapes:
            shapes.append(shape)
    if len(shapes) < count:
        raise ValueError("only %d different shapes in %d draws, not %d" %
                         (len(shapes), tries, count))
    return shapes


def shape_sequence(shapes, steps, rng, tries=1000):
    """The shape of each of `steps` steps, drawn at random from `shapes`
    with rng (as a data loader's batches come), every shape at least
    once: the first seeded draw that has them all."""
    if steps < len(shapes):
        raise ValueError("%d steps cannot visit %d shapes" %
                         (steps, len(shapes)))
    keys = {shape_key(s) for s in shapes}
    for _ in range(tries):
        seq = [rng.choice(shapes) for _ in range(steps)]
        if {shape_key(s) for s in seq} == keys:
            return seq
    raise ValueError("no sequence of %d steps visits all %d shapes" %
                     (steps, len(shapes)))


def shape_key(shape):
    """A hashable key of a shape as a step returns it or as results.json
    keeps it (tuples come back from JSON as lists)."""
    return json.dumps(shape, sort_keys=True)


def settle_flags(r):
    """For each step time of result r, whether it is a settling step: the
    first step at its shape (step_shapes), or, in results without shapes,
    among the first `warmup` steps."""
    n = len(r.get("step_times") or [])
    shapes = r.get("step_shapes")
    if shapes is None:
        warm = r.get("warmup", 1)
        return [i < warm for i in range(n)]
    if len(shapes) != n:
        raise ValueError("%s, %s: %d shapes for %d step times" % (
            r.get("workload"), r.get("allocator"), len(shapes), n))
    seen, flags = set(), []
    for s in shapes:
        k = shape_key(s)
        flags.append(k not in seen)
        seen.add(k)
    return flags


def median_ms(step_seconds, skip=1):
    """Median step time in ms, leaving out the first `skip` steps (warm-up)
    when enough steps remain; None without steps."""
    times = list(step_seconds)
    if len(times) > skip + 1:
        times = times[skip:]
    if not times:
        return None
    return statistics.median(times) * 1000.0


def merge_rounds(results):
    """One result per (workload, allocator) from several rounds of the
    same run: the median of the rounds' median step times (each kept in
    step_ms_rounds), the highest of each peak, ok only if every round was,
    out of memory if any round was. Results of one round come back as
    they are."""
    groups = {}
    for r in results:
        groups.setdefault((r["workload"], r["allocator"]), []).append(r)
    merged = []
    for rounds in groups.values():
        if len(rounds) == 1:
            merged.append(rounds[0])
            continue
        m = dict(rounds[0])
        steps = [r.get("step_ms") for r in rounds]
        m["step_ms_rounds"] = steps
        known = [s for s in steps if s is not None]
        m["step_ms"] = statistics.median(known) if known else None
        for k in ("peak_allocated", "peak_reserved", "driver_used",
                  "resident_peak", "spilled_peak"):
            vals = [r[k] for r in rounds if r.get(k) is not None]
            m[k] = max(vals) if vals else None
        m["ok"] = all(r.get("ok") for r in rounds)
        m["oom"] = any(r.get("oom") for r in rounds)
        errors = [r["error"] for r in rounds if r.get("error")]
        if errors:
            m["error"] = errors[0]
        m.pop("step_times", None)
        merged.append(m)
    return merged


def gib(n):
    return None if n is None else n / GiB


def _cell(v, fmt="%.2f"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return fmt % v


def row_values(r):
    """The table cells of one result dict (see bench.py's child)."""
    frag = result_fragmentation(r)
    oom = r.get("oom")
    status = "yes" if oom else ("no" if r.get("ok") else "error")
    if r.get("skipped"):
        status = "not applicable"
    return [r["workload"], ALLOCATOR_NAMES.get(r["allocator"], r["allocator"]),
            _cell(gib(r.get("peak_allocated"))),
            _cell(gib(r.get("peak_reserved"))),
            _cell(gib(r.get("driver_used"))),
            _cell(frag, "%.1f"),
            _cell(r.get("step_ms"), "%.1f"),
            status]


HEADER = ["workload", "allocator", "peak allocated GiB", "peak reserved GiB",
          "driver used GiB", "fragmentation %", "median step ms",
          "out of memory"]


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def results_table(results):
    """Markdown table of workload results, in workload then allocator
    order."""
    order = {a: i for i, a in enumerate(ALLOCATORS)}
    rows = sorted(results, key=lambda r: (r.get("index", 0),
                                          order.get(r["allocator"], 99)))
    return markdown_table(HEADER, [row_values(r) for r in rows])


OFFLOAD_HEADER = ["method", "allocator", "peak reserved GiB",
                  "blocks on device peak GiB",
                  "driver used GiB", "median step ms",
                  "reserved vs save_on_cpu", "step vs save_on_cpu",
                  "spilled GiB", "status"]


def _ratio(a, b):
    if a is None or not b:
        return "n/a"
    return "%.2fx" % (a / b)


def offload_table(results):
    """The GPT activation-offload rows: the same shapes without offload
    (gpt_keep, the reference), save_on_cpu under every allocator and
    gmlake's offload_activations(), each compared with save_on_cpu under
    the same allocator. "Blocks on device" is the peak of live blocks
    holding device memory (libgmlake's resident_bytes; peak allocated
    where nothing spills). None when none of them ran."""
    names = dict(OFFLOAD_METHODS)
    order = {a: i for i, a in enumerate(ALLOCATORS)}
    rows = [r for r in results if r["workload"] in names and
            not r.get("skipped")]
    if not rows:
        return None
    base = {r["allocator"]: r for r in rows
            if r["workload"] == "gpt_save_on_cpu" and r.get("ok")}
    rows.sort(key=lambda r: ([w for w, _ in OFFLOAD_METHODS].index(
        r["workload"]), order.get(r["allocator"], 99)))
    out = []
    for r in rows:
        b = base.get(r["allocator"], {})
        spilled = (r.get("offload") or {}).get("spilled_bytes")
        out.append([names[r["workload"]],
                    ALLOCATOR_NAMES.get(r["allocator"], r["allocator"]),
                    _cell(gib(r.get("peak_reserved"))),
                    _cell(gib(on_device_peak(r))),
                    _cell(gib(r.get("driver_used"))),
                    _cell(r.get("step_ms"), "%.1f"),
                    _ratio(r.get("peak_reserved"), b.get("peak_reserved")),
                    _ratio(r.get("step_ms"), b.get("step_ms")),
                    _cell(gib(spilled)),
                    "out of memory" if r.get("oom") else
                    ("ok" if r.get("ok") else "error")])
    return markdown_table(OFFLOAD_HEADER, out)


SWEEP_HEADER = ["workload", "allocator", "memory cap GiB",
                "sequence lengths", "largest batch that fits",
                "first batch that failed", "trials"]


def sweep_table(sweeps):
    rows = []
    for s in sweeps:
        rows.append([s.get("workload", "?"),
                     ALLOCATOR_NAMES.get(s["allocator"], s["allocator"]),
                     _cell(gib(s.get("cap_bytes"))),
                     " ".join(str(t) for t in s.get("seq") or []) or "?",
                     s.get("best") if s.get("best") is not None else "none",
                     s.get("failed") if s.get("failed") is not None else
                     "none up to the limit",
                     len(s.get("trials", []))])
    return markdown_table(SWEEP_HEADER, rows)


def next_batch(trials, limit):
    """Capacity search: the next batch to try, or None when done.

    trials: [(batch, fits)] so far. Doubles from 1 until a batch fails
    (or limit is reached), then bisects between the largest fit and the
    smallest failure."""
    fits = [b for b, ok in trials if ok]
    fails = [b for b, ok in trials if not ok]
    best = max(fits) if fits else 0
    worst = min(fails) if fails else None
    if worst is None:
        if best >= limit:
            return None
        return min(limit, best * 2 if best else 1)
    if worst - best <= 1:
        return None
    return (best + worst) // 2


def sweep_summary(trials):
    fits = [b for b, ok in trials if ok]
    fails = [b for b, ok in trials if not ok]
    return (max(fits) if fits else None, min(fails) if fails else None)


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def results_markdown(meta, results, sweeps):
    parts = ["# libgmlake benchmark results\n",
             "Command: `%s`\n" % meta.get("command", "?"),
             "GPU: %s (%s GiB); PyTorch %s; CUDA %s; libgmlake %s; %s.\n" % (
                 meta.get("gpu", "?"), _cell(gib(meta.get("gpu_bytes"))),
                 meta.get("torch", "?"), meta.get("cuda", "?"),
                 meta.get("library", "?"), meta.get("date", "?")),
             "Mode: %s. Each allocator ran in its own process, with the same "
             "seeds, shapes and steps; libgmlake with %s.%s\n" % (
                 meta.get("mode", "?"), meta.get("gmlake_env", "?"),
                 " %d rounds, the allocators' order reversed every other "
                 "round: step times are the median of the rounds' medians "
                 "(each in results.json, step_ms_rounds), peaks the highest "
                 "of any round." % meta["rounds"]
                 if meta.get("rounds", 1) > 1 else "")]
    if results:
        parts += ["## Workloads\n", results_table(results),
                  "\n" + DEFINITIONS]
    offload = offload_table(results)
    if offload:
        parts += ["\n## Activation offload (GPT)\n",
                  "The same GPT, shapes and steps, its blocks run under "
                  "torch.autograd.graph.save_on_cpu(pin_memory=True) or "
                  "under gmlake.torch.offload_activations() (libgmlake "
                  "only). Compare peak reserved (a spilled block gives its "
                  "chunks back but stays allocated, so peak allocated does "
                  "not fall) and median step time; ratios are against "
                  "save_on_cpu under the same allocator.\n",
                  offload]
    if sweeps:
        parts += ["\n## Capacity sweep\n",
                  "The largest batch under a fixed memory cap (PyTorch: "
                  "torch.cuda.set_per_process_memory_fraction; libgmlake: "
                  "the same call, through its memory-fraction hook). A "
                  "batch fits when one training step at each of the "
                  "sequence lengths, in the order shown, runs without "
                  "running out of memory; every trial starts from an "
                  "emptied cache. The batch doubles from 1 until a trial "
                  "fails, then bisects.\n",
                  sweep_table(sweeps)]
    notes = meta.get("notes") or []
    if notes:
        parts += ["\n## Notes\n"] + ["- %s\n" % n for n in notes]
    return "\n".join(parts)


DEFINITIONS = """Definitions: *peak allocated* is the largest sum of bytes \
the tensors asked for at one moment (PyTorch's requested_bytes.all.peak, \
libgmlake's requested_bytes.peak); *peak reserved* is the largest device \
memory the allocator held (PyTorch's max_memory_reserved(), libgmlake's \
reserved_bytes.peak); *fragmentation* = 1 - peak allocated / peak \
reserved (n/a where blocks were spilled: they stay allocated without \
device memory); *driver used* is the highest total - free of cudaMemGetInfo \
sampled after each step, minus the use before the workload (a cross-check \
from outside the allocator that also counts cuBLAS workspaces); *median \
step ms* leaves out the warm-up round (one step per distinct shape of a \
variable-shape workload, or the first step at fixed shapes).
"""


def chart(results, path):
    """Bar chart of peak reserved and fragmentation; returns a message."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not available: no chart written"
    workloads = []
    for r in sorted(results, key=lambda r: r.get("index", 0)):
        if r["workload"] not in workloads:
            workloads.append(r["workload"])
    by = {(r["workload"], r["allocator"]): r for r in results}
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(ALLOCATORS)
    for i, a in enumerate(ALLOCATORS):
        xs = [j + i * width for j in range(len(workloads))]
        res = [gib(by.get((w, a), {}).get("peak_reserved")) or 0
               for w in workloads]
        frag = [result_fragmentation(by.get((w, a), {})) or 0
                for w in workloads]
        axes[0].bar(xs, res, width, label=ALLOCATOR_NAMES[a])
        axes[1].bar(xs, frag, width, label=ALLOCATOR_NAMES[a])
    for ax, title in ((axes[0], "peak reserved (GiB)"),
                      (axes[1], "fragmentation (%)")):
        ax.set_title(title)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(workloads))])
        ax.set_xticklabels(workloads, rotation=20)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return "chart written to %s" % path
