// Medusa heads (heads.py: ResBlocks, then a vocabulary projection per head) drafted on block weights, in C.
//
// Published Medusa-1 heads each end in their own full-vocabulary lm_head; Medusa-2 checkpoints carry the same
// layout, and v2 heads share the backbone's. In fp32 PyTorch every step read every head's projection (4 heads x
// 49152 x 2048 fp32 = 1.6 GB at a 1B Llama shape, 5.7x a plain step's cost). Here the ResBlocks are Q8_0 block
// linears with a bias and each projection is a block linear (Q8_0, or Q4_1, or the backbone's own lm_head where
// the head's equals it), and a step evaluates only the heads its tree reaches (depth d needs heads 0 .. d - 1),
// keeping only their top-k. Drafts only choose what the backbone verifies: none of this affects the output.
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "decoder.h"
#include "drafting.h"
#include "qgemm.h"

typedef struct {
    int n_blocks;
    const Q8Lin *blocks;    // the head's ResBlocks
    BLin proj;              // its vocabulary projection (rows: the draft vocabulary when `vocab` is set)
    const int64_t *vocab;   // token id of each projection row, or NULL: row i is token i
} MHead;

// work: floats, >= 3 * H + max proj.N + 64; qx/dx/sx: the 8-bit activation scratch of one row of H
static void head_logits(int H, const MHead *h, const float *hidden, float *work, int8_t *qx, float *dx, float *sx,
                        float **logits) {
    float *y = work, *tmp = y + H;
    *logits = tmp + H;
    hydra_resblocks(1, H, h->n_blocks, h->blocks, hidden, y, tmp, qx, dx, sx);
#pragma omp parallel num_threads(mc_team())
    block_linear(&h->proj, y, 1, *logits, qx, dx, sx);
}

// Heads 0 .. D - 1 on the last accepted node's hidden state [H]: tokens[d * K + r] = head d's rank-r token; with
// probs, probs[d * K + r] = its softmax probability over the head's projection rows. K <= 64.
void medusa_draft(int H, const MHead *heads, int D, int K, const float *hidden, int64_t *tokens, float *probs,
                  float *work, int8_t *qx, float *dx, float *sx) {
    int top[64];
    for (int d = 0; d < D; d++) {
        const MHead *h = heads + d;
        float *logits;
        head_logits(H, h, hidden, work, qx, dx, sx, &logits);
        const int k = K < h->proj.N ? K : h->proj.N;
        draft_top_k(logits, h->proj.N, k, top);
        const float mx = logits[top[0]];
        const float sum = probs ? softmax_sum(logits, h->proj.N, mx) : 1.0f;
        for (int r = 0; r < K; r++) {
            const int i = top[r < k ? r : k - 1];
            tokens[d * K + r] = h->vocab ? h->vocab[i] : i;
            if (probs) probs[d * K + r] = r < k ? expf(logits[i] - mx) / sum : 0.0f;
        }
    }
}

// A tree of `size` nodes shaped by the draft's confidence (engine/drafters.py, confident_paths; as
// hydra_draft_shaped, on the Medusa heads' top-1 spine): candidate (d, r), the path (0,) * d + (r,), is head d's
// rank-r token with probability spine(d) * p_d(r), spine(d) the product of the heads' top-1 probabilities above
// it. codes / node_tokens / return value as hydra_draft_shaped's; work: floats, >= 3 * H + max N + 2 * D * K + 64.
int medusa_draft_shaped(int H, const MHead *heads, int D, int K, int size, const float *hidden, const int64_t *root,
                        int *codes, int64_t *node_tokens, float *work, int8_t *qx, float *dx, float *sx) {
    if (D * K > 8 * 64 || K > 64) return 0;
    int64_t cand_tok[8 * 64];
    float path_p[8 * 64];
    medusa_draft(H, heads, D, K, hidden, cand_tok, path_p, work, qx, dx, sx);
    float spine = 1.0f;
    for (int d = 0; d < D; d++) {
        for (int r = 0; r < K; r++) path_p[d * K + r] *= spine;
        spine = path_p[d * K];
    }
    return confident_select(path_p, cand_tok, D, K, size, root[0], codes, node_tokens);
}
