/* Block quantization of float32 to int32 (docs/PROTOCOL.md "Quantization") and the byte-order
 * conversions of the payload. All functions work on one block of at most K elements. */
#ifndef SWITCHAGG_QUANT_H
#define SWITCHAGG_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* Exponent field of a block: the smallest e with 2^e >= max|x|, clamped to [-126, SA_EXP_TOP]
 * (SA_EXP_TOP stands for 2^128); SA_EXP_NONE for an all-zero block, SA_EXP_NONFINITE if it holds
 * NaN or +-Inf. */
int8_t sa_block_exponent(const float *x, size_t len);

/* q = round(x * f) clamped to INT32_MAX/n, written big-endian; out is zero-padded up to k. For
 * e_max == SA_EXP_NONFINITE, per element the class count of docs/PROTOCOL.md instead. */
void sa_quantize_be(const float *x, size_t len, size_t k, int e_max, int n, uint32_t *out_be);

/* y = q / f from a big-endian block. */
void sa_dequantize_be(const uint32_t *in_be, size_t len, int e_max, int n, float *y);

/* int32 payloads: host order <-> big-endian, out zero-padded up to k. */
void sa_int_to_be(const int32_t *x, size_t len, size_t k, uint32_t *out_be);
void sa_be_to_int(const uint32_t *in_be, size_t len, int32_t *y);

/* ---- Narrow lanes (docs/PROTOCOL.md, Narrow lanes): 16- or 8-bit lanes, one scale byte per
 * SA_SCALE_BLOCK values. A chunk of len values has ceil(len / SA_SCALE_BLOCK) blocks. */

/* Each block's scale byte: its exponent (as sa_block_exponent) + SA_SCALE_BIAS; 0 all-zero, 255 non-finite. */
void sa_block_scales(const float *x, size_t len, uint8_t *scales);

/* Lanes of `bits` (16 or 8), big-endian, for len values quantized on the blocks' max scales with
 * stochastic rounding (seed: the per-element dither's, different on every rank and chunk); a block that
 * sends nothing (all zero, non-finite) gets zero lanes. With residual != NULL, residual[i] = x[i] - what
 * the lane stands for (the rank's rounding error, 0 in a non-finite block). */
void sa_quantize_lanes(const float *x, size_t len, int bits, const uint8_t *scales, int n, uint32_t seed,
                       uint8_t *out, float *residual);

/* y = lane / f for len values of big-endian lanes; a non-finite block is NaN throughout. */
void sa_dequantize_lanes(const uint8_t *in, size_t len, int bits, const uint8_t *scales, int n, float *y);

#endif
