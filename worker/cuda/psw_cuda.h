/* psw_cuda.h - the CUDA backend as a plugin.
 *
 * libpsw_cuda.so (worker/cuda/psw_backend_cuda.cu, built by nvcc when the
 * meson option `cuda` allows) links cudart and cuBLAS; pworker never does.
 * pworker loads the plugin with dlopen only when a GPU is asked for, so a
 * pworker built with CUDA starts and trains on CPU on a machine with no
 * NVIDIA driver or CUDA libraries at all. */
#ifndef PSW_CUDA_H
#define PSW_CUDA_H

#include <stddef.h>

#include "psw_backend.h"

#define PSW_CUDA_ABI 2
#define PSW_CUDA_SYMBOL "psw_cuda_plugin"

typedef struct {
    int abi; /* PSW_CUDA_ABI */
    /* Visible devices (after CUDA_VISIBLE_DEVICES). Any CUDA error (e.g. 35,
     * insufficient driver, on machines without a GPU) means no GPU: returns
     * -1 with what it means in err (no NVIDIA driver, a driver too old for
     * the runtime, no device; else the CUDA error). */
    int (*device_count)(char *err, size_t errlen);
    /* Name and memory of device dev, for logs. 0 or -1. */
    int (*device_name)(int dev, char *name, size_t n);
    /* A backend on device dev (cudaSetDevice, stream, cuBLAS handle). NULL
     * with a message on failure. The caller owns it (be->destroy(be)). */
    psw_backend_t *(*backend_new)(int dev, char *err, size_t errlen);
    /* A CUDA or cuBLAS failure inside an op ends the process (exit 1): hook
     * is called first, once, with the message the plugin printed, so that
     * the worker can tell psd (and close its connection, which sends it).
     * NULL: none. */
    void (*set_fatal_hook)(void (*hook)(const char *message, void *ctx), void *ctx);
} psw_cuda_plugin_t;

/* Exported by the plugin under PSW_CUDA_SYMBOL. */
typedef const psw_cuda_plugin_t *(*psw_cuda_plugin_fn)(void);

/* Load the plugin (worker/psw_plugin.c): $PSW_CUDA_PLUGIN if set, else
 * libpsw_cuda.so next to the executable, else in the install's plugin
 * directory. NULL with the reason (not built, dlopen error such as a missing
 * libcudart/libcublas, ABI mismatch) in err. Loaded once per process. */
const psw_cuda_plugin_t *psw_cuda_load(char *err, size_t errlen);

#endif
