// Weight-only quantized GEMM for small batches (a decoding step: 1 to a few dozen rows), AVX2 + FMA, with
// AVX-VNNI / AVX512-VNNI dot products where the CPU has them (the build passes -mavxvnni etc.: cbuild.py).
//
// y[m, n] = sum_k x[m, k] * w[n, k] with w stored as GGUF blocks of 32 along k:
//   Q4_1: w = d * q + mn, q in 0..15
//   Q8_0: w = d * q, q in -127..127
// The weights are the file's blocks; the activations are quantized to 8 bits per block of 32 (llama.cpp's own
// scheme for these formats), and the block dot products are exact integer sums.
//
// Layout: output columns in groups of GW (16 in AVX512-VNNI builds, else 8; block_linears.py, interleave_*), each
// group's blocks interleaved: per block, GW * 4-byte vectors where vector j holds for each column c of the group
// the 4 codes of block elements 4j..4j+3 at bytes 4c..4c+3 (Q4_1: low nibbles; the high nibbles hold elements
// 16+4j..16+4j+3). One multiply-add of such a vector with the row's 4 activation codes broadcast gives the
// partial dots of all the group's columns at once, so there is no horizontal sum, and the columns' scales apply
// with one vector FMA. A 512-bit tile takes a 16-column group, a 256-bit tile an 8-column one; both compute
// every column with the same arithmetic, so every build gives the same bits.
// Why a kernel of our own: at batch 1 the step is bound by these products, and torch's CPU weight-only kernels
// re-read or re-expand the weight for every row, so a 4-row tree step costs ~2x a 1-row step. Here each weight
// block is read and expanded once and applied to up to 4 rows. Row invariance (the tree step must reproduce the
// plain step bit for bit): each row's outputs are computed by the same instruction sequence whatever the number
// of rows (exact integer block sums, then acc = fma(d * dx, dot, acc) over the blocks in order), so a row's
// result never depends on the rows computed beside it.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
#include "qgemm.h"
#include "team.h"     // the team of our regions, the duet switch, the 8-bit activation rows (team.c)
#include "kquants.h"  // the K-quant products, which the duet runtime and the standalone calls below run
#include "qblock.h"   // the layout sizes, ISA switches and vector helpers shared with kquants.c
#include "duet.h"
#include "decoder.h"

static int duet_gemm(int kind, const float *x, int M, int K, const void *qs, const uint16_t *d, const void *aux,
                     int N, float *y);
static int duet_q8_0_argmax(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws,
                            int N, int64_t *out);

int qgemm_isa(void) { return HAVE_VNNI; }
int qgemm_group(void) { return GW; }

// Q4_1, 8 columns (a group, or with GW = 16 one half of it: qs, d, mn offset to it) x MR_ rows. Codes are 0..15 (unsigned
// operand), activations -127..127.
// Without VNNI, the 8 maddubs partials of a block add up exactly in 16 bits (|sum| <= 8 * 2 * 15 * 127 < 32768).
static inline __attribute__((always_inline)) void q4_1_tile(const int8_t *qx, const float *dx, const float *sx,
                                                             int nb, int r0, const uint8_t *qs, const uint16_t *d,
                                                             const uint16_t *mn, float *y, int N, int n0,
                                                             const int MR_) {
    const int pf = mc_pf_hint[PF_FAM_Q4_1][MR_ > 1];
    __m256 acc[TR];
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) acc[r] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F);
#if !HAVE_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = qs + (size_t)b * GW * 16;
        prefetch_lines(wb + PF_AHEAD, GW * 16, pf);
        if ((b & 1) == 0) {  // the scales: 2 blocks per 64-byte line
            prefetch_lines(d + (size_t)b * GW + PF_AHEAD / 8, 64, pf);
            prefetch_lines(mn + (size_t)b * GW + PF_AHEAD / 8, 64, pf);
        }
        __m256i lo[4], hi[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(wb + GW * 4 * j));
            lo[j] = _mm256_and_si256(raw, m4);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        }
        const __m256 db = load_f16(d + (size_t)b * GW), mb = load_f16(mn + (size_t)b * GW);
#pragma GCC unroll 4
        for (int r = 0; r < MR_; r++) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
            const int8_t *q = qx + xb * QK;
#if HAVE_VNNI
            // two independent chains (low and high halves), added at the end: exact integers either way
            __m256i s0 = DPBUSD(_mm256_setzero_si256(), lo[0], bcast4(q));
            __m256i s1 = DPBUSD(_mm256_setzero_si256(), hi[0], bcast4(q + 16));
            s0 = DPBUSD(s0, lo[1], bcast4(q + 4));
            s1 = DPBUSD(s1, hi[1], bcast4(q + 20));
            s0 = DPBUSD(s0, lo[2], bcast4(q + 8));
            s1 = DPBUSD(s1, hi[2], bcast4(q + 24));
            s0 = DPBUSD(s0, lo[3], bcast4(q + 12));
            s1 = DPBUSD(s1, hi[3], bcast4(q + 28));
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
#else
            __m256i s = _mm256_maddubs_epi16(lo[0], bcast4(q));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[1], bcast4(q + 4)));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[2], bcast4(q + 8)));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(lo[3], bcast4(q + 12)));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[0], bcast4(q + 16)));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[1], bcast4(q + 20)));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[2], bcast4(q + 24)));
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(hi[3], bcast4(q + 28)));
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s, ones));
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(db, _mm256_set1_ps(dx[xb])), dot, acc[r]);
            acc[r] = _mm256_fmadd_ps(mb, _mm256_set1_ps(sx[xb]), acc[r]);
        }
    }
    const int w = N - n0 < GC ? N - n0 : GC;
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) store_cols(y + (size_t)(r0 + r) * N + n0, acc[r], w);
}

// Q8_0, 8 columns (a group, or half of one as for Q4_1) x MR_ rows; both operands are signed.
//   VNNI: the unsigned operand is the activation shifted by 128 (xu = x + 128, kept beside qx by quantize_rows),
//         and 128 * (the column's block sum of codes, `ws`) is subtracted again: exact.
//   AVX2: the sign moves from w to x (|w| * sign(x, w)), pairs summed in 32 bits (two pairs could pass 16).
static inline __attribute__((always_inline)) void q8_0_tile(const int8_t *qx, const int8_t *qxu, const float *dx,
                                                             int nb, int r0, const int8_t *qs, const uint16_t *d,
                                                             const int16_t *ws, float *y, int N, int n0,
                                                             const int MR_) {
    const int pf = mc_pf_hint[PF_FAM_Q8_0][MR_ > 1];
    __m256 acc[TR];
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) acc[r] = _mm256_setzero_ps();
#if !HAVE_VNNI
    const __m256i ones = _mm256_set1_epi16(1);
    (void)qxu, (void)ws;
#else
    (void)qx;
#endif
    for (int b = 0; b < nb; b++) {
        const int8_t *wb = qs + (size_t)b * GW * 32;
        prefetch_lines(wb + PF_AHEAD, GW * 32, pf);
        if ((b & 1) == 0) {
            prefetch_lines(d + (size_t)b * GW + PF_AHEAD / 16, 64, pf);
            prefetch_lines(ws + (size_t)b * GW + PF_AHEAD / 16, 64, pf);
        }
        __m256i w[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)(wb + GW * 4 * j));
        const __m256 db = load_f16(d + (size_t)b * GW);
#if HAVE_VNNI
        const __m256i corr =
            _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(ws + (size_t)b * GW))), 7);
#endif
#pragma GCC unroll 4
        for (int r = 0; r < MR_; r++) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
#if HAVE_VNNI
            const int8_t *q = qxu + xb * QK;
            __m256i s0 = DPBUSD(_mm256_setzero_si256(), bcast4(q), w[0]);
            __m256i s1 = DPBUSD(_mm256_setzero_si256(), bcast4(q + 4), w[1]);
#pragma GCC unroll 3
            for (int j = 2; j < 8; j += 2) {
                s0 = DPBUSD(s0, bcast4(q + 4 * j), w[j]);
                s1 = DPBUSD(s1, bcast4(q + 4 * j + 4), w[j + 1]);
            }
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_add_epi32(s0, s1), corr));
#else
            const int8_t *q = qx + xb * QK;
            __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) {
                const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(bcast4(q + 4 * j), w[j]));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
            }
            const __m256 dot = _mm256_cvtepi32_ps(s);
#endif
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(db, _mm256_set1_ps(dx[xb])), dot, acc[r]);
        }
    }
    const int w = N - n0 < GC ? N - n0 : GC;
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) store_cols(y + (size_t)(r0 + r) * N + n0, acc[r], w);
}

#if HAVE_512  // 512-bit tiles (qblock.h)
static inline __attribute__((always_inline)) void q4_1_tile16(const int8_t *qx, const float *dx, const float *sx,
                                                               int nb, int r0, const uint8_t *qs,
                                                               const uint16_t *d, const uint16_t *mn, float *y,
                                                               int N, int n0, const int MR_) {
    const int pf = mc_pf_hint[PF_FAM_Q4_1][MR_ > 1];
    __m512 acc[TR];
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) acc[r] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = qs + (size_t)b * 256;
        prefetch_lines(wb + PF_AHEAD, 256, pf);
        if ((b & 1) == 0) {
            prefetch_lines(d + (size_t)b * GW + PF_AHEAD / 8, 64, pf);
            prefetch_lines(mn + (size_t)b * GW + PF_AHEAD / 8, 64, pf);
        }
        __m512i lo[4], hi[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(wb + 64 * j));
            lo[j] = _mm512_and_si512(raw, m4);
            hi[j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
        }
        const __m512 db = load_f16x16(d + (size_t)b * GW), mb = load_f16x16(mn + (size_t)b * GW);
#pragma GCC unroll 4
        for (int r = 0; r < MR_; r++) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
            const int8_t *q = qx + xb * QK;
            // one accumulation chain (exact integers, so any order gives the same sums): an add fewer per row and
            // block than two chains, and the rows' and blocks' chains in flight hide the latency. Measured with
            // benchmarks/step_gemms.c at commit 4e8dc55 (30 layers, 2-vCPU Xeon, three alternating runs): 1 / 3 / 8 rows 1.50-1.63
            // / 1.65-1.80 / 3.17-3.39 ms -> 1.43-1.47 / 1.61-1.65 / 3.07-3.15 ms
            __m512i s = dpbusd_bcast512(_mm512_setzero_si512(), lo[0], q);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                if (j) s = dpbusd_bcast512(s, lo[j], q + 4 * j);
                s = dpbusd_bcast512(s, hi[j], q + 16 + 4 * j);
            }
            const __m512 dot = _mm512_cvtepi32_ps(s);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(db, _mm512_set1_ps(dx[xb])), dot, acc[r]);
            acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(sx[xb]), acc[r]);
        }
    }
    const int w = N - n0 < GW ? N - n0 : GW;
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) store_cols16(y + (size_t)(r0 + r) * N + n0, acc[r], w);
}

static inline __attribute__((always_inline)) void q8_0_tile16(const int8_t *qxu, const float *dx, int nb, int r0,
                                                               const int8_t *qs, const uint16_t *d,
                                                               const int16_t *ws, float *y, int N, int n0,
                                                               const int MR_) {
    const int pf = mc_pf_hint[PF_FAM_Q8_0][MR_ > 1];
    __m512 acc[TR];
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const int8_t *wb = qs + (size_t)b * 512;
        prefetch_lines(wb + PF_AHEAD, 512, pf);
        if ((b & 1) == 0) {
            prefetch_lines(d + (size_t)b * GW + PF_AHEAD / 16, 64, pf);
            prefetch_lines(ws + (size_t)b * GW + PF_AHEAD / 16, 64, pf);
        }
        __m512i w[8];
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512((const void *)(wb + 64 * j));
        const __m512 db = load_f16x16(d + (size_t)b * GW);
        const __m512i corr =
            _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(ws + (size_t)b * GW))), 7);
#pragma GCC unroll 4
        for (int r = 0; r < MR_; r++) {
            const size_t xb = (size_t)(r0 + r) * nb + b;
            const int8_t *q = qxu + xb * QK;
            __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bcast4_512(q), w[0]);
#pragma GCC unroll 7
            for (int j = 1; j < 8; j++) s = _mm512_dpbusd_epi32(s, bcast4_512(q + 4 * j), w[j]);
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(s, corr));
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(db, _mm512_set1_ps(dx[xb])), dot, acc[r]);
        }
    }
    const int w = N - n0 < GW ? N - n0 : GW;
#pragma GCC unroll 4
    for (int r = 0; r < MR_; r++) store_cols16(y + (size_t)(r0 + r) * N + n0, acc[r], w);
}
#endif

// Column group g of a Q4_1 product, all M rows, to y [M, N]
static inline __attribute__((always_inline)) void q4_1_group(const int8_t *qx, const float *dx, const float *sx,
                                                              int M, int nb, const uint8_t *qs, const uint16_t *d,
                                                              const uint16_t *mn, int N, int g, float *y) {
    const uint8_t *gq = qs + (size_t)g * nb * GW * 16;
    const uint16_t *gd = d + (size_t)g * nb * GW, *gm = mn + (size_t)g * nb * GW;
#if HAVE_512
#define Q41(MRc) q4_1_tile16(qx, dx, sx, nb, r0, gq, gd, gm, y, N, g * GW, MRc)
    ROW_TILES(Q41)
#undef Q41
#else
    for (int h = 0; h < GW / GC && g * GW + h * GC < N; h++) {
#define Q41(MRc) q4_1_tile(qx, dx, sx, nb, r0, gq + 32 * h, gd + GC * h, gm + GC * h, y, N, g * GW + GC * h, MRc)
        ROW_TILES(Q41)
#undef Q41
    }
#endif
}

// The products as team work: called by every thread of a parallel region (decoder.c runs a whole step in one),
// each call shares the activation blocks, then the column groups, among the threads, with a barrier after each
// (the implicit one of `omp for`). Outside a parallel region one thread does everything. Which thread computes a
// column never changes its arithmetic.
//
// x [M, K] fp32 row-major; qs, d, mn: ceil(N / GW) interleaved groups (K / 2 * GW bytes, K / 32 * GW fp16
// each); y [M, N] fp32; scratch: qx 2 * M * K bytes, dx and sx M * K / 32 floats each.
void q4_1_gemm_team(const float *x, int M, int K, const uint8_t *qs, const uint16_t *d, const uint16_t *mn, int N,
                    float *y, int8_t *qx, float *dx, float *sx) {
    const int nb = K / QK, ng = (N + GW - 1) / GW;
    quantize_rows(x, M, K, qx, dx, sx, NULL, NULL);
#pragma omp for schedule(static)
    for (int g = 0; g < ng; g++) q4_1_group(qx, dx, sx, M, nb, qs, d, mn, N, g, y);
}

// Column group g of a Q8_0 product, all M rows, to y[r * ldy + c0 + c]: the product's own output (ldy = N, c0 =
// g * GW) or a group-sized scratch (ldy = GW, c0 = 0, q8_0_gemm_argmax). N: the product's outputs (the last
// group's padding columns are computed, never stored beyond N).
static inline __attribute__((always_inline)) void q8_0_group(const int8_t *qx, const int8_t *qxu, const float *dx,
                                                              int M, int nb, const int8_t *qs, const uint16_t *d,
                                                              const int16_t *ws, int N, int g, float *y, int ldy,
                                                              int c0) {
    const int8_t *gq = qs + (size_t)g * nb * GW * 32;
    const uint16_t *gd = d + (size_t)g * nb * GW;
    const int16_t *gs = ws + (size_t)g * nb * GW;
#if HAVE_512
    (void)qx, (void)N;
#define Q80(MRc) q8_0_tile16(qxu, dx, nb, r0, gq, gd, gs, y, ldy, c0, MRc)
    ROW_TILES(Q80)
#undef Q80
#else
    for (int h = 0; h < GW / GC && g * GW + h * GC < N; h++) {
#define Q80(MRc) q8_0_tile(qx, qxu, dx, nb, r0, gq + 32 * h, gd + GC * h, gs + GC * h, y, ldy, c0 + GC * h, MRc)
        ROW_TILES(Q80)
#undef Q80
    }
#endif
}

// x [M, K] fp32; qs, d, ws: ceil(N / GW) interleaved groups (K * GW bytes, K / 32 * GW fp16 scales, K / 32 * GW
// int16 block sums of the codes); y [M, N] fp32; scratch as above.
void q8_0_gemm_team(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws, int N,
                    float *y, int8_t *qx, float *dx, float *sx) {
    const int nb = K / QK, ng = (N + GW - 1) / GW;
    int8_t *qxu = qx + (size_t)M * K;
    quantize_rows(x, M, K, qx, dx, sx, HAVE_VNNI ? qxu : NULL, NULL);
#pragma omp for schedule(static)
    for (int g = 0; g < ng; g++) q8_0_group(qx, qxu, dx, M, nb, qs, d, ws, N, g, y, N, g * GW);
}

// The greedy tokens of a Q8_0 vocab projection (the lm_head): per row the index of the largest output, the first
// one where several are equal, and a NaN counting as the largest (torch.max's semantics, acceptance.greedy_tokens),
// without writing the [M, N] outputs: each thread keeps a running best per row over its own column groups (a
// contiguous range, in order), and the threads' bests are merged in column order. The outputs compared are the
// very values q8_0_gemm computes (the same tiles on the same activation codes), so the result is exactly
// greedy_tokens(q8_0_gemm(...)). Saves the logits' round trip through memory and a pass over them per step.
#define ARGMAX_ROWS 64
#define ARGMAX_THREADS 64
static inline int better(float v, float best) { return v > best || (v != v && best == best); }

// Column group g of the product folded into each row's running best (best/index [M]; index -1: none yet)
static inline void argmax_group(const int8_t *qx, const int8_t *qxu, const float *dx, int M, int nb,
                                const int8_t *qs, const uint16_t *d, const int16_t *ws, int N, int g, float *best,
                                int64_t *index) {
    __attribute__((aligned(64))) float y[ARGMAX_ROWS * GW];
    q8_0_group(qx, qxu, dx, M, nb, qs, d, ws, N, g, y, GW, 0);
    const int w = N - g * GW < GW ? N - g * GW : GW;  // the last group's padding columns are not outputs
    for (int r = 0; r < M; r++)
        for (int c = 0; c < w; c++) {
            const float v = y[r * GW + c];
            if (index[r] < 0 || better(v, best[r])) best[r] = v, index[r] = (int64_t)g * GW + c;
        }
}

int q8_0_gemm_argmax(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws, int N,
                     int64_t *out, int8_t *qx, float *dx, float *sx) {
    if (M > ARGMAX_ROWS) return 0;
    if (mc_duet() && duet_q8_0_argmax(x, M, K, qs, d, ws, N, out)) return 1;
    const int nb = K / QK, ng = (N + GW - 1) / GW;
    int8_t *qxu = qx + (size_t)M * K;
    float team_best[ARGMAX_THREADS][ARGMAX_ROWS];  // the caller's stack, shared by its team (48 KB)
    int64_t team_index[ARGMAX_THREADS][ARGMAX_ROWS];
    int threads = 1;
#pragma omp parallel if ((long)N * K >= PAR_MIN) num_threads(mc_team())
    {
        quantize_rows(x, M, K, qx, dx, sx, HAVE_VNNI ? qxu : NULL, NULL);
        const int t = omp_get_thread_num();
#pragma omp single
        threads = omp_get_num_threads();
        float best[ARGMAX_ROWS];
        int64_t index[ARGMAX_ROWS];
        for (int r = 0; r < M; r++) best[r] = 0.0f, index[r] = -1;
#pragma omp for schedule(static)
        for (int g = 0; g < ng; g++) argmax_group(qx, qxu, dx, M, nb, qs, d, ws, N, g, best, index);
        if (t < ARGMAX_THREADS)
            for (int r = 0; r < M; r++) team_best[t][r] = best[r], team_index[t][r] = index[r];
    }
    if (threads > ARGMAX_THREADS) return 0;
    for (int r = 0; r < M; r++) {
        int64_t index = -1;
        float best = 0.0f;
        for (int t = 0; t < threads; t++)  // static schedule: thread t's columns follow thread t - 1's
            if (team_index[t][r] >= 0 && (index < 0 || better(team_best[t][r], best)))
                best = team_best[t][r], index = team_index[t][r];
        out[r] = index;
    }
    return 1;
}

// One product on its own (the Python modules' calls): its own parallel region, or one thread when it is small
// (a region costs more than it saves below PAR_MIN).
void q4_1_gemm(const float *x, int M, int K, const uint8_t *qs, const uint16_t *d, const uint16_t *mn, int N,
               float *y, int8_t *qx, float *dx, float *sx) {
    if (mc_duet() && duet_gemm(1, x, M, K, qs, d, mn, N, y)) return;
#pragma omp parallel if ((long)N * K >= PAR_MIN) num_threads(mc_team())
    q4_1_gemm_team(x, M, K, qs, d, mn, N, y, qx, dx, sx);
}

void q8_0_gemm(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws, int N, float *y,
               int8_t *qx, float *dx, float *sx) {
    if (mc_duet() && duet_gemm(0, x, M, K, qs, d, ws, N, y)) return;
#pragma omp parallel if ((long)N * K >= PAR_MIN) num_threads(mc_team())
    q8_0_gemm_team(x, M, K, qs, d, ws, N, y, qx, dx, sx);
}

// One K-quant product on its own (the Python modules' calls), as q4_1_gemm: here rather than in kquants.c, so
// that the duet runtime below, which runs kquants.c's column groups, is only ever called from this file's side
void q4_k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx, float *sx) {
    const BLin l = {2, N, K, w, NULL, NULL};
    if (mc_duet() && duet_block_linear(&l, x, M, y)) return;
#pragma omp parallel if ((long)N * K >= PAR_MIN) num_threads(mc_team())
    q4_k_gemm_team(x, M, K, w, N, y, qx, dx, sx);
}
void q5_k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx, float *sx) {
    const BLin l = {3, N, K, w, NULL, NULL};
    if (mc_duet() && duet_block_linear(&l, x, M, y)) return;
#pragma omp parallel if ((long)N * K >= PAR_MIN) num_threads(mc_team())
    q5_k_gemm_team(x, M, K, w, N, y, qx, dx, sx);
}
void q6_k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx, float *sx) {
    const BLin l = {4, N, K, w, NULL, NULL};
    if (mc_duet() && duet_block_linear(&l, x, M, y)) return;
#pragma omp parallel if ((long)N * K >= PAR_MIN) num_threads(mc_team())
    q6_k_gemm_team(x, M, K, w, N, y, qx, dx, sx);
}

// Rows of a Q8_0 block linear's weight, dequantized: out[i] = row ids[i] (K floats), w = d * q exactly as the
// file defines it (the fp16 scale converted exactly, the product of an 11-bit and an 8-bit integer is exact in
// fp32). The token embedding of a model whose lm_head is tied to it is looked up this way (block_linears.py,
// BlockEmbedding), so the table is not also held in fp32. group: the layout's rows per interleaved group.
void q8_0_rows(const int8_t *qs, const uint16_t *d, int K, int group, const int64_t *ids, int n, float *out) {
    const int nb = K / QK;
    for (int i = 0; i < n; i++) {
        const int64_t g = ids[i] / group, c = ids[i] % group;
        const int8_t *gq = qs + (size_t)g * nb * group * 32;
        const uint16_t *gd = d + (size_t)g * nb * group;
        float *o = out + (size_t)i * K;
        for (int b = 0; b < nb; b++) {
            const float db = _cvtsh_ss(gd[(size_t)b * group + c]);
            for (int j = 0; j < 8; j++)
                for (int t = 0; t < 4; t++)
                    o[b * QK + 4 * j + t] = db * (float)gq[(size_t)b * group * 32 + (size_t)j * group * 4 + c * 4 + t];
        }
    }
}

// ------------------------------------------------------------------------------------------------------------
// The duet mode (duet.c): the products above, their column groups in chunks shared by the caller and a helper
// ------------------------------------------------------------------------------------------------------------
// Chunks per product: each claim is a compare-and-swap on a line both cores write, and 32 chunks made the quiet
// duet step 1.2x the OpenMP one at a 32-token context where 8 make it 1.04x (2-vCPU Xeon). A stolen chunk is
// then 1/8 of a product done twice.
#define DUET_CHUNKS 8

typedef struct {
    int kind, M, K, N, ng, per_chunk, chunks;  // kind: decoder.h's BLin kinds; per_chunk: column groups per chunk
    const void *qs;
    const uint16_t *d;
    const void *aux;
    const int8_t *qx, *qxu;
    const float *dx, *sx;
} DuetGemm;

static void duet_group(const DuetGemm *a, int g, float *y) {  // column group g, all rows, to y [M, N]
    const int nb = a->K / QK;
    switch (a->kind) {
        case 0: q8_0_group(a->qx, a->qxu, a->dx, a->M, nb, a->qs, a->d, a->aux, a->N, g, y, a->N, g * GW); break;
        case 1: q4_1_group(a->qx, a->dx, a->sx, a->M, nb, a->qs, a->d, a->aux, a->N, g, y); break;
        default: kq_group_kind(a->kind, a->qx, a->dx, a->sx, a->M, a->K, a->qs, a->N, g, y);
    }
}

static void duet_gemm_chunk(const void *args, int c, float *y) {
    const DuetGemm *a = args;
    const int g1 = (c + 1) * a->per_chunk < a->ng ? (c + 1) * a->per_chunk : a->ng;
    for (int g = c * a->per_chunk; g < g1; g++) duet_group(a, g, y);
}

// The activations quantized (as each *_team does) into the runtime's own code buffer, the product described
static int duet_prepare(DuetGemm *a, int kind, const float *x, int M, int K, const void *qs, const uint16_t *d,
                        const void *aux, int N) {
    const size_t nb = (size_t)M * K / QK;
    unsigned char *buf = duet_codes(2 * (size_t)M * K + 2 * nb * sizeof(float) + 128);
    if (!buf) return 0;
    int8_t *qx = (int8_t *)buf, *qxu = qx + (size_t)M * K;
    float *dx = (float *)(((uintptr_t)(qxu + (size_t)M * K) + 63) & ~(uintptr_t)63), *sx = dx + nb;
    if (kind == 0) quantize_rows(x, M, K, qx, dx, NULL, HAVE_VNNI ? qxu : NULL, NULL);
    else if (kind == 1) quantize_rows(x, M, K, qx, dx, sx, NULL, NULL);
    else kq_quantize(kind, x, M, K, qx, dx, sx);
    const int ng = (N + GW - 1) / GW;
    const int per_chunk = (ng + DUET_CHUNKS - 1) / DUET_CHUNKS;
    *a = (DuetGemm){kind, M, K, N, ng, per_chunk, (ng + per_chunk - 1) / per_chunk, qs, d, aux, qx, qxu, dx, sx};
    return 1;
}

static int duet_gemm(int kind, const float *x, int M, int K, const void *qs, const uint16_t *d, const void *aux,
                     int N, float *y) {
    DuetGemm a;
    if ((long)N * K < PAR_MIN || !duet_begin()) return 0;  // small: the caller alone (a hand-off costs more)
    int ok = duet_prepare(&a, kind, x, M, K, qs, d, aux, N);
    if (ok) ok = duet_columns(duet_gemm_chunk, &a, sizeof a, a.chunks, a.per_chunk * GW, M, N, y);
    duet_end();
    return ok;
}

int duet_block_linear(const BLin *l, const float *x, int M, float *y) {
    return duet_gemm(l->kind, x, M, l->K, l->qs, l->d, l->aux, l->N, y);
}

// chunk c of the lm_head's argmax: its rows' best over its columns, in column order (q8_0_gemm_argmax's rule)
static void duet_argmax_chunk(const void *args, int c, float *out) {
    const DuetGemm *a = args;
    float best[ARGMAX_ROWS];
    int64_t index[ARGMAX_ROWS];
    for (int r = 0; r < a->M; r++) best[r] = 0.0f, index[r] = -1;
    const int g1 = (c + 1) * a->per_chunk < a->ng ? (c + 1) * a->per_chunk : a->ng;
    for (int g = c * a->per_chunk; g < g1; g++)
        argmax_group(a->qx, a->qxu, a->dx, a->M, a->K / QK, a->qs, a->d, a->aux, a->N, g, best, index);
    DuetBest *bests = (DuetBest *)out + (size_t)c * a->M;
    for (int r = 0; r < a->M; r++) bests[r] = (DuetBest){best[r], index[r]};
}

static int duet_q8_0_argmax(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws,
                            int N, int64_t *out) {
    DuetGemm a;
    if (M > ARGMAX_ROWS || !duet_begin()) return 0;
    int ok = duet_prepare(&a, 0, x, M, K, qs, d, ws, N);
    if (ok) ok = duet_argmax(duet_argmax_chunk, &a, sizeof a, a.chunks, M, out);
    duet_end();
    return ok;
}
