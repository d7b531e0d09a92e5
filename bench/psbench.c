/* psbench - communication-only load generator for psd: W simulated workers
 * (threads, one psd client each) that speak the real protocol but do no
 * math. Each round a worker pushes a zero gradient of the model's size and
 * asks for the next weights (push+pull, synchronous: psd steps once every
 * worker has pushed). Not a test.
 *
 *   psd --workers W --set 'model.layers=[784,1338]' ... &     (a 4 MiB tensor)
 *   build/psbench --connect tcp://127.0.0.1:5555 --workers W [--key K --server-key P]
 *
 * Prints, over the training rounds of the run (validation excluded): rounds,
 * push+pull GB/s per worker and aggregate ((bytes pushed + bytes pulled) /
 * time), and round-latency percentiles (push sent -> next weights received).
 * With --pulls N each worker first pulls N times in a row (psd answers each
 * at once with the current version: no step), and the pull-only GB/s (bytes
 * pulled / time) and latencies are printed too.
 *
 * Sync or async is psd's choice (train.sync: bsp | async | ssp): in bsp a
 * round ends when every worker has pushed and psd has stepped; in async psd
 * applies each push as it comes and answers at once (ssp: unless the worker
 * is train.staleness steps ahead of the slowest). psbench prints the mode it
 * ran against. */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <zlib.h>

#include "bench_util.h"
#include "ps_auth.h"
#include "ps_config.h"
#include "ps_rng.h"
#include "ps_util.h"
#include "psworker.h"

#define MAX_W 64
#define MAX_ROUNDS (1 << 20)

typedef struct {
    const char *ep;
    int index;
    psw_info_t info;
    /* results */
    int rc;
    uint64_t rounds, bytes;
    double t_first, t_last;    /* the current epoch's first and last rounds' ends */
    double t_sum;              /* the earlier epochs' spans (first to last round) */
    double *lat;
    size_t n_lat;
    int pulls;                 /* pull-only rounds first */
    int push_only;             /* async psd: push every batch back to back, no pulls */
    int apart;                 /* each tensor's gradient in a buffer of its own (--apart) */
    uint64_t data[2];          /* model.kind tensors: the training and test samples (--data T,V) */
    uint64_t pushes, push_bytes;
    double q_first;            /* the current epoch's first push (0: none open) */
    double q_sum;              /* push-only spans: first push to psd's validation, per epoch */
    uint32_t sync;             /* psd's train.sync, from ASSIGN */
    uint64_t pull_rounds, pull_bytes;
    double p_first, p_last;
    double *plat;
    size_t n_plat;
} bw_t;

static void *bench_worker(void *p)
{
    bw_t *b = p;
    char err[512];
    uint8_t ident[16];
    psw_make_identity(ident, (uint64_t)b->index + 1);
    b->info.identity = ident;
    b->info.identity_len = sizeof ident;
    psw_client_t *c = psw_client_new(b->ep, &b->info, err, sizeof err);
    if (!c) {
        fprintf(stderr, "psbench: %s\n", err);
        b->rc = 2;
        return NULL;
    }
    psw_assign_t a;
    if (psw_client_register(c, &a, 60, err, sizeof err) != 0) {
        fprintf(stderr, "psbench: worker %d: %s\n", b->index, err);
        b->rc = 2;
        psw_client_destroy(&c);
        return NULL;
    }
    /* on psd's host the zero gradient lives in the region psd reads (a
     * memfd is zero-filled): pushed without a copy, as the wire sends from
     * the buffer without one (each tensor where psd lays it out) */
    size_t n_params = 0;
    for (int t = 0; t < a.n_tensors; t++)
        if (a.tensors[t].offset + a.tensors[t].numel > n_params) n_params = a.tensors[t].offset + a.tensors[t].numel;
    float *zero = calloc(n_params ? n_params : 1, sizeof *zero), *region = psw_client_push_region(c);
    psw_grad_t *gr = calloc((size_t)a.n_tensors, sizeof *gr);
    if (!zero || !gr) {
        fprintf(stderr, "psbench: out of memory\n");
        b->rc = 2;
        free(zero);
        free(gr);
        psw_client_destroy(&c);
        return NULL;
    }
    for (int t = 0; t < a.n_tensors; t++)
        gr[t] = (psw_grad_t){.tensor = (uint32_t)t, .data = (region ? region : zero) + a.tensors[t].offset};
    float **own = b->apart ? calloc((size_t)a.n_tensors, sizeof *own) : NULL; /* --apart: as torch's .grad are */
    for (int t = 0; own && t < a.n_tensors; t++)
        if ((own[t] = calloc(a.tensors[t].numel ? a.tensors[t].numel : 1, sizeof **own))) gr[t].data = own[t];
    psw_push_t push = {.n_grads = a.n_tensors, .grads = gr};
    /* the sample counts psd checks: from the IDX headers of the files it names */
    uint64_t count[2] = {a.ctr.train, a.ctr.test}; /* model.kind ctr: no files */
    if (a.model == PSW_MODEL_TENSORS) count[0] = b->data[0], count[1] = b->data[1]; /* the user's: --data */
    for (int i = 0; i < a.n_files; i++) {
        int k = strcmp(a.files[i].role, "train_images") == 0 ? 0 : strcmp(a.files[i].role, "test_images") == 0 ? 1 : -1;
        if (k < 0) continue;
        gzFile f = gzopen(a.files[i].path, "rb");
        unsigned char h[8];
        if (f && gzread(f, h, 8) == 8)
            count[k] = (uint64_t)h[4] << 24 | (uint64_t)h[5] << 16 | (uint64_t)h[6] << 8 | h[7];
        if (f) gzclose(f);
    }
    uint64_t limit = a.train_limit && a.train_limit < count[0] ? a.train_limit : count[0];
    b->sync = a.sync;
    if (b->push_only && a.sync == 0) {
        fprintf(stderr, "psbench: --push-only needs psd in async or ssp mode (train.sync); in bsp every push waits "
                        "for the step\n");
        b->rc = 2;
        psw_client_destroy(&c);
        free(zero);
        free(gr);
        for (int t = 0; own && t < a.n_tensors; t++) free(own[t]);
        free(own);
        return NULL;
    }
    psw_client_release_on_push(c, 1); /* it never reads the weights */
    psw_client_ready(c, limit, count[1], NULL);
    size_t n_ids = 0, pos = 0;
    uint32_t epoch = 0;
    int in_epoch = 0;
    double t_push = 0, t_pull = 0, timeout = a.start_timeout_s;
    int pulls_left = b->pulls;
    for (;;) {
        psw_event_t ev;
        int rc = psw_client_next(c, &ev, timeout, err, sizeof err);
        if (rc == -EINTR) continue;
        if (rc < 0) {
            fprintf(stderr, "psbench: worker %d: %s\n", b->index, err);
            b->rc = 1;
            break;
        }
        timeout = a.step_timeout_s;
        if (ev.kind == PSW_EV_SHUTDOWN) break;
        if (ev.kind == PSW_EV_EPOCH) {
            n_ids = ev.append ? n_ids + ev.n_samples : ev.n_samples;
            if (!ev.append) pos = 0;
            epoch = ev.epoch;
            if (pos >= n_ids) {
                in_epoch = 0;
                psw_client_barrier(c, epoch, n_ids);
            } else if (!in_epoch) {
                in_epoch = 1;
                psw_client_pull(c, ev.version);
            }
        } else if (ev.kind == PSW_EV_VALIDATE) {
            if (b->push_only && b->q_first > 0) { /* psd applied them all */
                b->q_sum += ps_now() - b->q_first;
                b->q_first = 0;
            }
            size_t nv = ev.val_end - ev.val_begin;
            float *sc = a.ctr.fields && nv ? calloc(nv, sizeof *sc) : NULL; /* ctr: psd wants scores */
            psw_client_val_result(c, &(psw_val_t){.epoch = ev.epoch, .version = ev.version, .begin = ev.val_begin,
                    .loss_sum = 0, .correct = 0, .count = nv, .scores = sc});
            free(sc);
        } else if (ev.kind == PSW_EV_WEIGHTS && in_epoch && pulls_left > 0) {
            double now = ps_now(); /* a pull-only round: pull -> weights */
            if (t_pull > 0) {
                if (b->n_plat < MAX_ROUNDS) b->plat[b->n_plat++] = now - t_pull;
                b->pull_rounds++;
                b->pull_bytes += 4 * n_params;
                b->p_last = now;
            } else {
                b->p_first = now;
            }
            t_pull = ps_now();
            if (--pulls_left == 0) t_pull = 0;
            psw_client_pull(c, ev.version);
        } else if (ev.kind == PSW_EV_WEIGHTS && in_epoch && b->push_only) {
            /* every batch of the epoch pushed on these weights without waiting (the
             * zero gradient never changes: frames in flight may share it); psd
             * applies each as it comes; the time ends when psd asks to validate */
            b->q_first = ps_now();
            for (; pos < n_ids; b->pushes++) {
                size_t B = n_ids - pos < a.batch_size ? n_ids - pos : a.batch_size;
                pos += B;
                b->push_bytes += 4 * n_params;
                push.version = ev.version, push.batch = (uint32_t)B, push.pull = 0;
                if (psw_client_push_v(c, &push) != 0) {
                    b->rc = 1;
                    break;
                }
            }
            in_epoch = 0;
            psw_client_barrier(c, epoch, n_ids);
        } else if (ev.kind == PSW_EV_WEIGHTS && in_epoch) {
            double now = ps_now();
            if (t_push > 0) { /* a round: push -> these weights */
                if (b->n_lat < MAX_ROUNDS) b->lat[b->n_lat++] = now - t_push;
                b->rounds++;
                b->bytes += 2 * 4 * n_params;
                b->t_last = now;
            } else { /* an epoch's first weights: the time between epochs (validation) is not counted */
                if (b->t_last > b->t_first) b->t_sum += b->t_last - b->t_first;
                b->t_first = b->t_last = now;
            }
            while (!psw_client_push_done(c)) sched_yield();
            size_t B = n_ids - pos < a.batch_size ? n_ids - pos : a.batch_size;
            pos += B;
            int last = pos >= n_ids;
            t_push = last ? 0 : ps_now();
            push.version = ev.version, push.batch = (uint32_t)B, push.pull = !last;
            if (psw_client_push_v(c, &push) != 0) {
                b->rc = 1;
                break;
            }
            if (last) {
                in_epoch = 0;
                psw_client_barrier(c, epoch, n_ids);
            }
        }
    }
    while (!psw_client_push_done(c)) sched_yield();
    psw_client_destroy(&c);
    free(zero);
    free(gr);
    for (int t = 0; own && t < a.n_tensors; t++) free(own[t]);
    free(own);
    return NULL;
}

/* One worker's line: rounds, GB/s over dt seconds, latency percentiles
 * (sorts lat). Returns the GB/s. */
static double report(int i, const char *unit, const char *what, uint64_t rounds, uint64_t bytes, double dt, double *lat,
                     size_t n)
{
    double gbs = dt > 0 ? (double)bytes / dt / 1e9 : 0;
    qsort(lat, n, sizeof(double), bench_cmp_double);
    double p50 = n ? lat[n / 2] : 0, p90 = n ? lat[n * 9 / 10] : 0, p99 = n ? lat[n * 99 / 100] : 0;
    printf("worker %d: %llu %s, %s %.3f GB/s, latency p50 %.3f ms p90 %.3f ms p99 %.3f ms\n", i,
           (unsigned long long)rounds, unit, what, gbs, p50 * 1e3, p90 * 1e3, p99 * 1e3);
    return gbs;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: psbench --connect ENDPOINT [--workers W] [--pulls N | --push-only] [--no-shm]\n"
               "               [--key FILE --server-key FILE] [--data TRAIN,TEST] [--apart]\n"
               "  W simulated workers (threads) push zero gradients and pull weights from psd\n"
               "  until psd ends the run; prints push+pull GB/s and round latencies. On psd's\n"
               "  host tensors go through shared memory unless --no-shm. --pulls N: N pull-only\n"
               "  rounds first. --push-only (psd in async mode): push every batch back to back,\n"
               "  no pulls; GB/s = bytes pushed / time until psd has applied them. Any model psd\n"
               "  trains (model.kind tensors: --data gives the samples the workers say they hold).\n"
               "  --apart: each tensor's gradient in a buffer of its own (else one buffer laid out\n"
               "  as psd lays the model out: small tensors go without being copied together)\n");
}

int main(int argc, char **argv)
{
    const char *ep = NULL, *key = NULL, *server_key = NULL;
    int W = 1, no_shm = 0, pulls = 0, push_only = 0, apart = 0;
    unsigned long long data[2] = {0, 0};
    static const struct option opts[] = {{"connect", required_argument, 0, 'c'},
                                         {"workers", required_argument, 0, 'w'},
                                         {"key", required_argument, 0, 'k'},
                                         {"server-key", required_argument, 0, 's'},
                                         {"no-shm", no_argument, 0, 'n'},
                                         {"pulls", required_argument, 0, 'p'},
                                         {"push-only", no_argument, 0, 'P'},
                                         {"data", required_argument, 0, 'd'},
                                         {"apart", no_argument, 0, 'a'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    ps_malloc_keep(); /* as pworker */
    int o;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 'c': ep = optarg; break;
        case 'w': W = atoi(optarg); break;
        case 'k': key = optarg; break;
        case 's': server_key = optarg; break;
        case 'n': no_shm = 1; break;
        case 'p': pulls = atoi(optarg); break;
        case 'P': push_only = 1; break;
        case 'a': apart = 1; break;
        case 'd':
            if (sscanf(optarg, "%llu,%llu", &data[0], &data[1]) != 2) data[0] = 0;
            break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!ep || W < 1 || W > MAX_W || pulls < 0 || pulls > MAX_ROUNDS || optind != argc || (!key != !server_key) ||
        (push_only && pulls)) {
        usage(stderr);
        return 2;
    }
    char err[512];
    if (ps_endpoint_check(ep, PS_EP_CONNECT, err, sizeof err) != 0) {
        fprintf(stderr, "psbench: --connect: %s\n", err);
        return 2;
    }
    ps_keypair_t kp;
    char spub[PS_Z85_LEN];
    if (key && (ps_auth_load_secret(key, &kp, err, sizeof err) != 0 ||
                ps_auth_load_public(server_key, spub, err, sizeof err) != 0)) {
        fprintf(stderr, "psbench: %s\n", err);
        return 2;
    }
    bw_t *b = calloc((size_t)W, sizeof *b);
    pthread_t th[MAX_W];
    for (int i = 0; i < W; i++) {
        b[i].ep = ep;
        b[i].index = i;
        b[i].info = (psw_info_t){.device = "cpu", .device_index = -1, .identity_hint = "psbench", .no_shm = no_shm};
        if (key) {
            b[i].info.curve_public = kp.public_z85;
            b[i].info.curve_secret = kp.secret_z85;
            b[i].info.curve_server = spub;
        }
        b[i].lat = malloc(MAX_ROUNDS * sizeof(double));
        b[i].plat = malloc(MAX_ROUNDS * sizeof(double));
        b[i].pulls = pulls;
        b[i].push_only = push_only;
        b[i].apart = apart;
        b[i].data[0] = data[0], b[i].data[1] = data[1];
        pthread_create(&th[i], NULL, bench_worker, &b[i]);
    }
    int rc = 0;
    for (int i = 0; i < W; i++) {
        pthread_join(th[i], NULL);
        if (b[i].rc) rc = b[i].rc;
    }
    double agg_pp = 0, agg_pull = 0, agg_push = 0;
    if (push_only) {
        for (int i = 0; i < W; i++) {
            double dt = b[i].q_sum, gbs = dt > 0 ? (double)b[i].push_bytes / dt / 1e9 : 0;
            printf("worker %d: %llu pushes, push %.3f GB/s\n", i, (unsigned long long)b[i].pushes, gbs);
            agg_push += gbs;
        }
        printf("aggregate push: %.3f GB/s (%d workers, %s)\n", agg_push, W, ps_sync_name((ps_sync_t)b[0].sync));
    }
    for (int i = 0; i < W && !push_only; i++)
        agg_pp += report(i, "rounds", "push+pull", b[i].rounds, b[i].bytes, b[i].t_sum + b[i].t_last - b[i].t_first,
                         b[i].lat, b[i].n_lat);
    if (!push_only)
        printf("aggregate push+pull: %.3f GB/s (%d workers, %s)\n", agg_pp, W, ps_sync_name((ps_sync_t)b[0].sync));
    for (int i = 0; i < W && pulls > 0; i++)
        agg_pull += report(i, "pulls", "pull", b[i].pull_rounds, b[i].pull_bytes, b[i].p_last - b[i].p_first, b[i].plat,
                           b[i].n_plat);
    if (pulls > 0) printf("aggregate pull: %.3f GB/s (%d workers)\n", agg_pull, W);
    for (int i = 0; i < W; i++) free(b[i].lat);
    for (int i = 0; i < W; i++) free(b[i].plat);
    free(b);
    memset(&kp, 0, sizeof kp);
    return rc;
}
