/*
 * corral-agent, commands: part of agent.c (a unity build: agent.c includes this file,
 * so it shares its statics). Runs commands with pipes, timeouts and output caps, and
 * reaps every child (the agent is pid 1).
 */

/* ---------- exec ---------- */

static struct exec_state *find_exec(uint32_t id) {
    for (int i = 0; i < MAX_EXECS; i++)
        if (execs[i].used && execs[i].id == id) return &execs[i];
    return NULL;
}

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

/*
 * Users (docs/users.md). A sandbox's user namespace maps two ids: 1000, the agent's
 * own, and 0, its root (each an unprivileged host uid of its own). The agent holds
 * the root's capabilities in its permitted set only (never effective: its file
 * operations are the sandbox user's; never inheritable or ambient: nothing it starts
 * gets them by default). In a command's child, before exec:
 *   uid 1000  every capability dropped (permitted too): an ordinary user;
 *   uid 0     ids set to 0 (which makes the permitted set effective): the root of the
 *             namespace with those capabilities only, no_new_privs and the seccomp
 *             filter still on; outside the namespace, an unprivileged host uid.
 * An image build step as root (rootbuild.py) has an agent that is root itself, with
 * its capabilities effective (as before users existed): its commands run as root.
 */
static int set_caps(int keep_permitted) {
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    if (syscall(SYS_capget, &h, d) != 0) return -1;
    for (int k = 0; k < 2; k++) {
        d[k].effective = d[k].inheritable = 0;
        if (!keep_permitted) d[k].permitted = 0;
    }
    return (int)syscall(SYS_capset, &h, d);
}

static int become(uint64_t uid) {
    uid_t me = getuid();
    if (uid == (uint64_t)me && me != 0) return set_caps(0);
    if (uid != 0) { errno = EINVAL; return -1; }
    /* raise what is permitted so that the id changes are allowed */
    struct __user_cap_header_struct h = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct d[2];
    if (syscall(SYS_capget, &h, d) != 0) return -1;
    d[0].effective = d[0].permitted;
    d[1].effective = d[1].permitted;
    if (syscall(SYS_capset, &h, d) != 0) return -1;
    if (me == 0) return 0; /* an image build step as root: the agent is root already */
    gid_t zero = 0;
    if (setgroups(1, &zero) != 0 || setresgid(0, 0, 0) != 0 || setresuid(0, 0, 0) != 0) {
        if (errno == EINVAL) errno = EPERM; /* 0 is not mapped here */
        return -1;
    }
    return 0;
}

#define COMMAND_OOM_SCORE_ADJ "1000"

#define SIG_BIT(s) (UINT64_C(1) << ((s) - 1))

/* The kernel's struct sigaction for rt_sigaction(2), called directly: libc's
   sigaction() refuses the signals it keeps for itself (32 and 33 in glibc, 32-34 in
   musl), yet those can be inherited ignored and must be reset like any other. */
struct kernel_sigaction {
    void (*handler)(int);
    unsigned long flags;
    void (*restorer)(void);
    uint64_t mask;
};

static int set_disposition(int s, void (*handler)(int)) {
    struct kernel_sigaction act = {.handler = handler};
    return (int)syscall(SYS_rt_sigaction, s, &act, NULL, sizeof act.mask);
}

/* SIG_IGN for every signal in SET (the agent's own, or a file job's: see harden). */
static void ignore_all(uint64_t set) {
    for (int s = 1; s <= 64; s++)
        if (set & SIG_BIT(s)) set_disposition(s, SIG_IGN);
}

/* SIG_DFL for every signal the agent inherited ignored but KEEP does not name. Read
   from /proc/self/status (SigIgn: one read, not a query per signal); without it,
   each signal is asked. */
static void default_inherited_ignored(uint64_t keep) {
    uint64_t inherited = 0;
    char buf[4096];
    int fd = open("/proc/self/status", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, buf, sizeof buf - 1) : -1;
    if (fd >= 0) close(fd);
    char *at = NULL;
    if (n > 0) {
        buf[n] = 0;
        at = strstr(buf, "\nSigIgn:\t");
    }
    if (at) {
        inherited = strtoull(at + 9, NULL, 16);
    } else {
        for (int s = 1; s <= 64; s++) {
            struct kernel_sigaction old;
            if (syscall(SYS_rt_sigaction, s, NULL, &old, sizeof old.mask) == 0 &&
                old.handler == SIG_IGN)
                inherited |= SIG_BIT(s);
        }
    }
    for (int s = 1; s <= 64; s++)
        if ((inherited & SIG_BIT(s)) && !(keep & SIG_BIT(s))) set_disposition(s, SIG_DFL);
}

/*
 * fork() for a command: the child is born at oom_score_adj 1000, above the agent's
 * (launch.c), so the OOM killer of the sandbox's memory cgroup picks a command and the
 * agent survives to report the OOM. The child cannot write its own value: it is not
 * dumpable until it execs, so its /proc files are root's (and making it dumpable
 * would open a copy of the agent's memory to sandbox code). So the agent raises its
 * own value for the fork and lowers it back (to no lower than it started: allowed).
 */
static pid_t fork_command(void) {
    if (oom_fd >= 0 && pwrite(oom_fd, COMMAND_OOM_SCORE_ADJ, strlen(COMMAND_OOM_SCORE_ADJ), 0) < 0) {}
    pid_t pid = fork();
    if (pid != 0 && oom_fd >= 0 && pwrite(oom_fd, oom_agent, oom_agent_len, 0) < 0) {}
    return pid;
}

/* Run PATH's FILE (glibc's execvp, the same whichever libc the agent is built with:
   musl's searches another default PATH and never falls back to the shell). A file
   without a #! line or an ELF header (ENOEXEC) runs under /bin/sh; with no PATH in
   the environment, /bin:/usr/bin; EACCES on one entry keeps looking, and is what is
   reported when nothing else ran. Returns only on failure, errno set. */
static void exec_path(char **argv) {
    const char *file = argv[0];
    int argc = 0;
    while (argv[argc]) argc++;
    char **sh = calloc((size_t)argc + 2, sizeof(char *));
    char buf[4096];
    const char *path = getenv("PATH");
    int denied = 0;
    if (!*file) { errno = ENOENT; return; }
    if (!path) path = "/bin:/usr/bin";
    for (const char *p = strchr(file, '/') ? "" : path;;) {
        const char *end = strchrnul(p, ':');
        const char *cand = file;
        if (!strchr(file, '/')) {
            size_t n = (size_t)(end - p);
            if (n + strlen(file) + 2 > sizeof buf) { errno = ENAMETOOLONG; goto next; }
            memcpy(buf, p, n);
            snprintf(buf + n, sizeof buf - n, "%s%s", n ? "/" : "", file);
            cand = buf;
        }
        execve(cand, argv, environ);
        if (errno == ENOEXEC && sh) {
            sh[0] = (char *)"/bin/sh";
            sh[1] = (char *)cand;
            for (int k = 1; k <= argc; k++) sh[k + 1] = argv[k];
            execve("/bin/sh", sh, environ);
            errno = ENOEXEC;
            return;
        }
        if (errno == EACCES) denied = 1;
        else if (errno != ENOENT && errno != ENOTDIR && errno != ESTALE && errno != ENODEV &&
                 errno != ETIMEDOUT) return;
    next:
        if (!*end || strchr(file, '/')) break;
        p = end + 1;
    }
    if (denied) errno = EACCES;
}

static void do_exec(uint32_t id, struct req *r) {
    struct exec_state *e = NULL;
    for (int i = 0; i < MAX_EXECS; i++)
        if (!execs[i].used) { e = &execs[i]; break; }
    if (!e) { send_err(id, EAGAIN, "too many concurrent commands in this sandbox"); return; }
    char **argv = get_list(r, F_ARGV);
    char **envp = get_list(r, F_ENV);
    char *cwd = get_str(r, F_CWD);
    uint64_t as_uid = get_u64(r, F_UID, (uint64_t)getuid());
    struct winsize ws;
    int pty = pty_wanted(r, &ws);
    if (!argv[0] || pty < 0) {
        send_err(id, EINVAL, pty < 0 ? "bad terminal size" : "empty command");
        goto out;
    }
    int in_p[2], out_p[2], err_p[2], report[2];
    if (pty ? pty_pipes(&ws, in_p, out_p, err_p) != 0
            : (pipe2(in_p, O_CLOEXEC) || pipe2(out_p, O_CLOEXEC) || pipe2(err_p, O_CLOEXEC))) {
        send_err(id, errno, pty ? "a pseudo-terminal (/dev/pts/ptmx)" : "pipe");
        goto out;
    }
    if (pipe2(report, O_CLOEXEC)) {
        int err = errno;
        close(in_p[0]); close(in_p[1]); close(out_p[0]); close(out_p[1]);
        close(err_p[0]); close(err_p[1]);
        send_err(id, err, "pipe");
        goto out;
    }
    pid_t pid = fork_command();
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
        /* only what the agent ignores: every other disposition is SIG_DFL already */
        for (int s = 1; s <= 64; s++)
            if (agent_ignored & SIG_BIT(s)) set_disposition(s, SIG_DFL);
        if (pty) pty_session(in_p[0]); /* a session: its group, its terminal */
        else setpgid(0, 0);
        dup2(in_p[0], 0);
        dup2(out_p[1], 1);
        dup2(err_p[1], 2);
        int stage_err[2];
        if (become(as_uid) != 0) {
            stage_err[0] = 2; stage_err[1] = errno;
            if (write(report[1], stage_err, sizeof stage_err) < 0) {}
            _exit(126);
        }
        if (cwd && chdir(cwd) != 0) {
            stage_err[0] = 1; stage_err[1] = errno;
            if (write(report[1], stage_err, sizeof stage_err) < 0) {}
            _exit(126);
        }
        /* Belt and braces: whatever the agent holds is close-on-exec already; the
           command starts with its stdin, stdout and stderr and nothing else. */
        syscall(SYS_close_range, 3U, ~0U, CLOSE_RANGE_CLOEXEC);
        environ = envp;
        exec_path(argv);
        /* Like a shell: 127 for "not found", 126 for "cannot execute". */
        int err = errno;
        dprintf(2, "corral: cannot execute '%s': %s\n", argv[0], strerror(err));
        _exit(err == ENOENT ? 127 : 126);
    }
    /* Its group made here too (as a shell's job control does), so that a SIGNAL read
       before the child has run finds it; a terminal's child makes a session, which a
       group leader cannot (kill_group covers that one). EACCES once it has exec'd. */
    if (!pty) setpgid(pid, pid);
    close(in_p[0]);
    close(out_p[1]);
    close(err_p[1]);
    close(report[1]);
    memset(e, 0, sizeof *e);
    e->used = 1;
    e->id = id;
    e->pid = pid;
    e->in_fd = in_p[1];
    e->out_fd = out_p[0];
    e->err_fd = err_p[0];
    /* Never wait for the child here: sandbox code can SIGSTOP it between fork and
       exec (kill(-1, SIGSTOP) reaches it), and a blocking read would park the agent.
       The poll loop learns from report_fd whether it exec'd (check_start). */
    e->report_fd = report[0];
    e->pty = pty;
    e->cwd = cwd;
    cwd = NULL;
    /* Fresh descriptors (pipe2, or the terminal's master and its dup) have no status
       flag to keep: one F_SETFL each, no F_GETFL (issue 30: syscalls per exec). */
    int fresh[] = {e->report_fd, e->in_fd, e->out_fd, e->err_fd};
    for (size_t k = 0; k < sizeof fresh / sizeof *fresh; k++)
        if (fresh[k] >= 0) fcntl(fresh[k], F_SETFL, O_NONBLOCK);
    e->max_output = get_u64(r, F_MAX_OUTPUT, 1 << 20);
    /* Of max_output, the last OUTPUT_TAIL bytes of a stream are its end (see drain). */
    uint64_t tail = get_u64(r, F_OUTPUT_TAIL, 0);
    e->tail[0].cap = e->tail[1].cap = tail < e->max_output ? tail : e->max_output;
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
    e->quiet_start = get_field(r, F_QUIET_START, &sd, &sn);
    if (e->stdin_close_after && e->pty) pty_queue_eof(e);
    else if (e->stdin_close_after && e->stdin_len == 0) {
        close(e->in_fd);
        e->in_fd = -1;
    }
out:
    free_list(argv);
    free_list(envp);
    free(cwd);
}

static void close_fd(int *fd) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
}

/* Has the child exec'd (EOF: send STARTED) or failed to chdir (an errno: send it)? */
static void check_start(struct exec_state *e) {
    int stage_err[2];
    ssize_t got = read(e->report_fd, stage_err, sizeof stage_err);
    if (got < 0 && (errno == EAGAIN || errno == EINTR)) return;
    close_fd(&e->report_fd);
    if (got == (ssize_t)sizeof stage_err) {
        /* chdir (or the switch of user) failed before exec: a caller error. */
        char what[600];
        if (stage_err[0] == 2) snprintf(what, sizeof what, "run the command as that user");
        else snprintf(what, sizeof what, "working directory %s", e->cwd);
        send_err(e->id, stage_err[1], what);
        e->failed = 1;
        e->deadline_ms = 0;
        close_fd(&e->in_fd);
        close_fd(&e->out_fd);
        close_fd(&e->err_fd);
        return;
    }
    /* A command run to completion (the engine's exec) needs no STARTED: its output or
       EXIT says it started, and the frame would wake the engine once more per command. */
    if (e->quiet_start) return;
    struct buf b = {0};
    field_u64(&b, F_PID, (uint64_t)e->pid);
    send_frame(RSP_STARTED, e->id, &b);
    free(b.p);
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
    if (close_it && !e->stdin_close_after && e->pty) pty_queue_eof(e);
    if (close_it) e->stdin_close_after = 1;
    pump_stdin(e);
}

/* Keep the last t->cap bytes of what went over a stream's head: a ring, allocated on
   first use (its memory is charged to the sandbox's own cgroup, like the command's). */
static void keep_tail(struct tail_ring *t, const char *p, uint64_t n) {
    if (t->cap == 0 || n == 0) return;
    if (!t->p && !(t->p = malloc(t->cap))) _exit(70);
    if (n >= t->cap) {
        memcpy(t->p, p + (n - t->cap), t->cap);
        t->pos = 0;
        t->len = t->cap;
        return;
    }
    uint64_t first = t->cap - t->pos < n ? t->cap - t->pos : n;
    memcpy(t->p + t->pos, p, first);
    memcpy(t->p, p + first, n - first);
    t->pos = (t->pos + n) % t->cap;
    t->len = t->len + n < t->cap ? t->len + n : t->cap;
}

/* Read what a pipe has. The head of a stream (max_output minus its tail) is forwarded
   as it comes; the rest is counted, and its last bytes are kept for send_tail. */
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
        struct tail_ring *t = &e->tail[is_err];
        uint64_t head = e->max_output - t->cap;
        uint64_t room = *count < head ? head - *count : 0;
        size_t send = (uint64_t)n < room ? (size_t)n : (size_t)room;
        if (send) {
            struct buf b = {0};
            field(&b, F_DATA, chunk, (uint32_t)send);
            send_frame(is_err ? RSP_STDERR : RSP_STDOUT, e->id, &b);
            free(b.p);
        }
        keep_tail(t, chunk + send, (uint64_t)n - send);
        *count += (uint64_t)n;
    }
}

/* Before the exit: what went over a stream's head. If it was more than the ring holds,
   a TAIL frame says how many bytes were dropped; then the ring, oldest byte first, as
   ordinary output frames. */
static void send_tail(struct exec_state *e, int is_err) {
    struct tail_ring *t = &e->tail[is_err];
    uint64_t count = is_err ? e->err_bytes : e->out_bytes;
    uint64_t head = e->max_output - t->cap;
    if (count <= head) return;
    if (count - head > t->len) {
        struct buf b = {0};
        field_u64(&b, F_STREAM, (uint64_t)(is_err ? 2 : 1));
        field_u64(&b, F_DROPPED, count - head - t->len);
        send_frame(RSP_TAIL, e->id, &b);
        free(b.p);
        if (is_err) e->trunc_err = 1; else e->trunc_out = 1;
    }
    uint64_t start = t->len == t->cap ? t->pos : 0;
    for (uint64_t off = 0; off < t->len;) {
        uint64_t at = (start + off) % t->cap;
        uint64_t n = t->len - off;
        if (n > t->cap - at) n = t->cap - at;
        if (n > READ_CHUNK) n = READ_CHUNK;
        struct buf b = {0};
        field(&b, F_DATA, t->p + at, (uint32_t)n);
        send_frame(is_err ? RSP_STDERR : RSP_STDOUT, e->id, &b);
        free(b.p);
        off += n;
    }
}

static void release_exec(struct exec_state *e) {
    close_fd(&e->out_fd);
    close_fd(&e->err_fd);
    close_fd(&e->in_fd);
    close_fd(&e->report_fd);
    free(e->stdin_buf);
    free(e->cwd);
    free(e->tail[0].p);
    free(e->tail[1].p);
    memset(e, 0, sizeof *e);
}

static void finish(struct exec_state *e) {
    if (e->failed) { release_exec(e); return; } /* its error went out already */
    struct buf b = {0};
    int64_t code;
    uint64_t sig = 0;
    if (WIFEXITED(e->status)) {
        code = WEXITSTATUS(e->status);
    } else {
        sig = (uint64_t)WTERMSIG(e->status);
        code = -(int64_t)sig;
    }
    send_tail(e, 0);
    send_tail(e, 1);
    field_u64(&b, F_CODE, (uint64_t)code);
    field_u64(&b, F_KILLED_BY_SIGNAL, sig);
    field_u64(&b, F_TIMED_OUT, (uint64_t)e->timed_out);
    field_u64(&b, F_TRUNC_OUT, (uint64_t)e->trunc_out);
    field_u64(&b, F_TRUNC_ERR, (uint64_t)e->trunc_err);
    field_u64(&b, F_DURATION_US, (uint64_t)(e->exit_us - e->start_us));
    send_frame(RSP_EXIT, e->id, &b);
    free(b.p);
    release_exec(e);
}

static int job_exited(pid_t pid, int status);

static void reap(void) {
    for (;;) {
        int status;
        pid_t pid = waitpid(-1, &status, WNOHANG);
        if (pid <= 0) return;
        if (job_exited(pid, status)) continue;
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
