/* fuzz_idx - the IDX reader, raw or gzipped (common/ps_idx.c).
 *
 * The input is written to a scratch file (memfd) and loaded with
 * expect_ndim 0, 1 and 3. On success the result must be consistent with
 * the header and every data byte is read. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "fuzz_util.h"
#include "ps_idx.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static const int expect[] = {0, 1, 3};
    const char *path = fuzz_scratch_write("fuzz-idx", data, size);
    for (size_t k = 0; k < sizeof expect / sizeof expect[0]; k++) {
        ps_idx_t idx;
        char err[512];
        memset(&idx, 0xa5, sizeof idx); /* the loader must initialise it */
        if (ps_idx_load(&idx, path, expect[k], err, sizeof err) == 0) {
            if (!idx.data || idx.ndim < 1 || idx.ndim > PS_IDX_MAX_DIMS ||
                (expect[k] && idx.ndim != expect[k]) || idx.count != idx.dims[0])
                FUZZ_DIE("inconsistent ps_idx_t after success");
            size_t item = 1;
            for (int i = 1; i < idx.ndim; i++) item *= idx.dims[i];
            if (item != idx.item) FUZZ_DIE("item size %zu, dims say %zu", idx.item, item);
            fuzz_touch(idx.data, idx.count * idx.item);
        } else {
            if (idx.data) FUZZ_DIE("data left after failure");
            if (!memchr(err, '\0', sizeof err) || !err[0]) FUZZ_DIE("failure without a message");
        }
        ps_idx_deinit(&idx);
        ps_idx_deinit(&idx); /* documented as safe */
    }
    return 0;
}
