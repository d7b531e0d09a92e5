/* ps_idx.c - IDX file reader (the MNIST format), gzipped or raw, via zlib.
 *
 * gzopen/gzread read gzip or plain files transparently. A short gzread is
 * not necessarily EOF: a truncated gzip stream returns the bytes it has and
 * leaves Z_BUF_ERROR in gzerror, a corrupt one returns -1 or fails its CRC
 * check only when the trailer is read. So every short read is checked with
 * gzerror, and the trailing-bytes probe doubles as the CRC check. */
#include "ps_idx.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

#include "ps_assert.h"

#define IDX_TYPE_U8 0x08
#define IDX_MAX_BYTES ((size_t)1 << 30) /* 1 GiB of data at most */
#define IDX_READ_CHUNK ((size_t)1 << 30) /* gzread takes an unsigned, returns an int */

#define set_err ps_set_err

/* Read up to n bytes; fewer only at the end of the data. Returns the number
 * read, or -1 on a read or decompression error with a message in err. */
static long long read_full(gzFile gz, void *buf, size_t n, const char *path, char *err,
                           size_t errlen)
{
    unsigned char *p = buf;
    size_t got = 0;
    while (got < n) {
        size_t want = n - got < IDX_READ_CHUNK ? n - got : IDX_READ_CHUNK;
        int r = gzread(gz, p + got, (unsigned)want);
        if (r > 0) got += (size_t)r;
        if ((size_t)(r > 0 ? r : 0) < want) {
            /* short read: EOF, or an error gzread only reports via gzerror */
            int zerr = Z_OK;
            const char *msg = gzerror(gz, &zerr);
            if (r < 0 || zerr != Z_OK) {
                /* zlib formats its message as "<path>: <what>"; keep <what> */
                size_t plen = strlen(path);
                if (msg && !strncmp(msg, path, plen) && !strncmp(msg + plen, ": ", 2))
                    msg += plen + 2;
                if (zerr == Z_ERRNO)
                    set_err(err, errlen, "%s: read error: %s", path, strerror(errno));
                else
                    set_err(err, errlen, "%s: corrupt gzip stream: %s", path,
                            msg && *msg ? msg : "unknown zlib error");
                return -1;
            }
            break;
        }
    }
    return (long long)got;
}

static uint32_t be32(const unsigned char *b)
{
    return (uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | (uint32_t)b[3];
}

int ps_idx_load(ps_idx_t *out, const char *path, int expect_ndim, char *err, size_t errlen)
{
    int rc = -1;
    gzFile gz = NULL;
    uint8_t *data = NULL;
    unsigned char hdr[4 + 4 * PS_IDX_MAX_DIMS];
    uint32_t dims[PS_IDX_MAX_DIMS] = {0};
    size_t total = 1;
    unsigned char extra;
    long long r;
    int ndim, zrc;

    if (!out || !path) {
        set_err(err, errlen, "ps_idx_load: NULL %s", out ? "path" : "output");
        return -1;
    }
    memset(out, 0, sizeof *out);
    if (expect_ndim < 0 || expect_ndim > PS_IDX_MAX_DIMS) {
        set_err(err, errlen, "%s: bad expected number of dimensions %d", path, expect_ndim);
        return -1;
    }

    errno = 0;
    gz = gzopen(path, "rb");
    if (!gz) {
        /* errno 0 means zlib could not allocate its state */
        set_err(err, errlen, "%s: cannot open: %s", path,
                errno ? strerror(errno) : "out of memory");
        goto out;
    }
    gzbuffer(gz, 1u << 17);

    r = read_full(gz, hdr, 4, path, err, errlen);
    if (r < 0) goto out;
    if (r < 4) {
        set_err(err, errlen, "%s: truncated header (%lld of 4 bytes)", path, r);
        goto out;
    }
    if (hdr[0] != 0 || hdr[1] != 0) {
        set_err(err, errlen, "%s: bad magic %02x %02x (not an IDX file)", path, hdr[0], hdr[1]);
        goto out;
    }
    if (hdr[2] != IDX_TYPE_U8) {
        set_err(err, errlen, "%s: unsupported data type 0x%02x (only 0x08, unsigned byte)",
                path, hdr[2]);
        goto out;
    }
    ndim = hdr[3];
    if (ndim < 1 || ndim > PS_IDX_MAX_DIMS) {
        set_err(err, errlen, "%s: %d dimensions, supported 1..%d", path, ndim,
                PS_IDX_MAX_DIMS);
        goto out;
    }
    if (expect_ndim != 0 && ndim != expect_ndim) {
        set_err(err, errlen, "%s: %d dimension%s, expected %d", path, ndim, ndim == 1 ? "" : "s",
                expect_ndim);
        goto out;
    }

    r = read_full(gz, hdr + 4, 4 * (size_t)ndim, path, err, errlen);
    if (r < 0) goto out;
    if (r < 4 * ndim) {
        set_err(err, errlen, "%s: truncated header (%lld of %d dimension bytes)", path, r,
                4 * ndim);
        goto out;
    }

    /* Size check before any allocation: each step keeps total <= 1 GiB, so
     * the product can neither overflow nor get near it. */
    for (int i = 0; i < ndim; i++) {
        dims[i] = be32(hdr + 4 + 4 * i);
        if (dims[i] == 0) {
            set_err(err, errlen, "%s: dimension %d is zero", path, i);
            goto out;
        }
    }
    for (int i = 0; i < ndim; i++) {
        if (dims[i] > IDX_MAX_BYTES / total) {
            set_err(err, errlen, "%s: data too large (dimensions exceed 1 GiB)", path);
            goto out;
        }
        total *= dims[i];
    }

    data = malloc(total);
    if (!data) {
        set_err(err, errlen, "%s: out of memory for %zu bytes", path, total);
        goto out;
    }
    r = read_full(gz, data, total, path, err, errlen);
    if (r < 0) goto out;
    if ((size_t)r < total) {
        set_err(err, errlen, "%s: truncated data (%lld of %zu bytes)", path, r, total);
        goto out;
    }
    /* Probe for trailing bytes; for gzip this also reads and checks the
     * trailer (CRC and length). */
    r = read_full(gz, &extra, 1, path, err, errlen);
    if (r < 0) goto out;
    if (r > 0) {
        set_err(err, errlen, "%s: trailing bytes after %zu bytes of data", path, total);
        goto out;
    }

    zrc = gzclose(gz);
    gz = NULL;
    if (zrc != Z_OK) {
        set_err(err, errlen, "%s: close failed: %s", path,
                zrc == Z_ERRNO ? strerror(errno) : zError(zrc));
        goto out;
    }

    out->ndim = ndim;
    memcpy(out->dims, dims, sizeof out->dims);
    out->count = dims[0];
    out->item = total / dims[0];
    out->data = data;
    data = NULL;
    rc = 0;
out:
    if (gz) {
        int saved = errno;
        gzclose(gz);
        errno = saved;
    }
    free(data);
    return rc;
}

void ps_idx_deinit(ps_idx_t *idx)
{
    if (!idx) return;
    free(idx->data);
    memset(idx, 0, sizeof *idx);
}
