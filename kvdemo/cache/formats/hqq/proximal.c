/* hqq's proximal solver of zero points, fused into one pass per iteration (kvdemo.cache.formats.hqq.optimize).
 *
 * The same iterations as hqq 0.2.8's `optimize_weights_proximal_legacy` (hqq/core/optimize.py; HQQ, Badri and
 * Shaji 2023), for the groups of one tensor laid out as rows of `group` floats:
 *
 *     W_q  = clamp(round(W * scale + zero), 0, max_v)
 *     W_r  = (W_q - zero) / scale
 *     W_e  = sign(W - W_r) * relu(|W - W_r| - |W - W_r|^(lp_norm - 1) / beta)     (shrink_lp_op)
 *     zero = mean over the group of (W_q - (W - W_e) * scale)
 *     error = mean over the tensor of |W - W_r|;  stop after the first iteration whose error is not below the best
 *
 * hqq runs these as a dozen separate torch operations per iteration, each a pass over the tensor (a fractional
 * power among them); here one loop per group does all of them, vectorised by the compiler (-O3 -ffast-math
 * -march=native: the power as expf(p * logf(a)), from glibc's vector math library). Rounding may differ from
 * hqq's in the last bits of a zero point, so a code may differ where a value sits on a rounding boundary: the
 * tests bound that against hqq's own solver. `beta` stays fixed, as in hqq's legacy loop (its kappa is unused).
 *
 * The groups of an iteration are shared among `threads` OpenMP threads (torch's own libgomp, already loaded in the
 * process, runs them); a group's zero point is computed by one thread, so the result does not depend on `threads`.
 *
 * w: rows x group floats; scale: rows (hqq's inverted scale, constant here); zero: rows, in and out; work: rows x
 * group floats of scratch. Returns the number of iterations run. */
#include <math.h>

int hqq_proximal(const float *w, const float *scale, float *zero, long rows, long group, float max_v, float beta,
                 float lp_norm, int iters, float *work, int threads) {
    const float inv_beta = 1.0f / beta, p = lp_norm - 1.0f;
    const long n = rows * group;
    for (long r = 0; r < rows; r++) {
        const float s = scale[r];
        for (long j = 0; j < group; j++) work[r * group + j] = w[r * group + j] * s; /* W * scale, as hqq */
    }
    double best = INFINITY;
    int i = 0;
    while (i < iters) {
        double error = 0.0;
#pragma omp parallel for reduction(+ : error) num_threads(threads) schedule(static)
        for (long r = 0; r < rows; r++) {
            const float s = scale[r], z = zero[r];
            const float *wr = w + r * group, *ws = work + r * group;
            float acc = 0.0f, err = 0.0f;
#pragma omp simd reduction(+ : acc, err)
            for (long j = 0; j < group; j++) {
                float q = nearbyintf(ws[j] + z); /* torch.round: half to even */
                q = q < 0.0f ? 0.0f : (q > max_v ? max_v : q);
                const float d = wr[j] - (q - z) / s;
                const float a = fabsf(d);
                /* |d|^p for |d| > 0; below beta^(-1/(1-p)) the shrink is 0 whatever the power, so a floor of
                   1e-30 only keeps the power finite (hqq's inf - inf is clamped to 0 the same way) */
                float shrunk = a - inv_beta * expf(p * logf(a > 1e-30f ? a : 1e-30f));
                shrunk = shrunk > 0.0f ? shrunk : 0.0f;
                const float e = d > 0.0f ? shrunk : (d < 0.0f ? -shrunk : 0.0f);
                acc += q - (wr[j] - e) * s;
                err += a;
            }
            zero[r] = acc / (float)group;
            error += err;
        }
        error /= (double)n;
        i++;
        if (error < best)
            best = error;
        else
            break;
    }
    return i;
}
