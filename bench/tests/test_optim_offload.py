# SPDX-License-Identifier: MIT
"""bench/optim_offload.py's pure parts and its parent side, without torch
or a GPU: the parameter count, the seeded shapes, the step figures, the
table, and a plan whose child cannot train (no torch or no GPU here)."""

import json
import os
import sys
import tempfile
import unittest

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import optim_offload as oo  # noqa: E402


class TestPure(unittest.TestCase):

    def test_params_of_llama_7b(self):
        # Llama-2-7B's published parameter count: 32 layers of this shape.
        self.assertEqual(oo.params_of(32), 6738415616)
        self.assertEqual(oo.params_of(33) - oo.params_of(32),
                         4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096)

    def test_shapes_seeded(self):
        a = oo.micro_shapes(0, 10, 8)
        self.assertEqual(a, oo.micro_shapes(0, 10, 8))
        self.assertNotEqual(a, oo.micro_shapes(1, 10, 8))
        self.assertEqual((len(a), {len(s) for s in a}), (10, {8}))
        self.assertTrue(set(x for s in a for x in s) <= set(oo.SEQS))

    def test_steady_and_table(self):
        r = dict(mode="offload", layers=4, params=oo.params_of(4), fits=True,
                 step_s=[5.0, 1.0, 3.0, 2.0], loss=[11.0, 10.5, 10.0, 9.5],
                 peak_reserved=3 << 30)
        self.assertEqual(oo.steady(r), (2.0, 2.0))   # steps 2-4
        self.assertEqual(oo.steady(dict(step_s=[1.0])), (None, None))
        no = dict(mode="torch", layers=40, params=oo.params_of(40),
                  fits=False, oom=True, error="OutOfMemoryError: x")
        t = oo.table([r, no])
        self.assertIn("| offload | 4 | 1.07B | yes | 5.000 | 2.000 | 2.000 "
                      "| 1.000-3.000 | n/a | n/a | 3.0 | 11.0000 / 9.5000 |",
                      t)
        # The host figures leave the first step out: opt.step()'s mean
        # and the host speed's median over the rest.
        r.update(opt_s=[9.0, 0.010, 0.030, 0.020],
                 host_ns=[9999.0, 1300.0, 1100.0, 2400.0])
        self.assertIn("| 1.000-3.000 | 20.0 | 1300 | 3.0 |", oo.table([r]))
        self.assertIn("| torch | 40 | 8.36B | no (out of memory) |", t)
        self.assertIn("does not fit", oo.summary_line(no))
        self.assertIn("mean 2.000 s", oo.summary_line(r))


class TestPlan(unittest.TestCase):

    def test_child_that_cannot_train(self):
        with tempfile.TemporaryDirectory() as d:
            with open(os.devnull, "w") as null:
                old, sys.stdout = sys.stdout, null
                try:
                    rc = oo.main(["plan", "--out", d, "--timeout", "120",
                                  "--steps", "1", "torch:1"])
                finally:
                    sys.stdout = old
            self.assertEqual(rc, 0)
            with open(os.path.join(d, "results.json")) as f:
                got = json.load(f)
            self.assertEqual(len(got), 1)
            self.assertFalse(got[0]["fits"])
            self.assertTrue(got[0]["error"])
            self.assertTrue(os.path.exists(os.path.join(d, "results.md")))
            # Bad runs are refused before anything runs or is written.
            for bad in ("nomode:1", "torch", "torch:x"):
                with self.assertRaises(SystemExit):
                    oo.main(["plan", "--out", os.path.join(d, "no"), bad])
            self.assertFalse(os.path.exists(os.path.join(d, "no")))


if __name__ == "__main__":
    unittest.main()
