// The whole backbone step of a Llama-family decoder whose projections are GGUF blocks (Q4_1 / Q8_0), in C.
//
// Why: at batch 1 on a CPU a step of a small model is ~10 ms of weight reads, and eager PyTorch adds another
// ~10 ms of per-op dispatch (30 layers x ~60 small ops) plus ~50 us per SDPA call, one call per tree node per
// layer for exact tree attention. Here a step is one call: per layer two RMSNorms, the fused q/k/v, o,
// gate/up and down projections (qgemm.c), rotary, the KV write and attention, with nothing around them.
//
// Exactness by construction: every row (a prompt token, a tree node, the plain loop's one token) is computed
// by the same instruction sequence whatever the other rows are.
//   - projections: qgemm.c is row-invariant (activation blocks quantized per row, fixed accumulation);
//   - RMSNorm, rotary, SiLU, residuals: per row, fixed vector order;
//   - attention: row r attends to the keys [0, start) then its own list of block slots (its tree path root ..
//     itself, or 0 .. r in a causal block). Each score is one fixed dot product, the softmax sum and the
//     weighted sum of values run over that key sequence in order. A tree node at depth d therefore sees
//     exactly the key sequence, and gets exactly the bits, of the plain step at position start + d; and a token
//     gets the same K/V whether it was prefilled in a block or decoded alone.
// Work is split across threads by rows, heads and key ranges, never inside one row's reduction.
#include <immintrin.h>
#include "simd.h"
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

void q4_1_gemm_team(const float *x, int M, int K, const uint8_t *qs, const uint16_t *d, const uint16_t *mn, int N,
                    float *y, int8_t *qx, float *dx, float *sx);
void q8_0_gemm_team(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws, int N,
                    float *y, int8_t *qx, float *dx, float *sx);
void q8_0_gemm(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws, int N, float *y,
               int8_t *qx, float *dx, float *sx);
void q8_0_rows(const int8_t *qs, const uint16_t *d, int K, int group, const int64_t *ids, int n, float *out);

typedef struct {
    int kind;  // 0 = Q8_0, 1 = Q4_1
    int N, K;  // out, in features
    const void *qs;
    const uint16_t *d;  // fp16 scales
    const void *aux;    // Q4_1: the minimums (fp16); Q8_0: the block sums of the codes (int16)
} BLin;

typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    BLin qkv, o, gate_up, down;  // q|k|v and gate|up fused along the output dimension
} DLayer;

typedef struct {
    int n_layers, hidden, n_heads, n_kv, head_dim, inter;
    float scale, final_eps;
    const float *final_norm;
    const DLayer *layers;
} DModel;

// Software prefetch of the KV cache in attention, keys / values ahead of the ones being read. A layer's keys and
// values come from L3 or DRAM (the step's weights went through the caches since the previous layer), in runs
// too short for the hardware prefetcher to ramp up on. Measured on the 2-vCPU Xeon, step latency at 300 / 1000
// cached tokens: 1 node 4.13 -> 3.85 / 5.94 -> 5.19 ms, 3 nodes 5.67 -> 5.23 / 8.20 -> 7.42 ms (3 runs each,
// alternating builds). A prefetch is a hint: the arithmetic, so the bits, are unchanged.
#define PF_KEYS 32
#define PF_VALUES 48
#define RC 16    // attention rows per chunk (bounds the score buffer)
#define JB 64    // keys per task when scoring the shared prefix
#define MAX_HD 256  // head_dim limit of this step (checked by block_forward.py)

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

// The KV cache holds fp16 (as llama.cpp's does by default): attention of a step is bound by reading the cached
// keys and values, and half the bytes read in about half the time. Every read converts exactly to fp32, and a
// key or value is rounded once, when written, so all paths see the same values.
typedef uint16_t kv_t;
static inline __m256 load_kv(const kv_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
// Values beyond fp16's range are saturated to +-65504 instead of becoming inf (an inf key would turn the whole
// softmax row into NaN); Llama-family keys and values are far inside the range, so this never changes them.
static inline void store_kv(kv_t *dst, const float *src, int hd) {
    const __m256 hi = _mm256_set1_ps(65504.0f), lo = _mm256_set1_ps(-65504.0f);
    for (int i = 0; i < hd; i += 8) {
        const __m256 v = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(src + i), hi), lo);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
}

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

// LlamaRMSNorm: w * (x * rsqrt(mean(x^2) + eps)), statistics in fp32. Rows are shared among the team.
static void rms_norm(const float *x, const float *w, float eps, int T, int H, float *out) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) {
        const float *xr = x + (size_t)t * H;
        float *o = out + (size_t)t * H;
        __m256 acc = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= H; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), _mm256_loadu_ps(xr + i), acc);
        if (i < H) {
            const __m256 v = load_tail(xr + i, H - i, 0.0f);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const float r = 1.0f / sqrtf(hsum8(acc) / (float)H + eps);
        for (int j = 0; j < H; j++) o[j] = w[j] * (xr[j] * r);
    }
}

// A block linear as team work (qgemm.c, *_team): inside decoder_forward's parallel region the threads share it,
// called alone (the drafter) one thread runs it.
static void linear(const BLin *l, const float *x, int M, float *y, int8_t *qx, float *dx, float *sx) {
    if (l->kind == 1)
        q4_1_gemm_team(x, M, l->K, (const uint8_t *)l->qs, l->d, (const uint16_t *)l->aux, l->N, y, qx, dx, sx);
    else
        q8_0_gemm_team(x, M, l->K, (const int8_t *)l->qs, l->d, (const int16_t *)l->aux, l->N, y, qx, dx, sx);
}

// HF's rotary: x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1].
static void rope(float *x, const float *cs, const float *sn, int hd) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cs[i] + (-b) * sn[i];
        x[i + half] = b * cs[i + half] + a * sn[i + half];
    }
}

// Block keys of row r: its own list (tree path) or, with no list, the causal block 0 .. r.
static inline int block_len(const int *blen, int r) { return blen ? blen[r] : r + 1; }
static inline int block_slot(const int *blk, int stride, int r, int b) { return blk ? blk[(size_t)r * stride + b] : b; }

// Weighted sums of values for P (row, head) pairs of one KV head, dims [d0, d0 + 8W): for each pair
// o = inv * sum_jj p[jj] * v[key jj], keys in order (the shared prefix, then the row's own block keys). A prefix
// value is read and converted from fp16 once for all P pairs (the pairs are the group's query heads times the
// tree rows), instead of once per pair. Per output lane the arithmetic is the same sequence whatever P is
// (acc = 0, acc = fma(p_j, v_j, acc) over the keys in order, then * inv), so a pair's result never depends on
// the pairs computed beside it. W and P are compile-time constants at every call: the accumulators stay in
// registers.
typedef struct {
    const float *p;  // the pair's softmax numerators [L]
    float *o;        // the pair's output (head slice of its row)
    float inv;       // 1 / sum(p)
    int row;         // row in the step (for its block keys)
} WPair;

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

// Attention of rows [r0, r0 + R) for one layer, as team work (each stage's items shared among the threads, a
// barrier after each). q: rows of the qkv buffer (stride qkv_n), out [T, n_heads * hd]; S and pairs: shared
// scratch.
static void attend_chunk(const DModel *m, const float *qkv, int qkv_n, const kv_t *kc, const kv_t *vc,
                         size_t cap, int start, int r0, int R, const int *blk, const int *blen, int stride,
                         float *S, size_t s_stride, WPair *pairs, float *out) {
    const int hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv, G = nh / nkv;
    const float scale = m->scale;
    // 1. scores against the shared prefix [0, start): each key is read once for every row and head of its group
    const int nj = (start + JB - 1) / JB;
#pragma omp for collapse(2) schedule(static)
    for (int kh = 0; kh < nkv; kh++)
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
        for (int h = 0; h < nh; h++) {
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
                (WPair){s, out + (size_t)row * nh * hd + h * hd, 1.0f / hsum8(sum), row};
        }
    // 4. weighted sums of values: per KV head and 16-dim slice, all of its (row, query head) pairs at once
    const int n_slices = (hd + 15) / 16, n_pairs = R * G;
#pragma omp for collapse(2) schedule(static)
    for (int kh = 0; kh < nkv; kh++)
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

size_t decoder_scratch_bytes(const DModel *m, int T, int max_len) {
    const size_t H = m->hidden, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv, I = m->inter;
    const size_t qkv_n = (nh + 2 * nkv) * hd, maxk = I > H ? I : (nh * hd > H ? nh * hd : H);
    const size_t floats = T * H + T * qkv_n + T * nh * hd + T * H + T * 2 * I + T * I +
                          (size_t)RC * nh * (size_t)max_len + 2 * (T * maxk / 32 + 1);
    // + attention's (row, head) pairs; qx: the codes and (Q8_0 VNNI) codes + 128
    return floats * sizeof(float) + (size_t)RC * nh * sizeof(WPair) + 2 * T * maxk + 64;
}

// SiLU(gate) * up for row r, elements [8c, 8c + 8) (the last chunk may be shorter: the same vector code on a
// padded copy, so every element is computed alike whichever chunk or thread it falls in)
static inline void silu_mul_chunk(const float *g, const float *u, float *a, int I, int c) {
    const int i = 8 * c;
    if (i + 8 <= I) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        _mm256_storeu_ps(a + i, _mm256_mul_ps(sg, _mm256_loadu_ps(u + i)));
    } else {
        const __m256 gv = load_tail(g + i, I - i, 0.0f);
        const __m256 sg = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv))));
        store_tail(a + i, _mm256_mul_ps(sg, load_tail(u + i, I - i, 0.0f)), I - i);
    }
}

// x [T, hidden]: the token embeddings in, the final-normed hidden states out. cos/sin [T, head_dim] per row.
// kv: the cache [n_layers, 2, n_kv, cap, head_dim] in fp16; rows are written at slots start .. start + T - 1.
// blk [T, stride] / blen [T]: each row's block keys (slot offsets from start, in order), or NULL for causal.
//
// The whole step is ONE parallel region: every stage (norms, projections, rotary and KV writes, the attention
// stages, SiLU, residuals) is a worksharing loop over its independent items (rows, column groups, heads, key
// blocks, 8-element chunks) with a barrier after it, instead of a parallel region per product and one thread
// for the per-row work in between (a step had ~180 fork/joins, and the second core idled through the per-row
// work of every tree row). An item's arithmetic does not depend on which thread runs it.
void decoder_forward(const DModel *m, int T, float *x, const float *cos_t, const float *sin_t, kv_t *kv, int cap,
                     int start, const int *blk, const int *blen, int stride, void *scratch) {
    const int H = m->hidden, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv, I = m->inter;
    const int qd = nh * hd, kvd = nkv * hd, qkv_n = qd + 2 * kvd;
    const int maxk = I > H ? I : (qd > H ? qd : H);
    int max_len = 0;
    for (int r = 0; r < T; r++) {
        const int L = start + block_len(blen, r);
        max_len = L > max_len ? L : max_len;
    }
    float *h = (float *)scratch, *qkv = h + (size_t)T * H, *att = qkv + (size_t)T * qkv_n, *tmp = att + (size_t)T * qd,
          *gu = tmp + (size_t)T * H, *act = gu + (size_t)T * 2 * I, *S = act + (size_t)T * I,
          *dx = S + (size_t)RC * nh * max_len, *sx = dx + (size_t)T * maxk / 32 + 1;
    WPair *pairs = (WPair *)(sx + (size_t)T * maxk / 32 + 1);
    int8_t *qx = (int8_t *)(pairs + (size_t)RC * nh);
    const size_t layer_stride = (size_t)2 * nkv * cap * hd, half_stride = (size_t)nkv * cap * hd;
    const int n_chunks = (I + 7) / 8;

#pragma omp parallel
    {
        for (int li = 0; li < m->n_layers; li++) {
            const DLayer *L = &m->layers[li];
            kv_t *kc = kv + li * layer_stride, *vc = kc + half_stride;
            rms_norm(x, L->norm1, L->eps1, T, H, h);
            linear(&L->qkv, h, T, qkv, qx, dx, sx);
            // rotary on the q and k heads, then the K/V writes: per (row, head)
#pragma omp for collapse(2) schedule(static)
            for (int r = 0; r < T; r++)
                for (int hh = 0; hh < nh + 2 * nkv; hh++) {
                    float *row = qkv + (size_t)r * qkv_n;
                    if (hh < nh + nkv)
                        rope(row + hh * hd, cos_t + (size_t)r * hd, sin_t + (size_t)r * hd, hd);
                    if (hh >= nh && hh < nh + nkv)
                        store_kv(kc + ((size_t)(hh - nh) * cap + start + r) * hd, row + hh * hd, hd);
                    else if (hh >= nh + nkv)
                        store_kv(vc + ((size_t)(hh - nh - nkv) * cap + start + r) * hd, row + hh * hd, hd);
                }
            for (int r0 = 0; r0 < T; r0 += RC)
                attend_chunk(m, qkv, qkv_n, kc, vc, cap, start, r0, T - r0 < RC ? T - r0 : RC, blk, blen, stride,
                             S, (size_t)max_len, pairs, att);
            linear(&L->o, att, T, tmp, qx, dx, sx);
#pragma omp for schedule(static)
            for (int r = 0; r < T; r++)
                for (int i = 0; i < H; i++) x[(size_t)r * H + i] += tmp[(size_t)r * H + i];
            rms_norm(x, L->norm2, L->eps2, T, H, h);
            linear(&L->gate_up, h, T, gu, qx, dx, sx);
#pragma omp for collapse(2) schedule(static)
            for (int r = 0; r < T; r++)
                for (int c = 0; c < n_chunks; c++)
                    silu_mul_chunk(gu + (size_t)r * 2 * I, gu + (size_t)r * 2 * I + I, act + (size_t)r * I, I, c);
            linear(&L->down, act, T, tmp, qx, dx, sx);
#pragma omp for schedule(static)
            for (int r = 0; r < T; r++)
                for (int i = 0; i < H; i++) x[(size_t)r * H + i] += tmp[(size_t)r * H + i];
        }
        rms_norm(x, m->final_norm, m->final_eps, T, H, h);
#pragma omp for schedule(static)
        for (int r = 0; r < T; r++) memcpy(x + (size_t)r * H, h + (size_t)r * H, (size_t)H * sizeof(float));
    }
}

// ---- Hydra drafter pieces (heads.py: ResBlock, TokenCell) on Q8_0 block weights --------------------------
// The drafter runs a few of these per step at batch 1-8; in PyTorch each is ~10 small ops whose dispatch cost
// more than their arithmetic. Drafts only choose what the backbone verifies: none of this affects the output.
typedef struct {
    const int8_t *qs;
    const uint16_t *d;
    const int16_t *ws;
    const float *bias;
} Q8Lin;

// y = x + silu(W x + b), one row at a time in fixed order
static void add_silu_bias(float *y, const float *x, const float *t, const float *b, int M, int H) {
    for (int r = 0; r < M; r++) {
        const float *tr = t + (size_t)r * H, *xr = x + (size_t)r * H;
        float *yr = y + (size_t)r * H;
        int i = 0;
        for (; i + 8 <= H; i += 8) {
            const __m256 v = _mm256_add_ps(_mm256_loadu_ps(tr + i), _mm256_loadu_ps(b + i));
            const __m256 sg = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), v))));
            _mm256_storeu_ps(yr + i, _mm256_add_ps(_mm256_loadu_ps(xr + i), sg));
        }
        for (; i < H; i++) {
            const float v = tr[i] + b[i];
            yr[i] = xr[i] + v / (1.0f + expf(-v));
        }
    }
}

// x [M, H] -> y [M, H] through n ResBlocks; tmp [M, H]; scratch for the 8-bit activations as q8_0_gemm's
void hydra_resblocks(int M, int H, int n, const Q8Lin *blocks, const float *x, float *y, float *tmp, int8_t *qx,
                     float *dx, float *sx) {
    memcpy(y, x, (size_t)M * H * sizeof(float));
    for (int i = 0; i < n; i++) {
        q8_0_gemm(y, M, H, blocks[i].qs, blocks[i].d, blocks[i].ws, H, tmp, qx, dx, sx);
        add_silu_bias(y, y, tmp, blocks[i].bias, M, H);
    }
}

// TokenCell: out = state + silu(W [state ; e * rsqrt(mean(e^2) + 1e-6)] + b); cat [M, 2H], tmp [M, H]
void hydra_cell(int M, int H, const Q8Lin *cell, const float *state, const float *emb, float *out, float *cat,
                float *tmp, int8_t *qx, float *dx, float *sx) {
    for (int r = 0; r < M; r++) {
        const float *e = emb + (size_t)r * H;
        float ss = 0.0f;
        for (int i = 0; i < H; i++) ss += e[i] * e[i];
        const float scale = 1.0f / sqrtf(ss / (float)H + 1e-6f);
        float *c = cat + (size_t)r * 2 * H;
        memcpy(c, state + (size_t)r * H, (size_t)H * sizeof(float));
        for (int i = 0; i < H; i++) c[H + i] = e[i] * scale;
    }
    q8_0_gemm(cat, M, 2 * H, cell->qs, cell->d, cell->ws, H, tmp, qx, dx, sx);
    add_silu_bias(out, state, tmp, cell->bias, M, H);
}

// The indices of the k largest of v[0 .. n), largest first; ties go to the lower index (a strict > test), so the
// result never depends on anything but the values. k is a tree's width at one depth (a few).
static void top_k(const float *v, int n, int k, int *out) {
    float best[64];
    int m = 0;
    for (int i = 0; i < n; i++) {
        const float x = v[i];
        if (m == k && !(x > best[k - 1])) continue;
        int j = m < k ? m++ : k - 1;
        while (j > 0 && x > best[j - 1]) {
            best[j] = best[j - 1];
            out[j] = out[j - 1];
            j--;
        }
        best[j] = x;
        out[j] = i;
    }
}

// A whole Hydra draft (decoding.py, HydraDrafter.propose) in one call: the cell folds the root into the last
// accepted node's state, then depth by depth the ResBlocks of head d on the nodes that have children, the
// draft-vocabulary projection (a Q4_1 block linear), top-k, the children's tokens and (except at the last depth)
// the cell folding each child's token into its parent's state. Python paid ~12 small tensor ops per depth for
// this; here a depth costs its arithmetic.
//
// plan (int32), per depth: I, C, K, then internal_rows[I], child_nodes[C], child_slot[C], child_rank[C],
// child_parent_row[C] (tree.py, TreeLevel). heads[d] / n_blocks[d]: head d's ResBlocks. embed: the token
// embedding, an fp32 table [vocab, H] or a Q8_0 block linear's rows (the tied lm_head's: q8_0_rows).
// work: floats, at least (6 * R + 2 * R) * H + R * V + R * 64, R = the most rows of a depth (I or C), V = the
// projection's padded rows; qx/dx/sx: the 8-bit activation scratch for R rows of 2H.
typedef struct {
    const float *table;  // fp32 [vocab, H], or NULL: then the Q8_0 blocks below
    const int8_t *qs;
    const uint16_t *d;
    int group;
} Embed;

static void embed_row(const Embed *e, int64_t tok, int H, float *out) {
    if (e->table)
        memcpy(out, e->table + (size_t)tok * H, (size_t)H * sizeof(float));
    else
        q8_0_rows(e->qs, e->d, H, e->group, &tok, 1, out);
}

void hydra_draft(int H, const Q8Lin *cell, const Q8Lin *const *heads, const int *n_blocks, const BLin *proj,
                 const int64_t *draft_vocab, const Embed *embed, const float *hidden, const int64_t *root,
                 const int *plan, int n_levels, int64_t *tokens, float *work, int R, int8_t *qx, float *dx,
                 float *sx) {
    float *state = work, *nstate = state + (size_t)R * H, *x = nstate + (size_t)R * H, *y = x + (size_t)R * H,
          *tmp = y + (size_t)R * H, *emb = tmp + (size_t)R * H, *cat = emb + (size_t)R * H,
          *logits = cat + (size_t)2 * R * H;
    int *top = (int *)(logits + (size_t)R * proj->N);
    const size_t row_bytes = (size_t)H * sizeof(float);
    tokens[0] = root[0];
    embed_row(embed, root[0], H, emb);
    hydra_cell(1, H, cell, hidden, emb, state, cat, tmp, qx, dx, sx);  // depth 0: the root only
    for (int d = 0; d < n_levels; d++) {
        const int I = plan[0], C = plan[1], K = plan[2];
        const int *internal = plan + 3, *nodes = internal + I, *slot = nodes + C, *rank = slot + C,
                  *parent_row = rank + C;
        plan = parent_row + C;
        for (int i = 0; i < I; i++) memcpy(x + (size_t)i * H, state + (size_t)internal[i] * H, row_bytes);
        hydra_resblocks(I, H, n_blocks[d], heads[d], x, y, tmp, qx, dx, sx);
#pragma omp parallel
        linear(proj, y, I, logits, qx, dx, sx);
        for (int i = 0; i < I; i++) top_k(logits + (size_t)i * proj->N, proj->N, K, top + i * 64);
        for (int c = 0; c < C; c++) {
            const int64_t tok = draft_vocab[top[slot[c] * 64 + rank[c]]];
            tokens[nodes[c]] = tok;
            if (d + 1 < n_levels) {
                embed_row(embed, tok, H, emb + (size_t)c * H);
                memcpy(x + (size_t)c * H, state + (size_t)parent_row[c] * H, row_bytes);
            }
        }
        if (d + 1 < n_levels) {
            hydra_cell(C, H, cell, x, emb, nstate, cat, tmp, qx, dx, sx);
            float *t = state;
            state = nstate;
            nstate = t;
        }
    }
}

// A tree shaped by the draft's confidence (EAGLE-2's dynamic tree on the Hydra spine; decoding.py,
// confident_paths, is the same rule in Python and documents it): the cell folds the root into the last accepted
// node's state; per depth d < D the ResBlocks of head d, the draft-vocabulary projection, the top-K tokens and
// their probabilities (softmax over the V draft-vocabulary logits), then the cell folds the top-1 token in for
// the next depth (the spine). Candidate (d, r), the path (0,) * d + (r,), has the spine's probabilities down to
// depth d - 1 times its own; the size - 1 most probable candidates (ties: shallower, then lower rank) are the
// tree. Out: codes[size - 1] = d * K + r of the chosen nodes in growth order (depth, then rank) and
// node_tokens[size] (the root first, then those nodes' tokens); returns the number of nodes chosen (size - 1, or
// fewer when D * K is smaller). work: floats, >= 8 * H + proj->N + 2 * D * K + 64.
int hydra_draft_shaped(int H, const Q8Lin *cell, const Q8Lin *const *heads, const int *n_blocks, const BLin *proj,
                       int V, const int64_t *draft_vocab, const Embed *embed, const float *hidden,
                       const int64_t *root, int D, int K, int size, int *codes, int64_t *node_tokens, float *work,
                       int8_t *qx, float *dx, float *sx) {
    float *state = work, *nstate = state + H, *y = nstate + H, *tmp = y + H, *emb = tmp + H, *cat = emb + H,
          *logits = cat + 2 * H, *path_p = logits + proj->N;
    int64_t cand_tok[8 * 64];
    int *top = (int *)(path_p + D * K);
    if (D * K > 8 * 64) return 0;
    embed_row(embed, root[0], H, emb);
    hydra_cell(1, H, cell, hidden, emb, state, cat, tmp, qx, dx, sx);
    float spine = 1.0f;
    for (int d = 0; d < D; d++) {
        hydra_resblocks(1, H, n_blocks[d], heads[d], state, y, tmp, qx, dx, sx);
#pragma omp parallel
        linear(proj, y, 1, logits, qx, dx, sx);
        top_k(logits, V, K, top);
        // softmax normaliser: sum of exp(l - max), 8 lanes at a time (a confidence: it shapes the tree, verification
        // decides what is accepted)
        const float mx = logits[top[0]];
        const __m256 vm = _mm256_set1_ps(mx);
        __m256 acc = _mm256_setzero_ps();
        int j = 0;
        for (; j + 8 <= V; j += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(logits + j), vm)));
        float sum = hsum8(acc);
        for (; j < V; j++) sum += expf(logits[j] - mx);
        for (int r = 0; r < K; r++) {
            cand_tok[d * K + r] = draft_vocab[top[r]];
            path_p[d * K + r] = spine * (expf(logits[top[r]] - mx) / sum);
        }
        spine = path_p[d * K];
        if (d + 1 < D) {
            embed_row(embed, cand_tok[d * K], H, emb);
            hydra_cell(1, H, cell, state, emb, nstate, cat, tmp, qx, dx, sx);
            float *t = state;
            state = nstate;
            nstate = t;
        }
    }
    // the size - 1 best candidates: selection by repeated maximum (a few dozen candidates at most); a strict >
    // in candidate order (depth, then rank) keeps ties on the shallower, lower-ranked one
    const int n = size - 1 < D * K ? size - 1 : D * K;
    unsigned char taken[8 * 64] = {0};
    for (int i = 0; i < n; i++) {
        int best = -1;
        for (int c = 0; c < D * K; c++)
            if (!taken[c] && (best < 0 || path_p[c] > path_p[best])) best = c;
        taken[best] = 1;
    }
    node_tokens[0] = root[0];
    int m = 0;
    for (int c = 0; c < D * K; c++)
        if (taken[c]) {
            codes[m] = c;
            node_tokens[++m] = cand_tok[c];
        }
    return m;
}
