"""What a recommendation found (`kvdemo.compare.recommend`): every candidate's row, the frontier, the pick with its
deploy lines and one sentence of why. Plain records (numbers and strings, `to_dict`/`from_dict`), so they cross a
process and are drawn from alone."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, cast

import pandas as pd

from kvdemo.qa.records import Cancelled

FULL = "full"
"""A row measured on every answer token of every question (and, where it could be the pick, on the held-out tokens)."""
BOUND = "bound"
"""A row measured until its KL, summed over the answer tokens scored so far, passed what the whole mean may hold
(the ceiling, or under a byte budget the best mean so far, times every answer token): each token's KL is >= 0, so
the mean over every token is at least that sum over their count (`RecommendRow.kl_at_least`), whatever the rest
would add. The row is out on a figure it measured, not on a guess."""


@dataclass(frozen=True)
class RecommendRow:
    """One candidate.

    Attributes:
        spec: the spec's text (`CacheSpec.short_text`); backend: its backend.
        bytes_per_token: KV bytes per context token at the context's length (the registry's byte formula, every
            token stored: no residual), then at `Recommendation.lengths` (a window's bytes stop growing).
        mean_kl: mean KL(P_dynamic || P_spec) over every answer token of every question, teacher-forced on
            `dynamic`'s answers (nats/token; None unless measured in full).
        kl_at_least: for a `BOUND` row, the lower bound its scored tokens prove on `mean_kl` (nats/token).
        positions: the answer tokens scored (all of them for a `FULL` row).
        same_top_p, p99_kl, p999_kl, rms_dp: llama.cpp's `--kl-divergence` report over the answer tokens (percent,
            nats, nats, percent: `kvdemo.evals.fidelity.KLStats`); None unless measured in full.
        question_kl: the mean KL of each question's answer tokens (a full row), in the order of the questions.
        held_out_kl, perplexity_ratio: over the text's held-out end (read after the context, as text that
            continues it): its mean KL to `dynamic`, and its perplexity through this cache over `dynamic`'s (None:
            not measured).
        measured: `full`, `bound`, or "" (refused by the model, or not measured: see `note`).
        deploy: the lines of the engines that store it the same way (`kvdemo.cache.deploy`), kvdemo's last.
        note: why it was refused or not measured; "" otherwise.
    """

    spec: str
    backend: str
    bytes_per_token: tuple[float, ...]
    mean_kl: float | None = None
    kl_at_least: float | None = None
    positions: int = 0
    same_top_p: float | None = None
    p99_kl: float | None = None
    p999_kl: float | None = None
    rms_dp: float | None = None
    question_kl: tuple[float, ...] = ()
    held_out_kl: float | None = None
    perplexity_ratio: float | None = None
    measured: str = ""
    deploy: tuple[str, ...] = ()
    note: str = ""

    @property
    def llama_cpp_command(self) -> str | None:
        """The deploy line that runs this row's cache in llama.cpp with a quantized type (`llama.cpp: [LLAMA_ATTN_ROT_
        DISABLE=1] llama-server ... -ctk q5_0 -ctv q5_0 -fa on ...`), or None (llama.cpp stores it otherwise, or it is
        llama.cpp's default f16 cache)."""
        return next((line for line in self.deploy if line.startswith("llama.cpp:") and " -ctk " in line), None)

    @property
    def kl(self) -> float | None:
        """The KL figure it has: the full mean, else the lower bound a `BOUND` row proved."""
        return self.mean_kl if self.mean_kl is not None else self.kl_at_least


@dataclass(frozen=True)
class TokenIds:
    """The token ids a recommendation scored, so an engine can read the very same ones (`--verify`).

    Attributes:
        prefix: the prefill's ids (the template's opening and the context, `PromptSplit.prefix`).
        questions: each question's ids fed after the prefix (`QASession.question_ids`), in the order asked.
        answers: `dynamic`'s greedy answer to each (the answer tokens every candidate was scored on).
    """

    prefix: tuple[int, ...]
    questions: tuple[tuple[int, ...], ...]
    answers: tuple[tuple[int, ...], ...]

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TokenIds:
        return cls(tuple(data["prefix"]), *(tuple(tuple(ids) for ids in data[k]) for k in ("questions", "answers")))


@dataclass(frozen=True)
class EngineCheck:
    """The pick run in the engine itself, on the same GGUF and `TokenIds` (`kvdemo.compare.llama_cpp_check`).

    Attributes:
        engine: `llama.cpp`; version: its binding's version (llama-cpp-python).
        spec: the pick checked; command: the deploy line the engine ran it as.
        kl: the engine's mean KL of the pick's cache against its own f16 cache, both with flash attention on, over
            the same answer tokens as `kvdemo_kl` (nats/token).
        kvdemo_kl: kvdemo's mean KL of the pick against `dynamic` (`RecommendRow.mean_kl`).
        floor_kl: the engine's q8_0 cache against its f16 one on the same tokens (nats/token). q8_0 stores keys and
            values within KL 0.0002-0.0013 (kvdemo's figure, docs/ggml.md), so this is mostly what the engine's
            quantized-cache arithmetic costs by itself (the query rounded to 8 bits for the dot products, the values
            accumulated otherwise): a floor under any quantized type's figure there.
        same_top_p: the percentage of answer tokens that are the engine's own top token with its f16 cache: the
            two engines read the same text (near 100 %; far below, the ids or the weights differ).
        positions: answer tokens scored. seconds: the engine's three runs.
    """

    engine: str
    version: str
    spec: str
    command: str
    kl: float
    kvdemo_kl: float
    floor_kl: float
    same_top_p: float
    positions: int
    seconds: float

    @property
    def ratio(self) -> float:
        """The engine's KL over kvdemo's."""
        return self.kl / self.kvdemo_kl if self.kvdemo_kl > 0 else math.inf

    @property
    def agrees(self) -> bool:
        """The two figures within a factor of 2 of each other (the bar `kvdemo.compare.llama_cpp_check` states)."""
        return 0.5 <= self.ratio <= 2

    def lines(self) -> list[str]:
        """What the command line prints: the two figures side by side, whether they agree, and the engine's floor."""
        return [
            f"{self.engine} {self.version} on the same GGUF and ids ({self.positions} answer tokens, "
            f"{self.seconds:.0f} s): `{self.command}`",
            f"  mean KL against its f16 cache (flash attention on in both): {self.kl:.5f}; kvdemo's: "
            f"{self.kvdemo_kl:.5f}; {self.ratio:.2f}x, {'within' if self.agrees else 'NOT within'} 2x",
            f"  of which its q8_0 cache already gives {self.floor_kl:.5f} (its quantized-cache arithmetic: q8_0's "
            f"storage moves it by 0.0002-0.0013 in kvdemo). Its f16 run's top token is dynamic's answer token at "
            f"{self.same_top_p:.1f} % of positions",
        ]


@dataclass(frozen=True)
class Recommendation:
    """A recommendation for one model on one text.

    Attributes:
        model: the model's name. context_tokens: the context's tokens (the held-out ones excluded).
        target: `max_kl` or `bytes_per_token`; limit: its value (nats/token, or bytes per context token).
        engine: `any` or one of `kvdemo.cache.deploy.ENGINES`. questions: asked on the text.
        lengths: the other context lengths `RecommendRow.bytes_per_token` gives (tokens).
        rows: every candidate, in the order measured (`dynamic` first).
        pick: the chosen row's spec ("" while unfinished); why: one sentence of why.
        plan: the per-layer plan's summary line, where one was measured ("" otherwise).
        held_out_tokens: the tokens of the text's end held out and scored for the perplexity (0: none).
        seconds: wall time. finished: False for a stopped run's partial record.
    """

    model: str
    context_tokens: int
    target: str
    limit: float
    engine: str
    questions: tuple[str, ...]
    lengths: tuple[int, ...]
    rows: tuple[RecommendRow, ...] = ()
    pick: str = ""
    why: str = ""
    plan: str = ""
    held_out_tokens: int = 0
    seconds: float = 0.0
    finished: bool = True
    source: str = field(default="", compare=False)
    """Where the text came from, for a stored page default ("the built-in Normans text"); "" otherwise."""
    weights: str = ""
    """What the weights say before anything runs (`kvdemo.compare.weights.WeightTraits.summary`)."""
    token_ids: TokenIds | None = field(default=None, compare=False)
    """The ids scored (None before `dynamic` answered)."""
    engine_check: EngineCheck | None = None
    """The pick run in the engine itself (`recommend --verify`); None unless asked."""

    @property
    def picked(self) -> RecommendRow | None:
        """The pick's row (None before the pick)."""
        return next((r for r in self.rows if r.spec == self.pick), None)

    def nearest_deployed(self, engines: tuple[str, ...] = ("llama.cpp", "vLLM")) -> list[tuple[RecommendRow, str]]:
        """For a pick that no engine in `engines` stores byte for byte: per engine, its candidate with the fewest
        bytes per token at or above the pick's (measured or not: `RecommendRow.measured` says), with that engine's
        deploy line; by bytes. Empty when there is no pick, or when an engine in `engines` runs the pick itself.
        `engines`: the deploy lines' prefixes (`kvdemo.cache.deploy`)."""
        pick = self.picked
        if pick is None or any(line.startswith(f"{e}:") for line in pick.deploy for e in engines):
            return []
        found = []
        for engine in engines:
            rows = [
                (row, line)
                for row in self.rows
                if row.bytes_per_token[0] >= pick.bytes_per_token[0] and row.spec != self.rows[0].spec
                for line in row.deploy
                if line.startswith(f"{engine}:")
            ]  # `dynamic` (the first row, the reference) is every engine's default: no setting to name
            if rows:
                found.append(min(rows, key=lambda pair: (pair[0].bytes_per_token[0], pair[0].measured != "full")))
        return sorted(found, key=lambda pair: pair[0].bytes_per_token[0])

    def frontier(self) -> list[RecommendRow]:
        """The rows measured in full that no other full row beats on both bytes (at the context's length) and mean
        KL, by bytes: what the chart draws as a line (a `BOUND` row's true KL is unknown above its bound)."""
        measured = sorted((r for r in self.rows if r.mean_kl is not None), key=lambda r: (r.bytes_per_token[0], r.kl))
        best, found = math.inf, list[RecommendRow]()
        for row in measured:
            if row.kl is not None and row.kl < best:
                best, found = row.kl, [*found, row]
        return found

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["rows"] = [asdict(r) for r in self.rows]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recommendation:
        rows = tuple(
            RecommendRow(**{**r, **{k: tuple(r[k]) for k in ("bytes_per_token", "deploy", "question_kl")}})
            for r in data["rows"]
        )
        fields = {**data, "rows": rows, "questions": tuple(data["questions"]), "lengths": tuple(data["lengths"])}
        if data.get("token_ids") is not None:
            fields["token_ids"] = TokenIds.from_dict(data["token_ids"])
        if data.get("engine_check") is not None:
            fields["engine_check"] = EngineCheck(**data["engine_check"])
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def with_rows(self, rows: list[RecommendRow], **changes: Any) -> Recommendation:
        return replace(self, rows=tuple(rows), **changes)

    def to_frame(self) -> pd.DataFrame:
        """One row per candidate, by bytes: the spec, bytes per token (at the context's length and at `lengths`),
        mean KL (the full figure; a `BOUND` row's lower bound as `>= x`), llama.cpp's report (same top token %, 99.9 %
        KL, RMS Δp), the KL on the held-out text, the perplexity ratio, how it was measured, and the first deploy
        line."""
        frontier = {r.spec for r in self.frontier()}
        rows = sorted(self.rows, key=lambda r: r.bytes_per_token[0])
        return pd.DataFrame(
            [
                {
                    "spec": r.spec + (" ← pick" if r.spec == self.pick else ""),
                    **{
                        f"B/token @{_k(n)}": round(b)
                        for n, b in zip((self.context_tokens, *self.lengths), r.bytes_per_token)
                    },
                    "mean KL": _kl_cell(r),
                    "same top %": _round(r.same_top_p, 1),
                    "99.9% KL": _round(r.p999_kl, 4),
                    "RMS Δp %": _round(r.rms_dp, 2),
                    "held-out KL": _round(r.held_out_kl),
                    "PPL ratio": _round(r.perplexity_ratio, 4),
                    "measured": _how(r) + (" · frontier" if r.spec in frontier else ""),
                    "deploy": r.deploy[0] if r.deploy else "",
                }
                for r in rows
            ]
        )


def _k(tokens: int) -> str:
    return f"{tokens / 1024:g}k" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:,}"


def _round(value: float | None, digits: int = 5) -> float | None:
    return None if value is None else round(value, digits)


def _kl_cell(row: RecommendRow) -> str:
    """The mean KL as the table shows it: the full figure, `>= x` for a bound, empty where not measured."""
    if row.mean_kl is not None:
        return f"{row.mean_kl:.5f}"
    return f">= {row.kl_at_least:.5f}" if row.kl_at_least is not None else ""


def _how(row: RecommendRow) -> str:
    """How a row was measured, in the table's words."""
    if row.measured == BOUND:
        return f"bound ({row.positions} tokens)"
    return row.measured or row.note[:60]


class RecommendationCancelled(Cancelled):
    """The recommendation was stopped; `recommendation` (`partial`) holds the rows measured so far (`finished`
    False, no pick)."""

    def __init__(self, recommendation: Recommendation):
        super().__init__("the recommendation was stopped", recommendation)

    @property
    def recommendation(self) -> Recommendation:
        """The rows measured before the stop."""
        return cast("Recommendation", self.partial)
