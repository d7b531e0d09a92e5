/* psd_metrics.c - the run's metrics file (see psd_metrics.h). */
#include "psd_metrics.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ps_log.h"
#include "ps_util.h"

void psd_metrics_init(psd_metrics_t *m)
{
    memset(m, 0, sizeof *m);
    m->fd = -1;
}

int psd_metrics_open(psd_metrics_t *m, const char *path, char *err, size_t n)
{
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) {
        int e = errno;
        snprintf(err, n, "metrics file %s: %s", path, strerror(e));
        return -e;
    }
    if (m->fd >= 0) close(m->fd);
    m->fd = fd;
    snprintf(m->path, sizeof m->path, "%s", path);
    return 0;
}

/* The first failure: logged once, and nothing is written after it. */
int psd_metrics_failed(psd_metrics_t *m, int e, const char *what)
{
    m->lost++;
    if (m->err) return -m->err;
    m->err = e;
    PS_ERROR("metrics file %s: cannot %s an epoch's line: %s; the metrics file of this run is incomplete (no "
             "further lines are written to it)",
             m->path, what, strerror(e));
    return -e;
}

int psd_metrics_write(psd_metrics_t *m, const char *line, size_t len)
{
    if (m->fd < 0) return 0;
    if (m->err) return psd_metrics_failed(m, m->err, "write");
    int rc = ps_write_all(m->fd, line, len);
    if (rc != 0) return psd_metrics_failed(m, -rc, "write");
    /* a character device or a pipe (/dev/stdout) cannot sync: nothing to wait for */
    if (fsync(m->fd) != 0 && errno != EINVAL && errno != EROFS) return psd_metrics_failed(m, errno, "sync");
    return 0;
}

int psd_metrics_close(psd_metrics_t *m)
{
    if (m->fd < 0) return 0;
    int rc = close(m->fd) == 0 ? 0 : -errno;
    m->fd = -1;
    if (rc != 0 && !m->err) {
        m->err = -rc;
        PS_ERROR("metrics file %s: closing it failed: %s; its lines may not all be on disk", m->path,
                 strerror(-rc));
    }
    return rc;
}

/* The run id and epoch of a metrics line of psd's: 0, or -1 if it has none. */
static int line_key(const char *line, const char *end, uint64_t *run_id, unsigned long *epoch)
{
    char buf[512];
    size_t len = (size_t)(end - line) < sizeof buf - 1 ? (size_t)(end - line) : sizeof buf - 1;
    memcpy(buf, line, len);
    buf[len] = '\0';
    const char *r = strstr(buf, "\"run_id\":\""), *e = strstr(buf, "\"epoch\":");
    if (!r || !e) return -1;
    char *x;
    *run_id = strtoull(r + 10, &x, 16);
    if (*x != '"') return -1;
    *epoch = strtoul(e + 8, &x, 10);
    return x == e + 8 ? -1 : 0;
}

typedef struct {
    const char *text;
    size_t len;
} kept_t;

static int write_kept(int fd, void *ud)
{
    const kept_t *k = ud;
    return ps_write_all(fd, k->text, k->len);
}

int psd_metrics_trim(psd_metrics_t *m, const char *path, uint64_t run_id, uint32_t epochs_done, char *err,
                     size_t n)
{
    struct stat st;
    if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    FILE *f = fopen(path, "r");
    if (!f) {
        int e = errno;
        snprintf(err, n, "metrics file %s: %s", path, strerror(e));
        return -e;
    }
    char *text = malloc((size_t)st.st_size + 1), *out = malloc((size_t)st.st_size + 1);
    size_t len = text ? fread(text, 1, (size_t)st.st_size, f) : 0;
    int rerr = ferror(f);
    fclose(f);
    if (!text || !out || rerr) {
        free(text);
        free(out);
        snprintf(err, n, "metrics file %s: %s", path, rerr ? "cannot read it" : "out of memory");
        return rerr ? -EIO : -ENOMEM;
    }
    size_t at = 0;
    int dropped = 0;
    unsigned long first = 0, last = 0;
    for (size_t i = 0; i < len;) {
        const char *nl = memchr(text + i, '\n', len - i);
        if (!nl) { /* cut short by a kill or a full disk: not a line */
            PS_WARN("metrics file %s: dropped its last line, cut short (%zu bytes without an end)", path, len - i);
            dropped++;
            break;
        }
        size_t ll = (size_t)(nl - (text + i)) + 1;
        uint64_t id;
        unsigned long ep;
        if (line_key(text + i, nl, &id, &ep) == 0 && id == run_id && ep > epochs_done) {
            if (!first || ep < first) first = ep;
            if (ep > last) last = ep;
            dropped++;
        } else {
            memcpy(out + at, text + i, ll);
            at += ll;
        }
        i += ll;
    }
    free(text);
    int rc = 0;
    if (dropped > 0) {
        kept_t k = {out, at};
        rc = ps_write_atomic(path, write_kept, &k);
        if (rc != 0)
            snprintf(err, n, "metrics file %s: cannot rewrite it without the epochs past the checkpoint: %s", path,
                     strerror(-rc));
        else if (first)
            PS_INFO("metrics file %s: dropped the lines of epochs %lu..%lu, written after the checkpoint this run "
                    "resumes from: they are trained and written again",
                    path, first, last);
    }
    free(out);
    if (rc == 0 && dropped > 0 && m->fd >= 0) rc = psd_metrics_open(m, path, err, n); /* the new file */
    return rc != 0 ? rc : dropped;
}

const double psd_hist_le[PSD_HIST_N] = {0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5};

void psd_hist_add(psd_hist_t *h, double v)
{
    int b = 0;
    while (b < PSD_HIST_N && v > psd_hist_le[b]) b++;
    h->n[b]++;
    h->sum += v;
}

uint64_t psd_hist_count(const psd_hist_t *h)
{
    uint64_t c = 0;
    for (int b = 0; b <= PSD_HIST_N; b++) c += h->n[b];
    return c;
}
