/* Integration: the real psd and pworker binaries on free loopback ports.
 * "short" cases use a slice of the training data (CI also runs them under
 * ASan/UBSan); "long" cases train on all of it. Every process started is
 * ended by PID (proc_reap_all in the fini). */
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
#include "ps_wire.h"

Test(short, one_worker_counts_every_test_sample)
{
    run_t r;
    train(&r, "n1", 1, slice, 300);
    check_run(&r, 1, 1);
}

Test(short, two_workers_count_every_test_sample)
{
    run_t r;
    train(&r, "n2", 2, slice, 300);
    check_run(&r, 2, 1);
}

Test(short, three_workers_uneven_shards_do_not_hang)
{
    /* 4001 samples over 3 workers, batch 64: shards of 1333/1334 samples end
     * on different step counts (21 vs 21 steps, last batches 53/54) and 10000
     * test samples split 3333/3333/3334 */
    run_t r;
    const char *args[] = {"--epochs", "2", "--set", "data.train_limit=4001", NULL};
    train(&r, "n3", 3, args, 300);
    check_run(&r, 3, 2);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 4001, "no training sample dropped or repeated");
    free(m);
}

Test(short, seven_workers_uneven_steps)
{
    /* 1000 samples over 7 workers with batch 100: shards of 142/143 samples,
     * 2 steps each; and a worker count that does not divide the test set */
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=1000", "--set",
                          "train.batch_size=100", NULL};
    train(&r, "n7", 7, args, 300);
    check_run(&r, 7, 1);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 1000);
    free(m);
}

Test(short, same_seed_gives_bit_identical_weights)
{
    run_t a, b, c;
    const char *args[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "7", NULL};
    train(&a, "a", 2, args, 300);
    check_run(&a, 2, 2);
    train(&b, "b", 2, args, 300);
    check_run(&b, 2, 2);
    cr_assert(weights_equal(a.weights, b.weights), "same seed, N and config: identical weights");
    const char *other[] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "8", NULL};
    train(&c, "c", 2, other, 300);
    check_run(&c, 2, 2);
    cr_assert_not(weights_equal(a.weights, c.weights), "another seed: other weights");
}

/* The step sums the workers' gradients in rank order whatever order their
 * pushes come in, and whether psd sums them as they come (server.grad_room:
 * 3 workers on the wire, more than its room of 2) or all at the step
 * (grad_room 0): 3 workers over the wire whose pushes come in rank order as
 * much as chance makes them, and the same run with rank r slower by
 * (2 - r) x 15 ms a step, so that rank 2 pushes first and rank 0 last (psd
 * counts the pushes begun before a lower rank's: pushes_ahead), with and
 * without the room, give the same weights, bit for bit (Adam with clipping:
 * the sum, then its norm). */
Test(short, pushes_in_reverse_rank_order_give_the_same_weights)
{
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=3000", "--seed", "9", "--set",
                          "optimizer.name=adam", "--set", "optimizer.lr=0.002", "--set", "optimizer.clip_norm=1",
                          "--set", "server.grad_room=2", NULL};
    const char *plain[] = {"--no-shm", NULL}, *reverse[] = {"--no-shm", "--x-slow-rank-ms", "15", NULL};
    run_t a, b, c;
    train_wx(&a, "order", 3, args, plain, 300);
    check_run(&a, 3, 1);
    train_wx(&b, "reverse", 3, args, reverse, 300);
    check_run(&b, 3, 1);
    args[13] = "server.grad_room=0"; /* the same run, every push held until the step */
    train_wx(&c, "unbound", 3, args, reverse, 300);
    check_run(&c, 3, 1);
    char *mb = metrics_last(&b), *mc = metrics_last(&c);
    double steps = json_num(last_line(mb), "step"), ahead = json_num(last_line(mb), "pushes_ahead");
    /* every step: rank 2's push (and rank 1's) before rank 0's, up to the epoch's uneven last steps */
    cr_assert_geq(ahead, steps, "pushes in reverse rank order: %s", last_line(mb));
    cr_assert_geq(json_num(last_line(mc), "pushes_ahead"), steps, "%s", last_line(mc));
    cr_assert(weights_equal(a.weights, b.weights), "the same weights whatever order the pushes come in");
    cr_assert(weights_equal(a.weights, c.weights), "summed as they come = summed at the step, bit for bit");
    free(mb);
    free(mc);
}

/* psd's step runs on a thread pool in chunks: any chunk size and thread
 * count gives the same bits (Adam with global-norm clipping, which needs the
 * whole gradient's norm before any chunk is applied; SGD, where each chunk is
 * reduced and applied at once; and Adagrad). */
Test(short, chunked_threaded_steps_give_identical_weights)
{
    const char *opt[3][8] = {
        {"--set", "optimizer.name=adam", "--set", "optimizer.lr=0.001", "--set", "optimizer.clip_norm=0.5", NULL},
        {"--set", "optimizer.name=sgd", NULL},
        {"--set", "optimizer.name=adagrad", "--set", "optimizer.lr=0.01", NULL}};
    const char *par[3][5] = {{"--set", "server.threads=1", "--set", "server.chunk_bytes=1073741824", NULL},
                             {"--set", "server.threads=3", "--set", "server.chunk_bytes=65536", NULL},
                             {"--set", "server.threads=2", "--set", "server.chunk_bytes=1048576", NULL}};
    for (int o = 0; o < 3; o++) {
        run_t r[3];
        for (int k = 0; k < 3; k++) {
            const char *args[24] = {"--epochs", "1", "--set", "data.train_limit=3000", "--seed", "7"};
            int n = 6;
            for (int i = 0; opt[o][i]; i++) args[n++] = opt[o][i];
            for (int i = 0; par[k][i]; i++) args[n++] = par[k][i];
            args[n] = NULL;
            char tag[16];
            snprintf(tag, sizeof tag, "par%d%d", o, k);
            train(&r[k], tag, 2, args, 300);
            check_run(&r[k], 2, 1);
        }
        cr_assert(weights_equal(r[0].weights, r[1].weights), "64 KiB chunks on 3 threads = one chunk per tensor");
        cr_assert(weights_equal(r[0].weights, r[2].weights), "1 MiB chunks on 2 threads = one chunk per tensor");
    }
}

/* Weights are sent from the version's arena without copying: psd must never
 * change an arena while ZeroMQ still sends from it. With --x-verify-weights
 * every WEIGHTS/VALIDATE carries the CRC-32 of its version and workers check
 * what they receive (a torn read fails them). Here a client asks for the
 * weights (23 MB, more than a connection's kernel buffers hold) and stops
 * itself (SIGSTOP) before reading them, so psd's message stays half sent,
 * still read from its arena; psd declares the client lost and steps on with
 * two real workers, recycling every arena nobody references; then the client
 * wakes up and must receive the version psd claimed, intact. */

static int stalled_client(const char *endpoint, long stall_ns)
{
    char err[512];
    /* over the wire: what it checks is ZeroMQ sending from psd's arena (the
     * workers, on shared memory, check their reads of psd's slots) */
    psw_info_t info = {.device = "cpu", .device_index = -1, .identity_hint = "stalled", .no_shm = 1};
    psw_client_t *c = psw_client_new(endpoint, &info, err, sizeof err);
    psw_assign_t a;
    psw_event_t ev;
    if (!c || psw_client_register(c, &a, 60, err, sizeof err) != 0) return 10;
    psw_client_ready(c, 6000, 10000, NULL); /* data.train_limit below */
    do {
        if (psw_client_next(c, &ev, 60, err, sizeof err) != 0) return 11;
    } while (ev.kind != PSW_EV_EPOCH);
    psw_client_pull(c, ev.version);
    /* stop (ZeroMQ's I/O thread too) once the pull is out and psd has begun
     * to answer, long before 23 MB can have arrived; the test sends SIGCONT
     * once psd has stepped on */
    struct timespec ts = {0, stall_ns};
    nanosleep(&ts, NULL);
    raise(SIGSTOP);
    int rc = psw_client_next(c, &ev, 60, err, sizeof err);
    if (rc == -ENOLINK) return 13; /* stopped before the pull was out: psd never answered */
    if (rc == -EPROTO && strstr(err, "do not match")) {
        fprintf(stderr, "%s\n", err);
        return 3; /* torn */
    }
    if (rc != 0 || ev.kind != PSW_EV_WEIGHTS || psw_client_verified(c) != 1) {
        fprintf(stderr, "stalled client: rc %d (%s), event %d, %llu verified\n", rc, rc ? err : "", (int)ev.kind,
                (unsigned long long)psw_client_verified(c));
        return 12;
    }
    psw_client_destroy(&c);
    return 0;
}

/* One run of the above, the client stopping stall_ns after its pull; returns
 * the client's exit status (13: its pull had not reached psd yet) */
static int stalled_run(const char *tag, long stall_ns)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=6000", "--x-verify-weights",
                          "--set", "model.layers=[784,2048,2048,10]", "--worker-timeout", "1",
                          "--set", "optimizer.lr=0.01", "--set", "server.threads=3",
                          "--set", "server.chunk_bytes=65536", "--set", "checkpoint.dir=", NULL};
    const char *wargs[] = {"--threads", "1", "--verbose", NULL};
    pid_t p = start_psd(&r, tag, 3, args);
    pid_t w0 = start_worker(&r, tag, 0, wargs), w1 = start_worker(&r, tag, 1, wargs);
    pid_t c = fork();
    cr_assert(c >= 0);
    if (c == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlives the test, even stopped */
        _exit(stalled_client(r.endpoint, stall_ns));
    }
    int st = 0;
    cr_assert_eq(waitpid(c, &st, WUNTRACED), c);
    cr_assert(WIFSTOPPED(st), "the client stopped itself before reading its weights");
    wait_log(r.psd_log, "lost: nothing from it", 60);
    /* psd steps on with the two workers (tens of steps, recycling arenas),
     * and is still running when the client wakes: a psd that had ended would
     * have dropped the half-sent message (the client's exit 12 seen once) */
    zmq_poll(NULL, 0, 700);
    kill(c, SIGCONT);
    cr_assert_eq(waitpid(c, &st, 0), c);
    int ex = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    cr_assert(ex == 0 || ex == 13, "the stalled client received the version it was promised, "
              "intact (exit %d; 3 = torn, 13 = its pull never reached psd)", ex);
    cr_assert_eq(proc_wait(p, 300), 0, "psd");
    cr_assert_eq(proc_wait(w0, 60), 0);
    cr_assert_eq(proc_wait(w1, 60), 0);
    for (int i = 0; i < 2; i++) {
        char wlog[512];
        snprintf(wlog, sizeof wlog, "%s/%s-w%d.log", dir, tag, i);
        char *log = slurp(wlog);
        cr_assert(log && !strstr(log, "do not match"), "worker %d received torn weights: %s", i, log ? log : "");
        free(log);
    }
    assert_workers_verified(tag, 2, "them");
    assert_validated_all(&r);
    return ex;
}

Test(short, workers_receive_exactly_the_version_psd_claims)
{
    /* On a loaded machine (or under sanitizers) ZeroMQ's I/O thread can be
     * too slow to send the pull within the client's pause: then there is
     * nothing to check (exit 13), and the run is made again with a longer
     * pause */
    static const long stall_ns[] = {3000000, 10000000, 30000000};
    int ex = 13;
    for (int k = 0; k < 3 && ex == 13; k++) {
        char tag[16];
        snprintf(tag, sizeof tag, "crc%d", k);
        ex = stalled_run(tag, stall_ns[k]);
        if (ex == 13) fprintf(stderr, "stalled client: its pull had not reached psd after %ld ms\n", stall_ns[k] / 1000000);
    }
    cr_assert(ex == 0 || sanitized(), "the stalled client's pull reached psd in one of 3 runs (exit %d)", ex);
}

/* A run whose loss becomes NaN or infinite ends at once with a clear error
 * (exit 1), instead of dropping the workers' pushes as bad messages. */
Test(short, a_diverging_run_ends_with_a_clear_error)
{
    run_t r;
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--set", "optimizer.lr=1e6",
                          "--set", "schedule.name=constant", NULL};
    pid_t p = start_psd(&r, "nan", 2, args);
    pid_t w0 = start_worker(&r, "nan", 0, NULL), w1 = start_worker(&r, "nan", 1, NULL);
    cr_assert_eq(proc_wait(p, 120), 1, "psd exits 1");
    cr_assert_eq(proc_wait(w0, 30), 1, "workers are told and exit 1");
    cr_assert_eq(proc_wait(w1, 30), 1);
    char *log = slurp(r.psd_log);
    cr_assert(log && strstr(log, "training diverged at step"), "says why: %s", log ? log : "");
    cr_assert(!strstr(log, "lost: nothing from it"), "no worker declared lost");
    free(log);
}

Test(short, eval_of_saved_weights_matches_validation)
{
    run_t r;
    train(&r, "ev", 2, slice, 300);
    check_run(&r, 2, 1);
    char *m = metrics_last(&r);
    double val_loss = json_num(last_line(m), "val_loss"), val_correct = json_num(last_line(m), "val_correct");
    free(m);
    char out[256], cmd[1024];
    path(out, sizeof out, "eval.txt");
    snprintf(cmd, sizeof cmd, "'%s' eval '%s' > '%s' 2>&1", psd_bin, r.weights, out);
    cr_assert_eq(system(cmd), 0);
    char *txt = slurp(out);
    const char *p = strstr(txt, "loss ");
    cr_assert_not_null(p, "%s", txt);
    double loss = strtod(p + 5, NULL);
    p = strstr(txt, "(");
    double correct = strtod(p + 1, NULL);
    cr_assert_eq(correct, val_correct, "same correct count: %s", txt);
    cr_assert_leq(fabs(loss - val_loss) / val_loss, 1e-6, "loss %.9g vs %.9g", loss, val_loss);
    free(txt);
}

Test(short, bad_config_and_flags_exit_2_with_one_line)
{
    char cfg[256], out[256];
    path(cfg, sizeof cfg, "bad.yaml");
    path(out, sizeof out, "out.txt");
    FILE *f = fopen(cfg, "w");
    fputs("run:\n  epochs: 3\noptimizer:\n  lrr: 0.1\n", f);
    fclose(f);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --config '%s' --check-config > '%s' 2>&1", psd_bin, cfg, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, ":4:") && strstr(t, "optimizer.lrr"), "names the key and line: %s", t);
    cr_assert_eq(count_lines(t), 1, "one line: %s", t);
    free(t);

    f = fopen(cfg, "w");
    fputs("model:\n  layers: [784, 0, 10]\n", f);
    fclose(f);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --config '%s' --check-config > /dev/null 2>&1", psd_bin, cfg), 2);
    f = fopen(cfg, "w");
    fputs("optimizer:\n  lr: fast\n", f);
    fclose(f);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:0 --config '%s' --check-config > /dev/null 2>&1", psd_bin, cfg), 2);
    cr_assert_eq(run_cmd("'%s' --config /nonexistent.yaml > /dev/null 2>&1", psd_bin), 2);
    cr_assert_eq(run_cmd("'%s' --epochs many > /dev/null 2>&1", psd_bin), 2);
    cr_assert_eq(run_cmd("'%s' --bogus > /dev/null 2>&1", psd_bin), 2);
    cr_assert_eq(run_cmd("'%s' --listen nonsense://x --insecure --start-timeout 5 > '%s' 2>&1", psd_bin, out), 2);
    t = slurp(out);
    cr_assert(strstr(t, "server.listen: 'nonsense://x' is not a tcp:// or ipc:// endpoint"), "%s", t);
    free(t);
    /* libzmq would take the port modulo 65536 (99999: 34463) */
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:99999 > '%s' 2>&1", psd_bin, out), 2);
    t = slurp(out);
    cr_assert(strstr(t, "the port must be a number from 0 to 65535") && count_lines(t) == 1, "%s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' > /dev/null 2>&1", pworker_bin), 2, "pworker without --connect");
    cr_assert_eq(run_cmd("'%s' --connect nowhere > /dev/null 2>&1", pworker_bin), 2);
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:99999 > '%s' 2>&1", pworker_bin, out), 2);
    t = slurp(out);
    cr_assert(strstr(t, "pworker: --connect: 'tcp://127.0.0.1:99999': the port must be a number from 1 to 65535"),
              "%s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:1 --threads 0 > /dev/null 2>&1", pworker_bin), 2);
    cr_assert_eq(run_cmd("'%s' --print-config | grep -q 'layers: \\[784, 512, 256, 10\\]'", psd_bin), 0);
    cr_assert_eq(run_cmd("'%s' --version | grep -q 'protocol %u'", psd_bin, PS_PROTOCOL_VERSION), 0);
    cr_assert_eq(run_cmd("'%s' --version | grep -q 'protocol %u'", pworker_bin, PS_PROTOCOL_VERSION), 0);
}

Test(short, missing_or_truncated_data_exit_2)
{
    char out[256], bad[256];
    path(out, sizeof out, "out.txt");
    path(bad, sizeof bad, "trunc.gz");
    cr_assert_eq(run_cmd("'%s' --set data.train_images=/nonexistent.gz --start-timeout 5 > '%s' 2>&1",
                         psd_bin, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "/nonexistent.gz"), "names the file: %s", t);
    free(t);
    cr_assert_eq(run_cmd("head -c 100000 /usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz > '%s'", bad), 0);
    cr_assert_eq(run_cmd("'%s' --set data.test_images='%s' --start-timeout 5 > '%s' 2>&1", psd_bin, bad, out), 2);
    t = slurp(out);
    cr_assert(strstr(t, "trunc.gz"), "names the file: %s", t);
    free(t);
}

Test(short, start_timeout_exits_3)
{
    run_t r;
    const char *args[] = {"--start-timeout", "2", NULL};
    char *argv_fix = NULL;
    (void)argv_fix;
    pid_t p = start_psd(&r, "st", 2, args); /* later --start-timeout wins */
    pid_t w = start_worker(&r, "st", 0, NULL);
    cr_assert_eq(proc_wait(p, 60), 3, "psd exits 3 when only 1 of 2 workers comes");
    int wc = proc_wait(w, 30);
    cr_assert_neq(wc, 0, "the waiting worker is told to stop");
    cr_assert_neq(wc, -1, "and does not hang");
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "1 of 2 workers registered"), "%s", log);
    free(log);
}

Test(short, other_protocol_version_is_refused_and_psd_carries_on)
{
    run_t r;
    pid_t p = start_psd(&r, "pv", 1, slice);
    const char *xp[] = {"--x-protocol", "99", NULL};
    char wlog[256];
    path(wlog, sizeof wlog, "pv-w9.log");
    const char *argv[] = {pworker_bin, "--connect", r.endpoint, "--devices", "cpu", "--x-protocol", "99", NULL};
    (void)xp;
    pid_t bad = proc_spawn(argv, wlog);
    cr_assert_eq(proc_wait(bad, 60), 2, "a worker of another protocol exits 2");
    char *t = slurp(wlog);
    cr_assert(strstr(t, "protocol"), "%s", t);
    cr_assert_eq(count_lines(t), 1, "one line: %s", t);
    free(t);
    /* a worker of the protocol before (6) is told in words to upgrade */
    char olog[256], six[8];
    path(olog, sizeof olog, "pv-w6.log");
    snprintf(six, sizeof six, "%u", PS_PROTOCOL_VERSION - 1);
    const char *old[] = {pworker_bin, "--connect", r.endpoint, "--devices", "cpu", "--x-protocol", six, NULL};
    pid_t o = proc_spawn(old, olog);
    cr_assert_eq(proc_wait(o, 60), 2, "a worker of the protocol before exits 2");
    t = slurp(olog);
    cr_assert(strstr(t, "upgrade it to psd"), "the worker shows psd's words: %s", t);
    free(t);
    pid_t good = start_worker(&r, "pv", 0, NULL);
    cr_assert_eq(proc_wait(p, 300), 0, "psd carries on and trains with a good worker");
    cr_assert_eq(proc_wait(good, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "protocol 99"), "psd logs the refusal: %s", log);
    free(log);
}

Test(short, malformed_messages_are_dropped)
{
    run_t r;
    pid_t p = start_psd(&r, "mal", 2, slice);
    /* a hostile peer: garbage, truncated multiparts, a PUSH from nobody,
     * a REGISTER with a huge bogus frame count, before the workers come */
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    cr_assert_eq(zmq_connect(s, r.endpoint), 0);
    zmq_send(s, "garbage", 7, 0);
    zmq_send(s, "", 0, 0);
    zmq_send(s, "\x08\x02\x18\x07", 4, ZMQ_SNDMORE); /* header: protocol 2, PUSH, no body */
    zmq_send(s, "frame", 5, 0);
    uint8_t buf[256];
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Push push = PSD__PUSH__INIT;
    h.protocol = PS_PROTOCOL_VERSION;
    h.type = PSD__MSG_TYPE__MSG_PUSH;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &push;
    size_t n = psd__header__pack(&h, buf);
    zmq_send(s, buf, n, 0); /* well formed, but from a peer that never registered */
    Psd__Barrier bar = PSD__BARRIER__INIT;
    h.type = PSD__MSG_TYPE__MSG_BARRIER;
    h.body_case = PSD__HEADER__BODY_BARRIER;
    h.barrier = &bar;
    n = psd__header__pack(&h, buf);
    zmq_send(s, buf, n, 0);
    Psd__Values vals = PSD__VALUES__INIT; /* a model's values psd never asked for (model.kind from_worker) */
    h.type = PSD__MSG_TYPE__MSG_VALUES;
    h.body_case = PSD__HEADER__BODY_VALUES;
    h.values = &vals;
    size_t nv = psd__header__pack(&h, buf);
    zmq_send(s, buf, nv, 0);
    h.type = PSD__MSG_TYPE__MSG_BARRIER; /* the junk below: the BARRIER again */
    h.body_case = PSD__HEADER__BODY_BARRIER;
    h.barrier = &bar;
    zmq_poll(NULL, 0, 200);
    pid_t w0 = start_worker(&r, "mal", 0, NULL), w1 = start_worker(&r, "mal", 1, NULL);
    /* more junk while training */
    for (int i = 0; i < 50; i++) zmq_send(s, buf, n / 2 + 1, 0);
    cr_assert_eq(proc_wait(p, 300), 0, "psd trained to the end");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    zmq_close(s);
    zmq_ctx_term(ctx);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "dropped a message"), "drops are logged: %s", log);
    cr_assert(strstr(log, "VALUES from a peer psd did not ask"), "%s", log);
    free(log);
    assert_validated_all(&r);
}

/* Wait up to timeout_ms for `event` on a monitor PAIR socket. */
static bool monitor_saw(void *mon, int event, int timeout_ms)
{
    double end = ps_now() + timeout_ms / 1000.0;
    while (ps_now() < end) {
        zmq_pollitem_t it = {mon, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0) continue;
        zmq_msg_t a, b;
        zmq_msg_init(&a);
        zmq_msg_init(&b);
        int got = -1;
        if (zmq_msg_recv(&a, mon, 0) >= 6) {
            uint16_t ev;
            memcpy(&ev, zmq_msg_data(&a), 2);
            got = ev;
        }
        if (zmq_msg_more(&a)) zmq_msg_recv(&b, mon, 0);
        zmq_msg_close(&a);
        zmq_msg_close(&b);
        if (got == event) return true;
    }
    return false;
}

Test(short, a_peer_that_keeps_sending_bad_messages_is_disconnected)
{
    run_t r;
    pid_t p = start_psd(&r, "cut", 2, slice);
    /* psd waits for its workers while the peer misbehaves (a run on the
     * slice is over in about a second: the peer would see psd go away) */
    void *ctx = zmq_ctx_new(), *s = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0, ivl = 60000; /* no quick reconnect: the test sees one connection end */
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_RECONNECT_IVL, &ivl, sizeof ivl);
    cr_assert_eq(zmq_socket_monitor(s, "inproc://cut-mon", ZMQ_EVENT_CONNECTED | ZMQ_EVENT_DISCONNECTED), 0);
    void *mon = zmq_socket(ctx, ZMQ_PAIR);
    zmq_setsockopt(mon, ZMQ_LINGER, &linger, sizeof linger);
    cr_assert_eq(zmq_connect(mon, "inproc://cut-mon"), 0);
    wait_log(r.psd_log, "listening on", 60);
    cr_assert_eq(zmq_connect(s, r.endpoint), 0);
    cr_assert(monitor_saw(mon, ZMQ_EVENT_CONNECTED, 10000), "connected to psd");
    /* a few bad messages are only dropped: the connection stays */
    for (int i = 0; i < 5; i++) zmq_send(s, "garbage", 7, 0);
    cr_assert_not(monitor_saw(mon, ZMQ_EVENT_DISCONNECTED, 1000), "5 bad messages do not cut a peer off");
    /* many in a row: psd closes the connection */
    for (int i = 0; i < 40; i++) zmq_send(s, "garbage", 7, 0);
    cr_assert(monitor_saw(mon, ZMQ_EVENT_DISCONNECTED, 20000), "psd disconnected the peer");
    pid_t w0 = start_worker(&r, "cut", 0, NULL), w1 = start_worker(&r, "cut", 1, NULL);
    cr_assert_eq(proc_wait(p, 300), 0, "psd trained to the end");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    zmq_socket_monitor(s, NULL, 0);
    zmq_close(mon);
    zmq_close(s);
    zmq_ctx_term(ctx);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "disconnected a peer at 127.0.0.1: 16 bad messages in a row"), "logged: %s", log);
    cr_assert(strstr(log, "dropped a message from an unknown peer at 127.0.0.1"), "address logged");
    free(log);
    assert_validated_all(&r);
}

/* Counts of tests/alloc_count.so's output: exe, protobuf-c, zmq, other. */
static void read_counts(const char *file, double c[4])
{
    char *t = slurp(file);
    cr_assert(t, "no allocation counts in %s", file);
    const char *key[4] = {"exe ", "protobuf-c ", "zmq ", "other "};
    for (int i = 0; i < 4; i++) {
        const char *p = strstr(t, key[i]);
        cr_assert(p, "no %s count", key[i]);
        c[i] = strtod(p + strlen(key[i]), NULL);
    }
    free(t);
}

/* Once training runs, psd's own code and protobuf decoding allocate nothing
 * per step: two runs that differ only in their number of steps make as
 * many allocations (libzmq's own, per step, are reported). */
/* psd's allocations in a run of n[0] and one of n[1] training samples
 * (data.train_limit, or ctr.train with ctr), 2 workers (w1_extra for the
 * second), counted by the preloaded counter: psd's own code and protobuf
 * decoding must allocate the same in both, i.e. nothing per step. */

static void alloc_check(const char *tag0, const char **cfg, const char *key, const int n[2], int steps_diff,
                        const char **w0_extra, const char **w1_extra, int shards)
{
    const char *lib = getenv("PSD_ALLOC_COUNT_LIB");
    if (!lib || !lib[0]) cr_skip_test("no allocation counter in this build (sanitizers own malloc)");
    double c[2][2][4]; /* [run][shard] */
    for (int k = 0; k < 2; k++) {
        run_t r;
        char tag[32], out[2][512], limit[64];
        snprintf(tag, sizeof tag, "%s%d", tag0, k);
        snprintf(limit, sizeof limit, "%s=%d", key, n[k]);
        const char *extra[16];
        int e = 0;
        for (int i = 0; cfg && cfg[i]; i++) extra[e++] = cfg[i];
        extra[e++] = "--epochs", extra[e++] = "1", extra[e++] = "--set", extra[e++] = limit;
        extra[e++] = "--set", extra[e++] = "checkpoint.dir=", extra[e] = NULL;
        const char *extra0[20];
        int e0 = 0;
        for (; e0 < e; e0++) extra0[e0] = extra[e0];
        if (shards > 1) extra0[e0++] = "--shard", extra0[e0++] = "0/2";
        extra0[e0] = NULL;
        setenv("LD_PRELOAD", lib, 1);
        pid_t sh = 0, p = 0;
        for (int i = 0; i < shards; i++) {
            snprintf(out[i], sizeof out[i], "%s/%s-counts%d.txt", dir, tag, i);
            setenv("ALLOC_COUNT_OUT", out[i], 1);
            if (i == 0) p = start_psd(&r, tag, 2, extra0);
            else sh = start_shard(&r, tag, 1, 2, extra);
        }
        unsetenv("LD_PRELOAD");
        unsetenv("ALLOC_COUNT_OUT");
        pid_t w0 = start_worker(&r, tag, 0, w0_extra), w1 = start_worker(&r, tag, 1, w1_extra);
        cr_assert_eq(proc_wait(p, 300), 0);
        cr_assert_eq(proc_wait(w0, 30), 0);
        cr_assert_eq(proc_wait(w1, 30), 0);
        if (shards > 1) cr_assert_eq(proc_wait(sh, 30), 0, "shard 1 exits 0");
        for (int i = 0; i < shards; i++) read_counts(out[i], c[k][i]);
        char *m = metrics_last(&r);
        cr_assert_eq(json_num(last_line(m), "train_samples"), n[k]);
        free(m);
    }
    const double d = steps_diff;
    for (int i = 0; i < shards; i++) {
        double(*a)[4] = &c[0][i], (*b)[4] = &c[1][i];
        const char *who = i ? "psd shard 1" : "psd";
        cr_log_info("%s %s allocations, short run / long run: psd %.0f / %.0f, protobuf-c %.0f / %.0f, "
                    "libzmq %.0f / %.0f (%.1f per step), other %.0f / %.0f",
                    tag0, who, (*a)[0], (*b)[0], (*a)[1], (*b)[1], (*a)[2], (*b)[2], ((*b)[2] - (*a)[2]) / d, (*a)[3],
                    (*b)[3]);
        fprintf(stderr, "%s %s allocations per step: psd's code %.2f, protobuf-c %.2f, libzmq %.2f, other %.2f\n",
                tag0, who, ((*b)[0] - (*a)[0]) / d, ((*b)[1] - (*a)[1]) / d, ((*b)[2] - (*a)[2]) / d,
                ((*b)[3] - (*a)[3]) / d);
        cr_assert((*a)[0] > 0, "the counter sees %s's allocations at start-up", who);
        cr_assert_eq((*b)[0], (*a)[0], "%s's own code allocated per step (%.0f vs %.0f)", who, (*b)[0], (*a)[0]);
        cr_assert_eq((*b)[1], (*a)[1], "%s: protobuf decoding allocated per step (%.0f vs %.0f)", who, (*b)[1],
                     (*a)[1]);
    }
}

Test(short, psd_allocates_nothing_per_step)
{
    const int n[2] = {1280, 6400}; /* 10 and 50 steps */
    const char *wire[] = {"--no-shm", NULL}; /* one worker on shared memory, one on the wire */
    alloc_check("alloc", NULL, "data.train_limit", n, 40, NULL, wire, 1);
}

/* The same for the ctr model with table rows both ways (both workers on the wire), with
 * the table on psd, and with 2 psd shards (rows both ways; each shard counted). */
Test(short, psd_allocates_nothing_per_step_with_table_rows)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *args[] = {"--config", cfg, "--set", "ctr.test=1000", NULL};
    const int n[2] = {2560, 12800}; /* 5 and 25 steps */
    const char *wire[] = {"--no-shm", NULL};
    alloc_check("allocrows", args, "ctr.train", n, 20, wire, wire, 1);
    const char *onpsd[] = {"--config", cfg, "--set", "ctr.test=1000", "--set", "ctr.worker_table_mb=0", NULL};
    alloc_check("allocpsd", onpsd, "ctr.train", n, 20, NULL, NULL, 1); /* the table on psd */
    alloc_check("allocsh", args, "ctr.train", n, 20, NULL, NULL, 2); /* 2 psd shards, rows both ways */
}

Test(short, worker_with_other_data_is_refused)
{
    run_t r;
    char other[256];
    path(other, sizeof other, "otherdata");
    cr_assert_eq(run_cmd("mkdir -p '%s' && cd '%s' && d=/usr/share/datasets/fashion-mnist && "
                         "cp $d/t10k-images-idx3-ubyte.gz train-images-idx3-ubyte.gz && "
                         "cp $d/t10k-labels-idx1-ubyte.gz train-labels-idx1-ubyte.gz && "
                         "cp $d/t10k-* .", other, other), 0);
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--start-timeout", "60", NULL};
    pid_t p = start_psd(&r, "dd", 1, args);
    const char *wx[] = {"--data-dir", other, NULL};
    pid_t bad = start_worker(&r, "dd-bad", 0, wx);
    cr_assert_eq(proc_wait(bad, 60), 2, "a worker whose data differs exits 2");
    pid_t good = start_worker(&r, "dd", 1, NULL);
    cr_assert_eq(proc_wait(p, 300), 0, "psd goes on with a worker whose data matches");
    cr_assert_eq(proc_wait(good, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "differs from psd's"), "%s", log);
    free(log);
}

Test(short, gradients_pushed_tensor_by_tensor_give_the_same_weights)
{
    /* GPU workers push each layer's gradient as soon as its backward is done;
     * psd must assemble the parts into exactly the same step */
    run_t a, b, c;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--seed", "5", NULL};
    const char *split[] = {"--x-split-push", NULL}, *split_wire[] = {"--x-split-push", "--no-shm", NULL};
    train(&a, "whole", 2, args, 300);
    check_run(&a, 2, 1);
    train_wx(&b, "split", 2, args, split, 300);
    check_run(&b, 2, 1);
    cr_assert(weights_equal(a.weights, b.weights), "same weights whether pushed whole or in parts");
    train_wx(&c, "splitw", 2, args, split_wire, 300);
    check_run(&c, 2, 1);
    cr_assert(weights_equal(a.weights, c.weights), "parts over the wire too");
    /* and streamed (train.stream): each tensor's chunks as its backward is done */
    const char *sargs[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--seed", "5", "--set",
                           "train.stream=true", "--set", "server.chunk_bytes=65536", NULL};
    train_wx(&c, "splits", 2, sargs, split_wire, 300);
    check_run(&c, 2, 1);
    cr_assert(weights_equal(a.weights, c.weights), "streamed parts");
    /* a device backend's code paths (uploads, gradients downloaded tensor by tensor and pushed
     * as they come down), on the CPU's ops: the CPU backend posing as a device */
    const char *dev[] = {"--x-device-sim", "--verbose", NULL}, *dev_wire[] = {"--x-device-sim", "--no-shm", NULL};
    train_wx(&c, "devsim", 2, args, dev, 300);
    check_run(&c, 2, 1);
    cr_assert(weights_equal(a.weights, c.weights), "a device worker on psd's host");
    char wlog[512];
    snprintf(wlog, sizeof wlog, "%s/devsim-w0.log", dir);
    char *log = slurp(wlog);
    cr_assert(log && strstr(log, "backend cpu-as-device"), "%s", log ? log : "");
    free(log);
    train_wx(&c, "devsimw", 2, args, dev_wire, 300);
    check_run(&c, 2, 1);
    cr_assert(weights_equal(a.weights, c.weights), "a device worker over the wire");
}
