"""The needle-in-a-haystack grid of docs/needle.md, measured in one run (`kvdemo.needle.grid`).

Runs the grid (default: dynamic, hqq:2, hqq:4, quanto:4 and fp8 on the embedded model, lengths 1024, 2048, 4096
and 7936 tokens, depths 0, 25, 50, 75 and 100 %, every depth of a length in one context), then the same grid
for `--one-per-context` specs with one needle per context (the classic grid: one prefill per cell), to show
what sharing a prefill costs in hits and score and saves in seconds. Prints the tables; writes the grids as
JSON and CSV into `--out` and the heatmap (graded score, hits marked) to `--svg`.

    .venv/bin/python benchmarks/needle_grid.py                 # about an hour on 2 CPU cores
    .venv/bin/python benchmarks/needle_grid.py --quick         # a few minutes: 2 specs, lengths 512 and 1024
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvdemo import load_model  # noqa: E402
from kvdemo.charts.needle import needle_heatmap_figure  # noqa: E402
from kvdemo.cli.format import format_needle  # noqa: E402
from kvdemo.needle.grid import needle_grid  # noqa: E402
from kvdemo.needle.inputs import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_SPECS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", action="append", help=f"default: {' '.join(DEFAULT_SPECS)}")
    parser.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    parser.add_argument("--depths", default=",".join(f"{d:g}" for d in DEFAULT_DEPTHS))
    parser.add_argument(
        "--one-per-context",
        action="append",
        default=None,
        help="specs to run again with one needle per context (default: dynamic; 'none' for none)",
    )
    parser.add_argument("--quick", action="store_true", help="dynamic and hqq:2, lengths 512,1024, depths 0,50,100")
    parser.add_argument("--out", default="artifacts/needle")
    parser.add_argument("--svg", default="benchmarks/needle.svg")
    args = parser.parse_args()
    specs = args.spec or (["dynamic", "hqq:2"] if args.quick else list(DEFAULT_SPECS))
    lengths = [512, 1024] if args.quick else [int(n) for n in args.lengths.split(",")]
    depths = [0, 50, 100] if args.quick else [float(d) for d in args.depths.split(",")]
    apart = [s for s in (args.one_per_context or ["dynamic"]) if s != "none"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    loaded = load_model()
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {loaded.name} on {loaded.device} ({loaded.dtype}); load average "
        f"{os.getloadavg()[0]:.1f} at the start",
        flush=True,
    )

    def progress(done: int, total: int, what: str) -> None:
        if "prefilling" in what:
            print(f"  [{time.perf_counter() - start:7.0f} s] {done}/{total} {what}", file=sys.stderr, flush=True)

    grid = needle_grid(loaded, specs, lengths, depths, on_progress=progress)
    grid.write(out, "grid")
    print(format_needle(grid), flush=True)
    shared = "one needle per context" if len(depths) == 1 else f"{len(depths)} needles per context"
    figure = needle_heatmap_figure(
        grid.to_frame(),
        title=f"Needle in a haystack, {loaded.name.split(' ')[0]} on "
        f"{loaded.device.type.upper()} ({shared}): log P(number) in nats, "
        "\u2713 hit / \u2717 miss",
    )
    figure.savefig(args.svg, format=Path(args.svg).suffix.lstrip(".") or "svg", metadata={"Date": None})
    print(f"\nheatmap: {args.svg}", flush=True)

    if apart:
        single = needle_grid(loaded, apart, lengths, depths, needles_per_context=1, on_progress=progress)
        single.write(out, "one_per_context")
        print("\nOne needle per context (one prefill per cell):")
        print(format_needle(single))
        both = pd.concat(
            [
                grid.summary_frame().assign(needles="all depths in one context"),
                single.summary_frame().assign(needles="one per context"),
            ]
        )
        both = both[both["spec text"].isin(single.specs)]
        print("\nSeveral needles per context against one:")
        print(both.to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    print(f"\ntotal {time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
