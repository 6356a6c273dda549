/* The software aggregator engine: the algorithm of docs/PROTOCOL.md on one UDP port, served by one
 * or more threads (each owns the slots congruent to its index), plain C.
 * py/aggregator_py.c binds it to Python (switchagg._core.Aggregator); it includes no Python header. */
#ifndef SWITCHAGG_AGGREGATOR_H
#define SWITCHAGG_AGGREGATOR_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "errmsg.h"
#include "protocol.h"

#define SA_BATCH 64                    /* datagrams per recvmmsg */
#define SA_RX_BUF 65536                /* > largest UDP payload, so nothing is cut */
#define SA_OUT_MSGS 512                /* queued results before a forced flush */
#define SA_MAX_FOREIGN (SA_BATCH * 64) /* another thread's datagrams in one batch: 64 per GRO buffer at most */
#define SA_NJOB_IDS 65536
#define SA_NUM_SLOTS (SA_POOL_SLOT_MASK + 1)
#define SA_JOB_COUNTERS 7              /* protocol.JOB_COUNTERS, then LEAF_COUNTERS (a leaf's job) */

enum { SA_F_DROPPED_IN, SA_F_DUPLICATED_IN, SA_F_DROPPED_OUT, SA_F_DUPLICATED_OUT, SA_F_N };
extern const char *const sa_fault_names[SA_F_N];
extern const char *const sa_drop_names[SA_DROP_NREASONS];
extern const char *const sa_job_counter_names[SA_JOB_COUNTERS];

/* A job as the control plane installs it. */
struct sa_job_spec {
    uint16_t id, gen;                /* gen: 1..65535 */
    uint32_t n, base, count, k, key;
    struct sockaddr_in addrs[SA_MAX_WORKERS]; /* rank r's address, where local_mask has bit r */
    uint32_t local_mask;
    int leaf;                        /* a leaf of a two-level job: partials go to upstream */
    uint16_t leaf_index;
    struct sockaddr_in upstream;
    int quiet;                       /* no loss notices to this job's ranks (P4 leaves take none) */
};

struct sa_job_counters {
    uint16_t id;
    int leaf;                        /* a leaf's job has all SA_JOB_COUNTERS, others the first 4 */
    uint64_t c[SA_JOB_COUNTERS];     /* summed over the threads */
};

/* One serving thread's own counters. */
struct sa_thread_counters {
    uint64_t rx, tx, dropped;        /* dropped: its drops over every reason */
    uint64_t aggregated;             /* contributions it added, over every job */
    uint64_t misrouted;              /* a packet for another thread's slot (dropped; see sa_agg_open) */
};

struct sa_agg_counters {
    uint64_t rx, tx, drops[SA_DROP_NREASONS], faults[SA_F_N]; /* summed over the threads */
    uint64_t rx_bytes, tx_bytes;     /* UDP payload bytes, summed over the threads */
    uint64_t gso_sends, gro_receives; /* sends of several results at once, receives of several datagrams */
    uint64_t status_resend, status_hold; /* loss notices sent: to a rank a round waits for, to one it has */
    size_t njobs;
    struct sa_job_counters *jobs;    /* malloc'ed */
    int nthreads;
    struct sa_thread_counters *threads; /* malloc'ed, nthreads of them */
};

struct out_msg {
    struct sa_header head;
    const uint8_t *payload;
    size_t payload_len;
    struct sockaddr_in dst;
    uint32_t word;                   /* a STATUS's payload (payload points here) */
};

struct job;
struct sa_agg;

/* One serving thread: its socket in the SO_REUSEPORT group, the slots it owns (slot % nthreads ==
 * index: the kernel steers every packet there by its pool field), its buffers and counters. */
struct sa_agg_thread {
    struct sa_agg *a;
    int index;
    int fd;
    uint64_t rng;                    /* the fault injector's stream */
    pthread_t tid;
    int rc;                          /* why its loop ended: 0 or an errno */
    /* Held while it serves a batch: add_job, remove_job and counters take every thread's. */
    pthread_mutex_t lock;
    uint64_t rx, tx, misrouted, drops[SA_DROP_NREASONS], faults[SA_F_N];
    uint64_t rx_bytes, tx_bytes;     /* UDP payload bytes: datagrams as received, results as sent */
    uint64_t gso_sends, gro_receives;
    uint64_t status_resend, status_hold;
    int gso, gro;                    /* UDP GSO sends and UDP_GRO receives are on (sa_agg_open, SWITCHAGG_GSO) */
    /* Owned by the thread while serving: */
    uint8_t *rx_bufs;
    struct mmsghdr rx_msgs[SA_BATCH];
    struct iovec rx_iov[SA_BATCH];
    struct sockaddr_in rx_addr[SA_BATCH];
    char rx_ctrl[SA_BATCH][CMSG_SPACE(sizeof(int))];
    struct out_msg out[SA_OUT_MSGS];
    size_t n_out;
    uint8_t *out_payloads;
    size_t n_payloads;
    struct mmsghdr tx_msgs[SA_OUT_MSGS];
    struct iovec tx_iov[SA_OUT_MSGS][2];
    /* GSO: the queued results regrouped by destination, a send of up to SA_GSO_MAX_SEGS each */
    struct iovec tx_flat[2 * SA_OUT_MSGS];
    size_t tx_idx[SA_OUT_MSGS];      /* out[] indices in send order */
    size_t tx_first[SA_OUT_MSGS];    /* per send: its first entry in tx_idx */
    size_t tx_segs[SA_OUT_MSGS];     /* per send: results in it */
    char tx_ctrl[SA_OUT_MSGS][CMSG_SPACE(sizeof(uint16_t))];
    /* Datagrams of other threads' slots in this batch (a GSO train is steered, and queued, as a whole
     * by its first datagram's slot): each is served by its owner's state under the owner's lock */
    struct foreign_dgram {
        const uint8_t *p;
        uint32_t len;
        uint16_t msg;                /* its rx_addr index */
        uint16_t owner;
    } foreign[SA_MAX_FOREIGN];
    size_t n_foreign;
} __attribute__((aligned(64)));

struct sa_agg {
    int nthreads;                    /* 0 until sa_agg_open */
    struct sa_agg_thread *th;        /* nthreads of them */
    int port;
    char host[INET_ADDRSTRLEN];
    double drop_in, dup_in, drop_out, dup_out; /* fault injection probabilities */
    int notices;                     /* loss notices (STATUS) are sent: unless SWITCHAGG_LOSS_NOTICES=0 */
    atomic_int stop_requested;
    atomic_int halt;                 /* every serving thread ends its loop */
    atomic_int running;
    struct job **jobs;               /* by job id: written with every thread's lock held, read under one */
};

#define SA_MAX_THREADS 256

/* Functions returning int return an sa_rc (errmsg.h): SA_OK, SA_ERR_ARG with the reason in err (bad
 * arguments), SA_ERR_SYS with errno, or SA_ERR_BIND (the address is taken: the reason in err, errno). */

void sa_agg_init(struct sa_agg *a);
/* Binds host:port with nthreads sockets (1..SA_MAX_THREADS; more than one: an SO_REUSEPORT group
 * whose classic BPF program picks socket pool_slot % nthreads, so each slot is served by one thread
 * only); probs = drop_in, dup_in, drop_out, dup_out; seed for the fault injector. */
int sa_agg_open(struct sa_agg *a, const char *host, int port, int nthreads, const double probs[4], uint64_t seed,
                char *err, size_t errlen);
int sa_agg_is_open(const struct sa_agg *a);
int sa_agg_add_job(struct sa_agg *a, const struct sa_job_spec *spec, char *err, size_t errlen);
/* -1: no such job. */
int sa_agg_remove_job(struct sa_agg *a, int job_id);
/* A consistent snapshot; free it with sa_agg_counters_free. */
int sa_agg_counters(struct sa_agg *a, struct sa_agg_counters *out);
void sa_agg_counters_free(struct sa_agg_counters *c);
/* Serves with every thread (the caller is thread 0) until sa_agg_stop, the deadline (CLOCK_MONOTONIC
 * ns; UINT64_MAX: none), or tick(ctx) (called on the caller's thread every ~50 ms) returns non-zero
 * (then 1). Returns 0, 1, an errno (a thread failed), or -1 if already serving. */
int sa_agg_serve(struct sa_agg *a, uint64_t deadline_ns, int (*tick)(void *), void *ctx);
void sa_agg_stop(struct sa_agg *a);   /* from any thread; serve returns within ~50 ms */
int sa_agg_close(struct sa_agg *a);   /* -1 while serving */
void sa_agg_free(struct sa_agg *a);

#endif
