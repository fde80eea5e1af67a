"""Every backend and nbits on one context and a few questions: context tokens, KV bytes per context token,
the ratio to full precision, decode tokens/s and the answers. Prints a Markdown table; `--json` for JSON.

    .venv/bin/python benchmarks/backends_table.py --paragraphs 0-7 --questions 2
"""

from __future__ import annotations

import argparse
import json
import statistics

from kvdemo import BACKENDS, CacheSpec, QASession, load_model
from kvdemo.cases import example_path, load_case


def specs() -> list[CacheSpec]:
    """dynamic, then every nbits of the group-wise backends, then fp8 (registry order, defaults elsewhere)."""
    out = []
    for name, info in BACKENDS.items():
        nbits = info.options.get("nbits")
        out += [CacheSpec(name, nbits=n) for n in nbits.choices] if nbits else [CacheSpec(name)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", default="normans")
    parser.add_argument("--paragraphs", default="0-7")
    parser.add_argument("--questions", type=int, default=2, help="first N answerable questions of the case")
    parser.add_argument("--question", action="append", default=[], help="ask these instead")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    case = load_case(example_path(args.case)).select(args.paragraphs)
    questions = args.question or [q.question for q in case.answerable(args.questions)]
    loaded = load_model()
    rows = []
    for spec in specs():
        session = QASession(loaded, spec)
        report = session.prefill(case.context)
        answers = [session.ask(q, args.max_new_tokens) for q in questions]
        rows.append(
            {
                "spec": spec.label,
                "context_tokens": report.context_tokens,
                "prefill_seconds": round(report.seconds, 2),
                "kv_bytes": report.kv_bytes,
                "bytes_per_token": round(report.bytes_per_token, 1),
                "ratio_to_full_precision": round(report.ratio_to_full_precision, 4),
                "tokens_per_second": round(statistics.median(a.tokens_per_second for a in answers), 2),
                "flushes": sum(a.flush_count for a in answers),
                "answers": [a.text for a in answers],
                "cache_length_after": [a.cache_length_after for a in answers],
            }
        )
        print(f"done: {spec.label}", flush=True)
    if args.json:
        print(json.dumps({"model": loaded.name, "questions": questions, "rows": rows}, indent=2))
        return
    print(f"\nmodel: {loaded.name}; {args.case} paragraphs {args.paragraphs}; max_new_tokens {args.max_new_tokens}")
    for i, q in enumerate(questions, 1):
        print(f"Q{i}: {q}")
    header = ["spec", "context tokens", "KV bytes/token", "ratio to fp32", "decode tokens/s"] + [
        f"A{i}" for i in range(1, len(questions) + 1)
    ]
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for r in rows:
        cells = [r["spec"], r["context_tokens"], f"{r['bytes_per_token']:,.0f}", f"{r['ratio_to_full_precision']:.3f}",
                 f"{r['tokens_per_second']:.1f}"] + [a.replace("|", "/").replace("\n", " ") for a in r["answers"]]
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
