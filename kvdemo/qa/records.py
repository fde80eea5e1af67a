"""The records a session returns: `PrefillReport` (what a prefill did) and `Answer` (one finished answer).
Plain data, JSON-ready through `to_dict`; the page, the command line and compare read them by field."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvdemo.cache.state.telemetry import MemoryReport


class Cancelled(Exception):
    """A job stopped before its end (Stop, Cancel, a caller's bound), with what it finished: `partial` (a comparison's
    report of the specs done, a grid of the cells done, the rows of a recommendation measured; None for a prefill,
    whose unfinished cache is dropped). The one type of a stopped job: each job's own subclass names its partial
    result. It pickles whole, so a job stopped in a device worker is raised again in the server as itself.

    Args:
        message: what was stopped and when; partial: what finished before.
    """

    def __init__(self, message: str, partial: Any = None):
        super().__init__(message)
        self.partial = partial

    def __reduce__(self) -> tuple[Any, ...]:
        return _cancelled, (type(self), str(self), self.partial)


def _cancelled(cls: type[Cancelled], message: str, partial: Any) -> Cancelled:
    """A `Cancelled` of class `cls` made again from its message and partial result (its own `__init__` may take
    other arguments)."""
    error = cls.__new__(cls)
    Cancelled.__init__(error, message, partial)
    return error


@dataclass(frozen=True)
class PrefillReport:
    """What a prefill did.

    Attributes:
        context_tokens: tokens prefilled (chat template prefix included; the context's trailing whitespace, fed
            with each question, not).
        seconds: wall time of the prefill forward pass and snapshot.
        memory: the bytes held for the cache right after the prefill (the snapshot's included).
        full_precision_bytes: what a `DynamicCache` in the model's dtype holds for the same tokens.
        prompt_matches_template: `QASession.prompt_ids` equals the chat template's ids (checked on probe
            questions, `kvdemo.qa.prompt.PROBE_QUESTIONS`); False when this tokenizer merges the context's end with
            the question or its template changes the user's text, with `prompt_note` saying so.
        prompt_note: why the ids differ from the template's; None when they do not.
        template_clock: where the chat template writes the time (Llama 3.1's date), the moment it read at this
            prefill and reads for every question of the session (`kvdemo.qa.prompt.PromptSplit.clock`); None where
            it writes none.
        opened_from: the session file this prefill was opened from (`kvdemo.qa.session_file.open_session`), whose
            load `seconds` then measures; None for a prefill run here.
        prefill_seconds: the wall time of the prefill itself (seconds): `seconds`, or for an opened file the time
            the prefill that wrote it took.
        deploy: the lines of the engines that store this cache the same way, kvdemo's last
            (`kvdemo.cache.spec.CacheSpec.deployments`: "llama.cpp: llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0
            -fa on").
        decode_read: how the decode steps attend to this cache (`kvdemo.cache.layers.attention.decode_read`:
            "Decode attention reads the stored codes in 30 layers").
    """

    context_tokens: int
    seconds: float
    memory: MemoryReport
    full_precision_bytes: int
    prompt_matches_template: bool = True
    prompt_note: str | None = None
    template_clock: datetime | None = None
    opened_from: str | None = None
    prefill_seconds: float | None = None
    deploy: tuple[str, ...] = ()
    decode_read: str = ""

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field (the memory per layer, the clock in ISO 8601): the command line's and
        the MCP tools' JSON (a device worker's records cross pickled, `kvdemo.serve.gpu_job`)."""
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["memory"] = self.memory.to_dict(per_layer=True)
        out["template_clock"] = self.template_clock.isoformat() if self.template_clock is not None else None
        out["deploy"] = list(self.deploy)
        return out

    @property
    def clock_note(self) -> str | None:
        """A line for the page and the command line where the template writes the date: which date every question
        of this session reads, and that today's may differ; None where it writes none."""
        if self.template_clock is None:
            return None
        return (
            f"The chat template writes the date: every question of this session reads its prefill's, "
            f"{self.template_clock:%d %b %Y} ({self.template_clock:%H:%M:%S}); a fresh prefill on another day reads "
            "that day's"
        )

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
        text: the answer text (special tokens skipped; whole characters only: an answer cut inside a character
            ends before it).
        token_ids: the generated token ids, EOS included when it was generated.
        steps: decode steps run (forward passes: the question's and one per fed-back token).
        flushes: flushes counted per layer during the answer (tuple of length num_layers).
        seconds: wall time of the answer (seconds).
        cache_length_after: the cache's length after the restore; equals the context's tokens.
        finish_reason: `eos`, `max_new_tokens`, `stopped` (the stream was closed early) or `error`.
        question_tokens: tokens of the question's own forward pass (step 0, which also gives the first token).
        question_seconds: wall time of that pass (seconds): it reads the whole question at once and may flush.
        question_flushes: flushes during that pass, summed over layers.
    """

    question: str
    text: str
    token_ids: tuple[int, ...]
    steps: int
    flushes: tuple[int, ...]
    seconds: float
    cache_length_after: int
    finish_reason: str
    question_tokens: int = 0
    question_seconds: float = 0.0
    question_flushes: int = 0

    @property
    def flush_count(self) -> int:
        """Flushes summed over layers (a step in which all 30 layers flush counts 30)."""
        return sum(self.flushes)

    @property
    def flush_steps(self) -> int:
        """Steps (the question's pass included) in which layers flushed: the most flushes of any one layer, since
        each layer is updated once per step and flushes at most once in it."""
        return max(self.flushes, default=0)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of the whole answer, the question's pass included."""
        return len(self.token_ids) / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens per second of the decode steps after the question's pass (one token each); 0 without any."""
        decode_seconds = self.seconds - self.question_seconds
        decoded = len(self.token_ids) - 1
        return decoded / decode_seconds if decoded > 0 and decode_seconds > 0 else 0.0

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
            "question_tokens": self.question_tokens,
            "question_seconds": round(self.question_seconds, 4),
            "question_flushes": self.question_flushes,
            "decode_tokens_per_second": round(self.decode_tokens_per_second, 2),
            "cache_length_after": self.cache_length_after,
            "finish_reason": self.finish_reason,
        }
