/*
 * corral-agent, "launch" mode (on the host, as root): part of agent.c (a unity build:
 * agent.c includes this file). See the top of agent.c.
 */

/* ---------- launch (host side) ---------- */

#define SANDBOX_PTYS "32"  /* pseudo-terminals one sandbox may hold at once */

struct launch_opts {
    uid_t uid;
    gid_t gid;
    uid_t canonical;        /* owner of sandbox files in layers on disk (0: no idmap) */
    int userns;             /* the idmapping canonical <-> uid, made ahead of time */
    int root_build;         /* an image build step as root: host root <-> uid instead */
    rlim_t nofile;
    const char *rootdir, *lower;
    unsigned long disk_mb;
    unsigned long inodes;   /* the tmpfs's nr_inodes: files the sandbox may make */
    const char *owned[16];
    int n_owned;
    const char *copies[8];  /* SRC:DEST, a host file put read-only at DEST (/.corral/...) */
    int n_copies;
    const char *stubs[32];  /* empty root-owned files: mount points for bwrap's --ro-bind */
    int n_stubs;
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
        else if (!strcmp(a, "--canonical")) o->canonical = (uid_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--root-build")) o->root_build = !strcmp(v, "1");
        else if (!strcmp(a, "--nofile")) o->nofile = (rlim_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--rootdir")) o->rootdir = v;
        else if (!strcmp(a, "--lower")) o->lower = v;
        else if (!strcmp(a, "--disk-mb")) o->disk_mb = strtoul(v, NULL, 10);
        else if (!strcmp(a, "--inodes")) o->inodes = strtoul(v, NULL, 10);
        else if (!strcmp(a, "--owned") && o->n_owned < 16) o->owned[o->n_owned++] = v;
        else if (!strcmp(a, "--copy") && o->n_copies < 8) o->copies[o->n_copies++] = v;
        else if (!strcmp(a, "--stub") && o->n_stubs < 32) o->stubs[o->n_stubs++] = v;
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

/* An empty file at PATH (absolute, in the sandbox) under UPPER, its missing parents
   made: root's, read-only. bwrap binds a host file onto it (a GPU driver's library:
   corral.runtime.gpus); it could not make the file itself in a root-owned directory. */
static int make_stub(const char *upper, const char *path) {
    char buf[4096];
    if (path[0] != '/' || strstr(path, "/../") || snprintf(buf, sizeof buf, "%s%s", upper, path) >= (int)sizeof buf) { errno = EINVAL; return -1; }
    for (char *s = buf + strlen(upper) + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST) return -1;
        *s = '/';
    }
    int fd = open(buf, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0444);
    if (fd < 0) return errno == EEXIST ? 0 : -1;
    return close(fd);
}

/* SPEC is SRC:DEST: copy the host file SRC to DEST under UPPER, root's and read-only
   (a copy in the sandbox's tmpfs, not a bind mount, whose source the sandbox's
   mountinfo would name). DEST's parent is made, root's, if missing. */
static int copy_in(const char *upper, const char *spec) {
    char src[4096], dest[4200], buf[65536];
    const char *colon = strrchr(spec, ':');
    if (!colon || colon[1] != '/' || (size_t)(colon - spec) >= sizeof src) { errno = EINVAL; return -1; }
    memcpy(src, spec, (size_t)(colon - spec));
    src[colon - spec] = 0;
    if (snprintf(dest, sizeof dest, "%s%s", upper, colon + 1) >= (int)sizeof dest) { errno = ENAMETOOLONG; return -1; }
    char *slash = strrchr(dest, '/');
    *slash = 0;
    if (mkdir(dest, 0755) != 0 && errno != EEXIST) return -1;
    *slash = '/';
    int in = open(src, O_RDONLY | O_CLOEXEC), out = -1, rc = -1;
    if (in >= 0) out = open(dest, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0444);
    for (ssize_t n; out >= 0 && (n = read(in, buf, sizeof buf)) != 0;) {
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 || write(out, buf, (size_t)n) != n) goto done;
    }
    rc = out >= 0 ? 0 : -1;
done:
    if (in >= 0) close(in);
    if (out >= 0) close(out);
    return rc;
}

/*
 * A user namespace used only as an idmapping (mount_setattr MOUNT_ATTR_IDMAP): the
 * canonical owner of sandbox files in layers (FROM) and this sandbox's own uid (TO)
 * swap places, every other id maps to itself, for uids and gids alike. Layers stay
 * shareable on disk while each sandbox owns its files under a uid of its own. A child
 * unshares the namespace and waits while we write its maps and keep a descriptor.
 */
static int idmap_userns(uint32_t from, uint32_t to) {
    int up[2], down[2], fd = -1;
    char map[512], path[64];
    if (to <= from) { errno = EINVAL; return -1; }
    if (pipe2(up, O_CLOEXEC) != 0) return -1;
    if (pipe2(down, O_CLOEXEC) != 0) { close(up[0]); close(up[1]); return -1; }
    pid_t pid = fork();
    if (pid == 0) {
        close(up[0]);
        close(down[1]); /* EOF on down[0] when the parent is done */
        char c = unshare(CLONE_NEWUSER) == 0 ? 'U' : 'E';
        if (write(up[1], &c, 1) != 1) _exit(1);
        while (read(down[0], &c, 1) < 0 && errno == EINTR) {}
        _exit(0);
    }
    close(up[1]);
    close(down[0]);
    char c = 0;
    while (pid > 0 && read(up[0], &c, 1) < 0 && errno == EINTR) {}
    int len = from ? snprintf(map, sizeof map, "0 0 %u\n", from) : 0;
    len += snprintf(map + len, sizeof map - len, "%u %u 1\n", from, to);
    if (to - from > 1) len += snprintf(map + len, sizeof map - len, "%u %u %u\n", from + 1, from + 1, to - from - 1);
    len += snprintf(map + len, sizeof map - len, "%u %u 1\n%u %u %u\n", to, from, to + 1, to + 1, 4294967295u - to - 1);
    int ok = c == 'U';
    for (int k = 0; ok && k < 2; k++) {
        snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, k ? "gid_map" : "uid_map");
        int m = open(path, O_WRONLY | O_CLOEXEC);
        ok = m >= 0 && write(m, map, (size_t)len) == len;
        if (m >= 0) close(m);
    }
    if (ok) {
        snprintf(path, sizeof path, "/proc/%d/ns/user", (int)pid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    int saved = errno;
    close(up[0]);
    close(down[1]); /* the child exits */
    if (pid > 0) while (waitpid(pid, NULL, 0) < 0 && errno == EINTR) {}
    errno = c == 'U' || pid < 0 ? saved : EPERM;
    return fd;
}

/* Attach a read-only clone of the directory LOWER at DEST, idmapped through USERNS. */
static int attach_lower(const char *lower, const char *dest, int userns) {
    int fd = (int)syscall(SYS_open_tree, AT_FDCWD, lower, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (fd < 0) return die("clone the layer", lower);
    struct mount_attr attr = {.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV};
    if (userns >= 0) {
        attr.attr_set |= MOUNT_ATTR_IDMAP;
        attr.userns_fd = (uint64_t)userns;
    }
    if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof attr) != 0) {
        close(fd);
        return die("idmap the layer (needs idmapped mounts: Linux 5.19+, ext4/xfs/btrfs/tmpfs)", lower);
    }
    if (mkdir(dest, 0700) != 0 || syscall(SYS_move_mount, fd, "", AT_FDCWD, dest, MOVE_MOUNT_F_EMPTY_PATH) != 0) {
        close(fd);
        return die("attach the layer at", dest);
    }
    close(fd);
    return 0;
}

/*
 * The sandbox's root lives in a mount namespace of its own, made here: the host's
 * mount table never grows with the number of sandboxes (every bwrap start copies the
 * whole table, and mount(2) serialises on it), and when the last process of the
 * sandbox exits the kernel drops the mounts by itself: a crash cannot leak them.
 * Paths are relative to ROOTDIR (our cwd meanwhile), so the overlay's options, which
 * the sandbox reads in /proc/self/mountinfo, name no host path:
 *   ROOTDIR/rw      tmpfs of disk_mb: the cap on everything the sandbox writes
 *   ROOTDIR/rw/N    the Nth lower layer (LOWER is a ':' list), an idmapped clone
 *   ROOTDIR/root    overlay: rw/0:rw/1:... read-only, rw/upper private and writable
 */
static int mount_root(struct launch_opts *o) {
    char path[4300], data[16384], *lowers = strdup(o->lower);
    int n_lowers = 1;
    for (const char *c = o->lower; *c; c++) n_lowers += *c == ':';
    if (!lowers) return die("strdup", NULL);
    if (unshare(CLONE_NEWNS) != 0) return die("unshare", "mount namespace");
    /* Nothing mounted here may propagate back to the host. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return die("make mounts private", NULL);
    if (chdir(o->rootdir) != 0) return die("chdir", o->rootdir);
    /* A build step as root (corral.runtime.rootbuild): the image's root-owned files are
       the sandbox's (its root is this uid in its user namespace), the sandbox user's are
       nobody's; what it writes is committed as root's. */
    if (o->root_build && o->uid != (uid_t)-1) {
        if (o->userns >= 0) close(o->userns);
        if ((o->userns = idmap_userns(0, o->uid)) < 0) return die("make the root idmapping for uid", NULL);
    }
    if (o->canonical && o->uid != (uid_t)-1 && o->userns < 0 &&
        (o->userns = idmap_userns(o->canonical, o->uid)) < 0)
        return die("make the idmapping for uid", NULL);
    /* nr_inodes: the sandbox's own, plus a mount point per lower layer and rw/pts */
    if (o->inodes)
        snprintf(data, sizeof data, "size=%lum,nr_inodes=%lu,mode=0711", o->disk_mb ? o->disk_mb : 1024, o->inodes + (unsigned long)n_lowers + 1);
    else
        snprintf(data, sizeof data, "size=%lum,mode=0711", o->disk_mb ? o->disk_mb : 1024);
    if (mount("corral-rw", "rw", "tmpfs", MS_NOSUID | MS_NODEV, data) != 0) return die("mount tmpfs on", "rw");
    if (mkdir("rw/upper", 0755) != 0 || mkdir("rw/work", 0700) != 0) return die("mkdir", "rw/upper");
    /* The sandbox's own devpts (bound over bwrap's at /dev/pts): at most SANDBOX_PTYS
       terminals, so one sandbox cannot use up the pseudo-terminals every devpts on the
       host shares (kernel.pty.max); its ptmx is root's, so the sandbox cannot chmod it. */
    if (mkdir("rw/pts", 0755) != 0) return die("mkdir", "rw/pts");
    if (mount("devpts", "rw/pts", "devpts", MS_NOSUID | MS_NOEXEC,
              "newinstance,ptmxmode=0666,mode=0620,max=" SANDBOX_PTYS) != 0)
        return die("mount devpts on", "rw/pts");
    /* The upper's root is root's (nobody inside), world-writable and sticky, like
       /tmp: the sandbox may create /app, but never unlink or replace what it did not
       create (/lib64, /bin, /usr: a swapped ELF loader would run inside every later
       command, the grader's too). The image's own files stay root's as well. */
    if (chmod("rw/upper", 01777) != 0) return die("chmod", "rw/upper");
    if (mkdir("rw/upper/.corral", 0755) != 0) return die("mkdir", "rw/upper/.corral");
    for (int i = 0; i < o->n_owned; i++)
        if (make_owned("rw/upper", o->owned[i], o->uid, o->gid) != 0) return die("mkdir", o->owned[i]);
    for (int i = 0; i < o->n_copies; i++)
        if (copy_in("rw/upper", o->copies[i]) != 0) return die("copy", o->copies[i]);
    for (int i = 0; i < o->n_stubs; i++)
        if (make_stub("rw/upper", o->stubs[i]) != 0) return die("make the mount point", o->stubs[i]);
    int len = snprintf(data, sizeof data, "lowerdir=");
    char *save = NULL;
    int i = 0;
    for (char *l = strtok_r(lowers, ":", &save); l; l = strtok_r(NULL, ":", &save), i++) {
        snprintf(path, sizeof path, "rw/%d", i);
        if (attach_lower(l, path, o->userns) != 0) return -1;
        len += snprintf(data + len, sizeof data - len, "%s%s", i ? ":" : "", path);
    }
    free(lowers);
    len += snprintf(data + len, sizeof data - len, ",upperdir=rw/upper,workdir=rw/work");
    if (len >= (int)sizeof data) { errno = E2BIG; return die("overlay options for", "root"); }
    if (mount("corral-root", "root", "overlay", MS_NOSUID | MS_NODEV, data) != 0) return die("mount overlay on", "root");
    if (o->userns >= 0) close(o->userns);
    o->userns = -1;
    if (chdir("/") != 0) return die("chdir", "/");
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
    struct launch_opts o = {.uid = (uid_t)-1, .gid = (gid_t)-1, .userns = -1};
    int ready = 0;
    if (parse_launch(argc - 2, argv + 2, &o, &ready) != 0) return 111;
    if (ready) {
        /* The idmapping costs a fork: made while the slot waits, not at create. */
        if (o.canonical && o.uid != (uid_t)-1 && (o.userns = idmap_userns(o.canonical, o.uid)) < 0)
            return die("make the idmapping for uid", NULL);
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
