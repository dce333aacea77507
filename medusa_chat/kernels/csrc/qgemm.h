// The block kernels of qgemm.c (GGUF Q4_1 / Q8_0 weights, 8-bit activations) and kquants.c (Q4_K / Q5_K /
// Q6_K), for the other C files.
#pragma once
#include <stdint.h>

int qgemm_isa(void);
int qgemm_group(void);
// our regions' team size (qgemm.c): set from Python, read by every `num_threads` clause
void mc_set_threads(int n);
int mc_get_threads(void);
int mc_team(void);
void q4_1_gemm_team(const float *x, int M, int K, const uint8_t *qs, const uint16_t *d, const uint16_t *mn, int N,
                    float *y, int8_t *qx, float *dx, float *sx);
void q8_0_gemm_team(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws, int N,
                    float *y, int8_t *qx, float *dx, float *sx);
int q8_0_gemm_argmax(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws, int N,
                     int64_t *out, int8_t *qx, float *dx, float *sx);
void q4_1_gemm(const float *x, int M, int K, const uint8_t *qs, const uint16_t *d, const uint16_t *mn, int N,
               float *y, int8_t *qx, float *dx, float *sx);
void q8_0_gemm(const float *x, int M, int K, const int8_t *qs, const uint16_t *d, const int16_t *ws, int N, float *y,
               int8_t *qx, float *dx, float *sx);
void q8_0_rows(const int8_t *qs, const uint16_t *d, int K, int group, const int64_t *ids, int n, float *out);
// 8-bit activation blocks of 32 (qgemm.c): codes, scales, optional scaled sums / codes + 128 / per-16 sums
void quantize_rows(const float *x, int M, int K, int8_t *q, float *dx, float *sx, int8_t *qu, int16_t *s16);
// K-quants (kquants.c): w is the interleaved superblock stream gguf_linears.py writes; K % 256 == 0
void q4_k_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                    float *sx);
void q5_k_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                    float *sx);
void q6_k_gemm_team(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx,
                    float *sx);
void q4_k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx, float *sx);
void q5_k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx, float *sx);
void q6_k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx, float *sx);
// column group g of a K-quant product (kind 2 Q4_K, 3 Q5_K, 4 Q6_K), all rows, to y [M, N] (kquants.c)
void kq_group_kind(int kind, const int8_t *qx, const float *dx, const float *sx, int M, int K, const uint8_t *w,
                   int N, int g, float *y);
// the file's K-quant blocks (type 0 Q4_K, 1 Q5_K, 2 Q6_K) -> the kernel's stream (kquants.c)
void kq_repack(int type, const uint8_t *raw, int rows, int K, int group, uint8_t *out);
// rows of a K-quant stream dequantized as ggml does (kquants.c)
void kq_rows(int type, const uint8_t *w, int K, int group, const int64_t *ids, int n, float *out);
