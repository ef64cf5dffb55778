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
 *             tokens (pair sums reach 16320: every two vpmaddubsw a vpmaddwd by the scale
 *             of their 16 values).
 * Each returns the multiply-adds it did (summed over the OpenMP threads).
 */
#include "../src/infire/kernels/cpu_forward.c"

static uint8_t loop_acts[2][8 * 1024] __attribute__((aligned(64)));
static uint8_t loop_codes[2][8 * 512] __attribute__((aligned(64)));
static int32_t loop_scales[2][8 * 16] __attribute__((aligned(64)));
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
        for (int i = 0; i < 8 * 512; i++) loop_codes[me][i] = (uint8_t)((i * 5 & 63) - 32);
        for (int i = 0; i < 8 * 16; i++) loop_scales[me][i] = 3 | 3 << 16;
        int sum = 0;
        for (long i = 0; i < iters; i++) { /* 16 rows' blocks, over and over */
            q6k_row_block(loop_acts[me], loop_codes[me] + 256 * (i & 15), loop_scales[me], 4, isum);
            sum += _mm256_extract_epi32(isum[i & 3], 0);
        }
        loop_sink = sum;
        total = iters * 256 * 32; /* a row x 256 values x 32 tokens */
    }
    return total;
}
