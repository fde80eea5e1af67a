"""The decode step over the stored codes against the de-quantize path and `dynamic`, at 2k, 8k and 16k tokens of
context, measured side by side in one process (interleaved rounds) and written to `artifacts/bench/code_attention.json`
with the load average beside the figures.

For each length: a `dynamic` cache and one cache per quantized spec hold the same keys and values (the embedded
model's over the first 2,048 tokens of a text no test prefills, the project's own docs/*.md joined, tiled to the
length, as `benchmarks/decode.py` fills them). Every round times one decode step of `dynamic`, then of each spec on
both paths: `codes` (kvdemo's build: `kvdemo.cache.read.code_attention`) and `dequantize` (the same cache read as
before it, each block de-quantized and read by torch's flash kernel: `blockwise.dequantized_reads`). Printed per
spec and path: the median step, its ratio to `dynamic`'s, its floor (`kvdemo.cache.state.speedlimit.speed_limit`:
weights and KV bytes over the measured copy bandwidth) and the ratio to it; and, from the same cache state, the largest
|logit difference| between the two paths beside the one between torch's own two reads of the de-quantized store
(block by block with the flash kernel, whole with sdpa), with whether the greedy tokens agree.

16,000 tokens is past the embedded model's window (8,192): the step's cost is measured there (RoPE positions beyond
the window compute the same way), not its answers.

    .venv/bin/python benchmarks/code_attention.py                       # about 8 minutes on 2 cores
    .venv/bin/python benchmarks/code_attention.py --lengths 2048 --rounds 3
    .venv/bin/python benchmarks/code_attention.py --model gemma3 --lengths 2048,6000   # where Gemma 3 270M is installed
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from flush import base_kv as flush_base_kv  # noqa: E402  (benchmarks/flush.py's helpers)
from flush import fill, forward, log  # noqa: E402

from kvdemo import CacheSpec, load_model  # noqa: E402
from kvdemo.cache.layers.attention import decode_read, materialized_blocks  # noqa: E402
from kvdemo.cache.layers.blockwise import dequantized_reads  # noqa: E402
from kvdemo.cache.spec import build_cache  # noqa: E402
from kvdemo.cache.state import snapshot  # noqa: E402
from kvdemo.cache.state.speedlimit import probe_bandwidth, speed_limit  # noqa: E402

SPECS = (
    "quanto:4", "hqq:4", "turboquant:4", "turboquant:3", "quanto:2", "hqq:4,flush=append", "ggml:q4_0", "ggml:q8_0",
    "fp8", "fp8,scale=per_token_head", "turboquant:8,nbits_value=4", "int8", "nvfp4", "turboquant:k8v4",
    "turboquant:4bit_nc",
)  # fmt: skip
"""The three 4-bit residual specs, TurboQuant at 3 bits, quanto at 2, hqq's append flush (many blocks), llama.cpp's
q4_0 and q8_0 (every token written as blocks, no residual), fp8 per tensor and per token and head, TurboQuant's
float8 keys, vLLM's int8 and NVFP4 (every token written as codes), and vLLM's TurboQuant presets (its layout: read
whole, every token flushed)."""

GEMMA_SPECS = (
    "turboquant:8,nbits_value=4,sliding=quantize", "turboquant:4,sliding=quantize", "quanto:4,sliding=quantize",
    "fp8", "fp8,sliding=quantize", "int8,sliding=quantize", "nvfp4,sliding=quantize", "ggml:q8_0", "ggml:q4_0",
)  # fmt: skip
"""Gemma 3 270M's (`--model gemma3`): the recommendation's start (`turboquant:8,nbits_value=4,sliding=quantize`), the
residual formats and the formats that write every token, sliding windows quantized (its 15 sliding layers) or kept
(`fp8`: transformers' own full-precision windows)."""

PATHS = {"codes": nullcontext, "dequantize": dequantized_reads}
"""Each quantized spec's two decode paths: kvdemo's build now, and the de-quantize path it replaced."""

FILLER = 13
"""The token fed at every timed step."""


def base_kv(loaded, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The embedded model's keys and values over the first `tokens` tokens of docs/*.md joined, per layer."""
    text = "\n\n".join(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))
    return flush_base_kv(loaded, tokens, loaded.tokenizer(text, add_special_tokens=False)["input_ids"])


def logit_gaps(loaded, cache) -> tuple[float, float, bool]:
    """From the same cache state (restored after each step: `kvdemo.cache.state.snapshot`), one step's logits on the
    codes path, the de-quantize path and torch's sdpa over the whole store de-quantized and joined
    (`attention.materialized_blocks`): max |codes - dequantize|, max |dequantize - whole| (how far torch's own two
    orders of sums part, the scale the first is read against), and whether the three top tokens agree."""
    saved = snapshot.take(cache)
    logits = []
    for reads in (*PATHS.values(), materialized_blocks):
        with reads():
            logits.append(forward(loaded, cache, [FILLER]))
        snapshot.restore(cache, saved)
    codes, dequantize, whole = logits
    same = int(codes.argmax()) == int(dequantize.argmax()) == int(whole.argmax())
    return float((codes - dequantize).abs().max()), float((dequantize - whole).abs().max()), same


def per_length(loaded, kv, length: int, rounds: int, bandwidth: float, specs) -> dict:
    """Median step seconds of `dynamic` and of every spec on both paths at `length` tokens, interleaved in rounds,
    with floors, ratios and each spec's logit gap."""
    caches = {"dynamic": fill(build_cache(CacheSpec("dynamic"), loaded.config), kv, length)}
    for text in specs:
        caches[text] = fill(build_cache(CacheSpec.parse(text), loaded.config), kv, length)
    runs = [("dynamic", "full precision")] + [(text, path) for text in specs for path in PATHS]
    times: dict[tuple[str, str], list[float]] = {run: [] for run in runs}
    for round_index in range(rounds + 1):  # the first round warms every path up and is not timed
        for name, path in runs:
            with PATHS.get(path, nullcontext)():
                start = time.perf_counter()
                forward(loaded, caches[name], [FILLER])
                if round_index:
                    times[(name, path)].append(time.perf_counter() - start)
    dynamic = statistics.median(times[runs[0]])
    out: dict = {"load_average": os.getloadavg()}
    for name, path in runs:
        step = statistics.median(times[(name, path)])
        floor = speed_limit(loaded.model, caches[name], bandwidth).floor_seconds
        row = {"step_seconds": step, "x_dynamic": step / dynamic, "floor_seconds": floor, "x_floor": step / floor}
        if name != "dynamic" and path == "codes":
            row["decode_read"] = decode_read(caches[name], loaded.model)
            row["max_logit_gap"], row["torch_logit_gap"], row["same_top_token"] = logit_gaps(loaded, caches[name])
        out[f"{name} {path}"] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="2048,7800,16000", help="context tokens, comma-separated")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--specs", help="specs separated by ';' (default: SPECS, or GEMMA_SPECS)")
    parser.add_argument("--model", choices=["embedded", "gemma3"], default="embedded")
    args = parser.parse_args()
    specs = args.specs.split(";") if args.specs else list(GEMMA_SPECS if args.model == "gemma3" else SPECS)
    lengths = [int(n) for n in args.lengths.split(",")]
    if args.model == "gemma3":
        from kvdemo.qa.packaged import gemma3_path

        loaded = load_model(gemma3_path())
    else:
        loaded = load_model()
    out: dict = {"load_average_start": os.getloadavg(), "threads": torch.get_num_threads(), "lengths": {}}
    out["bandwidth_bytes_per_second"] = bandwidth = probe_bandwidth()
    kv = base_kv(loaded, 2048)
    for length in lengths:
        log(f"{length:,} tokens")
        rows = out["lengths"][str(length)] = per_length(loaded, kv, length, args.rounds, bandwidth, specs)
        print(f"\n{length:,} tokens (load average {rows['load_average'][0]:.2f}): step, x dynamic, floor, x floor")
        for name, row in rows.items():
            if name == "load_average":
                continue
            gap = "" if "max_logit_gap" not in row else (
                f"  |logit gap| {row['max_logit_gap']:.1e} (torch's two paths: {row['torch_logit_gap']:.1e}),"
                f" same top token: {row['same_top_token']}"
            )  # fmt: skip
            print(
                f"  {name:32} {row['step_seconds'] * 1e3:7.1f} ms  {row['x_dynamic']:.2f}x"
                f"  floor {row['floor_seconds'] * 1e3:5.1f} ms ({row['x_floor']:.1f}x){gap}"
            )
    out["load_average_end"] = os.getloadavg()
    print(
        f"\nbandwidth {bandwidth / 1e9:.1f} GB/s, {out['threads']} threads, "
        f"load average {out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}"
    )
    path = (
        ROOT
        / "artifacts"
        / "bench"
        / ("code_attention.json" if args.model == "embedded" else "code_attention_gemma3.json")
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
