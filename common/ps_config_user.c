/* ps_config_user.c - a user's model's optimizer: PyTorch's defaults for
 * what nothing set, and the first worker's offer under the config's keys
 * (ps_config.h: ps_config_user_defaults, ps_config_adopt,
 * ps_config_before_user_defaults). Uses the key table through ps_config's
 * public functions only. */
#include <stdio.h>
#include <string.h>

#include "ps_config.h"

/* The keys that take PyTorch's defaults (for a user's model), and the
 * value each takes for each optimizer.name (sgd, adam, adamw, adagrad):
 * torch.optim's defaults (SGD's lr is torch 2's 1e-3). Keys an optimizer
 * does not read take neutral values, so that --print-config shows nothing
 * of psd's tuned ones. */
static const struct {
    const char *key;
    const char *v[4];
} torch_defaults[] = {
    {"optimizer.lr", {"0.001", "0.001", "0.001", "0.01"}},
    {"optimizer.momentum", {"0", "0", "0", "0"}},
    {"optimizer.nesterov", {"false", "false", "false", "false"}},
    {"optimizer.weight_decay", {"0", "0", "0.01", "0"}},
    {"optimizer.beta1", {"0.9", "0.9", "0.9", "0.9"}},
    {"optimizer.beta2", {"0.999", "0.999", "0.999", "0.999"}},
    {"optimizer.eps", {"1e-8", "1e-8", "1e-8", "1e-10"}},
    {"schedule.name", {"constant", "constant", "constant", "constant"}},
};
#define N_TD (sizeof torch_defaults / sizeof torch_defaults[0])

static bool users_model(const ps_config_t *c)
{
    return c->kind == PS_MODEL_TENSORS || c->kind == PS_MODEL_FROM_WORKER;
}

void ps_config_user_defaults(ps_config_t *c)
{
    if (!users_model(c)) return;
    for (size_t i = 0; i < N_TD; i++) {
        if (ps_config_from(c, torch_defaults[i].key) != PS_FROM_DEFAULT) continue;
        char err[256];
        int rc = ps_config_set_from(c, torch_defaults[i].key, torch_defaults[i].v[c->opt], PS_FROM_DEFAULT, err,
                                    sizeof err);
        (void)rc; /* the table's values are valid (tests/test_config.c) */
    }
}

static bool offerable(const char *key)
{
    return strncmp(key, "optimizer.", 10) == 0 || strncmp(key, "schedule.", 9) == 0;
}

int ps_config_adopt(ps_config_t *c, const char *yaml, char *err, size_t errlen)
{
    ps_config_t offer, res = *c; /* res: a view of c's tensors, not freed */
    char why[600];
    ps_config_defaults(&offer);
    if (ps_config_load_string(&offer, yaml, strlen(yaml), "the worker's offer", why, sizeof why) != 0) {
        snprintf(err, errlen, "the optimizer offered: %s", why);
        ps_config_free(&offer);
        return -1;
    }
    const char *key;
    for (size_t i = 0; (key = ps_config_key(i)); i++) {
        if (ps_config_from(&offer, key) != PS_FROM_CONFIG) continue;
        if (!offerable(key)) {
            snprintf(err, errlen, "the optimizer offered: %s: a worker offers optimizer and schedule keys only", key);
            ps_config_free(&offer);
            return -1;
        }
        if (ps_config_from(&res, key) == PS_FROM_CONFIG) continue; /* the config's own beats the offer */
        ps_config_copy_key(&res, &offer, key);
        res.from[i] = PS_FROM_WORKER;
    }
    ps_config_free(&offer);
    ps_config_user_defaults(&res);
    if (ps_config_validate(&res, why, sizeof why) != 0) {
        snprintf(err, errlen, "the optimizer offered, under this config: %s", why);
        return -1;
    }
    *c = res;
    return 0;
}

int ps_config_before_user_defaults(const ps_config_t *c, ps_config_t *old, char *flags, size_t n)
{
    *old = *c;
    if (n) flags[0] = 0;
    if (!users_model(c)) return 0;
    int differ = 0;
    size_t at = 0;
    for (size_t i = 0; i < N_TD; i++) {
        const char *key = torch_defaults[i].key;
        if (ps_config_from(c, key) != PS_FROM_DEFAULT) continue;
        ps_config_reset_key(old, key);
        char now[64], was[64];
        ps_config_value_text(c, key, now, sizeof now);
        ps_config_value_text(old, key, was, sizeof was);
        if (strcmp(now, was) == 0) continue;
        differ++;
        int w = snprintf(flags + at, at < n ? n - at : 0, "%s--set %s=%s", differ > 1 ? " " : "", key, was);
        if (w > 0) at += (size_t)w;
    }
    return differ;
}
