/* fuzz_ckpt - the checkpoint loader (server/psd_ckpt.c).
 *
 * A scratch directory is created once (in /dev/shm, else /tmp). Each input
 * is written as DIR/ckpt-000000000001.psdc, and a copy with a consistent
 * trailer (length field and CRC-32 recomputed, so that the fuzzer gets past
 * the checksum) as the older DIR/ckpt-000000000000.psdc. psd_ckpt_load_newest tries the
 * input first and falls back to the fixed copy; its log lines are dropped.
 * On success every byte of the loaded buffers is read, then freed. */
#include <dirent.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>

#include "fuzz_util.h"
#include "psd_ckpt.h"

#define TRAILER 12

static char g_dir[64];
static char g_newest[128], g_fixed[128];

static void cleanup(void)
{
    unlink(g_newest);
    unlink(g_fixed);
    DIR *d = opendir(g_dir);
    if (d) {
        struct dirent *e;
        while ((e = readdir(d)) != NULL)
            if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..")) unlinkat(dirfd(d), e->d_name, 0);
        closedir(d);
    }
    rmdir(g_dir);
}

static void drop_line(const char *line) { (void)line; }

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!g_dir[0]) {
        /* tmpfs if there is one: rewriting files on a disk file system
         * (ext4's replace-by-truncate flush) costs more than the parsing */
        snprintf(g_dir, sizeof g_dir, "/dev/shm/psd-fuzz-ckpt-XXXXXX");
        if (!mkdtemp(g_dir)) {
            snprintf(g_dir, sizeof g_dir, "/tmp/psd-fuzz-ckpt-XXXXXX");
            if (!mkdtemp(g_dir)) FUZZ_DIE("mkdtemp: %s", strerror(errno));
        }
        snprintf(g_newest, sizeof g_newest, "%s/ckpt-000000000001.psdc", g_dir);
        snprintf(g_fixed, sizeof g_fixed, "%s/ckpt-000000000000.psdc", g_dir);
        atexit(cleanup);
    }
    fuzz_write_file(g_newest, data, size);
    if (size >= TRAILER) {
        uint8_t *fixed = malloc(size);
        if (!fixed) return 0;
        memcpy(fixed, data, size);
        fuzz_put_u64le(fixed + size - TRAILER, (uint64_t)(size - TRAILER));
        fuzz_put_u32le(fixed + size - 4, (uint32_t)crc32(0L, fixed, (uInt)(size - 4)));
        fuzz_write_file(g_fixed, fixed, size);
        free(fixed);
    } else {
        unlink(g_fixed);
    }

    psd_ckpt_meta_t meta;
    uint8_t *seen = (uint8_t *)(uintptr_t)1;
    float *weights = (float *)(uintptr_t)1, *slots[2] = {NULL, NULL};
    char path[PATH_MAX], err[512];
    if (psd_ckpt_load_newest(g_dir, 0, &meta, &seen, &weights, slots, path, sizeof path, drop_line, err,
                             sizeof err) == 0) {
        if (!seen || !weights || meta.n_slots > 2) FUZZ_DIE("bad result after success");
        fuzz_touch(seen, (size_t)((meta.train_count + 7) / 8));
        fuzz_touch(weights, meta.n_params * sizeof(float));
        for (uint32_t s = 0; s < 2; s++) {
            if ((s < meta.n_slots) != (slots[s] != NULL)) FUZZ_DIE("slot %u presence", s);
            if (slots[s]) fuzz_touch(slots[s], meta.n_params * sizeof(float));
        }
        free(seen);
        free(weights);
        free(slots[0]);
        free(slots[1]);
    } else {
        if (!memchr(err, '\0', sizeof err) || !err[0]) FUZZ_DIE("failure without a message");
    }
    return 0;
}
