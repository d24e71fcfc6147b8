/* SPDX-License-Identifier: MIT */
/* The one place that picks the wide-character curses header. */
#ifndef GML_TOP_CURSES_H
#define GML_TOP_CURSES_H

#if defined(HAVE_NCURSESW_CURSES_H) || __has_include(<ncursesw/curses.h>)
#include <ncursesw/curses.h>
#else
#include <curses.h>
#endif

#endif
