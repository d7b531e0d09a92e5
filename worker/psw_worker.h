/* psw_worker.h - one training worker: register, check data, train, validate. */
#ifndef PSW_WORKER_H
#define PSW_WORKER_H

typedef struct {
    const char *connect;       /* psd endpoint */
    int threads;               /* 0 = host cores / workers psd has on this host */
    int verbose;               /* log INFO on every rank */
    const char *data_dir;      /* if set, data files are looked up here by base name */
    const char *device;        /* "cpu" or "cuda" */
    int device_index;          /* CUDA ordinal, -1 for cpu */
    int split_push;            /* push each tensor as its own message even on CPU (tests) */
    int slow_ms;               /* sleep this long before each push (tests: a slow worker) */
    int slow_rank_ms;          /* and this long times (world - 1 - rank): ranks push in reverse order (tests) */
    int device_sim;            /* the CPU backend posing as a device one (tests: the device code paths) */
    unsigned protocol;         /* 0 = ours; tests set another to check refusal */
    double register_timeout_s; /* how long to wait for psd to answer the registration */
    double retry_s;            /* after losing psd: keep registering again for this long */
    const char *key_file;      /* CurveZMQ: this worker's secret key file (psd keygen) */
    const char *server_key;    /* CurveZMQ: psd's public key file */
    int no_shm;                /* never use shared memory with psd */
} psw_worker_opts_t;

/* Exit codes of pworker (README). */
enum {
    PSW_EXIT_OK = 0,
    PSW_EXIT_ERROR = 1,     /* runtime failure (device, memory) */
    PSW_EXIT_USAGE = 2,     /* bad flags, refused by psd, protocol mismatch, data mismatch */
    PSW_EXIT_PSD_LOST = 4,  /* psd silent past its deadline */
};

/* Run one worker to the end; returns the process exit code. */
int psw_worker_run(const psw_worker_opts_t *o);

#endif
