/* SPDX-License-Identifier: MIT */
/*
 * Reader for PyTorch allocation traces (see trace.h for the format). The
 * file goes through zlib's gzread, which passes plain files through
 * unchanged; lines are split here rather than by gzgets so that NUL bytes
 * and overlong lines are seen for what they are.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <zlib.h>

#include "trace.h"

#define TRACE_BUF_SIZE (64 * 1024) /* must exceed GML_TRACE_LINE_MAX + 1 */
#define ACTION_MAX     32
#define SIDECAR_MAX    (1024 * 1024)

struct gml_trace {
	gzFile gz;
	char *path;
	struct gml_trace_info info;
	bool header_done; /* an event line has been seen */
	bool eof;	  /* gzread has nothing more */
	bool skipping;	  /* discarding the rest of an overlong line */
	bool truncated;	  /* the compressed stream ended early */
	int io_err;	  /* sticky -EIO */
	bool pending;	  /* read_header's look-ahead in pending_ev */
	struct gml_trace_event pending_ev;
	size_t start, end; /* unread bytes are buf[start, end) */
	char err[1024];
	char buf[TRACE_BUF_SIZE];
};

static const char *const kind_names[GML_TRACE_KIND_COUNT] = {
	[GML_TRACE_ALLOC] = "alloc",
	[GML_TRACE_FREE_REQUESTED] = "free_requested",
	[GML_TRACE_FREE_COMPLETED] = "free_completed",
	[GML_TRACE_SEGMENT_ALLOC] = "segment_alloc",
	[GML_TRACE_SEGMENT_FREE] = "segment_free",
	[GML_TRACE_SEGMENT_MAP] = "segment_map",
	[GML_TRACE_SEGMENT_UNMAP] = "segment_unmap",
	[GML_TRACE_STEP] = "step",
	[GML_TRACE_LONG_LIVED] = "long_lived",
	[GML_TRACE_TRIM] = "trim",
	[GML_TRACE_OTHER] = "other",
};

const char *gml_trace_kind_name(int kind)
{
	if (kind < 0 || kind >= GML_TRACE_KIND_COUNT)
		return NULL;
	return kind_names[kind];
}

static bool is_blank(char c)
{
	return c == ' ' || c == '\t';
}

static bool is_alpha(char c)
{
	return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

static bool is_digit(char c)
{
	return c >= '0' && c <= '9';
}

/* Trim blanks at both ends and CRs at the end: [*p, *e). */
static void trim(const char **p, const char **e)
{
	while (*p < *e && is_blank(**p))
		(*p)++;
	while (*e > *p && (is_blank((*e)[-1]) || (*e)[-1] == '\r'))
		(*e)--;
}

/*
 * One unsigned decimal number at *p, ending at a blank or at e. Advances
 * *p past it. 0, or -EINVAL with *why.
 */
static int parse_u64(const char **p, const char *e, uint64_t *val,
		     const char **why)
{
	const char *s = *p;
	uint64_t v = 0;

	if (s == e) {
		*why = "too few fields";
		return -EINVAL;
	}
	if (!is_digit(*s)) {
		*why = "field is not an unsigned decimal number";
		return -EINVAL;
	}
	for (; s < e && !is_blank(*s); s++) {
		unsigned d;

		if (!is_digit(*s)) {
			*why = "field is not an unsigned decimal number";
			return -EINVAL;
		}
		d = (unsigned)(*s - '0');
		if (v > (UINT64_MAX - d) / 10) {
			*why = "number out of range";
			return -EINVAL;
		}
		v = v * 10 + d;
	}
	*val = v;
	*p = s;
	return 0;
}

static enum gml_trace_kind lookup_kind(const char *s, size_t n)
{
	int k;

	for (k = 0; k < GML_TRACE_OTHER; k++) {
		if (strlen(kind_names[k]) == n && !memcmp(kind_names[k], s, n))
			return (enum gml_trace_kind)k;
	}
	return GML_TRACE_OTHER;
}

int gml_trace_parse_line(const char *line, size_t len,
			 struct gml_trace_event *ev, const char **why)
{
	const char *dummy;
	const char *p = line, *e = line + len, *action;
	uint64_t *fields[3] = {&ev->addr, &ev->size, &ev->stream};
	int i, ret;

	if (!why)
		why = &dummy;
	*why = "";
	if (!line && len)
		goto out_inval_null;
	trim(&p, &e);
	if (p == e || *p == '#')
		return 0;

	action = p;
	if (!is_alpha(*p)) {
		*why = "action does not start with a letter";
		return -EINVAL;
	}
	for (; p < e && !is_blank(*p); p++) {
		if (!is_alpha(*p) && !is_digit(*p) && *p != '_') {
			*why = "bad character in action";
			return -EINVAL;
		}
	}
	if (p - action > ACTION_MAX) {
		*why = "action too long";
		return -EINVAL;
	}
	ev->kind = lookup_kind(action, (size_t)(p - action));

	for (i = 0; i < 3; i++) {
		while (p < e && is_blank(*p))
			p++;
		ret = parse_u64(&p, e, fields[i], why);
		if (ret)
			return ret;
	}
	if (p != e) {
		*why = "too many fields";
		return -EINVAL;
	}
	/* S picks the steps a replay prices: no guessing at other values. */
	if (ev->kind == GML_TRACE_STEP && ev->size > 1) {
		*why = "step's settle flag (the size field) is not 0 or 1";
		return -EINVAL;
	}
	if (ev->kind == GML_TRACE_LONG_LIVED && ev->addr > 1) {
		*why = "long_lived's flag (the address field) is not 0 or 1";
		return -EINVAL;
	}
	if (ev->kind == GML_TRACE_TRIM && (ev->addr || ev->size || ev->stream)) {
		*why = "trim's fields are not 0";
		return -EINVAL;
	}
	return 1;

out_inval_null:
	*why = "no line";
	return -EINVAL;
}

/* Copy the printable bytes of [s, s+n) into dst (size dstlen), appended. */
static void append_printable(char *dst, size_t dstlen, const char *s, size_t n)
{
	size_t at = strlen(dst);

	for (; n && at + 1 < dstlen; s++, n--)
		dst[at++] = (*s >= ' ' && *s < 0x7f) ? *s : '?';
	dst[at] = '\0';
}

/* Apply one key=value word to *hdr. 0, or -EINVAL with *why. */
static int header_word(struct gml_trace_header *hdr, const char *w,
		       const char *eq, const char *e, const char **why)
{
	static const struct {
		const char *key;
		unsigned bit;
		size_t off;
	} nums[] = {
		{"steps", GML_TRACE_HAVE_STEPS,
		 offsetof(struct gml_trace_header, steps)},
		{"peak_alloc", GML_TRACE_HAVE_PEAK_ALLOC,
		 offsetof(struct gml_trace_header, peak_alloc)},
		{"peak_reserved", GML_TRACE_HAVE_PEAK_RESERVED,
		 offsetof(struct gml_trace_header, peak_reserved)},
	};
	size_t klen = (size_t)(eq - w), vlen = (size_t)(e - eq - 1);
	const char *v = eq + 1;
	uint64_t val;
	size_t i;

	if (klen == 8 && !memcmp(w, "workload", 8)) {
		if (!vlen || vlen >= sizeof(hdr->workload)) {
			*why = "bad workload in header";
			return -EINVAL;
		}
		for (i = 0; i < vlen; i++) {
			if (v[i] <= ' ' || v[i] >= 0x7f) {
				*why = "bad workload in header";
				return -EINVAL;
			}
		}
		memcpy(hdr->workload, v, vlen);
		hdr->workload[vlen] = '\0';
		hdr->have |= GML_TRACE_HAVE_WORKLOAD;
		return 0;
	}
	for (i = 0; i < sizeof(nums) / sizeof(nums[0]); i++) {
		if (strlen(nums[i].key) != klen || memcmp(nums[i].key, w, klen))
			continue;
		if (!vlen || parse_u64(&v, e, &val, why)) {
			*why = "bad number in header";
			return -EINVAL;
		}
		memcpy((char *)hdr + nums[i].off, &val, sizeof(val));
		hdr->have |= nums[i].bit;
		return 0;
	}
	return 0;
}

int gml_trace_parse_comment(const char *line, size_t len, bool first,
			    struct gml_trace_header *hdr, const char **why)
{
	const char *dummy;
	const char *p = line, *e = line + len, *w, *eq;
	bool producer = first;
	int ret;

	if (!why)
		why = &dummy;
	*why = "";
	if (!line && len) {
		*why = "no line";
		return -EINVAL;
	}
	trim(&p, &e);
	if (p == e || *p != '#') {
		*why = "not a comment";
		return -EINVAL;
	}
	p++;
	for (;;) {
		while (p < e && is_blank(*p))
			p++;
		if (p == e)
			break;
		w = p;
		while (p < e && !is_blank(*p))
			p++;
		eq = memchr(w, '=', (size_t)(p - w));
		if (!eq) {
			if (!producer)
				continue;
			if (hdr->producer[0])
				append_printable(hdr->producer,
						 sizeof(hdr->producer), " ", 1);
			append_printable(hdr->producer, sizeof(hdr->producer),
					 w, (size_t)(p - w));
			hdr->have |= GML_TRACE_HAVE_PRODUCER;
			continue;
		}
		producer = false;
		ret = header_word(hdr, w, eq, p, why);
		if (ret)
			return ret;
	}
	return 0;
}

int gml_trace_open(const char *path, struct gml_trace **tp)
{
	struct gml_trace *t;
	int fd, ret;

	if (!path || !tp)
		return -EINVAL;
	t = calloc(1, sizeof(*t));
	if (!t)
		return -ENOMEM;
	t->path = strdup(path);
	if (!t->path) {
		ret = -ENOMEM;
		goto out_free_t;
	}
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		ret = -errno;
		goto out_free_path;
	}
	t->gz = gzdopen(fd, "rb");
	if (!t->gz) {
		ret = errno ? -errno : -ENOMEM;
		close(fd);
		goto out_free_path;
	}
	/* Lines are split here; a large zlib buffer saves calls. */
	gzbuffer(t->gz, 128 * 1024);
	*tp = t;
	return 0;

out_free_path:
	free(t->path);
out_free_t:
	free(t);
	return ret;
}

void gml_trace_close(struct gml_trace *t)
{
	if (!t)
		return;
	gzclose(t->gz);
	free(t->path);
	free(t);
}

int gml_trace_rewind(struct gml_trace *t)
{
	if (gzrewind(t->gz)) {
		snprintf(t->err, sizeof(t->err), "%s: cannot read it again "
			 "from the start (a pipe?)", t->path);
		t->io_err = -EIO;
		return -EIO;
	}
	memset(&t->info, 0, sizeof(t->info));
	t->header_done = false;
	t->eof = false;
	t->skipping = false;
	t->truncated = false;
	t->io_err = 0;
	t->pending = false;
	t->start = t->end = 0;
	t->err[0] = '\0';
	return 0;
}

const struct gml_trace_info *gml_trace_info(const struct gml_trace *t)
{
	return &t->info;
}

const char *gml_trace_error(const struct gml_trace *t)
{
	return t->err;
}

static void set_error(struct gml_trace *t, const char *why)
{
	snprintf(t->err, sizeof(t->err), "%s:%" PRIu64 ": %s", t->path,
		 t->info.lines, why);
}

/* Fill the buffer from the file; 0 (eof set at the end) or -EIO. */
static int fill(struct gml_trace *t)
{
	int n, zerr;
	const char *msg;

	if (t->start) {
		memmove(t->buf, t->buf + t->start, t->end - t->start);
		t->end -= t->start;
		t->start = 0;
	}
	n = gzread(t->gz, t->buf + t->end, (unsigned)(sizeof(t->buf) - t->end));
	if (n < 0) {
		msg = gzerror(t->gz, &zerr);
		/* zlib names the file "<fd:N>: "; the path is ours. */
		if (msg[0] == '<' && strstr(msg, ">: "))
			msg = strstr(msg, ">: ") + 3;
		snprintf(t->err, sizeof(t->err), "%s: read error: %s", t->path,
			 zerr == Z_ERRNO ? strerror(errno) : msg);
		t->io_err = -EIO;
		return -EIO;
	}
	/* A truncated gzip stream ends early with Z_BUF_ERROR set. */
	gzerror(t->gz, &zerr);
	if (zerr == Z_BUF_ERROR) {
		t->truncated = true;
		t->eof = true;
	}
	if (n == 0)
		t->eof = true;
	t->end += (size_t)n;
	return 0;
}

/*
 * The next raw line: 1 with [*line, *line + *len), 0 at the end, -EINVAL
 * for an overlong line (the rest of which is then skipped), -EIO.
 */
static int read_line(struct gml_trace *t, const char **line, size_t *len)
{
	char *nl;
	int ret;

	for (;;) {
		nl = memchr(t->buf + t->start, '\n', t->end - t->start);
		if (nl) {
			*line = t->buf + t->start;
			*len = (size_t)(nl - *line);
			t->start += *len + 1;
			if (t->skipping) {
				t->skipping = false;
				continue;
			}
			t->info.lines++;
			if (*len > GML_TRACE_LINE_MAX) {
				set_error(t, "line too long");
				return -EINVAL;
			}
			return 1;
		}
		if (t->skipping) {
			t->start = t->end = 0;
		} else if (t->end - t->start > GML_TRACE_LINE_MAX) {
			t->info.lines++;
			t->start = t->end = 0;
			t->skipping = true;
			set_error(t, "line too long");
			return -EINVAL;
		}
		if (t->eof) {
			t->skipping = false;
			if (t->truncated)
				goto out_truncated;
			if (t->start == t->end)
				return 0;
			*line = t->buf + t->start;
			*len = t->end - t->start;
			t->start = t->end;
			t->info.lines++;
			return 1;
		}
		ret = fill(t);
		if (ret)
			return ret;
	}

out_truncated:
	snprintf(t->err, sizeof(t->err), "%s: unexpected end of file", t->path);
	t->io_err = -EIO;
	return -EIO;
}

static bool is_comment(const char *line, size_t len)
{
	const char *p = line, *e = line + len;

	trim(&p, &e);
	return p < e && *p == '#';
}

/*
 * One line through the parser: 1 event in *ev, 2 comment or blank line
 * (its header words taken while before the first event), 0 at the end,
 * -EINVAL, -EIO.
 */
static int step(struct gml_trace *t, struct gml_trace_event *ev)
{
	const char *line, *why;
	size_t len;
	int ret;

	ret = read_line(t, &line, &len);
	if (ret == -EINVAL)
		t->info.errors++;
	if (ret <= 0)
		return ret;
	ret = gml_trace_parse_line(line, len, ev, &why);
	if (ret < 0) {
		t->info.errors++;
		set_error(t, why);
		return ret;
	}
	if (ret == 1) {
		t->header_done = true;
		t->info.events++;
		t->info.kinds[ev->kind]++;
		return 1;
	}
	if (!is_comment(line, len))
		return 2;
	t->info.comments++;
	if (t->header_done)
		return 2;
	ret = gml_trace_parse_comment(line, len, t->info.lines == 1,
				      &t->info.header, &why);
	if (ret) {
		t->info.errors++;
		set_error(t, why);
		return ret;
	}
	return 2;
}

int gml_trace_read_header(struct gml_trace *t)
{
	int ret;

	if (t->io_err)
		return t->io_err;
	while (!t->header_done) {
		ret = step(t, &t->pending_ev);
		if (ret < 0)
			return ret;
		if (ret == 0)
			break;
		if (ret == 1)
			t->pending = true;
	}
	return 0;
}

int gml_trace_next(struct gml_trace *t, struct gml_trace_event *ev)
{
	int ret;

	if (t->io_err)
		return t->io_err;
	if (t->pending) {
		t->pending = false;
		*ev = t->pending_ev;
		return 1;
	}
	t->err[0] = '\0';
	do {
		ret = step(t, ev);
	} while (ret == 2);
	return ret;
}

int gml_trace_sidecar_path(const char *trace, const char *suffix, char *buf,
			   size_t len)
{
	size_t n = strlen(trace), slen = strlen(suffix);

	if (n >= 3 && !strcmp(trace + n - 3, ".gz"))
		n -= 3;
	if (n >= 6 && !memcmp(trace + n - 6, ".trace", 6))
		n -= 6;
	if (n + slen + 1 > len)
		return -ENAMETOOLONG;
	memcpy(buf, trace, n);
	memcpy(buf + n, suffix, slen + 1);
	return 0;
}

/* A JSON cursor over [p, e). */
struct json {
	const char *p, *e;
	const char *why;
};

static void json_ws(struct json *j)
{
	while (j->p < j->e && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' ||
			       *j->p == '\r'))
		j->p++;
}

static int json_fail(struct json *j, const char *why)
{
	j->why = why;
	return -EINVAL;
}

/*
 * A string at j->p; up to keylen - 1 of its bytes (escapes kept raw) go
 * into key when key is not NULL.
 */
static int json_string(struct json *j, char *key, size_t keylen)
{
	size_t n = 0;

	if (j->p == j->e || *j->p != '"')
		return json_fail(j, "expected a string");
	for (j->p++; j->p < j->e; j->p++) {
		if (*j->p == '"') {
			j->p++;
			if (key)
				key[n] = '\0';
			return 0;
		}
		if (*j->p == '\\' && ++j->p == j->e)
			break;
		if ((unsigned char)*j->p < 0x20)
			return json_fail(j, "control character in string");
		if (key && n + 1 < keylen)
			key[n++] = *j->p;
	}
	return json_fail(j, "unterminated string");
}

/* A number at j->p into *val (finite). */
static int json_number(struct json *j, double *val)
{
	char tmp[64], *end;
	size_t n = 0;

	while (j->p < j->e && n + 1 < sizeof(tmp) &&
	       (is_digit(*j->p) || strchr("+-.eE", *j->p)) && *j->p)
		tmp[n++] = *j->p++;
	tmp[n] = '\0';
	if (!n)
		return json_fail(j, "expected a value");
	errno = 0;
	*val = strtod(tmp, &end);
	if (*end || errno || !isfinite(*val))
		return json_fail(j, "bad number");
	return 0;
}

/*
 * Skip any value; *num and *is_num report a number. Nested objects and
 * arrays are skipped by depth, strings inside them honoured.
 */
static int json_value(struct json *j, double *num, bool *is_num)
{
	static const char *const lits[] = {"true", "false", "null"};
	unsigned depth = 0;
	size_t i, n;

	*is_num = false;
	json_ws(j);
	if (j->p == j->e)
		return json_fail(j, "expected a value");
	if (*j->p == '"')
		return json_string(j, NULL, 0);
	if (*j->p == '-' || is_digit(*j->p)) {
		*is_num = true;
		return json_number(j, num);
	}
	for (i = 0; i < 3; i++) {
		n = strlen(lits[i]);
		if ((size_t)(j->e - j->p) >= n && !memcmp(j->p, lits[i], n)) {
			j->p += n;
			return 0;
		}
	}
	if (*j->p != '{' && *j->p != '[')
		return json_fail(j, "expected a value");
	while (j->p < j->e) {
		if (*j->p == '"') {
			if (json_string(j, NULL, 0))
				return -EINVAL;
			continue;
		}
		if (*j->p == '{' || *j->p == '[') {
			if (++depth > 64)
				return json_fail(j, "nested too deep");
		} else if (*j->p == '}' || *j->p == ']') {
			if (--depth == 0) {
				j->p++;
				return 0;
			}
		}
		j->p++;
	}
	return json_fail(j, "unterminated value");
}

static void sidecar_set(struct gml_trace_sidecar *sc, const char *key,
			double val)
{
	static const struct {
		const char *key;
		unsigned bit;
		size_t off;
	} keys[] = {
		{"steps", GML_SIDECAR_HAVE_STEPS,
		 offsetof(struct gml_trace_sidecar, steps)},
		{"step_ms", GML_SIDECAR_HAVE_STEP_MS,
		 offsetof(struct gml_trace_sidecar, step_ms)},
		{"peak_alloc", GML_SIDECAR_HAVE_PEAK_ALLOC,
		 offsetof(struct gml_trace_sidecar, peak_alloc)},
		{"peak_reserved", GML_SIDECAR_HAVE_PEAK_RESERVED,
		 offsetof(struct gml_trace_sidecar, peak_reserved)},
		{"frag_pct", GML_SIDECAR_HAVE_FRAG_PCT,
		 offsetof(struct gml_trace_sidecar, frag_pct)},
		{"steady_step_ms", GML_SIDECAR_HAVE_STEADY_STEP_MS,
		 offsetof(struct gml_trace_sidecar, steady_step_ms)},
	};
	size_t i;

	for (i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
		if (!strcmp(keys[i].key, key)) {
			memcpy((char *)sc + keys[i].off, &val, sizeof(val));
			sc->have |= keys[i].bit;
		}
	}
}

int gml_trace_sidecar_parse(const char *text, size_t len,
			    struct gml_trace_sidecar *sc, const char **why)
{
	struct json j = {text, text + len, ""};
	const char *dummy;
	char key[32];
	double val;
	bool is_num;

	if (!why)
		why = &dummy;
	memset(sc, 0, sizeof(*sc));
	if (!text && len)
		goto out_inval;
	json_ws(&j);
	if (j.p == j.e || *j.p != '{') {
		j.why = "not a JSON object";
		goto out_inval;
	}
	j.p++;
	json_ws(&j);
	if (j.p < j.e && *j.p == '}')
		goto out_close;
	for (;;) {
		json_ws(&j);
		if (json_string(&j, key, sizeof(key)))
			goto out_inval;
		json_ws(&j);
		if (j.p == j.e || *j.p != ':') {
			j.why = "expected ':'";
			goto out_inval;
		}
		j.p++;
		if (json_value(&j, &val, &is_num))
			goto out_inval;
		if (is_num)
			sidecar_set(sc, key, val);
		json_ws(&j);
		if (j.p < j.e && *j.p == ',') {
			j.p++;
			continue;
		}
		if (j.p < j.e && *j.p == '}')
			break;
		j.why = "expected ',' or '}'";
		goto out_inval;
	}
out_close:
	j.p++;
	json_ws(&j);
	if (j.p != j.e) {
		j.why = "text after the object";
		goto out_inval;
	}
	*why = "";
	return 0;

out_inval:
	*why = j.why ? j.why : "no text";
	sc->have = 0;
	return -EINVAL;
}

int gml_trace_sidecar_load(const char *path, struct gml_trace_sidecar *sc,
			   const char **why)
{
	const char *dummy;
	char *text;
	ssize_t n;
	size_t len = 0;
	int fd, ret;

	if (!why)
		why = &dummy;
	*why = "";
	memset(sc, 0, sizeof(*sc));
	fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0) {
		*why = strerror(errno);
		return -errno;
	}
	text = malloc(SIDECAR_MAX);
	if (!text) {
		ret = -ENOMEM;
		*why = "out of memory";
		goto out_close;
	}
	while (len < SIDECAR_MAX) {
		n = read(fd, text + len, SIDECAR_MAX - len);
		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0) {
			ret = -errno;
			*why = strerror(errno);
			goto out_free;
		}
		if (n == 0)
			break;
		len += (size_t)n;
	}
	if (len == SIDECAR_MAX) {
		ret = -EFBIG;
		*why = "file too large";
		goto out_free;
	}
	ret = gml_trace_sidecar_parse(text, len, sc, why);
out_free:
	free(text);
out_close:
	close(fd);
	return ret;
}
