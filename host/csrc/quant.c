#include "common.h"

int sa_quant_register(PyObject *module) { return 0; }
