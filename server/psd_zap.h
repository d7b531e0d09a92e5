/* psd_zap.h - the ZAP handler: CurveZMQ clients are let in only if their
 * public key is in the allow-list. Runs in its own thread on
 * inproc://zeromq.zap.01 of psd's ZeroMQ context; psd's sockets set
 * ZMQ_ZAP_ENFORCE_DOMAIN, so if this handler is not there, nobody gets in. */
#ifndef PSD_ZAP_H
#define PSD_ZAP_H

#include <stdbool.h>

#include "ps_auth.h"

typedef struct psd_zap psd_zap_t;

/* Bind the handler in ctx and start its thread with the keys of allow_dir.
 * NULL + message on failure. Caller owns (psd_zap_stop). */
psd_zap_t *psd_zap_start(void *ctx, const char *allow_dir, char *err, size_t errlen);

/* Reload the allow-list (SIGHUP). 0, or -1 + message (the old list stays). */
int psd_zap_reload(psd_zap_t *z, char *err, size_t errlen);

/* Also let in psd's own public key: the psd shards (--shard i/n), which
 * share its key pair, connect to shard 0 with it. 0 or -1. */
int psd_zap_allow_self(psd_zap_t *z, const char *public_z85);

/* The ZAP user id of a message (its key's fingerprint) is psd's own key. */
bool psd_zap_is_self(psd_zap_t *z, const char *user_id);

void psd_zap_stop(psd_zap_t **z);

#endif
