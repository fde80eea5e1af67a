"""Command line.

`python -m kvdemo ask ...` prefills a context once and answers questions in turn over a chosen KV cache
backend, printing a summary or (with `--json`) one JSON object. `python -m kvdemo compare ...` runs the same
context and questions over several backends (`kvdemo.compare.run`) and prints a table or (with `--json`) the report.
`python -m kvdemo needle ...` runs a needle-in-a-haystack grid (`kvdemo.needle.grid`): context lengths x needle
depths per backend, hits and graded scores, as tables or (with `--json`) the grid. `python -m kvdemo recommend ...`
measures every candidate spec on the text and prints the pick for a KL ceiling or a byte budget, with its deploy line
(`kvdemo.compare.recommend`). Exit status: `main`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvdemo import checks
from kvdemo.cache.catalogue import default_compare_specs, examples
from kvdemo.cache.deploy import ENGINES
from kvdemo.cache.registry import (
    BACKENDS,
    GROUP_OPTIONS,
    SPEC_OPTIONS,
    backends_help,
    option_choices_text,
    presets_help,
)
from kvdemo.cache.spec import CacheSpec
from kvdemo.cli.ask import case_questions, run_ask
from kvdemo.needle import inputs as needle
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS

# The parser reads only modules that load no torch, so `--help` answers in well under 2 s; a run imports what it
# runs (the model, the comparison, the grid, the tables) in the function that runs it.
if TYPE_CHECKING:
    from tqdm.auto import tqdm

    from kvdemo.compare.recommendation import Recommendation
    from kvdemo.compare.records import ComparisonReport
    from kvdemo.needle.records import NeedleGrid


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of `python -m kvdemo`."""
    parser = argparse.ArgumentParser(
        prog="python -m kvdemo",
        description="Ask several questions over one prefilled context with a (quantized) KV cache.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ask = sub.add_parser(
        "ask",
        help="prefill a context once, answer questions in turn, restore the cache after each",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Prefill the context once into the chosen KV cache, then answer each question on top of it;\n"
        "after every answer the cache is restored to its post-prefill state (cache_length_after).\n\n"
        "Backends (options left unset take the default shown):\n" + backends_help(),
    )
    _context_arguments(ask, required=False)
    ask.add_argument(
        "--backend", choices=list(BACKENDS), help="KV cache backend (default dynamic; with --session the file's)"
    )
    ask.add_argument(
        "--preset", help=f"a preset of the backend, its options (the ones given beside it change it); {presets_help()}"
    )
    for name in SPEC_OPTIONS:  # each option's help and allowed values from the registry
        option = next(b.options[name] for b in BACKENDS.values() if name in b.options)
        kind = str.lower if option.is_text else int  # a word (flush) or a whole number
        ask.add_argument(f"--{name.replace('_', '-')}", type=kind, help=f"{option.help} ({option_choices_text(name)})")
    ask.add_argument(
        "--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="most tokens per answer (default 64)"
    )
    ask.add_argument("--model", help="a Hub id, a local folder or a .gguf file (default: the embedded SmolLM2-135M)")
    ask.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    ask.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    ask.add_argument(
        "--save-session", metavar="PATH", help="after the prefill, save the session to PATH (a .kvsession file)"
    )
    ask.add_argument(
        "--session",
        metavar="PATH",
        help="open a saved session instead of prefilling: its context, spec and model (--model and the spec's "
        "options, when given, must be the file's)",
    )
    _progress_arguments(ask)
    _compare_parser(sub)
    _needle_parser(sub)
    _recommend_parser(sub)
    return parser


def _compare_parser(sub: Any) -> None:
    """The `compare` subcommand's arguments (the default specs from `kvdemo.cache.catalogue`)."""
    compare = sub.add_parser(
        "compare",
        help="the same context and questions over several backends: memory, fidelity against dynamic and gold, speed",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Prefill the context and answer the questions once per --spec, one backend at a time, dynamic\n"
        "first (always included). Per spec: KV bytes after the prefill, bytes per context token, ratio to dynamic;\n"
        "answers identical to dynamic's, common prefix (tokens); over every position of dynamic's answers, both\n"
        "teacher-forced on them: KL divergence to dynamic (mean, median, 99%, 99.9%, max; nats/token), same top token\n"
        "(%), RMS delta p (%),\n"
        "|delta log p| of dynamic's token (named as llama.cpp's --kl-divergence report names them); the relative\n"
        "error of the de-quantized keys and values after the prefill and its drift across flushes; with\n"
        "--perplexity-tokens N the perplexity of the N tokens after the context fed one decode step each, and its\n"
        "ratio to dynamic's; exact match, gold containment and F1 (SQuAD normalisation) when the case file gives\n"
        "gold answers (an unanswerable question counts right only when the answer says the text does not say);\n"
        "prefill seconds, decode tokens/s, seconds of the decode steps that flushed; cache length after restore.\n"
        "The table is the short one (MiB, ratios; columns without values left out); --json gives everything.\n\n"
        "Spec syntax: backend[:nbits][,option=value...] or backend:preset[,option=value...] with the options\n"
        f"{', '.join(GROUP_OPTIONS[1:])} (unset ones take the defaults below), e.g.\n"
        "  --spec dynamic --spec hqq:4 --spec quanto:2,q_group_size=32,residual_length=16 --spec fp8\n"
        "  --spec quanto:4,nbits_value=2 (keys at 4 bits, values at 2)\n"
        f"  {presets_help()}\n"
        "  --spec quanto,plan=k4v2h*20+k2v2h*10 (a per-layer plan: each layer's key and value bits, h rotated)\n"
        "--plan-budget BYTES chooses one on this context within BYTES per token, compared beside the best uniform one\n"
        f"Default specs: {' '.join(s.text for s in default_compare_specs())}\n\nBackends:\n" + backends_help(),
    )
    _context_arguments(compare)
    compare.add_argument(
        "--unanswerable-from-case",
        type=int,
        metavar="N",
        help="case files: also ask the first N questions the text does not answer (SQuAD 2.0 is_impossible)",
    )
    compare.add_argument("--spec", action="append", default=[], help="a spec to compare (repeat for several)")
    compare.add_argument(
        "--plan-budget",
        type=float,
        action="append",
        default=[],
        metavar="BYTES",
        help="also compare a per-layer plan chosen on this context within BYTES per context token (at its length, "
        "kept layers such as sliding windows included; repeat for "
        "several; e.g. 5760, quanto:4,nbits_value=2's bytes on the embedded model), and the best uniform spec within "
        "the same bytes",
    )
    plan_base = examples("plan_base")[0]
    plan_help = f"the backend and options a plan keeps (default {plan_base}; e.g. hqq,q_group_size=32)"
    compare.add_argument("--plan-base", default=plan_base, metavar="SPEC", help=plan_help)
    compare.add_argument("--max-new-tokens", type=int, default=32, help="most tokens per answer (default 32)")
    compare.add_argument(
        "--perplexity-tokens",
        type=int,
        default=0,
        metavar="N",
        help="also measure the perplexity of N tokens read through each cache: for a case file the paragraphs after "
        "the chosen ones (or, when none follow, the context's last N+1 tokens held out of the prefill); for a text "
        "file its last N+1 tokens (default 0: none)",
    )
    compare.add_argument(
        "--model", help="a Hub id, a local folder or a .gguf file (default: the embedded SmolLM2-135M)"
    )
    compare.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    compare.add_argument("--json", action="store_true", help="print the report as one JSON object instead of a table")
    _progress_arguments(compare)


def _needle_parser(sub: Any) -> None:
    """The `needle` subcommand's arguments (the grid's defaults, from `kvdemo.needle.inputs`)."""
    parser = sub.add_parser(
        "needle",
        help="needle in a haystack: a fact hidden at depths of contexts of several lengths, per backend",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description='Hide a short fact ("The special magic number for <invented name> is <6 digits>.") at each\n'
        "--depths % of the shipped SQuAD articles' text, in contexts of exactly --lengths tokens, prefill each\n"
        "context into every --spec's cache and ask for the number. Per cell: hit (the answer holds the number),\n"
        "the graded score log P(number | context, question, answer prefix) in nats (0 = certain, about -13.8 =\n"
        "a guess), the answer, and the seconds of the prefill (shared by the needles of one context), the\n"
        "answer and the scoring. By default the needles of every depth of a length share one prefill per spec\n"
        "(--needles-per-context 1: one prefill per cell, the classic grid, slower).\n\n"
        "Example (about 2 minutes on 2 CPU cores):\n"
        "  python -m kvdemo needle --spec dynamic --spec hqq:2 --lengths 512,1024 --depths 0,50,100\n\n"
        f"Defaults: --spec {' --spec '.join(needle.DEFAULT_SPECS)} --lengths "
        f"{','.join(map(str, needle.DEFAULT_LENGTHS))} --depths {','.join(f'{d:g}' for d in needle.DEFAULT_DEPTHS)}"
        "\n(about an hour on 2 CPU cores). Spec syntax as for compare: backend[:nbits][,option=value...].",
    )
    parser.add_argument("--spec", action="append", default=[], help="a spec to run (repeat for several)")
    parser.add_argument("--lengths", help="context lengths in tokens, comma-separated (the chat template included)")
    parser.add_argument("--depths", help="needle depths in %% of the haystack, comma-separated, 0 to 100")
    parser.add_argument(
        "--needles-per-context",
        type=int,
        metavar="N",
        help="needles sharing one prefill (default: every depth of a length in one context)",
    )
    parser.add_argument("--seed", type=int, default=0, help="draws the needles' names and numbers (default 0)")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=needle.DEFAULT_MAX_NEW_TOKENS,
        help=f"most tokens per answer (default {needle.DEFAULT_MAX_NEW_TOKENS})",
    )
    parser.add_argument("--model", help="a Hub id, a local folder or a .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="print the grid as one JSON object instead of tables")
    parser.add_argument("--csv", metavar="PATH", help="also write the table of cells as CSV to PATH")
    _progress_arguments(parser)


def _recommend_parser(sub: Any) -> None:
    """The `recommend` subcommand's arguments (its defaults from `kvdemo.compare.recommend`, read without torch)."""
    parser = sub.add_parser(
        "recommend",
        help="which KV setting for this model on this text: every candidate measured, the pick and its deploy line",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Prefill the text once into dynamic, answer the questions, then measure every candidate spec the\n"
        "registry gives for --engine against dynamic (teacher-forced KL on its answers, same top token, perplexity of\n"
        "the text's held-out end, bytes per token), fewest bytes first, each until its own answer tokens prove it\n"
        "over the ceiling (a bound: every token's KL is >= 0) or to the end. The pick: the fewest bytes within\n"
        "--max-kl (default 0.02 nats/token), or the lowest KL within --bytes-per-token; with its deploy line and\n"
        "why. Without --question, questions are taken from the text.\n"
        "Example (about a minute on 2 idle CPU cores):\n"
        "  python -m kvdemo recommend --context-file kvdemo/data/cases/normans.json --paragraphs 0-4",
    )
    _context_arguments(parser)  # no question: taken from the text
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--max-kl", type=float, help="the mean-KL ceiling to dynamic, nats/token (default 0.02)")
    target.add_argument("--bytes-per-token", type=float, help="a KV budget per context token instead")
    parser.add_argument(
        "--engine", default="any", choices=["any", *ENGINES], help="only specs this engine stores the same way"
    )
    parser.add_argument("--no-plan", action="store_true", help="measure no per-layer plan (kvdemo's own)")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="with --engine llama.cpp and a .gguf model: run the pick in llama.cpp itself (llama-cpp-python, `make "
        "bench-peers`) on the same ids against its f16 cache, flash attention on in both, and print its KL beside "
        "kvdemo's (about 3 more passes of the text)",
    )
    parser.add_argument("--model", help="a Hub id, a local folder or a .gguf file (default: the embedded SmolLM2-135M)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--json", action="store_true", help="print every measured row as one JSON object")
    _progress_arguments(parser)


def _progress_arguments(parser: argparse.ArgumentParser) -> None:
    """`--no-progress` and `--progress`: whether the run draws progress bars on stderr (the model's loading bar
    and kvdemo's own). By default it does, except with `--json`, whose output a program reads (`--progress`
    brings them back)."""
    bars = parser.add_mutually_exclusive_group()
    bars.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    bars.add_argument("--progress", action="store_true", help="progress bars on stderr also with --json")


def _context_arguments(parser: argparse.ArgumentParser, required: bool = True) -> None:
    parser.add_argument(
        "--context-file",
        required=required,
        help="a UTF-8 text file (- reads standard input), or a SQuAD case file (JSON with 'paragraphs', e.g. "
        "kvdemo/data/cases/normans.json)" + ("" if required else "; or give --session"),
    )
    parser.add_argument("--paragraphs", help="case files: paragraphs to use, e.g. 0-7 or 0,2,5-7 (default: all)")
    parser.add_argument("--question", action="append", default=[], help="a question (repeat for several)")
    parser.add_argument(
        "--questions-from-case",
        type=int,
        metavar="N",
        help="case files: also ask the first N answerable questions about the chosen paragraphs",
    )


def run_compare(args: argparse.Namespace) -> ComparisonReport:
    """Run the `compare` command and return its report.

    Raises:
        ValueError, ImportError, OSError: bad input; the message says what to change.
    """
    specs = [CacheSpec.parse(text) for text in args.spec] or default_compare_specs()
    plans = [(CacheSpec.parse(args.plan_base), budget) for budget in args.plan_budget]
    checks.max_new_tokens(args.max_new_tokens)
    if args.perplexity_tokens < 0:
        raise ValueError(f"--perplexity-tokens {args.perplexity_tokens}: it must be >= 0 (0: no perplexity)")
    case, questions = case_questions(args)
    golds = [case.gold_for(q) for q in questions]
    gold_answers = None if any(g is None for g in golds) else [list(g) for g in golds]
    with _long_job(args) as job, _ProgressBar(args.no_progress) as on_progress:
        return job.compare(
            case.context,
            questions,
            specs,
            args.max_new_tokens,
            gold_answers,
            on_progress=on_progress,
            perplexity_tokens=args.perplexity_tokens,
            continuation=case.continuation,
            plans=plans,
        )


def run_recommend(args: argparse.Namespace) -> Recommendation:
    """Run the `recommend` command and return its `Recommendation`.

    Raises:
        ValueError, OSError: bad input (checked before the model loads where it can be); the message says what to
            change.
    """
    from kvdemo.compare.recommend import check_target
    from kvdemo.evals.cases import load_case
    from kvdemo.qa.text import check_question

    check_target(args.max_kl, args.bytes_per_token)
    gguf = _verify_gguf(args)
    case = load_case(args.context_file).select(args.paragraphs)
    questions = [check_question(q, f"--question number {i}") for i, q in enumerate(args.question, 1)]
    if args.questions_from_case is not None:
        if args.questions_from_case < 1 or not case.questions:
            raise ValueError("--questions-from-case needs N >= 1 and a case file with questions")
        questions += [q.question for q in case.answerable(args.questions_from_case)]
    with _long_job(args) as job, _ProgressBar(args.no_progress) as on_progress:
        found = job.recommend(
            case.context,
            questions,
            max_kl=args.max_kl,
            bytes_per_token=args.bytes_per_token,
            engine=args.engine,
            plans=not args.no_plan,
            on_progress=on_progress,
        )
    if gguf is None:
        return found
    if found.picked is None or found.picked.llama_cpp_command is None:
        print(f"--verify: the pick is {found.pick}, llama.cpp's f16 cache: nothing quantized to run", file=sys.stderr)
        return found
    from dataclasses import replace

    from kvdemo.compare.llama_cpp_check import verify

    if not args.no_progress:
        print(f"running {found.pick} in llama.cpp beside its f16 and q8_0 caches ...", file=sys.stderr)
    return replace(found, engine_check=verify(found, gguf))


def _verify_gguf(args: argparse.Namespace) -> Path | None:
    """`--verify`'s GGUF file (None without it), checked before the model loads.

    Raises:
        ValueError, ImportError, OSError: --verify without --engine llama.cpp, without llama-cpp-python, or with a
            model that is not a .gguf file.
    """
    if not args.verify:
        return None
    if args.engine != "llama.cpp":
        raise ValueError(f"--verify runs the pick in llama.cpp; add --engine llama.cpp (not {args.engine})")
    from kvdemo.compare.llama_cpp_check import check_available, check_gguf

    gguf = check_gguf(args.model)
    check_available()
    return gguf


def run_needle(args: argparse.Namespace) -> NeedleGrid:
    """Run the `needle` command and return its `NeedleGrid`.

    Raises:
        ValueError, ImportError, OSError: bad input; the message says what to change.
    """
    specs = [CacheSpec.parse(text) for text in (args.spec or needle.DEFAULT_SPECS)]
    lengths = needle.parse_lengths(args.lengths) if args.lengths is not None else list(needle.DEFAULT_LENGTHS)
    depths = needle.parse_depths(args.depths) if args.depths is not None else list(needle.DEFAULT_DEPTHS)
    if args.csv is not None and not Path(args.csv).expanduser().parent.is_dir():
        raise ValueError(f"--csv {args.csv}: the folder {Path(args.csv).expanduser().parent} does not exist")
    with _long_job(args) as job, _ProgressBar(args.no_progress) as on_progress:
        return job.needle(
            specs,
            lengths,
            depths,
            args.max_new_tokens,
            needles_per_context=args.needles_per_context,
            seed=args.seed,
            on_progress=on_progress,
        )


@contextmanager
def _long_job(args: argparse.Namespace) -> Iterator[Any]:
    """The loaded model's door (`kvdemo.serve.door.Door`, as the page's) and a long job in its one session."""
    from kvdemo.qa.models import load_model
    from kvdemo.serve.server import App
    from kvdemo.serve.store import API_KEY

    door = App.serving(load_model(args.model, device=args.device)).door
    with door.long_job(API_KEY, "a long job is already running") as job:
        yield job


class _ProgressBar:
    """A context manager giving an `on_progress(done, total, what)` that draws one tqdm bar on stderr (none
    when `off`), closed on exit."""

    def __init__(self, off: bool):
        self.off = off
        self.bar: tqdm | None = None

    def __enter__(self):
        def on_progress(done: int, total: int, what: str) -> None:
            if self.off:
                return
            if self.bar is None:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True)
            self.bar.set_description(what, refresh=False)
            self.bar.update(done - self.bar.n)

        return on_progress

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status (`python -m kvdemo` exits with it): 0, 2 on bad input, 1 on a failure at
    run time, with the message on stderr. With `--json` (unless `--progress`) or `--no-progress`, stderr gets no
    progress bar, transformers' "Loading weights" bar included (`kvdemo.quiet`, for the run only)."""
    from kvdemo.quiet import quiet

    parser = build_parser()
    args = parser.parse_args(argv)
    given: str | None = getattr(args, "context_file", None)  # checked before any heavy import: under a second
    if given is not None and given != "-" and not Path(given).expanduser().is_file():
        print(f"error: --context-file {given}: no such file", file=sys.stderr)
        return 2
    args.no_progress = args.no_progress or (args.json and not args.progress)
    if args.no_progress:
        quiet()
    try:
        if args.command == "compare":
            report = run_compare(args)
        elif args.command == "needle":
            grid = run_needle(args)
        elif args.command == "recommend":
            found = run_recommend(args)
        else:
            result = run_ask(args)
    except (ValueError, ImportError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:  # a failure at run time (the model's forward pass, a library): a message, exit 1
        print(f"error: the run failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    finally:
        if args.no_progress:
            quiet(False)  # transformers' defaults again (main() also runs inside other processes: the tests)
    from kvdemo.cli.format import format_comparison, format_needle, format_recommendation, format_summary

    if args.command == "recommend":
        print(found.to_json() if args.json else format_recommendation(found))
        return 0

    if args.command == "needle":
        if args.csv:
            try:
                Path(args.csv).write_text(grid.to_csv(), encoding="utf-8")
            except OSError as error:
                print(f"error: could not write --csv {args.csv}: {error}", file=sys.stderr)
                return 2
        print(grid.to_json() if args.json else format_needle(grid))
        return 0
    if args.command == "compare":
        print(report.to_json() if args.json else format_comparison(report))
        return 0
    print(json.dumps(result, indent=2, ensure_ascii=False) if args.json else format_summary(result))
    return 0
