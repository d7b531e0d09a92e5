/* fuzz_weights - the trained-weights file reader (common/ps_weights.c).
 *
 * The input is written to a scratch file (memfd) and loaded twice: as is,
 * and with its last 4 bytes replaced by the CRC-32 of the rest, so that the
 * fuzzer gets past the checksum to the layout checks (format 3: the packed
 * tensor table, ps_table_unpack). On success every float of the arena is
 * read. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "fuzz_util.h"
#include "ps_weights.h"

static void load(const char *path)
{
    ps_layout_t l;
    float *params = (float *)(uintptr_t)1; /* must be reset by the loader */
    ps_weights_meta_t meta;
    char err[512];
    if (ps_weights_load(path, &l, &params, &meta, err, sizeof err) == 0) {
        if (!params) FUZZ_DIE("success without an arena");
        /* a built-in MLP (formats 1, 2), or any table (format 3) */
        if ((l.n_sizes != 0 && (l.n_sizes < 2 || l.n_sizes > PS_MAX_LAYERS + 1)) || l.n_tensors < 1 ||
            l.n_tensors > PS_MAX_TENSORS || l.n_params < l.t[l.n_tensors - 1].offset + l.t[l.n_tensors - 1].numel)
            FUZZ_DIE("bad layout after success");
        fuzz_touch(params, l.n_params * sizeof *params);
        free(params);
        ps_layout_free(&l);
    } else {
        if (params) FUZZ_DIE("arena left after failure");
        if (!memchr(err, '\0', sizeof err) || !err[0]) FUZZ_DIE("failure without a message");
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    load(fuzz_scratch_write("fuzz-weights", data, size));
    if (size >= 4) {
        uint8_t *fixed = malloc(size);
        if (!fixed) return 0;
        memcpy(fixed, data, size);
        fuzz_put_u32le(fixed + size - 4, (uint32_t)crc32(0L, fixed, (uInt)(size - 4)));
        load(fuzz_scratch_write("fuzz-weights", fixed, size));
        free(fixed);
    }
    return 0;
}
