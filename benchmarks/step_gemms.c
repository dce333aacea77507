// One decoding step's projections of SmolLM2-135M (30 layers x qkv 960x576, o 576x576, gate_up 3072x576, down
// 576x1536, Q4_1) through the product's kernel (csrc/qgemm.c), all in one parallel region as the native step runs
// them, for 1-8 rows; best of 30. With more layers than the model has, the weights no longer fit this machine's
// share of the L3 and stream from DRAM, as they do in a real step (the lm_head and the drafter come between).
//
//   gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
//       -I medusa_chat/csrc benchmarks/step_gemms.c -o /tmp/step_gemms          # add -DPF_AHEAD=0: no prefetch
//   OMP_NUM_THREADS=2 /tmp/step_gemms 30     # the model's 66 MB; 60: 133 MB, from DRAM
//
// Measured 2026-12-02 on the 2-vCPU Xeon VM (AVX512-VNNI, AMX), ms, rows 1 / 2 / 3 / 4 / 8:
//   60 layers, no prefetch:     5.45 / 6.18 / 6.68 / 7.33 / 9.67
//   60 layers, 8 KB ahead:      3.35 / 3.49 / 3.80 / 4.22 / 6.77   (4 KB: 3.26 / 3.45 / 3.67; 16 KB: 3.42 / 3.69 / 4.25)
//   30 layers, no prefetch:     1.41 / 1.46 / 1.62 / 1.84 / 3.41
//   30 layers, 8 KB ahead:      1.32 / 1.37 / 1.42 / 1.63 / 2.92
// A plain read loop over 64 MB / 256 MB runs at 54 / 30 GB/s here.
#include "qgemm.c"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <omp.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

typedef struct {
    int N, K;
    uint8_t *qs;
    uint16_t *d, *mn;
} Mat;

static Mat mk(int N, int K) {
    Mat m = {N, K, NULL, NULL, NULL};
    const int nb = K / QK;
    m.qs = aligned_alloc(64, (size_t)N * K / 2);
    m.d = aligned_alloc(64, ((size_t)N * nb * 2 + 127) / 64 * 64);
    m.mn = aligned_alloc(64, ((size_t)N * nb * 2 + 127) / 64 * 64);
    for (size_t i = 0; i < (size_t)N * K / 2; i++) m.qs[i] = rand();
    for (size_t i = 0; i < (size_t)N * nb; i++) {
        m.d[i] = _cvtss_sh((rand() % 1000) / 1e5f, 0);
        m.mn[i] = _cvtss_sh(-(rand() % 1000) / 1e4f, 0);
    }
    return m;
}

int main(int argc, char **argv) {
    const int layers = argc > 1 ? atoi(argv[1]) : 30;
    const int shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    Mat *ms = malloc(sizeof(Mat) * layers * 4);
    for (int l = 0; l < layers; l++)
        for (int s = 0; s < 4; s++) ms[l * 4 + s] = mk(shapes[s][0], shapes[s][1]);
    float *x = malloc(8 * 1536 * 4), *y = malloc(8 * 3072 * 4);
    for (int i = 0; i < 8 * 1536; i++) x[i] = (rand() / (float)RAND_MAX - 0.5f) * 3;
    int8_t *qx = aligned_alloc(64, 2 * 8 * 1536);
    float *dx = malloc(8 * 64 * 4), *sx = malloc(8 * 64 * 4);
    printf("%d layers (%.0f MB), PF_AHEAD %d\n", layers, layers * 3.54e6 * 20 / 32 / 1e6, PF_AHEAD);
    const int rows[] = {1, 2, 3, 4, 6, 8};
    for (int ri = 0; ri < 6; ri++) {
        const int M = rows[ri];
        double best = 1e9;
        for (int rep = 0; rep < 30; rep++) {
            const double t0 = now();
#pragma omp parallel
            for (int i = 0; i < layers * 4; i++) {
                const Mat *m = &ms[i];
                q4_1_gemm_team(x, M, m->K, m->qs, m->d, m->mn, m->N, y, qx, dx, sx);
            }
            const double t = now() - t0;
            best = t < best ? t : best;
        }
        printf("rows %d: %.3f ms\n", M, best * 1e3);
    }
    return 0;
}
