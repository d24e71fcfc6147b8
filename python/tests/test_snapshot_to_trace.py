# SPDX-License-Identifier: MIT
"""Tests of gmlake.snapshot_to_trace's step markers; no torch needed.

convert() takes a device trace as a list of dicts (action, addr, size,
stream), as torch.cuda.memory._snapshot()["device_traces"] holds it; with
step_mark, the allocs of that size become step lines. The last test hands
a converted trace to tools/gmlake-replay when it is built.

Environment (tests/python_test.sh sets it): top_builddir (for
tools/gmlake-replay), GMLAKE_BACKEND=emu.
"""

import gzip
import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PYDIR = os.path.dirname(HERE)
ROOT = os.path.dirname(PYDIR)
sys.path.insert(0, PYDIR)

from gmlake import snapshot_to_trace as s2t  # noqa: E402

MARK = 977
MiB = 1 << 20


def ev(action, addr, size, stream=0):
    return {"action": action, "addr": addr, "size": size, "stream": stream}


def marker(addr, size=MARK):
    """A marker as a capture makes it: allocated, then freed at once."""
    return [ev("alloc", addr, size), ev("free_requested", addr, size),
            ev("free_completed", addr, size)]


def block(addr, size, stream=0):
    return [ev("alloc", addr, size, stream),
            ev("free_requested", addr, size, stream),
            ev("free_completed", addr, size, stream)]


def replayed(case, path):
    """tools/gmlake-replay's JSON line for the trace at path on the
    emulated device (case skipped when the tool is not built)."""
    replay = os.path.join(os.environ.get("top_builddir", ROOT), "tools",
                          "gmlake-replay")
    if not os.access(replay, os.X_OK):
        case.skipTest("%s not built" % replay)
    env = dict(os.environ, GMLAKE_BACKEND="emu")
    p = subprocess.run([replay, "--json", "--quiet", path],
                       capture_output=True, text=True, timeout=120, env=env)
    case.assertEqual(p.returncode, 0, p.stdout + p.stderr)
    return json.loads(p.stdout)


class TestStepMarkers(unittest.TestCase):

    def three_steps(self):
        """Set-up (a live 4 MiB block), then three steps of one block each,
        each led by a marker at the same small-pool address."""
        return ([ev("segment_alloc", 1 << 30, 20 * MiB),
                 ev("alloc", 1 << 30, 4 * MiB)] +
                marker(4096) + block((1 << 30) + 4 * MiB, 8 * MiB) +
                marker(4096) + block((1 << 30) + 4 * MiB, 16 * MiB) +
                marker(4096) + block((1 << 30) + 4 * MiB, 8 * MiB))

    def test_markers_become_steps(self):
        out, peak_alloc, peak_reserved = s2t.convert(
            self.three_steps(), step_mark=MARK, settle=[True, True, False])
        steps = [e for e in out if e[0] == "step"]
        self.assertEqual(steps, [("step", 0, 1, 0), ("step", 1, 1, 0),
                                 ("step", 2, 0, 0)])
        # Nothing of the markers is left but the step lines.
        self.assertFalse([e for e in out if e[0] != "step" and
                          e[2] == MARK])
        self.assertEqual(len(out), 2 + 3 + 3 * 3)
        # Each step line comes before its step's first event.
        self.assertEqual(out[2], ("step", 0, 1, 0))
        self.assertEqual(out[3][:3], ("alloc", (1 << 30) + 4 * MiB,
                                      8 * MiB))
        self.assertEqual(out[-4], ("step", 2, 0, 0))
        self.assertEqual(out[-3][:3], ("alloc", (1 << 30) + 4 * MiB,
                                       8 * MiB))
        self.assertEqual((peak_alloc, peak_reserved), (20 * MiB, 20 * MiB))

    def test_no_settle_flags(self):
        out, _, _ = s2t.convert(self.three_steps(), step_mark=MARK)
        self.assertEqual([e for e in out if e[0] == "step"],
                         [("step", k, 0, 0) for k in range(3)])

    def test_without_step_mark(self):
        # No step_mark: the marker is an allocation like any other.
        out, peak_alloc, _ = s2t.convert(self.three_steps())
        self.assertFalse([e for e in out if e[0] == "step"])
        self.assertEqual(len([e for e in out if e[2] == MARK]), 9)
        self.assertEqual(peak_alloc, 20 * MiB)

    def test_markers_not_in_peak(self):
        # A marker while the peak is live would raise it by its size.
        trace = ([ev("alloc", 1 << 30, 8 * MiB), ev("alloc", 4096, MARK),
                  ev("free_completed", 4096, MARK),
                  ev("free_completed", 1 << 30, 8 * MiB)])
        _, peak, _ = s2t.convert(trace)
        self.assertEqual(peak, 8 * MiB + MARK)
        out, peak, _ = s2t.convert(trace, step_mark=MARK, settle=[1])
        self.assertEqual(peak, 8 * MiB)
        self.assertEqual([e[0] for e in out],
                         ["alloc", "step", "free_completed"])

    def test_other_sizes_kept(self):
        trace = (marker(4096) + block(8192, MARK - 1) + block(8704, MARK + 1)
                 + block(9216, 2 * MARK))
        out, _, _ = s2t.convert(trace, step_mark=MARK, settle=[0])
        self.assertEqual([e[0] for e in out].count("step"), 1)
        self.assertEqual([e[2] for e in out if e[0] == "alloc"],
                         [MARK - 1, MARK + 1, 2 * MARK])
        self.assertEqual(len(out), 1 + 3 * 3)

    def test_marker_address_reused(self):
        # Once the marker is freed, a block at its address is a block.
        trace = marker(4096) + block(4096, 512, stream=7)
        out, peak, _ = s2t.convert(trace, step_mark=MARK)
        self.assertEqual(out, [("step", 0, 0, 0), ("alloc", 4096, 512, 7),
                               ("free_requested", 4096, 512, 7),
                               ("free_completed", 4096, 512, 7)])
        self.assertEqual(peak, 512)
        # Also when the marker's free went unrecorded.
        trace = [ev("alloc", 4096, MARK)] + block(4096, 512)
        out, _, _ = s2t.convert(trace, step_mark=MARK)
        self.assertEqual([e[0] for e in out],
                         ["step", "alloc", "free_requested",
                          "free_completed"])

    def test_keep_unmatched_drops_marker_frees(self):
        trace = ([ev("free_completed", 99, 8)] + marker(4096) +
                 block(8192, 512))
        out, _, _ = s2t.convert(trace, keep_unmatched=True, step_mark=MARK,
                                settle=[True])
        self.assertEqual([e[0] for e in out],
                         ["free_completed", "step", "alloc",
                          "free_requested", "free_completed"])
        self.assertEqual(out[0], ("free_completed", 99, 8, 0))

    def test_count_mismatch(self):
        # A workload's own block of the marker's size, or a trace that
        # lost its start: a wrong step count is an error, not a trace.
        with self.assertRaisesRegex(ValueError, "marker 3 .* 3 settle"):
            s2t.convert(self.three_steps() + marker(4096), step_mark=MARK,
                        settle=[1, 1, 0])
        with self.assertRaisesRegex(ValueError, "3 step markers .* 4 "
                                    "settle flags"):
            s2t.convert(self.three_steps(), step_mark=MARK,
                        settle=[1, 1, 0, 0])
        with self.assertRaisesRegex(ValueError, "without step_mark"):
            s2t.convert(self.three_steps(), settle=[1, 1, 0])

    def test_written_and_replayed(self):
        trace = self.three_steps()
        out, peak_alloc, peak_reserved = s2t.convert(
            trace, step_mark=MARK, settle=[1, 1, 0])
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "marked.trace.gz")
            s2t.write(path, out, ["pytorch test", "workload=marked",
                                  "steps=3", "peak_alloc=%d" % peak_alloc,
                                  "peak_reserved=%d" % peak_reserved])
            with gzip.open(path, "rt") as f:
                lines = f.read().splitlines()
            self.assertEqual([ln for ln in lines if ln.startswith("step")],
                             ["step 0 1 0", "step 1 1 0", "step 2 0 0"])
            r = replayed(self, path)
            self.assertEqual(r["priced"], "steady_steps")
            self.assertEqual(r["steady_steps"], 1)
            self.assertEqual(r["unknown_actions"], 0)
            self.assertEqual(r["allocs"], 4)


LL_ON, LL_OFF = 979, 983


class TestLongLivedMarkers(unittest.TestCase):

    def window(self):
        """A 64 MiB activation freed, then a 64 MiB state block allocated
        between long-lived markers (each freed at once, as the capture's)."""
        return (block(1 << 30, 64 * MiB) + marker(4096, LL_ON) +
                [ev("alloc", (1 << 30) + 64 * MiB, 64 * MiB)] +
                marker(4096, LL_OFF))

    def test_markers_become_lines(self):
        out, peak_alloc, _ = s2t.convert(self.window(),
                                         long_lived_marks=(LL_ON, LL_OFF))
        self.assertEqual([e[0] for e in out],
                         ["alloc", "free_requested", "free_completed",
                          "long_lived", "alloc", "long_lived"])
        self.assertEqual(out[3], ("long_lived", 1, 0, 0))
        self.assertEqual(out[5], ("long_lived", 0, 0, 0))
        self.assertEqual(peak_alloc, 64 * MiB)  # markers count in no peak

    def test_without_marks(self):
        # Not asked for: the markers are allocations like any other.
        out, _, _ = s2t.convert(self.window())
        self.assertNotIn("long_lived", [e[0] for e in out])
        self.assertEqual(sum(1 for e in out if e[0] == "alloc"), 4)

    def test_off_before_on(self):
        trace = [ev("alloc", 4096, LL_OFF)]
        with self.assertRaisesRegex(ValueError, "off marker .* without"):
            s2t.convert(trace, long_lived_marks=(LL_ON, LL_OFF))

    def test_sizes_must_differ(self):
        with self.assertRaisesRegex(ValueError, "must differ"):
            s2t.convert([], step_mark=MARK, long_lived_marks=(MARK, LL_OFF))
        with self.assertRaisesRegex(ValueError, "must differ"):
            s2t.convert([], long_lived_marks=(LL_ON, LL_ON))

    def test_written_and_replayed(self):
        out, peak_alloc, peak_reserved = s2t.convert(
            self.window(), long_lived_marks=(LL_ON, LL_OFF))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "ll.trace.gz")
            s2t.write(path, out, ["pytorch test", "workload=ll"])
            with gzip.open(path, "rt") as f:
                lines = f.read().splitlines()
            self.assertEqual([ln for ln in lines
                              if ln.startswith("long_lived")],
                             ["long_lived 1 0 0", "long_lived 0 0 0"])
            r = replayed(self, path)
            self.assertEqual(r["long_lived_windows"], 1)
            self.assertEqual(r["unknown_actions"], 0)
            self.assertEqual(r["allocs"], 2)


class TestTrims(unittest.TestCase):

    def emptied(self):
        """Two 64 MiB blocks in segments of their own, freed; the cache
        emptied (two segment frees); a block allocated again; emptied
        again (one segment unmap, expandable segments' form)."""
        return (
            [ev("segment_alloc", 1 << 30, 64 * MiB)] +
            block(1 << 30, 64 * MiB) +
            [ev("segment_alloc", 2 << 30, 64 * MiB)] +
            block(2 << 30, 64 * MiB) +
            [ev("segment_free", 1 << 30, 64 * MiB),
             ev("segment_free", 2 << 30, 64 * MiB),
             ev("segment_map", 1 << 30, 64 * MiB)] +
            block(1 << 30, 64 * MiB) +
            [ev("segment_unmap", 1 << 30, 64 * MiB)])

    def test_one_trim_per_run_of_releases(self):
        out, _, peak_reserved = s2t.convert(self.emptied(), trims=True)
        kinds = [e[0] for e in out]
        self.assertEqual(kinds.count("trim"), 2)
        first = kinds.index("trim")
        self.assertEqual(kinds[first + 1:first + 3],
                         ["segment_free", "segment_free"])
        self.assertEqual(kinds[-2:], ["trim", "segment_unmap"])
        self.assertIn(("trim", 0, 0, 0), out)
        self.assertEqual(peak_reserved, 128 * MiB)

    def test_off_by_default(self):
        out, _, _ = s2t.convert(self.emptied())
        self.assertNotIn("trim", [e[0] for e in out])

    def test_written_and_replayed(self):
        out, peak_alloc, peak_reserved = s2t.convert(self.emptied(),
                                                     trims=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trim.trace.gz")
            s2t.write(path, out, ["pytorch test", "workload=trim"])
            with gzip.open(path, "rt") as f:
                lines = f.read().splitlines()
            self.assertEqual([ln for ln in lines if ln.startswith("trim")],
                             ["trim 0 0 0", "trim 0 0 0"])
            r = replayed(self, path)
            self.assertEqual(r["trims"], 2)
            self.assertEqual(r["unknown_actions"], 0)
            # The first trim gave the 64 MiB back: the block after it
            # grows again, where without trims it reuses the memory.
            self.assertEqual(r["grows"], 2)
            self.assertGreater(r["releases"], 0)
            path = os.path.join(tmp, "kept.trace.gz")
            s2t.write(path, s2t.convert(self.emptied())[0],
                      ["pytorch test", "workload=kept"])
            r = replayed(self, path)
            self.assertEqual((r["trims"], r["grows"], r["releases"]),
                             (0, 1, 0))


if __name__ == "__main__":
    unittest.main()
