"""TurboQuant against rotated group-wise codes against fp8, at their bytes per token, on the embedded model and text
kvdemo has never seen: the table of docs/turboquant.md, written to `artifacts/bench/turboquant.json` with the load
average beside every figure.

1. Fidelity (`kvdemo.compare.compare`): each spec's bytes per context token, mean KL to `dynamic` over its
   teacher-forced answers, the same top token, and the perplexity of 128 held-out tokens fed one decode step each, on
   CPython's own LICENSE.txt (its history of the software and the PSF license: prose the project uses nowhere else),
   three questions.
2. The needle grid (`kvdemo.needle.grid.needle_grid`): hits at two lengths and three depths per spec.
3. Speed: the decode step of `dynamic`, `turboquant:4`, `turboquant:k8v4`, `quanto:4`, `hqq:4` and `fp8` at 2,048 and
   8,000 tokens (the Normans article's keys and values tiled, as `benchmarks/decode.py` fills them), interleaved in
   rounds, medians, ratios to `dynamic` and each step's floor (`kvdemo.cache.state.speedlimit.speed_limit`).

    .venv/bin/python benchmarks/turboquant.py             # about 25 minutes on 2 idle cores
    .venv/bin/python benchmarks/turboquant.py --speed-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flush import base_kv, fill, forward, log  # noqa: E402  (benchmarks/flush.py's helpers)

from kvdemo import CacheSpec, load_model  # noqa: E402
from kvdemo.cache.spec import build_cache  # noqa: E402
from kvdemo.cache.state.speedlimit import probe_bandwidth, speed_limit  # noqa: E402

SPECS = (
    "turboquant:k8v4",
    "turboquant:4bit_nc",
    "turboquant:k3v4_nc",
    "turboquant:3bit_nc",
    "turboquant:4",
    "turboquant:3",
    "turboquant:2",
    "quanto:4",
    "quanto:4,rotation=hadamard",
    "quanto:2",
    "quanto:2,rotation=hadamard",
    "hqq:4",
    "fp8",
    "fp8,scale=per_token_head",
)
"""The issue's specs (dynamic is always first in a comparison)."""

SPEED_SPECS = ("turboquant:4", "turboquant:k8v4", "quanto:4", "hqq:4", "fp8", "fp8,scale=per_token_head")
QUESTIONS = (
    "Who started the development of Python?",
    "Which organization holds the copyright of Python since version 2.1?",
    "Is Python's license compatible with the GPL?",
)
CONTEXT_TOKENS = 1800
FILLER = 13


def fidelity(loaded) -> dict:
    """Part 1 and 2: the comparison and the needle grid."""
    from kvdemo.compare.run import compare
    from kvdemo.needle.grid import needle_grid

    text = Path(sysconfig.get_paths()["stdlib"], "LICENSE.txt").read_text(encoding="utf-8")
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    context = loaded.tokenizer.decode(ids[:CONTEXT_TOKENS])
    continuation = loaded.tokenizer.decode(ids[CONTEXT_TOKENS : CONTEXT_TOKENS + 400])
    specs = [CacheSpec.parse(text) for text in SPECS]
    started = time.time()
    report = compare(
        loaded, context, QUESTIONS, specs, max_new_tokens=24, perplexity_tokens=128, continuation=continuation
    )
    frame = report.to_frame()
    log(f"comparison: {time.time() - started:.0f} s")
    out: dict = {"comparison": json.loads(frame.to_json(orient="index")), "load_average_comparison": os.getloadavg()}
    started = time.time()
    grid = needle_grid(loaded, ["dynamic", *SPECS], lengths=[1024, 2048], depths=[10, 50, 90])
    log(f"needle grid: {time.time() - started:.0f} s")
    out["needle_hits"] = {spec: hits for spec, hits in _hits(grid).items()}
    out["load_average_needle"] = os.getloadavg()
    print(frame.to_string())
    print({spec: f"{hits[0]}/{hits[1]}" for spec, hits in out["needle_hits"].items()})
    return out


def _hits(grid) -> dict[str, tuple[int, int]]:
    """(hits, cells) per spec of a needle grid."""
    counts: dict[str, list[int]] = {}
    for cell in grid.cells:
        row = counts.setdefault(cell.spec_text, [0, 0])
        row[0] += int(cell.hit)
        row[1] += 1
    return {spec: (row[0], row[1]) for spec, row in counts.items()}


def speed(loaded, rounds: int) -> dict:
    """Part 3: the decode step at 2,048 and 8,000 tokens, side by side."""
    bandwidth = probe_bandwidth()
    kv = base_kv(loaded, 1024)
    out: dict = {"bandwidth_bytes_per_second": bandwidth, "threads": torch.get_num_threads(), "lengths": {}}
    for length in (2048, 8000):
        caches = {
            text: fill(build_cache(CacheSpec.parse(text), loaded.config), kv, length)
            for text in ("dynamic", *SPEED_SPECS)
        }
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(rounds + 1):  # the first round warms every path up and is not timed
            for name, cache in caches.items():
                start = time.perf_counter()
                forward(loaded, cache, [FILLER])
                times[name].append(time.perf_counter() - start)
        dynamic = statistics.median(times["dynamic"][1:])
        rows = out["lengths"][str(length)] = {"load_average": os.getloadavg()}
        print(f"\n{length:,} tokens (load average {rows['load_average'][0]:.2f}): step, x dynamic, x its floor")
        for name, cache in caches.items():
            step = statistics.median(times[name][1:])
            floor = speed_limit(loaded.model, cache, bandwidth).floor_seconds
            rows[name] = {"step_seconds": step, "x_dynamic": step / dynamic, "floor_seconds": floor}
            print(
                f"  {name:28} {step * 1e3:7.1f} ms  {step / dynamic:.2f}x"
                f"  floor {floor * 1e3:5.1f} ms ({step / floor:.1f}x)"
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--speed-only", action="store_true")
    parser.add_argument("--fidelity-only", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(2)
    loaded = load_model()
    path = ROOT / "artifacts" / "bench" / "turboquant.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    out["load_average_start"] = os.getloadavg()
    if not args.speed_only:
        out["fidelity"] = fidelity(loaded)
    if not args.fidelity_only:
        out["speed"] = speed(loaded, args.rounds)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=str))
    log(f"written {path}")


if __name__ == "__main__":
    main()
