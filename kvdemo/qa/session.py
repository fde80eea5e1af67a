"""`QASession`: prefill a context once into a KV cache, then answer questions in turn on top of it, restoring the
cache to its post-prefill state after every answer (docs/DESIGN.md, invariants 1-3).

The prompt is laid out by `kvdemo.qa.prompt.PromptLayout`: the model reads exactly what its chat template gives
for one user message `context + "\\n\\n" + question` with the generation prompt (`prompt_ids`, invariant 5); the
part up to the context's end is prefilled once, and each question is fed with the rest. User text that looks like
a control token (`<|im_end|>`) stays text. Text in (context, question) is checked by `kvdemo.qa.text.check_text`;
text out (each step's and the answer's) is decoded incrementally by `kvdemo.qa.text.TextStream`, so it never ends in
half a character. Memory figures count the cache and what the snapshot keeps alive (`telemetry.kv_memory`)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol, cast

import torch
from transformers import Cache, PreTrainedConfig
from transformers.cache_utils import DynamicLayer

from kvdemo import checks
from kvdemo.cache.layers.attention import decode_read
from kvdemo.cache.model.geometry import full_precision_bytes
from kvdemo.cache.spec import CacheSpec, build_cache
from kvdemo.cache.state import budget, snapshot
from kvdemo.cache.state.telemetry import StepEvent, kv_memory
from kvdemo.qa.decode import greedy_decode, teacher_forced
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS, QUESTION_RESERVE_TOKENS
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.prefill import PREFILL_CHUNK_TOKENS, ProgressCallback, check_rope, hand_over, run_prefill
from kvdemo.qa.probe import check_model
from kvdemo.qa.prompt import PreparedContext, PreparedQuestion, PromptLayout, PromptSplit
from kvdemo.qa.records import Answer, PrefillReport
from kvdemo.qa.text import check_question, check_text


class Session(Protocol):
    """A prefilled session as the server holds it: a `QASession` (its cache in this process), or a session whose
    cache a device worker holds (`kvdemo.serve.device.RemoteSession`). What the page, the MCP tools and the door read
    and call; the cache itself only a runner touches (`kvdemo.serve.runner`)."""

    loaded: LoadedModel
    spec: CacheSpec
    kv_budget_bytes: int | None
    context: str | None
    prefill_report: PrefillReport | None
    history: list[Answer]
    reserve_tokens: int

    @property
    def cache_length(self) -> int: ...

    def request_stop(self) -> None: ...

    def check_prefill(self, context_tokens: int, reserve_tokens: int) -> None: ...

    def prepare_question(self, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> PreparedQuestion: ...

    def speed_limit(self) -> Any: ...


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
        UnsupportedModelError (a ValueError): the model's layers, or a few tokens run through the spec's cache
            (`kvdemo.qa.probe.check_model`), show the spec cannot be served right on this model.
    """

    def __init__(self, loaded_model: LoadedModel, spec: CacheSpec | None = None, kv_budget_bytes: int | None = None):
        if kv_budget_bytes is not None and kv_budget_bytes < 1:
            raise ValueError(f"kv_budget_bytes={kv_budget_bytes!r} must be >= 1 (or None for no limit)")
        self.loaded = loaded_model
        self.spec = (spec or CacheSpec()).validate(loaded_model.config)
        check_model(loaded_model, self.spec)  # what the config cannot show: a few tokens, once per model and spec
        self.kv_budget_bytes = kv_budget_bytes
        self.cache: Cache | None = None
        self.context: str | None = None
        self.prefill_report: PrefillReport | None = None
        self.history: list[Answer] = []
        self.reserve_tokens = QUESTION_RESERVE_TOKENS + DEFAULT_MAX_NEW_TOKENS  # kept free by the last prefill
        self._snapshot: snapshot.CacheSnapshot | None = None
        self.layout = PromptLayout(loaded_model.tokenizer)
        self._split: PromptSplit | None = None
        self._active: Generator[StepEvent, None, None] | None = None
        self._stop = threading.Event()

    # ---- the prompt ---------------------------------------------------------------------------------
    def context_ids(self, context: str | PreparedContext, max_tokens: int | None = None) -> list[int]:
        """The token ids a prefill of `context` feeds: the template's opening and the context up to its split
        (`PromptLayout.split`, the prefix of `prompt_ids`). Tokenizes only (a `PreparedContext` not again): the
        session's cache is not touched.

        Args:
            max_tokens: when the context is longer than this, its ids are returned at once, without the split's
                probes (each would tokenize the whole text again: minutes for megabytes); any longer count
                refuses it anyway (e.g. the model's window).

        Raises:
            ValueError: the context holds a broken character (`check_text`).
        """
        if isinstance(context, PreparedContext):
            return list(self._own(context).ids)
        return list(self.layout.split(check_text(context, "the context"), max_prefix_tokens=max_tokens).prefix)

    def prepare(self, context: str, max_tokens: int | None = None) -> PreparedContext:
        """`context` checked and split once (`PromptLayout.split`), to hand to every session of this tokenizer
        that prefills it (`prefill(prepared)`), so a comparison of N specs tokenizes its context once.

        Args:
            max_tokens: as for `context_ids`: a longer context is split unchecked (it is refused anyway).

        Raises:
            ValueError: the context is empty or blank, or holds a broken character (`check_text`).
        """
        if not isinstance(context, str) or not context.strip():
            raise ValueError("the context is empty; paste or upload the text to ask about")
        text = check_text(context, "the context")
        return PreparedContext(text, self.layout.split(text, max_prefix_tokens=max_tokens), self.loaded.tokenizer)

    def _own(self, prepared: PreparedContext) -> PreparedContext:
        """`prepared` if this session's tokenizer made it. Raises ValueError for another tokenizer's."""
        if prepared.tokenizer is not self.loaded.tokenizer:
            raise ValueError("the context was prepared with another model's tokenizer; prepare it with this session")
        return prepared

    def text_ids(self, text: str) -> list[int]:
        """`text` as the user's text is tokenized (no special tokens added; text that imitates a special token,
        such as `<|im_end|>`, stays text), e.g. a continuation of the context."""
        return self.loaded.text_ids(text)

    def question_ids(self, question: str) -> list[int]:
        """The token ids fed for `question` on top of the prefilled context: the context's tail that the
        tokenizer joins with the separator (usually its trailing whitespace, else ""), `"\\n\\n"`, the question
        stripped of surrounding whitespace, and the rest of the chat template (see `kvdemo.qa.prompt`).

        Raises:
            ValueError: no context was prefilled, the question is empty or blank, or it holds a broken character
                (an unpaired surrogate: `kvdemo.qa.text.check_text`).
        """
        split = self._prefilled()[2]
        return self.layout.question_ids(split, check_question(question))

    def prompt_ids(self, question: str) -> list[int]:
        """The whole token ids the model reads for `question` after the prefill: the prefilled ids followed by
        `question_ids(question)`.

        They equal the chat template's ids for the one user message `context + "\\n\\n" + question.strip()` with
        the generation prompt, `tokenizer.apply_chat_template([{"role": "user", "content": ...}], tokenize=True,
        add_generation_prompt=True, sanitize_control_tokens=True)` (the last option only matters for user text
        that looks like a control token, which stays text), and for a tokenizer without a chat template the plain
        layout's: BOS + `context + "\\n" + question.strip() + "\\n"`. Where the tokenizer cannot give that (it
        merges the context's end with the question), `prefill_report.prompt_matches_template` is False.

        Raises:
            ValueError: as `question_ids`.

        Example:
            >>> report = session.prefill("Hi.\\n")  # a saved text file ends in a newline
            >>> session.prompt_ids("Who?") == tokenizer.apply_chat_template(
            ...     [{"role": "user", "content": "Hi.\\n\\n\\nWho?"}], tokenize=True, add_generation_prompt=True,
            ...     return_dict=False)
            True
        """
        return list(self._prefilled()[2].prefix) + self.question_ids(question)

    @property
    def split(self) -> PromptSplit:
        """The prefill's split (its ids, tail and clock). Raises ValueError before a prefill."""
        return self._prefilled()[2]

    @property
    def streaming(self) -> bool:
        """Whether an answer is open: streaming, or not yet closed (the cache is not the post-prefill one)."""
        return self._active is not None

    def _prefilled(self) -> tuple[Cache, snapshot.CacheSnapshot, PromptSplit]:
        if self.cache is None or self._snapshot is None or self._split is None:  # set and cleared together
            raise ValueError("prefill a context before asking a question")
        return self.cache, self._snapshot, self._split

    # ---- prefill ------------------------------------------------------------------------------
    @property
    def cache_length(self) -> int:
        """Tokens in the cache now (0 before a prefill)."""
        return int(self.cache.get_seq_length()) if self.cache is not None else 0

    def prefill(
        self,
        context: str | PreparedContext,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        reserve_tokens: int | None = None,
        on_progress: ProgressCallback | None = None,
        chunk_tokens: int = PREFILL_CHUNK_TOKENS,
        on_quantize: ProgressCallback | None = None,
    ) -> PrefillReport:
        """Prefill `context` into a new cache of this session's backend, replacing (and freeing) any old one.

        Example:
            >>> session = QASession(load_model(), CacheSpec.parse("hqq:4"))
            >>> session.prefill(open("article.txt").read(), max_new_tokens=32).context_tokens
            2172

        Args:
            context: the text the questions are about, or a `PreparedContext` of it (`prepare`: not tokenized again).
            max_new_tokens: the longest answer to keep room for: the prefill keeps
                `QUESTION_RESERVE_TOKENS + max_new_tokens` tokens of the window free.
            reserve_tokens: overrides that reserve with an exact number of tokens.
            on_progress: `on_progress(done_tokens, total_tokens)` after each chunk of the forward pass.
            chunk_tokens: tokens per forward pass (`kvdemo.qa.prefill.run_prefill`: the same cache as one pass);
                `request_stop()` from another thread stops the prefill between two chunks.
            on_quantize: `on_quantize(done_layers, layers)` after each layer a quantized backend has taken the
                whole context into (the prefill's last stage, when the context took more than one chunk).

        Returns:
            A `PrefillReport` (tokens, seconds, memory).

        Raises:
            ValueError: the context is empty or blank, holds a broken character (an unpaired surrogate, e.g. half
                an emoji: the message gives its position; `kvdemo.qa.text.check_text`), or its tokens plus
                `reserve_tokens` exceed the model's `max_context_tokens` (the message gives the numbers), or the
                model's RoPE factors change between the context's length and that reserve's end (`check_rope`).
                The session is unchanged then.
            KVBudgetError (a ValueError): the estimated cache exceeds `kv_budget_bytes`; the session is
                unchanged (the old context and cache stay).
            PrefillStopped: `request_stop()` was called during the prefill; the old cache was already freed, so
                the session then holds no context (`cache_length` 0).
        """
        if not isinstance(context, PreparedContext) and (not isinstance(context, str) or not context.strip()):
            raise ValueError("the context is empty; paste or upload the text to ask about")
        if reserve_tokens is None:
            reserve_tokens = QUESTION_RESERVE_TOKENS + checks.max_new_tokens(max_new_tokens)
        self.check_prefill(0, reserve_tokens)  # the reserve alone must leave room
        if isinstance(context, PreparedContext):
            prepared = self._own(context)
        else:
            prepared = self.prepare(context, max_tokens=self.loaded.max_context_tokens - reserve_tokens)
        split, context = prepared.split, prepared.text
        self.check_prefill(len(split.prefix), reserve_tokens)
        self._close_active()
        self.cache = self._snapshot = self._split = self.prefill_report = self.context = None
        self.history, self.reserve_tokens = [], reserve_tokens
        self._stop.clear()
        cache = build_cache(self.spec, self.loaded.config)
        start = time.perf_counter()
        handed = self.spec.info.hands_over
        run_prefill(self.loaded, cache, split.prefix, handed, chunk_tokens, on_progress, self._stop, on_quantize)
        return self._install(cache, split, context, start)

    def prefill_from(self, reference: QASession) -> PrefillReport:
        """Prefill this session with `reference`'s context without a forward pass: a new cache of this session's spec
        takes each layer's full-precision keys and values from `reference`, a prefilled `dynamic` session of the
        same model, as the last stage of every quantized prefill takes them from its `DynamicCache`
        (`kvdemo.qa.prefill.hand_over`). So the cache equals `prefill` of the same context tensor for tensor
        (`tests/test_recommend.py`), and measuring tens of specs on one context costs one prefill in all (a
        recommendation). A layer the spec keeps at full precision is a shallow copy of the reference's (its tensors
        shared: every layer assigns new ones at a step, and this session's snapshot copies any in-place state back
        after each answer). Neither session may answer while the other does.

        Raises:
            ValueError: `reference` is not a prefilled `dynamic` session (storage=concat) of this model, or is
                answering; KVBudgetError (a ValueError): the cache would pass `kv_budget_bytes` (the session is
                unchanged then).
        """
        plain = CacheSpec().label  # the full-precision baseline: transformers' `DynamicCache` as it builds it
        if reference.loaded is not self.loaded or reference.spec.label != plain:
            raise ValueError("prefill_from takes a dynamic session (storage=concat) of the same loaded model")
        if not self.spec.info.quantized and self.spec.label != plain:
            raise ValueError(f"{self.spec.label} builds its own layers; prefill it with `prefill`")
        if self.spec.info.prefill_reads_cache:
            raise ValueError(
                f"{self.spec.backend}'s prefill attends through its own stored cache, as its engine's does, so no "
                "full-precision prefill can be handed over; prefill it with `prefill`"
            )
        if reference.streaming:
            raise ValueError("the reference session is answering; prefill from it once its answer is closed")
        source, _, split = reference._prefilled()
        assert reference.context is not None  # set with the cache
        self.check_prefill(len(split.prefix), reference.reserve_tokens)
        self._close_active()
        start = time.perf_counter()
        cache = build_cache(self.spec, self.loaded.config)
        for index, layer in enumerate(source.layers):
            hand_over(cache, index, cast(DynamicLayer, copy.copy(layer)))  # a DynamicCache's
        self.history, self.reserve_tokens = [], reference.reserve_tokens
        return self._install(cache, split, reference.context, start)

    def _install(
        self, cache: Cache, split: PromptSplit, context: str, start: float, opened: tuple[str, float] | None = None
    ) -> PrefillReport:
        saved = snapshot.take(cache)
        seconds = time.perf_counter() - start
        self.cache, self._snapshot, self._split, self.context = cache, saved, split, context
        opened_from, prefill_seconds = opened or (None, seconds)
        self.prefill_report = report = PrefillReport(
            len(split.prefix), seconds, kv_memory(cache, saved),
            full_precision_bytes(self.loaded.config, len(split.prefix), self.loaded.dtype), split.matches_template,
            split.note, split.clock, opened_from, prefill_seconds,
            tuple(d.line for d in self.spec.deployments(self.loaded.config)),
            decode_read(cache, self.loaded.model),
        )  # fmt: skip
        return report

    def adopt(
        self, cache: Cache, split: PromptSplit, context: str, start: float, opened: tuple[str, float], reserve: int = 0
    ) -> PrefillReport:
        """Take `cache`, prefilled elsewhere with `split.prefix` over `context` (a session file: `open_session`,
        from `start`), as this session's prefill; `opened`: (the file's name, its prefill's seconds); `reserve`: the
        prefill's `reserve_tokens` (0: the default's). Raises ValueError, KVBudgetError: it does not fit with it."""
        reserve = reserve or QUESTION_RESERVE_TOKENS + DEFAULT_MAX_NEW_TOKENS
        self.check_prefill(len(split.prefix), reserve)
        self._close_active()
        self.history, self.reserve_tokens = [], reserve
        return self._install(cache, split, context, start, opened)

    def check_prefill(self, context_tokens: int, reserve_tokens: int) -> None:
        """Whether a prefill of `context_tokens` tokens, keeping `reserve_tokens` for a question and its answer,
        fits: the model's window (`checks.prefill_fits`), then `kv_budget_bytes` (`budget.check_budget`).
        `prefill` checks it before it builds anything, a server before reserving its shared budget.

        Raises:
            ValueError: it does not fit the window; KVBudgetError (a ValueError): nor the budget.
        """
        check_prefill(self.loaded, self.spec, self.kv_budget_bytes, context_tokens, reserve_tokens)

    def check_answer(self, question_tokens: int, max_new_tokens: int) -> None:
        """Whether an answer of up to `max_new_tokens` to a question of `question_tokens` tokens fits the prefilled
        cache: the model's window (`checks.answer_fits`), then `kv_budget_bytes`. `stream` checks it, a server
        before growing its shared reservation (`kvdemo.serve.door.Door.reserve_answer`).

        Raises:
            ValueError: no prefill yet, or it does not fit the window; KVBudgetError (a ValueError): nor the budget.
        """
        context = self._prefilled()[1].seq_length
        check_answer(self.loaded, self.spec, self.kv_budget_bytes, context, question_tokens, max_new_tokens)

    @property
    def _budget_of(self) -> tuple[CacheSpec, PreTrainedConfig, torch.dtype, int | None]:
        """`budget.check_budget`'s first arguments for this session: spec, config, dtype, kv_budget_bytes."""
        return self.spec, self.loaded.config, self.loaded.dtype, self.kv_budget_bytes

    def estimate_kv_bytes(self, context_tokens: int, reserve_tokens: int) -> int:
        """The bytes held for this session's cache with `context_tokens` prefilled and `reserve_tokens` more
        decoded, the snapshot's share included: `kvdemo.cache.state.budget.held_bytes_estimate`."""
        return budget.held_bytes_estimate(*self._budget_of[:3], context_tokens, reserve_tokens)

    # ---- answers ------------------------------------------------------------------------------
    def _close_active(self) -> None:
        if self._active is not None:
            self._active.close()
            self._active = None

    def prepare_question(self, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> PreparedQuestion:
        """`question` tokenized and checked once for the current prefill (`question_ids`, `check_answer`), to
        hand from a server's reservation to `stream(prepared)`. Raises: as `stream`."""
        max_new_tokens = checks.max_new_tokens(max_new_tokens)
        q_ids = self.question_ids(question)
        self.check_answer(len(q_ids), max_new_tokens)
        return PreparedQuestion(question, tuple(q_ids), max_new_tokens, self._prefilled()[2])

    def stream(
        self,
        question: str | PreparedQuestion,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        logprobs: list[torch.Tensor] | None = None,
    ) -> Generator[StepEvent, None, None]:
        """Answer `question` greedily, one `StepEvent` per decode step.

        Arguments are checked before the generator is returned, so bad input raises here. The cache is
        restored in a `finally`: when the answer ends, when the generator is closed early (Stop), or when
        a step raises. The finished `Answer` is appended to `history` in every case. An answer still open
        when another one starts (or a new prefill) is closed first.

        Args:
            question: the question (blank is refused), or a `PreparedQuestion` of this prefill (`prepare_question`,
                which carries its own max_new_tokens: not tokenized or checked again).
            max_new_tokens: most tokens to generate, >= 1; generation stops earlier at an EOS token.
            logprobs: where given, each step's log-probabilities are appended ([vocab_size] each): `score` of the
                answer's tokens, row for row, without a second pass.

        Raises:
            ValueError: no prefill yet, an empty question or one with a broken character (`check_text`),
                max_new_tokens < 1 or not an integer, or a question plus `max_new_tokens` that does not fit the
                model's window (numbers given).
            KVBudgetError (a ValueError): the cache with the question and `max_new_tokens` decoded would
                exceed `kv_budget_bytes`.
        """
        if not isinstance(question, PreparedQuestion):
            question = self.prepare_question(question, max_new_tokens)
        elif question.split != self._split:  # the same split by value: a question prepared on the server, sent here
            raise ValueError("the question was prepared for another prefill; prepare it again for this context")
        self._close_active()
        self._stop.clear()
        self._active = self._decode(question.text, list(question.ids), question.max_new_tokens, logprobs)
        return self._active

    def speed_limit(self) -> Any:
        """The decode floor of the cache as it is now (`kvdemo.cache.state.speedlimit.SpeedLimit`). Raises
        ValueError: nothing is prefilled."""
        from kvdemo.cache.state.speedlimit import speed_limit

        if self.cache is None:
            raise ValueError("prefill a context first")
        return speed_limit(self.loaded.model, self.cache)

    def request_stop(self) -> None:
        """Ask the answer now streaming to end after its current decode step, or the prefill now running to
        stop before its next chunk (thread-safe: the Stop button of a UI whose work runs in another thread). The
        stream then ends with `finish_reason="stopped"`, and the cache is restored as after any answer; a stopped
        prefill raises `PrefillStopped`. Does nothing when neither runs."""
        self._stop.set()

    def _decode(
        self, question: str, q_ids: list[int], max_new_tokens: int, logprobs: list[torch.Tensor] | None = None
    ) -> Generator[StepEvent, None, None]:
        cache, saved, _ = self._prefilled()

        def finished(answer: Answer) -> None:  # the cache is restored already
            if self._active is not None and cache is self.cache:
                self._active = None
            self.history.append(answer)

        return greedy_decode(self.loaded, cache, saved, question, q_ids, max_new_tokens, self._stop, finished, logprobs)

    def score(
        self,
        question: str,
        answer_ids: Sequence[int],
        on_step: Callable[[int, Cache], None] | None = None,
        until: Callable[[torch.Tensor], bool] | None = None,
    ) -> torch.Tensor:
        """Teacher-forced next-token log-probabilities of a given answer to `question` on this session's cache.

        The question is fed as in `stream`, then the answer's tokens one decode step at a time, so a
        quantized cache fills and flushes its residual exactly as during generation. Row i is the
        distribution the model gives before `answer_ids[i]` is known; feeding a session's own greedy answer
        reproduces the distributions of its generation (each row's argmax is that answer's token). The cache
        is restored afterwards (also on error); `history` is not changed.

        Args:
            question: the question, as for `stream`.
            answer_ids: the answer's token ids (length n >= 1), e.g. another backend's `Answer.token_ids`.
            on_step: called as `on_step(i, cache)` after the forward pass that gives row i, before the restore; it
                may read the cache (e.g. `telemetry.flushed_layers`, `cache_error.dequantized_kv`), never change it.
            until: called with each row ([vocab_size]) as it comes; True ends the scoring there.

        Returns:
            float32 log-probabilities on the CPU, shape [n, vocab_size] (fewer rows where `until` ended it).

        Raises:
            ValueError: no prefill yet, an empty question or answer, too many tokens, or a RoPE switch (`check_rope`).
        """
        answer_ids = [int(t) for t in answer_ids]
        if not answer_ids:
            raise ValueError("answer_ids is empty; give at least one token to score")
        q_ids = self.question_ids(question)
        loaded, (cache, saved, _) = self.loaded, self._prefilled()
        context_tokens = saved.seq_length
        if context_tokens + len(q_ids) + len(answer_ids) > self.loaded.max_context_tokens:
            raise ValueError(
                f"context {context_tokens:,} + question {len(q_ids):,} + answer {len(answer_ids):,} tokens exceeds the "
                f"model's {self.loaded.max_context_tokens:,}-token window"
            )
        check_rope(loaded, context_tokens, len(q_ids) + len(answer_ids), "Score a shorter answer")
        self._close_active()
        return teacher_forced(loaded, cache, saved, q_ids, answer_ids, on_step, until)

    def score_text(self, ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced log-probabilities of token ids read straight after the prefilled context, inside the user
        turn where the context sits (the text that continues it, as `kvdemo.evals.fidelity.perplexity_inputs` lays it
        out): `ids[0]` in one pass, then each next one as a decode step, so the residual fills and flushes as in
        generation; row i is the distribution that predicts `ids[i + 1]`. The cache is restored afterwards.

        Returns:
            float32 log-probabilities on the CPU, shape [len(ids) - 1, vocab_size].

        Raises:
            ValueError: fewer than 2 ids, no prefill yet, the window passed, or a RoPE switch (`check_rope`).
        """
        ids = [int(t) for t in ids]
        if len(ids) < 2:
            raise ValueError("score_text needs at least 2 token ids: each fed token predicts the next")
        loaded, (cache, saved, _) = self.loaded, self._prefilled()
        if saved.seq_length + len(ids) > loaded.max_context_tokens:
            raise ValueError(
                f"context {saved.seq_length:,} + {len(ids):,} tokens exceeds the model's "
                f"{loaded.max_context_tokens:,}-token window"
            )
        check_rope(loaded, saved.seq_length, len(ids), "Score fewer tokens")
        self._close_active()
        return teacher_forced(loaded, cache, saved, ids[:1], ids[1:])

    def ask(
        self,
        question: str,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        logprobs: list[torch.Tensor] | None = None,
    ) -> Answer:
        """Answer `question` to the end and return the `Answer` (also appended to `history`); `logprobs` as for
        `stream`.

        Raises:
            ValueError: see `stream`. An exception inside a decode step propagates after the cache is restored.
        """
        for _ in self.stream(question, max_new_tokens, logprobs):
            pass
        return self.history[-1]


def check_prefill(
    loaded: LoadedModel, spec: CacheSpec, kv_budget_bytes: int | None, context_tokens: int, reserve_tokens: int
) -> None:
    """Whether a prefill of `context_tokens` tokens of `spec` on `loaded`, keeping `reserve_tokens` for a question and
    its answer, fits: the model's window (`checks.prefill_fits`), its RoPE factors (`check_rope`), then
    `kv_budget_bytes` (`budget.check_budget`; None: no limit). `QASession.check_prefill`, and a session held on a
    device worker (`kvdemo.serve.device.RemoteSession`), which checks in the server before any job.

    Raises:
        ValueError: it does not fit the window; KVBudgetError (a ValueError): nor the budget.
    """
    checks.prefill_fits(loaded.max_context_tokens, context_tokens, reserve_tokens)
    if context_tokens:
        check_rope(loaded, context_tokens, reserve_tokens, "Prefill a shorter context or lower max_new_tokens")
        budget.check_budget(spec, loaded.config, loaded.dtype, kv_budget_bytes, context_tokens, reserve_tokens)


def check_answer(
    loaded: LoadedModel,
    spec: CacheSpec,
    kv_budget_bytes: int | None,
    context_tokens: int,
    question_tokens: int,
    max_new_tokens: int,
) -> None:
    """Whether an answer of up to `max_new_tokens` to a question of `question_tokens` tokens fits a cache of `spec`
    holding `context_tokens`: the window (`checks.answer_fits`), the RoPE factors, then `kv_budget_bytes`
    (`QASession.check_answer`, and `kvdemo.serve.device.RemoteSession`).

    Raises:
        ValueError: it does not fit the window; KVBudgetError (a ValueError): nor the budget.
    """
    decoded = question_tokens + max_new_tokens
    checks.answer_fits(loaded.max_context_tokens, context_tokens, question_tokens, max_new_tokens)
    check_rope(loaded, context_tokens, decoded, "Lower max_new_tokens")
    args = (spec, loaded.config, loaded.dtype, kv_budget_bytes, context_tokens, decoded)
    budget.check_budget(*args, "Lower max_new_tokens, or prefill a shorter context")
