"""How each backend lays its store out, as the registry (`kvdemo.cache.registry.BACKENDS`) reads it: the byte
formulas (bytes a cache holds, from the model's shape, before anything runs; `kvdemo.cache.spec.estimate_kv_bytes`)
and the packing rules for `q_group_size` (which group sizes a library's layout takes). No torch: the command line's
`--help` reads the registry.

The packing rules were found by running every backend over every nbits, q_group_size and axis on the embedded
model's shapes (3 KV heads, head_dim 64) and on the test model's, for prefill lengths 1, 5, 37, 64 and 130 followed
by decode steps with flushes; `tests/test_backends.py::test_validation_predicts_what_runs` repeats that sweep. The
byte formulas are checked against the real tensors (`kvdemo.cache.telemetry.kv_memory`) in `tests/test_budget.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvdemo.cache.layer_plan import PLAN, parse_plan
from kvdemo.cache.policies import FLUSH_POLICIES

if TYPE_CHECKING:
    from kvdemo.cache.geometry import KVGeometry


def full_precision_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """Every value in the model's dtype; with `storage=growing` (`kvdemo.cache.layers.storage.GrowingLayer`) the
    buffers' whole capacity, at most `capacity_bound(tokens)` tokens (an upper bound, reached right after a one-pass
    prefill; up to max(256 tokens, 12.5 %) above the tokens held). `nominal` counts the tokens held only."""
    from kvdemo.cache.layers.storage import capacity_bound

    held = capacity_bound(tokens) if opts.get("storage") == "growing" and not nominal else tokens
    # a sliding layer keeps its window, as transformers builds it under either storage
    return element * sum(
        layer.values_per_token * layer.tokens_held(held if layer.window is None else tokens) for layer in geo.per_layer
    )


def fp8_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """One byte per value held (float8_e4m3; a sliding layer its window, `kvdemo.cache.layers.sliding`) plus one float32
    scale per layer and tensor (transformers' `Fp8QuantizedLayer`; kvdemo's de-quantization, `kvdemo.cache.layers.fp8`,
    holds nothing more), or with `scale=per_token_head` one float32 scale per token held, head and tensor
    (`kvdemo.cache.layers.fp8.PerTokenHeadFp8Layer`). `geo`: the quantized layers."""
    if opts.get("scale", "per_tensor") == "per_tensor":
        return geo.values_held(tokens) + 2 * len(geo.kv_layers) * 4
    scales = sum(4 * (layer.key_heads + layer.value_heads) * layer.tokens_held(tokens) for layer in geo.per_layer)
    return geo.values_held(tokens) + scales


TURBOQUANT_FP8_KEYS = 8
"""turboquant's nbits of float8 keys with a float32 scale per token and head (vLLM's `k8v4`)."""


def turboquant_bytes(opts, geo: KVGeometry, tokens, residual, element, nominal, blocks=None) -> float:
    """kvdemo's TurboQuant layout (`kvdemo.cache.layers.turboquant`, vLLM's `TurboQuantConfig.key_packed_size` and
    `value_packed_size`), per quantized layer, token and head: keys head_dim x nbits / 8 bytes of packed Lloyd-Max
    codes and a float16 norm (nbits 8: head_dim float8 codes and a float32 scale); values head_dim x nbits_value / 8
    bytes and a float16 scale and zero point; `residual` tokens in the model's dtype. Codes are packed densely (3 bits
    take 3), so `nominal` changes nothing, and nothing pads per block (`blocks` is ignored). A sliding layer quantized
    holds at most its window in its store."""
    key_bits, value_bits = opts["nbits"], opts.get("nbits_value", opts["nbits"])
    key_extra = 4 if key_bits == TURBOQUANT_FP8_KEYS else 2
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
    return None


def turboquant_width_problem(opts, tensor: str, width: int) -> str | None:
    """Why turboquant cannot store `tensor` (`keys` or `values`) of `width` values per head and token, or None: codes
    are packed eight at a time (a width a multiple of 8, but for 8-bit codes), and rotated keys need a Hadamard block of
    8 or more (`kvdemo.cache.layers.rotation.rotation_problem`)."""
    bits = opts["nbits"] if tensor == "keys" else opts.get("nbits_value", opts["nbits"])
    if bits == TURBOQUANT_FP8_KEYS:
        return None
    if tensor == "keys":
        from kvdemo.cache.layers.rotation import rotation_problem  # torch: only once a model is given

        problem = rotation_problem(width)
        if problem:
            return "turboquant rotates its keys: " + problem.replace("use rotation=none", "use nbits=8 (fp8 keys)")
    if width % 8:
        return f"turboquant packs {bits}-bit codes eight at a time, so head_dim must be a multiple of 8, not {width}"
    return None


def quanto_packed_bytes(bits: int, axis: int, group: int, values: int) -> int:
    """Bytes of optimum-quanto's codes for one stored block of `values` values (one layer's keys or values, batch x
    heads x tokens x width): quanto groups them into a [values / group, group] matrix (axis 0) or a
    [group, values / group] one (axis -1) and packs 8 // nbits codes of its first dimension into one uint8, padding
    that dimension up (optimum.quanto.tensor.packed.pack_weights, 0.2.7; measured: a one-token block of 3 heads at
    4 bits holds 4 rows, not 3). Scales and zero points are counted apart."""
    rows, cols = (values // group, group) if axis == 0 else (group, values // group)
    per_byte = 8 // bits
    return -(-rows // per_byte) * cols


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


def quanto_group_problem(nbits: int, group: int, axis: int, heads: int, width: int) -> str | None:
    """optimum-quanto, for a stored tensor of `heads` heads of `width` values per token (num_key_value_heads and
    head_dim; a latent's 1 and kv_lora_rank): axis 0 groups along the width; axis -1 groups along batch x heads x
    tokens, so one token must already fill whole groups."""
    if axis == 0:
        return f"q_group_size={group} must divide head_dim={width}" if width % group else None
    if heads % group:
        return f"q_group_size={group} with axis -1 must divide num_key_value_heads={heads}"
    return None


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
