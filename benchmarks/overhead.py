"""The app's cost per decode step, measured side by side in one process and written to
`artifacts/bench/overhead.json` with the load average beside the figures.

On the Ask tab's Normans example prefilled once per spec (`dynamic`, and the page's start spec, whose flushes
every 16 steps force redraws), interleaved in rounds on the same cache (restored after each answer), each answer
`TOKENS` tokens (the question runs to the limit on this model):

- bare: forward + argmax, no telemetry (`benchmarks/restore_mechanisms.bare_decode`);
- stream: `QASession.stream` (the memory report and the flush check at every step, the restore at the end);
- app, every step: the stream and what the Ask tab's handler built at every step before (the step line, the
  memory and residual charts' updates, `kvdemo.ui.views`);
- app, as now: the same with the charts redrawn when `kvdemo.ui.views.charts_due` says (4 a second, every flush).

Printed per spec: tokens/s of each (medians of the rounds) and each one's overhead against bare, which on a shared
2-core machine swings by several per cent from round to round; so the app's view work is also timed around its
calls alone (ms per step, and its share of a bare step): the figure the 5 % target is checked on. Not measured:
Gradio's serialising of each update and the browser's drawing, which run in other threads and processes.

    .venv/bin/python benchmarks/overhead.py          # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/overhead.py --quick  # 16 tokens, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from restore_mechanisms import bare_decode  # noqa: E402

from kvdemo import CacheSpec, QASession, load_model  # noqa: E402
from kvdemo.cache.state import snapshot  # noqa: E402
from kvdemo.ui import views  # noqa: E402
from kvdemo.ui.ask_widgets import START_SPEC  # noqa: E402
from kvdemo.ui.examples import example  # noqa: E402

QUESTION = "Tell me everything about the Normans."
TOKENS = 48


def app_answer(session: QASession, tokens: int, throttled: bool) -> tuple[int, float]:
    """One answer as the Ask tab's handler streams it (its per-step view work, without Gradio): the steps made and
    the seconds spent in the view work alone."""
    events: list = []
    drawn_at, view_seconds = None, 0.0
    for event in session.stream(QUESTION, tokens):
        start = time.perf_counter()
        events.append(event)
        views.step_line(event, session.spec)
        due = views.charts_due(event, drawn_at) if throttled else True
        if due:
            drawn_at = event.elapsed
            views.memory_chart(events, session.spec), views.residual_chart(events, session.spec)
        view_seconds += time.perf_counter() - start
    return len(events), view_seconds


def rounds_of(session: QASession, rounds: int, tokens: int) -> dict[str, dict[str, float]]:
    """Median tokens/s of the four ways, interleaved `rounds` times, and the median view work per step (ms) of the
    two app ways (timed around the view calls alone: what the app adds to each step, free of the rounds' noise)."""
    ids = session.question_ids(QUESTION)
    results: dict[str, list[float]] = {"bare": [], "stream": [], "app, every step": [], "app, as now": []}
    view_ms: dict[str, list[float]] = {"app, every step": [], "app, as now": []}
    for _ in range(rounds):
        saved = snapshot.take(session.cache)
        start = time.perf_counter()
        made = len(bare_decode(session.loaded, session.cache, ids, tokens))
        results["bare"].append(made / (time.perf_counter() - start))
        snapshot.restore(session.cache, saved)
        start = time.perf_counter()
        made = sum(1 for _ in session.stream(QUESTION, tokens))
        results["stream"].append(made / (time.perf_counter() - start))
        for name, throttled in (("app, every step", False), ("app, as now", True)):
            start = time.perf_counter()
            made, seconds = app_answer(session, tokens, throttled)
            results[name].append(made / (time.perf_counter() - start))
            view_ms[name].append(seconds / made * 1000)
    return {
        "tokens_per_second": {name: statistics.median(values) for name, values in results.items()},
        "view_ms_per_step": {name: statistics.median(values) for name, values in view_ms.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    tokens, rounds = (16, 3) if args.quick else (TOKENS, 7)
    loaded = load_model()
    context, _ = example("Normans")
    out: dict = {"load_average_start": os.getloadavg(), "tokens": tokens, "rounds": rounds, "specs": {}}
    for spec in (CacheSpec("dynamic"), START_SPEC):
        session = QASession(loaded, spec)
        report = session.prefill(context)
        measured = rounds_of(session, rounds, tokens)
        out["specs"][spec.short_text] = {"context_tokens": report.context_tokens, **measured}
        speeds, view_ms = measured["tokens_per_second"], measured["view_ms_per_step"]
        print(f"\n{spec.short_text}, {report.context_tokens:,} context tokens, {tokens} new tokens, {rounds} rounds:")
        for name, speed in speeds.items():
            overhead = speeds["bare"] / speed - 1
            line = f"  {name:16} {speed:6.2f} tokens/s  {1000 / speed:6.1f} ms/token  overhead {overhead:+.1%}"
            if name in view_ms:  # the view work alone, against the bare step
                line += f"  (view work {view_ms[name]:.2f} ms/step, {view_ms[name] * speeds['bare'] / 1000:.1%})"
            print(line)
    out["load_average_end"] = os.getloadavg()
    print(f"\nload average {out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}")
    path = ROOT / "artifacts" / "bench" / "overhead.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
