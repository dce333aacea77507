// An EAGLE draft (model/forward/eagle.py: EAGLE-3, or EAGLE-1/2 with one layer) drafting a step's tree in one C call,
// on block weights.
//
// The draft is one Llama decoder layer over (the backbone's features, the next token's embedding) with its own
// KV cache over the context. Per step (engine/eagle_drafter.py keeps the context's features and tokens):
//   extend  the pairs the draft has not seen yet, the last one (last committed feature, the root) included,
//           through the layer as a causal block; its last output is the root's state. The layer's input:
//             EAGLE-3: fc (3H -> H) on the three taps' features; q/k/v read cat(norm(embedding), norm(input))
//             EAGLE-1: fc (2H -> H, with its bias) on cat(embedding, feature); q/k/v read that (no input norm)
//   spine   depth by depth: the head on the state (EAGLE-3: final norm, then its V-token draft vocabulary;
//           EAGLE-1: the backbone's own lm_head, the full vocabulary), top-K and their probabilities; the top-1
//           token's embedding and the state go through the layer again (one row, at the next position; EAGLE-1
//           fuses them with fc first, as for a feature), and so on. The tree is the size - 1 most probable of the
//           D x K candidates below the top-1 spine (confident_select: EAGLE-2's dynamic tree on the spine, as the Hydra drafter's).
// In PyTorch each depth was ~40 small ops, which cost more than the layer's arithmetic on a CPU; here a depth
// costs its weight reads (~5 MB in Q4_1 with the embedded model's 576-wide draft). Drafts only choose what the backbone verifies:
// nothing here can change a reply (the drafter's numbers need not match the PyTorch draft's bit for bit).
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"
#include "decoder.h"
#include "drafting.h"
#include "qgemm.h"

// Rows of one extend call at a time: a long prompt's pairs go through the layer in blocks of this many (each
// block attends to everything before it), so the work buffer stays small whatever the prompt's length.
#define EXTEND_ROWS 64
#define MAX_TEAM 64  // attention's per-thread score rows (eagle_work_floats)

typedef struct {
    int H, F, n_heads, n_kv, head_dim, inter, V;  // F: the feature width (3H, EAGLE-1 H); V: the head's rows
    float eps_in, eps_hidden, eps_post, eps_final;
    const float *in_norm, *hidden_norm, *post_norm, *final_norm;  // fp32 [H] each (EAGLE-1: post_norm only)
    BLin fc, qkv, o, gate_up, down, head;  // qkv: q|k|v over cat(norm(emb), norm(x)) [2H] (EAGLE-1: x); gate_up: gate|up
    const int64_t *vocab;                  // draft index -> token id (NULL: the head's rows are the token ids)
    Embed embed;                           // the backbone's token embedding
    int version;                           // 3, or 1 (EAGLE-1/2)
    const float *fc_bias, *qkv_bias;       // EAGLE-1's fc bias [H]; q|k|v biases [qkv rows] (NULL: none)
} EDraft;

// out = w * (x * rsqrt(mean(x^2) + eps)) for one row
static void norm_row(const float *x, const float *w, float eps, int H, float *out) {
    float ss = 0.0f;
    for (int i = 0; i < H; i++) ss += x[i] * x[i];
    const float r = 1.0f / sqrtf(ss / (float)H + eps);
    for (int i = 0; i < H; i++) out[i] = w[i] * (x[i] * r);
}

static void linear(const BLin *l, const float *x, int M, float *y, int8_t *qx, float *dx, float *sx) {
#pragma omp parallel num_threads(mc_team())
    block_linear(l, x, M, y, qx, dx, sx);
}

// HF's rotary (rotate_half) on one head
static void rope_head(float *x, const float *cs, const float *sn, int hd) {
    const int half = hd / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cs[i] - b * sn[i];
        x[i + half] = b * cs[i + half] + a * sn[i + half];
    }
}

static float dot(const float *a, const float *b, int n) {
    __m256 acc = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

// work floats for a call extending T pairs (any T: they go EXTEND_ROWS at a time) with up to max_len positions
size_t eagle_work_floats(const EDraft *m, int T, int max_len) {
    const size_t H = m->H, qkv_n = (size_t)(m->n_heads + 2 * m->n_kv) * m->head_dim, I = m->inter;
    const size_t widest = (size_t)m->F > 2 * I ? (size_t)m->F : 2 * I;
    const size_t rows = T < EXTEND_ROWS ? (size_t)T : EXTEND_ROWS;
    return rows * (4 * H + 2 * H + qkv_n + (size_t)m->n_heads * m->head_dim + 2 * I + I + widest) +
           (size_t)MAX_TEAM * max_len + (size_t)m->V + 64;
}

// The layer on T rows: x [T, H] (its input: fc of features, or the draft's own earlier output), emb [T, H] (the
// next tokens' embeddings); row r sits at position (= cache slot) pos0 + r and attends to slots [0, pos0 + r].
// cos/sin: tables [positions, head_dim]. kc/vc: the cache [n_kv, cap, head_dim] (fp32). out [T, H].
static void layer_rows(const EDraft *m, int T, const float *x, const float *emb, int pos0, const float *cos_t,
                       const float *sin_t, float *kc, float *vc, int cap, float *out, float *w, int8_t *qx, float *dx,
                       float *sx) {
    const int H = m->H, hd = m->head_dim, nh = m->n_heads, nkv = m->n_kv, I = m->inter;
    const int qd = nh * hd, qkv_n = qd + 2 * nkv * hd, group = nh / nkv;
    float *cat = w, *qkv = cat + (size_t)T * 2 * H, *att = qkv + (size_t)T * qkv_n, *tmp = att + (size_t)T * qd,
          *h2 = tmp + (size_t)T * H, *gu = h2 + (size_t)T * H, *act = gu + (size_t)T * 2 * I, *S = act + (size_t)T * I;
    if (m->version == 3) {
        for (int r = 0; r < T; r++) {
            norm_row(emb + (size_t)r * H, m->in_norm, m->eps_in, H, cat + (size_t)r * 2 * H);
            norm_row(x + (size_t)r * H, m->hidden_norm, m->eps_hidden, H, cat + (size_t)r * 2 * H + H);
        }
        linear(&m->qkv, cat, T, qkv, qx, dx, sx);
    } else {
        linear(&m->qkv, x, T, qkv, qx, dx, sx);  // EAGLE-1's one layer has no input norm
    }
    if (m->qkv_bias)
        for (int r = 0; r < T; r++)
            for (int i = 0; i < qkv_n; i++) qkv[(size_t)r * qkv_n + i] += m->qkv_bias[i];
    const float scale = 1.0f / sqrtf((float)hd);
    for (int r = 0; r < T; r++) {
        const int pos = pos0 + r;
        float *row = qkv + (size_t)r * qkv_n;
        for (int hh = 0; hh < nh + nkv; hh++) rope_head(row + hh * hd, cos_t + (size_t)pos * hd, sin_t + (size_t)pos * hd, hd);
        for (int g = 0; g < nkv; g++) {
            memcpy(kc + ((size_t)g * cap + pos) * hd, row + qd + g * hd, (size_t)hd * sizeof(float));
            memcpy(vc + ((size_t)g * cap + pos) * hd, row + qd + (nkv + g) * hd, (size_t)hd * sizeof(float));
        }
    }
    // after every row's K/V is written: row r sees slots 0 .. pos0 + r; (row, head) pairs shared by the team
    // (a long prompt's first extend is most of a draft's attention), each thread with its own score row
    const int team = mc_team() < MAX_TEAM ? mc_team() : MAX_TEAM;
#pragma omp parallel for collapse(2) schedule(dynamic, 4) num_threads(team)
    for (int r = 0; r < T; r++)
        for (int hh = 0; hh < nh; hh++) {
            const int len = pos0 + r + 1;
            float *Sr = S + (size_t)omp_get_thread_num() * (pos0 + T);
            const float *q = qkv + (size_t)r * qkv_n + hh * hd;
            const float *keys = kc + (size_t)(hh / group) * cap * hd, *vals = vc + (size_t)(hh / group) * cap * hd;
            float mx = -INFINITY;
            for (int j = 0; j < len; j++) {
                Sr[j] = dot(q, keys + (size_t)j * hd, hd) * scale;
                mx = Sr[j] > mx ? Sr[j] : mx;
            }
            float sum = 0.0f;
            for (int j = 0; j < len; j++) sum += Sr[j] = expf(Sr[j] - mx);
            float *o = att + (size_t)r * qd + hh * hd;
            memset(o, 0, (size_t)hd * sizeof(float));
            for (int j = 0; j < len; j++) {
                const float p = Sr[j] / sum;
                const float *v = vals + (size_t)j * hd;
                for (int i = 0; i < hd; i++) o[i] += p * v[i];
            }
        }
    linear(&m->o, att, T, tmp, qx, dx, sx);
    for (size_t i = 0; i < (size_t)T * H; i++) out[i] = x[i] + tmp[i];
    for (int r = 0; r < T; r++) norm_row(out + (size_t)r * H, m->post_norm, m->eps_post, H, h2 + (size_t)r * H);
    linear(&m->gate_up, h2, T, gu, qx, dx, sx);
    for (int r = 0; r < T; r++)
        for (int i = 0; i < I; i++) {
            const float g = gu[(size_t)r * 2 * I + i];
            act[(size_t)r * I + i] = g / (1.0f + expf(-g)) * gu[(size_t)r * 2 * I + I + i];
        }
    linear(&m->down, act, T, tmp, qx, dx, sx);
    for (size_t i = 0; i < (size_t)T * H; i++) out[i] += tmp[i];
}

// EAGLE-1's layer input for T rows: x = fc(cat(embedding, feature)) + bias, with `fused` [T, 2H] as scratch
static void eagle1_input(const EDraft *m, int T, const float *emb, const float *feat, float *fused, float *x,
                         int8_t *qx, float *dx, float *sx) {
    const int H = m->H;
    for (int r = 0; r < T; r++) {
        memcpy(fused + (size_t)r * 2 * H, emb + (size_t)r * H, (size_t)H * sizeof(float));
        memcpy(fused + (size_t)r * 2 * H + H, feat + (size_t)r * H, (size_t)H * sizeof(float));
    }
    linear(&m->fc, fused, T, x, qx, dx, sx);
    if (m->fc_bias)
        for (int r = 0; r < T; r++)
            for (int i = 0; i < H; i++) x[(size_t)r * H + i] += m->fc_bias[i];
}

// One step's draft (module comment). feats [n, F] and next_ids [n] are the pairs not yet in the draft's cache, at
// positions first .. first + n - 1 (next_ids[n - 1] is the root); the spine then runs at positions first + n ..
// Out, as hydra_draft_shaped: codes[size - 1] (d * K + r of the chosen nodes, growth order), node_tokens[size]
// (the root, then theirs) and cand_tokens[D * K] (every candidate's token, for static trees); returns how many
// nodes were chosen. work: eagle_work_floats(m, n, first + n + D) floats; qx/dx/sx: activation scratch for
// min(n, EXTEND_ROWS) rows of the widest input (F or 2 * inter).
int eagle_draft_shaped(const EDraft *m, int n, const float *feats, const int64_t *next_ids, int first,
                        const float *cos_t, const float *sin_t, float *kc, float *vc, int cap, int D, int K, int size,
                        int *codes, int64_t *node_tokens, int64_t *cand_tokens, float *work, int8_t *qx, float *dx,
                        float *sx) {
    const int H = m->H;
    if (D * K > 8 * 64 || K > 64 || n < 1) return 0;
    const int rows = n < EXTEND_ROWS ? n : EXTEND_ROWS;
    float *x = work, *emb = x + (size_t)rows * H, *out = emb + (size_t)rows * H, *hn = out + (size_t)rows * H,
          *logits = hn + (size_t)rows * H, *lw = logits + m->V;
    float path_p[8 * 64];
    int top[64];
    int T = 0;
    for (int r0 = 0; r0 < n; r0 += T) {  // the new pairs, a block at a time (each attends to all before it)
        T = n - r0 < EXTEND_ROWS ? n - r0 : EXTEND_ROWS;
        for (int r = 0; r < T; r++) embed_row(&m->embed, next_ids[r0 + r], H, emb + (size_t)r * H);
        if (m->version == 3) linear(&m->fc, feats + (size_t)r0 * m->F, T, x, qx, dx, sx);
        else eagle1_input(m, T, emb, feats + (size_t)r0 * m->F, lw, x, qx, dx, sx);  // (lw: layer_rows' own scratch)
        layer_rows(m, T, x, emb, first + r0, cos_t, sin_t, kc, vc, cap, out, lw, qx, dx, sx);
    }
    float *state = out + (size_t)(T - 1) * H;  // the root's pair: predicts depth 1
    float spine = 1.0f;
    for (int d = 0; d < D; d++) {
        if (m->version == 3) norm_row(state, m->final_norm, m->eps_final, H, hn);
        linear(&m->head, m->version == 3 ? hn : state, 1, logits, qx, dx, sx);
        draft_top_k(logits, m->V, K, top);
        const float mx = logits[top[0]];
        const float sum = softmax_sum(logits, m->V, mx);
        for (int r = 0; r < K; r++) {
            cand_tokens[d * K + r] = m->vocab ? m->vocab[top[r]] : top[r];
            path_p[d * K + r] = spine * (expf(logits[top[r]] - mx) / sum);
        }
        spine = path_p[d * K];
        if (d + 1 < D) {  // the top-1 token at depth d + 1 sits at position first + n + d
            embed_row(&m->embed, cand_tokens[d * K], H, emb);
            if (m->version == 3) memcpy(x, state, (size_t)H * sizeof(float));
            else eagle1_input(m, 1, emb, state, lw, x, qx, dx, sx);
            layer_rows(m, 1, x, emb, first + n + d, cos_t, sin_t, kc, vc, cap, out, lw, qx, dx, sx);
            state = out;
        }
    }
    return confident_select(path_p, cand_tokens, D, K, size, next_ids[n - 1], codes, node_tokens);
}
