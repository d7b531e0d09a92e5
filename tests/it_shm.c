/* it_shm.c - integration tests: shared memory against the wire; psd shards end to end (same
 * weights, resume, stops, failures) (see itest.h). */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <glob.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/prctl.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "itest.h"
#include "proc.h"
#include "ps_auth.h"
#include "ps_ctr.h"
#include "ps_model.h"
#include "ps_shm.h"
#include "psworker.h"
#include "ps_util.h"
#include "ps_weights.h"
#include "ps_table.h"
#include "ps_wire.h"

/* ---- same host: shared memory ------------------------------------------- */

/* Workers on psd's host exchange tensors through shared memory unless told
 * not to; the arithmetic is the same, so are the weights, bit for bit, for
 * every mix of the two (and workers check each shared version they read
 * against psd's CRC-32). */
Test(short, shared_memory_and_wire_give_identical_weights)
{
    const char *args[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "11",
                          "--x-verify-weights", "--set", "optimizer.name=adam", "--set", "optimizer.lr=0.002", NULL};
    const char *wire[] = {"--no-shm", "--verbose", NULL}, *shm[] = {"--verbose", NULL};
    run_t a, b, c;
    train_wx(&a, "shm", 2, args, shm, 300);
    check_run(&a, 2, 2);
    train_wx(&b, "wire", 2, args, wire, 300);
    check_run(&b, 2, 2);
    pid_t p = start_psd(&c, "mixed", 2, args); /* rank order is registration order: wait for rank 0 */
    pid_t w0 = start_worker(&c, "mixed", 0, shm);
    wait_log(c.psd_log, "worker registered: rank 0", 60);
    pid_t w1 = start_worker(&c, "mixed", 1, wire);
    c.psd_code = proc_wait(p, 300);
    c.worker_code[0] = proc_wait(w0, 30);
    c.worker_code[1] = proc_wait(w1, 30);
    check_run(&c, 2, 2);
    char *la = slurp(a.psd_log), *lb = slurp(b.psd_log), *lc = slurp(c.psd_log);
    cr_assert_eq(count_in(la, "through shared memory"), 2, "both workers on shared memory:\n%s", la);
    cr_assert_eq(count_in(lb, "through shared memory"), 0, "--no-shm: the wire:\n%s", lb);
    cr_assert_eq(count_in(lc, "through shared memory"), 1, "one of each:\n%s", lc);
    cr_assert(weights_equal(a.weights, b.weights), "shared memory = wire, bit for bit");
    cr_assert(weights_equal(a.weights, c.weights), "a mix of both = wire, bit for bit");
    assert_workers_verified("shm", 2, "its reads");
    free(la);
    free(lb);
    free(lc);
}

/* train.wire_gradients / train.wire_weights: bf16 halves the bytes on the
 * wire (counted by psd, per epoch, in the metrics), is really used (other
 * weights than f32, checked by the workers against psd's CRC-32 of the
 * bfloat16 frames), trains about as well, and leaves shared memory alone
 * (f32 there: the same weights as an f32 run). */
Test(short, bf16_on_the_wire_halves_the_bytes)
{
    const char *f32[] = {"--epochs", "1", "--set", "data.train_limit=4000", "--seed", "9", "--x-verify-weights", NULL};
    const char *bf16[] = {"--epochs", "1", "--set", "data.train_limit=4000", "--seed", "9", "--x-verify-weights",
                          "--set", "train.wire_gradients=bf16", "--set", "train.wire_weights=bf16", NULL};
    const char *wire[] = {"--no-shm", "--verbose", NULL}, *shm[] = {"--verbose", NULL};
    run_t a, b, c;
    train_wx(&a, "f32", 2, f32, wire, 300);
    check_run(&a, 2, 1);
    train_wx(&b, "bf16", 2, bf16, wire, 300);
    check_run(&b, 2, 1);
    train_wx(&c, "bf16shm", 2, bf16, shm, 300);
    check_run(&c, 2, 1);
    char *ma = metrics_last(&a), *mb = metrics_last(&b), *mc = metrics_last(&c);
    const char *la = last_line(ma), *lb = last_line(mb), *lc = last_line(mc);
    double in_a = json_num(la, "wire_bytes_in"), out_a = json_num(la, "wire_bytes_out");
    cr_assert_gt(in_a, 0);
    cr_assert_eq(json_num(la, "step"), json_num(lb, "step"));
    cr_assert_eq(json_num(lb, "wire_bytes_in") * 2, in_a, "bf16 gradients: half the bytes (%s)", lb);
    cr_assert_eq(json_num(lb, "wire_bytes_out") * 2, out_a, "bf16 weights: half the bytes (%s)", lb);
    cr_assert_eq(json_num(lc, "wire_bytes_in"), 0, "shared memory: nothing on the wire");
    double acc_a = json_num(la, "val_acc"), acc_b = json_num(lb, "val_acc");
    cr_assert(fabs(acc_a - acc_b) < 0.02, "val_acc f32 %.4f, bf16 %.4f", acc_a, acc_b);
    cr_assert_not(weights_equal(a.weights, b.weights), "bf16 was used: other weights");
    cr_assert(weights_equal(a.weights, c.weights), "through shared memory bf16 does not apply: f32 weights");
    assert_workers_verified("bf16", 2, "bf16 frames");
    free(ma);
    free(mb);
    free(mc);
}

/* Several psd shards (psd --shard i/n): each holds part of the parameters
 * and of the optimizer state, workers push and pull each part to and from
 * its shard, and the run gives the same bits as one psd: Adam with
 * global-norm clipping (the norm is summed over every shard's blocks in
 * one order before any shard applies), chunked and unchunked steps, with
 * every weights message checked by the workers against its shard's CRC.
 * Each shard moves only its part: shard 0's bytes in are fewer. */
Test(short, one_two_and_three_psd_shards_give_identical_weights)
{
    const char *base[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "5", "--x-verify-weights",
                          "--set", "optimizer.name=adam", "--set", "optimizer.lr=0.002", "--set",
                          "optimizer.clip_norm=0.5", "--set", "checkpoint.dir=", NULL};
    const char *chunked[32];
    int k = 0;
    for (; base[k]; k++) chunked[k] = base[k];
    chunked[k++] = "--set";
    chunked[k++] = "server.chunk_bytes=65536";
    chunked[k++] = "--set";
    chunked[k++] = "server.threads=3";
    chunked[k] = NULL;
    const char *wex[] = {"--verbose", "--no-shm", NULL}; /* one psd: the wire too, to count its bytes */
    run_t a, b, c;
    train_sharded(&a, "one", 1, base, wex);
    check_run(&a, 2, 2);
    train_sharded(&b, "two", 2, chunked, wex);
    check_run(&b, 2, 2);
    const char *fetch[32]; /* shard 0 writes the weights file from chunks of 1001 floats of the others' parts */
    for (k = 0; base[k]; k++) fetch[k] = base[k];
    fetch[k++] = "--x-fetch-floats";
    fetch[k++] = "1001";
    fetch[k] = NULL;
    train_sharded(&c, "three", 3, fetch, wex);
    check_run(&c, 2, 2);
    cr_assert(weights_equal(a.weights, b.weights), "2 shards, chunked steps = 1 psd, bit for bit");
    cr_assert(weights_equal(a.weights, c.weights), "3 shards, the file written from chunks = 1 psd, bit for bit");
    char *lb = slurp(b.psd_log), *lc = slurp(c.psd_log);
    cr_assert_eq(count_in(lb, "psd shard 1/2 joined"), 1, "%s", lb);
    cr_assert(strstr(lb, "the other shards' parts came in 1 chunks"), "%s", lb); /* 16 MiB at a time */
    ps_layout_t l; /* the model's, from the weights file */
    float *params = NULL;
    ps_weights_meta_t meta;
    char err[512];
    cr_assert_eq(ps_weights_load(c.weights, &l, &params, &meta, err, sizeof err), 0, "%s", err);
    free(params);
    uint64_t chunks = 0;
    for (int i = 1; i < 3; i++) {
        ps_piece_t p[PS_MAX_TENSORS];
        ps_shard_pieces(&l, i, 3, p);
        chunks += (ps_part_size(p, l.n_tensors) + 1000) / 1001;
    }
    char want[96];
    snprintf(want, sizeof want, "the other shards' parts came in %" PRIu64 " chunks", chunks);
    cr_assert(chunks > 100 && strstr(lc, want), "%s: %s", want, lc);
    free(lb);
    free(lc);
    assert_workers_verified("two", 2, "every shard's part");
    assert_workers_verified("three", 2, "every shard's part");
    char *ma = metrics_last(&a), *mb = metrics_last(&b);
    double in_a = json_num(last_line(ma), "wire_bytes_in"), in_b = json_num(last_line(mb), "wire_bytes_in");
    cr_assert(in_b > 0.3 * in_a && in_b < 0.7 * in_a, "shard 0 of 2 receives about half the bytes (%g of %g)", in_b,
              in_a);
    free(ma);
    free(mb);
}

/* The click-through task (model.kind ctr, deploy/configs/ctr.yaml): the
 * embedding table is one more tensor, trained through the embedding bags.
 * With 2 workers the validation log-loss falls and closes most of the gap between a constant's log-loss and the planted model's (the best
 * reachable); psd eval of the saved weights gives psd's last validation
 * loss; and 2 psd shards give one psd's bits. */
Test(short, ctr_task_trains_toward_the_planted_optimum)
{
    char cfg[1024];
    const char *configs = getenv("PSD_CONFIGS");
    cr_assert_not_null(configs, "PSD_CONFIGS (set by meson)");
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", configs);
    const char *args[] = {"--config", cfg, "--epochs", "3", "--set", "ctr.train=100000", "--set", "ctr.test=10000",
                          "--set", "optimizer.lr=0.1", "--set", "checkpoint.dir=", "--x-verify-weights", NULL};
    const char *wex[] = {"--verbose", NULL}; /* every rank logs its checksum count */
    run_t a, b;
    train_sharded(&a, "ctr1", 1, args, wex);
    char *log = slurp(a.psd_log);
    cr_assert_eq(a.psd_code, 0, "psd exit %d: %s", a.psd_code, log ? log : "");
    cr_assert(strstr(log, "planted model's log-loss"), "%s", log);
    free(log);
    cr_assert_eq(a.worker_code[0], 0);
    cr_assert_eq(a.worker_code[1], 0);
    char *m = metrics_last(&a);
    cr_assert_eq(count_lines(m), 3, "%s", m);
    double first = 0, opt = 0, cst = 0, loss = 0, auc = 0, opt_auc = 0;
    for (const char *line = m; line && *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : NULL) {
        loss = json_num(line, "val_loss");
        if (line == m) first = loss;
        opt = json_num(line, "optimum_loss");
        cst = json_num(line, "constant_loss");
        auc = json_num(line, "val_auc");
        opt_auc = json_num(line, "optimum_auc");
        cr_assert_eq(json_num(line, "val_samples"), 10000, "every test example once: %s", line);
    }
    cr_assert(opt_auc > 0.8 && opt_auc < 1, "planted AUC %g", opt_auc);
    cr_assert(auc > 0.5 + 0.8 * (opt_auc - 0.5) && auc <= opt_auc + 0.01, "val AUC %g, planted %g", auc, opt_auc);
    cr_assert_lt(loss, first, "validation loss after 3 epochs below the first's: %s", m);
    cr_assert(opt > 0.2 && cst > opt + 0.1, "optimum %g, constant %g", opt, cst);
    cr_assert_lt(loss - opt, 0.3 * (cst - opt), "val_loss %g: less than 30%% of the gap (optimum %g, constant %g) left",
                 loss, opt, cst);
    free(m);
    assert_workers_verified("ctr1", 2, "weights with the table");

    char out[256], cmd[2048];
    path(out, sizeof out, "ctr-eval.txt");
    snprintf(cmd, sizeof cmd, "'%s' eval '%s' --config '%s' --set ctr.train=100000 --set ctr.test=10000 > '%s' 2>&1",
             psd_bin, a.weights, cfg, out);
    int rc = system(cmd);
    char *txt = slurp(out);
    cr_assert_eq(rc, 0, "%s", txt);
    const char *p = strstr(txt, "loss ");
    cr_assert_not_null(p, "%s", txt);
    cr_assert_leq(fabs(strtod(p + 5, NULL) - loss) / loss, 1e-6, "psd eval %s vs val_loss %.9g", txt, loss);
    /* the AUC over the scores of both workers' parts = one process's over all examples */
    p = strstr(txt, "AUC ");
    cr_assert_not_null(p, "%s", txt);
    cr_assert_leq(fabs(strtod(p + 4, NULL) - auc), 1e-6, "psd eval %s vs val_auc %.9g", txt, auc);
    free(txt);
    snprintf(cmd, sizeof cmd, "'%s' eval '%s' > '%s' 2>&1", psd_bin, a.weights, out);
    cr_assert_eq(system(cmd), 2 << 8, "eval of ctr weights with the image config exits 2");
    txt = slurp(out);
    cr_assert(strstr(txt, "embedding table"), "%s", txt);
    free(txt);

    train_sharded(&b, "ctr2", 2, args, wex);
    cr_assert_eq(b.psd_code, 0);
    cr_assert(weights_equal(a.weights, b.weights), "2 shards = 1 psd, bit for bit, table included");

    /* fewer test examples than workers: one validates nothing, and says so without scores */
    const char *tiny[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=2000", "--set", "ctr.test=1",
                          "--set", "checkpoint.dir=", NULL};
    run_t t;
    train(&t, "ctrtiny", 2, tiny, 120);
    cr_assert_eq(t.psd_code, 0);
    m = metrics_last(&t);
    cr_assert_eq(json_num(m, "val_samples"), 1, "%s", m);
    free(m);
}

/* Runs tags[0..2]: 1 psd with args `rows`, 2 shards with `rows` and 2
 * shards with `whole` (the table's gradient pushed whole): the same bits. */
static void rows_and_shards(run_t r[3], const char *const *tags, const char **rows, const char **whole,
                            const char **wex, const char *what)
{
    train_ok(&r[0], tags[0], 1, rows, wex);
    train_ok(&r[1], tags[1], 2, rows, wex);
    train_ok(&r[2], tags[2], 2, whole, wex);
    cr_assert(weights_equal(r[0].weights, r[1].weights), "%s: 2 shards with table rows = 1 psd, bit for bit", what);
    cr_assert(weights_equal(r[0].weights, r[2].weights), "%s: 2 shards with whole tables = 1 psd, bit for bit", what);
}

/* Table rows with psd shards: each shard gets the rows of its piece of
 * the table (the pieces are whole rows: the table's width divides the norm
 * block), none when the batch touched none there, and steps those rows
 * only, as one psd does (lazily); it answers with the rows of its piece the
 * next batch reads. 1 psd, 2 shards with rows and 2 shards with whole
 * tables give the same bits (Adagrad, and lazy Adam with clipping); the
 * bytes each shard receives and sends follow the rows. */
Test(short, table_rows_go_to_psd_shards)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *sparse[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                            "--set", "checkpoint.dir=", "--x-verify-weights", NULL};
    const char *dense[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                           "--set", "checkpoint.dir=", "--x-verify-weights", "--set", "train.sparse_threshold=0", NULL};
    const char *wex[] = {"--no-shm", "--verbose", NULL};
    run_t abc[3];
    rows_and_shards(abc, (const char *[]){"rows1", "rows2", "whole2"}, sparse, dense, wex, "Adagrad");
    run_t b = abc[1], c = abc[2];
    assert_workers_verified("rows2", 2, "every shard's part");
    /* the model: 64 -> 64 -> 2 (4290 floats, all on shard 0) and a table of 65536 x 8 (half on
     * each shard: 262144 floats); 2 workers x 40 batches an epoch */
    const double mlp = 4.0 * 4290, piece = 4.0 * 262144, row = 4 + 4 * 8;
    char *mb = metrics_last(&b), *mc = metrics_last(&c);
    const char *lb = last_line(mb), *lc = last_line(mc);
    double pushes = json_num(lb, "table_row_pushes"), rows0 = json_num(lb, "table_rows_in");
    cr_assert_eq(pushes, 2 * 40, "every push of the epoch as rows: %s", lb);
    cr_assert(rows0 > 0 && rows0 < 0.3 * 65536 * pushes, "%s", lb);
    /* the replies: the rows of its piece the next batch reads (asked for in the push: 4 bytes a
     * row), but for the epoch's first weights, its last batch's and the validation's */
    double replies0 = json_num(lb, "table_row_replies"), out0 = json_num(lb, "table_rows_out");
    cr_assert_eq(json_num(lb, "wire_bytes_in"), pushes * mlp + rows0 * row + out0 * 4, "%s", lb);
    cr_assert(replies0 >= 2 * 37 && out0 > 0 && out0 < 0.3 * 65536 * replies0, "%s", lb);
    double whole = (json_num(lb, "wire_bytes_out") - replies0 * mlp - out0 * (row - 4)) / (mlp + piece);
    cr_assert(whole == floor(whole) && whole >= 2 && whole <= 3 * 2, "%g whole sends of shard 0's part: %s", whole, lb);
    cr_assert_eq(json_num(lc, "table_row_pushes"), 0, "%s", lc);
    cr_assert_eq(json_num(lc, "wire_bytes_in"), pushes * (mlp + piece), "%s", lc);
    /* shard 1: the rows of its piece only, in every push of both epochs; whole, its piece */
    double got[2][4];
    const char *tags[2] = {"rows2-shard1.log", "whole2-shard1.log"};
    for (int i = 0; i < 2; i++) {
        char lp[256];
        path(lp, sizeof lp, tags[i]);
        char *l1 = slurp(lp);
        const char *p = l1 ? strstr(l1, "shard 1 received: ") : NULL;
        cr_assert(p && sscanf(p, "shard 1 received: %lf gradient bytes, %lf pushes of table rows (%lf rows); sent %lf",
                              &got[i][0], &got[i][1], &got[i][2], &got[i][3]) == 4,
                  "%s", l1 ? l1 : tags[i]);
        free(l1);
    }
    cr_assert_eq(got[0][1], 2 * 2 * 40, "shard 1: every push as rows");
    cr_assert(got[0][2] > 0 && got[0][0] == got[0][2] * row, "shard 1: %g bytes for %g rows", got[0][0], got[0][2]);
    cr_assert(got[0][2] < 0.3 * 65536 * got[0][1], "shard 1: %g rows", got[0][2]);
    cr_assert(got[0][3] > 0 && got[0][3] < 0.3 * 32768 * 2 * 2 * 40, "shard 1: %g rows sent", got[0][3]);
    cr_assert(got[1][1] == 0 && got[1][0] == 2 * 2 * 40 * piece && got[1][3] == 0, "shard 1, whole tables: %g bytes",
              got[1][0]);
    /* lazy Adam with clipping: a shard steps only the rows of its piece that a step's pushes
     * touched, as one psd does (rows pushed, or found in a piece pushed whole), and the rows'
     * norm blocks add up to one psd's: the same bits */
    const char *adam[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                          "--set", "checkpoint.dir=", "--set", "optimizer.name=adam", "--set", "optimizer.lr=0.01",
                          "--set", "optimizer.clip_norm=0.5", "--set", "train.sparse_threshold=0.3", NULL};
    const char *adam_whole[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                                "--set", "checkpoint.dir=", "--set", "optimizer.name=adam", "--set",
                                "optimizer.lr=0.01", "--set", "optimizer.clip_norm=0.5", "--set",
                                "train.sparse_threshold=0", NULL};
    run_t fgh[3];
    rows_and_shards(fgh, (const char *[]){"adam1", "adam2", "adamwhole2"}, adam, adam_whole, wex, "lazy Adam, clipped");
    /* a width that does not divide the norm block (12; with 50 000 rows the shards' boundary
     * falls inside a row): the table goes whole to the shards (rows to one psd), the same bits */
    const char *odd[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=5000", "--set", "ctr.test=500",
                         "--set", "checkpoint.dir=", "--set", "ctr.rows=50000", "--set", "ctr.dim=12", "--set",
                         "model.layers=[96,16,2]", NULL};
    run_t d, e;
    train_ok(&d, "odd1", 1, odd, wex);
    train_ok(&e, "odd2", 2, odd, wex);
    cr_assert(weights_equal(d.weights, e.weights), "table width 12: 2 shards = 1 psd, bit for bit");
    char *md = metrics_last(&d), *me = metrics_last(&e);
    cr_assert(json_num(md, "table_row_pushes") > 0 && json_num(me, "table_row_pushes") == 0, "%s\n%s", md, me);
    free(md);
    free(me);
    free(mb);
    free(mc);
}

/* Checkpoints with shards: every shard writes its part at the steps shard
 * 0 writes its own (run-<id>/shard-<i>/), and resumes at the step shard 0
 * resumed at. Stopped after epoch 1 and resumed, 2 shards end with the
 * same bits as one psd that never stopped. A shard started without
 * --resume next to a resumed shard 0 is refused. */
Test(short, psd_shards_stopped_and_resumed_give_identical_weights)
{
    const char *one[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "3", "--set",
                         "optimizer.name=adam", "--set", "optimizer.lr=0.002", "--set", "optimizer.clip_norm=0.5",
                         "--set", "checkpoint.dir=", NULL};
    const char *wex[] = {"--no-shm", NULL};
    run_t a, b, c;
    train_sharded(&a, "whole", 1, one, wex);
    check_run(&a, 2, 2);
    char ck[256], arg[300];
    path(ck, sizeof ck, "ck");
    snprintf(arg, sizeof arg, "checkpoint.dir=%s", ck);
    const char *stop[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "3", "--set",
                          "optimizer.name=adam", "--set", "optimizer.lr=0.002", "--set", "optimizer.clip_norm=0.5",
                          "--set", arg, "--stop-after-epoch", "1", NULL};
    train_sharded(&b, "first", 2, stop, wex);
    cr_assert_eq(b.psd_code, 0);
    char sub[400];
    snprintf(sub, sizeof sub, "ls %s/run-*/shard-1/ckpt-*.psdc >/dev/null 2>&1", ck);
    cr_assert_eq(run_cmd("%s", sub), 0, "shard 1 wrote its part");
    { /* each shard's file holds its part only (checkpoint format 4, 5 with the table): header, the
       * tensor table, seen bits (shard 0), the part's weights and two Adam moments, trailer */
        ps_layout_t l;
        float *params = NULL;
        ps_weights_meta_t meta;
        char err[512];
        cr_assert_eq(ps_weights_load(a.weights, &l, &params, &meta, err, sizeof err), 0, "%s", err);
        free(params);
        for (int i = 0; i < 2; i++) {
            ps_piece_t pc[PS_MAX_TENSORS];
            ps_shard_pieces(&l, i, 2, pc);
            uint8_t *tb;
            size_t tlen;
            cr_assert_eq(ps_table_pack(&l, &tb, &tlen), 0);
            free(tb);
            const uint64_t want =
                232 + 4 + tlen + 4 + 144 /* the run block: no fingerprint, keep_best, early_stop or offer */ +
                (i == 0 ? (3000 + 7) / 8 : 0) + 3 * ps_part_size(pc, l.n_tensors) * 4 + 12;
            glob_t g;
            if (i == 0) snprintf(sub, sizeof sub, "%s/run-*/ckpt-*.psdc", ck); /* shard 0: the run's directory */
            else snprintf(sub, sizeof sub, "%s/run-*/shard-%d/ckpt-*.psdc", ck, i);
            cr_assert_eq(glob(sub, 0, NULL, &g), 0, "%s", sub);
            for (size_t k = 0; k < g.gl_pathc; k++) {
                struct stat st;
                cr_assert_eq(stat(g.gl_pathv[k], &st), 0);
                cr_assert_eq((uint64_t)st.st_size, want, "%s: %lld bytes, its part's are %" PRIu64, g.gl_pathv[k],
                             (long long)st.st_size, want);
            }
            globfree(&g);
        }
    }
    /* shard 0 resumed, shard 1 not: refused */
    const char *res0[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "3", "--set",
                          "optimizer.name=adam", "--set", "optimizer.lr=0.002", "--set", "optimizer.clip_norm=0.5",
                          "--set", arg, "--resume", ck, "--shard", "0/2", "--start-timeout", "5", NULL};
    run_t r;
    pid_t p = start_psd(&r, "half", 2, res0);
    pid_t f = start_shard(&r, "half", 1, 2, one);
    cr_assert_eq(proc_wait(f, 30), 2, "a fresh shard next to a resumed shard 0 is refused");
    proc_wait(p, 30);
    char *l = slurp(r.psd_log);
    cr_assert(strstr(l, "with --resume DIR too"), "%s", l);
    free(l);
    const char *res[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "3", "--set",
                         "optimizer.name=adam", "--set", "optimizer.lr=0.002", "--set", "optimizer.clip_norm=0.5",
                         "--set", arg, "--resume", ck, NULL};
    train_sharded(&c, "second", 2, res, wex);
    cr_assert_eq(c.psd_code, 0);
    cr_assert(weights_equal(a.weights, c.weights), "stopped and resumed on 2 shards = one psd, bit for bit");
    /* resumed at the end of the run: nothing to train once every shard has
     * resumed its part there; the weights file is written from every part
     * (the bits of the run that ended), and every shard exits 0 at once (no
     * worker, no timeout waited for) */
    run_t e;
    const char *end0[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "3", "--set",
                          "optimizer.name=adam", "--set", "optimizer.lr=0.002", "--set", "optimizer.clip_norm=0.5",
                          "--set", arg, "--resume", ck, "--shard", "0/2", NULL};
    p = start_psd(&e, "atend", 2, end0);
    f = start_shard(&e, "atend", 1, 2, res);
    cr_assert_eq(proc_wait(p, 60), 0, "nothing to train: the weights file written, exit 0");
    cr_assert_eq(proc_wait(f, 30), 0, "shard 1 is told the run is over");
    l = slurp(e.psd_log);
    cr_assert(strstr(l, "the shards' checkpoints are at the end of the run (2 epochs): nothing to train"), "%s", l);
    cr_assert(strstr(l, "steps (all before this resume)") && !strstr(l, "val_acc 0.0000"),
              "no validation figure of a run that validated nothing: %s", l);
    free(l);
    cr_assert(weights_equal(c.weights, e.weights), "the file of every shard's part at the end = the run's own");
    /* shard 1's part at the end cut short: shard 0, at the end, goes back with it to the end of
     * epoch 1 and trains epoch 2 again, to the bits of the run never stopped */
    cr_assert_eq(run_cmd("f=$(ls %s/run-*/shard-1/ckpt-*.psdc | sort | tail -1) && truncate -s -8 \"$f\"", ck), 0);
    run_t bk;
    train_sharded(&bk, "back", 2, res, wex);
    cr_assert_eq(bk.psd_code, 0);
    l = slurp(bk.psd_log);
    cr_assert(strstr(l, "waiting for the other shards' parts") && strstr(l, "psd shard 1 has no checkpoint of step") &&
                  strstr(l, "training epochs 2 to 2"),
              "%s", l);
    free(l);
    cr_assert(weights_equal(a.weights, bk.weights), "went back from the end and trained on: the run's bits");
    /* a plain psd resuming shard 0's part (the rest of its file is zeros) is refused: the file
     * says which part of how many shards it holds (checkpoint format 3) */
    run_t g;
    p = start_psd(&g, "plain", 2, res);
    cr_assert_eq(proc_wait(p, 60), 2, "one psd does not resume a shard's part");
    l = slurp(g.psd_log);
    cr_assert(strstr(l, "it holds the part of psd shard 0 of 2, and this psd is shard 0 of 1"), "%s", l);
    free(l);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --resume '%s' --check-config --epochs 2 --set data.train_limit=3000 --seed 3 --set "
                         "optimizer.name=adam --set optimizer.lr=0.002 --set optimizer.clip_norm=0.5 --set '%s' > "
                         "/dev/null 2>&1", psd_bin, ck, arg), 2, "--check-config finds it too");
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --resume '%s' --check-config --shard 0/2 --epochs 2 --set data.train_limit=3000 --seed 3 "
                         "--set optimizer.name=adam --set optimizer.lr=0.002 --set optimizer.clip_norm=0.5 --set '%s' > "
                         "/dev/null 2>&1", psd_bin, ck, arg), 0, "and takes it as shard 0 of 2");
    cr_assert(access(g.weights, F_OK) != 0, "no weights file");
}

/* A kill between the shards' writes of one checkpoint, or a corrupt part:
 * shard 1's newest checkpoint is unusable. The resume goes back to the
 * newest step every shard has (each shard keeps at least 2), and training
 * from there gives the same bits as a run never stopped. Without any step
 * in common the resume is refused with exit 2. */
Test(short, a_sharded_resume_goes_back_to_a_step_every_shard_has)
{
#define SR_ARGS "--epochs", "3", "--set", "data.train_limit=3000", "--seed", "5", "--set", "optimizer.name=adam", \
                "--set", "optimizer.lr=0.002"
    const char *one[] = {SR_ARGS, "--set", "checkpoint.dir=", NULL};
    const char *wex[] = {"--no-shm", NULL};
    run_t a, b, c, d;
    train_sharded(&a, "whole", 1, one, wex);
    check_run(&a, 2, 3);
    char ck[256], arg[300];
    path(ck, sizeof ck, "ck");
    snprintf(arg, sizeof arg, "checkpoint.dir=%s", ck);
    const char *stop[] = {SR_ARGS, "--set", arg, "--set", "checkpoint.keep=1", "--stop-after-epoch", "2", NULL};
    train_sharded(&b, "first", 2, stop, wex);
    cr_assert_eq(b.psd_code, 0);
    cr_assert_eq(run_cmd("test $(ls %s/run-*/shard-1/ckpt-*.psdc | wc -l) -eq 2 && test $(ls %s/run-*/ckpt-*.psdc | "
                         "wc -l) -eq 2", ck, ck), 0, "checkpoint.keep 1 keeps 2 with psd shards");
    /* shard 1's newest part cut short, as by a full disk */
    cr_assert_eq(run_cmd("f=$(ls %s/run-*/shard-1/ckpt-*.psdc | sort | tail -1) && truncate -s -8 \"$f\"", ck), 0);
    const char *res[] = {SR_ARGS, "--set", arg, "--set", "checkpoint.keep=1", "--resume", ck, NULL};
    /* first with its older part moved away: no step in common, refused */
    cr_assert_eq(run_cmd("f=$(ls %s/run-*/shard-1/ckpt-*.psdc | sort | head -1) && mkdir %s/older && mv \"$f\" %s/older/",
                         ck, ck, ck), 0);
    const char *res0[] = {SR_ARGS, "--set", arg, "--set", "checkpoint.keep=1", "--resume", ck, "--shard", "0/2", NULL};
    pid_t p = start_psd(&d, "none", 2, res0);
    pid_t f = start_shard(&d, "none", 1, 2, res);
    cr_assert_eq(proc_wait(f, 60), 2, "shard 1 has no part to resume: exit 2");
    cr_assert_eq(proc_wait(p, 60), 2, "and shard 0 says so: exit 2");
    char *l = slurp(d.psd_log);
    cr_assert(strstr(l, "psd shard 1") && strstr(l, "cannot resume: no valid checkpoint"), "%s", l);
    free(l);
    cr_assert_eq(run_cmd("mv %s/older/* %s/run-*/shard-1/", ck, ck), 0);
    train_sharded(&c, "second", 2, res, wex);
    cr_assert_eq(c.psd_code, 0);
    cr_assert_eq(c.worker_code[0], 0);
    l = slurp(c.psd_log);
    cr_assert(strstr(l, "psd shard 1 has no checkpoint of step") && strstr(l, "all 2 psd shards resumed at step"),
              "%s", l);
    cr_assert_eq(count_in(l, "resuming run"), 2, "it went back from the end of epoch 2 to that of epoch 1: %s", l);
    cr_assert(strstr(l, "checkpoint of step 72 written by all 2 psd shards"), "and checkpoints on after it: %s", l);
    free(l);
    char sl[300];
    path(sl, sizeof sl, "second-shard1.log");
    l = slurp(sl);
    cr_assert(strstr(l, "trying an older one"), "%s", l);
    free(l);
    cr_assert(weights_equal(a.weights, c.weights), "went back a step and trained on: the bits of a run never stopped");
    /* 3 shards, shard 2's newest part gone (killed before its rename): shard 1 resumes at the
     * newest step and goes back when asked, whichever answers first */
    char ck3[256], arg3[300];
    path(ck3, sizeof ck3, "ck3");
    snprintf(arg3, sizeof arg3, "checkpoint.dir=%s", ck3);
    const char *stop3[] = {SR_ARGS, "--set", arg3, "--stop-after-epoch", "2", NULL};
    const char *res3[] = {SR_ARGS, "--set", arg3, "--resume", ck3, NULL};
    run_t e, g;
    train_sharded(&e, "first3", 3, stop3, wex);
    cr_assert_eq(e.psd_code, 0);
    cr_assert_eq(run_cmd("f=$(ls %s/run-*/shard-2/ckpt-*.psdc | sort | tail -1) && rm \"$f\"", ck3), 0);
    train_sharded(&g, "second3", 3, res3, wex);
    cr_assert_eq(g.psd_code, 0);
    l = slurp(g.psd_log);
    cr_assert(strstr(l, "psd shard 2 has no checkpoint of step") && strstr(l, "all 3 psd shards resumed at step"),
              "%s", l);
    cr_assert(strstr(l, "checkpoint of step 72 written by all 3 psd shards"), "%s", l);
    free(l);
    cr_assert(weights_equal(a.weights, g.weights), "3 shards, back a step: the same bits");
#undef SR_ARGS
}

/* More checkpoints than 64 (one at nearly every step: workers that take 50
 * ms a step; 96 steps): shard 1 keeps only its 6 oldest, so the newest step
 * every shard has is older than shard 0's 64 newest. The shards compare
 * every file a run keeps (they looked at 64: no step in common, exit 2),
 * resume at that step and train on to the bits of a run never stopped. */
Test(short, a_sharded_resume_finds_a_step_older_than_the_64_newest)
{
#define SR_ARGS "--epochs", "4", "--set", "data.train_limit=3000", "--seed", "9", "--set", "model.layers=[784,32,10]", \
                "--set", "optimizer.name=adam", "--set", "optimizer.lr=0.002"
    const char *one[] = {SR_ARGS, "--set", "checkpoint.dir=", NULL};
    const char *wex[] = {"--no-shm", NULL}, *slow[] = {"--no-shm", "--x-slow-ms", "50", NULL};
    run_t a, b, c;
    train_sharded(&a, "whole", 1, one, wex);
    check_run(&a, 2, 4);
    char ck[256], arg[300], out[64];
    path(ck, sizeof ck, "ck");
    snprintf(arg, sizeof arg, "checkpoint.dir=%s", ck);
    const char *every[] = {SR_ARGS, "--set", arg, "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep=1000",
                           NULL};
    train_sharded(&b, "first", 2, every, slow);
    cr_assert_eq(b.psd_code, 0);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "ls %s/run-*/shard-1/ckpt-*.psdc | wc -l", ck);
    run_cmd_out(cmd, out, sizeof out);
    cr_assert_geq(atoi(out), 71, "a checkpoint of nearly every one of the 96 steps: %s", out);
    /* shard 1's 6 oldest stay: the newest of them is the step to go back to */
    snprintf(cmd, sizeof cmd, "ls %s/run-*/shard-1/ckpt-*.psdc | sort | sed -n 6p | sed 's/.*ckpt-0*//; s/.psdc$//'", ck);
    run_cmd_out(cmd, out, sizeof out);
    out[strcspn(out, "\n")] = '\0';
    cr_assert_eq(run_cmd("ls %s/run-*/shard-1/ckpt-*.psdc | sort | tail -n +7 | xargs rm", ck), 0);
    const char *res[] = {SR_ARGS, "--set", arg, "--set", "checkpoint.every_steps=1", "--set", "checkpoint.keep=1000",
                         "--resume", ck, NULL};
    train_sharded(&c, "second", 2, res, wex);
    cr_assert_eq(c.psd_code, 0);
    char *l = slurp(c.psd_log), want[96];
    snprintf(want, sizeof want, "all 2 psd shards resumed at step %s\n", out);
    cr_assert(strstr(l, want), "%s:\n%s", want, l);
    free(l);
    cr_assert(weights_equal(a.weights, c.weights), "back to step %s and trained on: the bits of a run never stopped",
              out);
#undef SR_ARGS
}

/* A shard that cannot write its part of the checkpoint psd stops with
 * tells shard 0 (SHARD_CKPT_DONE): psd does not say "saved", and exits 1.
 * Shard 1 runs where checkpoint.dir (a relative path) is a file. */
Test(short, a_stop_whose_checkpoint_a_psd_shard_could_not_write_fails)
{
    char other[256];
    path(other, sizeof other, "elsewhere");
    cr_assert_eq(mkdir(other, 0755), 0);
    const char *args[] = {"--epochs", "2", "--set", "data.train_limit=2000", "--set", "checkpoint.dir=ckrel",
                          "--stop-after-epoch", "1", "--shard", "0/2", NULL};
    const char *sargs[] = {"--epochs", "2", "--set", "data.train_limit=2000", "--set", "checkpoint.dir=ckrel", NULL};
    run_t r;
    pid_t p = start_psd(&r, "ackfail", 2, args);
    proc_set_cwd(other);
    pid_t f = start_shard(&r, "ackfail", 1, 2, sargs);
    proc_set_cwd(dir);
    /* its checkpoint.dir becomes a file once it started (at the start it is refused) */
    char slog[256];
    path(slog, sizeof slog, "ackfail-shard1.log");
    wait_log(slog, "shard 1/2 joined run", 60);
    cr_assert_eq(run_cmd("echo not a directory > %s/ckrel", other), 0);
    pid_t w0 = start_worker(&r, "ackfail", 0, NULL), w1 = start_worker(&r, "ackfail", 1, NULL);
    cr_assert_eq(proc_wait(p, 120), 1, "the checkpoint to stop with is not whole: exit 1");
    cr_assert_eq(proc_wait(w0, 30), 1);
    cr_assert_eq(proc_wait(w1, 30), 1);
    cr_assert_eq(proc_wait(f, 30), 0, "shard 1 is told the run is over");
    char *l = slurp(r.psd_log);
    cr_assert(strstr(l, "psd shard 1") && strstr(l, "could not write its part of checkpoint"), "%s", l);
    cr_assert_null(strstr(l, "checkpoint saved"), "%s", l);
    cr_assert_null(strstr(l, "written by all 2 psd shards"), "%s", l);
    free(l);
}

/* SIGTERM to every psd shard (Ctrl-C, a scheduler's preemption) while
 * shard 0's checkpoint takes longer than the worker timeout: shard 1
 * waits for it (shard 0 told it it was stopped) and the run ends with the
 * checkpoint saved, exit 0, instead of shard 1 giving up (exit 5). */
Test(short, psd_shards_stopped_together_wait_for_a_slow_checkpoint)
{
    char ck[256], arg[300];
    path(ck, sizeof ck, "ck");
    snprintf(arg, sizeof arg, "checkpoint.dir=%s", ck);
    const char *args[] = {"--epochs", "40", "--set", "data.train_limit=2000", "--set", arg, "--worker-timeout", "2",
                          "--x-slow-ckpt-ms", "6000", "--shard", "0/2", NULL};
    const char *sargs[] = {"--epochs", "40", "--set", "data.train_limit=2000", "--set", arg, "--worker-timeout", "2",
                           NULL};
    run_t r;
    pid_t p = start_psd(&r, "sigall", 2, args);
    pid_t f = start_shard(&r, "sigall", 1, 2, sargs);
    pid_t w0 = start_worker(&r, "sigall", 0, NULL), w1 = start_worker(&r, "sigall", 1, NULL);
    wait_metrics(&r, 1);
    kill(f, SIGTERM);
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 120), 0, "stopped with its checkpoint saved");
    cr_assert_eq(proc_wait(f, 30), 0, "shard 1 waited for it");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    char *l = slurp(r.psd_log), sl[300];
    cr_assert(strstr(l, "written by all 2 psd shards"), "%s", l);
    free(l);
    path(sl, sizeof sl, "sigall-shard1.log");
    l = slurp(sl);
    cr_assert(strstr(l, "waiting for shard 0 to end the run") && strstr(l, "psd was stopped; checkpoint saved"), "%s",
              l);
    cr_assert_null(strstr(l, "was stopped ("), "it did not give up: %s", l);
    free(l);
}

/* Shard 0 before shard 1 joined: a checkpoint asked for (SIGUSR1) is not
 * taken (a part alone is none, and it would wait for a confirmation that
 * never comes), and SIGTERM ends it at once with exit 0: nothing trained. */
Test(short, psd_shard_0_stopped_before_the_shards_joined_ends_cleanly)
{
    char ck[256], arg[300];
    path(ck, sizeof ck, "ck");
    snprintf(arg, sizeof arg, "checkpoint.dir=%s", ck);
    const char *args[] = {"--set", arg, "--shard", "0/2", NULL};
    run_t r;
    pid_t p = start_psd(&r, "alone", 2, args);
    wait_log(r.psd_log, "waiting for shards 1..1 to join", 30);
    kill(p, SIGUSR1);
    wait_log(r.psd_log, "no checkpoint taken: not every psd shard has joined", 30);
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 30), 0, "stopped before training: exit 0");
    char *l = slurp(r.psd_log);
    cr_assert(strstr(l, "nothing trained since psd started"), "%s", l);
    free(l);
    cr_assert_neq(run_cmd("ls %s/run-*/ckpt-*.psdc > /dev/null 2>&1", ck), 0, "no part written alone");
}

/* A shard that dies ends the run with exit 5 and a clear error (its part of
 * the parameters is gone), the workers are told to stop; shard 0 that dies
 * leaves no shard behind. Nothing hangs, and nobody waits worker_timeout
 * (60 s here) for a killed process: its connection closes with it. */
Test(short, a_lost_psd_shard_ends_the_run_and_nothing_hangs)
{
    const char *args[] = {"--epochs", "50", "--set", "data.train_limit=3000", "--set", "checkpoint.dir=",
                          "--worker-timeout", "60", "--shard", "0/2", NULL};
    const char *fargs[] = {"--set", "data.train_limit=3000", "--set", "checkpoint.dir=", "--worker-timeout", "60",
                           "--epochs", "50", NULL};
    run_t r;
    pid_t p = start_psd(&r, "lost", 2, args);
    pid_t f = start_shard(&r, "lost", 1, 2, fargs);
    pid_t w0 = start_worker(&r, "lost", 0, NULL), w1 = start_worker(&r, "lost", 1, NULL);
    wait_log(r.psd_log, "epoch 1/50", 120);
    kill(f, SIGKILL);
    cr_assert_eq(proc_wait(f, 10), 128 + SIGKILL);
    int code = proc_wait(p, 30);
    char *log = slurp(r.psd_log);
    cr_assert_eq(code, 5, "psd exits 5 when a shard is lost (got %d):\n%s", code, log);
    cr_assert(strstr(log, "psd shard 1") && strstr(log, "lost: its connection closed"), "%s", log);
    free(log);
    for (int i = 0; i < 2; i++) {
        if (proc_wait(i ? w1 : w0, 30) != -1) continue;
        char wlog[512];
        snprintf(wlog, sizeof wlog, "%s/lost-w%d.log", dir, i);
        char *wl = slurp(wlog);
        cr_assert_fail("worker %d did not end within 30 s of psd's exit; its log:\n%s", i, wl ? wl : "(none)");
    }

    run_t q;
    p = start_psd(&q, "lost0", 2, args);
    f = start_shard(&q, "lost0", 1, 2, fargs);
    w0 = start_worker(&q, "lost0", 0, NULL);
    w1 = start_worker(&q, "lost0", 1, NULL);
    wait_log(q.psd_log, "epoch 1/50", 120);
    kill(p, SIGKILL);
    cr_assert_eq(proc_wait(p, 10), 128 + SIGKILL);
    cr_assert_eq(proc_wait(f, 30), 5, "the shard stops when shard 0 is gone");
    char flog[256];
    path(flog, sizeof flog, "lost0-shard1.log");
    char *fl = slurp(flog);
    cr_assert(fl && strstr(fl, "the connection to shard 0 closed"), "%s", fl ? fl : "");
    free(fl);
    proc_wait(w0, 1);
    proc_wait(w1, 1);

    /* lost while shard 0 writes the weights file (a float at a time: the
     * fetch lasts long enough to be caught): no file, finished or not */
    const char *fetch[] = {"--epochs", "1", "--set", "data.train_limit=3000", "--set", "checkpoint.dir=",
                           "--worker-timeout", "3", "--shard", "0/2", "--x-fetch-floats", "1", NULL};
    const char *fetch1[] = {"--set", "data.train_limit=3000", "--set", "checkpoint.dir=", "--worker-timeout", "3",
                            "--epochs", "1", NULL};
    run_t z;
    p = start_psd(&z, "lostw", 2, fetch);
    f = start_shard(&z, "lostw", 1, 2, fetch1);
    w0 = start_worker(&z, "lostw", 0, NULL);
    w1 = start_worker(&z, "lostw", 1, NULL);
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp", z.weights);
    double t = 0;
    for (; t < 120 && access(tmp, F_OK) != 0; t += 0.01) usleep(10000);
    cr_assert_lt(t, 120, "shard 0 began %s", tmp);
    kill(f, SIGKILL);
    cr_assert_eq(proc_wait(f, 10), 128 + SIGKILL);
    code = proc_wait(p, 30);
    log = slurp(z.psd_log);
    cr_assert_eq(code, 5, "psd exits 5 when a shard is lost while it writes the weights (got %d):\n%s", code, log);
    cr_assert(strstr(log, "psd shard 1") && !strstr(log, "saved weights"), "%s", log);
    free(log);
    cr_assert(access(tmp, F_OK) != 0 && access(z.weights, F_OK) != 0, "no weights file is left, whole or not");
    proc_wait(w0, 30);
    proc_wait(w1, 30);
}

/* A worker that comes while shard 0 writes the weights file (the others'
 * parts fetched a float at a time: the writing lasts seconds) registers
 * but trains nothing: the run is over. Before, its READY started another
 * epoch in the middle of the fetch. */
Test(short, a_worker_joining_while_psd_shards_write_the_weights_trains_nothing)
{
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--set", "model.layers=[784,256,10]",
                          "--set", "checkpoint.dir=", NULL};
    const char *args0[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--set", "model.layers=[784,256,10]",
                           "--set", "checkpoint.dir=", "--shard", "0/2", "--x-fetch-floats", "1", NULL};
    run_t r;
    pid_t p = start_psd(&r, "joinw", 2, args0);
    pid_t f = start_shard(&r, "joinw", 1, 2, args);
    pid_t w0 = start_worker(&r, "joinw", 0, NULL), w1 = start_worker(&r, "joinw", 1, NULL);
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp", r.weights);
    double t = 0;
    for (; t < 120 && access(tmp, F_OK) != 0; t += 0.01) usleep(10000);
    cr_assert_lt(t, 120, "shard 0 began %s", tmp);
    pid_t w2 = start_worker(&r, "joinw", 2, NULL);
    r.psd_code = proc_wait(p, 120);
    cr_assert_eq(proc_wait(f, 30), 0);
    r.worker_code[0] = proc_wait(w0, 30);
    r.worker_code[1] = proc_wait(w1, 30);
    cr_assert_eq(proc_wait(w2, 30), 0, "the newcomer is told the run is over");
    char *log = slurp(r.psd_log);
    const char *reg = strstr(log, "worker registered: rank 2"), *saved = strstr(log, "saved weights");
    cr_assert(reg && saved && reg < saved, "the third worker came while the file was written:\n%s", log);
    cr_assert_eq(count_in(log, "train_loss"), 1, "one epoch, not another for the newcomer:\n%s", log);
    free(log);
    check_run(&r, 2, 1);
    cr_assert(access(tmp, F_OK) != 0 && access(r.weights, F_OK) == 0);
}

/* A shard whose chunk of the final weights does not match what shard 0
 * asked for (test flag: its last frame a float short) ends the run:
 * exit 5, and no weights file, finished or not. Without --save, shard 0
 * fetches nothing, so the same shard ends well. */
Test(short, a_broken_chunk_of_the_final_weights_leaves_no_file)
{
    const char *args0[] = {"--epochs", "1", "--set", "data.train_limit=1000", "--set", "checkpoint.dir=", "--shard",
                           "0/2", NULL};
    const char *args1[] = {"--epochs", "1", "--set", "data.train_limit=1000", "--set", "checkpoint.dir=",
                           "--x-break-fetch", NULL};
    run_t r;
    pid_t p = start_psd(&r, "brokenw", 2, args0);
    pid_t f = start_shard(&r, "brokenw", 1, 2, args1);
    pid_t w0 = start_worker(&r, "brokenw", 0, NULL), w1 = start_worker(&r, "brokenw", 1, NULL);
    int code = proc_wait(p, 120);
    char *log = slurp(r.psd_log);
    cr_assert_eq(code, 5, "exit 5 (got %d):\n%s", code, log);
    cr_assert(strstr(log, "psd shard 1 sent final weights that do not match its part of the parameters"), "%s", log);
    cr_assert(!strstr(log, "saved weights"), "%s", log);
    free(log);
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp", r.weights);
    cr_assert(access(tmp, F_OK) != 0 && access(r.weights, F_OK) != 0, "no weights file is left, whole or not");
    cr_assert_neq(proc_wait(f, 30), -1, "shard 1 ends with the run");
    proc_wait(w0, 30);
    proc_wait(w1, 30);
    /* without --save nothing is fetched: the same broken shard, and the run ends well */
    const char *nosave[] = {"--epochs", "1", "--set", "data.train_limit=1000", "--set", "checkpoint.dir=", "--shard",
                            "0/2", "--save", "", NULL};
    p = start_psd(&r, "brokenw-nosave", 2, nosave);
    f = start_shard(&r, "brokenw-nosave", 1, 2, args1);
    w0 = start_worker(&r, "brokenw-nosave", 0, NULL), w1 = start_worker(&r, "brokenw-nosave", 1, NULL);
    code = proc_wait(p, 120);
    log = slurp(r.psd_log);
    cr_assert_eq(code, 0, "exit 0 (got %d):\n%s", code, log);
    cr_assert(!strstr(log, "saved weights") && !strstr(log, "final weights"), "%s", log);
    free(log);
    cr_assert(access(r.weights, F_OK) != 0, "no weights file");
    cr_assert_eq(proc_wait(f, 30), 0, "shard 1 ends with the run");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
}

/* Shards that do not fit the run are refused with a clear message, and
 * bad --shard flags exit 2. */
Test(short, psd_shards_that_do_not_fit_are_refused)
{
    cr_assert_eq(run_cmd("%s --listen tcp://127.0.0.1:0 --shard 1/2 --check-config >/dev/null 2>&1", psd_bin), 2, "no --leader");
    cr_assert_eq(run_cmd("%s --shard 2/2 >/dev/null 2>&1", psd_bin), 2, "i >= n");
    cr_assert_eq(run_cmd("%s --shard 0/x >/dev/null 2>&1", psd_bin), 2, "not a number");
    cr_assert_eq(run_cmd("%s --shard 0/2 --leader tcp://127.0.0.1:1 >/dev/null 2>&1", psd_bin), 2,
                 "--leader is for shards 1..n-1");
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=1000", "--set", "checkpoint.dir=", "--shard",
                          "0/2", "--start-timeout", "8", NULL};
    run_t r;
    pid_t p = start_psd(&r, "misfit", 1, args);
    const char *other[] = {"--set", "data.train_limit=1000", "--set", "checkpoint.dir=", "--seed", "99", NULL};
    pid_t f = start_shard(&r, "misfit", 1, 2, other); /* another seed: another config */
    cr_assert_eq(proc_wait(f, 30), 2, "a shard with another config is refused and exits 2");
    const char *three[] = {"--set", "data.train_limit=1000", "--set", "checkpoint.dir=", NULL};
    char ep[64], log[256];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", free_port());
    path(log, sizeof log, "misfit-three.log");
    const char *argv[] = {psd_bin, "--listen", ep, "--shard", "1/3", "--leader", r.endpoint, three[0], three[1],
                          three[2], three[3], NULL};
    cr_assert_eq(proc_wait(proc_spawn(argv, log), 30), 2, "a shard of another count is refused");
    cr_assert_eq(proc_wait(p, 60), 3, "shard 0 times out without its shards");
    char *l = slurp(r.psd_log);
    cr_assert(strstr(l, "refused a psd shard: shard 1 was started with another config"), "%s", l);
    cr_assert(strstr(l, "it is shard 1/3, this run has 2 shards"), "%s", l);
    cr_assert(strstr(l, "not every psd shard joined"), "%s", l);
    free(l);
}
