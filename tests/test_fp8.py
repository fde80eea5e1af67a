"""The `fp8` backend's de-quantization by table (`kvdemo.cache.fp8`): the same bits as transformers' own
`Fp8QuantizedLayer._dequantize`, for every code and on a real model's keys and values; the tables counted."""

from __future__ import annotations

import torch
from transformers.cache_utils import Fp8QuantizedLayer

from kvdemo import CacheSpec, QASession
from kvdemo.cache.fp8 import FP8_CODES, TableFp8Layer, dequantize_table
from kvdemo.cache.spec import estimate_kv_bytes


def test_every_code_de_quantizes_to_the_library_s_bits():
    library = Fp8QuantizedLayer()
    states = torch.randn(1, 2, 5, 8) * 7
    library.update(states, states)
    scale = library._quantized_keys[1]
    codes = torch.arange(FP8_CODES, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(1, 1, 32, 8)
    expected = library._dequantize((codes, scale))
    table = dequantize_table(scale, torch.float32)
    got = torch.take(table, codes.view(torch.uint8).long())
    finite = expected.isfinite()
    assert torch.equal(got[finite], expected[finite]) and torch.equal(got.isnan(), expected.isnan())
    assert int(expected.isnan().sum()) == 2  # e4m3fn's two NaN codes, 0x7f and 0xff, NaN both ways


def test_decode_steps_return_what_transformers_layer_returns():
    torch.manual_seed(0)
    mine, library = TableFp8Layer(), Fp8QuantizedLayer()
    prefill = torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64) * 0.1
    for layer in (mine, library):
        layer.update(*prefill)
    for _ in range(5):
        step = torch.randn(1, 3, 1, 64), torch.randn(1, 3, 1, 64) * 0.1
        ours, theirs = mine.update(*step), library.update(*step)
        assert torch.equal(ours[0], theirs[0]) and torch.equal(ours[1], theirs[1])
    assert [t.shape for t in mine._dequantize_tables] == [torch.Size([FP8_CODES])] * 2


def test_answers_and_bytes_with_the_tables(tiny, normans):
    session = QASession(tiny, CacheSpec("fp8"))
    report = session.prefill(normans.paragraphs[0])
    # the tables are held and counted: 2 x layers x 256 float32 values beside the codes and scales
    tables = 2 * tiny.config.num_hidden_layers * FP8_CODES * 4
    estimate = estimate_kv_bytes(CacheSpec("fp8"), tiny.config, report.context_tokens, torch.float32)
    nominal = estimate_kv_bytes(CacheSpec("fp8"), tiny.config, report.context_tokens, torch.float32, nominal_bits=True)
    assert report.kv_bytes == estimate == nominal + tables
    first = session.ask("Who was the Norse leader?", 8)
    assert session.ask("Who was the Norse leader?", 8).token_ids == first.token_ids
