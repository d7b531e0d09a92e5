/* table_worker.c - a test worker for any table psd gives it (model.kind
 * tensors), through the public worker API only. It fits every tensor to a
 * target drawn from (tensor, element), scaled by the batch: the gradient of
 * tensor k is w - m c_k, m the mean over the batch of a number of each
 * sample. Each tensor is pushed from its own buffer (the library packs the
 * small ones into units); a sparse-rows tensor as the rows the batch
 * touches (row s mod rows of sample s), where psd takes rows (every
 * sparse-rows tensor of the table so).
 *
 *   table_worker ENDPOINT TRAIN TEST [flat] [wire]
 *                                      train (data.train_size, test_size);
 *                                      flat: the gradients in one buffer laid
 *                                      out as psd lays them out (psw_tensor_t
 *                                      .offset: pushed without copies), wire:
 *                                      no shared memory with psd, parts: each
 *                                      push in two calls (tensor 0, then the
 *                                      rest; between them tensor 0 again,
 *                                      refused while its unit waits),
 *                                      offer=N: offer the table of --yaml N
 *                                      with values of its own (from_worker),
 *                                      id=S: S is its data's fingerprint,
 *                                      sums: validation answers carry the
 *                                      named sum sev (0.25 (s mod 7) over
 *                                      the part's samples s) and correct
 *                                      counts the samples s with s mod 3 0,
 *                                      script=a,b,...: epoch e's validation
 *                                      loss is the e-th number (the closing
 *                                      test's: the weights' own), die=K:
 *                                      SIGKILL itself after K pushes,
 *                                      slow=MS: sleep MS before each push
 *   table_worker --yaml N [small]      print a model.tensors list of N
 *                                      assorted tensors: scalars, vectors,
 *                                      matrices, one of 1,100,000 floats
 *                                      every 100th (not with small),
 *                                      tensors 7 and 21 sparse rows */
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "psworker.h"

/* Tensor k of the assorted table (--yaml), and its init's name. */
static const char *assorted(int k, int big, psw_tensor_t *t)
{
    static const char *const part[4] = {"weight", "bias", "norm", "scale"};
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "layers.%d.%s", k / 4, part[k % 4]);
    const char *init = "zeros";
    if (k == 7) t->ndim = 2, t->shape[0] = 1000, t->shape[1] = 8, t->sparse_rows = 1, init = "\"normal:0.02\"";
    else if (k == 21) t->ndim = 2, t->shape[0] = 300, t->shape[1] = 4, t->sparse_rows = 1, init = "\"uniform:0.1\"";
    else if (k % 100 == 50 && big) t->ndim = 1, t->shape[0] = 1100000, init = "\"uniform:0.01\"";
    else if (k % 4 == 0) t->ndim = 2, t->shape[0] = 8 + k % 5, t->shape[1] = 3 + k % 7, init = "kaiming_uniform";
    else if (k % 4 == 3) t->ndim = 0, init = "ones";
    else t->ndim = 1, t->shape[0] = 1 + (uint64_t)(k % 11);
    t->numel = 1;
    for (int d = 0; d < t->ndim; d++) t->numel *= t->shape[d];
    return init;
}

static void yaml(int n, int big)
{
    printf("model:\n  kind: tensors\n  tensors:\n");
    for (int k = 0; k < n; k++) {
        psw_tensor_t t;
        const char *init = assorted(k, big, &t);
        printf("    - {name: %s, shape: [", t.name);
        for (int d = 0; d < t.ndim; d++) printf("%s%llu", d ? ", " : "", (unsigned long long)t.shape[d]);
        printf("], init: %s%s}\n", init, t.sparse_rows ? ", kind: sparse_rows" : "");
    }
}

static double m_of(uint32_t s) { return 0.5 + (double)(s % 13) / 13.0; }

int main(int argc, char **argv)
{
    if (argc >= 3 && strcmp(argv[1], "--yaml") == 0) {
        yaml(atoi(argv[2]), argc == 3 || strcmp(argv[3], "small") != 0);
        return 0;
    }
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1};
    int flat = 0, parts = 0, n_offer = 0, sums = 0, n_script = 0, die = 0, pushes = 0, slow_ms = 0;
    const char *data_id = NULL;
    double script[64];
    for (int i = 4; i < argc; i++) {
        if (strncmp(argv[i], "id=", 3) == 0) data_id = argv[i] + 3;
        if (strcmp(argv[i], "sums") == 0) sums = 1;
        if (strncmp(argv[i], "die=", 4) == 0) die = atoi(argv[i] + 4);
        if (strncmp(argv[i], "slow=", 5) == 0) slow_ms = atoi(argv[i] + 5);
        for (char *p = strncmp(argv[i], "script=", 7) == 0 ? argv[i] + 7 : NULL; p && *p && n_script < 64;) {
            script[n_script++] = strtod(p, &p);
            if (*p == ',') p++;
        }
        if (strncmp(argv[i], "offer=", 6) == 0) n_offer = atoi(argv[i] + 6);
        if (strcmp(argv[i], "flat") == 0) flat = 1;
        if (strcmp(argv[i], "parts") == 0) parts = 1;
        if (strcmp(argv[i], "wire") == 0) info.no_shm = 1;
    }
    psw_tensor_t *offer = n_offer > 0 ? calloc((size_t)n_offer, sizeof *offer) : NULL;
    float **values = n_offer > 0 ? calloc((size_t)n_offer, sizeof *values) : NULL;
    for (int k = 0; k < n_offer; k++) { /* the assorted table (--yaml N) and values of its own */
        assorted(k, 1, &offer[k]);
        values[k] = malloc(offer[k].numel * sizeof(float));
        for (uint64_t j = 0; j < offer[k].numel; j++) values[k][j] = (float)(0.01 * cos(0.3 * k + 0.001 * (double)j));
    }
    info.n_offer = n_offer, info.offer = offer, info.offer_values = (const float *const *)values;
    psw_client_t *c = argc >= 4 ? psw_client_new(argv[1], &info, err, sizeof err) : NULL;
    psw_assign_t a;
    if (!c || psw_client_register(c, &a, 60, err, sizeof err) != 0) {
        fprintf(stderr, "table_worker: %s\n", argc >= 4 ? err : "usage: table_worker ENDPOINT TRAIN TEST [flat] [wire] | --yaml N [small]");
        return 1;
    }
    const int n = a.n_tensors;
    float **cst = calloc((size_t)n, sizeof *cst), **grad = calloc((size_t)n, sizeof *grad);
    psw_grad_t *g = calloc((size_t)n, sizeof *g);
    uint32_t **rows = calloc((size_t)n, sizeof *rows); /* a sparse tensor's rows a batch touches */
    uint64_t end = 0;
    for (int k = 0; k < n; k++)
        if (a.tensors[k].offset + a.tensors[k].numel > end) end = a.tensors[k].offset + a.tensors[k].numel;
    float *all = flat ? calloc(end, sizeof *all) : NULL;
    for (int k = 0; k < n; k++) {
        cst[k] = malloc(a.tensors[k].numel * sizeof(float));
        grad[k] = flat ? all + a.tensors[k].offset : malloc(a.tensors[k].numel * sizeof(float));
        for (uint64_t j = 0; j < a.tensors[k].numel; j++) cst[k][j] = (float)(0.1 * sin(0.37 * k + 0.011 * (double)j));
    }
    psw_client_ready(c, strtoull(argv[2], NULL, 10), strtoull(argv[3], NULL, 10), data_id);
    uint32_t *ids = NULL, epoch = 0;
    size_t n_ids = 0, pos = 0;
    for (;;) {
        psw_event_t ev;
        int rc = psw_client_next(c, &ev, 120, err, sizeof err);
        if (rc != 0) {
            fprintf(stderr, "table_worker: %s\n", err);
            return 1;
        }
        if (ev.kind == PSW_EV_SHUTDOWN) {
            int code = ev.exit_code;
            if (code) fprintf(stderr, "table_worker: psd ended this worker (%d): %s\n", code, ev.message);
            psw_client_destroy(&c);
            for (int k = 0; k < n; k++) {
                free(cst[k]);
                if (!flat) free(grad[k]);
            }
            for (int k = 0; k < n_offer; k++) free(values[k]);
            for (int k = 0; k < n; k++) free(rows[k]);
            free(cst), free(grad), free(g), free(all), free(rows), free(ids), free(offer), free(values);
            return code;
        } else if (ev.kind == PSW_EV_EPOCH) {
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
        } else if (ev.kind == PSW_EV_WEIGHTS) {
            while (!psw_client_push_done(c)) {
            }
            size_t b = n_ids - pos < a.batch_size ? n_ids - pos : a.batch_size, nr = 0;
            double m = 0, loss = 0;
            for (size_t j = 0; j < b; j++) m += m_of(ids[pos + j]) / (double)b;
            for (int k = 0; k < n; k++) {
                for (uint64_t j = 0; j < a.tensors[k].numel; j++) {
                    float d = ev.tensors[k][j] - (float)m * cst[k][j];
                    grad[k][j] = d;
                    loss += 0.5 * (double)d * d;
                }
                g[k] = (psw_grad_t){.tensor = (uint32_t)k, .data = grad[k]};
            }
            for (int sparse = 0; sparse < n; sparse++) { /* only the rows the batch touches */
                if (!a.tensors[sparse].sparse_rows) continue;
                const uint64_t R = a.tensors[sparse].shape[0], D = a.tensors[sparse].numel / R;
                char *hit = calloc(R, 1);
                uint32_t *rs = realloc(rows[sparse], R * sizeof *rs);
                if (!hit || !rs) {
                    fprintf(stderr, "table_worker: out of memory\n");
                    return 1;
                }
                rows[sparse] = rs;
                nr = 0;
                for (size_t j = 0; j < b; j++) hit[ids[pos + j] % R] = 1;
                for (uint64_t r = 0; r < R; r++)
                    if (hit[r]) rs[nr++] = (uint32_t)r;
                    else memset(grad[sparse] + r * D, 0, D * sizeof(float));
                for (size_t i = 0; i < nr && psw_client_rows_ok(c); i++) /* the rows' gradients, packed */
                    memmove(grad[sparse] + i * D, grad[sparse] + rs[i] * D, D * sizeof(float));
                if (psw_client_rows_ok(c))
                    g[sparse] = (psw_grad_t){.tensor = (uint32_t)sparse, .row_ids = rs, .n_rows = nr,
                                             .row_vals = grad[sparse]};
                free(hit);
            }
            pos += b;
            int last = pos >= n_ids;
            if (slow_ms > 0) nanosleep(&(struct timespec){slow_ms / 1000, (long)(slow_ms % 1000) * 1000000L}, NULL);
            psw_push_t p = {ev.version, (uint32_t)b, loss * (double)b, 0, !last, n, g, NULL, 0};
            if (parts && n >= 2) { /* tensor 0 alone, again (refused where it waits for the rest of its unit), the rest */
                psw_push_t p1 = p;
                p1.pull = 0, p1.n_grads = 1;
                rc = psw_client_push_v(c, &p1);
                if (rc == 0 && a.tensors[1].offset == a.tensors[0].offset + a.tensors[0].numel &&
                    psw_client_push_v(c, &p1) != -EINVAL) { /* packed with tensor 1: its unit waits */
                    fprintf(stderr, "table_worker: a tensor pushed twice was taken\n");
                    return 1;
                }
                p.n_grads = n - 1, p.grads = g + 1;
            }
            if (rc == 0) rc = psw_client_push_v(c, &p);
            if (die && ++pushes == die) raise(SIGKILL); /* a worker lost mid-epoch */
            if (rc == 0 && last) rc = psw_client_barrier(c, epoch, n_ids);
        } else if (ev.kind == PSW_EV_VALIDATE) {
            double loss = 0, sev = 0;
            uint64_t right = 0;
            for (int k = 0; k < n; k++)
                for (uint64_t j = 0; j < a.tensors[k].numel; j++) {
                    double d = (double)ev.tensors[k][j] - cst[k][j];
                    loss += 0.5 * d * d;
                }
            if (!ev.final && ev.epoch < (uint32_t)n_script) loss = script[ev.epoch];
            for (size_t i = 0; i < ev.n_val_ids; i++) {
                sev += 0.25 * (double)(ev.val_ids[i] % 7);
                right += ev.val_ids[i] % 3 == 0;
            }
            psw_val_t r = psw_val_for(&ev);
            psw_sum_t sv = {"sev", sev};
            r.loss_sum = loss * (double)ev.n_val_ids;
            if (sums) r.correct = right, r.n_sums = 1, r.sums = &sv;
            rc = psw_client_val_result(c, &r);
        }
        if (rc != 0) {
            fprintf(stderr, "table_worker: psd is gone (%d)\n", rc);
            return 1;
        }
    }
}
