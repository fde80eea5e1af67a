"""The recommendation (`kvdemo.compare.recommend`): its one-prefill hand-over against a prefill of its own, its
candidates and deploy lines from the registry, the pick against its target, progress, Stop, and every refusal before
any forward pass.

Cost: about 15 s on 2 cores (the tiny models; the embedded model only for the command line's refusals)."""

from __future__ import annotations

import math
import threading

import pytest
import torch
from transformers import LlamaConfig

from kvdemo.cache.spec import CacheSpec
from kvdemo.cli.main import main
from kvdemo.compare.candidates import candidate_specs
from kvdemo.compare.recommend import FULL_AT_MOST, check_target, recommend, text_questions
from kvdemo.compare.recommendation import FULL, PROBE, Recommendation, RecommendationCancelled
from kvdemo.evals.cases import example_path
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


def test_prefill_from_refuses_what_it_cannot_hand_over(tiny, text):
    reference = QASession(tiny, CacheSpec.parse("quanto:4"))
    with pytest.raises(ValueError, match="prefill it with `prefill`"):
        QASession(tiny, CacheSpec.parse("dynamic,storage=growing")).prefill_from(QASession(tiny))
    with pytest.raises(ValueError, match="takes a dynamic session"):
        QASession(tiny, CacheSpec.parse("fp8")).prefill_from(reference)
    with pytest.raises(ValueError, match="prefill a context"):  # a dynamic session not yet prefilled
        QASession(tiny, CacheSpec.parse("fp8")).prefill_from(QASession(tiny))


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
    assert served[0].text == "dynamic" and [s.deployments(LLAMA)[0].line for s in served[1:]] == [
        f"vLLM: --kv-cache-dtype turboquant_{name}" for name in ("k8v4", "4bit_nc", "k3v4_nc", "3bit_nc")
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
    for own in (
        "quanto:4,rotation=hadamard",
        "hqq:4,optimize=false",
        "quanto:4,flush=append",
        "fp8,scale=per_token_head",
    ):
        assert len(lines[own]) == 1 and lines[own][0].startswith("kvdemo: python -m kvdemo ask")  # kvdemo's own
        assert lines[own][0].endswith(f'CacheSpec.parse("{own}")')  # options: no engine stores them so
    assert len(lines["dynamic"]) == 5 and lines["dynamic"][0].startswith("llama.cpp:")
    assert lines["dynamic,storage=growing"] == [
        "kvdemo: python -m kvdemo ask --backend dynamic --storage growing ...; in Python "
        'CacheSpec.parse("dynamic,storage=growing")'
    ]


# ---- the recommendation --------------------------------------------------------------------------------------------
def test_recommend_picks_the_fewest_bytes_within_the_ceiling(tiny, short_text, questions):
    seen: list[tuple[int, int]] = []
    found = recommend(tiny, short_text, questions, max_kl=0.05, on_progress=lambda d, t, w: seen.append((d, t)))
    full = [r for r in found.rows if r.measured == FULL]
    picked = found.picked
    assert picked is not None and picked.mean_kl is not None and picked.mean_kl <= 0.05
    # measured by bytes, fewest first: every full row with fewer bytes than the pick was over the ceiling
    assert all(r.mean_kl > 0.05 for r in full if r.bytes_per_token[0] < picked.bytes_per_token[0])  # type: ignore[operator]
    assert len(full) <= FULL_AT_MOST + 2  # dynamic, and a plan
    assert found.rows[0].spec == "dynamic" and found.rows[0].mean_kl == 0.0
    assert all(r.probe_kl is not None for r in found.rows if r.measured in (PROBE, FULL))
    assert found.held_out_tokens == 32 and all(r.perplexity_ratio > 0 for r in full)  # type: ignore[operator]
    assert picked.spec in found.why and f"{picked.mean_kl:.4f}" in found.why
    assert picked.deploy[-1].startswith(f"kvdemo: python -m kvdemo ask --backend {picked.backend}")
    assert picked.deploy[-1].endswith(f'in Python CacheSpec.parse("{picked.spec}")')
    assert seen and all(d <= t for d, t in seen) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    again = Recommendation.from_dict(found.to_dict())
    assert again == found and again.to_frame().equals(found.to_frame())


def test_recommend_within_a_byte_budget_and_an_engine(tiny, short_text, questions):
    budget = 5000.0
    found = recommend(tiny, short_text, questions, bytes_per_token=budget, engine="transformers", plans=False)
    picked = found.picked
    assert picked is not None and picked.bytes_per_token[0] <= budget
    full = [r for r in found.rows if r.measured == FULL and r.backend != "dynamic"]
    assert picked.mean_kl == min(r.mean_kl for r in full)  # type: ignore[type-var]
    assert all(r.bytes_per_token[0] <= budget for r in full)
    assert all(any(line.startswith("transformers:") for line in r.deploy) for r in found.rows)


def test_recommend_stops_and_keeps_what_was_measured(tiny, short_text, questions):
    cancel = threading.Event()

    def progress(done, total, what):
        if done >= 12:
            cancel.set()

    with pytest.raises(RecommendationCancelled) as stopped:
        recommend(tiny, short_text, questions, cancel=cancel, on_progress=progress)
    kept = stopped.value.recommendation
    assert not kept.finished and kept.pick == "" and kept.rows[0].spec == "dynamic"
    assert any(r.measured == PROBE for r in kept.rows)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_kl": 0}, "must be a number > 0"),
        ({"max_kl": -0.1}, "must be a number > 0"),
        ({"max_kl": math.nan}, "must be a number > 0"),
        ({"bytes_per_token": 0.0}, "must be a number > 0"),
        ({"max_kl": 0.02, "bytes_per_token": 100.0}, "not both"),
        ({"bytes_per_token": 10.0}, "the smallest takes"),
        ({"engine": "vllm"}, "choose --engine among any, llama.cpp, transformers, kvdemo"),
        ({"engine": "tensorrt"}, "not one of"),
        ({"questions": ["Who?", " "]}, "a question is empty"),
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


@pytest.mark.model  # the refusal reads the model's candidates: main() loads the embedded model itself
def test_cli_recommend_refuses_an_engine_with_no_candidate_with_exit_2(capsys):
    case = str(example_path("normans"))
    assert main(["recommend", "--context-file", case, "--engine", "mlx", "--no-progress"]) == 2
    assert "kvdemo stores none of mlx's quantized cache formats" in capsys.readouterr().err
