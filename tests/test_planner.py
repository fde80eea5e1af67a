"""The per-layer plan chosen for a byte budget (`kvdemo.evals.planner`): the queries recorded per layer in the
planner's thread only, the attention-output errors it measures, the exact choice (checked against every plan of the
tiny model's two layers), the refusals, and a comparison that runs the plan beside the best uniform spec.

Cost: 12 s in a pytest-xdist worker on 2 cores (the clean-clone CI of 2026-12-04): a tiny model's errors measured for
every candidate, and one comparison."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

from kvdemo import CacheSpec, QASession
from kvdemo.cache.layer_plan import LayerPrecision, parse_plan
from kvdemo.cache.layers.attention import recording_queries
from kvdemo.cache.spec import estimate_kv_bytes
from kvdemo.cache.state.telemetry import kv_memory
from kvdemo.compare.run import compare
from kvdemo.evals.cache_error import full_precision_kv, reference_kv
from kvdemo.evals.planner import choose_plan, layer_errors, plan_layers
from tests.helpers import make_tiny

CONTEXT = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region in France. "
    "They were descended from Norse raiders and pirates from Denmark, Iceland and Norway who, under their leader "
    "Rollo, agreed to swear fealty to King Charles III of West Francia."
)


@pytest.fixture(scope="module")
def ids(tiny):
    return QASession(tiny).context_ids(CONTEXT)


@pytest.fixture(scope="module")
def quanto_errors(tiny, ids):
    return layer_errors(tiny, ids, CacheSpec("quanto", q_group_size=32), query_tokens=16)


def _bytes(tiny, spec: CacheSpec, tokens: int) -> float:
    """Bytes per context token of `spec`'s cache holding `tokens` quantized tokens (the registry's formula)."""
    return estimate_kv_bytes(spec, tiny.config, tokens, tiny.dtype) / tokens


def test_queries_are_recorded_per_layer_in_this_thread_only(tiny, ids):
    other: dict = {}

    def elsewhere():  # another user's forward pass through the shared model, at the same time
        reference_kv(tiny, ids)
        other["done"] = True

    with recording_queries(5) as record:
        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
        reference_kv(tiny, ids)
    assert other["done"] and sorted(record.queries) == [0, 1]  # one prefill's: the thread's added nothing
    heads, head_dim = tiny.config.num_attention_heads, tiny.config.head_dim
    assert record.queries[0].shape == (1, heads, 5, head_dim)
    assert record.scaling[0] == pytest.approx(head_dim**-0.5)
    with recording_queries(5) as chunked:  # two forward passes: the last five positions of both
        reference_kv(tiny, ids[:-3])
    assert chunked.queries[0].shape[-2] == 5


def test_a_session_s_own_chunked_prefill_gives_the_same_errors(tiny, ids, quanto_errors):
    """A recommendation hands the planner its reference's prefill (chunked, queries recorded) instead of a second
    one: the errors equal the planner's own prefill's within float rounding; a prefill of other ids is refused."""
    session = QASession(tiny)
    with recording_queries(16) as record:
        session.prefill(CONTEXT, chunk_tokens=16)  # several chunks
    assert list(session.split.prefix) == list(ids)
    prefilled = (full_precision_kv(session.cache), record)
    again = layer_errors(tiny, ids, CacheSpec("quanto", q_group_size=32), query_tokens=16, prefilled=prefilled)
    for ours, theirs in zip((*again.keys, *again.values), (*quanto_errors.keys, *quanto_errors.values)):
        assert ours.keys() == theirs.keys() and all(ours[k] == pytest.approx(theirs[k], rel=1e-4) for k in ours)
    with pytest.raises(ValueError, match="prefill these ids under recording_queries"):
        layer_errors(tiny, ids[:-1], CacheSpec("quanto", q_group_size=32), query_tokens=16, prefilled=prefilled)


def test_the_errors_fall_with_the_bits_and_are_zero_for_an_exact_side(quanto_errors):
    assert quanto_errors.layers == 2 and quanto_errors.query_tokens == 16
    for layer in range(2):
        for rotation in ("none", "hadamard"):
            for side in (quanto_errors.keys, quanto_errors.values):
                assert 0 < side[layer][(4, rotation)] < side[layer][(2, rotation)]
    # the bytes are the registry's formula at each (key bits, value bits)
    assert quanto_errors.bytes_per_token[(4, 2)] == pytest.approx(
        (quanto_errors.bytes_per_token[(4, 4)] + quanto_errors.bytes_per_token[(2, 2)]) / 2
    )


def _brute_force(errors, budget):
    """The least summed error over every plan of the two layers within the budget (bytes)."""
    precisions = [LayerPrecision(k, v, r) for k, v in errors.bytes_per_token for r in ("none", "hadamard")]
    best = None
    for plan in itertools.product(precisions, repeat=errors.layers):
        if errors.plan_bytes(plan) <= budget + 1e-6:
            error = errors.plan_error(plan)
            best = error if best is None else min(best, error)
    return best


def test_the_choice_is_the_least_error_within_the_budget(tiny, quanto_errors):
    low, high = quanto_errors.bytes_per_token[(2, 2)], quanto_errors.bytes_per_token[(4, 4)]
    for budget in (low, (low + high) / 2, quanto_errors.bytes_per_token[(4, 2)], high, 10 * high):
        plan = choose_plan(quanto_errors, budget)
        assert plan.bytes_per_token <= budget + 1e-6
        assert plan.error == pytest.approx(_brute_force(quanto_errors, budget))
        assert plan.uniform is not None and plan.error <= plan.uniform_error + 1e-12
        tokens = quanto_errors.context_tokens
        assert _bytes(tiny, plan.uniform, tokens) <= budget + 1e-6
        # the spec is the plan, and the byte formula of the spec is the plan's bytes
        assert parse_plan(plan.spec.plan) == plan.layers
        assert _bytes(tiny, plan.spec, tokens) == pytest.approx(plan.bytes_per_token)
    assert {(p.nbits, p.nbits_value) for p in choose_plan(quanto_errors, low).layers} == {(2, 2)}
    assert {(p.nbits, p.nbits_value) for p in choose_plan(quanto_errors, high).layers} == {(4, 4)}


@pytest.mark.parametrize(
    "budget, message",
    [
        (
            100.0,
            r"below the smallest quanto cache on this model at [0-9,]+ context tokens "
            r"\([0-9,]+: every layer at the fewest bits\); give",
        ),
        (-5, "must be a positive number of bytes per token"),
        (float("nan"), "must be a positive number of bytes per token"),
        ("5760", "must be a number of bytes per token"),
        (True, "must be a number of bytes per token"),
    ],
)
def test_a_bad_budget_is_refused_before_the_prefill(tiny, ids, budget, message, monkeypatch):
    monkeypatch.setattr(tiny.model, "forward", lambda *a, **k: pytest.fail("no prefill for a refused budget"))
    with pytest.raises(ValueError, match=message):
        plan_layers(tiny, ids, CacheSpec("quanto"), budget)


def test_a_base_without_a_plan_or_a_model_without_kvdemo_attention_is_refused(tiny, ids, embedded):
    with pytest.raises(ValueError, match="backend=fp8 takes no per-layer plan; choose quanto, hqq"):
        plan_layers(tiny, ids, CacheSpec("fp8"), 5000)
    eager = make_tiny(embedded.tokenizer)
    eager.model.set_attn_implementation("eager")
    with pytest.raises(ValueError, match="attends with eager. Load it with attn_implementation='sdpa'"):
        layer_errors(eager, ids, CacheSpec("quanto"))


def test_hqq_plans_take_its_bits_and_the_plan_runs_in_a_session(tiny, ids):
    base = CacheSpec("hqq", q_group_size=32, residual_length=4)
    budget = _bytes(tiny, CacheSpec("hqq", nbits=3, q_group_size=32), len(ids))
    plan = plan_layers(tiny, ids, base, budget, query_tokens=8)
    assert plan.spec.q_group_size == 32 and plan.spec.residual_length == 4 and plan.bytes_per_token <= budget
    session = QASession(tiny, plan.spec)
    report = session.prefill(CONTEXT)
    answer = session.ask("Who was the Norse leader?", 6)
    assert answer.cache_length_after == report.context_tokens and answer.flush_count > 0
    fresh = QASession(tiny, plan.spec)
    fresh.prefill(CONTEXT)
    assert fresh.ask("Who was the Norse leader?", 6).token_ids == answer.token_ids


def test_a_comparison_runs_the_plan_beside_the_best_uniform_spec(tiny, ids):
    budget = _bytes(tiny, CacheSpec("quanto", nbits=4, nbits_value=2), len(ids))
    seen = []
    report = compare(
        tiny,
        CONTEXT,
        ["Who was the Norse leader?"],
        [CacheSpec("quanto", nbits=4)],
        max_new_tokens=3,
        plans=[(CacheSpec("quanto", nbits=2), budget)],  # nbits is the plan's: the base keeps the other options
        on_progress=lambda done, total, what: seen.append((done, total, what)),
    )
    texts = [r.spec_text for r in report.results]
    assert texts[:2] == ["dynamic", "quanto:4"] and texts[2].startswith("quanto,plan=k") and len(texts) == 4
    assert len(report.plans) == 1 and report.plans[0].startswith(texts[2]) and texts[3] in report.plans[0]
    planned = report.results[2]
    assert planned.nbits is None and planned.options["plan"] == CacheSpec.parse(texts[2]).plan
    assert planned.kv_bytes <= report.results[3].kv_bytes + 64  # within the uniform spec's bytes
    assert all(r.restored for r in report.results)
    assert any(what.startswith("planning quanto per layer at") for _, _, what in seen)
    assert seen[-1][0] == seen[-1][1]  # the progress ends at its total
    frame = report.to_frame()
    assert frame.loc[2, "plan"] == planned.options["plan"] and "plans" in report.to_dict()


def test_a_comparison_refuses_a_budget_below_the_smallest_cache_before_anything_runs(tiny, monkeypatch):
    monkeypatch.setattr(tiny.model, "forward", lambda *a, **k: pytest.fail("nothing runs"))
    with pytest.raises(ValueError, match="below the smallest quanto cache"):
        compare(tiny, CONTEXT, ["Who?"], [], max_new_tokens=2, plans=[(CacheSpec("quanto"), 10.0)])


def test_a_plan_equal_to_a_uniform_spec_stores_what_it_stores(tiny):
    """A plan that gives every layer one precision is that uniform spec, byte for byte and token for token."""
    uniform = CacheSpec("quanto", nbits=4, nbits_value=2, rotation="hadamard", residual_length=4)
    planned = CacheSpec("quanto", plan="k4v2h*2", residual_length=4)
    answers, held, keys = [], [], []
    for spec in (uniform, planned):
        session = QASession(tiny, spec)
        session.prefill(CONTEXT)
        held.append(kv_memory(session.cache).cache_bytes)
        keys.append(session.cache.layers[1]._quantized_keys.dequantize())
        answers.append(session.ask("Who was the Norse leader?", 8).token_ids)
    assert answers[0] == answers[1] and held[0] == held[1] and torch.equal(keys[0], keys[1])
