"""kvdemo.evals.channel_spread: the per-channel maxima before and after the rotation, and the spans of the
quantization groups read from optimum-quanto's and hqq's own stores (the data of notebook 05), on keys with outlier
channels fed straight into the libraries' layers (no model)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig

from kvdemo.cache.formats.hqq.layers import HQQ_LAYERS
from kvdemo.cache.formats.quanto.layers import QUANTO_LAYERS
from kvdemo.cache.layers.flush import quantized_cache
from kvdemo.cache.layers.rotation import hadamard
from kvdemo.cache.registry import BACKENDS
from kvdemo.charts.rotation import channel_max_figure, group_span_figure
from kvdemo.evals.channel_spread import channel_max, group_spans, spread

RESIDUAL_LAYERS = {"quanto": QUANTO_LAYERS, "hqq": HQQ_LAYERS}
"""The residual formats' layer families, by backend name."""

CONFIG = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_hidden_layers=2)


def _keys(tokens: int = 256) -> torch.Tensor:
    """[1, 2, tokens, 64]: channels ~N(0, 1), channels 3, 17 and 40 twenty times larger for every token."""
    torch.manual_seed(0)
    keys = torch.randn(1, 2, tokens, 64)
    keys[..., [3, 17, 40]] *= 20
    return keys


def _prefilled(backend: str, keys: torch.Tensor, **options):
    cache = quantized_cache(
        RESIDUAL_LAYERS[backend], CONFIG, nbits=2, residual_length=1024, rotate_query=False, **options
    )
    for layer in cache.layers:
        layer.update(keys, keys / 2)
    return cache


def test_channel_max_is_each_channels_largest_magnitude_and_the_rotation_evens_it():
    keys = _keys()
    kv = ((keys, 2 * keys), (keys, keys))
    maxima = channel_max(kv, 0)
    assert maxima.shape == (2, 64) and maxima.dtype == torch.float64
    assert torch.equal(maxima, keys.double().abs().amax(dim=(0, 2)))
    assert torch.equal(channel_max(kv, 0, "values"), 2 * maxima)
    rotated = channel_max(kv, 0, rotated=True)
    assert torch.allclose(rotated, (keys.double() @ hadamard(64, torch.float64)).abs().amax(dim=(0, 2)))
    assert (spread(maxima) > 15).all() and (spread(rotated) < 3).all(), (spread(maxima), spread(rotated))
    with pytest.raises(ValueError, match="choose keys or values"):
        channel_max(kv, 0, "queries")
    with pytest.raises(IndexError):
        channel_max(kv, 2)


def test_quantos_spans_are_its_groups_ranges_and_shrink_when_rotated():
    keys = _keys()
    plain, rotated = _prefilled("quanto", keys), _prefilled("quanto", keys, rotation="hadamard")
    spans = group_spans(plain, 0)
    assert spans.shape == (2 * 256,)  # axis 0, q_group_size 64 = head_dim: one group per KV head and token
    layer = plain.layers[0]
    rows = layer._dequantize(layer._quantized_keys).reshape(-1, 64).double()
    assert torch.allclose(rows.amax(1) - rows.amin(1), spans, rtol=1e-5)  # min-max: the grid's ends are codes
    assert torch.allclose(group_spans(plain, 0, "values"), spans / 2)  # the values: their own store
    assert float(group_spans(rotated, 0).median()) < 0.5 * float(spans.median())


def test_an_append_stores_spans_are_its_blocks_spans_in_order():
    keys = _keys(40)
    cache = quantized_cache(QUANTO_LAYERS, CONFIG, nbits=2, residual_length=8, flush="append", rotate_query=False)
    layer = cache.layers[0]
    layer.update(keys[..., :32, :], keys[..., :32, :])  # the prefill: one block of 32 tokens
    for token in range(32, 40):  # the eighth decode step flushes the residual as a second block
        layer.update(keys[..., token : token + 1, :], keys[..., token : token + 1, :])
    blocks = layer._quantized_keys
    assert isinstance(blocks, list) and len(blocks) == 2
    spans = group_spans(cache, 0)
    assert spans.shape == (2 * (32 + 8),)  # one group per KV head and token, in every block
    rows = torch.cat([layer._dequantize(b).reshape(-1, 64) for b in blocks]).double()
    assert torch.allclose(rows.amax(1) - rows.amin(1), spans, rtol=1e-5)


def test_hqqs_groups_keep_to_one_channel_only_when_heads_times_tokens_is_a_multiple():
    """hqq's axis 0 reshapes the flat tensor to [q_group_size, -1]: a group is every (heads x tokens)-th value,
    one channel exactly when heads x tokens is a multiple of q_group_size (notebook 05, section 4)."""
    errors = {}
    for tokens, same_channel in ((256, True), (255, False)):
        keys = _keys(tokens)
        cache = _prefilled("hqq", keys)
        layer = cache.layers[0]
        read = layer._dequantize(layer._quantized_keys)
        columns = read.reshape(64, -1).double()
        spans = group_spans(cache, 0)
        assert spans.shape == (2 * tokens,)
        assert torch.allclose(columns.amax(0) - columns.amin(0), spans, rtol=1e-4)
        channels = torch.arange(2 * tokens * 64).reshape(64, -1) % 64  # each value's channel, grouped as hqq does
        assert bool((channels == channels[0]).all()) is same_channel
        errors[tokens] = float((read - keys).norm() / keys.norm())
    assert errors[256] < 0.75 * errors[255], errors  # own-channel grids: the outlier channels cost less


def test_group_spans_refuses_what_has_no_groups():
    keys = _keys(8)
    dynamic = DynamicCache(config=CONFIG)
    dynamic.update(keys, keys, 0)
    with pytest.raises(ValueError, match="layer 0 is DynamicLayer, not quantized"):
        group_spans(dynamic, 0)
    with pytest.raises(ValueError, match="no quantized store yet; prefill the cache first"):
        group_spans(quantized_cache(QUANTO_LAYERS, CONFIG, nbits=2), 1)
    fp8 = BACKENDS["fp8"].empty_cache({}, CONFIG)
    fp8.layers[0].update(keys, keys)
    with pytest.raises(ValueError, match="is not group-wise"):
        group_spans(fp8, 0)
    with pytest.raises(ValueError, match="choose keys or values"):
        group_spans(_prefilled("hqq", keys), 0, "scores")


def test_the_figures_draw_the_data_they_are_given():
    keys = _keys()
    kv = ((keys, keys),)
    before, after = channel_max(kv, 0), channel_max(kv, 0, rotated=True)
    fig = channel_max_figure(before, after, title="layer 0")
    heatmaps = [ax for ax in fig.axes if ax.images]
    assert [ax.get_title() for ax in heatmaps] == ["as the model writes it", "rotated (x @ H)"]
    assert heatmaps[0].images[0].get_array().tolist() == before.tolist()
    lines = [ax for ax in fig.axes if ax.lines]
    assert [len(ax.lines) for ax in lines] == [2, 2] and list(lines[1].lines[1].get_ydata()) == after[1].tolist()
    with pytest.raises(ValueError, match="differ"):
        channel_max_figure(before, after[:1])

    spans = {
        "quanto:2": group_spans(_prefilled("quanto", keys), 0),
        "quanto:2,rotation=hadamard": group_spans(_prefilled("quanto", keys, rotation="hadamard"), 0),
        "hqq:2": group_spans(_prefilled("hqq", keys), 0),
    }
    fig = group_span_figure(spans)
    panels = [ax for ax in fig.axes if ax.patches]
    assert [ax.get_title() for ax in panels] == ["quanto", "hqq"]
    assert [len(ax.patches) for ax in panels] == [2, 1]  # one histogram per spec
    medians = [line.get_xdata()[0] for line in panels[0].lines]
    assert medians == [float(spans["quanto:2"].median()), float(spans["quanto:2,rotation=hadamard"].median())]
    with pytest.raises(ValueError, match="no spans to draw"):
        group_span_figure({})
