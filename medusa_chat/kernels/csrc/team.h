// team.c: what the block products of qgemm.c and the K-quant products of kquants.c share, below both.
#pragma once
#include <stdint.h>

// our regions' team size: set from Python, read by every `num_threads` clause
void mc_set_threads(int n);
int mc_get_threads(void);
int mc_team(void);
// 1 while the duet mode is on (mc_set_threads(-1), duet.c)
int mc_duet(void);
// 8-bit activation blocks of 32: codes, scales, optional scaled sums / codes + 128 / per-16 sums
void quantize_rows(const float *x, int M, int K, int8_t *q, float *dx, float *sx, int8_t *qu, int16_t *s16);
