"""Separate key and value precision (`nbits_value`, `kvdemo/cache/layers/precision.py`): which of keys and values a bit
buys most for, measured on the shipped articles and written to `artifacts/bench/precision.json` with the load
average beside the figures.

Each spec against `dynamic`, as `benchmarks/rotation.py` measures it (the same set-up, so the same-bits rows
repeat its table): the embedded model teacher-forced on the article's next paragraphs after the Ask tab's example
context, one decode step per token through each cache, q_group_size 64, residual_length 128, axes at their
defaults: KL(P_dynamic || P_spec) (mean, 99 %, same top token) and the perplexity's ratio to `dynamic`'s. Bytes
per token are the registry's formula (`estimate_kv_bytes`, which counts keys and values apart; tests check it
against the real tensors).

    .venv/bin/python benchmarks/precision.py           # both shipped articles: about 15 minutes on 2 cores
    .venv/bin/python benchmarks/precision.py --quick   # the Normans only, 64 tokens
    .venv/bin/python benchmarks/precision.py --spec hqq:4,axis_value=1   # other specs (precision-specs.json)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from rotation import fidelity, print_fidelity  # noqa: E402  (benchmarks/rotation.py)

from kvdemo import CacheSpec, load_model  # noqa: E402
from kvdemo.ui.examples import EXAMPLES  # noqa: E402

SPECS = [
    "quanto:4",
    "quanto:4,nbits_value=2",
    "quanto:2,nbits_value=4",
    "quanto:2",
    "quanto:4,nbits_value=2,rotation=hadamard",
    "quanto:2,nbits_value=4,rotation=hadamard",
    "hqq:8,nbits_value=4",
    "hqq:4,nbits_value=8",
    "hqq:4",
    "hqq:4,nbits_value=2",
    "hqq:2,nbits_value=4",
    "hqq:2",
]
"""Keys and values at the same bits, then each way round at the same bytes (K4/V2 against K2/V4)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--spec", action="append", help="measure these specs instead of SPECS (repeat for several)")
    args = parser.parse_args()
    loaded = load_model()
    tokens = 64 if args.quick else 256
    articles = ["Normans"] if args.quick else list(EXAMPLES)
    specs = [CacheSpec.parse(text) for text in args.spec or SPECS]
    out: dict = {"load_average_start": os.getloadavg(), "fidelity": {}}
    for article in articles:
        out["fidelity"][article] = fidelity(loaded, article, tokens, specs)
    out["load_average_end"] = os.getloadavg()
    print_fidelity(out["fidelity"])
    print(f"load average {out['load_average_start'][0]:.2f} -> {out['load_average_end'][0]:.2f}")
    path = ROOT / "artifacts" / "bench" / ("precision-specs.json" if args.spec else "precision.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
