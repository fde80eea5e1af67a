"""Sections 1-2 of `benchmarks/run_all.py`: an answer over kvdemo's restore against one over `copy.deepcopy` of the
prefilled cache (the transformers documentation's prefix-cache pattern), with the bytes each holds per step, and
the bare decode loop (forward + argmax, no telemetry) that the deepcopy answer and the overhead section use."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from kvdemo import QASession
from kvdemo.cache.state import snapshot
from kvdemo.cache.state.telemetry import storage_bytes


def held_bytes(*objects: Any) -> int:
    """Bytes of every distinct tensor storage held by `objects`: caches (every attribute of every layer) and
    `snapshot.CacheSnapshot`s (every saved attribute); each storage counted once across all of them, quantized
    tensors opened to their packed data, scales and zero points as `kvdemo.cache.state.telemetry.kv_memory` does."""
    values = []
    for obj in objects:
        if isinstance(obj, snapshot.CacheSnapshot):
            values += [v for layer in obj.layers if layer.attributes for v in layer.attributes.values()]
        else:
            values += [v for layer in obj.layers for v in vars(layer).values()]
    return storage_bytes(values)  # the one byte count (kvdemo.cache.state.telemetry), each storage once


def answer_with_restore(session: QASession, question: str, max_new_tokens: int) -> dict[str, Any]:
    """One answer through `QASession.stream` (snapshot taken at the prefill, restored after the answer).

    Measures, at every decode step, the bytes of the cache alone and of the cache plus the session's snapshot;
    the measuring time is left out of the question's seconds.
    """
    restore_seconds = []
    real_restore = snapshot.restore

    def timed_restore(cache, saved):
        start = time.perf_counter()
        real_restore(cache, saved)
        restore_seconds.append(time.perf_counter() - start)

    snapshot.restore = timed_restore  # QASession calls `snapshot.restore` through the module
    cache_alone, with_mechanism, measuring, steps, device = [], [], 0.0, [], []
    try:
        start = time.perf_counter()
        for event in session.stream(question, max_new_tokens):
            m0 = time.perf_counter()
            cache_alone.append(held_bytes(session.cache))
            with_mechanism.append(held_bytes(session.cache, session._snapshot))  # what QASession keeps
            steps.append((event.step, event.seconds, bool(event.flushed_layers)))
            if event.memory.device_allocated_bytes is not None:  # CUDA only
                device.append(event.memory.device_allocated_bytes)
            measuring += time.perf_counter() - m0
        seconds = time.perf_counter() - start - measuring
    finally:
        snapshot.restore = real_restore
    answer = session.history[-1]
    return {
        "token_ids": list(answer.token_ids),
        "seconds": seconds,
        "mechanism_seconds": sum(restore_seconds),
        "peak_cache_bytes": max(cache_alone),
        "peak_held_bytes": max(with_mechanism),
        "extra_bytes": max(w - c for w, c in zip(with_mechanism, cache_alone)),
        "steps": steps,
        "device_allocated_peak_bytes": max(device) if device else None,
        "cache_length_after": answer.cache_length_after,
    }


def bare_decode(loaded, cache, input_ids: list[int], max_new_tokens: int, on_step=None) -> list[int]:
    """Greedy decoding on `cache`: model forward + argmax, no telemetry; stops at EOS like `QASession`."""
    tokens: list[int] = []
    inputs = torch.tensor([input_ids], device=loaded.device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = loaded.model(input_ids=inputs, cache=cache, use_cache=True, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if on_step is not None:
                on_step()
            if token in loaded.eos_token_ids:
                break
            inputs = torch.tensor([[token]], device=loaded.device)
    return tokens


def answer_with_deepcopy(session: QASession, question: str, max_new_tokens: int) -> dict[str, Any]:
    """One answer by the transformers docs' prefix-cache pattern: `copy.deepcopy(prefilled_cache)`, then
    decode on the copy; the prefilled original stays alive for the next question."""
    original = session.cache
    start = time.perf_counter()
    try:
        working = copy.deepcopy(original)
    except Exception as error:  # quanto's tensor subclasses, for one
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    copy_seconds = time.perf_counter() - start
    cache_alone, held, measuring = [], [], [0.0]

    def measure():  # `working` is this function's local, alive until the `del` below
        m0 = time.perf_counter()
        cache_alone.append(held_bytes(working))  # noqa: F821
        held.append(held_bytes(working, original))  # noqa: F821
        measuring[0] += time.perf_counter() - m0

    tokens = bare_decode(session.loaded, working, session.question_ids(question), max_new_tokens, measure)
    seconds = time.perf_counter() - start - measuring[0]
    del working
    return {
        "token_ids": tokens,
        "seconds": seconds,
        "mechanism_seconds": copy_seconds,
        "peak_cache_bytes": max(cache_alone),
        "peak_held_bytes": max(held),
        "extra_bytes": max(h - c for h, c in zip(held, cache_alone)),
    }
