"""`mlx`: mlx-lm's quantized KV cache (`--kv-bits`, `--kv-group-size`, `--quantized-kv-start`): MLX's affine groups
along head_dim, byte for byte as `mlx.core.quantize` writes them (codes packed in uint32, a scale and a bias per group
in the model's dtype), from the token the cache reaches its start on (`kvdemo.cache.formats.mlx.layers`).

Its folder: the card (here), the groups byte for byte (`affine`, checked against mlx-cpu) and the layer and cache
(`layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import Deployment
from kvdemo.cache.options import Option

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.model.geometry import KVGeometry

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""

BITS = (2, 3, 4, 5, 6, 8)
"""The bits `mx.quantize` takes (`affine_quantize` in `mlx/ops.cpp`: 2 to 8 but 7)."""

GROUP_SIZES = (32, 64, 128)
"""The group sizes `mx.quantize` takes; mlx-lm's `--kv-group-size` defaults to 64."""


def mlx_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """Per layer mlx-lm quantizes, once it holds `quantized_kv_start` tokens: per token and head, head_dim x bits / 8
    bytes of codes and a scale and a bias per group in the model's dtype (`element` bytes each), for keys and values;
    before that, every value in the model's dtype. (mlx-lm allocates in steps of 256 tokens; kvdemo counts the tokens
    held.) `nominal` and `blocks` change nothing."""
    if tokens < opts["quantized_kv_start"]:
        return float(element * geo.values_held(tokens))
    bits, group = opts["nbits"], opts["kv_group_size"]
    total = 0.0
    for layer in geo.per_layer:
        row = sum(heads * (width * bits / 8 + 2 * element * width / group) for heads, width in (
            (layer.key_heads, layer.key_dim), (layer.value_heads, layer.value_dim)))  # fmt: skip
        total += layer.tokens_held(tokens) * row
    return total


def mlx_width_problem(opts, tensor: str, width: int) -> str | None:
    """Why `tensor` of `width` values per head cannot be stored, or None: `mx.quantize` groups the last axis."""
    group = opts["kv_group_size"]
    if width % group == 0:
        return None
    fits = [g for g in GROUP_SIZES if width % g == 0]
    fix = f"kv_group_size={fits[-1]}" if fits else "backend=dynamic (no MLX group size divides it)"
    return (
        f"mlx-lm quantizes {tensor} in groups of {group} values along head_dim, so a head_dim of {width} cannot be "
        f"stored; use {fix}"
    )


def _deploy(backend: Backend, given, resolved, config: PreTrainedConfig) -> tuple[Deployment, ...]:
    """mlx-lm's line, on a model without sliding-window layers: mlx-lm cannot quantize its rotating cache
    ("RotatingKVCache Quantization NYI") and stops there, where kvdemo keeps those layers at full precision. The
    comment says the prefill's one condition (`kvdemo.cache.formats.mlx.layers`)."""
    from kvdemo.cache.layers.by_kind import sliding_windows

    if any(window is not None for window in sliding_windows(config)):
        return ()
    flags = f"--kv-bits {resolved['nbits']} --kv-group-size {resolved['kv_group_size']}"
    line = f"mlx-lm: mlx_lm.generate --model MODEL {flags} --quantized-kv-start {resolved['quantized_kv_start']}"
    line += "  # kvdemo prefills the context in one step: as mlx-lm with a --prefill-step-size above its tokens"
    return (Deployment("mlx-lm", line),)


def _cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """`kvdemo.cache.formats.mlx.layers.mlx_cache` of the spec's options."""
    from .layers import mlx_cache

    options = {**{n: o.default for n, o in BACKEND.options.items()}, **options}
    return mlx_cache(config, int(options["nbits"]), int(options["kv_group_size"]), int(options["quantized_kv_start"]))


def _stored() -> dict[str, type]:
    """MLX's affine store (`kvdemo.cache.formats.mlx.affine.AffineStore`)."""
    from .affine import AffineStore

    return {"AffineStore": AffineStore}


BACKEND = Backend(
    NAME,
    "mlx-lm's quantized KV cache (--kv-bits, --kv-group-size, --quantized-kv-start): MLX's affine groups along "
    "head_dim, codes packed in uint32 with a scale and a bias per group",
    "The cache holds full precision until it reaches quantized_kv_start tokens, then quantizes everything at once and "
    "every later token as it is written, as mlx-lm does: no residual, never flushes. The context is prefilled in full "
    "precision, then quantized. Sliding-window layers stay at full precision (mlx-lm cannot quantize them).",
    quantized=True,
    make_cache=_cache,
    kv_bytes=mlx_bytes,
    options={
        "nbits": Option(
            "nbits",
            4,
            choices=BITS,
            help="bits per value, mlx-lm's --kv-bits",
            in_matrix=False,  # one layer at every bits: each bits byte for byte in tests/test_mlx.py
        ),
        "kv_group_size": Option(
            "kv_group_size", 64, choices=GROUP_SIZES, help="values per scale and bias, mlx-lm's --kv-group-size"
        ),
        "quantized_kv_start": Option(
            "quantized_kv_start",
            0,
            minimum=0,
            help="tokens the cache holds in full precision before it is quantized, mlx-lm's --quantized-kv-start "
            "(mlx-lm's default is 5000; kvdemo's 0 quantizes from the prefill's first chunk on)",
        ),
    },
    compare_nbits=(),
    width_rule=mlx_width_problem,
    deploy=_deploy,
    stored=_stored,
    reference="mlx.core.quantize of mlx-cpu 0.32.4 (tests/test_mlx.py); mlx-lm 0.32.2 itself (benchmarks/mlx_peer.py)",
)
