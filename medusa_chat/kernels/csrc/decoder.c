// The whole backbone step of a Llama-family decoder (Qwen2 included: q/k/v biases) whose projections are GGUF
// blocks (Q4_1 / Q8_0 / K-quants), in C.
//
// Why: at batch 1 on a CPU a step of a small model is ~10 ms of weight reads, and eager PyTorch adds another
// ~10 ms of per-op dispatch (30 layers x ~60 small ops) plus ~50 us per SDPA call, one call per tree node per
// layer for exact tree attention. Here a step is one call: per layer two RMSNorms, the fused q/k/v, o,
// gate/up and down projections (qgemm.c), the q/k/v biases, rotary, the KV write and attention, with nothing
// around them.
//
// Exactness by construction: every row (a prompt token, a tree node, the plain loop's one token) is computed
// by the same instruction sequence whatever the other rows are.
//   - projections: qgemm.c is row-invariant (activation blocks quantized per row, fixed accumulation);
//   - RMSNorm, biases, rotary, SiLU, residuals: per row, fixed vector order;
//   - attention: row r attends to the keys [0, start) then its own list of block slots (its tree path root ..
//     itself, or 0 .. r in a causal block). Each score is one fixed dot product, the softmax sum and the
//     weighted sum of values run over that key sequence in order. A tree node at depth d therefore sees
//     exactly the key sequence, and gets exactly the bits, of the plain step at position start + d; and a token
//     gets the same K/V whether it was prefilled in a block or decoded alone.
// Work is split across threads by rows, heads and key ranges, never inside one row's reduction.
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"
#include "attention.h"
#include "decoder.h"
#include "duet.h"
#include "qgemm.h"
#include "kquants.h"

// LlamaRMSNorm of one vector: o = w * (x * rsqrt(mean(x^2) + eps)), statistics in fp32; o may be x (in place)
static inline void rms_row(const float *x, const float *w, float eps, int n, float *o) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), acc);
    if (i < n) {
        const __m256 v = load_tail(x + i, n - i, 0.0f);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    const float r = 1.0f / sqrtf(hsum8(acc) / (float)n + eps);
    for (int j = 0; j < n; j++) o[j] = w[j] * (x[j] * r);
}

// The hidden states' RMSNorm: rows are shared among the team.
static void rms_norm(const float *x, const float *w, float eps, int T, int H, float *out) {
#pragma omp for schedule(static)
    for (int t = 0; t < T; t++) rms_row(x + (size_t)t * H, w, eps, H, out + (size_t)t * H);
}

// Qwen3's q/k norms: one head's vector in place, per (row, head), inside the step's loop
static void head_rms_norm(float *x, const float *w, float eps, int hd) { rms_row(x, w, eps, hd, x); }

void block_linear(const BLin *l, const float *x, int M, float *y, int8_t *qx, float *dx, float *sx) {
    if (mc_duet() && duet_block_linear(l, x, M, y)) return;
    switch (l->kind) {
        case 1: q4_1_gemm_team(x, M, l->K, (const uint8_t *)l->qs, l->d, (const uint16_t *)l->aux, l->N, y, qx, dx, sx); break;
        case 2: q4_k_gemm_team(x, M, l->K, (const uint8_t *)l->qs, l->N, y, qx, dx, sx); break;
        case 3: q5_k_gemm_team(x, M, l->K, (const uint8_t *)l->qs, l->N, y, qx, dx, sx); break;
        case 4: q6_k_gemm_team(x, M, l->K, (const uint8_t *)l->qs, l->N, y, qx, dx, sx); break;
        default: q8_0_gemm_team(x, M, l->K, (const int8_t *)l->qs, l->d, (const int16_t *)l->aux, l->N, y, qx, dx, sx);
    }
}

// y [T, a.N + b.N] = [a(x) | b(x)] per row; b absent (kind < 0): a alone is the fused projection. Apart, each
// runs into `part` and the rows are interleaved: the same values as one fused product (each output column's
// arithmetic is its own), in the layout the step reads.
static void two_part_linear(const BLin *a, const BLin *b, const float *x, int T, float *y, float *part,
                            int8_t *qx, float *dx, float *sx) {
    if (b->kind < 0) {
        block_linear(a, x, T, y, qx, dx, sx);
        return;
    }
    const int na = a->N, nb = b->N;
    block_linear(a, x, T, part, qx, dx, sx);
    block_linear(b, x, T, part + (size_t)T * na, qx, dx, sx);
#pragma omp for schedule(static)
    for (int r = 0; r < T; r++) {
        memcpy(y + (size_t)r * (na + nb), part + (size_t)r * na, (size_t)na * sizeof(float));
        memcpy(y + (size_t)r * (na + nb) + na, part + (size_t)T * na + (size_t)r * nb, (size_t)nb * sizeof(float));
    }
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

size_t decoder_scratch_bytes(const DModel *m, int T, int max_len) {
    const size_t H = m->hidden, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv, I = m->inter;
    const size_t qkv_n = (nh + 2 * nkv) * hd, maxk = I > H ? I : (nh * hd > H ? nh * hd : H);
    const size_t split = qkv_n > 2 * I ? qkv_n : 2 * I;  // split projections' outputs before interleaving
    const size_t floats = T * H + T * qkv_n + T * nh * hd + T * H + T * 2 * I + T * I +
                          (size_t)RC * nh * (size_t)max_len + 2 * (T * maxk / 32 + 1) + T * split;
    // + attention's (row, head) pairs; qx: the codes and (Q8_0 VNNI) codes + 128
    return floats * sizeof(float) + (size_t)RC * nh * sizeof(WPair) + 2 * T * maxk + 64 + 64;  // + part's alignment
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

// Attention in the duet mode (duet.c): one chunk per KV head (its query heads' columns of `out`), the caller's
// chunks with its scratch, the helper's with scratch of the runtime's own (duet_helper_scratch). The helper reads
// the qkv rows (the step's scratch) and the KV cache; block_forward.py waits for it to be out of any chunk
// before either is freed (cthreads.quiesce).
typedef struct {
    const DModel *m;
    const float *qkv;
    const kv_t *kc, *vc;
    size_t cap, s_stride;
    int qkv_n, start, r0, R, stride;
    const int *blk, *blen;
    float *S, *out, *helper_S;
    WPair *pairs, *helper_pairs;
} DuetAttention;

static void duet_attention_chunk(const void *args, int c, float *y) {
    const DuetAttention *a = args;
    const int mine = y == a->out;
    attend_chunk(a->m, a->qkv, a->qkv_n, a->kc, a->vc, a->cap, a->start, a->r0, a->R, a->blk, a->blen, a->stride,
                 mine ? a->S : a->helper_S, a->s_stride, mine ? a->pairs : a->helper_pairs, y, c, c + 1);
}

static int duet_attention(const DModel *m, const float *qkv, int qkv_n, const kv_t *kc, const kv_t *vc, size_t cap,
                          int start, int r0, int R, const int *blk, const int *blen, int stride, float *S, size_t s_stride,
                          WPair *pairs, float *out) {
    if (m->n_kv < 2 || !duet_begin()) return 0;
    const size_t s_bytes = (size_t)R * m->n_heads * s_stride * sizeof(float);
    unsigned char *h = duet_helper_scratch(s_bytes + (size_t)RC * m->n_heads * sizeof(WPair) + 64);
    int ok = h != NULL;
    if (ok) {
        const DuetAttention a = {m, qkv, kc, vc, cap, s_stride, qkv_n, start, r0, R, stride, blk, blen, S, out,
                                 (float *)h, pairs, (WPair *)(((uintptr_t)(h + s_bytes) + 63) & ~(uintptr_t)63)};
        const int qd = m->n_heads * m->head_dim, cols = qd / m->n_kv;
        ok = duet_columns(duet_attention_chunk, &a, sizeof a, m->n_kv, cols, R, qd, out);
    }
    duet_end();
    return ok;
}

// x [T, hidden]: the token embeddings in, the final-normed hidden states out. cos/sin [T, head_dim] per row.
// taps [n_taps] (layer indices, ascending) / tap_out [T, n_taps * hidden]: the hidden states entering those layers,
// per row (an EAGLE-3 draft's features: engine/eagle_drafter.py); n_taps 0: none.
// kv: the cache [n_layers, 2, n_kv, cap, head_dim] in fp16; rows are written at slots start .. start + T - 1.
// blk [T, stride] / blen [T]: each row's block keys (slot offsets from start, in order), or NULL for causal.
//
// The whole step is ONE parallel region: every stage (norms, projections, rotary and KV writes, the attention
// stages, SiLU, residuals) is a worksharing loop over its independent items (rows, column groups, heads, key
// blocks, 8-element chunks) with a barrier after it, instead of a parallel region per product and one thread
// for the per-row work in between (a step had ~180 fork/joins, and the second core idled through the per-row
// work of every tree row). An item's arithmetic does not depend on which thread runs it.
void decoder_forward(const DModel *m, int T, float *x, const float *cos_t, const float *sin_t, kv_t *kv, int cap,
                     int start, const int *blk, const int *blen, int stride, void *scratch, const int *taps,
                     int n_taps, float *tap_out) {
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
    // split projections (DLayer v / up), 64-byte aligned after qx's own slack
    float *part = (float *)(((uintptr_t)(qx + 2 * (size_t)T * maxk + 64) + 63) & ~(uintptr_t)63);
    const size_t layer_stride = (size_t)2 * nkv * cap * hd, half_stride = (size_t)nkv * cap * hd;
    const int n_chunks = (I + 7) / 8;

#pragma omp parallel num_threads(mc_team())
    {
        for (int li = 0; li < m->n_layers; li++) {
            const DLayer *L = &m->layers[li];
            kv_t *kc = kv + li * layer_stride, *vc = kc + half_stride;
            for (int j = 0; j < n_taps; j++)
                if (taps[j] == li) {
#pragma omp for schedule(static)
                    for (int r = 0; r < T; r++)
                        memcpy(tap_out + ((size_t)r * n_taps + j) * H, x + (size_t)r * H, (size_t)H * sizeof(float));
                }
            rms_norm(x, L->norm1, L->eps1, T, H, h);
            two_part_linear(&L->qkv, &L->v, h, T, qkv, part, qx, dx, sx);
            // the q/k/v biases (if any), the q/k head norms (if any), rotary on the q and k heads, then the K/V
            // writes: per (row, head). The
            // bias is one fp32 add per element, the same for every row (a tree node gets the plain step's bits)
#pragma omp for collapse(2) schedule(static)
            for (int r = 0; r < T; r++)
                for (int hh = 0; hh < nh + 2 * nkv; hh++) {
                    float *row = qkv + (size_t)r * qkv_n;
                    if (L->qkv_bias) {
                        float *head = row + hh * hd;
                        const float *b = L->qkv_bias + hh * hd;
                        for (int i = 0; i < hd; i++) head[i] += b[i];
                    }
                    if (hh < nh && L->q_norm)
                        head_rms_norm(row + hh * hd, L->q_norm, L->qk_eps, hd);
                    else if (hh >= nh && hh < nh + nkv && L->k_norm)
                        head_rms_norm(row + hh * hd, L->k_norm, L->qk_eps, hd);
                    if (hh < nh + nkv)
                        rope(row + hh * hd, cos_t + (size_t)r * hd, sin_t + (size_t)r * hd, hd);
                    if (hh >= nh && hh < nh + nkv)
                        store_kv(kc + ((size_t)(hh - nh) * cap + start + r) * hd, row + hh * hd, hd);
                    else if (hh >= nh + nkv)
                        store_kv(vc + ((size_t)(hh - nh - nkv) * cap + start + r) * hd, row + hh * hd, hd);
                }
            for (int r0 = 0; r0 < T; r0 += RC) {
                const int R = T - r0 < RC ? T - r0 : RC;
                float *out = att + (size_t)r0 * qd;
                if (!(mc_duet() && duet_attention(m, qkv, qkv_n, kc, vc, cap, start, r0, R, blk, blen, stride, S,
                                                  (size_t)max_len, pairs, out)))
                    attend_chunk(m, qkv, qkv_n, kc, vc, cap, start, r0, R, blk, blen, stride, S, (size_t)max_len,
                                 pairs, out, 0, nkv);
            }
            block_linear(&L->o, att, T, tmp, qx, dx, sx);
#pragma omp for schedule(static)
            for (int r = 0; r < T; r++)
                for (int i = 0; i < H; i++) x[(size_t)r * H + i] += tmp[(size_t)r * H + i];
            rms_norm(x, L->norm2, L->eps2, T, H, h);
            two_part_linear(&L->gate_up, &L->up, h, T, gu, part, qx, dx, sx);
#pragma omp for collapse(2) schedule(static)
            for (int r = 0; r < T; r++)
                for (int c = 0; c < n_chunks; c++)
                    silu_mul_chunk(gu + (size_t)r * 2 * I, gu + (size_t)r * 2 * I + I, act + (size_t)r * I, I, c);
            block_linear(&L->down, act, T, tmp, qx, dx, sx);
#pragma omp for schedule(static)
            for (int r = 0; r < T; r++)
                for (int i = 0; i < H; i++) x[(size_t)r * H + i] += tmp[(size_t)r * H + i];
        }
        rms_norm(x, m->final_norm, m->final_eps, T, H, h);
#pragma omp for schedule(static)
        for (int r = 0; r < T; r++) memcpy(x + (size_t)r * H, h + (size_t)r * H, (size_t)H * sizeof(float));
    }
}
