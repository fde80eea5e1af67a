"""How long the page leaves a user waiting in silence, measured through the page's own handlers (`build_demo(app)`'s
`prefill`, `ask` and `stop`, as `tests/test_ui.py` calls them; no browser), on the embedded model.

The long-context run of the page's state issue: the Normans article's first 24 paragraphs twice (about 7,700
tokens with the chat template, the size of the issue's "whole article twice", 7,608 tokens; the whole article
twice, 11,264 tokens, does not fit the 8,192-token window), hqq nbits 4, residual_length 16. `--once` prefills the
whole article once instead (5,655 tokens), a shorter run. Figures:

1. prefill progress: the updates the handler gives `gr.Progress` (one per 256-token chunk), per second of the
   prefill, the wait until the first and the longest wait between two;
2. first visible feedback after Ask: the time from calling the `ask` handler to its first update (the question
   in the chat with "reading the question"), and to the first update with an answer token;
3. Stop latency: the time from the `stop` handler (it calls `QASession.request_stop()`) to what the page shows
   next: the `prefill` handler's return ("Stopped") for a Stop during a prefill; the `ask` handler's last update
   ("stopped", the cache restored) for a Stop during the question's pass and during decoding. Each Stop is sent
   by a timer thread at a random moment inside a chunk or step, as a click would.

    .venv/bin/python benchmarks/page_latency.py              # about 4-6 minutes on 2 busy CPU cores
    .venv/bin/python benchmarks/page_latency.py --once       # the whole article once
    .venv/bin/python benchmarks/page_latency.py --quick      # a smoke run on 1,341 tokens
    .venv/bin/python benchmarks/page_latency.py --json artifacts/bench/page_latency.json

Speed figures only: nothing here is asserted (the browser test `tests/e2e/test_page_state.py` checks the states).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gradio as gr  # noqa: E402
import torch  # noqa: E402

from kvdemo.evals.cases import example_path, load_case  # noqa: E402
from kvdemo.serve.server import App  # noqa: E402
from kvdemo.ui import build_demo  # noqa: E402

HQQ_OPTIONS = ("hqq", 4, 64, 16, 0, 0)
"""The Ask tab's option fields: backend, nbits, q_group_size, residual_length, axis_key, axis_value."""
PARAGRAPHS_TWICE = 24
"""The Normans paragraphs that, written twice, make about the issue's 7,608 tokens."""
QUESTION = "What is the original meaning of the word Norman?"
LONG_QUESTION = "Tell me everything about the Normans."  # runs to max_new_tokens on this model
BEFORE = {  # the page's state issue, measured on the page before the change (same context size, hqq:4, residual 16)
    "prefill": "55 s, no real progress (Gradio's guessed 2.2/3.6 s)",
    "feedback": "15-16 s (the question shown with the first token)",
    "stop_question": "~5 s",
}


def _request(name: str) -> gr.Request:
    return gr.Request(session_hash=name)


class ProgressLog:
    """A `gr.Progress` stand-in for the handler: the time (perf_counter seconds) and (done, total) of each update."""

    def __init__(self, on_update=None):
        self.updates: list[tuple[float, Any]] = []
        self.on_update = on_update

    def __call__(self, value, desc=None, unit=None, **_):
        self.updates.append((time.perf_counter(), value))
        if self.on_update is not None:
            self.on_update(len(self.updates))


def measure_prefill(fns, context: str, request: gr.Request) -> dict[str, Any]:
    """One whole prefill through the handler: its progress updates and their timing."""
    log = ProgressLog()
    start = time.perf_counter()
    view = fns["prefill"](context, *HQQ_OPTIONS, request, progress=log)
    seconds = time.perf_counter() - start
    if not str(view.prefill_info).startswith("Prefilled"):
        raise SystemExit(f"the prefill was refused: {view.notice or view.prefill_info}")
    times = [start] + [t for t, _ in log.updates]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {
        "summary": view.prefill_info,
        "tokens": log.updates[-1][1][1],
        "seconds": seconds,
        "updates": len(log.updates),
        "updates_per_second": len(log.updates) / seconds,
        "first_update_s": gaps[0],
        "longest_wait_s": max(gaps),
        "median_chunk_s": statistics.median(gaps),
    }


def measure_stop_during_prefill(
    fns, context: str, request: gr.Request, after_updates: int, chunk_s: float, rng: random.Random
) -> dict[str, Any]:
    """A prefill stopped by the `stop` handler at a random moment inside the chunk after `after_updates` updates;
    the latency runs from the stop call to the handler's return."""
    sent: dict[str, float] = {}

    def stop_later():
        sent["delay"] = rng.uniform(0, chunk_s)
        time.sleep(sent["delay"])
        sent["at"] = time.perf_counter()
        fns["stop"](request)

    log = ProgressLog(lambda n: threading.Thread(target=stop_later).start() if n == after_updates else None)
    view = fns["prefill"](context, *HQQ_OPTIONS, request, progress=log)
    returned = time.perf_counter()
    if "Stopped" not in str(view.prefill_info):
        raise SystemExit(f"the prefill was not stopped: {view.prefill_info}")
    last = max([t for t, _ in log.updates if t <= sent["at"]])
    # the chunk the Stop landed in: from the update before the Stop to the handler's return
    return {
        "latency_ms": (returned - sent["at"]) * 1000,
        "chunk_ms": (returned - last) * 1000,
        "line": view.prefill_info,
    }


def measure_ask(
    fns, context: str, request: gr.Request, question: str, max_new_tokens: int, stop_at=None
) -> dict[str, Any]:
    """One answer through the `ask` handler: the time to each update. `stop_at(updates, times)` returns the seconds
    after which a timer thread calls the `stop` handler (None: not now); it is asked after every update."""
    times: list[float] = []
    sent: dict[str, float] = {}
    updates = []

    def stop_later(delay: float):
        time.sleep(delay)
        sent["at"] = time.perf_counter()
        fns["stop"](request)

    start = time.perf_counter()
    for update in fns["ask"](question, max_new_tokens, request, context):
        times.append(time.perf_counter())
        updates.append(update)
        if stop_at is not None and "at" not in sent and "scheduled" not in sent:
            delay = stop_at(len(updates), times)
            if delay is not None:
                sent["scheduled"] = delay
                threading.Thread(target=stop_later, args=(delay,)).start()
    end = time.perf_counter()
    stats = str(updates[-1].stats)
    if stats.startswith("⚠"):
        raise SystemExit(f"the question was refused: {stats}")
    result = {
        "first_update_ms": (times[0] - start) * 1000,
        "first_update": str(updates[0].stats),
        "first_token_ms": (times[1] - start) * 1000 if len(times) > 2 else None,
        "updates": len(updates),
        "stats": stats,
        "step_s": [(b - a) for a, b in zip(times[1:-1], times[2:-1])],
    }
    if "at" in sent:
        result["stop_latency_ms"] = (end - sent["at"]) * 1000
        # the step (or the question's pass) the Stop landed in: from the update before the Stop to the last one
        result["landed_in_ms"] = (end - max(t for t in times if t <= sent["at"])) * 1000
    return result


def print_table(results: dict) -> None:
    """The figures of `main`'s run side by side with the issue's (`BEFORE`), one row per measurement."""
    what, prefill, answer = results["context"], results["prefill"], results["answer"]
    question_pass_s, stops, landed = (
        results["question_pass_s"],
        results["stop_latency_ms"],
        results["stop_landed_in_ms"],
    )
    decode_steps = answer["step_s"]
    ms = lambda values: ", ".join(f"{v:,.0f}" for v in values)
    rows = [
        ("prefill", f"{prefill['tokens']:,} tokens in {prefill['seconds']:.1f} s", BEFORE["prefill"]),
        ("  progress updates", f"{prefill['updates']} ({prefill['updates_per_second']:.2f} per second)", "none real"),
        (
            "  first update / longest wait",
            f"{prefill['first_update_s']:.2f} s / {prefill['longest_wait_s']:.2f} s "
            f"(median chunk {prefill['median_chunk_s']:.2f} s)",
            "55 s",
        ),
        (
            "first feedback after Ask",
            f"{answer['first_update_ms']:,.0f} ms ('{answer['first_update'][:32]}…')",
            BEFORE["feedback"],
        ),
        (
            "  first answer token",
            f"{answer['first_token_ms']:,.0f} ms (the question's pass: {question_pass_s:.2f} s)",
            "15-16 s",
        ),
        (
            "Stop during the prefill",
            f"{ms(stops['prefill'])} ms (in chunks of {ms(landed['prefill'])} ms)",
            "not possible",
        ),
        (
            "Stop during the question's pass",
            f"{ms(stops['question'])} ms (in passes of {ms(landed['question'])} ms)",
            BEFORE["stop_question"],
        ),
        ("Stop during decoding", f"{ms(stops['decoding'])} ms (in steps of {ms(landed['decoding'])} ms)", "-"),
        (
            "  decode steps (8-token answer)",
            f"median {statistics.median(decode_steps) * 1000:,.0f} ms, longest {max(decode_steps) * 1000:,.0f} ms"
            if decode_steps
            else "-",
            "-",
        ),
    ]
    loads = " → ".join(f"{load[0]:.1f}" for load in results["load_average"])
    print(
        f"\n{what}, hqq nbits=4 residual_length=16, {results['model']}, {torch.get_num_threads()} torch threads, "
        f"{os.cpu_count()} CPUs, load average {loads}\n"
    )
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}}  {'now':60}  before (the issue)")
    for name, now, before in rows:
        print(f"{name:{width}}  {now:60}  {before}")


def _context(args: argparse.Namespace) -> tuple[str, str]:
    """The context measured and its description, from --quick (which also sets one Stop of each kind) or --once."""
    case = load_case(example_path("normans"))
    if args.quick:
        context, what, args.repeats = case.select("0-7").context, "Normans paragraphs 0-7 once (--quick)", 1
    elif args.once:
        context, what = case.context, "the whole Normans article once"
    else:
        part = case.select(f"0-{PARAGRAPHS_TWICE - 1}").context
        context, what = f"{part}\n\n{part}", f"Normans paragraphs 0-{PARAGRAPHS_TWICE - 1} twice"
    return context, what


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--once", action="store_true", help="the whole article once (5,655 tokens) instead")
    parser.add_argument("--quick", action="store_true", help="a smoke run: paragraphs 0-7 once, one Stop of each kind")
    parser.add_argument("--repeats", type=int, default=3, help="Stops of each kind (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures there")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    context, what = _context(args)

    def note(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    load_before = os.getloadavg()
    app = App()
    app.start_loading()
    loaded = app.wait_for_model()
    fns = {f.api_name: f.fn for f in build_demo(app).fns.values() if f.api_name}
    main_tab = _request("bench-main")
    note(f"{loaded.name}, {torch.get_num_threads()} torch threads; prefilling {what}")

    prefill = measure_prefill(fns, context, main_tab)
    note(f"prefilled {prefill['tokens']:,} tokens in {prefill['seconds']:.1f} s")
    answer = measure_ask(fns, context, main_tab, QUESTION, 8)
    note(f"answered: first update {answer['first_update_ms']:.0f} ms, first token {answer['first_token_ms']:.0f} ms")
    question_pass_s = answer["first_token_ms"] / 1000 - answer["first_update_ms"] / 1000

    stops: dict[str, list[float]] = {"prefill": [], "question": [], "decoding": []}
    landed: dict[str, list[float]] = {"prefill": [], "question": [], "decoding": []}
    for n in range(args.repeats):
        # a Stop inside the question's own forward pass: at a random moment of the pass measured above
        stopped = measure_ask(
            fns,
            context,
            main_tab,
            LONG_QUESTION,
            64,
            stop_at=lambda count, t: rng.uniform(0.1, 0.9) * question_pass_s if count == 1 else None,
        )
        stops["question"].append(stopped["stop_latency_ms"])
        landed["question"].append(stopped["landed_in_ms"])
        # a Stop during decoding: at a random moment inside the step after the third token
        stopped = measure_ask(
            fns,
            context,
            main_tab,
            LONG_QUESTION,
            64,
            stop_at=lambda count, t: rng.uniform(0, 1) * (t[-1] - t[-2]) if count == 4 else None,
        )
        stops["decoding"].append(stopped["stop_latency_ms"])
        landed["decoding"].append(stopped["landed_in_ms"])
        # a Stop during a prefill (another tab, so the main cache stays): inside the chunk after the second update
        stopped = measure_stop_during_prefill(fns, context, _request("bench-stop"), 2, prefill["median_chunk_s"], rng)
        stops["prefill"].append(stopped["latency_ms"])
        landed["prefill"].append(stopped["chunk_ms"])
        note(f"stops, round {n + 1}: " + ", ".join(f"{k} {v[-1]:.0f} ms" for k, v in stops.items()))

    results = {
        "context": what,
        "model": loaded.name,
        "torch_threads": torch.get_num_threads(),
        "prefill": prefill,
        "answer": answer,
        "question_pass_s": question_pass_s,
        "stop_latency_ms": stops,
        "stop_landed_in_ms": landed,
        "load_average": (load_before, os.getloadavg()),
    }
    print_table(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
