// A second try at AMX for a tree step's extra rows (after benchmarks/amx_vs_vnni.c): two 32-weight blocks per
// TDPBSUD and weights unpacked once, ahead of time. A measurement, not product code.
//
// The first try paid a tile op per 32-weight block and unpacked the nibbles through memory on every call. Here
// the A tile holds each activation row twice, block-diagonally (row 2r = [block 2p of row r, zeros], row 2r + 1
// = [zeros, block 2p + 1]), so one TDPBSUD over 64 weights yields the two blocks' separate integer dots (each
// block keeps its own scales: exact, the same epilogue and FMA order as csrc/qgemm.c, so the same bits); the B
// tiles come straight from a copy of the weights unpacked to one code per byte (twice the bytes of Q4_1). Up to
// 8 rows per call. Timed as a whole step's projections of SmolLM2-135M (30 layers x qkv, o, gate_up, down), one
// parallel region per product, against the product's VNNI kernel on the same weights.
//
//   gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
//       -mamx-tile -mamx-int8 -I medusa_chat/csrc benchmarks/amx_two_blocks.c -o /tmp/amx_two_blocks
//   OMP_NUM_THREADS=2 /tmp/amx_two_blocks 30    # layers (2: the weights stay in L2)
//
// Measured 2026-12-02 on the 2-vCPU Xeon VM with AMX, ms per step's projections, VNNI / AMX (bitwise equal):
//   30 layers (66 MB of Q4_1, from L3/DRAM): M=1 2.88/3.79  M=2 3.24/3.80  M=3 3.48/4.17  M=4 3.76/4.33  M=8 4.92/6.06
//   2 layers (in cache):                     M=1 0.104/0.169  M=3 0.104/0.160  M=4 0.123/0.166  M=8 0.198/0.215
// Slower at every row count: with the weights streaming from L3/DRAM the projections are bound by the stream,
// which the unpacked copy doubles; in cache VNNI's extra rows are already nearly free. The same projections in
// ONE parallel region (as the native step runs them) take 1.34 ms at M=1 and 1.51 at M=3: 49 GB/s, against 54
// GB/s for a plain read loop over 64 MB on this VM. A tree step's extra rows cost little in the projections.
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
    for (int t = 0; t < 2; t++) {
        c.rows[0 + t] = 2 * M; c.colsb[0 + t] = 64;  // A
        c.rows[2 + t] = 16; c.colsb[2 + t] = 64;     // B
        c.rows[4 + t] = 2 * M; c.colsb[4 + t] = 64;  // C
    }
    _tile_loadconfig(&c);
}

// unpacked weights: per group, per pair of blocks: 16 rows x 64 B (1024 B); odd nb: last pair's second half zero
static uint8_t *unpack_q4(const uint8_t *qs, int N, int K) {
    const int nb = K / QK, ng = (N + GW - 1) / GW, np = (nb + 1) / 2;
    uint8_t *u = aligned_alloc(64, (size_t)ng * np * 1024);
    memset(u, 0, (size_t)ng * np * 1024);
    for (int g = 0; g < ng; g++)
        for (int b = 0; b < nb; b++) {
            const uint8_t *wb = qs + ((size_t)g * nb + b) * 256;
            uint8_t *o = u + ((size_t)g * np + b / 2) * 1024 + (b % 2) * 512;
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 64; i++) {
                    o[64 * j + i] = wb[64 * j + i] & 15;
                    o[64 * (4 + j) + i] = wb[64 * j + i] >> 4;
                }
        }
    return u;
}

// A tiles for a call: per pair p, 2M rows x 64 B: row 2r = [x(r, 2p), 0], row 2r+1 = [0, x(r, 2p+1)]
static void build_a(const int8_t *qx, int M, int K, int8_t *a) {
    const int nb = K / QK, np = (nb + 1) / 2;
    memset(a, 0, (size_t)np * 2 * M * 64);
    for (int p = 0; p < np; p++)
        for (int r = 0; r < M; r++)
            for (int h = 0; h < 2 && 2 * p + h < nb; h++)
                memcpy(a + ((size_t)p * 2 * M + 2 * r + h) * 64 + 32 * h, qx + (size_t)r * K + (2 * p + h) * QK, 32);
}

static inline void epi(const int32_t *cb, int M, int b, int nb, const float *dx, const float *sx, const uint16_t *d,
                       const uint16_t *mn, __m512 *acc, int h) {
    const __m512 db = load_f16x16(d + (size_t)b * GW), mb = load_f16x16(mn + (size_t)b * GW);
    for (int r = 0; r < M; r++) {
        const size_t xb = (size_t)r * nb + b;
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(cb + 16 * (2 * r + h))));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(db, _mm512_set1_ps(dx[xb])), dot, acc[r]);
        acc[r] = _mm512_fmadd_ps(mb, _mm512_set1_ps(sx[xb]), acc[r]);
    }
}

static void q4_1_amx2_group(const int8_t *a, const float *dx, const float *sx, int nb, int M, const uint8_t *u,
                            const uint16_t *d, const uint16_t *mn, float *y, int N, int n0) {
    __attribute__((aligned(64))) int32_t cb[2][16 * 16];
    const int np = (nb + 1) / 2;
    __m512 acc[8];
    for (int r = 0; r < M; r++) acc[r] = _mm512_setzero_ps();
    // software pipeline: tile ops of pair p+1 issued before the epilogue of pair p
    _tile_loadd(2, u, 64);
    _tile_loadd(0, a, 64);
    _tile_zero(4);
    _tile_dpbsud(4, 0, 2);
    _tile_stored(4, cb[0], 64);
    for (int p = 0; p < np; p++) {
        if (p + 1 < np) {
            const int t = (p + 1) & 1;
            if (t) {
                _tile_loadd(3, u + (size_t)(p + 1) * 1024, 64);
                _tile_loadd(1, a + (size_t)(p + 1) * 2 * M * 64, 64);
                _tile_zero(5);
                _tile_dpbsud(5, 1, 3);
                _tile_stored(5, cb[1], 64);
            } else {
                _tile_loadd(2, u + (size_t)(p + 1) * 1024, 64);
                _tile_loadd(0, a + (size_t)(p + 1) * 2 * M * 64, 64);
                _tile_zero(4);
                _tile_dpbsud(4, 0, 2);
                _tile_stored(4, cb[0], 64);
            }
        }
        epi(cb[p & 1], M, 2 * p, nb, dx, sx, d, mn, acc, 0);
        if (2 * p + 1 < nb) epi(cb[p & 1], M, 2 * p + 1, nb, dx, sx, d, mn, acc, 1);
    }
    const int w = N - n0 < GW ? N - n0 : GW;
    for (int r = 0; r < M; r++) store_cols16(y + (size_t)r * N + n0, acc[r], w);
}

static int8_t abuf[64 * 1024] __attribute__((aligned(64)));

void q4_1_gemm_amx2(const float *x, int M, int K, const uint8_t *u, const uint16_t *d, const uint16_t *mn, int N,
                    float *y, int8_t *qx, float *dx, float *sx) {
    const int nb = K / QK, ng = (N + GW - 1) / GW, np = (nb + 1) / 2;
#pragma omp parallel
    {
        quantize_rows(x, M, K, qx, dx, sx, NULL);
#pragma omp single
        build_a(qx, M, K, abuf);
        amx_config(M);
#pragma omp for schedule(static)
        for (int g = 0; g < ng; g++)
            q4_1_amx2_group(abuf, dx, sx, nb, M, u + (size_t)g * np * 1024, d + (size_t)g * nb * GW,
                            mn + (size_t)g * nb * GW, y, N, g * GW);
    }
}

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

typedef struct { int N, K; uint8_t *qs, *u; uint16_t *d, *mn; } Mat;

static Mat mk(int N, int K) {
    Mat m; m.N = N; m.K = K; int nb = K / QK;
    m.qs = aligned_alloc(64, (size_t)N * K / 2);
    m.d = aligned_alloc(64, (size_t)N * nb * 2 + 64); m.mn = aligned_alloc(64, (size_t)N * nb * 2 + 64);
    for (size_t i = 0; i < (size_t)N * K / 2; i++) m.qs[i] = rand();
    for (size_t i = 0; i < (size_t)N * nb; i++) { m.d[i] = _cvtss_sh((rand() % 1000) / 1e5f, 0); m.mn[i] = _cvtss_sh(-(rand() % 1000) / 1e4f, 0); }
    m.u = unpack_q4(m.qs, N, K);
    return m;
}

int main(int argc, char **argv) {
    if (!amx_request()) { printf("no AMX permission\n"); return 1; }
    int layers = argc > 1 ? atoi(argv[1]) : 30;
    // SmolLM2-135M per layer: qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536
    int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    Mat *ms = malloc(sizeof(Mat) * layers * 4);
    for (int l = 0; l < layers; l++) for (int s = 0; s < 4; s++) ms[l * 4 + s] = mk(shapes[s][0], shapes[s][1]);
    float *x = malloc(8 * 1536 * 4), *y1 = malloc(8 * 3072 * 4), *y2 = malloc(8 * 3072 * 4);
    for (int i = 0; i < 8 * 1536; i++) x[i] = (rand() / (float)RAND_MAX - 0.5f) * 3;
    int8_t *qx = aligned_alloc(64, 2 * 8 * 1536); float *dx = malloc(8 * 64 * 4), *sx = malloc(8 * 64 * 4);
    int Ms[] = {1, 2, 3, 4, 6, 8};
    for (int mi = 0; mi < 6; mi++) {
        int M = Ms[mi];
        int same = 1;
        for (int s = 0; s < 4; s++) {
            Mat *m = &ms[s];
            q4_1_gemm(x, M, m->K, m->qs, m->d, m->mn, m->N, y1, qx, dx, sx);
            q4_1_gemm_amx2(x, M, m->K, m->u, m->d, m->mn, m->N, y2, qx, dx, sx);
            same &= memcmp(y1, y2, (size_t)M * m->N * 4) == 0;
        }
        double tv = 0, ta = 0;
        for (int rep = 0; rep < 20; rep++) {
            double t0 = now();
            for (int i = 0; i < layers * 4; i++) { Mat *m = &ms[i]; q4_1_gemm(x, M, m->K, m->qs, m->d, m->mn, m->N, y1, qx, dx, sx); }
            double t1 = now();
            for (int i = 0; i < layers * 4; i++) { Mat *m = &ms[i]; q4_1_gemm_amx2(x, M, m->K, m->u, m->d, m->mn, m->N, y2, qx, dx, sx); }
            double t2 = now();
            tv += t1 - t0; ta += t2 - t1;
        }
        printf("step GEMMs M=%d: vnni %.3f ms  amx2 %.3f ms  bitwise %s\n", M, tv / 20 * 1e3, ta / 20 * 1e3, same ? "yes" : "NO");
    }
    return 0;
}
