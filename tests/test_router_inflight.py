"""The router's own count of requests in flight per worker (`Worker.in_flight`, kept by proxy.Upstream):
up when a request is sent, down once when its attempt ends however it ends (answered, streamed to the
end, refused, 503, broken mid-stream, retried elsewhere, abandoned by its client); and the load the
policies read from it (`Worker.load_score`: this count, exact, plus only what the last poll saw beyond
it), checked by a state machine against a model worker."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from starlette.requests import Request

from kvserve.router.app import Router
from kvserve.router.keys import RequestKeyer
from kvserve.router.metrics import RouterMetrics
from kvserve.router.policies import RoundRobinPolicy
from kvserve.router.policies.base import is_imbalanced
from kvserve.router.workers import Worker, WorkerLoad, WorkerPool

PATH = "/v1/completions"


class Fake:
    """What each worker URL does with a request; `seen` records the router's count for that worker as the
    request arrived (it must already include the request)."""

    def __init__(self, pool: WorkerPool, behaviour: dict[str, str]) -> None:
        self.pool, self.behaviour = pool, behaviour
        self.seen: list[tuple[str, int]] = []
        self.release = asyncio.Event()

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        url = f"http://{request.url.host}"
        worker = next(w for w in self.pool.workers if w.url == url)
        self.seen.append((url, worker.in_flight))
        what = self.behaviour[url]
        if what == "refuse":
            raise httpx.ConnectError("refused", request=request)
        if what == "503":
            return httpx.Response(503, text="draining")
        if what == "400":
            return httpx.Response(400, json={"error": "bad"})
        if what == "hang":
            await self.release.wait()
        if what == "break":
            return httpx.Response(200, content=_broken(), headers={"content-type": "text/event-stream"})
        if json.loads(request.content).get("stream"):
            return httpx.Response(200, content=_chunks(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})


async def _chunks():
    for text in ("a", "b"):
        yield f"data: {json.dumps({'choices': [{'text': text}]})}\n\n".encode()
    yield b"data: [DONE]\n\n"


async def _broken():
    yield b'data: {"choices": [{"text": "a"}]}\n\n'
    raise httpx.ReadError("connection reset")


def setup(behaviour: dict[str, str]) -> tuple[Router, Fake]:
    client = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: fake(r)))
    pool = WorkerPool(list(behaviour), client)
    for worker in pool.workers:
        worker.healthy = True
    fake = Fake(pool, behaviour)
    router = Router(pool=pool, policy=RoundRobinPolicy(), keyer=RequestKeyer(None, None), client=client,
                    metrics=RouterMetrics(lambda: pool.workers))
    return router, fake


def request(body: dict, gone: asyncio.Event | None = None, headers: tuple[tuple[bytes, bytes], ...] = ()) -> Request:
    """A caller's request (with `headers` besides its content type); it disconnects when `gone` is set (never,
    without one)."""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await (gone or asyncio.Event()).wait()
        return {"type": "http.disconnect"}

    scope = {"type": "http", "method": "POST", "path": PATH,
             "headers": [(b"content-type", b"application/json"), *headers], "query_string": b""}
    return Request(scope, receive)


async def drain(response) -> bytes:
    return b"".join([chunk async for chunk in response.body_iterator])


def counts(router: Router) -> list[int]:
    return [worker.in_flight for worker in router.pool.workers]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_counts_while_it_runs_and_not_after(stream):
    async def run() -> None:
        router, fake = setup({"http://a": "ok"})
        response = await router.route(request({"prompt": "hi", "stream": stream}), PATH)
        assert fake.seen == [("http://a", 1)]  # counted before the worker saw it
        if stream:
            assert response.status_code == 200 and counts(router) == [1]  # still streaming
            assert b"[DONE]" in await drain(response)
        assert counts(router) == [0] and router.pool.workers[0].sent == 1
        assert router.pool.workers[0].starts == []

    asyncio.run(run())


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failure", ["refuse", "503"])
def test_a_failed_attempt_is_uncounted_and_the_retry_counted_on_its_worker(stream, failure):
    async def run() -> None:
        router, fake = setup({"http://a": failure, "http://b": "ok"})
        response = await router.route(request({"prompt": "hi", "stream": stream}), PATH)
        if stream:
            await drain(response)
        assert response.status_code == 200
        assert fake.seen == [("http://a", 1), ("http://b", 1)]  # the retry: only b counts it then
        assert counts(router) == [0, 0]

    asyncio.run(run())


def test_an_error_answer_a_broken_stream_and_a_departed_client_are_uncounted():
    async def run() -> None:
        router, _ = setup({"http://a": "400"})
        for stream in (False, True):
            assert (await router.route(request({"prompt": "x", "stream": stream}), PATH)).status_code == 400
        assert counts(router) == [0]

        router, _ = setup({"http://a": "break"})
        response = await router.route(request({"prompt": "x", "stream": True}), PATH)
        assert b"failed mid-stream" in await drain(response)
        assert counts(router) == [0]

        router, fake = setup({"http://a": "hang"})
        gone = asyncio.Event()
        task = asyncio.ensure_future(router.route(request({"prompt": "x", "stream": True}, gone), PATH))
        while not fake.seen:
            await asyncio.sleep(0.01)
        assert counts(router) == [1]
        gone.set()  # the caller leaves before the first byte
        assert (await task).status_code == 499
        assert counts(router) == [0]

    asyncio.run(run())


def test_a_stream_whose_headers_never_went_out_is_uncounted():
    """The caller left between the first chunk and the response's start: the server never iterates the body
    (the relay's own cleanup never runs), yet the attempt is released and the upstream closed."""
    async def run() -> None:
        router, _ = setup({"http://a": "ok"})
        response = await router.route(request({"prompt": "x", "stream": True}), PATH)
        assert counts(router) == [1]

        async def send(message: dict) -> None:
            raise OSError("client gone")

        async def receive() -> dict:
            return {"type": "http.disconnect"}

        scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
        with pytest.raises(Exception):  # noqa: B017 (Starlette's ClientDisconnect)
            await response(scope, receive, send)
        assert counts(router) == [0]

    asyncio.run(run())


def test_ending_more_requests_than_were_sent_is_an_error():
    worker = Worker(url="http://a")
    worker.begin_request()
    worker.end_request()
    with pytest.raises(RuntimeError, match="below zero"):
        worker.end_request()


def test_a_lagging_poll_does_not_count_requests_that_finished():
    """SGLang's guard on the polled counts fired on requests that had finished since the poll (the old load
    was max(own, polled)); on the exact count it does not, while traffic from elsewhere still counts."""
    a, b = Worker(url="http://a"), Worker(url="http://b")
    for _ in range(3):
        a.begin_request()
    a.polled(WorkerLoad(running=3), in_flight_at_send=3, sent_at_send=3)  # all three ours
    for _ in range(3):
        a.end_request()  # they finish before the next poll
    assert a.load_score == 0 and not is_imbalanced([a, b], 2, 1.5)
    a.polled_load = True  # the old load: the poll, 250 ms late
    assert a.load_score == 3 and is_imbalanced([a, b], 2, 1.5)
    b.polled(WorkerLoad(running=2, waiting=2), in_flight_at_send=0, sent_at_send=0)  # another router's
    assert b.load_score == 4 and b.external == 4


class InFlightMachine(RuleBasedStateMachine):
    """A worker serving this router's requests and others'; polls go out, and answer later with the worker's
    count at some moment in between. Model: `ours` (our requests the worker holds), `theirs` (others')."""

    def __init__(self) -> None:
        super().__init__()
        self.worker = Worker(url="http://w")
        self.theirs = 0
        self.poll: tuple[int, int, int] | None = None  # (in_flight, sent) at send, worker count seen so far

    @rule()
    def send(self) -> None:
        self.worker.begin_request()

    @precondition(lambda self: self.worker.in_flight > 0)
    @rule()
    def finish(self) -> None:
        self.worker.end_request()

    @rule(delta=st.integers(-2, 2))
    def other_traffic(self, delta: int) -> None:
        self.theirs = max(self.theirs + delta, 0)

    @precondition(lambda self: self.poll is None)
    @rule()
    def poll_out(self) -> None:
        self.poll = (self.worker.in_flight, self.worker.sent, self.theirs)

    @precondition(lambda self: self.poll is not None)
    @rule(counted_theirs=st.booleans(), observe_now=st.booleans())
    def poll_answers(self, counted_theirs: bool, observe_now: bool) -> None:
        """The worker counted at send time or now (ours then or now; theirs as then or now)."""
        assert self.poll is not None
        in_flight, sent, theirs_then = self.poll
        ours = self.worker.in_flight if observe_now else in_flight
        theirs = self.theirs if counted_theirs else theirs_then
        self.worker.polled(WorkerLoad(running=ours + theirs), in_flight, sent)
        self.poll = None
        self.last_theirs = theirs
        # Nothing of ours is counted twice: what is left is at most the others' traffic the worker saw.
        assert self.worker.external <= theirs
        if ours == in_flight + (self.worker.sent - sent):  # every request of ours in the window was counted
            assert self.worker.external == theirs

    @invariant()
    def counts_are_sane(self) -> None:
        assert self.worker.in_flight >= 0 and self.worker.external >= 0
        assert self.worker.load_score == self.worker.in_flight + self.worker.external
        assert self.worker.sent >= self.worker.in_flight


TestInFlight = InFlightMachine.TestCase
TestInFlight.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
