"""The peers benchmark's runners (`benchmarks/peer_runners.py`) on a tiny random Llama: they read the job's ids and
decode the same greedy tokens as kvdemo, so that its ratios compare one job. llama.cpp's runner needs
llama-cpp-python, which only `make bench-peers` installs; its byte formula is checked here without it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvdemo import CacheSpec
from kvdemo.cache.model.geometry import full_precision_bytes

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from peer_runners import (  # noqa: E402
    GGML_TYPE_BYTES,
    Job,
    KvdemoRunner,
    PatternRunner,
    RePrefillRunner,
    ggml_kv_bytes,
)
from peers import pattern_outcomes, ratio  # noqa: E402

CONTEXT = "The harbour of Port Vell was rebuilt in 1992. Its lighthouse is painted green and stands 31 metres tall."
QUESTIONS = ["How tall is the lighthouse?", "When was the harbour rebuilt?"]


@pytest.fixture(scope="module")
def job(tiny):
    return Job.make(tiny, CONTEXT, QUESTIONS)


def test_the_job_holds_the_ids_a_session_reads(tiny, job):
    runner = KvdemoRunner(tiny, CacheSpec("dynamic"))
    runner.prefill(job)  # raises where the session's prompt differs from the job's ids
    assert len(job.prefix_ids) == runner.session.cache_length > 0
    for question, ids in zip(QUESTIONS, job.question_ids):
        assert runner.session.prompt_ids(question) == list(job.prefix_ids + ids)


def test_the_pattern_and_re_prefill_answer_like_kvdemo(tiny, job):
    runners = [KvdemoRunner(tiny, CacheSpec("dynamic")), PatternRunner(tiny), RePrefillRunner(tiny)]
    for r in runners:
        r.prefill(job)
    for i in range(len(QUESTIONS)):
        answers = [r.answer(job, i, 6) for r in runners]
        assert len(answers[0].token_ids) == 6  # a random model does not stop early on this text
        assert all(a.token_ids == answers[0].token_ids for a in answers), [a.token_ids for a in answers]
        for a in answers:
            assert 0 < a.first_token_seconds < a.seconds and a.decode_tokens == 5 and a.decode_seconds > 0
    kvdemo, pattern, reprefill = answers
    assert kvdemo.mechanism_seconds > 0 and pattern.mechanism_seconds > 0 and reprefill.mechanism_seconds == 0
    # the pattern holds the prefilled original beside its copy; kvdemo's snapshot holds nothing the cache does not
    prefix_bytes = full_precision_bytes(tiny.config, len(job.prefix_ids), torch.float32)
    assert pattern.kv_held_bytes - kvdemo.kv_held_bytes == prefix_bytes
    assert reprefill.kv_held_bytes == kvdemo.kv_held_bytes


def test_the_pattern_with_quantized_caches_records_what_the_library_does(tiny, job):
    outcomes = pattern_outcomes(tiny, job)
    assert outcomes["hqq"] == "works" and outcomes["fp8"] == "works"
    assert outcomes["quanto"].startswith("RuntimeError:") and "__deepcopy__" in outcomes["quanto"]


def test_llama_cpp_kv_bytes_follow_ggml_blocks():
    # SmolLM2-135M: 30 layers, 3 KV heads x 64; 1,000 tokens
    assert ggml_kv_bytes("f16", 1000, 30, 192) == 1000 * 30 * 2 * 192 * 2
    assert ggml_kv_bytes("q8_0", 1000, 30, 192) == 1000 * 30 * 2 * 192 // 32 * 34
    assert ggml_kv_bytes("q4_0", 1000, 30, 192) == 1000 * 30 * 2 * 192 // 32 * 18
    assert set(GGML_TYPE_BYTES) == {"f16", "q8_0", "q4_0"}
    with pytest.raises(ValueError, match="multiple of 32"):
        ggml_kv_bytes("q4_0", 1, 1, 48)


def test_ratios_are_taken_within_rounds():
    figures = {
        "a": {"per_round": [{"s": 1.0}, {"s": 3.0}, {"s": 2.0}]},
        "b": {"per_round": [{"s": 2.0}, {"s": 2.0}, {"s": 4.0}]},
    }
    assert ratio(figures, "a", "b", "s") == {"median": 0.5, "min": 0.5, "max": 1.5}
