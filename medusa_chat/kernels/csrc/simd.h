// Vector helpers shared by the C files (attention.c, decoder.c, hydra.c; qgemm.c needs no horizontal sums
// since its 8-column layout).
#pragma once
#include <immintrin.h>
#include <math.h>

// The one fixed horizontal sum of 8 lanes: every result that needs one uses this order.
static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}

// exp(x) for 8 lanes (Cephes' polynomial, ~1 ulp); lanes are independent, so a value's result never depends
// on its neighbours or on where a vector starts.
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    const __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(0x7f)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// A tail shorter than 8 goes through the same vector code (padded), so every element is computed alike.
static inline __m256 load_tail(const float *p, int n, float pad) {
    float t[8];
    for (int i = 0; i < 8; i++) t[i] = i < n ? p[i] : pad;
    return _mm256_loadu_ps(t);
}

static inline void store_tail(float *p, __m256 v, int n) {
    float t[8];
    _mm256_storeu_ps(t, v);
    for (int i = 0; i < n; i++) p[i] = t[i];
}
