/* switchagg._core: the Python bindings of the engines (worker.h, aggregator.h, quant.h). */
#ifndef SWITCHAGG_BINDINGS_H
#define SWITCHAGG_BINDINGS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../protocol.h"

/* Registration hooks, one per binding, called from module.c. */
int sa_quant_register(PyObject *module);
int sa_worker_register(PyObject *module);
int sa_aggregator_register(PyObject *module);

#endif
