/* psd_status.h - what psd shows of its run, rendered from its state and
 * never changing it: the progress line (a live line on a terminal, else a
 * log line every server.progress_every seconds), the HTTP paths (/metrics
 * for Prometheus, /status and /history as JSON, the live page, /healthz)
 * and psctl's text. Called from psd_server.c's loop (timer, HTTP server,
 * MSG_CONTROL); calls nothing of the run. */
#ifndef PSD_STATUS_H
#define PSD_STATUS_H

#include <stdbool.h>
#include <stdio.h>

#include "psd_core.h"

/* The progress line, when it is due (now: ps_now()). */
void psd_status_progress(srv_t *s, double now);
/* psd_http_render_fn for psd_http_start (ud: the srv_t). */
int psd_status_http(void *ud, const char *path, char **body, size_t *len, const char **ctype);
/* /status: the run as JSON (psctl status --json too). */
void psd_status_json(const srv_t *s, FILE *f);
/* psctl status (workers_only: psctl workers), as text for people. */
void psd_status_human(const srv_t *s, FILE *f, bool workers_only);

#endif
