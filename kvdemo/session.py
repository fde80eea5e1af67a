"""`QASession`: prefill a context once into a KV cache, then answer questions in turn on top of it,
restoring the cache to its post-prefill state after every answer (see DESIGN.md, invariants 1-3).

Prompt layout. For a chat model the user turn is rendered with the tokenizer's chat template around two
markers and split there, as kvpress's pipeline splits its context from its questions: the prefix (system
turn, user turn opening, the context) is prefilled once; each question is `"\\n\\n" + question` followed by
the rest of the template (end of the user turn, opening of the assistant turn). Without a chat template
the context is plain text and a question is `"\\n" + question + "\\n"`. The user's text is tokenized with
`split_special_tokens=True`, so text that imitates a special token (`<|im_end|>`) stays text.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from kvdemo import snapshot
from kvdemo.backends import CacheSpec, build_cache, estimate_kv_bytes
from kvdemo.models import LoadedModel
from kvdemo.telemetry import MemoryReport, StepEvent, flushed_layers, full_precision_bytes, kv_memory

DEFAULT_MAX_NEW_TOKENS = 64
QUESTION_RESERVE_TOKENS = 64
"""Tokens a prefill keeps free for a question, on top of the answer's `max_new_tokens`."""

_CONTEXT_MARK = "\ue000KVDEMO_CONTEXT\ue000"
_QUESTION_MARK = "\ue000KVDEMO_QUESTION\ue000"


@dataclass(frozen=True)
class PrefillReport:
    """What a prefill did.

    Attributes:
        context_tokens: tokens prefilled (chat template prefix included).
        seconds: wall time of the prefill forward pass and snapshot.
        memory: the cache's memory right after the prefill.
        full_precision_bytes: what a `DynamicCache` in the model's dtype holds for the same tokens.
    """

    context_tokens: int
    seconds: float
    memory: MemoryReport
    full_precision_bytes: int

    @property
    def kv_bytes(self) -> int:
        """Bytes the cache holds after the prefill."""
        return self.memory.total_bytes

    @property
    def bytes_per_token(self) -> float:
        """kv_bytes / context_tokens."""
        return self.kv_bytes / self.context_tokens

    @property
    def ratio_to_full_precision(self) -> float:
        """kv_bytes / full_precision_bytes (1.0 for `dynamic`)."""
        return self.kv_bytes / self.full_precision_bytes


@dataclass(frozen=True)
class Answer:
    """One finished answer.

    Attributes:
        question: the question as asked.
        text: the answer text (special tokens skipped).
        token_ids: the generated token ids, EOS included when it was generated.
        steps: decode steps run (forward passes: the question's and one per fed-back token).
        flushes: flushes counted per layer during the answer (tuple of length num_layers).
        seconds: wall time of the answer (seconds).
        cache_length_after: the cache's length after the restore; equals the context's tokens.
        finish_reason: `eos`, `max_new_tokens`, `stopped` (the stream was closed early) or `error`.
    """

    question: str
    text: str
    token_ids: tuple[int, ...]
    steps: int
    flushes: tuple[int, ...]
    seconds: float
    cache_length_after: int
    finish_reason: str

    @property
    def flush_count(self) -> int:
        """Flushes summed over layers."""
        return sum(self.flushes)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of the answer."""
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "question": self.question,
            "answer": self.text,
            "token_ids": list(self.token_ids),
            "steps": self.steps,
            "flushes_per_layer": list(self.flushes),
            "flushes": self.flush_count,
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "cache_length_after": self.cache_length_after,
            "finish_reason": self.finish_reason,
        }


@dataclass
class _Prompt:
    prefix: list[int]
    question_separator: str
    question_suffix: list[int] = field(default_factory=list)


class KVBudgetError(ValueError):
    """A prefill refused because its estimated KV cache exceeds the session's `kv_budget_bytes`.

    Attributes:
        estimate_bytes: the estimate (`backends.estimate_kv_bytes`); budget_bytes: the limit.
    """

    def __init__(self, message: str, estimate_bytes: int, budget_bytes: int):
        super().__init__(message)
        self.estimate_bytes = estimate_bytes
        self.budget_bytes = budget_bytes


class QASession:
    """A context prefilled once into a KV cache of one backend, and questions answered in turn on it.

    Args:
        loaded_model: from `kvdemo.load_model`.
        spec: the cache backend and its options; validated against the model here.
        kv_budget_bytes: the out-of-memory guard: a prefill whose cache would hold more than this (estimated
            from the model's shape, the tokens and the backend's bits before anything runs) is refused.
            None: no limit.

    Raises:
        ValueError, ImportError: the spec does not validate (see `CacheSpec.validate`), or a budget < 1.
    """

    def __init__(self, loaded_model: LoadedModel, spec: CacheSpec | None = None, kv_budget_bytes: int | None = None):
        if kv_budget_bytes is not None and kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes={kv_budget_bytes} must be >= 1 (or None for no limit)")
        self.loaded = loaded_model
        self.spec = (spec or CacheSpec()).validate(loaded_model.config)
        self.kv_budget_bytes = kv_budget_bytes
        self.cache = None
        self.context: str | None = None
        self.prefill_report: PrefillReport | None = None
        self.history: list[Answer] = []
        self._snapshot: snapshot.CacheSnapshot | None = None
        self._prompt: _Prompt | None = None
        self._active: Iterator[StepEvent] | None = None
        self._stop = threading.Event()

    # ---- tokenization -------------------------------------------------------------------------
    def _encode_text(self, text: str) -> list[int]:
        """User text: special-token look-alikes stay text."""
        return self.loaded.tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def _encode_template(self, text: str) -> list[int]:
        """Template text: its special tokens are parsed as such."""
        return self.loaded.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _layout(self, context: str) -> _Prompt:
        tokenizer = self.loaded.tokenizer
        if getattr(tokenizer, "chat_template", None):
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": _CONTEXT_MARK + _QUESTION_MARK}],
                tokenize=False,
                add_generation_prompt=True,
            )
            before, rest = rendered.split(_CONTEXT_MARK)
            _, after = rest.split(_QUESTION_MARK)
            bos, separator = [], "\n\n"
        else:
            before, after, separator = "", "\n", "\n"
            bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
        return _Prompt(
            prefix=bos + self._encode_template(before) + self._encode_text(context),
            question_separator=separator,
            question_suffix=self._encode_template(after),
        )

    def context_ids(self, context: str) -> list[int]:
        """The token ids a prefill of `context` feeds: the chat template's opening (system turn, user turn
        opening) followed by the context's tokens (see the module docstring). Checks nothing: a prefill
        refuses what does not fit, this only tokenizes (a tool to build a context of an exact token length).

        Example:
            >>> len(session.context_ids(text))  # equals session.prefill(text).context_tokens
            1341
        """
        return list(self._layout(context).prefix)

    def question_ids(self, question: str) -> list[int]:
        """The token ids fed for `question` on top of the prefilled context (see the module docstring).

        Raises:
            ValueError: no context was prefilled, or the question is empty or blank.
        """
        if self._prompt is None:
            raise ValueError("prefill a context before asking a question")
        if not isinstance(question, str) or not question.strip():
            raise ValueError("the question is empty; type a question about the context")
        return self._encode_text(self._prompt.question_separator + question.strip()) + self._prompt.question_suffix

    # ---- prefill ------------------------------------------------------------------------------
    @property
    def cache_length(self) -> int:
        """Tokens in the cache now (0 before a prefill)."""
        return self.cache.get_seq_length() if self.cache is not None else 0

    def prefill(self, context: str, reserve_tokens: int | None = None) -> PrefillReport:
        """Prefill `context` into a new cache of this session's backend, replacing (and freeing) any old one.

        Args:
            context: the text the questions are about.
            reserve_tokens: tokens to keep free for a question and its answer; default
                `QUESTION_RESERVE_TOKENS + DEFAULT_MAX_NEW_TOKENS`.

        Returns:
            A `PrefillReport` (tokens, seconds, memory).

        Raises:
            ValueError: the context is empty or blank, or its tokens plus `reserve_tokens` exceed the
                model's `max_context_tokens` (the message gives the numbers). The session is unchanged then.
            KVBudgetError (a ValueError): the estimated cache exceeds `kv_budget_bytes`; the session is
                unchanged (the old context and cache stay).
        """
        if not isinstance(context, str) or not context.strip():
            raise ValueError("the context is empty; paste or upload the text to ask about")
        reserve = QUESTION_RESERVE_TOKENS + DEFAULT_MAX_NEW_TOKENS if reserve_tokens is None else reserve_tokens
        limit = self.loaded.max_context_tokens
        if reserve >= limit:
            raise ValueError(
                f"keeping {reserve} tokens for a question and its answer leaves no room for a context in the model's "
                f"{limit}-token window; lower max_new_tokens"
            )
        prompt = self._layout(context)
        if len(prompt.prefix) + reserve > limit:
            raise ValueError(
                f"the context is {len(prompt.prefix)} tokens; with {reserve} tokens kept for a question and its "
                f"answer it exceeds the model's {limit}-token window. Shorten the context to at most "
                f"{limit - reserve} tokens"
            )
        self._check_budget(len(prompt.prefix), reserve)
        self._close_active()
        self.cache = self._snapshot = self._prompt = self.prefill_report = None
        self.context = None
        self.history = []
        cache = build_cache(self.spec, self.loaded.config)
        ids = torch.tensor([prompt.prefix], device=self.loaded.device)
        start = time.perf_counter()
        with torch.no_grad():
            self.loaded.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        saved = snapshot.take(cache)
        seconds = time.perf_counter() - start
        self.cache, self._snapshot, self._prompt, self.context = cache, saved, prompt, context
        self.prefill_report = PrefillReport(
            context_tokens=len(prompt.prefix),
            seconds=seconds,
            memory=kv_memory(cache),
            full_precision_bytes=full_precision_bytes(self.loaded.config, len(prompt.prefix), self.loaded.dtype),
        )
        return self.prefill_report

    def estimate_kv_bytes(self, context_tokens: int, reserve_tokens: int) -> int:
        """The bytes this session's cache would hold with `context_tokens` prefilled and `reserve_tokens` more
        decoded (a question and its answer, in the residual as far as it reaches): `backends.estimate_kv_bytes`."""
        return estimate_kv_bytes(
            self.spec, self.loaded.config, context_tokens + reserve_tokens, self.loaded.dtype,
            residual_tokens=reserve_tokens,
        )

    def _check_budget(self, context_tokens: int, reserve_tokens: int, advice: str | None = None) -> None:
        """Raise `KVBudgetError` when `estimate_kv_bytes(context_tokens, reserve_tokens)` exceeds the budget."""
        budget = self.kv_budget_bytes
        if budget is None:
            return
        estimate = self.estimate_kv_bytes(context_tokens, reserve_tokens)
        if estimate <= budget:
            return
        if advice is None:
            per_token = estimate / (context_tokens + reserve_tokens)
            fits = max(int(budget / per_token) - reserve_tokens, 0)
            advice = (f"Shorten the context to about {fits:,} tokens, or choose a backend with fewer bits "
                      "(e.g. hqq with nbits 2)")
        raise KVBudgetError(
            f"a {self.spec.label} KV cache for this context ({context_tokens:,} tokens + {reserve_tokens} for a "
            f"question and its answer) would hold about {estimate / 2**20:,.1f} MiB; the KV budget is "
            f"{budget / 2**20:,.1f} MiB. {advice}",
            estimate,
            budget,
        )

    # ---- answers ------------------------------------------------------------------------------
    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def stream(self, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> Iterator[StepEvent]:
        """Answer `question` greedily, one `StepEvent` per decode step.

        Arguments are checked before the generator is returned, so bad input raises here. The cache is
        restored in a `finally`: when the answer ends, when the generator is closed early (Stop), or when
        a step raises. The finished `Answer` is appended to `history` in every case. An answer still open
        when another one starts (or a new prefill) is closed first.

        Args:
            question: the question; blank is refused.
            max_new_tokens: most tokens to generate, >= 1; generation stops earlier at an EOS token.

        Raises:
            ValueError: no prefill yet, an empty question, max_new_tokens < 1 or not an integer, or a
                question plus `max_new_tokens` that does not fit the model's window (numbers given).
            KVBudgetError (a ValueError): the cache with the question and `max_new_tokens` decoded would
                exceed `kv_budget_bytes`.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be a whole number >= 1")
        q_ids = self.question_ids(question)
        context_tokens = self._snapshot.seq_length
        limit = self.loaded.max_context_tokens
        if context_tokens + len(q_ids) + max_new_tokens > limit:
            raise ValueError(
                f"context {context_tokens} + question {len(q_ids)} + max_new_tokens {max_new_tokens} tokens exceeds "
                f"the model's {limit}-token window; lower max_new_tokens to at most "
                f"{limit - context_tokens - len(q_ids)} or shorten the question"
            )
        self._check_budget(context_tokens, len(q_ids) + max_new_tokens,
                           advice="Lower max_new_tokens, or prefill a shorter context")
        self._close_active()
        self._stop.clear()
        self._active = self._decode(question, q_ids, max_new_tokens)
        return self._active

    def request_stop(self) -> None:
        """Ask the answer now streaming to end after its current decode step (thread-safe: the Stop button of
        a UI whose answer runs in another thread). The stream then ends with `finish_reason="stopped"`, and the
        cache is restored as after any answer. Does nothing when no answer is streaming."""
        self._stop.set()

    def _decode(self, question: str, q_ids: list[int], max_new_tokens: int) -> Iterator[StepEvent]:
        loaded, cache = self.loaded, self.cache
        flushes = [0] * len(cache.layers)
        token_ids: list[int] = []
        finish_reason = "error"
        start = time.perf_counter()
        steps = 0
        inputs = torch.tensor([q_ids], device=loaded.device)
        try:
            for step in range(max_new_tokens):
                step_start = time.perf_counter()
                with torch.no_grad():
                    logits = loaded.model(
                        input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1
                    ).logits
                token = int(logits[0, -1].argmax())
                now = time.perf_counter()
                steps += 1
                flushed = flushed_layers(cache)
                for index in flushed:
                    flushes[index] += 1
                token_ids.append(token)
                cache_length = cache.get_seq_length()
                finish_reason = "eos" if token in loaded.eos_token_ids else "max_new_tokens"
                yield StepEvent(
                    step=step,
                    token_id=token,
                    text=loaded.tokenizer.decode(token_ids, skip_special_tokens=True),
                    seconds=now - step_start,
                    elapsed=now - start,
                    memory=kv_memory(cache),
                    flushed_layers=flushed,
                    cache_length=cache_length,
                    full_precision_bytes=full_precision_bytes(loaded.config, cache_length, loaded.dtype),
                )
                if finish_reason == "eos":
                    break
                if self._stop.is_set():
                    finish_reason = "stopped" if step + 1 < max_new_tokens else finish_reason
                    break
                inputs = torch.tensor([[token]], device=loaded.device)
        except GeneratorExit:
            if finish_reason != "eos" and steps < max_new_tokens:
                finish_reason = "stopped"
            raise
        except BaseException:
            finish_reason = "error"
            raise
        finally:
            snapshot.restore(cache, self._snapshot)
            if self._active is not None and cache is self.cache:
                self._active = None
            self.history.append(
                Answer(
                    question=question,
                    text=loaded.tokenizer.decode(token_ids, skip_special_tokens=True),
                    token_ids=tuple(token_ids),
                    steps=steps,
                    flushes=tuple(flushes),
                    seconds=time.perf_counter() - start,
                    cache_length_after=cache.get_seq_length(),
                    finish_reason=finish_reason,
                )
            )

    def score(self, question: str, answer_ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced next-token log-probabilities of a given answer to `question` on this session's cache.

        The question is fed as in `stream`, then the answer's tokens one decode step at a time, so a
        quantized cache fills and flushes its residual exactly as during generation. Row i is the
        distribution the model gives before `answer_ids[i]` is known; feeding a session's own greedy answer
        reproduces the distributions of its generation (each row's argmax is that answer's token). The cache
        is restored afterwards (also on error); `history` is not changed.

        Args:
            question: the question, as for `stream`.
            answer_ids: the answer's token ids (length n >= 1), e.g. another backend's `Answer.token_ids`.

        Returns:
            float32 log-probabilities on the CPU, shape [n, vocab_size].

        Raises:
            ValueError: no prefill yet, an empty question or answer, or more tokens than the window holds.
        """
        answer_ids = [int(t) for t in answer_ids]
        if not answer_ids:
            raise ValueError("answer_ids is empty; give at least one token to score")
        q_ids = self.question_ids(question)
        context_tokens = self._snapshot.seq_length
        if context_tokens + len(q_ids) + len(answer_ids) > self.loaded.max_context_tokens:
            raise ValueError(
                f"context {context_tokens} + question {len(q_ids)} + answer {len(answer_ids)} tokens exceeds the "
                f"model's {self.loaded.max_context_tokens}-token window"
            )
        self._close_active()
        loaded, cache = self.loaded, self.cache
        rows = []
        inputs = torch.tensor([q_ids], device=loaded.device)
        try:
            for token in answer_ids:
                with torch.no_grad():
                    logits = loaded.model(
                        input_ids=inputs, past_key_values=cache, use_cache=True, logits_to_keep=1
                    ).logits
                rows.append(torch.log_softmax(logits[0, -1].float(), dim=-1).cpu())
                inputs = torch.tensor([[token]], device=loaded.device)
        finally:
            snapshot.restore(cache, self._snapshot)
        return torch.stack(rows)

    def ask(self, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> Answer:
        """Answer `question` to the end and return the `Answer` (also appended to `history`).

        Raises:
            ValueError: see `stream`. An exception inside a decode step propagates after the cache is restored.
        """
        for _ in self.stream(question, max_new_tokens):
            pass
        return self.history[-1]
