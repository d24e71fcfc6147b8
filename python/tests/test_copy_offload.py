# SPDX-License-Identifier: MIT
"""Tests of gmlake.copy_offload (offload_activations(same_address=False))
without torch or a GPU: fake tensors and a fake table of CUDA operations
that keeps each stream's queue, so the tests see what was copied, on
which stream, after what, and when the host waited.
"""

import gc
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from gmlake import copy_offload  # noqa: E402

MiB = 1 << 20


class Dev:
    type = "cuda"
    index = 0


class Tensor:
    """A fake tensor: nbytes of data (a bytearray), a version counter."""

    def __init__(self, nbytes, fill=0, device=True, leaf=False,
                 grad=True, param=False):
        self.data = bytearray([fill % 256]) * nbytes
        self.device = Dev() if device else None
        self.is_leaf = leaf
        self.requires_grad = grad
        self.param = param
        self._base = None
        self._version = 0

    def numel(self):
        return len(self.data)

    def element_size(self):
        return 1

    def detach(self):
        return self            # the same storage, as PyTorch's alias is

    def write(self, fill):
        self.data[:] = bytearray([fill % 256]) * len(self.data)
        self._version += 1


class Event:
    def __init__(self, stream, pos):
        self.stream, self.pos = stream, pos

    def done(self):
        return self.stream.done >= self.pos


class Stream:
    def __init__(self, name):
        self.name, self.queued, self.done = name, 0, 0
        self.waits = []         # (after my op number, other stream, its op)

    def push(self):
        self.queued += 1
        return self.queued


class Ops:
    """Streams whose work completes only when told (run)."""

    def __init__(self):
        self.cur = Stream("compute")
        self.sides = []
        self.log = []           # (what, stream name, nbytes)
        self.host_waits = 0

    def on_device(self, t):
        return t.device is not None

    def device_of(self, t):
        return 0

    def lives_on(self, t):
        return t.param or (t.is_leaf and t.requires_grad)

    def side_stream(self, device):
        s = Stream("side")
        self.sides.append(s)
        return s

    def current(self, device):
        return self.cur

    def after(self, stream, other):
        stream.waits.append((stream.queued, other, other.queued))

    def to_host(self, t, stream):
        host = Tensor(0, device=False)
        host.data = bytearray(t.data)       # the copy's values: now
        self.log.append(("out", stream.name, len(t.data)))
        return host, Event(stream, stream.push())

    def to_device(self, host, device, stream):
        self.after(stream, self.cur)
        t = Tensor(0)
        t.data = bytearray(host.data)
        self.log.append(("in", stream.name, len(host.data)))
        return t, Event(stream, stream.push())

    def wait(self, stream, ev):
        self.log.append(("wait", stream.name, ev.pos))

    def done(self, ev):
        return ev.done()

    def synchronize(self, ev):
        self.host_waits += 1
        ev.stream.done = max(ev.stream.done, ev.pos)

    def run(self):
        for s in self.sides:
            s.done = s.queued


def offloader(**kw):
    ops = Ops()
    return copy_offload.CopyOffloader(ops=ops, **kw), ops


class CopyOffloadTest(unittest.TestCase):
    def test_round_trip_values_and_order(self):
        off, ops = offloader(prefetch=0)
        ts = [Tensor(2 * MiB, fill=i) for i in range(4)]
        packed = [off.pack(t) for t in ts]
        self.assertEqual([w for w in ops.log if w[0] == "out"],
                         [("out", "side", 2 * MiB)] * 4)
        # Each copy out waits for the compute stream's work so far.
        side = ops.sides[0]
        self.assertEqual(len(side.waits), 4)
        self.assertTrue(all(w[1] is ops.cur for w in side.waits))
        for t in ts:                # forward goes on writing them
            t.write(99)
        got = [off.unpack(p) for p in reversed(packed)]
        for i, t in enumerate(reversed(got)):
            self.assertEqual(bytes(t.data[:1]), bytes([i]))
            self.assertIsNot(t, ts[i])       # a new tensor
        # The compute stream waits on the device for each copy back.
        self.assertEqual(sum(1 for w in ops.log if w[0] == "wait"), 4)
        self.assertEqual(ops.host_waits, 0)

    def test_small_leaf_and_host_tensors_stay(self):
        off, ops = offloader()
        small = Tensor(copy_offload.COPY_MIN_BYTES - 1)
        leaf = Tensor(4 * MiB, leaf=True)
        frozen = Tensor(4 * MiB, leaf=True, grad=False, param=True)
        view = Tensor(4 * MiB)
        view._base = leaf
        host = Tensor(4 * MiB, device=False)
        for t in (small, leaf, frozen, view, host):
            self.assertIs(off.pack(t), t)
            self.assertIs(off.unpack(t), t)
        self.assertEqual(ops.log, [])
        off2, ops2 = offloader(leaves=True)
        self.assertIsNot(off2.pack(leaf), leaf)
        self.assertEqual(len(ops2.log), 1)

    def test_saved_tensors_without_grad_move(self):
        # Normalization statistics and attention's logsumexp: leaves to
        # autograd (no grad), not parameters, held only by the graph.
        off, ops = offloader(prefetch=0)
        stats = Tensor(2 * MiB, fill=7, leaf=True, grad=False)
        rec = off.pack(stats)
        self.assertIsNot(rec, stats)
        self.assertEqual(ops.log, [("out", "side", 2 * MiB)])
        ops.run()
        got = off.unpack(rec)
        self.assertIsNot(got, stats)
        self.assertEqual(bytes(got.data[:1]), b"\x07")

    def test_budget_keeps_the_newest(self):
        off, ops = offloader(budget=5 * MiB, prefetch=0)
        ts = [Tensor(2 * MiB, fill=i) for i in range(5)]
        packed = [off.pack(t) for t in ts]
        # 5 MiB hold two of 2 MiB: the oldest three went out.
        self.assertEqual(off.stats["copied_out"], 3)
        ops.run()
        self.assertIs(off.unpack(packed[4]), ts[4])
        self.assertIs(off.unpack(packed[3]), ts[3])
        t2 = off.unpack(packed[2])
        self.assertIsNot(t2, ts[2])
        self.assertEqual(bytes(t2.data[:1]), b"\x02")

    def test_modified_in_place_while_kept_raises(self):
        off, ops = offloader(budget=64 * MiB)
        t = Tensor(2 * MiB, fill=1)
        p = off.pack(t)
        t.write(7)
        with self.assertRaisesRegex(RuntimeError, "inplace"):
            off.unpack(p)

    def test_modified_before_its_copy_stays_and_raises(self):
        off, ops = offloader(budget=2 * MiB)
        t = Tensor(2 * MiB, fill=1)
        p = off.pack(t)                  # kept: within the budget
        t.write(7)
        off.pack(Tensor(2 * MiB))        # pushes t out: modified, stays
        self.assertEqual(off.stats["modified"], 1)
        with self.assertRaisesRegex(RuntimeError, "inplace"):
            off.unpack(p)

    def test_prefetch_in_backward_order_within_the_window(self):
        off, ops = offloader(prefetch=4 * MiB)
        packed = [off.pack(Tensor(2 * MiB, fill=i)) for i in range(6)]
        ops.run()                       # every copy out is done
        ops.log.clear()
        off.unpack(packed[5])
        ins = [w for w in ops.log if w[0] == "in"]
        # Its own fetch, then two ahead (4 MiB): packed[4] and packed[3].
        self.assertEqual(len(ins), 3)
        self.assertEqual(off.stats["prefetches"], 2)
        self.assertIsNotNone(packed[4].fetched)
        self.assertIsNotNone(packed[3].fetched)
        self.assertIsNone(packed[2].fetched)
        off.unpack(packed[4])           # was ahead: one more ahead
        self.assertEqual(off.stats["fetches_on_demand"], 1)
        self.assertIsNotNone(packed[2].fetched)
        self.assertIsNone(packed[1].fetched)

    def test_unpack_while_its_copy_is_in_flight(self):
        off, ops = offloader(prefetch=4 * MiB)
        ts = [Tensor(2 * MiB, fill=i) for i in range(6)]
        packed = [off.pack(t) for t in ts]
        ops.log.clear()
        # Backward meets the newest while they are still going out: the
        # tensor itself, nothing copied back, no wait; and with 12 MiB
        # still going out, nothing fetched ahead in a 4 MiB window.
        self.assertIs(off.unpack(packed[5]), ts[5])
        self.assertEqual(ops.log, [])
        self.assertEqual(off.stats["unpacked_in_flight"], 1)
        self.assertTrue(all(p.fetched is None for p in packed))
        # Every copy finishes: the newest that backward needs next stay
        # as fetched, within the window; the older ones go.
        ops.run()
        self.assertIs(off.unpack(packed[4]), ts[4])
        self.assertEqual(off.stats["kept_for_backward"], 2)
        self.assertIs(packed[3].fetched, ts[3])
        # Then the window moves on as before, with copies from the host.
        self.assertEqual(off.stats["prefetches"], 1)
        self.assertEqual([w[0] for w in ops.log if w[0] == "in"], ["in"])
        self.assertIsNot(packed[2].fetched, ts[2])
        self.assertIsNone(packed[1].fetched)
        self.assertIs(off.unpack(packed[3]), ts[3])
        self.assertEqual(bytes(off.unpack(packed[2]).data[:1]), b"\x02")
        self.assertEqual(bytes(off.unpack(packed[1]).data[:1]), b"\x01")
        self.assertEqual(off.stats["fetches_on_demand"], 0)
        # However wide the window, what is still going out is never
        # fetched back beside itself.
        off2, ops2 = offloader(prefetch=64 * MiB)
        ps = [off2.pack(Tensor(2 * MiB)) for _ in range(3)]
        off2.unpack(ps[2])
        self.assertEqual([w for w in ops2.log if w[0] == "in"], [])

    def test_in_flight_and_modified_comes_from_the_host(self):
        off, ops = offloader(prefetch=0)
        t = Tensor(2 * MiB, fill=3)
        p = off.pack(t)
        t.write(9)                      # after the copy was taken
        got = off.unpack(p)
        self.assertIsNot(got, t)
        self.assertEqual(bytes(got.data[:1]), b"\x03")
        self.assertEqual(off.stats["unpacked_in_flight"], 0)

    def test_throttle_waits_for_the_oldest_copy(self):
        off, ops = offloader(max_inflight=5 * MiB)
        [off.pack(Tensor(2 * MiB)) for _ in range(2)]
        self.assertEqual(ops.host_waits, 0)
        off.pack(Tensor(2 * MiB))        # 6 MiB would be in flight
        self.assertEqual(ops.host_waits, 1)
        ops.run()                        # the bus caught up
        off.pack(Tensor(2 * MiB))
        self.assertEqual(ops.host_waits, 1)

    def test_drain_at_the_end_of_forward(self):
        off, ops = offloader(max_inflight=5 * MiB, prefetch=0)

        def forward(fill):
            ps = [off.pack(Tensor(2 * MiB, fill=fill + i)) for i in range(6)]
            return ps, len(off._outflight)

        # The first forward learns: its last copies stay in flight.
        ps, left = forward(0)
        self.assertGreater(left, 0)
        waits = ops.host_waits
        ops.run()
        for i in reversed(range(6)):
            self.assertEqual(bytes(off.unpack(ps[i]).data[:1]),
                             bytes([i]))
        # The next one: its last 3 copies (the window's 5 MiB) go one at
        # a time and the last is waited for, so nothing is in flight
        # when forward ends. Waits: the window's at the third copy, then
        # two to empty it at the fourth, one at the fifth and sixth, and
        # one for the sixth itself.
        ps, left = forward(10)
        self.assertEqual(left, 0)
        self.assertEqual(off.stats["drains"], 1)
        self.assertEqual(ops.host_waits - waits, 6)
        for i in reversed(range(6)):
            self.assertEqual(bytes(off.unpack(ps[i]).data[:1]),
                             bytes([10 + i]))
        # drain=False: as the first forward.
        off.configure(max_inflight=5 * MiB, prefetch=0, drain=False)
        ps, left = forward(20)
        self.assertGreater(left, 0)
        self.assertEqual(off.stats["drains"], 1)

    def test_drain_counts_packs_not_copies(self):
        # The small saved tensors stay at one shape and move at the next
        # (attention's logsumexp grows with the batch): the drain must
        # still end at the forward's last pack.
        off, ops = offloader(min_bytes=MiB, max_inflight=5 * MiB,
                             prefetch=0)

        def forward(small, fill):
            ps = []
            for i in range(4):
                ps.append(off.pack(Tensor(2 * MiB, fill=fill + i)))
                ps.append(off.pack(Tensor(small, fill=fill + i)))
            return ps, len(off._outflight)

        ps, left = forward(MiB // 2, 0)
        self.assertEqual(off.stats["copied_out"], 4)
        self.assertGreater(left, 0)
        ops.run()
        for p in reversed(ps):
            off.unpack(p)
        ps, left = forward(3 * MiB // 2, 10)
        self.assertEqual(off.stats["copied_out"], 4 + 8)
        self.assertEqual(left, 0)
        self.assertEqual(off.stats["drains"], 1)
        for i, p in reversed(list(enumerate(ps))):
            self.assertEqual(bytes(off.unpack(p).data[:1]),
                             bytes([10 + i // 2]))

    def test_block_end_waits_past_the_learned_end(self):
        off, ops = offloader(max_inflight=5 * MiB, prefetch=0)

        def forward(n):
            return [off.pack(Tensor(2 * MiB, fill=i)) for i in range(n)]

        ps = forward(3)
        # Nothing learned yet: the end of a block only reaps.
        off.scope_ended()
        self.assertEqual(len(off._outflight), 2)
        ops.run()
        for p in reversed(ps):
            off.unpack(p)
        # A longer forward: drained at its third pack, then one copy at
        # a time, and the end of the block waits for the last.
        ps = forward(5)
        self.assertEqual(off.stats["drains"], 1)
        self.assertEqual(len(off._outflight), 1)
        off.scope_ended()
        self.assertEqual(len(off._outflight), 0)
        self.assertEqual(off.stats["drains_at_exit"], 1)
        for i, p in reversed(list(enumerate(ps))):
            self.assertEqual(bytes(off.unpack(p).data[:1]), bytes([i]))

    def test_graph_freed_without_backward_lets_go(self):
        off, ops = offloader(budget=64 * MiB)
        t = Tensor(8 * MiB)
        p = off.pack(t)
        self.assertEqual(off._kept.bytes, 8 * MiB)
        del p
        gc.collect()
        self.assertEqual(off._kept.bytes, 0)
        off2, ops2 = offloader(prefetch=8 * MiB)
        ps = [off2.pack(Tensor(2 * MiB)) for _ in range(3)]
        ops2.run()
        off2.unpack(ps[2])
        self.assertEqual(off2._ahead.bytes, 4 * MiB)
        del ps
        gc.collect()
        self.assertEqual(off2._ahead.bytes, 0)

    def test_device_tensor_held_until_its_copy_is_done(self):
        import weakref
        off, ops = offloader()
        t = Tensor(2 * MiB)
        ref = weakref.ref(t)
        p = off.pack(t)
        del t
        gc.collect()
        self.assertIsNotNone(ref())     # the copy still reads it
        off.reap()
        self.assertIsNotNone(ref())
        ops.run()                       # the copy completed
        off.pack(Tensor(2 * MiB))       # every pack looks
        gc.collect()
        self.assertIsNone(ref())
        self.assertIsNotNone(p.host)

    def test_second_unpack_fetches_again(self):
        off, ops = offloader(prefetch=0)
        p = off.pack(Tensor(2 * MiB, fill=5))
        ops.run()
        a = off.unpack(p)
        b = off.unpack(p)
        self.assertIsNot(a, b)
        self.assertEqual(bytes(b.data[:1]), b"\x05")
        self.assertEqual(off.stats["fetches_on_demand"], 2)

    def test_offload_activations_options(self):
        from gmlake import activations
        # The copying offloader is the default; the same-address one's
        # options need same_address=True, or an Offloader.
        for kw in (dict(lag=2), dict(prefetch=3), dict(inplace=True)):
            with self.assertRaisesRegex(ValueError, "same_address=True"):
                activations.offload_activations(**kw)
        with self.assertRaisesRegex(ValueError, "prefetch_bytes"):
            activations.offload_activations(same_address=True,
                                            prefetch_bytes=MiB)
        with self.assertRaises(ValueError):
            activations.offload_activations(prefetch_bytes=-1)
        ctx = activations.offload_activations(budget=8 * MiB)
        self.assertFalse(ctx.same_address)
        self.assertEqual(ctx.opts["budget"], 8 * MiB)
        self.assertEqual(ctx.opts["prefetch"], copy_offload.COPY_WINDOW)
        self.assertEqual(ctx.opts["max_inflight"], copy_offload.COPY_WINDOW)
        self.assertEqual(ctx.opts["min_bytes"], copy_offload.COPY_MIN_BYTES)
        same = activations.offload_activations(same_address=True)
        self.assertEqual(same.opts["lag"], 4)
        self.assertEqual(same.opts["min_bytes"], MiB)
        self.assertEqual(same.opts["max_inflight"], activations.MAX_INFLIGHT)

    def test_context_installs_the_hooks_and_reaps_at_exit(self):
        import types
        from unittest import mock
        from gmlake import activations
        log = []

        class Hooks:
            def __init__(self, pack, unpack):
                log.append(("hooks", pack, unpack))

            def __enter__(self):
                log.append("enter")

            def __exit__(self, *exc):
                log.append("exit")
        torch = types.ModuleType("torch")
        torch.autograd = types.SimpleNamespace(graph=types.SimpleNamespace(
            saved_tensors_hooks=Hooks))
        off, ops = offloader()
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with activations.offload_activations(offloader=off,
                                                 budget=4 * MiB) as got:
                self.assertIs(got, off)
                self.assertEqual(off.budget, 4 * MiB)
                off.pack(Tensor(2 * MiB))
                off.pack(Tensor(4 * MiB))    # the 2 MiB one goes out
                ops.run()
            self.assertEqual(log[0], ("hooks", off.pack, off.unpack))
            self.assertEqual(log[1:], ["enter", "exit"])
            self.assertIsNone(off.budget)     # restored
            self.assertFalse(off._outflight)  # reaped at exit

    def test_bad_options(self):
        for kw in (dict(min_bytes=-1), dict(prefetch="x"),
                   dict(budget=-5), dict(max_inflight=True)):
            with self.assertRaises(ValueError):
                copy_offload.CopyOffloader(**kw)


if __name__ == "__main__":
    unittest.main()
