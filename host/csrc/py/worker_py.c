/* switchagg._core.Worker: the worker engine (worker.h) as a Python type; calls run with the GIL released. */
#include "bindings.h"

#include <arpa/inet.h>
#include <errno.h>

#include "../worker.h"

typedef struct {
    PyObject_HEAD struct sa_worker w;
} Worker;

static PyObject *SwitchaggError, *SwitchaggTimeout;
/* One class per sa_cause, indexed by it: SwitchaggError and its subclasses. */
static PyObject *cause_class[SA_CAUSES];

static void worker_dealloc(Worker *self) {
    sa_worker_close(&self->w);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Worker(host="127.0.0.1", port=0, rcvbuf=0): bind the socket now, so its address can be registered
 * with the control plane before the job is configured. */
static int worker_init(Worker *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"host", "port", "rcvbuf", NULL};
    const char *host = "127.0.0.1";
    int port = 0, rcvbuf = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|sii", kwlist, &host, &port, &rcvbuf)) return -1;
    sa_worker_close(&self->w);
    char err[256];
    int rc = sa_worker_open(&self->w, host, port, rcvbuf, err, sizeof err);
    if (rc == -1) PyErr_SetString(PyExc_ValueError, err);
    if (rc == -2) PyErr_SetFromErrno(PyExc_OSError);
    return rc < 0 ? -1 : 0;
}

static PyObject *worker_configure(Worker *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"agg_host", "agg_port", "job", "rank", "n", "slot_base", "slot_count", "k",
                             "rto", "rto_max", "timeout", "key", NULL};
    struct sa_worker_config c = {.rto = 0.05, .rto_max = 1.0, .timeout = 10.0};
    long long key = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "siiiiiii|dddL", kwlist, &c.agg_host, &c.agg_port, &c.job, &c.rank,
                                     &c.n, &c.slot_base, &c.slot_count, &c.k, &c.rto, &c.rto_max, &c.timeout, &key))
        return NULL;
    if (key < 0 || key > 0xFFFFFFFFll) return PyErr_Format(PyExc_ValueError, "key %lld is not 32-bit unsigned", key);
    c.key = (uint32_t)key;
    if (self->w.busy) return PyErr_Format(SwitchaggError, "an allreduce is running on this worker");
    char err[256];
    int rc = sa_worker_configure(&self->w, &c, err, sizeof err);
    if (rc == -1) return PyErr_Format(PyExc_ValueError, "%s", err);
    if (rc == -2) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *class_of(const struct sa_worker *w) {
    int cause = sa_worker_cause(w);
    return cause_class[cause >= 0 && cause < SA_CAUSES ? cause : SA_CAUSE_ERROR];
}

static PyObject *raise_failure(Worker *self, int rc);

/* One call with the GIL released; a failure is raised with the engine's reason, as its cause's class. */
static PyObject *call(Worker *self, char kind, void *data, size_t len, int abort, uint32_t tag, int bits,
                      float *residual) {
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = sa_worker_call(&self->w, kind, data, len, abort, tag, bits, residual);
    Py_END_ALLOW_THREADS;
    if (rc == SA_CALL_OK || abort) Py_RETURN_NONE; /* an abort always ends in a broken session */
    return raise_failure(self, rc);
}

static PyObject *raise_failure(Worker *self, int rc) {
    switch (rc) {
    case SA_CALL_POISONED:  /* a mismatch, or a peer's abort */
    case SA_CALL_TIMEOUT:
    case SA_CALL_CANCELLED: /* cancel(): with the canceller's cause (a peer gone, a teardown, another lane) */
        return PyErr_Format(class_of(&self->w), "%s", self->w.why_broken);
    case SA_CALL_NOMEM:
        return PyErr_NoMemory();
    default:
        return PyErr_SetFromErrno(PyExc_OSError);
    }
}

static int check_usable(Worker *self) {
    char err[1200];
    if (sa_worker_usable(&self->w, err, sizeof err) == 0) return 0;
    PyErr_SetString(self->w.configured ? class_of(&self->w) : SwitchaggError, err);
    return -1;
}

/* The residual buffer of an allreduce in narrow lanes: len writable float32s. */
static int get_residual(PyObject *obj, Py_buffer *view, size_t len) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE | PyBUF_FORMAT) < 0) return -1;
    if (view->itemsize != 4 || view->format == NULL || strcmp(view->format, "f") != 0 || (size_t)view->len != 4 * len) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "residual must be a contiguous float32 buffer of %zu elements", len);
        return -1;
    }
    return 0;
}

/* open_session(): the session's hello now (docs/PROTOCOL.md, Sessions), with the GIL released. */
static PyObject *worker_open_session(Worker *self, PyObject *unused) {
    if (check_usable(self) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    rc = sa_worker_open_session(&self->w);
    Py_END_ALLOW_THREADS;
    if (rc == SA_CALL_OK) Py_RETURN_NONE;
    return raise_failure(self, rc);
}

/* allreduce(buffer, kind, tag=0, bits=32, residual=None): sum the buffer over all workers, in place. kind
 * 'f' or 'i'; bits: the lanes on the wire (16 and 8 for 'f' only). */
static PyObject *worker_allreduce(Worker *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buffer", "kind", "tag", "bits", "residual", NULL};
    PyObject *obj, *res_obj = Py_None;
    int kind, bits = 32;
    unsigned int tag = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OC|IiO", kwlist, &obj, &kind, &tag, &bits, &res_obj)) return NULL;
    if (check_usable(self) < 0) return NULL;
    if (kind != 'f' && kind != 'i') return PyErr_Format(PyExc_ValueError, "kind must be 'f' or 'i'");
    if (bits != 32 && bits != 16 && bits != 8) return PyErr_Format(PyExc_ValueError, "bits must be 32, 16 or 8, not %d", bits);
    if (bits != 32 && kind != 'f') return PyErr_Format(PyExc_ValueError, "int32 calls travel in 32-bit lanes only");
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) return NULL;
    if (view.len % 4 != 0) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_TypeError, "buffer of %zd bytes is not made of 4-byte elements", view.len);
    }
    if ((size_t)view.len / 4 > (size_t)UINT32_MAX) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "tensors above 2^32 elements are not supported");
    }
    Py_buffer rview = {0};
    int with_residual = res_obj != Py_None;
    if (with_residual && get_residual(res_obj, &rview, (size_t)view.len / 4) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *res = call(self, (char)kind, view.buf, (size_t)view.len / 4, 0, tag, bits,
                         with_residual ? (float *)rview.buf : NULL);
    if (with_residual) PyBuffer_Release(&rview);
    PyBuffer_Release(&view);
    return res;
}

/* abort(total, kind, tag=0, bits=32): give up the next call after a local error, so that every peer fails it too:
 * one ABORT on chunk 0's slot, resent until its (poisoned) round completes or the timeout passes.
 * The session is unusable afterwards, as are the peers'. */
static PyObject *worker_abort(Worker *self, PyObject *args) {
    unsigned long long total;
    int kind;
    unsigned int tag = 0;
    int bits = 32;
    if (!PyArg_ParseTuple(args, "KC|Ii", &total, &kind, &tag, &bits)) return NULL;
    if (check_usable(self) < 0) return NULL;
    if (kind != 'f' && kind != 'i') return PyErr_Format(PyExc_ValueError, "kind must be 'f' or 'i'");
    if (bits != 32 && bits != 16 && bits != 8) return PyErr_Format(PyExc_ValueError, "bits must be 32, 16 or 8, not %d", bits);
    return call(self, (char)kind, NULL, total > UINT32_MAX ? UINT32_MAX : (size_t)total, 1, tag, bits, NULL);
}

static PyObject *worker_stats(Worker *self, PyObject *unused) {
    const struct sa_worker_stats *s = &self->w.stats;
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:I}", "sent", s->sent,
                         "retransmits", s->retransmits, "fast_retransmits", s->fast_retransmits, "status_resends",
                         s->status_resends, "status_holds", s->status_holds, "spurious_retransmits", s->spurious, "tail_probes", s->tail_probes, "spurious_probes", s->spurious_probes,
                         "timeouts", s->timeouts, "gso_sends", s->gso_sends, "gro_receives", s->gro_receives,
                         "results", s->results, "stale", s->stale, "bad_key", s->bad_key,
                         "allreduces", s->allreduces, "bytes_sent", s->bytes, "bytes_lanes32", s->lane_bytes[0],
                         "bytes_lanes16", s->lane_bytes[1], "bytes_lanes8", s->lane_bytes[2], "hello_rounds", s->hello_rounds,
                         "hello_ns", s->hello_ns, "call", self->w.call);
}

/* cancel(reason, cause=SwitchaggError): from any thread, end the call in progress and refuse later ones;
 * the call raises `cause` (SwitchaggError or one of its subclasses) with the reason. */
static PyObject *worker_cancel(Worker *self, PyObject *args) {
    const char *why;
    PyObject *cls = SwitchaggError;
    if (!PyArg_ParseTuple(args, "s|O", &why, &cls)) return NULL;
    int cause = -1;
    for (int c = 0; c < SA_CAUSES; c++)
        if (cause_class[c] == cls) cause = c;
    if (cause < 0) return PyErr_Format(PyExc_TypeError, "cause must be SwitchaggError or one of its subclasses");
    sa_worker_cancel(&self->w, why, cause);
    Py_RETURN_NONE;
}

static PyObject *worker_close(Worker *self, PyObject *unused) {
    if (self->w.busy) return PyErr_Format(SwitchaggError, "an allreduce is running on this worker");
    sa_worker_close(&self->w);
    Py_RETURN_NONE;
}

static PyObject *worker_address(Worker *self, void *unused) {
    /* Read again: a socket bound to 0.0.0.0 gets its real source address once configure() connects. */
    socklen_t sl = sizeof self->w.local;
    if (self->w.fd >= 0) getsockname(self->w.fd, (struct sockaddr *)&self->w.local, &sl);
    char buf[INET_ADDRSTRLEN];
    inet_ntop(AF_INET, &self->w.local.sin_addr, buf, sizeof buf);
    return Py_BuildValue("(si)", buf, ntohs(self->w.local.sin_port));
}

static PyObject *worker_window(Worker *self, void *unused) { return PyLong_FromLong(self->w.configured ? self->w.window : 0); }

static PyObject *worker_rcvbuf(Worker *self, void *unused) { return PyLong_FromLong(self->w.rcvbuf); }

static PyObject *worker_path_mtu(Worker *self, void *unused) { return PyLong_FromLong(self->w.configured ? self->w.path_mtu : 0); }

static PyObject *worker_gso(Worker *self, void *unused) { return PyLong_FromLong(self->w.configured ? self->w.gso_segs : 0); }

static PyObject *worker_gro(Worker *self, void *unused) { return PyBool_FromLong(self->w.configured && self->w.gro); }

static PyObject *worker_rcvbuf_needed(Worker *self, void *unused) {
    return PyLong_FromSize_t(sa_worker_rcvbuf_needed(&self->w));
}

static PyMethodDef worker_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))worker_configure, METH_VARARGS | METH_KEYWORDS,
     "configure(agg_host, agg_port, job, rank, n, slot_base, slot_count, k, rto=0.05, rto_max=1.0, timeout=10.0, "
     "key=0)"},
    {"allreduce", (PyCFunction)(void (*)(void))worker_allreduce, METH_VARARGS | METH_KEYWORDS,
     "allreduce(buffer, kind, tag=0, bits=32, residual=None): in-place sum, GIL released; tag: the caller's digest "
     "of its own call, part of the call's identity; bits: 32, or 16/8 lanes for float32 (docs/PROTOCOL.md, Narrow "
     "lanes); residual: float32 of the buffer's length, added first and left holding this rank's rounding error."},
    {"abort", (PyCFunction)worker_abort, METH_VARARGS,
     "abort(total, kind, tag=0, bits=32): give up the next call after a local error; every peer fails that call too."},
    {"open_session", (PyCFunction)worker_open_session, METH_NOARGS,
     "Run the session's hello with every other rank now (the first allreduce runs it otherwise)."},
    {"stats", (PyCFunction)worker_stats, METH_NOARGS, "Packet counters of this worker."},
    {"cancel", (PyCFunction)worker_cancel, METH_VARARGS,
     "cancel(reason, cause=SwitchaggError): from any thread, end the call in progress (raising cause with the "
     "reason) and refuse later ones."},
    {"close", (PyCFunction)worker_close, METH_NOARGS, "Close the socket."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef worker_getset[] = {
    {"address", (getter)worker_address, NULL, "(ip, port) the socket sends from (after configure(), the real source address)", NULL},
    {"window", (getter)worker_window, NULL, "packets in flight at most (the job's slots, fewer if SO_RCVBUF is small)", NULL},
    {"rcvbuf", (getter)worker_rcvbuf, NULL, "the receive buffer the kernel granted, bytes", NULL},
    {"gso", (getter)worker_gso, NULL, "packets per UDP GSO send (0: one datagram per send; SWITCHAGG_GSO=0 or the kernel said no)", NULL},
    {"gro", (getter)worker_gro, NULL, "whether UDP GRO is on (results may arrive coalesced)", NULL},
    {"path_mtu", (getter)worker_path_mtu, NULL, "the route's MTU toward the aggregator, bytes (0: unknown or not configured)", NULL},
    {"rcvbuf_needed", (getter)worker_rcvbuf_needed, NULL, "the receive buffer the job's full window needs, bytes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyObject *worker_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Worker *self = (Worker *)type->tp_alloc(type, 0);
    if (self != NULL) self->w.fd = self->w.cancel_fd = -1;
    return (PyObject *)self;
}

static PyTypeObject WorkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "switchagg._core.Worker",
    .tp_basicsize = sizeof(Worker),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A worker endpoint: Worker(host, port) binds; configure() sets the job; allreduce() sums.",
    .tp_new = worker_new,
    .tp_init = (initproc)worker_init,
    .tp_dealloc = (destructor)worker_dealloc,
    .tp_methods = worker_methods,
    .tp_getset = worker_getset,
};

static PyObject *new_error(const char *name, const char *doc, PyObject *base, PyObject *also) {
    PyObject *bases = also ? PyTuple_Pack(2, base, also) : PyTuple_Pack(1, base);
    if (!bases) return NULL;
    PyObject *cls = PyErr_NewExceptionWithDoc(name, doc, bases, NULL);
    Py_DECREF(bases);
    return cls;
}

int sa_worker_register(PyObject *module) {
    SwitchaggError = PyErr_NewExceptionWithDoc("switchagg._core.SwitchaggError", "A switchagg operation failed.",
                                               PyExc_RuntimeError, NULL);
    if (!SwitchaggError) return -1;
    SwitchaggTimeout = new_error("switchagg._core.SwitchaggTimeout",
                                 "No progress within the call's timeout, and no peer known to be gone.",
                                 SwitchaggError, PyExc_TimeoutError);
    if (!SwitchaggTimeout) return -1;
    cause_class[SA_CAUSE_ERROR] = SwitchaggError;
    cause_class[SA_CAUSE_TIMEOUT] = SwitchaggTimeout;
    cause_class[SA_CAUSE_PEER_GONE] = new_error("switchagg._core.SwitchaggPeerGone",
                                                "A peer rank's process (or the aggregator) is gone.", SwitchaggError,
                                                NULL);
    cause_class[SA_CAUSE_MISMATCH] = new_error("switchagg._core.SwitchaggMismatch",
                                               "The ranks' calls differed (length, dtype, op, structure or order).",
                                               SwitchaggError, NULL);
    cause_class[SA_CAUSE_ABORTED] = new_error("switchagg._core.SwitchaggAborted",
                                              "A rank gave up its call after a local error.", SwitchaggError, NULL);
    cause_class[SA_CAUSE_TEARDOWN] = new_error("switchagg._core.SwitchaggTeardown",
                                               "The control plane ended the job.", SwitchaggError, NULL);
    static const char *names[SA_CAUSES] = {"SwitchaggError", "SwitchaggTimeout", "SwitchaggPeerGone",
                                           "SwitchaggMismatch", "SwitchaggAborted", "SwitchaggTeardown"};
    if (PyType_Ready(&WorkerType) < 0) return -1;
    for (int c = 0; c < SA_CAUSES; c++) {
        if (!cause_class[c]) return -1;
        Py_INCREF(cause_class[c]);
        if (PyModule_AddObject(module, names[c], cause_class[c]) < 0) return -1;
    }
    Py_INCREF(&WorkerType);
    if (PyModule_AddObject(module, "Worker", (PyObject *)&WorkerType) < 0) return -1;
    return 0;
}
