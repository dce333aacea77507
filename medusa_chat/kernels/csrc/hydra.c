// The Hydra drafter (heads.py: ResBlock, TokenCell) on Q8_0 block weights, and the shaped-tree draft.
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"
#include "decoder.h"
#include "qgemm.h"
#include "drafting.h"
// The drafter runs a few of these per step at batch 1-8; in PyTorch each is ~10 small ops whose dispatch cost
// more than their arithmetic. Drafts only choose what the backbone verifies: none of this affects the output.
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

// A whole Hydra draft (engine/drafters.py, HydraDrafter.propose) in one call: the cell folds the root into the last
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
#pragma omp parallel num_threads(mc_team())
        block_linear(proj, y, I, logits, qx, dx, sx);
        for (int i = 0; i < I; i++) draft_top_k(logits + (size_t)i * proj->N, proj->N, K, top + i * 64);
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

// A tree shaped by the draft's confidence (EAGLE-2's dynamic tree on the Hydra spine; engine/drafters.py,
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
#pragma omp parallel num_threads(mc_team())
        block_linear(proj, y, 1, logits, qx, dx, sx);
        draft_top_k(logits, V, K, top);
        // softmax normaliser: sum of exp(l - max), 8 lanes at a time (a confidence: it shapes the tree, verification
        // decides what is accepted)
        const float mx = logits[top[0]];
        const float sum = softmax_sum(logits, V, mx);
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
    return confident_select(path_p, cand_tok, D, K, size, root[0], codes, node_tokens);
}

