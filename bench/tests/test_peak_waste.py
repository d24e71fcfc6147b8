# SPDX-License-Identifier: MIT
"""bench/peak_waste.py on small traces written here: the live blocks at
the first moment of the peak (a block lives to its free_requested), whole
chunks' loss against 512-byte sizes, the small pool left out, sizes
ranked by what they lose, and traces or arguments it cannot take refused
with a message."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(BENCH, "peak_waste.py")
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peak_waste as pw  # noqa: E402
from tracefile import MiB, alloc, free, write  # noqa: E402


def run(*args):
    return subprocess.run([sys.executable, SCRIPT] + list(args),
                          capture_output=True, text=True)


class PeakLive(unittest.TestCase):
    def test_first_moment_of_the_peak(self):
        # Peak 9 MiB with {1: 3, 2: 6}; a later moment reaches 9 MiB
        # again with other blocks, which must not replace the first.
        with tempfile.TemporaryDirectory() as d:
            p = write(d, [alloc(1, 3 * MiB), alloc(2, 6 * MiB)] +
                      free(1, 3 * MiB) + [("step", 1, 0, 0)] +
                      [alloc(3, 3 * MiB)] + free(2, 6 * MiB) +
                      free(3, 3 * MiB))
            peak, live = pw.peak_live(p)
        self.assertEqual(peak, 9 * MiB)
        self.assertEqual(live, {1: 3 * MiB, 2: 6 * MiB})

    def test_free_requested_ends_a_block(self):
        # free_completed comes late: the peak must not count block 1
        # beside block 2.
        with tempfile.TemporaryDirectory() as d:
            p = write(d, [alloc(1, 8 * MiB), free(1, 8 * MiB)[0],
                          alloc(2, 4 * MiB), free(1, 8 * MiB)[1]] +
                      free(2, 4 * MiB))
            peak, live = pw.peak_live(p)
        self.assertEqual(peak, 8 * MiB)
        self.assertEqual(live, {1: 8 * MiB})

    def test_peak_still_live_at_the_end(self):
        with tempfile.TemporaryDirectory() as d:
            p = write(d, [alloc(1, MiB), alloc(2, 2 * MiB)])
            peak, live = pw.peak_live(p)
        self.assertEqual((peak, live), (3 * MiB, {1: MiB, 2: 2 * MiB}))

    def test_unreadable_traces(self):
        # (lines, the line the message must name: two header lines)
        cases = [([alloc(1, MiB)] + free(2, MiB), 4),  # not live
                 ([alloc(1, MiB), alloc(1, MiB)], 4),   # live twice
                 ([("alloc", "x", 5, 0)], 3)]            # not a number
        for lines, bad in cases:
            with tempfile.TemporaryDirectory() as d:
                p = write(d, lines)
                with self.assertRaises(pw.TraceError) as e:
                    pw.peak_live(p)
                self.assertIn("t.trace.gz:%d:" % bad, str(e.exception))


class Waste(unittest.TestCase):
    def test_rounding_per_size(self):
        live = {1: 28 * MiB + MiB // 4, 2: 28 * MiB + MiB // 4,
                3: 4 * MiB, 4: 100, 5: MiB, 6: MiB + 1}
        w = pw.waste(live, 2 * MiB, MiB)
        # 4 and 5 are the small pool's; 3 is whole chunks.
        self.assertEqual(w["large_blocks"], 4)
        self.assertEqual(w["chunk_bytes"], 30 * MiB * 2 + 4 * MiB + 2 * MiB)
        lost6 = 2 * MiB - (MiB + 512)
        self.assertEqual(w["rounding_bytes"],
                         2 * (7 * MiB // 4) + lost6)
        self.assertEqual(w["sizes"],
                         {28 * MiB + MiB // 4: (2, 7 * MiB // 2),
                          MiB + 1: (1, lost6)})

    def test_chunk_size(self):
        w = pw.waste({1: 3 * MiB}, 4 * MiB, MiB)
        self.assertEqual(w["rounding_bytes"], MiB)


class Command(unittest.TestCase):
    def trace(self, d):
        return write(d, [alloc(1, 3 * MiB), alloc(2, 5 * MiB),
                         alloc(3, 6 * MiB)], name="small")

    def test_json(self):
        with tempfile.TemporaryDirectory() as d:
            r = run("--json", "--top", "1", self.trace(d))
        self.assertEqual(r.returncode, 0, r.stderr)
        o = json.loads(r.stdout)
        self.assertEqual(o["trace"], "small")
        self.assertEqual(o["peak_requested"], 14 * MiB)
        self.assertEqual(o["rounding_bytes"], 2 * MiB)
        # 3 and 5 MiB lose 1 MiB each; the smaller size first on a tie.
        self.assertEqual(o["top"], [{"size": 3 * MiB, "count": 1,
                                     "lost": MiB}])

    def test_table(self):
        with tempfile.TemporaryDirectory() as d:
            r = run(self.trace(d))
        self.assertEqual(r.returncode, 0, r.stderr)
        rows = r.stdout.splitlines()
        self.assertTrue(rows[0].startswith("trace"))
        self.assertIn("small", rows[1])
        self.assertIn("3.00 x 1 = 1, 5.00 x 1 = 1", rows[1])

    def test_bad_trace_exit_1(self):
        with tempfile.TemporaryDirectory() as d:
            p = write(d, free(7, MiB))
            r = run(p)
            self.assertEqual(r.returncode, 1)
            self.assertIn("not live", r.stderr)
            r = run(os.path.join(d, "missing.trace.gz"))
            self.assertEqual(r.returncode, 1)
            self.assertIn("missing.trace.gz", r.stderr)
            for name, data in (("plain.trace.gz", b"alloc 1 2 0\n"),
                               ("bytes.trace", b"alloc \xff\xfe 2 0\n")):
                with open(os.path.join(d, name), "wb") as f:
                    f.write(data)
                r = run(os.path.join(d, name))
                self.assertEqual(r.returncode, 1, name)
                self.assertIn("peak_waste:", r.stderr)
                self.assertNotIn("Traceback", r.stderr)

    def test_bad_arguments_exit_2(self):
        with tempfile.TemporaryDirectory() as d:
            p = self.trace(d)
            for args in (["--chunk", "0"], ["--chunk", "2X"],
                         ["--small", "2M"], ["--top", "-1"]):
                r = run(*(args + [p]))
                self.assertEqual(r.returncode, 2, args)
                self.assertIn("error", r.stderr)


if __name__ == "__main__":
    unittest.main()
