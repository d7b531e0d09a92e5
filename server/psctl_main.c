/* psctl - ask a running psd: status, workers, checkpoint, stop.
 *
 *   psctl status|workers|checkpoint|stop --server tcp://HOST:PORT
 *         [--key FILE --server-key FILE] [--json] [--timeout S]
 *
 * It talks to psd's worker port (shard 0's, with shards) over ZeroMQ,
 * authenticated like a worker: with CURVE, its key must be in psd's
 * allow-list. Exit 0: done; 1: psd refused or failed (its message on
 * stderr); 2: bad flags or key; 4: no answer within --timeout. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "ps_auth.h"
#include "ps_util.h"
#include "ps_wire.h"

static void usage(FILE *f)
{
    fprintf(f, "usage: psctl status|workers|checkpoint|stop --server ENDPOINT [options]\n"
               "  status       the run: phase, epoch, step, loss, accuracy, workers, checkpoints\n"
               "  workers      every worker: host, pid, device, state, compute and wait times, samples\n"
               "  checkpoint   write a checkpoint now; waits until it is written, prints its path\n"
               "  stop         checkpoint, stop the workers, end psd (like SIGTERM)\n"
               "  --server ENDPOINT   psd's worker endpoint, e.g. tcp://127.0.0.1:5555 (shard 0's)\n"
               "  --key FILE          this client's secret key (CURVE: in psd's allow-list, like a worker's)\n"
               "  --server-key FILE   psd's public key\n"
               "  --json              print psd's JSON (status, workers) instead of text\n"
               "  --timeout S         give up after S seconds (default 10; checkpoint: 300)\n"
               "exit: 0 done, 1 psd refused or failed, 2 bad flags or key, 4 no answer\n");
}

/* Send psd the command on sock and print its answer: psctl's exit code (0 done, 1 psd
 * refused or failed, 4 no answer within timeout). */
static int ask(void *sock, const char *server, const char *cmd, int json, double timeout)
{
    char err[512];
    Psd__Header h;
    Psd__Control ctl = PSD__CONTROL__INIT;
    psd__header__init(&h);
    h.type = PSD__MSG_TYPE__MSG_CONTROL;
    h.seq = 1;
    ctl.command = (char *)cmd;
    h.body_case = PSD__HEADER__BODY_CONTROL;
    h.control = &ctl;
    if (ps_msg_send(sock, NULL, 0, &h, NULL, 0) != 0) {
        fprintf(stderr, "psctl: cannot send to %s\n", server);
        return 4;
    }
    double deadline = ps_now() + timeout;
    for (;;) {
        double left = deadline - ps_now();
        zmq_pollitem_t it = {sock, 0, ZMQ_POLLIN, 0};
        if (left <= 0 || zmq_poll(&it, 1, (long)(left * 1000) + 1) <= 0) {
            fprintf(stderr, "psctl: no answer from psd at %s within %.0f s (is it running there? with keys: is this "
                            "key in its allow-list?)\n", server, timeout);
            return 4;
        }
        ps_msg_t m;
        if (ps_msg_recv(sock, &m, false, ZMQ_DONTWAIT, err, sizeof err) != 0) continue;
        if (m.hdr->type != PSD__MSG_TYPE__MSG_CONTROL_REPLY) { /* e.g. an ERROR: psd refused us */
            fprintf(stderr, "psctl: psd answered %s%s%s\n", ps_msg_type_name((int)m.hdr->type),
                    m.hdr->type == PSD__MSG_TYPE__MSG_ERROR ? ": " : "",
                    m.hdr->type == PSD__MSG_TYPE__MSG_ERROR && m.hdr->error->message ? m.hdr->error->message : "");
            ps_msg_deinit(&m);
            return 1;
        }
        Psd__ControlReply *r = m.hdr->control_reply;
        const char *text = json && r->json && r->json[0] ? r->json : r->text ? r->text : "";
        size_t n = strlen(text);
        fprintf(r->ok ? stdout : stderr, "%s%s%s", r->ok ? "" : "psctl: ", text, n && text[n - 1] == '\n' ? "" : "\n");
        int code = r->ok ? 0 : 1;
        ps_msg_deinit(&m);
        return code;
    }
}

int main(int argc, char **argv)
{
    enum { O_SERVER = 256, O_KEY, O_SKEY, O_JSON, O_TIMEOUT, O_HELP };
    static const struct option lo[] = {{"server", required_argument, NULL, O_SERVER},
                                       {"key", required_argument, NULL, O_KEY},
                                       {"server-key", required_argument, NULL, O_SKEY},
                                       {"json", no_argument, NULL, O_JSON},
                                       {"timeout", required_argument, NULL, O_TIMEOUT},
                                       {"help", no_argument, NULL, O_HELP},
                                       {NULL, 0, NULL, 0}};
    const char *server = NULL, *key = NULL, *skey = NULL, *cmd = NULL;
    int json = 0, c;
    double timeout = -1;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", lo, NULL)) != -1) {
        switch (c) {
        case O_SERVER: server = optarg; break;
        case O_KEY: key = optarg; break;
        case O_SKEY: skey = optarg; break;
        case O_JSON: json = 1; break;
        case O_TIMEOUT: {
            char *end;
            timeout = strtod(optarg, &end);
            if (*end || !(timeout > 0) || timeout > 86400) {
                fprintf(stderr, "psctl: --timeout: expected seconds in (0, 86400], got '%s'\n", optarg);
                return 2;
            }
            break;
        }
        case O_HELP: usage(stdout); return 0;
        default:
            fprintf(stderr, "psctl: unknown or incomplete option '%s' (see --help)\n", argv[optind - 1]);
            return 2;
        }
    }
    if (optind == argc - 1) cmd = argv[optind];
    if (!cmd || (strcmp(cmd, "status") && strcmp(cmd, "workers") && strcmp(cmd, "checkpoint") && strcmp(cmd, "stop"))) {
        fprintf(stderr, "psctl: expected one command: status, workers, checkpoint or stop (see --help)\n");
        return 2;
    }
    if (!server) {
        fprintf(stderr, "psctl: --server ENDPOINT is required (psd's worker endpoint)\n");
        return 2;
    }
    char why[400];
    if (ps_endpoint_check(server, PS_EP_CONNECT, why, sizeof why) != 0) {
        fprintf(stderr, "psctl: --server: %s\n", why);
        return 2;
    }
    if (!key != !skey) {
        fprintf(stderr, "psctl: --key and --server-key go together\n");
        return 2;
    }
    if (timeout < 0) timeout = strcmp(cmd, "checkpoint") == 0 ? 300 : 10;
    ps_keypair_t kp;
    char spub[PS_Z85_LEN], err[512];
    if (key && (ps_auth_load_secret(key, &kp, err, sizeof err) != 0 || ps_auth_load_public(skey, spub, err, sizeof err) != 0)) {
        fprintf(stderr, "psctl: %s\n", err);
        return 2;
    }
    int code = 4;
    void *ctx = zmq_ctx_new(), *sock = ctx ? zmq_socket(ctx, ZMQ_DEALER) : NULL;
    if (!sock) {
        fprintf(stderr, "psctl: zeromq: %s\n", zmq_strerror(zmq_errno()));
        return 1;
    }
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    if (key) {
        zmq_setsockopt(sock, ZMQ_CURVE_SERVERKEY, spub, 40);
        zmq_setsockopt(sock, ZMQ_CURVE_PUBLICKEY, kp.public_z85, 40);
        zmq_setsockopt(sock, ZMQ_CURVE_SECRETKEY, kp.secret_z85, 40);
        memset(&kp, 0, sizeof kp);
    }
    ps_zmq_endpoint_opts(sock, server);
    if (zmq_connect(sock, server) != 0) {
        fprintf(stderr, "psctl: cannot connect to '%s': %s\n", server, zmq_strerror(zmq_errno()));
        code = 2;
        goto out;
    }
    code = ask(sock, server, cmd, json, timeout);
out:
    zmq_close(sock);
    zmq_ctx_term(ctx);
    return code;
}
