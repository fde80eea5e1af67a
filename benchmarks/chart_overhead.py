"""The live charts' cost: tokens/s of `QASession.stream` bare, against the same stream with the chart
frames the app builds at every decode step (`kvdemo.charts`), interleaved in one run so that both see the
same machine load; and the time from Ask to the first token. Prints the ratio.

    .venv/bin/python benchmarks/chart_overhead.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvdemo import CacheSpec, QASession, load_model
from kvdemo.charts import answers_frame, flush_frame, memory_frame, residual_frame
from kvdemo.cases import example_path, load_case


def run(session: QASession, question: str, max_new_tokens: int, charts: bool) -> tuple[float, float]:
    """(tokens per second, seconds from the call to the first token) of one answer."""
    start = time.perf_counter()
    events, first = [], None
    for event in session.stream(question, max_new_tokens):
        if first is None:
            first = time.perf_counter() - start
        events.append(event)
        if charts:  # what the app's ask handler builds at every step
            memory_frame(events), residual_frame(events), flush_frame(events)
    if charts:
        answers_frame(a.to_dict() for a in session.history)
    return len(events) / (time.perf_counter() - start), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--residual-length", type=int, default=16)
    args = parser.parse_args()
    context = load_case(example_path("normans")).select("0-7").context  # the app's Normans example
    question = "Tell me everything about the Normans."  # runs to max_new_tokens on this model
    session = QASession(load_model(), CacheSpec("hqq", nbits=4, residual_length=args.residual_length))
    tokens = session.prefill(context).context_tokens
    results = {False: [], True: []}
    firsts = []
    for _ in range(args.rounds):
        for charts in (False, True):
            tps, first = run(session, question, args.max_new_tokens, charts)
            results[charts].append(tps)
            firsts.append(first)
    bare, with_charts = statistics.median(results[False]), statistics.median(results[True])
    print(f"Normans example ({tokens} context tokens), {session.spec.label}, {args.max_new_tokens} tokens, "
          f"{args.rounds} rounds interleaved")
    print(f"time from Ask to the first token: median {statistics.median(firsts):.3f} s")
    print(f"tokens/s bare stream:        {bare:.2f}")
    print(f"tokens/s with chart frames:  {with_charts:.2f}")
    print(f"chart overhead ratio (bare / with charts): {bare / with_charts:.3f}")


if __name__ == "__main__":
    main()
