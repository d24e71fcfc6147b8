# SPDX-License-Identifier: MIT
"""Tests of gmlake.optimizer (offload_optimizer) on the emulated device;
no torch needed.

A fake optimizer stands in for torch.optim's: its step makes each
parameter's state tensor on the first call, a real libgmlake block of the
emulated device filled with known bytes, and on later calls checks that
the block is resident and its bytes are intact before it writes new ones.
So every spill and fetch the offloader makes really moves the bytes, and
a step that ran on spilled or stale state fails the test.

Environment (tests/python_test.sh sets it): GMLAKE_LIBRARY, GMLAKE_BACKEND
=emu.
"""

import ctypes
import os
import sys
import types
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gmlake  # noqa: E402
import gmlake.torch  # noqa: E402
from gmlake import _fields, _lib, _stats, offload, optimizer  # noqa: E402
from test_offload import EmuCase, FakeStorage, FakeTensor  # noqa: E402

MiB = 1 << 20
STATE = 4 * MiB             # state bytes per parameter
PARAM = 1 * MiB             # what a parameter counts for bucketing
DEVICE = 5


class FakeParam(FakeTensor):
    """A parameter: storage bytes for the bucketing, gradient hooks."""

    def __init__(self, name):
        super().__init__(FakeStorage(0x1000 + id(self), PARAM), DEVICE)
        self.name = name
        self.requires_grad = True
        self.hooks = []

    def register_post_accumulate_grad_hook(self, fn):
        self.hooks.append(fn)
        hooks = self.hooks
        return types.SimpleNamespace(remove=lambda: hooks.remove(fn))

    def grad_ready(self):
        for fn in list(self.hooks):
            fn(self)

    __hash__ = object.__hash__


class FakeAdam:
    """What the offloader uses of a torch.optim.Optimizer."""

    def __init__(self, case, params, groups=1):
        self.case = case
        per = -(-len(params) // groups)
        self.param_groups = [{"params": list(params[i:i + per]),
                              "lr": 0.1 * (1 + i // per)}
                             for i in range(0, len(params), per)]
        self.state = {}
        self.calls = []         # [(group lr, [param names])] per step call
        self.seed = 0
        self.pressure = 0       # bytes the next call allocates mid-step
        self.state_bytes = STATE

    def step(self, closure=None):
        self.calls.append([(g["lr"], [p.name for p in g["params"]])
                           for g in self.param_groups])
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state.get(p)
                self.seed += 1
                if st is None:
                    self.state[p] = {"exp_avg": self.case.tensor(
                                         self.state_bytes, self.seed),
                                     "step": FakeTensor(FakeStorage(1, 4),
                                                        DEVICE)}
                    continue
                t = st["exp_avg"]
                self.case.intact(t)
                t.digest = self.case.fill(self.case.ctx, t.ptr,
                                          self.state_bytes, self.seed)
        if self.pressure:       # a temporary of the step itself
            self.case.squeeze(self.pressure)
            self.pressure = 0
            for g in self.param_groups:
                for p in g["params"]:
                    self.case.intact(self.state[p]["exp_avg"])
        return "stepped"

    def state_dict(self):
        return {"state": self.state, "param_groups": self.param_groups}

    def load_state_dict(self, sd):
        for p in sd["state"]:
            self.seed += 1
            self.state[p] = {"exp_avg": self.case.tensor(self.state_bytes,
                                                         self.seed)}


class TestOptimizer(EmuCase):
    """OptimizerOffloader against the library (device 5's context)."""

    ENV = {"GMLAKE_EMU_CAPACITY": "96M", "GMLAKE_HOST_LIMIT": "64M"}

    def setUp(self):
        self.blocks = []
        p = self.lib.gmlake_torch_alloc(MiB, DEVICE, None)   # the context
        self.assertTrue(p, gmlake._lib.last_error(self.lib))
        self.lib.gmlake_torch_free(p, MiB, DEVICE, None)
        self.ctx = offload.torch_context(DEVICE, self.lib)
        self.room = 1 << 40     # what memory() says is free
        self.offs = []
        self.cap = None

    def tearDown(self):
        for off in self.offs:
            if getattr(off.opt, "_gmlake_offloader", None) is off:
                off.close()
            self.assertEqual(off.in_flight(), 0)
        self.offs = []
        for p, size in self.blocks:
            self.lib.gmlake_torch_free(p, size, DEVICE, None)

    def tensor(self, size, seed):
        p = self.lib.gmlake_torch_alloc(size, DEVICE, None)
        self.assertTrue(p, gmlake._lib.last_error(self.lib))
        self.blocks.append((p, size))
        t = FakeTensor(FakeStorage(p, size), DEVICE)
        t.ptr = p
        t.digest = self.fill(self.ctx, p, size, seed)
        return t

    def squeeze(self, size):
        """Allocate size bytes and free them: memory pressure."""
        p = self.lib.gmlake_torch_alloc(size, DEVICE, None)
        self.assertTrue(p, gmlake._lib.last_error(self.lib))
        self.lib.gmlake_torch_free(p, size, DEVICE, None)

    def where(self, t):
        return offload.state(self.ctx, t.untyped_storage().data_ptr(),
                             self.lib)

    def intact(self, t):
        self.assertEqual(self.where(t), offload.RESIDENT)
        self.assertEqual(self.digest(self.ctx, t.ptr,
                                     t.untyped_storage().nbytes()), t.digest)

    def resident(self):
        return _stats.raw_stats(DEVICE, self.path).resident_bytes.current

    def memory(self, dev):
        """The device's size: room free beyond what is resident now."""
        self.assertEqual(dev, DEVICE)
        if self.cap is None:
            self.cap = self.resident() + self.room
        return self.resident(), self.cap

    def set_room(self, n):
        self.cap = self.resident() + n

    def offloaded(self, nparams=5, groups=1, **opts):
        params = [FakeParam("p%d" % i) for i in range(nparams)]
        opt = FakeAdam(self, params, groups)
        opts.setdefault("bucket_bytes", 2 * PARAM)
        opts.setdefault("reserve_bytes", 0)
        opts.setdefault("keep_bytes", 0)
        off = optimizer.OptimizerOffloader(opt, library=self.lib,
                                           entries=4, memory=self.memory,
                                           **opts)
        self.offs.append(off)
        return opt, off, params

    def states(self, opt):
        return [self.where(opt.state[p]["exp_avg"])
                for g in opt.param_groups for p in g["params"]]

    def backward(self, params):
        """One backward pass: gradients arrive from the last layer."""
        for p in reversed(params):
            p.grad_ready()

    def test_buckets_spill_and_return(self):
        opt, off, params = self.offloaded()
        groups, first = opt.param_groups, opt.param_groups[0]["params"]
        self.assertEqual(opt.step(), "stepped")
        self.assertEqual(opt.calls, [[(0.1, ["p0", "p1"])],
                                     [(0.1, ["p2", "p3"])],
                                     [(0.1, ["p4"])]])
        # The groups are put back, the same objects.
        self.assertIs(opt.param_groups, groups)
        self.assertIs(opt.param_groups[0]["params"], first)
        self.assertEqual(len(first), 5)
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.SPILLED] * 5)
        self.assertEqual(off.stats["spilled_bytes"], 5 * STATE)
        # The small step counter stayed; the next steps see their state
        # (FakeAdam checks residency and bytes).
        self.assertEqual(off.stats["storages"], 5)
        for _ in range(3):
            opt.step()
            off.synchronize()
            self.assertEqual(self.states(opt), [offload.SPILLED] * 5)
        self.assertEqual(off.stats["fetches"] + off.stats["prefetches"], 15)
        self.assertGreater(off.stats["prefetches"], 0)  # ahead in the step

    def test_loaded_state_long_lived(self):
        """The state load_state_dict makes is long-lived too, like the
        first step's; the step after, with its state there, is not."""
        opt, off, params = self.offloaded(nparams=2, keep_bytes=1 << 40)
        opt.step()
        sd = opt.state_dict()
        steps = off.stats["long_lived_steps"]
        opt.load_state_dict(sd)
        self.assertEqual(off.stats["long_lived_steps"], steps + 1)
        opt.step()      # state there: no long-lived step
        off.synchronize()
        self.assertEqual(off.stats["long_lived_steps"], steps + 1)
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 2)

    def test_first_step_state_in_one_handle_each(self):
        """The state the first step makes is long-lived: a large tensor
        of it is one handle (one map), not one per chunk; the steps after
        make none and leave the mode off."""
        opt, off, params = self.offloaded(nparams=1, keep_bytes=1 << 40)
        opt.state_bytes = 32 * MiB
        self.lib.gmlake_torch_empty_cache()     # nothing cached to reuse
        self.tensor(2 * MiB, 1)     # a segment, as the model's would be
        maps = _fields.CALLS.index("mem_map")
        before = _stats.raw_stats(DEVICE, self.path).calls[maps]
        opt.step()
        after = _stats.raw_stats(DEVICE, self.path).calls[maps]
        self.assertEqual(after - before, 1)
        self.assertEqual(off.stats["long_lived_steps"], 1)
        opt.step()
        self.assertEqual(off.stats["long_lived_steps"], 1)
        self.assertEqual(self.states(opt), [offload.RESIDENT])
        # The mode is off again: a large block grows by chunks.
        p = self.lib.gmlake_torch_alloc(32 * MiB, DEVICE, None)
        self.assertTrue(p, gmlake._lib.last_error(self.lib))
        self.blocks.append((p, 32 * MiB))
        self.assertGreater(
            _stats.raw_stats(DEVICE, self.path).calls[maps] - after, 1)

    def test_groups_cut_per_bucket(self):
        opt, off, params = self.offloaded(nparams=4, groups=2,
                                          bucket_bytes=3 * PARAM)
        opt.step()
        # Bucket 0 spans both groups; bucket 1 has group 1 only, so
        # group 0 is left out of its call; lr stays each group's.
        self.assertEqual(opt.calls, [[(0.1, ["p0", "p1"]), (0.2, ["p2"])],
                                     [(0.2, ["p3"])]])
        self.assertEqual([len(g["params"]) for g in opt.param_groups],
                         [2, 2])
        self.assertEqual([[p.name for p in b] for b in off.buckets()],
                         [["p0", "p1", "p2"], ["p3"]])

    def test_prefetch_in_last_backward(self):
        opt, off, params = self.offloaded()
        for _ in range(3):          # accumulation 3, first window
            self.backward(params)
        opt.step()
        off.synchronize()
        fetched = off.stats["prefetches"] + off.stats["fetches"]
        self.backward(params)
        self.backward(params)
        self.assertEqual(off.stats["prefetches"] + off.stats["fetches"],
                         fetched)       # not the last backward yet
        self.assertEqual(self.states(opt), [offload.SPILLED] * 5)
        self.backward(params)           # the third: the last
        self.assertEqual(off.stats["backward_prefetches"], 1)
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 5)
        waits, late = off.stats["host_waits"], off.stats["late_fetches"]
        opt.step()
        self.assertEqual(off.stats["late_fetches"], late)
        self.assertEqual(off.stats["host_waits"], waits)

    def test_prefetch_budget(self):
        opt, off, params = self.offloaded()
        self.backward(params)
        opt.step()
        off.synchronize()
        self.set_room(2 * STATE + STATE // 2)   # bucket 0 only
        self.backward(params)
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 2 +
                         [offload.SPILLED] * 3)
        # Later hooks of the same backward try again with what is free.
        self.set_room(10 * STATE)
        params[0].grad_ready()
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 5)
        opt.step()
        # No room at all: nothing ahead, the step fetches bucket 0's
        # two tensors itself (the rest come ahead of their buckets).
        off.synchronize()
        self.set_room(0)
        self.backward(params)
        self.assertEqual(self.states(opt), [offload.SPILLED] * 5)
        late = off.stats["late_fetches"]
        opt.step()
        self.assertEqual(off.stats["late_fetches"], late + 2)

    def test_spills_in_flight_bounded(self):
        opt, off, params = self.offloaded(max_inflight=STATE)
        opt.step()
        # Before each of buckets 1 and 2 the step waited until at most
        # one tensor's spill was copying.
        self.assertGreaterEqual(off.stats["waits_for_bus"], 2)
        self.assertLessEqual(off._spilling, 2 * STATE)
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.SPILLED] * 5)
        opt.step()

    def test_keep_what_fits(self):
        opt, off, params = self.offloaded(keep_bytes="auto")
        opt.step()                  # no window seen: all of it spills
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.SPILLED] * 5)
        # A backward's start sees the room for bucket 0's state only.
        self.set_room(2 * STATE + STATE // 2)
        self.backward(params)
        opt.step()
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 2 +
                         [offload.SPILLED] * 3)
        self.assertEqual(off.stats["kept_bytes"], 2 * STATE)
        # Kept state is offloadable until its step: pressure takes it,
        # and the step fetches it again.
        self.squeeze(90 * MiB)
        taken = self.states(opt)[:2].count(offload.SPILLED)
        self.assertGreater(taken, 0)
        opt.step()                  # FakeAdam checks every byte
        self.assertEqual(off.stats["pressure_spills"], taken)

    def test_whole_step_when_all_fits(self):
        opt, off, params = self.offloaded(keep_bytes="auto")
        opt.step()
        off.synchronize()
        self.set_room(10 * STATE)       # all of it fits
        self.backward(params)
        opt.step()
        self.assertEqual(opt.calls[-1], [(0.1, ["p0", "p1", "p2", "p3",
                                                "p4"])])
        self.assertEqual(off.stats["whole_steps"], 1)
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 5)
        # Still a safety net: pressure takes kept state, the whole step
        # fetches it first (FakeAdam checks every byte).
        self.squeeze(90 * MiB)
        self.assertIn(offload.SPILLED, self.states(opt))
        self.backward(params)
        opt.step()
        self.assertEqual(off.stats["whole_steps"], 2)

    def test_hooks_pruned_after_first_window(self):
        params = [FakeParam("h%d" % i) for i in range(40)]
        opt = types.SimpleNamespace(param_groups=[{"params": params}],
                                    state={}, step=lambda: None,
                                    state_dict=dict, load_state_dict=print)
        off = optimizer.OptimizerOffloader(opt, library=self.lib,
                                           memory=self.memory)
        self.offs.append(off)
        self.assertEqual(sum(len(p.hooks) for p in params), 40)
        self.backward(params)
        self.backward(params)
        opt.step()
        kept = [p for p in params if p.hooks]
        self.assertLessEqual(len(kept), optimizer.HOOKS_KEPT + 1)
        self.assertIn(params[-1], kept)     # the first gradient's
        self.backward(params)
        self.backward(params)               # the count still works
        self.assertEqual(off._passes, 2)
        opt.step()
        self.assertEqual(off._accum, 2)

    def test_pressure_takes_prefetched_back(self):
        opt, off, params = self.offloaded()
        opt.step()
        off.prefetch_now(1 << 40)
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 5)
        # Prefetched state is offloadable: an allocation that needs its
        # memory gets it, and the state goes to the host.
        self.squeeze(80 * MiB)
        self.assertIn(offload.SPILLED, self.states(opt))
        opt.step()                      # FakeAdam checks every byte
        self.assertGreater(off.stats["pressure_spills"], 0)
        # Pressure in the middle of a bucket's step takes other buckets'
        # state, never the stepping one's (FakeAdam checks it after).
        off.prefetch_now(1 << 40)
        off.synchronize()
        opt.pressure = 80 * MiB
        opt.step()

    def test_no_advice_for_the_step_window(self):
        opt, off, params = self.offloaded()
        opt.step()
        opt.step()
        off.synchronize()
        # Fetched by the step itself: never offloadable, so pressure
        # cannot take a bucket between its fetch and its step.
        off.fetch_all()
        size = 80 * MiB
        p = self.lib.gmlake_torch_alloc(size, DEVICE, None)
        self.assertFalse(p)
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 5)

    def test_state_dict_and_load(self):
        opt, off, params = self.offloaded()
        opt.step()
        off.synchronize()
        sd = opt.state_dict()
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 5)
        for p in params:
            self.intact(sd["state"][p]["exp_avg"])
        opt.step()
        opt.load_state_dict(sd)         # new tensors, old records gone
        self.assertEqual(off.where(sd["state"][params[0]]["exp_avg"]), None)
        opt.step()
        off.synchronize()
        self.assertEqual(self.states(opt), [offload.SPILLED] * 5)
        self.assertEqual(off.stats["storages"], 10)

    def test_shared_storage_stays(self):
        opt, off, params = self.offloaded(nparams=4)
        opt.step()
        shared = opt.state[params[0]]["exp_avg"]
        opt.state[params[3]]["extra"] = shared      # bucket 0 and 1
        opt.step()
        off.synchronize()
        self.assertEqual(off.stats["shared_kept"], 1)
        self.assertEqual(self.where(shared), offload.RESIDENT)
        opt.step()
        self.assertEqual(self.where(shared), offload.RESIDENT)

    def test_fetch_failure_keeps_state(self):
        opt, off, params = self.offloaded()
        opt.step()
        off.synchronize()
        filler = []
        while True:                     # the device full
            p = self.lib.gmlake_torch_alloc(4 * MiB, DEVICE, None)
            if not p:
                break
            filler.append(p)
        with self.assertRaises(offload.OffloadError) as cm:
            opt.step()
        self.assertIn("stays on the host", str(cm.exception))
        self.assertIn("ENOMEM", str(cm.exception))
        for p in filler:
            self.lib.gmlake_torch_free(p, 4 * MiB, DEVICE, None)
        opt.step()                      # intact, every byte
        self.assertEqual(opt.param_groups[0]["params"], params)

    def test_refusals(self):
        opt, off, params = self.offloaded()
        with self.assertRaises(ValueError):
            opt.step(lambda: 0.0)
        with self.assertRaises(RuntimeError):
            optimizer.OptimizerOffloader(opt, library=self.lib)
        with self.assertRaises(TypeError):
            optimizer.OptimizerOffloader(object(), library=self.lib)
        with self.assertRaises(ValueError):
            optimizer.OptimizerOffloader(opt, prefetch_bytes=-1,
                                         library=self.lib)
        with self.assertRaises(ValueError):
            optimizer.OptimizerOffloader(opt, keep_bytes="all",
                                         library=self.lib)
        hidden = FakeAdam(self, [FakeParam("q")])
        hidden.flat_buffer = self.tensor(2 * MiB, 1)
        with self.assertRaises(RuntimeError) as cm:
            optimizer.OptimizerOffloader(hidden, library=self.lib)
        self.assertIn("'flat_buffer'", str(cm.exception))
        _lib.set_enabled(None, None)
        with self.assertRaises(RuntimeError) as cm:
            optimizer.offload_optimizer(FakeAdam(self, [FakeParam("r")]))
        self.assertIn("gmlake.torch.enable()", str(cm.exception))

    def test_close_restores(self):
        opt, off, params = self.offloaded()
        opt.step()
        off.close()
        self.assertNotIn("step", vars(opt))
        self.assertEqual(self.states(opt), [offload.RESIDENT] * 5)
        self.assertEqual([h for p in params for h in p.hooks], [])
        calls = len(opt.calls)
        opt.step()                      # the class's own, whole
        self.assertEqual(len(opt.calls), calls + 1)

    def test_rebound_step(self):
        """An LR scheduler made later wraps step by rebinding its
        __func__ to the optimizer."""
        opt, off, params = self.offloaded()
        func = opt.step.__func__
        opt.step = lambda *a, **k: func.__get__(opt, type(opt))(*a, **k)
        opt.step()
        self.assertEqual(len(opt.calls), 3)


if __name__ == "__main__":
    unittest.main()
