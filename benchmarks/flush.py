"""Flush policies and quantized decode, measured side by side in one process (`make bench` runs it after
`run_all.py`), printed as ratios and written to `artifacts/bench/flush.json`.

1. flush step / normal step, for quanto:4 and hqq:4 (residual_length 128) with `flush=requantize` (transformers)
   and `flush=append` (`kvdemo.cache.layers.flush`), and hqq:4 with its optimiser off (`optimize=false`,
   `kvdemo.cache.formats.hqq.optimize`) under both, at 1,024, 2,048, 4,096 and 7,680 context tokens. Each round fills
   every cache's residual to residual_length - 1 with one untimed forward pass, then times the flush step and
   `--normal` steps after it; the caches take turns within a round (interleaved), and the medians are compared.
   The context's keys and values are the embedded model's on the Normans article (2,048 real tokens, tiled
   beyond that: a step's time depends on the shapes, not on the values; fidelity is measured on real text).
2. each quantized backend's normal step / `dynamic`'s step at the same lengths (the same rounds).
3. where a decode step's extra time goes: `torch.profiler` over one step per backend at 2,048 tokens, split into
   the cache update (of which de-quantizing the store, and `torch.cat`), attention (`scaled_dot_product_attention`)
   and the matrix products (`aten::linear`/`aten::mm`/`aten::addmm`).
4. fidelity of the same specs: teacher-forced on the article's next paragraphs after paragraphs 0-11, fed one
   decode step per token through each cache (the layout of `kvdemo.evals.fidelity.perplexity_inputs`), residual_length
   16 so that the answer flushes every 16 tokens: KL(P_dynamic || P_spec) (`kvdemo.evals.fidelity.kl_statistics`) and
   the perplexity (exp of the mean negative log-likelihood, as `kvdemo.evals.fidelity.perplexity` defines it).

    .venv/bin/python benchmarks/flush.py            # 8-25 minutes on 2 shared cores (hqq's requantize flushes
                                                    # at 7,680 tokens take most of it)
    .venv/bin/python benchmarks/flush.py --quick    # two lengths, one round, 32 fidelity tokens
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import DynamicCache  # noqa: E402

from kvdemo import CacheSpec, QASession, load_model  # noqa: E402
from kvdemo.cache.spec import build_cache  # noqa: E402
from kvdemo.cache.state.telemetry import flushed_layers  # noqa: E402
from kvdemo.evals.cases import example_path, load_case  # noqa: E402
from kvdemo.evals.fidelity import kl_statistics, perplexity_inputs  # noqa: E402
from kvdemo.qa.prefill import run_prefill  # noqa: E402

RESIDUAL = 128
POLICIES = ("requantize", "append")
FLUSH_SPECS = {
    f"{b}:4,flush={p}": CacheSpec(b, nbits=4, residual_length=RESIDUAL, flush=p)
    for b in ("quanto", "hqq")
    for p in POLICIES
} | {
    f"hqq:4,flush={p},optimize=false": CacheSpec("hqq", nbits=4, residual_length=RESIDUAL, flush=p, optimize="false")
    for p in POLICIES
}
HQQ_OWN = "hqq:4,flush=append,hqq's solver"
"""hqq:4,flush=append with hqq's own torch solver (`hqq.core.quantize.Quantizer`) in place of kvdemo's fused one
(`kvdemo.cache.formats.hqq.optimize.ProximalQuantizer`): the same iterations, the before and after of issue 57."""
FLUSH_SPECS[HQQ_OWN] = FLUSH_SPECS["hqq:4,flush=append"]
OTHER_SPECS = {"dynamic": CacheSpec("dynamic"), "fp8": CacheSpec("fp8")}
FILLER = 1000  # a token id fed to fill the residuals (timing does not depend on it)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def forward(loaded, cache, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return loaded.model(
            input_ids=torch.tensor([ids], device=loaded.device), cache=cache, use_cache=True, logits_to_keep=1
        ).logits[0, -1]


def timed_step(loaded, cache) -> float:
    start = time.perf_counter()
    forward(loaded, cache, [FILLER])
    return time.perf_counter() - start


def base_kv(loaded, tokens: int, ids: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The embedded model's keys and values over the first `tokens` of `ids` (None: the Normans article's, chat
    template included), per layer, [1, kv_heads, tokens, head_dim]."""
    if ids is None:
        ids = QASession(loaded).context_ids(load_case(example_path("normans")).context)
    ids = ids[:tokens]
    cache = DynamicCache(config=loaded.config)
    run_prefill(loaded, cache, ids, handed=False)
    return [(layer.keys, layer.values) for layer in cache.layers]


def filled(spec: CacheSpec, loaded, kv, length: int, name: str = ""):
    """A cache of `spec` holding `length` tokens: `kv` tiled along the tokens, given in one update per layer (the
    prefill's first update, as `kvdemo.qa.prefill.run_prefill` gives the whole context). `name` `HQQ_OWN`: its
    hqq layers quantize with hqq's own solver."""
    cache = build_cache(spec, loaded.config)
    if name == HQQ_OWN:
        from hqq.core.quantize import Quantizer

        for layer in cache.layers:
            layer.quantizer = Quantizer
    return fill(cache, kv, length)


def fill(cache, kv, length: int):
    """`cache` (any transformers cache, e.g. one built without a spec) given `length` tokens per layer as `filled`
    gives them; the cache."""
    for index, (keys, values) in enumerate(kv):
        reps = math.ceil(length / keys.shape[-2])
        k = keys.repeat(1, 1, reps, 1)[..., :length, :].contiguous()
        v = values.repeat(1, 1, reps, 1)[..., :length, :].contiguous()
        cache.update(k, v, index)
    return cache


def residual_tokens(cache) -> int:
    keys = cache.layers[0].keys
    return keys.shape[-2] if keys is not None and keys.dim() == 4 else 0


def step_timings(loaded, kv, lengths: list[int], rounds: int, normal: int) -> dict[str, Any]:
    """Per length: every spec's flush-step and normal-step seconds, interleaved in rounds."""
    out: dict[str, Any] = {}
    specs = {**OTHER_SPECS, **FLUSH_SPECS}
    for length in lengths:
        log(f"steps at {length:,} tokens")
        caches = {name: filled(spec, loaded, kv, length, name) for name, spec in specs.items()}
        flush = {name: [] for name in FLUSH_SPECS}
        steps = {name: [] for name in specs}
        names = list(specs)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:  # a different first cache each round
                cache = caches[name]
                if name in FLUSH_SPECS:
                    fill = RESIDUAL - 1 - residual_tokens(cache)
                    if fill > 0:
                        forward(loaded, cache, [FILLER] * fill)  # untimed: the residual now waits one token short
                    flush[name].append(timed_step(loaded, cache))
                    assert flushed_layers(cache), f"{name} did not flush"
                for _ in range(normal):
                    steps[name].append(timed_step(loaded, cache))
                    assert not flushed_layers(cache) or name not in FLUSH_SPECS
        dynamic = statistics.median(steps["dynamic"])
        row = {"dynamic_ms": 1000 * dynamic}
        for name in specs:
            if name == "dynamic":
                continue
            step = statistics.median(steps[name])
            row[name] = {"step_ms": 1000 * step, "step_over_dynamic": step / dynamic}
            if name in FLUSH_SPECS:
                f = statistics.median(flush[name])
                row[name].update(flush_ms=1000 * f, flush_over_step=f / step)
        out[str(length)] = row
        del caches
    return out


@contextlib.contextmanager
def labelled(layer_types):
    """Wrap each layer type's `update` and `_dequantize` in `record_function` ranges named `kv update` and
    `kv dequantize` (undone on exit)."""
    saved = []
    for cls in layer_types:
        for method, label in (("update", "kv update"), ("_dequantize", "kv dequantize")):
            if method not in vars(cls) and not hasattr(cls, method):
                continue
            original = getattr(cls, method)

            def wrapper(self, *args, _original=original, _label=label, **kwargs):
                with torch.profiler.record_function(_label):
                    return _original(self, *args, **kwargs)

            saved.append((cls, method, vars(cls).get(method)))
            setattr(cls, method, wrapper)
    try:
        yield
    finally:
        for cls, method, original in reversed(saved):
            if original is None:
                delattr(cls, method)
            else:
                setattr(cls, method, original)


def profile_step(loaded, kv, length: int, steps: int = 3) -> dict[str, dict[str, float]]:
    """Milliseconds per category of one normal decode step per backend (the mean over `steps` profiled steps)."""
    from torch.profiler import ProfilerActivity, profile

    specs = {**OTHER_SPECS, "quanto:4": CacheSpec("quanto", nbits=4), "hqq:4": CacheSpec("hqq", nbits=4)}
    out = {}
    for name, spec in specs.items():
        log(f"profile {name}")
        cache = filled(spec, loaded, kv, length)
        timed_step(loaded, cache)  # warm
        with labelled({type(layer) for layer in cache.layers}):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                start = time.perf_counter()
                for _ in range(steps):
                    forward(loaded, cache, [FILLER])
                wall = (time.perf_counter() - start) / steps
        totals = {e.key: e.cpu_time_total / 1000 / steps for e in prof.key_averages()}  # ms, inclusive

        def total(*keys, _totals=totals):
            return sum(_totals.get(k, 0.0) for k in keys)

        out[name] = {
            "step_ms": 1000 * wall,
            "kv_update_ms": total("kv update"),
            "dequantize_ms": total("kv dequantize"),
            "cat_ms": total("aten::cat"),
            "attention_ms": total("aten::scaled_dot_product_attention"),
            "matmul_ms": total("aten::linear"),
        }
        del cache
    return out


def fp8_exact(kv, rounds: int = 20) -> dict[str, Any]:
    """fp8's exact de-quantization by bit placement (the fp8 backend's own,
    `kvdemo.cache.formats.fp8.layers.ExactFp8Layer`: the same bits as `q.float() * scale`), measured against
    transformers' own on one layer's keys of 2,048 tokens; `benchmarks/fp8.py` measures it per decode step."""
    from transformers.cache_utils import Fp8QuantizedLayer

    from kvdemo.cache.formats.fp8.layers import ExactFp8Layer

    layer, exact_layer = Fp8QuantizedLayer(), ExactFp8Layer()
    keys = kv[0][0].contiguous()
    layer.update(keys, keys)
    exact_layer.update(keys, keys)

    def library():
        return layer._dequantize(layer._quantized_keys)

    def exact():
        return exact_layer._dequantize(exact_layer._quantized_keys)

    assert torch.equal(library(), exact())
    seconds = {"library": [], "kvdemo": []}
    for _ in range(rounds):
        for name, f in (("library", library), ("kvdemo", exact)):
            start = time.perf_counter()
            for _ in range(20):
                f()
            seconds[name].append((time.perf_counter() - start) / 20)
    lib, ours = statistics.median(seconds["library"]), statistics.median(seconds["kvdemo"])
    return {"tokens": keys.shape[-2], "library_ms": 1000 * lib, "kvdemo_ms": 1000 * ours, "speedup": lib / ours}


def fidelity(loaded, tokens: int) -> dict[str, Any]:
    """KL and perplexity of both policies against `dynamic`, teacher-forced on the article's continuation."""
    case = load_case(example_path("normans")).select("0-11")
    inputs = perplexity_inputs(loaded, case.context, tokens, case.continuation)
    specs = {"dynamic": CacheSpec("dynamic")}
    for name, spec in FLUSH_SPECS.items():
        specs[name] = spec.replace(residual_length=16)
    prefill = DynamicCache(config=loaded.config)
    run_prefill(loaded, prefill, list(inputs.context_ids), handed=False)
    kv = [(layer.keys, layer.values) for layer in prefill.layers]
    fed, scored = list(inputs.continuation_ids[:-1]), list(inputs.continuation_ids[1:])
    logprobs = {}
    for name, spec in specs.items():
        log(f"fidelity {name}")
        cache = filled(spec, loaded, kv, len(inputs.context_ids), name)
        rows = [torch.log_softmax(forward(loaded, cache, [t]).float(), dim=-1) for t in fed]
        logprobs[name] = torch.stack(rows)
    out = {"tokens": tokens, "context_tokens": len(inputs.context_ids), "residual_length": 16}
    for name, lp in logprobs.items():
        nll = -lp.gather(-1, torch.tensor(scored).unsqueeze(-1)).squeeze(-1)
        row = {"perplexity": math.exp(float(nll.mean()))}
        if name != "dynamic":
            stats = kl_statistics([logprobs["dynamic"]], [lp], [scored])
            row.update(mean_kld=stats.mean_kld, p99_kld=stats.p99_kld, same_top_p=stats.same_top_p)
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two lengths, one round, 32 fidelity tokens")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per length (default 2)")
    parser.add_argument("--normal", type=int, default=4, help="normal steps timed after each flush (default 4)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens scored for fidelity (default 128)")
    parser.add_argument(
        "--sections", default="steps,profile,fp8,fidelity", help="which to run, comma-separated (default all)"
    )
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench" / "flush.json"))
    args = parser.parse_args()
    lengths = [1024, 2048] if args.quick else [1024, 2048, 4096, 7680]
    rounds = 1 if args.quick else args.rounds
    start = time.perf_counter()
    loaded = load_model()
    log("prefill of 2,048 tokens")
    kv = base_kv(loaded, 2048)
    results: dict[str, Any] = {"torch_threads": torch.get_num_threads(), "residual_length": RESIDUAL}
    sections = set(args.sections.split(","))
    if "steps" in sections:
        print_steps(results, step_timings(loaded, kv, lengths, rounds, args.normal), rounds)
    if "profile" in sections:
        print_profile(results, profile_step(loaded, kv, 2048))
    if "fp8" in sections:
        results["fp8_exact"] = f = fp8_exact(kv)
        print(
            f"\n5. fp8 de-quantization, one tensor of {f['tokens']:,} tokens: transformers' {f['library_ms']:.2f} ms, "
            f"kvdemo's bit placement (bit-identical) {f['kvdemo_ms']:.2f} ms: {f['speedup']:.2f}× faster"
        )
    if "fidelity" in sections:
        print_fidelity(results, fidelity(loaded, 32 if args.quick else args.tokens))
    results["seconds"] = time.perf_counter() - start
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"\n{results['seconds']:.0f} s; written to {args.out}")


def print_steps(results, steps, rounds) -> None:
    results["steps"] = steps
    lengths = list(steps)
    print(f"\n1. flush step / normal step (residual_length {RESIDUAL}; medians of {rounds} rounds, interleaved)")
    print(f"{'context tokens':>15}" + "".join(f"{n:>38}" for n in FLUSH_SPECS))
    for length, row in results["steps"].items():
        cells = "".join(f"{row[n]['flush_over_step']:>26.2f}× ({row[n]['flush_ms']:>5.0f} ms)" for n in FLUSH_SPECS)
        print(f"{int(length):>15,}" + cells)
    print("\n2. quantized normal step / dynamic step")
    others = [n for n in results["steps"][lengths[0]] if n != "dynamic_ms"]
    print(f"{'context tokens':>15}{'dynamic ms':>12}" + "".join(f"{n:>38}" for n in others))
    for length, row in results["steps"].items():
        cells = "".join(f"{row[n]['step_over_dynamic']:>38.2f}" for n in others)
        print(f"{int(length):>15,}{row['dynamic_ms']:>12.0f}" + cells)


def print_profile(results, profile) -> None:
    results["profile"] = profile
    print("\n3. one decode step at 2,048 tokens, ms (torch.profiler, inclusive CPU time; update includes dequantize)")
    columns = ("step_ms", "kv_update_ms", "dequantize_ms", "cat_ms", "attention_ms", "matmul_ms")
    print(f"{'backend':>10}" + "".join(f"{c[:-3]:>13}" for c in columns))
    for name, row in results["profile"].items():
        print(f"{name:>10}" + "".join(f"{row[c]:>13.1f}" for c in columns))


def print_fidelity(results, f) -> None:
    results["fidelity"] = f
    print(f"\n4. fidelity: {f['tokens']} tokens after {f['context_tokens']:,}, residual_length 16, KL vs dynamic")
    for name, row in f.items():
        if isinstance(row, dict):
            kl = (
                f"mean KL {row['mean_kld']:.5f}  p99 {row['p99_kld']:.4f}  same top {row['same_top_p']:.3f}"
                if ("mean_kld" in row)
                else ""
            )
            print(f"{name:>28}  perplexity {row['perplexity']:.3f}  {kl}")


if __name__ == "__main__":
    main()
