# SPDX-License-Identifier: MIT
"""The benchmark's pure parts (fragmentation, step-time figures, rounds,
tables, capacity search, shape sets) and bench.py's parent side (options,
round order, results.json, the report, children's output and timeouts),
all without torch."""

import gc
import io
import json
import os
import random
import sys
import tempfile
import time
import unittest
from unittest import mock

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, BENCH)

import benchlib  # noqa: E402

G = 1 << 30
COMMITTED = os.path.join(BENCH, "results", "results.json")


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


class TestSummary(unittest.TestCase):
    """Mean, median and settling of one result; driver calls per step."""

    def test_step_summary(self):
        r = result("w", "gmlake", [900, 100, 500, 120, 140, 80],
                   shapes=[[1], [1], [2], [2], [1], [2]])
        s = benchlib.step_summary(r["step_times"], benchlib.settle_flags(r))
        self.assertAlmostEqual(s["mean_ms"], 110.0)
        self.assertAlmostEqual(s["median_ms"], 110.0)
        self.assertEqual((s["steady_steps"], s["settle_steps"]), (4, 2))
        self.assertAlmostEqual(s["settle_ms"], 1400.0)
        # A slow repeat counts in the mean, not the median.
        r["step_times"][3] = 1.0
        s = benchlib.step_summary(r["step_times"], benchlib.settle_flags(r))
        self.assertAlmostEqual(s["mean_ms"], (100 + 1000 + 140 + 80) / 4)
        self.assertAlmostEqual(s["median_ms"], 120.0)
        s = benchlib.step_summary([0.5], [True])
        self.assertEqual((s["mean_ms"], s["median_ms"], s["settle_steps"]),
                         (None, None, 1))

    def test_driver(self):
        r = result("w", "gmlake", [500, 100, 100, 200],
                   shapes=[[1], [1], [1], [2]],
                   step_calls=[{"mem_map": [100, 50000000]},
                               {"set_access": [4, 800000],
                                "mem_unmap": [2, 200000]},
                               {"set_access": [2, 400000]},
                               {"mem_map": [10, 5000000]}])
        flags = benchlib.settle_flags(r)
        t = benchlib.driver_totals(r, flags)
        self.assertEqual(t["steady"], {"set_access": [6, 1200000],
                                       "mem_unmap": [2, 200000]})
        self.assertEqual(t["settle"], {"mem_map": [110, 55000000]})
        d = benchlib.driver_rates(t)
        self.assertAlmostEqual(d["kinds"]["set_access"]["calls_per_step"], 3)
        self.assertAlmostEqual(d["kinds"]["set_access"]["ms_per_step"], 0.6)
        self.assertAlmostEqual(d["kinds"]["set_access"]["us_per_call"], 200)
        self.assertAlmostEqual(d["ms_per_step"], 0.7)
        self.assertAlmostEqual(d["share_pct"], 1.4 / 200 * 100)
        self.assertAlmostEqual(d["settle_ms_per_step"], 27.5)
        both = benchlib.add_driver_totals(t, t)
        self.assertEqual(both["steady"]["set_access"], [12, 2400000])
        self.assertEqual(both["steady_steps"], 4)
        self.assertIs(benchlib.add_driver_totals(None, t), t)
        self.assertIsNone(benchlib.driver_totals(result("w", "default", [1]),
                                                 [True]))
        self.assertAlmostEqual(benchlib.device_allocs_per_step(r, flags), 0)

    def test_device_allocs(self):
        r = result("w", "default", [5, 1, 1, 1],
                   step_segments=[[9, 0], [1, 1], [0, 0], [2, 0]])
        self.assertAlmostEqual(benchlib.device_allocs_per_step(
            r, benchlib.settle_flags(r)), 1.0)
        r = result("w", "gmlake", [5, 1],
                   step_calls=[{"mem_create": [7, 1]}, {"mem_create": [3, 1]}])
        self.assertAlmostEqual(benchlib.device_allocs_per_step(
            r, benchlib.settle_flags(r)), 3.0)


def three_rounds():
    """Synthetic rounds: libgmlake slower than the faster reference
    (expandable) in rounds 1 and 3, faster in 2; default fails round 3 of
    w2; gpt_offload is libgmlake only."""
    shapes = [[1], [2], [1], [2], [1], [2]]
    times = {  # round -> allocator -> w1 steps (ms)
        1: dict(default=[900, 800, 110, 110, 110, 110],
                expandable=[900, 800, 100, 100, 100, 100],
                gmlake=[900, 800, 105, 105, 105, 105]),
        2: dict(default=[900, 800, 110, 110, 110, 110],
                expandable=[900, 800, 100, 100, 100, 100],
                gmlake=[900, 800, 95, 95, 95, 95]),
        3: dict(default=[900, 800, 110, 110, 110, 110],
                expandable=[900, 800, 100, 100, 100, 100],
                gmlake=[900, 800, 110, 110, 110, 110]),
    }
    rounds = []
    for k in (1, 2, 3):
        res = []
        for a in benchlib.round_order(benchlib.ALLOCATORS, k):
            extra = dict(peak_allocated=9 * G, peak_reserved=(10 + k) * G)
            if a == "gmlake":
                extra.update(peak_reserved=(9.5 + k / 10) * G, step_calls=[
                    {"mem_map": [50, 9000000]}, {"mem_map": [50, 9000000]},
                    {}, {"set_access": [2, 500000]}, {}, {}])
            else:
                extra["step_segments"] = [[5, 0], [3, 0], [0, 0], [1, 1],
                                          [0, 0], [0, 0]]
            res.append(result("w1", a, times[k][a], shapes, index=0,
                              **extra))
            w2 = result("w2", a, [50, 10, 10], [None] * 3, index=1,
                        peak_allocated=G, peak_reserved=2 * G)
            if k == 3 and a == "default":
                w2.update(ok=False, oom=True, error="OutOfMemoryError: x",
                          step_times=[0.05], step_shapes=[None])
            res.append(w2)
            if a == "gmlake":
                res.append(result("gpt_offload", a, [90, 30, 30], [None] * 3,
                                  index=2, peak_reserved=4 * G,
                                  spilled_peak=2 * G, note="offloaded"))
            else:
                res.append(dict(workload="gpt_offload", allocator=a,
                                index=2, ok=False, oom=False,
                                skipped="not applicable", step_times=[],
                                step_shapes=[]))
        rounds.append(dict(round=k, order=benchlib.round_order(
            benchlib.ALLOCATORS, k), complete=True, gpu="GPU X",
            gpu_bytes=80 * G, torch="2.11", cuda="13.0", commit="abc1234",
            mode="full", seed=1234, library="build-gpu/libgmlake.so",
            command="python3 bench/bench.py --round %d" % k,
            date="today", wall_s=100.0 + k, notes=["n%d" % k],
            results=res, sweeps=[]))
    return dict(format=benchlib.FORMAT, rounds=rounds)


class TestRounds(unittest.TestCase):

    def test_round_order(self):
        a = ("A", "B", "C")
        self.assertEqual(benchlib.round_order(a, 1), ["A", "B", "C"])
        self.assertEqual(benchlib.round_order(a, 2), ["C", "B", "A"])
        self.assertEqual(benchlib.round_order(a, 3), ["A", "B", "C"])
        with self.assertRaises(ValueError):
            benchlib.round_order(a, 0)

    def test_add_round_replaces_same_number(self):
        data, replaced = benchlib.add_round(None, dict(round=2, x=1))
        self.assertFalse(replaced)
        data, _ = benchlib.add_round(data, dict(round=1, x=2))
        data, replaced = benchlib.add_round(data, dict(round=2, x=3))
        self.assertTrue(replaced)
        self.assertEqual([(r["round"], r["x"]) for r in data["rounds"]],
                         [(1, 2), (2, 3)])

    def test_round_in_parts(self):
        """A round may come in calls of different workloads."""
        a = dict(round=1, results=[dict(workload="w1")])
        b = dict(round=1, results=[dict(workload="w2")])
        c = dict(round=1, results=[dict(workload="w2"), dict(workload="w3")])
        self.assertFalse(benchlib.clash(a, b))
        self.assertTrue(benchlib.clash(b, c))
        self.assertFalse(benchlib.clash(c, dict(round=2, results=[
            dict(workload="w2")])))
        self.assertTrue(benchlib.clash(dict(round=1, results=[]),
                                       dict(round=1)))    # sweeps only
        data, _ = benchlib.add_round(None, a)
        data, replaced = benchlib.add_round(data, b)
        self.assertFalse(replaced)
        data, replaced = benchlib.add_round(data, c)
        self.assertTrue(replaced)
        self.assertEqual(data["rounds"], [a, c])
        self.assertEqual(benchlib.round_ids(data["rounds"]), [1])
        self.assertEqual(benchlib.merge_data([dict(format=2, rounds=[a]),
                                              dict(format=2, rounds=[b])])
                         ["rounds"], [a, b])
        with self.assertRaises(ValueError):
            benchlib.merge_data([dict(format=2, rounds=[b]),
                                 dict(format=2, rounds=[c])])

    def test_format_1_is_one_round(self):
        old = dict(meta=dict(gpu="G", command="c"),
                   results=[result("w", "gmlake", [1, 2])], sweeps=[])
        data = benchlib.as_rounds(old)
        self.assertEqual(data["format"], benchlib.FORMAT)
        self.assertEqual(len(data["rounds"]), 1)
        self.assertEqual((data["rounds"][0]["round"],
                          data["rounds"][0]["gpu"]), (1, "G"))
        self.assertIs(benchlib.as_rounds(data), data)
        with self.assertRaises(ValueError):
            benchlib.as_rounds(dict(something="else"))

    def test_merge_data(self):
        data = three_rounds()
        one = dict(format=2, rounds=data["rounds"][:1])
        rest = dict(format=2, rounds=data["rounds"][1:])
        merged = benchlib.merge_data([rest, one, one])  # one twice: kept once
        self.assertEqual([r["round"] for r in merged["rounds"]], [1, 2, 3])
        other = json.loads(json.dumps(one))
        other["rounds"][0]["wall_s"] = 5
        with self.assertRaises(ValueError):
            benchlib.merge_data([one, other])

    def test_merge(self):
        merged = benchlib.merge(three_rounds()["rounds"])
        by = {(m["workload"], m["allocator"]): m for m in merged}
        self.assertEqual([(m["workload"], m["allocator"]) for m in merged][:3],
                         [("w1", "default"), ("w1", "expandable"),
                          ("w1", "gmlake")])
        g = by[("w1", "gmlake")]
        self.assertAlmostEqual(g["mean_ms"], (105 + 95 + 110) / 3)
        self.assertAlmostEqual(g["median_ms"], 105.0)
        self.assertEqual(sorted(g["rounds"]), [1, 2, 3])
        self.assertAlmostEqual(g["rounds"][2]["mean_ms"], 95.0)
        self.assertAlmostEqual(g["spread_pct"], 15 / g["mean_ms"] * 100)
        self.assertAlmostEqual(g["settle_ms"], 1700.0)
        self.assertEqual(g["peak_reserved"], 9.8 * G)
        self.assertAlmostEqual(g["fragmentation"],
                               benchlib.fragmentation(9 * G, 9.8 * G))
        self.assertAlmostEqual(g["driver"]["ms_per_step"], 0.125)
        self.assertAlmostEqual(g["driver"]["kinds"]["set_access"]
                               ["calls_per_step"], 0.5)
        self.assertAlmostEqual(g["device_allocs_per_step"], 0.0)
        self.assertAlmostEqual(by[("w1", "default")]["device_allocs_per_step"],
                               0.25)
        self.assertEqual(by[("w1", "default")]["peak_reserved"], 13 * G)
        # A failed round: out of memory, its steps left out.
        d2 = by[("w2", "default")]
        self.assertFalse(d2["ok"])
        self.assertTrue(d2["oom"])
        self.assertEqual(d2["rounds"][3]["status"], "out of memory")
        self.assertAlmostEqual(d2["mean_ms"], 10.0)
        self.assertEqual(d2["rounds"][1]["settle_steps"], 1)
        self.assertTrue(by[("gpt_offload", "default")]["skipped"])
        self.assertIsNone(by[("gpt_offload", "gmlake")]["fragmentation"])

    def test_ratios(self):
        rounds = three_rounds()["rounds"]
        merged = benchlib.merge(rounds)
        rows = {r["workload"]: r for r in benchlib.ratios(merged, [1, 2, 3])}
        self.assertEqual(sorted(rows), ["w1", "w2"])    # not gpt_offload
        w1 = rows["w1"]
        self.assertEqual(w1["reference"], "expandable")
        self.assertAlmostEqual(w1["mean"], (105 + 95 + 110) / 3 / 100)
        self.assertEqual({k: round(v, 3) for k, v in w1["rounds"].items()},
                         {1: 1.05, 2: 0.95, 3: 1.1})
        self.assertAlmostEqual(w1["worst"], 1.1)
        self.assertAlmostEqual(w1["median"], 1.05)
        self.assertAlmostEqual(w1["reserved"], 9.8 / 13)
        # w2: the default allocator's failed round 3 is not its reference.
        self.assertEqual(rows["w2"]["rounds"], {1: 1.0, 2: 1.0, 3: 1.0})


class TestReport(unittest.TestCase):

    def test_host_speed(self):
        data = three_rounds()
        # No result timed the host: no table.
        self.assertIsNone(benchlib.host_table(
            benchlib.merge(data["rounds"]), [1, 2, 3]))
        self.assertNotIn("Host speed", benchlib.results_markdown(data))
        # w1: the settling steps' views (the first two) are left out.
        speed = {1: dict(default=700, expandable=700, gmlake=1400),
                 2: dict(default=700, expandable=650, gmlake=650),
                 3: dict(default=800, expandable=700, gmlake=None)}
        for rnd in data["rounds"]:
            for r in rnd["results"]:
                ns = speed[rnd["round"]].get(r["allocator"])
                if r["workload"] == "w1" and ns:
                    r["step_host_ns"] = [5.0, 5.0] + [ns] * 4
        flags = benchlib.settle_flags(data["rounds"][0]["results"][0])
        self.assertEqual(benchlib.host_speed(
            dict(step_host_ns=[5.0, 5.0, 1, 2, 3, 100]), flags), 2.5)
        self.assertIsNone(benchlib.host_speed({}, flags))
        merged = benchlib.merge(data["rounds"])
        table = benchlib.host_table(merged, [1, 2, 3])
        self.assertIn("| w1 | PyTorch default | 700 / 700 / 800 |  |", table)
        # Round 1: libgmlake's process was the slower host, 2x the faster
        # reference's (expandable); round 3: not timed.
        self.assertIn("| w1 | libgmlake | 1400 / 650 / n/a | "
                      "2.000x / 1.000x / n/a |", table)
        self.assertIn("| w2 | libgmlake | n/a / n/a / n/a | "
                      "n/a / n/a / n/a |", table)
        self.assertIn("## Host speed of each process",
                      benchlib.results_markdown(data))

    def test_gc_time(self):
        data = three_rounds()
        # No result timed the collector: no table.
        self.assertIsNone(benchlib.gc_table(
            benchlib.merge(data["rounds"]), [1, 2, 3]))
        self.assertNotIn("garbage collector", benchlib.results_markdown(data))
        # w1, libgmlake, round 2: a 300 ms collection in a steady step;
        # the settling steps' (the first two) are left out.
        for rnd in data["rounds"]:
            for r in rnd["results"]:
                if r["workload"] != "w1":
                    continue
                n = len(r["step_times"])
                r["step_gc_ms"] = [500.0, 500.0] + [1.0] * (n - 2)
                if r["allocator"] == "gmlake" and rnd["round"] == 2:
                    r["step_gc_ms"][2] = 300.0
        flags = benchlib.settle_flags(data["rounds"][0]["results"][0])
        self.assertEqual(benchlib.steady_gc_ms(
            dict(step_gc_ms=[500.0, 500.0, 1, 2, 3, 4]), flags), 10)
        self.assertIsNone(benchlib.steady_gc_ms({}, flags))
        merged = benchlib.merge(data["rounds"])
        table = benchlib.gc_table(merged, [1, 2, 3])
        by = {(m["workload"], m["allocator"]): m for m in merged}
        steady = by[("w1", "gmlake")]["rounds"][2]["steady_s"]
        share = 100 * 0.303 / steady
        self.assertIn("| w1 | libgmlake | 4 / 303 / 4 | ", table)
        self.assertIn(" / %.2f%% / " % share, table)
        self.assertIn("| w2 | libgmlake | n/a / n/a / n/a | "
                      "n/a / n/a / n/a |", table)
        self.assertIn("## Python's garbage collector",
                      benchlib.results_markdown(data))

    def test_markdown(self):
        text = benchlib.results_markdown(three_rounds())
        self.assertIn("GPU: GPU X (80.00 GiB); PyTorch: 2.11; CUDA: 13.0; "
                      "libgmlake: build-gpu/libgmlake.so; commit: abc1234",
                      text)
        self.assertIn("3 rounds (1, 2, 3)", text)
        self.assertIn("- round 2: `python3 bench/bench.py --round 2` "
                      "(today, 102 s)", text)
        self.assertNotIn("fewer than three rounds", text)
        self.assertIn("**Warning:** some workloads failed", text)
        self.assertIn("| w1 | libgmlake | 103.3 | 105.0 / 95.0 / 110.0 | "
                      "14.5 | 105.0 | 2 | 1700 | ok |", text)
        self.assertIn("| w2 | PyTorch default | 10.0 | 10.0 / 10.0 / n/a | "
                      "0.0 | 10.0 | 1 | 50 | round 3: out of memory |", text)
        self.assertIn("| w1 | PyTorch expandable segments | 1.033x | "
                      "1.050x / 0.950x / 1.100x | 1.100x | 1.050x | 0.754x |",
                      text)
        self.assertIn("| w1 | libgmlake | 9.00 | 9.80 | n/a | 8.2 | 0.00 |",
                      text)
        self.assertIn("| w1 | PyTorch default | 9.00 | 13.00 | n/a | 30.8 | "
                      "0.25 |", text)
        self.assertIn("| w1 | all | 0.5 | 0.12 |  | 0.12 | 9.0 |", text)
        self.assertIn("|  | set_access | 0.5 | 0.12 | 250.0 | 0.12 |  |",
                      text)
        self.assertIn("## Notes\n\n- gpt_offload: offloaded\n- round 1: n1\n"
                      "- round 2: n2\n- round 3: n3\n", text)
        self.assertIn("*Mean step ms* is the mean of all steady steps", text)
        self.assertNotIn("| gpt_offload | PyTorch default", text)

    def test_markdown_warnings(self):
        data = three_rounds()
        data["rounds"] = data["rounds"][:2]
        data["rounds"][1]["commit"] = "def5678"
        data["rounds"][1]["complete"] = False
        text = benchlib.results_markdown(data)
        self.assertIn("commit: abc1234 / def5678", text)
        self.assertIn("**Warning:** the rounds differ in commit", text)
        self.assertIn("**Warning:** fewer than three rounds", text)
        self.assertIn("102 s), not complete", text)

    @unittest.skipUnless(os.path.exists(COMMITTED),
                         "bench/results/results.json not in this tree")
    def test_committed_results(self):
        """The committed run (format 1): what its medians hid."""
        data = benchlib.as_rounds(benchlib.load_json(COMMITTED))
        rows = {r["workload"]: r for r in benchlib.ratios(
            benchlib.merge(data["rounds"]), [1])}
        self.assertAlmostEqual(rows["gpt_ckpt"]["mean"], 1.070, places=3)
        self.assertAlmostEqual(rows["gpt_plain"]["mean"], 1.075, places=3)
        self.assertLess(rows["gpt_ckpt"]["median"], 1.0)
        self.assertIn("| gpt_ckpt | libgmlake | 146.4 |",
                      benchlib.results_markdown(data))


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
        self.assertIn("mean step ms", lines[0])
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

    def test_offload_table_each_model_against_its_save_on_cpu(self):
        rows = self.RESULTS + [
            dict(index=5, workload="llama_save_on_cpu", allocator="gmlake",
                 ok=True, oom=False, peak_reserved=20 * G, step_ms=1000.0),
            dict(index=6, workload="llama_offload", allocator="gmlake",
                 ok=True, oom=False, peak_reserved=10 * G, step_ms=600.0)]
        lines = benchlib.offload_table(rows).strip().split("\n")
        self.assertTrue(lines[-2].startswith("| Llama: torch save_on_cpu"))
        self.assertIn("| 1.00x | 1.00x |", lines[-2])
        self.assertTrue(lines[-1].startswith("| Llama: gmlake "))
        self.assertIn("| 0.50x | 0.60x |", lines[-1])

    def test_offload_section_from_rounds(self):
        text = benchlib.results_markdown(three_rounds())
        self.assertIn("## Activation offload (GPT)", text)
        self.assertIn("| gmlake offload_activations() | libgmlake | 4.00 | "
                      "n/a | n/a | 30.0 |", text)


class TestSweepTable(unittest.TestCase):

    def test_sweep_in_report(self):
        data = three_rounds()
        data["rounds"][0]["sweeps"] = [dict(
            workload="lora", allocator="gmlake", cap_bytes=8 * G,
            seq=[512, 96], best=12, failed=13, trials=[(1, True)] * 7)]
        text = benchlib.results_markdown(data)
        self.assertIn("## Capacity sweep", text)
        self.assertIn("| lora | libgmlake | 8.00 | 512 96 | 12 | 13 | 7 |",
                      text)

    def test_sweep_only(self):
        data = dict(format=2, rounds=[dict(round=1, gpu="GPU X", results=[],
                                           sweeps=[dict(
                                               workload="lora",
                                               allocator="gmlake",
                                               cap_bytes=8 * G, seq=[64],
                                               best=3, failed=None,
                                               trials=[(1, True)])])])
        text = benchlib.results_markdown(data)
        self.assertNotIn("## Step time", text)
        self.assertIn("| lora | libgmlake | 8.00 | 64 | 3 | none up to the "
                      "limit | 1 |", text)


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
        if name in ("eco_vit", "eco_convnet"):
            b, res = s
            self.assertIn(b, spec["batch"])
            self.assertEqual(res % (16 if name == "eco_vit" else 32), 0)
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

    def test_groups(self):
        # eco is the five the allocator-speed issue names; the two more
        # stand apart, so rounds of eco stay comparable with older ones.
        self.assertEqual(self.eco.CORE, ("eco_vit", "eco_maskrcnn",
                                         "eco_sage", "eco_llama_fsdp",
                                         "eco_compile"))
        self.assertEqual(self.eco.WORKLOADS,
                         self.eco.CORE + self.eco.EXTRA)
        self.assertFalse(set(self.eco.CORE) & set(self.eco.EXTRA))

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


class TestDistributed(unittest.TestCase):
    """The distributed workloads' shapes and the child's command line,
    without torch."""

    def setUp(self):
        import distributed
        self.dist = distributed

    def test_import_needs_no_torch(self):
        for name in self.dist.WORKLOADS:
            self.assertIn(name, self.dist.BUILDERS)
            self.assertIn(name, self.dist.REQUIRES)
        if "torch" not in sys.modules:
            with self.assertRaises(ValueError):
                self.dist.build("nope", "full", 1, 4)
            self.assertNotIn("torch", sys.modules)

    def test_shapes(self):
        d = self.dist
        for size in ("full", "quick"):
            for name in d.WORKLOADS:
                shapes = d.shape_set(name, size, 7)
                self.assertEqual(shapes, d.shape_set(name, size, 7))
                seq = d.sequence(name, size, 7, d.STEPS[size][name])
                self.assertEqual(len(seq), d.STEPS[size][name])
                self.assertEqual(set(seq), set(shapes))  # each at least once
                spec = d.SHAPES[size][name]
                if name == "dist_collectives":
                    self.assertEqual(len(shapes),
                                     len(spec["mib"]) * len(d.OPS))
                    continue
                self.assertEqual(len(shapes), spec["count"])
                for b, t in shapes:
                    self.assertIn(b, spec["batch"])
                    self.assertIn(t, spec["seq"])
                    self.assertLessEqual(b * t, spec["tokens"])
        self.assertEqual([m for op, m in d.shape_set("dist_collectives",
                                                     "full", 1)],
                         [64, 64, 256, 256, 1024, 1024])
        with self.assertRaises(ValueError):
            d.shape_set("eco_vit", "full", 1)

    def test_bus_factor(self):
        # nccl-tests: all-reduce moves 2(n-1)/n bytes a byte, all-gather
        # (n-1)/n; one rank moves none.
        self.assertEqual(self.dist.bus_factor("all_reduce", 8), 1.75)
        self.assertEqual(self.dist.bus_factor("all_gather", 4), 0.75)
        self.assertEqual(self.dist.bus_factor("all_reduce", 1), 0.0)
        with self.assertRaises(ValueError):
            self.dist.bus_factor("broadcast", 2)

    def test_loss_and_collectives_tables(self):
        def rec(alloc, loss=None, coll=None, ok=True):
            r = dict(workload="dist_llama_fsdp" if loss else
                     "dist_collectives", allocator=alloc, ok=ok,
                     step_times=[0.1, 0.1])
            if loss:
                r["step_loss"] = loss
            if coll:
                r["collectives"] = coll
            return r
        rounds = [dict(round=1, results=[
            rec("default", loss=[2.0, 1.5, 1.25]),
            rec("expandable", loss=[2.0, 1.5, 1.2500625]),
            rec("gmlake", loss=[2.0, 1.49, 1.25]),
            rec("gmlake", loss=[9.0, 9.0, 9.0], ok=False)])]
        text = benchlib.loss_table(rounds)
        self.assertIn("| dist_llama_fsdp | 1 | 0.0100 | 0.0100 | 0.0001 |",
                      text)
        self.assertIsNone(benchlib.collectives_table(rounds))

        def coll(bus, stitched):
            return dict(world=2, iters=10, gbps={
                "all_reduce:64": dict(algbw=[1.0], busbw=bus)},
                stitched=stitched)
        rounds = [dict(round=1, results=[
            rec("default", coll=coll([100.0, 80.0], {})),
            rec("expandable", coll=coll([95.0], {})),
            rec("gmlake", coll=coll([85.5], {"64": True}))]),
            dict(round=2, results=[
                rec("gmlake", coll=coll([90.5], {"64": False}))])]
        text = benchlib.collectives_table(rounds)
        self.assertIn("Bus bandwidth, GB/s (2 ranks)", text)
        # gmlake 88.0 against the faster reference, expandable's 95.0.
        self.assertIn("| all_reduce 64 MiB | 90.0 | 95.0 | 88.0 | 0.926 | "
                      "no |", text)
        self.assertIsNone(benchlib.loss_table(rounds))

    def test_child_command(self):
        import bench
        a = bench.parse(["--lib", "L", "--workloads", "dist"])
        a.size = "full"
        one = bench.child_command(a, "gmlake", "workloads", ["--x"])
        self.assertEqual(one[0], sys.executable)
        self.assertNotIn("torch.distributed.run", one)
        a.nproc = 4
        many = bench.child_command(a, "gmlake", "workloads", ["--x"])
        self.assertEqual(many[:6], [sys.executable, "-m",
                                    "torch.distributed.run", "--standalone",
                                    "--nproc_per_node", "4"])
        self.assertEqual(many[6:], one[1:])
        self.assertEqual(one[1], os.path.abspath(bench.__file__))

    def test_nproc_needs_dist_workloads(self):
        import bench
        err = io.StringIO()
        with mock.patch("sys.stderr", err):
            self.assertEqual(bench.main(["--nproc", "2", "--workloads",
                                         "dist,eco_vit", "--report"]), 2)
            self.assertEqual(bench.main(["--nproc", "0", "--report"]), 2)
        self.assertIn("only dist workloads", err.getvalue())
        self.assertIn("at least 1", err.getvalue())


class TestBenchCli(unittest.TestCase):
    """bench.py's argument handling, rounds and report (no torch)."""

    def setUp(self):
        import bench
        self.bench = bench
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        self.tmp = tmp.name

    def test_host_view_ns(self):
        class View:
            calls = 0

            def t(self):
                View.calls += 1
                return self

        ns = benchlib.host_view_ns(View(), 500)
        self.assertEqual(View.calls, 500)
        self.assertGreater(ns, 0)

    def run_steps(self, steps, shapes, allocator="gmlake"):
        """bench.run_steps() over the callables steps, each returning its
        step's shape, with stand-ins for torch and the allocator's
        figures (driver use 5); (its return, r)."""
        class Tensor:
            def t(self):
                return self

        class Torch:
            class cuda:
                @staticmethod
                def synchronize():
                    pass

            @staticmethod
            def empty(shape, **kw):
                return Tensor()

        class Mem:
            torch = Torch

            def driver_used(self):
                return 5

            def snapshot(self):
                return {}

            def delta(self, a, b):
                return {}

            def now(self):
                return ""

        it = iter(steps)
        state = dict(step=lambda: next(it)(), shapes=shapes)
        args = mock.Mock(warmup=False, allocator=allocator)
        r = dict(step_times=[], step_shapes=[])
        with mock.patch.object(self.bench, "emit"):
            used = self.bench.run_steps("w", args, Mem(), state,
                                        len(steps), r)
        return used, r

    def test_run_steps_times_the_host(self):
        """Every step gets its time, shape, CPU and host speed, and the
        collector's clock goes when the steps end."""
        used, r = self.run_steps([lambda: [1], lambda: [2], lambda: [1]],
                                 [[1], [2]])
        self.assertEqual(used, 5)
        self.assertEqual(r["step_shapes"], [[1], [2], [1]])
        self.assertEqual(len(r["step_times"]), 3)
        self.assertEqual(len(r["step_host_ns"]), 3)
        self.assertTrue(all(ns > 0 for ns in r["step_host_ns"]))
        self.assertEqual(r["step_calls"], [{}, {}, {}])
        self.assertEqual(len(r["step_gc_ms"]), 3)
        self.assertFalse(any(isinstance(c, benchlib.GcClock)
                             for c in gc.callbacks))

    def test_run_steps_times_the_collector(self):
        """A step that collects garbage shows it in step_gc_ms; one that
        does not, 0."""
        def collecting():
            junk = [[] for _ in range(20000)]
            for j in junk:
                j.append(junk)  # cycles only the collector frees
            del junk
            gc.collect()
            return [1]

        # Only the step's own gc.collect(): no automatic collection in
        # the other step.
        if gc.isenabled():
            gc.disable()
            self.addCleanup(gc.enable)
        _, r = self.run_steps([lambda: [0], collecting], [[0], [1]],
                              allocator="default")
        self.assertEqual(r["step_gc_ms"][0], 0)
        self.assertGreater(r["step_gc_ms"][1], 0)
        self.assertEqual(r["step_segments"], [{}, {}])

    def main(self, argv, fake=None, missing=()):
        """bench.main(argv) with run_allocator replaced by fake and the
        modules in `missing` not importable; returns (rc, stderr)."""
        err = io.StringIO()
        with mock.patch("gmlake.find_library", return_value="/x.so"), \
                mock.patch.object(self.bench, "missing_modules",
                                  lambda mods: [m for m in mods
                                                if m in missing]), \
                mock.patch.object(self.bench, "run_allocator",
                                  fake or self.fake), \
                mock.patch.object(self.bench, "source_commit",
                                  return_value="abc1234"), \
                mock.patch("sys.stderr", err), \
                mock.patch("sys.stdout", io.StringIO()):
            rc = self.bench.main(argv)
        return rc, err.getvalue()

    def fake(self, args, a, todo, meta, notes):
        """Every workload ran: 4 steps, two shapes; a step per call."""
        self.order.append(a)
        n = len(self.order)
        meta.setdefault("gpu", "GPU X")
        return [result(w, a, [90, 80, 10 * n, 10 * n], [[1], [2], [1], [2]],
                       index=i, peak_allocated=G, peak_reserved=2 * G)
                for i, w in todo]

    order = None

    def load(self):
        with open(os.path.join(self.tmp, "results.json")) as f:
            return json.load(f)

    def test_parse(self):
        a = self.bench.parse(["--quick", "--sweep", "--lib", "/x.so"])
        self.assertEqual((a.size, a.sweep, a.lib), ("quick", True, "/x.so"))
        a = self.bench.parse([])
        self.assertEqual((a.size, a.out, a.round, a.rounds, a.report),
                         ("full", None, None, None, None))
        self.assertEqual(self.bench.parse(["--report"]).report, [])
        self.assertEqual(self.bench.parse(["--report", "a", "b", "--out",
                                           "c"]).report, ["a", "b"])
        with mock.patch("sys.stderr", io.StringIO()), \
                self.assertRaises(SystemExit):
            self.bench.parse(["--round", "1", "--rounds", "3"])

    def test_expand_workloads(self):
        b = self.bench
        self.assertEqual(b.expand_workloads(None), list(b.GPT))
        self.assertEqual(b.expand_workloads("eco"),
                         list(b.ecosystem.CORE))
        self.assertEqual(b.expand_workloads("eco_extra,eco_vit"),
                         ["eco_lora", "eco_convnet", "eco_vit"])
        self.assertEqual(b.expand_workloads("eco_sage,eco,lora"),
                         ["eco_sage", "eco_vit", "eco_maskrcnn",
                          "eco_llama_fsdp", "eco_compile", "lora"])
        self.assertEqual(b.expand_workloads("all"), list(b.WORKLOADS))
        with self.assertRaises(ValueError):
            b.expand_workloads("gpt_nope")

    def test_steps_and_budgets_for_all(self):
        for size in ("full", "quick"):
            self.assertEqual(sorted(self.bench.STEPS[size]),
                             sorted(self.bench.WORKLOADS))
            self.assertEqual(sorted(self.bench.BUDGET[size]),
                             sorted(self.bench.WORKLOADS))
        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop("BENCH_CHILD_TIMEOUT", None)
            eco = self.bench.child_timeout("full", self.bench.GROUPS["eco"])
            self.assertLessEqual(eco, self.bench.CHILD_MAX)
            self.assertEqual(self.bench.child_timeout("full", ["eco_sage"]),
                             self.bench.CHILD_START + 45)
            self.assertEqual(self.bench.child_timeout("full", [], True),
                             self.bench.CHILD_MAX)
        with mock.patch.dict(os.environ, {"BENCH_CHILD_TIMEOUT": "7"}):
            self.assertEqual(self.bench.child_timeout("full", ["lora"]), 7)

    def test_requires(self):
        self.assertEqual(self.bench.requires(["lora", "eco_vit", "eco_sage",
                                              "eco_compile"]),
                         ["torch", "timm", "torch_geometric"])

    def test_child_env(self):
        env = self.bench.child_env("expandable", "/x.so")
        self.assertEqual(env["PYTORCH_CUDA_ALLOC_CONF"],
                         "expandable_segments:True")
        self.assertEqual(env["TORCHINDUCTOR_CACHE_DIR"],
                         self.bench.compile_cache_dir())
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

    def test_bad_options(self):
        for argv in (["--workloads", "gpt_nope"], ["--rounds", "0"],
                     ["--round", "0"], ["--allocators", "default,nope"]):
            rc, err = self.main(argv + ["--out", self.tmp])
            self.assertEqual(rc, 2, argv)
            self.assertIn("bench.py: ", err)

    def test_no_torch(self):
        """Without PyTorch: one clear message, exit 2, nothing run."""
        self.order = []
        rc, err = self.main(["--out", self.tmp], missing=("torch",))
        self.assertEqual(rc, 2)
        self.assertIn("cannot run: torch not importable", err)
        self.assertEqual(err.count("\n"), 1)
        self.assertEqual(self.order, [])
        self.assertFalse(os.path.exists(os.path.join(self.tmp,
                                                     "results.json")))
        rc, err = self.main(["--workloads", "eco", "--out", self.tmp],
                            missing=("timm",))
        self.assertEqual(rc, 2)
        self.assertIn("timm not importable", err)

    def test_no_torch_for_real(self):
        """The real check, where this Python has no torch (CI)."""
        if self.bench.importlib.util.find_spec("torch") is not None:
            self.skipTest("torch is installed here")
        err = io.StringIO()
        with mock.patch("sys.stderr", err):
            self.assertEqual(self.bench.main(["--out", self.tmp]), 2)
        self.assertIn("torch not importable", err.getvalue())

    def test_rounds_alternate(self):
        self.order = []
        rc, _ = self.main(["--rounds", "3", "--workloads", "lora",
                           "--allocators", "default,gmlake",
                           "--out", self.tmp])
        self.assertEqual(rc, 0)
        self.assertEqual(self.order, ["default", "gmlake", "gmlake",
                                      "default", "default", "gmlake"])
        data = self.load()
        self.assertEqual([r["round"] for r in data["rounds"]], [1, 2, 3])
        self.assertEqual(data["rounds"][1]["order"], ["gmlake", "default"])
        self.assertEqual(data["rounds"][0]["commit"], "abc1234")
        self.assertTrue(all(r["complete"] for r in data["rounds"]))
        with open(os.path.join(self.tmp, "results.md")) as f:
            text = f.read()
        self.assertIn("3 rounds (1, 2, 3)", text)
        # Round 1: default 10 ms, gmlake 20; round 2: gmlake 30, default
        # 40; round 3: default 50, gmlake 60.
        self.assertIn("| lora | libgmlake | 36.7 | 20.0 / 30.0 / 60.0 |",
                      text)
        self.assertIn("| lora | PyTorch default | 1.100x | 2.000x / 0.750x "
                      "/ 1.200x | 2.000x |", text)

    def test_round_k_appends_and_replaces(self):
        self.order = []
        for k in (2, 1, 2):
            rc, _ = self.main(["--round", str(k), "--workloads",
                               "eco_sage,lora", "--out", self.tmp])
            self.assertEqual(rc, 0)
        self.assertEqual(self.order, ["gmlake", "expandable", "default",
                                      "default", "expandable", "gmlake",
                                      "gmlake", "expandable", "default"])
        data = self.load()
        self.assertEqual([r["round"] for r in data["rounds"]], [1, 2])
        two = data["rounds"][1]
        self.assertIn("replaces an earlier round 2", " ".join(two["notes"]))
        self.assertEqual(two["command"], "python3 bench/bench.py --round 2 "
                         "--workloads eco_sage,lora")
        self.assertEqual({r["workload"] for r in two["results"]},
                         {"eco_sage", "lora"})
        # The last round 2's steps: calls 7, 8, 9.
        g = [r for r in two["results"] if r["allocator"] == "gmlake"][0]
        self.assertEqual(g["step_times"][2], 0.07)

    def test_round_in_two_calls(self):
        self.order = []
        for w in ("lora", "eco_sage"):
            rc, _ = self.main(["--round", "1", "--workloads", w,
                               "--out", self.tmp])
            self.assertEqual(rc, 0)
        data = self.load()
        self.assertEqual([(r["round"], r["results"][0]["workload"])
                          for r in data["rounds"]],
                         [(1, "lora"), (1, "eco_sage")])
        self.assertEqual(data["rounds"][1]["notes"], [])
        with open(os.path.join(self.tmp, "results.md")) as f:
            text = f.read()
        self.assertIn("1 round (1)", text)
        self.assertIn("| eco_sage | libgmlake |", text)
        self.assertIn("| lora | libgmlake |", text)

    def test_sweep_in_the_last_round_only(self):
        self.order, sweeps = [], []

        def fake_child(args, a, what, extra, names=(), label=None):
            sweeps.append((a, what, extra))
            return 0, [dict(kind="sweep", workload="lora", allocator=a,
                            cap_bytes=G, seq=[64], best=2, failed=3,
                            trials=[(1, True)])]
        with mock.patch.object(self.bench, "run_child", fake_child):
            rc, _ = self.main(["--rounds", "2", "--sweep", "--workloads",
                               "lora", "--allocators", "default,gmlake",
                               "--out", self.tmp])
            self.assertEqual(rc, 0)
            self.assertEqual(sweeps, [
                ("default", "sweep", ["--workloads", "lora"]),
                ("gmlake", "sweep", ["--workloads", "lora"])])
            data = self.load()
            self.assertEqual([len(r["sweeps"]) for r in data["rounds"]],
                             [0, 2])
            rc, _ = self.main(["--sweep", "--workloads", "eco_sage",
                               "--round", "3", "--out", self.tmp])
            self.assertEqual(rc, 0)
            self.assertEqual(len(sweeps), 2)
            self.assertIn("no capacity sweep", " ".join(
                self.load()["rounds"][-1]["notes"]))

    def test_failed_workload_exits_1(self):
        def fake(args, a, todo, meta, notes):
            r = result("lora", a, [1, 1], index=0)
            if a == "expandable":
                r.update(ok=False, error="RuntimeError: boom")
            return [r]
        rc, _ = self.main(["--workloads", "lora", "--out", self.tmp], fake)
        self.assertEqual(rc, 1)
        rnd = self.load()["rounds"][0]
        self.assertTrue(rnd["complete"])
        self.assertIn("PyTorch expandable segments, lora: RuntimeError: boom",
                      rnd["notes"])

    def test_written_after_each_child(self):
        """A call cut short keeps every child that finished."""
        seen = []

        def fake(args, a, todo, meta, notes):
            path = os.path.join(self.tmp, "results.json")
            if os.path.exists(path):
                with open(path) as f:
                    rnd = json.load(f)["rounds"][0]
                seen.append((rnd["complete"], len(rnd["results"])))
            return [result("lora", a, [1, 1], index=0)]
        self.main(["--workloads", "lora", "--out", self.tmp], fake)
        self.assertEqual(seen, [(False, 1), (False, 2)])

    def test_default_out_is_new(self):
        with mock.patch.object(self.bench, "HERE", self.tmp):
            import datetime
            now = datetime.datetime(2027, 1, 2, 3, 4, 5)
            a = self.bench.default_out(now)
            self.assertEqual(a, os.path.join(self.tmp, "out",
                                             "20270102-030405"))
            os.makedirs(a)
            self.assertEqual(self.bench.default_out(now), a + "-2")
        self.assertTrue(self.bench.default_out().startswith(
            os.path.join(self.bench.HERE, "out") + os.sep))

    def test_report(self):
        data = three_rounds()
        paths = []
        for rnd in data["rounds"]:
            d = os.path.join(self.tmp, "r%d" % rnd["round"])
            os.makedirs(d)
            benchlib.write_json(os.path.join(d, "results.json"),
                                dict(format=2, rounds=[rnd]))
            paths.append(d)
        out = os.path.join(self.tmp, "merged")
        rc, _ = self.main(["--report", paths[2],
                           os.path.join(paths[0], "results.json"), paths[1],
                           "--out", out], missing=("torch",))
        self.assertEqual(rc, 0)     # no torch needed
        with open(os.path.join(out, "results.json")) as f:
            self.assertEqual(json.load(f), data)
        with open(os.path.join(out, "results.md")) as f:
            self.assertEqual(f.read(), benchlib.results_markdown(data))
        # Again from the merged folder: results.md only.
        os.remove(os.path.join(out, "results.md"))
        rc, _ = self.main(["--report", "--out", out])
        self.assertEqual(rc, 0)
        self.assertTrue(os.path.exists(os.path.join(out, "results.md")))

    def test_report_errors(self):
        rc, err = self.main(["--report"])
        self.assertEqual((rc, "needs results" in err), (2, True))
        rc, err = self.main(["--report", os.path.join(self.tmp, "none")])
        self.assertEqual(rc, 2)
        one = three_rounds()
        one["rounds"] = one["rounds"][:1]
        other = json.loads(json.dumps(one))
        other["rounds"][0]["wall_s"] = 1
        for name, d in (("a.json", one), ("b.json", other)):
            benchlib.write_json(os.path.join(self.tmp, name), d)
        rc, err = self.main(["--report", os.path.join(self.tmp, "a.json"),
                             os.path.join(self.tmp, "b.json"), "--out",
                             os.path.join(self.tmp, "o")])
        self.assertEqual(rc, 2)
        self.assertIn("round 1 twice", err)

    def test_compile_warmup_once(self):
        calls = []

        def fake_child(args, allocator, what, extra, names=(), label=None):
            calls.append((allocator, extra))
            return 0, [dict(kind="result", ok=True)]
        cache = os.path.join(self.tmp, "cache")
        args = self.bench.parse(["--lib", "/x.so"])
        with mock.patch.dict(os.environ, {"BENCH_COMPILE_CACHE": cache}), \
                mock.patch.object(self.bench, "run_child", fake_child), \
                mock.patch("sys.stdout", io.StringIO()):
            rnd = dict(notes=[])
            self.bench.warm_compile_cache(args, ["lora"], rnd)
            self.assertEqual((calls, rnd["notes"]), ([], []))
            self.bench.warm_compile_cache(args, ["lora", "eco_compile"], rnd)
            self.assertEqual(calls, [("default", ["--workloads",
                                                  "1:eco_compile",
                                                  "--warmup"])])
            self.assertIn("warmed by one step at each", rnd["notes"][0])
            self.bench.warm_compile_cache(args, ["eco_compile"], rnd)
            self.assertEqual(len(calls), 1)
            self.assertIn("warm from an earlier run", rnd["notes"][1])

    def test_fresh_child_per_workload(self):
        """--fresh: one child per workload and allocator, indices kept;
        without it one child per allocator runs them all."""
        def run(extra):
            calls = []

            def fake_child(args, allocator, what, extra, names=(),
                           label=None):
                calls.append((allocator, extra[1]))
                return 0, [dict(kind="result", workload=n, index=int(i),
                                allocator=allocator, ok=True, oom=False,
                                step_times=[0.1, 0.1])
                           for i, n in (w.split(":")
                                        for w in extra[1].split(","))]
            out = os.path.join(self.tmp, "fresh%d" % len(extra))
            args = self.bench.parse(["--lib", "/x.so", "--workloads",
                                     "eco_sage,eco_vit", "--allocators",
                                     "gmlake,default", "--round", "2",
                                     "--out", out] + extra)
            with mock.patch.object(self.bench, "run_child", fake_child), \
                    mock.patch("sys.stdout", io.StringIO()):
                rnd = self.bench.run_round(
                    args, 2, ["eco_sage", "eco_vit"], ["gmlake", "default"],
                    self.bench.Store(out), ["bench.py"], False)
            with open(os.path.join(out, "results.md")) as f:
                return calls, rnd, f.read()
        calls, rnd, md = run(["--fresh"])
        self.assertEqual(calls, [("default", "0:eco_sage"),
                                 ("default", "1:eco_vit"),
                                 ("gmlake", "0:eco_sage"),
                                 ("gmlake", "1:eco_vit")])
        self.assertTrue(rnd["fresh"])
        self.assertEqual(sorted((r["allocator"], r["index"])
                                for r in rnd["results"]),
                         [("default", 0), ("default", 1), ("gmlake", 0),
                          ("gmlake", 1)])
        self.assertIn("own process for each workload (--fresh)", md)
        calls, rnd, md = run([])
        self.assertEqual(calls, [("default", "0:eco_sage,1:eco_vit"),
                                 ("gmlake", "0:eco_sage,1:eco_vit")])
        self.assertFalse(rnd["fresh"])
        self.assertNotIn("--fresh", md)

    def test_shown_command(self):
        self.assertEqual(self.bench.shown_command(
            ["bench.py", "--lib", os.path.join(self.bench.REPO, "b", "x.so"),
             "--out", "/o", "--round", "2", "--out=/p"]),
            "python3 bench/bench.py --lib b/x.so --round 2")


CHILD = r"""
import json, sys, time
MARK = "BENCH-RESULT "
print(MARK + json.dumps(dict(kind="meta", gpu="G")), flush=True)
print("some warning", flush=True)
for i in range(3):
    print(MARK + json.dumps(dict(kind="progress", workload="w", step=i,
                                 steps=3)), flush=True)
    time.sleep(0.2)
print(MARK + json.dumps(dict(kind="result", workload="w")), flush=True)
time.sleep(float(sys.argv[1]))
sys.exit(int(sys.argv[2]))
"""


class Tty(io.StringIO):
    def isatty(self):
        return True


class TestChildProcess(unittest.TestCase):
    """run_process: records, other output, progress, exit and timeout."""

    def setUp(self):
        import bench
        self.bench = bench

    def run_child(self, sleep, rc, timeout, stderr):
        out = io.StringIO()
        with mock.patch("sys.stdout", out):
            got = self.bench.run_process(
                [sys.executable, "-c", CHILD, str(sleep), str(rc)],
                dict(os.environ), timeout, "libgmlake", stderr)
        return got, out.getvalue()

    def test_records_and_exit(self):
        err = io.StringIO()
        (rc, records), out = self.run_child(0, 3, 30, err)
        self.assertEqual(rc, 3)
        self.assertEqual([r["kind"] for r in records], ["meta", "result"])
        self.assertEqual(out, "   some warning\n")
        self.assertEqual(err.getvalue(), "")     # not a terminal: quiet

    def test_progress_on_a_terminal(self):
        err = Tty()
        (rc, _), _ = self.run_child(1, 0, 30, err)
        self.assertEqual(rc, 0)
        text = err.getvalue()
        self.assertIn("\rlibgmlake: w step 2/3, ", text)
        self.assertTrue(text.endswith("\r\x1b[K"))    # cleared at the end

    def test_timeout(self):
        t0 = time.monotonic()
        (rc, records), _ = self.run_child(60, 0, 2, io.StringIO())
        self.assertEqual(rc, "timeout")
        self.assertLess(time.monotonic() - t0, 20)
        self.assertEqual([r["kind"] for r in records], ["meta", "result"])

    def test_progress_text(self):
        p = self.bench.progress_text
        self.assertEqual(p("libgmlake", None, 3.7), "libgmlake, 3 s")
        self.assertEqual(p("x", dict(workload="eco_vit", step=0,
                                     steps=None), 5), "x: eco_vit building, "
                         "5 s")
        self.assertEqual(p("x", dict(workload="w", step=4, steps=28), 61),
                         "x: w step 4/28, 61 s")

    def test_call_delta(self):
        self.assertEqual(self.bench.call_delta(
            {"mem_map": (3, 100), "set_access": (1, 5)},
            {"mem_map": (5, 180), "set_access": (1, 5), "mem_unmap": (2, 9)}),
            {"mem_map": [2, 80], "mem_unmap": [2, 9]})


class FakeCuda:
    """The parts of torch.cuda the child's loop calls."""

    class OutOfMemoryError(RuntimeError):
        pass

    def __init__(self):
        self.allocs = 0

    def synchronize(self, device=None):
        pass

    def current_device(self):
        return 0

    def mem_get_info(self, device=None):
        return (70 * G - self.allocs * G, 80 * G)

    def empty_cache(self):
        pass

    def reset_peak_memory_stats(self, device=None):
        pass

    def memory_stats(self, device=None):
        return {"num_device_alloc": self.allocs, "num_device_free": 0,
                "requested_bytes.all.peak": 3 * G,
                "reserved_bytes.all.peak": 4 * G,
                "allocated_bytes.all.peak": 3 * G}


class FakeGmlake:
    """gmlake.stats() whose mem_map count grows by the step's shape."""

    def __init__(self):
        self.maps = 0

    def stats(self, device=0):
        return {"calls.mem_map": self.maps, "call_ns.mem_map": self.maps * 10,
                "calls.set_access": 1, "call_ns.set_access": 5,
                "requested_bytes.peak": 3 * G, "reserved_bytes.peak": 3 * G,
                "allocated_bytes.peak": 3 * G, "spilled_bytes.peak": 0,
                "resident_bytes.peak": 3 * G, "host_bytes.peak": 0,
                "stitches": 1, "stitch_reuses": 2}

    def reset_peak_stats(self, device=0):
        pass


class TestChildLoop(unittest.TestCase):
    """run_workload with a stand-in torch: step records, per-step driver
    calls or device allocations, close(), failures."""

    def setUp(self):
        import bench
        self.bench = bench
        self.cuda = FakeCuda()
        torch = mock.MagicMock()
        torch.cuda = self.cuda
        patcher = mock.patch.dict(sys.modules, {"torch": torch})
        patcher.start()
        self.addCleanup(patcher.stop)
        self.closed = []

    def state(self, fail_at=None):
        shapes = iter([(2, 3), (4, 5), (2, 3), (4, 5)])
        gm = self.gm = FakeGmlake()

        def step():
            shape = next(shapes)
            if fail_at is not None and gm.maps >= fail_at:
                raise self.cuda.OutOfMemoryError("CUDA out of memory")
            self.cuda.allocs += 1
            gm.maps += shape[0]
            return shape
        return dict(step=step, note="n", close=lambda: self.closed.append(1))

    def run_one(self, allocator, state):
        args = self.bench.parse(["--lib", "/x.so"])
        args.allocator = allocator
        mem = self.bench.Memory.__new__(self.bench.Memory)
        mem.torch, mem.allocator, mem.device = sys.modules["torch"], \
            allocator, 0
        mem.last_ns, mem.gmlake = {}, self.gm
        out = io.StringIO()
        with mock.patch.object(self.bench, "build_workload",
                               return_value=(state, 4)), \
                mock.patch.object(self.bench, "guard",
                                  lambda a: mock.MagicMock()), \
                mock.patch("sys.stdout", out):
            r = self.bench.run_workload("eco_sage", 3, args, mem)
        progress = [json.loads(line[len(self.bench.MARK):])
                    for line in out.getvalue().splitlines()]
        return r, progress

    def test_gmlake(self):
        r, progress = self.run_one("gmlake", self.state())
        self.assertTrue(r["ok"])
        self.assertEqual(r["step_shapes"], [[2, 3], [4, 5], [2, 3], [4, 5]])
        self.assertEqual(len(r["step_times"]), 4)
        self.assertEqual(r["step_calls"], [{"mem_map": [2, 20]},
                                           {"mem_map": [4, 40]},
                                           {"mem_map": [2, 20]},
                                           {"mem_map": [4, 40]}])
        self.assertEqual([p.get("step") for p in progress], [0, 1, 2, 3, 4])
        self.assertEqual(self.closed, [1])
        self.assertEqual((r["peak_reserved"], r["fragmentation"]),
                         (3 * G, 0.0))
        self.assertEqual(r["driver_used"], 4 * G)
        self.assertEqual(benchlib.settle_flags(r),
                         [True, True, False, False])

    def test_step_cpus(self):
        r, _ = self.run_one("gmlake", self.state())
        self.assertEqual(len(r["step_cpus"]), 4)
        here = os.sched_getaffinity(0)
        self.assertTrue(all(c in here for c in r["step_cpus"]),
                        r["step_cpus"])

    def test_cpu_list(self):
        self.assertEqual(self.bench.cpu_list("0-3,8, 10-11"),
                         {0, 1, 2, 3, 8, 10, 11})
        self.assertEqual(self.bench.cpu_list("5"), {5})
        for bad in ("", "3-1", "-1", "a", "1,,2"):
            with self.assertRaises(ValueError, msg=bad):
                self.bench.cpu_list(bad)

    def test_bench_cpus_refused(self):
        args = self.bench.parse(["--lib", "/x.so"])
        args.child, args.workloads = "workloads", "eco_sage:0"
        out = io.StringIO()
        with mock.patch.dict(os.environ, {"BENCH_CPUS": "3-1"}), \
                mock.patch("sys.stdout", out):
            self.assertEqual(self.bench.child(args), 1)
        rec = [json.loads(line[len(self.bench.MARK):])
               for line in out.getvalue().splitlines()]
        self.assertIn("BENCH_CPUS", json.dumps(rec))

    def test_current_cpu(self):
        cpu = self.bench.current_cpu()
        self.assertIn(cpu, os.sched_getaffinity(0))
        with mock.patch("builtins.open", side_effect=OSError("none")):
            self.assertIsNone(self.bench.current_cpu())

    def test_pytorch(self):
        r, _ = self.run_one("expandable", self.state())
        self.assertTrue(r["ok"])
        self.assertEqual(r["step_segments"], [[1, 0]] * 4)
        self.assertNotIn("step_calls", r)
        self.assertAlmostEqual(r["fragmentation"], 25.0)

    def test_out_of_memory(self):
        r, _ = self.run_one("gmlake", self.state(fail_at=8))
        self.assertFalse(r["ok"])
        self.assertTrue(r["oom"])
        self.assertEqual((r["steps_done"], len(r["step_shapes"]),
                          len(r["step_calls"])), (3, 3, 3))
        self.assertIn("OutOfMemoryError", r["error"])
        self.assertEqual(self.closed, [1])      # closed all the same


if __name__ == "__main__":
    unittest.main()
