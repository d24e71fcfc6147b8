/* SPDX-License-Identifier: MIT */
/*
 * Reader for PyTorch allocation traces, as written by the capture script
 * from torch.cuda.memory._snapshot()["device_traces"]:
 *
 *	# pytorch 2.11.0+cu130 workload=plain steps=12 peak_alloc=N peak_reserved=N
 *	# action addr size stream
 *	alloc 139861348581376 262144000 0
 *	step 0 1 0
 *	alloc 139861610725376 4194304 0
 *	free_completed 139861348581376 262144000 0
 *
 * Every event line holds four fields separated by blanks (spaces or tabs;
 * a trailing CR is accepted): an action word, then three unsigned decimal
 * numbers. Lines starting with '#' are comments; key=value words in the
 * comments before the first event form the header. Blank lines are
 * skipped. An action this reader does not know is returned as
 * GML_TRACE_OTHER and counted; any other deviation is an error (-EINVAL)
 * naming the line. The file may be gzip-compressed or plain.
 *
 * A "step K S 0" line (GML_TRACE_STEP) marks where training step K (the
 * addr field, from 0) begins: it comes before the step's first event.
 * S (the size field) is 1 for a settling step, the first at its shape,
 * and 0 for a steady one; any other S is malformed. The stream field is
 * 0, and not read. Events before the first step line are set-up (the
 * model's build); those after the last belong to the last step. A trace
 * without step lines is as valid, and readers older than step lines
 * count them as unknown actions.
 *
 * A "long_lived F 0 0" line (GML_TRACE_LONG_LIVED) says that the run
 * called gmlake_long_lived() with F (the addr field, 1 on, 0 off; any
 * other F is malformed) there: where an optimizer's hooks made its first
 * state.
 *
 * A "trim 0 0 0" line (GML_TRACE_TRIM) says that the run's allocator gave
 * its cached memory back to the driver there, as torch.cuda.empty_cache()
 * does (PyTorch's cuDNN benchmark calls it after each search): a replay
 * calls gmlake_trim(). Its three fields are 0; any other value is
 * malformed.
 *
 * Nothing here allocates on the event path, exits or aborts, whatever the
 * input; gml_trace_parse_line() takes raw bytes (NULs included) and is the
 * entry point for fuzzing.
 */
#ifndef GML_TRACE_H
#define GML_TRACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Longest line accepted, without its newline. */
#define GML_TRACE_LINE_MAX 4096

enum gml_trace_kind {
	GML_TRACE_ALLOC,
	GML_TRACE_FREE_REQUESTED,
	GML_TRACE_FREE_COMPLETED,
	GML_TRACE_SEGMENT_ALLOC,
	GML_TRACE_SEGMENT_FREE,
	GML_TRACE_SEGMENT_MAP,
	GML_TRACE_SEGMENT_UNMAP,
	GML_TRACE_STEP,	 /* addr: step index, size: 1 settling, 0 steady */
	GML_TRACE_LONG_LIVED, /* addr: 1 on, 0 off (gmlake_long_lived) */
	GML_TRACE_TRIM,	 /* the cache given back (gmlake_trim) */
	GML_TRACE_OTHER, /* well-formed, action unknown */
	GML_TRACE_KIND_COUNT
};

struct gml_trace_event {
	enum gml_trace_kind kind;
	uint64_t addr;
	uint64_t size;
	uint64_t stream;
};

/* Bits of gml_trace_header.have. */
#define GML_TRACE_HAVE_STEPS	     (1u << 0)
#define GML_TRACE_HAVE_PEAK_ALLOC    (1u << 1)
#define GML_TRACE_HAVE_PEAK_RESERVED (1u << 2)
#define GML_TRACE_HAVE_WORKLOAD	     (1u << 3)
#define GML_TRACE_HAVE_PRODUCER	     (1u << 4)

/* What the leading comments say; a field is valid when its bit is set. */
struct gml_trace_header {
	unsigned have;
	char producer[64]; /* "pytorch 2.11.0+cu130" */
	char workload[64];
	uint64_t steps;
	uint64_t peak_alloc;	/* PyTorch's peak allocated bytes */
	uint64_t peak_reserved; /* PyTorch's peak reserved bytes */
};

/* Counts of what the reader has returned so far. */
struct gml_trace_info {
	struct gml_trace_header header;
	uint64_t lines; /* lines read, the current one included */
	uint64_t comments;
	uint64_t events; /* event lines, GML_TRACE_OTHER included */
	uint64_t kinds[GML_TRACE_KIND_COUNT];
	uint64_t errors; /* malformed lines reported */
};

struct gml_trace;

/*
 * Parse one line of len bytes (no newline; NULs allowed). Returns 1 with
 * *ev filled for an event line, 0 for a blank or comment line, -EINVAL for
 * a malformed one; then *why (if why is not NULL) points at a static
 * message. Never reads past line[len - 1].
 */
int gml_trace_parse_line(const char *line, size_t len,
			 struct gml_trace_event *ev, const char **why);

/*
 * Take the key=value words of one comment line (with its '#') into *hdr.
 * Unknown keys are ignored; a known key with a bad value gives -EINVAL and
 * *why. The first line's leading words ("pytorch 2.11.0+cu130") become the
 * producer when first is true. 0 on success.
 */
int gml_trace_parse_comment(const char *line, size_t len, bool first,
			    struct gml_trace_header *hdr, const char **why);

/* Name of an action kind ("alloc"), or NULL when out of range. */
const char *gml_trace_kind_name(int kind);

/*
 * Open a trace (gzip or plain) for reading; *t is the caller's, to be
 * given to gml_trace_close(). 0, or -errno when the file cannot be opened
 * (-ENOMEM when out of memory).
 */
int gml_trace_open(const char *path, struct gml_trace **t);
void gml_trace_close(struct gml_trace *t);

/*
 * Back to the start of the file, to read it again (a second pass): the
 * header, counters and errors start afresh. 0, or -EIO (with
 * gml_trace_error()) when the file cannot be read twice, a pipe say.
 */
int gml_trace_rewind(struct gml_trace *t);

/*
 * Read the leading comment block into the header, stopping before the
 * first event. Optional (gml_trace_next() does it too); calling it again
 * does nothing. 0, -EINVAL for a malformed header or -EIO.
 */
int gml_trace_read_header(struct gml_trace *t);

/*
 * The next event: 1 with *ev filled, 0 at the end of the trace, -EINVAL
 * for a malformed line or -EIO for a read error; gml_trace_error() then
 * says "path:line: what". After -EINVAL the next call goes on with the
 * following line; after -EIO every call fails.
 */
int gml_trace_next(struct gml_trace *t, struct gml_trace_event *ev);

/* The header and counters so far; valid until gml_trace_close(). */
const struct gml_trace_info *gml_trace_info(const struct gml_trace *t);
/* Message for the last failure ("" when none); valid until the next call. */
const char *gml_trace_error(const struct gml_trace *t);

/*
 * Sidecar JSON files beside a trace: NAME.trace.gz (or NAME.trace, or
 * NAME) gives NAME<suffix>, e.g. suffix ".trace.json" or
 * ".expandable.json". 0, or -ENAMETOOLONG when buf is too small.
 */
int gml_trace_sidecar_path(const char *trace, const char *suffix, char *buf,
			   size_t len);

/* Bits of gml_trace_sidecar.have. */
#define GML_SIDECAR_HAVE_STEPS	       (1u << 0)
#define GML_SIDECAR_HAVE_STEP_MS       (1u << 1)
#define GML_SIDECAR_HAVE_PEAK_ALLOC    (1u << 2)
#define GML_SIDECAR_HAVE_PEAK_RESERVED (1u << 3)
#define GML_SIDECAR_HAVE_FRAG_PCT      (1u << 4)
#define GML_SIDECAR_HAVE_STEADY_STEP_MS (1u << 5)

/*
 * The numbers of a sidecar ({"steps": 12, "step_ms": 233.3, ...}):
 * step_ms is the mean of every step, steady_step_ms (optional) that of
 * the steady steps.
 */
struct gml_trace_sidecar {
	unsigned have;
	double steps;
	double step_ms;
	double peak_alloc;
	double peak_reserved;
	double frag_pct;
	double steady_step_ms; /* mean of the steady steps alone */
};

/*
 * Parse a flat JSON object of len bytes; keys it does not know are
 * skipped. 0, or -EINVAL (with *why) when it is not such an object.
 */
int gml_trace_sidecar_parse(const char *text, size_t len,
			    struct gml_trace_sidecar *sc, const char **why);
/* Read and parse the file at path: 0, -errno (-ENOENT: none), -EINVAL. */
int gml_trace_sidecar_load(const char *path, struct gml_trace_sidecar *sc,
			   const char **why);

#endif
