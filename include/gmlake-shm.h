/* SPDX-License-Identifier: MIT */
/*
 * Cross-process statistics: the shared-memory segment each process using
 * libgmlake publishes (GMLAKE_SHM_DIR, default /dev/shm, file
 * gmlake.PID.TOKEN), and the reader that gmlake-top and tests use.
 *
 * The name: "gmlake.", the pid in decimal without sign or leading zeros,
 * ".", then the header's token as 16 lowercase hex digits. The token is
 * random, so processes of different PID namespaces sharing the directory
 * (every container's main process is PID 1) never share a name. A pid
 * proves nothing outside its namespace: liveness is the publisher's
 * flock(LOCK_EX) on the file, held from before the file has its name until
 * the process ends (layout 2 on). A reader that can take the lock knows
 * the publisher is gone.
 *
 * The segment is a header followed by nslots fixed-size slots, one per
 * context. Every field is fixed-width and little-endian as the host writes
 * it; new fields are only ever added in the reserved space or at the end of
 * a part, with version raised and compat_version kept, so an older reader
 * still reads a newer segment (as perf_event_mmap_page does).
 *
 * Seqlock: the writer makes seq odd, writes the slots, then makes it even
 * again (release). A reader copies the whole segment, then reads seq again;
 * it keeps the copy only when both reads are equal and even, else retries.
 * gmlake_shm_read() does exactly this; read the segment through it.
 */
#ifndef GMLAKE_SHM_H
#define GMLAKE_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GMLAKE_SHM_MAGIC 0x314d48534b4c4d47ull	/* "GMLKSHM1" */
#define GMLAKE_SHM_VERSION 2		/* layout this header describes */
#define GMLAKE_SHM_SLOTS 16		/* contexts published per process */
#define GMLAKE_SHM_COMM_LEN 32
#define GMLAKE_SHM_MAX_SIZE (1u << 20)	/* larger files are rejected */
#define GMLAKE_SHM_ANY_UID UINT32_MAX	/* gmlake_shm_read: any owner */

/*
 * The segment's first bytes (256 in every layout). Layout 2 added token,
 * pidns and the slots' resident_bytes; layout 1 readers still read it.
 */
struct gmlake_shm_header {
	uint64_t magic;			/* GMLAKE_SHM_MAGIC */
	uint32_t version;		/* layout version of the writer */
	uint32_t compat_version;	/* oldest reader layout that can read it */
	uint64_t size;			/* bytes in the segment */
	uint32_t header_size;		/* offset of slot 0 */
	uint32_t slot_size;		/* bytes per slot */
	uint32_t nslots;		/* slots after the header */
	uint32_t flags;			/* 0 */
	int32_t pid;			/* the publishing process */
	uint32_t uid;			/* its effective user id */
	uint64_t start_time;		/* /proc/PID/stat field 22 (clock ticks) */
	uint64_t seq;			/* seqlock: odd while being written */
	uint64_t publish_ns;		/* CLOCK_MONOTONIC of the last publish */
	uint64_t interval_ns;		/* the publisher's period */
	char comm[GMLAKE_SHM_COMM_LEN];	/* command name, NUL-terminated */
	uint64_t token;			/* random, not 0; in the file name */
	uint64_t pidns;			/* inode of the publisher's PID
					   namespace, 0 if unknown */
	uint64_t reserved[16];
};

enum gmlake_shm_slot_state {
	GMLAKE_SHM_SLOT_FREE = 0,
	GMLAKE_SHM_SLOT_LIVE = 1,
};

/* One context's figures (512 bytes in layout 1). */
struct gmlake_shm_slot {
	uint32_t state;			/* enum gmlake_shm_slot_state */
	int32_t device;			/* device ordinal */
	int32_t backend;		/* enum gmlake_backend */
	int32_t offload_engine;		/* enum gmlake_offload_engine */
	uint64_t ctx_id;		/* 1, 2, ... in the process */
	uint64_t publish_ns;		/* CLOCK_MONOTONIC of this copy */
	uint64_t device_total;		/* device memory in bytes */
	uint64_t chunk_size;
	/* gauges (struct gmlake_stats), current and peak */
	int64_t requested_bytes;
	int64_t requested_peak;
	int64_t allocated_bytes;
	int64_t allocated_peak;
	int64_t reserved_bytes;
	int64_t reserved_peak;
	int64_t mapped_bytes;
	int64_t active_blocks;
	int64_t stitched_live;
	int64_t stitched_cached;
	int64_t chunks;
	int64_t spilled_bytes;
	int64_t spilled_blocks;
	int64_t host_bytes;
	int64_t host_pinned;
	/* counters */
	uint64_t allocs;
	uint64_t frees;
	uint64_t fits;
	uint64_t stitch_reuses;
	uint64_t stitches;
	uint64_t stitch_repairs;
	uint64_t grows;
	uint64_t evictions;
	uint64_t releases;
	uint64_t ooms;
	uint64_t spills;
	uint64_t fetches;
	uint64_t offload_failures;
	uint64_t d2h_bytes;
	uint64_t d2h_ns;
	uint64_t h2d_bytes;
	uint64_t h2d_ns;
	/* driver calls */
	uint64_t map_calls;
	uint64_t map_ns;
	uint64_t unmap_calls;
	uint64_t create_calls;
	uint64_t release_calls;
	uint64_t set_access_calls;
	uint64_t call_failures;		/* all kinds together */
	int64_t resident_bytes;		/* allocated, less spilled blocks */
	uint64_t reserved[18];
};

#define GMLAKE_SHM_SNAPSHOT_VERSION 1

/* gmlake_shm_snapshot.flags, set by gmlake_shm_read() */
#define GMLAKE_SHM_SNAP_LOCK_CHECKED (1u << 0)	/* the publisher's lock was
						   tested (canonical name) */
#define GMLAKE_SHM_SNAP_UNLOCKED (1u << 1)	/* nobody held it: gone */

/*
 * What the reader returns: the header's fields, checked, and a copy of
 * every live slot. The caller sets version and size.
 */
struct gmlake_shm_snapshot {
	uint32_t version;		/* GMLAKE_SHM_SNAPSHOT_VERSION */
	uint32_t size;			/* sizeof(struct gmlake_shm_snapshot) */
	uint32_t layout_version;	/* the segment's version */
	uint32_t uid;			/* owner (file owner for _read) */
	int32_t pid;
	uint32_t nslots;		/* live slots copied to slots[] */
	uint64_t start_time;
	uint64_t seq;
	uint64_t publish_ns;
	uint64_t interval_ns;
	char comm[GMLAKE_SHM_COMM_LEN];	/* unprintable bytes become '?' */
	struct gmlake_shm_slot slots[GMLAKE_SHM_SLOTS];
	uint64_t token;			/* the header's (0 in layout 1) */
	uint64_t pidns;			/* the header's (0 if unknown) */
	uint32_t flags;			/* GMLAKE_SHM_SNAP_* */
	uint32_t pad0;
	uint64_t file_dev, file_ino;	/* the file read (_read only) */
	uint64_t reserved[3];
};

/*
 * Check a segment image of len bytes and fill *snap. 0, or -EAGAIN while
 * it is being created or written, -EPROTONOSUPPORT for a layout too new,
 * -EBADMSG when a field is wrong, -EINVAL for bad arguments.
 */
int gmlake_shm_parse(const void *buf, size_t len,
		     struct gmlake_shm_snapshot *snap);
/*
 * Read the segment at path with the seqlock, refusing symbolic links, other
 * file types, files owned by another uid than expect_uid (unless
 * GMLAKE_SHM_ANY_UID) or open to other users, and names that start with
 * "gmlake." without being canonical or matching the header; parse it.
 * For a canonical name, flags says whether the publisher's lock was free,
 * also when the image itself was refused.
 */
int gmlake_shm_read(const char *path, uint32_t expect_uid,
		    struct gmlake_shm_snapshot *snap);
/*
 * True only when the publisher is proven gone: its lock was free (read
 * from a canonical name), or, for an image without that test, it comes
 * from our own PID namespace and there is no such pid or it started at
 * another time. False whenever unsure.
 */
bool gmlake_shm_stale(const struct gmlake_shm_snapshot *snap);
/* The directory segments live in: GMLAKE_SHM_DIR, else /dev/shm. */
const char *gmlake_shm_dir(void);

#ifdef __cplusplus
}
#endif

#endif
