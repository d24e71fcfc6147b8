# SPDX-License-Identifier: MIT
"""Tests of gmlake.optimizer_state on the emulated device; no torch needed.

A fake torch whose tensors are real libgmlake blocks (gmlake_torch_alloc
on the emulated device, freed when their last tensor lets go), with a
storage use count as PyTorch's: so where settle() puts a copy is where
libgmlake placed it, and the bytes it copies are read back.

Environment (tests/python_test.sh sets it): GMLAKE_LIBRARY, GMLAKE_BACKEND
=emu.
"""

import contextlib
import ctypes
import itertools
import os
import sys
import types
import unittest
import warnings
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gmlake  # noqa: E402
import gmlake.torch  # noqa: E402
from gmlake import _lib, optimizer_state  # noqa: E402

LIBRARY = os.environ.get("GMLAKE_LIBRARY")
HAVE_LIB = bool(LIBRARY) and os.path.exists(LIBRARY)
ON_EMU = os.environ.get("GMLAKE_BACKEND") == "emu"
MiB = 1 << 20
# A context of its own for each test (the emulated device has 128): the
# placements asserted start from an empty one.
DEVICES = itertools.count(40)


def _ctx(lib, device):
    ctx = ctypes.c_void_p()
    rc = lib.gmlake_torch_ctx_get(device, ctypes.byref(ctx))
    assert rc == 0, _lib.last_error(lib)
    return ctx


def read_block(lib, device, ptr, n):
    buf = (ctypes.c_uint8 * n)()
    rc = lib.gmlake_memcpy_dtoh(_ctx(lib, device), buf, ptr, n, None)
    assert rc == 0, _lib.last_error(lib)
    return buf


def write_block(lib, device, ptr, buf):
    rc = lib.gmlake_memcpy_htod(_ctx(lib, device), ptr, buf, len(buf), None)
    assert rc == 0, _lib.last_error(lib)


def fake_torch(lib, device):
    """A torch module with what optimizer_state uses, on lib's blocks of
    device."""
    torch = types.ModuleType("torch")
    torch.capturing = False
    torch.compiling = False
    torch.fail_alloc = None
    torch.pre_hooks, torch.post_hooks = [], []

    class Storage:
        def __init__(self, nbytes):
            if torch.fail_alloc:
                raise RuntimeError(torch.fail_alloc)
            self.ptr = lib.gmlake_torch_alloc(nbytes, device, None)
            if not self.ptr:
                raise RuntimeError(_lib.last_error(lib))
            self.size, self.refs = nbytes, 0
            self._cdata = self

        def nbytes(self):
            return self.size

        def data_ptr(self):
            return self.ptr

        def drop(self):
            self.refs -= 1
            if not self.refs:
                lib.gmlake_torch_free(self.ptr, self.size, device, None)

    class Tensor:
        def __init__(self, storage):
            self._storage = storage
            storage.refs += 1
            self.device = types.SimpleNamespace(type="cuda", index=device)
            self.is_cuda, self.requires_grad = True, False

        def __del__(self):
            self._storage.drop()

        def numel(self):
            return self._storage.size

        def element_size(self):
            return 1

        def is_inference(self):
            return False

        def storage_offset(self):
            return 0

        def is_contiguous(self):
            return True

        def untyped_storage(self):
            return self._storage

        def data_ptr(self):
            return self._storage.ptr

        def view(self):
            return Tensor(self._storage)

        def copy_(self, src):
            write_block(lib, device, self.data_ptr(),
                        read_block(lib, device, src.data_ptr(), src.numel()))
            return self

        def set_(self, src):
            src._storage.refs += 1
            self._storage.drop()
            self._storage = src._storage
            return self

    torch.Tensor = Tensor
    torch.Storage = Storage
    torch.empty = lambda n, device=None: Tensor(Storage(n))
    torch.empty_like = lambda t: Tensor(Storage(t.numel()))
    torch.no_grad = contextlib.nullcontext
    torch._C = types.SimpleNamespace(
        _storage_Use_Count=lambda cdata: cdata.refs)
    torch.compiler = types.SimpleNamespace(
        is_compiling=lambda: torch.compiling)
    torch.cuda = types.SimpleNamespace(
        is_current_stream_capturing=lambda: torch.capturing)

    def registrar(hooks):
        def register(fn):
            hooks.append(fn)
            return fn
        return register
    torch.optim = types.ModuleType("torch.optim")
    torch.optim.optimizer = types.ModuleType("torch.optim.optimizer")
    torch.optim.optimizer.register_optimizer_step_pre_hook = \
        registrar(torch.pre_hooks)
    torch.optim.optimizer.register_optimizer_step_post_hook = \
        registrar(torch.post_hooks)
    torch.modules = {"torch.optim": torch.optim,
                     "torch.optim.optimizer": torch.optim.optimizer}
    return torch


class FakeOptimizer:
    """optimizer.state as torch.optim keeps it; weakly referable."""

    def __init__(self):
        self.state = {}


class InitGroupOptimizer(FakeOptimizer):
    """An optimizer that makes its state as torch.optim's Adam does: in
    _init_group, called by step() for each parameter group, with the
    global step hooks around step()."""

    def __init__(self, torch, params, nbytes):
        super().__init__()
        self.torch, self.nbytes = torch, nbytes
        self.param_groups = [{"params": params}]
        self.init_calls = 0

    def _init_group(self, group, made):
        self.init_calls += 1
        for p in group["params"]:
            if not self.state.get(p):
                t = self.torch.empty(self.nbytes)
                self.state[p] = {"exp_avg": t}
                made.append(t)

    def step(self):
        for hook in self.torch.pre_hooks:
            hook(self, (), {})
        made = []
        for group in self.param_groups:
            self._init_group(group, made)
        for hook in self.torch.post_hooks:
            hook(self, (), {})
        return made


@unittest.skipUnless(HAVE_LIB and ON_EMU, "needs GMLAKE_LIBRARY and "
                     "GMLAKE_BACKEND=emu")
class TestSettle(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.path, cls.lib = gmlake.load(LIBRARY)
        for name in ("gmlake_memcpy_htod", "gmlake_memcpy_dtoh"):
            f = getattr(cls.lib, name)
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

    def setUp(self):
        _lib.set_enabled(self.path, "ctypes")
        self._env = mock.patch.dict(os.environ,
                                    {"GMLAKE_EMU_CAPACITY": "1G"})
        self._env.start()
        self.device = next(DEVICES)
        self.torch = fake_torch(self.lib, self.device)
        self._mods = mock.patch.dict(sys.modules, {"torch": self.torch,
                                                   **self.torch.modules})
        self._mods.start()
        optimizer_state._base_count.clear()

    def tearDown(self):
        self._env.stop()
        self._mods.stop()
        _lib.set_enabled(None, None)

    def hooks(self):
        """No hooks installed and copying off, for the test's install()."""
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(optimizer_state, "_hooks",
                                              None))
        stack.enter_context(mock.patch.object(optimizer_state, "_copy",
                                              False))
        return stack

    def fill(self, t, byte):
        buf = (ctypes.c_uint8 * t.numel())()
        ctypes.memset(buf, byte, t.numel())
        write_block(self.lib, self.device, t.data_ptr(), buf)

    def read(self, t):
        return bytes(read_block(self.lib, self.device, t.data_ptr(),
                                t.numel()))

    def step0(self):
        """A model, state that stays (a small tensor, one with a view, a
        scalar), and a large state tensor made in the hole a step's
        activations left, with room left in it for a copy."""
        T = self.torch
        act = T.empty(200 * MiB)
        self.model = T.empty(400 * MiB)
        small, aliased = T.empty(4 * MiB), T.empty(40 * MiB)
        self.view = aliased.view()
        hole = act.data_ptr()
        del act
        big = T.empty(64 * MiB)
        for t, byte in ((big, 0x5a), (small, 0x11), (aliased, 0x22)):
            self.fill(t, byte)
        opt = FakeOptimizer()
        opt.state["p"] = {"exp_avg": big, "small": small,
                          "aliased": aliased, "step": 3}
        return opt, hole

    def test_settle_moves_large_state_past_the_holes(self):
        opt, hole = self.step0()
        big, small, aliased = (opt.state["p"][k] for k in
                               ("exp_avg", "small", "aliased"))
        in_hole = range(hole, hole + 200 * MiB)
        self.assertIn(big.data_ptr(), in_hole)
        was = (small.data_ptr(), aliased.data_ptr())
        self.assertEqual(gmlake.torch.settle_optimizer_state(opt), 1)
        self.assertIs(opt.state["p"]["exp_avg"], big)
        self.assertNotIn(big.data_ptr(), in_hole)
        self.assertEqual(self.read(big), b"\x5a" * (64 * MiB))
        self.assertEqual((small.data_ptr(), aliased.data_ptr()), was)
        self.assertEqual(opt.state["p"]["step"], 3)
        # The mode is off again.
        self.assertLess(self.lib.gmlake_torch_long_lived(self.device, 0), 0)

    def test_left_alone(self):
        opt, _ = self.step0()
        big = opt.state["p"]["exp_avg"]
        ptr = big.data_ptr()
        opt._gmlake_offloader = object()        # offload_optimizer's
        self.assertEqual(optimizer_state.settle(opt), 0)
        opt._gmlake_offloader = None
        self.torch.capturing = True
        self.assertEqual(optimizer_state.settle(opt), 0)
        self.torch.capturing, self.torch.compiling = False, True
        self.assertEqual(optimizer_state.settle(opt), 0)
        self.torch.compiling = False
        _lib.set_enabled(None, None)            # not PyTorch's allocator
        self.assertEqual(optimizer_state.settle(opt), 0)
        self.assertEqual(big.data_ptr(), ptr)

    def test_hook_settles_each_optimizer_once(self):
        with self.hooks():
            self.assertTrue(optimizer_state.install(copy=True))
            self.assertTrue(optimizer_state.install())   # copy stays on
            self.assertEqual(len(self.torch.pre_hooks), 1)
            self.assertEqual(len(self.torch.post_hooks), 1)
            hook = self.torch.post_hooks[0]
            empty = FakeOptimizer()
            hook(empty, (), {})                 # no state yet: later
            self.assertNotIn(empty, optimizer_state._settled)
            opt, _ = self.step0()
            big = opt.state["p"]["exp_avg"]
            was = big.data_ptr()
            hook(opt, (), {})
            moved = big.data_ptr()
            self.assertNotEqual(moved, was)
            with mock.patch.object(optimizer_state, "settle") as settle:
                hook(opt, (), {})
            settle.assert_not_called()
            self.assertEqual(big.data_ptr(), moved)

    def test_hook_failure_warns_and_keeps_state(self):
        with self.hooks():
            optimizer_state.install(copy=True)
            opt, _ = self.step0()
            big = opt.state["p"]["exp_avg"]
            ptr = big.data_ptr()
            self.torch.fail_alloc = "CUDA out of memory"
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                self.torch.post_hooks[0](opt, (), {})
            self.torch.fail_alloc = None
            self.assertEqual(len(w), 1)
            self.assertIn("optimizer state left in place: CUDA out of "
                          "memory", str(w[0].message))
            self.assertEqual(big.data_ptr(), ptr)
            self.assertEqual(self.read(big), b"\x5a" * (64 * MiB))
            self.assertLess(
                self.lib.gmlake_torch_long_lived(self.device, 0), 0)

    def test_hooks_make_state_past_the_holes(self):
        """State made in _init_group in the first step lands past the
        activations' hole in place: not copied there afterwards."""
        T = self.torch
        with self.hooks():
            optimizer_state.install(copy=True)
            params = [T.empty(64 * MiB), T.empty(64 * MiB)]
            act = T.empty(300 * MiB)
            in_hole = range(act.data_ptr(), act.data_ptr() + 300 * MiB)
            del act
            opt = InitGroupOptimizer(T, params, 64 * MiB)
            with mock.patch.object(optimizer_state, "_settle",
                                   wraps=optimizer_state._settle) as settle, \
                    mock.patch.object(T, "empty_like",
                                      wraps=T.empty_like) as copy:
                made = opt.step()
            self.assertEqual(len(made), 2)
            for t in made:
                self.assertNotIn(t.data_ptr(), in_hole)
            # Placed where they were made: the post-hook copied none.
            settle.assert_called_once()
            self.assertEqual(settle.call_args.args[2],
                             {id(t) for t in made})
            copy.assert_not_called()
            self.assertNotIn("_init_group", vars(opt))
            self.assertLess(self.lib.gmlake_torch_long_lived(self.device, 0),
                            0)
            # Later steps run the optimizer's own _init_group, unwrapped.
            self.assertEqual(opt.step(), [])
            self.assertNotIn("_init_group", vars(opt))
            self.assertEqual(opt.init_calls, 2)
            # The hole is the next step's activations' again.
            act = T.empty(300 * MiB)
            self.assertIn(act.data_ptr(), in_hole)

    def test_default_places_and_copies_nothing(self):
        """install() without copy: state made in _init_group is placed,
        state made elsewhere stays where it was made."""
        T = self.torch
        with self.hooks():
            optimizer_state.install()
            params = [T.empty(64 * MiB)]
            act = T.empty(300 * MiB)
            in_hole = range(act.data_ptr(), act.data_ptr() + 300 * MiB)
            del act
            opt = InitGroupOptimizer(T, params, 64 * MiB)
            with mock.patch.object(optimizer_state, "_settle") as settle:
                made = opt.step()
            self.assertNotIn(made[0].data_ptr(), in_hole)
            settle.assert_not_called()
            self.assertIn(opt, optimizer_state._settled)
            # State made outside _init_group (SGD's momentum) stays.
            other, _ = self.step0()
            big = other.state["p"]["exp_avg"]
            ptr = big.data_ptr()
            for hook in T.post_hooks:
                hook(other, (), {})
            self.assertEqual(big.data_ptr(), ptr)
            self.assertIn(other, optimizer_state._settled)

    def test_hooks_leave_subclass_params_alone(self):
        """An optimizer with a tensor subclass among its parameters
        (FSDP2's DTensors) makes its state where it would without the
        hooks, and is not looked at again."""
        T = self.torch

        class DTensor(T.Tensor):
            pass

        with self.hooks():
            optimizer_state.install(copy=True)
            act = T.empty(300 * MiB)
            in_hole = range(act.data_ptr(), act.data_ptr() + 300 * MiB)
            params = [T.empty(64 * MiB), DTensor(T.Storage(64 * MiB))]
            del act
            opt = InitGroupOptimizer(T, params, 64 * MiB)
            with mock.patch.object(optimizer_state, "_settle") as settle:
                made = opt.step()
            self.assertEqual(len(made), 2)
            for t in made:
                self.assertIn(t.data_ptr(), in_hole)
            settle.assert_not_called()
            self.assertNotIn("_init_group", vars(opt))
            self.assertIn(opt, optimizer_state._settled)
            # Plain parameters alone: placed past the first hole's free
            # rest and a second hole.
            act = T.empty(300 * MiB)
            second = range(act.data_ptr(), act.data_ptr() + 300 * MiB)
            del act
            plain = InitGroupOptimizer(T, params[:1], 64 * MiB)
            ptr = plain.step()[0].data_ptr()
            self.assertNotIn(ptr, in_hole)
            self.assertNotIn(ptr, second)

    def test_hooks_leave_placing_off_when_not_ours(self):
        T = self.torch
        with self.hooks():
            optimizer_state.install()
            act = T.empty(300 * MiB)
            in_hole = range(act.data_ptr(), act.data_ptr() + 300 * MiB)
            params = [T.empty(64 * MiB)]
            del act
            offloaded = InitGroupOptimizer(T, params, 64 * MiB)
            offloaded._gmlake_offloader = object()
            self.assertIn(offloaded.step()[0].data_ptr(), in_hole)
            self.assertNotIn("_init_group", vars(offloaded))
            T.compiling = True                  # torch.compile traces
            traced = InitGroupOptimizer(T, params, 64 * MiB)
            self.assertIn(traced.step()[0].data_ptr(), in_hole)
            self.assertNotIn("_init_group", vars(traced))
            T.compiling = False
            _lib.set_enabled(None, None)        # not PyTorch's allocator
            plain = InitGroupOptimizer(T, params, 64 * MiB)
            self.assertIn(plain.step()[0].data_ptr(), in_hole)

    def test_hooks_after_a_failed_step(self):
        """A step that raises after making state leaves the wrapper; the
        next step ends it, and the state it placed is not copied."""
        T = self.torch
        with self.hooks():
            optimizer_state.install()
            params = [T.empty(64 * MiB)]
            act = T.empty(200 * MiB)
            in_hole = range(act.data_ptr(), act.data_ptr() + 200 * MiB)
            del act
            opt = InitGroupOptimizer(T, params, 64 * MiB)
            for hook in T.pre_hooks:
                hook(opt, (), {})
            made = []
            opt._init_group(opt.param_groups[0], made)  # then it raised
            self.assertIn("_init_group", vars(opt))
            with mock.patch.object(T, "empty_like",
                                   wraps=T.empty_like) as copy:
                self.assertEqual(opt.step(), [])
            copy.assert_not_called()
            self.assertNotIn("_init_group", vars(opt))
            self.assertNotIn(made[0].data_ptr(), in_hole)
            self.assertIn(opt, optimizer_state._settled)


if __name__ == "__main__":
    unittest.main()
