/* SPDX-License-Identifier: MIT */
/*
 * Helpers for the libFuzzer targets in tests/fuzz/ (header only).
 *
 * - fz_fail(): report a broken expectation and abort, so libFuzzer saves
 *   the input as a crash. Only the targets abort, never the library.
 * - struct fz_in: the fuzzer's bytes, consumed front to back; when they
 *   run out every read gives 0, so any input is a complete program.
 */
#ifndef GML_FUZZ_H
#define GML_FUZZ_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FZ_UNUSED __attribute__((unused))

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static FZ_UNUSED __attribute__((noreturn, format(printf, 1, 2))) void
fz_fail(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fputs("fuzz: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	abort();
}

struct fz_in {
	const uint8_t *p;
	size_t n;
};

static FZ_UNUSED uint8_t fz_u8(struct fz_in *in)
{
	uint8_t v;

	if (!in->n)
		return 0;
	v = *in->p++;
	in->n--;
	return v;
}

static FZ_UNUSED uint16_t fz_u16(struct fz_in *in)
{
	return (uint16_t)(fz_u8(in) | fz_u8(in) << 8);
}

static FZ_UNUSED uint32_t fz_u32(struct fz_in *in)
{
	return (uint32_t)fz_u16(in) | (uint32_t)fz_u16(in) << 16;
}

/* A value in [0, n) (n > 0). */
static FZ_UNUSED unsigned fz_pick(struct fz_in *in, unsigned n)
{
	return fz_u8(in) % n;
}

#endif
