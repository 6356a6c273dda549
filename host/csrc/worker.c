#include "common.h"

int sa_worker_register(PyObject *module) { return 0; }
