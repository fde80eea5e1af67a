"""The registry is the one place that knows the backends: a fifth backend added only there reaches the
spec syntax, the byte estimate, the session, the compare defaults, the command line and the page; and no
backend's facts are written by hand anywhere else (code, README)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

from kvdemo import QASession, kv_memory
from kvdemo.cache.backend import Backend
from kvdemo.cache.catalogue import all_specs, default_compare_specs
from kvdemo.cache.options import Option
from kvdemo.cache.registry import BACKENDS, FORMATS, markdown_table
from kvdemo.cache.spec import CacheSpec, estimate_kv_bytes

ROOT = Path(__file__).resolve().parents[1]


def _dummy() -> Backend:
    """A fifth backend: a plain `DynamicCache` under another name, with one option of its own choices (nbits, which
    it ignores) and its own byte formula: enough to see every consumer pick it up from the entry alone."""
    dynamic = BACKENDS["dynamic"]
    return Backend(
        "dummy",
        "DynamicCache under another name, for the registry test",
        "It never flushes.",
        quantized=False,
        make_cache=dynamic.make_cache,
        kv_bytes=dynamic.kv_bytes,
        options={"nbits": Option("nbits", 16, choices=(16,), help="bits per value (ignored)")},
        compare_nbits=(16,),
    )


@pytest.fixture()
def with_dummy(monkeypatch):
    monkeypatch.setitem(BACKENDS, "dummy", _dummy())


def test_a_fifth_backend_needs_only_its_registry_entry(with_dummy, tiny):
    spec = CacheSpec.parse("dummy:16")
    assert spec == CacheSpec("dummy", nbits=16) and spec.text == "dummy:16" and spec.label == "dummy nbits=16"
    assert spec in all_specs() and spec in default_compare_specs()
    with pytest.raises(ValueError, match="nbits=4 is not allowed for dummy; allowed: 16"):
        CacheSpec.parse("dummy:4")
    session = QASession(tiny, spec)
    report = session.prefill("The Normans were in Normandy. Rollo led them.")
    assert report.kv_bytes == estimate_kv_bytes(spec, tiny.config, report.context_tokens, tiny.dtype)
    fresh = QASession(tiny, CacheSpec("dynamic"))
    fresh.prefill("The Normans were in Normandy. Rollo led them.")
    assert session.ask("Who led them?", 4).token_ids == fresh.ask("Who led them?", 4).token_ids
    assert kv_memory(session.cache).seq_length == report.context_tokens
    assert "| [`dummy`](docs/formats.md#dummy) | DynamicCache under another name" in markdown_table()


def test_a_fifth_backend_reaches_the_command_line(with_dummy, capsys):
    from kvdemo.cli.main import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["ask", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps its help where it likes
    assert "dummy: DynamicCache under another name" in out and "dummy 16" in out
    assert parser.parse_args(["ask", "--context-file", "x", "--backend", "dummy"]).backend == "dummy"


def test_a_fifth_backend_reaches_the_page(with_dummy, tiny):
    import gradio as gr

    from kvdemo.serve.server import App
    from kvdemo.ui import build_demo
    from kvdemo.ui.inputs import spec_from_inputs
    from kvdemo.ui.option_fields import backend_option_updates

    demo = build_demo(App(loader=lambda source=None: tiny))
    radios = [b for b in demo.blocks.values() if isinstance(b, gr.Radio) and b.label == "cache backend"]
    assert [choice[1] for choice in radios[0].choices] == [*FORMATS, "dummy"]
    boxes = [b for b in demo.blocks.values() if isinstance(b, gr.CheckboxGroup)]
    assert ("dummy:16", "dummy:16") in boxes[0].choices and "dummy:16" in boxes[0].value
    *fields, note = backend_option_updates("dummy")
    assert fields[0]["visible"] and fields[0]["choices"] == [16] and not any(f["visible"] for f in fields[1:])
    assert note == (  # the first row's fields' help, in the backend's own words
        "DynamicCache under another name, for the registry test. It never flushes.\n\nThe fields above:\n"
        "- **nbits**: bits per value (ignored)"
    )
    assert spec_from_inputs("dummy", dict(nbits=16, q_group_size=64, residual_length=4)) == CacheSpec("dummy", nbits=16)


def test_the_readme_backend_table_is_the_registry():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert markdown_table() in readme, "README's backend table differs: paste kvdemo.cache.registry.markdown_table()"


def _choice_lists() -> set[str]:
    """Every registry choice tuple of two or more values as it would be written by hand: `1, 2, 3, 4, 8`,
    `1|2|3|4|8`, `(2, 4)`."""
    lists = set()
    for backend in BACKENDS.values():
        for option in backend.options.values():
            if option.choices and len(option.choices) > 2:
                values = list(map(str, option.choices))
                lists |= {", ".join(values), "|".join(values), "/".join(values)}
    return lists


def test_no_backend_facts_written_by_hand_outside_the_registry():
    """Backend names with their allowed values, and the lists of allowed values, appear only in the registry
    (and the README table generated from it)."""
    formats = ROOT / "kvdemo" / "cache" / "formats"
    sources = [p for p in (ROOT / "kvdemo").rglob("*.py") if p.name != "registry.py" and formats not in p.parents]
    sources += [ROOT / "app.py"]
    pattern = re.compile(r"\b(quanto|hqq)\b[^\n]{0,12}\b[0-9]\|[0-9]")
    for path in sources:
        text = path.read_text(encoding="utf-8")
        for written in _choice_lists():
            assert written not in text, f"{path.relative_to(ROOT)} writes the registry's choices {written!r} by hand"
        assert not pattern.search(text), f"{path.relative_to(ROOT)} writes a backend's allowed values by hand"
    # the backend names themselves are switched on nowhere but the registry
    names = "|".join(map(re.escape, BACKENDS))
    switch = re.compile(rf"""(==|!=|\bin\b)\s*\(?["']({names})["']""")
    for path in sources:
        match = switch.search(path.read_text(encoding="utf-8"))
        assert match is None, f"{path.relative_to(ROOT)} switches on a backend name: {match.group(0)!r}"


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module's code, docstrings left out: (line, text)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def _format_of(path: Path) -> str | None:
    """The format whose folder holds `path` (`kvdemo/cache/formats/<name>/...`), or None."""
    parts = path.relative_to(ROOT).parts
    return parts[3] if parts[:3] == ("kvdemo", "cache", "formats") and len(parts) > 4 else None


def test_a_format_is_named_only_in_its_folder_and_the_registry():
    """No code outside `kvdemo/cache/formats/<name>/` and the registry writes a format's name or a spec of it
    (`"hqq:4"`, `"fp8,scale=..."`) or imports its folder: a default spec comes from `catalogue.examples`, the baseline
    from `registry.BASELINE`, a store type, a decode read, a deploy line or a rotation's cost from the format's card or
    its layers. Docstrings may give examples."""
    names = "|".join(map(re.escape, BACKENDS))
    spec_text = re.compile(rf"^({names})([:,]|$)")
    sources = [p for p in (ROOT / "kvdemo").rglob("*.py") if p.name != "registry.py"] + [ROOT / "app.py"]
    modules = {path: _format_of(path) for path in sources}
    found = [
        f"{path.relative_to(ROOT)}:{line} {text!r}"
        for path, own in modules.items()
        for line, text in _code_strings(path)
        if (match := spec_text.match(text)) and match.group(1) != own
    ]
    assert not found, f"format names outside their folders: {found}"
    imported = [
        f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}"
        for path, own in modules.items()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("kvdemo.cache.formats.")
        and node.module.split(".")[3] != own
    ]
    assert not imported, f"a format's folder imported from outside it: {imported}"
    for name, backend in BACKENDS.items():  # and each folder holds its own entry
        module = importlib.import_module(f"kvdemo.cache.formats.{name}")
        assert module.BACKEND is backend and module.NAME == name


def test_every_backend_entry_is_complete():
    for name, backend in BACKENDS.items():
        assert backend.name == name and backend.summary and backend.behaviour.endswith(".")
        assert callable(backend.make_cache) and callable(backend.kv_bytes)
        assert (backend.group_rule is None) == ("q_group_size" not in backend.options)
        assert dataclasses.is_dataclass(backend)


def test_short_text_keeps_only_what_differs_from_the_defaults_and_parses_back():
    page_spec = CacheSpec.parse("quanto:4,q_group_size=64,residual_length=16,axis_key=0,axis_value=0,flush=requantize")
    assert page_spec.short_text == "quanto:4,residual_length=16"
    assert (
        CacheSpec.parse("hqq:4,rotation=hadamard,q_group_size=32").short_text
        == "hqq:4,q_group_size=32,rotation=hadamard"
    )
    assert CacheSpec.parse("fp8").short_text == "fp8" and CacheSpec.parse("dynamic,storage=growing").short_text == (
        "dynamic,storage=growing"
    )
    for spec in all_specs():
        again = CacheSpec.parse(spec.short_text)
        assert (again.backend, again.resolved()) == (spec.backend, spec.resolved()), spec.text
