# SPDX-License-Identifier: MIT
"""Saved activations copied to pinned host memory and back into new
tensors: gmlake.torch.offload_activations()'s default
(same_address=False).

The same-address offloader (gmlake.activations) moves libgmlake blocks:
a spill unmaps a block's chunks and a fetch maps chunks at the same
address again, and the driver charges that per 2 MiB chunk (on the H200,
an unmap about 20 us, a set-access 30-50 us, more while kernels run), so
on the bench's GPT those calls took more time than the copies. Saved
activations do not need their address: autograd only needs a tensor with
the same values back. This offloader therefore does what save_on_cpu
does, without its stalls:

* pack copies the tensor to pinned host memory on a side stream of its
  own, ordered after the work queued so far (the kernel that made the
  tensor), and holds the device tensor until the copy is done (its event,
  looked at in every pack and unpack): then it lets go, and the memory is
  an ordinary free on the compute stream, which the allocator reuses at
  once. (record_stream instead would leave the block marked for the side
  stream, and the allocator grew past those blocks: 8.6% fragmentation
  on the bench's GPT.) No driver call, no host wait. save_on_cpu copies
  on the compute stream and waits for it.
* Copies in flight hold device memory, so when more than max_inflight
  bytes are still copying out, pack waits for the oldest first: forward
  then runs at the bus's pace instead of keeping everything.
* The end of forward. Copies still going out when forward ends hold
  their tensors through the loss, typically the step's peak (nothing is
  packed or unpacked there to see them done), where save_on_cpu holds
  none. So the offloader counts the packs of each forward (every saved
  tensor, moved or not: how many are over min_bytes can change with the
  shapes, how many are saved does not), and in the next one, over the
  packs that copied out the last max_inflight bytes of the previous,
  keeps one copy in flight at a time and, at the last pack, waits for
  the copies going out (drain=True, the default): the loss then starts
  with nothing held. That costs the host a wait per copy there, about
  the bus time of one window a step. Past the count of the forward
  before, copies stay one at a time, and the end of each
  offload_activations block waits for them (the forward may end there);
  a shorter forward ends with its last copies in flight; the first
  forward, with nothing learned yet, does not drain.
* budget=BYTES: saved tensors stay on the device, the newest first,
  while their bytes fit in the budget; the oldest are copied out when a
  newer one needs the room. Backward needs the newest first, so only what
  the budget cannot hold crosses the bus. A tensor kept on the device is
  returned as it is; one modified in place since it was saved raises
  autograd's error, as without hooks.
* unpack of a copied tensor allocates a new one on the compute stream and
  copies it back on the side stream, then copies back the next saved
  tensors in backward order (the reverse of pack order) until `prefetch`
  bytes are fetched ahead and not yet unpacked, so the bus works while
  backward computes. The compute stream waits for each copy on the device
  (an event), never the host.
* Backward starts with forward's newest tensors, whose copies out may
  still be in flight: unpack then returns the device tensor itself, and
  when such copies finish during backward, the newest of them that fit
  in the prefetch window stay on the device as fetched. Copies going out
  count in that window, and the prefetch passes them over, so the device
  never holds a tensor and its copy back at once, and less crosses the
  bus.

Tensors that stay as they are: not dense or not on a CUDA device,
smaller than min_bytes (64 KiB), or, unless leaves=True, parameters
(frozen ones too), leaves that require grad, and views of them: their
memory stays on the device whatever is saved. Saved tensors that
require no grad move like the rest, as with save_on_cpu: normalization
statistics, attention's logsumexp (2 MiB a layer on the bench's GPT),
masks, and inputs and buffers too (for those a copy costs bus time and
saves nothing). The host copy is contiguous, so a strided tensor comes
back contiguous, as with save_on_cpu.

The CUDA work goes through a small table of operations (_TorchOps) so
that the tests can run the bookkeeping on the CPU.
"""

import collections
import threading
import weakref

MiB = 1 << 20
# Copies to the host in flight before pack waits, and bytes fetched ahead
# in backward: on the bench's GPT 128 MiB and 256 MiB ran alike (431 and
# 442 ms) and 1 GiB held 0.7 GiB more at the peak for no gain (428 ms).
COPY_WINDOW = 256 * MiB
# Saved tensors smaller than this stay. With 1 MiB the bench's GPT kept
# its layer-norm statistics (128 KiB each at its largest shape), and its
# peak reserved was 13.42 GiB against save_on_cpu's 13.41, which moves
# everything; under 64 KiB are seeds, offsets and counters.
COPY_MIN_BYTES = 64 << 10


class _TorchOps:
    """The CUDA operations the offloader makes, through PyTorch."""

    def __init__(self):
        import torch
        self.torch = torch

    def on_device(self, t):
        """A dense CUDA tensor (sparse and nested ones stay as they are:
        a plain copy of their shape would not hold them)."""
        dev = getattr(t, "device", None)
        return dev is not None and dev.type == "cuda" and \
            t.layout == self.torch.strided and not t.is_nested

    def device_of(self, t):
        return t.device.index if t.device.index is not None else 0

    def lives_on(self, t):
        """Whether t's memory outlives the step without autograd: a
        parameter (trainable or frozen) or a leaf that requires grad."""
        return isinstance(t, self.torch.nn.Parameter) or \
            (t.is_leaf and t.requires_grad)

    def side_stream(self, device):
        return self.torch.cuda.Stream(device)

    def current(self, device):
        return self.torch.cuda.current_stream(device)

    def after(self, stream, other):
        """stream's later work waits for what other has queued so far."""
        stream.wait_stream(other)

    def to_host(self, t, stream):
        """A pinned copy of t made on stream; (copy, event)."""
        torch = self.torch
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return host, ev

    def to_device(self, host, device, stream):
        """A new device tensor allocated on the current stream, filled
        from host on stream after the current stream's queued work (its
        memory may have been freed by that work); (tensor, event)."""
        torch = self.torch
        t = torch.empty(host.shape, dtype=host.dtype,
                        device=torch.device("cuda", device))
        stream.wait_stream(self.current(device))
        with torch.cuda.stream(stream):
            t.copy_(host, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return t, ev

    def wait(self, stream, ev):
        stream.wait_event(ev)

    def done(self, ev):
        return ev.query()

    def synchronize(self, ev):
        ev.synchronize()


class _Saved:
    """One saved tensor: on the device (kept), on the host, or fetched."""

    __slots__ = ("index", "device", "nbytes", "dev", "version", "host",
                 "out", "fetched", "in_ev", "unpacked", "__weakref__")

    def __init__(self, index, device, nbytes, dev, version):
        self.index = index
        self.device = device
        self.nbytes = nbytes
        self.dev = dev              # the tensor itself while kept
        self.version = version
        self.host = None            # pinned copy, once copied out
        self.out = None             # the device tensor, while copying out
        self.fetched = None         # device copy fetched ahead
        self.in_ev = None
        self.unpacked = False


class _WeakBytes:
    """Records by index, oldest first, and their bytes; weak references,
    so a record autograd lets go of (a graph freed without backward)
    leaves with its bytes."""

    def __init__(self, lock):
        self._lock = lock
        self._items = collections.OrderedDict()     # index -> (ref, n)
        self.bytes = 0

    def __len__(self):
        return len(self._items)

    def add(self, rec):
        self._items[rec.index] = (weakref.ref(rec, self._gone(rec.index)),
                                  rec.nbytes)
        self.bytes += rec.nbytes

    def pop(self, rec):
        item = self._items.pop(rec.index, None)
        if item is not None:
            self.bytes -= item[1]
        return item is not None

    def oldest(self):
        while self._items:
            index, (ref, n) = next(iter(self._items.items()))
            rec = ref()
            if rec is not None:
                return rec
            del self._items[index]      # its callback has not run yet
            self.bytes -= n
        return None

    def _gone(self, index):
        def gone(_ref, self_ref=weakref.ref(self)):
            wb = self_ref()
            if wb is None:
                return
            with wb._lock:
                item = wb._items.pop(index, None)
                if item is not None:
                    wb.bytes -= item[1]
        return gone


class CopyOffloader:
    """pack and unpack for torch.autograd.graph.saved_tensors_hooks (see
    the module's docstring). One per process is shared by
    offload_activations() (same_address=False); the options apply to it.
    """

    def __init__(self, min_bytes=COPY_MIN_BYTES, leaves=False, budget=None,
                 prefetch=COPY_WINDOW, max_inflight=COPY_WINDOW, drain=True,
                 ops=None):
        self.configure(min_bytes=min_bytes, leaves=leaves, budget=budget,
                       prefetch=prefetch, max_inflight=max_inflight,
                       drain=drain)
        self._ops = ops
        self._lock = threading.RLock()
        self._side = {}
        # Records are autograd's: weak references here, so a graph freed
        # without backward takes its saved tensors with it.
        self._kept = _WeakBytes(self._lock)     # on the device
        self._ahead = _WeakBytes(self._lock)    # fetched, not unpacked
        # (event, bytes, device tensor, record ref) of copies to the host
        # in flight
        self._outflight = collections.deque()
        self._out_bytes = 0
        self._backward = False  # an unpack came after the last pack
        self._copied = []       # refs in pack order, for the prefetch
        # This forward's copies out (sizes), and from the one before the
        # count of all of them and of those in its last window (drain).
        self._fwd_sizes = []
        self._last_fwd = self._tail = 0
        self._compact_at = 64
        self._index = 0
        self.stats = collections.Counter()

    def configure(self, min_bytes=COPY_MIN_BYTES, leaves=False,
                  budget=None, prefetch=COPY_WINDOW,
                  max_inflight=COPY_WINDOW, drain=True):
        for name, v in (("min_bytes", min_bytes), ("prefetch", prefetch)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError("%s must be a byte count >= 0, not %r" %
                                 (name, v))
        for name, v in (("budget", budget), ("max_inflight", max_inflight)):
            if v is not None and (not isinstance(v, int) or
                                  isinstance(v, bool) or v < 0):
                raise ValueError("%s must be None or a byte count >= 0, "
                                 "not %r" % (name, v))
        self.min_bytes = min_bytes
        self.leaves = bool(leaves)
        self.budget = budget
        self.prefetch = prefetch
        self.max_inflight = max_inflight
        self.drain = bool(drain)

    def options(self):
        return dict(min_bytes=self.min_bytes, leaves=self.leaves,
                    budget=self.budget, prefetch=self.prefetch,
                    max_inflight=self.max_inflight, drain=self.drain)

    @property
    def ops(self):
        if self._ops is None:
            self._ops = _TorchOps()
        return self._ops

    def eligible(self, t):
        if not self.ops.on_device(t):
            return False
        if not self.leaves:
            base = getattr(t, "_base", None)
            if self.ops.lives_on(base if base is not None else t):
                return False
        return t.numel() * t.element_size() >= max(self.min_bytes, 1)

    def side(self, device):
        s = self._side.get(device)
        if s is None:
            s = self._side[device] = self.ops.side_stream(device)
        return s

    def pack(self, t):
        self.stats["packs"] += 1
        eligible = self.eligible(t)
        with self._lock:
            if self._backward:
                self._fwd_sizes = []    # a new forward
            self._backward = False
            # Every pack counts for the drain, moved or not: the count
            # of saved tensors does not change with the shapes, the
            # count of those over min_bytes can.
            self._fwd_sizes.append(0)
            if not eligible:
                self.stats["kept_as_is"] += 1
                self._drain_end()
                return t
            t = t.detach()
            self.reap()
            self._index += 1
            rec = _Saved(self._index, self.ops.device_of(t),
                         t.numel() * t.element_size(), t, t._version)
            self._kept.add(rec)
            budget = self.budget or 0
            while self._kept.bytes > budget:
                old = self._kept.oldest()
                if old is None:
                    break
                self._copy_out(old)
            self._drain_end()
            return rec

    def scope_ended(self):
        """An offload_activations block ended. In the drain's window, or
        past the end the forward before had, wait for the copies going
        out: this forward may end here, before the pack that would."""
        with self._lock:
            if self._in_tail() and self._outflight:
                self.stats["drains_at_exit"] += 1
                self.synchronize()
            else:
                self.reap()

    def unpack(self, rec):
        if not isinstance(rec, _Saved):
            return rec
        with self._lock:
            self.stats["unpacks"] += 1
            self.reap()
            if not self._backward:
                self._forward_ended()
            self._backward = True
            if rec.dev is not None:         # kept on the device
                t = rec.dev
                self._kept.pop(rec)
                if t._version != rec.version:
                    raise RuntimeError(
                        "one of the variables needed for gradient "
                        "computation has been modified by an inplace "
                        "operation (a saved tensor kept on the device by "
                        "gmlake's offload_activations: version %d, saved "
                        "at %d)" % (t._version, rec.version))
                return t
            if rec.out is not None and rec.out._version == rec.version \
                    and rec.fetched is None:
                # Its copy out is still in flight: the device tensor
                # itself, no copy back (backward meets forward's newest
                # first, while they are still going out).
                t = rec.out
                rec.unpacked = True
                self.stats["unpacked_in_flight"] += 1
                self._prefetch(rec)
                return t
            cur = self.ops.current(rec.device)
            if rec.fetched is None:
                self._fetch(rec)
                self.stats["fetches_on_demand"] += 1
            t, ev = rec.fetched, rec.in_ev
            self._ahead.pop(rec)
            rec.unpacked = True
            # A second unpack (retain_graph) fetches again from the host.
            rec.fetched = rec.in_ev = None
            self._prefetch(rec)
            self.ops.wait(cur, ev)
            return t

    def reap(self):
        """Let go of the device tensors whose copy to the host is done."""
        with self._lock:
            done = []
            while self._outflight:
                entry = self._reap_out(False)
                if entry is None:
                    break
                done.append(entry)
            self._settle(done)

    def synchronize(self):
        """Wait for every copy to the host in flight."""
        with self._lock:
            while self._outflight:
                self._settle([self._reap_out(True)])

    def _copy_out(self, rec):
        """rec's tensor to the host now; the device tensor let go."""
        self._kept.pop(rec)
        t = rec.dev
        if t._version != rec.version:
            # Modified in place while kept: the saved values are gone.
            # Stay on the device; unpack raises autograd's error.
            self.stats["modified"] += 1
            return
        self._throttle(rec.nbytes, 0 if self._in_tail() else
                       self.max_inflight)
        side = self.side(rec.device)
        self.ops.after(side, self.ops.current(rec.device))
        rec.host, ev = self.ops.to_host(t, side)
        rec.dev = None
        rec.out = t
        self._outflight.append((ev, rec.nbytes, t, weakref.ref(rec)))
        self._out_bytes += rec.nbytes
        self._fwd_sizes[-1] += rec.nbytes
        self._copied.append(weakref.ref(rec))
        if len(self._copied) >= self._compact_at:
            self._copied = [r for r in self._copied
                            if r() is not None and not r().unpacked]
            self._compact_at = max(64, 2 * len(self._copied))
        self.stats["copied_out"] += 1
        self.stats["bytes_out"] += rec.nbytes

    def _reap_out(self, wait):
        """The oldest copy out, taken off the list once done (waiting for
        it if wait), or None."""
        ev, nbytes, t, ref = self._outflight[0]
        if not self.ops.done(ev):
            if not wait:
                return None
            self.ops.synchronize(ev)
            self.stats["out_waits"] += 1
        self._outflight.popleft()
        self._out_bytes -= nbytes
        return ev, nbytes, t, ref

    def _settle(self, done):
        """Finished copies out: their device tensors go, except, in
        backward, the newest of them within the prefetch window, which
        stay as fetched: backward needs them next, and this way they never
        cross the bus back."""
        for ev, nbytes, t, ref in reversed(done):
            rec = ref()
            if rec is None or rec.out is not t:
                continue
            rec.out = None
            if self._backward and not rec.unpacked and \
                    rec.fetched is None and t._version == rec.version and \
                    self._ahead.bytes + self._out_bytes + nbytes <= \
                    self.prefetch:
                rec.fetched, rec.in_ev = t, ev
                self._ahead.add(rec)
                self.stats["kept_for_backward"] += 1

    def _in_tail(self):
        """Whether this forward's packs have reached the drain's window
        (learned from the forward before) or gone past its end."""
        left = self._last_fwd - len(self._fwd_sizes)  # after this pack
        return self.drain and not self._backward and self._last_fwd > 0 \
            and left < self._tail

    def _drain_end(self):
        """At the forward's last pack (the count of the one before), wait
        for every copy going out, so the loss starts with none held."""
        if self.drain and self._last_fwd > 0 and \
                len(self._fwd_sizes) == self._last_fwd and self._outflight:
            self.stats["drains"] += 1
            self.synchronize()

    def _forward_ended(self):
        """Backward began: learn the forward's pack count and how many of
        its last packs copied out a window's bytes, for the next
        forward's drain."""
        sizes = self._fwd_sizes
        self._last_fwd = len(sizes)
        total = tail = 0
        for n in reversed(sizes):
            if total >= (self.max_inflight or 0):
                break
            total += n
            tail += 1
        self._tail = max(tail, 1) if sizes else 0

    def _throttle(self, nbytes, limit):
        self.reap()
        while limit is not None and self._outflight and \
                self._out_bytes + nbytes > limit:
            self._settle([self._reap_out(True)])

    def _fetch(self, rec):
        side = self.side(rec.device)
        rec.fetched, rec.in_ev = self.ops.to_device(rec.host, rec.device,
                                                    side)
        self._ahead.add(rec)
        self.stats["bytes_in"] += rec.nbytes

    def _prefetch(self, rec):
        """Fetch the saved tensors packed before rec, newest first, while
        fewer than `prefetch` bytes are fetched ahead."""
        copied = self._copied
        # Drop what backward has passed or autograd let go, from the end.
        while copied and (copied[-1]() is None or copied[-1]().unpacked):
            copied.pop()
        i = len(copied) - 1
        # Copies still going out hold their tensors: they count in the
        # window, so the device never holds a tensor and its copy back.
        while i >= 0 and self._ahead.bytes + self._out_bytes < self.prefetch:
            r = copied[i]()
            i -= 1
            if r is None or r.index >= rec.index or r.unpacked or \
                    r.fetched is not None or r.host is None or \
                    r.out is not None:
                continue
            self._fetch(r)
            self.stats["prefetches"] += 1


_default = None
_default_lock = threading.Lock()


def default_copy_offloader():
    """The process's CopyOffloader, shared."""
    global _default
    with _default_lock:
        if _default is None:
            _default = CopyOffloader()
        return _default
