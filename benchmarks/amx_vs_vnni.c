// Does AMX make a tree step's extra rows cheaper? A measurement, not product code.
//
// An AMX-INT8 version of the Q4_1 block GEMM (csrc/qgemm.c's layout and float epilogue: TDPBSUD computes each
// block's exact integer dot products for all rows at once) timed against the product's AVX512-VNNI kernel on the
// same weights, with a bitwise check (exact integer block sums, the same FMA order: the same bits).
//
//   gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
//       -mamx-tile -mamx-int8 -I medusa_chat/csrc benchmarks/amx_vs_vnni.c -o /tmp/amx_vs_vnni
//   /tmp/amx_vs_vnni 3072; /tmp/amx_vs_vnni 49152      # N (K = 576, SmolLM2's hidden size); needs an AMX CPU
//
// Measured 2026-12-02 on a 2-vCPU Intel Xeon VM with AMX (family 6 model 167), 2 threads, us per call, VNNI / AMX:
//   N = 3072 : M=1 10.4/23.9  M=3 17.5/28.4  M=4 22.0/30.8  M=8 41.8/40.8  M=16 80.6/68.9   (bitwise equal)
//   N = 49152: M=1 316/532    M=3 346/590    M=4 382/627
// A tile op's fixed cost (unpacking the nibbles to a B tile through memory, tile loads, storing C per 32-weight
// block for the block's scales) outweighs its arithmetic below ~8 rows; CPU trees are <= 8 nodes, so the
// product keeps the VNNI kernel on AMX machines too.
#include "qgemm.c"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef struct { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((packed)) tilecfg;

static int amx_request(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

static void amx_config(int M) {
    tilecfg c; memset(&c, 0, sizeof c); c.palette_id = 1;
    c.rows[0] = M; c.colsb[0] = 32;  // A: activations, M x 32 bytes
    c.rows[1] = 8; c.colsb[1] = 64;  // B: weights, 8 x 64
    c.rows[2] = M; c.colsb[2] = 64;  // C
    c.rows[3] = M; c.colsb[3] = 32;  // A'
    c.rows[4] = 8; c.colsb[4] = 64;  // B'
    c.rows[5] = M; c.colsb[5] = 64;  // C'
    _tile_loadconfig(&c);
}


#define MAXNB 64
static void q4_1_amx_group(const int8_t *qx, const float *dx, const float *sx, int nb, int K, int M, const uint8_t *qs,
                           const uint16_t *d, const uint16_t *mn, float *y, int N, int n0) {
    __attribute__((aligned(64))) static __thread uint8_t bb[MAXNB][8 * 64];
    __attribute__((aligned(64))) static __thread int32_t cb[MAXNB][16 * 16];
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t *wb = qs + (size_t)b * 256;
        for (int j = 0; j < 4; j++) {
            const __m512i raw = _mm512_loadu_si512((const void *)(wb + 64 * j));
            _mm512_store_si512((void *)(bb[b] + 64 * j), _mm512_and_si512(raw, m4));
            _mm512_store_si512((void *)(bb[b] + 64 * (4 + j)), _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4));
        }
    }
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        _tile_loadd(1, bb[b], 64);
        _tile_loadd(0, qx + (size_t)b * QK, K);
        _tile_zero(2);
        _tile_loadd(4, bb[b + 1], 64);
        _tile_loadd(3, qx + (size_t)(b + 1) * QK, K);
        _tile_zero(5);
        _tile_dpbsud(2, 0, 1);
        _tile_dpbsud(5, 3, 4);
        _tile_stored(2, cb[b], 64);
        _tile_stored(5, cb[b + 1], 64);
    }
    for (; b < nb; b++) {
        _tile_loadd(1, bb[b], 64);
        _tile_loadd(0, qx + (size_t)b * QK, K);
        _tile_zero(2);
        _tile_dpbsud(2, 0, 1);
        _tile_stored(2, cb[b], 64);
    }
    for (int r0 = 0; r0 < M; r0 += 4) {
        const int mr = M - r0 < 4 ? M - r0 : 4;
        __m512 acc[4];
        for (int r = 0; r < mr; r++) acc[r] = _mm512_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const __m512 db = load_f16x16(d + (size_t)b * GW), mb = load_f16x16(mn + (size_t)b * GW);
            for (int r = 0; r < mr; r++) {
                const size_t xb = (size_t)(r0 + r) * nb + b;
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cb[b] + 16 * (r0 + r))));
                acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(db, _mm512_set1_ps(dx[xb])), dot, acc[r]);
                acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(sx[xb]), acc[r]);
            }
        }
        const int w = N - n0 < GW ? N - n0 : GW;
        for (int r = 0; r < mr; r++) store_cols16(y + (size_t)(r0 + r) * N + n0, acc[r], w);
    }
}

void q4_1_gemm_amx(const float *x, int M, int K, const uint8_t *qs, const uint16_t *d, const uint16_t *mn, int N,
                   float *y, int8_t *qx, float *dx, float *sx) {
    const int nb = K / QK, ng = (N + GW - 1) / GW;
#pragma omp parallel
    {
        quantize_rows(x, M, K, qx, dx, sx, NULL);
        amx_config(M);
#pragma omp for schedule(static)
        for (int g = 0; g < ng; g++)
            q4_1_amx_group(qx, dx, sx, nb, K, M, qs + (size_t)g * nb * GW * 16, d + (size_t)g * nb * GW,
                           mn + (size_t)g * nb * GW, y, N, g * GW);
    }
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

int main(int argc, char **argv) {
    if (!amx_request()) { printf("no AMX permission\n"); return 1; }
    int K = 576, N = argc > 1 ? atoi(argv[1]) : 3072;
    int nb = K / QK;
    uint8_t *qs = aligned_alloc(64, (size_t)N * K / 2);
    uint16_t *d = aligned_alloc(64, (size_t)N * nb * 2 + 64), *mn = aligned_alloc(64, (size_t)N * nb * 2 + 64);
    for (size_t i = 0; i < (size_t)N * K / 2; i++) qs[i] = rand();
    for (size_t i = 0; i < (size_t)N * nb; i++) { d[i] = _cvtss_sh((rand() % 1000) / 1e5f, 0); mn[i] = _cvtss_sh(-(rand() % 1000) / 1e4f, 0); }
    float *x = malloc(16 * K * 4), *y1 = malloc(16 * N * 4), *y2 = malloc(16 * N * 4);
    for (int i = 0; i < 16 * K; i++) x[i] = (rand() / (float)RAND_MAX - 0.5f) * 3;
    int8_t *qx = aligned_alloc(64, 2 * 16 * K); float *dx = malloc(16 * nb * 4), *sx = malloc(16 * nb * 4);
    int Ms[] = {1, 2, 3, 4, 6, 8, 16};
    for (int mi = 0; mi < 7; mi++) {
        int M = Ms[mi];
        q4_1_gemm(x, M, K, qs, d, mn, N, y1, qx, dx, sx);
        q4_1_gemm_amx(x, M, K, qs, d, mn, N, y2, qx, dx, sx);
        int same = memcmp(y1, y2, (size_t)M * N * 4) == 0;
        int reps = 2000;
        double t0 = now();
        for (int i = 0; i < reps; i++) q4_1_gemm(x, M, K, qs, d, mn, N, y1, qx, dx, sx);
        double t1 = now();
        for (int i = 0; i < reps; i++) q4_1_gemm_amx(x, M, K, qs, d, mn, N, y2, qx, dx, sx);
        double t2 = now();
        printf("N=%d M=%2d vnni %.1f us  amx %.1f us  bitwise %s\n", N, M, (t1 - t0) / reps * 1e6, (t2 - t1) / reps * 1e6, same ? "yes" : "NO");
    }
    return 0;
}
