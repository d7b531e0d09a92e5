/* ps_ctr.c - the click-through task's generator (see ps_ctr.h). */
#include "ps_ctr.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "ps_config.h"
#include "ps_rng.h"

/* stream ids, so that weights, rows, values and labels never share draws */
#define CTR_WEIGHT 0x5745494748540000ULL
#define CTR_ROW 0x524f570000000000ULL
#define CTR_EXAMPLE 0x4558414d504c4500ULL

static double unit(uint64_t *x) { return (double)(ps_splitmix64(x) >> 11) * (1.0 / 9007199254740992.0); }

void ps_ctr_from_config(const ps_config_t *c, ps_ctr_t *g)
{
    *g = (ps_ctr_t){.fields = c->ctr_fields,
                    .per_field = c->ctr_per_field,
                    .vocab = (uint64_t)c->ctr_vocab,
                    .zipf = c->ctr_zipf,
                    .rows = (uint64_t)c->ctr_rows,
                    .weight_std = c->ctr_weight_std,
                    .bias = c->ctr_bias,
                    .seed = c->ctr_seed};
}

int ps_ctr_check(const ps_ctr_t *g, char *err, size_t errlen)
{
    const char *why = NULL;
    if (g->fields < 1 || g->per_field < 1 || (long)g->fields * g->per_field > PS_CTR_MAX_IDS)
        why = "fields x per_field must be 1..256";
    else if (g->vocab < 1 || g->vocab > (UINT64_C(1) << 40))
        why = "vocab must be 1..2^40";
    else if (!(g->zipf > 0 && g->zipf <= 10))
        why = "zipf exponent must be in (0, 10]";
    else if (g->rows < 1 || g->rows > UINT32_MAX)
        why = "rows must be 1..2^32-1";
    else if (!(g->weight_std >= 0 && g->weight_std <= 100) || !isfinite(g->bias) || fabs(g->bias) > 100)
        why = "weight_std must be in [0, 100] and |bias| <= 100";
    if (!why) return 0;
    snprintf(err, errlen, "%s", why);
    return -1;
}

double ps_ctr_weight(const ps_ctr_t *g, int f, uint64_t v)
{
    uint64_t x = g->seed ^ CTR_WEIGHT ^ ((uint64_t)f * 0x9e3779b97f4a7c15ULL) ^ (v * 0xd1b54a32d192ed03ULL);
    ps_splitmix64(&x);
    double u1 = unit(&x), u2 = unit(&x); /* Box-Muller */
    return g->weight_std * sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2);
}

uint32_t ps_ctr_row(const ps_ctr_t *g, int f, uint64_t v)
{
    uint64_t x = g->seed ^ CTR_ROW ^ ((uint64_t)f * 0xbf58476d1ce4e5b9ULL) ^ (v * 0x94d049bb133111ebULL);
    return (uint32_t)(ps_splitmix64(&x) % g->rows);
}

/* Rejection-inversion (Hoermann and Derflinger), as in Apache Commons RNG's
 * RejectionInversionZipfSampler: ranks 1..n with P(k) ~ k^-s. */
static double helper1(double x) { return fabs(x) > 1e-8 ? log1p(x) / x : 1 - x * (0.5 - x * (1.0 / 3 - 0.25 * x)); }
static double helper2(double x)
{
    return fabs(x) > 1e-8 ? expm1(x) / x : 1 + x * 0.5 * (1 + x * (1.0 / 3) * (1 + 0.25 * x));
}
static double h_int(double x, double s) { double lx = log(x); return helper2((1 - s) * lx) * lx; }
static double h(double x, double s) { return exp(-s * log(x)); }
static double h_int_inv(double x, double s)
{
    double t = x * (1 - s);
    if (t < -1) t = -1;
    return exp(helper1(t) * x);
}

uint64_t ps_zipf(uint64_t *x, uint64_t n, double s)
{
    if (n <= 1) return 0;
    const double hx1 = h_int(1.5, s) - 1, hn = h_int((double)n + 0.5, s);
    const double sth = 2 - h_int_inv(h_int(2.5, s) - h(2, s), s);
    for (;;) {
        double u = hn + unit(x) * (hx1 - hn);
        double xx = h_int_inv(u, s);
        double k = floor(xx + 0.5);
        if (k < 1) k = 1;
        else if (k > (double)n) k = (double)n;
        if (k - xx <= sth || u >= h_int(k + 0.5, s) - h(k, s)) return (uint64_t)k - 1;
    }
}

double ps_ctr_example(const ps_ctr_t *g, uint64_t index, uint32_t *rows, uint64_t *values, uint8_t *label)
{
    uint64_t x = g->seed ^ CTR_EXAMPLE ^ (index * 0x9e3779b97f4a7c15ULL);
    ps_splitmix64(&x);
    double logit = g->bias;
    for (int f = 0; f < g->fields; f++) {
        double sum = 0;
        for (int j = 0; j < g->per_field; j++) {
            uint64_t v = ps_zipf(&x, g->vocab, g->zipf);
            int i = f * g->per_field + j;
            rows[i] = ps_ctr_row(g, f, v);
            if (values) values[i] = v;
            sum += ps_ctr_weight(g, f, v);
        }
        logit += sum / g->per_field;
    }
    double p = 1.0 / (1.0 + exp(-logit));
    *label = unit(&x) < p;
    return p;
}

double ps_logloss(double p, int y)
{
    if (p < 1e-7) p = 1e-7;
    if (p > 1 - 1e-7) p = 1 - 1e-7;
    return y ? -log(p) : -log1p(-p);
}

static int by_score(const void *a, const void *b, void *ctx)
{
    const float *s = ctx;
    float x = s[*(const uint32_t *)a], y = s[*(const uint32_t *)b];
    return (x > y) - (x < y);
}

double ps_auc(const float *score, const uint8_t *label, size_t n, uint32_t *order)
{
    for (size_t i = 0; i < n; i++) order[i] = (uint32_t)i;
    qsort_r(order, n, sizeof *order, by_score, (void *)score);
    /* Mann-Whitney: the positives' ranks (1-based, ties averaged) */
    double rank_sum = 0;
    uint64_t pos = 0;
    for (size_t i = 0; i < n;) {
        size_t j = i;
        while (j < n && score[order[j]] == score[order[i]]) j++;
        double mid = (double)(i + 1 + j) / 2.0; /* ranks i+1 .. j */
        for (size_t k = i; k < j; k++)
            if (label[order[k]]) {
                rank_sum += mid;
                pos++;
            }
        i = j;
    }
    uint64_t neg = n - pos;
    if (pos == 0 || neg == 0) return 0.5;
    return (rank_sum - (double)pos * (double)(pos + 1) / 2.0) / ((double)pos * (double)neg);
}
