/* ps_safetensors.c - reading and writing safetensors files
 * (ps_safetensors.h). The header's JSON is parsed by a small strict parser
 * of exactly what the format allows: an object of tensor entries and one
 * "__metadata__" object of strings. */
#include "ps_safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps_util.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "ps_safetensors.c reads little-endian data as it is: a big-endian host needs byte swaps"
#endif

typedef struct {
    const char *p, *end;
    char *err;
    size_t errlen;
} js_t;

static int fail(js_t *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(js_t *j, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(j->err, j->errlen, fmt, ap);
    va_end(ap);
    return -1;
}

static void ws(js_t *j)
{
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

static int expect(js_t *j, char c)
{
    ws(j);
    if (j->p >= j->end || *j->p != c) return fail(j, "the header is not the JSON safetensors has: '%c' expected", c);
    j->p++;
    return 0;
}

static void put_utf8(char *out, size_t *n, uint32_t cp)
{
    if (cp < 0x80) {
        out[(*n)++] = (char)cp;
    } else if (cp < 0x800) {
        out[(*n)++] = (char)(0xC0 | (cp >> 6));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out[(*n)++] = (char)(0xE0 | (cp >> 12));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        out[(*n)++] = (char)(0xF0 | (cp >> 18));
        out[(*n)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[(*n)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*n)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static int hex4(js_t *j, uint32_t *v)
{
    if (j->end - j->p < 4) return fail(j, "a \\u escape in the header is cut short");
    *v = 0;
    for (int i = 0; i < 4; i++) {
        char c = *j->p++;
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return fail(j, "a \\u escape in the header is not 4 hex digits");
        *v = *v << 4 | (uint32_t)d;
    }
    return 0;
}

/* A JSON string into out (cap bytes: at most cap - 1 and a NUL; no NUL
 * inside). */
static int string(js_t *j, char *out, size_t cap, const char *what)
{
    if (expect(j, '"') != 0) return -1;
    size_t n = 0;
    while (j->p < j->end && *j->p != '"') {
        unsigned char c = (unsigned char)*j->p++;
        uint32_t cp = c;
        if (c < 0x20) return fail(j, "a control character in %s in the header", what);
        if (c == '\\') {
            if (j->p >= j->end) break;
            char e = *j->p++;
            switch (e) {
            case '"': cp = '"'; break;
            case '\\': cp = '\\'; break;
            case '/': cp = '/'; break;
            case 'b': cp = '\b'; break;
            case 'f': cp = '\f'; break;
            case 'n': cp = '\n'; break;
            case 'r': cp = '\r'; break;
            case 't': cp = '\t'; break;
            case 'u':
                if (hex4(j, &cp) != 0) return -1;
                if (cp >= 0xD800 && cp < 0xDC00) { /* a surrogate pair */
                    uint32_t lo;
                    if (j->end - j->p < 2 || j->p[0] != '\\' || j->p[1] != 'u')
                        return fail(j, "a lone surrogate in %s in the header", what);
                    j->p += 2;
                    if (hex4(j, &lo) != 0) return -1;
                    if (lo < 0xDC00 || lo >= 0xE000) return fail(j, "a lone surrogate in %s in the header", what);
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                } else if (cp >= 0xDC00 && cp < 0xE000) {
                    return fail(j, "a lone surrogate in %s in the header", what);
                }
                if (cp == 0) return fail(j, "a NUL character in %s in the header", what);
                break;
            default: return fail(j, "a bad escape \\%c in %s in the header", e, what);
            }
        }
        char u[4];
        size_t k = 0;
        if (c == '\\') put_utf8(u, &k, cp);
        else u[k++] = (char)c;
        if (n + k + 1 > cap) return fail(j, "%s in the header is longer than %zu bytes", what, cap - 1);
        memcpy(out + n, u, k);
        n += k;
    }
    if (j->p >= j->end) return fail(j, "%s in the header is not closed", what);
    j->p++; /* the closing quote */
    out[n] = '\0';
    return 0;
}

/* A non-negative integer (digits only, below 2^63). */
static int number(js_t *j, uint64_t *v, const char *what)
{
    ws(j);
    if (j->p >= j->end || *j->p < '0' || *j->p > '9') return fail(j, "%s: a non-negative integer expected", what);
    if (*j->p == '0' && j->end - j->p > 1 && j->p[1] >= '0' && j->p[1] <= '9')
        return fail(j, "%s: a number with a leading zero", what);
    uint64_t x = 0;
    while (j->p < j->end && *j->p >= '0' && *j->p <= '9') {
        if (x > (UINT64_MAX / 2 - 9) / 10) return fail(j, "%s: a number over 2^63", what);
        x = x * 10 + (uint64_t)(*j->p++ - '0');
    }
    if (j->p < j->end && (*j->p == '.' || *j->p == 'e' || *j->p == 'E'))
        return fail(j, "%s: a whole number expected", what);
    *v = x;
    return 0;
}

/* [a, b, ...] of at most max non-negative integers; *n of them. */
static int uints(js_t *j, uint64_t *v, int max, int *n, const char *what)
{
    if (expect(j, '[') != 0) return -1;
    *n = 0;
    ws(j);
    if (j->p < j->end && *j->p == ']') {
        j->p++;
        return 0;
    }
    for (;;) {
        if (*n == max) return fail(j, "%s: more than %d numbers", what, max);
        if (number(j, &v[(*n)++], what) != 0) return -1;
        ws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        return expect(j, ']');
    }
}

static int dtype_of(js_t *j, const char *s, const char *name, ps_st_dtype_t *d, int *size)
{
    if (strcmp(s, "F32") == 0) *d = PS_ST_F32, *size = 4;
    else if (strcmp(s, "F16") == 0) *d = PS_ST_F16, *size = 2;
    else if (strcmp(s, "BF16") == 0) *d = PS_ST_BF16, *size = 2;
    else return fail(j, "tensor %s is %s: psd reads F32, F16 and BF16", name, s);
    return 0;
}

/* {"dtype": ..., "shape": [...], "data_offsets": [b, e]} for tensor t (its name set). */
static int tensor(js_t *j, ps_st_tensor_t *t)
{
    bool have_d = false, have_s = false, have_o = false;
    int size = 0;
    if (expect(j, '{') != 0) return -1;
    for (;;) {
        char key[32];
        if (string(j, key, sizeof key, "a tensor's field") != 0) return -1;
        if (expect(j, ':') != 0) return -1;
        if (strcmp(key, "dtype") == 0 && !have_d) {
            char d[16];
            if (string(j, d, sizeof d, "a dtype") != 0 || dtype_of(j, d, t->name, &t->dtype, &size) != 0) return -1;
            have_d = true;
        } else if (strcmp(key, "shape") == 0 && !have_s) {
            if (uints(j, t->shape, PS_ST_MAX_DIMS, &t->ndim, "a shape") != 0) return -1;
            have_s = true;
        } else if (strcmp(key, "data_offsets") == 0 && !have_o) {
            uint64_t o[2];
            int n;
            if (uints(j, o, 2, &n, "data_offsets") != 0) return -1;
            if (n != 2 || o[1] < o[0]) return fail(j, "tensor %s: data_offsets must be [begin, end]", t->name);
            t->begin = o[0];
            t->end = o[1];
            have_o = true;
        } else {
            return fail(j, "tensor %s: field \"%s\" is not one of dtype, shape, data_offsets (or comes twice)",
                        t->name, key);
        }
        ws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        if (expect(j, '}') != 0) return -1;
        break;
    }
    if (!have_d || !have_s || !have_o) return fail(j, "tensor %s lacks its dtype, shape or data_offsets", t->name);
    uint64_t numel = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] != 0 && numel > (UINT64_C(1) << 61) / t->shape[d])
            return fail(j, "tensor %s: its shape holds more than 2^61 elements", t->name);
        numel *= t->shape[d];
    }
    t->numel = numel;
    if (t->end - t->begin != numel * (uint64_t)size)
        return fail(j, "tensor %s: %" PRIu64 " elements of %d bytes, but data_offsets span %" PRIu64 " bytes", t->name,
                    numel, size, t->end - t->begin);
    return 0;
}

static int metadata(js_t *j, ps_st_file_t *f)
{
    if (expect(j, '{') != 0) return -1;
    ws(j);
    if (j->p < j->end && *j->p == '}') {
        j->p++;
        return 0;
    }
    for (;;) {
        char k[1024], v[4096];
        if (string(j, k, sizeof k, "a metadata key") != 0 || expect(j, ':') != 0 ||
            string(j, v, sizeof v, "a metadata value") != 0)
            return -1;
        if (f->n_meta == 1024) return fail(j, "more than 1024 metadata entries");
        char **nk = realloc(f->meta_key, (f->n_meta + 1) * sizeof *nk);
        if (nk) f->meta_key = nk;
        char **nv = realloc(f->meta_val, (f->n_meta + 1) * sizeof *nv);
        if (nv) f->meta_val = nv;
        char *sk = strdup(k), *sv = strdup(v);
        if (!nk || !nv || !sk || !sv) {
            free(sk);
            free(sv);
            return fail(j, "out of memory for the metadata");
        }
        f->meta_key[f->n_meta] = sk;
        f->meta_val[f->n_meta++] = sv;
        ws(j);
        if (j->p < j->end && *j->p == ',') {
            j->p++;
            continue;
        }
        return expect(j, '}');
    }
}

static int by_begin(const void *a, const void *b)
{
    const ps_st_tensor_t *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1 : (x->end > y->end) - (x->end < y->end);
}

static int by_name(const void *a, const void *b)
{
    return strcmp(((const ps_st_tensor_t *)a)->name, ((const ps_st_tensor_t *)b)->name);
}

void ps_st_free(ps_st_file_t *f)
{
    for (size_t i = 0; i < f->n_meta; i++) {
        free(f->meta_key[i]);
        free(f->meta_val[i]);
    }
    free(f->meta_key);
    free(f->meta_val);
    free(f->t);
    memset(f, 0, sizeof *f);
}

int ps_st_parse(const uint8_t *buf, size_t len, uint64_t file_size, ps_st_file_t *f, char *err, size_t errlen)
{
    memset(f, 0, sizeof *f);
    js_t j = {.err = err, .errlen = errlen};
    if (len < 8 || file_size < 8) return fail(&j, "shorter than the 8 bytes of a safetensors header length");
    uint64_t N;
    memcpy(&N, buf, 8);
    if (N < 2 || N > PS_ST_MAX_HEADER)
        return fail(&j, "its header length %" PRIu64 " is not in [2, %u] bytes: not a safetensors file", N,
                    PS_ST_MAX_HEADER);
    if (N > file_size - 8) return fail(&j, "its header (%" PRIu64 " bytes) runs past the end of the file", N);
    if (N > len - 8) return fail(&j, "its header (%" PRIu64 " bytes) was not read whole", N);
    j.p = (const char *)buf + 8;
    j.end = j.p + N;
    f->data_off = 8 + N;
    f->data_len = file_size - f->data_off;
    size_t cap = 0;
    int rc = expect(&j, '{');
    bool meta_seen = false, empty = false;
    ws(&j);
    if (rc == 0 && j.p < j.end && *j.p == '}') {
        j.p++;
        empty = true;
    }
    while (rc == 0 && !empty) {
        char name[PS_ST_NAME_MAX + 1];
        if ((rc = string(&j, name, sizeof name, "a tensor's name")) != 0 || (rc = expect(&j, ':')) != 0) break;
        if (strcmp(name, "__metadata__") == 0) {
            if (meta_seen) {
                rc = fail(&j, "__metadata__ comes twice");
                break;
            }
            meta_seen = true;
            rc = metadata(&j, f);
        } else {
            if (!name[0]) {
                rc = fail(&j, "a tensor with an empty name");
                break;
            }
            if (f->n == PS_ST_MAX_TENSORS) {
                rc = fail(&j, "more than %d tensors", PS_ST_MAX_TENSORS);
                break;
            }
            if (f->n == cap) {
                size_t nc = cap ? 2 * cap : 16;
                ps_st_tensor_t *t = realloc(f->t, nc * sizeof *t);
                if (!t) {
                    rc = fail(&j, "out of memory for the tensor list");
                    break;
                }
                f->t = t;
                cap = nc;
            }
            ps_st_tensor_t *t = &f->t[f->n++];
            memset(t, 0, sizeof *t);
            memcpy(t->name, name, strlen(name) + 1);
            rc = tensor(&j, t);
        }
        if (rc != 0) break;
        ws(&j);
        if (j.p < j.end && *j.p == ',') {
            j.p++;
            continue;
        }
        rc = expect(&j, '}');
        break;
    }
    if (rc == 0) { /* nothing after the object but the padding */
        ws(&j);
        if (j.p != j.end) rc = fail(&j, "bytes after the header's JSON object");
    }
    if (rc == 0 && f->n > 1) { /* names once each */
        qsort(f->t, f->n, sizeof *f->t, by_name);
        for (size_t i = 1; i < f->n && rc == 0; i++)
            if (strcmp(f->t[i].name, f->t[i - 1].name) == 0) rc = fail(&j, "tensor %s comes twice", f->t[i].name);
    }
    if (rc == 0) { /* the data covered exactly, in order */
        if (f->n) qsort(f->t, f->n, sizeof *f->t, by_begin);
        uint64_t at = 0;
        for (size_t i = 0; i < f->n && rc == 0; i++) {
            if (f->t[i].begin != at)
                rc = fail(&j, "tensor %s starts at byte %" PRIu64 " of the data, not %" PRIu64 " (a hole or an overlap)",
                          f->t[i].name, f->t[i].begin, at);
            at = f->t[i].end;
        }
        if (rc == 0 && at != f->data_len)
            rc = fail(&j, "the tensors hold %" PRIu64 " bytes of data, the file has %" PRIu64, at, f->data_len);
    }
    if (rc != 0) ps_st_free(f);
    return rc;
}

const ps_st_tensor_t *ps_st_find(const ps_st_file_t *f, const char *name)
{
    for (size_t i = 0; i < f->n; i++)
        if (strcmp(f->t[i].name, name) == 0) return &f->t[i];
    return NULL;
}

/* IEEE half to single, every value exactly (subnormals, infinities, NaN). */
static float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF, bits;
    if (e == 0x1F) {
        bits = sign | 0x7F800000u | (m << 13);
    } else if (e != 0) {
        bits = sign | ((e + 112) << 23) | (m << 13);
    } else if (m == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        int s = 0;
        while (!(m & 0x400)) {
            m <<= 1;
            s++;
        }
        bits = sign | ((uint32_t)(113 - s) << 23) | ((m & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

void ps_st_to_f32(const ps_st_tensor_t *t, const uint8_t *bytes, float *out)
{
    switch (t->dtype) {
    case PS_ST_F32: memcpy(out, bytes, t->numel * 4); break;
    case PS_ST_F16:
        for (uint64_t i = 0; i < t->numel; i++) {
            uint16_t h;
            memcpy(&h, bytes + 2 * i, 2);
            out[i] = half_to_float(h);
        }
        break;
    case PS_ST_BF16:
        for (uint64_t i = 0; i < t->numel; i++) {
            uint16_t h;
            memcpy(&h, bytes + 2 * i, 2);
            uint32_t bits = (uint32_t)h << 16;
            memcpy(&out[i], &bits, 4);
        }
        break;
    }
}

static int read_at(int fd, void *buf, size_t n, uint64_t off)
{
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t r = pread(fd, p, n > (1u << 30) ? (1u << 30) : n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return r < 0 ? -errno : -EIO;
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

int ps_st_load(const char *path, ps_st_file_t *f, float **values, char *err, size_t errlen)
{
    memset(f, 0, sizeof *f);
    if (values) *values = NULL;
    char why[480];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "cannot open %s: %s", path, strerror(errno));
        return -1;
    }
    struct stat st;
    uint8_t *hdr = NULL, *tmp = NULL;
    float *v = NULL;
    int rc = -1;
    uint64_t N = 0;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        snprintf(err, errlen, "%s is not a regular file", path);
        goto out;
    }
    if (st.st_size >= 8 && read_at(fd, &N, 8, 0) != 0) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        goto out;
    }
    size_t hl = st.st_size < 8 ? 8 : (size_t)(8 + (N <= PS_ST_MAX_HEADER && N <= (uint64_t)st.st_size - 8 ? N : 0));
    if (!(hdr = calloc(1, hl))) {
        snprintf(err, errlen, "out of memory reading %s", path);
        goto out;
    }
    if (st.st_size >= 8 && read_at(fd, hdr, hl, 0) != 0) {
        snprintf(err, errlen, "cannot read %s: %s", path, strerror(errno));
        goto out;
    }
    if (ps_st_parse(hdr, hl, (uint64_t)st.st_size, f, why, sizeof why) != 0) {
        snprintf(err, errlen, "%s: %s", path, why);
        goto out;
    }
    if (!values) { /* the header only */
        rc = 0;
        goto out;
    }
    uint64_t total = 0, biggest = 0;
    for (size_t i = 0; i < f->n; i++) {
        total += f->t[i].numel;
        if (f->t[i].dtype != PS_ST_F32 && f->t[i].end - f->t[i].begin > biggest) biggest = f->t[i].end - f->t[i].begin;
    }
    if (total > SIZE_MAX / 4 || !(v = malloc(total ? (size_t)total * 4 : 4)) || (biggest && !(tmp = malloc(biggest)))) {
        snprintf(err, errlen, "out of memory for the %" PRIu64 " values of %s", total, path);
        goto out;
    }
    uint64_t at = 0;
    for (size_t i = 0; i < f->n; i++) {
        const ps_st_tensor_t *t = &f->t[i];
        size_t bytes = (size_t)(t->end - t->begin);
        uint8_t *dst = t->dtype == PS_ST_F32 ? (uint8_t *)(v + at) : tmp;
        if (bytes && read_at(fd, dst, bytes, f->data_off + t->begin) != 0) {
            snprintf(err, errlen, "cannot read tensor %s of %s", t->name, path);
            goto out;
        }
        if (t->dtype != PS_ST_F32) ps_st_to_f32(t, tmp, v + at);
        at += t->numel;
    }
    *values = v;
    v = NULL;
    rc = 0;
out:
    if (rc != 0) ps_st_free(f);
    free(v);
    free(tmp);
    free(hdr);
    close(fd);
    return rc;
}

/* ---- writing ------------------------------------------------------------ */

typedef struct {
    char *s;
    size_t n, cap;
    bool oom;
} sb_t;

static void sb_put(sb_t *b, const char *s, size_t n)
{
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = (b->n + n + 1) * 2;
        char *p = realloc(b->s, nc);
        if (!p) {
            b->oom = true;
            return;
        }
        b->s = p;
        b->cap = nc;
    }
    memcpy(b->s + b->n, s, n);
    b->n += n;
    b->s[b->n] = '\0';
}

static void sb_printf(sb_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sb_t *b, const char *fmt, ...)
{
    char tmp[64];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    sb_put(b, tmp, n > 0 ? (size_t)n : 0);
}

static void sb_str(sb_t *b, const char *s)
{
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') {
            char e[2] = {'\\', (char)c};
            sb_put(b, e, 2);
        } else if (c < 0x20) {
            sb_printf(b, "\\u%04x", c);
        } else {
            sb_put(b, s, 1);
        }
    }
    sb_put(b, "\"", 1);
}


/* The file's bytes, for ps_write_atomic: the header's length, the header,
 * every tensor's floats. */
typedef struct {
    const sb_t *hdr;
    const ps_st_out_t *t;
    size_t n;
} save_t;

static int save_body(int fd, void *ud)
{
    const save_t *sv = ud;
    uint64_t N = sv->hdr->n;
    int rc = ps_write_all(fd, &N, 8);
    if (rc == 0) rc = ps_write_all(fd, sv->hdr->s, sv->hdr->n);
    for (size_t i = 0; i < sv->n && rc == 0; i++) {
        uint64_t numel = 1;
        for (int d = 0; d < sv->t[i].ndim; d++) numel *= sv->t[i].shape[d];
        rc = ps_write_all(fd, sv->t[i].data, (size_t)numel * 4);
    }
    return rc;
}

/* The JSON header of n F32 tensors and their metadata into b (padded to
 * 8 bytes). 0, or -1 with the reason. */
static int st_header(sb_t *b, const ps_st_out_t *t, size_t n, const char *const *meta_key,
                     const char *const *meta_val, size_t n_meta, const char *path, char *err, size_t errlen)
{
    uint64_t off = 0;
    sb_put(b, "{", 1);
    if (n_meta) {
        sb_put(b, "\"__metadata__\":{", 16);
        for (size_t i = 0; i < n_meta; i++) {
            if (i) sb_put(b, ",", 1);
            sb_str(b, meta_key[i]);
            sb_put(b, ":", 1);
            sb_str(b, meta_val[i]);
        }
        sb_put(b, "}", 1);
    }
    for (size_t i = 0; i < n; i++) {
        if (!t[i].name[0] || strlen(t[i].name) > PS_ST_NAME_MAX || t[i].ndim < 0 || t[i].ndim > PS_ST_MAX_DIMS) {
            snprintf(err, errlen, "cannot write %s: tensor %zu has no name, a name over %d bytes or over %d dims", path,
                     i, PS_ST_NAME_MAX, PS_ST_MAX_DIMS);
            return -1;
        }
        uint64_t numel = 1;
        if (i || n_meta) sb_put(b, ",", 1);
        sb_str(b, t[i].name);
        sb_put(b, ":{\"dtype\":\"F32\",\"shape\":[", 25);
        for (int d = 0; d < t[i].ndim; d++) {
            sb_printf(b, d ? ",%" PRIu64 : "%" PRIu64, t[i].shape[d]);
            numel *= t[i].shape[d];
        }
        sb_printf(b, "],\"data_offsets\":[%" PRIu64, off);
        off += numel * 4;
        sb_printf(b, ",%" PRIu64 "]}", off);
    }
    sb_put(b, "}", 1);
    while (!b->oom && b->n % 8) sb_put(b, " ", 1); /* the data 8-byte aligned, as PyTorch's writer does */
    if (b->oom) {
        snprintf(err, errlen, "cannot write %s: out of memory", path);
        return -1;
    }
    return 0;
}

int ps_st_header(const ps_st_out_t *t, size_t n, const char *const *meta_key, const char *const *meta_val,
                 size_t n_meta, uint8_t **out, size_t *len, char *err, size_t errlen)
{
    sb_t b = {0};
    *out = NULL;
    if (st_header(&b, t, n, meta_key, meta_val, n_meta, "safetensors", err, errlen) != 0 ||
        !(*out = malloc(8 + b.n))) {
        if (!b.oom && b.s) snprintf(err, errlen, "out of memory");
        free(b.s);
        return -1;
    }
    uint64_t N = b.n;
    for (int i = 0; i < 8; i++) (*out)[i] = (uint8_t)(N >> (8 * i));
    memcpy(*out + 8, b.s, b.n);
    *len = 8 + b.n;
    free(b.s);
    return 0;
}

int ps_st_save(const char *path, const ps_st_out_t *t, size_t n, const char *const *meta_key,
               const char *const *meta_val, size_t n_meta, char *err, size_t errlen)
{
    sb_t b = {0};
    if (st_header(&b, t, n, meta_key, meta_val, n_meta, path, err, errlen) != 0) {
        free(b.s);
        return -1;
    }
    save_t sv = {.hdr = &b, .t = t, .n = n};
    int rc = ps_write_atomic(path, save_body, &sv); /* PATH.tmp, fsync, rename, fsync of the directory */
    free(b.s);
    if (rc != 0) {
        snprintf(err, errlen, "cannot write %s: %s", path, strerror(-rc));
        return -1;
    }
    return 0;
}
