# SPDX-License-Identifier: MIT
"""libgmlake as PyTorch's CUDA allocator.

    import gmlake.torch
    gmlake.torch.enable()      # first thing, before any CUDA tensor

enable() hands libgmlake's entry points to
torch.cuda.memory.CUDAPluggableAllocator and makes it the process-wide
allocator (change_current_allocator), with the optional hooks PyTorch
exposes to Python: empty_cache, set_per_process_memory_fraction and
Tensor.record_stream. PyTorch's allocator cannot be swapped once CUDA is
initialized, so enable() refuses with an explanation then.

With a pluggable allocator torch.cuda.memory_stats() and memory_summary()
raise; use gmlake.stats() and gmlake.memory_summary().

Out of memory: PyTorch does not check the pointer an allocator returns,
so libgmlake's failure shows up as "The tensor has a non-zero number of
elements, but its data is not allocated yet" at the tensor's first use.
libgmlake prints the real cause to stderr at once; translate_errors()
and the excepthook enable() installs turn it into an OutOfMemoryError
naming the request and the allocator's state.

offload_activations() (gmlake.activations) is a context manager that
spills the tensors autograd saves to host memory through libgmlake's
offload rings and fetches them back, at the same address, in backward:

    with gmlake.torch.offload_activations():
        loss = model(batch)
    loss.backward()
"""

import contextlib
import ctypes
import sys
import threading

from . import _lib
from .activations import Offloader, offload_activations  # noqa: F401

ALLOC = "gmlake_torch_alloc"
FREE = "gmlake_torch_free"
# (setter on torch's allocator object, libgmlake symbol)
HOOKS = (("set_reset_fn", "gmlake_torch_empty_cache"),
         ("set_memory_fraction_fn", "gmlake_torch_memory_fraction"),
         ("set_record_stream_fn", "gmlake_torch_record_stream"),
         ("set_init_fn", "gmlake_torch_init"))
NULL_DATA = "data is not allocated yet"

_lock = threading.Lock()
_enabled = None     # the library path once enabled
_allocator = None   # keeps torch's allocator object alive


class OutOfMemoryError(RuntimeError):
    """libgmlake could not allocate; the message says how much and why.

    When torch is importable this is also a torch.cuda.OutOfMemoryError
    (see _oom_class()), so existing handlers catch it.
    """


def _oom_class():
    try:
        import torch
        base = getattr(torch.cuda, "OutOfMemoryError", None)
    except ImportError:
        base = None
    if base is None or not isinstance(base, type):
        return OutOfMemoryError
    return type("OutOfMemoryError", (OutOfMemoryError, base), {})


def _too_late(why):
    return RuntimeError(
        "gmlake.torch.enable() was called too late: %s. PyTorch's allocator "
        "can only be replaced before CUDA is initialized. Call "
        "gmlake.torch.enable() at the very start of the program, before any "
        "CUDA tensor is made (.cuda(), .to('cuda'), device='cuda') and "
        "before torch.cuda calls that initialize CUDA." % why)


def enabled():
    """The path of the libgmlake in use, or None."""
    return _enabled


def enable(library=None, excepthook=True):
    """Make libgmlake PyTorch's CUDA allocator; returns the library path.

    library: libgmlake.so or its folder (default: GMLAKE_LIBRARY, then the
    usual places, see gmlake.find_library). Calling it again is a no-op.
    excepthook: wrap sys.excepthook so that an uncaught "data is not
    allocated yet" error after a libgmlake failure also prints the cause.
    """
    global _enabled, _allocator
    import torch

    with _lock:
        if _enabled:
            return _enabled
        if torch.cuda.is_initialized():
            raise _too_late("CUDA is already initialized in this process")
        path, lib = _lib.load(library)
        alloc = torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC, FREE)
        raw = alloc.allocator()
        for setter, symbol in HOOKS:
            fn = getattr(raw, setter, None)
            if fn is not None:
                fn(ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value)
        # PyTorch ran the init hook while building the allocator, before
        # set_init_fn could install it: call it here.
        lib.gmlake_torch_init(int(torch.cuda.device_count()))
        try:
            torch.cuda.memory.change_current_allocator(alloc)
        except RuntimeError as e:
            raise _too_late("PyTorch says: %s" % e) from e
        _allocator = alloc
        _enabled = path
        if excepthook:
            _install_excepthook()
        return path


def last_error(library=None):
    """(failures so far, message of the last) of libgmlake's entry points."""
    _, lib = _lib.load(library or _enabled)
    return _lib.torch_error(lib)


def error_for(exc, since=0, library=None):
    """An OutOfMemoryError for exc when libgmlake failed after `since`.

    exc: an exception PyTorch raised; since: last_error()[0] before the
    work that raised it. None when libgmlake has nothing to add.
    """
    n, msg = last_error(library)
    if n <= since or not msg:
        return None
    if "out of memory" in msg:
        return _oom_class()("libgmlake: " + msg)
    if NULL_DATA in str(exc):
        return RuntimeError("libgmlake: " + msg)
    return None


@contextlib.contextmanager
def translate_errors(library=None):
    """Re-raise a PyTorch error caused by a libgmlake failure in the block
    as OutOfMemoryError (or RuntimeError) carrying libgmlake's message."""
    since = last_error(library)[0]
    try:
        yield
    except RuntimeError as e:
        better = error_for(e, since, library)
        if better is None:
            raise
        raise better from e


def _install_excepthook():
    previous = sys.excepthook

    def hook(kind, value, tb):
        previous(kind, value, tb)
        try:
            if value is not None and NULL_DATA in str(value):
                n, msg = last_error()
                if n:
                    sys.stderr.write("\nThe cause, from libgmlake: %s\n" %
                                     msg)
        except Exception:  # never let the hook hide the first error
            pass

    sys.excepthook = hook
