# SPDX-License-Identifier: MIT
"""The benchmark's pure parts: fragmentation, tables, capacity search,
shape sets and settling steps, and bench.py's parent side, without torch."""

import json
import os
import random
import sys
import tempfile
import unittest
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))))

import benchlib  # noqa: E402

G = 1 << 30


def result(workload, allocator, times, shapes=None, index=0, **kw):
    """A child's result record: step times in ms."""
    r = dict(workload=workload, allocator=allocator, index=index, ok=True,
             oom=False, step_times=[t / 1000.0 for t in times],
             step_shapes=shapes if shapes is not None else [[1]] * len(times))
    r.update(kw)
    return r


class TestMath(unittest.TestCase):

    def test_fragmentation(self):
        self.assertAlmostEqual(benchlib.fragmentation(3 * G, 4 * G), 25.0)
        self.assertAlmostEqual(benchlib.fragmentation(4 * G, 4 * G), 0.0)
        self.assertIsNone(benchlib.fragmentation(None, 4 * G))
        self.assertIsNone(benchlib.fragmentation(1, 0))
        with self.assertRaises(ValueError):
            benchlib.fragmentation(-1, 4)
        r = dict(peak_allocated=6 * G, peak_reserved=4 * G)
        self.assertAlmostEqual(benchlib.result_fragmentation(r), -50.0)
        r["spilled_peak"] = 3 * G       # spilled blocks: no figure
        self.assertIsNone(benchlib.result_fragmentation(r))

    def test_merge_rounds(self):
        rounds = [dict(workload="w", allocator="a", ok=True, oom=False,
                       step_ms=s, peak_reserved=p * G, step_times=[1.0])
                  for s, p in ((30.0, 2), (10.0, 4), (20.0, 3))]
        rounds.append(dict(workload="v", allocator="a", ok=True,
                           oom=False, step_ms=5.0))
        m = benchlib.merge_rounds(rounds)
        self.assertEqual([r["workload"] for r in m], ["w", "v"])
        self.assertEqual(m[0]["step_ms"], 20.0)
        self.assertEqual(m[0]["step_ms_rounds"], [30.0, 10.0, 20.0])
        self.assertEqual(m[0]["peak_reserved"], 4 * G)
        self.assertNotIn("step_times", m[0])
        self.assertIs(m[1], rounds[3])          # one round: as it was
        bad = dict(rounds[0], ok=False, oom=True, step_ms=None,
                   error="OutOfMemoryError: x")
        m = benchlib.merge_rounds([rounds[1], bad])
        self.assertEqual((m[0]["ok"], m[0]["oom"], m[0]["step_ms"]),
                         (False, True, 10.0))
        self.assertEqual(m[0]["error"], "OutOfMemoryError: x")

    def test_median(self):
        self.assertAlmostEqual(benchlib.median_ms([9.0, 0.1, 0.3, 0.2]),
                               200.0)
        self.assertAlmostEqual(benchlib.median_ms([0.5]), 500.0)
        self.assertIsNone(benchlib.median_ms([]))

    def test_shape_cycle_rounds(self):
        draws = iter([(1, 2), (1, 2), (3, 4), (5, 6), (7, 8), (9, 9)])
        cycle = benchlib.ShapeCycle(random.Random(7), lambda: next(draws), 4)
        self.assertEqual(len(cycle), 4)
        self.assertEqual(cycle.shapes, [(1, 2), (3, 4), (5, 6), (7, 8)])
        rounds = [[cycle.next() for _ in range(4)] for _ in range(3)]
        for r in rounds:     # every round visits every shape once
            self.assertEqual(sorted(r), cycle.shapes)
        again = benchlib.ShapeCycle(
            random.Random(7), iter([(1, 2), (3, 4), (5, 6), (7, 8)]).__next__,
            4)
        self.assertEqual([again.next() for _ in range(4)], rounds[0])

    def test_search_doubles_then_bisects(self):
        fits = lambda b: b <= 11  # noqa: E731
        trials = []
        while True:
            b = benchlib.next_batch(trials, 64)
            if b is None:
                break
            self.assertNotIn(b, [t[0] for t in trials])
            trials.append((b, fits(b)))
        self.assertEqual([t[0] for t in trials][:5], [1, 2, 4, 8, 16])
        self.assertEqual(benchlib.sweep_summary(trials), (11, 12))

    def test_search_limit_and_nothing_fits(self):
        trials = []
        while benchlib.next_batch(trials, 8) is not None:
            trials.append((benchlib.next_batch(trials, 8), True))
        self.assertEqual(benchlib.sweep_summary(trials), (8, None))
        self.assertEqual(benchlib.next_batch([(1, False)], 8), None)
        self.assertEqual(benchlib.sweep_summary([(1, False)]), (None, 1))


class TestOffloadRows(unittest.TestCase):
    """gpt_offload: libgmlake only; the save_on_cpu comparison table."""

    def test_applies(self):
        self.assertTrue(benchlib.applies("gpt_offload", "gmlake"))
        self.assertFalse(benchlib.applies("gpt_offload", "default"))
        self.assertFalse(benchlib.applies("gpt_offload", "expandable"))
        for a in benchlib.ALLOCATORS:
            self.assertTrue(benchlib.applies("gpt_save_on_cpu", a))

    RESULTS = [
        dict(index=3, workload="gpt_save_on_cpu", allocator="gmlake",
             ok=True, oom=False, peak_reserved=8 * G, driver_used=9 * G,
             step_ms=200.0, peak_allocated=7 * G, resident_peak=7 * G),
        dict(index=4, workload="gpt_offload", allocator="default",
             ok=False, oom=False, skipped="not applicable"),
        dict(index=4, workload="gpt_offload", allocator="gmlake", ok=True,
             oom=False, peak_reserved=4 * G, driver_used=5 * G,
             step_ms=150.0, offload=dict(spilled_bytes=6 * G),
             peak_allocated=9 * G, resident_peak=3 * G),
        dict(index=3, workload="gpt_save_on_cpu", allocator="default",
             ok=True, oom=False, peak_reserved=10 * G, driver_used=None,
             step_ms=300.0, peak_allocated=7 * G),
        dict(index=0, workload="gpt_plain", allocator="gmlake", ok=True,
             oom=False, peak_reserved=20 * G, step_ms=100.0),
        dict(index=2, workload="gpt_keep", allocator="gmlake", ok=True,
             oom=False, peak_reserved=16 * G, driver_used=16 * G,
             step_ms=50.0),
    ]

    def test_offload_table(self):
        lines = benchlib.offload_table(self.RESULTS).strip().split("\n")
        self.assertEqual(len(lines), 6)   # header, rule, four rows
        # The reference first, against save_on_cpu like the others.
        self.assertEqual(lines.pop(2), "| none: activations kept on the "
                         "device | libgmlake | 16.00 | n/a | 16.00 | 50.0 | "
                         "2.00x | 0.25x | n/a | ok |")
        self.assertEqual(lines[2], "| torch save_on_cpu(pin_memory=True) | "
                         "PyTorch default | 10.00 | 7.00 | n/a | 300.0 | "
                         "1.00x | 1.00x | n/a | ok |")
        self.assertEqual(lines[3], "| torch save_on_cpu(pin_memory=True) | "
                         "libgmlake | 8.00 | 7.00 | 9.00 | 200.0 | 1.00x | "
                         "1.00x | n/a | ok |")
        self.assertEqual(lines[4], "| gmlake offload_activations() | "
                         "libgmlake | 4.00 | 3.00 | 5.00 | 150.0 | 0.50x | "
                         "0.75x | 6.00 | ok |")
        self.assertIsNone(benchlib.offload_table(self.RESULTS[-2:-1]))

    def test_skipped_row_and_markdown(self):
        row = benchlib.row_values(self.RESULTS[1])
        self.assertEqual(row[-1], "not applicable")
        self.assertEqual(row[2:7], ["n/a"] * 5)
        text = benchlib.results_markdown(dict(), self.RESULTS, [])
        self.assertIn("## Activation offload (GPT)", text)
        self.assertIn("| gmlake offload_activations() | libgmlake |", text)


class TestTables(unittest.TestCase):

    RESULTS = [
        dict(index=0, workload="gpt", allocator="gmlake", ok=True, oom=False,
             peak_allocated=3 * G, peak_reserved=4 * G, driver_used=5 * G,
             step_ms=12.34),
        dict(index=0, workload="gpt", allocator="default", ok=True,
             oom=True, peak_allocated=3 * G, peak_reserved=6 * G,
             driver_used=None, step_ms=None),
        dict(index=1, workload="gen", allocator="expandable", ok=False,
             oom=False),
    ]

    def test_results_table(self):
        text = benchlib.results_table(self.RESULTS)
        lines = text.strip().split("\n")
        self.assertEqual(lines[0], "| " + " | ".join(benchlib.HEADER) +
                         " |")
        self.assertEqual(lines[1].count("---"), len(benchlib.HEADER))
        # Workload order first, then PyTorch default before libgmlake.
        self.assertEqual(lines[2], "| gpt | PyTorch default | 3.00 | 6.00 | "
                         "n/a | 50.0 | n/a | yes |")
        self.assertEqual(lines[3], "| gpt | libgmlake | 3.00 | 4.00 | 5.00 "
                         "| 25.0 | 12.3 | no |")
        self.assertEqual(lines[4], "| gen | PyTorch expandable segments | "
                         "n/a | n/a | n/a | n/a | n/a | error |")

    def test_markdown(self):
        meta = dict(command="python3 bench/bench.py --quick", gpu="GPU X",
                    gpu_bytes=80 * G, torch="2.11", cuda="13.0",
                    library="/x/libgmlake.so", date="today", mode="quick",
                    notes=["a note"])
        sweeps = [dict(workload="lora", allocator="gmlake", cap_bytes=8 * G,
                       seq=[512, 96], best=12, failed=13,
                       trials=[(1, True)] * 7)]
        text = benchlib.results_markdown(meta, self.RESULTS, sweeps)
        self.assertIn("Command: `python3 bench/bench.py --quick`", text)
        self.assertIn("GPU: GPU X (80.00 GiB); PyTorch 2.11", text)
        self.assertIn("| lora | libgmlake | 8.00 | 512 96 | 12 | 13 | 7 |",
                      text)
        self.assertIn("- a note", text)
        self.assertIn("fragmentation* = 1 - peak allocated / peak reserved",
                      text)

    def test_markdown_sweep_only(self):
        meta = dict(command="python3 bench/bench.py --only-sweep",
                    gpu="GPU X", gpu_bytes=80 * G, mode="full")
        sweeps = [dict(workload="lora", allocator="gmlake", cap_bytes=8 * G,
                       seq=[64], best=3, failed=4, trials=[(1, True)])]
        text = benchlib.results_markdown(meta, [], sweeps)
        self.assertIn("GPU: GPU X (80.00 GiB)", text)
        self.assertNotIn("## Workloads", text)
        self.assertIn("| lora | libgmlake | 8.00 | 64 | 3 | 4 | 1 |", text)


class TestShapes(unittest.TestCase):
    """Shape sets, per-step sequences, settling steps."""

    def test_distinct_shapes(self):
        draws = iter([1, 1, 2, 1, 3])
        self.assertEqual(benchlib.distinct_shapes(lambda: next(draws), 3),
                         [1, 2, 3])
        with self.assertRaises(ValueError):
            benchlib.distinct_shapes(lambda: 5, 2, tries=50)

    def test_sequence_visits_every_shape_and_repeats(self):
        shapes = [(1, 2), (3, 4), (5, 6), (7, 8)]
        seq = benchlib.shape_sequence(shapes, 24, random.Random(3))
        self.assertEqual(len(seq), 24)
        self.assertEqual(sorted(set(seq)), shapes)
        self.assertEqual(seq, benchlib.shape_sequence(shapes, 24,
                                                      random.Random(3)))
        self.assertNotEqual(seq, benchlib.shape_sequence(shapes, 24,
                                                         random.Random(4)))
        self.assertEqual(sorted(set(benchlib.shape_sequence(
            shapes, 4, random.Random(1)))), shapes)   # each once
        with self.assertRaises(ValueError):
            benchlib.shape_sequence(shapes, 3, random.Random(1))

    def test_settle_flags(self):
        r = result("w", "gmlake", [9, 1, 8, 1, 1, 7],
                   shapes=[[1, 2], [1, 2], [3, 4], [1, 2], [3, 4], [[5], 6]])
        self.assertEqual(benchlib.settle_flags(r),
                         [True, False, True, False, False, True])
        # Tuples (a step's return) and lists (from JSON) are one shape.
        r["step_shapes"] = [(1, 2), [1, 2], (3, 4), [3, 4], (1, 2), [5]]
        self.assertEqual(benchlib.settle_flags(r),
                         [True, False, True, False, False, True])
        # Fixed shapes (None): only the first step settles.
        r["step_shapes"] = [None] * 6
        self.assertEqual(benchlib.settle_flags(r), [True] + [False] * 5)
        # Results of format 1: the first `warmup` steps.
        del r["step_shapes"]
        r["warmup"] = 4
        self.assertEqual(benchlib.settle_flags(r), [True] * 4 + [False] * 2)
        r["step_shapes"] = [[1]] * 5
        with self.assertRaises(ValueError):
            benchlib.settle_flags(r)


class TestEcosystem(unittest.TestCase):
    """The ecosystem workloads' shapes, without torch."""

    def setUp(self):
        import ecosystem
        self.eco = ecosystem

    def test_import_needs_no_torch(self):
        for name in self.eco.WORKLOADS:
            self.assertIn(name, self.eco.BUILDERS)
            self.assertIn(name, self.eco.REQUIRES)
        if "torch" not in sys.modules:
            self.assertNotIn("timm", sys.modules)
            with self.assertRaises(ValueError):
                self.eco.build("nope", "full", 1, 4)    # before any import

    def test_shapes_in_range(self):
        for size in ("full", "quick"):
            for name in self.eco.WORKLOADS:
                spec = self.eco.SHAPES[size][name]
                shapes = self.eco.shape_set(name, size, 1234)
                self.assertEqual(len(shapes), spec["count"])
                self.assertEqual(shapes, self.eco.shape_set(name, size, 1234))
                for s in shapes:
                    self._check(name, spec, s)
        # A different seed, different shapes (for most workloads at least).
        self.assertNotEqual(self.eco.shape_set("eco_vit", "full", 1),
                            self.eco.shape_set("eco_vit", "full", 2))

    def _check(self, name, spec, s):
        if name == "eco_vit":
            b, res = s
            self.assertIn(b, spec["batch"])
            self.assertEqual(res % 16, 0)
            self.assertIn(res, spec["res"])
        elif name == "eco_maskrcnn":
            self.assertEqual(len(s), spec["images"])
            for h, w, n in s:
                for side in (h, w):
                    self.assertGreaterEqual(side, spec["side"][0])
                    self.assertLessEqual(side, spec["side"][1])
                self.assertGreaterEqual(n, spec["boxes"][0])
        elif name == "eco_sage":
            n, e = s
            self.assertTrue(spec["nodes"][0] <= n <= spec["nodes"][1])
            self.assertEqual(e, n * spec["degree"])
        else:
            b, t = s
            self.assertLessEqual(b * t, spec["tokens"])

    def test_full_shapes_are_the_brief(self):
        full = self.eco.SHAPES["full"]
        self.assertEqual(full["eco_vit"]["res"][0], 192)
        self.assertEqual(full["eco_vit"]["res"][-1], 320)
        self.assertEqual((min(full["eco_vit"]["batch"]),
                          max(full["eco_vit"]["batch"])), (24, 64))
        self.assertEqual(full["eco_maskrcnn"]["side"], (400, 1100))
        self.assertEqual(full["eco_sage"]["nodes"], (100000, 400000))
        llama = self.eco.MODELS["full"]["llama"]
        self.assertEqual((llama["num_hidden_layers"], llama["hidden_size"],
                          llama["vocab_size"]), (12, 2048, 32000))

    def test_sequences_have_steady_steps(self):
        for size in ("full", "quick"):
            self.assertEqual(sorted(self.eco.STEPS[size]),
                             sorted(self.eco.WORKLOADS))
            for name in self.eco.WORKLOADS:
                steps = self.eco.STEPS[size][name]
                seq = self.eco.sequence(name, size, 1234, steps)
                self.assertEqual(len(seq), steps)
                r = result(name, "gmlake", [1] * steps, shapes=seq)
                flags = benchlib.settle_flags(r)
                self.assertEqual(sum(flags),
                                 self.eco.SHAPES[size][name]["count"])
                if size == "full":
                    self.assertGreaterEqual(flags.count(False), 20)

    def test_free_port(self):
        p = self.eco.free_port()
        self.assertTrue(0 < p < 65536)


class TestBenchCli(unittest.TestCase):
    """bench.py's argument handling and child environments (no torch)."""

    def setUp(self):
        import bench
        self.bench = bench

    def test_parse(self):
        a = self.bench.parse(["--quick", "--sweep", "--lib", "/x.so"])
        self.assertEqual((a.size, a.sweep, a.lib), ("quick", True, "/x.so"))
        self.assertEqual(self.bench.parse([]).size, "full")

    def test_child_env(self):
        env = self.bench.child_env("expandable", "/x.so")
        self.assertEqual(env["PYTORCH_CUDA_ALLOC_CONF"],
                         "expandable_segments:True")
        env = self.bench.child_env("gmlake", "/x.so")
        self.assertNotIn("PYTORCH_CUDA_ALLOC_CONF", env)
        self.assertEqual((env["GMLAKE_LIBRARY"], env["GMLAKE_BACKEND"]),
                         ("/x.so", "cuda"))
        self.assertIn(os.path.join(self.bench.REPO, "python"),
                      env["PYTHONPATH"].split(os.pathsep))
        with mock.patch.dict(os.environ, {"GMLAKE_HOST_PIN": "1G"}):
            env = self.bench.child_env("gmlake", "/x.so")
        self.assertEqual((env["GMLAKE_HOST_LIMIT"], env["GMLAKE_HOST_PIN"]),
                         (self.bench.HOST_LIMIT, "1G"))
        env = self.bench.child_env("default", "/x.so")
        self.assertNotIn("GMLAKE_HOST_PIN", env)

    def test_same_steps_for_all(self):
        for size in ("full", "quick"):
            self.assertEqual(sorted(self.bench.STEPS[size]),
                             sorted(["gpt_ckpt", "gpt_plain", "lora",
                                     "gpt_keep", "gpt_save_on_cpu",
                                     "gpt_offload", "generate"]))
            self.assertEqual(sorted(self.bench.STEPS[size]),
                             sorted(self.bench.WORKLOADS))

    def test_unknown_workload(self):
        with mock.patch("gmlake.find_library", return_value="/x.so"):
            self.assertEqual(self.bench.main(["--workloads", "gpt_nope"]),
                             2)

    def test_rounds_at_least_one(self):
        with mock.patch("gmlake.find_library", return_value="/x.so"):
            self.assertEqual(self.bench.main(["--rounds", "0"]), 2)

    def test_rounds_alternate_and_merge(self):
        order = []

        def fake(args, a, names, meta, notes):
            order.append(a)
            return [dict(workload="lora", index=0, allocator=a, ok=True,
                         oom=False, step_ms=10.0 * len(order),
                         peak_reserved=len(order) * G)]
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        out = tmp.name
        with mock.patch("gmlake.find_library", return_value="/x.so"), \
                mock.patch.object(self.bench, "run_allocator", fake), \
                mock.patch.object(self.bench.benchlib, "chart",
                                  return_value="no chart"):
            rc = self.bench.main(["--rounds", "3", "--workloads", "lora",
                                  "--allocators", "default,gmlake",
                                  "--out", out])
        self.assertEqual(rc, 0)
        self.assertEqual(order, ["default", "gmlake", "gmlake", "default",
                                 "default", "gmlake"])
        with open(os.path.join(out, "results.json")) as f:
            data = json.load(f)
        got = {r["allocator"]: r for r in data["results"]}
        self.assertEqual(got["gmlake"]["step_ms_rounds"], [20.0, 30.0, 60.0])
        self.assertEqual(got["gmlake"]["step_ms"], 30.0)
        self.assertEqual(got["default"]["peak_reserved"], 5 * G)
        with open(os.path.join(out, "results.md")) as f:
            self.assertIn("3 rounds", f.read())


if __name__ == "__main__":
    unittest.main()
