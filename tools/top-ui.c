/* SPDX-License-Identifier: MIT */
/*
 * gmlake-top's screen: the only module that uses curses. One loop: the
 * curses timeout+getch is the sleep; each pass refreshes the data when the
 * interval is over, then draws the main list, the detail view of one
 * process (with its allocated-versus-reserved history) or the help.
 * ncurses turns SIGWINCH into KEY_RESIZE; SIGINT and SIGTERM set a flag.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <locale.h>
#include <signal.h>
#include <string.h>
#include <time.h>

#include "gmlake.h"
#include "top-curses.h"
#include "top.h"

enum view { VIEW_MAIN, VIEW_DETAIL, VIEW_HELP };

struct ui {
	struct top_state *st;
	enum view view, back;
	size_t sel;			/* selected row index */
	int sel_pid;			/* kept across sorting */
	uint64_t sel_ctx;
	size_t top;			/* first row shown */
	double delay;
};

static volatile sig_atomic_t quit_flag;

static void on_signal(int sig)
{
	(void)sig;
	quit_flag = 1;
}

/* Sort keys: one letter per column. */
static const char col_keys[COL_COUNT] = {
	'P', 'U', 'C', 'D', 'A', 'R', 'K', 'F', 'S', 'M', 'O', 'B',
};

static double mono(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static void draw_line(void *arg, const char *s)
{
	int *y = arg;

	if (*y < LINES - 1)
		mvaddnstr((*y)++, 0, s, COLS);
}

/* Find the selected row again after a refresh re-sorted them. */
static void reselect(struct ui *ui)
{
	struct top_state *st = ui->st;

	for (size_t i = 0; i < st->nrows; i++)
		if (st->rows[i].pid == ui->sel_pid &&
		    st->rows[i].s.ctx_id == ui->sel_ctx) {
			ui->sel = i;
			return;
		}
	if (ui->sel >= st->nrows)
		ui->sel = st->nrows ? st->nrows - 1 : 0;
}

static void remember(struct ui *ui)
{
	if (ui->sel < ui->st->nrows) {
		ui->sel_pid = ui->st->rows[ui->sel].pid;
		ui->sel_ctx = ui->st->rows[ui->sel].s.ctx_id;
	}
}

static void draw_header_row(int y, int sort_col, bool rev)
{
	int x = 0;

	attron(A_REVERSE);
	mvhline(y, 0, ' ', COLS);
	for (int c = 0; c < COL_COUNT && x < COLS; c++) {
		char name[24];

		snprintf(name, sizeof(name), "%s%s", top_col_name(c),
			 c == sort_col ? (rev ? "^" : "v") : "");
		if (c == sort_col)
			attron(A_BOLD);
		mvprintw(y, x, c == COL_USER || c == COL_CMD ? "%-*.*s" :
			 "%*.*s", top_col_width[c], top_col_width[c], name);
		if (c == sort_col)
			attroff(A_BOLD);
		x += top_col_width[c] + 1;
	}
	attroff(A_REVERSE);
}

static void draw_main(struct ui *ui)
{
	struct top_state *st = ui->st;
	char cells[COL_COUNT][48];
	int y = 0, rows_y, avail;
	time_t t = time(NULL);
	char when[16];

	strftime(when, sizeof(when), "%H:%M:%S", localtime(&t));
	mvprintw(y++, 0, "gmlake-top %s - %s  %zu rows  every %gs  sort: "
		 "%s %s  (h: help, q: quit)", PACKAGE_VERSION, when, st->nrows,
		 ui->delay, top_col_name(st->sort_col),
		 st->sort_reverse ? "asc" : "desc");
	top_gpu_lines(st, draw_line, &y);
	y++;
	draw_header_row(y++, st->sort_col, st->sort_reverse);
	rows_y = y;
	avail = LINES - 1 - rows_y;
	if (avail < 1)
		return;
	if (ui->sel < ui->top)
		ui->top = ui->sel;
	if (ui->sel >= ui->top + (size_t)avail)
		ui->top = ui->sel - (size_t)avail + 1;
	for (size_t i = ui->top; i < st->nrows && y < LINES - 1; i++, y++) {
		int x = 0;

		top_row_cells(&st->rows[i], cells);
		if (i == ui->sel)
			attron(A_REVERSE);
		if (st->rows[i].state != TOP_LIVE)
			attron(A_DIM);
		mvhline(y, 0, ' ', COLS);
		for (int c = 0; c < COL_COUNT && x < COLS; c++) {
			mvprintw(y, x, c == COL_USER || c == COL_CMD ?
				 "%-*.*s" : "%*.*s", top_col_width[c],
				 top_col_width[c], cells[c]);
			x += top_col_width[c] + 1;
		}
		if (st->rows[i].msg[0] && x < COLS)
			mvaddnstr(y, x, st->rows[i].msg, COLS - x);
		attroff(A_REVERSE | A_DIM);
	}
	if (!st->nrows)
		mvprintw(rows_y, 0, "no gmlake processes (segments in %s)",
			 st->dir);
	mvprintw(LINES - 1, 0, "Enter: details  arrows: select  </>: sort "
		 "column  r: reverse  h: help  q: quit");
}

/* allocated ('#') under reserved (':'), newest sample at the right. */
static void draw_chart(const struct top_row *r, int y0, int h, int w)
{
	unsigned n = r->hist_len < (unsigned)w ? r->hist_len : (unsigned)w;
	int64_t max = 1;
	char top[32];

	if (h < 3 || w < 10)
		return;
	for (unsigned i = 0; i < n; i++) {
		unsigned k = (r->hist_head + TOP_HISTORY - n + i) % TOP_HISTORY;

		if (r->hist_res[k] > max)
			max = r->hist_res[k];
		if (r->hist_alloc[k] > max)
			max = r->hist_alloc[k];
	}
	top_fmt_bytes(top, sizeof(top), (double)max);
	mvprintw(y0, 0, "allocated (#) vs reserved (:), last %u samples, "
		 "top of scale %s", n, top);
	for (unsigned i = 0; i < n; i++) {
		unsigned k = (r->hist_head + TOP_HISTORY - n + i) % TOP_HISTORY;
		int ha = (int)((double)r->hist_alloc[k] * (h - 1) / max + 0.5);
		int hr = (int)((double)r->hist_res[k] * (h - 1) / max + 0.5);

		for (int j = 0; j < h - 1; j++) {
			char ch = j < ha ? '#' : j < hr ? ':' : ' ';

			mvaddch(y0 + h - 1 - j, 8 + (int)i, ch);
		}
	}
	mvprintw(y0 + 1, 0, "%7s", top);
	mvprintw(y0 + h - 1, 0, "%7s", "0");
}

#define KV(label, fmt, ...)						\
	do {								\
		if (y < LINES - 1)					\
			mvprintw(y, x, "%-16s " fmt, label, __VA_ARGS__); \
		if (x) { x = 0; y++; } else { x = COLS / 2; }		\
	} while (0)

static void draw_detail(struct ui *ui)
{
	const struct top_row *r;
	const struct gmlake_shm_slot *s;
	char a[32], b[32];
	int y = 0, x = 0;
	bool fv;

	if (ui->sel >= ui->st->nrows) {
		mvprintw(0, 0, "process gone (Esc: back)");
		return;
	}
	r = &ui->st->rows[ui->sel];
	s = &r->s;
	mvprintw(y++, 0, "PID %d  %s  user %s  device %d (%s)  context %llu"
		 "  %s", r->pid, r->comm, r->user, s->device,
		 s->backend == GMLAKE_BACKEND_EMU ? "emu" : "cuda",
		 (unsigned long long)s->ctx_id,
		 r->state == TOP_LIVE ? "live" : r->msg);
	y++;
	top_fmt_bytes(a, sizeof(a), (double)s->allocated_bytes);
	top_fmt_bytes(b, sizeof(b), (double)s->allocated_peak);
	KV("allocated", "%s (peak %s)", a, b);
	top_fmt_bytes(a, sizeof(a), (double)s->reserved_bytes);
	top_fmt_bytes(b, sizeof(b), (double)s->reserved_peak);
	KV("reserved", "%s (peak %s)", a, b);
	top_fmt_bytes(a, sizeof(a), (double)s->requested_bytes);
	KV("requested", "%s", a);
	KV("fragmentation", "%.1f%%", top_frag(r, &fv));
	KV("active blocks", "%lld", (long long)s->active_blocks);
	KV("chunks", "%lld", (long long)s->chunks);
	KV("stitched live", "%lld", (long long)s->stitched_live);
	KV("stitched cached", "%lld", (long long)s->stitched_cached);
	KV("allocs/frees", "%llu/%llu", (unsigned long long)s->allocs,
	   (unsigned long long)s->frees);
	KV("stitches/reuses", "%llu/%llu", (unsigned long long)s->stitches,
	   (unsigned long long)s->stitch_reuses);
	KV("map calls", "%llu (%.0f/s)", (unsigned long long)s->map_calls,
	   r->rates_valid ? r->maps_per_s : 0.0);
	KV("ooms", "%llu", (unsigned long long)s->ooms);
	top_fmt_bytes(a, sizeof(a), (double)s->spilled_bytes);
	KV("spilled", "%s in %lld blocks", a, (long long)s->spilled_blocks);
	top_fmt_bytes(a, sizeof(a), r->rates_valid ? r->offload_bps : 0);
	KV("offload", "%s/s", a);
	if (x)
		y++;
	y++;
	draw_chart(r, y, LINES - 2 - y, COLS - 10);
	mvprintw(LINES - 1, 0, "Esc/Backspace: back  q: quit");
}

static void draw_help(struct ui *ui)
{
	static const char *const lines[] = {
		"gmlake-top: GPU memory of the processes using libgmlake",
		"",
		"  q            quit",
		"  h, ?         this help (any key returns)",
		"  Enter        details and history of the selected process",
		"  Esc, Bksp    back to the list",
		"  Up/Down j/k  select a row; PgUp/PgDn a page",
		"  < >          sort by the column left/right",
		"  r            reverse the sort order",
		"  space        refresh now",
		"",
		"Sort keys: P pid, U user, C command, D device, A allocated,",
		"  R reserved, K peak reserved, F fragmentation, S stitched,",
		"  M maps/s, O spilled, B offload bandwidth",
		"",
		"FRAG% is 1 - allocated/reserved. MAPS/s counts mem_map calls.",
		"[gone]: the process died; its segment is removed when it is ours.",
	};

	(void)ui;
	for (size_t i = 0; i < sizeof(lines) / sizeof(lines[0]) &&
			   (int)i < LINES; i++)
		mvaddnstr((int)i, 0, lines[i], COLS);
}

static bool sort_key(struct ui *ui, int ch)
{
	struct top_state *st = ui->st;

	for (int c = 0; c < COL_COUNT; c++)
		if (ch == col_keys[c]) {
			st->sort_col = c;
			return true;
		}
	if (ch == '<' || ch == '>') {
		st->sort_col = (st->sort_col + (ch == '<' ? COL_COUNT - 1 : 1)) %
			       COL_COUNT;
		return true;
	}
	if (ch == 'r') {
		st->sort_reverse = !st->sort_reverse;
		return true;
	}
	return false;
}

/* One key; false to quit. */
static bool key(struct ui *ui, int ch, bool *refresh_now)
{
	size_t n = ui->st->nrows;

	if (ch == 'q' || ch == 'Q')
		return false;
	if (ui->view == VIEW_HELP) {
		ui->view = ui->back;
		return true;
	}
	if (ch == 'h' || ch == '?') {
		ui->back = ui->view;
		ui->view = VIEW_HELP;
	} else if (ch == 27 || ch == KEY_BACKSPACE || ch == 127 ||
		   ch == KEY_LEFT) {
		ui->view = VIEW_MAIN;
	} else if (ch == '\n' || ch == '\r' || ch == KEY_ENTER) {
		ui->view = ui->view == VIEW_DETAIL ? VIEW_MAIN : VIEW_DETAIL;
	} else if ((ch == KEY_DOWN || ch == 'j') && ui->sel + 1 < n) {
		ui->sel++;
	} else if ((ch == KEY_UP || ch == 'k') && ui->sel > 0) {
		ui->sel--;
	} else if (ch == KEY_NPAGE) {
		ui->sel = ui->sel + 10 < n ? ui->sel + 10 : (n ? n - 1 : 0);
	} else if (ch == KEY_PPAGE) {
		ui->sel = ui->sel > 10 ? ui->sel - 10 : 0;
	} else if (ch == ' ') {
		*refresh_now = true;
	} else if (sort_key(ui, ch)) {
		remember(ui);
		top_sort(ui->st);
		reselect(ui);
	}
	remember(ui);
	return true;
}

static void draw(struct ui *ui)
{
	erase();
	if (ui->view == VIEW_HELP)
		draw_help(ui);
	else if (ui->view == VIEW_DETAIL)
		draw_detail(ui);
	else
		draw_main(ui);
	refresh();
}

int top_ui_run(struct top_state *st, double delay)
{
	struct ui ui = { .st = st, .delay = delay };
	struct sigaction sa;
	double next = 0;
	bool again = true;

	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_signal;
	sigaction(SIGINT, &sa, NULL);
	sigaction(SIGTERM, &sa, NULL);
	setlocale(LC_ALL, "");
	if (!initscr())
		return -1;
	cbreak();
	noecho();
	keypad(stdscr, TRUE);
	set_escdelay(25);
	curs_set(0);
	while (again && !quit_flag) {
		bool refresh_now = false;
		double now = mono();
		int ch, ms;

		if (now >= next) {
			top_refresh(st);
			reselect(&ui);
			next = now + delay;
		}
		draw(&ui);
		ms = (int)((next - mono()) * 1000);
		timeout(ms < 1 ? 1 : ms);
		ch = getch();
		if (ch == ERR)
			continue;
		if (ch == KEY_RESIZE) {
			clear();
			continue;
		}
		again = key(&ui, ch, &refresh_now);
		if (refresh_now)
			next = 0;
	}
	endwin();
	return 0;
}
