"""The recommendation (`kvdemo.compare.recommend`): its one-prefill hand-over against a prefill of its own, its
candidates and deploy lines from the registry, the search that cannot miss a fit (scores built by hand where a short
probe would mislead), the pick against its target, what the weights say, progress, Stop, and every refusal before
any forward pass.

Cost: 29 s in a pytest-xdist worker (the clean-clone CI of 2026-12-07: the tiny models; the embedded model only for
the command line's refusal, 11 s)."""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from kvdemo.cache.spec import CacheSpec
from kvdemo.cli.main import main
from kvdemo.compare.candidates import candidate_specs
from kvdemo.compare.llama_cpp_check import verify
from kvdemo.compare.recommend import check_target, recommend, text_questions
from kvdemo.compare.recommendation import (
    BOUND,
    FULL,
    EngineCheck,
    Recommendation,
    RecommendationCancelled,
    RecommendRow,
    TokenIds,
)
from kvdemo.compare.weights import read_weights
from kvdemo.evals.cases import example_path
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.session import QASession
from tests.families import family_config, tiny_family
from tests.helpers import make_tiny

LLAMA = LlamaConfig(
    vocab_size=64, hidden_size=128, intermediate_size=32, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64,
)  # fmt: skip


@pytest.fixture(scope="module")
def text(normans) -> str:
    return normans.select("0-1").context


@pytest.fixture(scope="module")
def own_tiny(embedded):
    """A tiny model of this module's own: a test takes its forward pass away, and a model check that failed then would
    stay cached on a shared model (`kvdemo.qa.probe.check_model`)."""
    return make_tiny(embedded.tokenizer)


@pytest.fixture(scope="module")
def short_text(normans) -> str:
    """A text that leaves room in the tiny model's 512-token window for an answer and the held-out tokens."""
    return normans.select("0").context


@pytest.fixture(scope="module")
def questions(normans) -> list[str]:
    return [q.question for q in normans.select("0-1").answerable(2)]


# ---- the hand-over: one prefill for every candidate --------------------------------------------------------------
@pytest.mark.parametrize(
    ("family", "spec"),
    [("Llama 3", "hqq:4,flush=append"), ("Llama 3", "turboquant:4"), ("Gemma 3", "quanto:2,sliding=quantize"),
     ("Gemma 3", "fp8")],
)  # fmt: skip
def test_prefill_from_equals_a_prefill(family, spec, embedded, text, questions):
    """A cache handed over from a `dynamic` prefill scores and answers as a prefill of its own, bit for bit (both
    quantize the same full-precision keys and values: the chunked prefill's last stage), on full-attention and
    sliding-window layers; and the reference's own cache is unchanged by the candidate's answers."""
    loaded = tiny_family(family, embedded.tokenizer)
    spec_ = CacheSpec.parse(spec)
    reference = QASession(loaded)
    reference.prefill(text)
    assert reference.cache_length > 256  # several chunks: the hand-over path of a real prefill
    own, handed = QASession(loaded, spec_), QASession(loaded, spec_)
    own.prefill(text)
    handed.prefill_from(reference)
    assert handed.cache_length == own.cache_length == reference.cache_length
    before = reference.score(questions[0], [1, 2, 3])
    answer = own.ask(questions[0], 8)
    assert handed.ask(questions[0], 8).token_ids == answer.token_ids
    assert torch.equal(handed.score(questions[1], answer.token_ids), own.score(questions[1], answer.token_ids))
    assert torch.equal(reference.score(questions[0], [1, 2, 3]), before)


@pytest.mark.parametrize("spec", ["dynamic", "quanto:4,residual_length=4"])  # a residual that flushes mid-answer
def test_an_answer_s_own_log_probabilities_are_its_score(tiny, short_text, questions, spec):
    """`ask(..., logprobs=rows)` keeps each decode step's distribution: what `score` gives for the same answer, bit
    for bit (the recommendation's reference answers and scores in one pass)."""
    session = QASession(tiny, CacheSpec.parse(spec))
    session.prefill(short_text)
    rows: list[torch.Tensor] = []
    answer = session.ask(questions[0], 12, logprobs=rows)
    assert len(rows) == len(answer.token_ids) == 12
    assert torch.equal(torch.stack(rows), session.score(questions[0], answer.token_ids))
    assert [int(r.argmax()) for r in rows] == list(answer.token_ids)


def test_prefill_from_refuses_what_it_cannot_hand_over(tiny, text):
    reference = QASession(tiny, CacheSpec.parse("quanto:4"))
    with pytest.raises(ValueError, match="prefill it with `prefill`"):
        QASession(tiny, CacheSpec.parse("dynamic,storage=growing")).prefill_from(QASession(tiny))
    with pytest.raises(ValueError, match="takes a dynamic session"):
        QASession(tiny, CacheSpec.parse("fp8")).prefill_from(reference)
    with pytest.raises(ValueError, match="prefill a context"):  # a dynamic session not yet prefilled
        QASession(tiny, CacheSpec.parse("fp8")).prefill_from(QASession(tiny))
    dynamic = QASession(tiny)
    dynamic.prefill("Rollo led the Vikings to Normandy.")
    with pytest.raises(ValueError, match="ggml's prefill attends through its own stored cache"):  # as llama.cpp's
        QASession(tiny, CacheSpec.parse("ggml:q4_0")).prefill_from(dynamic)


# ---- candidates and deploy lines ---------------------------------------------------------------------------------
def test_candidates_come_from_the_registry_for_each_engine():
    every = candidate_specs(LLAMA)
    assert every[0].text == "dynamic" and len({s.label for s in every}) == len(every)
    for spec in every[1:]:
        options = spec.resolved()
        if "nbits_value" in spec.given() and "protect" not in spec.given():  # a split gives the keys the bits (but
            # vLLM's presets, which keep their own: k3v4_nc)
            assert options["nbits_value"] <= options["nbits"]
        assert options.get("nbits", 8) >= 2
    texts = {s.short_text for s in every}
    assert {"quanto:4,rotation=hadamard", "hqq:8,nbits_value=4", "fp8,scale=per_token_head"} <= texts
    vllm = "sliding=quantize,protect=vllm,layout=vllm"  # vLLM's presets, as vLLM stores them
    assert {f"turboquant:8,nbits_value=4,residual_length=1,{vllm}",
            f"turboquant:4,residual_length=1,norm_correction=true,{vllm}"} <= texts  # fmt: skip
    assert not any("sliding" in t for t in texts if vllm not in t)  # no sliding layer: the option changes nothing
    transformers = candidate_specs(LLAMA, "transformers")
    assert [s.short_text for s in transformers] == ["dynamic", "quanto:2", "quanto:4", "hqq:2", "hqq:3", "hqq:4",
                                                    "hqq:8", "fp8"]  # fmt: skip
    served = candidate_specs(LLAMA, "vllm")
    calculated = "fp8_e4m3 --calculate-kv-scales  # from its first forward pass: kvdemo's from the whole prefill"
    assert served[0].text == "dynamic" and [s.deployments(LLAMA)[0].line for s in served[1:]] == [
        *(f"vLLM: --kv-cache-dtype {name}" for name in ("fp8_per_token_head", "fp8_e4m3", calculated)),
        "vLLM: --kv-cache-dtype fp8_e5m2",  # fp8's own candidate, after its grid
        *(f"vLLM: --kv-cache-dtype turboquant_{name}" for name in ("k8v4", "4bit_nc", "k3v4_nc", "3bit_nc")),
        *(f"vLLM: --kv-cache-dtype {name}" for name in ("nvfp4", "nvfp4_4over6", "fp8_k_nvfp4_v")),
        "vLLM: --kv-cache-dtype int8_per_token_head",
    ]
    assert [s.short_text for s in candidate_specs(LLAMA, "sglang")] == [
        "dynamic", "fp8,scale=one", "fp8,scale=one,float8=e5m2", "nvfp4"]  # fmt: skip
    assert [s.short_text for s in candidate_specs(LLAMA, "tensorrt-llm")] == [
        "dynamic",
        "fp8",
        "nvfp4,tensor_scale=prefill",
    ]
    with pytest.raises(ValueError, match="not one of any, llama.cpp"):
        candidate_specs(LLAMA, "tensorrt")


def test_candidates_and_deploy_lines_on_a_sliding_window_model():
    gemma = family_config("Gemma 3")
    texts = {s.short_text for s in candidate_specs(gemma)}
    assert {
        "quanto:4,q_group_size=32",
        "quanto:4,q_group_size=32,sliding=quantize",
        "turboquant:4,sliding=quantize",
    } <= texts
    # transformers' QuantizedCache refuses a model with a layer that is not full attention
    assert [s.text for s in candidate_specs(gemma, "transformers")] == ["dynamic"]
    assert [d.engine for d in CacheSpec.parse("quanto:4").deployments(gemma)] == ["kvdemo"]


def test_deploy_lines_name_only_what_the_engine_stores():
    lines = {text: [d.line for d in CacheSpec.parse(text).deployments(LLAMA)] for text in
             ("quanto:4", "hqq:2,q_group_size=32", "fp8", "quanto:4,rotation=hadamard", "hqq:4,optimize=false",
              "quanto:4,flush=append", "fp8,scale=per_token_head", "dynamic", "dynamic,storage=growing")}  # fmt: skip
    assert lines["quanto:4"] == [
        'transformers: model.generate(..., cache_implementation="quantized", cache_config={"backend": "quanto", '
        '"nbits": 4})',
        'kvdemo: python -m kvdemo ask --backend quanto --nbits 4 ...; in Python CacheSpec.parse("quanto:4")',
    ]
    assert '"q_group_size": 32' in lines["hqq:2,q_group_size=32"][0]
    assert lines["fp8"][0].endswith('cache_config={"backend": "fp8"})')
    assert lines["fp8,scale=per_token_head"][0] == "vLLM: --kv-cache-dtype fp8_per_token_head"
    for own in (
        "quanto:4,rotation=hadamard",
        "hqq:4,optimize=false",
        "quanto:4,flush=append",
    ):
        assert len(lines[own]) == 1 and lines[own][0].startswith("kvdemo: python -m kvdemo ask")  # kvdemo's own
        assert lines[own][0].endswith(f'CacheSpec.parse("{own}")')  # options: no engine stores them so
    assert len(lines["dynamic"]) == 7 and lines["dynamic"][0].startswith("llama.cpp:")
    assert lines["dynamic,storage=growing"] == [
        "kvdemo: python -m kvdemo ask --backend dynamic --storage growing ...; in Python "
        'CacheSpec.parse("dynamic,storage=growing")'
    ]


# ---- the recommendation --------------------------------------------------------------------------------------------
def test_recommend_picks_the_fewest_bytes_within_the_ceiling(tiny, short_text, questions):
    seen: list[tuple[int, int]] = []
    ceiling = 1e-4  # the tiny random model moves little: turboquant:2 0.0003, turboquant:3 0.00005
    found = recommend(tiny, short_text, questions, max_kl=ceiling, on_progress=lambda d, t, w: seen.append((d, t)))
    picked = found.picked
    assert picked is not None and picked.measured == FULL and picked.mean_kl is not None
    assert picked.mean_kl <= ceiling
    least = picked.bytes_per_token[0]
    # every candidate with fewer bytes was measured over the ceiling (in full, or on a bound its tokens prove), or
    # refused; none with more bytes was measured
    for row in found.rows[1:]:
        if row.bytes_per_token[0] < least and row.spec != picked.spec:
            assert row.measured in (FULL, BOUND) or row.note.startswith("refused"), row
            assert row.kl is None or row.kl > ceiling, row
        elif PLAN_WORD not in row.spec and row.spec != picked.spec:
            assert row.measured == "" and row.note.startswith("not measured: no fewer bytes than"), row
    bound = [r for r in found.rows if r.measured == BOUND]
    assert bound and all(r.mean_kl is None and 0 < r.positions < picked.positions for r in bound)
    assert found.rows[0].spec == "dynamic" and found.rows[0].mean_kl == 0.0
    assert len(picked.question_kl) == 2 and min(picked.question_kl) <= picked.mean_kl <= max(picked.question_kl)
    assert found.held_out_tokens == 32 and picked.perplexity_ratio > 0 and picked.held_out_kl >= 0  # type: ignore[operator]
    assert picked.p999_kl >= picked.p99_kl >= 0 and 0 <= picked.rms_dp <= 100  # type: ignore[operator]
    assert picked.spec in found.why and f"{picked.mean_kl:.4f}" in found.why
    assert picked.deploy[-1].startswith(f"kvdemo: python -m kvdemo ask --backend {picked.backend}")
    assert picked.deploy[-1].endswith(f'in Python CacheSpec.parse("{picked.spec}")')
    assert seen and all(d <= t for d, t in seen) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    again = Recommendation.from_dict(found.to_dict())
    assert again == found and again.to_frame().equals(found.to_frame()) and again.token_ids == found.token_ids
    # the ids scored, for an engine to read the same (`--verify`): the prefill's, each question's, dynamic's answers
    ids, decode = found.token_ids, tiny.tokenizer.decode
    assert ids is not None and len(ids.answers) == len(ids.questions) == len(questions)
    assert short_text[:40] in decode(ids.prefix) and short_text[-200:] not in decode(ids.prefix)  # the end held out
    assert all(q in decode(q_ids) for q, q_ids in zip(questions, ids.questions))
    assert sum(len(a) for a in ids.answers) == picked.positions


PLAN_WORD = "plan="


def _row_of_kl(target: float, vocab: int) -> torch.Tensor:
    """Log-probabilities q over `vocab` tokens with KL(uniform || q) = `target`: token 0's logit raised by x, found by
    bisection (KL = log((V - 1 + e^x) / V) - x / V, increasing in x >= 0)."""
    low, high = 0.0, 60.0
    for _ in range(100):
        x = (low + high) / 2
        kl = math.log((vocab - 1 + math.exp(x)) / vocab) - x / vocab
        low, high = (x, high) if kl < target else (low, x)
    logits = torch.zeros(vocab, dtype=torch.float64)
    logits[0] = (low + high) / 2
    return torch.log_softmax(logits, dim=-1).float()


def _crafted_scores(monkeypatch, kl_at) -> None:
    """`QASession.score` made to give known figures: `dynamic` a uniform distribution at every answer token (its
    answers' own steps too, `ask(..., logprobs=)`), and a quantized spec one whose KL to it is `kl_at(spec, question,
    token)` (None: 1 nat, far over any ceiling); `until` is honoured as the real scoring honours it. Everything else
    (the answers' tokens, the model check, the hand-over, the held-out tokens) runs for real."""
    real_score, real_ask = QASession.score, QASession.ask
    rows_of: dict[float, torch.Tensor] = {}

    def ask(self, question, max_new_tokens=24, logprobs=None):
        answer = real_ask(self, question, max_new_tokens, logprobs)
        if logprobs is not None:  # the reference's rows: uniform, as its `score` gives them below
            uniform = rows_of.setdefault(0.0, _row_of_kl(0.0, self.loaded.model.config.vocab_size))
            logprobs[:] = [uniform] * len(logprobs)
        return answer

    def score(self, question, answer_ids, on_step=None, until=None):
        real_score(self, question, answer_ids[:1])  # the checks and the forward pass of a real scoring
        vocab = self.loaded.model.config.vocab_size
        rows = []
        for i in range(len(answer_ids)):
            kl = 0.0 if not self.spec.info.quantized else kl_at(self.spec.short_text, question, i)
            kl = 1.0 if kl is None else kl
            rows.append(rows_of.setdefault(kl, _row_of_kl(kl, vocab)))
            if until is not None and until(rows[-1]):
                break
        return torch.stack(rows)

    monkeypatch.setattr(QASession, "score", score)
    monkeypatch.setattr(QASession, "ask", ask)


def test_recommend_is_not_misled_by_an_answer_s_first_tokens(tiny, short_text, questions, monkeypatch):
    """The candidate good on its first 8 tokens and bad on the rest is out on a bound from its own tokens; the one
    bad on its first token and good on the rest is the pick: the earlier probe of 8 tokens dropped it (4x over the
    ceiling) and measured the other in full, then kept dynamic. Under a byte budget the same two: the lowest mean."""
    ceiling = 0.02
    good_start, bad_start = "quanto:2", "quanto:4"

    def kl_at(spec, question, token):
        first = question == questions[0]
        if spec == good_start:
            return 0.0 if first and token < 8 else 0.1
        if spec == bad_start:
            return 0.3 if first and token == 0 else 0.0
        return None

    _crafted_scores(monkeypatch, kl_at)
    found = recommend(tiny, short_text, questions, max_kl=ceiling, engine="transformers", plans=False)  # 7 specs
    rows = {r.spec: r for r in found.rows}
    tokens = rows["dynamic"].positions
    assert tokens > 15  # so that 0.3 / tokens is within the ceiling and 0.1 x (tokens - 8) / tokens is not
    assert found.pick == bad_start and rows[bad_start].mean_kl == pytest.approx(0.3 / tokens, rel=1e-4)
    early = rows[good_start]
    assert early.measured == BOUND and early.kl_at_least > ceiling and early.positions > 8  # type: ignore[operator]
    assert early.kl_at_least == pytest.approx(0.1 * (early.positions - 8) / tokens, rel=1e-4)
    smaller = [r for r in found.rows[1:] if r.bytes_per_token[0] < rows[bad_start].bytes_per_token[0]]
    assert smaller and all(r.measured in (BOUND, FULL) and r.kl > ceiling for r in smaller)  # type: ignore[operator]
    assert [r for r in smaller if r.spec != good_start and r.positions == 1]  # hqq:2 at 1 nat: out after one token
    assert f"{rows[bad_start].mean_kl:.4f}" in found.why and "mean KL 1.0000" in found.why  # the next smaller, in full

    least = rows[bad_start].bytes_per_token[0]
    budget = recommend(tiny, short_text, questions, bytes_per_token=least, engine="transformers", plans=False)
    assert budget.pick == bad_start and budget.picked.mean_kl == pytest.approx(0.3 / tokens, rel=1e-4)  # type: ignore[union-attr]


def test_recommend_keeps_dynamic_only_when_every_smaller_setting_is_over(tiny, short_text, questions, monkeypatch):
    """Nothing within the ceiling: the answer is dynamic, and every candidate with fewer bytes was measured over it
    (each on a bound from its own tokens); the sentence says so and names no figure that was not measured."""
    _crafted_scores(monkeypatch, lambda spec, question, token: 0.05)  # over 0.02 from the first token on
    found = recommend(tiny, short_text, questions, max_kl=0.02, engine="transformers", plans=False)
    assert found.pick == "dynamic"
    quantized = [r for r in found.rows[1:] if r.note != "not measured: no fewer bytes than dynamic"]
    assert quantized and all(r.measured == BOUND or r.note.startswith("refused") for r in quantized)
    measured = [r for r in quantized if r.measured == BOUND]
    assert f"{len(measured)} measured over it" in found.why and found.why.endswith("keep dynamic.")
    assert "moved it by mean KL at least 0.02" in found.why  # the sum passes 0.02 x every token: the bound says so


def test_recommend_within_a_byte_budget_and_an_engine(tiny, short_text, questions):
    """Also on shorter answers (`answer_tokens`): every row measured in full is scored on the same answer tokens,
    at most that many per question."""
    budget = 5000.0
    found = recommend(
        tiny, short_text, questions, bytes_per_token=budget, engine="transformers", plans=False, answer_tokens=6
    )
    assert 0 < found.rows[0].positions <= 6 * len(questions)
    assert {r.positions for r in found.rows if r.measured == FULL} == {found.rows[0].positions}
    picked = found.picked
    assert picked is not None and picked.bytes_per_token[0] <= budget and picked.measured == FULL
    measured = [r for r in found.rows[1:] if r.measured in (FULL, BOUND)]
    assert all(r.kl > picked.mean_kl for r in measured if r is not picked)  # type: ignore[operator]
    assert all(r.bytes_per_token[0] <= budget for r in measured)
    assert all(any(line.startswith("transformers:") for line in r.deploy) for r in found.rows)


def test_recommend_stops_and_keeps_what_was_measured(tiny, short_text, questions):
    cancel = threading.Event()

    def progress(done, total, what):
        if done >= 7:  # the reference's 6 steps, then one candidate measured
            cancel.set()

    with pytest.raises(RecommendationCancelled) as stopped:
        recommend(tiny, short_text, questions, max_kl=1e-4, cancel=cancel, on_progress=progress)
    kept = stopped.value.recommendation
    assert not kept.finished and kept.pick == "" and kept.rows[0].spec == "dynamic"
    assert any(r.measured in (FULL, BOUND) for r in kept.rows[1:])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_kl": 0}, "must be a number > 0"),
        ({"max_kl": -0.1}, "must be a number > 0"),
        ({"max_kl": math.nan}, "must be a number > 0"),
        ({"bytes_per_token": 0.0}, "must be a number > 0"),
        ({"max_kl": 0.02, "bytes_per_token": 100.0}, "not both"),
        ({"bytes_per_token": 10.0}, "the smallest takes"),
        ({"engine": "tensorrt"}, "not one of"),
        ({"questions": ["Who?", " "]}, "a question is empty"),
        ({"answer_tokens": 0}, "answer_tokens=0 must be a whole number >= 1"),
        ({"answer_tokens": 10_000}, "answer_tokens=10000 is more than a recommendation runs here; use at most 256"),
    ],
)
def test_recommend_refuses_bad_input_before_any_forward_pass(own_tiny, text, monkeypatch, kwargs, message):
    def no_forward(*args, **kw):
        raise AssertionError("a forward pass ran")

    QASession(own_tiny)  # the model check of `dynamic` (a few tokens, once per model), before the forward is taken
    monkeypatch.setattr(own_tiny, "forward", no_forward)
    questions = kwargs.pop("questions", ["Who were the Normans?"])
    with pytest.raises(ValueError, match=message):
        recommend(own_tiny, text, questions, **kwargs)


def test_recommend_refuses_an_empty_or_short_text(tiny):
    with pytest.raises(ValueError, match="the text is empty"):
        recommend(tiny, "  ", ["Who?"])
    with pytest.raises(ValueError, match="needs 64 or more"):
        recommend(tiny, "The Normans were a people of northern France.", ["Who?"])


def test_questions_are_taken_from_the_text_at_several_depths(text):
    asked = text_questions(text)
    assert len(asked) == 3 and all(q.startswith('What does the text say right after "') for q in asked)
    assert asked[0] != asked[-1]
    with pytest.raises(ValueError, match="give questions"):
        text_questions("Too short. Also short.")
    assert check_target(None, None) == ("max_kl", 0.02)


def test_cli_recommend_refuses_with_exit_2(capsys):
    case = str(example_path("normans"))
    assert main(["recommend", "--context-file", case, "--max-kl", "0"]) == 2
    assert "must be a number > 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--verify"], "add --engine llama.cpp (not any)"),
        (["--verify", "--engine", "llama.cpp", "--model", "HuggingFaceTB/SmolLM2-135M"], "is not one: give --model"),
        (["--verify", "--engine", "llama.cpp", "--model", "missing.gguf"], "missing.gguf: no such file"),
        (["--verify", "--engine", "llama.cpp", "LLAMA"], "make bench-peers"),
    ],
)
def test_cli_verify_refuses_before_the_model_loads_with_exit_2(args, message, capsys, monkeypatch):
    if "LLAMA" in args:  # llama-cpp-python not installed (as in CI), whether or not this machine has it
        monkeypatch.setitem(sys.modules, "llama_cpp", None)
        args = args[:-1]
    start = time.perf_counter()
    assert main(["recommend", "--context-file", str(example_path("normans")), "--no-progress", *args]) == 2
    assert message in capsys.readouterr().err
    assert time.perf_counter() - start < 5  # no model was loaded (that takes 10 s and more)


def test_the_engine_check_says_whether_the_engines_agree_within_2x():
    check = EngineCheck(
        "llama.cpp", "0.3.36", "ggml:q5_0", "llama.cpp: llama-server ...", 0.00638, 0.0094, 0.00198, 97.2, 72, 36.0
    )  # fmt: skip  (the embedded model on the Normans text, 2026-12-07)
    assert check.ratio == pytest.approx(0.00638 / 0.0094) and check.agrees
    assert "0.00638; kvdemo's: 0.00940; 0.68x, within 2x" in check.lines()[1]
    assert "of which its q8_0 cache already gives 0.00198" in check.lines()[2]
    assert "at 97.2 % of positions" in check.lines()[2]
    gemma = dataclasses.replace(check, kl=0.0398, kvdemo_kl=0.0128)  # Gemma 3 270M's q5_1 there
    assert not gemma.agrees and "3.11x, NOT within 2x" in gemma.lines()[1]
    assert not dataclasses.replace(check, kl=0.004, kvdemo_kl=0.0094).agrees  # under half: not agreeing either


def test_the_printed_recommendation_says_how_to_check_a_ggml_pick_in_llama_cpp():
    from kvdemo.cli.format import format_recommendation

    row = RecommendRow("ggml,type_k=q5_0", "ggml", (7920.0,), mean_kl=0.0094, positions=72, measured=FULL,
                       deploy=("llama.cpp: llama-server -m MODEL.gguf -ctk q5_0 -ctv q5_0 -fa on",))  # fmt: skip
    found = Recommendation("m", 900, "max_kl", 0.02, "llama.cpp", ("q",), (), (row,), row.spec)
    assert "verify: run it in llama.cpp itself with --engine llama.cpp --verify" in format_recommendation(found)
    assert "NaN" not in format_recommendation(found)  # figures not measured (same top %, 99.9 % KL) left blank
    check = EngineCheck("llama.cpp", "0.3.36", row.spec, row.deploy[0], 0.00638, 0.0094, 0.00198, 97.2, 72, 36.0)
    printed = format_recommendation(dataclasses.replace(found, engine_check=check)).splitlines()
    assert (
        printed[-4] == f"verify: llama.cpp 0.3.36 on the same GGUF and ids (72 answer tokens, 36 s): `{row.deploy[0]}`"
    )
    assert printed[-3:-1] == check.lines()[1:]
    again = Recommendation.from_dict(dataclasses.replace(found, engine_check=check).to_dict())
    assert again.engine_check == check


def test_the_llama_cpp_release_named_is_the_one_make_bench_peers_installs():
    from kvdemo.compare.llama_cpp_check import LLAMA_CPP_VERSION

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    assert f"LLAMA_CPP_VERSION := {LLAMA_CPP_VERSION}\n" in makefile


def test_verify_refuses_a_pick_llama_cpp_does_not_store():
    row = RecommendRow("quanto:4", "quanto", (1.0,), mean_kl=0.01, positions=1, measured=FULL)
    found = Recommendation("m", 10, "max_kl", 0.02, "any", ("q",), (), (row,), "quanto:4",
                           token_ids=TokenIds((1,), ((2,),), ((3,),)))  # fmt: skip
    with pytest.raises(ValueError, match="quanto:4, not one of llama.cpp's cache types"):
        verify(found, Path("model.gguf"))
    with pytest.raises(ValueError, match="no pick to verify"):
        verify(dataclasses.replace(found, pick=""), Path("model.gguf"))


def test_recommend_refuses_an_engine_with_no_candidate_on_this_model(embedded, short_text, monkeypatch):
    odd = make_tiny(embedded.tokenizer, head_dim=40)  # no MLX group size divides it
    QASession(odd)  # the model check of `dynamic`, before the forward is taken

    def no_forward(*args, **kw):
        raise AssertionError("a forward pass ran")

    monkeypatch.setattr(odd, "forward", no_forward)
    refusal = "kvdemo stores none of mlx-lm's quantized cache formats for this model, so it cannot measure what mlx-lm"
    with pytest.raises(ValueError, match=refusal + " would do; choose --engine among any, "):
        recommend(odd, short_text, ["Who were the Normans?"], engine="mlx-lm")


def test_cli_recommend_refuses_an_engine_it_does_not_know_with_exit_2(capsys):
    case = str(example_path("normans"))
    with pytest.raises(SystemExit) as stopped:
        main(["recommend", "--context-file", case, "--engine", "mlx", "--no-progress"])
    assert stopped.value.code == 2
    assert "invalid choice: 'mlx' (choose from 'any', 'llama.cpp', 'vllm', 'sglang'" in capsys.readouterr().err


# ---- what the weights say ------------------------------------------------------------------------------------------
def _qwen2(embedded, layers: int, outliers: dict[int, float]) -> LoadedModel:
    """A random tiny Qwen2 (k_proj with a bias, no QK-norm) whose key biases all have norm 1, but `outliers`'."""
    llama = family_config("Llama 3")
    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    config = AutoConfig.for_model("qwen2", num_hidden_layers=layers, **{k: getattr(llama, k) for k in shape})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            bias = layer.self_attn.k_proj.bias
            bias.copy_(torch.randn_like(bias)).div_(bias.norm()).mul_(outliers.get(i, 1.0))
    return LoadedModel(model, embedded.tokenizer, "tiny-qwen2", None, 1024, torch.device("cpu"), torch.float32)


def test_the_weights_are_read_first_and_outlier_key_biases_are_protected(embedded):
    """Qwen2's huge key biases at its ends (llama.cpp#21385): the layers over 5x the median are named, and every
    candidate that can keep layers at full precision is also measured with them kept (protect=1:1 here); an outlier
    deeper than protect reaches is said to be so; QK-norm and GQA read from the modules and the config."""
    qwen = _qwen2(embedded, 8, {0: 30.0, 7: 40.0})
    traits = read_weights(qwen)
    assert traits.key_bias_norms == pytest.approx((30.0, *[1.0] * 6, 40.0), rel=1e-4)
    assert (traits.outliers, traits.protect, traits.qk_norm, traits.gqa) == ((0, 7), "1:1", False, 2.0)
    assert traits.head_dims == (32,)
    assert "outliers over 5x: layer 0 30, layer 7 40; candidates also measured with protect=1:1" in traits.summary()
    texts = {s.short_text for s in candidate_specs(qwen.config, protect=traits.protect)}
    assert {"turboquant:4", "turboquant:4,protect=1:1", "fp8,protect=1:1", "hqq:4,q_group_size=32,protect=1:1"} <= texts
    assert not any("protect" in t for t in texts if t.startswith("ggml"))  # llama.cpp keeps no layer aside
    deep = read_weights(_qwen2(embedded, 12, {6: 50.0}))
    assert deep.outliers == (6,) and deep.protect == "" and "too deep for protect" in deep.summary()
    plain = read_weights(tiny_family("Qwen3", embedded.tokenizer))
    assert plain.qk_norm and not plain.key_bias_norms and plain.summary().endswith("QK-norm, no key bias")
