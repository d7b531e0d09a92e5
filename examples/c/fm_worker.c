/* fm_worker.c - a psd worker for a model psd has never heard of: a
 * factorization machine (Rendle 2010) on click data made from each
 * example's index. It uses only the public header, psworker.h:
 *
 *   cc -O2 fm_worker.c $(pkg-config --cflags --libs psworker) -lm -o fm_worker
 *   psd --config fm.yaml &   ./fm_worker tcp://127.0.0.1:5555 &   ./fm_worker tcp://127.0.0.1:5555
 *
 * With "offer" after the endpoint it offers its model (tensors and initial
 * values) for psd's model.kind from_worker (a number after it: the factors'
 * width it claims, to see psd refuse a model that is not the run's).
 *
 * psd holds the tensors fm.yaml lists (bias [1], linear [F*V], factors
 * [F*V, K]), hands out sample indices and steps them; this program computes
 * the gradients of the log-loss. An example has F fields, each one of V
 * values; its feature ids are field * V + value. */
#include <math.h>
#include <psworker.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { F = 8, V = 500, N = F * V, K = 8, TRAIN = 200000, TEST = 10000 };

static uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}
static double unit(uint64_t z) { return (double)(mix(z) >> 11) / 9007199254740992.0; }

/* Example i: its features and its click, drawn from a planted model whose
 * score is a sum of per-feature weights and one pairwise term. */
static int example(uint64_t i, int feat[F])
{
    double s = -0.5;
    for (int f = 0; f < F; f++) {
        feat[f] = f * V + (int)(mix(i * 16 + (uint64_t)f + 1) % V);
        s += 2.0 * unit((uint64_t)feat[f] * 7919 + 3) - 1.0;
    }
    s += (feat[0] % 2 == feat[1] % 2) ? 1.0 : -1.0;
    return unit(i * 16 + 15) < 1.0 / (1.0 + exp(-s));
}

/* The model's score of an example and, with g, the gradient of its log-loss
 * (scaled by w) added in. t: bias, linear, factors. Returns the loss. */
static double fm(const float *const t[3], const int feat[F], int y, float *const g[3], float w, int *hit)
{
    double sum[K] = {0}, sq = 0, score = t[0][0];
    for (int f = 0; f < F; f++) {
        score += t[1][feat[f]];
        for (int k = 0; k < K; k++) {
            double v = t[2][feat[f] * K + k];
            sum[k] += v, sq += v * v;
        }
    }
    for (int k = 0; k < K; k++) score += 0.5 * sum[k] * sum[k];
    score -= 0.5 * sq;
    double p = 1.0 / (1.0 + exp(-score));
    *hit = (p > 0.5) == (y == 1);
    if (g) {
        float d = (float)(p - y) * w;
        g[0][0] += d;
        for (int f = 0; f < F; f++) {
            g[1][feat[f]] += d;
            for (int k = 0; k < K; k++) g[2][feat[f] * K + k] += d * (float)(sum[k] - t[2][feat[f] * K + k]);
        }
    }
    return y ? -log(p > 1e-12 ? p : 1e-12) : -log(1 - p > 1e-12 ? 1 - p : 1e-12);
}

int main(int argc, char **argv)
{
    static const char *const names[3] = {"bias", "linear.weight", "factors.weight"};
    static const size_t sizes[3] = {1, N, (size_t)N * K};
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1};
    psw_tensor_t offer[3] = {{.name = "bias", .ndim = 1, .shape = {1}}, {.name = "linear.weight", .ndim = 1, .shape = {N}},
                             {.name = "factors.weight", .ndim = 2, .shape = {N, K}}};
    float *init = calloc(1 + N + (size_t)N * K, sizeof *init); /* zeros, zeros, U(-0.01, 0.01) */
    for (size_t i = 0; i < (size_t)N * K; i++) init[1 + N + i] = 0.02f * (float)(unit(i * 3 + 7) - 0.5);
    const float *values[3] = {init, init + 1, init + 1 + N};
    if (argc >= 3 && strcmp(argv[2], "offer") == 0) {
        offer[2].shape[1] = argc == 4 ? (uint64_t)atoi(argv[3]) : K;
        info.n_offer = 3, info.offer = offer, info.offer_values = values;
    }
    psw_client_t *c = argc >= 2 ? psw_client_new(argv[1], &info, err, sizeof err) : NULL;
    psw_assign_t a;
    if (!c || psw_client_register(c, &a, 60, err, sizeof err) != 0) {
        fprintf(stderr, "fm_worker: %s\n", argc >= 2 ? err : "usage: fm_worker ENDPOINT [offer [K]]");
        return 1;
    }
    int id[3] = {-1, -1, -1}; /* each tensor's index in psd's table */
    for (int i = 0; i < a.n_tensors; i++)
        for (int k = 0; k < 3; k++)
            if (strcmp(a.tensors[i].name, names[k]) == 0 && a.tensors[i].numel == sizes[k]) id[k] = i;
    if (a.model != PSW_MODEL_TENSORS || a.n_tensors != 3 || id[0] < 0 || id[1] < 0 || id[2] < 0) {
        psw_client_fail(c, 1, "not the factorization machine's tensors (fm.yaml)");
        fprintf(stderr, "fm_worker: psd's model is not fm.yaml's\n");
        return 1;
    }
    psw_client_ready(c, TRAIN, TEST, "fm-synthetic-v1"); /* a fingerprint: the generator's version */
    float *grad[3];
    for (int k = 0; k < 3; k++) grad[k] = malloc(sizes[k] * sizeof(float));
    uint32_t *ids = NULL;
    size_t n_ids = 0, pos = 0;
    uint32_t epoch = 0;
    for (;;) {
        psw_event_t ev;
        int rc = psw_client_next(c, &ev, 120, err, sizeof err);
        if (rc != 0) {
            fprintf(stderr, "fm_worker: %s\n", err);
            return 1;
        }
        const float *t[3] = {ev.tensors[id[0]], ev.tensors[id[1]], ev.tensors[id[2]]};
        if (ev.kind == PSW_EV_SHUTDOWN) {
            psw_client_destroy(&c);
            return ev.exit_code;
        } else if (ev.kind == PSW_EV_EPOCH) { /* this worker's samples of the epoch (or more of them) */
            size_t keep = ev.append ? n_ids : 0;
            if (ev.keep) n_ids = ev.keep;
            if (ev.keep) continue;
            ids = realloc(ids, (keep + ev.n_samples + 1) * sizeof *ids);
            memcpy(ids + keep, ev.samples, ev.n_samples * sizeof *ids);
            n_ids = keep + ev.n_samples;
            int idle = !ev.append || pos >= keep;
            if (!ev.append) pos = 0;
            epoch = ev.epoch;
            if (pos >= n_ids) rc = psw_client_barrier(c, epoch, n_ids);
            else if (idle) rc = psw_client_pull(c, ev.version);
        } else if (ev.kind == PSW_EV_WEIGHTS) { /* a step on the next batch */
            while (!psw_client_push_done(c)) {
            }
            size_t b = n_ids - pos < a.batch_size ? n_ids - pos : a.batch_size;
            double loss = 0;
            uint64_t right = 0;
            for (int k = 0; k < 3; k++) memset(grad[k], 0, sizes[k] * sizeof(float));
            for (size_t j = 0; j < b; j++) {
                int feat[F], hit, y = example(ids[pos + j], feat);
                loss += fm(t, feat, y, grad, 1.0f / (float)b, &hit);
                right += (uint64_t)hit;
            }
            pos += b;
            int last = pos >= n_ids;
            psw_grad_t g[3];
            for (int k = 0; k < 3; k++) g[k] = (psw_grad_t){.tensor = (uint32_t)id[k], .data = grad[k]};
            psw_push_t p = {ev.version, (uint32_t)b, loss, right, !last, 3, g, NULL, 0};
            rc = psw_client_push_v(c, &p);
            if (rc == 0 && last) rc = psw_client_barrier(c, epoch, n_ids);
        } else if (ev.kind == PSW_EV_VALIDATE) { /* test examples follow the TRAIN training ones */
            psw_val_t r = psw_val_for(&ev);
            for (size_t i = 0; i < ev.n_val_ids; i++) {
                uint64_t s = ev.split == PSW_SPLIT_TEST ? TRAIN + ev.val_ids[i] : ev.val_ids[i];
                int feat[F], hit, y = example(s, feat);
                r.loss_sum += fm(t, feat, y, NULL, 0, &hit);
                r.correct += (uint64_t)hit;
            }
            rc = psw_client_val_result(c, &r);
        }
        if (rc != 0) {
            fprintf(stderr, "fm_worker: psd is gone (%d)\n", rc);
            return 1;
        }
    }
}
