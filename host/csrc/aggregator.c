#include "common.h"

int sa_aggregator_register(PyObject *module) { return 0; }
