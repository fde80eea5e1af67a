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
