/*
 * Forward pass of a Llama-family model on x86-64 CPUs with AVX2 and FMA, in one call.
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
 *  - attention reads the paged KV pool through block tables with an online softmax.
 *
 * The layout of InfireModel is mirrored by a ctypes Structure in cpu_forward.py.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define TILE_ROWS 4
#define TILE_COLS 16
#define TOKEN_BLOCK 32 /* tokens whose activations stay in cache while a weight tile streams */
#define MAX_HEAD_DIM 256

typedef struct {
    int32_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, vocab;
    int32_t block_size, weight_bf16, kv_bf16;
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
    const void *embed;   /* [vocab, hidden] row-major, weight dtype */
    const void *lm_head; /* tiled, rows padded to TILE_ROWS */
    void *kv_cache;      /* [layers, 2, blocks, block_size, kv_heads, head_dim], kv dtype */
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

static inline __attribute__((always_inline)) void linear_impl(
    const void *w, const int bf16, const float *bias, const float *x, int n, int cols,
    float *y, int rows, int ldy, int accumulate) {
    int tiles = (rows + TILE_ROWS - 1) / TILE_ROWS;
    for (int t0 = 0; t0 < n; t0 += TOKEN_BLOCK) {
        int t1 = t0 + TOKEN_BLOCK < n ? t0 + TOKEN_BLOCK : n;
#pragma omp for schedule(static)
        for (int tile = 0; tile < tiles; tile++) {
            for (int t = t0; t < t1; t += 2) {
                float d0[TILE_ROWS], d1[TILE_ROWS];
                const float *x0 = x + (long)t * cols;
                int two = t + 1 < t1;
                if (two)
                    tile_dots(w, tile, cols, bf16, x0, x0 + cols, 1, d0, d1);
                else
                    tile_dots(w, tile, cols, bf16, x0, x0, 0, d0, d1);
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

/* y[t, :rows] (+)= W x[t] (+ bias) for n tokens; called inside a parallel region. */
static void linear(const void *w, int bf16, const float *bias, const float *x, int n, int cols,
                   float *y, int rows, int ldy, int accumulate) {
    if (bf16)
        linear_impl(w, 1, bias, x, n, cols, y, rows, ldy, accumulate);
    else
        linear_impl(w, 0, bias, x, n, cols, y, rows, ldy, accumulate);
}

static void rms_norm(const float *x, const float *weight, float *out, int n, int dim, float eps) {
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        const float *xt = x + (long)t * dim;
        float *ot = out + (long)t * dim;
        __m256 sum = _mm256_setzero_ps();
        for (int i = 0; i < dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xt + i);
            sum = _mm256_fmadd_ps(v, v, sum);
        }
        __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(sum) / dim + eps));
        for (int i = 0; i < dim; i += 8)
            _mm256_storeu_ps(ot + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i),
                                                    _mm256_mul_ps(_mm256_loadu_ps(xt + i), inv)));
    }
}

static void embed_tokens(const InfireModel *m, const int64_t *token_ids, int n, float *x) {
    int h = m->hidden;
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        float *xt = x + (long)t * h;
        long row = token_ids[t] * (long)h;
        if (m->weight_bf16)
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

/* RoPE on the q and k heads of each token, then its k and v into the pool at its slot. */
static void rope_and_store(const InfireModel *m, int layer, float *qkv, int n, const float *cos,
                           const float *sin, const int64_t *slots) {
    int hd = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    int width = (nh + 2 * nkv) * hd;
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        float *row = qkv + (long)t * width;
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
static inline __attribute__((always_inline)) void attend_impl(
    const InfireModel *m, int layer, const float *q, int kv_head, const int32_t *table,
    int context, float *out, const int bf16) {
    int hd = m->head_dim, bs = m->block_size;
    long elem = bf16 ? 2 : 4, stride = (long)m->num_kv_heads * hd * elem;
    long head_off = (long)kv_head * hd * elem;
    float acc[MAX_HEAD_DIM] = {0};
    float scores[bs + 8];
    float max = -INFINITY, denom = 0.0f;
    __m256 scale = _mm256_set1_ps(m->scale);
    for (int start = 0; start < context; start += bs) {
        int count = context - start < bs ? context - start : bs;
        long first = (long)table[start / bs] * bs;
        const char *keys = (const char *)kv_slot(m, layer, 0, first) + head_off;
        const char *values = (const char *)kv_slot(m, layer, 1, first) + head_off;
        int j = 0;
        for (; j + 8 <= count; j += 8)
            _mm256_storeu_ps(scores + j, _mm256_mul_ps(dot8(q, keys + j * stride, stride, hd, bf16), scale));
        for (; j < count; j++) scores[j] = dot(q, keys + j * stride, hd, bf16) * m->scale;
        float block_max = -INFINITY;
        for (j = 0; j < count; j++) block_max = scores[j] > block_max ? scores[j] : block_max;
        if (block_max > max) {
            float correction = expf(max - block_max);
            denom *= correction;
            for (int i = 0; i < hd; i++) acc[i] *= correction;
            max = block_max;
        }
        for (j = 0; j < count; j += 8)
            _mm256_storeu_ps(scores + j,
                             exp256(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(max))));
        for (j = 0; j < count; j++) {
            denom += scores[j];
            __m256 p = _mm256_set1_ps(scores[j]);
            const char *v = values + j * stride;
            for (int i = 0; i < hd; i += 8)
                _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(p, load8(v, i, bf16), _mm256_loadu_ps(acc + i)));
        }
    }
    for (int i = 0; i < hd; i++) out[i] = acc[i] / denom;
}

static void attend(const InfireModel *m, int layer, const float *q, int kv_head,
                   const int32_t *table, int context, float *out) {
    if (m->kv_bf16)
        attend_impl(m, layer, q, kv_head, table, context, out, 1);
    else
        attend_impl(m, layer, q, kv_head, table, context, out, 0);
}

static void attention(const InfireModel *m, int layer, const float *qkv, int n,
                      const int32_t *positions, const int32_t *seq_of_token,
                      const int32_t *block_tables, int max_blocks, float *out) {
    int hd = m->head_dim, nh = m->num_heads, nkv = m->num_kv_heads;
    int width = (nh + 2 * nkv) * hd, group = nh / nkv;
#pragma omp for schedule(static)
    for (int item = 0; item < n * nh; item++) {
        int t = item / nh, h = item % nh;
        attend(m, layer, qkv + (long)t * width + h * hd, h / group,
               block_tables + (long)seq_of_token[t] * max_blocks, positions[t] + 1,
               out + (long)t * nh * hd + h * hd);
    }
}

static void silu_mul(const float *gate_up, int n, int inter, float *out) {
#pragma omp for schedule(static)
    for (int t = 0; t < n; t++) {
        const float *g = gate_up + (long)t * 2 * inter, *u = g + inter;
        float *o = out + (long)t * inter;
        for (int i = 0; i < inter; i += 8) {
            __m256 gv = _mm256_loadu_ps(g + i);
            __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
            __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
    }
}

/* Scratch floats infire_forward needs for n tokens. */
long infire_forward_workspace(const InfireModel *m, int n) {
    long q = (long)m->num_heads * m->head_dim, kv = (long)m->num_kv_heads * m->head_dim;
    return (long)n * (3L * m->hidden + q + 2 * kv + q + 3L * m->intermediate);
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
    int hd = m->head_dim, h = m->hidden, inter = m->intermediate, bf16 = m->weight_bf16;
    int q = m->num_heads * hd, width = (m->num_heads + 2 * m->num_kv_heads) * hd;
    float *x = work, *normed = x + (long)n * h, *qkv = normed + (long)n * h;
    float *attn = qkv + (long)n * width, *gate_up = attn + (long)n * q;
    float *act = gate_up + (long)n * 2 * inter, *last = act + (long)n * inter;
#pragma omp parallel
    {
        embed_tokens(m, token_ids, n, x);
        for (int l = 0; l < m->num_layers; l++) {
            rms_norm(x, m->norm1[l], normed, n, h, m->eps);
            linear(m->qkv[l], bf16, m->qkv_bias[l], normed, n, h, qkv, width, width, 0);
            rope_and_store(m, l, qkv, n, cos, sin, slots);
            attention(m, l, qkv, n, positions, seq_of_token, block_tables, max_blocks, attn);
            linear(m->o_proj[l], bf16, NULL, attn, n, q, x, h, h, 1);
            rms_norm(x, m->norm2[l], normed, n, h, m->eps);
            linear(m->gate_up[l], bf16, NULL, normed, n, h, gate_up, 2 * inter, 2 * inter, 0);
            silu_mul(gate_up, n, inter, act);
            linear(m->down[l], bf16, NULL, act, n, inter, x, h, h, 1);
        }
#pragma omp for schedule(static)
        for (int i = 0; i < num_logits; i++)
            for (int j = 0; j < h; j++) last[(long)i * h + j] = x[(long)logit_rows[i] * h + j];
        rms_norm(last, m->final_norm, normed, num_logits, h, m->eps);
        linear(m->lm_head, bf16, NULL, normed, num_logits, h, logits, m->vocab, m->vocab, 0);
    }
    return 0;
}
