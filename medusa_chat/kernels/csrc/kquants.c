// GGUF K-quant weights (Q4_K, Q5_K, Q6_K) on the block kernel, in the file's own arithmetic: no second rounding.
//
// A K-quant superblock holds 256 weights along k with fp16 factors and small integer scales per sub-block
// (ggml-common.h; gguf_linears.py unpacks the file's bit layout):
//   Q4_K / Q5_K: 8 sub-blocks of 32, w = (d * sc) * q - (dmin * m), sc and m 6-bit, q 0..15 / 0..31
//   Q6_K: 16 sub-blocks of 16, w = (d * sc) * (q - 32), sc int8, q 0..63
// The kernel keeps the compact codes (bytes) and fp16 d per superblock, as the file does: the weights streamed
// per step stay near the file's size (a step is memory bound at batch 1).
//
// The activations are 8-bit, in one of three schemes (mc_kq_scheme, set when the library loads, before any
// product, from MEDUSA_CHAT_KQUANT_ACTIVATIONS: cbind.kquant_scheme; the plain loop and the tree steps share it):
// - 32 (the default): the blocks of 32 of qgemm.c's formats (team.c, quantize_rows). Each sub-block's dot
//   product is an exact integer sum, then per row and sub-block the exact fp32 factors:
//   acc = fma((d * sc) * dx, dot, acc), and the minimum.
// - the superblock schemes (quantize_k_rows below): per row and superblock one fp32 step dk, and per sub-block of
//   32 an integer multiplier m_j (1..16), the codes standing for dk * m_j * q. A superblock's sum is then one
//   integer: the sub-blocks' dot products times sc_j * m_j, summed in int32, and the minimum (or Q6_K's -32)
//   term the same way from the activations' code sums per 16 (times m_j). The fp32 factors apply once per
//   superblock and row:
//     Q4_K / Q5_K: acc = fma(d * dk, sum_j sc_j m_j dot_j, acc);  acc = fnmadd(dmin * dk, sum_j mn_j m_j sum(qx_j), acc)
//     Q6_K:        acc = fma(d * dk, sum_k sc_k m_k dot_k - 32 * sum_k sc_k m_k sum(qx_k), acc)
//   256: every m_j = 16, one scale per superblock: llama.cpp's Q8_K, the scheme its K-quant dot products use.
//   nested: m_j = ceil(16 * max|x_j| / max|x|): per 32 in 16ths of the superblock's step, so a sub-block of
//   small values beside an outlier keeps most of its resolution.
// The trade, measured (benchmarks/RESULTS.md, 1.17B Q4_K_M, a Zen 4): the superblock schemes spare each row a
// conversion and three fp32 operations per sub-block for a 16-bit multiply (AVX2 takes sc_j * m_j in the
// multiply-add that widens its 16-bit sums): products in cache 1.01-1.12x faster than per 32 on AVX2 (Q4_K), 2-7%
// slower with VNNI (sc_j * m_j is one more multiply per row and sub-block; the 8 dot-product instructions per
// row and sub-block are most of the work); whole tree steps of 1-8 nodes within the machine's noise of per 32
// on AVX2 (0.91-1.09x), and per 32 up to 1.09x faster at 4-8 nodes with VNNI. KL to the float model: per 32
// 0.00059, nested 0.00065, 256 0.00123 (llama.cpp's own figure on the same file). So 32 is the default.
// In all, every integer sum is exact and the fp32 operations are in a fixed order per row: row-invariant, and
// every build gives the same bits.
//
// Layout (gguf_linears.py writes it): output columns in interleaved groups of GW as in qgemm.c, and per group
// one byte stream, superblock after superblock (so one stream to prefetch per group):
//   Q4_K, 148 * GW bytes: 8 sub-blocks of 16 * GW code bytes (qgemm.c's Q4_1 vectors: vector j, column c,
//         bytes 4c..4c+3 = elements 4j..4j+3 in the low nibbles, 16+4j.. in the high), then sc[8][GW],
//         m[8][GW] (bytes), d[GW], dmin[GW] (fp16)
//   Q5_K, 180 * GW: per sub-block the 16 * GW code bytes, then GW 32-bit words of 5th bits (element 4j+t at
//         bit 8t+j, element 16+4j+t at bit 8t+4+j: one shift and mask per vector puts them at bit 4); then as Q4_K
//   Q6_K, 210 * GW: per sub-block the 16 * GW code bytes, then 2 * GW words of the codes' bits 4-5: byte t of
//         column c's word p (p = 0, 1) holds, from bit 0, the 2 bits of elements 8p+t, 16+8p+t, 8p+4+t, 20+8p+t
//         (vector 2p's low and high element, then vector 2p+1's); then sc[16][GW] (int8, half-blocks in order),
//         d[GW] (fp16)
// Bytes per weight: Q4_K 4.625 bits (the file: 4.5; its 12 packed scale bytes are 16 here), Q5_K 5.625 (5.5),
// Q6_K 6.5625 (the same).
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "kquants.h"
#include "team.h"  // the team size, quantize_rows: kquants.c calls into team.c only (qgemm.c calls into this file)
#include "qblock.h"

// 8 bytes (per-column scales) widened to 32-bit lanes, unsigned or signed
static inline __m256i u8_32x8(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline __m256i i8_32x8(const uint8_t *p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }

// 256-bit tiles (8 columns)
#define KV_NAME(f) f##_8
#define KV_LANES 8
#define KV_VNNI HAVE_VNNI
#define KV_I __m256i
#define KV_F __m256
#define KV_LOAD(p) _mm256_loadu_si256((const __m256i *)(p))
#define KV_ZERO_I() _mm256_setzero_si256()
#define KV_ZERO_PS() _mm256_setzero_ps()
#define KV_SET1_8(c) _mm256_set1_epi8((char)(c))
#define KV_SET1_16(c) _mm256_set1_epi16(c)
#define KV_SET1_32(c) _mm256_set1_epi32(c)
#define KV_SET1_PS(f) _mm256_set1_ps(f)
#define KV_AND _mm256_and_si256
#define KV_OR _mm256_or_si256
#define KV_SRLI16 _mm256_srli_epi16
#define KV_SLLI16 _mm256_slli_epi16
#define KV_SLLI32 _mm256_slli_epi32
#define KV_SRLI32 _mm256_srli_epi32
#define KV_ADD16 _mm256_add_epi16
#define KV_ADD32 _mm256_add_epi32
#define KV_SUB32 _mm256_sub_epi32
#define KV_MADDUBS _mm256_maddubs_epi16
#define KV_MADD16 _mm256_madd_epi16
#define KV_MULLO32 _mm256_mullo_epi32
#define KV_MULLO16 _mm256_mullo_epi16
#define KV_DP(acc, u, s) DPBUSD(acc, u, s)
#define KV_DPB(acc, u, p) KV_DP(acc, u, KV_BCAST4(p))
#define KV_BCAST4 bcast4
#define KV_CVT_PS _mm256_cvtepi32_ps
#define KV_MUL_PS _mm256_mul_ps
#define KV_FMADD _mm256_fmadd_ps
#define KV_FNMADD _mm256_fnmadd_ps
#define KV_LOAD_F16 load_f16
#define KV_U8_32 u8_32x8
#define KV_I8_32 i8_32x8
#define KV_U8_PS(p) KV_CVT_PS(KV_U8_32(p))
#define KV_I8_PS(p) KV_CVT_PS(KV_I8_32(p))
#define KV_STORE store_cols
#include "kq_tile.h"
#undef KV_NAME
#undef KV_LANES
#undef KV_VNNI
#undef KV_I
#undef KV_F
#undef KV_LOAD
#undef KV_ZERO_I
#undef KV_ZERO_PS
#undef KV_SET1_8
#undef KV_SET1_16
#undef KV_SET1_32
#undef KV_SET1_PS
#undef KV_AND
#undef KV_OR
#undef KV_SRLI16
#undef KV_SLLI16
#undef KV_SLLI32
#undef KV_SRLI32
#undef KV_ADD16
#undef KV_ADD32
#undef KV_SUB32
#undef KV_MADDUBS
#undef KV_MADD16
#undef KV_MULLO32
#undef KV_MULLO16
#undef KV_DP
#undef KV_DPB
#undef KV_BCAST4
#undef KV_CVT_PS
#undef KV_MUL_PS
#undef KV_FMADD
#undef KV_FNMADD
#undef KV_LOAD_F16
#undef KV_U8_32
#undef KV_I8_32
#undef KV_U8_PS
#undef KV_I8_PS
#undef KV_STORE

#if HAVE_512
// 512-bit tiles: a whole group of 16 columns per register
static inline __m512i u8_32x16(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline __m512i i8_32x16(const uint8_t *p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#define KV_NAME(f) f##_16
#define KV_LANES 16
#define KV_VNNI 1
#define KV_I __m512i
#define KV_F __m512
#define KV_LOAD(p) _mm512_loadu_si512((const void *)(p))
#define KV_ZERO_I() _mm512_setzero_si512()
#define KV_ZERO_PS() _mm512_setzero_ps()
#define KV_SET1_8(c) _mm512_set1_epi8((char)(c))
#define KV_SET1_32(c) _mm512_set1_epi32(c)
#define KV_SET1_PS(f) _mm512_set1_ps(f)
#define KV_AND _mm512_and_si512
#define KV_OR _mm512_or_si512
#define KV_SRLI16 _mm512_srli_epi16
#define KV_SLLI16 _mm512_slli_epi16
#define KV_SLLI32 _mm512_slli_epi32
#define KV_SRLI32 _mm512_srli_epi32
#define KV_ADD32 _mm512_add_epi32
#define KV_SUB32 _mm512_sub_epi32
#define KV_MADD16 _mm512_madd_epi16
#define KV_MULLO32 _mm512_mullo_epi32
#define KV_MULLO16 _mm512_mullo_epi16
#define KV_DP(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define KV_DPB(acc, u, p) dpbusd_bcast512(acc, u, p)  // (qblock.h: the broadcast in the instruction)
#define KV_BCAST4 bcast4_512
#define KV_CVT_PS _mm512_cvtepi32_ps
#define KV_MUL_PS _mm512_mul_ps
#define KV_FMADD _mm512_fmadd_ps
#define KV_FNMADD _mm512_fnmadd_ps
#define KV_LOAD_F16 load_f16x16
#define KV_U8_32 u8_32x16
#define KV_I8_32 i8_32x16
#define KV_U8_PS(p) KV_CVT_PS(KV_U8_32(p))
#define KV_I8_PS(p) KV_CVT_PS(KV_I8_32(p))
#define KV_STORE store_cols16
#include "kq_tile.h"
#endif

// Stream bytes per superblock and column (the layout above)
#define SB_Q4K 148
#define SB_Q5K 180
#define SB_Q6K 210

// The superblock schemes' activation scratch (the callers' qx, dx, sx, sized as qgemm.c's: qx 2 * M * K bytes,
// dx and sx M * K / 32 floats), as quantize_k_rows fills it: qx the codes [M, K], then the sub-block multipliers
// [M, K / 32] as int32 (m | m << 16: the 16-bit pair the tiles multiply the weights' scales by); dx the
// superblock scales [M, K / 256] (fp32); sx the codes' sums per 16 times their sub-block's m [M, K / 16] (int16:
// |sum| <= 16 * 127, times m <= 16: <= 32512).
static inline const int32_t *kq_mults(const int8_t *qx, int M, int K) {
    return (const int32_t *)(qx + (size_t)M * K);
}

// x [M, K] (K % 256 == 0) to 8-bit codes per row and superblock of 256 (both superblock schemes; per row, so
// row-invariant). A = max|x| over the superblock, dk = A / 2032 (= A / 127 / 16), and per sub-block j of 32 an
// integer multiplier m_j in 1..16: its codes are q = round(x * (1 / (dk * m_j))) (the FPU's round-to-nearest-even,
// as quantize_rows), the activation it stands for dk * m_j * q.
// - KQ_NESTED: m_j = ceil(16 * a_j / A), a_j = max|x| over the sub-block: the smallest step that keeps |q| <=
//   127, so a sub-block of small values keeps most of its own resolution (a scale per 32 in 16ths of the
//   superblock's) while every sub-block's sum stays an integer multiple of dk.
// - KQ_PER256: m_j = 16, one scale A / 127 for the whole superblock: llama.cpp's Q8_K, bit for bit.
// Superblocks are shared among the team that calls this (an orphaned worksharing loop, as quantize_rows).
static void quantize_k_rows(const float *x, int M, int K, int8_t *q, float *dk, int16_t *s16, const int nested) {
    const int nsb = K / 256;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int32_t *mults = (int32_t *)(q + (size_t)M * K);
#pragma omp for collapse(2) schedule(static)
    for (int r = 0; r < M; r++) {
        for (int s = 0; s < nsb; s++) {
            const float *xs = x + (size_t)r * K + (size_t)s * 256;
            float a[8], A = 0.0f;
            for (int b = 0; b < 8; b++) {
                __m256 mx = _mm256_setzero_ps();
                for (int i = 0; i < 4; i++)
                    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xs + 32 * b + 8 * i)));
                a[b] = hmax8(mx);
                A = a[b] > A ? a[b] : A;
            }
            const float d = A / 2032.0f;
            dk[(size_t)r * nsb + s] = d;
            for (int b = 0; b < 8; b++) {
                int m = 16;
                if (nested && A != 0.0f) {
                    m = (int)ceilf(16.0f * a[b] / A);
                    m = m < 1 ? 1 : m > 16 ? 16 : m;
                }
                const float step = d * (float)m, id = step != 0.0f ? 1.0f / step : 0.0f;
                int32_t h0, h1;
                codes32(xs + 32 * b, _mm256_set1_ps(id), q + (size_t)r * K + (size_t)s * 256 + 32 * b, &h0, &h1);
                const size_t blk = ((size_t)r * nsb + s) * 8 + b;
                s16[2 * blk] = (int16_t)(h0 * m), s16[2 * blk + 1] = (int16_t)(h1 * m);
                mults[blk] = m | m << 16;
            }
        }
    }
}

// The activation scheme (KQ_PER32, KQ_PER256 or KQ_NESTED: kquants.h). Set before any product, never between a
// plain and a tree step.
static int mc_kq_scheme = KQ_PER32;
void mc_set_kq_scheme(int scheme) {
    mc_kq_scheme = scheme == KQ_PER256 || scheme == KQ_NESTED ? scheme : KQ_PER32;
}
int mc_get_kq_scheme(void) { return mc_kq_scheme; }

// The activations of a K-quant product of kind 2 (Q4_K), 3 (Q5_K) or 4 (Q6_K: decoder.h's BLin kinds) into the
// scratch its groups read: per 32, qgemm.c's (dx the scales, sx the scaled sums, or Q6_K's per-16 code sums as
// 2 int16 per float); per superblock, the layout above
void kq_quantize(int kind, const float *x, int M, int K, int8_t *qx, float *dx, float *sx) {
    if (mc_kq_scheme != KQ_PER32)
        quantize_k_rows(x, M, K, qx, dx, (int16_t *)sx, mc_kq_scheme == KQ_NESTED);
    else
        quantize_rows(x, M, K, qx, dx, kind == 4 ? NULL : sx, NULL, kind == 4 ? (int16_t *)sx : NULL);
}

// One column group g of a K-quant product, all M rows (HB: Q5_K's 5th bits; Q6: the Q6_K tile)
static inline __attribute__((always_inline)) void kq_group(const int8_t *qx, const float *dx, const float *sx,
                                                            int M, int nsb, const uint8_t *w, int N, int g,
                                                            float *y, const int HB, const int Q6) {
    const size_t sb_bytes = Q6 ? SB_Q6K : HB ? SB_Q5K : SB_Q4K;
    const uint8_t *gw = w + (size_t)g * nsb * sb_bytes * GW;
    const int16_t *s16 = (const int16_t *)sx;
    const int32_t *mm = kq_mults(qx, M, 256 * nsb);
    const int sb = mc_kq_scheme != KQ_PER32;
#if HAVE_512
#define KQ(MRc)                                                                            \
    if (Q6 && sb) k6_tile_sb_16(qx, dx, s16, mm, nsb, r0, gw, 0, y, N, g * GW, MRc);            \
    else if (Q6) k6_tile_16(qx, dx, s16, nsb, r0, gw, 0, y, N, g * GW, MRc);                \
    else if (sb) kmin_tile_sb_16(qx, dx, s16, mm, nsb, r0, gw, 0, y, N, g * GW, MRc, HB);       \
    else kmin_tile_16(qx, dx, sx, nsb, r0, gw, 0, y, N, g * GW, MRc, HB)
    ROW_TILES(KQ)
#undef KQ
#else
    for (int h = 0; h < GW / GC && g * GW + h * GC < N; h++) {
#define KQ(MRc)                                                                            \
    if (Q6 && sb) k6_tile_sb_8(qx, dx, s16, mm, nsb, r0, gw, h, y, N, g * GW + GC * h, MRc);    \
    else if (Q6) k6_tile_8(qx, dx, s16, nsb, r0, gw, h, y, N, g * GW + GC * h, MRc);        \
    else if (sb) kmin_tile_sb_8(qx, dx, s16, mm, nsb, r0, gw, h, y, N, g * GW + GC * h, MRc, HB); \
    else kmin_tile_8(qx, dx, sx, nsb, r0, gw, h, y, N, g * GW + GC * h, MRc, HB)
        ROW_TILES(KQ)
#undef KQ
    }
#endif
}

// The products as team work (as qgemm.c's *_team): x [M, K] fp32, K a multiple of 256; w: ceil(N / GW) groups
// of K / 256 superblocks; y [M, N]; scratch as described above.
static void kq_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                         float *sx, const int HB, const int Q6) {
    const int nsb = K / 256, ng = (N + GW - 1) / GW;
    kq_quantize(Q6 ? 4 : HB ? 3 : 2, x, M, K, qx, dx, sx);
#pragma omp for schedule(static)
    for (int g = 0; g < ng; g++) {
        if (Q6)
            kq_group(qx, dx, sx, M, nsb, w, N, g, y, 0, 1);
        else if (HB)
            kq_group(qx, dx, sx, M, nsb, w, N, g, y, 1, 0);
        else
            kq_group(qx, dx, sx, M, nsb, w, N, g, y, 0, 0);
    }
}

void q4_k_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                    float *sx) {
    kq_gemm_team(x, M, K, w, N, y, qx, dx, sx, 0, 0);
}
void q5_k_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                    float *sx) {
    kq_gemm_team(x, M, K, w, N, y, qx, dx, sx, 1, 0);
}
void q6_k_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                    float *sx) {
    kq_gemm_team(x, M, K, w, N, y, qx, dx, sx, 0, 1);
}

// ggml's get_scale_min_k4: the 6-bit scale and minimum of sub-block j from a Q4_K / Q5_K block's 12 bytes
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = q[j] & 63, *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// The file's K-quant blocks -> the stream described at the top (type 0 = Q4_K, 1 = Q5_K, 2 = Q6_K). raw: rows x
// K / 256 blocks as stored (ggml-common.h); out: ceil(rows / group) groups of K / 256 superblocks, rows past
// `rows` zero. A load repacks ~1e9 weights this way; gguf_linears.interleave_k is the same in numpy (the tests
// compare them byte for byte). Groups are independent: shared among the team.
void kq_repack(int type, const uint8_t *raw, int rows, int K, int group, uint8_t *out) {
    static const int block_bytes[3] = {144, 176, 210}, sb_bytes[3] = {SB_Q4K, SB_Q5K, SB_Q6K}, sub[3] = {16, 20, 24};
    const int nsb = K / 256, ng = (rows + group - 1) / group, G = group, SUB = sub[type] * G;
    const size_t SBB = (size_t)sb_bytes[type] * G;
#pragma omp parallel for schedule(static) num_threads(mc_team())
    for (int g = 0; g < ng; g++) {
        for (int s = 0; s < nsb; s++) {
            uint8_t *o = out + ((size_t)g * nsb + s) * SBB, *tail = o + 8 * SUB;
            memset(o, 0, SBB);
            for (int c = 0; c < G && g * G + c < rows; c++) {
                const uint8_t *blk = raw + ((size_t)(g * G + c) * nsb + s) * block_bytes[type];
                uint8_t q[256];
                if (type == 2) {  // ql[128], qh[64], int8 scales[16], fp16 d
                    for (int h = 0; h < 2; h++)
                        for (int k = 0; k < 4; k++)
                            for (int i = 0; i < 32; i++)
                                q[128 * h + 32 * k + i] = ((blk[64 * h + 32 * (k & 1) + i] >> (4 * (k >> 1))) & 0xF) |
                                                          (((blk[128 + 32 * h + i] >> (2 * k)) & 3) << 4);
                    for (int k = 0; k < 16; k++) tail[G * k + c] = blk[192 + k];
                    memcpy(tail + 16 * G + 2 * c, blk + 208, 2);
                } else {  // fp16 d, fp16 dmin, scales[12], (Q5_K: qh[32]), qs[128]
                    const uint8_t *qs = blk + (type == 0 ? 16 : 48);
                    for (int i = 0; i < 4; i++)
                        for (int e = 0; e < 32; e++)
                            q[64 * i + e] = qs[32 * i + e] & 0xF, q[64 * i + 32 + e] = qs[32 * i + e] >> 4;
                    if (type == 1)
                        for (int j = 0; j < 8; j++)
                            for (int e = 0; e < 32; e++) q[32 * j + e] |= ((blk[16 + e] >> j) & 1) << 4;
                    for (int j = 0; j < 8; j++) scale_min_k4(j, blk + 4, &tail[G * j + c], &tail[8 * G + G * j + c]);
                    memcpy(tail + 16 * G + 2 * c, blk, 2);
                    memcpy(tail + 18 * G + 2 * c, blk + 2, 2);
                }
                for (int j = 0; j < 8; j++) {
                    uint8_t *sb = o + (size_t)j * SUB;
                    const uint8_t *qj = q + 32 * j;
                    for (int jj = 0; jj < 4; jj++)
                        for (int t = 0; t < 4; t++)
                            sb[G * 4 * jj + 4 * c + t] = (qj[4 * jj + t] & 0xF) | ((qj[16 + 4 * jj + t] & 0xF) << 4);
                    if (type == 1) {  // Q5_K: the 5th bits
                        uint32_t w = 0;
                        for (int e = 0; e < 32; e++)
                            w |= (uint32_t)((qj[e] >> 4) & 1) << (8 * (e & 3) + 4 * (e >> 4) + ((e & 15) >> 2));
                        memcpy(sb + G * 16 + 4 * c, &w, 4);
                    } else if (type == 2) {  // Q6_K: bits 4-5, two words
                        uint32_t w[2] = {0, 0};
                        for (int e = 0; e < 32; e++) {
                            const int jj = (e & 15) >> 2;
                            w[jj >> 1] |= (uint32_t)((qj[e] >> 4) & 3) << (8 * (e & 3) + 2 * (2 * (jj & 1) + (e >> 4)));
                        }
                        memcpy(sb + G * 16 + 4 * c, &w[0], 4);
                        memcpy(sb + G * 20 + 4 * c, &w[1], 4);
                    }
                }
            }
        }
    }
}

// Rows of a K-quant linear's weight, dequantized exactly as ggml / gguf-py do (fp32: (d * sc) * q - dmin * m, or
// (d * sc) * (q - 32); each product exact or rounded once, as theirs): out[i] = row ids[i] (K floats). The token
// embedding of a K-quant GGUF is looked up this way (gguf_linears.KQuantEmbedding), never held in fp32.
void kq_rows(int type, const uint8_t *w, int K, int group, const int64_t *ids, int n, float *out) {
    static const int sb_bytes[3] = {SB_Q4K, SB_Q5K, SB_Q6K}, sub[3] = {16, 20, 24};
    const int nsb = K / 256, G = group, SUB = sub[type] * G;
    const size_t SBB = (size_t)sb_bytes[type] * G;
    for (int i = 0; i < n; i++) {
        const int64_t g = ids[i] / G, c = ids[i] % G;
        float *o = out + (size_t)i * K;
        for (int s = 0; s < nsb; s++) {
            const uint8_t *sb = w + ((size_t)g * nsb + s) * SBB, *tail = sb + 8 * SUB;
            uint16_t dh, mh;
            memcpy(&dh, tail + 16 * G + 2 * c, 2);
            memcpy(&mh, tail + 18 * G + 2 * c, 2);  // Q6_K: unused
            const float d = _cvtsh_ss(dh), dmin = _cvtsh_ss(mh);
            for (int j = 0; j < 8; j++) {
                const uint8_t *sj = sb + (size_t)j * SUB;
                uint32_t hw[2] = {0, 0};
                if (type >= 1) memcpy(&hw[0], sj + G * 16 + 4 * c, 4);
                if (type == 2) memcpy(&hw[1], sj + G * 20 + 4 * c, 4);
                for (int e = 0; e < 32; e++) {
                    const int jj = (e & 15) >> 2, t = e & 3;
                    const uint8_t byte = sj[G * 4 * jj + 4 * c + t];
                    int q = e < 16 ? byte & 0xF : byte >> 4;
                    if (type == 1)
                        q |= (int)((hw[0] >> (8 * t + 4 * (e >> 4) + jj)) & 1) << 4;
                    else if (type == 2)
                        q |= (int)((hw[jj >> 1] >> (8 * t + 2 * (2 * (jj & 1) + (e >> 4)))) & 3) << 4;
                    float v;
                    if (type == 2) {
                        const float a = d * (float)(int8_t)tail[G * (2 * j + (e >> 4)) + c];
                        v = a * (float)(q - 32);
                    } else {
                        const float a = d * (float)tail[G * j + c], b = dmin * (float)tail[8 * G + G * j + c];
                        v = a * (float)q - b;
                    }
                    o[256 * s + 32 * j + e] = v;
                }
            }
        }
    }
}

// Column group g of a K-quant product (type 2 Q4_K, 3 Q5_K, 4 Q6_K: decoder.h's BLin kinds), all M rows, to y
// [M, N]: the duet runtime's chunks (qgemm.c, duet_block_linear)
void kq_group_kind(int kind, const int8_t *qx, const float *dx, const float *sx, int M, int K, const uint8_t *w,
                   int N, int g, float *y) {
    const int nsb = K / 256;
    if (kind == 4)
        kq_group(qx, dx, sx, M, nsb, w, N, g, y, 0, 1);
    else if (kind == 3)
        kq_group(qx, dx, sx, M, nsb, w, N, g, y, 1, 0);
    else
        kq_group(qx, dx, sx, M, nsb, w, N, g, y, 0, 0);
}
