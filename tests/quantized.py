"""What "equal" means for a quantized store reached by two different float paths (a chunked prefill against one
forward pass, say), and the checks that follow from it on any CPU.

Two float paths (different matrix shapes, a different order of additions) give full-precision keys and values
that differ by a float's rounding (1e-7 to 3e-7 measured on the tiny model). A quantizer then rounds each value to
its nearest level; a value that lay within that rounding of the midpoint between two levels goes to the other
level. So the de-quantized stores can differ by one quantization step in a few values, never more, and an answer
decoded from them equals the other path's only up to the first near tie. Seen on a CI machine: hqq 8-bit rounded
one value of 46,336 in one layer's values to the neighbouring level (0.0045, one step of a range of 0.92).
Comparisons of the same path twice (restore, an answer against a fresh run) stay exact and do not use these.
"""

from __future__ import annotations

import math

import torch

from kvdemo import CacheSpec
from kvdemo.cache.formats.ggml.layers import VALUE_ROTATION_BLOCK, GgmlRotation, key_rotation_block
from kvdemo.cache.formats.turboquant.layers import KEY_ROTATION
from kvdemo.cache.formats.turboquant.lloyd_max import exact_marginal
from kvdemo.cache.layers.rotation import hadamard

FLOAT_ATOL = 1e-4
"""Full-precision keys, values and de-quantized values that did not change level: equal within this (measured:
3e-7 between a chunked prefill and one pass)."""

MAX_FLIPPED_SHARE = 1e-2
"""At most this share of a store's values may differ by more than `FLOAT_ATOL` (one level away, or moved by less
than a step where hqq's optimiser shifted a group's zero point). Seen: 1 in 46,336 (2.2e-5, hqq 8-bit on a CI
machine); under four float32 roundings of the inputs (`test_the_store_tolerance_holds_when_the_inputs_move_by_a_float
_rounding`) up to 259 of 262,144 (9.9e-4, hqq 8-bit values) and whole groups of 64 for hqq at 1-4 bits. Ten times
the worst seen; a wrong store (another chunk's tokens, a missed update) differs in most of its values."""

FP8_MANTISSA_BITS = 3
"""float8_e4m3fn keeps 3 mantissa bits: between 2^e and 2^(e+1) its levels are 2^(e-3) apart."""


def quantization_step(spec: CacheSpec, reference: torch.Tensor, what: str = "keys") -> float:
    """The widest distance between two neighbouring levels a store of `reference` can have (an upper bound).

    Args:
        spec: the cache's spec; `nbits` for the group-wise backends (mlx's affine groups too), fp8's and NVFP4's
            formats otherwise.
        reference: a de-quantized store, any shape, in the domain of `levels`.
        what: a name of the store that says whether it holds values (`... values ...`) or keys.

    Returns:
        group-wise (quanto, hqq) and turboquant's values: (max - min) / (2^nbits - 1) of the whole tensor, which no
        group's step exceeds (a group's range lies within the tensor's; x ~ scale * (q - zero) with scale = range /
        (2^nbits - 1)). fp8 and turboquant's 8-bit keys: the spacing of float8_e4m3 at the largest magnitude,
        2^(floor(log2 max|x|) - 3). NVFP4: its widest gap (2) times the largest block scale, amax / 6 rounded up
        to e4m3 or its floor. turboquant's keys: the code's widest gap between centroids times the largest
        vector norm (a coordinate is centroid x norm).
    """
    values = "values" in what
    opts = spec.resolved()
    if spec.backend == "ggml":
        return _ggml_step(opts["type_v" if values else "type_k"], float(reference.abs().max()))
    nbits = int(opts.get("nbits_value", opts.get("nbits", 0)) if values else opts.get("nbits", 0))
    if spec.backend == "nvfp4" and (values or opts["keys"] == "nvfp4"):  # E2M1's widest gap (4 to 6) x block scale
        return 2 * max(float(reference.abs().max()) / 6 * (1 + 2**-FP8_MANTISSA_BITS), NVFP4_SCALE_FLOOR)
    if spec.backend == "int8":  # a step of amax / 127 per token and head: at most the tensor's amax / 127
        return float(reference.abs().max()) / 127
    float8 = spec.backend in ("fp8", "nvfp4")  # nvfp4's float8 keys (`keys=e4m3`)
    if float8 or (spec.backend == "turboquant" and not values and nbits == 8):
        top = float(reference.abs().max())
        return 2.0 ** (math.floor(math.log2(top)) - FP8_MANTISSA_BITS) if top > 0 else 0.0
    if spec.backend == "turboquant" and not values:
        centroids = exact_marginal(reference.shape[-1], nbits).centroids
        gap = float((centroids[1:] - centroids[:-1]).max())
        return gap * float(reference.norm(dim=-1).max())
    if spec.backend != "turboquant":
        nbits = int(opts["nbits"])  # the group-wise backends' bound as before: the keys' bits
    return float(reference.max() - reference.min()) / (2**nbits - 1)


NVFP4_SCALE_FLOOR = 2.0**-6
"""The smallest NVFP4 block scale under a tensor scale of at most 1 (torchao's clamp at e4m3's smallest normal)."""

GGML_STEP = {"q8_0": 1 / 127, "q4_0": 1 / 8, "q5_0": 1 / 16, "q4_1": 2 / 15, "q5_1": 2 / 31, "iq4_nl": 2 * 24 / 127}
"""ggml's widest step between levels over the largest magnitude of a block (ggml-quants.c): d = amax / 127 (q8_0),
amax / 8 (q4_0), amax / 16 (q5_0), range / 15 and range / 31 with range <= 2 amax (the _1 types); iq4_nl's widest gap
between its values (24, 89 to 113) times d, its least-squares d at most twice amax / 127."""


def _ggml_step(cache_type: str, top: float) -> float:
    """ggml's widest step of `cache_type` for a store whose largest magnitude is `top`; float16's spacing at `top`
    for `f16` (10 mantissa bits)."""
    if cache_type == "f16":
        return 2.0 ** (math.floor(math.log2(top)) - 10) if top > 0 else 0.0
    return GGML_STEP[cache_type] * top


def levels(spec: CacheSpec, store: torch.Tensor, what: str = "keys") -> torch.Tensor:
    """A de-quantized store read in the model's basis (`kvdemo.cache.layers.rotation.to_model_basis`) in the domain its
    quantization levels lie on: as it is, or for `rotation=hadamard` rotated again by H (H @ H = I). There one
    value moved by a level stays one value; rotated back it would move every value of its
    token by step / sqrt(head_dim). turboquant's keys (not its 8-bit ones) lie on their levels after its signed
    rotation (`KEY_ROTATION`); its values are not rotated. `what` names the store (`... values ...` or keys)."""
    if spec.backend == "ggml":  # llama.cpp's rotation of the type's store (kvdemo.cache.formats.ggml.layers)
        opts, width = spec.resolved(), store.shape[-1]
        if opts["rotation"] == "none" or opts["type_v" if "values" in what else "type_k"] == "f16":
            return store
        block = VALUE_ROTATION_BLOCK if "values" in what else key_rotation_block(width)
        return store if not block else GgmlRotation(block, block).forward(store)
    if spec.backend == "turboquant":
        rotated = "values" not in what and spec.resolved()["nbits"] != 8
        return KEY_ROTATION.forward(store) if rotated else store
    if spec.resolved().get("rotation", "none") == "none":
        return store
    return store @ hadamard(store.shape[-1], store.dtype)


def assert_within_one_step(got: torch.Tensor, expected: torch.Tensor, step: float, what: str = "store") -> None:
    """Two de-quantized stores of the same values reached by two float paths: every value within one
    quantization step, and at most `MAX_FLIPPED_SHARE` of them further apart than `FLOAT_ATOL`.

    Raises:
        AssertionError: with the largest difference, the step, and the count and share of values one level away.
    """
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
    diff = (got - expected).abs()
    flipped = int((diff > FLOAT_ATOL).sum())
    share = flipped / max(diff.numel(), 1)
    detail = (
        f"{what}: largest difference {float(diff.max()):.3g} (one step {step:.3g}); "
        f"{flipped:,} of {diff.numel():,} values apart ({share:.2e}, at most {MAX_FLIPPED_SHARE:.0e})"
    )
    assert float(diff.max()) <= step * (1 + 1e-3) + FLOAT_ATOL, detail
    assert share <= MAX_FLIPPED_SHARE, detail


def assert_same_answer_up_to_a_near_tie(got: torch.Tensor, expected: torch.Tensor, tolerance: float) -> int:
    """Teacher-forced log-probabilities of one answer on two caches reached by two float paths.

    Args:
        got, expected: float32 log-probabilities, [n, vocab_size] (`QASession.score` of the same answer).
        tolerance: the largest log-probability difference allowed (nats).

    Returns:
        the number of leading positions whose greedy token is certain on both caches (the top two of `expected`
        more than 2 x tolerance apart) and equal; a near tie may go either way on another CPU, so the greedy
        answers are only promised equal up to the first one.

    Raises:
        AssertionError: a difference above `tolerance`, or a different greedy token before the first near tie.
    """
    assert got.shape == expected.shape
    worst = float((got - expected).abs().max())
    assert worst <= tolerance, f"log-probabilities differ by {worst:.3g} nats (at most {tolerance})"
    top2 = expected.topk(2, dim=-1).values
    certain = 0
    for row in range(expected.shape[0]):
        if float(top2[row, 0] - top2[row, 1]) <= 2 * tolerance:
            break
        assert int(got[row].argmax()) == int(expected[row].argmax()), f"greedy token {row} differs"
        certain += 1
    return certain
