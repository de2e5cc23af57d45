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
 *   corral-agent serve FD
 *       Runs inside the sandbox as pid 1 (bwrap --as-pid-1). Speaks a framed binary
 *       protocol on FD (a socketpair end inherited from the engine): runs commands
 *       with pipes, timeouts and output caps, serves file operations from the
 *       sandbox's own view of the filesystem, and reaps every orphan (it is pid 1).
 *       When FD closes (the engine went away) it exits, which tears down the whole
 *       pid namespace: nothing survives its engine.
 *
 * Why C: a sandbox must start in a few milliseconds and idle in well under a
 * megabyte; a Python agent costs ~12 ms of CPU to start and ~8 MB resident. It is
 * also independent of the image: no interpreter is needed inside.
 *
 * Frame: u32 payload_len | u8 type | u32 request_id | payload (little endian).
 * Payload: a sequence of fields, u8 tag | u32 len | bytes. Integers are u64/i64.
 * protocol.py holds the same numbers; keep the two in step.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* message types: engine -> agent */
enum { M_EXEC = 1, M_STDIN = 2, M_STDIN_CLOSE = 3, M_SIGNAL = 4,
       M_FWRITE = 10, M_FREAD = 11, M_FLIST = 12, M_FSTAT = 13, M_FREMOVE = 14,
       M_FMKDIR = 15, M_PING = 16 };
/* message types: agent -> engine */
enum { RSP_STARTED = 101, RSP_STDOUT = 102, RSP_STDERR = 103, RSP_EXIT = 104, RSP_OK = 105,
       RSP_ERR = 106, RSP_READY = 107 };
/* field tags */
enum { F_ARGV = 1, F_ENV = 2, F_CWD = 3, F_TIMEOUT_MS = 4, F_MAX_OUTPUT = 5, F_STDIN = 6,
       F_STDIN_OPEN = 7, F_PATH = 8, F_DATA = 9, F_MODE = 10, F_PARENTS = 11,
       F_OFFSET = 12, F_LENGTH = 13, F_TRUNCATE = 14, F_RECURSIVE = 15, F_SIGNAL = 16,
       F_PID = 20, F_CODE = 21, F_TIMED_OUT = 22, F_TRUNC_OUT = 23, F_TRUNC_ERR = 24,
       F_DURATION_US = 25, F_ERRNO = 26, F_MESSAGE = 27, F_ENTRY = 28, F_SIZE = 29,
       F_KILLED_BY_SIGNAL = 30 };

#define MAX_EXECS 256
#define READ_CHUNK 65536
#define EXIT_GRACE_MS 50 /* how long to wait for pipe EOF after the command exits */

struct exec_state {
    int used;
    uint32_t id;
    pid_t pid;
    int out_fd, err_fd, in_fd;
    int exited, status;
    uint64_t max_output, out_bytes, err_bytes;
    int trunc_out, trunc_err, timed_out;
    int64_t start_ms, deadline_ms, exit_ms, start_us, exit_us;
    char *stdin_buf;
    size_t stdin_len, stdin_off;
    int stdin_close_after;
};

static int ctl = -1;
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
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                struct pollfd pfd = {fd, POLLOUT, 0};
                poll(&pfd, 1, -1);
                continue;
            }
            _exit(0); /* the engine is gone: nothing left to serve */
        }
        p += w;
        n -= (size_t)w;
    }
}

static void send_frame(uint8_t type, uint32_t id, const struct buf *payload) {
    char hdr[9];
    uint32_t len = payload ? (uint32_t)payload->len : 0;
    memcpy(hdr, &len, 4);
    hdr[4] = (char)type;
    memcpy(hdr + 5, &id, 4);
    write_all(ctl, hdr, 9);
    if (len) write_all(ctl, payload->p, len);
}

static void send_err(uint32_t id, int err, const char *what) {
    struct buf b = {0};
    char msg[512];
    snprintf(msg, sizeof msg, "%s: %s", what, strerror(err));
    field_u64(&b, F_ERRNO, (uint64_t)err);
    field(&b, F_MESSAGE, msg, (uint32_t)strlen(msg));
    send_frame(RSP_ERR, id, &b);
    free(b.p);
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

/* ---------- exec ---------- */

static struct exec_state *find_exec(uint32_t id) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (execs[i].used && execs[i].id == id) return &execs[i];
    return NULL;
}

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static void do_exec(uint32_t id, struct req *r) {
    struct exec_state *e = NULL;
    for (int i = 0; i < MAX_EXECS; i++)
        if (!execs[i].used) { e = &execs[i]; break; }
    if (!e) { send_err(id, EAGAIN, "too many concurrent commands in this sandbox"); return; }
    char **argv = get_list(r, F_ARGV);
    char **envp = get_list(r, F_ENV);
    char *cwd = get_str(r, F_CWD);
    if (!argv[0]) {
        send_err(id, EINVAL, "empty command");
        goto out;
    }
    int in_p[2], out_p[2], err_p[2], report[2];
    if (pipe2(in_p, O_CLOEXEC) || pipe2(out_p, O_CLOEXEC) || pipe2(err_p, O_CLOEXEC) ||
        pipe2(report, O_CLOEXEC)) {
        send_err(id, errno, "pipe");
        goto out;
    }
    pid_t pid = fork();
    if (pid < 0) {
        int err = errno;
        close(in_p[0]); close(in_p[1]); close(out_p[0]); close(out_p[1]);
        close(err_p[0]); close(err_p[1]); close(report[0]); close(report[1]);
        send_err(id, err, "fork");
        goto out;
    }
    if (pid == 0) {
        /* Child: own process group (timeouts kill the whole group), default signals. */
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
        setpgid(0, 0);
        /* The agent runs at oom_score_adj -998 so the OOM killer picks the command,
           not the agent; commands go back to 0 (raising it needs no privilege). */
        int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (oom >= 0) { if (write(oom, "0", 1) < 0) {} close(oom); }
        dup2(in_p[0], 0);
        dup2(out_p[1], 1);
        dup2(err_p[1], 2);
        int stage_err[2];
        if (cwd && chdir(cwd) != 0) {
            stage_err[0] = 1; stage_err[1] = errno;
            if (write(report[1], stage_err, sizeof stage_err) < 0) {}
            _exit(126);
        }
        environ = envp;
        execvp(argv[0], argv);
        /* Like a shell: 127 for "not found", 126 for "cannot execute". */
        int err = errno;
        dprintf(2, "corral: cannot execute '%s': %s\n", argv[0], strerror(err));
        _exit(err == ENOENT ? 127 : 126);
    }
    close(in_p[0]);
    close(out_p[1]);
    close(err_p[1]);
    close(report[1]);
    int stage_err[2];
    ssize_t got = read(report[0], stage_err, sizeof stage_err);
    close(report[0]);
    if (got == (ssize_t)sizeof stage_err) {
        /* chdir failed before exec: a caller error, reported as such. */
        waitpid(pid, NULL, 0);
        close(in_p[1]); close(out_p[0]); close(err_p[0]);
        char what[600];
        snprintf(what, sizeof what, "working directory %s", cwd);
        send_err(id, stage_err[1], what);
        goto out;
    }
    memset(e, 0, sizeof *e);
    e->used = 1;
    e->id = id;
    e->pid = pid;
    e->in_fd = in_p[1];
    e->out_fd = out_p[0];
    e->err_fd = err_p[0];
    set_nonblock(e->in_fd);
    set_nonblock(e->out_fd);
    set_nonblock(e->err_fd);
    e->max_output = get_u64(r, F_MAX_OUTPUT, 1 << 20);
    e->start_ms = now_ms();
    e->start_us = now_us();
    uint64_t tmo = get_u64(r, F_TIMEOUT_MS, 0);
    e->deadline_ms = tmo ? e->start_ms + (int64_t)tmo : 0;
    e->exit_ms = 0;
    const char *sd;
    uint32_t sn;
    if (get_field(r, F_STDIN, &sd, &sn) && sn > 0) {
        e->stdin_buf = malloc(sn);
        memcpy(e->stdin_buf, sd, sn);
        e->stdin_len = sn;
    }
    e->stdin_close_after = !get_field(r, F_STDIN_OPEN, &sd, &sn);
    if (e->stdin_close_after && e->stdin_len == 0) {
        close(e->in_fd);
        e->in_fd = -1;
    }
    struct buf b = {0};
    field_u64(&b, F_PID, (uint64_t)pid);
    send_frame(RSP_STARTED, id, &b);
    free(b.p);
out:
    free_list(argv);
    free_list(envp);
    free(cwd);
}

static void pump_stdin(struct exec_state *e) {
    while (e->in_fd >= 0 && e->stdin_off < e->stdin_len) {
        ssize_t w = write(e->in_fd, e->stdin_buf + e->stdin_off, e->stdin_len - e->stdin_off);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;
            /* EPIPE: the command stopped reading; drop the rest */
            e->stdin_off = e->stdin_len;
            break;
        }
        e->stdin_off += (size_t)w;
    }
    if (e->stdin_off >= e->stdin_len) {
        free(e->stdin_buf);
        e->stdin_buf = NULL;
        e->stdin_len = e->stdin_off = 0;
        if (e->stdin_close_after && e->in_fd >= 0) {
            close(e->in_fd);
            e->in_fd = -1;
        }
    }
}

static void add_stdin(uint32_t id, struct req *r, int close_it) {
    struct exec_state *e = find_exec(id);
    if (!e || e->in_fd < 0) return;
    const char *d;
    uint32_t n;
    if (!close_it && get_field(r, F_DATA, &d, &n) && n) {
        char *nb = realloc(e->stdin_buf, e->stdin_len + n);
        if (!nb) return;
        memcpy(nb + e->stdin_len, d, n);
        e->stdin_buf = nb;
        e->stdin_len += n;
    }
    if (close_it) e->stdin_close_after = 1;
    pump_stdin(e);
}

/* Read what a pipe has; forward up to the cap, count and drop the rest. */
static void drain(struct exec_state *e, int *fd, int is_err) {
    static char chunk[READ_CHUNK];
    for (;;) {
        ssize_t n = read(*fd, chunk, sizeof chunk);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;
            n = 0;
        }
        if (n == 0) {
            close(*fd);
            *fd = -1;
            return;
        }
        uint64_t *count = is_err ? &e->err_bytes : &e->out_bytes;
        int *trunc = is_err ? &e->trunc_err : &e->trunc_out;
        uint64_t room = *count < e->max_output ? e->max_output - *count : 0;
        size_t send = (uint64_t)n < room ? (size_t)n : (size_t)room;
        if (send < (size_t)n) *trunc = 1;
        if (send) {
            struct buf b = {0};
            field(&b, F_DATA, chunk, (uint32_t)send);
            send_frame(is_err ? RSP_STDERR : RSP_STDOUT, e->id, &b);
            free(b.p);
        }
        *count += (uint64_t)n;
    }
}

static void finish(struct exec_state *e) {
    struct buf b = {0};
    int64_t code;
    uint64_t sig = 0;
    if (WIFEXITED(e->status)) {
        code = WEXITSTATUS(e->status);
    } else {
        sig = (uint64_t)WTERMSIG(e->status);
        code = -(int64_t)sig;
    }
    field_u64(&b, F_CODE, (uint64_t)code);
    field_u64(&b, F_KILLED_BY_SIGNAL, sig);
    field_u64(&b, F_TIMED_OUT, (uint64_t)e->timed_out);
    field_u64(&b, F_TRUNC_OUT, (uint64_t)e->trunc_out);
    field_u64(&b, F_TRUNC_ERR, (uint64_t)e->trunc_err);
    field_u64(&b, F_DURATION_US, (uint64_t)(e->exit_us - e->start_us));
    send_frame(RSP_EXIT, e->id, &b);
    free(b.p);
    if (e->out_fd >= 0) close(e->out_fd);
    if (e->err_fd >= 0) close(e->err_fd);
    if (e->in_fd >= 0) close(e->in_fd);
    free(e->stdin_buf);
    memset(e, 0, sizeof *e);
}

static void reap(void) {
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) return;
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec_state *e = &execs[i];
            if (e->used && e->pid == pid && !e->exited) {
                e->exited = 1;
                e->status = status;
                e->exit_ms = now_ms();
                e->exit_us = now_us();
            }
        }
        /* anything else was an orphan reparented to us (we are pid 1): now reaped */
    }
}

/* ---------- files (run as the sandbox user, in the sandbox's view) ---------- */

static void entry(struct buf *b, const char *name, const struct stat *st) {
    struct buf e = {0};
    uint32_t mode = st->st_mode;
    uint64_t size = (uint64_t)st->st_size;
    int64_t mtime = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
    uint32_t uid = st->st_uid, gid = st->st_gid;
    buf_put(&e, &mode, 4);
    buf_put(&e, &size, 8);
    buf_put(&e, &mtime, 8);
    buf_put(&e, &uid, 4);
    buf_put(&e, &gid, 4);
    buf_put(&e, name, strlen(name));
    field(b, F_ENTRY, e.p, (uint32_t)e.len);
    free(e.p);
}

static int mkdirs(const char *path, mode_t mode) {
    char *p = strdup(path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(p, mode) != 0 && errno != EEXIST) { free(p); return -1; }
        *s = '/';
    }
    int rc = mkdir(p, mode);
    free(p);
    return (rc != 0 && errno != EEXIST) ? -1 : 0;
}

static int parent_dirs(const char *path) {
    char *p = strdup(path);
    char *slash = strrchr(p, '/');
    int rc = 0;
    if (slash && slash != p) {
        *slash = 0;
        rc = mkdirs(p, 0755);
    }
    free(p);
    return rc;
}

static void do_fwrite(uint32_t id, struct req *r) {
    char *path = get_str(r, F_PATH);
    const char *d = NULL;
    uint32_t n = 0;
    get_field(r, F_DATA, &d, &n);
    uint64_t off = get_u64(r, F_OFFSET, 0);
    int trunc = (int)get_u64(r, F_TRUNCATE, 1);
    mode_t mode = (mode_t)get_u64(r, F_MODE, 0644);
    if (!path) { send_err(id, EINVAL, "missing path"); return; }
    if (get_u64(r, F_PARENTS, 1) && parent_dirs(path) != 0) {
        send_err(id, errno, path);
        free(path);
        return;
    }
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC | (trunc ? O_TRUNC : 0), mode);
    if (fd < 0) { send_err(id, errno, path); free(path); return; }
    if (trunc) fchmod(fd, mode);
    size_t done = 0;
    while (done < n) {
        ssize_t w = pwrite(fd, d + done, n - done, (off_t)(off + done));
        if (w < 0) {
            if (errno == EINTR) continue;
            int err = errno;
            close(fd);
            send_err(id, err, path);
            free(path);
            return;
        }
        done += (size_t)w;
    }
    if (close(fd) != 0) { send_err(id, errno, path); free(path); return; }
    send_ok(id, NULL);
    free(path);
}

static void do_fread(uint32_t id, struct req *r) {
    char *path = get_str(r, F_PATH);
    if (!path) { send_err(id, EINVAL, "missing path"); return; }
    uint64_t off = get_u64(r, F_OFFSET, 0);
    uint64_t len = get_u64(r, F_LENGTH, 1 << 20);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) { send_err(id, errno, path); if (fd >= 0) close(fd); free(path); return; }
    if (S_ISDIR(st.st_mode)) { close(fd); send_err(id, EISDIR, path); free(path); return; }
    if (len > (64u << 20)) len = 64u << 20;
    char *data = malloc(len ? len : 1);
    size_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, data + got, len - got, (off_t)(off + got));
        if (n < 0) {
            if (errno == EINTR) continue;
            int err = errno;
            close(fd); free(data);
            send_err(id, err, path); free(path);
            return;
        }
        if (n == 0) break;
        got += (size_t)n;
    }
    close(fd);
    struct buf b = {0};
    field_u64(&b, F_SIZE, (uint64_t)st.st_size);
    field(&b, F_DATA, data, (uint32_t)got);
    send_ok(id, &b);
    free(b.p);
    free(data);
    free(path);
}

static void do_flist(uint32_t id, struct req *r) {
    char *path = get_str(r, F_PATH);
    if (!path) { send_err(id, EINVAL, "missing path"); return; }
    DIR *dir = opendir(path);
    if (!dir) { send_err(id, errno, path); free(path); return; }
    struct buf b = {0};
    struct dirent *de;
    while ((de = readdir(dir))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        struct stat st;
        if (fstatat(dirfd(dir), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        entry(&b, de->d_name, &st);
    }
    closedir(dir);
    send_ok(id, &b);
    free(b.p);
    free(path);
}

static void do_fstat(uint32_t id, struct req *r) {
    char *path = get_str(r, F_PATH);
    struct stat st;
    if (!path) { send_err(id, EINVAL, "missing path"); return; }
    if (lstat(path, &st) != 0) { send_err(id, errno, path); free(path); return; }
    struct buf b = {0};
    entry(&b, path, &st);
    send_ok(id, &b);
    free(b.p);
    free(path);
}

static int rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb; (void)ftw;
    return (flag == FTW_DP ? rmdir(p) : unlink(p)) != 0 ? -1 : 0;
}

static void do_fremove(uint32_t id, struct req *r) {
    char *path = get_str(r, F_PATH);
    struct stat st;
    if (!path) { send_err(id, EINVAL, "missing path"); return; }
    int rc;
    if (lstat(path, &st) != 0) rc = -1;
    else if (!S_ISDIR(st.st_mode)) rc = unlink(path);
    else if (get_u64(r, F_RECURSIVE, 0)) rc = nftw(path, rm_one, 32, FTW_DEPTH | FTW_PHYS);
    else rc = rmdir(path);
    if (rc != 0) send_err(id, errno, path);
    else send_ok(id, NULL);
    free(path);
}

static void do_fmkdir(uint32_t id, struct req *r) {
    char *path = get_str(r, F_PATH);
    if (!path) { send_err(id, EINVAL, "missing path"); return; }
    mode_t mode = (mode_t)get_u64(r, F_MODE, 0755);
    int rc = get_u64(r, F_PARENTS, 0) ? mkdirs(path, mode) : mkdir(path, mode);
    if (rc != 0) send_err(id, errno, path);
    else send_ok(id, NULL);
    free(path);
}

static void handle(uint8_t type, uint32_t id, struct req *r) {
    switch (type) {
    case M_EXEC: do_exec(id, r); break;
    case M_STDIN: add_stdin(id, r, 0); break;
    case M_STDIN_CLOSE: add_stdin(id, r, 1); break;
    case M_SIGNAL: {
        /* id 0 signals every running command (a graceful stop) */
        int sig = (int)get_u64(r, F_SIGNAL, SIGKILL);
        for (int i = 0; i < MAX_EXECS; i++)
            if (execs[i].used && !execs[i].exited && (id == 0 || execs[i].id == id))
                kill(-execs[i].pid, sig);
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

static int serve(int fd) {
    ctl = fd;
    set_nonblock(ctl);
    /* SIGCHLD through a signalfd: the poll loop sees exits without async handlers. */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGPIPE);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    fcntl(ctl, F_SETFD, FD_CLOEXEC);
    send_frame(RSP_READY, 0, NULL);

    struct buf in = {0};
    struct pollfd pfds[2 + 3 * MAX_EXECS];
    struct { struct exec_state *e; int which; } owner[2 + 3 * MAX_EXECS];
    for (;;) {
        int n = 0;
        pfds[n++] = (struct pollfd){ctl, POLLIN, 0};
        pfds[n++] = (struct pollfd){sfd, POLLIN, 0};
        int64_t now = now_ms(), wake = -1;
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec_state *e = &execs[i];
            if (!e->used) continue;
            if (e->out_fd >= 0) { owner[n].e = e; owner[n].which = 1; pfds[n++] = (struct pollfd){e->out_fd, POLLIN, 0}; }
            if (e->err_fd >= 0) { owner[n].e = e; owner[n].which = 2; pfds[n++] = (struct pollfd){e->err_fd, POLLIN, 0}; }
            if (e->in_fd >= 0 && e->stdin_len > e->stdin_off) { owner[n].e = e; owner[n].which = 3; pfds[n++] = (struct pollfd){e->in_fd, POLLOUT, 0}; }
            int64_t t = -1;
            if (!e->exited && e->deadline_ms) t = e->deadline_ms;
            if (e->exited) t = e->exit_ms + EXIT_GRACE_MS;
            if (t >= 0 && (wake < 0 || t < wake)) wake = t;
        }
        int timeout = wake < 0 ? -1 : (int)(wake > now ? wake - now : 0);
        int rc = poll(pfds, (nfds_t)n, timeout);
        if (rc < 0 && errno != EINTR) return 1;
        if (rc > 0) {
            if (pfds[0].revents & (POLLIN | POLLHUP | POLLERR)) {
                char tmp[65536];
                for (;;) {
                    ssize_t got = read(ctl, tmp, sizeof tmp);
                    if (got < 0 && errno == EINTR) continue;
                    if (got < 0 && errno == EAGAIN) break;
                    if (got <= 0) return 0; /* engine closed the channel: exit, ending the sandbox */
                    buf_put(&in, tmp, (size_t)got);
                }
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
                struct signalfd_siginfo si;
                while (read(sfd, &si, sizeof si) > 0) {}
                reap();
            }
            for (int i = 2; i < n; i++) {
                if (!pfds[i].revents) continue;
                struct exec_state *e = owner[i].e;
                if (!e->used) continue;
                if (owner[i].which == 1 && e->out_fd == pfds[i].fd) drain(e, &e->out_fd, 0);
                else if (owner[i].which == 2 && e->err_fd == pfds[i].fd) drain(e, &e->err_fd, 1);
                else if (owner[i].which == 3 && e->in_fd == pfds[i].fd) pump_stdin(e);
            }
        }
        reap();
        now = now_ms();
        for (int i = 0; i < MAX_EXECS; i++) {
            struct exec_state *e = &execs[i];
            if (!e->used) continue;
            if (!e->exited && e->deadline_ms && now >= e->deadline_ms) {
                e->timed_out = 1;
                kill(-e->pid, SIGKILL); /* the whole process group */
                kill(e->pid, SIGKILL);
                e->deadline_ms = 0;
            }
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

/* ---------- launch (host side) ---------- */

struct launch_opts {
    uid_t uid;
    gid_t gid;
    rlim_t nofile;
    const char *rootdir, *lower;
    unsigned long disk_mb;
    const char *owned[16];
    int n_owned;
    char **prog;
};

static int die(const char *what, const char *arg) {
    fprintf(stderr, "corral-agent launch: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", strerror(errno));
    return 111;
}

/* Parse options up to "--"; returns -1 on a bad option. Joins cgroups as it goes. */
static int parse_launch(int argc, char **argv, struct launch_opts *o, int *ready) {
    int i = 0;
    for (; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--")) { o->prog = argv + i + 1; return 0; }
        if (!strcmp(a, "--ready")) { *ready = 1; continue; }
        if (i + 1 >= argc) break;
        const char *v = argv[++i];
        if (!strcmp(a, "--cgroup")) {
            int fd = open(v, O_WRONLY | O_CLOEXEC);
            if (fd < 0 || dprintf(fd, "%d\n", getpid()) < 0) return die("cannot join cgroup", v), -1;
            close(fd);
        } else if (!strcmp(a, "--uid")) o->uid = (uid_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--gid")) o->gid = (gid_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--nofile")) o->nofile = (rlim_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--rootdir")) o->rootdir = v;
        else if (!strcmp(a, "--lower")) o->lower = v;
        else if (!strcmp(a, "--disk-mb")) o->disk_mb = strtoul(v, NULL, 10);
        else if (!strcmp(a, "--owned") && o->n_owned < 16) o->owned[o->n_owned++] = v;
        else { fprintf(stderr, "corral-agent launch: unknown option %s\n", a); return -1; }
    }
    return 0;
}

/* mkdir -p of PATH (absolute, in the sandbox) under UPPER; the last part gets uid/gid. */
static int make_owned(const char *upper, const char *path, uid_t uid, gid_t gid) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s%s", upper, path) >= (int)sizeof buf) { errno = ENAMETOOLONG; return -1; }
    size_t base = strlen(upper);
    for (char *s = buf + base + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *s = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
    return chown(buf, uid, gid);
}

/*
 * The sandbox's root lives in a mount namespace of its own, made here: the host's
 * mount table never grows with the number of sandboxes (every bwrap start copies the
 * whole table, and mount(2) serialises on it), and when the last process of the
 * sandbox exits the kernel drops the mounts by itself: a crash cannot leak them.
 *   ROOTDIR/rw    tmpfs of disk_mb: the cap on everything the sandbox writes
 *   ROOTDIR/root  overlay: LOWER read-only, rw/upper private and writable
 */
static int mount_root(const struct launch_opts *o) {
    char rw[4096], upper[4200], work[4200], root[4096], path[4300], data[16384];
    if (unshare(CLONE_NEWNS) != 0) return die("unshare", "mount namespace");
    /* Nothing mounted here may propagate back to the host. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return die("make mounts private", NULL);
    snprintf(rw, sizeof rw, "%s/rw", o->rootdir);
    snprintf(root, sizeof root, "%s/root", o->rootdir);
    snprintf(data, sizeof data, "size=%lum,mode=0711", o->disk_mb ? o->disk_mb : 1024);
    if (mount("corral-rw", rw, "tmpfs", MS_NOSUID | MS_NODEV, data) != 0) return die("mount tmpfs on", rw);
    snprintf(upper, sizeof upper, "%s/upper", rw);
    snprintf(work, sizeof work, "%s/work", rw);
    if (mkdir(upper, 0755) != 0 || mkdir(work, 0700) != 0) return die("mkdir", upper);
    /* The root directory belongs to the sandbox user (it may create /app); the
       image's own files stay root's, which the sandbox sees as nobody. */
    if (chown(upper, o->uid, o->gid) != 0) return die("chown", upper);
    snprintf(path, sizeof path, "%s/.corral", upper);
    if (mkdir(path, 0755) != 0) return die("mkdir", path);
    snprintf(path, sizeof path, "%s/.corral/agent", upper);
    int fd = open(path, O_WRONLY | O_CREAT | O_CLOEXEC, 0755); /* the agent's mount point */
    if (fd < 0) return die("create", path);
    close(fd);
    for (int i = 0; i < o->n_owned; i++)
        if (make_owned(upper, o->owned[i], o->uid, o->gid) != 0) return die("mkdir", o->owned[i]);
    if (snprintf(data, sizeof data, "lowerdir=%s,upperdir=%s,workdir=%s", o->lower, upper, work) >= (int)sizeof data) {
        errno = E2BIG;
        return die("overlay options for", root);
    }
    if (mount("corral-root", root, "overlay", MS_NOSUID | MS_NODEV, data) != 0) return die("mount overlay on", root);
    return 0;
}

/* Read NUL-separated arguments from stdin until EOF. */
static char **read_args(int *count) {
    struct buf b = {0};
    char tmp[8192];
    for (;;) {
        ssize_t n = read(0, tmp, sizeof tmp);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return NULL;
        if (n == 0) break;
        buf_put(&b, tmp, (size_t)n);
    }
    if (b.len == 0) return NULL; /* the engine went away before using us */
    buf_put(&b, "", 1);
    int c = 0;
    for (size_t k = 0; k < b.len - 1; k++) if (b.p[k] == 0) c++;
    if (b.p[b.len - 2] != 0) c++;
    char **out = calloc((size_t)c + 2, sizeof(char *));
    int j = 0;
    for (size_t k = 0; k < b.len - 1;) {
        out[j++] = b.p + k;
        k += strlen(b.p + k) + 1;
    }
    *count = j;
    return out;
}

/*
 * With --ready the launcher is made ahead of time (a warm slot): it joins its cgroups
 * at once, says "R" on stdout and waits for the rest of its options on stdin. Joining
 * a cgroup v1 hierarchy can wait ~10 ms for an RCU grace period; a warm slot pays that
 * before anyone asks for a sandbox.
 */
static int launch(int argc, char **argv) {
    struct launch_opts o = {.uid = (uid_t)-1, .gid = (gid_t)-1};
    int ready = 0;
    if (parse_launch(argc - 2, argv + 2, &o, &ready) != 0) return 111;
    if (ready) {
        if (write(1, "R", 1) != 1) return 111;
        int n = 0;
        char **more = read_args(&n);
        if (!more) return 0;
        int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
        dup2(null, 0);
        dup2(2, 1); /* closes the ready pipe; bwrap's messages go to the log */
        if (parse_launch(n, more, &o, &ready) != 0) return 111;
    }
    if (!o.prog || !o.prog[0]) { fprintf(stderr, "corral-agent launch: missing program\n"); return 111; }
    if (o.rootdir && (!o.lower || mount_root(&o) != 0)) return 111;
    /* Inherited by bwrap and the agent: under memory pressure the kernel kills the
       sandbox's command, and the agent survives to report the OOM. */
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom >= 0) { if (write(oom, "-998", 4) < 0) {} close(oom); }
    if (o.nofile) {
        struct rlimit rl = {o.nofile, o.nofile};
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) return die("setrlimit", NULL);
    }
    if (o.gid != (gid_t)-1 && (setgroups(0, NULL) != 0 || setresgid(o.gid, o.gid, o.gid) != 0))
        return die("setgid", NULL);
    if (o.uid != (uid_t)-1 && setresuid(o.uid, o.uid, o.uid) != 0) return die("setuid", NULL);
    execv(o.prog[0], o.prog);
    return die("exec", o.prog[0]);
}

int main(int argc, char **argv) {
    if (argc >= 3 && !strcmp(argv[1], "serve")) return serve(atoi(argv[2]));
    if (argc >= 2 && !strcmp(argv[1], "launch")) return launch(argc, argv);
    fprintf(stderr, "usage: corral-agent serve FD | launch [--ready] [--cgroup F]... [--uid N] [--gid N] [--nofile N]\n"
                    "         [--rootdir D --lower L1:L2 --disk-mb N --owned P...] -- PROG ARGS\n");
    return 2;
}
