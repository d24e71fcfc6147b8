# SPDX-License-Identifier: MIT
"""libgmlake from Python: statistics, and PyTorch's allocator (gmlake.torch).

    import gmlake.torch
    gmlake.torch.enable()          # before the first CUDA tensor
    ...
    print(gmlake.memory_summary())

or run a script unchanged: python -m gmlake.run train.py ARGS...

The library is found as _lib.find_library() says (GMLAKE_LIBRARY first)
and must be the version of this package (gmlake.__version__, from the
source's VERSION file); gmlake.torch supports PyTorch 2.11
(gmlake.SUPPORTED_TORCH).
"""

from ._lib import (LibraryNotFoundError, LibraryVersionError, find_library,
                   load)
from ._snapshot import snapshot as memory_snapshot
from ._stats import (Stats, format_bytes, memory_summary, raw_stats,
                     reset_peak_stats, stats)
from ._version import SUPPORTED_TORCH, VERSION as __version__

__all__ = ["LibraryNotFoundError", "LibraryVersionError", "Stats",
           "SUPPORTED_TORCH", "__version__", "find_library", "format_bytes",
           "load", "memory_snapshot", "memory_summary", "raw_stats",
           "reset_peak_stats", "stats"]
