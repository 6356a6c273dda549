/* The quantization kernels as Python functions, for tests and the benchmark. */
#include "bindings.h"

#include <string.h>

#include "../quant.h"

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
