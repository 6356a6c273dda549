/* Which rank skipped which round: the software aggregator's loss detector (docs/PROTOCOL.md, Loss
 * notices), plain C. Every worker sends the rounds of one steering class in the same order, and a
 * round's first contribution stamps it with the next epoch of its class, so a rank whose last
 * SA_STATUS_LAG contributions all went to rounds younger than one it has not contributed to has lost that
 * contribution, or the result before it on that slot (as TCP's three duplicate ACKs; a single jump ahead
 * is not enough: the rank that started the rounds may itself have sent out of order, after a result of
 * its own was lost). The detector only names candidates; the aggregator checks the round's state
 * (complete? the rank's bit?) and sends the notices. Each class is one thread's. */
#ifndef SWITCHAGG_GAPS_H
#define SWITCHAGG_GAPS_H

#include <stddef.h>
#include <stdint.h>

#include "protocol.h"

struct sa_gaps_class {
    uint32_t epoch;                    /* of the latest round started in this class */
    uint32_t recent[SA_MAX_WORKERS][SA_STATUS_LAG]; /* per rank: the epochs of its last contributions */
    uint8_t next_recent[SA_MAX_WORKERS];            /* where its next one goes in recent[rank] */
    uint32_t checked[SA_MAX_WORKERS];  /* per rank: epochs below this were looked at for it */
} __attribute__((aligned(64)));

struct sa_gaps {
    uint32_t ring;                     /* entries per class ring: a power of two */
    uint32_t *ring_si;                 /* per class, per epoch mod ring: the state index that started then */
    uint32_t *ring_epoch;              /* ... and that epoch (an entry overwritten since reads another) */
    uint32_t *epoch_of;                /* per state index: the epoch its current round started at */
    struct sa_gaps_class cls[SA_STEER_CLASSES];
};

/* A job of `states` state indexes (2 per slot); 0, or -1 with errno ENOMEM. */
int sa_gaps_init(struct sa_gaps *g, size_t states);
void sa_gaps_free(struct sa_gaps *g);

/* Called for every (state index, rank) the rank skipped: that round started before every one of the
 * rank's last SA_STATUS_LAG contributions, and is still the state's current round. */
typedef void (*sa_gap_fn)(void *ctx, uint32_t si, uint32_t rank);

/* Rank `rank` made a new contribution to state index si of class cls; `first`: it started the round. */
void sa_gaps_note(struct sa_gaps *g, uint32_t cls, uint32_t si, uint32_t rank, int first, sa_gap_fn skipped,
                  void *ctx);

#endif
