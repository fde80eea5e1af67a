"""`hqq`: transformers' `QuantizedCache(backend="hqq")`, HQQ's 1-8 bit group-wise codes with a full-precision
residual (its `optimize` switch: `kvdemo.cache.formats.hqq.optimize`); kvdemo's flush, rotation, K/V precision and
per-layer plan on top (`kvdemo.cache.layers.flush`).

Its folder: the card (here), its layers and their store as codes (`layers`), the fused optimiser (`optimize`, its C
solver `proximal.c`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvdemo.cache.backend import Backend
from kvdemo.cache.deploy import transformers_rule
from kvdemo.cache.layouts import group_bytes
from kvdemo.cache.options import Option, group_options
from kvdemo.cache.policies import OPTIMIZE_CHOICES

if TYPE_CHECKING:
    from transformers import PreTrainedConfig
    from transformers.cache_utils import Cache

    from kvdemo.cache.options import SpecOptions

NAME = __name__.rsplit(".", 1)[-1]
"""The format's name in a spec: its folder's name (a copy of the folder under another name is another format)."""

OPTIMIZE_HELP = "true: hqq's optimiser refines the zero points (as transformers); false: min-max rounding, cheaper"


HQQ_PACKS = {1: (8, 1), 2: (4, 1), 3: (10, 4), 4: (2, 1), 8: (1, 1)}
"""nbits -> (codes per pack, bytes per pack) of hqq 0.2.8's bit packing (hqq.core.bitpack: 8x1bit, 4x2bit, 2x4bit in
a uint8, 10x3bit in an int32; 8-bit codes as they are)."""


def hqq_packed_bytes(bits: int, axis: int, group: int, values: int) -> int:
    """Bytes of hqq's codes for one stored block of `values` values: hqq groups them into a [group, values / group]
    matrix (axis 0) or a [values / group, group] one (axis 1) and packs `HQQ_PACKS` codes of its first
    dimension together, padding it up (hqq.core.bitpack, 0.2.8: 3-bit codes go ten to an int32, so a group of 64
    takes 7 int32 per column: 3.5 bits a value; a group of 32, 4 int32: 4 bits a value). The group rules
    (`hqq_group_problem`) keep the other widths whole."""
    rows, cols = (group, values // group) if axis == 0 else (values // group, group)
    codes, nbytes = HQQ_PACKS[bits]
    return -(-rows // codes) * nbytes * cols


HQQ_VALUES_PER_PACK = {1: 8, 2: 4, 3: 1, 4: 2, 8: 1}
"""Values per byte that hqq's bit packing needs along the packed axis (hqq.core.bitpack: 8x1bit, 4x2bit,
2x4bit in a uint8; 3-bit values go 10 to an int32 and 8-bit ones are stored as they are)."""


def hqq_group_problem(nbits: int, group: int, axis: int, heads: int, width: int) -> str | None:
    """hqq, for a stored tensor of `heads` heads of `width` values per token: the group must fit the width
    (axis 0) or heads x width (axis 1) in whole packs."""
    pack = HQQ_VALUES_PER_PACK[nbits]
    if axis == 0:
        if width % group:
            return f"q_group_size={group} must divide head_dim={width}"
        if group % pack:
            return f"hqq packs {pack} {nbits}-bit values together, so q_group_size must be a multiple of {pack}"
        return None
    if nbits == 3:
        return "hqq's 3-bit packing along axis 1 breaks on some token counts; use axis 0 for 3 bits"
    width = heads * width
    if width % group or (width // group) % pack:
        return (
            f"with axis 1, num_key_value_heads x head_dim / q_group_size = {width}/{group} must be a whole "
            f"multiple of {pack} (hqq packs {pack} {nbits}-bit values together)"
        )
    return None


def _cache(name: str, options: SpecOptions, config: PreTrainedConfig) -> Cache:
    """`kvdemo.cache.formats.hqq.layers.hqq_cache` of the spec's options."""
    from .layers import hqq_cache

    return hqq_cache(dict(options), config)


BACKEND = Backend(
    NAME,
    "QuantizedCache(backend='hqq'): HQQ 1-8 bit, group-wise, with a full-precision residual",
    "New tokens wait in the full-precision residual; at residual_length the whole layer is re-quantized "
    "(flush=requantize, transformers') or only the residual block is quantized and appended (flush=append).",
    quantized=True,
    make_cache=_cache,
    kv_bytes=group_bytes(hqq_packed_bytes),
    options={
        **group_options(nbits=(1, 2, 3, 4, 8), axes=(0, 1)),
        "optimize": Option("optimize", OPTIMIZE_CHOICES[0], choices=OPTIMIZE_CHOICES, help=OPTIMIZE_HELP),
    },
    group_rule=hqq_group_problem,
    compare_nbits=(4,),
    module="hqq",
    pip="pip install hqq==0.2.8.post1",
    deploy=transformers_rule,
    examples={"needle": {f"{NAME}:2": 1, f"{NAME}:4": 2}, "more": {f"{NAME}:4,residual_length=16": 0}},
    reference=(
        "hqq's own quantizer, through transformers' QuantizedCache (tests/test_dequantize.py, "
        "tests/test_hqq_optimize.py)"
    ),
)
