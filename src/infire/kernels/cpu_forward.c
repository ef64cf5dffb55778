/*
 * Forward pass of a Llama-family model (and Qwen3's q/k norms, Mixtral's and Qwen3-MoE's
 * routed experts) on x86-64 CPUs with AVX2 and FMA, in one call.
 *
 * Decoding one token per sequence is bound by memory bandwidth: every weight is read once
 * per step and used for a handful of multiply-adds. PyTorch spends that step in ~30
 * small ops per layer (each a dispatch, an allocation, an OpenMP fork) and in GEMV
 * kernels that reach about half of the machine's read bandwidth; its bf16 GEMMs on CPUs
 * without bf16 instructions are several times slower than fp32. This file runs a step's
 * tokens (decodes, and prefill chunks in bf16), embedding to logits, inside one OpenMP
 * parallel region:
 *
 *  - weights are stored tiled, [rows/4][cols/16][4][16], so a tile of 4 output rows is
 *    one sequential stream; bf16 tiles store each 16-chunk as (w0-3, w8-11, w4-7, w12-15)
 *    so that two unpacks under zeros turn 16 bf16 into two fp32 vectors in column order;
 *  - activations stay fp32; each (row, token) dot product accumulates in the same order
 *    whatever the number of tokens, so a sequence's result does not depend on its batch;
 *  - attention reads the paged KV pool through block tables with an online softmax;
 *  - bf16 weights may also be held in Unweight's palette form (12 bits a weight, see
 *    PaletteWeight), rebuilt tile by tile into the bf16 layout right before their dots;
 *  - a layer with routed experts picks each token's top k by softmax and runs every
 *    expert once over the tokens routed to it, so its weights stream once per step.
 *
 * The layout of InfireModel is mirrored by a ctypes Structure in cpu_forward.py.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

/* The functions that run instructions beyond AVX2, FMA and F16C, chosen at run time by
 * what the CPU supports. tests/kernels/emulated_avx512.h redefines these (and the
 * intrinsics) to build those paths, emulated in AVX2, on CPUs without them. */
#ifndef CPU_SUPPORTS
#define CPU_SUPPORTS(feature) __builtin_cpu_supports(feature)
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq")))
#define TARGET_VNNI_EVEX __attribute__((target("avx512vl,avx512vnni")))
#define TARGET_AVXVNNI __attribute__((target("avx2,fma,avxvnni")))
#endif

#define TILE_ROWS 4
#define TILE_COLS 16
#define TOKEN_BLOCK 32 /* tokens whose activations stay in cache while a weight tile streams */
#define MAX_HEAD_DIM 256

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab;
    int32_t block_size, weight_bf16, kv_bf16;
    int32_t weight_palette; /* matmul weights and embedding are PaletteWeight (bf16 values) */
    int32_t weight_quant;   /* matmul weights and embedding are QuantWeight (GGUF blocks) */
    float eps, scale;
    int64_t num_blocks;
    const void *const *qkv;     /* per layer, tiled */
    const float *const *qkv_bias; /* per layer, NULL when the model has none */
    const void *const *o_proj;
    const void *const *gate_up;
    const void *const *down;
    const float *const *norm1; /* input_layernorm, fp32 */
    const float *const *norm2; /* post_attention_layernorm, fp32 */
    const float *final_norm;
    const void *embed;   /* [vocab, hidden] row-major, weight dtype; or a PaletteWeight */
    const void *lm_head; /* tiled, rows padded to TILE_ROWS */
    void *kv_cache;      /* [layers, 2, blocks, block_size, kv_heads, head_dim], kv dtype */
    /* Routed experts (Mixtral, Qwen3-MoE): a layer whose router is not NULL runs them
       instead of its dense MLP (softmax over num_experts, the top_k renormalized where
       norm_topk, SwiGLU experts of expert_intermediate features); num_experts 0: every
       layer dense */
    int32_t num_experts, top_k;
    const void *const *router;         /* per layer, tiled [num_experts rows] or NULL */
    const void *const *expert_gate_up; /* [layer * num_experts + e], tiled [2 inter, hidden] */
    const void *const *expert_down;    /* [layer * num_experts + e], tiled [hidden, inter] */
    int32_t norm_topk;           /* renormalize the top k weights (Mixtral; Qwen3-MoE's flag) */
    int32_t expert_intermediate; /* an expert's intermediate features */
    const float *const *q_norm;  /* per layer [head_dim] (Qwen3's per-head RMSNorm) or NULL */
    const float *const *k_norm;
} InfireModel;

static inline float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* e^x for 8 floats (Cephes' expf polynomial, ~1 ulp); inputs below -88.4 give ~0. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)),
                      _mm256_set1_ps(-88.3762626647949f));
    __m256 n = _mm256_floor_ps(
        _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } c = {(uint32_t)h << 16};
    return c.f;
}

/* Round to nearest even, as torch's float -> bfloat16 cast; NaN stays NaN. */
static inline uint16_t f32_to_bf16(float f) {
    union { float f; uint32_t u; } c = {f};
    if ((c.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((c.u >> 16) | 0x40);
    return (uint16_t)((c.u + 0x7fffu + ((c.u >> 16) & 1u)) >> 16);
}

/* 8 consecutive values of a row-major vector as fp32. */
static inline __m256 load8(const void *p, long i, const int bf16) {
    if (bf16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* One tiled 16-chunk of a weight row as fp32 columns 0..7 (lo) and 8..15 (hi). bf16 chunks
 * are stored (w0-3, w8-11, w4-7, w12-15): unpacking each 128-bit lane under zeros widens
 * them in column order (twice as fast here as a shift and a mask). */
static inline __attribute__((always_inline)) void load_chunk(
    const void *w, long i, const int bf16, __m256 *lo, __m256 *hi) {
    if (bf16) {
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i));
        *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), v));
        *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), v));
    } else {
        *lo = _mm256_loadu_ps((const float *)w + i);
        *hi = _mm256_loadu_ps((const float *)w + i + 8);
    }
}

/* Dot products of one 4-row weight tile with one or two token vectors. */
static inline __attribute__((always_inline)) void tile_dots(
    const void *w, long tile, int cols, const int bf16, const float *x0, const float *x1,
    const int two, float *out0, float *out1) {
    __m256 a[TILE_ROWS], b[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) a[r] = b[r] = _mm256_setzero_ps();
    long base = tile * (long)cols * TILE_ROWS;
    for (int k = 0; k < cols; k += TILE_COLS, base += TILE_COLS * TILE_ROWS) {
        __m256 xl0 = _mm256_loadu_ps(x0 + k), xh0 = _mm256_loadu_ps(x0 + k + 8);
        __m256 xl1 = xl0, xh1 = xh0;
        if (two) {
            xl1 = _mm256_loadu_ps(x1 + k);
            xh1 = _mm256_loadu_ps(x1 + k + 8);
        }
        for (int r = 0; r < TILE_ROWS; r++) {
            __m256 lo, hi;
            load_chunk(w, base + r * TILE_COLS, bf16, &lo, &hi);
            a[r] = _mm256_fmadd_ps(hi, xh0, _mm256_fmadd_ps(lo, xl0, a[r]));
            if (two) b[r] = _mm256_fmadd_ps(hi, xh1, _mm256_fmadd_ps(lo, xl1, b[r]));
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) {
        out0[r] = hsum(a[r]);
        if (two) out1[r] = hsum(b[r]);
    }
}

/*
 * A bf16 weight in the palette form, tiled like the bf16 weights (cpu_forward.py packs it):
 * per 4x16 tile chunk 96 bytes, two halves (rows 0-1, rows 2-3) of 16 index bytes (the low
 * nibbles index weights 0-15 of the half, the high nibbles 16-31) then two halves of 32
 * sign << 7 | mantissa bytes. Weight j of a half is rebuilt as the bf16 (r & 0x80) << 8 |
 * palette[index] << 7 | (r & 0x7F); chunks holding an exponent outside the 16-entry palette
 * take all 64 exponents from `verbatim` instead. The 64 weights of a half are stored in the
 * order that one byte unpack turns into the bf16 tile layout, so a chunk costs two shuffles
 * (palette lookups) and two unpacks per 32 weights, and no data-dependent branch other
 * than the verbatim flag.
 */
typedef struct {
    const uint8_t *palette;         /* 16 exponents (unused entries 0) */
    const uint8_t *chunks;          /* [tiles][cols / 16][PALETTE_CHUNK] */
    const uint8_t *flags;           /* [tiles][cols / 16]: 1 = exponents from verbatim */
    const uint8_t *verbatim;        /* [flagged chunks][64] exponents, in chunk order */
    const uint32_t *tile_verbatim;  /* [tiles]: the first flagged chunk of each tile */
} PaletteWeight;

#define PALETTE_CHUNK 96

/* The palette as the high and low bytes its exponents contribute to a bf16. */
static inline void palette_tables(const PaletteWeight *w, __m256i *hi, __m256i *lo) {
    __m128i p = _mm_loadu_si128((const __m128i *)w->palette);
    *hi = _mm256_broadcastsi128_si256(_mm_and_si128(_mm_srli_epi16(p, 1), _mm_set1_epi8(0x7F)));
    *lo = _mm256_broadcastsi128_si256(
        _mm_and_si128(_mm_slli_epi16(p, 7), _mm_set1_epi8((char)0x80)));
}

/* One chunk as its 4 rows of 16 bf16, each in the tile layout (w0-3, w8-11, w4-7, w12-15). */
static inline __attribute__((always_inline)) void palette_rows(
    const uint8_t *c, const uint8_t *verbatim, __m256i hi_tab, __m256i lo_tab, __m256i rows[4]) {
    const __m256i shifts = _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4);
    const __m256i nibble = _mm256_set1_epi8(0x0F), sign = _mm256_set1_epi8((char)0x80),
                  mantissa = _mm256_set1_epi8(0x7F);
    for (int h = 0; h < 2; h++) {
        __m256i r = _mm256_loadu_si256((const __m256i *)(c + 32 + 32 * h)), ehi, elo;
        if (verbatim) {
            __m256i e = _mm256_loadu_si256((const __m256i *)(verbatim + 32 * h));
            ehi = _mm256_and_si256(_mm256_srli_epi16(e, 1), mantissa);
            elo = _mm256_and_si256(_mm256_slli_epi16(e, 7), sign);
        } else {
            __m256i p = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(c + 16 * h)));
            __m256i ids = _mm256_and_si256(_mm256_srlv_epi32(p, shifts), nibble);
            ehi = _mm256_shuffle_epi8(hi_tab, ids);
            elo = _mm256_shuffle_epi8(lo_tab, ids);
        }
        __m256i hib = _mm256_or_si256(_mm256_and_si256(r, sign), ehi);
        __m256i lob = _mm256_or_si256(_mm256_and_si256(r, mantissa), elo);
        rows[2 * h] = _mm256_unpacklo_epi8(lob, hib);
        rows[2 * h + 1] = _mm256_unpackhi_epi8(lob, hib);
    }
}

/* One chunk as 64 bf16 in the tile layout (row r's 16 at out + 16 r). */
static inline __attribute__((always_inline)) void palette_chunk(
    const uint8_t *c, const uint8_t *verbatim, __m256i hi_tab, __m256i lo_tab, uint16_t *out) {
    __m256i rows[4];
    palette_rows(c, verbatim, hi_tab, lo_tab, rows);
    for (int r = 0; r < TILE_ROWS; r++)
        _mm256_storeu_si256((__m256i *)(out + TILE_COLS * r), rows[r]);
}

/* tile_dots on a palette tile, each chunk rebuilt in registers (one or two tokens). */
static inline __attribute__((always_inline)) void palette_dots(
    const PaletteWeight *w, long tile, int cols, __m256i hi_tab, __m256i lo_tab, const float *x0,
    const float *x1, const int two, float *out0, float *out1) {
    __m256 a[TILE_ROWS], b[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) a[r] = b[r] = _mm256_setzero_ps();
    int chunks = cols / TILE_COLS;
    long first = tile * chunks;
    const uint8_t *v = w->verbatim + 64L * w->tile_verbatim[tile];
    const __m256i zero = _mm256_setzero_si256();
    for (int k = 0; k < chunks; k++) {
        int flagged = w->flags[first + k];
        __m256i rows[4];
        palette_rows(w->chunks + (first + k) * PALETTE_CHUNK, flagged ? v : NULL, hi_tab, lo_tab,
                     rows);
        v += 64 * flagged;
        __m256 xl0 = _mm256_loadu_ps(x0 + k * TILE_COLS), xh0 = _mm256_loadu_ps(x0 + k * TILE_COLS + 8);
        __m256 xl1 = xl0, xh1 = xh0;
        if (two) {
            xl1 = _mm256_loadu_ps(x1 + k * TILE_COLS);
            xh1 = _mm256_loadu_ps(x1 + k * TILE_COLS + 8);
        }
        for (int r = 0; r < TILE_ROWS; r++) {
            __m256 lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, rows[r]));
            __m256 hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, rows[r]));
            a[r] = _mm256_fmadd_ps(hi, xh0, _mm256_fmadd_ps(lo, xl0, a[r]));
            if (two) b[r] = _mm256_fmadd_ps(hi, xh1, _mm256_fmadd_ps(lo, xl1, b[r]));
        }
    }
    for (int r = 0; r < TILE_ROWS; r++) {
        out0[r] = hsum(a[r]);
        if (two) out1[r] = hsum(b[r]);
    }
}

/* Tile `tile` (4 rows) of a palette weight as bf16 tiles into out[4 * cols]. */
static inline void palette_tile(const PaletteWeight *w, long tile, int cols, __m256i hi,
                                __m256i lo, uint16_t *out) {
    int chunks = cols / TILE_COLS;
    long first = tile * chunks;
    const uint8_t *v = w->verbatim + 64L * w->tile_verbatim[tile];
    for (int k = 0; k < chunks; k++) {
        int flagged = w->flags[first + k];
        palette_chunk(w->chunks + (first + k) * PALETTE_CHUNK, flagged ? v : NULL, hi, lo,
                      out + (long)k * TILE_COLS * TILE_ROWS);
        v += 64 * flagged;
    }
}

/*
 * GGUF quantized weights, kept in their own blocks (llama.cpp's layouts). A matmul weight
 * is a QuantWeight: one or more parts of whole rows (a fused q|k|v or gate|up weight whose
 * pieces have different types), each row a run of blocks along the input features. A tile
 * of 4 rows is decoded to fp32 in the fp32 tile layout, with the arithmetic of the `gguf`
 * package's dequantize, and multiplied as an fp32 tile: the result is bit for bit the
 * fp32 path's on the dequantized weights, whatever the batch.
 */
enum { GGML_F32 = 0, GGML_F16 = 1, GGML_BF16 = 30, GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8,
       GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14 };

#define MAX_QUANT_PARTS 4

typedef struct {
    int32_t type, rows; /* GGML type; rows */
    int64_t row_bytes;        /* a row's blocks */
    int64_t row_stride;       /* from one stored row to the next: row_bytes, or more where a
                                 tensor-parallel rank holds some of each row's blocks */
    const uint8_t *data;
    const int32_t *row_index; /* row r is stored at row_index[r] (NULL: at r) */
    int32_t interleaved;      /* rows in groups of 16, see infire_repack_rows16 */
    int32_t unused;
} QuantPart;

typedef struct {
    int32_t num_parts;
    QuantPart parts[MAX_QUANT_PARTS];
} QuantWeight;

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* Q4_K and Q5_K's 6-bit scale and min of sub-block j (of 8). */
static inline void scale_min_k4(const uint8_t *s, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
        *m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

/* One row of `cols` values as fp32, each computed as the `gguf` package's dequantize does
 * (the same products and sums, in the same order: the file is built without contraction
 * into FMAs). */
static void dequant_row(int type, const uint8_t *b, int cols, float *out) {
    switch (type) {
    case GGML_F32:
        memcpy(out, b, sizeof(float) * cols);
        break;
    case GGML_F16:
        for (int i = 0; i < cols; i++) out[i] = half(b + 2 * i);
        break;
    case GGML_BF16:
        for (int i = 0; i < cols; i++) out[i] = bf16_to_f32(((const uint16_t *)b)[i]);
        break;
    case GGML_Q8_0:
        for (int i = 0; i < cols; i += 32, b += 34) {
            float d = half(b);
            for (int j = 0; j < 32; j++) out[i + j] = (float)(int8_t)b[2 + j] * d;
        }
        break;
    case GGML_Q4_0:
        for (int i = 0; i < cols; i += 32, b += 18) {
            float d = half(b);
            for (int j = 0; j < 16; j++) {
                out[i + j] = d * (float)((b[2 + j] & 0x0F) - 8);
                out[i + j + 16] = d * (float)((b[2 + j] >> 4) - 8);
            }
        }
        break;
    case GGML_Q4_1:
        for (int i = 0; i < cols; i += 32, b += 20) {
            float d = half(b), m = half(b + 2);
            for (int j = 0; j < 16; j++) {
                out[i + j] = d * (float)(b[4 + j] & 0x0F) + m;
                out[i + j + 16] = d * (float)(b[4 + j] >> 4) + m;
            }
        }
        break;
    case GGML_Q5_0:
    case GGML_Q5_1: {
        int one = type == GGML_Q5_1, size = one ? 24 : 22;
        for (int i = 0; i < cols; i += 32, b += size) {
            float d = half(b), m = one ? half(b + 2) : 0.0f;
            uint32_t qh;
            memcpy(&qh, b + 2 + 2 * one, 4);
            const uint8_t *qs = b + 6 + 2 * one;
            for (int j = 0; j < 16; j++) {
                int lo = (qs[j] & 0x0F) | (((qh >> j) & 1) << 4);
                int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
                if (one) {
                    out[i + j] = d * (float)lo + m;
                    out[i + j + 16] = d * (float)hi + m;
                } else {
                    out[i + j] = d * (float)(lo - 16);
                    out[i + j + 16] = d * (float)(hi - 16);
                }
            }
        }
        break;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        int five = type == GGML_Q5_K, size = five ? 176 : 144;
        for (int i = 0; i < cols; i += 256, b += size) {
            float d = half(b), dmin = half(b + 2);
            const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + 16 + 32 * five;
            for (int j = 0; j < 8; j++) {
                int sc, mn;
                scale_min_k4(scales, j, &sc, &mn);
                float ds = d * (float)sc, dm = dmin * (float)mn;
                const uint8_t *q = qs + 32 * (j / 2);
                int shift = 4 * (j % 2);
                for (int l = 0; l < 32; l++) {
                    int v = (q[l] >> shift) & 0x0F;
                    if (five) v |= ((qh[l] >> j) & 1) << 4;
                    out[i + 32 * j + l] = ds * (float)v - dm;
                }
            }
        }
        break;
    }
    case GGML_Q6_K:
        for (int i = 0; i < cols; i += 256, b += 210) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *scales = (const int8_t *)(b + 192);
            float d = half(b + 208);
            for (int e = 0; e < 256; e++) {
                int h = e / 128, s = (e % 128) / 64, k = (e % 128) / 32;
                int lo = (ql[h * 64 + e % 64] >> (4 * s)) & 0x0F;
                int hi = (qh[h * 32 + e % 32] >> (2 * k)) & 0x03;
                out[i + e] = (d * (float)scales[e / 16]) * (float)((lo | (hi << 4)) - 32);
            }
        }
        break;
    }
}

/* Where row `at` of a part is stored (a part whose rows are not interleaved). */
static inline const uint8_t *quant_row(const QuantPart *p, long at) {
    return p->data + (p->row_index ? p->row_index[at] : at) * p->row_stride;
}

/* The part and row within it of global row `row`. */
static inline const QuantPart *quant_part(const QuantWeight *w, int *row) {
    int p = 0;
    while (p + 1 < w->num_parts && *row >= w->parts[p].rows) *row -= w->parts[p++].rows;
    return &w->parts[p];
}

/*
 * Products with GGUF blocks, as llama.cpp computes them: each token's activations are
 * quantized to int8 (scale max|x| / 127, rounded to nearest even) and meet the weights'
 * codes in integer multiply-adds.
 *
 * Legacy types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) take activations quantized per 32 values.
 * A weight block is unpacked to unsigned codes u (0..31) with a scale A and an offset B,
 * a weight being A u + B:
 *   Q4_0 A = d, B = -8 d;  Q4_1 A = d, B = m;  Q5_0 A = d, B = -16 d;  Q5_1 A = d, B = m;
 *   Q8_0's codes stay signed (A = d, B = 0) and the activations take their signs.
 * A block's product is dx (A S' + B S), S' the integer sum of u q and S that of q.
 *
 * K-quants (Q4_K, Q5_K, Q6_K) take activations quantized per 256 values (llama.cpp's
 * Q8_K), with the integer sum of each 16 codes. A weight is d sc u - dmin m, sc and m
 * per 32 values (Q4_K, Q5_K: 6 bits each, u 0..15 or 0..31), or d sc (u - 32), sc per 16
 * (Q6_K: 8-bit signed, u 0..63). Over the 16 groups g of 16 values of a 256-value block:
 *   Q4_K, Q5_K:  dx (d sum_g sc_g S'_g - dmin sum_g m_g S_g)
 *   Q6_K:        dx d (sum_g sc_g S'_g - 32 sum_g sc_g S_g)
 * Every sum inside is an integer (pairs of u q in 16 bits, then times sc in 32 bits), so a
 * block costs one conversion to float where per-32 activations would cost eight.
 *
 * Each (row, token) product runs the same operations in the same order whatever the
 * batch. Rows of F32, F16 or BF16 parts are decoded to fp32 and multiplied in fp32.
 */
#define QX_BLOCK 32
#define QK_BLOCK 256

static inline int is_k_quant(int type) {
    return type == GGML_Q4_K || type == GGML_Q5_K || type == GGML_Q6_K;
}

/* A block of tokens' quantized activations, token t's at t times each stride.
 *  - per 32 (legacy types): codes in q_stride bytes (a whole number of 64-byte pairs of
 *    blocks, zero past the end); per 16 codes (x_stride floats, zero past the end) the
 *    block's scale and the codes' sum times it (what a weight's offset B multiplies), and
 *    per 32 the scale times the block's sum;
 *  - per 256 (K-quants; cols a multiple of 256): cols codes, a scale per 256 and the sum
 *    of each 16 codes. */
typedef struct {
    const int8_t *q;
    const float *scale, *xsum;
    const float *xblock; /* per 32 codes: the scale times their sum (interleaved rows) */
    const int8_t *qk;
    const float *dk;
    const int16_t *bsum;
    /* the same per-256 activations with the tokens side by side, for the wide kernels
     * (rows16_q4k_wide, rows_q6k_wide): per 4 codes (as qk stores them) the block's
     * TOKEN_BLOCK tokens' 4 each (qt); per 256 values each token's scale (dt). Each kernel's
     * own sums are NULL where a block of tokens does not take it: Q4_K's mins' (mt), per
     * 256 values and pair c of 32-value sub-blocks (2 c, 2 c + 1) each token's two sums as
     * 16-bit halves; Q6_K's offsets' (ct), per 256 values, 32-value sub-block slot s and
     * its 16s h, each token's -32 times the sums of the codes its 16-bit halves meet in
     * rows_q6k_wide (values 4 k, 4 k + 1 and 4 k + 2, 4 k + 3 of k = 4 h .. 4 h + 3). */
    const int8_t *qt;
    const int32_t *mt;
    const int32_t *ct;
    const float *dt;
    int cols;
} QuantX;

static inline int q_stride(int cols) { return 64 * ((cols / QX_BLOCK + 1) / 2); }
static inline int x_stride(int cols) { return 4 * ((cols / QX_BLOCK + 1) / 2); }

/* max |x| over n values (a multiple of 8) */
static inline float abs_max(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}

/* 16 values times id, rounded to nearest even, as int8 at q; returns their sum. */
static inline int round16(const float *x, float id, int8_t *q) {
    const __m256 s = _mm256_set1_ps(id);
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), s));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), s));
    __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8); /* 16 x int16 */
    __m128i v = _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
    _mm_storeu_si128((__m128i *)q, v);
    __m256i sum = _mm256_madd_epi16(w, _mm256_set1_epi16(1));
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1)));
}

static void quantize_x(const float *x, int cols, int8_t *q, float *scale, float *xsum,
                       float *xblock) {
    memset(q + cols, 0, q_stride(cols) - cols);
    for (int i = 2 * (cols / QX_BLOCK); i < x_stride(cols); i++) scale[i] = xsum[i] = 0.0f;
    for (int b = 0; b < cols / QX_BLOCK; b++) {
        const float *xb = x + b * QX_BLOCK;
        float d = abs_max(xb, QX_BLOCK) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        int s0 = round16(xb, id, q + b * QX_BLOCK), s1 = round16(xb + 16, id, q + b * QX_BLOCK + 16);
        scale[2 * b] = scale[2 * b + 1] = d;
        xsum[2 * b] = d * (float)s0;
        xsum[2 * b + 1] = d * (float)s1;
        xblock[b] = d * (float)(s0 + s1);
    }
}

/* Where a 256-value block's sub-block j (values 32 j .. 32 j + 31) is stored: in the
 * order (0, 2, 1, 3, 4, 6, 5, 7), the order in which 64 bytes of Q4_K codes hold them (a
 * byte's low nibbles, then its high nibbles). */
static inline int k_slot(int j) { return (j & 4) | ((j & 1) << 1) | ((j >> 1) & 1); }

/* The same per 256 values, for K-quant rows: the codes' 32-value sub-blocks stored in
 * k_slot order, the sums of each 16 in value order. */
static void quantize_xk(const float *x, int cols, int8_t *q, float *d, int16_t *bsum) {
    for (int b = 0; b < cols / QK_BLOCK; b++) {
        const float *xb = x + b * QK_BLOCK;
        float s = abs_max(xb, QK_BLOCK) / 127.0f, id = s > 0.0f ? 1.0f / s : 0.0f;
        for (int g = 0; g < QK_BLOCK / 16; g++) {
            int8_t *at = q + b * QK_BLOCK + 32 * k_slot(g / 2) + 16 * (g % 2);
            bsum[16 * b + g] = (int16_t)round16(xb + 16 * g, id, at);
        }
        d[b] = s;
    }
}

/* 32 bits, one per byte (bit j of `bits` -> byte j, as 0 or 1). */
static inline __m256i bits_to_bytes(uint32_t bits) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
    return _mm256_and_si256(v, _mm256_set1_epi8(1));
}

/* Weight block g (32 values) of a row of a legacy type: codes u and A, B for each 16
 * (see above; a K-quant block is unpacked whole: k_ints, k_codes32). */
static inline __attribute__((always_inline)) __m256i unpack32(
    int type, const uint8_t *row, int g, float ab[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    switch (type) {
    case GGML_Q8_0: {
        const uint8_t *blk = row + 34 * g;
        ab[0] = ab[1] = half(blk);
        ab[2] = ab[3] = 0.0f;
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
    case GGML_Q4_0:
    case GGML_Q4_1:
    case GGML_Q5_0:
    case GGML_Q5_1: {
        int five = type == GGML_Q5_0 || type == GGML_Q5_1;
        int one = type == GGML_Q4_1 || type == GGML_Q5_1;
        const uint8_t *blk = row + (18 + 2 * one + 4 * five) * g;
        float d = half(blk);
        ab[0] = ab[1] = d;
        ab[2] = ab[3] = one ? half(blk + 2) : (five ? -16.0f : -8.0f) * d;
        __m128i v = _mm_loadu_si128((const __m128i *)(blk + 2 + 2 * one + 4 * five));
        __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), low4);
        if (five) {
            uint32_t qh;
            memcpy(&qh, blk + 2 + 2 * one, 4);
            u = _mm256_or_si256(u, _mm256_slli_epi16(bits_to_bytes(qh), 4));
        }
        return u;
    }
    }
    return _mm256_setzero_si256();
}

/* Where value `i` of a row's blocks starts (a constant type folds it to a multiply). */
static inline long value_offset(int type, long i) {
    switch (type) {
    case GGML_Q8_0: return i / 32 * 34;
    case GGML_Q4_0: return i / 32 * 18;
    case GGML_Q4_1: return i / 32 * 20;
    case GGML_Q5_0: return i / 32 * 22;
    case GGML_Q5_1: return i / 32 * 24;
    case GGML_Q4_K: return i / 256 * 144;
    case GGML_Q5_K: return i / 256 * 176;
    case GGML_Q6_K: return i / 256 * 210;
    }
    return 0;
}

#define PREFETCH_VALUES 8192 /* how far ahead of the products a row is fetched */

/* The byte of a row's blocks at value `i`, in proportion (a prefetch's address: every
 * cache line of a block gets one, not only the block's first). */
static inline long value_byte(int type, long i) { return value_offset(type, 256 * i) / 256; }

/* Fetch both rows' blocks PREFETCH_VALUES ahead of value `at` (row1 may be NULL); inlined
 * so that the type's block size folds to a constant. The K-quants' blocks go to the outer
 * caches (decode from memory on Zen 4: Q4_K 23 -> 31 GB/s, Q6_K 18 -> 33), the legacy
 * types' to L1 (SmolLM2's Q4_1 decode was no faster with them in the outer caches). */
static inline __attribute__((always_inline)) void prefetch_rows(
    int type, const uint8_t *row0, const uint8_t *row1, long at) {
    const char *p0 = (const char *)row0 + value_byte(type, at + PREFETCH_VALUES);
    const char *p1 = row1 ? (const char *)row1 + value_byte(type, at + PREFETCH_VALUES) : NULL;
    if (is_k_quant(type)) {
        _mm_prefetch(p0, _MM_HINT_T2);
        if (p1) _mm_prefetch(p1, _MM_HINT_T2);
    } else {
        _mm_prefetch(p0, _MM_HINT_T0);
        if (p1) _mm_prefetch(p1, _MM_HINT_T0);
    }
}

/*
 * Interleaved rows. Q4_0, Q4_1, Q8_0 and Q4_K parts whose rows are whole and a multiple of
 * 16 are copied once at load into groups of 16 rows (cpu_forward.py can_interleave; Q4_K
 * not where AVX512-VNNI's products are in use): the same bytes in another order (a part
 * takes the same memory, the same bits). Per block, a group stores its 16 rows' 2-byte
 * fields (see group_layout), then their other bytes. Q8_0's, 4 of a row at a time: bytes
 * 4 k .. 4 k + 3 of the 16 rows form 64-byte vector k, row i in 32-bit lane i, its codes
 * stored + 128 (unsigned; the offset takes it back). One `vpdpbusd` of such a vector with 4
 * of a token's activation codes broadcast sums 4 products for each of the 16 rows (the
 * 256-bit kernels take a vector as two halves of 8 rows). The 4-bit codes of Q4_0, Q4_1
 * and Q4_K, as nibble_group_codes: 4 values of 16 rows in 32 bytes, rows 0-7 in the low
 * nibbles and 8-15 in the high ones. A token's 16 results come out as vectors.
 */
#define GROUP_ROWS 16

static inline int group_scale_bytes(int type) { return type == GGML_Q4_1 ? 4 : 2; }

/* A block of a type that interleaves, as a group stores it: its 2-byte fields (scales, mins)
 * first, each as the 16 rows' in a row (32 bytes), then its runs of bytes, each 4 of a row
 * at a time (16 x len bytes). Q4_K: d, dmin, the 12 bytes of 6-bit scales and mins, the
 * 128 bytes of codes. (Q6_K in groups, its codes rebuilt from ql and qh in registers, ran
 * no faster than its rows as they are: 25 GB/s either way on Zen 3. A later try, its top 2
 * bits apart and 4 tokens a pass, ran 225 GOP/s at batch 32 in cache against the rows'
 * 170, yet the served Q4_K_M's batch-32 throughput did not move and its decode fell from
 * 75 to 58 tok/s: one token a pass is compute-bound there.) */
typedef struct {
    int halves, runs, half_at[2], run_at[2], run_len[2];
} GroupLayout;

static GroupLayout group_layout(int type) {
    switch (type) {
    case GGML_Q4_0: return (GroupLayout){1, 1, {0}, {2}, {16}};
    case GGML_Q4_1: return (GroupLayout){2, 1, {0, 2}, {4}, {16}};
    case GGML_Q8_0: return (GroupLayout){1, 1, {0}, {2}, {32}};
    default: return (GroupLayout){2, 2, {0, 2}, {4, 16}, {12, 128}}; /* Q4_K */
    }
}

static inline long block_bytes(int type) {
    return value_offset(type, is_k_quant(type) ? QK_BLOCK : QX_BLOCK);
}

/* The 4-bit codes of Q4_0, Q4_1 (32 values a block) and Q4_K (8 sub-blocks of 32) in a
 * group: per 32 values and values 4 k .. 4 k + 3 of them, one 32-byte vector, 8 s + k for
 * sub-block s: lane i (32 bits) holds those 4 values of row i in its bytes' low nibbles and
 * of row i + 8 in their high ones, so that one broadcast of 4 activations meets 16 rows.
 * The file's byte v holds values v and v + 16 of a legacy block; byte 32 c + v, value v of
 * Q4_K sub-blocks 2 c and 2 c + 1. Row i's codes `qs` (as in the file) <-> the group's
 * `codes` (to_group: which way; the other row's nibbles are kept). */
static inline void nibble_group_codes(int type, uint8_t *qs, uint8_t *codes, int i, int to_group) {
    const int lane = i % 8, shift = 4 * (i / 8), subs = type == GGML_Q4_K ? 8 : 1;
    for (int s = 0; s < subs; s++)
        for (int v = 0; v < 32; v++) {
            uint8_t *g = codes + 32 * (8 * s + v / 4) + 4 * lane + v % 4;
            uint8_t *f = subs == 8 ? qs + 32 * (s / 2) + v : qs + v % 16;
            const int at = subs == 8 ? 4 * (s % 2) : 4 * (v / 16);
            if (to_group) *g = (uint8_t)((*g & ~(0xF << shift)) | ((*f >> at) & 0xF) << shift);
            else *f = (uint8_t)((*f & ~(0xF << at)) | ((*g >> shift) & 0xF) << at);
        }
}

/* Row i of a group's block `out` <-> the file's block `blk` (to_group: which way). Q8_0's
 * codes are stored + 128, 4-bit ones as nibble_group_codes. */
static inline void group_block_row(int type, uint8_t *blk, uint8_t *out, int i, int to_group) {
    const GroupLayout l = group_layout(type);
    const uint8_t flip = type == GGML_Q8_0 ? 0x80 : 0;
    int o = 0;
    for (int f = 0; f < l.halves; f++, o += 2 * GROUP_ROWS)
        to_group ? memcpy(out + o + 2 * i, blk + l.half_at[f], 2) : memcpy(blk + l.half_at[f], out + o + 2 * i, 2);
    for (int r = 0; r < l.runs; o += GROUP_ROWS * l.run_len[r], r++)
        if (type != GGML_Q8_0 && r == l.runs - 1)
            nibble_group_codes(type, blk + l.run_at[r], out + o, i, to_group);
        else
            for (int j = 0; j < l.run_len[r]; j++) {
                uint8_t *g = out + o + 64 * (j / 4) + 4 * i + j % 4, *f = blk + l.run_at[r] + j;
                if (to_group) *g = *f ^ flip;
                else *f = *g ^ flip;
            }
}

/* Exported: `rows` rows (a multiple of 16) of a Q4_0, Q4_1, Q8_0 or Q4_K part, row r
 * read at src + (row_index ? row_index[r] : r) * row_stride, into groups of 16 at dst
 * (rows * row_bytes bytes). */
void infire_repack_rows16(int type, int rows, long row_bytes, const uint8_t *src,
                          long row_stride, const int32_t *row_index, uint8_t *dst) {
    const long size = block_bytes(type), blocks = row_bytes / size;
    for (int g = 0; g < rows / GROUP_ROWS; g++)
        for (int i = 0; i < GROUP_ROWS; i++) {
            const long r = (long)g * GROUP_ROWS + i;
            const uint8_t *row = src + (row_index ? row_index[r] : r) * row_stride;
            for (long b = 0; b < blocks; b++)
                group_block_row(type, (uint8_t *)(row + b * size),
                                dst + (long)g * GROUP_ROWS * row_bytes + b * GROUP_ROWS * size, i, 1);
        }
}

/* Row `at` of a part as the file stores it: where it lies, or rebuilt into `buf`
 * (row_bytes) from its group. */
static const uint8_t *plain_row(const QuantPart *p, long at, uint8_t *buf) {
    if (!p->interleaved) return quant_row(p, at);
    const long size = block_bytes(p->type), blocks = p->row_bytes / size;
    const uint8_t *group = p->data + at / GROUP_ROWS * GROUP_ROWS * p->row_bytes;
    for (long b = 0; b < blocks; b++)
        group_block_row(p->type, buf + b * size, (uint8_t *)(group + b * GROUP_ROWS * size),
                        (int)(at % GROUP_ROWS), 0);
    return buf;
}

/* A K-quant block's scales as 16-bit integers per group of 16 values, in registers: sc
 * (and m for Q4_K, Q5_K), with d and dmin. */
typedef struct {
    __m256i sc, m;
    float d, dmin;
} KInts;

static inline __attribute__((always_inline)) void k_ints(int type, const uint8_t *blk,
                                                         KInts *k) {
    if (type == GGML_Q6_K) {
        k->sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        k->m = _mm256_setzero_si256();
        k->d = half(blk + 208);
        k->dmin = 0.0f;
        return;
    }
    /* the 12 bytes of 8 6-bit scales and mins, as llama.cpp unpacks them (in 64-bit
     * registers: a vector load of bytes just stored in pieces would wait for them) */
    uint64_t lo;
    uint32_t u2;
    memcpy(&lo, blk + 4, 8);
    memcpy(&u2, blk + 12, 4);
    const uint64_t u0 = lo & 0xffffffffu, u1 = lo >> 32;
    const uint64_t sc = (u0 & 0x3f3f3f3f) | (((u2 & 0x0f0f0f0f) | (((u0 >> 6) & 0x03030303) << 4)) << 32);
    const uint64_t m = (u1 & 0x3f3f3f3f) | ((((u2 >> 4) & 0x0f0f0f0f) | (((u1 >> 6) & 0x03030303) << 4)) << 32);
    __m128i sc8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc));
    __m128i m8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)m));
    /* each sub-block's scale for both of its 16s */
    k->sc = _mm256_setr_m128i(_mm_unpacklo_epi16(sc8, sc8), _mm_unpackhi_epi16(sc8, sc8));
    k->m = _mm256_setr_m128i(_mm_unpacklo_epi16(m8, m8), _mm_unpackhi_epi16(m8, m8));
    k->d = half(blk);
    k->dmin = half(blk + 2);
}

/* Half hh of a Q6_K block: its sub-blocks 4 hh .. 4 hh + 3 (values 32 j .. 32 j + 31), 32
 * codes (0..63) each, from 2 x 32 bytes of low nibbles and 32 of top 2 bits. */
static inline __attribute__((always_inline)) void q6k_half_codes(const uint8_t *blk, int hh,
                                                                 __m256i u[4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hh));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * hh + 32));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * hh));
    u[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), top2));
    u[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), top2));
    u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(qh, top2));
    u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                           _mm256_and_si256(_mm256_srli_epi16(qh, 2), top2));
}

/* A Q6_K block's 8 sub-blocks' codes. */
static inline __attribute__((always_inline)) void q6k_codes(const uint8_t *blk, __m256i u[8]) {
    q6k_half_codes(blk, 0, u);
    q6k_half_codes(blk, 1, u + 4);
}

/* The scales of Q6_K sub-block j's two 16s as 16 16-bit lanes, sc_2j in the low 128 bits
 * and sc_2j+1 in the high ones, from `lane`: the 8 scales of j's half of the block (its
 * 16-bit scales' 128-bit lane j / 4) in both lanes. A `vpshufb` (lane-crossing
 * `vpermd` took 8 a row's block). */
static inline __attribute__((always_inline)) __m256i q6k_scale_pair(__m256i lane, int j) {
    const __m256i word = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2,
                                          3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
    return _mm256_shuffle_epi8(lane, _mm256_add_epi8(word, _mm256_set1_epi8((char)(4 * (j % 4)))));
}

/* A Q6_K block's 16-bit scales (`sc16`, sign-extended) in both 128-bit lanes, half hh's. */
static inline __attribute__((always_inline)) __m256i q6k_scale_half(__m256i sc16, int hh) {
    return _mm256_permute2x128_si256(sc16, sc16, hh ? 0x11 : 0x00);
}

/* Per Q6_K sub-block j, q6k_scale_pair's scales. */
static inline __attribute__((always_inline)) void q6k_scale_pairs(__m256i sc16, __m256i pair[8]) {
    const __m256i lo = q6k_scale_half(sc16, 0), hi = q6k_scale_half(sc16, 1);
    for (int j = 0; j < 8; j++) pair[j] = q6k_scale_pair(j < 4 ? lo : hi, j);
}

/* Sub-block j (values 32 j .. 32 j + 31) of a Q4_K or Q5_K block: 32 codes. */
static inline __attribute__((always_inline)) __m256i k_codes32(int type, const uint8_t *blk,
                                                               int j) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    int five = type == GGML_Q5_K;
    __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * five + 32 * (j / 2)));
    __m256i u = _mm256_and_si256(_mm256_srli_epi16(v, 4 * (j % 2)), low4);
    if (five) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(blk + 16));
        h = _mm256_and_si256(_mm256_srli_epi16(h, j), _mm256_set1_epi8(1));
        u = _mm256_or_si256(u, _mm256_slli_epi16(h, 4));
    }
    return u;
}

/* One (row, token, block) into the row's float sums: its integer sums in `dots` (8 lanes),
 * the group sums of the token's codes in `bsum`. */
static inline __attribute__((always_inline)) __m256 k_block_sums(
    int type, const KInts *k, __m256i dots, __m256i bsum, float dx, __m256 acc) {
    if (type == GGML_Q6_K) { /* d sc (u - 32): the offset shares the scale */
        __m256i off = _mm256_madd_epi16(bsum, k->sc);
        dots = _mm256_sub_epi32(dots, _mm256_slli_epi32(off, 5));
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_set1_ps(k->d * dx), acc);
    if (type == GGML_Q6_K) return acc;
    __m256i m = _mm256_madd_epi16(bsum, k->m);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(k->dmin * dx), acc);
}

/* The sums of a row pair's accumulators (b's where two rows were multiplied). */
static inline __attribute__((always_inline)) void hsum_rows(const int nr, __m256 a, __m256 b,
                                                            float *out_a, float *out_b) {
    if (nr == 1) {
        *out_a = hsum(a);
        return;
    }
    __m256 h = _mm256_hadd_ps(a, b); /* a01 a23 b01 b23 | a45 a67 b45 b67 */
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    v = _mm_hadd_ps(v, v); /* a, b in lanes 0, 1 */
    *out_a = _mm_cvtss_f32(v);
    *out_b = _mm_cvtss_f32(_mm_movehdup_ps(v));
}

/*
 * The 256-bit products with VNNI (`vnni` 1: AVX-VNNI's VEX form, Alder Lake and later;
 * 2: the same instructions in AVX512-VNNI's 256-bit EVEX form): `vpdpbusd` in place of
 * AVX2's `vpmaddubsw` + `vpmaddwd` + add, `vpdpwssd` in place of `vpmaddwd` + add. The
 * integers are the same: the 16-bit pair sums of `vpmaddubsw` never saturate here (codes
 * |u| <= 128, activations |x| <= 127), so results equal the AVX2 path's bit for bit.
 */
#if defined(__clang__) || __GNUC__ >= 11
#define HAVE_AVXVNNI 1
static inline TARGET_AVXVNNI __m256i dpbusd_vex(__m256i acc, __m256i u,
                                                                          __m256i x) {
    return _mm256_dpbusd_avx_epi32(acc, u, x);
}
static inline TARGET_AVXVNNI __m256i dpwssd_vex(__m256i acc, __m256i a,
                                                                          __m256i b) {
    return _mm256_dpwssd_avx_epi32(acc, a, b);
}
#else
#define dpbusd_vex dpbusd_evex
#define dpwssd_vex dpwssd_evex
#endif
static inline TARGET_VNNI_EVEX __m256i dpbusd_evex(__m256i acc,
                                                                                 __m256i u,
                                                                                 __m256i x) {
    return _mm256_dpbusd_epi32(acc, u, x);
}
static inline TARGET_VNNI_EVEX __m256i dpwssd_evex(__m256i acc,
                                                                                 __m256i a,
                                                                                 __m256i b) {
    return _mm256_dpwssd_epi32(acc, a, b);
}

/* acc + the sums of each 4 products of unsigned u and signed x bytes, per 32-bit lane. */
static inline __attribute__((always_inline)) __m256i dot_u8(__m256i acc, __m256i u, __m256i x,
                                                            const int vnni) {
    if (vnni == 1) return dpbusd_vex(acc, u, x);
    if (vnni == 2) return dpbusd_evex(acc, u, x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
}

/* acc + the sums of each 2 products of 16-bit a and b, per 32-bit lane. */
static inline __attribute__((always_inline)) __m256i dot_s16(__m256i acc, __m256i a, __m256i b,
                                                             const int vnni) {
    if (vnni == 1) return dpwssd_vex(acc, a, b);
    if (vnni == 2) return dpwssd_evex(acc, a, b);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

/* A Q6_K block's integer products with a token (8 lanes) less the -32 offset's share,
 * 32 sum_g sc_g bsum_g (`sc16` its scales, `bsum` the token's 16s' sums). */
static inline __attribute__((always_inline)) __m256i q6k_offset(__m256i dots, __m256i bsum,
                                                                __m256i sc16) {
    return _mm256_sub_epi32(dots, _mm256_slli_epi32(_mm256_madd_epi16(bsum, sc16), 5));
}

/* Two rows' whole block integer sums (8 lanes each; d1 = d0 for one row) into their float
 * sums, lanes 0 and 1 of `whole`, times s0 and s1 (d dx): the one-token and several-token
 * forms' float operations, the same so that both give the same bits. */
static inline __attribute__((always_inline)) __m128 q6k_whole(__m256i d0, __m256i d1, float s0,
                                                              float s1, __m128 whole) {
    const __m256i h = _mm256_hadd_epi32(d0, d1);
    __m128i total = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    total = _mm_hadd_epi32(total, total); /* row 0's, row 1's, again */
    return _mm_fmadd_ps(_mm_cvtepi32_ps(total), _mm_setr_ps(s0, s1, 0.0f, 0.0f), whole);
}

/* A Q6_K block's integer sum sc (u - 32) x with one token's activations `q` (k_slot
 * order; `bsum` their 16s' sums), 8 lanes to add: each sub-block's codes are unpacked
 * and meet the token at once. The form for several tokens keeps a block's 8 unpacked
 * vectors (and 8 scale pairs) for every token: at two rows they spill, and a row's
 * block ran at 28 reference cycles in L1 on Zen 3 against 22 in this form. */
static inline __attribute__((always_inline)) __m256i q6k_block_dots1(const uint8_t *blk,
                                                                     const int8_t *q,
                                                                     __m256i bsum,
                                                                     const int vnni) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    __m256i dots = _mm256_setzero_si256();
    for (int hh = 0; hh < 2; hh++) {
        const __m256i lane = q6k_scale_half(sc16, hh);
        __m256i u[4];
        q6k_half_codes(blk, hh, u);
        for (int i = 0; i < 4; i++) {
            const __m256i xq = _mm256_loadu_si256((const __m256i *)(q + 32 * k_slot(4 * hh + i)));
            dots = dot_s16(dots, _mm256_maddubs_epi16(u[i], xq), q6k_scale_pair(lane, i), vnni);
            /* one chain of adds: GCC otherwise sums the 8 products as a tree, all of them
             * live at once, and spills them */
            __asm__("" : "+x"(dots));
        }
    }
    return q6k_offset(dots, bsum, sc16);
}

/* Q6_K rows `row0` and `row1` (row1 NULL where nr is 1) with one token: the same integer
 * sums and float operations as rows_dots_k_typed's, block by block. */
static inline __attribute__((always_inline)) void q6k_rows_dots1(const int nr, const uint8_t *row0,
                                                                 const uint8_t *row1,
                                                                 const QuantX *x, float *out0,
                                                                 float *out1, const int vnni) {
    const int blocks = x->cols / QK_BLOCK;
    __m128 whole = _mm_setzero_ps(); /* rows 0 and 1 in lanes 0 and 1 */
    for (int b = 0; b < blocks; b++) {
        for (int s = 0; s < 4; s++) prefetch_rows(GGML_Q6_K, row0, row1, 256L * b + 64 * s);
        const int8_t *q = x->qk + QK_BLOCK * b;
        const __m256i bsum = _mm256_loadu_si256((const __m256i *)(x->bsum + 16 * b));
        const float dx = x->dk[b];
        const uint8_t *blk0 = row0 + 210L * b, *blk1 = (nr == 2 ? row1 : row0) + 210L * b;
        const __m256i d0 = q6k_block_dots1(blk0, q, bsum, vnni);
        /* row 1 reads the activations again (memory operands): kept from row 0, GCC spills
         * them and the products (23 reference cycles a row's block against 21.5) */
        __asm__ volatile("" : : : "memory");
        const __m256i d1 = nr == 2 ? q6k_block_dots1(blk1, q, bsum, vnni) : d0;
        whole = q6k_whole(d0, d1, half(blk0 + 208) * dx, half(blk1 + 208) * dx, whole);
    }
    *out0 = _mm_cvtss_f32(whole);
    if (nr == 2) *out1 = _mm_cvtss_f32(_mm_shuffle_ps(whole, whole, 1));
}

/* K-quant rows `row0` and `row1` (nr of them: row1 is NULL where nr is 1) with `nt`
 * tokens: each block's codes and scales are unpacked once and meet every token. */
static inline __attribute__((always_inline)) void rows_dots_k_typed(
    const int type, const int nr, const uint8_t *row0, const uint8_t *row1, int nt,
    const QuantX *x, float *out0, float *out1, const int vnni) {
    const int cols = x->cols, blocks = cols / QK_BLOCK;
    const long k_bytes = value_offset(type, QK_BLOCK);
    const uint8_t *rows[2] = {row0, row1};
    __m256 acc[2][TOKEN_BLOCK];
    __m128 whole[TOKEN_BLOCK]; /* Q6_K: rows 0 and 1 in lanes 0 and 1 */
    for (int t = 0; t < nt; t++) {
        acc[0][t] = acc[1][t] = _mm256_setzero_ps();
        whole[t] = _mm_setzero_ps();
    }
    for (int b = 0; b < blocks; b++) {
        KInts k[2];
        __m256i u[2][8], sc[2][8];
        for (int r = 0; r < nr; r++) {
            const uint8_t *blk = rows[r] + k_bytes * b;
            k_ints(type, blk, &k[r]);
            /* sub-block j's groups 2 j and 2 j + 1: 32 bits of sc, spread over the halves */
            const __m256i spread = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,
                                                    2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3);
            if (type == GGML_Q6_K) {
                q6k_codes(blk, u[r]);
                q6k_scale_pairs(k[r].sc, sc[r]);
                continue;
            }
            for (int j = 0; j < 8; j++) {
                u[r][j] = k_codes32(type, blk, j);
                __m256i pair = _mm256_permutevar8x32_epi32(k[r].sc, _mm256_set1_epi32(j));
                sc[r][j] = _mm256_shuffle_epi8(pair, spread);
            }
        }
        for (int s = 0; s < 4; s++) prefetch_rows(type, row0, row1, 256L * b + 64 * s);
        for (int t = 0; t < nt; t++) {
            const int8_t *q = x->qk + (long)t * cols + QK_BLOCK * b;
            __m256i bsum = _mm256_loadu_si256((const __m256i *)(x->bsum + (long)t * (cols / 16) + 16 * b));
            const float dx = x->dk[(long)t * blocks + b];
            __m256i dots[2];
            for (int r = 0; r < nr; r++) {
                dots[r] = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    __m256i xq = _mm256_loadu_si256((const __m256i *)(q + 32 * k_slot(j)));
                    dots[r] = dot_s16(dots[r], _mm256_maddubs_epi16(u[r][j], xq), sc[r][j], vnni);
                }
                if (type != GGML_Q6_K) acc[r][t] = k_block_sums(type, &k[r], dots[r], bsum, dx, acc[r][t]);
            }
            if (type == GGML_Q6_K) { /* the block's whole integer sums, as rows_q6k_wide's */
                for (int r = 0; r < nr; r++) dots[r] = q6k_offset(dots[r], bsum, k[r].sc);
                whole[t] = q6k_whole(dots[0], dots[nr - 1], k[0].d * dx, k[nr - 1].d * dx, whole[t]);
            }
        }
    }
    if (type == GGML_Q6_K) {
        for (int t = 0; t < nt; t++) {
            out0[t] = _mm_cvtss_f32(whole[t]);
            if (nr == 2) out1[t] = _mm_cvtss_f32(_mm_shuffle_ps(whole[t], whole[t], 1));
        }
        return;
    }
    for (int t = 0; t < nt; t++) hsum_rows(nr, acc[0][t], acc[1][t], out0 + t, out1 + t);
}

/* Products of legacy-type rows `row0` and `row1` (of one type; row1 may be NULL) with `nt`
 * tokens' quantized activations: each block is unpacked once and meets every token, and
 * each (row, token) sum runs in block order, whatever the number of tokens or the other
 * row. */
static inline __attribute__((always_inline)) void rows_dots_q_typed(
    const int type, const int nr, const uint8_t *row0, const uint8_t *row1, int nt,
    const QuantX *x, float *out0, float *out1, const int vnni) {
    if (nr == 1) row1 = NULL;
    const int cols = x->cols, blocks = cols / QX_BLOCK, is_signed = type == GGML_Q8_0;
    const int qs = q_stride(cols), xs_stride = x_stride(cols);
    __m256 acc0[TOKEN_BLOCK], acc1[TOKEN_BLOCK];
    float off0[TOKEN_BLOCK], off1[TOKEN_BLOCK];
    for (int t = 0; t < nt; t++) {
        acc0[t] = acc1[t] = _mm256_setzero_ps();
        off0[t] = off1[t] = 0.0f;
    }
    for (int b = 0; b < blocks; b++) {
        prefetch_rows(type, row0, row1, 32L * b);
        float ab0[4], ab1[4] = {0};
        __m256i u0, u1;
        u0 = u1 = unpack32(type, row0, b, ab0);
        if (row1) u1 = unpack32(type, row1, b, ab1);
        __m256i m0 = is_signed ? _mm256_sign_epi8(u0, u0) : u0;
        __m256i m1 = is_signed ? _mm256_sign_epi8(u1, u1) : u1;
        for (int t = 0; t < nt; t++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(x->q + (long)t * qs + 32 * b));
            __m256i q0 = is_signed ? _mm256_sign_epi8(q, u0) : q;
            __m256 p0 = _mm256_cvtepi32_ps(dot_u8(_mm256_setzero_si256(), m0, q0, vnni));
            const float dx = x->scale[t * xs_stride + 2 * b];
            const float *xs = x->xsum + (long)t * xs_stride + 2 * b;
            acc0[t] = _mm256_fmadd_ps(p0, _mm256_set1_ps(ab0[0] * dx), acc0[t]);
            off0[t] += ab0[2] * (xs[0] + xs[1]);
            if (!row1) continue;
            __m256i q1 = is_signed ? _mm256_sign_epi8(q, u1) : q;
            __m256 p1 = _mm256_cvtepi32_ps(dot_u8(_mm256_setzero_si256(), m1, q1, vnni));
            acc1[t] = _mm256_fmadd_ps(p1, _mm256_set1_ps(ab1[0] * dx), acc1[t]);
            off1[t] += ab1[2] * (xs[0] + xs[1]);
        }
    }
    for (int t = 0; t < nt; t++) {
        out0[t] = hsum(acc0[t]) + off0[t];
        if (row1) out1[t] = hsum(acc1[t]) + off1[t];
    }
}

/*
 * The same products with AVX512-VNNI (chosen at run time where the CPU has it): two
 * blocks (64 codes) a step, `vpdpbusd` summing each 4 code x activation products into 32
 * bits, so Q8_0's signed codes are shifted to unsigned (u = w + 128, B = -128 d) instead
 * of lending their signs. Per (row, token) the operations are fixed, whatever the batch.
 */
#define AVX512 TARGET_AVX512

/* unpack64 of two whole Q4_0, Q4_1 or Q8_0 blocks, in vectors: the same codes, A and B
 * (the scales converted four at a time, the nibbles of both blocks split at once). */
static inline AVX512 __attribute__((always_inline)) __m512i unpack64_pair(
    int type, const uint8_t *row, int h, __m128 *a, __m128 *b) {
    const long size = type == GGML_Q8_0 ? 34 : type == GGML_Q4_1 ? 20 : 18;
    const uint8_t *b0 = row + size * 2 * h, *b1 = b0 + size;
    if (type == GGML_Q8_0) { /* signed codes: w + 128, and the offset takes it back */
        __m256i u0 = _mm256_loadu_si256((const __m256i *)(b0 + 2));
        __m256i u1 = _mm256_loadu_si256((const __m256i *)(b1 + 2));
        uint16_t d0, d1;
        memcpy(&d0, b0, 2);
        memcpy(&d1, b1, 2);
        __m128 d = _mm_cvtph_ps(_mm_cvtsi32_si128(d0 | (uint32_t)d1 << 16)); /* d0 d1 */
        *a = _mm_unpacklo_ps(d, d);
        *b = _mm_mul_ps(_mm_set1_ps(-128.0f), *a);
        __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
        return _mm512_xor_si512(u, _mm512_set1_epi8((char)0x80));
    }
    const int one = type == GGML_Q4_1;
    uint32_t s0, s1; /* d, and m for Q4_1 */
    memcpy(&s0, b0, 4);
    memcpy(&s1, b1, 4);
    __m128 dm = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)(s0 | (uint64_t)s1 << 32)));
    /* dm: d0 m0 d1 m1 (Q4_1), d0 x d1 x (Q4_0) */
    *a = _mm_shuffle_ps(dm, dm, _MM_SHUFFLE(2, 2, 0, 0));
    *b = one ? _mm_shuffle_ps(dm, dm, _MM_SHUFFLE(3, 3, 1, 1)) : _mm_mul_ps(_mm_set1_ps(-8.0f), *a);
    __m256i v = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(b0 + 2 + 2 * one))),
        _mm_loadu_si128((const __m128i *)(b1 + 2 + 2 * one)), 1);
    __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    u = _mm512_and_si512(u, _mm512_set1_epi8(0x0F)); /* lo0 lo1 hi0 hi1 */
    return _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0)); /* lo0 hi0 lo1 hi1 */
}

/* Blocks 2 h and 2 h + 1 of a row: 64 unsigned codes, and A and B for each 16. */
static inline AVX512 __attribute__((always_inline)) __m512i unpack64(
    int type, const uint8_t *row, int h, int blocks, __m128 *a, __m128 *b) {
    if (2 * h + 1 < blocks && (type == GGML_Q4_0 || type == GGML_Q4_1 || type == GGML_Q8_0))
        return unpack64_pair(type, row, h, a, b);
    float lo[4], hi[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    __m256i u0 = unpack32(type, row, 2 * h, lo), u1 = _mm256_setzero_si256();
    if (2 * h + 1 < blocks) u1 = unpack32(type, row, 2 * h + 1, hi);
    if (type == GGML_Q8_0) { /* signed codes: w + 128, and the offset takes it back */
        const __m256i flip = _mm256_set1_epi8((char)0x80);
        u0 = _mm256_xor_si256(u0, flip);
        lo[2] = lo[3] = -128.0f * lo[0];
        if (2 * h + 1 < blocks) {
            u1 = _mm256_xor_si256(u1, flip);
            hi[2] = hi[3] = -128.0f * hi[0];
        }
    }
    *a = _mm_setr_ps(lo[0], lo[1], hi[0], hi[1]);
    *b = _mm_setr_ps(lo[2], lo[3], hi[2], hi[3]);
    return _mm512_inserti64x4(_mm512_castsi256_si512(u0), u1, 1);
}

/* Step s of a K-quant block: 64 codes, the sub-blocks in slots 2 s and 2 s + 1 (k_slot:
 * sub-blocks a and a + 2, a = 4 (s / 2) + s % 2), each half shifted by its own count. */
static inline AVX512 __attribute__((always_inline)) __m512i k_codes(int type, const uint8_t *blk,
                                                                    int s) {
    const int a = 4 * (s / 2) + s % 2;
    if (type == GGML_Q4_K || type == GGML_Q5_K) { /* a's codes are a byte's nibble s % 2 */
        const int five = type == GGML_Q5_K;
        __m512i u = _mm512_loadu_si512(blk + 16 + 32 * five + 64 * (s / 2));
        u = _mm512_and_si512(_mm512_srli_epi16(u, 4 * (s % 2)), _mm512_set1_epi8(0x0F));
        if (five) { /* bit a (and a + 2) of each byte of qh */
            __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
            const __m512i by = _mm512_inserti64x4(_mm512_set1_epi16((short)a),
                                                  _mm256_set1_epi16((short)(a + 2)), 1);
            h = _mm512_and_si512(_mm512_srlv_epi16(h, by), _mm512_set1_epi8(1));
            u = _mm512_or_si512(u, _mm512_slli_epi16(h, 4));
        }
        return u;
    }
    /* Q6_K: a and a + 2 share 32 bytes of ql (low and high nibbles) and of qh (2 bits each) */
    const int hh = s / 2, k = s % 2;
    const __m512i by_l = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i by_h = _mm512_inserti64x4(_mm512_set1_epi16((short)(2 * k)),
                                            _mm256_set1_epi16((short)(2 * k + 4)), 1);
    __m512i l = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 64 * hh + 32 * k)));
    __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * hh)));
    l = _mm512_and_si512(_mm512_srlv_epi16(l, by_l), _mm512_set1_epi8(0x0F));
    h = _mm512_and_si512(_mm512_srlv_epi16(h, by_h), _mm512_set1_epi8(3));
    return _mm512_or_si512(l, _mm512_slli_epi16(h, 4));
}

/* Which of a block's 16 group scales each 16-bit lane of step s's products takes (groups
 * 2 a, 2 a + 1, 2 a + 4, 2 a + 5, 8 lanes each). */
static const int16_t K_STEP_GROUPS[4][32] __attribute__((aligned(64))) = {
    {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
    {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
    {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9, 12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
    {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11, 14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15},
};

/* rows_dots_k_typed with AVX512: 64 codes a step, their pairs' sums (16 bits) times the
 * groups' scales summed into 32 bits by `vpdpwssd`. */
static inline AVX512 __attribute__((always_inline)) void rows_dots_k512_typed(
    const int type, const int nr, const uint8_t *row0, const uint8_t *row1, int nt,
    const QuantX *x, float *out0, float *out1) {
    const int cols = x->cols, blocks = cols / QK_BLOCK;
    const long k_bytes = value_offset(type, QK_BLOCK);
    const uint8_t *rows[2] = {row0, row1};
    __m256 acc[2][TOKEN_BLOCK];
    for (int r = 0; r < 2; r++)
        for (int t = 0; t < nt; t++) acc[r][t] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        KInts k[2];
        __m512i u[2][4], sc[2][4];
        for (int r = 0; r < nr; r++) {
            const uint8_t *blk = rows[r] + k_bytes * b;
            k_ints(type, blk, &k[r]);
            __m512i scales = _mm512_castsi256_si512(k[r].sc);
            for (int s = 0; s < 4; s++) {
                u[r][s] = k_codes(type, blk, s);
                sc[r][s] = _mm512_permutexvar_epi16(_mm512_load_si512(K_STEP_GROUPS[s]), scales);
            }
        }
        for (int s = 0; s < 4; s++) prefetch_rows(type, row0, row1, 256L * b + 64 * s);
        for (int t = 0; t < nt; t++) {
            const int8_t *q = x->qk + (long)t * cols + QK_BLOCK * b;
            __m512i xq[4];
            for (int s = 0; s < 4; s++) xq[s] = _mm512_loadu_si512(q + 64 * s);
            __m256i bsum = _mm256_loadu_si256((const __m256i *)(x->bsum + (long)t * (cols / 16) + 16 * b));
            const float dx = x->dk[(long)t * blocks + b];
            for (int r = 0; r < nr; r++) {
                __m512i dots = _mm512_setzero_si512();
                for (int s = 0; s < 4; s++)
                    dots = _mm512_dpwssd_epi32(dots, _mm512_maddubs_epi16(u[r][s], xq[s]), sc[r][s]);
                __m256i d8 = _mm256_add_epi32(_mm512_castsi512_si256(dots), _mm512_extracti64x4_epi64(dots, 1));
                acc[r][t] = k_block_sums(type, &k[r], d8, bsum, dx, acc[r][t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) hsum_rows(nr, acc[0][t], acc[1][t], out0 + t, out1 + t);
}

/* The sum of a (row, token) product's float accumulators. */
static inline AVX512 __attribute__((always_inline)) float q512_total(__m512 acc, __m128 off) {
    off = _mm_add_ps(off, _mm_movehl_ps(off, off));
    return _mm512_reduce_add_ps(acc) + _mm_cvtss_f32(_mm_add_ss(off, _mm_movehdup_ps(off)));
}

#define Q_TOKENS 4 /* tokens whose legacy-type sums stay in registers */

/* rows_dots_q512_typed for several tokens: both rows are unpacked once into a buffer,
 * then each group of Q_TOKENS tokens runs every step with its sums in registers. Each
 * (row, token) product runs rows_dots_q512_typed's operations, in the same order. */
static inline AVX512 __attribute__((always_inline)) void rows_dots_q512_batch(
    const int type, const int nr, const uint8_t *row0, const uint8_t *row1, int nt,
    const QuantX *x, float *out0, float *out1) {
    const int cols = x->cols, blocks = cols / QX_BLOCK, steps = (blocks + 1) / 2;
    const int qs = q_stride(cols), xs_stride = x_stride(cols);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const uint8_t *rows[2] = {row0, row1};
    float *outs[2] = {out0, out1};
    __m512i codes[2][steps];
    __m512 a[2][steps]; /* each 16's A, as the lanes of the products take it */
    __m128 b[2][steps];
    for (int h = 0; h < steps; h++) {
        prefetch_rows(type, row0, nr == 2 ? row1 : NULL, 64L * h);
        for (int r = 0; r < nr; r++) {
            __m128 a4;
            codes[r][h] = unpack64(type, rows[r], h, blocks, &a4, &b[r][h]);
            a[r][h] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(a4));
        }
    }
    for (int t0 = 0; t0 < nt; t0 += Q_TOKENS) {
        const int group = nt - t0 < Q_TOKENS ? nt - t0 : Q_TOKENS;
        __m512 acc[2][Q_TOKENS];
        __m128 off[2][Q_TOKENS];
        for (int r = 0; r < 2; r++)
            for (int j = 0; j < Q_TOKENS; j++) acc[r][j] = _mm512_setzero_ps(), off[r][j] = _mm_setzero_ps();
        for (int h = 0; h < steps; h++)
            for (int j = 0; j < Q_TOKENS; j++) {
                if (j >= group) break;
                const long t = t0 + j;
                __m512i q = _mm512_loadu_si512(x->q + t * qs + 64 * h);
                __m128 dx4 = _mm_loadu_ps(x->scale + t * xs_stride + 4 * h);
                __m512 dx = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(dx4));
                __m128 xs = _mm_loadu_ps(x->xsum + t * xs_stride + 4 * h);
                for (int r = 0; r < nr; r++) {
                    __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), codes[r][h], q));
                    acc[r][j] = _mm512_fmadd_ps(p, _mm512_mul_ps(a[r][h], dx), acc[r][j]);
                    off[r][j] = _mm_fmadd_ps(b[r][h], xs, off[r][j]);
                }
            }
        for (int r = 0; r < nr; r++)
            for (int j = 0; j < group; j++) outs[r][t0 + j] = q512_total(acc[r][j], off[r][j]);
    }
}

static inline AVX512 __attribute__((always_inline)) void rows_dots_q512_typed(
    const int type, const int nr, const uint8_t *row0, const uint8_t *row1, int nt,
    const QuantX *x, float *out0, float *out1) {
    if (nt > 1) {
        rows_dots_q512_batch(type, nr, row0, row1, nt, x, out0, out1);
        return;
    }
    if (nr == 1) row1 = NULL;
    const int cols = x->cols, blocks = cols / QX_BLOCK, steps = (blocks + 1) / 2;
    const int qs = q_stride(cols), xs_stride = x_stride(cols);
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc0[TOKEN_BLOCK], acc1[TOKEN_BLOCK];
    __m128 off0[TOKEN_BLOCK], off1[TOKEN_BLOCK];
    for (int t = 0; t < nt; t++) {
        acc0[t] = acc1[t] = _mm512_setzero_ps();
        off0[t] = off1[t] = _mm_setzero_ps();
    }
    for (int h = 0; h < steps; h++) {
        prefetch_rows(type, row0, row1, 64L * h);
        __m128 a0, b0, a1 = _mm_setzero_ps(), b1 = a1;
        __m512i u0, u1;
        u0 = u1 = unpack64(type, row0, h, blocks, &a0, &b0);
        if (row1) u1 = unpack64(type, row1, h, blocks, &a1, &b1);
        for (int t = 0; t < nt; t++) {
            __m512i q = _mm512_loadu_si512(x->q + (long)t * qs + 64 * h);
            __m128 dx = _mm_loadu_ps(x->scale + (long)t * xs_stride + 4 * h);
            __m128 xs = _mm_loadu_ps(x->xsum + (long)t * xs_stride + 4 * h);
            __m512 p0 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, q));
            __m512 s0 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(a0, dx)));
            acc0[t] = _mm512_fmadd_ps(p0, s0, acc0[t]);
            off0[t] = _mm_fmadd_ps(b0, xs, off0[t]);
            if (!row1) continue;
            __m512 p1 = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, q));
            __m512 s1 = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(a1, dx)));
            acc1[t] = _mm512_fmadd_ps(p1, s1, acc1[t]);
            off1[t] = _mm_fmadd_ps(b1, xs, off1[t]);
        }
    }
    for (int t = 0; t < nt; t++) {
        out0[t] = q512_total(acc0[t], off0[t]);
        if (row1) out1[t] = q512_total(acc1[t], off1[t]);
    }
}

#define GROUP_AHEAD 8192 /* how far ahead of the products a group's bytes are fetched */
#define GROUP_AHEAD_L2 32768 /* and how far ahead into L2 */

/* Fetch into L1 the group's bytes GROUP_AHEAD past block `blk` of `size` bytes (groups lie
 * one after another: this runs on into the next group), and into L2 those GROUP_AHEAD_L2
 * past it, so that the L1 fetch finds them there (Q4_K at 1024 columns streamed from
 * memory, alternated 30 times in one process: median 371 -> 381 GOP/s, faster in 20; at
 * 4096 columns no change). */
static inline void prefetch_group_block(const uint8_t *blk, long size) {
    for (long o = 0; o < size; o += 64) {
        _mm_prefetch((const char *)blk + GROUP_AHEAD + o, _MM_HINT_T0);
        _mm_prefetch((const char *)blk + GROUP_AHEAD_L2 + o, _MM_HINT_T1);
    }
}
#define G_TOKENS 8        /* tokens whose interleaved-row sums stay in registers */

/* A group of 16 interleaved rows (see infire_repack_rows16) with `nt` tokens: out[t * 16
 * + i] is row i's product with token t. Per block, the group's codes are unpacked once for
 * each G_TOKENS tokens; per (row, token) the operations are fixed, whatever the batch. */
static inline AVX512 __attribute__((always_inline)) void rows16_typed(
    const int type, const uint8_t *group, int nt, const QuantX *x, float *out) {
    const int cols = x->cols, blocks = cols / QX_BLOCK, qs = q_stride(cols), xs = x_stride(cols);
    const long size = GROUP_ROWS * value_offset(type, QX_BLOCK);
    const int four = type != GGML_Q8_0, sb = group_scale_bytes(type);
    for (int t0 = 0; t0 < nt; t0 += G_TOKENS) {
        const int count = nt - t0 < G_TOKENS ? nt - t0 : G_TOKENS;
        __m512 acc[G_TOKENS];
        for (int j = 0; j < G_TOKENS; j++) acc[j] = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b++) {
            const uint8_t *blk = group + b * size;
            if (t0 == 0) /* later tokens find the group in cache */
                prefetch_group_block(blk, size);
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
            const __m512 off = type == GGML_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                                 : _mm512_mul_ps(d, _mm512_set1_ps(four ? -8.0f : -128.0f));
            const uint8_t *codes = blk + GROUP_ROWS * sb;
            __m512i u[8]; /* u[k]: values 4 k .. 4 k + 3, row i in lane i */
            for (int k = 0; k < 8; k++)
                if (four) { /* rows 0-7 from the low nibbles, 8-15 from the high */
                    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(codes + 32 * k)));
                    u[k] = _mm512_and_si512(_mm512_srlv_epi16(v, _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1)),
                                            _mm512_set1_epi8(0x0F));
                } else
                    u[k] = _mm512_loadu_si512(codes + 64 * k);
            for (int j = 0; j < G_TOKENS; j++) {
                if (j >= count) break;
                const long t = t0 + j;
                const int8_t *q = x->q + t * qs + QX_BLOCK * b;
                __m512i dot0 = _mm512_setzero_si512(), dot1 = dot0;
                for (int k = 0; k < 8; k += 2) {
                    int32_t a, c;
                    memcpy(&a, q + 4 * k, 4);
                    memcpy(&c, q + 4 * k + 4, 4);
                    dot0 = _mm512_dpbusd_epi32(dot0, u[k], _mm512_set1_epi32(a));
                    dot1 = _mm512_dpbusd_epi32(dot1, u[k + 1], _mm512_set1_epi32(c));
                }
                const __m512 p = _mm512_cvtepi32_ps(_mm512_add_epi32(dot0, dot1));
                acc[j] = _mm512_fmadd_ps(p, _mm512_mul_ps(d, _mm512_set1_ps(x->scale[t * xs + 2 * b])), acc[j]);
                acc[j] = _mm512_fmadd_ps(off, _mm512_set1_ps(x->xblock[t * blocks + b]), acc[j]);
            }
        }
        for (int j = 0; j < count; j++) _mm512_storeu_ps(out + (long)(t0 + j) * GROUP_ROWS, acc[j]);
    }
}

static AVX512 void rows16_dots512(int type, const uint8_t *group, int nt, const QuantX *x,
                                  float *out) {
    if (type == GGML_Q4_0) rows16_typed(GGML_Q4_0, group, nt, x, out);
    else if (type == GGML_Q4_1) rows16_typed(GGML_Q4_1, group, nt, x, out);
    else rows16_typed(GGML_Q8_0, group, nt, x, out);
}

#define G2_TOKENS 4 /* at most this many tokens' sums stay in registers in the 256-bit group
                     * kernels: `tk` of them (see rows16_dots256) */

/* The same with 256-bit vectors (AVX2, and the 256-bit VNNI ISAs), Q8_0: a group's 64-byte
 * vectors taken as two halves of 8 rows. The codes are turned back to signed and meet the
 * activations as |w| and q with w's sign (pair sums <= 32512, widened one by one), so the
 * offset is 0. Per (row, token) the operations are fixed, whatever the batch. */
static inline __attribute__((always_inline)) void rows16_q8_0(const int tk, const uint8_t *group,
                                                              int nt, const QuantX *x, float *out) {
    const int cols = x->cols, blocks = cols / QX_BLOCK, qs = q_stride(cols), xs = x_stride(cols);
    const long size = GROUP_ROWS * value_offset(GGML_Q8_0, QX_BLOCK);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t0 = 0; t0 < nt; t0 += tk) {
        const int count = nt - t0 < tk ? nt - t0 : tk;
        __m256 acc[2][G2_TOKENS];
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < tk; j++) acc[h][j] = _mm256_setzero_ps();
        for (int b = 0; b < blocks; b++) {
            const uint8_t *blk = group + b * size;
            if (t0 == 0) /* later tokens find the group in cache */
                prefetch_group_block(blk, size);
            for (int h = 0; h < 2; h++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
                const uint8_t *codes = blk + GROUP_ROWS * group_scale_bytes(GGML_Q8_0) + 32 * h;
                __m256i u[8];
                for (int k = 0; k < 8; k++)
                    u[k] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(codes + 64 * k)),
                                            _mm256_set1_epi8((char)0x80));
                for (int j = 0; j < tk; j++) {
                    if (j >= count) break;
                    const long t = t0 + j;
                    const int8_t *q = x->q + t * qs + QX_BLOCK * b;
                    __m256i d0 = _mm256_setzero_si256(), d1 = d0;
                    for (int k = 0; k < 8; k += 2) {
                        int32_t a, c;
                        memcpy(&a, q + 4 * k, 4);
                        memcpy(&c, q + 4 * k + 4, 4);
                        __m256i p0 = _mm256_maddubs_epi16(_mm256_sign_epi8(u[k], u[k]),
                                                          _mm256_sign_epi8(_mm256_set1_epi32(a), u[k]));
                        __m256i p1 = _mm256_maddubs_epi16(_mm256_sign_epi8(u[k + 1], u[k + 1]),
                                                          _mm256_sign_epi8(_mm256_set1_epi32(c), u[k + 1]));
                        d0 = _mm256_add_epi32(d0, _mm256_madd_epi16(p0, ones));
                        d1 = _mm256_add_epi32(d1, _mm256_madd_epi16(p1, ones));
                    }
                    const __m256 p = _mm256_cvtepi32_ps(_mm256_add_epi32(d0, d1));
                    acc[h][j] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(x->scale[t * xs + 2 * b])), acc[h][j]);
                }
            }
        }
        for (int j = 0; j < count; j++)
            for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + (long)(t0 + j) * GROUP_ROWS + 8 * h, acc[h][j]);
    }
}

/* Q4_0 and Q4_1 rows in groups of 16 (see nibble_group_codes) with tokens t0 .. t0 + tk - 1:
 * a vector's low nibbles are rows 0-7's codes, its high ones rows 8-15', both meeting one
 * broadcast of a token's 4 activations. A block's 8 `vpmaddubsw` a row half (pair sums of
 * codes 0..15 times activations |q| <= 128: at most 3840) add up in 16 bits (at most 30720)
 * before one `vpmaddwd` widens them. Per (row, token) the operations are fixed, whatever
 * `tk`. */
static inline __attribute__((always_inline)) void rows16_q4(const int type, const int tk,
                                                            const uint8_t *group, int t0,
                                                            const QuantX *x, float *out) {
    const int cols = x->cols, blocks = cols / QX_BLOCK, qs = q_stride(cols), xs = x_stride(cols);
    const long size = GROUP_ROWS * value_offset(type, QX_BLOCK);
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 acc[2][G2_TOKENS];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < tk; j++) acc[h][j] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = group + b * size;
        if (t0 == 0) /* later tokens find the group in cache */
            prefetch_group_block(blk, size);
        const uint8_t *codes = blk + GROUP_ROWS * group_scale_bytes(type);
        __m256i slo[G2_TOKENS], shi[G2_TOKENS];
        for (int j = 0; j < tk; j++) slo[j] = shi[j] = _mm256_setzero_si256();
#pragma GCC unroll 4
        for (int k = 0; k < 8; k++) { /* values 4 k .. 4 k + 3 of the 16 rows */
            const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 32 * k));
            const __m256i lo = _mm256_and_si256(v, low4);
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int j = 0; j < tk; j++) {
                int32_t e;
                memcpy(&e, x->q + (long)(t0 + j) * qs + QX_BLOCK * b + 4 * k, 4);
                const __m256i a = _mm256_set1_epi32(e);
                slo[j] = _mm256_add_epi16(slo[j], _mm256_maddubs_epi16(lo, a));
                shi[j] = _mm256_add_epi16(shi[j], _mm256_maddubs_epi16(hi, a));
            }
        }
        for (int j = 0; j < tk; j++) {
            const long t = t0 + j;
            const __m256 sx = _mm256_set1_ps(x->scale[t * xs + 2 * b]), bx = _mm256_set1_ps(x->xblock[t * blocks + b]);
            for (int h = 0; h < 2; h++) {
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
                const __m256 off = type == GGML_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)))
                                                     : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
                const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(h ? shi[j] : slo[j], ones));
                acc[h][j] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, sx), acc[h][j]);
                acc[h][j] = _mm256_fmadd_ps(off, bx, acc[h][j]);
            }
        }
    }
    for (int j = 0; j < tk; j++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + (long)(t0 + j) * GROUP_ROWS + 8 * h, acc[h][j]);
}

/* Byte j of each 32-bit lane (one row) in the low byte of both of its 16-bit halves (`pair`:
 * bytes j and j + 1, one a half), zero-extended. */
static inline __m256i lane_bytes16(__m256i v, int j, int pair) {
    const int lo = j, hi = j + pair;
    const __m256i lanes = _mm256_setr_epi32(0, 0x00040004, 0x00080008, 0x000C000C, 0, 0x00040004,
                                            0x00080008, 0x000C000C);
    return _mm256_shuffle_epi8(v, _mm256_add_epi32(lanes, _mm256_set1_epi32(lo | 0x8000 | hi << 16 | (int)0x80000000)));
}

/* A Q4_K group block's 6-bit scales and mins (see group_layout), per row half h (rows 8 h ..
 * 8 h + 7, a 32-bit lane each): sc[h][s] sub-block s's scale in both 16-bit halves of its
 * row's lane, mn[h][c] the mins of sub-blocks 2 c and 2 c + 1 in the low and high halves. */
static inline __attribute__((always_inline)) void q4k_group_scales(const uint8_t *blk, __m256i sc[2][8],
                                                                   __m256i mn[2][4]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), six = _mm256_set1_epi8(0x3F);
    const __m256i top2 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i s0 = _mm256_loadu_si256((const __m256i *)(blk + 64 + 32 * h));
        const __m256i s1 = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        const __m256i s2 = _mm256_loadu_si256((const __m256i *)(blk + 192 + 32 * h));
        /* per row: scales and mins of sub-blocks 0-3 and 4-7, a byte each */
        const __m256i sc_lo = _mm256_and_si256(s0, six), m_lo = _mm256_and_si256(s1, six);
        const __m256i sc_hi = _mm256_or_si256(_mm256_and_si256(s2, low4),
                                              _mm256_and_si256(_mm256_srli_epi32(s0, 2), top2));
        const __m256i m_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(s2, 4), low4),
                                             _mm256_and_si256(_mm256_srli_epi32(s1, 2), top2));
        for (int s = 0; s < 8; s++) sc[h][s] = lane_bytes16(s < 4 ? sc_lo : sc_hi, s % 4, 0);
        for (int c = 0; c < 4; c++) mn[h][c] = lane_bytes16(c < 2 ? m_lo : m_hi, (2 * c) % 4, 1);
    }
}

/* Q4_K rows in groups of 16 (see group_layout, nibble_group_codes) with tokens t0 .. t0 + tk - 1's
 * per-256 activations: a vector's low nibbles are 8 rows' codes, its high nibbles the other 8
 * rows', both meeting one broadcast of a token's 4 activations. A sub-block's 8 `vpmaddubsw`
 * a row half (codes 0..15, pair sums at most 3840) add up in 16 bits before `vpmaddwd`
 * multiplies them by the rows' 6-bit scales into 32 bits; the mins meet the activations'
 * 32-value sums in 16-bit pairs. A block's integer sums convert to float once, as in
 * rows_dots_k_typed. Per (row, token) the operations are fixed, whatever `tk`. */
static inline __attribute__((always_inline)) void rows16_q4k(const int tk, const uint8_t *group,
                                                             int t0, const QuantX *x, float *out) {
    const int cols = x->cols, blocks = cols / QK_BLOCK;
    const long size = GROUP_ROWS * 144;
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[2][G2_TOKENS];
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < tk; j++) acc[h][j] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = group + b * size;
        if (t0 == 0) /* later tokens find the group in cache */
            prefetch_group_block(blk, size);
        __m256i sc[2][8], mn[2][4];
        q4k_group_scales(blk, sc, mn);
        __m256i isum[2][G2_TOKENS];
        for (int j = 0; j < tk; j++) isum[0][j] = isum[1][j] = _mm256_setzero_si256();
#pragma GCC unroll 1 /* unrolled, GCC 12 keeps every product on the stack before summing */
        for (int s = 0; s < 8; s++) {
            const uint8_t *codes = blk + 256 + 256 * s;
            const long at = QK_BLOCK * b + 32 * k_slot(s);
            __m256i slo[G2_TOKENS], shi[G2_TOKENS];
            for (int j = 0; j < tk; j++) slo[j] = shi[j] = _mm256_setzero_si256();
#pragma GCC unroll 4
            for (int k = 0; k < 8; k++) { /* a vector's codes meet each token */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 32 * k));
                const __m256i lo = _mm256_and_si256(v, low4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                for (int j = 0; j < tk; j++) {
                    int32_t e;
                    memcpy(&e, x->qk + (long)(t0 + j) * cols + at + 4 * k, 4);
                    const __m256i a = _mm256_set1_epi32(e);
                    slo[j] = _mm256_add_epi16(slo[j], _mm256_maddubs_epi16(lo, a));
                    shi[j] = _mm256_add_epi16(shi[j], _mm256_maddubs_epi16(hi, a));
                }
            }
            for (int j = 0; j < tk; j++) {
                isum[0][j] = _mm256_add_epi32(isum[0][j], _mm256_madd_epi16(slo[j], sc[0][s]));
                isum[1][j] = _mm256_add_epi32(isum[1][j], _mm256_madd_epi16(shi[j], sc[1][s]));
            }
        }
        for (int j = 0; j < tk; j++) {
            const int16_t *bs = x->bsum + (long)(t0 + j) * (cols / 16) + 16 * b;
            const float dx = x->dk[(long)(t0 + j) * blocks + b];
            for (int h = 0; h < 2; h++) {
                /* the mins of sub-blocks 2 c, 2 c + 1 with their activations' sums */
                __m256i msum = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    const uint32_t pair = (uint16_t)(bs[4 * c] + bs[4 * c + 1]) |
                                          (uint32_t)(uint16_t)(bs[4 * c + 2] + bs[4 * c + 3]) << 16;
                    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mn[h][c], _mm256_set1_epi32((int)pair)));
                }
                const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * h)));
                const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 32 + 16 * h)));
                acc[h][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][j]), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[h][j]);
                acc[h][j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, _mm256_set1_ps(dx)), acc[h][j]);
            }
        }
    }
    for (int j = 0; j < tk; j++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(out + (long)(t0 + j) * GROUP_ROWS + 8 * h, acc[h][j]);
}

/* A wide kernel's sums, acc[r][v] (row r of 16, tokens 8 v .. 8 v + 7), into out[t * 16 + r]
 * for the tokens of nv vectors (out holds 16 x 8 nv floats): 8 x 8 transposes, a token's 8
 * rows a store (one at a time, the 512 scalar stores of a 16-row pass were ~10% of an
 * lm_head's time at batch 32). */
static inline __attribute__((always_inline)) void store_token_rows(__m256 acc[GROUP_ROWS][4], int nv,
                                                                   float *out) {
    for (int v = 0; v < nv; v++)
        for (int h = 0; h < GROUP_ROWS; h += 8) {
            __m256 t[8], u[8];
            for (int i = 0; i < 8; i += 2) {
                t[i] = _mm256_unpacklo_ps(acc[h + i][v], acc[h + i + 1][v]);
                t[i + 1] = _mm256_unpackhi_ps(acc[h + i][v], acc[h + i + 1][v]);
            }
            for (int i = 0; i < 8; i += 4) {
                u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
                u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
                u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
                u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
            }
            for (int i = 0; i < 8; i++) /* token 8 v + i: rows h .. h + 7 */
                _mm256_storeu_ps(out + (8 * v + i) * GROUP_ROWS + h,
                                 _mm256_permute2f128_ps(u[i % 4], u[i % 4 + 4], i < 4 ? 0x20 : 0x31));
        }
}

/* A step of the wide kernels' inner loops (wide_row_block, q6k_row_block): a row's 4 codes
 * (at W) broadcast against 4 vectors of 8 tokens' activations (at A), added to the 16-bit
 * sums ymm0-3 */
#define WIDE_STEP(W, A)                                                                       \
    "vpbroadcastd " W "(%[w]), %%ymm12\n\t"                                                   \
    "vpmaddubsw " A "(%[a]), %%ymm12, %%ymm13\n\t"                                            \
    "vpaddw %%ymm13, %%ymm0, %%ymm0\n\t"                                                      \
    "vpmaddubsw " A "+32(%[a]), %%ymm12, %%ymm14\n\t"                                         \
    "vpaddw %%ymm14, %%ymm1, %%ymm1\n\t"                                                      \
    "vpmaddubsw " A "+64(%[a]), %%ymm12, %%ymm15\n\t"                                         \
    "vpaddw %%ymm15, %%ymm2, %%ymm2\n\t"                                                      \
    "vpmaddubsw " A "+96(%[a]), %%ymm12, %%ymm13\n\t"                                         \
    "vpaddw %%ymm13, %%ymm3, %%ymm3\n\t"

/* The inner loop of rows16_q4k_wide: a whole 256-value block of one row with 32 tokens.
 * Sub-block j (in k_slot order) has the row's codes at w + 512 j + 64 k (4 for each k), its
 * scale as a 16-bit pair at sc[16 j], and the tokens' activations at a + 1024 j + 128 k (4
 * vectors of 8 tokens' 4). The products' pair sums are added in 16 bits through a sub-block
 * (its first step writes them), then times the scale added in 32 bits to isum[0 .. 3] (8
 * tokens each), which stay in registers for the whole block. One row at a time with the
 * activations as memory operands: the 16 registers hold the 4 + 4 sums, a broadcast and
 * temporaries (two rows at a time needed their 32-bit sums in memory: ~15% slower). In
 * assembly: GCC (12) spills the accumulators of the same loop in intrinsics. */
static inline __attribute__((always_inline)) void wide_row_block(const int8_t *a, const uint8_t *w,
                                                                 const int32_t *sc, __m256i *isum) {
/* the first step of a sub-block: its products start the 16-bit sums */
#define WIDE_FIRST                                                                            \
    "vpbroadcastd (%[w]), %%ymm12\n\t"                                                        \
    "vpmaddubsw (%[a]), %%ymm12, %%ymm0\n\t"                                                  \
    "vpmaddubsw 32(%[a]), %%ymm12, %%ymm1\n\t"                                                \
    "vpmaddubsw 64(%[a]), %%ymm12, %%ymm2\n\t"                                                \
    "vpmaddubsw 96(%[a]), %%ymm12, %%ymm3\n\t"
#define WIDE_SCALE(S, I) "vpmaddwd %%ymm12, %%ymm" S ", %%ymm" S "\n\t" "vpaddd %%ymm" S ", %%ymm" I ", %%ymm" I "\n\t"
    long j = 8;
    __asm__ volatile(
        "vpxor %%xmm8, %%xmm8, %%xmm8\n\t"
        "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
        "vpxor %%xmm10, %%xmm10, %%xmm10\n\t"
        "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
        "1:\n\t"
        WIDE_FIRST
        WIDE_STEP("64", "128") WIDE_STEP("128", "256") WIDE_STEP("192", "384")
        WIDE_STEP("256", "512") WIDE_STEP("320", "640") WIDE_STEP("384", "768")
        WIDE_STEP("448", "896")
        "vpbroadcastd (%[sc]), %%ymm12\n\t"
        WIDE_SCALE("0", "8") WIDE_SCALE("1", "9") WIDE_SCALE("2", "10") WIDE_SCALE("3", "11")
        "add $512, %[w]\n\t"
        "add $1024, %[a]\n\t"
        "add $64, %[sc]\n\t"
        "dec %[j]\n\t"
        "jnz 1b\n\t"
        "vmovdqa %%ymm8, (%[p])\n\t"
        "vmovdqa %%ymm9, 32(%[p])\n\t"
        "vmovdqa %%ymm10, 64(%[p])\n\t"
        "vmovdqa %%ymm11, 96(%[p])\n\t"
        : [a] "+r"(a), [w] "+r"(w), [sc] "+r"(sc), [j] "+r"(j)
        : [p] "r"(isum)
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "xmm14", "xmm15");
#undef WIDE_FIRST
#undef WIDE_SCALE
}

/* A Q4_K group block's codes as bytes ([sub-block in k_slot order][k][row]: 4 codes a row,
 * as wide_row_block reads them), its scales as 16-bit pairs and its mins pairs per row. */
static inline __attribute__((always_inline)) void q4k_group_unpack(const uint8_t *blk, uint8_t codes[8][8][64],
                                                                   int32_t sc[8][GROUP_ROWS],
                                                                   int32_t mn[4][GROUP_ROWS]) {
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int s = 0; s < 8; s++) /* sub-blocks in k_slot order, as the activations */
        for (int k = 0; k < 8; k++) {
            const __m256i c = _mm256_loadu_si256((const __m256i *)(blk + 256 + 256 * s + 32 * k));
            _mm256_store_si256((__m256i *)codes[k_slot(s)][k], _mm256_and_si256(c, low4));
            _mm256_store_si256((__m256i *)(codes[k_slot(s)][k] + 32), _mm256_and_si256(_mm256_srli_epi16(c, 4), low4));
        }
    __m256i scv[2][8], mnv[2][4];
    q4k_group_scales(blk, scv, mnv);
    for (int h = 0; h < 2; h++) {
        for (int s = 0; s < 8; s++) _mm256_store_si256((__m256i *)(sc[k_slot(s)] + 8 * h), scv[h][s]);
        for (int c = 0; c < 4; c++) _mm256_store_si256((__m256i *)(mn[c] + 8 * h), mnv[h][c]);
    }
}

/* Q4_K rows in groups of 16 with a batch's tokens side by side: the arithmetic of rows16_q4k
 * (the same integer sums, converted and scaled in the same float operations, so a product
 * does not depend on the kernel that made it), arranged the other way round. A block's codes
 * are unpacked once into bytes for all of the block's tokens; a row's 4 codes are broadcast
 * and meet a vector of 8 tokens' 4 activations (QuantX.qt) in one `vpmaddubsw`, so that
 * nothing but products and their 16-bit sums runs in the inner loop (rows16_q4k splits
 * nibbles and broadcasts activations there, 3 tokens a pass). `nv` vectors of 8 tokens.
 * Each block's work runs in three stretches of one kind: the 16 rows' products (the
 * assembly loops back to back), the next block's unpacking, this block's mins and
 * conversion to float; unpacked before its products and converted after each row, the
 * block ran each row's chain in turn (loop_q4k_whole 457 -> 473 GOP/s). */
static inline __attribute__((always_inline)) void rows16_q4k_wide(const uint8_t *group, int nt,
                                                                  const QuantX *x, float *out) {
    const int nv = 4;
    const int cols = x->cols, blocks = cols / QK_BLOCK;
    const long size = GROUP_ROWS * 144;
    uint8_t codes[8][8][64] __attribute__((aligned(32))); /* [sub-block][k][row]: 4 codes a row */
    int32_t sc[8][GROUP_ROWS] __attribute__((aligned(32))), mn[2][4][GROUP_ROWS] __attribute__((aligned(32)));
    __m256i isum[GROUP_ROWS][4] __attribute__((aligned(32)));
    __m256 acc[GROUP_ROWS][4];
    for (int r = 0; r < GROUP_ROWS; r++)
        for (int v = 0; v < nv; v++) acc[r][v] = _mm256_setzero_ps();
    prefetch_group_block(group, size);
    q4k_group_unpack(group, codes, sc, mn[0]);
    for (int b = 0; b < blocks; b++) {
        const uint8_t *blk = group + b * size;
        const int8_t *act = x->qt + (long)b * QK_BLOCK * TOKEN_BLOCK;
        for (int r = 0; r < GROUP_ROWS; r++) wide_row_block(act, codes[0][0] + 4 * r, sc[0] + r, isum[r]);
        if (b + 1 < blocks) {
            prefetch_group_block(blk + size, size);
            q4k_group_unpack(blk + size, codes, sc, mn[(b + 1) & 1]);
        }
        for (int r = 0; r < GROUP_ROWS; r++) {
            const __m256 d = _mm256_set1_ps(half(blk + 2 * r));
            const __m256 dmin = _mm256_set1_ps(half(blk + 32 + 2 * r));
            for (int v = 0; v < nv; v++) {
                const __m256 dx = _mm256_load_ps(x->dt + (long)b * TOKEN_BLOCK + 8 * v);
                __m256i msum = _mm256_setzero_si256();
                for (int c = 0; c < 4; c++) {
                    const __m256i pair = _mm256_load_si256((const __m256i *)(x->mt + ((long)b * 4 + c) * TOKEN_BLOCK + 8 * v));
                    msum = _mm256_add_epi32(msum, _mm256_madd_epi16(_mm256_set1_epi32(mn[b & 1][c][r]), pair));
                }
                acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][v]), _mm256_mul_ps(d, dx), acc[r][v]);
                acc[r][v] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), acc[r][v]);
            }
        }
    }
    store_token_rows(acc, nv, out);
}

/* Tokens from which a block takes rows16_q4k_wide (fewer: rows16_q4k, faster where the wide
 * form's 32 lanes are not nearly full) and rows_q6k_wide. */
#define WIDE_Q4K_TOKENS 30
#define WIDE_Q6K_TOKENS 12

/* The inner loop of rows_q6k_wide: a whole 256-value block of one row with 16 or 32 tokens
 * (`nv` vectors of 8). Sub-block slot s (k_slot order, as the activations) has the row's
 * codes u (0..63) at w + 32 s (4 for each step k), its two 16s' scales as 16-bit pairs at
 * sc[2 s] and sc[2 s + 1], the tokens' activations (QuantX.qt, signed: the side of
 * `vpmaddubsw` that may come from memory) at a + 1024 s + 128 k and their offsets' sums
 * (QuantX.ct) at c + 64 s + 32 h. The 16-bit sums of a 16 start from its offset sum
 * -32 sum x and add its 4 steps' products u x: 8 values' (u - 32) x each, at most
 * 32 127 8 = 32512, so the wrapping 16-bit adds end exact whatever they pass through (the
 * pair sums themselves, at most 63 127 2, do not saturate; activations are within +-127).
 * Then vpmaddwd by the 16's scale, vpaddd into isum[0 .. nv - 1], which stay in registers
 * for the block. Against (x + 128)(u - 32), which reaches 16320 a pair and took a vpmaddwd
 * every 2 steps: 40 multiplies a 32-value sub-block instead of 48 (the inner loop alone,
 * 32 tokens in L1, alternated: 363 -> 429 GOP/s on 2 Zen 3 threads). One row at a time, as Q4_K's
 * wide_row_block. */
static inline __attribute__((always_inline)) void q6k_row_block(const int8_t *a, const uint8_t *w,
                                                                const int32_t *sc, const int32_t *c,
                                                                int nv, __m256i *isum) {
/* a 16's 16-bit sums start from its offsets' (at C) */
#define Q6_START4(C)                                                                          \
    "vmovdqa " C "(%[c]), %%ymm0\n\t"                                                          \
    "vmovdqa " C "+32(%[c]), %%ymm1\n\t"                                                       \
    "vmovdqa " C "+64(%[c]), %%ymm2\n\t"                                                       \
    "vmovdqa " C "+96(%[c]), %%ymm3\n\t"
#define Q6_START2(C)                                                                          \
    "vmovdqa " C "(%[c]), %%ymm0\n\t"                                                          \
    "vmovdqa " C "+32(%[c]), %%ymm1\n\t"
/* 4 codes of the row (at W) against nv vectors of activations (at A), added to the sums */
#define Q6_STEP4(W, A) WIDE_STEP(W, A)
#define Q6_STEP2(W, A)                                                                        \
    "vpbroadcastd " W "(%[w]), %%ymm12\n\t"                                                   \
    "vpmaddubsw " A "(%[a]), %%ymm12, %%ymm13\n\t"                                            \
    "vpaddw %%ymm13, %%ymm0, %%ymm0\n\t"                                                      \
    "vpmaddubsw " A "+32(%[a]), %%ymm12, %%ymm14\n\t"                                         \
    "vpaddw %%ymm14, %%ymm1, %%ymm1\n\t"
#define Q6_SCALE4(S)                                                                          \
    "vpbroadcastd " S "(%[sc]), %%ymm12\n\t"                                                   \
    "vpmaddwd %%ymm12, %%ymm0, %%ymm0\n\t"                                                     \
    "vpaddd %%ymm0, %%ymm8, %%ymm8\n\t"                                                        \
    "vpmaddwd %%ymm12, %%ymm1, %%ymm1\n\t"                                                     \
    "vpaddd %%ymm1, %%ymm9, %%ymm9\n\t"                                                        \
    "vpmaddwd %%ymm12, %%ymm2, %%ymm2\n\t"                                                     \
    "vpaddd %%ymm2, %%ymm10, %%ymm10\n\t"                                                      \
    "vpmaddwd %%ymm12, %%ymm3, %%ymm3\n\t"                                                     \
    "vpaddd %%ymm3, %%ymm11, %%ymm11\n\t"
#define Q6_SCALE2(S)                                                                          \
    "vpbroadcastd " S "(%[sc]), %%ymm12\n\t"                                                   \
    "vpmaddwd %%ymm12, %%ymm0, %%ymm0\n\t"                                                     \
    "vpaddd %%ymm0, %%ymm8, %%ymm8\n\t"                                                        \
    "vpmaddwd %%ymm12, %%ymm1, %%ymm1\n\t"                                                     \
    "vpaddd %%ymm1, %%ymm9, %%ymm9\n\t"
/* a sub-block: its two 16s, 4 steps each */
#define Q6_SUB_BLOCK(N)                                                                       \
    Q6_START##N("0") Q6_STEP##N("0", "0") Q6_STEP##N("4", "128") Q6_STEP##N("8", "256")        \
    Q6_STEP##N("12", "384") Q6_SCALE##N("0")                                                   \
    Q6_START##N("128") Q6_STEP##N("16", "512") Q6_STEP##N("20", "640")                         \
    Q6_STEP##N("24", "768") Q6_STEP##N("28", "896") Q6_SCALE##N("4")
#define Q6_LOOP(N, BODY)                                                                      \
    __asm__ volatile(                                                                         \
        "vpxor %%xmm8, %%xmm8, %%xmm8\n\t"                                                    \
        "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"                                                    \
        "vpxor %%xmm10, %%xmm10, %%xmm10\n\t"                                                 \
        "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"                                                 \
        "1:\n\t" BODY                                                                         \
        "add $32, %[w]\n\t"                                                                   \
        "add $1024, %[a]\n\t"                                                                 \
        "add $256, %[c]\n\t"                                                                  \
        "add $8, %[sc]\n\t"                                                                   \
        "dec %[j]\n\t"                                                                        \
        "jnz 1b\n\t"                                                                          \
        "vmovdqa %%ymm8, (%[p])\n\t"                                                          \
        "vmovdqa %%ymm9, 32(%[p])\n\t"                                                        \
        "vmovdqa %%ymm10, 64(%[p])\n\t"                                                       \
        "vmovdqa %%ymm11, 96(%[p])\n\t"                                                       \
        : [a] "+r"(a), [w] "+r"(w), [sc] "+r"(sc), [c] "+r"(c), [j] "+r"(j)                   \
        : [p] "r"(isum)                                                                       \
        : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm8", "xmm9", "xmm10", "xmm11",   \
          "xmm12", "xmm13", "xmm14", "xmm15")
    long j = 8;
    if (nv == 4) Q6_LOOP(4, Q6_SUB_BLOCK(4));
    else Q6_LOOP(2, Q6_SUB_BLOCK(2));
#undef Q6_START4
#undef Q6_START2
#undef Q6_STEP4
#undef Q6_STEP2
#undef Q6_SCALE4
#undef Q6_SCALE2
#undef Q6_SUB_BLOCK
#undef Q6_LOOP
}

/* Block b of Q6_K rows for rows_q6k_wide: per row its codes u (sub-blocks in k_slot
 * order), its scales as 16-bit pairs (the same order) and d. */
typedef struct {
    uint8_t w[GROUP_ROWS][8][32] __attribute__((aligned(32)));
    int32_t sc[GROUP_ROWS][16] __attribute__((aligned(32)));
    float d[GROUP_ROWS];
} Q6Rows;

static inline __attribute__((always_inline)) void q6k_rows_unpack(const uint8_t *const *rows, int count,
                                                                  int b, Q6Rows *q) {
    for (int r = 0; r < count; r++) {
        const uint8_t *blk = rows[r] + 210L * b;
        for (int s = 0; s < 4; s++) prefetch_rows(GGML_Q6_K, rows[r], NULL, 256L * b + 64 * s);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
        q->d[r] = half(blk + 208);
        __m256i u[8];
        q6k_codes(blk, u);
        for (int j = 0; j < 8; j++) _mm256_store_si256((__m256i *)q->w[r][k_slot(j)], u[j]);
        { /* the scales of groups 2 j, 2 j + 1 of sub-block j at 2 k_slot(j), + 1 */
            const __m256i lo = _mm256_unpacklo_epi16(sc16, sc16); /* 0-3, 8-11 as pairs */
            const __m256i hi = _mm256_unpackhi_epi16(sc16, sc16); /* 4-7, 12-15 */
            const __m256i a = _mm256_unpacklo_epi64(lo, hi), c = _mm256_unpackhi_epi64(lo, hi);
            _mm256_store_si256((__m256i *)q->sc[r], _mm256_permute2x128_si256(a, c, 0x20));
            _mm256_store_si256((__m256i *)(q->sc[r] + 8), _mm256_permute2x128_si256(a, c, 0x31));
        }
    }
}

/* Q6_K rows with a batch's tokens side by side (QuantX.qt and ct): the same integer sum
 * per (row, token, block) as rows_dots_k_typed's one-token form, in another order. Up to
 * 16 rows (`rows`, `count` of them; out[t * GROUP_ROWS + r]) take each block in turn, so
 * that the block's activations (8 KiB for 32 tokens) are read from L1 by every row: row by
 * row through all blocks they came from L2 each time, at about the rate of the products.
 * Each block's codes are unpacked once for all of its tokens; the offset 32 enters through
 * the tokens' sums (q6k_row_block). As rows16_q4k_wide, a block's rows' products run back
 * to back, then the next block's unpacking (q6k_rows_unpack), then this block's conversion
 * to float (each row unpacked, multiplied and converted in turn: loop_q6k_whole 342 -> 354
 * GOP/s). Up to 16 tokens take 2 vectors of 8, more 4. */
static void rows_q6k_wide(const uint8_t *const *rows, int count, int nt, const QuantX *x,
                          float *out) {
    const int cols = x->cols, blocks = cols / QK_BLOCK, nv = nt > 16 ? 4 : 2;
    Q6Rows q[2];
    __m256i isum[GROUP_ROWS][4] __attribute__((aligned(32)));
    __m256 acc[GROUP_ROWS][4];
    for (int r = 0; r < count; r++)
        for (int v = 0; v < 4; v++) acc[r][v] = _mm256_setzero_ps();
    q6k_rows_unpack(rows, count, 0, &q[0]);
    for (int b = 0; b < blocks; b++) {
        const int8_t *act = x->qt + (long)b * QK_BLOCK * TOKEN_BLOCK;
        const int32_t *offsets = x->ct + (long)b * 16 * TOKEN_BLOCK;
        const Q6Rows *cur = &q[b & 1];
        for (int r = 0; r < count; r++) q6k_row_block(act, cur->w[r][0], cur->sc[r], offsets, nv, isum[r]);
        if (b + 1 < blocks) q6k_rows_unpack(rows, count, b + 1, &q[(b + 1) & 1]);
        for (int r = 0; r < count; r++) {
            for (int v = 0; v < nv; v++) {
                const __m256 dx = _mm256_load_ps(x->dt + (long)b * TOKEN_BLOCK + 8 * v);
                acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][v]), _mm256_mul_ps(_mm256_set1_ps(cur->d[r]), dx), acc[r][v]);
            }
        }
    }
    if (count == GROUP_ROWS) {
        store_token_rows(acc, nv, out);
        return;
    }
    for (int r = 0; r < count; r++) {
        float lane[32];
        for (int v = 0; v < nv; v++) _mm256_storeu_ps(lane + 8 * v, acc[r][v]);
        for (int t = 0; t < nt; t++) out[t * GROUP_ROWS + r] = lane[t];
    }
}

/* rows16_q4k and rows16_q4 in whole passes of 3 tokens, then the rest (2 or 1) in one. */
#define ROWS16_PASSES(KERNEL)                                                                   \
    do {                                                                                        \
        int t0 = 0;                                                                             \
        for (; t0 + 3 <= nt; t0 += 3) KERNEL(3, group, t0, x, out);                             \
        if (nt - t0 == 2) KERNEL(2, group, t0, x, out);                                         \
        else if (nt - t0 == 1) KERNEL(1, group, t0, x, out);                                    \
    } while (0)
#define ROWS16_Q4_0(...) rows16_q4(GGML_Q4_0, __VA_ARGS__)
#define ROWS16_Q4_1(...) rows16_q4(GGML_Q4_1, __VA_ARGS__)

/* 3 tokens a pass over a group's 4-bit codes (2 x 3 sums and 3 broadcasts in registers: Q4_K
 * 195 GOP/s a Zen 3 core in L1; 4 spill, 153), Q8_0 4 for batches (fewer unpacks a
 * product), 2 for one to three tokens (a decode step from memory ran 20% slower with the
 * registers of 4). */
static void rows16_dots256(int type, const uint8_t *group, int nt, const QuantX *x, float *out) {
    if (type == GGML_Q4_K && x->mt) {
        rows16_q4k_wide(group, nt, x, out);
    } else if (type == GGML_Q4_K) ROWS16_PASSES(rows16_q4k);
    else if (type == GGML_Q4_0) ROWS16_PASSES(ROWS16_Q4_0);
    else if (type == GGML_Q4_1) ROWS16_PASSES(ROWS16_Q4_1);
    else if (nt >= 4) rows16_q8_0(4, group, nt, x, out);
    else rows16_q8_0(2, group, nt, x, out);
}

/* Each type's loop compiled on its own (the type a constant in it). */
#define FOR_EACH_QUANT_TYPE(CALL)                                                          \
    switch (type) {                                                                        \
    case GGML_Q8_0: CALL(q, GGML_Q8_0); break;                                             \
    case GGML_Q4_0: CALL(q, GGML_Q4_0); break;                                             \
    case GGML_Q4_1: CALL(q, GGML_Q4_1); break;                                             \
    case GGML_Q5_0: CALL(q, GGML_Q5_0); break;                                             \
    case GGML_Q5_1: CALL(q, GGML_Q5_1); break;                                             \
    case GGML_Q4_K: CALL(k, GGML_Q4_K); break;                                             \
    case GGML_Q5_K: CALL(k, GGML_Q5_K); break;                                             \
    case GGML_Q6_K: CALL(k, GGML_Q6_K); break;                                             \
    }

/* One token (decode) and one or two rows compiled apart: their sums stay in registers. */
#define DOTS_SHAPES(F, T)                                                                 \
    row1 ? (nt == 1 ? F(T, 2, row0, row1, 1, x, out0, out1)                              \
                    : F(T, 2, row0, row1, nt, x, out0, out1))                            \
         : (nt == 1 ? F(T, 1, row0, NULL, 1, x, out0, NULL)                              \
                    : F(T, 1, row0, NULL, nt, x, out0, NULL))

/* The 256-bit products' instruction forms (see dot_u8). */
#define rows_dots_q_v0(...) rows_dots_q_typed(__VA_ARGS__, 0)
#define rows_dots_k_v0(...) rows_dots_k_typed(__VA_ARGS__, 0)
#define rows_dots_q_v1(...) rows_dots_q_typed(__VA_ARGS__, 1)
#define rows_dots_k_v1(...) rows_dots_k_typed(__VA_ARGS__, 1)
#define rows_dots_q_v2(...) rows_dots_q_typed(__VA_ARGS__, 2)
#define rows_dots_k_v2(...) rows_dots_k_typed(__VA_ARGS__, 2)

static void rows_dots_avx2(int type, const uint8_t *row0, const uint8_t *row1, int nt,
                           const QuantX *x, float *out0, float *out1) {
#define DOTS_AVX2(KIND, T) DOTS_SHAPES(rows_dots_##KIND##_v0, T)
    FOR_EACH_QUANT_TYPE(DOTS_AVX2)
}

#ifdef HAVE_AVXVNNI
static TARGET_AVXVNNI void rows_dots_vnni_vex(
    int type, const uint8_t *row0, const uint8_t *row1, int nt, const QuantX *x, float *out0,
    float *out1) {
#define DOTS_VEX(KIND, T) DOTS_SHAPES(rows_dots_##KIND##_v1, T)
    FOR_EACH_QUANT_TYPE(DOTS_VEX)
}
#endif

static AVX512 void rows_dots_vnni_evex(int type, const uint8_t *row0, const uint8_t *row1, int nt,
                                       const QuantX *x, float *out0, float *out1) {
#define DOTS_EVEX(KIND, T) DOTS_SHAPES(rows_dots_##KIND##_v2, T)
    FOR_EACH_QUANT_TYPE(DOTS_EVEX)
}

static AVX512 void rows_dots_avx512(int type, const uint8_t *row0, const uint8_t *row1, int nt,
                                    const QuantX *x, float *out0, float *out1) {
#define DOTS_AVX512(KIND, T) DOTS_SHAPES(rows_dots_##KIND##512_typed, T)
    FOR_EACH_QUANT_TYPE(DOTS_AVX512)
}

/* Q6_K rows (count, up to 16: a window's) with one token, into out[r]: q6k_rows_dots1 on
 * pairs of rows 8 apart (rows i and i + 8 of a whole window; the rest in pairs of
 * neighbours). Paired with their neighbours, rows of 1024 columns streamed from memory
 * ~20% slower than rows of 4096 (a Q6_K ffn_down's bytes as rows of 1024 columns: 20
 * GB/s, as its own rows: 24), whether a unit or a window a call. Rows 8 apart took the
 * lm_head [49152, 1024] from 18.6 to 24.3 GB/s on 2 threads (alternated in one process,
 * faster in 11 of 12 rounds; 2 and 4 apart: 19.9 and 23.2) and left the ffn_down's rows
 * of 4096 columns where they were (22.7). */
#define Q6K_ONE_BODY(VNNI)                                                                     \
    int r = 0;                                                                                 \
    for (; r + 16 <= count; r += 16)                                                           \
        for (int i = r; i < r + 8; i++)                                                        \
            q6k_rows_dots1(2, rows[i], rows[i + 8], x, out + i, out + i + 8, VNNI);            \
    for (; r < count; r += 2)                                                                  \
        if (r + 1 < count)                                                                     \
            q6k_rows_dots1(2, rows[r], rows[r + 1], x, out + r, out + r + 1, VNNI);            \
        else                                                                                   \
            q6k_rows_dots1(1, rows[r], NULL, x, out + r, NULL, VNNI);
static void rows_q6k_one_avx2(const uint8_t *const *rows, int count, const QuantX *x, float *out) {
    Q6K_ONE_BODY(0)
}
#ifdef HAVE_AVXVNNI
static TARGET_AVXVNNI void rows_q6k_one_vex(const uint8_t *const *rows, int count, const QuantX *x,
                                            float *out) {
    Q6K_ONE_BODY(1)
}
#endif
static AVX512 void rows_q6k_one_evex(const uint8_t *const *rows, int count, const QuantX *x,
                                     float *out) {
    Q6K_ONE_BODY(2)
}
#undef Q6K_ONE_BODY

/* 1: the AVX2 products, 2: AVX512-VNNI's, 3: the 256-bit ones with VNNI (AVX-VNNI, or
 * AVX512-VNNI's 256-bit form where the CPU has that instead: the same code). */
static int quant_isa = 0, vnni_form = 0;

static int has_avx512_vnni(void) {
    return CPU_SUPPORTS("avx512vnni") && CPU_SUPPORTS("avx512bw") &&
           CPU_SUPPORTS("avx512vl") && CPU_SUPPORTS("avx512dq");
}

/* The form of the 256-bit VNNI products this CPU runs (1 VEX, 2 EVEX), or 0. */
static int detect_vnni_form(void) {
#ifdef HAVE_AVXVNNI
    if (CPU_SUPPORTS("avxvnni")) return 1;
#endif
    return CPU_SUPPORTS("avx512vnni") && CPU_SUPPORTS("avx512vl") ? 2 : 0;
}

static int detect_quant_isa(void) {
    __builtin_cpu_init();
    vnni_form = detect_vnni_form();
    return has_avx512_vnni() ? 2 : vnni_form ? 3 : 1;
}

/* Exported: choose the products' instruction set (0: the best this CPU has, 1: AVX2,
 * 2: AVX512-VNNI, 3: 256-bit VNNI, where the CPU has it; -1: keep the one in use);
 * returns the one in use. */
int infire_quant_isa(int wanted) {
    if (wanted < 0 && quant_isa) return quant_isa;
    int best = detect_quant_isa();
    int can = wanted == 1 || (wanted == 2 && has_avx512_vnni()) || (wanted == 3 && vnni_form);
    quant_isa = can ? wanted : best;
    return quant_isa;
}

static inline void rows_dots(int type, const uint8_t *row0, const uint8_t *row1, int nt,
                             const QuantX *x, float *out0, float *out1) {
    if (!quant_isa) quant_isa = detect_quant_isa();
    if (quant_isa == 2)
        rows_dots_avx512(type, row0, row1, nt, x, out0, out1);
#ifdef HAVE_AVXVNNI
    else if (quant_isa == 3 && vnni_form == 1)
        rows_dots_vnni_vex(type, row0, row1, nt, x, out0, out1);
#endif
    else if (quant_isa == 3)
        rows_dots_vnni_evex(type, row0, row1, nt, x, out0, out1);
    else
        rows_dots_avx2(type, row0, row1, nt, x, out0, out1);
}

/* rows_q6k_one in the 256-bit form in use (not with AVX512-VNNI's products: see
 * quant_units). */
static inline void rows_q6k_one(const uint8_t *const *rows, int count, const QuantX *x,
                                float *out) {
#ifdef HAVE_AVXVNNI
    if (quant_isa == 3 && vnni_form == 1) {
        rows_q6k_one_vex(rows, count, x, out);
        return;
    }
#endif
    if (quant_isa == 3)
        rows_q6k_one_evex(rows, count, x, out);
    else
        rows_q6k_one_avx2(rows, count, x, out);
}

/* The same in fp32, for a row decoded to fp32 (F32, F16 and BF16 parts). */
static inline float row_dot_f32(const float *w, const float *x, int cols) {
    __m256 acc = _mm256_setzero_ps();
    for (int k = 0; k < cols; k += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), acc);
    return hsum(acc);
}

static inline int is_float_type(int type) {
    return type == GGML_F32 || type == GGML_F16 || type == GGML_BF16;
}

/* A part's units of work: its groups of 16 where its rows are interleaved, else pairs of
 * rows (the last may be one). */
static inline int unit_rows(const QuantPart *p) { return p->interleaved ? GROUP_ROWS : 2; }
static inline int part_units(const QuantPart *p) { return (p->rows + unit_rows(p) - 1) / unit_rows(p); }

/* The first unit (counted over the parts in order) at or after `share` bytes of a weight. */
static int unit_at_bytes(const QuantWeight *w, long share) {
    long before = 0;
    int units = 0;
    for (int p = 0; p < w->num_parts; p++) {
        const QuantPart *part = &w->parts[p];
        const long bytes = (long)part->rows * part->row_bytes, unit = unit_rows(part) * part->row_bytes;
        if (before + bytes > share) {
            const long at = (share - before + unit - 1) / unit;
            return units + (at < part_units(part) ? (int)at : part_units(part));
        }
        before += bytes;
        units += part_units(part);
    }
    return units;
}

/* y[t0 + t, row + i] (+)= out[t * 16 + i] (+ bias[row + i]) for nt tokens and a group's
 * 16 rows, a token's 16 in two vectors. */
static inline void store_group(float *y, int ldy, int accumulate, const float *bias, int row,
                               int t0, int nt, const float *out) {
    for (int t = 0; t < nt; t++) {
        float *yt = y + (long)(t0 + t) * ldy + row;
        for (int h = 0; h < GROUP_ROWS; h += 8) {
            __m256 v = _mm256_loadu_ps(out + t * GROUP_ROWS + h);
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + row + h));
            if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(yt + h), v);
            _mm256_storeu_ps(yt + h, v);
        }
    }
}

/* The rows of a window of 16 (rows row .. row + 15 of y) that `filled` marks, from out[t * 16
 * + i], a token's 16 rows in two vectors (row by row, the outputs of 32 tokens lie 4 KiB
 * multiples apart, one L1 set): a whole window as store_group does, a part of one (a
 * thread's run starts or ends inside it, a part's rows end) through masked loads and stores,
 * which touch only its rows (the others may be another thread's). Scalar stores row by row
 * took ~6% of an lm_head's time at batch 32, its threads' runs cutting windows. */
static inline void flush_window(float *y, int ldy, int accumulate, const float *bias, int row,
                                unsigned filled, int t0, int nt, const float *out) {
    if (filled == 0xFFFFu) {
        store_group(y, ldy, accumulate, bias, row, t0, nt, out);
        return;
    }
    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    for (int h = 0; h < GROUP_ROWS; h += 8) {
        if (!(filled >> h & 0xFFu)) continue;
        const __m256i mask = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)(filled >> h)), bit), bit);
        const __m256 add = bias ? _mm256_maskload_ps(bias + row + h, mask) : _mm256_setzero_ps();
        for (int t = 0; t < nt; t++) {
            float *yt = y + (long)(t0 + t) * ldy + row + h;
            __m256 v = _mm256_loadu_ps(out + t * GROUP_ROWS + h);
            if (bias) v = _mm256_add_ps(v, add);
            if (accumulate) v = _mm256_add_ps(_mm256_maskload_ps(yt, mask), v);
            _mm256_maskstore_ps(yt, mask, v);
        }
    }
}

/* QuantX.qt and dt, mt (where mt is not NULL) and ct (where ct is not NULL) from nt tokens'
 * per-256 activations (qk, dk, bsum); the lanes of tokens nt .. TOKEN_BLOCK - 1 hold zero
 * codes. */
static void tokens_side_by_side(const int8_t *qk, const float *dk, const int16_t *bsum, int nt,
                                int cols, int8_t *qt, int32_t *mt, int32_t *ct, float *dt) {
    const int blocks = cols / QK_BLOCK, whole = nt / 8 * 8;
    /* 8 tokens' 8 x 4 codes at a time, an 8 x 8 transpose of 32-bit lanes */
    for (int t = 0; t < whole; t += 8)
        for (int c = 0; c < cols / 4; c += 8) {
            __m256i r[8], u[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_si256((const __m256i *)(qk + (long)(t + i) * cols + 4 * c));
            for (int i = 0; i < 8; i += 2) {
                u[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
                u[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
            }
            for (int i = 0; i < 8; i += 4) {
                r[i] = _mm256_unpacklo_epi64(u[i], u[i + 2]);
                r[i + 1] = _mm256_unpackhi_epi64(u[i], u[i + 2]);
                r[i + 2] = _mm256_unpacklo_epi64(u[i + 1], u[i + 3]);
                r[i + 3] = _mm256_unpackhi_epi64(u[i + 1], u[i + 3]);
            }
            for (int j = 0; j < 8; j++) {
                const long at = ((long)(c + j) * TOKEN_BLOCK + t) * 4;
                const __m256i v = _mm256_permute2x128_si256(r[j % 4], r[j % 4 + 4], j < 4 ? 0x20 : 0x31);
                _mm256_store_si256((__m256i *)(qt + at), v);
            }
        }
    for (int c = 0; c < cols / 4; c++)
        for (int t = whole; t < TOKEN_BLOCK; t++) {
            uint32_t v = 0;
            if (t < nt) memcpy(&v, qk + (long)t * cols + 4 * c, 4);
            memcpy(qt + ((long)c * TOKEN_BLOCK + t) * 4, &v, 4);
        }
    for (int b = 0; b < blocks; b++) {
        for (int t = 0; t < TOKEN_BLOCK; t++) {
            const int16_t *bs = bsum + ((long)t * blocks + b) * 16;
            dt[b * TOKEN_BLOCK + t] = t < nt ? dk[(long)t * blocks + b] : 0.0f;
            for (int c = 0; mt && c < 4; c++) /* the mins' sums: Q4_K's alone */
                mt[(b * 4 + c) * TOKEN_BLOCK + t] =
                    t < nt ? (int32_t)((uint32_t)(uint16_t)(bs[4 * c] + bs[4 * c + 1]) |
                                       (uint32_t)(uint16_t)(bs[4 * c + 2] + bs[4 * c + 3]) << 16)
                           : 0;
        }
    }
    if (!ct) return;
    /* Q6_K's offsets: per 16 of a sub-block slot, its 4 steps' pair sums (vpmaddubsw by
     * ones: 16-bit halves as q6k_row_block's products fill them) times -32 */
    const __m256i ones = _mm256_set1_epi8(1);
    for (int g = 0; g < blocks * 16; g++) /* g = (b * 8 + s) * 2 + h */
        for (int v = 0; v < TOKEN_BLOCK / 8; v++) {
            __m256i sum = _mm256_setzero_si256();
            for (int k = 0; k < 4; k++)
                sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(ones, _mm256_load_si256((const __m256i *)(qt + ((long)(4 * g + k) * TOKEN_BLOCK + 8 * v) * 4))));
            _mm256_store_si256((__m256i *)(ct + (long)g * TOKEN_BLOCK + 8 * v), _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sum, 5)));
        }
}

/* A team's shares of the units of a linear (groups of 16 interleaved rows, pairs of
 * others), one slot a thread, shared by the threads of a parallel region (the caller's,
 * declared before it, zeroed). A slot's word holds the token block's number (16 bits) and
 * the thread's share still to run, [front, back) (24 bits each): its thread takes runs
 * from the front, a thread done with its own takes half of what is left from the back.
 * The products are the same whichever thread runs a unit; taking moves work from a thread
 * the machine slows for a while to the others, which would otherwise wait for it at the
 * barrier (static shares on this 2-core VM: the threads' waits at the linears' barriers
 * were ~8% of a batch-32 decode step in busy hours). */
#define MAX_TEAM 64
typedef struct {
    uint64_t word; /* read and written with __atomic builtins */
    uint32_t blocks; /* token blocks this thread has run through quant_linear_impl */
    char pad[52];
} __attribute__((aligned(64))) TeamSlot;
typedef struct {
    TeamSlot slot[MAX_TEAM];
} Team;

static inline uint64_t share_word(unsigned gen, unsigned front, unsigned back) {
    return (uint64_t)(gen & 0xFFFFu) << 48 | (uint64_t)front << 24 | back;
}

/* Units [*u0, *u1) taken from the slot's share of token block `gen`: up to `want` from its
 * front (by its own thread), or (want 0) half of those left, rounded down, from its back;
 * 0 where none is left or the slot is on another block. */
static inline int take_units(TeamSlot *slot, unsigned gen, int want, int *u0, int *u1) {
    uint64_t w = __atomic_load_n(&slot->word, __ATOMIC_RELAXED);
    for (;;) {
        const int front = (int)(w >> 24 & 0xFFFFFF), back = (int)(w & 0xFFFFFF);
        if ((unsigned)(w >> 48) != (gen & 0xFFFFu) || front >= back) return 0;
        const int take = want ? (back - front < want ? back - front : want) : (back - front) / 2;
        if (take <= 0) return 0;
        const uint64_t next = want ? share_word(gen, front + take, back) : share_word(gen, front, back - take);
        if (__atomic_compare_exchange_n(&slot->word, &w, next, 1, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            *u0 = want ? front : back - take;
            *u1 = want ? front + take : back;
            return 1;
        }
    }
}

/* The products of units [begin, end) of a QuantWeight (counted over its parts in
 * order) for tokens t0 .. t0 + nt - 1, stored into y. */
static void quant_units(const QuantWeight *w, const float *bias, const float *x, int cols,
                        float *y, int ldy, int accumulate, const QuantX *qx, int t0, int nt,
                        int begin, int end, float *row_f32, float *out, float *stage) {
    int base = 0, first_row = 0, window = -GROUP_ROWS;
    unsigned filled = 0;
    for (int p = 0; p < w->num_parts; p++) {
        const QuantPart *part = &w->parts[p];
        const int lo = begin - base > 0 ? begin - base : 0;
        const int hi = end - base < part_units(part) ? end - base : part_units(part);
        for (int u = lo, units = 1; u < hi; u += units) {
            const int r0 = u * unit_rows(part);
            if (part->interleaved) {
                const uint8_t *group = part->data + (long)r0 * part->row_bytes;
                if (quant_isa == 2 && !is_k_quant(part->type))
                    rows16_dots512(part->type, group, nt, qx, out);
                else
                    rows16_dots256(part->type, group, nt, qx, out);
                store_group(y, ldy, accumulate, bias, first_row + r0, t0, nt, out);
                continue;
            }
            /* other rows into their window of 16, stored a whole window at a time */
            const int at = r0 % GROUP_ROWS;
            if (r0 - at != window) {
                flush_window(y, ldy, accumulate, bias, first_row + window, filled, t0, nt, stage);
                window = r0 - at;
                filled = 0;
            }
            /* Q6_K with the tokens side by side or one token (not with AVX512-VNNI's
             * products): up to 8 units (16 rows, the rest of the window) a pass, sharing
             * each block's activations in L1, its outputs straight into the window; other
             * rows a unit (2) at a time */
            if (part->type == GGML_Q6_K && (qx->ct || (nt == 1 && quant_isa != 2))) {
                const int room = (GROUP_ROWS - at) / 2;
                units = hi - u < room ? hi - u : room;
                const int count = (part->rows < (u + units) * 2 ? part->rows : (u + units) * 2) - r0;
                const uint8_t *rows[GROUP_ROWS];
                for (int k = 0; k < count; k++) rows[k] = quant_row(part, r0 + k);
                if (qx->ct)
                    rows_q6k_wide(rows, count, nt, qx, stage + at);
                else
                    rows_q6k_one(rows, count, qx, stage + at);
                filled |= ((1u << count) - 1) << at;
                continue;
            }
            const int two = r0 + 1 < part->rows; /* the unit's second row */
            if (is_float_type(part->type)) {
                for (int k = 0; k <= two; k++) {
                    dequant_row(part->type, quant_row(part, r0 + k), cols, row_f32);
                    for (int t = 0; t < nt; t++)
                        out[k * TOKEN_BLOCK + t] = row_dot_f32(row_f32, x + (long)(t0 + t) * cols, cols);
                }
            } else
                rows_dots(part->type, quant_row(part, r0), two ? quant_row(part, r0 + 1) : NULL, nt,
                          qx, out, out + TOKEN_BLOCK);
            for (int k = 0; k <= two; k++)
                for (int t = 0; t < nt; t++) stage[t * GROUP_ROWS + at + k] = out[k * TOKEN_BLOCK + t];
            filled |= (two ? 3u : 1u) << at;
        }
        flush_window(y, ldy, accumulate, bias, first_row + window, filled, t0, nt, stage);
        window = -GROUP_ROWS;
        filled = 0;
        base += part_units(part);
        first_row += part->rows;
    }
}

/* y[t, :rows] (+)= W x[t] (+ bias) for a QuantWeight, inside a parallel region: per block
 * of tokens each thread quantizes their activations (cheap next to the product: per 32
 * values where a legacy part needs them, per 256 where a K-quant part does), then takes
 * its share of the units (groups of 16 interleaved rows, pairs of others), each unpacked
 * once for the block's tokens. The shares are equal in bytes, not rows: a q|k|v whose v
 * is Q6_K has heavier rows at its end. Each thread runs its share from the front in runs
 * of ~32 KiB, then (with a `team`) takes half of what another thread has left from its
 * back, until none is left. */
static void quant_linear_impl(const QuantWeight *w, const float *bias, const float *x, int n,
                              int cols, float *y, int ldy, int accumulate, Team *team,
                              const int *cuts, int num_cuts) {
    if (!quant_isa) quant_isa = detect_quant_isa();
    int legacy = 0, k_quant = 0;
    for (int p = 0; p < w->num_parts; p++) {
        k_quant |= is_k_quant(w->parts[p].type);
        legacy |= !is_k_quant(w->parts[p].type) && !is_float_type(w->parts[p].type);
    }
    const int qs = legacy ? q_stride(cols) : 0, xs = legacy ? x_stride(cols) : 0;
    const int xb = legacy ? cols / QX_BLOCK : 0;
    const int kq = k_quant ? cols : 0, kb = kq / QK_BLOCK;
    int8_t q[TOKEN_BLOCK * qs + 1], qk[TOKEN_BLOCK * kq + 1];
    float scale[TOKEN_BLOCK * xs + 1], xsum[TOKEN_BLOCK * xs + 1], xblock[TOKEN_BLOCK * xb + 1];
    float dk[TOKEN_BLOCK * kb + 1];
    int16_t bsum[TOKEN_BLOCK * 16 * kb + 1];
    /* tokens side by side for the parts that take them: interleaved Q4_K (rows16_q4k_wide),
     * Q6_K (rows_q6k_wide, not where AVX512-VNNI's products serve it) */
    int wide4 = 0, wide6 = 0;
    for (int p = 0; p < w->num_parts; p++) {
        wide4 |= w->parts[p].interleaved && w->parts[p].type == GGML_Q4_K;
        wide6 |= w->parts[p].type == GGML_Q6_K && quant_isa != 2;
    }
    const int kt = wide4 || wide6 ? cols : 0;
    int8_t qt[TOKEN_BLOCK * kt + 32] __attribute__((aligned(32)));
    int32_t mt[TOKEN_BLOCK * 4 * (wide4 ? kt / QK_BLOCK : 0) + 8] __attribute__((aligned(32)));
    int32_t ct[TOKEN_BLOCK * 16 * (wide6 ? kt / QK_BLOCK : 0) + 8] __attribute__((aligned(32)));
    float dt[TOKEN_BLOCK * (kt / QK_BLOCK) + 8] __attribute__((aligned(32)));
    QuantX qx = {q, scale, xsum, xblock, qk, dk, bsum, qt, NULL, NULL, dt, cols};
    float row_f32[cols], out[GROUP_ROWS * TOKEN_BLOCK], stage[GROUP_ROWS * TOKEN_BLOCK];
    long total = 0;
    int units = 0;
    for (int p = 0; p < w->num_parts; p++) {
        total += (long)w->parts[p].rows * w->parts[p].row_bytes;
        units += part_units(&w->parts[p]);
    }
    const int threads = omp_get_num_threads(), me = omp_get_thread_num();
    const int begin = unit_at_bytes(w, total * me / threads);
    const int end = me + 1 == threads ? units : unit_at_bytes(w, total * (me + 1) / threads);
    const long share = total * (me + 1) / threads - total * me / threads;
    for (int t0 = 0; t0 < n; t0 += TOKEN_BLOCK) {
        int t1 = t0 + TOKEN_BLOCK < n ? t0 + TOKEN_BLOCK : n, nt = t1 - t0;
        for (int t = 0; t < nt; t++) {
            const float *xt = x + (long)(t0 + t) * cols;
            if (legacy) quantize_x(xt, cols, q + t * qs, scale + t * xs, xsum + t * xs, xblock + t * xb);
            if (k_quant) quantize_xk(xt, cols, qk + t * kq, dk + t * kb, bsum + t * 16 * kb);
        }
        int32_t *mins = wide4 && nt >= WIDE_Q4K_TOKENS ? mt : NULL;
        int32_t *offsets = wide6 && nt >= WIDE_Q6K_TOKENS ? ct : NULL;
        qx.mt = mins, qx.ct = offsets;
        if (mins || offsets) tokens_side_by_side(qk, dk, bsum, nt, cols, qt, mins, offsets, dt);
        if (cuts) { /* the tests' runs: units [cuts[i - 1], cuts[i]), the last first */
            for (int i = num_cuts - 1; i > 0; i--)
                quant_units(w, bias, x, cols, y, ldy, accumulate, &qx, t0, nt, cuts[i - 1], cuts[i], row_f32, out, stage);
            continue;
        }
        if (!team || threads > MAX_TEAM || units >= 1 << 24) { /* static shares */
            quant_units(w, bias, x, cols, y, ldy, accumulate, &qx, t0, nt, begin, end, row_f32, out, stage);
            continue;
        }
        const unsigned gen = ++team->slot[me].blocks;
        __atomic_store_n(&team->slot[me].word, share_word(gen, begin, end), __ATOMIC_RELEASE);
        const int run = 1 + (int)(32768 * (long)(end - begin) / (share + 1)); /* units in ~32 KiB */
        int u0, u1;
        while (take_units(&team->slot[me], gen, run, &u0, &u1))
            quant_units(w, bias, x, cols, y, ldy, accumulate, &qx, t0, nt, u0, u1, row_f32, out, stage);
        for (int k = 1; k < threads; k++) {
            TeamSlot *other = &team->slot[(me + k) % threads];
            while (take_units(other, gen, 0, &u0, &u1))
                quant_units(w, bias, x, cols, y, ldy, accumulate, &qx, t0, nt, u0, u1, row_f32, out, stage);
        }
    }
#pragma omp barrier
}

/* Exported for the tests: rows [first, first + n) of a QuantWeight as fp32 row-major. */
void infire_dequantize_rows(const QuantWeight *w, int first, int n, int cols, float *out) {
    uint8_t buf[cols / QX_BLOCK * 34 + 1];
    for (int r = 0; r < n; r++) {
        int at = first + r;
        const QuantPart *p = quant_part(w, &at);
        dequant_row(p->type, plain_row(p, at, buf), cols, out + (long)r * cols);
    }
}

/* Exported: the rows `ids[0..n)` of a QuantWeight as fp32 (an embedding's lookups). */
void infire_dequantize_gather(const QuantWeight *w, const int64_t *ids, int n, int cols,
                              float *out) {
    uint8_t buf[cols / QX_BLOCK * 34 + 1];
    for (int r = 0; r < n; r++) {
        int at = (int)ids[r];
        const QuantPart *p = quant_part(w, &at);
        dequant_row(p->type, plain_row(p, at, buf), cols, out + (long)r * cols);
    }
}

enum { WEIGHT_F32, WEIGHT_BF16, WEIGHT_PALETTE };

static inline __attribute__((always_inline)) void linear_impl(
    const void *w, const int kind, const float *bias, const float *x, int n, int cols,
    float *y, int rows, int ldy, int accumulate, uint16_t *scratch) {
    int tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    __m256i hi = _mm256_setzero_si256(), lo = hi;
    if (kind == WEIGHT_PALETTE) palette_tables(w, &hi, &lo);
    for (int t0 = 0; t0 < n; t0 += TOKEN_BLOCK) {
        int t1 = t0 + TOKEN_BLOCK < n ? t0 + TOKEN_BLOCK : n;
#pragma omp for schedule(static)
        for (int tile = 0; tile < tiles; tile++) {
            const void *wt = w;
            long at = tile;
            /* a palette tile is rebuilt in registers for one or two tokens, else once into
               a bf16 scratch tile that all the block's tokens then read */
            int rebuild = kind == WEIGHT_PALETTE && t1 - t0 > 2;
            if (rebuild) {
                palette_tile(w, tile, cols, hi, lo, scratch);
                wt = scratch;
                at = 0;
            }
            const int bf16 = kind == WEIGHT_BF16 || kind == WEIGHT_PALETTE;
            for (int t = t0; t < t1; t += 2) {
                float d0[TILE_ROWS], d1[TILE_ROWS];
                const float *x0 = x + (long)t * cols;
                int two = t + 1 < t1;
                if (kind == WEIGHT_PALETTE && !rebuild) {
                    if (two)
                        palette_dots(w, tile, cols, hi, lo, x0, x0 + cols, 1, d0, d1);
                    else
                        palette_dots(w, tile, cols, hi, lo, x0, x0, 0, d0, d1);
                } else if (two)
                    tile_dots(wt, at, cols, bf16, x0, x0 + cols, 1, d0, d1);
                else
                    tile_dots(wt, at, cols, bf16, x0, x0, 0, d0, d1);
                for (int r = 0; r < TILE_ROWS; r++) {
                    int row = tile * TILE_ROWS + r;
                    if (row >= rows) break;
                    float add = bias ? bias[row] : 0.0f;
                    float *y0 = y + (long)t * ldy + row;
                    *y0 = accumulate ? *y0 + (d0[r] + add) : d0[r] + add;
                    if (two) y0[ldy] = accumulate ? y0[ldy] + (d1[r] + add) : d1[r] + add;
                }
            }
        }
    }
}

/* y[t, :rows] (+)= W x[t] (+ bias) for n tokens; called inside a parallel region. A palette
 * weight's tiles are rebuilt into a scratch tile on each thread's stack, once per token
 * block, and multiplied as bf16 tiles. */
static void linear(const InfireModel *m, Team *team, const void *w, const float *bias,
                   const float *x, int n, int cols, float *y, int rows, int ldy, int accumulate) {
    if (m->weight_palette) {
        uint16_t scratch[TILE_ROWS * cols];
        linear_impl(w, WEIGHT_PALETTE, bias, x, n, cols, y, rows, ldy, accumulate, scratch);
    } else if (m->weight_quant)
        quant_linear_impl(w, bias, x, n, cols, y, ldy, accumulate, team, NULL, 0);
    else if (m->weight_bf16)
        linear_impl(w, WEIGHT_BF16, bias, x, n, cols, y, rows, ldy, accumulate, NULL);
    else
        linear_impl(w, WEIGHT_F32, bias, x, n, cols, y, rows, ldy, accumulate, NULL);
}

/* Exported: y[n, rows] = x[n, cols] W^T (+ bias) for a float32 or bf16 weight in the
 * kernel's tiles (cpu_forward.py tile_weight), on the OpenMP threads. */
void infire_dense_linear(const void *w, int bf16, const float *bias, const float *x, int n,
                         int cols, float *y, int rows) {
#pragma omp parallel
    linear_impl(w, bf16 ? WEIGHT_BF16 : WEIGHT_F32, bias, x, n, cols, y, rows, rows, 0, NULL);
}

/* Exported for the tests and benchmarks: y[n, rows] (+)= x[n, cols] W^T (+ bias) through
 * the kernel's QuantWeight path (the one the forward takes), on the OpenMP threads. */
void infire_quant_linear(const QuantWeight *w, const float *bias, const float *x, int n, int cols,
                         float *y, int rows, int accumulate) {
    Team team;
    memset(&team, 0, sizeof team);
#pragma omp parallel
    quant_linear_impl(w, bias, x, n, cols, y, rows, accumulate, &team, NULL, 0);
}

/* Exported for the tests: the same on one thread, in runs of units [cuts[i - 1], cuts[i])
 * (cuts[0] = 0, the last the weight's units), the last run first, as a thread that takes
 * another's units from their back runs them. */
void infire_quant_linear_runs(const QuantWeight *w, const float *bias, const float *x, int n,
                              int cols, float *y, int rows, int accumulate, const int *cuts,
                              int num_cuts) {
    quant_linear_impl(w, bias, x, n, cols, y, rows, accumulate, NULL, cuts, num_cuts);
}

/* Exported: out[r] = the index of the largest of x[r, :cols] for `rows` rows, the first
 * where several are, a NaN counting as the largest (torch.argmax's answer), on the OpenMP
 * threads: a pass for the maximum, then one for where it is first. */
void infire_argmax_rows(const float *x, int rows, int cols, int64_t *out) {
#pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *v = x + (long)r * cols;
        __m256 top = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
        int i = 0;
        for (; i + 8 <= cols; i += 8) {
            const __m256 a = _mm256_loadu_ps(v + i);
            top = _mm256_max_ps(top, a);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
        }
        float lanes[8], best = -INFINITY;
        _mm256_storeu_ps(lanes, top);
        for (int j = 0; j < 8; j++) best = lanes[j] > best ? lanes[j] : best;
        int has_nan = _mm256_movemask_ps(nan) != 0;
        for (; i < cols; i++) {
            has_nan |= v[i] != v[i];
            best = v[i] > best ? v[i] : best;
        }
        long at = 0;
        if (has_nan)
            while (v[at] == v[at]) at++;
        else {
            const __m256 b = _mm256_set1_ps(best);
            for (at = 0; at + 8 <= cols; at += 8) {
                const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + at), b, _CMP_EQ_OQ));
                if (hit) {
                    at += __builtin_ctz(hit);
                    break;
                }
            }
            if (at + 8 > cols)
                while (v[at] != best) at++;
        }
        out[r] = at;
    }
}

/* out = x / rms(x) * weight over one row of dim floats (out may be x) */
static inline void norm_row(const float *x, const float *weight, float *out, int dim, float eps) {
    __m256 sum = _mm256_setzero_ps();
    for (int i = 0; i < dim; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        sum = _mm256_fmadd_ps(v, v, sum);
    }
    __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(sum) / dim + eps));
    for (int i = 0; i < dim; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i),
                                                _mm256_mul_ps(_mm256_loadu_ps(x + i), inv)));
}

static void rms_norm(const float *x, const float *weight, float *out, int n, int dim, float eps) {
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) norm_row(x + (long)t * dim, weight, out + (long)t * dim, dim, eps);
}

static void embed_tokens(const InfireModel *m, const int64_t *token_ids, int n, float *x) {
    int h = m->hidden;
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        float *xt = x + (long)t * h;
        long row = token_ids[t] * (long)h;
        if (m->weight_palette) { /* row token % 4 of tile token / 4, chunk by chunk */
            const PaletteWeight *w = m->embed;
            __m256i hi, lo;
            palette_tables(w, &hi, &lo);
            long tile = token_ids[t] / TILE_ROWS, first = tile * (h / TILE_COLS);
            const uint8_t *v = w->verbatim + 64L * w->tile_verbatim[tile];
            uint16_t chunk[TILE_COLS * TILE_ROWS];
            for (int k = 0; k < h / TILE_COLS; k++) {
                int flagged = w->flags[first + k];
                palette_chunk(w->chunks + (first + k) * PALETTE_CHUNK, flagged ? v : NULL, hi,
                              lo, chunk);
                v += 64 * flagged;
                __m256 a, b;
                load_chunk(chunk, TILE_COLS * (token_ids[t] % TILE_ROWS), 1, &a, &b);
                _mm256_storeu_ps(xt + k * TILE_COLS, a);
                _mm256_storeu_ps(xt + k * TILE_COLS + 8, b);
            }
        } else if (m->weight_quant) { /* the looked-up row, decoded */
            int at = (int)token_ids[t];
            const QuantPart *p = quant_part(m->embed, &at);
            uint8_t buf[h / QX_BLOCK * 34 + 1];
            dequant_row(p->type, plain_row(p, at, buf), h, xt);
        } else if (m->weight_bf16)
            for (int i = 0; i < h; i++) xt[i] = bf16_to_f32(((const uint16_t *)m->embed)[row + i]);
        else
            for (int i = 0; i < h; i++) xt[i] = ((const float *)m->embed)[row + i];
    }
}

/* Rotate-half RoPE on one head vector, cos/sin rows of length head_dim. */
static inline void rope(float *v, const float *cos, const float *sin, int dim) {
    int half = dim / 2;
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

static inline void *kv_slot(const InfireModel *m, int layer, int which, long slot) {
    long row = (((long)layer * 2 + which) * m->num_blocks * m->block_size + slot);
    long off = row * m->num_kv_heads * m->head_dim;
    return m->kv_bf16 ? (void *)((uint16_t *)m->kv_cache + off)
                      : (void *)((float *)m->kv_cache + off);
}

static inline void store_kv(void *dst, const float *src, int len, int bf16) {
    if (bf16)
        for (int i = 0; i < len; i++) ((uint16_t *)dst)[i] = f32_to_bf16(src[i]);
    else
        for (int i = 0; i < len; i++) ((float *)dst)[i] = src[i];
}

/* Per-head q/k norm (Qwen3) and RoPE on the q and k heads of each token, then its k and v
 * into the pool at its slot. */
static void rope_and_store(const InfireModel *m, int layer, float *qkv, int n, const float *cos,
                           const float *sin, const int64_t *slots) {
    int hd = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    int width = (nh + 2 * nkv) * hd;
    const float *qn = m->q_norm ? m->q_norm[layer] : NULL;
    const float *kn = m->k_norm ? m->k_norm[layer] : NULL;
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        float *row = qkv + (long)t * width;
        if (qn)
            for (int h = 0; h < nh + nkv; h++) norm_row(row + h * hd, h < nh ? qn : kn, row + h * hd, hd, m->eps);
        for (int h = 0; h < nh + nkv; h++) rope(row + h * hd, cos + (long)t * hd, sin + (long)t * hd, hd);
        store_kv(kv_slot(m, layer, 0, slots[t]), row + nh * hd, nkv * hd, m->kv_bf16);
        store_kv(kv_slot(m, layer, 1, slots[t]), row + (nh + nkv) * hd, nkv * hd, m->kv_bf16);
    }
}

static inline float dot(const float *q, const void *k, int dim, const int bf16) {
    __m256 acc = _mm256_setzero_ps();
    for (int i = 0; i < dim; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k, i, bf16), acc);
    return hsum(acc);
}

/* q . k_j for 8 keys stride bytes apart, as one vector (a transpose-and-add of 8 sums). */
static inline __m256 dot8(const float *q, const char *k, long stride, int dim, const int bf16) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (int i = 0; i < dim; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(qv, load8(k + j * stride, i, bf16), a[j]);
    }
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* One query head against its sequence's context in the pool: online softmax, one KV block
 * at a time (scores of a block, one rescale per block, vectorized exp). */
/* `fixed_hd`: head_dim as a constant (64), so the output's accumulators stay in registers
 * (in memory, each position's fused multiply-adds waited on the stores before them), or
 * 0 for any head_dim. The same operations either way. */
/* A query's running softmax over the keys seen so far: the weighted sum of their values,
 * the largest score and the sum of exp(score - max). */
typedef struct {
    __m256 acc[MAX_HEAD_DIM / 8];
    float max, denom;
} Softmax;

static inline __attribute__((always_inline)) void softmax_start(Softmax *s, const int hd) {
    for (int i = 0; i < hd; i += 8) s->acc[i / 8] = _mm256_setzero_ps();
    s->max = -INFINITY, s->denom = 0.0f;
}

/* `count` more keys and values, `stride` bytes apart (`scores`: room for count + 8). */
static inline __attribute__((always_inline)) void attend_span(
    const float *q, const char *keys, const char *values, long stride, int count, const int hd,
    const int bf16, float scale, float *scores, Softmax *s) {
    int j = 0;
    for (; j + 8 <= count; j += 8)
        _mm256_storeu_ps(scores + j, _mm256_mul_ps(dot8(q, keys + j * stride, stride, hd, bf16), _mm256_set1_ps(scale)));
    for (; j < count; j++) scores[j] = dot(q, keys + j * stride, hd, bf16) * scale;
    float block_max = -INFINITY;
    for (j = 0; j < count; j++) block_max = scores[j] > block_max ? scores[j] : block_max;
    if (block_max > s->max) {
        float correction = expf(s->max - block_max);
        s->denom *= correction;
        for (int i = 0; i < hd; i += 8) s->acc[i / 8] = _mm256_mul_ps(s->acc[i / 8], _mm256_set1_ps(correction));
        s->max = block_max;
    }
    for (j = 0; j < count; j += 8)
        _mm256_storeu_ps(scores + j, exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(s->max))));
    for (j = 0; j < count; j++) {
        s->denom += scores[j];
        __m256 p = _mm256_set1_ps(scores[j]);
        const char *v = values + j * stride;
        for (int i = 0; i < hd; i += 8) s->acc[i / 8] = _mm256_fmadd_ps(p, load8(v, i, bf16), s->acc[i / 8]);
    }
}

static inline __attribute__((always_inline)) void softmax_end(const Softmax *s, const int hd, float *out) {
    for (int i = 0; i < hd; i += 8) _mm256_storeu_ps(out + i, _mm256_div_ps(s->acc[i / 8], _mm256_set1_ps(s->denom)));
}

#define DENSE_SPAN 64 /* keys a step of attend_dense */

/* One query over `keys` keys and values in a row, `stride` bytes apart. */
static inline __attribute__((always_inline)) void attend_dense(const float *q, const char *k,
                                                                const char *v, int keys, long stride,
                                                                const int hd, const int bf16,
                                                                float scale, float *out) {
    Softmax s;
    softmax_start(&s, hd);
    float scores[DENSE_SPAN + 8];
    for (int start = 0; start < keys; start += DENSE_SPAN) {
        const int count = keys - start < DENSE_SPAN ? keys - start : DENSE_SPAN;
        attend_span(q, k + start * stride, v + start * stride, stride, count, hd, bf16, scale, scores, &s);
    }
    softmax_end(&s, hd, out);
}

/* Exported: out = softmax(q K^T scale) V for n queries (q and out [n, heads, head_dim]
 * float32), query i over the keys[seq[i]] keys of its sequence seq[i], whose k and v ([heads, keys,
 * head_dim], float32 or bf16, contiguous) are at the addresses k_seqs[seq[i]] and
 * v_seqs[seq[i]] (Whisper's cross-attention: each window's own encoding). On the OpenMP
 * threads; head_dim a multiple of 8, at most MAX_HEAD_DIM. */
void infire_attend_dense(const float *q, const int64_t *k_seqs, const int64_t *v_seqs, int bf16,
                         const int32_t *seq, const int32_t *keys, int n, int heads, int head_dim,
                         float scale, float *out) {
    const long items = (long)n * heads, elem = bf16 ? 2 : 4, stride = head_dim * elem;
#pragma omp parallel for schedule(static)
    for (long item = 0; item < items; item++) {
        const long i = item / heads, count = keys[seq[i]], at = (item % heads) * count * stride;
        const char *kb = (const char *)k_seqs[seq[i]] + at, *vb = (const char *)v_seqs[seq[i]] + at;
        const float *qi = q + item * head_dim;
        float *oi = out + item * head_dim;
        if (bf16 && head_dim == 64)
            attend_dense(qi, kb, vb, count, stride, 64, 1, scale, oi);
        else if (bf16)
            attend_dense(qi, kb, vb, count, stride, head_dim, 1, scale, oi);
        else if (head_dim == 64)
            attend_dense(qi, kb, vb, count, stride, 64, 0, scale, oi);
        else
            attend_dense(qi, kb, vb, count, stride, head_dim, 0, scale, oi);
    }
}

/* One query and head over the first `context` keys of a block table. */
static inline __attribute__((always_inline)) void attend_blocks(
    const float *q, const char *k, const char *v, long stride, const int32_t *table, int bs,
    int context, const int hd, const int bf16, float scale, float *out) {
    Softmax s;
    softmax_start(&s, hd);
    float scores[bs + 8];
    for (int start = 0; start < context; start += bs) {
        const int count = context - start < bs ? context - start : bs;
        const long first = (long)table[start / bs] * bs * stride;
        attend_span(q, k + first, v + first, stride, count, hd, bf16, scale, scores, &s);
    }
    softmax_end(&s, hd, out);
}

/* Exported: attention over a paged KV cache (one layer's k and v [slots, heads, head_dim],
 * float32 or bf16; slot = block * block_size + offset). Query i (q and out [n, heads,
 * head_dim] float32) sees the first context[i] keys of its sequence seq[i], whose blocks are
 * tables[seq[i] * max_blocks ...] (Whisper's decoder self-attention). On the OpenMP threads. */
void infire_attend_paged(const float *q, const void *k, const void *v, int bf16, int heads,
                         int head_dim, int block_size, const int32_t *tables, int max_blocks,
                         const int32_t *seq, const int32_t *context, int n, float scale,
                         float *out) {
    const long items = (long)n * heads, elem = bf16 ? 2 : 4, stride = (long)heads * head_dim * elem;
#pragma omp parallel for schedule(static)
    for (long item = 0; item < items; item++) {
        const long i = item / heads, off = (item % heads) * head_dim * elem;
        const int32_t *table = tables + (long)seq[i] * max_blocks;
        const char *kb = (const char *)k + off, *vb = (const char *)v + off;
        const float *qi = q + item * head_dim;
        float *oi = out + item * head_dim;
        if (bf16 && head_dim == 64)
            attend_blocks(qi, kb, vb, stride, table, block_size, context[i], 64, 1, scale, oi);
        else if (bf16)
            attend_blocks(qi, kb, vb, stride, table, block_size, context[i], head_dim, 1, scale, oi);
        else if (head_dim == 64)
            attend_blocks(qi, kb, vb, stride, table, block_size, context[i], 64, 0, scale, oi);
        else
            attend_blocks(qi, kb, vb, stride, table, block_size, context[i], head_dim, 0, scale, oi);
    }
}

/* A block's `count` bf16 keys or values (rows `stride` elements apart) widened into float rows
 * of `hd`: exactly the values load8 reads from them. */
static inline __attribute__((always_inline)) void widen_rows(const uint16_t *src, long stride,
                                                             int count, const int hd, float *dst) {
    for (int j = 0; j < count; j++)
        for (int i = 0; i < hd; i += 8) _mm256_store_ps(dst + (long)j * hd + i, load8(src + j * stride, i, 1));
}

/* The `group` query heads of one KV head (q and out: group rows of hd) over the first
 * `context` keys of a block table, together: each block's keys and values (DENSE_SPAN at
 * most at a time) are read, and widened from bf16, once for all of them, while the next
 * span's are fetched. Each head's arithmetic is attend_blocks' wherever a block holds at
 * most DENSE_SPAN keys (the widening is exact): the same result. */
static inline __attribute__((always_inline)) void attend_group_impl(
    const InfireModel *m, int layer, const float *q, int group, int kv_head,
    const int32_t *table, int context, float *out, const int bf16, const int fixed_hd) {
    const int hd = fixed_hd ? fixed_hd : m->head_dim, bs = m->block_size;
    const long elem = bf16 ? 2 : 4, stride = (long)m->num_kv_heads * hd * elem, off = (long)kv_head * hd * elem;
    const char *k = (const char *)kv_slot(m, layer, 0, 0) + off, *v = (const char *)kv_slot(m, layer, 1, 0) + off;
    Softmax s[group];
    for (int h = 0; h < group; h++) softmax_start(&s[h], hd);
    const int span = bs < DENSE_SPAN ? bs : DENSE_SPAN; /* keys widened at a time */
    float scores[span + 8];
    float kf[bf16 ? span * hd : 1] __attribute__((aligned(32))), vf[bf16 ? span * hd : 1] __attribute__((aligned(32)));
    for (int start = 0, count; start < context; start += count) {
        count = context - start < span ? context - start : span;
        count = bs - start % bs < count ? bs - start % bs : count; /* within its block */
        const char *kb = k + ((long)table[start / bs] * bs + start % bs) * stride, *vb = v + (kb - k);
        if (start + count < context) { /* the next span's keys and values */
            const int after = start + count;
            const long next = ((long)table[after / bs] * bs + after % bs) * stride;
            for (int j = 0; j < span && j < bs - after % bs && after + j < context; j++)
                for (long o = 0; o < hd * elem; o += 64) {
                    _mm_prefetch(k + next + j * stride + o, _MM_HINT_T0);
                    _mm_prefetch(v + next + j * stride + o, _MM_HINT_T0);
                }
        }
        long at = stride;
        if (bf16) {
            widen_rows((const uint16_t *)kb, stride / 2, count, hd, kf);
            widen_rows((const uint16_t *)vb, stride / 2, count, hd, vf);
            kb = (const char *)kf, vb = (const char *)vf, at = hd * 4;
        }
        for (int h = 0; h < group; h++)
            attend_span(q + (long)h * hd, kb, vb, at, count, hd, 0, m->scale, scores, &s[h]);
    }
    for (int h = 0; h < group; h++) softmax_end(&s[h], hd, out + (long)h * hd);
}

static void attend_group(const InfireModel *m, int layer, const float *q, int group, int kv_head,
                         const int32_t *table, int context, float *out) {
    if (m->kv_bf16 && m->head_dim == 64)
        attend_group_impl(m, layer, q, group, kv_head, table, context, out, 1, 64);
    else if (m->kv_bf16)
        attend_group_impl(m, layer, q, group, kv_head, table, context, out, 1, 0);
    else if (m->head_dim == 64)
        attend_group_impl(m, layer, q, group, kv_head, table, context, out, 0, 64);
    else
        attend_group_impl(m, layer, q, group, kv_head, table, context, out, 0, 0);
}

/* Per (token, KV head): its query heads together (attend_group). */
static void attention(const InfireModel *m, int layer, const float *qkv, int n,
                      const int32_t *positions, const int32_t *seq_of_token,
                      const int32_t *block_tables, int max_blocks, float *out) {
    int hd = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    int width = (nh + 2 * nkv) * hd, group = nh / nkv;
#pragma omp for schedule(static)
    for (int item = 0; item < n * nkv; item++) {
        int t = item / nkv, g = item % nkv;
        attend_group(m, layer, qkv + (long)t * width + (long)g * group * hd, group, g,
                     block_tables + (long)seq_of_token[t] * max_blocks, positions[t] + 1,
                     out + (long)t * nh * hd + (long)g * group * hd);
    }
}

/* silu(gate) * up per token, in chunks of features shared by the threads (a decode step's
 * one token is not left to one thread). */
#define SILU_CHUNK 512

static void silu_mul(const float *gate_up, int n, int inter, float *out) {
    const int chunks = (inter + SILU_CHUNK - 1) / SILU_CHUNK;
#pragma omp for schedule(static)
    for (int item = 0; item < n * chunks; item++) {
        const int t = item / chunks, first = item % chunks * SILU_CHUNK;
        const int last = first + SILU_CHUNK < inter ? first + SILU_CHUNK : inter;
        const float *g = gate_up + (long)t * 2 * inter, *u = g + inter;
        float *o = out + (long)t * inter;
        for (int i = first; i < last; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
}

/*
 * The routed experts of layer l for n tokens: x[t] += sum over t's top_k experts of
 * weight * down(silu(gate(normed[t])) * up(normed[t])). Each expert runs once over the
 * tokens routed to it (gathered into rows), so its weights stream once per step; a token
 * sums its experts in ascending order. Called inside the parallel region; gate_up and act
 * are the dense MLP's scratch, moe the experts' (see infire_forward_workspace).
 */
static void experts(const InfireModel *m, Team *team, int l, const float *normed, int n,
                    float *x, float *gate_up, float *act, float *moe) {
    int h = m->hidden, inter = m->expert_intermediate, num = m->num_experts, k = m->top_k;
    float *logits = moe, *weights = logits + (long)n * num, *rows = weights + (long)n * k;
    float *out = rows + (long)n * h, *acc = out + (long)n * h;
    int32_t *ids = (int32_t *)(acc + (long)n * h);
    linear(m, team, m->router[l], NULL, normed, n, h, logits, num, num, 0);
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        float *lg = logits + (long)t * num, top = lg[0], sum = 0.0f, chosen = 0.0f;
        for (int e = 1; e < num; e++) top = lg[e] > top ? lg[e] : top;
        for (int e = 0; e < num; e++) sum += (lg[e] = expf(lg[e] - top));
        for (int j = 0; j < k; j++) { /* the k largest; ties to the lower expert */
            int best = -1;
            for (int e = 0; e < num; e++)
                if (lg[e] >= 0.0f && (best < 0 || lg[e] > lg[best])) best = e;
            ids[(long)t * k + j] = best;
            weights[(long)t * k + j] = lg[best] / sum;
            chosen += lg[best] / sum;
            lg[best] = -1.0f; /* taken */
        }
        if (m->norm_topk)
            for (int j = 0; j < k; j++) weights[(long)t * k + j] /= chosen;
        for (int i = 0; i < h; i++) acc[(long)t * h + i] = 0.0f;
    }
    int token[n], which[n]; /* this expert's tokens (every thread builds the same list) */
    for (int e = 0; e < num; e++) {
        int count = 0;
        for (int t = 0; t < n; t++)
            for (int j = 0; j < k; j++)
                if (ids[(long)t * k + j] == e) {
                    token[count] = t;
                    which[count++] = j;
                }
        if (!count) continue;
#pragma omp for schedule(static)
        for (int i = 0; i < count; i++)
            memcpy(rows + (long)i * h, normed + (long)token[i] * h, sizeof(float) * h);
        long at = (long)l * num + e;
        linear(m, team, m->expert_gate_up[at], NULL, rows, count, h, gate_up, 2 * inter, 2 * inter, 0);
        silu_mul(gate_up, count, inter, act);
        linear(m, team, m->expert_down[at], NULL, act, count, inter, out, h, h, 0);
#pragma omp for schedule(static)
        for (int i = 0; i < count; i++) { /* a token meets an expert once: rows are apart */
            float w = weights[(long)token[i] * k + which[i]];
            float *a = acc + (long)token[i] * h;
            const float *o = out + (long)i * h;
            for (int c = 0; c < h; c++) a[c] += w * o[c];
        }
    }
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++)
        for (int i = 0; i < h; i++) x[(long)t * h + i] += acc[(long)t * h + i];
}

/* The dense MLP's or an expert's intermediate features, whichever is wider (they share
 * the gate_up and act scratch). */
static inline long mlp_width(const InfireModel *m) {
    return m->expert_intermediate > m->intermediate ? m->expert_intermediate : m->intermediate;
}

/* Scratch floats infire_forward needs for n tokens. */
long infire_forward_workspace(const InfireModel *m, int n) {
    long q = (long)m->num_heads * m->head_dim, kv = (long)m->num_kv_heads * m->head_dim;
    long moe = m->num_experts ? m->num_experts + 3L * m->top_k + 3L * m->hidden : 0;
    return (long)n * (3L * m->hidden + q + 2 * kv + q + 3L * mlp_width(m) + moe);
}

/*
 * Forward n tokens (any mix of sequences, each token's earlier context already in the
 * pool or among the n) and return the logits of the rows in logit_rows.
 * cos/sin: [n, head_dim] rows of the tokens' positions; slots: pool slot of each token;
 * seq_of_token indexes block_tables [num_seqs, max_blocks]; logits: [num_logits, vocab].
 */
int infire_forward(const InfireModel *m, int n, const int64_t *token_ids,
                   const int32_t *positions, const float *cos, const float *sin,
                   const int64_t *slots, const int32_t *seq_of_token,
                   const int32_t *block_tables, int max_blocks, int num_logits,
                   const int32_t *logit_rows, float *work, float *logits) {
    int hd = m->head_dim, h = m->hidden, inter = m->intermediate;
    int q = m->num_heads * hd, width = (m->num_heads + 2 * m->num_kv_heads) * hd;
    float *x = work, *normed = x + (long)n * h, *qkv = normed + (long)n * h;
    float *attn = qkv + (long)n * width, *gate_up = attn + (long)n * q;
    long wide = mlp_width(m);
    float *act = gate_up + (long)n * 2 * wide, *last = act + (long)n * wide;
    Team shares, *team = &shares; /* the threads' shares of each quantized linear */
    memset(team, 0, sizeof shares);
#pragma omp parallel
    {
        embed_tokens(m, token_ids, n, x);
        for (int l = 0; l < m->num_layers; l++) {
            rms_norm(x, m->norm1[l], normed, n, h, m->eps);
            linear(m, team, m->qkv[l], m->qkv_bias[l], normed, n, h, qkv, width, width, 0);
            rope_and_store(m, l, qkv, n, cos, sin, slots);
            attention(m, l, qkv, n, positions, seq_of_token, block_tables, max_blocks, attn);
            linear(m, team, m->o_proj[l], NULL, attn, n, q, x, h, h, 1);
            rms_norm(x, m->norm2[l], normed, n, h, m->eps);
            if (m->num_experts && m->router[l]) {
                experts(m, team, l, normed, n, x, gate_up, act, last + (long)n * h);
                continue;
            }
            linear(m, team, m->gate_up[l], NULL, normed, n, h, gate_up, 2 * inter, 2 * inter, 0);
            silu_mul(gate_up, n, inter, act);
            linear(m, team, m->down[l], NULL, act, n, inter, x, h, h, 1);
        }
#pragma omp for schedule(static)
        for (int i = 0; i < num_logits; i++)
            for (int j = 0; j < h; j++) last[(long)i * h + j] = x[(long)logit_rows[i] * h + j];
        rms_norm(last, m->final_norm, normed, num_logits, h, m->eps);
        linear(m, team, m->lm_head, NULL, normed, num_logits, h, logits, m->vocab, m->vocab, 0);
    }
    return 0;
}
