/* SPDX-License-Identifier: MIT */
/*
 * libFuzzer target for the segment reader, in two modes.
 *
 * Image (any input not starting with "NAME:"): the input is a segment
 * image, given to the buffer-level parser gmlake_shm_parse() (the one that
 * gmlake_shm_read() runs on every file it reads). Any input must give 0 or
 * a negative errno with a message, and a snapshot that stays in bounds.
 *
 * Name ("NAME:" then a file name): the segment-name parser that decides
 * which process a file claims to be (gml_shm_name_parse). A name it
 * accepts must be the one canonical spelling of its pid and token, as the
 * publisher writes it ("gmlake.%d.%016llx", pid 1 and up, token not 0):
 * "gmlake.+1.T", "gmlake.01.T" or an upper-case token would let a file
 * pass for another process's segment.
 *
 * Seeds: tests/fuzz/corpus/fuzz_shm/ (a valid segment, broken ones, and
 * names). Build, e.g.: clang -fsanitize=fuzzer,address -Iinclude -Ilib
 *   tests/fuzz/fuzz_shm.c lib/.libs/libgmlake-internal.a -ldl -lpthread
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <stdio.h>

#include "gmlake.h"
#include "gmlake-shm.h"
#include "shm.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void fuzz_name(const uint8_t *data, size_t size)
{
	char name[96], canon[96];
	uint64_t token = 0;
	int32_t pid = 0;

	if (size >= sizeof(name))
		return;
	memcpy(name, data, size);
	name[size] = '\0';
	if (!gml_shm_name_parse(name, &pid, &token))
		return;
	snprintf(canon, sizeof(canon), "gmlake.%d.%016llx", (int)pid,
		 (unsigned long long)token);
	if (pid <= 0 || !token || strcmp(name, canon))
		abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct gmlake_shm_snapshot snap;
	/* A heap copy of exactly size bytes, so ASan sees any overread. */
	uint8_t *buf;
	int ret;

	if (size >= 5 && !memcmp(data, "NAME:", 5)) {
		fuzz_name(data + 5, size - 5);
		return 0;
	}
	buf = malloc(size ? size : 1);
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
