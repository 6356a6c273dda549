/* LD_PRELOAD fault injector: the kernel refusing UDP GSO, as it does (EIO) for a device that cannot finish
 * checksums or (ENOPROTOOPT) before Linux 4.18, which no test machine's kernel does by itself any more.
 * A sendmmsg or sendmsg that would send a GSO train (a datagram longer than the socket's UDP_SEGMENT, or
 * one with a UDP_SEGMENT cmsg) fails with EIO; everything else goes to libc. Each refusal appends a line
 * to $REFUSE_GSO_LOG, so a test can tell the refusal happened. Used by tests/test_gso_refused.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/udp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#ifndef UDP_SEGMENT
#define UDP_SEGMENT 103
#endif
#define MAX_FDS 4096

static int segment[MAX_FDS]; /* the socket's UDP_SEGMENT, per fd */

int setsockopt(int fd, int level, int name, const void *val, socklen_t len) {
    static int (*real)(int, int, int, const void *, socklen_t);
    if (!real) real = (int (*)(int, int, int, const void *, socklen_t))dlsym(RTLD_NEXT, "setsockopt");
    if (level == SOL_UDP && name == UDP_SEGMENT && fd >= 0 && fd < MAX_FDS && len >= sizeof(int))
        segment[fd] = *(const int *)val;
    return real(fd, level, name, val, len);
}

static int is_train(int fd, const struct msghdr *m) {
    size_t total = 0;
    for (size_t i = 0; i < m->msg_iovlen; i++) total += m->msg_iov[i].iov_len;
    if (fd >= 0 && fd < MAX_FDS && segment[fd] > 0 && total > (size_t)segment[fd]) return 1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR((struct msghdr *)m, c))
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_SEGMENT) {
            int seg;
            memcpy(&seg, CMSG_DATA(c), sizeof seg);
            if (seg > 0 && total > (size_t)seg) return 1;
        }
    return 0;
}

static int refuse(void) {
    const char *log = getenv("REFUSE_GSO_LOG");
    if (log) {
        int fd = open(log, O_WRONLY | O_APPEND | O_CREAT, 0600);
        if (fd >= 0) {
            (void)!write(fd, "refused\n", 8);
            close(fd);
        }
    }
    errno = EIO;
    return -1;
}

int sendmmsg(int fd, struct mmsghdr *v, unsigned int n, int flags) {
    static int (*real)(int, struct mmsghdr *, unsigned int, int);
    if (!real) real = (int (*)(int, struct mmsghdr *, unsigned int, int))dlsym(RTLD_NEXT, "sendmmsg");
    for (unsigned int i = 0; i < n; i++)
        if (is_train(fd, &v[i].msg_hdr)) {
            if (i == 0) return refuse();
            return real(fd, v, i, flags); /* what goes before the train, as the kernel does */
        }
    return real(fd, v, n, flags);
}

ssize_t sendmsg(int fd, const struct msghdr *m, int flags) {
    static ssize_t (*real)(int, const struct msghdr *, int);
    if (!real) real = (ssize_t (*)(int, const struct msghdr *, int))dlsym(RTLD_NEXT, "sendmsg");
    if (is_train(fd, m)) return refuse();
    return real(fd, m, flags);
}
