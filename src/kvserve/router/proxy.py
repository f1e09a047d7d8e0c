"""Forward one request to one worker: the body as received, the caller's headers (API key included)
unchanged, the answer back as it comes.

A worker *fails* a request when it cannot be reached, drops the connection, or answers 503 (engine
dead or draining) before the first byte of the answer reached our caller; `WorkerFailed` tells the
caller to mark it down and try another worker. Once bytes have been relayed there is no retry: a
stream that breaks gets a final SSE `error` event (and no `[DONE]`), so the client sees a clear
failure rather than a silently truncated answer.

Client disconnects propagate: the upstream request is cancelled (its connection closed), which the
worker sees as its own client disconnect, so it aborts the request and frees its blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from kvserve.router.metrics import RouterMetrics
from kvserve.router.workers import PrefillStart, Worker
from kvserve.server.roles import BACKGROUND_HEADER, FLUSH_BYTES_HEADER, FLUSH_HEADER, FLUSH_MS_HEADER

CLIENT_CLOSED_REQUEST = 499
# What the router decided for a request, for whoever studies its tail (benchmarks/router.py):
# `worker=URL; reason=R; prompt=N; matched=N; ahead_requests=N; ahead_tokens=N; others_min_requests=N`:
# the chosen worker's requests in flight and their pending prefill tokens at the moment of the decision,
# and the fewest requests in flight on any other candidate; `; copy=URL` when a warm copy went there.
ROUTE_HEADER = "x-kvserve-route"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# Hop-by-hop and framing headers are the proxy's own business; everything else passes unchanged.
_DROPPED_REQUEST_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "upgrade",
                            "te", "trailer", "proxy-authorization", "proxy-connection", "accept-encoding",
                            BACKGROUND_HEADER}  # the router's own (idle copies), never a client's
# ... and a prefill worker's hand-off report (handoff.py).
_PASSED_RESPONSE_HEADERS = ("content-type", "retry-after", "x-request-id", FLUSH_HEADER, FLUSH_BYTES_HEADER,
                            FLUSH_MS_HEADER)
T = TypeVar("T")


class WorkerFailed(Exception):
    """The worker could not take the request; nothing was sent to the caller yet."""


class ClientGone(Exception):
    """The caller disconnected while we waited for the worker."""


def forward_headers(request: Request) -> dict[str, str]:
    return {name: value for name, value in request.headers.items() if name.lower() not in _DROPPED_REQUEST_HEADERS}


@dataclass(slots=True)
class Upstream:
    """One attempt: `worker` gets `body` at `path`."""

    client: httpx.AsyncClient
    worker: Worker
    path: str
    body: bytes
    headers: dict[str, str]
    metrics: RouterMetrics
    prefill_tokens: int = 0  # the policy's estimate of the prompt tokens the worker must compute
    route_header: str | None = None  # ROUTE_HEADER's value for our caller (None: not sent)
    on_answer: Callable[[bytes], None] | None = None  # sees a 200 body, or a stream's first bytes
    on_prefilled: Callable[[], None] | None = None  # the worker answered (200 body or first bytes): prompt computed

    _start: PrefillStart | None = field(default=None, init=False)  # our entry in worker.starts, while pending
    _open: bool = field(default=False, init=False)  # counted in worker.in_flight

    def _begin(self) -> None:
        self.worker.begin_request()
        self._open = True
        self._start = PrefillStart(self.prefill_tokens)
        self.worker.starts.append(self._start)

    def _end(self) -> None:
        """The attempt ended (answered, failed, or its caller left): it leaves the worker's counts, once."""
        self._prefilled()
        if self._open:
            self._open = False
            self.worker.end_request()

    def _prefilled(self, answered: bool = False) -> None:
        """The first token is back (`answered`) or the attempt ended: the prefill no longer waits on the
        worker."""
        if self._start is not None:
            self.worker.starts.remove(self._start)
            if answered:
                self.worker.observe_prefill(self.prefill_tokens, time.monotonic() - self._start.started)
                if self.on_prefilled is not None:
                    self.on_prefilled()
            self._start = None

    def _own_headers(self) -> dict[str, str]:
        return {ROUTE_HEADER: self.route_header} if self.route_header is not None else {}

    async def unary(self, request: Request) -> Response:
        started = time.perf_counter()
        self._begin()
        try:
            answer = await _unless_disconnected(request, self.client.post(
                self.worker.url + self.path, content=self.body, headers=self.headers, timeout=None))
        except httpx.TransportError as err:
            raise WorkerFailed(f"{type(err).__name__}: {err}") from err
        finally:
            self._end()
        self.metrics.first_byte.observe(time.perf_counter() - started)
        if answer.status_code == 503:
            raise WorkerFailed(f"worker answered 503: {answer.text[:200]}")
        if answer.status_code == 200 and self.on_prefilled is not None:
            self.on_prefilled()
        if answer.status_code == 200 and self.on_answer is not None:
            self.on_answer(answer.content)
        return Response(answer.content, status_code=answer.status_code,
                        headers=_response_headers(answer) | self._own_headers())

    async def stream(self, request: Request) -> Response:
        """Open the stream and wait for its first chunk (retryable until then), then relay the rest."""
        started = time.perf_counter()
        self._begin()
        answer: httpx.Response | None = None
        try:
            sent = self.client.build_request("POST", self.worker.url + self.path, content=self.body,
                                             headers=self.headers, timeout=None)
            answer = await _unless_disconnected(request, self.client.send(sent, stream=True))
            if answer.status_code != 200:
                content = await answer.aread()
                if answer.status_code == 503:
                    raise WorkerFailed(f"worker answered 503: {content[:200]!r}")
                self._end()
                await answer.aclose()
                return Response(content, status_code=answer.status_code,
                                headers=_response_headers(answer) | self._own_headers())
            chunks = answer.aiter_raw()
            first = await _unless_disconnected(request, anext(chunks, b""))
            self._prefilled(answered=True)
            if self.on_answer is not None:
                self.on_answer(first)
        except BaseException as err:
            self._end()
            if answer is not None:
                await answer.aclose()
            if isinstance(err, httpx.TransportError):
                raise WorkerFailed(f"{type(err).__name__}: {err}") from err
            raise
        self.metrics.first_byte.observe(time.perf_counter() - started)
        return RelayedResponse(self._relay(request, answer, first, chunks), status_code=200,
                               media_type=answer.headers.get("content-type", "text/event-stream"),
                               headers=SSE_HEADERS | _request_id_header(answer) | self._own_headers(),
                               on_close=lambda: self._close(answer))

    async def _close(self, answer: httpx.Response) -> None:
        self._end()
        await answer.aclose()

    async def _relay(
        self, request: Request, answer: httpx.Response, first: bytes, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            if first:
                yield first
            async for chunk in chunks:
                if watcher.done():
                    break  # our caller left: closing the upstream makes the worker abort
                yield chunk
        except httpx.TransportError as err:
            self.metrics.failures.labels("mid_stream").inc()
            yield _sse_error(f"worker {self.worker.url} failed mid-stream: {type(err).__name__}: {err}")
        finally:
            watcher.cancel()
            self._end()
            await answer.aclose()


class RelayedResponse(StreamingResponse):
    """A relayed stream that releases its attempt however the response ends, including when the ASGI server
    never iterates the body (the caller left before the headers went out): the relay's own `finally` runs
    only once iteration has begun, and the worker's count and connection must not leak."""

    def __init__(self, *args: Any, on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (ClientGone) if the caller disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        raise ClientGone()
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read: from here the ASGI server's receive() blocks until the client leaves.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _request_id_header(answer: httpx.Response) -> dict[str, str]:
    """The worker's X-Request-Id (the response's id), passed on to the caller."""
    return {"x-request-id": answer.headers["x-request-id"]} if "x-request-id" in answer.headers else {}


def _response_headers(answer: httpx.Response) -> dict[str, str]:
    return {name: answer.headers[name] for name in _PASSED_RESPONSE_HEADERS if name in answer.headers}


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "worker_error", "param": None, "code": "worker_failed"}}
    return f"data: {json.dumps(body)}\n\n".encode()


def error_response(status: int, message: str, code: str) -> Response:
    body = {"error": {"message": message, "type": "router_error", "param": None, "code": code}}
    return Response(json.dumps(body), status_code=status, media_type="application/json")
