"""The app's MCP tools: typed functions over the same `App` as the tabs (the per-session store, the per-cache
and server-wide KV budgets, the `model` and `compare` queue groups), registered with `gr.api` so that
`launch(mcp_server=True)` (app.py `--mcp`) serves them as MCP tools, each described by its docstring, with
typed parameters from its signature. Their results are JSON text.

Sessions. An MCP client reaches a tool through Gradio's loopback `gradio_client`, one client for the whole MCP
server, so every MCP call carries the same Gradio `session_hash`. A tool's `session` argument names the caller's
own session in `App.sessions` (key `mcp:<session>`), so that several MCP clients do not share a context; left
empty, the request's `session_hash` is the key (one session for every MCP client that gives none, and each
`gradio_client.Client` calling the endpoints directly gets its own).

Progress and leaving (`kvdemo.ui.mcp_calls`): each tool's `gr.Progress`, fed by its work's own callbacks about once a
second, reaches a client that gave a progress token; a tool whose client leaves stops after its current prefill
chunk or decode step, which frees its queue slot.

Example:
    >>> with gr.Blocks() as demo:
    ...     McpTools(app).register()
    >>> demo.queue().launch(mcp_server=True, prevent_thread_lock=True)
    >>> serve_only_tools(demo)  # the tabs' own endpoints stay API endpoints but are not MCP tools
    ['ask_question', 'compare_backends', 'prefill_context']
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Callable
from typing import Any

import gradio as gr

from kvdemo.cache.catalogue import defaults_for
from kvdemo.cache.spec import CacheSpec
from kvdemo.compare.candidates import ANY_ENGINE
from kvdemo.compare.recommend import DEFAULT_MAX_KL, check_target
from kvdemo.compare.recommendation import RecommendationCancelled
from kvdemo.compare.records import ComparisonCancelled, ComparisonReport, json_ready
from kvdemo.evals.cases import gold_answers_for
from kvdemo.qa.limits import DEFAULT_MAX_NEW_TOKENS
from kvdemo.serve.runs import AnswerRun
from kvdemo.serve.server import App
from kvdemo.serve.store import UserSession
from kvdemo.ui import views
from kvdemo.ui.ask_widgets import START_SPEC
from kvdemo.ui.inputs import compare_inputs, user_errors
from kvdemo.ui.mcp_calls import CALLS, ProgressRelay, after, hook

TOOLS = ("prefill_context", "ask_question", "compare_backends", "recommend_setting")
"""The MCP tools, by endpoint name (`api_name`). The needle grid's tool joins here (a method of `McpTools`
registered in `register`) when its tab lands."""

_SESSION_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


MCP_ANSWER_SECONDS = 30.0
"""The most seconds one `ask_question` call decodes: then the answer ends after its current decode step, as Stop
ends it (finish_reason "stopped", the cache restored, the queue slot freed). A bound, because not every way a
client gives up reaches the tool: a closed connection does (`kvdemo.ui.mcp_calls`), but Gradio serves streamable
HTTP statelessly, so a `notifications/cancelled` sent there comes in a request of its own that the MCP SDK cannot
match to the call (a client that gives up and keeps its connection open)."""

MCP_COMPARE_SECONDS = 300.0
"""The most seconds one `compare_backends` call runs: then it stops after the current prefill chunk or decode step,
as Cancel does, and returns the specs finished so far with a note (same reason as `MCP_ANSWER_SECONDS`)."""


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


class McpTools:
    """The MCP tools over the shared `App`; `register` adds them to the page being built.

    Every tool refuses bad input with a `gr.Error` whose message says what to change (nothing changes then):
    an empty context or question, a spec that does not parse or that the model cannot run, a context over the
    model's window or a cache over the KV budget (per cache, or server-wide: `ServerKVBudgetError`), a question
    before any prefill, a session name that is not 1-64 letters, digits, `_`, `.` or `-`, a second answer or
    comparison while one runs in the same session.

    Args:
        app: the server state the tabs share.
    """

    def __init__(self, app: App):
        self.app = app

    @staticmethod
    def key_of(session: str, request: gr.Request | None) -> str:
        """The `App.sessions` key of a call: `mcp:<session>`, or the request's `session_hash` when `session` is
        empty (`api` without a request).

        Raises:
            ValueError: `session` is not 1-64 letters, digits, `_`, `.` or `-`.
        """
        if not isinstance(session, str) or not session.strip():
            return request.session_hash if request is not None and request.session_hash else "api"
        if not _SESSION_NAME.fullmatch(session.strip()):
            raise ValueError(f"session={session[:40]!r} must be 1-64 letters, digits, '_', '.' or '-' (or empty)")
        return f"mcp:{session.strip()}"

    def _prefilled(self, key: str) -> UserSession:
        """The session of `key` with a prefilled cache, or a ValueError that says why there is none."""
        user = self.app.sessions.peek(key)
        if user is None or user.qa is None:
            reason = self.app.sessions.freed_reason(key)
            if reason:
                raise ValueError(f"This session was freed because {reason}; call prefill_context again")
            raise ValueError("Nothing is prefilled in this session: call prefill_context first (with the same session)")
        return user

    @user_errors
    def prefill_context(
        self, context: str, spec: str = START_SPEC.text, session: str = "", request: gr.Request | None = None
    ) -> str:
        """Prefill a text once into a new KV cache of the chosen backend, so that ask_question can answer
        questions about it; replaces this session's context. About 5 s per 1,000 tokens on 2 CPU cores with the
        embedded 135M model; progress every 256 tokens (at most a few seconds apart).

        Args:
            context: the text the questions will be about (plain text, up to the model's window less 128 tokens)
            spec: the KV cache, backend[:nbits][,option=value...]: dynamic, fp8, hqq:4,residual_length=16, quanto:2,
                ggml:q4_0 (llama.cpp's -ctk/-ctv q4_0), turboquant:4bit_nc (vLLM's turboquant_4bit_nc)
            session: your session's name (letters, digits, _ . -), the same for ask_question; empty: a shared one

        Returns:
            JSON: spec, context_tokens, prefill_seconds, kv_bytes, bytes_per_token, ratio_to_full_precision, model,
            prompt_note (why the prompt differs from the chat template's, or null), template_clock_note (the date a
            dated template writes for every question of this session, or null), deploy (the lines of the engines
            that store this cache byte for byte, e.g. "llama.cpp: llama-server -m MODEL.gguf -ctk q4_0 -ctv q4_0
            -fa on", kvdemo's last),
            decode_read (how decode steps attend to it: "Decode attention reads the stored codes in 30 layers")
        """
        if not isinstance(spec, str):
            raise ValueError("spec must be a text like hqq:4,residual_length=16")
        parsed = CacheSpec.parse(spec)
        key = self.key_of(session, request)
        loaded = self.app.wait_for_model()
        relay, stop = ProgressRelay(), threading.Event()
        with CALLS.watching(request, stop.set) as gone:

            def on_progress(done: int, total: int, what: str = "prefilling {:,} of {:,} tokens") -> None:
                relay(done, total, what.format(done, total))
                if gone() or stop.is_set():  # it left: stop before the next chunk
                    self.app.door.stop(key)

            on_quantize = lambda done, total: on_progress(done, total, "quantizing the cache: layer {} of {}")
            qa = self.app.door.prefill(key, parsed, context, on_progress=on_progress, on_quantize=on_quantize).session
        report = qa.prefill_report
        assert report is not None  # prefilled
        return _json(
            {
                "spec": qa.spec.text,
                "context_tokens": report.context_tokens,
                "prefill_seconds": round(report.seconds, 3),
                "kv_bytes": report.kv_bytes,
                "bytes_per_token": round(report.bytes_per_token, 1),
                "ratio_to_full_precision": round(report.ratio_to_full_precision, 4),
                "model": loaded.name,
                "prompt_note": report.prompt_note,
                "template_clock_note": report.clock_note,
                "deploy": list(report.deploy),
                "decode_read": report.decode_read,
            }
        )

    @user_errors
    def ask_question(
        self,
        question: str,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        session: str = "",
        request: gr.Request | None = None,
    ) -> str:
        """Answer a question about the text prefilled by prefill_context (greedy decoding); afterwards the KV
        cache is restored exactly to the prefilled context. About 6-13 tokens per second on 2 CPU cores with the
        embedded 135M model (fewer after a longer text); progress about every second. One call decodes for
        at most 30 seconds: a longer answer ends there (finish_reason "stopped", with a note); closing the
        connection stops it sooner.

        Args:
            question: the question about the prefilled text
            max_new_tokens: the most tokens the answer may have (>= 1; it also ends at the end-of-turn token)
            session: the session name given to prefill_context (empty: the shared one)

        Returns:
            JSON: question, answer, tokens, steps, flushes, seconds, tokens_per_second, first_token_seconds
            finish_reason, cache_length_after (equal to context_tokens: the cache was restored), spec
        """
        key = self.key_of(session, request)
        self._prefilled(key)
        busy = "An answer or a prefill is already running in this session; wait for it to end"
        with self.app.door.answer(key, question, max_new_tokens, busy) as run:
            user = self.app.sessions.peek(key)
            with CALLS.watching(request, user.interrupt if user is not None else run.session.request_stop):
                return self._answer(run)  # Stop, when the client leaves

    def _answer(self, run: AnswerRun) -> str:
        """`ask_question`'s answer as JSON, with the session's lock held (`Door.answer`)."""
        qa, max_new_tokens = run.session, run.question.max_new_tokens
        first_token, relay = None, ProgressRelay()
        bound = threading.Event()
        timer = after(MCP_ANSWER_SECONDS, bound, qa.request_stop)
        try:
            relay(0, max_new_tokens, "answering: the question's forward pass")
            for event in run:
                if first_token is None:
                    first_token = event.elapsed
                relay(event.step + 1, max_new_tokens, "answering: tokens decoded")
        except ValueError:
            raise
        except Exception as error:  # a fault inside a decode step: the session has restored the cache
            steps = qa.history[-1].steps if qa.history else 0
            raise ValueError(
                f"The answer failed after {steps} decode step(s) ({type(error).__name__}: {str(error)[:200]}). "
                "The cache was restored to the prefilled context; ask again"
            ) from None
        finally:
            timer.cancel()
            run.events.close()
        answer = run.answer
        timed_out = bound.is_set() and answer.finish_reason == "stopped"
        return _json(
            {
                "question": answer.question,
                "answer": answer.text,
                "tokens": len(answer.token_ids),
                "steps": answer.steps,
                "flushes": answer.flush_count,
                "seconds": round(answer.seconds, 3),
                "tokens_per_second": round(answer.tokens_per_second, 2),
                "first_token_seconds": None if first_token is None else round(first_token, 3),
                "finish_reason": answer.finish_reason,
                "cache_length_after": answer.cache_length_after,
                "context_tokens": views.prefilled_tokens(qa),
                "spec": qa.spec.text,
                "note": f"stopped at this tool's bound of {MCP_ANSWER_SECONDS:g} s per call; ask with a lower "
                "max_new_tokens, or again"
                if timed_out
                else "",
            }
        )

    @user_errors
    def compare_backends(
        self,
        questions: list[str],
        specs: list[str] | None = None,
        max_new_tokens: int = 32,
        context: str = "",
        session: str = "",
        request: gr.Request | None = None,
    ) -> str:
        """Compare KV cache backends on one text: each spec prefills it in a fresh cache and answers the
        questions; gives memory, agreement with dynamic (identical answers, KL divergence) and speed. About 10 s
        per spec and question at 32 tokens on 2 CPU cores with the embedded 135M model and a 775-token text (the
        default 6 specs, 2 questions: about 2 minutes), more with more tokens or a longer text. Progress about every
        second (per spec, prefill chunk, answer, 8 tokens), at most 10 s apart: let it reset your timeout. One
        comparison runs at a time on the server. One call runs for at most 300 seconds: it then returns the specs
        finished so far, with a note; closing the connection stops it within a second.

        Args:
            questions: the questions, asked in turn on the text (1-20)
            specs: the specs, e.g. ["hqq:4", "quanto:2", "fp8"]; dynamic is always included; empty: the default set
            max_new_tokens: the most tokens per answer (1-256)
            context: the text; empty: the text this session prefilled with prefill_context
            session: the session name given to prefill_context (empty: the shared one)

        Returns:
            JSON: context_tokens, max_new_tokens, scored_against_gold, note, results (one row per spec)
            each row: spec, KV bytes, bytes/token, ratio to dynamic, identical to dynamic, KL (nats), tokens/s, answers
        """
        key = self.key_of(session, request)
        if not isinstance(questions, list) or not questions or not all(isinstance(q, str) for q in questions):
            raise ValueError("questions must be a list of 1-20 question texts")
        if specs is not None and (not isinstance(specs, list) or not all(isinstance(s, str) for s in specs)):
            raise ValueError("specs must be a list of spec texts like hqq:4 (or empty for the default set)")
        loaded = self.app.wait_for_model()
        chosen = specs or [s.text for s in defaults_for(loaded.config)[0]]  # the defaults this model serves
        if any(not q.strip() for q in questions):
            raise ValueError("a question is empty; give the text of every question")
        questions_text = "\n".join(" ".join(q.split()) for q in questions)  # one line each, for compare_inputs
        parsed, questions, max_new_tokens = compare_inputs(chosen, None, questions_text, max_new_tokens)
        context = self._text_of(key, context)
        busy = "A comparison is already running in this session; wait for it to end"
        with self.app.door.long_job(key, busy) as job:
            golds = gold_answers_for(context, questions)
            with CALLS.watching(request, job.cancel.set) as gone:
                work = functools.partial(job.compare, context, questions, parsed, max_new_tokens, golds)
                relay = ProgressRelay()
                report, note = self._bounded_compare(work, job.cancel, gone, relay)
                relay.settle()  # its last unit told before the result
            rows = json_ready(report.to_frame().to_dict(orient="records"), nan=None)
            for row, result in zip(rows, report.results):
                row["answers"] = [q.answer for q in result.questions]
            return _json(
                {
                    "context_tokens": report.results[0].context_tokens if report.results else None,
                    "max_new_tokens": max_new_tokens,
                    "scored_against_gold": golds is not None,
                    "note": note,
                    "results": rows,
                }
            )

    @user_errors
    def recommend_setting(
        self,
        context: str = "",
        questions: list[str] | None = None,
        max_kl: float = DEFAULT_MAX_KL,
        engine: str = ANY_ENGINE,
        session: str = "",
        request: gr.Request | None = None,
    ) -> str:
        """Which KV cache setting for the loaded model on this text: every candidate spec measured against dynamic
        (teacher-forced KL on dynamic's answers, same top token, held-out perplexity, bytes per token), and the one
        with the fewest bytes within the KL ceiling, with the line that deploys it. About a minute on 2 CPU cores
        with the embedded model and a 1,500-token text. Progress about every second. At most 300 s per call: it then
        returns what was measured, with no pick and a note.

        Args:
            context: the text; empty: the text this session prefilled with prefill_context
            questions: asked on the text (empty: questions taken from the text itself)
            max_kl: the ceiling on the mean KL to dynamic, nats per token (default 0.02)
            engine: any, llama.cpp, vllm, transformers, mlx or kvdemo: only specs that engine stores the same way
            session: the session name given to prefill_context (empty: the shared one)

        Returns:
            JSON: pick, why, deploy (the lines), finished, note, and rows (every candidate: spec, bytes_per_token,
            mean_kl, kl_at_least, positions, same_top_p, p99_kl, p999_kl, rms_dp, question_kl, held_out_kl,
            perplexity_ratio, measured: full or bound, deploy, note)
        """
        key = self.key_of(session, request)
        if questions is not None and (
            not isinstance(questions, list) or not all(isinstance(q, str) for q in questions)
        ):
            raise ValueError("questions must be a list of question texts (or empty to take them from the text)")
        check_target(max_kl, None)
        context = self._text_of(key, context)
        with self.app.door.long_job(key, "A long job is already running in this session; wait for it to end") as job:
            with CALLS.watching(request, job.cancel.set) as gone:
                relay, bound = ProgressRelay(), threading.Event()
                timer = after(MCP_COMPARE_SECONDS, bound, job.cancel.set)
                try:
                    found = job.recommend(context, questions or (), max_kl=max_kl, engine=engine, on_progress=relay)
                    note = ""
                except RecommendationCancelled as stopped:
                    found = stopped.recommendation
                    why = gone() or f"this tool's bound of {MCP_COMPARE_SECONDS:g} s"
                    note = f"stopped ({why}); the rows measured so far follow, with no pick"
                finally:
                    timer.cancel()
                relay.settle()
        picked = found.picked
        return _json({"pick": found.pick, "why": found.why, "deploy": list(picked.deploy) if picked else [],
                      "finished": found.finished, "note": note, **json_ready(found.to_dict(), nan=None)})  # fmt: skip

    def _text_of(self, key: str, context: str) -> str:
        """`context`, or where it is empty the text the session of `key` prefilled (`gr.Error` where none is)."""
        if isinstance(context, str) and context.strip():
            return context
        qa = self._prefilled(key).qa
        assert qa is not None and qa.context is not None  # `_prefilled` checked it
        return qa.context

    def _bounded_compare(
        self,
        work: Callable[..., ComparisonReport],
        cancel: threading.Event,
        gone: Callable[[], str | None],
        relay: ProgressRelay,
    ) -> tuple[ComparisonReport, str]:
        """`compare_backends`' run of `work`, the door's `LongJob.compare` given the context, the questions, the
        specs, max_new_tokens and the gold answers, stopped by `cancel` (the job's), which `MCP_COMPARE_SECONDS` sets,
        and which the call's MCP client sets when it leaves (`gone()` says why); its progress to `relay`. Returns the
        report (the specs finished, when stopped) and a note saying why it stopped ("" when it did not).

        Raises:
            ValueError, ImportError: bad input, or a fault inside a decode step (every session it used restored).
        """
        bound = threading.Event()
        timer = after(MCP_COMPARE_SECONDS, bound, cancel.set)
        try:
            return work(on_progress=relay), ""
        except ComparisonCancelled as cancelled:  # the bound passed, the client left, or the session was freed
            if gone() is not None:
                return cancelled.report, f"stopped: the MCP client left ({gone()}); the finished specs follow"
            if bound.is_set():
                return cancelled.report, (
                    f"stopped at this tool's bound of {MCP_COMPARE_SECONDS:g} s per call; the finished specs follow "
                    "(compare fewer specs or questions per call)"
                )
            return cancelled.report, "cancelled: the session was freed; the finished specs follow"
        except (ValueError, ImportError):
            raise
        except Exception as error:  # a fault inside a decode step: every session it used has restored
            raise ValueError(f"The comparison failed ({type(error).__name__}: {str(error)[:200]})") from None
        finally:
            timer.cancel()

    def register(self) -> None:
        """Add the tools to the `gr.Blocks` being built, as API endpoints named `TOOLS`: prefill and ask in the
        tabs' `model` queue group (`--concurrency` at once across users), compare in their `compare` group (one
        at a time)."""
        gr.api(self.prefill_context, api_name="prefill_context", concurrency_id="model")
        gr.api(self.ask_question, api_name="ask_question", concurrency_id="model")
        gr.api(self.compare_backends, api_name="compare_backends", concurrency_limit=1, concurrency_id="compare")
        gr.api(self.recommend_setting, api_name="recommend_setting", concurrency_limit=1, concurrency_id="compare")
        # the needle grid's tool: a typed method here (its KV bytes held by the door's `LongJob.needle`),
        # registered on the next line, and its name added to TOOLS


def serve_only_tools(demo: gr.Blocks) -> list[str]:
    """After `demo.launch(mcp_server=True, ...)`: make `TOOLS` the MCP server's only tools, and hook its bridge so
    that a tool stops when its caller leaves (`kvdemo.ui.mcp_calls.hook`). Gradio makes every public endpoint a
    tool; the tabs' endpoints return page updates (charts, chat) and stay what they are, API endpoints for
    `gradio_client`, but are no MCP tools. Returns the tool names served (a Space prefixes them with its name).

    Raises:
        RuntimeError: the MCP server did not start (Gradio's message, e.g. the `mcp` package is missing), or its
            bridge is not Gradio 6.31's (`hook`).
    """
    server = getattr(demo, "mcp_server_obj", None)
    if server is None:
        raise RuntimeError(
            getattr(demo, "mcp_error", None)
            or "the MCP server is not running; launch with mcp_server=True (pip install 'gradio[mcp]')"
        )
    hook(server)  # each call's tool hears when its client leaves
    endpoints = {f"/{name}" for name in TOOLS}
    server.tool_to_endpoint = {tool: ep for tool, ep in server.tool_to_endpoint.items() if ep in endpoints}
    return sorted(server.tool_to_endpoint)
