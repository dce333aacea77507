// Weight-only quantized GEMM for small batches (a decoding step: 1 to a few dozen rows), AVX2 + FMA.
//
// y[m, n] = sum_k x[m, k] * w[n, k] with w stored as GGUF blocks of 32 along k:
//   Q4_1: w = d * q + mn, q in 0..15 (16 bytes: low nibbles = block elements 0..15, high = 16..31)
//   Q8_0: w = d * q, q in -128..127
// The weights are the file's blocks as stored; the activations are quantized to 8 bits per block of 32
// (llama.cpp's own scheme for these formats), and the block dot products are exact integer sums.
//
// Why a kernel of our own: at batch 1 the step is memory-bound, and torch's CPU weight-only kernels re-read
// or re-expand the weight for every row, so a 4-row tree step costs ~2x a 1-row step. Here each weight block
// is read and expanded once and applied to up to 8 rows held in registers: a small tree costs about what one
// token costs. Row invariance (the tree step must reproduce the plain step bit for bit): every row's sum is
// accumulated with the same instruction sequence whatever the number of rows (8 lanes per block, blocks in
// order, one fixed horizontal sum), so a row's result never depends on the rows computed beside it.
#include <immintrin.h>
#include <stdint.h>

#define QK 32
#define MR 8  // rows per register tile
#define PAR_MIN (1L << 18)  // smaller products run on one thread: a parallel region costs more than it saves

static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    __m128 sh = _mm_movehdup_ps(lo);
    __m128 s = _mm_add_ps(lo, sh);
    sh = _mm_movehl_ps(sh, s);
    s = _mm_add_ss(s, sh);
    return _mm_cvtss_f32(s);
}


// Activation rows quantized per block of 32 the way llama.cpp does (Q8_1): q = round(x / d), d = max|x| / 127,
// plus s = d * sum(q) for Q4_1's minimum term. Integer dot products then cost a few instructions per 32 weights
// (the float-dequantizing alternative is compute-bound on AVX2 at one row). Per row, so row-invariant.
static void quantize_rows(const float *x, int M, int K, int8_t *q, float *dx, float *sx) {
    const int nb = K / QK;
    for (int r = 0; r < M; r++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * K + (size_t)b * QK;
            float amax = 0.0f;
            for (int j = 0; j < QK; j++) {
                const float a = xb[j] < 0 ? -xb[j] : xb[j];
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int sum = 0;
            int8_t *qb = q + (size_t)r * K + (size_t)b * QK;
            for (int j = 0; j < QK; j++) {
                const int v = (int)__builtin_lrintf(xb[j] * id);
                qb[j] = (int8_t)v;
                sum += v;
            }
            dx[(size_t)r * nb + b] = d;
            sx[(size_t)r * nb + b] = d * (float)sum;
        }
    }
}

static inline __m256 dot_i8(__m256i w_u8, __m256i x_s8, __m256i ones) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w_u8, x_s8), ones));
}

// One output column n for rows [r0, r0 + mr).
static void q4_1_col(const int8_t *qx, const float *dx, const float *sx, int K, int r0, int mr,
                     const uint8_t *qs, const float *d, const float *mn, float *y, int N, int n) {
    __m256 acc[MR];
    float accm[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps(), accm[r] = 0.0f;
    const int nb = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(qs + (size_t)b * 16));
        const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        for (int r = 0; r < mr; r++) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + xb * QK));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * dx[xb]), dot_i8(w, xq, ones), acc[r]);
            accm[r] += mn[b] * sx[xb];
        }
    }
    for (int r = 0; r < mr; r++) y[(size_t)(r0 + r) * N + n] = hsum(acc[r]) + accm[r];
}

static void q8_0_col(const int8_t *qx, const float *dx, int K, int r0, int mr, const int8_t *qs, const float *d,
                     float *y, int N, int n) {
    __m256 acc[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps();
    const int nb = K / QK;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; b++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(qs + (size_t)b * QK));
        const __m256i aw = _mm256_sign_epi8(w, w);  // |w| as unsigned bytes; the sign moves to x
        for (int r = 0; r < mr; r++) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
            const __m256i xq = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(qx + xb * QK)), w);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d[b] * dx[xb]), dot_i8(aw, xq, ones), acc[r]);
        }
    }
    for (int r = 0; r < mr; r++) y[(size_t)(r0 + r) * N + n] = hsum(acc[r]);
}

// x [M, K] fp32 row-major, qs [N, K / 2] bytes, d and mn [N, K / 32] fp32, y [M, N] fp32;
// work: M * K bytes + 2 * M * K / 32 floats of scratch for the quantized rows.
void q4_1_gemm(const float *x, int M, int K, const uint8_t *qs, const float *d, const float *mn, int N,
               float *y, int8_t *qx, float *dx, float *sx) {
    const int nb = K / QK;
    quantize_rows(x, M, K, qx, dx, sx);
#pragma omp parallel for schedule(static) if ((long)N * K >= PAR_MIN)
    for (int n = 0; n < N; n++) {
        for (int r0 = 0; r0 < M; r0 += MR) {
            const int mr = M - r0 < MR ? M - r0 : MR;
            q4_1_col(qx, dx, sx, K, r0, mr, qs + (size_t)n * nb * 16, d + (size_t)n * nb, mn + (size_t)n * nb,
                     y, N, n);
        }
    }
}

// x [M, K] fp32, qs [N, K] int8, d [N, K / 32] fp32, y [M, N] fp32; scratch as above.
void q8_0_gemm(const float *x, int M, int K, const int8_t *qs, const float *d, int N, float *y, int8_t *qx,
               float *dx, float *sx) {
    const int nb = K / QK;
    quantize_rows(x, M, K, qx, dx, sx);
#pragma omp parallel for schedule(static) if ((long)N * K >= PAR_MIN)
    for (int n = 0; n < N; n++) {
        for (int r0 = 0; r0 < M; r0 += MR) {
            const int mr = M - r0 < MR ? M - r0 : MR;
            q8_0_col(qx, dx, K, r0, mr, qs + (size_t)n * K, d + (size_t)n * nb, y, N, n);
        }
    }
}
