/* it_export.c - `psd export` and `psd eval` of safetensors files: a run's
 * weights exported evaluate exactly as the weights file does, an export of
 * the export is the same bytes, and what is not such a file is refused. */
#include <criterion/criterion.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "itest.h"
#include "proc.h"

Test(short, exported_safetensors_evaluate_as_the_weights_file)
{
    run_t r;
    const char *args[] = {"--epochs", "1", "--set", "data.train_limit=2000", "--set", "checkpoint.dir=", NULL};
    train(&r, "export", 2, args, 300);
    check_run(&r, 2, 1);
    char st[256], st2[256], a[256], b[256], out[256];
    path(st, sizeof st, "w.safetensors");
    path(st2, sizeof st2, "w2.safetensors");
    path(a, sizeof a, "eval-bin.txt");
    path(b, sizeof b, "eval-st.txt");
    path(out, sizeof out, "export.txt");
    cr_assert_eq(run_cmd("'%s' export '%s' '%s' > '%s' 2>&1", psd_bin, r.weights, st, out), 0);
    char *t = slurp(out);
    cr_assert(strstr(t, "6 tensors") && strstr(t, "wrote"), "%s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' eval '%s' > '%s' 2>&1", psd_bin, r.weights, a), 0);
    cr_assert_eq(run_cmd("'%s' eval '%s' > '%s' 2>&1", psd_bin, st, b), 0);
    char *ea = slurp(a), *eb = slurp(b);
    const char *pa = strstr(ea, ": "), *pb = strstr(eb, ": ");
    cr_assert(pa && pb, "%s / %s", ea, eb);
    cr_assert_str_eq(pa, pb, "the same samples, loss, accuracy, run, step and epoch");
    free(ea);
    free(eb);
    /* the export of the export: the same bytes (names, shapes, values, metadata) */
    cr_assert_eq(run_cmd("'%s' export '%s' '%s' > /dev/null 2>&1", psd_bin, st, st2), 0);
    cr_assert_eq(run_cmd("cmp -s '%s' '%s'", st, st2), 0, "an export of an export is the same file");
    /* refused: a cut file, another model's tensors, a non-.safetensors output name */
    cr_assert_eq(run_cmd("head -c 100 '%s' > '%s'", st, st2), 0);
    cr_assert_eq(run_cmd("'%s' eval '%s' > '%s' 2>&1", psd_bin, st2, out), 2);
    t = slurp(out);
    cr_assert(strstr(t, "w2.safetensors") && strstr(t, "psd eval: "), "names the file: %s", t);
    free(t);
    cr_assert_eq(run_cmd("'%s' export '%s' '%s' > '%s' 2>&1", psd_bin, r.weights, a, out), 2);
    t = slurp(out);
    cr_assert(strstr(t, "usage: psd export WEIGHTS OUT.safetensors"), "%s", t);
    free(t);
}
