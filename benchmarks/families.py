"""Per model family (`tests/families.py`: one tiny random model each, 4 layers), per quantized spec: the share of the
cache the backend quantizes (layers, and bytes after the prefill) and its fidelity against `dynamic` (mean KL and
max |Δ log p|, teacher-forced on `dynamic`'s answers to two questions on the Normans' first paragraph). The models
are random, so the fidelity figures say how far each cache moves a model of that shape, not how a trained one
answers. Written to `artifacts/bench/families.json` with the load average.

    .venv/bin/python benchmarks/families.py      # about 3 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ANSWER_TOKENS = 6


def main() -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from kvdemo.cache.model.layer_kinds import layer_types, quantized_layers
    from kvdemo.cache.spec import CacheSpec
    from kvdemo.evals.cases import example_path, load_case
    from kvdemo.evals.metrics import kl_divergence
    from kvdemo.qa.models import LoadedModel, load_model
    from kvdemo.qa.session import QASession
    from tests.families import FAMILIES, SPECS, family_config, verdict

    torch.set_num_threads(1)
    tokenizer = load_model().tokenizer
    case = load_case(example_path("normans"))
    context, questions = case.paragraphs[0], [q.question for q in case.questions[:2]]
    rows = []
    for family in FAMILIES:
        config = family_config(family)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        loaded = LoadedModel(model, tokenizer, family, None, 1024, torch.device("cpu"), torch.float32, frozenset({2}))
        dynamic = QASession(loaded, SPECS[0])
        dynamic.prefill(context, max_new_tokens=ANSWER_TOKENS, chunk_tokens=64)
        answers = [dynamic.ask(q, max_new_tokens=ANSWER_TOKENS).token_ids for q in questions]
        reference = [dynamic.score(q, a) for q, a in zip(questions, answers)]
        for spec in SPECS[1:]:
            reason = verdict(spec, config)
            row = dict(family=family, spec=spec.text, layers=len(layer_types(config)))
            row["quantized_layers"] = len(quantized_layers(config, spec.sliding or "keep"))
            if reason is not None:
                rows.append(dict(row, refused=reason[:120]))
                print(f"{family:<22} {spec.text:<28} refused", flush=True)
                continue
            session = QASession(loaded, CacheSpec.parse(spec.text))
            report = session.prefill(context, max_new_tokens=ANSWER_TOKENS, chunk_tokens=64)
            scores = [session.score(q, a) for q, a in zip(questions, answers)]
            kl = torch.cat([kl_divergence(r, s) for r, s in zip(reference, scores)])
            kinds = report.memory.bytes_by_kind()
            row.update(
                quantized_bytes_share=kinds["quantized"] / max(report.memory.cache_bytes, 1),
                mean_kl=float(kl.mean()),
                max_abs_delta_logp=max(float((r - s).abs().max()) for r, s in zip(reference, scores)),
                context_tokens=report.context_tokens,
                load_average=os.getloadavg()[0],
            )
            rows.append(row)
            print(
                f"{family:<22} {spec.text:<28} quantized {row['quantized_layers']} layers, "
                f"{row['quantized_bytes_share']:.0%} of bytes; KL {row['mean_kl']:.2e}; "
                f"max|Δlogp| {row['max_abs_delta_logp']:.3f}",
                flush=True,
            )
    out = ROOT / "artifacts" / "bench" / "families.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2))
    print(f"written {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
