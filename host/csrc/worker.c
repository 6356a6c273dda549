/* The worker's packet path: one allreduce streams a tensor through the job's slots with a
 * window of one chunk per slot, retransmits what was lost, and dequantizes results in place.
 *
 * Loss detection is TCP's, per slot instead of per byte: a packet is resent when FAST_RETRANSMIT
 * packets first sent after it (or after its latest resend) were answered first (a slot completes when its last worker's packet
 * arrives, and every worker first sends in the order results came, the same for all: so results
 * come in first-send order unless something was lost), or when nothing at all was answered for
 * the retransmission timeout. Ordering the answered packets by their latest transmission instead
 * would turn one worker's resend into reordering for the others. A result restarts every timer, so packets
 * queued behind others on a slow or rate-capped link are not resent just because the queue is long.
 * Plain C, no Python: worker_py.c is its binding (it calls sa_worker_call with the GIL released). */
#define _GNU_SOURCE
#include "worker.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "errmsg.h"
#include "protocol.h"
#include "quant.h"
#include "sockets.h"

#define BATCH 64
#define GRO_BATCH 16      /* coalesced receives per recvmmsg: each buffer is SA_GRO_BUF */
#define GSO_MSGS 16       /* GSO sends per sendmmsg: up to SA_GSO_MAX_SEGS packets each */
#define FAST_RETRANSMIT 3 /* later packets answered before a packet is taken for lost, as TCP's dupacks */
#define REO_MAX_STEPS 16  /* RACK's reordering window grows to 4 round trips more at most */
#define REO_DECAY 16      /* fast retransmits without a spurious one before the extra window halves */
#define INITIAL_RTO_NS 200000000ull /* the timer before any round trip was measured (RFC 6298 says 1 s) */
#define TLP_MIN_NS 1000000 /* a tail loss probe waits 2 round trips, and at least this (scheduling noise) */
#define TLP_MAX_SHIFT 8   /* spurious probes double the wait, up to 256 times (the timer bounds it anyway) */

enum { SLOT_PRIME, SLOT_DATA, SLOT_ABORT, SLOT_DONE };
enum { WATCH_FAST = 1, WATCH_PROBE = 2 };

typedef struct {
    int64_t chunk;     /* chunk index this slot currently carries */
    int phase;         /* SLOT_PRIME, SLOT_DATA or SLOT_DONE */
    uint64_t deadline; /* ns: retransmit when no result by then */
    uint64_t rto;      /* current retransmission timeout, ns */
    uint64_t sent_at;  /* ns: first transmission of the outstanding packet */
    uint64_t seq;      /* order of its first transmission: the order every worker sends, so results come in it */
    uint64_t xmit_at;  /* ns: its latest transmission, first or resend */
    uint64_t xmit_seq; /* packets first sent after its latest transmission have a higher seq than this */
    int passed;        /* results of packets first sent after its latest transmission, come back before its own */
    int fast_done;     /* fast-retransmitted this round (a second answer of the round then shows it spurious) */
    int probe;         /* resent as a tail loss probe this round */
    int held;          /* the aggregator has its packet and waits for a peer's resend (a STATUS said) */
    int lost;          /* its timer expired: resent when returning results make room (slow start) */
    int retried;       /* Karn: no RTT sample from a retransmitted packet */
    int queued;        /* its packet is built but waits for room in the window */
    /* Its last round (on the set before sets[slot]) was fast-retransmitted (WATCH_FAST) or probed
     * (WATCH_PROBE): a second RESULT of that round (the stored result the aggregator unicasts to a
     * resend that reached a complete slot) shows the resend was spurious. */
    int watch;
    uint32_t watch_offset;
} slot_t;

static void free_bufs(struct sa_worker *w) {
    free(w->sets);
    free(w->pkts);
    free(w->rx);
    w->sets = NULL;
    w->pkts = NULL;
    w->rx = NULL;
}

int sa_worker_open(struct sa_worker *w, const char *host, int port, int rcvbuf, char *err, size_t errlen) {
    memset(w, 0, sizeof *w);
    w->fd = w->cancel_fd = -1;
    if (rcvbuf < 0) return sa_fail(err, errlen, "rcvbuf must be >= 0 (0: as large as allowed), got %d", rcvbuf);
    w->local.sin_family = AF_INET;
    w->local.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &w->local.sin_addr) != 1)
        return sa_fail(err, errlen, "bind address %s is not an IPv4 address", host);
    w->cancel_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (w->cancel_fd < 0) return -2;
    w->fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (w->fd < 0 || bind(w->fd, (struct sockaddr *)&w->local, sizeof w->local) != 0) return -2;
    socklen_t sl = sizeof w->local;
    getsockname(w->fd, (struct sockaddr *)&w->local, &sl);
    if (sa_set_dont_fragment(w->fd) != 0) return -2;
    sa_set_sockbuf(w->fd, 16 << 20);
    if (rcvbuf > 0) (void)setsockopt(w->fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof rcvbuf);
    return 0;
}

/* Receive-queue bytes one result datagram of pkt_len bytes costs: about twice its size (skb overhead). */
static size_t result_cost(size_t pkt_len) { return 2 * pkt_len + 1024; }

size_t sa_worker_rcvbuf_needed(const struct sa_worker *w) {
    return w->configured ? (size_t)w->slot_count * result_cost(w->pkt_len) : 0;
}

int sa_worker_configure(struct sa_worker *w, const struct sa_worker_config *c, char *err, size_t errlen) {
    if (w->busy) return sa_fail(err, errlen, "an allreduce is running on this worker");
    if (c->job < 0 || c->job > 0xffff) return sa_fail(err, errlen, "job id %d is not 16-bit", c->job);
    if (c->n < 1 || c->n > SA_MAX_WORKERS) return sa_fail(err, errlen, "world size %d not in 1..32", c->n);
    if (c->rank < 0 || c->rank >= c->n) return sa_fail(err, errlen, "rank %d not in 0..%d", c->rank, c->n - 1);
    if (c->slot_count < 1 || c->slot_base < 0 || c->slot_base + c->slot_count > SA_POOL_SLOT_MASK + 1)
        return sa_fail(err, errlen, "slot range %d+%d outside 0..32767", c->slot_base, c->slot_count);
    if (c->k < 1 || c->k > SA_MAX_K) return sa_fail(err, errlen, "k=%d not in 1..%d", c->k, SA_MAX_K);
    if (c->k < c->n) /* a hello round is one packet with a word per rank (docs/PROTOCOL.md, Sessions) */
        return sa_fail(err, errlen, "k=%d is below the world size %d: a session's hello needs k >= n", c->k, c->n);
    if (!(c->rto > 0 && c->rto_max >= c->rto && c->timeout > 0 && c->timeout < 1e9 && c->rto_max < 1e9))
        return sa_fail(err, errlen, "need 0 < rto <= rto_max and 0 < timeout, finite");
    struct sockaddr_in agg = {0};
    agg.sin_family = AF_INET;
    agg.sin_port = htons((uint16_t)c->agg_port);
    if (c->agg_port < 0 || c->agg_port > 65535 || inet_pton(AF_INET, c->agg_host, &agg.sin_addr) != 1)
        return sa_fail(err, errlen, "aggregator address %s:%d is not an IPv4 address and port", c->agg_host,
                    c->agg_port);
    /* connect(): the kernel then only delivers datagrams from the aggregator to us. */
    if (connect(w->fd, (struct sockaddr *)&agg, sizeof agg) != 0) return -2;
    /* DF is set (sa_worker_open): a datagram larger than the path MTU would fail every send with
     * EMSGSIZE, and a fragmented one would be lost with any of its frames. Say so now. */
    w->path_mtu = sa_path_mtu(w->fd);
    if (w->path_mtu > 0 && SA_HEADER_LEN + 4 * (size_t)c->k + SA_IPV4_UDP_HEADERS > (size_t)w->path_mtu)
        return sa_fail(err, errlen, "K=%d makes %d-byte IP packets, more than the MTU of %d bytes on the path to "
                    "%s:%d (packets are never fragmented): use K <= %d, or leave K unset to choose it from the MTU",
                    c->k, SA_HEADER_LEN + 4 * c->k + SA_IPV4_UDP_HEADERS, w->path_mtu, c->agg_host, c->agg_port,
                    (w->path_mtu - SA_IPV4_UDP_HEADERS - SA_HEADER_LEN) / 4);
    free_bufs(w);
    w->pkt_len = SA_HEADER_LEN + 4 * (size_t)c->k;
    /* GSO: frame-sized packets at the cost of a big datagram per syscall; off where the kernel says no
     * (a later send that fails with EIO, e.g. no checksum offload, turns it off too) */
    w->gso_segs = sa_gso_allowed() ? sa_gso_segments(w->pkt_len, w->path_mtu) : 0;
    if (w->gso_segs && sa_set_gso(w->fd, (int)w->pkt_len) != 0) w->gso_segs = 0;
    if (!w->gso_segs) (void)sa_set_gso(w->fd, 0);
    w->gro = sa_gso_allowed() && sa_set_gro(w->fd, 1) == 0;
    if (!w->gro) (void)sa_set_gro(w->fd, 0);
    w->sets = calloc((size_t)c->slot_count, 1);
    w->pkts = malloc((size_t)c->slot_count * w->pkt_len);
    w->rx = malloc(w->gro ? GRO_BATCH * (size_t)SA_GRO_BUF : BATCH * w->pkt_len);
    if (!w->sets || !w->pkts || !w->rx) {
        free_bufs(w);
        errno = ENOMEM;
        return -2;
    }
    w->job = (uint16_t)c->job;
    w->rank = (uint16_t)c->rank;
    w->key = c->key;
    w->call = 0;
    w->inc = 0;
    w->opened = 0;
    if (getrandom(&w->seed, sizeof w->seed, 0) != (ssize_t)sizeof w->seed) w->seed = (uint32_t)sa_now_ns() ^ (uint32_t)getpid();
    w->n = c->n;
    w->slot_base = c->slot_base;
    w->slot_count = c->slot_count;
    w->k = c->k;
    /* Every outstanding slot's result may sit in the receive queue at once; a datagram costs about
     * twice its size there (skb overhead, measured on loopback). A window the buffer cannot hold
     * would lose results silently and make every round a retransmission: send fewer at a time. */
    int rcvbuf = 0;
    socklen_t ol = sizeof rcvbuf;
    if (getsockopt(w->fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, &ol) != 0) rcvbuf = 0;
    size_t fits = (size_t)rcvbuf / result_cost(w->pkt_len);
    w->rcvbuf = rcvbuf;
    w->window = fits >= (size_t)c->slot_count ? c->slot_count : (fits < 1 ? 1 : (int)fits);
    w->rto_ns = (uint64_t)(c->rto * 1e9);
    w->rto_max_ns = (uint64_t)(c->rto_max * 1e9);
    w->timeout_ns = (uint64_t)(c->timeout * 1e9);
    w->srtt_ns = w->rttvar_ns = 0;
    w->reo_steps = w->reo_clean = 0;
    w->tlp_shift = w->tlp_clean = 0;
    w->configured = 1;
    w->broken = 0;
    return 0;
}

/* ---- one allreduce ---- */

typedef struct {
    struct sa_worker *w;
    char kind; /* 'f' or 'i' */
    uint32_t number; /* this call's sequence number */
    uint32_t call;   /* its identity on the wire: sa_call_identity(number, tag) */
    int tagged;
    int bits;        /* lane width on the wire: 32, or 16/8 for a float call in narrow lanes */
    int hello;       /* a round of the session's hello: int32, call 0, flag HELLO */
    uint32_t inc;    /* the incarnation its packets carry (the session's, or the hello round's) */
    uint32_t prev_inc; /* a hello round: the incarnation of the round before it */
    uint8_t lane_flag;
    size_t vals;     /* values per packet: K for 32-bit lanes, protocol.lanes_per_packet for narrow */
    size_t xwords;   /* narrow: leading payload words of scale bytes */
    size_t nb;       /* narrow: scale blocks per chunk */
    float *residual; /* narrow: this rank's rounding error per element (error feedback), or NULL */
    struct sa_header poisoned;                 /* the poisoned RESULT that ended the call */
    uint32_t poison_info[SA_MISMATCH_INFO_LEN]; /* its payload: who differed */
    void *data;
    size_t len, chunks;
    int8_t *exp_local, *exp_max; /* per chunk (narrow lanes: nb scale bytes per chunk) */
    size_t scaled;               /* chunks whose exp_local is computed (local_scales) */
    slot_t *slots;
    size_t active, done;
    size_t *ready;        /* queued slots in the order their results came (a ring of `active`) */
    size_t ready_head, ready_len;
    size_t outstanding; /* sent and unanswered, at most w->window */
    uint64_t seq;         /* first transmissions so far (resends keep their packet's place) */
    uint64_t last_result; /* ns: the latest matching result (restarts every retransmission timer) */
    uint64_t last_start;  /* ns: the latest first transmission */
    int probed;           /* a tail loss probe went out since the latest result: the timer takes over */
    size_t lost;          /* slots whose timer expired, not resent yet */
    size_t lost_budget;   /* of them, how many may be resent now: 2 per result (TCP's slow start) */
    int frto;             /* results since the timeout that resent none of them (F-RTO): 2 say it was a loss */
    uint64_t last_expiry; /* ns: the latest timeout that took packets for lost */
} run_t;


static inline size_t chunk_len(const run_t *r, int64_t c) {
    size_t off = (size_t)c * r->vals;
    return r->len - off < r->vals ? r->len - off : r->vals;
}

/* The dither seed of chunk c: differs per rank (the worker's random seed), call and chunk, so the ranks'
 * rounding errors are independent and a resend carries the packet it resends (built once). */
static uint32_t chunk_seed(const run_t *r, int64_t c) {
    return sa_call_identity(r->w->seed ^ r->number * 0x85ebca6bu, (uint32_t)c + 1u);
}

/* A narrow payload: the scale bytes of chunk `scales_of` (none past the end), then chunk c's lanes. */
static void build_lanes(run_t *r, int64_t c, int64_t scales_of, int prime, uint32_t *payload) {
    struct sa_worker *w = r->w;
    uint8_t *bytes = (uint8_t *)payload;
    memset(bytes, 0, 4 * r->xwords);
    if ((size_t)scales_of < r->chunks) memcpy(bytes, (uint8_t *)r->exp_local + (size_t)scales_of * r->nb, r->nb);
    uint8_t *lanes = bytes + 4 * r->xwords;
    size_t lane_bytes = 4 * ((size_t)w->k - r->xwords);
    if (prime) {
        memset(lanes, 0, lane_bytes);
        return;
    }
    size_t off = (size_t)c * r->vals, l = chunk_len(r, c);
    memset(lanes + l * (size_t)r->bits / 8, 0, lane_bytes - l * (size_t)r->bits / 8);
    sa_quantize_lanes((const float *)r->data + off, l, r->bits, (uint8_t *)r->exp_max + (size_t)c * r->nb, w->n,
                      chunk_seed(r, c), lanes, r->residual ? r->residual + off : NULL);
}

/* This rank's scales (32-bit lanes: the block exponent; narrow: scale bytes) of chunks 0..upto, computed
 * as packets first need them: a pass over the whole tensor before the first send would leave the link
 * idle meanwhile (about 6 ms for 64 MB, 1% of the call at 1 Gbit/s). */
static void local_scales(run_t *r, size_t upto) {
    if (r->kind != 'f') return;
    for (; r->scaled <= upto && r->scaled < r->chunks; r->scaled++) {
        size_t c = r->scaled;
        const float *x = (const float *)r->data + c * r->vals;
        if (r->bits != 32)
            sa_block_scales(x, chunk_len(r, (int64_t)c), (uint8_t *)r->exp_local + c * r->nb);
        else
            r->exp_local[c] = sa_block_exponent(x, chunk_len(r, (int64_t)c));
    }
}

/* The identity flags every packet of the call carries (PRIME aside): its kind, lane width, hello. */
static uint8_t call_flags(const run_t *r) {
    return (r->kind == 'f' ? SA_FLAG_FLOAT : 0) | r->lane_flag | (r->hello ? SA_FLAG_HELLO : 0);
}

/* Build the outstanding packet of slot i for its current chunk and phase. */
static void build_packet(run_t *r, size_t i) {
    struct sa_worker *w = r->w;
    slot_t *s = &r->slots[i];
    uint8_t *p = w->pkts + i * w->pkt_len;
    struct sa_header *h = (struct sa_header *)p;
    uint32_t *payload = (uint32_t *)(p + SA_HEADER_LEN);
    int64_t c = s->chunk;
    int64_t next = c + w->slot_count;
    h->version = SA_VERSION;
    h->type = SA_MSG_DATA;
    h->job = htons(w->job);
    h->rank = htons(w->rank);
    h->pool = htons((uint16_t)((w->sets[i] ? SA_POOL_SET_BIT : 0) | (uint16_t)(w->slot_base + (int)i)));
    h->elems = htons((uint16_t)w->k);
    h->offset = htonl((uint32_t)((size_t)c * r->vals));
    h->call = htonl(r->call);
    h->total = htonl((uint32_t)r->len);
    h->key = htonl(r->inc); /* a DATA's key field: its session incarnation */
    uint8_t kind_flag = call_flags(r);
    if (s->phase == SLOT_ABORT) { /* its payload says who gave up on which call */
        h->flags = SA_FLAG_ABORT | kind_flag;
        h->exp = SA_EXP_NONE;
        memset(payload, 0, 4 * (size_t)w->k);
        uint32_t info[SA_MISMATCH_INFO_LEN] = {w->rank, r->number, (uint32_t)r->len, h->flags};
        for (size_t e = 0; e < SA_MISMATCH_INFO_LEN && e < (size_t)w->k; e++) payload[e] = htonl(info[e]);
        return;
    }
    local_scales(r, (size_t)next); /* this chunk's, and the next one's on this slot (sent one round ahead) */
    if (r->bits != 32) { /* the scales travel in the payload, one round ahead as the exponent does */
        h->flags = (s->phase == SLOT_PRIME ? SA_FLAG_PRIME : 0) | kind_flag;
        h->exp = SA_EXP_NONE;
        build_lanes(r, c, s->phase == SLOT_PRIME ? c : next, s->phase == SLOT_PRIME, payload);
        return;
    }
    if (s->phase == SLOT_PRIME) {
        h->flags = SA_FLAG_PRIME | kind_flag;
        h->exp = r->exp_local[c];
        memset(payload, 0, 4 * (size_t)w->k);
        return;
    }
    h->flags = kind_flag;
    size_t off = (size_t)c * (size_t)w->k, l = chunk_len(r, c);
    if (r->kind == 'f') {
        h->exp = (size_t)next < r->chunks ? r->exp_local[next] : SA_EXP_NONE;
        sa_quantize_be((const float *)r->data + off, l, (size_t)w->k, r->exp_max[c], w->n, payload);
    } else {
        h->exp = SA_EXP_NONE;
        sa_int_to_be((const int32_t *)r->data + off, l, (size_t)w->k, payload);
    }
}

static int send_plain(run_t *r, const size_t *which, size_t count);
static int send_trains(run_t *r, const size_t *which, size_t count);

/* The kernel cannot segment here (EIO: the device has no checksum offload; EINVAL: the route's MTU
 * shrank): send one datagram per packet from now on. */
static int gso_refused(int e) { return e == EIO || e == EINVAL || e == ENOPROTOOPT || e == EOPNOTSUPP; }

/* Packets in GSO sends of up to w->gso_segs each (the socket's UDP_SEGMENT is pkt_len: a send of m
 * packets leaves as m datagrams), many sends per sendmmsg. */
static int send_slots(run_t *r, const size_t *which, size_t count) {
    struct sa_worker *w = r->w;
    if (w->gso_segs < 2 || count < 2) return send_plain(r, which, count);
    /* One steering class after another (protocol.h, SA_STEER_CLASSES), each in the order given: a
     * train is steered whole by its first packet, so it holds packets of one class only. */
    size_t *ordered = malloc(count * sizeof *ordered);
    if (ordered == NULL) return send_plain(r, which, count);
    size_t n = 0;
    for (uint32_t c = 0; c < SA_STEER_CLASSES; c++)
        for (size_t j = 0; j < count; j++)
            if ((uint32_t)(w->slot_base + (int)which[j]) % SA_STEER_CLASSES == c) ordered[n++] = which[j];
    int rc = send_trains(r, ordered, count);
    free(ordered);
    return rc;
}

/* GSO sends of packets ``which`` (of one class per run of up to w->gso_segs), many per sendmmsg. */
static int send_trains(run_t *r, const size_t *which, size_t count) {
    struct sa_worker *w = r->w;
    struct mmsghdr msgs[GSO_MSGS];
    struct iovec iov[GSO_MSGS * SA_GSO_MAX_SEGS];
    size_t segs[GSO_MSGS];
    size_t sent = 0;
    while (sent < count) {
        size_t m = 0, used = 0;
        for (; m < GSO_MSGS && sent + used < count; m++) {
            size_t take = count - sent - used < (size_t)w->gso_segs ? count - sent - used : (size_t)w->gso_segs;
            size_t first = sent + used, cls = (size_t)(w->slot_base + (int)which[first]) % SA_STEER_CLASSES;
            for (size_t j = 1; j < take; j++) /* the train ends where the class changes */
                if ((size_t)(w->slot_base + (int)which[first + j]) % SA_STEER_CLASSES != cls) {
                    take = j;
                    break;
                }
            struct iovec *v = &iov[m * SA_GSO_MAX_SEGS];
            for (size_t j = 0; j < take; j++) {
                v[j].iov_base = w->pkts + which[sent + used + j] * w->pkt_len;
                v[j].iov_len = w->pkt_len;
            }
            memset(&msgs[m].msg_hdr, 0, sizeof msgs[m].msg_hdr);
            msgs[m].msg_hdr.msg_iov = v;
            msgs[m].msg_hdr.msg_iovlen = take;
            segs[m] = take;
            used += take;
        }
        int rc = sendmmsg(w->fd, msgs, (unsigned)m, 0);
        if (rc < 0) {
            if (errno == EINTR) continue;
            if (gso_refused(errno)) {
                w->gso_segs = 0;
                (void)sa_set_gso(w->fd, 0);
                return send_plain(r, which + sent, count - sent);
            }
            if (errno == EAGAIN || errno == ENOBUFS || errno == ECONNREFUSED || errno == EHOSTUNREACH ||
                errno == ENETUNREACH) { /* a loss like any other (send_plain) */
                sent += used;
                continue;
            }
            return -1;
        }
        size_t done = 0;
        for (int i = 0; i < rc; i++) done += segs[i];
        w->stats.sent += done;
        w->stats.bytes += done * w->pkt_len;
        w->stats.gso_sends += (unsigned long long)rc;
        sent += rc > 0 ? done : used;
    }
    return 0;
}

static int send_plain(run_t *r, const size_t *which, size_t count) {
    struct sa_worker *w = r->w;
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    size_t sent = 0;
    while (sent < count) {
        size_t m = count - sent < BATCH ? count - sent : BATCH;
        for (size_t j = 0; j < m; j++) {
            iov[j].iov_base = w->pkts + which[sent + j] * w->pkt_len;
            iov[j].iov_len = w->pkt_len;
            memset(&msgs[j].msg_hdr, 0, sizeof msgs[j].msg_hdr);
            msgs[j].msg_hdr.msg_iov = &iov[j];
            msgs[j].msg_hdr.msg_iovlen = 1;
        }
        int rc = sendmmsg(w->fd, msgs, (unsigned)m, 0);
        if (rc < 0) {
            if (errno == EINTR) continue;
            /* A full queue or an ICMP error from an earlier datagram is a loss like any
             * other: the retransmission timer repairs it. */
            if (errno == EAGAIN || errno == ENOBUFS || errno == ECONNREFUSED || errno == EHOSTUNREACH ||
                errno == ENETUNREACH) {
                sent += m;
                continue;
            }
            return -1;
        }
        w->stats.sent += (unsigned long long)rc;
        w->stats.bytes += (unsigned long long)rc * w->pkt_len;
        sent += rc > 0 ? (size_t)rc : m;
    }
    return 0;
}

/* The configured RTO is a floor (a few ms: a data-centre link's round trip is far shorter): a
 * slot's round trip includes waiting for the slowest peer, so the smoothed estimate (RFC 6298)
 * raises it where round trips are longer or vary (bmv2, a loaded link). Before the first sample,
 * INITIAL_RTO_NS: the first window's answers take as long as the aggregator needs for all of it. */
static uint64_t current_rto(const struct sa_worker *w) {
    uint64_t rto = w->srtt_ns ? w->srtt_ns + 4 * w->rttvar_ns : INITIAL_RTO_NS;
    if (rto < w->rto_ns) rto = w->rto_ns;
    return rto < w->rto_max_ns ? rto : w->rto_max_ns;
}

static void rtt_sample(struct sa_worker *w, uint64_t rtt) {
    if (w->srtt_ns == 0) {
        w->srtt_ns = rtt;
        w->rttvar_ns = rtt / 2;
        return;
    }
    uint64_t dev = rtt > w->srtt_ns ? rtt - w->srtt_ns : w->srtt_ns - rtt;
    w->rttvar_ns = (3 * w->rttvar_ns + dev) / 4;
    w->srtt_ns = (7 * w->srtt_ns + rtt) / 8;
}

/* A PRIME round's result: the max exponent (32-bit lanes) or scale bytes (narrow) of chunk c. */
static void take_scales(run_t *r, int64_t c, const struct sa_header *h, const uint32_t *payload) {
    if (r->bits == 32)
        r->exp_max[c] = h->exp;
    else
        memcpy((uint8_t *)r->exp_max + (size_t)c * r->nb, payload, r->nb);
}

/* A data round's result: chunk c's sum into the tensor, and the max scales of the slot's next chunk
 * (they travel one round ahead). */
static void take_sum(run_t *r, int64_t c, const struct sa_header *h, const uint32_t *payload) {
    struct sa_worker *w = r->w;
    int64_t next = c + w->slot_count;
    size_t off = (size_t)c * r->vals, l = chunk_len(r, c);
    if (r->bits != 32) {
        const uint8_t *bytes = (const uint8_t *)payload;
        sa_dequantize_lanes(bytes + 4 * r->xwords, l, r->bits, (uint8_t *)r->exp_max + (size_t)c * r->nb, w->n,
                            (float *)r->data + off);
        if ((size_t)next < r->chunks) memcpy((uint8_t *)r->exp_max + (size_t)next * r->nb, bytes, r->nb);
    } else if (r->kind == 'f') {
        sa_dequantize_be(payload, l, r->exp_max[c], w->n, (float *)r->data + off);
        if ((size_t)next < r->chunks) r->exp_max[next] = h->exp;
    } else {
        sa_be_to_int(payload, l, (int32_t *)r->data + off);
    }
}

/* Slot i waits for room in the window, behind the slots queued before it. */
static void enqueue(run_t *r, size_t i) {
    r->slots[i].queued = 1;
    r->ready[(r->ready_head + r->ready_len++) % r->active] = i;
}

/* Advance slot i after its result arrived; returns 1 if a new packet is outstanding. */
static int advance_slot(run_t *r, size_t i, const uint8_t *pkt, uint64_t now) {
    struct sa_worker *w = r->w;
    slot_t *s = &r->slots[i];
    const struct sa_header *h = (const struct sa_header *)pkt;
    const uint32_t *payload = (const uint32_t *)(pkt + SA_HEADER_LEN);
    int64_t c = s->chunk, next = c + w->slot_count;
    if (!s->retried) rtt_sample(w, now - s->sent_at);
    if (s->lost) { /* answered before its resend: the timeout was spurious (a stall, not a loss), as
                    * F-RTO (RFC 5682) tells it; the others marked with it are not resent either */
        for (size_t j = 0; j < r->active; j++) r->slots[j].lost = 0;
        r->lost = 0;
    }
    s->watch = (s->fast_done ? WATCH_FAST : 0) | (s->probe ? WATCH_PROBE : 0);
    s->watch_offset = (uint32_t)((size_t)c * r->vals);
    w->sets[i] ^= 1; /* this round on this slot is finished for us */
    if (s->phase == SLOT_ABORT) {
        s->phase = SLOT_DONE;
        r->done++;
        return 0;
    }
    if (s->phase == SLOT_PRIME) {
        take_scales(r, c, h, payload);
        s->phase = SLOT_DATA;
    } else {
        take_sum(r, c, h, payload);
        if ((size_t)next >= r->chunks) {
            s->phase = SLOT_DONE;
            r->done++;
            return 0;
        }
        s->chunk = next;
    }
    enqueue(r, i);
    build_packet(r, i);
    return 1;
}

static void start_timer(run_t *r, size_t i, uint64_t now) {
    slot_t *s = &r->slots[i];
    s->queued = 0;
    s->rto = current_rto(r->w);
    s->deadline = now + s->rto;
    s->sent_at = s->xmit_at = now;
    s->retried = 0;
    s->seq = s->xmit_seq = ++r->seq;
    r->last_start = now;
    s->passed = 0;
    s->fast_done = 0;
    s->probe = 0;
    s->held = 0;
    r->outstanding++;
}

/* Move queued slots into the window in the order their results came, and append them to `out`.
 * Every worker gets the results in the same order (the aggregator sends each round's to all at
 * once), so every worker sends in the same order however its receives were batched: fast retransmit
 * and the aggregator's loss notices rely on it. (Sorting a batch by chunk would not: a worker that
 * takes results one at a time sends a late slot's next chunk after higher ones, one that takes
 * them in a batch before.) */
static size_t release(run_t *r, uint64_t now, size_t *out, size_t nout) {
    size_t room = (size_t)r->w->window - r->outstanding;
    for (; room > 0 && r->ready_len > 0; room--, r->ready_len--) {
        size_t i = r->ready[r->ready_head];
        r->ready_head = (r->ready_head + 1) % r->active;
        start_timer(r, i, now);
        out[nout++] = i;
    }
    return nout;
}

/* Slot i's result came: every packet still outstanding whose latest transmission came before the first
 * transmission of slot i's packet was passed. */
static void note_passed(run_t *r, size_t i) {
    uint64_t seq = r->slots[i].seq;
    for (size_t j = 0; j < r->active; j++) {
        slot_t *s = &r->slots[j];
        if (j != i && s->phase != SLOT_DONE && !s->queued && s->xmit_seq < seq) s->passed++;
    }
}

/* Slot s is resent now (any reason): RACK times it from this transmission, as RFC 8985 times a
 * retransmission by its own send time, so a resend that is lost too is found by packets first sent after
 * it, not only by the timer (which every result restarts: in a busy stream it would wait for the end of
 * the call). */
static void resend(run_t *r, slot_t *s, uint64_t now) {
    if (s->lost) { /* resent now: not again when its turn after a timeout comes */
        s->lost = 0;
        r->lost--;
    }
    s->retried = 1; /* Karn: no round-trip sample from it */
    s->xmit_at = now;
    s->xmit_seq = r->seq;
    s->passed = 0;
    s->held = 0;
    s->deadline = now + s->rto;
}

/* Outstanding packets passed FAST_RETRANSMIT times are taken for lost: resend them now, with the
 * same timeout (as TCP, a fast retransmit does not back off). Appends them to `out`. */
static size_t fast_retransmits(run_t *r, uint64_t now, size_t *out, size_t nout) {
    /* As RACK (RFC 8985): a passed packet is lost only once it is older than a round trip plus a
     * reordering window. Results of a CPU-starved or multi-threaded aggregator (one thread runs
     * ahead of another) come back out of order by as much as round trips vary, so the window is
     * the larger of a quarter round trip and 2 deviations of the round trip (RFC 6298's rttvar):
     * where round trips are steady it stays RACK's, where they vary it follows. */
    uint64_t srtt = r->w->srtt_ns ? r->w->srtt_ns : r->w->rto_ns;
    uint64_t window = 2 * r->w->rttvar_ns > srtt / 4 ? 2 * r->w->rttvar_ns : srtt / 4;
    uint64_t reorder_age = srtt + window + r->w->reo_steps * (srtt / 4);
    for (size_t j = 0; j < r->active; j++) {
        slot_t *s = &r->slots[j];
        if (s->phase == SLOT_DONE || s->queued || s->passed < FAST_RETRANSMIT) continue;
        /* RACK: younger than a round trip is reordering; a held packet waits for the peer's resend to come
         * through the peer's queue: a round trip more */
        if (now - s->xmit_at < (s->held ? 2 * reorder_age : reorder_age)) continue;
        s->fast_done = 1;
        if (++r->w->reo_clean >= REO_DECAY && r->w->reo_steps) { /* RFC 8985: the window shrinks back */
            r->w->reo_steps /= 2;
            r->w->reo_clean = 0;
        }
        resend(r, s, now);
        out[nout++] = j;
        r->w->stats.fast_retransmits++;
        r->w->stats.retransmits++;
    }
    return nout;
}

/* A second RESULT of a round this worker fast-retransmitted: the first answered the original
 * packet, which was late, not lost: a spurious fast retransmit, as a DSACK tells TCP. RACK's
 * reordering window widens by a quarter round trip (RFC 8985, 6.2 step 4), up to REO_MAX_STEPS. */
static void note_spurious(struct sa_worker *w, slot_t *s) {
    if (s->watch & WATCH_PROBE) { /* the probe came too early: wait twice as long before the next */
        w->stats.spurious_probes++;
        w->tlp_clean = 0;
        if (w->tlp_shift < TLP_MAX_SHIFT) w->tlp_shift++;
    }
    if (s->watch & WATCH_FAST) {
        w->stats.spurious++;
        w->reo_clean = 0;
        if (w->reo_steps < REO_MAX_STEPS) w->reo_steps++;
    }
    s->watch = 0; /* once per round */
}

/* A STATUS from the aggregator (docs/PROTOCOL.md, Loss notices): slot i's round waits for the ranks not
 * in its bitmap. This rank in it: its packet is there, a peer's is being resent, so RACK waits a round
 * trip from now before resending (a resend would be ignored). Not in it, and the round is our outstanding
 * one, or the one after it (our result of that one was lost): resend the outstanding packet now, unless
 * it went out within half a round trip (the notice may predate it). Appends a resend to `out`. */
static size_t take_status(run_t *r, const uint8_t *pkt, uint64_t now, size_t *out, size_t nout) {
    struct sa_worker *w = r->w;
    const struct sa_header *h = (const struct sa_header *)pkt;
    if (h->version != SA_VERSION || ntohs(h->job) != w->job || ntohs(h->rank) != w->rank || ntohs(h->elems) != 1 ||
        ntohl(h->key) != (w->key ^ r->inc) || ntohl(h->call) != r->call || ntohl(h->total) != (uint32_t)r->len)
        return nout;
    uint16_t pool = ntohs(h->pool);
    long i = (long)(pool & SA_POOL_SLOT_MASK) - w->slot_base;
    if (i < 0 || (size_t)i >= r->active) return nout;
    slot_t *s = &r->slots[i];
    if (s->phase == SLOT_DONE || s->queued) return nout;
    uint32_t have, offset = ntohl(h->offset), mine = (uint32_t)((size_t)s->chunk * r->vals);
    memcpy(&have, pkt + SA_HEADER_LEN, sizeof have);
    int set = (pool & SA_POOL_SET_BIT) ? 1 : 0, prime = (h->flags & SA_FLAG_PRIME) != 0;
    int ours = set == w->sets[i] && offset == mine && prime == (s->phase == SLOT_PRIME);
    uint32_t after = s->phase == SLOT_PRIME ? mine : (uint32_t)((size_t)(s->chunk + w->slot_count) * r->vals);
    int next = set != w->sets[i] && !prime && offset == after;
    if (ours && (ntohl(have) >> w->rank & 1)) { /* hold */
        s->xmit_at = now;
        s->xmit_seq = r->seq;
        s->passed = 0;
        s->held = 1;
        w->stats.status_holds++;
        return nout;
    }
    uint64_t srtt = w->srtt_ns ? w->srtt_ns : w->rto_ns;
    if (!(ours || next) || (ntohl(have) >> w->rank & 1) || now - s->xmit_at < srtt / 2) return nout;
    resend(r, s, now);
    w->stats.status_resends++;
    w->stats.retransmits++;
    out[nout++] = (size_t)i;
    return nout;
}

/* Is this datagram the answer to slot's outstanding request? Returns the slot index, or -1 (not an
 * answer: stale, duplicate, or not from the job's aggregator). A poisoned RESULT answers the slot's
 * round whatever its identity: the round's contributions differed, so its identity is not ours. */
static long match_result(run_t *r, const uint8_t *pkt, size_t len, int *poisoned) {
    struct sa_worker *w = r->w;
    const struct sa_header *h = (const struct sa_header *)pkt;
    if (len != w->pkt_len || h->version != SA_VERSION || h->type != SA_MSG_RESULT || ntohs(h->job) != w->job ||
        ntohs(h->rank) != w->rank || ntohs(h->elems) != w->k)
        return -1;
    /* Only the job's aggregator knows the key, and it answers a session with key ^ incarnation: never use
     * this payload (a result of another session's round included) */
    if (ntohl(h->key) != (w->key ^ r->inc)) {
        /* in a hello, a late answer to its round before carries that round's incarnation: stale */
        if (r->hello && ntohl(h->key) == (w->key ^ r->prev_inc))
            w->stats.stale++;
        else
            w->stats.bad_key++;
        return -1;
    }
    uint16_t pool = ntohs(h->pool);
    long i = (long)(pool & SA_POOL_SLOT_MASK) - w->slot_base;
    if (i < 0 || (size_t)i >= r->active) return -1;
    slot_t *s = &r->slots[i];
    int set = (pool & SA_POOL_SET_BIT) ? 1 : 0;
    /* the round before, on the other set: never the answer to the outstanding request */
    if (s->watch && set != w->sets[i] && ntohl(h->offset) == s->watch_offset && ntohl(h->call) == r->call) {
        note_spurious(w, s);
        return -1;
    }
    if (s->phase == SLOT_DONE || s->queued || set != w->sets[i]) return -1;
    *poisoned = (h->flags & SA_POISON_FLAGS) != 0;
    if (*poisoned) return i;
    if (ntohl(h->offset) != (uint32_t)((size_t)s->chunk * r->vals)) return -1;
    if (ntohl(h->call) != r->call || ntohl(h->total) != (uint32_t)r->len) return -1;
    uint8_t want = (s->phase == SLOT_PRIME ? SA_FLAG_PRIME : 0) | call_flags(r);
    if ((h->flags & SA_IDENTITY_FLAGS) != want) return -1;
    return i;
}

/* When a tail loss probe is due (RACK-TLP, RFC 8985 7): two smoothed round trips after the latest
 * result or first transmission, whichever came last, if packets are outstanding and none was probed
 * since. RACK needs FAST_RETRANSMIT later packets answered to call one lost, and the last packets of
 * a call (or a window whose every packet was lost) have none: without a probe they wait for the
 * retransmission timer. 0: no probe is armed. */
static uint64_t probe_due(const run_t *r) {
    const struct sa_worker *w = r->w;
    if (r->probed || r->outstanding == 0 || w->srtt_ns == 0) return 0;
    uint64_t pto = (2 * w->srtt_ns < TLP_MIN_NS ? TLP_MIN_NS : 2 * w->srtt_ns) << w->tlp_shift, rto = current_rto(w);
    if (pto > rto) pto = rto;
    return (r->last_result > r->last_start ? r->last_result : r->last_start) + pto;
}

/* The probe: the oldest outstanding packet again (results come in first-send order, so it is the
 * likeliest lost). Its answer, or that of the resend the aggregator unicasts, re-arms RACK. */
static size_t tail_probe(run_t *r, uint64_t now, size_t *out) {
    size_t best = r->active;
    for (size_t i = 0; i < r->active; i++) {
        const slot_t *s = &r->slots[i];
        if (s->phase == SLOT_DONE || s->queued) continue;
        if (best == r->active || s->seq < r->slots[best].seq) best = i;
    }
    r->probed = 1;
    if (best == r->active) return 0;
    resend(r, &r->slots[best], now);
    if (++r->w->tlp_clean >= REO_DECAY && r->w->tlp_shift) { /* useful probes: shorten the wait again */
        r->w->tlp_shift--;
        r->w->tlp_clean = 0;
    }
    r->slots[best].probe = 1;
    r->w->stats.tail_probes++;
    r->w->stats.retransmits++;
    out[0] = best;
    return 1;
}

/* Resend up to r->lost_budget of the slots whose timer expired, oldest first; appends to `out`.
 * After a timeout the window is resent as TCP's is after an RTO: one packet at once, then, once
 * two results showed it was a loss (F-RTO), two more for every result that comes back. A whole
 * window resent at once, on a timer that fired because a peer, the aggregator or a link stalled
 * (a busy CPU, a rank that starts its call late), only adds to the stall. */
static size_t resend_lost(run_t *r, uint64_t now, size_t *out, size_t nout) {
    while (r->lost > 0 && r->lost_budget > 0) {
        size_t best = r->active;
        for (size_t i = 0; i < r->active; i++)
            if (r->slots[i].lost && (best == r->active || r->slots[i].seq < r->slots[best].seq)) best = i;
        if (best == r->active) {
            r->lost = 0;
            break;
        }
        resend(r, &r->slots[best], now); /* takes it off the lost ones */
        r->lost_budget--;
        r->w->stats.timeouts++;
        r->w->stats.retransmits++;
        out[nout++] = best;
    }
    return nout;
}

/* One call: an allreduce of r->len elements, or (abort) one ABORT packet on chunk 0's slot, sent
 * until the round it poisons comes back, so that every peer in the call fails it too. */
static int run_call(run_t *r, int abort) {
    struct sa_worker *w = r->w;
    size_t K = r->vals;
    r->chunks = abort ? 1 : (r->len + K - 1) / K;
    if (r->chunks == 0) return SA_CALL_OK;
    r->active = r->chunks < (size_t)w->slot_count ? r->chunks : (size_t)w->slot_count;
    r->slots = calloc(r->active, sizeof *r->slots);
    r->ready = malloc(r->active * sizeof *r->ready);
    size_t *queue = malloc(r->active * sizeof *queue);
    if (r->kind == 'f') {
        r->exp_local = calloc(r->chunks, r->nb);
        r->exp_max = calloc(r->chunks, r->nb);
    }
    if (!r->slots || !r->ready || !queue || (r->kind == 'f' && (!r->exp_local || !r->exp_max))) {
        free(queue);
        return SA_CALL_NOMEM;
    }
    int rc = SA_CALL_OK;
    if (r->residual && !abort) /* error feedback: what rounding took from the last call comes back */
        for (size_t e = 0; e < r->len; e++) ((float *)r->data)[e] += r->residual[e];
    uint64_t now = sa_now_ns();
    for (size_t i = 0; i < r->active; i++) {
        r->slots[i].chunk = (int64_t)i;
        r->slots[i].phase = abort ? SLOT_ABORT : r->kind == 'f' ? SLOT_PRIME : SLOT_DATA;
        enqueue(r, i);
        build_packet(r, i);
    }
    if (send_slots(r, queue, release(r, now, queue, 0)) < 0) {
        free(queue);
        return SA_CALL_OSERROR;
    }
    uint64_t last_progress = now, next_scan = now + current_rto(w);
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
    char ctrl[BATCH][CMSG_SPACE(sizeof(int))];
    /* the datagrams of one recvmmsg: a coalesced (GRO) buffer holds several of one size back to back */
    const uint8_t *seg[GRO_BATCH * SA_GSO_MAX_SEGS > BATCH ? GRO_BATCH * SA_GSO_MAX_SEGS : BATCH];
    size_t seg_len[sizeof seg / sizeof seg[0]];
    while (r->done < r->active) {
        now = sa_now_ns();
        uint64_t wake = next_scan, probe = probe_due(r);
        if (probe && probe < wake) wake = probe;
        uint64_t wait_ns = wake > now ? wake - now : 0; /* ns: round trips on a LAN are well under 1 ms */
        struct timespec ts = {.tv_sec = (time_t)(wait_ns / 1000000000u), .tv_nsec = (long)(wait_ns % 1000000000u)};
        struct pollfd pfd[2] = {{.fd = w->fd, .events = POLLIN}, {.fd = w->cancel_fd, .events = POLLIN}};
        int pr = ppoll(pfd, 2, &ts, NULL);
        if (pr < 0 && errno != EINTR) {
            rc = SA_CALL_OSERROR;
            break;
        }
        if (__atomic_load_n(&w->cancelled, __ATOMIC_ACQUIRE)) {
            rc = SA_CALL_CANCELLED;
            break;
        }
        size_t nq = 0;
        if (pr > 0 && (pfd[0].revents & POLLIN)) {
            int nbufs = w->gro ? GRO_BATCH : BATCH;
            size_t bufsz = w->gro ? SA_GRO_BUF : w->pkt_len;
            for (int j = 0; j < nbufs; j++) {
                iov[j].iov_base = w->rx + (size_t)j * bufsz;
                iov[j].iov_len = bufsz;
                memset(&msgs[j].msg_hdr, 0, sizeof msgs[j].msg_hdr);
                msgs[j].msg_hdr.msg_iov = &iov[j];
                msgs[j].msg_hdr.msg_iovlen = 1;
                if (w->gro) {
                    msgs[j].msg_hdr.msg_control = ctrl[j];
                    msgs[j].msg_hdr.msg_controllen = sizeof ctrl[j];
                }
            }
            int got = recvmmsg(w->fd, msgs, (unsigned)nbufs, MSG_DONTWAIT, NULL);
            if (got < 0 && errno != EAGAIN && errno != EINTR && errno != ECONNREFUSED) {
                rc = SA_CALL_OSERROR;
                break;
            }
            size_t nseg = 0;
            for (int j = 0; j < got; j++) { /* walk a coalesced buffer by its segment size */
                const uint8_t *buf = w->rx + (size_t)j * bufsz;
                size_t total = (msgs[j].msg_hdr.msg_flags & MSG_TRUNC) ? 0 : msgs[j].msg_len;
                size_t step = w->gro ? (size_t)sa_gro_size(&msgs[j].msg_hdr) : 0;
                if (step == 0 || step > total) step = total;
                size_t off = 0;
                do { /* bounded: a buffer of tiny packets beyond the array is lost, and resent */
                    if (nseg == sizeof seg / sizeof seg[0]) break;
                    seg[nseg] = buf + off;
                    seg_len[nseg++] = total - off < step ? total - off : step;
                    off += step;
                } while (off < total);
                if (w->gro && step < total) w->stats.gro_receives++;
            }
            now = sa_now_ns();
            size_t nstatus = 0; /* resends STATUS notices asked for, first in the queue */
            for (size_t j = 0; j < nseg && rc == SA_CALL_OK; j++) {
                const uint8_t *pkt = seg[j];
                size_t len = seg_len[j];
                if (len == SA_HEADER_LEN + 4 && ((const struct sa_header *)pkt)->type == SA_MSG_STATUS) {
                    nstatus = take_status(r, pkt, now, queue, nstatus);
                    continue;
                }
                int poisoned = 0;
                long i = match_result(r, pkt, len, &poisoned);
                if (i < 0) {
                    w->stats.stale++;
                    continue;
                }
                if (poisoned) { /* the call failed on every rank: keep what says why */
                    memcpy(&r->poisoned, pkt, sizeof r->poisoned);
                    const uint32_t *info = (const uint32_t *)(pkt + SA_HEADER_LEN);
                    for (size_t e = 0; e < SA_MISMATCH_INFO_LEN; e++)
                        r->poison_info[e] = e < (size_t)w->k ? ntohl(info[e]) : 0;
                    w->stats.results++;
                    w->sets[i] ^= 1;
                    rc = SA_CALL_POISONED;
                    break;
                }
                w->stats.results++;
                last_progress = r->last_result = now;
                r->probed = 0;
                /* F-RTO (RFC 5682): the first two results after a timeout resend nothing more; if
                 * either answers a packet the timeout took for lost, it was a stall (all cleared in
                 * advance_slot), else a loss, and the rest is resent in slow start */
                if (r->lost) r->lost_budget += ++r->frto > 2 ? 2 : 0;
                else r->lost_budget = 0;
                r->outstanding--;
                note_passed(r, (size_t)i);
                advance_slot(r, (size_t)i, pkt, now);
            }
            if (rc != SA_CALL_OK) break;
            nq = release(r, now, queue, resend_lost(r, now, queue, fast_retransmits(r, now, queue, nstatus)));
        }
        if (nq && send_slots(r, queue, nq) < 0) {
            rc = SA_CALL_OSERROR;
            break;
        }
        now = sa_now_ns();
        probe = probe_due(r);
        if (probe && now >= probe && (nq = tail_probe(r, now, queue)) && send_slots(r, queue, nq) < 0) {
            rc = SA_CALL_OSERROR;
            break;
        }
        if (now >= next_scan) { /* retransmit what timed out, with exponential backoff */
            nq = 0;
            size_t lost_before = r->lost, expired = 0; /* lost_before: an earlier timeout's, not found spurious */
            uint64_t soonest = now + w->rto_max_ns;
            for (size_t i = 0; i < r->active; i++) {
                slot_t *s = &r->slots[i];
                if (s->phase == SLOT_DONE || s->queued) continue;
                /* any result restarts the timer: a queue that drains is not a loss */
                uint64_t due = s->deadline > r->last_result + s->rto ? s->deadline : r->last_result + s->rto;
                if (due <= now) {
                    s->rto = s->rto * 2 < w->rto_max_ns ? s->rto * 2 : w->rto_max_ns;
                    due = s->deadline = now + s->rto;
                    if (!s->lost) r->lost++;
                    s->lost = 1;
                    expired++;
                }
                if (due < soonest) soonest = due;
            }
            /* Slow start anew: the oldest at once, the rest as results return. But if nothing came
             * back since the last timeout, all of them: a slot completes only when every rank's
             * packet is in, and ranks that each resent only their own oldest could wait on each
             * other for ever. Not before the call's first result, though: then every rank's oldest is
             * the same (chunk 0's), and the first window may still be queued on a slow link (a round
             * trip measured in a small earlier call says nothing of it): a window resent into that
             * queue would only lengthen it. */
            if (expired) {
                r->lost_budget = r->last_result && r->last_result < r->last_expiry ? r->lost : 1;
                r->frto = lost_before ? 2 : 0;
                r->last_expiry = now;
            }
            nq = resend_lost(r, now, queue, 0);
            if (nq && send_slots(r, queue, nq) < 0) {
                rc = SA_CALL_OSERROR;
                break;
            }
            next_scan = soonest;
        }
        if (now - last_progress > w->timeout_ns) {
            rc = SA_CALL_TIMEOUT;
            break;
        }
    }
    free(queue);
    return rc;
}

static const char *kind_name(uint32_t flags) {
    if (flags & SA_FLAG_HELLO) return "session-hello int32";
    if (!(flags & SA_FLAG_FLOAT)) return "int32";
    int bits = sa_lane_bits((uint8_t)flags);
    return bits == 16 ? "float32 (16-bit lanes)" : bits == 8 ? "float32 (8-bit lanes)" : "float32";
}

/* A call identity as a person reads it: a sequence number, or (tagged calls) a digest in hex. */
static void name_call(char *buf, size_t size, int tagged, uint32_t call) {
    snprintf(buf, size, tagged ? "call identity 0x%08x" : "call %u", call);
}

/* Why a poisoned RESULT ended call r: what the aggregator saw differ, in words, into buf; its cause. */
static int describe_poison(const run_t *r, char *buf, size_t size) {
    const struct sa_worker *w = r->w;
    const struct sa_header *h = &r->poisoned;
    const uint32_t *info = r->poison_info; /* rank, call, total, flags of the contribution that differed */
    uint32_t rcall = ntohl(h->call), rtotal = ntohl(h->total);
    int cause = (h->flags & SA_FLAG_ABORT) ? SA_CAUSE_ABORTED : SA_CAUSE_MISMATCH;
    char mine[200], theirs[40], first[40], own[40];
    name_call(own, sizeof own, r->tagged, r->call);
    snprintf(mine, sizeof mine, "this rank (%u) is at call %u (%s) with %u %s elements", w->rank, r->number,
             own, (unsigned)r->len, kind_name((r->kind == 'f' ? SA_FLAG_FLOAT : 0) | r->lane_flag));
    if (w->k < SA_MISMATCH_INFO_LEN)
        snprintf(buf, size, "call %u of job %u failed on every rank: the contributions to one slot round "
                 "differed in call identity or a rank aborted (K=%d is too small to say who); %s",
                 r->number, w->job, w->k, mine);
    else if (info[3] & SA_FLAG_ABORT)
        snprintf(buf, size, "call %u of job %u failed on every rank: rank %u aborted its call %u (a local error "
                 "on that rank, see its log); %s", r->number, w->job, info[0], info[1], mine);
    else {
        name_call(theirs, sizeof theirs, r->tagged, info[1]);
        name_call(first, sizeof first, r->tagged, rcall);
        /* Same length and kind but another identity: the callers' own calls differ (tagged), or a rank
         * is a call ahead or behind (untagged). */
        const char *why = info[2] != rtotal || ((info[3] ^ h->flags) & SA_IDENTITY_FLAGS) ? ""
                          : r->tagged ? " (the same length and kind on the wire: the callers' own calls differ "
                                        "in shape, dtype, op or position)"
                                      : " (the same length and kind: a rank made a call more or fewer)";
        snprintf(buf, size, "call %u of job %u failed on every rank: rank %u sent %s with %u %s elements "
                 "(offset %u%s) to a slot round that began with %s with %u %s elements%s; %s", r->number, w->job,
                 info[0], theirs, info[2], kind_name(info[3]), ntohl(h->offset),
                 (info[3] & SA_FLAG_PRIME) ? ", exponent round" : "", first, rtotal, kind_name(h->flags), why, mine);
    }
    return cause;
}

int sa_worker_usable(const struct sa_worker *w, char *err, size_t errlen) {
    if (!w->configured) return sa_fail(err, errlen, "worker is not configured with a job");
    if (w->broken)
        return sa_fail(err, errlen, "an earlier call on this session failed, so its slots are out of step with its "
                    "peers' (open a new session): %s", w->why_broken);
    if (w->busy) return sa_fail(err, errlen, "another allreduce is running on this session");
    if (__atomic_load_n(&w->cancelled, __ATOMIC_ACQUIRE)) return sa_fail(err, errlen, "%s", w->cancel_why);
    return 0;
}

int sa_worker_cause(const struct sa_worker *w) {
    if (w->broken) return w->cause;
    if (__atomic_load_n(&w->cancelled, __ATOMIC_ACQUIRE)) return w->cancel_cause;
    return SA_CAUSE_ERROR;
}

uint32_t sa_call_identity(uint32_t seq, uint32_t tag) {
    if (tag == 0) return seq;
    /* murmur3's finaliser on the tag, then on it mixed with the sequence number: a 32-bit digest in
     * which any change of either changes the identity (two differing calls collide with p = 2^-32) */
    uint32_t h = tag;
    for (int round = 0; round < 2; round++) {
        h ^= h >> 16;
        h *= 0x85ebca6bu;
        h ^= h >> 13;
        h *= 0xc2b2ae35u;
        h ^= h >> 16;
        if (round == 0) h ^= seq * 0x9e3779b1u;
    }
    return h;
}

void sa_worker_cancel(struct sa_worker *w, const char *why, int cause) {
    if (__atomic_load_n(&w->cancelled, __ATOMIC_ACQUIRE)) return;
    snprintf(w->cancel_why, sizeof w->cancel_why, "%s", why);
    w->cancel_cause = cause;
    __atomic_store_n(&w->cancelled, 1, __ATOMIC_RELEASE);
    uint64_t one = 1;
    if (w->cancel_fd >= 0) (void)!write(w->cancel_fd, &one, sizeof one);
}

/* The run's buffers go with it. */
static void free_run(run_t *r) {
    free(r->slots);
    free(r->ready);
    free(r->exp_local);
    free(r->exp_max);
}

/* After a failed call or hello round: the worker is broken, and why_broken says why. */
static void note_failure(struct sa_worker *w, run_t *r, int rc, int err) {
    switch (rc) {
    case SA_CALL_POISONED:
        w->broken = 1;
        w->cause = describe_poison(r, w->why_broken, sizeof w->why_broken);
        break;
    case SA_CALL_TIMEOUT:
        /* No result at all: the peers may be alive and making other calls (a rank made a call fewer),
         * stalled past the timeout, or gone; a liveness watcher, where there is one, says which first. */
        w->broken = 1;
        w->cause = SA_CAUSE_TIMEOUT;
        if (r->hello)
            snprintf(w->why_broken, sizeof w->why_broken,
                     "opening the session failed: no answer to its hello from the aggregator for %.1f s (job %u, "
                     "rank %u, hello round %u): every rank of the job opens its session together; a peer has not "
                     "started (or is still in an earlier session: a rank restarted alone cannot rejoin its peers' "
                     "session, restart them all), or the aggregator is unreachable",
                     (double)w->timeout_ns / 1e9, w->job, w->rank, (unsigned)w->stats.hello_rounds);
        else
            snprintf(w->why_broken, sizeof w->why_broken,
                     "no result from the aggregator for %.1f s (job %u, rank %u, call %u, %zu of %zu slots done): "
                     "a peer has not made this call (it made fewer calls, is stalled, is gone, or restarted into a "
                     "new session) or the aggregator is unreachable",
                     (double)w->timeout_ns / 1e9, w->job, w->rank, r->number, r->done, r->active);
        break;
    case SA_CALL_NOMEM:
        break;
    case SA_CALL_CANCELLED:
        w->broken = 1;
        w->cause = w->cancel_cause;
        snprintf(w->why_broken, sizeof w->why_broken, "%s (job %u, rank %u, %s %u, %zu of %zu slots done)",
                 w->cancel_why, w->job, w->rank, r->hello ? "hello round" : "call",
                 r->hello ? (unsigned)w->stats.hello_rounds : r->number, r->done, r->active);
        break;
    default:
        w->broken = 1;
        w->cause = SA_CAUSE_ERROR;
        snprintf(w->why_broken, sizeof w->why_broken, "%s %u failed: %s", r->hello ? "hello round" : "call",
                 r->hello ? (unsigned)w->stats.hello_rounds : r->number, strerror(err));
        errno = err;
    }
}

uint32_t sa_hello_digest(const uint32_t *words, size_t n, char domain) {
    uint32_t h = sa_call_identity((uint32_t)n, (uint32_t)(unsigned char)domain << 24 | 0x5a11u);
    for (size_t i = 0; i < n; i++) h = sa_call_identity(h, words[i] ^ 0x9e3779b9u);
    return h ? h : 1u;
}

/* One hello round of `words` (n int32, summed in place) in incarnation `inc`, on the job's slot `off`,
 * which the engine sees as a job of that one slot. A failure breaks the worker, saying it was the hello. */
static int hello_round(struct sa_worker *w, uint32_t *words, uint32_t inc, uint32_t prev_inc, size_t off) {
    run_t r = {.w = w, .kind = 'i', .data = words, .len = (size_t)w->n, .bits = 32, .hello = 1, .inc = inc,
               .prev_inc = prev_inc, .vals = (size_t)w->k, .nb = 1};
    w->stats.hello_rounds++;
    int base = w->slot_base, count = w->slot_count, window = w->window;
    w->slot_base += (int)off;
    w->sets += off;
    w->slot_count = w->window = 1;
    w->busy = 1;
    int rc = run_call(&r, 0);
    w->busy = 0;
    w->slot_base = base;
    w->sets -= off;
    w->slot_count = count;
    w->window = window;
    int err = errno;
    free_run(&r);
    if (rc == SA_CALL_OK) return rc;
    note_failure(w, &r, rc, err);
    if (rc == SA_CALL_POISONED) { /* say it was the hello, not a call */
        static const char pre[] = "opening the session failed: ";
        size_t len = strnlen(w->why_broken, sizeof w->why_broken - sizeof pre);
        memmove(w->why_broken + sizeof pre - 1, w->why_broken, len);
        memcpy(w->why_broken, pre, sizeof pre - 1);
        w->why_broken[sizeof pre - 1 + len] = '\0';
    }
    return rc;
}

/* The session's hello (docs/PROTOCOL.md, Sessions): rounds of one int32 word per rank, a fresh random
 * word each, whose low bit vouches that this rank found its own word in the round before. A round's
 * incarnation is a digest of the round before (0 for the first), so rounds of an earlier session can
 * answer only a round whose predecessor every rank found stale; the session starts, with an incarnation
 * digested from the round, when a round holds this rank's own word and every rank's vouch. Every rank
 * sees the same rounds, so every rank starts the same session, or none does. */
static int open_session(struct sa_worker *w) {
    uint64_t t0 = sa_now_ns();
    size_t n = (size_t)w->n;
    uint32_t *words = calloc(n, sizeof *words);
    if (words == NULL) return SA_CALL_NOMEM;
    uint32_t inc = 0, prev = 0, vouch = 0;
    for (int round = 0; round < SA_HELLO_PHASES; round++) {
        uint32_t mine = 0;
        if (getrandom(&mine, sizeof mine, 0) != (ssize_t)sizeof mine) mine = (uint32_t)sa_now_ns() * 0x9e3779b1u;
        mine = (mine & ~1u) | vouch;
        if ((mine & ~1u) == 0) mine |= 2u;
        memset(words, 0, n * sizeof *words);
        words[w->rank] = mine;
        /* Round k on the job's slot (k-1) mod W: a rank whose rounds an earlier session's stored ones
         * answered at once runs ahead of its peers by those rounds, and must not overwrite one that a
         * peer has yet to be answered from. */
        size_t off = (size_t)round % (size_t)w->slot_count;
        int rc = hello_round(w, words, inc, prev, off);
        if (rc != SA_CALL_OK) {
            free(words);
            return rc;
        }
        int fresh = words[w->rank] == mine, all = 1;
        for (size_t i = 0; i < n; i++) all &= (int)(words[i] & 1u);
        if (fresh && all) {
            /* Every rank is past the rounds before this one: their slots start again on set 0, and a
             * last round in the session's own incarnation overwrites the first (on the first slot), so
             * that the next session's first round is fresh, not this one's stored first round (which it
             * would follow, one round more with each session). */
            size_t used = (size_t)round < (size_t)w->slot_count ? (size_t)round : (size_t)w->slot_count;
            for (size_t x = 0; x < used; x++)
                if (x != off) w->sets[x] = 0;
            w->inc = sa_hello_digest(words, n, 's');
            memset(words, 0, n * sizeof *words);
            rc = hello_round(w, words, w->inc, inc, 0);
            free(words);
            if (rc != SA_CALL_OK) return rc;
            w->opened = 1;
            /* A one-packet round trip says nothing of how long a call's window waits in a slow link's
             * queue: the first call starts, as without a hello, from the initial timeout. */
            w->srtt_ns = w->rttvar_ns = 0;
            w->stats.hello_ns += sa_now_ns() - t0;
            return SA_CALL_OK;
        }
        vouch = (uint32_t)fresh;
        prev = inc;
        inc = sa_hello_digest(words, n, 'h');
    }
    free(words);
    w->broken = 1;
    w->cause = SA_CAUSE_ERROR;
    snprintf(w->why_broken, sizeof w->why_broken,
             "opening the session failed: the ranks of job %u did not agree on a session in %d hello rounds "
             "(another process is sending as one of its ranks?)", w->job, SA_HELLO_PHASES);
    return SA_CALL_POISONED;
}

int sa_worker_open_session(struct sa_worker *w) {
    if (w->opened) return SA_CALL_OK;
    return open_session(w);
}

int sa_worker_call(struct sa_worker *w, char kind, void *data, size_t len, int abort, uint32_t tag, int bits,
                   float *residual) {
    int rc = sa_worker_open_session(w);
    if (rc != SA_CALL_OK) return rc;
    run_t r = {.w = w, .kind = kind, .data = data, .len = len, .tagged = tag != 0, .bits = bits,
               .residual = bits == 32 ? NULL : residual, .inc = w->inc};
    r.lane_flag = bits == 16 ? SA_FLAG_LANE16 : bits == 8 ? SA_FLAG_LANE8 : 0;
    r.vals = sa_lanes_per_packet((uint32_t)w->k, bits);
    r.xwords = sa_scale_words((uint32_t)w->k, bits);
    r.nb = bits == 32 ? 1 : (r.vals + SA_SCALE_BLOCK - 1) / SA_SCALE_BLOCK;
    w->busy = 1;
    r.number = ++w->call;
    r.call = sa_call_identity(r.number, tag);
    rc = run_call(&r, abort);
    w->busy = 0;
    int err = errno;
    free_run(&r);
    if (rc == SA_CALL_OK) {
        if (!abort) w->stats.allreduces++;
        if (!abort) w->stats.lane_bytes[bits == 32 ? 0 : bits == 16 ? 1 : 2] += (unsigned long long)r.chunks * w->pkt_len;
    } else {
        note_failure(w, &r, rc, err);
    }
    if (abort && !w->broken) { /* nothing came back poisoned (no peer), but peers may still come */
        w->broken = 1;
        w->cause = SA_CAUSE_ABORTED;
        snprintf(w->why_broken, sizeof w->why_broken, "this rank aborted call %u", r.number);
    }
    return rc;
}

void sa_worker_close(struct sa_worker *w) {
    if (w->fd >= 0) close(w->fd);
    w->fd = -1;
    if (w->cancel_fd >= 0) close(w->cancel_fd);
    w->cancel_fd = -1;
    w->configured = 0;
    free_bufs(w);
}
