// Exact tree attention over the fp16 KV cache (attention.c): the cache's element type, the (row, head) pairs
// of the weighted value sums, and the chunked attention the decoder step calls.
#pragma once
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>
#include "decoder.h"

// Software prefetch of the KV cache in attention, keys / values ahead of the ones being read. A layer's keys and
// values come from L3 or DRAM (the step's weights went through the caches since the previous layer), in runs
// too short for the hardware prefetcher to ramp up on. Measured on the 2-vCPU Xeon, step latency at 300 / 1000
// cached tokens: 1 node 4.13 -> 3.85 / 5.94 -> 5.19 ms, 3 nodes 5.67 -> 5.23 / 8.20 -> 7.42 ms (3 runs each,
// alternating builds). A prefetch is a hint: the arithmetic, so the bits, are unchanged.
#define PF_KEYS 32
#define PF_VALUES 48
#define RC 16    // attention rows per chunk (bounds the score buffer)
#define JB 64    // keys per task when scoring the shared prefix
#define MAX_HD 256  // head_dim limit of this step (checked by block_forward.py)

// The KV cache holds fp16 (as llama.cpp's does by default): attention of a step is bound by reading the cached
// keys and values, and half the bytes read in about half the time. Every read converts exactly to fp32, and a
// key or value is rounded once, when written, so all paths see the same values.
typedef uint16_t kv_t;
static inline __m256 load_kv(const kv_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
// Values beyond fp16's range are saturated to +-65504 instead of becoming inf (an inf key would turn the whole
// softmax row into NaN); Llama-family keys and values are far inside the range, so this never changes them.
static inline void store_kv(kv_t *dst, const float *src, int hd) {
    const __m256 hi = _mm256_set1_ps(65504.0f), lo = _mm256_set1_ps(-65504.0f);
    for (int i = 0; i < hd; i += 8) {
        const __m256 v = _mm256_max_ps(_mm256_min_ps(_mm256_loadu_ps(src + i), hi), lo);
        _mm_storeu_si128((__m128i *)(dst + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
}

// Block keys of row r: its own list (tree path) or, with no list, the causal block 0 .. r.
static inline int block_len(const int *blen, int r) { return blen ? blen[r] : r + 1; }
static inline int block_slot(const int *blk, int stride, int r, int b) { return blk ? blk[(size_t)r * stride + b] : b; }

// Weighted sums of values for P (row, head) pairs of one KV head, dims [d0, d0 + 8W): for each pair
// o = inv * sum_jj p[jj] * v[key jj], keys in order (the shared prefix, then the row's own block keys). A prefix
// value is read and converted from fp16 once for all P pairs (the pairs are the group's query heads times the
// tree rows), instead of once per pair. Per output lane the arithmetic is the same sequence whatever P is
// (acc = 0, acc = fma(p_j, v_j, acc) over the keys in order, then * inv), so a pair's result never depends on
// the pairs computed beside it. W and P are compile-time constants at every call: the accumulators stay in
// registers.
typedef struct {
    const float *p;  // the pair's softmax numerators [L]
    float *o;        // the pair's output (head slice of its row)
    float inv;       // 1 / sum(p)
    int row;         // row in the step (for its block keys)
} WPair;

// Attention of rows [r0, r0 + R) for one layer, the query heads of KV heads [kh0, kh1), as team work (each
// stage's items shared among the threads, a barrier after each). q: rows of the qkv buffer (stride qkv_n), out
// [R, n_heads * hd] (row r0 first; only those heads' columns written); S and pairs: scratch (the duet's helper
// passes its own). A (row, head)'s arithmetic does not depend on the head range it was computed in.
void attend_chunk(const DModel *m, const float *qkv, int qkv_n, const kv_t *kc, const kv_t *vc, size_t cap,
                  int start, int r0, int R, const int *blk, const int *blen, int stride, float *S,
                  size_t s_stride, WPair *pairs, float *out, int kh0, int kh1);
