/* The software aggregator engine, the algorithm of docs/PROTOCOL.md in C.
 *
 * One UDP port, served by sa_agg_serve (the binding, aggregator_py.c, releases the GIL around it)
 * with nthreads threads, each on its own socket: recvmmsg a batch, process it under the thread's
 * mutex (so add_job/remove_job/counters from other threads, which take every thread's, see whole
 * batches), sendmmsg the results. No allocation on the per-packet path.
 *
 * Threads: the sockets form an SO_REUSEPORT group on the same address, and a classic BPF program
 * steers each datagram to socket (pool & SA_POOL_SLOT_MASK) % nthreads, read from the header (the
 * program sees the UDP payload). So a slot's packets, DATA and a spine's RESULT alike, are served
 * by one thread only: slot state needs no lock, each thread counts in its own counters (a job's
 * too), and results leave from the port the workers sent to.
 *
 * A job is aggregated either in one level (its ranks are workers, or leaves when this is a spine:
 * the code is the same) or as a leaf of a two-level job (docs/PROTOCOL.md, Two levels): it sums its
 * local ranks and sends the partial to its spine, and multicasts the spine's RESULT. */
#define _GNU_SOURCE
#include "aggregator.h"

#include <arpa/inet.h>
#include <errno.h>
#include <linux/filter.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/udp.h>
#include <sys/socket.h>
#include <unistd.h>

#include "clock.h"
#include "errmsg.h"
#include "gaps.h"
#include "sockets.h"

#define OUT_PAYLOADS 64              /* result payload buffers before a forced flush */
#define POLL_MS 50                   /* how soon stop() and the tick are noticed */

const char *const sa_fault_names[SA_F_N] = {"dropped_in", "duplicated_in", "dropped_out", "duplicated_out"};
/* Same order as enum sa_drop and protocol.DROP_REASONS. */
const char *const sa_drop_names[SA_DROP_NREASONS] = {"bad_version", "bad_type", "unknown_job", "bad_rank",
                                                     "spoofed",     "bad_pool", "truncated"};
const char *const sa_job_counter_names[SA_JOB_COUNTERS] = {"aggregated", "multicast", "resent", "retrans_ignored",
                                                           "upstream", "upstream_resent", "stale_results"};

/* A job's counters as one thread counts them, in sa_job_counter_names order (the last three: a
 * leaf's job only); a cache line each, so threads never share one. */
enum { JC_AGGREGATED, JC_MULTICAST, JC_RESENT, JC_RETRANS_IGNORED, JC_UPSTREAM, JC_UPSTREAM_RESENT, JC_STALE };
struct job_ctr {
    uint64_t c[SA_JOB_COUNTERS];
} __attribute__((aligned(64)));

struct job {
    uint16_t id, gen;
    uint32_t n, base, count, k;
    uint32_t key;                    /* written into every RESULT; workers accept only results with it */
    /* Rank r's address, bound by the control plane: its packets must come from it and its results
     * go to it. There is no learnt mode: a foreign packet must never count as a rank's contribution. */
    struct sockaddr_in addrs[SA_MAX_WORKERS];
    uint32_t local_mask;             /* ranks with an address here: all of them, except on a leaf */
    uint32_t m;                      /* contributions that complete a slot here: popcount(local_mask) */
    uint32_t first_local;            /* the lowest local rank: only its resends re-send a partial */
    int leaf;                        /* a leaf of a two-level job: partials go to upstream */
    int quiet;                       /* no loss notices to its ranks (they may be P4 leaves) */
    uint16_t leaf_index;             /* this leaf's rank at the spine */
    struct sockaddr_in upstream;     /* the spine; RESULTs are accepted only from it */
    struct job_ctr *ctr;             /* one per thread: a thread counts only in its own */
    /* Slot state; index i = local_slot * 2 + set. A set's stamp: the installation's generation and the
     * session incarnation of the round it holds (docs/PROTOCOL.md, Sessions); a packet of another
     * stamp finds the set empty. */
    uint16_t *sgen;
    uint32_t *sinc;
    uint32_t *bitmap;
    uint8_t *cnt;
    int8_t *exp;
    uint32_t *values;                /* count * 2 * k, host order, uint32 so that adds wrap */
    uint32_t scale_words[2];         /* narrow payloads: leading words of scale bytes, 16 and 8 bits */
    /* The round's identity, from its first contribution: every other one must match it. */
    uint32_t *rcall, *rtotal, *roffset;
    uint8_t *rflags;
    uint8_t *poison;                 /* SA_POISON_FLAGS the round got: its result carries no sum */
    /* Leaf only, per state index: the value is the spine's result. */
    uint8_t *final;
    /* Loss notices (docs/PROTOCOL.md): which rank skipped which round; per state index, whether the
     * ranks the round has were told to wait for the missing ones. */
    struct sa_gaps gaps;
    uint8_t *held;
};

static void job_free(struct job *j) {
    if (j == NULL) return;
    free(j->sgen);
    free(j->sinc);
    free(j->bitmap);
    free(j->cnt);
    free(j->exp);
    free(j->values);
    free(j->rcall);
    free(j->rtotal);
    free(j->roffset);
    free(j->rflags);
    free(j->poison);
    free(j->final);
    free(j->held);
    sa_gaps_free(&j->gaps);
    free(j->ctr);
    free(j);
}

/* ---- the packet path (called by the thread that owns the slot, with its lock held) ---- */

/* The per-element kernels. Byte swaps vectorize only with pshufb (SSSE3/AVX2), which baseline
 * x86-64 lacks, hence the clones picked at load time. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SA_KERNEL __attribute__((target_clones("avx2", "ssse3", "default")))
#else
#define SA_KERNEL
#endif

SA_KERNEL static void k_load(uint32_t *restrict v, const uint32_t *restrict p, uint32_t k) {
    for (uint32_t e = 0; e < k; e++) v[e] = __builtin_bswap32(p[e]);
}

SA_KERNEL static void k_add(uint32_t *restrict v, const uint32_t *restrict p, uint32_t k) {
    for (uint32_t e = 0; e < k; e++) v[e] += __builtin_bswap32(p[e]);
}

/* Narrow lanes (docs/PROTOCOL.md): each lane of a word adds on its own, wrapping inside the lane;
 * hi holds the lanes' sign bits, whose carries are the ones that must not cross into a neighbour. */
SA_KERNEL static void k_add_lanes(uint32_t *restrict v, const uint32_t *restrict p, uint32_t k, uint32_t hi) {
    for (uint32_t e = 0; e < k; e++) {
        uint32_t a = v[e], b = __builtin_bswap32(p[e]);
        v[e] = ((a & ~hi) + (b & ~hi)) ^ ((a ^ b) & hi);
    }
}

/* Scale words: the unsigned max of each byte. */
static void k_max_bytes(uint32_t *v, const uint32_t *p, uint32_t words) {
    for (uint32_t e = 0; e < words; e++) {
        uint32_t a = v[e], b = __builtin_bswap32(p[e]), m = 0;
        for (int sh = 0; sh < 32; sh += 8) {
            uint32_t x = (a >> sh) & 0xffu, y = (b >> sh) & 0xffu;
            m |= (x > y ? x : y) << sh;
        }
        v[e] = m;
    }
}

/* Adds a contribution of the round's lane width to the slot's values. */
static void add_payload(const struct job *j, uint32_t *v, const uint32_t *p, uint8_t flags) {
    int bits = sa_lane_bits(flags);
    if (bits == 32) {
        k_add(v, p, j->k);
        return;
    }
    uint32_t x = j->scale_words[bits == 16 ? 0 : 1];
    k_max_bytes(v, p, x);
    k_add_lanes(v + x, p + x, j->k - x, bits == 16 ? 0x80008000u : 0x80808080u);
}

static int same_addr(const struct sockaddr_in *x, const struct sockaddr_in *y);

/* Sends out[idx[0..count)] one datagram each. */
static void send_each(struct sa_agg_thread *t, const size_t *idx, size_t count) {
    for (size_t i = 0; i < count; i++) {
        struct out_msg *o = &t->out[idx[i]];
        t->tx_iov[i][0].iov_base = &o->head;
        t->tx_iov[i][0].iov_len = sizeof o->head;
        t->tx_iov[i][1].iov_base = (void *)o->payload;
        t->tx_iov[i][1].iov_len = o->payload_len;
        memset(&t->tx_msgs[i], 0, sizeof t->tx_msgs[i]);
        t->tx_msgs[i].msg_hdr.msg_name = &o->dst;
        t->tx_msgs[i].msg_hdr.msg_namelen = sizeof o->dst;
        t->tx_msgs[i].msg_hdr.msg_iov = t->tx_iov[i];
        t->tx_msgs[i].msg_hdr.msg_iovlen = 2;
    }
    size_t done = 0;
    while (done < count) { /* bounded: every iteration sends >= 1 datagram or skips one that failed */
        int r = sendmmsg(t->fd, &t->tx_msgs[done], (unsigned)(count - done), 0);
        if (r > 0) {
            t->tx += (uint64_t)r;
            for (int i = 0; i < r; i++) t->tx_bytes += t->tx_msgs[done + (size_t)i].msg_len;
            done += (size_t)r;
        } else if (r < 0 && errno == EINTR) {
            continue;
        } else {
            done++; /* e.g. ECONNREFUSED from an earlier ICMP error: UDP loses this one */
        }
    }
}

/* The thread that owns a slot: its steering class's (protocol.h, SA_STEER_CLASSES), so a GSO train of
 * one class is one thread's whole. */
static inline uint32_t slot_owner(const struct sa_agg *a, uint32_t slot) {
    return (slot % SA_STEER_CLASSES) % (uint32_t)a->nthreads;
}

/* A partial (DATA) goes up to a spine that may run several threads: its GSO trains hold one class. */
static inline int same_train(const struct out_msg *a, const struct out_msg *b) {
    return a->head.type != SA_MSG_DATA ||
           (ntohs(a->head.pool) & SA_POOL_SLOT_MASK) % SA_STEER_CLASSES ==
               (ntohs(b->head.pool) & SA_POOL_SLOT_MASK) % SA_STEER_CLASSES;
}

/* The queued results regrouped by destination (a worker's results keep their order: it is the order
 * RACK relies on; across workers order does not matter), each group of one size sent as one UDP
 * GSO datagram train: a sendmsg per worker and batch instead of one per result. Where the kernel
 * refuses (EIO: no checksum offload; EINVAL: a segment above the device's MTU), GSO is off for
 * this thread and the rest goes one datagram each. */
static void flush_gso(struct sa_agg_thread *t) {
    size_t m = t->n_out, nmsg = 0, nidx = 0, niov = 0;
    uint8_t taken[SA_OUT_MSGS] = {0};
    for (size_t i = 0; i < m; i++) {
        if (taken[i]) continue;
        const struct out_msg *o = &t->out[i];
        size_t len = sizeof o->head + o->payload_len;
        int max = sa_gso_segments(len, 0);
        size_t segs = 0, first_iov = niov;
        t->tx_first[nmsg] = nidx;
        for (size_t j = i; j < m && segs < (size_t)(max ? max : 1); j++) {
            struct out_msg *q = &t->out[j];
            if (taken[j] || !same_addr(&q->dst, &o->dst) || sizeof q->head + q->payload_len != len ||
                !same_train(q, o))
                continue;
            taken[j] = 1;
            t->tx_idx[nidx++] = j;
            t->tx_flat[niov].iov_base = &q->head;
            t->tx_flat[niov++].iov_len = sizeof q->head;
            t->tx_flat[niov].iov_base = (void *)q->payload;
            t->tx_flat[niov++].iov_len = q->payload_len;
            segs++;
        }
        struct msghdr *h = &t->tx_msgs[nmsg].msg_hdr;
        memset(&t->tx_msgs[nmsg], 0, sizeof t->tx_msgs[nmsg]);
        h->msg_name = (void *)&o->dst;
        h->msg_namelen = sizeof o->dst;
        h->msg_iov = &t->tx_flat[first_iov];
        h->msg_iovlen = niov - first_iov;
        if (segs > 1) {
            h->msg_control = t->tx_ctrl[nmsg];
            h->msg_controllen = sizeof t->tx_ctrl[nmsg];
            struct cmsghdr *c = CMSG_FIRSTHDR(h);
            c->cmsg_level = SOL_UDP;
            c->cmsg_type = UDP_SEGMENT;
            c->cmsg_len = CMSG_LEN(sizeof(uint16_t));
            uint16_t gso = (uint16_t)len;
            memcpy(CMSG_DATA(c), &gso, sizeof gso);
        }
        t->tx_segs[nmsg++] = segs;
    }
    size_t done = 0;
    while (done < nmsg) {
        int r = sendmmsg(t->fd, &t->tx_msgs[done], (unsigned)(nmsg - done), 0);
        if (r > 0) {
            for (int i = 0; i < r; i++) {
                t->tx += t->tx_segs[done + (size_t)i];
                t->tx_bytes += t->tx_msgs[done + (size_t)i].msg_len;
                t->gso_sends += t->tx_segs[done + (size_t)i] > 1;
            }
            done += (size_t)r;
        } else if (r < 0 && errno == EINTR) {
            continue;
        } else if (r < 0 && t->tx_segs[done] > 1 &&
                   (errno == EIO || errno == EINVAL || errno == ENOPROTOOPT || errno == EOPNOTSUPP)) {
            t->gso = 0; /* this kernel or device cannot: one datagram each from now on */
            size_t from = t->tx_first[done];
            memmove(t->tx_idx, t->tx_idx + from, (nidx - from) * sizeof *t->tx_idx);
            send_each(t, t->tx_idx, nidx - from);
            return;
        } else {
            done++; /* e.g. ECONNREFUSED from an earlier ICMP error: UDP loses these */
        }
    }
}

static void flush_out(struct sa_agg_thread *t) {
    size_t m = t->n_out;
    if (t->gso && m > 1) {
        flush_gso(t);
        t->n_out = 0;
        return;
    }
    for (size_t i = 0; i < m; i++) t->tx_idx[i] = i;
    send_each(t, t->tx_idx, m);
    t->n_out = 0;
}

/* Payload buffers are reused only after a flush, so no queued message points at a reused one. */
static uint8_t *take_payload(struct sa_agg_thread *t) {
    if (t->n_payloads == OUT_PAYLOADS) {
        flush_out(t);
        t->n_payloads = 0;
    }
    return t->out_payloads + (t->n_payloads++) * SA_RX_BUF;
}

/* payload NULL: the one word `word` (a STATUS) */
static void queue_msg(struct sa_agg_thread *t, const struct sa_header *h, uint8_t type, uint16_t rank, int8_t exp,
                      const uint8_t *payload, size_t len, const struct sockaddr_in *dst, uint32_t word) {
    int copies = 1;
    if (t->a->drop_out > 0 && sa_rand01(&t->rng) < t->a->drop_out) {
        t->faults[SA_F_DROPPED_OUT]++;
        return;
    }
    if (t->a->dup_out > 0 && sa_rand01(&t->rng) < t->a->dup_out) {
        t->faults[SA_F_DUPLICATED_OUT]++;
        copies = 2;
    }
    for (int c = 0; c < copies; c++) {
        if (t->n_out == SA_OUT_MSGS) flush_out(t); /* keeps the payload buffers: more copies may follow */
        struct out_msg *o = &t->out[t->n_out++];
        o->head = *h;
        o->head.type = type;
        o->head.rank = htons(rank);
        o->head.exp = exp;
        o->word = word;
        o->payload = payload ? payload : (const uint8_t *)&o->word;
        o->payload_len = len;
        o->dst = *dst;
    }
}

/* The header every copy of state index si's RESULT carries (the rank is set per copy): the round's
 * identity, its poison, and the job's key, so a worker can tell it from anything else. */
static struct sa_header round_header(const struct job *j, uint32_t pool, size_t si) {
    struct sa_header r = {
        .version = SA_VERSION,
        .type = SA_MSG_RESULT,
        .flags = (uint8_t)(j->rflags[si] | j->poison[si]),
        .exp = j->exp[si],
        .job = htons(j->id),
        .pool = htons((uint16_t)pool),
        .elems = htons((uint16_t)j->k),
        .offset = htonl(j->roffset[si]),
        .call = htonl(j->rcall[si]),
        .total = htonl(j->rtotal[si]),
        .key = htonl(j->key ^ j->sinc[si]), /* a stored result answers only the session that made it */
    };
    return r;
}

/* Result payload of state index si, converted to network order in a fresh output buffer. */
static const uint8_t *encode_result(struct sa_agg_thread *t, const struct job *j, size_t si) {
    uint8_t *buf = take_payload(t);
    k_load((uint32_t *)buf, j->values + si * j->k, j->k); /* a byte swap is its own inverse */
    return buf;
}

static int same_addr(const struct sockaddr_in *x, const struct sockaddr_in *y) {
    return x->sin_addr.s_addr == y->sin_addr.s_addr && x->sin_port == y->sin_port;
}

/* RESULT(value[si]) to rank r alone. */
static void unicast(struct sa_agg_thread *t, const struct job *j, uint32_t pool, size_t si, uint32_t r) {
    struct sa_header rh = round_header(j, pool, si);
    queue_msg(t, &rh, SA_MSG_RESULT, (uint16_t)r, rh.exp, encode_result(t, j, si), 4 * (size_t)j->k, &j->addrs[r], 0);
}

/* RESULT(value[si]) to every rank with an address here. */
static void multicast(struct sa_agg_thread *t, struct job *j, uint32_t pool, size_t si) {
    struct sa_header rh = round_header(j, pool, si);
    const uint8_t *out = encode_result(t, j, si);
    for (uint32_t q = 0; q < j->n; q++) {
        if (j->local_mask >> q & 1)
            queue_msg(t, &rh, SA_MSG_RESULT, (uint16_t)q, rh.exp, out, 4 * (size_t)j->k, &j->addrs[q], 0);
    }
    j->ctr[t->index].c[JC_MULTICAST]++;
}

/* A leaf's partial of state index si to the spine: a worker's DATA with rank = the leaf index. */
static void send_partial(struct sa_agg_thread *t, const struct job *j, uint32_t slot, uint32_t s, size_t si) {
    struct sa_header up = round_header(j, slot | (s ? SA_POOL_SET_BIT : 0), si);
    up.key = htonl(j->sinc[si]); /* a DATA carries its session's incarnation */
    const uint8_t *out = encode_result(t, j, si);
    queue_msg(t, &up, SA_MSG_DATA, j->leaf_index, j->exp[si], out, 4 * (size_t)j->k, &j->upstream, 0);
}

/* A STATUS of state index si's round to rank r: the round's identity and the ranks it has. */
static void status_to(struct sa_agg_thread *t, const struct job *j, size_t si, uint32_t r) {
    uint32_t pool = (j->base + (uint32_t)(si / 2)) | (si & 1 ? SA_POOL_SET_BIT : 0);
    struct sa_header h = round_header(j, pool, si);
    h.flags = j->rflags[si] & SA_IDENTITY_FLAGS;
    h.elems = htons(1);
    queue_msg(t, &h, SA_MSG_STATUS, (uint16_t)r, SA_EXP_NONE, NULL, 4, &j->addrs[r], htonl(j->bitmap[si]));
}

struct skip_ctx {
    struct sa_agg_thread *t;
    struct job *j;
};

/* The detector found rank r past round si (gaps.h): if the round still waits for r, tell r to resend,
 * and (once per round) tell the ranks it has to wait rather than resend too. */
static void on_skip(void *p, uint32_t si, uint32_t r) {
    struct skip_ctx *x = p;
    struct job *j = x->j;
    uint32_t bit = 1u << r;
    if (j->cnt[si] == j->m || (j->bitmap[si] & bit) || !(j->local_mask & bit)) return;
    status_to(x->t, j, si, r);
    x->t->status_resend++;
    if (j->held[si]) return;
    j->held[si] = 1;
    for (uint32_t q = 0; q < j->n; q++)
        if (j->bitmap[si] >> q & 1) {
            status_to(x->t, j, si, q);
            x->t->status_hold++;
        }
}

/* The slot a packet of job j addresses (its index in the job and its shadow set), or 0 with the
 * drop counted when the slot is not the job's or the payload is not exactly `words` values (K, or a
 * STATUS's one), or when the slot is not this thread's. */
static int job_slot(struct sa_agg_thread *t, const struct job *j, const struct sa_header *h, size_t len,
                    uint32_t words, uint32_t *local, uint32_t *s) {
    uint32_t pool = ntohs(h->pool);
    uint32_t slot = pool & SA_POOL_SLOT_MASK;
    if (slot < j->base || slot >= j->base + j->count) {
        t->drops[SA_DROP_BAD_POOL]++;
        return 0;
    }
    if (len != SA_HEADER_LEN + 4 * (size_t)words || ntohs(h->elems) != words) {
        t->drops[SA_DROP_TRUNCATED]++;
        return 0;
    }
    if (slot_owner(t->a, slot) != (uint32_t)t->index) {
        /* Another thread's slot: only a packet queued before the group had all its sockets can
         * land here. Its state is not ours to touch; the sender's resend is steered right. */
        t->misrouted++;
        return 0;
    }
    *local = slot - j->base;
    *s = pool >> 15;
    return 1;
}

/* A RESULT or a STATUS: only a leaf takes one, only from its spine, and only about the round of its
 * partial that waits for the spine. A RESULT answers it; a STATUS whose bitmap lacks this leaf says
 * the partial was lost on the way up, and it is sent again. */
static void process_from_spine(struct sa_agg_thread *t, const uint8_t *buf, size_t len,
                               const struct sockaddr_in *src) {
    const struct sa_header *h = (const struct sa_header *)buf;
    struct job *j = t->a->jobs[ntohs(h->job)];
    if (j == NULL || !j->leaf) { /* what a worker sent by mistake, as in one level */
        t->drops[SA_DROP_BAD_TYPE]++;
        return;
    }
    if (ntohs(h->rank) != j->leaf_index) {
        t->drops[SA_DROP_BAD_RANK]++;
        return;
    }
    if (!same_addr(&j->upstream, src)) {
        t->drops[SA_DROP_SPOOFED]++;
        return;
    }
    int status = h->type == SA_MSG_STATUS;
    uint32_t local, s;
    if (!job_slot(t, j, h, len, status ? 1 : j->k, &local, &s)) return;
    size_t si = 2 * (size_t)local + s;
    /* A set of an earlier installation (gen differs) sent no partial of this one: stale too. The
     * spine's result carries the partial's identity, its session's key, and its poison if any round
     * below had one. */
    if (j->sgen[si] != j->gen || j->cnt[si] != j->m || j->final[si] || ntohl(h->key) != (j->key ^ j->sinc[si]) ||
        ntohl(h->offset) != j->roffset[si] || ntohl(h->call) != j->rcall[si] ||
        ntohl(h->total) != j->rtotal[si] || (h->flags & SA_IDENTITY_FLAGS) != (j->rflags[si] & SA_IDENTITY_FLAGS)) {
        j->ctr[t->index].c[JC_STALE]++;
        return;
    }
    if (status) {
        uint32_t have;
        memcpy(&have, buf + SA_HEADER_LEN, sizeof have);
        if (ntohl(have) >> j->leaf_index & 1) return; /* the spine has it: its result is on the way */
        send_partial(t, j, j->base + local, s, si);
        j->ctr[t->index].c[JC_UPSTREAM_RESENT]++;
        return;
    }
    k_load(j->values + si * j->k, (const uint32_t *)(buf + SA_HEADER_LEN), j->k);
    j->exp[si] = h->exp;
    j->poison[si] = h->flags & SA_POISON_FLAGS;
    j->final[si] = 1;
    multicast(t, j, ntohs(h->pool), si);
}

/* Does state index si hold a round of this installation and of session `inc` (its stamp)? */
static inline int of_session(const struct job *j, size_t si, uint32_t inc) {
    return j->sgen[si] == j->gen && j->sinc[si] == inc;
}

static void process(struct sa_agg_thread *t, const uint8_t *buf, size_t len, const struct sockaddr_in *src) {
    if (len < SA_HEADER_LEN) {
        t->drops[SA_DROP_TRUNCATED]++;
        return;
    }
    const struct sa_header *h = (const struct sa_header *)buf;
    if (h->version != SA_VERSION) {
        t->drops[SA_DROP_BAD_VERSION]++;
        return;
    }
    if (sa_lane_bits(h->flags) == 0) { /* LANES = 3 names no width */
        t->drops[SA_DROP_BAD_TYPE]++;
        return;
    }
    if (h->type == SA_MSG_RESULT || h->type == SA_MSG_STATUS) {
        process_from_spine(t, buf, len, src);
        return;
    }
    if (h->type != SA_MSG_DATA) {
        t->drops[SA_DROP_BAD_TYPE]++;
        return;
    }
    struct job *j = t->a->jobs[ntohs(h->job)];
    if (j == NULL) {
        t->drops[SA_DROP_UNKNOWN_JOB]++;
        return;
    }
    uint32_t r = ntohs(h->rank);
    if (r >= j->n) {
        t->drops[SA_DROP_BAD_RANK]++;
        return;
    }
    if (!(j->local_mask >> r & 1) || !same_addr(&j->addrs[r], src)) { /* a rank behind another leaf */
        t->drops[SA_DROP_SPOOFED]++;
        return;
    }
    uint32_t local, s;
    if (!job_slot(t, j, h, len, j->k, &local, &s)) return;
    const uint32_t k = j->k;
    uint32_t bit = 1u << r;

    size_t si = 2 * (size_t)local + s, so = 2 * (size_t)local + (1 - s);
    uint32_t inc = ntohl(h->key); /* the sender's session incarnation */
    if (!of_session(j, si, inc)) {
        /* The set holds another installation's or another session's round (or none): this packet finds
         * it empty, so no bit of an earlier session makes it a retransmission of a round it never sent. */
        j->sgen[si] = j->gen;
        j->sinc[si] = inc;
        j->bitmap[si] = 0;
        j->cnt[si] = 0;
        if (j->leaf) j->final[si] = 0;
    }
    const uint32_t *p = (const uint32_t *)(buf + SA_HEADER_LEN);
    uint32_t *v = j->values + si * k;
    if ((j->bitmap[si] & bit) == 0) {
        int first = j->bitmap[si] == 0;
        j->bitmap[si] |= bit;
        if (of_session(j, so, inc)) j->bitmap[so] &= ~bit; /* only this session's round */
        uint8_t poison = h->flags & SA_POISON_FLAGS;
        if (first) { /* overwrite: no reset of the slot is ever needed */
            k_load(v, p, k);
            j->exp[si] = h->exp;
            j->cnt[si] = 1;
            j->rcall[si] = ntohl(h->call);
            j->rtotal[si] = ntohl(h->total);
            j->roffset[si] = ntohl(h->offset);
            j->rflags[si] = h->flags;
            j->poison[si] = poison;
            j->held[si] = 0;
            if (j->leaf) j->final[si] = 0;
        } else {
            int differs = ntohl(h->call) != j->rcall[si] || ntohl(h->total) != j->rtotal[si] ||
                          ntohl(h->offset) != j->roffset[si] ||
                          (h->flags & SA_IDENTITY_FLAGS) != (j->rflags[si] & SA_IDENTITY_FLAGS);
            if (differs) poison |= SA_FLAG_MISMATCH;
            if (j->poison[si] == 0 && poison != 0) {
                /* The round turns poisoned: its payload says who differed, from the packet when it
                 * carries that already (an abort, a poisoned partial), else from its header. */
                uint32_t info[SA_MISMATCH_INFO_LEN] = {r, ntohl(h->call), ntohl(h->total), h->flags};
                uint32_t m = k < SA_MISMATCH_INFO_LEN ? k : SA_MISMATCH_INFO_LEN;
                if (h->flags & SA_POISON_FLAGS)
                    k_load(v, p, m);
                else
                    memcpy(v, info, m * sizeof *v);
            } else if (j->poison[si] == 0) {
                add_payload(j, v, p, h->flags);
            }
            j->poison[si] |= poison;
            if (h->exp > j->exp[si]) j->exp[si] = h->exp;
            j->cnt[si]++;
        }
        j->ctr[t->index].c[JC_AGGREGATED]++;
        struct skip_ctx ctx = {t, j};
        if (t->a->notices && !j->quiet)
            sa_gaps_note(&j->gaps, (j->base + local) % SA_STEER_CLASSES, (uint32_t)si, r, first, on_skip, &ctx);
        if (j->held[si] && j->cnt[si] != j->m) { /* came after the others were told to wait: wait too */
            status_to(t, j, si, r);
            t->status_hold++;
        }
        if (j->cnt[si] == j->m) {
            if (j->leaf) {
                send_partial(t, j, j->base + local, s, si);
                j->ctr[t->index].c[JC_UPSTREAM]++;
            } else {
                multicast(t, j, ntohs(h->pool), si);
            }
        }
    } else if (j->leaf && j->final[si]) {
        unicast(t, j, ntohs(h->pool), si, r);
        j->ctr[t->index].c[JC_RESENT]++;
    } else if (j->cnt[si] == j->m) {
        if (j->leaf && r != j->first_local) {
            j->ctr[t->index].c[JC_RETRANS_IGNORED]++; /* the m workers resend alike: re-send up once per loss, not m times */
        } else if (j->leaf) {     /* still waiting for the spine: the partial or its result was lost */
            send_partial(t, j, j->base + local, s, si);
            j->ctr[t->index].c[JC_UPSTREAM_RESENT]++;
        } else {
            unicast(t, j, ntohs(h->pool), si, r);
            j->ctr[t->index].c[JC_RESENT]++;
        }
    } else {
        j->ctr[t->index].c[JC_RETRANS_IGNORED]++;
    }
}

/* ---- the engine's interface (aggregator.h) ---- */


/* The reuseport group's program: the socket index for a datagram, read from the UDP payload (the
 * switchagg header): slot_owner of its slot. A datagram too short to hold the pool
 * field ends the program at the load, which returns 0: thread 0 counts it as truncated. */
static int attach_steering(int fd, int nthreads) {
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_H | BPF_ABS, offsetof(struct sa_header, pool)),
        BPF_STMT(BPF_ALU | BPF_AND | BPF_K, SA_POOL_SLOT_MASK),
        BPF_STMT(BPF_ALU | BPF_MOD | BPF_K, SA_STEER_CLASSES),
        BPF_STMT(BPF_ALU | BPF_MOD | BPF_K, (uint32_t)nthreads),
        BPF_STMT(BPF_RET | BPF_A, 0),
    };
    struct sock_fprog prog = {.len = sizeof code / sizeof code[0], .filter = code};
    return setsockopt(fd, SOL_SOCKET, SO_ATTACH_REUSEPORT_CBPF, &prog, sizeof prog);
}

static void close_sockets(struct sa_agg *a) {
    for (int i = 0; i < a->nthreads; i++) {
        if (a->th[i].fd >= 0) close(a->th[i].fd);
        a->th[i].fd = -1;
    }
}

static void free_threads(struct sa_agg *a) {
    if (a->th == NULL) return;
    close_sockets(a);
    for (int i = 0; i < a->nthreads; i++) {
        free(a->th[i].rx_bufs);
        free(a->th[i].out_payloads);
        pthread_mutex_destroy(&a->th[i].lock);
    }
    free(a->th);
    a->th = NULL;
    a->nthreads = 0;
}

/* Thread i's socket, bound to sa (whose port is the group's once thread 0 bound it). */
static int open_socket(struct sa_agg *a, int i, struct sockaddr_in *sa, const char *host, char *err, size_t errlen) {
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return SA_ERR_SYS;
    a->th[i].fd = fd;
    if (sa_set_dont_fragment(fd) != 0) return SA_ERR_SYS; /* results leave whole or not at all */
    sa_set_sockbuf(fd, 64 << 20);
    /* GSO is asked per send (a cmsg: jobs differ in K); GRO where the kernel has it */
    a->th[i].gso = sa_gso_allowed();
    a->th[i].gro = a->th[i].gso && sa_set_gro(fd, 1) == 0;
    if (a->nthreads > 1) {
        int one = 1;
        if (setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one) != 0) return SA_ERR_SYS;
        /* On thread 0's socket before it binds: the group exists with its program from the first
         * datagram on, and a socket that already has a group never joins another one on bind. */
        if (i == 0 && attach_steering(fd, a->nthreads) != 0) {
            int e = errno;
            snprintf(err, errlen, "cannot attach the reuseport steering program (SO_ATTACH_REUSEPORT_CBPF): %s",
                     strerror(e));
            errno = e;
            return SA_ERR_BIND;
        }
    }
    if (bind(fd, (struct sockaddr *)sa, sizeof *sa) != 0) {
        int e = errno;
        snprintf(err, errlen, "cannot bind the aggregator to %s:%d: %s", host, ntohs(sa->sin_port), strerror(e));
        errno = e;
        return SA_ERR_BIND;
    }
    socklen_t sl = sizeof *sa;
    getsockname(fd, (struct sockaddr *)sa, &sl);
    return SA_OK;
}

int sa_agg_open(struct sa_agg *a, const char *host, int port, int nthreads, const double probs[4], uint64_t seed,
                char *err, size_t errlen) {
    const char *pnames[4] = {"drop_in", "dup_in", "drop_out", "dup_out"};
    if (a->th != NULL) return sa_fail(err, errlen, "the aggregator is open already");
    for (int i = 0; i < 4; i++)
        if (!(probs[i] >= 0.0 && probs[i] <= 1.0))
            return sa_fail(err, errlen, "%s must be a probability in [0, 1], got %g", pnames[i], probs[i]);
    if (port < 0 || port > 65535) return sa_fail(err, errlen, "port must be in 0..65535, got %d", port);
    if (nthreads < 1 || nthreads > SA_MAX_THREADS)
        return sa_fail(err, errlen, "threads must be in 1..%d, got %d", SA_MAX_THREADS, nthreads);
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1)
        return sa_fail(err, errlen, "host must be an IPv4 address such as 127.0.0.1, got '%s'", host);
    if (a->jobs == NULL) a->jobs = calloc(SA_NJOB_IDS, sizeof *a->jobs);
    a->th = aligned_alloc(64, (size_t)nthreads * sizeof *a->th);
    if (a->jobs == NULL || a->th == NULL) {
        free(a->th);
        a->th = NULL;
        errno = ENOMEM;
        return SA_ERR_SYS;
    }
    memset(a->th, 0, (size_t)nthreads * sizeof *a->th);
    a->nthreads = nthreads;
    /* splitmix the seed so that small seeds give unrelated streams; xorshift needs non-zero state.
     * Thread i's stream starts from seed + i: with one thread, the streams of before threads. */
    for (int i = 0; i < nthreads; i++) {
        struct sa_agg_thread *t = &a->th[i];
        t->a = a;
        t->index = i;
        t->fd = -1;
        pthread_mutex_init(&t->lock, NULL);
        uint64_t z = seed + (uint64_t)i + 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        t->rng = (z ^ (z >> 31)) | 1;
        t->rx_bufs = malloc((size_t)SA_BATCH * SA_RX_BUF);
        t->out_payloads = malloc((size_t)OUT_PAYLOADS * SA_RX_BUF);
    }
    int rc = SA_OK;
    for (int i = 0; i < nthreads && rc == SA_OK; i++) {
        if (a->th[i].rx_bufs == NULL || a->th[i].out_payloads == NULL) {
            errno = ENOMEM;
            rc = SA_ERR_SYS;
        } else {
            rc = open_socket(a, i, &sa, host, err, errlen);
        }
    }
    if (rc != SA_OK) {
        int e = errno;
        free_threads(a);
        errno = e;
        return rc;
    }
    for (int i = 0; i < nthreads; i++) {
        struct sa_agg_thread *t = &a->th[i];
        for (int b = 0; b < SA_BATCH; b++) {
            t->rx_iov[b].iov_base = t->rx_bufs + (size_t)b * SA_RX_BUF;
            t->rx_iov[b].iov_len = SA_RX_BUF;
        }
    }
    a->port = ntohs(sa.sin_port);
    snprintf(a->host, sizeof a->host, "%s", host);
    const char *notices = getenv("SWITCHAGG_LOSS_NOTICES"); /* =0: off, e.g. to measure what they save */
    a->notices = !(notices && strcmp(notices, "0") == 0);
    a->drop_in = probs[0];
    a->dup_in = probs[1];
    a->drop_out = probs[2];
    a->dup_out = probs[3];
    return SA_OK;
}

int sa_agg_is_open(const struct sa_agg *a) { return a->th != NULL && a->th[0].fd >= 0; }

/* Every thread's lock, in index order (the only place two are held): the threads see the job table
 * and their counters change between batches only. */
static void lock_all(struct sa_agg *a) {
    for (int i = 0; i < a->nthreads; i++) pthread_mutex_lock(&a->th[i].lock);
}

static void unlock_all(struct sa_agg *a) {
    for (int i = a->nthreads - 1; i >= 0; i--) pthread_mutex_unlock(&a->th[i].lock);
}

int sa_agg_add_job(struct sa_agg *a, const struct sa_job_spec *spec, char *err, size_t errlen) {
    if (a->th == NULL) return sa_fail(err, errlen, "the aggregator is not open");
    if (spec->n < 1 || spec->n > SA_MAX_WORKERS)
        return sa_fail(err, errlen, "n (workers) must be in 1..%d, got %u", SA_MAX_WORKERS, spec->n);
    if (spec->k < 1 || spec->k > SA_MAX_K) return sa_fail(err, errlen, "k must be in 1..%d, got %u", SA_MAX_K, spec->k);
    if (spec->count < 1 || (uint64_t)spec->base + spec->count > SA_NUM_SLOTS)
        return sa_fail(err, errlen, "slot range [%u, %llu) must be non-empty and inside the pool 0..%d", spec->base,
                    (unsigned long long)spec->base + spec->count, SA_NUM_SLOTS - 1);
    if (spec->gen < 1)
        return sa_fail(err, errlen, "generation must be in 1..65535 (0 means never installed), got %u", spec->gen);
    if (spec->leaf_index >= SA_MAX_WORKERS)
        return sa_fail(err, errlen, "leaf_index (the leaf's rank at the spine) must be in 0..%d, got %u",
                    SA_MAX_WORKERS - 1, spec->leaf_index);
    if (!spec->leaf && spec->leaf_index != 0)
        return sa_fail(err, errlen, "leaf_index is %u but no upstream is given", spec->leaf_index);
    if (spec->local_mask == 0) return sa_fail(err, errlen, "addrs names no rank: a leaf needs at least one local rank");
    struct job *j = calloc(1, sizeof *j);
    if (j == NULL) goto nomem;
    j->id = spec->id;
    j->gen = spec->gen;
    j->n = spec->n;
    j->base = spec->base;
    j->count = spec->count;
    j->k = spec->k;
    j->scale_words[0] = sa_scale_words(spec->k, 16);
    j->scale_words[1] = sa_scale_words(spec->k, 8);
    j->key = spec->key;
    j->leaf = spec->leaf;
    j->quiet = spec->quiet;
    j->leaf_index = spec->leaf_index;
    j->upstream = spec->upstream;
    memcpy(j->addrs, spec->addrs, sizeof j->addrs);
    j->local_mask = spec->local_mask;
    j->m = (uint32_t)__builtin_popcount(j->local_mask);
    j->first_local = (uint32_t)__builtin_ctz(j->local_mask);
    size_t count = spec->count;
    if (j->leaf && (j->final = calloc(2 * count, sizeof *j->final)) == NULL) goto nomem;
    if (sa_gaps_init(&j->gaps, 2 * count) != 0 || (j->held = calloc(2 * count, 1)) == NULL) goto nomem;
    j->ctr = aligned_alloc(64, (size_t)a->nthreads * sizeof *j->ctr);
    if (j->ctr == NULL) goto nomem;
    memset(j->ctr, 0, (size_t)a->nthreads * sizeof *j->ctr);
    /* calloc: zero state; a stamp's generation 0 never equals a valid one */
    j->sgen = calloc(2 * count, sizeof *j->sgen);
    j->sinc = calloc(2 * count, sizeof *j->sinc);
    j->bitmap = calloc(2 * count, sizeof *j->bitmap);
    j->cnt = calloc(2 * count, sizeof *j->cnt);
    j->exp = calloc(2 * count, sizeof *j->exp);
    j->values = calloc(2 * count * (size_t)spec->k, sizeof *j->values);
    j->rcall = calloc(2 * count, sizeof *j->rcall);
    j->rtotal = calloc(2 * count, sizeof *j->rtotal);
    j->roffset = calloc(2 * count, sizeof *j->roffset);
    j->rflags = calloc(2 * count, sizeof *j->rflags);
    j->poison = calloc(2 * count, sizeof *j->poison);
    if (!j->sgen || !j->sinc || !j->bitmap || !j->cnt || !j->exp || !j->values || !j->rcall || !j->rtotal ||
        !j->roffset || !j->rflags || !j->poison)
        goto nomem;
    lock_all(a);
    struct job *other = a->jobs[spec->id];
    int in_use = other != NULL;
    for (int i = 0; i < SA_NJOB_IDS && other == NULL; i++) {
        struct job *o = a->jobs[i];
        if (o != NULL && j->base < o->base + o->count && o->base < j->base + j->count) other = o;
    }
    if (other == NULL) a->jobs[spec->id] = j;
    uint32_t ob = other ? other->base : 0, oc = other ? other->count : 0, oid = other ? other->id : 0;
    unlock_all(a);
    if (other == NULL) return SA_OK;
    job_free(j);
    if (in_use) return sa_fail(err, errlen, "job id %u is already installed", spec->id);
    return sa_fail(err, errlen, "slots [%u, %u) of job %u overlap slots [%u, %u) of job %u", spec->base,
                spec->base + spec->count, spec->id, ob, ob + oc, oid);
nomem:
    job_free(j);
    errno = ENOMEM;
    return SA_ERR_SYS;
}

int sa_agg_remove_job(struct sa_agg *a, int job_id) {
    struct job *j = NULL;
    if (a->th != NULL && job_id >= 0 && job_id < SA_NJOB_IDS) {
        lock_all(a);
        j = a->jobs[job_id];
        a->jobs[job_id] = NULL;
        unlock_all(a);
    }
    if (j == NULL) return -1;
    job_free(j);
    return SA_OK;
}

void sa_agg_counters_free(struct sa_agg_counters *c) {
    free(c->jobs);
    free(c->threads);
    c->jobs = NULL;
    c->threads = NULL;
}

int sa_agg_counters(struct sa_agg *a, struct sa_agg_counters *out) {
    memset(out, 0, sizeof *out);
    if (a->th == NULL) {
        errno = EBADF;
        return SA_ERR_SYS;
    }
    out->nthreads = a->nthreads;
    out->threads = calloc((size_t)a->nthreads, sizeof *out->threads);
    lock_all(a);
    size_t njobs = 0;
    for (int i = 0; i < SA_NJOB_IDS; i++) njobs += a->jobs[i] != NULL;
    out->jobs = malloc((njobs ? njobs : 1) * sizeof *out->jobs);
    if (out->jobs != NULL && out->threads != NULL) {
        for (int i = 0; i < SA_NJOB_IDS; i++) {
            struct job *j = a->jobs[i];
            if (j == NULL) continue;
            struct sa_job_counters *c = &out->jobs[out->njobs++];
            memset(c, 0, sizeof *c);
            c->id = j->id;
            c->leaf = j->leaf;
            for (int t = 0; t < a->nthreads; t++) {
                for (int k = 0; k < SA_JOB_COUNTERS; k++) c->c[k] += j->ctr[t].c[k];
                out->threads[t].aggregated += j->ctr[t].c[JC_AGGREGATED];
            }
        }
        for (int i = 0; i < a->nthreads; i++) {
            const struct sa_agg_thread *t = &a->th[i];
            struct sa_thread_counters *tc = &out->threads[i];
            tc->rx = t->rx;
            tc->tx = t->tx;
            tc->misrouted = t->misrouted;
            out->rx += t->rx;
            out->tx += t->tx;
            out->rx_bytes += t->rx_bytes;
            out->tx_bytes += t->tx_bytes;
            out->gso_sends += t->gso_sends;
            out->gro_receives += t->gro_receives;
            out->status_resend += t->status_resend;
            out->status_hold += t->status_hold;
            for (int d = 0; d < SA_DROP_NREASONS; d++) {
                out->drops[d] += t->drops[d];
                tc->dropped += t->drops[d];
            }
            for (int f = 0; f < SA_F_N; f++) out->faults[f] += t->faults[f];
        }
    }
    unlock_all(a);
    if (out->jobs == NULL || out->threads == NULL) {
        sa_agg_counters_free(out);
        errno = ENOMEM;
        return SA_ERR_SYS;
    }
    return SA_OK;
}

/* The thread that owns a datagram's slot, as the steering program picks it (too short: thread 0). */
static uint16_t owner_of(const struct sa_agg *a, const uint8_t *p, size_t len) {
    if (a->nthreads < 2 || len < offsetof(struct sa_header, pool) + 2) return 0;
    uint16_t pool;
    memcpy(&pool, p + offsetof(struct sa_header, pool), sizeof pool);
    return (uint16_t)slot_owner(a, ntohs(pool) & SA_POOL_SLOT_MASK);
}

/* Serve one received batch: fault injection in, the algorithm, then send what it produced. A
 * datagram of another thread's slot (a GSO train is steered and queued whole, by its first
 * datagram's slot; or it came before the group had all its sockets) is served afterwards by the
 * owner's state under the owner's lock, which this thread then holds alone: slot state stays one
 * thread's at a time, and no thread ever holds two locks but lock_all. */
static void serve_batch(struct sa_agg_thread *t, int got) {
    struct sa_agg *a = t->a;
    pthread_mutex_lock(&t->lock);
    t->n_foreign = 0;
    for (int i = 0; i < got; i++) {
        /* A coalesced (GRO) receive holds several datagrams of one size back to back: each is one */
        const uint8_t *buf = t->rx_iov[i].iov_base;
        size_t total = t->rx_msgs[i].msg_len, step = t->gro ? (size_t)sa_gro_size(&t->rx_msgs[i].msg_hdr) : 0;
        if (step == 0 || step > total) step = total;
        if (step < total) t->gro_receives++;
        size_t off = 0;
        do {
            size_t len = total - off < step ? total - off : step;
            t->rx++;
            t->rx_bytes += len;
            int times = 1;
            if (a->drop_in > 0 && sa_rand01(&t->rng) < a->drop_in) {
                t->faults[SA_F_DROPPED_IN]++;
                off += step;
                continue;
            }
            if (a->dup_in > 0 && sa_rand01(&t->rng) < a->dup_in) {
                t->faults[SA_F_DUPLICATED_IN]++;
                times = 2;
            }
            uint16_t owner = owner_of(a, buf + off, len);
            for (int r = 0; r < times; r++) {
                if (owner == t->index) {
                    process(t, buf + off, len, &t->rx_addr[i]);
                } else if (t->n_foreign < SA_MAX_FOREIGN) {
                    t->foreign[t->n_foreign++] = (struct foreign_dgram){buf + off, (uint32_t)len, (uint16_t)i, owner};
                } else {
                    t->misrouted++; /* cannot happen (64 per buffer at most); a loss if it did */
                }
            }
            off += step;
        } while (off < total);
    }
    flush_out(t);
    t->n_payloads = 0;
    pthread_mutex_unlock(&t->lock);
    for (int u = 0; u < a->nthreads && t->n_foreign; u++) { /* each owner once, in its own batch */
        if (u == t->index) continue;
        struct sa_agg_thread *o = &a->th[u];
        int locked = 0;
        for (size_t f = 0; f < t->n_foreign; f++) {
            if (t->foreign[f].owner != u) continue;
            if (!locked) {
                pthread_mutex_lock(&o->lock);
                locked = 1;
            }
            process(o, t->foreign[f].p, t->foreign[f].len, &t->rx_addr[t->foreign[f].msg]);
        }
        if (locked) {
            flush_out(o);
            o->n_payloads = 0;
            pthread_mutex_unlock(&o->lock);
        }
    }
}

/* One thread's loop on its socket until stop, halt, the deadline or the tick (thread 0 only). */
static int serve_loop(struct sa_agg_thread *t, uint64_t deadline_ns, int (*tick)(void *), void *ctx) {
    struct sa_agg *a = t->a;
    int rc = 0;
    uint64_t next_tick = sa_now_ns() + POLL_MS * 1000000ull;
    while (!atomic_load(&a->stop_requested) && !atomic_load(&a->halt)) {
        uint64_t now = sa_now_ns();
        if (now >= deadline_ns) break;
        if (tick != NULL && now >= next_tick) { /* e.g. let Ctrl-C interrupt a run() in Python's main thread */
            if (tick(ctx)) {
                rc = 1;
                break;
            }
            next_tick = now + POLL_MS * 1000000ull;
        }
        uint64_t wait_ms = POLL_MS, left_ms = (deadline_ns - now) / 1000000ull;
        if (left_ms < wait_ms) wait_ms = left_ms + 1;
        struct pollfd pfd = {.fd = t->fd, .events = POLLIN};
        int pr = poll(&pfd, 1, (int)wait_ms);
        if (pr < 0) {
            if (errno == EINTR) continue;
            rc = errno;
            break;
        }
        if (pr == 0) continue;
        for (int i = 0; i < SA_BATCH; i++) {
            memset(&t->rx_msgs[i].msg_hdr, 0, sizeof t->rx_msgs[i].msg_hdr);
            t->rx_msgs[i].msg_hdr.msg_name = &t->rx_addr[i];
            t->rx_msgs[i].msg_hdr.msg_namelen = sizeof t->rx_addr[i];
            t->rx_msgs[i].msg_hdr.msg_iov = &t->rx_iov[i];
            t->rx_msgs[i].msg_hdr.msg_iovlen = 1;
            if (t->gro) {
                t->rx_msgs[i].msg_hdr.msg_control = t->rx_ctrl[i];
                t->rx_msgs[i].msg_hdr.msg_controllen = sizeof t->rx_ctrl[i];
            }
        }
        int got = recvmmsg(t->fd, t->rx_msgs, SA_BATCH, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNREFUSED) continue;
            rc = errno;
            break;
        }
        serve_batch(t, got);
    }
    if (rc != 0) atomic_store(&a->halt, 1); /* one thread failed: the others end too */
    return rc;
}

static void *serve_thread(void *arg) {
    struct sa_agg_thread *t = arg;
    t->rc = serve_loop(t, UINT64_MAX, NULL, NULL);
    return NULL;
}

int sa_agg_serve(struct sa_agg *a, uint64_t deadline_ns, int (*tick)(void *), void *ctx) {
    if (a->th == NULL) return EBADF;
    int expected = 0;
    if (!atomic_compare_exchange_strong(&a->running, &expected, 1)) return -1;
    atomic_store(&a->halt, 0);
    /* The helper threads take no signals: they stay with the caller's threads (Python's main one). */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = 0, started = 1;
    for (; started < a->nthreads; started++) {
        a->th[started].rc = 0;
        int e = pthread_create(&a->th[started].tid, NULL, serve_thread, &a->th[started]);
        if (e != 0) {
            rc = e;
            break;
        }
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc == 0) rc = serve_loop(&a->th[0], deadline_ns, tick, ctx);
    atomic_store(&a->halt, 1);
    for (int i = 1; i < started; i++) {
        pthread_join(a->th[i].tid, NULL);
        if (rc == 0) rc = a->th[i].rc;
    }
    atomic_store(&a->stop_requested, 0);
    atomic_store(&a->halt, 0);
    atomic_store(&a->running, 0);
    return rc;
}

void sa_agg_stop(struct sa_agg *a) { atomic_store(&a->stop_requested, 1); }

void sa_agg_init(struct sa_agg *a) { memset(a, 0, sizeof *a); }

int sa_agg_close(struct sa_agg *a) {
    if (atomic_load(&a->running)) return -1;
    if (a->th != NULL) close_sockets(a);
    return SA_OK;
}

void sa_agg_free(struct sa_agg *a) {
    free_threads(a);
    if (a->jobs != NULL) {
        for (int i = 0; i < SA_NJOB_IDS; i++) job_free(a->jobs[i]);
        free(a->jobs);
        a->jobs = NULL;
    }
}
