// The decoder step's model description (block linears, layers, the model) and the helpers its C files share.
#pragma once
#include <stdint.h>

typedef struct {
    int kind;  // 0 = Q8_0, 1 = Q4_1, 2 = Q4_K, 3 = Q5_K, 4 = Q6_K (kquants.c: qs is the stream, d and aux unused)
    int N, K;  // out, in features
    const void *qs;
    const uint16_t *d;  // fp16 scales
    const void *aux;    // Q4_1: the minimums (fp16); Q8_0: the block sums of the codes (int16)
} BLin;

typedef struct {
    const float *norm1, *norm2;
    float eps1, eps2;
    BLin qkv, o, gate_up, down;  // q|k|v and gate|up fused along the output dimension
    // kind -1: absent (fused above). Else v (up) runs apart and qkv holds q|k (gate_up holds gate): a file whose
    // v (up) blocks are of another type than q/k's (gate's), e.g. a Q4_K_M file's Q6_K attn_v in some layers.
    BLin v, up;
    // fp32 [q | k | v] biases (Qwen2's q/k/v projections), added to every row after the projection; NULL: none
    const float *qkv_bias;
    // Qwen3: fp32 RMSNorm weights [head_dim] applied to every q head (q_norm) and k head (k_norm) after the
    // biases and before rotary, with qk_eps; NULL: none
    const float *q_norm, *k_norm;
    float qk_eps;
} DLayer;

typedef struct {
    int n_layers, hidden, n_heads, n_kv, head_dim, inter;
    float scale, final_eps;
    const float *final_norm;
    const DLayer *layers;
} DModel;

// A block linear as team work (qgemm.c, *_team): inside decoder_forward's parallel region the threads share it,
// called alone (the drafter) one thread runs it.
void block_linear(const BLin *l, const float *x, int M, float *y, int8_t *qx, float *dx, float *sx);
