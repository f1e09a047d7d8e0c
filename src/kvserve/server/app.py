"""The FastAPI app factory and `run_server`, the production entry point behind `kvserve serve`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.middleware.cors import CORSMiddleware

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.step_trace import StepTrace
from kvserve.events.engine_hook import attach_kv_events, attach_tier_events
from kvserve.events.format import AllBlocksCleared
from kvserve.events.publisher import KVEventPublisher
from kvserve.lora.adapter import LoRAAdapter
from kvserve.openmp import serial_thread
from kvserve.replay.request_log import RequestLog
from kvserve.server import admin_routes, extra_routes, lora_routes, openai_routes
from kvserve.server.auth import ApiKeys, add_operator_keys, load_api_keys
from kvserve.server.dashboard import dashboard_enabled
from kvserve.server.dashboard import install as install_dashboard
from kvserve.server.errors import install_error_handlers
from kvserve.server.frontdoor import guarded_protocol
from kvserve.server.heap import fix_mmap_threshold, freeze_startup_objects, periodic_trim
from kvserve.server.limits import ServerLimits
from kvserve.server.metrics import ServerMetrics
from kvserve.server.options import DEFAULT_MAX_QUEUE, GRACEFUL_SHUTDOWN_S, ServerOptions
from kvserve.server.responses import TokenTexts
from kvserve.server.responses_api import routes as responses_routes
from kvserve.server.responses_api.store import ResponseStoreCollector
from kvserve.server.roles import RoleInfo, remote_offload
from kvserve.server.state import Caller, ReplicaInfo, ServerState
from kvserve.server.stats_log import StatsLogger, periodic_stats
from kvserve.serving.async_engine import AsyncEngine

logger = logging.getLogger("uvicorn.error")  # shows up alongside uvicorn's own lines
__all__ = ["DEFAULT_MAX_QUEUE", "GRACEFUL_SHUTDOWN_S", "build_app", "run_server"]


def build_app(
    async_engine: AsyncEngine, served_model_name: str, api_keys: ApiKeys | None, max_queue: int,
    options: ServerOptions | None = None, limits: ServerLimits | None = None, dashboard: bool = False,
    replica: ReplicaInfo | None = None,
    lora_adapters: dict[str, LoRAAdapter] | None = None,
) -> FastAPI:
    """An app serving `async_engine`; its lifespan starts the engine thread and shuts it down.

    `api_keys` None is single-tenant mode (no auth; `cache_salt` alone picks the namespace).
    More than `max_queue` requests that cannot start now are refused with 429. `options` adds vLLM's server
    conventions (served names, CORS, the periodic stats line). `dashboard`: serve /dashboard.
    """
    if max_queue < 1:
        raise ValueError(f"max_queue must be >= 1, got {max_queue}")
    options = options or ServerOptions()
    names = options.model_names(served_model_name)
    metrics = ServerMetrics(async_engine.stats, names[0], async_engine.info.max_model_len)
    stats_logger = StatsLogger(metrics.totals, async_engine.stats, logger)
    limits = limits or ServerLimits()
    workers = ThreadPoolExecutor(limits.input_workers, thread_name_prefix="kvserve-inputs", initializer=serial_thread)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        # asyncio.to_thread's threads (dashboard, heap trims, hand-offs) stay off OpenMP too (openmp.py).
        asyncio.get_running_loop().set_default_executor(
            ThreadPoolExecutor(thread_name_prefix="kvserve-aux", initializer=serial_thread))
        try:
            heap_log = bool(os.environ.get("KVSERVE_HEAP_LOG"))  # one heap-statistics line per trim
            async with periodic_stats(stats_logger, options.stats_log_interval), periodic_trim(log=heap_log):
                yield
        finally:
            # In-flight handlers were finished or cancelled (and aborted) by uvicorn's graceful shutdown.
            await asyncio.to_thread(async_engine.shutdown, False)
            workers.shutdown(wait=False, cancel_futures=True)

    public_docs = limits.docs and api_keys is None
    app = FastAPI(title="kvserve", summary="OpenAI-compatible LLM server", lifespan=lifespan,
                  **({} if public_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.server = ServerState(
        engine=async_engine, model_name=names[0], api_keys=api_keys, max_queue=max_queue,
        metrics=metrics, token_texts=TokenTexts(async_engine.tokenizer), served_model_names=names,
        limits=limits, workers=workers, replica=replica or ReplicaInfo(), lora_adapters=dict(lora_adapters or {}),
    )
    metrics.registry.register(ResponseStoreCollector(app.state.server.response_store, names[0]))
    install_error_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(extra_routes.router)
    app.include_router(lora_routes.router)
    app.include_router(responses_routes.router)
    _add_cors(app, options.allowed_origins)
    install_dashboard(app, app.state.server, enabled=dashboard)
    if limits.docs and api_keys is not None:
        _add_keyed_docs(app)
    return app


def _add_cors(app: FastAPI, origins: tuple[str, ...]) -> None:
    """Browser access from `origins` (vLLM allows any origin by default; kvserve none unless asked)."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)


def _add_keyed_docs(app: FastAPI) -> None:
    """/openapi.json and /docs for callers with a valid key (the schema lists every route and field)."""

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(_: Caller) -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False)
    async def docs(_: Caller) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="kvserve - docs")


def run_server(
    config: EngineConfig, host: str, port: int, api_keys_path: str | None, max_queue: int,
    shutdown_timeout: float = GRACEFUL_SHUTDOWN_S, options: ServerOptions | None = None,
    limits: ServerLimits | None = None, kv_events_endpoint: str | None = None,
    kv_events_replay_endpoint: str | None = None, request_log: str | None = None,
) -> None:
    """Load the model and serve until SIGTERM/SIGINT; then stop accepting, let in-flight requests
    finish for up to `shutdown_timeout` seconds, abort the rest, and return (exit status 0). If the
    engine loop dies, shut down the same way and exit with status 1.

    With `kv_events_endpoint`, KV events are published there (vLLM's format; the first batch is an
    AllBlocksCleared: a fresh process holds nothing). With `request_log`, one Mooncake-format line per
    finished request is appended there (`kvserve replay` reads it)."""
    options = options or ServerOptions()
    _configure_logging(options.log_level)
    fix_mmap_threshold()  # 256 KiB unless KVSERVE_MMAP_THRESHOLD says otherwise (heap.py); before the model
    # Keys fail before the slow model load.
    api_keys = add_operator_keys(load_api_keys(api_keys_path) if api_keys_path else None, options.api_keys)
    limits = limits or ServerLimits(max_num_seqs=config.max_num_seqs)
    publisher = (KVEventPublisher(kv_events_endpoint, kv_events_replay_endpoint)
                 if kv_events_endpoint else None)
    adapters: dict[str, LoRAAdapter] = {}
    offload: list[Any] = []  # the engine's remote tier policy, for a prefill worker's role (or None)
    tier_blocks: list[int] = []  # how many blocks its host and disk tiers hold at most (`/load`)

    def build() -> LLMEngine:  # on the engine's thread, which then steps it (AsyncEngine.spawn says why)
        llm_engine = LLMEngine(config)
        policy = llm_engine.tiers.policy if llm_engine.tiers is not None else None
        if publisher is not None:
            publisher.publish([AllBlocksCleared()])
            attach_kv_events(llm_engine.block_manager, publisher)
            if policy is not None:
                attach_tier_events(policy, publisher, config.block_size)
        tier_blocks.append(policy.local_capacity_blocks() if policy is not None else 0)
        _attach_step_trace(llm_engine)
        if request_log:
            llm_engine.finish_listeners.append(RequestLog(request_log, config.block_size, config.prefix_hash))
        adapters.update((name, llm_engine.load_lora(name, path)) for name, path in options.lora_modules)
        offload.append(remote_offload(llm_engine))
        return llm_engine

    with _graceful_signals() as signals, _closing(publisher):
        engine = AsyncEngine.spawn(build)
        serial_thread()  # this thread runs the event loop: its torch ops must not start a second OpenMP team
        try:
            _override_chat_template(engine, options.chat_template)
            show = dashboard_enabled(options.dashboard, host, api_keys is not None)
            role = RoleInfo(options.role, options.prefill_flush_timeout, offload[0])
            replica = ReplicaInfo(prefix_hash=config.prefix_hash, kv_events=publisher, role=role,
                                  tier_blocks=tier_blocks[0])
            app = build_app(engine, engine.info.model_name, api_keys, max_queue, options, limits, dashboard=show,
                            replica=replica, lora_adapters=adapters)
            mode = f"{len(api_keys)} API keys" if api_keys else "single tenant, no auth"
            logger.info("kvserve: model %s served as %s, %d KV blocks of %d tokens, %s", engine.info.model_name,
                        ", ".join(options.model_names(engine.info.model_name)), engine.info.num_blocks,
                        engine.info.block_size, mode)
            server = _GracefulServer(engine, shutdown_timeout, uvicorn.Config(
                # uvicorn's own limit is a backstop: by then our abort has ended every stream.
                app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout + 10,
                log_level=options.log_level,
                http=guarded_protocol(limits.max_connections, limits.header_timeout_s),
                timeout_keep_alive=limits.keep_alive_s,
            ))
            engine.set_death_callback(server.engine_died)
            freeze_startup_objects()
            signals.serving = True
            server.run()
        finally:
            engine.shutdown(drain=False)
        if server.engine_error is not None:
            logger.critical("kvserve: exiting with status 1: the engine loop died (%r)", server.engine_error)
            raise SystemExit(1)  # so a supervisor restarts the process instead of a 503 zombie living on


def _attach_step_trace(llm_engine: LLMEngine) -> None:
    """KVSERVE_STEP_TRACE=path: a JSON line per step and per finished request (engine/step_trace.py)."""
    path = os.environ.get("KVSERVE_STEP_TRACE")
    if path:
        trace = StepTrace(path)
        llm_engine.scheduler.trace = trace
        llm_engine.finish_listeners.append(trace)
        logger.info("kvserve: tracing steps to %s", path)


def _configure_logging(level: str) -> None:
    """`--log-level` for kvserve's own loggers too (uvicorn configures its own from the same value)."""
    numeric = 5 if level == "trace" else getattr(logging, level.upper())
    logging.basicConfig(level=numeric, format="%(levelname)s:     %(name)s: %(message)s")
    logging.getLogger("kvserve").setLevel(numeric)


def _override_chat_template(engine: AsyncEngine, template: str | None) -> None:
    """`--chat-template`: replace the model's template before any request is rendered."""
    if template is None:
        return
    if engine.tokenizer is None:
        raise ValueError("chat_template: this model has no tokenizer to render a template with")
    engine.tokenizer.chat_template = template


@contextlib.contextmanager
def _closing(publisher: KVEventPublisher | None) -> Iterator[None]:
    try:
        yield
    finally:
        if publisher is not None:
            publisher.close()


class _GracefulServer(uvicorn.Server):
    """uvicorn, plus: `grace` seconds into a shutdown, abort the engine's remaining requests.

    uvicorn stops accepting at once and waits for open responses; aborting in the engine ends each
    remaining stream properly (finish_reason "abort", then `[DONE]`) instead of cutting the socket.
    """

    def __init__(self, engine: AsyncEngine, grace: float, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._engine = engine
        self._grace = grace
        self.engine_error: BaseException | None = None

    def engine_died(self, exc: BaseException) -> None:
        """On the engine thread, when its loop crashed: shut the server down (`/health` is 503 meanwhile)."""
        logger.critical("kvserve: the engine loop died; shutting down")
        self.engine_error = exc
        self.should_exit = True  # uvicorn's main loop polls it

    async def shutdown(self, sockets: list | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self._grace, self._engine.stop, False)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


class _SignalHandler:
    """SIGTERM/SIGINT before serving: exit 0 at once. While serving uvicorn owns both signals; when it
    is done it re-raises the caught signal to the handler installed before it -- with the default
    handler SIGTERM would then kill the process (status -15) after a clean shutdown, so this
    handler takes that call and does nothing."""

    def __init__(self) -> None:
        self.serving = False

    def __call__(self, signum: int, _frame: object) -> None:
        if not self.serving:
            raise SystemExit(0)
        logger.info("kvserve: stopped on %s", signal.Signals(signum).name)


@contextlib.contextmanager
def _graceful_signals() -> Iterator[_SignalHandler]:
    handler = _SignalHandler()
    if threading.current_thread() is not threading.main_thread():
        yield handler  # signals can only be handled on the main thread
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield handler
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)
