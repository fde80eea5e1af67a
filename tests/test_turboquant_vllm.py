"""`turboquant` with `layout=vllm` (the presets under vLLM's names) against vLLM's store as vLLM's code writes it,
written out here from `vllm/model_executor/layers/quantization/turboquant/config.py` and
`vllm/v1/attention/ops/triton_turboquant_store.py` (after PR #40194): the slot layout and size, the value codes,
the raw float8 keys, the Gaussian codebook, the plain Hadamard rotation and the boundary rule."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvdemo import CacheSpec, QASession
from kvdemo.cache.formats.turboquant.vllm import (
    VllmFp8Keys,
    quantize_keys,
    quantize_values,
    vllm_centroids,
    vllm_midpoints,
    vllm_slots,
)
from kvdemo.cache.model.layer_kinds import layer_actions
from kvdemo.cache.spec import build_cache, estimate_kv_bytes
from kvdemo.qa.prefill import run_prefill
from tests.families import family_config
from tests.helpers import make_tiny

MAX_1960 = {
    3: (0.2451, 0.7560, 1.3440, 2.1520),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
}
"""The positive Lloyd-Max levels for N(0, 1) (Max 1960, Table I): vLLM's code for N(0, 1/d) is these over sqrt(d)."""


def _slot_size(head_dim: int, key_bits: int, value_bits: int) -> int:
    """vLLM's `slot_size_aligned`: key_packed_size (head_dim fp8 bytes, or ceil(d x bits / 8) + 2) plus
    value_packed_size (ceil(d x bits / 8) + 4), rounded up to even."""
    key = head_dim if key_bits == 8 else math.ceil(head_dim * key_bits / 8) + 2
    size = key + math.ceil(head_dim * value_bits / 8) + 4
    return size + size % 2


@pytest.mark.parametrize("bits", [3, 4])
def test_the_codebook_is_lloyd_max_for_a_gaussian_of_variance_one_over_d(bits):
    for dimension in (64, 128):
        centroids = vllm_centroids(dimension, bits).double() * math.sqrt(dimension)
        expected = torch.tensor(MAX_1960[bits], dtype=torch.float64)
        assert centroids.dtype == torch.float64 and torch.allclose(centroids[2 ** (bits - 1) :], expected, atol=2e-3)
        assert torch.allclose(centroids, -centroids.flip(0), atol=1e-6)  # symmetric
    midpoints = vllm_midpoints(64, bits)
    assert midpoints.dtype == torch.float32 and torch.all(midpoints[1:] > midpoints[:-1])


def _reference_keys(keys: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's MSE key store of `keys` [n, d] written out: norm of the float32 key, x / (norm + 1e-8) times H / sqrt(d)
    (Sylvester), the index of the first midpoint above each coordinate, packed LSB first; the norm as float16. Also
    returns each coordinate's distance to its nearest midpoint (a float32 product may round either way there)."""
    d = keys.shape[1]
    hadamard = np.array([[1.0]])
    while hadamard.shape[0] < d:
        hadamard = np.block([[hadamard, hadamard], [hadamard, -hadamard]])
    norms = np.linalg.norm(keys.astype(np.float32), axis=1, keepdims=True).astype(np.float32)
    rotated = (keys / (norms + np.float32(1e-8))).astype(np.float64) @ (hadamard / math.sqrt(d))
    midpoints = vllm_midpoints(d, bits).numpy().astype(np.float64)
    indices = np.searchsorted(midpoints, rotated, side="right")
    margin = np.abs(rotated[..., None] - midpoints).min(axis=-1)
    words = indices.reshape(len(keys), -1, 8).astype(np.int64)
    word = (words << (np.arange(8) * bits)).sum(-1)
    packed = ((word[..., None] >> (np.arange(bits) * 8)) & 0xFF).astype(np.uint8).reshape(len(keys), -1)
    return packed, norms.astype(np.float16), margin


@pytest.mark.parametrize("bits", [3, 4])
def test_keys_are_vllms_codes_and_norms(bits):
    rng = np.random.default_rng(3)
    keys = (rng.standard_normal((512, 128)) * rng.choice([0.1, 1, 8], size=(512, 1))).astype(np.float32)
    keys[:, 7] *= 20  # an outlier channel
    store = quantize_keys(torch.from_numpy(keys), bits)
    packed, norms, margin = _reference_keys(keys, bits)
    assert np.array_equal(store.norms.numpy(), norms)
    ours = store.codes.numpy()
    differ = ours != packed
    ambiguous = (margin < 1e-6).reshape(len(keys), -1)  # a coordinate within float32 rounding of a midpoint
    rows_with_ties = ambiguous.any(axis=1)
    assert not differ[~rows_with_ties].any() and rows_with_ties.mean() < 0.02


def test_values_fp8_keys_and_the_slot_are_vllms():
    rng = np.random.default_rng(5)
    values = (rng.standard_normal((1, 2, 33, 64)) * 3).astype(np.float32)
    values[0, 0, 0] = 0.5  # a constant vector: the scale floor
    store = quantize_values(torch.from_numpy(values), 4)
    low, high = values.min(-1, keepdims=True), values.max(-1, keepdims=True)
    scale = (high - low) / np.float32(15)
    scale = np.where(scale > 1e-8, scale, np.float32(1e-8)).astype(np.float32)
    codes = np.clip(np.floor((values - low) / scale + np.float32(0.5)), 0, 15).astype(np.uint8)
    assert np.array_equal(store.codes.numpy(), codes[..., 0::2] | (codes[..., 1::2] << 4))  # low nibble first
    assert np.array_equal(store.scale.numpy(), scale.astype(np.float16))
    assert np.array_equal(store.zero.numpy(), low.astype(np.float16))
    keys = torch.tensor([[[[500.0, -1000.0, 1.0, 0.0] * 16]]])
    fp8 = quantize_keys(keys, 8)
    assert isinstance(fp8, VllmFp8Keys) and fp8.codes.dtype == torch.float8_e4m3fn  # a raw cast: no scale
    assert fp8.codes.float()[0, 0, 0, :4].tolist() == [448.0, -448.0, 1.0, 0.0]  # saturated at +-448
    for key_bits, value_bits in ((4, 4), (3, 4), (3, 3), (8, 4)):
        keys_store = quantize_keys(torch.from_numpy(values), key_bits)
        slot = vllm_slots(keys_store, quantize_values(torch.from_numpy(values), value_bits))
        assert slot.shape == (1, 2, 33, _slot_size(64, key_bits, value_bits))  # 70 bytes for 4bit_nc at 64
    slot = vllm_slots(quantize_keys(torch.from_numpy(values), 4), store)
    assert np.array_equal(slot[..., 32:34].contiguous().view(torch.float16).numpy(), np.linalg.norm(
        values, axis=-1, keepdims=True).astype(np.float16))  # fmt: skip  # the norm after the 32 code bytes
    assert np.array_equal(slot[..., 34:66].numpy(), store.codes.numpy())


def test_the_presets_hold_vllms_bytes_and_protect_vllms_layers(embedded):
    tiny = make_tiny(embedded.tokenizer, kv_heads=2, head_dim=64, layers=6)
    assert layer_actions(tiny.config, True, protect="vllm") == ["keep", "keep", "quantize", "quantize", "keep", "keep"]
    hybrid = family_config("Qwen3-Next")  # linear-attention layers: vLLM's is_hybrid, no boundary layers kept
    assert layer_actions(hybrid, True, protect="vllm") == layer_actions(hybrid, True, protect="0:0")
    gemma = family_config("Gemma 3")  # sliding layers count as decoder layers: 0, 1, L-2, L-1 whatever their kind
    actions = layer_actions(gemma, True, sliding="quantize", protect="vllm")
    assert actions[:2] == actions[-2:] == ["keep", "keep"] and len(actions) == 4  # the tiny Gemma: 4 layers
    session = QASession(tiny, CacheSpec.parse("turboquant:4bit_nc"))
    report = session.prefill("The Normans gave their name to Normandy, a region in France. " * 6)
    tokens = report.context_tokens
    quantized = 2 * 2 * tokens * _slot_size(64, 4, 4)  # 2 layers x 2 heads x 70 bytes a token
    kept = 4 * 2 * 2 * 64 * 4 * tokens  # 4 layers at float32
    assert report.kv_bytes == quantized + kept == estimate_kv_bytes(session.spec, tiny.config, tokens, torch.float32)
    assert report.deploy[0] == "vLLM: --kv-cache-dtype turboquant_4bit_nc"
    answer = session.ask("Where is Normandy?", 4)
    assert len(answer.token_ids) == 4 and session.cache_length == tokens
    kvdemo = CacheSpec.parse("turboquant:4bit_nc,layout=kvdemo")
    assert [d.engine for d in kvdemo.deployments(tiny.config)] == ["kvdemo"]  # kvdemo's variant: not vLLM's bytes


def test_the_vllm_layout_refuses_what_vllm_cannot_store():
    with pytest.raises(ValueError, match="keys of 3, 4 or 8 bits and values of 3 or 4 .*use a preset"):
        CacheSpec.parse("turboquant:2,layout=vllm")
    config = make_config(head_dim=96)
    with pytest.raises(ValueError, match="power-of-two head_dim, not 96 .*use layout=kvdemo"):
        CacheSpec.parse("turboquant:4bit_nc").validate(config)


def make_config(head_dim: int):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=192, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim)


@pytest.mark.parametrize("text", ["turboquant:4bit_nc", "turboquant:k8v4", "turboquant:3bit_nc"])
def test_vllms_write_path_codes_each_token_and_decode_reads_the_codes_in_vllms_basis(embedded, text):
    """vLLM stores each new token before attention reads the cache, the step's own token from its codes
    (`do_kv_cache_update`, then TurboQuant's decode kernel). kvdemo's layers for the presets do the same
    (`kvdemo.cache.formats.turboquant.vllm_layers`): every record after 8 decode steps holds vLLM's bytes of exactly the
    tokens fed, and a decode step read from the codes with the query rotated by vLLM's H gives the logits of the same
    store read back whole in the model's basis (`_dequantize`, then sdpa: vLLM's arithmetic written plainly), to the
    float order (measured 3e-7 to 4e-7 of the largest logit; with the query rotated another way, (q D) H, 1e-2)."""
    tiny = make_tiny(embedded.tokenizer, kv_heads=2, head_dim=64, layers=6)
    spec = CacheSpec.parse(text + ",protect=0:0")
    ids = QASession(tiny).context_ids("The Normans gave their name to Normandy, a region in France. " * 6)
    caches = [build_cache(spec, tiny.config) for _ in range(2)]
    for layer in caches[1].layers:
        layer.reads_blocks = False  # every update returns the whole store in the model's basis
    for cache in caches:
        run_prefill(tiny, cache, ids, handed=True)
    token, gaps = 13, []
    with torch.no_grad():
        for _ in range(8):
            logits = [
                tiny.model(input_ids=torch.tensor([[token]]), cache=c, use_cache=True).logits[0, -1] for c in caches
            ]
            gaps.append(float((logits[0] - logits[1]).abs().max() / logits[1].abs().max()))
            token = int(logits[1].argmax())
    assert max(gaps) <= 1e-5, gaps
    layer = caches[0].layers[3]
    assert layer.rotates_query == (spec.nbits != 8) and layer._answer_keys is not None
    keys, values = layer._records()
    whole_keys, whole_values = caches[1].layers[3]._records()
    assert all(torch.equal(a, b) for a, b in zip((*keys, *values), (*whole_keys, *whole_values)))
    assert keys[0].shape[-2] == len(ids) + 8
