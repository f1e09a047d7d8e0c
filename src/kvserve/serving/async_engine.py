"""AsyncEngine: one `LLMEngine` stepped by a dedicated thread, streamed to asyncio callers.

The engine is not thread-safe, so exactly one thread (the engine thread) ever calls it; `spawn` also
builds it there, so one thread runs all of its OpenMP work (see `spawn`). Everything
else talks to that thread through an inbox of commands (submit, abort, call) that it drains before
each step; results travel back through per-request `asyncio.Queue`s fed with
`loop.call_soon_threadsafe`, so the event loop stays free while the engine computes. When there is
no work the engine thread sleeps on a condition variable instead of spinning.

    engine = AsyncEngine(LLMEngine(config)); engine.start()
    async for output in engine.generate(prompt, params, "req-1", namespace=()):
        print(output.delta_text, end="")
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.engine.request import RequestOutput
from kvserve.lora.adapter import LoRAAdapter
from kvserve.prefix.namespace import Namespace
from kvserve.serving.crossing import call_soon, put_all, settle, snapshot
from kvserve.serving.streams import EngineDeadError, RequestFailedError, RequestGroup

__all__ = ["AsyncEngine", "EngineDeadError", "EngineInfo", "RequestFailedError", "RequestGroup", "RequestSpec"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
ENGINE_DIED = "engine thread died after an internal error"


@dataclass(slots=True)
class RequestSpec:
    """One engine request to submit: a prompt (text or token ids) and how to sample it (n / best_of
    samples: one parallel request) or beam-search it."""

    prompt: str | list[int]
    params: SamplingParams | BeamSearchParams
    request_id: str
    namespace: Namespace = ()
    lora: LoRAAdapter | None = None  # the adapter the request runs under (None: the base model)
    priority: int = 0  # lower first, under --schedule-policy priority (else only 0)
    probe_remote: bool = True  # False: admission skips asking the shared store (engine/kv_tiers.py)
    background: bool = False  # only while nothing else waits or runs (engine/background.py)


@dataclass(slots=True)
class EngineInfo:
    """Immutable facts about the engine, safe to read from any thread."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int


@dataclass(slots=True)
class _Sink:
    """Where the outputs of one engine request go: a group's queue, tagged with its index."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int


@dataclass(slots=True)
class _Command:
    run: Callable[[], Any]
    future: Future | None = None
    num_submissions: int = 0  # requests this command adds (counted as waiting until it runs)


class AsyncEngine:
    """Runs an `LLMEngine` on its own thread; async methods are called from one event loop or more."""

    def __init__(self, engine: LLMEngine, on_death: Callable[[BaseException], None] | None = None) -> None:
        """Take ownership of `engine`: after `start()` only the engine thread touches it.

        `on_death(exc)` is called (on the engine thread) if the engine loop crashes: a server uses it to
        exit non-zero, so a supervisor restarts it, instead of living on unable to serve."""
        self._engine = engine
        self._on_death = on_death
        self.tokenizer = engine.tokenizer  # immutable after load; encode/decode are thread-safe
        self.info = EngineInfo(
            model_name=engine.model_name, max_model_len=engine.max_model_len,
            vocab_size=engine.model_config.vocab_size, num_blocks=engine.block_manager.num_blocks,
            block_size=engine.block_manager.block_size,
        )
        self._cond = threading.Condition()
        self._inbox: deque[_Command] = deque()
        self._num_unadmitted = 0  # submissions still in the inbox (guarded by _cond)
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._outbox: list[RequestOutput] = []  # engine thread only: outputs not yet delivered
        self._stats: dict[str, float | int] = dict(engine.stats())
        self._stop_mode: str | None = None  # None | "drain" | "abort"
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)

    @classmethod
    def spawn(cls, build: Callable[[], LLMEngine], name: str = "kvserve-engine") -> AsyncEngine:
        """Build the engine with `build()` on a new thread and step it there; returns once it is built
        (re-raising what `build` raised).

        Why not `AsyncEngine(engine)`: OpenMP (torch's libgomp, shared by the native kernels) keeps its
        workers spinning between parallel regions only while the threads it manages number no more than
        the CPUs. A model loaded on one thread and stepped on another gives libgomp two teams, and on a
        small machine (2 cores) that tips it over: from then on every region's workers sleep between
        regions and each region pays their wake-up (a 7-row decode step 37 ms instead of 18). One thread
        for all of the engine's parallel work keeps one team."""
        built: Future = Future()

        def run() -> None:
            try:
                engine = cls(build())
            except BaseException as exc:  # noqa: BLE001 - the caller re-raises it
                built.set_exception(exc)
                return
            engine._thread = threading.current_thread()  # this thread steps it: start() has nothing to do
            built.set_result(engine)
            engine._run()

        threading.Thread(target=run, name=name, daemon=True).start()
        return built.result()

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._cond:
            if not self._thread.is_alive() and self._stop_mode is None and self._error is None:
                self._thread.start()

    @property
    def is_alive(self) -> bool:
        """True while the engine loop runs and accepts work (False once stopping or crashed)."""
        return self._thread.is_alive() and self._error is None and self._stop_mode is None

    @property
    def error(self) -> BaseException | None:
        """The exception that killed the engine thread, if any."""
        return self._error

    def stop(self, drain: bool = False) -> None:
        """Stop accepting work and finish (`drain`) or abort what is in flight; returns at once.

        Aborted requests end their streams with finish_reason "abort". Stopping is one-way.
        """
        with self._cond:
            if self._stop_mode != "abort":
                self._stop_mode = "drain" if drain else "abort"
            self._cond.notify_all()

    def shutdown(self, drain: bool = False, timeout: float | None = 30.0) -> None:
        """`stop(drain)`, then wait for the engine thread to end.

        Blocking: call it from a worker thread (e.g. `asyncio.to_thread`) inside an event loop.
        """
        self.stop(drain)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # --- requests ------------------------------------------------------------------------------------

    async def add_requests(self, specs: Sequence[RequestSpec]) -> RequestGroup:
        """Validate and queue a group of requests atomically; raises ValueError naming the problem.

        Either every request of the group is queued or none is (validation happens first, on the
        engine thread, because `make_request` reads engine state).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sinks = [_Sink(loop, queue, index) for index in range(len(specs))]
        future = self._post(lambda: self._submit(specs, sinks), num_submissions=len(specs))
        try:
            await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # The caller went away while we waited: whatever got queued must not run unobserved.
            self.abort([spec.request_id for spec in specs])
            raise
        return RequestGroup(self.abort, [spec.request_id for spec in specs], queue)

    async def generate(
        self, prompt_or_ids: str | list[int], params: SamplingParams, request_id: str,
        namespace: Namespace = (),
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; closing the iterator early aborts the request."""
        group = await self.add_requests([RequestSpec(prompt_or_ids, params, request_id, namespace)])
        async with group:
            async for _, output in group:
                yield output

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests by id (unknown or finished ids are ignored); never blocks."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        try:
            self._post(lambda: self._abort(ids))
        except EngineDeadError:
            pass  # nothing runs any more, so nothing is left to abort

    async def reset_prefix_cache(self, tiers: bool = False) -> bool:
        """Drop every cached block (with `tiers`, the host and disk tiers' too); False while blocks are in use."""
        return await self.call(lambda engine: engine.reset_prefix_cache(tiers))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        return await asyncio.wrap_future(self._post(lambda: fn(self._engine)))

    # --- thread-safe snapshots -----------------------------------------------------------------------

    def stats(self) -> dict[str, float | int]:
        """The engine's `stats()` as of the last step or command (a copy; never blocks), with
        `num_waiting` counting accepted submissions too: a caller holding its response headers sees
        its request waiting even while the step that will publish the scheduler's count still runs."""
        with self._cond:
            stats = dict(self._stats)
            stats["num_waiting"] = self._waiting_locked()
        return stats

    @property
    def num_waiting(self) -> int:
        """Requests queued but not running: the scheduler's waiting queue plus unprocessed submissions."""
        with self._cond:
            return self._waiting_locked()

    def _waiting_locked(self) -> int:  # caller holds _cond
        return int(self._stats["num_waiting"]) + self._num_unadmitted

    @property
    def num_running(self) -> int:
        return int(self._stats["num_running"])

    @property
    def num_background(self) -> int:
        """Background requests (a router's idle copies) queued or running; not in the two counts above."""
        return int(self._stats.get("num_background", 0))

    # --- crossing into the engine thread -----------------------------------------------------------

    def _post(self, run: Callable[[], Any], num_submissions: int = 0) -> Future:
        future: Future = Future()
        with self._cond:
            if self._error is not None:
                raise EngineDeadError(ENGINE_DIED)  # the details are in the log, not for callers
            if self._stop_mode is not None:
                raise EngineDeadError("engine is shutting down")
            self._inbox.append(_Command(run, future, num_submissions))
            self._num_unadmitted += num_submissions
            self._cond.notify()
        return future

    # --- the engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._run_once():
                pass
        except BaseException as exc:  # noqa: BLE001 - any crash must reach every waiting caller
            logger.exception("engine thread crashed")
            self._fail_everything(exc)
            return
        self._abort_everything()

    def set_death_callback(self, on_death: Callable[[BaseException], None]) -> None:
        """Install `on_death` (see `__init__`); called at once if the engine has already died."""
        self._on_death = on_death
        if self._error is not None:
            self._report_death(self._error)

    def _report_death(self, exc: BaseException) -> None:
        if self._on_death is None:
            return
        try:
            self._on_death(exc)
        except Exception:  # noqa: BLE001 - the callback's failure must not hide the crash
            logger.exception("engine death callback failed")

    def _run_once(self) -> bool:
        """Drain the inbox, then step once if there is work; False when the loop should end."""
        commands, stop_mode = self._wait_for_work()
        num_submitted = self._run_commands(commands)
        busy = self._engine.has_unfinished_requests()
        stopping = stop_mode == "abort" or (stop_mode == "drain" and not busy)
        if busy and not stopping:
            self._outbox.extend(self._engine.step())
        # Stats first, outputs second: whoever reacts to an output sees stats at least that fresh.
        self._refresh_stats(num_submitted)
        self._flush_outbox()
        return not stopping

    def _wait_for_work(self) -> tuple[list[_Command], str | None]:
        with self._cond:
            while not self._inbox and self._stop_mode is None and not self._engine.has_unfinished_requests():
                self._cond.wait()  # notified by _post and stop
            commands = list(self._inbox)
            self._inbox.clear()
            return commands, self._stop_mode

    def _run_commands(self, commands: list[_Command]) -> int:
        for command in commands:
            try:
                result = command.run()
            except Exception as exc:  # noqa: BLE001 - a bad request is the caller's error, not ours
                settle(command.future, error=exc)
            else:
                settle(command.future, result=result)
        return sum(command.num_submissions for command in commands)

    def _refresh_stats(self, num_admitted: int = 0) -> None:
        stats = dict(self._engine.stats())
        with self._cond:
            # Publish the new waiting count and drop the inbox count together, so num_waiting never dips.
            self._stats = stats
            self._num_unadmitted -= num_admitted

    def _submit(self, specs: Sequence[RequestSpec], sinks: list[_Sink]) -> None:
        if len({spec.request_id for spec in specs}) != len(specs):
            raise ValueError("request ids within a group must be unique")
        requests = [
            self._engine.make_request(spec.prompt, spec.params, request_id=spec.request_id,
                                      namespace=spec.namespace, lora=spec.lora, priority=spec.priority)
            for spec in specs
        ]  # all validated before any is queued
        for request, spec, sink in zip(requests, specs, sinks, strict=True):
            request.probe_remote = spec.probe_remote
            request.background = spec.background
            self._sinks[request.request_id] = sink
            self._engine.add(request)

    def _abort(self, request_ids: list[str]) -> None:
        outputs = [self._engine.abort_request(request_id) for request_id in request_ids]
        self._outbox.extend(output for output in outputs if output is not None)

    def _flush_outbox(self) -> None:
        """Hand outputs to their queues: one thread-safe callback per event loop per step."""
        outputs, self._outbox = self._outbox, []
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for output in outputs:
            request_id = output.request_id
            sink = self._sinks.pop(request_id) if output.finished else self._sinks.get(request_id)
            if sink is None:
                continue
            item = (sink.index, snapshot(output)) if output.error is None else (
                RequestFailedError(output.error, request_id, output.error_is_request_fault))
            batches.setdefault(sink.loop, []).append((sink.queue, item))
        for loop, batch in batches.items():
            call_soon(loop, put_all, batch)

    def _abort_everything(self) -> None:
        """At shutdown: abort whatever is still queued or running so every stream ends."""
        self._fail_commands(EngineDeadError("engine is shutting down"))
        self._abort(list(self._sinks))
        self._refresh_stats()
        self._flush_outbox()

    def _fail_everything(self, exc: BaseException) -> None:
        with self._cond:
            self._error = exc
        self._report_death(exc)  # first: whoever sees a failed stream may already find the server stopping
        error = EngineDeadError(ENGINE_DIED)
        self._fail_commands(error)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = {}
        for sink in self._sinks.values():
            batches.setdefault(sink.loop, []).append((sink.queue, error))
        self._sinks.clear()
        for loop, batch in batches.items():
            call_soon(loop, put_all, batch)

    def _fail_commands(self, error: BaseException) -> None:
        with self._cond:
            commands = list(self._inbox)
            self._inbox.clear()
            self._num_unadmitted = 0
        for command in commands:
            settle(command.future, error=error)
