"""`ggml`: llama.cpp's KV cache types (`-ctk`/`-ctv`: q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, f16), blocks of 32 values
byte for byte as ggml writes them, every token quantized as it is written (no residual, no flush), llama.cpp's
Hadamard rotation where llama.cpp applies it, sliding-window layers quantized too
(`kvdemo.cache.formats.ggml.layers`).

Its folder: the card (here), the layers (`layers`) and llama.cpp's blocks byte for byte (`blocks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import Deployment
from kvdemo.cache.options import SLIDING_OPTION, Option
from kvdemo.cache.policies import SLIDING_CHOICES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.model.geometry import KVGeometry
    from kvdemo.cache.options import SpecOptions

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""

BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "iq4_nl": 18}
"""Bytes of one block of 32 values of each quantized type (`sizeof(block_q4_0)` and the others in ggml-common.h): the
byte formula's and the blocks' (`kvdemo.cache.formats.ggml.blocks`) one table."""

CACHE_TYPES = (*BLOCK_BYTES, "f16")
"""The `type_k`/`type_v` words: llama.cpp's `--cache-type-k`/`--cache-type-v` values kvdemo stores."""

GGML_ROTATIONS = ("auto", "none")
"""The `rotation` words: `auto`, llama.cpp's own rule (on for a quantized type where head_dim is a multiple of 64);
`none`, llama.cpp with `LLAMA_ATTN_ROT_DISABLE=1`."""

LLAMA_CPP = "llama.cpp commit 0c1e570 (2026-10-01, as vendored by llama-cpp-python 0.3.36)"
"""The llama.cpp kvdemo's `ggml` backend follows."""

ROTATION_SINCE = "744c0c7 (#21038, 2026-04-01)"
"""The llama.cpp commit from which a quantized cache is rotated (`attn_rot_k`, `attn_rot_v`: "llama : rotate
activations for better quantization"); a build before it stores the same types unrotated, as `rotation=none` does,
and takes a bare `-fa` for flash attention instead of `-fa on`."""

MIXED_KEY_TYPES = ("f16", "q8_0")
"""The key types a recommendation also pairs with each value type of fewer bytes (`-ctk q8_0 -ctv q4_0`, `-ctk f16
-ctv q8_0`): what llama.cpp users deploy, keys at 8 bits or more, as kvdemo's bit pairs give the keys the bits (the
keys set which tokens a query attends to: KIVI, KVQuant)."""


def value_bytes(cache_type: str, values: int, element: int) -> float:
    """Bytes of `values` values (a multiple of 32) stored as `cache_type` (`f16`: 2 a value)."""
    return 2.0 * values if cache_type == "f16" else values / 32 * BLOCK_BYTES[cache_type]


def ggml_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """llama.cpp's cache bytes per quantized layer: every token held (a sliding layer its window) as blocks of its
    type, keys and values each their own (q4_0: 18 bytes per 32 values, q8_0: 34); no residual, no padding, so
    `nominal` and `blocks` change nothing. (llama.cpp itself allocates its whole context up front, padded to 256
    cells; kvdemo counts the tokens held.)"""
    total = 0.0
    for layer in geo.per_layer:
        held = layer.tokens_held(tokens)
        total += held * layer.key_heads * value_bytes(opts["type_k"], layer.key_dim, element)
        total += held * layer.value_heads * value_bytes(opts["type_v"], layer.value_dim, element)
    return total


def ggml_width_problem(opts, tensor: str, width: int) -> str | None:
    """Why `tensor` of `width` values per head cannot be stored as its type, or None: blocks hold 32 values."""
    cache_type = opts["type_k"] if tensor == "keys" else opts["type_v"]
    if cache_type == "f16" or width % 32 == 0:
        return None
    option = "type_k" if tensor == "keys" else "type_v"
    return (
        f"ggml stores {tensor} in blocks of 32 values, so a head_dim of {width} cannot be {cache_type} "
        f"(llama.cpp refuses it too); set {option}=f16, or use backend=dynamic"
    )


def _cache(name: str, options: Mapping[str, Any], config: PreTrainedConfig) -> Cache:
    """`kvdemo.cache.formats.ggml.layers.ggml_cache` of the spec's options."""
    from .layers import ggml_cache

    type_k = str(options.get("type_k", CACHE_TYPES[0]))
    return ggml_cache(
        config,
        type_k,
        str(options.get("type_v", type_k)),
        str(options.get("rotation", GGML_ROTATIONS[0])),
        str(options.get("sliding", SLIDING_CHOICES[1])),
        "0:0",
    )


def llama_cpp_command(resolved: SpecOptions, rotated: bool = True) -> str:
    """The llama.cpp command of a spec: `llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on` (flash attention:
    llama.cpp needs it for a quantized V cache); for `rotation=none`, `LLAMA_ATTN_ROT_DISABLE=1` in front; where
    llama.cpp rotates (`rotated`: a quantized type, head_dim a multiple of 64), a shell comment naming the build from
    which it does (`ROTATION_SINCE`), so the line still runs as it is."""
    command = f"llama-server -m MODEL.gguf -ctk {resolved['type_k']} -ctv {resolved['type_v']} -fa on"
    if resolved["rotation"] == "none":
        return f"LLAMA_ATTN_ROT_DISABLE=1 {command}"
    return f"{command}  # rotated: llama.cpp since {ROTATION_SINCE}" if rotated else command


def _deploy(backend: Backend, given: SpecOptions, resolved: SpecOptions, config: PreTrainedConfig):
    """llama.cpp's line, where llama.cpp stores the same: its sliding-window layers take the same types, so a spec
    that keeps them at full precision on a model that has them is kvdemo's only."""
    from kvdemo.cache.model.geometry import kv_geometry
    from kvdemo.cache.model.layer_kinds import layer_types

    sliding_kept = resolved["sliding"] == SLIDING_CHOICES[0]
    if sliding_kept and set(layer_types(config)) & set(backend.options["sliding"].acts_on):
        return ()
    quantized = {resolved["type_k"], resolved["type_v"]} != {"f16"}
    widths = {w for layer in kv_geometry(config).per_layer for w in (layer.key_dim, layer.value_dim)}
    rotated = quantized and all(w % 64 == 0 for w in widths)
    return (Deployment("llama.cpp", f"llama.cpp: {llama_cpp_command(resolved, rotated)}"),)


def _stored() -> dict[str, type]:
    """llama.cpp's rows of blocks (`kvdemo.cache.formats.ggml.layers.GgmlRows`)."""
    from .layers import GgmlRows

    return {"GgmlRows": GgmlRows}


BACKEND = Backend(
    NAME,
    "llama.cpp's KV cache types (-ctk/-ctv q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, f16): blocks of 32 values with a "
    "float16 scale, byte for byte as ggml writes them, with llama.cpp's Hadamard rotation",
    "Every token is quantized as it is written, as llama.cpp does: no residual, never flushes; attention reads the "
    "whole cache from the blocks, the prefill included. Sliding-window layers take the same types.",
    quantized=True,
    prefill_reads_cache=True,  # llama.cpp's prefill attends through its blocks (`kvdemo.cache.formats.ggml.layers`)
    make_cache=_cache,
    kv_bytes=ggml_bytes,
    options={
        "type_k": Option(
            "type_k",
            CACHE_TYPES[0],
            choices=CACHE_TYPES,
            help="the keys' type, llama.cpp's --cache-type-k (-ctk): 32 values a block, q8_0 34 bytes, q4_0 18",
            in_matrix=False,  # one layer for every type: the blocks have their own tests (tests/test_ggml.py)
        ),
        "type_v": Option(
            "type_v",
            CACHE_TYPES[0],
            choices=CACHE_TYPES,
            help="the values' type, llama.cpp's --cache-type-v (-ctv); unset: type_k",
            same_as="type_k",
            in_matrix=False,
        ),
        "rotation": Option(
            "rotation",
            GGML_ROTATIONS[0],
            choices=GGML_ROTATIONS,
            help="auto: llama.cpp's Hadamard rotation of a quantized K or V where head_dim is a multiple of 64; "
            "none: LLAMA_ATTN_ROT_DISABLE=1",
        ),
        "sliding": dataclasses.replace(
            SLIDING_OPTION,
            default=SLIDING_CHOICES[1],
            help="sliding-window layers: quantize them with the same types, as llama.cpp does (the default), or keep "
            "them at full precision (kvdemo only)",
        ),
    },
    compare_nbits=(None,),  # q8_0, llama.cpp's most deployed quantized cache, in the default comparison
    width_rule=ggml_width_problem,
    presets={name: {"type_k": name, "type_v": name} for name in CACHE_TYPES},
    candidates=tuple(
        {"type_k": k, "type_v": v}
        for k in MIXED_KEY_TYPES
        for v in BLOCK_BYTES
        if value_bytes(v, 32, 4) < value_bytes(k, 32, 4)
    ),
    deploy=_deploy,
    examples={"more": {f"{NAME}:q4_0": 2}},
    stored=_stored,
    reference="gguf.quants (ggml's reference quantizers) and llama.cpp itself (tests/test_ggml.py, make bench-peers)",
)
