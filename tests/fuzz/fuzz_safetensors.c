/* fuzz_safetensors - the safetensors reader (common/ps_safetensors.c).
 *
 * The input is parsed from memory (ps_st_parse, the file being exactly the
 * input) and loaded from a scratch file (ps_st_load), and, so that the
 * fuzzer gets past the length prefix to the JSON, once more with its first
 * 8 bytes replaced by the length of the rest up to its first NUL or its
 * end. On success every tensor lies inside the data, the data is covered
 * exactly, and every value read is touched. Seeds (corpus/fuzz_safetensors):
 * files as PyTorch's writer lays them out (F32, F16, BF16, metadata, a
 * scalar, an escaped name, an F64 one refused), written once by hand. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "ps_safetensors.h"

static void check(const ps_st_file_t *f, uint64_t size)
{
    uint64_t at = 0;
    for (size_t i = 0; i < f->n; i++) {
        if (f->t[i].begin != at || f->t[i].end < f->t[i].begin) FUZZ_DIE("tensor %zu not where the last ended", i);
        if (!memchr(f->t[i].name, '\0', sizeof f->t[i].name) || !f->t[i].name[0]) FUZZ_DIE("a bad name");
        at = f->t[i].end;
    }
    if (at != f->data_len || f->data_off + f->data_len != size) FUZZ_DIE("the data not covered exactly");
}

static void one(const uint8_t *data, size_t size)
{
    ps_st_file_t f;
    char err[512];
    if (ps_st_parse(data, size, size, &f, err, sizeof err) == 0) {
        check(&f, size);
        float *v = malloc(64 * sizeof *v);
        for (size_t i = 0; v && i < f.n; i++) /* at most 64 values of each: enough to reach every branch */
            if (f.t[i].numel <= 64) ps_st_to_f32(&f.t[i], data + f.data_off + f.t[i].begin, v);
        free(v);
        ps_st_free(&f);
    } else if (!memchr(err, '\0', sizeof err) || !err[0] || f.n || f.t) {
        FUZZ_DIE("failure without a message, or with a tensor list left");
    }
    float *vals = (float *)(uintptr_t)1;
    if (ps_st_load(fuzz_scratch_write("fuzz-st", data, size), &f, &vals, err, sizeof err) == 0) {
        check(&f, size);
        uint64_t total = 0;
        for (size_t i = 0; i < f.n; i++) total += f.t[i].numel;
        fuzz_touch(vals, total * sizeof *vals);
        free(vals);
        ps_st_free(&f);
    } else if (vals || !err[0]) {
        FUZZ_DIE("load failure with values left or without a message");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    one(data, size);
    if (size > 8) {
        uint8_t *fixed = malloc(size);
        if (!fixed) return 0;
        memcpy(fixed, data, size);
        const uint8_t *nul = memchr(data + 8, '\0', size - 8);
        uint64_t n = nul ? (uint64_t)(nul - (data + 8)) : size - 8;
        memcpy(fixed, &n, 8);
        one(fixed, size);
        free(fixed);
    }
    return 0;
}
