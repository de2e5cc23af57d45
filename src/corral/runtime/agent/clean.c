/*
 * What a sandbox starts with whatever the daemon inherited (included by agent.c, used
 * by launch.c before it becomes bwrap): the umask and resource limits a fresh login on
 * a freshly booted machine has, not the daemon's. A daemon inherits its parent's: a CI
 * runner's umask 077 or 000, RLIMIT_FSIZE of a megabyte, a core limit of "unlimited",
 * a 1 MiB stack; each reached every command (tests/security/test_inherited_state.py).
 * Signals are the agent's to reset (exec.c: default_inherited_ignored), the
 * environment is never inherited (launcher.py: env={}); RLIMIT_NOFILE is the
 * sandbox's open_files (launch --nofile: set_open_files). RLIMIT_SIGPENDING stays as
 * it is: the kernel sizes it to the machine's memory at boot.
 */

#define SANDBOX_UMASK 022

struct clean_limit {
    int resource;
    rlim_t soft, hard;
};

/* Linux's own defaults (RLIMIT_MEMLOCK's since 5.16, RLIMIT_MSGQUEUE's since 2.6.8);
   no core dumps at all: a core_pattern pipe would run a host program on the sandbox's
   memory, and a core file is disk the sandbox did not ask for. RLIMIT_NPROC: none, the
   pids cgroup is the sandbox's process limit (its own uid counts nothing else). */
static const struct clean_limit clean_limits[] = {
    {RLIMIT_CPU, RLIM_INFINITY, RLIM_INFINITY},
    {RLIMIT_FSIZE, RLIM_INFINITY, RLIM_INFINITY},
    {RLIMIT_DATA, RLIM_INFINITY, RLIM_INFINITY},
    {RLIMIT_STACK, 8 << 20, RLIM_INFINITY},
    {RLIMIT_CORE, 0, 0},
    {RLIMIT_RSS, RLIM_INFINITY, RLIM_INFINITY},
    {RLIMIT_NPROC, RLIM_INFINITY, RLIM_INFINITY},
    {RLIMIT_MEMLOCK, 8 << 20, 8 << 20},
    {RLIMIT_AS, RLIM_INFINITY, RLIM_INFINITY},
    {RLIMIT_LOCKS, RLIM_INFINITY, RLIM_INFINITY},
    {RLIMIT_MSGQUEUE, 819200, 819200},
    {RLIMIT_NICE, 0, 0},
    {RLIMIT_RTPRIO, 0, 0},
    {RLIMIT_RTTIME, RLIM_INFINITY, RLIM_INFINITY},
};

/* The sandbox's umask and limits, set in the launcher (as root, before it drops to the
   sandbox's uid: raising a hard limit needs CAP_SYS_RESOURCE, which it has on the host
   unless a container took it away; then the soft limit goes as near as the hard one
   lets it, and the rest stays as inherited). */
static void clean_start(void) {
    umask(SANDBOX_UMASK);
    for (size_t k = 0; k < sizeof clean_limits / sizeof *clean_limits; k++) {
        const struct clean_limit *c = &clean_limits[k];
        struct rlimit rl = {c->soft, c->hard};
        if (setrlimit(c->resource, &rl) == 0) continue;
        struct rlimit now;
        if (getrlimit(c->resource, &now) != 0) continue;
        rl.rlim_max = now.rlim_max;
        rl.rlim_cur = c->soft <= now.rlim_max ? c->soft : now.rlim_max;
        if (c->hard < now.rlim_max) rl.rlim_max = c->hard; /* lowering needs no privilege */
        if (rl.rlim_cur > rl.rlim_max) rl.rlim_cur = rl.rlim_max;
        if (setrlimit(c->resource, &rl) != 0) {}
    }
}

static int die(const char *what, const char *arg);

/* RLIMIT_NOFILE: the sandbox's open_files, soft and hard. 0, or 111 with what to do. */
static int set_open_files(rlim_t n) {
    struct rlimit rl = {n, n}, now;
    if (setrlimit(RLIMIT_NOFILE, &rl) == 0) return 0;
    int err = errno;
    if (err == EPERM && getrlimit(RLIMIT_NOFILE, &now) == 0 && now.rlim_max < n) {
        /* the daemon's own hard limit, and no CAP_SYS_RESOURCE to go past it */
        fprintf(stderr, "corral-agent launch: open_files %llu is above the daemon's hard "
                "limit on open files (%llu), which it may not raise here: ask for "
                "open_files <= %llu, or start the daemon with a higher one (ulimit -Hn; "
                "systemd: LimitNOFILE=)\n", (unsigned long long)n,
                (unsigned long long)now.rlim_max, (unsigned long long)now.rlim_max);
        return 111;
    }
    errno = err;
    return die("setrlimit", NULL);
}
