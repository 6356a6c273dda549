/* switchagg._core: the per-packet work of switchagg (the engines in host/csrc), bound to Python. */
#include "bindings.h"
#include "../worker.h"

static PyObject *constants(PyObject *self, PyObject *unused) {
    /* Exposed so that tests can compare the C constants with protocol.py. */
    return Py_BuildValue(
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i}",
        "VERSION", SA_VERSION, "UDP_PORT", SA_UDP_PORT, "MSG_DATA", SA_MSG_DATA, "MSG_RESULT", SA_MSG_RESULT,
        "MSG_STATUS", SA_MSG_STATUS, "STATUS_LAG", SA_STATUS_LAG,
        "FLAG_PRIME", SA_FLAG_PRIME, "FLAG_FLOAT", SA_FLAG_FLOAT, "FLAG_ABORT", SA_FLAG_ABORT,
        "FLAG_MISMATCH", SA_FLAG_MISMATCH, "EXP_TOP", SA_EXP_TOP, "EXP_NONFINITE", SA_EXP_NONFINITE, "POOL_SET_BIT", SA_POOL_SET_BIT, "POOL_SLOT_MASK", SA_POOL_SLOT_MASK,
        "EXP_NONE", SA_EXP_NONE, "HEADER_LEN", SA_HEADER_LEN, "MAX_WORKERS", SA_MAX_WORKERS, "P4_K", SA_P4_K,
        "P4_NUM_SLOTS", SA_P4_NUM_SLOTS, "MAX_UDP_PAYLOAD", SA_MAX_UDP_PAYLOAD, "MAX_K", SA_MAX_K,
        "IPV4_UDP_HEADERS", SA_IPV4_UDP_HEADERS,
        "STEER_CLASSES", SA_STEER_CLASSES,
        "FLAG_LANE16", SA_FLAG_LANE16, "FLAG_LANE8", SA_FLAG_LANE8, "SCALE_BLOCK", SA_SCALE_BLOCK,
        "SCALE_BIAS", SA_SCALE_BIAS, "FLAG_HELLO", SA_FLAG_HELLO, "IDENTITY_FLAGS", SA_IDENTITY_FLAGS,
        "HELLO_ROUNDS", SA_HELLO_PHASES,
        "DROP_NREASONS", SA_DROP_NREASONS);
}

/* hello_digest(words, domain): sa_hello_digest of a hello round's words (a sequence of uint32), domain 'h'
 * (the next round's incarnation) or 's' (the session's); for tests that play an earlier session. */
static PyObject *hello_digest(PyObject *self, PyObject *args) {
    PyObject *seq;
    int domain;
    if (!PyArg_ParseTuple(args, "OC", &seq, &domain)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "words must be a sequence of uint32");
    if (fast == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    uint32_t *words = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof *words);
    if (words == NULL) {
        Py_DECREF(fast);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long v = PyLong_AsUnsignedLongMask(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) break;
        words[i] = (uint32_t)v;
    }
    Py_DECREF(fast);
    uint32_t d = sa_hello_digest(words, (size_t)n, (char)domain);
    PyMem_Free(words);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromUnsignedLong(d);
}

static PyMethodDef methods[] = {
    {"constants", constants, METH_NOARGS, "The protocol constants compiled into the C code."},
    {"hello_digest", hello_digest, METH_VARARGS, "sa_hello_digest(words, domain): a hello round's digest."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "switchagg._core", "switchagg's C packet path.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__core(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (sa_quant_register(m) < 0 || sa_worker_register(m) < 0 || sa_aggregator_register(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
