/* psd_server.h - the run: registration, data ranges, synchronous steps,
 * barriers, validation, metrics; a libuv loop over one ZeroMQ ROUTER. */
#ifndef PSD_SERVER_H
#define PSD_SERVER_H

#include "ps_config.h"

/* Exit codes of psd (README). */
enum {
    PSD_EXIT_OK = 0,
    PSD_EXIT_ERROR = 1,         /* runtime failure (I/O, memory) */
    PSD_EXIT_USAGE = 2,         /* bad flags, config or data */
    PSD_EXIT_START_TIMEOUT = 3, /* not all workers registered in time */
    PSD_EXIT_WORKER_LOST = 4,   /* a worker went silent past worker_timeout */
};

/* Run a whole training described by c; returns the exit code. Signals
 * (SIGINT/SIGTERM) end the run with 128 + signal number. */
int psd_server_run(const ps_config_t *c);

#endif
