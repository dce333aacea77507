// What the block kernels' C files share (qgemm.c: Q4_1 / Q8_0, kquants.c: Q4_K / Q5_K / Q6_K): the interleaved
// layout's sizes, the instruction-set switches and the small vector helpers. See qgemm.c for the why of each.
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define QK 32
#define GC 8    // output columns per 256-bit tile (one 8-lane vector)
// Output columns per interleaved group (the layout, block_linears.py reads it from qgemm_group()): 16 where 512-bit
// tiles take a whole group per instruction; else 8, one 256-bit tile (a 16-wide layout read half by half
// streamed worse from DRAM on AVX2: the second half's compute no longer overlapped the loads)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GW 16
#else
#define GW 8
#endif
#define TR 4    // rows per tile: the unpacked weight registers plus one accumulator per row fit the registers
#define PAR_MIN (1L << 18)  // smaller products run on one thread: a parallel region costs more than it saves

// Software prefetch of the weight stream, this many bytes ahead of the block being read. A decoding step reads
// ~100 MB of weights (the backbone, the lm_head, the drafter), more than a small machine's share of the L3, so
// they stream from DRAM every step; the hardware prefetcher alone left the kernel at ~24 GB/s there, and an extra
// tree row's arithmetic then came on top of the stream instead of under it. Measured on the 2-vCPU Xeon, one
// step's projections of SmolLM2-135M in one parallel region (benchmarks/step_gemms.c at commit 4e8dc55): weights from DRAM, 1 / 2 /
// 3 rows 5.5 / 6.2 / 6.6 ms -> 3.4 / 3.5 / 3.8 ms; from L3 1.41 / 1.46 / 1.62 -> 1.32 / 1.37 / 1.42 ms (4 KB
// ahead: a little faster at 1 row, slower at 3; 16 KB: slower). A prefetch is a hint: the arithmetic, so the
// bits, are unchanged. (It must stay inlined: GCC deletes calls to a function that only prefetches.)
#ifndef PF_AHEAD  // benchmarks/step_gemms.c at commit 4e8dc55 builds with -DPF_AHEAD=0 for the before
#define PF_AHEAD 8192
#endif
//
// Which cache level the prefetches fill is chosen by measuring, per kernel family and per tile of one row or of
// more (mc_pf_hint, set by prefetch.py's choose_prefetch from a stream of weights larger than the L3, timed on this
// machine once and cached): on the 2-vCPU AMD EPYC (Zen 4) a prefetch into L1 (prefetcht0) held a core to ~15 GB/s
// on the Q4_K stream (the L1's few outstanding misses) where one into L2 (prefetcht1) let it stream at ~25 GB/s and
// kept the extra rows' arithmetic under the stream (one thread, 8 layers of the 1.17B's Q4_K projections from
// DRAM, 1 / 2 / 4 rows: 13.9 / 15.3 / 18.3 -> 8.4 / 8.7 / 11.8 ms). The default, until measured, is prefetcht0.
enum { PF_T0 = 0, PF_T1 = 1, PF_T2 = 2, PF_OFF = 3 };
enum { PF_FAM_Q4_1 = 0, PF_FAM_Q8_0 = 1, PF_FAM_KQ = 2 };
extern int mc_pf_hint[3][2];  // [family][tile of one row, of more]
static inline __attribute__((always_inline)) void prefetch_lines(const void *p, const int bytes, const int hint) {
    if (hint == PF_T0) {
#pragma GCC unroll 8
        for (int b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 3);
    } else if (hint == PF_T1) {
#pragma GCC unroll 8
        for (int b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 2);
    } else if (hint == PF_T2) {
#pragma GCC unroll 8
        for (int b = 0; b < bytes; b += 64) __builtin_prefetch((const char *)p + b, 0, 1);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAVE_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#elif defined(__AVXVNNI__)
#define HAVE_VNNI 1
#define DPBUSD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
#else
#define HAVE_VNNI 0
#endif

// The activations' 8-bit quantization, shared by team.c's quantize_rows (a scale per 32) and kquants.c's
// quantize_k_rows (per 256): the largest |x| of 8 lanes (exact in any order), and one block of 32 values to codes
// q = round(x * id) (the FPU's round-to-nearest-even; |x * id| <= 127 by the choice of id, so packs never
// saturate), stored in element order, with the exact integer sums of its two halves of 16.
static inline float hmax8(__m256 v) {
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    return _mm_cvtss_f32(m4);
}
static inline int32_t hsum8_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}
static inline __m256i codes32(const float *xb, __m256 vid, int8_t *q, int32_t *half0, int32_t *half1) {
    const __m256i perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo packs' per-lane interleave
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb), vid));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 8), vid));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 16), vid));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xb + 24), vid));
    *half0 = hsum8_epi32(_mm256_add_epi32(i0, i1));
    *half1 = hsum8_epi32(_mm256_add_epi32(i2, i3));
    const __m256i codes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3)), perm);
    _mm256_storeu_si256((__m256i *)q, codes);
    return codes;
}

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// 8 fp16 values (the blocks' scales, stored as in the file) to fp32: exact
static inline __m256 load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

static inline void store_cols(float *out, __m256 v, int w) {
    if (w == GC) {
        _mm256_storeu_ps(out, v);
    } else {
        float t[GC];
        _mm256_storeu_ps(t, v);
        for (int c = 0; c < w; c++) out[c] = t[c];
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// 512-bit tiles: a whole group of 16 columns per register, per lane exactly the 256-bit tiles' arithmetic
// (same integer sums, same FMAs in the same order), so the results are bitwise theirs. Half the instructions
// per multiply-add: a tree step's extra rows are compute, not memory, and cost that much less.
#define HAVE_512 1
static inline __m512i bcast4_512(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
// acc + dpbusd(u, the 4 signed bytes at p in every lane): the same instruction as _mm512_dpbusd_epi32(acc, u,
// bcast4_512(p)), so the same bits, with the broadcast folded into its memory operand ({1to16}). GCC 12 emits a
// vpbroadcastd apart for every one (it has no broadcast form of vpdpbusd): a row's work per 32-weight block was
// 20 512-bit ops instead of 12. Measured on the 2-vCPU EPYC Zen 4, one thread (benchmarks/lib_ab.py): Q4_1
// products in cache 2-3 rows 1.10-1.13x faster, 1 row 1.02-1.06x; the embedded model's C step 2 / 3 / 4 rows
// 1.04 / 1.07 / 1.04x, 1 row unchanged. (The unsigned operand cannot be the memory one: Q8_0's stays apart.)
typedef int32_t __attribute__((may_alias, aligned(1))) i32_any;
static inline __attribute__((always_inline)) __m512i dpbusd_bcast512(__m512i acc, __m512i u, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const i32_any *)p));
    return acc;
}

static inline __m512 load_f16x16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

static inline void store_cols16(float *out, __m512 v, int w) {
    if (w == GW)
        _mm512_storeu_ps(out, v);
    else
        _mm512_mask_storeu_ps(out, (__mmask16)((1u << w) - 1), v);
}
#else
#define HAVE_512 0
#endif

#define ROW_TILES(CALL)                                                     \
    for (int r0 = 0; r0 < M; r0 += TR) {                                    \
        switch (M - r0 < TR ? M - r0 : TR) {                                \
            case 1: CALL(1); break;                                         \
            case 2: CALL(2); break;                                         \
            case 3: CALL(3); break;                                         \
            default: CALL(4); break;                                        \
        }                                                                   \
    }

