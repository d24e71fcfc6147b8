# SPDX-License-Identifier: MIT
"""An optimizer's state moved out of the activations' memory after the
step that made it.

An optimizer makes its state (AdamW: two tensors the size of each
parameter) in its first step, after backward freed the step's
activations, so the allocator puts the state in the holes the
activations left. The next step's activations then find those holes
taken and the allocator grows: new device memory in a step that repeats
a shape (under libgmlake, creates, maps and set-access calls in a steady
step), and a layout that stays fragmented.

settle(optimizer) copies each large state tensor into a new block made
under gmlake_long_lived(3), which libgmlake places in a handle of its own
at the end of its newest segment, past what shorter-lived blocks freed,
and points the tensor at the copy (Tensor.set_): optimizer.state, the
tensor objects and every reference to them stay valid, the old block is
freed, and the holes are the activations' again. With
gmlake.torch.enable(optimizer_state=True) (or
GMLAKE_TORCH_SETTLE_OPTIMIZER=1), a global optimizer step post-hook
(install()) settles each optimizer after the first of its steps that
made state; state made later (a parameter group added,
load_state_dict()) is left where it is, for settle() to move when
called.

Off by default: where the activations do not need the holes the old
state leaves, the moved state is memory added (bench/results/
gpt-settle-h100/: driver time per steady step down by 37-46%, peak
reserved -0.5% to +1.6%).

A tensor is moved only when nothing else can see its memory: a plain
CUDA tensor of at least MIN_BYTES that owns its whole storage and shares
it with no view (PyTorch's storage use count); DTensors and other
subclasses, views and aliased tensors stay. Never while a CUDA graph
captures or torch.compile traces, nor for an optimizer that
gmlake.torch.offload_optimizer() manages: its state lives on the host
between steps at addresses the offloader keeps.
"""

import threading
import warnings
import weakref

from . import _lib

# What gmlake_long_lived(3) places past free memory: blocks of 16 chunks
# (32 MiB at the default chunk size) or more, each in a handle of its own.
# A smaller block would be copied into another hole.
MIN_BYTES = 32 << 20

_lock = threading.Lock()
_settled = weakref.WeakSet()    # optimizers the hook has moved
_hook = None
_base_count = {}                # device index -> use count of a sole owner


def _use_count(torch, t):
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _sole_owner_count(torch, device):
    """The storage use count of a tensor nothing else refers to, measured
    rather than assumed (it counts the storage object asked for)."""
    index = device.index
    if index not in _base_count:
        probe = torch.empty(1, device=device)
        _base_count[index] = _use_count(torch, probe)
    return _base_count[index]


def _movable(torch, t):
    if type(t) is not torch.Tensor or not t.is_cuda or t.requires_grad:
        return False
    nbytes = t.numel() * t.element_size()
    return (nbytes >= MIN_BYTES and not t.is_inference() and
            t.storage_offset() == 0 and t.is_contiguous() and
            t.untyped_storage().nbytes() == nbytes and
            _use_count(torch, t) == _sole_owner_count(torch, t.device))


def _busy(torch):
    """Whether moving now would be recorded instead of done."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and compiler.is_compiling():
        return True
    return torch.cuda.is_current_stream_capturing()


def _offloaded(optimizer):
    return getattr(optimizer, "_gmlake_offloader", None) is not None


def settle(optimizer, library=None):
    """Move optimizer's state tensors past the activations' memory (see
    the module's text); returns how many moved. Copies on the current
    stream. A no-op (0) where libgmlake is not PyTorch's allocator, for
    an offloaded optimizer, and while a CUDA graph captures or
    torch.compile traces."""
    import torch

    from .torch import long_lived   # that module imports this one

    path = library or _lib.enabled_library()
    if path is None or not hasattr(torch._C, "_storage_Use_Count") or \
            _offloaded(optimizer) or _busy(torch):
        return 0
    by_device = {}
    for state in list(optimizer.state.values()):
        if not isinstance(state, dict):
            continue
        for t in state.values():
            if isinstance(t, torch.Tensor) and _movable(torch, t):
                by_device.setdefault(t.device.index, []).append(t)
    moved = 0
    with torch.no_grad():
        for index, tensors in by_device.items():
            with long_lived(index, path):
                for t in tensors:
                    new = torch.empty_like(t)
                    new.copy_(t)
                    t.set_(new)
                    moved += 1
    return moved


def _post_step(optimizer, args, kwargs):
    with _lock:
        if optimizer in _settled:
            return
    if not optimizer.state or _offloaded(optimizer):
        return
    import torch
    if _busy(torch):
        return
    with _lock:
        _settled.add(optimizer)     # once, whatever happens below
    try:
        settle(optimizer)
    except RuntimeError as e:       # out of memory for a copy, ...
        # The state not moved stays valid where it is: training goes on.
        warnings.warn("gmlake: optimizer state left in place: %s" % e,
                      RuntimeWarning, stacklevel=2)


def install():
    """Register the global step post-hook once (gmlake.torch.enable);
    False where this PyTorch has no global optimizer hooks."""
    global _hook
    try:
        from torch.optim.optimizer import \
            register_optimizer_step_post_hook as register
    except ImportError:
        return False
    with _lock:
        if _hook is None:
            _hook = register(_post_step)
    return True
