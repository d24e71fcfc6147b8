# SPDX-License-Identifier: MIT
"""bench/expandable_sim.py on small traces written here: pages of 20 and
2 MiB mapped at the segment's end and never given back, a free block at
the end grown into, splits at 512 bytes, best fit, a pool per stream,
the default allocator's segments, and a trace it cannot read refused."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(BENCH, "expandable_sim.py")
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import expandable_sim as es  # noqa: E402
from tracefile import MiB, alloc, free, write  # noqa: E402


class TestModel(unittest.TestCase):
    def run_events(self, events, default=False):
        with tempfile.TemporaryDirectory() as d:
            return es.replay(write(d, events), default)

    def test_pages(self):
        # 30 MiB maps two 20 MiB pages; the default allocator's segment
        # is the size in 2 MiB.
        s = self.run_events([alloc(1, 30 * MiB)])
        self.assertEqual(s.reserved_peak, 40 * MiB)
        self.assertEqual(s.requested_peak, 30 * MiB)
        s = self.run_events([alloc(1, 30 * MiB)], default=True)
        self.assertEqual(s.reserved_peak, 30 * MiB)

    def test_grows_into_free_end(self):
        # The freed 40 MiB at the end is grown by one page for 50 MiB;
        # the default allocator needs a new 50 MiB segment.
        ev = [alloc(1, 30 * MiB)] + free(1, 30 * MiB) + [alloc(2, 50 * MiB)]
        self.assertEqual(self.run_events(ev).reserved_peak, 60 * MiB)
        self.assertEqual(self.run_events(ev, True).reserved_peak, 80 * MiB)

    def test_never_unmapped(self):
        ev = [alloc(1, 100 * MiB)] + free(1, 100 * MiB) + [alloc(2, MiB + 1)]
        s = self.run_events(ev)
        self.assertEqual(s.reserved, 100 * MiB)
        self.assertEqual(s.requested, MiB + 1)

    def test_split_at_512(self):
        # 10 MiB + 100 takes 10 MiB + 512 of a 20 MiB page; the rest
        # serves 9 MiB, so nothing more is mapped.
        ev = [alloc(1, 10 * MiB + 100), alloc(2, 9 * MiB)]
        self.assertEqual(self.run_events(ev).reserved_peak, 20 * MiB)
        # The default allocator: a 12 MiB segment, whose 2 MiB rest does
        # not fit 9 MiB, then a 20 MiB one (requests under 10 MiB).
        self.assertEqual(self.run_events(ev, True).reserved_peak, 32 * MiB)

    def test_small_pool(self):
        # Up to 1 MiB from 2 MiB pages of their own segment: 1000 bytes
        # and 1 MiB share one; 1 MiB + 1 is large.
        ev = [alloc(1, 1000), alloc(2, MiB), alloc(3, MiB + 1)]
        self.assertEqual(self.run_events(ev).reserved_peak, 22 * MiB)

    def test_stream_pools(self):
        # The same request on two streams maps a page for each.
        ev = [alloc(1, 8 * MiB, 0), alloc(2, 8 * MiB, 7)]
        self.assertEqual(self.run_events(ev).reserved_peak, 40 * MiB)
        ev = [alloc(1, 8 * MiB, 0)] + free(1, 8 * MiB, 0) + \
            [alloc(2, 8 * MiB, 7)]
        self.assertEqual(self.run_events(ev).reserved_peak, 40 * MiB)

    def test_best_fit(self):
        # Free holes of 30 and 10 MiB between live blocks: 8 MiB takes
        # the 10 MiB hole, 25 MiB the 30 MiB one, nothing is mapped.
        ev = [alloc(1, 10 * MiB), alloc(2, 10 * MiB), alloc(3, 30 * MiB),
              alloc(4, 10 * MiB)]
        ev += free(1, 10 * MiB) + free(3, 30 * MiB)
        ev += [alloc(5, 8 * MiB), alloc(6, 25 * MiB)]
        s = self.run_events(ev)
        self.assertEqual(s.reserved_peak, 60 * MiB)
        base = s.live[2][1].addr - 10 * MiB
        self.assertEqual(s.live[5][1].addr, base)
        self.assertEqual(s.live[6][1].addr, base + 20 * MiB)

    def test_grow_passes_end_block(self):
        # A free block next to unmapped space counts as growable: a
        # larger free block elsewhere is taken first (get_free_block).
        ev = [alloc(1, 12 * MiB), alloc(2, 4 * MiB), alloc(3, 16 * MiB)]
        ev += free(1, 12 * MiB)     # a 12 MiB hole at the bottom
        ev += [alloc(4, 2 * MiB)]   # the top free block is 8 MiB
        s = self.run_events(ev)
        self.assertEqual(s.live[4][1].addr, s.live[2][1].addr - 12 * MiB)

    def test_bad_trace(self):
        with self.assertRaises(es.TraceError):
            self.run_events(free(5, MiB))
        with self.assertRaises(es.TraceError):
            self.run_events([alloc(1, MiB), alloc(1, MiB)])


class TestCli(unittest.TestCase):
    def test_json_and_exit(self):
        with tempfile.TemporaryDirectory() as d:
            ok = write(d, [alloc(1, 30 * MiB)], "ok")
            out = subprocess.run([sys.executable, SCRIPT, "--json", ok],
                                 capture_output=True, text=True, check=True)
            got = json.loads(out.stdout)
            self.assertEqual(got["trace"], "ok")
            self.assertEqual(got["peak_reserved"], 40 * MiB)
            self.assertEqual(got["fragmentation_pct"], 25.0)
            bad = write(d, free(9, MiB), "bad")
            out = subprocess.run([sys.executable, SCRIPT, bad],
                                 capture_output=True, text=True)
            self.assertEqual(out.returncode, 1)
            self.assertIn("not live", out.stderr)


if __name__ == "__main__":
    unittest.main()
