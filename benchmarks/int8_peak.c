/*
 * The machine's ceiling for GGUF products (benchmarks/bench_gguf.py): how many int8
 * multiply-adds a second the cores retire in the instruction mix each arithmetic needs,
 * with no memory traffic and no dependency stalls (12 independent chains a thread):
 *   dpbusd:  vpdpbusd alone, 64 u8 x s8 products an instruction (the instruction set's peak);
 *   k_quant: vpmaddubsw then vpdpwssd, 64 products a pair (K-quants: 16-bit pair sums times
 *            each sub-block's scale, llama.cpp's arithmetic for Q4_K/Q5_K/Q6_K);
 *   legacy:  vpdpbusd, then per 16 values the sums to float, the product of the weights'
 *            and the activations' scales, a fused multiply-add, and one for the offset
 *            (Q4_0/Q4_1/Q8_0: float scales per 32 values, llama.cpp's and infire's work).
 * The same three with AVX2 alone (256-bit, no VNNI), for CPUs without AVX512-VNNI:
 *   maddubs2: vpmaddubsw then vpaddw, 32 products an instruction, summed in 16 bits (the
 *             instruction set's peak: no arithmetic on u8 x s8 products does less);
 *   k_quant2: vpmaddubsw, vpmaddwd by each sub-block's scale, vpaddd (llama.cpp's AVX2
 *             Q4_K/Q5_K/Q6_K);
 *   legacy2:  vpmaddubsw, vpmaddwd by ones, the sums to float, the product of the scales,
 *             a fused multiply-add, and one for the offset (llama.cpp's AVX2 Q4_1).
 * (The inner loops of infire's own kernels: benchmarks/kernel_loops.c.)
 * Each returns the multiply-adds it did (summed over the OpenMP threads).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma")))
#define CHAINS 12

static volatile int sink;

AVX512 long peak_dpbusd(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        __m512i u = _mm512_set1_epi8(3 + omp_get_thread_num()), x = _mm512_set1_epi8(-5);
        __m512i acc[CHAINS];
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
        for (long i = 0; i < iters; i++)
            for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], u, x);
        for (int c = 1; c < CHAINS; c++) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
        sink = _mm512_reduce_add_epi32(acc[0]);
        total = iters * CHAINS * 64;
    }
    return total;
}

AVX512 long peak_k_quant(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        __m512i u = _mm512_set1_epi8(3 + omp_get_thread_num()), x = _mm512_set1_epi8(-5);
        __m512i sc = _mm512_set1_epi16(7);
        __m512i acc[CHAINS];
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
        for (long i = 0; i < iters; i++)
            for (int c = 0; c < CHAINS; c++)
                acc[c] = _mm512_dpwssd_epi32(acc[c], _mm512_maddubs_epi16(u, x), sc);
        for (int c = 1; c < CHAINS; c++) acc[0] = _mm512_add_epi32(acc[0], acc[c]);
        sink = _mm512_reduce_add_epi32(acc[0]);
        total = iters * CHAINS * 64;
    }
    return total;
}

AVX512 long peak_legacy(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        __m512i u = _mm512_set1_epi8(3 + omp_get_thread_num()), x = _mm512_set1_epi8(-5);
        __m512 a = _mm512_set1_ps(0.01f), dx = _mm512_set1_ps(0.02f);
        __m128 b = _mm_set1_ps(0.5f), xs = _mm_set1_ps(0.25f);
        __m512 acc[CHAINS];
        __m128 off[CHAINS];
        for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_set1_ps((float)c), off[c] = _mm_setzero_ps();
        for (long i = 0; i < iters; i++)
            for (int c = 0; c < CHAINS; c++) {
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
                acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(a, dx), acc[c]);
                off[c] = _mm_fmadd_ps(b, xs, off[c]);
            }
        for (int c = 1; c < CHAINS; c++) acc[0] = _mm512_add_ps(acc[0], acc[c]), off[0] = _mm_add_ps(off[0], off[c]);
        sink = (int)(_mm512_reduce_add_ps(acc[0]) + _mm_cvtss_f32(off[0]));
        total = iters * CHAINS * 64;
    }
    return total;
}

#define AVX2 __attribute__((target("avx2,fma")))
#define CHAINS2 8 /* 16 registers: 8 chains in flight cover the latency of 2 a cycle */
/* u is taken as new before each product (no instruction): none is hoisted or shared */
#define VARY(v) __asm__ volatile("" : "+x"(v))

AVX2 long peak_maddubs2(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        __m256i u = _mm256_set1_epi8(3 + omp_get_thread_num()), x = _mm256_set1_epi8(-5);
        __m256i acc[CHAINS2];
        for (int c = 0; c < CHAINS2; c++) acc[c] = _mm256_set1_epi16(c);
        for (long i = 0; i < iters; i++)
#pragma GCC unroll 8
            for (int c = 0; c < CHAINS2; c++) {
                VARY(u);
                acc[c] = _mm256_add_epi16(acc[c], _mm256_maddubs_epi16(u, x));
            }
        for (int c = 1; c < CHAINS2; c++) acc[0] = _mm256_add_epi16(acc[0], acc[c]);
        sink = _mm256_extract_epi16(acc[0], 0);
        total = iters * CHAINS2 * 32;
    }
    return total;
}

AVX2 long peak_k_quant2(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        __m256i u = _mm256_set1_epi8(3 + omp_get_thread_num()), x = _mm256_set1_epi8(-5);
        __m256i sc = _mm256_set1_epi16(7);
        __m256i acc[CHAINS2];
        for (int c = 0; c < CHAINS2; c++) acc[c] = _mm256_set1_epi32(c);
        for (long i = 0; i < iters; i++)
#pragma GCC unroll 8
            for (int c = 0; c < CHAINS2; c++) {
                VARY(u);
                acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), sc));
            }
        for (int c = 1; c < CHAINS2; c++) acc[0] = _mm256_add_epi32(acc[0], acc[c]);
        sink = _mm256_extract_epi32(acc[0], 0);
        total = iters * CHAINS2 * 32;
    }
    return total;
}

AVX2 long peak_legacy2(long iters) {
    long total = 0;
#pragma omp parallel reduction(+ : total)
    {
        __m256i u = _mm256_set1_epi8(3 + omp_get_thread_num()), x = _mm256_set1_epi8(-5);
        __m256i ones = _mm256_set1_epi16(1);
        __m256 a = _mm256_set1_ps(0.01f), dx = _mm256_set1_ps(0.02f);
        __m128 b = _mm_set1_ps(0.5f), xs = _mm_set1_ps(0.25f);
        __m256 acc[CHAINS2];
        __m128 off[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
        for (int c = 0; c < CHAINS2; c++) acc[c] = _mm256_set1_ps((float)c);
        for (long i = 0; i < iters; i++)
#pragma GCC unroll 8
            for (int c = 0; c < CHAINS2; c++) {
                VARY(u);
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(a, dx), acc[c]);
                off[c % 2] = _mm_fmadd_ps(b, xs, off[c % 2]);
            }
        for (int c = 1; c < CHAINS2; c++) acc[0] = _mm256_add_ps(acc[0], acc[c]);
        off[0] = _mm_add_ps(off[0], off[1]);
        __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[0]), _mm256_extractf128_ps(acc[0], 1));
        sink = (int)(_mm_cvtss_f32(s4) + _mm_cvtss_f32(off[0]));
        total = iters * CHAINS2 * 32;
    }
    return total;
}
