"""Data made once and handed down: a comparison tokenizes its context once for its reservation and all its specs
(`LoadedModel.prepare` in the door's `LongJob.compare`, `PreparedContext`), a page prefill once for its reservation
and the prefill (`Door.prefill`), and an answer its question once from the reservation to the decode loop
(`Door.answer`, `PreparedQuestion`).

Each count is of the tokenizer's own entry points (`__call__`, `encode`, `apply_chat_template`, nested calls
included) whose arguments hold the text, against the count of one `QASession.prepare` (the prompt split: the
template's reference ids and the split's probes, 39 calls on the Normans' first paragraph) or one
`QASession.question_ids`. (A perplexity without a continuation tokenizes the text once more, plainly, to count its
own tokens before holding its tail out: `fidelity.perplexity_inputs`.) Before this, a 3-spec comparison from the
page split its context 8 times (273 calls in
`compare` alone), a page prefill twice, and a page answer tokenized its question 3 times.

Each test runs on both runners (`kvdemo.serve.runner.InProcess`, and `kvdemo.serve.device.Device` with the worker's
generator run here, so that its calls are counted too): the worker takes the prepared ids and tokenizes nothing again.

Cost: 12 s in a pytest-xdist worker on 2 cores (2026-12-04): prefills and comparisons on the embedded model."""

from __future__ import annotations

import pytest

from kvdemo.cache.spec import CacheSpec
from kvdemo.qa.prompt import PreparedContext
from kvdemo.qa.session import QASession
from kvdemo.serve.device import Device
from kvdemo.serve.gpu_job import gpu_job, serve_model
from kvdemo.serve.server import App
from kvdemo.serve.warm_sessions import WARM

QUESTION = "Who gave their name to Normandy, a region in France?"


def _counting(monkeypatch, tokenizer, text: str) -> list[str]:
    """From now on, the name of every tokenizer entry point called with `text` in its arguments, in order."""
    calls: list[str] = []
    cls = type(tokenizer)
    for name in ("__call__", "encode", "apply_chat_template"):
        original = getattr(cls, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            if text in repr(args) or text in repr(kwargs):
                calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    return calls


def _counting_after_one_preparation(monkeypatch, tiny, context: str) -> tuple[list[str], int]:
    """The calls counted from now on with `context` (`_counting`), and how many one `QASession.prepare` of it
    makes (the count is then cleared)."""
    calls = _counting(monkeypatch, tiny.tokenizer, context[:120])
    tiny.prepare(context)
    one_preparation = len(calls)
    calls.clear()
    return calls, one_preparation


@pytest.fixture(params=["in process", "worker"])
def app(tiny, request, tmp_path) -> App:
    device = None
    if request.param == "worker":
        serve_model(tiny)
        device = Device(gpu_job, str(tmp_path / "sessions"), tmp_path / "stops")
    app = App(loader=lambda source: tiny, device=device)
    app.start_loading()
    app.wait_for_model()
    yield app
    WARM.clear()


def test_a_comparison_of_three_specs_tokenizes_its_context_once(tiny, normans, app, monkeypatch):
    context = normans.paragraphs[0]
    calls, one_preparation = _counting_after_one_preparation(monkeypatch, tiny, context)
    specs = [CacheSpec.parse("hqq:4"), CacheSpec.parse("quanto:4"), CacheSpec.parse("fp8")]
    continuation = "\n\n" + normans.paragraphs[1]
    with app.door.long_job("a", "busy") as job:  # what the Compare tab, the MCP tool and the command line do
        report = job.compare(context, ["Who?", "Where?"], specs, 3, perplexity_tokens=4, continuation=continuation)
    assert len(report.results) == 4 and [r.backend for r in report.results] == ["dynamic", "hqq", "quanto", "fp8"]
    assert one_preparation > 0 and len(calls) == one_preparation
    assert all(r.context_tokens == len(tiny.prepare(context).ids) for r in report.results)
    assert all(r.restored for r in report.results)


def test_a_page_prefill_tokenizes_its_context_once(tiny, normans, app, monkeypatch):
    context = normans.paragraphs[1]
    calls, one_preparation = _counting_after_one_preparation(monkeypatch, tiny, context)
    qa = app.door.prefill("k", CacheSpec.parse("hqq:4"), context, 8).session
    assert one_preparation > 0 and len(calls) == one_preparation
    assert qa.prefill_report.context_tokens == len(tiny.context_ids(context)) == qa.cache_length


def test_an_answer_tokenizes_its_question_once(tiny, normans, app, monkeypatch):
    qa = app.door.prefill("k", CacheSpec.parse("quanto:4,residual_length=4"), normans.paragraphs[0], 8).session
    calls = _counting(monkeypatch, tiny.tokenizer, QUESTION)
    q_ids = tiny.layout.question_ids(qa.split, QUESTION)
    one_tokenization = len(calls)
    calls.clear()
    with app.door.answer("k", QUESTION, 6) as run:  # what the Ask tab, the MCP tool and the command line do
        events = list(run)
    assert list(run.question.ids) == q_ids and len(events) == len(qa.history[-1].token_ids) >= 1
    assert qa.history[-1].question_tokens == len(q_ids) and qa.history[-1].question == QUESTION
    assert one_tokenization > 0 and len(calls) == one_tokenization


def test_a_prepared_question_or_context_is_refused_where_it_does_not_belong(tiny, normans):
    qa = QASession(tiny)
    qa.prefill(normans.paragraphs[0])
    prepared = qa.prepare_question(QUESTION, 4)
    qa.prefill(normans.paragraphs[1])  # another prefill: the question's ids were for the first context
    with pytest.raises(ValueError, match="the question was prepared for another prefill; prepare it again"):
        qa.stream(prepared)
    assert qa.ask(QUESTION, 2).cache_length_after == qa.prefill_report.context_tokens  # the session goes on
    made = QASession(tiny).prepare(normans.paragraphs[0])
    foreign = PreparedContext(made.text, made.split, tokenizer=object())  # as another model's tokenizer made it
    with pytest.raises(ValueError, match="prepared with another model's tokenizer; prepare it with this session"):
        qa.prefill(foreign)
    assert qa.context == normans.paragraphs[1]  # the refused prefill changed nothing
