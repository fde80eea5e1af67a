"""An MCP tool's two lines to its caller through Gradio's MCP bridge: progress out, and word that the caller left.

Gradio 6.31 runs a queued tool as a job of its own loopback `gradio_client` (`gradio/mcp.py`, `call_tool`): the
bridge's coroutine awaits the job and turns each of its status updates into a `notifications/progress` for the
request's progress token (`_execute_tool_with_progress`), so a `gr.Progress` update in the tool reaches the
client; `ProgressRelay` feeds it from the work's own callbacks. When the client leaves, the MCP SDK cancels that
coroutine: a closed streamable HTTP connection terminates the request's (stateless) transport and `Server.run`
cancels its handlers (mcp 1.30, `server/lowlevel/server.py`, "Transport closed: cancel in-flight handlers"); on the
SSE transport a `notifications/cancelled` cancels the request; a progress notification sent to a closed stream
raises. The bridge tells the job none of this, so the tool ran on, holding its queue slot.

`hook(server)` closes the gap from kvdemo's side. Each MCP call gets an id, sent to the tool with the loopback
request as the header `CALL_HEADER`; when the bridge's coroutine ends before its job (cancelled, or a progress send
failed), `McpCalls.abandon` calls the stop the tool registered with `McpCalls.watching` (a comparison's Cancel, an
answer's or a prefill's Stop), at once or when a call that waited in the queue starts. `after` is a call's time
bound, for the one way of leaving that never reaches the bridge's coroutine (a streamable HTTP client that sends
`notifications/cancelled` and keeps its connection: Gradio's stateless transport cannot match it to the call).

Example:
    >>> demo.launch(mcp_server=True, prevent_thread_lock=True)
    >>> hook(demo.mcp_server_obj)
    >>> # in a tool: with CALLS.watching(request, cancel.set) as gone: ... (gone(): why the caller left, or None)
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import gradio as gr

_log = logging.getLogger(__name__)

CALL_HEADER = "x-kvdemo-mcp-call"
"""The header that carries an MCP call's id from the bridge to the tool (set by `hook`, overriding a client's)."""

_CALL: contextvars.ContextVar[str | None] = contextvars.ContextVar("kvdemo_mcp_call", default=None)
"""The id of the MCP call that the bridge's `call_tool` coroutine now serves (set in its own task)."""

_HOOKED = "_kvdemo_calls_hooked"

PROGRESS_EVERY_SECONDS = 1.0
"""`ProgressRelay` forwards an update at most this often (seconds): the client hears about the work every second
or so while it advances, without one notification per decode step."""


class McpCalls:
    """The MCP calls whose tools run, by id: each one's stop, and why a caller left (the last `remember` ids, so a
    call that left while it waited in Gradio's queue is stopped when it starts). Thread-safe."""

    def __init__(self, remember: int = 1024):
        self._lock = threading.Lock()
        self._stops: dict[str, Callable[[], None]] = {}
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._remember = remember

    @staticmethod
    def call_of(request: gr.Request | None) -> str | None:
        """The MCP call id of a tool's request (`CALL_HEADER`), or None: not called through a hooked bridge."""
        headers = getattr(request, "headers", None) if request is not None else None
        call = headers.get(CALL_HEADER) if headers is not None else None
        return call if isinstance(call, str) and call else None

    @contextmanager
    def watching(self, request: gr.Request | None, stop: Callable[[], None]) -> Iterator[Callable[[], str | None]]:
        """While the tool works: `stop()` (quick and thread-safe, e.g. `threading.Event.set`) is called from the
        bridge's thread as soon as the call's MCP client leaves, and at once if it left while the call waited in
        the queue. Yields `gone()`: why the client left ("cancelled", or the error that ended the bridge's wait),
        or None while it is there (always None for a call that no hooked bridge made)."""
        call = self.call_of(request)
        if call is None:
            yield lambda: None
            return
        with self._lock:
            self._stops[call] = stop
            left = self._gone.get(call)
        if left is not None:
            stop()
        try:
            yield lambda: self._gone.get(call)
        finally:
            with self._lock:
                self._stops.pop(call, None)
                self._gone.pop(call, None)

    def abandon(self, call: str, why: str) -> None:
        """The MCP client of `call` left (`why`): stop its tool now, or when it starts."""
        with self._lock:
            self._gone[call] = why
            while len(self._gone) > self._remember:
                self._gone.popitem(last=False)
            stop = self._stops.get(call)
        _log.info("an MCP client left its call (%s); %s", why, "stopping its tool" if stop else "its tool has not run")
        if stop is not None:
            stop()


CALLS = McpCalls()
"""The process's MCP calls: `hook` reports to it, the tools of `kvdemo.ui.mcp_tools` watch through it."""


def hook(server: Any, calls: McpCalls = CALLS) -> None:
    """Make Gradio's MCP bridge `server` (`demo.mcp_server_obj`, a `gradio.mcp.GradioMCPServer`) tell `calls` when
    an MCP call's client leaves before its tool's job ends; once per server (a second call does nothing).

    It wraps three methods of that one object: `_prepare_tool_call_args` adds `CALL_HEADER` to the headers
    the loopback job is sent with; `_execute_tool_with_progress` is awaited as before, and its end by a cancel or
    an error while the job runs calls `calls.abandon`; `_execute_tool_without_progress` polls the job every 0.1 s
    instead of the bridge's `run_sync(job.result)`, which a cancel cannot interrupt until the job ends.

    Raises:
        RuntimeError: this Gradio's bridge lacks one of those methods (a Gradio other than 6.31's layout).
    """
    if getattr(server, _HOOKED, False):
        return
    names = ("_prepare_tool_call_args", "_execute_tool_with_progress", "_execute_tool_without_progress")
    missing = [name for name in names if not callable(getattr(server, name, None))]
    if missing:
        raise RuntimeError(f"Gradio's MCP bridge has no {', '.join(missing)}: kvdemo cannot see a caller leave")
    prepare, relay = server._prepare_tool_call_args, server._execute_tool_with_progress

    def prepare_call(name: str, arguments: dict[str, Any]) -> tuple:
        endpoint, args, headers, block_fn = prepare(name, arguments)
        call = uuid.uuid4().hex
        headers[CALL_HEADER] = call
        _CALL.set(call)  # the same task awaits the job next (`call_tool`)
        return endpoint, args, headers, block_fn

    async def with_progress(job: Any, progress_token: str | int) -> Any:
        return await _watched(job, relay(job, progress_token), calls)

    async def without_progress(job: Any) -> list[Any]:
        return await _watched(job, _result(job), calls)

    server._prepare_tool_call_args = prepare_call
    server._execute_tool_with_progress = with_progress
    server._execute_tool_without_progress = without_progress
    setattr(server, _HOOKED, True)


async def _result(job: Any) -> list[Any]:
    """The job's output as the bridge's own fast path returns it, awaited in steps that a cancel interrupts."""
    while not job.done():
        await anyio.sleep(0.1)
    return [job.result()]


async def _watched(job: Any, work: Awaitable[Any], calls: McpCalls) -> Any:
    """`await work`; if it ends by a cancel or an error while `job` still runs, the call's client has left."""
    call = _CALL.get()
    try:
        return await work
    except BaseException as error:
        if call is not None and not job.done():
            cancelled = isinstance(error, anyio.get_cancelled_exc_class())
            calls.abandon(call, "cancelled" if cancelled else f"{type(error).__name__} while relaying progress")
        raise


def after(seconds: float, bound: threading.Event, stop: Callable[[], None]) -> threading.Timer:
    """A call's bound: in `seconds`, unless the returned timer is cancelled first (a daemon thread), `bound.set()`,
    then `stop()`."""

    def reached() -> None:
        bound.set()
        stop()

    timer = threading.Timer(seconds, reached)
    timer.daemon = True
    timer.start()
    return timer


SETTLE_SECONDS = 0.2
"""How long a relay's last update is given to reach the client before the tool returns (`ProgressRelay.settle`)."""


class ProgressRelay:
    """A tool's progress, fed by its work's own callbacks as `relay(done, total, what)` (a unit of work done, a
    prefill chunk, a decode step) and forwarded at most once per `every` seconds, and always when `done == total`.

    It forwards to a `gr.Progress` made in the tool's event: Gradio 6.31's `gr.api` takes no `gr.Progress`
    parameter (it would be an input of the tool), but a `gr.Progress()` made while an event runs reports for
    that event (it reads the event from Gradio's `LocalContext`). Through Gradio's MCP bridge each update becomes
    one `notifications/progress` ("Progress <what>: Step <done> of <total>"); outside a queued event, nothing.

    Args:
        progress: where to forward `progress((done, total), desc=what, unit="steps")`; None: a new `gr.Progress()`.
        every: seconds.
    """

    def __init__(self, progress: Callable[..., Any] | None = None, every: float = PROGRESS_EVERY_SECONDS):
        self.progress = gr.Progress() if progress is None else progress
        self.every = every
        self._sent = float("-inf")

    def __call__(self, done: int, total: int | None, what: str) -> None:
        now = time.monotonic()
        if now - self._sent < self.every and done != total:
            return
        self._sent = now
        self.progress((done, total), desc=what, unit="steps")

    def settle(self) -> None:
        """Wait until the last update forwarded is `SETTLE_SECONDS` old before the tool returns: Gradio's queue sends
        a pending update on its next pass (every 10 ms) and the loopback job drops one that arrives with the result,
        so a comparison that ends right after its last unit would otherwise never tell "15 of 15"."""
        wait = self._sent + SETTLE_SECONDS - time.monotonic()
        if wait > 0:
            time.sleep(wait)
