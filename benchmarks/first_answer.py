"""The Ask tab's first result, measured side by side in one process: for each candidate start spec and `dynamic`,
on a shipped example's context with its first question at the tab's `max_new_tokens`, the prefill, the time to
the first token and the whole answer (seconds), and each as a ratio to `dynamic`'s. The specs take turns within
a round (interleaved) and the medians over the rounds are compared. Written to
`artifacts/bench/first_answer.json`, with the load average beside the figures.

This is how the Ask tab's `START_SPEC` was chosen (issue 24): the first answer at the start spec should take at
most about 3x `dynamic`'s and still show flushes.

    .venv/bin/python benchmarks/first_answer.py            # 2 rounds, both examples: 5-15 minutes on 2 cores
    .venv/bin/python benchmarks/first_answer.py --quick    # 1 round, the Normans only
    .venv/bin/python benchmarks/first_answer.py --spec hqq:4,residual_length=16   # another candidate
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
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvdemo import CacheSpec, QASession, load_model  # noqa: E402
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS  # noqa: E402
from kvdemo.ui.ask_widgets import START_SPEC  # noqa: E402
from kvdemo.ui.examples import EXAMPLES, example  # noqa: E402

CANDIDATES = (
    START_SPEC.text,
    "hqq:4,residual_length=16",
    "hqq:4,residual_length=16,flush=append",
    "quanto:4,residual_length=16",
    "quanto:4,residual_length=16,flush=append",
)


def first_answer(loaded, spec: CacheSpec, context: str, question: str, max_new_tokens: int) -> dict:
    """One prefill and one answer on a fresh session: seconds of each, the first token's, and the flushes."""
    session = QASession(loaded, spec)
    report = session.prefill(context)
    start, first = time.perf_counter(), None
    for _ in session.stream(question, max_new_tokens):
        if first is None:
            first = time.perf_counter() - start
    answer = session.history[-1]
    return {
        "context_tokens": report.context_tokens,
        "prefill_s": report.seconds,
        "first_token_s": first,
        "answer_s": answer.seconds,
        "tokens": len(answer.token_ids),
        "flushes": answer.flush_count,
        "answer": answer.text,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 round, the Normans only")
    parser.add_argument("--spec", action="append", help="a candidate spec (repeatable); default: CANDIDATES")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model()
    specs = ["dynamic", *dict.fromkeys(args.spec or CANDIDATES)]
    examples = ["Normans"] if args.quick else list(EXAMPLES)
    rounds = 1 if args.quick else args.rounds
    out: dict = {"max_new_tokens": DEFAULT_MAX_NEW_TOKENS, "start_spec": START_SPEC.text, "examples": {}}
    for name in examples:
        context, questions = example(name)
        runs: dict[str, list[dict]] = {s: [] for s in specs}
        for _ in range(rounds):
            for text in specs:  # interleaved: each round runs every spec once
                spec = CacheSpec.parse(text)
                runs[text].append(first_answer(loaded, spec, context, questions[0], DEFAULT_MAX_NEW_TOKENS))
        medians = {
            text: {k: statistics.median(r[k] for r in rs) for k in ("prefill_s", "first_token_s", "answer_s")}
            | {k: rs[0][k] for k in ("context_tokens", "tokens", "flushes", "answer")}
            for text, rs in runs.items()
        }
        base = medians["dynamic"]
        load = os.getloadavg()[0]
        print(f"\n{name}: {base['context_tokens']:,} context tokens, question {questions[0]!r}, load {load:.2f}")
        print(f"{'spec':44} {'prefill s':>9} {'1st tok s':>9} {'answer s':>9} {'x dyn (prefill+answer)':>23} flushes")
        for text, m in medians.items():
            total, base_total = m["prefill_s"] + m["answer_s"], base["prefill_s"] + base["answer_s"]
            m["ratio_to_dynamic"] = total / base_total
            m["first_token_ratio"] = (m["prefill_s"] + m["first_token_s"]) / (base["prefill_s"] + base["first_token_s"])
            print(
                f"{text:44} {m['prefill_s']:9.2f} {m['first_token_s']:9.2f} {m['answer_s']:9.2f} "
                f"{m['ratio_to_dynamic']:23.2f} {m['flushes']:7}"
            )
        out["examples"][name] = {"medians": medians, "load_average": os.getloadavg()}
    path = ROOT / "artifacts" / "bench" / "first_answer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwritten to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
