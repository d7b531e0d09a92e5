/* psd_http.c - psd's small HTTP server (see psd_http.h).
 *
 * One request per connection (HTTP/1.0 style: the answer closes it), parsed
 * by Debian's http-parser; requests and answers are bounded, slow or idle
 * clients are cut after PSD_HTTP_IDLE_S, and a request with a body (psd
 * takes none) is refused as soon as its headers are in. At most PSD_HTTP_MAX_CONN at once:
 * a newcomer beyond that closes the oldest connection still waiting for its
 * request (idle ones cannot keep a health check out), or is closed itself
 * when every one is being answered. Everything runs on psd's loop thread. */
#include "psd_http.h"

#include <errno.h>
#include <http_parser.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ps_log.h"
#include "ps_util.h"

/* 256 connections: well under a 1024 file-descriptor soft limit with psd's
 * own; an idle one holds no request buffer (it is allocated on the first
 * bytes), about 1.3 KiB. */
#define PSD_HTTP_MAX_CONN 256
#define PSD_HTTP_MAX_REQ (16 << 10) /* request line + headers */
#define PSD_HTTP_IDLE_S 5.0
#define PSD_HTTP_BACKLOG 512 /* a burst of connections waits in the kernel, not refused */

typedef struct conn {
    uv_tcp_t tcp;
    psd_http_t *h;
    http_parser parser;
    char *req;            /* PSD_HTTP_MAX_REQ bytes once something came; NULL before */
    size_t req_len;
    char url[512];
    size_t url_len;
    char field[32];       /* the header being read: only Authorization matters */
    size_t field_len;
    bool in_value, in_auth;
    char auth[256];
    size_t auth_len;
    bool done, closing, too_long;
    int refuse;           /* 405 or 413: refused once its headers came (see on_headers) */
    double started;
    struct conn *next;
    uv_write_t wr;
    char *out;            /* the whole answer */
} conn_t;

struct psd_http {
    uv_loop_t *loop;
    uv_tcp_t server;
    uv_timer_t timer;
    psd_http_render_fn render;
    void *ud;
    char token[256];      /* "" = no token asked for */
    conn_t *conns;        /* newest first */
    int n_conns, n_open;  /* in the list; of them not closing */
    int handles;          /* server and timer, until their close callbacks ran */
    uint64_t served, refused, evicted;
    http_parser_settings settings;
};

static void conn_closed(uv_handle_t *hd)
{
    conn_t *c = hd->data;
    psd_http_t *h = c->h;
    for (conn_t **p = &h->conns; *p; p = &(*p)->next)
        if (*p == c) {
            *p = c->next;
            break;
        }
    h->n_conns--;
    free(c->req);
    free(c->out);
    free(c);
}

static void conn_close(conn_t *c)
{
    if (c->closing) return;
    c->closing = true;
    c->h->n_open--;
    uv_close((uv_handle_t *)&c->tcp, conn_closed);
}

static void written(uv_write_t *w, int status)
{
    (void)status;
    conn_close(w->data);
}

static const char *status_text(int code)
{
    switch (code) {
    case 200: return "OK";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 413: return "Content Too Large";
    case 431: return "Request Header Fields Too Large";
    case 503: return "Service Unavailable";
    default: return "Internal Server Error";
    }
}

static void answer(conn_t *c, int code, const char *ctype, const char *body, size_t len, bool head)
{
    if (c->out) return;
    char hdr[512];
    int n = snprintf(hdr, sizeof hdr,
                     "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nCache-Control: no-store\r\n"
                     "X-Content-Type-Options: nosniff\r\nConnection: close\r\n%s%s\r\n",
                     code, status_text(code), ctype, len,
                     code == 401 ? "WWW-Authenticate: Bearer realm=\"psd\"\r\n" : "",
                     code == 405 ? "Allow: GET, HEAD\r\n" : "");
    size_t total = (size_t)n + (head ? 0 : len);
    c->out = malloc(total ? total : 1);
    if (!c->out) {
        conn_close(c);
        return;
    }
    memcpy(c->out, hdr, (size_t)n);
    if (!head && len) memcpy(c->out + n, body, len);
    uv_buf_t b = uv_buf_init(c->out, (unsigned)total);
    c->wr.data = c;
    uv_read_stop((uv_stream_t *)&c->tcp);
    if (uv_write(&c->wr, (uv_stream_t *)&c->tcp, &b, 1, written) != 0) conn_close(c);
}

static void answer_text(conn_t *c, int code, const char *text)
{
    answer(c, code, "text/plain; charset=utf-8", text, strlen(text), false);
}

static int on_url(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (c->url_len + len >= sizeof c->url) {
        c->too_long = true;
        return 1;
    }
    memcpy(c->url + c->url_len, at, len);
    c->url_len += len;
    c->url[c->url_len] = '\0';
    return 0;
}

static int on_header_field(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (c->in_value) { /* a new header starts */
        c->field_len = 0;
        c->in_value = false;
    }
    size_t room = sizeof c->field - 1 - c->field_len, n = len < room ? len : room;
    memcpy(c->field + c->field_len, at, n); /* longer names are not Authorization anyway */
    c->field_len += n;
    c->field[c->field_len] = '\0';
    return 0;
}

static int on_header_value(http_parser *p, const char *at, size_t len)
{
    conn_t *c = p->data;
    if (!c->in_value) { /* its first piece */
        c->in_value = true;
        c->in_auth = strcasecmp(c->field, "authorization") == 0;
        if (c->in_auth) c->auth_len = 0;
    }
    if (!c->in_auth) return 0;
    if (c->auth_len + len >= sizeof c->auth) {
        c->too_long = true;
        return 1;
    }
    memcpy(c->auth + c->auth_len, at, len);
    c->auth_len += len;
    c->auth[c->auth_len] = '\0';
    return 0;
}

/* The request line and headers are in: a request psd does not take is
 * refused now, never waiting for a body (a client may declare 100 MB and
 * send nothing). Any method but GET and HEAD: 405, whatever follows; a GET or
 * HEAD that declares a body (Content-Length over 0, or chunked): 413. Both
 * before the token check: they depend on the request's form alone, are the
 * same for every client and every path, and tell nothing about the run. */
static int on_headers(http_parser *p)
{
    conn_t *c = p->data;
    if (p->method != HTTP_GET && p->method != HTTP_HEAD)
        c->refuse = 405;
    else if ((p->flags & F_CHUNKED) || ((p->flags & F_CONTENTLENGTH) && p->content_length > 0))
        c->refuse = 413;
    return c->refuse ? -1 : 0; /* not 0, 1 or 2: the parser stops here */
}

static int on_complete(http_parser *p)
{
    ((conn_t *)p->data)->done = true;
    return 1; /* one request per connection: stop here */
}

/* Constant-time comparison of the presented token with the one asked for. */
static bool token_ok(const psd_http_t *h, const conn_t *c)
{
    if (!h->token[0]) return true;
    const char *v = c->auth, *q = strstr(c->url, "?token=");
    if (!q) q = strstr(c->url, "&token=");
    char qt[256];
    if (strncasecmp(v, "Bearer ", 7) == 0) {
        v += 7;
    } else if (q) { /* ?token=...: for the live page in a browser */
        snprintf(qt, sizeof qt, "%s", q + 7);
        qt[strcspn(qt, "&#")] = '\0';
        v = qt;
    } else {
        return false;
    }
    size_t n = strlen(h->token), m = strlen(v);
    unsigned diff = (unsigned)(n ^ m);
    for (size_t i = 0; i < n; i++) diff |= (unsigned)(h->token[i] ^ (i < m ? v[i] : 0));
    return diff == 0;
}

static void serve(conn_t *c)
{
    psd_http_t *h = c->h;
    int method = c->parser.method; /* GET or HEAD: on_headers refused the others */
    char path[512];
    snprintf(path, sizeof path, "%s", c->url);
    char *q = strchr(path, '?');
    if (q) *q = '\0';
    if (strcmp(path, "/healthz") != 0 && !token_ok(h, c)) {
        h->refused++;
        answer_text(c, 401, "a token is needed: Authorization: Bearer <server.http_token>\n");
        return;
    }
    char *body = NULL;
    size_t len = 0;
    const char *ctype = "text/plain; charset=utf-8";
    int code = h->render(h->ud, path, &body, &len, &ctype);
    h->served++;
    answer(c, code, ctype, body ? body : "", body ? len : 0, method == HTTP_HEAD);
    free(body);
}

static void alloc_cb(uv_handle_t *hd, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    conn_t *c = hd->data;
    if (!c->req) c->req = malloc(PSD_HTTP_MAX_REQ);
    /* none: an empty buffer, read_cb gets UV_ENOBUFS and closes it */
    *buf = c->req ? uv_buf_init(c->req + c->req_len, (unsigned)(PSD_HTTP_MAX_REQ - c->req_len)) : uv_buf_init(NULL, 0);
}

static void read_cb(uv_stream_t *s, ssize_t n, const uv_buf_t *buf)
{
    (void)buf;
    conn_t *c = s->data;
    if (n < 0) {
        conn_close(c);
        return;
    }
    if (n == 0 || c->out) return;
    size_t got = http_parser_execute(&c->parser, &c->h->settings, c->req + c->req_len, (size_t)n);
    c->req_len += (size_t)n;
    if (c->refuse) { /* a HEAD's 413 without its body, as any answer to a HEAD */
        const char *why = c->refuse == 405 ? "only GET and HEAD\n" : "a request with a body: psd takes none\n";
        answer(c, c->refuse, "text/plain; charset=utf-8", why, strlen(why), c->parser.method == HTTP_HEAD);
        return;
    }
    if (c->done) {
        serve(c);
        return;
    }
    if (c->too_long || c->req_len >= PSD_HTTP_MAX_REQ) {
        answer_text(c, 431, "request too large\n");
        return;
    }
    if (HTTP_PARSER_ERRNO(&c->parser) != HPE_OK || got != (size_t)n) answer_text(c, 400, "bad request\n");
}

/* The oldest open connection still waiting for (the rest of) its request,
 * or NULL: every one is being answered. */
static conn_t *oldest_waiting(psd_http_t *h)
{
    conn_t *old = NULL;
    for (conn_t *c = h->conns; c; c = c->next)
        if (!c->closing && !c->out) old = c; /* newest first: the last one found is the oldest */
    return old;
}

static void on_connection(uv_stream_t *server, int status)
{
    psd_http_t *h = server->data;
    if (status < 0) return;
    conn_t *c = calloc(1, sizeof *c);
    if (!c) return;
    c->h = h;
    uv_tcp_init(h->loop, &c->tcp);
    c->tcp.data = c;
    c->next = h->conns;
    h->conns = c;
    h->n_conns++;
    h->n_open++;
    if (uv_accept(server, (uv_stream_t *)&c->tcp) != 0) {
        conn_close(c);
        return;
    }
    if (h->n_open > PSD_HTTP_MAX_CONN) { /* make room: the one waiting longest for its request goes */
        conn_t *old = oldest_waiting(h);
        if (old == c) old = NULL; /* not itself: all the others are being answered */
        if (old && h->evicted++ == 0) /* once */
            PS_WARN("HTTP: %d connections open, the limit: each new one closes the oldest still without its "
                    "request (a client that opens connections and sends nothing?)",
                    PSD_HTTP_MAX_CONN);
        conn_close(old ? old : c);
        if (!old) return;
    }
    http_parser_init(&c->parser, HTTP_REQUEST);
    c->parser.data = c;
    c->started = ps_now();
    uv_read_start((uv_stream_t *)&c->tcp, alloc_cb, read_cb);
}

static void on_tick(uv_timer_t *t)
{
    psd_http_t *h = t->data;
    double now = ps_now();
    for (conn_t *c = h->conns; c; c = c->next)
        if (!c->closing && now - c->started > PSD_HTTP_IDLE_S) conn_close(c);
}

/* "HOST:PORT": HOST an IPv4 address, localhost, or an IPv6 address in
 * brackets ([::1]:9100); PORT 0-65535 (0: any free port). */
static int parse_addr(const char *addr, struct sockaddr_storage *sa)
{
    char host[INET6_ADDRSTRLEN + 2];
    const char *colon = strrchr(addr, ':');
    if (!colon || colon == addr || (size_t)(colon - addr) >= sizeof host) return -EINVAL;
    memcpy(host, addr, (size_t)(colon - addr));
    host[colon - addr] = '\0';
    bool v6 = host[0] == '[';
    if (v6) {
        size_t hl = strlen(host);
        if (hl < 3 || host[hl - 1] != ']') return -EINVAL;
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
    } else if (strcmp(host, "localhost") == 0) {
        snprintf(host, sizeof host, "127.0.0.1");
    }
    size_t digits = strspn(colon + 1, "0123456789");
    if (digits == 0 || digits > 5 || colon[1 + digits]) return -EINVAL;
    int port = atoi(colon + 1);
    if (port > 65535) return -EINVAL;
    memset(sa, 0, sizeof *sa);
    return (v6 ? uv_ip6_addr(host, port, (struct sockaddr_in6 *)sa) : uv_ip4_addr(host, port, (struct sockaddr_in *)sa)) == 0
               ? 0
               : -EINVAL;
}

#define ADDR_FORMS "an IPv4 address, localhost, or an IPv6 address in brackets: [::1]:9100"

/* Whether addr is a HOST:PORT psd_http_start takes: 0, *loopback set
 * (127.x.x.x, localhost, [::1] or 127.x.x.x mapped into IPv6), or -EINVAL
 * with a message. */
static int psd_http_check(const char *addr, bool *loopback, char *err, size_t errlen)
{
    struct sockaddr_storage sa;
    char ep[128];
    if (parse_addr(addr, &sa) != 0 || snprintf(ep, sizeof ep, "tcp://%s", addr) >= (int)sizeof ep) {
        snprintf(err, errlen, "server.http: expected HOST:PORT (" ADDR_FORMS "), got '%s'", addr);
        return -EINVAL;
    }
    *loopback = ps_endpoint_is_loopback(ep); /* the rule psd's own endpoint follows */
    return 0;
}

int psd_http_settings(const char *addr, const char *token_file, bool insecure, char *token, size_t token_len,
                      bool *open, char *err, size_t errlen)
{
    bool loopback = false;
    token[0] = '\0';
    *open = false;
    if (psd_http_check(addr, &loopback, err, errlen) != 0) return -EINVAL;
    if (token_file[0]) {
        struct stat st;
        FILE *f = fopen(token_file, "r");
        if (!f || fstat(fileno(f), &st) != 0) {
            snprintf(err, errlen, "server.http_token_file %s: %s", token_file, strerror(errno));
            if (f) fclose(f);
            return -EINVAL;
        }
        if (!fgets(token, (int)token_len, f)) token[0] = '\0';
        fclose(f);
        token[strcspn(token, "\r\n")] = '\0';
        if (st.st_mode & 077) {
            snprintf(err, errlen, "server.http_token_file %s is readable by others (mode %03o): chmod 600 it",
                     token_file, (unsigned)(st.st_mode & 0777));
            return -EINVAL;
        }
        if (strlen(token) < 16) {
            snprintf(err, errlen, "server.http_token_file %s: the token (its first line) must have at least 16 "
                     "characters", token_file);
            return -EINVAL;
        }
    } else if (!loopback) {
        if (!insecure) {
            snprintf(err, errlen, "refusing HTTP on %s without a token: set server.http_token_file (requests then "
                     "need \"Authorization: Bearer <token>\"), use a loopback address, or --insecure", addr);
            return -EINVAL;
        }
        *open = true;
    }
    return 0;
}

int psd_http_start(psd_http_t **out, uv_loop_t *loop, const char *addr, const char *token, psd_http_render_fn render,
                   void *ud, char *err, size_t errlen)
{
    struct sockaddr_storage sa;
    *out = NULL;
    if (parse_addr(addr, &sa) != 0) {
        snprintf(err, errlen, "server.http: expected HOST:PORT (" ADDR_FORMS "), got '%s'", addr);
        return -EINVAL;
    }
    psd_http_t *h = calloc(1, sizeof *h);
    if (!h) return -ENOMEM;
    h->loop = loop;
    h->render = render;
    h->ud = ud;
    snprintf(h->token, sizeof h->token, "%s", token ? token : "");
    http_parser_settings_init(&h->settings);
    h->settings.on_url = on_url;
    h->settings.on_header_field = on_header_field;
    h->settings.on_header_value = on_header_value;
    h->settings.on_headers_complete = on_headers;
    h->settings.on_message_complete = on_complete;
    uv_tcp_init(loop, &h->server);
    h->server.data = h;
    int rc = uv_tcp_bind(&h->server, (const struct sockaddr *)&sa, 0);
    if (rc == 0) rc = uv_listen((uv_stream_t *)&h->server, PSD_HTTP_BACKLOG, on_connection);
    if (rc != 0) {
        snprintf(err, errlen, "server.http: cannot listen on %s: %s", addr, uv_strerror(rc));
        uv_close((uv_handle_t *)&h->server, NULL);
        uv_run(loop, UV_RUN_NOWAIT);
        free(h);
        return -EADDRINUSE;
    }
    uv_timer_init(loop, &h->timer);
    h->timer.data = h;
    uv_timer_start(&h->timer, on_tick, 500, 500);
    h->handles = 2;
    *out = h;
    return 0;
}

int psd_http_port(const psd_http_t *h)
{
    struct sockaddr_storage sa;
    int len = sizeof sa;
    if (!h || uv_tcp_getsockname(&h->server, (struct sockaddr *)&sa, &len) != 0) return -1;
    return ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port : ((struct sockaddr_in *)&sa)->sin_port);
}

static void handle_closed(uv_handle_t *hd) { ((psd_http_t *)hd->data)->handles--; }

void psd_http_stop(psd_http_t **hp)
{
    psd_http_t *h = *hp;
    if (!h) return;
    for (conn_t *c = h->conns; c; c = c->next) conn_close(c);
    uv_close((uv_handle_t *)&h->server, handle_closed);
    uv_close((uv_handle_t *)&h->timer, handle_closed);
    while (h->conns || h->handles > 0) uv_run(h->loop, UV_RUN_ONCE); /* their close callbacks */
    free(h);
    *hp = NULL;
}
