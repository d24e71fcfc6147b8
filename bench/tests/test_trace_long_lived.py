# SPDX-License-Identifier: MIT
"""bench/trace_long_lived.py on small traces written here (the window
from the first run of step-0 survivors to the last one, a lone earlier
survivor left out, the sidecar copied, no run or marks already there
refused), and benchlib.mark_long_lived's hooks on a stand-in for torch
(markers around _init_group in an optimizer's first step only, none for
a tensor-subclass optimizer or while compiling, installed once)."""

import gzip
import os
import subprocess
import sys
import tempfile
import types
import unittest
from unittest import mock

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(BENCH, "trace_long_lived.py")
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(os.path.dirname(BENCH), "python"))

import benchlib  # noqa: E402
import tracefile as tf  # noqa: E402

MiB = tf.MiB


def events(lone=True, run=4):
    """Set-up (a parameter), step 0: a lone survivor (a workspace), an
    activation allocated and freed, run state blocks; step 1: an
    activation."""
    ev = [tf.alloc(1 << 20, 2 * MiB), ("step", 0, 1, 0)]
    if lone:
        ev.append(tf.alloc(1 << 31, 32 * MiB))
    ev.append(tf.alloc(1 << 30, 64 * MiB))
    ev += tf.free(1 << 30, 64 * MiB)
    ev += [tf.alloc((1 << 32) + i * 8 * MiB, 8 * MiB) for i in range(run)]
    ev += [("step", 1, 0, 0), tf.alloc(1 << 30, 64 * MiB)]
    ev += tf.free(1 << 30, 64 * MiB)
    return ev


def run_script(*args):
    return subprocess.run([sys.executable, SCRIPT] + list(args),
                          capture_output=True, text=True, timeout=60)


class TestTraceLongLived(unittest.TestCase):

    def test_window_around_the_state(self):
        with tempfile.TemporaryDirectory() as d:
            path = tf.write(d, events(), name="w")
            with open(os.path.join(d, "w.trace.json"), "w") as f:
                f.write('{"steps": 2}\n')
            out = os.path.join(d, "out")
            p = run_script(path, out)
            self.assertEqual(p.returncode, 0, p.stderr)
            self.assertIn("window of 4 allocations", p.stdout)
            with gzip.open(os.path.join(out, "w.trace.gz"), "rt") as f:
                lines = f.read().splitlines()
            on = lines.index("long_lived 1 0 0")
            off = lines.index("long_lived 0 0 0")
            inside = lines[on + 1:off]
            self.assertEqual(len(inside), 4)
            self.assertTrue(all(ln.startswith("alloc %d " % ((1 << 32) +
                                                             i * 8 * MiB))
                                for i, ln in enumerate(inside)))
            # The lone survivor before the run stays outside.
            self.assertLess(lines.index("alloc %d %d 0" %
                                        (1 << 31, 32 * MiB)), on)
            self.assertTrue(os.path.exists(os.path.join(out,
                                                        "w.trace.json")))

    def test_no_run_refused(self):
        with tempfile.TemporaryDirectory() as d:
            path = tf.write(d, events(lone=False, run=3), name="n")
            p = run_script(path, os.path.join(d, "out"))
            self.assertEqual(p.returncode, 1)
            self.assertIn("no run of 4 blocks", p.stderr)

    def test_not_a_trace_gz_refused(self):
        p = run_script("/nonexistent/t.trace", "/nonexistent/out")
        self.assertEqual(p.returncode, 2)
        self.assertIn("not a NAME.trace.gz", p.stderr)

    def test_marked_trace_refused(self):
        with tempfile.TemporaryDirectory() as d:
            ev = events()
            ev.insert(6, ("long_lived", 1, 0, 0))
            ev.insert(11, ("long_lived", 0, 0, 0))
            path = tf.write(d, ev, name="m")
            p = run_script(path, os.path.join(d, "out"))
            self.assertEqual(p.returncode, 1)
            self.assertIn("already has long_lived", p.stderr)


class FakeTensor:
    pass


def fake_torch(log, compiling=False):
    """What mark_long_lived and gmlake.optimizer_state's predicates touch:
    empty() logs the sizes asked for."""
    pre, post = [], []
    optimizer_mod = types.ModuleType("torch.optim.optimizer")
    optimizer_mod.register_optimizer_step_pre_hook = pre.append
    optimizer_mod.register_optimizer_step_post_hook = post.append
    optim = types.ModuleType("torch.optim")
    optim.optimizer = optimizer_mod
    torch = types.ModuleType("torch")
    torch.optim = optim
    torch.Tensor = FakeTensor
    torch.nn = types.SimpleNamespace(Parameter=FakeTensor)
    torch.uint8 = "uint8"
    torch.empty = lambda size, dtype=None, device=None: log.append(size)
    torch.compiler = types.SimpleNamespace(is_compiling=lambda: compiling)
    torch.cuda = types.SimpleNamespace(
        is_current_stream_capturing=lambda: False)
    modules = {"torch": torch, "torch.optim": optim,
               "torch.optim.optimizer": optimizer_mod}
    return torch, modules, pre, post


class FakeOptimizer:
    def __init__(self, log, param):
        self.log = log
        self.param_groups = [{"params": [param]}]
        self.state = {}

    def _init_group(self, group):
        if not self.state:
            self.log.append("state")
            self.state[0] = {}

    def step(self, pre, post):
        for h in pre:
            h(self, (), {})
        for g in self.param_groups:
            self._init_group(g)
        for h in post:
            h(self, (), {})


class TestMarkLongLived(unittest.TestCase):

    def run_steps(self, param, compiling=False, steps=2, calls=1,
                  optimizers=1):
        log = []
        torch, modules, pre, post = fake_torch(log, compiling)
        with mock.patch.dict(sys.modules, modules):
            for _ in range(calls):
                benchlib.mark_long_lived(torch)
            for _ in range(optimizers):     # one after the other
                opt = FakeOptimizer(log, param)
                for _ in range(steps):
                    opt.step(pre, post)
                self.assertNotIn("_init_group", vars(opt))  # unwrapped
                del opt
        return log

    def test_first_step_marked(self):
        on, off = benchlib.LONG_LIVED_MARKS
        self.assertEqual(self.run_steps(FakeTensor()), [on, "state", off])

    def test_installed_once(self):
        # bench.py calls it for each workload of a child.
        on, off = benchlib.LONG_LIVED_MARKS
        self.assertEqual(self.run_steps(FakeTensor(), calls=2),
                         [on, "state", off])

    def test_next_optimizer_marked(self):
        # A workload after another in one child: its optimizer may sit
        # where the freed one was, and is marked all the same.
        on, off = benchlib.LONG_LIVED_MARKS
        self.assertEqual(self.run_steps(FakeTensor(), optimizers=3),
                         [on, "state", off] * 3)

    def test_subclass_params_not_marked(self):
        class Sub(FakeTensor):
            pass
        self.assertEqual(self.run_steps(Sub()), ["state"])

    def test_not_while_compiling(self):
        self.assertEqual(self.run_steps(FakeTensor(), compiling=True),
                         ["state"])

    def test_marks_are_not_the_step_mark(self):
        self.assertNotIn(benchlib.STEP_MARK, benchlib.LONG_LIVED_MARKS)
        self.assertEqual(len(set(benchlib.LONG_LIVED_MARKS)), 2)


if __name__ == "__main__":
    unittest.main()
