"""The out-of-memory guard: the bytes a session will hold for its KV cache, estimated from the model's shape
before anything runs, and the refusal when they exceed a budget."""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedConfig

from kvdemo.cache.policies import FLUSH_POLICIES
from kvdemo.cache.spec import CacheSpec, estimate_kv_bytes


class KVBudgetError(ValueError):
    """A prefill refused because its estimated KV cache exceeds the session's `kv_budget_bytes`.

    Attributes:
        estimate_bytes: the estimate (`backends.estimate_kv_bytes`); budget_bytes: the limit.
    """

    def __init__(self, message: str, estimate_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.estimate_bytes = estimate_bytes
        self.budget_bytes = budget_bytes

    def __reduce__(self) -> tuple[Any, ...]:  # pickled whole: a refusal in a device worker is raised again as itself
        return type(self), (str(self), self.estimate_bytes, self.budget_bytes)


def held_bytes_estimate(
    spec: CacheSpec, config: PreTrainedConfig, dtype: torch.dtype, context_tokens: int, reserve_tokens: int
) -> int:
    """The bytes held for a cache of `spec` with `context_tokens` prefilled and `reserve_tokens` more decoded (a
    question and its answer): the peak that `telemetry.kv_memory(cache, snapshot)` can report.

    - the cache: `spec.estimate_kv_bytes` with the reserve in the residual as far as it reaches, and with
      `flush=append` the rest in blocks of residual_length (the most blocks it can take, each padded on its own);
    - plus what the snapshot keeps alive meanwhile: for a quantized backend the post-prefill store (less the
      per-layer constants it shares with the cache: fp8's scales), once the
      cache replaces it: fp8 at the first decode step (`torch.cat` builds a new store), a residual backend at
      its first flush, which comes when `reserve_tokens >= residual_length` (the residual is empty after the
      prefill). `dynamic` keeps only lengths.
    """
    opts, blocks = spec.resolved(), None
    if opts.get("flush") == FLUSH_POLICIES[1]:
        # the most blocks the reserve can flush: the residual full, the rest in blocks of residual_length
        # (a flush takes at least that many), each padded on its own (`kvdemo.cache.layouts.group_bytes`)
        length = opts["residual_length"]
        stored = reserve_tokens - min(reserve_tokens, length)
        blocks = [context_tokens] + [length] * (stored // length) + ([stored % length] if stored % length else [])
    held = estimate_kv_bytes(
        spec, config, context_tokens + reserve_tokens, dtype, residual_tokens=reserve_tokens, blocks=blocks
    )
    info = spec.info
    flushes = not spec.keeps_residual or reserve_tokens >= spec.resolved()["residual_length"]
    if info.quantized and reserve_tokens > 0 and flushes:
        # the post-prefill store's tokens; its per-layer constants (fp8's scales, the store of no token) are the
        # very tensors the cache still holds, counted once
        held += estimate_kv_bytes(spec, config, context_tokens, dtype) - estimate_kv_bytes(spec, config, 0, dtype)
    return held


def check_budget(
    spec: CacheSpec,
    config: PreTrainedConfig,
    dtype: torch.dtype,
    budget_bytes: int | None,
    context_tokens: int,
    reserve_tokens: int,
    advice: str | None = None,
) -> None:
    """Refuse a prefill (or an answer) whose `held_bytes_estimate` exceeds `budget_bytes` (None: no limit).

    Raises:
        KVBudgetError: with the estimate, the budget and what to change (`advice`, or the context length that fits).
    """
    if budget_bytes is None:
        return
    estimate = held_bytes_estimate(spec, config, dtype, context_tokens, reserve_tokens)
    if estimate <= budget_bytes:
        return
    if advice is None:
        per_token = estimate / (context_tokens + reserve_tokens)
        fits = max(int(budget_bytes / per_token) - reserve_tokens, 0)
        advice = (
            f"Shorten the context to about {fits:,} tokens, or choose a backend with fewer bits (e.g. hqq with nbits 2)"
        )
    raise KVBudgetError(
        f"a {spec.label} KV cache for this context ({context_tokens:,} tokens + {reserve_tokens} for a "
        f"question and its answer) would hold about {estimate / 2**20:,.1f} MiB; the KV budget is "
        f"{budget_bytes / 2**20:,.1f} MiB. {advice}",
        estimate,
        budget_bytes,
    )
