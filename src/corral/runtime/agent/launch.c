/*
 * corral-agent, "launch" mode (on the host, as root): part of agent.c (a unity build:
 * agent.c includes this file). See the top of agent.c.
 */

/* ---------- launch (host side) ---------- */

struct launch_opts {
    uid_t uid;
    gid_t gid;
    rlim_t nofile;
    const char *rootdir, *lower;
    unsigned long disk_mb;
    unsigned long inodes;   /* the tmpfs's nr_inodes: files the sandbox may make */
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
        else if (!strcmp(a, "--inodes")) o->inodes = strtoul(v, NULL, 10);
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
    if (o->inodes)
        snprintf(data, sizeof data, "size=%lum,nr_inodes=%lu,mode=0711", o->disk_mb ? o->disk_mb : 1024, o->inodes);
    else
        snprintf(data, sizeof data, "size=%lum,mode=0711", o->disk_mb ? o->disk_mb : 1024);
    if (mount("corral-rw", rw, "tmpfs", MS_NOSUID | MS_NODEV, data) != 0) return die("mount tmpfs on", rw);
    snprintf(upper, sizeof upper, "%s/upper", rw);
    snprintf(work, sizeof work, "%s/work", rw);
    if (mkdir(upper, 0755) != 0 || mkdir(work, 0700) != 0) return die("mkdir", upper);
    /* The root directory is root's (nobody inside), world-writable and sticky, like
       /tmp: the sandbox may create /app, but never unlink or replace what it did not
       create (/lib64, /bin, /usr: a swapped ELF loader would run inside every later
       command, the grader's too). The image's own files stay root's as well. */
    if (chmod(upper, 01777) != 0) return die("chmod", upper);
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
        /* stdin stays the options pipe, now at EOF; stdout becomes the log pipe (which
           closes the ready pipe): no host file is handed on to bwrap and the agent. */
        dup2(2, 1);
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
