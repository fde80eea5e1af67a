"""A CPU harness that plays ZeroGPU's part for a GPU job (`kvdemo.serve.gpu_job`), as `spaces` 0.51.3 does it
(`spaces/zero/wrappers.py: regular_function_wrapper`):

- the worker is a process of `multiprocessing.get_context("fork")`: it inherits the caller's memory (the model loaded
  before the first call) and nothing made after it was forked;
- the call's arguments go to the worker, and its result comes back, through `SimpleQueue`s, which pickle in `put`
  (as `spaces.utils.SimpleQueue` does): what cannot be pickled fails in the caller; every pickled argument and
  result is kept in `Harness.crossed` for the tests to inspect;
- a generator function's values come back one by one as the worker yields them (`generator_function_wrapper`), and
  a caller that closes its side early sets the worker's stop event, after which the worker closes the generator;
- a worker first closes the TCP sockets it inherited from the server (`worker_init`), so that it holds none of the
  page's connections open;
- one pool of workers per decorated function; the duration callable (`duration=`) is called in the caller with the
  call's arguments, as the scheduler's request does, and kept in `Harness.durations`;
- an exception in the worker comes back as its class name, message and traceback (`WorkerError`), as ZeroGPU's
  `ExceptionResult`; a worker that dies during a call is reported, not waited on forever;
- calls at once (two visitors): a worker runs one call at a time; a call that finds every worker busy forks another,
  as the scheduler does (`most_at_once` counts the calls that overlapped);
- four scheduler policies: `reuse` (a worker reused while alive and idle), `fresh` (a new worker
  forked for each call; the old one stays alive and unused, as `spaces` leaves it), `kill` (the worker is killed
  after each call: the GPU and the process taken back), `swap` (two workers, and each visitor's calls alternate
  between them, so a visitor's next call lands on the worker that served the other visitor).

What it cannot prove: anything about CUDA (the fork here inherits a CPU model and CPU torch; on ZeroGPU the worker
initialises CUDA after the fork, moves tensors and unpatches torch's CUDA emulation: `spaces.zero.torch`), the real
scheduler (when it reports a worker idle, how many workers a Space gets, queueing and priority), quotas (a visitor's
daily GPU seconds; calls refused or cut short), timings (the duration is computed and recorded, never enforced;
on ZeroGPU `spaces` warns past it and the platform may end the call), Gradio's progress and errors crossing from the
worker (`GradioPartialContext`, `gr.Error`), and the file descriptors and signals `spaces` handles in the worker.

Workers are daemons, closed by `Harness.close` (a context manager), which kills and joins every one it forked.
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import pickle
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from typing import Any

import psutil
import torch

POLICIES = ("reuse", "fresh", "kill", "swap")
CALL_TIMEOUT_S = 120.0


class WorkerError(RuntimeError):
    """An exception raised in the worker: its class name, message and traceback, as ZeroGPU reports it."""


@dataclass
class _Worker:
    process: Any
    args: Any
    results: Any
    stop: Any
    busy: bool = False


def _put(results: Any, out: tuple[str, Any]) -> bool:
    """Put `out` back; an unpicklable value is reported as ZeroGPU reports it. Returns whether it went."""
    try:
        results.put(out)
        return True
    except Exception as error:
        results.put(("error", f"{type(error).__name__}: the result cannot be pickled: {error}"))
        return False


def _close_inherited_connections() -> int:
    """Close, in a worker just forked, the TCP sockets it inherited from the server (its listening socket and every
    connection open at the fork), as `spaces`' `worker_init` closes the server port's connections first thing. A
    worker that kept them would hold each of those connections open after the server closed its end: the browser
    then waits on a connection nobody serves (found by a browser walk: the page's Stop queued behind six of them).
    Returns how many it closed."""
    closed = 0
    for connection in psutil.Process().net_connections(kind="tcp"):
        if connection.fd >= 0:
            try:
                os.close(connection.fd)
                closed += 1
            except OSError:
                pass
    return closed


def _serve(task: Callable[..., Any], args: Any, results: Any, stop: Any) -> None:
    """The worker's loop: take a call, run it, put its result (or its exception) back; None ends it. A generator's
    values go back one by one as `yield`, then `end`; once `stop` is set (the caller closed its side) the generator is
    closed after its current value, as `spaces`' `generator_function_wrapper` does."""
    _close_inherited_connections()
    while True:
        call = args.get()
        if call is None:
            return
        positional, keywords = call
        stop.clear()
        if not inspect.isgeneratorfunction(task):
            try:
                out: tuple[str, Any] = ("ok", task(*positional, **keywords))
            except Exception as error:
                out = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
            _put(results, out)
            continue
        generator, ended = task(*positional, **keywords), ("end", None)
        while True:
            try:
                value = next(generator)
            except StopIteration:
                break
            except Exception as error:  # the error ends the call: no `end` after it
                ended = ("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
                break
            if stop.is_set():
                generator.close()
                break
            if not _put(results, ("yield", value)):  # its error was put: nothing after it
                ended = None
                break
        if ended is not None:
            _put(results, ended)


@dataclass
class Harness:
    """ZeroGPU's part for the decorated functions of one test (module docstring).

    Attributes:
        policy: one of `POLICIES`.
        visitor: who calls the functions `gpu` decorates (the `swap` policy alternates workers per visitor).
        crossed: every argument tuple and result that crossed, with its pickled size: (direction, bytes, object as
            the other side received it), direction `args` or `result`.
        durations: the duration the scheduler was asked for, per call (seconds).
        forked: the pid of every worker forked.
    """

    policy: str = "reuse"
    visitor: str = "anonymous"
    crossed: list[tuple[str, int, Any]] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    forked: list[int] = field(default_factory=list)
    _pools: dict[int, list[_Worker]] = field(default_factory=dict)
    _calls: dict[str, int] = field(default_factory=dict)
    _all: list[_Worker] = field(default_factory=list)
    most_at_once: int = 0
    _running: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}; use one of {POLICIES}")
        self._context = multiprocessing.get_context("fork")

    def gpu(self, duration: Callable[..., float] | float = 60) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """`spaces.GPU(duration=...)` played here: the decorated function (a generator function's values streamed back
        one by one, `stream`) runs in this harness's workers; its calls come from `visitor` (set it between calls to
        play several visitors; `call` and `stream` name one directly)."""

        def decorate(task: Callable[..., Any]) -> Callable[..., Any]:
            if inspect.isgeneratorfunction(task):

                def streamed(*args: Any, **kwargs: Any) -> Any:
                    yield from self.stream(task, *args, visitor=self.visitor, duration=duration, **kwargs)

                return streamed

            def handler(*args: Any, **kwargs: Any) -> Any:
                return self.call(task, *args, visitor=self.visitor, duration=duration, **kwargs)

            return handler

        return decorate

    def _fork(self, task: Callable[..., Any]) -> _Worker:
        torch.set_num_threads(1)  # one thread in the parent before forking: OpenMP's pool does not survive a fork
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        args, results, stop = self._context.SimpleQueue(), self._context.SimpleQueue(), self._context.Event()
        process = self._context.Process(target=_serve, args=(task, args, results, stop), daemon=True)
        process.start()
        worker = _Worker(process, args, results, stop)
        self._all.append(worker)
        self.forked.append(process.pid)
        return worker

    def _worker(self, task: Callable[..., Any], visitor: str) -> _Worker:
        """A worker for `visitor`'s call (the policy's), marked busy until `_done`."""
        with self._lock:
            worker = self._choose(task, visitor)
            worker.busy = True
            self._running += 1
            self.most_at_once = max(self.most_at_once, self._running)
            return worker

    def _done(self, worker: _Worker) -> None:
        with self._lock:
            worker.busy = False
            self._running -= 1

    def _choose(self, task: Callable[..., Any], visitor: str) -> _Worker:
        pool = self._pools.setdefault(id(task), [])
        alive = [w for w in pool if w.process.is_alive() and not w.busy]
        if self.policy == "swap":
            while len(pool) < 2:
                pool.append(self._fork(task))
            order = self._calls.setdefault(visitor, 0)  # a visitor's first call: worker (its rank among visitors) % 2
            first = list(self._calls).index(visitor)
            self._calls[visitor] = order + 1
            worker = pool[(first + order) % 2]
            if not worker.process.is_alive():
                pool[pool.index(worker)] = worker = self._fork(task)
            return worker
        if self.policy == "reuse" and alive:
            return alive[0]
        worker = self._fork(task)
        if self.policy == "reuse":
            pool.append(worker)  # every worker busy: one more, reused later too
        else:
            pool[:] = [w for w in pool if w.busy] + [worker]  # `fresh`: the old worker stays alive, unused
        return worker

    def call(
        self, task: Callable[..., Any], *args: Any, visitor: str = "anonymous", duration: Any = 60, **kwargs: Any
    ) -> Any:
        """Run `task(*args, **kwargs)` in a worker chosen by the policy for `visitor`; returns its result.

        Raises:
            WorkerError: the task raised, or its result could not be pickled, or the worker died.
            TimeoutError: no result within `CALL_TIMEOUT_S`.
        """
        self.durations.append(float(duration(*args, **kwargs) if callable(duration) else duration))
        sent = pickle.dumps((args, kwargs))
        self.crossed.append(("args", len(sent), pickle.loads(sent)))
        worker = self._worker(task, visitor)
        try:
            worker.args.put((args, kwargs))
            status, value = self._next(worker)
            if self.policy == "kill":
                worker.process.kill()
                worker.process.join(10)
        finally:
            self._done(worker)
        if status != "ok":
            raise WorkerError(value)
        self.crossed.append(("result", len(pickle.dumps(value)), value))
        return value

    def _next(self, worker: _Worker) -> tuple[str, Any]:
        """The worker's next message; TimeoutError or WorkerError where none comes."""
        ready = wait([worker.results._reader, worker.process.sentinel], timeout=CALL_TIMEOUT_S)
        if not ready:
            raise TimeoutError(f"no result from the worker in {CALL_TIMEOUT_S} s")
        if worker.results._reader not in ready:
            raise WorkerError(f"the worker died (exit code {worker.process.exitcode})")
        return worker.results.get()

    def stream(
        self, task: Callable[..., Any], *args: Any, visitor: str = "anonymous", duration: Any = 60, **kwargs: Any
    ) -> Any:
        """A generator `task(*args, **kwargs)` run in a worker chosen by the policy for `visitor`: its values as the
        worker yields them (each kept in `crossed` as a `yield`). Closing this generator early sets the worker's stop
        event, and the worker closes `task`'s generator after its current value (`spaces` does the same).

        Raises:
            WorkerError: the task raised, a value could not be pickled, or the worker died.
        """
        self.durations.append(float(duration(*args, **kwargs) if callable(duration) else duration))
        sent = pickle.dumps((args, kwargs))
        self.crossed.append(("args", len(sent), pickle.loads(sent)))
        worker = self._worker(task, visitor)
        worker.args.put((args, kwargs))
        ended = False
        try:
            while True:
                status, value = self._next(worker)
                if status == "end":
                    ended = True
                    return
                if status != "yield":
                    ended = True
                    raise WorkerError(value)
                self.crossed.append(("yield", len(pickle.dumps(value)), value))
                yield value
        finally:
            if not ended:  # the caller left: the worker stops the task, then its end still comes
                worker.stop.set()
                while self._next(worker)[0] not in ("end", "error"):
                    pass
            if self.policy == "kill":
                worker.process.kill()
                worker.process.join(10)
            self._done(worker)

    def close(self) -> None:
        """Stop and join every worker forked (killed where it does not end at once)."""
        for worker in self._all:
            if worker.process.is_alive():
                try:
                    worker.args.put(None)
                except OSError:
                    pass
        for worker in self._all:
            worker.process.join(5)
            if worker.process.is_alive():
                worker.process.kill()
                worker.process.join(5)
            worker.args.close()
            worker.results.close()
        self._pools.clear()

    def alive(self) -> list[int]:
        """The pids of the workers still running."""
        return [w.process.pid for w in self._all if w.process.is_alive()]

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
