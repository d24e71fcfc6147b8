# SPDX-License-Identifier: MIT
"""The package's version, and the PyTorch versions its adapter supports.

The version is the VERSION file of the source the package came from: as
make install recorded it (_installed.py), the source tree's own when run
from it, or the installed distribution's metadata (pip install).
"""

import os

# PyTorch releases whose C++ allocator interface the adapter
# (csrc/adapter.cpp) is written for; others fall back to the ctypes path
# when the adapter does not build.
SUPPORTED_TORCH = ("2.11",)

_HERE = os.path.dirname(os.path.abspath(__file__))
_TREE = os.path.normpath(os.path.join(_HERE, "..", ".."))


def _read(path):
    with open(path) as f:
        return f.read().strip()


def _find():
    try:
        from . import _installed  # written by make install
        if getattr(_installed, "VERSION", None):
            return _installed.VERSION
    except ImportError:
        pass
    if os.path.isfile(os.path.join(_TREE, "configure.ac")) and \
            os.path.isfile(os.path.join(_TREE, "VERSION")):
        return _read(os.path.join(_TREE, "VERSION"))
    try:
        from importlib import metadata
        return metadata.version("gmlake")
    except Exception:  # no metadata: a copy of the package, not installed
        return "0+unknown"


VERSION = _find()


def source_tree():
    """The source tree this package runs from, or None when installed."""
    if os.path.isfile(os.path.join(_TREE, "configure.ac")):
        return _TREE
    return None
