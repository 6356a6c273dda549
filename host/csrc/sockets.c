#include "sockets.h"

#include "protocol.h"

#include <netinet/in.h>
#include <netinet/udp.h>
#include <stdlib.h>
#include <string.h>
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

int sa_gso_allowed(void) {
    const char *v = getenv("SWITCHAGG_GSO");
    return !(v && strcmp(v, "0") == 0);
}

int sa_gso_segments(size_t pkt_len, int mtu) {
    if (pkt_len == 0 || (mtu > 0 && pkt_len + SA_IPV4_UDP_HEADERS > (size_t)mtu)) return 0;
    size_t segs = SA_MAX_UDP_PAYLOAD / pkt_len;
    if (segs > SA_GSO_MAX_SEGS) segs = SA_GSO_MAX_SEGS;
    return segs >= 2 ? (int)segs : 0;
}

int sa_set_gso(int fd, int gso_size) { return setsockopt(fd, SOL_UDP, UDP_SEGMENT, &gso_size, sizeof gso_size); }

int sa_set_gro(int fd, int on) { return setsockopt(fd, SOL_UDP, UDP_GRO, &on, sizeof on); }

int sa_gro_size(const void *msghdr) {
    const struct msghdr *m = msghdr;
    if (m->msg_control == NULL) return 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c != NULL; c = CMSG_NXTHDR((struct msghdr *)m, c)) {
        if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) {
            int size;
            memcpy(&size, CMSG_DATA(c), sizeof size);
            return size;
        }
    }
    return 0;
}
