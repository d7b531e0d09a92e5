/* gpu_step.c - time one training step (forward + backward, no optimiser) of
 * an MLP on the CUDA backend; bench/torch_gpu_step.py does the same in
 * PyTorch on the same GPU.
 *
 *   gpu_step [--steps N] [--warmup N] [--batch B] [--device D]
 *
 * Model 784-4096-4096-10 (ReLU, softmax cross-entropy), fp32, batch 512,
 * seeded random inputs in [0, 1) and labels, made once in host memory.
 * 20 warm-up steps, then 200 timed ones; the clock stops after be->sync.
 *
 * Two numbers:
 *   ms_per_step           psw_model_train_step, as pworker runs it: each step
 *                         uploads the batch from host memory (through the
 *                         backend's pinned staging buffers) and xent waits
 *                         for the loss on the host.
 *   ms_per_step_resident  the same ops driven directly on a batch uploaded
 *                         once, as PyTorch does with a batch already on the
 *                         GPU (xent still waits for the loss).
 * tflops = flops per step / time per step, flops counted as 2*B*in*out per
 * GEMM: forward and dW for every layer, dx for every layer but the first.
 *
 * Last line: GPU_STEP {json}. No plugin or no GPU: "no CUDA device: ...",
 * exit 77 (the automake "skipped" code). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ps_model.h"
#include "ps_rng.h"
#include "psw_backend.h"
#include "cuda/psw_cuda.h"
#include "psw_model.h"

#define EXIT_SKIP 77

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int int_arg(int argc, char **argv, int *i, const char *name, int *v)
{
    if (strcmp(argv[*i], name) != 0) return 0;
    if (*i + 1 >= argc || (*v = atoi(argv[*i + 1])) < 0) {
        fprintf(stderr, "gpu_step: %s wants a number\n", name);
        exit(2);
    }
    (*i)++;
    return 1;
}

/* Device buffers for the resident variant: act[i] (B, sizes[i]), delta[2]
 * (B, max of sizes[1..L]), labels (B). */
typedef struct {
    float *act[PS_MAX_LAYERS + 1];
    float *delta[2];
    int32_t *labels;
} resident_t;

/* Forward + backward with the batch already in act[0] and labels: the ops
 * psw_model_train_step issues, without its two uploads. */
static void step_resident(psw_backend_t *be, const ps_layout_t *l, float *params, float *grads,
                          resident_t *r, int B, double *loss, int64_t *correct)
{
    const int L = l->n_layers;
    for (int i = 0; i < L; i++) {
        be->linear_fwd(be, r->act[i + 1], r->act[i], params + l->t[2 * i].offset,
                       params + l->t[2 * i + 1].offset, B, l->sizes[i], l->sizes[i + 1]);
        if (i < L - 1)
            be->relu_fwd(be, r->act[i + 1], r->act[i + 1], (size_t)B * (size_t)l->sizes[i + 1]);
    }
    be->xent(be, r->delta[0], r->act[L], r->labels, B, l->sizes[L], 1.0f / (float)B, loss, correct);
    int cur = 0;
    for (int i = L - 1; i >= 0; i--) {
        float *dx = i > 0 ? r->delta[1 - cur] : NULL;
        be->linear_bwd(be, dx, grads + l->t[2 * i].offset, grads + l->t[2 * i + 1].offset,
                       r->delta[cur], r->act[i], params + l->t[2 * i].offset, B, l->sizes[i],
                       l->sizes[i + 1]);
        if (dx) {
            be->relu_bwd(be, dx, dx, r->act[i], (size_t)B * (size_t)l->sizes[i]);
            cur = 1 - cur;
        }
    }
}

int main(int argc, char **argv)
{
    int steps = 200, warmup = 20, B = 512, dev = 0;
    for (int i = 1; i < argc; i++) {
        if (int_arg(argc, argv, &i, "--steps", &steps) ||
            int_arg(argc, argv, &i, "--warmup", &warmup) ||
            int_arg(argc, argv, &i, "--batch", &B) || int_arg(argc, argv, &i, "--device", &dev))
            continue;
        fprintf(stderr, "usage: gpu_step [--steps N] [--warmup N] [--batch B] [--device D]\n");
        return 2;
    }
    if (steps < 1 || B < 1) {
        fprintf(stderr, "gpu_step: --steps and --batch must be at least 1\n");
        return 2;
    }

    char err[512] = "";
    const psw_cuda_plugin_t *p = psw_cuda_load(err, sizeof err);
    if (!p) {
        printf("no CUDA device: %s\n", err);
        return EXIT_SKIP;
    }
    const int n_dev = p->device_count(err, sizeof err);
    if (n_dev < 1) {
        printf("no CUDA device: %s\n", n_dev < 0 ? err : "0 devices visible");
        return EXIT_SKIP;
    }
    if (dev >= n_dev) {
        fprintf(stderr, "gpu_step: no device %d (%d visible)\n", dev, n_dev);
        return 2;
    }
    char name[256];
    p->device_name(dev, name, sizeof name);
    for (char *c = name; *c; c++)
        if (*c == '"' || *c == '\\') *c = '\''; /* it goes into JSON */
    psw_backend_t *be = p->backend_new(dev, err, sizeof err);
    if (!be) {
        fprintf(stderr, "gpu_step: backend_new(%d): %s\n", dev, err);
        return 1;
    }

    const int sizes[] = {784, 4096, 4096, 10};
    const int n_sizes = (int)(sizeof sizes / sizeof sizes[0]);
    ps_layout_t l;
    if (ps_layout_init(&l, sizes, n_sizes) != 0) return 1;
    float *params = malloc(l.n_params * sizeof(float));
    float *x = malloc((size_t)B * sizes[0] * sizeof(float));
    int32_t *y = malloc((size_t)B * sizeof(int32_t));
    if (!params || !x || !y) return 1;
    ps_model_init_params(&l, params, 42);
    ps_rng_t r;
    ps_rng_seed(&r, 42, 1);
    for (size_t i = 0; i < (size_t)B * sizes[0]; i++) x[i] = ps_rng_uniform(&r);
    for (int i = 0; i < B; i++) y[i] = (int32_t)ps_rng_below(&r, (uint64_t)sizes[n_sizes - 1]);

    psw_model_t *m = psw_model_new(be, &l, B);
    if (!m) {
        fprintf(stderr, "gpu_step: psw_model_new: out of device memory\n");
        return 1;
    }
    psw_model_set_params(m, params);

    double flops = 0;
    for (int i = 0; i < l.n_layers; i++)
        flops += 2.0 * B * sizes[i] * sizes[i + 1] * (i == 0 ? 2 : 3);

    /* psw_model_train_step */
    double loss0 = 0;
    int64_t correct0 = 0;
    for (int s = 0; s < warmup; s++)
        psw_model_train_step(m, x, y, B, s == 0 ? &loss0 : NULL, s == 0 ? &correct0 : NULL, NULL,
                             NULL);
    be->sync(be);
    double t0 = now_s();
    for (int s = 0; s < steps; s++) psw_model_train_step(m, x, y, B, NULL, NULL, NULL, NULL);
    be->sync(be);
    const double dt = (now_s() - t0) / steps;

    /* resident: the batch uploaded once */
    resident_t res;
    memset(&res, 0, sizeof res);
    int max_out = 1;
    for (int i = 1; i < n_sizes; i++) max_out = sizes[i] > max_out ? sizes[i] : max_out;
    for (int i = 0; i < n_sizes; i++)
        res.act[i] = be->alloc(be, (size_t)B * sizes[i] * sizeof(float));
    for (int i = 0; i < 2; i++) res.delta[i] = be->alloc(be, (size_t)B * max_out * sizeof(float));
    res.labels = be->alloc(be, (size_t)B * sizeof(int32_t));
    for (int i = 0; i < n_sizes; i++)
        if (!res.act[i]) return 1;
    if (!res.delta[0] || !res.delta[1] || !res.labels) return 1;
    be->upload(be, res.act[0], x, (size_t)B * sizes[0] * sizeof(float));
    be->upload(be, res.labels, y, (size_t)B * sizeof(int32_t));
    float *P = psw_model_params(m), *G = psw_model_grads(m);
    double loss_r = 0, sink = 0;
    int64_t correct_r = 0, csink = 0;
    for (int s = 0; s < warmup; s++)
        step_resident(be, &l, P, G, &res, B, s == 0 ? &loss_r : &sink,
                      s == 0 ? &correct_r : &csink);
    be->sync(be);
    t0 = now_s();
    for (int s = 0; s < steps; s++) step_resident(be, &l, P, G, &res, B, &sink, &csink);
    be->sync(be);
    const double dt_r = (now_s() - t0) / steps;

    fprintf(stderr, "gpu_step: %s, MLP 784-4096-4096-10, batch %d, %d+%d steps, first loss %.4f "
            "(%.4f resident)\n", name, B, warmup, steps, loss0 / B, loss_r / B);
    printf("GPU_STEP {\"ms_per_step\": %.4f, \"steps_per_s\": %.2f, \"tflops\": %.3f, "
           "\"ms_per_step_resident\": %.4f, \"tflops_resident\": %.3f, \"batch\": %d, "
           "\"layers\": [784, 4096, 4096, 10], \"steps\": %d, \"warmup\": %d, "
           "\"first_loss\": %.6f, \"device\": \"%s\"}\n",
           dt * 1e3, 1.0 / dt, flops / dt * 1e-12, dt_r * 1e3, flops / dt_r * 1e-12, B, steps,
           warmup, loss0 / B, name);

    for (int i = 0; i < n_sizes; i++) be->free(be, res.act[i]);
    for (int i = 0; i < 2; i++) be->free(be, res.delta[i]);
    be->free(be, res.labels);
    psw_model_destroy(&m);
    be->destroy(be);
    free(params);
    free(x);
    free(y);
    return 0;
}
