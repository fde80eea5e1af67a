"""mlx-lm itself beside kvdemo's `mlx` format, on the same model, text and token ids: the KL of `--kv-bits 4` and 8
against mlx-lm's own full precision, beside kvdemo's `mlx:4` and `mlx:8` against its `dynamic`.

The job (the project's one: prefill a context once, then answer): kvdemo's `dynamic` prefills the embedded model's
safetensors copy on a text (SQuAD's Normans, `PARAGRAPHS`) and answers each question greedily; its answers are the
teacher-forced sequence on every side. mlx-lm (`mlx-lm` 0.32.2 on `mlx-cpu`, from `.venv/oracles`, run in a child
process) loads the same safetensors, prefills the same prefix ids in one forward pass (its prompt cache), quantizes the
cache at once (each layer's `to_quantized`, what `maybe_quantize_kv_cache` does at `--quantized-kv-start 0`), then reads
the question's ids in one pass and the answer one token at a time, as kvdemo's `QASession.score` does, and trims the
cache back to the context after each question (`trim_prompt_cache`: mlx-lm's own restore, the stored codes untouched).
Printed, per `--kv-bits`: mlx-lm's mean KL against its own full precision, kvdemo's against its own, and the share of
layer 0's key codes that are the same bytes on both sides (their full-precision keys differ by float rounding between
the two frameworks, so a value near a rounding boundary may take the next code). Also the KL between the two full-
precision runs: the frameworks' own float noise.

    .venv/bin/python benchmarks/mlx_peer.py          # `make setup` installs mlx-lm into .venv/oracles
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvdemo import CacheSpec, QASession, load_model  # noqa: E402
from kvdemo.evals.cases import example_path, load_case  # noqa: E402
from kvdemo.evals.metrics import kl_divergence  # noqa: E402
from kvdemo.qa.models import converted_dir, embedded_gguf_path  # noqa: E402

BITS = (4, 8)
GROUP = 64
MAX_NEW_TOKENS = 16
PARAGRAPHS, QUESTIONS = "0-2", 3
"""A short text: mlx's CPU backend took about 9 minutes for one forward pass over 1,044 tokens of the embedded model
on this machine (2026-12-07), so mlx-lm prefills once and each kv-bits quantizes that one prefill."""
ORACLES = Path(sys.prefix) / "oracles"

MLX_SIDE = """
import numpy as np, mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
model, _ = load(inputs["folder"])
full = make_prompt_cache(model)
mx.eval(model(mx.array(inputs["prefix"][None]), cache=full))  # the context, one forward pass in full precision
for bits in [0, *BITS]:
    # `maybe_quantize_kv_cache(..., quantized_kv_start=0)`: each layer's `to_quantized`, from the one prefill
    cache = [c.to_quantized(group_size=GROUP, bits=bits) for c in full] if bits else full
    if bits:
        outputs[f"codes_{bits}"] = np.array(cache[0].keys[0]).view(np.uint8)
    for i in range(int(inputs["questions"])):
        question, answer = inputs[f"question_{i}"], inputs[f"answer_{i}"]
        rows = [model(mx.array(question[None]), cache=cache)[0, -1]]
        for token in answer[:-1]:
            rows.append(model(mx.array([[int(token)]]), cache=cache)[0, -1])
        logits = mx.stack(rows).astype(mx.float32)
        outputs[f"logp_{bits}_{i}"] = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        trim_prompt_cache(cache, len(question) + len(answer) - 1)  # back to the context, as kvdemo restores
"""


def mlx_run(folder: Path, prefix: list[int], questions: list[list[int]], answers: list[list[int]]) -> dict:
    """mlx-lm's log-probabilities and layer 0's key codes (`MLX_SIDE`), from a child process with the oracles."""
    with tempfile.TemporaryDirectory() as tmp:
        given, taken = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        arrays = {f"question_{i}": np.array(q) for i, q in enumerate(questions)}
        arrays |= {f"answer_{i}": np.array(a) for i, a in enumerate(answers)}
        np.savez(given, folder=str(folder), prefix=np.array(prefix), questions=len(questions), **arrays)
        program = (
            f"import numpy as np\nBITS = {BITS!r}\nGROUP = {GROUP}\ninputs = dict(np.load({str(given)!r}))\n"
            f"inputs['folder'] = str(inputs['folder'])\noutputs = {{}}\n{MLX_SIDE}\n"
            f"np.savez({str(taken)!r}, **outputs)\n"
        )
        env = {**os.environ, "PYTHONPATH": str(ORACLES)}
        done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"mlx-lm could not run here:\n{done.stderr[-2000:]}")
        with np.load(taken) as out:
            return dict(out)


def mlx_folder(folder: Path, into: Path) -> Path:
    """`folder` as mlx-lm 0.32.2 reads it: its files linked into `into`, and config.json with `rope_theta` written at
    the top level too. transformers 5 saves it under `rope_parameters`, which mlx-lm's `ModelArgs` do not read: it would
    take its default 10,000 instead of the model's (100,000 for SmolLM2), another model (KL 0.32 against kvdemo's in
    a first run, layer 0's keys 4-13 % the same bytes)."""
    for path in folder.iterdir():
        if path.name != "config.json":
            (into / path.name).symlink_to(path)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.setdefault("rope_theta", config.get("rope_parameters", {}).get("rope_theta"))
    (into / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return into


def main() -> None:
    loaded = load_model()
    folder = mlx_folder(converted_dir(embedded_gguf_path()), Path(tempfile.mkdtemp()))
    case = load_case(example_path("normans")).select(PARAGRAPHS)
    questions = [q.question for q in case.questions[:QUESTIONS]]
    dynamic = QASession(loaded, CacheSpec("dynamic"))
    dynamic.prefill(case.context)
    answers = [list(dynamic.ask(q, MAX_NEW_TOKENS).token_ids) for q in questions]
    reference = [dynamic.score(q, a) for q, a in zip(questions, answers)]
    prefix, question_ids = list(dynamic.split.prefix), [dynamic.question_ids(q) for q in questions]
    mlx = mlx_run(folder, prefix, question_ids, answers)

    def mean_kl(p_rows: list[torch.Tensor], q_rows: list[torch.Tensor]) -> float:
        return float(torch.cat([kl_divergence(p, q) for p, q in zip(p_rows, q_rows)]).mean())

    mlx_full = [torch.from_numpy(mlx[f"logp_0_{i}"]) for i in range(len(questions))]
    rows = {"context_tokens": len(prefix), "questions": len(questions), "positions": sum(map(len, answers))}
    rows["frameworks_full_precision_kl"] = mean_kl(reference, mlx_full)
    for bits in BITS:
        session = QASession(loaded, CacheSpec.parse(f"mlx:{bits}"))
        session.prefill(case.context)
        ours = [session.score(q, a) for q, a in zip(questions, answers)]
        theirs = [torch.from_numpy(mlx[f"logp_{bits}_{i}"]) for i in range(len(questions))]
        codes = session.cache.layers[0]._quantized_keys.codes.numpy()  # [1, kv_heads, tokens, head_dim * bits / 8]
        mlx_codes = mlx[f"codes_{bits}"][:, :, : codes.shape[2]]  # mlx-lm holds room for 256 tokens at a time
        rows[f"kv_bits_{bits}"] = {
            "mlx_lm_kl": mean_kl(mlx_full, theirs),
            "kvdemo_kl": mean_kl(reference, ours),
            "layer0_key_bytes_equal": float((codes == mlx_codes).mean()),
        }
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
