# SPDX-License-Identifier: MIT
"""The benchmark's pure parts: no torch, tested in make check
(bench/tests/test_benchlib.py).

Definitions used in every table:
  settling step   a step whose shape no earlier step of the workload had
                  (its first step at fixed shapes): the allocator meets
                  the shape for the first time, torch.compile compiles;
  steady step     every other step;
  mean step       the mean time of the steady steps: whatever an
                  allocator pays when shapes come back (breaking and
                  repairing views, mapping again) is in it; pooled over
                  the rounds (each round runs the same steps);
  median step     the median of the same steps;
  spread          (highest - lowest) / mean of the rounds' mean steps;
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
                  memory the allocator does not serve);
  driver time     libgmlake's own count and time of its driver calls
                  (gmlake.stats(), calls.KIND and call_ns.KIND, all its
                  threads together), read after every step.
"""

import json
import math
import os
import statistics
import time

ALLOCATORS = ("default", "expandable", "gmlake")
ALLOCATOR_NAMES = {
    "default": "PyTorch default",
    "expandable": "PyTorch expandable segments",
    "gmlake": "libgmlake",
}
# The allocators libgmlake is measured against: the faster of them.
REFERENCES = ("default", "expandable")
GiB = float(1 << 30)
# results.json: 2 keeps rounds; 1 (no "format") was one run.
FORMAT = 2

# Workloads that only some allocators can run: name -> (allocators, why).
ONLY = {
    "gpt_offload": (("gmlake",), "gmlake.torch.offload_activations() is "
                    "measured on libgmlake; PyTorch's allocators run "
                    "save_on_cpu"),
    "llama_offload": (("gmlake",), "the same, on transformers' Llama"),
}

# The activation-offload comparison: workload -> how it offloads
# (gpt_keep, the same shapes without offload, is the reference).
OFFLOAD_METHODS = (
    ("gpt_keep", "none: activations kept on the device"),
    ("gpt_save_on_cpu", "torch save_on_cpu(pin_memory=True)"),
    ("gpt_offload", "gmlake offload_activations()"),
    ("llama_save_on_cpu", "Llama: torch save_on_cpu(pin_memory=True)"),
    ("llama_offload", "Llama: gmlake offload_activations()"),
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


# ---------------------------------------------------------------------------
# Shapes: what each step of a workload runs at.

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


# The step marker: one block of this size, allocated and freed right
# before each step, becomes the step's line in the trace
# (snapshot_to_trace.convert(step_mark=...)). The trace records the size
# asked for, and 977 bytes (a prime) is one no workload asks for: no
# allocation of the traces in tests/data has it. A workload's block of
# that size would be taken for a marker, and convert() would then refuse
# the count of markers rather than write wrong steps.
STEP_MARK = 977

# The long-lived markers (snapshot_to_trace.convert(long_lived_marks=...)):
# blocks of these sizes, allocated and freed right before and after an
# optimizer's _init_group makes its first state, become "long_lived 1 0 0"
# and "long_lived 0 0 0" lines, where a run under libgmlake has its
# optimizer hooks call gmlake_long_lived(). Primes again, asked for by no
# allocation of the traces in tests/data.
LONG_LIVED_MARKS = (983, 991)


_marking = []    # the torch module mark_long_lived() hooked


def mark_long_lived(torch):
    """Global optimizer step hooks that put a long-lived marker before and
    after each _init_group call of an optimizer's first step, as
    gmlake.optimizer_state's hooks put gmlake_long_lived() there (the same
    optimizers: with plain tensor parameters, outside compiling and
    capture). capture_eco.py's children install them, the unrecorded
    one too so that both allocate alike, and bench.py's under
    BENCH_TRACE. Once per process: a second call (the next workload in
    the same child) adds nothing, where a second set of hooks would mark
    each window twice."""
    if torch in _marking:
        return
    _marking.append(torch)
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    import weakref
    from gmlake import optimizer_state as ostate

    # Optimizers whose state exists: weak, since a child's next workload
    # may build its optimizer where the last one's freed object was.
    done = weakref.WeakSet()

    def marker(size):
        m = torch.empty(size, dtype=torch.uint8, device="cuda")
        del m

    def pre(opt, args, kwargs):
        init_group = getattr(opt, "_init_group", None)
        if opt in done or not callable(init_group) or \
                ostate._subclass_params(torch, opt) or ostate._busy(torch):
            return

        def marked(*a, **k):
            marker(LONG_LIVED_MARKS[0])
            try:
                return init_group(*a, **k)
            finally:
                marker(LONG_LIVED_MARKS[1])
        opt._init_group = marked

    def post(opt, args, kwargs):
        vars(opt).pop("_init_group", None)
        if opt.state:
            done.add(opt)

    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


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


# ---------------------------------------------------------------------------
# One result: a workload under one allocator in one round.

def _ms(seconds):
    return None if seconds is None else seconds * 1000.0


def step_summary(times, flags):
    """Step times (s) and settle_flags() -> mean_ms and median_ms of the
    steady steps, their count, and the settling steps' count and total
    (settle_ms)."""
    steady = [t for t, f in zip(times, flags) if not f]
    settle = [t for t, f in zip(times, flags) if f]
    return dict(mean_ms=_ms(statistics.fmean(steady)) if steady else None,
                median_ms=_ms(statistics.median(steady)) if steady
                else None,
                steady_steps=len(steady), steady_s=sum(steady),
                settle_steps=len(settle), settle_ms=_ms(sum(settle)))


def _add_calls(into, calls):
    for kind, (n, ns) in calls.items():
        c = into.setdefault(kind, [0, 0])
        c[0] += n
        c[1] += ns


def driver_totals(r, flags):
    """libgmlake's driver calls of result r (step_calls: per step
    {kind: [calls, ns]}), summed over the steady and over the settling
    steps; None for results without them (PyTorch's allocators)."""
    per_step = r.get("step_calls")
    if per_step is None:
        return None
    times = r.get("step_times") or []
    t = dict(steady={}, settle={}, steady_steps=0, settle_steps=0,
             steady_s=0.0)
    for calls, f, s in zip(per_step, flags, times):
        _add_calls(t["settle" if f else "steady"], calls)
        if f:
            t["settle_steps"] += 1
        else:
            t["steady_steps"] += 1
            t["steady_s"] += s
    return t


def add_driver_totals(a, b):
    """The sum of two driver_totals() (either may be None)."""
    if a is None or b is None:
        return a or b
    t = dict(steady={}, settle={})
    for part in ("steady", "settle"):
        _add_calls(t[part], a[part])
        _add_calls(t[part], b[part])
    for k in ("steady_steps", "settle_steps", "steady_s"):
        t[k] = a[k] + b[k]
    return t


def driver_rates(t):
    """Per-step figures of driver_totals(): for each call kind in the
    steady steps calls and ms per step and us per call; all kinds' ms per
    steady step, their share of the steady step time (percent), and ms
    per settling step."""
    n = t["steady_steps"]
    kinds = {}
    total_ns = 0
    for kind, (calls, ns) in t["steady"].items():
        total_ns += ns
        if calls and n:
            kinds[kind] = dict(calls_per_step=calls / n,
                               ms_per_step=ns / 1e6 / n,
                               us_per_call=ns / 1e3 / calls)
    settle_ns = sum(ns for _, ns in t["settle"].values())
    return dict(kinds=kinds,
                ms_per_step=total_ns / 1e6 / n if n else None,
                share_pct=total_ns / 1e9 / t["steady_s"] * 100.0
                if t["steady_s"] else None,
                settle_ms_per_step=settle_ns / 1e6 / t["settle_steps"]
                if t["settle_steps"] else None)


def device_allocs_per_step(r, flags):
    """New device memory the allocator asked the driver for, calls per
    steady step: PyTorch's num_device_alloc (step_segments: per step
    [allocs, frees]), libgmlake's mem_create calls."""
    steady = [not f for f in flags]
    n = sum(steady)
    if not n:
        return None
    if r.get("step_segments") is not None:
        return sum(s[0] for s, k in zip(r["step_segments"], steady)
                   if k) / n
    if r.get("step_calls") is not None:
        return sum(c.get("mem_create", [0])[0]
                   for c, k in zip(r["step_calls"], steady) if k) / n
    return None


def status(r):
    if r.get("skipped"):
        return "not applicable"
    if r.get("oom"):
        return "out of memory"
    return "ok" if r.get("ok") else "error"


# ---------------------------------------------------------------------------
# Rounds: results.json, one round per bench.py --round K.

def round_order(allocators, k):
    """The allocators in the order round k (1, 2, ...) runs them: as given
    in odd rounds, reversed in even ones, so that no allocator always
    runs first on a cold machine."""
    if k < 1:
        raise ValueError("rounds count from 1, not %d" % k)
    a = list(allocators)
    return a if k % 2 else a[::-1]


def as_rounds(data):
    """The results.json data in format 2: {"format", "rounds", ...};
    a format 1 file (one run: meta, results, sweeps) as its round 1."""
    if data.get("format") == FORMAT:
        return data
    if "rounds" in data or "results" not in data:
        raise ValueError("not a bench results.json (format %r)" %
                         data.get("format"))
    rnd = dict(data.get("meta") or {}, round=1, complete=True,
               results=data["results"], sweeps=data.get("sweeps") or [])
    return dict(format=FORMAT, rounds=[rnd])


def _workloads(rnd):
    return {r["workload"] for r in rnd.get("results") or []}


def clash(a, b):
    """Whether round records a and b are the same round's run of a
    workload: one number, workloads in common (or neither has any). A
    round may come in parts of different workloads, one call each."""
    if a["round"] != b["round"]:
        return False
    wa, wb = _workloads(a), _workloads(b)
    return bool(wa & wb) or not (wa or wb)


def add_round(data, rnd):
    """data (format 2, or None for a new file) with round record rnd in
    it, in round order; records that clash() with it are replaced.
    Returns (data, whether one was replaced)."""
    data = dict(data or dict(format=FORMAT, rounds=[]))
    keep = [r for r in data["rounds"] if not clash(r, rnd)]
    replaced = len(keep) != len(data["rounds"])
    data["rounds"] = sorted(keep + [rnd], key=lambda r: r["round"])
    return data, replaced


def round_ids(rounds):
    """The round numbers of round records, each once, in order."""
    return sorted({r["round"] for r in rounds})


def merge_data(datas):
    """One format-2 data from several results.json datas: every round
    record of each. The same record twice is kept once; two different
    records of one round and workload are a ValueError (say which file to
    leave out)."""
    out = dict(format=FORMAT, rounds=[])
    for data in datas:
        for rnd in as_rounds(data)["rounds"]:
            text = json.dumps(rnd, sort_keys=True)
            same = [r for r in out["rounds"] if clash(r, rnd)]
            if any(json.dumps(r, sort_keys=True) == text for r in same):
                continue
            if same:
                raise ValueError("round %d twice, with different results "
                                 "(%s)" % (rnd["round"], ", ".join(
                                     sorted(_workloads(rnd))) or "sweep"))
            out, _ = add_round(out, rnd)
    return out


def load_json(path):
    """results.json at path, or in the folder path."""
    if os.path.isdir(path):
        path = os.path.join(path, "results.json")
    with open(path) as f:
        return json.load(f)


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


# Figures of one result that merge() takes the highest of, over rounds.
PEAKS = ("peak_allocated", "peak_reserved", "driver_used", "resident_peak",
         "spilled_peak")


def merge(rounds):
    """One record per (workload, allocator) over the rounds: mean_ms and
    median_ms of the steady steps of every round where it ran to the end
    (pooled), each round's figures under "rounds" (round -> mean_ms,
    median_ms, settle_ms, settle_steps, steady_steps, status), spread_pct,
    settle_ms (the rounds' mean), the highest of each peak and
    fragmentation, pooled driver rates (libgmlake), device allocations
    per steady step, status: ok only if every round was."""
    merged = {}
    for rnd in rounds:
        for r in rnd["results"]:
            key = (r["workload"], r["allocator"])
            m = merged.get(key)
            if m is None:
                m = merged[key] = dict(
                    workload=r["workload"], allocator=r["allocator"],
                    index=r.get("index", 0), rounds={}, note=r.get("note"),
                    _times=[], _driver=None, _allocs=[], _frag=[])
            m["index"] = min(m["index"], r.get("index", 0))
            _merge_one(m, rnd["round"], r)
    out = []
    for m in merged.values():
        _finish(m)
        out.append(m)
    order = {a: i for i, a in enumerate(ALLOCATORS)}
    out.sort(key=lambda m: (m["index"], order.get(m["allocator"], 99)))
    return out


HOST_VIEWS = 2000   # views timed after each step (about 1.5 ms)


def host_view_ns(x, n=HOST_VIEWS):
    """Nanoseconds per x.t() over n of them: a view of a CPU tensor,
    nothing allocated and no device involved, so this process's host
    speed at the moment whatever the allocator (on the GPU machine one
    process ran such a loop 2.2x slower than the next,
    bench/results/host-ed27a83/)."""
    t0 = time.perf_counter_ns()
    for _ in range(n):
        x.t()
    return (time.perf_counter_ns() - t0) / n


class GcClock:
    """Time the interpreter spends in garbage collection, from
    gc.callbacks: `ns` grows by each collection's length. A step far
    slower than its shape's others under every allocator alike (FSDP2's
    second step, bench/results/eco-84db13b/) may be a full collection
    rather than anything the allocator did; step_gc_ms tells."""

    def __init__(self):
        self.ns = 0
        self._t0 = None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        elif self._t0 is not None:
            self.ns += time.perf_counter_ns() - self._t0
            self._t0 = None


def host_speed(r, flags):
    """Median ns per view (step_host_ns) after r's steady steps: the
    process's host speed; None in results that did not time it."""
    ns = [h for h, f in zip(r.get("step_host_ns") or [], flags) if not f]
    return statistics.median(ns) if ns else None


def steady_gc_ms(r, flags):
    """The Python garbage collector's ms inside r's steady steps
    (step_gc_ms), in all; None in results that did not time it."""
    gc_ms = r.get("step_gc_ms")
    if not gc_ms:
        return None
    return sum(g for g, f in zip(gc_ms, flags) if not f)


def _merge_one(m, k, r):
    flags = settle_flags(r)
    times = r.get("step_times") or []
    s = step_summary(times, flags)
    s["host_ns"] = host_speed(r, flags)
    s["gc_ms"] = steady_gc_ms(r, flags)
    if not times and r.get("step_ms") is not None:
        s["median_ms"] = r["step_ms"]       # a merged format-1 result
    s["status"] = status(r)
    if r.get("error"):
        s["error"] = r["error"]
    m["rounds"][k] = s
    if r.get("skipped"):
        m["skipped"] = r["skipped"]
        return
    if not r.get("ok"):
        return
    m["_times"] += [t for t, f in zip(times, flags) if not f]
    m["_driver"] = add_driver_totals(m["_driver"], driver_totals(r, flags))
    a = device_allocs_per_step(r, flags)
    if a is not None:
        m["_allocs"].append(a)
    for p in PEAKS:
        if r.get(p) is not None:
            m[p] = max(m.get(p) or 0, r[p])
    f = result_fragmentation(r)
    if f is not None:
        m["_frag"].append(f)
    if r.get("offload") and "offload" not in m:
        m["offload"] = r["offload"]


def _finish(m):
    times = m.pop("_times")
    rounds = m["rounds"]
    statuses = [s["status"] for s in rounds.values()]
    m["ok"] = all(s == "ok" for s in statuses)
    m["oom"] = "out of memory" in statuses
    m["mean_ms"] = _ms(statistics.fmean(times)) if times else None
    m["median_ms"] = _ms(statistics.median(times)) if times else None
    if not times:
        known = [s["median_ms"] for s in rounds.values()
                 if s["status"] == "ok" and s["median_ms"] is not None]
        m["median_ms"] = statistics.median(known) if known else None
    means = [s["mean_ms"] for s in rounds.values()
             if s["status"] == "ok" and s["mean_ms"] is not None]
    m["spread_pct"] = (max(means) - min(means)) / m["mean_ms"] * 100.0 \
        if len(means) > 1 and m["mean_ms"] else None
    settle = [s["settle_ms"] for s in rounds.values()
              if s["status"] == "ok" and s["settle_steps"]]
    m["settle_ms"] = statistics.fmean(settle) if settle else None
    driver = m.pop("_driver")
    m["driver"] = driver_rates(driver) if driver else None
    allocs = m.pop("_allocs")
    m["device_allocs_per_step"] = statistics.fmean(allocs) if allocs \
        else None
    frag = m.pop("_frag")
    m["fragmentation"] = max(frag) if frag else None
    # What offload_table() and chart() read.
    m["step_ms"] = m["mean_ms"] if m["mean_ms"] is not None \
        else m["median_ms"]


def _ref_mean(by, workload, figure, round_k=None):
    """(allocator, figure) of the faster reference allocator on workload,
    overall or in round round_k; (None, None) when none ran."""
    best = (None, None)
    for a in REFERENCES:
        m = by.get((workload, a))
        if not m:
            continue
        v = m[figure] if round_k is None else \
            (m["rounds"].get(round_k) or {}).get(figure)
        if round_k is not None and \
                (m["rounds"].get(round_k) or {}).get("status") != "ok":
            v = None
        if v is not None and (best[1] is None or v < best[1]):
            best = (a, v)
    return best


def ratios(merged, round_ids):
    """Per workload that libgmlake ran: libgmlake's mean over the faster
    reference allocator's (overall, and in each round its own faster
    one), the worst round, the medians' ratio, and peak reserved over
    expandable segments'."""
    by = {(m["workload"], m["allocator"]): m for m in merged}
    rows = []
    for m in merged:
        if m["allocator"] != "gmlake" or m.get("skipped"):
            continue
        w = m["workload"]
        if not any(by.get((w, a)) and not by[(w, a)].get("skipped")
                   for a in REFERENCES):
            continue    # libgmlake only (ONLY), or no reference ran
        ref, ref_mean = _ref_mean(by, w, "mean_ms")
        _, ref_median = _ref_mean(by, w, "median_ms")
        per = {}
        for k in round_ids:
            g = m["rounds"].get(k) or {}
            _, r = _ref_mean(by, w, "mean_ms", k)
            if g.get("status") == "ok" and g.get("mean_ms") and r:
                per[k] = g["mean_ms"] / r
        exp = by.get((w, "expandable")) or {}
        rows.append(dict(
            workload=w, reference=ref,
            mean=m["mean_ms"] / ref_mean if m["mean_ms"] and ref_mean
            else None,
            rounds=per, worst=max(per.values()) if per else None,
            median=m["median_ms"] / ref_median
            if m["median_ms"] and ref_median else None,
            reserved=m["peak_reserved"] / exp["peak_reserved"]
            if m.get("peak_reserved") and exp.get("peak_reserved")
            else None))
    return rows


# ---------------------------------------------------------------------------
# Tables.

def gib(n):
    return None if n is None else n / GiB


def _cell(v, fmt="%.2f"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return fmt % v


def _x(v):
    return _cell(v, "%.3fx")


def markdown_table(header, rows):
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines) + "\n"


def _name(a):
    return ALLOCATOR_NAMES.get(a, a)


def _status(m, round_ids):
    if m.get("skipped"):
        return "not applicable"
    bad = ["round %s: %s" % (k, m["rounds"][k]["status"])
           for k in round_ids if k in m["rounds"] and
           m["rounds"][k]["status"] != "ok"]
    missing = [str(k) for k in round_ids if k not in m["rounds"]]
    if missing:
        bad.append("not in round " + ", ".join(missing))
    return "; ".join(bad) or "ok"


STEP_HEADER = ["workload", "allocator", "mean step ms",
               "round means ms", "spread %", "median step ms",
               "settling steps", "settling ms", "status"]


def step_table(merged, round_ids):
    """Step times: the mean and median of the steady steps, each round's
    mean (in round order), the spread, the settling steps (per round) and
    their total time (the rounds' mean)."""
    rows = []
    for m in merged:
        if m.get("skipped"):
            continue
        per = [_cell((m["rounds"].get(k) or {}).get("mean_ms"), "%.1f")
               for k in round_ids]
        settle = sorted({s["settle_steps"] for s in m["rounds"].values()})
        rows.append([m["workload"], _name(m["allocator"]),
                     _cell(m["mean_ms"], "%.1f"), " / ".join(per),
                     _cell(m["spread_pct"], "%.1f"),
                     _cell(m["median_ms"], "%.1f"),
                     "/".join(str(s) for s in settle) or "n/a",
                     _cell(m["settle_ms"], "%.0f"),
                     _status(m, round_ids)])
    return markdown_table(STEP_HEADER, rows)


RATIO_HEADER = ["workload", "faster PyTorch allocator",
                "libgmlake mean / its mean", "per round", "worst round",
                "libgmlake median / faster median",
                "peak reserved / expandable's"]


def ratio_table(merged, round_ids):
    rows = []
    for r in ratios(merged, round_ids):
        rows.append([r["workload"],
                     _name(r["reference"]) if r["reference"] else "n/a",
                     _x(r["mean"]),
                     " / ".join(_x(r["rounds"].get(k)) for k in round_ids),
                     _x(r["worst"]), _x(r["median"]), _x(r["reserved"])])
    return markdown_table(RATIO_HEADER, rows)


HOST_HEADER = ["workload", "allocator", "ns per view, per round",
               "libgmlake's / the reference's, per round"]


def host_table(merged, round_ids):
    """Each process's host speed (host_speed(), per round), and
    libgmlake's over that of the faster reference allocator of the same
    round (above 1: libgmlake's process was the slower host). None when
    no result timed it."""
    by = {(m["workload"], m["allocator"]): m for m in merged}

    def ns(m, k):
        return ((m or {}).get("rounds", {}).get(k) or {}).get("host_ns")

    def relative(m, k):
        ref, _ = _ref_mean(by, m["workload"], "mean_ms", k)
        mine, theirs = ns(m, k), ns(by.get((m["workload"], ref)), k)
        return mine / theirs if mine and theirs else None

    if not any(ns(m, k) for m in merged for k in round_ids):
        return None
    rows = []
    for m in merged:
        if m.get("skipped"):
            continue
        rel = " / ".join(_x(relative(m, k)) for k in round_ids) \
            if m["allocator"] == "gmlake" else ""
        rows.append([m["workload"], _name(m["allocator"]),
                     " / ".join(_cell(ns(m, k), "%.0f") for k in round_ids),
                     rel])
    return markdown_table(HOST_HEADER, rows)


GC_HEADER = ["workload", "allocator", "ms in all steady steps, per round",
             "share of the steady steps' time, per round"]


def gc_table(merged, round_ids):
    """Each process's time in Python's garbage collector inside its steady
    steps (steady_gc_ms(), per round) and its share of those steps' time:
    a full collection, hundreds of ms where a large model is loaded, that
    falls into one allocator's steady step and not another's moves the
    means above without the allocator. None when no result timed it."""
    def cell(m, k, what):
        s = (m.get("rounds") or {}).get(k) or {}
        if s.get("gc_ms") is None:
            return None
        if what == "ms":
            return s["gc_ms"]
        steady = s.get("steady_s")
        return 100 * s["gc_ms"] / 1e3 / steady if steady else None

    if not any(cell(m, k, "ms") is not None for m in merged
               for k in round_ids):
        return None
    rows = []
    for m in merged:
        if m.get("skipped"):
            continue
        rows.append([m["workload"], _name(m["allocator"]),
                     " / ".join(_cell(cell(m, k, "ms"), "%.0f")
                                for k in round_ids),
                     " / ".join(_cell(cell(m, k, "share"), "%.2f%%")
                                for k in round_ids)])
    return markdown_table(GC_HEADER, rows)


MEMORY_HEADER = ["workload", "allocator", "peak allocated GiB",
                 "peak reserved GiB", "driver used GiB", "fragmentation %",
                 "device allocations per steady step"]


def memory_table(merged):
    rows = []
    for m in merged:
        if m.get("skipped"):
            continue
        rows.append([m["workload"], _name(m["allocator"]),
                     _cell(gib(m.get("peak_allocated"))),
                     _cell(gib(m.get("peak_reserved"))),
                     _cell(gib(m.get("driver_used"))),
                     _cell(m["fragmentation"], "%.1f"),
                     _cell(m["device_allocs_per_step"], "%.2f")])
    return markdown_table(MEMORY_HEADER, rows)


DRIVER_HEADER = ["workload", "call kind", "calls per steady step",
                 "ms per steady step", "us per call",
                 "share of step time %", "ms per settling step"]


def driver_table(merged):
    """libgmlake's driver calls in the steady steps: a row per workload
    (all kinds), then one per kind, largest time first. None when no
    result has them."""
    rows = []
    for m in merged:
        d = m.get("driver")
        if not d or m["allocator"] != "gmlake":
            continue
        mean = m["mean_ms"]
        rows.append([m["workload"], "all", "%.1f" % sum(
            k["calls_per_step"] for k in d["kinds"].values()),
            _cell(d["ms_per_step"], "%.2f"), "", _cell(d["share_pct"],
                                                        "%.2f"),
            _cell(d["settle_ms_per_step"], "%.1f")])
        kinds = sorted(d["kinds"].items(),
                       key=lambda kv: -kv[1]["ms_per_step"])
        for kind, k in kinds:
            share = k["ms_per_step"] / mean * 100.0 if mean else None
            rows.append(["", kind, "%.1f" % k["calls_per_step"],
                         "%.2f" % k["ms_per_step"],
                         "%.1f" % k["us_per_call"], _cell(share, "%.2f"),
                         ""])
    return markdown_table(DRIVER_HEADER, rows) if rows else None


OFFLOAD_HEADER = ["method", "allocator", "peak reserved GiB",
                  "blocks on device peak GiB",
                  "driver used GiB", "mean step ms",
                  "reserved vs save_on_cpu", "step vs save_on_cpu",
                  "spilled GiB", "status"]


def _ratio(a, b):
    if a is None or not b:
        return "n/a"
    return "%.2fx" % (a / b)


def offload_table(results):
    """The activation-offload rows, GPT's then Llama's: the same shapes
    without offload (gpt_keep, the reference), save_on_cpu under every
    allocator and gmlake's offload_activations(), each compared with its
    model's save_on_cpu under the same allocator. "Blocks on device" is the peak of live blocks
    holding device memory (libgmlake's resident_bytes; peak allocated
    where nothing spills). None when none of them ran."""
    names = dict(OFFLOAD_METHODS)
    order = {a: i for i, a in enumerate(ALLOCATORS)}
    rows = [r for r in results if r["workload"] in names and
            not r.get("skipped")]
    if not rows:
        return None
    # Each model's rows against its own save_on_cpu (gpt_, llama_).
    base = {(r["workload"].split("_")[0], r["allocator"]): r for r in rows
            if r["workload"].endswith("_save_on_cpu") and r.get("ok")}
    rows.sort(key=lambda r: ([w for w, _ in OFFLOAD_METHODS].index(
        r["workload"]), order.get(r["allocator"], 99)))
    out = []
    for r in rows:
        b = base.get((r["workload"].split("_")[0], r["allocator"]), {})
        spilled = (r.get("offload") or {}).get("spilled_bytes")
        out.append([names[r["workload"]], _name(r["allocator"]),
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
        rows.append([s.get("workload", "?"), _name(s["allocator"]),
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


# ---------------------------------------------------------------------------
# results.md

# What every round of one report should share; the header shows each
# once, or every value with a warning where rounds differ.
SHARED = (("gpu", "GPU"), ("torch", "PyTorch"), ("cuda", "CUDA"),
          ("library", "libgmlake"), ("commit", "commit"), ("mode", "mode"),
          ("seed", "seed"), ("gmlake_env", "libgmlake settings"))


def _values(rounds, key):
    vals = []
    for r in rounds:
        v = r.get(key)
        if v is not None and v not in vals:
            vals.append(v)
    return vals


def report_header(rounds):
    """Lines saying what ran, where, and how; warnings where rounds
    differ in what they should share."""
    lines, warn = [], []
    for key, label in SHARED:
        vals = _values(rounds, key)
        if key == "gpu" and rounds and rounds[0].get("gpu_bytes"):
            vals = ["%s (%s GiB)" % (v, _cell(gib(rounds[0]["gpu_bytes"])))
                    for v in vals]
        lines.append("%s: %s" % (label, " / ".join(str(v) for v in vals)
                                 if vals else "?"))
        if len(vals) > 1:
            warn.append("the rounds differ in %s: %s" % (
                label, ", ".join(str(v) for v in vals)))
    return lines, warn


def _fresh_text(rounds):
    """How the rounds split workloads into processes (bench.py --fresh)."""
    fresh = [str(r["round"]) for r in rounds if r.get("fresh")]
    if not fresh:
        return ""
    if len(fresh) == len(rounds):
        return " for each workload (--fresh)"
    return " for each workload in round%s %s (--fresh)" % (
        "" if len(fresh) == 1 else "s", ", ".join(fresh))


def results_markdown(data):
    """results.md of a format-2 data: every round merged."""
    rounds = data["rounds"]
    ids = round_ids(rounds)
    merged = merge(rounds)
    head, warn = report_header(rounds)
    parts = ["# libgmlake benchmark results\n",
             "; ".join(head) + ".\n",
             "%d round%s (%s). Each allocator ran in its own process%s, "
             "with the same seeds, shapes and steps; odd rounds ran the "
             "allocators in the order %s, even rounds in reverse.\n" % (
                 len(ids), "" if len(ids) == 1 else "s",
                 ", ".join(str(k) for k in ids), _fresh_text(rounds),
                 ", ".join(_name(a) for a in (rounds[0].get("order") or
                                              ALLOCATORS)) if rounds
                 else "?")]
    cmds = ["- round %s: `%s`%s%s\n" % (
        r["round"], r.get("command", "?"),
        " (%s, %s s)" % (r.get("date", "?"), _cell(r.get("wall_s"), "%.0f")),
        "" if r.get("complete", True) else ", not complete")
        for r in rounds]
    parts += ["Commands:\n\n" + "".join(cmds)]
    if len(ids) < 3:
        warn.append("fewer than three rounds: the spread says little")
    if any(not m["ok"] and not m.get("skipped") for m in merged):
        warn.append("some workloads failed (status column)")
    if warn:
        parts.append("".join("**Warning:** %s.\n\n" % w for w in warn))
    workloads = [m for m in merged if not m.get("skipped")]
    if workloads:
        parts += ["## Step time\n", step_table(merged, ids),
                  "\n## libgmlake against the faster PyTorch allocator\n",
                  "Ratios of mean step times (below 1: libgmlake is "
                  "faster); *per round* compares each round with its own "
                  "faster PyTorch allocator.\n",
                  ratio_table(merged, ids),
                  "\n## Memory\n",
                  "The highest of the rounds.\n", memory_table(merged)]
        host = host_table(merged, ids)
        if host:
            parts += ["\n## Host speed of each process\n",
                      "The median time of x.t() on a CPU tensor (a view: "
                      "nothing allocated, no device) after each steady "
                      "step, timed apart from the step: the process's "
                      "host speed, which moves between processes whatever "
                      "the allocator. Where libgmlake's process was the "
                      "slower host, a host-bound step's ratio above "
                      "compares hosts as well as allocators.\n", host]
        collector = gc_table(merged, ids)
        if collector:
            parts += ["\n## Python's garbage collector\n",
                      "Time the interpreter spent collecting inside the "
                      "steady steps (gc.callbacks), counted in their "
                      "times above. Since a399bb0 the bench freezes the "
                      "heap built before the timed steps (gc.freeze), so "
                      "that a full collection scans only what the steps "
                      "keep.\n",
                      collector]
        driver = driver_table(merged)
        if driver:
            parts += ["\n## libgmlake driver calls\n",
                      "Calls of each kind libgmlake made per steady step "
                      "(all its threads), their time, and its share of "
                      "the mean steady step; pooled over the rounds.\n",
                      driver]
        parts += ["\n" + DEFINITIONS]
    offload = offload_table(merged)
    if offload:
        parts += ["\n## Activation offload (GPT)\n",
                  "The same GPT, shapes and steps, its blocks run under "
                  "torch.autograd.graph.save_on_cpu(pin_memory=True) or "
                  "under gmlake.torch.offload_activations() (libgmlake "
                  "only). Compare peak reserved (a spilled block gives its "
                  "chunks back but stays allocated, so peak allocated does "
                  "not fall) and mean step time; ratios are against "
                  "save_on_cpu under the same allocator.\n",
                  offload]
    losses = loss_table(rounds)
    if losses:
        parts += ["\n## Loss curves\n",
                  "The largest difference of rank 0's loss at the same "
                  "step between two allocators, per round (same seeds, "
                  "shapes and data).\n", losses]
    coll = collectives_table(rounds)
    if coll:
        parts += ["\n## Collectives\n", coll]
    sweeps = [s for r in rounds for s in r.get("sweeps") or []]
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
    notes, noted = [], set()
    for m in merged:
        if m.get("note") and m["workload"] not in noted:
            noted.add(m["workload"])
            notes.append("%s: %s" % (m["workload"], m["note"]))
    for r in rounds:
        notes += ["round %s: %s" % (r["round"], n)
                  for n in r.get("notes") or []]
    if notes:
        parts += ["\n## Notes\n", "".join("- %s\n" % n for n in notes)]
    return "\n".join(parts)


def loss_table(rounds):
    """Per workload with a loss per step (step_loss: the distributed
    ones) and round: the largest difference between two allocators' loss
    at the same step. PyTorch's two allocators against each other give
    the noise (bf16, NCCL's reduction order); None without such data."""
    pairs = (("gmlake", "default"), ("gmlake", "expandable"),
             ("default", "expandable"))
    rows = []
    for rnd in rounds:
        by = {}
        for r in rnd["results"]:
            if r.get("ok") and r.get("step_loss"):
                by.setdefault(r["workload"], {})[r["allocator"]] = \
                    r["step_loss"]
        for w, losses in by.items():
            cells = []
            for a, b in pairs:
                if a in losses and b in losses:
                    cells.append("%.4f" % max(
                        abs(x - y) for x, y in zip(losses[a], losses[b])))
                else:
                    cells.append("-")
            rows.append([w, str(rnd["round"])] + cells)
    if not rows:
        return None
    return markdown_table(["workload", "round", "libgmlake - default",
                           "libgmlake - expandable",
                           "default - expandable"], rows)


def collectives_table(rounds):
    """dist_collectives: each (collective, MiB)'s mean bus bandwidth
    (algorithm bandwidth on one rank, where the bus carries nothing) per
    allocator over every step of every round, libgmlake's share of the
    faster PyTorch allocator's, and whether libgmlake's tensor was
    stitched; None without such results."""
    gbps, stitched, world = {}, {}, None
    for rnd in rounds:
        for r in rnd["results"]:
            c = r.get("collectives") if r.get("ok") else None
            if not c:
                continue
            world = c["world"]
            key = "busbw" if world > 1 else "algbw"
            for shape, v in c["gbps"].items():
                gbps.setdefault(shape, {}).setdefault(
                    r["allocator"], []).extend(v[key])
            for mib, s in c.get("stitched", {}).items():
                stitched[mib] = stitched.get(mib, True) and s
    if not gbps:
        return None
    rows = []
    for shape in sorted(gbps, key=lambda s: (int(s.split(":")[1]), s)):
        mean = {a: statistics.fmean(v) for a, v in gbps[shape].items() if v}
        refs = [mean[a] for a in REFERENCES if a in mean]
        ratio = mean["gmlake"] / max(refs) if "gmlake" in mean and refs \
            else None
        st = stitched.get(shape.split(":")[1])
        rows.append([shape.replace(":", " ") + " MiB"] +
                    [_cell(mean.get(a), "%.1f") for a in ALLOCATORS] +
                    [_cell(ratio, "%.3f"),
                     "-" if st is None else "yes" if st else "no"])
    return "%s bandwidth, GB/s (%d rank%s)\n\n" % (
        "Bus" if world > 1 else "Algorithm", world,
        "" if world == 1 else "s") + markdown_table(
        ["collective"] + [_name(a) for a in ALLOCATORS] +
        ["libgmlake / faster", "stitched"], rows)


DEFINITIONS = """Definitions: a *settling step* is a step at a shape no \
earlier step of the workload had (the first step at fixed shapes); every \
other step is *steady*. *Mean step ms* is the mean of all steady steps of \
all rounds, so a cost paid when a shape comes back is in it; *median step \
ms* is their median; *round means* are each round's mean, in round \
order, and *spread* is (highest - lowest) / mean of them; *settling ms* \
is the settling steps' total time (the rounds' mean), where torch.compile \
compiles. *Peak allocated* is the largest sum of bytes the tensors asked \
for at one moment (PyTorch's requested_bytes.all.peak, libgmlake's \
requested_bytes.peak); *peak reserved* is the largest device memory the \
allocator held (PyTorch's max_memory_reserved(), libgmlake's \
reserved_bytes.peak); *fragmentation* = 1 - peak allocated / peak \
reserved (n/a where blocks were spilled: they stay allocated without \
device memory); *driver used* is the highest total - free of \
cudaMemGetInfo sampled after each step, minus the use before the workload \
(a cross-check from outside the allocator that also counts cuBLAS \
workspaces); *device allocations per steady step* are PyTorch's \
num_device_alloc and libgmlake's mem_create calls. libgmlake's *driver \
calls* are its own counts and times (gmlake.stats(), read after every \
step).
"""


def console_summary(data):
    """The step and ratio tables of data, for the terminal."""
    rounds = data["rounds"]
    ids = round_ids(rounds)
    merged = merge(rounds)
    return step_table(merged, ids) + "\n" + ratio_table(merged, ids)


def _chart_frag(r):
    return r["fragmentation"] if "rounds" in r else result_fragmentation(r)


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
        frag = [_chart_frag(by.get((w, a), {})) or 0 for w in workloads]
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
