"""The router's ASGI app: the worker's OpenAI API, proxied to the worker a policy picks.

    POST /v1/chat/completions, /v1/completions   keyed (tokens + tenant namespace), routed, proxied; a
                                                  prompt_cache_key follows its last request (affinity.py)
    POST /v1/responses                            the same; a continuation (previous_response_id) goes to the
                                                  worker that holds that response (affinity.py)
    GET, DELETE /v1/responses/{id}                to the worker holding it (else each worker in turn)
    GET  /v1/models                               proxied to any healthy worker
    GET  /health                                  200 while at least one worker is in the pool
    GET  /metrics                                 the router's own Prometheus metrics (with API keys:
                                                  admin keys only, as on the workers; `--open-metrics` opens it)

Retries: a request goes to at most `max_attempts` different workers; a worker that fails before any
byte reached the caller leaves the pool (it rejoins when its polls succeed) and the request moves on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvserve.router.affinity import CacheKeyAffinity, ResponseAffinity
from kvserve.router.handoff import FallbackLog, copy_request, run_prefill
from kvserve.router.idle_copy import IDLE_COPY_TIMEOUT_S, IdleCopies, send_copy
from kvserve.router.keys import CHAT_PATH, COMPLETIONS_PATH, RESPONSES_PATH, RequestKeyer, RouteKey
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies.base import Decision, Policy
from kvserve.router.policies.pd import FALLBACK_REASONS, PdPolicy
from kvserve.router.proxy import (
    CLIENT_CLOSED_REQUEST,
    ClientGone,
    Upstream,
    WorkerFailed,
    error_response,
    forward_headers,
)
from kvserve.router.workers import Worker, WorkerPool
from kvserve.server.auth import ApiKeys, AuthError, authenticate, require_admin
from kvserve.server.roles import BACKGROUND_HEADER, STORE_PROBE_HEADER

logger = logging.getLogger("kvserve.router")
MAX_BODY_BYTES = 16 * 1024 * 1024  # the workers' own limit
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True)
class Router:
    """Everything the routes share."""

    pool: WorkerPool
    policy: Policy
    keyer: RequestKeyer
    client: httpx.AsyncClient
    metrics: RouterMetrics
    max_attempts: int = 3
    metrics_keys: ApiKeys | None = None  # /metrics needs an admin key from these (None: open)
    affinity: ResponseAffinity = field(default_factory=ResponseAffinity)
    cache_keys: CacheKeyAffinity = field(default_factory=CacheKeyAffinity)
    fallbacks: FallbackLog = field(init=False)
    copies: dict[Worker, asyncio.Task] = field(default_factory=dict)  # warm copies in flight, one per worker
    idle: IdleCopies | None = None  # idle copies (idle_copy.py); None: off

    def __post_init__(self) -> None:
        self.fallbacks = FallbackLog(self.metrics)

    async def route(self, request: Request, path: str) -> Response:
        body = await _read_body(request)
        if body is None:
            return error_response(413, f"request body exceeds {MAX_BODY_BYTES} bytes", "request_too_large")
        started = time.perf_counter()
        parsed = _json_or_none(body)
        key = await asyncio.to_thread(self.keyer.key, path, parsed, request.headers.get("authorization"))
        streaming = isinstance(parsed, dict) and parsed.get("stream") is True
        first: Worker | None = None
        if isinstance(self.policy, PdPolicy):
            planned = await self._prefill_first(request, path, parsed, key, started)
            if isinstance(planned, Response):
                return planned
            first = planned
        elif path == RESPONSES_PATH and isinstance(parsed, dict):
            first = self.affinity.worker(parsed.get("previous_response_id"), self.pool.healthy())
            if first is not None:
                self.metrics.decisions.labels(self.policy.name, "response_affinity").inc()
        cache_key = parsed.get("prompt_cache_key") if isinstance(parsed, dict) else None
        if first is None and not isinstance(self.policy, PdPolicy):
            first = self.cache_keys.worker(cache_key, key.namespace, self.pool.healthy())
            if first is not None:
                self.metrics.decisions.labels(self.policy.name, "cache_key_affinity").inc()
        tried: set[Worker] = set()
        errors: list[str] = []
        for attempt in range(self.max_attempts):
            candidates = [worker for worker in self.pool.healthy() if worker not in tried]
            if not candidates:
                break
            prefill, route, headers = 0, None, forward_headers(request)
            if first is not None and first in candidates:
                worker, first = first, None
                self.policy.on_routed(key, worker)
            else:
                decision = self._decide(key, candidates, started if attempt == 0 else None)
                worker, prefill = decision.worker, decision.uncached(key)
                route = route_header(decision, key, candidates)
                if decision.copy_to is not None and isinstance(parsed, dict) and path != RESPONSES_PATH:
                    self._warm_copy(decision.copy_to, path, parsed, forward_headers(request), key)
                if decision.store_probe is not None:  # over a shared store (policies/store.py)
                    headers[STORE_PROBE_HEADER] = "1" if decision.store_probe else "0"
            tried.add(worker)
            self.cache_keys.learn(cache_key, key.namespace, worker)
            learn = (lambda answer, at=worker: self.affinity.learn(at, answer)) if path == RESPONSES_PATH else None
            prefilled = (lambda at=worker, sent=headers: self._prefilled(key, at, path, parsed, sent))
            upstream = Upstream(self.client, worker, path, body, headers, self.metrics, prefill, route, learn,
                                prefilled)
            try:
                response = await (upstream.stream(request) if streaming else upstream.unary(request))
            except WorkerFailed as err:
                errors.append(f"{worker.url}: {err}")
                self.pool.mark_down(worker, str(err))
                self.metrics.routed.labels(worker.url, "failed").inc()
                self.metrics.retries.inc()
                continue
            except ClientGone:
                self.metrics.routed.labels(worker.url, "client_gone").inc()
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            self.metrics.routed.labels(worker.url, "ok").inc()
            return response
        self.metrics.failures.labels("no_worker").inc()
        detail = "; ".join(errors) if errors else "no worker is in the pool"
        return error_response(503, f"no worker could take the request: {detail}", "no_worker_available")

    def _prefilled(self, key: RouteKey, worker: Worker, path: str, parsed: object, headers: dict[str, str]) -> None:
        """`worker` answered: index it, then let idle workers copy the prompt (not /v1/responses: see `_warm_copy`)."""
        self.policy.on_prefilled(key, worker)
        if self.idle is not None and isinstance(parsed, dict) and path != RESPONSES_PATH:
            self.idle.after_prefill(key, worker, self.pool.healthy(), path, parsed, headers)

    def _warm_copy(self, worker: Worker, path: str, parsed: dict, headers: dict[str, str], key: RouteKey) -> None:
        """The share guard's warm copy (`Decision.copy_to`): the request as a one-token prefill
        (`handoff.copy_request`: same tenant, salt and prompt) to `worker` as a background request
        (`engine/background.py`: computed only while nobody else's request waits or runs there, so it
        delays the worker's callers by one 64-token step at most), outside this router's load counts, its
        answer dropped; indexed there once answered 200. One in flight per worker. Not for
        /v1/responses, whose duplicate would store a response nobody asked for."""
        if worker in self.copies:
            return
        body, sent = copy_request(parsed, headers)
        task = asyncio.create_task(self._run_copy(worker, path, body, sent | {BACKGROUND_HEADER: "1"}, key))
        self.copies[worker] = task
        task.add_done_callback(lambda _, at=worker: self.copies.pop(at, None))

    async def _run_copy(self, worker: Worker, path: str, body: bytes, headers: dict[str, str],
                        key: RouteKey) -> None:
        if await send_copy(self.client, worker, path, body, headers, IDLE_COPY_TIMEOUT_S, self.metrics.warm_copies,
                           "warm"):
            self.policy.on_copied(key, worker)
            self.policy.on_prefilled(key, worker)

    async def _prefill_first(
        self, request: Request, path: str, parsed: object, key: RouteKey, started: float
    ) -> Worker | Response | None:
        """pd: plan the request; when the plan hands off, run the prefill on its prefill worker. Returns the
        decode worker to try first, or the caller's answer (an error in the request, or 499)."""
        assert isinstance(self.policy, PdPolicy)
        healthy = self.pool.healthy()
        if not healthy:
            return None
        plan = self.policy.plan(key, healthy)
        self.metrics.decisions.labels(self.policy.name, plan.reason).inc()
        self.metrics.routing.observe(time.perf_counter() - started)
        if plan.reason in FALLBACK_REASONS:
            self.fallbacks.record(plan.reason, f"decode worker {plan.decode.url} serves the request whole")
        if plan.prefill is None or not isinstance(parsed, dict):
            return plan.decode
        self.policy.on_routed(key, plan.prefill)
        outcome = await run_prefill(request, self.client, self.pool, self.fallbacks, plan.prefill, path, parsed,
                                    forward_headers(request))
        return outcome.answer if outcome.answer is not None else plan.decode

    def _decide(self, key: RouteKey, candidates: list[Worker], started: float | None) -> Decision:
        decision = self.policy.choose(key, candidates)
        self.policy.on_routed(key, decision.worker)
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        if key.usable:
            assert key.tokens is not None
            self.metrics.prompt_tokens.labels(decision.worker.url).inc(len(key.tokens))
            self.metrics.matched_tokens.labels(decision.worker.url).inc(decision.matched_tokens)
        if started is not None:
            self.metrics.routing.observe(time.perf_counter() - started)
        return decision

    async def stored_response(self, request: Request, response_id: str) -> Response:
        """GET / DELETE /v1/responses/{id}: the worker that created it, else each healthy worker until one
        has it (a 404 from every worker is the answer)."""
        healthy = self.pool.healthy()
        holder = self.affinity.worker(response_id, healthy)
        answer: httpx.Response | None = None
        for worker in ([holder] if holder is not None else []) + [w for w in healthy if w is not holder]:
            try:
                answer = await self.client.request(request.method, f"{worker.url}{RESPONSES_PATH}/{response_id}",
                                                   headers=forward_headers(request))
            except httpx.TransportError as err:
                self.pool.mark_down(worker, str(err))
                continue
            if answer.status_code != 404:
                if request.method == "DELETE" and answer.status_code == 200:
                    self.affinity.forget(response_id)
                break
        if answer is None:
            return error_response(503, "no worker is in the pool", "no_worker_available")
        return Response(answer.content, status_code=answer.status_code, media_type=answer.headers.get("content-type"))

    async def models(self, request: Request) -> Response:
        for worker in self.pool.healthy():
            try:
                answer = await self.client.get(worker.url + "/v1/models", headers=forward_headers(request))
            except httpx.TransportError as err:
                self.pool.mark_down(worker, str(err))
                continue
            return Response(answer.content, status_code=answer.status_code,
                            media_type=answer.headers.get("content-type"))
        return error_response(503, "no worker is in the pool", "no_worker_available")


def build_router_app(router: Router) -> FastAPI:
    """The app; its lifespan polls the pool (once before serving) and runs the policy's background work."""
    router.pool.on_join.append(router.policy.on_join)
    router.pool.on_leave.append(router.policy.on_leave)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.policy.start()
        await router.pool.poll_all()
        poller = asyncio.create_task(router.pool.run())
        feeder = asyncio.create_task(router.idle.run(router.pool)) if router.idle is not None else None
        try:
            yield
        finally:
            poller.cancel()
            if feeder is not None:
                feeder.cancel()
            for copy in list(router.copies.values()):
                copy.cancel()
            if router.idle is not None:
                await router.idle.stop()
            await router.policy.stop()
            await router.client.aclose()

    app = FastAPI(title="kvserve router", summary="cache-aware router over kvserve workers", lifespan=lifespan)
    app.state.router = router

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        return await router.route(request, CHAT_PATH)

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        return await router.route(request, COMPLETIONS_PATH)

    @app.post(RESPONSES_PATH)
    async def responses(request: Request) -> Response:
        return await router.route(request, RESPONSES_PATH)

    @app.api_route(RESPONSES_PATH + "/{response_id}", methods=["GET", "DELETE"])
    async def stored_response(request: Request, response_id: str) -> Response:
        return await router.stored_response(request, response_id)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        workers = {worker.url: worker.healthy for worker in router.pool.workers}
        status = 200 if any(workers.values()) else 503
        return JSONResponse({"status": "ok" if status == 200 else "unavailable", "policy": router.policy.name,
                             "workers": workers}, status_code=status)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if router.metrics_keys is not None:  # per-worker load and decisions reveal other tenants' traffic
            try:
                require_admin(authenticate(request.headers.get("authorization"), router.metrics_keys))
            except AuthError as err:
                code = "forbidden" if err.status == 403 else "invalid_api_key"
                return error_response(err.status, str(err), code)
        return Response(router.metrics.render(), media_type=PROMETHEUS_CONTENT_TYPE)

    return app


def route_header(decision: Decision, key: RouteKey, candidates: list[Worker]) -> str:
    """`proxy.ROUTE_HEADER`'s value: the decision and the chosen worker's queue as the router saw it."""
    worker = decision.worker
    others = [other.in_flight for other in candidates if other is not worker]
    prompt = len(key.tokens) if key.tokens is not None else 0
    return (f"worker={worker.url}; reason={decision.reason}; prompt={prompt}; matched={decision.matched_tokens}; "
            f"ahead_requests={worker.in_flight}; ahead_tokens={worker.pending_prefill}; "
            f"others_min_requests={min(others, default=0)}"
            + (f"; copy={decision.copy_to.url}" if decision.copy_to is not None else ""))


async def _read_body(request: Request) -> bytes | None:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            return None
    return bytes(body)


def _json_or_none(body: bytes) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None  # the worker answers the 400
