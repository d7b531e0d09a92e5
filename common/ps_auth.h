/* ps_auth.h - CurveZMQ keys in files, and the allow-list of worker keys.
 *
 * NAME.pub: one line, the public key in Z85 (40 characters).
 * NAME.key: "public <Z85>\nsecret <Z85>\n", mode 0600; refused if group or
 *           others may read it.
 * Z85 strings are 40 characters (+ NUL = 41 bytes, the form ZeroMQ takes). */
#ifndef PS_AUTH_H
#define PS_AUTH_H

#include <stddef.h>
#include <stdint.h>

#define PS_Z85_LEN 41 /* 40 characters + NUL */

typedef struct {
    char public_z85[PS_Z85_LEN];
    char secret_z85[PS_Z85_LEN];
} ps_keypair_t;

/* Make a key pair and write PATH.key (0600) and PATH.pub. Refuses to
 * overwrite existing files. 0, or -1 with a message. */
int ps_auth_keygen(const char *path, char *err, size_t errlen);

/* Read a .key file (checks its permissions). 0, or -1 with a message. */
int ps_auth_load_secret(const char *file, ps_keypair_t *kp, char *err, size_t errlen);

/* Read a .pub file. 0, or -1 with a message. */
int ps_auth_load_public(const char *file, char out_z85[PS_Z85_LEN], char *err, size_t errlen);

/* A short fingerprint of a public key for logs: first 12 hex digits of its
 * FNV-1a 64 hash, from the 32 key bytes. */
void ps_auth_fingerprint(const uint8_t key[32], char out[17]);

/* The allow-list: every DIR/\*.pub, as 32-byte keys. */
typedef struct {
    uint8_t (*keys)[32];
    size_t n;
} ps_allow_t;

int ps_allow_load(ps_allow_t *a, const char *dir, char *err, size_t errlen);
int ps_allow_has(const ps_allow_t *a, const uint8_t key[32]);
void ps_allow_deinit(ps_allow_t *a);

#endif
