/* The variadic exec calls (execl, execlp, execle): Rust cannot define a C-variadic function,
 * so these build the argument vector and call the library's own execv/execvp/execve, which
 * hand accelerated connections back to the kernel's TCP before the exec. The exported names
 * are naked jumps to these (see lib.rs): symbols of a C object are not exported from a Rust
 * cdylib. */
#include <errno.h>
#include <stdarg.h>
#include <stddef.h>
#include <unistd.h>

#define HIDDEN __attribute__((visibility("hidden")))

/* Counts the arguments after the first up to the terminating NULL (that one included). */
static size_t count(va_list ap)
{
    size_t n = 1;
    while (va_arg(ap, const char *) != NULL)
        n++;
    return n;
}

/* Declares `argv`, the NULL-terminated vector of `arg` and the variadic arguments after it,
 * and leaves `ap` started just past the NULL (execle's envp follows); returns -1 with E2BIG
 * from the enclosing function when there are too many. */
#define ARGV_FROM(arg, argv, ap)                       \
    va_list ap;                                        \
    va_start(ap, arg);                                 \
    size_t n_ = count(ap);                             \
    va_end(ap);                                        \
    if (n_ > 1u << 20) {                               \
        errno = E2BIG;                                 \
        return -1;                                     \
    }                                                  \
    const char *argv[n_ + 1];                          \
    argv[0] = arg;                                     \
    va_start(ap, arg);                                 \
    for (size_t i_ = 1; i_ <= n_; i_++)                \
        argv[i_] = va_arg(ap, const char *);

HIDDEN int bp_execl(const char *path, const char *arg, ...)
{
    ARGV_FROM(arg, argv, ap)
    va_end(ap);
    return execv(path, (char *const *)argv);
}

HIDDEN int bp_execlp(const char *file, const char *arg, ...)
{
    ARGV_FROM(arg, argv, ap)
    va_end(ap);
    return execvp(file, (char *const *)argv);
}

HIDDEN int bp_execle(const char *path, const char *arg, ...)
{
    ARGV_FROM(arg, argv, ap)
    char *const *envp = va_arg(ap, char *const *);
    va_end(ap);
    return execve(path, (char *const *)argv, envp);
}
