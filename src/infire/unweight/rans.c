/*
 * Unweight: chunked, 8-way interleaved rANS coding of byte symbols (rans.py has the layout;
 * docs/unweight-format.md every byte of it).
 *
 * Probabilities are quantized to 4096ths; a state x lives in [2^16, 2^32) and is
 * renormalized in 16-bit words. Symbol i of a chunk uses state i % 8, so a decoder has 8
 * independent dependency chains to overlap. A chunk is the 8 decoder start states
 * (uint32 LE), then its words (uint16 LE) in the order the decoder reads them. The
 * encoder starts every state at 2^16 and runs backwards, so a decoder that ends a chunk
 * with all states at 2^16 and every word consumed has decoded what was encoded (the CRC
 * of the whole tensor is checked by the caller besides). Chunks run in parallel (OpenMP);
 * on x86 with AVX2 (checked at run time; the flags stay portable) a thread steps two
 * chunks at once, each chunk's 8 states as one vector.
 * The byte order is that of the host: little-endian machines only (rans.py checks).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PROB_BITS 12
#define PROB_MASK ((1u << PROB_BITS) - 1)
#define STATE_LOW (1u << 16)
#define STATES 8
#define HEADER_BYTES (4 * STATES)
#define MAX_CHUNK 65536

/* Encoder region of one chunk in scratch: the header plus one word per symbol at most. */
static inline int64_t region_bytes(int64_t chunk) { return HEADER_BYTES + 2 * chunk; }

/*
 * One encode step of state X with symbol S: if X would leave [2^16, 2^32), emit its low
 * word below W first. The word is stored and the shift applied whatever the condition,
 * arithmetically, like the decoder's refill (a branch on it would miss often); W stays
 * above the chunk's header since a chunk never emits more words than it has symbols.
 * X / f is a multiply by rcp = ceil(2^44 / f): exact for X < f * 2^20 and f < 4096
 * (the error X * (rcp - 2^44 / f) / 2^44 < 2^-12 < 1 / f, and X * rcp < 2^64), and
 * 2-3x faster than a division measured on the EPYC this was written on.
 */
#define ENCODE(X, S)                                                  \
    do {                                                              \
        uint32_t s_ = (S), f_ = freq[s_];                             \
        uint32_t emit = (X) >= f_ << (32 - PROB_BITS);                \
        uint16_t word = (uint16_t)(X);                                \
        memcpy(w - 2, &word, 2);                                      \
        w -= 2 * emit;                                                \
        (X) >>= 16 * emit;                                            \
        uint32_t q = (uint32_t)(((X) * rcp[s_]) >> (32 + PROB_BITS)); \
        (X) = (q << PROB_BITS) + (X) - q * f_ + cum[s_];              \
    } while (0)

/*
 * Encode n symbols in chunks of `chunk`. Chunk c is written to the end of its region
 * scratch[c * region_bytes(chunk) ...], sizes[c] receiving its byte count. cum[s] is the
 * sum of freq[t] for t < s. Returns 1 if a symbol has frequency 0 (nothing is valid then).
 */
int unweight_rans_encode(const uint8_t *symbols, int64_t n, int64_t chunk,
                         const uint32_t *freq, const uint32_t *cum, uint8_t *scratch,
                         int64_t *sizes) {
    int64_t num_chunks = (n + chunk - 1) / chunk;
    uint64_t rcp[256];
    for (int s = 0; s < 256; s++)
        rcp[s] = freq[s] ? ((1ull << (32 + PROB_BITS)) + freq[s] - 1) / freq[s] : 0;
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 1) reduction(| : bad)
    for (int64_t c = 0; c < num_chunks; c++) {
        const uint8_t *sym = symbols + c * chunk;
        int64_t count = n - c * chunk < chunk ? n - c * chunk : chunk;
        for (int64_t i = 0; i < count; i++) bad |= freq[sym[i]] == 0;
        uint8_t *region_end = scratch + (c + 1) * region_bytes(chunk);
        uint8_t *w = region_end;  // words are written backwards
        uint32_t x[STATES];
        for (int j = 0; j < STATES; j++) x[j] = STATE_LOW;
        int64_t i = count - 1;
        for (; i >= 0 && (i & (STATES - 1)) != STATES - 1; i--)  // a last, partial group
            ENCODE(x[i & (STATES - 1)], sym[i]);
        uint32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3], x4 = x[4], x5 = x[5], x6 = x[6],
                 x7 = x[7];
        for (; i >= 0; i -= STATES) {
            ENCODE(x7, sym[i]);
            ENCODE(x6, sym[i - 1]);
            ENCODE(x5, sym[i - 2]);
            ENCODE(x4, sym[i - 3]);
            ENCODE(x3, sym[i - 4]);
            ENCODE(x2, sym[i - 5]);
            ENCODE(x1, sym[i - 6]);
            ENCODE(x0, sym[i - 7]);
        }
        x[0] = x0, x[1] = x1, x[2] = x2, x[3] = x3, x[4] = x4, x[5] = x5, x[6] = x6, x[7] = x7;
        w -= HEADER_BYTES;
        memcpy(w, x, HEADER_BYTES);
        sizes[c] = region_end - w;
    }
    return bad;
}

/*
 * One decode step of state X: table entry = symbol | freq << 8 | (slot - cum) << 20.
 * The renormalization reads the next word unconditionally and shifts it in only if
 * needed, by arithmetic on the 0/1 condition: whether a word is needed is data, so a
 * branch on it would miss often (and GCC compiles a ?: here into a branch; measured
 * 1.84 ns/symbol with a mask select, 1.71 with this). P advances 2 bytes when it was.
 */
#define STEP(X, SYM)                                                   \
    do {                                                               \
        uint32_t e = table[(X) & PROB_MASK];                           \
        (X) = ((e >> 8) & PROB_MASK) * ((X) >> PROB_BITS) + (e >> 20); \
        uint16_t word;                                                 \
        memcpy(&word, p, 2);                                           \
        uint32_t need = (X) < STATE_LOW;                               \
        (X) = ((X) << (16 * need)) | (word & (0u - need));             \
        p += 2 * need;                                                 \
        (SYM) = (uint8_t)e;                                            \
    } while (0)

/* Where the decoding of one chunk stands. */
typedef struct {
    uint32_t x[STATES];
    const uint8_t *p, *end;  // the next word; the chunk's end
    int64_t i;               // symbols decoded
} Cursor;

/* The chunk's start states; 1 when they cannot be (a damaged chunk). */
static int open_chunk(Cursor *c, const uint8_t *begin, const uint8_t *end) {
    if (end - begin < HEADER_BYTES || ((end - begin) & 1)) return 1;
    memcpy(c->x, begin, HEADER_BYTES);
    for (int j = 0; j < STATES; j++)
        if (c->x[j] < STATE_LOW) return 1;
    c->p = begin + HEADER_BYTES;
    c->end = end;
    c->i = 0;
    return 0;
}

/* The rest of a chunk's count symbols into sym (c->i a multiple of 8); 0 when it
 * decoded exactly to its end: every state back at 2^16, every word read. */
static int finish_chunk(Cursor *c, int64_t count, const uint32_t *table, uint8_t *sym) {
    uint32_t x0 = c->x[0], x1 = c->x[1], x2 = c->x[2], x3 = c->x[3], x4 = c->x[4],
             x5 = c->x[5], x6 = c->x[6], x7 = c->x[7], *x = c->x;
    const uint8_t *p = c->p, *end = c->end;
    int64_t i = c->i;
    // A group of 8 steps reads at most 8 words: no bound checks while 8 are left.
    for (; i + STATES <= count && end - p >= 2 * STATES; i += STATES) {
        STEP(x0, sym[i]);
        STEP(x1, sym[i + 1]);
        STEP(x2, sym[i + 2]);
        STEP(x3, sym[i + 3]);
        STEP(x4, sym[i + 4]);
        STEP(x5, sym[i + 5]);
        STEP(x6, sym[i + 6]);
        STEP(x7, sym[i + 7]);
    }
    x[0] = x0, x[1] = x1, x[2] = x2, x[3] = x3, x[4] = x4, x[5] = x5, x[6] = x6, x[7] = x7;
    for (; i < count; i++) {  // the chunk's tail, every read checked
        uint32_t *state = &x[i & (STATES - 1)];
        uint32_t e = table[*state & PROB_MASK];
        *state = ((e >> 8) & PROB_MASK) * (*state >> PROB_BITS) + (e >> 20);
        if (*state < STATE_LOW) {
            if (end - p < 2) return 1;
            uint16_t word;
            memcpy(&word, p, 2);
            p += 2;
            *state = (*state << 16) | word;
        }
        sym[i] = (uint8_t)e;
    }
    for (int j = 0; j < STATES; j++)
        if (x[j] != STATE_LOW) return 1;
    return p != end;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define AVX2_PATH 1

/* lanes[m]: for the lanes set in m (those that need a word), which of the next words. */
static void refill_lanes(int32_t lanes[256][8]) {
    for (int m = 0; m < 256; m++)
        for (int j = 0, rank = 0; j < STATES; j++) lanes[m][j] = (m >> j) & 1 ? rank++ : 0;
}

/* One step of all 8 states of a chunk, in one AVX2 register each: gather the table
 * entries, decode, and refill the lanes below 2^16 with the next words, spread to them
 * by a permutation of 8 zero-extended words (lanes[mask]). */
#define VSTEP(X, P, SYM)                                                                    \
    do {                                                                                    \
        __m256i e = _mm256_i32gather_epi32((const int *)table, _mm256_and_si256(X, mask12), 4); \
        __m256i f = _mm256_and_si256(_mm256_srli_epi32(e, 8), mask12);                      \
        X = _mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(X, PROB_BITS)),          \
                             _mm256_srli_epi32(e, 20));                                     \
        __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(X, 16), zero);                  \
        int m = _mm256_movemask_ps(_mm256_castsi256_ps(need));                              \
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(P)));           \
        w = _mm256_permutevar8x32_epi32(w, _mm256_loadu_si256((const __m256i *)lanes[m]));  \
        X = _mm256_blendv_epi8(X, _mm256_or_si256(_mm256_slli_epi32(X, 16), w), need);      \
        P += 2 * __builtin_popcount(m);                                                     \
        __m256i b = _mm256_shuffle_epi8(e, low_bytes);                                      \
        uint32_t lo = (uint32_t)_mm256_extract_epi32(b, 0);                                 \
        uint32_t hi = (uint32_t)_mm256_extract_epi32(b, 4);                                 \
        memcpy((SYM) + i, &lo, 4);                                                          \
        memcpy((SYM) + i + 4, &hi, 4);                                                      \
    } while (0)

/*
 * Two chunks side by side while both have 8 words left: one chunk's 8 states form a
 * single dependency chain of vector steps (gather, multiply, refill: ~2 ns a symbol, no
 * faster than scalar code); two chains overlap (1.3 ns a symbol measured on Zen 3).
 * Leaves both cursors at the same multiple of 8 for finish_chunk.
 */
__attribute__((target("avx2,popcnt"))) static void decode_pair_avx2(
    Cursor *a, Cursor *b, int64_t count, const uint32_t *table, const int32_t lanes[256][8],
    uint8_t *sym_a, uint8_t *sym_b) {
    const __m256i mask12 = _mm256_set1_epi32(PROB_MASK), zero = _mm256_setzero_si256();
    const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                               -1, -1, -1, -1, 0, 4, 8, 12, -1, -1, -1, -1,
                                               -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i xa = _mm256_loadu_si256((const __m256i *)a->x);
    __m256i xb = _mm256_loadu_si256((const __m256i *)b->x);
    const uint8_t *pa = a->p, *pb = b->p;
    int64_t i = 0;
    for (; i + STATES <= count && a->end - pa >= 2 * STATES && b->end - pb >= 2 * STATES;
         i += STATES) {
        VSTEP(xa, pa, sym_a);
        VSTEP(xb, pb, sym_b);
    }
    _mm256_storeu_si256((__m256i *)a->x, xa);
    _mm256_storeu_si256((__m256i *)b->x, xb);
    a->p = pa, b->p = pb, a->i = i, b->i = i;
}
#endif

/*
 * CRC-32 as zlib computes it (reflected polynomial 0xEDB88320, pre- and post-inverted),
 * 8 bytes a step through 8 tables, so that each thread checks the weights it has just
 * written while they are in its cache, in parallel: a serial zlib pass after decoding
 * would cost about as much as the decoding itself. Pieces are joined with
 * crc(A B) = crc(A) * x^(8 |B|) ^ crc(B) (mod the polynomial; the inversions cancel).
 */
#define CRC_POLY 0xEDB88320u

static void crc_tables(uint32_t table[8][256]) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t r = b;
        for (int k = 0; k < 8; k++) r = r & 1 ? (r >> 1) ^ CRC_POLY : r >> 1;
        table[0][b] = r;
    }
    for (int t = 1; t < 8; t++)
        for (int b = 0; b < 256; b++)
            table[t][b] = (table[t - 1][b] >> 8) ^ table[0][table[t - 1][b] & 0xFF];
}

/* The running (uninverted) CRC after the next len bytes at p. */
static inline uint32_t crc_update(const uint32_t table[8][256], uint32_t crc, const uint8_t *p,
                                  int64_t len) {
    for (; len >= 8; p += 8, len -= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^
              table[4][lo >> 24] ^ table[3][hi & 0xFF] ^ table[2][(hi >> 8) & 0xFF] ^
              table[1][(hi >> 16) & 0xFF] ^ table[0][hi >> 24];
    }
    for (; len > 0; p++, len--) crc = (crc >> 8) ^ table[0][(crc ^ *p) & 0xFF];
    return crc;
}

#ifdef AVX2_PATH
/*
 * The same CRC-32 16 bytes at a time with carry-less multiplication (PCLMULQDQ), ~5x the
 * tables' speed: four 128-bit accumulators are folded forward over 64-byte blocks
 * (multiplied by x^(512+32) and x^(512-32) mod P, reflected), folded into one, then
 * reduced to 32 bits by Barrett reduction. The constants are those powers of x modulo
 * P(x) = 0x104C11DB7 in the reflected bit order, P itself and floor(x^64 / P).
 * Takes and returns the running (inverted) register like crc_update; len >= 64, len % 16
 * == 0.
 */
__attribute__((target("pclmul,sse4.1"))) static uint32_t crc_update_clmul(uint32_t crc,
                                                                          const uint8_t *p,
                                                                          int64_t len) {
    const __m128i fold4 = _mm_set_epi64x(0x01c6e41596, 0x0154442bd4);  // x^(512-32), x^(512+32)
    const __m128i fold1 = _mm_set_epi64x(0x00ccaa009e, 0x01751997d0);  // x^(128-32), x^(128+32)
    const __m128i fold64 = _mm_set_epi64x(0, 0x0163cd6124);            // x^64
    const __m128i barrett = _mm_set_epi64x(0x01f7011641, 0x01db710641);  // x^64 / P, P
    const __m128i low32 = _mm_setr_epi32(~0, 0, ~0, 0);
    __m128i x[4];
    for (int k = 0; k < 4; k++) x[k] = _mm_loadu_si128((const __m128i *)(p + 16 * k));
    x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)crc));
    for (p += 64, len -= 64; len >= 64; p += 64, len -= 64)
        for (int k = 0; k < 4; k++) {
            __m128i lo = _mm_clmulepi64_si128(x[k], fold4, 0x00);
            __m128i hi = _mm_clmulepi64_si128(x[k], fold4, 0x11);
            x[k] = _mm_xor_si128(_mm_xor_si128(lo, hi),
                                 _mm_loadu_si128((const __m128i *)(p + 16 * k)));
        }
    __m128i a = x[0];
    for (int k = 1; k < 4; k++)
        a = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, fold1, 0x00),
                                        _mm_clmulepi64_si128(a, fold1, 0x11)), x[k]);
    for (; len >= 16; p += 16, len -= 16)
        a = _mm_xor_si128(_mm_xor_si128(_mm_clmulepi64_si128(a, fold1, 0x00),
                                        _mm_clmulepi64_si128(a, fold1, 0x11)),
                          _mm_loadu_si128((const __m128i *)p));
    // 128 -> 64 bits, then 64 -> 32 (Barrett)
    a = _mm_xor_si128(_mm_srli_si128(a, 8), _mm_clmulepi64_si128(a, fold1, 0x10));
    a = _mm_xor_si128(_mm_srli_si128(a, 4),
                      _mm_clmulepi64_si128(_mm_and_si128(a, low32), fold64, 0x00));
    __m128i t = _mm_clmulepi64_si128(_mm_and_si128(a, low32), barrett, 0x10);
    t = _mm_clmulepi64_si128(_mm_and_si128(t, low32), barrett, 0x00);
    return (uint32_t)_mm_extract_epi32(_mm_xor_si128(a, t), 1);
}
#endif

static uint32_t crc_multiply(uint32_t a, uint32_t b);
static uint32_t crc_shift(uint64_t len);

/* CRC-32 of len bytes. Each 8-byte step waits for the previous one, so four quarters
 * are checked side by side (4 independent chains, ~2x faster) and then joined. */
static uint32_t crc32_of(const uint32_t table[8][256], const uint8_t *p, int64_t len,
                         int clmul) {
#ifdef AVX2_PATH
    if (clmul && len >= 64) {
        int64_t body = len & ~(int64_t)15;
        return ~crc_update(table, crc_update_clmul(0xFFFFFFFFu, p, body), p + body, len - body);
    }
#else
    (void)clmul;
#endif
    int64_t part = (len / 4) & ~(int64_t)7;
    if (part < 1024) return ~crc_update(table, 0xFFFFFFFFu, p, len);
    uint32_t c[4] = {0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu, 0xFFFFFFFFu};
    for (int64_t k = 0; k < part; k += 8)
        for (int q = 0; q < 4; q++) c[q] = crc_update(table, c[q], p + q * part + k, 8);
    c[3] = crc_update(table, c[3], p + 4 * part, len - 4 * part);
    uint32_t shift = crc_shift(part), total = ~c[0];
    total = crc_multiply(total, shift) ^ ~c[1];
    total = crc_multiply(total, shift) ^ ~c[2];
    return crc_multiply(total, crc_shift(len - 3 * part)) ^ ~c[3];
}

/* a * b modulo the CRC polynomial, bit 31 being x^0 (the reflected order). */
static uint32_t crc_multiply(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (int i = 0; i < 32; i++) {  // b = b * x^i as i goes
        if (a & (0x80000000u >> i)) product ^= b;
        b = b & 1 ? (b >> 1) ^ CRC_POLY : b >> 1;
    }
    return product;
}

/* x^(8 * len) modulo the CRC polynomial. */
static uint32_t crc_shift(uint64_t len) {
    uint32_t result = 0x80000000u, power = 0x80000000u >> 8;  // x^0, x^8
    for (; len; len >>= 1, power = crc_multiply(power, power))
        if (len & 1) result = crc_multiply(result, power);
    return result;
}

/* What decoding needs, the same for every chunk. */
typedef struct {
    const uint8_t *stream;
    const uint64_t *offsets;
    int64_t n, chunk, num_chunks;
    const uint32_t *table;
    const uint8_t *rest;  // NULL: symbols out, else BF16 weights
    void *out;
    uint32_t *crcs;  // per chunk, with rest
    const uint32_t (*crc_table)[256];
    const int32_t (*lanes)[8];  // NULL: scalar code only
    int clmul;                  // CRC-32 with PCLMULQDQ
} Job;

static int64_t chunk_count(const Job *job, int64_t c) {
    int64_t first = c * job->chunk;
    return job->n - first < job->chunk ? job->n - first : job->chunk;
}

/* With weights as the output: chunk c's, from its symbols in sym, and their CRC-32
 * (symbols as the output are decoded in place). */
static void emit_chunk(const Job *job, int64_t c, const uint8_t *sym) {
    if (!job->rest) return;
    int64_t first = c * job->chunk, count = chunk_count(job, c);
    const uint8_t *r = job->rest + first;
    uint16_t *w = (uint16_t *)job->out + first;
    for (int64_t k = 0; k < count; k++)  // vectorizes
        w[k] = (uint16_t)((r[k] & 0x80) << 8) | (uint16_t)(sym[k] << 7) | (r[k] & 0x7F);
    job->crcs[c] = crc32_of(job->crc_table, (const uint8_t *)w, 2 * count, job->clmul);
}

/* Chunks c and, with the AVX2 path, c + 1; the number that did not decode exactly. */
static int decode_unit(const Job *job, int64_t c) {
    uint8_t buffers[2][MAX_CHUNK];  // the chunks' exponents, when weights are the output
    int64_t last = job->lanes && c + 1 < job->num_chunks ? c + 1 : c;
    Cursor cursors[2];
    uint8_t *sym[2];
    int bad[2] = {0, 0};
    for (int64_t k = c; k <= last; k++) {
        sym[k - c] = job->rest ? buffers[k - c] : (uint8_t *)job->out + k * job->chunk;
        const uint8_t *begin = job->stream + job->offsets[k];
        bad[k - c] = open_chunk(&cursors[k - c], begin, job->stream + job->offsets[k + 1]);
    }
#ifdef AVX2_PATH
    if (last > c && !bad[0] && !bad[1])
        decode_pair_avx2(&cursors[0], &cursors[1], chunk_count(job, last), job->table,
                         job->lanes, sym[0], sym[1]);
#endif
    for (int64_t k = c; k <= last; k++) {
        if (!bad[k - c])
            bad[k - c] = finish_chunk(&cursors[k - c], chunk_count(job, k), job->table, sym[k - c]);
        if (!bad[k - c]) emit_chunk(job, k, sym[k - c]);
    }
    return bad[0] + bad[1];
}

/*
 * Decode n symbols from stream (chunk c in bytes [offsets[c], offsets[c + 1]), offsets
 * checked by the caller) with the frequencies freq[256] (summing to 4096). With rest
 * (one sign << 7 | mantissa byte per weight) the BF16 weights are written to out as
 * uint16 and their CRC-32 to *crc, else the symbols as uint8. simd = 0 keeps to the
 * scalar code (for tests; else AVX2 where the CPU has it). Returns the number of chunks
 * that did not decode exactly (or 1 for unusable arguments).
 */
int64_t unweight_rans_decode(const uint8_t *stream, const uint64_t *offsets, int64_t n,
                             int64_t chunk, const uint32_t *freq, const uint8_t *rest,
                             void *out, uint32_t *crc, int simd) {
    if (chunk > MAX_CHUNK || chunk < 1 || n < 1) return 1;
    // The table: per slot, symbol | freq << 8 | (slot - cum) << 20.
    uint32_t table[1u << PROB_BITS], slot = 0;
    for (uint32_t s = 0; s < 256; s++) {
        if (slot + freq[s] > (1u << PROB_BITS) || freq[s] >= (1u << PROB_BITS)) return 1;
        for (uint32_t k = 0; k < freq[s]; k++) table[slot++] = s | freq[s] << 8 | k << 20;
    }
    if (slot != (1u << PROB_BITS)) return 1;
    uint32_t crc_table[8][256];
    int64_t num_chunks = (n + chunk - 1) / chunk, bad = 0;
    Job job = {stream, offsets, n, chunk, num_chunks, table, rest, out, NULL,
               (const uint32_t(*)[256])crc_table, NULL, 0};
#ifdef AVX2_PATH
    int32_t lanes[256][8];
    if (simd && num_chunks > 1 && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("popcnt")) {
        refill_lanes(lanes);
        job.lanes = (const int32_t(*)[8])lanes;
    }
    job.clmul = simd && __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1");
#else
    (void)simd;
#endif
    if (rest) {
        crc_tables(crc_table);
        job.crcs = malloc(num_chunks * sizeof *job.crcs);
        if (!job.crcs) return 1;
    }
    int64_t step = job.lanes ? 2 : 1, units = (num_chunks + step - 1) / step;
    if (units == 1) {  // no threads to wake: that costs more than a small tensor
        bad = decode_unit(&job, 0);
    } else {
#pragma omp parallel for schedule(dynamic, 1) reduction(+ : bad)
        for (int64_t u = 0; u < units; u++) bad += decode_unit(&job, u * step);
    }
    if (rest) {
        uint32_t whole = crc_shift(2 * (uint64_t)chunk), total = job.crcs[0];
        for (int64_t c = 1; c < num_chunks; c++) {
            int64_t count = chunk_count(&job, c);
            total = crc_multiply(total, count == chunk ? whole : crc_shift(2 * (uint64_t)count)) ^
                    job.crcs[c];
        }
        *crc = total;
        free(job.crcs);
    }
    return bad;
}
