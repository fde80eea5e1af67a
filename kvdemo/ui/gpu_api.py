"""On a ZeroGPU Space, the GPU job (`kvdemo.serve.gpu_job`, `@spaces.GPU`) served as two API endpoints beside the page:
`gpu_prefill` (a context prefilled on the GPU into a session file; its path and figures) and `gpu_answer` (a question
answered on that file: warm in the worker, or opened from the file). `gradio_client` and MCP clients call them as the
other endpoints (`client.predict(context=..., spec="hqq:4", api_name="/gpu_prefill")`). The page's tabs run in the
main process, on the CPU, as on a CPU Space: their per-step charts and Stop need the session in the same process.

A client names a session file only by the path `gpu_prefill` returned: a path outside the jobs' folder of session
files, or not a `.kvsession` file, is refused before any job runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr

from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS
from kvdemo.qa.session_file import SUFFIX
from kvdemo.serve.gpu_job import GpuJobError, GpuRequest, run_job, serve_model, session_files
from kvdemo.serve.server import App


def _checked(session_path: str) -> str:
    """`session_path` when it names a session file in the jobs' folder. Raises gr.Error otherwise."""
    folder = session_files().folder.resolve()
    path = Path(str(session_path or "")).resolve()
    if path.suffix != SUFFIX or folder not in path.parents:
        raise gr.Error(f"session_path must be a path gpu_prefill returned (a {SUFFIX} file in {folder})")
    return str(path)


def _run(request: GpuRequest) -> dict[str, Any]:
    try:
        return run_job(request)
    except GpuJobError as error:
        raise gr.Error(str(error)) from None


def gpu_prefill(context: str, spec: str = "dynamic", max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> dict[str, Any]:
    """Prefill `context` into a KV cache of `spec` on the GPU and save it as a session file (or open the file of the
    same context, model and spec). Returns `session_path` (give it to gpu_answer), `context_tokens`, `kv_bytes`,
    `prefill_seconds`, `opened` and the job's `device` and `seconds`. Raises: the job's refusal as its message."""
    return _run(GpuRequest("prefill", str(spec), str(context), max_new_tokens=int(max_new_tokens)))


def gpu_answer(session_path: str, question: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS) -> dict[str, Any]:
    """Answer `question` on the session file `session_path` (from gpu_prefill) on the GPU: on the worker's warm session
    (`warm`: `hit`) or opened from the file (`miss`); the same answer either way. Returns the answer's text, token ids,
    steps, flushes and seconds (`Answer.to_dict`) and `warm`. Raises: a path not from gpu_prefill, the job's refusal."""
    path, tokens = _checked(session_path), int(max_new_tokens)
    return _run(GpuRequest("answer", session_path=path, question=str(question), max_new_tokens=tokens))


def add_gpu_api(demo: gr.Blocks, app: App) -> list[str]:
    """Serve `app`'s model to the GPU job (`serve_model`) and add `gpu_prefill` and `gpu_answer` to `demo`; returns
    their names. Each endpoint waits for the model in the main process before its job, so that the worker ZeroGPU
    forks for the job inherits it loaded."""
    serve_model(app.wait_for_model)
    names = []
    with demo:
        for fn in (gpu_prefill, gpu_answer):
            gr.api(_after_load(fn, app), api_name=fn.__name__, concurrency_id="gpu", concurrency_limit=1)
            names.append(fn.__name__)
    return names


def _after_load(fn: Any, app: App) -> Any:
    """`fn` after `app.wait_for_model()`, with `fn`'s name, signature and docstring (what the API page shows)."""
    import functools

    @functools.wraps(fn)
    def called(*args: Any, **kwargs: Any) -> Any:
        app.wait_for_model()
        return fn(*args, **kwargs)

    return called
