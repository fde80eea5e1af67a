"""The decode step on the real path beside the one `benchmarks/code_attention.py` times, side by side in one process
(interleaved rounds), written to `artifacts/bench/stream_steps.json` with the load average beside the figures.

For each spec and `dynamic`, at one context length:

- **filled**: `code_attention.py`'s step: one forward pass of one token over a cache given the keys and values in one
  update (`benchmarks/flush.py`'s `fill`: the project's docs tiled), the cache growing by a token a round;
- **stream**: a `QASession` prefilled with the same length of real text (the project's own docs/*.md, which no test
  prefills) and answering one question with `QASession.stream`: each decode step's own time (`StepEvent.seconds`: the
  forward pass and the argmax) and its wall time (from one step's end to the next's: the step's forward pass plus
  what the loop does around it, the memory report `kv_memory`, the flush check, the text decoded), the question's
  pass left out; the answer restores the cache, so every round starts from the same prefill.

Printed per spec: the medians, each ÷ `dynamic`'s of the same kind, so a ratio that differs between the two paths
shows where the real path spends what the filled cache does not.

    .venv/bin/python benchmarks/stream_steps.py                     # 2,048 tokens, 3 rounds: about 3 minutes
    .venv/bin/python benchmarks/stream_steps.py --length 7800 --specs "quanto:4;fp8"
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flush import base_kv as flush_base_kv  # noqa: E402
from flush import fill, forward, log  # noqa: E402  (benchmarks/flush.py's helpers)

from kvdemo import CacheSpec, QASession, load_model  # noqa: E402
from kvdemo.cache.spec import build_cache  # noqa: E402

SPECS = ("quanto:4", "hqq:4", "turboquant:4", "fp8", "int8", "nvfp4", "ggml:q4_0", "turboquant:4bit_nc")
"""The specs measured by default: the 4-bit residual formats, the formats that code every token, vLLM's layout."""

QUESTION = "What does the text say about the KV cache?"
FILLER = 13
"""The token fed at every filled step (`code_attention.py`'s)."""


def docs_ids(loaded, tokens: int) -> list[int]:
    """The first `tokens` token ids of the project's docs/*.md joined (text no test prefills)."""
    text = "\n\n".join(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))
    return loaded.tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]


def streamed(session: QASession, tokens: int) -> tuple[list[float], list[float]]:
    """One answer of `tokens` steps at most: each decode step's own seconds and its wall seconds (the question's pass
    left out)."""
    events = list(session.stream(QUESTION, max_new_tokens=tokens))
    own = [e.seconds for e in events[2:]]
    wall = [b.elapsed - a.elapsed for a, b in zip(events[1:], events[2:])]
    return own, wall


def measure(loaded, length: int, rounds: int, tokens: int, specs: list[str]) -> dict:
    """Median seconds of each kind of step per spec (`dynamic` first), interleaved in rounds (the first untimed)."""
    ids = docs_ids(loaded, length)
    context = loaded.tokenizer.decode(ids)
    kv = flush_base_kv(loaded, 2048, ids)
    names = ["dynamic", *specs]
    sessions, caches = {}, {}
    for name in names:
        spec = CacheSpec.parse(name)
        sessions[name] = QASession(loaded, spec)
        report = sessions[name].prefill(context)
        caches[name] = fill(build_cache(spec, loaded.config), kv, report.context_tokens)
    times: dict[str, dict[str, list[float]]] = {n: {"filled": [], "stream": [], "stream wall": []} for n in names}
    for round_index in range(rounds + 1):
        log(f"round {round_index} of {rounds}")
        for name in names:
            start = time.perf_counter()
            forward(loaded, caches[name], [FILLER])
            filled_seconds = time.perf_counter() - start
            own, wall = streamed(sessions[name], tokens)
            if round_index:
                times[name]["filled"].append(filled_seconds)
                times[name]["stream"] += own
                times[name]["stream wall"] += wall
    medians = {n: {kind: statistics.median(v) for kind, v in kinds.items()} for n, kinds in times.items()}
    return {
        "context_tokens": sessions["dynamic"].prefill_report.context_tokens,  # type: ignore[union-attr]
        "load_average": os.getloadavg(),
        "medians_seconds": medians,
        "x_dynamic": {n: {k: v / medians["dynamic"][k] for k, v in kinds.items()} for n, kinds in medians.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=2048, help="context tokens")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=16, help="answer tokens a round")
    parser.add_argument("--specs", help="specs separated by ';' (default: SPECS)")
    args = parser.parse_args()
    specs = args.specs.split(";") if args.specs else list(SPECS)
    loaded = load_model()
    out = {"load_average_start": os.getloadavg(), "threads": torch.get_num_threads()}
    out.update(measure(loaded, args.length, args.rounds, args.tokens, specs))
    out["load_average_end"] = os.getloadavg()
    print(f"\n{out['context_tokens']:,} tokens, {out['threads']} threads, load average "
          f"{out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}: ms (x dynamic's)")  # fmt: skip
    print(f"  {'spec':28} {'filled':>16} {'stream':>16} {'stream wall':>16}")
    for name, kinds in out["medians_seconds"].items():
        cells = [f"{s * 1e3:7.1f} ({out['x_dynamic'][name][k]:.2f})" for k, s in kinds.items()]
        print(f"  {name:28} " + " ".join(f"{c:>16}" for c in cells))
    path = ROOT / "artifacts" / "bench" / "stream_steps.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
