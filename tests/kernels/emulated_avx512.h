/*
 * Test-only: builds cpu_forward.c's AVX512-VNNI and AVX-VNNI paths on a CPU with AVX2
 * only, each 512-bit intrinsic emulated by SIMDe (Debian's libsimde-dev) or below, so
 * that CI machines without AVX-512 still run them (tests/kernels/emulated.py). Included
 * first (`-include`): every function then targets AVX2 and the CPU "supports" all.
 */
#include <immintrin.h>
#include <simde/x86/avx512.h>

#define CPU_SUPPORTS(feature) 1
#define TARGET_AVX512
#define TARGET_VNNI_EVEX
#define TARGET_AVXVNNI

/* what SIMDe 0.7 lacks, with the arithmetic of GCC's definitions */
static inline simde__m512 emulated_cvtepi32_ps(simde__m512i a) {
    simde__m512i_private v = simde__m512i_to_private(a);
    simde__m512_private r;
    for (int i = 0; i < 16; i++) r.f32[i] = (float)v.i32[i];
    return simde__m512_from_private(r);
}

static inline simde__m512 emulated_cvtph_ps(__m256i h) {
    float r[16];
    _mm256_storeu_ps(r, _mm256_cvtph_ps(_mm256_castsi256_si128(h)));
    _mm256_storeu_ps(r + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
    return simde_mm512_loadu_ps(r);
}

static inline float emulated_reduce_add_ps(simde__m512 a) {
    simde__m512_private v = simde__m512_to_private(a);
    float t3[8], t6[4];
    for (int i = 0; i < 8; i++) t3[i] = v.f32[8 + i] + v.f32[i];
    for (int i = 0; i < 4; i++) t6[i] = t3[4 + i] + t3[i];
    return (t6[0] + t6[2]) + (t6[1] + t6[3]);
}

#define __m512 simde__m512
#define __m512i simde__m512i
#define _mm512_cvtepi32_ps emulated_cvtepi32_ps
#define _mm512_cvtph_ps emulated_cvtph_ps
#define _mm512_reduce_add_ps emulated_reduce_add_ps
#define _mm256_dpbusd_avx_epi32 simde_mm256_dpbusd_epi32
#define _mm256_dpwssd_avx_epi32 simde_mm256_dpwssd_epi32
#undef _mm256_dpbusd_epi32
#define _mm256_dpbusd_epi32 simde_mm256_dpbusd_epi32
#undef _mm256_dpwssd_epi32
#define _mm256_dpwssd_epi32 simde_mm256_dpwssd_epi32
#define _mm512_add_epi32 simde_mm512_add_epi32
#define _mm512_and_si512 simde_mm512_and_si512
#define _mm512_broadcast_i64x4 simde_mm512_broadcast_i64x4
#define _mm512_castps128_ps512 simde_mm512_castps128_ps512
#define _mm512_castsi256_si512 simde_mm512_castsi256_si512
#define _mm512_castsi512_si256 simde_mm512_castsi512_si256
#define _mm512_dpbusd_epi32 simde_mm512_dpbusd_epi32
#define _mm512_dpwssd_epi32 simde_mm512_dpwssd_epi32
#define _mm512_extracti64x4_epi64 simde_mm512_extracti64x4_epi64
#define _mm512_fmadd_ps simde_mm512_fmadd_ps
#define _mm512_inserti64x4 simde_mm512_inserti64x4
#define _mm512_load_si512 simde_mm512_load_si512
#define _mm512_loadu_si512 simde_mm512_loadu_si512
#define _mm512_maddubs_epi16 simde_mm512_maddubs_epi16
#define _mm512_mul_ps simde_mm512_mul_ps
#define _mm512_or_si512 simde_mm512_or_si512
#define _mm512_permutexvar_epi16 simde_mm512_permutexvar_epi16
#define _mm512_permutexvar_ps simde_mm512_permutexvar_ps
#define _mm512_set1_epi16 simde_mm512_set1_epi16
#define _mm512_set1_epi32 simde_mm512_set1_epi32
#define _mm512_set1_epi8 simde_mm512_set1_epi8
#define _mm512_set1_ps simde_mm512_set1_ps
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 simde_mm512_setr_epi32
#define _mm512_setzero_ps simde_mm512_setzero_ps
#define _mm512_setzero_si512 simde_mm512_setzero_si512
#define _mm512_shuffle_i64x2 simde_mm512_shuffle_i64x2
#define _mm512_slli_epi16 simde_mm512_slli_epi16
#define _mm512_srli_epi16 simde_mm512_srli_epi16
#define _mm512_srlv_epi16 simde_mm512_srlv_epi16
#define _mm512_storeu_ps simde_mm512_storeu_ps
#define _mm512_xor_si512 simde_mm512_xor_si512
