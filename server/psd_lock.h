/* psd_lock.h - a psd process's exclusive hold on a run's outputs.
 *
 * Each output gets a lock file: <file>.lock beside the metrics and weights
 * files (they are replaced by rename, so the lock cannot be on the file),
 * <dir>/psd.lock in a checkpoint directory (run-<id>/ for psd or shard 0,
 * run-<id>/shard-<i>/ for shard i: the shards of one run do not refuse each
 * other), <path>.lock beside an ipc:// socket. The locks are advisory
 * flock(2) locks: the kernel releases them when the process ends, kill -9
 * included, so a lock never outlives its holder and never stops the next
 * --resume. A lock file holds "host pid" of its holder, for the message of
 * whoever finds it taken. A clean release removes the file.
 *
 * Ownership: the caller owns the psd_locks_t (psd's run, or a shard's) and
 * releases it with psd_locks_release at its end. Not thread-safe: the loop
 * thread only. */
#ifndef PSD_LOCK_H
#define PSD_LOCK_H

#include <stddef.h>
#include <sys/types.h>

#include "ps_config.h" /* PS_PATH_MAX */

#define PSD_LOCKS_MAX 8

typedef struct {
    int fd;
    dev_t dev;
    ino_t ino;
    char path[PS_PATH_MAX];
} psd_lock_t;

typedef struct psd_locks {
    psd_lock_t l[PSD_LOCKS_MAX];
    int n;
} psd_locks_t;

/* The same for "<file>.lock" (file: a metrics or weights file, a socket). */
int psd_lock_beside(psd_locks_t *set, const char *file, char *err, size_t n);
/* The same for "<dir>/psd.lock". */
int psd_lock_dir(psd_locks_t *set, const char *dir, char *err, size_t n);
/* Remove and release every lock of the set. */
void psd_locks_release(psd_locks_t *set);

#endif
