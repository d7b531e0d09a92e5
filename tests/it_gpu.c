/* it_gpu.c - integration tests: GPU workers on the CUDA emulator; long runs on all 60000 samples
 * (see itest.h). */
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
