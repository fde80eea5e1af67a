"""The load test's clients (`tests/e2e/test_load.py`), in a process of their own so that the app's resident memory
is measured without them: `CLIENTS` `gradio_client` clients on one app, each on a thread, each prefilling, asking,
stopping, re-prefilling or disconnecting mid-answer, trying again after each refusal meant for users (the queue is
full; the server's KV budget is full) until a deadline. Prints what they did as JSON.

Example:
    python -m tests.e2e.load_clients http://127.0.0.1:7860/
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
import traceback

from gradio_client import Client
from gradio_client.utils import Status

from kvdemo.evals.cases import example_path, load_case

CLIENTS = 16
LONG_ANSWER = 150  # tokens: a context (at most 300 here) with it fits the small model's 512-token window
DEADLINE_SECONDS = 420
SPECS = [
    "dynamic",
    "hqq:4,residual_length=8",
    "quanto:4,residual_length=8",
    "fp8",
    "hqq:2,residual_length=16",
    "quanto:2,residual_length=4",
    "dynamic",
    "hqq:8,residual_length=4",
]
REFUSALS = {"queue": "Queue is full", "kv": "The server's KV budget is full"}


def contexts_and_questions() -> tuple[list[str], list[str]]:
    """Paragraphs 0-7 of the Normans article, one per context, and twelve of its questions."""
    normans = load_case(example_path("normans"))
    contexts = [normans.select(str(p)).context for p in range(8)]
    return contexts, [q.question for q in normans.select("0-7").answerable(12)]


class Run:
    """What the clients did, shared across their threads."""

    def __init__(self, url: str):
        self.url = url
        self.lock = threading.Lock()
        self.requests = 0
        self.refusals = {kind: 0 for kind in REFUSALS}
        self.refusal_texts: set[str] = set()
        self.answers: list[dict] = []  # context, spec, question, max_new_tokens, the answer's JSON
        self.first_token: list[float] = []  # seconds from the request to the first token, queue wait included
        self.stops: list[str] = []
        self.disconnects = 0
        self.failures: list[str] = []
        self.deadline = time.perf_counter() + DEADLINE_SECONDS

    def to_dict(self) -> dict:
        return {
            name: getattr(self, name)
            for name in ("requests", "refusals", "answers", "first_token", "stops", "disconnects", "failures")
        } | {"refusal_texts": sorted(self.refusal_texts)}

    def count(self, **changes) -> None:
        with self.lock:
            for name, value in changes.items():
                setattr(self, name, getattr(self, name) + value)

    def refused(self, error: Exception) -> bool:
        """Count `error` when it is a refusal meant for the user (then the client waits and tries again)."""
        for kind, text in REFUSALS.items():
            if text in str(error):
                with self.lock:
                    self.refusals[kind] += 1
                    self.refusal_texts.add(str(error)[:160])
                return True
        return False

    def call(self, client: Client, api: str, *args):
        """`client.predict`, tried again after each refusal until the run's deadline."""
        while True:
            self.count(requests=1)
            start = time.perf_counter()
            try:
                return client.predict(*args, api_name=api), time.perf_counter() - start
            except Exception as error:
                if not self.refused(error) or time.perf_counter() > self.deadline:
                    raise
            time.sleep(random.uniform(0.5, 1.5))  # a user trying again a moment later

    def ask(self, client: Client, context: str, spec: str, question: str, max_new_tokens: int) -> dict:
        out, latency = self.call(client, "/ask_question", question, max_new_tokens, "")
        answer = json.loads(out)
        if answer["first_token_seconds"] is not None:
            queue_and_first = latency - (answer["seconds"] - answer["first_token_seconds"])
            with self.lock:
                self.first_token.append(queue_and_first)
        with self.lock:
            self.answers.append(
                {
                    "context": context,
                    "spec": spec,
                    "question": question,
                    "max_new_tokens": max_new_tokens,
                    "answer": answer,
                }
            )
        return answer

    def long_answer(self, client: Client, question: str):
        """A long answer submitted and running (not waiting in the queue), or None at the deadline."""
        while time.perf_counter() < self.deadline:
            self.count(requests=1)
            job = client.submit(question, LONG_ANSWER, "", api_name="/ask_question")
            # running: PROCESSING, or PROGRESS once the tool reports its decode steps (`kvdemo.ui.mcp_calls`)
            while not job.done() and job.status().code not in (Status.PROCESSING, Status.PROGRESS):
                time.sleep(0.02)
            if not job.done():
                return job
            try:
                job.result()
                return job  # finished before we could stop it: as good as stopped late
            except Exception as error:
                if not self.refused(error):
                    raise
            time.sleep(random.uniform(0.5, 1.5))
        return None

    def stop_long_answer(self, client: Client, question: str) -> None:
        """A long answer stopped mid-way with the Stop button's event, pressed again every 0.3 s until the answer
        ends (as a user would: the tool's call reports PROCESSING before its handler has begun, and a Stop that
        comes before the handler is for no answer yet). Tried again until the deadline when the answer itself
        was refused (the refusal may come only from `job.result()`) or ended before a Stop landed."""
        while True:
            job = self.long_answer(client, question)
            if job is None:
                return
            while not job.done():
                time.sleep(0.3)
                self.call(client, "/stop")  # a full queue turns gradio_client's Stop away too (the browser's is not)
            try:
                stopped = json.loads(job.result())
            except Exception as error:
                if not self.refused(error) or time.perf_counter() > self.deadline:
                    raise
                time.sleep(random.uniform(0.5, 1.5))
                continue
            with self.lock:
                self.stops.append(stopped["finish_reason"])
            assert stopped["cache_length_after"] == stopped["context_tokens"]
            if stopped["finish_reason"] == "stopped" or time.perf_counter() > self.deadline:
                return


def _client(run: Run, i: int, contexts: list[str], questions: list[str]) -> None:
    try:
        client = Client(run.url, verbose=False, httpx_kwargs={"timeout": 120})  # a loaded machine is slow
        context, spec = contexts[i % len(contexts)], SPECS[i % len(SPECS)]
        run.call(client, "/prefill_context", context, spec, "")
        run.ask(client, context, spec, questions[i % len(questions)], 8)
        kind = i % 4
        if kind == 0:  # another question
            run.ask(client, context, spec, questions[(i + 1) % len(questions)], 12)
        elif kind == 1:  # Stop mid-answer, then ask again
            run.stop_long_answer(client, "Tell me everything about it, in detail.")
            run.ask(client, context, spec, questions[(i + 2) % len(questions)], 8)
        elif kind == 2:  # disconnect mid-answer: the client goes away, the session is swept once idle
            job = run.long_answer(client, "Tell me everything about it, in detail.")
            if job is not None:
                job.cancel()
            run.count(disconnects=1)
        else:  # a new prefill with another backend replaces the cache
            spec = SPECS[(i + 3) % len(SPECS)]
            run.call(client, "/prefill_context", context, spec, "")
            run.ask(client, context, spec, questions[i % len(questions)], 8)
        client.close()  # the client leaves: its heartbeat ends and the app frees its session (demo.unload)
    except Exception as error:  # recorded, so that the test shows which client failed and why
        with run.lock:
            where = traceback.extract_tb(error.__traceback__)[1:2]
            run.failures.append(f"client {i}: {type(error).__name__}: {str(error)[:300]} at {where}")


def run_clients(url: str) -> Run:
    """`CLIENTS` clients at once until each is done (or the deadline)."""
    run = Run(url)
    contexts, questions = contexts_and_questions()
    threads = [threading.Thread(target=_client, args=(run, i, contexts, questions)) for i in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(run.deadline - time.perf_counter(), 1) + 60)
    if any(thread.is_alive() for thread in threads):
        run.failures.append("a client did not finish within the deadline")
    return run


if __name__ == "__main__":
    start = time.perf_counter()
    result = run_clients(sys.argv[1]).to_dict()
    print(json.dumps(result | {"wall_seconds": time.perf_counter() - start}))
