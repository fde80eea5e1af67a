"""A model-kind probe: a few tokens run through a spec's cache before the prefill, to refuse what the config alone
cannot show wrong.

Some models keep state that transformers' cache layers do not hold (RWKV, xLSTM, RecurrentGemma keep it on their
modules; MiniMax builds a cache of its own), and some change the keys and values between `cache.update` and
attention (DiffLlama, JetMoE, Doge), which kvdemo's block-wise read and query-side rotation cannot follow. Their
configs look like any other. So, once per model and spec, `check_model` prefills `PROBE_TEXT`'s first tokens into a
cache of the spec, decodes the last two, restores the cache and decodes the first again, and checks:

1. the cache holds every token fed (its length);
2. the first decode gives the same logits before and after the restore, bit for bit (the restore restored
   everything the model reads);
3. for the full-precision backend, the logits are those of one cache-free forward pass of the same tokens (within
   float rounding);
4. for a quantized backend, the logits are those of the same cache read whole (`kvdemo.cache.layers.flush.read_whole`:
   no block-wise read, a rotation undone on read), within half of what quantization moves them from a cache-free pass.
   Where they are not, the run is made once more with the block-wise marks kept but the blocks read whole
   (`kvdemo.cache.layers.attention.materialized_blocks`): if that agrees with the read-whole cache, kvdemo's own
   block-wise read is wrong, and the refusal says so (a kvdemo bug); if not, the model changes the keys and values
   between the cache and attention.

Any failure, or any exception the model raises, is an `UnsupportedModelError` (a `ValueError`) when the session is
built, before the prefill: the message says what failed and what would work. A probe costs five forward passes of
one token, once per (model, spec): three on kvdemo's read (two decode steps, the restore, one again), two on the
read-whole cache. A quantized cache takes its context as a long prefill's last stage gives it, from a full-precision
prefill (`kvdemo.qa.prefill.hand_over`); that prefill and the cache-free pass are made once per model.
"""

from __future__ import annotations

import copy
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvdemo.cache.layers.attention import materialized_blocks
from kvdemo.cache.layers.flush import read_whole, recorded_writes, replayed_writes
from kvdemo.cache.model.layer_kinds import UnsupportedModelError
from kvdemo.cache.registry import BACKENDS
from kvdemo.cache.spec import CacheSpec, build_cache
from kvdemo.cache.state import snapshot
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prefill import hand_over
from kvdemo.qa.prompt import TOKENIZER_LOCK

PROBE_TEXT = "The Normans gave their name to Normandy, a region in the north of France."
DECODED = 2
"""Tokens the probe decodes one at a time after its prefill."""
QUANTIZATION_SHARE = 0.5
"""How far kvdemo's read may move the logits from the same cache read whole, as a share of how far quantization
moves them from a cache-free pass (DiffLlama: 1.3 against 0.04; the embedded model's hqq:2 rotated: 0.04, within)."""


def _tolerance(loaded: LoadedModel, reference: torch.Tensor) -> float:
    """Float rounding between two orders of the same arithmetic, in logits: 1e-3 of their scale in float32, 5e-2 in
    half precision (invariant 6's kind of bound, loose enough for any real model's sums)."""
    scale = max(1.0, float(reference.abs().max()))
    return (1e-3 if loaded.dtype == torch.float32 else 5e-2) * scale


def _run(
    loaded: LoadedModel, spec: CacheSpec, ids: torch.Tensor, restore: bool = True
) -> tuple[torch.Tensor, str | None]:
    """Prefill, decode `DECODED` tokens, restore, decode the first again, on a new cache of `spec`: (the last decode's
    logits, what went wrong or None). Without `restore`, only the prefill and the decodes (the reference run of the
    same cache: the restore was checked on kvdemo's own read). A quantized cache is prefilled as a long context's
    prefill fills it, from a full-precision prefill of the same tokens (`hand_over`; that prefill made once per
    model, each run given its own copy)."""
    cache, split, total = build_cache(spec, loaded.config), ids.shape[-1] - DECODED, ids.shape[-1]
    with torch.no_grad():
        if spec.info.hands_over:
            for index, layer in enumerate(_prefill_layers(loaded, ids[:, :split])):
                hand_over(cache, index, layer)
        else:
            loaded.forward(ids[:, :split], cache)
        saved = snapshot.take(cache) if restore else None
        decoded = [loaded.forward(ids[:, i : i + 1], cache)[0, -1].float() for i in range(split, total)]
        if saved is None:
            return decoded[-1], None
        held = snapshot.attention_length(cache)
        if held != total:
            return decoded[-1], f"the cache holds {held} of the {total} tokens fed: the model keeps its state elsewhere"
        snapshot.restore(cache, saved)
        again = loaded.forward(ids[:, split : split + 1], cache)[0, -1].float()
    if not torch.equal(decoded[0], again):
        return decoded[-1], "restoring the cache does not restore the model: it keeps state outside transformers' cache"
    return decoded[-1], None


def _prefill_layers(loaded: LoadedModel, ids: torch.Tensor) -> list[DynamicLayer]:
    """A copy of each layer of a `DynamicCache` prefilled with `ids` (the prefill made once per model): what a
    quantized cache takes its context from."""
    found: dict[tuple[int, ...], DynamicCache] = loaded.__dict__.setdefault("_probe_prefill", {})
    key = tuple(ids[0].tolist())
    if key not in found:  # kept only once the forward pass has run
        prefilled = DynamicCache(config=loaded.config)
        loaded.forward(ids, prefilled)
        found[key] = prefilled
    return [cast(DynamicLayer, copy.deepcopy(layer)) for layer in found[key].layers]  # a decode may change one in place


def _cache_free(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """The last logits of one cache-free forward pass of `ids`, once per model (every spec's probe compares with it)."""
    found: dict[tuple[int, ...], torch.Tensor] = loaded.__dict__.setdefault("_probe_free", {})
    key = tuple(ids[0].tolist())
    if key not in found:
        with torch.no_grad():
            found[key] = loaded.model(input_ids=ids, use_cache=False).logits[0, -1].float()
    return found[key]


def _probe(loaded: LoadedModel, spec: CacheSpec) -> str | None:
    """Why `spec` cannot be served right on this model, or None."""
    with TOKENIZER_LOCK:
        probe_ids = loaded.tokenizer(PROBE_TEXT)["input_ids"][: 8 + DECODED]
    ids = torch.tensor([probe_ids], device=loaded.device)
    try:
        with recorded_writes() as writes:
            logits, problem = _run(loaded, spec, ids)
        if problem:
            return problem
        free = _cache_free(loaded, ids)
        if not spec.info.quantized:
            gap = float((logits - free).abs().max())
            if gap > _tolerance(loaded, free):
                return (
                    f"its cached forward pass differs from a cache-free one by {gap:.3g} in the logits (a "
                    f"{spec.backend} cache stores exactly what the model wrote: its card says quantized=False)"
                )
            return None
        with read_whole(), replayed_writes(writes):  # the same bytes where a layer quantizes each token it writes
            reference, _ = _run(loaded, spec, ids, restore=False)
    except Exception as error:  # the model's own failure, whatever its type: refused, never a traceback
        return f"a {len(ids[0])}-token run on a {spec.text} cache failed: {type(error).__name__}: {error}"
    # the two reads hold the same stored values (a layer that quantizes each new token as it comes replays the first
    # run's bytes); a value within rounding of a level's midpoint may still round the other way elsewhere (invariant
    # 6), so the bar is half of what quantization itself moves the logits, plus float rounding
    gap, quantization = float((logits - reference).abs().max()), float((reference - free).abs().max())
    if gap > _tolerance(loaded, reference) + QUANTIZATION_SHARE * quantization:
        with materialized_blocks(), replayed_writes(writes):  # the marks kept, the blocks read whole: kvdemo or model?
            marked, _ = _run(loaded, spec, ids, restore=False)
        if float((marked - reference).abs().max()) <= _tolerance(loaded, reference):
            return (
                f"kvdemo's own block-wise read of this cache (torch's CPU flash kernel over the de-quantized blocks) "
                f"differs by {gap:.3g} in the logits from the same blocks read whole, which agree with the cache read "
                "whole: a kvdemo bug, not the model's behaviour (please report it with the spec)"
            )
        return (
            f"the model changes the keys and values between the cache and attention (its logits over kvdemo's "
            f"block-wise or rotated read differ by {gap:.3g} from the same cache read whole, against "
            f"{quantization:.3g} between that cache and a cache-free pass)"
        )
    return None


def check_model(loaded: LoadedModel, spec: CacheSpec) -> None:
    """Refuse `spec` on this model before the prefill where the probe (module docstring) shows it would be wrong;
    checked once per model and spec (the result is kept on `loaded`).

    Args:
        loaded: the model.
        spec: a spec validated on the model (`CacheSpec.validate(config)`).

    Raises:
        UnsupportedModelError (a ValueError): the message says what failed and what would work.
    """
    found: dict[str, str | None] = loaded.__dict__.setdefault("_probes", {})
    key = spec.full_text  # every option resolved: the page's fields and a typed spec of the same cache share it
    if key not in found:
        found[key] = _probe(loaded, spec)
    problem = found[key]
    if problem is None:
        return
    baseline = CacheSpec(next(name for name, backend in BACKENDS.items() if not backend.quantized))
    works = spec.info.quantized and _check_quietly(loaded, baseline)
    advice = f"backend={baseline.backend} serves it" if works else "kvdemo cannot serve this model"
    raise UnsupportedModelError(f"{spec.text} on {loaded.name}: {problem}. {advice}")


def _check_quietly(loaded: LoadedModel, spec: CacheSpec) -> bool:
    try:
        check_model(loaded, spec)
    except UnsupportedModelError:
        return False
    return True
