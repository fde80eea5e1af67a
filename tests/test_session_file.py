"""Session files (`kvdemo.qa.session_file`): a prefilled session saved and opened again answers exactly as a fresh
single-question run, on every spec of the matrix, two per-layer plans and every model kind (sliding-window, linear
attention, Mamba hybrid, latent MLA, bfloat16); bad, truncated, tampered and foreign files are refused before
anything is loaded into the session, which keeps its own prefill.

Cost: 20 s in a pytest-xdist worker (the clean-clone CI of 2026-12-05; tiny models: every spec prefills three
sessions, saves once and opens once)."""

from __future__ import annotations

import copy
import dataclasses
import json
import struct
from typing import NamedTuple

import pytest
import torch

from kvdemo.cache.catalogue import all_specs
from kvdemo.cache.spec import CacheSpec
from kvdemo.qa import session_file
from kvdemo.qa.session import QASession
from kvdemo.qa.session_file import SessionFileError, open_session, read_manifest, save_session
from tests.families import SPECS as FAMILY_SPECS
from tests.families import tiny_family, verdict
from tests.helpers import make_tiny

CONTEXT = (
    "The Normans were the people who in the 10th and 11th centuries gave their name to Normandy, a region in "
    "France. They were descended from Norse raiders and pirates from Denmark, Iceland and Norway. "
) * 3
QUESTIONS = ("In what country is Normandy located?", "Who were the Normans descended from?")
ANSWER_TOKENS = 6
PLANNED = [CacheSpec.parse("quanto,plan=k4v2h+k2v4"), CacheSpec.parse("hqq,plan=k8v3+k2v4h,flush=append")]
KINDS = ("Gemma 3", "Qwen3.5", "Falcon-H1", "DeepSeek-V3 (MLA)")


def _prefilled(loaded, spec) -> QASession:
    session = QASession(loaded, spec)
    session.prefill(CONTEXT, max_new_tokens=ANSWER_TOKENS, chunk_tokens=64)
    return session


def _round_trip(loaded, spec, path) -> None:
    """Answers and teacher-forced log-probs after save and open equal a fresh run's, exactly; the opened cache is
    the post-prefill cache after each answer."""
    fresh = [_prefilled(loaded, spec).ask(q, ANSWER_TOKENS) for q in QUESTIONS]
    reference = _prefilled(loaded, spec)
    expected = reference.score(QUESTIONS[0], fresh[1].token_ids)
    saved = save_session(reference, path)
    assert saved.bytes == path.stat().st_size > 0
    opened = open_session(loaded, path)
    assert opened.spec.text == reference.spec.text
    assert opened.prefill_report.opened_from == path.name
    assert opened.prefill_report.context_tokens == reference.prefill_report.context_tokens
    assert opened.prefill_report.kv_bytes == reference.prefill_report.kv_bytes
    assert opened.prompt_ids(QUESTIONS[1]) == reference.prompt_ids(QUESTIONS[1])
    for question, answer in zip(QUESTIONS, fresh):
        again = opened.ask(question, ANSWER_TOKENS)
        assert again.token_ids == answer.token_ids, (spec.text, question)
        assert opened.cache_length == reference.prefill_report.context_tokens
    assert torch.equal(opened.score(QUESTIONS[0], fresh[1].token_ids), expected), spec.text


@pytest.fixture(scope="module")
def small(embedded):
    return make_tiny(embedded.tokenizer)


@pytest.mark.parametrize("spec", [*all_specs(), *PLANNED], ids=lambda s: s.text)
def test_round_trip_on_every_spec(small, spec, tmp_path):
    _round_trip(small, spec, tmp_path / "s.kvsession")


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_on_every_model_kind(small, kind, tmp_path):
    loaded = tiny_family(kind, small.tokenizer)
    served = [spec for spec in FAMILY_SPECS if verdict(spec, loaded.config) is None]
    assert served and served[0].backend == "dynamic", kind  # Falcon-H1 (hybrid layers): dynamic only
    for spec in served:
        _round_trip(loaded, spec, tmp_path / "s.kvsession")


def test_round_trip_in_bfloat16(small, tmp_path):
    half = dataclasses.replace(small, model=copy.deepcopy(small.model).to(torch.bfloat16), dtype=torch.bfloat16)
    for spec in (CacheSpec("dynamic"), CacheSpec.parse("quanto:4"), CacheSpec.parse("turboquant:4")):
        _round_trip(half, spec, tmp_path / "s.kvsession")


@pytest.fixture(scope="module")
def written(small, tmp_path_factory):
    """A session file of `hqq:4` on the small model, and its session."""
    session = _prefilled(small, CacheSpec.parse("hqq:4"))
    path = tmp_path_factory.mktemp("files") / "hqq.kvsession"
    save_session(session, path)
    return path, session


@pytest.fixture
def held(small):
    """A session of `hqq:4` holding another prefill: a refused file must leave it as it was."""
    session = QASession(small, CacheSpec.parse("hqq:4"))
    session.prefill("Paris is the capital of France.", max_new_tokens=ANSWER_TOKENS)
    return session


def _refused(small, path, held, match, **kwargs) -> None:
    before = (held.cache, held.context, held.prefill_report, held.cache_length)
    with pytest.raises(SessionFileError, match=match):
        open_session(small, path, session=held, **kwargs)
    assert (held.cache, held.context, held.prefill_report, held.cache_length) == before
    assert held.ask("What is the capital?", 3).cache_length_after == before[3]


def _header_length(path) -> int:
    return struct.unpack("<Q", path.read_bytes()[:8])[0]


def test_a_truncated_file_is_refused(small, written, held, tmp_path):
    data = written[0].read_bytes()
    for keep in (len(data) - 100, 8 + _header_length(written[0]) + 10, 200, 5, 0):
        cut = tmp_path / "cut.kvsession"
        cut.write_bytes(data[:keep])
        _refused(small, cut, held, "not a session file, or it was cut short")


def test_changed_bytes_are_refused(small, written, held, tmp_path):
    data = bytearray(written[0].read_bytes())
    data[-1] ^= 0x01  # one bit of the last tensor's bytes
    changed = tmp_path / "bit.kvsession"
    changed.write_bytes(bytes(data))
    _refused(small, changed, held, "do not match its digest: it was changed or damaged")


def test_a_changed_manifest_is_refused(small, written, held, tmp_path):
    data = written[0].read_bytes()
    n = _header_length(written[0])
    header = json.loads(data[8 : 8 + n])
    manifest = json.loads(header["__metadata__"][session_file._MANIFEST])
    manifest["context"] = manifest["context"].replace("Normandy", "Brittany")
    header["__metadata__"][session_file._MANIFEST] = json.dumps(manifest, sort_keys=True)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    changed = tmp_path / "manifest.kvsession"
    changed.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    assert read_manifest(changed)["context"].count("Brittany") == 3  # still a well-formed file
    _refused(small, changed, held, "do not match its digest")


def test_files_that_are_no_session_are_refused(small, held, tmp_path):
    text = tmp_path / "notes.kvsession"
    text.write_text("not a session")
    _refused(small, text, held, "not a session file")
    _refused(small, tmp_path / "missing.kvsession", held, "is not a file")
    from safetensors.torch import save_file

    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(2)}, str(plain))
    _refused(small, plain, held, "holds no kvdemo session")


def test_another_model_spec_or_version_is_refused(small, written, held, monkeypatch):
    other = make_tiny(small.tokenizer, seed=1)  # the same config, other weights
    with pytest.raises(SessionFileError, match="differ in their weights"):
        open_session(other, written[0])
    renamed = dataclasses.replace(small, name="Another model")
    with pytest.raises(SessionFileError, match="load that model to open it"):
        open_session(renamed, written[0])
    _refused(
        small,
        written[0],
        held,
        r"holds a `hqq:4` cache, not `quanto:4`: choose `hqq:4`",
        spec=CacheSpec("quanto", nbits=4),
    )
    ours = session_file.versions()
    monkeypatch.setattr(session_file, "versions", lambda: {**ours, "transformers": "9.9.0"})
    _refused(small, written[0], held, f"written with transformers {ours['transformers']}; this is transformers 9.9.0")
    monkeypatch.setattr(session_file, "FORMAT", session_file.FORMAT + 1)
    monkeypatch.setattr(session_file, "versions", lambda: ours)
    _refused(small, written[0], held, f"session format {session_file.FORMAT - 1} .*reads format {session_file.FORMAT}")


def test_the_same_cache_spelled_with_its_defaults_opens_the_file(small, written):
    """The page spells every option (`axis_key=0,axis_value=0`), a typed spec leaves the defaults out: the same cache
    (`full_text`), so the file opens either way (a breaker found the server's folder throwing such files away)."""
    spelled = CacheSpec.parse("hqq:4,q_group_size=64,axis_key=0,axis_value=0")
    assert spelled.text != CacheSpec.parse("hqq:4").text
    opened = open_session(small, written[0], spelled)
    assert opened.ask(QUESTIONS[0], ANSWER_TOKENS).token_ids == written[1].ask(QUESTIONS[0], ANSWER_TOKENS).token_ids


def test_another_kvdemo_release_of_the_same_format_opens_the_file(small, written, monkeypatch):
    """An upgrade that keeps the layout keeps the files (issue 57: every file refused at each release before)."""
    ours = session_file.versions()
    monkeypatch.setattr(session_file, "versions", lambda: {**ours, "kvdemo": "99.0.0"})
    opened = open_session(small, written[0])
    assert opened.ask(QUESTIONS[0], ANSWER_TOKENS).token_ids == written[1].ask(QUESTIONS[0], ANSWER_TOKENS).token_ids


def test_a_file_of_today_kept_as_a_fixture_still_opens(small, tmp_path):
    """`tests/data/quanto4.kvsession`, written by this format's code on the small model (`make_tiny`, seed 0):
    a later kvdemo of the same format must open it and answer as a fresh prefill of its context does."""
    from pathlib import Path

    fixture = Path(__file__).parent / "data" / "quanto4.kvsession"
    manifest = read_manifest(fixture)
    assert manifest["format"] == session_file.FORMAT and manifest["spec"] == "quanto:4"
    opened = open_session(small, fixture)
    fresh = QASession(small, CacheSpec.parse("quanto:4"))
    fresh.prefill(manifest["context"], reserve_tokens=manifest["reserve_tokens"])
    assert opened.ask(QUESTIONS[0], ANSWER_TOKENS).token_ids == fresh.ask(QUESTIONS[0], ANSWER_TOKENS).token_ids


def test_another_tokenizer_is_refused_before_anything_loads(small, written, held):
    """The same weights with the same tokenizer plus a `Lowercase` normalizer tokenize the stored context otherwise
    (issue 57: it opened with no note and answered wrong)."""
    from tokenizers import normalizers

    tokenizer = copy.deepcopy(small.tokenizer)
    tokenizer.backend_tokenizer.normalizer = normalizers.Lowercase()
    assert tokenizer(CONTEXT)["input_ids"] != small.tokenizer(CONTEXT)["input_ids"]
    lowered = dataclasses.replace(small, tokenizer=tokenizer)
    held_here = QASession(lowered, CacheSpec.parse("hqq:4"))
    held_here.prefill("Paris is the capital of France.", max_new_tokens=ANSWER_TOKENS)
    _refused(lowered, written[0], held_here, "tokenized by another tokenizer than .* load the tokenizer it was made")


def test_the_prefill_reserve_is_kept_and_checked_at_open(small, tmp_path):
    """A prefill that kept 10 tokens free (`reserve_tokens=10`) opens with that reserve, not the default 128."""
    session = QASession(small, CacheSpec.parse("quanto:4"))
    window = small.max_context_tokens
    reps = next(n for n in range(1, 200) if len(session.context_ids("Rollo led the Normans. " * n)) > window - 100)
    long = "Rollo led the Normans. " * reps  # within 10 tokens of the window, not within 128
    report = session.prefill(long, reserve_tokens=10)
    assert report.context_tokens > small.max_context_tokens - 128  # the default reserve would refuse it
    path = tmp_path / "near-the-window.kvsession"
    save_session(session, path)
    assert read_manifest(path)["reserve_tokens"] == 10
    opened = open_session(small, path)
    assert opened.reserve_tokens == 10 and opened.cache_length == report.context_tokens


def test_a_session_of_another_spec_is_not_opened_into(small, written):
    other = QASession(small, CacheSpec("dynamic"))
    with pytest.raises(SessionFileError, match="this session serves `dynamic`; the file holds `hqq:4`"):
        open_session(small, written[0], session=other)
    assert other.cache is None


def test_saving_needs_a_prefill_and_no_open_answer(small, written, tmp_path):
    with pytest.raises(ValueError, match="prefill a context before saving"):
        save_session(QASession(small, CacheSpec("dynamic")), tmp_path / "none.kvsession")
    session = written[1]
    stream = session.stream(QUESTIONS[0], ANSWER_TOKENS)
    next(stream)
    with pytest.raises(ValueError, match="an answer is streaming"):
        save_session(session, tmp_path / "mid.kvsession")
    stream.close()
    assert not (tmp_path / "mid.kvsession").exists() and not list(tmp_path.glob("*.part"))
    save_session(session, tmp_path / "after.kvsession")
    assert (
        open_session(small, tmp_path / "after.kvsession").ask(QUESTIONS[0], 3).token_ids
        == session.ask(QUESTIONS[0], 3).token_ids
    )


def test_a_failed_write_leaves_no_file(written, tmp_path, monkeypatch):
    import safetensors.torch

    def full_disk(tensors, filename, metadata=None):
        with open(filename, "wb") as file:
            file.write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left on device"):
        save_session(written[1], tmp_path / "full.kvsession")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(OSError):
        save_session(written[1], tmp_path / "no" / "such" / "folder.kvsession")


class MadeForTheTest(NamedTuple):
    """A store type no format declares: a record of tensors, as TurboQuant's and ggml's stores are."""

    codes: torch.Tensor
    scale: torch.Tensor


class HeldForTheTest:
    """Not a record, but holding a tensor as an attribute: a store type too."""

    def __init__(self) -> None:
        self.codes = torch.zeros(4, dtype=torch.uint8)


@pytest.mark.parametrize("store", [MadeForTheTest(torch.zeros(2, 4), torch.ones(2, 1)), HeldForTheTest()])
def test_a_store_type_no_format_declares_is_refused_at_save(written, tmp_path, monkeypatch, store):
    """A session file never leaves a store out: a layer holding a store type its format does not declare
    (`Backend.store_types`) is refused at save with what to change, and no file is left."""
    session = written[1]
    layer = session.cache.layers[0]
    monkeypatch.setattr(layer, "_kvdemo_extra", store, raising=False)
    with pytest.raises(TypeError, match=rf"{type(store).__name__} holding tensors, a store type no format declares"):
        save_session(session, tmp_path / "lost.kvsession")
    assert list(tmp_path.iterdir()) == []


def test_a_declared_store_type_is_written_and_rebuilt(small, tmp_path):
    from kvdemo.cache.spec import build_cache
    from kvdemo.cache.state.serialize import CacheFileError, cache_state, load_cache_state

    cache = build_cache(CacheSpec("dynamic"), small.config)
    record = MadeForTheTest(torch.arange(8.0).reshape(2, 4), torch.ones(2, 1))
    cache.layers[0]._kvdemo_extra = record
    tensors, manifest = cache_state(cache, {"MadeForTheTest": MadeForTheTest})
    again = build_cache(CacheSpec("dynamic"), small.config)
    load_cache_state(again, manifest, tensors.__getitem__, torch.device("cpu"), {"MadeForTheTest": MadeForTheTest})
    rebuilt = again.layers[0]._kvdemo_extra
    assert type(rebuilt) is MadeForTheTest and all(map(torch.equal, rebuilt, record))
    with pytest.raises(CacheFileError, match="unknown record 'MadeForTheTest'"):
        load_cache_state(build_cache(CacheSpec("dynamic"), small.config), manifest, tensors.__getitem__, "cpu", {})


def write_fixture() -> None:
    """Write `tests/data/quanto4.kvsession` (`python -m tests.test_session_file`): only when the session format
    changes, with `FORMAT` raised."""
    from pathlib import Path

    from kvdemo.qa.models import load_model

    small = make_tiny(load_model().tokenizer)
    session = QASession(small, CacheSpec.parse("quanto:4"))
    session.prefill("The Normans gave their name to Normandy, a region in France. Rollo led them.", max_new_tokens=16)
    folder = Path(__file__).parent / "data"
    folder.mkdir(exist_ok=True)
    print(save_session(session, folder / "quanto4.kvsession"))


if __name__ == "__main__":
    write_fixture()
