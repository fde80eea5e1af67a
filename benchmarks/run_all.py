"""kvdemo's figures, measured side by side in one run (`make bench`), printed as ratios and written to
`artifacts/bench/results.json` and `artifacts/bench/bench.png` (and `bench.svg`).

Sized for a 2-core CPU (about 3.5 minutes there): one context of the Normans article (paragraphs 0-11,
2,172 tokens with the chat template), two questions of 24 new tokens each, residual_length 16 so that
answers flush. Sections:

1. restore: kvdemo's `snapshot.take/restore` (as `QASession` uses them) against the transformers
   documentation's prefix-cache pattern (`copy.deepcopy` of the prefilled cache before each answer, the
   answer decoded on the copy): the mechanism's own seconds per question, each question's seconds, and the
   extra bytes held while an answer decodes; where deepcopy fails, the error.
2. memory during an answer: the peak bytes held by the cache and the restore mechanism, against the cache
   alone, for both mechanisms. Bytes are counted from the tensors really held (`kvdemo.telemetry`), each
   storage once across the cache and what the mechanism keeps (the snapshot, or the prefilled original).
3. KV bytes per token per backend and nbits against the theoretical bytes (`theoretical_kv_bytes`).
4. decode speed per backend relative to `dynamic`: the median seconds of decode steps without a flush, and
   of steps with one (from `StepEvent.flushed_layers` and `StepEvent.seconds`); step 0 (the question's
   forward pass) is left out of both.
5. the app's overhead: tokens/s of `QASession.stream` with the chart frames the app builds at every step
   (`kvdemo.charts`), and without them, against a bare decode loop (model forward + argmax on the same
   cache, restored afterwards, no telemetry), interleaved in rounds so that all see the same load.
6. start-up, each in a fresh process: loading the embedded model from its GGUF (de-quantized), the first
   load that also writes the converted safetensors copy, a later load from that copy; and `app.py` from
   launch to the first page and to the model loaded (its `model_status` API answers once it is).

    .venv/bin/python benchmarks/run_all.py            # everything
    .venv/bin/python benchmarks/run_all.py --quick    # shorter context and answers, no start-up section
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from kvdemo import CacheSpec, QASession, load_model, snapshot  # noqa: E402
from kvdemo.cases import example_path, load_case  # noqa: E402
from kvdemo.charts import answers_frame, memory_frame, residual_frame, step_time_frame  # noqa: E402
from kvdemo.spec import build_cache, estimate_kv_bytes  # noqa: E402
from kvdemo.telemetry import _plain_tensors, full_precision_bytes, kv_memory  # noqa: E402

MiB = 2**20
RESIDUAL = 16
MAIN_SPECS = [
    CacheSpec("dynamic"),
    CacheSpec("quanto", nbits=4, residual_length=RESIDUAL),
    CacheSpec("hqq", nbits=4, residual_length=RESIDUAL),
    CacheSpec("fp8"),
]
NBITS_SPECS = (
    [CacheSpec("dynamic")]
    + [
        CacheSpec(b, nbits=n, residual_length=RESIDUAL)
        for b, bits in (("quanto", (2, 4)), ("hqq", (1, 2, 3, 4, 8)))
        for n in bits
    ]
    + [CacheSpec("fp8")]
)
OVERHEAD_QUESTION = "Tell me everything about the Normans."  # runs to max_new_tokens on this model


# ---- counting bytes -----------------------------------------------------------------------------------


def held_bytes(*objects: Any) -> int:
    """Bytes of every distinct tensor storage held by `objects`: caches (every attribute of every layer) and
    `snapshot.CacheSnapshot`s (every saved attribute); each storage counted once across all of them, quantized
    tensors opened to their packed data, scales and zero points as `kvdemo.telemetry.kv_memory` does."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for obj in objects:
        if isinstance(obj, snapshot.CacheSnapshot):
            values = [v for layer in obj.layers if layer.attributes for v in layer.attributes.values()]
        else:
            values = [v for layer in obj.layers for v in vars(layer).values()]
        for tensor in _plain_tensors(values):
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if storage.nbytes() and key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def theoretical_kv_bytes(
    spec: CacheSpec, config, quantized_tokens: int, residual_tokens: int, dtype: torch.dtype
) -> int:
    """The bytes a cache of `spec` should hold by the group-wise formula with nominal bits:
    `kvdemo.spec.estimate_kv_bytes(..., nominal_bits=True)` (formula and sources in its docstring). Bit
    packing (hqq packs 3-bit values 10 to an int32), padding and anything else a library stores count only in
    the measured bytes, so measured / theoretical shows them."""
    return estimate_kv_bytes(
        spec, config, quantized_tokens + residual_tokens, dtype, residual_tokens, nominal_bits=True
    )


# ---- the two restore mechanisms ---------------------------------------------------------------------


def answer_with_restore(session: QASession, question: str, max_new_tokens: int) -> dict[str, Any]:
    """One answer through `QASession.stream` (snapshot taken at the prefill, restored after the answer).

    Measures, at every decode step, the bytes of the cache alone and of the cache plus the session's snapshot;
    the measuring time is left out of the question's seconds.
    """
    restore_seconds = []
    real_restore = snapshot.restore

    def timed_restore(cache, saved):
        start = time.perf_counter()
        real_restore(cache, saved)
        restore_seconds.append(time.perf_counter() - start)

    snapshot.restore = timed_restore  # QASession calls `snapshot.restore` through the module
    cache_alone, with_mechanism, measuring, steps, device = [], [], 0.0, [], []
    try:
        start = time.perf_counter()
        for event in session.stream(question, max_new_tokens):
            m0 = time.perf_counter()
            cache_alone.append(held_bytes(session.cache))
            with_mechanism.append(held_bytes(session.cache, session._snapshot))  # what QASession keeps
            steps.append((event.step, event.seconds, bool(event.flushed_layers)))
            if event.memory.device_allocated_bytes is not None:  # CUDA only
                device.append(event.memory.device_allocated_bytes)
            measuring += time.perf_counter() - m0
        seconds = time.perf_counter() - start - measuring
    finally:
        snapshot.restore = real_restore
    answer = session.history[-1]
    return {
        "token_ids": list(answer.token_ids),
        "seconds": seconds,
        "mechanism_seconds": sum(restore_seconds),
        "peak_cache_bytes": max(cache_alone),
        "peak_held_bytes": max(with_mechanism),
        "extra_bytes": max(w - c for w, c in zip(with_mechanism, cache_alone)),
        "steps": steps,
        "device_allocated_peak_bytes": max(device) if device else None,
        "cache_length_after": answer.cache_length_after,
    }


def bare_decode(loaded, cache, input_ids: list[int], max_new_tokens: int, on_step=None) -> list[int]:
    """Greedy decoding on `cache`: model forward + argmax, no telemetry; stops at EOS like `QASession`."""
    tokens: list[int] = []
    inputs = torch.tensor([input_ids], device=loaded.device)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = loaded.model(input_ids=inputs, cache=cache, use_cache=True, logits_to_keep=1).logits
            token = int(logits[0, -1].argmax())
            tokens.append(token)
            if on_step is not None:
                on_step()
            if token in loaded.eos_token_ids:
                break
            inputs = torch.tensor([[token]], device=loaded.device)
    return tokens


def answer_with_deepcopy(session: QASession, question: str, max_new_tokens: int) -> dict[str, Any]:
    """One answer by the transformers docs' prefix-cache pattern: `copy.deepcopy(prefilled_cache)`, then
    decode on the copy; the prefilled original stays alive for the next question."""
    original = session.cache
    start = time.perf_counter()
    try:
        working = copy.deepcopy(original)
    except Exception as error:  # quanto's tensor subclasses, for one
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    copy_seconds = time.perf_counter() - start
    cache_alone, held, measuring = [], [], [0.0]

    def measure():  # `working` is this function's local, alive until the `del` below
        m0 = time.perf_counter()
        cache_alone.append(held_bytes(working))  # noqa: F821
        held.append(held_bytes(working, original))  # noqa: F821
        measuring[0] += time.perf_counter() - m0

    tokens = bare_decode(session.loaded, working, session.question_ids(question), max_new_tokens, measure)
    seconds = time.perf_counter() - start - measuring[0]
    del working
    return {
        "token_ids": tokens,
        "seconds": seconds,
        "mechanism_seconds": copy_seconds,
        "peak_cache_bytes": max(cache_alone),
        "peak_held_bytes": max(held),
        "extra_bytes": max(h - c for h, c in zip(held, cache_alone)),
    }


# ---- the sections -----------------------------------------------------------------------------------


def median(values: Iterable[float]) -> float | None:
    values = list(values)
    return statistics.median(values) if values else None


def run_backends(
    loaded, context: str, questions: list[str], max_new_tokens: int, overhead_rounds: int, overhead_tokens: int
) -> tuple[list[dict], list[dict], dict]:
    """Sections 1, 2, 4 and 5: one prefill per main backend, both mechanisms, the overhead rounds."""
    rows, overhead = [], []
    sessions = {}
    for spec in MAIN_SPECS:
        session = QASession(loaded, spec)
        report = session.prefill(context)
        restore = [answer_with_restore(session, q, max_new_tokens) for q in questions]
        deep = [answer_with_deepcopy(session, q, max_new_tokens) for q in questions]
        steps = [s for a in restore for s in a["steps"] if s[0] >= 1]
        row = {
            "spec": spec.label,
            "backend": spec.backend,
            "context_tokens": report.context_tokens,
            "prefill_seconds": report.seconds,
            "kv_bytes_after_prefill": report.kv_bytes,
            "restore": {
                k: [a[k] for a in restore]
                for k in ("seconds", "mechanism_seconds", "peak_cache_bytes", "peak_held_bytes", "extra_bytes")
            },
            "deepcopy": (
                {"error": deep[0]["error"]}
                if "error" in deep[0]
                else {
                    k: [a[k] for a in deep]
                    for k in ("seconds", "mechanism_seconds", "peak_cache_bytes", "peak_held_bytes", "extra_bytes")
                }
            ),
            "same_answers": None
            if "error" in deep[0]
            else all(r["token_ids"] == d["token_ids"] for r, d in zip(restore, deep)),
            "cache_length_after": [a["cache_length_after"] for a in restore],
            "device_allocated_peak_bytes": max((a["device_allocated_peak_bytes"] or 0) for a in restore) or None,
            "tokens": sum(len(a["token_ids"]) for a in restore),
            "decode_steps": len(steps),
            "flush_steps": sum(1 for s in steps if s[2]),
            "step_seconds": median(s[1] for s in steps if not s[2]),
            "flush_step_seconds": median(s[1] for s in steps if s[2]),
            "decode_tokens_per_second": len(steps) / sum(s[1] for s in steps) if steps else None,
        }
        rows.append(row)
        sessions[spec.backend] = session
        print(
            f"  {spec.label}: prefill {report.context_tokens} tokens in {report.seconds:.1f} s, "
            f"{row['decode_steps']} decode steps, {row['flush_steps']} with a flush",
            flush=True,
        )
    # dynamic: the fastest decode steps, so the largest relative overhead; fp8: a quantized cache without flushes.
    # (hqq, the app's default, is left out: its flush steps, ~1-80 s on 2 cores, swamp the overhead and the run time)
    for backend in ("dynamic", "fp8"):
        overhead.append(run_overhead(sessions[backend], overhead_rounds, overhead_tokens))
        print(f"  overhead on {sessions[backend].spec.label}: done", flush=True)
    return rows, overhead, sessions


def run_overhead(session: QASession, rounds: int, max_new_tokens: int) -> dict[str, Any]:
    """Section 5: tokens/s of the bare loop, of `QASession.stream`, and of the stream with the app's chart
    frames at every step, interleaved `rounds` times on the same prefilled cache."""
    loaded = session.loaded
    ids = session.question_ids(OVERHEAD_QUESTION)
    results: dict[str, list[float]] = {"bare": [], "stream": [], "stream_charts": []}
    tokens = {}
    for _ in range(rounds):
        saved = snapshot.take(session.cache)
        start = time.perf_counter()
        out = bare_decode(loaded, session.cache, ids, max_new_tokens)
        results["bare"].append(len(out) / (time.perf_counter() - start))
        snapshot.restore(session.cache, saved)
        tokens["bare"] = len(out)
        for name, charts in (("stream", False), ("stream_charts", True)):
            start, events = time.perf_counter(), []
            for event in session.stream(OVERHEAD_QUESTION, max_new_tokens):
                events.append(event)
                if charts:  # what the app's ask handler builds at every step
                    memory_frame(events), residual_frame(events), step_time_frame(events)
            if charts:
                answers_frame(a.to_dict() for a in session.history)
            results[name].append(len(events) / (time.perf_counter() - start))
            tokens[name] = len(events)
    med = {k: statistics.median(v) for k, v in results.items()}
    return {
        "spec": session.spec.label,
        "tokens": tokens,
        "rounds": rounds,
        "tokens_per_second": med,
        "overhead_stream": med["bare"] / med["stream"] - 1,
        "overhead_stream_charts": med["bare"] / med["stream_charts"] - 1,
    }


def run_bytes_per_token(loaded, sessions: dict[str, QASession]) -> list[dict]:
    """Section 3. The post-prefill keys and values of the `dynamic` session are fed to a fresh cache of each
    spec with `Cache.update` (what the prefill's forward pass does: a quantized layer's first update
    quantizes what it is given and keeps no residual), then 3 more tokens (a residual of 3 tokens)."""
    dyn = sessions["dynamic"].cache
    tokens = dyn.get_seq_length()
    rows = []
    for spec in NBITS_SPECS:
        cache = build_cache(spec, loaded.config)
        for index, layer in enumerate(dyn.layers):
            cache.update(layer.keys, layer.values, index)
        states = {"after prefill": (tokens, 0)}
        measured = {"after prefill": kv_memory(cache).total_bytes}
        for index, layer in enumerate(dyn.layers):
            for t in range(3):
                cache.update(layer.keys[..., t : t + 1, :], layer.values[..., t : t + 1, :], index)
        report = kv_memory(cache)
        residual = report.layers[0].residual_tokens if spec.info.has_residual else 0
        states["with a residual"] = (report.seq_length - residual, residual)
        measured["with a residual"] = report.total_bytes
        row = {"spec": spec.label, "context_tokens": tokens}
        for state, (tq, tr) in states.items():
            theory = theoretical_kv_bytes(spec, loaded.config, tq, tr, loaded.dtype)
            row[state] = {
                "quantized_tokens": tq,
                "residual_tokens": tr,
                "measured_bytes": measured[state],
                "theoretical_bytes": theory,
                "measured_bytes_per_token": measured[state] / (tq + tr),
                "theoretical_bytes_per_token": theory / (tq + tr),
                "ratio": measured[state] / theory,
                "ratio_to_full_precision": measured[state] / full_precision_bytes(loaded.config, tq + tr, loaded.dtype),
            }
        rows.append(row)
    return rows


def _subprocess_load(env: dict[str, str]) -> dict[str, Any]:
    code = (
        "import json, time; t = time.perf_counter(); from kvdemo import models; m = models.load_model(); "
        "print('RESULT', json.dumps({'weights_from': m.weights_from, 'load_seconds': m.load_seconds, "
        "'process_seconds': time.perf_counter() - t}))"
    )
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, check=True)
    result = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("RESULT"))[7:])
    result["wall_seconds"] = time.perf_counter() - start
    return result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _app_start(env: dict[str, str], timeout: float = 180) -> dict[str, Any]:
    """Launch `app.py` on a free port; seconds until GET / answers and until `model_status` returns."""
    from gradio_client import Client

    port = _free_port()
    url = f"http://127.0.0.1:{port}/"
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "app.py", "--port", str(port), "--host", "127.0.0.1"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"app.py exited with status {proc.returncode}")
            if time.perf_counter() - start > timeout:
                raise TimeoutError(f"app.py served no page within {timeout} s")
            try:
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        page = time.perf_counter() - start
        status = Client(url, verbose=False).predict(api_name="/model_status")
        loaded = time.perf_counter() - start
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    return {"first_page_seconds": page, "model_loaded_seconds": loaded, "model_status": str(status)[:120]}


def run_startup() -> dict[str, Any]:
    """Section 6, in fresh processes with an empty temporary cache folder."""
    with tempfile.TemporaryDirectory(prefix="kvdemo-bench-cache-") as folder:
        env = dict(os.environ, KVDEMO_CACHE_DIR=folder, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
        out = {"gguf": _subprocess_load(dict(env, KVDEMO_GGUF_CACHE="0"))}
        print(f"  GGUF load: {out['gguf']['load_seconds']:.1f} s", flush=True)
        out["gguf_first_load_writing_copy"] = _subprocess_load(env)
        out["converted_copy"] = _subprocess_load(env)
        print(f"  converted copy load: {out['converted_copy']['load_seconds']:.1f} s", flush=True)
        out["app_with_converted_copy"] = _app_start(env)
        out["app_gguf"] = _app_start(dict(env, KVDEMO_GGUF_CACHE="0"))
        print("  app starts: done", flush=True)
    return out


# ---- output -----------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import transformers

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def _s(s: float | None) -> str:
    return "-" if s is None else f"{s:.3f}"


def print_report(results: dict[str, Any]) -> None:
    cfg = results["config"]
    print(
        f"\nmodel: {results['model']}; {results['machine']['cpu']} ({results['machine']['cpu_cores']} cores, "
        f"{results['machine']['torch_threads']} torch threads), torch {results['machine']['torch']}; "
        f"load average {results['load_average_at_start'][0]:.1f} at the start, {results['load_average_at_end'][0]:.1f} "
        "at the end (above the core count, other processes shared the CPU)"
    )
    print(
        f"context: Normans paragraphs {cfg['paragraphs']} ({cfg['context_tokens']} tokens); {len(cfg['questions'])} "
        f"questions x {cfg['max_new_tokens']} new tokens; residual_length {RESIDUAL}"
    )

    print(
        "\n1-2. restore (kvdemo snapshot) against copy.deepcopy of the prefilled cache (transformers docs' "
        "prefix-cache pattern), per question (median)"
    )
    print(
        "| backend | restore s | deepcopy s | question s: restore | question s: deepcopy | extra MiB held: restore "
        "| extra MiB held: deepcopy | peak held / cache alone: restore | peak held / cache alone: deepcopy |"
        " same answers |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results["backends"]:
        rs, dc = r["restore"], r["deepcopy"]
        peak_r = max(rs["peak_held_bytes"]) / max(rs["peak_cache_bytes"])
        if "error" in dc:
            dcells = [f"fails: {dc['error'][:70]}", "-", "-", "-"]
        else:
            dcells = [
                f"{median(dc['mechanism_seconds']):.4f}",
                f"{median(dc['seconds']):.2f}",
                _mib(max(dc["extra_bytes"])),
                f"{max(dc['peak_held_bytes']) / max(dc['peak_cache_bytes']):.3f}",
            ]
        cells = [
            r["backend"],
            f"{median(rs['mechanism_seconds']):.6f}",
            dcells[0],
            f"{median(rs['seconds']):.2f}",
            dcells[1],
            _mib(max(rs["extra_bytes"])),
            dcells[2],
            f"{peak_r:.3f}",
            dcells[3],
            r["same_answers"] if r["same_answers"] is not None else "-",
        ]
        print("| " + " | ".join(map(str, cells)) + " |")
    for r in results["backends"]:
        if r.get("device_allocated_peak_bytes"):
            print(
                f"   {r['backend']}: torch.cuda.memory_allocated peak during the answers "
                f"{_mib(r['device_allocated_peak_bytes'])} MiB (weights, cache, activations)"
            )
    print(
        "   (question s: restore goes through QASession.stream, which also reads telemetry at every step; the "
        "deepcopy answer is a bare loop)"
    )

    print(
        "\n3. KV bytes per token, measured (kvdemo.telemetry) / theoretical (bits per value + a scale and a "
        "zero point per group + the residual)"
    )
    print(
        "| spec | bytes/token after prefill | theoretical | ratio | with a 3-token residual: ratio | "
        "ratio to full precision |"
    )
    print("|---|---|---|---|---|---|")
    for r in results["bytes_per_token"]:
        a, b = r["after prefill"], r["with a residual"]
        print(
            f"| {r['spec']} | {a['measured_bytes_per_token']:,.1f} | {a['theoretical_bytes_per_token']:,.1f} | "
            f"{a['ratio']:.3f} | {b['ratio']:.3f} | {a['ratio_to_full_precision']:.3f} |"
        )

    base = next(r for r in results["backends"] if r["backend"] == "dynamic")
    print("\n4. decode speed (median seconds per decode step, step 0 left out), relative to dynamic")
    print("| backend | steps | flush steps | s/step without flush | x dynamic | s/flush step | tokens/s | x dynamic |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results["backends"]:
        print(
            f"| {r['spec']} | {r['decode_steps']} | {r['flush_steps']} | {r['step_seconds']:.3f} | "
            f"{r['step_seconds'] / base['step_seconds']:.2f} | "
            f"{_s(r['flush_step_seconds'])} | "
            f"{r['decode_tokens_per_second']:.2f} | "
            f"{r['decode_tokens_per_second'] / base['decode_tokens_per_second']:.2f} |"
        )
    hqq = next(r for r in results["backends"] if r["backend"] == "hqq")
    if hqq["flush_step_seconds"] is not None:
        print(
            f"   hqq: a flush step on the {hqq['context_tokens']}-token context takes "
            f"{hqq['flush_step_seconds']:.2f} s "
            f"({hqq['flush_step_seconds'] / hqq['step_seconds']:.1f}x a step without a flush)"
        )

    print("\n5. the app's overhead: tokens/s against a bare decode loop (forward + argmax, no telemetry)")
    print(
        "| spec | tokens | bare | QASession.stream | stream + chart frames | overhead stream | "
        "overhead stream + charts |"
    )
    print("|---|---|---|---|---|---|---|")
    for o in results["overhead"]:
        t = o["tokens_per_second"]
        print(
            f"| {o['spec']} | {o['tokens']['bare']} | {t['bare']:.2f} | {t['stream']:.2f} | {t['stream_charts']:.2f} | "
            f"{o['overhead_stream']:+.1%} | {o['overhead_stream_charts']:+.1%} |"
        )
    print("   target: <= 5 % overhead with the charts")

    s = results.get("startup")
    if s:
        print("\n6. start-up (fresh processes)")
        print("| what | load s (in load_model) | process s |")
        print("|---|---|---|")
        for key, label in (
            ("gguf", "embedded model from the GGUF (de-quantized)"),
            ("gguf_first_load_writing_copy", "first load: GGUF + writing the converted copy"),
            ("converted_copy", "later loads: the converted safetensors copy"),
        ):
            print(f"| {label} | {s[key]['load_seconds']:.2f} | {s[key]['wall_seconds']:.2f} |")
        print(
            f"   GGUF / converted copy: {s['gguf']['load_seconds'] / s['converted_copy']['load_seconds']:.1f}x "
            f"(load), {s['gguf']['wall_seconds'] / s['converted_copy']['wall_seconds']:.1f}x (process)"
        )
        print("| app.py | first page s | model loaded s |")
        print("|---|---|---|")
        for key, label in (("app_with_converted_copy", "with the converted copy"), ("app_gguf", "from the GGUF")):
            print(f"| {label} | {s[key]['first_page_seconds']:.1f} | {s[key]['model_loaded_seconds']:.1f} |")


def draw(results: dict[str, Any], folder: Path) -> list[Path]:
    """A 2 x 2 figure: extra bytes held per mechanism, bytes per token measured and theoretical, seconds per
    decode step with and without a flush, start-up seconds. Written as PNG and SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    rows = results["backends"]
    names = [r["backend"] for r in rows]
    x = range(len(rows))

    ax = axes[0][0]
    restore = [max(r["restore"]["extra_bytes"]) / MiB for r in rows]
    deep = [0 if "error" in r["deepcopy"] else max(r["deepcopy"]["extra_bytes"]) / MiB for r in rows]
    ax.bar([i - 0.2 for i in x], restore, 0.4, label="kvdemo restore")
    ax.bar([i + 0.2 for i in x], deep, 0.4, label="copy.deepcopy")
    for i, r in enumerate(rows):
        if "error" in r["deepcopy"]:
            ax.text(i + 0.2, 0, "fails", ha="center", va="bottom", rotation=90, fontsize=9)
    ax.set_xticks(list(x), names)
    ax.set_ylabel("MiB")
    ax.set_title(f"extra KV bytes held while an answer decodes ({results['config']['context_tokens']} tokens)")
    ax.legend()

    ax = axes[0][1]
    bpt = results["bytes_per_token"]
    labels = [
        r["spec"].replace(" q_group_size=64", "").replace(f" residual_length={RESIDUAL}", "").replace("nbits=", "")
        for r in bpt
    ]
    ax.bar(
        [i - 0.2 for i in range(len(bpt))],
        [r["after prefill"]["measured_bytes_per_token"] for r in bpt],
        0.4,
        label="measured",
    )
    ax.bar(
        [i + 0.2 for i in range(len(bpt))],
        [r["after prefill"]["theoretical_bytes_per_token"] for r in bpt],
        0.4,
        label="theoretical",
    )
    ax.set_xticks(range(len(bpt)), labels, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("bytes per token (log)")
    ax.set_title("KV bytes per token")
    ax.legend()

    ax = axes[1][0]
    ax.bar([i - 0.2 for i in x], [r["step_seconds"] for r in rows], 0.4, label="step without a flush")
    ax.bar([i + 0.2 for i in x], [r["flush_step_seconds"] or 0 for r in rows], 0.4, label="step with a flush")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("seconds (median)")
    ax.set_title("seconds per decode step")
    ax.legend()

    ax = axes[1][1]
    s = results.get("startup")
    if s:
        bars = [
            ("GGUF load", s["gguf"]["load_seconds"]),
            ("copy load", s["converted_copy"]["load_seconds"]),
            ("app: model\n(GGUF)", s["app_gguf"]["model_loaded_seconds"]),
            ("app: model\n(copy)", s["app_with_converted_copy"]["model_loaded_seconds"]),
        ]
        ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["C1", "C0", "C1", "C0"])
        ax.set_ylabel("seconds")
        ax.set_title("start-up")
    else:
        ax.set_axis_off()
    m = results["machine"]
    fig.suptitle(f"kvdemo on {results['model']} - {m['cpu']}, {m['cpu_cores']} cores - {results['date']}", fontsize=10)
    fig.tight_layout()
    paths = [folder / "bench.png", folder / "bench.svg"]
    for path in paths:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paragraphs", default="0-11", help="Normans paragraphs (0-11: 2,172 tokens)")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--overhead-rounds", type=int, default=3)
    parser.add_argument("--overhead-tokens", type=int, default=24)
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--quick", action="store_true", help="paragraphs 0-3, 12 tokens, 1 round, no start-up")
    parser.add_argument("--out", default=str(ROOT / "artifacts" / "bench"))
    args = parser.parse_args()
    if args.quick:
        args.paragraphs, args.max_new_tokens, args.overhead_rounds, args.overhead_tokens = "0-3", 12, 1, 12
        args.skip_startup = True
    began = time.perf_counter()
    load_at_start = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    case = load_case(example_path("normans")).select(args.paragraphs)
    questions = [q.question for q in case.answerable(args.questions)]
    loaded = load_model()
    print(
        f"kvdemo benchmarks: {loaded.name} on {loaded.device} ({loaded.dtype}), loaded in {loaded.load_seconds:.1f} s "
        f"from {loaded.weights_from}",
        flush=True,
    )
    print("sections 1, 2, 4, 5: prefill and answers per backend", flush=True)
    rows, overhead, sessions = run_backends(
        loaded, case.context, questions, args.max_new_tokens, args.overhead_rounds, args.overhead_tokens
    )
    print("section 3: bytes per token", flush=True)
    bpt = run_bytes_per_token(loaded, sessions)
    sessions.clear()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "model": loaded.name,
        "machine": machine(),
        "load_average_at_start": load_at_start,
        "config": {
            "paragraphs": args.paragraphs,
            "context_tokens": rows[0]["context_tokens"],
            "questions": questions,
            "max_new_tokens": args.max_new_tokens,
            "residual_length": RESIDUAL,
            "overhead_question": OVERHEAD_QUESTION,
            "overhead_tokens": args.overhead_tokens,
        },
        "backends": rows,
        "bytes_per_token": bpt,
        "overhead": overhead,
    }
    if not args.skip_startup:
        print("section 6: start-up (fresh processes)", flush=True)
        results["startup"] = run_startup()
    results["seconds"] = time.perf_counter() - began
    results["load_average_at_end"] = os.getloadavg()
    for r in rows:  # keep the JSON small: the per-step list is summarised above
        r.pop("steps", None)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    paths = draw(results, out)
    print_report(results)
    print(f"\nwritten: {out / 'results.json'}, {', '.join(map(str, paths))}; run time {results['seconds']:.0f} s")


if __name__ == "__main__":
    main()
