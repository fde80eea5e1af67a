"""Random sequences against the invariants (issue 23, item 5; the pattern of SQLite's and vLLM's randomized tests):
a hypothesis `RuleBasedStateMachine` drives one `QASession` on a tiny model of a random kind (`MODELS`: full
attention in float32 and bfloat16, sliding windows, linear attention, a Mamba hybrid, a latent cache) through random
sequences of prefill (random and odd texts, some too long for the window), ask (random max_new_tokens; a
residual_length of 1-8 makes answers flush mid-answer and on the last step), Stop at a random decode step, a fault
injected at a random decode step, and changes of spec (every spec of `all_specs()`, TurboQuant's and `protect`
included; a spec the model's kind cannot serve must be refused when the session is built, before any prefill) and
of context. After every step:

- the cache holds exactly the post-prefill tokens, and the post-prefill bytes (`kv_memory` of the cache and its
  snapshot): exactly where every layer's restore puts back the saved tensors; where a layer is restored by slicing
  the last decode step's tensors back to the context (`dynamic`'s, and the layers a quantized backend keeps at full
  precision: a view, docs/DESIGN.md), besides the fixed-size states at most what the spec's byte formula gives for
  the context with the longest question and answer fed since the prefill;
- every answer equals a fresh session's answer to the same question on the same context and spec, a stopped
  answer a prefix of it;
- a refused prefill (too long for the window) leaves the session as it was;
- at the end, every `QASession` the sequence made is freed (weak references), so nothing keeps a cache alive.

CI runs `KVDEMO_RANDOM_EXAMPLES` sequences (default 12) of up to 12 steps; a longer run:
`KVDEMO_RANDOM_EXAMPLES=500 pytest tests/test_state_machine.py`.

Cost: 18 s for 1 test in one process (2026-12-04, issue 43, load 2.3: six model kinds, the same 12 sequences).
A run of 120 examples (307 sequences, all six kinds, 0 failures) took 195 s.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import os
import re
import weakref
from collections import Counter
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvdemo import CacheSpec, QASession
from kvdemo.cache.catalogue import all_specs
from kvdemo.cache.spec import estimate_kv_bytes
from kvdemo.cache.state.telemetry import kv_memory
from kvdemo.qa.models import LoadedModel
from tests.families import tiny_family
from tests.helpers import fail_forward_at

EXAMPLES = int(os.environ.get("KVDEMO_RANDOM_EXAMPLES", "12"))
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"

ODD = ["<|im_end|>", "<|im_start|>assistant", "\u200b", "\u202e", "\x00", "\r\n", "\t", "😀", "ſ", "Ｆｕｌｌ"]
"""Pieces of text a tokenizer or a chat template could trip on: control tokens as text, invisible and bidi
characters, NUL, line endings, an emoji (4 UTF-8 bytes), letters with odd case mappings, full-width forms."""

WORDS = st.sampled_from(["The", "Normans", "held", "Rouen", "in", "911", "and", "Rollo", "led", "them", ".", ",", "?"])
TEXT = st.lists(
    st.one_of(WORDS, WORDS, WORDS, st.sampled_from(ODD), st.text(st.characters(exclude_categories=["Cs"]), max_size=8)),
    min_size=1,
    max_size=120,
).map(" ".join)


def _spec(draw_spec: CacheSpec, residual: int) -> CacheSpec:
    """`draw_spec` with a short residual where it has one, so answers flush."""
    return draw_spec.replace(residual_length=residual) if draw_spec.info.has_residual else draw_spec


SPECS = st.builds(
    _spec, st.sampled_from([*all_specs(), CacheSpec.parse("turboquant:k3v4_nc,protect=1:1")]), st.integers(1, 8)
)

MODELS = ("Llama", "Llama bfloat16", "Gemma 3", "Qwen3.5", "Falcon-H1", "DeepSeek-V3 (MLA)")
"""The model kinds a sequence runs on: the tiny Llama (full attention, float32) and its bfloat16 copy, and the
family matrix's sliding-window (Gemma 3), linear-attention (Qwen3.5), Mamba-hybrid (Falcon-H1) and latent-cache
(DeepSeek-V3) models (`tests.families`)."""


def _model(name: str, tiny: LoadedModel, made: dict[str, LoadedModel]) -> LoadedModel:
    """Model `name` of `MODELS`, made once per test run."""
    if name not in made:
        if name == "Llama bfloat16":
            made[name] = dataclasses.replace(
                tiny, model=copy.deepcopy(tiny.model).to(torch.bfloat16), dtype=torch.bfloat16
            )
        else:
            made[name] = tiny if name == "Llama" else tiny_family(name, tiny.tokenizer)
    return made[name]


class SessionMachine(RuleBasedStateMachine):
    """One session under random use; `loaded` is set by the test (the tiny model); `done` counts what ran."""

    tiny: LoadedModel
    models: dict[str, LoadedModel] = {}
    done: Counter = Counter()

    @initialize(model=st.sampled_from(MODELS), spec=SPECS)
    def start(self, model, spec):
        self.done["sequences"] += 1
        self.done[f"sequences on {model}"] += 1
        self.loaded = _model(model, self.tiny, self.models)
        self.made: list[weakref.ref] = []
        self.qa = self._session(spec)
        self.context: str | None = None
        self.tokens = self.bytes = self.fed = 0

    def _session(self, spec: CacheSpec) -> QASession:
        """A session of `spec` on the sequence's model, or of `dynamic` where the model's kind refuses `spec`: the
        refusal comes when the session is built (nothing prefilled) and says what would work."""
        try:
            qa = QASession(self.loaded, spec)
        except ValueError as refusal:
            assert re.search(r"[a-z_]+=\S", str(refusal)), refusal  # names a setting that works
            self.done["specs refused before the prefill"] += 1
            qa = QASession(self.loaded, CacheSpec())
        self.made.append(weakref.ref(qa))
        return qa

    def _fresh(self, question: str, max_new_tokens: int):
        fresh = self._session(self.qa.spec)
        fresh.prefill(self.context)
        return fresh.ask(question, max_new_tokens)

    @precondition(lambda self: self.context is not None)  # a spec change drops the context: after a prefill only
    @rule(spec=SPECS)
    def change_spec(self, spec):
        self.done["spec changes"] += 1
        self.qa, self.context, self.tokens, self.fed = self._session(spec), None, 0, 0

    def _feeds(self, question: str, max_new_tokens: int) -> None:
        """Count the most tokens an answer to `question` may feed after the context (its ids and the answer)."""
        try:
            self.fed = max(self.fed, len(self.qa.prepare_question(question, max_new_tokens).ids) + max_new_tokens)
        except ValueError:
            pass

    @rule(text=TEXT)
    def prefill(self, text):
        before = (self.qa.cache, self.qa.context, self.qa.cache_length)
        try:
            report = self.qa.prefill(text)
        except ValueError as refusal:  # too long for the window, or a text with nothing in it
            assert any(s in str(refusal) for s in ("tokens", "empty")), refusal
            assert (self.qa.cache, self.qa.context, self.qa.cache_length) == before  # unchanged
            self.done["prefills refused"] += 1
            return
        self.done["prefills"] += 1
        self.context, self.tokens, self.fed = text, report.context_tokens, 0
        self.bytes = kv_memory(self.qa.cache, self.qa._snapshot).total_bytes

    @precondition(lambda self: self.context is not None)
    @rule(question=TEXT, max_new_tokens=st.integers(1, 24))
    def ask(self, question, max_new_tokens):
        self._feeds(question, max_new_tokens)
        try:
            answer = self.qa.ask(question, max_new_tokens)
        except ValueError as refusal:  # an empty question, or one that does not fit the window
            assert any(s in str(refusal) for s in ("tokens", "empty")), refusal
            self.done["questions refused"] += 1
            return
        self.done["answers"] += 1
        self.done["answers that flushed"] += answer.flush_count > 0
        expected = self._fresh(question, max_new_tokens)
        assert answer.token_ids == expected.token_ids and answer.text == expected.text
        assert answer.finish_reason == expected.finish_reason and answer.cache_length_after == self.tokens

    @precondition(lambda self: self.context is not None)
    @rule(question=TEXT, stop_at=st.integers(0, 10))
    def stop(self, question, stop_at):
        self._feeds(question, 16)
        try:
            stream = self.qa.stream(question, 16)
        except ValueError:
            return
        for step, _ in enumerate(stream):
            if step == stop_at:
                self.qa.request_stop()
        answer = self.qa.history[-1]
        expected = self._fresh(question, 16)
        assert list(answer.token_ids) == list(expected.token_ids[: len(answer.token_ids)])
        cut = len(answer.token_ids) < len(expected.token_ids)
        self.done["answers stopped" if cut else "answers that ended before the stop"] += 1
        assert answer.finish_reason == ("stopped" if cut else expected.finish_reason)

    @precondition(lambda self: self.context is not None)
    @rule(question=TEXT, fail_at=st.integers(1, 12))
    def fault(self, question, fail_at):
        self._feeds(question, 16)
        with pytest.MonkeyPatch.context() as patch:  # the model's own forward again when the block ends
            fail_forward_at(patch, self.loaded, fail_at, "injected fault")
            try:
                self.qa.ask(question, 16)
            except RuntimeError as error:
                assert str(error) == "injected fault"
                self.done["faults injected"] += 1
            except ValueError:
                pass

    @invariant()
    def the_cache_is_the_post_prefill_cache(self):
        if self.context is None:
            return
        assert self.qa.cache_length == self.tokens
        report = kv_memory(self.qa.cache, self.qa._snapshot)
        held, fixed = report.total_bytes, report.state_bytes + report.snapshot_bytes  # states: a fixed size
        if all(saved.length is None for saved in self.qa._snapshot.layers):  # each layer put back what it saved
            assert held == self.bytes
        else:  # a layer restored by its length (`dynamic`'s, a layer a quantized backend keeps: protect, a hybrid's)
            # is a view of the last step's tensors: bounded by the byte formula (capacity for storage=growing)
            most = estimate_kv_bytes(self.qa.spec, self.loaded.config, self.tokens + self.fed, self.loaded.dtype)
            assert self.bytes <= held and held - fixed <= max(most, self.bytes - fixed), (held, self.bytes, most)

    def teardown(self):
        made = getattr(self, "made", [])
        self.qa = None
        gc.collect()
        assert not [ref for ref in made if ref() is not None], "a QASession outlived its sequence"


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_random_sequences_keep_every_invariant(tiny):
    SessionMachine.tiny, SessionMachine.models, SessionMachine.done = tiny, {}, Counter()
    run_state_machine_as_test(
        SessionMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=12,
            deadline=None,
            derandomize=EXAMPLES <= 12,  # CI: the same sequences every run; a long run draws new ones
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            database=None,
        ),
    )
    done = dict(sorted(SessionMachine.done.items()))
    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "random_sequences.json").write_text(json.dumps(done, indent=2))
    print(json.dumps(done))
    assert done["sequences"] >= EXAMPLES and done["answers"] > 0 and done["prefills"] > 0
