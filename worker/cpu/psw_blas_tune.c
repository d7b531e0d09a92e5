/* psw_blas_tune.c - make OpenBLAS use the kernels the CPU can run.
 *
 * Debian's OpenBLAS (0.3.21, DYNAMIC_ARCH) picks its kernels from the CPU
 * model. CPUs it does not know (Sapphire Rapids, or a VM that hides the
 * model, as on our build machines: "Intel(R) Xeon(R) Processor") get the
 * generic Prescott kernels, 2-4x slower than Haswell/SkylakeX ones. The
 * choice is made when the library loads, before main, and can only be
 * changed with OPENBLAS_CORETYPE in the environment; so when the chosen core
 * is generic but the CPU has AVX2/AVX-512, set it and re-exec once. A user
 * who sets OPENBLAS_CORETYPE keeps their choice. */
#include "psw_backend.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

char *openblas_get_corename(void);

static const char *best_core(void)
{
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
        return "SkylakeX";
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
#endif
    return NULL;
}

void psw_blas_tune(char **argv)
{
    if (getenv("OPENBLAS_CORETYPE")) return;
    const char *core = openblas_get_corename();
    static const char *generic[] = {"Prescott", "Core2", "Penryn", "Dunnington", "Nehalem", "Atom",
                                    "Katmai", "Coppermine", "Northwood", "Banias", "Unknown"};
    int is_generic = 0;
    for (size_t i = 0; i < sizeof generic / sizeof generic[0]; i++)
        is_generic |= core && strcmp(core, generic[i]) == 0;
    const char *best = best_core();
    if (!is_generic || !best) return;
    setenv("OPENBLAS_CORETYPE", best, 1);
    execv("/proc/self/exe", argv);
    /* exec failed: carry on with the generic kernels */
}

const char *psw_blas_core(void)
{
    const char *c = openblas_get_corename();
    return c ? c : "unknown";
}
