/* psw_backend_cuda.cu - the CUDA backend (cuBLAS GEMMs, small kernels), built
 * as the plugin libpsw_cuda.so (see psw_cuda.h).
 *
 * Streams: every op, upload and download runs on one non-blocking compute
 * stream, in issue order; cuBLAS is bound to it. download_async copies on a
 * second, non-blocking copy stream that waits (cudaStreamWaitEvent) for the
 * compute work queued before it, so later compute work is not held up.
 *
 * Uploads: the source may be pageable memory that the caller reuses as soon
 * as upload() returns. It is first copied (memcpy) into one of STAGE_SLOTS
 * pinned staging slots, and the slot is copied to the device asynchronously;
 * a slot is reused only after the event recorded behind its last copy has
 * completed. So upload() never returns before the source has been read, and
 * it does not wait for the compute stream unless every slot is still queued
 * behind unfinished work. Uploads larger than a slot go through in chunks.
 *
 * Numerics: fp32 throughout, CUBLAS_DEFAULT_MATH (no TF32; NVIDIA_TF32_OVERRIDE
 * can only disable TF32, not enable it), cuBLAS atomics left disallowed (the
 * default), so results are reproducible run to run on the same GPU. No
 * kernel uses fast-math intrinsics; db and the softmax sums use fixed
 * reduction orders (deterministic, but not the CPU's sequential order).
 *
 * Threads: a backend is used by one thread at a time (the staging ring and
 * the ticket pool are not locked); any thread may be that one, since every
 * entry point makes the backend's device current.
 *
 * Errors: any CUDA or cuBLAS failure inside an op is fatal (message with
 * file:line, exit(1)): a worker cannot go on with a broken device. The
 * worker's hook (set_fatal_hook) tells psd first, which carries on without
 * it at once. device_count, device_name and backend_new return
 * errors instead; alloc and host_alloc return NULL when out of memory. */
#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

extern "C" {
#include "psw_backend.h"
#include "cuda/psw_cuda.h"
}

/* ---- checks ---- */

static void (*fatal_hook)(const char *message, void *ctx);
static void *fatal_ctx;

/* A failure inside an op: the message to stderr and to the worker's hook
 * (which tells psd), then exit 1. */
[[noreturn]] static void fatal(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void fatal(const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr, "%s\n", msg);
    void (*hook)(const char *, void *) = fatal_hook;
    fatal_hook = NULL; /* once: a failure inside the hook exits at once */
    if (hook) hook(msg, fatal_ctx);
    exit(1);
}

static void cuda_set_fatal_hook(void (*hook)(const char *message, void *ctx), void *ctx)
{
    fatal_hook = hook;
    fatal_ctx = ctx;
}

#define CUDA_CHECK(call)                                                                       \
    do {                                                                                       \
        cudaError_t err_ = (call);                                                             \
        if (err_ != cudaSuccess)                                                               \
            fatal("psw_cuda: %s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(err_)); \
    } while (0)

#define CUBLAS_CHECK(call)                                                                     \
    do {                                                                                       \
        cublasStatus_t st_ = (call);                                                           \
        if (st_ != CUBLAS_STATUS_SUCCESS)                                                      \
            fatal("psw_cuda: %s:%d: %s: %s", __FILE__, __LINE__, #call, cublasGetStatusString(st_)); \
    } while (0)

/* After every kernel launch: catches bad launch configurations at once
 * (errors inside the kernel surface at the next synchronising call). */
#define CUDA_LAUNCH_CHECK() CUDA_CHECK(cudaGetLastError())

/* Programming errors: always on, whatever NDEBUG says. */
#define PSW_ASSERT(cond)                                                                       \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "psw_cuda: %s:%d: assertion failed: %s\n", __FILE__, __LINE__,     \
                    #cond);                                                                    \
            abort();                                                                           \
        }                                                                                      \
    } while (0)

/* For device_count and backend_new, which report errors instead of exiting:
 * on failure, write "call: error" to err and goto fail. */
#define CUDA_TRY(call)                                                                         \
    do {                                                                                       \
        cudaError_t err_ = (call);                                                             \
        if (err_ != cudaSuccess) {                                                             \
            snprintf(err, errlen, "%s:%d: %s: %s (error %d)", __FILE__, __LINE__, #call,       \
                     cudaGetErrorString(err_), (int)err_);                                     \
            (void)cudaGetLastError();                                                          \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)

#define CUBLAS_TRY(call)                                                                       \
    do {                                                                                       \
        cublasStatus_t st_ = (call);                                                           \
        if (st_ != CUBLAS_STATUS_SUCCESS) {                                                    \
            snprintf(err, errlen, "%s:%d: %s: %s", __FILE__, __LINE__, #call,                  \
                     cublasGetStatusString(st_));                                              \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)

/* A kernel launch: PSW_LAUNCH(kernel, grid, block, stream)(args...). With
 * nvcc, the usual triple chevrons; tests/cuda_emu/cuda_runtime.h (the CPU
 * emulation this file is also compiled against, as libpsw_cuda_emu.so)
 * defines its own. */
#ifndef PSW_LAUNCH
#define PSW_LAUNCH(kernel, grid, block, stream) kernel<<<(grid), (block), 0, (stream)>>>
#endif

/* ---- backend state ---- */

#define N_TICKETS 64             /* download_async copies in flight at most */
#define STAGE_SLOTS 8            /* pinned staging buffers for upload */
#define STAGE_BYTES (2u << 20)   /* bytes per staging slot */
#define ELEM_THREADS 256         /* block size of the elementwise kernels */
#define MAX_ELEM_BLOCKS 8192     /* grid-stride loops beyond this */
#define DB_COLS 32               /* db: columns per block (one warp wide) */
#define DB_ROWS 16               /* db: row lanes per block */
#define XENT_ROWS_PER_BLOCK 4    /* xent: one warp per row */

typedef struct {
    cudaEvent_t ready; /* on compute: the work the copy waits for */
    cudaEvent_t done;  /* on copy: the copy itself */
    int busy;          /* handed out, not yet waited for */
} ticket_t;

typedef struct {
    void *buf;      /* pinned, STAGE_BYTES */
    cudaEvent_t ev; /* recorded behind the last copy out of buf */
} stage_t;

typedef struct {
    int dev;
    cudaStream_t compute, copy;
    cublasHandle_t blas;
    ticket_t tickets[N_TICKETS];
    stage_t stage[STAGE_SLOTS];
    int stage_next;
    /* xent results, per sample: loss (float) then correct flag (int32, -1
     * for a label out of range); device and pinned host, xent_cap samples */
    void *xent_dev, *xent_host;
    size_t xent_cap;
} cuda_ctx_t;

static cuda_ctx_t *ctx_of(psw_backend_t *be)
{
    PSW_ASSERT(be && be->ctx);
    return (cuda_ctx_t *)be->ctx;
}

/* The calling thread may not be the one that made the backend, and the
 * current device is per thread: make ours current (cheap when it already is). */
static cuda_ctx_t *use(psw_backend_t *be)
{
    cuda_ctx_t *c = ctx_of(be);
    CUDA_CHECK(cudaSetDevice(c->dev));
    return c;
}

static unsigned elem_blocks(size_t n)
{
    size_t b = (n + ELEM_THREADS - 1) / ELEM_THREADS;
    return (unsigned)(b < MAX_ELEM_BLOCKS ? b : MAX_ELEM_BLOCKS);
}

/* ---- kernels ---- */

/* y (B,out) row i = b (out), for every row; n = B*out. */
static __global__ void bias_broadcast_kernel(float *y, const float *b, size_t n, int out)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        y[i] = b[i % (size_t)out];
}

/* db (out) = column sums of dy (B,out). Block (DB_COLS, DB_ROWS) owns DB_COLS
 * columns; row lane r sums rows r, r+DB_ROWS, ... in order, then lane 0 adds
 * the DB_ROWS partials in order: a fixed order, so the result is the same on
 * every run. Loads are coalesced along the columns. */
static __global__ void colsum_kernel(float *db, const float *dy, int B, int out)
{
    __shared__ float part[DB_ROWS][DB_COLS];
    const int j = blockIdx.x * DB_COLS + threadIdx.x;
    float s = 0.0f;
    if (j < out)
        for (int i = threadIdx.y; i < B; i += DB_ROWS) s += dy[(size_t)i * out + j];
    part[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && j < out) {
        float t = part[0][threadIdx.x];
        for (int r = 1; r < DB_ROWS; r++) t += part[r][threadIdx.x];
        db[j] = t;
    }
}

/* y = max(x, 0); y may equal x. NaN -> 0 and -0 -> +0, as on the CPU. */
static __global__ void relu_fwd_kernel(float *y, const float *x, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float v = x[i];
        y[i] = v > 0.0f ? v : 0.0f;
    }
}

/* dx = dy * (y > 0); dx may equal dy. */
static __global__ void relu_bwd_kernel(float *dx, const float *dy, const float *y, size_t n)
{
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

/* Embedding bags, one thread per output element (bag k, column d): the rows
 * of the bag added in the order of j, as on the CPU. */
static __global__ void embag_fwd_kernel(float *y, const float *E, const uint32_t *ids, size_t bags, int m, int D,
                                        int mean)
{
    const size_t n = bags * (size_t)D, stride = (size_t)gridDim.x * blockDim.x;
    const float inv = mean ? 1.0f / (float)m : 1.0f;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t k = i / (size_t)D;
        const int d = (int)(i % (size_t)D);
        const uint32_t *bag = ids + k * (size_t)m;
        float v = E[(size_t)bag[0] * (size_t)D + d];
        for (int j = 1; j < m; j++) v += E[(size_t)bag[j] * (size_t)D + d];
        y[i] = mean ? v * inv : v;
    }
}

/* dE += dy scattered to the bags' rows: one thread per column d walks every
 * (bag, j) in order, so each element of dE takes its additions in the CPU's
 * order (the same bits, no atomics). Parallel over D only: enough for the
 * batches of a step (B*F*m entries per thread). */
static __global__ void embag_bwd_kernel(float *dE, const float *dy, const uint32_t *ids, size_t bags, int m, int D,
                                        int mean)
{
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    const float inv = 1.0f / (float)m;
    for (size_t k = 0; k < bags; k++) {
        const float g = dy[k * (size_t)D + d];
        for (int j = 0; j < m; j++) {
            float *e = dE + (size_t)ids[k * (size_t)m + j] * (size_t)D + d;
            *e = __fadd_rn(*e, mean ? __fmul_rn(g, inv) : g); /* never fused: the CPU's bits */
        }
    }
}

/* Rows of a table, one thread per element (row j, column d):
 * scatter E[ids[j]] = vals[j], gather out[j] = E[ids[j]]. */
static __global__ void scatter_rows_kernel(float *E, const uint32_t *ids, const float *vals, size_t n, int D)
{
    const size_t all = n * (size_t)D, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < all; i += stride)
        E[(size_t)ids[i / (size_t)D] * (size_t)D + i % (size_t)D] = vals[i];
}

static __global__ void gather_rows_kernel(float *out, const float *E, const uint32_t *ids, size_t n, int D)
{
    const size_t all = n * (size_t)D, stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < all; i += stride)
        out[i] = E[(size_t)ids[i / (size_t)D] * (size_t)D + i % (size_t)D];
}

/* Softmax cross-entropy, one warp per row of logits (B,C); labels (B).
 * Per row, as cpu_xent: m = max_j l_j (arg = first maximum),
 * s = sum_j exp(l_j - m), loss = log(s) - (l_label - m),
 * dlogits_j = (exp(l_j - m) * (1/s) - [j == label]) * grad_scale.
 * Writes loss[row] and status[row] = (arg == label), or status[row] = -1 and
 * nothing else when the label is out of range. Lane k owns columns k, k+32,
 * ...; dlogits may alias logits: l[label] is read before any write, and each
 * column is read and written by its own lane only. */
static __global__ void xent_kernel(float *dlogits, float *loss, int32_t *status,
                                   const float *logits, const int32_t *labels, int B, int C,
                                   float grad_scale)
{
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * XENT_ROWS_PER_BLOCK + threadIdx.x / 32;
    if (row >= B) return; /* whole warp */
    const int y = labels[row];
    if (y < 0 || y >= C) { /* whole warp */
        if (lane == 0) {
            loss[row] = 0.0f;
            status[row] = -1;
        }
        return;
    }
    const float *l = logits + (size_t)row * C;
    const float ly = l[y];

    /* max and first argmax: per lane in column order, then across lanes,
     * preferring the smaller column on equal values */
    float m = -INFINITY;
    int arg = INT32_MAX;
    for (int j = lane; j < C; j += 32) {
        const float v = l[j];
        if (arg == INT32_MAX || v > m) {
            m = v;
            arg = j;
        }
    }
    for (int off = 16; off > 0; off /= 2) {
        const float om = __shfl_xor_sync(0xffffffffu, m, off);
        const int oa = __shfl_xor_sync(0xffffffffu, arg, off);
        if (om > m || (om == m && oa < arg)) {
            m = om;
            arg = oa;
        }
    }
    /* every lane now holds the same (m, arg); use lane 0's to be sure */
    m = __shfl_sync(0xffffffffu, m, 0);
    arg = __shfl_sync(0xffffffffu, arg, 0);

    float s = 0.0f;
    for (int j = lane; j < C; j += 32) s += expf(l[j] - m);
    for (int off = 16; off > 0; off /= 2) s += __shfl_xor_sync(0xffffffffu, s, off);
    s = __shfl_sync(0xffffffffu, s, 0);

    if (lane == 0) {
        loss[row] = logf(s) - (ly - m);
        status[row] = arg == y;
    }
    if (dlogits) {
        __syncwarp(); /* every lane has read l[y] (above) before any write */
        float *d = dlogits + (size_t)row * C;
        const float inv = 1.0f / s;
        for (int j = lane; j < C; j += 32) {
            /* __fmul_rn: no FMA contraction, so p rounds as on the CPU before
             * the one-hot is subtracted (p - 1 cancels when p is near 1) */
            const float p = __fmul_rn(expf(l[j] - m), inv);
            d[j] = (p - (j == y ? 1.0f : 0.0f)) * grad_scale;
        }
    }
}

/* ---- memory ---- */

static void *cuda_alloc(psw_backend_t *be, size_t bytes)
{
    cuda_ctx_t *c = use(be);
    /* cudaMalloc(0) gives NULL; the interface wants a distinct pointer. The
     * result is 256-byte aligned. */
    const size_t n = bytes ? bytes : 1;
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, n);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError(); /* not sticky; clear it */
        return NULL;
    }
    CUDA_CHECK(e);
    CUDA_CHECK(cudaMemsetAsync(p, 0, n, c->compute));
    CUDA_CHECK(cudaStreamSynchronize(c->compute));
    return p;
}

static void cuda_free(psw_backend_t *be, void *p)
{
    cuda_ctx_t *c = use(be);
    if (!p) return;
    /* Nothing queued may still use p (cudaFree synchronises too, but say so). */
    CUDA_CHECK(cudaStreamSynchronize(c->compute));
    CUDA_CHECK(cudaStreamSynchronize(c->copy));
    CUDA_CHECK(cudaFree(p));
}

static void *cuda_host_alloc(psw_backend_t *be, size_t bytes)
{
    (void)use(be);
    void *p = NULL;
    cudaError_t e = cudaMallocHost(&p, bytes ? bytes : 1);
    if (e == cudaErrorMemoryAllocation) {
        (void)cudaGetLastError();
        return NULL;
    }
    CUDA_CHECK(e);
    return p;
}

static void cuda_host_free(psw_backend_t *be, void *p)
{
    (void)use(be);
    if (p) CUDA_CHECK(cudaFreeHost(p));
}

/* See the file comment: through the pinned staging slots, in order on the
 * compute stream; src_host is free again when this returns. */
static void cuda_upload(psw_backend_t *be, void *dst, const void *src_host, size_t bytes)
{
    cuda_ctx_t *c = use(be);
    PSW_ASSERT((dst && src_host) || bytes == 0);
    be->bytes_up += bytes;
    for (size_t off = 0; off < bytes;) {
        const size_t n = bytes - off < STAGE_BYTES ? bytes - off : STAGE_BYTES;
        stage_t *s = &c->stage[c->stage_next];
        c->stage_next = (c->stage_next + 1) % STAGE_SLOTS;
        CUDA_CHECK(cudaEventSynchronize(s->ev)); /* the slot's last copy is done */
        memcpy(s->buf, (const char *)src_host + off, n);
        CUDA_CHECK(cudaMemcpyAsync((char *)dst + off, s->buf, n, cudaMemcpyHostToDevice,
                                   c->compute));
        CUDA_CHECK(cudaEventRecord(s->ev, c->compute));
        off += n;
    }
}

static void cuda_download(psw_backend_t *be, void *dst_host, const void *src, size_t bytes)
{
    cuda_ctx_t *c = use(be);
    PSW_ASSERT((dst_host && src) || bytes == 0);
    if (!bytes) return;
    be->bytes_down += bytes;
    CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, c->compute));
    CUDA_CHECK(cudaStreamSynchronize(c->compute));
}

static void cuda_sync(psw_backend_t *be)
{
    cuda_ctx_t *c = use(be);
    CUDA_CHECK(cudaStreamSynchronize(c->compute));
}

/* dst_host should come from host_alloc (pinned), or the copy is not
 * asynchronous. src must not be overwritten by later work before wait(). */
static int cuda_download_async(psw_backend_t *be, void *dst_host, const void *src, size_t bytes)
{
    cuda_ctx_t *c = use(be);
    PSW_ASSERT((dst_host && src) || bytes == 0);
    int k = 0;
    while (k < N_TICKETS && c->tickets[k].busy) k++;
    if (k == N_TICKETS) {
        fprintf(stderr, "psw_cuda: %s:%d: more than %d download_async in flight (wait for some)\n",
                __FILE__, __LINE__, N_TICKETS);
        abort();
    }
    ticket_t *t = &c->tickets[k];
    t->busy = 1;
    be->bytes_down += bytes;
    CUDA_CHECK(cudaEventRecord(t->ready, c->compute));
    CUDA_CHECK(cudaStreamWaitEvent(c->copy, t->ready, 0));
    if (bytes)
        CUDA_CHECK(cudaMemcpyAsync(dst_host, src, bytes, cudaMemcpyDeviceToHost, c->copy));
    CUDA_CHECK(cudaEventRecord(t->done, c->copy));
    return k;
}

static void cuda_wait(psw_backend_t *be, int ticket)
{
    cuda_ctx_t *c = use(be);
    PSW_ASSERT(ticket >= 0 && ticket < N_TICKETS);
    /* A ticket already waited for: its event is complete, this returns at once. */
    CUDA_CHECK(cudaEventSynchronize(c->tickets[ticket].done));
    c->tickets[ticket].busy = 0;
}

/* ---- ops ---- */

/* cuBLAS is column-major. A row-major (r,c) matrix in memory is, read
 * column-major, its transpose (c,r) with leading dimension c. So with
 * x_mem = x^T (in,B), W_mem = W^T (in,out), y_mem = y^T (out,B):
 *   y = x W^T  <=>  y^T = W x^T = op_T(W_mem) (out,in) @ x_mem (in,B):
 *   sgemm(T, N, m=out, n=B, k=in, W, lda=in, x, ldb=in, y, ldc=out).
 * The bias rows are written first and the product added (beta = 1), as on
 * the CPU. */
static void cuda_linear_fwd(psw_backend_t *be, float *y, const float *x, const float *W,
                            const float *b, int B, int in, int out)
{
    cuda_ctx_t *c = use(be);
    PSW_ASSERT(y && x && W && b);
    PSW_ASSERT(B >= 1 && in >= 1 && out >= 1);
    const size_t n = (size_t)B * (size_t)out;
    PSW_LAUNCH(bias_broadcast_kernel, elem_blocks(n), ELEM_THREADS, c->compute)(y, b, n, out);
    CUDA_LAUNCH_CHECK();
    const float one = 1.0f;
    CUBLAS_CHECK(cublasSgemm(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, out, B, in, &one, W, in, x, in,
                             &one, y, out));
}

/* With dy_mem = dy^T (out,B), x_mem = x^T (in,B), W_mem = W^T (in,out):
 *   dW (out,in) = dy^T x  <=>  dW^T (in,out) = x^T dy = x_mem (in,B) @ op_T(dy_mem) (B,out):
 *     sgemm(N, T, m=in, n=out, k=B, x, lda=in, dy, ldb=out, dW, ldc=in)
 *   dx (B,in) = dy W  <=>  dx^T (in,B) = W^T dy^T = W_mem (in,out) @ dy_mem (out,B):
 *     sgemm(N, N, m=in, n=B, k=out, W, lda=in, dy, ldb=out, dx, ldc=in)
 *   db (out) = column sums of dy (B,out): colsum_kernel. */
static void cuda_linear_bwd(psw_backend_t *be, float *dx, float *dW, float *db, const float *dy,
                            const float *x, const float *W, int B, int in, int out)
{
    cuda_ctx_t *c = use(be);
    PSW_ASSERT(dW && db && dy && x && W);
    PSW_ASSERT(B >= 1 && in >= 1 && out >= 1);
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_CHECK(cublasSgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_T, in, out, B, &one, x, in, dy, out,
                             &zero, dW, in));
    const dim3 block(DB_COLS, DB_ROWS);
    const unsigned grid = (unsigned)((out + DB_COLS - 1) / DB_COLS);
    PSW_LAUNCH(colsum_kernel, grid, block, c->compute)(db, dy, B, out);
    CUDA_LAUNCH_CHECK();
    if (dx)
        CUBLAS_CHECK(cublasSgemm(c->blas, CUBLAS_OP_N, CUBLAS_OP_N, in, B, out, &one, W, in, dy,
                                 out, &zero, dx, in));
}

static void cuda_relu_fwd(psw_backend_t *be, float *y, const float *x, size_t n)
{
    cuda_ctx_t *c = use(be);
    PSW_ASSERT((y && x) || n == 0);
    if (!n) return;
    PSW_LAUNCH(relu_fwd_kernel, elem_blocks(n), ELEM_THREADS, c->compute)(y, x, n);
    CUDA_LAUNCH_CHECK();
}

static void cuda_relu_bwd(psw_backend_t *be, float *dx, const float *dy, const float *y, size_t n)
{
    cuda_ctx_t *c = use(be);
    PSW_ASSERT((dx && dy && y) || n == 0);
    if (!n) return;
    PSW_LAUNCH(relu_bwd_kernel, elem_blocks(n), ELEM_THREADS, c->compute)(dx, dy, y, n);
    CUDA_LAUNCH_CHECK();
}

static void cuda_zero(psw_backend_t *be, void *p, size_t bytes)
{
    cuda_ctx_t *c = use(be);
    if (bytes) CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, c->compute));
}

static void cuda_embag_fwd(psw_backend_t *be, float *y, const float *E, const uint32_t *ids, int B, int F, int m,
                           int D, int mean)
{
    cuda_ctx_t *c = use(be);
    const size_t bags = (size_t)B * (size_t)F;
    if (!bags || D < 1 || m < 1) return;
    PSW_LAUNCH(embag_fwd_kernel, elem_blocks(bags * (size_t)D), ELEM_THREADS, c->compute)(y, E, ids, bags, m, D,
                                                                                           mean);
    CUDA_LAUNCH_CHECK();
}

static void cuda_embag_bwd(psw_backend_t *be, float *dE, const float *dy, const uint32_t *ids, int B, int F, int m,
                           int D, int mean)
{
    cuda_ctx_t *c = use(be);
    const size_t bags = (size_t)B * (size_t)F;
    if (!bags || D < 1 || m < 1) return;
    PSW_LAUNCH(embag_bwd_kernel, (unsigned)((D + 63) / 64), 64, c->compute)(dE, dy, ids, bags, m, D, mean);
    CUDA_LAUNCH_CHECK();
}

static void cuda_scatter_rows(psw_backend_t *be, float *E, const uint32_t *ids, const float *vals, size_t n, int D)
{
    cuda_ctx_t *c = use(be);
    if (!n || D < 1) return;
    PSW_LAUNCH(scatter_rows_kernel, elem_blocks(n * (size_t)D), ELEM_THREADS, c->compute)(E, ids, vals, n, D);
    CUDA_LAUNCH_CHECK();
}

static void cuda_gather_rows(psw_backend_t *be, float *out, const float *E, const uint32_t *ids, size_t n, int D)
{
    cuda_ctx_t *c = use(be);
    if (!n || D < 1) return;
    PSW_LAUNCH(gather_rows_kernel, elem_blocks(n * (size_t)D), ELEM_THREADS, c->compute)(out, E, ids, n, D);
    CUDA_LAUNCH_CHECK();
}

/* Grow the per-sample result buffers to at least B samples. Called only
 * after a sync of the compute stream (the end of the previous xent), so the
 * old buffers are idle. */
static void xent_reserve(cuda_ctx_t *c, int B)
{
    if ((size_t)B <= c->xent_cap) return;
    const size_t cap = ((size_t)B + 1023) / 1024 * 1024;
    if (c->xent_dev) CUDA_CHECK(cudaFree(c->xent_dev));
    if (c->xent_host) CUDA_CHECK(cudaFreeHost(c->xent_host));
    c->xent_dev = c->xent_host = NULL;
    c->xent_cap = 0;
    CUDA_CHECK(cudaMalloc(&c->xent_dev, cap * 8));
    CUDA_CHECK(cudaMallocHost(&c->xent_host, cap * 8));
    c->xent_cap = cap;
}

/* logits (B,C), labels (B) on the device. Losses are summed on the host in
 * double in sample order, as cpu_xent does; this waits for the stream. */
static void cuda_xent(psw_backend_t *be, float *dlogits, const float *logits,
                      const int32_t *labels, int B, int C, float grad_scale, double *loss_sum_host,
                      int64_t *correct_host)
{
    cuda_ctx_t *c = use(be);
    PSW_ASSERT(logits && labels && loss_sum_host && correct_host);
    PSW_ASSERT(B >= 1 && C >= 1);
    xent_reserve(c, B);
    /* device: loss (B) floats, then status (B) int32; same layout on the host */
    float *loss_d = (float *)c->xent_dev;
    int32_t *status_d = (int32_t *)(loss_d + B);
    const unsigned grid = (unsigned)((B + XENT_ROWS_PER_BLOCK - 1) / XENT_ROWS_PER_BLOCK);
    PSW_LAUNCH(xent_kernel, grid, 32 * XENT_ROWS_PER_BLOCK, c->compute)(dlogits, loss_d, status_d, logits, labels, B,
                                                                        C, grad_scale);
    CUDA_LAUNCH_CHECK();
    CUDA_CHECK(cudaMemcpyAsync(c->xent_host, c->xent_dev, (size_t)B * 8, cudaMemcpyDeviceToHost,
                               c->compute));
    CUDA_CHECK(cudaStreamSynchronize(c->compute));

    const float *loss_h = (const float *)c->xent_host;
    const int32_t *status_h = (const int32_t *)(loss_h + B);
    double loss = 0.0;
    int64_t correct = 0;
    for (int i = 0; i < B; i++) {
        if (status_h[i] < 0) {
            int32_t y = 0;
            CUDA_CHECK(cudaMemcpy(&y, labels + i, sizeof y, cudaMemcpyDeviceToHost));
            fatal("psw_cuda: %s:%d: xent: label %d of sample %d is out of range [0, %d)", __FILE__, __LINE__,
                  (int)y, i, C);
        }
        loss += (double)loss_h[i];
        correct += status_h[i];
    }
    *loss_sum_host += loss;
    *correct_host += correct;
}

/* ---- life cycle ---- */

/* Frees what backend_new made, whatever got made; NULL handles are skipped.
 * Errors are ignored: this also runs on the failure path of backend_new. */
static void ctx_release(cuda_ctx_t *c)
{
    if (c->compute) (void)cudaStreamSynchronize(c->compute);
    if (c->copy) (void)cudaStreamSynchronize(c->copy);
    for (int i = 0; i < STAGE_SLOTS; i++) {
        if (c->stage[i].buf) (void)cudaFreeHost(c->stage[i].buf);
        if (c->stage[i].ev) (void)cudaEventDestroy(c->stage[i].ev);
    }
    for (int i = 0; i < N_TICKETS; i++) {
        if (c->tickets[i].ready) (void)cudaEventDestroy(c->tickets[i].ready);
        if (c->tickets[i].done) (void)cudaEventDestroy(c->tickets[i].done);
    }
    if (c->xent_dev) (void)cudaFree(c->xent_dev);
    if (c->xent_host) (void)cudaFreeHost(c->xent_host);
    if (c->blas) (void)cublasDestroy(c->blas);
    if (c->compute) (void)cudaStreamDestroy(c->compute);
    if (c->copy) (void)cudaStreamDestroy(c->copy);
    free(c);
}

static void cuda_destroy(psw_backend_t *be)
{
    cuda_ctx_t *c = use(be);
    CUDA_CHECK(cudaStreamSynchronize(c->compute));
    CUDA_CHECK(cudaStreamSynchronize(c->copy));
    ctx_release(c);
    free(be);
}

/* "12.4" from CUDA's 12040. */
static void cuda_version(char *out, size_t len, int v)
{
    snprintf(out, len, "%d.%d", v / 1000, v % 1000 / 10);
}

/* Without a GPU or driver this is the expected way out, so the message
 * says what it means, short, no file:line: no driver at all (CUDA's "driver
 * version is insufficient", error 35, with a driver version of 0), a driver
 * older than the runtime this plugin was built with (35 too), no device
 * (error 100). */
static int cuda_device_count(char *err, size_t errlen)
{
    int n = 0, drv = 0, rt = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e == cudaSuccess) return n;
    (void)cudaGetLastError();
    if (cudaDriverGetVersion(&drv) != cudaSuccess) drv = -1; /* not known */
    if (cudaRuntimeGetVersion(&rt) != cudaSuccess) rt = 0;
    (void)cudaGetLastError();
    char dv[16], rv[16];
    cuda_version(dv, sizeof dv, drv);
    cuda_version(rv, sizeof rv, rt);
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (drv == 0)
        snprintf(err, errlen, "no NVIDIA driver on this machine");
    else if (e == cudaErrorInsufficientDriver && drv > 0 && rt > 0)
        snprintf(err, errlen, "the NVIDIA driver (CUDA %s) is too old for this build's CUDA runtime (CUDA %s)", dv, rv);
    else if (e == cudaErrorNoDevice && vis)
        snprintf(err, errlen, "no CUDA device visible with CUDA_VISIBLE_DEVICES='%s'", vis);
    else if (e == cudaErrorNoDevice)
        snprintf(err, errlen, "the NVIDIA driver finds no CUDA device");
    else
        snprintf(err, errlen, "cudaGetDeviceCount: %s (error %d)", cudaGetErrorString(e), (int)e);
    return -1;
}

static int cuda_device_name(int dev, char *name, size_t len)
{
    cudaDeviceProp p;
    if (cudaGetDeviceProperties(&p, dev) != cudaSuccess) {
        (void)cudaGetLastError();
        snprintf(name, len, "device %d (unknown)", dev);
        return -1;
    }
    snprintf(name, len, "%s (sm_%d%d, %.1f GiB)", p.name, p.major, p.minor,
             (double)p.totalGlobalMem / (double)(1u << 30));
    return 0;
}

static psw_backend_t *cuda_backend_new(int dev, char *err, size_t errlen)
{
    psw_backend_t *be = NULL;
    cuda_ctx_t *c = NULL;
    int n = 0;
    CUDA_TRY(cudaGetDeviceCount(&n));
    if (dev < 0 || dev >= n) {
        snprintf(err, errlen, "no CUDA device %d (%d visible)", dev, n);
        goto fail;
    }
    be = (psw_backend_t *)calloc(1, sizeof(*be));
    c = (cuda_ctx_t *)calloc(1, sizeof(*c));
    if (!be || !c) {
        snprintf(err, errlen, "out of host memory");
        goto fail;
    }
    c->dev = dev;
    CUDA_TRY(cudaSetDevice(dev));
    CUDA_TRY(cudaStreamCreateWithFlags(&c->compute, cudaStreamNonBlocking));
    CUDA_TRY(cudaStreamCreateWithFlags(&c->copy, cudaStreamNonBlocking));
    CUBLAS_TRY(cublasCreate(&c->blas));
    CUBLAS_TRY(cublasSetStream(c->blas, c->compute));
    CUBLAS_TRY(cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH)); /* fp32, no TF32 */
    CUBLAS_TRY(cublasSetPointerMode(c->blas, CUBLAS_POINTER_MODE_HOST));
    for (int i = 0; i < N_TICKETS; i++) {
        CUDA_TRY(cudaEventCreateWithFlags(&c->tickets[i].ready, cudaEventDisableTiming));
        CUDA_TRY(cudaEventCreateWithFlags(&c->tickets[i].done, cudaEventDisableTiming));
    }
    for (int i = 0; i < STAGE_SLOTS; i++) {
        CUDA_TRY(cudaMallocHost(&c->stage[i].buf, STAGE_BYTES));
        CUDA_TRY(cudaEventCreateWithFlags(&c->stage[i].ev, cudaEventDisableTiming));
    }

    be->name = "cuda";
    be->ctx = c;
    be->host_visible = 0;
    be->host_alloc = cuda_host_alloc;
    be->host_free = cuda_host_free;
    be->download_async = cuda_download_async;
    be->wait = cuda_wait;
    be->alloc = cuda_alloc;
    be->free = cuda_free;
    be->upload = cuda_upload;
    be->download = cuda_download;
    be->sync = cuda_sync;
    be->linear_fwd = cuda_linear_fwd;
    be->linear_bwd = cuda_linear_bwd;
    be->relu_fwd = cuda_relu_fwd;
    be->relu_bwd = cuda_relu_bwd;
    be->xent = cuda_xent;
    be->zero = cuda_zero;
    be->embag_fwd = cuda_embag_fwd;
    be->embag_bwd = cuda_embag_bwd;
    be->scatter_rows = cuda_scatter_rows;
    be->gather_rows = cuda_gather_rows;
    be->destroy = cuda_destroy;
    return be;

fail:
    if (c) ctx_release(c);
    free(be);
    return NULL;
}

static const psw_cuda_plugin_t plugin = {
    PSW_CUDA_ABI,
    cuda_device_count,
    cuda_device_name,
    cuda_backend_new,
    cuda_set_fatal_hook,
};

extern "C" __attribute__((visibility("default"))) const psw_cuda_plugin_t *psw_cuda_plugin(void)
{
    return &plugin;
}
