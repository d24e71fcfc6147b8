# SPDX-License-Identifier: MIT
"""An optimizer's state made past the activations' memory.

An optimizer makes its state (AdamW: two tensors the size of each
parameter) in its first step, after backward freed the step's
activations, so the allocator puts the state in the holes the
activations left. The next step's activations then find those holes
taken and the allocator grows: new device memory in a step that repeats
a shape (under libgmlake, creates, maps and set-access calls in a steady
step), and a layout that stays fragmented.

gmlake.torch.enable() installs global optimizer step hooks (install())
that make each optimizer's first state under gmlake_long_lived(3), which
libgmlake places in handles of their own at the end of its newest
segment, past the holes: a step pre-hook wraps the optimizer's
_init_group (where torch.optim's Adam, AdamW, Adamax, NAdam, RAdam,
RMSprop and Adadelta make their state) in long_lived() until the step
that made state ends. That is the default ("place"): on an H100 it took
the bench's GPT workloads' steady driver time from 1.4-2.0% of a step to
0.55-0.91% at no cost in peak reserved memory
(bench/results/gpt-place-h100/). An optimizer with a parameter of a
tensor subclass (FSDP2's DTensors) is left alone: placed there, FSDP2's
state made its largest blocks (fp32 logits) stitch and repair
(bench/results/eco-place-h100/).

With enable(optimizer_state=True) (or GMLAKE_TORCH_SETTLE_OPTIMIZER=1),
state made elsewhere (SGD's momentum in its step, Adagrad's when it is
built, a custom optimizer's, or all of it where this PyTorch's optimizers
have no _init_group) is moved there too by the post-hook after that
step: copied into a block made under long_lived and the tensor pointed
at it (Tensor.set_), which leaves its old place free as memory added
where the activations may not need it (so not by default).
enable(optimizer_state=False) or GMLAKE_TORCH_SETTLE_OPTIMIZER=0
installs no hook. State made later (a parameter group added,
load_state_dict()) is left where it is, for settle() to move when called.

settle(optimizer) does the moving for any optimizer, at any time:
optimizer.state, the tensor objects and every reference to them stay
valid, the old block is freed.

A tensor is moved only when nothing else can see its memory: a plain
CUDA tensor of at least MIN_BYTES that owns its whole storage and shares
it with no view (PyTorch's storage use count); DTensors and other
subclasses, views and aliased tensors stay. Nothing is placed or moved
while a CUDA graph captures or torch.compile traces, nor for an
optimizer that gmlake.torch.offload_optimizer() manages: its state lives
on the host between steps at addresses the offloader keeps.
"""

import contextlib
import threading
import warnings
import weakref

from . import _lib

# What gmlake_long_lived(3) places past free memory: blocks of 16 chunks
# (32 MiB at the default chunk size) or more, each in a handle of its own.
# A smaller block would be copied into another hole.
MIN_BYTES = 32 << 20

_lock = threading.Lock()
_settled = weakref.WeakSet()    # optimizers the hooks are done with
_placed = weakref.WeakKeyDictionary()   # optimizer -> ids made in place
_hooks = None
_copy = False                   # the post-hook moves state made elsewhere
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
    return _settle(optimizer, library, ())


def _settle(optimizer, library, skip):
    """settle(), leaving the tensors whose id() is in skip."""
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
            if isinstance(t, torch.Tensor) and id(t) not in skip and \
                    _movable(torch, t):
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


def _state_ids(torch, optimizer, params):
    ids = set()
    for p in params:
        state = optimizer.state.get(p)
        if isinstance(state, dict):
            ids.update(id(t) for t in state.values()
                       if isinstance(t, torch.Tensor))
    return ids


def _placing(optimizer, init_group):
    """init_group (the optimizer's bound _init_group) run under
    long_lived() on its group's CUDA devices; the ids of the state
    tensors it made go to _placed."""
    from .torch import long_lived

    def placed_init_group(group, *args, **kwargs):
        import torch
        params = group.get("params", ()) if isinstance(group, dict) else ()
        devices = {p.device.index for p in params
                   if isinstance(p, torch.Tensor) and p.is_cuda}
        if not devices or _busy(torch):
            return init_group(group, *args, **kwargs)
        before = _state_ids(torch, optimizer, params)
        with contextlib.ExitStack() as stack:
            for index in sorted(devices):
                stack.enter_context(long_lived(index))
            result = init_group(group, *args, **kwargs)
        made = _state_ids(torch, optimizer, params) - before
        with _lock:
            _placed.setdefault(optimizer, set()).update(made)
        return result

    placed_init_group._gmlake_placing = True
    return placed_init_group


def _subclass_params(torch, optimizer):
    """Whether a parameter of optimizer is a tensor subclass (FSDP2's
    DTensor) rather than a plain tensor or nn.Parameter."""
    nn = getattr(torch, "nn", None)
    plain = (torch.Tensor, getattr(nn, "Parameter", torch.Tensor))
    for group in getattr(optimizer, "param_groups", ()):
        params = group.get("params", ()) if isinstance(group, dict) else ()
        if any(type(p) not in plain for p in params):
            return True
    return False


def _left_alone(optimizer):
    """Whether the hooks leave optimizer be now: done with it, offloaded,
    with a tensor subclass among its parameters, or while a CUDA graph
    captures or torch.compile traces."""
    with _lock:
        if optimizer in _settled:
            return True
    if _offloaded(optimizer):
        return True
    import torch
    if _subclass_params(torch, optimizer):
        with _lock:
            _settled.add(optimizer)     # decided once, not every step
        return True
    return _busy(torch)


def _pre_step(optimizer, args, kwargs):
    if _lib.enabled_library() is None or _left_alone(optimizer):
        return
    init_group = getattr(optimizer, "_init_group", None)
    if callable(init_group) and \
            not getattr(init_group, "_gmlake_placing", False):
        optimizer._init_group = _placing(optimizer, init_group)


def _unwrap(optimizer):
    mine = getattr(vars(optimizer).get("_init_group"), "_gmlake_placing",
                   False)
    if mine:
        del optimizer._init_group


def _post_step(optimizer, args, kwargs):
    _unwrap(optimizer)
    if not optimizer.state or _left_alone(optimizer):
        return
    with _lock:
        _settled.add(optimizer)     # once, whatever happens below
        placed = _placed.pop(optimizer, set())
        copy = _copy
    if not copy:
        return
    try:
        _settle(optimizer, None, placed)
    except RuntimeError as e:       # out of memory for a copy, ...
        # The state not moved stays valid where it is: training goes on.
        warnings.warn("gmlake: optimizer state left in place: %s" % e,
                      RuntimeWarning, stacklevel=2)


def install(copy=False):
    """Register the global step pre- and post-hooks once
    (gmlake.torch.enable); with copy, the post-hook also moves state the
    first step made outside _init_group (from then on: a later
    install(copy=False) does not undo it). False where this PyTorch has
    no global optimizer hooks."""
    global _hooks, _copy
    try:
        from torch.optim.optimizer import \
            register_optimizer_step_post_hook as register_post, \
            register_optimizer_step_pre_hook as register_pre
    except ImportError:
        return False
    with _lock:
        _copy = _copy or bool(copy)
        if _hooks is None:
            _hooks = (register_pre(_pre_step), register_post(_post_step))
    return True
