// The GGUF K-quant kernels of kquants.c (Q4_K, Q5_K, Q6_K weights, 8-bit activations), for the other C files.
#pragma once
#include <stdint.h>
// w is the interleaved superblock stream gguf_linears.py writes; K % 256 == 0
void q4_k_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                    float *sx);
void q5_k_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                    float *sx);
void q6_k_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                    float *sx);
// the K-quants' activation scheme (kquants.c): a scale per 32 (the default), one per superblock of 256 (llama.cpp's
// Q8_K), or per 32 as integer multiples of a superblock step (nested); the codes are what cbind.py passes
enum { KQ_NESTED = 1, KQ_PER32 = 32, KQ_PER256 = 256 };
void mc_set_kq_scheme(int scheme);
int mc_get_kq_scheme(void);
// the activations of a K-quant product (kind 2 Q4_K, 3 Q5_K, 4 Q6_K) into the scratch its groups read (kquants.c)
void kq_quantize(int kind, const float *x, int M, int K, int8_t *qx, float *dx, float *sx);
// column group g of a K-quant product (kind 2 Q4_K, 3 Q5_K, 4 Q6_K), all rows, to y [M, N] (kquants.c)
void kq_group_kind(int kind, const int8_t *qx, const float *dx, const float *sx, int M, int K, const uint8_t *w,
                   int N, int g, float *y);
// the file's K-quant blocks (type 0 Q4_K, 1 Q5_K, 2 Q6_K) -> the kernel's stream (kquants.c)
void kq_repack(int type, const uint8_t *raw, int rows, int K, int group, uint8_t *out);
// rows of a K-quant stream dequantized as ggml does (kquants.c)
void kq_rows(int type, const uint8_t *w, int K, int group, const int64_t *ids, int n, float *out);
