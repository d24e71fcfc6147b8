# SPDX-License-Identifier: MIT
"""What the PyTorch offloaders (gmlake.activations, gmlake.optimizer)
share: a ring per device, the requests in flight keyed by user_data, and
what a completion does to the record it belongs to.

A record is any object with the attributes device, ptr, nbytes, state
(one of the four below), want (a fetch op to submit once a spill is
done, or None) and movable (False once a spill said the block cannot
move). Subclasses add to a completion through _spill_failed, _fetched
and _completed.
"""

import collections
import errno
import itertools

from . import offload as _off

# Where a block is, as an offloader's bookkeeping knows it.
RESIDENT = "resident"
SPILLING = "spilling"
SPILLED = "spilled"
FETCHING = "fetching"


class Mover:
    """entries: submission entries of each ring; context: device ->
    gmlake context (default: gmlake_torch_ctx_get); library: the
    libgmlake to use (a path, or a loaded library)."""

    def __init__(self, entries, context, library):
        self.entries = entries
        self.library = library
        self._context = context
        self.stats = collections.Counter()
        self.unknown = {}           # completions of nobody's request
        self._inflight = {}         # user_data -> (record, op)
        self._spilling = 0          # bytes of spills not yet completed
        self._rings = {}            # device -> offload.Ring
        self._dirty = set()         # devices with entries not submitted
        self._ids = itertools.count(1)
        self._clib = None           # (library given, loaded library)

    def _lib(self):
        """The library, loaded: resolving a path costs file lookups, and
        an offloader makes a few calls per block per step."""
        if self._clib is None or self._clib[0] is not self.library:
            self._clib = (self.library, _off._library(self.library))
        return self._clib[1]

    def _ring(self, dev):
        ring = self._rings.get(dev)
        if ring is None:
            ctx = self._context(dev) if self._context else \
                _off.torch_context(dev, self._lib())
            ring = _off.Ring(ctx, self.entries, 0, self._lib())
            self._rings[dev] = ring
        return ring

    def _queue(self, rec, op, inplace=False):
        ring = self._ring(rec.device)
        sqe = ring.sqe_or_reap(self._complete)
        uid = next(self._ids)
        ring.prep(sqe, op, rec.ptr, inplace)
        ring.set_data(sqe, uid)
        if op == _off.SPILL:
            rec.state = SPILLING
            self._spilling += rec.nbytes
        else:
            rec.state = FETCHING
        self._inflight[uid] = (rec, op)
        self._dirty.add(rec.device)
        self.stats[_off.OP_STATS[op]] += 1

    def _flush(self):
        """Hand in what is prepared, on every ring."""
        while self._dirty:
            self._rings[self._dirty.pop()].submit()

    def _reap_ready(self):
        for ring in list(self._rings.values()):
            ring.reap_ready(self._complete)

    def _reap_one(self, dev):
        """Wait for one completion on dev's ring (after handing in)."""
        self._flush()
        self._complete(*self._rings[dev].reap())

    def _want(self, rec, op):
        """Make sure a fetch of rec is (or will be) submitted."""
        if rec.state == SPILLED:
            rec.error = None
            self._queue(rec, op)
        elif rec.state == SPILLING and rec.want != _off.FETCH:
            rec.want = op

    def _complete(self, uid, res):
        rec, op = self._inflight.pop(uid, (None, None))
        if rec is None:
            self.unknown[uid] = res
            return
        if op == _off.SPILL:
            self._spilling -= rec.nbytes
            if res == 0:
                rec.state = SPILLED
                self.stats["spilled_bytes"] += rec.nbytes
                if rec.want is not None:
                    want, rec.want = rec.want, None
                    self._queue(rec, want)
            else:
                rec.state = RESIDENT
                rec.want = None
                self.stats["spill_failures"] += 1
                self.stats["spill_" + _off.errno_name(res)] += 1
                if res in (-errno.EOPNOTSUPP, -errno.EINVAL):
                    rec.movable = False
                self._spill_failed(rec, res)
        elif res == 0:
            rec.state = RESIDENT
            rec.error = None
            self.stats["fetched_bytes"] += rec.nbytes
            self._fetched(rec, None)
        else:
            rec.state = SPILLED
            self.stats["fetch_failures"] += 1
            self._fetched(rec, res)
        self._completed(rec)

    def _spill_failed(self, rec, res):
        """A spill of rec completed with res < 0 (rec is resident)."""

    def _fetched(self, rec, res):
        """A fetch of rec completed: res None (rec is resident) or < 0
        (rec stays spilled; set rec.error)."""

    def _completed(self, rec):
        """After any completion of rec's."""
