#include "psd_zap.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "ps_log.h"

struct psd_zap {
    void *sock;
    pthread_t th;
    atomic_int stop;
    pthread_mutex_t mu;
    ps_allow_t allow;
    uint8_t self[32];     /* psd's own public key: psd shards connect to shard 0 with it */
    int has_self;
    char dir[4096];
    unsigned long accepted, refused;
};

/* One ZAP request (RFC 27): version, request id, domain, address, identity,
 * mechanism, credentials...; answered with version, request id, status
 * code, status text, user id, metadata. */
static void serve_one(psd_zap_t *z)
{
    zmq_msg_t f[8];
    int n = 0, more = 1;
    while (more && n < 8) {
        zmq_msg_init(&f[n]);
        if (zmq_msg_recv(&f[n], z->sock, 0) < 0) {
            zmq_msg_close(&f[n]);
            goto out;
        }
        more = zmq_msg_more(&f[n]);
        n++;
    }
    while (more) { /* more frames than any mechanism sends: drop them */
        zmq_msg_t x;
        zmq_msg_init(&x);
        if (zmq_msg_recv(&x, z->sock, 0) < 0) {
            zmq_msg_close(&x);
            goto out;
        }
        more = zmq_msg_more(&x);
        zmq_msg_close(&x);
    }
    const char *status = "400", *text = "not allowed";
    char address[64] = "?", mech[16] = "?", fp[17] = "none";
    if (n >= 6) {
        snprintf(address, sizeof address, "%.*s", (int)zmq_msg_size(&f[3]), (char *)zmq_msg_data(&f[3]));
        snprintf(mech, sizeof mech, "%.*s", (int)zmq_msg_size(&f[5]), (char *)zmq_msg_data(&f[5]));
    }
    if (n >= 7 && strcmp(mech, "CURVE") == 0 && zmq_msg_size(&f[6]) == 32) {
        const uint8_t *key = zmq_msg_data(&f[6]);
        ps_auth_fingerprint(key, fp);
        pthread_mutex_lock(&z->mu);
        int ok = ps_allow_has(&z->allow, key) || (z->has_self && memcmp(key, z->self, 32) == 0);
        pthread_mutex_unlock(&z->mu);
        if (ok) {
            status = "200";
            text = "OK";
        } else {
            text = "key not in the allow-list";
        }
    } else {
        text = "only CURVE clients with an allowed key";
    }
    if (strcmp(status, "200") == 0) {
        z->accepted++;
        PS_DEBUG("let in a client from %s, key %s", address, fp);
    } else {
        z->refused++;
        if (z->refused <= 20 || z->refused % 1000 == 0)
            PS_WARN("refused a client from %s: %s (mechanism %s, key %s)%s", address, text, mech, fp,
                    z->refused == 20 ? " (further refusals logged every 1000th)" : "");
    }
    if (n >= 2) {
        zmq_send(z->sock, "1.0", 3, ZMQ_SNDMORE);
        zmq_send(z->sock, zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), ZMQ_SNDMORE);
        zmq_send(z->sock, status, 3, ZMQ_SNDMORE);
        zmq_send(z->sock, text, strlen(text), ZMQ_SNDMORE);
        zmq_send(z->sock, fp, strlen(fp), ZMQ_SNDMORE); /* user id: the key's fingerprint */
        zmq_send(z->sock, "", 0, 0);
    }
out:
    for (int i = 0; i < n; i++) zmq_msg_close(&f[i]);
}

static void *zap_main(void *arg)
{
    psd_zap_t *z = arg;
    while (!atomic_load(&z->stop)) {
        zmq_pollitem_t it = {z->sock, 0, ZMQ_POLLIN, 0};
        int r = zmq_poll(&it, 1, 100);
        if (r > 0) serve_one(z);
        else if (r < 0 && zmq_errno() == ETERM) break;
    }
    return NULL;
}

psd_zap_t *psd_zap_start(void *ctx, const char *allow_dir, char *err, size_t errlen)
{
    psd_zap_t *z = calloc(1, sizeof *z);
    if (!z) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&z->mu, NULL);
    snprintf(z->dir, sizeof z->dir, "%s", allow_dir);
    if (ps_allow_load(&z->allow, allow_dir, err, errlen) != 0) goto fail;
    z->sock = zmq_socket(ctx, ZMQ_REP);
    int linger = 0;
    if (!z->sock) goto zfail;
    zmq_setsockopt(z->sock, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(z->sock, "inproc://zeromq.zap.01") != 0) goto zfail;
    if (pthread_create(&z->th, NULL, zap_main, z) != 0) {
        snprintf(err, errlen, "cannot start the authentication thread");
        goto fail;
    }
    PS_INFO("authentication: CURVE, %zu allowed worker key%s in %s", z->allow.n, z->allow.n == 1 ? "" : "s",
            allow_dir);
    return z;
zfail:
    snprintf(err, errlen, "authentication handler: %s", zmq_strerror(zmq_errno()));
fail:
    if (z->sock) zmq_close(z->sock);
    ps_allow_deinit(&z->allow);
    pthread_mutex_destroy(&z->mu);
    free(z);
    return NULL;
}

int psd_zap_reload(psd_zap_t *z, char *err, size_t errlen)
{
    ps_allow_t fresh;
    if (ps_allow_load(&fresh, z->dir, err, errlen) != 0) return -1;
    pthread_mutex_lock(&z->mu);
    ps_allow_t old = z->allow;
    z->allow = fresh;
    pthread_mutex_unlock(&z->mu);
    ps_allow_deinit(&old);
    PS_INFO("authentication: reloaded %zu allowed worker key%s from %s", fresh.n, fresh.n == 1 ? "" : "s", z->dir);
    return 0;
}

void psd_zap_stop(psd_zap_t **zp)
{
    psd_zap_t *z = *zp;
    if (!z) return;
    atomic_store(&z->stop, 1);
    pthread_join(z->th, NULL);
    zmq_close(z->sock);
    ps_allow_deinit(&z->allow);
    pthread_mutex_destroy(&z->mu);
    free(z);
    *zp = NULL;
}

bool psd_zap_is_self(psd_zap_t *z, const char *user_id)
{
    if (!z || !z->has_self) return false;
    char fp[17];
    ps_auth_fingerprint(z->self, fp);
    return user_id && strcmp(user_id, fp) == 0;
}

int psd_zap_allow_self(psd_zap_t *z, const char *public_z85)
{
    uint8_t k[32];
    if (!z || !zmq_z85_decode(k, public_z85)) return -1;
    pthread_mutex_lock(&z->mu);
    memcpy(z->self, k, 32);
    z->has_self = 1;
    pthread_mutex_unlock(&z->mu);
    return 0;
}
