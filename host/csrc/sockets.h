/* Socket helpers shared by the engines. */
#ifndef SWITCHAGG_SOCKETS_H
#define SWITCHAGG_SOCKETS_H

#include <stddef.h>

/* Enlarge a socket's buffers; as root SO_*BUFFORCE passes net.core.*mem_max. */
void sa_set_sockbuf(int fd, int bytes);
/* Send with DF set and never fragment locally (IP_PMTUDISC_DO): a datagram above the path MTU
 * fails with EMSGSIZE instead of leaving as fragments. 0, or -1 with errno. */
int sa_set_dont_fragment(int fd);
/* The path MTU of a connected socket (IP_MTU), or 0 if the kernel does not say. */
int sa_path_mtu(int fd);

/* UDP GSO and GRO: one sendmsg hands the kernel up to SA_GSO_MAX_SEGS frame-sized datagrams, which it
 * cuts at the device (or never, over veth and loopback, to a socket with GRO on), and one recvmsg on a
 * socket with UDP_GRO may return several datagrams of one size back to back, the size in a cmsg. */
#define SA_GSO_MAX_SEGS 64   /* the kernel's UDP_MAX_SEGMENTS */
#define SA_GRO_BUF 65536     /* a coalesced receive is at most one IP packet's worth */
/* Whether GSO/GRO may be used: not with SWITCHAGG_GSO=0 in the environment (tests force the
 * fallback with it; the engines fall back by themselves where the kernel refuses). */
int sa_gso_allowed(void);
/* Datagrams of pkt_len bytes one GSO send carries: 0 when fewer than 2 fit one IP packet, or when one
 * does not fit the path MTU (mtu 0: unknown, assumed to fit). */
int sa_gso_segments(size_t pkt_len, int mtu);
/* setsockopt UDP_SEGMENT (0: off) and UDP_GRO; 0, or -1 with errno (ENOPROTOOPT: kernel < 4.18/5.0). */
int sa_set_gso(int fd, int gso_size);
int sa_set_gro(int fd, int on);
/* The segment size a received message's UDP_GRO cmsg carries, or 0 (not coalesced). */
int sa_gro_size(const void *msghdr);

#endif
