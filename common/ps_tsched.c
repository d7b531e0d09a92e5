/* ps_tsched.c - see ps_tsched.h. A small recursive-descent reader of the
 * constructor text (keyword arguments: numbers, True/False, quoted
 * strings, lists, nested calls) and the closed forms of torch's
 * schedulers (torch/optim/lr_scheduler.py). */
#include "ps_tsched.h"

#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SUPPORTED                                                                                              \
    "StepLR, MultiStepLR, ExponentialLR, ConstantLR, LinearLR, CosineAnnealingLR, OneCycleLR, and SequentialLR " \
    "of those"

typedef struct {
    const char *p;
    char *err;
    size_t errlen;
    bool failed;
} rd_t;

static int fail(rd_t *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(rd_t *r, const char *fmt, ...)
{
    if (!r->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->err, r->errlen, fmt, ap);
        va_end(ap);
    }
    r->failed = true;
    return -1;
}

static void skip(rd_t *r)
{
    while (isspace((unsigned char)*r->p)) r->p++;
}

static bool eat(rd_t *r, char ch)
{
    skip(r);
    if (*r->p != ch) return false;
    r->p++;
    return true;
}

/* An identifier into out (at most n-1 bytes): 0, or -1. */
static int ident(rd_t *r, char *out, size_t n)
{
    skip(r);
    size_t k = 0;
    if (!isalpha((unsigned char)*r->p) && *r->p != '_') return fail(r, "schedule.torch: expected a name at '%.20s'", r->p);
    while (isalnum((unsigned char)*r->p) || *r->p == '_') {
        if (k + 1 >= n) return fail(r, "schedule.torch: a name longer than %zu bytes", n - 1);
        out[k++] = *r->p++;
    }
    out[k] = 0;
    return 0;
}

/* A value: number, True/False, a quoted string (into str), a list or a
 * call are told apart by the caller; this reads a number or a boolean. */
static int number(rd_t *r, const char *arg, double *v)
{
    skip(r);
    if (strncmp(r->p, "True", 4) == 0 && !isalnum((unsigned char)r->p[4])) {
        r->p += 4;
        *v = 1;
        return 0;
    }
    if (strncmp(r->p, "False", 5) == 0 && !isalnum((unsigned char)r->p[5])) {
        r->p += 5;
        *v = 0;
        return 0;
    }
    char *end;
    double d = strtod(r->p, &end);
    if (end == r->p || !isfinite(d)) return fail(r, "schedule.torch: %s: expected a number at '%.20s'", arg, r->p);
    r->p = end;
    *v = d;
    return 0;
}

static int integer(rd_t *r, const char *arg, int64_t lo, int64_t *out)
{
    double d;
    if (number(r, arg, &d) != 0) return -1;
    if (d != floor(d) || d < (double)lo || d > 1e15)
        return fail(r, "schedule.torch: %s: expected a whole number of at least %lld, got %.17g", arg, (long long)lo, d);
    *out = (int64_t)d;
    return 0;
}

static int boolean(rd_t *r, const char *arg, bool *out)
{
    skip(r);
    double d;
    const char *at = r->p;
    if (number(r, arg, &d) != 0) return -1;
    if (d != 0 && d != 1) {
        r->p = at;
        return fail(r, "schedule.torch: %s: expected True or False at '%.20s'", arg, at);
    }
    *out = d != 0;
    return 0;
}

static int string(rd_t *r, const char *arg, char *out, size_t n)
{
    skip(r);
    char q = *r->p;
    if (q != '\'' && q != '"') return fail(r, "schedule.torch: %s: expected a quoted string at '%.20s'", arg, r->p);
    const char *b = ++r->p, *e = strchr(b, q);
    if (!e || (size_t)(e - b) >= n) return fail(r, "schedule.torch: %s: a string not closed, or too long", arg);
    memcpy(out, b, (size_t)(e - b));
    out[e - b] = 0;
    r->p = e + 1;
    return 0;
}

/* [a, b, ...] of whole numbers >= 0, increasing (strictly unless repeats). */
static int int_list(rd_t *r, const char *arg, int64_t *v, int max, int *n, bool repeats)
{
    *n = 0;
    if (!eat(r, '[')) return fail(r, "schedule.torch: %s: expected a list [...] at '%.20s'", arg, r->p);
    if (eat(r, ']')) return 0;
    do {
        if (*n >= max) return fail(r, "schedule.torch: %s: more than %d entries", arg, max);
        if (integer(r, arg, 0, &v[*n]) != 0) return -1;
        if (*n > 0 && (v[*n] < v[*n - 1] || (!repeats && v[*n] == v[*n - 1])))
            return fail(r, "schedule.torch: %s: not in increasing order", arg);
        (*n)++;
    } while (eat(r, ','));
    if (!eat(r, ']')) return fail(r, "schedule.torch: %s: expected ',' or ']' at '%.20s'", arg, r->p);
    return 0;
}

static const struct {
    const char *name;
    ps_ts_kind_t kind;
    const char *args; /* the keyword arguments it takes, space-separated */
} classes[] = {
    {"StepLR", PS_TS_STEP, "step_size gamma"},
    {"MultiStepLR", PS_TS_MULTISTEP, "milestones gamma"},
    {"ExponentialLR", PS_TS_EXP, "gamma"},
    {"ConstantLR", PS_TS_CONSTANT, "factor total_iters"},
    {"LinearLR", PS_TS_LINEAR, "start_factor end_factor total_iters"},
    {"CosineAnnealingLR", PS_TS_COSINE, "T_max eta_min"},
    {"OneCycleLR", PS_TS_ONECYCLE,
     "total_steps epochs steps_per_epoch pct_start anneal_strategy cycle_momentum base_momentum max_momentum "
     "div_factor final_div_factor three_phase"},
};
#define N_CLASSES (sizeof classes / sizeof classes[0])

static bool takes(const char *args, const char *arg)
{
    size_t n = strlen(arg);
    for (const char *p = args; (p = strstr(p, arg)); p += n)
        if ((p == args || p[-1] == ' ') && (p[n] == ' ' || p[n] == 0)) return true;
    return false;
}

static void phase_defaults(ps_ts_phase_t *f, ps_ts_kind_t k)
{
    memset(f, 0, sizeof *f);
    f->kind = k;
    f->gamma = k == PS_TS_EXP ? NAN : 0.1; /* ExponentialLR's gamma has no default */
    f->factor = 1.0 / 3.0;
    f->start_factor = 1.0 / 3.0;
    f->end_factor = 1.0;
    f->total_iters = 5;
    f->t_max = NAN;
    f->pct_start = 0.3;
    f->div_factor = 25;
    f->final_div_factor = 1e4;
    f->base_momentum = 0.85;
    f->max_momentum = 0.95;
    f->cycle_momentum = true;
}

static int arg_value(rd_t *r, ps_ts_phase_t *f, const char *a, int64_t *epochs, int64_t *spe)
{
    double d;
    if (strcmp(a, "step_size") == 0) return integer(r, a, 1, &f->step_size);
    if (strcmp(a, "gamma") == 0) {
        if (number(r, a, &d) != 0) return -1;
        if (!(d > 0)) return fail(r, "schedule.torch: gamma: must be > 0, got %.17g", d);
        f->gamma = d;
        return 0;
    }
    if (strcmp(a, "milestones") == 0)
        return int_list(r, a, f->milestones, PS_TSCHED_MILESTONES_MAX, &f->n_milestones, true);
    if (strcmp(a, "total_iters") == 0) return integer(r, a, 0, &f->total_iters);
    if (strcmp(a, "total_steps") == 0) return integer(r, a, 1, &f->total_steps);
    if (strcmp(a, "epochs") == 0) return integer(r, a, 1, epochs);
    if (strcmp(a, "steps_per_epoch") == 0) return integer(r, a, 1, spe);
    if (strcmp(a, "T_max") == 0) {
        if (number(r, a, &d) != 0) return -1;
        if (!(d > 0)) return fail(r, "schedule.torch: T_max: must be > 0, got %.17g", d);
        f->t_max = d;
        return 0;
    }
    if (strcmp(a, "anneal_strategy") == 0) {
        char s[16];
        if (string(r, a, s, sizeof s) != 0) return -1;
        if (strcmp(s, "cos") != 0 && strcmp(s, "linear") != 0)
            return fail(r, "schedule.torch: anneal_strategy: 'cos' or 'linear', got '%s'", s);
        f->anneal_linear = strcmp(s, "linear") == 0;
        return 0;
    }
    if (strcmp(a, "cycle_momentum") == 0) return boolean(r, a, &f->cycle_momentum);
    if (strcmp(a, "three_phase") == 0) return boolean(r, a, &f->three_phase);
    double *dst = strcmp(a, "factor") == 0             ? &f->factor
                  : strcmp(a, "start_factor") == 0     ? &f->start_factor
                  : strcmp(a, "end_factor") == 0       ? &f->end_factor
                  : strcmp(a, "eta_min") == 0          ? &f->eta_min
                  : strcmp(a, "pct_start") == 0        ? &f->pct_start
                  : strcmp(a, "div_factor") == 0       ? &f->div_factor
                  : strcmp(a, "final_div_factor") == 0 ? &f->final_div_factor
                  : strcmp(a, "base_momentum") == 0    ? &f->base_momentum
                                                       : &f->max_momentum;
    return number(r, a, dst);
}

/* torch's own checks of the arguments (what its constructors refuse) */
static int phase_check(rd_t *r, const char *name, ps_ts_phase_t *f, int64_t epochs, int64_t spe)
{
    switch (f->kind) {
    case PS_TS_STEP:
        if (f->step_size < 1) return fail(r, "schedule.torch: StepLR needs step_size");
        break;
    case PS_TS_MULTISTEP:
        if (f->n_milestones < 1) return fail(r, "schedule.torch: MultiStepLR needs milestones");
        break;
    case PS_TS_EXP:
        if (isnan(f->gamma)) return fail(r, "schedule.torch: ExponentialLR needs gamma");
        break;
    case PS_TS_CONSTANT:
        if (!(f->factor >= 0 && f->factor <= 1))
            return fail(r, "schedule.torch: ConstantLR: factor must be between 0 and 1, got %.17g", f->factor);
        break;
    case PS_TS_LINEAR:
        if (!(f->start_factor > 0 && f->start_factor <= 1) || !(f->end_factor >= 0 && f->end_factor <= 1))
            return fail(r, "schedule.torch: LinearLR: start_factor in (0, 1] and end_factor in [0, 1]");
        if (f->total_iters < 1) return fail(r, "schedule.torch: LinearLR: total_iters must be at least 1");
        break;
    case PS_TS_COSINE:
        if (isnan(f->t_max)) return fail(r, "schedule.torch: CosineAnnealingLR needs T_max");
        if (!(f->eta_min >= 0)) return fail(r, "schedule.torch: CosineAnnealingLR: eta_min must be >= 0");
        break;
    case PS_TS_ONECYCLE:
        if (!f->total_steps && epochs && spe) f->total_steps = epochs * spe;
        if (f->total_steps < 1)
            return fail(r, "schedule.torch: OneCycleLR needs total_steps (or epochs and steps_per_epoch)");
        if (!(f->pct_start >= 0 && f->pct_start <= 1))
            return fail(r, "schedule.torch: OneCycleLR: pct_start must be between 0 and 1");
        if (!(f->div_factor > 0) || !(f->final_div_factor > 0))
            return fail(r, "schedule.torch: OneCycleLR: div_factor and final_div_factor must be > 0");
        if (f->cycle_momentum && !(f->base_momentum >= 0 && f->base_momentum < 1 && f->max_momentum >= 0 &&
                                   f->max_momentum < 1))
            return fail(r, "schedule.torch: OneCycleLR: base_momentum and max_momentum in [0, 1)");
        break;
    }
    (void)name;
    return 0;
}

/* NAME(kw=value, ...) of one of classes[] into f. */
static int call(rd_t *r, ps_ts_phase_t *f)
{
    char name[40];
    if (ident(r, name, sizeof name) != 0) return -1;
    size_t c = 0;
    while (c < N_CLASSES && strcmp(classes[c].name, name) != 0) c++;
    if (c == N_CLASSES)
        return fail(r, "schedule.torch: the scheduler %s is not one psd runs (it runs " SUPPORTED ")", name);
    phase_defaults(f, classes[c].kind);
    int64_t epochs = 0, spe = 0;
    if (!eat(r, '(')) return fail(r, "schedule.torch: expected '(' after %s", name);
    if (!eat(r, ')')) {
        char seen[16][24];
        int n_seen = 0;
        do {
            skip(r);
            if (*r->p == ')') break; /* a trailing comma */
            char a[24];
            if (ident(r, a, sizeof a) != 0) return -1;
            if (!takes(classes[c].args, a))
                return fail(r, "schedule.torch: %s takes no argument %s (psd reads: %s)", name, a, classes[c].args);
            for (int i = 0; i < n_seen; i++)
                if (strcmp(seen[i], a) == 0) return fail(r, "schedule.torch: %s: %s given twice", name, a);
            if (n_seen < 16) snprintf(seen[n_seen++], sizeof seen[0], "%s", a);
            if (!eat(r, '=')) return fail(r, "schedule.torch: %s: keyword arguments only (%s=...)", name, a);
            if (arg_value(r, f, a, &epochs, &spe) != 0) return -1;
        } while (eat(r, ','));
        if (!eat(r, ')')) return fail(r, "schedule.torch: %s: expected ',' or ')' at '%.20s'", name, r->p);
    }
    return phase_check(r, name, f, epochs, spe);
}

static int sequential(rd_t *r, ps_tsched_t *s)
{
    bool have_s = false, have_m = false;
    int n_m = 0;
    if (!eat(r, '(')) return fail(r, "schedule.torch: expected '(' after SequentialLR");
    do {
        skip(r);
        if (*r->p == ')') break;
        char a[24];
        if (ident(r, a, sizeof a) != 0) return -1;
        if (!eat(r, '=')) return fail(r, "schedule.torch: SequentialLR: keyword arguments only (%s=...)", a);
        if (strcmp(a, "schedulers") == 0 && !have_s) {
            have_s = true;
            if (!eat(r, '[')) return fail(r, "schedule.torch: SequentialLR: schedulers: expected a list [...]");
            do {
                if (s->n >= PS_TSCHED_PHASES_MAX)
                    return fail(r, "schedule.torch: SequentialLR: more than %d schedulers", PS_TSCHED_PHASES_MAX);
                skip(r);
                if (strncmp(r->p, "SequentialLR", 12) == 0)
                    return fail(r, "schedule.torch: SequentialLR of a SequentialLR is not run by psd");
                if (call(r, &s->ph[s->n]) != 0) return -1;
                if (s->ph[s->n].kind == PS_TS_ONECYCLE && s->ph[s->n].cycle_momentum)
                    return fail(r, "schedule.torch: OneCycleLR with cycle_momentum=True inside SequentialLR is not "
                                   "run by psd (give cycle_momentum=False)");
                s->n++;
            } while (eat(r, ','));
            if (!eat(r, ']')) return fail(r, "schedule.torch: SequentialLR: schedulers: expected ',' or ']'");
        } else if (strcmp(a, "milestones") == 0 && !have_m) {
            have_m = true;
            if (int_list(r, a, s->milestones, PS_TSCHED_PHASES_MAX - 1, &n_m, false) != 0) return -1;
        } else {
            return fail(r, "schedule.torch: SequentialLR takes schedulers=[...] and milestones=[...] once each, not %s",
                        a);
        }
    } while (eat(r, ','));
    if (!eat(r, ')')) return fail(r, "schedule.torch: SequentialLR: expected ',' or ')' at '%.20s'", r->p);
    if (!have_s || !have_m || s->n < 1) return fail(r, "schedule.torch: SequentialLR needs schedulers and milestones");
    if (n_m != s->n - 1) return fail(r, "schedule.torch: SequentialLR: %d schedulers need %d milestones", s->n, s->n - 1);
    return 0;
}

int ps_tsched_parse(const char *text, ps_tsched_t *s, char *err, size_t errlen)
{
    rd_t r = {.p = text, .err = err, .errlen = errlen};
    memset(s, 0, sizeof *s);
    if (!text || strlen(text) >= PS_TSCHED_TEXT_MAX) {
        snprintf(err, errlen, "schedule.torch: empty or longer than %d bytes", PS_TSCHED_TEXT_MAX - 1);
        return -1;
    }
    skip(&r);
    if (strncmp(r.p, "SequentialLR", 12) == 0 && !(isalnum((unsigned char)r.p[12]) || r.p[12] == '_')) {
        r.p += 12;
        if (sequential(&r, s) != 0) return -1;
    } else {
        s->n = 1;
        if (call(&r, &s->ph[0]) != 0) return -1;
    }
    skip(&r);
    if (*r.p) return fail(&r, "schedule.torch: unexpected '%.20s' after the scheduler", r.p);
    return 0;
}

/* torch's _annealing_cos and _annealing_linear: from a at pct 0 to b at 1 */
static double anneal(bool linear, double a, double b, double pct)
{
    if (linear) return (b - a) * pct + a;
    return b + (a - b) / 2.0 * (cos(M_PI * pct) + 1.0);
}

static double onecycle(const ps_ts_phase_t *f, int64_t k, double lr, double *mom)
{
    if (k > f->total_steps) k = f->total_steps; /* torch refuses to step further; psd holds the last rate */
    const double total = (double)f->total_steps, initial = lr / f->div_factor, min_lr = initial / f->final_div_factor;
    const double e1 = f->pct_start * total - 1.0;
    struct ocp {
        double end, lr0, lr1, m0, m1;
    } ph[3];
    int n;
    if (f->three_phase) {
        n = 3;
        ph[0] = (struct ocp){e1, initial, lr, f->max_momentum, f->base_momentum};
        ph[1] = (struct ocp){2.0 * f->pct_start * total - 2.0, lr, initial, f->base_momentum, f->max_momentum};
        ph[2] = (struct ocp){total - 1.0, initial, min_lr, f->max_momentum, f->max_momentum};
    } else {
        n = 2;
        ph[0] = (struct ocp){e1, initial, lr, f->max_momentum, f->base_momentum};
        ph[1] = (struct ocp){total - 1.0, lr, min_lr, f->base_momentum, f->max_momentum};
    }
    double start = 0, step = (double)k;
    for (int i = 0; i < n; i++) {
        if (step <= ph[i].end || i == n - 1) {
            double pct = (step - start) / (ph[i].end - start);
            if (mom) *mom = f->cycle_momentum ? anneal(f->anneal_linear, ph[i].m0, ph[i].m1, pct) : -1.0;
            return anneal(f->anneal_linear, ph[i].lr0, ph[i].lr1, pct);
        }
        start = ph[i].end;
    }
    return lr; /* not reached */
}

static double phase_lr(const ps_ts_phase_t *f, int64_t k, double lr, double *mom)
{
    if (mom) *mom = -1.0;
    switch (f->kind) {
    case PS_TS_STEP: return lr * pow(f->gamma, (double)(k / f->step_size));
    case PS_TS_MULTISTEP: {
        int c = 0;
        while (c < f->n_milestones && f->milestones[c] <= k) c++;
        return lr * pow(f->gamma, (double)c);
    }
    case PS_TS_EXP: return lr * pow(f->gamma, (double)k);
    case PS_TS_CONSTANT: return k < f->total_iters ? lr * f->factor : lr;
    case PS_TS_LINEAR: {
        double t = (double)(k < f->total_iters ? k : f->total_iters);
        return lr * (f->start_factor + (f->end_factor - f->start_factor) * t / (double)f->total_iters);
    }
    case PS_TS_COSINE: return f->eta_min + (lr - f->eta_min) * (1.0 + cos(M_PI * (double)k / f->t_max)) / 2.0;
    case PS_TS_ONECYCLE: return onecycle(f, k, lr, mom);
    }
    return lr;
}

double ps_tsched_lr(const ps_tsched_t *s, int64_t k, double lr, double *momentum)
{
    if (k < 0) k = 0;
    int i = 0;
    while (i < s->n - 1 && s->milestones[i] <= k) i++; /* torch's bisect_right */
    return phase_lr(&s->ph[i], i ? k - s->milestones[i - 1] : k, lr, momentum);
}

double ps_tsched_cycled_momentum(const ps_tsched_t *s)
{
    for (int i = 0; i < s->n; i++)
        if (s->ph[i].kind == PS_TS_ONECYCLE && s->ph[i].cycle_momentum) return s->ph[i].max_momentum;
    return -1.0;
}

bool ps_tsched_has_floor(const ps_tsched_t *s)
{
    for (int i = 0; i < s->n; i++)
        if (s->ph[i].kind == PS_TS_COSINE && s->ph[i].eta_min != 0) return true;
    return false;
}
