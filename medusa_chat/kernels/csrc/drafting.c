// The pieces the drafters share (drafting.h): Q8_0 ResBlocks, token embeddings, top-k, a softmax's normaliser and
// the confident-tree selection; hydra.c, medusa.c and eagle.c draft with them. Drafts only choose what the backbone
// verifies: none of this affects the output.
#include <immintrin.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "simd.h"
#include "qgemm.h"
#include "drafting.h"

// y = x + silu(W x + b), one row at a time in fixed order
void add_silu_bias(float *y, const float *x, const float *t, const float *b, int M, int H) {
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

// One token's embedding row (H floats) into out: from the fp32 table, the Q8_0 rows or the lookup callback
void embed_row(const Embed *e, int64_t tok, int H, float *out) {
    if (e->table)
        memcpy(out, e->table + (size_t)tok * H, (size_t)H * sizeof(float));
    else if (e->qs)
        q8_0_rows(e->qs, e->d, H, e->group, &tok, 1, out);
    else
        e->lookup(tok, out);
}

// The indices of the k largest of v[0 .. n), largest first; ties go to the lower index (a strict > test), so the
// result never depends on anything but the values. k is a tree's width at one depth (a few).
void draft_top_k(const float *v, int n, int k, int *out) {
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

// sum of exp(v[j] - mx) over j < n, 8 lanes at a time: a softmax's normaliser (a draft's confidence: it shapes
// the tree, verification decides what is accepted)
float softmax_sum(const float *v, int n, float mx) {
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 acc = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) acc = _mm256_add_ps(acc, exp8(_mm256_sub_ps(_mm256_loadu_ps(v + j), vm)));
    float sum = hsum8(acc);
    for (; j < n; j++) sum += expf(v[j] - mx);
    return sum;
}

// the size - 1 best candidates: selection by repeated maximum (a few dozen candidates at most); a strict > in
// candidate order (depth, then rank) keeps ties on the shallower, lower-ranked one
int confident_select(const float *path_p, const int64_t *cand_tok, int D, int K, int size, int64_t root,
                     int *codes, int64_t *node_tokens) {
    const int n = size - 1 < D * K ? size - 1 : D * K;
    unsigned char taken[8 * 64] = {0};
    for (int i = 0; i < n; i++) {
        int best = -1;
        for (int c = 0; c < D * K; c++)
            if (!taken[c] && (best < 0 || path_p[c] > path_p[best])) best = c;
        taken[best] = 1;
    }
    node_tokens[0] = root;
    int m = 0;
    for (int c = 0; c < D * K; c++)
        if (taken[c]) {
            codes[m] = c;
            node_tokens[++m] = cand_tok[c];
        }
    return m;
}
