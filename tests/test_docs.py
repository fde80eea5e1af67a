"""The README a newcomer reads in two minutes, and the manual under docs/: the README stays short, every relative
link and picture points to a file (and a heading) that exists, the screenshots are small PNGs, every page leads
back to the README, and docs/app.md's settings table lists every option of `app.py --help`. No model is loaded."""

from __future__ import annotations

import pydoc
import re
from pathlib import Path

import pytest

import app as app_module

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
README_LINES = 120
FIRST_EXAMPLE_WITHIN = 60
"""The README's first code example starts within this many lines after the Space's front matter."""
SCREENSHOTS = ("docs/images/ask.png", "docs/images/compare.png")
SCREENSHOT_BYTES = 300_000
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
BACK = "[← back to the README](../README.md)"


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (a link there is code, not a link)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code and emphasis marks and punctuation but `-` and `_` dropped,
    spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {slug(m) for m in re.findall(r"^#{1,6} +(.+?) *#*$", text, flags=re.M)}


def links(path: Path) -> list[tuple[str, str]]:
    """(text, target) of every link and picture in `path`, outside code."""
    return LINK.findall(_prose(path.read_text(encoding="utf-8")))


def test_the_readme_is_short_and_shows_code_on_its_first_screen():
    text = README.read_text(encoding="utf-8")
    lines = text.count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines; move detail into a docs/ page ({README_LINES} at most)"
    body = text.split("\n---\n", 1)[1].splitlines()  # after the Space's front matter
    first = next(i for i, line in enumerate(body, 1) if line.startswith("```python"))
    assert first <= FIRST_EXAMPLE_WITHIN, f"README.md's first Python example is {first} lines after the front matter"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_picture_points_to_a_file_and_heading(path):
    broken = []
    for text, target in links(path):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:: not checked offline
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        if not resolved.exists():
            broken.append(f"[{text}]({target}): no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"[{text}]({target}): no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_readme_shows_the_screenshots_small_and_described():
    shown = {target: text for text, target in links(README)}
    for name in SCREENSHOTS:
        assert name in shown and len(shown[name]) > 20, f"README.md shows {name} with alt text"
        data = (ROOT / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{name} is not a PNG"
        assert len(data) < SCREENSHOT_BYTES, f"{name} is {len(data):,} bytes; `make screenshots` shrinks it"


def test_every_page_has_a_title_and_leads_back_to_the_readme():
    for path in PAGES:
        if path.name == "DESIGN.md":
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        assert lines[0].startswith("# ") and BACK in lines[:5], f"{path.name}: a '# title' then {BACK}"
    linked = {target.partition("#")[0] for _, target in links(README)}
    missing = [p.name for p in PAGES if f"docs/{p.name}" not in linked]
    assert not missing, f"README.md links no docs page {missing}"


def _help_options(capsys) -> dict[str, tuple[list[str], set[str]]]:
    """`app.py --help`: each option's first flag -> (its flags, the environment variables its help names)."""
    with pytest.raises(SystemExit):
        app_module.parse_args(["--help"])
    text = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    options: dict[str, tuple[list[str], set[str]]] = {}
    for block in re.split(r"\n(?=  -)", "\n" + text):
        if not block.strip() or block.strip().startswith("-h"):
            continue
        head = block.strip().split("  ")[0]  # the flags, before the help text
        flags = re.findall(r"--[a-z][a-z-]*", head)
        options[flags[0]] = (flags, set(re.findall(r"KVDEMO_[A-Z_]+", block)))
    return options


def test_the_settings_table_lists_every_option_of_app_help(capsys):
    options = _help_options(capsys)
    assert {"--host", "--queue-size", "--mcp", "--allow-local-paths"} <= set(options), options
    page = (ROOT / "docs" / "app.md").read_text(encoding="utf-8")
    rows = {}
    for line in page.splitlines():
        if line.startswith("| `--"):
            rows[re.findall(r"--[a-z][a-z-]*", line.split("|")[1])[0]] = line
    missing = sorted(set(options) - set(rows))
    assert not missing, f"docs/app.md's settings table lacks {missing} (`app.py --help`)"
    for first, (flags, variables) in options.items():
        cells = rows[first].split("|")
        assert all(f"`{flag}`" in cells[1] for flag in flags), f"{first}: the row names {flags}"
        assert all(v in cells[2] for v in variables), f"{first}: the row names {sorted(variables)}"


FORMAT_ROWS = (
    "dynamic", "quanto:4", "hqq:4", "fp8", "fp8,scale=per_token_head", "fp8,scale=one", "fp8,scale=one,float8=e5m2",
    "fp8,scale=calculated", "turboquant:k8v4", "turboquant:4bit_nc", "ggml:q8_0", "ggml:q4_0", "nvfp4",
    "nvfp4:nvfp4_4over6", "nvfp4:fp8_k_nvfp4_v", "nvfp4,tensor_scale=prefill", "mlx:4", "mlx:8", "int8",
)  # fmt: skip
"""The specs docs/formats.md lists: each format at the settings the engines deploy."""


def formats_table() -> str:
    """docs/formats.md's table: per spec of `FORMAT_ROWS`, the bytes a token takes per KV head and layer (keys and
    values, at 4,096 tokens, float16 where a format keeps the model's dtype, no residual), at head_dim 64 and 128, from
    the format's byte formula (`tests/test_budget.py` checks it against the tensors); the engines that store it and
    their line on a plain full-attention model; the reference its bytes are checked against (`Backend.reference`)."""
    import torch
    from transformers import LlamaConfig

    from kvdemo.cache.spec import CacheSpec, estimate_kv_bytes

    rows = [
        "| spec | bytes/token per KV head and layer, head_dim 64 · 128 | engines that store it, and the line | checked "
        "against |",
        "|---|---|---|---|",
    ]
    tokens = 4096
    for text in FORMAT_ROWS:
        spec, sizes = CacheSpec.parse(text), []
        for dim in (64, 128):
            config = LlamaConfig(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=dim,
                                 hidden_size=dim, max_position_embeddings=2 * tokens)  # fmt: skip
            sizes.append(f"{estimate_kv_bytes(spec, config, tokens, torch.float16) / tokens:.1f}")
        lines = [d.line.split("  #")[0] for d in spec.deployments(config) if d.engine != "kvdemo"]
        engines = "<br>".join(f"`{line}`" for line in lines) if spec.backend != "dynamic" else "every engine's default"
        rows.append(f"| `{text}` | {sizes[0]} · {sizes[1]} | {engines or 'kvdemo only'} | {spec.info.reference} |")
    return "\n".join(rows)


def test_the_formats_page_holds_every_format_s_bytes_engines_and_reference():
    page = (ROOT / "docs" / "formats.md").read_text(encoding="utf-8")
    assert formats_table() in page, "docs/formats.md's table differs: paste tests.test_docs.formats_table()"


def test_the_formats_page_holds_each_format_s_options_under_its_own_heading():
    from kvdemo.cache.registry import BACKENDS, FORMATS_PAGE, options_markdown

    page = (ROOT / FORMATS_PAGE).read_text(encoding="utf-8")
    for name in BACKENDS:
        section = page.split(f"\n### `{name}`\n", 1)
        assert len(section) == 2, f"{FORMATS_PAGE} has no '### `{name}`' section (the README's table links it)"
        assert section[1].split("\n### ", 1)[0].lstrip().startswith(options_markdown(name)), (
            f"{FORMATS_PAGE}, section `{name}`: paste kvdemo.cache.registry.options_markdown({name!r}) under it"
        )


DESIGN_PAGE = ROOT / "docs" / "DESIGN.md"
PACKAGES = "ui|cli|serve|compare|needle|evals|charts|qa|cache"
PICTURED = re.compile(rf"(?<![\w.])((?:{PACKAGES})(?:\.(?:\w+|<name>))+)|, \.(\w+)")
"""A dotted name of kvdemo in a picture (`serve.door.Door.prefill`, `cache.formats.<name>.layers`), or `, .name`: a
sibling of the name before it (`QASession.prefill, .stream`)."""


def pictures(section: str) -> list[str]:
    """The fenced blocks of docs/DESIGN.md's section `section` (a `## ` heading's text)."""
    text = DESIGN_PAGE.read_text(encoding="utf-8").split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```text\n(.*?)^```", text, flags=re.M | re.S)


def test_the_design_opens_with_its_pictures_then_its_invariants():
    lines = DESIGN_PAGE.read_text(encoding="utf-8").splitlines()
    heads = [line for line in lines if line.startswith("## ")]
    assert heads[:3] == ["## The data path", "## The two seams", heads[2]] and heads[2].startswith("## The invariants")
    assert lines.index(heads[2]) < 80, "docs/DESIGN.md's invariants start within its first 80 lines"
    assert len(pictures("The data path")) == 1 and len(pictures("The two seams")) == 2


@pytest.mark.parametrize("section", ["The data path", "The two seams"])
def test_every_name_in_the_design_s_pictures_exists(section):
    """Each dotted name in the pictures is a module, class, function or attribute of kvdemo; `<name>` stands for
    every quantized format's folder. A renamed step makes the picture fail here, not mislead a reader."""
    from kvdemo.cache.registry import BASELINE, FORMATS

    missing, checked, before = [], 0, ""
    for block in pictures(section):
        for match in PICTURED.finditer(block):
            dotted = match.group(1) or f"{before.rsplit('.', 1)[0]}.{match.group(2)}"
            before = dotted if match.group(1) else before
            names = [dotted.replace("<name>", f) for f in FORMATS if f != BASELINE] if "<name>" in dotted else [dotted]
            checked += len(names)
            missing += [name for name in names if pydoc.locate(f"kvdemo.{name}") is None]  # module, then attributes
    assert checked >= 20 and not missing, f"docs/DESIGN.md, {section}: {missing}"
