"""The report of `benchmarks/run_all.py`: its tables printed as Markdown and its 2 x 2 figure, from the results
dict it writes to `artifacts/bench/results.json` (so a saved run can be printed again)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

MiB = 2**20


def median(values: Iterable[float]) -> float | None:
    """The median of `values`, None for none."""
    values = list(values)
    return statistics.median(values) if values else None


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def _s(s: float | None) -> str:
    return "-" if s is None else f"{s:.3f}"


def print_report(results: dict[str, Any]) -> None:
    """Print every table of a `run_all.py` results dict, in the order of docs/benchmarks.md."""
    cfg = results["config"]
    print(
        f"\nmodel: {results['model']}; {results['machine']['cpu']} ({results['machine']['cpu_cores']} cores, "
        f"{results['machine']['torch_threads']} torch threads), torch {results['machine']['torch']}; "
        f"load average {results['load_average_at_start'][0]:.1f} at the start, {results['load_average_at_end'][0]:.1f} "
        "at the end (above the core count, other processes shared the CPU)"
    )
    print(
        f"context: Normans paragraphs {cfg['paragraphs']} ({cfg['context_tokens']} tokens); {len(cfg['questions'])} "
        f"questions x {cfg['max_new_tokens']} new tokens; residual_length {results['config']['residual_length']}"
    )

    _print_restore(results)
    _print_bytes(results)
    _print_speed(results)
    _print_overhead(results)
    _print_startup(results)


def _print_restore(results: dict[str, Any]) -> None:
    print(
        "\n1-2. restore (kvdemo snapshot) against copy.deepcopy of the prefilled cache (transformers docs' "
        "prefix-cache pattern), per question (median)"
    )
    print(
        "| backend | restore s | deepcopy s | question s: restore | question s: deepcopy | extra MiB held: restore "
        "| extra MiB held: deepcopy | peak held / cache alone: restore | peak held / cache alone: deepcopy |"
        " same answers |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["backends"]:
        rs, dc = r["restore"], r["deepcopy"]
        peak_r = max(rs["peak_held_bytes"]) / max(rs["peak_cache_bytes"])
        if "error" in dc:
            dcells = [f"fails: {dc['error'][:70]}", "-", "-", "-"]
        else:
            dcells = [
                f"{median(dc['mechanism_seconds']):.4f}",
                f"{median(dc['seconds']):.2f}",
                _mib(max(dc["extra_bytes"])),
                f"{max(dc['peak_held_bytes']) / max(dc['peak_cache_bytes']):.3f}",
            ]
        cells = [
            r["backend"],
            f"{median(rs['mechanism_seconds']):.6f}",
            dcells[0],
            f"{median(rs['seconds']):.2f}",
            dcells[1],
            _mib(max(rs["extra_bytes"])),
            dcells[2],
            f"{peak_r:.3f}",
            dcells[3],
            r["same_answers"] if r["same_answers"] is not None else "-",
        ]
        print("| " + " | ".join(map(str, cells)) + " |")
    for r in results["backends"]:
        if r.get("device_allocated_peak_bytes"):
            print(
                f"   {r['backend']}: torch.cuda.memory_allocated peak during the answers "
                f"{_mib(r['device_allocated_peak_bytes'])} MiB (weights, cache, activations)"
            )
    print(
        "   (question s: restore goes through QASession.stream, which also reads telemetry at every step; the "
        "deepcopy answer is a bare loop)"
    )


def _print_bytes(results: dict[str, Any]) -> None:
    print(
        "\n3. KV bytes per token, measured (kvdemo.cache.state.telemetry) / theoretical (bits per value + a scale "
        "and a zero point per group + the residual)"
    )
    print(
        "| spec | bytes/token after prefill | theoretical | ratio | with a 3-token residual: ratio | "
        "ratio to full precision |"
    )
    print("|---|---|---|---|---|---|")
    for r in results["bytes_per_token"]:
        a, b = r["after prefill"], r["with a residual"]
        print(
            f"| {r['spec']} | {a['measured_bytes_per_token']:,.1f} | {a['theoretical_bytes_per_token']:,.1f} | "
            f"{a['ratio']:.3f} | {b['ratio']:.3f} | {a['ratio_to_full_precision']:.3f} |"
        )


def _print_speed(results: dict[str, Any]) -> None:
    base = next(r for r in results["backends"] if r["backend"] == "dynamic")
    print("\n4. decode speed (median seconds per decode step, step 0 left out), relative to dynamic")
    print("| backend | steps | flush steps | s/step without flush | x dynamic | s/flush step | tokens/s | x dynamic |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["backends"]:
        print(
            f"| {r['spec']} | {r['decode_steps']} | {r['flush_steps']} | {r['step_seconds']:.3f} | "
            f"{r['step_seconds'] / base['step_seconds']:.2f} | "
            f"{_s(r['flush_step_seconds'])} | "
            f"{r['decode_tokens_per_second']:.2f} | "
            f"{r['decode_tokens_per_second'] / base['decode_tokens_per_second']:.2f} |"
        )
    hqq = next(r for r in results["backends"] if r["backend"] == "hqq")
    if hqq["flush_step_seconds"] is not None:
        print(
            f"   hqq: a flush step on the {hqq['context_tokens']}-token context takes "
            f"{hqq['flush_step_seconds']:.2f} s "
            f"({hqq['flush_step_seconds'] / hqq['step_seconds']:.1f}x a step without a flush)"
        )


def _print_overhead(results: dict[str, Any]) -> None:
    print("\n5. the app's overhead: tokens/s against a bare decode loop (forward + argmax, no telemetry)")
    print(
        "| spec | tokens | bare | QASession.stream | stream + chart frames | overhead stream | "
        "overhead stream + charts |"
    )
    print("|---|---|---|---|---|---|---|")
    for o in results["overhead"]:
        t = o["tokens_per_second"]
        print(
            f"| {o['spec']} | {o['tokens']['bare']} | {t['bare']:.2f} | {t['stream']:.2f} | {t['stream_charts']:.2f} | "
            f"{o['overhead_stream']:+.1%} | {o['overhead_stream_charts']:+.1%} |"
        )
    print("   target: <= 5 % overhead with the charts")


def _print_startup(results: dict[str, Any]) -> None:
    s = results.get("startup")
    if s:
        print("\n6. start-up (fresh processes)")
        print("| what | load s (in load_model) | process s |")
        print("|---|---|---|")
        for key, label in (
            ("gguf", "embedded model from the GGUF (de-quantized)"),
            ("gguf_first_load_writing_copy", "first load: GGUF + writing the converted copy"),
            ("converted_copy", "later loads: the converted safetensors copy"),
        ):
            print(f"| {label} | {s[key]['load_seconds']:.2f} | {s[key]['wall_seconds']:.2f} |")
        print(
            f"   GGUF / converted copy: {s['gguf']['load_seconds'] / s['converted_copy']['load_seconds']:.1f}x "
            f"(load), {s['gguf']['wall_seconds'] / s['converted_copy']['wall_seconds']:.1f}x (process)"
        )
        print("| app.py | first page s | model loaded s |")
        print("|---|---|---|")
        for key, label in (("app_with_converted_copy", "with the converted copy"), ("app_gguf", "from the GGUF")):
            print(f"| {label} | {s[key]['first_page_seconds']:.1f} | {s[key]['model_loaded_seconds']:.1f} |")
        if "cli_help" in s:
            h = s["cli_help"]
            print(
                f"   python -m kvdemo --help: {h['help_seconds']:.2f} s (target < 2 s; the bare interpreter "
                f"{h['interpreter_seconds']:.2f} s, import torch alone {h['import_torch_seconds']:.2f} s: "
                f"{h['help_seconds'] / h['import_torch_seconds']:.2f}x)"
            )


def draw(results: dict[str, Any], folder: Path) -> list[Path]:
    """A 2 x 2 figure: extra bytes held per mechanism, bytes per token measured and theoretical, seconds per
    decode step with and without a flush, start-up seconds. Written as PNG and SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    rows = results["backends"]
    names = [r["backend"] for r in rows]
    x = range(len(rows))

    ax = axes[0][0]
    restore = [max(r["restore"]["extra_bytes"]) / MiB for r in rows]
    deep = [0 if "error" in r["deepcopy"] else max(r["deepcopy"]["extra_bytes"]) / MiB for r in rows]
    ax.bar([i - 0.2 for i in x], restore, 0.4, label="kvdemo restore")
    ax.bar([i + 0.2 for i in x], deep, 0.4, label="copy.deepcopy")
    for i, r in enumerate(rows):
        if "error" in r["deepcopy"]:
            ax.text(i + 0.2, 0, "fails", ha="center", va="bottom", rotation=90, fontsize=9)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("MiB")
    ax.set_title(f"extra KV bytes held while an answer decodes ({results['config']['context_tokens']} tokens)")
    ax.legend()

    ax = axes[0][1]
    bpt = results["bytes_per_token"]
    labels = [
        r["spec"]
        .replace(" q_group_size=64", "")
        .replace(f" residual_length={results['config']['residual_length']}", "")
        .replace("nbits=", "")
        for r in bpt
    ]
    ax.bar(
        [i - 0.2 for i in range(len(bpt))],
        [r["after prefill"]["measured_bytes_per_token"] for r in bpt],
        0.4,
        label="measured",
    )
    ax.bar(
        [i + 0.2 for i in range(len(bpt))],
        [r["after prefill"]["theoretical_bytes_per_token"] for r in bpt],
        0.4,
        label="theoretical",
    )
    ax.set_xticks(range(len(bpt)), labels, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("bytes per token (log)")
    ax.set_title("KV bytes per token")
    ax.legend()

    ax = axes[1][0]
    ax.bar([i - 0.2 for i in x], [r["step_seconds"] for r in rows], 0.4, label="step without a flush")
    ax.bar([i + 0.2 for i in x], [r["flush_step_seconds"] or 0 for r in rows], 0.4, label="step with a flush")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("seconds (median)")
    ax.set_title("seconds per decode step")
    ax.legend()

    _draw_startup(axes[1][1], results)
    m = results["machine"]
    fig.suptitle(f"kvdemo on {results['model']} - {m['cpu']}, {m['cpu_cores']} cores - {results['date']}", fontsize=10)
    fig.tight_layout()
    paths = [folder / "bench.png", folder / "bench.svg"]
    for path in paths:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return paths


def _draw_startup(ax, results: dict[str, Any]) -> None:
    """The start-up panel: seconds to load the model from the GGUF and from the copy, alone and in `app.py`."""
    s = results.get("startup")
    if s:
        bars = [
            ("GGUF load", s["gguf"]["load_seconds"]),
            ("copy load", s["converted_copy"]["load_seconds"]),
            ("app: model\n(GGUF)", s["app_gguf"]["model_loaded_seconds"]),
            ("app: model\n(copy)", s["app_with_converted_copy"]["model_loaded_seconds"]),
        ]
        ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["C1", "C0", "C1", "C0"])
        ax.set_ylabel("seconds")
        ax.set_title("start-up")
    else:
        ax.set_axis_off()
