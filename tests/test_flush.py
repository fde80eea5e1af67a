"""The flush policies (`kvdemo.cache.layers.flush`): `append` quantizes only the residual block at a flush, with the
layer's own quantizer, and keeps a list of blocks; the snapshot restores it exactly; transformers' `requantize` stays
the default."""

from __future__ import annotations

import pytest
import torch
from transformers.cache_utils import HQQQuantizedLayer

from kvdemo import CacheSpec, QASession
from kvdemo.cache.formats.hqq.layers import HQQ_LAYERS, AppendHQQLayer, ExactHQQLayer
from kvdemo.cache.formats.quanto.layers import AppendQuantoLayer, ExactQuantoLayer
from kvdemo.cache.layers.blockwise import blockwise_layer
from kvdemo.cache.layers.flush import AppendFlushMixin, quantized_cache
from kvdemo.cache.spec import build_cache
from kvdemo.cache.state import snapshot
from kvdemo.cache.state.telemetry import kv_memory

APPEND = [CacheSpec("quanto", nbits=4, flush="append"), CacheSpec("hqq", nbits=4, flush="append")]


def _feed(loaded, cache, ids):
    with torch.no_grad():
        return loaded.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0, -1]


def test_the_registry_builds_each_policy(tiny):
    # transformers' layers de-quantizing in place, read block-wise (the tiny model attends through kvdemo's function)
    assert type(build_cache(CacheSpec("hqq", nbits=4), tiny.config).layers[0]) is blockwise_layer(ExactHQQLayer)
    assert type(build_cache(CacheSpec("quanto", nbits=4, flush="requantize"), tiny.config).layers[0]) is (
        blockwise_layer(ExactQuantoLayer)
    )
    assert type(build_cache(APPEND[0], tiny.config).layers[0]) is blockwise_layer(AppendQuantoLayer)
    assert type(build_cache(APPEND[1], tiny.config).layers[0]) is blockwise_layer(AppendHQQLayer)
    whole = quantized_cache(HQQ_LAYERS, tiny.config, flush="append", blockwise=False, nbits=4)
    assert type(whole.layers[0]) is AppendHQQLayer and issubclass(AppendHQQLayer, HQQQuantizedLayer)
    assert CacheSpec.parse("hqq:4,flush=append") == APPEND[1] and APPEND[1].text == "hqq:4,flush=append"
    assert CacheSpec("hqq", nbits=4).label == "hqq nbits=4 q_group_size=64 residual_length=128"
    assert APPEND[1].label.endswith("residual_length=128 flush=append")
    with pytest.raises(ValueError, match="flush=append is not an option of the fp8 backend"):
        CacheSpec.parse("fp8,flush=append")
    with pytest.raises(ValueError, match="flush='later' is not allowed for quanto; allowed: requantize, append"):
        CacheSpec.parse("quanto:4,flush=later")


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_append_quantizes_only_the_residual_block_with_the_library_quantizer(tiny, backend, monkeypatch):
    """Before the first flush and at it, both policies return the same keys; at the flush `append` quantizes the
    residual block alone (the library's own `_quantize`), transformers re-quantizes every token."""
    spec = CacheSpec(backend, nbits=4, residual_length=4)
    caches = {p: build_cache(spec.replace(flush=p), tiny.config) for p in ("requantize", "append")}
    quantized = {p: [] for p in caches}
    base = {"quanto": ExactQuantoLayer, "hqq": ExactHQQLayer}[backend]  # both layers inherit its `_quantize`
    original = base._quantize

    def spy(layer, tensor, axis):
        quantized["append" if isinstance(layer, AppendFlushMixin) else "requantize"].append(tensor.shape[-2])
        return original(layer, tensor, axis)

    monkeypatch.setattr(base, "_quantize", spy)
    ids = list(range(5, 25))
    logits = {p: _feed(tiny, c, ids) for p, c in caches.items()}  # the prefill: one block of 20 tokens
    for token in (30, 31, 32, 33):  # the 4th step flushes
        logits = {p: _feed(tiny, c, [token]) for p, c in caches.items()}
        assert torch.equal(logits["requantize"], logits["append"])
    layers = tiny.config.num_hidden_layers
    assert quantized["requantize"] == [20] * 2 * layers + [24] * 2 * layers
    assert quantized["append"] == [20] * 2 * layers + [4] * 2 * layers  # keys and values of each layer
    layer = caches["append"].layers[0]
    assert isinstance(layer._quantized_keys, list) and len(layer._quantized_keys) == 2
    assert layer.get_seq_length() == 24 and layer._dequantize(layer._quantized_keys).shape[-2] == 24
    assert layer._dequantize(layer._quantized_keys[1]).shape[-2] == 4
    # kv_memory walks into the list of blocks: every block's packed data, scales and zero points
    per_block = kv_memory(caches["append"]).layers[0].quantized_bytes
    assert per_block == sum(
        kv_memory(_one_block_cache(caches["append"], index)).layers[0].quantized_bytes for index in (0, 1)
    )


def _one_block_cache(cache, index):
    """A shallow copy of `cache` whose layer 0 holds only block `index` (to count one block's bytes)."""
    import copy

    other = copy.copy(cache)
    layer = copy.copy(cache.layers[0])
    layer._quantized_keys = [cache.layers[0]._quantized_keys[index]]
    layer._quantized_values = [cache.layers[0]._quantized_values[index]]
    layer.keys = layer.values = torch.tensor([])
    other.layers = [layer]
    return other


@pytest.mark.parametrize("spec", APPEND, ids=lambda s: s.text)
def test_restore_is_exact_after_a_flush_during_an_answer_with_append(tiny, normans, spec):
    spec = spec.replace(residual_length=4)
    session = QASession(tiny, spec)
    context_tokens = session.prefill(normans.paragraphs[0]).context_tokens
    saved = [dict(vars(layer)) for layer in session.cache.layers]
    blocks = [list(layer._quantized_keys) for layer in session.cache.layers]
    assert all(len(b) == 1 for b in blocks)
    answer = session.ask("Who was the Norse leader?", 12)
    assert answer.steps == 12 and sum(answer.flushes) >= 2 * tiny.config.num_hidden_layers  # flushes mid-answer
    for layer, state, before in zip(session.cache.layers, saved, blocks):
        assert layer.get_seq_length() == context_tokens
        assert vars(layer).keys() == state.keys()
        assert all(vars(layer)[name] is value for name, value in state.items())
        assert layer._quantized_keys == before and len(layer._quantized_keys) == 1  # no block appended in place
    fresh = QASession(tiny, spec)
    fresh.prefill(normans.paragraphs[0])
    second = session.ask("In what country is Normandy located?", 12)
    assert second.token_ids == fresh.ask("In what country is Normandy located?", 12).token_ids


def test_update_assigns_a_new_list_at_each_flush(tiny):
    cache = build_cache(APPEND[1].replace(residual_length=2), tiny.config)
    _feed(tiny, cache, list(range(5, 15)))
    saved = snapshot.take(cache)
    held = cache.layers[0]._quantized_keys
    _feed(tiny, cache, [20])
    _feed(tiny, cache, [21])  # flushes
    assert cache.layers[0]._quantized_keys is not held and len(held) == 1 and len(cache.layers[0]._quantized_keys) == 2
    snapshot.restore(cache, saved)
    assert cache.layers[0]._quantized_keys is held and cache.get_seq_length() == 10


def test_the_option_reaches_the_command_line_and_the_page(capsys):
    from kvdemo.cache.registry import GROUP_OPTIONS
    from kvdemo.cli.main import build_parser
    from kvdemo.ui.inputs import spec_from_inputs
    from kvdemo.ui.option_fields import backend_option_updates

    parser = build_parser()
    args = parser.parse_args(["ask", "--context-file", "x", "--backend", "hqq", "--flush", "Append"])
    assert args.flush == "append"
    with pytest.raises(SystemExit):
        parser.parse_args(["ask", "--help"])
    assert "--flush" in capsys.readouterr().out
    *fields, _ = backend_option_updates("hqq", 4, 64, 128, 0, 0, "append")
    flush = fields[GROUP_OPTIONS.index("flush")]
    assert flush["choices"] == ["requantize", "append"] and flush["value"] == "append"
    assert not backend_option_updates("fp8")[GROUP_OPTIONS.index("flush")]["visible"]
    assert spec_from_inputs(
        "hqq", dict(nbits=4, q_group_size=64, residual_length=128, axis_key=0, axis_value=0, flush="append")
    ) == CacheSpec("hqq", nbits=4, residual_length=128, axis_key=0, axis_value=0, flush="append")  # 64: fitted
    assert spec_from_inputs("fp8", dict(nbits=None, flush="append")) == CacheSpec("fp8")


@pytest.mark.parametrize(
    "text",
    ["quanto:4", "quanto:2,q_group_size=32", "hqq:4", "hqq:3", "hqq:4,q_group_size=32,axis_key=1,axis_value=1"],
)
def test_append_holds_the_bytes_of_the_formula_after_many_flushes(text):
    """Blocks add no bytes: every grouping allowed splits one token's values into whole groups, so the store split
    at the flushes holds exactly what one store holds (and what the registry's formula says), on the embedded
    model's KV shape."""
    from transformers import LlamaConfig

    from kvdemo.cache.spec import estimate_kv_bytes

    config = LlamaConfig(
        num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, head_dim=64, hidden_size=576
    )
    held = {}
    for policy in ("requantize", "append"):
        spec = CacheSpec.parse(f"{text},residual_length=16,flush={policy}")
        cache = build_cache(spec, config)
        torch.manual_seed(0)
        cache.update(torch.randn(1, 3, 100, 64), torch.randn(1, 3, 100, 64), 0)
        for _ in range(16 * 3 + 5):  # three flushes, five tokens left in the residual
            cache.update(torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64), 0)
        memory = kv_memory(cache)
        held[policy] = memory.cache_bytes
        assert memory.layers[0].residual_tokens == 5 and memory.seq_length == 153
        assert held[policy] == estimate_kv_bytes(spec, config, 153, torch.float32, 5)
    assert len(cache.layers[0]._quantized_keys) == 4 and held["append"] == held["requantize"]


def test_the_step_time_chart_marks_append_flush_steps(tiny, normans):
    from kvdemo.cache.state.telemetry import expected_flush_steps
    from kvdemo.charts.steps import step_time_frame

    session = QASession(tiny, APPEND[1].replace(residual_length=4))
    session.prefill(normans.paragraphs[0])
    events = list(session.stream("Who was the Norse leader?", 12))
    rule = expected_flush_steps(len(session.question_ids("Who was the Norse leader?")), 4, len(events))
    assert [e.step for e in events if e.flushed_layers] == rule
    frame = step_time_frame(events)
    assert list(frame[frame["kind"] == "flush step"]["step"]) == [s for s in rule if s > 0]
    answer = session.history[-1]  # flushes counted per layer; the steps that flushed, once each
    assert answer.flush_steps == len(rule) and answer.flush_count == len(rule) * tiny.config.num_hidden_layers
    # the figure (the page's chart and the notebooks'): the same points by kind, on a log axis, every kind in its
    # legend, the x-axis to the last step
    from kvdemo.charts.steps import step_time_figure

    figure = step_time_figure(events, "steps", min_steps=8)
    axes = figure.axes[0]
    points = {c.get_label(): [tuple(p) for p in c.get_offsets()] for c in axes.collections}
    assert [step for step, _ in points["flush step"]] == [s for s in rule if s > 0]
    drawn = sorted(p for ps in points.values() for p in ps)
    assert [step for step, _ in drawn] == [e.step for e in events]
    assert [ms for _, ms in drawn] == pytest.approx([e.seconds * 1000 for e in events])
    assert axes.get_yscale() == "log" and axes.get_xlim() == (-0.5, 11.5)
    assert [t.get_text() for t in figure.legends[0].get_texts()] == ["question pass", "decode step", "flush step"]
    empty = step_time_figure([], "none yet", min_steps=8).axes[0]
    assert empty.get_xlim() == (-0.5, 8.5) and empty.get_ylim() == (10, 1000) and empty.get_title() == "none yet"
