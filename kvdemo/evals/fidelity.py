"""How far a quantized KV cache moves the model, beyond its answers: the statistics of the next-token
distributions against `dynamic`, perplexity through the cache, where in the cache the error sits, and whether
re-quantizing at each flush makes it grow.

- **Distribution statistics** (`position_fidelity`, `KLStats`): over all teacher-forced positions of the answers,
  KL(P_dynamic || P_spec) per position (mean, median, 99th percentile, maximum), the share of positions whose
  most likely token is `dynamic`'s ("same top p"), and |Δ log p| of `dynamic`'s token. They are computed from the
  log-probabilities `QASession.score` already gives, with no further decode pass. The names follow the
  "KL divergence statistics" and "Token probability statistics" that llama.cpp's perplexity tool prints with
  `--kl-divergence` (ggml-org/llama.cpp, tools/perplexity/perplexity.cpp, commit 050fc7f: "Mean KLD",
  "Median KLD", "99.0% KLD", "Maximum KLD", "Same top p"), with its percentile rule (linear interpolation at
  fraction x (n - 1) of the sorted values). One difference: llama.cpp's Δp is the signed change of the
  *probability* of the text's token; here it is |Δ log p| of `dynamic`'s token, in nats, as the issue asks.
- **Perplexity through the cache** (`perplexity_inputs`, `perplexity`): prefill a context into a fresh cache,
  then feed the next N + 1 tokens of real text one decode step at a time, so that each token attends to the
  quantized store and the residual exactly as in generation (flushes included); the N predictions of the
  tokens after the first give PPL = exp(mean negative log-likelihood), KIVI's and KVQuant's headline figure.
- **Where the error sits** (`reference_kv`, `dequantized_kv`, `kv_error`): per layer and KV head, the relative
  error ||K - K^||_F / ||K||_F and ||V - V^||_F / ||V||_F of the de-quantized cache against the full-precision
  keys and values of the same tokens. De-quantizing uses each backend's own code (the layer's `_dequantize`:
  optimum-quanto's `dequantize()`, hqq's `Quantizer.dequantize`, transformers' fp8 scale), never a quantizer
  of ours.
- **Drift across flushes** (`context_error`, `drift_ratio`): transformers' flush de-quantizes the whole store,
  appends the residual and quantizes everything again (`QuantizedLayer.update`); the context's own tokens are
  measured again after each flush, against their error after the prefill.

The full-precision reference is exact: during the prefill a `QuantizedLayer` (and fp8's layer) returns the
states it was given, so every layer's attention, and so every key and value of the context, is computed in
full precision, as in a `DynamicCache`; `tests/test_fidelity.py` checks it bit for bit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvdemo.cache.spec import CacheSpec, build_cache, estimate_kv_bytes
from kvdemo.cache.state.budget import KVBudgetError
from kvdemo.cache.state.telemetry import flushed_layers
from kvdemo.evals.cache_error import KV, ReferenceKV, as_reference, context_error
from kvdemo.evals.metrics import kl_divergence
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prefill import check_rope
from kvdemo.qa.probe import check_model
from kvdemo.qa.prompt import PreparedContext


# ---- distribution statistics ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PositionFidelity:
    """Per teacher-forced position, a cache's next-token distribution against `dynamic`'s (tensors of shape [n]).

    Attributes:
        kl: KL(P_dynamic || P_spec) in nats.
        same_top: whether both distributions have the same most likely token (bool).
        abs_dlogp: |log P_dynamic(t) - log P_spec(t)| of `dynamic`'s token t at that position, in nats.
        dp: P_spec(t) - P_dynamic(t) of `dynamic`'s token t, a probability in [-1, 1] (llama.cpp's Δp, whose token
            is the text's: here `dynamic`'s answer is the text).
    """

    kl: torch.Tensor
    same_top: torch.Tensor
    abs_dlogp: torch.Tensor
    dp: torch.Tensor


def position_fidelity(reference: torch.Tensor, other: torch.Tensor, tokens: Sequence[int]) -> PositionFidelity:
    """Compare two teacher-forced runs position by position.

    Args:
        reference: `dynamic`'s log-probabilities, shape [n, vocab] (e.g. from `QASession.score`).
        other: the cache under test's log-probabilities for the same positions, shape [n, vocab].
        tokens: `dynamic`'s token at each position (length n): the answer that was teacher-forced.

    Returns:
        A `PositionFidelity` of n positions.

    Raises:
        ValueError: the shapes differ, or `tokens` is not one token per row.
    """
    kl = kl_divergence(reference, other)
    if len(tokens) != reference.shape[0]:
        raise ValueError(f"{len(tokens)} tokens for {reference.shape[0]} positions; give one token per row")
    index = torch.as_tensor(list(tokens), dtype=torch.long, device=reference.device).unsqueeze(-1)
    ref_lp, other_lp = reference.gather(-1, index).squeeze(-1), other.gather(-1, index).squeeze(-1)
    return PositionFidelity(
        kl=kl,
        same_top=reference.argmax(-1) == other.argmax(-1),
        abs_dlogp=(ref_lp - other_lp).abs(),
        dp=other_lp.double().exp() - ref_lp.double().exp(),
    )


def percentile(values: torch.Tensor, fraction: float) -> float:
    """The `fraction` quantile of `values` (shape [n], n >= 1) by linear interpolation between the sorted values at
    position fraction x (n - 1): llama.cpp's `percentile` in tools/perplexity/perplexity.cpp, and
    `torch.quantile`'s default. The median is `percentile(values, 0.5)`.

    Raises:
        ValueError: no values, or a fraction outside [0, 1].
    """
    if values.numel() == 0:
        raise ValueError("no values to take a percentile of")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction={fraction} must be between 0 and 1")
    ordered = values.detach().double().flatten().sort().values
    position = fraction * (ordered.numel() - 1)
    low = int(math.floor(position))
    high = min(low + 1, ordered.numel() - 1)
    weight = position - low
    if weight == 0 or ordered[low] == ordered[high]:  # also an infinite value as it is (0 x inf would be NaN)
        return float(ordered[low])
    return float((1 - weight) * ordered[low] + weight * ordered[high])


@dataclass(frozen=True)
class KLStats:
    """Distribution statistics of one cache against `dynamic`, pooled over every teacher-forced position.

    Attributes (llama.cpp's `--kl-divergence` name in brackets):
        positions: the positions pooled (answer tokens over all questions).
        mean_kld, median_kld, p99_kld, p999_kld, max_kld: KL(P_dynamic || P_spec) per position in nats/token
            ["Mean KLD", "Median KLD", "99.0% KLD", "99.9% KLD", "Maximum KLD"].
        same_top_p: percent of positions whose most likely token is `dynamic`'s ["Same top p"].
        rms_dp: the root mean square of Δp, P_spec(t) - P_dynamic(t) of `dynamic`'s token, in percent ["RMS Δp"].
        mean_abs_dlogp, p99_abs_dlogp: mean and 99th percentile of |Δ log p| of `dynamic`'s token (nats); no
            llama.cpp equivalent (its Δp is the signed change of the text token's probability).
    """

    positions: int
    mean_kld: float
    median_kld: float
    p99_kld: float
    max_kld: float
    same_top_p: float
    mean_abs_dlogp: float
    p99_abs_dlogp: float
    p999_kld: float
    rms_dp: float

    @classmethod
    def pool(cls, parts: Sequence[PositionFidelity]) -> KLStats:
        """Pool the positions of several answers (each a `position_fidelity`) into one set of statistics.

        Raises:
            ValueError: no position at all.
        """
        if not parts or sum(p.kl.numel() for p in parts) == 0:
            raise ValueError("no teacher-forced position to pool; give at least one answer token")
        kl = torch.cat([p.kl.double().flatten() for p in parts])
        same = torch.cat([p.same_top.flatten() for p in parts])
        dlogp = torch.cat([p.abs_dlogp.double().flatten() for p in parts])
        dp = torch.cat([p.dp.double().flatten() for p in parts])
        return cls(
            positions=kl.numel(),
            mean_kld=float(kl.mean()),
            median_kld=percentile(kl, 0.5),
            p99_kld=percentile(kl, 0.99),
            max_kld=float(kl.max()),
            same_top_p=100.0 * float(same.double().mean()),
            mean_abs_dlogp=float(dlogp.mean()),
            p99_abs_dlogp=percentile(dlogp, 0.99),
            p999_kld=percentile(kl, 0.999),
            rms_dp=100.0 * float(dp.square().mean().sqrt()),
        )


def kl_statistics(
    reference: Sequence[torch.Tensor], other: Sequence[torch.Tensor], tokens: Sequence[Sequence[int]]
) -> KLStats:
    """`KLStats` of several teacher-forced answers: `position_fidelity` per answer, pooled.

    Args:
        reference: `dynamic`'s log-probabilities per answer, each [n_i, vocab].
        other: the cache under test's, the same shapes.
        tokens: `dynamic`'s answer tokens, each of length n_i.

    Raises:
        ValueError: the lists differ in length, a shape differs, or there is no position.

    Example:
        >>> stats = kl_statistics([ref_logprobs], [spec_logprobs], [dynamic_answer_ids])
        >>> stats.same_top_p, stats.p99_kld
    """
    if not len(reference) == len(other) == len(tokens):
        raise ValueError(
            f"{len(reference)} reference, {len(other)} other and {len(tokens)} token lists; give one each per answer"
        )
    return KLStats.pool([position_fidelity(r, o, t) for r, o, t in zip(reference, other, tokens)])


# ---- perplexity through the cache -------------------------------------------------------------------------------
@dataclass(frozen=True)
class PerplexityInputs:
    """A context's token ids and the real text after it, as `perplexity` feeds them.

    Attributes:
        context_ids: the prefill: the chat template's opening and the context, as `QASession.context_ids` gives.
        continuation_ids: N + 1 tokens of the text after the context; N of them are fed, one decode step each,
            each predicting the next.
        source: `continuation` (text after the context was given, e.g. the article's next paragraphs) or `tail`
            (the last N + 1 tokens of the context itself were held out of the prefill).
    """

    context_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...]
    source: str

    @property
    def tokens(self) -> int:
        """N: the tokens scored."""
        return len(self.continuation_ids) - 1


def perplexity_inputs(
    loaded_model: LoadedModel, context: str | PreparedContext, tokens: int, continuation: str | None = None
) -> PerplexityInputs:
    """What a perplexity run prefills and feeds.

    Layout: the continuation's tokens come straight after the context's, inside the user turn where the context
    sits, before the question part of the chat template (`"\\n\\n" + question`, end of the user turn, opening of
    the assistant turn). They continue the context as text; fed after the template's question part they would be
    scored as an answer, which the real text is not. The context is tokenized as `QASession` tokenizes it and the
    continuation on its own (`QASession.text_ids`); a plain forward over the same ids is the reference.

    Args:
        tokens: N >= 1, the tokens to score.
        continuation: the text after the context (for a SQuAD case, `Case.continuation`: the article's next
            paragraphs, starting with the blank line that joins paragraphs); its first N + 1 tokens are used.
            None: the last N + 1 tokens of the context are held out of the prefill and fed instead (the tail of
            the user's own text).

    Raises:
        ValueError: N < 1 or not an integer, an empty context, a continuation shorter than N + 1 tokens, a
            context too short to hold out N + 1 tokens and keep one, or a context plus N tokens over the window.

    Example:
        >>> case = load_case(example_path("normans")).select("0-11")
        >>> inputs = perplexity_inputs(loaded, case.context, 256, case.continuation)
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"perplexity tokens={tokens!r} must be a whole number >= 1")
    if not isinstance(context, PreparedContext) and (not isinstance(context, str) or not context.strip()):
        raise ValueError("the context is empty; paste or upload the text to ask about")
    prefix = loaded_model.context_ids(context)  # a PreparedContext is not tokenized again
    if continuation is not None:
        following = loaded_model.text_ids(continuation) if isinstance(continuation, str) else []
        if len(following) < tokens + 1:
            raise ValueError(
                f"the continuation holds {len(following)} tokens; scoring {tokens} needs {tokens + 1} (each fed "
                f"token predicts the next). Lower the perplexity tokens to at most {max(len(following) - 1, 0)} or "
                "give a longer continuation"
            )
        context_ids, continuation_ids, source = prefix, following[: tokens + 1], "continuation"
    else:
        text = context.text if isinstance(context, PreparedContext) else context
        text_tokens = len(loaded_model.text_ids(text))  # the text's own tokens, without the template's
        if text_tokens < tokens + 2:
            raise ValueError(
                f"the context holds {text_tokens} tokens; holding out its last {tokens + 1} to score {tokens} leaves "
                f"none to prefill. Lower the perplexity tokens to at most {max(text_tokens - 2, 0)} or give a "
                "continuation"
            )
        context_ids, continuation_ids, source = prefix[: -(tokens + 1)], prefix[-(tokens + 1) :], "tail"
    limit = loaded_model.max_context_tokens
    if len(context_ids) + tokens > limit:
        raise ValueError(
            f"the context ({len(context_ids)} tokens) and {tokens} fed tokens exceed the model's {limit}-token "
            f"window; lower the perplexity tokens to at most {limit - len(context_ids)} or shorten the context"
        )
    return PerplexityInputs(tuple(context_ids), tuple(continuation_ids), source)


@dataclass(frozen=True)
class PerplexityResult:
    """Perplexity of real text read through one cache.

    Attributes:
        tokens: N, the tokens scored; context_tokens: the tokens prefilled.
        perplexity: exp(mean_nll).
        mean_nll: the mean negative log-likelihood of the scored tokens (nats/token).
        nll: each scored token's negative log-likelihood (nats), in order.
        flush_steps: the decode steps (0-based, one per fed token) during which the layers flushed.
        prefill_context_error: `context_error` of the context's tokens right after the prefill (None without a
            reference).
        context_errors: `context_error` of the context's tokens after each of those flushes (empty without a
            reference or without flushes): the drift, against `prefill_context_error`.
        seconds: wall time of the prefill and the N decode steps.
        ratio_to_dynamic: perplexity / `dynamic`'s on the same tokens (llama.cpp's "PPL(Q)/PPL(base)"); set by
            `kvdemo.compare.run`, None otherwise.
    """

    tokens: int
    context_tokens: int
    perplexity: float
    mean_nll: float
    nll: tuple[float, ...]
    flush_steps: tuple[int, ...]
    prefill_context_error: float | None
    context_errors: tuple[float, ...]
    seconds: float
    ratio_to_dynamic: float | None = None


def _check_budget(loaded_model: LoadedModel, spec: CacheSpec, context: int, fed: int, kv_budget_bytes: int) -> None:
    """Raise `KVBudgetError` when a cache of `spec` for `context` prefilled and `fed` fed tokens would pass the
    budget (estimated before anything runs)."""
    estimate = estimate_kv_bytes(spec, loaded_model.config, context + fed, loaded_model.dtype, residual_tokens=fed)
    if estimate > kv_budget_bytes:
        raise KVBudgetError(
            f"a {spec.label} KV cache for {context:,} context tokens + {fed} fed tokens would hold about "
            f"{estimate / 2**20:,.1f} MiB; the KV budget is {kv_budget_bytes / 2**20:,.1f} MiB. Lower the "
            "perplexity tokens or shorten the context",
            estimate,
            kv_budget_bytes,
        )


def perplexity(
    loaded_model: LoadedModel,
    spec: CacheSpec,
    inputs: PerplexityInputs,
    reference: ReferenceKV | KV | None = None,
    on_step: Callable[[int], None] | None = None,
    kv_budget_bytes: int | None = None,
) -> PerplexityResult:
    """Perplexity through the quantized cache: prefill `inputs.context_ids` into a fresh cache of `spec`, then feed
    the continuation's first N tokens one decode step each (`logits_to_keep=1`, as `QASession` decodes), so that
    each attends to the quantized store and the residual exactly as in generation, flushes included; decode step
    i predicts token i + 1. PPL = exp(-1/N sum_i log p(c_{i+1} | context, c_0..c_i)). For `dynamic` this equals one
    plain forward pass over context + continuation (tested to 1e-4 relative). The cache is freed on return.

    Args:
        inputs: from `perplexity_inputs`.
        reference: the context's full-precision keys and values (`reference_kv`); when given, the context's
            error is measured after every flush (`PerplexityResult.context_errors`: the drift).
        on_step: called with the decode step just done (0-based) after each one; it may raise to stop the run.
        kv_budget_bytes: refuse a cache whose estimated bytes (`backends.estimate_kv_bytes`) exceed this.

    Returns:
        A `PerplexityResult`.

    Raises:
        ValueError, ImportError: the spec does not validate against the model; `KVBudgetError` (a ValueError)
            over the budget; a reference of another length than the context.

    Example:
        >>> result = perplexity(loaded, CacheSpec("hqq", nbits=2), perplexity_inputs(loaded, text, 128))
        >>> result.perplexity
    """
    spec = spec.validate(loaded_model.config)
    check_model(loaded_model, spec)  # refused before anything runs where a few tokens show it would be wrong
    context, continuation = list(inputs.context_ids), list(inputs.continuation_ids)
    if reference is not None:
        reference = as_reference(reference)
        if reference.tokens != len(context):
            raise ValueError(f"the reference holds {reference.tokens} tokens, the context {len(context)}")
    fed = len(continuation) - 1
    check_rope(loaded_model, len(context), fed + 1, "Score fewer perplexity tokens")  # as every door that feeds tokens
    if kv_budget_bytes is not None:
        _check_budget(loaded_model, spec, len(context), fed, kv_budget_bytes)
    device = loaded_model.device
    cache = build_cache(spec, loaded_model.config)
    nll, flush_steps, errors = [], [], []
    start = time.perf_counter()
    with torch.no_grad():
        loaded_model.forward(torch.tensor([context], device=device), cache)
        prefill_error = None if reference is None else context_error(reference, cache)
        for step in range(fed):
            logits = loaded_model.forward(torch.tensor([[continuation[step]]], device=device), cache)
            logprobs = torch.log_softmax(logits[0, -1].float(), dim=-1)
            nll.append(-float(logprobs[continuation[step + 1]]))
            if flushed_layers(cache):
                flush_steps.append(step)
                if reference is not None and (error := context_error(reference, cache)) is not None:
                    errors.append(error)
            if on_step is not None:
                on_step(step)
    seconds = time.perf_counter() - start
    del cache
    mean = math.fsum(nll) / len(nll)
    return PerplexityResult(
        tokens=fed,
        context_tokens=len(context),
        perplexity=math.exp(mean),
        mean_nll=mean,
        nll=tuple(nll),
        flush_steps=tuple(flush_steps),
        prefill_context_error=prefill_error,
        context_errors=tuple(errors),
        seconds=seconds,
    )
