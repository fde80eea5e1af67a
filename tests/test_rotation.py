"""kvdemo.cache.layers.rotation and kvdemo.cache.layers.attention: the Hadamard matrix, rotated layers that store the
library's own quantization of the rotated keys and values (rotated back on read, or kept in the rotated basis for
kvdemo's attention function, which rotates the query), what rotation buys on keys with outlier channels, and its
refusals. The restore and fresh-run invariants of the rotated specs run in tests/test_invariants.py (`all_specs`)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

from kvdemo import CacheSpec, QASession
from kvdemo.cache.formats.hqq.layers import (
    HQQ_LAYERS,
    AppendQueryRotatedHQQLayer,
    AppendRotatedHQQLayer,
    RotatedHQQLayer,
    set_quantizer,
)
from kvdemo.cache.formats.quanto.layers import QUANTO_LAYERS, QueryRotatedQuantoLayer, RotatedQuantoLayer
from kvdemo.cache.layers.attention import ATTENTION, install, uses_query_rotation
from kvdemo.cache.layers.blockwise import blockwise_layer
from kvdemo.cache.layers.flush import quantized_cache
from kvdemo.cache.layers.rotation import HADAMARD, ROTATED_MARK, hadamard
from kvdemo.cache.model.geometry import hadamard_block, rotation_problem
from kvdemo.cache.spec import build_cache
from kvdemo.evals.cache_error import dequantized_kv
from tests.helpers import logits_through, make_tiny

RESIDUAL_LAYERS = {"quanto": QUANTO_LAYERS, "hqq": HQQ_LAYERS}
"""The residual formats' layer families, by backend name."""


def test_the_hadamard_matrix_is_symmetric_orthonormal_and_flat():
    for size in (1, 2, 64, 128):
        matrix = hadamard(size)
        assert matrix.shape == (size, size) and torch.equal(matrix, matrix.T)
        assert torch.allclose(matrix @ matrix, torch.eye(size), atol=1e-6)
        assert torch.allclose(matrix.abs(), torch.full((size, size), size**-0.5))  # every channel spread evenly
    assert hadamard(64, torch.float16).dtype == torch.float16
    with pytest.raises(ValueError, match="a Hadamard matrix needs a size >= 1, not 0"):
        hadamard(0)
    assert rotation_problem(64) is None


@pytest.mark.parametrize("size, block", [(96, 32), (80, 16), (192, 64), (48, 16)])
def test_a_head_dim_that_is_not_a_power_of_two_is_rotated_block_by_block(size, block):
    """96 = 3 x 32: the block-diagonal matrix of three H_32, still symmetric and orthonormal (H @ H = I); each
    channel spread evenly over its block and nowhere else."""
    assert hadamard_block(size) == block and rotation_problem(size) is None
    matrix = hadamard(size)
    assert torch.equal(matrix, matrix.T)
    assert torch.allclose(matrix @ matrix, torch.eye(size), atol=1e-6)
    blocks = torch.block_diag(*[torch.ones(block, block)] * (size // block)).bool()
    assert torch.allclose(matrix.abs()[blocks], torch.full((size * block,), block**-0.5))
    assert not matrix[~blocks].any()
    for refused in (0, 12, 36, 99):  # blocks of 4 or less spread nothing worth a rotation
        assert "needs head_dim to be a multiple of 8" in str(rotation_problem(refused))


def _keys_with_outlier_channels(tokens: int = 256, head_dim: int = 64) -> torch.Tensor:
    """[1, 2, tokens, head_dim]: most channels ~N(0, 1), three channels 20x larger for every token (the
    low-frequency rotary pairs of real keys)."""
    torch.manual_seed(0)
    keys = torch.randn(1, 2, tokens, head_dim)
    keys[..., [3, 17, 40]] *= 20
    return keys


@pytest.mark.parametrize(
    "plain_class, rotated_class, axis",
    [(QuantoQuantizedLayer, RotatedQuantoLayer, 0), (HQQQuantizedLayer, RotatedHQQLayer, 1)],
)  # the axis whose groups run along head_dim (quanto's 0, hqq's 1): there an outlier channel sets a group's range
def test_a_rotated_layer_stores_the_librarys_quantization_of_the_rotated_keys(plain_class, rotated_class, axis):
    keys = _keys_with_outlier_channels()
    matrix = hadamard(keys.shape[-1])
    options = dict(nbits=2, residual_length=1024, axis_key=axis, axis_value=axis)
    rotated, plain, plain_of_rotated = (c(**options) for c in (rotated_class, plain_class, plain_class))
    rotated.update(keys, keys)
    plain.update(keys, keys)
    plain_of_rotated.update(keys @ matrix, keys @ matrix)  # the library's own quantizer on x @ H, by hand
    read = rotated._dequantize(rotated._quantized_keys)
    by_hand = plain_of_rotated._dequantize(plain_of_rotated._quantized_keys) @ matrix
    assert read.shape == keys.shape and torch.allclose(read, by_hand, atol=1e-5)
    # what the rotation buys: the outlier channels no longer set every group's range
    error_rotated = float((read - keys).norm() / keys.norm())
    error_plain = float((plain._dequantize(plain._quantized_keys) - keys).norm() / keys.norm())
    assert error_rotated < 0.6 * error_plain, (error_rotated, error_plain)


def _config(head_dim: int) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=2 * head_dim, num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, num_hidden_layers=2
    )


def test_rotation_is_refused_where_it_cannot_run():
    assert CacheSpec.parse("quanto:4,rotation=hadamard").validate(_config(64)).rotation == "hadamard"
    assert CacheSpec.parse("hqq:4,rotation=hadamard,q_group_size=16").validate(_config(48)).q_group_size == 16
    with pytest.raises(ValueError, match="needs head_dim to be a multiple of 8 \\(this model's is 36"):
        CacheSpec.parse("hqq:4,rotation=hadamard,q_group_size=4").validate(_config(36))
    with pytest.raises(ValueError, match="rotation='givens' is not allowed for quanto; allowed: none, hadamard"):
        CacheSpec.parse("quanto:4,rotation=givens")
    for backend in ("dynamic", "fp8"):
        with pytest.raises(ValueError, match=f"rotation=hadamard is not an option of the {backend} backend"):
            CacheSpec.parse(f"{backend},rotation=hadamard")
    with pytest.raises(ValueError, match="rotation='x' is not a rotation; choose one of none, hadamard"):
        quantized_cache(QUANTO_LAYERS, _config(64), rotation="x")


def test_rotation_with_the_append_flush_builds_both_layers(tiny):
    assert uses_query_rotation(tiny.config)  # a LoadedModel's attention is kvdemo's
    cache = build_cache(CacheSpec.parse("hqq:4,flush=append,rotation=hadamard"), tiny.config)
    assert all(type(layer) is blockwise_layer(AppendQueryRotatedHQQLayer) for layer in cache.layers)
    read_side = quantized_cache(HQQ_LAYERS, tiny.config, flush="append", rotation="hadamard", rotate_query=False)
    assert all(type(layer) is blockwise_layer(AppendRotatedHQQLayer) for layer in read_side.layers)


def test_kvdemos_attention_gives_sdpas_own_bits_for_an_unrotated_cache(embedded):
    """Without a rotation kvdemo's attention is sdpa's, bit for bit, for a cache read whole; a quantized cache read
    block-wise (the default under kvdemo's attention, `kvdemo.cache.layers.blockwise`) agrees to float rounding."""
    tiny = make_tiny(embedded.tokenizer, seed=3)  # its own model: the attention is switched below
    assert tiny.config._attn_implementation == ATTENTION
    ids = embedded.tokenizer("The Normans held Rouen. Rollo led them, and Normandy was named after them.")["input_ids"]
    outputs = {}
    texts = ("dynamic", "quanto:4,residual_length=4", "fp8")
    for implementation in (ATTENTION, "sdpa"):
        tiny.model.set_attn_implementation(implementation)
        caches = {text: build_cache(CacheSpec.parse(text), tiny.config) for text in texts}
        if implementation == ATTENTION:
            caches["whole"] = quantized_cache(QUANTO_LAYERS, tiny.config, blockwise=False, nbits=4, residual_length=4)
        for text, cache in caches.items():
            prefill = logits_through(tiny, cache, ids[:-6])
            steps = [logits_through(tiny, cache, [token]) for token in ids[-6:]]  # decode steps, one flush (residual 4)
            outputs[implementation, text] = torch.cat([prefill, *steps])
    assert torch.equal(outputs[ATTENTION, "dynamic"], outputs["sdpa", "dynamic"])
    quanto = "quanto:4,residual_length=4"
    assert torch.equal(outputs[ATTENTION, "whole"], outputs["sdpa", quanto])
    for text in (quanto, "fp8"):  # fp8 writes every token as codes: its decode steps read them block-wise too
        blockwise, sdpa = outputs[ATTENTION, text], outputs["sdpa", text]
        assert not torch.equal(blockwise, sdpa), text  # the decode steps took the block-wise path
        assert torch.allclose(blockwise, sdpa, atol=1e-4) and torch.equal(blockwise.argmax(-1), sdpa.argmax(-1))


@pytest.mark.parametrize("text", ["quanto:4,residual_length=3", "hqq:4,residual_length=3,flush=append,nbits_value=2"])
def test_the_query_side_rotation_attends_as_the_read_side_one(tiny, embedded, text):
    """The two ways of `rotation=hadamard` are the same arithmetic: in the rotated basis with the query rotated
    (kvdemo's attention), and rotated back on every read (any attention). Their stores hold the library's
    quantization of the same rotated tensors, so what attention reads and the logits agree to float rounding."""
    spec = CacheSpec.parse(text + ",rotation=hadamard")
    query_side = build_cache(spec, tiny.config)
    options = dict(spec.resolved())
    optimize = options.pop("optimize", None)  # hqq's quantizer, set by its own format
    read_side = quantized_cache(RESIDUAL_LAYERS[spec.backend], tiny.config, rotate_query=False, **options)
    if optimize is not None:
        set_quantizer(read_side, str(optimize))
    assert isinstance(query_side.layers[0], QueryRotatedQuantoLayer) == text.startswith("quanto")
    ids = embedded.tokenizer("The Normans held Rouen. Rollo led them, and Normandy was named after them.")["input_ids"]
    for cache in (query_side, read_side):
        logits_through(tiny, cache, ids[:-5])
    for token in ids[-5:]:  # a flush at the third step (residual 3)
        query_logits, read_logits = logits_through(tiny, query_side, [token]), logits_through(tiny, read_side, [token])
        assert torch.allclose(query_logits, read_logits, atol=1e-4), float((query_logits - read_logits).abs().max())
    assert query_side.layers[0]._quantized_keys is not None
    for (keys, values), (read_keys, read_values) in zip(dequantized_kv(query_side), dequantized_kv(read_side)):
        # in the model's basis both ways: the same de-quantized keys and values
        assert keys.shape == read_keys.shape and torch.allclose(keys, read_keys, atol=1e-4)
        assert torch.allclose(values, read_values, atol=1e-4)
    returned, _ = query_side.layers[0].update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64))
    assert getattr(returned, ROTATED_MARK) is HADAMARD  # what makes kvdemo's attention rotate the query


def test_a_model_whose_attention_is_not_sdpa_keeps_it_and_rotates_on_read(embedded):
    tiny = make_tiny(embedded.tokenizer, seed=5)
    tiny.model.set_attn_implementation("eager")
    assert install(tiny.model) is False and tiny.config._attn_implementation == "eager"
    cache = build_cache(CacheSpec.parse("quanto:4,rotation=hadamard"), tiny.config)
    assert all(type(layer) is RotatedQuantoLayer for layer in cache.layers)
    with pytest.raises(ValueError, match="rotate_query needs a model that attends through kvdemo_attention"):
        quantized_cache(QUANTO_LAYERS, tiny.config, rotation="hadamard", rotate_query=True)
    context = "The Normans were the people who gave their name to Normandy, a region in France. Rollo led them."
    answers = []
    for implementation in ("eager", ATTENTION):  # the same answer through either attention (the tiny model)
        tiny.model.set_attn_implementation(implementation)
        session = QASession(tiny, CacheSpec.parse("quanto:4,residual_length=3,rotation=hadamard"))
        session.prefill(context)
        answers.append(session.ask("Who led them?", 8).token_ids)
    assert answers[0] == answers[1]


@pytest.mark.parametrize("text", ["quanto:2,residual_length=3", "hqq:4,residual_length=2,flush=append"])
def test_a_rotated_cache_has_the_same_bytes_restores_and_answers_as_a_fresh_run(tiny, text):
    context = "The Normans were the people who gave their name to Normandy, a region in France. Rollo led them."
    spec, rotated = CacheSpec.parse(text), CacheSpec.parse(text + ",rotation=hadamard")
    plain_report = QASession(tiny, spec).prefill(context)
    session = QASession(tiny, rotated)
    report = session.prefill(context)
    assert report.kv_bytes == plain_report.kv_bytes and report.memory == plain_report.memory  # the same tensors
    answers = [session.ask("Who led them?", 7) for _ in range(2)]  # flushes mid-answer (residual 2-3)
    assert answers[0].flush_count > 0 and answers[0].token_ids == answers[1].token_ids
    assert answers[1].cache_length_after == report.context_tokens
    fresh = QASession(tiny, rotated)
    fresh.prefill(context)
    assert fresh.ask("Who led them?", 7).token_ids == answers[0].token_ids
