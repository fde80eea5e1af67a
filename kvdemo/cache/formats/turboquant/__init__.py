"""`turboquant`: kvdemo's TurboQuant (arXiv:2504.19874, as vLLM serves it; `kvdemo.cache.formats.turboquant.layers`):
keys randomly rotated and coded by Lloyd-Max with a norm, values uniform per token and head, a full-precision residual;
vLLM's `kv_cache_dtype` presets.

Its folder: the card (here), kvdemo's layout and the cache (`layers`), vLLM's layout (`vllm`) and its token-by-token
layers (`vllm_layers`), the Lloyd-Max codes (`lloyd_max`), and the stores as the decode kernel reads them (`codes`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import Deployment
from kvdemo.cache.options import PROTECT_OPTION, SLIDING_OPTION, Option, group_options
from kvdemo.cache.policies import FLUSH_POLICIES, NORM_CORRECTION_CHOICES, TURBOQUANT_LAYOUTS, vllm_write_path

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.model.geometry import KVGeometry

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""


TURBOQUANT_FP8_KEYS = 8
"""turboquant's nbits of float8 keys with a float32 scale per token and head (vLLM's `k8v4`)."""


def turboquant_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """kvdemo's TurboQuant layout (`kvdemo.cache.formats.turboquant.layers`, vLLM's `TurboQuantConfig.key_packed_size`
    and `value_packed_size`), per quantized layer, token and head: keys head_dim x nbits / 8 bytes of packed Lloyd-Max
    codes and a float16 norm (nbits 8: head_dim float8 codes and a float32 scale); values head_dim x nbits_value / 8
    bytes and a float16 scale and zero point; `residual` tokens in the model's dtype. With `layout=vllm` the same but
    for the float8 keys, which carry no scale (`kvdemo.cache.formats.turboquant.vllm`; vLLM's slot padding to an even
    size adds nothing for the power-of-two head_dims that layout takes). Codes are packed densely (3 bits
    take 3), so `nominal` changes nothing, and nothing pads per block (`blocks` is ignored). A sliding layer quantized
    holds at most its window in its store."""
    key_bits, value_bits = opts["nbits"], opts.get("nbits_value", opts["nbits"])
    fp8_scale = 0 if opts.get("layout") == TURBOQUANT_LAYOUTS[1] else 4  # vLLM's float8 keys carry no scale
    key_extra = fp8_scale if key_bits == TURBOQUANT_FP8_KEYS else 2
    total = 0.0
    for layer in geo.per_layer:
        keys = layer.key_heads * (layer.key_dim * key_bits / 8 + key_extra)
        values = layer.value_heads * (layer.value_dim * value_bits / 8 + 4)
        full = (layer.key_heads * layer.key_dim + layer.value_heads * layer.value_dim) * element
        total += (keys + values) * layer.tokens_held(tokens - residual) + full * residual
    return total


def turboquant_combination_problem(opts) -> str | None:
    """Why turboquant's resolved options cannot go together, or None: the norm correction acts on the Lloyd-Max keys
    (nbits 2 to 4); 8-bit keys are float8 with their own scale and have no code to correct."""
    if opts.get("norm_correction") == "true" and opts["nbits"] == TURBOQUANT_FP8_KEYS:
        return (
            "norm_correction=true corrects the norm of Lloyd-Max coded keys (nbits 2 to 4); with nbits=8 the keys are "
            "float8 with a scale per token and head, so leave norm_correction out or choose nbits 2 to 4"
        )
    if opts.get("layout") == TURBOQUANT_LAYOUTS[1]:
        bits = (opts["nbits"], opts.get("nbits_value", opts["nbits"]))
        if bits[0] not in (3, 4, 8) or bits[1] not in (3, 4):
            return (
                f"layout=vllm stores what vLLM's TurboQuant stores: keys of 3, 4 or 8 bits and values of 3 or 4 (not "
                f"nbits={bits[0]}, nbits_value={bits[1]}); use a preset (turboquant:4bit_nc) or layout=kvdemo"
            )
    return None


def turboquant_width_problem(opts, tensor: str, width: int) -> str | None:
    """Why turboquant cannot store `tensor` (`keys` or `values`) of `width` values per head and token, or None: codes
    are packed eight at a time (a width a multiple of 8, but for 8-bit codes), and rotated keys need a Hadamard block of
    8 or more (`kvdemo.cache.layers.rotation.rotation_problem`)."""
    bits = opts["nbits"] if tensor == "keys" else opts.get("nbits_value", opts["nbits"])
    if bits == TURBOQUANT_FP8_KEYS:
        return None
    if tensor == "keys" and opts.get("layout") == TURBOQUANT_LAYOUTS[1] and width & (width - 1):
        return (
            f"layout=vllm rotates the keys by one Sylvester Hadamard matrix, which needs a power-of-two head_dim, not "
            f"{width} (vLLM's too); use layout=kvdemo (block-diagonal) or nbits=8"
        )
    if tensor == "keys":
        from kvdemo.cache.model.geometry import rotation_problem  # torch: only once a model is given

        problem = rotation_problem(width)
        if problem:
            return "turboquant rotates its keys: " + problem.replace("use rotation=none", "use nbits=8 (fp8 keys)")
    if width % 8:
        return f"turboquant packs {bits}-bit codes eight at a time, so head_dim must be a multiple of 8, not {width}"
    return None


VLLM_STORE: dict[str, int | str] = {"layout": "vllm", "protect": "vllm", "sliding": "quantize", "residual_length": 1}
"""What every vLLM preset stores as vLLM does: its layout, its boundary layers, its sliding-window layers quantized,
every token coded as it comes (`kvdemo.cache.formats.turboquant.vllm`)."""

TURBOQUANT_PRESETS: dict[str, dict[str, int | str]] = {
    "k8v4": {"nbits": 8, "nbits_value": 4, **VLLM_STORE},
    "4bit_nc": {"nbits": 4, "nbits_value": 4, "norm_correction": "true", **VLLM_STORE},
    "k3v4_nc": {"nbits": 3, "nbits_value": 4, "norm_correction": "true", **VLLM_STORE},
    "3bit_nc": {"nbits": 3, "nbits_value": 3, "norm_correction": "true", **VLLM_STORE},
}
"""vLLM's TurboQuant `kv_cache_dtype` presets (`turboquant_<name>`, vLLM's `TQ_PRESETS`), storing what vLLM stores:
`k8v4` raw float8 keys and 4-bit values (vLLM: 2.6x smaller, perplexity +1.17 %); `4bit_nc` 4-bit keys and values with
norm correction (3.8x, +2.71 %); `k3v4_nc` 3-bit keys, 4-bit values (~3.5x, +10.63 %); `3bit_nc` 3-bit keys and
values (4.9x, +20.59 %). kvdemo's own variant of each is the preset with `layout=kvdemo` (its figures are vLLM's on
its models; kvdemo measures its own, docs/turboquant.md)."""


def keeps_residual(resolved) -> bool:
    """Whether a turboquant spec keeps a residual: all but vLLM's write path (`kvdemo.cache.policies.vllm_write_path`:
    every preset), which codes each token as it comes."""
    return not vllm_write_path(resolved.get("layout"), resolved.get("residual_length"), resolved.get("flush"))


def vllm_dtype(resolved) -> str | None:
    """vLLM's `--kv-cache-dtype` of a spec that stores exactly what a preset of vLLM stores, or None."""
    for name, preset in TURBOQUANT_PRESETS.items():
        wanted = {"norm_correction": "false", "flush": "append", **preset}
        if all(str(resolved.get(option)) == str(value) for option, value in wanted.items()):
            return f"turboquant_{name}"
    return None


def _turboquant_options() -> dict[str, Option]:
    """The turboquant backend's options: bits of keys and values, the residual and its flush, the norm correction, and
    the layer options of every quantized backend."""
    bits = (2, 3, 4, 8)
    group = group_options(nbits=bits, axes=(0,))
    flush = group["flush"]
    return {
        "nbits": Option(
            "nbits",
            4,
            choices=bits,
            help="the keys' bits per coordinate: a Lloyd-Max code of the rotated key (8: float8 keys with a scale per "
            "token and head, not rotated)",
        ),
        "nbits_value": Option(
            "nbits_value",
            4,
            choices=bits,
            help="the values' bits: uniform codes with a float16 scale and zero per token and head; unset: nbits",
            same_as="nbits",
        ),
        "residual_length": group["residual_length"],
        "flush": Option("flush", FLUSH_POLICIES[1], choices=FLUSH_POLICIES, help=flush.help),
        "norm_correction": Option(
            "norm_correction",
            NORM_CORRECTION_CHOICES[0],
            choices=NORM_CORRECTION_CHOICES,
            help="true: store each key's norm over its code's, so a de-quantized key keeps its norm (vLLM's _nc)",
            quiet=True,
        ),
        "sliding": SLIDING_OPTION,
        "protect": PROTECT_OPTION,
        "layout": Option(
            "layout",
            TURBOQUANT_LAYOUTS[0],
            choices=TURBOQUANT_LAYOUTS,
            help="kvdemo: the exact marginal's code, signed rotation, fp8 keys with a scale; vllm: vLLM's store byte "
            "for byte (plain Hadamard, Gaussian code, raw fp8 keys)",
            quiet=True,
        ),
    }


def _deploy(backend: Backend, given, resolved, config: PreTrainedConfig) -> tuple[Deployment, ...]:
    """vLLM's line where the spec stores exactly what one of its TurboQuant presets stores."""
    dtype = vllm_dtype(resolved)
    return (Deployment("vllm", f"vLLM: --kv-cache-dtype {dtype}"),) if dtype else ()


def _cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """kvdemo's TurboQuant cache (`kvdemo.cache.formats.turboquant.layers.turboquant_cache`) of the options a spec
    sets."""
    from .layers import turboquant_cache

    return turboquant_cache(config, **options)


def _stored() -> dict[str, type]:
    """TurboQuant's records, kvdemo's layout and vLLM's (`kvdemo.cache.formats.turboquant.layers`, `.vllm`)."""
    from .layers import TurboKeys, UniformValues
    from .vllm import VllmFp8Keys, VllmKeys, VllmValues

    return {cls.__name__: cls for cls in (TurboKeys, UniformValues, VllmKeys, VllmFp8Keys, VllmValues)}


BACKEND = Backend(
    NAME,
    "kvdemo's TurboQuant (arXiv:2504.19874, as vLLM serves it): keys randomly rotated, Lloyd-Max codes and a norm; "
    "values uniform per token and head; a full-precision residual",
    "Why one fixed code fits: the random rotation spreads a key's outlier channels over all its coordinates, so "
    "every coordinate of every key follows one known distribution, and the code is the optimal one for it. New "
    "tokens wait in the full-precision residual; at residual_length the residual block is coded and appended "
    "(flush=append, vLLM's) or the whole layer is coded again (flush=requantize).",
    quantized=True,
    make_cache=_cache,
    kv_bytes=turboquant_bytes,
    options=_turboquant_options(),
    compare_nbits=(4,),
    width_rule=turboquant_width_problem,
    presets=TURBOQUANT_PRESETS,
    combination_rule=turboquant_combination_problem,
    residual_rule=keeps_residual,
    deploy=_deploy,
    stored=_stored,
    reference=(
        "the paper's MSE table and vLLM's TurboQuant layout, written out (tests/test_turboquant.py, "
        "tests/test_turboquant_vllm.py)"
    ),
)
