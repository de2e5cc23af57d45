/*
 * corral-agent: the process that lives inside every sandbox.
 *
 * Two modes in one static binary:
 *
 *   corral-agent launch --cgroup FILE... --uid N --gid N --nofile N -- PROGRAM ARGS...
 *       Runs on the host. Joins the sandbox's cgroups (writes its own pid to each
 *       cgroup.procs file), drops to the sandbox's unprivileged host uid/gid, sets
 *       RLIMIT_NOFILE and execs PROGRAM (bubblewrap). Joining before exec means every
 *       process bwrap forks is born inside the limits: there is no window in which a
 *       sandboxed process runs outside its cgroup.
 *
 *   corral-agent serve FD [REATTACH_FD]
 *       Runs inside the sandbox as pid 1 (bwrap --as-pid-1). Speaks a framed binary
 *       protocol on FD (a socketpair end inherited from the engine): runs commands
 *       with pipes (or a pseudo-terminal), timeouts and output caps, serves file
 *       operations from the sandbox's own view of the filesystem, and reaps every
 *       orphan (it is pid 1).
 *       Without REATTACH_FD: when FD closes (the engine went away) it exits, which
 *       tears down the whole pid namespace.
 *       With REATTACH_FD (a SOCK_SEQPACKET socketpair end whose other end the
 *       engine's warden holds, see runtime/warden.py): when FD closes the agent
 *       *detaches* instead: its commands keep running (and their own timeouts keep
 *       firing) but are forgotten by id (their output is read and dropped, their
 *       stdin closed), and it waits on REATTACH_FD for one message carrying a new
 *       control socket (SCM_RIGHTS) from the next engine, on which it says READY
 *       again. When REATTACH_FD closes (the warden gave up: no engine came back) it
 *       exits: nothing survives both its engine and its warden. Only a holder of the
 *       other end can reattach it: a descriptor, never a path or a secret that
 *       sandbox code could find.
 *
 *   corral-agent serve FD REATTACH_FD local
 *       A checkpointable sandbox (docs/live.md): the agent first makes both channels
 *       again *inside* the sandbox's network namespace, sends the engine their other
 *       ends over FD (one byte 'L', SCM_RIGHTS: control, reattach) and closes FD and
 *       REATTACH_FD, so CRIU finds every socket it holds in the namespaces it dumps.
 *
 * The agent is the trust boundary inside the sandbox: the code it runs is written by
 * a model optimised to earn reward, with the same uid as the agent. So the agent is
 * not dumpable (its memory, /proc/1/fd, pidfd_getfd, process_vm_* and kcmp are closed
 * to a same-uid process without CAP_SYS_PTRACE), none of its descriptors reaches a
 * command, it has no signal handler (pid 1 of a pid namespace gets no signal from
 * inside that it has no handler for; SIGCHLD is read through a signalfd and only
 * makes it reap), and its file operations never block: a FIFO, socket, device, lease
 * or /proc file where a file is expected is refused, and a recursive remove runs in
 * a child, so a huge tree or one deeper than any stack costs neither the loop nor
 * the agent; a command is started without waiting for its exec (sandbox code can
 * SIGSTOP the child in between).
 *
 * Why C: a sandbox must start in a few milliseconds and idle in well under a
 * megabyte; a Python agent costs ~12 ms of CPU to start and ~8 MB resident. It is
 * also independent of the image: no interpreter is needed inside.
 *
 * One translation unit: this file (protocol, hardening, main loop) includes exec.c
 * (commands), pty.c (commands on a pseudo-terminal), files.c (file operations) and
 * launch.c (launch mode).
 *
 * Frame: u32 payload_len | u8 type | u32 request_id | payload (little endian).
 * Payload: a sequence of fields, u8 tag | u32 len | bytes. Integers are u64/i64.
 * protocol.py holds the same numbers; keep the two in step.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#ifndef OPEN_TREE_CLONE /* musl: the new mount API is in the kernel's header only */
#include <linux/mount.h>
#endif
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <linux/capability.h>
#include <time.h>
#include <unistd.h>
#include <linux/loop.h>
#include <linux/magic.h>

#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif

/* message types: engine -> agent */
enum { M_EXEC = 1, M_STDIN = 2, M_STDIN_CLOSE = 3, M_SIGNAL = 4, M_RESIZE = 5,
       M_FWRITE = 10, M_FREAD = 11, M_FLIST = 12, M_FSTAT = 13, M_FREMOVE = 14,
       M_FMKDIR = 15, M_PING = 16 };
/* message types: agent -> engine */
enum { RSP_STARTED = 101, RSP_STDOUT = 102, RSP_STDERR = 103, RSP_EXIT = 104, RSP_OK = 105,
       RSP_ERR = 106, RSP_READY = 107, RSP_TAIL = 108 };
/* field tags */
enum { F_ARGV = 1, F_ENV = 2, F_CWD = 3, F_TIMEOUT_MS = 4, F_MAX_OUTPUT = 5, F_STDIN = 6,
       F_STDIN_OPEN = 7, F_PATH = 8, F_DATA = 9, F_MODE = 10, F_PARENTS = 11,
       F_OFFSET = 12, F_LENGTH = 13, F_TRUNCATE = 14, F_RECURSIVE = 15, F_SIGNAL = 16,
       F_PID = 20, F_CODE = 21, F_TIMED_OUT = 22, F_TRUNC_OUT = 23, F_TRUNC_ERR = 24,
       F_DURATION_US = 25, F_ERRNO = 26, F_MESSAGE = 27, F_ENTRY = 28, F_SIZE = 29,
       F_KILLED_BY_SIGNAL = 30, F_OUTPUT_TAIL = 31, F_STREAM = 32, F_DROPPED = 33,
       F_ROWS = 34, F_COLS = 35, F_UID = 36, F_QUIET_START = 37 };

#define MAX_EXECS 256
#define READ_CHUNK 65536
#define EXIT_GRACE_MS 50 /* how long to wait for pipe EOF after the command exits */
#define MAX_READ (64u << 20) /* the most one file read request allocates */
#define MAX_JOBS 16
#define JOB_TIMEOUT_MS 300000 /* a file job (a recursive remove) that runs longer is killed */

struct tail_ring { char *p; uint64_t cap, pos, len; };

struct exec_state {
    int used;
    uint32_t id;
    pid_t pid;
    int out_fd, err_fd, in_fd;
    int exited, status;
    uint64_t max_output, out_bytes, err_bytes;
    struct tail_ring tail[2]; /* stdout, stderr: the end of what went over the head (exec.c) */
    int trunc_out, trunc_err, timed_out;
    int64_t start_ms, deadline_ms, exit_ms, start_us, exit_us;
    char *stdin_buf;
    size_t stdin_len, stdin_off;
    int stdin_close_after;
    int report_fd; /* until the child has exec'd (EOF) or failed to chdir (errno) */
    int failed;    /* it failed before exec: an error was sent, no exit will be */
    int pty;       /* on a pseudo-terminal (pty.c): out_fd and in_fd are its master */
    int quiet_start; /* F_QUIET_START: no STARTED frame (the engine waits for none) */
    char *cwd;
};

static int ctl = -1;
static int reattach = -1; /* see "serve" above; -1: none, exit with the engine */
static int ctl_dead;      /* the engine's end is gone: detach at the top of the loop */
/* The agent's own oom_score_adj, opened before it stops being dumpable (then the file
   is root's): commands are forked at COMMAND_OOM_SCORE_ADJ (fork_command in exec.c). */
static int oom_fd = -1;
static char oom_agent[16];
/* The signals harden() set to SIG_IGN: the only dispositions a command's child must
   put back to SIG_DFL before exec (a caught one would be reset by execve itself, but
   the agent catches none), and what a file job's child ignores (see harden). A bit
   mask (bit S-1 for signal S), not a sigset_t: libc's sigaddset refuses the signals
   it keeps for itself (32 and 33 in glibc), and those can be inherited ignored too. */
static uint64_t agent_ignored;
/* Signals the agent ignores even as pid 1: those it can raise on itself or that the
   terminal code acts on when ignored (SIGTTIN reads fail with EIO, no stop). */
static const int always_ignored[] = {SIGHUP, SIGPIPE, SIGTTIN, SIGTTOU, SIGTSTP, SIGXFSZ};
static size_t oom_agent_len;
static struct exec_state execs[MAX_EXECS];

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* ---------- output buffer and framing ---------- */

struct buf { char *p; size_t len, cap; };

static void buf_reserve(struct buf *b, size_t extra) {
    if (b->len + extra <= b->cap) return;
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + extra) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) _exit(70);
    b->p = p;
    b->cap = cap;
}

static void buf_put(struct buf *b, const void *data, size_t n) {
    buf_reserve(b, n);
    memcpy(b->p + b->len, data, n);
    b->len += n;
}

static void field(struct buf *b, uint8_t tag, const void *data, uint32_t n) {
    buf_put(b, &tag, 1);
    buf_put(b, &n, 4);
    buf_put(b, data, n);
}

static void field_u64(struct buf *b, uint8_t tag, uint64_t v) { field(b, tag, &v, 8); }

static void write_all(int fd, const char *p, size_t n) {
    if (fd < 0 || ctl_dead) return; /* detached: nobody to tell */
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                struct pollfd pfd = {fd, POLLOUT, 0};
                poll(&pfd, 1, -1);
                continue;
            }
            if (reattach < 0) _exit(0); /* the engine is gone: nothing left to serve */
            ctl_dead = 1; /* detach at the top of the loop; drop the rest meanwhile */
            return;
        }
        p += w;
        n -= (size_t)w;
    }
}

static void send_frame(uint8_t type, uint32_t id, const struct buf *payload) {
    /* Id 0 is never a request's (READY excepted): a command or job of an engine
       that went away, forgotten at the detach; its frames go nowhere. */
    if (id == 0 && type != RSP_READY) return;
    char hdr[9];
    uint32_t len = payload ? (uint32_t)payload->len : 0;
    memcpy(hdr, &len, 4);
    hdr[4] = (char)type;
    memcpy(hdr + 5, &id, 4);
    /* Header and payload in one write where the socket has room: a sandbox frozen for a
       checkpoint is then never between the two, which would leave its copies' agents
       the end of a frame whose start went to the original's engine (live_processes). */
    if (ctl < 0 || ctl_dead) return;
    struct iovec iov[2] = {{hdr, 9}, {len ? payload->p : NULL, len}};
    ssize_t w;
    do w = writev(ctl, iov, len ? 2 : 1); while (w < 0 && errno == EINTR);
    size_t done = w > 0 ? (size_t)w : 0; /* an error: write_all below says what to do */
    if (done < 9) write_all(ctl, hdr + done, 9 - done);
    if (len && done < 9 + (size_t)len)
        write_all(ctl, payload->p + (done > 9 ? done - 9 : 0), len - (done > 9 ? done - 9 : 0));
}

/* An error with a message of our own (no strerror appended). */
static void send_err_msg(uint32_t id, int err, const char *msg) {
    struct buf b = {0};
    field_u64(&b, F_ERRNO, (uint64_t)err);
    field(&b, F_MESSAGE, msg, (uint32_t)strlen(msg));
    send_frame(RSP_ERR, id, &b);
    free(b.p);
}

static void send_err(uint32_t id, int err, const char *what) {
    char msg[1024];
    snprintf(msg, sizeof msg, "%s: %s", what, strerror(err));
    send_err_msg(id, err, msg);
}

static void send_ok(uint32_t id, struct buf *b) { send_frame(RSP_OK, id, b); }

/* ---------- request parsing ---------- */

struct req {
    const char *p;
    size_t len;
};

/* Iterate fields: returns 1 and fills tag/data/n while fields remain. */
static int next_field(struct req *r, size_t *off, uint8_t *tag, const char **data, uint32_t *n) {
    if (*off + 5 > r->len) return 0;
    *tag = (uint8_t)r->p[*off];
    memcpy(n, r->p + *off + 1, 4);
    if (*off + 5 + *n > r->len) return 0;
    *data = r->p + *off + 5;
    *off += 5 + *n;
    return 1;
}

static int get_field(struct req *r, uint8_t want, const char **data, uint32_t *n) {
    size_t off = 0;
    uint8_t tag;
    while (next_field(r, &off, &tag, data, n))
        if (tag == want) return 1;
    return 0;
}

static uint64_t get_u64(struct req *r, uint8_t want, uint64_t dflt) {
    const char *d;
    uint32_t n;
    uint64_t v;
    if (!get_field(r, want, &d, &n) || n != 8) return dflt;
    memcpy(&v, d, 8);
    return v;
}

/* A NUL-terminated copy of a string field (caller frees), or NULL. */
static char *get_str(struct req *r, uint8_t want) {
    const char *d;
    uint32_t n;
    if (!get_field(r, want, &d, &n)) return NULL;
    return strndup(d, n);
}

static char **get_list(struct req *r, uint8_t want) {
    size_t off = 0, count = 0;
    uint8_t tag;
    const char *d;
    uint32_t n;
    while (next_field(r, &off, &tag, &d, &n))
        if (tag == want) count++;
    char **out = calloc(count + 1, sizeof(char *));
    off = 0;
    count = 0;
    while (next_field(r, &off, &tag, &d, &n))
        if (tag == want) out[count++] = strndup(d, n);
    return out;
}

static void free_list(char **l) {
    if (!l) return;
    for (char **p = l; *p; p++) free(*p);
    free(l);
}

static struct exec_state *find_exec(uint32_t id);

/* Signal a command's process group. The child makes its group (or, on a terminal, its
   session) first thing, but a SIGNAL read right behind its EXEC can come before the
   child has run: then there is no group yet, and nothing the command started either,
   so the child alone is signalled (a kill(-pid) that failed with ESRCH was lost, and a
   command whose client left at once ran on to its timeout). */
static void kill_group(pid_t pid, int sig) {
    if (kill(-pid, sig) < 0 && errno == ESRCH) kill(pid, sig);
}

#include "pty.c"
#include "exec.c"
#include "files.c"

static void handle(uint8_t type, uint32_t id, struct req *r) {
    switch (type) {
    case M_EXEC: do_exec(id, r); break;
    case M_STDIN: add_stdin(id, r, 0); break;
    case M_STDIN_CLOSE: add_stdin(id, r, 1); break;
    case M_RESIZE: pty_resize(id, r); break;
    case M_SIGNAL: {
        /* id 0 signals every running command (a graceful stop) */
        int sig = (int)get_u64(r, F_SIGNAL, SIGKILL);
        for (int i = 0; i < MAX_EXECS; i++)
            if (execs[i].used && !execs[i].exited && (id == 0 || execs[i].id == id))
                kill_group(execs[i].pid, sig);
        break;
    }
    case M_FWRITE: do_fwrite(id, r); break;
    case M_FREAD: do_fread(id, r); break;
    case M_FLIST: do_flist(id, r); break;
    case M_FSTAT: do_fstat(id, r); break;
    case M_FREMOVE: do_fremove(id, r); break;
    case M_FMKDIR: do_fmkdir(id, r); break;
    case M_PING: send_ok(id, NULL); break;
    default: send_err(id, ENOSYS, "unknown request");
    }
}

/* ---------- main loop ---------- */

/*
 * Before anything of the sandbox runs: make the agent unreachable from it.
 * - Not dumpable: /proc/1/mem, /proc/1/fd, /proc/1/environ, pidfd_getfd,
 *   process_vm_readv/writev and kcmp need CAP_SYS_PTRACE over a non-dumpable process,
 *   even for the same uid; sandbox code has no capability. (Forked children inherit
 *   it until they exec a command.)
 * - No descriptor but stdin/stdout/stderr, the control channel and its own
 *   oom_score_adj, all close-on-exec or replaced in a command.
 * - No signal handler: the kernel drops every signal sent from inside the pid namespace
 *   to its pid 1 unless pid 1 handles it (SIGKILL and SIGSTOP included). Everything is
 *   ignored but SIGCHLD, which stays blocked and is read from a signalfd: a forged one
 *   only makes the agent call waitpid.
 */
static int harden(int fd, int keep) {
    int lo = fd, hi = keep > fd ? keep : fd;
    if (keep >= 0 && keep < lo) lo = keep;
    /* close everything but FD and KEEP (at most two ranges around them, and between) */
    if (lo > 3) syscall(SYS_close_range, 3U, (unsigned)lo - 1, 0U);
    if (keep >= 0 && hi - lo > 1) syscall(SYS_close_range, (unsigned)(lo + 1 < 3 ? 3 : lo + 1), (unsigned)hi - 1, 0U);
    syscall(SYS_close_range, (unsigned)(hi < 3 ? 3 : hi + 1), ~0U, 0U);
    oom_fd = open("/proc/self/oom_score_adj", O_RDWR | O_CLOEXEC);
    ssize_t n = oom_fd >= 0 ? pread(oom_fd, oom_agent, sizeof oom_agent - 1, 0) : -1;
    while (n > 0 && (oom_agent[n - 1] == '\n' || oom_agent[n - 1] == 0)) n--;
    if (n > 0) oom_agent_len = (size_t)n;
    else if (oom_fd >= 0) { close(oom_fd); oom_fd = -1; }
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0) return -1;
    if (fcntl(fd, F_SETFD, FD_CLOEXEC) != 0) return -1;
    if (keep >= 0 && fcntl(keep, F_SETFD, FD_CLOEXEC) != 0) return -1;
    /* As pid 1 of its pid namespace (always, in a sandbox) a signal left at SIG_DFL is
       dropped as if ignored: the kernel marks the namespace's init SIGNAL_UNKILLABLE
       and discards every default-action signal to it but SIGKILL/SIGSTOP from an
       ancestor namespace, and faults are forced either way. So only ALWAYS_IGNORED
       needs SIG_IGN there, and each command's child resets those few instead of all
       64 (issue 30: one rt_sigaction each, before every exec). Run as anything else
       (a test driving the binary directly), it ignores everything as before. */
    agent_ignored = 0;
    if (getpid() == 1) {
        for (size_t k = 0; k < sizeof always_ignored / sizeof *always_ignored; k++)
            agent_ignored |= SIG_BIT(always_ignored[k]);
        /* "every other disposition is SIG_DFL" (fork_command) must hold whatever the
           agent inherited: SIG_IGN survives execve, and a daemon started by a process
           that ignores a signal (a CI runner ignores 32) hands it down through bwrap. */
        default_inherited_ignored(agent_ignored);
    } else {
        for (int s = 1; s < NSIG && s <= 64; s++)
            if (s != SIGCHLD && s != SIGKILL && s != SIGSTOP) agent_ignored |= SIG_BIT(s);
    }
    ignore_all(agent_ignored);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    return sigprocmask(SIG_SETMASK, &chld, NULL);
}

/*
 * The engine's end of the control socket is gone (its daemon stopped or died) and a
 * warden holds the reattach socket: forget every request by id (their frames would
 * name ids the next engine never sent), keep the commands running (their output is
 * read and dropped, their own timeouts still fire; a pipe's stdin gets EOF, as
 * nobody can write to it any more), and drop what was half read.
 */
static void detach_keeping(struct buf *in, const uint32_t *keep, size_t nkeep, int kill_rest) {
    close(ctl);
    ctl = -1;
    ctl_dead = 0;
    in->len = 0;
    for (int i = 0; i < MAX_EXECS; i++) {
        struct exec_state *e = &execs[i];
        if (!e->used) continue;
        int kept = 0;
        for (size_t k = 0; k < nkeep && !kept; k++) kept = e->id != 0 && e->id == keep[k];
        if (kept) continue;
        /* A restored checkpoint's command nobody adopted: an exec the engine answered
           when it checkpointed the sandbox (or a live fork's copy of the parent's):
           killed, never left running unowned with no deadline kept by the host. */
        if (kill_rest && !e->exited) kill_group(e->pid, SIGKILL);
        e->id = 0;
        free(e->stdin_buf);
        e->stdin_buf = NULL;
        e->stdin_len = e->stdin_off = 0;
        if (!e->pty && e->in_fd >= 0) { close(e->in_fd); e->in_fd = -1; }
    }
    for (int i = 0; i < MAX_JOBS; i++) jobs[i].id = 0;
}

static void detach(struct buf *in) { detach_keeping(in, NULL, 0, 0); }

/*
 * One message on the reattach socket: a new control socket (SCM_RIGHTS) from the
 * engine that took over ('C'), or a new control and a new reattach socket ('R': made
 * in the sandbox's own namespaces for a restored checkpoint, docs/live.md). After 'R'
 * come the ids (u32 each) of the commands the restoring engine adopts (the processes
 * it knew running at the checkpoint): they keep their id, stdin and output on the new
 * socket; every other request is forgotten as at a detach, and its command killed
 * (nobody will read it, and the host keeps no deadline for it). What was half read
 * from the old socket is dropped either way. 1 when attached, 0 for anything else
 * (ignored), -1 at EOF.
 */
static int take_ctl(struct buf *in) {
    char msg[1 + 4 * MAX_EXECS], cbuf[CMSG_SPACE(sizeof(int) * 4)];
    struct iovec iov = {msg, sizeof msg};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t n = recvmsg(reattach, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0) return (errno == EAGAIN || errno == EINTR) ? 0 : -1;
    if (n == 0) return -1;
    char byte = msg[0];
    uint32_t keep[MAX_EXECS];
    size_t nkeep = byte == 'R' ? (size_t)(n - 1) / 4 : 0;
    memcpy(keep, msg + 1, nkeep * 4);
    int got = -1, swap = -1; /* 'R': a new reattach socket too (a restored checkpoint's) */
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int nfds = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int k = 0; k < nfds; k++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
            if (got < 0 && (byte == 'C' || byte == 'R')) got = fd;
            else if (swap < 0 && byte == 'R') swap = fd;
            else close(fd);
        }
    }
    if (got >= 0 && byte == 'R' && swap < 0) { close(got); got = -1; } /* both or none */
    if (got < 0) { if (swap >= 0) close(swap); return 0; }
    if (swap >= 0) { close(reattach); reattach = swap; }
    /* A restored copy's: what it sent on the control socket CRIU gave it (output it had
       read before the freeze) is read by the engine up to this READY, then dropped. */
    if (byte == 'R' && ctl >= 0) send_frame(RSP_READY, 0, NULL);
    /* an engine that took over while the old end lingered; a restored copy's */
    if (ctl >= 0) detach_keeping(in, keep, nkeep, byte == 'R');
    ctl = got;
    ctl_dead = 0;
    set_nonblock(ctl);
    send_frame(RSP_READY, 0, NULL);
    return 1;
}

/* See "serve FD REATTACH_FD local" above: new channels, made in our namespaces. */
static int localize(int *fd, int *keep) {
    int c[2], r[2];
    if (*keep < 0 || socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, c) != 0) return -1;
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, r) != 0) return -1;
    char byte = 'L', cbuf[CMSG_SPACE(sizeof(int) * 2)];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {&byte, 1};
    struct msghdr mh = {0};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * 2);
    int ends[2] = {c[1], r[1]};
    memcpy(CMSG_DATA(cm), ends, sizeof ends);
    ssize_t n;
    do n = sendmsg(*fd, &mh, MSG_NOSIGNAL); while (n < 0 && errno == EINTR);
    if (n != 1) return -1;
    close(c[1]);
    close(r[1]);
    close(*fd);
    close(*keep);
    *fd = c[0];
    *keep = r[0];
    return 0;
}

static int serve(int fd, int keep, int local) {
    if (harden(fd, keep) != 0 || (local && localize(&fd, &keep) != 0)) {
        fprintf(stderr, "corral-agent serve: cannot protect the agent: %s\n", strerror(errno));
        return 1;
    }
    reattach = keep;
    /* The root's capabilities (if bwrap gave any) stay permitted only: exec.c, become()
       (an image build step's agent is root itself and keeps them effective) */
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 ||
        (getuid() != 0 && set_caps(1) != 0)) {
        fprintf(stderr, "corral-agent serve: cannot set its capabilities: %s\n", strerror(errno));
        return 1;
    }
    /* The outer bwrap (outside our pid namespace) is our parent: a kill of it from the
       host ends the sandbox (it no longer dies with the daemon: see "serve" above). */
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    ctl = fd;
    set_nonblock(ctl);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    /* SIGCHLD through a signalfd: the poll loop sees exits without async handlers. */
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0) {
        fprintf(stderr, "corral-agent serve: signalfd: %s\n", strerror(errno));
        return 1;
    }
    send_frame(RSP_READY, 0, NULL);

    struct buf in = {0};
    struct pollfd pfds[3 + 4 * MAX_EXECS];
    struct { struct exec_state *e; int which; } owner[3 + 4 * MAX_EXECS];
    for (;;) {
        /* The control socket failed. A restored copy's agent may write to the one CRIU
           gave it before it reads the 'R' already waiting for it (the engine closes
           that socket once 'R' is sent): take 'R' first, so the commands it names are
           kept, not forgotten. */
        if (ctl_dead) {
            int took = take_ctl(&in);
            if (took < 0) return 0;
            if (took == 0) detach(&in);
        }
        int n = 0;
        /* pfds[0] is the control socket (fd -1 while detached: poll skips it) */
        pfds[n++] = (struct pollfd){ctl, POLLIN, 0};
        pfds[n++] = (struct pollfd){sfd, POLLIN, 0};
        pfds[n++] = (struct pollfd){reattach, POLLIN, 0};
        int64_t now = now_ms(), wake = -1;
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec_state *e = &execs[i];
            if (!e->used) continue;
            if (e->report_fd >= 0) { owner[n].e = e; owner[n].which = 4; pfds[n++] = (struct pollfd){e->report_fd, POLLIN, 0}; }
            else if (e->out_fd >= 0) { owner[n].e = e; owner[n].which = 1; pfds[n++] = (struct pollfd){e->out_fd, POLLIN, 0}; }
            if (e->err_fd >= 0 && e->report_fd < 0) { owner[n].e = e; owner[n].which = 2; pfds[n++] = (struct pollfd){e->err_fd, POLLIN, 0}; }
            if (e->in_fd >= 0 && e->stdin_len > e->stdin_off) { owner[n].e = e; owner[n].which = 3; pfds[n++] = (struct pollfd){e->in_fd, POLLOUT, 0}; }
            int64_t t = -1;
            if (!e->exited && e->deadline_ms) t = e->deadline_ms;
            if (e->exited) t = e->exit_ms + EXIT_GRACE_MS;
            if (t >= 0 && (wake < 0 || t < wake)) wake = t;
        }
        int64_t job_wake = check_jobs(now);
        if (job_wake >= 0 && (wake < 0 || job_wake < wake)) wake = job_wake;
        int timeout = wake < 0 ? -1 : (int)(wake > now ? wake - now : 0);
        int rc = poll(pfds, (nfds_t)n, timeout);
        if (rc < 0 && errno != EINTR) return 1;
        if (rc > 0) {
            /* The reattach socket first: a restoring engine sends 'R' and then closes
               the control socket CRIU gave the agent, and its hang-up must not detach
               the commands 'R' keeps. New channels: poll again. */
            if (pfds[2].revents & (POLLIN | POLLHUP | POLLERR)) {
                /* EOF: the warden let go, no engine will ever come back: end. */
                int took = take_ctl(&in);
                if (took < 0) return 0;
                if (took > 0) continue;
            }
            if (pfds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
                char tmp[65536];
                for (;;) {
                    ssize_t got = read(ctl, tmp, sizeof tmp);
                    if (got < 0 && errno == EINTR) continue;
                    if (got < 0 && errno == EAGAIN) break;
                    if (got <= 0) {
                        if (reattach < 0) return 0; /* engine closed the channel: exit, ending the sandbox */
                        ctl_dead = 1; /* wait for the next engine on the reattach socket */
                        break;
                    }
                    buf_put(&in, tmp, (size_t)got);
                }
                if (ctl_dead) continue;
                size_t off = 0;
                while (in.len - off >= 9) {
                    uint32_t len, id;
                    memcpy(&len, in.p + off, 4);
                    memcpy(&id, in.p + off + 5, 4);
                    if (in.len - off < 9 + (size_t)len) break;
                    struct req r = {in.p + off + 9, len};
                    handle((uint8_t)in.p[off + 4], id, &r);
                    off += 9 + len;
                }
                memmove(in.p, in.p + off, in.len - off);
                in.len -= off;
            }
            if (pfds[1].revents & POLLIN) {
                /* One read empties it (SIGCHLD is not queued twice; a later one wakes
                   the poll again); the reap below, every turn, does the waiting. */
                struct signalfd_siginfo si[4];
                if (read(sfd, si, sizeof si) < 0) {}
            }
            for (int i = 3; i < n; i++) {
                if (!pfds[i].revents) continue;
                struct exec_state *e = owner[i].e;
                if (!e->used) continue;
                if (owner[i].which == 1 && e->out_fd == pfds[i].fd) drain(e, &e->out_fd, 0);
                else if (owner[i].which == 2 && e->err_fd == pfds[i].fd) drain(e, &e->err_fd, 1);
                else if (owner[i].which == 3 && e->in_fd == pfds[i].fd) pump_stdin(e);
                else if (owner[i].which == 4 && e->report_fd == pfds[i].fd) check_start(e);
            }
        }
        reap();
        now = now_ms();
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec_state *e = &execs[i];
            if (!e->used) continue;
            if (!e->exited && e->deadline_ms && now >= e->deadline_ms) {
                e->timed_out = 1;
                kill_group(e->pid, SIGKILL); /* the whole process group */
                kill(e->pid, SIGKILL);
                e->deadline_ms = 0;
            }
            if (e->exited && e->report_fd >= 0) check_start(e); /* EOF or errno by now */
            if (e->exited) {
                /* Output first, then the exit. Background children may hold the pipes
                   open: past a short grace period we stop waiting for their EOF. */
                if (e->out_fd >= 0) drain(e, &e->out_fd, 0);
                if (e->err_fd >= 0) drain(e, &e->err_fd, 1);
                if ((e->out_fd < 0 && e->err_fd < 0) || now >= e->exit_ms + EXIT_GRACE_MS)
                    finish(e);
            }
        }
    }
}

#include "netns.c"
#include "clean.c"
#include "launch.c"

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[1], "serve")) return serve(atoi(argv[2]), argc >= 4 ? atoi(argv[3]) : -1,
                                                                   argc >= 5 && !strcmp(argv[4], "local"));
    if (argc >= 2 && !strcmp(argv[1], "launch")) return launch(argc, argv);
    fprintf(stderr, "usage: corral-agent serve FD [REATTACH_FD [local]] | launch [--ready] [--cgroup F]... [--uid N] [--gid N] [--nofile N]\n"
                    "         [--rootdir D --lower L1:L2 --disk-mb N --owned P...] -- PROG ARGS\n");
    return 2;
}
