/* switchagg._core.Aggregator: the aggregator engine (aggregator.h) as a Python type; run() serves
 * with the GIL released. */
#include "bindings.h"

#include "../aggregator.h"
#include "../clock.h"

typedef struct {
    PyObject_HEAD struct sa_agg a;
} Aggregator;

static int Aggregator_init(Aggregator *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"host", "port", "drop_in", "dup_in", "drop_out", "dup_out", "seed", "threads", NULL};
    const char *host = "127.0.0.1";
    int port = 0, threads = 1;
    unsigned long long seed = 1;
    double p[4] = {0, 0, 0, 0};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|siddddKi", kwlist, &host, &port, &p[0], &p[1], &p[2], &p[3],
                                     &seed, &threads))
        return -1;
    if (self->a.th != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Aggregator is already initialised");
        return -1;
    }
    char err[256];
    int rc = sa_agg_open(&self->a, host, port, threads, p, seed, err, sizeof err);
    if (rc == SA_ERR_ARG) PyErr_SetString(PyExc_ValueError, err);
    if (rc == SA_ERR_SYS) PyErr_SetFromErrno(PyExc_OSError);
    if (rc == SA_ERR_BIND) { /* OSError(errno, message): .errno says why (EADDRINUSE, EADDRNOTAVAIL, ...) */
        PyObject *e = Py_BuildValue("(is)", errno, err);
        if (e != NULL) PyErr_SetObject(PyExc_OSError, e);
        Py_XDECREF(e);
    }
    return rc == SA_OK ? 0 : -1;
}

static PyObject *Aggregator_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    Aggregator *self = (Aggregator *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    sa_agg_init(&self->a);
    return (PyObject *)self;
}

static void Aggregator_dealloc(Aggregator *self) {
    sa_agg_free(&self->a);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_open(Aggregator *self) {
    if (!sa_agg_is_open(&self->a)) {
        PyErr_SetString(PyExc_RuntimeError, "Aggregator is closed or was not initialised");
        return -1;
    }
    return 0;
}

static int same_addr(const struct sockaddr_in *x, const struct sockaddr_in *y) {
    return x->sin_addr.s_addr == y->sin_addr.s_addr && x->sin_port == y->sin_port;
}

/* One (ip, port) tuple; `what` names it in errors. */
static int parse_addr(PyObject *item, const char *what, struct sockaddr_in *out) {
    const char *ip;
    int port;
    if (!PyTuple_Check(item) || !PyArg_ParseTuple(item, "si", &ip, &port)) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s must be an (ip: str, port: int) tuple, got %R", what, item);
        return -1;
    }
    memset(out, 0, sizeof *out);
    out->sin_family = AF_INET;
    if (port < 1 || port > 65535 || inet_pton(AF_INET, ip, &out->sin_addr) != 1) {
        PyErr_Format(PyExc_ValueError, "%s = %R is not an IPv4 address with a port in 1..65535", what, item);
        return -1;
    }
    out->sin_port = htons((uint16_t)port);
    if (out->sin_addr.s_addr == htonl(INADDR_ANY)) {
        PyErr_Format(PyExc_ValueError, "%s = %R: 0.0.0.0 is no source address; name the one it sends from", what,
                     item);
        return -1;
    }
    return 0;
}

/* addrs[r] = rank r's address; on a leaf (allow_none) None marks a rank behind another leaf. */
static int parse_addrs(PyObject *addrs, uint32_t n, int allow_none, struct sockaddr_in *out, uint32_t *mask) {
    PyObject *seq = PySequence_Fast(addrs, "addrs must be a list of (ip, port) tuples, one per rank");
    if (seq == NULL) return -1;
    if ((uint32_t)PySequence_Fast_GET_SIZE(seq) != n) {
        PyErr_Format(PyExc_ValueError, "addrs must name one (ip, port) per rank: %u expected, got %zd", n,
                     PySequence_Fast_GET_SIZE(seq));
        Py_DECREF(seq);
        return -1;
    }
    *mask = 0;
    for (uint32_t r = 0; r < n; r++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, r);
        memset(&out[r], 0, sizeof out[r]);
        if (item == Py_None && allow_none) continue;
        char what[32];
        snprintf(what, sizeof what, "addrs[%u]", r);
        if (parse_addr(item, what, &out[r]) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        for (uint32_t q = 0; q < r; q++) {
            if ((*mask >> q & 1) && same_addr(&out[q], &out[r])) { /* one socket, two ranks */
                PyErr_Format(PyExc_ValueError, "addrs[%u] and addrs[%u] are the same address %R", q, r, item);
                Py_DECREF(seq);
                return -1;
            }
        }
        *mask |= 1u << r;
    }
    Py_DECREF(seq);
    return 0;
}

static PyObject *Aggregator_add_job(Aggregator *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"job_id", "n", "slot_base", "slot_count", "k", "generation", "addrs",
                             "upstream", "leaf_index", "key", "loss_notices", NULL};
    long long job_id, n, base, count, k, gen, leaf_index = 0, key = 0;
    int loss_notices = 1;
    PyObject *addrs, *upstream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLLLLLO|OLLp", kwlist, &job_id, &n, &base, &count, &k, &gen,
                                     &addrs, &upstream, &leaf_index, &key, &loss_notices))
        return NULL;
    if (check_open(self) < 0) return NULL;
    /* Ranges the engine's unsigned fields cannot show; the engine checks the rest. */
    if (job_id < 0 || job_id >= SA_NJOB_IDS)
        return PyErr_Format(PyExc_ValueError, "job_id must be in 0..65535, got %lld", job_id);
    if (n < 1 || n > SA_MAX_WORKERS)
        return PyErr_Format(PyExc_ValueError, "n (workers) must be in 1..%d, got %lld", SA_MAX_WORKERS, n);
    if (k < 1 || k > SA_MAX_K) return PyErr_Format(PyExc_ValueError, "k must be in 1..%d, got %lld", SA_MAX_K, k);
    if (count < 1 || base < 0 || base + count > SA_NUM_SLOTS)
        return PyErr_Format(PyExc_ValueError, "slot range [%lld, %lld) must be non-empty and inside the pool 0..%d",
                            base, base + count, SA_NUM_SLOTS - 1);
    if (gen < 1 || gen > 65535)
        return PyErr_Format(PyExc_ValueError, "generation must be in 1..65535 (0 means never installed), got %lld",
                            gen);
    if (leaf_index < 0 || leaf_index >= SA_MAX_WORKERS)
        return PyErr_Format(PyExc_ValueError, "leaf_index (the leaf's rank at the spine) must be in 0..%d, got %lld",
                            SA_MAX_WORKERS - 1, leaf_index);
    if (key < 0 || key > 0xFFFFFFFFll)
        return PyErr_Format(PyExc_ValueError, "key must be a 32-bit unsigned number, got %lld", key);
    struct sa_job_spec spec = {
        .id = (uint16_t)job_id, .gen = (uint16_t)gen, .n = (uint32_t)n, .base = (uint32_t)base,
        .count = (uint32_t)count, .k = (uint32_t)k, .key = (uint32_t)key, .leaf = upstream != Py_None,
        .leaf_index = (uint16_t)leaf_index, .quiet = !loss_notices,
    };
    if ((spec.leaf && parse_addr(upstream, "upstream", &spec.upstream) < 0) ||
        parse_addrs(addrs, spec.n, spec.leaf, spec.addrs, &spec.local_mask) < 0)
        return NULL;
    char err[256];
    int rc = sa_agg_add_job(&self->a, &spec, err, sizeof err);
    if (rc == SA_ERR_ARG) return PyErr_Format(PyExc_ValueError, "%s", err);
    if (rc != SA_OK) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *Aggregator_remove_job(Aggregator *self, PyObject *args) {
    long long job_id;
    if (!PyArg_ParseTuple(args, "L", &job_id)) return NULL;
    if (check_open(self) < 0) return NULL;
    if (job_id < 0 || job_id >= SA_NJOB_IDS || sa_agg_remove_job(&self->a, (int)job_id) < 0)
        return PyErr_Format(PyExc_ValueError, "job %lld is not installed", job_id);
    Py_RETURN_NONE;
}

static int set_u64(PyObject *d, const char *key, uint64_t v) {
    PyObject *o = PyLong_FromUnsignedLongLong(v);
    if (o == NULL) return -1;
    int r = PyDict_SetItemString(d, key, o);
    Py_DECREF(o);
    return r;
}

static PyObject *Aggregator_counters(Aggregator *self, PyObject *unused) {
    if (check_open(self) < 0) return NULL;
    struct sa_agg_counters c;
    if (sa_agg_counters(&self->a, &c) < 0) return PyErr_NoMemory();
    PyObject *res = PyDict_New(), *d = PyDict_New(), *f = PyDict_New(), *js = PyDict_New();
    PyObject *ts = PyList_New(c.nthreads);
    if (!res || !d || !f || !js || !ts) goto fail;
    for (int i = 0; i < c.nthreads; i++) {
        const struct sa_thread_counters *t = &c.threads[i];
        PyObject *td = Py_BuildValue("{s:K,s:K,s:K,s:K,s:K}", "rx", (unsigned long long)t->rx, "tx",
                                     (unsigned long long)t->tx, "dropped", (unsigned long long)t->dropped,
                                     "aggregated", (unsigned long long)t->aggregated, "misrouted",
                                     (unsigned long long)t->misrouted);
        if (td == NULL) goto fail;
        PyList_SET_ITEM(ts, i, td);
    }
    if (set_u64(res, "rx", c.rx) < 0 || set_u64(res, "tx", c.tx) < 0) goto fail;
    if (set_u64(res, "rx_bytes", c.rx_bytes) < 0 || set_u64(res, "tx_bytes", c.tx_bytes) < 0) goto fail;
    if (set_u64(res, "gso_sends", c.gso_sends) < 0 || set_u64(res, "gro_receives", c.gro_receives) < 0) goto fail;
    if (set_u64(res, "status_resend", c.status_resend) < 0 || set_u64(res, "status_hold", c.status_hold) < 0)
        goto fail;
    for (int i = 0; i < SA_DROP_NREASONS; i++)
        if (set_u64(d, sa_drop_names[i], c.drops[i]) < 0) goto fail;
    for (int i = 0; i < SA_F_N; i++)
        if (set_u64(f, sa_fault_names[i], c.faults[i]) < 0) goto fail;
    for (size_t w = 0; w < c.njobs; w++) {
        PyObject *jd = PyDict_New(), *key = PyLong_FromLong(c.jobs[w].id);
        int bad = jd == NULL || key == NULL;
        for (int i = 0; i < (c.jobs[w].leaf ? SA_JOB_COUNTERS : 4) && !bad; i++)
            bad = set_u64(jd, sa_job_counter_names[i], c.jobs[w].c[i]) < 0;
        if (!bad) bad = PyDict_SetItem(js, key, jd) < 0;
        Py_XDECREF(jd);
        Py_XDECREF(key);
        if (bad) goto fail;
    }
    if (PyDict_SetItemString(res, "drops", d) < 0 || PyDict_SetItemString(res, "faults", f) < 0 ||
        PyDict_SetItemString(res, "jobs", js) < 0 || PyDict_SetItemString(res, "threads", ts) < 0)
        goto fail;
    Py_DECREF(d);
    Py_DECREF(f);
    Py_DECREF(js);
    Py_DECREF(ts);
    sa_agg_counters_free(&c);
    return res;
fail:
    Py_XDECREF(res);
    Py_XDECREF(d);
    Py_XDECREF(f);
    Py_XDECREF(js);
    Py_XDECREF(ts);
    sa_agg_counters_free(&c);
    return NULL;
}

/* Called by the engine every ~50 ms with the GIL released: take it, check for signals (Ctrl-C). */
static int check_signals(void *ts) {
    PyEval_RestoreThread((PyThreadState *)ts);
    int signalled = PyErr_CheckSignals() < 0;
    PyEval_SaveThread(); /* the same thread state, saved again */
    return signalled;
}

static PyObject *Aggregator_run(Aggregator *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|O", kwlist, &timeout_obj)) return NULL;
    if (check_open(self) < 0) return NULL;
    uint64_t deadline = UINT64_MAX;
    if (timeout_obj != Py_None) {
        double t = PyFloat_AsDouble(timeout_obj);
        if (t == -1.0 && PyErr_Occurred()) return NULL;
        if (!(t >= 0)) return PyErr_Format(PyExc_ValueError, "timeout must be None or >= 0, got %R", timeout_obj);
        if (t < 1e9) deadline = sa_now_ns() + (uint64_t)(t * 1e9); /* longer: as good as forever */
    }
    Py_INCREF(self); /* the object must outlive the GIL-free loop */
    PyThreadState *ts = PyEval_SaveThread();
    int rc = sa_agg_serve(&self->a, deadline, check_signals, ts);
    PyEval_RestoreThread(ts);
    Py_DECREF(self);
    if (rc == -1) {
        PyErr_SetString(PyExc_RuntimeError, "run() is already serving in another thread");
        return NULL;
    }
    if (rc == 1) return NULL; /* a signal handler raised */
    if (rc != 0) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *Aggregator_stop(Aggregator *self, PyObject *unused) {
    sa_agg_stop(&self->a);
    Py_RETURN_NONE;
}

static PyObject *Aggregator_close(Aggregator *self, PyObject *unused) {
    if (sa_agg_close(&self->a) < 0) {
        PyErr_SetString(PyExc_RuntimeError, "stop() the aggregator and wait for run() to return before close()");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Aggregator_get_port(Aggregator *self, void *closure) { return PyLong_FromLong(self->a.port); }
static PyObject *Aggregator_get_host(Aggregator *self, void *closure) { return PyUnicode_FromString(self->a.host); }
static PyObject *Aggregator_get_threads(Aggregator *self, void *closure) { return PyLong_FromLong(self->a.nthreads); }
static PyObject *Aggregator_get_running(Aggregator *self, void *closure) {
    return PyBool_FromLong(atomic_load(&self->a.running));
}

static PyMethodDef Aggregator_methods[] = {
    {"add_job", (PyCFunction)(void (*)(void))Aggregator_add_job, METH_VARARGS | METH_KEYWORDS,
     "add_job(job_id, n, slot_base, slot_count, k, generation, addrs, upstream=None, leaf_index=0, key=0): "
     "install a job; addrs[r] = (ip, port) of rank r; key: the 32-bit result key every RESULT carries. With "
     "upstream = the spine's (ip, port) the job is aggregated here as leaf leaf_index: addrs[r] is None for "
     "ranks behind other leaves."},
    {"remove_job", (PyCFunction)Aggregator_remove_job, METH_VARARGS, "remove_job(job_id): uninstall a job."},
    {"counters", (PyCFunction)Aggregator_counters, METH_NOARGS,
     "Counters as a dict (see docs/PROTOCOL.md), summed over the threads; 'threads': each thread's own."},
    {"run", (PyCFunction)(void (*)(void))Aggregator_run, METH_VARARGS | METH_KEYWORDS,
     "run(timeout=None): serve until stop() or the timeout, GIL released."},
    {"stop", (PyCFunction)Aggregator_stop, METH_NOARGS, "Ask run() to return (within ~50 ms)."},
    {"close", (PyCFunction)Aggregator_close, METH_NOARGS, "Close the sockets."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Aggregator_getset[] = {
    {"port", (getter)Aggregator_get_port, NULL, "The bound UDP port.", NULL},
    {"host", (getter)Aggregator_get_host, NULL, "The bound IPv4 address.", NULL},
    {"running", (getter)Aggregator_get_running, NULL, "Whether run() is serving.", NULL},
    {"threads", (getter)Aggregator_get_threads, NULL, "Serving threads (and sockets on the port).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject AggregatorType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "switchagg._core.Aggregator",
    .tp_basicsize = sizeof(Aggregator),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Aggregator(host='127.0.0.1', port=0, drop_in=0.0, dup_in=0.0, drop_out=0.0, dup_out=0.0, "
              "seed=1, threads=1)\n"
              "The software aggregator of docs/PROTOCOL.md on one UDP port; run() serves it with `threads` "
              "threads, each owning the slots congruent to its index.",
    .tp_new = Aggregator_new,
    .tp_init = (initproc)Aggregator_init,
    .tp_dealloc = (destructor)Aggregator_dealloc,
    .tp_methods = Aggregator_methods,
    .tp_getset = Aggregator_getset,
};

int sa_aggregator_register(PyObject *module) {
    if (PyType_Ready(&AggregatorType) < 0) return -1;
    Py_INCREF(&AggregatorType);
    if (PyModule_AddObject(module, "Aggregator", (PyObject *)&AggregatorType) < 0) {
        Py_DECREF(&AggregatorType);
        return -1;
    }
    return 0;
}
