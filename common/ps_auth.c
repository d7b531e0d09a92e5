#include "ps_auth.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "ps_util.h"

static int valid_z85_key(const char *s)
{
    if (strlen(s) != 40) return 0;
    uint8_t bin[32];
    return zmq_z85_decode(bin, s) != NULL;
}

int ps_auth_keygen(const char *path, char *err, size_t errlen)
{
    char pub[PS_Z85_LEN], sec[PS_Z85_LEN], fkey[4096], fpub[4096];
    if (zmq_curve_keypair(pub, sec) != 0) {
        snprintf(err, errlen, "cannot make a key pair: %s (is libzmq built with CURVE?)", zmq_strerror(zmq_errno()));
        return -1;
    }
    snprintf(fkey, sizeof fkey, "%s.key", path);
    snprintf(fpub, sizeof fpub, "%s.pub", path);
    int fd = open(fkey, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", fkey, strerror(errno));
        return -1;
    }
    char buf[128];
    int n = snprintf(buf, sizeof buf, "public %s\nsecret %s\n", pub, sec);
    int rc = ps_write_all(fd, buf, (size_t)n);
    if (rc == 0 && fsync(fd) != 0) rc = -errno;
    close(fd);
    memset(sec, 0, sizeof sec);
    memset(buf, 0, sizeof buf);
    if (rc != 0) {
        unlink(fkey);
        snprintf(err, errlen, "%s: %s", fkey, strerror(-rc));
        return -1;
    }
    fd = open(fpub, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", fpub, strerror(errno));
        unlink(fkey);
        return -1;
    }
    n = snprintf(buf, sizeof buf, "%s\n", pub);
    rc = ps_write_all(fd, buf, (size_t)n);
    close(fd);
    if (rc != 0) {
        snprintf(err, errlen, "%s: %s", fpub, strerror(-rc));
        return -1;
    }
    return 0;
}

/* Read a small text file (at most 4 KiB). */
static int read_small(const char *file, char *buf, size_t n, struct stat *st, char *err, size_t errlen)
{
    int fd = open(file, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(err, errlen, "%s: %s", file, strerror(errno));
        return -1;
    }
    if (fstat(fd, st) != 0 || !S_ISREG(st->st_mode)) {
        snprintf(err, errlen, "%s: not a regular file", file);
        close(fd);
        return -1;
    }
    ssize_t got = read(fd, buf, n - 1);
    close(fd);
    if (got < 0) {
        snprintf(err, errlen, "%s: %s", file, strerror(errno));
        return -1;
    }
    buf[got] = '\0';
    return 0;
}

int ps_auth_load_secret(const char *file, ps_keypair_t *kp, char *err, size_t errlen)
{
    char buf[4096];
    struct stat st;
    if (read_small(file, buf, sizeof buf, &st, err, errlen) != 0) return -1;
    if (st.st_mode & 0077) {
        snprintf(err, errlen, "%s: secret key file is readable by others (mode %04o); run chmod 600 %s",
                 file, (unsigned)(st.st_mode & 07777), file);
        memset(buf, 0, sizeof buf);
        return -1;
    }
    memset(kp, 0, sizeof *kp);
    int ok = sscanf(buf, "public %40s\nsecret %40s", kp->public_z85, kp->secret_z85) == 2 &&
             valid_z85_key(kp->public_z85) && valid_z85_key(kp->secret_z85);
    memset(buf, 0, sizeof buf);
    if (!ok) {
        snprintf(err, errlen, "%s: not a psd key file (expected 'public KEY' and 'secret KEY' lines, from psd keygen)",
                 file);
        memset(kp, 0, sizeof *kp);
        return -1;
    }
    return 0;
}

int ps_auth_load_public(const char *file, char out_z85[PS_Z85_LEN], char *err, size_t errlen)
{
    char buf[4096];
    struct stat st;
    if (read_small(file, buf, sizeof buf, &st, err, errlen) != 0) return -1;
    buf[strcspn(buf, "\r\n")] = '\0';
    if (!valid_z85_key(buf)) {
        snprintf(err, errlen, "%s: not a public key (expected 40 Z85 characters, from psd keygen)", file);
        return -1;
    }
    memcpy(out_z85, buf, PS_Z85_LEN);
    return 0;
}

void ps_auth_fingerprint(const uint8_t key[32], char out[17])
{
    uint64_t h = ps_fnv1a(PS_FNV_INIT, key, 32);
    snprintf(out, 17, "%012llx", (unsigned long long)(h >> 16));
}

int ps_allow_load(ps_allow_t *a, const char *dir, char *err, size_t errlen)
{
    memset(a, 0, sizeof *a);
    DIR *d = opendir(dir);
    if (!d) {
        snprintf(err, errlen, "allow-list %s: %s", dir, strerror(errno));
        return -1;
    }
    struct dirent *e;
    size_t cap = 0;
    int rc = 0;
    while ((e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".pub") != 0) continue;
        char file[4096], z85[PS_Z85_LEN];
        snprintf(file, sizeof file, "%s/%s", dir, e->d_name);
        if (ps_auth_load_public(file, z85, err, errlen) != 0) {
            rc = -1;
            break;
        }
        if (a->n == cap) {
            cap = cap ? 2 * cap : 16;
            uint8_t(*k)[32] = realloc(a->keys, cap * sizeof *k);
            if (!k) {
                snprintf(err, errlen, "out of memory");
                rc = -1;
                break;
            }
            a->keys = k;
        }
        zmq_z85_decode(a->keys[a->n++], z85);
    }
    closedir(d);
    if (rc != 0) ps_allow_deinit(a);
    return rc;
}

int ps_allow_has(const ps_allow_t *a, const uint8_t key[32])
{
    for (size_t i = 0; i < a->n; i++)
        if (memcmp(a->keys[i], key, 32) == 0) return 1;
    return 0;
}

void ps_allow_deinit(ps_allow_t *a)
{
    free(a->keys);
    a->keys = NULL;
    a->n = 0;
}
