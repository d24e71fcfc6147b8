# SPDX-License-Identifier: MIT
"""The fields of struct gmlake_stats (include/gmlake-stats.h), by hand.

The header's X-macro lists and this file must agree; python/tests parses
the header and compares, and checks the ctypes layout against the C
compiler's, so a change on one side only fails the tests.
"""

STATS_VERSION = 2

# GMLAKE_FOREACH_GAUGE: struct gmlake_stat {current, peak, total} each.
GAUGES = (
    "requested_bytes",
    "allocated_bytes",
    "resident_bytes",
    "reserved_bytes",
    "mapped_bytes",
    "active_blocks",
    "stitched_live",
    "stitched_cached",
    "chunks",
    "small_chunks",
    "spilled_bytes",
    "spilled_blocks",
    "host_bytes",
    "host_pinned",
)

# GMLAKE_FOREACH_COUNTER: uint64_t each.
COUNTERS = (
    "allocs",
    "frees",
    "fits",
    "stitch_reuses",
    "stitches",
    "stitch_repairs",
    "grows",
    "evictions",
    "releases",
    "ooms",
    "cross_stream_waits",
    "spills",
    "fetches",
    "auto_spills",
    "offload_failures",
    "d2h_bytes",
    "d2h_ns",
    "h2d_bytes",
    "h2d_ns",
)

# GMLAKE_FOREACH_CALL: the driver call kinds, indexes of calls[] etc.
CALLS = (
    "mem_create",
    "mem_release",
    "va_reserve",
    "va_free",
    "mem_map",
    "mem_unmap",
    "set_access",
    "event_create",
    "event_record",
    "event_query",
    "event_sync",
    "stream_sync",
    "memcpy",
    "stream_wait",
    "host_func",
    "host_register",
    "host_unregister",
    "mem_create_host",
)

RESERVED_WORDS = 31

# include/gmlake-torch.h: struct gmlake_torch_stats, PyTorch's names.
TORCH_STATS_VERSION = 1

# GMLAKE_TORCH_FOREACH_STAT: struct gmlake_torch_stat each.
TORCH_STATS = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)

# GMLAKE_TORCH_FOREACH_COUNT: int64_t each.
TORCH_COUNTS = (
    "num_alloc_retries",
    "num_ooms",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
)

TORCH_RESERVED_WORDS = 16

# enum gmlake_torch_action, in order: PyTorch's trace action names.
TORCH_ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
)
