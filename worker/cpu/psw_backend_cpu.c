/* psw_backend_cpu.c - the reference backend: host memory and OpenBLAS.
 *
 * Everything is synchronous, so sync() has nothing to wait for. The ops are
 * written for clarity first: they are what the other backends are tested
 * against. */
#include <assert.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cblas.h>

#include "psw_backend.h"

#define CPU_ALIGN 64 /* bytes; a cache line, and the arena's tensor alignment */

/* ---- memory ---- */

static void *cpu_alloc(psw_backend_t *be, size_t bytes)
{
    (void)be;
    /* aligned_alloc wants a multiple of the alignment; 0 bytes still gets a
     * distinct, freeable pointer. */
    size_t n = bytes ? (bytes + CPU_ALIGN - 1) / CPU_ALIGN * CPU_ALIGN : CPU_ALIGN;
    if (n < bytes) return NULL; /* overflow */
    void *p = aligned_alloc(CPU_ALIGN, n);
    if (p) memset(p, 0, n);
    return p;
}

static void cpu_free(psw_backend_t *be, void *p)
{
    (void)be;
    free(p);
}

static void cpu_upload(psw_backend_t *be, void *dst, const void *src_host, size_t bytes)
{
    assert((dst && src_host) || bytes == 0);
    be->bytes_up += bytes;
    if (bytes) memcpy(dst, src_host, bytes);
}

static void cpu_download(psw_backend_t *be, void *dst_host, const void *src, size_t bytes)
{
    assert((dst_host && src) || bytes == 0);
    be->bytes_down += bytes;
    if (bytes) memcpy(dst_host, src, bytes);
}

static void cpu_sync(psw_backend_t *be) { (void)be; }

static void cpu_zero(psw_backend_t *be, void *p, size_t bytes)
{
    (void)be;
    memset(p, 0, bytes);
}

/* Host memory is device memory: "downloads" are plain copies, done at once. */
static int cpu_download_async(psw_backend_t *be, void *dst_host, const void *src, size_t bytes)
{
    cpu_download(be, dst_host, src, bytes);
    return 0;
}

static void cpu_wait(psw_backend_t *be, int ticket)
{
    (void)be;
    (void)ticket;
}

/* ---- ops ---- */

/* y (B,out) = x (B,in) @ W^T + b. The bias rows are written first and the
 * product accumulated onto them (beta = 1): one pass over y fewer than adding
 * the bias after the GEMM. */
static void cpu_linear_fwd(psw_backend_t *be, float *y, const float *x, const float *W,
                           const float *b, int B, int in, int out)
{
    (void)be;
    assert(y && x && W && b);
    assert(B >= 1 && in >= 1 && out >= 1);
    for (int i = 0; i < B; i++) memcpy(y + (size_t)i * out, b, (size_t)out * sizeof(float));
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, B, out, in, 1.0f, x, in, W, in, 1.0f,
                y, out);
}

/* dW (out,in) = dy^T (out,B) @ x (B,in); db (out) = column sums of dy (B,out);
 * dx (B,in) = dy (B,out) @ W (out,in). */
static void cpu_linear_bwd(psw_backend_t *be, float *dx, float *dW, float *db, const float *dy,
                           const float *x, const float *W, int B, int in, int out)
{
    (void)be;
    assert(dW && db && dy && x && W);
    assert(B >= 1 && in >= 1 && out >= 1);
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, out, in, B, 1.0f, dy, out, x, in, 0.0f,
                dW, in);
    memcpy(db, dy, (size_t)out * sizeof(float));
    for (int i = 1; i < B; i++) {
        const float *row = dy + (size_t)i * out;
        for (int j = 0; j < out; j++) db[j] += row[j];
    }
    if (dx)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, B, in, out, 1.0f, dy, out, W, in,
                    0.0f, dx, in);
}

static void cpu_relu_fwd(psw_backend_t *be, float *y, const float *x, size_t n)
{
    (void)be;
    assert((y && x) || n == 0);
    for (size_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

static void cpu_relu_bwd(psw_backend_t *be, float *dx, const float *dy, const float *y, size_t n)
{
    (void)be;
    assert((dx && dy && y) || n == 0);
    for (size_t i = 0; i < n; i++) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

static void cpu_embag_fwd(psw_backend_t *be, float *y, const float *E, const uint32_t *ids, int B, int F, int m,
                          int D, int mean)
{
    (void)be;
    const float inv = mean ? 1.0f / (float)m : 1.0f;
    for (size_t k = 0; k < (size_t)B * (size_t)F; k++) {
        float *out = y + k * (size_t)D;
        const uint32_t *bag = ids + k * (size_t)m;
        memcpy(out, E + (size_t)bag[0] * (size_t)D, (size_t)D * sizeof *out);
        for (int j = 1; j < m; j++) {
            const float *row = E + (size_t)bag[j] * (size_t)D;
            for (int d = 0; d < D; d++) out[d] += row[d];
        }
        if (mean)
            for (int d = 0; d < D; d++) out[d] *= inv;
    }
}

static void cpu_embag_bwd(psw_backend_t *be, float *dE, const float *dy, const uint32_t *ids, int B, int F, int m,
                          int D, int mean)
{
    (void)be;
    const float inv = 1.0f / (float)m;
    for (size_t k = 0; k < (size_t)B * (size_t)F; k++) {
        const float *g = dy + k * (size_t)D;
        for (int j = 0; j < m; j++) {
            float *row = dE + (size_t)ids[k * (size_t)m + (size_t)j] * (size_t)D;
            if (mean)
                for (int d = 0; d < D; d++) row[d] += g[d] * inv;
            else
                for (int d = 0; d < D; d++) row[d] += g[d];
        }
    }
}

static void cpu_scatter_rows(psw_backend_t *be, float *E, const uint32_t *ids, const float *vals, size_t n, int D)
{
    (void)be;
    for (size_t j = 0; j < n; j++) memcpy(E + (size_t)ids[j] * (size_t)D, vals + j * (size_t)D, (size_t)D * sizeof *E);
}

static void cpu_gather_rows(psw_backend_t *be, float *out, const float *E, const uint32_t *ids, size_t n, int D)
{
    (void)be;
    for (size_t j = 0; j < n; j++) memcpy(out + j * (size_t)D, E + (size_t)ids[j] * (size_t)D, (size_t)D * sizeof *E);
}

/* logits (B,C), labels (B). Per sample, in float:
 *   m = max_j l_j, s = sum_j exp(l_j - m), loss = log(s) - (l_label - m),
 *   dlogits_j = (exp(l_j - m) / s - [j == label]) * grad_scale. */
static void cpu_xent(psw_backend_t *be, float *dlogits, const float *logits,
                     const int32_t *labels, int B, int C, float grad_scale, double *loss_sum_host,
                     int64_t *correct_host)
{
    (void)be;
    assert(logits && labels && loss_sum_host && correct_host);
    assert(B >= 1 && C >= 1);
    double loss = 0.0;
    int64_t correct = 0;
    for (int i = 0; i < B; i++) {
        const float *l = logits + (size_t)i * C;
        const int y = labels[i];
        assert(y >= 0 && y < C);
        const float ly = l[y]; /* read first: lets dlogits alias logits */
        int arg = 0;
        float m = l[0];
        for (int j = 1; j < C; j++)
            if (l[j] > m) {
                m = l[j];
                arg = j;
            }
        float s = 0.0f;
        if (dlogits) {
            /* Keep exp(l_j - m) in dlogits, normalise below. */
            float *d = dlogits + (size_t)i * C;
            for (int j = 0; j < C; j++) s += d[j] = expf(l[j] - m);
            const float inv = 1.0f / s;
            for (int j = 0; j < C; j++) d[j] = (d[j] * inv - (j == y ? 1.0f : 0.0f)) * grad_scale;
        } else {
            for (int j = 0; j < C; j++) s += expf(l[j] - m);
        }
        loss += (double)(logf(s) - (ly - m));
        correct += arg == y;
    }
    *loss_sum_host += loss;
    *correct_host += correct;
}

static void cpu_destroy(psw_backend_t *be) { free(be); }

psw_backend_t *psw_backend_cpu_new(int threads)
{
    assert(threads >= 0);
    psw_backend_t *be = calloc(1, sizeof(*be));
    if (!be) return NULL;
    if (threads > 0) openblas_set_num_threads(threads);
    be->name = "cpu";
    be->ctx = NULL;
    be->host_visible = 1;
    be->host_alloc = cpu_alloc;
    be->host_free = cpu_free;
    be->download_async = cpu_download_async;
    be->wait = cpu_wait;
    be->alloc = cpu_alloc;
    be->free = cpu_free;
    be->upload = cpu_upload;
    be->download = cpu_download;
    be->sync = cpu_sync;
    be->zero = cpu_zero;
    be->linear_fwd = cpu_linear_fwd;
    be->linear_bwd = cpu_linear_bwd;
    be->relu_fwd = cpu_relu_fwd;
    be->relu_bwd = cpu_relu_bwd;
    be->xent = cpu_xent;
    be->embag_fwd = cpu_embag_fwd;
    be->embag_bwd = cpu_embag_bwd;
    be->scatter_rows = cpu_scatter_rows;
    be->gather_rows = cpu_gather_rows;
    be->destroy = cpu_destroy;
    return be;
}
