# SPDX-License-Identifier: MIT
"""Saved activations spilled to host memory by libgmlake's offload rings.

    import gmlake.torch
    gmlake.torch.enable()
    ...
    with gmlake.torch.offload_activations():
        loss = model(batch)
    loss.backward()

offload_activations() installs torch.autograd.graph.saved_tensors_hooks
whose pack and unpack are Offloader.pack and Offloader.unpack below. A
spill moves the whole libgmlake block behind a saved tensor's storage to
the pinned host arena and gives its chunks back; the fetch maps chunks at
the SAME device address again. So, unlike save_on_cpu, no tensor is
allocated or copied in Python: pack returns a handle holding the tensor,
unpack returns the same tensor (the alias pack kept), and the only work
on the hot path is a few ctypes calls into the ring. Nothing synchronizes
the device; unpack waits on the host only for the completion of the one
fetch it needs (prefetched ahead, it is normally there already).

Design, and why:

* What moves. A CUDA tensor whose storage is at least min_bytes (1 MiB:
  smaller libgmlake blocks share chunks and complete with -EOPNOTSUPP) and
  is not a leaf: parameters, frozen weights, inputs and buffers are leaves
  (a view counts as its base), and the rest of the program reads them
  outside autograd's knowledge (the optimizer, the next step), so they stay
  unless leaves=True. Everything else is returned as it is and never
  touched. The block address is t.untyped_storage().data_ptr(); a storage
  that is not the start of a libgmlake block completes with -EINVAL and
  stays where it is, as do blocks whose spill fails for any reason (the
  data is intact on the device: a failed spill only saves less memory).

* References. A handle keeps a reference to its tensor (t.detach(): the
  same storage, without the grad_fn that would make a reference cycle
  with a saved output; autograd puts the history back on unpack, and
  unpack returns that very alias, no new tensor memory), so PyTorch never
  frees a storage while it is spilled: its address is the one the fetch
  maps again. Saved tensors that share a storage (a tensor and its views,
  an output saved by two ops) share one record, counted per storage: the
  block spills once and is fetched once. A record also holds a tensor
  itself until every request on it has completed and been reaped, so no
  block is ever freed while it moves (gmlake_free of a moving block fails
  with -EBUSY, and PyTorch's free would log and leak it).

* When to spill. pack runs when the op that saves the tensor is being
  recorded: for an input, before its kernel is even queued; and forward
  often reads a saved tensor again later (a residual add, the next
  layer). A spill orders itself only after the stream work queued before
  the engine started it, so spilling a storage some tensor of the program
  still refers to would unmap memory a later kernel reads (a fatal CUDA
  error). A storage is therefore spilled only when nothing but the
  offloader refers to it any more: PyTorch counts the tensors on each
  storage (torch._C._storage_Use_Count; the offloader calibrates what one
  tensor adds once, on the CPU), and a storage whose count is the
  offloader's own aliases is one no kernel can be queued on again. The
  check runs at every pack for the storages waiting, oldest first, and
  also waits for `lag` more saved tensors to be packed after a storage's
  last pack (default 4: the newest saved tensors are the first ones
  backward needs). Storages still waiting when backward starts (the first
  unpack) are not spilled at all: a round trip would only cost time.
  Forward can make activations faster than the bus takes them (in the
  benchmark's GPT it does, several times over), and a spill gives its
  memory back only when its copy is done; so when more than max_inflight
  bytes (1 GiB) are spilling, pack waits for completions first. Without
  that wait the peak is the peak of not offloading at all; with it
  forward runs at the bus's pace.
  A budget (budget=BYTES) bounds what stays instead of spilling
  everything: storages waiting for their spill are spilled oldest first
  only while their bytes pass the budget, so the newest, the first that
  backward needs, stay on the device, and the bus carries only what the
  budget needs. Leaving the context spills down to the budget too.
  Leaving the context (without an exception) spills what still waits for
  its lag and nothing else refers to: the code after the context (a
  loss, typically, the step's peak) saves nothing through these hooks,
  and would otherwise run with those storages on the device. It waits
  for completions as pack does, so no more than max_inflight bytes are
  still spilling when the loss runs; backward then fetches them first.
  Spills in flight complete on their own and are reaped at the next pack
  or unpack (or by synchronize()). With a PyTorch that cannot count
  (users=None), the lag is all there is: then code that reads a saved
  tensor more than `lag` saves later faults, and in-place mode or a larger
  lag is the way out.

* In place. inplace=False (the default) spills into the pinned arena:
  full-speed copies, no pinning on the hot path; the block's range is
  unmapped while spilled, so a read of it faults. Counting users rules
  that out for tensors; what it cannot see is a raw address kept outside
  them (an extension holding data_ptr(), or a PyTorch without the count).
  inplace=True asks each spill for the ring's in-place mode
  (GMLAKE_OFFLOAD_SQE_INPLACE): host memory is mapped at the block while
  spilled, so such a stray read gets the right bytes over the bus; but
  each spill then creates and maps host memory of its own (cuMemCreate on
  a host NUMA node, about 4 GB/s where the copy runs at 50), so it is for
  debugging or for programs that need it.

* Backward. unpack of a spilled (or still spilling) storage submits its
  fetch, then prefetches for the next `prefetch` spilled storages in
  backward order (the reverse of spill order), all in one submit (the
  engine starts fetches before prefetches), and waits for its own
  completion. The window counts storages fetched ahead and not yet
  unpacked, whether their fetch is still in flight or done: counting only
  fetches in flight let each unpack fetch `prefetch` more whenever the
  bus ran ahead of backward, until most of the saved tensors were back on
  the device at once. Storages packed after the one unpacked (backward
  has passed them: they belong to nodes off its path, such as a metric's)
  are neither fetched ahead nor kept in the window. Completions are
  reaped into the records they belong to,
  keyed by user_data, whatever order they come in; a spill that completes
  after someone asked for its fetch gets the fetch submitted at once. A
  fetch that fails (res < 0: no device memory, say) raises OffloadError
  (a RuntimeError) with the errno and the block stays spilled: nothing is
  lost, and a later unpack tries again. A tensor that was never spilled
  comes back as it is.

* Graphs freed without backward. When the last handle of a spilled
  storage goes (the graph was freed, or backward never reached that
  node), the tensor may still be referenced elsewhere, so the block is
  fetched back before the record lets go of it. That costs a transfer
  only in that case; backward itself drops records as it consumes them.

* Threads. Backward runs unpack on autograd's device threads and handles
  die wherever the graph is freed: one lock guards the bookkeeping, and a
  handle dying while the lock is busy (or inside the offloader's own
  calls) is queued and processed at the end of the call in progress.

Works only with libgmlake as PyTorch's allocator (gmlake.torch.enable());
one ring per device context, created at the first spill on that device.
"""

import collections
import threading

from . import _lib
from . import offload as _off
from ._mover import FETCHING, RESIDENT, SPILLED, SPILLING, Mover

MiB = 1 << 20
# Bytes of spills in flight before pack waits for some to complete.
MAX_INFLIGHT = 1024 * MiB
# An option left to its mode's default.
_DEFAULT = object()

# Where a storage is, as the bookkeeping knows it: RESIDENT (on the
# device and staying there, for now), SPILLING (spill submitted, its
# completion not reaped), SPILLED (on the host), FETCHING, and:
PENDING = "pending"      # packed; spills after `lag` more packs
DROPPED = "dropped"      # no handle left; the record let the tensor go
MOVING = (SPILLING, SPILLED, FETCHING)


def _detach(t):
    detach = getattr(t, "detach", None)
    return detach() if detach is not None else t


def torch_users():
    """A function telling how many tensors refer to a tensor's storage,
    from PyTorch's storage use count, or None when this PyTorch cannot
    tell. What one tensor adds to the count, and what the lookup itself
    adds, are measured once here rather than assumed."""
    try:
        import torch
        count = torch._C._storage_Use_Count
        a = torch.empty(1)
        one = count(a.untyped_storage()._cdata)
        b = a.detach()
        two = count(a.untyped_storage()._cdata)
        del b
    except Exception:  # no torch, or one without the count
        return None
    per = two - one
    if per < 1 or one < per:
        return None
    base = one - per

    def users(t):
        return (count(t.untyped_storage()._cdata) - base) // per
    return users


class _Storage:
    """The bookkeeping of one storage (one libgmlake block)."""
    __slots__ = ("key", "device", "ptr", "nbytes", "tensor", "refs",
                 "state", "last_pack", "want", "movable", "error", "ahead")

    def __init__(self, key, device, ptr, nbytes, tensor):
        self.key = key
        self.device = device
        self.ptr = ptr
        self.nbytes = nbytes
        self.tensor = tensor     # keeps the block alive while it moves
        self.refs = 0            # live handles
        self.state = PENDING
        self.last_pack = 0
        self.want = None         # FETCH or PREFETCH once the spill is done
        self.movable = True
        self.error = None        # (message, errno) of a failed fetch
        self.ahead = False       # prefetched, not unpacked since


class Handle:
    """What pack returns for a tensor it may spill."""
    __slots__ = ("tensor", "rec", "owner")

    def __init__(self, tensor, rec, owner):
        self.tensor = tensor
        self.rec = rec
        self.owner = owner

    def __del__(self):
        owner, rec = self.owner, self.rec
        if owner is not None and rec is not None:
            owner._release(rec)


class Offloader(Mover):
    """The pack/unpack pair and its bookkeeping (see the module docstring).

    lag: packs after a storage's last pack before it is spilled (0 spills
    at pack time: only for code that never reads a saved tensor again in
    forward); prefetch: spilled storages fetched ahead in backward
    (default: lag); inplace: spill in place (see above); min_bytes:
    smaller storages stay; leaves: also spill leaf tensors (parameters);
    entries: submission entries of each ring; context: device -> gmlake
    context (default: gmlake_torch_ctx_get); library: libgmlake to use;
    users: tensor -> how many tensors refer to its storage ("torch":
    torch_users(), looked up at the first pack; None: do not count, spill
    by lag alone); max_inflight: bytes of spills in flight before pack
    waits for some to complete (None: never); budget: bytes of saved
    storages that may stay on the device (None: no budget, everything
    past its lag spills).
    """

    def __init__(self, lag=4, prefetch=None, inplace=False, min_bytes=MiB,
                 leaves=False, entries=256, context=None, library=None,
                 users="torch", max_inflight=MAX_INFLIGHT, budget=None):
        super().__init__(entries, context, library)
        self.configure(lag, prefetch, inplace, min_bytes, leaves,
                       max_inflight, budget)
        self.users = users
        self._lock = threading.RLock()
        self._depth = 0
        self._deferred = collections.deque()
        self._storages = {}      # (device, ptr) -> _Storage
        self._lagq = collections.OrderedDict()   # pending, oldest first
        self._lag_bytes = 0      # bytes of the storages in _lagq
        self._stack = []         # spilled records, in spill order
        self._ahead = []         # records prefetched, not yet unpacked
        self._ahead_bytes = 0
        self._seq = 0            # packs so far

    def configure(self, lag=4, prefetch=None, inplace=False, min_bytes=MiB,
                  leaves=False, max_inflight=MAX_INFLIGHT, budget=None):
        if lag < 0 or (prefetch is not None and prefetch < 0):
            raise ValueError("lag and prefetch must be >= 0")
        if max_inflight is not None and max_inflight < 0:
            raise ValueError("max_inflight must be >= 0 (or None)")
        if budget is not None and (not isinstance(budget, int) or
                                   budget < 0):
            raise ValueError("budget must be bytes >= 0 (or None)")
        self.max_inflight = max_inflight
        self.budget = budget
        self.lag = int(lag)
        self.prefetch = int(lag if prefetch is None else prefetch)
        self.inplace = bool(inplace)
        self.min_bytes = int(min_bytes)
        self.leaves = bool(leaves)

    def options(self):
        return dict(lag=self.lag, prefetch=self.prefetch,
                    inplace=self.inplace, min_bytes=self.min_bytes,
                    leaves=self.leaves, max_inflight=self.max_inflight,
                    budget=self.budget)

    # ------------------------------------------------------------------
    # The hooks

    def eligible(self, t):
        """Whether pack may spill t's storage (cheap checks only)."""
        dev = getattr(t, "device", None)
        if dev is None or getattr(dev, "type", None) != "cuda":
            return False
        if not self.leaves:
            base = getattr(t, "_base", None)
            if getattr(base if base is not None else t, "is_leaf", True):
                return False
        st = t.untyped_storage()
        return st.nbytes() >= max(self.min_bytes, 1) and st.data_ptr() != 0

    def pack(self, t):
        self.stats["packs"] += 1
        eligible = self.eligible(t)
        # Never hold the live tensor: for a saved output its grad_fn owns
        # the handle, and the cycle would outlive a graph freed without
        # backward. detach() is an alias of the same storage (no device
        # memory), and autograd restores the history on unpack.
        t = _detach(t)
        if not eligible:
            self.stats["kept"] += 1
            return t
        st = t.untyped_storage()
        dev = t.device.index if t.device.index is not None else 0
        key = (dev, st.data_ptr())
        self._enter()
        try:
            self._seq += 1
            rec = self._storages.get(key)
            if rec is None:
                # An alias of its own: the record then holds exactly one
                # tensor besides one per live handle (see _in_use).
                rec = _Storage(key, dev, key[1], st.nbytes(), _detach(t))
                self._storages[key] = rec
                self.stats["storages"] += 1
            elif rec.state in MOVING:
                # Saved again while away: the op saving it reads it next.
                self.stats["refetches"] += 1
                self._claim(rec)
                self._want(rec, _off.FETCH)
                self._wait(rec)
            rec.refs += 1
            rec.last_pack = self._seq
            if rec.movable and rec.state in (PENDING, RESIDENT):
                rec.state = PENDING
                if key not in self._lagq:
                    self._lag_bytes += rec.nbytes
                self._lagq[key] = rec
                self._lagq.move_to_end(key)
            self._spill_lagged()
            self._reap_ready()
            return Handle(t, rec, self)
        finally:
            self._leave()

    def unpack(self, h):
        if not isinstance(h, Handle):
            return h
        rec = h.rec
        self._enter()
        try:
            if self._lagq:          # backward started: keep the rest
                for r in self._lagq.values():
                    r.state = RESIDENT
                self.stats["kept_for_backward"] += len(self._lagq)
                self._lagq.clear()
                self._lag_bytes = 0
            self._reap_ready()
            self._claim(rec)
            # Fetched ahead, packed after rec, not unpacked: backward went
            # past them (their nodes are off its path), so they leave the
            # window instead of holding it shut.
            for r in [r for r in self._ahead if r.last_pack > rec.last_pack]:
                self._claim(r)
                if r.want == _off.PREFETCH:     # still spilling: no fetch
                    r.want = None
            if rec.state in MOVING:
                self._want(rec, _off.FETCH)
            if self._stack:
                self._prefetch(rec)
            if rec.state in MOVING:
                self._wait(rec)
            return h.tensor
        finally:
            self._leave()

    # ------------------------------------------------------------------
    # Whole-offloader operations

    def synchronize(self):
        """Wait until no request is in flight (and fetch back what lost
        its last handle while spilled)."""
        self._enter()
        try:
            self._quiesce()
        finally:
            self._leave()

    def close(self):
        """synchronize(), then free the rings."""
        self.synchronize()
        with self._lock:
            rings, self._rings = self._rings, {}
            for ring in rings.values():
                ring.exit()

    def where(self, tensor):
        """The bookkeeping's state of tensor's storage, or None."""
        key = (tensor.device.index or 0, tensor.untyped_storage().data_ptr())
        rec = self._storages.get(key)
        return rec.state if rec else None

    def tracked(self):
        """How many storages have records."""
        return len(self._storages)

    def in_flight(self):
        return len(self._inflight)

    def spilling(self):
        """Bytes of spills submitted and not yet completed."""
        return self._spilling

    def spill_waiting(self):
        """Spill every packed storage waiting for its lag that nothing
        else refers to (leaving offload_activations). Nothing without a
        count of users: then the lag is all that keeps a storage forward
        still reads from being unmapped."""
        self._enter()
        try:
            if self._counting():
                self._spill_lagged(lag=0)
        finally:
            self._leave()

    # ------------------------------------------------------------------
    # Inside: the caller holds the lock (_enter/_leave)

    def _enter(self):
        self._lock.acquire()
        self._depth += 1

    def _leave(self):
        try:
            if self._depth == 1:
                self._drain()
                self._flush()
        finally:
            self._depth -= 1
            self._lock.release()

    def _queue(self, rec, op, inplace=False):
        if op == _off.SPILL:
            self._claim(rec)    # saved again after its prefetch
            self._stack.append(rec)
        super()._queue(rec, op, self.inplace)

    def _counting(self):
        """Whether tensors on a storage can be counted (users="torch" is
        looked up here, the first time)."""
        if self.users == "torch":
            self.users = torch_users()
        return self.users is not None

    def _spill_lagged(self, lag=None):
        limit = self._seq - (self.lag if lag is None else lag)
        if self._counting():
            self._drain()
            if self._deferred:      # a handle is dying: counts are off
                return
        for rec in list(self._lagq.values()):
            if rec.last_pack > limit:
                break
            if self.budget is not None and self._lag_bytes <= self.budget:
                self.stats["kept_by_budget"] = len(self._lagq)
                break
            if self._in_use(rec):
                self.stats["waits_for_users"] += 1
                continue
            del self._lagq[rec.key]
            self._lag_bytes -= rec.nbytes
            self._throttle(rec.nbytes)
            self._queue(rec, _off.SPILL)

    def _throttle(self, nbytes):
        """Wait for spills in flight to complete until nbytes more stay
        within max_inflight: the device memory of a spill comes back only
        when its copy is done, and forward makes activations faster than
        the bus takes them, so without this the peak is what it would be
        without offloading."""
        cap = self.max_inflight
        if cap is None:
            return
        waited = False
        while self._spilling and self._spilling + nbytes > cap:
            if not waited:
                self.stats["waits_for_bus"] += 1
                waited = True
            self._reap_one(next(r.device for r, op in self._inflight.values()
                                if op == _off.SPILL))

    def _in_use(self, rec):
        """Whether a tensor other than the offloader's aliases (the
        record's and one per live handle) refers to rec's storage."""
        if self.users is None:
            return False
        return self.users(rec.tensor) > rec.refs + 1

    def _prefetch(self, current):
        """Fetch ahead until `prefetch` storages are on their way back or
        back and not yet unpacked, taking the next spilled ones in
        backward order."""
        stack = self._stack
        # Off the top: storages back on the device, and those backward
        # passed (so the walk below stays short).
        while stack and (stack[-1].state not in (SPILLING, SPILLED) or
                         stack[-1].last_pack > current.last_pack):
            stack.pop()
        n = len(self._ahead)
        for rec in reversed(stack):
            if n >= self.prefetch:
                break
            if rec is current or rec.ahead or rec.want is not None or \
                    rec.last_pack > current.last_pack:
                continue        # needed now, on its way, or passed
            if (rec.state == SPILLED and rec.error is None) or \
                    rec.state == SPILLING:
                self._want(rec, _off.PREFETCH)
                rec.ahead = True
                self._ahead.append(rec)
                self._ahead_bytes += rec.nbytes
                peak = self.stats["ahead_bytes_peak"]
                self.stats["ahead_bytes_peak"] = max(peak, self._ahead_bytes)
                n += 1

    def _claim(self, rec):
        """rec is needed now (unpacked, or dropped): it no longer counts
        in the prefetch window."""
        if rec.ahead:
            rec.ahead = False
            self._ahead.remove(rec)
            self._ahead_bytes -= rec.nbytes

    def _wait(self, rec):
        """Reap completions until rec is on the device; raise if its
        fetch failed."""
        while rec.state != RESIDENT:
            if rec.error is not None:
                msg, err = rec.error
                rec.error = None
                raise _off.OffloadError(msg, err)
            if rec.state == SPILLED:
                self._want(rec, _off.FETCH)
            self._reap_one(rec.device)

    def _fetched(self, rec, res):
        if res is not None:
            rec.error = ("gmlake offload: fetching the saved tensor block "
                         "%#x (%d bytes, device %d) back failed: %s; it "
                         "stays on the host" % (rec.ptr, rec.nbytes,
                                                rec.device,
                                                _off.describe(res)), -res)

    def _completed(self, rec):
        if rec.refs == 0:
            self._let_go(rec)

    def _let_go(self, rec):
        """rec has no handle left: drop it once nothing moves it."""
        if rec.state in (SPILLING, FETCHING):
            return                  # again when the completion comes
        if rec.state == SPILLED and rec.error is None:
            self.stats["fetched_on_release"] += 1
            self._queue(rec, _off.FETCH)
            return
        if rec.state == SPILLED:
            self.stats["dropped_spilled"] += 1
        self._claim(rec)
        if self._lagq.pop(rec.key, None) is not None:
            self._lag_bytes -= rec.nbytes
        if self._storages.get(rec.key) is rec:
            del self._storages[rec.key]
        rec.state = DROPPED
        rec.tensor = None
        if not self._storages:
            self._stack.clear()

    def _release(self, rec):
        """A handle died (Handle.__del__; any thread)."""
        if self._lock.acquire(blocking=False):
            try:
                if self._depth == 0:
                    self._depth += 1
                    try:
                        self._unref(rec)
                        self._drain()
                        self._flush()
                    finally:
                        self._depth -= 1
                    return
            except Exception as e:  # never raise out of __del__
                self.stats["release_errors"] += 1
                self.last_release_error = e
                return
            finally:
                self._lock.release()
        self._deferred.append(rec)

    def _unref(self, rec):
        rec.refs -= 1
        if rec.refs == 0:
            self._let_go(rec)

    def _drain(self):
        while self._deferred:
            self._unref(self._deferred.popleft())

    def _quiesce(self):
        while True:
            self._drain()
            self._flush()
            if not self._inflight:
                return
            rec, _ = next(iter(self._inflight.values()))
            self._reap_one(rec.device)


_default = None
_default_lock = threading.Lock()


def default_offloader():
    """The process's Offloader, shared by every offload_activations()."""
    global _default
    with _default_lock:
        if _default is None:
            import atexit
            _default = Offloader()
            atexit.register(_close_default)
        return _default


def _close_default():
    off = _default
    if off is not None:
        try:
            off.close()
        except Exception:   # at exit: the library may be going already
            pass


# The growth budget (per mille) while activations are offloaded
# (_memory_first): the copying offloader's GPT on an H100 reserved 13.30
# GiB with it against save_on_cpu's 13.32 in three rounds (13.37 at the
# default 20; bench/results/act-offload/rounds-e443193-h100/).
OFFLOAD_GROW_SLACK = 5
_budget_lowered = set()


def _memory_first():
    """A program that offloads activations asks for memory before
    speed: lower libgmlake's growth budget on the current device to
    OFFLOAD_GROW_SLACK, once, unless GMLAKE_GROW_SLACK chose one or it is
    lower already. Nothing where libgmlake is not PyTorch's allocator; a
    failure only warns (offload works all the same)."""
    import os
    import warnings
    path = _lib.enabled_library()
    if path is None or "GMLAKE_GROW_SLACK" in os.environ:
        return
    import torch
    try:
        device = torch.cuda.current_device()
    except (AttributeError, RuntimeError) as e:    # no CUDA to ask
        warnings.warn("gmlake: the growth budget stays: no current "
                      "device (%s)" % e, RuntimeWarning, stacklevel=3)
        return
    if device in _budget_lowered:
        return
    _budget_lowered.add(device)
    from .torch import grow_slack
    try:
        if grow_slack(None, device, path) > OFFLOAD_GROW_SLACK:
            grow_slack(OFFLOAD_GROW_SLACK, device, path)
    except ValueError as e:
        warnings.warn("gmlake: the growth budget stays: %s" % e,
                      RuntimeWarning, stacklevel=3)


class offload_activations:
    """Context manager: tensors autograd saves inside it go to host memory
    and come back when backward needs them: copied into new tensors
    (same_address=False, the default: gmlake.copy_offload), or spilled by
    libgmlake and fetched back at the same address (same_address=True:
    gmlake.activations, whose docstring is the design).

    lag (4): saved tensors packed after a storage before it is spilled;
    prefetch (lag): spilled storages fetched ahead in backward; inplace
    (False): spill in place, so that a stray read sees the right bytes;
    min_bytes (1 MiB; 64 KiB for the copying offloader): smaller
    storages stay; leaves (False): spill leaf tensors (parameters,
    inputs) too; max_inflight (1 GiB): bytes of spills in flight before
    pack waits for some to complete (None: never wait); budget (None):
    bytes of saved tensors that may stay on the device, the newest (the
    ones backward needs first) staying, the oldest spilled, so only what
    the budget needs crosses the bus (None: everything spills); offloader: an Offloader of one's own (default:
    one per process, shared; the options above are applied to it for the
    time of the block).

    same_address: False (the default, unless offloader is an Offloader)
    copies saved tensors to pinned host memory on a side stream and back
    into new tensors (gmlake.copy_offload.CopyOffloader): no driver
    mapping work, which on the H200 made it 0.71-0.75x save_on_cpu's step
    on the bench's GPT (0.72x over three rounds) where the same-address
    spill took 1.5x. Then lag, prefetch and inplace do not apply,
    max_inflight defaults to 256 MiB, prefetch_bytes (256 MiB) bounds
    what backward fetches ahead, and drain (True) waits at the end of
    each forward (learned from the one before) for the copies still
    going out, so that the loss does not run beside them. Its leaves
    rule is narrower (a copy never takes memory away): only parameters
    and leaves that require grad stay; saved tensors that require no
    grad (normalization statistics, attention's logsumexp) move.
    True moves libgmlake's blocks and brings them back at the same
    address (the options above; it needs gmlake.torch.enable(),
    libgmlake as PyTorch's allocator).

    Offloading asks for memory before speed: where libgmlake is
    PyTorch's allocator, the first use on a device lowers its growth
    budget to OFFLOAD_GROW_SLACK (5 per mille, from 20) for the rest of
    the process, unless GMLAKE_GROW_SLACK is set or the budget is lower
    (gmlake.torch.grow_slack(), gmlake_grow_slack(3)).
    """

    def __init__(self, lag=None, prefetch=None, inplace=None,
                 min_bytes=None, leaves=False, offloader=None,
                 max_inflight=_DEFAULT, budget=None, same_address=None,
                 prefetch_bytes=None, drain=None):
        if same_address is None:
            same_address = isinstance(offloader, Offloader)
        self.same_address = bool(same_address)
        if self.same_address:
            lag = 4 if lag is None else lag
            inplace = False if inplace is None else inplace
            min_bytes = MiB if min_bytes is None else min_bytes
            if max_inflight is _DEFAULT:
                max_inflight = MAX_INFLIGHT
            if prefetch_bytes is not None:
                raise ValueError("prefetch_bytes is for same_address="
                                 "False; the same-address offloader's "
                                 "prefetch counts storages")
            if drain is not None:
                raise ValueError("drain is for same_address=False (the "
                                 "copying offloader)")
            self.opts = dict(lag=lag, prefetch=prefetch, inplace=inplace,
                             min_bytes=min_bytes, leaves=leaves,
                             max_inflight=max_inflight, budget=budget)
            Offloader.configure(_Check(), **self.opts)  # bad values: now
        else:
            if lag is not None or prefetch is not None or \
                    inplace is not None:
                raise ValueError("lag, prefetch and inplace are the "
                                 "same-address offloader's: pass "
                                 "same_address=True (the copying one, the "
                                 "default, takes prefetch_bytes)")
            from .copy_offload import (CopyOffloader, COPY_MIN_BYTES,
                                       COPY_WINDOW)
            self.opts = dict(min_bytes=(COPY_MIN_BYTES if min_bytes is None
                                        else min_bytes), leaves=leaves,
                             budget=budget,
                             max_inflight=(COPY_WINDOW if max_inflight is
                                           _DEFAULT else max_inflight),
                             prefetch=(COPY_WINDOW if prefetch_bytes is None
                                       else prefetch_bytes),
                             drain=True if drain is None else drain)
            CopyOffloader.configure(_Check(), **self.opts)
            if offloader is not None and \
                    not isinstance(offloader, CopyOffloader):
                raise ValueError("same_address=False needs a "
                                 "CopyOffloader as offloader")
        self.offloader = offloader
        self._saved = None
        self._hooks = None

    def __enter__(self):
        if not self.same_address:
            return self._enter_copy()
        if not _lib.enabled_library():
            raise RuntimeError(
                "gmlake.torch.offload_activations(same_address=True) needs "
                "libgmlake as PyTorch's CUDA allocator: call "
                "gmlake.torch.enable() at the start of the program, before "
                "any CUDA tensor is made. Only libgmlake blocks can be "
                "spilled and fetched back at the same address (the default, "
                "same_address=False, copies and needs no enable()).")
        off = self.offloader or default_offloader()
        if off.library is None:
            off.library = _lib.enabled_library()
        return self._install(off)

    def _enter_copy(self):
        from .copy_offload import default_copy_offloader
        return self._install(self.offloader or default_copy_offloader())

    def _install(self, off):
        """off's options for the block, and its hooks installed."""
        import torch
        _memory_first()
        self.offloader = off
        self._saved = off.options()
        off.configure(**self.opts)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(off.pack,
                                                               off.unpack)
        try:
            self._hooks.__enter__()
        except BaseException:
            off.configure(**self._saved)
            raise
        return off

    def __exit__(self, *exc):
        off = self.offloader
        if not self.same_address:
            try:
                self._hooks.__exit__(*exc)
            finally:
                off.configure(**self._saved)
                off.scope_ended()
            return False
        try:
            self._hooks.__exit__(*exc)
        finally:
            try:
                if exc[0] is None:
                    off.spill_waiting()
            finally:
                off.configure(**self._saved)
                off._enter()
                try:
                    off._reap_ready()
                finally:
                    off._leave()
        return False


class _Check:
    """A throwaway target for Offloader.configure's checks."""
