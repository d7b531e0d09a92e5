/* bench_util.h - small helpers the benchmark programs share (not tests). */
#ifndef PSD_BENCH_UTIL_H
#define PSD_BENCH_UTIL_H

/* zmq_msg_init_data free callback for buffers the program owns */
static inline void bench_no_free(void *data, void *hint)
{
    (void)data;
    (void)hint;
}

/* qsort comparator for doubles (medians, percentiles) */
static inline int bench_cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#endif
