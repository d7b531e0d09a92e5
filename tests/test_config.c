/* test_config.c - ps_config: defaults, YAML loading and its error messages,
 * flags, validation, the YAML round trip and the config hash. */
#include <criterion/criterion.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ps_config.h"
#include "ps_log.h"
#include "ps_model.h"

#define FM "/usr/share/datasets/fashion-mnist/"

static char err[512];

/* Load yaml over defaults as "test.yaml"; returns the rc, message in err. */
static int load(ps_config_t *c, const char *yaml)
{
    ps_config_defaults(c);
    err[0] = '\0';
    return ps_config_load_string(c, yaml, strlen(yaml), "test.yaml", err, sizeof err);
}

/* yaml must fail with a message containing every one of the given parts. */
static void expect_load_error(const char *yaml, const char *part1, const char *part2)
{
    ps_config_t c;
    cr_expect_eq(load(&c, yaml), -1, "accepted:\n%s", yaml);
    cr_expect(strstr(err, part1) != NULL, "message '%s' lacks '%s'", err, part1);
    if (part2) cr_expect(strstr(err, part2) != NULL, "message '%s' lacks '%s'", err, part2);
    cr_expect(strchr(err, '\n') == NULL, "message is more than one line: '%s'", err);
}

static char *write_to_string(const ps_config_t *c)
{
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    cr_assert_not_null(f);
    cr_assert_eq(ps_config_write_yaml(c, f), 0);
    cr_assert_eq(fclose(f), 0);
    return text;
}

/* Every field, compared one by one (doubles exactly). */
static void expect_same(const ps_config_t *a, const ps_config_t *b)
{
    cr_expect_eq(a->seed, b->seed);
    cr_expect_eq(a->epochs, b->epochs);
    cr_expect_eq(a->n_sizes, b->n_sizes);
    for (int i = 0; i < a->n_sizes; i++) cr_expect_eq(a->sizes[i], b->sizes[i], "sizes[%d]", i);
    cr_expect_eq(a->activation, b->activation);
    cr_expect_str_eq(a->train_images, b->train_images);
    cr_expect_str_eq(a->train_labels, b->train_labels);
    cr_expect_str_eq(a->test_images, b->test_images);
    cr_expect_str_eq(a->test_labels, b->test_labels);
    cr_expect_eq(a->norm_mean, b->norm_mean);
    cr_expect_eq(a->norm_std, b->norm_std);
    cr_expect_eq(a->train_limit, b->train_limit);
    cr_expect_eq(a->batch_size, b->batch_size);
    cr_expect_eq(a->val_batch_size, b->val_batch_size);
    cr_expect_eq(a->opt, b->opt);
    cr_expect_eq(a->lr, b->lr);
    cr_expect_eq(a->momentum, b->momentum);
    cr_expect_eq(a->nesterov, b->nesterov);
    cr_expect_eq(a->weight_decay, b->weight_decay);
    cr_expect_eq(a->beta1, b->beta1);
    cr_expect_eq(a->beta2, b->beta2);
    cr_expect_eq(a->eps, b->eps);
    cr_expect_eq(a->clip_norm, b->clip_norm);
    cr_expect_eq(a->n_groups, b->n_groups);
    for (int i = 0; i < a->n_groups && i < b->n_groups; i++) {
        cr_expect_str_eq(a->groups[i].match, b->groups[i].match, "groups[%d]", i);
        cr_expect_eq(a->groups[i].has_wd, b->groups[i].has_wd, "groups[%d]", i);
        cr_expect_eq(a->groups[i].weight_decay, b->groups[i].weight_decay, "groups[%d]", i);
        cr_expect_eq(a->groups[i].lr_scale, b->groups[i].lr_scale, "groups[%d]", i);
    }
    cr_expect_eq(a->divergence_factor, b->divergence_factor);
    cr_expect_eq(a->sched, b->sched);
    cr_expect_eq(a->warmup_epochs, b->warmup_epochs);
    cr_expect_eq(a->step_epochs, b->step_epochs);
    cr_expect_eq(a->gamma, b->gamma);
    cr_expect_eq(a->min_lr, b->min_lr);
    cr_expect_eq(a->pct_start, b->pct_start);
    cr_expect_eq(a->div_factor, b->div_factor);
    cr_expect_eq(a->final_div_factor, b->final_div_factor);
    cr_expect_str_eq(a->listen, b->listen);
    cr_expect_eq(a->workers, b->workers);
    cr_expect_eq(a->start_timeout, b->start_timeout);
    cr_expect_eq(a->worker_timeout, b->worker_timeout);
    cr_expect_str_eq(a->metrics, b->metrics);
    cr_expect_str_eq(a->save, b->save);
    cr_expect_eq(a->log_level, b->log_level);
    cr_expect_str_eq(a->ckpt_dir, b->ckpt_dir);
    cr_expect_eq(a->ckpt_every_epochs, b->ckpt_every_epochs);
    cr_expect_eq(a->ckpt_every_steps, b->ckpt_every_steps);
    cr_expect_eq(a->ckpt_keep, b->ckpt_keep);
}

/* write(c) -> load over defaults -> same fields and same text. */
static void expect_round_trip(const ps_config_t *c)
{
    char *text = write_to_string(c);
    ps_config_t d;
    int rc = load(&d, text);
    cr_assert_eq(rc, 0, "%s\n%s", err, text);
    expect_same(c, &d);
    char *again = write_to_string(&d);
    cr_expect_str_eq(text, again);
    free(text);
    free(again);
}

/* ------------------------------------------------------------ defaults */

Test(config, defaults_validate)
{
    ps_config_t c;
    ps_config_defaults(&c);
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
}

Test(config, defaults_values)
{
    ps_config_t c;
    ps_config_defaults(&c);
    cr_expect_eq(c.seed, 42);
    cr_expect_eq(c.epochs, 15);
    cr_expect_eq(c.n_sizes, 4);
    cr_expect_eq(c.sizes[0], 784);
    cr_expect_eq(c.sizes[1], 512);
    cr_expect_eq(c.sizes[2], 256);
    cr_expect_eq(c.sizes[3], 10);
    cr_expect_eq(c.sizes[4], 0);
    cr_expect_eq(c.activation, PS_ACT_RELU);
    cr_expect_str_eq(c.train_images, FM "train-images-idx3-ubyte.gz");
    cr_expect_str_eq(c.train_labels, FM "train-labels-idx1-ubyte.gz");
    cr_expect_str_eq(c.test_images, FM "t10k-images-idx3-ubyte.gz");
    cr_expect_str_eq(c.test_labels, FM "t10k-labels-idx1-ubyte.gz");
    cr_expect_eq(c.norm_mean, 0.2860);
    cr_expect_eq(c.norm_std, 0.3530);
    cr_expect_eq(c.train_limit, 0);
    cr_expect_eq(c.batch_size, 64);
    cr_expect_eq(c.val_batch_size, 500);
    cr_expect_eq(c.opt, PS_OPT_SGD);
    cr_expect_eq(c.lr, 0.1);
    cr_expect_eq(c.momentum, 0.9);
    cr_expect_eq(c.nesterov, true);
    cr_expect_eq(c.weight_decay, 5e-4);
    cr_expect_eq(c.beta1, 0.9);
    cr_expect_eq(c.beta2, 0.999);
    cr_expect_eq(c.eps, 1e-8);
    cr_expect_eq(c.clip_norm, 0.0);
    cr_expect_eq(c.sched, PS_SCHED_ONECYCLE);
    cr_expect_eq(c.warmup_epochs, 0.0);
    cr_expect_eq(c.step_epochs, 5.0);
    cr_expect_eq(c.gamma, 0.1);
    cr_expect_eq(c.min_lr, 0.0);
    cr_expect_eq(c.pct_start, 0.25);
    cr_expect_eq(c.div_factor, 25.0);
    cr_expect_eq(c.final_div_factor, 1e4);
    cr_expect_str_eq(c.listen, "tcp://0.0.0.0:5555");
    cr_expect_eq(c.workers, 2);
    cr_expect_eq(c.start_timeout, 300.0);
    cr_expect_eq(c.worker_timeout, 5.0);
    cr_expect_str_eq(c.ckpt_dir, "psd-checkpoints");
    cr_expect_eq(c.ckpt_every_epochs, 1);
    cr_expect_eq(c.ckpt_every_steps, 0);
    cr_expect_eq(c.ckpt_keep, 3);
    cr_expect_str_eq(c.metrics, "psd-metrics.jsonl");
    cr_expect_str_eq(c.save, "psd-weights.bin");
    cr_expect_eq(c.log_level, PS_LOG_INFO);
}

Test(config, enum_names)
{
    cr_expect_str_eq(ps_opt_name(PS_OPT_ADAMW), "adamw");
    cr_expect_str_eq(ps_sched_name(PS_SCHED_COSINE), "cosine");
    cr_expect_str_eq(ps_log_level_name(PS_LOG_DEBUG), "debug");
    cr_expect_str_eq(ps_opt_name((ps_opt_kind_t)99), "?");
}

/* ------------------------------------------------------------ loading */

static const char full_yaml[] =
    "# every key, none at its default\n"
    "run:\n"
    "  seed: 18446744073709551615\n"
    "  epochs: 3\n"
    "model:\n"
    "  layers: [784, 128, 64, 32, 10]\n"
    "  activation: relu\n"
    "data:\n"
    "  train_images: /data/a-images.gz\n"
    "  train_labels: '/data/a labels.gz'\n"
    "  test_images: \"/data/b-images\"\n"
    "  test_labels: /data/b-labels\n"
    "  normalize_mean: 0.1307\n"
    "  normalize_std: 0.3081\n"
    "  train_limit: 10000\n"
    "train:\n"
    "  batch_size: 128\n"
    "  val_batch_size: 1000\n"
    "optimizer:\n"
    "  name: adamw\n"
    "  lr: 3e-4\n"
    "  momentum: 0.8\n"
    "  nesterov: no\n"
    "  weight_decay: 0.01\n"
    "  beta1: 0.85\n"
    "  beta2: 0.99\n"
    "  eps: 1e-6\n"
    "  clip_norm: 1.5\n"
    "schedule:\n"
    "  name: cosine\n"
    "  warmup_epochs: 0.5\n"
    "  step_epochs: 2\n"
    "  gamma: 0.5\n"
    "  min_lr: 1e-5\n"
    "  pct_start: 0.3\n"
    "  div_factor: 10\n"
    "  final_div_factor: 100\n"
    "server:\n"
    "  listen: tcp://127.0.0.1:6000\n"
    "  workers: 4\n"
    "  start_timeout: 12.5\n"
    "  worker_timeout: 7\n"
    "  metrics: ''\n"
    "  save: out/w.bin\n"
    "  log_level: debug\n";

Test(config, full_example)
{
    ps_config_t c;
    cr_assert_eq(load(&c, full_yaml), 0, "%s", err);
    cr_expect_eq(c.seed, UINT64_MAX);
    cr_expect_eq(c.epochs, 3);
    cr_expect_eq(c.n_sizes, 5);
    const int sizes[] = {784, 128, 64, 32, 10};
    for (int i = 0; i < 5; i++) cr_expect_eq(c.sizes[i], sizes[i]);
    cr_expect_eq(c.activation, PS_ACT_RELU);
    cr_expect_str_eq(c.train_images, "/data/a-images.gz");
    cr_expect_str_eq(c.train_labels, "/data/a labels.gz");
    cr_expect_str_eq(c.test_images, "/data/b-images");
    cr_expect_str_eq(c.test_labels, "/data/b-labels");
    cr_expect_eq(c.norm_mean, 0.1307);
    cr_expect_eq(c.norm_std, 0.3081);
    cr_expect_eq(c.train_limit, 10000);
    cr_expect_eq(c.batch_size, 128);
    cr_expect_eq(c.val_batch_size, 1000);
    cr_expect_eq(c.opt, PS_OPT_ADAMW);
    cr_expect_eq(c.lr, 3e-4);
    cr_expect_eq(c.momentum, 0.8);
    cr_expect_eq(c.nesterov, false);
    cr_expect_eq(c.weight_decay, 0.01);
    cr_expect_eq(c.beta1, 0.85);
    cr_expect_eq(c.beta2, 0.99);
    cr_expect_eq(c.eps, 1e-6);
    cr_expect_eq(c.clip_norm, 1.5);
    cr_expect_eq(c.sched, PS_SCHED_COSINE);
    cr_expect_eq(c.warmup_epochs, 0.5);
    cr_expect_eq(c.step_epochs, 2.0);
    cr_expect_eq(c.gamma, 0.5);
    cr_expect_eq(c.min_lr, 1e-5);
    cr_expect_eq(c.pct_start, 0.3);
    cr_expect_eq(c.div_factor, 10.0);
    cr_expect_eq(c.final_div_factor, 100.0);
    cr_expect_str_eq(c.listen, "tcp://127.0.0.1:6000");
    cr_expect_eq(c.workers, 4);
    cr_expect_eq(c.start_timeout, 12.5);
    cr_expect_eq(c.worker_timeout, 7.0);
    cr_expect_str_eq(c.metrics, "");
    cr_expect_str_eq(c.save, "out/w.bin");
    cr_expect_eq(c.log_level, PS_LOG_DEBUG);
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
}

Test(config, partial_file_keeps_other_values)
{
    ps_config_t c;
    cr_assert_eq(load(&c, "optimizer: {name: sgd, lr: 0.05}\n"), 0, "%s", err);
    cr_expect_eq(c.lr, 0.05);
    cr_expect_eq(c.momentum, 0.9);
    cr_expect_eq(c.epochs, 15);
    cr_expect_eq(c.n_sizes, 4);
}

Test(config, block_sequence_layers)
{
    ps_config_t c;
    cr_assert_eq(load(&c, "model:\n  layers:\n    - 784\n    - 100\n    - 10\n"), 0, "%s", err);
    cr_expect_eq(c.n_sizes, 3);
    cr_expect_eq(c.sizes[1], 100);
    cr_expect_eq(c.sizes[3], 0, "entries past n_sizes are cleared");
}

Test(config, empty_documents_are_defaults)
{
    const char *docs[] = {"", "# only a comment\n", "---\n", "---\n...\n", "\n\n", "~\n",
                          "run:\n", "run: {}\n"};
    ps_config_t d;
    ps_config_defaults(&d);
    for (size_t i = 0; i < sizeof docs / sizeof docs[0]; i++) {
        ps_config_t c;
        cr_expect_eq(load(&c, docs[i]), 0, "'%s': %s", docs[i], err);
        expect_same(&c, &d);
    }
}

Test(config, bool_spellings)
{
    const char *t[] = {"true", "True", "yes", "on", "1", "ON"};
    const char *f[] = {"false", "FALSE", "no", "off", "0", "No"};
    for (size_t i = 0; i < 6; i++) {
        char y[64];
        ps_config_t c;
        snprintf(y, sizeof y, "optimizer: {nesterov: %s}\n", f[i]);
        cr_expect_eq(load(&c, y), 0, "%s", err);
        cr_expect_eq(c.nesterov, false, "%s", f[i]);
        cr_expect_eq(ps_config_set(&c, "optimizer.nesterov", t[i], err, sizeof err), 0, "%s", err);
        cr_expect_eq(c.nesterov, true, "%s", t[i]);
    }
    expect_load_error("optimizer:\n  nesterov: maybe\n",
                      "test.yaml:2: optimizer.nesterov: expected true or false, got 'maybe'", NULL);
}

Test(config, null_string_means_empty)
{
    ps_config_t c;
    cr_assert_eq(load(&c, "server:\n  metrics:\n  save: ~\n"), 0, "%s", err);
    cr_expect_str_eq(c.metrics, "");
    cr_expect_str_eq(c.save, "");
    cr_assert_eq(load(&c, "server:\n  save: 'null'\n"), 0, "%s", err);
    cr_expect_str_eq(c.save, "null", "a quoted null is text");
}

/* ------------------------------------------------------------ load errors */

Test(config, unknown_key_names_key_and_line)
{
    ps_config_t c;
    cr_expect_eq(load(&c, "run:\n  epochs: 3\noptimizer:\n  name: sgd\n  lrr: 0.1\n"), -1);
    cr_expect_str_eq(err, "test.yaml:5: unknown key 'optimizer.lrr'");
}

Test(config, unknown_section)
{
    expect_load_error("run: {epochs: 2}\n\noptimiser:\n  lr: 0.1\n",
                      "test.yaml:3: unknown section 'optimiser'", "optimizer");
}

Test(config, wrong_type)
{
    ps_config_t c;
    cr_expect_eq(load(&c, "optimizer:\n  lr: abc\n"), -1);
    cr_expect_str_eq(err, "test.yaml:2: optimizer.lr: expected a number, got 'abc'");
    expect_load_error("run:\n  epochs: 1.5\n", "test.yaml:2: run.epochs: expected an integer",
                      "'1.5'");
    expect_load_error("run:\n  epochs: 12abc\n", "test.yaml:2: run.epochs", "'12abc'");
    expect_load_error("run:\n  epochs: ''\n", "run.epochs: expected an integer", NULL);
    expect_load_error("run:\n  seed: -1\n", "run.seed: expected an integer", NULL);
    expect_load_error("optimizer:\n  lr: 0.1x\n", "optimizer.lr: expected a number", NULL);
    expect_load_error("optimizer:\n  lr: ' 0.1'\n", "optimizer.lr: expected a number", NULL);
}

Test(config, non_finite_and_overflow_rejected)
{
    expect_load_error("optimizer: {lr: nan}\n", "optimizer.lr", "'nan'");
    expect_load_error("optimizer: {lr: inf}\n", "optimizer.lr", "'inf'");
    expect_load_error("optimizer: {lr: -Infinity}\n", "optimizer.lr", "'-Infinity'");
    expect_load_error("optimizer: {lr: .inf}\n", "optimizer.lr", "'.inf'");
    expect_load_error("optimizer: {lr: 1e999}\n", "optimizer.lr", "'1e999'");
    expect_load_error("run: {epochs: 99999999999999999999}\n", "run.epochs",
                      "99999999999999999999 is out of range");
    expect_load_error("run: {epochs: 3000000000}\n", "run.epochs", "out of range");
    expect_load_error("run: {seed: 18446744073709551616}\n", "run.seed", "out of range");
    expect_load_error("data: {train_limit: 9223372036854775808}\n", "data.train_limit",
                      "out of range");
}

Test(config, bad_enum)
{
    expect_load_error("optimizer:\n  name: rmsprop\n",
                      "test.yaml:2: optimizer.name: expected one of sgd, adam, adamw, adagrad, got 'rmsprop'",
                      NULL);
    expect_load_error("schedule: {name: linear}\n",
                      "schedule.name: expected one of constant, step, cosine, onecycle", NULL);
    expect_load_error("server: {log_level: verbose}\n", "expected one of error, warn, info, debug",
                      NULL);
    expect_load_error("model: {activation: tanh}\n", "expected one of relu", NULL);
}

Test(config, syntax_error_has_line)
{
    ps_config_t c;
    cr_expect_eq(load(&c, "run:\n  epochs: 3\n  - x\n"), -1);
    cr_expect_str_eq(err, "test.yaml:3: YAML syntax error: did not find expected key "
                          "(while parsing a block mapping)");
    cr_expect_eq(load(&c, "run:\n  epochs: 3\n bad: 1\n"), -1);
    cr_expect(strncmp(err, "test.yaml:3: YAML syntax error", 30) == 0, "%s", err);
    cr_expect_eq(load(&c, "run:\n  epochs: @x\n"), -1);
    cr_expect(strncmp(err, "test.yaml:2: YAML syntax error", 30) == 0, "%s", err);
    cr_expect_eq(load(&c, "run:\n  epochs: 3\x01\n"), -1);
    cr_expect(strstr(err, "control characters are not allowed") != NULL, "%s", err);
    cr_expect_eq(load(&c, "optimizer:\n  lr: \"0.1\n"), -1);
    cr_expect(strstr(err, "YAML syntax error") != NULL, "%s", err);
    cr_expect_eq(load(&c, "run:\n\tepochs: 3\n"), -1);
    cr_expect(strncmp(err, "test.yaml:2:", 12) == 0, "%s", err);
}

Test(config, out_of_range)
{
    expect_load_error("optimizer:\n  lr: 0\n", "test.yaml:2: optimizer.lr: 0 is out of range",
                      "must be > 0");
    expect_load_error("optimizer:\n  lr: -0.1\n", "optimizer.lr: -0.1 is out of range", NULL);
    expect_load_error("optimizer:\n  beta1: 1\n", "optimizer.beta1: 1 is out of range",
                      "[0, 1)");
    expect_load_error("optimizer:\n  momentum: -0.5\n", "optimizer.momentum", "out of range");
    expect_load_error("server:\n  workers: 5000\n", "server.workers: 5000 is out of range",
                      "[1, 1024]");
    expect_load_error("server:\n  workers: 0\n", "server.workers", "out of range");
    expect_load_error("run:\n  epochs: 0\n", "run.epochs: 0 is out of range", NULL);
    expect_load_error("train:\n  batch_size: -1\n", "train.batch_size", "out of range");
    expect_load_error("data:\n  normalize_std: 0\n", "data.normalize_std", "out of range");
    expect_load_error("data:\n  train_limit: -1\n", "data.train_limit", "must be >= 0");
    expect_load_error("server:\n  worker_timeout: 0\n", "server.worker_timeout", "out of range");
    expect_load_error("server:\n  listen: ''\n", "test.yaml:2: server.listen: must not be empty",
                      NULL);
}

Test(config, sequence_or_mapping_where_scalar_expected)
{
    expect_load_error("optimizer:\n  lr: [0.1, 0.2]\n",
                      "test.yaml:2: optimizer.lr: expected a number, got a sequence", NULL);
    expect_load_error("optimizer:\n  name:\n    kind: sgd\n",
                      "test.yaml:3: optimizer.name: expected one of sgd, adam, adamw, adagrad, got a mapping",
                      NULL);
    expect_load_error("data:\n  train_images: [a, b]\n", "data.train_images: expected a string",
                      "sequence");
}

Test(config, scalar_where_sequence_or_mapping_expected)
{
    expect_load_error("model:\n  layers: 784\n", "test.yaml:2: model.layers: expected a sequence",
                      "got a scalar");
    expect_load_error("model:\n  layers: {a: 1}\n", "model.layers: expected a sequence",
                      "got a mapping");
    expect_load_error("optimizer: sgd\n", "test.yaml:1: section 'optimizer' must be a mapping",
                      "got a scalar");
    expect_load_error("optimizer:\n  - lr\n", "section 'optimizer' must be a mapping",
                      "got a sequence");
}

Test(config, non_mapping_top_level)
{
    expect_load_error("hello\n", "test.yaml:1: top level must be a mapping", "got a scalar");
    expect_load_error("- run\n- model\n", "top level must be a mapping", "got a sequence");
}

Test(config, duplicate_key_and_section)
{
    expect_load_error("optimizer:\n  lr: 0.1\n  lr: 0.2\n", "test.yaml:3: duplicate key 'optimizer.lr'",
                      NULL);
    expect_load_error("run: {epochs: 2}\nmodel: {activation: relu}\nrun: {seed: 1}\n",
                      "test.yaml:3: duplicate section 'run'", NULL);
}

Test(config, other_structure_errors)
{
    expect_load_error("run: {epochs: 2}\n---\nrun: {epochs: 3}\n", "only one YAML document", NULL);
    expect_load_error("run: &r {epochs: 2}\nmodel: *r\n", "test.yaml:2:", "alias");
    expect_load_error("run:\n  ? [a, b]\n  : 1\n", "expected a key in section 'run'", NULL);
    expect_load_error("run:\n  epochs: \"1\\0\"\n", "NUL byte", NULL);
}

Test(config, layer_sizes_rejected)
{
    expect_load_error("model:\n  layers: [784, 0, 10]\n",
                      "test.yaml:2: model.layers: layer size 0 is out of range", "[1, 1048576]");
    expect_load_error("model:\n  layers:\n    - 784\n    - -5\n    - 10\n",
                      "test.yaml:4: model.layers: layer size -5 is out of range", NULL);
    expect_load_error("model:\n  layers: [784]\n", "test.yaml:2: model.layers: expected at least 2",
                      "got 1");
    expect_load_error("model:\n  layers: []\n", "model.layers: expected at least 2", "got 0");
    expect_load_error("model:\n  layers: [784, 2000000, 10]\n", "layer size 2000000", NULL);
    expect_load_error("model:\n  layers: [784, 1.5, 10]\n",
                      "model.layers: expected an integer layer size, got '1.5'", NULL);
    expect_load_error("model:\n  layers: [784, [1, 2], 10]\n",
                      "model.layers: expected an integer layer size, got a sequence", NULL);

    /* 17 sizes (16 layers) is the limit; 18 is too many. */
    char ok[256] = "model:\n  layers: [", over[300];
    for (int i = 0; i < PS_MAX_LAYERS + 1; i++) strcat(ok, i ? ", 8" : "8");
    snprintf(over, sizeof over, "%s, 8]\n", ok);
    strcat(ok, "]\n");
    ps_config_t c;
    cr_expect_eq(load(&c, ok), 0, "%s", err);
    cr_expect_eq(c.n_sizes, PS_MAX_LAYERS + 1);
    expect_load_error(over, "test.yaml:2: model.layers: too many layer sizes", "at most 17");
}

/* yaml loads, and ps_config_validate refuses it with a message holding part */
static void expect_invalid_yaml(const char *yaml, const char *part)
{
    ps_config_t c;
    cr_assert_eq(load(&c, yaml), 0, "%s", err);
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), -1, "accepted:\n%s", yaml);
    cr_expect(strstr(err, part) != NULL, "message '%s' lacks '%s'", err, part);
}

Test(config, ctr_task)
{
    ps_config_t c;
    cr_expect_eq(load(&c, "model:\n  kind: ctr\n  layers: [32, 16, 2]\nctr:\n  fields: 4\n  dim: 8\n"
                          "  rows: 1000\n  per_field: 3\n"),
                 0, "%s", err);
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
    cr_expect_eq(c.kind, PS_MODEL_CTR);
    cr_expect_eq(c.ctr_fields, 4);
    cr_expect_eq(c.ctr_per_field, 3);
    cr_expect_eq(c.ctr_rows, 1000);
    ps_layout_t l;
    cr_assert_eq(ps_config_layout(&c, &l), 0);
    cr_expect_eq(l.table, 4);
    cr_expect_eq(l.t[4].rows, 1000);
    cr_expect_eq(l.t[4].cols, 8);
    cr_expect_eq(l.n_params, l.t[4].offset + 8000);
    expect_invalid_yaml("model:\n  kind: ctr\n  layers: [30, 16, 2]\nctr:\n  fields: 4\n  dim: 8\n",
                      "model.layers: with model.kind: ctr the first size is ctr.fields x ctr.dim = 32");
    expect_invalid_yaml("model:\n  kind: ctr\n  layers: [32, 16, 3]\nctr:\n  fields: 4\n  dim: 8\n",
                      "and the last 2");
    expect_invalid_yaml("model:\n  kind: ctr\n  layers: [32, 2]\nctr:\n  fields: 4\n  dim: 8\n  per_field: 100\n",
                      "ctr.fields x ctr.per_field: 400 ids per example, at most 256");
    expect_invalid_yaml("model:\n  kind: ctr\n  layers: [32, 2]\nctr:\n  fields: 4\n  dim: 8\n  rows: 300000000\n",
                        "ctr.rows x ctr.dim");
    expect_invalid_yaml("model:\n  kind: ctr\n  layers: [32, 2]\nctr:\n  fields: 4\n  dim: 8\n  train: 4000000000\n"
                        "  test: 400000000\n",
                        "ctr.train + ctr.test");
    expect_load_error("model:\n  kind: tree\n", "model.kind", "mlp");
    /* the MLP ignores the ctr section, and its layout has no table */
    cr_expect_eq(load(&c, "ctr:\n  fields: 4\n"), 0, "%s", err);
    cr_assert_eq(ps_config_layout(&c, &l), 0);
    cr_expect_eq(l.table, -1);
}

Test(config, error_leaves_config_unchanged)
{
    ps_config_t c, before;
    ps_config_defaults(&c);
    before = c;
    const char *y = "run: {epochs: 7}\noptimizer: {lr: 0.5, momentum: 2}\n";
    cr_expect_eq(ps_config_load_string(&c, y, strlen(y), NULL, err, sizeof err), -1);
    cr_expect(strncmp(err, "<string>:2: optimizer.momentum", 30) == 0, "%s", err);
    expect_same(&c, &before);
    cr_expect_eq(ps_config_set(&c, "optimizer.lr", "x", err, sizeof err), -1);
    cr_expect_eq(ps_config_set(&c, "model.layers", "784,0,10", err, sizeof err), -1);
    expect_same(&c, &before);
}

Test(config, small_or_missing_error_buffer)
{
    ps_config_t c;
    ps_config_defaults(&c);
    const char *y = "optimizer: {lrr: 1}\n";
    cr_expect_eq(ps_config_load_string(&c, y, strlen(y), "x.yaml", NULL, 0), -1);
    char small[8];
    cr_expect_eq(ps_config_load_string(&c, y, strlen(y), "x.yaml", small, sizeof small), -1);
    cr_expect_str_eq(small, "x.yaml:");
    cr_expect_eq(ps_config_set(&c, "nope", "1", NULL, 0), -1);
}

Test(config, path_too_long)
{
    size_t n = PS_PATH_MAX + 20;
    char *y = malloc(n + 64);
    cr_assert_not_null(y);
    int k = sprintf(y, "data:\n  train_images: ");
    memset(y + k, 'a', PS_PATH_MAX);
    strcpy(y + k + PS_PATH_MAX, "\n");
    expect_load_error(y, "test.yaml:2: data.train_images: too long (1024 bytes, at most 1023)",
                      NULL);
    /* One byte shorter fits. */
    strcpy(y + k + PS_PATH_MAX - 1, "\n");
    ps_config_t c;
    cr_expect_eq(load(&c, y), 0, "%s", err);
    cr_expect_eq(strlen(c.train_images), PS_PATH_MAX - 1);
    free(y);

    char big[PS_ENDPOINT_MAX + 1];
    memset(big, 'x', PS_ENDPOINT_MAX);
    big[PS_ENDPOINT_MAX] = '\0';
    cr_expect_eq(ps_config_set(&c, "server.listen", big, err, sizeof err), -1);
    cr_expect(strstr(err, "server.listen: too long") != NULL, "%s", err);
}

/* ------------------------------------------------------------ flags */

Test(config, set_flags)
{
    ps_config_t c;
    ps_config_defaults(&c);
    cr_expect_eq(ps_config_set(&c, "optimizer.lr", "0.025", err, sizeof err), 0, "%s", err);
    cr_expect_eq(c.lr, 0.025);
    cr_expect_eq(ps_config_set(&c, "optimizer.name", "adam", err, sizeof err), 0, "%s", err);
    cr_expect_eq(c.opt, PS_OPT_ADAM);
    cr_expect_eq(ps_config_set(&c, "run.seed", "7", err, sizeof err), 0, "%s", err);
    cr_expect_eq(c.seed, 7);
    cr_expect_eq(ps_config_set(&c, "server.workers", "8", err, sizeof err), 0, "%s", err);
    cr_expect_eq(c.workers, 8);
    cr_expect_eq(ps_config_set(&c, "server.listen", "ipc:///tmp/psd", err, sizeof err), 0);
    cr_expect_str_eq(c.listen, "ipc:///tmp/psd");
    cr_expect_eq(ps_config_set(&c, "server.metrics", "", err, sizeof err), 0);
    cr_expect_str_eq(c.metrics, "");
    cr_expect_eq(ps_config_set(&c, "data.train_limit", "5000", err, sizeof err), 0);
    cr_expect_eq(c.train_limit, 5000);

    cr_expect_eq(ps_config_set(&c, "optimizer.lrr", "0.1", err, sizeof err), -1);
    cr_expect_str_eq(err, "unknown key 'optimizer.lrr'");
    cr_expect_eq(ps_config_set(&c, "optimizer.lr", "abc", err, sizeof err), -1);
    cr_expect_str_eq(err, "optimizer.lr: expected a number, got 'abc'");
    cr_expect_eq(ps_config_set(&c, "optimizer.name", "sgdd", err, sizeof err), -1);
    cr_expect_str_eq(err, "optimizer.name: expected one of sgd, adam, adamw, adagrad, got 'sgdd'");
    cr_expect_eq(ps_config_set(&c, "server.workers", "0", err, sizeof err), -1);
    cr_expect(strstr(err, "server.workers: 0 is out of range") != NULL, "%s", err);
    cr_expect_eq(ps_config_set(&c, "optimizer", "sgd", err, sizeof err), -1);
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
    /* an endpoint libzmq would take modulo 65536 */
    cr_expect_eq(ps_config_set(&c, "server.listen", "tcp://127.0.0.1:99999", err, sizeof err), 0);
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), -1);
    cr_expect(strstr(err, "server.listen: 'tcp://127.0.0.1:99999': the port must be a number from 0 to 65535"),
              "%s", err);
    cr_expect_eq(ps_config_set(&c, "server.listen", "tcp://127.0.0.1:0", err, sizeof err), 0);
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
}

Test(config, set_layers)
{
    ps_config_t c;
    ps_config_defaults(&c);
    cr_assert_eq(ps_config_set(&c, "model.layers", "784,256,10", err, sizeof err), 0, "%s", err);
    cr_expect_eq(c.n_sizes, 3);
    cr_expect_eq(c.sizes[0], 784);
    cr_expect_eq(c.sizes[1], 256);
    cr_expect_eq(c.sizes[2], 10);
    cr_expect_eq(c.sizes[3], 0);
    cr_assert_eq(ps_config_set(&c, "model.layers", "[784, 100, 50, 10]", err, sizeof err), 0,
                 "%s", err);
    cr_expect_eq(c.n_sizes, 4);
    cr_expect_eq(c.sizes[2], 50);
    cr_assert_eq(ps_config_set(&c, "model.layers", " [ 2 ,3 ] ", err, sizeof err), 0, "%s", err);
    cr_expect_eq(c.n_sizes, 2);
    cr_expect_eq(c.sizes[1], 3);

    const char *bad[] = {"784",         "[784]",      "",           "[]",     "784,,10",
                         "784,256,",    "[784, 256",  "784, 0, 10", "784,-1,10",
                         "784,abc,10",  "784;256;10", "784 256 10", "784,2e3,10",
                         "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cr_expect_eq(ps_config_set(&c, "model.layers", bad[i], err, sizeof err), -1, "'%s'",
                     bad[i]);
        cr_expect(strncmp(err, "model.layers: ", 14) == 0, "'%s': %s", bad[i], err);
    }
    cr_expect_eq(c.n_sizes, 2, "failed sets leave layers alone");
    cr_expect_eq(ps_config_set(&c, "model.layers", "1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17",
                               err, sizeof err),
                 0, "%s", err);
    cr_expect_eq(c.n_sizes, 17);
}

/* ------------------------------------------------------------ validation */

static void expect_invalid(const ps_config_t *c, const char *part)
{
    cr_expect_eq(ps_config_validate(c, err, sizeof err), -1, "accepted (expected '%s')", part);
    cr_expect(strstr(err, part) != NULL, "message '%s' lacks '%s'", err, part);
}

Test(config, validate_rejects_bad_structs)
{
    ps_config_t d, c;
    ps_config_defaults(&d);

    c = d, c.n_sizes = 1;
    expect_invalid(&c, "model.layers: expected at least 2");
    c = d, c.n_sizes = PS_MAX_LAYERS + 2;
    expect_invalid(&c, "model.layers: too many");
    c = d, c.n_sizes = -3;
    expect_invalid(&c, "model.layers");
    c = d, c.sizes[2] = 0;
    expect_invalid(&c, "model.layers: layer size 0 (entry 2)");
    c = d, c.sizes[1] = -7;
    expect_invalid(&c, "model.layers: layer size -7");
    c = d, c.sizes[1] = (1 << 20) + 1;
    expect_invalid(&c, "model.layers");
    /* Each size in range but 2^20 * 2^20 weights overflow an int32 count. */
    c = d, c.n_sizes = 3, c.sizes[0] = 1 << 20, c.sizes[1] = 1 << 20, c.sizes[2] = 10;
    expect_invalid(&c, "parameters");
    c = d, c.n_sizes = 3, c.sizes[0] = 46340, c.sizes[1] = 46340, c.sizes[2] = 1;
    expect_invalid(&c, "model.layers: 2147488281 parameters, at most 2147483647");

    c = d, c.epochs = 0;
    expect_invalid(&c, "run.epochs: 0 is out of range");
    c = d, c.batch_size = 0;
    expect_invalid(&c, "train.batch_size");
    c = d, c.lr = 0.0;
    expect_invalid(&c, "optimizer.lr: 0 is out of range");
    c = d, c.lr = NAN;
    expect_invalid(&c, "optimizer.lr");
    c = d, c.norm_std = -1.0;
    expect_invalid(&c, "data.normalize_std");
    c = d, c.workers = 0;
    expect_invalid(&c, "server.workers");
    c = d, c.workers = 1025;
    expect_invalid(&c, "server.workers");
    c = d, c.start_timeout = 0.0;
    expect_invalid(&c, "server.start_timeout");
    c = d, c.worker_timeout = -1.0;
    expect_invalid(&c, "server.worker_timeout");
    c = d, c.listen[0] = '\0';
    expect_invalid(&c, "server.listen: must not be empty");
    c = d, c.train_images[0] = '\0';
    expect_invalid(&c, "data.train_images: must not be empty");
    c = d, memset(c.save, 'x', sizeof c.save);
    expect_invalid(&c, "server.save: not NUL-terminated");
    c = d, c.opt = (ps_opt_kind_t)7;
    expect_invalid(&c, "optimizer.name: invalid value 7");
    c = d, c.sched = (ps_sched_kind_t)-1;
    expect_invalid(&c, "schedule.name");
    c = d, c.warmup_epochs = 20.0;
    expect_invalid(&c, "schedule.warmup_epochs: 20 exceeds run.epochs (15)");
    c = d, c.sched = PS_SCHED_COSINE, c.min_lr = 1.0;
    expect_invalid(&c, "schedule.min_lr");

    c = d, c.n_sizes = PS_MAX_LAYERS + 1;
    for (int i = 0; i < c.n_sizes; i++) c.sizes[i] = 64;
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
}

/* train.divergence.factor: a number over 1, or off (0): when a run counts
 * as diverged (psd_diverge.h), not what it trains. */
Test(config, divergence_factor_is_a_number_over_1_or_off)
{
    ps_config_t c;
    ps_config_defaults(&c);
    cr_expect_eq(c.divergence_factor, 100.0);
    cr_expect_eq(ps_config_set(&c, "train.divergence.factor", "off", err, sizeof err), 0, "%s", err);
    cr_expect_eq(c.divergence_factor, 0.0);
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
    char *text = write_to_string(&c);
    cr_expect(strstr(text, "train:\n") && strstr(text, "\n  divergence.factor: off\n"), "%s", text);
    free(text);
    expect_round_trip(&c);
    cr_expect_eq(ps_config_set(&c, "train.divergence.factor", "2.5", err, sizeof err), 0, "%s", err);
    cr_expect_eq(c.divergence_factor, 2.5);
    expect_round_trip(&c);
    cr_expect_eq(load(&c, "train:\n  divergence.factor: off\n"), 0, "%s", err);
    cr_expect_eq(c.divergence_factor, 0.0);
    cr_expect_eq(load(&c, "train:\n  divergence.factor: 1e3\n"), 0, "%s", err);
    cr_expect_eq(c.divergence_factor, 1000.0);

    ps_config_defaults(&c);
    cr_expect_eq(ps_config_set(&c, "train.divergence.factor", "1", err, sizeof err), -1);
    cr_expect_str_eq(err, "train.divergence.factor: 1 is out of range (must be > 1, or off)");
    cr_expect_eq(ps_config_set(&c, "train.divergence.factor", "-3", err, sizeof err), -1);
    cr_expect_eq(ps_config_set(&c, "train.divergence.factor", "Off", err, sizeof err), -1);
    cr_expect_str_eq(err, "train.divergence.factor: expected a number or off, got 'Off'");
    cr_expect_eq(ps_config_set(&c, "train.divergence.factor", "inf", err, sizeof err), -1);
    cr_expect_eq(c.divergence_factor, 100.0, "unchanged by the errors");
    cr_expect_eq(ps_config_set(&c, "train.divergence.factor", "0", err, sizeof err), 0, "0 is off: %s", err);
    cr_expect_eq(c.divergence_factor, 0.0);
    expect_load_error("train:\n  divergence.factor: 0.5\n", "test.yaml:2", "must be > 1, or off");
    /* a key's parts as a nested mapping, as for train.keep_best */
    ps_config_t n;
    ps_config_defaults(&n);
    const char *nested = "train:\n  divergence:\n    factor: 5\n  keep_best: {metric: val_acc, path: b.bin}\n";
    cr_expect_eq(ps_config_load_string(&n, nested, strlen(nested), "t.yaml", err, sizeof err), 0, "%s", err);
    cr_expect_eq(n.divergence_factor, 5.0);
    cr_expect_str_eq(n.best_metric, "val_acc");
    cr_expect_str_eq(n.best_path, "b.bin");
    ps_config_free(&n);
    expect_load_error("train:\n  divergence:\n    factors: 5\n", "unknown key 'train.divergence.factors'", NULL);
    expect_load_error("train:\n  divergence: 5\n", "unknown key 'train.divergence'", NULL);
    expect_load_error("train:\n  keep_best: [val_loss]\n", "'train.keep_best' must be a mapping", NULL);
    /* "off" is a value of this key only */
    cr_expect_eq(ps_config_set(&c, "optimizer.clip_norm", "off", err, sizeof err), -1);

    c.divergence_factor = 0.5; /* a struct set by hand */
    expect_invalid(&c, "train.divergence.factor: 0.5 is out of range (must be > 1, or off)");
    c.divergence_factor = NAN;
    expect_invalid(&c, "train.divergence.factor");

    /* not in the hash: a run stopped by it resumes with another */
    ps_config_t a;
    ps_config_defaults(&a);
    ps_config_defaults(&c);
    c.divergence_factor = 0.0;
    cr_expect_eq(ps_config_hash(&c), ps_config_hash(&a));
}

/* data.normalize_*: inputs (pixel/255 - mean) / std that f32 training
 * cannot learn from are refused, with why; a ctr model has no pixels. */
Test(config, normalization_that_cannot_learn_is_refused)
{
    ps_config_t c;
    ps_config_defaults(&c);
    cr_expect_eq(ps_config_set(&c, "data.normalize_std", "1e-300", err, sizeof err), 0, "%s", err);
    expect_invalid(&c, "data.normalize_std: 1e-300 (with data.normalize_mean 0.286) makes the inputs "
                       "(pixel/255 - mean) / std as large as 7.14e+299, and f32 training cannot learn from inputs "
                       "beyond 1e6");
    c.norm_std = 1e-7;
    expect_invalid(&c, "data.normalize_std: 1e-07 (with data.normalize_mean 0.286) makes the inputs (pixel/255 - mean) "
                       "/ std as large as 7.14e+06");
    c.norm_std = 1e-6; /* 0.714 / 1e-6: under 1e6 */
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
    c.norm_std = 1.0, c.norm_mean = 2e6;
    expect_invalid(&c, "data.normalize_mean 2000000");
    c.norm_mean = -1e6 + 1, c.norm_std = 1.0;
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
    c.norm_std = 1e-300, c.kind = PS_MODEL_CTR, c.sizes[0] = c.ctr_fields * c.ctr_dim, c.sizes[c.n_sizes - 1] = 2;
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "ctr: no pixels to normalize: %s", err);
    cr_expect_eq(load(&c, "data:\n  normalize_std: 1e-300\n"), 0, "loading is not checking: %s", err);
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), -1);
}

/* ------------------------------------------------------------ output */

Test(config, round_trip_defaults)
{
    ps_config_t c;
    ps_config_defaults(&c);
    expect_round_trip(&c);
    char *text = write_to_string(&c);
    cr_expect(strstr(text, "optimizer:\n  name: sgd\n  lr: 0.1\n") != NULL, "%s", text);
    cr_expect(strstr(text, "  layers: [784, 512, 256, 10]\n") != NULL, "%s", text);
    cr_expect(strncmp(text, "run:\n  seed: 42\n", 16) == 0, "%s", text);
    free(text);
}

Test(config, round_trip_full_and_awkward_values)
{
    ps_config_t c;
    cr_assert_eq(load(&c, full_yaml), 0, "%s", err);
    expect_round_trip(&c);

    /* Doubles that need 17 digits, tiny, denormal, negative zero. */
    c.lr = 1.0 / 3.0;
    c.momentum = nextafter(0.9, 1.0);
    c.norm_mean = -0.0;
    c.weight_decay = 4.9406564584124654e-324;
    c.eps = 1e-300;
    c.final_div_factor = 1e300;
    c.min_lr = 0.1 + 0.2;
    c.train_limit = INT64_MAX;
    c.seed = 0;
    c.nesterov = true;
    /* Strings YAML would otherwise read differently. */
    strcpy(c.train_images, "a \"quoted\" \\ path: # not a comment");
    strcpy(c.train_labels, "tab\there\nnewline\x01\x7f");
    strcpy(c.test_images, "  leading and trailing spaces  ");
    strcpy(c.test_labels, "caf\xc3\xa9/\xe2\x82\xac.gz");
    strcpy(c.metrics, "yes");
    strcpy(c.save, "123");
    expect_round_trip(&c);

    ps_config_t d;
    char *text = write_to_string(&c);
    cr_assert_eq(load(&d, text), 0, "%s", err);
    cr_expect(signbit(d.norm_mean));
    free(text);
}

Test(config, hash_ignores_server_section)
{
    ps_config_t a, b;
    ps_config_defaults(&a);
    ps_config_defaults(&b);
    const uint64_t h = ps_config_hash(&a);
    cr_expect_eq(h, ps_config_hash(&b));
    cr_expect_neq(h, 0);

    strcpy(b.listen, "tcp://10.0.0.1:7000");
    b.workers = 16;
    strcpy(b.save, "");
    b.log_level = PS_LOG_DEBUG;
    b.worker_timeout = 5.0;
    cr_expect_eq(ps_config_hash(&b), h, "server keys must not change the hash");
    b = a, b.divergence_factor = 3.0;
    cr_expect_eq(ps_config_hash(&b), h, "train.divergence.factor does not change the hash");

    b = a, b.lr = 0.1000001;
    cr_expect_neq(ps_config_hash(&b), h);
    b = a, b.seed = 43;
    cr_expect_neq(ps_config_hash(&b), h);
    b = a, b.sizes[1] = 511;
    cr_expect_neq(ps_config_hash(&b), h);
    b = a, strcpy(b.train_images, "/other");
    cr_expect_neq(ps_config_hash(&b), h);
    b = a, b.sched = PS_SCHED_STEP;
    cr_expect_neq(ps_config_hash(&b), h);
    /* the ctr task's keys count for a ctr model only */
    b = a, b.ctr_rows = 99;
    cr_expect_eq(ps_config_hash(&b), h, "ctr keys do not change an MLP's hash");
    b = a, b.kind = PS_MODEL_CTR;
    const uint64_t hc = ps_config_hash(&b);
    cr_expect_neq(hc, h);
    b.ctr_rows = 99;
    cr_expect_neq(ps_config_hash(&b), hc);

    /* Loading the written YAML keeps the hash. */
    char *text = write_to_string(&a);
    cr_assert_eq(load(&b, text), 0, "%s", err);
    cr_expect_eq(ps_config_hash(&b), h);
    free(text);
}

/* ------------------------------------------------------------ optimizer.groups */

Test(config, groups_read_written_and_hashed)
{
    ps_config_t c, d;
    cr_assert_eq(load(&c, "optimizer:\n  weight_decay: 0.01\n  groups:\n"
                          "    - {match: \"*.bias\", weight_decay: 0}\n"
                          "    - match: \"emb*\"\n      lr_scale: 2.5\n"
                          "    - {match: \"a \\\"q\\\" b\", weight_decay: 1e-3, lr_scale: 0.5}\n"), 0, "%s", err);
    cr_assert_eq(c.n_groups, 3);
    cr_expect_str_eq(c.groups[0].match, "*.bias");
    cr_expect(c.groups[0].has_wd);
    cr_expect_eq(c.groups[0].weight_decay, 0.0);
    cr_expect_eq(c.groups[0].lr_scale, 1.0);
    cr_expect_not(c.groups[1].has_wd);
    cr_expect_eq(c.groups[1].lr_scale, 2.5);
    cr_expect_str_eq(c.groups[2].match, "a \"q\" b");
    cr_expect_eq(ps_config_validate(&c, err, sizeof err), 0, "%s", err);
    expect_round_trip(&c);
    /* first match wins; a glob's '*' crosses dots */
    cr_expect_eq(ps_groups_find(c.groups, c.n_groups, "fc1.bias"), 0);
    cr_expect_eq(ps_groups_find(c.groups, c.n_groups, "embedding.weight"), 1);
    cr_expect_eq(ps_groups_find(c.groups, c.n_groups, "fc1.weight"), -1);

    /* the hash: a config without groups keeps its hash; groups change it */
    ps_config_defaults(&d);
    const uint64_t h = ps_config_hash(&d);
    cr_assert_eq(load(&d, "optimizer:\n  groups: []\n"), 0, "%s", err);
    cr_expect_eq(ps_config_hash(&d), h, "no groups: the hash of before");
    cr_assert_eq(load(&d, "optimizer:\n  groups:\n    - {match: \"*.bias\", weight_decay: 0}\n"), 0, "%s", err);
    const uint64_t hg = ps_config_hash(&d);
    cr_expect_neq(hg, h);
    d.groups[0].weight_decay = 1e-4;
    cr_expect_neq(ps_config_hash(&d), hg);
    cr_expect_eq(ps_config_set(&d, "optimizer.groups", "[]", err, sizeof err), 0, "%s", err);
    cr_expect_eq(d.n_groups, 0);
    cr_expect_eq(ps_config_hash(&d), h);
}

Test(config, bad_groups_are_errors_naming_the_group)
{
    expect_load_error("optimizer:\n  groups:\n    - {match: \"\", weight_decay: 0}\n", "test.yaml:3",
                      "optimizer.groups[0]: match");
    expect_load_error("optimizer:\n  groups:\n    - {weight_decay: 0}\n", "optimizer.groups[0]", "needs a match");
    expect_load_error("optimizer:\n  groups:\n    - {match: a}\n    - {match: b, momentum: 0}\n", "test.yaml:4",
                      "optimizer.groups[1]: unknown field 'momentum'");
    expect_load_error("optimizer:\n  groups:\n    - {match: a, wd: 0}\n", "optimizer.groups[0]", "unknown field 'wd'");
    expect_load_error("optimizer:\n  groups:\n    - {match: a, weight_decay: -0.1}\n", "optimizer.groups[0] (a)",
                      "weight_decay -0.1 must be >= 0");
    expect_load_error("optimizer:\n  groups:\n    - {match: a, lr_scale: 0}\n", "optimizer.groups[0]", "lr_scale 0 must be > 0");
    expect_load_error("optimizer:\n  groups:\n    - {match: a, lr_scale: -2}\n", "optimizer.groups[0]", "must be > 0");
    expect_load_error("optimizer:\n  groups:\n    - {match: a, lr_scale: .nan}\n", "optimizer.groups[0]: lr_scale",
                      "expected a number");
    expect_load_error("optimizer:\n  groups:\n    - {match: a, lr_scale: 1e999}\n", "optimizer.groups[0]: lr_scale",
                      "expected a number");
    expect_load_error("optimizer:\n  groups:\n    - {match: a, lr_scale: 1, lr_scale: 2}\n", "optimizer.groups[0]",
                      "lr_scale given twice");
    expect_load_error("optimizer:\n  groups:\n    - {match: [a]}\n", "optimizer.groups: a value", "expected a scalar");
    expect_load_error("optimizer:\n  groups:\n    - \"*.bias\"\n", "optimizer.groups[0]: expected {match", NULL);
    expect_load_error("optimizer:\n  groups: {match: a}\n", "optimizer.groups: expected a list of groups", NULL);
    /* at most PS_GROUPS_MAX */
    char *yaml = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&yaml, &len);
    cr_assert_not_null(f);
    fputs("optimizer:\n  groups:\n", f);
    for (int i = 0; i <= PS_GROUPS_MAX; i++) fprintf(f, "    - {match: \"t%d\"}\n", i);
    cr_assert_eq(fclose(f), 0);
    expect_load_error(yaml, "optimizer.groups: more than 64 groups", NULL);
    free(yaml);
    /* a flag cannot give a list; validate checks a struct filled by hand */
    ps_config_t c;
    ps_config_defaults(&c);
    cr_expect_eq(ps_config_set(&c, "optimizer.groups", "*.bias", err, sizeof err), -1);
    cr_expect(strstr(err, "in a config file") != NULL, "%s", err);
    c.n_groups = 1;
    ps_group_clear(&c.groups[0]);
    strcpy(c.groups[0].match, "x");
    c.groups[0].lr_scale = INFINITY;
    expect_invalid(&c, "optimizer.groups[0] (x): lr_scale inf must be > 0");
    c.groups[0].lr_scale = 1;
    c.groups[0].match[0] = '\0';
    expect_invalid(&c, "optimizer.groups[0]: match");
    c.n_groups = PS_GROUPS_MAX + 1;
    expect_invalid(&c, "at most 64");
}

/* ------------------------------------------------------------ files */

Test(config, load_file)
{
    char path[] = "/tmp/test_config_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    const char *y = "run:\n  epochs: 4\noptimizer:\n  lr: 0.2\n  bogus: 1\n";
    const ssize_t head = strstr(y, "  bogus") - y; /* up to and including "  lr: 0.2\n" */
    cr_assert_eq(write(fd, y, (size_t)head), head);
    ps_config_t c;
    ps_config_defaults(&c);
    int rc = ps_config_load_file(&c, path, err, sizeof err);
    cr_expect_eq(rc, 0, "%s", err);
    cr_expect_eq(c.epochs, 4);
    cr_expect_eq(c.lr, 0.2);

    cr_assert_eq(write(fd, y + head, strlen(y) - (size_t)head), (ssize_t)strlen(y) - head);
    close(fd);
    rc = ps_config_load_file(&c, path, err, sizeof err);
    char want[128];
    snprintf(want, sizeof want, "%s:5: unknown key 'optimizer.bogus'", path);
    cr_expect_eq(rc, -1);
    cr_expect_str_eq(err, want);
    unlink(path);
}

Test(config, load_file_round_trip)
{
    char path[] = "/tmp/test_config_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    FILE *f = fdopen(fd, "w");
    cr_assert_not_null(f);
    ps_config_t a, b;
    ps_config_defaults(&a);
    a.lr = 0.07, a.opt = PS_OPT_ADAM, a.n_sizes = 3, a.sizes[1] = 33, a.sizes[2] = 10;
    a.sizes[3] = 0;
    cr_assert_eq(ps_config_write_yaml(&a, f), 0);
    cr_assert_eq(fclose(f), 0);
    ps_config_defaults(&b);
    cr_expect_eq(ps_config_load_file(&b, path, err, sizeof err), 0, "%s", err);
    expect_same(&a, &b);
    unlink(path);
}

Test(config, missing_and_unreadable_file)
{
    ps_config_t c;
    ps_config_defaults(&c);
    cr_expect_eq(ps_config_load_file(&c, "/nonexistent/psd.yaml", err, sizeof err), -1);
    cr_expect_str_eq(err, "/nonexistent/psd.yaml: cannot open: No such file or directory");
    cr_expect_eq(ps_config_load_file(&c, "/tmp", err, sizeof err), -1);
    cr_expect(strstr(err, "/tmp: ") == err, "%s", err);
    cr_expect(strstr(err, strerror(EISDIR)) != NULL, "%s", err);
}

Test(config, empty_file_is_defaults)
{
    char path[] = "/tmp/test_config_XXXXXX";
    int fd = mkstemp(path);
    cr_assert_geq(fd, 0);
    close(fd);
    ps_config_t c, d;
    ps_config_defaults(&c);
    ps_config_defaults(&d);
    cr_expect_eq(ps_config_load_file(&c, path, err, sizeof err), 0, "%s", err);
    expect_same(&c, &d);
    unlink(path);
}

/* JSON log lines: every message becomes a valid JSON string. */
Test(log, json_escape)
{
    char out[64];
    ps_json_escape(out, sizeof out, "a \"q\" \\ b");
    cr_assert_str_eq(out, "a \\\"q\\\" \\\\ b");
    ps_json_escape(out, sizeof out, "tab\there\nnl\x01");
    cr_assert_str_eq(out, "tab\\u0009here\\u000anl\\u0001");
    ps_json_escape(out, sizeof out, "caf\xc3\xa9 \xe2\x82\xac");
    cr_assert_str_eq(out, "caf\xc3\xa9 \xe2\x82\xac", "valid UTF-8 is kept");
    ps_json_escape(out, sizeof out, "bad \xff\xc3 end \xed\xa0\x80!");
    cr_assert_str_eq(out, "bad \xef\xbf\xbd\xef\xbf\xbd end \xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd!",
                     "invalid bytes and surrogates become U+FFFD");
    char small[6];
    cr_assert_eq(ps_json_escape(small, sizeof small, "a\"bcd"), 5);
    cr_assert_str_eq(small, "a\\\"bc", "truncated between characters, NUL-terminated");
    cr_assert_eq(ps_json_escape(small, sizeof small, "abcd\"e"), 4);
    cr_assert_str_eq(small, "abcd", "an escape is not cut");
    cr_assert_eq(ps_json_escape(small, sizeof small, "abc\xe2\x82\xac"), 3);
    cr_assert_str_eq(small, "abc", "a multi-byte character is not cut");
}
