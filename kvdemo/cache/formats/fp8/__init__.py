"""`fp8`: float8 codes as transformers, vLLM, SGLang and TensorRT-LLM store them: transformers'
`QuantizedCache(backend="fp8")` (float8_e4m3, one scale per tensor frozen at the first update: amax / 448 of the
prefill), the engines' scale of 1.0 (`scale=one`, e4m3 or e5m2), vLLM's `--calculate-kv-scales` (`scale=calculated`),
or one scale per token and KV head (`scale=per_token_head`, vLLM's `fp8_per_token_head`); no residual
(`kvdemo.cache.formats.fp8.layers`).

Its folder: the card (here) and its layers and cache (`layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import Deployment, transformers_rule, vllm_skip_layers
from kvdemo.cache.options import PROTECT_OPTION, SLIDING_OPTION, Option
from kvdemo.cache.policies import PROTECT_CHOICES, SLIDING_CHOICES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.model.geometry import KVGeometry

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""

SCALES = ("per_tensor", "per_token_head", "one", "calculated")
"""The `scale` option: transformers' one scale per tensor, amax / 448 frozen at the first update (the default; kvdemo
hands the whole prefill over in that update); one float32 scale per token and KV head (vLLM's `fp8_per_token_head`,
vllm#38378); 1.0 (vLLM's and SGLang's `fp8_e4m3`/`fp8_e5m2` when the checkpoint carries no scale); vLLM's
`--calculate-kv-scales`, amax / 200 of the keys and amax / 100 of the values at the first forward pass (its
`K_SCALE_CONSTANT`, `V_SCALE_CONSTANT`), frozen (`kvdemo.cache.formats.fp8.layers`)."""

FLOAT8_FORMATS = ("e4m3", "e5m2")
"""The `float8` option: float8_e4m3fn (every engine's default) or float8_e5m2 (vLLM's and SGLang's `fp8_e5m2`, stored
unscaled: with `scale=one` only)."""

CALCULATED_RANGES = (200.0, 100.0)
"""vLLM's `K_SCALE_CONSTANT` and `V_SCALE_CONSTANT` (vllm/envs.py defaults): `--calculate-kv-scales` sets a layer's
key scale to amax / 200 and its value scale to amax / 100 of the first forward pass."""


def fp8_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """One byte per value held (float8_e4m3; a sliding layer its window, `kvdemo.cache.layers.sliding`) plus one float32
    scale per layer and tensor (transformers' `Fp8QuantizedLayer`; kvdemo's de-quantization,
    `kvdemo.cache.formats.fp8.layers`, holds nothing more), or with `scale=per_token_head` one float32 scale per token
    held, head and tensor (`kvdemo.cache.formats.fp8.layers.PerTokenHeadFp8Layer`). `geo`: the quantized layers."""
    if opts.get("scale", SCALES[0]) != "per_token_head":  # one float32 scale per layer and tensor
        return geo.values_held(tokens) + 2 * len(geo.kv_layers) * 4
    scales = sum(4 * (layer.key_heads + layer.value_heads) * layer.tokens_held(tokens) for layer in geo.per_layer)
    return geo.values_held(tokens) + scales


def _cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """`kvdemo.cache.formats.fp8.layers.fp8_cache` of the spec's options: transformers' fp8 layers de-quantizing by
    bit placement (the same bits, the same store)."""
    from .layers import fp8_cache

    return fp8_cache(
        config,
        sliding=str(options.get("sliding", SLIDING_CHOICES[0])),
        protect=str(options.get("protect", PROTECT_CHOICES[0])),
        scale=str(options.get("scale", SCALES[0])),
        float8=str(options.get("float8", FLOAT8_FORMATS[0])),
    )


def fp8_combination_problem(opts) -> str | None:
    """Why fp8's resolved options cannot go together, or None: e5m2 is stored unscaled by the engines that store it."""
    if opts.get("float8") == FLOAT8_FORMATS[1] and opts.get("scale") != "one":
        return (
            f"float8=e5m2 is stored unscaled (vLLM's and SGLang's fp8_e5m2), so it takes scale=one, not "
            f"scale={opts.get('scale')}; or use float8=e4m3"
        )
    return None


def _deploy(backend: Backend, given, resolved, config: PreTrainedConfig) -> tuple[Deployment, ...]:
    """The engines that store these codes and scales: transformers' `QuantizedCache` and TensorRT-LLM through
    ModelOpt (amax / 448, calibrated: kvdemo's from this prefill) for `per_tensor`; vLLM for the others, its kept
    layers as `--kv-cache-dtype-skip-layers`; SGLang for `one` where every attention layer is in the one dtype."""
    scale, skip = resolved["scale"], vllm_skip_layers(resolved, config)
    if scale == SCALES[0]:
        lines = [*transformers_rule(backend, given, resolved, config)]
        if not skip:
            ptq = "ModelOpt hf_ptq.py --kv_cache_qformat fp8 (its calibration sets the scales; kvdemo sets them from "
            ptq += 'this prefill), then LLM(..., kv_cache_config=KvCacheConfig(dtype="fp8"))'
            lines.append(Deployment("tensorrt-llm", f"TensorRT-LLM: {ptq}"))
        return tuple(lines)
    dtype = {"per_token_head": "fp8_per_token_head", "one": f"fp8_{resolved['float8']}", "calculated": "fp8_e4m3"}
    vllm = f"vLLM: --kv-cache-dtype {dtype[scale]}{skip}"
    if scale == "calculated":
        vllm += " --calculate-kv-scales  # from its first forward pass: kvdemo's from the whole prefill"
    lines = [Deployment("vllm", vllm)]
    if scale == "one" and not skip:
        lines.append(Deployment("sglang", f"SGLang: --kv-cache-dtype {dtype[scale]}"))
    return tuple(lines)


BACKEND = Backend(
    NAME,
    "float8 codes: transformers' QuantizedCache(backend='fp8') (a scale per tensor frozen at the first update), the "
    "engines' scale 1.0 (e4m3, e5m2), vLLM's calculated scales or a scale per token and head; no residual",
    "It appends every new token, with the scale frozen at the prefill (scale=per_tensor, calculated), 1.0 (one) or "
    "its own scales (scale=per_token_head): no residual, never flushes.",
    quantized=True,
    make_cache=_cache,
    kv_bytes=fp8_bytes,
    options={
        "sliding": SLIDING_OPTION,
        "protect": PROTECT_OPTION,
        "scale": Option(
            "scale",
            SCALES[0],
            choices=SCALES,
            help="per_tensor: amax / 448 per layer and tensor, frozen at the first update (transformers'); "
            "per_token_head: one float32 scale per token and KV head (vLLM's fp8_per_token_head); one: 1.0 (vLLM's "
            "and SGLang's fp8 without a checkpoint scale); calculated: vLLM's --calculate-kv-scales",
            quiet=True,
        ),
        "float8": Option(
            "float8",
            FLOAT8_FORMATS[0],
            choices=FLOAT8_FORMATS,
            help="e4m3 (every engine's fp8) or e5m2 (vLLM's and SGLang's fp8_e5m2, unscaled: scale=one)",
            in_matrix=False,  # e5m2 goes with scale=one only; its own tests (tests/test_fp8.py)
            quiet=True,
        ),
    },
    candidates=({"scale": "one", "float8": FLOAT8_FORMATS[1]},),  # `scale` itself is varied (kvdemo.compare)
    combination_rule=fp8_combination_problem,
    deploy=_deploy,
    examples={"needle": {NAME: 4}},
    reference=(
        "transformers' Fp8QuantizedLayer; vLLM's per-token-head reference and scale rules, written out "
        "(tests/test_fp8.py)"
    ),
)
