/* fuzz_util.h - helpers shared by the libFuzzer harnesses (tests/fuzz/).
 *
 * The parsers under test read files by path, so the harnesses keep one
 * scratch file per process (a memfd, reached through /proc/self/fd/N, or a
 * /tmp file if memfd_create is unavailable) and rewrite it every iteration. */
#ifndef FUZZ_UTIL_H
#define FUZZ_UTIL_H

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>
#include <zlib.h>

#define FUZZ_DIE(...)                      \
    do {                                   \
        fprintf(stderr, "fuzz: " __VA_ARGS__); \
        fputc('\n', stderr);               \
        abort();                           \
    } while (0)

/* Write all of buf to fd at offset 0 and cut the file there. */
static inline void fuzz_rewrite_fd(int fd, const uint8_t *buf, size_t n)
{
    if (ftruncate(fd, 0) != 0) FUZZ_DIE("ftruncate: %s", strerror(errno));
    size_t off = 0;
    while (off < n) {
        ssize_t w = pwrite(fd, buf + off, n - off, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) FUZZ_DIE("pwrite: %s", strerror(errno));
        off += (size_t)w;
    }
}

/* Write buf to path (created or truncated). */
static inline void fuzz_write_file(const char *path, const uint8_t *buf, size_t n)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) FUZZ_DIE("open %s: %s", path, strerror(errno));
    fuzz_rewrite_fd(fd, buf, n);
    close(fd);
}

/* The per-process scratch file: its path, created on first use. */
typedef struct {
    int fd;
    char path[64];
} fuzz_scratch_t;

static fuzz_scratch_t fuzz_scratch_ = {.fd = -1};

static void fuzz_scratch_cleanup_(void)
{
    if (fuzz_scratch_.fd >= 0 && strncmp(fuzz_scratch_.path, "/tmp/", 5) == 0)
        unlink(fuzz_scratch_.path);
}

static inline const char *fuzz_scratch_path(const char *tag)
{
    if (fuzz_scratch_.fd < 0) {
        int fd = memfd_create(tag, MFD_CLOEXEC);
        if (fd >= 0) {
            snprintf(fuzz_scratch_.path, sizeof fuzz_scratch_.path, "/proc/self/fd/%d", fd);
        } else {
            snprintf(fuzz_scratch_.path, sizeof fuzz_scratch_.path, "/tmp/psd-%s-%ld", tag,
                     (long)getpid());
            fd = open(fuzz_scratch_.path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
            if (fd < 0) FUZZ_DIE("open %s: %s", fuzz_scratch_.path, strerror(errno));
            atexit(fuzz_scratch_cleanup_);
        }
        fuzz_scratch_.fd = fd;
    }
    return fuzz_scratch_.path;
}

/* Rewrite the scratch file with buf; returns its path. */
static inline const char *fuzz_scratch_write(const char *tag, const uint8_t *buf, size_t n)
{
    const char *p = fuzz_scratch_path(tag);
    fuzz_rewrite_fd(fuzz_scratch_.fd, buf, n);
    return p;
}

static inline void fuzz_put_u32le(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static inline void fuzz_put_u64le(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Read every byte of [p, p+n) so that ASan checks the whole range. */
static inline void fuzz_touch(const void *p, size_t n)
{
    const volatile uint8_t *b = p;
    uint8_t x = 0;
    for (size_t i = 0; i < n; i++) x ^= b[i];
    (void)x;
}

#endif
