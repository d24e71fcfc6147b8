# SPDX-License-Identifier: MIT
"""Small gmlake-replay traces for the bench's tests (tools/trace.h's
format): events as tuples, written gzipped under a header."""

import gzip
import os

MiB = 1 << 20


def write(d, events, name="t"):
    """DIR/NAME.trace.gz with two header lines, then one event a line."""
    path = os.path.join(d, name + ".trace.gz")
    with gzip.open(path, "wt") as f:
        f.write("# pytorch 2.11 workload=%s\n# action addr size stream\n"
                % name)
        for ev in events:
            f.write(" ".join(str(x) for x in ev) + "\n")
    return path


def alloc(addr, size, stream=0):
    return ("alloc", addr, size, stream)


def free(addr, size, stream=0):
    """A free as PyTorch records it: requested, then completed."""
    return [("free_requested", addr, size, stream),
            ("free_completed", addr, size, stream)]
