#include "sockets.h"

#include <netinet/in.h>
#include <sys/socket.h>

void sa_set_sockbuf(int fd, int bytes) {
    /* Try the forced variants first (root), then the capped ones. */
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &bytes, sizeof bytes) != 0)
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &bytes, sizeof bytes) != 0)
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
}

int sa_set_dont_fragment(int fd) {
    int v = IP_PMTUDISC_DO;
    return setsockopt(fd, IPPROTO_IP, IP_MTU_DISCOVER, &v, sizeof v);
}

int sa_path_mtu(int fd) {
    int mtu = 0;
    socklen_t l = sizeof mtu;
    return getsockopt(fd, IPPROTO_IP, IP_MTU, &mtu, &l) == 0 ? mtu : 0;
}
