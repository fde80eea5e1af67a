"""The forward passes on top of a prefilled cache: the greedy decode loop of an answer (`greedy_decode`) and the
teacher-forced scoring of a given answer (`teacher_forced`). Both feed the question's ids in one pass, then one
token per decode step, so a quantized cache fills and flushes its residual as in generation; both restore the cache
to its post-prefill snapshot in a `finally` (docs/DESIGN.md, invariant 1), whatever ends them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator

import torch
from transformers.cache_utils import Cache

from kvdemo.cache.model.geometry import full_precision_bytes
from kvdemo.cache.state import snapshot
from kvdemo.cache.state.telemetry import StepEvent, flushed_layers, kv_memory
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.records import Answer
from kvdemo.qa.text import TextStream


def greedy_decode(
    loaded: LoadedModel,
    cache: Cache,
    saved: snapshot.CacheSnapshot,
    question: str,
    q_ids: list[int],
    max_new_tokens: int,
    stop: threading.Event,
    finished: Callable[[Answer], None],
    logprobs: list[torch.Tensor] | None = None,
) -> Generator[StepEvent, None, None]:
    """Answer greedily on `cache` (prefilled; `saved` its post-prefill snapshot), yielding one `StepEvent` per
    decode step (the first is the question's pass over `q_ids`): token, text so far, seconds, memory, flushes.
    It ends at one of `loaded.eos_token_ids`, after `max_new_tokens` (checked >= 1), or after the step during which
    `stop` is set; then, or on close (Stop) or on error, the cache is restored and `finished(answer)` is called.
    `logprobs`, where given, receives each step's float32 log-probabilities on the CPU ([vocab_size]): the rows
    `teacher_forced` gives for this answer, from the same forward passes."""
    text = TextStream(loaded.tokenizer)
    flushes = [0] * len(cache.layers)
    token_ids: list[int] = []
    finish_reason = "error"
    start = time.perf_counter()
    question_seconds, question_flushes = 0.0, 0
    inputs = torch.tensor([q_ids], device=loaded.device)
    try:
        for step in range(max_new_tokens):
            step_start = time.perf_counter()
            with torch.no_grad():
                logits = loaded.forward(inputs, cache)
            token = int(logits[0, -1].argmax())
            if logprobs is not None:
                logprobs.append(torch.log_softmax(logits[0, -1].float(), dim=-1).cpu())
            now = time.perf_counter()
            token_ids.append(token)  # one per forward pass done: len(token_ids) is the steps
            flushed = flushed_layers(cache)
            for index in flushed:
                flushes[index] += 1
            if step == 0:
                question_seconds, question_flushes = now - step_start, len(flushed)
            text.push(token)
            cache_length = int(cache.get_seq_length())  # transformers 5.25's linear layers count in a tensor
            finish_reason = "eos" if token in loaded.eos_token_ids else "max_new_tokens"
            yield StepEvent(
                step=step,
                token_id=token,
                text=text.text,
                seconds=now - step_start,
                elapsed=now - start,
                memory=kv_memory(cache, saved),
                flushed_layers=flushed,
                cache_length=cache_length,
                full_precision_bytes=full_precision_bytes(loaded.config, cache_length, loaded.dtype),
            )
            if finish_reason == "eos":
                break
            if stop.is_set():
                finish_reason = "stopped" if step + 1 < max_new_tokens else finish_reason
                break
            inputs = torch.tensor([[token]], device=loaded.device)
    except GeneratorExit:
        if finish_reason != "eos" and len(token_ids) < max_new_tokens:
            finish_reason = "stopped"
        raise
    except BaseException:
        finish_reason = "error"
        raise
    finally:
        snapshot.restore(cache, saved)
        finished(
            Answer(
                question=question,
                text=text.text,
                token_ids=tuple(token_ids),
                steps=len(token_ids),
                flushes=tuple(flushes),
                seconds=time.perf_counter() - start,
                cache_length_after=int(cache.get_seq_length()),
                finish_reason=finish_reason,
                question_tokens=len(q_ids),
                question_seconds=question_seconds,
                question_flushes=question_flushes,
            )
        )


def teacher_forced(
    loaded: LoadedModel,
    cache: Cache,
    saved: snapshot.CacheSnapshot,
    q_ids: list[int],
    answer_ids: list[int],
    on_step: Callable[[int, Cache], None] | None = None,
    until: Callable[[torch.Tensor], bool] | None = None,
) -> torch.Tensor:
    """The next-token log-probabilities of a given answer on `cache` (see `QASession.score`): the question's ids in
    one pass, then each answer token as a decode step; the cache restored to `saved` afterwards (also on error).
    `until(row)`, given each row as it is computed, ends the scoring after that row when it returns True (a
    measurement that has seen enough: `kvdemo.compare.recommend`).

    Returns:
        float32 log-probabilities on the CPU, shape [k, vocab_size]: k = len(answer_ids), or fewer where `until`
        ended it.
    """
    rows = []
    inputs = torch.tensor([q_ids], device=loaded.device)
    try:
        for token in answer_ids:
            with torch.no_grad():
                logits = loaded.forward(inputs, cache)
            rows.append(torch.log_softmax(logits[0, -1].float(), dim=-1).cpu())
            if on_step is not None:
                on_step(len(rows) - 1, cache)
            if until is not None and until(rows[-1]):
                break
            inputs = torch.tensor([[token]], device=loaded.device)
    finally:
        snapshot.restore(cache, saved)
    return torch.stack(rows)
