/* psd_lock.c - exclusive hold on a run's outputs (see psd_lock.h). */
#include "psd_lock.h"

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdio.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps_log.h"
#include "ps_util.h"

static bool cannot_lock(int e) { return e == ENOLCK || e == EOPNOTSUPP || e == ENOSYS; }

/* "host pid" of the holder of fd's lock, or a stand-in. */
static void holder(int fd, char *out, size_t n)
{
    char buf[300];
    ssize_t got = pread(fd, buf, sizeof buf - 1, 0);
    if (got <= 0) {
        snprintf(out, n, "another process (it has not written its host and pid yet)");
        return;
    }
    buf[got] = '\0';
    buf[strcspn(buf, "\n")] = '\0';
    char host[256] = "";
    long pid = 0;
    if (sscanf(buf, "%255s %ld", host, &pid) == 2)
        snprintf(out, n, "psd pid %ld on host %s", pid, host);
    else
        snprintf(out, n, "another process ('%s')", buf);
}

/* Take the lock file `path` (created if missing) for this process: 0 when
 * held (or already held through this set); -EWOULDBLOCK when another
 * process holds it, err naming the file and its holder's host and pid;
 * another -errno when the file cannot be made, with the reason in err.
 * Where the file system cannot lock (ENOLCK, some NFS) it warns once per
 * process and returns 0: the run goes on unprotected. */
static int psd_lock(psd_locks_t *set, const char *path, char *err, size_t n)
{
    struct stat st;
    if (stat(path, &st) == 0)
        for (int i = 0; i < set->n; i++)
            if (set->l[i].dev == st.st_dev && set->l[i].ino == st.st_ino) return 0; /* ours already */
    if (set->n >= PSD_LOCKS_MAX) {
        snprintf(err, n, "%s: too many lock files for one psd", path);
        return -ENOSPC;
    }
    for (int tries = 0;; tries++) {
        /* made: this call made the file, and removes it again where it
         * holds no lock on it (never one another process locked) */
        bool made = true;
        int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0 && errno == EEXIST) {
            made = false;
            fd = open(path, O_RDWR | O_CLOEXEC);
            if (fd < 0 && errno == ENOENT && tries < 100) continue; /* removed in between by its holder */
        }
        if (fd < 0) {
            int e = errno;
            snprintf(err, n, "cannot make the lock file %s: %s", path, strerror(e));
            return -e;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            int e = errno;
            if (e != EWOULDBLOCK && made) (void)unlink(path); /* best effort: the error said is the lock's */
            if (cannot_lock(e)) {
                static bool warned;
                if (!warned)
                    PS_WARN("this file system cannot lock files (%s: %s): nothing stops a second psd from "
                            "using this run's files at the same time",
                            path, strerror(e));
                warned = true;
                close(fd);
                return 0;
            }
            if (e == EWOULDBLOCK) {
                char who[400];
                holder(fd, who, sizeof who);
                snprintf(err, n, "%s is held by %s: another psd is using these files (a run still going?). "
                         "Stop it first, or give this run other files (--metrics, --save, checkpoint.dir)",
                         path, who);
            } else {
                snprintf(err, n, "cannot lock %s: %s", path, strerror(e));
            }
            close(fd);
            return -e;
        }
        /* a holder that let go removed the file: a lock on that removed
         * file holds nothing; take the one now at path */
        struct stat fs;
        if (fstat(fd, &fs) != 0 || stat(path, &st) != 0 || fs.st_dev != st.st_dev || fs.st_ino != st.st_ino) {
            close(fd);
            if (tries < 100) continue;
            snprintf(err, n, "cannot lock %s: it keeps being replaced", path);
            return -EAGAIN;
        }
        char me[300], host[256];
        ps_hostname(host, sizeof host);
        int len = snprintf(me, sizeof me, "%s %ld\n", host, (long)getpid());
        int rc = ftruncate(fd, 0) != 0 ? -errno : ps_pwrite_all(fd, me, (size_t)len, 0);
        if (rc != 0) {
            int e = -rc;
            snprintf(err, n, "cannot write the lock file %s: %s", path, strerror(e));
            unlink(path);
            close(fd);
            return -e;
        }
        psd_lock_t *l = &set->l[set->n++];
        l->fd = fd;
        l->dev = fs.st_dev;
        l->ino = fs.st_ino;
        snprintf(l->path, sizeof l->path, "%s", path);
        return 0;
    }
}

int psd_lock_beside(psd_locks_t *set, const char *file, char *err, size_t n)
{
    char p[PS_PATH_MAX + 8];
    snprintf(p, sizeof p, "%s.lock", file);
    return psd_lock(set, p, err, n);
}

int psd_lock_dir(psd_locks_t *set, const char *dir, char *err, size_t n)
{
    char p[PS_PATH_MAX + 16];
    snprintf(p, sizeof p, "%s/psd.lock", dir);
    return psd_lock(set, p, err, n);
}

void psd_locks_release(psd_locks_t *set)
{
    for (int i = 0; i < set->n; i++) {
        unlink(set->l[i].path); /* while held: nobody takes the removed file for a lock (psd_lock checks) */
        close(set->l[i].fd);
    }
    set->n = 0;
}
