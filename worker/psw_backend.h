/* psw_backend.h - the compute backend interface of a worker.
 *
 * A backend is a table of functions over buffers it allocates ("device"
 * memory: host memory for the CPU backend, GPU memory for CUDA). Every op has
 * the same signature in every backend: outputs first, then inputs, then sizes.
 * Matrices are row-major. Ops may run asynchronously; host results are
 * complete after backend->sync(). The CPU backend (worker/cpu) is the
 * reference the others are tested against. */
#ifndef PSW_BACKEND_H
#define PSW_BACKEND_H

#include <stddef.h>
#include <stdint.h>

typedef struct psw_backend psw_backend_t;

struct psw_backend {
    const char *name; /* "cpu", "cuda" */
    void *ctx;        /* backend private */
    int host_visible; /* 1: device buffers are host memory (CPU backend) */
    /* bytes copied host -> device (upload) and device -> host (download,
     * download_async) so far: what a step costs the bus */
    uint64_t bytes_up, bytes_down;

    /* host buffers for the wire: pinned (page-locked) for CUDA, so that
     * copies are asynchronous; plain aligned memory for the CPU backend */
    void *(*host_alloc)(psw_backend_t *be, size_t bytes);
    void (*host_free)(psw_backend_t *be, void *p);
    /* Start copying bytes device -> host (dst from host_alloc) once all work
     * queued so far has finished, without holding up later work. Returns a
     * ticket for wait(); tickets are small integers reused after wait. */
    int (*download_async)(psw_backend_t *be, void *dst_host, const void *src, size_t bytes);
    /* Block until the copy with this ticket is complete. */
    void (*wait)(psw_backend_t *be, int ticket);

    /* memory: device buffers, zero-filled on alloc */
    void *(*alloc)(psw_backend_t *be, size_t bytes);
    void (*free)(psw_backend_t *be, void *p);
    void (*upload)(psw_backend_t *be, void *dst, const void *src_host, size_t bytes);
    void (*download)(psw_backend_t *be, void *dst_host, const void *src, size_t bytes);
    void (*sync)(psw_backend_t *be);
    /* bytes at p (a device buffer) = 0, in order with the ops queued */
    void (*zero)(psw_backend_t *be, void *p, size_t bytes);

    /* y (B,out) = x (B,in) @ W^T + b, with W (out,in), b (out) */
    void (*linear_fwd)(psw_backend_t *be, float *y, const float *x, const float *W,
                       const float *b, int B, int in, int out);
    /* dW (out,in) = dy^T @ x ; db (out) = sum over B of dy ; dx (B,in) = dy @ W.
     * dW and db are overwritten (not accumulated); dx may be NULL (first layer). */
    void (*linear_bwd)(psw_backend_t *be, float *dx, float *dW, float *db, const float *dy,
                       const float *x, const float *W, int B, int in, int out);
    /* y = max(x, 0), n elements; y may equal x */
    void (*relu_fwd)(psw_backend_t *be, float *y, const float *x, size_t n);
    /* dx = dy * (y > 0); dx may equal dy */
    void (*relu_bwd)(psw_backend_t *be, float *dx, const float *dy, const float *y, size_t n);
    /* Softmax cross-entropy over logits (B,C) with int32 labels (B) in device
     * memory. Adds sum over the batch of -log softmax(logits)[label] (computed
     * per sample in float with max-subtraction, summed in double) to
     * *loss_sum_host, and the number of samples whose argmax (first maximum)
     * equals the label to *correct_host; both are host pointers, valid after
     * the call returns. If dlogits is not NULL, writes
     * dlogits = (softmax - onehot(label)) * grad_scale. */
    void (*xent)(psw_backend_t *be, float *dlogits, const float *logits, const int32_t *labels,
                 int B, int C, float grad_scale, double *loss_sum_host, int64_t *correct_host);

    /* Embedding bags (sparse features): for every bag k = b * F + f (example
     * b, field f), y (B, F*D) holds at [b][f*D, f*D + D) the sum over j < m of
     * the rows E[ids[k*m + j]] of E (rows, D), added in the order of j, and
     * with mean != 0 multiplied by 1/m. ids (B*F*m, device memory) must be
     * rows of E. */
    void (*embag_fwd)(psw_backend_t *be, float *y, const float *E, const uint32_t *ids, int B, int F, int m, int D,
                      int mean);
    /* dE (rows, D) += for every bag k in order and every j in order, dy's
     * slice of bag k (times 1/m with mean) added to row ids[k*m + j]: the same
     * additions in the same order on every backend, so the same bits. The
     * caller zeroes dE first for a fresh gradient. */
    void (*embag_bwd)(psw_backend_t *be, float *dE, const float *dy, const uint32_t *ids, int B, int F, int m,
                      int D, int mean);

    /* Rows of a table E (rows, D) in device memory, ids (n, device memory)
     * rows of E: scatter_rows sets E[ids[j]] = vals[j] (vals n x D), ids
     * distinct; gather_rows sets out[j] = E[ids[j]] (out n x D). So a
     * replica of a table moves by the rows that changed, not whole. */
    void (*scatter_rows)(psw_backend_t *be, float *E, const uint32_t *ids, const float *vals, size_t n, int D);
    void (*gather_rows)(psw_backend_t *be, float *out, const float *E, const uint32_t *ids, size_t n, int D);

    /* Release everything; be is freed. */
    void (*destroy)(psw_backend_t *be);
};

/* The CPU backend on OpenBLAS with `threads` BLAS threads (0 = leave as is).
 * Caller owns the result (be->destroy(be)). */
psw_backend_t *psw_backend_cpu_new(int threads);

/* If OpenBLAS chose generic kernels on a CPU with AVX2/AVX-512, set
 * OPENBLAS_CORETYPE and re-exec argv (returns only if nothing to do). Call
 * first thing in main. */
void psw_blas_tune(char **argv);
/* Name of the OpenBLAS kernels in use ("SkylakeX"). */
const char *psw_blas_core(void);

#endif
