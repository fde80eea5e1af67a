"""The `fp8` backend's de-quantization by table (`kvdemo/cache/fp8.py`) against transformers' own
`Fp8QuantizedLayer`, measured side by side in one process and written to `artifacts/bench/fp8.json` with the load
average beside the figures.

1. Per tensor: one layer's key store ([1, 3, tokens, 64] float8_e4m3 codes) de-quantized by the library's
   `(q.float() * scale).to(dtype)` and by the table, medians of interleaved repeats, `torch.equal` checked.
2. Per decode step on the embedded model, at 2,048 and 8,000 tokens (the Normans article's keys and values tiled):
   `dynamic`, `fp8` with transformers' layer, `fp8` by table, interleaved in rounds; the medians, their ratios and
   each step's floor (`kvdemo.cache.speedlimit.speed_limit`: the bytes a step must read over the measured
   bandwidth). Before timing, one step on each fp8 cache must give the same logits bit for bit.

    .venv/bin/python benchmarks/fp8.py            # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/fp8.py --quick    # 1,024 tokens, 3 rounds
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

from flush import base_kv, fill, forward, log  # noqa: E402  (benchmarks/flush.py's helpers)
from transformers import QuantizedCache  # noqa: E402

from kvdemo import CacheSpec, load_model  # noqa: E402
from kvdemo.cache.spec import build_cache  # noqa: E402
from kvdemo.cache.speedlimit import probe_bandwidth, speed_limit  # noqa: E402

FILLER = 13
"""The token fed at every timed step."""


def caches(loaded, kv, length: int) -> dict:
    """The three caches compared, each holding `length` tokens."""
    return {
        "dynamic": fill(build_cache(CacheSpec("dynamic"), loaded.config), kv, length),
        "fp8 transformers": fill(QuantizedCache("fp8", loaded.config), kv, length),
        "fp8 table": fill(build_cache(CacheSpec("fp8"), loaded.config), kv, length),
    }


def per_tensor(compared: dict, repeats: int) -> dict:
    """Seconds to de-quantize layer 0's key store, the library's way and by table (medians, interleaved)."""
    library, table = compared["fp8 transformers"].layers[0], compared["fp8 table"].layers[0]
    store = library._quantized_keys
    assert torch.equal(library._dequantize(store), table._dequantize(table._quantized_keys))
    times: dict[str, list[float]] = {"transformers": [], "table": []}
    for _ in range(repeats):
        for name, layer in (("transformers", library), ("table", table)):
            start = time.perf_counter()
            layer._dequantize(layer._quantized_keys)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def per_step(loaded, compared: dict, rounds: int, bandwidth: float) -> dict:
    """Median decode-step seconds of each cache, interleaved in rounds, and each step's floor."""
    logits = {name: forward(loaded, cache, [FILLER]) for name, cache in compared.items() if name != "dynamic"}
    assert torch.equal(logits["fp8 transformers"], logits["fp8 table"]), "the table changed the logits"
    times: dict[str, list[float]] = {name: [] for name in compared}
    for _ in range(rounds):
        for name, cache in compared.items():
            start = time.perf_counter()
            forward(loaded, cache, [FILLER])
            times[name].append(time.perf_counter() - start)
    out = {}
    for name, cache in compared.items():
        floor = speed_limit(loaded.model, cache, bandwidth).floor_seconds
        out[name] = {"step_seconds": statistics.median(times[name]), "floor_seconds": floor}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    loaded = load_model()
    lengths, rounds = ([1024], 3) if args.quick else ([2048, 8000], 9)
    kv = base_kv(loaded, 1024)
    out: dict = {"load_average_start": os.getloadavg(), "threads": torch.get_num_threads(), "lengths": {}}
    bandwidth = probe_bandwidth()
    out["bandwidth_bytes_per_second"] = bandwidth
    for length in lengths:
        log(f"{length:,} tokens")
        compared = caches(loaded, kv, length)
        row = {
            "tensor_seconds": per_tensor(compared, 5 * rounds),
            "steps": per_step(loaded, compared, rounds, bandwidth),
        }
        out["lengths"][str(length)] = row
        tensor, steps = row["tensor_seconds"], row["steps"]
        print(
            f"\n{length:,} tokens: one key store de-quantized: transformers {tensor['transformers'] * 1e3:.2f} ms, "
            f"table {tensor['table'] * 1e3:.2f} ms ({tensor['transformers'] / tensor['table']:.1f}x faster)"
        )
        dynamic = steps["dynamic"]["step_seconds"]
        for name, step in steps.items():
            print(
                f"  {name:17} step {step['step_seconds'] * 1e3:7.1f} ms  {step['step_seconds'] / dynamic:.2f}x dynamic"
                f"  floor {step['floor_seconds'] * 1e3:5.1f} ms ({step['step_seconds'] / step['floor_seconds']:.1f}x)"
            )
    out["load_average_end"] = os.getloadavg()
    print(
        f"\nbandwidth {bandwidth / 1e9:.1f} GB/s, {out['threads']} threads, "
        f"load average {out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}"
    )
    path = ROOT / "artifacts" / "bench" / "fp8.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
