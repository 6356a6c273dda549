/* switchagg._core.Aggregator: the software aggregator, the algorithm of docs/PROTOCOL.md in C.
 *
 * One UDP socket, served by run() with the GIL released: recvmmsg a batch, process it under the
 * state mutex (so add_job/remove_job/counters from other threads see whole batches), sendmmsg
 * the results. No allocation on the per-packet path.
 *
 * A job is aggregated either in one level (its ranks are workers, or leaves when this is a spine:
 * the code is the same) or as a leaf of a two-level job (docs/PROTOCOL.md, Two levels): it sums its
 * local ranks and sends the partial to its spine, and multicasts the spine's RESULT. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common.h"

#define BATCH 64                     /* datagrams per recvmmsg */
#define RX_BUF 65536                 /* > largest UDP payload, so nothing is cut */
#define OUT_MSGS 512                 /* queued results before a forced flush */
#define OUT_PAYLOADS 64              /* result payload buffers before a forced flush */
#define POLL_MS 50                   /* how soon stop() and signals are noticed */
#define NJOB_IDS 65536
#define NUM_SLOTS (SA_POOL_SLOT_MASK + 1)

enum { F_DROPPED_IN, F_DUPLICATED_IN, F_DROPPED_OUT, F_DUPLICATED_OUT, F_N };
static const char *const fault_names[F_N] = {"dropped_in", "duplicated_in", "dropped_out", "duplicated_out"};
/* Same order as enum sa_drop and protocol.DROP_REASONS. */
static const char *const drop_names[SA_DROP_NREASONS] = {"bad_version", "bad_type", "unknown_job", "bad_rank",
                                                         "spoofed",     "bad_pool", "truncated"};

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
    uint16_t leaf_index;             /* this leaf's rank at the spine */
    struct sockaddr_in upstream;     /* the spine; RESULTs are accepted only from it */
    uint64_t aggregated, multicast, resent, retrans_ignored;
    uint64_t upstream_sent, upstream_resent, stale_results; /* leaf only */
    /* Slot state; index i = local_slot * 2 + set. */
    uint16_t *slot_gen;              /* per local slot */
    uint32_t *bitmap;
    uint8_t *cnt;
    int8_t *exp;
    uint32_t *values;                /* count * 2 * k, host order, uint32 so that adds wrap */
    /* The round's identity, from its first contribution: every other one must match it. */
    uint32_t *rcall, *rtotal, *roffset;
    uint8_t *rflags;
    uint8_t *poison;                 /* SA_POISON_FLAGS the round got: its result carries no sum */
    /* Leaf only, per state index: the value is the spine's result. */
    uint8_t *final;
};

struct out_msg {
    struct sa_header head;
    const uint8_t *payload;
    size_t payload_len;
    struct sockaddr_in dst;
};

typedef struct {
    PyObject_HEAD int fd;
    int port;
    char host[INET_ADDRSTRLEN];
    double drop_in, dup_in, drop_out, dup_out;
    uint64_t rng;
    pthread_mutex_t lock;
    atomic_int stop_requested;
    atomic_int running;
    /* Protected by lock: */
    struct job **jobs;               /* by job id */
    uint64_t rx, tx, drops[SA_DROP_NREASONS], faults[F_N];
    /* Owned by the thread in run(): */
    uint8_t *rx_bufs;
    struct mmsghdr rx_msgs[BATCH];
    struct iovec rx_iov[BATCH];
    struct sockaddr_in rx_addr[BATCH];
    struct out_msg out[OUT_MSGS];
    size_t n_out;
    uint8_t *out_payloads;           /* OUT_PAYLOADS x RX_BUF */
    size_t n_payloads;
    struct mmsghdr tx_msgs[OUT_MSGS];
    struct iovec tx_iov[OUT_MSGS][2];
} Aggregator;

static void job_free(struct job *j) {
    if (j == NULL) return;
    free(j->slot_gen);
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
    free(j);
}

/* ---- the packet path (called with lock held) ---- */

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

static void flush_out(Aggregator *a) {
    size_t m = a->n_out;
    for (size_t i = 0; i < m; i++) {
        struct out_msg *o = &a->out[i];
        a->tx_iov[i][0].iov_base = &o->head;
        a->tx_iov[i][0].iov_len = sizeof o->head;
        a->tx_iov[i][1].iov_base = (void *)o->payload;
        a->tx_iov[i][1].iov_len = o->payload_len;
        memset(&a->tx_msgs[i], 0, sizeof a->tx_msgs[i]);
        a->tx_msgs[i].msg_hdr.msg_name = &o->dst;
        a->tx_msgs[i].msg_hdr.msg_namelen = sizeof o->dst;
        a->tx_msgs[i].msg_hdr.msg_iov = a->tx_iov[i];
        a->tx_msgs[i].msg_hdr.msg_iovlen = 2;
    }
    size_t done = 0;
    /* Bounded: every iteration either sends >= 1 datagram or skips one that failed. */
    while (done < m) {
        int r = sendmmsg(a->fd, &a->tx_msgs[done], (unsigned)(m - done), 0);
        if (r > 0) {
            a->tx += (uint64_t)r;
            done += (size_t)r;
        } else if (r < 0 && errno == EINTR) {
            continue;
        } else {
            done++; /* e.g. ECONNREFUSED from an earlier ICMP error: UDP loses this one */
        }
    }
    a->n_out = 0;
}

/* Payload buffers are reused only after a flush, so no queued message points at a reused one. */
static uint8_t *take_payload(Aggregator *a) {
    if (a->n_payloads == OUT_PAYLOADS) {
        flush_out(a);
        a->n_payloads = 0;
    }
    return a->out_payloads + (a->n_payloads++) * RX_BUF;
}

static void queue_msg(Aggregator *a, const struct sa_header *h, uint8_t type, uint16_t rank, int8_t exp,
                      const uint8_t *payload, size_t len, const struct sockaddr_in *dst) {
    int copies = 1;
    if (a->drop_out > 0 && sa_rand01(&a->rng) < a->drop_out) {
        a->faults[F_DROPPED_OUT]++;
        return;
    }
    if (a->dup_out > 0 && sa_rand01(&a->rng) < a->dup_out) {
        a->faults[F_DUPLICATED_OUT]++;
        copies = 2;
    }
    for (int c = 0; c < copies; c++) {
        if (a->n_out == OUT_MSGS) flush_out(a); /* keeps the payload buffers: more copies may follow */
        struct out_msg *o = &a->out[a->n_out++];
        o->head = *h;
        o->head.type = type;
        o->head.rank = htons(rank);
        o->head.exp = exp;
        o->payload = payload;
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
        .key = htonl(j->key),
    };
    return r;
}

/* Result payload of state index si, converted to network order in a fresh output buffer. */
static const uint8_t *encode_result(Aggregator *a, const struct job *j, size_t si) {
    uint8_t *buf = take_payload(a);
    k_load((uint32_t *)buf, j->values + si * j->k, j->k); /* a byte swap is its own inverse */
    return buf;
}

static int same_addr(const struct sockaddr_in *x, const struct sockaddr_in *y) {
    return x->sin_addr.s_addr == y->sin_addr.s_addr && x->sin_port == y->sin_port;
}

/* RESULT(value[si]) to rank r alone. */
static void unicast(Aggregator *a, const struct job *j, uint32_t pool, size_t si, uint32_t r) {
    struct sa_header rh = round_header(j, pool, si);
    queue_msg(a, &rh, SA_MSG_RESULT, (uint16_t)r, rh.exp, encode_result(a, j, si), 4 * (size_t)j->k, &j->addrs[r]);
}

/* RESULT(value[si]) to every rank with an address here. */
static void multicast(Aggregator *a, struct job *j, uint32_t pool, size_t si) {
    struct sa_header rh = round_header(j, pool, si);
    const uint8_t *out = encode_result(a, j, si);
    for (uint32_t q = 0; q < j->n; q++) {
        if (j->local_mask >> q & 1)
            queue_msg(a, &rh, SA_MSG_RESULT, (uint16_t)q, rh.exp, out, 4 * (size_t)j->k, &j->addrs[q]);
    }
    j->multicast++;
}

/* A leaf's partial of state index si to the spine: a worker's DATA with rank = the leaf index. */
static void send_partial(Aggregator *a, const struct job *j, uint32_t slot, uint32_t s, size_t si) {
    struct sa_header up = round_header(j, slot | (s ? SA_POOL_SET_BIT : 0), si);
    up.key = 0; /* a DATA carries no key */
    const uint8_t *out = encode_result(a, j, si);
    queue_msg(a, &up, SA_MSG_DATA, j->leaf_index, j->exp[si], out, 4 * (size_t)j->k, &j->upstream);
}

/* The slot a packet of job j addresses (its index in the job and its shadow set), or 0 with the
 * drop counted when the slot is not the job's or the payload is not exactly K values. */
static int job_slot(Aggregator *a, const struct job *j, const struct sa_header *h, size_t len,
                    uint32_t *local, uint32_t *s) {
    uint32_t pool = ntohs(h->pool);
    uint32_t slot = pool & SA_POOL_SLOT_MASK;
    if (slot < j->base || slot >= j->base + j->count) {
        a->drops[SA_DROP_BAD_POOL]++;
        return 0;
    }
    if (len != SA_HEADER_LEN + 4 * (size_t)j->k || ntohs(h->elems) != j->k) {
        a->drops[SA_DROP_TRUNCATED]++;
        return 0;
    }
    *local = slot - j->base;
    *s = pool >> 15;
    return 1;
}

/* A RESULT: only a leaf takes one, only from its spine, and only as the answer to its partial. */
static void process_result(Aggregator *a, const uint8_t *buf, size_t len, const struct sockaddr_in *src) {
    const struct sa_header *h = (const struct sa_header *)buf;
    struct job *j = a->jobs[ntohs(h->job)];
    if (j == NULL || !j->leaf) { /* what a worker sent by mistake, as in one level */
        a->drops[SA_DROP_BAD_TYPE]++;
        return;
    }
    if (ntohs(h->rank) != j->leaf_index) {
        a->drops[SA_DROP_BAD_RANK]++;
        return;
    }
    if (!same_addr(&j->upstream, src)) {
        a->drops[SA_DROP_SPOOFED]++;
        return;
    }
    uint32_t local, s;
    if (!job_slot(a, j, h, len, &local, &s)) return;
    size_t si = 2 * (size_t)local + s;
    /* A slot of an earlier installation (gen differs) sent no partial of this one: stale too. The
     * spine's result carries the partial's identity, and its poison if any round below had one. */
    if (j->slot_gen[local] != j->gen || j->cnt[si] != j->m || j->final[si] || ntohl(h->key) != j->key ||
        ntohl(h->offset) != j->roffset[si] || ntohl(h->call) != j->rcall[si] ||
        ntohl(h->total) != j->rtotal[si] || (h->flags & SA_IDENTITY_FLAGS) != (j->rflags[si] & SA_IDENTITY_FLAGS)) {
        j->stale_results++;
        return;
    }
    k_load(j->values + si * j->k, (const uint32_t *)(buf + SA_HEADER_LEN), j->k);
    j->exp[si] = h->exp;
    j->poison[si] = h->flags & SA_POISON_FLAGS;
    j->final[si] = 1;
    multicast(a, j, ntohs(h->pool), si);
}

static void process(Aggregator *a, const uint8_t *buf, size_t len, const struct sockaddr_in *src) {
    if (len < SA_HEADER_LEN) {
        a->drops[SA_DROP_TRUNCATED]++;
        return;
    }
    const struct sa_header *h = (const struct sa_header *)buf;
    if (h->version != SA_VERSION) {
        a->drops[SA_DROP_BAD_VERSION]++;
        return;
    }
    if (h->type == SA_MSG_RESULT) {
        process_result(a, buf, len, src);
        return;
    }
    if (h->type != SA_MSG_DATA) {
        a->drops[SA_DROP_BAD_TYPE]++;
        return;
    }
    struct job *j = a->jobs[ntohs(h->job)];
    if (j == NULL) {
        a->drops[SA_DROP_UNKNOWN_JOB]++;
        return;
    }
    uint32_t r = ntohs(h->rank);
    if (r >= j->n) {
        a->drops[SA_DROP_BAD_RANK]++;
        return;
    }
    if (!(j->local_mask >> r & 1) || !same_addr(&j->addrs[r], src)) { /* a rank behind another leaf */
        a->drops[SA_DROP_SPOOFED]++;
        return;
    }
    uint32_t local, s;
    if (!job_slot(a, j, h, len, &local, &s)) return;
    const uint32_t k = j->k;
    uint32_t bit = 1u << r;

    if (j->slot_gen[local] != j->gen) { /* first packet into this slot for this installation */
        j->slot_gen[local] = j->gen;
        j->bitmap[2 * local] = j->bitmap[2 * local + 1] = 0;
        j->cnt[2 * local] = j->cnt[2 * local + 1] = 0;
        if (j->leaf) j->final[2 * local] = j->final[2 * local + 1] = 0;
    }
    size_t si = 2 * (size_t)local + s, so = 2 * (size_t)local + (1 - s);
    const uint32_t *p = (const uint32_t *)(buf + SA_HEADER_LEN);
    uint32_t *v = j->values + si * k;
    if ((j->bitmap[si] & bit) == 0) {
        int first = j->bitmap[si] == 0;
        j->bitmap[si] |= bit;
        j->bitmap[so] &= ~bit;
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
                k_add(v, p, k);
            }
            j->poison[si] |= poison;
            if (h->exp > j->exp[si]) j->exp[si] = h->exp;
            j->cnt[si]++;
        }
        j->aggregated++;
        if (j->cnt[si] == j->m) {
            if (j->leaf) {
                send_partial(a, j, j->base + local, s, si);
                j->upstream_sent++;
            } else {
                multicast(a, j, ntohs(h->pool), si);
            }
        }
    } else if (j->leaf && j->final[si]) {
        unicast(a, j, ntohs(h->pool), si, r);
        j->resent++;
    } else if (j->cnt[si] == j->m) {
        if (j->leaf && r != j->first_local) {
            j->retrans_ignored++; /* the m workers resend alike: re-send up once per loss, not m times */
        } else if (j->leaf) {     /* still waiting for the spine: the partial or its result was lost */
            send_partial(a, j, j->base + local, s, si);
            j->upstream_resent++;
        } else {
            unicast(a, j, ntohs(h->pool), si, r);
            j->resent++;
        }
    } else {
        j->retrans_ignored++;
    }
}

/* ---- Python type ---- */

static int Aggregator_init(Aggregator *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"host", "port", "drop_in", "dup_in", "drop_out", "dup_out", "seed", NULL};
    const char *host = "127.0.0.1";
    int port = 0;
    unsigned long long seed = 1;
    double drop_in = 0, dup_in = 0, drop_out = 0, dup_out = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|siddddK", kwlist, &host, &port, &drop_in, &dup_in, &drop_out,
                                     &dup_out, &seed))
        return -1;
    if (self->fd >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "Aggregator is already initialised");
        return -1;
    }
    const double probs[4] = {drop_in, dup_in, drop_out, dup_out};
    const char *pnames[4] = {"drop_in", "dup_in", "drop_out", "dup_out"};
    for (int i = 0; i < 4; i++) {
        if (!(probs[i] >= 0.0 && probs[i] <= 1.0)) {
            char num[64];
            snprintf(num, sizeof num, "%g", probs[i]);
            PyErr_Format(PyExc_ValueError, "%s must be a probability in [0, 1], got %s", pnames[i], num);
            return -1;
        }
    }
    if (port < 0 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "port must be in 0..65535, got %d", port);
        return -1;
    }
    struct sockaddr_in sa;
    memset(&sa, 0, sizeof sa);
    sa.sin_family = AF_INET;
    sa.sin_port = htons((uint16_t)port);
    if (inet_pton(AF_INET, host, &sa.sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "host must be an IPv4 address such as 127.0.0.1, got '%s'", host);
        return -1;
    }
    /* Kept if an earlier __init__ failed after allocating. */
    if (self->jobs == NULL) self->jobs = calloc(NJOB_IDS, sizeof *self->jobs);
    if (self->rx_bufs == NULL) self->rx_bufs = malloc((size_t)BATCH * RX_BUF);
    if (self->out_payloads == NULL) self->out_payloads = malloc((size_t)OUT_PAYLOADS * RX_BUF);
    if (self->jobs == NULL || self->rx_bufs == NULL || self->out_payloads == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    sa_set_sockbuf(fd, 64 << 20);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        int err = errno;
        close(fd);
        errno = err;
        PyErr_Format(PyExc_OSError, "cannot bind the aggregator to %s:%d: %s", host, port, strerror(err));
        return -1;
    }
    socklen_t sl = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    self->fd = fd;
    self->port = ntohs(sa.sin_port);
    snprintf(self->host, sizeof self->host, "%s", host);
    self->drop_in = drop_in;
    self->dup_in = dup_in;
    self->drop_out = drop_out;
    self->dup_out = dup_out;
    /* splitmix the seed so that small seeds give unrelated streams; xorshift needs non-zero state */
    uint64_t z = (uint64_t)seed + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    self->rng = (z ^ (z >> 31)) | 1;
    for (int i = 0; i < BATCH; i++) {
        self->rx_iov[i].iov_base = self->rx_bufs + (size_t)i * RX_BUF;
        self->rx_iov[i].iov_len = RX_BUF;
    }
    return 0;
}

static PyObject *Aggregator_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Aggregator *self = (Aggregator *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->fd = -1;
    pthread_mutex_init(&self->lock, NULL);
    return (PyObject *)self;
}

static void Aggregator_dealloc(Aggregator *self) {
    if (self->fd >= 0) close(self->fd);
    if (self->jobs != NULL) {
        for (int i = 0; i < NJOB_IDS; i++) job_free(self->jobs[i]);
        free(self->jobs);
    }
    free(self->rx_bufs);
    free(self->out_payloads);
    pthread_mutex_destroy(&self->lock);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_open(Aggregator *self) {
    if (self->fd < 0) {
        PyErr_SetString(PyExc_RuntimeError, "Aggregator is closed or was not initialised");
        return -1;
    }
    return 0;
}

/* One (ip, port) tuple; `what` names it in errors. */
static int parse_addr(PyObject *item, const char *what, struct sockaddr_in *out) {
    const char *ip;
    int port;
    if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "si", &ip, &port)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be an (ip: str, port: int) tuple, got %R", what, item);
        return -1;
    }
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    if (port < 1 || port > 65535 || inet_pton(AF_INET, ip, &out->sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "%s = %R is not an IPv4 address with a port in 1..65535", what, item);
        return -1;
    }
    out->sin_port = htons((uint16_t)port);
    if (out->sin_addr.s_addr == htonl(INADDR_ANY)) {
        PyErr_Format(PyExc_ValueError, "%s = %R: 0.0.0.0 is no source address; name the one it sends from", what,
                     item);
        return -1;
    }
    return 0;
}

/* addrs[r] = rank r's address; on a leaf (allow_none) None marks a rank behind another leaf. */
static int parse_addrs(PyObject *addrs, uint32_t n, int allow_none, struct sockaddr_in *out, uint32_t *mask) {
    PyObject *seq = PySequence_Fast(addrs, "addrs must be a list of (ip, port) tuples, one per rank");
    if (seq == NULL) return -1;
    if ((uint32_t)PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "addrs must name one (ip, port) per rank: %u expected, got %zd", n,
                     PySequence_Fast_GET_SIZE(seq));
        Py_DECREF(seq);
        return -1;
    }
    *mask = 0;
    for (uint32_t r = 0; r < n; r++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, r);
        memset(&out[r], 0, sizeof out[r]);
        if (item == Py_None && allow_none) continue;
        char what[32];
        snprintf(what, sizeof what, "addrs[%u]", r);
        if (parse_addr(item, what, &out[r]) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        for (uint32_t q = 0; q < r; q++) {
            if ((*mask >> q & 1) && same_addr(&out[q], &out[r])) { /* one socket, two ranks */
                PyErr_Format(PyExc_ValueError, "addrs[%u] and addrs[%u] are the same address %R", q, r, item);
                Py_DECREF(seq);
                return -1;
            }
        }
        *mask |= 1u << r;
    }
    if (*mask == 0) {
        PyErr_SetString(PyExc_ValueError, "addrs names no rank: a leaf needs at least one local rank");
        Py_DECREF(seq);
        return -1;
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *Aggregator_add_job(Aggregator *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"job_id", "n", "slot_base", "slot_count", "k", "generation", "addrs",
                             "upstream", "leaf_index", "key", NULL};
    long long job_id, n, base, count, k, gen, leaf_index = 0, key = 0;
    PyObject *addrs, *upstream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLLLLO|OLL", kwlist, &job_id, &n, &base, &count, &k, &gen,
                                     &addrs, &upstream, &leaf_index, &key))
        return NULL;
    if (check_open(self) < 0) return NULL;
    if (job_id < 0 || job_id >= NJOB_IDS)
        return PyErr_Format(PyExc_ValueError, "job_id must be in 0..65535, got %lld", job_id);
    if (n < 1 || n > SA_MAX_WORKERS)
        return PyErr_Format(PyExc_ValueError, "n (workers) must be in 1..%d, got %lld", SA_MAX_WORKERS, n);
    if (k < 1 || k > SA_MAX_K)
        return PyErr_Format(PyExc_ValueError, "k must be in 1..%d, got %lld", SA_MAX_K, k);
    if (count < 1 || base < 0 || base + count > NUM_SLOTS)
        return PyErr_Format(PyExc_ValueError,
                            "slot range [%lld, %lld) must be non-empty and inside the pool 0..%d", base,
                            base + count, NUM_SLOTS - 1);
    if (gen < 1 || gen > 65535)
        return PyErr_Format(PyExc_ValueError,
                            "generation must be in 1..65535 (0 means never installed), got %lld", gen);
    if (leaf_index < 0 || leaf_index >= SA_MAX_WORKERS)
        return PyErr_Format(PyExc_ValueError, "leaf_index (the leaf's rank at the spine) must be in 0..%d, got %lld",
                            SA_MAX_WORKERS - 1, leaf_index);
    if (key < 0 || key > 0xFFFFFFFFll)
        return PyErr_Format(PyExc_ValueError, "key must be a 32-bit unsigned number, got %lld", key);
    if (upstream == Py_None && leaf_index != 0)
        return PyErr_Format(PyExc_ValueError, "leaf_index is %lld but no upstream is given", leaf_index);
    struct job *j = calloc(1, sizeof *j);
    if (j == NULL) return PyErr_NoMemory();
    j->id = (uint16_t)job_id;
    j->gen = (uint16_t)gen;
    j->n = (uint32_t)n;
    j->base = (uint32_t)base;
    j->count = (uint32_t)count;
    j->k = (uint32_t)k;
    j->key = (uint32_t)key;
    j->leaf = upstream != Py_None;
    j->leaf_index = (uint16_t)leaf_index;
    if ((j->leaf && parse_addr(upstream, "upstream", &j->upstream) < 0) ||
        parse_addrs(addrs, j->n, j->leaf, j->addrs, &j->local_mask) < 0) {
        job_free(j);
        return NULL;
    }
    j->m = (uint32_t)__builtin_popcount(j->local_mask);
    j->first_local = (uint32_t)__builtin_ctz(j->local_mask);
    if (j->leaf && (j->final = calloc(2 * (size_t)count, sizeof *j->final)) == NULL) {
        job_free(j);
        return PyErr_NoMemory();
    }
    /* calloc: zero state, slot_gen 0 never equals a valid generation */
    j->slot_gen = calloc((size_t)count, sizeof *j->slot_gen);
    j->bitmap = calloc(2 * (size_t)count, sizeof *j->bitmap);
    j->cnt = calloc(2 * (size_t)count, sizeof *j->cnt);
    j->exp = calloc(2 * (size_t)count, sizeof *j->exp);
    j->values = calloc(2 * (size_t)count * (size_t)k, sizeof *j->values);
    j->rcall = calloc(2 * (size_t)count, sizeof *j->rcall);
    j->rtotal = calloc(2 * (size_t)count, sizeof *j->rtotal);
    j->roffset = calloc(2 * (size_t)count, sizeof *j->roffset);
    j->rflags = calloc(2 * (size_t)count, sizeof *j->rflags);
    j->poison = calloc(2 * (size_t)count, sizeof *j->poison);
    if (!j->slot_gen || !j->bitmap || !j->cnt || !j->exp || !j->values || !j->rcall || !j->rtotal ||
        !j->roffset || !j->rflags || !j->poison) {
        job_free(j);
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&self->lock);
    const char *err = NULL;
    struct job *other = NULL;
    if (self->jobs[job_id] != NULL) {
        err = "in use";
        other = self->jobs[job_id];
    } else {
        for (int i = 0; i < NJOB_IDS && other == NULL; i++) {
            struct job *o = self->jobs[i];
            if (o != NULL && j->base < o->base + o->count && o->base < j->base + j->count) other = o;
        }
        if (other != NULL) err = "overlap";
    }
    if (err == NULL) self->jobs[job_id] = j;
    uint32_t ob = other ? other->base : 0, oc = other ? other->count : 0, oid = other ? other->id : 0;
    pthread_mutex_unlock(&self->lock);
    if (err != NULL) {
        job_free(j);
        if (err[0] == 'i') return PyErr_Format(PyExc_ValueError, "job id %lld is already installed", job_id);
        return PyErr_Format(PyExc_ValueError,
                            "slots [%lld, %lld) of job %lld overlap slots [%u, %u) of job %u", base,
                            base + count, job_id, ob, ob + oc, oid);
    }
    Py_RETURN_NONE;
}

static PyObject *Aggregator_remove_job(Aggregator *self, PyObject *args) {
    long long job_id;
    if (!PyArg_ParseTuple(args, "L", &job_id)) return NULL;
    if (check_open(self) < 0) return NULL;
    struct job *j = NULL;
    if (job_id >= 0 && job_id < NJOB_IDS) {
        pthread_mutex_lock(&self->lock);
        j = self->jobs[job_id];
        self->jobs[job_id] = NULL;
        pthread_mutex_unlock(&self->lock);
    }
    if (j == NULL) return PyErr_Format(PyExc_ValueError, "job %lld is not installed", job_id);
    job_free(j);
    Py_RETURN_NONE;
}

static int set_u64(PyObject *d, const char *key, uint64_t v) {
    PyObject *o = PyLong_FromUnsignedLongLong(v);
    if (o == NULL) return -1;
    int r = PyDict_SetItemString(d, key, o);
    Py_DECREF(o);
    return r;
}

struct job_snapshot {
    uint16_t id;
    int leaf;
    uint64_t c[7];
};

static PyObject *Aggregator_counters(Aggregator *self, PyObject *unused) {
    if (check_open(self) < 0) return NULL;
    uint64_t rx, tx, drops[SA_DROP_NREASONS], faults[F_N];
    size_t njobs = 0;
    /* Snapshot under the lock, build Python objects after releasing it. */
    struct job_snapshot *snap = NULL;
    pthread_mutex_lock(&self->lock);
    for (int i = 0; i < NJOB_IDS; i++) njobs += self->jobs[i] != NULL;
    snap = malloc((njobs ? njobs : 1) * sizeof *snap);
    if (snap != NULL) {
        size_t w = 0;
        for (int i = 0; i < NJOB_IDS; i++) {
            struct job *j = self->jobs[i];
            if (j == NULL) continue;
            snap[w].id = j->id;
            snap[w].c[0] = j->aggregated;
            snap[w].c[1] = j->multicast;
            snap[w].c[2] = j->resent;
            snap[w].c[3] = j->retrans_ignored;
            snap[w].c[4] = j->upstream_sent;
            snap[w].c[5] = j->upstream_resent;
            snap[w].c[6] = j->stale_results;
            snap[w].leaf = j->leaf;
            w++;
        }
    }
    rx = self->rx;
    tx = self->tx;
    memcpy(drops, self->drops, sizeof drops);
    memcpy(faults, self->faults, sizeof faults);
    pthread_mutex_unlock(&self->lock);
    if (snap == NULL) return PyErr_NoMemory();

    /* protocol.JOB_COUNTERS, then protocol.LEAF_COUNTERS for a leaf's job */
    static const char *const job_names[7] = {"aggregated", "multicast", "resent", "retrans_ignored",
                                             "upstream",   "upstream_resent", "stale_results"};
    PyObject *res = PyDict_New(), *d = PyDict_New(), *f = PyDict_New(), *js = PyDict_New();
    if (!res || !d || !f || !js) goto fail;
    if (set_u64(res, "rx", rx) < 0 || set_u64(res, "tx", tx) < 0) goto fail;
    for (int i = 0; i < SA_DROP_NREASONS; i++)
        if (set_u64(d, drop_names[i], drops[i]) < 0) goto fail;
    for (int i = 0; i < F_N; i++)
        if (set_u64(f, fault_names[i], faults[i]) < 0) goto fail;
    for (size_t w = 0; w < njobs; w++) {
        PyObject *jd = PyDict_New(), *key = PyLong_FromLong(snap[w].id);
        int bad = jd == NULL || key == NULL;
        for (int c = 0; c < (snap[w].leaf ? 7 : 4) && !bad; c++) bad = set_u64(jd, job_names[c], snap[w].c[c]) < 0;
        if (!bad) bad = PyDict_SetItem(js, key, jd) < 0;
        Py_XDECREF(jd);
        Py_XDECREF(key);
        if (bad) goto fail;
    }
    if (PyDict_SetItemString(res, "drops", d) < 0 || PyDict_SetItemString(res, "faults", f) < 0 ||
        PyDict_SetItemString(res, "jobs", js) < 0)
        goto fail;
    Py_DECREF(d);
    Py_DECREF(f);
    Py_DECREF(js);
    free(snap);
    return res;
fail:
    Py_XDECREF(res);
    Py_XDECREF(d);
    Py_XDECREF(f);
    Py_XDECREF(js);
    free(snap);
    return NULL;
}

/* Serve one received batch: fault injection in, the algorithm, then send what it produced. */
static void serve_batch(Aggregator *a, int got) {
    pthread_mutex_lock(&a->lock);
    for (int i = 0; i < got; i++) {
        a->rx++;
        int times = 1;
        if (a->drop_in > 0 && sa_rand01(&a->rng) < a->drop_in) {
            a->faults[F_DROPPED_IN]++;
            continue;
        }
        if (a->dup_in > 0 && sa_rand01(&a->rng) < a->dup_in) {
            a->faults[F_DUPLICATED_IN]++;
            times = 2;
        }
        for (int t = 0; t < times; t++)
            process(a, a->rx_iov[i].iov_base, a->rx_msgs[i].msg_len, &a->rx_addr[i]);
    }
    flush_out(a);
    a->n_payloads = 0;
    pthread_mutex_unlock(&a->lock);
}

static PyObject *Aggregator_run(Aggregator *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &timeout_obj)) return NULL;
    if (check_open(self) < 0) return NULL;
    uint64_t deadline = UINT64_MAX;
    if (timeout_obj != Py_None) {
        double t = PyFloat_AsDouble(timeout_obj);
        if (t == -1.0 && PyErr_Occurred()) return NULL;
        if (!(t >= 0))
            return PyErr_Format(PyExc_ValueError, "timeout must be None or >= 0, got %R", timeout_obj);
        if (t < 1e9) deadline = sa_now_ns() + (uint64_t)(t * 1e9); /* longer: as good as forever */
    }
    int expected = 0;
    if (!atomic_compare_exchange_strong(&self->running, &expected, 1)) {
        PyErr_SetString(PyExc_RuntimeError, "run() is already serving in another thread");
        return NULL;
    }
    Py_INCREF(self); /* the object must outlive the GIL-free loop */
    int failed_errno = 0, signalled = 0;
    uint64_t next_signal_check = sa_now_ns() + POLL_MS * 1000000ull;
    PyThreadState *ts = PyEval_SaveThread();
    while (!atomic_load(&self->stop_requested)) {
        uint64_t now = sa_now_ns();
        if (now >= deadline) break;
        if (now >= next_signal_check) { /* let Ctrl-C interrupt a run() in the main thread */
            PyEval_RestoreThread(ts);
            signalled = PyErr_CheckSignals() < 0;
            ts = PyEval_SaveThread();
            if (signalled) break;
            next_signal_check = now + POLL_MS * 1000000ull;
        }
        uint64_t wait_ms = POLL_MS, left_ms = (deadline - now) / 1000000ull;
        if (left_ms < wait_ms) wait_ms = left_ms + 1;
        struct pollfd pfd = {.fd = self->fd, .events = POLLIN};
        int pr = poll(&pfd, 1, (int)wait_ms);
        if (pr < 0) {
            if (errno == EINTR) continue;
            failed_errno = errno;
            break;
        }
        if (pr == 0) continue;
        for (int i = 0; i < BATCH; i++) {
            memset(&self->rx_msgs[i].msg_hdr, 0, sizeof self->rx_msgs[i].msg_hdr);
            self->rx_msgs[i].msg_hdr.msg_name = &self->rx_addr[i];
            self->rx_msgs[i].msg_hdr.msg_namelen = sizeof self->rx_addr[i];
            self->rx_msgs[i].msg_hdr.msg_iov = &self->rx_iov[i];
            self->rx_msgs[i].msg_hdr.msg_iovlen = 1;
        }
        int got = recvmmsg(self->fd, self->rx_msgs, BATCH, MSG_DONTWAIT, NULL);
        if (got < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR || errno == ECONNREFUSED) continue;
            failed_errno = errno;
            break;
        }
        serve_batch(self, got);
    }
    PyEval_RestoreThread(ts);
    atomic_store(&self->stop_requested, 0);
    atomic_store(&self->running, 0);
    Py_DECREF(self);
    if (signalled) return NULL;
    if (failed_errno) {
        errno = failed_errno;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *Aggregator_stop(Aggregator *self, PyObject *unused) {
    atomic_store(&self->stop_requested, 1);
    Py_RETURN_NONE;
}

static PyObject *Aggregator_close(Aggregator *self, PyObject *unused) {
    if (atomic_load(&self->running)) {
        PyErr_SetString(PyExc_RuntimeError,
                        "stop() the aggregator and wait for run() to return before close()");
        return NULL;
    }
    if (self->fd >= 0) close(self->fd);
    self->fd = -1;
    Py_RETURN_NONE;
}

static PyObject *Aggregator_get_port(Aggregator *self, void *closure) { return PyLong_FromLong(self->port); }
static PyObject *Aggregator_get_host(Aggregator *self, void *closure) {
    return PyUnicode_FromString(self->host);
}
static PyObject *Aggregator_get_running(Aggregator *self, void *closure) {
    return PyBool_FromLong(atomic_load(&self->running));
}

static PyMethodDef Aggregator_methods[] = {
    {"add_job", (PyCFunction)(void (*)(void))Aggregator_add_job, METH_VARARGS | METH_KEYWORDS,
     "add_job(job_id, n, slot_base, slot_count, k, generation, addrs, upstream=None, leaf_index=0, key=0): "
     "install a job; addrs[r] = (ip, port) of rank r; key: the 32-bit result key every RESULT carries. With "
     "upstream = the spine's (ip, port) the job is aggregated here as leaf leaf_index: addrs[r] is None for "
     "ranks behind other leaves."},
    {"remove_job", (PyCFunction)Aggregator_remove_job, METH_VARARGS, "remove_job(job_id): uninstall a job."},
    {"counters", (PyCFunction)Aggregator_counters, METH_NOARGS, "Counters as a dict (see docs/PROTOCOL.md)."},
    {"run", (PyCFunction)(void (*)(void))Aggregator_run, METH_VARARGS | METH_KEYWORDS,
     "run(timeout=None): serve until stop() or the timeout, GIL released."},
    {"stop", (PyCFunction)Aggregator_stop, METH_NOARGS, "Ask run() to return (within ~50 ms)."},
    {"close", (PyCFunction)Aggregator_close, METH_NOARGS, "Close the socket."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Aggregator_getset[] = {
    {"port", (getter)Aggregator_get_port, NULL, "The bound UDP port.", NULL},
    {"host", (getter)Aggregator_get_host, NULL, "The bound IPv4 address.", NULL},
    {"running", (getter)Aggregator_get_running, NULL, "Whether run() is serving.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject AggregatorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "switchagg._core.Aggregator",
    .tp_basicsize = sizeof(Aggregator),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Aggregator(host='127.0.0.1', port=0, drop_in=0.0, dup_in=0.0, drop_out=0.0, dup_out=0.0, "
              "seed=1)\n"
              "The software aggregator of docs/PROTOCOL.md on one UDP socket.",
    .tp_new = Aggregator_new,
    .tp_init = (initproc)Aggregator_init,
    .tp_dealloc = (destructor)Aggregator_dealloc,
    .tp_methods = Aggregator_methods,
    .tp_getset = Aggregator_getset,
};

int sa_aggregator_register(PyObject *module) {
    if (PyType_Ready(&AggregatorType) < 0) return -1;
    Py_INCREF(&AggregatorType);
    if (PyModule_AddObject(module, "Aggregator", (PyObject *)&AggregatorType) < 0) {
        Py_DECREF(&AggregatorType);
        return -1;
    }
    return 0;
}
