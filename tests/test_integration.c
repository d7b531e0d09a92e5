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

/* Workers <tag>-w0.. ran with --verbose under psd --x-verify-weights: each
 * says it checked the weights it received against psd's CRC-32. */
static void assert_workers_verified(const char *tag, int n, const char *what)
{
    for (int i = 0; i < n; i++) {
        char wlog[512];
        snprintf(wlog, sizeof wlog, "%s/%s-w%d.log", dir, tag, i);
        char *log = slurp(wlog);
        cr_assert(log && strstr(log, "weights messages matched psd's checksums"), "worker %d checked %s", i, what);
        free(log);
    }
}

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
    psw_client_ready(c, 6000, 10000); /* data.train_limit below */
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
    cr_assert_eq(run_cmd("'%s' --config '%s' --check-config > '%s' 2>&1", psd_bin, cfg, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, ":4:") && strstr(t, "optimizer.lrr"), "names the key and line: %s", t);
    cr_assert_eq(count_lines(t), 1, "one line: %s", t);
    free(t);

    f = fopen(cfg, "w");
    fputs("model:\n  layers: [784, 0, 10]\n", f);
    fclose(f);
    cr_assert_eq(run_cmd("'%s' --config '%s' --check-config > /dev/null 2>&1", psd_bin, cfg), 2);
    f = fopen(cfg, "w");
    fputs("optimizer:\n  lr: fast\n", f);
    fclose(f);
    cr_assert_eq(run_cmd("'%s' --config '%s' --check-config > /dev/null 2>&1", psd_bin, cfg), 2);
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
static pid_t start_shard(const run_t *r, const char *tag, int i, int n, const char **extra);

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

/* ---- same host: shared memory ------------------------------------------- */

/* A command's first line of output (or all of it, up to n - 1 bytes). */
static void run_cmd_out(const char *cmd, char *out, size_t n)
{
    FILE *f = popen(cmd, "r");
    cr_assert_not_null(f);
    size_t k = fread(out, 1, n - 1, f);
    out[k] = '\0';
    pclose(f);
}

/* A unix socket bound to abstract name `name` exists on this host. */
static bool unix_socket_listed(const char *name)
{
    FILE *f = fopen("/proc/net/unix", "r"); /* size 0 to stat: read it line by line */
    char line[512], want[128];
    snprintf(want, sizeof want, " @%s\n", name);
    bool found = false;
    while (f && !found && fgets(line, sizeof line, f)) found = strstr(line, want) != NULL;
    if (f) fclose(f);
    return found;
}

/* How many of pid's mappings and open descriptors are files in /dev/shm
 * (*memfd: how many of its mappings are memfds). */
static int dev_shm_files_of(pid_t pid, int *memfd)
{
    char path[64], line[512], link[512];
    int n = 0;
    *memfd = 0;
    snprintf(path, sizeof path, "/proc/%d/maps", (int)pid);
    FILE *f = fopen(path, "r");
    cr_assert_not_null(f, "%s", path);
    while (fgets(line, sizeof line, f)) {
        if (strstr(line, "/dev/shm/")) n++;
        if (strstr(line, "/memfd:")) (*memfd)++;
    }
    fclose(f);
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    cr_assert_not_null(d, "%s", path);
    for (struct dirent *e; (e = readdir(d));) {
        char fd[320];
        snprintf(fd, sizeof fd, "%s/%s", path, e->d_name);
        ssize_t k = readlink(fd, link, sizeof link - 1);
        if (k > 0 && (link[k] = '\0', strncmp(link, "/dev/shm/", 9) == 0)) n++;
    }
    closedir(d);
    return n;
}

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

/* psd shard i of n (i > 0) of the run r's psd (shard 0), listening on a
 * free port, logging to TAG-shardI.log. */
/* shard i of n for the run r; its endpoint into ep_out (64 bytes) if not NULL */
static pid_t start_shard_at(const run_t *r, const char *tag, int i, int n, const char **extra, char *ep_out)
{
    char ep[64], sh[16], name[64], log[256];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", free_port());
    if (ep_out) memcpy(ep_out, ep, sizeof ep);
    snprintf(sh, sizeof sh, "%d/%d", i, n);
    snprintf(name, sizeof name, "%s-shard%d.log", tag, i);
    path(log, sizeof log, name);
    const char *argv[48] = {psd_bin, "--listen", ep, "--shard", sh, "--leader", r->endpoint, "--start-timeout", "120",
                            "--worker-timeout", "60"};
    int k = 11;
    for (int j = 0; extra && extra[j]; j++) argv[k++] = extra[j];
    argv[k] = NULL;
    return proc_spawn(argv, log);
}

static pid_t start_shard(const run_t *r, const char *tag, int i, int n, const char **extra)
{
    return start_shard_at(r, tag, i, n, extra, NULL);
}

/* psd as n shards (n > 1: shard 0 with --shard 0/n, and shards 1..n-1) and
 * two workers, to the end; every shard must exit 0. */
static void train_sharded(run_t *r, const char *tag, int n, const char **extra, const char **worker_extra)
{
    const char *args[48];
    int k = 0;
    char sh[16];
    snprintf(sh, sizeof sh, "0/%d", n);
    for (int j = 0; extra && extra[j]; j++) args[k++] = extra[j];
    if (n > 1) {
        args[k++] = "--shard";
        args[k++] = sh;
    }
    args[k] = NULL;
    pid_t p = start_psd(r, tag, 2, args), f[PS_MAX_SHARDS];
    for (int i = 1; i < n; i++) f[i] = start_shard(r, tag, i, n, extra);
    pid_t w0 = start_worker(r, tag, 0, worker_extra), w1 = start_worker(r, tag, 1, worker_extra);
    r->psd_code = proc_wait(p, 300);
    r->worker_code[0] = proc_wait(w0, 30);
    r->worker_code[1] = proc_wait(w1, 30);
    for (int i = 1; i < n; i++) cr_assert_eq(proc_wait(f[i], 30), 0, "shard %d/%d exits 0", i, n);
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

/* psd (every shard: train_sharded) and both workers exited 0 */
static bool a_run_ok(const run_t *r)
{
    return r->psd_code == 0 && r->worker_code[0] == 0 && r->worker_code[1] == 0;
}

/* train_sharded, and psd (every shard) and both workers exited 0 */
static void train_ok(run_t *r, const char *tag, int shards, const char **args, const char **wex)
{
    train_sharded(r, tag, shards, args, wex);
    cr_assert(a_run_ok(r), "%s: %s", tag, r->psd_log);
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
    { /* each shard's file holds its part only (checkpoint format 4): header, seen bits (shard 0),
       * the part's weights and two Adam moments, trailer */
        ps_layout_t l;
        float *params = NULL;
        ps_weights_meta_t meta;
        char err[512];
        cr_assert_eq(ps_weights_load(a.weights, &l, &params, &meta, err, sizeof err), 0, "%s", err);
        free(params);
        for (int i = 0; i < 2; i++) {
            ps_piece_t pc[PS_MAX_TENSORS];
            ps_shard_pieces(&l, i, 2, pc);
            const uint64_t want = 232 + (i == 0 ? (3000 + 7) / 8 : 0) + 3 * ps_part_size(pc, l.n_tensors) * 4 + 12;
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
    cr_assert_eq(run_cmd("'%s' --resume '%s' --check-config --epochs 2 --set data.train_limit=3000 --seed 3 --set "
                         "optimizer.name=adam --set optimizer.lr=0.002 --set optimizer.clip_norm=0.5 --set '%s' > "
                         "/dev/null 2>&1", psd_bin, ck, arg), 2, "--check-config finds it too");
    cr_assert_eq(run_cmd("'%s' --resume '%s' --check-config --shard 0/2 --epochs 2 --set data.train_limit=3000 --seed 3 "
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
    cr_assert_eq(run_cmd("%s --shard 1/2 --check-config >/dev/null 2>&1", psd_bin), 2, "no --leader");
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

/* ---- a fake shard 0 (and a hand-made worker) against a real psd shard ---- */

/* The next message of `type` on sock within timeout_s (others dropped):
 * 0, or -1. */
static int recv_type(void *sock, bool router, Psd__MsgType type, ps_msg_t *m, double timeout_s)
{
    double end = ps_now() + timeout_s;
    char err[256];
    while (ps_now() < end) {
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0 || ps_msg_recv(sock, m, router, ZMQ_DONTWAIT, err, sizeof err) != 0) continue;
        if (m->hdr->type == type) return 0;
        ps_msg_deinit(m);
    }
    return -1;
}

/* A header of `type` for run 0x77 from rank 0 (the body is the caller's):
 * the fake peers' (shard 0, a shard, a worker, psd) */
static Psd__Header fake_hdr(Psd__MsgType type, uint64_t seq)
{
    Psd__Header h;
    psd__header__init(&h);
    h.type = type;
    h.run_id = 0x77;
    h.seq = seq;
    return h;
}

/* A worker's DEALER registered with the shard at ep as rank 0 with token
 * (asked again until the shard answers: shard 0's word may come later). */
static void *shard_register(void *ctx, const char *ep, const uint8_t *token, uint64_t *seq)
{
    void *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_connect(d, ep), 0);
    for (int i = 0; i < 50; i++) {
        Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_REGISTER, ++*seq);
        Psd__Register r = PSD__REGISTER__INIT;
        r.shard_token.data = (uint8_t *)token;
        r.shard_token.len = PS_SHM_TOKEN;
        h.body_case = PSD__HEADER__BODY_REG;
        h.reg = &r;
        cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
        ps_msg_t m;
        if (recv_type(d, false, PSD__MSG_TYPE__MSG_ASSIGN, &m, 0.5) == 0) {
            ps_msg_deinit(&m);
            return d;
        }
    }
    cr_assert_fail("the shard did not answer REGISTER");
    return NULL;
}

/* Rank 0's push of version v: the bias (4 floats of 1, the shard's part of
 * MLP 784-4), with a pull of the next version. */
static void shard_push(void *d, uint64_t v, uint64_t *seq)
{
    float g[4] = {1, 1, 1, 1};
    ps_frame_t fr = {.data = g, .nbytes = sizeof g, .id = 1, .dtype = PSD__DTYPE__DT_F32, .rows = 4};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_PUSH, ++*seq);
    Psd__Push p = PSD__PUSH__INIT;
    p.version = v;
    p.batch = 1;
    p.pull = true;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &p;
    cr_assert_eq(ps_msg_send(d, NULL, 0, &h, &fr, 1), 0);
}

/* Shard 0 tells the shard to step version v (step v) with `ranks`, each
 * weighing 1/n, lr 0.5. */
static void shard_step(void *lead, const uint8_t *ident, size_t ilen, uint64_t v, uint32_t *ranks, size_t n,
                       uint64_t seq)
{
    double wt[4] = {1.0 / (double)n, 1.0 / (double)n, 1.0 / (double)n, 1.0 / (double)n};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_STEP, seq);
    Psd__ShardStep st = PSD__SHARD_STEP__INIT;
    st.version = v;
    st.step = v;
    st.ranks = ranks;
    st.n_ranks = n;
    st.weights = wt;
    st.n_weights = n;
    st.lr = 0.5;
    h.body_case = PSD__HEADER__BODY_SHARD_STEP;
    h.shard_step = &st;
    cr_assert_eq(ps_msg_send(lead, ident, ilen, &h, NULL, 0), 0);
}

/* The test as shard 0 of 2 against a real `psd --shard 1/2` (started with
 * the extra arguments, its log in `log`): it joins (the test answers its
 * HELLO), learns that rank 0 may register with fake_token, and rank 0 is
 * registered with it (w). */
typedef struct {
    void *ctx, *lead, *w; /* shard 0's ROUTER; rank 0's DEALER to the shard */
    char wep[64], log[256];
    uint8_t ident[PS_MAX_IDENTITY]; /* the shard's identity on lead */
    size_t ilen;
    uint64_t lseq, seq; /* shard 0's and rank 0's sequence numbers */
    pid_t sh;
} fake_lead_t;

static const uint8_t fake_token[PS_SHM_TOKEN] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};

static void fake_lead_start(fake_lead_t *f, const char *logname, const char *const *extra)
{
    memset(f, 0, sizeof *f);
    f->ctx = zmq_ctx_new();
    f->lead = zmq_socket(f->ctx, ZMQ_ROUTER);
    int zero = 0;
    zmq_setsockopt(f->lead, ZMQ_LINGER, &zero, sizeof zero);
    char lep[64];
    snprintf(lep, sizeof lep, "tcp://127.0.0.1:%d", free_port());
    snprintf(f->wep, sizeof f->wep, "tcp://127.0.0.1:%d", free_port());
    cr_assert_eq(zmq_bind(f->lead, lep), 0);
    path(f->log, sizeof f->log, logname);
    const char *argv[32] = {psd_bin, "--listen", f->wep, "--shard", "1/2", "--leader", lep, "--set",
                            "checkpoint.dir=", "--worker-timeout", "60"};
    int k = 11;
    for (int j = 0; extra[j]; j++) argv[k++] = extra[j];
    argv[k] = NULL;
    f->sh = proc_spawn(argv, f->log);
    ps_msg_t m;
    cr_assert_eq(recv_type(f->lead, true, PSD__MSG_TYPE__MSG_SHARD_HELLO, &m, 60), 0, "no HELLO from the shard");
    f->ilen = m.ident_len;
    memcpy(f->ident, m.ident, m.ident_len);
    ps_msg_deinit(&m);
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_HELLO, ++f->lseq);
    Psd__ShardHello hb = PSD__SHARD_HELLO__INIT;
    hb.shard = 1;
    hb.shards = 2;
    h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    h.shard_hello = &hb;
    cr_assert_eq(ps_msg_send(f->lead, f->ident, f->ilen, &h, NULL, 0), 0);
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_WORKER, ++f->lseq);
    Psd__ShardWorker sw = PSD__SHARD_WORKER__INIT;
    sw.token.data = (uint8_t *)fake_token;
    sw.token.len = PS_SHM_TOKEN;
    h.body_case = PSD__HEADER__BODY_SHARD_WORKER;
    h.shard_worker = &sw;
    cr_assert_eq(ps_msg_send(f->lead, f->ident, f->ilen, &h, NULL, 0), 0);
    f->w = shard_register(f->ctx, f->wep, fake_token, &f->seq);
}

/* Shard 0 sends h (its sequence number next) to the shard. */
static void fake_lead_send(fake_lead_t *f, Psd__Header *h)
{
    h->seq = ++f->lseq;
    cr_assert_eq(ps_msg_send(f->lead, f->ident, f->ilen, h, NULL, 0), 0);
}

static void fake_lead_end(fake_lead_t *f)
{
    zmq_close(f->w);
    zmq_close(f->lead);
    zmq_ctx_term(f->ctx);
}

/* A psd shard keeps a worker's complete push when the worker registers
 * again from a new connection (shard 0 was told it is here and names it
 * in its STEP: the shard failed the run before), and refuses a STEP that
 * names a rank twice (it reduced that push twice before). Shard 0 is this
 * test: it answers the shard's HELLO, tells it about rank 0, reads its
 * SHARD_HAVE and sends the STEPs. */
Test(short, a_psd_shard_keeps_pushes_across_registrations_and_refuses_repeated_ranks)
{
    const char *extra[] = {"--set", "model.layers=[784,4]", "--set", "optimizer.momentum=0", "--set",
                           "optimizer.weight_decay=0", "--set", "data.train_limit=1000", "--log-level", "debug", NULL};
    fake_lead_t f;
    fake_lead_start(&f, "fakelead-shard.log", extra);
    ps_msg_t m;
    Psd__Header h;
    shard_push(f.w, 0, &f.seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE");
    cr_assert_eq(m.hdr->shard_have->rank, 0);
    ps_msg_deinit(&m);
    void *w2 = shard_register(f.ctx, f.wep, fake_token, &f.seq); /* the same rank from a new connection */
    h = fake_hdr(PSD__MSG_TYPE__MSG_PULL, ++f.seq);
    Psd__Pull pl = PSD__PULL__INIT;
    pl.min_version = 1;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &pl;
    cr_assert_eq(ps_msg_send(w2, NULL, 0, &h, NULL, 0), 0);
    uint32_t one[1] = {0};
    shard_step(f.lead, f.ident, f.ilen, 0, one, 1, ++f.lseq);
    cr_assert_eq(recv_type(w2, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0,
                 "no version 1 after the STEP: the shard dropped the push (log %s)", f.log);
    size_t n = 0;
    const float *b = m.n_frames == 1 ? ps_msg_f32(&m, 0, &n) : NULL;
    cr_assert(b && n == 4 && m.hdr->weights->version == 1, "weights of the shard's part");
    for (int i = 0; i < 4; i++) cr_expect_float_eq(b[i], -0.5f, 1e-6, "bias %d: 0 - 0.5 x 1", i);
    ps_msg_deinit(&m);

    shard_push(w2, 1, &f.seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE for version 1");
    ps_msg_deinit(&m);
    uint32_t twice[2] = {0, 0};
    shard_step(f.lead, f.ident, f.ilen, 1, twice, 2, ++f.lseq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_ERROR, &m, 30), 0, "a STEP naming rank 0 twice was taken");
    cr_expect(m.hdr->error->message && strstr(m.hdr->error->message, "repeated rank"), "%s",
              m.hdr->error->message ? m.hdr->error->message : "");
    ps_msg_deinit(&m);
    cr_expect_eq(proc_wait(f.sh, 30), 1, "the shard exits 1");
    zmq_close(w2);
    fake_lead_end(&f);
}

/* Shard 0 gives the rank of a worker long gone to a new one (every worker
 * slot taken: worker_slots_are_reused_once_every_one_was_taken): a
 * SHARD_WORKER with another token. The shard forgets all of the old
 * worker, also its complete push that shard 0 never stepped (the old one
 * was gone); the new worker's push of that version is taken, not dropped
 * as a second one, and stepped. */
Test(short, a_psd_shard_forgets_a_rank_given_to_a_new_worker)
{
    const char *extra[] = {"--set", "model.layers=[784,4]", "--set", "optimizer.momentum=0", "--set",
                           "optimizer.weight_decay=0", "--set", "data.train_limit=1000", NULL};
    fake_lead_t f;
    fake_lead_start(&f, "fakelead-reuse.log", extra);
    ps_msg_t m;
    shard_push(f.w, 0, &f.seq); /* the old worker's push, complete here */
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE");
    ps_msg_deinit(&m);
    static const uint8_t token2[PS_SHM_TOKEN] = {9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 2};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_WORKER, 0);
    Psd__ShardWorker sw = PSD__SHARD_WORKER__INIT;
    sw.token.data = (uint8_t *)token2;
    sw.token.len = PS_SHM_TOKEN;
    h.body_case = PSD__HEADER__BODY_SHARD_WORKER;
    h.shard_worker = &sw;
    fake_lead_send(&f, &h);
    uint64_t seq2 = 0;
    void *w2 = shard_register(f.ctx, f.wep, token2, &seq2);
    shard_push(w2, 0, &seq2);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0,
                 "no SHARD_HAVE for the new worker's push: dropped as a second one (log %s)", f.log);
    ps_msg_deinit(&m);
    uint32_t one[1] = {0};
    shard_step(f.lead, f.ident, f.ilen, 0, one, 1, ++f.lseq);
    cr_assert_eq(recv_type(w2, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0, "no version 1 for the new worker");
    size_t n = 0;
    const float *b = m.n_frames == 1 ? ps_msg_f32(&m, 0, &n) : NULL;
    cr_assert(b && n == 4 && m.hdr->weights->version == 1, "weights of the shard's part");
    for (int i = 0; i < 4; i++) cr_expect_float_eq(b[i], -0.5f, 1e-6, "bias %d: 0 - 0.5 x 1 (its push, once)", i);
    ps_msg_deinit(&m);
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHUTDOWN, 0);
    Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
    sd.reason = "test over";
    h.body_case = PSD__HEADER__BODY_SHUTDOWN;
    h.shutdown = &sd;
    fake_lead_send(&f, &h);
    cr_expect_eq(proc_wait(f.sh, 30), 0, "the shard exits 0 at SHUTDOWN");
    zmq_close(w2);
    fake_lead_end(&f);
}

/* A PUSH of table rows to rank 0's shard connection d for version v: the
 * ids frame (n ids) and a values frame of nv rows of 8 floats (val), or
 * none when nv < 0; then, with want, the n_want rows the reply is to bring
 * (pull: whether it asks for the next version). */
static void shard_push_rows_want(void *d, uint64_t v, const uint32_t *ids, size_t n, int nv, float val,
                                 const uint32_t *want, size_t n_want, bool pull, uint64_t *seq)
{
    const uint32_t table = 4; /* ctr.yaml: W0, b0, W1, b1, E */
    float vals[4 * 8];
    for (int i = 0; i < 4 * 8; i++) vals[i] = val + (float)(i / 8);
    ps_frame_t fr[3] = {{.data = ids, .nbytes = n * 4, .id = table, .dtype = PSD__DTYPE__DT_U32, .rows = (uint32_t)n},
                        {.data = vals, .nbytes = (size_t)(nv > 0 ? nv : 0) * 32, .id = table,
                         .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)(nv > 0 ? nv : 0), .cols = 8}};
    int k = nv < 0 ? 1 : 2;
    if (want)
        fr[k++] = (ps_frame_t){.data = want, .nbytes = n_want * 4, .id = table, .dtype = PSD__DTYPE__DT_U32,
                               .rows = (uint32_t)n_want};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_PUSH, ++*seq);
    Psd__Push p = PSD__PUSH__INIT;
    p.version = v;
    p.batch = 1;
    p.pull = pull;
    p.want_rows = want != NULL;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &p;
    cr_assert_eq(ps_msg_send(d, NULL, 0, &h, fr, k), 0);
}

static void shard_push_rows(void *d, uint64_t v, const uint32_t *ids, size_t n, int nv, float val, uint64_t *seq)
{
    shard_push_rows_want(d, v, ids, n, nv, val, NULL, 0, true, seq);
}

/* The shard's part (its piece of the table) of the version its WEIGHTS
 * answer on d brings, copied into out (n floats). */
static void shard_weights(void *d, uint64_t version, float *out, size_t n)
{
    ps_msg_t m;
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0, "no WEIGHTS of version %" PRIu64,
                 version);
    size_t got = 0;
    const float *f = m.n_frames == 1 ? ps_msg_f32(&m, 0, &got) : NULL;
    cr_assert(f && got == n && m.hdr->weights->version == version, "the piece of version %" PRIu64, version);
    memcpy(out, f, n * sizeof *f);
    ps_msg_deinit(&m);
}

/* A psd shard takes a push of table rows for its piece of the table only
 * (ids strictly increasing inside the piece, one value row each: anything
 * else is dropped and logged), steps the rows pushed (no other), forgets
 * a push's rows at the next one,
 * and answers a push or a PULL that lists rows of its piece with those
 * rows. The test is shard 0 (ctr.yaml: the MLP on shard 0, the table's
 * rows 32768..65535 on shard 1) and worker rank 0. */
Test(short, a_psd_shard_takes_table_rows_of_its_piece_only)
{
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, (int[]){64, 64, 2}, 3, 65536, 8), 0);
    ps_piece_t pc[PS_MAX_TENSORS];
    ps_shard_pieces(&l, 1, 2, pc);
    size_t r0 = 0, r1 = 0;
    cr_assert(l.table == 4 && ps_piece_rows(&l, &pc[4], &r0, &r1) && r0 == 32768 && r1 == 65536, "%zu..%zu", r0, r1);
    for (int t = 0; t < 4; t++) cr_assert_eq(pc[t].n, 0, "the MLP on shard 0");
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *extra[] = {"--config", cfg, NULL};
    fake_lead_t f;
    fake_lead_start(&f, "fakelead-rows.log", extra);
    ps_msg_t m;
    Psd__Header h;
    void *w = f.w;
    uint64_t *seq = &f.seq;
    const size_t n = pc[4].n;
    float *v0 = malloc(n * sizeof *v0), *v1 = malloc(n * sizeof *v1), *v2 = malloc(n * sizeof *v2);
    h = fake_hdr(PSD__MSG_TYPE__MSG_PULL, ++*seq);
    Psd__Pull pl = PSD__PULL__INIT;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &pl;
    cr_assert_eq(ps_msg_send(w, NULL, 0, &h, NULL, 0), 0);
    shard_weights(w, 0, v0, n);

    /* refused: a row of shard 0's piece, ids out of order, values for fewer rows, no values */
    const uint32_t below[2] = {32767, 32768}, unsorted[2] = {40000, 39999}, ok[2] = {32768, 65535};
    shard_push_rows(w, 0, below, 2, 2, 1, seq);
    shard_push_rows(w, 0, unsorted, 2, 2, 1, seq);
    shard_push_rows(w, 0, ok, 2, 1, 1, seq);
    shard_push_rows(w, 0, ok, 2, -1, 1, seq);
    cr_assert_neq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 1), 0, "a bad push of rows was taken");
    char *text = slurp(f.log);
    cr_assert_eq(count_in(text, "are not rows of this shard's piece of the table"), 4, "%s", text);
    free(text);
    shard_push_rows(w, 0, ok, 2, 2, 1, seq); /* rows 32768 (all 1) and 65535 (all 2) */
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE for the rows");
    ps_msg_deinit(&m);
    uint32_t one[1] = {0};
    shard_step(f.lead, f.ident, f.ilen, 0, one, 1, ++f.lseq);
    shard_weights(w, 1, v1, n);
    const size_t last = n - 8;
    for (size_t i = 0; i < n; i++) {
        if (i < 8 || i >= last) cr_assert(v1[i] < v0[i], "float %zu of a row pushed went down", i);
        else cr_assert(v1[i] == v0[i], "float %zu of a row not pushed changed", i);
    }
    /* the next push's rows only: the last push's are not stepped again */
    const uint32_t mid[1] = {50000};
    shard_push_rows(w, 1, mid, 1, 1, 1, seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE for version 1");
    ps_msg_deinit(&m);
    shard_step(f.lead, f.ident, f.ilen, 1, one, 1, ++f.lseq);
    shard_weights(w, 2, v2, n);
    const size_t at = (50000 - 32768) * 8;
    for (size_t i = 0; i < n; i++) {
        if (i >= at && i < at + 8) cr_assert(v2[i] < v1[i], "float %zu of the row pushed went down", i);
        else cr_assert(v2[i] == v1[i], "float %zu of a row not pushed this time changed", i);
    }
    /* with the rows the next batch reads: the reply brings those rows of the new version only;
     * refused: a row of shard 0's piece, a list without a pull */
    const uint32_t other[1] = {50001}, want[2] = {32768, 65535};
    shard_push_rows_want(w, 2, other, 1, 1, 1, below, 2, true, seq);
    shard_push_rows_want(w, 2, other, 1, 1, 1, want, 2, false, seq);
    cr_assert_neq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 1), 0, "a bad list of rows was taken");
    text = slurp(f.log);
    cr_assert_eq(count_in(text, "asking for table rows that are not rows of this shard's piece"), 2, "%s", text);
    free(text);
    shard_push_rows_want(w, 2, other, 1, 1, 1, want, 2, true, seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE for version 2");
    ps_msg_deinit(&m);
    shard_step(f.lead, f.ident, f.ilen, 2, one, 1, ++f.lseq);
    cr_assert_eq(recv_type(w, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0, "no WEIGHTS of version 3");
    size_t got = 0;
    const float *r = m.n_frames == 1 ? ps_msg_f32(&m, 0, &got) : NULL;
    cr_assert(r && got == 16 && m.hdr->weights->version == 3 && m.hdr->weights->rows,
              "two rows of version 3 (%zu floats)", got);
    for (int i = 0; i < 8; i++) {
        cr_assert(r[i] == v2[i], "row 32768 (not pushed since version 1), float %d", i);
        cr_assert(r[8 + i] == v2[last + i], "row 65535, float %d", i);
    }
    ps_msg_deinit(&m);
    /* a PULL listing rows (a batch that grew, a validation part): those of the piece only; the
     * reply brings them */
    for (int k = 0; k < 2; k++) {
        h = fake_hdr(PSD__MSG_TYPE__MSG_PULL, ++*seq);
        Psd__Pull rp = PSD__PULL__INIT;
        rp.min_version = 3;
        rp.want_rows = true;
        h.body_case = PSD__HEADER__BODY_PULL;
        h.pull = &rp;
        const uint32_t mine[1] = {40000};
        ps_frame_t fr = {.data = k ? mine : below, .nbytes = (k ? 1 : 2) * sizeof(uint32_t), .id = 4,
                         .dtype = PSD__DTYPE__DT_U32, .rows = k ? 1 : 2};
        cr_assert_eq(ps_msg_send(w, NULL, 0, &h, &fr, 1), 0);
    }
    cr_assert_eq(recv_type(w, false, PSD__MSG_TYPE__MSG_WEIGHTS, &m, 30), 0, "no WEIGHTS for the PULL of rows");
    r = m.n_frames == 1 ? ps_msg_f32(&m, 0, &got) : NULL;
    cr_assert(r && got == 8 && m.hdr->weights->rows, "row 40000 only (%zu floats)", got);
    for (int i = 0; i < 8; i++) cr_assert(r[i] == v2[(40000 - 32768) * 8 + i], "row 40000, float %d", i);
    ps_msg_deinit(&m);
    text = slurp(f.log);
    cr_assert_eq(count_in(text, "PULL of rank 0 asking for table rows that are not rows of this shard's piece"), 1,
                 "%s", text);
    free(text);
    free(v0);
    free(v1);
    free(v2);
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHUTDOWN, ++f.lseq);
    Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
    sd.reason = "test over";
    h.body_case = PSD__HEADER__BODY_SHUTDOWN;
    h.shutdown = &sd;
    fake_lead_send(&f, &h);
    cr_expect_eq(proc_wait(f.sh, 30), 0, "the shard exits 0 at SHUTDOWN");
    text = slurp(f.log);
    cr_expect(text && strstr(text, "3 pushes of table rows (4 rows); sent 3 rows in replies"), "%s", text ? text : "");
    free(text);
    fake_lead_end(&f);
}

/* With clipping, a psd shard sends its blocks' norms (SHARD_NORM) and
 * applies nothing before shard 0's APPLY; an APPLY whose sum of squares is
 * negative (no gradient has one) ends the run on the shard (exit 1, ERROR
 * to shard 0) instead of applying a NaN scale. The test is shard 0. */
Test(short, a_psd_shard_refuses_a_negative_norm)
{
    const char *extra[] = {"--set", "model.layers=[784,4]", "--set", "optimizer.clip_norm=1", "--set",
                           "data.train_limit=1000", NULL};
    fake_lead_t f;
    fake_lead_start(&f, "fakelead-norm.log", extra);
    ps_msg_t m;
    shard_push(f.w, 0, &f.seq);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_HAVE, &m, 30), 0, "no SHARD_HAVE");
    ps_msg_deinit(&m);
    uint32_t one[1] = {0};
    double wt[1] = {1};
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_STEP, 0);
    Psd__ShardStep st = PSD__SHARD_STEP__INIT;
    st.ranks = one;
    st.n_ranks = 1;
    st.weights = wt;
    st.n_weights = 1;
    st.lr = 0.5;
    st.clip_norm = 1;
    h.body_case = PSD__HEADER__BODY_SHARD_STEP;
    h.shard_step = &st;
    fake_lead_send(&f, &h);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_SHARD_NORM, &m, 30), 0, "no SHARD_NORM (log %s)", f.log);
    cr_assert(m.hdr->shard_norm->n_block_sq == 1 && m.hdr->shard_norm->block_sq[0] == 4.0,
              "one block: the bias's 4 ones");
    ps_msg_deinit(&m);
    h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_APPLY, 0);
    Psd__ShardApply ap = PSD__SHARD_APPLY__INIT;
    ap.sumsq = -1;
    h.body_case = PSD__HEADER__BODY_SHARD_APPLY;
    h.shard_apply = &ap;
    fake_lead_send(&f, &h);
    cr_assert_eq(recv_type(f.lead, true, PSD__MSG_TYPE__MSG_ERROR, &m, 30), 0, "a negative norm was applied");
    cr_expect(m.hdr->error->message && strstr(m.hdr->error->message, "negative sum of squares"), "%s",
              m.hdr->error->message ? m.hdr->error->message : "");
    ps_msg_deinit(&m);
    cr_expect_eq(proc_wait(f.sh, 30), 1, "the shard exits 1");
    fake_lead_end(&f);
}

/* A shard's HELLO to shard 0 (as shard i of n, config hash `hash`, MLP
 * 784-10), from the fake shard's DEALER d. */
static void fake_hello(void *d, uint32_t i, uint32_t n, uint64_t hash, uint64_t *seq)
{
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHARD_HELLO, ++*seq);
    h.run_id = 0;
    h.rank = i;
    Psd__ShardHello b = PSD__SHARD_HELLO__INIT;
    b.shard = i;
    b.shards = n;
    b.endpoint = "tcp://127.0.0.1:1";
    b.config_hash = hash;
    b.n_params = 784 * 10 + 10;
    b.hostname = "fake";
    b.pid = 4242;
    h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
    h.shard_hello = &b;
    cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
}

/* Shard 0 keeps watching a joined shard whose connection says HELLO again
 * as another shard: that HELLO is dropped. Before, it un-joined the shard,
 * and a shard that then fell silent went unnoticed: the run waited for its
 * start timeout (exit 3). This test is shard 1: it joins, says HELLO as
 * shard 2 of 3, and falls silent: shard 0 ends the run, shard lost (5). */
Test(short, a_joined_shard_saying_hello_as_another_is_still_watched)
{
    run_t r;
    const char *args[] = {"--set", "model.layers=[784,10]", "--set", "checkpoint.dir=", "--shard", "0/2",
                          "--worker-timeout", "2", "--start-timeout", "60", NULL};
    pid_t p = start_psd(&r, "oddhello", 1, args);
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_connect(d, r.endpoint), 0);
    uint64_t seq = 0, hash = 0;
    ps_msg_t m;
    fake_hello(d, 1, 2, 0, &seq); /* a wrong hash: the refusal names shard 0's */
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_ERROR, &m, 60), 0, "no refusal");
    const char *at = m.hdr->error->message ? strstr(m.hdr->error->message, "shard 0's ") : NULL;
    cr_assert(at && sscanf(at, "shard 0's %" SCNx64, &hash) == 1, "%s", m.hdr->error->message);
    ps_msg_deinit(&m);
    fake_hello(d, 1, 2, hash, &seq);
    cr_assert_eq(recv_type(d, false, PSD__MSG_TYPE__MSG_SHARD_HELLO, &m, 30), 0, "not joined");
    ps_msg_deinit(&m);
    fake_hello(d, 2, 3, hash, &seq);
    cr_assert_eq(proc_wait(p, 45), 5, "shard 0 did not notice its silent shard (log %s)", r.psd_log);
    char *l = slurp(r.psd_log);
    cr_expect(strstr(l, "dropped a message from psd shard 1 (fake pid 4242): HELLO on its connection as shard 2"), "%s",
              l); /* named as the shard it is, not "an unknown peer" */
    cr_expect(strstr(l, "psd shard 1 (fake pid 4242) lost"), "%s", l);
    free(l);
    zmq_close(d);
    zmq_ctx_term(ctx);
}

/* --log-format json: every line psd and the workers write is one JSON
 * object with ts, role, level and msg (checked with Python's json module);
 * the rank-0 rule holds (rank 1 logs no INFO without --verbose). */
Test(short, json_logs_are_one_object_a_line)
{
    if (run_cmd("command -v python3 >/dev/null") != 0) cr_skip_test("no python3 to parse JSON with");
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--log-format", "json", NULL};
    const char *wargs[] = {"--log-format", "json", NULL};
    pid_t p = start_psd(&r, "json", 2, args);
    pid_t w0 = start_worker(&r, "json", 0, wargs);
    wait_log(r.psd_log, "rank 0", 60);
    pid_t w1 = start_worker(&r, "json", 1, wargs);
    cr_assert_eq(proc_wait(p, 300), 0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    char script[] = "import json, sys\n"
                    "for f, want_info in zip(sys.argv[1:], (1, 1, 0)):\n"
                    "    n = info = 0\n"
                    "    for line in open(f, encoding='utf-8'):\n"
                    "        d = json.loads(line)\n"
                    "        assert set(d) == {'ts', 'role', 'level', 'msg'}, d\n"
                    "        assert d['level'] in ('error', 'warn', 'info', 'debug'), d\n"
                    "        n += 1; info += d['level'] == 'info'\n"
                    "    assert n > 0 and (info > 0) == bool(want_info), (f, n, info)\n";
    char py[512];
    path(py, sizeof py, "check.py");
    FILE *f = fopen(py, "w");
    cr_assert_not_null(f);
    fputs(script, f);
    fclose(f);
    cr_assert_eq(run_cmd("python3 '%s' '%s' '%s/json-w0.log' '%s/json-w1.log'", py, r.psd_log, dir, dir), 0,
                 "every log line is a JSON object (see the test's output)");
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "\"msg\":\"run finished: 1 epochs"), "%s", log);
    free(log);
}

/* Progress: on a terminal (a pseudo-terminal from script(1)) psd keeps a
 * live line (carriage return, erase to end of line) with the step, speed,
 * ETA, loss and slowest worker, and the log lines stay whole; without one it
 * writes plain progress lines every server.progress_every seconds and no
 * control character at all. */
Test(short, progress_on_a_terminal_and_off_it)
{
    if (run_cmd("command -v script >/dev/null") != 0) cr_skip_test("no script(1) for a pseudo-terminal");
    const char *wx[] = {"--no-shm", NULL}; /* slower: the epoch lasts a few timer ticks */
    /* on a terminal */
    run_t r;
    snprintf(r.endpoint, sizeof r.endpoint, "tcp://127.0.0.1:%d", free_port());
    char out[512];
    path(out, sizeof out, "tty.out");
    pid_t w0 = start_worker(&r, "tty", 0, wx), w1 = start_worker(&r, "tty", 1, wx);
    int rc = run_cmd("cd '%s' && TERM=xterm timeout 300 script -qfec \"'%s' --listen %s --workers 2 --epochs 1 "
                     "--set data.train_limit=20000 --set checkpoint.dir= --metrics '' --save ''\" /dev/null > '%s'",
                     dir, psd_bin, r.endpoint, out);
    cr_assert_eq(rc, 0, "psd under a pseudo-terminal");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    char *t = slurp(out);
    cr_assert_not_null(t);
    cr_assert(strstr(t, "\r") && strstr(t, "\x1b[K"), "a live line on the terminal:\n%s", t);
    cr_assert(strstr(t, "\repoch 1/1 step ") && strstr(t, "samples/s ETA "), "%s", t);
    cr_assert(strstr(t, "psd INFO  epoch 1/1 step "), "the epoch's log line:\n%s", t);
    cr_assert(strstr(t, "\r\x1b[K20"), "a log line erases the live line first:\n%s", t);
    free(t);
    /* not a terminal */
    run_t q;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=20000", "--set", "server.progress_every=0.2",
                          NULL};
    train_wx(&q, "plain", 2, args, wx, 300);
    check_run(&q, 2, 1);
    char *log = slurp(q.psd_log);
    cr_assert_not_null(log);
    cr_assert(strstr(log, "psd INFO  epoch 1/1 step ") && strstr(log, " samples/s ETA "), "progress lines:\n%s", log);
    for (const char *c = log; *c; c++)
        cr_assert((unsigned char)*c >= 0x20 || *c == '\n', "control character %#x in a log file", *c);
    free(log);
}

/* A worker that finished its samples, pushed its last batch (no pull) and
 * reached the barrier is given more samples when another is lost; it asks
 * for weights while its last push still waits for the step (a third worker
 * has not pushed yet). psd must answer with the version that step makes:
 * the version its push was computed on would make its next push stale. */

/* A library worker, registered and ready (384 training samples, 10000
 * test), through psd's shared memory (shm) or over the wire. */
static psw_client_t *lib_worker_shm(const char *ep, int shm, char *err, size_t n)
{
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = !shm};
    psw_client_t *c = psw_client_new(ep, &info, err, n);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, n) == 0, "%s", err);
    cr_assert_eq(psw_client_ready(c, 384, 10000), 0);
    return c;
}

/* the same over the wire */
static psw_client_t *lib_worker(const char *ep, char *err, size_t n) { return lib_worker_shm(ep, 0, err, n); }

/* The library workers' model, 784-hidden-10, and a zero gradient for it. */
static float *lib_model(ps_layout_t *l, int hidden)
{
    cr_assert_eq(ps_layout_init(l, (const int[]){784, hidden, 10}, 3), 0);
    float *zero = calloc(l->n_params, sizeof *zero);
    cr_assert(zero);
    return zero;
}

static void lib_next(psw_client_t *c, psw_event_t *ev, psw_event_kind_t kind)
{
    char err[512];
    int rc = psw_client_next(c, ev, 30, err, sizeof err);
    cr_assert_eq(rc, 0, "%s", err);
    cr_assert_eq(ev->kind, kind, "event %d, want %d", (int)ev->kind, (int)kind);
}

/* n library workers in registration order, each given `samples` of the
 * epoch and asking for the weights. */
static void lib_start(const char *ep, psw_client_t **w, int n, size_t samples)
{
    char err[512];
    psw_event_t ev;
    for (int i = 0; i < n; i++) w[i] = lib_worker(ep, err, sizeof err);
    for (int i = 0; i < n; i++) {
        lib_next(w[i], &ev, PSW_EV_EPOCH);
        cr_assert_eq(ev.n_samples, samples, "worker %d was given %" PRIu64 " samples, not %zu", i,
                     (uint64_t)ev.n_samples, samples);
        psw_client_pull(w[i], ev.version);
    }
}

/* A push's arguments for every tensor of l, the gradient from grad (laid out as l). */
typedef struct {
    const float *g[PSW_MAX_TENSORS];
    size_t numel[PSW_MAX_TENSORS];
    int ids[PSW_MAX_TENSORS], rows[PSW_MAX_TENSORS], cols[PSW_MAX_TENSORS];
} lib_grads_t;

static void lib_grads(lib_grads_t *a, const ps_layout_t *l, const float *grad)
{
    for (int t = 0; t < l->n_tensors; t++) {
        a->ids[t] = t;
        a->g[t] = grad + l->t[t].offset;
        a->numel[t] = l->t[t].numel;
        a->rows[t] = l->t[t].rows;
        a->cols[t] = t % 2 == 0 ? l->t[t].cols : 0;
    }
}

static void lib_push(psw_client_t *c, uint64_t version, uint32_t batch, int pull, const float *zero,
                     const ps_layout_t *l)
{
    lib_grads_t a;
    lib_grads(&a, l, zero);
    cr_assert_eq(psw_client_push(c, version, batch, 0.5 * batch, 0, pull, l->n_tensors, a.ids, a.g, a.numel, a.rows,
                                 a.cols),
                 0);
}

/* A worker on shared memory reads its weights in psd's parameter slot.
 * Until it promises to read no more of them once it pushes
 * (psw_client_release_on_push), psd's step leaves that slot alone: the next
 * version goes into another slot and the old one keeps its values. Once it
 * has promised, each step updates the slot in place (the same slot, new
 * values, the CRC-32 psd sends for it checked by the client), and the
 * metrics count those steps; the last push of the epoch asks for nothing,
 * so it releases nothing. The weights are the same as a wire worker's. */
/* psd's arguments for the in-place tests (one epoch of 384 samples, model
 * 784-32-10, CRC-32 of every version), the model's layout, a gradient that
 * moves every weight, and room for a copy of the first tensor */
static const char *const inplace_args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set",
                                           "model.layers=[784,32,10]", "--set", "checkpoint.dir=",
                                           "--x-verify-weights", NULL};

static float *inplace_model(ps_layout_t *l, float **copy)
{
    float *grad = lib_model(l, 32);
    for (size_t i = 0; i < l->n_params; i++) grad[i] = 0.01f * (float)(i % 7) - 0.02f;
    *copy = malloc(l->t[0].numel * sizeof **copy);
    cr_assert(*copy);
    return grad;
}

Test(short, a_shared_slot_is_stepped_in_place_only_once_released)
{
    const char **args = (const char **)inplace_args;
    ps_layout_t l;
    float *copy;
    float *grad = inplace_model(&l, &copy);
    const size_t n0 = l.t[0].numel;
    char weights[2][sizeof ((run_t *)0)->weights];
    for (int mode = 0; mode < 2; mode++) { /* shared memory, then the wire */
        run_t r;
        pid_t p = start_psd(&r, mode ? "inplace-wire" : "inplace", 1, args);
        char err[512];
        psw_client_t *c = lib_worker_shm(r.endpoint, mode == 0, err, sizeof err);
        cr_assert_eq(psw_client_push_region(c) != NULL, mode == 0, "shared memory only without no_shm");
        psw_event_t ev;
        lib_next(c, &ev, PSW_EV_EPOCH);
        cr_assert_eq(ev.n_samples, 384);
        psw_client_pull(c, ev.version);
        lib_next(c, &ev, PSW_EV_WEIGHTS);
        const float *prev = ev.tensors[0];
        for (int step = 0; step < 6; step++) {
            int last = step == 5;
            memcpy(copy, ev.tensors[0], n0 * sizeof *copy);
            if (step == 1) psw_client_release_on_push(c, 1);
            lib_push(c, ev.version, 64, !last, grad, &l);
            if (last) break;
            lib_next(c, &ev, PSW_EV_WEIGHTS);
            if (mode == 1) continue;
            cr_assert_neq(memcmp(ev.tensors[0], copy, n0 * sizeof *copy), 0, "step %d changed the weights", step);
            if (step == 0) {
                cr_assert_neq(ev.tensors[0], prev, "not released: the next version in another slot");
                cr_assert_eq(memcmp(prev, copy, n0 * sizeof *copy), 0, "not released: the slot read is untouched");
            } else {
                cr_assert_eq(ev.tensors[0], prev, "released (step %d): the same slot, updated in place", step);
            }
            prev = ev.tensors[0];
        }
        psw_client_barrier(c, 0, 384);
        lib_next(c, &ev, PSW_EV_VALIDATE);
        cr_assert_eq(psw_client_val_result(c, ev.epoch, ev.version, ev.val_begin, 0, 0, ev.val_end - ev.val_begin,
                                           NULL),
                     0);
        lib_next(c, &ev, PSW_EV_SHUTDOWN);
        r.psd_code = proc_wait(p, 30);
        psw_client_destroy(&c);
        cr_assert_eq(r.psd_code, 0);
        char *m = metrics_last(&r);
        if (mode == 0) /* the 4 between: the first released nothing, the last asked for nothing */
            cr_assert_eq(json_num(m, "psd_steps_in_place"), 4, "%s", m);
        free(m);
        snprintf(weights[mode], sizeof weights[mode], "%s", r.weights);
    }
    cr_assert(weights_equal(weights[0], weights[1]), "in place or not, shared memory or wire: the same weights");
    free(copy);
    free(grad);
}

/* Two workers on shared memory read the same slot: one that releases it
 * with its push does not make psd step it in place while the other still
 * holds it (another slot, the read one untouched); once both release, the
 * step is in place. */
Test(short, a_slot_another_worker_still_reads_is_not_stepped_in_place)
{
    const char **args = (const char **)inplace_args;
    ps_layout_t l;
    float *copy;
    float *grad = inplace_model(&l, &copy);
    const size_t n0 = l.t[0].numel;
    run_t r;
    pid_t p = start_psd(&r, "inplace2", 2, args);
    char err[512];
    psw_client_t *c[2];
    psw_event_t ev[2];
    for (int i = 0; i < 2; i++) {
        c[i] = lib_worker_shm(r.endpoint, 1, err, sizeof err);
        cr_assert_not_null(psw_client_push_region(c[i]), "worker %d on shared memory", i);
    }
    psw_client_release_on_push(c[0], 1); /* worker 1 does not promise, at first */
    for (int i = 0; i < 2; i++) {
        lib_next(c[i], &ev[i], PSW_EV_EPOCH);
        cr_assert_eq(ev[i].n_samples, 192);
        psw_client_pull(c[i], ev[i].version);
        lib_next(c[i], &ev[i], PSW_EV_WEIGHTS);
    }
    /* each client maps psd's slots at its own addresses: each is compared with itself */
    for (int step = 0; step < 3; step++) {
        int last = step == 2;
        const float *prev[2] = {ev[0].tensors[0], ev[1].tensors[0]};
        memcpy(copy, prev[1], n0 * sizeof *copy);
        if (step == 1) psw_client_release_on_push(c[1], 1);
        for (int i = 0; i < 2; i++) lib_push(c[i], ev[i].version, 64, !last, grad, &l);
        if (last) break;
        for (int i = 0; i < 2; i++) lib_next(c[i], &ev[i], PSW_EV_WEIGHTS);
        for (int i = 0; i < 2; i++) {
            cr_assert_neq(memcmp(ev[i].tensors[0], copy, n0 * sizeof *copy), 0, "step %d changed the weights", step);
            if (step == 0)
                cr_assert_neq(ev[i].tensors[0], prev[i], "worker 1 still held the slot: the next version in another");
            else
                cr_assert_eq(ev[i].tensors[0], prev[i], "both released: the same slot, updated in place");
        }
        if (step == 0) cr_assert_eq(memcmp(prev[1], copy, n0 * sizeof *copy), 0, "the slot worker 1 held is untouched");
    }
    for (int i = 0; i < 2; i++) psw_client_barrier(c[i], 0, 192);
    for (int i = 0; i < 2; i++) {
        lib_next(c[i], &ev[i], PSW_EV_VALIDATE);
        cr_assert_eq(psw_client_val_result(c[i], ev[i].epoch, ev[i].version, ev[i].val_begin, 0, 0,
                                           ev[i].val_end - ev[i].val_begin, NULL),
                     0);
    }
    for (int i = 0; i < 2; i++) lib_next(c[i], &ev[i], PSW_EV_SHUTDOWN);
    r.psd_code = proc_wait(p, 30);
    for (int i = 0; i < 2; i++) psw_client_destroy(&c[i]);
    cr_assert_eq(r.psd_code, 0);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(m, "psd_steps_in_place"), 1, "only the step both released: %s", m);
    free(m);
    free(copy);
    free(grad);
}

/* ctr validation results must carry the range's click probabilities (psd
 * reduces them to the AUC): without them, or with one that is no
 * probability, the result is logged and dropped, and the run goes on. A
 * library worker that answers with the planted probabilities gets psd's
 * planted AUC back as val_auc: the scores land where their examples are. */
Test(short, ctr_results_without_scores_are_dropped)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *args[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=256", "--set", "ctr.test=100",
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "ctrbad", 1, args);
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c = psw_client_new(r.endpoint, &info, err, sizeof err);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, sizeof err) == 0, "%s", err);
    cr_assert_eq(a.ctr.fields, 8);
    cr_assert_eq(a.n_files, 0);
    cr_assert_eq(psw_client_ready(c, 256, 100), 0);
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim), 0);
    cr_assert_eq(l.n_tensors, 5);
    float *zero = calloc(l.n_params, sizeof *zero);
    cr_assert(zero);
    psw_event_t ev;
    lib_next(c, &ev, PSW_EV_EPOCH);
    cr_assert_eq(ev.n_samples, 256);
    psw_client_pull(c, ev.version);
    lib_next(c, &ev, PSW_EV_WEIGHTS);
    lib_push(c, ev.version, 256, 0, zero, &l);
    psw_client_barrier(c, 0, 256);
    lib_next(c, &ev, PSW_EV_VALIDATE);
    cr_assert_eq(ev.val_end - ev.val_begin, 100);
    ps_ctr_t g = {.fields = a.ctr.fields, .per_field = a.ctr.per_field, .vocab = a.ctr.vocab, .zipf = a.ctr.zipf,
                  .rows = a.ctr.rows, .weight_std = a.ctr.weight_std, .bias = a.ctr.bias, .seed = a.ctr.seed};
    float sc[100];
    uint32_t rows[PS_CTR_MAX_IDS];
    for (int i = 0; i < 100; i++) {
        uint8_t y;
        sc[i] = (float)ps_ctr_example(&g, a.ctr.train + (uint64_t)i, rows, NULL, &y);
    }
    psw_client_val_result(c, ev.epoch, ev.version, ev.val_begin, 50, 60, 100, NULL);
    wait_log(r.psd_log, "without the range's 100 scores", 20);
    float keep = sc[37];
    sc[37] = NAN;
    psw_client_val_result(c, ev.epoch, ev.version, ev.val_begin, 50, 60, 100, sc);
    sc[37] = 1.5f;
    psw_client_val_result(c, ev.epoch, ev.version, ev.val_begin, 50, 60, 100, sc);
    sc[37] = keep;
    psw_client_val_result(c, ev.epoch, ev.version, ev.val_begin, 50, 60, 100, sc);
    lib_next(c, &ev, PSW_EV_SHUTDOWN);
    r.psd_code = proc_wait(p, 30);
    psw_client_destroy(&c);
    free(zero);
    cr_assert_eq(r.psd_code, 0);
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, "without the range's 100 scores"), 3, "%s", log);
    free(log);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(m, "val_auc"), json_num(m, "optimum_auc"), "%s", m);
    cr_assert_eq(json_num(m, "val_loss"), 0.5, "%s", m);
    free(m);
}

/* The rows of the ctr task's table test examples [begin, end) read,
 * sorted, into out (room for (end - begin) x 8); their count. */
static size_t ctr_range_rows(const psw_assign_t *a, uint64_t begin, uint64_t end, uint32_t *out)
{
    ps_ctr_t gen = {.fields = a->ctr.fields, .per_field = a->ctr.per_field, .vocab = a->ctr.vocab,
                    .zipf = a->ctr.zipf, .rows = a->ctr.rows, .weight_std = a->ctr.weight_std, .bias = a->ctr.bias,
                    .seed = a->ctr.seed};
    const size_t per = (size_t)(a->ctr.fields * a->ctr.per_field);
    for (uint64_t i = begin; i < end; i++) {
        uint8_t y;
        ps_ctr_example(&gen, a->ctr.train + i, out + (i - begin) * per, NULL, &y);
    }
    return ps_sort_unique_u32(out, (size_t)(end - begin) * per);
}

/* The table on psd, as a library worker sees it: a plain pull brings no
 * row of the table, a pull listing rows brings exactly those (psd's
 * values, asked again: again), a push of rows steps them, and the
 * validation part brings the rows of its range's examples, the pushed
 * rows stepped and the others as they were. */
Test(short, a_worker_gets_the_table_rows_it_asks_for)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *args[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=256", "--set", "ctr.test=100",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    pid_t p = start_psd(&r, "askrows", 1, args);
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1};
    psw_client_t *c = psw_client_new(r.endpoint, &info, err, sizeof err);
    psw_assign_t a;
    cr_assert(c && psw_client_register(c, &a, 60, err, sizeof err) == 0, "%s", err);
    cr_assert(a.ctr.table_on_psd, "psd keeps the table");
    cr_assert(!a.shm, "and sends rows over the wire");
    cr_assert_eq(psw_client_ready(c, 256, 100), 0);
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim), 0);
    float *w0 = calloc(l.n_params, sizeof *w0);
    cr_assert(w0);
    ps_model_init_params(&l, w0, 7); /* run.seed 7 in ctr.yaml */
    const float *E0 = w0 + l.t[4].offset;
    psw_event_t ev;
    lib_next(c, &ev, PSW_EV_EPOCH);
    psw_client_pull(c, ev.version);
    lib_next(c, &ev, PSW_EV_WEIGHTS);
    cr_assert(ev.n_row_ids == 0 && ev.tensor_numel[4] == 0, "no row asked for, none sent (never the table)");
    cr_assert(memcmp(ev.tensors[0], w0, l.t[0].numel * sizeof *w0) == 0, "the MLP whole");
    const uint32_t asks[2][3] = {{1, 5, 900}, {2, 3, 65535}};
    for (int k = 0; k < 2; k++) {
        cr_assert_eq(psw_client_pull_rows(c, ev.version, asks[k], 3), 0);
        lib_next(c, &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(ev.n_row_ids, 3);
        cr_assert(memcmp(ev.row_ids, asks[k], sizeof asks[k]) == 0, "the rows asked for");
        cr_assert_eq(ev.tensor_numel[4], 3 * 8);
        for (int j = 0; j < 3; j++)
            cr_assert(memcmp(ev.tensors[4] + j * 8, E0 + asks[k][j] * 8, 8 * sizeof(float)) == 0, "row %u's values",
                      asks[k][j]);
    }
    const uint32_t bad[2] = {5, 1};
    cr_assert_eq(psw_client_pull_rows(c, ev.version, bad, 2), -EINVAL, "refused before it leaves");
    /* push rows 1 and 5, then validate */
    float *zero = calloc(l.n_params, sizeof *zero), vals[16];
    cr_assert(zero);
    lib_grads_t ga;
    lib_grads(&ga, &l, zero);
    for (int i = 0; i < 16; i++) vals[i] = 0.25f;
    const uint32_t pushed[2] = {1, 5};
    cr_assert_eq(psw_client_push_rows(c, ev.version, 256, 100, 0, 0, 5, ga.ids, ga.g, ga.numel, ga.rows, ga.cols,
                                      pushed, 2, vals, NULL, 0),
                 0);
    psw_client_barrier(c, 0, 256);
    lib_next(c, &ev, PSW_EV_VALIDATE);
    uint32_t want[800];
    size_t nw = ctr_range_rows(&a, 0, 100, want);
    cr_assert_eq(ev.n_row_ids, nw, "the rows the range's examples read");
    cr_assert(memcmp(ev.row_ids, want, nw * sizeof *want) == 0, "those rows, increasing");
    for (size_t j = 0; j < ev.n_row_ids; j++) {
        uint32_t id = ev.row_ids[j];
        bool stepped = memcmp(ev.tensors[4] + j * 8, E0 + (size_t)id * 8, 8 * sizeof(float)) != 0;
        cr_assert_eq(stepped, id == 1 || id == 5, "row %u %s", id, stepped ? "changed" : "did not change");
    }
    float sc[100];
    for (int i = 0; i < 100; i++) sc[i] = 0.5f;
    psw_client_val_result(c, ev.epoch, ev.version, ev.val_begin, 50, 60, 100, sc);
    lib_next(c, &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(proc_wait(p, 30), 0);
    psw_client_destroy(&c);
    free(zero);
    free(w0);
}

/* The table on psd with 2 psd shards, as a library worker sees it, given
 * two validation parts at once (the second one is a worker's that left
 * while it validated): each part's event brings the rows its range's
 * examples read, all of them, put together from both shards (psd's
 * values: the pushes were zero), the second after the first; the run ends
 * with both results in. */
Test(short, two_validation_parts_at_once_with_the_table_on_psd_shards)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *base[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=512", "--set", "ctr.test=200",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    const char *a0[16] = {NULL};
    int n0 = 0;
    while (base[n0]) a0[n0] = base[n0], n0++;
    a0[n0++] = "--shard", a0[n0] = "0/2"; /* shard 0, and shard 1 */
    pid_t p = start_psd(&r, "twoparts", 2, a0), p1 = start_shard(&r, "twoparts", 1, 2, base);
    char err[512];
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c[2];
    psw_assign_t a;
    for (int i = 0; i < 2; i++) {
        c[i] = psw_client_new(r.endpoint, &info, err, sizeof err);
        cr_assert(c[i] && psw_client_register(c[i], &a, 60, err, sizeof err) == 0, "%s", err);
        cr_assert(a.ctr.table_on_psd, "psd keeps the table");
        cr_assert_eq(psw_client_ready(c[i], 512, 200), 0);
    }
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, a.sizes, a.n_sizes, a.ctr.rows, a.ctr.dim), 0);
    float *w0 = calloc(l.n_params, sizeof *w0), *zero = calloc(l.n_params, sizeof *zero);
    cr_assert(w0 && zero);
    ps_model_init_params(&l, w0, 7); /* run.seed 7 in ctr.yaml */
    const float *E0 = w0 + l.t[4].offset;
    psw_event_t ev;
    lib_grads_t ga;
    lib_grads(&ga, &l, zero);
    const uint32_t one_row[1] = {1};
    const float vals[8] = {0};
    for (int i = 0; i < 2; i++) { /* one batch each, a zero gradient */
        lib_next(c[i], &ev, PSW_EV_EPOCH);
        cr_assert_eq(ev.n_samples, 256);
        psw_client_pull(c[i], ev.version);
        lib_next(c[i], &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(psw_client_push_rows(c[i], ev.version, 256, 100, 0, 0, 5, ga.ids, ga.g, ga.numel, ga.rows, ga.cols,
                                          one_row, 1, vals, NULL, 0),
                     0);
        psw_client_barrier(c[i], 0, 256);
    }
    psw_event_t gone;
    lib_next(c[1], &gone, PSW_EV_VALIDATE); /* validation began; worker 1 leaves with its part */
    cr_assert_eq(psw_client_leave(c[1], "test: leaves while validating"), 0);
    psw_client_destroy(&c[1]);
    wait_log(r.psd_log, "left the run", 30);
    zmq_poll(NULL, 0, 300); /* the second part is on its way to worker 0 */
    uint32_t *want = malloc(200 * 8 * sizeof *want);
    cr_assert(want);
    uint64_t covered = 0;
    float sc[200];
    for (int i = 0; i < 200; i++) sc[i] = 0.5f;
    for (int k = 0; k < 2; k++) {
        lib_next(c[0], &ev, PSW_EV_VALIDATE);
        if (k == 1) cr_assert_eq(ev.val_begin, gone.val_begin, "the part of the worker that left, second");
        size_t nw = ctr_range_rows(&a, ev.val_begin, ev.val_end, want);
        cr_assert_eq(ev.n_row_ids, nw, "part %d [%" PRIu64 ", %" PRIu64 "): the rows its examples read", k,
                     ev.val_begin, ev.val_end);
        cr_assert(memcmp(ev.row_ids, want, nw * sizeof *want) == 0, "part %d: those rows", k);
        cr_assert_eq(ev.tensor_numel[4], nw * 8);
        for (size_t j = 0; j < nw; j++)
            cr_assert(memcmp(ev.tensors[4] + j * 8, E0 + (size_t)want[j] * 8, 8 * sizeof(float)) == 0,
                      "part %d, row %u: psd's values (from shard %d)", k, want[j], want[j] < 32768 ? 0 : 1);
        covered += ev.val_end - ev.val_begin;
        psw_client_val_result(c[0], ev.epoch, ev.version, ev.val_begin, 50, 60, ev.val_end - ev.val_begin, sc);
    }
    cr_assert_eq(covered, 200, "both parts");
    lib_next(c[0], &ev, PSW_EV_SHUTDOWN);
    cr_assert_eq(proc_wait(p, 30), 0);
    cr_assert_eq(proc_wait(p1, 30), 0);
    psw_client_destroy(&c[0]);
    free(want);
    free(zero);
    free(w0);
}

/* psd gives a worker at most two validation parts at once (its own and one
 * more): the parts of three workers that left during validation wait on
 * psd and come one at a time as the worker answers, instead of piling up on
 * it (a worker's queue of parts is bounded). Every test example is still
 * validated exactly once. Four library workers; three leave. */
Test(short, validation_parts_of_workers_that_left_come_one_at_a_time)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,16,10]",
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "vparts", 4, args);
    ps_layout_t l;
    float *zero = lib_model(&l, 16);
    psw_client_t *w[4];
    lib_start(r.endpoint, w, 4, 96);
    psw_event_t ev, held[8];
    for (int i = 0; i < 4; i++) { /* two batches each (64 and 32), then the barrier */
        lib_next(w[i], &ev, PSW_EV_WEIGHTS);
        lib_push(w[i], ev.version, 64, 1, zero, &l);
    }
    for (int i = 0; i < 4; i++) {
        lib_next(w[i], &ev, PSW_EV_WEIGHTS);
        lib_push(w[i], ev.version, 32, 0, zero, &l);
        psw_client_barrier(w[i], 0, 96);
    }
    int n = 0;
    lib_next(w[0], &held[n++], PSW_EV_VALIDATE);
    for (int i = 1; i < 4; i++) {
        lib_next(w[i], &ev, PSW_EV_VALIDATE); /* validation began: they leave with their parts */
        cr_assert_eq(psw_client_leave(w[i], "test: leaves while validating"), 0);
        psw_client_destroy(&w[i]);
    }
    for (int t = 0; t < 600; t++) {
        char *log = slurp(r.psd_log);
        int left = log ? count_in(log, "left the run") : 0;
        free(log);
        if (left == 3) break;
        zmq_poll(NULL, 0, 50);
    }
    char err[512];
    uint64_t covered = 0;
    int most = 0, answered = 0;
    for (;;) {
        /* take what psd sends without answering for a while: what it holds at once */
        while (psw_client_next(w[0], &ev, 0.5, err, sizeof err) == 0) {
            if (ev.kind == PSW_EV_SHUTDOWN) goto done;
            cr_assert_eq(ev.kind, PSW_EV_VALIDATE, "event %d", (int)ev.kind);
            cr_assert_lt(n, 8);
            held[n++] = ev;
        }
        if (n > most) most = n;
        cr_assert_gt(n, 0, "psd sent nothing more and did not end the run: %s", err);
        ev = held[0]; /* answer the oldest */
        memmove(held, held + 1, (size_t)(n - 1) * sizeof *held);
        n--;
        covered += ev.val_end - ev.val_begin;
        answered++;
        psw_client_val_result(w[0], ev.epoch, ev.version, ev.val_begin, 0.5 * (double)(ev.val_end - ev.val_begin), 0,
                              ev.val_end - ev.val_begin, NULL);
    }
done:
    cr_assert_eq(n, 0);
    cr_assert_eq(answered, 4, "its part and the three of the workers that left");
    cr_assert_eq(most, 2, "two parts held at once, never more (held %d)", most);
    cr_assert_eq(covered, 10000, "every test example once");
    psw_client_destroy(&w[0]);
    free(zero);
    cr_assert_eq(proc_wait(p, 30), 0);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "val_samples"), 10000, "%s", last_line(m));
    free(m);
}

/* A fake psd: answers one REGISTER on its ROUTER with an ASSIGN of a ctr
 * model (32 -> 2) carrying task ct (batch sizes `batch` when not 0), then,
 * with wframes > 0, sends WEIGHTS of wframes f32 frames (tensor ids 0, 1,
 * ...) of wnumel floats each, or with wids, frame i of tensor wids[i], of
 * wsizes[i] floats of value wids[i] + 1 (the worker's event: the first
 * float of each tensor in wfirst); with noise > 0, that many messages no
 * worker expects from psd (PULL), 100 ms apart. With shutdown, it answers
 * the REGISTER with a SHUTDOWN of exit code shutdown_code instead (the
 * worker library's psw_client_shutdown_code() then: got_code). */
typedef struct {
    bool shutdown;
    int shutdown_code, got_code;
    void *router;
    Psd__CtrTask ct;
    uint32_t batch;
    int wframes;
    size_t wnumel;
    const uint32_t *wids;
    const size_t *wsizes;
    float wfirst[PS_MAX_TENSORS];
    int noise;
} fake_psd_t;

static void *fake_psd(void *p)
{
    fake_psd_t *f = p;
    ps_msg_t m = {0};
    char err[256];
    if (ps_msg_recv(f->router, &m, true, 0, err, sizeof err) != 0) return NULL;
    if (f->shutdown) {
        Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_SHUTDOWN, 1);
        Psd__Shutdown sd = PSD__SHUTDOWN__INIT;
        sd.exit_code = f->shutdown_code;
        sd.reason = (char *)"training finished";
        h.body_case = PSD__HEADER__BODY_SHUTDOWN;
        h.shutdown = &sd;
        ps_msg_send(f->router, m.ident, m.ident_len, &h, NULL, 0);
        ps_msg_deinit(&m);
        return NULL;
    }
    Psd__Header h = fake_hdr(PSD__MSG_TYPE__MSG_ASSIGN, 1);
    Psd__Assign a = PSD__ASSIGN__INIT;
    Psd__Hyper hy = PSD__HYPER__INIT;
    uint32_t layers[] = {32, 2};
    a.layers = layers;
    a.n_layers = 2;
    hy.batch_size = f->batch ? f->batch : 16;
    hy.val_batch_size = f->batch ? f->batch : 16;
    hy.norm_std = 1;
    a.hyper = &hy;
    a.start_timeout_s = 5;
    a.step_timeout_s = 5;
    a.ctr = &f->ct;
    h.body_case = PSD__HEADER__BODY_ASSIGN;
    h.assign = &a;
    ps_msg_send(f->router, m.ident, m.ident_len, &h, NULL, 0);
    if (f->wframes > 0) {
        float *v = calloc(f->wnumel ? f->wnumel : 1, sizeof *v), *vi[PS_MAX_FRAMES] = {NULL};
        ps_frame_t fr[PS_MAX_FRAMES];
        for (int i = 0; i < f->wframes && i < PS_MAX_FRAMES; i++) {
            fr[i] = (ps_frame_t){.data = v, .nbytes = f->wnumel * sizeof *v, .id = (uint32_t)i,
                                 .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)f->wnumel};
            if (!f->wids) continue;
            vi[i] = malloc(f->wsizes[i] * sizeof *vi[i]);
            for (size_t j = 0; j < f->wsizes[i]; j++) vi[i][j] = (float)f->wids[i] + 1.0f;
            fr[i] = (ps_frame_t){.data = vi[i], .nbytes = f->wsizes[i] * sizeof(float), .id = f->wids[i],
                                 .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)f->wsizes[i], .copy = true};
        }
        Psd__Header w = fake_hdr(PSD__MSG_TYPE__MSG_WEIGHTS, 2);
        Psd__Weights wt = PSD__WEIGHTS__INIT;
        wt.version = 1;
        w.body_case = PSD__HEADER__BODY_WEIGHTS;
        w.weights = &wt;
        ps_msg_send(f->router, m.ident, m.ident_len, &w, fr, f->wframes < PS_MAX_FRAMES ? f->wframes : PS_MAX_FRAMES);
        free(v);
        for (int i = 0; i < PS_MAX_FRAMES; i++) free(vi[i]);
    }
    for (int i = 0; i < f->noise; i++) {
        Psd__Header n = fake_hdr(PSD__MSG_TYPE__MSG_PULL, 3 + (uint64_t)i);
        Psd__Pull pl = PSD__PULL__INIT;
        n.body_case = PSD__HEADER__BODY_PULL;
        n.pull = &pl;
        ps_msg_send(f->router, m.ident, m.ident_len, &n, NULL, 0);
        nanosleep(&(struct timespec){0, 100000000L}, NULL);
    }
    ps_msg_deinit(&m);
    return NULL;
}

/* A ctr task that fits the fake psd's model: 4 fields x 8 = 32 inputs, a
 * table of 50 x 8. */
static Psd__CtrTask fake_ctr_task(void)
{
    Psd__CtrTask ct = PSD__CTR_TASK__INIT;
    ct.fields = 4;
    ct.per_field = 2;
    ct.vocab = 100;
    ct.zipf = 1.1;
    ct.rows = 50;
    ct.dim = 8;
    ct.mean = true;
    ct.weight_std = 1;
    ct.seed = 3;
    ct.train = 1000;
    ct.test = 100;
    return ct;
}

/* One worker (library) against fake psd f: the result of registering and,
 * when it registered and f sends weights, of the next event; err says why. */
static int against_fake_psd(fake_psd_t *f, void *ctx, psw_assign_t *a, char *err, size_t errlen)
{
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", free_port());
    f->router = zmq_socket(ctx, ZMQ_ROUTER);
    cr_assert_eq(zmq_bind(f->router, ep), 0);
    pthread_t th;
    pthread_create(&th, NULL, fake_psd, f);
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1};
    psw_client_t *c = psw_client_new(ep, &info, err, errlen);
    cr_assert_not_null(c, "%s", err);
    int rc = psw_client_register(c, a, 10, err, errlen);
    psw_event_t ev;
    if (rc == 0 && f->wframes > 0) rc = psw_client_next(c, &ev, 10, err, errlen);
    if (rc == 0 && f->wframes > 0 && ev.kind == PSW_EV_WEIGHTS)
        for (int t = 0; t < ev.n_tensors && t < PS_MAX_TENSORS; t++) f->wfirst[t] = ev.tensor_numel[t] ? ev.tensors[t][0] : -1;
    if (rc == 0 && f->noise > 0) { /* 1 s to wait, which the messages it drops do not prolong */
        double t0 = ps_now();
        rc = psw_client_next(c, &ev, 1, err, errlen);
        cr_expect_lt(ps_now() - t0, 4.0, "waited %.1f s of psd's %d unexpected messages for a 1 s wait",
                     ps_now() - t0, f->noise);
    }
    pthread_join(th, NULL);
    f->got_code = psw_client_shutdown_code(c);
    psw_client_destroy(&c);
    int linger = 0;
    zmq_setsockopt(f->router, ZMQ_LINGER, &linger, sizeof linger);
    zmq_close(f->router);
    return rc;
}

/* psd ends the run while a worker registers (again, after psd declared it
 * lost): the SHUTDOWN that comes instead of the assignment ends the
 * registration at once with psd's exit code (it was dropped, and the worker
 * waited for an assignment that never came). */
Test(short, a_shutdown_instead_of_the_assignment_ends_the_registration)
{
    void *ctx = zmq_ctx_new();
    fake_psd_t f = {.shutdown = true, .shutdown_code = 3};
    char err[512] = "";
    psw_assign_t a;
    double t0 = ps_now();
    int rc = against_fake_psd(&f, ctx, &a, err, sizeof err);
    cr_expect_eq(rc, -ESHUTDOWN, "rc %d: %s", rc, err);
    cr_expect_eq(f.got_code, 3);
    cr_expect(strstr(err, "psd ended the run: training finished"), "%s", err);
    cr_expect_lt(ps_now() - t0, 5.0, "the registration waited for its timeout (10 s)");
    zmq_ctx_term(ctx);
}

/* The worker checks the ctr task psd sends as psd checks its config: a task
 * whose sizes overflow, or that does not fit the model, is refused with a
 * message (and nothing is allocated from it); a good one is taken. */
Test(short, a_bad_ctr_task_from_psd_is_refused)
{
    Psd__CtrTask good = fake_ctr_task();
    Psd__CtrTask bad[7];
    for (int i = 0; i < 7; i++) bad[i] = good;
    bad[0].test = UINT64_MAX; /* train + test wraps */
    bad[1].train = (uint64_t)1 << 33;
    bad[2].dim = 7;           /* fields x dim != layers[0] */
    bad[3].fields = 0;
    bad[4].per_field = 1000;  /* fields x per_field > 256 */
    bad[5].zipf = NAN;
    bad[6].rows = 0;
    void *ctx = zmq_ctx_new();
    for (int i = 0; i <= 7; i++) {
        fake_psd_t f = {.ct = i < 7 ? bad[i] : good};
        char err[512] = "";
        psw_assign_t a;
        int rc = against_fake_psd(&f, ctx, &a, err, sizeof err);
        if (i < 7) {
            cr_expect_eq(rc, -EPROTO, "case %d accepted", i);
            cr_expect(strstr(err, "invalid ctr task"), "case %d: %s", i, err);
        } else {
            cr_expect_eq(rc, 0, "the good task: %s", err);
            cr_expect_eq(a.ctr.fields, 4);
            cr_expect_eq(a.ctr.rows, 50);
            cr_expect_eq(a.n_files, 0);
        }
    }
    zmq_ctx_term(ctx);
}

/* The worker checks psd's batch sizes and weights: a batch size past
 * psd's own limit is an invalid assignment (it aborted the worker when cast
 * to int), and weights must be one frame per tensor of the model, each of
 * its size (40 frames overran the event's arrays). The model: W 32 x 2, b 2,
 * table 50 x 8. And a wait ends at its deadline however many messages the
 * worker drops meanwhile (each one restarted it). */
Test(short, bad_batch_sizes_and_weights_from_psd_are_refused)
{
    Psd__CtrTask ct = fake_ctr_task();
    void *ctx = zmq_ctx_new();
    char err[512] = "";
    psw_assign_t a;
    fake_psd_t big = {.ct = ct, .batch = 1u << 31};
    cr_expect_eq(against_fake_psd(&big, ctx, &a, err, sizeof err), -EPROTO, "a batch of 2^31 was taken");
    cr_expect(strstr(err, "invalid assignment"), "%s", err);
    fake_psd_t many = {.ct = ct, .wframes = 40, .wnumel = 2};
    cr_expect_eq(against_fake_psd(&many, ctx, &a, err, sizeof err), -EPROTO, "40 weights frames were taken");
    cr_expect(strstr(err, "40 weights frames for a model of 3 tensors"), "%s", err);
    fake_psd_t small = {.ct = ct, .wframes = 3, .wnumel = 2}; /* W and the table too small */
    cr_expect_eq(against_fake_psd(&small, ctx, &a, err, sizeof err), -EPROTO, "short weights frames were taken");
    cr_expect(strstr(err, "invalid weights frame 0"), "%s", err);
    /* protocol 5: tensor frames in any order, each tensor once (the model: W 64, b 2, the table 400) */
    const uint32_t rev[3] = {2, 1, 0}, twice[3] = {0, 0, 2}, beyond[3] = {1, 0, 3};
    const size_t rev_n[3] = {400, 2, 64}, twice_n[3] = {64, 64, 400}, beyond_n[3] = {2, 64, 400};
    fake_psd_t any = {.ct = ct, .wframes = 3, .wids = rev, .wsizes = rev_n};
    cr_expect_eq(against_fake_psd(&any, ctx, &a, err, sizeof err), 0, "frames in reverse: %s", err);
    cr_expect(any.wfirst[0] == 1.0f && any.wfirst[1] == 2.0f && any.wfirst[2] == 3.0f,
              "each tensor from its frame: %g %g %g", any.wfirst[0], any.wfirst[1], any.wfirst[2]);
    fake_psd_t two = {.ct = ct, .wframes = 3, .wids = twice, .wsizes = twice_n};
    cr_expect_eq(against_fake_psd(&two, ctx, &a, err, sizeof err), -EPROTO, "a tensor twice was taken");
    cr_expect(strstr(err, "not one of each tensor"), "%s", err);
    fake_psd_t out = {.ct = ct, .wframes = 3, .wids = beyond, .wsizes = beyond_n};
    cr_expect_eq(against_fake_psd(&out, ctx, &a, err, sizeof err), -EPROTO, "a tensor beyond the model was taken");
    cr_expect(strstr(err, "not one of each tensor"), "%s", err);
    fake_psd_t ok = {.ct = ct, .batch = 1u << 20};
    cr_expect_eq(against_fake_psd(&ok, ctx, &a, err, sizeof err), 0, "psd's largest batch: %s", err);
    fake_psd_t noisy = {.ct = ct, .noise = 80}; /* 8 s of messages it drops */
    cr_expect_eq(against_fake_psd(&noisy, ctx, &a, err, sizeof err), -ETIMEDOUT, "%s", err);
    zmq_ctx_term(ctx);
}

Test(short, more_samples_while_the_last_push_waits_are_trained_on_the_next_version)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,16,10]",
                          "--worker-timeout", "1", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "defer", 3, args);
    char err[512];
    psw_event_t ev;
    ps_layout_t l;
    float *zero = lib_model(&l, 16);
    psw_client_t *all[3];
    lib_start(r.endpoint, all, 3, 128); /* 128 samples each: two batches of 64 */
    psw_client_t *A = all[0], *C = all[2];
    for (int i = 0; i < 3; i++) {
        lib_next(all[i], &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(ev.version, 0);
        lib_push(all[i], 0, 64, 1, zero, &l);
    }
    for (int i = 0; i < 3; i++) {
        lib_next(all[i], &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(ev.version, 1);
    }
    lib_push(A, 1, 64, 0, zero, &l); /* A's last batch, then its barrier */
    psw_client_barrier(A, 0, 128);
    /* B falls silent; C keeps psd company (heartbeats) without pushing */
    double deadline = ps_now() + 20;
    int rc;
    for (;;) {
        psw_client_heartbeat(C, 0);
        rc = psw_client_next(A, &ev, 0.3, err, sizeof err);
        if (rc == 0 || ps_now() > deadline) break;
    }
    cr_assert_eq(rc, 0, "A was given B's samples: %s", err);
    cr_assert(ev.kind == PSW_EV_EPOCH && ev.append, "more samples for A (event %d)", (int)ev.kind);
    psw_client_pull(A, ev.version);
    lib_next(C, &ev, PSW_EV_EPOCH);
    cr_assert(ev.append);
    lib_push(C, 1, 64, 1, zero, &l); /* the step A's last push waited for */
    lib_next(A, &ev, PSW_EV_WEIGHTS);
    cr_assert_eq(ev.version, 2, "A is answered with the version the step made, not the one its push used");
    lib_next(C, &ev, PSW_EV_WEIGHTS);
    cr_assert_eq(ev.version, 2);
    for (int i = 0; i < 3; i++) psw_client_destroy(&all[i]);
    free(zero);
    kill(p, SIGKILL);
    proc_wait(p, 10);
}

/* train.stream: gradients and weights travel in chunks, each stepped as
 * soon as every worker has sent it, and the new values go back at once:
 * the same bits as whole steps (SGD; Adam with global-norm clipping, where
 * the chunks are reduced as they come and applied once the norm is known),
 * over the wire and with one worker on shared memory; the streamed weights
 * are checked by the workers against psd's CRC-32 of the version. */
Test(short, streamed_steps_give_the_same_weights_as_whole_steps)
{
    const char *opt[2][8] = {
        {"--set", "optimizer.name=sgd", NULL},
        {"--set", "optimizer.name=adam", "--set", "optimizer.lr=0.001", "--set", "optimizer.clip_norm=0.5", NULL}};
    const char *wire[] = {"--no-shm", "--verbose", NULL}, *shm[] = {"--verbose", NULL};
    for (int o = 0; o < 2; o++) {
        const char *args[24] = {"--epochs", "2", "--set", "data.train_limit=3000", "--seed", "13", "--x-verify-weights",
                                "--set", "server.chunk_bytes=65536", "--set", "checkpoint.dir="};
        int n = 11;
        for (int i = 0; opt[o][i]; i++) args[n++] = opt[o][i];
        args[n] = NULL;
        run_t a, b, c;
        char ta[16], tb[16], tc[16];
        snprintf(ta, sizeof ta, "whole%d", o);
        snprintf(tb, sizeof tb, "stream%d", o);
        snprintf(tc, sizeof tc, "smix%d", o);
        train_wx(&a, ta, 2, args, wire, 300);
        check_run(&a, 2, 2);
        args[n] = "--set";
        args[n + 1] = "train.stream=true";
        args[n + 2] = NULL;
        train_wx(&b, tb, 2, args, wire, 300);
        check_run(&b, 2, 2);
        pid_t p = start_psd(&c, tc, 2, args); /* rank 0 on shared memory, rank 1 on the wire */
        pid_t w0 = start_worker(&c, tc, 0, shm);
        wait_log(c.psd_log, "worker registered: rank 0", 60);
        pid_t w1 = start_worker(&c, tc, 1, wire);
        c.psd_code = proc_wait(p, 300);
        c.worker_code[0] = proc_wait(w0, 30);
        c.worker_code[1] = proc_wait(w1, 30);
        check_run(&c, 2, 2);
        char *lb = slurp(b.psd_log), *lc = slurp(c.psd_log);
        cr_assert(strstr(lb, "streamed steps: 37 chunks of up to 64 KiB"), "%s", lb);
        cr_assert_eq(count_in(lc, "through shared memory"), 1, "one of each:\n%s", lc);
        free(lb);
        free(lc);
        cr_assert(weights_equal(a.weights, b.weights), "streamed = whole steps, bit for bit (%s)", opt[o][1]);
        cr_assert(weights_equal(a.weights, c.weights), "streamed with a worker on shared memory (%s)", opt[o][1]);
        assert_workers_verified(tb, 2, "the streamed weights");
    }
}

/* A library worker with `left` of its `assigned` samples of epoch 1 to
 * train (weights asked for) trains until psd's SHUTDOWN in batches of 64,
 * taking the samples psd adds (appended: as an EPOCH that adds to the
 * epoch under way, else one that starts it: it then asks for weights),
 * and answers validations. Returns the samples it trained. */
static uint64_t lib_train_to_end(psw_client_t *c, uint64_t left, uint64_t assigned, bool appended, const float *zero,
                                 const ps_layout_t *l)
{
    char err[512];
    psw_event_t ev;
    uint64_t trained = 0;
    for (;;) {
        int rc = psw_client_next(c, &ev, 30, err, sizeof err);
        cr_assert_eq(rc, 0, "%s", err);
        if (ev.kind == PSW_EV_SHUTDOWN) return trained;
        if (ev.kind == PSW_EV_EPOCH) {
            cr_assert_eq(ev.append, appended);
            left += ev.n_samples;
            assigned += ev.n_samples;
            if (!appended) psw_client_pull(c, ev.version);
        } else if (ev.kind == PSW_EV_WEIGHTS) {
            cr_assert_gt(left, 0);
            uint32_t batch = left < 64 ? (uint32_t)left : 64;
            left -= batch;
            trained += batch;
            lib_push(c, ev.version, batch, left > 0, zero, l);
            if (left == 0) psw_client_barrier(c, 0, assigned);
        } else if (ev.kind == PSW_EV_VALIDATE) {
            psw_client_val_result(c, ev.epoch, ev.version, ev.val_begin, 0.1 * (double)(ev.val_end - ev.val_begin), 0,
                                  ev.val_end - ev.val_begin, NULL);
        }
    }
}

/* psd for the streamed-loss tests: 384 samples, 7 chunks of 64 KiB, a
 * worker lost after 1 s of silence, clipping or not */
#define STREAM_LOSS_ARGS(clip)                                                                                        \
    "--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,64,10]", "--set",                  \
        "server.chunk_bytes=65536", "--set", "train.stream=true", "--worker-timeout", "1", "--set", "checkpoint.dir=", \
        "--set", (clip) ? "optimizer.clip_norm=1" : "optimizer.clip_norm=0"

/* train.stream: a worker lost after some of its chunks were stepped (with
 * clipping: reduced, to be applied once the norm is known). Its gradient
 * cannot be taken out of them again, so its batch counts as trained (with
 * clipping: once the step is taken) and the rest of the step goes on with
 * the other worker's alone; its other samples go to that worker; every
 * sample is trained once and nothing hangs. Two library workers: B sends
 * only its first tensor's chunks, then falls silent. */
static void lose_one_streamed_contributor(const char *tag, bool clip)
{
    run_t r;
    const char *args[] = {STREAM_LOSS_ARGS(clip), NULL};
    pid_t p = start_psd(&r, tag, 2, args);
    psw_event_t ev;
    ps_layout_t l;
    float *zero = lib_model(&l, 64);
    psw_client_t *both[2];
    lib_start(r.endpoint, both, 2, 192);
    psw_client_t *A = both[0], *B = both[1];
    for (int i = 0; i < 2; i++) {
        lib_next(both[i], &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(ev.version, 0);
    }
    lib_push(A, 0, 64, 1, zero, &l);
    const float *g0 = zero;
    size_t n0 = l.t[0].numel;
    int id0 = 0, rows0 = l.t[0].rows, cols0 = l.t[0].cols;
    cr_assert_eq(psw_client_push(B, 0, 64, 32.0, 0, 1, 1, &id0, &g0, &n0, &rows0, &cols0), 0); /* W0's 4 chunks */
    while (!psw_client_push_done(B)) sched_yield();
    wait_log(r.psd_log, "its gradient is in 4 of 7 chunks", 30);
    psw_client_destroy(&B);
    /* A trains the rest: its own 128 samples and B's 128 */
    uint64_t trained = 64 + lib_train_to_end(A, 128, 192, true, zero, &l);
    cr_assert_eq(trained, 320, "A trained its 192 samples and B's 128 not yet trained");
    psw_client_destroy(&A);
    free(zero);
    r.psd_code = proc_wait(p, 60);
    cr_assert_eq(r.psd_code, 0, "psd finished the run");
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 384, "every sample trained once: %s", last_line(m));
    free(m);
}

Test(short, a_worker_lost_in_the_middle_of_a_streamed_step) { lose_one_streamed_contributor("stlost", false); }

Test(short, a_worker_lost_in_the_middle_of_a_streamed_step_with_clipping)
{
    lose_one_streamed_contributor("stlostc", true);
}

/* train.stream, n workers that each send their first tensor's chunks and
 * fall silent: psd logs `said` (once the last is lost), and C, joining, is
 * given `left` samples and trains them; every sample is trained once, in 6
 * steps in all. */
static void lose_every_streamed_contributor(const char *tag, int n, bool clip, const char *said, uint64_t left)
{
    run_t r;
    const char *args[] = {STREAM_LOSS_ARGS(clip), NULL};
    pid_t p = start_psd(&r, tag, n, args);
    psw_event_t ev;
    ps_layout_t l;
    float *zero = lib_model(&l, 64);
    psw_client_t *b[2], *c[1];
    cr_assert(n >= 1 && n <= 2);
    lib_start(r.endpoint, b, n, 384 / (size_t)n);
    const float *g0 = zero;
    size_t n0 = l.t[0].numel;
    int id0 = 0, rows0 = l.t[0].rows, cols0 = l.t[0].cols;
    for (int i = 0; i < n; i++) {
        lib_next(b[i], &ev, PSW_EV_WEIGHTS);
        cr_assert_eq(psw_client_push(b[i], 0, 64, 32.0, 0, 1, 1, &id0, &g0, &n0, &rows0, &cols0), 0); /* W0's 4 chunks */
        while (!psw_client_push_done(b[i])) sched_yield();
    }
    wait_log(r.psd_log, said, 30);
    for (int i = 0; i < n; i++) psw_client_destroy(&b[i]);
    lib_start(r.endpoint, c, 1, left);
    uint64_t trained = lib_train_to_end(c[0], left, left, true, zero, &l);
    cr_assert_eq(trained, left);
    psw_client_destroy(&c[0]);
    free(zero);
    r.psd_code = proc_wait(p, 60);
    cr_assert_eq(r.psd_code, 0, "psd finished the run");
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 384, "every sample trained once: %s", last_line(m));
    cr_assert_eq(json_num(last_line(m), "step"), 6, "6 steps in all: %s", last_line(m));
    free(m);
}

/* With clipping chunks take the step only once the global norm is known,
 * so the step whose only contributor is lost in the middle of it takes
 * none (the chunks keep their values, Adam's count stays) and its batch is
 * still to be trained, as a gradient lost before a whole step: C is given
 * the whole epoch, and its 6 steps are the run's only ones. */
Test(short, a_streamed_step_whose_only_contributor_is_lost_is_no_step)
{
    lose_every_streamed_contributor(
        "stvoid", 1, true, "before any chunk took the step: no step is taken, and its batch of 64 is still to be trained",
        384);
}

/* The same with two contributors lost one by one: the first one's gradient
 * is in the chunks reduced so far, so its batch would count as trained had
 * the step been taken; it was not, so that batch is trained again too (it
 * was lost for the epoch: C was given 320 samples). */
Test(short, a_streamed_step_whose_contributors_are_all_lost_is_no_step)
{
    lose_every_streamed_contributor("stvoid2", 2, true, "no step is taken, and its batch of 64 is still to be trained",
                                    384);
}

/* Without clipping B's first tensor took the step before B was lost: its
 * batch counts as trained and the step ends with the other chunks as they
 * were (it never ended: psd then stepped those chunks again with no
 * contributor and waited for them forever); C is given the other 320
 * samples (5 steps after B's). */
Test(short, a_streamed_step_whose_only_contributor_is_lost_after_some_chunks_ends)
{
    lose_every_streamed_contributor("stlast", 1, false, "its batch of 64 counts as trained", 320);
}

/* Worker slots (1024 a run; 2 here with --x-max-workers): once every one
 * was taken, a new worker is refused with the reason until a gone worker's
 * slot is older than a worker's patience with psd (3 x its silence limit +
 * 10 s: it has registered again, or is dead); then it gets that slot and
 * its rank. A worker that registers again with its identity (as pworker
 * does) gets its own gone slot at once. Library workers: A (rank 0)
 * registers and leaves; B (rank 1) takes A's samples and falls silent
 * (lost), registers again with its identity (rank 1 again, at once) and
 * leaves; C is refused, retries, gets A's slot (gone longest) and trains
 * the epoch as rank 0. */
Test(short, worker_slots_are_reused_once_every_one_was_taken)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,64,10]",
                          "--worker-timeout", "1", "--x-max-workers", "2", "--set", "checkpoint.dir=",
                          "--start-timeout", "60", NULL};
    pid_t p = start_psd(&r, "slots", 1, args);
    char err[512];
    psw_event_t ev;
    ps_layout_t l;
    float *zero = lib_model(&l, 64);
    psw_client_t *a[1];
    lib_start(r.endpoint, a, 1, 384);
    psw_client_leave(a[0], "test");
    psw_client_destroy(&a[0]);
    wait_log(r.psd_log, "rank 0 (", 10);
    wait_log(r.psd_log, "left the run", 10);
    double gone = ps_now();
    static const char bid[] = "worker-b-identity";
    psw_info_t info = {.device = "cpu", .device_index = -1, .no_shm = 1, .identity = bid, .identity_len = sizeof bid};
    psw_assign_t as;
    psw_client_t *b = psw_client_new(r.endpoint, &info, err, sizeof err); /* rank 1 takes the samples A left */
    cr_assert(b && psw_client_register(b, &as, 30, err, sizeof err) == 0, "%s", err);
    cr_assert_eq(as.rank, 1);
    cr_assert_eq(psw_client_ready(b, 384, 10000), 0);
    lib_next(b, &ev, PSW_EV_EPOCH);
    wait_log(r.psd_log, "lost: nothing from it", 10); /* B: silent while training */
    psw_client_destroy(&b);
    b = psw_client_new(r.endpoint, &info, err, sizeof err); /* B again: its own slot */
    cr_assert(b && psw_client_register(b, &as, 30, err, sizeof err) == 0, "%s", err);
    cr_assert_eq(as.rank, 1, "its own slot");
    cr_assert_lt(ps_now() - gone, 9.0, "at once, not after a worker's patience");
    psw_client_leave(b, "test");
    psw_client_destroy(&b);
    wait_log(r.psd_log, "rank 1 registers again in its own slot: every one of psd's 2 worker slots was taken", 10);
    static const char cid[] = "worker-c-identity";
    info.identity = cid;
    info.identity_len = sizeof cid;
    psw_client_t *c = NULL;
    int refused = 0;
    for (;;) { /* refused until A's slot is free again */
        c = psw_client_new(r.endpoint, &info, err, sizeof err);
        cr_assert_not_null(c, "%s", err);
        if (psw_client_register(c, &as, 30, err, sizeof err) == 0) break;
        cr_assert(strstr(err, "psd refused: psd has no free worker slot"), "%s", err);
        psw_client_destroy(&c);
        refused++;
        cr_assert_lt(ps_now() - gone, 40, "a slot comes free within 3 x silence + 10 s");
        usleep(500000);
    }
    double waited = ps_now() - gone;
    cr_assert_gt(refused, 0, "refused while both slots were taken");
    cr_assert_gt(waited, 9.0, "A's slot was given after a worker's patience (%.1f s)", waited);
    cr_assert_eq(as.rank, 0, "the slot gone longest: A's");
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "refused a worker from") && strstr(log, "no free worker slot"), "%s", log);
    cr_assert(strstr(log, "rank 0 is given to a new worker: every one of psd's 2 worker slots was taken"), "%s", log);
    free(log);
    cr_assert_eq(psw_client_ready(c, 384, 10000), 0);
    cr_assert_eq(lib_train_to_end(c, 0, 0, false, zero, &l), 384, "the reused slot's worker trained the epoch");
    psw_client_destroy(&c);
    free(zero);
    r.psd_code = proc_wait(p, 60);
    cr_assert_eq(r.psd_code, 0, "psd finished the run");
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 384, "every sample trained once: %s", last_line(m));
    free(m);
}

/* A raw worker: REGISTER on a DEALER and return psd's ASSIGN (in m). */
static int raw_register(void *sock, ps_msg_t *m)
{
    char host[256], hid[256];
    ps_hostname(host, sizeof host);
    ps_host_id(hid, sizeof hid);
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Register reg = PSD__REGISTER__INIT;
    h.type = PSD__MSG_TYPE__MSG_REGISTER;
    h.seq = 1;
    reg.hostname = host;
    reg.host_id = hid;
    reg.pid = (uint32_t)getpid();
    reg.device = "cpu";
    reg.device_index = -1;
    reg.prev_rank = -1;
    h.body_case = PSD__HEADER__BODY_REG;
    h.reg = &reg;
    if (ps_msg_send(sock, NULL, 0, &h, NULL, 0) != 0) return -1;
    char err[256];
    zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
    if (zmq_poll(&it, 1, 30000) != 1) return -1;
    return ps_msg_recv(sock, m, false, 0, err, sizeof err);
}

/* A raw worker's message: header fields, then send (protocol filled in). */
static void raw_send(void *d, uint64_t *seq, uint64_t run, uint32_t rank, Psd__Header *h, const ps_frame_t *fr, int n)
{
    h->seq = ++*seq;
    h->run_id = run;
    h->rank = rank;
    cr_assert_eq(ps_msg_send(d, NULL, 0, h, fr, n), 0);
}

/* The next message psd sends d, which must be of `type` (psd's HEARTBEATs,
 * every second while a worker waits on it, are skipped). */
static void raw_expect(void *d, ps_msg_t *m, Psd__MsgType type)
{
    char err[256];
    do {
        zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
        cr_assert_eq(zmq_poll(&it, 1, 30000), 1, "psd answers");
        ps_msg_deinit(m);
        cr_assert_eq(ps_msg_recv(d, m, false, 0, err, sizeof err), 0, "%s", err);
    } while (m->hdr->type == PSD__MSG_TYPE__MSG_HEARTBEAT && type != PSD__MSG_TYPE__MSG_HEARTBEAT);
    cr_assert_eq(m->hdr->type, type, "got %s", ps_msg_type_name((int)m->hdr->type));
}

/* train.stream: PUSH messages whose frames are not chunks of the model, or
 * repeat a chunk (in one message or a later one), are dropped with a log
 * line; the push then completes with the right chunks, psd steps, and sends
 * the new version back in parts, every tensor once. A raw worker (the only
 * one) over the wire. */
/* A raw worker's DEALER connected to endpoint (no linger). */
static void *raw_dealer(void *ctx, const char *endpoint)
{
    void *d = zmq_socket(ctx, ZMQ_DEALER);
    int linger = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &linger, sizeof linger);
    cr_assert_eq(zmq_connect(d, endpoint), 0);
    return d;
}

/* A raw worker on d: registers (the ASSIGN left in *m), says READY with
 * these counts, takes its EPOCH, pulls and takes version 0's WEIGHTS. */
static void raw_start(void *d, ps_msg_t *m, uint64_t *run, uint64_t *seq, uint32_t *rank, uint64_t train_count,
                      uint64_t test_count)
{
    cr_assert_eq(raw_register(d, m), 0);
    cr_assert_eq(m->hdr->type, PSD__MSG_TYPE__MSG_ASSIGN);
    *run = m->hdr->run_id;
    *seq = 1;
    *rank = m->hdr->assign->rank;
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Ready rd = PSD__READY__INIT;
    rd.train_count = train_count;
    rd.test_count = test_count;
    h.type = PSD__MSG_TYPE__MSG_READY;
    h.body_case = PSD__HEADER__BODY_READY;
    h.ready = &rd;
    raw_send(d, seq, *run, *rank, &h, NULL, 0);
    raw_expect(d, m, PSD__MSG_TYPE__MSG_EPOCH);
    Psd__Pull pl = PSD__PULL__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_PULL;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &pl;
    raw_send(d, seq, *run, *rank, &h, NULL, 0);
    raw_expect(d, m, PSD__MSG_TYPE__MSG_WEIGHTS);
    cr_assert_eq(m->hdr->weights->version, 0);
}

/* A message with this run's id from a peer psd does not know (a worker
 * whose slot went to another, or one from before a restart) is dropped and
 * answered with ERR_LOST, so that the worker registers again at once; a
 * stranger with another run id gets nothing. */
Test(short, a_stranger_of_this_run_is_told_to_register_again)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,64,10]",
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "stranger", 1, args);
    void *ctx = zmq_ctx_new(), *d = raw_dealer(ctx, r.endpoint), *x = raw_dealer(ctx, r.endpoint);
    ps_msg_t m = {0};
    uint64_t run, seq, xseq = 0;
    uint32_t rank;
    raw_start(d, &m, &run, &seq, &rank, 384, 10000);
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Pull pl = PSD__PULL__INIT;
    h.type = PSD__MSG_TYPE__MSG_PULL;
    h.body_case = PSD__HEADER__BODY_PULL;
    h.pull = &pl;
    raw_send(x, &xseq, run + 1, 0, &h, NULL, 0); /* another run's */
    zmq_pollitem_t it = {x, 0, ZMQ_POLLIN, 0};
    cr_assert_eq(zmq_poll(&it, 1, 500), 0, "no answer to a stranger of another run");
    raw_send(x, &xseq, run, 0, &h, NULL, 0);
    raw_expect(x, &m, PSD__MSG_TYPE__MSG_ERROR);
    cr_assert_eq(m.hdr->error->code, PSD__ERR_CODE__ERR_LOST);
    cr_assert(strstr(m.hdr->error->message, "register again"), "%s", m.hdr->error->message);
    ps_msg_deinit(&m);
    zmq_close(x);
    zmq_close(d);
    zmq_ctx_term(ctx);
    kill(p, SIGTERM);
    cr_assert_neq(proc_wait(p, 60), -1, "psd ended");
}

Test(short, malformed_streamed_pushes_are_dropped)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=384", "--set", "model.layers=[784,64,10]",
                          "--set", "server.chunk_bytes=65536", "--set", "train.stream=true", "--set",
                          "server.shared_memory=false", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "stbad", 1, args);
    void *ctx = zmq_ctx_new(), *d = raw_dealer(ctx, r.endpoint);
    ps_msg_t m = {0};
    uint64_t run, seq;
    uint32_t rank;
    raw_start(d, &m, &run, &seq, &rank, 384, 10000);
    cr_assert_eq(m.hdr->weights->parts, 0, "weights outside a step come whole");
    ps_layout_t l;
    float *g = lib_model(&l, 64);
    for (size_t i = 0; i < l.n_params; i++) g[i] = 1e-3f;
    Psd__Header h;
    /* chunk k of W0 (784 x 64 = 50176 floats: chunks of 16384), or a piece at any offset (from a
     * buffer that has the bytes of a piece past the tensor too) */
    const size_t cf = 16384;
    float *w0 = calloc(4 * cf, sizeof *w0);
    cr_assert(w0);
#define W0_PIECE(off, n) \
    ((ps_frame_t){.data = w0 + (off), .nbytes = (n) * 4, .id = 0, .dtype = PSD__DTYPE__DT_F32, .rows = 64, \
                  .cols = 784, .offset = (off)})
    Psd__Push pu = PSD__PUSH__INIT;
    pu.version = 0;
    pu.batch = 64;
    pu.loss_sum = 32;
    pu.pull = 1;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_PUSH;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &pu;
    ps_frame_t bad1 = W0_PIECE(5, cf), dup[2] = {W0_PIECE(0, cf), W0_PIECE(0, cf)}, tail = W0_PIECE(3 * cf, cf);
    raw_send(d, &seq, run, rank, &h, &bad1, 1);            /* not at a chunk's start */
    raw_send(d, &seq, run, rank, &h, &tail, 1);            /* past the tensor (its last chunk is shorter) */
    raw_send(d, &seq, run, rank, &h, dup, 2);              /* one chunk twice in a message */
    raw_send(d, &seq, run, rank, &h, &dup[0], 1);          /* accepted */
    raw_send(d, &seq, run, rank, &h, &dup[0], 1);          /* again */
    wait_log(r.psd_log, "already received", 30);
    /* the rest, right: W0's chunks 1-3, b0, W1, b1 */
    for (int k = 1; k < 4; k++) {
        size_t off = (size_t)k * cf, n = k < 3 ? cf : l.t[0].numel - 3 * cf;
        ps_frame_t f = W0_PIECE(off, n);
        raw_send(d, &seq, run, rank, &h, &f, 1);
    }
#undef W0_PIECE
    for (int t = 1; t < l.n_tensors; t++) {
        ps_frame_t f = {.data = g + l.t[t].offset, .nbytes = l.t[t].numel * 4, .id = (uint32_t)t,
                        .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)l.t[t].rows,
                        .cols = t % 2 == 0 ? (uint32_t)l.t[t].cols : 0};
        raw_send(d, &seq, run, rank, &h, &f, 1);
    }
    uint64_t got = 0;
    while (got != (1ull << l.n_tensors) - 1) { /* version 1 in parts, every tensor once */
        raw_expect(d, &m, PSD__MSG_TYPE__MSG_WEIGHTS);
        cr_assert_eq(m.hdr->weights->version, 1);
        cr_assert_eq(m.hdr->weights->parts, (uint32_t)l.n_tensors);
        for (int i = 0; i < m.n_frames; i++) {
            uint32_t t = m.hdr->tensors[i]->id;
            cr_assert(t < (uint32_t)l.n_tensors && !(got & (1ull << t)), "tensor %u once", t);
            cr_assert_eq(zmq_msg_size(&m.frames[i]), l.t[t].numel * 4, "tensor %u whole", t);
            got |= 1ull << t;
        }
    }
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, "is no chunk of the model"), 1, "%s", log);
    cr_assert_eq(count_in(log, "outside shape"), 1, "a chunk past the tensor (the wire's own check):\n%s", log);
    cr_assert_eq(count_in(log, "already received"), 2, "%s", log);
    free(log);
    ps_msg_deinit(&m);
    free(g);
    free(w0);
    zmq_close(d);
    zmq_ctx_term(ctx);
    kill(p, SIGKILL);
    proc_wait(p, 10);
}

/* Rows of the table's gradient that are not rows of it (ids not strictly
 * increasing, beyond the table, without their values, values of another
 * count) are logged and dropped, and so are PULLs asking for rows that are
 * not rows of it or more than a batch reads; right ones are taken and
 * stepped. */
Test(short, malformed_table_rows_are_dropped)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    run_t r;
    const char *args[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=256", "--set", "ctr.test=100",
                          "--set", "server.shared_memory=false", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "rowsbad", 1, args);
    void *ctx = zmq_ctx_new(), *d = raw_dealer(ctx, r.endpoint);
    ps_msg_t m = {0};
    uint64_t run, seq;
    uint32_t rank;
    raw_start(d, &m, &run, &seq, &rank, 256, 100);
    ps_layout_t l;
    cr_assert_eq(ps_layout_init_table(&l, (const int[]){64, 64, 2}, 3, 65536, 8), 0);
    float *g = calloc(l.n_params, sizeof *g);
    cr_assert(g);
    Psd__Header h;
    Psd__Push pu = PSD__PUSH__INIT;
    pu.version = 0;
    pu.batch = 256;
    pu.loss_sum = 100;
    pu.pull = 1;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_PUSH;
    h.body_case = PSD__HEADER__BODY_PUSH;
    h.push = &pu;
    /* the MLP's four tensors whole, then the table as rows */
    ps_frame_t fr[6];
    for (int t = 0; t < 4; t++)
        fr[t] = (ps_frame_t){.data = g + l.t[t].offset, .nbytes = l.t[t].numel * 4, .id = (uint32_t)t,
                             .dtype = PSD__DTYPE__DT_F32, .rows = (uint32_t)l.t[t].rows,
                             .cols = t % 2 == 0 ? (uint32_t)l.t[t].cols : 0};
    uint32_t same[2] = {3, 3}, beyond[2] = {3, 70000}, good[2] = {1, 5};
    float vals[3 * 8];
    for (int i = 0; i < 24; i++) vals[i] = 0.25f;
#define IDS(p, n) ((ps_frame_t){.data = (p), .nbytes = (n) * 4, .id = 4, .dtype = PSD__DTYPE__DT_U32, .rows = (n)})
#define VALS(n) ((ps_frame_t){.data = vals, .nbytes = (n) * 32, .id = 4, .dtype = PSD__DTYPE__DT_F32, .rows = (n), .cols = 8})
    fr[4] = IDS(same, 2), fr[5] = VALS(2);
    raw_send(d, &seq, run, rank, &h, fr, 6);  /* a row twice */
    fr[4] = IDS(beyond, 2);
    raw_send(d, &seq, run, rank, &h, fr, 6);  /* beyond the table */
    fr[4] = IDS(good, 2);
    raw_send(d, &seq, run, rank, &h, fr, 5);  /* ids without their values */
    fr[5] = VALS(3);
    raw_send(d, &seq, run, rank, &h, fr, 6);  /* 3 rows of values for 2 ids */
    fr[5] = VALS(2);
    pu.want_rows = 1;
    raw_send(d, &seq, run, rank, &h, fr, 6);  /* its last frame is no list of rows wanted */
    pu.want_rows = 0;
    /* PULLs asking for table rows: a row twice, beyond the table, more rows than a batch
     * reads (256 x 8 x 1), no list */
    Psd__Header ph;
    Psd__Pull pl = PSD__PULL__INIT;
    pl.want_rows = 1;
    psd__header__init(&ph);
    ph.type = PSD__MSG_TYPE__MSG_PULL;
    ph.body_case = PSD__HEADER__BODY_PULL;
    ph.pull = &pl;
    uint32_t *many = malloc(2049 * sizeof *many);
    cr_assert(many);
    for (uint32_t i = 0; i < 2049; i++) many[i] = i;
    ps_frame_t pf = IDS(same, 2);
    raw_send(d, &seq, run, rank, &ph, &pf, 1);
    pf = IDS(beyond, 2);
    raw_send(d, &seq, run, rank, &ph, &pf, 1);
    pf = IDS(many, 2049);
    raw_send(d, &seq, run, rank, &ph, &pf, 1);
    raw_send(d, &seq, run, rank, &ph, NULL, 0);
    free(many);
    raw_send(d, &seq, run, rank, &h, fr, 6);  /* right: stepped */
#undef IDS
#undef VALS
    raw_expect(d, &m, PSD__MSG_TYPE__MSG_WEIGHTS);
    cr_assert_eq(m.hdr->weights->version, 1);
    cr_assert_eq(m.n_frames, 5);
    /* SGD in the config? no: Adagrad moves each touched float by about lr; rows 1 and 5 moved, row 2 did not */
    const float *E = (const float *)zmq_msg_data(&m.frames[4]);
    float *E0 = calloc(l.t[4].numel, sizeof *E0);
    cr_assert(E0);
    ps_model_init_params(&l, g, 7); /* run.seed 7 in ctr.yaml */
    memcpy(E0, g + l.t[4].offset, l.t[4].numel * sizeof *E0);
    cr_assert(E[1 * 8] != E0[1 * 8] && E[5 * 8 + 7] != E0[5 * 8 + 7], "rows 1 and 5 stepped");
    cr_assert(memcmp(E + 2 * 8, E0 + 2 * 8, 3 * 8 * sizeof *E) == 0, "rows 2-4 untouched");
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, "that are not rows of the table"), 9, "%s", log);
    free(log);
    free(E0);
    ps_msg_deinit(&m);
    free(g);
    zmq_close(d);
    zmq_ctx_term(ctx);
    kill(p, SIGKILL);
    proc_wait(p, 10);
}

/* One hello on psd's shared-memory socket; returns the reply's status (or
 * -1000 - errno when there was none) and closes any fd that came back. */
static int hello(const char *name, uint64_t run_id, uint32_t rank, const uint8_t *token, int fd, uint64_t bytes,
                 char *msg, size_t n)
{
    struct sockaddr_un a;
    socklen_t alen = ps_shm_addr(&a, name);
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct timeval tv = {10, 0};
    setsockopt(s, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (connect(s, (struct sockaddr *)&a, alen) != 0) {
        close(s);
        return -1000 - errno;
    }
    ps_shm_hello_t h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, PS_SHM_MAGIC, sizeof h.magic);
    h.run_id = run_id;
    h.rank = rank;
    memcpy(h.token, token, PS_SHM_TOKEN);
    h.grad_bytes = bytes;
    ps_shm_reply_t r;
    int rfd = -1, rc = ps_shm_send(s, &h, sizeof h, fd);
    if (rc == 0) rc = ps_shm_recv(s, &r, sizeof r, &rfd, 0);
    close(s);
    if (rc != 0) return -1000 + rc;
    if (rfd >= 0) {
        /* what psd hands out must be read-only */
        void *w = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, rfd, 0);
        cr_assert(w == MAP_FAILED, "psd's parameter region can be mapped writable");
        close(rfd);
    }
    snprintf(msg, n, "%.*s", (int)sizeof r.message, r.message);
    return r.status == 0 && rfd < 0 ? -2000 : r.status;
}

/* psd's shared-memory socket is reachable by anyone on the host: it takes a
 * region only from the worker it offered one to (token from the ASSIGN),
 * only a memfd of the gradient's size whose size is sealed (a region that
 * could shrink would crash psd when read), only once; everything else gets
 * a refusal and a log line, and training carries on. */
Test(short, shared_memory_requests_are_checked)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--set", "model.layers=[784,32,10]",
                          NULL};
    pid_t p = start_psd(&r, "shmreq", 1, args);
    void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
    cr_assert_eq(zmq_connect(d, r.endpoint), 0);
    ps_msg_t m = {0};
    cr_assert_eq(raw_register(d, &m), 0, "psd answers a raw REGISTER");
    cr_assert_eq(m.hdr->type, PSD__MSG_TYPE__MSG_ASSIGN);
    Psd__Assign *as = m.hdr->assign;
    cr_assert(as->shm_socket && as->shm_socket[0] && as->shm_token.len == PS_SHM_TOKEN,
              "psd offers shared memory to a worker on its host");
    char name[128];
    uint8_t tok[PS_SHM_TOKEN], bad[PS_SHM_TOKEN];
    snprintf(name, sizeof name, "%s", as->shm_socket);
    memcpy(tok, as->shm_token.data, PS_SHM_TOKEN);
    memcpy(bad, tok, PS_SHM_TOKEN);
    bad[7] ^= 1;
    ps_layout_t lay;
    cr_assert_eq(ps_layout_init(&lay, (const int[]){784, 32, 10}, 3), 0);
    uint64_t run = m.hdr->run_id, bytes = lay.n_params * sizeof(float);
    uint32_t rank = as->rank;
    ps_msg_deinit(&m);
    char msg[128];
    int sealed = ps_shm_memfd("t", bytes, 1), loose = ps_shm_memfd("t", bytes, 0);
    int small = ps_shm_memfd("t", bytes - 64, 1);
    cr_assert(sealed >= 0 && loose >= 0 && small >= 0);
    cr_assert_neq(hello(name, run, rank, bad, sealed, bytes, msg, sizeof msg), 0, "a wrong token is refused");
    cr_assert(strstr(msg, "token"), "%s", msg);
    cr_assert_neq(hello(name, run + 1, rank, tok, sealed, bytes, msg, sizeof msg), 0, "another run is refused");
    cr_assert_neq(hello(name, run, rank + 1, tok, sealed, bytes, msg, sizeof msg), 0, "another rank is refused");
    cr_assert_neq(hello(name, run, rank, tok, -1, bytes, msg, sizeof msg), 0, "a hello without a region");
    cr_assert(strstr(msg, "memfd"), "%s", msg);
    cr_assert_neq(hello(name, run, rank, tok, loose, bytes, msg, sizeof msg), 0, "an unsealed region is refused");
    cr_assert(strstr(msg, "sealed"), "%s", msg);
    cr_assert_neq(hello(name, run, rank, tok, small, bytes - 64, msg, sizeof msg), 0, "a region of another size");
    int tmp = open(dir, O_TMPFILE | O_RDWR, 0600);
    cr_assert(tmp >= 0 && ftruncate(tmp, (off_t)bytes) == 0);
    cr_assert_neq(hello(name, run, rank, tok, tmp, bytes, msg, sizeof msg), 0, "a plain file is refused");
    cr_assert_eq(hello(name, run, rank, tok, sealed, bytes, msg, sizeof msg), 0, "the right one is taken: %s", msg);
    cr_assert_neq(hello(name, run, rank, tok, sealed, bytes, msg, sizeof msg), 0, "only once");
    /* a connection that never says anything is dropped, not waited for */
    struct sockaddr_un a;
    socklen_t alen = ps_shm_addr(&a, name);
    int mute = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    cr_assert_eq(connect(mute, (struct sockaddr *)&a, alen), 0);
    close(tmp);
    close(sealed);
    close(loose);
    close(small);
    /* a real worker trains the run to the end */
    zmq_close(d);
    zmq_ctx_term(ctx);
    wait_log(r.psd_log, "sent nothing for", 30);
    close(mute);
    pid_t w = start_worker(&r, "shmreq", 0, NULL);
    cr_assert_eq(proc_wait(p, 300), 0, "psd");
    cr_assert_eq(proc_wait(w, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert_geq(count_in(log, "refused a shared-memory request"), 8, "%s", log);
    free(log);
}

/* Nothing of the shared memory outlives the processes, whatever kills
 * them: memfds are freed with their last descriptor and mapping (nothing
 * is in /dev/shm: other tests running beside may put files there, so the
 * processes' own mappings and descriptors are checked), the socket's name
 * is abstract. */
Test(short, nothing_is_left_behind_after_kill_9)
{
    run_t r;
    const char *args[] = {"--epochs", "20", "--set", "data.train_limit=6000", NULL};
    pid_t p = start_psd(&r, "shk", 2, args);
    pid_t w0 = start_worker(&r, "shk", 0, NULL), w1 = start_worker(&r, "shk", 1, NULL);
    wait_metrics(&r, 1);
    char *log = slurp(r.psd_log);
    cr_assert_eq(count_in(log, "through shared memory"), 2, "%s", log);
    const char *at = strstr(log, "socket @");
    cr_assert_not_null(at);
    char sock[96];
    snprintf(sock, sizeof sock, "%.*s", (int)strcspn(at + 8, " \n"), at + 8);
    free(log);
    cr_assert(unix_socket_listed(sock), "%s is in /proc/net/unix while psd runs", sock);
    const pid_t ps[] = {p, w0, w1};
    for (int i = 0; i < 3; i++) {
        int memfd;
        cr_assert_eq(dev_shm_files_of(ps[i], &memfd), 0, "process %d of 3 uses a file in /dev/shm", i + 1);
        cr_assert_geq(memfd, 2, "process %d of 3 maps the gradient and parameter memfds", i + 1);
    }
    kill(p, SIGKILL);
    kill(w0, SIGKILL);
    kill(w1, SIGKILL);
    cr_assert_eq(proc_wait(p, 10), 128 + SIGKILL);
    cr_assert_eq(proc_wait(w0, 10), 128 + SIGKILL);
    cr_assert_eq(proc_wait(w1, 10), 128 + SIGKILL);
    cr_assert_not(unix_socket_listed(sock), "%s gone with psd", sock);
}

Test(short, one_pworker_command_starts_one_worker_per_device)
{
    run_t r;
    pid_t p = start_psd(&r, "sup", 3, slice);
    const char *devs[] = {"--devices", "cpu,cpu,cpu", NULL};
    pid_t sup = start_worker(&r, "sup", 0, devs);
    cr_assert_eq(proc_wait(p, 300), 0, "psd got its 3 workers from one pworker command");
    cr_assert_eq(proc_wait(sup, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "rank 2"), "%s", log);
    free(log);
}

Test(short, pworker_forwards_signals_to_its_workers)
{
    run_t r;
    const char *args[] = {"--start-timeout", "60", NULL};
    pid_t p = start_psd(&r, "sig", 3, args);
    const char *devs[] = {"--devices", "cpu,cpu", NULL};
    pid_t sup = start_worker(&r, "sig", 0, devs);
    for (int i = 0; i < 300; i++) { /* both registered */
        char *log = slurp(r.psd_log);
        int both = log && strstr(log, "rank 1,");
        free(log);
        if (both) break;
        zmq_poll(NULL, 0, 50);
    }
    zmq_poll(NULL, 0, 300);
    kill(sup, SIGTERM);
    int code = proc_wait(sup, 30);
    cr_assert_eq(code, 0, "both workers got SIGTERM and left cleanly (got %d)", code);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "rank 0") && strstr(log, "left the run"), "psd saw them leave: %s", log);
    free(log);
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 30), 0, "psd stops on SIGTERM with exit 0");
}

static void setenv_no_gpu(void) { setenv("CUDA_VISIBLE_DEVICES", "", 1); }

Test(short, devices_auto_without_gpu_trains_on_cpu_with_one_warning)
{
    setenv_no_gpu();
    run_t r;
    train(&r, "auto", 1, slice, 300);
    check_run(&r, 1, 1);
    char log[256];
    path(log, sizeof log, "auto-w0.log");
    char *t = slurp(log);
    int warnings = 0;
    for (const char *q = t; (q = strstr(q, "WARN")) != NULL; q++) warnings++;
    cr_assert_eq(warnings, 1, "exactly one warning: %s", t);
    cr_assert(strstr(t, "no GPU found") && strstr(t, "training on the CPU"), "%s", t);
    free(t);
}

Test(short, a_gpu_that_does_not_exist_is_an_error)
{
    setenv_no_gpu();
    char out[256];
    path(out, sizeof out, "dev.txt");
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices 7 > '%s' 2>&1", pworker_bin, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "GPU 7 does not exist"), "%s", t);
    cr_assert_eq(count_lines(t), 1, "one line: %s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices 0,zz > /dev/null 2>&1", pworker_bin), 2);
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices '' > /dev/null 2>&1", pworker_bin), 2);
}

/* ---- GPU workers on the CUDA emulator ---------------------------------------
 * pworker's GPU paths run here on libpsw_cuda_emu.so: the CUDA backend's own
 * source against a CPU emulation of the CUDA runtime and cuBLAS
 * (tests/cuda_emu), which faults on a host access to device memory and runs
 * stream work only when it is waited for. Skipped where it is not built (the
 * sanitizer build). */

/* Workers started after this see `devices` emulated GPUs of `mib` MiB each. */
static void use_cuda_emu(int devices, int mib)
{
    const char *emu = getenv("PSD_CUDA_EMU");
    if (!emu || !*emu) cr_skip_test("no CUDA emulator plugin in this build (PSD_CUDA_EMU)");
    char n[16], m[16];
    snprintf(n, sizeof n, "%d", devices);
    snprintf(m, sizeof m, "%d", mib);
    setenv("PSW_CUDA_PLUGIN", emu, 1);
    setenv("PSW_CUDA_EMU_DEVICES", n, 1);
    setenv("PSW_CUDA_EMU_MIB", m, 1);
    unsetenv("CUDA_VISIBLE_DEVICES");
}

/* psd + one `pworker --devices DEVS [wflag]` (one worker per device) to the
 * end: psd's exit code, the supervisor's in *sup_code. */
static int train_devices(run_t *r, const char *tag, int workers, const char **args, const char *devs,
                         const char *wflag, int *sup_code)
{
    pid_t p = start_psd(r, tag, workers, args);
    const char *extra[] = {"--devices", devs, wflag, NULL};
    pid_t sup = start_worker(r, tag, 0, extra);
    int code = proc_wait(p, 300);
    *sup_code = proc_wait(sup, 60);
    return code;
}

Test(short, gpu_workers_train_like_cpu_workers_on_the_cuda_emulator)
{
    use_cuda_emu(2, 4096);
    run_t g, c;
    int gsup, csup;
    cr_assert_eq(train_devices(&g, "emu", 2, slice, "auto", NULL, &gsup), 0, "psd with 2 GPU workers");
    cr_assert_eq(gsup, 0, "pworker --devices auto");
    cr_assert_eq(train_devices(&c, "cpu", 2, slice, "cpu,cpu", NULL, &csup), 0, "psd with 2 CPU workers");
    cr_assert_eq(csup, 0);
    char *log = slurp(g.psd_log);
    cr_assert(log && strstr(log, ", cuda:0 (") && strstr(log, ", cuda:1 ("), "--devices auto: a worker on each GPU: %s",
              log);
    free(log);
    char wl[256];
    path(wl, sizeof wl, "emu-w0.log"); /* rank 0's INFO lines, every worker's warnings */
    log = slurp(wl);
    cr_assert(log && strstr(log, "(psw CUDA emulator "), "%s", log);
    cr_assert(!strstr(log, "WARN") && !strstr(log, "on the CPU"), "no fallback to the CPU: %s", log);
    free(log);
    /* the same run (seed, data, psd's step): the GPU's products and sums
     * differ from the CPU's in rounding only (on the emulator its GEMMs are
     * OpenBLAS's; db, the embedding bags and the softmax are its kernels) */
    char *gm = metrics_last(&g), *cm = metrics_last(&c);
    const char *gl = last_line(gm), *cl = last_line(cm);
    cr_assert_eq(json_num(gl, "val_samples"), 10000, "%s", gl);
    cr_assert_eq(json_num(gl, "workers"), 2, "%s", gl);
    double gacc = json_num(gl, "val_acc"), cacc = json_num(cl, "val_acc");
    double gloss = json_num(gl, "val_loss"), closs = json_num(cl, "val_loss");
    cr_assert(gacc > 0.6, "trained: %s", gl);
    cr_assert(fabs(gacc - cacc) <= 0.005 && fabs(gloss - closs) <= 1e-3 * closs,
              "GPU val_acc %g val_loss %g against CPU %g %g", gacc, gloss, cacc, closs);
    free(gm);
    free(cm);
}

/* The click-through model on GPU workers (embedding bags, rows up and down),
 * with the table on psd and with a replica on each worker (over tcp: on
 * shared memory a replica's gradient goes whole), against CPU workers: every
 * push as rows, the same validation log-loss to rounding. */
Test(short, ctr_gpu_workers_train_like_cpu_workers_on_the_cuda_emulator)
{
    use_cuda_emu(2, 4096);
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *modes[2] = {"ctr.worker_table_mb=0", "ctr.worker_table_mb=256"};
    const char *says[2] = {"pushed as rows 40 times, whole 0 times; the table stayed on psd",
                           "pushed as rows 40 times, whole 0 times\n"};
    for (int i = 0; i < 2; i++) {
        const char *args[] = {"--config", cfg, "--epochs", "1", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                              "--set", "checkpoint.dir=", "--set", modes[i], NULL};
        run_t g, c;
        int gsup, csup;
        char tg[16], tc[16];
        snprintf(tg, sizeof tg, "ctrg%d", i);
        snprintf(tc, sizeof tc, "ctrc%d", i);
        cr_assert_eq(train_devices(&g, tg, 2, args, "0,1", "--no-shm", &gsup), 0, "psd with 2 GPU workers, %s", modes[i]);
        cr_assert_eq(gsup, 0);
        cr_assert_eq(train_devices(&c, tc, 2, args, "cpu,cpu", "--no-shm", &csup), 0, "psd with 2 CPU workers, %s", modes[i]);
        cr_assert_eq(csup, 0);
        char wl[256];
        snprintf(wl, sizeof wl, "%s/%s-w0.log", dir, tg);
        char *log = slurp(wl);
        cr_assert(log && strstr(log, "(psw CUDA emulator ") && strstr(log, says[i]), "%s: %s", modes[i], log);
        free(log);
        char *gm = metrics_last(&g), *cm = metrics_last(&c);
        const char *gl = last_line(gm), *cl = last_line(cm);
        cr_assert_eq(json_num(gl, "val_samples"), 2000, "%s", gl);
        double gloss = json_num(gl, "val_loss"), closs = json_num(cl, "val_loss");
        cr_assert(gloss > 0 && fabs(gloss - closs) <= 1e-3 * closs, "%s: GPU val_loss %g, CPU %g", modes[i], gloss,
                  closs);
        free(gm);
        free(cm);
    }
}

/* A GPU that fails mid-run (the emulator's 200th kernel launch on device 1
 * faults, as a kernel that reads a bad address does): its worker tells psd
 * which device and why before it exits 1, and psd goes on with the other at
 * once (not after worker_timeout): every sample trained once, every test
 * sample validated. */
Test(short, a_gpu_that_fails_mid_run_is_reported_and_the_run_goes_on)
{
    use_cuda_emu(2, 4096);
    setenv("PSW_CUDA_EMU_FAIL", "1:200", 1);
    run_t r;
    int sup;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=4000", "--worker-timeout", "120", NULL};
    double t0 = ps_now();
    cr_assert_eq(train_devices(&r, "gfail", 2, args, "0,1", NULL, &sup), 0, "psd finishes with the other worker");
    double took = ps_now() - t0;
    cr_assert_eq(sup, 1, "pworker exits with its failed worker's status");
    char *log = slurp(r.psd_log);
    cr_assert(log && strstr(log, "failed: device cuda:1 failed: psw_cuda: ") &&
                  strstr(log, "unspecified launch failure"),
              "psd names the device and the error: %s", log);
    cr_assert_null(strstr(log, "nothing from it"), "told, not timed out: %s", log);
    free(log);
    cr_assert(took < 100, "psd went on at once (%.0f s; its worker_timeout is 120 s)", took);
    char *m = metrics_last(&r);
    const char *l = last_line(m);
    cr_assert_eq(json_num(l, "train_samples"), 4000, "%s", l);
    cr_assert_eq(json_num(l, "val_samples"), 10000, "%s", l);
    free(m);
}

Test(short, a_gpu_beyond_the_visible_ones_is_an_error)
{
    use_cuda_emu(2, 4096);
    char out[256];
    path(out, sizeof out, "dev2.txt");
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices 0,2 > '%s' 2>&1", pworker_bin, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "GPU 2 does not exist: 2 visible (ordinals 0-1)"), "%s", t);
    free(t);
    setenv("CUDA_VISIBLE_DEVICES", "1", 1);
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices 1 > '%s' 2>&1", pworker_bin, out), 2);
    t = slurp(out);
    cr_assert(strstr(t, "GPU 1 does not exist: 1 visible (ordinals 0-0, after CUDA_VISIBLE_DEVICES)"), "%s", t);
    free(t);
}

Test(short, a_gpu_without_memory_for_the_model_fails_and_does_not_fall_back)
{
    use_cuda_emu(1, 1); /* 1 MiB: the MLP's 2 MiB of weights do not fit */
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=4000", "--start-timeout", "30", NULL};
    pid_t p = start_psd(&r, "oom", 1, args);
    const char *extra[] = {"--devices", "0", NULL};
    pid_t sup = start_worker(&r, "oom", 0, extra);
    cr_assert_eq(proc_wait(sup, 60), 1, "the worker fails");
    wait_log(r.psd_log, "failed: out of device memory for the model", 30); /* psd was told */
    kill(p, SIGTERM);
    proc_wait(p, 30);
    char wl[256];
    path(wl, sizeof wl, "oom-w0.log");
    char *log = slurp(wl);
    cr_assert(log && strstr(log, "out of device memory for the model (2.0 MiB of parameters"), "%s", log);
    cr_assert(!strstr(log, "on the CPU"), "no fallback: %s", log);
    free(log);
}

/* ---- long: all 60000 training samples ------------------------------------ */

static void full_epoch(int workers)
{
    run_t r;
    const char *args[] = {"--epochs", "1", NULL};
    char tag[8];
    snprintf(tag, sizeof tag, "f%d", workers);
    train(&r, tag, workers, args, 900);
    check_run(&r, workers, 1);
    char *m = metrics_last(&r);
    const char *last = last_line(m);
    cr_assert_eq(json_num(last, "train_samples"), 60000);
    cr_assert_gt(json_num(last, "val_acc"), 0.80, "one epoch learns: %s", last);
    free(m);
}

Test(long, full_epoch_one_worker) { full_epoch(1); }
Test(long, full_epoch_two_workers) { full_epoch(2); }
Test(long, full_epoch_three_workers) { full_epoch(3); }

/* ---- fault injection (issue: never hang, never lose a run) -------------- */

static unsigned fault_seed(void)
{
    const char *e = getenv("PSD_FAULT_SEED");
    unsigned seed = e ? (unsigned)strtoul(e, NULL, 10) : (unsigned)time(NULL);
    fprintf(stderr, "fault injection seed %u (PSD_FAULT_SEED=%u replays it)\n", seed, seed);
    srand(seed);
    return seed;
}

/* Every epoch trained each sample once and validated every test sample. */
static void check_every_epoch(const run_t *r, int epochs, uint64_t train)
{
    char *m = metrics_last(r);
    cr_assert_eq(count_lines(m), epochs, "%s", m);
    int e = 0;
    for (char *line = m; line && *line; e++) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        cr_assert_eq(json_num(line, "train_samples"), (double)train, "epoch %d: %s", e + 1, line);
        cr_assert_eq(json_num(line, "val_samples"), 10000, "epoch %d: %s", e + 1, line);
        cr_assert_eq(json_num(line, "epoch"), e + 1, "%s", line);
        line = nl ? nl + 1 : NULL;
    }
    cr_assert_gt(json_num(last_line(m), "val_acc"), 0.7, "trained: %s", last_line(m));
    free(m);
}

/* Seconds psd reported between a worker's last message and declaring it
 * lost: for its silence ("nothing from it for 2.1 s") or for its closed
 * connection ("its connection closed, 0.0 s after its last message"); -1
 * if neither. *closed: which. */
static double detection_seconds(const char *psd_log, bool *closed)
{
    static const char *const how[2] = {"nothing from it for ", "its connection closed, "};
    char *log = slurp(psd_log);
    double d = -1;
    for (int k = 0; k < 2 && d < 0; k++) {
        const char *p = log ? strstr(log, how[k]) : NULL;
        if (p) d = strtod(p + strlen(how[k]), NULL), *closed = k == 1;
    }
    free(log);
    return d;
}

/* psd and 3 workers; one of them killed (SIGKILL) in the middle of epoch
 * 2: psd and the others finish the run. */
static void kill_one_mid_epoch(run_t *r, const char *tag, const char **args, int shards)
{
    fault_seed();
    const char *a0[48];
    int k = 0;
    for (; args[k]; k++) a0[k] = args[k];
    if (shards > 1) a0[k++] = "--shard", a0[k++] = "0/2"; /* and shard 1 */
    a0[k] = NULL;
    pid_t p = start_psd(r, tag, 3, a0), s1 = shards > 1 ? start_shard(r, tag, 1, 2, args) : 0;
    pid_t w[3];
    for (int i = 0; i < 3; i++) w[i] = start_worker(r, tag, i, NULL);
    wait_metrics(r, 1);
    zmq_poll(NULL, 0, rand() % 150); /* mid-epoch 2 */
    int victim = rand() % 3;
    kill(w[victim], SIGKILL);
    cr_assert_eq(proc_wait(p, 300), 0, "psd finished the run with the survivors");
    for (int i = 0; i < 3; i++)
        if (i != victim) cr_assert_eq(proc_wait(w[i], 30), 0, "worker %d", i);
    if (s1) cr_assert_eq(proc_wait(s1, 30), 0, "shard 1 exits 0");
}

Test(short, a_slow_link_is_not_taken_for_a_dead_worker)
{
    /* A 38 MB model over a 100 MB/s link (a process relaying the worker's
     * connection at that rate each way): each reply and each push is on the
     * wire for about 0.4 s, ZeroMQ hands it over only whole, so the worker
     * is silent for longer than --worker-timeout 0.5 at every step. psd
     * allows for a message of the whole model each way (at 40 MB/s, 0.95 s):
     * the worker is never declared lost and the run trains and validates
     * every sample. */
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=640", "--set", "model.layers=[784,12000,10]",
                          "--worker-timeout", "0.5", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "slow", 1, args);
    /* the link accepts at once: a worker that reached it before psd listens
     * would see its handshakes fail and give up */
    wait_log(r.psd_log, "listening on", 120);
    int lport = free_port();
    pid_t link = proc_slow_link(lport, atoi(strrchr(r.endpoint, ':') + 1), 100e6);
    cr_assert(link > 0, "the slow link listens");
    run_t via = r;
    snprintf(via.endpoint, sizeof via.endpoint, "tcp://127.0.0.1:%d", lport);
    const char *wargs[] = {"--no-shm", "--threads", "1", NULL};
    pid_t w = start_worker(&via, "slow", 0, wargs);
    r.psd_code = proc_wait(p, 300);
    r.worker_code[0] = proc_wait(w, 30);
    char *log = slurp(r.psd_log);
    cr_assert(log && strstr(log, "a silent worker is lost after"), "psd says how long it waits");
    cr_assert(!strstr(log, "lost:"), "no worker was declared lost on the slow link:\n%s", log);
    free(log);
    check_run(&r, 1, 1);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 640, "%s", last_line(m));
    free(m);
}

/* The killed worker's connection closes with it: psd declares it lost at
 * once, not after --worker-timeout (60 s here: a psd that waited for it
 * took 63 s for the run). */
Test(short, killed_worker_the_others_finish_every_sample_once)
{
    run_t r;
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=12000", "--worker-timeout", "60",
                          "--set", "checkpoint.dir=", NULL};
    double t0 = ps_now();
    kill_one_mid_epoch(&r, "k9", args, 1);
    check_every_epoch(&r, 3, 12000);
    bool closed = false;
    double d = detection_seconds(r.psd_log, &closed);
    cr_assert(closed && d >= 0 && d <= 1.0, "declared lost for its closed connection, %.1f s after its last message "
              "(the worker was training)", d);
    cr_assert_lt(ps_now() - t0, 60.0, "the run did not wait worker_timeout for the killed worker");
}

/* A worker that dies before training starts frees its place: psd starts
 * with the two that are alive instead of counting the dead one in and
 * waiting worker_timeout (60 s) for it in the first epoch. */
Test(short, a_worker_that_dies_before_the_start_is_not_waited_for)
{
    run_t r;
    const char *args[] = {"--epochs", "2", "--set", "data.train_limit=12000", "--worker-timeout", "60",
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "k9wait", 2, args);
    pid_t a = start_worker(&r, "k9wait", 0, NULL);
    wait_log(r.psd_log, "rank 0 exchanges tensors with psd", 60); /* its data checked: ready */
    kill(a, SIGKILL);
    cr_assert_eq(proc_wait(a, 10), 128 + SIGKILL);
    wait_log(r.psd_log, "lost: its connection closed", 10);
    double t0 = ps_now();
    pid_t b = start_worker(&r, "k9wait", 1, NULL), c = start_worker(&r, "k9wait", 2, NULL);
    cr_assert_eq(proc_wait(p, 300), 0, "psd");
    cr_assert_eq(proc_wait(b, 30), 0);
    cr_assert_eq(proc_wait(c, 30), 0);
    cr_assert_lt(ps_now() - t0, 50.0, "the dead worker was not waited for");
    char *log = slurp(r.psd_log);
    cr_assert(log && !strstr(log, "nothing from it"), "%s", log ? log : "");
    free(log);
    check_every_epoch(&r, 2, 12000);
}

/* psd itself held up (SIGSTOP) past its silence limit while it waits for
 * the workers: their messages wait unread in its queue, and the overdue timer
 * runs before they are read. Nobody is lost for that (psd used to take every
 * worker it waited for for lost and go on without them). */
Test(short, a_psd_held_up_past_its_silence_limit_loses_nobody)
{
    run_t r;
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=30000", "--worker-timeout", "1", "--set",
                          "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "held", 2, args);
    pid_t w0 = start_worker(&r, "held", 0, NULL), w1 = start_worker(&r, "held", 1, NULL);
    wait_metrics(&r, 1); /* epoch 2 under way: psd waits for the workers' pushes */
    kill(p, SIGSTOP);
    zmq_poll(NULL, 0, 2500); /* the silence limit is about 1 s */
    kill(p, SIGCONT);
    r.psd_code = proc_wait(p, 300);
    r.worker_code[0] = proc_wait(w0, 30);
    r.worker_code[1] = proc_wait(w1, 30);
    check_run(&r, 2, 3);
    char *log = slurp(r.psd_log);
    cr_assert(log && strstr(log, "event loop was held up") && !strstr(log, ") lost: ") && !strstr(log, "registers again"),
              "%s", log ? log : "");
    free(log);
}

/* A worker frozen (SIGSTOP) past psd's silence limit is declared lost, and
 * psd is stopped (SIGINT) before it wakes: psd's SHUTDOWN waits for it on its
 * connection, and once woken it ends at once with psd's code (it used to wait
 * for a psd that was gone for its whole --retry-for, 120 s by default). */
Test(short, a_worker_lost_while_frozen_is_told_that_the_run_ended)
{
    run_t r;
    const char *args[] = {"--epochs", "50", "--set", "data.train_limit=6000", "--worker-timeout", "1", "--set",
                          "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "told", 2, args);
    pid_t w0 = start_worker(&r, "told", 0, NULL), w1 = start_worker(&r, "told", 1, NULL);
    wait_metrics(&r, 1);
    kill(w1, SIGSTOP);
    wait_log(r.psd_log, ") lost: nothing from it", 30); /* before ZeroMQ's heartbeat closes its connection (3 s) */
    kill(p, SIGINT);
    cr_assert_eq(proc_wait(p, 60), 0, "psd stopped");
    double t0 = ps_now();
    kill(w1, SIGCONT);
    int code = proc_wait(w1, 20);
    cr_assert_eq(code, 0, "the woken worker ended with psd's code (exit %d after %.1f s)", code, ps_now() - t0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    char *l = slurp(r.psd_log);
    cr_assert(l && !strstr(l, ") lost: its connection closed"), "%s", l ? l : "");
    free(l);
}

Test(short, frozen_worker_is_dropped_then_rejoins_cleanly)
{
    fault_seed();
    run_t r;
    /* 8 epochs: after the 2-3 s to detect it and 0.5 s frozen, the worker must find the run
     * still going, to rejoin (with 3 the others sometimes finished first; a worker lost and
     * still frozen when the run ends: a_worker_lost_while_frozen_is_told_that_the_run_ended) */
    const char *args[] = {"--epochs", "8", "--set", "data.train_limit=12000", "--worker-timeout", "2", "--set",
                          "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "stop", 2, args);
    pid_t w0 = start_worker(&r, "stop", 0, NULL), w1 = start_worker(&r, "stop", 1, NULL);
    wait_metrics(&r, 1);
    zmq_poll(NULL, 0, rand() % 150);
    kill(w1, SIGSTOP);
    wait_log(r.psd_log, "lost: ", 30);
    zmq_poll(NULL, 0, 500);
    kill(w1, SIGCONT); /* it wakes up, is told it was declared lost, and registers again */
    cr_assert_eq(proc_wait(p, 300), 0, "psd finished the run");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 60), 0, "the frozen worker rejoined or left cleanly");
    check_every_epoch(&r, 8, 12000);
    char *l = slurp(r.psd_log);
    cr_assert(l && strstr(l, "joins from epoch"), "the frozen worker rejoined: %s", l ? l : "");
    free(l);
    bool closed = false;
    double d = detection_seconds(r.psd_log, &closed);
    /* for its silence (worker_timeout 2 s, 0.1 s timer), or, frozen where psd
     * does not wait for it (at the barrier), when ZeroMQ's heartbeat gives up
     * on its connection (3 s plus the model's transfer time) */
    cr_assert(closed ? d >= 3 && d <= 4.5 : d >= 2 && d <= 3.0, "declared lost after %.1f s (%s)", d,
              closed ? "its connection closed" : "silence");
}

/* Wait for a metrics line with "workers":n; returns the number of lines then. */
static int wait_workers_line(const run_t *r, int n, double timeout_s)
{
    char pat[32];
    snprintf(pat, sizeof pat, "\"workers\":%d,", n);
    for (double t = 0; t < timeout_s; t += 0.05) {
        char *m = slurp(r->metrics);
        int lines = m && strstr(m, pat) ? count_lines(m) : 0;
        free(m);
        if (lines) return lines;
        zmq_poll(NULL, 0, 50);
    }
    cr_assert_fail("no epoch with %d workers within %.0f s", n, timeout_s);
    return 0;
}

Test(short, worker_joins_mid_run)
{
    run_t r;
    const char *args[] = {"--epochs", "200", "--set", "data.train_limit=6000", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "join", 2, args);
    pid_t w0 = start_worker(&r, "join", 0, NULL), w1 = start_worker(&r, "join", 1, NULL);
    wait_metrics(&r, 1);
    pid_t w2 = start_worker(&r, "join", 2, NULL);
    wait_workers_line(&r, 3, 120); /* it trained a whole epoch with the others */
    kill(p, SIGINT);
    cr_assert_eq(proc_wait(p, 60), 0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    cr_assert_eq(proc_wait(w2, 30), 0);
    char *m = metrics_last(&r);
    int epochs = count_lines(m);
    free(m);
    check_every_epoch(&r, epochs, 6000);
}

Test(short, worker_sigterm_is_a_planned_departure)
{
    run_t r;
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=12000", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "term", 2, args);
    pid_t w0 = start_worker(&r, "term", 0, NULL), w1 = start_worker(&r, "term", 1, NULL);
    wait_metrics(&r, 1);
    kill(w1, SIGTERM);
    cr_assert_eq(proc_wait(w1, 30), 0, "a worker stopped by SIGTERM exits 0");
    cr_assert_eq(proc_wait(p, 300), 0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    check_every_epoch(&r, 3, 12000);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "left the run"), "%s", log);
    cr_assert_null(strstr(log, "lost:"), "not taken for a failure: %s", log);
    free(log);
}

static const char *ckpt_dir_arg(char *buf, size_t n)
{
    char d[256];
    path(d, sizeof d, "ckpt");
    snprintf(buf, n, "checkpoint.dir=%s", d);
    return buf;
}

Test(short, killed_psd_resumes_and_the_same_workers_carry_on)
{
    fault_seed();
    run_t r;
    char ck[300], dirbuf[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *args[] = {"--epochs", "4", "--set", "data.train_limit=12000", "--set", ck, NULL};
    pid_t p = start_psd(&r, "pk", 2, args);
    const char *wx[] = {"--retry-for", "60", NULL};
    pid_t w0 = start_worker(&r, "pk", 0, wx), w1 = start_worker(&r, "pk", 1, wx);
    wait_metrics(&r, 1);
    /* the epoch's checkpoint is written in the background after its metrics
     * line: kill only once it is there (else there is nothing to resume) */
    wait_log(r.psd_log, ".psdc: ", 60);
    zmq_poll(NULL, 0, rand() % 200);
    kill(p, SIGKILL); /* no goodbye: the workers see the connection drop */
    proc_wait(p, 10);
    /* restart on the same endpoint from the checkpoint */
    const char *rargs[] = {"--epochs", "4", "--set", "data.train_limit=12000", "--set", ck, "--resume", dirbuf, NULL};
    char name[64];
    snprintf(name, sizeof name, "pk2-psd.log");
    char log2[256];
    path(log2, sizeof log2, name);
    char wn[4] = "2";
    const char *argv[40] = {psd_bin, "--listen", r.endpoint, "--workers", wn, "--metrics", r.metrics, "--save",
                            r.weights, "--start-timeout", "60", "--worker-timeout", "5"};
    int n = 13;
    for (int i = 0; rargs[i]; i++) argv[n++] = rargs[i];
    argv[n] = NULL;
    pid_t p2 = proc_spawn(argv, log2);
    int code = proc_wait(p2, 300);
    char *l2 = slurp(log2);
    cr_assert_eq(code, 0, "resumed psd finished: %s", l2);
    cr_assert(strstr(l2, "resuming run"), "%s", l2);
    free(l2);
    cr_assert_eq(proc_wait(w0, 30), 0, "worker 0 carried on without a restart");
    cr_assert_eq(proc_wait(w1, 30), 0, "worker 1 carried on without a restart");
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "epoch"), 4, "the run reached its last epoch: %s", m);
    cr_assert_eq(json_num(last_line(m), "val_samples"), 10000);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 12000, "%s", last_line(m));
    free(m);
}

Test(short, stopped_at_an_epoch_boundary_and_resumed_gives_identical_weights)
{
    run_t a, b;
    char ck[300], dirbuf[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *plain[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set",
                           "checkpoint.dir=", NULL};
    train(&a, "full", 2, plain, 300);
    check_run(&a, 2, 3);
    const char *first[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set", ck,
                           "--stop-after-epoch", "2", NULL};
    train(&b, "half", 2, first, 300);
    cr_assert_eq(b.psd_code, 0, "stop after epoch 2 exits 0");
    const char *second[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set", ck,
                            "--resume", dirbuf, NULL};
    run_t c;
    train(&c, "rest", 2, second, 300);
    cr_assert_eq(c.psd_code, 0);
    cr_assert(weights_equal(a.weights, c.weights), "resumed run ends with bit-identical weights");
    /* epoch 1's checkpoint (step 24) still being written (a slow disk) when epoch 2 ends at
     * step 48: the epoch's end is written after it, and the stop waits for that one (it used
     * to stop with the one of step 24, and the resume trained epoch 2 again) */
    char ck2[300], dir2[256];
    path(dir2, sizeof dir2, "ckpt2");
    snprintf(ck2, sizeof ck2, "checkpoint.dir=%s", dir2);
    const char *slow[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set", ck2,
                          "--x-slow-ckpt-ms", "5000", "--stop-after-epoch", "2", NULL};
    run_t e, g;
    train(&e, "slowhalf", 2, slow, 300);
    cr_assert_eq(e.psd_code, 0);
    char *l = slurp(e.psd_log);
    const char *stopping = strstr(l, "stopping after epoch 2"), *c24 = strstr(l, "ckpt-000000000024.psdc: ");
    cr_assert(stopping && c24 && stopping < c24 && strstr(l, "ckpt-000000000048.psdc: "),
              "epoch 2 ended while step 24's checkpoint was written, then step 48's was: %s", l);
    free(l);
    const char *rest2[] = {"--epochs", "3", "--set", "data.train_limit=3000", "--seed", "11", "--set", ck2,
                           "--resume", dir2, NULL};
    train(&g, "slowrest", 2, rest2, 300);
    cr_assert_eq(g.psd_code, 0);
    cr_assert(weights_equal(a.weights, g.weights), "resumed from the epoch's end: bit-identical weights");
    /* resumed once more at its end: nothing to train, and the weights file is the same, its
     * header (step, last epoch trained) included */
    run_t d;
    pid_t p = start_psd(&d, "atend1", 2, second);
    cr_assert_eq(proc_wait(p, 60), 0);
    l = slurp(d.psd_log);
    cr_assert(l && strstr(l, "nothing to train"), "%s", l ? l : "");
    free(l);
    cr_assert(weights_equal(a.weights, d.weights), "the weights file of a resume at the end = the run's");
    /* and another config is refused */
    cr_assert_eq(run_cmd("'%s' --resume '%s' --set optimizer.lr=0.5 --set '%s' --check-config > /dev/null 2>&1",
                         psd_bin, dirbuf, ck), 2);
    cr_assert_eq(run_cmd("'%s' --resume '%s' --set optimizer.lr=0.5 --force-resume --set data.train_limit=3000 "
                         "--seed 11 --check-config > /dev/null 2>&1", psd_bin, dirbuf), 0);
}

/* Both workers of run <tag> (--verbose) say the table stayed on psd and was
 * never sent whole, and that `also` */
static void assert_table_stayed(const char *tag, const char *also)
{
    for (int i = 0; i < 2; i++) {
        char wlog[512];
        snprintf(wlog, sizeof wlog, "%s/%s-w%d.log", dir, tag, i);
        char *log = slurp(wlog);
        cr_assert(log && strstr(log, also) && strstr(log, "the table stayed on psd") && strstr(log, "whole 0 times"),
                  "worker %d: %s", i, log ? log : "");
        free(log);
    }
}

/* The click-through model trained with SGD (plain, and with momentum), its
 * table's gradient pushed as rows and forced whole (train.sparse_threshold=0):
 * the same weights, bit for bit, and only the rows' bytes on the wire. */
Test(short, sparse_and_dense_table_pushes_give_the_same_weights_with_sgd)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *mom[] = {"optimizer.momentum=0", "optimizer.momentum=0.9"};
    const char *wex[] = {"--no-shm", NULL};
    for (int o = 0; o < 2; o++) {
        const char *args[24] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                                "--set", "checkpoint.dir=", "--set", "optimizer.name=sgd", "--set",
                                "optimizer.lr=0.1", "--set", "optimizer.weight_decay=0", "--set", mom[o]};
        int n = 18;
        run_t a, b;
        char ta[16], tb[16];
        snprintf(ta, sizeof ta, "sgdrows%d", o);
        snprintf(tb, sizeof tb, "sgdwhole%d", o);
        args[n] = NULL;
        train_wx(&a, ta, 2, args, wex, 300);
        args[n] = "--set";
        args[n + 1] = "train.sparse_threshold=0";
        args[n + 2] = NULL;
        train_wx(&b, tb, 2, args, wex, 300);
        cr_assert(a.psd_code == 0 && b.psd_code == 0, "psd exit %d / %d", a.psd_code, b.psd_code);
        cr_assert(weights_equal(a.weights, b.weights), "%s: rows = whole table, bit for bit", mom[o]);
        char *ma = metrics_last(&a), *mb = metrics_last(&b);
        const char *la = last_line(ma), *lb = last_line(mb);
        cr_assert_eq(json_num(la, "table_row_pushes"), 2 * 40, "every push as rows: %s", la);
        cr_assert_eq(json_num(lb, "table_row_pushes"), 0, "%s", lb);
        cr_assert_lt(json_num(la, "wire_bytes_in") * 10, json_num(lb, "wire_bytes_in"), "rows: %s\nwhole: %s", la, lb);
        cr_assert_eq(json_num(la, "val_loss"), json_num(lb, "val_loss"));
        free(ma);
        free(mb);
    }
}

/* The embedding table's gradient goes as the rows a batch touched when
 * they are few (train.sparse_threshold, default 0.3 of the table), and the
 * reply brings only the rows the next batch reads: the weights are bit for
 * bit those of whole-table pushes and pulls (psd steps a table-sized
 * gradient that is zero elsewhere; the worker's batch reads only rows it
 * was sent), and the bytes follow the rows: every push is the MLP's tensors
 * plus 4 + 4 x dim bytes per row and 4 per row wanted, every reply the
 * MLP's plus 4 x dim per row, where the whole table is 4 x rows x dim.
 * Over the wire (on shared memory the table is not sent). */
Test(short, table_rows_and_whole_table_pushes_give_the_same_weights)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *sparse[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                            "--set", "checkpoint.dir=", NULL};
    const char *dense[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                           "--set", "checkpoint.dir=", "--set", "train.sparse_threshold=0", NULL};
    const char *wex[] = {"--no-shm", NULL};
    run_t a, b;
    train_wx(&a, "rows", 2, sparse, wex, 300);
    train_wx(&b, "whole", 2, dense, wex, 300);
    cr_assert_eq(a.psd_code, 0);
    cr_assert_eq(b.psd_code, 0);
    cr_assert(weights_equal(a.weights, b.weights), "rows = whole table, bit for bit");
    char *ma = metrics_last(&a), *mb = metrics_last(&b);
    const char *la = last_line(ma), *lb = last_line(mb);
    /* the model: 64 -> 64 -> 2 (4290 floats) and a table of 65536 x 8 */
    const double mlp = 4.0 * 4290, table = 4.0 * 65536 * 8, row = 4 + 4 * 8;
    double pushes = json_num(la, "table_row_pushes"), rows = json_num(la, "table_rows_in");
    cr_assert_eq(pushes, 2 * 40, "every push of the epoch as rows (2 workers x 40 batches): %s", la);
    cr_assert(rows > pushes && rows < 0.3 * 65536 * pushes, "%s", la);
    /* replies: the rows the next batch reads (asked for in the push: 4 bytes a row), but for
     * the epoch's first weights, its last (partial) batch's and the validation's, which bring
     * the whole table */
    double replies = json_num(la, "table_row_replies"), out = json_num(la, "table_rows_out");
    cr_assert_eq(json_num(la, "wire_bytes_in"), pushes * mlp + rows * row + out * 4, "%s", la);
    cr_assert_eq(json_num(lb, "table_row_pushes"), 0, "%s", lb);
    cr_assert_eq(json_num(lb, "wire_bytes_in"), pushes * (mlp + table), "%s", lb);
    cr_assert(replies >= 2 * 37 && out < 0.3 * 65536 * replies, "%s", la);
    double whole = (json_num(la, "wire_bytes_out") - replies * mlp - out * (row - 4)) / (mlp + table);
    cr_assert(whole == floor(whole) && whole >= 2 && whole <= 3 * 2, "%g whole-table sends: %s", whole, la);
    cr_assert_eq(json_num(lb, "table_row_replies"), 0, "%s", lb);
    /* the table on psd (ctr.worker_table_mb=0; workers may use shared memory: psd offers none
     * then): the same bits, and the table never goes whole: every reply brings the rows asked
     * for (the epoch's first and the partial batch's too), each validation part the rows of
     * its range (4 bytes of id more a row) */
    const char *onpsd[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                           "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    run_t c;
    const char *verbose[] = {"--verbose", NULL};
    train_wx(&c, "onpsd", 2, onpsd, verbose, 300);
    cr_assert_eq(c.psd_code, 0);
    cr_assert(weights_equal(a.weights, c.weights), "the table on psd = a replica on each worker, bit for bit");
    char *mc = metrics_last(&c);
    const char *lc = last_line(mc);
    double rc = json_num(lc, "table_row_replies"), oc = json_num(lc, "table_rows_out");
    cr_assert_eq(json_num(lc, "table_row_pushes"), 2 * 40, "%s", lc);
    cr_assert_eq(rc, 2 * 39 + 2, "every reply as rows, the epoch's first included: %s", lc);
    double val_ids = json_num(lc, "wire_bytes_out") - (rc + 2) * mlp - oc * (row - 4);
    cr_assert(val_ids > 0 && val_ids < 4 * oc && fmod(val_ids, 4) == 0,
              "two validation parts with their rows, no whole table (%g): %s", val_ids, lc);
    cr_assert_eq(json_num(lc, "val_loss"), json_num(la, "val_loss"), "the same validation: %s", lc);
    cr_assert_eq(json_num(lc, "val_auc"), json_num(la, "val_auc"), "%s", lc);
    assert_table_stayed("onpsd", "the table stayed on psd");
    char *plog = slurp(c.psd_log);
    cr_assert(plog && strstr(plog, "stays on psd") && !strstr(plog, "shared memory for workers"), "%s", plog);
    free(plog);
    /* device workers (the CPU backend posing as one: uploads, downloads), table replicas and the
     * table on psd: the same bits, every push as rows */
    const char *dev_wire[] = {"--x-device-sim", "--no-shm", NULL}, *dev[] = {"--x-device-sim", "--verbose", NULL};
    run_t e;
    train_wx(&e, "rows-dev", 2, sparse, dev_wire, 300);
    cr_assert_eq(e.psd_code, 0);
    cr_assert(weights_equal(a.weights, e.weights), "device workers' rows = the CPU's, bit for bit");
    char *me = metrics_last(&e);
    cr_assert_eq(json_num(last_line(me), "table_row_pushes"), 2 * 40, "%s", last_line(me));
    cr_assert_eq(json_num(last_line(me), "val_loss"), json_num(la, "val_loss"), "%s", last_line(me));
    free(me);
    /* and its replica crosses the bus by the rows of a step, not whole: up, the rows the batch
     * reads (ids and values), the MLP and the batch (the whole table only for the 2 validations);
     * down, the MLP's gradient and the touched rows' (at most 256 x 8 rows of 32 bytes a step) */
    double up, down, steps;
    char *dl = rank0_log("rows-dev", 2);
    const char *dc = dl ? strstr(dl, "device copies: ") : NULL;
    cr_assert(dc && sscanf(dc, "device copies: %lf bytes up, %lf bytes down; %lf training steps", &up, &down, &steps) == 3,
              "%s", dl ? dl : "no log");
    cr_assert(steps == 80 && down > 0 && down < steps * (mlp + 2048 * 32), "down %g in %g steps", down, steps);
    cr_assert(up > 2 * table && up < 2 * table + steps * (mlp + 4 * 256 + 8 * 256 * 4 + 2048 * 36),
              "up %g in %g steps (a whole table is %g)", up, steps, table);
    free(dl);
    /* on psd's host (shared memory: the whole table in psd's slot, gradients pushed whole): the
     * same bits, and still only the batch's rows go up */
    train_wx(&e, "rows-dev-shm", 2, sparse, dev, 300);
    cr_assert_eq(e.psd_code, 0);
    cr_assert(weights_equal(a.weights, e.weights), "device workers through shared memory, bit for bit");
    dl = rank0_log("rows-dev-shm", 2);
    dc = dl ? strstr(dl, "device copies: ") : NULL;
    cr_assert(dc && sscanf(dc, "device copies: %lf bytes up, %lf bytes down; %lf training steps", &up, &down, &steps) == 3,
              "%s", dl ? dl : "no log");
    cr_assert(steps == 80 && up < 2 * table + steps * (mlp + 4 * 256 + 8 * 256 * 4 + 2048 * 36),
              "up %g in %g steps (a whole table is %g)", up, steps, table);
    cr_assert(strstr(dl, "pushed as rows 0 times, whole 80 times"), "%s", dl);
    free(dl);
    dl = slurp(e.psd_log);
    cr_assert(dl && strstr(dl, "rank 0 exchanges tensors with psd through shared memory"), "%s", dl ? dl : "");
    free(dl);
    train_wx(&e, "onpsd-dev", 2, onpsd, dev, 300);
    cr_assert_eq(e.psd_code, 0);
    cr_assert(weights_equal(c.weights, e.weights), "device workers with the table on psd, bit for bit");
    me = metrics_last(&e);
    cr_assert_eq(json_num(last_line(me), "val_loss"), json_num(lc, "val_loss"), "%s", last_line(me));
    cr_assert_eq(json_num(last_line(me), "val_auc"), json_num(lc, "val_auc"), "%s", last_line(me));
    cr_assert_eq(json_num(last_line(me), "table_row_replies"), rc, "%s", last_line(me));
    free(me);
    assert_table_stayed("onpsd-dev", "backend cpu-as-device");
    /* asked for streamed steps, psd steps whole so that the table still goes by rows */
    const char *streamed[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                              "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", "--set",
                              "train.stream=true", NULL};
    run_t d;
    train_wx(&d, "onpsd-st", 2, streamed, NULL, 300);
    cr_assert_eq(d.psd_code, 0);
    cr_assert(weights_equal(c.weights, d.weights), "train.stream changes nothing with a table");
    char *md = metrics_last(&d);
    cr_assert_eq(json_num(last_line(md), "table_row_replies"), rc, "%s", last_line(md));
    free(md);
    plog = slurp(d.psd_log);
    cr_assert(plog && strstr(plog, "steps are whole (not streamed)") && strstr(plog, "stays on psd") &&
                  !strstr(plog, "streamed steps:"),
              "%s", plog);
    free(plog);
    free(mc);
    free(ma);
    free(mb);
}

/* The table on psd (ctr.worker_table_mb=0) with 2 psd shards: each shard
 * keeps its piece of the table, and workers hold only the rows of their
 * batch, put together from every shard's: the same bits, the same
 * validation as one psd; shard 1 (the table's rows 32768.. and nothing
 * else) sends only rows, each asked for; shard 0 sends the MLP and rows of
 * its piece, and the ids of a validation part's rows with its part. Device
 * workers (the CPU backend posing as one) give the same bits. */
Test(short, the_table_on_psd_with_psd_shards)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *args[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", NULL};
    const char *wex[] = {"--no-shm", "--verbose", NULL};
    run_t a, b;
    train_ok(&a, "onpsd1", 1, args, wex);
    train_ok(&b, "onpsd2", 2, args, wex);
    cr_assert(weights_equal(a.weights, b.weights), "the table on 2 psd shards = on 1 psd, bit for bit");
    assert_table_stayed("onpsd2", "the table stayed on psd");
    /* device workers (the CPU backend posing as one: uploads, downloads): the same bits */
    const char *dev[] = {"--x-device-sim", "--no-shm", "--verbose", NULL};
    run_t d;
    train_ok(&d, "onpsd2-dev", 2, args, dev);
    cr_assert(weights_equal(a.weights, d.weights), "device workers, the table on 2 psd shards, bit for bit");
    assert_table_stayed("onpsd2-dev", "backend cpu-as-device");
    char *ma = metrics_last(&a), *mb = metrics_last(&b);
    const char *la = last_line(ma), *lb = last_line(mb);
    cr_assert_eq(json_num(lb, "val_loss"), json_num(la, "val_loss"), "the same validation: %s", lb);
    cr_assert_eq(json_num(lb, "val_auc"), json_num(la, "val_auc"), "%s", lb);
    cr_assert_eq(json_num(lb, "val_samples"), 2000, "%s", lb);
    /* shard 0: every reply as rows (of its piece), the validation parts with their rows' ids */
    const double mlp = 4.0 * 4290, row = 4 + 4 * 8;
    double rc = json_num(lb, "table_row_replies"), oc = json_num(lb, "table_rows_out");
    cr_assert_eq(rc, json_num(la, "table_row_replies"), "every reply as rows: %s", lb);
    cr_assert(oc > 0 && oc < json_num(la, "table_rows_out"), "shard 0 sends the rows of its piece only: %s", lb);
    double val_ids = json_num(lb, "wire_bytes_out") - (rc + 2) * mlp - oc * (row - 4);
    cr_assert(val_ids > 0 && val_ids < 4 * 2000 * 8 && fmod(val_ids, 4) == 0,
              "two validation parts with their rows' ids, no whole table (%g): %s", val_ids, lb);
    /* shard 1: rows only, those asked for */
    char lp[256];
    path(lp, sizeof lp, "onpsd2-shard1.log");
    char *l1 = slurp(lp);
    const char *p = l1 ? strstr(l1, "shard 1 received: ") : NULL;
    double got[5];
    cr_assert(p && sscanf(p, "shard 1 received: %lf gradient bytes, %lf pushes of table rows (%lf rows); sent %lf rows "
                             "in replies, %lf weights bytes",
                          &got[0], &got[1], &got[2], &got[3], &got[4]) == 5,
              "%s", l1 ? l1 : "no log");
    cr_assert(got[3] > 0 && got[4] == got[3] * (row - 4), "shard 1 sent %g rows in %g bytes: nothing else", got[3],
              got[4]);
    cr_assert_eq(got[1], 2 * 2 * 40, "shard 1: every push as rows");
    free(l1);
    free(ma);
    free(mb);
}

/* The table on psd with a worker killed mid-epoch: the others take its
 * samples (the batches they had asked rows for may grow: they ask again),
 * every epoch trains each example once and validates every test example;
 * with one psd and with 2 psd shards. */
Test(short, killed_worker_with_the_table_on_psd)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *args[] = {"--config", cfg, "--epochs", "3", "--set", "ctr.train=60000", "--set", "ctr.test=3000",
                          "--set", "checkpoint.dir=", "--set", "ctr.worker_table_mb=0", "--worker-timeout", "2",
                          "--set", "train.batch_size=100", NULL};
    for (int shards = 1; shards <= 2; shards++) { /* one psd, and 2 psd shards */
        run_t r;
        kill_one_mid_epoch(&r, shards > 1 ? "k9psd2" : "k9psd", args, shards);
        char *m = metrics_last(&r);
        cr_assert_eq(count_lines(m), 3, "%s", m);
        for (char *line = m; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = '\0';
            cr_assert_eq(json_num(line, "train_samples"), 60000, "%d shards: %s", shards, line);
            cr_assert_eq(json_num(line, "val_samples"), 3000, "%s", line);
            double opt = json_num(line, "optimum_loss"), cst = json_num(line, "constant_loss");
            cr_assert_lt(json_num(line, "val_loss") - opt, 0.8 * (cst - opt), "trained: %s", line);
            line = nl ? nl + 1 : NULL;
        }
        free(m);
    }
}

/* Table rows both ways in async and ssp (each push stepped on its own and
 * answered at once, or held back): the run trains as in bsp. */
Test(short, table_rows_in_async_and_ssp)
{
    char cfg[1024];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    const char *modes[] = {"train.sync=async", "train.sync=ssp"};
    const char *wex[] = {"--no-shm", NULL};
    for (int k = 0; k < 2; k++) {
        const char *args[] = {"--config", cfg, "--epochs", "2", "--set", "ctr.train=40000", "--set", "ctr.test=4000",
                              "--set", "checkpoint.dir=", "--set", modes[k], NULL};
        run_t r;
        train_wx(&r, k ? "rowsssp" : "rowsasync", 2, args, wex, 300);
        cr_assert_eq(r.psd_code, 0, "%s", modes[k]);
        char *m = metrics_last(&r);
        const char *l = last_line(m);
        cr_assert_gt(json_num(l, "table_row_pushes"), 100, "%s: %s", modes[k], l);
        cr_assert_gt(json_num(l, "table_row_replies"), 100, "%s: %s", modes[k], l);
        double opt = json_num(l, "optimum_loss"), cst = json_num(l, "constant_loss");
        cr_assert_lt(json_num(l, "val_loss") - opt, 0.6 * (cst - opt), "%s: %s", modes[k], l);
        free(m);
    }
}

/* The ctr model's embedding table is checkpointed and restored with the
 * rest (checkpoint format 2 carries its shape): stopped after epoch 2 and
 * resumed, the run ends with the weights of one that never stopped. */
Test(short, ctr_stopped_and_resumed_gives_identical_weights)
{
    char cfg[1024], ck[300], dirbuf[256];
    snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *plain[] = {"--config", cfg, "--epochs", "3", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                           "--set", "checkpoint.dir=", NULL};
    const char *first[] = {"--config", cfg, "--epochs", "3", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                           "--set", ck, "--stop-after-epoch", "2", NULL};
    const char *second[] = {"--config", cfg, "--epochs", "3", "--set", "ctr.train=20000", "--set", "ctr.test=2000",
                            "--set", ck, "--resume", dirbuf, NULL};
    run_t a, b, c;
    train(&a, "ctrfull", 2, plain, 300);
    cr_assert_eq(a.psd_code, 0);
    train(&b, "ctrhalf", 2, first, 300);
    cr_assert_eq(b.psd_code, 0, "stop after epoch 2 exits 0");
    train(&c, "ctrrest", 2, second, 300);
    cr_assert_eq(c.psd_code, 0);
    char *log = slurp(c.psd_log);
    cr_assert(strstr(log, "resum"), "%s", log);
    free(log);
    cr_assert(weights_equal(a.weights, c.weights), "resumed ctr run ends with bit-identical weights, table included");
}

Test(short, corrupt_newest_checkpoint_falls_back_to_the_previous)
{
    run_t r;
    char ck[300], dirbuf[256], out[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    path(out, sizeof out, "resume.txt");
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=2000", "--set", ck, NULL};
    train(&r, "cc", 1, args, 300);
    check_run(&r, 1, 3);
    const char *cfg = "--set data.train_limit=2000 --epochs 3";
    /* flip a byte in the middle of the newest */
    cr_assert_eq(run_cmd("f=$(ls '%s'/run-*/ckpt-*.psdc | tail -1); printf '\\x55' | dd of=\"$f\" bs=1 seek=5000 "
                         "conv=notrunc status=none", dirbuf), 0);
    cr_assert_eq(run_cmd("'%s' %s --resume '%s' --check-config > '%s' 2>&1", psd_bin, cfg, dirbuf, out), 0);
    char *t = slurp(out);
    cr_assert(strstr(t, "checksum") || strstr(t, "CRC") || strstr(t, "corrupt"), "says why: %s", t);
    cr_assert(strstr(t, "epoch 2"), "uses the previous one (epoch 2): %s", t);
    free(t);
    /* truncate the next one too */
    cr_assert_eq(run_cmd("f=$(ls '%s'/run-*/ckpt-*.psdc | tail -2 | head -1); truncate -s 1000 \"$f\"", dirbuf), 0);
    cr_assert_eq(run_cmd("'%s' %s --resume '%s' --check-config > '%s' 2>&1", psd_bin, cfg, dirbuf, out), 0);
    t = slurp(out);
    cr_assert(strstr(t, "epoch 1"), "falls back twice: %s", t);
    free(t);
}

Test(short, sigint_on_psd_checkpoints_and_stops_the_workers)
{
    run_t r;
    char ck[300], dirbuf[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *args[] = {"--epochs", "50", "--set", "data.train_limit=12000", "--set", ck, NULL};
    pid_t p = start_psd(&r, "int", 2, args);
    pid_t w0 = start_worker(&r, "int", 0, NULL), w1 = start_worker(&r, "int", 1, NULL);
    wait_metrics(&r, 1);
    kill(p, SIGINT);
    cr_assert_eq(proc_wait(p, 60), 0, "psd exits 0 after SIGINT");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "checkpoint "), "%s", log);
    free(log);
    cr_assert_eq(run_cmd("'%s' --epochs 50 --set data.train_limit=12000 --resume '%s' --check-config > /dev/null",
                         psd_bin, dirbuf), 0, "the checkpoint loads");
}

Test(long, psd_killed_while_writing_checkpoints_always_resumes)
{
    /* checkpoints of a 2.9M-parameter Adam model every step: psd spends most
     * of its time writing; kill -9 it at 20 random moments, each time the
     * newest complete checkpoint must load */
    fault_seed();
    char ck[300], dirbuf[256], out[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    path(out, sizeof out, "check.txt");
    const char *args[] = {"--epochs", "1000", "--set", "data.train_limit=6400", "--set", ck, "--set",
                          "model.layers=784,2048,640,10", "--set", "optimizer.name=adam", "--set",
                          "optimizer.lr=0.001", "--set", "checkpoint.every_steps=1", "--set",
                          "checkpoint.keep=2", NULL};
    int loaded = 0;
    for (int round = 0; round < 20; round++) {
        run_t r;
        char tag[16];
        snprintf(tag, sizeof tag, "kc%d", round);
        const char *a2[40];
        int n = 0;
        for (int i = 0; args[i]; i++) a2[n++] = args[i];
        if (round > 0) {
            a2[n++] = "--resume";
            a2[n++] = dirbuf;
        }
        a2[n] = NULL;
        pid_t p = start_psd(&r, tag, 1, a2);
        const char *wx[] = {"--retry-for", "0", NULL};
        pid_t w = start_worker(&r, tag, 0, wx);
        char psdlog[256];
        snprintf(psdlog, sizeof psdlog, "%s", r.psd_log);
        if (round == 0) wait_log(psdlog, "checkpoint ", 60); /* one complete checkpoint first */
        else wait_log(psdlog, "resuming run", 60);
        zmq_poll(NULL, 0, 50 + rand() % 400);
        kill(p, SIGKILL);
        proc_wait(p, 10);
        kill(w, SIGKILL);
        proc_wait(w, 10);
        int rc = run_cmd("'%s' --set data.train_limit=6400 --epochs 1000 --set model.layers=784,2048,640,10 "
                         "--set optimizer.name=adam --set optimizer.lr=0.001 --resume '%s' --check-config > '%s' 2>&1",
                         psd_bin, dirbuf, out);
        char *t = slurp(out);
        cr_assert_eq(rc, 0, "round %d: the newest complete checkpoint loads: %s", round, t);
        free(t);
        loaded++;
    }
    cr_assert_eq(loaded, 20);
}

Test(short, a_worker_of_another_run_is_refused)
{
    run_t r;
    const char *args[] = {"--epochs", "200", "--set", "data.train_limit=3000", "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "ar", 1, args);
    const char *wx[] = {"--retry-for", "60", NULL};
    pid_t w = start_worker(&r, "ar", 0, wx);
    wait_metrics(&r, 1);
    kill(p, SIGKILL);
    proc_wait(p, 10);
    /* a new run (not a resume) on the same endpoint: the worker belongs to the old one */
    char log2[256];
    path(log2, sizeof log2, "ar2-psd.log");
    const char *argv[] = {psd_bin, "--listen", r.endpoint, "--workers", "1", "--set", "checkpoint.dir=",
                          "--metrics", "", "--start-timeout", "60", NULL};
    pid_t p2 = proc_spawn(argv, log2);
    cr_assert_eq(proc_wait(w, 60), 2, "the old run's worker is refused and exits 2");
    char wlog[256];
    path(wlog, sizeof wlog, "ar-w0.log");
    char *t = slurp(wlog);
    cr_assert(strstr(t, "belongs to run"), "a clear message: %s", t);
    free(t);
    wait_log(log2, "the worker belongs to run", 10);
    kill(p2, SIGUSR1); /* and SIGUSR1 on an idle psd is harmless */
    kill(p2, SIGTERM);
    cr_assert_eq(proc_wait(p2, 30), 0);
}

Test(short, sigusr1_writes_a_checkpoint_and_training_goes_on)
{
    run_t r;
    char ck[300], dirbuf[256];
    ckpt_dir_arg(ck, sizeof ck);
    path(dirbuf, sizeof dirbuf, "ckpt");
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=12000", "--set", ck, "--set",
                          "checkpoint.every_epochs=0", NULL};
    pid_t p = start_psd(&r, "usr1", 1, args);
    pid_t w = start_worker(&r, "usr1", 0, NULL);
    wait_metrics(&r, 1);
    kill(p, SIGUSR1);
    wait_log(r.psd_log, "checkpoint ", 30);
    cr_assert_eq(proc_wait(p, 300), 0, "training went on to the end");
    cr_assert_eq(proc_wait(w, 30), 0);
    check_every_epoch(&r, 3, 12000);
    cr_assert_eq(run_cmd("'%s' --epochs 3 --set data.train_limit=12000 --resume '%s' --check-config > /dev/null",
                         psd_bin, dirbuf), 0);
}

Test(short, a_second_sigint_exits_at_once)
{
    /* a 20M-parameter Adam model: the first SIGINT's checkpoint takes a
     * while, the second one must not wait for it */
    run_t r;
    char ck[300];
    ckpt_dir_arg(ck, sizeof ck);
    const char *args[] = {"--epochs", "5", "--set", "data.train_limit=640", "--set", ck, "--set",
                          "model.layers=784,4096,4096,10", "--set", "optimizer.name=adam", "--set",
                          "checkpoint.every_epochs=0", NULL};
    pid_t p = start_psd(&r, "int2", 1, args);
    pid_t w = start_worker(&r, "int2", 0, NULL);
    wait_log(r.psd_log, "1 workers ready", 60);
    zmq_poll(NULL, 0, 300);
    kill(p, SIGINT);
    /* two signals sent close together can reach psd as one (standard signals
     * do not queue), or as an echo of one (the same within PS_SIGNAL_ECHO_S,
     * as timeout(1) sends it): the second goes once psd has taken the first,
     * and 0.2 s after it */
    wait_log(r.psd_log, "writing a checkpoint", 30);
    zmq_poll(NULL, 0, 200);
    kill(p, SIGINT);
    int code = proc_wait(p, 30);
    cr_assert_eq(code, 128 + SIGINT, "the second SIGINT exits at once, during the 240 MB checkpoint (%d)", code);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "again: exiting now"), "%s", log);
    free(log);
    /* and the workers were told: they do not wait for psd to come back */
    proc_wait(w, 30);
    char wlog[256];
    path(wlog, sizeof wlog, "int2-w0.log");
    char *wl = slurp(wlog);
    cr_assert(wl && strstr(wl, "psd ended the run"), "the worker heard of the stop: %s", wl ? wl : "");
    free(wl);
}

/* ---- authentication (CurveZMQ + allow-list) ------------------------------ */

static void keygen(const char *name)
{
    cr_assert_eq(run_cmd("cd '%s' && '%s' keygen %s > /dev/null", dir, psd_bin, name), 0, "keygen %s", name);
}

/* pworker with keys against psd at r->endpoint; returns its exit code. */
static int keyed_worker(run_t *r, const char *tag, const char *key, const char *server_pub, double wait_s)
{
    char log[256], k[256], sp[256];
    snprintf(log, sizeof log, "%s/%s.log", dir, tag);
    snprintf(k, sizeof k, "%s/%s", dir, key ? key : "");
    snprintf(sp, sizeof sp, "%s/%s", dir, server_pub ? server_pub : "");
    /* how long the worker waits for psd: 20 s, or a third of wait_s when
     * that is shorter (a test that expects no answer) */
    char wait[16];
    snprintf(wait, sizeof wait, "%.0f", wait_s >= 60 ? 20.0 : wait_s / 3);
    const char *argv[16] = {pworker_bin, "--connect", r->endpoint, "--devices", "cpu", "--wait", wait};
    int n = 7;
    if (key) {
        argv[n++] = "--key";
        argv[n++] = k;
        argv[n++] = "--server-key";
        argv[n++] = sp;
    }
    argv[n] = NULL;
    pid_t w = proc_spawn(argv, log);
    return proc_wait(w, wait_s);
}

Test(short, keygen_writes_a_private_secret_key)
{
    keygen("a");
    cr_assert_eq(run_cmd("cd '%s' && test \"$(stat -c %%a a.key)\" = 600 && test \"$(stat -c %%a a.pub)\" = 644 && "
                         "test $(head -c 40 a.pub | wc -c) = 40", dir), 0);
    cr_assert_eq(run_cmd("cd '%s' && '%s' keygen a > /dev/null 2>&1", dir, psd_bin), 2, "never overwrites a key");
    keygen("srv");
    cr_assert_eq(run_cmd("chmod 644 '%s/a.key'", dir), 0);
    char out[256];
    path(out, sizeof out, "perm.txt");
    cr_assert_eq(run_cmd("'%s' --connect tcp://127.0.0.1:9 --devices cpu --key '%s/a.key' --server-key '%s/srv.pub' "
                         "> '%s' 2>&1", pworker_bin, dir, dir, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "readable by others") && strstr(t, "chmod 600"), "clear message: %s", t);
    free(t);
    cr_assert_eq(run_cmd("mkdir -p '%s/allow' && chmod 644 '%s/srv.key' && '%s' --key '%s/srv.key' --allow '%s/allow' "
                         "--listen tcp://127.0.0.1:9 > '%s' 2>&1", dir, dir, psd_bin, dir, dir, out), 2,
                 "psd refuses a world-readable secret key too");
}

/* srv.key/.pub, and DIR/allow holding allowed.pub (NULL: empty); fills the
 * --key and --allow arguments. */
static void auth_setup(const char *allowed, char *key, char *allow, size_t n)
{
    keygen("srv");
    cr_assert_eq(run_cmd("mkdir -p '%s/allow'", dir), 0);
    if (allowed) cr_assert_eq(run_cmd("cp '%s/%s.pub' '%s/allow/'", dir, allowed, dir), 0);
    snprintf(key, n, "%s/srv.key", dir);
    snprintf(allow, n, "%s/allow", dir);
}

Test(short, only_allow_listed_keys_get_in)
{
    keygen("good");
    keygen("bad");
    keygen("other");
    run_t r;
    char key[300], allow[300];
    auth_setup("good", key, allow, sizeof key);
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--key", key, "--allow", allow,
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "auth", 1, args);
    cr_assert_eq(keyed_worker(&r, "w-bad", "bad.key", "srv.pub", 60), 2, "unknown key refused");
    cr_assert_eq(keyed_worker(&r, "w-plain", NULL, NULL, 60), 2, "client without encryption refused");
    cr_assert_eq(keyed_worker(&r, "w-wrongsrv", "good.key", "other.pub", 60), 2, "wrong server key refused");
    char wlog[256];
    path(wlog, sizeof wlog, "w-bad.log");
    char *t = slurp(wlog);
    cr_assert(strstr(t, "authentication failed"), "%s", t);
    free(t);
    cr_assert_eq(keyed_worker(&r, "w-good", "good.key", "srv.pub", 120), 0, "the allowed worker trains");
    cr_assert_eq(proc_wait(p, 60), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "refused a client from 127.0.0.1: key not in the allow-list"), "address logged: %s", log);
    cr_assert(strstr(log, "handshake failed"), "plain and wrong-server-key clients logged: %s", log);
    free(log);
    assert_validated_all(&r);
}

/* With keys, psd shards share shard 0's key pair and allow-list: shard 1
 * joins with it, an allowed worker trains through both, a worker with a
 * key not in the list gets into neither. */
Test(short, psd_shards_with_keys)
{
    keygen("good");
    keygen("bad");
    char key[300], allow[300];
    auth_setup("good", key, allow, sizeof key);
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--key", key, "--allow", allow,
                          "--set", "checkpoint.dir=", "--shard", "0/2", NULL};
    const char *fargs[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--key", key, "--allow", allow, "--set",
                           "checkpoint.dir=", NULL};
    run_t r;
    pid_t p = start_psd(&r, "kshard", 1, args);
    { /* an allowed worker's key claiming to be shard 1 is refused */
        ps_keypair_t kp;
        char spub[PS_Z85_LEN], err[256], kf[300], sf[300];
        snprintf(kf, sizeof kf, "%s/good.key", dir);
        snprintf(sf, sizeof sf, "%s/srv.pub", dir);
        cr_assert_eq(ps_auth_load_secret(kf, &kp, err, sizeof err), 0, "%s", err);
        cr_assert_eq(ps_auth_load_public(sf, spub, err, sizeof err), 0, "%s", err);
        void *ctx = zmq_ctx_new(), *d = zmq_socket(ctx, ZMQ_DEALER);
        int zero = 0, tmo = 20000;
        zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
        zmq_setsockopt(d, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
        zmq_setsockopt(d, ZMQ_CURVE_SERVERKEY, spub, 40);
        zmq_setsockopt(d, ZMQ_CURVE_PUBLICKEY, kp.public_z85, 40);
        zmq_setsockopt(d, ZMQ_CURVE_SECRETKEY, kp.secret_z85, 40);
        cr_assert_eq(zmq_connect(d, r.endpoint), 0);
        Psd__Header h;
        Psd__ShardHello b = PSD__SHARD_HELLO__INIT;
        psd__header__init(&h);
        h.type = PSD__MSG_TYPE__MSG_SHARD_HELLO;
        b.shard = 1;
        b.shards = 2;
        b.endpoint = "tcp://127.0.0.1:1";
        h.body_case = PSD__HEADER__BODY_SHARD_HELLO;
        h.shard_hello = &b;
        cr_assert_eq(ps_msg_send(d, NULL, 0, &h, NULL, 0), 0);
        ps_msg_t m;
        cr_assert_eq(ps_msg_recv(d, &m, false, 0, err, sizeof err), 0, "an answer");
        cr_assert_eq(m.hdr->type, PSD__MSG_TYPE__MSG_ERROR);
        cr_assert(strstr(m.hdr->error->message, "psd's own key"), "%s", m.hdr->error->message);
        ps_msg_deinit(&m);
        zmq_close(d);
        zmq_ctx_term(ctx);
    }
    pid_t f = start_shard(&r, "kshard", 1, 2, fargs);
    cr_assert_eq(keyed_worker(&r, "w-bad", "bad.key", "srv.pub", 60), 2, "unknown key refused");
    cr_assert_eq(keyed_worker(&r, "w-good", "good.key", "srv.pub", 120), 0, "the allowed worker trains");
    cr_assert_eq(proc_wait(p, 60), 0);
    cr_assert_eq(proc_wait(f, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "psd shard 1/2 joined"), "%s", log);
    free(log);
    assert_validated_all(&r);
}

Test(short, no_authentication_handler_means_nobody_gets_in)
{
    keygen("good");
    run_t r;
    char key[300], allow[300];
    auth_setup("good", key, allow, sizeof key);
    const char *args[] = {"--key", key, "--allow", allow, "--x-no-zap", "--start-timeout", "30", NULL};
    pid_t p = start_psd(&r, "nozap", 1, args);
    int code = keyed_worker(&r, "w-good", "good.key", "srv.pub", 15);
    cr_assert(code == 2 || code == 4, "even an allowed key gets no answer (exit 2 refused, or 4 nothing for 5 s): %d",
              code);
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 30), 0);
    char *log = slurp(r.psd_log);
    cr_assert_null(strstr(log, "worker registered"), "nobody got in: %s", log);
    cr_assert(strstr(log, "handshake failed"), "the refusal is logged: %s", log);
    free(log);
}

Test(short, sighup_reloads_the_allow_list)
{
    keygen("late");
    run_t r;
    char key[300], allow[300];
    auth_setup(NULL, key, allow, sizeof key);
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--key", key, "--allow", allow,
                          "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "hup", 1, args);
    cr_assert_eq(keyed_worker(&r, "w-early", "late.key", "srv.pub", 60), 2, "not allowed yet");
    cr_assert_eq(run_cmd("cp '%s/late.pub' '%s/allow/'", dir, dir), 0);
    kill(p, SIGHUP);
    wait_log(r.psd_log, "reloaded 1 allowed worker key", 10);
    cr_assert_eq(keyed_worker(&r, "w-late", "late.key", "srv.pub", 120), 0, "allowed after SIGHUP");
    cr_assert_eq(proc_wait(p, 60), 0);
}

Test(short, no_keys_no_listening_beyond_loopback)
{
    char out[256];
    path(out, sizeof out, "ins.txt");
    int port = free_port();
    cr_assert_eq(run_cmd("'%s' --listen tcp://0.0.0.0:%d > '%s' 2>&1", psd_bin, port, out), 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "psd keygen") && strstr(t, "--insecure"), "says how to make keys: %s", t);
    free(t);
    run_t r;
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://0.0.0.0:%d", port);
    char log[256];
    path(log, sizeof log, "ins-psd.log");
    const char *argv[] = {psd_bin, "--listen", ep, "--insecure", "--set", "checkpoint.dir=", "--metrics", "",
                          "--start-timeout", "30", NULL};
    pid_t p = proc_spawn(argv, log);
    wait_log(log, "WITHOUT AUTHENTICATION", 20);
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 30), 0);
    (void)r;
}

/* SIGTERM while psd still builds a large table (before its loop and its
 * own handlers): remembered, acted on once the loop runs (exit 0, the
 * workers told); a second one exits at once with 128+15, but not the first
 * one again at once (twice == 2: as timeout(1) sends it), which is one
 * request. */
Test(short, a_stop_while_psd_loads_is_a_clean_stop)
{
    for (int twice = 0; twice < 3; twice++) {
        char log[256], ep[64];
        snprintf(log, sizeof log, "%s/load-stop%d.log", dir, twice);
        snprintf(ep, sizeof ep, "tcp://127.0.0.1:%d", free_port());
        char cfg[512];
        snprintf(cfg, sizeof cfg, "%s/ctr.yaml", getenv("PSD_CONFIGS"));
        const char *argv[] = {psd_bin, "--config", cfg, "--listen", ep, "--set", "ctr.rows=3000000", "--set",
                              "ctr.dim=32", "--set", "model.layers=[256,64,2]", "--set", "checkpoint.dir=",
                              "--metrics", "", "--start-timeout", "60", NULL};
        pid_t p = proc_spawn(argv, log);
        wait_log(log, "ctr task:", 60); /* logged before the table is built */
        kill(p, SIGTERM);
        if (twice) {
            if (twice == 1) zmq_poll(NULL, 0, 250); /* past PS_SIGNAL_ECHO_S */
            kill(p, SIGTERM);
        }
        int rc = proc_wait(p, 60);
        char *t = slurp(log);
        cr_assert(t, "psd's log");
        if (twice == 1) {
            cr_assert_eq(rc, 128 + SIGTERM, "a second signal exits at once: %d\n%s", rc, t);
            cr_assert_null(strstr(t, "listening on"), "it did not go on loading: %s", t);
        } else {
            cr_assert_eq(rc, 0, "a clean stop: %d\n%s", rc, t);
            cr_assert(strstr(t, "the embedding table") && strstr(t, "received Terminated"),
                      "loaded, then acted on the signal: %s", t);
        }
        free(t);
    }
}

/* timeout(1) sends its signal to psd and to its process group: twice at
 * once. One request: a checkpoint, the workers told, exit 0 (before, the
 * second copy made psd exit at once with 143). */
Test(short, psd_under_timeout_stops_cleanly)
{
    char log[256], ck[256];
    path(log, sizeof log, "timeout-psd.log");
    path(ck, sizeof ck, "timeout-ck");
    int rc = run_cmd("timeout -k 30 --preserve-status 2 '%s' --listen tcp://127.0.0.1:%d --workers 1 --set "
                     "checkpoint.dir='%s' --metrics '' --start-timeout 60 > '%s' 2>&1",
                     psd_bin, free_port(), ck, log);
    char *t = slurp(log);
    cr_assert_eq(rc, 0, "psd's exit status: %d\n%s", rc, t);
    cr_assert(strstr(t, "received Terminated: writing a checkpoint"), "%s", t);
    cr_assert_null(strstr(t, "exiting now"), "%s", t);
    free(t);
}

/* ---- soak: training while hostile connections pound psd ----------------- */

static long rss_kib(pid_t pid)
{
    char f[64], line[256];
    snprintf(f, sizeof f, "/proc/%d/status", (int)pid);
    FILE *fp = fopen(f, "r");
    long kib = -1;
    while (fp && fgets(line, sizeof line, fp))
        if (strncmp(line, "VmRSS:", 6) == 0) kib = strtol(line + 6, NULL, 10);
    if (fp) fclose(fp);
    return kib;
}

typedef struct {
    const char *endpoint;
    int port;
    volatile int stop;
    unsigned seed;
} soak_t;

/* 20 hostile peers: raw TCP garbage, idle connections, and ZeroMQ peers
 * sending frames larger than psd's ZMQ_MAXMSGSIZE or malformed headers. */
static void *soak_main(void *arg)
{
    soak_t *k = arg;
    int raw[14];
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)k->port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < 14; i++) {
        raw[i] = socket(AF_INET, SOCK_STREAM, 0);
        if (raw[i] >= 0 && connect(raw[i], (struct sockaddr *)&a, sizeof a) != 0) {
            close(raw[i]);
            raw[i] = -1;
        }
    }
    void *ctx = zmq_ctx_new(), *z[6];
    int linger = 0;
    for (int i = 0; i < 6; i++) {
        z[i] = zmq_socket(ctx, ZMQ_DEALER);
        zmq_setsockopt(z[i], ZMQ_LINGER, &linger, sizeof linger);
        zmq_connect(z[i], k->endpoint);
    }
    size_t big_n = 64u << 20; /* larger than psd accepts for this model */
    char *big = calloc(1, big_n), junk[4096];
    unsigned seed = k->seed;
    while (!k->stop) {
        for (int i = 0; i < 8; i++) { /* 8 raw garbage senders; 6 stay idle */
            if (raw[i] < 0) continue;
            for (size_t j = 0; j < sizeof junk; j++) junk[j] = (char)rand_r(&seed);
            if (send(raw[i], junk, 1 + (size_t)rand_r(&seed) % sizeof junk, MSG_NOSIGNAL | MSG_DONTWAIT) < 0 &&
                errno != EAGAIN) {
                close(raw[i]); /* psd dropped it: come back */
                raw[i] = socket(AF_INET, SOCK_STREAM, 0);
                if (raw[i] >= 0 && connect(raw[i], (struct sockaddr *)&a, sizeof a) != 0) {
                    close(raw[i]);
                    raw[i] = -1;
                }
            }
        }
        for (int i = 0; i < 3; i++) zmq_send(z[i], big, big_n, ZMQ_DONTWAIT); /* oversized */
        for (int i = 3; i < 6; i++) zmq_send(z[i], junk, 1 + (size_t)rand_r(&seed) % 512, ZMQ_DONTWAIT);
        zmq_poll(NULL, 0, 20);
    }
    for (int i = 0; i < 14; i++)
        if (raw[i] >= 0) close(raw[i]);
    for (int i = 0; i < 6; i++) zmq_close(z[i]);
    zmq_ctx_term(ctx);
    free(big);
    return NULL;
}

Test(short, soak_hostile_connections_while_training)
{
    /* PSD_SOAK_EPOCHS / PSD_SOAK_LIMIT make it longer (a 5-minute soak) */
    unsigned seed = fault_seed();
    run_t r;
    const char *ep_env = getenv("PSD_SOAK_EPOCHS"), *lim_env = getenv("PSD_SOAK_LIMIT");
    int epochs = ep_env ? atoi(ep_env) : 6;
    long limit = lim_env ? atol(lim_env) : 12000;
    char ep_s[16], lim_s[48];
    snprintf(ep_s, sizeof ep_s, "%d", epochs < 6 ? 6 : epochs);
    epochs = atoi(ep_s);
    snprintf(lim_s, sizeof lim_s, "data.train_limit=%ld", limit);
    const char *args[] = {"--epochs", ep_s, "--set", lim_s, "--set", "checkpoint.dir=", NULL};
    pid_t p = start_psd(&r, "soak", 4, args);
    int port = atoi(strrchr(r.endpoint, ':') + 1);
    soak_t k = {.endpoint = r.endpoint, .port = port, .seed = seed};
    pthread_t th;
    pthread_create(&th, NULL, soak_main, &k);
    pid_t w[4];
    for (int i = 0; i < 4; i++) w[i] = start_worker(&r, "soak", i, NULL);
    wait_metrics(&r, 2); /* warm-up */
    long rss0 = rss_kib(p);
    wait_metrics(&r, epochs - 1);
    long rss1 = rss_kib(p);
    int code = proc_wait(p, 300);
    k.stop = 1;
    pthread_join(th, NULL);
    cr_assert_eq(code, 0, "psd trained to the end under attack");
    for (int i = 0; i < 4; i++) cr_assert_eq(proc_wait(w[i], 30), 0);
    check_every_epoch(&r, epochs, (uint64_t)(limit ? limit : 60000));
    char *m = metrics_last(&r);
    fprintf(stderr, "soak: %d epochs, final val_acc %.4f\n", epochs, json_num(last_line(m), "val_acc"));
    free(m);
    fprintf(stderr, "soak: psd RSS %ld KiB after warm-up, %ld KiB near the end (%+.1f%%)\n", rss0, rss1,
            100.0 * (double)(rss1 - rss0) / (double)rss0);
    /* Under ASan, RSS follows its allocator (quarantine, size-class regions
     * that are never returned), which connection churn from peers cut off
     * and reconnecting makes grow; leaks are LeakSanitizer's job there. */
    if (!sanitized())
        cr_assert(rss0 > 0 && rss1 <= rss0 * 105 / 100, "RSS grew by at most 5%%: %ld -> %ld KiB", rss0, rss1);
}

/* A psd shard's socket is as exposed as psd's: the same hostile peers
 * (raw garbage, frames over its ZMQ_MAXMSGSIZE, malformed headers) against
 * shard 1 while 2 shards train. Nothing reaches the parameters: the
 * weights are the bits of the same run left alone, and the shard logs what
 * it dropped. */
Test(short, a_psd_shard_under_attack_trains_on_with_the_same_weights)
{
    const char *args[] = {"--epochs", "3", "--set", "data.train_limit=4000", "--seed", "7", "--set",
                          "checkpoint.dir=", NULL};
    run_t a, b;
    train_sharded(&a, "calm", 2, args, NULL);
    check_run(&a, 2, 3);
    const char *args0[] = {"--epochs", "3", "--set", "data.train_limit=4000", "--seed", "7", "--set",
                           "checkpoint.dir=", "--shard", "0/2", NULL};
    pid_t p = start_psd(&b, "attacked", 2, args0);
    char ep[64];
    pid_t f = start_shard_at(&b, "attacked", 1, 2, args, ep);
    soak_t k = {.endpoint = ep, .port = atoi(strrchr(ep, ':') + 1), .seed = fault_seed()};
    pthread_t th;
    pthread_create(&th, NULL, soak_main, &k);
    pid_t w0 = start_worker(&b, "attacked", 0, NULL), w1 = start_worker(&b, "attacked", 1, NULL);
    b.psd_code = proc_wait(p, 300);
    k.stop = 1;
    pthread_join(th, NULL);
    b.worker_code[0] = proc_wait(w0, 30);
    b.worker_code[1] = proc_wait(w1, 30);
    cr_assert_eq(proc_wait(f, 30), 0, "shard 1 trained to the end under attack");
    check_run(&b, 2, 3);
    cr_assert(weights_equal(a.weights, b.weights), "the same bits as the run left alone");
    char log[256];
    path(log, sizeof log, "attacked-shard1.log");
    char *l = slurp(log);
    cr_assert(l && strstr(l, "dropped"), "shard 1 logs what it dropped: %s", l ? l : "(no log)");
    free(l);
}

/* ---- HTTP endpoint -------------------------------------------------------- */

/* Send `req` (raw bytes) to 127.0.0.1:port, read the whole answer into out;
 * the status code, or -1 (no connection or no answer within 10 s). */
static int http_raw_at(int family, int port, const char *req, size_t req_len, char *out, size_t n)
{
    int fd = socket(family, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port), .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    if (fd < 0 || connect(fd, family == AF_INET6 ? (struct sockaddr *)&a6 : (struct sockaddr *)&a,
                          family == AF_INET6 ? sizeof a6 : sizeof a) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    if (write(fd, req, req_len) != (ssize_t)req_len) {
        close(fd);
        return -1;
    }
    size_t got = 0;
    ssize_t r;
    while (got + 1 < n && (r = read(fd, out + got, n - 1 - got)) > 0) got += (size_t)r;
    out[got] = '\0';
    close(fd);
    int code = -1;
    if (sscanf(out, "HTTP/1.1 %d", &code) != 1) return -1;
    return code;
}

/* The request on 127.0.0.1:port: the status code, the answer in out. */
static int http_raw(int port, const char *req, size_t req_len, char *out, size_t n)
{
    return http_raw_at(AF_INET, port, req, req_len, out, n);
}

/* GET path (with a bearer token unless NULL): status code; *body points
 * into out. */
static int http_get(int port, const char *pathq, const char *token, char *out, size_t n, const char **body)
{
    char req[512];
    int len = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%s%s%sConnection: close\r\n\r\n", pathq,
                       token ? "Authorization: Bearer " : "", token ? token : "", token ? "\r\n" : "");
    int code = http_raw(port, req, (size_t)len, out, n);
    const char *b = strstr(out, "\r\n\r\n");
    if (body) *body = b ? b + 4 : out + strlen(out);
    return code;
}

/* The value of a sample line "name value" in a metrics text, or NAN. */
static double metric_value(const char *text, const char *name)
{
    size_t n = strlen(name);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, name, n) == 0 && p[n] == ' ') return strtod(p + n + 1, NULL);
    return NAN;
}

/* psd --http: /metrics parses with Prometheus' own parser (promtool check
 * metrics) and its counters move while training runs; /status is JSON with
 * every worker; /healthz answers; bad requests get 400/404/405/431 and psd
 * goes on serving and training. */
Test(short, http_metrics_status_and_healthz)
{
    int port = free_port();
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    const char *args[] = {"--epochs", "2", "--http", addr, "--set", "checkpoint.dir=", NULL};
    const char *wex[] = {"--threads", "1", NULL};
    run_t r;
    pid_t p = start_psd(&r, "http", 2, args);
    pid_t w0 = start_worker(&r, "http", 0, wex), w1 = start_worker(&r, "http", 1, wex);
    static char out[1 << 20];
    const char *body = NULL;
    double t0 = ps_now(), steps1 = NAN;
    while (ps_now() - t0 < 120) { /* until it trains */
        if (http_get(port, "/metrics", NULL, out, sizeof out, &body) == 200 &&
            (steps1 = metric_value(body, "psd_steps_total")) > 0)
            break;
        usleep(100000);
    }
    cr_assert_gt(steps1, 0, "psd_steps_total moves: %s", out);
    char mfile[256];
    path(mfile, sizeof mfile, "metrics.txt");
    FILE *f = fopen(mfile, "w");
    fputs(body, f);
    fclose(f);
    if (run_cmd("command -v promtool >/dev/null") == 0)
        cr_assert_eq(run_cmd("promtool check metrics < '%s'", mfile), 0, "promtool accepts /metrics:\n%s", body);
    else
        cr_log_warn("promtool not installed (deploy/setup.sh --deploy installs it): format not checked");
    double samples1 = metric_value(body, "psd_train_samples_total");
    cr_assert(strstr(body, "psd_worker_pull_wait_seconds_bucket{rank=\"1\",le=\"+Inf\"}"), "%s", body);
    usleep(700000);
    cr_assert_eq(http_get(port, "/metrics", NULL, out, sizeof out, &body), 200);
    cr_assert_gt(metric_value(body, "psd_steps_total"), steps1, "steps counted on");
    cr_assert_gt(metric_value(body, "psd_train_samples_total"), samples1, "samples counted on");
    cr_assert_eq(metric_value(body, "psd_workers_live"), 2);
    cr_assert_eq(http_get(port, "/status", NULL, out, sizeof out, &body), 200);
    cr_assert_eq(json_num(body, "workers_live"), 2, "%s", body);
    cr_assert(strstr(body, "\"rank\":0") && strstr(body, "\"rank\":1") && strstr(body, "\"phase\":\"training\""), "%s",
              body);
    char sfile[256];
    path(sfile, sizeof sfile, "status.json");
    f = fopen(sfile, "w");
    fputs(body, f);
    fclose(f);
    cr_assert_eq(run_cmd("python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert len(d[\"workers\"])==2' "
                         "'%s'", sfile), 0, "/status is JSON: %s", body);
    cr_assert_eq(http_get(port, "/healthz", NULL, out, sizeof out, &body), 200);
    cr_assert_str_eq(body, "ok\n");
    cr_assert_eq(http_get(port, "/nope", NULL, out, sizeof out, NULL), 404);
    cr_assert_eq(http_raw(port, "GARBAGE\r\n\r\n", 11, out, sizeof out), 400);
    cr_assert_eq(http_raw(port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 45, out, sizeof out), 405);
    static char big[40000];
    memcpy(big, "GET / HTTP/1.1\r\nX: ", 19);
    memset(big + 19, 'a', sizeof big - 19);
    cr_assert_eq(http_raw(port, big, sizeof big, out, sizeof out), 431, "a header too long");
    cr_assert_eq(http_get(port, "/healthz", NULL, out, sizeof out, NULL), 200, "still serving");
    cr_assert_eq(proc_wait(p, 300), 0, "the run finishes");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
}

/* server.http_token_file: every path but /healthz needs the bearer token;
 * HTTP beyond loopback without a token is refused (exit 2). */
Test(short, http_token_and_loopback_rule)
{
    char tok[256];
    path(tok, sizeof tok, "http.token");
    FILE *f = fopen(tok, "w");
    fputs("s3cret-token-0123456789\n", f);
    fclose(f);
    chmod(tok, 0600);
    int port = free_port();
    char addr[64], tf[300];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    snprintf(tf, sizeof tf, "server.http_token_file=%s", tok);
    const char *args[] = {"--http", addr, "--set", tf, "--start-timeout", "60", "--set", "checkpoint.dir=", NULL};
    run_t r;
    pid_t p = start_psd(&r, "tok", 2, args);
    static char out[1 << 16];
    double t0 = ps_now();
    while (http_get(port, "/healthz", NULL, out, sizeof out, NULL) != 200 && ps_now() - t0 < 30) usleep(50000);
    cr_assert_eq(http_get(port, "/healthz", NULL, out, sizeof out, NULL), 200, "/healthz needs no token");
    cr_assert_eq(http_get(port, "/metrics", NULL, out, sizeof out, NULL), 401, "no token");
    cr_assert_eq(http_get(port, "/status", "wrong-token-0123456789", out, sizeof out, NULL), 401, "wrong token");
    cr_assert_eq(http_get(port, "/metrics", "s3cret-token-0123456789", out, sizeof out, NULL), 200, "the token");
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 30), 0);
    chmod(tok, 0644);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:%d --http 127.0.0.1:%d --set '%s' --start-timeout 1 "
                         "--set checkpoint.dir= >/dev/null 2>&1", psd_bin, free_port(), free_port(), tf), 2,
                 "a token file others can read is refused");
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:%d --http 0.0.0.0:%d --start-timeout 1 --set checkpoint.dir= "
                         ">/dev/null 2>&1", psd_bin, free_port(), free_port()), 2,
                 "HTTP beyond loopback without a token is refused");
    char outf[256];
    path(outf, sizeof outf, "tok-bad.txt");
    static const char *const bad[] = {"[::1", "[::1]:99999", "[zz]:80", "host.example:80", "127.0.0.1:"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:%d --http '%s' --start-timeout 1 --set checkpoint.dir= "
                             ">'%s' 2>&1", psd_bin, free_port(), bad[i], outf), 2, "--http %s", bad[i]);
        char *t = slurp(outf);
        cr_assert(t && strstr(t, "server.http: expected HOST:PORT"), "--http %s: %s", bad[i], t ? t : "");
        free(t);
    }
}

/* psd, its workers and psctl over IPv6 loopback (tcp://[::1]:PORT; the
 * workers on the wire, --no-shm), and psd's HTTP endpoint on [::1]: a run
 * like any other, and loopback (no keys, no HTTP token needed); HTTP on
 * every IPv6 interface ([::]) without a token is refused. Worker 1 and
 * psctl reach psd by a host name whose only address is ::1 (a hosts file
 * of their own through nss_wrapper): without ZMQ_IPV6 libzmq would look it
 * up for IPv4 and find nothing. Skipped where this host has no IPv6
 * loopback. */
Test(short, a_run_over_ipv6_loopback)
{
    int fd = socket(AF_INET6, SOCK_STREAM, 0);
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_addr = IN6ADDR_LOOPBACK_INIT};
    socklen_t len = sizeof a;
    bool have = fd >= 0 && bind(fd, (struct sockaddr *)&a, sizeof a) == 0 &&
                getsockname(fd, (struct sockaddr *)&a, &len) == 0;
    if (fd >= 0) close(fd);
    if (!have) cr_skip_test("no IPv6 loopback on this host");
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://[::1]:%d", ntohs(a.sin6_port));
    int hport = free_port();
    char http[64];
    snprintf(http, sizeof http, "[::1]:%d", hport);
    const char *args[] = {"--epochs", "4", "--set", "data.train_limit=4000", "--http", http, "--listen", ep, NULL};
    const char *wex[] = {"--no-shm", NULL};
    void *nss = dlopen("libnss_wrapper.so", RTLD_NOW);
    cr_assert_not_null(nss, "libnss_wrapper.so: %s (deploy/setup.sh installs libnss-wrapper)", dlerror());
    dlclose(nss);
    char hosts[256], ep_name[64], asan[512], asan_was[480] = "";
    path(hosts, sizeof hosts, "v6-hosts");
    FILE *hf = fopen(hosts, "w");
    cr_assert(hf && fputs("::1 psd-v6-only.test\n", hf) >= 0 && fclose(hf) == 0);
    snprintf(ep_name, sizeof ep_name, "tcp://psd-v6-only.test:%d", ntohs(a.sin6_port));
    /* under the sanitizers their runtime must come first, unless told otherwise */
    const bool had_asan = getenv("ASAN_OPTIONS") != NULL;
    if (had_asan) snprintf(asan_was, sizeof asan_was, "%s", getenv("ASAN_OPTIONS"));
    snprintf(asan, sizeof asan, "%s%sverify_asan_link_order=0", asan_was, had_asan ? ":" : "");
    run_t r;
    pid_t p = start_psd(&r, "v6", 2, args); /* its --listen is the last */
    snprintf(r.endpoint, sizeof r.endpoint, "%s", ep);
    pid_t w0 = start_worker(&r, "v6", 0, wex);
    snprintf(r.endpoint, sizeof r.endpoint, "%s", ep_name);
    setenv("LD_PRELOAD", "libnss_wrapper.so", 1);
    setenv("NSS_WRAPPER_HOSTS", hosts, 1);
    setenv("NSS_WRAPPER_DISABLE_DEEPBIND", "1", 1); /* its RTLD_DEEPBIND and the sanitizers exclude each other */
    setenv("ASAN_OPTIONS", asan, 1);
    pid_t w1 = start_worker(&r, "v6", 1, wex);
    unsetenv("LD_PRELOAD");
    if (had_asan) setenv("ASAN_OPTIONS", asan_was, 1);
    else unsetenv("ASAN_OPTIONS");
    snprintf(r.endpoint, sizeof r.endpoint, "%s", ep);
    wait_log(r.psd_log, "2 workers ready", 120);
    static const char req[] = "GET /metrics HTTP/1.1\r\nHost: [::1]\r\nConnection: close\r\n\r\n";
    static char page[1 << 16];
    cr_assert_eq(http_raw_at(AF_INET6, hport, req, sizeof req - 1, page, sizeof page), 200,
                 "/metrics on [::1] with no token (loopback): %s", page);
    cr_assert(strstr(page, "psd_"), "%s", page);
    const char *psctl = getenv("PSCTL_BIN");
    cr_assert_not_null(psctl, "PSCTL_BIN is set by meson");
    char out[256];
    path(out, sizeof out, "v6-psctl.txt");
    int ctl = run_cmd("ASAN_OPTIONS='%s' LD_PRELOAD=libnss_wrapper.so '%s' status --server '%s' > '%s' 2>&1", asan,
                      psctl, ep_name, out);
    unsetenv("NSS_WRAPPER_HOSTS");
    unsetenv("NSS_WRAPPER_DISABLE_DEEPBIND");
    r.psd_code = proc_wait(p, 300);
    r.worker_code[0] = proc_wait(w0, 30);
    r.worker_code[1] = proc_wait(w1, 30);
    check_run(&r, 2, 4);
    char *log = slurp(r.psd_log), *t = slurp(out);
    cr_assert(log && strstr(log, ep) && !strstr(log, "exchanges tensors with psd through shared memory"), "%s", log);
    cr_assert(ctl == 0 && t && strstr(t, "workers 2 live"), "psctl over IPv6, by a host name: %d %s", ctl,
              t ? t : "");
    free(log);
    free(t);
    cr_assert_eq(run_cmd("'%s' --listen tcp://127.0.0.1:%d --http '[::]:%d' --start-timeout 1 --set checkpoint.dir= "
                         ">/dev/null 2>&1", psd_bin, free_port(), free_port()), 2,
                 "HTTP on every IPv6 interface without a token is refused");
}

/* psctl: status and workers (text and --json) of a running psd; a
 * checkpoint asked for during training is written and is the one
 * `psd --check-config --resume` would resume from; stop ends the run
 * cleanly; no psd: exit 4. */
Test(short, psctl_status_checkpoint_and_stop)
{
    const char *psctl = getenv("PSCTL_BIN");
    cr_assert_not_null(psctl, "PSCTL_BIN is set by meson");
    char ck[256], arg[300], out[8192];
    path(ck, sizeof ck, "ck");
    snprintf(arg, sizeof arg, "checkpoint.dir=%s", ck);
    const char *args[] = {"--epochs", "6", "--set", arg, "--set", "checkpoint.every_epochs=0", NULL};
    const char *wex[] = {"--threads", "1", NULL};
    run_t r;
    pid_t p = start_psd(&r, "ctl", 2, args);
    pid_t w0 = start_worker(&r, "ctl", 0, wex), w1 = start_worker(&r, "ctl", 1, wex);
    wait_log(r.psd_log, "2 workers ready", 120);
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "'%s' status --server %s", psctl, r.endpoint);
    run_cmd_out(cmd, out, sizeof out);
    cr_assert(strstr(out, "workers 2 live") && strstr(out, "run "), "%s", out);
    char js[256];
    path(js, sizeof js, "workers.json");
    cr_assert_eq(run_cmd("'%s' workers --json --server %s > '%s'", psctl, r.endpoint, js), 0);
    cr_assert_eq(run_cmd("python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert [w[\"rank\"] for w in "
                         "d[\"workers\"]] == [0, 1], d' '%s'", js), 0, "psctl workers --json lists both");
    snprintf(cmd, sizeof cmd, "'%s' checkpoint --server %s", psctl, r.endpoint);
    run_cmd_out(cmd, out, sizeof out);
    const char *w = strstr(out, "checkpoint written: ");
    cr_assert_not_null(w, "%s", out);
    char file[512];
    snprintf(file, sizeof file, "%s", w + strlen("checkpoint written: "));
    file[strcspn(file, "\n")] = '\0';
    cr_assert_eq(access(file, R_OK), 0, "%s exists", file);
    char rdir[512];
    snprintf(rdir, sizeof rdir, "%s", file);
    *strrchr(rdir, '/') = '\0';
    snprintf(cmd, sizeof cmd, "'%s' --check-config --epochs 6 --set '%s' --set checkpoint.every_epochs=0 --resume '%s' 2>&1",
             psd_bin, arg, rdir);
    run_cmd_out(cmd, out, sizeof out);
    cr_assert(strstr(out, "would resume") && strstr(out, file), "--resume takes psctl's checkpoint: %s", out);
    cr_assert_eq(run_cmd("'%s' stop --server %s >/dev/null", psctl, r.endpoint), 0);
    cr_assert_eq(proc_wait(p, 60), 0, "psd stops cleanly");
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
    cr_assert_eq(run_cmd("'%s' status --server %s --timeout 1 >/dev/null 2>&1", psctl, r.endpoint), 4, "no psd: 4");
    cr_assert_eq(run_cmd("'%s' frobnicate --server %s >/dev/null 2>&1", psctl, r.endpoint), 2, "bad command: 2");
}

/* The live page (/, compiled into psd) in a real headless Chromium while a
 * run trains: its script fetches /status and /history, the loss chart has
 * points and the worker table one row per worker. A screenshot is written
 * to the build directory (psd-live-page.png). */
Test(short, live_page_in_headless_chromium)
{
    if (run_cmd("command -v chromium >/dev/null") != 0) {
        cr_log_warn("chromium not installed (deploy/setup.sh --deploy installs it): page not checked");
        cr_skip_test("no chromium");
    }
    int port = free_port();
    char addr[64], url[96];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
    snprintf(url, sizeof url, "http://%s/", addr);
    /* short epochs (the first validation comes soon), many of them (psd
     * still serves the page when chromium loads it; SIGTERM ends the run) */
    const char *args[] = {"--epochs", "200", "--http", addr, "--set", "checkpoint.dir=", "--set",
                          "data.train_limit=10000", NULL};
    const char *wex[] = {"--threads", "1", "--no-shm", NULL};
    run_t r;
    pid_t p = start_psd(&r, "page", 2, args);
    pid_t w0 = start_worker(&r, "page", 0, wex), w1 = start_worker(&r, "page", 1, wex);
    static char out[1 << 20];
    const char *body;
    double t0 = ps_now();
    while (ps_now() - t0 < 180 && !(http_get(port, "/metrics", NULL, out, sizeof out, &body) == 200 &&
                                    isfinite(metric_value(body, "psd_val_accuracy")))) /* an epoch validated */
        usleep(200000);
    cr_assert_eq(http_get(port, "/", NULL, out, sizeof out, &body), 200);
    cr_assert(strstr(body, "<canvas id=\"loss\""), "the page: %.300s", body);
    char prof[256], cmd[2048];
    path(prof, sizeof prof, "chromium-profile");
    const char *flags = "--headless --no-sandbox --disable-gpu --no-first-run --disable-background-networking "
                        "--disable-component-update --disable-sync --virtual-time-budget=6000";
    snprintf(cmd, sizeof cmd, "chromium %s --user-data-dir='%s' --dump-dom '%s' 2>/dev/null", flags, prof, url);
    run_cmd_out(cmd, out, sizeof out);
    const char *lp = strstr(out, "id=\"loss-points\">");
    cr_assert_not_null(lp, "the DOM has the loss chart: %.500s", out);
    int points = atoi(lp + strlen("id=\"loss-points\">"));
    cr_assert_gt(points, 0, "the loss chart has points");
    const char *vp = strstr(out, "id=\"val-points\">");
    cr_assert(vp && atoi(vp + strlen("id=\"val-points\">")) > 0, "the accuracy chart has points");
    cr_assert_eq(count_in(out, "<tr class=\"worker"), 2, "one row per worker: %s", strstr(out, "<table"));
    cr_assert(strstr(out, "shards 1, bsp"), "the summary names the consistency mode: %.300s", strstr(out, "summary"));
    char shot[512];
    snprintf(shot, sizeof shot, "%s", psd_bin);
    *strrchr(shot, '/') = '\0';
    strcat(shot, "/psd-live-page.png");
    unlink(shot);
    cr_assert_eq(run_cmd("chromium %s --user-data-dir='%s' --window-size=1280,900 --screenshot='%s' '%s' "
                         ">/dev/null 2>&1", flags, prof, shot, url), 0);
    struct stat st;
    cr_assert(stat(shot, &st) == 0 && st.st_size > 1000, "screenshot %s written", shot);
    fprintf(stderr, "live page screenshot: %s (%d loss points, %d validated epochs, 2 workers)\n", shot, points,
            atoi(vp + strlen("id=\"val-points\">")));
    kill(p, SIGTERM);
    cr_assert_eq(proc_wait(p, 60), 0);
    cr_assert_eq(proc_wait(w0, 30), 0);
    cr_assert_eq(proc_wait(w1, 30), 0);
}

/* ---- consistency modes (train.sync: bsp | async | ssp) ------------------- */

/* psd + 2 workers, worker 0 slowed down by slow_ms per step; the largest
 * staleness and ssp lead over the epochs' metrics lines */
static void run_sync(run_t *r, const char *tag, const char *mode, int slow_ms, uint64_t *stale_max,
                     uint64_t *lead_max)
{
    char sync[32], slow[16];
    snprintf(sync, sizeof sync, "train.sync=%s", mode);
    snprintf(slow, sizeof slow, "%d", slow_ms);
    const char *args[] = {"--epochs", "2", "--set", "data.train_limit=3200", "--set", sync, "--set",
                          "train.staleness=2", "--set", "optimizer.lr=0.05", NULL};
    pid_t p = start_psd(r, tag, 2, args);
    const char *slowed[] = {"--x-slow-ms", slow, NULL};
    pid_t w0 = start_worker(r, tag, 0, slowed), w1 = start_worker(r, tag, 1, NULL);
    r->psd_code = proc_wait(p, 300);
    r->worker_code[0] = proc_wait(w0, 30);
    r->worker_code[1] = proc_wait(w1, 30);
    check_run(r, 2, 2);
    char *m = metrics_last(r), *save = NULL;
    *stale_max = *lead_max = 0;
    for (char *line = strtok_r(m, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char want[32];
        snprintf(want, sizeof want, "\"sync\":\"%s\"", mode);
        cr_assert(strstr(line, want), "%s in %s", want, line);
        double st = json_num(line, "staleness_max"), mean = json_num(line, "staleness_mean");
        cr_assert(mean > 0 && mean <= st, "staleness mean %g max %g", mean, st);
        if (st > (double)*stale_max) *stale_max = (uint64_t)st;
        if (json_num(line, "ssp_lead_max") > (double)*lead_max) *lead_max = (uint64_t)json_num(line, "ssp_lead_max");
    }
    free(m);
}

/* ssp with bound k = 2: the fast worker is held back at 2 steps ahead of the
 * slow one, so no gradient psd applies is more than 2k + 1 = 5 versions stale
 * (2 workers: while one computes, the other applies at most 2k + 1 pushes,
 * k + 1 while the slowest computes); async lets it run, and its staleness
 * goes past that (so the first check can fail). */
Test(short, ssp_holds_a_fast_worker_within_the_staleness_bound)
{
    int slow = sanitized() ? 200 : 40;
    run_t r;
    uint64_t stale, lead;
    run_sync(&r, "ssp", "ssp", slow, &stale, &lead);
    cr_assert_eq(lead, 2, "the fast worker reached the bound and never passed it (lead %" PRIu64 ")", lead);
    cr_assert(stale >= 1 && stale <= 5, "ssp staleness max %" PRIu64 " (bound 2k + 1 = 5)", stale);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "workers trained at most 2 steps ahead of the slowest (bound 2)"), "%s", log);
    free(log);
    run_sync(&r, "async", "async", slow, &stale, &lead);
    cr_assert_eq(lead, 0, "async has no bound to report");
    cr_assert_gt(stale, 5, "async lets the fast worker run ahead: staleness max %" PRIu64, stale);
}

/* ssp: the slowest worker dies; the fast one, held back, is let go once psd
 * declares it lost, and finishes the epoch (its samples too). */
Test(short, ssp_does_not_hang_when_the_slowest_worker_dies)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=3200", "--set", "train.sync=ssp",
                          "--set", "train.staleness=1", "--set", "optimizer.lr=0.05", "--worker-timeout", "2",
                          NULL};
    pid_t p = start_psd(&r, "sspkill", 2, args);
    const char *slowed[] = {"--x-slow-ms", "300", "--retry-for", "0", NULL};
    pid_t w0 = start_worker(&r, "sspkill", 0, slowed), w1 = start_worker(&r, "sspkill", 1, NULL);
    wait_log(r.psd_log, "training 1 epoch", 60);
    zmq_poll(NULL, 0, 1500); /* the fast worker is held back by now */
    kill(w0, SIGKILL);
    cr_assert_eq(proc_wait(w0, 10), 128 + SIGKILL);
    r.psd_code = proc_wait(p, 120);
    r.worker_code[0] = 0;
    r.worker_code[1] = proc_wait(w1, 30);
    check_run(&r, 1, 1);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 3200, "every sample trained once: %s", last_line(m));
    free(m);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "lost"), "%s", log);
    free(log);
}

/* A mode psd shards do not support is refused at start. */
Test(short, async_with_psd_shards_is_refused)
{
    char out[256];
    path(out, sizeof out, "syncshard.txt");
    cr_assert_eq(run_cmd("'%s' --shard 0/2 --set train.sync=async --listen tcp://127.0.0.1:9 > '%s' 2>&1", psd_bin, out),
                 2);
    char *t = slurp(out);
    cr_assert(strstr(t, "train.sync: async needs one psd"), "%s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' --set train.sync=sometimes --print-config > /dev/null 2>&1", psd_bin), 2);
    /* streamed steps: bsp and one psd only */
    cr_assert_eq(run_cmd("'%s' --set train.stream=true --set train.sync=ssp --print-config > '%s' 2>&1", psd_bin, out), 2);
    t = slurp(out);
    cr_assert(strstr(t, "train.stream: true needs train.sync: bsp"), "%s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' --shard 0/2 --set train.stream=true --listen tcp://127.0.0.1:9 > '%s' 2>&1", psd_bin, out),
                 2);
    t = slurp(out);
    cr_assert(strstr(t, "train.stream: true needs one psd"), "%s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' --set train.staleness=-1 --print-config > /dev/null 2>&1", psd_bin), 2);
}

/* Fashion-MNIST, 2 workers, 5 epochs: async and ssp learn as well as bsp
 * (lr 0.05: each push is a step of one worker's batch). */
static void full_sync(const char *mode)
{
    run_t r;
    char sync[32];
    snprintf(sync, sizeof sync, "train.sync=%s", mode);
    const char *args[] = {"--epochs", "5", "--set", sync, "--set", "optimizer.lr=0.05", NULL};
    train(&r, mode, 2, args, 900);
    check_run(&r, 2, 5);
    char *m = metrics_last(&r);
    const char *last = last_line(m);
    cr_assert_eq(json_num(last, "train_samples"), 60000);
    cr_assert_geq(json_num(last, "val_acc"), 0.88, "%s: %s", mode, last);
    fprintf(stderr, "%s: val_acc %.4f, %.0f samples/s\n", mode, json_num(last, "val_acc"),
            json_num(last, "samples_per_s"));
    free(m);
}

/* async, worker 0 slowed down (40 ms a step), 2 epochs: the fast worker
 * finishes its half, then takes over most of what the slow one has left
 * (train.rebalance, on by default), and trains most of the epoch; every
 * sample is trained once (psd's own check, in check_run, and the counts).
 * With train.rebalance=false each trains its half, the fast one waiting at
 * its barrier. The counts come from psd's log: "trained: rank 0 N, rank 1 M". */
static void trained_counts(const run_t *r, int epoch, uint64_t *moved, uint64_t n[2])
{
    char *log = slurp(r->psd_log), want[64];
    snprintf(want, sizeof want, "epoch %d: ", epoch);
    *moved = n[0] = n[1] = 0;
    for (const char *at = log; (at = strstr(at, want)) != NULL; at++) {
        unsigned long long mv, a, b;
        unsigned ra, rb;
        if (sscanf(at + strlen(want), "%llu samples moved from slower workers to those done with theirs; trained: "
                                      "rank %u %llu, rank %u %llu", &mv, &ra, &a, &rb, &b) == 5) {
            cr_assert(ra < 2 && rb < 2 && ra != rb, "%s", at);
            *moved = mv;
            n[ra] = a;
            n[rb] = b;
        }
    }
    free(log);
}

Test(short, async_gives_a_slow_workers_samples_to_the_fast_one)
{
    int slow = sanitized() ? 150 : 40;
    char slow_ms[16];
    snprintf(slow_ms, sizeof slow_ms, "%d", slow);
    const char *slowed[] = {"--x-slow-ms", slow_ms, NULL};
    for (int rebalance = 1; rebalance >= 0; rebalance--) {
        run_t r;
        const char *tag = rebalance ? "rebal" : "norebal";
        const char *args[] = {"--epochs", "2", "--set", "data.train_limit=3200", "--set", "train.sync=async",
                              "--set", rebalance ? "train.rebalance=true" : "train.rebalance=false", "--set",
                              "optimizer.lr=0.05", NULL};
        pid_t p = start_psd(&r, tag, 2, args);
        pid_t w0 = start_worker(&r, tag, 0, slowed), w1 = start_worker(&r, tag, 1, NULL);
        r.psd_code = proc_wait(p, 300);
        r.worker_code[0] = proc_wait(w0, 30);
        r.worker_code[1] = proc_wait(w1, 30);
        check_run(&r, 2, 2);
        char *m = metrics_last(&r);
        for (char *line = m, *nl; line && *line; line = nl ? nl + 1 : NULL) {
            nl = strchr(line, '\n');
            cr_assert_eq(json_num(line, "train_samples"), 3200, "every sample trained once an epoch: %.300s", line);
            cr_assert_eq(json_num(line, "samples_moved") > 0, rebalance, "%.600s", line);
        }
        free(m);
        for (int e = 1; e <= 2; e++) {
            uint64_t moved, n[2];
            trained_counts(&r, e, &moved, n);
            if (!rebalance) {
                cr_assert_eq(moved, 0, "nothing moved without train.rebalance");
                continue;
            }
            cr_assert_gt(moved, 0, "epoch %d: samples moved (psd's log %s)", e, r.psd_log);
            cr_assert_eq(n[0] + n[1], 3200, "epoch %d: %" PRIu64 " + %" PRIu64, e, n[0], n[1]);
            uint64_t lo = n[0] < n[1] ? n[0] : n[1], hi = n[0] + n[1] - lo;
            cr_assert_geq(hi, 2 * lo, "epoch %d: the fast worker trained most of the epoch (%" PRIu64 " / %" PRIu64 ")",
                          e, n[0], n[1]);
        }
    }
}

/* async with rebalancing: the fast worker takes over most of the slow one's
 * samples, then is killed; what it had not trained goes back to the slow one,
 * and every sample of the epoch is trained once. */
Test(short, a_worker_killed_after_taking_over_samples_gives_them_back)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=3200", "--set", "train.sync=async",
                          "--set", "optimizer.lr=0.05", "--log-level", "debug", NULL};
    pid_t p = start_psd(&r, "rebalkill", 2, args);
    const char *slow[] = {"--x-slow-ms", "300", NULL}, *fast[] = {"--x-slow-ms", "30", NULL};
    pid_t w0 = start_worker(&r, "rebalkill", 0, slow), w1 = start_worker(&r, "rebalkill", 1, fast);
    wait_log(r.psd_log, "to 1 worker done with theirs", 60);
    kill(w1, SIGKILL);
    cr_assert_eq(proc_wait(w1, 10), 128 + SIGKILL);
    r.psd_code = proc_wait(p, 120);
    r.worker_code[0] = proc_wait(w0, 30);
    check_run(&r, 1, 1);
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), 3200, "every sample trained once: %s", last_line(m));
    cr_assert_gt(json_num(last_line(m), "samples_moved"), 0, "%s", last_line(m));
    free(m);
    char *log = slurp(r.psd_log);
    cr_assert(strstr(log, "lost"), "the fast worker was lost: %s", log);
    free(log);
}

Test(long, async_two_workers_reach_088) { full_sync("async"); }
Test(long, ssp_two_workers_reach_088) { full_sync("ssp"); }

/* ---- waits that are not silences ------------------------------------------ */

/* The last worker training in an epoch is lost while another, which joined
 * during the epoch, waits for the next one: that worker takes the samples
 * at once (psd used to keep them for a worker to join, and the waiting one
 * only came for them when its own wait for psd timed out: start timeout +
 * 10 s). And when that waiting worker is dead too (lost at once: its
 * connection closed), psd gives up after its start timeout (exit 4)
 * instead of waiting for ever. */
Test(short, the_last_worker_lost_with_one_waiting_for_the_next_epoch)
{
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=3200", "--worker-timeout", "2",
                          "--start-timeout", "8", NULL};
    const char *slowed[] = {"--x-slow-ms", "200", NULL};
    for (int dead = 0; dead < 2; dead++) { /* the waiting worker alive, then dead */
        run_t r;
        const char *tag = dead ? "joinlast-dead" : "joinlast";
        pid_t p = start_psd(&r, tag, 1, args);
        pid_t a = start_worker(&r, tag, 0, slowed);
        wait_log(r.psd_log, "training 1 epoch", 60);
        pid_t b = start_worker(&r, tag, 1, NULL);
        wait_log(r.psd_log, "rank 1 joins from epoch 2", 60);
        if (dead) {
            kill(b, SIGKILL);
            cr_assert_eq(proc_wait(b, 10), 128 + SIGKILL);
        }
        kill(a, SIGKILL);
        cr_assert_eq(proc_wait(a, 10), 128 + SIGKILL);
        if (!dead) {
            wait_log(r.psd_log, "rank 1 takes the", 5); /* at once, not after b's own timeout */
            r.psd_code = proc_wait(p, 120);
            cr_assert_eq(r.psd_code, 0, "psd finished the run");
            cr_assert_eq(proc_wait(b, 30), 0);
            char *m = metrics_last(&r);
            cr_assert_eq(json_num(last_line(m), "train_samples"), 3200, "every sample once: %s", last_line(m));
            cr_assert_eq(json_num(last_line(m), "val_samples"), 10000, "%s", last_line(m));
            free(m);
        } else {
            /* b's connection closed with it: lost at once, before a's samples
             * could go to it; nobody comes within 8 s */
            r.psd_code = proc_wait(p, 60);
            cr_assert_eq(r.psd_code, 4, "psd gave up: no worker left (exit %d)", r.psd_code);
            char *log = slurp(r.psd_log);
            const char *bl = log ? strstr(log, "rank 1 (") : NULL, *lost = bl ? strstr(bl, ") lost: ") : NULL;
            cr_assert(lost && !memchr(bl, '\n', (size_t)(lost - bl)) &&
                          strncmp(lost, ") lost: its connection closed", 29) == 0 && !strstr(log, "rank 1 takes the") &&
                          strstr(log, "no worker came back within 8 s"),
                      "%s", log ? log : "");
            free(log);
        }
    }
}

/* psd and `workers` workers, worker 0 slowed by slow_ms a step, train one
 * epoch of `samples` to the end with nobody lost, registering again or
 * giving psd up. */
static void run_slowed(const char *tag, int workers, const char **args, const char *slow_ms, double samples)
{
    run_t r;
    const char *slowed[] = {"--x-slow-ms", slow_ms, NULL};
    pid_t p = start_psd(&r, tag, workers, args), w[2];
    for (int i = 0; i < workers; i++) w[i] = start_worker(&r, tag, i, i == 0 ? slowed : NULL);
    r.psd_code = proc_wait(p, 180);
    for (int i = 0; i < workers; i++) r.worker_code[i] = proc_wait(w[i], 30);
    check_run(&r, workers, 1);
    char *log = slurp(r.psd_log);
    cr_assert(log && !strstr(log, "registers again") && !strstr(log, " lost"), "%s", log ? log : "");
    free(log);
    for (int i = 0; i < workers; i++) {
        char name[64], wl[512];
        snprintf(name, sizeof name, "%s-w%d.log", tag, i);
        path(wl, sizeof wl, name);
        char *l = slurp(wl);
        cr_assert(l && !strstr(l, "sent nothing"), "worker %d gave psd up: %s", i, l ? l : "");
        free(l);
    }
    char *m = metrics_last(&r);
    cr_assert_eq(json_num(last_line(m), "train_samples"), samples, "%s", last_line(m));
    free(m);
}

/* A worker that waits on psd longer than its step timeout (psd's worker
 * timeout x 3 + 10 s) is not waiting on a psd that is gone: in async
 * without rebalancing, the fast worker waits at its barrier while the slow
 * one trains its half of the epoch (about 15 s here, its step timeout about
 * 11.5 s). psd says it is there every second, and nobody registers again or
 * is lost (the fast worker used to give psd up, register again and count as
 * lost). */
Test(short, a_worker_waits_at_its_barrier_longer_than_its_step_timeout)
{
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=6400", "--set", "train.sync=async",
                          "--set", "train.rebalance=false", "--worker-timeout", "0.5", NULL};
    run_slowed("barrierwait", 2, args, "300", 6400);
}

/* Steps longer than the worker timeout (1.8 s a step, psd's limit about 1 s
 * of silence): the worker says it is alive as its layers compute, and the run
 * goes on (it used to be taken for lost at every step, register again, take
 * its samples back and be lost again: no step ever counted). */
Test(short, steps_longer_than_the_worker_timeout_are_not_a_lost_worker)
{
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=192", "--set", "train.batch_size=64",
                          "--worker-timeout", "1", NULL};
    run_slowed("longstep", 1, args, "1800", 192);
}

/* A peer that registers during training and never says its data is ready
 * is forgotten after the start timeout (its slot is no longer kept as a
 * worker to come), and the run goes on. */
Test(short, a_registration_never_ready_is_forgotten)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=3200", "--start-timeout", "2", NULL};
    const char *slowed[] = {"--x-slow-ms", "150", NULL};
    pid_t p = start_psd(&r, "neverready", 1, args);
    pid_t w = start_worker(&r, "neverready", 0, slowed);
    wait_log(r.psd_log, "training 1 epoch", 60);
    void *ctx = zmq_ctx_new(), *d = raw_dealer(ctx, r.endpoint);
    ps_msg_t m = {0};
    cr_assert_eq(raw_register(d, &m), 0);
    cr_assert_eq(m.hdr->type, PSD__MSG_TYPE__MSG_ASSIGN);
    wait_log(r.psd_log, "never said it was ready; forgetting it", 30);
    r.psd_code = proc_wait(p, 120);
    r.worker_code[0] = proc_wait(w, 30);
    check_run(&r, 1, 1);
    ps_msg_deinit(&m);
    zmq_close(d);
    zmq_ctx_term(ctx);
}

/* Stops and resumes that could not be what they say are refused up front or
 * fail loudly: --stop-after-epoch without checkpoints, --save into a
 * directory that is not there (found at start, not after the training), a
 * checkpoint resumed with another optimizer of the same slot count (even
 * forced), and a stop whose checkpoint fails (exit 1, not "checkpoint
 * saved"). */
Test(short, stops_and_resumes_that_cannot_work_are_refused)
{
    cr_assert_eq(run_cmd("'%s' --stop-after-epoch 1 --set checkpoint.dir= --listen tcp://127.0.0.1:1 > '%s/nock.txt' 2>&1",
                         psd_bin, dir), 2);
    char out[512];
    path(out, sizeof out, "nock.txt");
    char *t = slurp(out);
    cr_assert(t && strstr(t, "--stop-after-epoch needs checkpoints"), "%s", t ? t : "");
    free(t);
    cr_assert_eq(run_cmd("'%s' --save '%s/no/such/dir/w.bin' --listen tcp://127.0.0.1:1 > '%s/nosave.txt' 2>&1", psd_bin,
                         dir, dir), 2);
    path(out, sizeof out, "nosave.txt");
    t = slurp(out);
    cr_assert(t && strstr(t, "cannot write in") && strstr(t, "No such file or directory"), "%s", t ? t : "");
    free(t);
    /* a checkpoint of SGD with momentum (one slot), resumed as Adagrad (one slot) */
    char ck[256], arg[300];
    path(ck, sizeof ck, "optck");
    snprintf(arg, sizeof arg, "checkpoint.dir=%s", ck);
    const char *stop[] = {"--epochs", "2", "--set", "data.train_limit=1000", "--set", arg, "--stop-after-epoch", "1",
                          NULL};
    run_t a;
    train(&a, "optstop", 1, stop, 120);
    cr_assert_eq(a.psd_code, 0);
    const char *res[] = {"--epochs", "2", "--set", "data.train_limit=1000", "--set", arg, "--resume", ck,
                         "--force-resume", "--set", "optimizer.name=adagrad", NULL};
    run_t b;
    pid_t p = start_psd(&b, "optres", 1, res);
    cr_assert_eq(proc_wait(p, 60), 2, "another optimizer's state is not resumed");
    t = slurp(b.psd_log);
    cr_assert(t && strstr(t, "its optimizer does not match this config"), "%s", t ? t : "");
    free(t);
    /* --check-config --resume says the same (it checks what a resume checks, but the data) */
    cr_assert_eq(run_cmd("'%s' --resume '%s' --force-resume --set optimizer.name=adagrad --check-config > /dev/null "
                         "2>&1", psd_bin, ck), 2);
    cr_assert_eq(run_cmd("'%s' --resume '%s' --force-resume --set 'model.layers=[784,32,10]' --check-config > "
                         "/dev/null 2>&1", psd_bin, ck), 2);
    cr_assert_eq(run_cmd("'%s' --resume '%s' --epochs 2 --set data.train_limit=1000 --set '%s' --check-config > "
                         "/dev/null 2>&1", psd_bin, ck, arg), 0, "the same config would resume");
    /* the checkpoint of a stop fails (its directory is gone): exit 1, and the workers are told */
    char ck2[256], arg2[300];
    path(ck2, sizeof ck2, "goneck");
    snprintf(arg2, sizeof arg2, "checkpoint.dir=%s", ck2);
    const char *gone[] = {"--epochs", "2", "--set", "data.train_limit=1000", "--set", arg2, "--stop-after-epoch", "1",
                          NULL};
    const char *slowed[] = {"--x-slow-ms", "100", NULL};
    run_t c;
    p = start_psd(&c, "goneck", 1, gone);
    pid_t w = start_worker(&c, "goneck", 0, slowed);
    wait_log(c.psd_log, "training 2 epochs", 60);
    cr_assert_eq(run_cmd("rm -rf '%s'", ck2), 0);
    c.psd_code = proc_wait(p, 120);
    c.worker_code[0] = proc_wait(w, 30);
    t = slurp(c.psd_log);
    cr_assert_eq(c.psd_code, 1, "exit 1 (got %d): %s", c.psd_code, t ? t : "");
    cr_assert(t && strstr(t, "checkpoint failed") && !strstr(t, "checkpoint saved"), "%s", t ? t : "");
    free(t);
    path(out, sizeof out, "goneck-w0.log");
    t = slurp(out);
    cr_assert(t && strstr(t, "psd ended the run: psd stopped; its checkpoint failed"), "%s", t ? t : "");
    free(t);
    cr_assert_eq(c.worker_code[0], 1, "the worker exits with psd's code");
}

/* The congestion control of the established tcp connections to (sport) and
 * from (dport) port `port`, as `ss` shows them: how many it listed, and how
 * many of them use `cc` (the first word of each one's info line). */
static int conns_using(int port, const char *cc, int *total)
{
    char out[256], cmd[512];
    path(out, sizeof out, "ss.txt");
    snprintf(cmd, sizeof cmd, "ss -Htin state established '( sport = :%d or dport = :%d )' > '%s' 2>&1", port, port,
             out);
    cr_assert_eq(run_cmd("%s", cmd), 0, "ss (iproute2: deploy/setup.sh installs it) failed");
    char *txt = slurp(out);
    cr_assert(txt);
    int n = 0, hits = 0;
    for (char *line = strtok(txt, "\n"); line; line = strtok(NULL, "\n")) {
        if (line[0] != ' ' && line[0] != '\t') continue; /* the address line; its info follows, indented */
        n++;
        while (*line == ' ' || *line == '\t') line++;
        size_t k = strlen(cc);
        if (strncmp(line, cc, k) == 0 && (line[k] == ' ' || line[k] == '\0')) hits++;
    }
    free(txt);
    *total = n;
    return hits;
}

/* psd and the worker each set server.tcp_congestion on their side of the
 * connection (psd from the worker's messages, the worker from ASSIGN):
 * named (reno), every end uses it; auto: no loopback end is left on bbr
 * (where the kernel's default is bbr, both ends moved off it). Polled
 * while the training runs over tcp; psd is then stopped. */
static void cc_run(const char *tag, const char *setting, const char *want, const char *unwanted)
{
    run_t r;
    char set[64];
    snprintf(set, sizeof set, "server.tcp_congestion=%s", setting);
    const char *extra[] = {"--set", "run.epochs=30", "--set", set, "--set", "checkpoint.dir=", NULL};
    const char *wire[] = {"--no-shm", NULL};
    pid_t p = start_psd(&r, tag, 1, extra);
    int port = atoi(strrchr(r.endpoint, ':') + 1);
    pid_t w = start_worker(&r, tag, 0, wire);
    int total = 0, good = 0;
    for (double t0 = ps_now(); ps_now() - t0 < 60; usleep(100000)) {
        int hits = conns_using(port, want ? want : unwanted, &total);
        good = want ? hits : total - hits;
        if (total >= 2 && good == total) break; /* both ends, as wanted */
    }
    kill(p, SIGTERM);
    int pc = proc_wait(p, 60), wc = proc_wait(w, 30);
    cr_assert_eq(total, 2, "%s: ss shows %d ends of the worker's connection, not 2", tag, total);
    if (want)
        cr_assert_eq(good, total, "%s: %d of the %d ends use %s", tag, good, total, want);
    else
        cr_assert_eq(good, total, "%s: %d of the %d ends are on %s", tag, total - good, total, unwanted);
    cr_assert(pc == 0 || pc == 143 || pc == 130, "%s: psd exited %d", tag, pc);
    cr_assert(wc == 0, "%s: the worker exited %d", tag, wc);
}

Test(short, tcp_connections_use_the_congestion_control_psd_is_given)
{
    cc_run("ccreno", "reno", "reno", NULL);
    cc_run("ccauto", "auto", NULL, "bbr");
    char err[512];
    int rc = run_cmd("%s --set server.tcp_congestion=no_such_cc --check-config > %s/cc.txt 2>&1", psd_bin, dir);
    cr_assert_eq(rc, 2, "an unusable congestion control is a configuration error (exit %d)", rc);
    snprintf(err, sizeof err, "%s/cc.txt", dir);
    char *txt = slurp(err);
    cr_assert(txt && strstr(txt, "server.tcp_congestion") && strstr(txt, "no_such_cc"), "%s", txt ? txt : "");
    free(txt);
}
