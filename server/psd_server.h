/* psd_server.h - the run: registration, data ranges, synchronous steps,
 * barriers, validation, metrics; a libuv loop over one ZeroMQ ROUTER. */
#ifndef PSD_SERVER_H
#define PSD_SERVER_H

#include <stdbool.h>

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
} psd_run_opts_t;

/* Checkpoints kept (checkpoint.keep), at least 2 with psd shards: a kill
 * between the shards' writes of one step leaves the step before on every
 * shard (shard 0 asks for a checkpoint only once each shard confirmed the
 * one before). */
int psd_ckpt_keep(const ps_config_t *c, int shards);
/* Threads of a step: server.threads, or the CPUs psd may use
 * (ps_cpus_usable: affinity mask, cgroup quota; at most 16). */
int psd_step_threads(const ps_config_t *c);
/* ZeroMQ I/O threads: server.io_threads, or 1 on one usable CPU, 2, and
 * usable/4 up to 4 from 12 on. */
int psd_io_threads(const ps_config_t *c);
/* The I/O threads for `cores` usable CPUs (server.io_threads: 0). */
int psd_io_threads_for(int cores);
/* The embedding table of layout l stays on psd (workers hold only their
 * batches' rows: CtrTask.table_on_psd): it is larger than
 * ctr.worker_table_mb, stepped by rows (`lazy`: one psd, steps not
 * streamed, or shards whose pieces are whole rows) and f32 both ways.
 * Shard 0 and the other shards decide alike. */
bool psd_table_on_psd(const ps_config_t *c, const ps_layout_t *l, bool lazy);
/* A ZeroMQ context with psd_io_threads I/O threads. NULL if it cannot be
 * made. */
void *psd_zmq_context(const ps_config_t *c);

/* Seconds a message of the whole model (n_params floats) may take on the
 * wire: its bytes at 40 MB/s, at most 57 s. ZeroMQ hands a message over only
 * whole (and counts only whole messages in its heartbeats, libzmq issue
 * 2709), so a peer is silent while one of that size is on its way. */
double psd_transfer_s(size_t n_params);
/* The silence after which a peer psd waits for is lost: worker_timeout, plus
 * a model-sized message each way (a reply that is still arriving, then a
 * push on its way back). */
double psd_silence_limit(const ps_config_t *c, size_t n_params);

struct psd_zap;
struct psd_locks;
/* psd's ROUTER socket on `listen`: CURVE with the allow-list (failing
 * closed) when the config has a key, else the loopback rule; options; bind.
 * allow_self: also let in psd's own key (shards connect with it).
 * *monp: a PAIR with the socket's events (psd_router_monitor), when there
 * are any to watch: failed handshakes (with a key), closed connections
 * (watch_closed). An ipc:// path is locked first (its <path>.lock, into
 * locks): a second psd on it is refused. 0, or the exit code (logged);
 * *sockp, *zapp, *monp are the caller's to close. */
int psd_router_open(void *zctx, const ps_config_t *c, const char *listen, int no_zap, size_t n_params, bool allow_self,
                    bool watch_closed, struct psd_locks *locks, void **sockp, struct psd_zap **zapp, void **monp);
/* Read the events waiting on mon (psd_router_open's *monp, or a monitor of
 * another socket with these events): each refused
 * handshake counts in *refused and is logged (the first 20, then every
 * 1000th; libzmq 4.3 does not say which peer: the ZAP handler logs address
 * and key of those it sees); each closed connection's fd goes to on_closed
 * (may be NULL). */
void psd_router_monitor(void *mon, uint64_t *refused, void (*on_closed)(void *arg, int fd), void *arg);

/* psd --shard i/n with i > 0 (psd_shard.c): hold part i of the parameters
 * and their optimizer state for the run shard 0 coordinates. Exit code. */
int psd_shard_run(const ps_config_t *c, const psd_run_opts_t *opts);

/* Run a whole training described by c; returns the exit code. SIGINT/SIGTERM
 * write a checkpoint, tell the workers and exit 0 (a second one exits at
 * once with 128 + signal); SIGUSR1 writes a checkpoint and goes on. */
int psd_server_run(const ps_config_t *c, const psd_run_opts_t *opts);

/* --check-config --resume DIR: load the checkpoint a resume would use, check
 * it against the config (and shard 0 of `shards`, 0 or 1: one psd) as a
 * resume does but for the data's size, print which it is. Exit code (0 or 2). */
int psd_resume_check(const char *dir, const ps_config_t *c, int force, int shards);

#endif
