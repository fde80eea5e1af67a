/* Decode attention over a quantized store's codes (kvdemo.cache.read.code_attention): the store is never
 * de-quantized whole. Each thread takes a range of one KV head's tokens and walks it in tiles of TILE tokens: it
 * de-quantizes the tile's keys into a buffer on its stack (the library's own formula, operation for operation, so
 * every key equals the library's de-quantized key bit for bit), scores the tile for every query row that shares the
 * head, updates the running maximum and sum of the softmax (FlashAttention's rescaling, Dao et al. 2022,
 * arXiv:2205.14135), de-quantizes the tile's values the same way and adds them in. The ranges of a head are merged by
 * their log-sum-exp (Flash-Decoding's split-KV reduction). At most one tile of keys and one of values exist in float
 * per thread.
 *
 * Store formats (the `Codes` descriptor, filled by the Python side):
 *   kind 0, affine: optimum-quanto's and hqq's group-wise integer codes. The store is a matrix [rows, cols] (the
 *     tensor's flat index e = row * cols + col, as the libraries reshape it), packed along its rows into `step` rows
 *     of words (uint8, or int32 for hqq's 3-bit): row j's code sits in word row j % step at bit
 *     shift0 + shift_step * (j / step). A group is a row (`by_row`) or a column; per group a float32 scale and zero:
 *     quanto x = code * scale - zero (its shift), hqq x = (code - zero) * scale (zero_first).
 *   kind 1, lookup: TurboQuant's keys, one row of head_dim codes per token and head, `bits` bits each packed densely
 *     (code k at bit k * bits of the row, little-endian), x = table[code] * norm (the row's float16 or float32 norm);
 *     with `unit`, the row's table values divided by their Euclidean norm first, x = (table[code] / |c|) * norm with
 *     |c| = sqrt(sum of table[code]^2 + 1e-16) (vLLM's `_nc` keys; the sum in this loop's order).
 *   kind 2, uniform: TurboQuant's values, the same packing, x = code * scale + zero (per row).
 *   kind 3, float: float32 rows as they are (the full-precision residual, read with the store in one call).
 *   kind 4, ggml: llama.cpp's blocks of 32 values, type `bits` (ggml_dequant.c's numbers), row_bytes per row.
 *   kind 5, half: float16 rows (llama.cpp's f16 cache type).
 *   kind 6, scaled: one code per value, `bits` 8 (a byte each) or 4 (two a byte, the even value in the low nibble),
 *     row_bytes per row; a code's value is table[code] (float8 e4m3/e5m2, int8, E2M1: exact in float32), times a
 *     scale: the row's float32 (`row_scale`: fp8 and int8 per token and head), or per block of `cols` values the
 *     block's uint8 code (`zero`, its value from the table `row_zero`: NVFP4's e4m3 block scales) times the tensor's
 *     float32 scale (`scale`), or the tensor's scale alone (fp8 per tensor); 1 where no scale is given. `shift0` says
 *     how a byte's value is found: 0 the table, 1 e4m3 by placing its bits in a float32 (vectorised; exact, as
 *     kvdemo.cache.layers.float8 places them; NaN codes blended in), 2 int8 by conversion.
 * Compiled without fused multiply-add (kvdemo.cache.read.c_build.FLAGS), so each de-quantization step rounds as torch's
 * operations do. The scores and the sums (`dot`, `add_weighted`: AVX2 fused multiply-adds where the CPU has them) are
 * float32 in another order than torch's kernel: the bound is in the module docstring. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

#include "ggml_dequant.c" /* ggml_dequantize_block, half_to_float: llama.cpp's blocks, as the ggml backend reads them */

#define TILE 32
#define MAX_DIM 256
#define MAX_ROWS 64

typedef struct { /* every field an int64_t, pointers included (the Python side fills one int64 row per store) */
    int64_t kind, bits, codes, word_bytes, shift0, shift_step, by_row, zero_first, half, rows, cols, step, row_bytes;
    int64_t scale, zero, table, row_scale, row_zero, tokens;
    int64_t first, stride; /* the tokens read are [first, first + tokens) of each head's `stride` stored (0: tokens) */
    int64_t unit;          /* kind 1: each row's table values divided by their norm first (vLLM's `_nc` keys) */
} Codes;

/* the storage row of token t of head `head` in a store */
static int64_t store_row(const Codes *c, int64_t head, int64_t t) {
    return head * (c->stride ? c->stride : c->tokens) + c->first + t;
}

#define PTR(type, field) ((const type *)(intptr_t)(field))

static float row_value(int64_t values, int64_t half, int64_t row) {
#if defined(__F16C__)
    if (half) return _cvtsh_ss(PTR(uint16_t, values)[row]); /* the same conversion, exact, in one instruction */
#endif
    return half ? half_to_float((const uint8_t *)(PTR(uint16_t, values) + row)) : PTR(float, values)[row];
}

/* affine codes: n elements from flat index e0 into out */
static void affine(const Codes *c, int64_t e0, int64_t n, float *out) {
    const uint32_t mask = (1u << c->bits) - 1;
    for (int64_t e = e0, end = e0 + n; e < end;) {
        const int64_t j = e / c->cols, col = e % c->cols;
        const int64_t len = (c->cols - col < end - e) ? c->cols - col : end - e;
        const int shift = c->shift0 + c->shift_step * (int)(j / c->step);
        const int64_t word = (j % c->step) * c->cols + col;
        float *o = out + (e - e0);
        if (c->word_bytes == 1) {
            const uint8_t *w = PTR(uint8_t, c->codes) + word;
            if (c->by_row) {
                const float s = PTR(float, c->scale)[j], z = PTR(float, c->zero)[j];
                if (c->zero_first)
                    for (int64_t k = 0; k < len; k++) o[k] = ((float)((w[k] >> shift) & mask) - z) * s;
                else
                    for (int64_t k = 0; k < len; k++) o[k] = (float)((w[k] >> shift) & mask) * s - z;
            } else {
                const float *s = PTR(float, c->scale) + col, *z = PTR(float, c->zero) + col;
                if (c->zero_first)
                    for (int64_t k = 0; k < len; k++) o[k] = ((float)((w[k] >> shift) & mask) - z[k]) * s[k];
                else
                    for (int64_t k = 0; k < len; k++) o[k] = (float)((w[k] >> shift) & mask) * s[k] - z[k];
            }
        } else {
            const uint32_t *w = PTR(uint32_t, c->codes) + word;
            const float *scale = PTR(float, c->scale), *zero = PTR(float, c->zero);
            for (int64_t k = 0; k < len; k++) {
                const int64_t g = c->by_row ? j : col + k;
                const float code = (float)((w[k] >> shift) & mask);
                o[k] = c->zero_first ? (code - zero[g]) * scale[g] : code * scale[g] - zero[g];
            }
        }
        e += len;
    }
}

/* one row's dim codes of `bits` bits (packed densely, little-endian) as bytes */
static void expand(const uint8_t *bytes, int64_t dim, int64_t bits, uint8_t *codes) {
    const uint32_t mask = (1u << bits) - 1;
    int64_t k = 0;
    if (bits == 4) {
#if defined(__AVX2__)
        const __m128i low = _mm_set1_epi8(0x0f);
        for (; k + 16 <= dim; k += 16) { /* 8 bytes -> 16 codes: byte b holds code 2b (low nibble), 2b + 1 */
            const __m128i packed = _mm_loadl_epi64((const __m128i *)(bytes + k / 2));
            const __m128i lo = _mm_and_si128(packed, low), hi = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
            _mm_storeu_si128((__m128i *)(codes + k), _mm_unpacklo_epi8(lo, hi));
        }
#endif
        for (; k < dim; k += 2) {
            codes[k] = bytes[k / 2] & 0x0f;
            codes[k + 1] = bytes[k / 2] >> 4;
        }
    } else if (8 % bits == 0) {
        const int64_t per = 8 / bits;
        for (; k < dim; k++) codes[k] = (uint8_t)((bytes[k / per] >> ((k % per) * bits)) & mask);
    } else if (bits == 3 && dim % 8 == 0) { /* 8 codes in each 3 bytes */
        for (; k < dim; k += 8) {
            const uint8_t *b = bytes + k / 8 * 3;
            const uint32_t word = (uint32_t)b[0] | ((uint32_t)b[1] << 8) | ((uint32_t)b[2] << 16);
            for (int i = 0; i < 8; i++) codes[k + i] = (uint8_t)((word >> (3 * i)) & 7);
        }
    } else {
        for (; k < dim; k++) {
            const int64_t bit = k * bits, at = bit >> 3;
            uint32_t word = bytes[at];
            if ((bit & 7) + bits > 8) word |= (uint32_t)bytes[at + 1] << 8;
            codes[k] = (uint8_t)((word >> (bit & 7)) & mask);
        }
    }
}

/* lookup and uniform codes: n rows (head_dim values each) from row r0 into out */
static void packed_rows(const Codes *c, int64_t r0, int64_t n, int64_t dim, float *out) {
    const float *table = PTR(float, c->table);
    const int64_t bits = c->bits;
#if defined(__AVX2__)
    __m256 table_lo = _mm256_setzero_ps(), table_hi = _mm256_setzero_ps();
    if (c->kind == 1) { /* the 2^bits levels in two registers of 8 (zeros past the table's end) */
        float padded[16] = {0};
        for (int i = 0; i < (1 << bits); i++) padded[i] = table[i];
        table_lo = _mm256_loadu_ps(padded);
        table_hi = _mm256_loadu_ps(padded + 8);
    }
    /* 8 codes of `bits` bits fill `bits` bytes: one 32-bit word, each lane shifted to its code */
    const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32((int)bits));
    const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
#endif
    for (int64_t r = r0; r < r0 + n; r++) {
        const uint8_t *bytes = PTR(uint8_t, c->codes) + r * c->row_bytes;
        float *o = out + (r - r0) * dim;
        /* vLLM's _nc rows: the centroids first (times 1, exact), their squares summed, then (c / |c|) * norm, each
         * step rounded as torch's separate operations round it (the sum in this loop's order) */
        const int unit = c->kind == 1 && c->unit;
        const float norm = row_value(c->row_scale, c->half, r), s = unit ? 1.0f : norm;
        float squares = 0.0f;
        const float z = c->kind == 1 ? 0.0f : row_value(c->row_zero, c->half, r);
        int64_t k = 0;
#if defined(__AVX2__)
        __m256 sum8 = _mm256_setzero_ps();
        const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
        for (; k + 8 <= dim; k += 8) {
            __m256i index;
            if (bits == 8) {
                index = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + k)));
            } else {
                const int64_t at = k / 8 * bits;
                uint32_t word = 0;
                if (at + 4 <= c->row_bytes)
                    memcpy(&word, bytes + at, 4); /* little-endian; a 3-byte group's fourth byte is masked off */
                else
                    for (int64_t i = 0; i < bits; i++) word |= (uint32_t)bytes[at + i] << (8 * i);
                index = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)word), shifts), mask);
            }
            __m256 x;
            if (c->kind == 1) { /* table[code]: bit 3 of the code picks the register */
                const __m256 a = _mm256_permutevar8x32_ps(table_lo, index);
                const __m256 b = _mm256_permutevar8x32_ps(table_hi, index);
                x = _mm256_mul_ps(_mm256_blendv_ps(a, b, _mm256_castsi256_ps(_mm256_slli_epi32(index, 28))), vs);
                if (unit) sum8 = _mm256_add_ps(sum8, _mm256_mul_ps(x, x));
            } else {
                x = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(index), vs), vz);
            }
            _mm256_storeu_ps(o + k, x);
        }
        if (unit) {
            float lanes[8];
            _mm256_storeu_ps(lanes, sum8);
            for (int i = 0; i < 8; i++) squares += lanes[i];
        }
#endif
        if (k < dim) {
            uint8_t codes[MAX_DIM];
            expand(bytes, dim, bits, codes);
            for (; k < dim; k++) {
                o[k] = c->kind == 1 ? table[codes[k]] * s : (float)codes[k] * s + z;
                if (unit) squares += o[k] * o[k];
            }
        }
        if (unit) {
            const float length = sqrtf(squares + 1e-16f);
            for (int64_t i = 0; i < dim; i++) o[i] = (o[i] / length) * norm;
        }
    }
}

/* whether x is neither infinite nor NaN, read from its bits: the kernel is compiled with -ffast-math, under which the
 * compiler may assume every float finite and fold isfinite() away; an integer test it cannot fold */
static int finite_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    return (bits & 0x7f800000u) != 0x7f800000u;
}

/* scaled codes: n rows (head_dim values each) from row r0 into out, as the formats' `codes.float() * scale` and
 * NVFP4's `E2M1[code] * (float(block_scale) * tensor_scale)` round: one product per value */
static void scaled_rows(const Codes *c, int64_t r0, int64_t n, int64_t dim, float *out) {
    const float *table = PTR(float, c->table);
    const float tensor = c->scale ? PTR(float, c->scale)[0] : 1.0f;
    for (int64_t r = r0; r < r0 + n; r++) {
        const uint8_t *bytes = PTR(uint8_t, c->codes) + r * c->row_bytes;
        float *o = out + (r - r0) * dim;
        if (c->cols) { /* a scale per block of cols values (cols even) */
            const uint8_t *blocks = PTR(uint8_t, c->zero) + r * (dim / c->cols);
            const float *block_table = PTR(float, c->row_zero);
            for (int64_t b = 0; b < dim / c->cols; b++) {
                const float s = block_table[blocks[b]] * tensor;
                float *ob = o + b * c->cols;
                if (c->bits == 4) {
                    const uint8_t *w = bytes + b * c->cols / 2;
                    for (int64_t k = 0; k < c->cols / 2; k++) {
                        ob[2 * k] = table[w[k] & 0x0f] * s;
                        ob[2 * k + 1] = table[w[k] >> 4] * s;
                    }
                } else {
                    const uint8_t *w = bytes + b * c->cols;
                    for (int64_t k = 0; k < c->cols; k++) ob[k] = table[w[k]] * s;
                }
            }
            continue;
        }
        const float s = c->row_scale ? PTR(float, c->row_scale)[r] : tensor;
        if (c->shift0 == 2) { /* int8: the code converted, times the scale */
            const int8_t *q = (const int8_t *)bytes;
            for (int64_t k = 0; k < dim; k++) o[k] = (float)q[k] * s;
            continue;
        }
        const float placed = s * 0x1p120f; /* 2^(127 - 7) x s: exact where finite (a power of two times s) */
        if (c->shift0 == 1 && finite_bits(placed)) { /* e4m3: sign, exponent and mantissa placed in float32's fields */
            const uint32_t nan_bits = 0x7fc00000u;
            for (int64_t k = 0; k < dim; k++) {
                const uint32_t bits = ((uint32_t)(int32_t)(int8_t)bytes[k] << 20) & 0x87f00000u;
                float value, nan_value;
                memcpy(&value, &bits, sizeof value);
                memcpy(&nan_value, &nan_bits, sizeof nan_value);
                o[k] = (bytes[k] & 0x7f) == 0x7f ? nan_value : value * placed;
            }
            continue;
        }
        if (c->bits == 4)
            for (int64_t k = 0; k < dim / 2; k++) {
                o[2 * k] = table[bytes[k] & 0x0f] * s;
                o[2 * k + 1] = table[bytes[k] >> 4] * s;
            }
        else
            for (int64_t k = 0; k < dim; k++) o[k] = table[bytes[k]] * s;
    }
}

static void dequantize(const Codes *c, int64_t row, int64_t n, int64_t dim, float *out) {
    if (c->kind == 0)
        affine(c, row * dim, n * dim, out);
    else if (c->kind == 3)
        memcpy(out, PTR(float, c->codes) + row * dim, sizeof(float) * n * dim);
    else if (c->kind == 4)
        for (int64_t r = 0; r < n; r++)
            for (int64_t b = 0; b < dim / 32; b++)
                ggml_dequantize_block((int)c->bits, PTR(uint8_t, c->codes) + (row + r) * c->row_bytes + b * GGML_BLOCK_BYTES[c->bits],
                                      out + r * dim + b * 32);
    else if (c->kind == 5)
        for (int64_t k = 0; k < n * dim; k++) out[k] = row_value(c->codes, 1, row * dim + k);
    else if (c->kind == 6)
        scaled_rows(c, row, n, dim, out);
    else
        packed_rows(c, row, n, dim, out);
}

/* a . b over dim floats (fused multiply-add where the CPU has it: the scores need not round as torch's do) */
static float dot(const float *a, const float *b, int64_t dim) {
    int64_t d = 0;
    float s = 0.0f;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (; d + 16 <= dim; d += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d + 8), _mm256_loadu_ps(b + d + 8), s1);
    }
    for (; d + 8 <= dim; d += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), s0);
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(_mm256_add_ps(s0, s1)), _mm256_extractf128_ps(_mm256_add_ps(s0, s1), 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    s = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
#endif
    for (; d < dim; d++) s += a[d] * b[d];
    return s;
}

/* acc[d] += sum_i w[i] x v[i][d], for n rows of v (dim floats each) */
static void add_weighted(float *acc, const float *w, const float *v, int64_t n, int64_t dim) {
    int64_t d = 0;
#if defined(__AVX2__) && defined(__FMA__)
    for (; d + 32 <= dim; d += 32) { /* four registers of acc held over the rows */
        __m256 a0 = _mm256_loadu_ps(acc + d), a1 = _mm256_loadu_ps(acc + d + 8);
        __m256 a2 = _mm256_loadu_ps(acc + d + 16), a3 = _mm256_loadu_ps(acc + d + 24);
        for (int64_t i = 0; i < n; i++) {
            const __m256 wi = _mm256_set1_ps(w[i]);
            const float *vi = v + i * dim + d;
            a0 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vi), a0);
            a1 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vi + 8), a1);
            a2 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vi + 16), a2);
            a3 = _mm256_fmadd_ps(wi, _mm256_loadu_ps(vi + 24), a3);
        }
        _mm256_storeu_ps(acc + d, a0);
        _mm256_storeu_ps(acc + d + 8, a1);
        _mm256_storeu_ps(acc + d + 16, a2);
        _mm256_storeu_ps(acc + d + 24, a3);
    }
    for (; d + 8 <= dim; d += 8) {
        __m256 a0 = _mm256_loadu_ps(acc + d);
        for (int64_t i = 0; i < n; i++) a0 = _mm256_fmadd_ps(_mm256_set1_ps(w[i]), _mm256_loadu_ps(v + i * dim + d), a0);
        _mm256_storeu_ps(acc + d, a0);
    }
#endif
    for (; d < dim; d++)
        for (int64_t i = 0; i < n; i++) acc[d] += w[i] * v[i * dim + d];
}

/* one head's tokens [t0, t1): running maximum m, sum l and unnormalised output acc of each query row; returns 0, or 1
 * where a score is not finite (a key holding NaN or infinity: the caller hands the call to torch) */
static int attend_range(const float *q, const Codes *keys, const Codes *values, int64_t head,
                         int64_t dim, int64_t rows, float scale, int64_t t0, int64_t t1, float *m, float *l,
                         float *acc) {
    float kbuf[TILE * MAX_DIM], vbuf[TILE * MAX_DIM], p[MAX_ROWS * TILE];
    int bad = 0;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -FLT_MAX;
        l[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * rows * dim);
    for (int64_t t = t0; t < t1; t += TILE) {
        const int64_t n = t1 - t < TILE ? t1 - t : TILE;
        dequantize(keys, store_row(keys, head, t), n, dim, kbuf);
        dequantize(values, store_row(values, head, t), n, dim, vbuf);
        for (int64_t r = 0; r < rows; r++) {
            const float *qr = q + r * dim;
            float *pr = p + r * TILE, top = m[r];
            for (int64_t i = 0; i < n; i++) {
                pr[i] = dot(qr, kbuf + i * dim, dim) * scale;
                bad |= !finite_bits(pr[i]);
                top = pr[i] > top ? pr[i] : top;
            }
            const float correction = expf(m[r] - top);
            float sum = 0.0f;
            for (int64_t i = 0; i < n; i++) {
                pr[i] = expf(pr[i] - top);
                sum += pr[i];
            }
            l[r] = l[r] * correction + sum;
            m[r] = top;
            float *ar = acc + r * dim;
            for (int64_t d = 0; d < dim; d++) ar[d] *= correction;
            add_weighted(ar, pr, vbuf, n, dim);
        }
    }
    return bad;
}

/* query: [heads, rows, dim] float32 (the query rows that share each KV head; heads = batch x kv_heads);
 * stores[2b], stores[2b + 1]: block b's keys and values, [heads, stores[2b].tokens, dim]; out: [heads, rows, dim];
 * lse: [heads, rows] (natural log), over every block's tokens. Returns 0, -1 for a shape it does not take
 * (dim > MAX_DIM, rows > MAX_ROWS, no tokens), -2 where memory runs out, -3 where a score or an output is not finite
 * (a key or value holding NaN or infinity): the caller then reads the store with torch's kernel, so a broken cache
 * propagates NaN and infinity exactly as torch's attention propagates them. */
int code_attention(const float *query, const Codes *stores, int64_t blocks, int64_t heads, int64_t rows, int64_t dim,
                   float scale, float *out, float *lse, int threads) {
    int64_t total = 0;
    for (int64_t b = 0; b < blocks; b++) total += stores[2 * b].tokens;
    if (dim > MAX_DIM || rows > MAX_ROWS || dim < 1 || rows < 1 || total < 1) return -1;
    /* ranges of about total / (8 x threads / heads) tokens, whole tiles, at least 4 */
    const int64_t split = (8 * (int64_t)threads + heads - 1) / heads;
    int64_t chunk = ((total + split - 1) / split + TILE - 1) / TILE * TILE;
    if (chunk < 4 * TILE) chunk = 4 * TILE;
    int64_t ranges = 0; /* per head */
    for (int64_t b = 0; b < blocks; b++) ranges += (stores[2 * b].tokens + chunk - 1) / chunk;
    const int64_t items = heads * ranges;
    int64_t *where = malloc(sizeof(int64_t) * 3 * ranges); /* block, first token, end */
    float *m = malloc(sizeof(float) * items * rows), *l = malloc(sizeof(float) * items * rows);
    float *acc = malloc(sizeof(float) * items * rows * dim);
    if (!where || !m || !l || !acc) {
        free(where), free(m), free(l), free(acc);
        return -2;
    }
    for (int64_t b = 0, at = 0; b < blocks; b++)
        for (int64_t t = 0, end = stores[2 * b].tokens; t < end; t += chunk, at++) {
            where[3 * at] = b;
            where[3 * at + 1] = t;
            where[3 * at + 2] = t + chunk < end ? t + chunk : end;
        }
    int bad = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic) reduction(| : bad)
    for (int64_t item = 0; item < items; item++) {
        const int64_t head = item / ranges, *range = where + 3 * (item % ranges), b = range[0];
        bad |= attend_range(query + head * rows * dim, stores + 2 * b, stores + 2 * b + 1, head, dim,
                     rows, scale, range[1], range[2], m + item * rows, l + item * rows, acc + item * rows * dim);
    }
    for (int64_t head = 0; head < heads; head++) {
        for (int64_t r = 0; r < rows; r++) {
            float top = -FLT_MAX, sum = 0.0f;
            for (int64_t i = head * ranges; i < (head + 1) * ranges; i++) top = m[i * rows + r] > top ? m[i * rows + r] : top;
            float *o = out + (head * rows + r) * dim;
            memset(o, 0, sizeof(float) * dim);
            for (int64_t i = head * ranges; i < (head + 1) * ranges; i++) {
                const float w = expf(m[i * rows + r] - top);
                const float *a = acc + (i * rows + r) * dim;
                sum += l[i * rows + r] * w;
                for (int64_t d = 0; d < dim; d++) o[d] += a[d] * w;
            }
            for (int64_t d = 0; d < dim; d++) {
                o[d] /= sum;
                bad |= !finite_bits(o[d]);
            }
            lse[head * rows + r] = top + logf(sum);
        }
    }
    free(where), free(m), free(l), free(acc);
    return bad ? -3 : 0;
}

/* rows [row0, row0 + n) of a store ([heads x tokens, dim]) de-quantized into out ([n, dim]), as the attention's tiles
 * are: what the tests compare with the library's own de-quantization, bit for bit. Returns 0, or -1 for dim > MAX_DIM. */
int code_dequantize(const Codes *codes, int64_t row0, int64_t n, int64_t dim, float *out) {
    if (dim > MAX_DIM || dim < 1) return -1;
    for (int64_t r = 0; r < n; r += TILE) dequantize(codes, row0 + r, n - r < TILE ? n - r : TILE, dim, out + r * dim);
    return 0;
}
