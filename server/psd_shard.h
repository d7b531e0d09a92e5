/* psd_shard.h - psd shards 1..n-1 (psd --shard i/n, i > 0). */
#ifndef PSD_SHARD_H
#define PSD_SHARD_H

#include "psd_opts.h"

/* psd --shard i/n with i > 0 (psd_shard.c): hold part i of the parameters
 * and their optimizer state for the run shard 0 coordinates. Exit code. */
int psd_shard_run(const ps_config_t *c, const psd_run_opts_t *opts);

#endif
