/* psd_run.h - what psd_run.c (the run's phases, checkpoints, resume; see
 * psd_core.h) offers beyond the coordinator: the --check-config --resume
 * check psd_main.c runs before any run. The coordinator's own functions of
 * psd_run.c are in psd_core.h. */
#ifndef PSD_RUN_H
#define PSD_RUN_H

#include "ps_config.h"

/* --check-config --resume DIR: load the checkpoint a resume would use, check
 * it against the config (and shard 0 of `shards`, 0 or 1: one psd) as a
 * resume does but for the data's size, print which it is. Exit code (0 or 2). */
int psd_resume_check(const char *dir, const ps_config_t *c, int force, int shards);

#endif
