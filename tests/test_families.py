"""The model-family matrix (docs/DESIGN.md, invariants 1 and 2 on every family): one tiny random model per family
(`tests.families.FAMILIES`, 4 layers, hidden 128, built from its own transformers config), each spec of
`tests.families.SPECS`, on the Normans' first paragraph and two of its questions. A cell either runs and is right,
or is refused before the prefill; none runs and is wrong, none crashes. docs/models.md shows the table.

Cost: 48 s in a pytest-xdist worker on 2 cores (the clean-clone CI run of 2026-12-04) before `sliding=quantize`;
about 70 s in one process since: 25 models of a few million weights built from their configs, each working cell
prefilling three sessions and scoring two answers (a `sliding=quantize` cell on a model without sliding layers is
checked to build the same layers as its twin instead of run again); the probe's seven model types; DeepSeek-V3's
real shape on four backends."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import BaseQuantizedLayer

from kvdemo.cache.layers import attention, flush
from kvdemo.cache.model.layer_kinds import (
    LAYER_KINDS,
    STATE_ATTRIBUTES,
    UnsupportedModelError,
    layer_types,
    quantized_layers,
)
from kvdemo.cache.spec import CacheSpec, build_cache
from kvdemo.qa.models import LoadedModel
from kvdemo.qa.session import QASession
from tests.families import FAMILIES, SPECS, family_config, markdown_table, tiny_family, verdict

ANSWER_TOKENS = 6
DYNAMIC_BOUND = 1e-4
"""max |Δ log p| of `dynamic` against a cache-free forward pass of the same ids (float rounding: 1e-6 measured)."""
RECURRENT_BOUND = 5e-4
"""The same for a model with conv or recurrent states prefilled in chunks: 2e-4 measured on Jamba, whose Mamba state
is carried from chunk to chunk (a scan per chunk against the cache-free pass's single scan)."""
READ_WHOLE_BOUND = 1e-3
"""max |Δ log p| of a quantized backend against the same cache read whole (no block-wise read, any rotation undone
on read): the same stored values, other float orders (invariant 6's bound for teacher-forced log-probabilities)."""


CHUNK_TOKENS = 64
"""The prefill's chunk in the matrix: the context (about 150 tokens, windows of 16) is prefilled in several chunks,
so a quantized cache is filled from a full-precision one layer by layer (`kvdemo.qa.prefill.hand_over`)."""


def _filled_like_dynamic(session: QASession, dynamic: QASession) -> None:
    """After the prefill (or a restore) every layer of a quantized session has seen the context's tokens, and every
    layer its backend keeps at full precision holds `dynamic`'s tensors bit for bit (the same chunks through the
    same transformers layers): its window, its conv and recurrent states. Not for a backend whose prefill attends
    through its own store (`ggml`, as llama.cpp): the hidden states after its first attention layer differ, so the
    later kept layers' states do too, as they do in llama.cpp."""
    for index, (layer, reference) in enumerate(zip(session.cache.layers, dynamic.cache.layers)):
        if getattr(reference, "keys", None) is not None:
            assert layer.get_seq_length() == reference.get_seq_length(), index
        if isinstance(layer, BaseQuantizedLayer) or not session.spec.info.hands_over:
            continue
        for name in ("keys", "values", *STATE_ATTRIBUTES):
            mine, theirs = getattr(layer, name, None), getattr(reference, name, None)
            if isinstance(theirs, dict):
                assert mine.keys() == theirs.keys(), (index, name)
                assert all(torch.equal(mine[k], theirs[k]) for k in theirs if theirs[k] is not None), (index, name)
            elif isinstance(theirs, torch.Tensor):
                assert torch.equal(mine, theirs), (index, name)


def _session(loaded: LoadedModel, spec, context: str, chunk_tokens: int = CHUNK_TOKENS) -> QASession:
    session = QASession(loaded, spec)
    session.prefill(context, max_new_tokens=ANSWER_TOKENS, chunk_tokens=chunk_tokens)
    return session


def _cache_free(loaded: LoadedModel, prompt: list[int], answer: tuple[int, ...]) -> torch.Tensor:
    """The log-probabilities of each answer token's position from one forward pass without a cache."""
    ids = torch.tensor([prompt + list(answer)])
    with torch.no_grad():
        logits = loaded.model(input_ids=ids, use_cache=False).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


def _layer_classes(spec: CacheSpec, loaded) -> list[type]:
    """The classes of the layers of an empty cache of `spec` built now (under the patch: those of the whole read)."""
    return [type(layer) for layer in build_cache(spec, loaded.config).layers]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_cell_is_right_or_refused_before_the_prefill(family, embedded, normans, monkeypatch):
    loaded = tiny_family(family, embedded.tokenizer)
    context, questions = normans.paragraphs[0], [q.question for q in normans.questions[:2]]
    for spec in SPECS:
        reason = verdict(spec, loaded.config)
        if reason is not None:  # refused when the session is built, nothing ran, with what would work
            with pytest.raises(ValueError) as refused:
                QASession(loaded, spec)
            assert str(refused.value) == reason
            assert "backend=dynamic" in reason
            continue
        if spec.sliding and quantized_layers(loaded.config, "keep") == quantized_layers(loaded.config, spec.sliding):
            # no sliding layer: the cache is the one the spec without `sliding` builds, layer for layer (run above)
            built = [type(layer) for layer in build_cache(spec, loaded.config).layers]
            assert built == [type(layer) for layer in build_cache(spec.replace(sliding=None), loaded.config).layers]
            continue
        session = _session(loaded, spec, context)
        if spec.backend == "dynamic":
            dynamic = session
        else:
            _filled_like_dynamic(session, dynamic)
        length = session.cache_length
        answers = [session.ask(question, max_new_tokens=ANSWER_TOKENS) for question in questions]
        assert all(a.steps == ANSWER_TOKENS for a in answers) and session.cache_length == length
        fresh = _session(loaded, spec, context)
        scores = []
        for question, answer in zip(questions, answers):  # restored twice: the same as a fresh session's, Δ 0
            scores.append(session.score(question, answer.token_ids))
            assert torch.equal(scores[-1], fresh.score(question, answer.token_ids)), (family, spec.text)
            assert session.cache_length == length
        if spec.backend == "dynamic":
            for question, answer, score in zip(questions, answers, scores):
                reference = _cache_free(loaded, session.prompt_ids(question), answer.token_ids)
                recurrent = any(LAYER_KINDS[kind].in_place_state for kind in layer_types(loaded.config))
                assert (score - reference).abs().max() < (RECURRENT_BOUND if recurrent else DYNAMIC_BOUND), family
            continue
        with monkeypatch.context() as patch:  # the same cache read whole, rotated back on read
            patch.setattr(flush, "uses_query_rotation", lambda config: False)
            if _layer_classes(spec, loaded) == [type(layer) for layer in session.cache.layers]:
                continue  # no layer reads its store another way (nvfp4, int8, mlx, fp8): the session is the whole read
            whole = _session(loaded, spec, context)
            for question, answer, score in zip(questions, answers, scores):
                gap = (score - whole.score(question, answer.token_ids)).abs().max()
                assert gap < READ_WHOLE_BOUND, (family, spec.text, float(gap))


LATENT = "DeepSeek-V3 (MLA)"


@pytest.mark.parametrize(
    "spec",
    [s for s in SPECS if s.backend != "dynamic" and verdict(s, family_config(LATENT)) is None],  # ggml: refused
    ids=lambda s: s.text,  # (its tiny rotary width, 16, is not a block of 32: test_every_family_and_backend)
)
def test_a_latent_cache_is_read_whole_at_every_decode_step(spec, embedded, normans, monkeypatch):
    """MLA: the model up-projects what `cache.update` returns, so attention must receive every cached position at
    every decode step (before, a block-wise read handed it the residual alone: 15-19 keys of 484-488)."""
    loaded = tiny_family(LATENT, embedded.tokenizer)
    session = _session(loaded, spec, normans.paragraphs[0])
    seen: list[tuple[int, int]] = []
    sdpa = attention.sdpa_attention_forward

    def counting(module, query, key, value, mask, **kwargs):
        seen.append((key.shape[-2], session.cache_length))
        return sdpa(module, query, key, value, mask, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counting)
    answer = session.ask(normans.questions[0].question, max_new_tokens=ANSWER_TOKENS)
    assert answer.steps == ANSWER_TOKENS and len(seen) == 4 * ANSWER_TOKENS  # 4 layers, every call unmarked
    assert all(keys == length for keys, length in seen), seen


def test_the_docs_show_the_matrix():
    """docs/models.md holds the table `tests.families.markdown_table` makes (`python -m tests.families`)."""
    from pathlib import Path

    assert markdown_table() in (Path(__file__).parent.parent / "docs" / "models.md").read_text()


@pytest.mark.parametrize("text", ["dynamic", "quanto:4", "hqq:4", "fp8"])
def test_deepseek_v3_bytes_from_the_formula_match_its_tensors(text):
    """DeepSeek-V3's own shape (61 layers caching a 512-wide latent and a 64-wide rotary key, one "head" each):
    the byte formula (`estimate_kv_bytes`, from the per-layer geometry) against the tensors a cache of it holds after
    a 300-token prefill. The formula of num_key_value_heads x head_dim (61 x 2 x 128 x 64 values per token against
    61 x (512 + 64)) was about 28 times too high."""
    from transformers import AutoConfig

    from kvdemo.cache.spec import CacheSpec, build_cache, estimate_kv_bytes
    from kvdemo.cache.state.telemetry import kv_memory

    config, tokens = AutoConfig.for_model("deepseek_v3"), 300
    spec = CacheSpec.parse(text)
    cache = build_cache(spec, config)
    torch.manual_seed(0)
    for layer in cache.layers:
        layer.update(torch.randn(1, 1, tokens, 512), torch.randn(1, 1, tokens, 64))
    held = kv_memory(cache).cache_bytes
    estimate = estimate_kv_bytes(spec, config, tokens, torch.float32)
    assert abs(estimate - held) <= 0.01 * held, (estimate, held)
    assert text != "dynamic" or held == 61 * (512 + 64) * tokens * 4


@pytest.mark.parametrize("family", ["Gemma 4", "Gemma 4 (KV sharing)", "Qwen3.5", "Falcon-H1", "DeepSeek-V3 (MLA)"])
def test_full_precision_bytes_follow_each_layer(family, embedded, normans):
    """Per-layer geometry: the full-precision formula (each layer's own heads and head_dim, a sliding layer its
    window, a KV-shared or recurrent layer nothing) equals the keys and values a `dynamic` session holds; the
    recurrent states are counted apart (`state_bytes`)."""
    from kvdemo.cache.model.geometry import full_precision_bytes
    from kvdemo.cache.spec import CacheSpec
    from kvdemo.cache.state.telemetry import kv_memory

    loaded = tiny_family(family, embedded.tokenizer)
    session = _session(loaded, CacheSpec("dynamic"), normans.paragraphs[0])
    memory = kv_memory(session.cache)
    assert memory.residual_bytes == full_precision_bytes(loaded.config, session.cache_length, torch.float32)
    assert (memory.state_bytes > 0) == (family in ("Qwen3.5", "Falcon-H1"))
    assert memory.seq_length == session.cache_length


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
def test_every_default_spec_gives_a_first_result_on_any_common_head_dim(head_dim, embedded):
    """The page's start spec (as its fields send it), the default comparison (CLI, MCP, page) and the planner's base:
    none is refused on head_dim 80, 96 or 192 (q_group_size fitted, the rotated twins block-diagonal), and each
    answers a first question."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvdemo.cache.catalogue import defaults_for
    from kvdemo.evals.plan_budget import plan_base
    from kvdemo.ui.ask_widgets import START_SPEC
    from kvdemo.ui.inputs import spec_from_inputs

    config = LlamaConfig(
        vocab_size=len(embedded.tokenizer), hidden_size=128, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    loaded = LoadedModel(
        LlamaForCausalLM(config).eval(), embedded.tokenizer, "tiny", None, 256, torch.device("cpu"), torch.float32
    )
    page_start = spec_from_inputs(START_SPEC.backend, dict(START_SPEC.resolved()))
    served, left_out = defaults_for(config)  # the defaults on this model: ggml's blocks of 32 need a width of 32k
    assert [line.split(" ")[0] for line in left_out] == ([] if head_dim % 32 == 0 else ["ggml"])
    assert all("blocks of 32 values" in line and "type_k=f16" in line for line in left_out)
    for spec in [page_start, *served, plan_base(CacheSpec("quanto"))]:
        session = QASession(loaded, spec)  # refused here if it did not fit
        session.prefill("The Normans gave their name to Normandy, a region in France.", max_new_tokens=2)
        answer = session.ask("Who gave their name to Normandy?", max_new_tokens=2)
        assert answer.steps == 2 and session.cache_length == session.prefill_report.context_tokens
        group = session.spec.resolved().get("q_group_size")
        assert group is None or (head_dim % group == 0 and group == min(64, head_dim & -head_dim)), session.spec


@pytest.mark.parametrize(
    "model_type, options, refused, served",
    [
        ("rwkv", {}, "dynamic", None),  # its state lives outside transformers' cache: the cache holds 0 tokens
        ("xlstm", {}, "dynamic", None),  # a cache class of its own (AttributeError on a DynamicCache)
        ("recurrent_gemma", dict(attention_window_size=16, lru_width=128), "dynamic", None),  # states on its modules
        ("minimax", dict(num_local_experts=2, num_experts_per_tok=1), "dynamic", None),  # a cache of its own
        ("doge", {}, "quanto:4", "dynamic"),  # its mask follows the block-wise read's residual, not the cache
        ("diffllama", {}, "fp8", "turboquant:4,layout=vllm"),  # keys changed after the cache: only a read whole serves
        ("jetmoe", {}, "hqq:4,rotation=hadamard", "dynamic"),
    ],
)
def test_what_the_config_cannot_show_is_refused_by_the_probe(model_type, options, refused, served, embedded):
    """Configs that look like full attention, whose models keep state outside the cache or change the keys and values
    between the cache and attention: a few tokens run through the spec's cache when the session is built
    (`kvdemo.qa.probe`) refuse them before the prefill, saying what would work (found by a helper breaking issue 40's
    work: rwkv's answers ignored the context, recurrent_gemma's restores were 0.13 off, diffllama's quanto:4 answers
    1.09 off in log p, all silently)."""
    from transformers import AutoConfig

    from tests.families import _BASE

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**_BASE, **options})).eval()
    loaded = LoadedModel(model, embedded.tokenizer, model_type, None, 1024, torch.device("cpu"), torch.float32)
    spec = CacheSpec.parse(refused)
    assert verdict(spec, loaded.config) is None  # the config alone passes
    advice = "backend=dynamic serves it" if served else "kvdemo cannot serve this model"
    with pytest.raises(UnsupportedModelError, match=advice):
        QASession(loaded, spec)
    if served is not None:
        session = _session(loaded, CacheSpec.parse(served), "The Normans gave their name to Normandy.")
        assert session.ask("Who?", max_new_tokens=2).steps == 2


def _llama(embedded, kv_heads: int = 2) -> LoadedModel:
    from tests.families import _BASE

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **{**_BASE, "num_key_value_heads": kv_heads})
    model = AutoModelForCausalLM.from_config(config).eval()
    return LoadedModel(model, embedded.tokenizer, "llama", None, 1024, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize(
    "spec", ["quanto:4,axis_key=-1,q_group_size=1", "quanto:4,axis_value=-1,q_group_size=1", "hqq:4,axis_key=1"]
)
def test_axis_minus_one_stores_are_read_right(spec, embedded):
    """Issue 57: a store de-quantized along the last axis has a last-axis stride > 1, which torch's private CPU flash
    kernel misread (13.9 off in the logits), and the probe blamed the model. Now each block handed to the kernel is
    contiguous: the spec is served, and its answers' teacher-forced log-probs equal the same cache read whole."""
    from kvdemo.cache.layers.flush import read_whole

    loaded = _llama(embedded)
    context = "The Normans gave their name to Normandy, a region in France. Rollo led them. " * 4
    session = _session(loaded, CacheSpec.parse(spec), context)  # the probe passes
    answer = session.ask("Who led the Normans?", max_new_tokens=ANSWER_TOKENS)
    blockwise = session.score("Who led the Normans?", answer.token_ids)
    with read_whole():
        whole = _session(loaded, CacheSpec.parse(spec), context).score("Who led the Normans?", answer.token_ids)
    assert float((blockwise - whole).abs().max()) < READ_WHOLE_BOUND


@pytest.mark.parametrize("read", ["codes", "de-quantized blocks"])
def test_a_wrong_blockwise_read_is_reported_as_kvdemos_bug_not_the_models(embedded, monkeypatch, read):
    """Issue 57: a failure of kvdemo's own read against the same cache read whole is kvdemo's, and the probe says so;
    a model that changes the keys (DiffLlama, above) is still refused as the model's behaviour. Both reads are
    broken in turn: the decode kernel over the codes (issue 56), and torch's flash kernel over each de-quantized block
    (the path `dequantized_reads` keeps)."""
    from contextlib import nullcontext

    from kvdemo.cache.layers import blockwise

    if read == "codes":
        codes = blockwise.attend_codes

        def wrong(grouped, stores, scaling):
            done = codes(grouped, stores, scaling)
            return None if done is None else (done[0].flip(-1) * 3, done[1])

        monkeypatch.setattr(blockwise, "attend_codes", wrong)
    else:
        flash = blockwise._FLASH
        monkeypatch.setattr(blockwise, "_FLASH", lambda q, k, v, scale=None: flash(q, k.flip(-2) * 3, v, scale=scale))
    with pytest.raises(UnsupportedModelError, match="kvdemo's own block-wise read .* a kvdemo bug, not the model"):
        with blockwise.dequantized_reads() if read != "codes" else nullcontext():
            QASession(_llama(embedded), CacheSpec.parse("quanto:4,residual_length=16"))


def test_the_longrope_row_reaches_its_switch(embedded):
    """Issue 57: the Phi-3 row's switch (64 tokens) lies inside the matrix's context, so its cells above prefill past
    it (in one pass) and are checked against a cache-free pass there; transformers had replaced the row's 256 by 4096,
    so it never got there."""
    from kvdemo.qa.prefill import rope_changes

    loaded = tiny_family("Phi-3 longrope", embedded.tokenizer)
    assert loaded.config.original_max_position_embeddings == 64
    assert rope_changes(loaded, 32, 100) == "longrope" and rope_changes(loaded, 65, 400) is None
