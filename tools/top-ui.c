/* SPDX-License-Identifier: MIT */
/*
 * gmlake-top's screen: the only module that uses curses. One loop: the
 * curses timeout+getch is the sleep; each pass refreshes the data when the
 * interval is over, then draws the main list, the detail view of one
 * process (with its allocated-versus-reserved history) or the help.
 * ncurses turns SIGWINCH into KEY_RESIZE; SIGINT and SIGTERM set a flag.
 * Keys follow top and htop where they have one: M memory, P activity,
 * N pid, F1/h help, F10/q quit, / or F3 search, \ or F4 filter, d or s
 * the delay; q on the help closes the help.
 */
#ifdef HAVE_CONFIG_H
#include "config.h"
#endif

#include <errno.h>
#include <locale.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "gmlake.h"
#include "top-curses.h"
#include "top.h"

enum view { VIEW_MAIN, VIEW_DETAIL, VIEW_HELP };

struct ui {
	struct top_state *st;
	enum view view, back;
	size_t sel;			/* selected position in st->view */
	uint64_t sel_token;		/* the selected row, kept across */
	uint64_t sel_ctx;		/* sorting and refreshes */
	size_t top;			/* first position shown */
	double delay;
	char search[64];		/* last / text, for n */
	char note[96];			/* one-time message on the last line */
};

static volatile sig_atomic_t quit_flag;

static void on_signal(int sig)
{
	(void)sig;
	quit_flag = 1;
}

/*
 * Sort keys, one letter per column. As in top and htop: M memory
 * (reserved), P the busiest (map calls per second: what stands for CPU
 * here), N pid; R is reserved too.
 */
static const struct {
	int ch, col;
} col_keys[] = {
	{ 'N', COL_PID }, { 'U', COL_USER }, { 'C', COL_CMD },
	{ 'D', COL_DEV }, { 'A', COL_ALLOC }, { 'M', COL_RES },
	{ 'R', COL_RES }, { 'K', COL_PEAK }, { 'F', COL_FRAG },
	{ 'S', COL_STITCH }, { 'P', COL_MAPS }, { 'O', COL_SPILL },
	{ 'B', COL_BW },
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

static struct top_row *sel_row(struct ui *ui)
{
	struct top_state *st = ui->st;

	return ui->sel < st->nview ? &st->rows[st->view[ui->sel]] : NULL;
}

/* Find the selected row again after a refresh re-sorted them. */
static void reselect(struct ui *ui)
{
	struct top_state *st = ui->st;

	for (size_t k = 0; k < st->nview; k++) {
		const struct top_row *r = &st->rows[st->view[k]];

		if (r->token == ui->sel_token && r->s.ctx_id == ui->sel_ctx) {
			ui->sel = k;
			return;
		}
	}
	if (ui->sel >= st->nview)
		ui->sel = st->nview ? st->nview - 1 : 0;
}

static void remember(struct ui *ui)
{
	const struct top_row *r = sel_row(ui);

	if (r) {
		ui->sel_token = r->token;
		ui->sel_ctx = r->s.ctx_id;
	}
}

/* The cells of a line at their columns; COMMAND takes what is left. */
static void draw_cells(int y, char cells[][TOP_CELL], const char *msg)
{
	int x = 0;

	for (int c = 0; c < COL_CMD && x < COLS; c++) {
		mvprintw(y, x, c == COL_USER ? "%-*.*s" : "%*.*s",
			 top_col_width[c], top_col_width[c], cells[c]);
		x += top_col_width[c] + 1;
	}
	if (x < COLS)
		mvaddnstr(y, x, cells[COL_CMD], COLS - x);
	x += (int)strlen(cells[COL_CMD]) + 2;
	if (msg && msg[0] && x < COLS)
		mvaddnstr(y, x, msg, COLS - x);
}

static void draw_header_row(int y, int sort_col, bool rev)
{
	char cells[COL_COUNT][TOP_CELL];

	for (int c = 0; c < COL_COUNT; c++)
		snprintf(cells[c], TOP_CELL, "%s%s", top_col_name(c),
			 c == sort_col ? (rev ? "^" : "v") : "");
	attron(A_REVERSE);
	mvhline(y, 0, ' ', COLS);
	draw_cells(y, cells, NULL);
	attroff(A_REVERSE);
}

static void draw_main(struct ui *ui)
{
	struct top_state *st = ui->st;
	char cells[COL_COUNT][TOP_CELL];
	int y = 0, rows_y, avail;
	time_t t = time(NULL);
	char when[16];

	strftime(when, sizeof(when), "%H:%M:%S", localtime(&t));
	mvprintw(y++, 0, "gmlake-top %s - %s  %zu rows  every %gs  sort: "
		 "%s %s", PACKAGE_VERSION, when, st->nview, ui->delay,
		 top_col_name(st->sort_col), st->sort_reverse ? "asc" : "desc");
	if (st->filter[0])
		printw("  filter: %s", st->filter);
	if (st->skipped)
		printw("  %llu skipped", (unsigned long long)st->skipped);
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
	for (size_t k = ui->top; k < st->nview && y < LINES - 1; k++, y++) {
		const struct top_row *r = &st->rows[st->view[k]];

		top_row_cells(r, cells);
		if (k == ui->sel)
			attron(A_REVERSE);
		if (r->state != TOP_LIVE)
			attron(A_DIM);
		mvhline(y, 0, ' ', COLS);
		draw_cells(y, cells, r->msg);
		attroff(A_REVERSE | A_DIM);
	}
	if (!st->nview)
		mvprintw(rows_y, 0, st->nrows ? "no row matches the filter" :
			 "no gmlake processes (segments in %s)", st->dir);
	if (ui->note[0])
		mvaddnstr(LINES - 1, 0, ui->note, COLS);
	else
		mvaddnstr(LINES - 1, 0, "Enter details  M/P/N sort  / search  "
			  "\\ filter  d delay  F1 help  F10 quit", COLS);
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
	const struct top_row *r = sel_row(ui);
	const struct gmlake_shm_slot *s;
	char a[32], b[32];
	int y = 0, x = 0;
	bool fv;

	if (!r) {
		mvprintw(0, 0, "process gone (Esc: back)");
		return;
	}
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
	top_fmt_bytes(a, sizeof(a), (double)s->resident_bytes);
	KV("resident", "%s", a);
	if (top_frag(r, &fv), fv)
		KV("fragmentation", "%.1f%%", top_frag(r, &fv));
	else
		KV("fragmentation", "%s", "N/A");
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
	mvprintw(LINES - 1, 0, "Esc/Backspace: back  F10/q: quit");
}

static void draw_help(struct ui *ui)
{
	static const char *const lines[] = {
		"gmlake-top: GPU memory of the processes using libgmlake",
		"",
		"  q, F10       quit (on this help: close it)",
		"  h, ?, F1     this help (any key returns)",
		"  Enter        details and history of the selected process",
		"  Esc, Bksp    back to the list",
		"  Up/Down j/k  select a row; PgUp/PgDn a page; Home/End",
		"  / F3         search pid or command; n: next match",
		"  \\ F4         filter rows by pid or command (empty: all)",
		"  d, s         set the refresh delay in seconds",
		"  < >          sort by the column left/right",
		"  r            reverse the sort order",
		"  space        refresh now",
		"",
		"Sort keys: M memory (reserved), P activity (map calls/s),",
		"  N pid, U user, C command, D device, A allocated, R reserved,",
		"  K peak reserved, F fragmentation, S stitched, O spilled,",
		"  B offload bandwidth",
		"",
		"FRAG% is 1 - resident/reserved now, never below 0 (resident:",
		"  allocated less spilled). MAP/s counts mem_map calls.",
		"[gone]: the process ended; its segment is removed when ours.",
	};

	(void)ui;
	for (size_t i = 0; i < sizeof(lines) / sizeof(lines[0]) &&
			   (int)i < LINES; i++)
		mvaddnstr((int)i, 0, lines[i], COLS);
}

/*
 * A line of text typed on the last line: Enter takes it, Esc gives up
 * (false). Blocks; the screen is not refreshed meanwhile.
 */
static bool prompt(const char *label, char *buf, size_t len)
{
	size_t n = 0;
	int ch;

	buf[0] = '\0';
	timeout(-1);
	curs_set(1);
	for (;;) {
		move(LINES - 1, 0);
		clrtoeol();
		mvprintw(LINES - 1, 0, "%s%s", label, buf);
		refresh();
		ch = getch();
		if (ch == '\n' || ch == '\r' || ch == KEY_ENTER)
			break;
		if (ch == 27 || ch == ERR) {
			curs_set(0);
			return false;
		}
		if ((ch == KEY_BACKSPACE || ch == 127 || ch == 8) && n)
			buf[--n] = '\0';
		else if (ch >= 0x20 && ch < 0x7f && n + 1 < len) {
			buf[n++] = (char)ch;
			buf[n] = '\0';
		}
	}
	curs_set(0);
	return true;
}

static bool row_matches(const struct top_row *r, const char *text)
{
	char pid[16];

	snprintf(pid, sizeof(pid), "%d", r->pid);
	return strstr(pid, text) || strcasestr(r->comm, text);
}

/* Select the next row after the selected one that matches ui->search. */
static void search_next(struct ui *ui)
{
	struct top_state *st = ui->st;

	for (size_t i = 1; i <= st->nview; i++) {
		size_t k = (ui->sel + i) % st->nview;

		if (row_matches(&st->rows[st->view[k]], ui->search)) {
			ui->sel = k;
			return;
		}
	}
	snprintf(ui->note, sizeof(ui->note), "no row matches \"%s\"",
		 ui->search);
}

static void ask_delay(struct ui *ui, double *next)
{
	char buf[32], *end;
	double v;

	if (!prompt("delay in seconds (0.05 to 86400): ", buf, sizeof(buf)))
		return;
	errno = 0;
	v = strtod(buf, &end);
	if (errno || end == buf || *end || !(v >= 0.05) || v > 86400) {
		snprintf(ui->note, sizeof(ui->note), "not a delay: \"%s\"",
			 buf);
		return;
	}
	ui->delay = v;
	*next = 0;
}

static bool sort_key(struct ui *ui, int ch)
{
	struct top_state *st = ui->st;

	for (size_t i = 0; i < sizeof(col_keys) / sizeof(col_keys[0]); i++)
		if (ch == col_keys[i].ch) {
			st->sort_col = col_keys[i].col;
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

/* Keys that move the selection; false when ch is none of them. */
static bool move_key(struct ui *ui, int ch)
{
	size_t n = ui->st->nview;

	if ((ch == KEY_DOWN || ch == 'j') && ui->sel + 1 < n)
		ui->sel++;
	else if ((ch == KEY_UP || ch == 'k') && ui->sel > 0)
		ui->sel--;
	else if (ch == KEY_NPAGE)
		ui->sel = ui->sel + 10 < n ? ui->sel + 10 : (n ? n - 1 : 0);
	else if (ch == KEY_PPAGE)
		ui->sel = ui->sel > 10 ? ui->sel - 10 : 0;
	else if (ch == KEY_HOME)
		ui->sel = 0;
	else if (ch == KEY_END)
		ui->sel = n ? n - 1 : 0;
	else
		return ch == KEY_DOWN || ch == KEY_UP || ch == 'j' || ch == 'k';
	return true;
}

/* One key; false to quit. */
static bool key(struct ui *ui, int ch, double *next)
{
	struct top_state *st = ui->st;

	ui->note[0] = '\0';
	if (ui->view == VIEW_HELP) {
		/* any key closes the help, q and F10 too (as in htop) */
		ui->view = ui->back;
		return true;
	}
	if (ch == 'q' || ch == 'Q' || ch == KEY_F(10))
		return false;
	if (ch == 'h' || ch == '?' || ch == KEY_F(1)) {
		ui->back = ui->view;
		ui->view = VIEW_HELP;
	} else if (ch == 27 || ch == KEY_BACKSPACE || ch == 127 ||
		   ch == KEY_LEFT) {
		ui->view = VIEW_MAIN;
	} else if (ch == '\n' || ch == '\r' || ch == KEY_ENTER) {
		ui->view = ui->view == VIEW_DETAIL ? VIEW_MAIN : VIEW_DETAIL;
	} else if (move_key(ui, ch)) {
		;
	} else if (ch == '/' || ch == KEY_F(3)) {
		if (prompt("search: ", ui->search, sizeof(ui->search)) &&
		    ui->search[0])
			search_next(ui);
	} else if (ch == 'n' && ui->search[0]) {
		search_next(ui);
	} else if (ch == '\\' || ch == KEY_F(4)) {
		char buf[sizeof(st->filter)];

		if (prompt("filter (pid or command, empty: all): ", buf,
			   sizeof(buf))) {
			snprintf(st->filter, sizeof(st->filter), "%s", buf);
			remember(ui);
			top_sort(st);
			reselect(ui);
		}
	} else if (ch == 'd' || ch == 's') {
		ask_delay(ui, next);
	} else if (ch == ' ') {
		*next = 0;
	} else if (sort_key(ui, ch)) {
		remember(ui);
		top_sort(st);
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
		double now = mono();
		int ch, ms;

		if (now >= next) {
			top_refresh(st);
			reselect(&ui);
			next = now + ui.delay;
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
		again = key(&ui, ch, &next);
	}
	endwin();
	return 0;
}
