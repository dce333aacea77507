// Helpers for the kernels (decoder.c; qgemm.c needs no horizontal sums since its 8-column layout).
#pragma once
#include <immintrin.h>

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
