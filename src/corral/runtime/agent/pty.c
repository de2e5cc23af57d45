/*
 * corral-agent, pseudo-terminals: part of agent.c (a unity build: agent.c includes this
 * file before exec.c, so both share its statics).
 *
 * An EXEC with F_ROWS and F_COLS runs its command on a new pseudo-terminal of the
 * sandbox's own devpts instance (bwrap --dev mounts one per sandbox: /dev/pts, with
 * ptmxmode=666). The command becomes a session leader with the terminal as its
 * controlling tty and stdin, stdout and stderr on it; the agent keeps the master:
 * what the command writes comes back as STDOUT frames (a terminal has one output
 * stream), STDIN bytes are typed into it (Ctrl-C is byte 0x03: the line discipline
 * turns it into SIGINT for the foreground job), RESIZE sets its size (the kernel
 * sends SIGWINCH), and STDIN_CLOSE types the terminal's end-of-file character (a
 * shell at its prompt exits), since closing the master would hang the terminal up
 * and lose what the command still writes.
 *
 * Why this is safe for the agent: the master is opened through the devpts mount
 * itself (/dev/pts/ptmx, checked to be devpts), never through /dev/ptmx, a symlink in
 * the sandbox-owned /dev that sandbox code can replace with a FIFO; the slave comes
 * from TIOCGPTPEER, with no path at all; both are O_NOCTTY, so the agent (a session
 * leader) never gets a controlling terminal; the master is non-blocking like every
 * pipe the agent reads. The terminal is the sandbox's own: nothing outside the
 * sandbox reads it, and seccomp refuses TIOCSTI and TIOCLINUX (runtime/seccomp.py).
 *
 * In exec.c the terminal takes the place of the three pipes (pty_pipes), so the poll
 * loop, output caps, timeouts and exit reporting are the same for both.
 */
#include <sys/ioctl.h>
#include <termios.h>

#ifndef TIOCGPTPEER
#define TIOCGPTPEER _IO('T', 0x41)
#endif
#ifndef DEVPTS_SUPER_MAGIC
#define DEVPTS_SUPER_MAGIC 0x1cd1
#endif

#define PTY_MAX_SIDE 65535 /* struct winsize holds unsigned shorts */

/* Does the request ask for a terminal? 1 (and its size in *ws), 0, or -1 if its size
   is not one a terminal can have. */
static int pty_wanted(struct req *r, struct winsize *ws) {
    const char *d;
    uint32_t n;
    int has_rows = get_field(r, F_ROWS, &d, &n), has_cols = get_field(r, F_COLS, &d, &n);
    if (!has_rows && !has_cols) return 0;
    uint64_t rows = get_u64(r, F_ROWS, 0), cols = get_u64(r, F_COLS, 0);
    if (rows < 1 || rows > PTY_MAX_SIDE || cols < 1 || cols > PTY_MAX_SIDE) return -1;
    memset(ws, 0, sizeof *ws);
    ws->ws_row = (unsigned short)rows;
    ws->ws_col = (unsigned short)cols;
    return 1;
}

/*
 * A new terminal in the shape of do_exec's three pipes, so that its child and its
 * poll loop need no change: the child's ends (in_p[0], out_p[1], err_p[1]) are copies
 * of the slave, the agent's are the master for output (out_p[0]) and a copy of it for
 * input (in_p[1]); err_p[0] is -1 (no stderr stream). All close-on-exec. On failure
 * returns -1 with errno set and nothing left open.
 */
static int pty_pipes(const struct winsize *ws, int in_p[2], int out_p[2], int err_p[2]) {
    int fds[5] = {-1, -1, -1, -1, -1}; /* master, master copy, slave x3 */
    int err = 0;
    fds[0] = open("/dev/pts/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC | O_NONBLOCK);
    if (fds[0] < 0) return -1;
    struct statfs sfs;
    struct stat st;
    if (fstatfs(fds[0], &sfs) != 0 || sfs.f_type != DEVPTS_SUPER_MAGIC ||
        fstat(fds[0], &st) != 0 || !S_ISCHR(st.st_mode)) {
        err = ENOTTY;
        goto fail;
    }
    int unlock = 0;
    struct termios t;
    if (ioctl(fds[0], TIOCSPTLCK, &unlock) != 0 || ioctl(fds[0], TIOCSWINSZ, ws) != 0) goto fail;
    /* UTF-8 aware erase in canonical mode (a backspace removes a whole character) */
    if (tcgetattr(fds[0], &t) == 0) {
        t.c_iflag |= IUTF8;
        tcsetattr(fds[0], TCSANOW, &t);
    }
    fds[2] = ioctl(fds[0], TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (fds[2] < 0) goto fail;
    fds[1] = fcntl(fds[0], F_DUPFD_CLOEXEC, 3);
    fds[3] = fcntl(fds[2], F_DUPFD_CLOEXEC, 3);
    fds[4] = fcntl(fds[2], F_DUPFD_CLOEXEC, 3);
    if (fds[1] < 0 || fds[3] < 0 || fds[4] < 0) goto fail;
    out_p[0] = fds[0];
    in_p[1] = fds[1];
    in_p[0] = fds[2];
    out_p[1] = fds[3];
    err_p[1] = fds[4];
    err_p[0] = -1;
    return 0;
fail:
    if (!err) err = errno;
    for (int i = 0; i < 5; i++)
        if (fds[i] >= 0) close(fds[i]);
    errno = err;
    return -1;
}

/* In the child, before exec: a session of its own with the terminal as its
   controlling tty (without one, no Ctrl-C, no job control, no /dev/tty). */
static void pty_session(int slave) {
    if (setsid() < 0 || ioctl(slave, TIOCSCTTY, 0) != 0) {
        dprintf(slave, "corral: cannot make the terminal the controlling one: %s\n",
                strerror(errno));
        _exit(126);
    }
}

/* The master of an exec's terminal while the agent holds it, or -1. */
static int pty_master(const struct exec_state *e) {
    if (!e->pty) return -1;
    return e->out_fd >= 0 ? e->out_fd : e->in_fd;
}

/* STDIN_CLOSE on a terminal: queue its end-of-file character after what was typed. */
static void pty_queue_eof(struct exec_state *e) {
    struct termios t;
    char eof = 4; /* Ctrl-D, unless the terminal says otherwise */
    int fd = pty_master(e);
    if (fd >= 0 && tcgetattr(fd, &t) == 0 && t.c_cc[VEOF] != _POSIX_VDISABLE) eof = (char)t.c_cc[VEOF];
    char *nb = realloc(e->stdin_buf, e->stdin_len + 1);
    if (!nb) return;
    nb[e->stdin_len++] = eof;
    e->stdin_buf = nb;
}

/* RESIZE: the terminal's new size; the kernel sends SIGWINCH to its foreground job. */
static void pty_resize(uint32_t id, struct req *r) {
    struct exec_state *e = find_exec(id);
    struct winsize ws;
    int fd = e ? pty_master(e) : -1;
    if (fd < 0 || pty_wanted(r, &ws) != 1) return; /* the engine checked it already */
    ioctl(fd, TIOCSWINSZ, &ws);
}
