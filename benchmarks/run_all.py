"""kvdemo's figures, measured side by side in one run (`make bench`), printed as ratios and written to
`artifacts/bench/results.json` and `artifacts/bench/bench.png` (and `bench.svg`).

Sized for a 2-core CPU (about 3.5 minutes there): one context of the Normans article (paragraphs 0-11,
2,172 tokens with the chat template), two questions of 24 new tokens each, residual_length 16 so that
answers flush. Sections:

1. restore: kvdemo's `snapshot.take/restore` (as `QASession` uses them) against the transformers
   documentation's prefix-cache pattern (`copy.deepcopy` of the prefilled cache before each answer, the
   answer decoded on the copy): the mechanism's own seconds per question, each question's seconds, and the
   extra bytes held while an answer decodes; where deepcopy fails, the error.
2. memory during an answer: the peak bytes held by the cache and the restore mechanism, against the cache
   alone, for both mechanisms. Bytes are counted from the tensors really held (`kvdemo.cache.state.telemetry`), each
   storage once across the cache and what the mechanism keeps (the snapshot, or the prefilled original).
3. KV bytes per token per backend and nbits against the theoretical bytes (`theoretical_kv_bytes`).
4. decode speed per backend relative to `dynamic`: the median seconds of decode steps without a flush, and
   of steps with one (from `StepEvent.flushed_layers` and `StepEvent.seconds`); step 0 (the question's
   forward pass) is left out of both.
5. the app's overhead: tokens/s of `QASession.stream` with the chart frames the app builds at every step
   (`kvdemo.charts.steps`), and without them, against a bare decode loop (model forward + argmax on the same
   cache, restored afterwards, no telemetry), interleaved in rounds so that all see the same load.
6. start-up, each in a fresh process: loading the embedded model from its GGUF (de-quantized), the first
   load that also writes the converted safetensors copy, a later load from that copy; and `app.py` from
   launch to the first page and to the model loaded (its `model_status` API answers once it is).

    .venv/bin/python benchmarks/run_all.py            # everything
    .venv/bin/python benchmarks/run_all.py --quick    # shorter context and answers, no start-up section
"""

from __future__ import annotations

import argparse
import json
import os
import platform
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

from kvdemo import CacheSpec, QASession, load_model  # noqa: E402
from kvdemo.cache.model.geometry import full_precision_bytes  # noqa: E402
from kvdemo.cache.spec import build_cache, estimate_kv_bytes  # noqa: E402
from kvdemo.cache.state import snapshot  # noqa: E402
from kvdemo.cache.state.telemetry import kv_memory  # noqa: E402
from kvdemo.charts.steps import answers_frame, memory_frame, residual_frame, step_time_frame  # noqa: E402
from kvdemo.evals.cases import example_path, load_case  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_report import draw, median, print_report  # noqa: E402
from restore_mechanisms import answer_with_deepcopy, answer_with_restore, bare_decode  # noqa: E402
from startup import run_startup  # noqa: E402

RESIDUAL = 16
MAIN_SPECS = [
    CacheSpec("dynamic"),
    CacheSpec("quanto", nbits=4, residual_length=RESIDUAL),
    CacheSpec("hqq", nbits=4, residual_length=RESIDUAL),
    CacheSpec("fp8"),
]
NBITS_SPECS = (
    [CacheSpec("dynamic")]
    + [
        CacheSpec(b, nbits=n, residual_length=RESIDUAL)
        for b, bits in (("quanto", (2, 4)), ("hqq", (1, 2, 3, 4, 8)))
        for n in bits
    ]
    + [CacheSpec("fp8")]
)
OVERHEAD_QUESTION = "Tell me everything about the Normans."  # runs to max_new_tokens on this model


# ---- counting bytes -----------------------------------------------------------------------------------


def theoretical_kv_bytes(
    spec: CacheSpec, config, quantized_tokens: int, residual_tokens: int, dtype: torch.dtype
) -> int:
    """The bytes a cache of `spec` should hold by the group-wise formula with nominal bits:
    `kvdemo.cache.spec.estimate_kv_bytes(..., nominal_bits=True)` (formula and sources in its docstring). Bit
    packing (hqq packs 3-bit values 10 to an int32), padding and anything else a library stores count only in
    the measured bytes, so measured / theoretical shows them."""
    return estimate_kv_bytes(
        spec, config, quantized_tokens + residual_tokens, dtype, residual_tokens, nominal_bits=True
    )


# ---- the two restore mechanisms ---------------------------------------------------------------------


def run_backends(
    loaded, context: str, questions: list[str], max_new_tokens: int, overhead_rounds: int, overhead_tokens: int
) -> tuple[list[dict], list[dict], dict]:
    """Sections 1, 2, 4 and 5: one prefill per main backend, both mechanisms, the overhead rounds."""
    rows, overhead = [], []
    sessions = {}
    for spec in MAIN_SPECS:
        session = QASession(loaded, spec)
        report = session.prefill(context)
        restore = [answer_with_restore(session, q, max_new_tokens) for q in questions]
        deep = [answer_with_deepcopy(session, q, max_new_tokens) for q in questions]
        steps = [s for a in restore for s in a["steps"] if s[0] >= 1]
        row = {
            "spec": spec.label,
            "backend": spec.backend,
            "context_tokens": report.context_tokens,
            "prefill_seconds": report.seconds,
            "kv_bytes_after_prefill": report.kv_bytes,
            "restore": {
                k: [a[k] for a in restore]
                for k in ("seconds", "mechanism_seconds", "peak_cache_bytes", "peak_held_bytes", "extra_bytes")
            },
            "deepcopy": (
                {"error": deep[0]["error"]}
                if "error" in deep[0]
                else {
                    k: [a[k] for a in deep]
                    for k in ("seconds", "mechanism_seconds", "peak_cache_bytes", "peak_held_bytes", "extra_bytes")
                }
            ),
            "same_answers": None
            if "error" in deep[0]
            else all(r["token_ids"] == d["token_ids"] for r, d in zip(restore, deep)),
            "cache_length_after": [a["cache_length_after"] for a in restore],
            "device_allocated_peak_bytes": max((a["device_allocated_peak_bytes"] or 0) for a in restore) or None,
            "tokens": sum(len(a["token_ids"]) for a in restore),
            "decode_steps": len(steps),
            "flush_steps": sum(1 for s in steps if s[2]),
            "step_seconds": median(s[1] for s in steps if not s[2]),
            "flush_step_seconds": median(s[1] for s in steps if s[2]),
            "decode_tokens_per_second": len(steps) / sum(s[1] for s in steps) if steps else None,
        }
        rows.append(row)
        sessions[spec.backend] = session
        print(
            f"  {spec.label}: prefill {report.context_tokens} tokens in {report.seconds:.1f} s, "
            f"{row['decode_steps']} decode steps, {row['flush_steps']} with a flush",
            flush=True,
        )
    # dynamic: the fastest decode steps, so the largest relative overhead; fp8: a quantized cache without flushes.
    # (hqq, the app's default, is left out: its flush steps, ~1-80 s on 2 cores, swamp the overhead and the run time)
    for backend in ("dynamic", "fp8"):
        overhead.append(run_overhead(sessions[backend], overhead_rounds, overhead_tokens))
        print(f"  overhead on {sessions[backend].spec.label}: done", flush=True)
    return rows, overhead, sessions


def run_overhead(session: QASession, rounds: int, max_new_tokens: int) -> dict[str, Any]:
    """Section 5: tokens/s of the bare loop, of `QASession.stream`, and of the stream with the app's chart
    frames at every step, interleaved `rounds` times on the same prefilled cache."""
    loaded = session.loaded
    ids = session.question_ids(OVERHEAD_QUESTION)
    results: dict[str, list[float]] = {"bare": [], "stream": [], "stream_charts": []}
    tokens = {}
    for _ in range(rounds):
        saved = snapshot.take(session.cache)
        start = time.perf_counter()
        out = bare_decode(loaded, session.cache, ids, max_new_tokens)
        results["bare"].append(len(out) / (time.perf_counter() - start))
        snapshot.restore(session.cache, saved)
        tokens["bare"] = len(out)
        for name, charts in (("stream", False), ("stream_charts", True)):
            start, events = time.perf_counter(), []
            for event in session.stream(OVERHEAD_QUESTION, max_new_tokens):
                events.append(event)
                if charts:  # what the app's ask handler builds at every step
                    memory_frame(events), residual_frame(events), step_time_frame(events)
            if charts:
                answers_frame(a.to_dict() for a in session.history)
            results[name].append(len(events) / (time.perf_counter() - start))
            tokens[name] = len(events)
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "spec": session.spec.label,
        "tokens": tokens,
        "rounds": rounds,
        "tokens_per_second": med,
        "overhead_stream": med["bare"] / med["stream"] - 1,
        "overhead_stream_charts": med["bare"] / med["stream_charts"] - 1,
    }


def run_bytes_per_token(loaded, sessions: dict[str, QASession]) -> list[dict]:
    """Section 3. The post-prefill keys and values of the `dynamic` session are fed to a fresh cache of each
    spec with `Cache.update` (what the prefill's forward pass does: a quantized layer's first update
    quantizes what it is given and keeps no residual), then 3 more tokens (a residual of 3 tokens)."""
    dyn = sessions["dynamic"].cache
    tokens = dyn.get_seq_length()
    rows = []
    for spec in NBITS_SPECS:
        cache = build_cache(spec, loaded.config)
        for index, layer in enumerate(dyn.layers):
            cache.update(layer.keys, layer.values, index)
        states = {"after prefill": (tokens, 0)}
        measured = {"after prefill": kv_memory(cache).total_bytes}
        for index, layer in enumerate(dyn.layers):
            for t in range(3):
                cache.update(layer.keys[..., t : t + 1, :], layer.values[..., t : t + 1, :], index)
        report = kv_memory(cache)
        residual = report.layers[0].residual_tokens if spec.info.has_residual else 0
        states["with a residual"] = (report.seq_length - residual, residual)
        measured["with a residual"] = report.total_bytes
        row = {"spec": spec.label, "context_tokens": tokens}
        for state, (tq, tr) in states.items():
            theory = theoretical_kv_bytes(spec, loaded.config, tq, tr, loaded.dtype)
            row[state] = {
                "quantized_tokens": tq,
                "residual_tokens": tr,
                "measured_bytes": measured[state],
                "theoretical_bytes": theory,
                "measured_bytes_per_token": measured[state] / (tq + tr),
                "theoretical_bytes_per_token": theory / (tq + tr),
                "ratio": measured[state] / theory,
                "ratio_to_full_precision": measured[state] / full_precision_bytes(loaded.config, tq + tr, loaded.dtype),
            }
        rows.append(row)
    return rows


def machine() -> dict[str, Any]:
    import transformers

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paragraphs", default="0-11", help="Normans paragraphs (0-11: 2,172 tokens)")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--overhead-rounds", type=int, default=3)
    parser.add_argument("--overhead-tokens", type=int, default=24)
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--quick", action="store_true", help="paragraphs 0-3, 12 tokens, 1 round, no start-up")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench"))
    args = parser.parse_args()
    if args.quick:
        args.paragraphs, args.max_new_tokens, args.overhead_rounds, args.overhead_tokens = "0-3", 12, 1, 12
        args.skip_startup = True
    began = time.perf_counter()
    load_at_start = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    case = load_case(example_path("normans")).select(args.paragraphs)
    questions = [q.question for q in case.answerable(args.questions)]
    loaded = load_model()
    print(
        f"kvdemo benchmarks: {loaded.name} on {loaded.device} ({loaded.dtype}), loaded in {loaded.load_seconds:.1f} s "
        f"from {loaded.weights_from}",
        flush=True,
    )
    print("sections 1, 2, 4, 5: prefill and answers per backend", flush=True)
    rows, overhead, sessions = run_backends(
        loaded, case.context, questions, args.max_new_tokens, args.overhead_rounds, args.overhead_tokens
    )
    print("section 3: bytes per token", flush=True)
    bpt = run_bytes_per_token(loaded, sessions)
    sessions.clear()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model": loaded.name,
        "machine": machine(),
        "load_average_at_start": load_at_start,
        "config": {
            "paragraphs": args.paragraphs,
            "context_tokens": rows[0]["context_tokens"],
            "questions": questions,
            "max_new_tokens": args.max_new_tokens,
            "residual_length": RESIDUAL,
            "overhead_question": OVERHEAD_QUESTION,
            "overhead_tokens": args.overhead_tokens,
        },
        "backends": rows,
        "bytes_per_token": bpt,
        "overhead": overhead,
    }
    if not args.skip_startup:
        print("section 6: start-up (fresh processes)", flush=True)
        results["startup"] = run_startup()
    results["seconds"] = time.perf_counter() - began
    results["load_average_at_end"] = os.getloadavg()
    for r in rows:  # keep the JSON small: the per-step list is summarised above
        r.pop("steps", None)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    paths = draw(results, out)
    print_report(results)
    print(f"\nwritten: {out / 'results.json'}, {', '.join(map(str, paths))}; run time {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
