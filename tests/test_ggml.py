"""The `ggml` backend against llama.cpp's own definitions: its blocks byte for byte against ggml's reference
quantizers (the `gguf` package's numpy port, `gguf.quants`), its rotation against `ggml_gen_hadamard`'s construction
and `build_input_k_rot`'s rule (llama.cpp commit 0c1e570, written out here), its byte formula, its refusals and its
deploy lines. The invariants (restore, fresh runs, session files, the byte formula against the real tensors) run it
with every other spec of `all_specs()`; the model families run `ggml:q4_0` (`tests/families.py`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants
from gguf.constants import GGMLQuantizationType
from transformers import LlamaConfig

from kvdemo import CacheSpec, QASession
from kvdemo.cache.formats import ggml as ggml_backend
from kvdemo.cache.formats.ggml import BLOCK_BYTES
from kvdemo.cache.formats.ggml.blocks import (
    KERNEL_TYPES,
    KVALUES_IQ4NL,
    dequantize_rows,
    kernel,
    quantize_rows,
    quantizer,
    row_bytes,
    torch_dequantize_rows,
    torch_quantize_rows,
)
from kvdemo.cache.formats.ggml.layers import (
    VALUE_ROTATION_BLOCK,
    GgmlLayer,
    GgmlRotation,
    _block_hadamard,
    key_rotation_block,
)
from kvdemo.cache.layers.blockwise import blocks_of
from kvdemo.cache.layers.rotation import to_model_basis
from kvdemo.cache.spec import estimate_kv_bytes
from kvdemo.ui.views import prefill_summary
from tests.helpers import make_tiny

ORACLE = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")
"""The types `gguf.quants` quantizes ("bit-exact same results as reference implementation in ggml-quants.c")."""


def _rows() -> np.ndarray:
    """Rows a KV cache meets: Gaussian ones at three scales, an outlier channel, an all-zero row, exact halves
    (where rounding rules differ), and a row of one repeated value."""
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((300, 128)).astype(np.float32) * rng.choice([1e-3, 1.0, 40.0], size=(300, 1))
    rows[:, 5] *= 30  # an outlier channel, as keys have
    rows[1] = 0
    rows[2] = np.round(rows[2] * 2) / 2
    rows[3] = 0.75
    return rows + np.float32(0.0)  # -0.0 to 0.0: gguf's numpy minimum keeps +0.0 where C keeps the first zero's sign


ROTATED = "  # rotated: llama.cpp since 744c0c7 (#21038, 2026-04-01)"
"""The deploy line's note where llama.cpp rotates the types (a shell comment: the line runs as it is)."""


@pytest.mark.parametrize("block_type", ORACLE)
def test_blocks_are_ggml_reference_bytes(block_type):
    rows = _rows()
    ours = quantize_rows(torch.from_numpy(rows), block_type).numpy()
    reference = quants.quantize(rows, getattr(GGMLQuantizationType, block_type.upper()))
    assert ours.shape == reference.shape == (300, 128 // 32 * BLOCK_BYTES[block_type])
    assert np.array_equal(ours, reference), f"{int((ours != reference).sum())} bytes differ"


@pytest.mark.parametrize("block_type", KERNEL_TYPES)
def test_the_c_quantizer_writes_the_bytes_of_the_torch_arithmetic(block_type):
    """`quantize_rows` on the CPU runs ggml's reference C (`quantize.c`); its torch twin (`torch_quantize_rows`, for a
    GPU or a machine without a compiler) is the arithmetic checked against gguf above. The same bytes, on values
    that make ties, zeros of either sign first, all-zero blocks, tiny and huge scales."""
    assert quantizer() is not None  # the set-up compiled it
    torch.manual_seed(0)
    cases = [
        torch.randn(3, 7, 128) * 3,
        torch.randn(500, 64) * torch.rand(500, 1) * 10,
        torch.round(torch.randn(4, 256) * 8) / 4,  # many equal values and exact halves
        torch.zeros(2, 64),
        torch.tensor([[0.0] * 31 + [-0.0], [-0.0] + [0.0] * 31, [0.0, -0.0] * 16, [-1.0, 1.0] * 16]),
        torch.randn(2, 64) * 1e4,
        torch.randn(2, 64) * 1e-20,
    ]
    for values in cases:
        assert torch.equal(quantize_rows(values, block_type), torch_quantize_rows(values, block_type))


@pytest.mark.parametrize("block_type", [*ORACLE, "iq4_nl"])
def test_blocks_read_back_as_ggml_reads_them(block_type):
    """The C kernel and the torch path de-quantize every type to ggml's values (gguf's de-quantizers), bit for bit."""
    rows = _rows()
    stored = quantize_rows(torch.from_numpy(rows), block_type)
    reference = quants.dequantize(stored.numpy(), getattr(GGMLQuantizationType, block_type.upper()))
    assert np.array_equal(torch_dequantize_rows(stored, block_type, 128).numpy(), reference)
    assert kernel() is not None  # the CI machine has a C compiler: the decode path is the kernel's
    assert np.array_equal(dequantize_rows(stored, block_type, 128).numpy(), reference)
    error = np.abs(reference - rows).max(axis=1) / np.maximum(np.abs(rows).max(axis=1), 1e-30)
    assert error[4:].max() < {"q8_0": 0.01, "q5_0": 0.07, "q5_1": 0.07}.get(block_type, 0.15)


def test_iq4_nl_codes_are_the_nearest_values_and_the_scale_the_least_squares_one():
    """ggml's `quantize_row_iq4_nl_ref` (ntry -1): each code the value of `KVALUES_IQ4NL` nearest x / d0, d0 the
    block's signed largest magnitude over -127, then d = sum(w q x) / sum(w q^2) with w = x^2, stored as float16."""
    rows = _rows()[4:40]
    blocks = rows.reshape(-1, 32)
    stored = quantize_rows(torch.from_numpy(rows), "iq4_nl").numpy().reshape(-1, 18)
    values = np.array(KVALUES_IQ4NL, dtype=np.float32)
    top = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(axis=1)]
    scaled = blocks / (top / -127)[:, None]
    nearest = np.abs(scaled[..., None] - values).argmin(axis=-1)  # ties are measure-zero on these rows
    codes = np.concatenate([stored[:, 2:] & 0x0F, stored[:, 2:] >> 4], axis=1)
    assert np.array_equal(codes, nearest)
    q, w = values[codes], blocks**2
    d = (w * q * blocks).sum(axis=1) / (w * q * q).sum(axis=1)
    assert np.allclose(stored[:, :2].copy().view(np.float16)[:, 0], d.astype(np.float16), rtol=1e-3)


def test_the_block_sizes_are_ggmls():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    assert BLOCK_BYTES is ggml_backend.BLOCK_BYTES  # one table for the byte formula and the blocks
    assert {name: GGML_QUANT_SIZES[GGMLQuantizationType[name.upper()]] for name in BLOCK_BYTES} == {
        name: (32, size) for name, size in BLOCK_BYTES.items()
    }
    assert set(ggml_backend.CACHE_TYPES) == {*BLOCK_BYTES, "f16"}
    assert row_bytes("q4_0", 32) == 18 and row_bytes("q8_0", 32) == 34 and row_bytes("q4_0", 128) == 72


def _ggml_gen_hadamard(n: int) -> np.ndarray:
    """llama.cpp's `ggml_gen_hadamard` (src/llama-kv-cache.cpp), written out: data[0] = 1/sqrt(n), then each
    s = 1, 2, 4, ... copies the s x s corner right, down and negated down-right."""
    data = np.zeros((n, n), dtype=np.float32)
    data[0, 0] = 1.0 / np.sqrt(np.float32(n))
    s = 1
    while s < n:
        corner = data[:s, :s].copy()
        data[s : 2 * s, :s], data[:s, s : 2 * s], data[s : 2 * s, s : 2 * s] = corner, corner, -corner
        s *= 2
    return data


def test_the_rotation_is_llama_cpps():
    # build_input_k_rot: from 64, doubled while head_dim stays a multiple; 0 (no rotation) off multiples of 64
    assert [key_rotation_block(d) for d in (64, 128, 256, 192, 96, 80, 512)] == [64, 128, 256, 64, 0, 0, 512]
    assert VALUE_ROTATION_BLOCK == 64  # build_input_v_rot: always 64
    for n in (64, 128):
        assert np.allclose(_block_hadamard(n, n, torch.float32, "cpu").numpy(), _ggml_gen_hadamard(n), atol=1e-7)
    blocks = _block_hadamard(128, 64, torch.float32, "cpu").numpy()  # llama_mul_mat_hadamard: each 64 of a row
    assert np.allclose(blocks[:64, :64], _ggml_gen_hadamard(64)) and not blocks[:64, 64:].any()


def test_query_side_and_read_side_give_the_same_keys_and_values():
    """One layer's store is the same bytes either way; the query side hands attention the rotated basis (marked), the
    read side rotates back on read: in the model's basis they are equal within float rounding."""
    torch.manual_seed(0)
    keys, values = torch.randn(1, 2, 40, 128), torch.randn(1, 2, 40, 128)
    rotation = GgmlRotation(key_rotation_block(128), VALUE_ROTATION_BLOCK)
    query, read = GgmlLayer("q4_0", "q8_0", rotation, True), GgmlLayer("q4_0", "q8_0", rotation, False)
    for layer in (query, read):
        layer.update(keys[:, :, :39], values[:, :, :39])
    (qk, qv), (rk, rv) = (
        query.update(keys[:, :, 39:], values[:, :, 39:]),
        read.update(keys[:, :, 39:], values[:, :, 39:]),
    )
    assert torch.equal(query._quantized_keys.rows, read._quantized_keys.rows)
    assert qk._kvdemo_rotated is rotation and not hasattr(rk, "_kvdemo_rotated")
    # a query-side decode step hands attention no tail and the store as one block (read from its codes, or joined
    # de-quantized where attention cannot: what is compared here)
    store = blocks_of(qk)
    assert store is not None and qk.shape == (1, 2, 0, 128) and store.codes is not None
    qk, qv = store.materialized(qk, qv)
    assert torch.allclose(to_model_basis(query, qk), rk, atol=1e-5)
    assert torch.allclose(to_model_basis(query, qv, values=True), rv, atol=1e-5)
    assert (rk - keys).abs().max() < 0.3 * keys.abs().max()  # q4_0 keys near the originals, not another basis


def test_a_decode_step_copies_no_row_of_the_context():
    """Each decode step writes its token's rows into the answer's block: the context's rows (the prefill's store) stay
    the same tensor, never copied, and the rows are those of the whole sequence coded at once (blocks are per token).
    An update of several tokens (a question) joins the answer's rows to the store, in order."""
    torch.manual_seed(1)
    keys, values = torch.randn(1, 2, 50, 64), torch.randn(1, 2, 50, 64)
    layer = GgmlLayer("q4_0", "q8_0", GgmlRotation(0, 0), True)
    layer.update(keys[:, :, :40], values[:, :, :40])
    context = layer._quantized_keys.rows
    pointer = context.untyped_storage().data_ptr()
    for t in range(40, 50):
        layer.update(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    assert layer._quantized_keys.rows is context and context.untyped_storage().data_ptr() == pointer
    assert layer._answer_keys is not None and layer._answer_keys.rows.shape[-2] == 10
    assert torch.equal(torch.cat([context, layer._answer_keys.rows], dim=-2), quantize_rows(keys, "q4_0"))
    layer.update(keys[:, :, :3], values[:, :, :3])
    assert layer._answer_keys is None and layer._quantized_values.rows.shape[-2] == 53
    assert torch.equal(layer._quantized_keys.rows, quantize_rows(torch.cat([keys, keys[:, :, :3]], dim=-2), "q4_0"))


def test_a_ggml_session_holds_the_formula_bytes_and_says_how_to_deploy(embedded):
    tiny = make_tiny(embedded.tokenizer, kv_heads=2, head_dim=64, layers=2)
    session = QASession(tiny, CacheSpec.parse("ggml:q4_0,type_v=q8_0"))
    report = session.prefill("The Normans gave their name to Normandy, a region in France. " * 8)
    tokens, layers, heads = report.context_tokens, 2, 2
    assert report.kv_bytes == tokens * layers * heads * (64 // 32) * (18 + 34)  # no residual, no padding
    assert report.kv_bytes == estimate_kv_bytes(session.spec, tiny.config, tokens, torch.float32)
    line = "llama.cpp: llama-server -m MODEL.gguf -ctk q4_0 -ctv q8_0 -fa on" + ROTATED
    assert report.deploy[0] == line and report.deploy[-1].startswith("kvdemo:")
    assert f"Deploy: `{line}`" in prefill_summary(session)  # the page, beside the spec
    answer = session.ask("Where is Normandy?", 4)
    assert session.cache_length == tokens and len(answer.token_ids) == 4
    for text in ("ggml:f16", "ggml:iq4_nl,type_v=q5_1"):  # the types the matrix leaves out: restored, as fresh runs
        typed = QASession(tiny, CacheSpec.parse(text))
        typed.prefill("The Normans gave their name to Normandy, a region in France. " * 8)
        first, again = typed.ask("Where is Normandy?", 4), typed.ask("Where is Normandy?", 4)
        assert first.token_ids == again.token_ids and typed.cache_length == tokens
    appended = QASession(tiny, CacheSpec.parse("quanto:4,flush=append"))
    appended.prefill("The Normans gave their name to Normandy.")
    assert "Deploy: kvdemo only (no engine stores this cache byte for byte)" in prefill_summary(appended)


def test_deploy_lines(embedded):
    tiny = make_tiny(embedded.tokenizer)
    lines = {
        text: [d.line for d in CacheSpec.parse(text).deployments(tiny.config)]
        for text in ("ggml:q8_0", "ggml:q4_0,rotation=none", "ggml:f16", "quanto:4", "dynamic", "hqq:4,flush=append")
    }
    assert lines["ggml:q8_0"][0] == "llama.cpp: llama-server -m MODEL.gguf -ctk q8_0 -ctv q8_0 -fa on" + ROTATED
    assert (
        lines["ggml:q4_0,rotation=none"][0]
        == "llama.cpp: LLAMA_ATTN_ROT_DISABLE=1 llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0 -fa on"
    )
    assert lines["ggml:f16"][0] == "llama.cpp: llama-server -m MODEL.gguf -ctk f16 -ctv f16 -fa on"  # nothing rotated
    narrow = make_tiny(embedded.tokenizer, head_dim=32)  # llama.cpp rotates only where head_dim is a multiple of 64
    assert CacheSpec.parse("ggml:q8_0").deployments(narrow.config)[0].line.endswith("-fa on")
    assert lines["quanto:4"][0].startswith('transformers: model.generate(..., cache_implementation="quantized"')
    assert [line.split(":")[0] for line in lines["dynamic"]] == [
        "llama.cpp",
        "vLLM",
        "SGLang",
        "TensorRT-LLM",
        "transformers",
        "mlx-lm",
        "kvdemo",
    ]
    assert [line.split(":")[0] for line in lines["hqq:4,flush=append"]] == ["kvdemo"]


def test_a_head_dim_off_the_blocks_is_refused_before_the_prefill(embedded):
    config = LlamaConfig(hidden_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=48, num_hidden_layers=1)
    with pytest.raises(
        ValueError,
        match="blocks of 32 values, so a head_dim of 48 cannot be q4_0.*set type_k=f16, or use backend=dynamic",
    ):
        CacheSpec.parse("ggml:q4_0").validate(config)
    assert CacheSpec.parse("ggml:f16").validate(config).backend == "ggml"  # f16 stores any width
    with pytest.raises(ValueError, match="type_k='q3_0' is not allowed for ggml; allowed: q8_0, q4_0"):
        CacheSpec("ggml", type_k="q3_0").validate()
    with pytest.raises(ValueError, match="'q3_0' is neither nbits nor a preset of ggml; presets: q8_0, q4_0"):
        CacheSpec.parse("ggml:q3_0")


@pytest.mark.parametrize("block_type", ["q5_1"])
def test_a_decode_token_the_reference_writes_a_step_apart_is_not_blamed_on_the_model(embedded, monkeypatch, block_type):
    """ggml quantizes each decode token as it is written, from keys that the earlier layers' attention moved by a float
    rounding (query-side rotation and the code kernel against the probe's read-whole reference), so the reference can
    write the same token a step apart, and the step cascades: Gemma 3 270M's q5_1 was refused as "the model changes the
    keys and values" where one float16 scale of layer 1 fell either side of its midpoint (0.24102791 and 0.24102783,
    the midpoint) and 40-120 codes per write differed by the last layers, the logits 0.73 apart against 0.80 of
    quantization. The probe's reference now replays the checked run's bytes. Here the reference run's quantizer writes
    each decode token half a level off (every code a step apart, as such a cascade leaves them): refused before."""
    from kvdemo.cache.formats.ggml import layers as ggml
    from kvdemo.cache.layers import flush
    from kvdemo.qa.probe import check_model
    from tests.quantized import GGML_STEP

    def apart(tensor: torch.Tensor, kind: str) -> torch.Tensor:
        if flush._READ_WHOLE.get() and tensor.shape[-2] == 1:  # the read-whole reference's decode writes
            sign = torch.where(torch.arange(tensor.shape[-1]) % 2 == 0, 1.0, -1.0)
            tensor = tensor + tensor.abs().amax(-1, keepdim=True) * GGML_STEP[kind] / 2 * sign
        return quantize_rows(tensor, kind)

    monkeypatch.setattr(ggml, "quantize_rows", apart)
    tiny = make_tiny(embedded.tokenizer, kv_heads=1, head_dim=256, layers=4)  # Gemma 3 270M's KV shape, H_256 keys
    check_model(tiny, CacheSpec.parse(f"ggml:{block_type}").validate(tiny.config))  # raises where it is refused
