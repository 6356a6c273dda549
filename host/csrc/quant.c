/* Quantization kernels. Written as plain loops that GCC vectorizes; on x86-64 each kernel is
 * also compiled for AVX2 and picked at load time (target_clones), so one build runs anywhere. */
#include "quant.h"

#include <math.h>
#include <string.h>

#include "common.h"

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

/* ---- Python entry points, for tests and the benchmark ---- */

static int get_f32(PyObject *obj, Py_buffer *view, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "f") != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "expected a contiguous float32 buffer");
        return -1;
    }
    return 0;
}

static int get_u32(PyObject *obj, Py_buffer *view, int writable) {
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) return -1;
    if (view->len % 4 != 0) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "expected a buffer of 4-byte elements");
        return -1;
    }
    return 0;
}

/* quantize(x, q, exps, n, k): per block of k, local exponent into exps (int8 buffer of
 * ceil(len/k)) and big-endian q (len rounded up to k). A block with NaN/Inf gets EXP_NONFINITE. */
static PyObject *py_quantize(PyObject *self, PyObject *args) {
    PyObject *xo, *qo, *eo;
    int n, k;
    if (!PyArg_ParseTuple(args, "OOOii", &xo, &qo, &eo, &n, &k)) return NULL;
    if (n < 1 || n > SA_MAX_WORKERS || k < 1 || k > SA_MAX_K) {
        PyErr_SetString(PyExc_ValueError, "n must be in 1..32 and k in 1..MAX_K");
        return NULL;
    }
    Py_buffer x, q, e;
    if (get_f32(xo, &x, 0) < 0) return NULL;
    if (get_u32(qo, &q, 1) < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    if (PyObject_GetBuffer(eo, &e, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&x);
        PyBuffer_Release(&q);
        return NULL;
    }
    size_t len = (size_t)x.len / 4, blocks = (len + (size_t)k - 1) / (size_t)k;
    int rc = 0;
    if ((size_t)q.len < blocks * (size_t)k * 4 || (size_t)e.len < blocks) {
        rc = -2;
    } else {
        Py_BEGIN_ALLOW_THREADS;
        for (size_t b = 0; b < blocks; b++) {
            size_t off = b * (size_t)k, l = len - off < (size_t)k ? len - off : (size_t)k;
            int8_t ex = sa_block_exponent((const float *)x.buf + off, l);
            ((int8_t *)e.buf)[b] = ex;
            sa_quantize_be((const float *)x.buf + off, l, (size_t)k, ex, n, (uint32_t *)q.buf + off);
        }
        Py_END_ALLOW_THREADS;
    }
    PyBuffer_Release(&x);
    PyBuffer_Release(&q);
    PyBuffer_Release(&e);
    if (rc == -2) return PyErr_Format(PyExc_ValueError, "output buffers are too small for %zu blocks", blocks);
    Py_RETURN_NONE;
}

/* dequantize(q, exps, y, n, k): inverse of quantize, into float32 y. */
static PyObject *py_dequantize(PyObject *self, PyObject *args) {
    PyObject *qo, *eo, *yo;
    int n, k;
    if (!PyArg_ParseTuple(args, "OOOii", &qo, &eo, &yo, &n, &k)) return NULL;
    if (n < 1 || n > SA_MAX_WORKERS || k < 1 || k > SA_MAX_K) {
        PyErr_SetString(PyExc_ValueError, "n must be in 1..32 and k in 1..MAX_K");
        return NULL;
    }
    Py_buffer q, e, y;
    if (get_u32(qo, &q, 0) < 0) return NULL;
    if (PyObject_GetBuffer(eo, &e, PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&q);
        return NULL;
    }
    if (get_f32(yo, &y, 1) < 0) {
        PyBuffer_Release(&q);
        PyBuffer_Release(&e);
        return NULL;
    }
    size_t len = (size_t)y.len / 4, blocks = (len + (size_t)k - 1) / (size_t)k;
    int ok = (size_t)q.len >= len * 4 && (size_t)e.len >= blocks;
    if (ok) {
        Py_BEGIN_ALLOW_THREADS;
        for (size_t b = 0; b < blocks; b++) {
            size_t off = b * (size_t)k, l = len - off < (size_t)k ? len - off : (size_t)k;
            sa_dequantize_be((const uint32_t *)q.buf + off, l, ((int8_t *)e.buf)[b], n, (float *)y.buf + off);
        }
        Py_END_ALLOW_THREADS;
    }
    PyBuffer_Release(&q);
    PyBuffer_Release(&e);
    PyBuffer_Release(&y);
    if (!ok) return PyErr_Format(PyExc_ValueError, "input buffers are too small for %zu elements", len);
    Py_RETURN_NONE;
}

static PyMethodDef quant_methods[] = {
    {"quantize", py_quantize, METH_VARARGS, "quantize(x, q, exps, n, k): float32 -> big-endian int32 blocks."},
    {"dequantize", py_dequantize, METH_VARARGS, "dequantize(q, exps, y, n, k): big-endian int32 -> float32."},
    {NULL, NULL, 0, NULL},
};

int sa_quant_register(PyObject *module) { return PyModule_AddFunctions(module, quant_methods); }
