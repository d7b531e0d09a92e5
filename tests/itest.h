/* itest.h - what the integration tests share (test_integration.c and the
 * it_*.c files by area, linked into one executable): the suites' set-up
 * (a fresh directory a test, every process started ended by PID), starting
 * psd and workers on free loopback ports, and the checks of a finished run.
 * The suites "short" (CI also runs them under ASan/UBSan) and "long" are
 * declared in itest.c. */
#ifndef TEST_ITEST_H
#define TEST_ITEST_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "ps_model.h"
#include "ps_wire.h"
#include "psworker.h"

extern char dir[128];                       /* the test's directory (processes run there) */
extern const char *psd_bin, *pworker_bin;   /* from meson: PSD_BIN, PWORKER_BIN */

#define MAXW 8
typedef struct {
    int psd_code;
    int worker_code[MAXW];
    char metrics[256], weights[256], psd_log[256];
    char endpoint[64];
} run_t;

/* The metrics schema psd writes (README "Metrics file"). */
#define IT_METRICS_SCHEMA 2

extern const char *slice[]; /* 1 epoch of 4000 training samples */

void it_setup(void);
void it_teardown(void);
/* dir/name into out. */
void path(char *out, size_t n, const char *name);
/* The log of the worker that got rank 0 among the `workers` of run `tag`;
 * NULL if none. Caller frees. */
char *rank0_log(const char *tag, int workers);
/* psd for `workers` workers with <tag>-metrics.jsonl, <tag>-weights.bin and
 * <tag>-psd.log in dir, on a free port, and the extra args (NULL-terminated). */
pid_t start_psd(run_t *r, const char *tag, int workers, const char **extra);
/* Worker i of run r (log <tag>-w<i>.log), with extra args. */
pid_t start_worker(run_t *r, const char *tag, int i, const char **extra);
/* psd + N workers (each with worker_extra) to the end. */
void train_wx(run_t *r, const char *tag, int workers, const char **extra, const char **worker_extra, double timeout);
void train(run_t *r, const char *tag, int workers, const char **extra, double timeout);
/* The metrics file (caller frees); fails the test if there is none. */
char *metrics_last(const run_t *r);
/* Built with sanitizers (meson sets PSD_TEST_SANITIZED). */
bool sanitized(void);
/* The last epoch validated every test sample once. */
void assert_validated_all(const run_t *r);
/* psd and every worker exited 0, one metrics line an epoch, the last one whole. */
void check_run(const run_t *r, int workers, int epochs);
/* Weights files equal but for the header's run id. */
int weights_equal(const char *a, const char *b);
/* Wait until psd's metrics file has at least n lines (60 s for each new one). */
void wait_metrics(const run_t *r, int n);
/* Wait until text appears in file, or fail the test. */
void wait_log(const char *file, const char *text, double timeout_s);
/* A shell command's exit code (128: it did not exit). */
int run_cmd(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Occurrences of what in text. */
int count_in(const char *text, const char *what);
void assert_workers_verified(const char *tag, int n, const char *what);
void check_every_epoch(const run_t *r, int epochs, uint64_t train);
int dev_shm_files_of(pid_t pid, int *memfd);
Psd__Header fake_hdr(Psd__MsgType type, uint64_t seq);
unsigned fault_seed(void);
float *lib_model(ps_layout_t *l, int hidden);
void lib_next(psw_client_t *c, psw_event_t *ev, psw_event_kind_t kind);
void lib_push(psw_client_t *c, uint64_t version, uint32_t batch, int pull, const float *zero, const ps_layout_t *l);
void lib_start(const char *ep, psw_client_t **w, int n, size_t samples);
void *raw_dealer(void *ctx, const char *endpoint);
int raw_register(void *sock, ps_msg_t *m);
void run_cmd_out(const char *cmd, char *out, size_t n);
pid_t start_shard(const run_t *r, const char *tag, int i, int n, const char **extra);
pid_t start_shard_at(const run_t *r, const char *tag, int i, int n, const char **extra, char *ep_out);
void train_ok(run_t *r, const char *tag, int shards, const char **args, const char **wex);
void train_sharded(run_t *r, const char *tag, int n, const char **extra, const char **worker_extra);
bool unix_socket_listed(const char *name);
bool a_run_ok(const run_t *r);
psw_client_t *lib_worker(const char *ep, char *err, size_t n);
psw_client_t *lib_worker_shm(const char *ep, int shm, char *err, size_t n);

/* A push's arguments for every tensor of l's table (at most LIB_GRADS_MAX),
 * the gradient from grad (laid out as l). */
#define LIB_GRADS_MAX 512
typedef struct {
    psw_grad_t gr[LIB_GRADS_MAX]; /* every tensor whole, in order */
    int n;
} lib_grads_t;
void lib_grads(lib_grads_t *a, const ps_layout_t *l, const float *grad);

#endif
