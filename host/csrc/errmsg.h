/* The engines' error convention: a function that refuses its arguments writes why into the
 * caller's buffer and returns SA_ERR_ARG (the bindings raise it as ValueError); one that a system
 * call failed returns SA_ERR_SYS with errno set (OSError); SA_ERR_BIND: the address to bind is taken
 * or not ours, why in the buffer and errno set (OSError with the message). */
#ifndef SWITCHAGG_ERRMSG_H
#define SWITCHAGG_ERRMSG_H

#include <stdarg.h>
#include <stdio.h>

enum sa_rc { SA_OK = 0, SA_ERR_ARG = -1, SA_ERR_SYS = -2, SA_ERR_BIND = -3 };

__attribute__((format(printf, 3, 4))) static inline int sa_fail(char *err, size_t errlen, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
    return SA_ERR_ARG;
}

#endif
