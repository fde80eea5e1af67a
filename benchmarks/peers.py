"""kvdemo beside its peers on one job, in paired rounds: transformers' documented prefix-cache pattern, re-prefilling
each question, and llama.cpp on the same embedded GGUF (`benchmarks/peer_runners.py` has the runners).

The job, per context: prefill the context once, then answer each question greedily (`--max-new-tokens`), the
prefix kept for the next question by each system's own means. Every system reads the same token ids. One thread on
every side (`--threads`): torch's and llama.cpp's. Each round prefills every system and then asks every question of
every system in turn, the systems' order rotated from round to round; the machine is shared, so a ratio is taken
within a round and the rounds' ratios are summarised (median, and the range). Printed, per context:

- per system: prefill seconds, seconds per answer, first token, decode tokens/s, the mechanism that keeps the
  prefix (seconds per question), KV bytes held at an answer's last step, the step's floor (bytes a decode step must
  read over the one-thread bandwidth, `kvdemo.cache.state.speedlimit`), and how many answers equal kvdemo `dynamic`'s;
- the ratios kvdemo / peer of the pairs in `PAIRS`.

Written to `artifacts/bench/peers.json` with the load average at the start and the end.

    make bench-peers                          # builds llama-cpp-python once (pinned in the Makefile), then this
    .venv/bin/python benchmarks/peers.py      # without llama-cpp-python installed its rows are left out, said so
    .venv/bin/python benchmarks/peers.py --quick
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

from peer_runners import (  # noqa: E402
    Job,
    KvdemoRunner,
    LlamaCppRunner,
    PatternRunner,
    RePrefillRunner,
    gguf_tensor_bytes,
)

from kvdemo import CacheSpec, load_model  # noqa: E402
from kvdemo.cache.model.geometry import kv_geometry  # noqa: E402
from kvdemo.cache.state.speedlimit import probe_bandwidth  # noqa: E402
from kvdemo.evals.cases import example_path, load_case  # noqa: E402
from kvdemo.qa.models import embedded_gguf_path  # noqa: E402

KVDEMO_SPECS = ("dynamic", "quanto:4", "hqq:4", "fp8", "turboquant:4")
LLAMA_KV_TYPES = ("f16", "q8_0", "q4_0")
QUANTIZED_PATTERNS = ("quanto", "hqq", "fp8")
REFERENCE = "kvdemo dynamic"
PAIRS = (
    ("kvdemo dynamic", "transformers pattern (dynamic)"),
    ("kvdemo quanto:4", "transformers pattern (quanto)"),
    ("kvdemo hqq:4", "transformers pattern (hqq)"),
    ("kvdemo fp8", "transformers pattern (fp8)"),
    ("kvdemo dynamic", "re-prefill per question"),
    ("kvdemo dynamic", "llama.cpp f16 KV"),
    ("kvdemo fp8", "llama.cpp q8_0 KV"),
    ("kvdemo quanto:4", "llama.cpp q4_0 KV"),
    ("kvdemo hqq:4", "llama.cpp q4_0 KV"),
    ("kvdemo turboquant:4", "llama.cpp q4_0 KV"),
)
"""(kvdemo system, peer): the ratios printed."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def pattern_outcomes(loaded, job: Job) -> dict[str, str]:
    """The documented pattern with each `QuantizedCache` backend, tried once on the first question: "works" or
    the error the library raises."""
    out = {}
    for backend in QUANTIZED_PATTERNS:
        runner = PatternRunner(loaded, backend)
        try:
            runner.prefill(job)
            runner.answer(job, 0, 2)
            out[backend] = "works"
        except Exception as error:  # what the library raises is the finding
            out[backend] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    return out


def make_runners(loaded, job: Job, args, outcomes: dict[str, str]) -> tuple[list, dict[str, str]]:
    """Every system for `job`: the pattern with each `QuantizedCache` backend whose outcome "works", llama.cpp's
    when llama-cpp-python imports (else the reason, in the second value)."""
    runners: list = [KvdemoRunner(loaded, CacheSpec.parse(text)) for text in KVDEMO_SPECS]
    runners.append(PatternRunner(loaded))
    runners += [PatternRunner(loaded, backend) for backend, outcome in outcomes.items() if outcome == "works"]
    skipped = {}
    if len(job.prefix_ids) <= args.reprefill_max_tokens:
        runners.append(RePrefillRunner(loaded))
    else:
        skipped["re-prefill"] = f"the context is over --reprefill-max-tokens {args.reprefill_max_tokens:,}"
    geometry = kv_geometry(loaded.config)
    n_ctx = len(job.prefix_ids) + max(map(len, job.question_ids)) + args.max_new_tokens + 16
    for kv_type in LLAMA_KV_TYPES:
        try:
            runners.append(
                LlamaCppRunner(
                    embedded_gguf_path(),
                    kv_type,
                    n_ctx,
                    args.threads,
                    geometry.layers,
                    geometry.kv_heads * geometry.head_dim,
                )
            )
        except ImportError as error:
            skipped["llama.cpp"] = f"{error}; `make bench-peers` installs llama-cpp-python"
            break
    return runners, skipped


def run_rounds(runners: list, job: Job, rounds: int, max_new_tokens: int) -> dict[str, list[dict]]:
    """Per system, per round: its prefill seconds and its answers (`Answered` as dicts)."""
    out: dict[str, list[dict]] = {r.name: [] for r in runners}
    for k in range(rounds):
        order = runners[k % len(runners) :] + runners[: k % len(runners)]
        log(f"round {k + 1}/{rounds}: prefill")
        record = {r.name: {"prefill_seconds": r.prefill(job), "answers": []} for r in order}
        for i in range(len(job.questions)):
            log(f"round {k + 1}/{rounds}: question {i + 1}/{len(job.questions)}")
            for r in order:
                a = r.answer(job, i, max_new_tokens)
                record[r.name]["answers"].append(
                    {**vars(a), "decode_tokens": a.decode_tokens, "decode_seconds": a.decode_seconds}
                )
        for name, rec in record.items():
            out[name].append(rec)
    return out


def summary(rounds: list[dict]) -> dict:
    """One system's figures: medians over rounds of per-round totals (seconds, tokens/s, bytes)."""
    per_round = [
        {
            "prefill_seconds": r["prefill_seconds"],
            "answer_seconds": statistics.mean(a["seconds"] for a in r["answers"]),
            "first_token_seconds": statistics.mean(a["first_token_seconds"] for a in r["answers"]),
            "mechanism_seconds": statistics.mean(a["mechanism_seconds"] for a in r["answers"]),
            "decode_tokens_per_second": sum(a["decode_tokens"] for a in r["answers"])
            / sum(a["decode_seconds"] for a in r["answers"]),
        }
        for r in rounds
    ]
    out = {key: statistics.median(p[key] for p in per_round) for key in per_round[0]}
    out["per_round"] = per_round
    out["kv_held_bytes"] = max(a["kv_held_bytes"] or 0 for r in rounds for a in r["answers"])
    out["answers"] = [a["token_ids"] for a in rounds[0]["answers"]]
    return out


def ratio(figures: dict, ours: str, peer: str, key: str) -> dict:
    """ours / peer of `key`, per round: the median and the range."""
    values = [
        a[key] / b[key] if b[key] else None for a, b in zip(figures[ours]["per_round"], figures[peer]["per_round"])
    ]
    values = [v for v in values if v is not None]
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def floors(loaded, runners: list, job: Job, bandwidth: float) -> dict[str, dict]:
    """Each system's decode-step floor at the context's length (prefilled caches; llama.cpp by its KV type)."""
    out, tokens = {}, len(job.prefix_ids)
    weights = gguf_tensor_bytes(embedded_gguf_path())
    for r in runners:
        if isinstance(r, KvdemoRunner):
            out[r.name] = r.floor().to_dict()
        elif isinstance(r, LlamaCppRunner):
            out[r.name] = r.floor(weights, tokens, bandwidth).to_dict()
    for r in runners:  # the pattern and re-prefill decode on a DynamicCache of the same tokens
        out.setdefault(r.name, out[REFERENCE])
    return out


def print_context(name: str, result: dict) -> None:
    """The two tables of one context (see the module docstring)."""
    figures, reference = result["systems"], result["systems"][REFERENCE]["answers"]
    print(
        f"\n{name}: {result['context_tokens']:,} tokens, {len(result['questions'])} questions x "
        f"{result['max_new_tokens']} new tokens, {result['rounds']} rounds"
    )
    print(
        "| system | prefill s | s per answer | first token s | decode tokens/s | step ms | floor ms | step / floor "
        "| keeping the prefix, ms per question | KV held MiB | answers equal to kvdemo dynamic's |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for system, f in figures.items():
        step, floor = 1 / f["decode_tokens_per_second"], result["floors"][system]["floor_seconds"]
        same = sum(a == b for a, b in zip(f["answers"], reference))
        prefill = f"{f['prefill_seconds']:.2f}" if f["prefill_seconds"] else "in each answer"
        print(
            f"| {system} | {prefill} | {f['answer_seconds']:.2f} | {f['first_token_seconds']:.3f} | "
            f"{f['decode_tokens_per_second']:.1f} | {step * 1e3:.1f} | {floor * 1e3:.1f} | {step / floor:.1f} | "
            f"{f['mechanism_seconds'] * 1e3:.2f} | {f['kv_held_bytes'] / 2**20:.1f} | {same}/{len(reference)} |"
        )
    print(
        "\n| kvdemo / peer (per round: median [range]) | s per answer | decode tokens/s | prefill s | KV held "
        "| same answers |"
    )
    print("|---|---|---|---|---|---|")
    for ours, peer in PAIRS:
        if ours in figures and peer in figures:
            cells = []
            for key in ("answer_seconds", "decode_tokens_per_second", "prefill_seconds"):
                r = ratio(figures, ours, peer, key)
                cells.append(f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]" if r else "-")
            held = figures[peer]["kv_held_bytes"]
            cells.append(f"{figures[ours]['kv_held_bytes'] / held:.2f}" if held else "-")
            same = sum(a == b for a, b in zip(figures[ours]["answers"], figures[peer]["answers"]))
            cells.append(f"{same}/{len(figures[ours]['answers'])}")
            print(f"| {ours} / {peer} | " + " | ".join(cells) + " |")
    for backend, outcome in result["pattern_with_quantized_cache"].items():
        print(f"   transformers pattern with QuantizedCache({backend!r}): {outcome}")
    for what, why in result["skipped"].items():
        print(f"   {what} left out: {why}")


def run_context(loaded, name: str, paragraphs: str, args, bandwidth: float) -> dict:
    """Build the job for one context, run its rounds and gather its figures."""
    case = load_case(example_path(name)).select(paragraphs)
    questions = [q.question for q in case.answerable(args.questions)]
    job = Job.make(loaded, case.context, questions)
    log(f"{name} paragraphs {paragraphs}: {len(job.prefix_ids):,} tokens")
    outcomes = pattern_outcomes(loaded, job)
    runners, skipped = make_runners(loaded, job, args, outcomes)
    rounds = run_rounds(runners, job, args.rounds, args.max_new_tokens)
    return {
        "paragraphs": paragraphs,
        "context_tokens": len(job.prefix_ids),
        "questions": questions,
        "max_new_tokens": args.max_new_tokens,
        "rounds": args.rounds,
        "systems": {system: summary(r) for system, r in rounds.items()},
        "floors": floors(loaded, runners, job, bandwidth),
        "pattern_with_quantized_cache": outcomes,
        "skipped": skipped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--contexts",
        nargs="+",
        default=["southern_california:0-14", "normans:0-38"],
        help="article:paragraphs of the shipped cases (default: 1,996 and 5,603 tokens)",
    )
    parser.add_argument("--questions", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch's and llama.cpp's threads")
    parser.add_argument(
        "--reprefill-max-tokens",
        type=int,
        default=2500,
        help="re-prefill only contexts up to this many tokens (a whole prefill per question)",
    )
    parser.add_argument("--quick", action="store_true", help="one short context, 2 questions x 8 tokens, 1 round")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench" / "peers.json"))
    args = parser.parse_args()
    if args.quick:
        args.contexts, args.questions, args.max_new_tokens, args.rounds = ["southern_california:0-3"], 2, 8, 1
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    out: dict = {"load_average_start": os.getloadavg(), "threads": args.threads, "contexts": {}}
    loaded = load_model()
    bandwidth = probe_bandwidth()
    out["bandwidth_bytes_per_second"] = bandwidth
    for text in args.contexts:
        name, paragraphs = text.split(":")
        out["contexts"][text] = run_context(loaded, name, paragraphs, args, bandwidth)
        print_context(text, out["contexts"][text])
    out["load_average_end"], out["seconds"] = os.getloadavg(), time.perf_counter() - start
    print(
        f"\n{args.threads} thread(s); bandwidth {bandwidth / 1e9:.1f} GB/s (one copy at that thread count); load "
        f"average {out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}; {out['seconds']:.0f} s"
    )
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path}")


if __name__ == "__main__":
    main()
