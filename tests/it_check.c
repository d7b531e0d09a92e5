/* it_check.c - integration tests (see itest.h). */
#include <criterion/criterion.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "itest.h"
#include "proc.h"

/* psd with args (shell words), its output in dir/name: its exit code;
 * *text is the output (caller frees). A start that got past the checks
 * gives up after 5 s without workers (exit 3). */
static int psd_out(const char *args, const char *name, char **text)
{
    char out[256];
    path(out, sizeof out, name);
    int rc = run_cmd("cd '%s' && timeout 120 '%s' --workers 1 --start-timeout 5 --listen tcp://127.0.0.1:%d %s > '%s' 2>&1",
                dir, psd_bin, free_port(), args, out);
    *text = slurp(out);
    if (!*text) *text = strdup("");
    return rc;
}

/* --check-config refuses, with the same message and exit code 2 as the
 * start, an HTTP port out of range, --save and --metrics in a directory
 * that is not there, and a checkpoint.dir that is a regular file; with
 * --resume too. It binds nothing and writes nothing; a good config is still
 * OK. */
Test(short, check_config_refuses_what_the_start_refuses)
{
    char file[256], good[1024];
    path(file, sizeof file, "a-file");
    FILE *f = fopen(file, "w");
    cr_assert_not_null(f);
    fputs("not a directory\n", f);
    fclose(f);
    snprintf(good, sizeof good, "--listen tcp://127.0.0.1:0 --save '%s/w.bin' --metrics '%s/m.jsonl' --set 'checkpoint.dir=%s/ck' --http 127.0.0.1:0",
             dir, dir, dir);
    char *t, args[2048];
    snprintf(args, sizeof args, "%s --check-config", good);
    cr_assert_eq(psd_out(args, "good-check.txt", &t), 0, "%s", t);
    cr_assert(strstr(t, "config OK"), "%s", t);
    free(t);
    cr_assert_eq(run_cmd("test ! -e '%s/ck' && test ! -e '%s/w.bin' && test ! -e '%s/m.jsonl'", dir, dir, dir), 0,
                 "--check-config writes nothing");

    static const struct {
        const char *args, *names, *path; /* what the message names */
    } bad[] = {
        {"--http 127.0.0.1:99999", "server.http", "127.0.0.1:99999"},
        {"--save /nonexistent/dir/x.bin", "--save", "/nonexistent/dir/x.bin"},
        {"--metrics /nonexistent/m.jsonl", "--metrics", "/nonexistent/m.jsonl"},
        {"--set checkpoint.dir=a-file", "checkpoint.dir", "a-file"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char *c, *s, *rs;
        snprintf(args, sizeof args, "%s %s --check-config", good, bad[i].args);
        int check = psd_out(args, "check.txt", &c);
        snprintf(args, sizeof args, "%s %s", good, bad[i].args);
        int start = psd_out(args, "start.txt", &s);
        snprintf(args, sizeof args, "%s %s --check-config --resume '%s/no-checkpoints'", good, bad[i].args, dir);
        int resume = psd_out(args, "resume.txt", &rs);
        cr_log_info("%s: %s", bad[i].args, c);
        cr_assert_eq(check, 2, "--check-config %s: exit %d: %s", bad[i].args, check, c);
        cr_assert(strstr(c, bad[i].names) && strstr(c, bad[i].path) && !strstr(c, "config OK"),
                  "--check-config %s names %s and %s: %s", bad[i].args, bad[i].names, bad[i].path, c);
        cr_assert_eq(start, 2, "the start with %s: exit %d: %s", bad[i].args, start, s);
        cr_assert_str_eq(s, c, "the start with %s says what --check-config says", bad[i].args);
        cr_assert_eq(resume, 2, "--check-config --resume %s: exit %d: %s", bad[i].args, resume, rs);
        cr_assert_str_eq(rs, c, "--check-config --resume with %s says it too", bad[i].args);
        free(c);
        free(s);
        free(rs);
    }

    /* shards 1..N-1 write checkpoints, not --save or --metrics */
    snprintf(args, sizeof args, "--shard 1/2 --leader tcp://127.0.0.1:1 %s --set checkpoint.dir=a-file --check-config",
             good);
    cr_assert_eq(psd_out(args, "shard.txt", &t), 2, "%s", t);
    cr_assert(strstr(t, "checkpoint.dir a-file"), "%s", t);
    free(t);
    snprintf(args, sizeof args, "--shard 1/2 --leader tcp://127.0.0.1:1 --save /nonexistent/dir/x.bin "
             "--metrics /nonexistent/m.jsonl --set 'checkpoint.dir=%s/ck/shards' --check-config", dir);
    cr_assert_eq(psd_out(args, "shard-ok.txt", &t), 0, "%s", t);
    free(t);
}
