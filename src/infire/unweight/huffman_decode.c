/*
 * Unweight: parallel decoding of a chunked canonical-Huffman bit stream (huffman.py).
 *
 * The stream is MSB-first; chunk c starts at bit offsets[c] and holds `chunk` symbols
 * (the last one fewer). Every code is at most 12 bits, so one 4096-entry table lookup of
 * the next 12 bits gives the symbol and its length; a length of 0 marks a bit pattern that
 * is no code (a corrupted stream). Chunks decode independently, one per OpenMP iteration.
 * ends[c] receives the bit position after the chunk's last symbol, which the caller
 * compares with offsets[c + 1]. A chunk never reads past total_bits; the stream must be
 * followed by 3 readable bytes. Returns 1 when some chunk met an invalid code.
 */
#include <stdint.h>

#define PEEK_BITS 12

static inline __attribute__((always_inline)) int decode_impl(
    const uint8_t *stream, uint64_t total_bits, const uint64_t *offsets, int64_t num_chunks,
    int64_t chunk, int64_t n, const uint8_t *table_symbol, const uint8_t *table_length,
    const uint8_t *rest, void *out, uint64_t *ends, const int bf16) {
    int bad = 0;
#pragma omp parallel for schedule(dynamic, 16) reduction(| : bad)
    for (int64_t c = 0; c < num_chunks; c++) {
        uint64_t pos = offsets[c];
        int64_t first = c * chunk, count = n - first < chunk ? n - first : chunk;
        for (int64_t i = 0; i < count; i++) {
            const uint8_t *p = stream + (pos >> 3);
            uint32_t window = ((uint32_t)p[0] << 16) | ((uint32_t)p[1] << 8) | p[2];
            uint32_t peek = (window >> (24 - PEEK_BITS - (pos & 7))) & ((1u << PEEK_BITS) - 1);
            uint8_t length = table_length[peek];
            if (length == 0 || pos + length > total_bits) {
                bad = 1;
                break;
            }
            if (bf16) {
                uint16_t r = rest[first + i];
                ((uint16_t *)out)[first + i] =
                    (uint16_t)((r & 0x80) << 8) | (uint16_t)(table_symbol[peek] << 7) | (r & 0x7F);
            } else {
                ((uint8_t *)out)[first + i] = table_symbol[peek];
            }
            pos += length;
        }
        ends[c] = pos;
    }
    return bad;
}

/* The symbols (exponents) into out[n]. */
int unweight_huffman_decode(const uint8_t *stream, uint64_t total_bits,
                            const uint64_t *offsets, int64_t num_chunks, int64_t chunk,
                            int64_t n, const uint8_t *table_symbol,
                            const uint8_t *table_length, uint8_t *out, uint64_t *ends) {
    return decode_impl(stream, total_bits, offsets, num_chunks, chunk, n, table_symbol,
                       table_length, 0, out, ends, 0);
}

/* BF16 weights rebuilt at once: out[i] = (rest & 0x80) << 8 | exponent << 7 | rest & 0x7F. */
int unweight_huffman_decode_bf16(const uint8_t *stream, uint64_t total_bits,
                                 const uint64_t *offsets, int64_t num_chunks, int64_t chunk,
                                 int64_t n, const uint8_t *table_symbol,
                                 const uint8_t *table_length, const uint8_t *rest,
                                 uint16_t *out, uint64_t *ends) {
    return decode_impl(stream, total_bits, offsets, num_chunks, chunk, n, table_symbol,
                       table_length, rest, out, ends, 1);
}
