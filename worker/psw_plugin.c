/* psw_plugin.c - find and load the CUDA backend plugin (see cuda/psw_cuda.h). */
#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cuda/psw_cuda.h"

#ifndef PSW_PLUGIN_DIR
#define PSW_PLUGIN_DIR ""
#endif

static const psw_cuda_plugin_t *loaded;

static void *try_open(const char *path, char *err, size_t errlen)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        snprintf(err, errlen, "%s", e ? e : path);
    }
    return h;
}

const psw_cuda_plugin_t *psw_cuda_load(char *err, size_t errlen)
{
    if (loaded) return loaded;
    char paths[3][PATH_MAX];
    int n = 0;
    const char *env = getenv("PSW_CUDA_PLUGIN");
    if (env && env[0]) snprintf(paths[n++], PATH_MAX, "%s", env);
    else {
        char exe[PATH_MAX];
        ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
        if (len > 0) {
            exe[len] = '\0';
            snprintf(paths[n++], PATH_MAX, "%s/libpsw_cuda.so", dirname(exe));
        }
        if (PSW_PLUGIN_DIR[0]) snprintf(paths[n++], PATH_MAX, "%s/libpsw_cuda.so", PSW_PLUGIN_DIR);
    }
    void *h = NULL;
    char why[512] = "the CUDA backend was not built (meson option cuda)";
    for (int i = 0; i < n && !h; i++) {
        if (access(paths[i], F_OK) != 0) continue;
        h = try_open(paths[i], why, sizeof why);
    }
    if (!h) {
        snprintf(err, errlen, "no CUDA backend: %s", why);
        return NULL;
    }
    void *sym = dlsym(h, PSW_CUDA_SYMBOL);
    psw_cuda_plugin_fn fn = NULL;
    memcpy(&fn, &sym, sizeof fn); /* POSIX: dlsym results convert to function pointers */
    const psw_cuda_plugin_t *p = fn ? fn() : NULL;
    if (!p || p->abi != PSW_CUDA_ABI) {
        snprintf(err, errlen, "CUDA backend plugin has another interface (ABI %d, want %d)", p ? p->abi : -1,
                 PSW_CUDA_ABI);
        dlclose(h);
        return NULL;
    }
    loaded = p; /* stays loaded for the life of the process */
    return p;
}
