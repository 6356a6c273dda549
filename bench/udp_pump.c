/* The raw UDP pump: what this machine's kernel moves between two UDP sockets on loopback with
 * datagrams of a given size, with the aggregator's own batching (sendmmsg / recvmmsg, 64 at a time)
 * and nothing else: the baseline of bench/bench_aggregator_threads.py, which compiles it.
 *
 *   udp_pump DATAGRAM_BYTES SECONDS [SENDERS [RECEIVERS [gso]]]
 *
 * With `gso` the senders hand the kernel up to 64 datagrams per send (UDP_SEGMENT: one buffer cut
 * into DATAGRAM_BYTES segments) and the receivers take coalesced buffers (UDP_GRO), counting the
 * datagrams in each by the segment size its cmsg gives: the engines' GSO/GRO path, at the same
 * datagram size. It also prints the process's CPU seconds (user + system, getrusage), so that
 * `cpu_seconds / (received * DATAGRAM_BYTES * 8 / 1e9)` is its CPU per Gbit.
 *
 * SENDERS threads blast datagrams (each from its own socket) at RECEIVERS threads (one socket each,
 * an SO_REUSEPORT group when more than one) for SECONDS; prints one JSON line: datagrams sent and
 * received, and the seconds it ran. The receive rate is the pump's rate (a sender that outruns its
 * receiver only fills the queue, the surplus is dropped by the kernel). */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/udp.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BATCH 64
#define MAX_THREADS 16

static atomic_int stop;
static struct sockaddr_in target;
static size_t dgram;
static int gso;       /* segments per send (0: one datagram per send) */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void big_buffers(int fd) {
    int bytes = 64 << 20;
    if (setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &bytes, sizeof bytes) != 0)
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &bytes, sizeof bytes);
    if (setsockopt(fd, SOL_SOCKET, SO_SNDBUFFORCE, &bytes, sizeof bytes) != 0)
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof bytes);
}

struct worker {
    pthread_t tid;
    int fd;
    uint64_t count;
};

static void *send_loop(void *p) {
    struct worker *w = p;
    size_t per = gso ? (size_t)gso : 1;
    uint8_t *buf = calloc(per, dgram);
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    memset(msgs, 0, sizeof msgs);
    if (gso) {
        int size = (int)dgram;
        if (setsockopt(w->fd, SOL_UDP, UDP_SEGMENT, &size, sizeof size) != 0) perror("UDP_SEGMENT");
    }
    for (int i = 0; i < BATCH; i++) {
        iov[i].iov_base = buf;
        iov[i].iov_len = dgram * per;
        msgs[i].msg_hdr.msg_iov = &iov[i];
        msgs[i].msg_hdr.msg_iovlen = 1;
        msgs[i].msg_hdr.msg_name = &target;
        msgs[i].msg_hdr.msg_namelen = sizeof target;
    }
    while (!atomic_load(&stop)) {
        int r = sendmmsg(w->fd, msgs, BATCH, 0);
        if (r > 0) w->count += (uint64_t)r * per;
    }
    free(buf);
    return NULL;
}

static void *recv_loop(void *p) {
    struct worker *w = p;
    uint8_t *bufs = malloc((size_t)BATCH * 65536);
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    char ctrl[BATCH][CMSG_SPACE(sizeof(int))];
    int one = 1;
    if (gso && setsockopt(w->fd, SOL_UDP, UDP_GRO, &one, sizeof one) != 0) perror("UDP_GRO");
    while (!atomic_load(&stop)) {
        struct pollfd pfd = {.fd = w->fd, .events = POLLIN};
        if (poll(&pfd, 1, 50) <= 0) continue;
        memset(msgs, 0, sizeof msgs);
        for (int i = 0; i < BATCH; i++) {
            iov[i].iov_base = bufs + (size_t)i * 65536;
            iov[i].iov_len = 65536;
            msgs[i].msg_hdr.msg_iov = &iov[i];
            msgs[i].msg_hdr.msg_iovlen = 1;
            msgs[i].msg_hdr.msg_control = gso ? ctrl[i] : NULL;
            msgs[i].msg_hdr.msg_controllen = gso ? sizeof ctrl[i] : 0;
        }
        int r = recvmmsg(w->fd, msgs, BATCH, MSG_DONTWAIT, NULL);
        for (int i = 0; i < r; i++) { /* a coalesced buffer: msg_len / its segment size datagrams */
            int seg = 0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&msgs[i].msg_hdr); gso && c; c = CMSG_NXTHDR(&msgs[i].msg_hdr, c))
                if (c->cmsg_level == SOL_UDP && c->cmsg_type == UDP_GRO) memcpy(&seg, CMSG_DATA(c), sizeof seg);
            w->count += seg > 0 ? (msgs[i].msg_len + (unsigned)seg - 1) / (unsigned)seg : 1;
        }
    }
    free(bufs);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s DATAGRAM_BYTES SECONDS [SENDERS [RECEIVERS [gso]]]\n", argv[0]);
        return 2;
    }
    dgram = (size_t)atol(argv[1]);
    double seconds = atof(argv[2]);
    int senders = argc > 3 ? atoi(argv[3]) : 1, receivers = argc > 4 ? atoi(argv[4]) : 1;
    if (argc > 5 && strcmp(argv[5], "gso") == 0) {
        gso = (int)(65507 / (dgram ? dgram : 1));
        if (gso > 64) gso = 64;
        if (gso < 2) gso = 0;
    }
    if (dgram < 1 || dgram > 65507 || seconds <= 0 || senders < 1 || senders > MAX_THREADS || receivers < 1 ||
        receivers > MAX_THREADS) {
        fprintf(stderr, "bad arguments\n");
        return 2;
    }
    struct worker rx[MAX_THREADS] = {0}, tx[MAX_THREADS] = {0};
    memset(&target, 0, sizeof target);
    target.sin_family = AF_INET;
    inet_pton(AF_INET, "127.0.0.1", &target.sin_addr);
    for (int i = 0; i < receivers; i++) {
        rx[i].fd = socket(AF_INET, SOCK_DGRAM, 0);
        int one = 1;
        if (receivers > 1) setsockopt(rx[i].fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one);
        big_buffers(rx[i].fd);
        if (bind(rx[i].fd, (struct sockaddr *)&target, sizeof target) != 0) {
            perror("bind");
            return 1;
        }
        socklen_t sl = sizeof target;
        getsockname(rx[i].fd, (struct sockaddr *)&target, &sl);
    }
    for (int i = 0; i < senders; i++) {
        tx[i].fd = socket(AF_INET, SOCK_DGRAM, 0);
        big_buffers(tx[i].fd);
    }
    double t0 = now();
    for (int i = 0; i < receivers; i++) pthread_create(&rx[i].tid, NULL, recv_loop, &rx[i]);
    for (int i = 0; i < senders; i++) pthread_create(&tx[i].tid, NULL, send_loop, &tx[i]);
    struct timespec ts = {.tv_sec = (time_t)seconds, .tv_nsec = (long)((seconds - (double)(time_t)seconds) * 1e9)};
    nanosleep(&ts, NULL);
    atomic_store(&stop, 1);
    double t1 = now();
    uint64_t sent = 0, received = 0;
    for (int i = 0; i < senders; i++) {
        pthread_join(tx[i].tid, NULL);
        sent += tx[i].count;
    }
    for (int i = 0; i < receivers; i++) {
        pthread_join(rx[i].tid, NULL);
        received += rx[i].count;
    }
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 + (double)ru.ru_stime.tv_sec +
                 (double)ru.ru_stime.tv_usec * 1e-6;
    printf("{\"datagram\": %zu, \"seconds\": %.6f, \"sent\": %llu, \"received\": %llu, \"senders\": %d, "
           "\"receivers\": %d, \"gso_segments\": %d, \"cpu_seconds\": %.3f}\n",
           dgram, t1 - t0, (unsigned long long)sent, (unsigned long long)received, senders, receivers, gso, cpu);
    return 0;
}
