"""The prefill forward pass, in chunks: real progress (tokens done of the total) and a stop between chunks,
building the same cache a single forward pass builds.

A quantized layer (transformers' `QuantizedLayer`, fp8's) quantizes the keys and values of its first update
and attends to the full-precision ones in that same pass; fed chunk by chunk, it would quantize the first
chunk, attend to its de-quantized values in the next chunks and flush again and again. So for a quantized
backend the chunks run over a plain `DynamicCache` (full precision, as inside one forward pass), and the
whole context's keys and values are then given to the quantized cache in one `update` per layer: its first
update, the one a single forward pass makes. Memory: those full-precision keys and values are held until the
last chunk, which a single pass over the whole context needs too (with its attention scores on top).
The exception is a cache whose prefill attends through what it stores, as llama.cpp's does
(`Backend.prefill_reads_cache`, the `ggml` backend): each chunk is written to it and attends to its blocks, exactly
what one pass does there (each token's blocks are its own), so the chunks run over it directly.
Pattern: the chunked prefill of vLLM and SGLang (`--chunked-prefill-size`), here for progress and a stop.

"The same cache" means what two float paths can promise on any CPU (docs/DESIGN.md, invariant 6): the chunks'
full-precision keys and values equal one pass's within float rounding (1.2e-7 to 3.0e-7 measured: other matrix
shapes, other sums), and the quantizer then rounds the same levels except for values that lay within that
rounding of a midpoint, which go one quantization step the other way (seen: 1 value of 46,336 in hqq 8-bit's
layer-1 values on one CI machine, 0.0045 = one step of a 0.92 range; `tests/quantized.py` bounds the share).
Restoring and re-asking repeat the same path and stay exact.

A RoPE whose factors depend on the sequence length (Phi-3's `longrope`, `dynamic` NTK: transformers' rotary
embeddings recompute them from the longest position of each forward, `dynamic_rope_update`) would give the first
chunks the short sequence's factors and the last ones the whole context's (huggingface/transformers PR#33129).
`rope_changes` finds such a RoPE by asking the model's own rotary embeddings (transformers'
`ROPE_INIT_FUNCTIONS[rope_type]`) for the factors at two lengths, whatever its name; for those models the prefill
is one forward pass.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import BaseQuantizedLayer, Cache, DynamicLayer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvdemo.qa.models import LoadedModel
from kvdemo.qa.records import Cancelled

PREFILL_CHUNK_TOKENS = 256
"""Tokens per forward pass of a prefill: about 1-2 s each on 2 CPU cores for the embedded model, so progress
moves and Stop acts within that time."""

ProgressCallback = Callable[[int, int], None]
"""`on_progress(done_tokens, total_tokens)`, called after each chunk; `on_quantize(done_layers, layers)`, called
after each layer the quantized cache has taken."""


def rope_changes(loaded: LoadedModel, shorter: int, longer: int) -> str | None:
    """Whether the model's RoPE factors for a sequence of `longer` tokens differ from those for `shorter` tokens.

    Reads every rotary embedding module of the model (one with a `rope_type` that transformers'
    `ROPE_INIT_FUNCTIONS` knows) and calls its own init function with `seq_len` set to each length; the inverse
    frequencies and the attention scaling are compared exactly. A RoPE that ignores the length (default,
    linear, yarn, llama3) never differs.

    Returns:
        The rope_type whose factors differ (e.g. "longrope"), or None.
    """
    for module in loaded.model.modules():
        rope_type = getattr(module, "rope_type", None)
        init = ROPE_INIT_FUNCTIONS.get(rope_type) if isinstance(rope_type, str) else None
        config = getattr(module, "config", None)
        if init is None or config is None:
            continue
        (short_freq, short_scale), (long_freq, long_scale) = (init(config, None, seq_len=n) for n in (shorter, longer))
        if short_scale != long_scale or not torch.equal(short_freq, long_freq):
            return rope_type
    return None


def check_rope(loaded: LoadedModel, context_tokens: int, more_tokens: int, hint: str) -> None:
    """Refuse a cache whose keys would mix two RoPE factor sets: the model's RoPE factors change between the
    context's length and the `more_tokens` after it that a question and its answer may add (`rope_changes`:
    Phi-3's longrope past `original_max_position_embeddings`, dynamic NTK past `max_position_embeddings`). The
    context's keys, cached once, keep the factors of its length, while every later token would get the other
    ones. transformers' `generate` recomputes the whole cache at that point for Phi-3 (huggingface/transformers
    PR#33129); a cache kept and restored cannot, so `QASession` refuses it.

    Raises:
        ValueError: naming the RoPE, the length where its factors change (found by bisection) and what to do
            (`hint`, e.g. "Lower max_new_tokens").
    """
    kind = rope_changes(loaded, context_tokens, context_tokens + more_tokens)
    if kind is None:
        return
    low, high = context_tokens, context_tokens + more_tokens  # the factors at low are the context's; at high not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if rope_changes(loaded, context_tokens, middle) else (middle, high)
    longer = high + more_tokens <= loaded.max_context_tokens and not rope_changes(loaded, high, high + more_tokens)
    raise ValueError(  # `longer`: a context past the change keeps its factors (longrope's; dynamic NTK's move on)
        f"this model's RoPE ({kind}) takes other factors from {high:,} tokens on, and the context's "
        f"{context_tokens:,} tokens with a question and an answer may reach {context_tokens + more_tokens:,}: the "
        "keys cached with the context's factors would not match the later ones (transformers' generate "
        f"recomputes the whole cache there; a kept cache cannot). {hint} so that the whole stays below "
        f"{high:,} tokens" + (f", or prefill a context of {high:,} tokens or more" if longer else "")
    )


class PrefillStopped(Cancelled):
    """The prefill was stopped between two chunks (Stop, or a new prefill); the cache it was building is dropped
    (`partial` is None)."""


def hand_over(cache: Cache, index: int, layer: DynamicLayer) -> None:
    """Give layer `index` of the quantized `cache` what the full-precision prefill put in `layer`, the same layer of
    a `DynamicCache(config=...)`: a quantized layer takes its keys and values in one update (a sliding layer's are its
    window, and it is told how many tokens the context held, for its mask), and a layer the backend keeps at full
    precision (`kvdemo.cache.model.layer_kinds`: sliding with `sliding=keep`, linear attention, conv, hybrid, KV-shared)
    is that very layer, with its window, its conv and recurrent states and its token count."""
    if not isinstance(cache.layers[index], BaseQuantizedLayer):  # the same class `DynamicCache(config)` builds
        cache.layers[index] = layer
        return
    assert layer.keys is not None and layer.values is not None
    cache.update(layer.keys, layer.values, index)
    target = cast(BaseQuantizedLayer, cache.layers[index])
    target.cumulative_length = layer.get_seq_length()  # a sliding window's keys are fewer than the tokens seen


def run_prefill(
    loaded: LoadedModel,
    cache: Cache,
    ids: Sequence[int],
    handed: bool,
    chunk_tokens: int = PREFILL_CHUNK_TOKENS,
    on_progress: ProgressCallback | None = None,
    stop: threading.Event | None = None,
    on_quantize: ProgressCallback | None = None,
) -> None:
    """Fill the empty `cache` with the keys and values of `ids`, `chunk_tokens` at a time.

    Args:
        loaded: the model; cache: an empty cache built for it.
        ids: the prefix's token ids (length n >= 1); fed as input_ids of shape [1, chunk].
        handed: whether `cache` takes the context handed over (`Backend.hands_over`: it quantizes on update and its
            prefill attends in full precision): then the chunks run over a full-precision `DynamicCache` and the
            cache gets the whole context in one update per layer. Otherwise (`dynamic`; `ggml`, whose prefill
            attends through its blocks as llama.cpp's does) the chunks run over `cache` itself.
        chunk_tokens: tokens per forward pass (>= 1); a context that fits one chunk takes one pass, and so does
            every context of a model whose RoPE factors change between the first chunk's length and the whole
            context's (`rope_changes`): chunks would be given other factors than one pass gives them.
        on_progress: called with (tokens done, n) after each chunk.
        stop: when set before a chunk starts, or before a layer is quantized, the prefill stops.
        on_quantize: for a quantized cache fed from the chunks, called with (0, layers) once the chunks are
            done, then with (layers done, layers) after each layer's first update, which quantizes the whole
            context's keys and values: the prefill's last stage, seconds for `hqq` (its optimiser).

    Raises:
        PrefillStopped: `stop` was set; `cache` is then in an unfinished state and must be dropped.
    """
    total = len(ids)
    if total > chunk_tokens and rope_changes(loaded, chunk_tokens, total):
        chunk_tokens = total
    work = DynamicCache(config=loaded.config) if handed and total > chunk_tokens else cache
    for start in range(0, total, chunk_tokens):
        if stop is not None and stop.is_set():
            raise PrefillStopped(f"the prefill was stopped after {start:,} of {total:,} tokens")
        chunk = torch.tensor([ids[start : start + chunk_tokens]], device=loaded.device)
        with torch.no_grad():  # positions follow from the cache's length, so each chunk continues the last
            loaded.forward(chunk, work)
        if on_progress is not None:
            on_progress(min(start + chunk_tokens, total), total)
    if work is not cache:  # the quantized cache's first update: the whole context, as one forward pass gives it
        layers = cast("list[DynamicLayer]", work.layers)  # a DynamicCache's, prefilled
        if on_quantize is not None:
            on_quantize(0, len(layers))  # the stage starts: the first layer may take seconds
        for index, layer in enumerate(layers):
            if stop is not None and stop.is_set():
                raise PrefillStopped(f"the prefill was stopped while quantizing layer {index + 1} of {len(layers)}")
            hand_over(cache, index, layer)
            if on_quantize is not None:
                on_quantize(index + 1, len(layers))
