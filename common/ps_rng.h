/* ps_rng.h - small deterministic random numbers (splitmix64 / xoshiro256**). */
#ifndef PS_RNG_H
#define PS_RNG_H

#include <stddef.h>
#include <stdint.h>

typedef struct { uint64_t s[4]; } ps_rng_t;

/* splitmix64's output function: a counter-based generator on its own
 * (value j of a key: ps_mix64(key + (j + 1) * golden)). */
static inline uint64_t ps_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static inline uint64_t ps_splitmix64(uint64_t *x) { return ps_mix64(*x += 0x9e3779b97f4a7c15ULL); }

/* Seed from two words (e.g. run seed and a stream id such as the epoch). */
static inline void ps_rng_seed(ps_rng_t *r, uint64_t seed, uint64_t stream)
{
    uint64_t x = seed ^ (stream * 0xd1b54a32d192ed03ULL);
    for (int i = 0; i < 4; i++) r->s[i] = ps_splitmix64(&x);
}

static inline uint64_t ps_rng_next(ps_rng_t *r)
{
    uint64_t *s = r->s;
    uint64_t x = s[1] * 5, result = ((x << 7) | (x >> 57)) * 9, t = s[1] << 17;
    s[2] ^= s[0]; s[3] ^= s[1]; s[1] ^= s[2]; s[0] ^= s[3]; s[2] ^= t;
    s[3] = (s[3] << 45) | (s[3] >> 19);
    return result;
}

/* Uniform in [0, 1) with 24 bits (exact in float). */
static inline float ps_rng_uniform(ps_rng_t *r) { return (float)(ps_rng_next(r) >> 40) * (1.0f / 16777216.0f); }

/* Uniform integer in [0, n), unbiased (Lemire). n > 0. */
static inline uint64_t ps_rng_below(ps_rng_t *r, uint64_t n)
{
    for (;;) {
        __extension__ unsigned __int128 m = (unsigned __int128)ps_rng_next(r) * n;
        uint64_t lo = (uint64_t)m;
        if (lo >= n || lo >= (uint64_t)(-n) % n) return (uint64_t)(m >> 64);
    }
}

/* perm[i] = i shuffled (Fisher-Yates) by (seed, stream). */
static inline void ps_rng_permutation(uint32_t *perm, size_t n, uint64_t seed, uint64_t stream)
{
    ps_rng_t r;
    ps_rng_seed(&r, seed, stream);
    for (size_t i = 0; i < n; i++) perm[i] = (uint32_t)i;
    for (size_t i = n; i > 1; i--) {
        size_t j = (size_t)ps_rng_below(&r, i);
        uint32_t t = perm[i - 1]; perm[i - 1] = perm[j]; perm[j] = t;
    }
}

#endif
