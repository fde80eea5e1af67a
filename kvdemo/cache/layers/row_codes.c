/* A decode step's codes with a scale per row or per tensor, written as torch writes them (kvdemo.cache.layers.float8
 * `write_codes`): float8 e4m3 (the `fp8` format, TurboQuant's float8 keys) and int8 (the `int8` format).
 *
 * mode 0, e4m3 under a tensor scale: codes = e4m3(x / scale), transformers' `(x.float() / scale).to(float8_e4m3fn)`
 *   (the engines' clamp to +-448 first changes nothing: the conversion saturates there);
 * mode 1, e4m3 per row (vLLM's `fp8_per_token_head`): scale = max(amax / 448, 1e-6), codes = e4m3(x * (1 / scale))
 *   clamped to +-448;
 * mode 2, int8 per row (vLLM's `int8_per_token_head`): scale = max(amax / 127, 1e-6), codes = round(x * (1 / scale)),
 *   half to even, clamped to [-128, 127].
 * The e4m3 conversion is torch's (`c10::detail::fp8e4m3fn_from_fp32_value`, torch 2.13: round to nearest even,
 * saturating at 448, NaN to 0x7f). amax propagates NaN as torch's `amax` does. IEEE arithmetic (no fast-math): each
 * step rounds as torch's separate operations do.
 *
 * x: rows of `dim` floats; codes: row r at codes + r * code_stride bytes; scales (modes 1, 2): one float32 per row
 * at scales + r * scale_stride floats; scale (mode 0): the tensor's. Returns how many float8 codes it wrote as NaN
 * (0x7f, 0xff: a NaN state), or -1 for an unknown mode. */
#pragma GCC optimize("no-fast-math")

#include <math.h>
#include <stdint.h>
#include <string.h>

static uint8_t e4m3(float f) {
    const uint32_t fp8_max = UINT32_C(1087) << 20, denorm_mask = UINT32_C(141) << 23;
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    const uint32_t sign = bits & UINT32_C(0x80000000);
    uint8_t result;
    bits ^= sign;
    if (bits >= fp8_max) {
        result = bits > UINT32_C(0x7f800000) ? 0x7f : 0x7e;
    } else if (bits < (UINT32_C(121) << 23)) { /* below 2^-6: a subnormal code, rounded by a float addition */
        float value, magic;
        memcpy(&value, &bits, sizeof value);
        memcpy(&magic, &denorm_mask, sizeof magic);
        value += magic;
        memcpy(&bits, &value, sizeof bits);
        result = (uint8_t)(bits - denorm_mask);
    } else {
        const uint32_t odd = (bits >> 20) & 1;
        bits += ((uint32_t)(7 - 127) << 23) + 0x7ffff;
        bits += odd;
        result = (uint8_t)(bits >> 20);
        if (result == 0x7f) result = 0x7e;
    }
    return result | (uint8_t)(sign >> 24);
}

static float row_amax(const float *x, int64_t dim) {
    float top = 0.0f;
    for (int64_t k = 0; k < dim; k++) {
        const float a = fabsf(x[k]);
        if (a > top || isnan(a)) top = a;
        if (isnan(top)) break;
    }
    return top;
}

int write_codes(int mode, const float *x, int64_t rows, int64_t dim, uint8_t *codes, int64_t code_stride,
                float *scales, int64_t scale_stride, const float *scale) {
    if (mode < 0 || mode > 2) return -1;
    int nan_codes = 0;
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * dim;
        uint8_t *out = codes + r * code_stride;
        if (mode == 0) {
            for (int64_t k = 0; k < dim; k++) {
                out[k] = e4m3(xr[k] / scale[0]);
                nan_codes += (out[k] & 0x7f) == 0x7f;
            }
            continue;
        }
        const float top = mode == 1 ? 448.0f : 127.0f;
        float s = row_amax(xr, dim) / top;
        s = s < 1e-6f ? 1e-6f : s;
        scales[r * scale_stride] = s;
        const float inverse = 1.0f / s;
        for (int64_t k = 0; k < dim; k++) {
            float v = xr[k] * inverse;
            if (mode == 1) {
                v = v < -top ? -top : (v > top ? top : v);
                out[k] = e4m3(v);
                nan_codes += (out[k] & 0x7f) == 0x7f;
            } else {
                v = nearbyintf(v);
                v = v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v);
                out[k] = (uint8_t)(int8_t)v;
            }
        }
    }
    return nan_codes;
}

/* e4m3 code -> its value (exact in float32; 0x7f and 0xff NaN) */
static float e4m3_value(uint8_t code) {
    const int exponent = (code >> 3) & 0x0f, mantissa = code & 7;
    if (exponent == 0x0f && mantissa == 7) return NAN;
    const float magnitude = exponent ? ldexpf(1.0f + mantissa / 8.0f, exponent - 7) : ldexpf((float)mantissa, -9);
    return code & 0x80 ? -magnitude : magnitude;
}

/* the nearest E2M1 code of a value within +-6, ties to the even code, the sign bit from the value's sign */
static uint8_t e2m1(float v) {
    const float m = fabsf(v);
    const uint8_t code = (uint8_t)((m > 0.25f) + (m >= 0.75f) + (m > 1.25f) + (m >= 1.75f) + (m > 2.5f) + (m >= 3.5f) +
                                   (m > 5.0f));
    return code | (signbit(v) ? 8 : 0);
}

/* NVFP4 blocks with the max/6 rule (kvdemo.cache.formats.nvfp4.blocks.quantize_nvfp4, torchao's arithmetic): per
 * block of 16 values the e4m3 scale of clamp(amax / 6 / tensor_scale, 2^-6, 448), codes of x * ((1 / tensor_scale) /
 * scale) clamped to +-6, two a byte (the even value low). Rows of `dim` floats; codes dim / 2 bytes a row, block scales
 * dim / 16 a row. Returns 0, or -1 where dim is not a multiple of 16. */
int write_nvfp4(const float *x, int64_t rows, int64_t dim, uint8_t *codes, uint8_t *block_scales,
                const float *tensor_scale) {
    if (dim % 16) return -1;
    const float inverse = 1.0f / tensor_scale[0];
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < dim / 16; b++) {
            const float *xb = x + r * dim + b * 16;
            float amax = 0.0f;
            for (int k = 0; k < 16; k++) {
                const float a = fabsf(xb[k]);
                if (a > amax || isnan(a)) amax = a;
                if (isnan(amax)) break;
            }
            float s = amax / 6.0f / tensor_scale[0];
            if (!isnan(s)) s = s < 0.015625f ? 0.015625f : (s > 448.0f ? 448.0f : s);
            const uint8_t scale_code = e4m3(s);
            block_scales[r * (dim / 16) + b] = scale_code;
            const float reciprocal = inverse / e4m3_value(scale_code);
            uint8_t *out = codes + r * (dim / 2) + b * 8;
            for (int k = 0; k < 16; k += 2) {
                float v0 = xb[k] * reciprocal, v1 = xb[k + 1] * reciprocal;
                if (!isnan(v0)) v0 = v0 < -6.0f ? -6.0f : (v0 > 6.0f ? 6.0f : v0);
                if (!isnan(v1)) v1 = v1 < -6.0f ? -6.0f : (v1 > 6.0f ? 6.0f : v1);
                out[k / 2] = (uint8_t)(e2m1(v0) | (e2m1(v1) << 4));
            }
        }
    return 0;
}
