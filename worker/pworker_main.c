/* pworker - a psd worker process. Needs only psd's address; everything else
 * (rank, model, data, hyper-parameters) comes from psd. */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ps_log.h"
#include "psw_backend.h"
#include "ps_wire.h"
#include "psw_worker.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: pworker --connect tcp://HOST:PORT [options]\n"
            "\n"
            "A psd worker: registers with psd, gets its rank, model, data shard and\n"
            "hyper-parameters, and trains until psd ends the run.\n"
            "\n"
            "  --connect ENDPOINT  psd's address, e.g. tcp://10.0.0.5:5555 (required)\n"
            "  --threads N         BLAS threads (default: host cores / workers psd has on this host)\n"
            "  --data-dir DIR      look for the data files in DIR (by base name) instead of psd's paths\n"
            "  --wait SECONDS      how long to wait for psd to answer the registration (default 300)\n"
            "  --verbose           log INFO on every rank (default: only rank 0; others warn/error)\n"
            "  --help              this text\n"
            "  --version           version, protocol version and git commit\n"
            "\n"
            "exit codes: 0 run finished, 1 runtime error, 2 usage error / refused by psd /\n"
            "protocol or data mismatch, 4 psd lost (silent past its deadline)\n");
}

static int parse_int(const char *flag, const char *s, long lo, long hi, long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "pworker: %s: expected an integer in [%ld, %ld], got '%s'\n", flag, lo, hi, s);
        return -1;
    }
    *out = v;
    return 0;
}

int main(int argc, char **argv)
{
    enum { OPT_DATA_DIR = 256, OPT_WAIT, OPT_XPROTO, OPT_VERSION };
    static const struct option longopts[] = {
        {"connect", required_argument, NULL, 'c'}, {"threads", required_argument, NULL, 't'},
        {"verbose", no_argument, NULL, 'v'},       {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, OPT_VERSION}, {"data-dir", required_argument, NULL, OPT_DATA_DIR},
        {"wait", required_argument, NULL, OPT_WAIT}, {"x-protocol", required_argument, NULL, OPT_XPROTO},
        {NULL, 0, NULL, 0}};
    psw_worker_opts_t o = {.device = "cpu", .device_index = -1, .register_timeout_s = 300};
    ps_log_set_role("pworker");
    psw_blas_tune(argv);
    long v;
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", longopts, NULL)) != -1) {
        switch (c) {
        case 'c': o.connect = optarg; break;
        case 't':
            if (parse_int("--threads", optarg, 1, 1024, &v)) return 2;
            o.threads = (int)v;
            break;
        case 'v': o.verbose = 1; break;
        case 'h': usage(stdout); return 0;
        case OPT_VERSION:
            printf("pworker %s (protocol %u, commit %s)\n", PSD_VERSION, PS_PROTOCOL_VERSION, PSD_GIT_COMMIT);
            return 0;
        case OPT_DATA_DIR: o.data_dir = optarg; break;
        case OPT_WAIT:
            if (parse_int("--wait", optarg, 1, 86400, &v)) return 2;
            o.register_timeout_s = (double)v;
            break;
        case OPT_XPROTO: /* testing only: claim another protocol version */
            if (parse_int("--x-protocol", optarg, 1, INT_MAX, &v)) return 2;
            o.protocol = (unsigned)v;
            break;
        default:
            fprintf(stderr, "pworker: unknown or incomplete option '%s' (see --help)\n", argv[optind - 1]);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "pworker: unexpected argument '%s' (see --help)\n", argv[optind]);
        return 2;
    }
    if (!o.connect) {
        fprintf(stderr, "pworker: --connect tcp://HOST:PORT is required (see --help)\n");
        return 2;
    }
    if (strncmp(o.connect, "tcp://", 6) != 0 && strncmp(o.connect, "ipc://", 6) != 0) {
        fprintf(stderr, "pworker: --connect: '%s' is not a tcp:// or ipc:// endpoint\n", o.connect);
        return 2;
    }
    return psw_worker_run(&o);
}
