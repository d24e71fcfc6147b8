# SPDX-License-Identifier: MIT
"""bench/trace_shuffle.py on a small trace written here: the warm-up
steps first, steps drawn from the rest whole, settle flags set again for
the new order, the sidecar's counts, and a step that leaves a block live
refused."""

import gzip
import json
import os
import subprocess
import sys
import tempfile
import unittest

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(BENCH, "trace_shuffle.py")
sys.path.insert(0, BENCH)

import trace_shuffle as ts  # noqa: E402


def step_lines(i, settle, size, addr):
    return ["step %d %d 0" % (i, settle),
            "alloc %d %d 0" % (addr, size),
            "free_requested %d %d 0" % (addr, size),
            "free_completed %d %d 0" % (addr, size)]


def write_trace(d, steps, leak=False):
    lines = ["# pytorch 2.11 workload=t steps=%d" % len(steps),
             "# action addr size stream",
             "alloc 4096 512 0"]              # a parameter, kept
    for i, size in enumerate(steps):
        lines += step_lines(i, int(i == 0), size, 8192 + i)
    if leak:
        lines.append("alloc 99999 64 0")     # the last step keeps it
    path = os.path.join(d, "t.trace.gz")
    with gzip.open(path, "wt") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(d, "t.trace.json"), "w") as f:
        json.dump({"workload": "t", "steps": len(steps), "events": 0}, f)
    return path


def read_steps(path):
    with gzip.open(path, "rt") as f:
        head, steps = ts.split_steps(f.read().splitlines())
    return head, [(s[0].split(), s[1].split()[2]) for s in steps]


class TestShuffle(unittest.TestCase):

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT] + list(args),
                               capture_output=True, text=True)

    def test_order_and_flags(self):
        with tempfile.TemporaryDirectory() as d:
            src = write_trace(d, [100, 200, 300, 400, 300])
            out = os.path.join(d, "out")
            r = self.run_script(src, out, "--steps", "30", "--seeds", "7,8")
            self.assertEqual(r.returncode, 0, r.stderr)
            a = os.path.join(out, "t_s7.trace.gz")
            head, steps = read_steps(a)
            self.assertEqual(head[2], "alloc 4096 512 0")
            self.assertEqual(len(steps), 32)
            # Warm-up first, as recorded; then sizes from steps 2-4 only.
            self.assertEqual([s for _, s in steps[:2]], ["100", "200"])
            drawn = [s for _, s in steps[2:]]
            self.assertTrue(set(drawn) <= {"300", "400"})
            self.assertEqual(set(drawn), {"300", "400"})   # 30 draws
            seen = set()
            for i, (f, size) in enumerate(steps):
                self.assertEqual(f[1], str(i))
                self.assertEqual(f[2], "0" if size in seen else "1")
                seen.add(size)
            with open(os.path.join(out, "t_s7.trace.json")) as f:
                side = json.load(f)
            self.assertEqual((side["workload"], side["steps"]),
                             ("t_s7", 32))
            self.assertEqual(side["events"], 1 + 32 * 4)
            # Seeded: the same seed the same order, another seed another.
            r = self.run_script(src, os.path.join(d, "again"),
                                "--steps", "30", "--seeds", "7")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertEqual(
                read_steps(os.path.join(d, "again", "t_s7.trace.gz")),
                (head, steps))
            self.assertNotEqual(
                read_steps(os.path.join(out, "t_s8.trace.gz"))[1], steps)

    def test_refuses_a_step_that_keeps_blocks(self):
        with tempfile.TemporaryDirectory() as d:
            src = write_trace(d, [100, 200, 300], leak=True)
            r = self.run_script(src, os.path.join(d, "out"))
            self.assertEqual(r.returncode, 1)
            self.assertIn("cannot be reordered", r.stderr)
            self.assertFalse(os.path.exists(os.path.join(d, "out")))

    def test_bad_arguments(self):
        with tempfile.TemporaryDirectory() as d:
            src = write_trace(d, [100, 200, 300])
            for args in (["--steps", "0"], ["--seeds", "1,x"]):
                r = self.run_script(src, os.path.join(d, "out"), *args)
                self.assertEqual(r.returncode, 2, args)


if __name__ == "__main__":
    unittest.main()
