/* psd_opts.h - what every part of psd shares about a run: its exit codes,
 * the options of the process (flags beyond the config), and the decisions
 * every psd shard takes alike from the config (checkpoints kept, step
 * threads, where the embedding table lives). Plain data and pure
 * functions: no part of psd below it. */
#ifndef PSD_OPTS_H
#define PSD_OPTS_H

#include <stdbool.h>
#include <stdint.h>

#include "ps_config.h"
#include "ps_model.h"

/* Exit codes of psd (README). */
enum {
    PSD_EXIT_OK = 0,
    PSD_EXIT_ERROR = 1,         /* runtime failure (I/O, memory) */
    PSD_EXIT_USAGE = 2,         /* bad flags, config or data */
    PSD_EXIT_START_TIMEOUT = 3, /* not all workers registered in time */
    PSD_EXIT_WORKER_LOST = 4,   /* a worker went silent past worker_timeout */
    PSD_EXIT_SHARD_LOST = 5,    /* a psd shard went silent, failed or refused the run */
    PSD_EXIT_METRICS = 6,       /* the run finished, but a write to its metrics file failed */
};

/* Floats of a psd shard's part shard 0 asks for at a time at the end of a
 * run, to write the weights file (16 MiB) */
#define PSD_FETCH_FLOATS ((uint64_t)4 << 20)

typedef struct {
    const char *resume_dir; /* --resume DIR: continue from its newest valid checkpoint */
    int force_resume;       /* --force-resume: even if the config differs */
    int stop_after_epoch;   /* --stop-after-epoch E: checkpoint and stop after epoch E (1-based) */
    int no_zap;             /* tests only: keys but no authentication handler (everyone refused) */
    int verify_weights;     /* tests only: weights messages carry their version's CRC-32 */
    uint64_t fetch_floats;  /* tests only: floats per chunk of a shard's part fetched for --save
                             * (0: PSD_FETCH_FLOATS) */
    int break_fetch;        /* tests only: a shard answers SHARD_FETCH with its last frame a float short */
    int die_after_metrics;  /* tests only: SIGKILL itself right after epoch E's metrics line (0: never) */
    int max_workers;        /* tests only: worker slots before gone ones are reused (0: all 1024) */
    int shard, shards;      /* --shard i/n: this psd holds part i of n (shards 0: one psd) */
    const char *leader;     /* shard i > 0: shard 0's endpoint */
    const char *advertise;  /* shard i > 0: the endpoint workers reach it at (default: where it listens) */
    int check;              /* --check-config: every check of the start, its socket bound and closed, then 0
                             * (nothing written, nothing trained) */
} psd_run_opts_t;

/* Checkpoints kept (checkpoint.keep), at least 2 with psd shards: a kill
 * between the shards' writes of one step leaves the step before on every
 * shard (shard 0 asks for a checkpoint only once each shard confirmed the
 * one before). */
int psd_ckpt_keep(const ps_config_t *c, int shards);
/* Threads of a step: server.threads, or the CPUs psd may use
 * (ps_cpus_usable: affinity mask, cgroup quota; at most 16). */
int psd_step_threads(const ps_config_t *c);
/* The embedding table of layout l stays on psd (workers hold only their
 * batches' rows: CtrTask.table_on_psd): it is larger than
 * ctr.worker_table_mb, stepped by rows (`lazy`: one psd, steps not
 * streamed, or shards whose pieces are whole rows) and f32 both ways.
 * Shard 0 and the other shards decide alike. */
bool psd_table_on_psd(const ps_config_t *c, const ps_layout_t *l, bool lazy);

#endif
