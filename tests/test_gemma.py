"""A real model of several layer kinds: Gemma 3 270M (`make gemma`: 15 sliding-window + 3 full-attention layers), on
a real text that is not one of kvdemo's cases (Gemma's terms of use, shipped in its package). Two questions on one
prefill of a quantized cache (`quanto:4`: the full-attention layers quantized, the sliding ones kept): each answer
restores the cache exactly and equals a fresh single-question run; the cache's bytes by layer kind equal the formula.

Skipped, with the reason, only where the Gemma 3 packages are not installed: CI does not install them (the download
and the one-off conversion cost about 2-5 minutes of the 30-minute budget; the family matrix covers every layer
kind on tiny models). Cost where installed: about 60 s on 2 cores (a converted copy loaded, three prefills of
1,200 tokens)."""

from __future__ import annotations

import html
import math
import re
from importlib.resources import files

import pytest
import torch

from kvdemo.cache.spec import CacheSpec, estimate_kv_bytes
from kvdemo.qa.packaged import GEMMA3_PACKAGE, GEMMA3_PIP, gemma3_installed, gemma3_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(not gemma3_installed(), reason=f"Gemma 3 270M is not installed: {GEMMA3_PIP}"),
]

CONTEXT_TOKENS = 1200
QUESTIONS = ("Who may use Gemma under these terms?", "What happens if you breach these terms?")
ANSWER_TOKENS = 12


def _terms_text() -> str:
    """The text of `GEMMA_TERMS.html` from the Gemma package, tags and scripts removed."""
    raw = files(GEMMA3_PACKAGE).joinpath("data/GEMMA_TERMS.html").read_text(encoding="utf-8")
    raw = re.sub(r"(?is)<(script|style).*?</\1>", " ", raw)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", raw))).strip()


def test_gemma3_answers_two_questions_with_exact_restore():
    from kvdemo.qa.models import load_model
    from kvdemo.qa.session import QASession

    loaded = load_model(gemma3_path())
    assert loaded.describe()["layer_kinds"] == "15 sliding_attention + 3 full_attention layers"
    text = _terms_text()
    start = text.index("Gemma Terms of Use", 200)  # past the site's navigation
    ids = loaded.tokenizer(text[start:], add_special_tokens=False)["input_ids"][:CONTEXT_TOKENS]
    context = loaded.tokenizer.decode(ids)
    spec = CacheSpec("quanto", nbits=4)
    session = QASession(loaded, spec)
    report = session.prefill(context, max_new_tokens=ANSWER_TOKENS)
    length = session.cache_length
    assert length == report.context_tokens > 1000  # every layer saw the context (the sliding ones keep 511)
    kinds = report.memory.bytes_by_kind()
    assert kinds["sliding"] == 15 * 2 * 256 * 511 * 4 and kinds["full"] == 0 and kinds["quantized"] > 0
    assert estimate_kv_bytes(spec, loaded.config, length, loaded.dtype) == report.memory.cache_bytes
    answers = [session.ask(question, max_new_tokens=ANSWER_TOKENS) for question in QUESTIONS]
    assert all(answer.cache_length_after == length and answer.steps > 0 for answer in answers)
    scores = [session.score(q, a.token_ids) for q, a in zip(QUESTIONS, answers)]
    again = [session.score(q, a.token_ids) for q, a in zip(QUESTIONS, answers)]
    assert all(torch.equal(a, b) for a, b in zip(scores, again))  # restored twice: Δ 0
    fresh = QASession(loaded, spec)  # the second question alone, on a fresh prefill: the same answer
    fresh.prefill(context, max_new_tokens=ANSWER_TOKENS)
    alone = fresh.ask(QUESTIONS[1], max_new_tokens=ANSWER_TOKENS)
    assert alone.token_ids == answers[1].token_ids
    assert torch.equal(fresh.score(QUESTIONS[1], answers[1].token_ids), scores[1])


def test_gemma3_through_every_door():
    """Issue 52's check on the real model: the comparison of `quanto:4` (sliding windows kept), `quanto:4,
    sliding=quantize` and `turboquant:4`, with the perplexity, a plan within a budget between the smallest and the
    largest quanto cache, and the needle grid at one length. Each layer compared with what it holds: a kept window
    exactly `dynamic`'s, a quantized one off by a 4-bit step; the plan within its budget; every cache restored."""
    from kvdemo.compare.run import compare
    from kvdemo.needle.grid import answer_tokens_needed, needle_grid
    from kvdemo.qa.models import load_model

    loaded = load_model(gemma3_path())
    text = _terms_text()
    start = text.index("Gemma Terms of Use", 200)
    ids = loaded.tokenizer(text[start:], add_special_tokens=False)["input_ids"][:CONTEXT_TOKENS]
    context = loaded.tokenizer.decode(ids)
    specs = [CacheSpec.parse(t) for t in ("quanto:4", "quanto:4,sliding=quantize", "turboquant:4")]
    from kvdemo.qa.session import QASession

    tokens = len(QASession(loaded).context_ids(context))  # the prefill's tokens: the budget is per token at that length
    low, high = (
        estimate_kv_bytes(CacheSpec("quanto", nbits=b), loaded.config, tokens, loaded.dtype) / tokens for b in (2, 4)
    )
    budget = (low + high) / 2
    report = compare(
        loaded,
        context,
        QUESTIONS[:1],
        specs,
        max_new_tokens=8,
        perplexity_tokens=16,
        plans=[(CacheSpec("quanto"), budget)],
    )
    by_text = {r.spec_text: r for r in report.results}
    kinds = [("window" if "sliding" in t else "all tokens") for t in loaded.config.layer_types]
    for text_, result in by_text.items():
        assert list(result.kv_error.reads) == kinds and result.restored, text_
        assert math.isfinite(result.kl.mean_kld) and math.isfinite(result.perplexity.ratio_to_dynamic), text_
        for layer, stored in enumerate(result.kv_error.quantized):
            worst = max(result.kv_error.keys[layer] + result.kv_error.values[layer])
            assert worst < (0.5 if stored else 1e-6), (text_, layer, worst)
    assert sum(by_text["quanto:4"].kv_error.quantized) == 3
    assert sum(by_text["quanto:4,sliding=quantize"].kv_error.quantized) == 18
    plan = next(r for r in report.results if r.spec_text.startswith("quanto,plan="))
    assert plan.bytes_per_token <= budget * 1.02  # the prefill's residual of its last tokens beside the plan's bytes
    needed = answer_tokens_needed(loaded, [1024], [50.0], seed=0)
    grid = needle_grid(loaded, ["dynamic", "quanto:4"], [1024], [50.0], seed=0, max_new_tokens=needed)
    assert all(c.cache_length_after == 1024 and c.score <= 0 for c in grid.cells)
    print({t: (round(r.kl.mean_kld, 4), round(r.kv_error.total, 4), r.kv_bytes) for t, r in by_text.items()})
    print(report.plans, [(c.spec_text, c.hit, round(c.score, 2)) for c in grid.cells])


def test_gemma3_starts_on_its_own_recommended_spec(embedded, tmp_path, monkeypatch):
    """Issue 55: a model loaded on the page starts on its own recommendation at the default ceiling, measured once on
    the built-in text and stored. Gemma 3 270M moves its answers 4-10 times more than the embedded model under
    `quanto:4`, so its pick must keep the ceiling in a way that fits it, within fp8's bytes."""
    from types import SimpleNamespace

    from kvdemo.compare.recommend import DEFAULT_MAX_KL
    from kvdemo.qa.models import load_model
    from kvdemo.serve.recommended import stored
    from kvdemo.serve.server import App
    from kvdemo.ui.ask_tab import AskTab

    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path))  # measured here, not read from the user's folder
    gemma = load_model(gemma3_path())
    app = App(loader=lambda source: gemma if source == "gemma" else embedded, measure_defaults=True)
    app.start_loading()
    app.wait_for_model()
    seen: list[str] = []
    app.load("gemma", on_progress=lambda done, total, what: seen.append(what))
    found = app.recommended
    assert found is not None and found.model == gemma.name and seen[-1] == f"picked {found.pick}"
    assert stored(gemma) == found  # kept for the next load
    picked = found.picked
    assert picked is not None and picked.mean_kl is not None and picked.mean_kl <= DEFAULT_MAX_KL
    fp8 = next(row for row in found.rows if row.spec == "fp8")
    assert picked.bytes_per_token[0] <= fp8.bytes_per_token[0]
    backend, *_, note, memory = AskTab(app).start_spec(None, SimpleNamespace(session_hash="fresh"))
    assert CacheSpec.parse(found.pick).backend == backend and backend in memory
    assert note.startswith("ℹ Recommended for this model: `" + found.pick)


def test_gemma3_recommends_a_quantized_setting_on_a_real_text():
    """Issue 66: on Gemma 3 270M and a text it was not chosen on (a Wikipedia article of about 1,500 tokens, two of
    its questions), the recommendation at the default ceiling is not `dynamic` while fp8 fits: every candidate with
    fewer bytes than the pick was measured over the ceiling (or refused), the pick within it and within fp8's bytes,
    and the sentence names only figures measured in full or bounds."""
    from kvdemo.compare.recommend import DEFAULT_MAX_KL, recommend
    from kvdemo.compare.recommendation import BOUND, FULL
    from kvdemo.evals.cases import example_path, load_case
    from kvdemo.qa.models import load_model

    gemma = load_model(gemma3_path())
    case = load_case(example_path("southern_california")).select("0-11")
    found = recommend(gemma, case.context, [q.question for q in case.answerable(2)], plans=False)
    picked = found.picked
    assert picked is not None and picked.backend != "dynamic" and picked.measured == FULL
    assert picked.mean_kl is not None and picked.mean_kl <= DEFAULT_MAX_KL
    fp8 = next(row for row in found.rows if row.spec == "fp8")
    assert picked.bytes_per_token[0] <= fp8.bytes_per_token[0]
    smaller = [r for r in found.rows[1:] if r.bytes_per_token[0] < picked.bytes_per_token[0]]
    assert smaller and all(
        (r.measured in (FULL, BOUND) and r.kl > DEFAULT_MAX_KL) or r.note.startswith("refused")  # type: ignore[operator]
        for r in smaller
    )
    assert not [r for r in found.rows if "q5_1" in r.spec and r.note.startswith("refused")]  # the replayed check
    assert f"{picked.mean_kl:.4f}" in found.why and "KL (probe)" not in found.why
