/* it_diverge.c - integration tests (see itest.h): a run whose training
 * diverges stops with a reason, and saves nothing (psd_diverge.h). */
#include <criterion/criterion.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "itest.h"
#include "proc.h"

/* A run of opt at learning rate 1e6 (constant): psd stops it as diverged
 * (exit 1, the workers told: exit 1), says at which step and why, and
 * leaves no weights file; returns psd's log (caller frees). */
static char *explode(const char *tag, const char *opt, const char **more)
{
    run_t r;
    char name[64];
    snprintf(name, sizeof name, "optimizer.name=%s", opt);
    const char *args[32] = {"--epochs", "3", "--set", "data.train_limit=3000", "--set", name,
                            "--set", "optimizer.lr=1e6", "--set", "schedule.name=constant"};
    int n = 10;
    for (int i = 0; more && more[i]; i++) args[n++] = more[i];
    args[n] = NULL;
    pid_t p = start_psd(&r, tag, 2, args);
    pid_t w0 = start_worker(&r, tag, 0, NULL), w1 = start_worker(&r, tag, 1, NULL);
    int code = proc_wait(p, 300);
    char *log = slurp(r.psd_log);
    cr_assert(log, "psd's log");
    size_t len = strlen(log); /* Criterion drops long messages: the tail */
    const char *tail = log + (len > 1500 ? len - 1500 : 0);
    cr_assert_eq(code, 1, "psd exits 1 (%d):\n%s", code, tail);
    cr_assert_eq(proc_wait(w0, 60), 1, "the workers are told and exit 1");
    cr_assert_eq(proc_wait(w1, 60), 1);
    cr_assert(strstr(log, "training diverged at step"), "says why:\n%s", tail);
    cr_assert(strstr(log, "lower optimizer.lr"), "and what to change:\n%s", tail);
    cr_assert(!strstr(log, "saved weights"), "saves nothing:\n%s", tail);
    cr_assert(access(r.weights, F_OK) != 0, "no weights file %s", r.weights);
    cr_assert(!strstr(log, "lost: nothing from it"), "no worker declared lost");
    return log;
}

/* Adam and Adagrad take steps of about lr whatever the gradient: at lr 1e6
 * the loss goes to 1e20 and beyond and stays finite (the run used to train
 * on to its end at val_acc 0.1 and save that). It is stopped at the second
 * step, the first one compared with the run's start. */
Test(short, adam_at_a_huge_learning_rate_stops_as_diverged)
{
    char *log = explode("adam", "adam", NULL);
    cr_assert(strstr(log, "training diverged at step 2 (epoch 1): the mean loss of the last 2 steps"), "%s", log);
    cr_assert(strstr(log, "times the loss the run started at") && strstr(log, "train.divergence.factor"), "%s", log);
    free(log);
}

Test(short, adagrad_at_a_huge_learning_rate_stops_as_diverged)
{
    char *log = explode("adagrad", "adagrad", NULL);
    cr_assert(strstr(log, "times the loss the run started at"), "%s", log);
    free(log);
}

/* The same with steps streamed chunk by chunk (train.stream) and with each
 * push a step of its own (async): every way a step is taken is checked. */
Test(short, divergence_is_caught_in_streamed_and_async_steps)
{
    static const char *stream[] = {"--set", "train.stream=true", NULL};
    static const char *async[] = {"--set", "train.sync=async", NULL};
    free(explode("dstream", "adam", stream));
    free(explode("dasync", "adagrad", async));
}

/* A config whose inputs f32 training cannot learn from is refused by the
 * check, as by the start: exit 2, one line naming the key. */
Test(short, a_config_that_cannot_learn_is_refused)
{
    char out[256], cmd[1024];
    path(out, sizeof out, "check.txt");
    snprintf(cmd, sizeof cmd, "'%s' --listen tcp://127.0.0.1:0 --check-config --set data.normalize_std=1e-300 > '%s' 2>&1", psd_bin, out);
    int st = system(cmd);
    char *t = slurp(out);
    cr_assert(t);
    cr_assert(WIFEXITED(st) && WEXITSTATUS(st) == 2, "exit 2: %s", t);
    cr_assert(strstr(t, "data.normalize_std: 1e-300") && strstr(t, "cannot learn"), "says why: %s", t);
    cr_assert_eq(count_lines(t), 1, "one line: %s", t);
    free(t);
    snprintf(cmd, sizeof cmd, "'%s' --listen tcp://127.0.0.1:0 --check-config --set train.divergence.factor=off > '%s' 2>&1", psd_bin, out);
    cr_assert_eq(system(cmd), 0, "off is a value of train.divergence.factor");
}
