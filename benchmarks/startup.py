"""Start-up figures of `benchmarks/run_all.py` (section 6), each in a fresh process: `load_model` from the embedded
GGUF and from its converted safetensors copy, and `app.py` up to its first page and to the model loaded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _subprocess_load(env: dict[str, str]) -> dict[str, Any]:
    code = (
        "import json, time; t = time.perf_counter(); from kvdemo.qa import models; m = models.load_model(); "
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


def _cli_help(env: dict[str, str], rounds: int = 3) -> dict[str, float]:
    """Seconds of `python -m kvdemo --help` beside its floors, measured in turn in fresh processes (the median of
    `rounds`): the bare interpreter (`python -c pass`) and `import torch` alone, which `--help` must not need."""
    commands = {
        "interpreter": [sys.executable, "-c", "pass"],
        "help": [sys.executable, "-m", "kvdemo", "--help"],
        "import_torch": [sys.executable, "-c", "import torch"],
    }
    times: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(rounds):
        for name, command in commands.items():
            start = time.perf_counter()
            subprocess.run(command, env=env, cwd=ROOT, capture_output=True, check=True)
            times[name].append(time.perf_counter() - start)
    return {f"{name}_seconds": sorted(values)[len(values) // 2] for name, values in times.items()}


def run_startup() -> dict[str, Any]:
    """Section 6, in fresh processes with an empty temporary cache folder."""
    with tempfile.TemporaryDirectory(prefix="kvdemo-bench-cache-") as folder:
        env = dict(os.environ, KVDEMO_CACHE_DIR=folder, HF_HUB_OFFLINE="1", GRADIO_ANALYTICS_ENABLED="False")
        out: dict[str, Any] = {"cli_help": _cli_help(env)}
        print(f"  python -m kvdemo --help: {out['cli_help']['help_seconds']:.2f} s", flush=True)
        out["gguf"] = _subprocess_load(dict(env, KVDEMO_GGUF_CACHE="0"))
        print(f"  GGUF load: {out['gguf']['load_seconds']:.1f} s", flush=True)
        out["gguf_first_load_writing_copy"] = _subprocess_load(env)
        out["converted_copy"] = _subprocess_load(env)
        print(f"  converted copy load: {out['converted_copy']['load_seconds']:.1f} s", flush=True)
        out["app_with_converted_copy"] = _app_start(env)
        out["app_gguf"] = _app_start(dict(env, KVDEMO_GGUF_CACHE="0"))
        print("  app starts: done", flush=True)
    return out


# ---- output -----------------------------------------------------------------------------------------
