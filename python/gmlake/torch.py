# SPDX-License-Identifier: MIT
"""libgmlake as PyTorch's CUDA allocator.

    import gmlake.torch
    gmlake.torch.enable()      # first thing, before any CUDA tensor

or, without editing the script: python -m gmlake.run train.py ARGS...

enable() makes libgmlake the process-wide CUDA allocator, through one of
two backends (backend() says which runs):

"adapter": a C++ implementation of PyTorch's allocator interface
  (csrc/adapter.cpp) that forwards to libgmlake's C API. It is compiled
  once against the installed torch (PyTorch 2.11; see gmlake._adapter)
  and cached. With it PyTorch's own functions work on libgmlake's
  figures: torch.cuda.memory_stats(), memory_allocated(),
  max_memory_reserved(), memory_summary(), reset_peak_memory_stats(),
  torch.cuda.memory._record_memory_history() / _snapshot() /
  _dump_snapshot(), cudnn.benchmark, CUDA graphs (private pools,
  torch.compile(mode="reduce-overhead")) and torch.cuda.MemPool without
  an allocator of its own; out of memory raises
  torch.cuda.OutOfMemoryError at the allocation, with libgmlake's
  message after PyTorch's own "CUDA out of memory." words.
"ctypes": PyTorch's CUDAPluggableAllocator with libgmlake's C entry
  points, where the adapter cannot be built (no compiler or ninja).
  PyTorch's statistics, snapshot and graph functions raise there; use
  gmlake.torch.memory_stats(), gmlake.memory_summary() and
  gmlake.torch.snapshot(). Out of memory shows up as "The tensor has a
  non-zero number of elements, but its data is not allocated yet" at the
  tensor's first use; translate_errors() and the excepthook enable()
  installs name the real cause.

GMLAKE_TORCH_BACKEND=adapter|ctypes|auto (default auto: the adapter if it
builds, else ctypes with a warning) chooses. PyTorch's allocator cannot
be swapped once CUDA is initialized, so enable() refuses then.

offload_activations() (gmlake.activations) is a context manager that
moves the tensors autograd saves to host memory and back in backward:
copied into new tensors on a side stream (gmlake.copy_offload, the
default), or, with same_address=True, spilled through libgmlake's
offload rings and fetched back at the same address:

    with gmlake.torch.offload_activations():
        loss = model(batch)
    loss.backward()

offload_optimizer(optimizer) (gmlake.optimizer) keeps the optimizer's
state (AdamW's moments) on the host between steps: the step runs in
buckets, each fetching its state back to the same addresses, stepping on
the GPU as before and spilling it again; the state comes back ahead of
the step, during the last backward before it.

long_lived() is a context manager inside which each large tensor takes
one new physical handle at the end of libgmlake's memory instead of one
per 2 MiB chunk or a hole other tensors left (gmlake_long_lived(3)): for
parameters as they load.

enable() makes every optimizer's first state past the holes its first
step's activations left (gmlake.optimizer_state: step hooks around
torch.optim's _init_group; not for FSDP2's DTensor parameters), so that
the next steps' activations find them free instead of growing.
enable(optimizer_state=True) or GMLAKE_TORCH_SETTLE_OPTIMIZER=1 also
moves state made elsewhere there after the first step, False or =0
turns the hooks off; settle_optimizer_state(optimizer) moves an
optimizer's state there at any time.
"""

import contextlib
import ctypes
import os
import sys
import threading
import warnings

from . import _adapter, _lib, _snapshot, _stats, _version
from . import optimizer_state as _optimizer_state
from .activations import Offloader, offload_activations  # noqa: F401
from .optimizer import OptimizerOffloader, offload_optimizer  # noqa: F401

ALLOC = "gmlake_torch_alloc"
FREE = "gmlake_torch_free"
# (setter on torch's allocator object, libgmlake symbol)
HOOKS = (("set_reset_fn", "gmlake_torch_empty_cache"),
         ("set_memory_fraction_fn", "gmlake_torch_memory_fraction"),
         ("set_record_stream_fn", "gmlake_torch_record_stream"),
         ("set_init_fn", "gmlake_torch_init"))
NULL_DATA = "data is not allocated yet"
BACKEND_ENV = "GMLAKE_TORCH_BACKEND"
BACKENDS = ("auto", "adapter", "ctypes")
SETTLE_ENV = "GMLAKE_TORCH_SETTLE_OPTIMIZER"
# PyTorch's allocator settings, which do not apply to libgmlake.
ALLOC_CONF_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
SUPPORTED_TORCH = _version.SUPPORTED_TORCH

_lock = threading.Lock()
_allocator = None   # keeps torch's pluggable allocator object alive
_adapter_module = None


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
    return _lib.enabled_library()


def backend():
    """Which backend serves PyTorch: "adapter", "ctypes", or None before
    enable()."""
    return _lib.enabled_backend()


def _warn_alloc_conf():
    for name in ALLOC_CONF_ENV:
        if os.environ.get(name):
            warnings.warn(
                "gmlake: %s=%r is set, but it configures PyTorch's own "
                "allocator and does not apply under libgmlake; libgmlake "
                "reads GMLAKE_* variables (man gmlake(7)), e.g. "
                "GMLAKE_DEVICE_LIMIT for a memory cap." %
                (name, os.environ[name]), RuntimeWarning, stacklevel=3)


def _torch_supported(torch):
    ver = str(getattr(torch, "__version__", ""))
    return any(ver == v or ver.startswith(v + ".") or
               ver.startswith(v + "+") for v in SUPPORTED_TORCH)


def _enable_ctypes(torch, path, lib):
    global _allocator
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


def _enable_adapter(torch, path):
    """Install the C++ adapter; AdapterUnavailable when it cannot be."""
    global _adapter_module
    if not _torch_supported(torch):
        warnings.warn("gmlake: the PyTorch adapter is written for torch %s; "
                      "this is torch %s, so it may not build" %
                      (" or ".join(SUPPORTED_TORCH), torch.__version__),
                      RuntimeWarning, stacklevel=3)
    mod = _adapter.load(torch)
    try:
        mod.install(path)
    except RuntimeError as e:
        if "initialized already" in str(e):
            raise _too_late("PyTorch says: %s" % e) from e
        raise _adapter.AdapterUnavailable("installing it failed: %s" % e) \
            from e
    _adapter_module = mod


def _optimizer_state_mode(value):
    """enable()'s optimizer_state (or, for None, SETTLE_ENV) as "place",
    "copy" or None (no hooks); ValueError naming what is wrong."""
    if value is None:
        env = os.environ.get(SETTLE_ENV, "")
        key = env.strip().lower()
        modes = {"": "place", "place": "place", "1": "copy", "0": None}
        if key not in modes:
            raise ValueError("gmlake.torch.enable: %s=%r is not 1, 0 or "
                             "place" % (SETTLE_ENV, env))
        return modes[key]
    if value is True:
        return "copy"
    if value is False:
        return None
    if value == "place":
        return "place"
    raise ValueError("gmlake.torch.enable: optimizer_state=%r is not "
                     "True, False or \"place\"" % (value,))


def enable(library=None, excepthook=True, backend=None,
           optimizer_state=None):
    """Make libgmlake PyTorch's CUDA allocator; returns the library path.

    library: libgmlake.so or its folder (default: GMLAKE_LIBRARY, then the
    usual places, see gmlake.find_library). backend: "auto" (default, or
    GMLAKE_TORCH_BACKEND), "adapter" (fail if it cannot be built) or
    "ctypes". Calling it again is a no-op. excepthook (ctypes backend):
    wrap sys.excepthook so that an uncaught "data is not allocated yet"
    error after a libgmlake failure also prints the cause.
    optimizer_state: "place" (the default) makes each optimizer's first
    state past the activations' memory where torch.optim makes it
    (global step hooks; gmlake.optimizer_state says how, why, for which
    optimizers and what it measured); True also moves state made
    elsewhere there after the first step; False installs no hook.
    Default: GMLAKE_TORCH_SETTLE_OPTIMIZER (1: True, 0: False, place),
    else "place".
    """
    import torch

    with _lock:
        if _lib.enabled_library():
            return _lib.enabled_library()
        mode = _optimizer_state_mode(optimizer_state)
        choice = backend or os.environ.get(BACKEND_ENV) or "auto"
        if choice not in BACKENDS:
            raise ValueError("gmlake.torch.enable: backend %r is not one of "
                             "%s (%s)" % (choice, ", ".join(BACKENDS),
                                          BACKEND_ENV))
        if torch.cuda.is_initialized():
            raise _too_late("CUDA is already initialized in this process")
        _warn_alloc_conf()
        path, lib = _lib.load(library)
        used = None
        if choice != "ctypes":
            try:
                _enable_adapter(torch, path)
                used = "adapter"
            except _adapter.AdapterUnavailable as e:
                if choice == "adapter":
                    raise
                warnings.warn(
                    "gmlake: the PyTorch adapter is not available (%s); "
                    "using the ctypes backend (CUDAPluggableAllocator), "
                    "under which torch.cuda.memory_stats(), snapshots, CUDA "
                    "graphs and OutOfMemoryError do not work, and an "
                    "allocation that fails can hand PyTorch a tensor with "
                    "no memory (data_ptr() 0) that a later kernel faults "
                    "on; install a C++ compiler and ninja for the "
                    "adapter" % e,
                    RuntimeWarning, stacklevel=2)
        if used is None:
            _enable_ctypes(torch, path, lib)
            used = "ctypes"
        _lib.set_enabled(path, used)
        if mode:
            _optimizer_state.install(copy=mode == "copy")
        if excepthook and used == "ctypes":
            _install_excepthook()
        return path


def memory_stats(device=0, library=None):
    """torch.cuda.memory_stats()'s dict from libgmlake's figures, on either
    backend (with the adapter, torch.cuda.memory_stats() gives the same)."""
    return _stats.torch_memory_stats(device, library or enabled())


def snapshot(library=None):
    """torch.cuda.memory._snapshot()'s dict from libgmlake, on either
    backend: segments and stitched views, with the trace recorded since
    record_memory_history()."""
    return _snapshot.snapshot(library=library or enabled())


def record_memory_history(enabled=True, max_entries=100000, skip_actions=(),
                          clear=False, library=None):
    """libgmlake's allocation history on or off, as
    torch.cuda.memory._record_memory_history(); on the adapter backend,
    PyTorch's function does the same and adds stack traces."""
    _snapshot.record_memory_history(enabled, max_entries, skip_actions,
                                    clear, library or _lib.enabled_library())


def dump_snapshot(filename="dump_snapshot.pickle", library=None):
    """Write snapshot() where torch.cuda.memory._dump_snapshot() would, for
    pytorch.org/memory_viz."""
    _snapshot.dump_snapshot(filename, library=library or enabled())


@contextlib.contextmanager
def long_lived(device=None, library=None):
    """Large tensors made inside take one new physical handle each, at the
    end of libgmlake's memory, instead of one per 2 MiB chunk or a hole
    other tensors left (gmlake_long_lived(3)): for what lives as long as
    the model, such as parameters as they load or the optimizer's state as
    its first step makes it. Nests. device: a CUDA device index (default:
    the current device). A no-op where libgmlake is not PyTorch's
    allocator."""
    path = library or _lib.enabled_library()
    if path is None:
        yield
        return
    _, lib = _lib.load(path)
    if device is None:
        import torch
        device = torch.cuda.current_device()
    rc = lib.gmlake_torch_long_lived(int(device), 1)
    if rc < 0:
        raise RuntimeError("gmlake_torch_long_lived: %s" %
                           _lib.last_error(lib))
    try:
        yield
    finally:
        if lib.gmlake_torch_long_lived(int(device), 0) < 0:
            warnings.warn("gmlake.torch.long_lived: turning it off "
                          "failed: %s" % _lib.last_error(lib),
                          RuntimeWarning, stacklevel=3)


def settle_optimizer_state(optimizer, library=None):
    """Move optimizer's large state tensors into memory of their own at
    the end of libgmlake's (gmlake.optimizer_state.settle): after state
    is made anew (load_state_dict(), a parameter group added), or made
    where enable()'s hooks do not place it (outside _init_group). Returns
    how many tensors moved; 0 where libgmlake is not PyTorch's
    allocator."""
    return _optimizer_state.settle(optimizer, library)


def grow_slack(permille=None, device=None, library=None):
    """libgmlake's growth budget on device (gmlake_grow_slack(3)): how far,
    in thousandths of the most memory the live tensors ever needed at once,
    reserved memory may grow for a request before free memory is stitched
    instead. Lower saves memory for more driver work. permille None only
    reads it. Returns the budget it had; None where libgmlake is not
    PyTorch's allocator."""
    path = library or _lib.enabled_library()
    if path is None:
        return None
    _, lib = _lib.load(path)
    if device is None:
        import torch
        device = torch.cuda.current_device()
    rc = lib.gmlake_torch_grow_slack(int(device),
                                     -1 if permille is None else
                                     int(permille))
    if rc < 0:
        raise ValueError("gmlake_torch_grow_slack: %s" %
                         _lib.last_error(lib))
    return rc


def last_error(library=None):
    """(failures so far, message of the last) of libgmlake's entry points."""
    _, lib = _lib.load(library or _lib.enabled_library())
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
