/* Block quantization of float32 to int32 (docs/PROTOCOL.md "Quantization") and the byte-order
 * conversions of the payload. All functions work on one block of at most K elements. */
#ifndef SWITCHAGG_QUANT_H
#define SWITCHAGG_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* Exponent e of a block with 2^e >= max|x| (SA_EXP_NONE for an all-zero block).
 * Returns 0, or -1 if the block holds NaN, Inf or a magnitude above 2^127 (then *bad_index is set). */
int sa_block_exponent(const float *x, size_t len, int8_t *e, size_t *bad_index);

/* q = round(x * f) clamped to INT32_MAX/n, written big-endian; out is zero-padded up to k. */
void sa_quantize_be(const float *x, size_t len, size_t k, int e_max, int n, uint32_t *out_be);

/* y = q / f from a big-endian block. */
void sa_dequantize_be(const uint32_t *in_be, size_t len, int e_max, int n, float *y);

/* int32 payloads: host order <-> big-endian, out zero-padded up to k. */
void sa_int_to_be(const int32_t *x, size_t len, size_t k, uint32_t *out_be);
void sa_be_to_int(const uint32_t *in_be, size_t len, int32_t *y);

#endif
