# SPDX-License-Identifier: MIT
"""libgmlake from Python: statistics, and PyTorch's allocator (gmlake.torch).

    import gmlake.torch
    gmlake.torch.enable()          # before the first CUDA tensor
    ...
    print(gmlake.memory_summary())

Pure Python (ctypes); the library is found as _lib.find_library() says
(GMLAKE_LIBRARY first).
"""

from ._lib import LibraryNotFoundError, find_library, load
from ._stats import (Stats, format_bytes, memory_summary, raw_stats,
                     reset_peak_stats, stats)

__all__ = ["LibraryNotFoundError", "Stats", "find_library", "format_bytes",
           "load", "memory_summary", "raw_stats", "reset_peak_stats",
           "stats"]
