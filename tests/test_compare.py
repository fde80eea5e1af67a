"""kvdemo.evals.metrics and kvdemo.compare.run: SQuAD metrics and the unanswerable rule on hand-made cases, KL
divergence, and comparisons on a tiny model checked against `QASession`, `kv_memory` and `kvdemo.evals.fidelity` on
the same caches.

Cost: 22 s for 34 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import io
import json
import math
import threading

import pandas as pd
import pytest
import torch

from kvdemo import CacheSpec, QASession
from kvdemo.cache.state.telemetry import flushed_layers, kv_memory
from kvdemo.compare.measure import ComparisonRun, first_departure, measure_spec
from kvdemo.compare.records import ComparisonCancelled, json_ready
from kvdemo.compare.run import compare
from kvdemo.evals import cache_error, fidelity
from kvdemo.evals.metrics import (
    common_prefix,
    contains_gold,
    kl_divergence,
    normalize_answer,
    says_unanswerable,
    score_against_gold,
    token_f1,
)

CONTEXT = "The Normans were the people who gave their name to Normandy. Rollo led them."
QUESTIONS = ["Who led them?", "Where?"]


def test_squad_normalisation():
    assert normalize_answer("The Normans, in  FRANCE!") == "normans in france"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("Doesn't say.") == "doesnt say"


def test_token_f1_and_containment():
    assert token_f1("Rollo", "Rollo") == 1.0
    assert token_f1("the leader was Rollo", "Rollo") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert token_f1("Charles", "Rollo") == 0.0
    assert contains_gold("Their leader was Rollo.", ["rollo"]) is True
    assert contains_gold("Rolloesque", ["Rollo"]) is False  # whole words only
    assert contains_gold("anything", []) is False


@pytest.mark.parametrize(
    "answer, expected",
    [
        ("The text does not say.", True),
        ("It doesn't mention who built it.", True),
        ("That is not mentioned in the context.", True),
        ("There is no information about that.", True),
        ("Unknown.", True),
        ("Rollo led them.", False),
        ("He said it was unknowable", False),  # whole phrases only
        ("", False),
    ],
)
def test_says_unanswerable(answer, expected):
    assert says_unanswerable(answer) is expected


def test_score_against_gold_answerable_and_unanswerable():
    assert score_against_gold("Rollo", ["Rollo", "Rollo the Viking"]) == (s := score_against_gold("rollo.", ["Rollo"]))
    assert (s.exact_match, s.contains_gold, s.f1) == (1.0, 1.0, 1.0)
    s = score_against_gold("Their leader was Rollo.", ["Rollo"])
    assert (s.exact_match, s.contains_gold) == (0.0, 1.0) and s.f1 == pytest.approx(0.4)  # P 1/4, R 1
    # an abstention on an answerable question is wrong, even if it repeats words of the gold answer
    s = score_against_gold("The text does not say who Rollo was.", ["Rollo"])
    assert (s.exact_match, s.contains_gold, s.f1) == (0.0, 0.0, 0.0)
    # unanswerable (empty gold list): right only when the answer says the text does not give it
    s = score_against_gold("The passage does not mention it.", [])
    assert (s.exact_match, s.contains_gold, s.f1) == (1.0, 1.0, 1.0)
    s = score_against_gold("It was founded in 911.", [])
    assert (s.exact_match, s.contains_gold, s.f1) == (0.0, 0.0, 0.0)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4]) == 2 and common_prefix([], [1]) == 0 and common_prefix([5], [5]) == 1


def test_kl_divergence_by_hand():
    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]]).log()
    q = torch.tensor([[0.9, 0.1], [0.9, 0.1]]).log()
    kl = kl_divergence(p, q)
    assert kl[0].item() == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-5)
    assert kl[1].item() == 0.0
    assert kl_divergence(p, p).abs().max().item() == 0.0
    with pytest.raises(ValueError, match="differ"):
        kl_divergence(p, q[:1])


def test_kl_divergence_with_zero_probabilities():
    """0 log 0 = 0 (issue 23, p-e-w/heretic PR#348): a token both give zero probability adds nothing, so equal rows
    give 0, not NaN; P > 0 where Q = 0 gives +inf; the statistics carry +inf and never NaN, and the report's JSON
    writes it out as "inf" (strict JSON, as JSON.parse reads it)."""
    inf = float("inf")
    p = torch.tensor([[0.5, 0.5, 0.0], [0.9, 0.1, 0.0]]).log()  # the third token masked: log 0 = -inf
    assert torch.isneginf(p[:, 2]).all()
    assert kl_divergence(p, p).tolist() == [0.0, 0.0]
    q = torch.tensor([[0.5, 0.0, 0.5], [0.9, 0.1, 0.0]]).log()  # row 0: Q gives 0 where P gives 0.5
    kl = kl_divergence(p, q)
    assert kl[0].item() == inf and kl[1].item() == 0.0
    assert kl_divergence(q, p)[0].item() == inf  # and the other way round
    stats = fidelity.kl_statistics([p, p], [q, p], [[0, 0], [0, 0]])
    figures = [stats.mean_kld, stats.median_kld, stats.p99_kld, stats.max_kld, stats.mean_abs_dlogp]
    assert not any(math.isnan(f) for f in figures), figures
    assert stats.mean_kld == inf and stats.max_kld == inf and stats.median_kld == 0.0  # 3 of 4 positions are 0
    assert fidelity.percentile(torch.tensor([0.0, inf]), 0.0) == 0.0  # not 1 x 0 + 0 x inf = NaN
    assert fidelity.percentile(torch.tensor([inf, inf]), 0.5) == inf
    ready = json_ready({"kl": {"mean_kld": inf, "min": -inf, "missing": float("nan")}, "rows": [(1.5, inf)]})
    assert ready == {"kl": {"mean_kld": "inf", "min": "-inf", "missing": "nan"}, "rows": [[1.5, "inf"]]}
    assert json_ready([float("nan")], nan=None) == [None]
    json.loads(json.dumps(ready, allow_nan=False))


def test_dynamic_against_itself_has_zero_kl_and_identical_answers(tiny):
    run = ComparisonRun(tiny, CONTEXT, tuple(QUESTIONS), max_new_tokens=6)
    first, reference = measure_spec(run, CacheSpec("dynamic"))
    # the teacher-forced scoring reproduces the generation: each row's argmax is the answer's token
    for ids, logprobs in zip(reference.token_ids, reference.logprobs):
        assert logprobs.shape == (len(ids), len(tiny.tokenizer)) and tuple(logprobs.argmax(-1).tolist()) == ids
    # a second, independent session (its own prefill) measured against the first one
    second, _ = measure_spec(run, CacheSpec("dynamic"), reference=reference)
    assert [q.kl_nats for q in second.questions] == [0.0, 0.0]
    assert all(q.identical_to_dynamic and q.common_prefix_tokens == len(q.token_ids) == 6 for q in second.questions)
    assert second.kv_bytes == first.kv_bytes and second.restored


def test_compare_against_sessions_and_kv_memory(tiny):
    specs = [CacheSpec("hqq", nbits=2, residual_length=2), CacheSpec("fp8"), CacheSpec("dynamic"), CacheSpec("fp8")]
    progress = []
    report = compare(
        tiny,
        CONTEXT,
        QUESTIONS,
        specs,
        max_new_tokens=5,
        gold_answers=[["Rollo"], []],
        on_progress=lambda done, total, what: progress.append((done, total)),
    )
    assert [r.spec_text for r in report.results] == ["dynamic", "hqq:2,residual_length=2", "fp8"]  # dynamic once, first
    assert progress[-1] == (15, 15) and [d for d, _ in progress] == sorted(d for d, _ in progress)
    dynamic = report.results[0]
    assert dynamic.ratio_to_dynamic == 1.0 and all(q.kl_nats == 0.0 for q in dynamic.questions)
    for result, spec in zip(report.results[1:], specs[:2]):
        session = QASession(tiny, spec)
        prefill = session.prefill(CONTEXT)
        memory = kv_memory(session.cache)
        assert (result.kv_bytes, result.quantized_bytes, result.residual_bytes) == (
            memory.total_bytes,
            memory.quantized_bytes,
            memory.residual_bytes,
        )
        assert result.bytes_per_token == memory.total_bytes / prefill.context_tokens
        assert result.ratio_to_dynamic == pytest.approx(memory.total_bytes / dynamic.kv_bytes)
        assert [q.token_ids for q in result.questions] == [session.ask(q, 5).token_ids for q in QUESTIONS]
        assert all(q.cache_length_after == prefill.context_tokens for q in result.questions) and result.restored
        # KL against dynamic's teacher-forced distributions, recomputed here by hand
        ref_session = QASession(tiny, CacheSpec("dynamic"))
        ref_session.prefill(CONTEXT)
        for q, ref in zip(result.questions, dynamic.questions):
            expected = kl_divergence(
                ref_session.score(q.question, ref.token_ids), session.score(q.question, ref.token_ids)
            )
            assert q.kl_nats == pytest.approx(float(expected.mean()), abs=1e-6) and q.kl_nats > 0
    hqq = report.results[1]
    assert hqq.flushes > 0 and sum(q.flush_steps for q in hqq.questions) > 0 and hqq.flush_seconds > 0
    assert [q.answerable for q in hqq.questions] == [True, False]
    frame = report.to_frame()
    assert list(frame["spec"]) == [r.spec for r in report.results]
    assert frame["identical to dynamic"].iloc[0] == 1.0 and frame["KL (nats)"].iloc[0] == 0.0
    assert frame["KL (nats)"].iloc[1] == pytest.approx(sum(q.kl_nats for q in hqq.questions) / 2)
    assert not math.isnan(frame["F1"].iloc[0]) and frame["restored"].all()
    data = json.loads(json.dumps(report.to_dict()))
    assert data["results"][1]["questions"][0]["token_ids"] == list(hqq.questions[0].token_ids)
    # each row's deploy lines: the engines that store it the same way, kvdemo's own last (compare --json, MCP)
    for row, result in zip(data["results"], report.results):
        spec = CacheSpec.parse(result.spec_text)
        assert row["deploy"] == [d.line for d in spec.deployments(tiny.config)] and row["deploy"][-1].startswith(
            "kvdemo:"
        )
    assert frame["deploy"].tolist() == [
        "every engine's default cache",
        'transformers: model.generate(..., cache_implementation="quantized", cache_config={"backend": "hqq", '
        '"nbits": 2, "residual_length": 2})',
        'transformers: model.generate(..., cache_implementation="quantized", cache_config={"backend": "fp8"}) · '
        "TensorRT-LLM: ModelOpt hf_ptq.py --kv_cache_qformat fp8 (its calibration sets the scales; kvdemo sets them "
        'from this prefill), then LLM(..., kv_cache_config=KvCacheConfig(dtype="fp8"))',
    ]


def test_compare_without_gold_has_nan_gold_columns(tiny):
    frame = compare(tiny, CONTEXT, QUESTIONS[:1], [], max_new_tokens=2).to_frame()
    assert len(frame) == 1 and math.isnan(frame["F1"].iloc[0]) and math.isnan(frame["contains gold"].iloc[0])


def test_cancel_stops_at_the_next_step_and_keeps_finished_specs(tiny):
    cancel = threading.Event()

    def on_progress(done, total, what):
        if what.startswith("hqq:4: answered 1/"):
            cancel.set()

    with pytest.raises(ComparisonCancelled) as caught:
        compare(
            tiny,
            CONTEXT,
            QUESTIONS,
            [CacheSpec("hqq", nbits=4)],
            max_new_tokens=4,
            cancel=cancel,
            on_progress=on_progress,
        )
    assert [r.backend for r in caught.value.report.results] == ["dynamic"]


def test_a_long_prefill_shows_its_chunks_and_layers_and_cancel_acts_within_one_chunk(tiny):
    context = " ".join([CONTEXT] * 20)  # two 256-token chunks on the 512-token window
    notes: list[str] = []

    def run(**kwargs):
        return compare(tiny, context, QUESTIONS[:1], [CacheSpec("hqq", nbits=4)], max_new_tokens=2, **kwargs)

    run(on_progress=lambda *a: notes.append(a[2]))
    tokens = QASession(tiny).prepare(context, max_tokens=tiny.max_context_tokens).split.prefix
    total = f"{len(tokens):,}"
    assert 256 < len(tokens) <= 512 - 64
    for spec in ("dynamic", "hqq:4"):
        assert (
            f"{spec}: prefilling 256 of {total} tokens" in notes
            and f"{spec}: prefilling {total} of {total} tokens" in notes
        )
    layers = tiny.config.num_hidden_layers
    assert [n for n in notes if "quantizing" in n] == [
        f"hqq:4: quantizing the cache, {k} of {layers} layers" for k in range(layers + 1)
    ]
    assert notes.index(f"hqq:4: prefilling {total} of {total} tokens") < notes.index(
        f"hqq:4: quantizing the cache, 0 of {layers} layers"
    )

    cancel, seen = threading.Event(), []

    def on_progress(done, total_, what):
        seen.append(what)
        if what == f"hqq:4: prefilling 256 of {total} tokens":
            cancel.set()

    with pytest.raises(ComparisonCancelled) as caught:
        run(cancel=cancel, on_progress=on_progress)
    assert [r.backend for r in caught.value.report.results] == ["dynamic"]
    assert seen[-1] == f"hqq:4: prefilling 256 of {total} tokens"  # no second chunk ran


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(questions=[]), "at least one question"),
        (dict(questions=["ok", "  "]), "question 2 is empty"),
        (dict(gold_answers=[["x"]]), "gold_answers has 1 entries for 2 questions"),
        (dict(max_new_tokens=0), "max_new_tokens=0 must be a whole number >= 1"),
        (dict(specs=[CacheSpec("hqq", nbits=4, q_group_size=48)]), "q_group_size=48"),
        (dict(context="   "), "the context is empty"),
    ],
)
def test_bad_input_is_refused(tiny, kwargs, message):
    args = dict(context=CONTEXT, questions=QUESTIONS, specs=[], max_new_tokens=2) | kwargs
    with pytest.raises(ValueError, match=message):
        compare(tiny, **args)


LONG_CONTEXT = CONTEXT + " They came from Denmark, Iceland and Norway and settled on the Seine. " * 2
CONTINUATION = " In the following century the Normans spread to England, Italy and the Near East. " * 2


def test_fidelity_figures_against_sessions_by_hand(tiny):
    specs = [CacheSpec("hqq", nbits=2, residual_length=2), CacheSpec("fp8")]
    progress = []
    report = compare(
        tiny,
        LONG_CONTEXT,
        QUESTIONS,
        specs,
        max_new_tokens=5,
        perplexity_tokens=12,
        continuation=CONTINUATION,
        on_progress=lambda done, total, what: progress.append((done, total)),
    )
    assert progress[-1] == (18, 18)  # 3 specs x (prefill + 2 answers + 2 scores + 1 perplexity unit)
    assert report.perplexity_source == "continuation"
    dynamic, hqq, fp8 = report.results
    assert (dynamic.nbits, dynamic.options, hqq.nbits, fp8.nbits) == (None, {"storage": "concat"}, 2, None)
    assert hqq.options == specs[0].resolved() and hqq.backend == "hqq"
    # dynamic against itself: zeros, 100 % the same top token, no cache error, PPL ratio 1
    assert (dynamic.kl.mean_kld, dynamic.kl.max_kld, dynamic.kl.same_top_p) == (0.0, 0.0, 100.0)
    assert dynamic.kv_error.total == 0.0 and dynamic.drift is None and dynamic.perplexity.ratio_to_dynamic == 1.0
    ref_session = QASession(tiny, CacheSpec("dynamic"))
    ref_session.prefill(LONG_CONTEXT)
    ref_ids = [q.token_ids for q in dynamic.questions]
    ref_logprobs = [ref_session.score(q, ids) for q, ids in zip(QUESTIONS, ref_ids)]
    inputs = fidelity.perplexity_inputs(tiny, LONG_CONTEXT, 12, CONTINUATION)
    reference = cache_error.reference_kv(tiny, inputs.context_ids)
    for result, spec in zip((hqq, fp8), specs):
        session = QASession(tiny, spec)
        session.prefill(LONG_CONTEXT)
        expected_error = cache_error.kv_error(reference, session.cache)
        assert result.kv_error == expected_error and result.kv_error.total > 0
        runs, logprobs = [], []
        for question, ids in zip(QUESTIONS, ref_ids):
            errors = []

            def after_step(_, cache, errors=errors):
                if flushed_layers(cache):
                    errors.append(cache_error.context_error(reference, cache))

            logprobs.append(session.score(question, ids, on_step=after_step))
            runs.append(tuple(errors))
        stats = fidelity.kl_statistics(ref_logprobs, logprobs, ref_ids)
        for name in ("mean_kld", "median_kld", "p99_kld", "max_kld", "same_top_p", "mean_abs_dlogp", "p99_abs_dlogp"):
            assert getattr(result.kl, name) == pytest.approx(getattr(stats, name), abs=1e-6), name
        assert result.kl.positions == sum(len(ids) for ids in ref_ids) == 10
        for q, run in zip(result.questions, runs):
            assert q.context_errors == pytest.approx(run)
        ppl = fidelity.perplexity(tiny, spec, inputs, reference=reference)
        assert result.perplexity.perplexity == pytest.approx(ppl.perplexity, rel=1e-6)
        assert result.perplexity.ratio_to_dynamic == pytest.approx(ppl.perplexity / dynamic.perplexity.perplexity)
        assert result.perplexity.context_errors == pytest.approx(ppl.context_errors)
        expected_drift = cache_error.drift_ratio(expected_error.total, runs + [ppl.context_errors])
        assert (result.drift, result.drift_flushes) == (pytest.approx(expected_drift[0]), expected_drift[1])
    assert hqq.drift_flushes == 6 and len(hqq.perplexity.flush_steps) == 6  # 12 fed tokens, residual_length 2
    assert fp8.drift is None and fp8.drift_flushes == 0  # fp8 appends, never flushes
    # the full table and its CSV, the JSON the CLI prints
    frame = report.to_frame()
    assert list(frame.columns) == list(report.COLUMNS)
    assert frame["same top p (%)"].tolist() == [r.kl.same_top_p for r in report.results]
    assert frame["99.0% KLD"].tolist() == [r.kl.p99_kld for r in report.results]
    assert frame["PPL ratio to dynamic"].iloc[0] == 1.0 and frame["nbits"].iloc[1] == 2
    assert frame["flush"].fillna("").tolist() == ["", "requantize", ""]  # each spec's policies, empty where not taken
    assert frame["storage"].fillna("").tolist() == ["concat", "", ""]
    assert frame["KL (nats)"].tolist() == [r.kl.mean_kld for r in report.results]
    from_csv = pd.read_csv(io.StringIO(report.to_csv()))
    assert list(from_csv.columns) == list(report.COLUMNS)
    assert from_csv["KV bytes"].tolist() == frame["KV bytes"].tolist()
    assert from_csv["K error"].tolist() == pytest.approx(frame["K error"].tolist())
    data = json.loads(report.to_json())
    assert data == json.loads(json.dumps(report.to_dict()))
    assert data["results"][1]["kv_error"]["keys"] == [list(row) for row in hqq.kv_error.keys]
    assert data["results"][1]["kl"]["same_top_p"] == hqq.kl.same_top_p and data["perplexity_source"] == "continuation"


def test_perplexity_on_the_tail_of_the_text(tiny):
    report = compare(
        tiny,
        LONG_CONTEXT,
        QUESTIONS[:1],
        [CacheSpec("quanto", nbits=4, residual_length=4)],
        max_new_tokens=2,
        perplexity_tokens=10,
    )
    assert report.perplexity_source == "tail"
    inputs = fidelity.perplexity_inputs(tiny, LONG_CONTEXT, 10)
    expected = fidelity.perplexity(tiny, CacheSpec("dynamic"), inputs)
    dynamic, quanto = report.results
    assert dynamic.perplexity.perplexity == pytest.approx(expected.perplexity, rel=1e-6)
    assert dynamic.perplexity.context_tokens == quanto.perplexity.context_tokens == len(inputs.context_ids)
    # the held-out tail's context is a prefix of the questions' context: its reference is the first positions
    assert quanto.perplexity.prefill_context_error > 0 and len(quanto.perplexity.context_errors) == 2


def test_cancel_during_the_perplexity_feed(tiny):
    cancel = threading.Event()

    def on_progress(done, total, what):
        if what.startswith("fp8: perplexity"):
            cancel.set()

    with pytest.raises(ComparisonCancelled) as caught:
        compare(
            tiny,
            LONG_CONTEXT,
            QUESTIONS[:1],
            [CacheSpec("fp8")],
            max_new_tokens=2,
            perplexity_tokens=34,
            continuation=CONTINUATION,
            cancel=cancel,
            on_progress=on_progress,
        )
    assert [r.backend for r in caught.value.report.results] == ["dynamic"]
    assert caught.value.report.perplexity_source == "continuation"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(perplexity_tokens=-1), "perplexity_tokens=-1 must be a whole number >= 0"),
        (dict(perplexity_tokens=1.5), "perplexity_tokens=1.5 must be a whole number >= 0"),
        (dict(perplexity_tokens=50, continuation=" Rollo."), "the continuation holds 3 tokens; scoring 50 needs 51"),
        (dict(perplexity_tokens=100), "holding out its last 101 to score 100 leaves none to prefill"),
    ],
)
def test_bad_perplexity_input_is_refused_before_anything_runs(tiny, kwargs, message):
    progress = []
    with pytest.raises(ValueError, match=message):
        compare(tiny, CONTEXT, QUESTIONS, [], max_new_tokens=2, on_progress=lambda *a: progress.append(a), **kwargs)
    assert progress == []


def test_first_departure_on_hand_made_answers():
    class Loaded:  # what first_departure reads of a LoadedModel
        class tokenizer:
            decode = staticmethod(lambda ids: f"<{ids[0]}>")

    dynamic_lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]]), dim=-1)
    spec_lp = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0], [1.0, 0.0, 2.0], [5.0, 0.0, 0.0]]), dim=-1)
    assert first_departure(Loaded, [1, 0, 2], [1, 0, 2], spec_lp, dynamic_lp) is None
    dep = first_departure(Loaded, [1, 2, 0], [1, 0, 2], spec_lp, dynamic_lp)
    assert (dep.position, dep.dynamic_token, dep.spec_token) == (1, "<0>", "<2>")
    assert dep.dynamic_logprobs == (float(dynamic_lp[1, 0]), float(dynamic_lp[1, 2]))
    assert dep.spec_logprobs == (float(spec_lp[1, 0]), float(spec_lp[1, 2]))
    assert dep.describe("hqq:2") == (
        f"token 2: '<2>' (log p {float(spec_lp[1, 2]):.2f} here, {float(dynamic_lp[1, 2]):.2f} under dynamic) "
        f"where dynamic has '<0>' ({float(dynamic_lp[1, 0]):.2f} under dynamic, {float(spec_lp[1, 0]):.2f} here)"
    )
    ended = first_departure(Loaded, [1], [1, 0, 2], spec_lp, dynamic_lp)  # the spec's answer ended first
    assert (ended.position, ended.spec_token) == (1, None)
    assert ended.spec_logprobs[1] is None and ended.dynamic_logprobs[1] is None
    assert ended.describe("fp8").startswith("token 2: the end (log p - here, - under dynamic) where dynamic has '<0>'")
    longer = first_departure(Loaded, [1, 0, 2, 2], [1, 0, 2], spec_lp, dynamic_lp)  # dynamic's ended first
    assert (longer.position, longer.dynamic_token, longer.spec_token) == (3, None, "<2>")
    assert longer.spec_logprobs == longer.dynamic_logprobs == (None, None)


def test_answers_side_by_side_with_the_first_departure_from_dynamic(embedded):
    """On the embedded model, whose answer a 2-bit cache changes at once: the departure as measured by hand."""
    spec, question = CacheSpec("quanto", nbits=2, residual_length=2), "Where did they settle?"
    report = compare(embedded, LONG_CONTEXT, [question], [spec], max_new_tokens=6)
    (d,), (q,) = (r.questions for r in report.results)
    assert d.departure is None and not q.identical_to_dynamic  # the reference against itself; a changed answer
    at, dep = q.common_prefix_tokens, q.departure
    theirs, ours = d.token_ids[at], q.token_ids[at]
    assert dep.position == at and (dep.dynamic_token, dep.spec_token) == tuple(
        embedded.tokenizer.decode([t]) for t in (theirs, ours)
    )
    under = {}  # dynamic's answer teacher-forced through each cache, by hand
    for s in (CacheSpec("dynamic"), spec):
        session = QASession(embedded, s)
        session.prefill(LONG_CONTEXT)
        under[s.backend] = session.score(question, d.token_ids)[at].tolist()
    assert dep.dynamic_logprobs == pytest.approx((under["dynamic"][theirs], under["dynamic"][ours]), abs=1e-5)
    assert dep.spec_logprobs == pytest.approx((under["quanto"][theirs], under["quanto"][ours]), abs=1e-5)
    # each cache's greedy step chose its own token from these very distributions
    assert dep.spec_logprobs[1] >= dep.spec_logprobs[0] and dep.dynamic_logprobs[0] >= dep.dynamic_logprobs[1]
    frame = report.answers_frame()
    assert list(frame.columns) == list(report.ANSWER_COLUMNS)
    assert frame.to_dict("list") == {
        "question": [question, question],
        "spec": ["dynamic", spec.text],
        "answer": [d.answer, q.answer],
        "finish": [d.finish_reason, q.finish_reason],
        "first departure from dynamic": ["(the reference)", dep.describe(spec.text)],
    }
    assert json.loads(report.to_json())["results"][1]["questions"][0]["departure"]["position"] == at


def test_each_spec_frees_its_cache_before_the_next_by_reference_counting(tiny, monkeypatch):
    """A comparison and a needle grid free each spec's session and cache before the next one runs, with the cyclic
    garbage collector off: no cycle holds a session, so no `gc.collect()` is needed (it cost 0.24 s a spec in a
    process holding Gradio and the tests' models)."""
    import gc
    import weakref

    from kvdemo.evals import fidelity as fidelity_module
    from kvdemo.needle.grid import answer_tokens_needed, needle_grid
    from kvdemo.qa import session as session_module

    built: list = []

    def recording(build):
        def build_cache(spec, config):
            assert sum(ref() is not None for ref in built) == 0, "an earlier cache is still alive"
            cache = build(spec, config)
            built.append(weakref.ref(cache))
            return cache

        return build_cache

    for module in (session_module, fidelity_module):
        monkeypatch.setattr(module, "build_cache", recording(module.build_cache))
    gc.disable()
    try:
        specs = [CacheSpec.parse("hqq:4,residual_length=4"), CacheSpec("fp8")]
        compare(tiny, "Rollo led the Normans. " * 10, ["Who led them?"], specs, 3, perplexity_tokens=4)
        assert len(built) == 6 and all(ref() is None for ref in built)  # 3 specs x (session + perplexity)
        built.clear()
        needed = answer_tokens_needed(tiny, [96], [50.0], seed=0)
        needle_grid(tiny, ["dynamic", "quanto:4"], [96], [50.0], seed=0, max_new_tokens=needed)
        assert len(built) == 2 and all(ref() is None for ref in built)
    finally:
        gc.enable()
