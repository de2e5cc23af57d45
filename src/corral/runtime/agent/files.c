/*
 * corral-agent, file operations: part of agent.c (a unity build: agent.c includes this
 * file, so it shares its statics). They run as the sandbox user, in the sandbox's view
 * of the filesystem, and never block: see open_regular and the jobs below.
 */

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
    if (rc != 0 && errno == EEXIST) {
        /* mkdir -p of a path that exists is fine only if it is a directory. */
        struct stat st;
        rc = (stat(p, &st) == 0 && S_ISDIR(st.st_mode)) ? 0 : -1;
        errno = EEXIST;
    }
    free(p);
    return rc;
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

/* What a file operation refuses, in words ("it is a FIFO"), or NULL for a regular file. */
static const char *not_regular(mode_t mode) {
    if (S_ISREG(mode)) return NULL;
    if (S_ISFIFO(mode)) return "it is a FIFO";
    if (S_ISSOCK(mode)) return "it is a socket";
    if (S_ISCHR(mode)) return "it is a character device";
    if (S_ISBLK(mode)) return "it is a block device";
    return "it is not a regular file";
}

/* Kernel filesystems whose files are views of processes or of the kernel: a symlink
   to /proc/1/mem or /proc/1/environ must not make the agent read its own memory. */
static int kernel_fs(long type) {
    switch ((unsigned long)type & 0xffffffffUL) {
    case PROC_SUPER_MAGIC: case SYSFS_MAGIC: case DEBUGFS_MAGIC: case TRACEFS_MAGIC:
    case SECURITYFS_MAGIC: case CGROUP_SUPER_MAGIC: case CGROUP2_SUPER_MAGIC:
    case BPF_FS_MAGIC: case PSTOREFS_MAGIC: case EFIVARFS_MAGIC: case BINFMTFS_MAGIC:
    case FUSE_SUPER_MAGIC:
        return 1;
    }
    return 0;
}

/*
 * Open PATH for a file operation without ever blocking: O_NONBLOCK, so a FIFO or a
 * lease held by sandbox code cannot park the agent in open(). Only a regular file on
 * an ordinary filesystem is accepted; anything else is refused with EOPNOTSUPP and a
 * message saying what it is. Returns the descriptor (and its stat in ST), or -1 after
 * sending the error.
 */
static int open_regular(uint32_t id, const char *path, int flags, mode_t mode, struct stat *st) {
    struct statfs fs;
    const char *why = NULL;
    int err = 0, fd = open(path, flags | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, mode);
    if (fd < 0) {
        err = errno;
        if (err == ENXIO && stat(path, st) == 0) why = not_regular(st->st_mode);
        if (why) err = EOPNOTSUPP; /* a FIFO without a reader, a socket, a device */
    } else if (fstat(fd, st) != 0 || fstatfs(fd, &fs) != 0) {
        err = errno;
    } else if (S_ISDIR(st->st_mode)) {
        err = EISDIR;
    } else if ((why = not_regular(st->st_mode))) {
        err = EOPNOTSUPP;
    } else if (kernel_fs(fs.f_type)) {
        err = EOPNOTSUPP;
        why = "it is on /proc, /sys or another kernel filesystem";
    } else {
        return fd;
    }
    if (fd >= 0) close(fd);
    char msg[600];
    if (why) {
        snprintf(msg, sizeof msg, "%s: corral reads and writes only regular files", why);
        send_err_msg(id, err, msg);
    } else if (err == EWOULDBLOCK) {
        send_err_msg(id, err, "a process in the sandbox holds a lease on it "
                              "(it has been asked to give it up): try again");
    } else {
        send_err(id, err, path);
    }
    return -1;
}

/* A file operation failed with ERR after opening FD (if >= 0) for PATH: close, answer, free. */
static void fail_op(uint32_t id, int fd, int err, char *path) {
    if (fd >= 0) close(fd);
    send_err(id, err, path);
    free(path);
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
    /* No O_TRUNC here: nothing is changed before the checks have passed. */
    struct stat st;
    int fd = open_regular(id, path, O_WRONLY | O_CREAT, mode, &st);
    if (fd < 0) { free(path); return; }
    if (trunc && (ftruncate(fd, 0) != 0 || fchmod(fd, mode) != 0)) {
        fail_op(id, fd, errno, path);
        return;
    }
    size_t done = 0;
    while (done < n) {
        ssize_t w = pwrite(fd, d + done, n - done, (off_t)(off + done));
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) { fail_op(id, fd, errno, path); return; }
        done += (size_t)w;
    }
    if (close(fd) != 0) { fail_op(id, -1, errno, path); return; }
    send_ok(id, NULL);
    free(path);
}

static void do_fread(uint32_t id, struct req *r) {
    char *path = get_str(r, F_PATH);
    if (!path) { send_err(id, EINVAL, "missing path"); return; }
    uint64_t off = get_u64(r, F_OFFSET, 0);
    uint64_t len = get_u64(r, F_LENGTH, 1 << 20);
    struct stat st;
    int fd = open_regular(id, path, O_RDONLY, 0, &st);
    if (fd < 0) { free(path); return; }
    /* However big the file, or however fast something in the sandbox grows it, one
       request allocates at most MAX_READ and reads at most that. */
    if (len > MAX_READ) len = MAX_READ;
    char *data = malloc(len ? len : 1);
    if (!data) { fail_op(id, fd, ENOMEM, path); return; }
    size_t got = 0;
    while (got < len) {
        ssize_t n = pread(fd, data + got, len - got, (off_t)(off + got));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { int err = errno; free(data); fail_op(id, fd, err, path); return; }
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

/*
 * rm -r PATH without recursion, in a job child (so in its own cwd): a tree can be
 * deeper than any stack (nftw recurses, and a 60000-deep tree crashed the agent).
 * Walks down with chdir, keeping the names it took on a heap stack, and back up
 * with "..". It runs as the sandbox user: whatever a race makes it remove, code in
 * the sandbox could have removed itself; the job's deadline bounds the time.
 */
static int remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) return -1;
    if (!S_ISDIR(st.st_mode)) return unlink(path);
    if (chdir(path) != 0) return -1;
    char **names = NULL;
    size_t depth = 0, cap = 0;
    for (;;) {
        DIR *d = opendir(".");
        if (!d) return -1;
        char *down = NULL;
        struct dirent *de;
        while ((de = readdir(d))) {
            if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
            int is_dir = de->d_type == DT_DIR;
            if (de->d_type == DT_UNKNOWN)
                is_dir = fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
            if (is_dir) {
                if (!(down = strdup(de->d_name))) { closedir(d); errno = ENOMEM; return -1; }
                break;
            }
            if (unlinkat(dirfd(d), de->d_name, 0) != 0 && errno != ENOENT) {
                int err = errno;
                closedir(d);
                errno = err;
                return -1;
            }
        }
        closedir(d);
        if (down) {
            if (depth == cap) {
                cap = cap ? cap * 2 : 64;
                char **grown = realloc(names, cap * sizeof *names);
                if (!grown) { errno = ENOMEM; return -1; }
                names = grown;
            }
            names[depth++] = down;
            if (chdir(down) != 0) return -1;
            continue;
        }
        if (depth == 0) break; /* PATH itself is empty now */
        if (chdir("..") != 0) return -1;
        char *name = names[--depth];
        if (rmdir(name) != 0 && errno != ENOENT) return -1;
        free(name);
    }
    if (chdir("/") != 0) return -1;
    return rmdir(path);
}

/* ---------- jobs: file operations that may take long, run in a child ---------- */

struct job { pid_t pid; uint32_t id; int timed_out, stopped; int64_t deadline_ms; char *path; };
static struct job jobs[MAX_JOBS];

/* Run FN(PATH) in a child and answer request ID when it exits. */
static void start_job(uint32_t id, int (*fn)(const char *), char *path) {
    struct job *j = NULL;
    for (int i = 0; i < MAX_JOBS; i++)
        if (!jobs[i].pid) { j = &jobs[i]; break; }
    if (!j) {
        send_err_msg(id, EAGAIN, "too many file operations in progress in this sandbox");
        free(path);
        return;
    }
    pid_t pid = fork();
    if (pid < 0) { send_err(id, errno, "cannot start the file operation"); free(path); return; }
    if (pid == 0) {
        /* Not pid 1: ignore what the agent would outside a pid namespace's init, as a
           job's child always did (only SIGKILL and SIGSTOP end or stop it). */
        for (int s = 1; s < NSIG; s++)
            if (s != SIGCHLD && s != SIGKILL && s != SIGSTOP) signal(s, SIG_IGN);
        int rc = fn(path);
        _exit(rc == 0 ? 0 : (errno > 0 && errno < 256) ? errno : EIO);
    }
    *j = (struct job){pid, id, 0, 0, now_ms() + JOB_TIMEOUT_MS, path};
}

static int job_exited(pid_t pid, int status) {
    for (int i = 0; i < MAX_JOBS; i++) {
        struct job *j = &jobs[i];
        if (j->pid != pid) continue;
        char msg[600];
        if (j->stopped) {
            snprintf(msg, sizeof msg, "%s: a process in the sandbox stopped the operation "
                     "(SIGSTOP), so it was abandoned", j->path);
            send_err_msg(j->id, EINTR, msg);
        } else if (j->timed_out) {
            snprintf(msg, sizeof msg, "%s: did not finish in %d s (does something in the "
                     "sandbox keep adding files?)", j->path, JOB_TIMEOUT_MS / 1000);
            send_err_msg(j->id, ETIMEDOUT, msg);
        } else if (WIFSIGNALED(status)) {
            snprintf(msg, sizeof msg, "%s: the operation was killed by signal %d",
                     j->path, WTERMSIG(status));
            send_err_msg(j->id, EINTR, msg);
        } else if (WEXITSTATUS(status)) {
            send_err(j->id, WEXITSTATUS(status), j->path);
        } else {
            send_ok(j->id, NULL);
        }
        free(j->path);
        memset(j, 0, sizeof *j);
        return 1;
    }
    return 0;
}

/* Kill jobs past their deadline, or stopped (a job child is not pid 1: sandbox code of
   the same uid can SIGSTOP it); return the earliest deadline still ahead (or -1). */
static int64_t check_jobs(int64_t now) {
    int64_t wake = -1;
    for (int i = 0; i < MAX_JOBS; i++) {
        struct job *j = &jobs[i];
        if (!j->pid || j->timed_out || j->stopped) continue;
        int status;
        if (waitpid(j->pid, &status, WNOHANG | WUNTRACED) == j->pid) {
            if (!WIFSTOPPED(status)) { job_exited(j->pid, status); continue; }
            j->stopped = 1;
            kill(j->pid, SIGKILL);
        } else if (now >= j->deadline_ms) {
            j->timed_out = 1;
            kill(j->pid, SIGKILL);
        } else if (wake < 0 || j->deadline_ms < wake) {
            wake = j->deadline_ms;
        }
    }
    return wake;
}

static void do_fremove(uint32_t id, struct req *r) {
    char *path = get_str(r, F_PATH);
    struct stat st;
    if (!path) { send_err(id, EINVAL, "missing path"); return; }
    int rc;
    if (lstat(path, &st) != 0) rc = -1;
    else if (!S_ISDIR(st.st_mode)) rc = unlink(path);
    else if (get_u64(r, F_RECURSIVE, 0)) { start_job(id, remove_tree, path); return; }
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
