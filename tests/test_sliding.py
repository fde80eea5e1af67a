"""Quantized sliding-window layers (`kvdemo.cache.layers.sliding`, `sliding=quantize`) against transformers'
`DynamicSlidingWindowLayer`: the same tokens returned to attention at every update, under the same mask sizes, and the
store never holding more than the window; and the bytes by layer kind of mixed models against their tensors.

Cost: about 10 s (tiny tensors; six 4-layer random models, one prefill and a few decode steps each)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicSlidingWindowLayer, QuantizedLayer

from kvdemo.cache.formats.fp8.layers import ExactFp8Layer, SlidingFp8Layer
from kvdemo.cache.layers.sliding import sliding_layer
from kvdemo.cache.model.geometry import split_geometry
from kvdemo.cache.spec import CacheSpec, build_cache, estimate_kv_bytes
from kvdemo.cache.state import snapshot
from kvdemo.cache.state.telemetry import kv_memory
from tests.families import family_config

CHUNKS = (7, 1, 1, 2, 1, 1, 1, 4, 1, 1, 1, 1, 9, 1)
"""Update sizes: a prefill longer than the window, decode steps, question passes of a few tokens, a flush now and
then (residual_length 3)."""


class IdentityLayer(QuantizedLayer):
    """A `QuantizedLayer` whose quantization is the identity: what the sliding logic returns is then exact."""

    def _quantize(self, tensor, axis):
        return tensor.clone()

    def _dequantize(self, q_tensor):
        return q_tensor


def _states(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(1, 2, count, 4, generator=generator), torch.randn(1, 2, count, 4, generator=generator)


@pytest.mark.parametrize("window", [5, 6, 30])
def test_a_quantized_sliding_layer_returns_what_the_dynamic_one_returns(window):
    reference = DynamicSlidingWindowLayer(sliding_window=window)
    layer = sliding_layer(IdentityLayer)(sliding_window=window, residual_length=3)
    for step, count in enumerate(CHUNKS):
        assert layer.get_mask_sizes(count) == reference.get_mask_sizes(count), step
        keys, values = _states(count, step)
        expected, got = reference.update(keys, values), layer.update(keys, values)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), step
        assert layer.get_seq_length() == reference.get_seq_length()
        stored = layer._quantized_keys.shape[-2]
        residual = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0  # emptied at a flush
        assert stored <= window - 1 and residual < 3  # the window at most, and the residual below residual_length
    assert layer.is_sliding and layer.get_max_length() == window


def test_a_quantized_sliding_fp8_layer_keeps_its_window_and_returns_what_the_dynamic_one_returns():
    window = 6
    reference, layer, whole = DynamicSlidingWindowLayer(sliding_window=window), SlidingFp8Layer(window), ExactFp8Layer()
    for step, count in enumerate(CHUNKS):
        assert layer.get_mask_sizes(count) == reference.get_mask_sizes(count), step
        keys, values = _states(count, step)
        expected, got, full = reference.update(keys, values), layer.update(keys, values), whole.update(keys, values)
        assert got[0].shape == expected[0].shape, step
        # the same codes as transformers' fp8 layer over every token, cut to the window
        assert torch.equal(got[0], full[0][..., -got[0].shape[-2] :, :]), step
        codes = layer._quantized_keys[0]
        assert codes.shape[-2] == min(layer.get_seq_length(), window - 1)
        assert codes.untyped_storage().nbytes() == codes.numel()  # compact: no longer storage pinned


@pytest.mark.parametrize("family", ["Gemma 3", "GPT-OSS", "Mistral (window)", "Qwen3.5", "Gemma 4 (KV sharing)"])
def test_bytes_by_layer_kind_match_the_tensors(family):
    """The formula (quantized layers by the backend's, kept ones as `dynamic`'s) equals the tensors held after the
    prefill and after decode steps, and `bytes_by_kind` adds up to the cache's bytes."""
    config = family_config(family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 1000, (1, 45))
    for text in (
        "quanto:4",
        "hqq:2,nbits_value=4,residual_length=16",
        "fp8,sliding=quantize",
        "hqq:4,sliding=quantize",
    ):
        try:
            spec = CacheSpec.parse(text).validate(config)
        except ValueError:
            assert family == "Mistral (window)" and "sliding=quantize" not in text  # nothing to quantize: refused
            continue
        cache = build_cache(spec, config)
        with torch.no_grad():
            model(ids[:, :40], cache=cache, use_cache=True)
            snapshot.take(cache)  # as the session does: a sliding window compacted to its tokens
            report = kv_memory(cache)
            assert estimate_kv_bytes(spec, config, 40, torch.float32) == report.cache_bytes - report.state_bytes
            for position in range(40, 45):
                model(ids[:, position : position + 1], cache=cache, position_ids=torch.tensor([[position]]))
        report = kv_memory(cache)
        kinds = report.bytes_by_kind()
        assert sum(kinds.values()) == report.cache_bytes and kinds["quantized"] > 0, (family, text)
        residual = next(layer.residual_tokens for layer in report.layers if layer.kind == "quantized")
        quantized, kept = split_geometry(config, str(spec.resolved()["sliding"]))
        formula = estimate_kv_bytes(spec, config, 45, torch.float32, residual_tokens=residual)
        assert formula - 4 * kept.values_held(45) == kinds["quantized"], (family, text)
        assert kinds["sliding"] == 0 or spec.sliding != "quantize"  # quantized sliding layers count as quantized


def test_a_plan_gives_bits_to_the_quantized_layers_only_and_the_planner_plans_those(embedded):
    """Gemma 3's tiny model (3 sliding + 1 full-attention layers): a hand-written plan has one entry per quantized
    layer (1 with `sliding=keep`, 4 with `sliding=quantize`); the planner plans those layers, with the kept windows'
    bytes at the context's length counted in the budget (the registry's formula of the plan's own spec)."""
    from kvdemo.evals.planner import plan_layers
    from kvdemo.qa.models import LoadedModel

    config = family_config("Gemma 3")
    one = build_cache(CacheSpec.parse("quanto,plan=k4v2").validate(config), config)
    quantized = [layer for layer in one.layers if isinstance(layer, QuantizedLayer)]
    assert len(quantized) == 1 and quantized[0].nbits == 4 and quantized[0].nbits_value == 2
    four = build_cache(CacheSpec.parse("quanto,sliding=quantize,plan=k2v2*3+k4v4").validate(config), config)
    assert [layer.nbits for layer in four.layers] == [2, 2, 2, 4] and four.layers[0].is_sliding
    with pytest.raises(ValueError, match="the plan gives 4 layers and this model has 1 layers that are quantized"):
        CacheSpec.parse("quanto,plan=k4v2*4").validate(config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    cpu = torch.device("cpu")
    loaded = LoadedModel(model, embedded.tokenizer, "Gemma 3", None, 1024, cpu, torch.float32, frozenset())
    ids = list(range(3, 40))  # 37 tokens, more than the window of 16
    for sliding, planned in (("keep", [3]), ("quantize", [0, 1, 2, 3])):
        base = CacheSpec("quanto", q_group_size=32, sliding=sliding)
        uniform = estimate_kv_bytes(base.replace(nbits=4, nbits_value=2), config, len(ids), torch.float32) / len(ids)
        plan = plan_layers(loaded, ids, base, uniform, query_tokens=8)
        assert list(plan.errors.layer_indices) == planned and len(plan.layers) == len(planned)
        assert plan.bytes_per_token <= uniform + 1e-6
        spec_bytes = estimate_kv_bytes(plan.spec, config, len(ids), torch.float32) / len(ids)
        assert plan.bytes_per_token == pytest.approx(spec_bytes)
        kept = 3 * 15 * 2 * 2 * 32 * 4 / len(ids) if sliding == "keep" else 0.0  # three windows of 15 tokens
        assert plan.errors.kept_bytes_per_token == pytest.approx(kept)
        assert all(0 < plan.errors.keys[j][(2, "none")] for j in range(len(planned)))
