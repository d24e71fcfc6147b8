# SPDX-License-Identifier: MIT
"""Snapshots and allocation history in PyTorch's memory-snapshot format.

gmlake_snapshot_take() (include/gmlake-snapshot.h) through ctypes, and the
history ring of the PyTorch entry points (gmlake_torch_history_*), made
into the dict torch.cuda.memory._snapshot() returns: "segments" (address,
total_size, allocated_size, active_size, requested_size, stream,
segment_type, segment_pool_id, is_expandable, device, blocks with address,
size, requested_size, state) and "device_traces" (per device, events with
action, addr, size, stream, time_us, frames). That is the file
torch.cuda.memory._dump_snapshot() writes and pytorch.org/memory_viz
reads. Stitched views are segments with is_expandable True; every segment
and block also carries libgmlake's own "gmlake_kind" / "gmlake_state".

With the C++ adapter PyTorch's own functions give the same through
libgmlake; these serve the ctypes path and tests, and need no torch.
"""

import ctypes
import pickle

from . import _fields
from . import _lib

RANGE_KINDS = ("segment", "stitched")
PIECE_STATES = ("free", "allocated", "pending_free", "spilled", "elsewhere")
PIECE_SMALL = 0x1
# PyTorch's block states for libgmlake's piece states.
TORCH_STATE = {
    "free": "inactive",
    "allocated": "active_allocated",
    "spilled": "active_allocated",
    "pending_free": "active_pending_free",
    "elsewhere": "active_pending_free",
}


class SnapRange(ctypes.Structure):
    """struct gmlake_snap_range"""
    _fields_ = [("address", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("kind", ctypes.c_uint32), ("first", ctypes.c_uint32),
                ("count", ctypes.c_uint32), ("pad0", ctypes.c_uint32),
                ("stream", ctypes.c_void_p)]


class SnapPiece(ctypes.Structure):
    """struct gmlake_snap_piece"""
    _fields_ = [("address", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("requested", ctypes.c_uint64), ("state", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("stream", ctypes.c_void_p)]


class Snapshot(ctypes.Structure):
    """struct gmlake_snapshot"""
    _fields_ = [("version", ctypes.c_uint32), ("size", ctypes.c_uint32),
                ("chunk_size", ctypes.c_uint64),
                ("ranges", ctypes.POINTER(SnapRange)),
                ("nranges", ctypes.c_size_t),
                ("pieces", ctypes.POINTER(SnapPiece)),
                ("npieces", ctypes.c_size_t)]


class TorchEvent(ctypes.Structure):
    """struct gmlake_torch_event"""
    _fields_ = [("action", ctypes.c_uint32), ("device", ctypes.c_int32),
                ("addr", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("stream", ctypes.c_void_p),
                ("pool_id", ctypes.c_uint64 * 2), ("time", ctypes.c_uint64),
                ("context", ctypes.c_void_p)]


SNAPSHOT_VERSION = 1


def _device_ctx(lib, device):
    ctx = ctypes.c_void_p()
    if lib.gmlake_torch_ctx_get(int(device), ctypes.byref(ctx)) < 0:
        return None
    return ctx


def _pool_of(lib, device, address):
    pid = (ctypes.c_uint64 * 2)()
    rc = lib.gmlake_torch_pool_of(int(device), ctypes.c_void_p(address), pid)
    return max(rc, 0), (pid[0], pid[1])


def _block(lib, device, p):
    state = PIECE_STATES[p.state] if p.state < len(PIECE_STATES) else \
        "unknown"
    torch_state = TORCH_STATE.get(state, "inactive")
    pool = (0, 0)
    if state in ("allocated", "spilled"):
        where, pool = _pool_of(lib, device, p.address)
        if where == 2:          # parked in its pool: free to PyTorch
            torch_state = "inactive"
            state = "parked"
    return {"address": p.address, "size": p.size,
            "requested_size": p.requested, "state": torch_state,
            "gmlake_state": state, "small": bool(p.flags & PIECE_SMALL),
            "frames": []}, pool


def segments_of_ctx(lib, ctx, device=0):
    """The segments (PyTorch's dicts) of a gmlake_ctx."""
    raw = ctypes.c_void_p()
    rc = lib.gmlake_snapshot_take(ctx, ctypes.byref(raw))
    if rc < 0:
        raise RuntimeError("gmlake_snapshot_take: %s" % _lib.last_error(lib))
    try:
        s = ctypes.cast(raw, ctypes.POINTER(Snapshot)).contents
        if s.version != SNAPSHOT_VERSION:
            raise RuntimeError("gmlake_snapshot_take: version %d, this "
                               "package reads %d" % (s.version,
                                                     SNAPSHOT_VERSION))
        out = []
        for i in range(s.nranges):
            r = s.ranges[i]
            seg = {"device": device, "address": r.address,
                   "total_size": r.size, "stream": r.stream or 0,
                   "segment_type": "large", "segment_pool_id": (0, 0),
                   "is_expandable": r.kind == 1,
                   "gmlake_kind": RANGE_KINDS[r.kind]
                   if r.kind < len(RANGE_KINDS) else "unknown",
                   "allocated_size": 0, "active_size": 0,
                   "requested_size": 0, "blocks": [], "frames": []}
            for j in range(r.first, r.first + r.count):
                b, pool = _block(lib, device, s.pieces[j])
                if pool != (0, 0) and seg["segment_pool_id"] == (0, 0):
                    seg["segment_pool_id"] = pool
                if b["state"] == "active_allocated":
                    seg["allocated_size"] += b["size"]
                    seg["requested_size"] += b["requested_size"]
                if b["state"] != "inactive":
                    seg["active_size"] += b["size"]
                seg["blocks"].append(b)
            out.append(seg)
        return out
    finally:
        lib.gmlake_snapshot_free(raw)


def history(device=0, library=None):
    """The recorded events of device, in PyTorch's trace-entry dicts."""
    _, lib = _lib.load(library)
    n = lib.gmlake_torch_history_read(int(device), None, 0)
    if n < 0:
        raise RuntimeError("gmlake_torch_history_read: %s" %
                           _lib.last_error(lib))
    ev = (TorchEvent * max(n, 1))()
    n = lib.gmlake_torch_history_read(int(device), ev, n)
    out = []
    for e in ev[:max(n, 0)]:
        out.append({"action": _fields.TORCH_ACTIONS[e.action]
                    if e.action < len(_fields.TORCH_ACTIONS) else "unknown",
                    "addr": e.addr, "size": e.size, "stream": e.stream or 0,
                    "time_us": e.time // 1000, "device": e.device,
                    "segment_pool_id": (e.pool_id[0], e.pool_id[1]),
                    "frames": []})
    return out


def snapshot(devices=None, library=None):
    """torch.cuda.memory._snapshot()'s dict for the given devices (default:
    every device libgmlake has a context on)."""
    _, lib = _lib.load(library)
    if devices is None:
        devices = [d for d in range(128) if _device_ctx(lib, d)]
    segments, traces = [], []
    for d in range(max(devices) + 1 if devices else 0):
        traces.append(history(d, library) if d in devices else [])
    for d in devices:
        ctx = _device_ctx(lib, d)
        if ctx is not None:
            segments += segments_of_ctx(lib, ctx, d)
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {"allocator": "libgmlake"}}


def record_memory_history(enabled=True, max_entries=100000,
                          skip_actions=(), clear=False, library=None):
    """Start (or stop) libgmlake's allocation history, as
    torch.cuda.memory._record_memory_history() does for PyTorch's: stopping
    drops what was recorded, as PyTorch's allocator does, so a later start
    records from empty; clear on a start drops it too."""
    _, lib = _lib.load(library)
    if not enabled:
        lib.gmlake_torch_history_stop(True)
        return
    mask = 0
    for name in skip_actions:
        mask |= 1 << _fields.TORCH_ACTIONS.index(name)
    rc = lib.gmlake_torch_history_start(int(max_entries), mask, None,
                                        bool(clear))
    if rc < 0:
        raise RuntimeError("gmlake_torch_history_start: %s" %
                           _lib.last_error(lib))


def dump_snapshot(filename="dump_snapshot.pickle", devices=None,
                  library=None):
    """Write snapshot() as torch.cuda.memory._dump_snapshot() does."""
    with open(filename, "wb") as f:
        pickle.dump(snapshot(devices, library), f)
