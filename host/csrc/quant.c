/* Quantization kernels. Written as plain loops that GCC vectorizes; on x86-64 each kernel is
 * also compiled for AVX2 and picked at load time (target_clones), so one build runs anywhere. */
#include "quant.h"

#include <math.h>
#include <string.h>

#include "protocol.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SA_HOT __attribute__((target_clones("avx2", "default")))
#else
#define SA_HOT
#endif

static inline uint32_t bswap32(uint32_t v) {
    return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

/* The largest float not above INT32_MAX / n: the clamp that keeps an n-way sum in int32. */
static inline float sa_limit(int n) { return nextafterf((float)(2147483647.0 / (double)n), 0.0f); }

SA_HOT int8_t sa_block_exponent(const float *x, size_t len) {
    /* For non-negative floats the bit pattern orders like the value, and NaN/Inf sort above all
     * finite values, so one integer max finds both the magnitude and any non-finite element. */
    const uint32_t *bits = (const uint32_t *)x;
    uint32_t m = 0;
    for (size_t i = 0; i < len; i++) {
        uint32_t a = bits[i] & 0x7fffffffu;
        m = a > m ? a : m;
    }
    if (m == 0) return SA_EXP_NONE;
    if (m >= 0x7f800000u) return SA_EXP_NONFINITE;
    float mf;
    memcpy(&mf, &m, sizeof mf);
    int ex;
    float frac = frexpf(mf, &ex); /* mf = frac * 2^ex, frac in [0.5, 1) */
    if (frac == 0.5f) ex -= 1;    /* an exact power of two needs no extra bit: 2^(ex-1) >= mf */
    if (ex < -126) ex = -126;
    if (ex > SA_EXP_TOP) ex = SA_EXP_TOP; /* EXP_TOP stands for 2^128, above every finite float */
    return (int8_t)ex;
}

/* The E of an exponent field: the field itself, EXP_TOP stands for 128. */
static inline int exp_value(int e_field) { return e_field >= SA_EXP_TOP ? 128 : e_field; }

/* Non-finite blocks: each rank sends a class count per element; sums of n <= 32 fit 8 bits each. */
#define NF_POS 1u
#define NF_NEG (1u << 8)
#define NF_NAN (1u << 16)

static void quantize_nonfinite(const float *x, size_t len, size_t k, uint32_t *out_be) {
    for (size_t i = 0; i < len; i++) {
        uint32_t c = 0;
        if (isnan(x[i]))
            c = NF_NAN;
        else if (isinf(x[i]))
            c = x[i] > 0 ? NF_POS : NF_NEG;
        out_be[i] = bswap32(c);
    }
    for (size_t i = len; i < k; i++) out_be[i] = 0;
}

static void dequantize_nonfinite(const uint32_t *in_be, size_t len, float *y) {
    for (size_t i = 0; i < len; i++) {
        uint32_t c = bswap32(in_be[i]), pos = c & 0xff, neg = (c >> 8) & 0xff, nan = (c >> 16) & 0xff;
        /* IEEE's sum: NaN absorbs, +Inf + -Inf is NaN. A finite element of this block did not
         * travel (its ranks sent class counts), so its sum is unknown: NaN as well. */
        if (nan || (pos && neg) || !(pos || neg))
            y[i] = NAN;
        else
            y[i] = pos ? INFINITY : -INFINITY;
    }
}

SA_HOT void sa_quantize_be(const float *x, size_t len, size_t k, int e_max, int n, uint32_t *out_be) {
    if (e_max == SA_EXP_NONE) { /* every worker's block is zero */
        memset(out_be, 0, k * sizeof *out_be);
        return;
    }
    if (e_max == SA_EXP_NONFINITE) {
        quantize_nonfinite(x, len, k, out_be);
        return;
    }
    e_max = exp_value(e_max);
    const float lim = sa_limit(n);
    /* f = lim * 2^-e_max; for e_max below -96 it overflows a float, so scale in two steps. */
    const float f1 = e_max >= -96 ? ldexpf(lim, -e_max) : ldexpf(1.0f, -e_max);
    const float f2 = e_max >= -96 ? 1.0f : lim;
    for (size_t i = 0; i < len; i++) {
        float t = (x[i] * f1) * f2;
        t = t > lim ? lim : t;
        t = t < -lim ? -lim : t;
        out_be[i] = bswap32((uint32_t)(int32_t)rintf(t)); /* round to nearest even: vroundps */
    }
    for (size_t i = len; i < k; i++) out_be[i] = 0;
}

SA_HOT void sa_dequantize_be(const uint32_t *in_be, size_t len, int e_max, int n, float *y) {
    if (e_max == SA_EXP_NONE) {
        memset(y, 0, len * sizeof *y);
        return;
    }
    if (e_max == SA_EXP_NONFINITE) {
        dequantize_nonfinite(in_be, len, y);
        return;
    }
    e_max = exp_value(e_max);
    if (e_max == 128) { /* 2^128 is no float: scale in double, so FLT_MAX comes back as itself */
        const double f = ldexp(1.0, 128) / (double)sa_limit(n);
        for (size_t i = 0; i < len; i++) y[i] = (float)((double)(int32_t)bswap32(in_be[i]) * f);
        return;
    }
    const float inv = 1.0f / sa_limit(n);
    if (e_max >= -90) { /* then inv * 2^e_max is a normal float: one multiply per element */
        const float f = ldexpf(inv, e_max);
        for (size_t i = 0; i < len; i++) y[i] = (float)(int32_t)bswap32(in_be[i]) * f;
        return;
    }
    const float pow2 = ldexpf(1.0f, e_max);
    for (size_t i = 0; i < len; i++) y[i] = ((float)(int32_t)bswap32(in_be[i]) * inv) * pow2;
}

SA_HOT void sa_int_to_be(const int32_t *x, size_t len, size_t k, uint32_t *out_be) {
    for (size_t i = 0; i < len; i++) out_be[i] = bswap32((uint32_t)x[i]);
    for (size_t i = len; i < k; i++) out_be[i] = 0;
}

SA_HOT void sa_be_to_int(const uint32_t *in_be, size_t len, int32_t *y) {
    for (size_t i = 0; i < len; i++) y[i] = (int32_t)bswap32(in_be[i]);
}

/* ---- Narrow lanes ---- */

SA_HOT void sa_block_scales(const float *x, size_t len, uint8_t *scales) {
    for (size_t b = 0, off = 0; off < len; b++, off += SA_SCALE_BLOCK) {
        size_t l = len - off < SA_SCALE_BLOCK ? len - off : SA_SCALE_BLOCK;
        scales[b] = (uint8_t)(sa_block_exponent(x + off, l) + SA_SCALE_BIAS);
    }
}

/* M: one contribution's largest lane magnitude, so that n of them sum inside the lane. */
static inline int lane_limit(int bits, int n) { return ((1 << (bits - 1)) - 1) / n; }

/* A uniform dither in [0, 1) per element: a 32-bit integer hash (lowbias32) of the element's index
 * and the chunk's seed; integer multiplies and shifts, so the loop still vectorizes. */
static inline float dither(uint32_t seed, uint32_t i) {
    uint32_t h = seed + i * 0x9e3779b9u;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    h *= 0x846ca68bu;
    h ^= h >> 16;
    return (float)(h >> 8) * 0x1p-24f;
}

/* The value of one unit of a lane in a block of scale byte s: 2^E / M. */
static inline double lane_step(uint8_t s, int m) { return ldexp(1.0, exp_value((int)s - SA_SCALE_BIAS)) / m; }

SA_HOT static void quantize_block(const float *x, size_t l, int bits, uint8_t s, int m, uint32_t seed,
                                  uint32_t first, uint8_t *out, float *residual) {
    if (s == 0 || s == 255) { /* all zero on every rank, or non-finite somewhere: nothing travels */
        memset(out, 0, l * (size_t)bits / 8);
        if (residual) memset(residual, 0, l * sizeof *residual);
        return;
    }
    const int e = exp_value((int)s - SA_SCALE_BIAS);
    /* 2^-E is exact (2^-128 as a subnormal), and so is x * 2^-E (at most 1); 2^-E * M is not: it
     * overflows to Inf for the smallest blocks (E below about -115 in 16-bit lanes, -123 in 8-bit),
     * which made their lanes and residuals NaN (gradients that small are common). */
    const float down = ldexpf(1.0f, -e);
    const float step = (float)lane_step(s, m), lim = (float)m;
    for (size_t i = 0; i < l; i++) {
        float t = floorf(x[i] * down * lim + dither(seed, first + (uint32_t)i));
        t = t > lim ? lim : t;
        t = t < -lim ? -lim : t;
        if (residual) residual[i] = x[i] - t * step;
        if (bits == 16) {
            uint16_t v = (uint16_t)(int16_t)t;
            out[2 * i] = (uint8_t)(v >> 8);
            out[2 * i + 1] = (uint8_t)v;
        } else {
            out[i] = (uint8_t)(int8_t)t;
        }
    }
}

void sa_quantize_lanes(const float *x, size_t len, int bits, const uint8_t *scales, int n, uint32_t seed,
                       uint8_t *out, float *residual) {
    const int m = lane_limit(bits, n);
    const size_t bytes = (size_t)bits / 8;
    for (size_t b = 0, off = 0; off < len; b++, off += SA_SCALE_BLOCK) {
        size_t l = len - off < SA_SCALE_BLOCK ? len - off : SA_SCALE_BLOCK;
        quantize_block(x + off, l, bits, scales[b], m, seed, (uint32_t)off, out + off * bytes,
                       residual ? residual + off : NULL);
    }
}

SA_HOT static void dequantize_block(const uint8_t *in, size_t l, int bits, uint8_t s, int m, float *y) {
    if (s == 0 || s == 255) {
        for (size_t i = 0; i < l; i++) y[i] = s == 0 ? 0.0f : NAN;
        return;
    }
    const double step = lane_step(s, m);
    if (bits == 16)
        for (size_t i = 0; i < l; i++) y[i] = (float)((double)(int16_t)(uint16_t)(in[2 * i] << 8 | in[2 * i + 1]) * step);
    else
        for (size_t i = 0; i < l; i++) y[i] = (float)((double)(int8_t)in[i] * step);
}

void sa_dequantize_lanes(const uint8_t *in, size_t len, int bits, const uint8_t *scales, int n, float *y) {
    const int m = lane_limit(bits, n);
    const size_t bytes = (size_t)bits / 8;
    for (size_t b = 0, off = 0; off < len; b++, off += SA_SCALE_BLOCK) {
        size_t l = len - off < SA_SCALE_BLOCK ? len - off : SA_SCALE_BLOCK;
        dequantize_block(in + off * bytes, l, bits, scales[b], m, y + off);
    }
}
