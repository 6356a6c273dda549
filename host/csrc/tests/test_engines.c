/* The C engines alone, through their plain C interfaces (aggregator.h, worker.h, quant.h): no
 * Python. tests/test_c_engines.py compiles this with the engines' sources and runs it.
 *
 * Real UDP sockets on 127.0.0.1: an aggregator served by two threads, three workers in threads of
 * their own, int32 sums checked exactly and float32 within the documented bound; malformed datagrams
 * from a plain socket, counted by reason; the error codes of the interfaces. Exit 0 when every
 * check holds; each failed check prints its line and the run ends with status 1. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "aggregator.h"
#include "clock.h"
#include "errmsg.h"
#include "protocol.h"
#include "quant.h"
#include "worker.h"

static int failures, checks;

#define CHECK(cond, ...)                                                                                     \
    do {                                                                                                     \
        checks++;                                                                                            \
        if (!(cond)) {                                                                                       \
            failures++;                                                                                      \
            fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);                                  \
            fprintf(stderr, __VA_ARGS__);                                                                    \
            fputc('\n', stderr);                                                                             \
        }                                                                                                    \
    } while (0)

#define WAIT_NS (30ull * 1000000000ull) /* only guards against a hang */

/* ---- quant ---- */

static void test_quant(void) {
    const float a[] = {0.5f, -3.0f, 1.0f};
    CHECK(sa_block_exponent(a, 3) == 2, "max |x| = 3 needs 2^2, got %d", sa_block_exponent(a, 3));
    const float zero[4] = {0};
    CHECK(sa_block_exponent(zero, 4) == SA_EXP_NONE, "an all-zero block has no exponent");
    const float bad[] = {1.0f, NAN};
    CHECK(sa_block_exponent(bad, 2) == SA_EXP_NONFINITE, "NaN makes the block non-finite");
    const float huge[] = {3.0e38f};
    CHECK(sa_block_exponent(huge, 1) == SA_EXP_TOP, "3e38 is quantized on the top scale");

    /* One worker of n = 4: quantize then dequantize is within the bound n * 2^(E - 22). */
    enum { K = 1000, LEN = 997 };
    float x[K], y[K];
    uint32_t q[K];
    for (int i = 0; i < LEN; i++) x[i] = (float)sin(i * 0.37) * 5.0f;
    int e = sa_block_exponent(x, LEN);
    sa_quantize_be(x, LEN, K, e, 4, q);
    for (int i = LEN; i < K; i++) CHECK(q[i] == 0, "padding element %d is %u, not 0", i, q[i]);
    sa_dequantize_be(q, LEN, e, 4, y);
    double bound = 4.0 * ldexp(1.0, e - 22), worst = 0;
    for (int i = 0; i < LEN; i++) worst = fmax(worst, fabs((double)y[i] - (double)x[i]));
    CHECK(worst <= bound, "round trip off by %g > bound %g", worst, bound);

    int32_t ints[5] = {1, -2, 2147483647, -2147483647 - 1, 0x01020304}, back[5];
    uint32_t be[8];
    sa_int_to_be(ints, 5, 8, be);
    CHECK(be[0] == htonl(1) && be[4] == htonl(0x01020304) && be[5] == 0 && be[7] == 0, "int32 to big-endian");
    sa_be_to_int(be, 5, back);
    CHECK(memcmp(ints, back, sizeof ints) == 0, "big-endian back to int32");
}

/* ---- the engines' error codes ---- */

static void test_error_codes(void) {
    char err[256] = "";
    const double none[4] = {0, 0, 0, 0}, bad[4] = {0, 1.5, 0, 0};
    struct sa_agg a, b;
    sa_agg_init(&a);
    CHECK(sa_agg_open(&a, "127.0.0.1", 0, 1, bad, 1, err, sizeof err) == SA_ERR_ARG, "a bad probability");
    CHECK(strstr(err, "dup_in must be a probability") != NULL, "says which: %s", err);
    CHECK(sa_agg_open(&a, "localhost", 0, 1, none, 1, err, sizeof err) == SA_ERR_ARG, "a host name");
    CHECK(sa_agg_open(&a, "127.0.0.1", 0, 0, none, 1, err, sizeof err) == SA_ERR_ARG, "zero threads");
    CHECK(sa_agg_open(&a, "127.0.0.1", 0, 2, none, 1, err, sizeof err) == SA_OK, "open: %s", err);
    struct sa_job_spec spec = {.id = 1, .gen = 1, .n = 0, .base = 0, .count = 1, .k = 4, .local_mask = 1};
    CHECK(sa_agg_add_job(&a, &spec, err, sizeof err) == SA_ERR_ARG, "n = 0 is refused");
    CHECK(sa_agg_remove_job(&a, 1) == -1, "no job 1 to remove");
    /* The port is taken: a bind error, told apart by its code (not its message) and errno. */
    for (int threads = 1; threads <= 2; threads++) {
        sa_agg_init(&b);
        errno = 0;
        int rc = sa_agg_open(&b, "127.0.0.1", a.port, threads, none, 1, err, sizeof err);
        CHECK(rc == SA_ERR_BIND && errno == EADDRINUSE, "%d threads on a taken port: rc %d errno %d", threads, rc,
              errno);
        CHECK(strstr(err, "cannot bind") != NULL, "the message says so: %s", err);
        sa_agg_free(&b);
    }
    sa_agg_free(&a);

    struct sa_worker w;
    CHECK(sa_worker_open(&w, "127.0.0.1", 0, -1, err, sizeof err) == SA_ERR_ARG, "a negative rcvbuf");
    CHECK(sa_worker_open(&w, "127.0.0.1", 0, 0, err, sizeof err) == SA_OK, "worker open");
    struct sa_worker_config c = {.agg_host = "127.0.0.1", .agg_port = 9, .job = 1, .rank = 2, .n = 2,
                                 .slot_count = 1, .k = 4, .rto = 0.05, .rto_max = 1, .timeout = 1};
    CHECK(sa_worker_configure(&w, &c, err, sizeof err) == SA_ERR_ARG, "rank 2 of 2 is refused");
    CHECK(sa_worker_usable(&w, err, sizeof err) == SA_ERR_ARG, "an unconfigured worker is not usable");
    sa_worker_close(&w);
}

/* ---- a job through the aggregator engine, workers through the worker engine ---- */

enum { N = 3, K = 256, SLOTS = 8, BASE = 100, JOB = 7, INTS = 10007, FLOATS = 5003 };
#define KEY 0x5EC12E7u

struct serve_arg {
    struct sa_agg *a;
    int rc;
};

static void *serve(void *p) {
    struct serve_arg *s = p;
    s->rc = sa_agg_serve(s->a, UINT64_MAX, NULL, NULL);
    return NULL;
}

struct rank_arg {
    struct sa_worker w;
    int32_t *ints;
    float *floats;
    int rc_int, rc_float;
};

static void *run_rank(void *p) {
    struct rank_arg *r = p;
    r->rc_int = sa_worker_call(&r->w, 'i', r->ints, INTS, 0, 0, 32, NULL);
    r->rc_float = sa_worker_call(&r->w, 'f', r->floats, FLOATS, 0, 0, 32, NULL);
    return NULL;
}

static int32_t int_input(int rank, int i) { return (int32_t)((uint32_t)(i + 1) * 2654435761u + (uint32_t)rank * 977u); }
static float float_input(int rank, int i) { return (float)cos(i * 0.01 + rank) * (float)(rank + 1); }

static void wait_rx(struct sa_agg *a, uint64_t rx, struct sa_agg_counters *c) {
    uint64_t deadline = sa_now_ns() + WAIT_NS;
    for (;;) {
        if (sa_agg_counters(a, c) != SA_OK) return;
        if (c->rx >= rx || sa_now_ns() > deadline) return;
        sa_agg_counters_free(c);
        usleep(1000);
    }
}

/* A DATA-like datagram: header h and `values` zero values; to == NULL: on fd's connected address. */
static void emit(int fd, const struct sockaddr_in *to, struct sa_header h, size_t values) {
    uint8_t buf[SA_HEADER_LEN + 4 * K] = {0};
    memcpy(buf, &h, sizeof h);
    size_t len = SA_HEADER_LEN + 4 * values;
    if (to != NULL)
        (void)!sendto(fd, buf, len, 0, (const struct sockaddr *)to, sizeof *to);
    else
        (void)!send(fd, buf, len, 0);
}

static void test_job(void) {
    char err[256] = "";
    const double none[4] = {0, 0, 0, 0};
    struct sa_agg a;
    sa_agg_init(&a);
    if (sa_agg_open(&a, "127.0.0.1", 0, 2, none, 1, err, sizeof err) != SA_OK) {
        CHECK(0, "aggregator open: %s", err);
        return;
    }
    static struct rank_arg ranks[N];
    struct sa_job_spec spec = {.id = JOB, .gen = 1, .n = N, .base = BASE, .count = SLOTS, .k = K, .key = KEY};
    for (int r = 0; r < N; r++) {
        CHECK(sa_worker_open(&ranks[r].w, "127.0.0.1", 0, 0, err, sizeof err) == SA_OK, "worker %d: %s", r, err);
        spec.addrs[r] = ranks[r].w.local;
        spec.local_mask |= 1u << r;
    }
    CHECK(sa_agg_add_job(&a, &spec, err, sizeof err) == SA_OK, "add_job: %s", err);
    CHECK(sa_agg_add_job(&a, &spec, err, sizeof err) == SA_ERR_ARG && strstr(err, "already installed"),
          "the same id twice: %s", err);
    struct sa_worker_config cfg = {.agg_host = "127.0.0.1", .agg_port = a.port, .job = JOB, .n = N,
                                   .slot_base = BASE, .slot_count = SLOTS, .k = K, .rto = 0.05, .rto_max = 1,
                                   .timeout = 20, .key = KEY};
    for (int r = 0; r < N; r++) {
        cfg.rank = r;
        CHECK(sa_worker_configure(&ranks[r].w, &cfg, err, sizeof err) == SA_OK, "configure %d: %s", r, err);
        ranks[r].ints = malloc(INTS * sizeof(int32_t));
        ranks[r].floats = malloc(FLOATS * sizeof(float));
        for (int i = 0; i < INTS; i++) ranks[r].ints[i] = int_input(r, i);
        for (int i = 0; i < FLOATS; i++) ranks[r].floats[i] = float_input(r, i);
    }
    struct serve_arg sv = {.a = &a};
    pthread_t server, workers[N];
    pthread_create(&server, NULL, serve, &sv);
    for (int r = 0; r < N; r++) pthread_create(&workers[r], NULL, run_rank, &ranks[r]);
    for (int r = 0; r < N; r++) pthread_join(workers[r], NULL);

    int wrong_int = 0, wrong_float = 0;
    double worst = 0;
    for (int r = 0; r < N; r++) {
        CHECK(ranks[r].rc_int == SA_CALL_OK && ranks[r].rc_float == SA_CALL_OK, "rank %d: calls %d %d (%s)", r,
              ranks[r].rc_int, ranks[r].rc_float, ranks[r].w.why_broken);
        for (int i = 0; i < INTS; i++) {
            uint32_t want = 0; /* int32 sums wrap */
            for (int q = 0; q < N; q++) want += (uint32_t)int_input(q, i);
            wrong_int += ranks[r].ints[i] != (int32_t)want;
        }
        for (int b = 0; b < FLOATS; b += K) { /* the bound per block: n * 2^(E - 22), E the block's max */
            int len = FLOATS - b < K ? FLOATS - b : K, e = SA_EXP_NONE;
            for (int q = 0; q < N; q++) {
                float in[K];
                for (int i = 0; i < len; i++) in[i] = float_input(q, b + i);
                int eq = sa_block_exponent(in, (size_t)len);
                e = eq > e ? eq : e;
            }
            double bound = N * ldexp(1.0, e - 22);
            for (int i = b; i < b + len; i++) {
                double exact = 0;
                for (int q = 0; q < N; q++) exact += (double)float_input(q, i);
                double off = fabs((double)ranks[r].floats[i] - exact);
                worst = fmax(worst, off / bound);
                wrong_float += off > bound;
            }
        }
    }
    CHECK(wrong_int == 0, "%d int32 elements differ from the exact sum", wrong_int);
    CHECK(wrong_float == 0, "%d float32 elements off the bound (worst %.3g of it)", wrong_float, worst);

    /* Every contribution is aggregated once: the sessions' hello rounds (round k on slot BASE + k, the
     * last on BASE; the same rounds at every rank), the int32 call's chunks, the float32 call's chunks and its PRIME round
     * on each slot it used. Resends (if any) count elsewhere. */
    int ci = (INTS + K - 1) / K, cf = (FLOATS + K - 1) / K;
    uint64_t per_thread[2] = {0, 0};
    for (int r = 1; r < N; r++)
        CHECK(ranks[r].w.stats.hello_rounds == ranks[0].w.stats.hello_rounds, "rank %d saw other hello rounds", r);
    CHECK(ranks[0].w.stats.hello_rounds >= 2, "a hello of %llu rounds", ranks[0].w.stats.hello_rounds);
    for (unsigned long long k = 0; k + 1 < ranks[0].w.stats.hello_rounds; k++) per_thread[(BASE + k % SLOTS) % 2] += N;
    per_thread[BASE % 2] += N; /* the last round, in the session's incarnation, on the first slot */
    for (int j = 0; j < ci; j++) per_thread[(BASE + j % SLOTS) % 2] += N;
    for (int j = 0; j < cf; j++) per_thread[(BASE + j % SLOTS) % 2] += N;
    for (int j = 0; j < (cf < SLOTS ? cf : SLOTS); j++) per_thread[(BASE + j % SLOTS) % 2] += N;
    struct sa_agg_counters c;
    CHECK(sa_agg_counters(&a, &c) == SA_OK, "counters");
    CHECK(c.nthreads == 2 && c.njobs == 1 && c.jobs[0].id == JOB, "one job, two threads");
    CHECK(c.jobs[0].c[0] == per_thread[0] + per_thread[1], "aggregated %llu, want %llu",
          (unsigned long long)c.jobs[0].c[0], (unsigned long long)(per_thread[0] + per_thread[1]));
    for (int t = 0; t < 2; t++) {
        CHECK(c.threads[t].aggregated == per_thread[t], "thread %d aggregated %llu, want %llu (its slots')", t,
              (unsigned long long)c.threads[t].aggregated, (unsigned long long)per_thread[t]);
        CHECK(c.threads[t].misrouted == 0, "thread %d: a packet of another thread's slot", t);
    }
    CHECK(c.rx == c.threads[0].rx + c.threads[1].rx && c.tx == c.threads[0].tx + c.threads[1].tx,
          "the totals are the threads' sums");
    uint64_t rx0 = c.rx, drops = 0;
    for (int d = 0; d < SA_DROP_NREASONS; d++) drops += c.drops[d];
    CHECK(drops == 0, "%llu drops in a clean run", (unsigned long long)drops);
    sa_agg_counters_free(&c);

    /* Malformed datagrams, on slots of both threads: counted by reason, nothing aggregated. Spoofed:
     * rank 0 from a plain socket; the others from rank 0's own (connected) socket, its calls done. */
    int stranger = socket(AF_INET, SOCK_DGRAM, 0);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)a.port)};
    inet_pton(AF_INET, "127.0.0.1", &to.sin_addr);
    int own = ranks[0].w.fd;
    uint64_t want[SA_DROP_NREASONS] = {0};
    for (int slot = BASE; slot < BASE + 4; slot++) {
        struct sa_header x = {.version = SA_VERSION, .type = SA_MSG_DATA, .exp = SA_EXP_NONE, .job = htons(JOB),
                              .rank = htons(0), .pool = htons((uint16_t)slot), .elems = htons(K)};
        struct sa_header v = x, t = x, j = x, r = x, p = x, e = x;
        v.version = 1;
        t.type = 9;
        j.job = htons(JOB + 1);
        r.rank = htons(N);
        p.pool = htons((uint16_t)(slot + SLOTS));
        e.elems = htons(K - 1);
        emit(own, NULL, v, K), want[SA_DROP_BAD_VERSION]++;
        emit(own, NULL, t, K), want[SA_DROP_BAD_TYPE]++;
        emit(own, NULL, j, K), want[SA_DROP_UNKNOWN_JOB]++;
        emit(own, NULL, r, K), want[SA_DROP_BAD_RANK]++;
        emit(stranger, &to, x, K), want[SA_DROP_SPOOFED]++;
        emit(own, NULL, p, K), want[SA_DROP_BAD_POOL]++;
        emit(own, NULL, x, K - 1), want[SA_DROP_TRUNCATED]++; /* one value short */
        emit(own, NULL, e, K - 1), want[SA_DROP_TRUNCATED]++; /* elems != K */
    }
    (void)!send(own, "\x02", 1, 0), want[SA_DROP_TRUNCATED]++;
    uint64_t sent = 0;
    for (int d = 0; d < SA_DROP_NREASONS; d++) sent += want[d];
    wait_rx(&a, rx0 + sent, &c);
    for (int d = 0; d < SA_DROP_NREASONS; d++)
        CHECK(c.drops[d] == want[d], "drops %s: %llu, want %llu", sa_drop_names[d], (unsigned long long)c.drops[d],
              (unsigned long long)want[d]);
    CHECK(c.threads[0].dropped > 0 && c.threads[1].dropped > 0, "both threads counted drops (%llu, %llu)",
          (unsigned long long)c.threads[0].dropped, (unsigned long long)c.threads[1].dropped);
    CHECK(c.jobs[0].c[0] == per_thread[0] + per_thread[1], "no malformed datagram was aggregated");
    sa_agg_counters_free(&c);
    close(stranger);

    sa_agg_stop(&a);
    pthread_join(server, NULL);
    CHECK(sv.rc == 0, "serve returned %d", sv.rc);
    CHECK(sa_agg_close(&a) == SA_OK && !sa_agg_is_open(&a), "closed");
    for (int r = 0; r < N; r++) {
        sa_worker_close(&ranks[r].w);
        free(ranks[r].ints);
        free(ranks[r].floats);
    }
    sa_agg_free(&a);
}

int main(void) {
    test_quant();
    test_error_codes();
    test_job();
    printf("%d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
