"""The systems `benchmarks/peers.py` runs on one job: kvdemo's sessions, transformers' documented prefix-cache
pattern, re-prefilling each question, and llama.cpp (llama-cpp-python) on the embedded GGUF.

Every runner reads the same token ids, a `Job`'s: the prefix (what `QASession.prefill` puts in the cache: the
chat template up to the context's end) once, then each question's ids on top of it (`QASession.question_ids`),
and decodes greedily (argmax) up to `max_new_tokens` or an EOS. Each exposes `prefill(job) -> seconds` and
`answer(job, i, max_new_tokens) -> Answered` (question `i`), so the rounds in `peers.py` time them all alike.

- `KvdemoRunner`: `QASession.prefill` once, `QASession.stream` per question (the snapshot restored after it).
- `PatternRunner`: the transformers documentation's "Re-use Cache to continue generation" pattern
  (https://huggingface.co/docs/transformers/kv_cache, prefix caching): the prefix in one forward pass into a
  `DynamicCache` (or a `QuantizedCache`), then per question `copy.deepcopy(prompt_cache)` and `model.generate`
  on the whole prompt with the copy, `do_sample=False`.
- `RePrefillRunner`: no cache kept: `model.generate` on the whole prompt with a fresh `DynamicCache` per question.
- `LlamaCppRunner`: `llama_cpp.Llama` on the same GGUF file with `type_k`/`type_v` set (f16, q8_0, q4_0) and flash
  attention on (llama.cpp needs it for a quantized V cache), the prefix evaluated once; per question its own cut
  back of the KV cache to the prefix (`llama_memory_seq_rm` from the prefix's end on, which `Llama.eval` calls
  when `n_tokens` is set back), then `eval` of the question and one `eval` per token, argmax of the last logits.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from restore_mechanisms import held_bytes  # noqa: E402  (benchmarks/restore_mechanisms.py)
from transformers import DynamicCache, QuantizedCache
from transformers.generation.streamers import BaseStreamer

from kvdemo import CacheSpec, QASession
from kvdemo.cache.state import snapshot
from kvdemo.cache.state.speedlimit import SpeedLimit, speed_limit
from kvdemo.compare.llama_cpp_check import GGML_TYPE_IDS

GGML_TYPE_BYTES = {"f16": (2, 1), "q8_0": (34, 32), "q4_0": (18, 32)}
"""ggml's storage per KV type: (bytes, values) of one block (ggml/src/ggml.c `type_traits`: q8_0 is 32 int8 values
and one float16 scale, q4_0 is 32 4-bit values and one float16 scale)."""


@dataclass
class Answered:
    """One answer as a runner timed it.

    Attributes:
        token_ids: the generated ids (EOS included when generated).
        seconds: the whole answer: the question's forward pass, the decode steps and, for kvdemo, the restore
            (seconds).
        first_token_seconds: from the call to the first token (the question's forward pass, seconds).
        mechanism_seconds: what the runner spends to keep the prefix for the next question: kvdemo's restore,
            the pattern's `copy.deepcopy`, llama.cpp's `llama_memory_seq_rm`; 0 for re-prefill (seconds).
        kv_held_bytes: KV bytes held at the answer's last step: the cache and whatever keeps the prefix (kvdemo's
            snapshot, the pattern's prefilled original); llama.cpp's KV buffer, allocated for its whole `n_ctx`
            (bytes).
    """

    token_ids: list[int]
    seconds: float
    first_token_seconds: float
    mechanism_seconds: float = 0.0
    kv_held_bytes: int | None = None

    @property
    def decode_tokens(self) -> int:
        """Tokens after the first one (each one decode step)."""
        return max(len(self.token_ids) - 1, 0)

    @property
    def decode_seconds(self) -> float:
        """The answer's seconds after its first token, less the mechanism's."""
        return self.seconds - self.first_token_seconds - self.mechanism_seconds


@dataclass(frozen=True)
class Job:
    """One context and its questions, as text and as the token ids every runner reads.

    Attributes:
        context: the context's text.
        questions: the questions' texts.
        prefix_ids: the prefilled ids (the chat template up to the context's end).
        question_ids: per question, the ids fed on top of the prefix.
    """

    context: str
    questions: tuple[str, ...]
    prefix_ids: tuple[int, ...]
    question_ids: tuple[tuple[int, ...], ...]

    @classmethod
    def make(cls, loaded, context: str, questions: list[str]) -> Job:
        """The ids a `dynamic` `QASession` makes of `context` and `questions` (`QASession.prompt_ids`)."""
        session = QASession(loaded, CacheSpec("dynamic"))
        session.prefill(context)
        n = session.cache_length
        prefix = tuple(session.prompt_ids(questions[0])[:n])
        return cls(context, tuple(questions), prefix, tuple(tuple(session.question_ids(q)) for q in questions))


@dataclass
class KvdemoRunner:
    """A `QASession` of `spec` on `loaded` (see the module docstring)."""

    loaded: object
    spec: CacheSpec
    name: str = ""
    session: QASession = field(init=False)

    def __post_init__(self):
        self.name = self.name or f"kvdemo {self.spec.short_text}"
        self.session = QASession(self.loaded, self.spec)

    def prefill(self, job: Job) -> float:
        start = time.perf_counter()
        self.session.prefill(job.context)
        seconds = time.perf_counter() - start
        if self.session.prompt_ids(job.questions[0]) != list(job.prefix_ids + job.question_ids[0]):
            raise AssertionError(f"{self.name} read other ids than the job's")
        return seconds

    def answer(self, job: Job, i: int, max_new_tokens: int) -> Answered:
        question = self.session.prepare_question(job.questions[i], max_new_tokens)
        restore_seconds, real_restore = [], snapshot.restore

        def timed_restore(cache, saved):
            start = time.perf_counter()
            real_restore(cache, saved)
            restore_seconds.append(time.perf_counter() - start)

        snapshot.restore = timed_restore  # QASession calls `snapshot.restore` through the module
        first, held, measuring = 0.0, 0, 0.0
        try:
            start = time.perf_counter()
            for event in self.session.stream(question):
                if event.step == 0:
                    first = time.perf_counter() - start
                m0 = time.perf_counter()
                held = held_bytes(self.session.cache, self.session._snapshot)
                measuring += time.perf_counter() - m0
            seconds = time.perf_counter() - start - measuring
        finally:
            snapshot.restore = real_restore
        answer = self.session.history[-1]
        return Answered(list(answer.token_ids), seconds, first, sum(restore_seconds), held)

    def floor(self) -> SpeedLimit:
        """The floor of a decode step on the prefilled cache (`kvdemo.cache.state.speedlimit`)."""
        return speed_limit(self.loaded.model, self.session.cache)


class _Clock(BaseStreamer):
    """A `generate` streamer that notes when the first new token arrives (`put` is called with the prompt first)."""

    def __init__(self):
        self.puts: list[float] = []

    def put(self, value):
        self.puts.append(time.perf_counter())

    def end(self):
        pass


def _generate(loaded, prompt_ids: list[int], cache, max_new_tokens: int) -> tuple[list[int], float]:
    """Greedy `model.generate` on `prompt_ids` with `cache`: the new ids and the seconds to the first one."""
    inputs = torch.tensor([prompt_ids], device=loaded.device)
    clock = _Clock()
    start = time.perf_counter()
    with torch.no_grad():
        out = loaded.model.generate(
            input_ids=inputs,
            attention_mask=torch.ones_like(inputs),
            cache=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(loaded.eos_token_ids),
            pad_token_id=min(loaded.eos_token_ids),
            streamer=clock,
        )
    first = (clock.puts[1] if len(clock.puts) > 1 else time.perf_counter()) - start
    return out[0, len(prompt_ids) :].tolist(), first


@dataclass
class PatternRunner:
    """transformers' prefix-cache pattern with `DynamicCache` (`backend="dynamic"`) or `QuantizedCache(backend)`.

    `prefill` raises what the library raises; `answer` raises where `copy.deepcopy` of the cache fails (quanto's
    tensors), which `peers.py` records once as that peer's result.
    """

    loaded: object
    backend: str = "dynamic"
    name: str = ""
    prefix: list[int] = field(default_factory=list)
    prompt_cache: object = None

    def __post_init__(self):
        self.name = self.name or f"transformers pattern ({self.backend})"

    def _new_cache(self):
        if self.backend == "dynamic":
            return DynamicCache(config=self.loaded.config)
        bits = {} if self.backend == "fp8" else {"nbits": 4}  # fp8 takes no nbits
        return QuantizedCache(self.backend, self.loaded.config, **bits)

    def prefill(self, job: Job) -> float:
        start = time.perf_counter()
        self.prefix, self.prompt_cache = list(job.prefix_ids), self._new_cache()
        with torch.no_grad():
            self.loaded.model(input_ids=torch.tensor([self.prefix]), cache=self.prompt_cache)
        return time.perf_counter() - start

    def answer(self, job: Job, i: int, max_new_tokens: int) -> Answered:
        start = time.perf_counter()
        working = copy.deepcopy(self.prompt_cache)
        copied = time.perf_counter() - start
        tokens, first = _generate(self.loaded, self.prefix + list(job.question_ids[i]), working, max_new_tokens)
        seconds = time.perf_counter() - start
        return Answered(tokens, seconds, first, copied, held_bytes(working, self.prompt_cache))


@dataclass
class RePrefillRunner:
    """No cache kept between questions: the whole prompt through `generate` with a fresh `DynamicCache`."""

    loaded: object
    name: str = "re-prefill per question"

    def prefill(self, job: Job) -> float:
        return 0.0  # nothing is kept: every answer reads the whole prompt

    def answer(self, job: Job, i: int, max_new_tokens: int) -> Answered:
        cache = DynamicCache(config=self.loaded.config)
        start = time.perf_counter()
        tokens, first = _generate(self.loaded, list(job.prefix_ids + job.question_ids[i]), cache, max_new_tokens)
        return Answered(tokens, time.perf_counter() - start, first, 0.0, held_bytes(cache))


class LlamaCppRunner:
    """llama.cpp on `gguf` with a KV cache of `kv_type` (`f16`, `q8_0`, `q4_0`), `threads` threads.

    Raises:
        ImportError: llama-cpp-python is not installed (`make bench-peers` builds it).
    """

    def __init__(self, gguf: Path, kv_type: str, n_ctx: int, threads: int, layers: int, kv_width: int):
        import llama_cpp  # noqa: PLC0415  (optional: only `make bench-peers` installs it)
        import numpy as np  # noqa: PLC0415

        self._np = np
        self.name, self.kv_type = f"llama.cpp {kv_type} KV", kv_type
        self.n_ctx, self.layers, self.kv_width = n_ctx, layers, kv_width
        self.llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=GGML_TYPE_IDS[kv_type],
            type_v=GGML_TYPE_IDS[kv_type],
            flash_attn=True,
            verbose=False,
        )
        self.eos = self.llm.token_eos()
        self.n_prefix = 0

    def _argmax(self) -> int:
        logits = self._np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def prefill(self, job: Job) -> float:
        start = time.perf_counter()
        self.llm.reset()
        self.llm.eval(list(job.prefix_ids))
        self.n_prefix = len(job.prefix_ids)
        return time.perf_counter() - start

    def answer(self, job: Job, i: int, max_new_tokens: int) -> Answered:
        start = time.perf_counter()
        self.llm._ctx.kv_cache_seq_rm(-1, self.n_prefix, -1)  # llama.cpp's own cut back to the prefix
        self.llm.n_tokens = self.n_prefix
        cut = time.perf_counter() - start
        self.llm.eval(list(job.question_ids[i]))
        tokens = [self._argmax()]
        first = time.perf_counter() - start
        while len(tokens) < max_new_tokens and tokens[-1] != self.eos:
            self.llm.eval([tokens[-1]])
            tokens.append(self._argmax())
        return Answered(tokens, time.perf_counter() - start, first - cut, cut, self.kv_bytes(self.llm.n_ctx()))

    def kv_bytes(self, tokens: int) -> int:
        """Bytes of keys and values for `tokens` tokens at this KV type (`ggml_kv_bytes`)."""
        return ggml_kv_bytes(self.kv_type, tokens, self.layers, self.kv_width)

    def floor(self, weight_bytes: int, tokens: int, bandwidth: float) -> SpeedLimit:
        """The floor of a decode step at `tokens` tokens: the GGUF's tensor bytes plus the KV bytes read."""
        return SpeedLimit(weight_bytes, self.kv_bytes(tokens), tokens, bandwidth)


def ggml_kv_bytes(kv_type: str, tokens: int, layers: int, kv_width: int) -> int:
    """Bytes of llama.cpp's keys and values for `tokens` tokens: per layer and token a key row and a value row of
    `kv_width` (KV heads x head_dim) values, each row stored in ggml blocks of `kv_type` (`GGML_TYPE_BYTES`).

    Raises:
        ValueError: `kv_width` is not a whole number of blocks (ggml refuses such a row).
    """
    block_bytes, block_values = GGML_TYPE_BYTES[kv_type]
    if kv_width % block_values:
        raise ValueError(f"a {kv_type} row holds a multiple of {block_values} values, not {kv_width}")
    return tokens * layers * 2 * (kv_width // block_values) * block_bytes


def gguf_tensor_bytes(path: Path) -> int:
    """Bytes of the tensors in a GGUF file (`gguf.GGUFReader`): what llama.cpp reads of its weights per step."""
    from gguf import GGUFReader  # noqa: PLC0415

    return sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
