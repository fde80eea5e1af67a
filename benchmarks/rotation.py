"""`rotation=hadamard` against `rotation=none`, measured side by side in one process, written to
`artifacts/bench/rotation.json` with the load average beside the figures.

1. Fidelity, for quanto 2/4 and hqq 2/4/8 bits (q_group_size 64, residual_length 128, both axes at their
   defaults), rotation off and on: the embedded model teacher-forced on the article's next paragraphs after the
   Ask tab's example context (Normans 0-7, Southern California 0-5), one decode step per token through each
   cache (the layout of
   `kvdemo.evals.fidelity.perplexity_inputs`): KL(P_dynamic || P_spec) (`kvdemo.evals.fidelity.kl_statistics`:
   mean, 99 %, the share of positions with the same top token) and the perplexity's ratio to `dynamic`'s.
   Bytes per token are the registry's formula (`estimate_kv_bytes`), equal off and on.
2. The rotation's cost per decode step: median step time of quanto:4 and hqq:4, off and on, at the context's
   length and 4x it (the same keys and values tiled), interleaved in rounds. On, both ways
   (`kvdemo.cache.layers.rotation`): the query side (the new token's key and value, the query and the output rotated:
   O(head_dim^2) per new token, what `rotation=hadamard` builds) and the read side (the whole store rotated back
   after every de-quantization: one [tokens, head_dim] x [head_dim, head_dim] product per layer and tensor).

    .venv/bin/python benchmarks/rotation.py                  # both shipped articles: 10-25 minutes on 2 cores
    .venv/bin/python benchmarks/rotation.py --quick          # the Normans only, 64 tokens, 3 rounds
    .venv/bin/python benchmarks/rotation.py --steps-only     # part 2 alone
"""

from __future__ import annotations

import argparse
import json
import math
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

from flush import fill, filled, forward, log  # noqa: E402  (benchmarks/flush.py's helpers)
from transformers import DynamicCache  # noqa: E402

from kvdemo import CacheSpec, load_model  # noqa: E402
from kvdemo.cache.formats.hqq.layers import HQQ_LAYERS, set_quantizer
from kvdemo.cache.formats.quanto.layers import QUANTO_LAYERS
from kvdemo.cache.layers.flush import quantized_cache  # noqa: E402
from kvdemo.cache.spec import estimate_kv_bytes  # noqa: E402
from kvdemo.evals.cases import example_path, load_case  # noqa: E402
from kvdemo.evals.fidelity import kl_statistics, perplexity_inputs  # noqa: E402
from kvdemo.qa.prefill import run_prefill  # noqa: E402
from kvdemo.ui.examples import EXAMPLES  # noqa: E402

RESIDUAL_LAYERS = {"quanto": QUANTO_LAYERS, "hqq": HQQ_LAYERS}
"""The residual formats' layer families, by backend name."""

PAIRS = [(backend, nbits) for backend, bits in (("quanto", (2, 4)), ("hqq", (2, 4, 8))) for nbits in bits]


def _spec(backend: str, nbits: int, rotation: str) -> CacheSpec:
    return CacheSpec(backend, nbits=nbits, rotation=None if rotation == "none" else rotation)


def rotation_specs() -> list[CacheSpec]:
    """Every pair of `PAIRS`, rotation off then on."""
    return [_spec(backend, nbits, rotation) for backend, nbits in PAIRS for rotation in ("none", "hadamard")]


def fidelity(loaded, example: str, tokens: int, compared: list[CacheSpec] | None = None) -> dict:
    """Each spec of `compared` (default `rotation_specs()`) against `dynamic`, teacher-forced on `tokens` tokens of
    the article's next paragraphs after the Ask tab's example context (`kvdemo.ui.examples.EXAMPLES`).

    Returns:
        {"context_tokens", "tokens", spec text: {"perplexity", "ppl_ratio", "bytes_per_token", "mean_kld",
        "p99_kld", "same_top_p"}} (`dynamic`'s row without the KL figures).
    """
    stem, paragraphs = EXAMPLES[example]
    case = load_case(example_path(stem)).select(paragraphs)
    inputs = perplexity_inputs(loaded, case.context, tokens, case.continuation)
    context_ids = list(inputs.context_ids)
    prefill = DynamicCache(config=loaded.config)
    run_prefill(loaded, prefill, context_ids, handed=False)
    kv = [(layer.keys, layer.values) for layer in prefill.layers]
    fed, scored = list(inputs.continuation_ids[:-1]), list(inputs.continuation_ids[1:])
    specs = {"dynamic": CacheSpec("dynamic")} | {spec.text: spec for spec in compared or rotation_specs()}
    logprobs = {}
    for name, spec in specs.items():
        log(f"{example}: fidelity {name}")
        cache = filled(spec, loaded, kv, len(context_ids))
        logprobs[name] = torch.stack([torch.log_softmax(forward(loaded, cache, [t]).float(), dim=-1) for t in fed])
    out: dict = {"context_tokens": len(context_ids), "tokens": len(scored)}
    base_nll = None
    for name, lp in logprobs.items():
        nll = float(-lp.gather(-1, torch.tensor(scored).unsqueeze(-1)).squeeze(-1).mean())
        base_nll = nll if name == "dynamic" else base_nll
        row = {"perplexity": math.exp(nll), "ppl_ratio": math.exp(nll - base_nll)}
        row["bytes_per_token"] = estimate_kv_bytes(specs[name], loaded.config, 1024, torch.float32) / 1024
        if name != "dynamic":
            stats = kl_statistics([logprobs["dynamic"]], [lp], [scored])
            row |= {"mean_kld": stats.mean_kld, "p99_kld": stats.p99_kld, "same_top_p": stats.same_top_p}
        out[name] = row
    return out


READ_SIDE = " (read side)"
"""The suffix of a rotated spec's name built rotating on read (`kvdemo.cache.layers.rotation.RotationMixin`)."""


def step_cost(loaded, rounds: int) -> dict:
    """Median decode-step seconds of quanto:4 and hqq:4, rotation off and on, at the Normans example's length and
    4x it (interleaved). Rotated, both ways: the query side (what `rotation=hadamard` builds for the embedded model,
    `kvdemo.cache.layers.attention`) and the read side (`name + READ_SIDE`: the whole store rotated back at every
    step)."""
    stem, paragraphs = EXAMPLES["Normans"]
    ids = perplexity_inputs(loaded, load_case(example_path(stem)).select(paragraphs).context, 8, None).context_ids
    prefill = DynamicCache(config=loaded.config)
    run_prefill(loaded, prefill, list(ids), handed=False)
    kv = [(layer.keys, layer.values) for layer in prefill.layers]
    out: dict = {}
    for length in (len(ids), 4 * len(ids)):
        specs = {s.text: s for b in ("quanto", "hqq") for r in ("none", "hadamard") for s in [_spec(b, 4, r)]}
        specs = {name: s.replace(residual_length=4096) for name, s in specs.items()}  # no flush within the steps
        caches = {name: filled(s, loaded, kv, length) for name, s in specs.items()}
        for name, spec in list(specs.items()):
            if spec.rotation == "hadamard":  # the same spec's layers rotating on read (the library call)
                options = dict(spec.resolved())
                optimize = options.pop("optimize", None)  # hqq's quantizer, set by its own format
                read_side = quantized_cache(RESIDUAL_LAYERS[spec.backend], loaded.config, rotate_query=False, **options)
                if optimize is not None:
                    set_quantizer(read_side, str(optimize))
                caches[name + READ_SIDE] = fill(read_side, kv, length)
        times: dict[str, list[float]] = {name: [] for name in caches}
        for _ in range(rounds):
            for name, cache in caches.items():
                start = time.perf_counter()
                forward(loaded, cache, [13])
                times[name].append(time.perf_counter() - start)
        out[str(length)] = {name: statistics.median(t) for name, t in times.items()}
        log(f"steps at {length:,} tokens: " + ", ".join(f"{n} {v * 1000:.1f} ms" for n, v in out[str(length)].items()))
    return out


def print_fidelity(articles: dict) -> None:
    """`fidelity`'s rows per article as a table."""
    for article, rows in articles.items():
        print(f"\n{article}: {rows['context_tokens']:,} context tokens, {rows['tokens']} teacher-forced tokens")
        print(f"{'spec':40} {'bytes/tok':>9} {'mean KL':>8} {'99% KL':>7} {'same top':>8} {'PPL x':>6}")
        for name, row in rows.items():
            if not isinstance(row, dict):
                continue
            print(
                f"{name:40} {row['bytes_per_token']:9.0f} {row.get('mean_kld', 0):8.4f} {row.get('p99_kld', 0):7.3f} "
                f"{row.get('same_top_p', 100):7.1f}% {row['ppl_ratio']:6.3f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps-only", action="store_true", help="only the step cost (part 2), a few minutes")
    args = parser.parse_args()
    loaded = load_model()
    tokens, rounds = (64, 3) if args.quick else (256, 7)
    articles = [] if args.steps_only else ["Normans"] if args.quick else list(EXAMPLES)
    out: dict = {"load_average_start": os.getloadavg(), "fidelity": {}}
    for article in articles:
        out["fidelity"][article] = fidelity(loaded, article, tokens)
    out["step_seconds"] = step_cost(loaded, rounds)
    out["load_average_end"] = os.getloadavg()
    print_fidelity(out["fidelity"])
    for length, row in out["step_seconds"].items():
        for way, suffix in (("query side", ""), ("read side", READ_SIDE)):
            cost = ", ".join(
                f"{b}:4 {row[_spec(b, 4, 'hadamard').text + suffix] / row[_spec(b, 4, 'none').text]:.2f}x"
                for b in ("quanto", "hqq")
            )
            print(f"step at {int(length):,} tokens, rotation on ({way}) / off: {cost}")
    print(f"load average {out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}")
    path = ROOT / "artifacts" / "bench" / "rotation.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
