"""The quantized decode step against `dynamic`'s, before and after block-wise reads and in-place de-quantization,
measured side by side in one process and written to `artifacts/bench/decode.json` with the load average beside the
figures.

1. Per store: one layer's key store of 2,048 tokens ([1, 3, 2,048, 64]) de-quantized by the library's own
   `_dequantize` and in place (`kvdemo.cache.formats.quanto.layers`), medians of interleaved repeats, `torch.equal`
   checked.
2. Per decode step on the embedded model at 2,048 and 8,000 tokens (the Normans article's keys and values tiled,
   as `benchmarks/flush.py` fills them): `dynamic`; each quantized spec as transformers builds it (`before`: its own
   `QuantizedCache` layers, the whole store de-quantized by the library and joined at every step), in place but
   whole (`in place`: `quantized_cache(blockwise=False)`), and as kvdemo builds it now (`after`: in place and
   block-wise); interleaved in rounds, medians, ratios to `dynamic` and each step's floor
   (`kvdemo.cache.state.speedlimit.speed_limit`: the bytes a step must read over the measured bandwidth). The greedy
   token of every timed step is compared between `before` and `after`.
3. The same greedy answers: each shipped example's context and its first `--questions` questions (2), 32 new
   tokens, greedy, on `before` and `after` caches of every spec: the token ids compared.

fp8 is measured beside them (kvdemo's layer, `kvdemo.cache.formats.fp8.layers`: the whole store de-quantized by bit
placement; `benchmarks/fp8.py` compares it with transformers' layer and the table it replaced).

    .venv/bin/python benchmarks/decode.py            # about 6 minutes of steps, then 10 of greedy answers (2 cores)
    .venv/bin/python benchmarks/decode.py --quick    # 1,024 tokens, 2 rounds, one question
    .venv/bin/python benchmarks/decode.py --answers-only   # part 3 alone
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
from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer  # noqa: E402

from kvdemo import CacheSpec, QASession, load_model  # noqa: E402
from kvdemo.cache.formats.hqq.layers import HQQ_LAYERS, ExactHQQLayer
from kvdemo.cache.formats.quanto.layers import QUANTO_LAYERS, ExactQuantoLayer
from kvdemo.cache.layers.flush import AppendFlushMixin, quantized_cache  # noqa: E402
from kvdemo.cache.spec import build_cache  # noqa: E402
from kvdemo.cache.state.speedlimit import probe_bandwidth, speed_limit  # noqa: E402
from kvdemo.evals.cases import example_path, load_case  # noqa: E402
from kvdemo.qa.prefill import run_prefill  # noqa: E402

RESIDUAL_LAYERS = {"quanto": QUANTO_LAYERS, "hqq": HQQ_LAYERS}
"""The residual formats' layer families, by backend name."""

SPECS = ("quanto:4", "hqq:4", "quanto:4,residual_length=16", "quanto:2", "hqq:4,flush=append")
"""The quantized specs compared: transformers' default residual (128), the Ask tab's starting spec (residual 16),
2 bits, and the append flush (whose `before` is kvdemo's append layer with the library's de-quantization)."""

FILLER = 13
"""The token fed at every timed step."""


GROUP_OPTIONS = ("nbits", "q_group_size", "residual_length", "axis_key", "axis_value")

LIBRARY_APPEND = {
    "quanto": type("LibraryAppendQuantoLayer", (AppendFlushMixin, QuantoQuantizedLayer), {}),
    "hqq": type("LibraryAppendHQQLayer", (AppendFlushMixin, HQQQuantizedLayer), {}),
}
"""kvdemo's append flush on transformers' own layers (the library's de-quantization): the append layers before."""


def before_cache(spec: CacheSpec, config):
    """The cache as it was before: transformers' own `QuantizedCache` layers (the library's de-quantization, the
    whole store joined at every step); for `flush=append`, kvdemo's append flush on those layers."""
    options = {name: value for name, value in spec.resolved().items() if name in GROUP_OPTIONS}
    cache = QuantizedCache(spec.backend, config, **options)
    if spec.flush == "append":
        cache.layers = [LIBRARY_APPEND[spec.backend](**options) for _ in cache.layers]
    return cache


def variants(spec_text: str, config) -> dict:
    """`before`, `in place` (whole store) and `after` (kvdemo's default build) caches of one spec."""
    spec = CacheSpec.parse(spec_text)
    resolved = spec.resolved()
    options = {name: value for name, value in resolved.items() if name in GROUP_OPTIONS}
    whole = quantized_cache(
        RESIDUAL_LAYERS[spec.backend], config, flush=str(resolved["flush"]), blockwise=False, **options
    )
    return {"before": before_cache(spec, config), "in place": whole, "after": build_cache(spec, config)}


def per_store(repeats: int) -> dict:
    """Seconds to de-quantize one key store of 2,048 tokens, the library's way and in place (medians)."""
    torch.manual_seed(0)
    states = torch.randn(1, 3, 2048, 64)
    out = {}
    for name, library, exact in (
        ("quanto:4", QuantoQuantizedLayer, ExactQuantoLayer),
        ("hqq:4", HQQQuantizedLayer, ExactHQQLayer),
    ):
        layer = library(nbits=4, q_group_size=64)
        layer.keys = states
        store = layer._quantize(states, 0)
        fast = exact(nbits=4, q_group_size=64)
        assert torch.equal(layer._dequantize(store), fast._dequantize(store)), name
        times: dict[str, list[float]] = {"library": [], "in place": []}
        with torch.no_grad():
            for _ in range(repeats):
                for label, which in (("library", layer), ("in place", fast)):
                    start = time.perf_counter()
                    which._dequantize(store)
                    times[label].append(time.perf_counter() - start)
        out[name] = {label: statistics.median(t) for label, t in times.items()}
    return out


def per_step(loaded, kv, length: int, rounds: int, bandwidth: float, specs) -> dict:
    """Median decode-step seconds of every cache at `length` tokens, interleaved in rounds; each step's floor; the
    greedy tokens of `before` and `after` compared at every timed step."""
    caches = {"dynamic": fill(build_cache(CacheSpec("dynamic"), loaded.config), kv, length)}
    caches["fp8"] = fill(build_cache(CacheSpec("fp8"), loaded.config), kv, length)
    for text in specs:
        for label, cache in variants(text, loaded.config).items():
            caches[f"{text} {label}"] = fill(cache, kv, length)
    times: dict[str, list[float]] = {name: [] for name in caches}
    tokens: dict[str, list[int]] = {name: [] for name in caches}
    for _ in range(rounds + 1):  # the first round warms every path up and is not timed
        for name, cache in caches.items():
            start = time.perf_counter()
            logits = forward(loaded, cache, [FILLER])
            times[name].append(time.perf_counter() - start)
            tokens[name].append(int(logits.argmax()))
    out = {}
    for name, cache in caches.items():
        floor = speed_limit(loaded.model, cache, bandwidth).floor_seconds
        out[name] = {"step_seconds": statistics.median(times[name][1:]), "floor_seconds": floor}
    for text in specs:
        out[f"{text} after"]["same_step_tokens"] = tokens[f"{text} after"] == tokens[f"{text} before"]
    return out


def greedy(loaded, cache, prefix: list[int], question: list[int], new_tokens: int, handed: bool) -> list[int]:
    """`new_tokens` greedy token ids after a prefill of `prefix` (kvdemo's chunked prefill: `handed` as
    `Backend.hands_over` says for the spec) and the question."""
    run_prefill(loaded, cache, prefix, handed=handed)
    logits = forward(loaded, cache, question)
    out = [int(logits.argmax())]
    for _ in range(new_tokens - 1):
        out.append(int(forward(loaded, cache, [out[-1]]).argmax()))
    return out


def same_answers(loaded, specs, questions: int, new_tokens: int) -> dict:
    """Per spec: how many of the answers (each example's first `questions` questions) are the same token ids on
    `before` and `after`, and the context lengths."""
    out: dict = {"contexts": {}, "specs": {}}
    prompts = []
    for name in ("normans", "southern_california"):
        case = load_case(example_path(name))
        session = QASession(loaded)
        session.prefill(case.context)
        for q in case.questions[:questions]:
            question = session.question_ids(q.question)
            prompt = session.prompt_ids(q.question)
            prompts.append((prompt[: len(prompt) - len(question)], question))
            out["contexts"][name] = len(prompt) - len(question)
    for text in specs:
        spec = CacheSpec.parse(text)
        same = 0
        for prefix, question in prompts:
            answers = [
                greedy(loaded, make(spec, loaded.config), prefix, question, new_tokens, spec.info.hands_over)
                for make in (before_cache, build_cache)
            ]
            same += answers[0] == answers[1]
        out["specs"][text] = {"same": same, "answers": len(prompts)}
        log(f"{text}: {same}/{len(prompts)} answers the same")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--questions", type=int, default=2, help="questions per example for the greedy answers")
    parser.add_argument("--answers-only", action="store_true", help="only part 3 (no timing: may run beside others)")
    args = parser.parse_args()
    loaded = load_model()
    lengths, rounds, questions = ([1024], 2, 1) if args.quick else ([2048, 8000], 7, args.questions)
    if args.answers_only:
        lengths = []
    out: dict = {"load_average_start": os.getloadavg(), "threads": torch.get_num_threads(), "lengths": {}}
    out["bandwidth_bytes_per_second"] = bandwidth = probe_bandwidth()
    out["store_seconds"] = stores = per_store(40) if lengths else {}
    print("\none key store of 2,048 tokens de-quantized:")
    for name, row in stores.items():
        print(
            f"  {name:9} library {row['library'] * 1e3:.2f} ms, in place {row['in place'] * 1e3:.2f} ms "
            f"({row['library'] / row['in place']:.1f}x faster, the same bits)"
        )
    kv = base_kv(loaded, 1024)
    for length in lengths:
        log(f"{length:,} tokens")
        steps = out["lengths"][str(length)] = per_step(loaded, kv, length, rounds, bandwidth, SPECS)
        steps["load_average"] = os.getloadavg()
        dynamic = steps["dynamic"]["step_seconds"]
        print(f"\n{length:,} tokens (load average {steps['load_average'][0]:.2f}): step, x dynamic, x its floor")
        for name, step in steps.items():
            if name == "load_average":
                continue
            same = "" if "same_step_tokens" not in step else f"  same tokens: {step['same_step_tokens']}"
            print(
                f"  {name:38} {step['step_seconds'] * 1e3:7.1f} ms  {step['step_seconds'] / dynamic:.2f}x"
                f"  floor {step['floor_seconds'] * 1e3:5.1f} ms ({step['step_seconds'] / step['floor_seconds']:.1f}x)"
                + same
            )
    log("greedy answers")
    out["answers"] = answers = same_answers(loaded, SPECS, questions, 32)
    print(f"\nthe same greedy answers, before and after (32 tokens; contexts {answers['contexts']}):")
    for text, row in answers["specs"].items():
        print(f"  {text:38} {row['same']}/{row['answers']}")
    out["load_average_end"] = os.getloadavg()
    print(
        f"\nbandwidth {bandwidth / 1e9:.1f} GB/s, {out['threads']} threads, "
        f"load average {out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}"
    )
    path = ROOT / "artifacts" / "bench" / ("decode_answers.json" if args.answers_only else "decode.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
