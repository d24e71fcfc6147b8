# SPDX-License-Identifier: MIT
"""Tests of gmlake.offload (the ring through ctypes) and gmlake.activations
(the saved-tensor hooks), on the emulated device; no torch needed.

The hooks run against the real library: fake tensors whose
untyped_storage().data_ptr() is a real libgmlake block of the emulated
device, allocated through the PyTorch entry points, so every spill and
fetch really moves bytes.

Environment (tests/python_test.sh sets it): GMLAKE_LIBRARY, GMLAKE_BACKEND
=emu, GMLAKE_OFFLOAD_LAYOUT (the offload_layout program).
"""

import ctypes
import errno
import gc
import hashlib
import os
import random
import subprocess
import sys
import types
import unittest
import weakref
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gmlake  # noqa: E402
import gmlake.torch  # noqa: E402
from gmlake import _lib, activations, offload  # noqa: E402

LIBRARY = os.environ.get("GMLAKE_LIBRARY")
HAVE_LIB = bool(LIBRARY) and os.path.exists(LIBRARY)
MiB = 1 << 20


def c_layout():
    """{name: value} from tests/offload_layout, or None if not built."""
    prog = os.environ.get("GMLAKE_OFFLOAD_LAYOUT")
    if not prog or not os.path.exists(prog):
        return None
    out = subprocess.run([prog], capture_output=True, text=True,
                         check=True).stdout
    c = {}
    for line in out.splitlines():
        parts = line.split()
        c[parts[0]] = tuple(int(x) for x in parts[1:])
    return c


STRUCTS = (("offload_sqe", offload.Sqe), ("offload_cqe", offload.Cqe),
           ("offload", offload.Offload))
CONSTS = {"GMLAKE_OFFLOAD_NOP": offload.NOP,
          "GMLAKE_OFFLOAD_SPILL": offload.SPILL,
          "GMLAKE_OFFLOAD_FETCH": offload.FETCH,
          "GMLAKE_OFFLOAD_PREFETCH": offload.PREFETCH,
          "GMLAKE_OFFLOAD_INPLACE": offload.INPLACE,
          "GMLAKE_OFFLOAD_SQE_INPLACE": offload.SQE_INPLACE,
          "GMLAKE_ADVISE_NOT_OFFLOADABLE": offload.ADVISE_NOT_OFFLOADABLE,
          "GMLAKE_ADVISE_OFFLOADABLE": offload.ADVISE_OFFLOADABLE,
          "GMLAKE_BLOCK_RESIDENT": offload.RESIDENT,
          "GMLAKE_BLOCK_SPILLING": offload.SPILLING,
          "GMLAKE_BLOCK_SPILLED": offload.SPILLED,
          "GMLAKE_BLOCK_FETCHING": offload.FETCHING}


def layout_diffs(c, structs=STRUCTS, consts=CONSTS):
    """Every difference between the C layout and the ctypes one."""
    diffs = []
    for cname, cls in structs:
        names = [f[0] for f in cls._fields_]
        cfields = sorted(k.split(".", 1)[1] for k in c
                         if k.startswith(cname + "."))
        if sorted(names) != cfields:
            diffs.append("%s fields: C %s, ctypes %s" % (cname, cfields,
                                                         sorted(names)))
        for name in names:
            f = getattr(cls, name)
            want = c.get("%s.%s" % (cname, name))
            if want != (f.offset, f.size):
                diffs.append("%s.%s: C %s, ctypes %s" % (
                    cname, name, want, (f.offset, f.size)))
        if c.get("sizeof." + cname) != (ctypes.sizeof(cls),):
            diffs.append("sizeof %s: C %s, ctypes %d" % (
                cname, c.get("sizeof." + cname), ctypes.sizeof(cls)))
    for name, value in consts.items():
        if c.get("const." + name) != (value,):
            diffs.append("%s: C %s, Python %d" % (name, c.get("const." +
                                                               name), value))
    return diffs


class TestLayout(unittest.TestCase):
    """The ctypes structs and constants against the C compiler's."""

    def setUp(self):
        self.c = c_layout()
        if self.c is None:
            self.skipTest("GMLAKE_OFFLOAD_LAYOUT not built")

    def test_layout(self):
        self.assertEqual(layout_diffs(self.c), [])

    def test_drift_is_seen(self):
        class Drifted(ctypes.Structure):
            _fields_ = [("user_data", ctypes.c_uint64),
                        ("res", ctypes.c_int64),
                        ("flags", ctypes.c_uint32)]
        diffs = layout_diffs(self.c, (("offload_cqe", Drifted),),
                             {"GMLAKE_OFFLOAD_FETCH": 3})
        self.assertTrue(any("offload_cqe.res" in d for d in diffs), diffs)
        self.assertTrue(any("sizeof offload_cqe" in d for d in diffs))
        self.assertTrue(any("GMLAKE_OFFLOAD_FETCH" in d for d in diffs))


def declare_core(lib):
    c = ctypes
    for name, res, args in (
            ("gmlake_ctx_init", c.c_int, [c.POINTER(c.c_void_p),
                                          c.c_void_p]),
            ("gmlake_ctx_destroy", c.c_int, [c.c_void_p, c.c_bool]),
            ("gmlake_alloc", c.c_int, [c.c_void_p, c.POINTER(c.c_void_p),
                                       c.c_size_t, c.c_void_p]),
            ("gmlake_free", c.c_int, [c.c_void_p, c.c_void_p]),
            ("gmlake_memcpy_htod", c.c_int, [c.c_void_p, c.c_void_p,
                                             c.c_void_p, c.c_size_t,
                                             c.c_void_p]),
            ("gmlake_memcpy_dtoh", c.c_int, [c.c_void_p, c.c_void_p,
                                             c.c_void_p, c.c_size_t,
                                             c.c_void_p])):
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


class EmuCase(unittest.TestCase):
    """A libgmlake on the emulated device, small limits for the test."""

    ENV = {"GMLAKE_EMU_CAPACITY": "96M", "GMLAKE_HOST_LIMIT": "64M"}

    @classmethod
    def setUpClass(cls):
        if not HAVE_LIB:
            raise unittest.SkipTest("GMLAKE_LIBRARY not set")
        if os.environ.get("GMLAKE_BACKEND") != "emu":
            raise unittest.SkipTest("needs GMLAKE_BACKEND=emu")
        cls._env = mock.patch.dict(os.environ, cls.ENV)
        cls._env.start()
        cls.path, cls.lib = gmlake.load(LIBRARY)
        declare_core(cls.lib)
        offload._declare(cls.lib)

    @classmethod
    def tearDownClass(cls):
        cls._env.stop()

    def fill(self, ctx, ptr, size, seed):
        data = random.Random(seed).randbytes(size)
        buf = ctypes.create_string_buffer(data, size)
        rc = self.lib.gmlake_memcpy_htod(ctx, ptr, buf, size, None)
        self.assertEqual(rc, 0, gmlake._lib.last_error(self.lib))
        return hashlib.sha256(data).hexdigest()

    def digest(self, ctx, ptr, size):
        buf = ctypes.create_string_buffer(size)
        rc = self.lib.gmlake_memcpy_dtoh(ctx, buf, ptr, size, None)
        if rc < 0:
            return rc
        return hashlib.sha256(buf.raw).hexdigest()


class TestRing(EmuCase):
    """offload.Ring on a context of its own (gmlake_ctx_init)."""

    def setUp(self):
        ctx = ctypes.c_void_p()
        rc = self.lib.gmlake_ctx_init(ctypes.byref(ctx), None)
        self.assertEqual(rc, 0, gmlake._lib.last_error(self.lib))
        self.ctx = ctx
        self.blocks = []

    def tearDown(self):
        for p in self.blocks:
            self.lib.gmlake_free(self.ctx, p)
        self.assertEqual(self.lib.gmlake_ctx_destroy(self.ctx, False), 0,
                         gmlake._lib.last_error(self.lib))

    def alloc(self, size):
        p = ctypes.c_void_p()
        rc = self.lib.gmlake_alloc(self.ctx, ctypes.byref(p), size, None)
        self.assertEqual(rc, 0, gmlake._lib.last_error(self.lib))
        self.blocks.append(p.value)
        return p.value

    def request(self, ring, op, ptr, data):
        sqe = ring.get_sqe()
        self.assertIsNotNone(sqe)
        {offload.SPILL: ring.prep_spill, offload.FETCH: ring.prep_fetch,
         offload.PREFETCH: ring.prep_prefetch}[op](sqe, ptr)
        ring.set_data(sqe, data)
        self.assertEqual(sqe.contents.opcode, op)
        self.assertEqual(sqe.contents.addr, ptr)
        self.assertEqual(sqe.contents.user_data, data)

    def test_spill_fetch_same_address(self):
        size = 6 * MiB + 4096
        p = self.alloc(size)
        want = self.fill(self.ctx, p, size, 1)
        with offload.Ring(self.ctx, 8, library=self.lib) as ring:
            self.request(ring, offload.SPILL, p, 11)
            self.assertEqual(ring.submit(), 1)
            self.assertEqual(ring.reap(), (11, 0))
            self.assertEqual(offload.state(self.ctx, p, self.lib),
                             offload.SPILLED)
            # While spilled, copies from the block fail (EFAULT).
            self.assertEqual(self.digest(self.ctx, p, size), -errno.EFAULT)
            self.request(ring, offload.FETCH, p, 12)
            self.assertEqual(ring.submit(), 1)
            cqe = ring.wait()
            self.assertEqual((cqe.contents.user_data, cqe.contents.res),
                             (12, 0))
            self.assertEqual(self.lib.gmlake_offload_cqe_get_data(cqe), 12)
            ring.seen(cqe)
            self.assertIsNone(ring.peek())
        self.assertEqual(offload.state(self.ctx, p, self.lib),
                         offload.RESIDENT)
        self.assertEqual(self.digest(self.ctx, p, size), want)

    def test_many_any_order(self):
        sizes = [2 * MiB, 3 * MiB + 100, 5 * MiB, 8 * MiB]
        ptrs = [self.alloc(s) for s in sizes]
        want = [self.fill(self.ctx, p, s, i)
                for i, (p, s) in enumerate(zip(ptrs, sizes))]
        with offload.Ring(self.ctx, 4, library=self.lib) as ring:
            for i, p in enumerate(ptrs):
                self.request(ring, offload.SPILL, p, 100 + i)
            self.assertIsNone(ring.get_sqe())     # 4 entries: full
            self.assertEqual(ring.submit(), 4)
            got = dict(ring.reap() for _ in ptrs)
            self.assertEqual(got, {100 + i: 0 for i in range(4)})
            for i, p in enumerate(ptrs):
                op = offload.PREFETCH if i % 2 else offload.FETCH
                self.request(ring, op, p, 200 + i)
            ring.submit()
            got = dict(ring.reap() for _ in ptrs)
            self.assertEqual(got, {200 + i: 0 for i in range(4)})
            with self.assertRaises(offload.OffloadError) as cm:
                ring.wait()             # nothing in flight
            self.assertEqual(cm.exception.errno, errno.EAGAIN)
            self.assertIn("nothing in flight", str(cm.exception))
        for p, s, w in zip(ptrs, sizes, want):
            self.assertEqual(self.digest(self.ctx, p, s), w)

    def test_inplace(self):
        size = 4 * MiB
        p = self.alloc(size)
        want = self.fill(self.ctx, p, size, 5)
        with offload.Ring(self.ctx, 2, offload.INPLACE,
                          library=self.lib) as ring:
            self.request(ring, offload.SPILL, p, 1)
            ring.submit()
            self.assertEqual(ring.reap(), (1, 0))
            self.assertEqual(offload.state(self.ctx, p, self.lib),
                             offload.SPILLED)
            self.request(ring, offload.FETCH, p, 2)
            ring.submit()
            self.assertEqual(ring.reap(), (2, 0))
        self.assertEqual(self.digest(self.ctx, p, size), want)

    def test_errors(self):
        p = self.alloc(2 * MiB)
        small = self.alloc(64 * 1024)
        with offload.Ring(self.ctx, 4, library=self.lib) as ring:
            self.request(ring, offload.FETCH, p + 4096, 1)   # not a block
            self.request(ring, offload.SPILL, small, 2)      # small block
            ring.submit()
            got = dict(ring.reap() for _ in range(2))
        self.assertEqual(got, {1: -errno.EINVAL, 2: -errno.EOPNOTSUPP})
        self.assertEqual(offload.describe(-errno.EINVAL),
                         "EINVAL (%s)" % os.strerror(errno.EINVAL))
        with self.assertRaises(offload.OffloadError) as cm:
            offload.state(self.ctx, p + 4096, self.lib)
        self.assertEqual(cm.exception.errno, errno.EINVAL)
        self.assertIn("is not a live block", str(cm.exception))
        with self.assertRaises(offload.OffloadError) as cm:
            offload.Ring(self.ctx, 0, library=self.lib)
        self.assertIn("1 to 4096", str(cm.exception))
        with self.assertRaises(offload.OffloadError) as cm:
            offload.Ring(self.ctx, 4, 0x80, library=self.lib)
        self.assertIn("unknown flags", str(cm.exception))
        with self.assertRaises(offload.OffloadError) as cm:
            offload.advise(self.ctx, small, offload.ADVISE_OFFLOADABLE,
                           self.lib)
        self.assertEqual(cm.exception.errno, errno.EOPNOTSUPP)
        offload.advise(self.ctx, p, offload.ADVISE_OFFLOADABLE, self.lib)
        ring = offload.Ring(self.ctx, 1, library=self.lib)
        ring.exit()
        with self.assertRaises(offload.OffloadError) as cm:
            ring.submit()
        self.assertIn("after exit", str(cm.exception))


# ---------------------------------------------------------------------------
# The hooks, with fake tensors over real blocks.

class FakeStorage:
    def __init__(self, ptr, nbytes):
        self.ptr, self.size = ptr, nbytes

    def data_ptr(self):
        return self.ptr

    def nbytes(self):
        return self.size


class FakeTensor:
    """What Offloader uses of a torch.Tensor."""

    def __init__(self, storage, device=3, kind="cuda", is_leaf=False,
                 base=None):
        self._storage = storage
        self.device = types.SimpleNamespace(type=kind, index=device)
        self.is_leaf = is_leaf
        self._base = base

    def untyped_storage(self):
        return self._storage

    def detach(self):
        """The same object: tests compare with assertIs."""
        return self

    def view(self):
        return FakeTensor(self._storage, self.device.index, is_leaf=False,
                          base=self)


class CountedTensor(FakeTensor):
    """A fake tensor whose storage counts the tensors on it, as PyTorch's
    storage use count does; detach makes a new alias."""

    def __init__(self, storage, device=3):
        super().__init__(storage, device)
        storage.users = getattr(storage, "users", 0) + 1

    def __del__(self):
        self._storage.users -= 1

    def detach(self):
        return CountedTensor(self._storage, self.device.index)


class TestHooks(EmuCase):
    """Offloader.pack/unpack against the library (device 3's context)."""

    DEVICE = 3

    def setUp(self):
        self.blocks = []
        self.off = activations.Offloader(lag=2, library=self.lib,
                                         entries=8, users=None)
        self.ctx = None

    def tearDown(self):
        self.off.close()
        self.assertEqual(self.off.in_flight(), 0)
        for p, size in self.blocks:
            self.lib.gmlake_torch_free(p, size, self.DEVICE, None)

    def tensor(self, size, seed):
        p = self.lib.gmlake_torch_alloc(size, self.DEVICE, None)
        self.assertTrue(p, gmlake._lib.last_error(self.lib))
        self.blocks.append((p, size))
        if self.ctx is None:
            self.ctx = offload.torch_context(self.DEVICE, self.lib)
        t = FakeTensor(FakeStorage(p, size))
        t.digest = self.fill(self.ctx, p, size, seed)
        return t

    def state(self, t):
        return offload.state(self.ctx, t.untyped_storage().data_ptr(),
                             self.lib)

    def intact(self, t):
        p, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        self.assertEqual(self.state(t), offload.RESIDENT)
        self.assertEqual(self.digest(self.ctx, p, size), t.digest)

    def test_lag_then_backward(self):
        ts = [self.tensor((2 + i) * MiB, i) for i in range(5)]
        hs = [self.off.pack(ts[0]), self.off.pack(ts[1])]
        self.assertEqual(self.off.stats["spills"], 0)    # lag 2
        self.assertEqual(self.off.where(ts[0]), activations.PENDING)
        hs.append(self.off.pack(ts[2]))
        self.assertEqual(self.off.stats["spills"], 1)    # t0 now
        self.assertIn(self.off.where(ts[0]), (activations.SPILLING,
                                              activations.SPILLED))
        hs += [self.off.pack(t) for t in ts[3:]]
        self.assertEqual(self.off.stats["spills"], 3)
        self.off.synchronize()
        for t in ts[:3]:
            self.assertEqual(self.state(t), offload.SPILLED)
        for t in ts[3:]:
            self.assertEqual(self.state(t), offload.RESIDENT)
        # Backward: the last two were never spilled.
        for h, t in reversed(list(zip(hs, ts))):
            self.assertIs(self.off.unpack(h), t)
            self.intact(t)
        self.assertEqual(self.off.stats["kept_for_backward"], 2)
        self.assertEqual(self.off.stats["fetches"] +
                         self.off.stats["prefetches"], 3)
        self.assertEqual(self.off.stats["spilled_bytes"], (2 + 3 + 4) * MiB)
        del hs, h
        gc.collect()
        self.assertEqual(self.off.tracked(), 0)

    def counted(self, size, seed):
        """A CountedTensor over a new block, and users() counting them."""
        self.off.users = lambda t: t.untyped_storage().users
        t = self.tensor(size, seed)
        c = CountedTensor(t.untyped_storage(), self.DEVICE)
        c.digest = t.digest
        return c

    def test_spills_only_what_nobody_else_holds(self):
        self.off.configure(lag=0)
        counted = self.counted
        a, b, c = (counted((2 + i) * MiB, 60 + i) for i in range(3))
        digests = [x.digest for x in (a, b, c)]
        storages = [x.untyped_storage() for x in (a, b, c)]
        ha = self.off.pack(a)       # forward still holds a: it stays
        self.assertEqual(self.off.where(a), activations.PENDING)
        hb = self.off.pack(b)
        del b                       # forward is done with b
        hc = self.off.pack(c)       # b goes now; a and c stay
        self.assertEqual(self.off.stats["spills"], 1)
        self.off.synchronize()
        self.assertEqual(self.state(ha.tensor), offload.RESIDENT)
        self.assertEqual(self.state(hb.tensor), offload.SPILLED)
        self.assertEqual(self.state(hc.tensor), offload.RESIDENT)
        self.assertGreater(self.off.stats["waits_for_users"], 0)
        del a
        self.off.pack(counted(2 * MiB, 70))     # a goes, c stays (held)
        self.off.synchronize()
        self.assertEqual(self.state(ha.tensor), offload.SPILLED)
        self.assertEqual(self.state(hc.tensor), offload.RESIDENT)
        for h, d, st in zip((hc, hb, ha), reversed(digests),
                            reversed(storages)):
            self.off.unpack(h)
            self.assertEqual(self.digest(self.ctx, st.data_ptr(),
                                         st.nbytes()), d)

    def test_budget_keeps_the_newest(self):
        self.off.configure(lag=0, budget=2 * 4 * MiB)
        ts = [self.tensor(4 * MiB, 40 + i) for i in range(5)]
        hs = [self.off.pack(t) for t in ts]
        # The oldest three spill; the newest two fit in the budget.
        self.assertEqual(self.off.stats["spills"], 3)
        self.off.spill_waiting()        # leaving: down to the budget only
        self.assertEqual(self.off.stats["spills"], 3)
        self.off.synchronize()
        self.assertEqual([self.state(t) for t in ts],
                         [offload.SPILLED] * 3 + [offload.RESIDENT] * 2)
        for h, t in reversed(list(zip(hs, ts))):
            self.assertIs(self.off.unpack(h), t)
            self.intact(t)
        self.assertEqual(self.off.stats["fetches"] +
                         self.off.stats["prefetches"], 3)
        # A larger saved tensor pushes more out: what stays is bytes.
        self.off.configure(lag=0, budget=6 * MiB)
        big = self.tensor(8 * MiB, 50)
        small = self.tensor(4 * MiB, 51)
        h1, h2 = self.off.pack(small), self.off.pack(big)
        self.assertIn(self.off.where(small), (activations.SPILLING,
                                              activations.SPILLED))
        del h1, h2
        with self.assertRaises(ValueError):
            self.off.configure(budget=-1)

    def test_spill_waiting(self):
        """Leaving the context spills what waits for its lag unless a
        tensor of the program still holds it, and nothing when users
        cannot be counted."""
        self.off.configure(lag=4)
        a, b, c = (self.counted((2 + i) * MiB, 90 + i) for i in range(3))
        digests = [x.digest for x in (a, b, c)]
        hs = [self.off.pack(x) for x in (a, b, c)]
        del b, c                    # forward still holds a
        self.assertEqual(self.off.stats["spills"], 0)      # lag 4
        self.off.spill_waiting()
        self.assertEqual(self.off.stats["spills"], 2)
        self.off.synchronize()
        self.assertEqual([self.state(h.tensor) for h in hs],
                         [offload.RESIDENT] + [offload.SPILLED] * 2)
        self.off.users = None
        del a
        self.off.spill_waiting()
        self.assertEqual(self.off.stats["spills"], 2)
        for h, d in zip(reversed(hs), reversed(digests)):
            self.off.unpack(h)
            st = h.tensor.untyped_storage()
            self.assertEqual(self.digest(self.ctx, st.data_ptr(),
                                         st.nbytes()), d)

    def test_inflight_cap(self):
        """Past max_inflight bytes spilling, pack waits for completions;
        a spill larger than the cap still goes, alone."""
        for cap, waits in ((3 * MiB, 3), (0, 3), (None, 0)):
            with self.subTest(cap=cap):
                self.off = activations.Offloader(
                    lag=0, library=self.lib, entries=8, users=None,
                    max_inflight=cap)
                ts = [self.tensor(2 * MiB, 80 + i) for i in range(4)]
                hs = []
                for t in ts:
                    hs.append(self.off.pack(t))
                    if cap is not None:
                        self.assertLessEqual(self.off.spilling(),
                                             max(cap, 2 * MiB))
                self.assertEqual(self.off.stats["waits_for_bus"], waits)
                self.assertEqual(self.off.stats["spills"], 4)
                for h, t in reversed(list(zip(hs, ts))):
                    self.assertIs(self.off.unpack(h), t)
                    self.intact(t)
                self.assertEqual(self.off.spilling(), 0)
                self.off.close()
        with self.assertRaises(ValueError):
            self.off.configure(max_inflight=-1)

    def test_prefetch_order(self):
        self.off.configure(lag=1, prefetch=2)
        ts = [self.tensor(2 * MiB, 10 + i) for i in range(6)]
        hs = [self.off.pack(t) for t in ts]
        self.off.synchronize()
        self.assertEqual([self.state(t) for t in ts],
                         [offload.SPILLED] * 5 + [offload.RESIDENT])
        # Backward starts: 5 was never spilled; 4 and 3 come ahead.
        self.assertIs(self.off.unpack(hs[5]), ts[5])
        self.assertEqual(self.off.stats["prefetches"], 2)
        self.off.synchronize()
        self.assertEqual([self.state(t) for t in ts],
                         [offload.SPILLED] * 3 + [offload.RESIDENT] * 3)
        # 4 is needed now and 3 is back already: one more comes, so two
        # stay ahead however far the bus runs ahead of backward.
        for i in (4, 3, 2, 1, 0):
            self.assertIs(self.off.unpack(hs[i]), ts[i])  # already there
            self.assertEqual(self.off.stats["fetches"], 0)
            self.assertEqual(self.off.stats["prefetches"], min(7 - i, 5))
            self.off.synchronize()
            self.assertEqual([self.state(t) for t in ts],
                             [offload.SPILLED] * max(i - 2, 0) +
                             [offload.RESIDENT] * (6 - max(i - 2, 0)))
        self.assertEqual(self.off.stats["ahead_bytes_peak"], 2 * 2 * MiB)
        for t in ts:
            self.intact(t)

    def test_window_skips_what_backward_passed(self):
        """Saved tensors whose nodes backward never runs (off the loss's
        path) are not fetched ahead and do not hold the window shut."""
        self.off.configure(lag=0, prefetch=2)
        ts = [self.tensor(2 * MiB, 30 + i) for i in range(6)]
        hs = [self.off.pack(t) for t in ts]
        self.off.synchronize()
        for i in (2, 1, 0):     # 5, 4 and 3 are never unpacked
            self.assertIs(self.off.unpack(hs[i]), ts[i])
            self.off.synchronize()
        self.assertEqual(self.off.stats["fetches"], 1)
        self.assertEqual(self.off.stats["prefetches"], 2)
        for t in ts[:3]:
            self.intact(t)
        for t in ts[3:]:
            self.assertEqual(self.state(t), offload.SPILLED)

    def test_window_frees_what_backward_passed(self):
        """A storage fetched ahead whose node backward then skips leaves
        the window when backward goes past it, so the next one comes
        ahead."""
        self.off.configure(lag=0, prefetch=1)
        ts = [self.tensor(2 * MiB, 50 + i) for i in range(4)]
        hs = [self.off.pack(t) for t in ts]
        self.off.synchronize()
        self.off.unpack(hs[3])          # fetches 3, 2 comes ahead
        self.off.synchronize()
        self.off.unpack(hs[1])          # 2 is passed: 0 comes ahead
        self.off.synchronize()
        self.assertEqual(self.state(ts[0]), offload.RESIDENT)
        self.off.unpack(hs[0])
        self.assertEqual(self.off.stats["fetches"], 2)     # 3 and 1
        self.assertEqual(self.off.stats["prefetches"], 2)  # 2 and 0
        for i in (3, 1, 0):
            self.intact(ts[i])

    def test_repacked_after_prefetch(self):
        """A storage saved again after its prefetch and spilled again is
        prefetched again, not counted ahead forever."""
        self.off.configure(lag=0, prefetch=1)
        ts = [self.tensor(2 * MiB, 40 + i) for i in range(3)]
        hs = [self.off.pack(t) for t in ts]
        self.off.synchronize()
        self.off.unpack(hs[2])          # fetches 2, prefetches 1
        self.off.synchronize()
        self.assertEqual(self.state(ts[1]), offload.RESIDENT)
        hs.append(self.off.pack(ts[1]))     # saved again: spills again
        self.off.synchronize()
        self.assertEqual(self.state(ts[1]), offload.SPILLED)
        self.assertEqual(self.off._ahead, [])
        self.off.unpack(hs[3])
        self.assertEqual(self.off.stats["prefetches"], 2)  # t1, then t0
        for h in (hs[1], hs[0]):
            self.off.unpack(h)
        for t in ts:
            self.intact(t)

    def test_shared_storage_once(self):
        t = self.tensor(4 * MiB, 20)
        views = [t.view(), t.view(), t]
        others = [self.tensor(2 * MiB, 21 + i) for i in range(3)]
        hs = [self.off.pack(v) for v in views]
        self.assertEqual(self.off.tracked(), 1)
        hs += [self.off.pack(o) for o in others]
        self.assertEqual(self.off.stats["storages"], 4)
        self.off.synchronize()
        self.assertEqual(self.state(t), offload.SPILLED)
        self.assertEqual(self.off.stats["spills"], 2)    # t once, others[0]
        for h in reversed(hs):
            self.off.unpack(h)
        self.assertEqual(self.off.stats["fetches"] +
                         self.off.stats["prefetches"], 2)
        for i, v in enumerate(views):
            self.assertIs(self.off.unpack(hs[i]), v)
        self.intact(t)

    def test_repack_while_spilled(self):
        t = self.tensor(3 * MiB, 30)
        h0 = self.off.pack(t)
        hs = [self.off.pack(self.tensor(2 * MiB, 31 + i)) for i in range(2)]
        self.off.synchronize()
        self.assertEqual(self.state(t), offload.SPILLED)
        h1 = self.off.pack(t.view())     # forward reads it again
        self.assertEqual(self.off.stats["refetches"], 1)
        self.intact(t)
        self.assertEqual(self.off.where(t), activations.PENDING)
        for h in (h1, *reversed(hs), h0):
            self.off.unpack(h)
        self.intact(t)

    def test_kept_as_is(self):
        self.off.configure(lag=0)
        t = self.tensor(2 * MiB, 40)
        leaf = FakeTensor(t.untyped_storage(), is_leaf=True)
        view_of_leaf = leaf.view()
        cpu = FakeTensor(FakeStorage(1 << 40, 8 * MiB), kind="cpu")
        small = FakeTensor(FakeStorage(t.untyped_storage().data_ptr(),
                                       4096))
        for x in (leaf, view_of_leaf, cpu, small):
            self.assertIs(self.off.pack(x), x)
            self.assertIs(self.off.unpack(x), x)
        self.assertEqual(self.off.stats["kept"], 4)
        self.assertEqual(self.off.stats["spills"], 0)
        self.assertEqual(self.off.tracked(), 0)

    def test_keeps_a_detached_alias(self):
        t = self.tensor(2 * MiB, 45)
        alias = FakeTensor(t.untyped_storage())
        live = FakeTensor(t.untyped_storage())
        live.detach = lambda: alias
        h = self.off.pack(live)
        self.assertIs(h.tensor, alias)
        self.assertIs(self.off.unpack(h), alias)
        leaf = FakeTensor(t.untyped_storage(), is_leaf=True)
        leaf.detach = lambda: alias
        self.assertIs(self.off.pack(leaf), alias)

    def test_unmovable_stays(self):
        self.off.configure(lag=0, min_bytes=0)
        p = self.lib.gmlake_torch_alloc(64 * 1024, self.DEVICE, None)
        self.blocks.append((p, 64 * 1024))
        small = FakeTensor(FakeStorage(p, 64 * 1024))
        odd = self.tensor(2 * MiB, 41)
        inner = FakeTensor(FakeStorage(odd.untyped_storage().data_ptr() +
                                       MiB, MiB))
        hs = [self.off.pack(small), self.off.pack(inner)]
        self.off.synchronize()
        self.assertEqual(self.off.stats["spill_EOPNOTSUPP"], 1)
        self.assertEqual(self.off.stats["spill_EINVAL"], 1)
        self.assertIs(self.off.unpack(hs[0]), small)
        self.assertIs(self.off.unpack(hs[1]), inner)
        self.intact(odd)

    def test_fetch_failure_keeps_data(self):
        t = self.tensor(24 * MiB, 50)
        h = self.off.pack(t)
        hs = [self.off.pack(self.tensor(2 * MiB, 51 + i)) for i in range(2)]
        self.off.synchronize()
        self.assertEqual(self.state(t), offload.SPILLED)
        fillers = []
        while True:       # take the emulated device's memory
            q = self.lib.gmlake_torch_alloc(8 * MiB, self.DEVICE, None)
            if not q:
                break
            fillers.append(q)
        self.assertTrue(fillers)
        try:
            with self.assertRaises(offload.OffloadError) as cm:
                self.off.unpack(h)
            self.assertIsInstance(cm.exception, RuntimeError)
            self.assertEqual(cm.exception.errno, errno.ENOMEM)
            self.assertIn("stays on the host", str(cm.exception))
            self.assertEqual(self.state(t), offload.SPILLED)
        finally:
            for q in fillers:
                self.lib.gmlake_torch_free(q, 8 * MiB, self.DEVICE, None)
        self.assertIs(self.off.unpack(h), t)    # tried again: works
        self.intact(t)
        for x in reversed(hs):
            self.off.unpack(x)

    def test_references_until_reaped(self):
        t = self.tensor(6 * MiB, 60)
        ref = weakref.ref(t)
        h = self.off.pack(t)
        hs = [self.off.pack(self.tensor(2 * MiB, 61 + i)) for i in range(2)]
        self.assertEqual(self.off.where(t), activations.SPILLING)
        digest = t.digest
        del t, h
        gc.collect()
        # The record still holds the tensor: its spill is not reaped.
        self.assertEqual(self.off.tracked(), 3)
        self.assertIsNotNone(ref())
        self.off.synchronize()
        # Spilled without a handle: fetched back, then let go.
        self.assertEqual(self.off.stats["fetched_on_release"], 1)
        self.assertIsNone(ref())
        self.assertEqual(self.off.tracked(), 2)
        p, size = self.blocks[0]
        self.assertEqual(offload.state(self.ctx, p, self.lib),
                         offload.RESIDENT)
        self.assertEqual(self.digest(self.ctx, p, size), digest)
        del hs
        gc.collect()
        self.off.synchronize()
        self.assertEqual(self.off.tracked(), 0)

    def test_unknown_completion_recorded(self):
        t = self.tensor(2 * MiB, 70)
        hs = [self.off.pack(t)] + [self.off.pack(self.tensor(2 * MiB, 71 +
                                                             i))
                                   for i in range(2)]
        ring = self.off._rings[self.DEVICE]
        sqe = ring.get_sqe()
        self.lib.gmlake_offload_sqe_set_data(sqe, 1 << 60)   # a NOP
        ring.submit()
        for h in reversed(hs):
            self.off.unpack(h)
        self.off.synchronize()
        self.assertEqual(self.off.unknown, {1 << 60: 0})
        self.intact(t)

    def test_bad_options(self):
        with self.assertRaises(ValueError):
            activations.Offloader(lag=-1)


def fake_torch():
    torch = types.ModuleType("torch")
    torch.log = []

    class Hooks:
        def __init__(self, pack, unpack):
            self.pack, self.unpack = pack, unpack

        def __enter__(self):
            torch.log.append(("enter", self.pack, self.unpack))

        def __exit__(self, *exc):
            torch.log.append(("exit",))
    torch.autograd = types.SimpleNamespace(graph=types.SimpleNamespace(
        saved_tensors_hooks=Hooks))
    return torch


class TestContext(unittest.TestCase):

    def tearDown(self):
        _lib.set_enabled(None, None)

    def test_needs_enable(self):
        _lib.set_enabled(None, None)
        with mock.patch.dict(sys.modules, {"torch": fake_torch()}):
            with self.assertRaises(RuntimeError) as cm:
                with gmlake.torch.offload_activations(same_address=True):
                    pass
        self.assertIn("gmlake.torch.enable()", str(cm.exception))

    def test_hooks_and_options(self):
        _lib.set_enabled(LIBRARY or "libgmlake.so", "ctypes")
        off = activations.Offloader(library=LIBRARY)
        torch = fake_torch()
        with mock.patch.dict(sys.modules, {"torch": torch}):
            with gmlake.torch.offload_activations(lag=7, inplace=True,
                                                  offloader=off) as got:
                self.assertIs(got, off)
                self.assertEqual((off.lag, off.prefetch, off.inplace),
                                 (7, 7, True))
        self.assertEqual(torch.log[0], ("enter", off.pack, off.unpack))
        self.assertEqual(torch.log[1], ("exit",))
        self.assertEqual((off.lag, off.inplace), (4, False))  # restored
        # Leaving spills what waits, unless forward raised.
        with mock.patch.object(off, "spill_waiting") as spill, \
                mock.patch.dict(sys.modules, {"torch": torch}):
            with gmlake.torch.offload_activations(offloader=off):
                pass
            self.assertEqual(spill.call_count, 1)
            with self.assertRaises(KeyError):
                with gmlake.torch.offload_activations(offloader=off):
                    raise KeyError("forward failed")
            self.assertEqual(spill.call_count, 1)
        with self.assertRaises(ValueError):
            gmlake.torch.offload_activations(prefetch=-2)


if __name__ == "__main__":
    unittest.main()
