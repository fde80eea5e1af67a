"""The layout rules shared by the group-wise backends with a residual (quanto, hqq: `kvdemo.cache.formats`): the
blocks of their store after a prefill and its flushes (`store_blocks`) and their byte formula (`group_bytes`), to which
each backend hands its own packing of codes. Each backend's other rules (its packing, its group rule, its own formula)
live in its module. No torch: the command line's `--help` reads the registry.

The packing rules were found by running every backend over every nbits, q_group_size and axis on the embedded
model's shapes (3 KV heads, head_dim 64) and on the test model's, for prefill lengths 1, 5, 37, 64 and 130 followed
by decode steps with flushes; `tests/test_backends.py::test_validation_predicts_what_runs` repeats that sweep. The
byte formulas are checked against the real tensors (`kvdemo.cache.state.telemetry.kv_memory`) in `tests/test_budget.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvdemo.cache.layer_plan import PLAN, parse_plan
from kvdemo.cache.policies import FLUSH_POLICIES

if TYPE_CHECKING:
    from kvdemo.cache.model.geometry import KVGeometry


def store_blocks(
    flush: str, residual_length: int, prefill_tokens: int, updates: Sequence[int]
) -> tuple[list[int], int]:
    """The blocks (tokens each) of a residual backend's store and the tokens left in its residual after a prefill of
    `prefill_tokens` (one block) and then `updates` (the tokens of each later forward pass: a question's, then one per
    decode step). A pass flushes when the residual and its new tokens reach `residual_length` (transformers'
    `QuantizedLayer.update`, kept by kvdemo's `AppendFlushMixin`): `requantize` quantizes the whole layer again into
    one block, `append` adds the residual and the new tokens as one more block (`kvdemo.cache.layers.flush`).

    Example:
        >>> store_blocks("append", 1, 250, [7, 1, 1])
        ([250, 7, 1, 1], 0)
    """
    blocks, residual = [prefill_tokens], 0
    for new in updates:
        if residual + new < residual_length:
            residual += new
        elif flush == FLUSH_POLICIES[1]:
            blocks, residual = [*blocks, residual + new], 0
        else:
            blocks, residual = [sum(blocks) + residual + new], 0
    return blocks, residual


PackedBytes = Callable[[int, int, int, int], int]
"""`packed(nbits, axis, q_group_size, values) -> bytes` of a library's codes for one stored block."""


def group_bytes(packed: PackedBytes) -> Callable[..., float]:
    """Group-wise affine quantization with a full-precision residual: `residual` tokens in the model's dtype, the
    others in the store's blocks, each block's keys and values packed as the library packs them (`packed`, e.g.
    `quanto_packed_bytes`) plus a scale and a zero point in the model's dtype per group of q_group_size values, summed
    over the quantized layers of `geo` (each its own key and value widths: a latent's differ). Source:
    x ~ scale * (q - zero) per group (HQQ, Badri and Shaji 2023; optimum-quanto) with KIVI's full-precision residual
    (Liu et al. 2024), whose keys and values take their bits apart (its `k_bits`, `v_bits`). With a per-layer `plan`
    (`kvdemo.cache.layer_plan`) each quantized layer takes its own bits; the scales are the same. A sliding layer
    quantized (`sliding=quantize`) holds at most its window in its store, as one block.

    `blocks` are the token counts of the store's blocks: with `flush=requantize` one (the default, tokens - residual),
    with `flush=append` the prefill's, then one per flush (`kvdemo.cache.layers.flush`). Every grouping these backends
    allow splits one token's values into whole groups (the group rules), so the scales do not depend on the blocks;
    the packing does: each block pads its packed dimension up on its own, so that a store of one-token blocks holds
    more than one block of the same tokens (quanto, 3 KV heads, 4 bits: 4 rows a token, not 3). With `nominal` the
    codes count nbits a value exactly, with no padding (the textbook figure)."""

    def layer_bits(opts, layers: int) -> list[tuple[int, int]]:
        """(key bits, value bits) per quantized layer: the same pair for every layer, or the plan's."""
        if opts.get(PLAN):
            return [(p.nbits, p.nbits_value) for p in parse_plan(opts[PLAN])]
        return [(opts["nbits"], opts.get("nbits_value", opts["nbits"]))] * layers

    def formula(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
        group = opts["q_group_size"]
        stored = [tokens - residual] if blocks is None else list(blocks)
        total = 0.0
        for layer, bits in zip(geo.per_layer, layer_bits(opts, geo.layers)):
            held = stored if layer.window is None else [layer.tokens_held(tokens - residual)]
            for heads, width, nbits, axis in (
                (layer.key_heads, layer.key_dim, bits[0], opts.get("axis_key", 0)),
                (layer.value_heads, layer.value_dim, bits[1], opts.get("axis_value", 0)),
            ):
                values = [heads * width * block for block in held if block]
                codes = sum(v * nbits / 8 if nominal else packed(nbits, axis, group, v) for v in values)
                total += codes + 2 * element * sum(values) / group + heads * width * element * residual
        return total

    return formula
