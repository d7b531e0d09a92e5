/* test_user_optim.c - a user's model's optimizer: PyTorch's defaults
 * (ps_config_user_defaults), the first worker's offer under the config's
 * keys (ps_config_adopt), the flags that give a run made before them its
 * values (ps_config_before_user_defaults), and torch's schedulers
 * (ps_tsched.h) against values torch 1.13 printed. */
#include <criterion/criterion.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "ps_config.h"
#include "ps_tsched.h"
#include "psd_optim.h"

static char err[700];

/* defaults, then the YAML as a config file, then PyTorch's defaults: what psd's main does */
static void config(ps_config_t *c, const char *yaml)
{
    ps_config_defaults(c);
    cr_assert_eq(ps_config_load_string(c, yaml, strlen(yaml), "test.yaml", err, sizeof err), 0, "%s", err);
    ps_config_user_defaults(c);
    cr_assert_eq(ps_config_validate(c, err, sizeof err), 0, "%s", err);
}

static void expect_value(const ps_config_t *c, const char *key, const char *want, ps_from_t from)
{
    char v[256];
    ps_config_value_text(c, key, v, sizeof v);
    cr_expect_str_eq(v, want, "%s", key);
    cr_expect_eq(ps_config_from(c, key), from, "%s from %s", key, ps_from_name(ps_config_from(c, key)));
}

Test(user_optim, a_users_model_takes_pytorchs_defaults_for_each_optimizer)
{
    static const struct {
        const char *name, *lr, *momentum, *nesterov, *wd, *eps;
    } want[] = {
        {"sgd", "0.001", "0", "false", "0", "1e-08"},
        {"adam", "0.001", "0", "false", "0", "1e-08"},
        {"adamw", "0.001", "0", "false", "0.01", "1e-08"},
        {"adagrad", "0.01", "0", "false", "0", "1e-10"},
    };
    const char *kinds[2] = {"from_worker", "tensors"};
    for (int k = 0; k < 2; k++)
        for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
            char y[300];
            snprintf(y, sizeof y, "model: {kind: %s%s}\noptimizer: {name: %s}\n", kinds[k],
                     k ? ", tensors: [{name: w, shape: [3]}]" : "", want[i].name);
            ps_config_t c;
            config(&c, y);
            expect_value(&c, "optimizer.lr", want[i].lr, PS_FROM_DEFAULT);
            expect_value(&c, "optimizer.momentum", want[i].momentum, PS_FROM_DEFAULT);
            expect_value(&c, "optimizer.nesterov", want[i].nesterov, PS_FROM_DEFAULT);
            expect_value(&c, "optimizer.weight_decay", want[i].wd, PS_FROM_DEFAULT);
            expect_value(&c, "optimizer.eps", want[i].eps, PS_FROM_DEFAULT);
            expect_value(&c, "optimizer.beta1", "0.9", PS_FROM_DEFAULT);
            expect_value(&c, "optimizer.beta2", "0.999", PS_FROM_DEFAULT);
            expect_value(&c, "schedule.name", "constant", PS_FROM_DEFAULT);
            expect_value(&c, "optimizer.name", want[i].name, PS_FROM_CONFIG);
            ps_config_free(&c);
        }
}

Test(user_optim, the_built_in_models_keep_their_tuned_defaults)
{
    ps_config_t c;
    config(&c, "optimizer: {name: sgd}\n");
    expect_value(&c, "optimizer.lr", "0.1", PS_FROM_DEFAULT);
    expect_value(&c, "optimizer.momentum", "0.9", PS_FROM_DEFAULT);
    expect_value(&c, "optimizer.nesterov", "true", PS_FROM_DEFAULT);
    expect_value(&c, "optimizer.weight_decay", "0.0005", PS_FROM_DEFAULT);
    expect_value(&c, "schedule.name", "onecycle", PS_FROM_DEFAULT);
}

Test(user_optim, config_beats_the_offer_which_beats_the_defaults)
{
    ps_config_t c;
    config(&c, "model: {kind: from_worker}\noptimizer: {lr: 0.05}\n");
    const char *offer = "optimizer: {name: adamw, lr: 0.01, weight_decay: 0.1, beta1: 0.8}\n"
                        "schedule: {name: torch, torch: \"StepLR(step_size=3)\", interval: step}\n";
    cr_assert_eq(ps_config_adopt(&c, offer, err, sizeof err), 0, "%s", err);
    expect_value(&c, "optimizer.name", "adamw", PS_FROM_WORKER);
    expect_value(&c, "optimizer.lr", "0.05", PS_FROM_CONFIG);      /* the config's own */
    expect_value(&c, "optimizer.weight_decay", "0.1", PS_FROM_WORKER); /* offered, beats adamw's 0.01 */
    expect_value(&c, "optimizer.beta1", "0.8", PS_FROM_WORKER);
    expect_value(&c, "optimizer.beta2", "0.999", PS_FROM_DEFAULT);
    expect_value(&c, "schedule.name", "torch", PS_FROM_WORKER);
    expect_value(&c, "schedule.interval", "step", PS_FROM_WORKER);
    ps_config_t plain;
    config(&plain, "model: {kind: from_worker}\noptimizer: {lr: 0.05}\n");
    cr_expect_neq(ps_config_hash(&c), ps_config_hash(&plain), "the offer is part of what is trained");
}

Test(user_optim, an_offer_psd_cannot_take_is_refused_and_changes_nothing)
{
    static const struct {
        const char *yaml, *names;
    } bad[] = {
        {"model: {kind: mlp}\n", "model.kind: a worker offers optimizer and schedule keys only"},
        {"optimizer: {name: rmsprop}\n", "rmsprop"},
        {"optimizer: {lr: -1}\n", "optimizer.lr"},
        {"schedule: {name: torch, torch: \"ReduceLROnPlateau(patience=3)\"}\n", "ReduceLROnPlateau is not one psd runs"},
        {"schedule: {name: torch, torch: \"StepLR(step_size=3, last_epoch=4)\"}\n", "StepLR takes no argument last_epoch"},
        {"optimizer: {name: adagrad}\nschedule: {name: torch, torch: \"OneCycleLR(total_steps=9)\"}\n",
         "cycle_momentum"},
        {"schedule: {name: torch, torch: \"CosineAnnealingLR(T_max=9, eta_min=0.001)\"}\noptimizer: {groups: [{match: "
         "\"*.bias\", lr_scale: 2}]}\n",
         "eta_min"},
        {"optimizer: {lr: [1]}\n", "optimizer.lr"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ps_config_t c, was;
        config(&c, "model: {kind: from_worker}\n");
        was = c;
        cr_expect_eq(ps_config_adopt(&c, bad[i].yaml, err, sizeof err), -1, "%s", bad[i].yaml);
        cr_expect(strstr(err, bad[i].names) != NULL, "%s: %s", bad[i].yaml, err);
        cr_expect_eq(memcmp(&c, &was, sizeof c), 0, "unchanged by %s", bad[i].yaml);
    }
}

/* A run of a user's model made before PyTorch's defaults had psd's: the
 * flags named give back its config, hash and all. */
Test(user_optim, the_flags_that_give_a_run_from_before_its_values)
{
    ps_config_t now, old, back;
    config(&now, "model: {kind: from_worker}\noptimizer: {name: sgd, lr: 0.1, momentum: 0.9}\nschedule: {name: constant}\n");
    char flags[700];
    cr_assert_eq(ps_config_before_user_defaults(&now, &old, flags, sizeof flags), 2, "%s", flags);
    cr_expect_str_eq(flags, "--set optimizer.nesterov=true --set optimizer.weight_decay=0.0005");
    ps_config_t before; /* the config as psd read it before: the key table's defaults under the same file */
    ps_config_defaults(&before);
    const char *y = "model: {kind: from_worker}\noptimizer: {name: sgd, lr: 0.1, momentum: 0.9}\nschedule: {name: constant}\n";
    cr_assert_eq(ps_config_load_string(&before, y, strlen(y), "t", err, sizeof err), 0);
    cr_expect_eq(ps_config_hash(&old), ps_config_hash(&before));
    config(&back, "model: {kind: from_worker}\noptimizer: {name: sgd, lr: 0.1, momentum: 0.9, nesterov: true, "
                  "weight_decay: 0.0005}\nschedule: {name: constant}\n");
    cr_expect_eq(ps_config_hash(&back), ps_config_hash(&before), "resumed with the flags: the same hash");
    cr_expect_eq(ps_config_before_user_defaults(&back, &old, flags, sizeof flags), 0, "nothing left to name");
}

/* torch 1.13's lr (and momentum) after k scheduler steps of a base lr 0.1,
 * printed by torch (optimizer.param_groups[0]) */
Test(user_optim, torch_schedulers_as_torch_computes_them)
{
    static const struct {
        const char *text;
        int k;
        double lr, mom;
    } want[] = {
        {"StepLR(step_size=7, gamma=0.5)", 13, 0.05, -1},
        {"StepLR(step_size=7, gamma=0.5)", 14, 0.025, -1},
        {"MultiStepLR(milestones=[5, 5, 20], gamma=0.3)", 5, 0.009, -1},
        {"MultiStepLR(milestones=[5, 5, 20], gamma=0.3)", 20, 0.0026999999999999997, -1},
        {"ExponentialLR(gamma=0.97)", 10, 0.0737424126894928, -1},
        {"ConstantLR(factor=0.25, total_iters=9)", 8, 0.025, -1},
        {"ConstantLR(factor=0.25, total_iters=9)", 9, 0.1, -1},
        {"LinearLR(start_factor=0.1, end_factor=0.9, total_iters=30)", 15, 0.05, -1},
        {"LinearLR(start_factor=0.1, end_factor=0.9, total_iters=30)", 40, 0.09, -1},
        {"CosineAnnealingLR(T_max=40, eta_min=0.001)", 10, 0.0855017856687341, -1},
        {"CosineAnnealingLR(T_max=40, eta_min=0.001)", 60, 0.05050000000000174, -1},
        {"OneCycleLR(total_steps=100)", 0, 0.0040000000000000036, 0.95},
        {"OneCycleLR(total_steps=100)", 29, 0.1, 0.85},
        {"OneCycleLR(total_steps=100)", 99, 4e-07, 0.95},
        {"OneCycleLR(total_steps=100, three_phase=True, anneal_strategy='linear', pct_start=0.2)", 29, 0.04947368421052632,
         0.9026315789473683},
        {"SequentialLR(schedulers=[LinearLR(start_factor=0.1, total_iters=10), CosineAnnealingLR(T_max=50)], "
         "milestones=[10])",
         5, 0.055, -1},
        {"SequentialLR(schedulers=[LinearLR(start_factor=0.1, total_iters=10), CosineAnnealingLR(T_max=50)], "
         "milestones=[10])",
         35, 0.049999999999999996, -1},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        ps_tsched_t s;
        cr_assert_eq(ps_tsched_parse(want[i].text, &s, err, sizeof err), 0, "%s: %s", want[i].text, err);
        double m, lr = ps_tsched_lr(&s, want[i].k, 0.1, &m);
        cr_expect(fabs(lr - want[i].lr) <= 1e-12 * want[i].lr, "%s at %d: %.17g, torch %.17g", want[i].text,
                  want[i].k, lr, want[i].lr);
        cr_expect(want[i].mom < 0 ? m < 0 : fabs(m - want[i].mom) <= 1e-12, "%s at %d: momentum %.17g, torch %.17g",
                  want[i].text, want[i].k, m, want[i].mom);
    }
}

Test(user_optim, one_cycles_momentum_starts_at_its_max_and_needs_a_buffer)
{
    ps_config_t c;
    config(&c, "model: {kind: from_worker}\noptimizer: {name: sgd}\n"
               "schedule: {name: torch, torch: \"OneCycleLR(total_steps=50, max_momentum=0.9)\", interval: step}\n");
    psd_optim_t o;
    psd_optim_from_config(&o, &c);
    cr_expect_float_eq(o.momentum, 0.9f, 1e-7, "torch sets max_momentum at construction");
    cr_expect_eq(psd_optim_slots(&o), 1, "SGD with a cycled momentum keeps a momentum buffer");
    cr_expect_eq(psd_optim_set_momentum(&o, 1.5), -1);
    o.kind = PS_OPT_ADAM;
    cr_expect_eq(psd_optim_set_momentum(&o, 0.85), 0);
    cr_expect_float_eq(o.beta1, 0.85f, 1e-7, "Adam's beta1 is what it cycles");
}
