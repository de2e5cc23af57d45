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
 *
 * Other state the kernel hands down across fork and execve is put back too
 * (clean_kernel_state): a personality (`setarch -R`: no ASLR for the agent or any
 * command; `linux32`), a real-time scheduling policy (`chrt -f`: with RT group
 * scheduling no launcher could join its cgroup, EINVAL; without it a command's CPU time
 * escaped the sandbox's CFS quota), a real-time I/O class (`ionice -c1`: its I/O ahead
 * of the host's), a timer slack (systemd's TimerSlackNSec=), transparent huge pages
 * disabled and the IO_FLUSHER flag (prctl). A nice level, SCHED_BATCH or SCHED_IDLE and
 * a best-effort or idle I/O class stay: an operator who lowers a daemon means its
 * sandboxes too (docs/inherited.md).
 */

#include <sys/personality.h>

#ifndef SCHED_DEADLINE
#define SCHED_DEADLINE 6
#endif
#ifndef SCHED_RESET_ON_FORK
#define SCHED_RESET_ON_FORK 0x40000000
#endif
#ifndef PR_SET_IO_FLUSHER
#define PR_SET_IO_FLUSHER 57
#define PR_GET_IO_FLUSHER 58
#endif
#define CLEAN_TIMER_SLACK_NS 50000UL /* the kernel's own (init_task's) */
#define CLEAN_IOPRIO_CLASS_RT 1
#define CLEAN_IOPRIO_WHO_PROCESS 1

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

/* Called first in the launcher, as root, before it joins its cgroups (an RT task may not
   join a group without an RT budget). Raw syscalls: musl stubs sched_setscheduler. */
static void clean_kernel_state(void) {
    if (personality(0xffffffff) != PER_LINUX && personality(PER_LINUX) < 0) {}
    long policy = syscall(SYS_sched_getscheduler, 0);
    if (policy >= 0) {
        policy &= ~(long)SCHED_RESET_ON_FORK;
        if (policy == SCHED_FIFO || policy == SCHED_RR || policy == SCHED_DEADLINE) {
            struct sched_param sp = {0}; /* SCHED_OTHER keeps the nice level */
            if (syscall(SYS_sched_setscheduler, 0, SCHED_OTHER, &sp) != 0) {}
        }
    }
    long io = syscall(SYS_ioprio_get, CLEAN_IOPRIO_WHO_PROCESS, 0);
    if (io >= 0 && (io >> 13) == CLEAN_IOPRIO_CLASS_RT)
        if (syscall(SYS_ioprio_set, CLEAN_IOPRIO_WHO_PROCESS, 0, 0) != 0) {} /* none: from nice */
    if (prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0) != (int)CLEAN_TIMER_SLACK_NS)
        if (prctl(PR_SET_TIMERSLACK, CLEAN_TIMER_SLACK_NS, 0, 0, 0) != 0) {}
    if (prctl(PR_GET_THP_DISABLE, 0, 0, 0, 0) > 0 && prctl(PR_SET_THP_DISABLE, 0, 0, 0, 0) != 0) {}
    if (prctl(PR_GET_IO_FLUSHER, 0, 0, 0, 0) > 0 && prctl(PR_SET_IO_FLUSHER, 0, 0, 0, 0) != 0) {}
}

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
