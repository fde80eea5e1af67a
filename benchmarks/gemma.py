"""Gemma 3 270M (`make gemma`; 15 sliding-window + 3 full-attention layers) on one real text: the cache's bytes by
layer kind at about 2k and 8k tokens for each backend, the share the backend shrinks, the mean KL against `dynamic`
and two answers restored exactly. Written to `artifacts/bench/gemma.json` with the load average beside the figures.

The text is the GNU GPL v3 followed by the GNU FDL 1.3 (Debian's `/usr/share/common-licenses`): real prose that is
not one of kvdemo's cases, long enough for 8k tokens. The model is the base model, so its answers are not the point:
the KL is measured teacher-forced on `dynamic`'s own answers (`QASession.score`), and "restored" means each spec's
two answers leave the cache at its post-prefill length and its log-probabilities scored again after them are equal
bit for bit to the ones scored before (Δ 0).

    .venv/bin/python benchmarks/gemma.py            # about 25 minutes on 2 idle cores
    .venv/bin/python benchmarks/gemma.py --tokens 2048
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
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

SPECS = (
    "dynamic",
    "quanto:4",
    "hqq:4,rotation=hadamard",
    "fp8",
    "quanto:4,sliding=quantize",
    "hqq:4,rotation=hadamard,sliding=quantize",
    "fp8,sliding=quantize",
)
QUESTIONS = ("What does it mean to propagate a work?", "Which version of the license is this?")
TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/GFDL-1.3")
ANSWER_TOKENS = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    args = parser.parse_args()
    import torch

    from kvdemo.cache.spec import CacheSpec
    from kvdemo.evals.metrics import kl_divergence
    from kvdemo.qa.models import load_model
    from kvdemo.qa.packaged import gemma3_path
    from kvdemo.qa.session import QASession

    torch.set_num_threads(2)
    loaded = load_model(gemma3_path())
    text = "\n\n".join(Path(path).read_text() for path in TEXTS)
    ids = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    rows = []
    for tokens in args.tokens:
        context = loaded.tokenizer.decode(ids[:tokens])
        reference, answers = None, None
        for text_spec in SPECS:
            start = time.perf_counter()
            session = QASession(loaded, CacheSpec.parse(text_spec))
            report = session.prefill(context, max_new_tokens=ANSWER_TOKENS)
            length = session.cache_length
            if answers is None:  # dynamic: its answers are what every spec is scored on
                answers = [session.ask(q, max_new_tokens=ANSWER_TOKENS).token_ids for q in QUESTIONS]
            scores = [session.score(q, a) for q, a in zip(QUESTIONS, answers)]
            own = [session.ask(q, max_new_tokens=ANSWER_TOKENS) for q in QUESTIONS]
            again = [session.score(q, a) for q, a in zip(QUESTIONS, answers)]
            restored = session.cache_length == length and all(torch.equal(a, b) for a, b in zip(scores, again))
            if reference is None:
                reference = scores
            kl = torch.cat([kl_divergence(r, s) for r, s in zip(reference, scores)])
            delta = max(float((r - s).abs().max()) for r, s in zip(reference, scores))
            kinds = report.memory.bytes_by_kind()
            rows.append(
                dict(
                    tokens=length,
                    spec=session.spec.text,
                    bytes=report.memory.cache_bytes,
                    by_kind=kinds,
                    shrinkable_share=kinds["quantized"] / max(report.memory.cache_bytes, 1),
                    mean_kl=float(kl.mean()),
                    max_abs_delta_logp=delta,
                    restored_exactly=restored,
                    answers=[a.text for a in own],
                    seconds=round(time.perf_counter() - start, 1),
                    load_average=os.getloadavg()[0],
                )
            )
            row, mib = rows[-1], {kind: held / 2**20 for kind, held in kinds.items()}
            print(
                f"{length:>6} {row['spec']:<42} {row['bytes'] / 2**20:8.2f} MiB  quantized {mib['quantized']:7.2f}"
                f"  sliding {mib['sliding']:7.2f}  full {mib['full']:7.2f}  KL {row['mean_kl']:.2e}"
                f"  max|Δlogp| {delta:.3f}  restored {restored}  {row['seconds']} s  load {row['load_average']:.2f}",
                flush=True,
            )
    out = ROOT / "artifacts" / "bench" / "gemma.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2, ensure_ascii=False))
    print(f"written {out}")
    return 0 if all(row["restored_exactly"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
