/* ggml's reference block quantizers for the `ggml` backend's decode steps (kvdemo.cache.formats.ggml.blocks).
 *
 * The arithmetic of `quantize_row_q8_0_ref`, `_q4_0_ref`, `_q4_1_ref`, `_q5_0_ref`, `_q5_1_ref` and `_iq4_nl_ref`
 * (ggml-quants.c, llama.cpp commit 0c1e570), operation for operation, which `blocks.quantize_rows` writes in torch
 * operations (checked against gguf's reference quantizers in tests/test_ggml.py, and this file against it, byte for
 * byte): a block of 32 float32 values, a scale d (and for the _1 types the minimum m) stored as float16 rounded to
 * nearest even, codes from x * (1 / d). Code j of a block goes to the low nibble of byte j of qs, code j + 16 to the
 * high one; bit j of the little-endian qh is code j's fifth bit. Compiled without fused multiply-add
 * (`kvdemo.cache.read.c_build.FLAGS`), so the iq4_nl scale's float32 sums round as the reference's loop.
 *
 * x: rows of `width` floats, row r at x + r * width; out: row r's blocks at out + r * out_stride bytes. Returns 0, or
 * -1 for a type it does not know. */
/* IEEE arithmetic for this file: the reference keeps the first of equal values, a zero's sign included, and its scale
 * from x - min; under -ffast-math (c_build's flags, for the decode kernel's vector expf) the compiler may treat -0 and
 * +0 alike and reorder the sums. */
#pragma GCC optimize("no-fast-math")

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

static const int8_t KVALUES_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static const int BLOCK_BYTES[6] = {34, 18, 20, 22, 24, 18}; /* q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl */

#define GROUP_MAX_EPS 1e-15f

/* float32 -> float16, round to nearest even (GGML_FP32_TO_FP16; torch's and numpy's conversion) */
static void put_half(uint8_t *p, float f) {
#if defined(__F16C__)
    const uint16_t h = _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    const _Float16 half = (_Float16)f; /* IEEE round to nearest even (GCC 12+, x86-64 and AArch64) */
    uint16_t h;
    memcpy(&h, &half, sizeof h);
#endif
    p[0] = (uint8_t)(h & 0xff);
    p[1] = (uint8_t)(h >> 8);
}

/* ggml's `best_index_int8`: the nearest of the 16 values (the lower one of a tie) */
static int best_index(float x) {
    if (x <= KVALUES_IQ4NL[0]) return 0;
    if (x >= KVALUES_IQ4NL[15]) return 15;
    int ml = 0, mu = 15;
    while (mu - ml > 1) {
        const int mav = (ml + mu) / 2;
        if (x < KVALUES_IQ4NL[mav]) mu = mav;
        else ml = mav;
    }
    return x - KVALUES_IQ4NL[mu - 1] < KVALUES_IQ4NL[mu] - x ? mu - 1 : mu;
}

static void block_q8_0(const float *x, uint8_t *y) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++) amax = amax < fabsf(x[j]) ? fabsf(x[j]) : amax;
    const float d = amax / 127, id = d ? 1.0f / d : 0.0f;
    put_half(y, d);
    for (int j = 0; j < 32; j++) y[2 + j] = (uint8_t)(int8_t)roundf(x[j] * id);
}

/* q4_0 (levels 8) and q5_0 (levels 16): d = max / -levels, max the value of largest magnitude (the first of ties) */
static void block_symmetric(const float *x, uint8_t *y, int levels) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; j++)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    const float d = max / -levels, id = d ? 1.0f / d : 0.0f, offset = levels + 0.5f;
    const int top = 2 * levels - 1;
    put_half(y, d);
    uint8_t *qs = y + (levels == 16 ? 6 : 2);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        int xi0 = (int8_t)(x[j] * id + offset), xi1 = (int8_t)(x[16 + j] * id + offset);
        xi0 = xi0 < top ? xi0 : top;
        xi1 = xi1 < top ? xi1 : top;
        qs[j] = (uint8_t)((xi0 & 0x0f) | ((xi1 & 0x0f) << 4));
        qh |= ((uint32_t)(xi0 & 0x10) >> 4) << j;
        qh |= ((uint32_t)(xi1 & 0x10) >> 4) << (j + 16);
    }
    if (levels == 16) memcpy(y + 2, &qh, 4); /* little-endian, as ggml's memcpy on the CPUs it runs on */
}

/* q4_1 (levels 15) and q5_1 (levels 31): d = (max - min) / levels, m = min (the first of equal values) */
static void block_affine(const float *x, uint8_t *y, int levels) {
    float min = x[0], max = x[0];
    for (int j = 1; j < 32; j++) {
        if (x[j] < min) min = x[j];
        if (x[j] > max) max = x[j];
    }
    const float d = (max - min) / levels, id = d ? 1.0f / d : 0.0f;
    put_half(y, d);
    put_half(y + 2, min);
    uint8_t *qs = y + (levels == 31 ? 8 : 4);
    uint32_t qh = 0;
    for (int j = 0; j < 16; j++) {
        int xi0 = (int8_t)((x[j] - min) * id + 0.5f), xi1 = (int8_t)((x[16 + j] - min) * id + 0.5f);
        xi0 = xi0 < levels ? xi0 : levels;
        xi1 = xi1 < levels ? xi1 : levels;
        qs[j] = (uint8_t)((xi0 & 0x0f) | ((xi1 & 0x0f) << 4));
        qh |= ((uint32_t)(xi0 & 0x10) >> 4) << j;
        qh |= ((uint32_t)(xi1 & 0x10) >> 4) << (j + 16);
    }
    if (levels == 31) memcpy(y + 4, &qh, 4);
}

/* iq4_nl with no search (ntry = -1): d0 = max / -127, each code the nearest value to x / d0, then the least-squares
 * scale d = sum(w q x) / sum(w q^2), w = x^2, summed in float32 in the loop's order */
static void block_iq4_nl(const float *x, uint8_t *y) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < 32; j++)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    uint8_t codes[32] = {0};
    float d = 0.0f;
    if (amax >= GROUP_MAX_EPS) {
        const float id = 1.0f / (max / KVALUES_IQ4NL[0]);
        float sum_qx = 0.0f, sum_q2 = 0.0f;
        for (int j = 0; j < 32; j++) {
            codes[j] = (uint8_t)best_index(x[j] * id);
            const float w = x[j] * x[j], q = KVALUES_IQ4NL[codes[j]];
            sum_qx += w * q * x[j];
            sum_q2 += w * q * q;
        }
        d = sum_q2 > 0 ? sum_qx / sum_q2 : 0.0f;
    }
    put_half(y, d);
    for (int j = 0; j < 16; j++) y[2 + j] = (uint8_t)(codes[j] | (codes[16 + j] << 4));
}

int ggml_quantize(int type, const float *x, uint8_t *out, int64_t rows, int64_t width, int64_t out_stride) {
    if (type < 0 || type > 5 || width % 32) return -1;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < width / 32; b++) {
            const float *xb = x + r * width + b * 32;
            uint8_t *yb = out + r * out_stride + b * BLOCK_BYTES[type];
            if (type == 0) block_q8_0(xb, yb);
            else if (type == 1) block_symmetric(xb, yb, 8);
            else if (type == 2) block_affine(xb, yb, 15);
            else if (type == 3) block_symmetric(xb, yb, 16);
            else if (type == 4) block_affine(xb, yb, 31);
            else block_iq4_nl(xb, yb);
        }
    return 0;
}
