/* SPDX-License-Identifier: MIT */
/*
 * The emulated device (lib/drv_emu.c), called through its operations table.
 * Every test runs on a fresh device opened by the checked fixture: G bytes
 * of granularity, CAP_UNITS chunks of capacity.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <check.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "drv.h"
#include "gmlake.h"

#define G		((size_t)64 << 10)
#define CAP_UNITS	16

static const struct gml_drv_ops *ops = &gml_drv_emu;
static void *dev;

static void open_dev(size_t capacity, size_t gran)
{
	struct gmlake_config cfg;

	memset(&cfg, 0, sizeof(cfg));
	cfg.emu_capacity = capacity;
	cfg.emu_granularity = gran;
	ck_assert_int_eq(ops->open(&cfg, &dev), 0);
	ck_assert_ptr_nonnull(dev);
}

static void close_dev(void)
{
	if (dev)
		ops->close(dev);
	dev = NULL;
}

/* Reopen with other sizes (capacity in units of gran). */
static void reopen(size_t units, size_t gran)
{
	close_dev();
	open_dev(units * gran, gran);
}

static void setup(void)
{
	open_dev(CAP_UNITS * G, G);
}

static void teardown(void)
{
	close_dev();
}

static struct gml_emu_info info(void)
{
	struct gml_emu_info in;

	ck_assert_int_eq(gml_emu_info(dev, &in), 0);
	return in;
}

static size_t free_bytes(void)
{
	size_t fr, total;

	ck_assert_int_eq(ops->mem_info(dev, &fr, &total), 0);
	return fr;
}

static void assert_nothing_live(void)
{
	struct gml_emu_info in = info();

	ck_assert_uint_eq(in.used, 0);
	ck_assert_uint_eq(in.live_handles, 0);
	ck_assert_uint_eq(in.live_mappings, 0);
	ck_assert_uint_eq(in.live_reservations, 0);
	ck_assert_uint_eq(in.live_events, 0);
	ck_assert_uint_eq(in.live_streams, 0);
	ck_assert_uint_eq(free_bytes(), in.capacity);
}

/* An error code with a message naming the problem. */
#define ck_assert_err(expr, err)					\
	do {								\
		ck_assert_int_eq((expr), (err));			\
		ck_assert_str_ne(gmlake_last_error(), "");		\
	} while (0)

/* Whether the process may read / write p (no fault: the kernel checks). */
static bool readable(const void *p)
{
	int fd[2];
	ssize_t n;

	ck_assert_int_eq(pipe(fd), 0);
	n = write(fd[1], p, 1);
	close(fd[0]);
	close(fd[1]);
	return n == 1;
}

/* Writes p's own byte back, so the contents stay as they were. */
static bool writable(void *p)
{
	char c;
	int fd[2];
	ssize_t n;

	if (!readable(p))
		return false;
	c = *(volatile char *)p;
	ck_assert_int_eq(pipe(fd), 0);
	ck_assert_int_eq(write(fd[1], &c, 1), 1);
	n = read(fd[0], p, 1);
	close(fd[0]);
	close(fd[1]);
	return n == 1;
}

static gml_handle chunk(size_t units)
{
	gml_handle h = 0;

	ck_assert_int_eq(ops->mem_create(dev, units * G, &h), 0);
	ck_assert_uint_ne(h, 0);
	return h;
}

static gml_va reserve(size_t units)
{
	gml_va va = 0;

	ck_assert_int_eq(ops->va_reserve(dev, units * G, 0, &va), 0);
	ck_assert_uint_ne(va, 0);
	return va;
}

/* A chunk of units mapped read-write in its own reservation. */
static void *mapped(size_t units, gml_handle *h)
{
	gml_va va = reserve(units);

	*h = chunk(units);
	ck_assert_int_eq(ops->mem_map(dev, va, units * G, *h), 0);
	ck_assert_int_eq(ops->set_access(dev, va, units * G, NULL, 0), 0);
	return (void *)(uintptr_t)va;
}

static void unmapped(void *p, size_t units, gml_handle h)
{
	gml_va va = (uintptr_t)p;

	ck_assert_int_eq(ops->mem_unmap(dev, va, units * G), 0);
	ck_assert_int_eq(ops->mem_release(dev, h), 0);
	ck_assert_int_eq(ops->va_free(dev, va, units * G), 0);
}

static void fill(void *p, size_t size, unsigned seed)
{
	unsigned char *b = p;
	size_t i;

	for (i = 0; i < size; i++)
		b[i] = (unsigned char)(i * 31 + seed);
}

static bool filled(const void *p, size_t size, unsigned seed)
{
	const unsigned char *b = p;
	size_t i;

	for (i = 0; i < size; i++)
		if (b[i] != (unsigned char)(i * 31 + seed))
			return false;
	return true;
}

static bool zeroed(const void *p, size_t size)
{
	const unsigned char *b = p;
	size_t i;

	for (i = 0; i < size; i++)
		if (b[i])
			return false;
	return true;
}

static void sleep_ms(long ms)
{
	struct timespec ts = { ms / 1000, (ms % 1000) * 1000000L };

	nanosleep(&ts, NULL);
}

/* ------------------------------------------------------------------ */
/* open                                                                */

START_TEST(test_open_defaults)
{
	size_t gran = 0, fr = 0, total = 0;

	close_dev();
	open_dev(0, 0);
	ck_assert_int_eq(ops->granularity(dev, &gran), 0);
	ck_assert_uint_eq(gran, (size_t)2 << 20);
	ck_assert_int_eq(ops->mem_info(dev, &fr, &total), 0);
	ck_assert_uint_eq(total, (size_t)64 << 30);
	ck_assert_uint_eq(fr, total);
	ck_assert_int_eq(ops->enter(dev), 0);
	ops->leave(dev);
	ck_assert_str_eq(ops->name, "emu");
	assert_nothing_live();
}
END_TEST

START_TEST(test_open_sizes)
{
	size_t gran = 0, fr, total;

	/* Capacity is rounded down to whole granules. */
	close_dev();
	open_dev(3 * G + G / 2, G);
	ck_assert_int_eq(ops->granularity(dev, &gran), 0);
	ck_assert_uint_eq(gran, G);
	ck_assert_int_eq(ops->mem_info(dev, &fr, &total), 0);
	ck_assert_uint_eq(total, 3 * G);
	ck_assert_err(ops->granularity(dev, NULL), -EINVAL);
	ck_assert_err(ops->mem_info(dev, NULL, &total), -EINVAL);
}
END_TEST

START_TEST(test_open_bad_config)
{
	struct gmlake_config cfg;
	void *p = (void *)1;

	memset(&cfg, 0, sizeof(cfg));
	cfg.emu_granularity = 3 << 20;		/* not a power of two */
	ck_assert_err(ops->open(&cfg, &p), -EINVAL);
	cfg.emu_granularity = 1024;		/* below the page size */
	ck_assert_err(ops->open(&cfg, &p), -EINVAL);
	cfg.emu_granularity = G;
	cfg.emu_capacity = G - 1;		/* less than one granule */
	ck_assert_err(ops->open(&cfg, &p), -EINVAL);
	cfg.emu_capacity = G;
	cfg.device = -1;
	ck_assert_err(ops->open(&cfg, &p), -ENODEV);
	cfg.device = 0;
	ck_assert_err(ops->open(NULL, &p), -EINVAL);
	ck_assert_err(ops->open(&cfg, NULL), -EINVAL);
	ck_assert_ptr_eq(p, (void *)1);
}
END_TEST

START_TEST(test_emu_hooks)
{
	uint64_t foreign[16] = { 0 };	/* some other backend's state */
	struct gml_emu_info in;

	ck_assert_err(gml_emu_info(foreign, &in), -EOPNOTSUPP);
	ck_assert_err(gml_emu_info(NULL, &in), -EOPNOTSUPP);
	ck_assert_err(gml_emu_stream_hold(foreign, NULL, true), -EOPNOTSUPP);
	ck_assert_err(gml_emu_info(dev, NULL), -EINVAL);
	ck_assert_err(gml_emu_stream_hold(dev, (gmlake_stream_t)(uintptr_t)42,
					  true), -EINVAL);
	in = info();
	ck_assert_uint_eq(in.capacity, CAP_UNITS * G);
}
END_TEST

/* ------------------------------------------------------------------ */
/* chunks                                                              */

START_TEST(test_chunk_create_release)
{
	gml_handle a = chunk(1), b = chunk(2), c = chunk(3);
	struct gml_emu_info in = info();

	ck_assert_uint_ne(a, b);
	ck_assert_uint_ne(b, c);
	ck_assert_uint_ne(a, c);
	ck_assert_uint_eq(in.live_handles, 3);
	ck_assert_uint_eq(in.used, 6 * G);
	ck_assert_uint_eq(free_bytes(), (CAP_UNITS - 6) * G);
	ck_assert_int_eq(ops->mem_release(dev, b), 0);
	ck_assert_uint_eq(free_bytes(), (CAP_UNITS - 4) * G);
	ck_assert_uint_eq(info().live_handles, 2);
	ck_assert_int_eq(ops->mem_release(dev, a), 0);
	ck_assert_int_eq(ops->mem_release(dev, c), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_chunk_bad_size)
{
	gml_handle h = 7;

	ck_assert_err(ops->mem_create(dev, 0, &h), -EINVAL);
	ck_assert_err(ops->mem_create(dev, G - 1, &h), -EINVAL);
	ck_assert_err(ops->mem_create(dev, G + 4096, &h), -EINVAL);
	ck_assert_err(ops->mem_create(dev, G, NULL), -EINVAL);
	ck_assert_uint_eq(h, 7);
	assert_nothing_live();
}
END_TEST

START_TEST(test_chunk_bad_handle)
{
	gml_handle a, b;

	ck_assert_err(ops->mem_release(dev, 0), -EINVAL);
	ck_assert_err(ops->mem_release(dev, 12345), -EINVAL);
	ck_assert_err(ops->mem_release(dev, ~(gml_handle)0), -EINVAL);
	ck_assert_err(ops->mem_release(dev, (uintptr_t)&a), -EINVAL);

	a = chunk(1);
	ck_assert_int_eq(ops->mem_release(dev, a), 0);
	ck_assert_err(ops->mem_release(dev, a), -EINVAL);
	/* b may take a's slot; a stays dead and b stays alive. */
	b = chunk(1);
	ck_assert_uint_ne(a, b);
	ck_assert_err(ops->mem_release(dev, a), -EINVAL);
	ck_assert_uint_eq(info().live_handles, 1);
	ck_assert_int_eq(ops->mem_release(dev, b), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_chunk_coalesce)
{
	gml_handle h[4], big;
	gml_handle x;
	int i;

	reopen(4, G);
	for (i = 0; i < 4; i++)
		h[i] = chunk(1);
	ck_assert_err(ops->mem_create(dev, G, &x), -ENOMEM);
	/* Free 0 and 2, then 1: the three merge into one 3-unit range. */
	ck_assert_int_eq(ops->mem_release(dev, h[0]), 0);
	ck_assert_int_eq(ops->mem_release(dev, h[2]), 0);
	ck_assert_err(ops->mem_create(dev, 2 * G, &x), -ENOMEM);
	ck_assert_int_eq(ops->mem_release(dev, h[1]), 0);
	big = chunk(3);
	ck_assert_int_eq(ops->mem_release(dev, big), 0);
	ck_assert_int_eq(ops->mem_release(dev, h[3]), 0);
	big = chunk(4);
	ck_assert_int_eq(ops->mem_release(dev, big), 0);
	assert_nothing_live();
}
END_TEST

/* ------------------------------------------------------------------ */
/* capacity                                                            */

START_TEST(test_capacity_exhaust_recover)
{
	gml_handle h[CAP_UNITS], x;
	int i;

	for (i = 0; i < CAP_UNITS; i++)
		h[i] = chunk(1);
	ck_assert_uint_eq(free_bytes(), 0);
	ck_assert_err(ops->mem_create(dev, G, &x), -ENOMEM);
	ck_assert_uint_eq(info().live_handles, CAP_UNITS);
	ck_assert_int_eq(ops->mem_release(dev, h[5]), 0);
	h[5] = chunk(1);
	ck_assert_err(ops->mem_create(dev, G, &x), -ENOMEM);
	for (i = 0; i < CAP_UNITS; i++)
		ck_assert_int_eq(ops->mem_release(dev, h[i]), 0);
	x = chunk(CAP_UNITS);
	ck_assert_int_eq(ops->mem_release(dev, x), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_capacity_too_large)
{
	gml_handle x;

	ck_assert_err(ops->mem_create(dev, (CAP_UNITS + 1) * G, &x), -ENOMEM);
	ck_assert_err(ops->mem_create(dev, SIZE_MAX - G + 1, &x), -ENOMEM);
	assert_nothing_live();
}
END_TEST

START_TEST(test_capacity_many_chunks)
{
	enum { N = 4096 };
	gml_handle *h = calloc(N, sizeof(*h)), x;
	int i;

	ck_assert_ptr_nonnull(h);
	reopen(N, 4096);
	for (i = 0; i < N; i++)
		ck_assert_int_eq(ops->mem_create(dev, 4096, &h[i]), 0);
	ck_assert_err(ops->mem_create(dev, 4096, &x), -ENOMEM);
	/* Every other one, then the rest: many extents, then one. */
	for (i = 0; i < N; i += 2)
		ck_assert_int_eq(ops->mem_release(dev, h[i]), 0);
	ck_assert_err(ops->mem_create(dev, 2 * 4096, &x), -ENOMEM);
	for (i = 1; i < N; i += 2)
		ck_assert_int_eq(ops->mem_release(dev, h[i]), 0);
	ck_assert_int_eq(ops->mem_create(dev, (size_t)N * 4096, &x), 0);
	ck_assert_int_eq(ops->mem_release(dev, x), 0);
	assert_nothing_live();
	free(h);
}
END_TEST

/* ------------------------------------------------------------------ */
/* mappings                                                            */

START_TEST(test_map_access_unmap)
{
	gml_va va = reserve(4);
	gml_handle h = chunk(2);
	char *p = (char *)(uintptr_t)(va + G);

	ck_assert_uint_eq(va % G, 0);
	ck_assert(!readable((void *)(uintptr_t)va));
	ck_assert_int_eq(ops->mem_map(dev, va + G, 2 * G, h), 0);
	ck_assert(!readable(p));	/* mapped, no access yet */
	ck_assert_uint_eq(info().live_mappings, 1);
	ck_assert_int_eq(ops->set_access(dev, va + G, 2 * G, NULL, 0), 0);
	ck_assert(readable(p) && writable(p));
	ck_assert(readable(p + 2 * G - 1));
	ck_assert(!readable(p + 2 * G));
	ck_assert(zeroed(p, 2 * G));
	fill(p, 2 * G, 3);
	ck_assert(filled(p, 2 * G, 3));

	ck_assert_int_eq(ops->mem_unmap(dev, va + G, 2 * G), 0);
	ck_assert(!readable(p));
	ck_assert_uint_eq(info().live_mappings, 0);
	/* The reservation stays: the same range maps again, same bytes. */
	ck_assert_int_eq(ops->mem_map(dev, va + G, 2 * G, h), 0);
	ck_assert_int_eq(ops->set_access(dev, va + G, 2 * G, NULL, 0), 0);
	ck_assert(filled(p, 2 * G, 3));
	ck_assert_int_eq(ops->mem_unmap(dev, va + G, 2 * G), 0);
	ck_assert_int_eq(ops->mem_release(dev, h), 0);
	ck_assert_int_eq(ops->va_free(dev, va, 4 * G), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_reserve)
{
	gml_va va = 0, vb = 0;

	ck_assert_int_eq(ops->va_reserve(dev, 3 * G, 16 * G, &va), 0);
	ck_assert_uint_eq(va % (16 * G), 0);
	ck_assert_int_eq(ops->va_reserve(dev, G, 0, &vb), 0);
	ck_assert_uint_eq(vb % G, 0);
	ck_assert_uint_eq(info().live_reservations, 2);
	/* Reservations need no device memory, only address space. */
	ck_assert_uint_eq(free_bytes(), CAP_UNITS * G);
	ck_assert_int_eq(ops->va_free(dev, va, 3 * G), 0);
	ck_assert_int_eq(ops->va_free(dev, vb, G), 0);

	va = 9;
	ck_assert_err(ops->va_reserve(dev, 0, 0, &va), -EINVAL);
	ck_assert_err(ops->va_reserve(dev, G + 1, 0, &va), -EINVAL);
	ck_assert_err(ops->va_reserve(dev, G, 3 * G, &va), -EINVAL);
	ck_assert_err(ops->va_reserve(dev, G, 0, NULL), -EINVAL);
	ck_assert_err(ops->va_reserve(dev, SIZE_MAX - G + 1, 0, &va), -EINVAL);
	ck_assert_uint_eq(va, 9);
	assert_nothing_live();
}
END_TEST

START_TEST(test_va_free_errors)
{
	gml_va va = reserve(2);
	gml_handle h = chunk(1);

	ck_assert_err(ops->va_free(dev, va, G), -EINVAL);
	ck_assert_err(ops->va_free(dev, va, 3 * G), -EINVAL);
	ck_assert_err(ops->va_free(dev, va + G, G), -EINVAL);
	ck_assert_err(ops->va_free(dev, 0, G), -EINVAL);
	ck_assert_int_eq(ops->mem_map(dev, va + G, G, h), 0);
	ck_assert_err(ops->va_free(dev, va, 2 * G), -EBUSY);
	ck_assert_uint_eq(info().live_reservations, 1);
	ck_assert_int_eq(ops->mem_unmap(dev, va + G, G), 0);
	ck_assert_int_eq(ops->va_free(dev, va, 2 * G), 0);
	ck_assert_err(ops->va_free(dev, va, 2 * G), -EINVAL);
	ck_assert_int_eq(ops->mem_release(dev, h), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_map_errors)
{
	gml_va va = reserve(4), other = reserve(1);
	gml_handle h1 = chunk(1), h2 = chunk(2), dead = chunk(1);
	char host[64];

	ck_assert_int_eq(ops->mem_release(dev, dead), 0);
	ck_assert_int_eq(ops->mem_map(dev, va, 2 * G, h2), 0);

	/* Outside any reservation, or running off the end of one. */
	ck_assert_err(ops->mem_map(dev, (uintptr_t)host & ~(G - 1), G, h1),
		      -EINVAL);
	ck_assert_err(ops->mem_map(dev, va + 4 * G, G, h1), -EINVAL);
	ck_assert_err(ops->mem_map(dev, other, 2 * G, h2), -EINVAL);
	ck_assert_err(ops->mem_map(dev, va + 3 * G, 2 * G, h2), -EINVAL);
	ck_assert_err(ops->mem_map(dev, ~(gml_va)0 & ~(G - 1), G, h1), -EINVAL);
	/* Overlapping the mapping at va, from the front and inside. */
	ck_assert_err(ops->mem_map(dev, va, G, h1), -EINVAL);
	ck_assert_err(ops->mem_map(dev, va + G, G, h1), -EINVAL);
	/* Size not the chunk's, unaligned address, bad handles. */
	ck_assert_err(ops->mem_map(dev, va + 2 * G, 2 * G, h1), -EINVAL);
	ck_assert_err(ops->mem_map(dev, va + 2 * G, 0, h1), -EINVAL);
	ck_assert_err(ops->mem_map(dev, va + 2 * G + 4096, G, h1), -EINVAL);
	ck_assert_err(ops->mem_map(dev, va + 2 * G, G, 0), -EINVAL);
	ck_assert_err(ops->mem_map(dev, va + 2 * G, G, 0xdeadbeef), -EINVAL);
	ck_assert_err(ops->mem_map(dev, va + 2 * G, G, dead), -EINVAL);
	ck_assert_uint_eq(info().live_mappings, 1);

	/* The neighbouring slot is still free and maps fine. */
	ck_assert_int_eq(ops->mem_map(dev, va + 2 * G, G, h1), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, va + 2 * G, G), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, va, 2 * G), 0);
	ck_assert_int_eq(ops->mem_release(dev, h1), 0);
	ck_assert_int_eq(ops->mem_release(dev, h2), 0);
	ck_assert_int_eq(ops->va_free(dev, va, 4 * G), 0);
	ck_assert_int_eq(ops->va_free(dev, other, G), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_unmap_errors)
{
	gml_va va = reserve(4);
	gml_handle h = chunk(2);

	ck_assert_int_eq(ops->mem_map(dev, va + G, 2 * G, h), 0);
	ck_assert_err(ops->mem_unmap(dev, va + G, G), -EINVAL);
	ck_assert_err(ops->mem_unmap(dev, va + G, 3 * G), -EINVAL);
	ck_assert_err(ops->mem_unmap(dev, va + 2 * G, G), -EINVAL);
	ck_assert_err(ops->mem_unmap(dev, va, 2 * G), -EINVAL);
	ck_assert_err(ops->mem_unmap(dev, va, 4 * G), -EINVAL);
	ck_assert_err(ops->mem_unmap(dev, 0, G), -EINVAL);
	ck_assert_uint_eq(info().live_mappings, 1);
	ck_assert_int_eq(ops->mem_unmap(dev, va + G, 2 * G), 0);
	ck_assert_err(ops->mem_unmap(dev, va + G, 2 * G), -EINVAL);
	ck_assert_int_eq(ops->mem_release(dev, h), 0);
	ck_assert_int_eq(ops->va_free(dev, va, 4 * G), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_set_access_errors)
{
	gml_va va = reserve(5);
	gml_handle a = chunk(1), b = chunk(1), c = chunk(2);

	/* a at 0, b at 1, gap at 2, c at 3..4 */
	ck_assert_int_eq(ops->mem_map(dev, va, G, a), 0);
	ck_assert_int_eq(ops->mem_map(dev, va + G, G, b), 0);
	ck_assert_int_eq(ops->mem_map(dev, va + 3 * G, 2 * G, c), 0);

	ck_assert_err(ops->set_access(dev, va, 0, NULL, 0), -EINVAL);
	/* Over the gap, in it, over half of c. */
	ck_assert_err(ops->set_access(dev, va, 5 * G, NULL, 0), -EINVAL);
	ck_assert_err(ops->set_access(dev, va, 3 * G, NULL, 0), -EINVAL);
	ck_assert_err(ops->set_access(dev, va + 2 * G, G, NULL, 0), -EINVAL);
	ck_assert_err(ops->set_access(dev, va + 3 * G, G, NULL, 0), -EINVAL);
	ck_assert_err(ops->set_access(dev, va + 4 * G, G, NULL, 0), -EINVAL);
	ck_assert_err(ops->set_access(dev, va + 3 * G, 3 * G, NULL, 0), -EINVAL);
	ck_assert_err(ops->set_access(dev, va + 4096, G, NULL, 0), -EINVAL);
	ck_assert_err(ops->set_access(dev, va, SIZE_MAX, NULL, 0), -EINVAL);
	ck_assert(!readable((void *)(uintptr_t)va));

	/* Two mappings side by side take one call. */
	ck_assert_int_eq(ops->set_access(dev, va, 2 * G, NULL, 0), 0);
	ck_assert(writable((void *)(uintptr_t)(va + 2 * G - 1)));
	ck_assert(!readable((void *)(uintptr_t)(va + 3 * G)));
	ck_assert_int_eq(ops->set_access(dev, va + 3 * G, 2 * G, NULL, 0), 0);
	ck_assert(writable((void *)(uintptr_t)(va + 5 * G - 1)));

	ck_assert_int_eq(ops->mem_unmap(dev, va, G), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, va + G, G), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, va + 3 * G, 2 * G), 0);
	ck_assert_int_eq(ops->mem_release(dev, a), 0);
	ck_assert_int_eq(ops->mem_release(dev, b), 0);
	ck_assert_int_eq(ops->mem_release(dev, c), 0);
	ck_assert_int_eq(ops->va_free(dev, va, 5 * G), 0);
	assert_nothing_live();
}
END_TEST

/* ------------------------------------------------------------------ */
/* stitch                                                              */

START_TEST(test_stitch_two_chunks)
{
	gml_handle a = chunk(1), filler = chunk(1), b = chunk(1);
	gml_va x = reserve(1), y = reserve(1), z = reserve(2), f = reserve(1);
	char *px = (char *)(uintptr_t)x, *py = (char *)(uintptr_t)y;
	char *pz = (char *)(uintptr_t)z;

	/* a and b are apart in device memory; z shows them side by side. */
	ck_assert_int_eq(ops->mem_map(dev, x, G, a), 0);
	ck_assert_int_eq(ops->mem_map(dev, y, G, b), 0);
	ck_assert_int_eq(ops->mem_map(dev, z, G, a), 0);
	ck_assert_int_eq(ops->mem_map(dev, z + G, G, b), 0);
	ck_assert_int_eq(ops->mem_map(dev, f, G, filler), 0);
	ck_assert_int_eq(ops->set_access(dev, z, 2 * G, NULL, 0), 0);
	ck_assert_int_eq(ops->set_access(dev, x, G, NULL, 0), 0);
	ck_assert_int_eq(ops->set_access(dev, y, G, NULL, 0), 0);
	ck_assert_int_eq(ops->set_access(dev, f, G, NULL, 0), 0);
	ck_assert_uint_eq(info().live_mappings, 5);

	fill(pz, 2 * G, 7);
	ck_assert(filled(pz, 2 * G, 7));
	ck_assert_int_eq(memcmp(px, pz, G), 0);
	ck_assert_int_eq(memcmp(py, pz + G, G), 0);
	ck_assert(zeroed((void *)(uintptr_t)f, G));

	/* Writes through a chunk's own view show in the stitched one. */
	fill(py, G, 99);
	ck_assert(filled(pz + G, G, 99));
	ck_assert_int_eq(memcmp(px, pz, G), 0);
	memset(px + G - 1, 0xab, 1);
	ck_assert_uint_eq((unsigned char)pz[G - 1], 0xab);

	ck_assert_int_eq(ops->mem_unmap(dev, z, G), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, z + G, G), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, x, G), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, y, G), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, f, G), 0);
	ck_assert_int_eq(ops->mem_release(dev, a), 0);
	ck_assert_int_eq(ops->mem_release(dev, b), 0);
	ck_assert_int_eq(ops->mem_release(dev, filler), 0);
	ck_assert_int_eq(ops->va_free(dev, x, G), 0);
	ck_assert_int_eq(ops->va_free(dev, y, G), 0);
	ck_assert_int_eq(ops->va_free(dev, z, 2 * G), 0);
	ck_assert_int_eq(ops->va_free(dev, f, G), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_stitch_reversed)
{
	gml_handle a, b;
	char *pa = mapped(1, &a), *pb = mapped(2, &b);
	gml_va z = reserve(3);
	char *pz = (char *)(uintptr_t)z;

	fill(pa, G, 1);
	fill(pb, 2 * G, 2);
	/* b first, then a: the order in the range is the caller's. */
	ck_assert_int_eq(ops->mem_map(dev, z, 2 * G, b), 0);
	ck_assert_int_eq(ops->mem_map(dev, z + 2 * G, G, a), 0);
	ck_assert_int_eq(ops->set_access(dev, z, 3 * G, NULL, 0), 0);
	ck_assert(filled(pz, 2 * G, 2));
	ck_assert(filled(pz + 2 * G, G, 1));
	ck_assert_int_eq(ops->mem_unmap(dev, z, 2 * G), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, z + 2 * G, G), 0);
	ck_assert_int_eq(ops->va_free(dev, z, 3 * G), 0);
	unmapped(pa, 1, a);
	unmapped(pb, 2, b);
	assert_nothing_live();
}
END_TEST

/* ------------------------------------------------------------------ */
/* release while mapped                                                */

START_TEST(test_release_mapped_keeps_bytes)
{
	gml_handle h, again;
	gml_va other;
	char *p;
	struct gml_emu_info in;

	reopen(1, G);
	other = reserve(1);
	p = mapped(1, &h);
	fill(p, G, 42);
	ck_assert_int_eq(ops->mem_release(dev, h), 0);

	/* The handle is gone, the memory is not. */
	ck_assert(filled(p, G, 42));
	in = info();
	ck_assert_uint_eq(in.live_handles, 0);
	ck_assert_uint_eq(in.live_mappings, 1);
	ck_assert_uint_eq(in.used, G);
	ck_assert_uint_eq(free_bytes(), 0);
	ck_assert_err(ops->mem_map(dev, other, G, h), -EINVAL);
	ck_assert_err(ops->mem_release(dev, h), -EINVAL);
	ck_assert_err(ops->mem_create(dev, G, &again), -ENOMEM);

	/* The last unmap frees it, and a hole was punched: zeros again. */
	ck_assert_int_eq(ops->mem_unmap(dev, (uintptr_t)p, G), 0);
	ck_assert_uint_eq(info().used, 0);
	ck_assert_uint_eq(free_bytes(), G);
	again = chunk(1);
	ck_assert_int_eq(ops->mem_map(dev, (uintptr_t)p, G, again), 0);
	ck_assert_int_eq(ops->set_access(dev, (uintptr_t)p, G, NULL, 0), 0);
	ck_assert(zeroed(p, G));
	unmapped(p, 1, again);
	ck_assert_int_eq(ops->va_free(dev, other, G), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_release_mapped_twice)
{
	gml_handle h;
	char *p = mapped(1, &h);
	gml_va v2 = reserve(1);

	ck_assert_int_eq(ops->mem_map(dev, v2, G, h), 0);
	ck_assert_int_eq(ops->set_access(dev, v2, G, NULL, 0), 0);
	fill(p, G, 5);
	ck_assert(filled((void *)(uintptr_t)v2, G, 5));
	ck_assert_int_eq(ops->mem_release(dev, h), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, (uintptr_t)p, G), 0);
	ck_assert_uint_eq(info().used, G);	/* still mapped at v2 */
	ck_assert(filled((void *)(uintptr_t)v2, G, 5));
	ck_assert_int_eq(ops->mem_unmap(dev, v2, G), 0);
	ck_assert_uint_eq(info().used, 0);
	ck_assert_int_eq(ops->va_free(dev, (uintptr_t)p, G), 0);
	ck_assert_int_eq(ops->va_free(dev, v2, G), 0);
	assert_nothing_live();
}
END_TEST

/* ------------------------------------------------------------------ */
/* streams and events                                                  */

START_TEST(test_stream_create_destroy)
{
	gmlake_stream_t s[3];
	int i;

	for (i = 0; i < 3; i++) {
		ck_assert_int_eq(ops->stream_create(dev, &s[i]), 0);
		ck_assert_ptr_nonnull(s[i]);
	}
	ck_assert_ptr_ne(s[0], s[1]);
	ck_assert_ptr_ne(s[1], s[2]);
	ck_assert_uint_eq(info().live_streams, 3);
	for (i = 0; i < 3; i++)
		ck_assert_int_eq(ops->stream_sync(dev, s[i]), 0);
	ck_assert_int_eq(ops->stream_sync(dev, NULL), 0);
	for (i = 0; i < 3; i++)
		ck_assert_int_eq(ops->stream_destroy(dev, s[i]), 0);
	ck_assert_err(ops->stream_destroy(dev, s[0]), -EINVAL);
	ck_assert_err(ops->stream_sync(dev, s[1]), -EINVAL);
	ck_assert_err(ops->stream_destroy(dev, NULL), -EINVAL);
	ck_assert_err(ops->stream_sync(dev, (gmlake_stream_t)(uintptr_t)77),
		      -EINVAL);
	ck_assert_err(ops->stream_create(dev, NULL), -EINVAL);
	assert_nothing_live();
}
END_TEST

START_TEST(test_event_basic)
{
	gml_event e, e2;
	gmlake_stream_t s;

	ck_assert_int_eq(ops->event_create(dev, &e), 0);
	ck_assert_ptr_nonnull(e);
	ck_assert_uint_eq(info().live_events, 1);
	/* Never recorded: complete, as in CUDA. */
	ck_assert_int_eq(ops->event_query(dev, e), 0);
	ck_assert_int_eq(ops->event_sync(dev, e), 0);
	ck_assert_int_eq(ops->event_record(dev, e, NULL), 0);
	ck_assert_int_eq(ops->event_sync(dev, e), 0);
	ck_assert_int_eq(ops->event_query(dev, e), 0);
	ck_assert_int_eq(ops->stream_create(dev, &s), 0);
	ck_assert_int_eq(ops->event_record(dev, e, s), 0);
	ck_assert_int_eq(ops->stream_sync(dev, s), 0);
	ck_assert_int_eq(ops->event_query(dev, e), 0);

	ck_assert_err(ops->event_record(dev, e, (gmlake_stream_t)(uintptr_t)5),
		      -EINVAL);
	ck_assert_int_eq(ops->stream_destroy(dev, s), 0);
	ck_assert_err(ops->event_record(dev, e, s), -EINVAL);
	ck_assert_int_eq(ops->event_destroy(dev, e), 0);
	ck_assert_err(ops->event_query(dev, e), -EINVAL);
	ck_assert_err(ops->event_sync(dev, e), -EINVAL);
	ck_assert_err(ops->event_record(dev, e, NULL), -EINVAL);
	ck_assert_err(ops->event_destroy(dev, e), -EINVAL);
	ck_assert_err(ops->event_destroy(dev, NULL), -EINVAL);
	ck_assert_err(ops->event_query(dev, (gml_event)&e), -EINVAL);
	ck_assert_err(ops->event_create(dev, NULL), -EINVAL);
	/* A new event may reuse the slot; the old handle stays dead. */
	ck_assert_int_eq(ops->event_create(dev, &e2), 0);
	ck_assert_ptr_ne(e2, e);
	ck_assert_err(ops->event_query(dev, e), -EINVAL);
	ck_assert_int_eq(ops->event_destroy(dev, e2), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_hold_keeps_pending)
{
	gmlake_stream_t s;
	gml_event e;
	gml_handle h;
	char *p = mapped(1, &h);
	static char src[4096];
	int i;

	fill(src, sizeof(src), 11);
	ck_assert_int_eq(ops->stream_create(dev, &s), 0);
	ck_assert_int_eq(ops->event_create(dev, &e), 0);
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, true), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, p, src, sizeof(src),
					   GML_COPY_HTOD, s), 0);
	ck_assert_int_eq(ops->event_record(dev, e, s), 0);
	for (i = 0; i < 5; i++) {
		ck_assert_int_eq(ops->event_query(dev, e), -EBUSY);
		sleep_ms(5);
	}
	ck_assert(zeroed(p, sizeof(src)));	/* the copy waits too */
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, false), 0);
	ck_assert_int_eq(ops->event_sync(dev, e), 0);
	ck_assert_int_eq(ops->event_query(dev, e), 0);
	ck_assert(filled(p, sizeof(src), 11));

	/* Re-recording makes it pending again. */
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, true), 0);
	ck_assert_int_eq(ops->event_record(dev, e, s), 0);
	ck_assert_int_eq(ops->event_query(dev, e), -EBUSY);
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, false), 0);
	ck_assert_int_eq(ops->stream_sync(dev, s), 0);
	ck_assert_int_eq(ops->event_query(dev, e), 0);

	/* The default stream holds too. */
	ck_assert_int_eq(gml_emu_stream_hold(dev, NULL, true), 0);
	ck_assert_int_eq(ops->event_record(dev, e, NULL), 0);
	ck_assert_int_eq(ops->event_query(dev, e), -EBUSY);
	ck_assert_int_eq(gml_emu_stream_hold(dev, NULL, false), 0);
	ck_assert_int_eq(ops->event_sync(dev, e), 0);

	ck_assert_int_eq(ops->event_destroy(dev, e), 0);
	ck_assert_int_eq(ops->stream_destroy(dev, s), 0);
	unmapped(p, 1, h);
	assert_nothing_live();
}
END_TEST

/*
 * emu_lag: recorded work waits for a host wait, which lets every stream
 * run, one stream's wait on another's event included; a destroy and a
 * close run what is queued. Fails if the device runs work on its own
 * (the queries see it done) or a host wait leaves a stream held (hang).
 */
START_TEST(test_lag_waits_for_host)
{
	static char src[4096];
	struct gmlake_config cfg;
	gmlake_stream_t a, b;
	gml_event ea, eb, idle;
	gml_handle h;
	char *p;

	close_dev();
	memset(&cfg, 0, sizeof(cfg));
	cfg.emu_capacity = CAP_UNITS * G;
	cfg.emu_granularity = G;
	cfg.emu_lag = true;
	ck_assert_int_eq(ops->open(&cfg, &dev), 0);
	p = mapped(1, &h);
	fill(src, sizeof(src), 7);
	ck_assert_int_eq(ops->stream_create(dev, &a), 0);
	ck_assert_int_eq(ops->stream_create(dev, &b), 0);
	ck_assert_int_eq(ops->event_create(dev, &ea), 0);
	ck_assert_int_eq(ops->event_create(dev, &eb), 0);
	ck_assert_int_eq(ops->event_create(dev, &idle), 0);

	/* Even an idle stream's record stays pending. */
	ck_assert_int_eq(ops->event_record(dev, idle, NULL), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, p, src, sizeof(src),
					   GML_COPY_HTOD, a), 0);
	ck_assert_int_eq(ops->event_record(dev, ea, a), 0);
	ck_assert_int_eq(ops->stream_wait(dev, b, ea), 0);
	ck_assert_int_eq(ops->event_record(dev, eb, b), 0);
	for (int i = 0; i < 5; i++) {
		ck_assert_int_eq(ops->event_query(dev, idle), -EBUSY);
		ck_assert_int_eq(ops->event_query(dev, ea), -EBUSY);
		ck_assert_int_eq(ops->event_query(dev, eb), -EBUSY);
		sleep_ms(5);
	}
	ck_assert(zeroed(p, sizeof(src)));

	/* Syncing b needs a's copy and event: both run. */
	ck_assert_int_eq(ops->stream_sync(dev, b), 0);
	ck_assert_int_eq(ops->event_query(dev, eb), 0);
	ck_assert_int_eq(ops->event_query(dev, ea), 0);
	ck_assert(filled(p, sizeof(src), 7));
	ck_assert_int_eq(ops->event_sync(dev, idle), 0);
	ck_assert_int_eq(ops->event_query(dev, idle), 0);

	/* Held again once the host's waits returned. */
	ck_assert_int_eq(ops->event_record(dev, ea, a), 0);
	sleep_ms(5);
	ck_assert_int_eq(ops->event_query(dev, ea), -EBUSY);

	/* b's queued wait on a's event runs at its destroy. */
	ck_assert_int_eq(ops->stream_wait(dev, b, ea), 0);
	ck_assert_int_eq(ops->event_record(dev, eb, b), 0);
	ck_assert_int_eq(ops->stream_destroy(dev, b), 0);
	ck_assert_int_eq(ops->event_query(dev, eb), 0);

	/* The close runs the rest. */
	ck_assert_int_eq(ops->memcpy_async(dev, p, src, 8, GML_COPY_HTOD,
					   a), 0);
	ck_assert_int_eq(ops->event_destroy(dev, eb), 0);
	ck_assert_int_eq(ops->event_destroy(dev, idle), 0);
	close_dev();
}
END_TEST

START_TEST(test_fifo_order)
{
	enum { N = 64 };
	static uint32_t vals[N];
	gmlake_stream_t s;
	gml_event mid, end;
	gml_handle h;
	uint32_t *p = mapped(1, &h);
	int i;

	ck_assert_int_eq(ops->stream_create(dev, &s), 0);
	ck_assert_int_eq(ops->event_create(dev, &mid), 0);
	ck_assert_int_eq(ops->event_create(dev, &end), 0);
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, true), 0);
	/* Every copy writes p[0]; p[1 + i] records which ones ran. */
	for (i = 0; i < N; i++) {
		vals[i] = (uint32_t)i + 1;
		ck_assert_int_eq(ops->memcpy_async(dev, p, &vals[i], 4,
						   GML_COPY_HTOD, s), 0);
		ck_assert_int_eq(ops->memcpy_async(dev, p + 1 + i, p, 4,
						   GML_COPY_DTOD, s), 0);
		if (i == N / 2)
			ck_assert_int_eq(ops->event_record(dev, mid, s), 0);
	}
	ck_assert_int_eq(ops->event_record(dev, end, s), 0);
	ck_assert_int_eq(ops->event_query(dev, mid), -EBUSY);
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, false), 0);
	ck_assert_int_eq(ops->event_sync(dev, end), 0);
	ck_assert_int_eq(ops->event_query(dev, mid), 0);
	ck_assert_uint_eq(p[0], N);
	for (i = 0; i < N; i++)
		ck_assert_uint_eq(p[1 + i], (uint32_t)i + 1);
	ck_assert_int_eq(ops->event_destroy(dev, mid), 0);
	ck_assert_int_eq(ops->event_destroy(dev, end), 0);
	ck_assert_int_eq(ops->stream_destroy(dev, s), 0);
	unmapped(p, 1, h);
	assert_nothing_live();
}
END_TEST

START_TEST(test_streams_independent)
{
	gmlake_stream_t s1, s2;
	gml_event e1, e2;

	ck_assert_int_eq(ops->stream_create(dev, &s1), 0);
	ck_assert_int_eq(ops->stream_create(dev, &s2), 0);
	ck_assert_int_eq(ops->event_create(dev, &e1), 0);
	ck_assert_int_eq(ops->event_create(dev, &e2), 0);
	ck_assert_int_eq(gml_emu_stream_hold(dev, s1, true), 0);
	ck_assert_int_eq(ops->event_record(dev, e1, s1), 0);
	ck_assert_int_eq(ops->event_record(dev, e2, s2), 0);
	/* A held s1 does not stop s2. */
	ck_assert_int_eq(ops->event_sync(dev, e2), 0);
	ck_assert_int_eq(ops->stream_sync(dev, s2), 0);
	ck_assert_int_eq(ops->event_query(dev, e1), -EBUSY);
	/* The last record counts: e1 again on s2 completes there. */
	ck_assert_int_eq(ops->event_record(dev, e1, s2), 0);
	ck_assert_int_eq(ops->event_sync(dev, e1), 0);
	ck_assert_int_eq(ops->event_query(dev, e1), 0);
	/* Destroying the held stream runs what it holds. */
	ck_assert_int_eq(ops->event_record(dev, e2, s1), 0);
	ck_assert_int_eq(ops->event_query(dev, e2), -EBUSY);
	ck_assert_int_eq(ops->stream_destroy(dev, s1), 0);
	ck_assert_int_eq(ops->event_query(dev, e2), 0);
	ck_assert_int_eq(ops->event_destroy(dev, e1), 0);
	ck_assert_int_eq(ops->event_destroy(dev, e2), 0);
	ck_assert_int_eq(ops->stream_destroy(dev, s2), 0);
	assert_nothing_live();
}
END_TEST

START_TEST(test_destroy_drains)
{
	static char src[8192];
	gmlake_stream_t s;
	gml_handle h;
	char *p = mapped(1, &h);

	fill(src, sizeof(src), 9);
	ck_assert_int_eq(ops->stream_create(dev, &s), 0);
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, true), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, p, src, sizeof(src),
					   GML_COPY_HTOD, s), 0);
	ck_assert(zeroed(p, sizeof(src)));
	ck_assert_int_eq(ops->stream_destroy(dev, s), 0);
	ck_assert(filled(p, sizeof(src), 9));
	ck_assert_err(gml_emu_stream_hold(dev, s, false), -EINVAL);
	unmapped(p, 1, h);
	assert_nothing_live();
}
END_TEST

START_TEST(test_event_destroy_pending)
{
	gmlake_stream_t s;
	gml_event e;

	ck_assert_int_eq(ops->stream_create(dev, &s), 0);
	ck_assert_int_eq(ops->event_create(dev, &e), 0);
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, true), 0);
	ck_assert_int_eq(ops->event_record(dev, e, s), 0);
	ck_assert_int_eq(ops->event_record(dev, e, s), 0);
	ck_assert_int_eq(ops->event_destroy(dev, e), 0);
	ck_assert_uint_eq(info().live_events, 0);
	ck_assert_err(ops->event_query(dev, e), -EINVAL);
	/* The markers still in the queue complete without harm. */
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, false), 0);
	ck_assert_int_eq(ops->stream_sync(dev, s), 0);
	ck_assert_int_eq(ops->stream_destroy(dev, s), 0);
	assert_nothing_live();
}
END_TEST

struct waiter {
	gml_event e;
	gmlake_stream_t s;
	int ret;
	volatile int done;
};

static void *event_waiter(void *arg)
{
	struct waiter *w = arg;

	w->ret = ops->event_sync(dev, w->e);
	__atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
	return NULL;
}

static void *stream_waiter(void *arg)
{
	struct waiter *w = arg;

	w->ret = ops->stream_sync(dev, w->s);
	__atomic_store_n(&w->done, 1, __ATOMIC_RELEASE);
	return NULL;
}

START_TEST(test_sync_blocks_until_released)
{
	struct waiter we = { 0 }, ws = { 0 };
	pthread_t te, ts;

	ck_assert_int_eq(ops->stream_create(dev, &ws.s), 0);
	ck_assert_int_eq(ops->event_create(dev, &we.e), 0);
	ck_assert_int_eq(gml_emu_stream_hold(dev, ws.s, true), 0);
	ck_assert_int_eq(ops->event_record(dev, we.e, ws.s), 0);
	ck_assert_int_eq(pthread_create(&te, NULL, event_waiter, &we), 0);
	ck_assert_int_eq(pthread_create(&ts, NULL, stream_waiter, &ws), 0);
	sleep_ms(50);
	ck_assert_int_eq(__atomic_load_n(&we.done, __ATOMIC_ACQUIRE), 0);
	ck_assert_int_eq(__atomic_load_n(&ws.done, __ATOMIC_ACQUIRE), 0);
	ck_assert_int_eq(gml_emu_stream_hold(dev, ws.s, false), 0);
	pthread_join(te, NULL);
	pthread_join(ts, NULL);
	ck_assert_int_eq(we.ret, 0);
	ck_assert_int_eq(ws.ret, 0);
	ck_assert_int_eq(ops->event_query(dev, we.e), 0);
	ck_assert_int_eq(ops->event_destroy(dev, we.e), 0);
	ck_assert_int_eq(ops->stream_destroy(dev, ws.s), 0);
	assert_nothing_live();
}
END_TEST

/* ------------------------------------------------------------------ */
/* memcpy                                                              */

START_TEST(test_memcpy_roundtrip)
{
	gml_handle a = chunk(1), b = chunk(1), wh;
	gml_va z = reserve(2);
	char *pz = (char *)(uintptr_t)z, *pw = mapped(2, &wh);
	char *in = malloc(2 * G), *out = malloc(2 * G);
	gmlake_stream_t s;

	ck_assert_ptr_nonnull(in);
	ck_assert_ptr_nonnull(out);
	ck_assert_int_eq(ops->mem_map(dev, z, G, a), 0);
	ck_assert_int_eq(ops->mem_map(dev, z + G, G, b), 0);
	ck_assert_int_eq(ops->set_access(dev, z, 2 * G, NULL, 0), 0);
	ck_assert_int_eq(ops->stream_create(dev, &s), 0);

	/* Host to a stitched range and back, across the seam. */
	fill(in, 2 * G, 21);
	ck_assert_int_eq(ops->memcpy_async(dev, pz, in, 2 * G,
					   GML_COPY_HTOD, s), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, pw, pz, 2 * G,
					   GML_COPY_DTOD, s), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, out, pw + 100, G,
					   GML_COPY_DTOH, s), 0);
	ck_assert_int_eq(ops->stream_sync(dev, s), 0);
	ck_assert(filled(pz, 2 * G, 21));
	ck_assert_int_eq(memcmp(pw, in, 2 * G), 0);
	ck_assert_int_eq(memcmp(out, in + 100, G), 0);

	/* The default stream copies too; size 0 is a no-op. */
	memset(out, 0, 2 * G);
	ck_assert_int_eq(ops->memcpy_async(dev, out, pz + G - 10, 20,
					   GML_COPY_DTOH, NULL), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, NULL, NULL, 0,
					   GML_COPY_DTOH, NULL), 0);
	ck_assert_int_eq(ops->stream_sync(dev, NULL), 0);
	ck_assert_int_eq(memcmp(out, in + G - 10, 20), 0);

	ck_assert_int_eq(ops->stream_destroy(dev, s), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, z, G), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, z + G, G), 0);
	ck_assert_int_eq(ops->mem_release(dev, a), 0);
	ck_assert_int_eq(ops->mem_release(dev, b), 0);
	ck_assert_int_eq(ops->va_free(dev, z, 2 * G), 0);
	unmapped(pw, 2, wh);
	free(in);
	free(out);
	assert_nothing_live();
}
END_TEST

START_TEST(test_memcpy_errors)
{
	gml_handle a, b = chunk(1), c = chunk(1);
	char *p = mapped(1, &a);
	gml_va v = reserve(3);
	char *pv = (char *)(uintptr_t)v;
	char host[256] = { 0 };
	gmlake_stream_t bad = (gmlake_stream_t)(uintptr_t)3;

	/* v: b mapped with access, a gap, c mapped without access. */
	ck_assert_int_eq(ops->mem_map(dev, v, G, b), 0);
	ck_assert_int_eq(ops->set_access(dev, v, G, NULL, 0), 0);
	ck_assert_int_eq(ops->mem_map(dev, v + 2 * G, G, c), 0);

	ck_assert_err(ops->memcpy_async(dev, host, host + 128, 64,
					GML_COPY_HTOD, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, host, host + 128, 64,
					GML_COPY_DTOH, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, p, host, 64,
					GML_COPY_DTOD, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, host, p, 64,
					GML_COPY_DTOD, NULL), -EINVAL);
	/* Off the end of a mapping, over a gap, into no access. */
	ck_assert_err(ops->memcpy_async(dev, p + G - 8, host, 16,
					GML_COPY_HTOD, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, pv + G - 8, host, 16,
					GML_COPY_HTOD, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, host, pv + 2 * G, 16,
					GML_COPY_DTOH, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, pv + G, host, 16,
					GML_COPY_HTOD, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, p, host, SIZE_MAX,
					GML_COPY_HTOD, NULL), -EINVAL);
	/* NULL pointers, bad kind, unknown stream. */
	ck_assert_err(ops->memcpy_async(dev, NULL, host, 16,
					GML_COPY_HTOD, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, p, NULL, 16,
					GML_COPY_HTOD, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, p, host, 16,
					(enum gml_copy_kind)7, NULL), -EINVAL);
	ck_assert_err(ops->memcpy_async(dev, p, host, 16, GML_COPY_HTOD, bad),
		      -EINVAL);
	/* The valid ones still work, then fail once unmapped. */
	ck_assert_int_eq(ops->memcpy_async(dev, pv, p, G, GML_COPY_DTOD,
					   NULL), 0);
	ck_assert_int_eq(ops->stream_sync(dev, NULL), 0);
	ck_assert_int_eq(ops->mem_unmap(dev, v, G), 0);
	ck_assert_err(ops->memcpy_async(dev, pv, p, G, GML_COPY_DTOD, NULL),
		      -EINVAL);

	ck_assert_int_eq(ops->mem_unmap(dev, v + 2 * G, G), 0);
	ck_assert_int_eq(ops->mem_release(dev, b), 0);
	ck_assert_int_eq(ops->mem_release(dev, c), 0);
	ck_assert_int_eq(ops->va_free(dev, v, 3 * G), 0);
	unmapped(p, 1, a);
	assert_nothing_live();
}
END_TEST

/* ------------------------------------------------------------------ */
/* leaks and threads                                                   */

START_TEST(test_leak_accounting)
{
	enum { N = 8 };
	gml_handle h[N];
	void *p[N];
	gmlake_stream_t s[N];
	gml_event e[N];
	struct gml_emu_info in;
	int i;

	for (i = 0; i < N; i++) {
		p[i] = mapped(1, &h[i]);
		ck_assert_int_eq(ops->stream_create(dev, &s[i]), 0);
		ck_assert_int_eq(ops->event_create(dev, &e[i]), 0);
		ck_assert_int_eq(ops->event_record(dev, e[i], s[i]), 0);
	}
	in = info();
	ck_assert_uint_eq(in.used, N * G);
	ck_assert_uint_eq(in.live_handles, N);
	ck_assert_uint_eq(in.live_mappings, N);
	ck_assert_uint_eq(in.live_reservations, N);
	ck_assert_uint_eq(in.live_events, N);
	ck_assert_uint_eq(in.live_streams, N);
	for (i = 0; i < N; i++) {
		ck_assert_int_eq(ops->event_destroy(dev, e[i]), 0);
		ck_assert_int_eq(ops->stream_destroy(dev, s[i]), 0);
		unmapped(p[i], 1, h[i]);
	}
	assert_nothing_live();
}
END_TEST

/* Close with everything still live: the sanitizer build checks for leaks. */
START_TEST(test_close_with_live_objects)
{
	static char src[4096];
	gml_handle h, released;
	char *p = mapped(2, &h);
	char *q = mapped(1, &released);
	gmlake_stream_t s;
	gml_event e, pending;

	ck_assert_int_eq(ops->mem_release(dev, released), 0);
	(void)chunk(1);
	(void)reserve(3);
	ck_assert_int_eq(ops->stream_create(dev, &s), 0);
	ck_assert_int_eq(ops->event_create(dev, &e), 0);
	ck_assert_int_eq(ops->event_create(dev, &pending), 0);
	ck_assert_int_eq(gml_emu_stream_hold(dev, s, true), 0);
	ck_assert_int_eq(gml_emu_stream_hold(dev, NULL, true), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, p, src, sizeof(src),
					   GML_COPY_HTOD, s), 0);
	ck_assert_int_eq(ops->memcpy_async(dev, q, src, sizeof(src),
					   GML_COPY_HTOD, NULL), 0);
	ck_assert_int_eq(ops->event_record(dev, e, s), 0);
	ck_assert_int_eq(ops->event_record(dev, pending, s), 0);
	ck_assert_int_eq(ops->event_destroy(dev, pending), 0);
	close_dev();
}
END_TEST

#define THREADS	4
#define ROUNDS	100

static void *churn(void *arg)
{
	unsigned seed = (unsigned)(uintptr_t)arg;
	gmlake_stream_t s;
	gml_event e;
	char buf[256];
	int i, bad = 0;

	if (ops->stream_create(dev, &s) || ops->event_create(dev, &e))
		return (void *)1;
	for (i = 0; i < ROUNDS && !bad; i++) {
		gml_handle h;
		gml_va va;
		char *p;

		if (ops->mem_create(dev, G, &h))
			continue;	/* another thread holds it all */
		bad |= ops->va_reserve(dev, G, 0, &va);
		bad |= ops->mem_map(dev, va, G, h);
		bad |= ops->set_access(dev, va, G, NULL, 0);
		if (bad)
			break;
		p = (char *)(uintptr_t)va;
		fill(buf, sizeof(buf), seed + i);
		bad |= ops->memcpy_async(dev, p, buf, sizeof(buf),
					 GML_COPY_HTOD, s);
		bad |= ops->event_record(dev, e, s);
		bad |= ops->event_sync(dev, e);
		bad |= !filled(p, sizeof(buf), seed + i);
		bad |= ops->mem_release(dev, h);
		bad |= ops->mem_unmap(dev, va, G);
		bad |= ops->va_free(dev, va, G);
	}
	bad |= ops->event_destroy(dev, e);
	bad |= ops->stream_destroy(dev, s);
	return (void *)(uintptr_t)(bad != 0);
}

START_TEST(test_threads)
{
	pthread_t t[THREADS];
	void *ret;
	int i;

	for (i = 0; i < THREADS; i++) {
		void *seed = (void *)(uintptr_t)(i * 17);

		ck_assert_int_eq(pthread_create(&t[i], NULL, churn, seed), 0);
	}
	for (i = 0; i < THREADS; i++) {
		pthread_join(t[i], &ret);
		ck_assert_ptr_null(ret);
	}
	assert_nothing_live();
}
END_TEST

/* ------------------------------------------------------------------ */

static TCase *tcase(const char *name)
{
	TCase *tc = tcase_create(name);

	tcase_add_checked_fixture(tc, setup, teardown);
	return tc;
}

static Suite *emu_suite(void)
{
	Suite *s = suite_create("emu");
	TCase *tc;

	tc = tcase("open");
	tcase_add_test(tc, test_open_defaults);
	tcase_add_test(tc, test_open_sizes);
	tcase_add_test(tc, test_open_bad_config);
	tcase_add_test(tc, test_emu_hooks);
	suite_add_tcase(s, tc);

	tc = tcase("chunks");
	tcase_add_test(tc, test_chunk_create_release);
	tcase_add_test(tc, test_chunk_bad_size);
	tcase_add_test(tc, test_chunk_bad_handle);
	tcase_add_test(tc, test_chunk_coalesce);
	suite_add_tcase(s, tc);

	tc = tcase("capacity");
	tcase_add_test(tc, test_capacity_exhaust_recover);
	tcase_add_test(tc, test_capacity_too_large);
	tcase_add_test(tc, test_capacity_many_chunks);
	suite_add_tcase(s, tc);

	tc = tcase("mappings");
	tcase_add_test(tc, test_map_access_unmap);
	tcase_add_test(tc, test_reserve);
	tcase_add_test(tc, test_va_free_errors);
	tcase_add_test(tc, test_map_errors);
	tcase_add_test(tc, test_unmap_errors);
	tcase_add_test(tc, test_set_access_errors);
	suite_add_tcase(s, tc);

	tc = tcase("stitch");
	tcase_add_test(tc, test_stitch_two_chunks);
	tcase_add_test(tc, test_stitch_reversed);
	suite_add_tcase(s, tc);

	tc = tcase("release");
	tcase_add_test(tc, test_release_mapped_keeps_bytes);
	tcase_add_test(tc, test_release_mapped_twice);
	suite_add_tcase(s, tc);

	tc = tcase("streams");
	tcase_add_test(tc, test_stream_create_destroy);
	tcase_add_test(tc, test_event_basic);
	tcase_add_test(tc, test_hold_keeps_pending);
	tcase_add_test(tc, test_lag_waits_for_host);
	tcase_add_test(tc, test_fifo_order);
	tcase_add_test(tc, test_streams_independent);
	tcase_add_test(tc, test_destroy_drains);
	tcase_add_test(tc, test_event_destroy_pending);
	tcase_add_test(tc, test_sync_blocks_until_released);
	suite_add_tcase(s, tc);

	tc = tcase("memcpy");
	tcase_add_test(tc, test_memcpy_roundtrip);
	tcase_add_test(tc, test_memcpy_errors);
	suite_add_tcase(s, tc);

	tc = tcase("leaks");
	tcase_add_test(tc, test_leak_accounting);
	tcase_add_test(tc, test_close_with_live_objects);
	suite_add_tcase(s, tc);

	tc = tcase("threads");
	tcase_add_test(tc, test_threads);
	suite_add_tcase(s, tc);

	return s;
}

int main(void)
{
	SRunner *sr = srunner_create(emu_suite());
	int failed;

	srunner_run_all(sr, CK_ENV);
	failed = srunner_ntests_failed(sr);
	srunner_free(sr);
	return failed ? 1 : 0;
}
