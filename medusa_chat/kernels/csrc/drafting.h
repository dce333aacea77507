// The drafters' shared pieces (drafting.c): Q8_0 linears with a bias, token embeddings, ResBlocks, top-k, a softmax's
// normaliser and the confident-tree selection; hydra.c, medusa.c (Medusa-1 / Medusa-2 heads) and eagle.c (EAGLE-1 and
// EAGLE-3 drafts) draft with them.
#pragma once
#include <stdint.h>

typedef struct {
    const int8_t *qs;
    const uint16_t *d;
    const int16_t *ws;
    const float *bias;
} Q8Lin;

// A token embedding: an fp32 table [vocab, H], or (table NULL) a Q8_0 block linear's rows (the tied lm_head's),
// or (both NULL) `lookup`, the embedding module's own lookup called back (a GGUF file's K-quant or F16 rows: a
// few rows a step, called only from the thread that drafts, outside any parallel region)
typedef struct {
    const float *table;
    const int8_t *qs;
    const uint16_t *d;
    int group;
    void (*lookup)(int64_t tok, float *out);
} Embed;

void embed_row(const Embed *e, int64_t tok, int H, float *out);
// y = x + silu(t + b) for M rows of H, one row at a time in fixed order (a ResBlock's or the Hydra cell's output)
void add_silu_bias(float *y, const float *x, const float *t, const float *b, int M, int H);
void hydra_resblocks(int M, int H, int n, const Q8Lin *blocks, const float *x, float *y, float *tmp, int8_t *qx,
                     float *dx, float *sx);
// the indices of the k (<= 64) largest of v[0 .. n), largest first; ties go to the lower index
void draft_top_k(const float *v, int n, int k, int *out);
float softmax_sum(const float *v, int n, float mx);
// the size - 1 most probable of D * K candidates (path_p, candidate order: depth, then rank) as codes d * K + r in
// growth order, their tokens after the root in node_tokens; returns how many were chosen
int confident_select(const float *path_p, const int64_t *cand_tok, int D, int K, int size, int64_t root,
                     int *codes, int64_t *node_tokens);
