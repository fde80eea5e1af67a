"""The contract of a format's folder (docs/DESIGN.md, "One format, one folder"): a copy of one format's folder under
a new name, and that name added to the registry's `FORMATS`, is a working format through every door: the command
line's `ask` and `compare`, a session file saved and reopened, the page's `/prefill` and `/ask` through gradio_client,
the MCP tools, and `recommend`'s candidates; nothing else of the package is edited.

Cost: one child process (the embedded model, the page and its MCP server): about 40 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvdemo.ui.examples import example

ROOT = Path(__file__).resolve().parents[1]
COPIED, NEW = "turboquant", "turbocopy"


def _copied(tmp_path: Path, copied: str, new: str) -> Path:
    """A copy of the package under `tmp_path` with the folder of format `copied` copied as `new` and `new` added to
    the registry's `FORMATS` (one line changed); returns the copy's format folder."""
    package = tmp_path / "kvdemo"
    shutil.copytree(ROOT / "kvdemo", package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    formats = package / "cache" / "formats"
    shutil.copytree(formats / copied, formats / new)
    registry = package / "cache" / "registry.py"
    before = registry.read_text(encoding="utf-8").splitlines()
    after = [line.replace(")", f', "{new}")') if line.startswith("FORMATS = ") else line for line in before]
    assert sum(a != b for a, b in zip(before, after)) == 1  # the one registry line
    registry.write_text("\n".join(after) + "\n", encoding="utf-8")
    return formats / new


def _run(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    """`python *argv` with the copy's `kvdemo` first on the path (then the project's root, for `tests`)."""
    environment = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}", "GRADIO_ANALYTICS_ENABLED": "False"}
    return subprocess.run(
        [sys.executable, *argv], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=600
    )


@pytest.mark.process
def test_a_copied_format_folder_and_one_registry_line_work_through_every_door(tmp_path):
    package = _copied(tmp_path, COPIED, NEW).parents[2]

    context_file = tmp_path / "normans.txt"
    context_file.write_text(example("Normans")[0][:2000], encoding="utf-8")  # about 450 tokens
    run = _run(tmp_path, "-m", "tests.format_doors", NEW, COPIED, str(context_file), str(tmp_path / "copy.kvsession"))
    assert run.returncode == 0, run.stderr[-3000:]
    doors = json.loads(run.stdout.strip().splitlines()[-1])

    assert doors["package"] == str(package)  # the copy ran, not the project's package
    assert doors["formats"][-2:] == ["int8", NEW]
    # the same code under another name: the same bytes and tokens as the original format, through every door
    tokens, answer = doors["original"], doors["text"]
    assert len(tokens) == 6 and doors["session"] == doors["reopened"] == tokens
    assert doors["kv_bytes"][NEW] == doors["kv_bytes"][COPIED]
    assert doors["reopened_spec"] == f"{NEW}:4"
    assert doors["stored_modules"] == [f"kvdemo.cache.formats.{NEW}.layers"]  # its own store types were saved
    assert doors["ask_status"] == 0 and doors["ask"]["backend"] == NEW
    assert [tokens] == [a["token_ids"] for a in doors["ask"]["answers"]]
    assert doors["ask"]["kv_bytes"] == doors["kv_bytes"][NEW] and f"--backend {NEW}" in doors["ask"]["deploy"][-1]
    assert doors["compare_status"] == 0
    rows = {row["spec_text"]: row for row in doors["compare"]["results"]}
    assert (
        rows[f"{NEW}:4"]["questions"][0]["token_ids"] == tokens
        and rows[f"{NEW}:4"]["kv_bytes"] < rows["dynamic"]["kv_bytes"]
    )
    assert doors["candidates"] == [text.replace(COPIED, NEW, 1) for text in doors["original_candidates"]]
    assert NEW in doors["page_backend_choices"]
    assert f"with **{NEW} nbits=4" in doors["page_summary"] and doors["page_answer"] == answer
    assert f'"spec": "{NEW}:4"' in doors["mcp_prefill"] and f'"answer": {json.dumps(answer)}' in doors["mcp_answer"]


OPTION = """        "scale_rule": Option(
            "scale_rule",
            "amax",
            choices=("amax", "one"),
            help="the per-tensor scale: amax / 448, or 1.0 (a test's option)",
            quiet=True,
        ),
"""

WIRED = """
from kvdemo import CacheSpec
from kvdemo.cache.registry import GROUP_OPTIONS, SPEC_OPTIONS
from kvdemo.cli.main import build_parser
from kvdemo.ui.option_fields import backend_option_updates

spec = CacheSpec.parse("fp8x,scale_rule=one")
assert spec == CacheSpec("fp8x", scale_rule="one") and spec.scale_rule == "one" and CacheSpec("fp8").scale_rule is None
assert spec.text == "fp8x,scale_rule=one" and spec.full_text == "fp8x,scale_rule=one", spec.full_text
assert SPEC_OPTIONS[-1] == GROUP_OPTIONS[-1] == "scale_rule"
fields = backend_option_updates("fp8x")[:-1]
assert fields[-1]["visible"] and fields[-1]["choices"] == ["amax", "one"], fields[-1]
assert not backend_option_updates("fp8")[len(GROUP_OPTIONS) - 1]["visible"]
args = build_parser().parse_args(["ask", "--context-file", "x", "--backend", "fp8x", "--scale-rule", "one"])
assert args.scale_rule == "one"
try:
    CacheSpec.parse("fp8,scale_rule=one")
except ValueError as error:
    assert "scale_rule=one is not an option of the fp8 backend" in str(error), error
else:
    raise AssertionError("fp8 took the copy's option")
print("wired")
"""


@pytest.mark.process
def test_an_option_one_format_adds_is_its_own_and_reaches_the_page_and_the_command_line(tmp_path):
    """An option added in one format's card, and nowhere else, is that format's: a spec of it parses and writes it, the
    page has a field for it and the command line a flag, and no other format takes it."""
    card = _copied(tmp_path, "fp8", "fp8x") / "__init__.py"
    text = card.read_text(encoding="utf-8")
    assert text.count('        "scale": Option(') == 1
    card.write_text(text.replace('        "scale": Option(', OPTION + '        "scale": Option('), encoding="utf-8")
    run = _run(tmp_path, "-c", WIRED)
    assert run.returncode == 0 and run.stdout.strip() == "wired", run.stderr[-3000:]
