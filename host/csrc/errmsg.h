/* The engines' error convention: a function that refuses its arguments writes why into the
 * caller's buffer and returns -1 (the bindings raise it as ValueError). */
#ifndef SWITCHAGG_ERRMSG_H
#define SWITCHAGG_ERRMSG_H

#include <stdarg.h>
#include <stdio.h>

__attribute__((format(printf, 3, 4))) static inline int sa_fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return -1;
}

#endif
