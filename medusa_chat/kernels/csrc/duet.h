// The duet runtime (duet.c): a product's column groups shared between the caller and one helper thread that the
// caller never waits for, for a machine whose other processes keep a core busy.
#pragma once
#include <stddef.h>
#include <stdint.h>

// chunk c of a product into y: its columns of all rows ([M, N] layout), or for an argmax its rows' bests at
// ((DuetBest *)y)[c * M + r]
typedef void (*duet_chunk_fn)(const void *args, int c, float *y);
typedef struct {
    float value;
    int64_t index;  // -1: none
} DuetBest;

// mc_set_threads(-1) (team.c) turns this mode on (team.h, mc_duet); these report it and serve the products
int duet_available(void);
void duet_quiesce(void);
void duet_set_test_delay(int us);
long duet_stolen_chunks(void);
// around every use of the functions below (duet_codes included): 1 = this caller has the runtime; 0 = another
// thread has it, run the product the ordinary way
int duet_begin(void);
void duet_end(void);
// a buffer of at least `bytes` for a product's activation codes (the helper may read it after the product)
void *duet_codes(size_t bytes);
// scratch for the helper's own use in a product (decoder.c's attention), grown as duet_codes
void *duet_helper_scratch(size_t bytes);
int duet_columns(duet_chunk_fn fn, const void *args, size_t args_size, int n_chunks, int cols, int M, int N,
                 float *y);
int duet_argmax(duet_chunk_fn fn, const void *args, size_t args_size, int n_chunks, int M, int64_t *out);
