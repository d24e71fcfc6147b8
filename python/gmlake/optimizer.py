# SPDX-License-Identifier: MIT
"""Optimizer state parked on the host between steps.

    import gmlake.torch
    gmlake.torch.enable()
    model = ...
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    gmlake.torch.offload_optimizer(opt)
    for batch in data:                  # any gradient accumulation
        loss(model, batch).backward()
        ...
        opt.step()                      # state comes back, steps, goes
        opt.zero_grad()

offload_optimizer(opt) returns an OptimizerOffloader, which replaces the
optimizer's step (an attribute of the instance; the class is untouched)
with a step in buckets. Each bucket is a run of parameters whose bytes add
up to about bucket_bytes (256 MiB), taken in param_groups order. For each
bucket the wrapper makes the bucket's state resident, runs the
optimizer's own step with param_groups cut down to the bucket's
parameters (the groups' other keys, lr and the rest, are the same dicts),
and then parks the state that step made or updated. The optimizer
itself, fused, foreach or for-loop, runs on the GPU as it always does: a
spill keeps a block's device address reserved and the fetch maps memory
at the SAME address again, so every tensor in optimizer.state stays
valid and nothing is copied in Python.

Why buckets: a step needs the state of every parameter it updates. Run
whole, it would need all of it on the device at once, which is the peak
that offloading is there to remove. By buckets the peak is the
parameters, their gradients and a window of state: the bucket stepping,
`prefetch` buckets (2) fetched ahead, and the spills still copying (at
most max_inflight bytes, 2 GiB: before a bucket steps, the wrapper waits
for spills to complete until no more are copying).

Parking: the first buckets' state stays on the device while it fits in
keep_bytes, and the rest is spilled (submitted, not waited for: the
copy runs after the step's kernels, on libgmlake's copy stream). The
bus then carries only what memory needs. "auto" (the default) keeps the
device's size less a reserve (reserve_bytes: 10% of the device, at
least 2 GiB) less the most that was resident besides the state at the
start of a backward (sampled at its first gradient): 0, spill it all,
until the first backward has been seen. State kept is advised
offloadable (gmlake_advise) until its bucket's next step, so where the
guess was wrong libgmlake spills it to serve an allocation that would
fail otherwise, and the step fetches it again (stats["pressure_spills"]);
what pressure took is added to the estimate, so the next steps keep that
much less.
keep_bytes=0 parks everything on the host after every step.

When state comes back:

* In the last micro-batch's backward. The wrapper hooks gradient
  accumulation (register_post_accumulate_grad_hook on each parameter
  for the first window, then on the first and HOOKS_KEPT others spread
  over the model) and counts backward passes between steps by the
  parameter whose gradient comes first. Once a window reaches the count of the window
  before it, the backward running is the last before a step, and each
  gradient hook of it prefetches buckets in stepping order while their
  bytes stay within prefetch_bytes: backward frees memory as it goes, so
  later hooks find more room. "auto" (the default) takes the device's
  free room at that moment: its size less what is allocated and
  resident (and the fetches still under way), less the reserve, for
  what backward still allocates. The reserve is a guess, not a limit: a
  prefetched bucket is advised offloadable like kept state, so when
  backward needs its memory after all, libgmlake spills it back. A block
  is advised offloadable only while nothing will use it before its
  bucket's step, and is advised back before that step runs.
* During the step, `prefetch` buckets ahead of the one stepping, so that
  the bus works while the GPU steps. When all the state fits in
  keep_bytes (the model fits without offload), there is nothing to move:
  the step is then one call of the optimizer's own step over all the
  parameters, as without offload (stats["whole_steps"]).
* A bucket not back when its step comes is fetched then
  (stats["late_fetches"] counts its tensors), and the host waits for the
  copy: the only wait (stats["host_waits"] counts the tensors waited for).

Other uses of the state: optimizer.state_dict() and load_state_dict()
are wrapped too. state_dict() first fetches all state (waiting for it),
so that a checkpoint reads resident tensors; load_state_dict() fetches,
loads (the optimizer makes new state tensors, long-lived as the first
step's are) and forgets the old records. Anything else that reads optimizer.state between steps must call
fetch_all() first: a spilled tensor's memory is not mapped, and a kernel
reading it faults. State the wrapper cannot see is refused with a
RuntimeError naming it: a CUDA tensor kept in an attribute of the
optimizer rather than in optimizer.state (offload_optimizer checks at the
start and after the first step). A storage shared by the state of two
buckets stays on the device (stats["shared_kept"]), since spilling it
after one bucket would unmap it under the other. Tensors smaller than
min_bytes (1 MiB: AdamW's step counters, say) stay where they are, as do
storages that do not start a libgmlake block (the spill completes with
-EINVAL).

close() (or gmlake.torch.offload_optimizer(opt).close()) fetches
everything, restores the optimizer's methods and removes the hooks.
step(closure) is refused: a closure re-evaluates the model per call, and
per bucket it would run once for each.

Works only with libgmlake as PyTorch's allocator (gmlake.torch.enable()).
The optimizer must be a torch.optim.Optimizer (param_groups and state);
everything else about it is left alone.
"""

import collections
import contextlib
import errno
import itertools
import threading
import types

from . import _lib
from . import offload as _off
from ._mover import FETCHING, RESIDENT, SPILLED, SPILLING, Mover

MiB = 1 << 20
GiB = 1 << 30
BUCKET_BYTES = 256 * MiB
HOOKS_KEPT = 16             # gradient hooks after the first window


class _Rec:
    """One storage of optimizer state (one libgmlake block)."""
    __slots__ = ("key", "device", "ptr", "nbytes", "tensor", "bucket",
                 "state", "want", "error", "movable", "advised")

    def __init__(self, key, tensor, nbytes, bucket):
        self.key = key
        self.device, self.ptr = key
        self.nbytes = nbytes
        self.tensor = tensor        # keeps the block alive while it moves
        self.bucket = bucket
        self.state = RESIDENT
        self.want = None            # a fetch to submit when a spill ends
        self.error = None           # (message, errno) of a failed fetch
        self.movable = True
        self.advised = False        # offloadable: pressure may spill it


def _cuda_storage(t, min_bytes):
    """(device, storage pointer, bytes) of a CUDA tensor worth moving, or
    None."""
    dev = getattr(t, "device", None)
    if getattr(dev, "type", None) != "cuda" or \
            not hasattr(t, "untyped_storage"):
        return None
    st = t.untyped_storage()
    if st.nbytes() < max(min_bytes, 1) or not st.data_ptr():
        return None
    return (dev.index or 0, st.data_ptr()), st.nbytes()


def _device_memory(library):
    """device -> (resident, capacity) bytes: libgmlake's allocated bytes
    less its spilled ones (PyTorch's memory_allocated() counts those),
    and the device's size."""
    def memory(device):
        import torch
        from . import _stats
        st = _stats.raw_stats(device, library)
        return (st.resident_bytes.current,
                torch.cuda.get_device_properties(device).total_memory)
    return memory


class OptimizerOffloader(Mover):
    """The bucketed step, its bookkeeping and hooks (module docstring).

    optimizer: a torch.optim.Optimizer; bucket_bytes: parameter bytes per
    bucket; prefetch: buckets fetched ahead during the step; prefetch_bytes:
    state bytes fetched in the last backward ("auto", an int, or 0 for
    none); keep_bytes: state bytes that stay on the device after a step
    ("auto", an int, or 0: spill all of it); reserve_bytes: room "auto"
    leaves free (None: 10% of the device, at least 2 GiB); max_inflight:
    bytes of spills copying before the step waits for some (None: never);
    min_bytes: smaller state stays; hooks: count
    backward passes through the parameters' gradient hooks (False: only
    prefetch_now() and the step fetch); entries: submission entries of
    each ring; context: device -> gmlake context (default:
    gmlake_torch_ctx_get); memory: device -> (resident, capacity) bytes
    (default: libgmlake's resident bytes, PyTorch's device size);
    library: the libgmlake to use.
    """

    def __init__(self, optimizer, bucket_bytes=BUCKET_BYTES, prefetch=2,
                 prefetch_bytes="auto", keep_bytes="auto",
                 reserve_bytes=None, max_inflight=2 * GiB, min_bytes=MiB,
                 hooks=True, entries=1024, context=None, memory=None,
                 library=None):
        if not hasattr(optimizer, "param_groups") or \
                not hasattr(optimizer, "state"):
            raise TypeError("offload_optimizer needs a torch.optim.Optimizer "
                            "(with param_groups and state), not %s" %
                            type(optimizer).__name__)
        if bucket_bytes <= 0 or prefetch < 0:
            raise ValueError("bucket_bytes must be > 0 and prefetch >= 0")
        for name, v in (("prefetch_bytes", prefetch_bytes),
                        ("keep_bytes", keep_bytes)):
            if v != "auto" and (not isinstance(v, int) or v < 0):
                raise ValueError("%s must be 'auto' or bytes >= 0" % name)
        if getattr(optimizer, "_gmlake_offloader", None) is not None:
            raise RuntimeError("this optimizer is offloaded already; close() "
                               "its OptimizerOffloader first")
        super().__init__(entries, context,
                         library or _lib.enabled_library())
        self.opt = optimizer
        self.bucket_bytes = int(bucket_bytes)
        self.prefetch = int(prefetch)
        self.prefetch_bytes = prefetch_bytes
        self.keep_bytes = keep_bytes
        if max_inflight is not None and max_inflight < 0:
            raise ValueError("max_inflight must be >= 0 (or None)")
        self.max_inflight = max_inflight
        self.reserve_bytes = reserve_bytes
        self.min_bytes = int(min_bytes)
        self._memory = memory or _device_memory(self.library)
        self._lock = threading.RLock()
        self._recs = {}             # (device, ptr) -> _Rec
        self._by_bucket = collections.defaultdict(list)
        self._buckets = None
        self._sig = None
        self._checked = False
        # backward passes, for the prefetch in the last one
        self._hooks = []
        self._first = None          # the parameter whose grad comes first
        self._passes = 0            # backward passes since the last step
        self._accum = None          # passes of the last window
        self._peak = None           # resident besides state, sampled
        self._taken = 0             # state bytes pressure took back
        self._capacity = 0
        self._ahead_from = 0        # first bucket not prefetched yet
        self._check_hidden()
        self._orig = {n: optimizer.__dict__.get(n)
                      for n in ("step", "state_dict", "load_state_dict")}
        self._step_fn = optimizer.step
        self._state_dict_fn = optimizer.state_dict
        self._load_fn = optimizer.load_state_dict
        # Methods of the optimizer itself: an LR scheduler made later
        # rebinds step's __func__ to the optimizer.
        optimizer._gmlake_offloader = self
        for name, fn in (("step", _step), ("state_dict", _state_dict),
                         ("load_state_dict", _load_state_dict)):
            setattr(optimizer, name, types.MethodType(fn, optimizer))
        if hooks:
            self._hook_all()

    # ------------------------------------------------------------------
    # What the optimizer's methods become

    def step(self, closure=None, **kwargs):
        """The optimizer's step, bucket by bucket (module docstring)."""
        if closure is not None:
            raise ValueError("offload_optimizer: step(closure) is not "
                             "supported: the step runs once per bucket, "
                             "and so would the closure")
        buckets = self._bucketing()
        out = None
        with self._lock:
            self._reap_ready()
            self._window_ends()
            keep = self._keep_budget()
            if self._recs and keep >= sum(r.nbytes for r in
                                          self._recs.values()):
                out = self._step_whole(buckets, kwargs, keep)
            else:
                out = self._step_buckets(buckets, kwargs, keep)
            self.stats["steps"] += 1
        if not self._checked:
            self._checked = True
            self._check_hidden()
        return out

    def state_dict(self, *args, **kwargs):
        self.fetch_all()
        return self._state_dict_fn(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        with self._lock:
            self.fetch_all()
            # The state it makes lives as long as the optimizer, as the
            # first step's does: long-lived, one handle a large tensor.
            groups = [list(g["params"]) for g in self.opt.param_groups]
            with self._long_lived(groups, fresh=True):
                out = self._load_fn(*args, **kwargs)
            self._forget()
        return out

    # ------------------------------------------------------------------
    # Whole-offloader calls

    def prefetch_now(self, nbytes=None):
        """Fetch buckets in stepping order while their bytes stay within
        nbytes (default: prefetch_bytes, "auto" as in the docstring)."""
        with self._lock:
            self._reap_ready()
            budget = self._budget() if nbytes is None else int(nbytes)
            n = len(self._buckets or ())
            while self._ahead_from < n:
                i = self._ahead_from
                need = sum(r.nbytes for r in self._by_bucket[i]
                           if r.state in (SPILLING, SPILLED))
                if need > budget:
                    break
                budget -= need
                self._ahead(i, 1, advise=True)
                self._ahead_from += 1
                self.stats["prefetched_buckets"] += 1

    def fetch_all(self):
        """Bring every state tensor back and wait for it: for code that
        reads optimizer.state between steps."""
        with self._lock:
            for rec in list(self._recs.values()):
                self._unadvise(rec)
                self._want(rec, _off.FETCH)
            for rec in list(self._recs.values()):
                self._wait(rec)

    def synchronize(self):
        """Wait until no request is in flight."""
        with self._lock:
            while self._inflight:
                rec, _ = next(iter(self._inflight.values()))
                self._reap_one(rec.device)

    def close(self):
        """fetch_all(), then give the optimizer its methods back, remove
        the hooks and free the rings."""
        with self._lock:
            self.fetch_all()
            self.synchronize()
            for h in self._hooks:
                h.remove()
            self._hooks = []
            for name, orig in self._orig.items():
                if orig is None:
                    self.opt.__dict__.pop(name, None)
                else:
                    setattr(self.opt, name, orig)
            self.opt.__dict__.pop("_gmlake_offloader", None)
            self._forget()
            rings, self._rings = self._rings, {}
            for ring in rings.values():
                ring.exit()

    def where(self, tensor):
        """The bookkeeping's state of tensor's storage, or None."""
        got = _cuda_storage(tensor, 1)
        rec = self._recs.get(got[0]) if got else None
        return rec.state if rec else None

    def buckets(self):
        """The buckets: lists of parameters, in stepping order."""
        return [list(itertools.chain.from_iterable(b))
                for b in self._bucketing()]

    def in_flight(self):
        return len(self._inflight)

    # ------------------------------------------------------------------
    # Buckets and the step of one

    def _bucketing(self):
        groups = self.opt.param_groups
        sig = tuple(tuple(id(p) for p in g["params"]) for g in groups)
        if sig == self._sig:
            return self._buckets
        with self._lock:
            if self._sig is not None:       # the groups changed
                self.fetch_all()
                self._forget()
            buckets, cur, size = [], [[] for _ in groups], 0
            for gi, g in enumerate(groups):
                for p in g["params"]:
                    nbytes = p.untyped_storage().nbytes() \
                        if hasattr(p, "untyped_storage") else 0
                    if size and size + nbytes > self.bucket_bytes:
                        buckets.append(cur)
                        cur, size = [[] for _ in groups], 0
                    cur[gi].append(p)
                    size += nbytes
            if size or not buckets:
                buckets.append(cur)
            self._buckets, self._sig = buckets, sig
        return buckets

    def _step_buckets(self, buckets, kwargs, keep):
        out = None
        for i in range(len(buckets)):
            self._throttle()
            self._resident(i)
            with self._long_lived(buckets[i]):
                out = self._step_bucket(buckets[i], kwargs)
            self._collect(i, buckets[i])
            keep = self._park(i, keep)
            self._flush()
        return out

    def _step_whole(self, buckets, kwargs, keep):
        """All the state stays on the device: one step of the whole
        optimizer, as without offload (what pressure took back comes
        first)."""
        for i in range(len(buckets)):
            self._resident(i, ahead=False)
        with self._long_lived([g for b in buckets for g in b]):
            out = self._step_fn(**kwargs)
        for i in range(len(buckets)):
            self._collect(i, buckets[i])
            keep = self._park(i, keep)
        self._flush()
        self.stats["whole_steps"] += 1
        return out

    @contextlib.contextmanager
    def _long_lived(self, bucket, fresh=False):
        """While the optimizer's step makes state for bucket's parameters
        (its first step for them; with fresh, whatever state they have,
        as load_state_dict replaces it), libgmlake's long-lived mode on
        their devices: that state lives as long as the optimizer, and a
        large tensor of it then costs one handle, not one per 2 MiB chunk
        (gmlake_long_lived(3))."""
        state = self.opt.state
        devices = sorted({p.device.index or 0 for params in bucket
                          for p in params if (fresh or p not in state) and
                          getattr(p.device, "type", None) == "cuda"})
        lib = self._lib() if devices else None
        on = []
        try:
            for d in devices:
                if lib.gmlake_torch_long_lived(d, 1) == 0:
                    on.append(d)
            self.stats["long_lived_steps"] += bool(on)
            yield
        finally:
            for d in on:
                lib.gmlake_torch_long_lived(d, 0)

    def _step_bucket(self, bucket, kwargs):
        """The optimizer's own step on the bucket's parameters: each
        group's params cut down (groups with none of them left out), put
        back whatever happens."""
        opt = self.opt
        groups = opt.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, sub in zip(groups, bucket):
                g["params"] = sub
            opt.param_groups = [g for g in groups if g["params"]]
            return self._step_fn(**kwargs)
        finally:
            opt.param_groups = groups
            for g, params in zip(groups, saved):
                g["params"] = params

    def _collect(self, i, bucket):
        """Records for the state of bucket i's parameters: new tensors
        (the first step, a tensor replaced) get one; a storage two
        buckets share stays resident."""
        keep = []
        for params in bucket:
            for p in params:
                for t in self.opt.state.get(p, {}).values():
                    got = _cuda_storage(t, self.min_bytes)
                    if got is None:
                        continue
                    key, nbytes = got
                    rec = self._recs.get(key)
                    if rec is None:
                        rec = _Rec(key, t.detach() if hasattr(t, "detach")
                                   else t, nbytes, i)
                        self._recs[key] = rec
                        self.stats["storages"] += 1
                    elif rec.bucket != i and rec.movable:
                        rec.movable = False
                        self.stats["shared_kept"] += 1
                        self._want(rec, _off.FETCH)
                        self._wait(rec)
                    keep.append(rec)
        seen = set(map(id, keep))
        for rec in self._by_bucket[i]:
            if id(rec) not in seen:         # replaced: let it go
                self._drop(rec)
        self._by_bucket[i] = [r for r in keep if r.bucket == i]

    def _check_hidden(self):
        """Refuse CUDA state kept outside optimizer.state."""
        for name, v in vars(self.opt).items():
            if name in ("state", "param_groups", "defaults") or \
                    name.startswith("_gmlake"):
                continue
            vals = v.values() if isinstance(v, dict) else \
                v if isinstance(v, (list, tuple)) else (v,)
            for t in vals:
                if _cuda_storage(t, self.min_bytes) is not None:
                    raise RuntimeError(
                        "offload_optimizer: %s keeps a CUDA tensor in its "
                        "attribute %r, outside optimizer.state, where the "
                        "offloader cannot see it or know when it is used; "
                        "it cannot be offloaded" %
                        (type(self.opt).__name__, name))

    # ------------------------------------------------------------------
    # Residency

    def _ahead(self, first, count, advise=False):
        """Fetches (as prefetches) for buckets first..first+count-1."""
        for i in range(first, min(first + count, len(self._buckets))):
            for rec in self._by_bucket[i]:
                if rec.state in (SPILLED, SPILLING) and rec.error is None:
                    if advise:
                        rec.advised = True
                    self._want(rec, _off.PREFETCH)
        self._flush()

    def _resident(self, i, ahead=True):
        """Bucket i's state on the device, and staying there: advised
        back, refetched if pressure spilled it meanwhile; the next
        `prefetch` buckets on their way."""
        for rec in self._by_bucket[i]:
            self._unadvise(rec)
            if rec.state in (SPILLING, SPILLED):
                self.stats["late_fetches"] += 1
                self._want(rec, _off.FETCH)
        if ahead:
            self._ahead(i + 1, self.prefetch)
        for rec in self._by_bucket[i]:
            self._wait(rec)

    def _unadvise(self, rec):
        if not rec.advised:
            return
        rec.advised = False
        if rec.state != RESIDENT:
            return              # advised when its fetch completes: not yet
        ctx = self._ring(rec.device).ctx
        _off.advise(ctx, rec.ptr, _off.ADVISE_NOT_OFFLOADABLE, self._lib())
        if _off.state(ctx, rec.ptr, self._lib()) == _off.SPILLED:
            rec.state = SPILLED
            self.stats["pressure_spills"] += 1
            self._taken += rec.nbytes

    def _park(self, i, keep):
        """After bucket i's step: keep its state on the device while it
        fits in keep bytes (advised offloadable: pressure may still take
        it), else spill it. What is left of keep."""
        recs = [r for r in self._by_bucket[i]
                if r.movable and r.state == RESIDENT]
        nbytes = sum(r.nbytes for r in recs)
        if nbytes <= keep:
            for rec in recs:
                self._advise(rec)
            self.stats["kept_bytes"] += nbytes
            return keep - nbytes
        for rec in recs:
            self._queue(rec, _off.SPILL)
        return 0                # later buckets spill too: keep the first

    def _throttle(self):
        """Wait for spills until at most max_inflight bytes are copying:
        a spill's memory comes back only when its copy is done, and the
        GPU steps buckets faster than the bus takes their state, so
        without this the step's peak would hold most of the state."""
        cap = self.max_inflight
        while cap is not None and self._spilling > cap:
            self.stats["waits_for_bus"] += 1
            self._reap_one(next(r.device for r, op in self._inflight.values()
                                if op == _off.SPILL))

    def _advise(self, rec):
        rec.advised = True
        _off.advise(self._ring(rec.device).ctx, rec.ptr,
                    _off.ADVISE_OFFLOADABLE, self._lib())

    def _keep_budget(self):
        """State bytes that may stay on the device through the next
        window: the device's size less the reserve, less the most that
        was resident besides the state at a backward's start (sampled at
        its first gradient). 0 until a window was seen."""
        if self.keep_bytes != "auto":
            return self.keep_bytes
        if self._peak is None:
            return 0
        return max(0, self._capacity - self._reserve(self._capacity) -
                   self._peak)

    def _reserve(self, capacity):
        if self.reserve_bytes is not None:
            return self.reserve_bytes
        return max(capacity // 10, 2 * GiB)

    def _wait(self, rec):
        """Reap completions until rec is on the device; raise if its
        fetch failed (the state stays on the host, intact)."""
        if rec.state != RESIDENT:
            self.stats["host_waits"] += 1
        while rec.state != RESIDENT:
            if rec.error is not None:
                msg, err = rec.error
                rec.error = None
                if err == errno.ENOMEM and self._spills_done():
                    continue        # their memory is back: try again
                raise _off.OffloadError(msg, err)
            self._want(rec, _off.FETCH)
            self._reap_one(rec.device)

    def _spills_done(self):
        """Wait for the spills in flight; whether there were any."""
        waited = False
        while True:
            spill = next((r for r, op in self._inflight.values()
                          if op == _off.SPILL), None)
            if spill is None:
                return waited
            waited = True
            self._reap_one(spill.device)

    def _drop(self, rec):
        """Forget rec (its tensor was replaced); a spilled block is freed
        by the library with the tensor."""
        self._wait_idle(rec)
        self._recs.pop(rec.key, None)
        rec.tensor = None

    def _wait_idle(self, rec):
        while rec.state in (SPILLING, FETCHING):
            self._reap_one(rec.device)

    def _forget(self):
        for rec in list(self._recs.values()):
            self._wait_idle(rec)
            rec.tensor = None
        self._recs.clear()
        self._by_bucket.clear()

    # ------------------------------------------------------------------
    # Backward passes and the prefetch budget

    def _hook_all(self):
        for g in self.opt.param_groups:
            for p in g["params"]:
                reg = getattr(p, "register_post_accumulate_grad_hook", None)
                if reg is not None and getattr(p, "requires_grad", True):
                    self._hooks.append(reg(self._grad_hook(p)))

    def _prune_hooks(self):
        params = [p for g in self.opt.param_groups for p in g["params"]
                  if hasattr(p, "register_post_accumulate_grad_hook")]
        stride = max(1, -(-len(params) // HOOKS_KEPT))
        keep = [p for k, p in enumerate(params)
                if p is self._first or k % stride == 0]
        for h in self._hooks:
            h.remove()
        self._hooks = [p.register_post_accumulate_grad_hook(
            self._grad_hook(p)) for p in keep]

    def _grad_hook(self, p):
        def hook(_param):
            self._on_grad(p)
        return hook

    def _on_grad(self, p):
        """A parameter's gradient was accumulated (autograd's thread).
        In the last backward before a step every such hook tries the
        prefetch again, since backward frees memory as it goes."""
        if self._first is None:
            self._first = p
        if p is self._first:
            self._passes += 1
            if self.keep_bytes == "auto":
                self._sample()
        if self._accum is None or self._passes < self._accum or \
                self.prefetch_bytes == 0 or \
                self._ahead_from >= len(self._buckets or ()):
            return
        if p is self._first:
            self.stats["backward_prefetches"] += 1
        self.prefetch_now()

    def _window_ends(self):
        """At a step: the window's passes are the next window's count.
        After the first, hooks stay on the first parameter and on
        HOOKS_KEPT others spread over the model: each is a Python call
        per backward, and that many retries of the prefetch suffice."""
        if self._passes and self._accum is None and \
                len(self._hooks) > HOOKS_KEPT + 1:
            self._prune_hooks()
        if self._passes:
            self._accum = self._passes
        self._passes = 0
        self._ahead_from = 0
        # What pressure took back was more than the room there was: the
        # next windows keep (and count on) that much less.
        if self._peak is not None:
            self._peak += self._taken
        self._taken = 0

    def _sample(self):
        """What is resident besides the state the bookkeeping holds on
        the device, at a backward's start: the window's peak, nearly."""
        dev = self._first.device.index or 0
        resident, self._capacity = self._memory(dev)
        with self._lock:
            state = sum(r.nbytes for r in self._recs.values()
                        if r.state == RESIDENT)
        other = max(0, resident - state)
        if self._peak is None or other > self._peak:
            self._peak = other

    def _budget(self):
        if self.prefetch_bytes != "auto":
            return self.prefetch_bytes
        if not self._recs:
            return 0                # nothing to fetch
        dev = next(iter(self._recs.values())).device
        resident, capacity = self._memory(dev)
        reserve = self._reserve(capacity)
        # Fetches in flight may not be in the resident bytes yet.
        coming = sum(r.nbytes for r in self._recs.values()
                     if r.state == FETCHING)
        return max(0, capacity - reserve - resident - coming)

    # ------------------------------------------------------------------
    # Rings and completions

    def _spill_failed(self, rec, res):
        if res == -errno.ENOMEM and not self.stats["warned_host"]:
            self.stats["warned_host"] = 1
            import warnings
            warnings.warn(
                "gmlake offload_optimizer: a spill found no host memory "
                "(the pinned arena is at GMLAKE_HOST_LIMIT, 16 GiB by "
                "default): that state stays on the device; raise "
                "GMLAKE_HOST_LIMIT to park more", RuntimeWarning)

    def _fetched(self, rec, res):
        if res is None:
            if rec.advised:
                # Prefetched for a later step: pressure may take it back.
                _off.advise(self._ring(rec.device).ctx, rec.ptr,
                            _off.ADVISE_OFFLOADABLE, self._lib())
            return
        rec.advised = False
        rec.error = ("gmlake offload_optimizer: fetching optimizer state "
                     "block %#x (%d bytes, device %d) back failed: %s; it "
                     "stays on the host" % (rec.ptr, rec.nbytes, rec.device,
                                            _off.describe(res)), -res)


def _step(opt, closure=None, **kwargs):
    return opt._gmlake_offloader.step(closure, **kwargs)


def _state_dict(opt, *args, **kwargs):
    return opt._gmlake_offloader.state_dict(*args, **kwargs)


def _load_state_dict(opt, *args, **kwargs):
    return opt._gmlake_offloader.load_state_dict(*args, **kwargs)


def offload_optimizer(optimizer, **options):
    """Park optimizer's state on the host between steps; see
    gmlake.optimizer. Returns the OptimizerOffloader (close() undoes it).
    Needs gmlake.torch.enable()."""
    if not options.get("library") and not _lib.enabled_library():
        raise RuntimeError(
            "gmlake.torch.offload_optimizer() needs libgmlake as PyTorch's "
            "CUDA allocator: call gmlake.torch.enable() at the start of the "
            "program, before any CUDA tensor is made. Only libgmlake blocks "
            "can be spilled and fetched back at the same address.")
    return OptimizerOffloader(optimizer, **options)
