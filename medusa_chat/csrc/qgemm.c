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
#include "simd.h"
#include <stdint.h>

#define QK 32
#define MR 8  // rows per register tile
#define PAR_MIN (1L << 18)  // smaller products run on one thread: a parallel region costs more than it saves


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

// A tile: NC output columns x MR rows, each (row, column) with its own accumulator. Several columns per tile
// give a 1-row step independent FMA chains to overlap (a single column's chain of block FMAs is latency-bound);
// several rows share each weight block's load and unpacking. Every (row, column) pair runs the same instruction
// sequence in every tile shape (acc = fma(d_w * d_x, dot, acc) over the blocks in order, one horizontal sum), so
// the tiling never changes a result's bits. NC and MR are compile-time constants at each call (always_inline).
static inline __attribute__((always_inline)) void q4_1_tile(const int8_t *qx, const float *dx, const float *sx,
                                                             int nb, int r0, const uint8_t *qs, const float *d,
                                                             const float *mn, float *y, int N, int n0,
                                                             const int NC, const int MR_) {
    __m256 acc[4][MR];
    float accm[4][MR];
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++)
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++) acc[c][r] = _mm256_setzero_ps(), accm[c][r] = 0.0f;
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        __m256i w[4];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) {
            const __m128i raw = _mm_loadu_si128((const __m128i *)(qs + ((size_t)(n0 + c) * nb + b) * 16));
            w[c] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + xb * QK));
#pragma GCC unroll 4
            for (int c = 0; c < NC; c++) {
                const size_t wb = (size_t)(n0 + c) * nb + b;
                acc[c][r] = _mm256_fmadd_ps(_mm256_set1_ps(d[wb] * dx[xb]), dot_i8(w[c], xq, ones), acc[c][r]);
                accm[c][r] += mn[wb] * sx[xb];
            }
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++)
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++) y[(size_t)(r0 + r) * N + n0 + c] = hsum8(acc[c][r]) + accm[c][r];
}

static inline __attribute__((always_inline)) void q8_0_tile(const int8_t *qx, const float *dx, int nb, int r0,
                                                             const int8_t *qs, const float *d, float *y, int N,
                                                             int n0, const int NC, const int MR_) {
    __m256 acc[4][MR];
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++)
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++) acc[c][r] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int b = 0; b < nb; b++) {
        __m256i w[4], aw[4];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) {
            w[c] = _mm256_loadu_si256((const __m256i *)(qs + ((size_t)(n0 + c) * nb + b) * QK));
            aw[c] = _mm256_sign_epi8(w[c], w[c]);  // |w| as unsigned bytes; the sign moves to x
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(qx + xb * QK));
#pragma GCC unroll 4
            for (int c = 0; c < NC; c++) {
                const __m256i xs = _mm256_sign_epi8(xq, w[c]);
                acc[c][r] = _mm256_fmadd_ps(_mm256_set1_ps(d[(size_t)(n0 + c) * nb + b] * dx[xb]),
                                            dot_i8(aw[c], xs, ones), acc[c][r]);
            }
        }
    }
#pragma GCC unroll 4
    for (int c = 0; c < NC; c++)
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++) y[(size_t)(r0 + r) * N + n0 + c] = hsum8(acc[c][r]);
}

// Columns per tile for a row tile of mr rows: about 8 accumulators (16 ymm registers in all). Q8_0 holds two
// registers per column (w and |w|), so it takes half as many columns; and a very tall Q8_0 matrix (the
// lm_head, 49152 x 576) streamed faster one column at a time on the machines measured (Zen 3).
static inline int q4_1_cols(int mr, int N) { (void)N; return mr <= 2 ? 4 : (mr <= 4 ? 2 : 1); }
static inline int q8_0_cols(int mr, int N) { return N >= 16384 ? 1 : (mr <= 4 ? 2 : 1); }

#define DISPATCH(CALL)                                                                 \
    switch (mr) {                                                                      \
        case 1: if (nc == 4) CALL(4, 1); else if (nc == 2) CALL(2, 1); else CALL(1, 1); break; \
        case 2: if (nc == 4) CALL(4, 2); else if (nc == 2) CALL(2, 2); else CALL(1, 2); break; \
        case 3: if (nc == 2) CALL(2, 3); else CALL(1, 3); break;                       \
        case 4: if (nc == 2) CALL(2, 4); else CALL(1, 4); break;                       \
        case 5: CALL(1, 5); break;                                                     \
        case 6: CALL(1, 6); break;                                                     \
        case 7: CALL(1, 7); break;                                                     \
        default: CALL(1, 8); break;                                                    \
    }

// Columns in groups of 4 (the unit of work per thread); in a group, tiles of COLS(mr) columns for each
// row tile, and column by column where a tile would pass the group's or the matrix's end.
#define TILED(CALL, COLS)                                                                  \
    _Pragma("omp parallel for schedule(static) if ((long)N * K >= PAR_MIN)")          \
    for (int n0 = 0; n0 < N; n0 += 4) {                                                \
        const int n1 = n0 + 4 < N ? n0 + 4 : N;                                        \
        for (int r0 = 0; r0 < M; r0 += MR) {                                           \
            const int mr = M - r0 < MR ? M - r0 : MR, tc = COLS(mr, N);                \
            for (int col = n0, nc; col < n1; col += nc) {                              \
                nc = col + tc <= n1 ? tc : 1;                                          \
                DISPATCH(CALL)                                                         \
            }                                                                          \
        }                                                                              \
    }

// x [M, K] fp32 row-major, qs [N, K / 2] bytes, d and mn [N, K / 32] fp32, y [M, N] fp32;
// work: M * K bytes + 2 * M * K / 32 floats of scratch for the quantized rows.
void q4_1_gemm(const float *x, int M, int K, const uint8_t *qs, const float *d, const float *mn, int N,
               float *y, int8_t *qx, float *dx, float *sx) {
    const int nb = K / QK;
    quantize_rows(x, M, K, qx, dx, sx);
#define Q41(NCc, MRc) q4_1_tile(qx, dx, sx, nb, r0, qs, d, mn, y, N, col, NCc, MRc)
    TILED(Q41, q4_1_cols)
#undef Q41
}

// x [M, K] fp32, qs [N, K] int8, d [N, K / 32] fp32, y [M, N] fp32; scratch as above.
void q8_0_gemm(const float *x, int M, int K, const int8_t *qs, const float *d, int N, float *y, int8_t *qx,
               float *dx, float *sx) {
    const int nb = K / QK;
    quantize_rows(x, M, K, qx, dx, sx);
#define Q80(NCc, MRc) q8_0_tile(qx, dx, nb, r0, qs, d, y, N, col, NCc, MRc)
    TILED(Q80, q8_0_cols)
#undef Q80
}
