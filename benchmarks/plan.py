"""A per-layer plan (`kvdemo.evals.planner`) against uniform specs of the same bytes, on the shipped articles:
does spending the bits where the measured attention error is largest beat one precision for every layer?

For each article (the Ask tab's example context) and each (backend, budget) of `BUDGETS`, the planner chooses a
plan on that context; the plan, the best uniform spec the planner finds within the budget, and the field's usual
uniform specs of those bytes are then measured as `benchmarks/rotation.py` measures every spec: the embedded model
teacher-forced on the article's next paragraphs, one decode step per token through each cache (q_group_size 64,
residual_length 128), KL(P_dynamic || P_spec) (mean, 99 %, same top token) and the perplexity's ratio to
`dynamic`'s. Written to `artifacts/bench/plan.json` with the load average and the planner's seconds.

    .venv/bin/python benchmarks/plan.py           # both articles: about 15 minutes on 2 idle cores
    .venv/bin/python benchmarks/plan.py --quick   # the Normans only, 64 tokens
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rotation import fidelity, print_fidelity  # noqa: E402  (benchmarks/rotation.py)

from kvdemo import CacheSpec, load_model  # noqa: E402
from kvdemo.evals.cases import example_path, load_case  # noqa: E402
from kvdemo.evals.fidelity import perplexity_inputs  # noqa: E402
from kvdemo.evals.planner import choose_plan, layer_errors  # noqa: E402
from kvdemo.ui.examples import EXAMPLES  # noqa: E402

BUDGETS = {"quanto": (5040, 5760), "hqq": (5760, 7200)}
"""Bytes per quantized token on the embedded model: 4,320 is every value at 2 bits, 5,760 K4/V2 (or K2/V4), 7,200
K4/V4 (quanto's top: its plan there can only be quanto:4, so quanto is planned at 5,040, halfway to K4/V2)."""

UNIFORM = {
    "quanto": ["quanto:2,rotation=hadamard", "quanto:4,nbits_value=2,rotation=hadamard"],
    "hqq": [
        "hqq:4,nbits_value=2,rotation=hadamard",
        "hqq:2,nbits_value=4,rotation=hadamard",
        "hqq:4",
        "hqq:4,rotation=hadamard",
    ],
}
"""The field's uniform specs at those bytes, measured beside the plans (the planner's own best uniform is added)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    loaded = load_model()
    tokens = 64 if args.quick else 256
    articles = ["Normans"] if args.quick else list(EXAMPLES)
    out: dict = {"load_average_start": os.getloadavg(), "plans": {}, "fidelity": {}}
    for article in articles:
        stem, paragraphs = EXAMPLES[article]
        case = load_case(example_path(stem)).select(paragraphs)
        ids = list(perplexity_inputs(loaded, case.context, tokens, case.continuation).context_ids)
        specs: dict[str, CacheSpec] = {}
        out["plans"][article] = {}
        for backend, budgets in BUDGETS.items():
            start = time.perf_counter()
            errors = layer_errors(loaded, ids, CacheSpec(backend))
            seconds = time.perf_counter() - start
            for budget in budgets:
                plan = choose_plan(errors, budget)
                print(f"{article}: {plan.summary()} (measured in {seconds:.1f} s)", flush=True)
                out["plans"][article][f"{backend}@{budget}"] = {
                    "plan": plan.spec.text,
                    "bytes_per_token": plan.bytes_per_token,
                    "error": plan.error,
                    "uniform": plan.uniform.text if plan.uniform else None,
                    "uniform_error": plan.uniform_error,
                    "measure_seconds": seconds,
                }
                specs |= {s.text: s for s in (plan.spec, plan.uniform) if s is not None}
            specs |= {text: CacheSpec.parse(text) for text in UNIFORM[backend]}
        out["fidelity"][article] = fidelity(loaded, article, tokens, list(specs.values()))
    out["load_average_end"] = os.getloadavg()
    print_fidelity(out["fidelity"])
    print(f"load average {out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}")
    path = ROOT / "artifacts" / "bench" / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
