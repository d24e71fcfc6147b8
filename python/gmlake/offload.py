# SPDX-License-Identifier: MIT
"""libgmlake's offload rings from Python (include/gmlake-offload.h).

Ring wraps one struct gmlake_offload: take an entry, prepare it, tag it,
submit, reap completions, exactly as in C (gmlake_offload_init(3)):

    ring = Ring(ctx, entries=64)
    sqe = ring.get_sqe()
    ring.prep_spill(sqe, ptr)          # or prep_fetch, prep_prefetch
    ring.set_data(sqe, 42)
    ring.submit()
    user_data, res = ring.reap()       # wait + copy + seen; res 0 or -errno
    ring.exit()

The ctypes structs below must match the C header byte for byte;
python/tests compares them with what the C compiler says
(tests/offload_layout), so a change on one side only fails the tests.
Functions that fail raise OffloadError (a RuntimeError with .errno) whose
message is gmlake_last_error()'s.

For PyTorch, gmlake.torch.offload_activations() builds on this: see
gmlake.activations for its design.
"""

import ctypes
import errno as _errno
import os
import threading

from . import _lib

# enum gmlake_offload_op
NOP = 0
SPILL = 1
FETCH = 2
PREFETCH = 3
# gmlake_offload_init flags, sqe flags
INPLACE = 1 << 0
SQE_INPLACE = 1 << 0
# enum gmlake_advice
ADVISE_NOT_OFFLOADABLE = 0
ADVISE_OFFLOADABLE = 1
# enum gmlake_offload_where
RESIDENT = 0
SPILLING = 1
SPILLED = 2
FETCHING = 3
STATE_NAMES = {RESIDENT: "resident", SPILLING: "spilling",
               SPILLED: "spilled", FETCHING: "fetching"}
# What the Python offloaders count each operation as.
OP_STATS = {SPILL: "spills", FETCH: "fetches", PREFETCH: "prefetches"}
MAX_ENTRIES = 4096


class Sqe(ctypes.Structure):
    """struct gmlake_offload_sqe"""
    _fields_ = [("opcode", ctypes.c_uint8),
                ("flags", ctypes.c_uint8),
                ("pad0", ctypes.c_uint16),
                ("pad1", ctypes.c_uint32),
                ("addr", ctypes.c_uint64),
                ("user_data", ctypes.c_uint64),
                ("reserved", ctypes.c_uint64 * 2)]


class Cqe(ctypes.Structure):
    """struct gmlake_offload_cqe"""
    _fields_ = [("user_data", ctypes.c_uint64),
                ("res", ctypes.c_int32),
                ("flags", ctypes.c_uint32)]


class Offload(ctypes.Structure):
    """struct gmlake_offload (the library's fields)"""
    _fields_ = [("priv", ctypes.c_void_p),
                ("reserved", ctypes.c_uint64 * 3)]


class OffloadError(RuntimeError):
    """A ring call or a request failed; .errno is the positive errno."""

    def __init__(self, message, err=0):
        super().__init__(message)
        self.errno = err


def errno_name(res):
    """-12 -> 'ENOMEM' (the C library's names: EOPNOTSUPP, not ENOTSUP)."""
    if res >= 0:
        return str(res)
    if -res == _errno.EOPNOTSUPP:
        return "EOPNOTSUPP"
    return _errno.errorcode.get(-res, str(res))


def describe(res):
    """A completion's res in words: -12 -> 'ENOMEM (Cannot allocate ...)'."""
    if res >= 0:
        return "ok"
    return "%s (%s)" % (errno_name(res), os.strerror(-res))


_declared = set()
_declare_lock = threading.Lock()


def _declare(lib):
    """Prototypes of the offload functions on lib (once per library)."""
    with _declare_lock:
        if id(lib) in _declared:
            return lib
        c = ctypes
        ring_p = c.POINTER(Offload)
        sqe_p = c.POINTER(Sqe)
        cqe_p = c.POINTER(Cqe)
        sigs = {
            "gmlake_offload_init": (c.c_int, [ring_p, c.c_void_p, c.c_uint,
                                              c.c_uint]),
            "gmlake_offload_exit": (c.c_int, [ring_p]),
            "gmlake_offload_get_sqe": (sqe_p, [ring_p]),
            "gmlake_offload_prep_spill": (None, [sqe_p, c.c_void_p]),
            "gmlake_offload_prep_fetch": (None, [sqe_p, c.c_void_p]),
            "gmlake_offload_prep_prefetch": (None, [sqe_p, c.c_void_p]),
            "gmlake_offload_sqe_set_data": (None, [sqe_p, c.c_uint64]),
            "gmlake_offload_cqe_get_data": (c.c_uint64, [cqe_p]),
            "gmlake_offload_submit": (c.c_int, [ring_p]),
            "gmlake_offload_wait_cqe": (c.c_int, [ring_p,
                                                  c.POINTER(cqe_p)]),
            "gmlake_offload_peek_cqe": (c.c_int, [ring_p,
                                                  c.POINTER(cqe_p)]),
            "gmlake_offload_cqe_seen": (None, [ring_p, cqe_p]),
            "gmlake_advise": (c.c_int, [c.c_void_p, c.c_void_p, c.c_int]),
            "gmlake_offload_state": (c.c_int, [c.c_void_p, c.c_void_p]),
        }
        try:
            for name, (res, args) in sigs.items():
                fn = getattr(lib, name)
                fn.restype = res
                fn.argtypes = args
        except AttributeError as e:
            raise _lib.LibraryNotFoundError(
                "this libgmlake has no offload manager (%s)" % e) from e
        _declared.add(id(lib))
        return lib


def _library(library=None):
    if library is not None and not isinstance(library, (str, bytes,
                                                        os.PathLike)):
        return _declare(library)            # a ctypes.CDLL already
    _, lib = _lib.load(library or _lib.enabled_library())
    return _declare(lib)


def _fail(lib, what, rc):
    msg = _lib.last_error(lib) or os.strerror(-rc)
    return OffloadError("%s: %s (%s)" % (what, msg, errno_name(rc)), -rc)


def torch_context(device, library=None):
    """The gmlake_ctx (a ctypes.c_void_p) serving a PyTorch device."""
    lib = _library(library)
    ctx = ctypes.c_void_p()
    rc = lib.gmlake_torch_ctx_get(int(device), ctypes.byref(ctx))
    if rc < 0:
        raise _fail(lib, "gmlake_torch_ctx_get(device %d)" % device, rc)
    return ctx


def _ctx_arg(ctx):
    return ctx if isinstance(ctx, ctypes.c_void_p) else ctypes.c_void_p(ctx)


def state(ctx, ptr, library=None):
    """RESIDENT, SPILLING, SPILLED or FETCHING of the block at ptr."""
    lib = _library(library)
    rc = lib.gmlake_offload_state(_ctx_arg(ctx), ctypes.c_void_p(ptr))
    if rc < 0:
        raise _fail(lib, "gmlake_offload_state(%#x)" % ptr, rc)
    return rc


def advise(ctx, ptr, advice, library=None):
    """gmlake_advise: ADVISE_OFFLOADABLE or ADVISE_NOT_OFFLOADABLE."""
    lib = _library(library)
    rc = lib.gmlake_advise(_ctx_arg(ctx), ctypes.c_void_p(ptr), int(advice))
    if rc < 0:
        raise _fail(lib, "gmlake_advise(%#x, %d)" % (ptr, advice), rc)


class Ring:
    """One offload ring on a context (gmlake_offload_init(3)).

    ctx: a gmlake_ctx pointer (int or ctypes.c_void_p); entries: 1 to
    4096; flags: 0 or INPLACE. Usable as a context manager (exit() at the
    end). Not for use by several threads at once without a lock of the
    caller's: a completion pointer is valid only until seen().
    """

    def __init__(self, ctx, entries=64, flags=0, library=None):
        self.lib = _library(library)
        self.ctx = _ctx_arg(ctx)
        self.entries = entries
        self.flags = flags
        self._ring = Offload()
        rc = self.lib.gmlake_offload_init(ctypes.byref(self._ring),
                                          self.ctx, entries, flags)
        if rc < 0:
            raise _fail(self.lib, "gmlake_offload_init(%d entries, flags "
                        "%#x)" % (entries, flags), rc)
        self._open = True

    def _live(self):
        if not self._open:
            raise OffloadError("offload ring used after exit()", _errno.EINVAL)
        return ctypes.byref(self._ring)

    def get_sqe(self):
        """A free entry (a ctypes pointer to Sqe), or None when full."""
        sqe = self.lib.gmlake_offload_get_sqe(self._live())
        return sqe if sqe else None

    def prep_spill(self, sqe, ptr, inplace=False):
        self.lib.gmlake_offload_prep_spill(sqe, ctypes.c_void_p(ptr))
        if inplace:
            sqe.contents.flags |= SQE_INPLACE

    def prep_fetch(self, sqe, ptr):
        self.lib.gmlake_offload_prep_fetch(sqe, ctypes.c_void_p(ptr))

    def prep_prefetch(self, sqe, ptr):
        self.lib.gmlake_offload_prep_prefetch(sqe, ctypes.c_void_p(ptr))

    def prep(self, sqe, op, ptr, inplace=False):
        """prep_spill, prep_fetch or prep_prefetch, by op."""
        if op == SPILL:
            self.prep_spill(sqe, ptr, inplace)
        elif op == FETCH:
            self.prep_fetch(sqe, ptr)
        else:
            self.prep_prefetch(sqe, ptr)

    def set_data(self, sqe, user_data):
        self.lib.gmlake_offload_sqe_set_data(sqe, user_data)

    def sqe_or_reap(self, complete):
        """A free entry. When the queue is full, the prepared entries are
        handed in first, and if that frees none, one completion is reaped
        into complete(user_data, res)."""
        sqe = self.get_sqe()
        while sqe is None:
            self.submit()
            sqe = self.get_sqe()
            if sqe is None:
                complete(*self.reap())
                sqe = self.get_sqe()
        return sqe

    def reap_ready(self, complete):
        """complete(user_data, res) for every completion waiting now."""
        while True:
            got = self.reap(wait=False)
            if got is None:
                return
            complete(*got)

    def submit(self):
        """Hand the prepared entries in; how many went."""
        rc = self.lib.gmlake_offload_submit(self._live())
        if rc < 0:
            raise _fail(self.lib, "gmlake_offload_submit", rc)
        return rc

    def _next(self, fn, name, quiet):
        cqe = ctypes.POINTER(Cqe)()
        rc = fn(self._live(), ctypes.byref(cqe))
        if rc == -_errno.EAGAIN and quiet:
            return None
        if rc < 0:
            raise _fail(self.lib, name, rc)
        return cqe

    def wait(self):
        """The next completion (a ctypes pointer to Cqe), waiting for one.
        OffloadError (EAGAIN) when nothing is in flight."""
        return self._next(self.lib.gmlake_offload_wait_cqe,
                          "gmlake_offload_wait_cqe", False)

    def peek(self):
        """The next completion, or None when none is waiting."""
        return self._next(self.lib.gmlake_offload_peek_cqe,
                          "gmlake_offload_peek_cqe", True)

    def seen(self, cqe):
        """Done with the completion wait() or peek() gave."""
        self.lib.gmlake_offload_cqe_seen(self._live(), cqe)

    def reap(self, wait=True):
        """(user_data, res) of the next completion, marked seen; None when
        wait is false and none is waiting."""
        cqe = self.wait() if wait else self.peek()
        if cqe is None:
            return None
        c = cqe.contents
        out = (c.user_data, c.res)
        self.seen(cqe)
        return out

    def exit(self):
        """Wait for the requests in flight and free the ring."""
        if not self._open:
            return
        rc = self.lib.gmlake_offload_exit(ctypes.byref(self._ring))
        if rc < 0:
            raise _fail(self.lib, "gmlake_offload_exit", rc)
        self._open = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.exit()
        return False


__all__ = ["ADVISE_NOT_OFFLOADABLE", "ADVISE_OFFLOADABLE", "Cqe", "FETCH",
           "FETCHING", "INPLACE", "NOP", "Offload", "OffloadError",
           "PREFETCH", "RESIDENT", "Ring", "SPILL", "SPILLED", "SPILLING",
           "SQE_INPLACE", "Sqe", "advise", "describe", "state",
           "torch_context"]
