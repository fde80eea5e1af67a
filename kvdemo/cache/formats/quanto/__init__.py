"""`quanto`: transformers' `QuantizedCache(backend="quanto")`, optimum-quanto's int2/int4 group-wise codes with a
full-precision residual; kvdemo's flush, rotation, K/V precision and per-layer plan on top
(`kvdemo.cache.layers.flush`).

Its folder: the card (here), its layers and their store as codes (`layers`), optimum-quanto's extension built once per
machine (`build`) and its unpacking on CUDA (`device`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import transformers_rule
from kvdemo.cache.layouts import group_bytes
from kvdemo.cache.options import group_options

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.options import SpecOptions

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""


def quanto_packed_bytes(bits: int, axis: int, group: int, values: int) -> int:
    """Bytes of optimum-quanto's codes for one stored block of `values` values (one layer's keys or values, batch x
    heads x tokens x width): quanto groups them into a [values / group, group] matrix (axis 0) or a
    [group, values / group] one (axis -1) and packs 8 // nbits codes of its first dimension into one uint8, padding
    that dimension up (optimum.quanto.tensor.packed.pack_weights, 0.2.7; measured: a one-token block of 3 heads at
    4 bits holds 4 rows, not 3). Scales and zero points are counted apart."""
    rows, cols = (values // group, group) if axis == 0 else (group, values // group)
    per_byte = 8 // bits
    return -(-rows // per_byte) * cols


def quanto_group_problem(nbits: int, group: int, axis: int, heads: int, width: int) -> str | None:
    """optimum-quanto, for a stored tensor of `heads` heads of `width` values per token (num_key_value_heads and
    head_dim; a latent's 1 and kv_lora_rank): axis 0 groups along the width; axis -1 groups along batch x heads x
    tokens, so one token must already fill whole groups."""
    if axis == 0:
        return f"q_group_size={group} must divide head_dim={width}" if width % group else None
    if heads % group:
        return f"q_group_size={group} with axis -1 must divide num_key_value_heads={heads}"
    return None


def _cache(name: str, options: SpecOptions, config: PreTrainedConfig) -> Cache:
    """`kvdemo.cache.layers.flush.residual_cache` of quanto's layers (`kvdemo.cache.formats.quanto.layers`), once
    optimum-quanto's extension is pointed at its one build per machine (`kvdemo.cache.formats.quanto.build`: compiled
    by the first process, only loaded by the others)."""
    from kvdemo.cache.layers.flush import residual_cache

    from .build import share_quanto_build
    from .layers import QUANTO_LAYERS

    share_quanto_build()
    return residual_cache(QUANTO_LAYERS, dict(options), config)


def _stored() -> dict[str, type]:
    """optimum-quanto's tensor subclasses a session file flattens and rebuilds (their metadata are strings only:
    quanto's own serialization format)."""
    from optimum.quanto.tensor.packed import PackedTensor  # type: ignore[import-untyped]
    from optimum.quanto.tensor.weights.qbits import WeightQBitsTensor  # type: ignore[import-untyped]

    return {"quanto.WeightQBitsTensor": WeightQBitsTensor, "quanto.PackedTensor": PackedTensor}


def _on_device(device) -> str | None:
    """`kvdemo.cache.formats.quanto.device.quanto_on_device`: what unpacks quanto's stores on a GPU."""
    from .device import quanto_on_device

    return quanto_on_device(device)


BACKEND = Backend(
    NAME,
    "QuantizedCache(backend='quanto'): optimum-quanto int2/int4, group-wise, with a full-precision residual",
    "New tokens wait in the full-precision residual; at residual_length the whole layer is re-quantized "
    "(flush=requantize, transformers') or only the residual block is quantized and appended (flush=append).",
    quantized=True,
    make_cache=_cache,
    kv_bytes=group_bytes(quanto_packed_bytes),
    options=group_options(nbits=(2, 4), axes=(0, -1)),
    group_rule=quanto_group_problem,
    compare_nbits=(4,),  # the default comparison: one spec per backend (`default_compare_specs`)
    module="optimum.quanto",
    pip="pip install optimum-quanto==0.2.7",
    deploy=transformers_rule,
    examples={
        "start": {f"{NAME}:4,residual_length=16": 0},
        "needle": {f"{NAME}:4": 3},
        "plan_base": {NAME: 0},
        "more": {f"{NAME}:2,q_group_size=32,axis_key=-1": 1},
    },
    stored=_stored,
    on_device=_on_device,
    reference="optimum-quanto's own quantizer, through transformers' QuantizedCache (tests/test_dequantize.py)",
)
