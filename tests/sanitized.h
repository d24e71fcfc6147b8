/* SPDX-License-Identifier: MIT */
/*
 * TH_ASAN: defined when the test is built with AddressSanitizer (gcc's
 * macro, clang's feature test). Tests that cannot run under it (a fork
 * while gcc 12's sanitizer allocator holds a lock) or that scale down
 * under it (tests/stress.c) ask here.
 */
#ifndef GML_TEST_SANITIZED_H
#define GML_TEST_SANITIZED_H

#if defined(__SANITIZE_ADDRESS__)
#define TH_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TH_ASAN 1
#endif
#endif

#endif
