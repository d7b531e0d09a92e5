/* psd_server.h - the run: registration, data ranges, synchronous steps,
 * barriers, validation, metrics; a libuv loop over one ZeroMQ ROUTER. */
#ifndef PSD_SERVER_H
#define PSD_SERVER_H

#include <stdbool.h>

#include "ps_config.h"
#include "psd_opts.h"

/* Run a whole training described by c; returns the exit code. SIGINT/SIGTERM
 * write a checkpoint, tell the workers and exit 0 (a second one exits at
 * once with 128 + signal); SIGUSR1 writes a checkpoint and goes on. */
int psd_server_run(const ps_config_t *c, const psd_run_opts_t *opts);

#endif
