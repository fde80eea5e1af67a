"""Shared fixtures: the embedded model (loaded once), and tiny random Llama models built from a
`LlamaConfig` that reuse its tokenizer, so the backend matrix runs in seconds and offline."""

from __future__ import annotations

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# the kvdemo cache folder is the user's, as for the app (`kvdemo.paths.cache_dir`): the tests reuse the converted
# embedded GGUF and optimum-quanto's extension that the set-up's warm-up built (`kvdemo.cache.formats.quanto.build`);
# tests of a fresh cache set their own folder

import pytest
import torch

from kvdemo.evals.cases import example_path, load_case
from kvdemo.qa.models import LoadedModel, load_model
from tests.helpers import make_tiny

if os.environ.get("PYTEST_XDIST_WORKER"):
    # two pytest-xdist workers on two cores (`make test`): one thread each, and so in every process a test starts
    # (a notebook's kernel, the app, the command line), which inherits OMP_NUM_THREADS. Two processes of two spinning
    # OpenMP threads each on two cores ran notebook 02 in 274 s instead of 29 s.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def embedded() -> LoadedModel:
    """The embedded SmolLM2-135M-Instruct (GGUF Q4_1, float32 on CPU)."""
    return load_model()


@pytest.fixture(scope="session")
def tiny(embedded) -> LoadedModel:
    return make_tiny(embedded.tokenizer)


@pytest.fixture(scope="session")
def normans():
    return load_case(example_path("normans"))


MODEL_FIXTURES = frozenset({"embedded", "tiny"})
"""The fixtures that load a model: a test that uses one (directly or through another fixture) is marked `model`."""


def pytest_collection_modifyitems(config, items):
    """Mark every test that loads a model `model`: those that use a model fixture, and those in tests/e2e/ (a running
    app with the embedded model). `make test-fast` runs the others (`-m "not model and not slow"`)."""
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or "e2e" in item.path.parts:
            item.add_marker(pytest.mark.model)


def _utf8(text: str) -> str:
    """`text` with lone surrogates written as `\\udXXX` escapes: what a test may capture (the hostile payloads of
    tests/e2e/test_every_door.py are logged as received) and what pytest-xdist's channel cannot send as UTF-8."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test report's captured output made UTF-8 before a pytest-xdist worker sends it to the controller (which
    otherwise stops the whole run with `DumpError: strings must be utf-8 encodable`)."""
    outcome = yield
    report = outcome.get_result()
    report.sections = [(title, _utf8(content)) for title, content in report.sections]
    if isinstance(report.longrepr, str):
        report.longrepr = _utf8(report.longrepr)
