/* The software aggregator's loss detector (gaps.h). O(1) per contribution, amortised: each rank
 * looks at each round of a class once. */
#include "gaps.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int sa_gaps_init(struct sa_gaps *g, size_t states) {
    memset(g, 0, sizeof *g);
    /* A class has about states / SA_STEER_CLASSES rounds in flight; a rank that falls further behind
     * than the ring (stalled) is not looked at for the overwritten rounds: its own timers repair them. */
    uint32_t ring = 64;
    while (ring < 4 * (states / SA_STEER_CLASSES + 1)) ring *= 2;
    g->ring = ring;
    g->ring_si = calloc((size_t)ring * SA_STEER_CLASSES, sizeof *g->ring_si);
    g->ring_epoch = calloc((size_t)ring * SA_STEER_CLASSES, sizeof *g->ring_epoch);
    g->epoch_of = calloc(states, sizeof *g->epoch_of);
    if (g->ring_si == NULL || g->ring_epoch == NULL || g->epoch_of == NULL) {
        sa_gaps_free(g);
        errno = ENOMEM;
        return -1;
    }
    for (int c = 0; c < SA_STEER_CLASSES; c++)
        for (int r = 0; r < SA_MAX_WORKERS; r++) g->cls[c].checked[r] = 1; /* epochs start at 1 */
    return 0;
}

void sa_gaps_free(struct sa_gaps *g) {
    free(g->ring_si);
    free(g->ring_epoch);
    free(g->epoch_of);
    g->ring_si = g->ring_epoch = g->epoch_of = NULL;
}

/* a - b as a signed distance: epochs wrap after 2^32 rounds of a class */
static inline int32_t ahead(uint32_t a, uint32_t b) { return (int32_t)(a - b); }

void sa_gaps_note(struct sa_gaps *g, uint32_t cls, uint32_t si, uint32_t rank, int first, sa_gap_fn skipped,
                  void *ctx) {
    struct sa_gaps_class *c = &g->cls[cls];
    uint32_t *ring_si = g->ring_si + (size_t)cls * g->ring, *ring_epoch = g->ring_epoch + (size_t)cls * g->ring;
    if (first) {
        uint32_t e = ++c->epoch;
        if (e == 0) e = ++c->epoch; /* 0 marks "never started" */
        g->epoch_of[si] = e;
        ring_si[e & (g->ring - 1)] = si;
        ring_epoch[e & (g->ring - 1)] = e;
    }
    uint32_t *recent = c->recent[rank];
    recent[c->next_recent[rank]] = g->epoch_of[si];
    c->next_recent[rank] = (uint8_t)((c->next_recent[rank] + 1) % SA_STATUS_LAG);
    uint32_t oldest = recent[0]; /* of the last SA_STATUS_LAG: every round before it was skipped */
    for (int i = 0; i < SA_STATUS_LAG; i++) {
        if (recent[i] == 0) return; /* fewer than SA_STATUS_LAG contributions so far */
        if (ahead(recent[i], oldest) < 0) oldest = recent[i];
    }
    uint32_t *next = &c->checked[rank];
    if (ahead(oldest, *next) > (int32_t)g->ring) *next = oldest - g->ring; /* the rest was overwritten */
    for (; ahead(oldest, *next) > 0; (*next)++) {
        uint32_t slot = *next & (g->ring - 1), old = ring_si[slot];
        if (ring_epoch[slot] == *next && g->epoch_of[old] == *next) skipped(ctx, old, rank);
    }
}
