"""`nvfp4`: NVIDIA's 4-bit float KV cache as vLLM, SGLang and TensorRT-LLM store it: E2M1 codes two a byte, a
float8_e4m3 scale per 16 values and a float32 scale per tensor (36 bytes per 64 values), every token coded as it is
written (no residual, never flushes); vLLM's presets `nvfp4`, `nvfp4_4over6` and `fp8_k_nvfp4_v`
(`kvdemo.cache.formats.nvfp4.layers`).

Its folder: the card (here), the blocks byte for byte (`blocks`, checked against torchao's reference) and the layers
and cache (`layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import Deployment, vllm_skip_layers
from kvdemo.cache.options import ENGINE_SLIDING_OPTION, PROTECT_OPTION, Option

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.model.geometry import KVGeometry

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""

BLOCK = 16
"""Values per NVFP4 block: the width a stored head_dim must be a multiple of."""

KEY_FORMATS = ("nvfp4", "e4m3")
"""The keys' format: NVFP4 blocks like the values, or float8_e4m3 with one scale per tensor (vLLM's `fp8_k_nvfp4_v`;
`kvdemo.cache.formats.nvfp4.blocks.quantize_fp8`)."""

BLOCK_RULES = ("max6", "4over6")
"""How a block's scale is chosen: from amax / 6 (NVIDIA's, torchao's), or from amax / 6 or amax / 4, whichever errs
less (`kvdemo.cache.formats.nvfp4.blocks`)."""

TENSOR_SCALES = ("one", "prefill")
"""The per-tensor scale: 1.0 (vLLM's and SGLang's when the checkpoint carries none and no scale is calculated), or
computed from the prefill's amax and frozen (torchao's and ModelOpt's rule, here on the user's own text:
`kvdemo.cache.formats.nvfp4.blocks.amax_scale`)."""

PRESETS: dict[str, dict[str, int | str]] = {
    "nvfp4": {"keys": "nvfp4", "block_rule": "max6"},
    "nvfp4_4over6": {"keys": "nvfp4", "block_rule": "4over6"},
    "fp8_k_nvfp4_v": {"keys": "e4m3", "block_rule": "max6"},
}
"""vLLM's `--kv-cache-dtype` values of this format (vllm#37332/#40177 `nvfp4`; #45187 `nvfp4_4over6`, each block's
scale from max/6 or max/4, whichever errs less; #53770 `fp8_k_nvfp4_v`, float8 keys and NVFP4 values), each with the
tensor scale vLLM takes without a checkpoint scale (1.0)."""


def nvfp4_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """Per quantized layer and token held (a sliding layer its window) and head: head_dim / 2 bytes of codes and
    head_dim / 16 of e4m3 block scales (keys with `keys=e4m3`: head_dim bytes); one float32 tensor scale per layer for
    the keys and one for the values. No residual and no padding: `nominal` and `blocks` change nothing."""
    fp8_keys = opts.get("keys", KEY_FORMATS[0]) == KEY_FORMATS[1]
    total = 0.0
    for layer in geo.per_layer:
        key_row = layer.key_dim if fp8_keys else layer.key_dim / 2 + layer.key_dim / BLOCK
        value_row = layer.value_dim / 2 + layer.value_dim / BLOCK
        total += layer.tokens_held(tokens) * (layer.key_heads * key_row + layer.value_heads * value_row) + 2 * 4
    return total


def nvfp4_width_problem(opts, tensor: str, width: int) -> str | None:
    """Why `tensor` of `width` values per head cannot be stored, or None: NVFP4 blocks hold 16 values."""
    if width % BLOCK == 0 or (tensor == "keys" and opts.get("keys") == KEY_FORMATS[1]):
        return None
    fix = "keys=e4m3 (float8 keys) or " if tensor == "keys" else ""
    return (
        f"NVFP4 stores {tensor} in blocks of {BLOCK} values, so a head_dim of {width} cannot be NVFP4 (the engines "
        f"refuse it too); use {fix}backend=fp8 or backend=dynamic"
    )


def engine_dtype(resolved) -> str | None:
    """vLLM's `--kv-cache-dtype` of resolved options that store what one of its presets stores, or None."""
    for name, options in PRESETS.items():
        if all(resolved.get(k) == v for k, v in options.items()) and resolved.get("tensor_scale") == "one":
            return name
    return None


def _deploy(backend: Backend, given, resolved, config: PreTrainedConfig) -> tuple[Deployment, ...]:
    """vLLM's line, its kept layers as `--kv-cache-dtype-skip-layers` (`kvdemo.cache.deploy.vllm_skip_layers`); SGLang's
    and TensorRT-LLM's where every attention layer is in the one dtype (sliding-window layers too, no protected layer).
    The tensor scale: 1.0 (vLLM, SGLang without a checkpoint scale) or the calibrated amax (TensorRT-LLM through
    ModelOpt, which kvdemo computes from the prefill)."""
    skip = vllm_skip_layers(resolved, config)
    dtype, lines = engine_dtype(resolved), []
    if dtype:
        lines.append(Deployment("vllm", f"vLLM: --kv-cache-dtype {dtype}{skip}"))
        if dtype == "nvfp4" and not skip:
            lines.append(Deployment("sglang", "SGLang: --kv-cache-dtype nvfp4"))
    ptq = {"keys": "nvfp4", "block_rule": "max6", "tensor_scale": "prefill"}
    if not skip and all(resolved.get(k) == v for k, v in ptq.items()):
        ptq_line = (
            "TensorRT-LLM: ModelOpt hf_ptq.py --kv_cache_qformat nvfp4 (its calibration sets the tensor scales; kvdemo "
            'sets them from this prefill), then LLM(..., kv_cache_config=KvCacheConfig(dtype="nvfp4"))'
        )
        lines.append(Deployment("tensorrt-llm", ptq_line))
    return tuple(lines)


def _cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """`kvdemo.cache.formats.nvfp4.layers.nvfp4_cache` of the spec's options."""
    from .layers import nvfp4_cache

    return nvfp4_cache(config, **{k: str(v) for k, v in options.items()})


def _stored() -> dict[str, type]:
    """The NVFP4 and float8 stores (`kvdemo.cache.formats.nvfp4.blocks`)."""
    from .blocks import Fp8Store, Nvfp4Store

    return {"Nvfp4Store": Nvfp4Store, "Fp8Store": Fp8Store}


def _words(name: str, words: tuple[str, ...], text: str, in_matrix: bool = True) -> Option:
    return Option(name, words[0], choices=words, help=text, in_matrix=in_matrix)


BACKEND = Backend(
    NAME,
    "NVFP4 (vLLM, SGLang, TensorRT-LLM): E2M1 codes two a byte, a float8 scale per 16 values and a float32 scale per "
    "tensor, 36 bytes per 64 values; vLLM's presets nvfp4, nvfp4_4over6, fp8_k_nvfp4_v",
    "Every token is coded as it is written, with its own block scales under the tensor's scale: no residual, never "
    "flushes. Sliding-window layers take the same format, as the engines store them.",
    quantized=True,
    make_cache=_cache,
    kv_bytes=nvfp4_bytes,
    options={
        "keys": _words(
            "keys",
            KEY_FORMATS,
            "nvfp4: keys in NVFP4 blocks like the values; e4m3: float8_e4m3 keys with one scale per tensor (vLLM's "
            "fp8_k_nvfp4_v)",
            in_matrix=False,
        ),
        "block_rule": _words(
            "block_rule",
            BLOCK_RULES,
            "max6: each block's scale from its amax / 6 (NVIDIA's); 4over6: from amax / 6 or amax / 4, whichever "
            "errs less (vLLM's nvfp4_4over6)",
            in_matrix=False,  # the same layer: each rule byte for byte in tests/test_nvfp4.py
        ),
        "tensor_scale": _words(
            "tensor_scale",
            TENSOR_SCALES,
            "one: 1.0 (vLLM and SGLang without a checkpoint scale); prefill: amax / (6 x 448) of the prefill, frozen "
            "(ModelOpt's calibrated rule)",
            in_matrix=False,  # the same layer: each rule in tests/test_nvfp4.py
        ),
        "sliding": ENGINE_SLIDING_OPTION,
        "protect": PROTECT_OPTION,
    },
    compare_nbits=(),
    width_rule=nvfp4_width_problem,
    presets=PRESETS,
    candidates=({"tensor_scale": TENSOR_SCALES[1]},),  # the calibrated scale TensorRT-LLM deploys through ModelOpt
    deploy=_deploy,
    stored=_stored,
    reference="torchao 0.18.0's nvfp4_quantize (tests/test_nvfp4.py)",
)
