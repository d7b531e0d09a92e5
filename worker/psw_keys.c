/* psw_keys.c - CurveZMQ key files (psd keygen's) for the worker library's
 * callers: psw_load_keys fills psw_info_t's curve_* strings the way pworker's
 * --key/--server-key do. Owns nothing. */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "ps_auth.h"
#include "psworker.h"

int psw_load_keys(const char *key_file, const char *server_key_file, char public_z85[41], char secret_z85[41],
                  char server_z85[41], char *err, size_t errlen)
{
    char why[512] = "";
    ps_keypair_t kp;
    if (!key_file || !server_key_file || !public_z85 || !secret_z85 || !server_z85) {
        snprintf(err, errlen, "psw_load_keys: a key file and psd's public key file go together");
        return -EINVAL;
    }
    if (ps_auth_load_secret(key_file, &kp, why, sizeof why) != 0 ||
        ps_auth_load_public(server_key_file, server_z85, why, sizeof why) != 0) {
        snprintf(err, errlen, "%s", why);
        return -EINVAL;
    }
    memcpy(public_z85, kp.public_z85, 41);
    memcpy(secret_z85, kp.secret_z85, 41);
    memset(&kp, 0, sizeof kp);
    return 0;
}
