"""The decode step against its speed limit, measured side by side in one process (`make bench` runs it after
`run_all.py`; about 3 minutes on 2 cores, most of it the 8,000-token prefill).

1. bandwidth: `kvdemo.cache.state.speedlimit.probe_bandwidth` (STREAM copy) at torch's thread count and at 1 thread.
2. products: the effective GB/s of the model's matrix-vector products (every `nn.Linear` once, on one token:
   the weight bytes over the time), interleaved with a copy of the same thread count, at torch's threads and at 1.
3. step ÷ floor: a `dynamic` decode step (bare loop: forward + argmax) on the Normans context (paragraphs 0-11)
   with transformers' `DynamicLayer` (`dynamic`, `storage=concat`) and with `kvdemo.cache.layers.storage.GrowingLayer`
   (`storage=growing`), against the floor
   (`kvdemo.cache.state.speedlimit.speed_limit`: weights + KV bytes over the copy bandwidth).
4. context sweep: the same step at 1k, 2k, 4k and 8k tokens of context (SQuAD articles joined), both layers in
   interleaved rounds, and the step's growth from 1k to 8k over what reading the extra KV bytes costs at the copy
   bandwidth (1.0 = the growth is only the KV read).

Every figure is the median over interleaved rounds; ratios are what to compare across runs (the machine is shared).

    .venv/bin/python benchmarks/speed.py [--quick] [--out artifacts/bench/speed.json]
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
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import kvdemo  # noqa: E402, F401  (first: it sets libgomp's GOMP_SPINCOUNT before torch loads)
from kvdemo import load_model  # noqa: E402
from kvdemo.cache.spec import CacheSpec, build_cache  # noqa: E402
from kvdemo.cache.state.speedlimit import probe_bandwidth, speed_limit, weight_bytes  # noqa: E402
from kvdemo.evals.cases import example_path, load_case  # noqa: E402
from kvdemo.qa.prefill import run_prefill  # noqa: E402

LAYERS = {
    "DynamicLayer": lambda config: build_cache(CacheSpec("dynamic", storage="concat"), config),
    "GrowingLayer": lambda config: build_cache(CacheSpec("dynamic", storage="growing"), config),
}
"""The two `storage` choices of the `dynamic` backend, by the layer class each builds."""


def copy_bandwidth(mib: int = 128) -> float:
    """One timed STREAM copy of `mib` MiB (bytes read + written per second), at the current thread count."""
    source = torch.ones(mib * 2**20 // 4)
    target = torch.empty_like(source)
    target.copy_(source)
    start = time.perf_counter()
    target.copy_(source)
    return 2 * source.numel() * 4 / (time.perf_counter() - start)


def products_bandwidth(model: torch.nn.Module) -> float:
    """Every `nn.Linear` of `model` once on one token (`F.linear`, as the model calls it): weight bytes / seconds."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {m.in_features: torch.randn(1, 1, m.in_features) for m in linears}
    total = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    with torch.no_grad():
        start = time.perf_counter()
        for m in linears:
            torch.nn.functional.linear(inputs[m.in_features], m.weight)
        return total / (time.perf_counter() - start)


def products_section(model, rounds: int) -> dict:
    """Copy and products GB/s, interleaved, at torch's thread count and at 1 thread."""
    default = torch.get_num_threads()
    out = {}
    for threads in sorted({default, 1}, reverse=True):
        torch.set_num_threads(threads)
        copies, products = [], []
        for _ in range(rounds):
            copies.append(copy_bandwidth())
            products.append(products_bandwidth(model))
        out[threads] = {
            "copy_gbps": statistics.median(copies) / 1e9,
            "products_gbps": statistics.median(products) / 1e9,
        }
    torch.set_num_threads(default)
    return out


def _crop_to(cache, length: int) -> None:
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra:
            layer.crop(-extra)


def _copy_of(source, build, config):
    """A cache of `build` holding `source`'s tokens (each layer's keys and values assigned, then one grow)."""
    cache = build(config)
    for mine, theirs in zip(cache.layers, source.layers):
        mine.lazy_initialization(theirs.keys, theirs.values)
        mine.update(theirs.keys.clone(), theirs.values.clone())
    return cache


def timed_steps(model, cache, token: int, steps: int) -> tuple[list[float], list[int]]:
    """`steps` greedy decode steps (forward + argmax) from `token`; seconds of each, tokens produced."""
    seconds, tokens = [], []
    ids = torch.tensor([[token]])
    with torch.no_grad():
        for _ in range(steps):
            start = time.perf_counter()
            logits = model(ids, cache=cache, use_cache=True).logits
            ids = logits[:, -1:].argmax(-1)
            seconds.append(time.perf_counter() - start)
            tokens.append(int(ids))
    return seconds, tokens


def sweep(loaded, ids: list[int], lengths: list[int], rounds: int, steps: int, threads: list[int]) -> dict:
    """Step time of both layers at each thread count and context length (prefilled once at the longest, cropped
    down), in interleaved rounds; the floor at the best copy bandwidth over the thread counts."""
    model, config = loaded.model, loaded.model.config
    plain = LAYERS["DynamicLayer"](config)
    default = torch.get_num_threads()
    torch.set_num_threads(min(threads))  # on a busy 2-core machine 2 threads can be 10x slower (docs/benchmarks.md)
    start = time.perf_counter()
    run_prefill(loaded, plain, ids[: max(lengths)], handed=False)
    prefill_seconds = time.perf_counter() - start
    torch.set_num_threads(default)
    caches = {"DynamicLayer": plain, "GrowingLayer": _copy_of(plain, LAYERS["GrowingLayer"], config)}
    variants = [(name, n) for n in threads for name in caches]
    bandwidth = 0.0
    for n in threads:
        torch.set_num_threads(n)
        bandwidth = max(bandwidth, probe_bandwidth())
    torch.set_num_threads(default)
    token = ids[max(lengths)]
    out = {"prefill_seconds": prefill_seconds, "bandwidth": bandwidth, "lengths": {}}
    for length in sorted(lengths, reverse=True):
        times = {v: [] for v in variants}
        produced = set()
        limit = None
        for r in range(rounds):
            for name, n in variants if r % 2 == 0 else variants[::-1]:
                torch.set_num_threads(n)
                _crop_to(caches[name], length)
                seconds, tokens = timed_steps(model, caches[name], token, steps)
                times[(name, n)] += seconds[1:]  # the first step after a crop re-allocates for transformers' layer
                produced.add(tuple(tokens))
                if name == "DynamicLayer" and limit is None:
                    limit = speed_limit(model, caches[name], bandwidth)  # compact tensors of length + steps tokens
        torch.set_num_threads(default)
        for cache in caches.values():
            _crop_to(cache, length)
        out["lengths"][length] = {
            **{f"{name}@{n}_ms": statistics.median(t) * 1000 for (name, n), t in times.items()},
            "floor_ms": limit.floor_seconds * 1000,
            "kv_bytes": limit.kv_bytes,
            "identical_tokens": len(produced) == 1,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="lengths 512-2048, fewer rounds")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench" / "speed.json"))
    args = parser.parse_args()
    loaded = load_model()
    model = loaded.model
    rounds, steps = (2, 4) if args.quick else (3, 6)
    lengths = [512, 1024, 2048] if args.quick else [1024, 2048, 4096, 8000]
    threads = torch.get_num_threads()
    env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    print(f"speed limit (torch threads {threads}, {env})", flush=True)

    products = products_section(model, rounds=5)
    for n, p in products.items():
        print(
            f"  products at {n} thread(s): {p['products_gbps']:.1f} GB/s effective vs copy {p['copy_gbps']:.1f} GB/s "
            f"({p['products_gbps'] / p['copy_gbps']:.0%} of copy)",
            flush=True,
        )

    tokenizer = loaded.tokenizer
    normans = load_case(example_path("normans")).select("0-11")
    messages = [{"role": "user", "content": normans.context + "\n\nWho led the Normans?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False).input_ids
    both = sorted({threads, 1}, reverse=True)
    normans_run = sweep(loaded, prompt, [len(prompt) - 1], rounds=rounds, steps=steps, threads=both)
    row = normans_run["lengths"][len(prompt) - 1]
    print(
        f"  dynamic step on Normans 0-11 ({len(prompt) - 1:,} tokens): floor {row['floor_ms']:.1f} ms "
        f"(weights {weight_bytes(model) / 1e6:.0f} MB + KV {row['kv_bytes'] / 1e6:.0f} MB at "
        f"{normans_run['bandwidth'] / 1e9:.1f} GB/s); same tokens everywhere: {row['identical_tokens']}",
        flush=True,
    )
    for n in both:
        for name in LAYERS:
            ms = row[f"{name}@{n}_ms"]
            print(f"    {name} at {n} thread(s): {ms:.1f} ms = {ms / row['floor_ms']:.2f}x floor (target <= 2.5x)")

    cases = [load_case(p) for p in sorted((ROOT.parent / "shared" / "cases").glob("*.json"))] or [normans]
    text = "\n\n".join(c.context for c in cases)
    ids = tokenizer(text).input_ids
    while len(ids) < max(lengths) + 1:
        ids = ids + ids
    long_run = sweep(loaded, ids, lengths, rounds=rounds, steps=steps, threads=[1])
    print(
        f"  context sweep at 1 thread (prefilled {max(lengths):,} tokens in {long_run['prefill_seconds']:.0f} s):",
        flush=True,
    )
    for length in sorted(lengths):
        r = long_run["lengths"][length]
        print(
            f"    {length:>5,} tokens: floor {r['floor_ms']:6.1f} ms · DynamicLayer {r['DynamicLayer@1_ms']:6.1f} ms "
            f"({r['DynamicLayer@1_ms'] / r['floor_ms']:.2f}x) · GrowingLayer {r['GrowingLayer@1_ms']:6.1f} ms "
            f"({r['GrowingLayer@1_ms'] / r['floor_ms']:.2f}x) · same tokens {r['identical_tokens']}",
            flush=True,
        )
    low, high = long_run["lengths"][min(lengths)], long_run["lengths"][max(lengths)]
    read_ms = high["floor_ms"] - low["floor_ms"]  # the extra KV bytes at the copy bandwidth
    growth = {}
    for name in LAYERS:
        extra = high[f"{name}@1_ms"] - low[f"{name}@1_ms"]
        growth[name] = extra / read_ms
        print(
            f"  step growth {min(lengths):,}->{max(lengths):,} tokens ÷ KV bytes read, {name}: "
            f"+{extra:.1f} ms / +{read_ms:.1f} ms = {growth[name]:.2f}x",
            flush=True,
        )
    result = {
        "torch_threads": threads,
        "products": products,
        "normans": normans_run,
        "sweep": long_run,
        "growth_over_kv_read": growth,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(f"  written to {args.out}", flush=True)


if __name__ == "__main__":
    main()
