"""Block-wise reads (`kvdemo.cache.layers.blockwise`): the merge by log-sum-exp is attention over the joined blocks, a
block-wise layer keeps the same state as transformers' layer at every step, and kvdemo's attention falls back to the
whole store for a call the block-wise path does not take. No model."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvdemo.cache.formats.hqq.layers import HQQ_LAYERS, AppendHQQLayer, ExactHQQLayer
from kvdemo.cache.formats.quanto.layers import QUANTO_LAYERS, ExactQuantoLayer, QueryRotatedQuantoLayer
from kvdemo.cache.layers.attention import kvdemo_attention
from kvdemo.cache.layers.blockwise import BLOCKS_MARK, StoreBlocks, attend_blockwise, blocks_of, blockwise_layer
from kvdemo.cache.layers.flush import quantized_cache
from kvdemo.cache.layers.rotation import ROTATED_MARK, rotate


class _Attention(torch.nn.Module):
    """What `sdpa_attention_forward` reads from an attention module: 6 query heads over 2 KV heads."""

    num_key_value_groups = 3
    is_causal = True
    layer_idx = 0


def _joined(blocks: StoreBlocks, keys: torch.Tensor, values: torch.Tensor):
    return blocks.materialized(keys, values)


def test_the_merge_is_attention_over_the_joined_blocks():
    torch.manual_seed(0)
    sizes = (37, 128, 5)  # two stored blocks of different sizes, then a tail of 5 tokens
    keys = [torch.randn(1, 2, n, 64) * 3 for n in sizes]
    values = [torch.randn(1, 2, n, 64) for n in sizes]
    blocks = StoreBlocks(keys=keys[:2], values=values[:2], dequantize=lambda block: block)
    query = torch.randn(1, 6, 1, 64)
    got = attend_blockwise(query, keys[2], values[2], blocks, 0.125)
    whole_keys, whole_values = _joined(blocks, keys[2], values[2])
    assert whole_keys.shape == (1, 2, 170, 64)
    expected, _ = sdpa_attention_forward(_Attention(), query, whole_keys, whole_values, None, scaling=0.125)
    assert got.shape == expected.shape == (1, 1, 6, 64)
    assert torch.allclose(got, expected, atol=1e-6)
    # in float64 the same arithmetic: the merge itself loses nothing
    reference = torch.softmax(query.double().view(1, 2, 3, 64) @ whole_keys.double().transpose(-1, -2) * 0.125, -1)
    reference = (reference @ whole_values.double()).view(1, 6, 1, 64).transpose(1, 2)
    assert torch.allclose(got.double(), reference, atol=1e-6)


def test_blocks_whose_last_axis_is_strided_are_read_right():
    """A block de-quantized along axis -1 has a last-axis stride > 1; torch's private CPU flash kernel, which skips
    sdpa's layout checks, misread such blocks (issue 57, pytorch PR#187506): `attend_blockwise` hands it contiguous
    ones, so the merge equals attention over the joined blocks for every layout."""
    torch.manual_seed(0)
    keys = [torch.randn(1, 2, 64, 20).transpose(-1, -2) * 3 for _ in range(2)]  # [1, 2, 20, 64], stride 20 last
    values = [torch.randn(1, 2, 64, 20).transpose(-1, -2) for _ in range(2)]
    assert keys[0].stride(-1) == 20
    tail_keys, tail_values = torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64)
    blocks = StoreBlocks(keys=keys, values=values, dequantize=lambda block: block)
    query = torch.randn(1, 6, 1, 64)
    got = attend_blockwise(query, tail_keys, tail_values, blocks, 0.125)
    whole_keys, whole_values = _joined(blocks, tail_keys, tail_values)
    expected, _ = sdpa_attention_forward(_Attention(), query, whole_keys, whole_values, None, scaling=0.125)
    assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize(
    "layer_class",
    [ExactQuantoLayer, ExactHQQLayer, AppendHQQLayer, QueryRotatedQuantoLayer],
    ids=["quanto", "hqq", "hqq-append", "quanto-query-rotated"],
)
def test_a_blockwise_layer_keeps_transformers_state_and_returns_the_same_keys(layer_class):
    """Fed the same prefill and decode steps (two flushes among them), the block-wise layer holds the same residual,
    store and length as the layer it is built on; what it returns, joined, is what that layer returns."""
    options = {"nbits": 4, "q_group_size": 64, "residual_length": 4}
    whole, blockwise = layer_class(**options), blockwise_layer(layer_class)(**options)
    assert isinstance(blockwise, layer_class)
    torch.manual_seed(1)
    prefill = torch.randn(1, 2, 20, 64), torch.randn(1, 2, 20, 64)
    assert all(torch.equal(a, b) for a, b in zip(whole.update(*prefill), blockwise.update(*prefill)))
    marked_steps = 0
    for _ in range(9):
        token = torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64)
        expected = whole.update(*token)
        keys, values = blockwise.update(*token)
        assert getattr(keys, ROTATED_MARK, False) == getattr(expected[0], ROTATED_MARK, False)
        blocks = blocks_of(keys)
        if blocks is not None:  # a decode step without a flush: the tail, marked
            marked_steps += 1
            assert keys.shape[-2] == blockwise.keys.shape[-2] and not hasattr(blockwise.keys, BLOCKS_MARK)
            keys, values = _joined(blocks, keys, values)
        assert torch.equal(keys, expected[0]) and torch.equal(values, expected[1])
        assert blockwise.cumulative_length == whole.cumulative_length
        assert torch.equal(blockwise.keys, whole.keys) and torch.equal(blockwise.values, whole.values)
    assert marked_steps == 7  # 9 steps at residual_length 4: flushes at the 4th and 8th


def test_kvdemos_attention_reads_blocks_and_falls_back_to_the_whole_store():
    torch.manual_seed(2)
    layer = blockwise_layer(ExactQuantoLayer)(nbits=4, q_group_size=64, residual_length=8)
    layer.update(torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64))
    keys, values = layer.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
    whole_keys, whole_values = _joined(blocks_of(keys), keys, values)
    query, module = torch.randn(1, 6, 1, 64), _Attention()
    expected, _ = sdpa_attention_forward(module, query, whole_keys, whole_values, None, scaling=0.125)
    got, weights = kvdemo_attention(module, query, keys, values, None, scaling=0.125)
    assert weights is None and torch.allclose(got, expected, atol=1e-6) and not torch.equal(got, expected)
    # a mask (padding, a window) is not the block-wise path's: the whole store, sdpa's own bits
    mask = torch.ones(1, 1, 1, whole_keys.shape[-2], dtype=torch.bool)
    mask[..., :3] = False
    masked, _ = kvdemo_attention(module, query, keys, values, mask, scaling=0.125)
    assert torch.equal(masked, sdpa_attention_forward(module, query, whole_keys, whole_values, mask, scaling=0.125)[0])
    # a rotated layer's tail: the query rotated in, the output rotated back, as for the whole store
    rotated = blockwise_layer(QueryRotatedQuantoLayer)(nbits=4, q_group_size=64, residual_length=8)
    rotated.update(torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64))
    keys, values = rotated.update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
    whole_keys, whole_values = _joined(blocks_of(keys), keys, values)
    expected, _ = sdpa_attention_forward(module, rotate(query), whole_keys, whole_values, None, scaling=0.125)
    got, _ = kvdemo_attention(module, query, keys, values, None, scaling=0.125)
    assert torch.allclose(got, rotate(expected), atol=1e-5)


def test_blockwise_needs_kvdemos_attention():
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=256)
    with pytest.raises(ValueError, match="blockwise needs a model that attends through kvdemo_attention"):
        quantized_cache(QUANTO_LAYERS, config, blockwise=True)
    assert not isinstance(quantized_cache(HQQ_LAYERS, config).layers[0], type(blockwise_layer(ExactHQQLayer)))
