// A product's column groups shared between the calling thread and one helper thread that never makes the caller
// wait for it: the runtime of the native step on a machine whose other processes keep a core busy.
//
// Why: the OpenMP step (decoder.c) ends every worksharing loop with a barrier. When another process holds one
// of the two cores, the thread there runs only in the scheduler's slices, and each barrier (~500 a step) waits
// for it: a step took up to 10x its quiet time, and one thread alone (no barrier) was the best there was, half
// the quiet speed. Here the caller ("main") runs the whole step; only the block products and the attention's KV
// heads (decoder.c) are shared. Main takes
// chunks of column groups from the front, the helper from the back, each with one compare-and-swap on a word
// that also names the product (so a helper that slept through a product can never take a chunk of the next).
// The helper computes into a staging buffer of its own and publishes each finished chunk; main copies finished
// chunks into the output. When main runs out of chunks and the helper's current one is not done within about
// two of main's chunk times, main computes that chunk itself and moves on: a descheduled helper costs a chunk,
// never a scheduler slice. Quiet, the two share every product about evenly.
//
// Exactness: a chunk is computed by the same tile code whoever runs it (the kernels' arithmetic is per output
// column: qgemm.c), and staged values are copied bit for bit, so the outputs equal the one-thread and the OpenMP
// step's exactly (tests/test_threads.py).
//
// Memory the helper touches: the weights (alive as long as the model), its staging buffer, scratch and the
// activation codes, all owned here and only ever grown while the helper is known to be out of any chunk, and in
// attention the step's qkv rows and the KV cache, which block_forward.py frees only after duet_quiesce. A helper
// that resumes a stale chunk reads and writes only these. The helper writes nothing main reads unless it finished
// that chunk of the current product, and it is one thread, so a stale chunk's writes precede its later ones.
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include "duet.h"

#define SLOTS 4           // product descriptions in flight (a stale helper may still read an old one)
#define ARGS_BYTES 256    // a product's arguments, copied by value
#define SPIN_NS 200000    // the helper spins this long for the next product, then sleeps on a futex

typedef struct {
    duet_chunk_fn fn;
    _Alignas(64) unsigned char args[ARGS_BYTES];
} Job;

// state: seq (32 bits) | lo (16) | hi (16): chunks [lo, hi) of product seq are unclaimed
static _Atomic uint64_t state;
// the helper's finished chunks of product seq: seq (32) | count (32); they are [n_chunks - count, n_chunks)
static _Atomic uint64_t done;
static _Atomic int helper_busy;      // inside a chunk (stale or not)
static _Atomic int helper_sleeping;
static _Atomic uint32_t wake_word;
static Job jobs[SLOTS];
// tests: the helper sleeps up to this long before each chunk, as if descheduled (main then steals, and the
// helper's stale chunks must change nothing)
static _Atomic int test_delay_us;
void duet_set_test_delay(int us) { atomic_store(&test_delay_us, us); }
static long stolen;  // chunks main computed after the helper had claimed them (main's counter)
long duet_stolen_chunks(void) { return stolen; }
static uint32_t seq_now;             // main's product counter
static pthread_once_t started = PTHREAD_ONCE_INIT;
static int helper_ok;
// staging (the helper's outputs: a product's [M, N] floats, or an argmax's per-chunk row bests) and the
// activation codes the products read; grown only while the helper is out of every chunk
static float *stage;
static size_t stage_bytes;
static unsigned char *codes;
static size_t codes_bytes;

static inline uint64_t pack(uint32_t seq, uint32_t lo, uint32_t hi) {
    return ((uint64_t)seq << 32) | ((uint64_t)lo << 16) | hi;
}
static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}
static void futex_wait(_Atomic uint32_t *w, uint32_t v) { syscall(SYS_futex, w, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0); }
static void futex_wake(_Atomic uint32_t *w) { syscall(SYS_futex, w, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0); }

static void *helper_main(void *unused) {
    (void)unused;
    // The helper runs only on time no other thread wants (SCHED_IDLE): on a busy core it would otherwise take a
    // fair share from the caller's own core too (3 threads on 2 cores: the caller, the critical path, at 2/3).
    // (Measured on 2 cores with a spinning process: a helper at nice 0, 5 or 10 decoded no faster than one thread
    // either; in the browser case nice 0 read 0.76x `ask` against SCHED_IDLE's 0.77-0.81x.)
    const struct sched_param idle = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
    uint32_t cur = 0, count = 0;
    unsigned seed = 1;
    uint64_t idle_since = now_ns();
    unsigned spins = 0;
    for (;;) {
        const uint64_t s = atomic_load_explicit(&state, memory_order_acquire);
        const uint32_t seq = (uint32_t)(s >> 32), lo = (uint32_t)(s >> 16) & 0xFFFF, hi = (uint32_t)s & 0xFFFF;
        if (lo < hi) {
            Job job = jobs[seq % SLOTS];  // read before the claim; the claim succeeding proves it was current
            atomic_store_explicit(&helper_busy, 1, memory_order_seq_cst);
            uint64_t expect = s;
            if (atomic_compare_exchange_strong_explicit(&state, &expect, pack(seq, lo, hi - 1), memory_order_acq_rel,
                                                        memory_order_acquire)) {
                if (seq != cur) cur = seq, count = 0;
                const int c = (int)hi - 1;
                const int delay = atomic_load_explicit(&test_delay_us, memory_order_relaxed);
                if (delay > 0) usleep((useconds_t)(rand_r(&seed) % (unsigned)delay));  // a descheduled helper
                job.fn(job.args, c, stage);
                count++;
                atomic_store_explicit(&done, ((uint64_t)seq << 32) | count, memory_order_release);
            }
            atomic_store_explicit(&helper_busy, 0, memory_order_release);
            idle_since = now_ns();
            spins = 0;
            continue;
        }
        _mm_pause();
        if (++spins % 64 == 0 && now_ns() - idle_since > SPIN_NS) {
            const uint32_t w = atomic_load_explicit(&wake_word, memory_order_seq_cst);
            atomic_store_explicit(&helper_sleeping, 1, memory_order_seq_cst);
            const uint64_t again = atomic_load_explicit(&state, memory_order_seq_cst);
            if (((uint32_t)(again >> 16) & 0xFFFF) >= ((uint32_t)again & 0xFFFF)) futex_wait(&wake_word, w);
            atomic_store_explicit(&helper_sleeping, 0, memory_order_seq_cst);
            idle_since = now_ns();
        }
    }
    return NULL;
}

// A forked child has no helper thread (only the forking thread is copied): the duet is off there, and a helper
// that was inside a chunk at the fork must not look busy forever to the child's quiesce.
static void forked_child(void) {
    helper_ok = 0;
    atomic_store(&helper_busy, 0);
    atomic_store(&helper_sleeping, 0);
}

static void start_helper(void) {
    pthread_atfork(NULL, NULL, forked_child);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    helper_ok = pthread_create(&t, &attr, helper_main, NULL) == 0;
    pthread_attr_destroy(&attr);
}

int duet_available(void) {
    pthread_once(&started, start_helper);
    return helper_ok;
}

// One caller at a time (two Python threads may step two engines at once): a second caller gets 0 from
// duet_begin and runs its product the ordinary way, on its own thread.
static pthread_mutex_t caller = PTHREAD_MUTEX_INITIALIZER;
int duet_begin(void) { return duet_available() && pthread_mutex_trylock(&caller) == 0; }
void duet_end(void) { pthread_mutex_unlock(&caller); }

// Sleeps rather than spins after a moment: the helper runs only on idle time, so a caller spinning on its core
// while another process holds the other one would keep it from ever finishing.
void duet_quiesce(void) {
    for (int i = 0; atomic_load_explicit(&helper_busy, memory_order_acquire); i++) {
        if (i < 1000) _mm_pause();
        else usleep(50);
    }
}

// grow a buffer only while the helper is out of every chunk (it may be reading or writing the old one)
static void *grow(void *buf, size_t *have, size_t need) {
    if (need <= *have) return buf;
    duet_quiesce();
    free(buf);
    size_t bytes = need + need / 4 + 4096;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes) != 0) p = NULL;
    *have = p ? bytes : 0;
    return p;
}

void *duet_codes(size_t bytes) {
    codes = grow(codes, &codes_bytes, bytes);
    return codes;
}

static unsigned char *helper_scratch;
static size_t helper_scratch_bytes;
void *duet_helper_scratch(size_t bytes) {
    helper_scratch = grow(helper_scratch, &helper_scratch_bytes, bytes);
    return helper_scratch;
}

// Run chunks 0..n_chunks-1 of a product: fn(args, c, y) computes chunk c's columns [c * cols, (c + 1) * cols)
// of all M rows into y laid out [M, N] (argmax: chunk c's per-row best into ((float, int64) *)y + c * M).
// Main's results go to `out`, the helper's to the staging buffer and are copied over; argmax returns the merged
// per-row best index in `best_index` (first of equal maxima, NaN the largest: q8_0_gemm_argmax's rule).
static int run(duet_chunk_fn fn, const void *args, size_t args_size, int n_chunks, int cols, int M, int N,
               float *out, int argmax, int64_t *best_index) {
    if (!duet_available() || args_size > ARGS_BYTES || n_chunks > 0xFFFF || n_chunks < 1) return 0;
    const size_t need = argmax ? (size_t)n_chunks * M * sizeof(DuetBest) : (size_t)M * N * sizeof(float);
    stage = grow(stage, &stage_bytes, need);
    if (!stage) return 0;
    const uint32_t seq = ++seq_now;
    Job *job = &jobs[seq % SLOTS];
    job->fn = fn;
    memcpy(job->args, args, args_size);
    atomic_store_explicit(&state, pack(seq, 0, (uint32_t)n_chunks), memory_order_seq_cst);
    if (atomic_load_explicit(&helper_sleeping, memory_order_seq_cst)) {
        atomic_fetch_add_explicit(&wake_word, 1, memory_order_seq_cst);
        futex_wake(&wake_word);
    }
    if (atomic_load_explicit(&test_delay_us, memory_order_relaxed) > 0) {
        // tests: let the (late) helper claim a chunk first, so that stealing really happens even when other
        // processes leave an idle-time helper no time; sleeping, so that it can run on this core
        for (int i = 0; i < 20000 && (uint32_t)atomic_load(&state) == (uint32_t)n_chunks; i++) usleep(50);
    }
    // main: from the front
    int mine = 0;
    const uint64_t t0 = now_ns();
    for (;;) {
        uint64_t s = atomic_load_explicit(&state, memory_order_acquire);
        const uint32_t lo = (uint32_t)(s >> 16) & 0xFFFF, hi = (uint32_t)s & 0xFFFF;
        if (lo >= hi) break;
        if (!atomic_compare_exchange_weak_explicit(&state, &s, pack(seq, lo + 1, hi), memory_order_acq_rel,
                                                   memory_order_acquire))
            continue;
        fn(job->args, (int)lo, out);
        mine++;
    }
    const uint64_t t1 = now_ns();
    const int helper_chunks = n_chunks - mine;
    // the helper's chunks are the last `helper_chunks`; wait about two of main's chunk times for the one in flight
    const uint64_t patience = mine ? 2 * (t1 - t0) / (uint64_t)mine + 2000 : 20000;
    int have = 0;
    for (;;) {
        const uint64_t d = atomic_load_explicit(&done, memory_order_acquire);
        have = (uint32_t)(d >> 32) == seq ? (int)(uint32_t)d : 0;
        if (have >= helper_chunks || now_ns() - t1 > patience) break;
        _mm_pause();
    }
    // the helper's unfinished chunk(s) (at most the one in flight): main computes them into the output itself
    for (int c = mine; c < n_chunks - have; c++) fn(job->args, c, out), stolen++;
    const int first_staged = n_chunks - have;
    if (!argmax) {
        for (int c = first_staged; c < n_chunks; c++) {
            const int c0 = c * cols, w = (c0 + cols <= N ? cols : N - c0);
            for (int r = 0; r < M; r++)
                memcpy(out + (size_t)r * N + c0, stage + (size_t)r * N + c0, (size_t)w * sizeof(float));
        }
        return 1;
    }
    const DuetBest *mine_b = (const DuetBest *)out, *staged = (const DuetBest *)stage;
    for (int r = 0; r < M; r++) {
        float best = 0.0f;
        int64_t index = -1;
        for (int c = 0; c < n_chunks; c++) {
            const DuetBest *b = (c < first_staged ? mine_b : staged) + (size_t)c * M + r;
            if (b->index >= 0 && (index < 0 || b->value > best || (b->value != b->value && best == best)))
                best = b->value, index = b->index;
        }
        best_index[r] = index;
    }
    return 1;
}

int duet_columns(duet_chunk_fn fn, const void *args, size_t args_size, int n_chunks, int cols, int M, int N,
                 float *y) {
    return run(fn, args, args_size, n_chunks, cols, M, N, y, 0, NULL);
}

int duet_argmax(duet_chunk_fn fn, const void *args, size_t args_size, int n_chunks, int M, int64_t *out) {
    static DuetBest *work;  // main's chunks' bests (main alone touches it)
    static size_t work_n;
    const size_t need = (size_t)n_chunks * M;
    if (need > work_n) {
        free(work);
        work = malloc(need * sizeof(DuetBest));
        work_n = work ? need : 0;
        if (!work) return 0;
    }
    return run(fn, args, args_size, n_chunks, 0, M, 0, (float *)work, 1, out);
}
