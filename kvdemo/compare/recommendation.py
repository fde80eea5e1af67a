"""What a recommendation found (`kvdemo.compare.recommend`): every candidate's row, the frontier, the pick with its
deploy lines and one sentence of why. Plain records (numbers and strings, `to_dict`/`from_dict`), so they cross a
process and are drawn from alone."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pandas as pd

PROBE = "probe"
"""A row measured by the probe alone (one question, its first tokens)."""
FULL = "full"
"""A row measured on every question, every answer token, and the held-out tokens' perplexity."""


@dataclass(frozen=True)
class RecommendRow:
    """One candidate.

    Attributes:
        spec: the spec's text (`CacheSpec.short_text`); backend: its backend.
        bytes_per_token: KV bytes per context token at the context's length (the registry's byte formula, every
            token stored: no residual), then at `Recommendation.lengths` (a window's bytes stop growing).
        probe_kl: mean KL(P_dynamic || P_spec) over the probe's positions (nats/token); None before the probe.
        mean_kl, same_top_p, p99_kl: over every position of `dynamic`'s answers, teacher-forced (None unless
            measured in full); same_top_p in percent.
        perplexity_ratio: perplexity of the held-out tokens through this cache over `dynamic`'s (None: not measured).
        measured: `probe`, `full`, or "" (refused by the model: see `note`).
        deploy: the lines of the engines that store it the same way (`kvdemo.cache.deploy`), kvdemo's last.
        note: why it was refused or left after the probe; "" otherwise.
    """

    spec: str
    backend: str
    bytes_per_token: tuple[float, ...]
    probe_kl: float | None = None
    mean_kl: float | None = None
    same_top_p: float | None = None
    p99_kl: float | None = None
    perplexity_ratio: float | None = None
    measured: str = ""
    deploy: tuple[str, ...] = ()
    note: str = ""

    @property
    def kl(self) -> float | None:
        """The best KL figure it has: the full mean, else the probe's."""
        return self.mean_kl if self.mean_kl is not None else self.probe_kl


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

    @property
    def picked(self) -> RecommendRow | None:
        """The pick's row (None before the pick)."""
        return next((r for r in self.rows if r.spec == self.pick), None)

    def frontier(self) -> list[RecommendRow]:
        """The measured rows no other measured row beats on both bytes (at the context's length) and KL, by
        bytes: what the chart draws as a line."""
        measured = sorted((r for r in self.rows if r.kl is not None), key=lambda r: (r.bytes_per_token[0], r.kl))
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
            RecommendRow(**{**r, "bytes_per_token": tuple(r["bytes_per_token"]), "deploy": tuple(r["deploy"])})
            for r in data["rows"]
        )
        fields = {**data, "rows": rows, "questions": tuple(data["questions"]), "lengths": tuple(data["lengths"])}
        return cls(**fields)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def with_rows(self, rows: list[RecommendRow], **changes: Any) -> Recommendation:
        return replace(self, rows=tuple(rows), **changes)

    def to_frame(self) -> pd.DataFrame:
        """One row per candidate measured, by bytes: the spec, bytes per token (at the context's length and at
        `lengths`), mean KL (the full figure, else the probe's: the `measured` column says which), same top token
        %, perplexity ratio, how it was measured, and the first deploy line."""
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
                    "mean KL (full, else probe)": _round(r.kl),
                    "same top %": _round(r.same_top_p, 1),
                    "PPL ratio": _round(r.perplexity_ratio, 4),
                    "measured": r.measured + (" · frontier" if r.spec in frontier else "") or r.note[:60],
                    "deploy": r.deploy[0] if r.deploy else "",
                }
                for r in rows
            ]
        )


def _k(tokens: int) -> str:
    return f"{tokens / 1024:g}k" if tokens >= 1024 and tokens % 1024 == 0 else f"{tokens:,}"


def _round(value: float | None, digits: int = 5) -> float | None:
    return None if value is None else round(value, digits)


class RecommendationCancelled(Exception):
    """The recommendation was stopped; `recommendation` holds the rows measured so far (`finished` False, no pick)."""

    def __init__(self, recommendation: Recommendation):
        super().__init__("the recommendation was stopped")
        self.recommendation = recommendation
