/*
 * corral-agent, "launch" mode (on the host, as root): part of agent.c (a unity build:
 * agent.c includes this file). See the top of agent.c.
 */

/* ---------- launch (host side) ---------- */

#define SANDBOX_PTYS "32"  /* pseudo-terminals one sandbox may hold at once */
#define AGENT_OOM_SCORE_ADJ "500"  /* the agent's, and the floor of the sandbox's */

struct launch_opts {
    uid_t uid;
    gid_t gid;
    uid_t canonical;        /* owner of sandbox files in layers on disk (0: no idmap) */
    int userns;             /* the idmapping canonical <-> uid, made ahead of time */
    int root_build;         /* an image build step as root: host root <-> uid instead */
    int exec_root;          /* PROGRAM is CRIU restoring a checkpoint: it stays root (it
                               makes the sandbox's user namespace itself, docs/live.md) */
    uid_t root_uid;         /* the host uid of the sandbox's root (0: none mapped) */
    int sb_userns;          /* the sandbox's user namespace: 0 -> root_uid, 1000 -> uid */
    rlim_t nofile;
    const char *rootdir, *lower;
    unsigned long disk_mb;
    unsigned long inodes;   /* the tmpfs's nr_inodes: files the sandbox may make */
    const char *cpus;       /* "0,3": the CPUs it runs on (affinity, its /sys's view) */
    const char *disk_image; /* an ext4 image: the writable layer on disk, not a tmpfs */
    const char *owned[16];
    int n_owned;
    const char *copies[8];  /* SRC:DEST, a host file put read-only at DEST (/.corral/...) */
    int n_copies;
    const char *netns;      /* a network namespace to join (a policy's: runtime/net) */
    int prenet;             /* --ready: make an empty network namespace while waiting */
    int host_net;           /* --host-net 1: leave the one made for the host's (netns.c) */
    const char *volumes[16]; /* MODE:SRC:DEST, a volume (runtime/volumes.py) */
    int n_volumes;
    const char *stubs[32];  /* empty root-owned files: mount points for bwrap's --ro-bind */
    int n_stubs;
    const char *kdat;       /* CRIU's kernel probes, kept by the engine (seed_kdat) */
    const char *prelower;   /* --ready: layers (a ':' list, as --lower's) to clone and
                               idmap while the slot waits (premake_lowers) */
    int pre_fd[16];         /* their detached clones (-1: none), pre_path[k]'s */
    char *pre_path[16];
    int n_pre;
    char **prog;
};

/*
 * CRIU probes the kernel at every run (~25 ms of a restore's ~150) unless it finds
 * what it probed in /run/criu.kdat, which it keeps only on a tmpfs: a host whose /run
 * is on disk probes every time. A restore (--exec-root, in our private mount
 * namespace) gets a /run of its own, a small tmpfs, seeded with the copy the engine
 * keeps (KDAT; none yet: CRIU probes and writes one there, which the engine copies
 * from /proc/PID/root/run once the restore ran: corral.runtime.live_images). Nothing
 * of the sandbox reaches this /run. A failure only costs the probes.
 */
static void seed_kdat(const char *kdat) {
    if (mount("corral-kdat", "/run", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=1m,mode=0700") != 0)
        return;
    int in = open(kdat, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (in < 0) return;
    int out = open("/run/criu.kdat", O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    char buf[16384];
    ssize_t n;
    while (out >= 0 && (n = read(in, buf, sizeof buf)) > 0)
        if (write(out, buf, (size_t)n) != n) break;
    if (out >= 0) close(out);
    close(in);
}

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
        else if (!strcmp(a, "--exec-root")) o->exec_root = !strcmp(v, "1");
        else if (!strcmp(a, "--root-uid")) o->root_uid = (uid_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--nofile")) o->nofile = (rlim_t)strtoul(v, NULL, 10);
        else if (!strcmp(a, "--rootdir")) o->rootdir = v;
        else if (!strcmp(a, "--lower")) o->lower = v;
        else if (!strcmp(a, "--disk-mb")) o->disk_mb = strtoul(v, NULL, 10);
        else if (!strcmp(a, "--inodes")) o->inodes = strtoul(v, NULL, 10);
        else if (!strcmp(a, "--cpus")) o->cpus = v;
        else if (!strcmp(a, "--disk-image")) o->disk_image = v;
        else if (!strcmp(a, "--owned") && o->n_owned < 16) o->owned[o->n_owned++] = v;
        else if (!strcmp(a, "--copy") && o->n_copies < 8) o->copies[o->n_copies++] = v;
        else if (!strcmp(a, "--netns")) o->netns = v;
        else if (!strcmp(a, "--prenet")) o->prenet = !strcmp(v, "1");
        else if (!strcmp(a, "--host-net")) o->host_net = !strcmp(v, "1");
        else if (!strcmp(a, "--volume") && o->n_volumes < 16) o->volumes[o->n_volumes++] = v;
        else if (!strcmp(a, "--stub") && o->n_stubs < 32) o->stubs[o->n_stubs++] = v;
        else if (!strcmp(a, "--kdat")) o->kdat = v;
        else if (!strcmp(a, "--prelower")) o->prelower = v;
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
 * The writable layer on disk (storage="disk"; corral.runtime.diskimage): the ext4
 * image IMAGE (made by the engine, bounded by its size and inode count) on a loop
 * device, mounted at DEST. The loop device clears itself when the mount goes, which
 * is when the last process of the sandbox exits (the mount namespace is ours alone).
 */
static int mount_disk(const char *image, const char *dest) {
    char dev[64];
    int ctl = open("/dev/loop-control", O_RDWR | O_CLOEXEC);
    if (ctl < 0) return die("open", "/dev/loop-control");
    int img = open(image, O_RDWR | O_CLOEXEC | O_NOFOLLOW);
    if (img < 0) { close(ctl); return die("open", image); }
    int rc = -1;
    for (int tries = 0; tries < 64 && rc != 0; tries++) {
        int n = ioctl(ctl, LOOP_CTL_GET_FREE);
        if (n < 0) break;
        snprintf(dev, sizeof dev, "/dev/loop%d", n);
        int lfd = open(dev, O_RDWR | O_CLOEXEC);
        if (lfd < 0) break;
        struct loop_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.fd = (uint32_t)img;
        cfg.info.lo_flags = LO_FLAGS_AUTOCLEAR;
        if (ioctl(lfd, LOOP_CONFIGURE, &cfg) == 0) {
            rc = mount(dev, dest, "ext4", MS_NOSUID | MS_NODEV, "errors=remount-ro,noinit_itable");
            if (rc != 0) { int e = errno; ioctl(lfd, LOOP_CLR_FD, 0); errno = e; close(lfd); break; }
        } else if (errno != EBUSY) {  /* EBUSY: another launcher took it first */
            close(lfd);
            break;
        }
        close(lfd);
    }
    int saved = errno;
    close(img);
    close(ctl);
    errno = saved;
    if (rc != 0) return die("mount the disk image", image);
    if (chmod(dest, 0711) != 0 || (rmdir("rw/lost+found") != 0 && errno != ENOENT)) return die("prepare", dest);
    return 0;
}

/*
 * The sandbox's CPUs (CPUS: "0,3"): its affinity, inherited by everything in it, so
 * nproc and sched_getaffinity say how many it has; and ROOTDIR/rw/sys, bound read-only
 * at /sys, where glibc's sysconf(_SC_NPROCESSORS_ONLN/_CONF) (Python's os.cpu_count(),
 * getconf) reads the CPUs online and present. The host's /sys is never shown.
 */
static int set_cpus(const char *cpus) {
    cpu_set_t set;
    CPU_ZERO(&set);
    char path[128];
    static const char *dirs[] = {"rw/sys", "rw/sys/devices", "rw/sys/devices/system", "rw/sys/devices/system/cpu"};
    for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++)
        if (mkdir(dirs[i], 0555) != 0) return die("mkdir", dirs[i]);
    for (const char *c = cpus; *c;) {
        char *end;
        unsigned long n = strtoul(c, &end, 10);
        if (end == c || n >= CPU_SETSIZE || (*end && *end != ',')) { errno = EINVAL; return die("bad --cpus", cpus); }
        CPU_SET(n, &set);
        snprintf(path, sizeof path, "rw/sys/devices/system/cpu/cpu%lu", n);
        if (mkdir(path, 0555) != 0) return die("mkdir", path);
        c = *end ? end + 1 : end;
    }
    static const char *files[] = {"online", "possible", "present"};
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        snprintf(path, sizeof path, "rw/sys/devices/system/cpu/%s", files[i]);
        int fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0444);
        if (fd < 0 || dprintf(fd, "%s\n", cpus) < 0) return die("write", path);
        close(fd);
    }
    if (sched_setaffinity(0, sizeof set, &set) != 0) return die("sched_setaffinity", cpus);
    return 0;
}

/*
 * A user namespace whose uid and gid maps are MAP (lines "inside outside count"),
 * made by a child that takes host uid OWNER first (the namespace's owner: bubblewrap,
 * running as OWNER, may then enter it with --userns), unshares it and waits while we
 * write its maps (as host root) and keep a descriptor (close-on-exec).
 */
static int make_userns(const char *map, uid_t owner) {
    int up[2], down[2], fd = -1;
    char path[64];
    size_t len = strlen(map);
    if (pipe2(up, O_CLOEXEC) != 0) return -1;
    if (pipe2(down, O_CLOEXEC) != 0) { close(up[0]); close(up[1]); return -1; }
    pid_t pid = fork();
    if (pid == 0) {
        close(up[0]);
        close(down[1]); /* EOF on down[0] when the parent is done */
        char c = (owner == 0 || (setgroups(0, NULL) == 0 && setresgid(owner, owner, owner) == 0 &&
                                 setresuid(owner, owner, owner) == 0)) &&
                 unshare(CLONE_NEWUSER) == 0 ? 'U' : 'E';
        if (write(up[1], &c, 1) != 1) _exit(1);
        while (read(down[0], &c, 1) < 0 && errno == EINTR) {}
        _exit(0);
    }
    close(up[1]);
    close(down[0]);
    char c = 0;
    while (pid > 0 && read(up[0], &c, 1) < 0 && errno == EINTR) {}
    int ok = c == 'U';
    for (int k = 0; ok && k < 2; k++) {
        snprintf(path, sizeof path, "/proc/%d/%s", (int)pid, k ? "gid_map" : "uid_map");
        int m = open(path, O_WRONLY | O_CLOEXEC);
        ok = m >= 0 && write(m, map, len) == (ssize_t)len;
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

/*
 * A user namespace used only as an idmapping (mount_setattr MOUNT_ATTR_IDMAP): each
 * pair (A[k], B[k]) swaps places, every other id maps to itself, for uids and gids
 * alike. The canonical owner of sandbox files in layers and this sandbox's own uid
 * swap (and host root and the sandbox's root uid, when it maps one): layers stay
 * shareable on disk while each sandbox owns its files under host uids of its own.
 */
static int idmap_userns(const uint32_t *a, const uint32_t *b, int n) {
    uint32_t ids[8], to[8];
    int m = 0;
    for (int k = 0; k < n && m + 2 <= 8; k++) {
        if (a[k] == b[k]) { errno = EINVAL; return -1; }
        ids[m] = a[k]; to[m++] = b[k];
        ids[m] = b[k]; to[m++] = a[k];
    }
    for (int i = 1; i < m; i++)  /* sort by id (insertion: a handful) */
        for (int j = i; j > 0 && ids[j - 1] > ids[j]; j--) {
            uint32_t t = ids[j]; ids[j] = ids[j - 1]; ids[j - 1] = t;
            t = to[j]; to[j] = to[j - 1]; to[j - 1] = t;
        }
    char map[1024];
    int len = 0;
    uint32_t next = 0; /* the first id not written yet */
    for (int i = 0; i < m; i++) {
        if (i && ids[i] == ids[i - 1]) { errno = EINVAL; return -1; }
        if (ids[i] > next) len += snprintf(map + len, sizeof map - len, "%u %u %u\n", next, next, ids[i] - next);
        len += snprintf(map + len, sizeof map - len, "%u %u 1\n", ids[i], to[i]);
        next = ids[i] + 1;
    }
    if (next < 4294967295u) len += snprintf(map + len, sizeof map - len, "%u %u %u\n", next, next, 4294967295u - next);
    return make_userns(map, 0);
}

/* The idmapping of a sandbox's layers (see idmap_userns). */
static int layer_idmap(struct launch_opts *o) {
    uint32_t a[2] = {o->canonical, 0}, b[2] = {o->uid, o->root_uid};
    return idmap_userns(a, b, o->root_uid ? 2 : 1);
}

/* The sandbox's own user namespace when it maps a root: uid and gid 0 are the
   sandbox's root uid on the host, 1000 (SANDBOX_UID) its own; nothing else. */
static int sandbox_userns(struct launch_opts *o) {
    char map[128];
    snprintf(map, sizeof map, "0 %u 1\n1000 %u 1\n", o->root_uid, o->uid);
    return make_userns(map, o->uid);
}

/* A detached read-only clone of the directory LOWER, idmapped through USERNS: its
   descriptor (close-on-exec), or -1 with errno set and WHY saying which step failed. */
static int clone_lower(const char *lower, int userns, const char **why) {
    int fd = (int)syscall(SYS_open_tree, AT_FDCWD, lower, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    *why = "clone the layer";
    if (fd < 0) return -1;
    struct mount_attr attr = {.attr_set = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV};
    if (userns >= 0) {
        attr.attr_set |= MOUNT_ATTR_IDMAP;
        attr.userns_fd = (uint64_t)userns;
    }
    if (syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof attr) != 0) {
        int e = errno;
        close(fd);
        errno = e;
        *why = "idmap the layer (needs idmapped mounts: Linux 5.19+, ext4/xfs/btrfs/tmpfs)";
        return -1;
    }
    return fd;
}

/*
 * A warm slot clones and idmaps the layers it was told a sandbox will likely have (the
 * agent's, and those of the last sandbox the engine started) while it waits: open_tree
 * and mount_setattr each take the host's mount lock, which every sandbox starting or
 * ending on the host contends for. A failure only means the layer is cloned at launch.
 */
static void premake_lowers(struct launch_opts *o) {
    char *list = strdup(o->prelower), *save = NULL;
    const char *why;
    if (!list) return;
    for (char *l = strtok_r(list, ":", &save); l && o->n_pre < 16; l = strtok_r(NULL, ":", &save)) {
        o->pre_path[o->n_pre] = strdup(l);
        o->pre_fd[o->n_pre] = o->pre_path[o->n_pre] ? clone_lower(l, o->userns, &why) : -1;
        o->n_pre++;
    }
    free(list);
}

/* The clone made ahead of time for layer K if it is of LOWER, the very directory that
   path names now (not one put in its place meanwhile: same device and inode), else -1. */
static int premade_lower(struct launch_opts *o, int k, const char *lower) {
    struct stat want, have;
    if (k >= o->n_pre || o->pre_fd[k] < 0 || strcmp(o->pre_path[k], lower) != 0) return -1;
    int fd = o->pre_fd[k];
    o->pre_fd[k] = -1;
    if (stat(lower, &want) != 0 || fstat(fd, &have) != 0 ||
        want.st_dev != have.st_dev || want.st_ino != have.st_ino) {
        close(fd);
        return -1;
    }
    return fd;
}

static void drop_premade(struct launch_opts *o) {
    for (int k = 0; k < o->n_pre; k++) {
        if (o->pre_fd[k] >= 0) close(o->pre_fd[k]);
        o->pre_fd[k] = -1;
        free(o->pre_path[k]);
        o->pre_path[k] = NULL;
    }
    o->n_pre = 0;
}

/* Attach a read-only clone of the directory LOWER (layer K) at DEST, idmapped through
   the layers' idmapping: the one made while the slot waited, where it is LOWER's. */
static int attach_lower(struct launch_opts *o, int k, const char *lower, const char *dest) {
    const char *why = "clone the layer";
    int fd = premade_lower(o, k, lower);
    if (fd < 0 && (fd = clone_lower(lower, o->userns, &why)) < 0) return die(why, lower);
    if (mkdir(dest, 0700) != 0 || syscall(SYS_move_mount, fd, "", AT_FDCWD, dest, MOVE_MOUNT_F_EMPTY_PATH) != 0) {
        close(fd);
        return die("attach the layer at", dest);
    }
    close(fd);
    return 0;
}

/* The directory PATH (absolute, in the sandbox) under the sandbox's root, made root's
   where missing, one component at a time without following any symlink: the image or
   a snapshot may hold a symlink there, and this runs as host root with the host's
   files in view. An O_PATH descriptor of it, or -1. */
static int open_mount_point(const char *path) {
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) { errno = ENAMETOOLONG; return -1; }
    int dir = open("root", O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    char *save = NULL;
    for (char *part = strtok_r(buf, "/", &save); dir >= 0 && part; part = strtok_r(NULL, "/", &save)) {
        if (!strcmp(part, "..") || !strcmp(part, ".")) { close(dir); errno = EINVAL; return -1; }
        if (mkdirat(dir, part, 0755) != 0 && errno != EEXIST) { close(dir); return -1; }
        int next = openat(dir, part, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        close(dir);
        dir = next;
    }
    return dir;
}

/*
 * SPEC is MODE:SRC:DEST (runtime/volumes.py checked it): the host directory SRC,
 * idmapped like the layers, at DEST in the sandbox (K: its number, for its dirs).
 *   ro   a read-only overlay of the clone alone
 *   cow  an overlay: the clone below, an upper in the sandbox's tmpfs (what it writes
 *        costs its own disk_mb; nobody else sees it), the sandbox's user owning its root
 *   rw   a writable clone: writes land in the volume, seen by every sandbox that has it
 * (ro and cow are overlays so that mountinfo names only rw/vK, no host path; an rw
 * volume's mountinfo shows its path in the state directory.)
 * Mounted on the sandbox's root (root/DEST), so bwrap's bind of root carries them.
 */
static int mount_volume(struct launch_opts *o, const char *spec, int k) {
    char mode[8], src[4096], dest[64], lower[64], data[512];
    const char *c1 = strchr(spec, ':'), *c2 = c1 ? strrchr(spec, ':') : NULL;
    if (!c1 || c2 == c1 || c1 - spec >= (long)sizeof mode || c2 - c1 - 1 >= (long)sizeof src || c2[1] != '/') {
        errno = EINVAL;
        return die("volume", spec);
    }
    memcpy(mode, spec, (size_t)(c1 - spec)); mode[c1 - spec] = 0;
    memcpy(src, c1 + 1, (size_t)(c2 - c1 - 1)); src[c2 - c1 - 1] = 0;
    int point = open_mount_point(c2 + 1);
    if (point < 0) return die("make the volume's mount point (no symlinks)", c2 + 1);
    snprintf(dest, sizeof dest, "/proc/self/fd/%d", point);
    int rw = !strcmp(mode, "rw");
    int fd = (int)syscall(SYS_open_tree, AT_FDCWD, src, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC);
    if (fd < 0) return die("clone the volume", src);
    struct mount_attr attr = {.attr_set = (rw ? 0 : MOUNT_ATTR_RDONLY) | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV};
    /* A volume's idmapping swaps the canonical owner and the sandbox's uid only, never
       host root and the sandbox's root: what root in the sandbox writes there would be
       host root's files (a set-user-id root file in a host directory, an admin's
       root-owned files changed). Its root cannot create files there (EOVERFLOW). */
    int vol_userns = o->userns;
    if (o->root_uid && o->canonical && !o->root_build) {
        uint32_t a[1] = {o->canonical}, b[1] = {o->uid};
        if ((vol_userns = idmap_userns(a, b, 1)) < 0) { close(point); return die("make the volume idmapping", NULL); }
    }
    if (vol_userns >= 0) { attr.attr_set |= MOUNT_ATTR_IDMAP; attr.userns_fd = (uint64_t)vol_userns; }
    snprintf(lower, sizeof lower, "rw/v%d", k);
    int cow = strcmp(mode, "rw") != 0;  /* cow and ro: overlays */
    int set = (int)syscall(SYS_mount_setattr, fd, "", AT_EMPTY_PATH, &attr, sizeof attr);
    if (vol_userns >= 0 && vol_userns != o->userns) close(vol_userns);
    if (set != 0 ||
        (cow && mkdir(lower, 0700) != 0) ||
        (cow ? syscall(SYS_move_mount, fd, "", AT_FDCWD, lower, MOVE_MOUNT_F_EMPTY_PATH)
             : syscall(SYS_move_mount, fd, "", point, "", MOVE_MOUNT_F_EMPTY_PATH | MOVE_MOUNT_T_EMPTY_PATH)) != 0) {
        close(fd);
        close(point);
        return die("attach the volume at", c2 + 1);
    }
    close(fd);
    if (!cow) { close(point); return 0; }
    if (!strcmp(mode, "ro")) {  /* no upper: overlay wants two lowers, the 2nd empty */
        char empty[64];
        snprintf(empty, sizeof empty, "rw/ve%d", k);
        if (mkdir(empty, 0755) != 0) { close(point); return die("mkdir", empty); }
        snprintf(data, sizeof data, "lowerdir=%s:%s", lower, empty);
        int rc = mount("corral-volume", dest, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV, data);
        close(point);
        return rc != 0 ? die("mount the volume's overlay on", c2 + 1) : 0;
    }
    char upper[64], work[64];
    snprintf(upper, sizeof upper, "rw/vu%d", k);
    snprintf(work, sizeof work, "rw/vw%d", k);
    if (mkdir(upper, 0755) != 0 || mkdir(work, 0700) != 0 || chown(upper, o->uid, o->gid) != 0) {
        close(point);
        return die("make the volume's upper", upper);
    }
    snprintf(data, sizeof data, "lowerdir=%s,upperdir=%s,workdir=%s", lower, upper, work);
    int rc = mount("corral-volume", dest, "overlay", MS_NOSUID | MS_NODEV, data);
    close(point);
    return rc != 0 ? die("mount the volume's overlay on", c2 + 1) : 0;
}

/*
 * The sandbox's root lives in a mount namespace of its own, made here: the host's
 * mount table never grows with the number of sandboxes (every bwrap start copies the
 * whole table, and mount(2) serialises on it), and when the last process of the
 * sandbox exits the kernel drops the mounts by itself: a crash cannot leak them.
 * Paths are relative to ROOTDIR (our cwd meanwhile), so the overlay's options, which
 * the sandbox reads in /proc/self/mountinfo, name no host path:
 *   ROOTDIR/rw      tmpfs of disk_mb (or an ext4 image of it: mount_disk): the cap
 *                   on everything the sandbox writes
 *   ROOTDIR/rw/shm  the sandbox's /dev/shm (sticky, world-writable, like the host's)
 *   ROOTDIR/rw/sys  its /sys: only devices/system/cpu, its CPUs (set_cpus)
 *   ROOTDIR/rw/N    the Nth lower layer (LOWER is a ':' list), an idmapped clone
 *   ROOTDIR/root    overlay: rw/0:rw/1:... read-only, rw/upper private and writable
 */
static int mount_root(struct launch_opts *o) {
    char path[4300], data[16384], *lowers = strdup(o->lower);
    int n_lowers = 1;
    for (const char *c = o->lower; *c; c++) n_lowers += *c == ':';
    if (!lowers) return die("strdup", NULL);
    unsigned long sys_inodes = 0; /* rw/sys: 4 directories, 3 files, one per CPU */
    if (o->cpus) { sys_inodes = 8; for (const char *c = o->cpus; *c; c++) sys_inodes += *c == ','; }
    if (unshare(CLONE_NEWNS) != 0) return die("unshare", "mount namespace");
    /* Nothing mounted here may propagate back to the host. */
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) return die("make mounts private", NULL);
    if (chdir(o->rootdir) != 0) return die("chdir", o->rootdir);
    /* A build step as root (corral.runtime.rootbuild): the image's root-owned files are
       the sandbox's (its root is this uid in its user namespace), the sandbox user's are
       nobody's; what it writes is committed as root's. */
    if (o->root_build && o->uid != (uid_t)-1) {
        uint32_t a[1] = {0}, b[1] = {o->uid};
        drop_premade(o);  /* made with the layers' idmapping, not this one */
        if (o->userns >= 0) close(o->userns);
        if ((o->userns = idmap_userns(a, b, 1)) < 0) return die("make the root idmapping for uid", NULL);
    }
    if (o->canonical && o->uid != (uid_t)-1 && o->userns < 0 && (o->userns = layer_idmap(o)) < 0)
        return die("make the idmapping for uid", NULL);
    /* nr_inodes: the sandbox's own, plus a mount point per lower layer, rw/pts, rw/shm,
       rw/sys (its files, a directory per CPU) and three directories per volume */
    if (o->inodes)
        snprintf(data, sizeof data, "size=%lum,nr_inodes=%lu,mode=0711", o->disk_mb ? o->disk_mb : 1024, o->inodes + (unsigned long)n_lowers + 2 + sys_inodes + 3ul * (unsigned long)o->n_volumes);
    else
        snprintf(data, sizeof data, "size=%lum,mode=0711", o->disk_mb ? o->disk_mb : 1024);
    if (o->disk_image) {
        if (mount_disk(o->disk_image, "rw") != 0) return -1;
    } else if (mount("corral-rw", "rw", "tmpfs", MS_NOSUID | MS_NODEV, data) != 0) return die("mount tmpfs on", "rw");
    if (mkdir("rw/upper", 0755) != 0 || mkdir("rw/work", 0700) != 0) return die("mkdir", "rw/upper");
    /* The sandbox's own devpts (bound over bwrap's at /dev/pts): at most SANDBOX_PTYS
       terminals, so one sandbox cannot use up the pseudo-terminals every devpts on the
       host shares (kernel.pty.max); its ptmx is root's, so the sandbox cannot chmod it. */
    if (mkdir("rw/pts", 0755) != 0) return die("mkdir", "rw/pts");
    /* /dev/shm (bound there by bwrap): in this tmpfs, so under its size and inodes */
    if (mkdir("rw/shm", 0755) != 0 || chmod("rw/shm", 01777) != 0) return die("mkdir", "rw/shm");
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
    if (o->cpus && set_cpus(o->cpus) != 0) return -1;
    int len = snprintf(data, sizeof data, "lowerdir=");
    char *save = NULL;
    int i = 0;
    for (char *l = strtok_r(lowers, ":", &save); l; l = strtok_r(NULL, ":", &save), i++) {
        snprintf(path, sizeof path, "rw/%d", i);
        if (attach_lower(o, i, l, path) != 0) return -1;
        len += snprintf(data + len, sizeof data - len, "%s%s", i ? ":" : "", path);
    }
    free(lowers);
    drop_premade(o);
    len += snprintf(data + len, sizeof data - len, ",upperdir=rw/upper,workdir=rw/work");
    if (len >= (int)sizeof data) { errno = E2BIG; return die("overlay options for", "root"); }
    if (mount("corral-root", "root", "overlay", MS_NOSUID | MS_NODEV, data) != 0) return die("mount overlay on", "root");
    for (int k = 0; k < o->n_volumes; k++)
        if (mount_volume(o, o->volumes[k], k) != 0) return -1;
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
    struct launch_opts o = {.uid = (uid_t)-1, .gid = (gid_t)-1, .userns = -1, .sb_userns = -1};
    int ready = 0, host_net_fd = -1, in_prenet = 0;
    clean_kernel_state(); /* before the cgroups are joined (clean.c) */
    if (parse_launch(argc - 2, argv + 2, &o, &ready) != 0) return 111;
    clean_start(); /* not the daemon's umask and limits (clean.c) */
    if (ready) {
        /* The idmapping costs a fork: made while the slot waits, not at create. */
        if (o.canonical && o.uid != (uid_t)-1 && (o.userns = layer_idmap(&o)) < 0)
            return die("make the idmapping for uid", NULL);
        if (o.prelower && o.userns >= 0) premake_lowers(&o);
        if (o.root_uid && o.uid != (uid_t)-1 && (o.sb_userns = sandbox_userns(&o)) < 0)
            return die("make the sandbox's user namespace for uid", NULL);
        /* "N": ready, in a network namespace of its own (netns.c); "R": ready */
        if (o.prenet && (in_prenet = enter_prenet(&host_net_fd)) < 0)
            return die("go back to the host's network namespace", NULL);
        if (write(1, in_prenet ? "N" : "R", 1) != 1) return 111;
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
    drop_premade(&o);  /* (a restore without a root, or nothing to mount: unused) */
    if (o.rootdir && o.exec_root && o.kdat) seed_kdat(o.kdat);
    /* Inherited by bwrap and the agent (commands go higher still: exec.c). Sandbox
       code is the first thing a host-wide OOM should kill, before the daemon or any
       host service, and it must not be able to lower itself: written with
       CAP_SYS_RESOURCE, this value is also the floor (oom_score_adj_min) that nothing
       in the sandbox can go below. A negative value for the agent would be that floor
       too (a command could take -998 and outlive the host's own processes). Without
       CAP_SYS_RESOURCE (some containers) raising still works, unpinned. */
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom >= 0) { if (write(oom, AGENT_OOM_SCORE_ADJ, strlen(AGENT_OOM_SCORE_ADJ)) < 0) {} close(oom); }
    if (o.nofile && set_open_files(o.nofile) != 0) return 111;
    /* bwrap (0.8) cannot join a network namespace: we join it here, as root, and bwrap
       runs without --unshare-net. The namespace belongs to the host's user namespace,
       so nothing in the sandbox (root in its own user namespace included) may change
       its addresses, routes or firewall. */
    if (in_prenet && !o.netns && o.host_net && leave_prenet(&host_net_fd) != 0)
        return die("go back to the host's network namespace", NULL);
    if (host_net_fd >= 0) close(host_net_fd);
    if (o.netns) {
        int nfd = open(o.netns, O_RDONLY | O_CLOEXEC);
        if (nfd < 0 || setns(nfd, CLONE_NEWNET) != 0) return die("join network namespace", o.netns);
        close(nfd);
    }
    if (!o.exec_root && o.gid != (gid_t)-1 && (setgroups(0, NULL) != 0 || setresgid(o.gid, o.gid, o.gid) != 0))
        return die("setgid", NULL);
    if (!o.exec_root && o.uid != (uid_t)-1 && setresuid(o.uid, o.uid, o.uid) != 0) return die("setuid", NULL);
    /* bwrap enters the sandbox's user namespace (--userns): "@USERNS@" in its argv is
       the descriptor, kept open across exec (a build step as root has none: bwrap makes
       its own namespace with --unshare-user). */
    static char nsfd[16];
    for (char **a = o.prog; *a; a++)
        if (!strcmp(*a, "@USERNS@")) {
            if (o.sb_userns < 0 || o.root_build) { errno = EINVAL; return die("no user namespace for", *a); }
            snprintf(nsfd, sizeof nsfd, "%d", o.sb_userns);
            *a = nsfd;
            if (fcntl(o.sb_userns, F_SETFD, 0) != 0) return die("fcntl", "userns");
        }
    execv(o.prog[0], o.prog);
    return die("exec", o.prog[0]);
}
