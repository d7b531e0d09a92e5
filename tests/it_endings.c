/* it_endings.c - how a pworker's run ends (docs/usage.md "How a worker's run
 * ends"): done, left, lost, failed, refused, each with its exit code, psd's
 * log line and its count in the metrics file; the run's last log line says
 * it finished with fewer workers. (psd.torch's endings:
 * python/tests/test_endings.py; a library worker refused for a message psd
 * cannot take: it_client.c and it_shards.c.) */
#include <criterion/criterion.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "itest.h"
#include "proc.h"
#include "ps_util.h"
#include "ps_wire.h"
#include <zmq.h>

/* Of 4 pworkers of one run (each step slowed to 30 ms, so that the run is
 * under way when the others end): one trains to the end (exit 0), one is
 * sent SIGTERM (it leaves: exit 0), one is killed (lost, at once: its
 * connection closed), one fails (its GPU, on the CUDA emulator, faults at
 * its 200th kernel launch: exit 1, psd told why); a fifth of another
 * protocol is refused (exit 2). psd finishes (exit 0) with every sample
 * trained once an epoch, counts each ending apart and says so last. */
Test(short, each_way_a_pworkers_run_ends_has_its_exit_code_log_line_and_count)
{
    const char *emu = getenv("PSD_CUDA_EMU");
    if (!emu || !*emu) cr_skip_test("no CUDA emulator plugin in this build (PSD_CUDA_EMU): no GPU to fail");
    setenv("PSW_CUDA_PLUGIN", emu, 1);
    setenv("PSW_CUDA_EMU_DEVICES", "1", 1);
    setenv("PSW_CUDA_EMU_MIB", "4096", 1);
    setenv("PSW_CUDA_EMU_FAIL", "0:200", 1);
    unsetenv("CUDA_VISIBLE_DEVICES");
    run_t r;
    const char *args[] = {"--epochs", "2", "--set", "data.train_limit=8000", "--worker-timeout", "120", NULL};
    pid_t p = start_psd(&r, "end", 4, args);
    const char *cpu[] = {"--devices", "cpu", "--x-slow-ms", "30", NULL};
    const char *gpu[] = {"--devices", "0", "--x-slow-ms", "30", NULL};
    pid_t w[4];
    for (int i = 0; i < 3; i++) w[i] = start_worker(&r, "end", i, cpu);
    w[3] = start_worker(&r, "end", 3, gpu);
    wait_log(r.psd_log, "training 2 epochs", 60);
    usleep(400 * 1000);
    kill(w[1], SIGTERM);
    kill(w[2], SIGKILL);
    char out[256];
    path(out, sizeof out, "end-refused.log");
    cr_assert_eq(run_cmd("'%s' --connect %s --devices cpu --x-protocol 3 > '%s' 2>&1", pworker_bin, r.endpoint, out),
                 2, "a worker psd refuses exits 2");
    r.psd_code = proc_wait(p, 240);
    int code[4];
    for (int i = 0; i < 4; i++) code[i] = proc_wait(w[i], 30);
    cr_assert_eq(r.psd_code, 0, "psd finished the run");
    cr_assert_eq(code[0], 0, "done: exit 0");
    cr_assert_eq(code[1], 0, "left on SIGTERM: exit 0");
    cr_assert_eq(code[2], 128 + SIGKILL, "killed");
    cr_assert_eq(code[3], 1, "failed (its device): exit 1");
    char *log = slurp(r.psd_log);
    cr_assert(log, "psd's log");
    cr_assert(strstr(log, "left the run: worker stopped by a signal"), "%s", log);
    cr_assert(strstr(log, "lost: its connection closed"), "%s", log);
    cr_assert(strstr(log, "failed: device cuda:0 failed: psw_cuda: "), "%s", log);
    cr_assert(strstr(log, "refused a worker from"), "%s", log);
    cr_assert_null(strstr(log, "nothing from it"), "every ending told or seen at once: %s", log);
    cr_assert_eq(count_in(log, "a step now averages the batches of"), 1, "logged once: %s", log);
    cr_assert(strstr(last_line(log),
                     "the run finished with 1 of the 4 workers it started with: 1 failed, 1 lost, 1 left, 0 refused"),
              "the last line: %s", last_line(log));
    free(log);
    char *m = metrics_last(&r);
    const char *l = last_line(m);
    cr_assert_eq(json_num(l, "train_samples"), 8000, "%s", l);
    cr_assert_eq(json_num(l, "workers"), 1, "%s", l);
    cr_assert_eq(json_num(l, "workers_left"), 1, "%s", l);
    cr_assert_eq(json_num(l, "workers_lost"), 1, "%s", l);
    cr_assert_eq(json_num(l, "workers_failed"), 1, "%s", l);
    cr_assert_eq(json_num(l, "workers_refused"), 0, "a refusal at registration is no worker's ending: %s", l);
    free(m);
    char *t = slurp(out);
    cr_assert(t && strstr(t, "protocol"), "the refused worker says why: %s", t ? t : "");
    free(t);
}

/* One wrong message of a registered worker (a raw DEALER: registered, then
 * h with its run id, rank and sequence number 2; frame fr if any, or raw
 * bytes `junk` instead of a message): psd ends that worker's run, SHUTDOWN
 * exit 2 with a reason holding `why`, within 10 s. */
static void wrong_one(const run_t *r, void *ctx, Psd__Header *h, const char *junk, const char *why)
{
    void *d = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(d, ZMQ_LINGER, &zero, sizeof zero);
    cr_assert_eq(zmq_connect(d, r->endpoint), 0);
    ps_msg_t m;
    cr_assert_eq(raw_register(d, &m), 0, "psd answers a raw REGISTER");
    cr_assert_eq(m.hdr->type, PSD__MSG_TYPE__MSG_ASSIGN, "registered (%s)", why);
    h->run_id = m.hdr->run_id;
    h->rank = m.hdr->assign->rank;
    h->seq = 2;
    ps_msg_deinit(&m);
    if (junk) cr_assert_eq(zmq_send(d, junk, strlen(junk), 0), (int)strlen(junk));
    else cr_assert_eq(ps_msg_send(d, NULL, 0, h, NULL, 0), 0);
    double end = ps_now() + 10;
    char err[256];
    for (;;) {
        cr_assert(ps_now() < end, "no SHUTDOWN for a %s within 10 s", why);
        zmq_pollitem_t it = {d, 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, 100) <= 0 || ps_msg_recv(d, &m, false, ZMQ_DONTWAIT, err, sizeof err) != 0) continue;
        const bool sd = m.hdr->type == PSD__MSG_TYPE__MSG_SHUTDOWN;
        if (sd) {
            const char *reason = m.hdr->shutdown->reason ? m.hdr->shutdown->reason : "";
            cr_assert(m.hdr->shutdown->exit_code == 2 && strstr(reason, "psd refused this worker: ") &&
                          strstr(reason, why),
                      "SHUTDOWN exit %d '%s' for a %s", m.hdr->shutdown->exit_code, reason, why);
        }
        ps_msg_deinit(&m);
        if (sd) break;
    }
    zmq_close(d);
}

/* No message psd cannot take from a registered worker is dropped into a
 * retry loop: each kind a worker may get wrong before training (a PULL, a
 * PUSH, a BARRIER, a VAL_RESULT out of turn, a READY with a bad
 * fingerprint, a message type workers do not send, bytes that are no
 * message) ends that worker's run with psd's reason (exit 2), logged with
 * its rank and counted refused; nothing of a registered worker is logged
 * as dropped. (Those of a run's training: it_client.c, it_shards.c,
 * python/tests/test_endings.py.) */
Test(short, every_wrong_message_of_a_registered_worker_ends_its_run)
{
    run_t r;
    const char *args[] = {"--set", "model.layers=[784,10]", "--set", "checkpoint.dir=", "--start-timeout", "120",
                          NULL};
    pid_t p = start_psd(&r, "wrong", 2, args);
    void *ctx = zmq_ctx_new();
    Psd__Header h = PSD__HEADER__INIT;
    Psd__Pull pl = PSD__PULL__INIT;
    h.type = PSD__MSG_TYPE__MSG_PULL, h.body_case = PSD__HEADER__BODY_PULL, h.pull = &pl;
    wrong_one(&r, ctx, &h, NULL, "PULL while");
    Psd__Push pu = PSD__PUSH__INIT;
    pu.batch = 1;
    h = (Psd__Header)PSD__HEADER__INIT;
    h.type = PSD__MSG_TYPE__MSG_PUSH, h.body_case = PSD__HEADER__BODY_PUSH, h.push = &pu;
    wrong_one(&r, ctx, &h, NULL, "PUSH while");
    Psd__Barrier b = PSD__BARRIER__INIT;
    h = (Psd__Header)PSD__HEADER__INIT;
    h.type = PSD__MSG_TYPE__MSG_BARRIER, h.body_case = PSD__HEADER__BODY_BARRIER, h.barrier = &b;
    wrong_one(&r, ctx, &h, NULL, "BARRIER for epoch");
    Psd__ValResult v = PSD__VAL_RESULT__INIT;
    h = (Psd__Header)PSD__HEADER__INIT;
    h.type = PSD__MSG_TYPE__MSG_VAL_RESULT, h.body_case = PSD__HEADER__BODY_VAL_RESULT, h.val_result = &v;
    wrong_one(&r, ctx, &h, NULL, "VAL_RESULT");
    Psd__Ready rd = PSD__READY__INIT;
    rd.data_id = "\x01 not printable";
    h = (Psd__Header)PSD__HEADER__INIT;
    h.type = PSD__MSG_TYPE__MSG_READY, h.body_case = PSD__HEADER__BODY_READY, h.ready = &rd;
    wrong_one(&r, ctx, &h, NULL, "READY with a data fingerprint");
    Psd__Weights wt = PSD__WEIGHTS__INIT;
    h = (Psd__Header)PSD__HEADER__INIT;
    h.type = PSD__MSG_TYPE__MSG_WEIGHTS, h.body_case = PSD__HEADER__BODY_WEIGHTS, h.weights = &wt;
    wrong_one(&r, ctx, &h, NULL, "WEIGHTS is not a message workers send");
    wrong_one(&r, ctx, &h, "no message at all", "");
    zmq_ctx_term(ctx);
    wait_log(r.psd_log, "refused: ", 10);
    kill(p, SIGTERM);
    cr_expect_eq(proc_wait(p, 60), 0, "psd");
    char *log = slurp(r.psd_log);
    cr_expect_eq(count_in(log, "; its run ends (exit 2)"), 7, "%s", log);
    cr_expect_eq(count_in(log, "dropped a message from rank"), 0, "%s", log);
    free(log);
}
