"""A stand-in for Hugging Face's `spaces` package on a ZeroGPU Space (which cannot be installed here), for running the
whole app as ZeroGPU runs it: put `tests/stand_in` first on `PYTHONPATH` and set `SPACES_ZERO_GPU`. `GPU` plays
`spaces.GPU` (`spaces/zero/decorator.py` of spaces 0.51.3) with the CPU harness's workers (tests/zerogpu_harness.py):
the decorated function runs in a forked worker, its arguments and results (a generator's values one by one) pickled
across, the duration callable called in the server's process. The scheduler policy is `KVDEMO_STAND_IN_POLICY`
(default `fresh`: a new worker forked for every call, the case where nothing is warm).

`KVDEMO_STAND_IN_LOG`, when set, names a file where each call's worker appends one line, `<pid> <kind>` (the job's
`WorkOrder.kind`): what the tests read to see that the model work ran in forked workers.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

from tests.zerogpu_harness import Harness

HARNESS = Harness(os.environ.get("KVDEMO_STAND_IN_POLICY", "fresh"))
_SERVER = os.getpid()


def _close(signum: int | None = None, frame: object = None) -> None:
    """Kill and join every worker, in the server's process only (a worker inherits this handler with the fork); on a
    signal, then end as the signal would have."""
    if os.getpid() != _SERVER:
        return
    HARNESS.close()
    if signum is not None:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


atexit.register(_close)
if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _close)  # the workers do not outlive the app (ZeroGPU's die with their Space)


def _log(args: tuple) -> None:
    path = os.environ.get("KVDEMO_STAND_IN_LOG")
    if path:
        kind = getattr(args[0], "kind", "?") if args else "?"
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"{os.getpid()} {kind}\n")


def _logged(task: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isgeneratorfunction(task):

        @functools.wraps(task)
        def streamed(*args: Any, **kwargs: Any) -> Any:
            _log(args)
            yield from task(*args, **kwargs)

        return streamed

    @functools.wraps(task)
    def called(*args: Any, **kwargs: Any) -> Any:
        _log(args)
        return task(*args, **kwargs)

    return called


def GPU(task: Callable[..., Any] | None = None, *, duration: Any = 60, size: str | None = None) -> Any:  # noqa: N802
    """`@spaces.GPU`, `@spaces.GPU(duration=...)`: the function, run in the harness's forked workers."""
    if task is None:
        return lambda fn: HARNESS.gpu(duration)(_logged(fn))
    return HARNESS.gpu(duration)(_logged(task))
