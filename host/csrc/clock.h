/* Time and cheap randomness shared by the engines (no Python). */
#ifndef SWITCHAGG_CLOCK_H
#define SWITCHAGG_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t sa_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* xorshift64*: cheap, seedable randomness for fault injection and jitter. */
static inline uint64_t sa_rand(uint64_t *state) {
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1Dull;
}

/* Uniform in [0, 1). */
static inline double sa_rand01(uint64_t *state) { return (double)(sa_rand(state) >> 11) * (1.0 / 9007199254740992.0); }

#endif
