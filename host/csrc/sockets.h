/* Socket helpers shared by the engines. */
#ifndef SWITCHAGG_SOCKETS_H
#define SWITCHAGG_SOCKETS_H

/* Enlarge a socket's buffers; as root SO_*BUFFORCE passes net.core.*mem_max. */
void sa_set_sockbuf(int fd, int bytes);
/* Send with DF set and never fragment locally (IP_PMTUDISC_DO): a datagram above the path MTU
 * fails with EMSGSIZE instead of leaving as fragments. 0, or -1 with errno. */
int sa_set_dont_fragment(int fd);
/* The path MTU of a connected socket (IP_MTU), or 0 if the kernel does not say. */
int sa_path_mtu(int fd);

#endif
