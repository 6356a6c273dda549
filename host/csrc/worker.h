/* The worker engine: one rank's packet path of docs/PROTOCOL.md ("The worker side"), in plain C.
 * py/worker_py.c binds it to Python (switchagg._core.Worker); it includes no Python header. */
#ifndef SWITCHAGG_WORKER_H
#define SWITCHAGG_WORKER_H

#include <netinet/in.h>
#include <stddef.h>
#include <stdint.h>

struct sa_worker_stats {
    unsigned long long sent, retransmits, fast_retransmits, results, stale, bad_key, allreduces, bytes;
    unsigned long long spurious; /* fast retransmits found unneeded: their round was answered twice */
    unsigned long long tail_probes; /* resends of a tail loss probe (RACK-TLP): no result for 2 round trips */
    unsigned long long timeouts;    /* resends of the retransmission timer */
    unsigned long long spurious_probes; /* tail loss probes found unneeded: their round was answered twice */
    unsigned long long gso_sends;       /* sends of several packets at once (UDP GSO) */
    unsigned long long gro_receives;    /* receives of several results at once (UDP GRO) */
    unsigned long long lane_bytes[3];   /* datagram bytes of completed calls' first sends, by lane width 32/16/8 */
    unsigned long long status_resends;  /* resends a STATUS asked for: the round waits for this rank */
    unsigned long long status_holds;    /* STATUS notices that the round has this rank's packet: no resend */
    unsigned long long hello_rounds;    /* rounds of this session's hello (2 unless an earlier session's were met) */
    unsigned long long hello_ns;        /* how long the hello took, ns */
};

struct sa_worker {
    int fd;
    struct sockaddr_in local;
    int configured;
    int broken; /* a failed call leaves peers' slot state unknown: refuse further use */
    int cause;  /* why it broke: an sa_cause (the class of error every later call raises) */
    char why_broken[1024];
    int busy;
    int cancel_fd;          /* an eventfd: sa_worker_cancel wakes a call in progress through it */
    int cancelled;          /* set (atomically) by sa_worker_cancel; read by the call's thread */
    char cancel_why[400];   /* why, written before `cancelled` is set */
    int cancel_cause;       /* its sa_cause, written before `cancelled` is set */
    /* job */
    uint16_t job, rank;
    uint32_t key;  /* the job's result key: a RESULT without it is not from the job's aggregator */
    uint32_t call; /* the call sequence number of the latest call (the next one is call + 1) */
    uint32_t inc;  /* the session's incarnation, agreed by its hello (docs/PROTOCOL.md, Sessions) */
    int opened;    /* the hello is done: inc is this session's */
    uint32_t seed; /* narrow lanes' stochastic rounding: this worker's random seed */
    int n, slot_base, slot_count, k;
    int window;    /* packets in flight at most: the job's slots, or fewer if SO_RCVBUF cannot hold their results */
    int rcvbuf;    /* the socket's receive buffer as the kernel granted it */
    int path_mtu;  /* the route's MTU toward the aggregator (IP_MTU after connect), 0 if unknown */
    int gso_segs;  /* packets per UDP GSO send (UDP_SEGMENT = the packet size), 0: one per datagram */
    int gro;       /* UDP_GRO is on: a receive may hold several results of one size */
    uint8_t *sets; /* per slot: the shadow set of its next round, kept across calls */
    uint8_t *pkts; /* per slot: the outstanding packet */
    uint8_t *rx;   /* receive buffers */
    size_t pkt_len;
    /* timers */
    uint64_t rto_ns, rto_max_ns, timeout_ns;
    uint64_t srtt_ns, rttvar_ns; /* smoothed round trip, as TCP (RFC 6298), kept across calls */
    unsigned reo_steps;          /* RACK's reordering window widened by this many quarter round trips */
    unsigned reo_clean;          /* fast retransmits since the last one found spurious */
    unsigned tlp_shift;          /* a tail loss probe waits 2 round trips times 2^tlp_shift (spurious ones raise it) */
    unsigned tlp_clean;          /* probes since the last one found spurious */
    struct sa_worker_stats stats;
};

struct sa_worker_config {
    const char *agg_host;
    int agg_port, job, rank, n, slot_base, slot_count, k;
    double rto, rto_max, timeout; /* seconds */
    uint32_t key;
};

enum sa_call_result { SA_CALL_OK = 0, SA_CALL_POISONED, SA_CALL_TIMEOUT, SA_CALL_OSERROR, SA_CALL_NOMEM, SA_CALL_CANCELLED };

/* Why a worker broke, one cause per error class the binding raises (SwitchaggError and its subclasses):
 * a peer whose process is gone, calls that differed between ranks, a rank that gave up its call, the
 * control plane that ended the job, or no progress within the timeout. */
enum sa_cause { SA_CAUSE_ERROR = 0, SA_CAUSE_TIMEOUT, SA_CAUSE_PEER_GONE, SA_CAUSE_MISMATCH, SA_CAUSE_ABORTED,
                SA_CAUSE_TEARDOWN, SA_CAUSES };

/* A call's identity on the wire (the header's `call`): the sequence number alone for an untagged call,
 * else a 32-bit mix of the sequence number and the caller's tag (a digest of the caller's own call, e.g.
 * the torch tensor's dtype, element count and op, and which chunk of it this is). Two ranks' calls
 * match only if both agree (docs/PROTOCOL.md, Call identity). */
uint32_t sa_call_identity(uint32_t seq, uint32_t tag);

/* The incarnations a hello derives from a round's words: the next hello round's (domain 'h') or, once
 * every rank vouched for the round before, the session's (domain 's'); never 0 (the first hello round's). */
uint32_t sa_hello_digest(const uint32_t *words, size_t n, char domain);

/* Functions returning int: 0 on success, -1 with the reason in err (bad arguments), -2 with errno. */

/* Binds the socket (so its address can be registered before the job is configured). */
int sa_worker_open(struct sa_worker *w, const char *host, int port, int rcvbuf, char *err, size_t errlen);
int sa_worker_configure(struct sa_worker *w, const struct sa_worker_config *c, char *err, size_t errlen);
/* -1 with the reason when no call can be made now (not configured, broken, busy). */
int sa_worker_usable(const struct sa_worker *w, char *err, size_t errlen);
/* One call: before the session's first, its hello (docs/PROTOCOL.md, Sessions) with every other rank.
 * Allreduce len elements of data in place (kind 'f' float32 or 'i' int32), or (abort) give
 * up the next call so every peer fails it too; `tag` (0: none) goes into the call's identity. `bits`:
 * the lanes on the wire, 32, or 16/8 for float32 (docs/PROTOCOL.md, Narrow lanes); with narrow lanes and
 * residual != NULL (len floats), residual is added to data first and then holds what rounding took from
 * it (error feedback).
 * Blocks; returns an sa_call_result. After any failure
 * but SA_CALL_NOMEM the worker is broken, w->why_broken says why (SA_CALL_OSERROR: errno too). */
int sa_worker_call(struct sa_worker *w, char kind, void *data, size_t len, int abort, uint32_t tag, int bits,
                   float *residual);
/* The session's hello alone, before its first call (which runs it otherwise); a no-op once done. Blocks;
 * returns an sa_call_result, and breaks the worker as a call does on failure. */
int sa_worker_open_session(struct sa_worker *w);
/* The cause of the error a call made now would raise (valid when sa_worker_usable or a call failed). */
int sa_worker_cause(const struct sa_worker *w);
/* From any thread: end the call in progress (and refuse every later one) with SA_CALL_CANCELLED and
 * `why` as the reason, e.g. a watcher that found a peer gone. Only the first reason is kept. */
void sa_worker_cancel(struct sa_worker *w, const char *why, int cause);
/* The receive buffer the job's full window needs, bytes. */
size_t sa_worker_rcvbuf_needed(const struct sa_worker *w);
void sa_worker_close(struct sa_worker *w);

#endif
