"""Decode attention over the stored codes (`kvdemo.cache.read.code_attention`): the kernel reads every store it
serves as the library de-quantizes it, bit for bit; its attention equals torch's kernel over the de-quantized store
within the stated float bound, alone and merged with other blocks and the residual; the embedded model decodes the
same tokens with logits within 1e-3 of the de-quantize path; every store, layer or call it does not serve takes the
de-quantize path, and the prefill report says which path a session's decode steps take.

Cost: about 15 s (the embedded model's decoded answers 8 s)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from transformers import LlamaConfig

from kvdemo import CacheSpec, QASession
from kvdemo.cache.formats.hqq.layers import hqq_codes
from kvdemo.cache.formats.quanto.layers import AppendQuantoLayer, RotatedQuantoLayer, quanto_codes
from kvdemo.cache.formats.turboquant.codes import uniform_codes
from kvdemo.cache.formats.turboquant.layers import quantize_uniform
from kvdemo.cache.layers.appended import AppendedLayer
from kvdemo.cache.layers.attention import ATTENTION, _joined_layers, decode_read
from kvdemo.cache.layers.blockwise import (
    _FLASH,
    StoreBlocks,
    attend_blockwise,
    blocks_of,
    code_reader,
    dequantized_reads,
)
from kvdemo.cache.layers.flush import read_whole
from kvdemo.cache.read.code_attention import (
    MAX_DIM,
    NotFinite,
    attend_codes,
    dequantize_codes,
    float_rows,
    kernel,
)
from kvdemo.cache.spec import build_cache
from kvdemo.cache.state import snapshot
from kvdemo.qa.prefill import run_prefill
from tests.families import tiny_family
from tests.helpers import filled_layer

OUTPUT_BOUND = 1e-5
"""|kernel output - torch's| <= this x the largest |value| (measured: at most 1.7e-6 on real keys and values)."""

LSE_BOUND = 3e-5
"""|kernel log-sum-exp - torch's|, absolute (measured: at most 9.5e-6, log-sum-exps of 2 to 15)."""

SERVED = (
    "quanto:2", "quanto:4", "quanto:4,q_group_size=32", "quanto:4,flush=append", "quanto:4,rotation=hadamard",
    "hqq:1", "hqq:2", "hqq:3", "hqq:4", "hqq:8", "hqq:4,axis_key=1,axis_value=1,q_group_size=32",
    "hqq:4,nbits_value=2", "turboquant:2", "turboquant:3", "turboquant:4", "turboquant:4,nbits_value=8",
    "turboquant:3,nbits_value=2,norm_correction=true", "turboquant:4,flush=requantize", "turboquant:8,nbits_value=4",
    "ggml:q8_0", "ggml:q4_0", "ggml:q4_1", "ggml:q5_0,rotation=none", "ggml,type_k=q5_1,type_v=iq4_nl",
    "ggml,type_k=f16", "fp8", "fp8,scale=per_token_head", "fp8,scale=calculated", "fp8,scale=one,float8=e5m2", "int8",
    "nvfp4", "nvfp4,block_rule=4over6,tensor_scale=prefill", "nvfp4,keys=e4m3", "turboquant:4bit_nc",
    "turboquant:k8v4", "turboquant:k3v4_nc", "turboquant:3bit_nc",
)  # fmt: skip
"""Every store layout the kernel reads: each backend's bit widths, group sizes and axes, flush policies, the
query-side rotation, mixed key and value precision, TurboQuant's float8 keys, llama.cpp's block types, float8 under
each scale rule, int8 and NVFP4 (these last three write every token as codes: no residual), and vLLM's TurboQuant
layouts, written token by token too."""


def _config(head_dim: int = 64) -> LlamaConfig:
    config = LlamaConfig(
        vocab_size=8, hidden_size=6 * head_dim, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=2, head_dim=head_dim,
    )  # fmt: skip
    config._attn_implementation = ATTENTION  # so the cache builds the layers kvdemo's attention reads
    return config


def _states(tokens: int, head_dim: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys with an outlier channel (as real keys have) and values, [1, 2, tokens, head_dim]."""
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, tokens, head_dim, generator=generator)
    keys[..., 3] *= 12
    return keys, torch.randn(1, 2, tokens, head_dim, generator=generator) * 2


def _read(layer):
    """How a decode step's attention reads one of `layer`'s blocks: the layer's `_dequantize`, or the basis of the query
    it scores (vLLM's TurboQuant keys, in the rotated basis: `stored_blocks`)."""
    return layer.stored_blocks().dequantize if hasattr(layer, "stored_blocks") else layer._dequantize


def _blocks(layer) -> list:
    store_keys, store_values = layer._quantized_keys, layer._quantized_values
    return list(zip(*(s if isinstance(s, list) else [s] for s in (store_keys, store_values))))


@pytest.fixture(scope="module", params=SERVED)
def served(request):
    """(spec text, layer 0 after a prefill of 70 tokens and 12 decode steps with an 8-token residual where the backend
    keeps one: two blocks where the flush appends)."""
    spec = CacheSpec.parse(request.param)
    if spec.keeps_residual:
        spec = CacheSpec.parse(request.param + ",residual_length=8")
    keys, values = _states(70)
    return request.param, filled_layer(spec, _config(), keys, values, steps=12)


def test_the_kernel_reads_each_store_as_the_library_de_quantizes_it(served):
    text, layer = served
    assert code_reader(type(layer)), text
    blocks = _blocks(layer)
    residual = not isinstance(layer, AppendedLayer)  # vLLM's layout writes every token: one record
    residual_blocks = residual and text.startswith("turboquant:") and "requantize" not in text
    assert len(blocks) == (2 if "append" in text or residual_blocks else 1)
    for key_block, value_block in blocks:
        for block in (key_block, value_block):
            codes = layer._codes_of(block)
            assert codes is not None, text
            if "_nc" in text and block is key_block:  # the kernel sums the centroids' |c|^2 in its own order
                assert torch.allclose(dequantize_codes(codes), _read(layer)(block), rtol=1e-6, atol=0), text
            else:
                assert torch.equal(dequantize_codes(codes), _read(layer)(block)), text  # bit for bit


def test_attention_over_the_codes_is_torch_s_over_the_de_quantized_store_within_the_bound(served):
    text, layer = served
    blocks = _blocks(layer)
    query = torch.randn(1, 2, 3, 64, generator=torch.Generator().manual_seed(1)) * 2
    keys = torch.cat([_read(layer)(k) for k, _ in blocks], dim=-2)
    values = torch.cat([_read(layer)(v) for _, v in blocks], dim=-2)
    expected, expected_lse = _FLASH(query, keys, values, scale=0.125)
    read = attend_codes(query, [(layer._codes_of(k), layer._codes_of(v)) for k, v in blocks], 0.125)
    assert read is not None
    output, lse = read
    assert output.shape == (1, 2, 3, 64) and lse.shape == (1, 2, 3)
    assert (output - expected).abs().max() <= OUTPUT_BOUND * values.abs().max(), text
    assert (lse - expected_lse.reshape(lse.shape)).abs().max() <= LSE_BOUND, text
    # a wrong read (the values of another head) is far outside the bound: the bound can fail
    swapped = _FLASH(query, keys, values.flip(1), scale=0.125)[0]
    assert (output - swapped).abs().max() > 100 * OUTPUT_BOUND * values.abs().max()


def test_blocks_the_kernel_reads_merge_with_the_residual_and_with_blocks_it_does_not():
    """`attend_blockwise` reads the coded blocks in one call, de-quantizes the others, and merges every part with the
    residual: the result is attention over the joined store within the bound."""
    layer = filled_layer(CacheSpec.parse("hqq:4,flush=append,residual_length=8"), _config(), *_states(40), steps=13)
    blocks = _blocks(layer)
    assert len(blocks) == 2
    tail_keys, tail_values = _states(5, seed=2)
    unread = StoreBlocks([b[0] for b in blocks], [b[1] for b in blocks], layer._dequantize,
                         codes=lambda block: None if block is blocks[0][0] else layer._codes_of(block))  # fmt: skip
    query = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(3))
    expected = attend_blockwise(
        query, tail_keys, tail_values, StoreBlocks(unread.keys, unread.values, unread.dequantize), 0.125
    )
    for blocks_read in (unread, StoreBlocks(unread.keys, unread.values, unread.dequantize, codes=layer._codes_of)):
        got = attend_blockwise(query, tail_keys, tail_values, blocks_read, 0.125)
        assert (got - expected).abs().max() <= OUTPUT_BOUND * 2 * tail_values.abs().max()


def test_a_layer_that_changes_the_read_is_de_quantized():
    """The codes are read only where they de-quantize to what the layer's `_dequantize` gives: not under a rotation
    back on read, nor a layer class that defines no `_codes_of`."""
    assert code_reader(AppendQuantoLayer)  # the append flush hands a single block to the library's read
    assert not code_reader(RotatedQuantoLayer)  # rotated back on read: the codes are in another basis
    rotated = filled_layer(CacheSpec.parse("quanto:4,rotation=hadamard"), LlamaConfig(
        vocab_size=8, hidden_size=384, intermediate_size=8, num_hidden_layers=1, num_attention_heads=6,
        num_key_value_heads=2, head_dim=64), *_states(20))  # fmt: skip
    assert not code_reader(type(rotated))  # eager attention: the read-side rotation


def test_stores_and_calls_the_kernel_does_not_take_return_none():
    layer = filled_layer(CacheSpec.parse("quanto:4"), _config(), *_states(20))
    store = layer._quantized_keys
    codes = layer._codes_of(store)
    query = torch.randn(1, 2, 3, 64)
    assert attend_codes(query.to(torch.bfloat16), [(codes, codes)], None) is None  # a bfloat16 model's query
    assert attend_codes(torch.randn(1, 2, 65, 64), [(codes, codes)], None) is None  # 65 query rows per KV head
    assert attend_codes(torch.randn(1, 3, 3, 64), [(codes, codes)], None) is None  # another number of KV heads
    assert attend_codes(query, [], None) is None
    wide = filled_layer(CacheSpec.parse("hqq:4"), _config(2 * MAX_DIM), *_states(8, 2 * MAX_DIM))
    assert hqq_codes(wide._quantized_keys) is None  # head_dim 512
    half = filled_layer(CacheSpec.parse("quanto:4"), _config(), *(s.to(torch.bfloat16) for s in _states(20)))
    assert quanto_codes(half._quantized_keys) is None  # bfloat16 scales: the library's rounding, not float32's
    values = quantize_uniform(torch.randn(1, 2, 4, 64), 4)
    assert uniform_codes(values.codes[..., ::2], values.scale, values.zero, 4) is None  # not contiguous
    assert uniform_codes(values.codes, values.scale.to(torch.bfloat16), values.zero, 4) is None
    assert kernel() is not None  # the set-up compiled it


@pytest.mark.parametrize("text", ["quanto:4", "hqq:4", "turboquant:4", "ggml:q4_0", "fp8"])
def test_the_embedded_model_decodes_the_same_tokens_with_logits_within_1e_3(embedded, normans, text):
    """Eight greedy decode steps over a prefill of 700 tokens (the store, a flushed block where the flush appends,
    the residual): at each step, from the same cache state (restored by the snapshot), the logits on the codes path
    against the de-quantize path. The same greedy token at every step, and the typical gap (the median) is the float
    order's, 1e-4 at most (measured 1e-5 to 4e-5). Where new tokens wait in a full-precision residual, no step parts
    by more than 1e-3. ggml and fp8 write each new token as codes at once, from keys that the earlier layers'
    attention moved by a float rounding, so a code of it can land on the other side of a boundary: one step then parts
    further, as torch's own two reads of the de-quantized store do (seen: 2.8e-2 for q4_0 with one thread, and 4.2e-2
    between flash by block and sdpa whole for q8_0)."""
    ids = QASession(embedded).context_ids(normans.context)[:700]
    spec = CacheSpec.parse(text)
    cache = build_cache(
        CacheSpec.parse(text + ",residual_length=4") if spec.info.has_residual else spec, embedded.config
    )
    run_prefill(embedded, cache, ids, handed=spec.info.hands_over)
    token, gaps = 13, []
    with torch.no_grad():
        for _ in range(8):
            saved = snapshot.take(cache)
            codes = embedded.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
            snapshot.restore(cache, saved)
            with dequantized_reads():
                before = embedded.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
            assert int(codes.argmax()) == int(before.argmax())
            gaps.append(float((codes - before).abs().max()))
            token = int(before.argmax())
    assert sorted(gaps)[len(gaps) // 2] <= 1e-4
    if spec.info.has_residual:
        assert max(gaps) <= 1e-3
    assert max(gaps) > 0  # the codes path ran: another order of sums


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("quanto:4", "reads the stored codes in 30 layers"),
        ("turboquant:4", "reads the stored codes in 30 layers"),
        ("ggml:q4_0", "reads the stored codes in 30 layers"),
        ("turboquant:8,nbits_value=4", "reads the stored codes in 30 layers"),
        ("fp8", "reads the stored codes in 30 layers"),
        ("int8", "reads the stored codes in 30 layers"),
        ("turboquant:4,layout=vllm", "de-quantizes the whole store in 30 layers"),
        ("turboquant:4bit_nc", "reads full precision in 4 layers; reads the stored codes in 26 layers"),
        ("dynamic", "full precision in 30 layers"),
    ],
)
def test_the_prefill_report_says_which_path_decode_steps_take(embedded, text, expected):
    session = QASession(embedded, CacheSpec.parse(text))
    report = session.prefill("The Normans were the people who in the 10th and 11th centuries gave their name.")
    assert expected in report.decode_read
    assert decode_read(session.cache, embedded.model) == report.decode_read


def test_the_report_counts_each_layer_s_path_on_a_model_of_two_kinds(embedded):
    """Gemma 3's tiny family: three sliding-window layers and one full-attention layer. The sliding layers' attention
    modules pass a window (`_joined_layers`), which the kernel takes where a decode step hands the window alone
    (ggml's rows, fp8's codes; a residual format's store less its tokens past the window). TurboQuant's sliding
    layers rotate their 4-bit keys back on read, so their blocks are de-quantized, one at a time."""
    loaded = tiny_family("Gemma 3", embedded.tokenizer)
    sliding = {i for i, kind in enumerate(loaded.config.layer_types) if kind != "full_attention"}
    assert _joined_layers(loaded.model) == dict.fromkeys(sliding, {"sliding_window"})
    text = "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy. " * 3
    for spec, expected in (
        ("ggml:q4_0", "reads the stored codes in 4 layers"),
        ("fp8,sliding=quantize", "reads the stored codes in 4 layers"),
        (
            "turboquant:4,sliding=quantize",
            "de-quantizes each block in 3 layers; reads the stored codes in 1 layer",
        ),
    ):
        assert QASession(loaded, CacheSpec.parse(spec)).prefill(text).decode_read == "Decode attention " + expected


@pytest.mark.parametrize(
    "text",
    [
        "ggml:q8_0",
        "int8,sliding=quantize",
        "nvfp4,sliding=quantize",
        "quanto:4,sliding=quantize,residual_length=4",
        "turboquant:8,nbits_value=4,sliding=quantize,residual_length=4",
        "turboquant:4bit_nc,protect=0:0",
    ],
)
def test_sliding_layers_read_from_their_window_s_codes_decode_as_the_layer_s_own_read(embedded, text):
    """Tiny Gemma 3 (a window of 16 tokens in three of its four layers): 24 decode steps after a prefill of 40 tokens,
    on a cache whose sliding layers hand attention their window's codes and on one built under `read_whole` (each
    layer's own update: the window joined, then sdpa under the model's sliding mask), fed the same tokens. The
    window's store (and a residual format's store less its tokens past the window, skipped in place) holds exactly
    the tokens the mask leaves visible: the typical step's logits agree to the float order (measured 4e-7 of the
    largest logit; a window one token off parts by more than 1e-3 at every step); a step where a re-coding flush
    lands a code across a boundary parts further (seen 5e-3 on hqq)."""
    loaded = tiny_family("Gemma 3", embedded.tokenizer)
    ids = QASession(loaded).context_ids("The Normans gave their name to Normandy, a region in France. " * 6)[:40]
    spec = CacheSpec.parse(text)
    cache = build_cache(spec, loaded.config)
    with read_whole():
        whole_cache = build_cache(spec, loaded.config)
    for built in (cache, whole_cache):
        run_prefill(loaded, built, ids, handed=spec.info.hands_over)
    assert decode_read(cache, loaded.model).endswith("reads the stored codes in 4 layers")
    assert decode_read(whole_cache, loaded.model).endswith("de-quantizes the whole store in 4 layers")
    token, gaps = 13, []
    with torch.no_grad():
        for _ in range(24):
            codes = loaded.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).logits[0, -1]
            whole = loaded.model(input_ids=torch.tensor([[token]]), cache=whole_cache, use_cache=True).logits[0, -1]
            gaps.append(float((codes - whole).abs().max() / whole.abs().max()))
            token = int(whole.argmax())
    assert sorted(gaps)[len(gaps) // 2] <= 1e-5 and max(gaps) <= 1e-2, gaps


def test_a_residual_window_whose_stored_count_is_missing_takes_the_layer_s_own_update(embedded):
    """A sliding layer opened from a session file written before it counted its stored tokens (`_held`) cannot say
    which of them left the window: its decode steps take the layer's own update (the window joined), not the codes."""
    loaded = tiny_family("Gemma 3", embedded.tokenizer)
    cache = build_cache(CacheSpec.parse("quanto:4,sliding=quantize,residual_length=4"), loaded.config)
    layer = cache.layers[0]
    states = _states(40, head_dim=loaded.config.head_dim)[0][:, :1]
    layer.update(states, states)
    step = states[..., :1, :]
    assert blocks_of(layer.update(step, step)[0]) is not None  # counted: the window's codes
    del layer._held
    keys, _ = layer.update(step, step)
    assert blocks_of(keys) is None and keys.shape[-2] == loaded.config.sliding_window  # the window, joined


@pytest.mark.parametrize("text", ["fp8", "fp8,scale=per_token_head", "fp8,scale=one", "int8", "nvfp4"])
def test_a_decode_step_copies_no_code_of_the_context(text):
    """The formats that write every token as codes put a decode step's token in the answer's record: the context's
    codes stay the same tensor, never copied; the records joined are those of the same tokens written in one update
    (a question's several tokens, which join the answer's record to the store first)."""
    keys, values = _states(50)
    layer = filled_layer(CacheSpec.parse(text), _config(), keys[..., :40, :], values[..., :40, :])
    context = layer._quantized_keys[0]
    pointer = context.untyped_storage().data_ptr()
    for t in range(40, 50):
        layer.update(keys[..., t : t + 1, :], values[..., t : t + 1, :])
    assert layer._quantized_keys[0] is context and context.untyped_storage().data_ptr() == pointer
    assert layer._answer_keys[0].shape[-2] == 10
    whole = filled_layer(CacheSpec.parse(text), _config(), keys[..., :40, :], values[..., :40, :])
    whole.update(keys[..., 40:, :], values[..., 40:, :])
    for ours, theirs in zip((*layer._records()[0], *layer._records()[1]), (*whole._records()[0], *whole._records()[1])):
        assert torch.equal(ours, theirs), text
    layer.update(keys[..., :2, :], values[..., :2, :])  # a question: the answer's record joins the store, in order
    assert layer._answer_keys is None and layer._quantized_keys[0].shape[-2] == 52


POISONED = ("quanto:4", "hqq:4", "turboquant:4", "turboquant:8,nbits_value=4", "ggml:q4_0", "ggml,type_k=f16", "fp8",
            "int8", "nvfp4", "turboquant:4bit_nc")  # fmt: skip
"""One spec per kind of store the kernel reads: affine, lookup and uniform, scaled, llama.cpp's blocks, float16 rows,
float8 and int8 rows, NVFP4 blocks, vLLM's `_nc` keys (lookup over the centroids' norm); the float32 residual (kind 3)
where the poisoned token waits in it."""


@pytest.mark.parametrize("text", POISONED)
@pytest.mark.parametrize(("where", "bad"), [("key", float("nan")), ("key", float("inf")), ("value", float("-inf"))])
@pytest.mark.parametrize("stored", [True, False], ids=["stored", "new token"])
def test_a_poisoned_cache_propagates_nan_and_infinity_as_torch_does(text, where, bad, stored):
    """A key or value holding NaN or infinity, in the prefill's store or in the decode step's new token (the residual
    where the format keeps one): the codes path's output is NaN exactly where the de-quantize path's (torch's kernel)
    is, infinite where it is with the same value, and equal to it elsewhere within the bound. Where the quantizer
    keeps the poison (a residual holds the new token as it is; fp8's scale from an amax that is not finite), it
    reaches attention; other quantizers may code it as a finite value (fp8 saturates a new infinite token), and then
    every path reads the same finite store. The reference is the store read whole by sdpa: torch's flash kernel over a
    block of one NaN key returns 0 where sdpa returns NaN, so `attend_blockwise` reads a poisoned store whole."""
    spec = CacheSpec.parse(text)
    if spec.keeps_residual:
        spec = CacheSpec.parse(text + ",residual_length=8")
    keys, values = _states(41)
    poisoned = keys if where == "key" else values
    poisoned[0, 1, 17 if stored else 40, 5] = bad
    query = torch.randn(1, 6, 1, 64, generator=torch.Generator().manual_seed(5))
    layer = filled_layer(spec, _config(), keys[..., :40, :], values[..., :40, :])
    tail_keys, tail_values = layer.update(keys[..., 40:, :], values[..., 40:, :])
    blocks = blocks_of(tail_keys)
    assert blocks is not None, text  # a decode step handed attention the store
    whole_keys, whole_values = blocks.materialized(tail_keys, tail_values)
    reference = torch.nn.functional.scaled_dot_product_attention(
        query, whole_keys.repeat_interleave(3, 1), whole_values.repeat_interleave(3, 1), scale=0.125
    ).transpose(1, 2)
    if stored and text == "fp8" or not stored and spec.info.has_residual:
        assert not torch.isfinite(reference).all(), text  # the poison reached attention
    infinite, finite = torch.isinf(reference), torch.isfinite(reference)
    for reads in (nullcontext, dequantized_reads):
        with reads():
            read = attend_blockwise(query, tail_keys, tail_values, blocks, 0.125)
        assert torch.equal(torch.isnan(read), torch.isnan(reference)), text
        assert torch.equal(torch.isinf(read), infinite) and torch.equal(read[infinite], reference[infinite]), text
        if finite.any():
            assert (read[finite] - reference[finite]).abs().max() <= OUTPUT_BOUND * 20, text


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_the_kernel_gives_back_a_call_whose_keys_or_values_are_not_finite(bad):
    """Every store kind reaches the same scores and sums once de-quantized (the kernel's tile), so one kind stands
    for all here: a key or a value of float32 rows holding NaN or an infinity, and the kernel raises `NotFinite`;
    finite rows it reads."""
    keys, values = _states(40)
    query = torch.randn(1, 2, 3, 64)
    assert attend_codes(query, [(float_rows(keys), float_rows(values))], None) is not None
    for poisoned in (keys, values):
        poisoned[0, 1, 17, 5] = bad
        with pytest.raises(NotFinite):
            attend_codes(query, [(float_rows(keys), float_rows(values))], None)
        poisoned[0, 1, 17, 5] = 0.0
