"""What a needle grid returns: one `NeedleCell` per (spec, length, depth), the `NeedleGrid` with its tables
(`to_frame`, `summary_frame`) and files (`to_csv`, `to_json`, `write`), and `NeedleCancelled`. See
`kvdemo.needle.grid` for how they are measured."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import pandas as pd

from kvdemo.qa.records import Cancelled


# ---- the grid --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NeedleCell:
    """One (spec, length, depth) cell: the needle, the answer, the hit and the score, and the seconds.

    Attributes:
        spec: `CacheSpec.label`; spec_text: `CacheSpec.text` (e.g. `hqq:4`).
        length: tokens prefilled (the requested length, exactly).
        depth: the requested depth (%); placed_depth: where the needle landed (% of the haystack before it).
        position: the needle's first token's index in the prefill; needle_tokens: its tokens.
        name, value: the needle's; question, answer: as asked and as answered (greedy).
        hit: the answer holds the value (`hit`).
        score: log P(value | context, question, answer prefix), nats, summed over value_tokens tokens (<= 0).
        finish_reason: the answer's (`eos`, `max_new_tokens`, ...).
        context: the index of the cell's context in the grid's plan (`plan_contexts`): cells of one spec with
            the same index shared one prefill.
        needles_in_context: needles sharing this cell's context (and its prefill).
        prefill_seconds: the wall time of that context's prefill (shared by needles_in_context cells).
        answer_seconds, score_seconds: this needle's answer and teacher-forced scoring (seconds).
        cache_length_after: the cache's length after the restore (equals length).
        kv_bytes: the cache's bytes after the prefill.
    """

    spec: str
    spec_text: str
    length: int
    depth: float
    placed_depth: float
    position: int
    needle_tokens: int
    name: str
    value: str
    question: str
    answer: str
    hit: bool
    score: float
    value_tokens: int
    finish_reason: str
    context: int
    needles_in_context: int
    prefill_seconds: float
    answer_seconds: float
    score_seconds: float
    cache_length_after: int
    kv_bytes: int

    @property
    def cut(self) -> bool:
        """A miss that `max_new_tokens` ended: the answer may have been cut before the number could appear (the
        score still says whether the model knew it)."""
        return not self.hit and self.finish_reason == "max_new_tokens"

    @property
    def seconds(self) -> float:
        """This cell's share of the work: prefill_seconds / needles_in_context + answer + scoring seconds."""
        return self.prefill_seconds / self.needles_in_context + self.answer_seconds + self.score_seconds


@dataclass(frozen=True)
class NeedleGrid:
    """A needle grid's cells (spec by spec, then by length and depth) and how it was made.

    Attributes:
        model: the model's name; device: where it ran.
        specs: the specs run, as `CacheSpec.text`, in order; lengths (tokens) and depths (%), sorted.
        needles_per_context: needles per prefill (None: every depth of a length in one context).
        seed, max_new_tokens: as given.
        cells: one `NeedleCell` per finished cell.
        seconds: the grid's wall time (seconds).
        complete: False when it was cancelled (then `cells` holds the cells finished before).
    """

    model: str
    device: str
    specs: tuple[str, ...]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    needles_per_context: int | None
    seed: int | str
    max_new_tokens: int
    cells: tuple[NeedleCell, ...]
    seconds: float
    complete: bool = True

    COLUMNS = (
        "spec text",
        "length",
        "depth",
        "placed depth",
        "hit",
        "cut",
        "score",
        "value",
        "answer",
        "needles in context",
        "prefill s",
        "answer s",
        "score s",
        "cell s",
        "name",
        "position",
        "spec",
    )

    def to_frame(self) -> pd.DataFrame:
        """One row per cell (`COLUMNS`, also when there is none): spec text, length (tokens), depth (%),
        placed depth (%), hit (bool), cut (bool, `NeedleCell.cut`), score (nats), value, answer, needles in
        context, prefill s (the shared prefill's), answer s, score s, cell s (`NeedleCell.seconds`), name,
        position (token), spec (label)."""
        rows = [
            {
                "spec text": c.spec_text,
                "length": c.length,
                "depth": c.depth,
                "placed depth": c.placed_depth,
                "hit": c.hit,
                "cut": c.cut,
                "score": round(c.score, 4),
                "value": c.value,
                "answer": c.answer,
                "needles in context": c.needles_in_context,
                "prefill s": round(c.prefill_seconds, 3),
                "answer s": round(c.answer_seconds, 3),
                "score s": round(c.score_seconds, 3),
                "cell s": round(c.seconds, 3),
                "name": c.name,
                "position": c.position,
                "spec": c.spec,
            }
            for c in self.cells
        ]
        return pd.DataFrame(rows, columns=list(self.COLUMNS)).astype(
            {
                "length": "int64",
                "depth": "float64",
                "placed depth": "float64",
                "hit": "bool",
                "cut": "bool",
                "score": "float64",
            }
        )

    def summary_frame(self) -> pd.DataFrame:
        """One row per spec: `spec text`, `cells`, `hits`, `cut` (misses ended by max_new_tokens, `NeedleCell.cut`),
        `hit rate` and `mean score` (nats; both to 3 decimals, for reading), `prefill s` (summed
        over its prefills), `decode s` (answers and scorings summed), `seconds` (the two together)."""
        rows = []
        for spec in self.specs:
            cells = [c for c in self.cells if c.spec_text == spec]
            if not cells:
                continue
            prefill = sum({c.context: c.prefill_seconds for c in cells}.values())
            decode = sum(c.answer_seconds + c.score_seconds for c in cells)
            rows.append(
                {
                    "spec text": spec,
                    "cells": len(cells),
                    "hits": sum(c.hit for c in cells),
                    "cut": sum(c.cut for c in cells),
                    "hit rate": round(sum(c.hit for c in cells) / len(cells), 3),
                    "mean score": round(sum(c.score for c in cells) / len(cells), 3),
                    "prefill s": round(prefill, 2),
                    "decode s": round(decode, 2),
                    "seconds": round(prefill + decode, 2),
                }
            )
        columns = ["spec text", "cells", "hits", "cut", "hit rate", "mean score", "prefill s", "decode s", "seconds"]
        return pd.DataFrame(rows, columns=columns)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: every field and every cell (`asdict`, with its `seconds` and `cut`)."""
        out = asdict(self)
        out["cells"] = [asdict(c) | {"seconds": c.seconds, "cut": c.cut} for c in self.cells]
        return out

    def to_json(self) -> str:
        """`to_dict()` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2, ensure_ascii=False)

    def to_csv(self) -> str:
        """`to_frame()` as CSV text (a header line, one line per cell)."""
        return self.to_frame().to_csv(index=False)

    def write(self, folder: str | Path, stem: str = "needle_grid") -> tuple[Path, Path]:
        """Write `<stem>.csv` and `<stem>.json` into `folder` (created if missing); returns their paths."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        csv_path, json_path = folder / f"{stem}.csv", folder / f"{stem}.json"
        csv_path.write_text(self.to_csv(), encoding="utf-8")
        json_path.write_text(self.to_json(), encoding="utf-8")
        return csv_path, json_path


class NeedleCancelled(Cancelled):
    """Raised by `needle_grid` when its `cancel` event is set; `grid` (`partial`) holds the cells finished before
    (`complete=False`)."""

    def __init__(self, grid: NeedleGrid):
        super().__init__(f"needle grid cancelled after {len(grid.cells)} cell(s)", grid)

    @property
    def grid(self) -> NeedleGrid:
        """The cells finished before the cancel."""
        return cast("NeedleGrid", self.partial)
