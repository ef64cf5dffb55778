/*
 * The inner loops of infire's AVX2 K-quant kernels at batch 32 (cpu_forward.c, included
 * here: the loops measured are the ones served), run alone on data in L1 with nothing
 * around them (no unpacking of codes, no mins, no conversion to float, no weight traffic):
 * what those kernels could reach if everything outside their inner loop were free
 * (benchmarks/bench_gguf.py prints the batch-32 ceiling at these rates).
 *   q4k_wide: wide_row_block, rows16_q4k_wide's loop: a 256-value block of one row with
 *             32 tokens (a row's 4 codes broadcast, 4 vectors of 8 tokens' 4
 *             activations; vpmaddubsw + vpaddw, then per 32 values vpmaddwd by the
 *             scale, vpaddd);
 *   q6k_wide: q6k_row_block, rows_q6k_wide's loop: a 256-value block of one row with 32
 *             tokens (as q4k_wide, but each 16's sums start from the tokens' offsets and
 *             take a vpmaddwd by its scale every 4 steps).
 * Each returns the multiply-adds it did (summed over the OpenMP threads).
 */
#include "../src/infire/kernels/cpu_forward.c"

static uint8_t loop_acts[2][8 * 1024] __attribute__((aligned(64)));
static uint8_t loop_codes[2][8 * 512] __attribute__((aligned(64)));
static int32_t loop_scales[2][8 * 16] __attribute__((aligned(64)));
static int32_t loop_offsets[2][8 * 64] __attribute__((aligned(64)));
static volatile int loop_sink;

/* Written, not left as the zero page: every page of an untouched static array maps to the
 * one physical zero page, and reading one line through several virtual pages thrashes L1 (a
 * third of the loops' rate lost). */
static void fill_acts(int me) {
    for (int i = 0; i < 8 * 1024; i++) loop_acts[me][i] = (uint8_t)(i * 7 + 1);
}

long loop_q4k_wide(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        const int me = omp_get_thread_num() % 2;
        fill_acts(me);
        __m256i isum[4] __attribute__((aligned(32)));
        for (int i = 0; i < 8 * 512; i++) loop_codes[me][i] = (uint8_t)(i * 5 & 15);
        for (int i = 0; i < 8 * 16; i++) loop_scales[me][i] = 3 | 3 << 16;
        int sum = 0;
        for (long i = 0; i < iters; i++) { /* the 16 rows of a group's block, over and over */
            wide_row_block((const int8_t *)loop_acts[me], loop_codes[me] + 4 * (i & 15),
                           loop_scales[me] + (i & 15), isum);
            sum += _mm256_extract_epi32(isum[i & 3], 0);
        }
        loop_sink = sum;
        total = iters * 256 * 32; /* a row x 256 values x 32 tokens */
    }
    return total;
}

long loop_q6k_wide(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        const int me = omp_get_thread_num() % 2;
        fill_acts(me);
        __m256i isum[4] __attribute__((aligned(32)));
        for (int i = 0; i < 8 * 512; i++) loop_codes[me][i] = (uint8_t)(i * 5 & 63);
        for (int i = 0; i < 8 * 16; i++) loop_scales[me][i] = 3 | 3 << 16;
        for (int i = 0; i < 8 * 64; i++) loop_offsets[me][i] = -(i * 97 & 0x3fff3fff);
        int sum = 0;
        for (long i = 0; i < iters; i++) { /* 16 rows' blocks, over and over */
            q6k_row_block((const int8_t *)loop_acts[me], loop_codes[me] + 256 * (i & 15), loop_scales[me],
                          loop_offsets[me], 4, isum);
            sum += _mm256_extract_epi32(isum[i & 3], 0);
        }
        loop_sink = sum;
        total = iters * 256 * 32; /* a row x 256 values x 32 tokens */
    }
    return total;
}

/* The whole batch kernels, as served, on weights that stay in L2 (a [128, 1024] Q4_K
 * weight in groups of 16 rows, a [64, 1024] Q6_K one): their inner loops with the codes'
 * unpacking, the mins, the conversion to float and the stores, but no weight traffic from
 * memory and nothing of the forward around them: the rate the served products could reach
 * with the weights' streaming free. */
#define WHOLE_COLS 1024

/* 32 tokens' activations side by side, as tokens_side_by_side leaves them (whole_free
 * frees them). */
static void whole_acts(QuantX *x) {
    const int blocks = WHOLE_COLS / QK_BLOCK;
    int8_t *qt = aligned_alloc(64, TOKEN_BLOCK * WHOLE_COLS);
    int32_t *mt = aligned_alloc(64, TOKEN_BLOCK * 4 * blocks * 4);
    int32_t *ct = aligned_alloc(64, TOKEN_BLOCK * 16 * blocks * 4);
    float *dt = aligned_alloc(64, TOKEN_BLOCK * blocks * 4);
    for (int i = 0; i < TOKEN_BLOCK * WHOLE_COLS; i++) qt[i] = (int8_t)(i * 7 + 1);
    for (int i = 0; i < TOKEN_BLOCK * 4 * blocks; i++) mt[i] = (i * 13) & 0x03ff03ff;
    for (int i = 0; i < TOKEN_BLOCK * 16 * blocks; i++) ct[i] = -(i * 97 & 0x3fff3fff);
    for (int i = 0; i < TOKEN_BLOCK * blocks; i++) dt[i] = 0.01f;
    memset(x, 0, sizeof *x);
    x->qt = qt, x->mt = mt, x->ct = ct, x->dt = dt, x->cols = WHOLE_COLS;
}

static void whole_free(QuantX *x) {
    free((void *)x->qt), free((void *)x->mt), free((void *)x->ct), free((void *)x->dt);
}

static void whole_weight(uint8_t *w, long bytes, long block, int at, int halves) {
    for (long i = 0; i < bytes; i++) w[i] = (uint8_t)(i * 2654435761u >> 13);
    for (long b = 0; b < bytes / block; b++) /* finite fp16 scales (0.01) */
        for (int h = 0; h < halves; h++) memcpy(w + b * block + at + 2 * h, &(uint16_t){0x211f}, 2);
}

long loop_q4k_whole(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        enum { GROUPS = 8, BLOCKS = WHOLE_COLS / QK_BLOCK };
        const long group = BLOCKS * GROUP_ROWS * 144L;
        uint8_t *w = aligned_alloc(64, GROUPS * group);
        float out[GROUP_ROWS * TOKEN_BLOCK];
        QuantX x;
        whole_acts(&x);
        whole_weight(w, GROUPS * group, GROUP_ROWS * 144L, 0, 2 * GROUP_ROWS); /* d, dmin */
        for (long i = 0; i < iters; i++) rows16_q4k_wide(w + (i % GROUPS) * group, TOKEN_BLOCK, &x, out);
        loop_sink = (int)out[3];
        free(w), whole_free(&x);
        total = iters * GROUP_ROWS * WHOLE_COLS * TOKEN_BLOCK;
    }
    return total;
}

long loop_q6k_whole(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        enum { ROWS = 64, BLOCKS = WHOLE_COLS / QK_BLOCK };
        uint8_t *w = aligned_alloc(64, ROWS * BLOCKS * 210L);
        float out[GROUP_ROWS * TOKEN_BLOCK];
        QuantX x;
        whole_acts(&x);
        whole_weight(w, ROWS * BLOCKS * 210L, 210, 208, 1); /* d at the block's end */
        const uint8_t *rows[ROWS];
        for (int r = 0; r < ROWS; r++) rows[r] = w + r * BLOCKS * 210L;
        for (long i = 0; i < iters; i++) /* 16 rows a pass, as served */
            rows_q6k_wide(rows + GROUP_ROWS * (i % (ROWS / GROUP_ROWS)), GROUP_ROWS, TOKEN_BLOCK, &x, out);
        loop_sink = (int)out[3];
        free(w), whole_free(&x);
        total = iters * GROUP_ROWS * WHOLE_COLS * TOKEN_BLOCK;
    }
    return total;
}
