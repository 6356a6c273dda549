/* Socket helpers shared by the engines. */
#ifndef SWITCHAGG_SOCKETS_H
#define SWITCHAGG_SOCKETS_H

/* Enlarge a socket's buffers; as root SO_*BUFFORCE passes net.core.*mem_max. */
void sa_set_sockbuf(int fd, int bytes);

#endif
