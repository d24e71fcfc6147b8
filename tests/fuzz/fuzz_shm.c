/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target for the segment reader: the input is a segment image,
 * given to the buffer-level parser gmlake_shm_parse() (the one that
 * gmlake_shm_read() runs on every file it reads). Any input must give 0 or
 * a negative errno with a message, and a snapshot that stays in bounds.
 *
 * Seeds: tests/fuzz/corpus/fuzz_shm/ (a valid segment, and broken ones).
 * Build, e.g.: clang -fsanitize=fuzzer,address -Iinclude -Ilib
 *   tests/fuzz/fuzz_shm.c lib/.libs/libgmlake-internal.a -ldl -lpthread
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "gmlake.h"
#include "gmlake-shm.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct gmlake_shm_snapshot snap;
	/* A heap copy of exactly size bytes, so ASan sees any overread. */
	uint8_t *buf = malloc(size ? size : 1);
	int ret;

	if (!buf)
		return 0;
	if (size)
		memcpy(buf, data, size);
	memset(&snap, 0, sizeof(snap));
	snap.version = GMLAKE_SHM_SNAPSHOT_VERSION;
	snap.size = sizeof(snap);
	ret = gmlake_shm_parse(buf, size, &snap);
	if (ret > 0 || (ret < 0 && !gmlake_last_error()[0]))
		abort();
	if (!ret && (snap.nslots > GMLAKE_SHM_SLOTS ||
		     !memchr(snap.comm, '\0', sizeof(snap.comm))))
		abort();
	free(buf);
	return 0;
}
