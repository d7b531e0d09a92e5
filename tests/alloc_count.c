/* alloc_count.so - LD_PRELOAD'ed into psd by the allocation test: counts
 * malloc/calloc/realloc/aligned allocations by the object file of the
 * immediate caller (psd's own code = the executable; libprotobuf-c; libzmq,
 * with libstdc++'s operator new, which only libzmq uses in psd; the rest),
 * and writes the counts to $ALLOC_COUNT_OUT at exit:
 *   exe N
 *   protobuf-c N
 *   zmq N
 *   other N
 * Not for sanitizer builds (they replace malloc themselves). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <link.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);
extern void *__libc_memalign(size_t, size_t);

enum { C_EXE, C_PBC, C_ZMQ, C_OTHER, C_N };
static const char *cname[C_N] = {"exe", "protobuf-c", "zmq", "other"};
static _Atomic uint64_t count[C_N];

#define MAX_RANGES 64
static struct {
    uintptr_t lo, hi;
    int cat;
} range[MAX_RANGES];
static int n_range;
static _Atomic int ready;

static int add_object(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    (void)data;
    const char *name = info->dlpi_name;
    int cat = C_OTHER;
    if (!name || !name[0]) cat = C_EXE; /* the main program */
    else if (strstr(name, "libprotobuf-c")) cat = C_PBC;
    else if (strstr(name, "libzmq") || strstr(name, "libstdc++")) cat = C_ZMQ;
    else return 0;
    for (int i = 0; i < info->dlpi_phnum && n_range < MAX_RANGES; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        if (ph->p_type != PT_LOAD || !(ph->p_flags & PF_X)) continue;
        range[n_range].lo = info->dlpi_addr + ph->p_vaddr;
        range[n_range].hi = range[n_range].lo + ph->p_memsz;
        range[n_range].cat = cat;
        n_range++;
    }
    return 0;
}

static void note(const void *caller)
{
    if (!atomic_load_explicit(&ready, memory_order_acquire)) return;
    uintptr_t a = (uintptr_t)caller;
    int cat = C_OTHER;
    for (int i = 0; i < n_range; i++)
        if (a >= range[i].lo && a < range[i].hi) {
            cat = range[i].cat;
            break;
        }
    atomic_fetch_add_explicit(&count[cat], 1, memory_order_relaxed);
}

__attribute__((constructor)) static void start(void)
{
    dl_iterate_phdr(add_object, NULL);
    atomic_store_explicit(&ready, 1, memory_order_release);
}

__attribute__((destructor)) static void stop(void)
{
    const char *out = getenv("ALLOC_COUNT_OUT");
    if (!out) return;
    atomic_store(&ready, 0);
    FILE *f = fopen(out, "w");
    if (!f) return;
    for (int i = 0; i < C_N; i++) fprintf(f, "%s %llu\n", cname[i], (unsigned long long)atomic_load(&count[i]));
    fclose(f);
}

void *malloc(size_t n)
{
    note(__builtin_return_address(0));
    return __libc_malloc(n);
}

void *calloc(size_t k, size_t n)
{
    note(__builtin_return_address(0));
    return __libc_calloc(k, n);
}

void *realloc(void *p, size_t n)
{
    note(__builtin_return_address(0));
    return __libc_realloc(p, n);
}

int posix_memalign(void **p, size_t align, size_t n)
{
    note(__builtin_return_address(0));
    void *q = __libc_memalign(align, n);
    if (!q) return 12; /* ENOMEM */
    *p = q;
    return 0;
}

void *aligned_alloc(size_t align, size_t n)
{
    note(__builtin_return_address(0));
    return __libc_memalign(align, n);
}
