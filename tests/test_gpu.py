"""The same invariants on a CUDA GPU: bfloat16 model, caches on the device, answers after restore equal to
fresh single-question runs for every backend, `torch.cuda.memory_allocated` beside the tensor accounting.
Skipped without CUDA; `benchmarks/gpu_check.sh` runs them on a GPU machine."""

from __future__ import annotations

import pytest
import torch

from kvdemo import CacheSpec, QASession, load_model
from kvdemo.cache.state.telemetry import _plain_tensors
from tests.helpers import ALL_SPECS, spec_id

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

QUESTIONS = ["Who was the Norse leader?", "In what country is Normandy located?", "Who was the Norse leader?"]


@pytest.fixture(scope="module")
def gpu_model():
    return load_model(device="cuda")


@pytest.fixture(scope="module")
def context(normans):
    return normans.select("0-3").context  # 775 tokens with the chat template


def test_model_loads_in_bfloat16_on_the_device(gpu_model):
    assert gpu_model.device.type == "cuda" and gpu_model.dtype == torch.bfloat16
    assert {p.dtype for p in gpu_model.model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in gpu_model.model.parameters()} == {"cuda"}


@pytest.mark.parametrize("spec", ALL_SPECS + [CacheSpec("hqq", nbits=4, residual_length=1)], ids=spec_id)
def test_answers_after_restore_equal_fresh_runs_on_the_device(gpu_model, context, spec):
    session = QASession(gpu_model, spec)
    report = session.prefill(context)
    assert report.memory.device_allocated_bytes is not None
    assert report.memory.device_allocated_bytes > report.kv_bytes  # the weights are on the device too
    tensors = [t for layer in session.cache.layers for t in _plain_tensors(list(vars(layer).values()))]
    assert tensors and {t.device.type for t in tensors} == {"cuda"}
    answers = [session.ask(q, 20) for q in QUESTIONS]
    for question, answer in zip(QUESTIONS, answers):
        assert answer.cache_length_after == report.context_tokens
        fresh = QASession(gpu_model, spec)
        fresh.prefill(context)
        assert fresh.ask(question, 20).token_ids == answer.token_ids, question
    assert answers[0].token_ids == answers[2].token_ids
    assert session.cache.get_seq_length() == report.context_tokens
