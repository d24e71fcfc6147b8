# SPDX-License-Identifier: MIT
"""struct gmlake_stats through ctypes, and the Python views of it."""

import ctypes

from . import _fields
from . import _lib


class Stat(ctypes.Structure):
    """struct gmlake_stat"""
    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64),
                ("total", ctypes.c_int64)]


def _stats_fields():
    ncalls = len(_fields.CALLS)
    f = [("version", ctypes.c_uint32), ("size", ctypes.c_uint32),
         ("chunk_size", ctypes.c_uint64)]
    f += [(name, Stat) for name in _fields.GAUGES]
    f += [(name, ctypes.c_uint64) for name in _fields.COUNTERS]
    f += [("calls", ctypes.c_uint64 * ncalls),
          ("call_ns", ctypes.c_uint64 * ncalls),
          ("call_failures", ctypes.c_uint64 * ncalls),
          ("access_bytes", ctypes.c_uint64),
          ("offload_engine", ctypes.c_int32),
          ("pad0", ctypes.c_int32),
          ("access_handles", ctypes.c_uint64),
          ("reserved", ctypes.c_uint64 * _fields.RESERVED_WORDS)]
    return f


class Stats(ctypes.Structure):
    """struct gmlake_stats"""
    _fields_ = _stats_fields()


def _ctx(lib, device):
    ctx = ctypes.c_void_p()
    rc = lib.gmlake_torch_ctx_get(int(device), ctypes.byref(ctx))
    if rc < 0:
        raise RuntimeError("gmlake: no statistics for device %s: %s" %
                           (device, _lib.last_error(lib)))
    return ctx


def raw_stats(device=0, library=None):
    """struct gmlake_stats of the context serving device (ctypes)."""
    _, lib = _lib.load(library)
    st = Stats(version=_fields.STATS_VERSION, size=ctypes.sizeof(Stats))
    rc = lib.gmlake_stats_get(_ctx(lib, device), ctypes.byref(st))
    if rc < 0:
        raise RuntimeError("gmlake_stats_get: %s" % _lib.last_error(lib))
    return st


def to_dict(st):
    """Flat dict with dotted keys, like torch.cuda.memory_stats()."""
    d = {"chunk_size": st.chunk_size}
    for name in _fields.GAUGES:
        g = getattr(st, name)
        d[name + ".current"] = g.current
        d[name + ".peak"] = g.peak
        d[name + ".total"] = g.total
    for name in _fields.COUNTERS:
        d[name] = getattr(st, name)
    for i, name in enumerate(_fields.CALLS):
        d["calls." + name] = st.calls[i]
        d["call_ns." + name] = st.call_ns[i]
        d["call_failures." + name] = st.call_failures[i]
    d["access_bytes"] = st.access_bytes
    d["access_handles"] = st.access_handles
    d["offload_engine"] = st.offload_engine
    return d


def stats(device=0, library=None):
    """libgmlake's counters for device, as a dict.

    Gauges give NAME.current, NAME.peak and NAME.total (e.g.
    reserved_bytes.peak); counters give NAME; driver calls give
    calls.KIND, call_ns.KIND and call_failures.KIND.
    """
    return to_dict(raw_stats(device, library))


def reset_peak_stats(device=0, library=None):
    """Set every peak to its current value."""
    _, lib = _lib.load(library)
    rc = lib.gmlake_stats_reset_peaks(_ctx(lib, device))
    if rc < 0:
        raise RuntimeError("gmlake_stats_reset_peaks: %s" %
                           _lib.last_error(lib))


def format_bytes(n):
    """1536 -> '1.50 KiB'."""
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return ("%d %s" % (v, unit)) if unit == "B" else \
                ("%.2f %s" % (v, unit))
        v /= 1024
    return "%d B" % n


_SUMMARY_BYTES = (("allocated_bytes", "Allocated memory"),
                  ("resident_bytes", "Allocated, on the device"),
                  ("requested_bytes", "Requested memory"),
                  ("reserved_bytes", "Reserved memory (chunks)"),
                  ("mapped_bytes", "Mapped memory"),
                  ("spilled_bytes", "Spilled to host"))
_SUMMARY_COUNTS = (("active_blocks", "Active blocks"),
                   ("chunks", "Physical chunks"),
                   ("stitched_live", "Live stitched blocks"),
                   ("stitched_cached", "Cached stitched ranges"))


def summary_from_dict(d, device=0):
    """The text of memory_summary() for a stats dict."""
    width = 78
    rule = "|" + "=" * (width - 2) + "|"
    thin = "|" + "-" * (width - 2) + "|"
    row = "| {:<30} | {:>12} | {:>12} | {:>12} |"
    lines = [rule,
             "| {:<74} |".format("libgmlake memory summary, device %d" %
                                 device),
             rule,
             row.format("Metric", "Cur Usage", "Peak Usage", "Tot Alloc"),
             thin]
    for key, label in _SUMMARY_BYTES:
        lines.append(row.format(label, *[format_bytes(d[key + "." + s])
                                         for s in ("current", "peak",
                                                   "total")]))
    lines.append(thin)
    for key, label in _SUMMARY_COUNTS:
        lines.append(row.format(label, *[str(d[key + "." + s])
                                         for s in ("current", "peak",
                                                   "total")]))
    lines.append(thin)
    # The one definition (README, gmlake-replay, bench): the share of the
    # reserved peak that the requested peak leaves unused; never negative.
    peak_res = d["reserved_bytes.peak"]
    frag = max(0.0, (1 - d["requested_bytes.peak"] / peak_res) * 100) \
        if peak_res else 0.0
    for label, value in (("Allocations / frees", "%d / %d" %
                          (d["allocs"], d["frees"])),
                         ("Stitches / reuses", "%d / %d" %
                          (d["stitches"], d["stitch_reuses"])),
                         ("Out-of-memory errors", str(d["ooms"])),
                         ("Chunk size", format_bytes(d["chunk_size"])),
                         ("Fragmentation at peaks",
                          "%.1f %%" % frag)):
        lines.append("| {:<30} | {:>41} |".format(label, value))
    lines.append(rule)
    return "\n".join(lines) + "\n"


def memory_summary(device=0, library=None):
    """A table of the counters, like torch.cuda.memory_summary()."""
    return summary_from_dict(stats(device, library), device)


# ---------------------------------------------------------------------------
# PyTorch's names: struct gmlake_torch_stats (include/gmlake-torch.h)

class TorchStat(ctypes.Structure):
    """struct gmlake_torch_stat"""
    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64),
                ("allocated", ctypes.c_int64), ("freed", ctypes.c_int64)]


class TorchStats(ctypes.Structure):
    """struct gmlake_torch_stats"""
    _fields_ = ([("version", ctypes.c_uint32), ("size", ctypes.c_uint32)] +
                [(name, TorchStat) for name in _fields.TORCH_STATS] +
                [(name, ctypes.c_int64) for name in _fields.TORCH_COUNTS] +
                [("reserved",
                  ctypes.c_uint64 * _fields.TORCH_RESERVED_WORDS)])


POOLS = ("all", "large_pool", "small_pool")
STAT_KINDS = ("current", "peak", "allocated", "freed")


def raw_torch_stats(device=0, library=None):
    """struct gmlake_torch_stats of device (zeros before its first
    allocation)."""
    _, lib = _lib.load(library)
    st = TorchStats(version=_fields.TORCH_STATS_VERSION,
                    size=ctypes.sizeof(TorchStats))
    rc = lib.gmlake_torch_stats_get(int(device), ctypes.byref(st))
    if rc < 0:
        raise RuntimeError("gmlake_torch_stats_get: %s" %
                           _lib.last_error(lib))
    return st


def torch_dict(st):
    """torch.cuda.memory_stats()'s flat dict for a TorchStats.

    libgmlake keeps no small and large pools apart: their entries are 0,
    as PyTorch's cudaMallocAsync backend leaves them.
    """
    d = {}
    for name in _fields.TORCH_STATS:
        s = getattr(st, name)
        for pool in POOLS:
            for kind in STAT_KINDS:
                d["%s.%s.%s" % (name, pool, kind)] = \
                    getattr(s, kind) if pool == "all" else 0
    for name in _fields.TORCH_COUNTS:
        d[name] = getattr(st, name)
    d["max_split_size"] = -1        # as PyTorch's default: no limit
    for name in ("oversize_allocations", "oversize_segments"):
        for kind in STAT_KINDS[:2]:
            d["%s.%s" % (name, kind)] = 0
    return dict(sorted(d.items()))


def torch_memory_stats(device=0, library=None):
    """torch.cuda.memory_stats()'s keys and meaning, from libgmlake."""
    return torch_dict(raw_torch_stats(device, library))
