/* psd_metrics.h - the run's metrics file (server.metrics, --metrics): one
 * JSON line an epoch, appended.
 *
 * Every line is written whole with write(2) and fsync'ed: a failure (a full
 * disk, an I/O error) is logged once, with the file and the error, and the
 * file is then incomplete: later lines are not written (a torn line would
 * make them unreadable), psd's run says so at its end and exits
 * PSD_EXIT_METRICS. On --resume, psd_metrics_trim drops the lines of the
 * resumed run's epochs past its checkpoint (a kill between an epoch's line
 * and its checkpoint, or a failed checkpoint, left them): the resumed psd
 * writes those epochs again, so the file holds each epoch once.
 *
 * Ownership: psd's run owns one psd_metrics_t (the loop thread only); the
 * caller holds the file's lock (psd_lock.h) before trimming or opening. */
#ifndef PSD_METRICS_H
#define PSD_METRICS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ps_config.h" /* PS_PATH_MAX */

typedef struct {
    int fd;                 /* -1: no file */
    char path[PS_PATH_MAX];
    int err;                /* errno of the first failed write; 0: none */
    uint32_t lost;          /* lines not written (that one and those after it) */
} psd_metrics_t;

void psd_metrics_init(psd_metrics_t *m);
/* Open path for appending (created if missing): 0, or -errno with err. */
int psd_metrics_open(psd_metrics_t *m, const char *path, char *err, size_t n);
/* Append one line (ending in '\n') and fsync it: 0, or -errno (logged the
 * first time; after a failure nothing more is written). */
int psd_metrics_write(psd_metrics_t *m, const char *line, size_t len);
/* Drop the lines of run run_id (hex in "run_id") whose "epoch" is past
 * epochs_done, and a last line cut short, by writing the rest to a temp
 * file renamed over path (an open m is moved to the new file). Lines of
 * other runs stay. Returns how many lines were dropped, or -errno with err.
 * A path that is not a regular file (or does not exist) is left alone. */
int psd_metrics_trim(psd_metrics_t *m, const char *path, uint64_t run_id, uint32_t epochs_done, char *err,
                     size_t n);
/* A line that could not be written (e: errno; what: "write", "build"...):
 * counted, logged the first time. Returns -e. */
int psd_metrics_failed(psd_metrics_t *m, int e, const char *what);
/* Close it: 0, or -errno (a failed close makes it incomplete too). */
int psd_metrics_close(psd_metrics_t *m);
/* Some line was not written. */
static inline bool psd_metrics_incomplete(const psd_metrics_t *m) { return m->err != 0; }

/* A histogram of durations (seconds) for /metrics (a worker's step times):
 * counts by bucket (psd_hist_le's upper bounds, then +Inf) and their sum. */
#define PSD_HIST_N 12
extern const double psd_hist_le[PSD_HIST_N];
typedef struct {
    uint64_t n[PSD_HIST_N + 1];
    double sum;
} psd_hist_t;
/* v (finite, >= 0) counted in its bucket. */
void psd_hist_add(psd_hist_t *h, double v);
/* Values counted. */
uint64_t psd_hist_count(const psd_hist_t *h);

#endif
