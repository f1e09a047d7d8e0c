"""Admission limit (--max-queue → 429) and graceful SIGTERM (finish or abort in-flight work, exit 0).

One server for the module (one running sequence, a queue of one, a 3 s grace period) over a tiny
model with an 8k context, so a "long" request (8,000 tokens) cannot finish inside the grace period
however fast the machine; the SIGTERM test stops the server, so it comes last.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator

import httpx
import openai
import pytest

from kvserve.server.launcher import ServerProcess
from test_server_support import make_chat_model_dir, metric_value, start_server, wait_until_drained

MODEL = "tiny-chat"
LONG = {"model": MODEL, "prompt": [5] * 40, "max_tokens": 8000, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def small_server(tmp_path_factory) -> Iterator[ServerProcess]:
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("8k") / MODEL, max_position_embeddings=8192)
    flags = ["--max-num-seqs", "1", "--max-queue", "1", "--shutdown-timeout", "3"]
    with start_server(model_dir, *flags, num_blocks=640) as process:
        yield process


def test_full_queue_answers_429_and_recovers(small_server):
    client = openai.OpenAI(base_url=small_server.base_url, api_key="x", max_retries=0, timeout=60)
    params = {key: value for key, value in LONG.items() if key != "ignore_eos"}
    running = client.completions.create(stream=True, extra_body={"ignore_eos": True}, **params)
    queued = None
    try:
        next(iter(running))  # holds the only sequence slot
        queued = client.completions.create(stream=True, extra_body={"ignore_eos": True}, **params)  # waits
        # Counted as waiting from the moment its headers arrive, not only after the engine's next step.
        assert metric_value(small_server.url, "kvserve_num_requests_waiting") == 1
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=MODEL, prompt="one too many", max_tokens=1)
        assert info.value.status_code == 429 and info.value.body["code"] == "queue_full"
        running.close()  # frees the slot: the queued request runs
        assert next(iter(queued)).choices[0].text is not None
    finally:  # a failure here must not leave the slot taken for the SIGTERM test
        running.close()
        if queued is not None:
            queued.close()
    wait_until_drained(small_server.url)
    assert client.completions.create(model=MODEL, prompt="room again", max_tokens=1).choices


def test_sigterm_finishes_short_requests_aborts_long_ones_and_exits_0(small_server):
    results: dict[str, dict] = {}
    started = {name: threading.Event() for name in ("short", "long")}
    bodies = {"short": {**LONG, "max_tokens": 100}, "long": LONG}
    threads = [
        threading.Thread(target=_stream, args=(small_server, bodies[name], started[name],
                                               results.setdefault(name, {}), name == "short"))
        for name in ("short", "long")
    ]
    threads[0].start()
    assert started["short"].wait(30)  # first token streamed: the short request is running
    threads[1].start()  # queued behind the short one (one sequence slot)
    assert started["long"].wait(30)  # headers received: accepted before the signal
    small_server.process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert small_server.process.wait(30) == 0
    assert results["short"]["finish"] == "length" and results["short"]["done"]  # finished in the grace period
    assert results["long"]["finish"] == "abort" and results["long"]["done"]  # aborted after the 3 s grace
    assert results["long"]["chunks"] > 1 and "error" not in results["long"]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{small_server.url}/health")


def _stream(
    server: ServerProcess, body: dict, started: threading.Event, result: dict, on_token: bool
) -> None:
    """Raw SSE read: records the finish reason and whether `[DONE]` arrived (the stream may be cut).

    `started` is set once the request is accepted (headers in), or with `on_token` at its first token.
    """
    try:
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
            if not on_token:
                started.set()
            for line in response.iter_lines():
                started.set()
                if line == "data: [DONE]":
                    result["done"] = True
                elif line.startswith("data: "):
                    result["chunks"] = result.get("chunks", 0) + 1
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    result["finish"] = choices[0].get("finish_reason") or result.get("finish")
    except httpx.HTTPError as err:
        result["error"] = repr(err)
    finally:
        started.set()
