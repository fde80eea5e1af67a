"""Every door on every layer kind: one tiny model per kind of cache layer (`KINDS`, from the family matrix's models)
through every way a user reaches a result (`DOORS`): the comparison (library and `python -m kvdemo compare --json`),
the needle grid, the charts drawn from their records, the per-layer planner and a hand-written `plan=`, a session file
saved and opened, and the page's Compare and Needle endpoints and the MCP comparison through `gradio_client`. Each
cell gives a result whose figures are checked against the layer kinds (what each layer holds, what is quantized,
what is kept) and against a reference (the same cache read whole, a fresh run, the library called directly), or,
where the kind cannot be served, a refusal before any forward pass that names what would work.

A new kind is one entry of `KINDS`, a new door one function in `DOORS`: the matrix is their product.

Cost: about 100 s in one process on 2 busy cores (2026-12-05): 31 s for the library's doors (eight models of a few
million weights, a 128-token text, one question of 3 tokens), 65-70 s for the page's (one server, 8 s a kind).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import pytest
import torch

from kvdemo.cache.model.geometry import split_geometry
from kvdemo.cache.model.layer_kinds import KEEP, QUANTIZE, is_latent, layer_actions, layer_types
from kvdemo.cache.spec import CacheSpec, estimate_kv_bytes
from kvdemo.charts.reports import kv_error_figure, layer_labels
from kvdemo.charts.steps import KEPT_SERIES, memory_frame
from kvdemo.compare.run import compare
from kvdemo.evals import cache_error
from kvdemo.evals.channel_spread import channel_max
from kvdemo.evals.planner import plan_layers
from kvdemo.needle.grid import answer_tokens_needed, needle_grid
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.session import QASession
from kvdemo.qa.session_file import open_session, save_session
from tests.families import family_config, tiny_family

pytestmark = pytest.mark.model  # loads tiny models through `_loaded`, not a model fixture

CONTEXT = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region in France. "
    "They were descended from Norse raiders and pirates from Denmark, Iceland and Norway who, under their leader "
    "Rollo, agreed to swear fealty to King Charles III of West Francia. Through generations of assimilation and "
    "mixing with the native Frankish and Roman-Gaulish populations, their descendants would gradually merge with "
    "the Carolingian-based cultures of West Francia."
)
QUESTION = "Who was the Norse leader?"
TOKENS = 3
PERPLEXITY_TOKENS = 12


@dataclass(frozen=True)
class Kind:
    """One kind of cache layer in the matrix: the tiny family that has it and the spec that shows it."""

    family: str
    spec: str


KINDS: dict[str, Kind] = {
    "full attention": Kind("Llama 3", "quanto:4,residual_length=8"),
    "sliding window kept": Kind("Gemma 3", "quanto:4,residual_length=8"),
    "sliding window quantized": Kind("Gemma 3", "hqq:4,residual_length=8,sliding=quantize"),
    "linear attention beside full": Kind("Qwen3.5", "turboquant:4,residual_length=8"),
    "conv beside full": Kind("LFM2", "quanto:4,residual_length=8,rotation=hadamard"),
    "Mamba-combined layers": Kind("Falcon-H1", "quanto:4,residual_length=8"),
    "KV-shared layers": Kind("Gemma 4 (KV sharing)", "quanto:4,residual_length=8"),
    "MLA": Kind("DeepSeek-V3 (MLA)", "hqq:4,residual_length=8"),
}
"""Kind of layer -> the family and spec of its cell. Falcon-H1's combined attention-and-Mamba layers are kept whole,
so a quantized spec is refused there (the `dynamic`-only kind)."""


@cache
def _loaded(family: str) -> LoadedModel:
    from kvdemo.qa.models import load_model

    return tiny_family(family, load_model().tokenizer)


@dataclass
class Cell:
    kind: str
    loaded: LoadedModel
    spec: CacheSpec
    refusal: str | None  # the spec's refusal on this model, or None where it runs


def _cell(kind: str) -> Cell:
    loaded = _loaded(KINDS[kind].family)
    spec = CacheSpec.parse(KINDS[kind].spec)
    try:
        spec = spec.fit(loaded.config).validate(loaded.config)
    except ValueError as error:
        return Cell(kind, loaded, spec, str(error))
    return Cell(kind, loaded, spec, None)


def _expected_reads(cell: Cell, tokens: int) -> tuple[list[str], list[bool]]:
    """What `kv_error` must compare of each layer, and which layers the spec quantizes, from the layer kinds."""
    config = cell.loaded.config
    window = getattr(config.get_text_config(decoder=True), "sliding_window", None) or 0
    reads = []
    for kind in layer_types(config):
        if kind in ("linear_attention", "conv"):
            reads.append(cache_error.STATE)
        elif kind == "dummy":
            reads.append(cache_error.NOTHING)
        elif "sliding" in kind and tokens >= window:
            reads.append(cache_error.WINDOW)
        else:
            reads.append(cache_error.ALL_TOKENS)
    resolved = cell.spec.resolved()
    actions = layer_actions(config, True, str(resolved.get("sliding", "keep")), str(resolved.get("protect", "0:0")))
    return reads, [action == QUANTIZE for action in actions]


def _no_forward(cell: Cell, monkeypatch) -> None:
    monkeypatch.setattr(cell.loaded.model, "forward", lambda *a, **k: pytest.fail("a refusal runs no forward pass"))


def _refused(cell: Cell, run: Callable[[], object], monkeypatch) -> None:
    """A refused cell: the door raises a ValueError before any forward pass, naming what would work."""
    assert cell.refusal is not None and "backend=dynamic serves it" in cell.refusal
    _no_forward(cell, monkeypatch)
    with pytest.raises(ValueError, match="backend=dynamic serves it"):
        run()


# ---- the doors ----------------------------------------------------------------------------------------------------
@cache
def _report(kind: str):
    cell = _cell(kind)
    return compare(
        cell.loaded, CONTEXT, [QUESTION], [cell.spec], max_new_tokens=TOKENS, perplexity_tokens=PERPLEXITY_TOKENS
    )


def door_compare(cell: Cell, monkeypatch, tmp_path) -> None:
    """`kvdemo.compare`: every column it reports, against the layer kinds and the references."""
    if cell.refusal:
        _refused(
            cell, lambda: compare(cell.loaded, CONTEXT, [QUESTION], [cell.spec], max_new_tokens=TOKENS), monkeypatch
        )
        return
    report = _report(cell.kind)
    dynamic, result = report.results
    tokens = result.context_tokens
    reads, quantized = _expected_reads(cell, tokens)
    # bytes: the registry's formula, and the kept layers' share where the spec keeps some
    resolved = result.options
    _, kept = split_geometry(cell.loaded.config, str(resolved.get("sliding", "keep")), str(resolved["protect"]))
    states = any(kind in ("linear_attention", "conv") for kind in layer_types(cell.loaded.config))
    formula = estimate_kv_bytes(cell.spec, cell.loaded.config, tokens, torch.float32)  # every token in the store
    kept_kv = 4 * kept.values_held(tokens)  # float32 keys and values of the kept layers
    if states:  # conv and recurrent states are held beside the keys and values (kept, never quantized)
        assert result.kv_bytes > formula and result.kept_bytes > kept_kv
    else:
        assert result.kv_bytes == formula and result.kept_bytes == kept_kv
    assert result.quantized_bytes > 0
    assert 0 < result.ratio_to_dynamic < 1 and dynamic.kept_bytes == 0
    # the KV error: what each layer holds compared, the kept ones exact, the quantized ones off by a 4-bit step
    error = result.kv_error
    assert (
        list(error.reads) == reads
        and list(error.quantized) == quantized
        and error.latent == is_latent(cell.loaded.config)
    )
    for layer, (read, stored) in enumerate(zip(reads, quantized)):
        if read in cache_error.COMPARED:
            assert max(error.keys[layer]) < (0.3 if stored else 1e-6), (layer, error.keys[layer])
            assert min(error.keys[layer] + error.values[layer]) > (1e-3 if stored else -1), layer
        else:
            assert error.keys[layer] == () and error.values[layer] == ()
    assert dynamic.kv_error.total == 0 and dynamic.kv_error.reads == error.reads
    assert error.context_total is not None and 0 < error.context_total <= 0.3
    # fidelity, perplexity, drift, answers, restore
    assert 0 <= result.kl.mean_kld < 1 and 0 <= result.kl.same_top_p <= 100 and dynamic.kl.mean_kld == 0
    assert result.perplexity is not None and math.isfinite(result.perplexity.ratio_to_dynamic)
    assert result.drift_flushes > 0 and 0.5 < result.drift < 2  # residual_length=8: flushes while scoring
    assert result.restored and dynamic.restored
    assert all(len(q.token_ids) == TOKENS or q.finish_reason != "max_new_tokens" for q in result.questions)
    # the same cache read whole: the figure a fresh prefill gives
    session = QASession(cell.loaded, cell.spec)
    session.prefill(CONTEXT, max_new_tokens=TOKENS)
    again = cache_error.kv_error(cache_error.reference_kv(cell.loaded, session.context_ids(CONTEXT)), session.cache)
    assert again.total == pytest.approx(error.total, rel=1e-6)


def door_cli_compare(cell: Cell, monkeypatch, tmp_path) -> None:
    """`python -m kvdemo compare --json` on the model saved to a folder: the library's figures, or exit 2 with the
    refusal."""
    from kvdemo.cli.main import main

    folder = tmp_path / "model"
    cell.loaded.model.save_pretrained(folder)
    cell.loaded.tokenizer.save_pretrained(folder)
    text = tmp_path / "context.txt"
    text.write_text(CONTEXT, encoding="utf-8")
    argv = ["compare", "--model", str(folder), "--context-file", str(text), "--question", QUESTION]
    argv += ["--spec", cell.spec.text, "--max-new-tokens", str(TOKENS), "--json", "--no-progress"]
    argv += ["--perplexity-tokens", str(PERPLEXITY_TOKENS)]
    if cell.refusal:
        assert main(argv) == 2
        return
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    data = json.loads(out.getvalue())
    library = _report(cell.kind).to_dict()["results"]
    for mine, theirs in zip(data["results"], library):
        for key in ("spec", "kv_bytes", "quantized_bytes", "kept_bytes", "restored", "drift_flushes"):
            assert mine[key] == theirs[key], key
        assert mine["kv_error"]["reads"] == theirs["kv_error"]["reads"]
        assert mine["kv_error"]["total"] == pytest.approx(theirs["kv_error"]["total"], rel=1e-5)
        assert mine["kl"]["mean_kld"] == pytest.approx(theirs["kl"]["mean_kld"], abs=1e-5)


def door_needle(cell: Cell, monkeypatch, tmp_path) -> None:
    """The needle grid at one length and depth: each cell's score a log-probability, the cache restored."""
    needed = answer_tokens_needed(cell.loaded, [96], [50.0], seed=1)
    run = lambda: needle_grid(cell.loaded, ["dynamic", cell.spec], [96], [50.0], seed=1, max_new_tokens=needed)  # noqa: E731
    if cell.refusal:
        _refused(cell, run, monkeypatch)
        return
    grid = run()
    assert [c.spec_text for c in grid.cells] == ["dynamic", cell.spec.text]
    for c in grid.cells:
        assert c.length == 96 and c.cache_length_after == 96 and -1e4 < c.score <= 0 and c.kv_bytes > 0
    assert grid.cells[1].kv_bytes < grid.cells[0].kv_bytes


def door_charts(cell: Cell, monkeypatch, tmp_path) -> None:
    """The charts from the records: the KV error map names each layer's kind, the memory chart the kept layers, the
    channel spread of a compared layer."""
    if cell.refusal:
        _refused(cell, lambda: QASession(cell.loaded, cell.spec), monkeypatch)
        return
    result = _report(cell.kind).results[1]
    labels = layer_labels(result.kv_error)
    figure = kv_error_figure(result.kv_error)
    ticks = [t.get_text() for t in figure.axes[0].get_yticklabels()]
    assert ticks == [f"{i} {label}" for i, label in enumerate(labels)]
    reads, quantized = _expected_reads(cell, result.context_tokens)
    for label, read, stored in zip(labels, reads, quantized):
        assert label.startswith("quantized" if stored else "kept") or label == read
    session = QASession(cell.loaded, cell.spec)
    session.prefill(CONTEXT, max_new_tokens=TOKENS)
    events = list(session.stream(QUESTION, TOKENS))
    kept = memory_frame(events, (KEPT_SERIES,))["MiB"]
    has_kept = any(a == KEEP for a in layer_actions(cell.loaded.config, True, str(cell.spec.resolved().get("sliding"))))
    assert (kept > 0).all() if has_kept else (kept == 0).all()
    reference = cache_error.reference_kv(cell.loaded, session.context_ids(CONTEXT))
    first = next(i for i, kv in enumerate(reference) if kv is not None)
    assert channel_max(reference, first).shape == reference[first][0].shape[1:2] + reference[first][0].shape[-1:]


def door_planner(cell: Cell, monkeypatch, tmp_path) -> None:
    """`--plan-budget`'s planner between the fewest and the most bits, and a hand-written `plan=` of its layers: the
    plan runs and answers as a fresh run of it does."""
    config = cell.loaded.config
    base = CacheSpec("quanto", sliding=cell.spec.resolved().get("sliding", "keep"))
    ids = QASession(cell.loaded).context_ids(CONTEXT)
    if cell.refusal:
        _refused(cell, lambda: plan_layers(cell.loaded, ids, base, 1e6), monkeypatch)
        return
    fitted = base.fit(config)
    low, high = (estimate_kv_bytes(fitted.replace(nbits=b), config, len(ids), torch.float32) / len(ids) for b in (2, 4))
    plan = plan_layers(cell.loaded, ids, base, (low + high) / 2, query_tokens=8)
    _, quantized = _expected_reads(cell, len(ids))
    assert list(plan.errors.layer_indices) == [i for i, q in enumerate(quantized) if q]
    assert low - 1e-6 <= plan.bytes_per_token <= (low + high) / 2 + 1e-6
    assert plan.bytes_per_token == pytest.approx(
        estimate_kv_bytes(plan.spec, config, len(ids), torch.float32) / len(ids)
    )
    assert plan.errors.latent == is_latent(config) and plan.error <= (plan.uniform_error or math.inf) + 1e-12
    by_hand = fitted.replace(plan="k4v2*" + str(len(plan.layers)) if len(plan.layers) > 1 else "k4v2")
    answers = []
    for spec in (plan.spec, by_hand, by_hand):
        session = QASession(cell.loaded, spec)
        session.prefill(CONTEXT, max_new_tokens=TOKENS)
        answers.append(session.ask(QUESTION, TOKENS).token_ids)
        assert session.cache_length == len(ids)
    assert answers[1] == answers[2] and len(answers[0]) > 0


def door_session_file(cell: Cell, monkeypatch, tmp_path) -> None:
    """A session saved and opened answers as the prefilled one does, token for token."""
    if cell.refusal:
        _refused(cell, lambda: QASession(cell.loaded, cell.spec), monkeypatch)
        return
    session = QASession(cell.loaded, cell.spec)
    session.prefill(CONTEXT, max_new_tokens=TOKENS)
    path = tmp_path / "cell.kvsession"
    save_session(session, path)
    opened = open_session(cell.loaded, path)
    assert opened.ask(QUESTION, TOKENS).token_ids == session.ask(QUESTION, TOKENS).token_ids


DOORS: dict[str, Callable[[Cell, object, object], None]] = {
    "compare": door_compare,
    "compare CLI --json": door_cli_compare,
    "needle grid": door_needle,
    "charts": door_charts,
    "planner and plan=": door_planner,
    "session file": door_session_file,
}
"""The library's and the command line's doors; the page's and MCP's are `test_page_and_mcp_doors` below (one
server for every kind)."""


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_door_on_every_kind(kind, door, monkeypatch, tmp_path):
    DOORS[door](_cell(kind), monkeypatch, tmp_path)


PAGE_DOORS = ("page Compare and Needle, MCP compare",)
"""The doors `test_page_and_mcp_doors` checks, as docs/models.md names them."""


def doors_table() -> str:
    """docs/models.md's doors x kinds table: one row per kind (its family and spec), one column per door; a cell is
    `result` (figures checked) or the refusal's fix."""
    doors = [*DOORS, *PAGE_DOORS]
    rows = ["| kind | family | spec | " + " | ".join(doors) + " |", "|---|---|---|" + "---|" * len(doors)]
    for name, kind in KINDS.items():
        reason = CacheSpec.parse(kind.spec)
        config = family_config(kind.family)
        try:
            reason.fit(config).validate(config)
            shown = "result"
        except ValueError as error:
            shown = "refused: " + str(error).rsplit("; ", 1)[-1]
        rows.append(f"| {name} | {kind.family} | `{kind.spec}` | " + " | ".join([shown] * len(doors)) + " |")
    return "\n".join(rows)


def test_docs_show_the_doors_table():
    from pathlib import Path

    models = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text(encoding="utf-8")
    assert doors_table() in models, "docs/models.md: paste `python -m tests.test_doors`'s table"


def test_the_kinds_cover_every_layer_kind_kvdemo_knows():
    """Every layer type of `LAYER_KINDS` that a model of the matrix can have is in one kind's model."""
    from kvdemo.cache.model.layer_kinds import LAYER_KINDS

    seen = {t for kind in KINDS.values() for t in layer_types(family_config(kind.family))}
    assert seen >= set(LAYER_KINDS) - {"chunked_attention", "hybrid_sliding"}  # no tiny family has these two


# ---- the page's Compare and Needle endpoints and the MCP comparison, through gradio_client ------------------------
@pytest.fixture(scope="module")
def page():
    from gradio_client import Client

    from kvdemo.serve.server import App
    from tests.e2e.conftest import serve

    models = {f"kinds/{family.replace(' ', '-').replace('(', '').replace(')', '')}": family for family in FAMILIES}
    app = App(loader=lambda source: _loaded(models[source]) if source else _loaded("Llama 3"))
    demo, url = serve(app, show_error=True)
    app.wait_for_model()
    yield Client(url, verbose=False), models
    demo.close()


FAMILIES = sorted({kind.family for kind in KINDS.values()})


@pytest.mark.parametrize("kind", list(KINDS))
def test_page_and_mcp_doors(page, kind):
    from gradio_client.exceptions import AppError

    client, models = page
    source = next(name for name, family in models.items() if family == KINDS[kind].family)
    assert "⚠" not in client.predict(source, api_name="/load_model")
    cell = _cell(kind)
    status, table, *_ = client.predict(CONTEXT, ["dynamic"], cell.spec.text, QUESTION, TOKENS, 0, api_name="/compare")
    mcp = lambda: client.predict(  # noqa: E731
        [QUESTION], ["dynamic", cell.spec.text], TOKENS, CONTEXT, "doors", api_name="/compare_backends"
    )
    choice = KINDS[kind].spec.split(",")[0]  # the Needle tab offers the catalogue's specs (`quanto:4`)
    needle = client.predict(["dynamic", choice], "96", "50", 1, 24, api_name="/needle")
    if cell.refusal:
        assert "backend=dynamic serves it" in status and not (table or {}).get("data")  # no placeholder rows
        with pytest.raises(AppError, match="backend=dynamic serves it"):
            mcp()
        assert "backend=dynamic serves it" in str(needle[0])
        return
    assert status.startswith("Compared 2 specs on 1 question"), status
    rows = table["data"]
    assert [row[table["headers"].index("spec")] for row in rows] == ["dynamic", cell.spec.text]
    assert all(row[table["headers"].index("restored")] for row in rows)
    library = _report(kind).results[1]
    kv_mib = rows[1][table["headers"].index("KV MiB")]
    assert kv_mib == pytest.approx(library.kv_bytes / 2**20, abs=0.006)
    results = json.loads(mcp())["results"]
    assert results[-1]["spec text"] == cell.spec.text and results[-1]["KV bytes"] == library.kv_bytes
    assert str(needle[0]).startswith("2 cells in "), needle[0]


if __name__ == "__main__":
    print(doors_table())
