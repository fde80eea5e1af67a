"""The page's starting spec per model: the recommendation (`kvdemo.compare.recommend`) at the default ceiling,
measured once per model identity on a short built-in text and kept in the kvdemo cache folder
(`recommend/<identity>.json`), so the Ask tab starts each model on a setting that keeps its answers.

The built-in text is the first `BUILT_IN_PARAGRAPHS` paragraphs of the packaged Normans article (SQuAD 2.0) and
its first `BUILT_IN_QUESTIONS` answerable questions; no per-layer plan (the fields of the Ask tab show uniform specs).
`make setup` measures the embedded model's (`python -m kvdemo.serve.recommended`), so the first page shows it at
once; the app measures another model's when it loads it (`App(measure_defaults=True)`, about 1-3 minutes once).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from kvdemo.cache.spec import CacheSpec
from kvdemo.compare.recommend import DEFAULT_MAX_KL, recommend
from kvdemo.compare.recommendation import Recommendation
from kvdemo.evals.cases import example_path, load_case
from kvdemo.paths import cache_dir
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.session_file import model_identity

_log = logging.getLogger(__name__)

BUILT_IN_CASE = "normans"
BUILT_IN_PARAGRAPHS = "0-2"
BUILT_IN_QUESTIONS = 2
FORMAT = 4
"""The stored record's format: a file of another is measured again (3: `ggml`'s prefill attends through its blocks,
as llama.cpp's does, so its rows measured before are stale; the ids scored are kept; 4: NVFP4, the engines' fp8
scales, int8 and mlx are candidates, which a record measured before never weighed)."""

_LOCK = threading.Lock()


PAGE_RESIDUAL_LENGTH = 16
"""The residual the page starts at (tokens): a flush shows within the first answer. The residual is empty after the
prefill (`kvdemo.cache.state.budget.held_bytes_estimate`); a question with the chat template's tokens takes 10-30 tokens
on the shipped models (14 for "Which newspaper defined southern California?" on the embedded model), so the residual
fills within the question's pass or the answer's first tokens, and again every 16 tokens. At the 128 a
recommendation measures, the short answers of a QA text show a straight ramp and no flush."""


def page_start(pick: CacheSpec) -> CacheSpec:
    """The spec the page's fields start at for a recommended `pick`: the pick, with a residual longer than
    `PAGE_RESIDUAL_LENGTH` cut to it (the note under the fields says so: `views.recommended_note`)."""
    if pick.keeps_residual and pick.resolved()["residual_length"] > PAGE_RESIDUAL_LENGTH:
        return pick.replace(residual_length=PAGE_RESIDUAL_LENGTH)
    return pick


def _path(loaded: LoadedModel) -> Path:
    identity = {k: v for k, v in model_identity(loaded).items() if k != "source"}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]
    return cache_dir() / "recommend" / f"{key}.json"


def stored(loaded: LoadedModel) -> Recommendation | None:
    """The recommendation stored for this model's identity, or None (none yet, another format, unreadable)."""
    try:
        data = json.loads(_path(loaded).read_text(encoding="utf-8"))
        if data.pop("format", None) != FORMAT:
            return None
        return Recommendation.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def measure(loaded: LoadedModel, on_progress: Callable[[int, int, str], None] | None = None) -> Recommendation:
    """Measure the page default on the built-in text and store it (atomically). Raises what `recommend` raises."""
    case = load_case(example_path(BUILT_IN_CASE)).select(BUILT_IN_PARAGRAPHS)
    questions = [q.question for q in case.answerable(BUILT_IN_QUESTIONS)]
    found = recommend(loaded, case.context, questions, max_kl=DEFAULT_MAX_KL, plans=False, on_progress=on_progress)
    path = _path(loaded)
    found = Recommendation.from_dict({**found.to_dict(), "source": f"the built-in {case.title} text"})
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps({"format": FORMAT, **found.to_dict()}), encoding="utf-8")
    temporary.replace(path)
    return found


def page_default(
    loaded: LoadedModel, measure_missing: bool, on_progress: Callable[[int, int, str], None] | None = None
) -> Recommendation | None:
    """The stored page default, else (with `measure_missing`) one measured now, once across threads; None where none
    is stored and none is measured, or the measurement failed (logged: the page then starts on its fixed spec)."""
    with _LOCK:
        try:
            found = stored(loaded)
            return found if found is not None or not measure_missing else measure(loaded, on_progress)
        except Exception as error:  # the page works without it: its fixed starting spec, and a note
            _log.warning("no recommended default for %s: %s: %s", loaded.name, type(error).__name__, error)
            return None


if __name__ == "__main__":  # `make setup`: the embedded model's default, measured once
    import time

    from kvdemo.qa.job import seconds_left
    from kvdemo.qa.models import load_model

    model = load_model()
    began = time.perf_counter()

    def _say(done: int, total: int, what: str) -> None:  # a line per step: the install is never silent for long
        elapsed = time.perf_counter() - began
        left = seconds_left(elapsed, done, total)
        pace = "" if left is None else f", at most {left:.0f} s left at this pace"
        print(f"  {elapsed:5.0f} s  step {done}/{total}{pace}: {what}", flush=True)

    result = page_default(model, measure_missing=True, on_progress=_say)  # a failure is logged: the fixed spec then
    print(f"recommended for {model.name}: {result.pick} ({result.why})" if result else "no recommended start stored")
