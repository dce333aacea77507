// The block kernels of qgemm.c (GGUF Q4_1 / Q8_0 weights, 8-bit activations), the standalone K-quant products
// and the duet runtime's block linears, for the other C files (with team.h: the team size, the duet switch).
#pragma once
#include <stdint.h>
#include "decoder.h"  // BLin
#include "team.h"     // the team size and the duet switch, for the files that include this one

int qgemm_isa(void);
int qgemm_group(void);
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
// One K-quant product on its own (Q4_K, Q5_K, Q6_K; the Python modules' calls: kquants.c's *_team in a region)
void q4_k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx, float *sx);
void q5_k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx, float *sx);
void q6_k_gemm(const float *x, int M, int K, const uint8_t *w, int N, float *y, int8_t *qx, float *dx, float *sx);
// A block linear in the duet mode (duet.c's runtime, any kind): 1 when done, 0 when that mode cannot run it
int duet_block_linear(const BLin *l, const float *x, int M, float *y);
