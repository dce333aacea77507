// What qgemm.c's and kquants.c's products share, below both: the team of every parallel region of ours (its
// size, the duet mode's switch), the prefetch hints the tiles read (qblock.h), and the activations' 8-bit rows
// (quantize_rows). Both files call into this one and it calls into neither, so the C files have no circle:
// qgemm.c -> kquants.c -> team.c.
#include <immintrin.h>
#include <stdint.h>
#include <omp.h>
#include "team.h"
#include "qblock.h"
#include "duet.h"

// The team size of every parallel region of ours (mc_set_threads; 0: the OpenMP runtime's default, i.e.
// omp_get_max_threads of the calling thread). A `num_threads` clause on each region rather than
// omp_set_num_threads: it applies whatever runtime (torch's bundled libgomp or the system one) and whichever
// thread calls, and it leaves torch's own pool size alone. With 1 the regions run on the caller alone, so no
// barrier ever waits for a descheduled thread (a loaded machine: engine/threads.py).
// -1: the duet mode (duet.c): every region runs on the caller alone, and the block products are shared with a
// helper thread that the caller never waits for.
static int mc_threads = 0, mc_duet_on = 0;
void mc_set_threads(int n) {
    mc_duet_on = n < 0 && duet_available();
    mc_threads = n < 0 ? 1 : n;
}
int mc_get_threads(void) { return mc_duet_on ? -1 : mc_threads > 0 ? mc_threads : omp_get_max_threads(); }
int mc_team(void) { return mc_threads > 0 ? mc_threads : omp_get_max_threads(); }
int mc_duet(void) { return mc_duet_on; }
// The team a region of ours really gets (tests: the clause applies on the runtime actually loaded)
int mc_team_probe(void) {
    int n = 0;
#pragma omp parallel num_threads(mc_team())
#pragma omp single
    n = omp_get_num_threads();
    return n;
}

int mc_pf_hint[3][2];  // qblock.h: all PF_T0 until prefetch.py sets what it measured
void mc_set_prefetch(int family, int many_rows, int hint) {
    if (family >= 0 && family < 3 && (many_rows == 0 || many_rows == 1) && hint >= PF_T0 && hint <= PF_OFF)
        mc_pf_hint[family][many_rows] = hint;
}
int mc_get_prefetch(int family, int many_rows) { return mc_pf_hint[family][many_rows != 0]; }

// Activation rows quantized per block of 32 the way llama.cpp does (Q8_1): q = round(x / d), d = max|x| / 127,
// plus s = d * sum(q) for Q4_1's minimum term. Integer dot products then cost a few instructions per 32 weights
// (the float-dequantizing alternative is compute-bound on AVX2 at one row). Per row, so row-invariant; the
// max and the integer sum are exact in any order, and the rounding is the FPU's round-to-nearest-even.
// qu (optional): the same codes plus 128, as unsigned bytes (the VNNI Q8_0 product's unsigned operand).
// sx may be NULL (no minimum term); s16 (optional): the integer code sums of each 16-half of a block (Q6_K's
// per-16 scales, kquants.c), exact in 16 bits (|sum| <= 16 * 127).
// Every block is independent: the blocks are shared among the threads of the team that calls this (an orphaned
// worksharing loop; called outside a parallel region, one thread does them all).
void quantize_rows(const float *x, int M, int K, int8_t *q, float *dx, float *sx, int8_t *qu, int16_t *s16) {
    const int nb = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
#pragma omp for collapse(2) schedule(static)
    for (int r = 0; r < M; r++) {
        for (int b = 0; b < nb; b++) {
            const float *xb = x + (size_t)r * K + (size_t)b * QK;
            __m256 mx = _mm256_andnot_ps(sign, _mm256_loadu_ps(xb));
            for (int i = 1; i < 4; i++) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + 8 * i)));
            const float d = hmax8(mx) / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            int32_t h0, h1;
            const __m256i codes = codes32(xb, _mm256_set1_ps(id), q + (size_t)r * K + (size_t)b * QK, &h0, &h1);
            if (qu)
                _mm256_storeu_si256((__m256i *)(qu + (size_t)r * K + (size_t)b * QK),
                                    _mm256_xor_si256(codes, _mm256_set1_epi8((char)0x80)));
            dx[(size_t)r * nb + b] = d;
            if (sx) sx[(size_t)r * nb + b] = d * (float)(h0 + h1);
            if (s16) s16[((size_t)r * nb + b) * 2] = (int16_t)h0, s16[((size_t)r * nb + b) * 2 + 1] = (int16_t)h1;
        }
    }
}
