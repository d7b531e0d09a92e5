/* psd_http.h - psd's HTTP endpoint (server.http / --http HOST:PORT): a
 * small server on psd's libuv loop for /metrics, /status, /healthz and the
 * live page; what each path answers is psd_server.c's render function. Off
 * by default; loopback unless a token is set (server.http_token), then
 * every path but /healthz needs "Authorization: Bearer <token>". */
#ifndef PSD_HTTP_H
#define PSD_HTTP_H

#include <stdbool.h>
#include <stddef.h>
#include <uv.h>

typedef struct psd_http psd_http_t;

/* Answer for path: an HTTP status code, *body (malloc'ed, the caller frees;
 * may stay NULL) of *len bytes and its content type. */
typedef int (*psd_http_render_fn)(void *ud, const char *path, char **body, size_t *len, const char **ctype);

/* Listen on addr ("HOST:PORT": an IPv4 address, localhost, or an IPv6
 * address in brackets, [::1]:9100) on loop. 0, or -errno with a message. */
int psd_http_start(psd_http_t **h, uv_loop_t *loop, const char *addr, const char *token, psd_http_render_fn render,
                   void *ud, char *err, size_t errlen);
/* The port it listens on (useful with port 0), or -1. */
int psd_http_port(const psd_http_t *h);
/* Close every connection and the listener (runs the loop until they are). */
void psd_http_stop(psd_http_t **h);
/* The endpoint's settings as the start and --check-config both check them:
 * addr a HOST:PORT psd_http_start takes; token_file ("" for none) a file
 * only its owner may read whose first line, the token (into token), has at
 * least 16 characters; beyond loopback only with a token or `insecure`
 * (then *open is set: the caller warns). 0, or -EINVAL with a message. */
int psd_http_settings(const char *addr, const char *token_file, bool insecure, char *token, size_t token_len,
                      bool *open, char *err, size_t errlen);

#endif
