/*
 * corral-agent, the launcher's mount table made small before it becomes bwrap: part of
 * agent.c (a unity build: agent.c includes this file before launch.c).
 *
 * The launcher's private mount namespace starts as a copy of the host's whole table
 * (launch.c, mount_root). bwrap copies it again into the sandbox's namespace, reads all
 * of /proc/self/mountinfo at each bind it makes (about seven a sandbox: the kernel
 * formats every line each time), and every copied mount is torn down again when the
 * sandbox ends. Host mounts that neither bwrap nor the sandbox can use (/sys and its
 * cgroup hierarchies, /run/netns, other sandboxes' volumes, a host's loop mounts)
 * cost each of those steps for nothing; a sandbox never sees them (bwrap detaches its
 * old root). So they are detached here, in our namespace only (mount_root made every
 * mount private: nothing propagates to the host).
 *
 * Kept: "/", and every mount that leads to or lies under a host path bwrap is given
 * (its own binary, the source of each bind: the sandbox's root, a GPU's nodes and
 * files, resolv.conf), the sandbox's directory, and what bwrap's exec, --proc and --dev
 * take from the host: /proc, /dev, /usr, /etc, /lib, /lib64, /bin, /sbin. A failure
 * leaves the table as it was: this only saves time.
 */

#define PRUNE_KEEP_MAX 96

/* Whether PATH is DIR or lies under it ("/" holds everything). */
static int path_under(const char *path, const char *dir) {
    size_t n = strlen(dir);
    if (n == 1 && dir[0] == '/') return path[0] == '/';
    return strncmp(path, dir, n) == 0 && (path[n] == 0 || path[n] == '/');
}

/* mountinfo escapes space, tab, newline and backslash as \ooo: undo it in place. */
static void unescape_octal(char *s) {
    char *out = s;
    for (; *s; s++) {
        if (s[0] == '\\' && s[1] >= '0' && s[1] <= '3' && s[2] >= '0' && s[2] <= '7' && s[3] >= '0' && s[3] <= '7') {
            *out++ = (char)((s[1] - '0') * 64 + (s[2] - '0') * 8 + (s[3] - '0'));
            s += 3;
        } else {
            *out++ = *s;
        }
    }
    *out = 0;
}

static void prune_mounts(const char *rootdir, char **prog) {
    static const char *host[] = {"/proc", "/dev", "/usr", "/etc", "/lib", "/lib64", "/bin", "/sbin"};
    const char *keep[PRUNE_KEEP_MAX];
    int n_keep = 0;
    for (size_t i = 0; i < sizeof host / sizeof *host; i++) keep[n_keep++] = host[i];
    keep[n_keep++] = rootdir;
    for (char **a = prog; *a; a++) {
        /* the program itself, and the host side of each bind (the other paths in a
           bwrap command line are the sandbox's: destinations) */
        int source = a == prog || (a[1] && (!strcmp(*a, "--bind") || !strcmp(*a, "--ro-bind") ||
                                            !strcmp(*a, "--dev-bind") || !strcmp(*a, "--bind-try") ||
                                            !strcmp(*a, "--ro-bind-try") || !strcmp(*a, "--dev-bind-try")));
        const char *path = a == prog ? *a : a[1];
        if (!source || path[0] != '/') continue;
        if (n_keep == PRUNE_KEEP_MAX) return;  /* too many paths to judge: keep all */
        keep[n_keep++] = path;
    }
    struct buf b = {0};
    char tmp[8192];
    int fd = open("/proc/self/mountinfo", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    for (ssize_t r; (r = read(fd, tmp, sizeof tmp)) != 0;) {
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { close(fd); free(b.p); return; }
        buf_put(&b, tmp, (size_t)r);
    }
    close(fd);
    buf_put(&b, "", 1);
    /* the mount points to detach, in table order; one under another detached goes with it */
    char *gone[512];
    int n_gone = 0;
    for (char *line = b.p, *next; line && *line && n_gone < 512; line = next) {
        next = strchr(line, '\n');
        if (next) *next++ = 0;
        char *f = line;  /* fields: id parent major:minor root MOUNT-POINT ... */
        for (int k = 0; k < 4 && f; k++) { f = strchr(f, ' '); if (f) f++; }
        if (!f) continue;
        char *end = strchr(f, ' ');
        if (end) *end = 0;
        unescape_octal(f);
        if (f[0] != '/' || !strcmp(f, "/")) continue;
        int needed = 0, covered = 0;
        for (int k = 0; k < n_keep && !needed; k++)
            needed = path_under(keep[k], f) || path_under(f, keep[k]);
        for (int k = 0; k < n_gone && !covered; k++) covered = path_under(f, gone[k]);
        if (!needed && !covered) gone[n_gone++] = f;
    }
    for (int k = 0; k < n_gone; k++)
        while (umount2(gone[k], MNT_DETACH | UMOUNT_NOFOLLOW) == 0) {}  /* stacked mounts too */
    free(b.p);
}
