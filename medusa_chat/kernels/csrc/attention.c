// Exact tree attention for the decoder step (decoder.c): row r attends to the keys [0, start) then its own list
// of block slots (its tree path root .. itself, or 0 .. r in a causal block). Each score is one fixed dot
// product; the softmax sum and the weighted sum of values run over that key sequence in order, so a tree node
// at depth d sees exactly the key sequence, and gets exactly the bits, of the plain step at position start + d.
// Work is split across threads by rows, heads and key ranges, never inside one row's reduction.
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"
#include "attention.h"

// q . k, hd % 8 == 0 (checked by the caller)
static inline float dot(const float *q, const kv_t *k, int hd) {
    __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q), load_kv(k));
    for (int i = 8; i < hd; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load_kv(k + i), acc);
    return hsum8(acc);
}

// dot(q, k_i) for 8 consecutive keys (converted to fp32: k .. k + 7 * hd), each bit for bit what `dot` gives: the same FMA chain
// per key, then the 8 horizontal sums done side by side in hsum8's order (lanes i + (i + 4) first, then
// pairs, then the two halves; see simd.h), so a key scores the same whether it is scored here (a cached
// prefix key) or by `dot` (a key of the current block).
static inline __m256 hsum8x8(const __m256 *a) {
    // c[i] = [lo(a_i) + hi(a_i) | lo(a_{i+4}) + hi(a_{i+4})]
    __m256 c[4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++)
        c[i] = _mm256_add_ps(_mm256_permute2f128_ps(a[i], a[i + 4], 0x20), _mm256_permute2f128_ps(a[i], a[i + 4], 0x31));
    // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7]
    return _mm256_hadd_ps(_mm256_hadd_ps(c[0], c[1]), _mm256_hadd_ps(c[2], c[3]));
}

static inline __m256 dot8(const float *q, const float *k, int hd) {
    __m256 a[8];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) a[i] = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(k + (size_t)i * hd));
    for (int e = 8; e < hd; e += 8) {
        const __m256 qe = _mm256_loadu_ps(q + e);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qe, _mm256_loadu_ps(k + (size_t)i * hd + e), a[i]);
    }
    return hsum8x8(a);
}

#if defined(__AVX512F__)
// 512-bit attention (AVX-512 builds): the same per-lane arithmetic with half the instructions, so the same bits.
// Scores: two keys share a register, key 2p in the low 8 lanes and key 2p + 1 in the high 8, against the query
// chunk copied into both halves; per key that is dot8's 8-lane FMA chain exactly, and the halves go through
// the same hsum8x8. The 8 keys are converted once into that pair layout: chunk c of pair p at (c * 4 + p) * 16.
// Measured on a 2-vCPU Xeon (AVX-512), step latency at a 2000-token context: 3 nodes 12.5 -> 11.9 ms, 4 nodes
// 13.8 -> 13.1 ms (1 node: unchanged within noise); a test pins the bits against
// the AVX2 build.
#define HAVE_ATT512 1
static inline __m512 dup8(const float *p) {  // 8 floats into both halves (broadcast_f64x4: AVX512F only)
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(p))));
}

static inline void keys8_pairs(const kv_t *k16, int hd, float *kp) {
    for (int c = 0; c < hd / 8; c++)
        for (int p = 0; p < 4; p++) {
            const __m256i two = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(k16 + (size_t)(2 * p) * hd + 8 * c))),
                _mm_loadu_si128((const __m128i *)(k16 + (size_t)(2 * p + 1) * hd + 8 * c)), 1);
            _mm512_storeu_ps(kp + (size_t)(c * 4 + p) * 16, _mm512_cvtph_ps(two));
        }
}

static inline __m256 hsum_pairs(const __m512 *a) {
    __m256 b[8];
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        b[2 * p] = _mm512_castps512_ps256(a[p]);
        b[2 * p + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[p]), 1));
    }
    return hsum8x8(b);
}

// dot8 (bitwise) for NQ queries at once on pair-layout keys
static inline __attribute__((always_inline)) void dot8_pairs(const float *const *q, const float *kp, int hd,
                                                             __m256 *out, const int NQ) {
    __m512 a[2][4];
#pragma GCC unroll 2
    for (int u = 0; u < NQ; u++) {
        const __m512 q0 = dup8(q[u]);
#pragma GCC unroll 4
        for (int p = 0; p < 4; p++) a[u][p] = _mm512_mul_ps(q0, _mm512_loadu_ps(kp + (size_t)p * 16));
    }
    for (int c = 1; c < hd / 8; c++) {
        const float *kc = kp + (size_t)c * 64;
#pragma GCC unroll 2
        for (int u = 0; u < NQ; u++) {
            const __m512 qc = dup8(q[u] + 8 * c);
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) a[u][p] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(kc + (size_t)p * 16), a[u][p]);
        }
    }
#pragma GCC unroll 2
    for (int u = 0; u < NQ; u++) out[u] = hsum_pairs(a[u]);
}
#else
#define HAVE_ATT512 0
#endif

// max(s[0 .. n)): vector lanes, then the tail. A max is exact, so it is the same whatever the order.
static inline float max_of(const float *s, int n) {
    __m256 v = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(s + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float mx = _mm_cvtss_f32(m4);
    for (; j < n; j++) mx = s[j] > mx ? s[j] : mx;
    return mx;
}

static inline __attribute__((always_inline)) void weighted_values(const WPair *pr, int start, const int *blk,
                                                                   const int *blen, int stride, const kv_t *vh,
                                                                   int hd, int d0, const int W, const int P) {
#if HAVE_ATT512
    if (W == 2) {  // 16 dims in one register: each lane's FMA sequence is the one below, so the same bits
        __m512 acc[4];
#pragma GCC unroll 4
        for (int i = 0; i < P; i++) acc[i] = _mm512_setzero_ps();
        for (int jj = 0; jj < start; jj++) {
            _mm_prefetch((const char *)(vh + (size_t)(jj + PF_VALUES) * hd + d0), _MM_HINT_T0);
            const __m512 vv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(vh + (size_t)jj * hd + d0)));
#pragma GCC unroll 4
            for (int i = 0; i < P; i++) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(pr[i].p[jj]), vv, acc[i]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < P; i++) {
            const int nb = block_len(blen, pr[i].row);
            for (int b = 0; b < nb; b++) {
                const kv_t *v = vh + (size_t)(start + block_slot(blk, stride, pr[i].row, b)) * hd + d0;
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(pr[i].p[start + b]),
                                         _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)v)), acc[i]);
            }
            _mm512_storeu_ps(pr[i].o + d0, _mm512_mul_ps(acc[i], _mm512_set1_ps(pr[i].inv)));
        }
        return;
    }
#endif
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int i = 0; i < P; i++)
#pragma GCC unroll 2
        for (int u = 0; u < W; u++) acc[i][u] = _mm256_setzero_ps();
    for (int jj = 0; jj < start; jj++) {
        const kv_t *v = vh + (size_t)jj * hd + d0;
        _mm_prefetch((const char *)(v + PF_VALUES * hd), _MM_HINT_T0);
        __m256 vv[2];
#pragma GCC unroll 2
        for (int u = 0; u < W; u++) vv[u] = load_kv(v + 8 * u);
#pragma GCC unroll 4
        for (int i = 0; i < P; i++) {
            const __m256 pj = _mm256_set1_ps(pr[i].p[jj]);
#pragma GCC unroll 2
            for (int u = 0; u < W; u++) acc[i][u] = _mm256_fmadd_ps(pj, vv[u], acc[i][u]);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < P; i++) {
        const int nb = block_len(blen, pr[i].row);
        for (int b = 0; b < nb; b++) {
            const kv_t *v = vh + (size_t)(start + block_slot(blk, stride, pr[i].row, b)) * hd + d0;
            const __m256 pj = _mm256_set1_ps(pr[i].p[start + b]);
#pragma GCC unroll 2
            for (int u = 0; u < W; u++) acc[i][u] = _mm256_fmadd_ps(pj, load_kv(v + 8 * u), acc[i][u]);
        }
        const __m256 vi = _mm256_set1_ps(pr[i].inv);
#pragma GCC unroll 2
        for (int u = 0; u < W; u++) _mm256_storeu_ps(pr[i].o + d0 + 8 * u, _mm256_mul_ps(acc[i][u], vi));
    }
}

void attend_chunk(const DModel *m, const float *qkv, int qkv_n, const kv_t *kc, const kv_t *vc,
                         size_t cap, int start, int r0, int R, const int *blk, const int *blen, int stride,
                         float *S, size_t s_stride, WPair *pairs, float *out, int kh0, int kh1) {
    const int hd = m->head_dim, nh = m->n_heads, G = nh / m->n_kv;
    const float scale = m->scale;
    // 1. scores against the shared prefix [0, start): each key is read once for every row and head of its group
    const int nj = (start + JB - 1) / JB;
#pragma omp for collapse(2) schedule(static)
    for (int kh = kh0; kh < kh1; kh++)
        for (int jb = 0; jb < nj; jb++) {
            const int j1 = (jb + 1) * JB < start ? (jb + 1) * JB : start;
            int j = jb * JB;
            for (; j + 8 <= j1; j += 8) {
                // the 8 keys in fp32 once (exact), for the G heads x R rows that score them
                float k[8 * MAX_HD];
                const kv_t *k16 = kc + ((size_t)kh * cap + j) * hd;
                for (int b = 0; b < 8 * hd * (int)sizeof(kv_t); b += 64)
                    _mm_prefetch((const char *)(k16 + PF_KEYS * hd) + b, _MM_HINT_T0);
                // queries t = (row r, query head g of this KV head): r = t / G, g = t % G
                const __m256 vs = _mm256_set1_ps(scale);
                int t = 0;
#if HAVE_ATT512
                keys8_pairs(k16, hd, k);
                for (; t < R * G; t += 2) {
                    const int nq = R * G - t < 2 ? 1 : 2;
                    const float *qs[2];
                    int rr[2], hh[2];
                    for (int u = 0; u < nq; u++) {
                        rr[u] = (t + u) / G, hh[u] = kh * G + (t + u) % G;
                        qs[u] = qkv + (size_t)(r0 + rr[u]) * qkv_n + hh[u] * hd;
                    }
                    __m256 d8[2];
                    if (nq == 2)
                        dot8_pairs(qs, k, hd, d8, 2);
                    else
                        dot8_pairs(qs, k, hd, d8, 1);
                    for (int u = 0; u < nq; u++)
                        _mm256_storeu_ps(S + ((size_t)rr[u] * nh + hh[u]) * s_stride + j, _mm256_mul_ps(d8[u], vs));
                }
#else
                for (int e = 0; e < 8 * hd; e += 8) _mm256_storeu_ps(k + e, load_kv(k16 + e));
                for (; t < R * G; t++) {
                    const int r = t / G, h = kh * G + t % G;
                    const __m256 d8 = dot8(qkv + (size_t)(r0 + r) * qkv_n + h * hd, k, hd);
                    _mm256_storeu_ps(S + ((size_t)r * nh + h) * s_stride + j, _mm256_mul_ps(d8, vs));
                }
#endif
            }
            for (; j < j1; j++) {
                const kv_t *k = kc + ((size_t)kh * cap + j) * hd;
                for (int r = 0; r < R; r++)
                    for (int g = 0; g < G; g++) {
                        const int h = kh * G + g;
                        S[((size_t)r * nh + h) * s_stride + j] = dot(qkv + (size_t)(r0 + r) * qkv_n + h * hd, k, hd) * scale;
                    }
            }
        }
    // 2. each row's block keys, 3. softmax weights (unnormalised) and their sum
#pragma omp for collapse(2) schedule(static)
    for (int r = 0; r < R; r++)
        for (int h = kh0 * G; h < kh1 * G; h++) {
            const int row = r0 + r, kh = h / G, nb = block_len(blen, row), L = start + nb;
            const float *q = qkv + (size_t)row * qkv_n + h * hd;
            float *s = S + ((size_t)r * nh + h) * s_stride;
            for (int b = 0; b < nb; b++)
                s[start + b] = dot(q, kc + ((size_t)kh * cap + start + block_slot(blk, stride, row, b)) * hd, hd) * scale;
            float mx = max_of(s, L);
            const __m256 vm = _mm256_set1_ps(mx);
            __m256 sum = _mm256_setzero_ps();
            int j = 0;
            for (; j + 8 <= L; j += 8) {
                const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
                _mm256_storeu_ps(s + j, p);
                sum = _mm256_add_ps(sum, p);
            }
            if (j < L) {
                __m256 p = exp8(_mm256_sub_ps(load_tail(s + j, L - j, mx), vm));
                store_tail(s + j, p, L - j);
                p = load_tail(s + j, L - j, 0.0f);  // padding lanes add +0: the sum's bits are unchanged
                sum = _mm256_add_ps(sum, p);
            }
            // pairs are ordered by KV head, then row, then query head of the group (step 4's tiles)
            const int g = h % G;
            pairs[((size_t)kh * R + r) * G + g] =
                (WPair){s, out + (size_t)r * nh * hd + h * hd, 1.0f / hsum8(sum), row};
        }
    // 4. weighted sums of values: per KV head and 16-dim slice, all of its (row, query head) pairs at once
    const int n_slices = (hd + 15) / 16, n_pairs = R * G;
#pragma omp for collapse(2) schedule(static)
    for (int kh = kh0; kh < kh1; kh++)
        for (int c = 0; c < n_slices; c++) {
            const kv_t *vh = vc + (size_t)kh * cap * hd;
            const WPair *pk = pairs + (size_t)kh * n_pairs;
            const int d0 = 16 * c, wide = hd - d0 >= 16;  // hd % 8 == 0: the last slice may be 8 dims
            for (int t = 0; t < n_pairs; t += 4) {
                const int P = n_pairs - t < 4 ? n_pairs - t : 4;
#define WVC(Wc, Pc) weighted_values(pk + t, start, blk, blen, stride, vh, hd, d0, Wc, Pc)
                if (wide) {
                    switch (P) {
                        case 1: WVC(2, 1); break;
                        case 2: WVC(2, 2); break;
                        case 3: WVC(2, 3); break;
                        default: WVC(2, 4); break;
                    }
                } else {
                    switch (P) {
                        case 1: WVC(1, 1); break;
                        case 2: WVC(1, 2); break;
                        case 3: WVC(1, 3); break;
                        default: WVC(1, 4); break;
                    }
                }
#undef WVC
            }
        }
}
