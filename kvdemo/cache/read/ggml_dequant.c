/* ggml's block de-quantization for the `ggml` backend's decode steps (kvdemo.cache.formats.ggml.blocks).
 *
 * The same arithmetic as ggml's `dequantize_row_q8_0` and the others (ggml-quants.c, llama.cpp commit 0c1e570):
 * each block of 32 values is the float16 scale d (and the float16 minimum m of the _1 types) times the codes, in
 * float32: x = d * q (q8_0), d * (q - 8) (q4_0), d * (q - 16) (q5_0), d * q + m (q4_1, q5_1), d * kvalues[q]
 * (iq4_nl). Code j of a block sits in the low nibble of byte j of qs and code j + 16 in the high one; bit j of the
 * little-endian qh is code j's fifth bit. One pass over the rows, shared among `threads` OpenMP threads (torch's own
 * libgomp in a process that imported torch): each row by one thread, so the result does not depend on `threads`.
 * Compiled without fused multiply-add (`kvdemo.cache.read.c_build.FLAGS`), so d * q + m rounds as torch's two operations.
 *
 * rows: n_rows x (width / 32) blocks of `block_bytes` bytes; out: n_rows x width floats. Returns 0, or -1 for a type
 * it does not know. */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#if defined(__F16C__)
    return _cvtsh_ss(h); /* the same value for every float16 but a NaN's payload, in one instruction */
#endif
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            exponent = 127 - 15 + 1;
            while (!(mantissa & 0x400)) {
                mantissa <<= 1;
                exponent--;
            }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000 | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 127 - 15) << 23) | (mantissa << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof(out));
    return out;
}

static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static const int GGML_BLOCK_BYTES[6] = {34, 18, 20, 22, 24, 18};

/* one block of 32 values of `type` (0 q8_0, 1 q4_0, 2 q4_1, 3 q5_0, 4 q5_1, 5 iq4_nl) at x, into y; also read by the
 * decode kernel over the stored codes (code_attention.c includes this file) */
static void ggml_dequantize_block(int type, const uint8_t *x, float *y) {
    const float d = half_to_float(x);
    if (type == 0) {
        const int8_t *qs = (const int8_t *)(x + 2);
        for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
    } else if (type == 1 || type == 5) {
        const uint8_t *qs = x + 2;
        for (int j = 0; j < 16; j++) {
            const int lo = qs[j] & 0x0f, hi = qs[j] >> 4;
            y[j] = (float)(type == 1 ? lo - 8 : KVALUES_IQ4NL[lo]) * d;
            y[j + 16] = (float)(type == 1 ? hi - 8 : KVALUES_IQ4NL[hi]) * d;
        }
    } else if (type == 2) {
        const float m = half_to_float(x + 2);
        const uint8_t *qs = x + 4;
        for (int j = 0; j < 16; j++) {
            y[j] = (float)(qs[j] & 0x0f) * d + m;
            y[j + 16] = (float)(qs[j] >> 4) * d + m;
        }
    } else {
        const int affine = type == 4;
        const float m = affine ? half_to_float(x + 2) : 0.0f;
        const uint8_t *qh_bytes = x + (affine ? 4 : 2), *qs = qh_bytes + 4;
        const uint32_t qh = (uint32_t)qh_bytes[0] | ((uint32_t)qh_bytes[1] << 8) | ((uint32_t)qh_bytes[2] << 16) |
                            ((uint32_t)qh_bytes[3] << 24);
        for (int j = 0; j < 16; j++) {
            const int lo = (qs[j] & 0x0f) | (((qh >> j) & 1) << 4);
            const int hi = (qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
            if (affine) {
                y[j] = (float)lo * d + m;
                y[j + 16] = (float)hi * d + m;
            } else {
                y[j] = (float)(lo - 16) * d;
                y[j + 16] = (float)(hi - 16) * d;
            }
        }
    }
}

/* type: 0 q8_0, 1 q4_0, 2 q4_1, 3 q5_0, 4 q5_1, 5 iq4_nl */
int ggml_dequantize(int type, const uint8_t *rows, float *out, long n_rows, long width, int threads) {
    if (type < 0 || type > 5) return -1;
    const long blocks = width / 32, row_bytes = blocks * GGML_BLOCK_BYTES[type];
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long r = 0; r < n_rows; r++)
        for (long b = 0; b < blocks; b++)
            ggml_dequantize_block(type, rows + r * row_bytes + b * GGML_BLOCK_BYTES[type], out + r * width + b * 32);
    return 0;
}
