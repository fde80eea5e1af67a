"""Compact weights on this CPU (issue 25, goal 5), measured side by side in one process and written to
`artifacts/bench/weights.json` with the load average beside the figures. Nothing here is adopted by the app: the
float32 model stays the reference.

1. Per decode step of the embedded model over a `dynamic` cache of the Normans example's context (1,341 tokens
   with the chat template), one thread, the decode steps of real answers in interleaved rounds: float32 (the
   reference), bfloat16 (`load_model(dtype=torch.bfloat16)`), and optimum-quanto's weight-only qint8 and qint4
   (`optimum.quanto.quantize(model, weights=...)` + `freeze`, the library's own classes, on a copy of the float32
   model). Each step's floor is the bytes it must read (the weights as stored + the KV cache) over the bandwidth
   measured with one thread.
2. The greedy answers of each variant to the example's three questions (24 new tokens), against float32's.
3. Per matrix-vector product (one thread): the embedded model's four weight shapes (the LM head 49,152 x 576 and
   the layers' 1,536 x 576, 576 x 1,536, 576 x 576) in float32, bfloat16, and torch's packed int8 weight-only
   kernel (`torch.ops.aten._weight_int8pack_mm`, per-row scales) with float32 and bfloat16 activations. This part
   quantizes random weights by hand only to time the kernel; no answer comes from it.

    .venv/bin/python benchmarks/weights.py           # about 4 minutes on 2 cores
    .venv/bin/python benchmarks/weights.py --quick   # 256 tokens, 2 rounds, one question
"""

from __future__ import annotations

import argparse
import copy
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

from flush import log  # noqa: E402  (benchmarks/flush.py's helper)

from kvdemo import QASession, load_model  # noqa: E402
from kvdemo.cache.state.speedlimit import probe_bandwidth, speed_limit  # noqa: E402
from kvdemo.evals.cases import example_path, load_case  # noqa: E402
from kvdemo.qa.models import LoadedModel  # noqa: E402
from kvdemo.ui.examples import EXAMPLES  # noqa: E402

SHAPES = [(49152, 576), (1536, 576), (576, 1536), (576, 576)]
"""The embedded model's weight shapes (out, in): the LM head, gate/up, down, q/o projections."""


def stored_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as stored: every tensor of the state dict once (quanto's packed data and scales
    included; a tied embedding once)."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def variants(reference: LoadedModel) -> dict[str, LoadedModel]:
    """float32 (the reference), bfloat16, quanto qint8 and qint4 weights (copies of the float32 model)."""
    from optimum.quanto import freeze, qint4, qint8, quantize

    out = {"float32": reference, "bfloat16": load_model(dtype=torch.bfloat16)}
    for name, qtype in (("quanto qint8", qint8), ("quanto qint4", qint4)):
        model = copy.deepcopy(reference.model)
        quantize(model, weights=qtype)
        freeze(model)
        out[name] = LoadedModel(
            model,
            reference.tokenizer,
            name,
            None,
            reference.max_context_tokens,
            reference.device,
            reference.dtype,
            reference.eos_token_ids,
        )
    return out


def gemv(repeats: int) -> dict:
    """Milliseconds per product for each of `SHAPES`, each format (medians)."""

    def timed(call) -> float:
        call()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    out = {}
    for rows, cols in SHAPES:
        torch.manual_seed(0)
        w, x = torch.randn(rows, cols), torch.randn(1, cols)
        wb, xb = w.bfloat16(), x.bfloat16()
        scales = w.abs().amax(dim=1) / 127
        w8 = (w / scales[:, None]).round().clamp(-128, 127).to(torch.int8)
        calls = {
            "float32": lambda x=x, w=w: x @ w.T,
            "bfloat16": lambda x=xb, w=wb: x @ w.T,
            "int8 float32": lambda x=x, w=w8, s=scales: torch.ops.aten._weight_int8pack_mm(x, w, s),
            "int8 bfloat16": lambda x=xb, w=w8, s=scales.bfloat16(): torch.ops.aten._weight_int8pack_mm(x, w, s),
        }
        out[f"{rows}x{cols}"] = {name: timed(call) for name, call in calls.items()}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rounds, new_tokens = (2, 8) if args.quick else (3, 24)
    out: dict = {"load_average_start": os.getloadavg(), "threads": 1}
    reference = load_model()
    stem, paragraphs = EXAMPLES["Normans"]
    case = load_case(example_path(stem)).select(paragraphs)
    questions = [q.question for q in case.questions][: 1 if args.quick else 3]
    context = case.context
    if args.quick:  # its first 256 tokens, the same text for every variant (one tokenizer)
        context = reference.tokenizer.decode(QASession(reference).context_ids(context)[:256])
    sessions = {}
    for name, loaded in variants(reference).items():
        log(f"prefill {name}")
        sessions[name] = QASession(loaded)
        sessions[name].prefill(context)
    answers: dict[str, list] = {name: [] for name in sessions}
    times: dict[str, list[float]] = {name: [] for name in sessions}
    for round_ in range(rounds):  # every question on every variant, interleaved; a step = 1 / decode tokens/s
        for question in questions:
            for name, session in sessions.items():
                answer = session.ask(question, new_tokens)
                times[name].append(1 / answer.decode_tokens_per_second)
                if round_ == 0:
                    answers[name].append(answer.token_ids)
        log(f"round {round_ + 1}: " + ", ".join(f"{n} {statistics.median(t) * 1000:.1f} ms" for n, t in times.items()))
    bandwidth = probe_bandwidth()
    rows = {}
    for name, session in sessions.items():
        step = statistics.median(times[name])
        limit = speed_limit(session.loaded.model, session.cache, bandwidth=bandwidth)
        weights = stored_bytes(session.loaded.model)
        floor = (weights + limit.kv_bytes) / bandwidth
        same = sum(a == b for a, b in zip(answers[name], answers["float32"]))
        rows[name] = {
            "step_seconds": step,
            "weight_bytes": weights,
            "kv_bytes": limit.kv_bytes,
            "floor_seconds": floor,
            "same_answers": same,
            "answers": len(questions),
        }
    out |= {"context_tokens": sessions["float32"].cache_length, "bandwidth": bandwidth, "steps": rows}
    out["gemv_ms"] = gemv(31 if not args.quick else 5)
    out["load_average_end"] = os.getloadavg()
    base = rows["float32"]["step_seconds"]
    print(f"\n{out['context_tokens']:,} context tokens, 1 thread, bandwidth {bandwidth / 1e9:.1f} GB/s")
    print(f"{'weights':14} {'MB':>7} {'step ms':>8} {'x f32':>6} {'floor ms':>9} {'step/floor':>10} same answers")
    for name, row in rows.items():
        print(
            f"{name:14} {row['weight_bytes'] / 1e6:7.1f} {row['step_seconds'] * 1000:8.1f} "
            f"{row['step_seconds'] / base:6.2f} {row['floor_seconds'] * 1000:9.1f} "
            f"{row['step_seconds'] / row['floor_seconds']:10.1f} {row['same_answers']}/{row['answers']}"
        )
    print(f"\n{'GEMV (ms)':14} " + " ".join(f"{k:>13}" for k in next(iter(out["gemv_ms"].values()))))
    for shape, row in out["gemv_ms"].items():
        print(f"{shape:14} " + " ".join(f"{v:13.3f}" for v in row.values()))
    print(f"load average {out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}")
    path = ROOT / "artifacts" / "bench" / "weights.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
