"""python -m kvdemo: the issue's command, the summary, --help and bad input (exit 2, message on stderr).

Cost: 98 s for 52 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvdemo import CacheSpec
from kvdemo.cli.main import main
from kvdemo.compare.run import compare
from kvdemo.evals.cases import example_path, load_case
from kvdemo.evals.fidelity import perplexity, perplexity_inputs

NORMANS = str(example_path("normans"))


def test_ask_json_on_the_normans_case(embedded, capsys):
    code = main(
        [
            "ask",
            "--context-file",
            NORMANS,
            "--paragraphs",
            "0-7",
            "--question",
            "Who was the Norse leader?",
            "--question",
            "When was the Duchy of Normandy founded?",
            "--backend",
            "hqq",
            "--nbits",
            "4",
            "--residual-length",
            "16",
            "--max-new-tokens",
            "32",
            "--json",
        ]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct (embedded GGUF Q4_1)"
    assert result["backend"] == "hqq"
    assert result["options"] == {
        "nbits": 4,
        "nbits_value": 4,  # unset: nbits's
        "q_group_size": 64,
        "residual_length": 16,
        "axis_key": 0,
        "axis_value": 0,
        "flush": "requantize",
        "rotation": "none",
        "optimize": "true",
        "sliding": "keep",  # sliding-window layers (none here) at full precision
        "protect": "0:0",  # no edge layer kept at full precision
    }
    assert result["deploy"] == [  # transformers' own QuantizedCache stores it; then kvdemo's line
        'transformers: model.generate(..., cache_implementation="quantized", cache_config={"backend": "hqq", '
        '"nbits": 4, "residual_length": 16})',
        "kvdemo: python -m kvdemo ask --backend hqq --nbits 4 --residual-length 16 ...; in Python "
        'CacheSpec.parse("hqq:4,residual_length=16")',
    ]
    tokens = result["context_tokens"]
    assert 1300 < tokens < 1400
    assert result["full_precision_bytes"] == 2 * 30 * 3 * 64 * 4 * tokens
    assert 0.1 < result["kv_bytes"] / result["full_precision_bytes"] < 0.25
    assert len(result["answers"]) == 2
    for answer in result["answers"]:
        assert answer["cache_length_after"] == tokens
        assert 1 <= answer["steps"] == len(answer["token_ids"]) <= 32
        assert len(answer["flushes_per_layer"]) == 30 and answer["flushes"] == sum(answer["flushes_per_layer"]) > 0
        assert answer["seconds"] > 0 and answer["answer"]
    assert "Rollo" in result["answers"][0]["answer"]


def test_summary_with_questions_from_the_case(embedded, capsys):
    code = main(
        [
            "ask",
            "--context-file",
            NORMANS,
            "--paragraphs",
            "0",
            "--questions-from-case",
            "2",
            "--backend",
            "fp8",
            "--max-new-tokens",
            "8",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "backend: fp8" in out and "Q2: " in out and "gold: " in out
    tokens = int(out.split("prefill: ")[1].split(" tokens")[0])
    assert out.count(f"cache length after restore = {tokens} (context {tokens})") == 2


def test_ask_saves_a_session_and_opens_it_without_a_prefill(embedded, capsys, tmp_path):
    path = str(tmp_path / "normans.kvsession")
    ask = ["ask", "--question", "In what country is Normandy located?", "--max-new-tokens", "6", "--json"]
    first = ["--context-file", NORMANS, "--paragraphs", "0", "--backend", "quanto", "--nbits", "4"]
    assert main([*ask, *first, "--save-session", path]) == 0
    made = json.loads(capsys.readouterr().out)
    assert made["session_saved"]["file"] == path and made["session_saved"]["bytes"] > made["kv_bytes"]
    assert made["session_opened"] is None
    assert main([*ask, "--session", path]) == 0
    opened = json.loads(capsys.readouterr().out)
    assert opened["session_opened"]["file"] == path and opened["session_saved"] is None
    assert opened["options"] == made["options"] and opened["context_tokens"] == made["context_tokens"]
    assert opened["prefill_seconds"] == made["prefill_seconds"]  # the prefill that made the file
    assert [a["token_ids"] for a in opened["answers"]] == [a["token_ids"] for a in made["answers"]]
    assert main([*ask[:-1], "--session", path]) == 0
    assert f"opened from {path} in " in capsys.readouterr().out
    for args, message in (
        (["--session", path, "--backend", "hqq"], "holds a `quanto:4` cache, not `hqq`: choose `quanto:4`"),
        (["--session", path, *first[:2]], "give --context-file to prefill, or --session"),
        ([], "give --context-file (the text to prefill) or --session"),
        (["--session", str(tmp_path / "none.kvsession")], "is not a file"),
        (["--session", NORMANS], "is not a session file, or it was cut short"),
        (["--session", path, "--questions-from-case", "1"], "give --question with --session"),
    ):
        assert main([*ask, *args]) == 2, args
        assert message in capsys.readouterr().err, args


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "quanto", "--nbits", "3"], "error: nbits=3 is not allowed for quanto; allowed: 2, 4"),
        (
            ["--backend", "fp8", "--residual-length", "4"],
            "error: residual_length=4 is not an option of the fp8 backend",
        ),
        (["--paragraphs", "9-3"], "error: paragraphs='9-3': this file has paragraphs 0 to 38"),
        (["--paragraphs", "x"], "error: paragraphs='x': write ranges like 0-7"),
        (["--questions-from-case", "0"], "error: --questions-from-case must be >= 1"),
    ],
)
def test_bad_options_exit_2_with_a_message(args, message, capsys):
    assert main(["ask", "--context-file", NORMANS, "--question", "Who?", *args]) == 2
    assert message in capsys.readouterr().err


def test_bad_context_files(tmp_path, capsys):
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00\x81binary")
    assert main(["ask", "--context-file", str(binary), "--question", "Who?"]) == 2
    assert "is not UTF-8 text" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert main(["ask", "--context-file", str(empty), "--question", "Who?"]) == 2
    assert "is empty; give a file with the context text" in capsys.readouterr().err
    plain = tmp_path / "context.txt"
    plain.write_text("Rollo led the Vikings.")
    assert main(["ask", "--context-file", str(plain), "--questions-from-case", "2"]) == 2
    assert "has no questions; --questions-from-case needs a case file" in capsys.readouterr().err
    assert main(["ask", "--context-file", str(plain)]) == 2
    assert "no question: give --question" in capsys.readouterr().err
    assert main(["ask", "--context-file", str(tmp_path / "missing.txt"), "--question", "Who?"]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"paragraphs": ["Text."], "questions": [{"q": 1}]}', "'questions' must be a list of"),
        ('{"paragraphs": ["Rollo led the Norse."], "questions": "abc"}', "'questions' must be a list of"),
        ('{"paragraphs": [null, 5]}', "needs a non-empty 'paragraphs' list of strings"),
        ('{"paragraphs": []}', "needs a non-empty 'paragraphs' list of strings"),
        ("[1, 2]", "is JSON but not a case file"),
    ],
)
def test_malformed_case_files(tmp_path, capsys, content, message):
    path = tmp_path / "case.json"
    path.write_text(content)
    assert main(["ask", "--context-file", str(path), "--question", "Who?"]) == 2
    assert message in capsys.readouterr().err


def test_bad_device_and_token_counts(embedded, capsys):
    assert main(["ask", "--context-file", NORMANS, "--question", "Who?", "--device", "tpu"]) == 2
    assert "device='tpu' is not a device; use cpu or cuda" in capsys.readouterr().err
    assert main(["ask", "--context-file", NORMANS, "--question", "Who?", "--max-new-tokens", "0"]) == 2
    assert "max_new_tokens=0 must be a whole number >= 1" in capsys.readouterr().err
    args = [
        "ask",
        "--context-file",
        NORMANS,
        "--paragraphs",
        "0",
        "--question",
        "Who?",
        "--max-new-tokens",
        "100000000",
    ]
    assert main(args) == 2
    assert (
        "leaves no room for a context in the model's 8,192-token window; lower max_new_tokens"
        in capsys.readouterr().err
    )


@pytest.mark.process
@pytest.mark.model
@pytest.mark.process
@pytest.mark.parametrize("extra, bar", [((), False), (("--progress",), True)])
def test_json_runs_print_no_progress_bar_unless_asked(extra, bar):
    """`--json` output is read by programs: stderr stays empty, transformers' "Loading weights" bar included, unless
    `--progress` asks for the bars (a process of its own: the model loads in it, as from a shell)."""
    command = [sys.executable, "-m", "kvdemo", "ask", "--context-file", NORMANS, "--paragraphs", "0"]
    command += ["--question", "Who?", "--max-new-tokens", "2", "--json", *extra]
    run = subprocess.run(command, capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.loads(run.stdout)["answers"][0]["cache_length_after"] > 0
    assert ("Loading weights" in run.stderr) is bar and (run.stderr == "") is not bar


@pytest.mark.process
@pytest.mark.parametrize(
    "argv, status, message",
    [
        (["ask", "--question", ""], 2, "--question number 1 is empty; type a question about the context"),
        (["ask", "--question", "Who?", "--context-file", "/no/such/file.txt"], 2, "/no/such/file.txt"),
        (["ask", "--question", "Who?", "--backend", "hqq", "--q-group-size", "7"], 2, "q_group_size=7 must divide"),
        (["ask", "--question", "Who?", "--model", "{not a model}"], 2, "error: "),
    ],
    ids=["empty-question", "missing-file", "q_group_size-7", "bad-model"],
)
def test_python_m_kvdemo_exits_with_mains_status(argv, status, message):
    """`python -m kvdemo` as a shell runs it: bad input exits 2 with the message on stderr and nothing on stdout. Only
    the q_group_size is checked against the model (its head_dim), so only it loads the embedded model; the others are
    refused before."""
    command = [sys.executable, "-m", "kvdemo", *argv]
    if "--context-file" not in argv:
        command += ["--context-file", NORMANS]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert run.returncode == status, (run.returncode, run.stderr[-2000:])
    assert message in run.stderr and run.stdout == ""
    assert ("Loading weights" in run.stderr) is ("--q-group-size" in argv)


@pytest.mark.process
@pytest.mark.parametrize("command", ["ask", "compare", "recommend"])
def test_a_missing_context_file_is_refused_before_any_heavy_import(command, tmp_path):
    """Issue 67: a missing --context-file exits 2 at once, without importing torch (the imports take seconds)."""
    script = (
        "import sys; from kvdemo.cli.main import main; status = main(sys.argv[1:]); "
        "print(status, 'torch' in sys.modules)"
    )
    missing = str(tmp_path / "missing.txt")
    run = subprocess.run(
        [sys.executable, "-c", script, command, "--context-file", missing, "--question", "Who?"],
        capture_output=True, text=True, timeout=60, env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )  # fmt: skip
    assert run.stdout.split() == ["2", "False"], run.stderr[-2000:]
    assert f"--context-file {missing}: no such file" in run.stderr


def test_a_context_from_standard_input(monkeypatch):
    """`--context-file -` reads standard input: a text, or a case file's JSON."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Rollo led the Vikings.\n")))
    case = load_case("-")
    assert case.context == "Rollo led the Vikings.\n" and case.source == "standard input" and not case.questions
    normans = Path(NORMANS).read_bytes()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(normans)))
    assert load_case("-").questions == load_case(NORMANS).questions
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"  ")))
    with pytest.raises(ValueError, match="standard input is empty"):
        load_case("-")


def test_a_failure_at_run_time_is_a_message_and_status_1(monkeypatch, capsys):
    """A fault past the input checks (here the model's load raising a RuntimeError) is a one-line message and exit
    status 1, never a traceback."""
    from kvdemo.qa import models

    def failing_load(*args, **kwargs):
        raise RuntimeError("injected failure in the model's load")

    monkeypatch.setattr(models, "load_model", failing_load)
    status = main(["ask", "--context-file", NORMANS, "--question", "Who?"])
    err = capsys.readouterr().err
    assert status == 1
    assert err.strip() == "error: the run failed: RuntimeError: injected failure in the model's load"


HEAVY = ("torch", "transformers", "optimum.quanto", "hqq", "gradio", "pandas", "matplotlib")
"""What `--help` must not import (issue 25: it took 17.5 s when the parser came after them)."""


@pytest.mark.parametrize("command", ["", "ask", "compare", "needle"])
def test_help_loads_no_model_library(command):
    """Every `--help` is printed by a process that imported none of `HEAVY` (read from the process itself, after
    argparse printed the help and before it exits), and `import kvdemo` alone loads none of them either."""
    probe = (
        "import atexit, sys\n"
        f"atexit.register(lambda: print('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr))\n"
        "import runpy\n"
        f"sys.argv = ['kvdemo', *{command.split()!r}, '--help']\n"
        "runpy.run_module('kvdemo', run_name='__main__')\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "usage: python -m kvdemo" in done.stdout
    assert "LOADED []" in done.stderr, done.stderr
    bare = subprocess.run(
        [sys.executable, "-c", f"import sys, kvdemo; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert bare.stdout.strip() == "[]"


def test_the_public_names_load_on_first_use():
    """`kvdemo`'s public names (PEP 562 `__getattr__`): each is its module's object, `__all__` lists exactly the
    lazy table, and a name that is not public is an AttributeError as for any module."""
    import kvdemo
    from kvdemo.qa.session import QASession

    assert sorted(kvdemo.__all__) == sorted([*kvdemo._PUBLIC, "quiet"])
    assert kvdemo.QASession is QASession and "QASession" in dir(kvdemo)
    for name in kvdemo._PUBLIC:
        assert getattr(kvdemo, name) is getattr(__import__(kvdemo._PUBLIC[name], fromlist=[name]), name)
    with pytest.raises(AttributeError, match="has no attribute 'session_of_nobody'"):
        kvdemo.session_of_nobody  # noqa: B018


def test_help_explains_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "kvdemo", "ask", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for option in (
        "--context-file",
        "--paragraphs",
        "--question",
        "--questions-from-case",
        "--backend",
        "--nbits",
        "--q-group-size",
        "--residual-length",
        "--axis-key",
        "--axis-value",
        "--max-new-tokens",
        "--json",
        "--progress",
        "--no-progress",
    ):
        assert option in out
    assert "hqq: QuantizedCache(backend='hqq')" in out and "nbits 1|2|3|4|8 (default 4)" in out


def test_compare_json_on_the_normans_case(embedded, capsys):
    code = main(
        [
            "compare",
            "--context-file",
            NORMANS,
            "--paragraphs",
            "0",
            "--questions-from-case",
            "1",
            "--unanswerable-from-case",
            "1",
            "--spec",
            "hqq:4,residual_length=2",
            "--spec",
            "fp8",
            "--max-new-tokens",
            "4",
            "--json",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert captured.err == ""  # --json: no progress bar unless --progress
    report = json.loads(captured.out)
    assert [r["spec_text"] for r in report["results"]] == ["dynamic", "hqq:4,residual_length=2", "fp8"]
    assert report["max_new_tokens"] == 4
    dynamic, hqq, fp8 = report["results"]
    assert [q["answerable"] for q in dynamic["questions"]] == [True, False]  # gold from the case file
    assert all(q["kl_nats"] == 0.0 for q in dynamic["questions"]) and dynamic["ratio_to_dynamic"] == 1.0
    assert dynamic["kv_bytes"] == 2 * 30 * 3 * 64 * 4 * dynamic["context_tokens"]
    assert hqq["flushes"] > 0 and all(r["restored"] for r in report["results"])
    assert 0.1 < hqq["ratio_to_dynamic"] < 0.2 and fp8["ratio_to_dynamic"] == pytest.approx(0.25, abs=0.01)


def test_compare_plans_per_layer_within_a_budget(embedded, capsys):
    argv = ["compare", "--context-file", NORMANS, "--paragraphs", "0", "--question", "Who was the Norse leader?"]
    argv += ["--spec", "quanto:4", "--plan-budget", "5760", "--max-new-tokens", "2", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    plan = re.search(
        r"per-layer plan: (quanto,plan=\S+): 5,760 bytes per token at [0-9,]+ tokens \(budget 5,760\)", out
    )
    assert plan is not None and plan.group(1) in out.splitlines()[4]  # the plan's row after dynamic and quanto:4
    layers = CacheSpec.parse(plan.group(1)).plan.split("+")
    assert sum(int(run.partition("*")[2] or 1) for run in layers) == 30  # one precision per layer of SmolLM2
    assert "the best uniform spec within it, quanto:4," in out


def test_compare_table_and_progress_bar(embedded, capsys):
    assert (
        main(
            [
                "compare",
                "--context-file",
                NORMANS,
                "--paragraphs",
                "0",
                "--question",
                "Who?",
                "--spec",
                "fp8",
                "--max-new-tokens",
                "2",
            ]
        )
        == 0
    )
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    # the short table: a line of groups, a line of headers, one row per spec; no gold, perplexity or drift columns
    assert lines[0].split() == ["memory", "fidelity", "speed"] and len(lines) == 4
    headers = lines[1]
    assert headers.split()[:3] == ["spec", "KV", "MiB"] and "same top %" in headers and "99% KLD" in headers
    assert "F1" not in headers and "PPL" not in headers and "drift" not in headers
    assert lines[2].split()[0] == "dynamic" and lines[3].split()[0] == "fp8"
    assert (
        "| 0/6 [" in captured.err and "6/6" in captured.err
    )  # tqdm knows the total: 2 specs x (prefill + answer + score)


def test_compare_perplexity_on_the_next_paragraphs(embedded, capsys, monkeypatch):
    import kvdemo.compare.run

    reports = []

    def keep(*args, **kwargs):
        reports.append(compare(*args, **kwargs))
        return reports[-1]

    monkeypatch.setattr(kvdemo.compare.run, "compare", keep)  # where the command imports it from when it runs
    code = main(
        [
            "compare",
            "--context-file",
            NORMANS,
            "--paragraphs",
            "0",
            "--question",
            "Who?",
            "--spec",
            "hqq:2",
            "--max-new-tokens",
            "2",
            "--perplexity-tokens",
            "16",
            "--json",
            "--no-progress",
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert out == reports[0].to_json() + "\n"  # --json prints the report's own JSON
    report = json.loads(out)
    assert report["perplexity_source"] == "continuation"
    dynamic, hqq = report["results"]
    assert dynamic["perplexity"]["tokens"] == 16 and dynamic["perplexity"]["ratio_to_dynamic"] == 1.0
    case = load_case(NORMANS).select("0")
    inputs = perplexity_inputs(embedded, case.context, 16, case.continuation)
    assert dynamic["perplexity"]["perplexity"] == pytest.approx(
        perplexity(embedded, CacheSpec("dynamic"), inputs).perplexity, rel=1e-6
    )
    assert hqq["nbits"] == 2 and hqq["options"]["residual_length"] == 128 and hqq["perplexity"]["ratio_to_dynamic"] > 1
    assert len(hqq["kv_error"]["keys"]) == 30 and len(hqq["kv_error"]["keys"][0]) == 3  # layers x KV heads
    assert 0 < hqq["kl"]["same_top_p"] <= 100 and hqq["kl"]["positions"] == len(dynamic["questions"][0]["token_ids"])


def test_compare_perplexity_on_the_tail_of_a_text_file(embedded, capsys, tmp_path):
    text = tmp_path / "normans.txt"
    text.write_text(load_case(NORMANS).select("0").context)
    assert (
        main(
            [
                "compare",
                "--context-file",
                str(text),
                "--question",
                "Who?",
                "--spec",
                "fp8",
                "--max-new-tokens",
                "2",
                "--perplexity-tokens",
                "8",
                "--no-progress",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert "PPL" in lines[1] and "PPL ×" in lines[1]
    assert lines[-1].startswith("perplexity: 8 tokens of the context's last tokens, held out of the prefill")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--spec", "hqq:5"], "error: nbits=5 is not allowed for hqq; allowed: 1, 2, 3, 4, 8"),
        (["--spec", "hqq:4,group=32"], "error: spec 'hqq:4,group=32': 'group' is not an option"),
        (["--spec", "int3"], "error: backend='int3' is not a backend"),
        (["--spec", "hqq:4,q_group_size=48"], "error: q_group_size=48 (axis_key=0)"),
        (["--unanswerable-from-case", "0"], "error: --unanswerable-from-case must be >= 1"),
        (["--max-new-tokens", "0"], "error: max_new_tokens=0 must be a whole number >= 1"),
        (["--perplexity-tokens", "-3"], "error: --perplexity-tokens -3: it must be >= 0"),
        (["--paragraphs", "38", "--perplexity-tokens", "5000"], "holding out its last 5001 to score 5000 leaves none"),
        (
            ["--plan-budget", "1000"],
            "error: a budget of 1,000 bytes per token is below the smallest quanto cache on "
            "this model at 192 context tokens (4,320: every layer at the fewest bits); give 4,320 or more",
        ),
        (["--plan-base", "fp8", "--plan-budget", "5000"], "error: backend=fp8 takes no per-layer plan; choose quanto"),
    ],
)
def test_compare_bad_input_exits_2_with_a_message(embedded, args, message, capsys):
    assert (
        main(["compare", "--context-file", NORMANS, "--paragraphs", "0", "--question", "Who?", "--no-progress", *args])
        == 2
    )
    assert message in capsys.readouterr().err


@pytest.mark.process
def test_compare_help_documents_the_spec_syntax():
    out = subprocess.run(
        [sys.executable, "-m", "kvdemo", "compare", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "backend[:nbits][,option=value...]" in out and "--spec dynamic --spec hqq:4" in out
    assert "Default specs: dynamic quanto:4 hqq:4 fp8 turboquant:4 ggml" in out


def test_needle_json_and_csv_on_the_embedded_model(embedded, capsys, tmp_path):
    csv = tmp_path / "grid.csv"
    code = main(
        [
            "needle",
            "--spec",
            "dynamic",
            "--spec",
            "fp8",
            "--lengths",
            "300",
            "--depths",
            "100,0",
            "--max-new-tokens",
            "24",
            "--json",
            "--no-progress",
            "--csv",
            str(csv),
        ]
    )
    assert code == 0
    grid = json.loads(capsys.readouterr().out)
    assert grid["specs"] == ["dynamic", "fp8"] and grid["lengths"] == [300] and grid["depths"] == [0.0, 100.0]
    assert grid["complete"] and grid["needles_per_context"] is None and grid["max_new_tokens"] == 24
    cells = grid["cells"]
    assert [(c["spec_text"], c["depth"]) for c in cells] == [
        ("dynamic", 0.0),
        ("dynamic", 100.0),
        ("fp8", 0.0),
        ("fp8", 100.0),
    ]
    for cell in cells:
        assert cell["length"] == cell["cache_length_after"] == 300 and cell["needles_in_context"] == 2
        assert cell["hit"] == (cell["value"] in cell["answer"].replace(",", "")) and cell["score"] < 0
        assert cell["value_tokens"] == 6 and cell["prefill_seconds"] > 0 and cell["score_seconds"] > 0
    assert cells[0]["value"] == cells[2]["value"]  # the same needles for every spec
    lines = csv.read_text().splitlines()
    assert lines[0].startswith("spec text,length,depth,placed depth,hit,cut,score") and len(lines) == 5


def test_needle_tables_and_progress_bar(embedded, capsys):
    assert main(["needle", "--spec", "dynamic", "--lengths", "256", "--depths", "50", "--max-new-tokens", "2"]) == 0
    captured = capsys.readouterr()
    out = captured.out.splitlines()
    assert "needles per context: all depths" in out[0]
    assert out[2] == "dynamic: hit (\u2713/\u2717) and log P(value) in nats, depth x context length"
    assert out[3].split() == ["256", "tokens"] and out[4].split()[:2] == ["50", "%"]
    assert out[-2].split()[:3] == ["spec", "text", "cells"] and out[-1].split()[:2] == ["dynamic", "1"]
    assert "| 0/3 [" in captured.err and "3/3" in captured.err  # prefill, answer, scoring


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lengths", "1024,abc"], "error: lengths: 'abc' is not a whole number of tokens"),
        (["--lengths", "0"], "error: length 0 must be a whole number of tokens >= 1"),
        (["--lengths", "512,512"], "error: length 512 is given twice"),
        (["--depths", "0,150"], "error: depth 150.0 must be a number from 0 to 100"),
        (["--depths", ""], "error: depths is empty"),
        (["--spec", "hqq:5"], "error: nbits=5 is not allowed for hqq"),
        (["--needles-per-context", "0"], "error: needles_per_context=0 must be a whole number >= 1 (or None)"),
        (["--max-new-tokens", "0"], "error: max_new_tokens=0 must be a whole number >= 1"),
        (["--lengths", "9000"], "error: length 9,000 does not fit: the longest context is 8,096 tokens"),
        (["--lengths", "40"], "error: length 40 is too short for 1 needle(s)"),
        (["--csv", "/no/such/folder/grid.csv"], "error: --csv /no/such/folder/grid.csv: the folder /no/such/folder"),
    ],
)
def test_needle_bad_input_exits_2_with_a_message(embedded, args, message, capsys):
    assert main(["needle", "--spec", "dynamic", "--lengths", "256", "--depths", "50", "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.process
def test_needle_help_documents_the_grid():
    out = subprocess.run(
        [sys.executable, "-m", "kvdemo", "needle", "--help"], capture_output=True, text=True, check=True
    ).stdout
    for option in (
        "--spec",
        "--lengths",
        "--depths",
        "--needles-per-context",
        "--seed",
        "--max-new-tokens",
        "--json",
        "--csv",
        "--no-progress",
    ):
        assert option in out
    assert "--spec dynamic --spec hqq:2 --spec hqq:4 --spec quanto:4 --spec fp8 --lengths 1024,2048,4096,7936" in out
