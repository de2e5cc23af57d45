/*
 * corral-agent, a warm launcher's own network namespace: part of agent.c (a unity
 * build: agent.c includes this file before launch.c).
 *
 * A sandbox without a network gets an empty namespace, loopback only. bwrap's
 * --unshare-net makes one at create (~1-2 ms of CPU here, more wall time when the
 * kernel is busy tearing others down); a warm slot (--ready --prenet 1) makes it
 * while it waits instead, by unshare(2) in the launcher itself, so the namespace is
 * this one process's and its children's only: nothing names it on a file system, no
 * descriptor of it is handed to anyone, and it goes away with the sandbox's last
 * process. It belongs to the host's user namespace (we are root there), so nothing in
 * the sandbox, root in its own user namespace included, may change its interfaces,
 * addresses, routes or firewall (as with a policy's namespace, --netns).
 */

#include <net/if.h>

/* Bring up "lo" in the current network namespace: the kernel gives it 127.0.0.1/8
   and ::1 itself (what bwrap's --unshare-net sets up). */
static int loopback_up(void) {
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) return -1;
    int rc = ioctl(s, SIOCGIFFLAGS, &ifr);
    if (rc == 0) {
        ifr.ifr_flags |= IFF_UP;
        rc = ioctl(s, SIOCSIFFLAGS, &ifr);
    }
    int saved = errno;
    close(s);
    errno = saved;
    return rc;
}

/*
 * Move this launcher into a new, empty network namespace with loopback up, keeping a
 * descriptor of the one it was in (close-on-exec) in *HOST_NET, so that a sandbox
 * that is to have the host's network (or a checkpointable one, whose namespace bwrap
 * makes as before) can go back: leave_prenet. Returns 1 if it moved, 0 if it could
 * not (no CAP_SYS_ADMIN: a rootless engine; the sandbox then gets bwrap's).
 */
static int enter_prenet(int *host_net) {
    *host_net = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (*host_net < 0) return 0;
    if (unshare(CLONE_NEWNET) != 0) {
        close(*host_net);
        *host_net = -1;
        return 0;
    }
    if (loopback_up() != 0) {
        /* half made: back where we were, as if it had failed */
        if (setns(*host_net, CLONE_NEWNET) != 0) return -1;
        close(*host_net);
        *host_net = -1;
        return 0;
    }
    return 1;
}

/* Back to the namespace enter_prenet left (the prepared one is freed with us). */
static int leave_prenet(int *host_net) {
    if (*host_net < 0) { errno = EBADF; return -1; }
    int rc = setns(*host_net, CLONE_NEWNET);
    close(*host_net);
    *host_net = -1;
    return rc;
}
