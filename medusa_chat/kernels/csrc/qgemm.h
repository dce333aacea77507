// The block kernels of qgemm.c (GGUF Q4_1 / Q8_0 weights, 8-bit activations), the team size of our parallel
// regions and the duet mode's switch, for the other C files.
#pragma once
#include <stdint.h>
#include "decoder.h"  // BLin

int qgemm_isa(void);
int qgemm_group(void);
// our regions' team size (qgemm.c): set from Python, read by every `num_threads` clause
void mc_set_threads(int n);
int mc_get_threads(void);
int mc_team(void);
// 1 while the duet mode is on (mc_set_threads(-1), duet.c)
int mc_duet(void);
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
// A block linear in the duet mode (duet.c's runtime, any kind): 1 when done, 0 when that mode cannot run it
int duet_block_linear(const BLin *l, const float *x, int M, float *y);
