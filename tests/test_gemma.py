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
