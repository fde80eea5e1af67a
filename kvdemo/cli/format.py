"""What `python -m kvdemo` prints without `--json`: the readable summary of `ask`, the comparison's table and the
needle grid's tables (`kvdemo.cli.main` runs the jobs; this module only formats their records)."""

from __future__ import annotations

from typing import Any

import pandas as pd

from kvdemo.charts.reports import comparison_display_frame
from kvdemo.compare.recommendation import Recommendation
from kvdemo.compare.records import ComparisonReport


def format_needle(grid: Any) -> str:
    """The readable tables printed by `needle` without `--json`: per spec, depth rows x length columns with a
    tick (hit) or a cross (miss) and the score (nats), then one summary row per spec."""
    from kvdemo.charts.needle import needle_heatmap_frame

    table = grid.to_frame()
    lines = [
        f"model: {grid.model} on {grid.device}; seed {grid.seed}; needles per context: "
        f"{grid.needles_per_context or 'all depths'}; {grid.seconds:.1f} s"
    ]
    for spec in grid.specs:
        scores, hits = needle_heatmap_frame(table, spec, "score"), needle_heatmap_frame(table, spec, "hit")
        if scores.empty:
            continue
        shown = pd.DataFrame(
            [
                [
                    ("\u2713" if hits.at[d, n] >= 0.5 else "\u2717") + f" {scores.at[d, n]:.2f}"
                    if pd.notna(scores.at[d, n])
                    else ""
                    for n in scores.columns
                ]
                for d in scores.index
            ],
            index=[f"{d:g} %" for d in scores.index],
            columns=[f"{n:,} tokens" for n in scores.columns],
        )
        lines += [
            "",
            f"{spec}: hit (\u2713/\u2717) and log P(value) in nats, depth x context length",
            shown.to_string(),
        ]
    lines += ["", grid.summary_frame().to_string(index=False, float_format=lambda v: f"{v:.3f}")]
    return "\n".join(lines)


def format_summary(result: dict[str, Any]) -> str:
    """The readable summary printed without `--json`."""
    opts = " ".join(f"{k}={v}" for k, v in result["options"].items())
    lines = [
        f"model: {result['model']}",
        f"backend: {result['backend']} {opts}".rstrip(),
        f"prefill: {result['context_tokens']} tokens in {result['prefill_seconds']:.2f} s",
        *(
            [f"  opened from {opened['file']} in {opened['load_seconds']:.2f} s, no prefill run"]
            if (opened := result.get("session_opened"))
            else []
        ),
        *(
            [f"  saved to {saved['file']} ({saved['bytes']:,} bytes, {saved['seconds']:.2f} s)"]
            if (saved := result.get("session_saved"))
            else []
        ),
        f"KV cache: {result['kv_bytes']:,} bytes ({result['bytes_per_token']:.0f} bytes/token), "
        f"{result['ratio_to_full_precision']:.3f} x full precision ({result['full_precision_bytes']:,} bytes)",
    ]
    lines += [f"  deploy: {line}" for line in result.get("deploy") or ()]
    lines += [f"  {result['decode_read']}"] if result.get("decode_read") else []
    kinds = result.get("bytes_by_kind") or {}
    if any(held for kind, held in kinds.items() if kind != "quantized") and kinds.get("quantized"):
        lines.append("  by what holds it: " + ", ".join(f"{kind} {held:,} bytes" for kind, held in kinds.items()))
    if result.get("prompt_note"):
        lines.append(f"  prompt check: {result['prompt_note']}")
    if result.get("template_clock"):
        lines.append(
            f"  the chat template writes the date: every question reads the prefill's, {result['template_clock']}"
            " (a prefill on another day reads that day's)"
        )
    for i, a in enumerate(result["answers"], 1):
        lines += [
            "",
            f"Q{i}: {a['question']}",
            f"A{i}: {a['answer']}",
        ]
        if "gold_answers" in a:
            lines.append(f"    gold: {' | '.join(a['gold_answers'])}")
        lines.append(
            f"    {len(a['token_ids'])} tokens; question pass {a['question_seconds']:.2f} s ({a['question_tokens']} "
            f"tokens, {a['question_flushes']} flushes); decode {a['decode_tokens_per_second']:.1f} tokens/s; "
            f"{a['flushes']} flushes, "
            f"cache length after restore = {a['cache_length_after']} (context {result['context_tokens']})"
        )
    return "\n".join(lines)


def format_comparison(report: ComparisonReport) -> str:
    """The table printed without `--json`: `charts.comparison_display_frame` with its groups as a first header
    line, then a line on the perplexity's text when there was a perplexity run, and one per per-layer plan."""
    display = comparison_display_frame(report.to_frame(), grouped=True)
    with pd.option_context("display.width", 400, "display.max_columns", None, "display.max_colwidth", 60):
        text = display.to_string(index=False)
    ppl = next((r.perplexity for r in report.results if r.perplexity is not None), None)
    if ppl is not None:
        where = (
            "the text after the context"
            if report.perplexity_source == "continuation"
            else "the context's last tokens, held out of the prefill"
        )
        text += (
            f"\nperplexity: {ppl.tokens} tokens of {where}, fed one decode step each after a "
            f"{ppl.context_tokens}-token prefill"
        )
    for line in report.plans:
        text += f"\nper-layer plan: {line}"
    return text


def format_recommendation(found: Recommendation) -> str:
    """The table printed without `--json`: every measured candidate by bytes, then the pick, why, and how to deploy
    it."""
    with pd.option_context("display.width", 400, "display.max_columns", None, "display.max_colwidth", 70):
        table = found.to_frame().drop(columns="deploy").to_string(index=False, na_rep="")  # unmeasured: blank
    target = f"mean KL <= {found.limit:g}" if found.target == "max_kl" else f"<= {found.limit:,.0f} bytes per token"
    picked = found.picked
    lines = [
        table,
        "",
        f"{found.model}, {found.context_tokens:,} context tokens, {len(found.questions)} questions, target {target}, "
        f"engine {found.engine}: {len(found.rows)} candidates in {found.seconds:.0f} s",
        *(f"question {i}: {q}" for i, q in enumerate(found.questions, 1)),
        *([f"weights: {found.weights}"] if found.weights else []),
        f"pick: {found.pick}",
        f"why: {found.why}",
        *(f"deploy: {line}" for line in (picked.deploy if picked else ())),
    ]
    if found.plan:
        lines.append(f"plan: {found.plan}")
    if found.engine_check is not None:
        first, *rest = found.engine_check.lines()
        lines += ["verify: " + first, *rest]
    elif picked is not None and picked.llama_cpp_command:  # kvdemo's model of llama.cpp's cache, not llama.cpp
        lines.append(
            "verify: run it in llama.cpp itself with --engine llama.cpp --verify (on Gemma 3 270M llama.cpp read "
            "q5_1 at 3x kvdemo's KL: docs/recommend.md)"
        )
    lines.append("This holds for this model, this text and these questions; check it on another text (compare).")
    return "\n".join(lines)
