"""The `fp8` backend's de-quantization by bit placement (`kvdemo/cache/formats/fp8/layers.py`) against transformers' own
`Fp8QuantizedLayer` and against the 256-entry table kvdemo used before it (2026-12-02 to 12-03; defined here as
`TableFp8Layer`), measured side by side in one process and written to `artifacts/bench/fp8.json` with the load
average beside the figures.

1. Per tensor: one layer's key store ([1, 3, tokens, 64] float8_e4m3 codes) de-quantized by the library's
   `(q.float() * scale).to(dtype)`, by the table (`torch.take`) and by bit placement, medians of interleaved
   repeats, `torch.equal` checked.
2. Per decode step on the embedded model, at 2,048 and 8,000 tokens (the Normans article's keys and values tiled):
   `dynamic` and the three fp8 layers, interleaved in rounds; the medians, their ratios and each step's floor
   (`kvdemo.cache.state.speedlimit.speed_limit`: the bytes a step must read over the measured bandwidth). Before
   timing, one step on each fp8 cache must give the same logits bit for bit.

    .venv/bin/python benchmarks/fp8.py            # about 4 minutes on 2 cores
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
from transformers.cache_utils import Fp8QuantizedLayer  # noqa: E402

from kvdemo import CacheSpec, load_model  # noqa: E402
from kvdemo.cache.spec import build_cache  # noqa: E402
from kvdemo.cache.state.speedlimit import probe_bandwidth, speed_limit  # noqa: E402

FILLER = 13
"""The token fed at every timed step."""


class TableFp8Layer(Fp8QuantizedLayer):
    """kvdemo's fp8 layer before bit placement (the "before" of this benchmark): each code's value read from a
    256-entry table of `(code.float() * scale).to(dtype)`, made once per layer and tensor from the frozen scale, by
    `torch.take(table, codes.long())`. The same bits as the library (NaN codes aside)."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        codes = torch.arange(256, dtype=torch.uint8).view(self.fp8_dtype)
        self._tables = tuple(
            (codes.float() * store[1]).to(key_states.dtype) for store in (self._quantized_keys, self._quantized_values)
        )

    def _dequantize(self, qtensor):
        quant_tensor, scale = qtensor
        table = self._tables[0] if scale is self._quantized_keys[1] else self._tables[1]
        return torch.take(table, quant_tensor.view(torch.uint8).long())


def caches(loaded, kv, length: int) -> dict:
    """The four caches compared, each holding `length` tokens."""
    table = QuantizedCache("fp8", loaded.config)
    table.layers = [TableFp8Layer() for _ in table.layers]
    return {
        "dynamic": fill(build_cache(CacheSpec("dynamic"), loaded.config), kv, length),
        "fp8 transformers": fill(QuantizedCache("fp8", loaded.config), kv, length),
        "fp8 table (before)": fill(table, kv, length),
        "fp8 kvdemo": fill(build_cache(CacheSpec("fp8"), loaded.config), kv, length),
    }


def per_tensor(compared: dict, repeats: int) -> dict:
    """Seconds to de-quantize layer 0's key store, the library's way, by table and by bit placement (medians,
    interleaved)."""
    layers = {
        "transformers": compared["fp8 transformers"].layers[0],
        "table": compared["fp8 table (before)"].layers[0],
        "kvdemo": compared["fp8 kvdemo"].layers[0],
    }
    expected = layers["transformers"]._dequantize(layers["transformers"]._quantized_keys)
    for layer in layers.values():
        assert torch.equal(layer._dequantize(layer._quantized_keys), expected)
    times: dict[str, list[float]] = {name: [] for name in layers}
    for _ in range(repeats):
        for name, layer in layers.items():
            start = time.perf_counter()
            layer._dequantize(layer._quantized_keys)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def per_step(loaded, compared: dict, rounds: int, bandwidth: float) -> dict:
    """Median decode-step seconds of each cache, interleaved in rounds, and each step's floor."""
    logits = {name: forward(loaded, cache, [FILLER]) for name, cache in compared.items() if name != "dynamic"}
    for name, got in logits.items():
        assert torch.equal(logits["fp8 transformers"], got), f"{name} changed the logits"
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
            f"table {tensor['table'] * 1e3:.2f} ms, kvdemo (bit placement) {tensor['kvdemo'] * 1e3:.2f} ms "
            f"({tensor['transformers'] / tensor['kvdemo']:.1f}x faster than transformers, "
            f"{tensor['table'] / tensor['kvdemo']:.1f}x than the table)"
        )
        dynamic = steps["dynamic"]["step_seconds"]
        for name, step in steps.items():
            print(
                f"  {name:18} step {step['step_seconds'] * 1e3:7.1f} ms  {step['step_seconds'] / dynamic:.2f}x dynamic"
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
