"""Issue 8, reproductions 3 and 4 on a real server subprocess, timed client-side over HTTP.

3. A client holding the pool (n=16, best_of=16, max_tokens=700, ignore_eos on a 64-block pool, the
   per-request cap lifted so it is admitted) does not stop other clients' 4-token requests: each
   finishes within a few seconds while the big group keeps producing tokens. (With the default cap the
   same body is refused with a 400 naming `max_blocks_per_request`: test_hardening.py.)
4. A short request sent while an 8,191-token prompt prefills gets its first token within 2x its solo
   TTFT plus one step of that prefill (streaming, measured from the client).

Both fail with the engine's fairness switched off (checked by hand when they were written): 3 with
admission in plain FCFS order (`unserved_groups_first` off: a 4-token request waited 18 s behind the
group's preempted samples); 4 with `--long-prefill-token-threshold 0` (median TTFT 4.2 s against a
bound of 1.2 s). Preemption by pool share instead of arrival barely changes 3 for 4-token requests
(they finish before their turn as victim comes); test_fairness.py checks it on the engine, where a
request admitted beside the big group is never preempted.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from kvserve.server.launcher import ServerProcess
from test_server_support import chat_model_dir, make_chat_model_dir, metric_value, start_server, wait_until_drained  # noqa: F401

MODEL = "tiny-chat"
HOSTAGE = {"prompt": "Hi", "n": 16, "best_of": 16, "max_tokens": 700, "temperature": 1, "ignore_eos": True}
SHORT_DEADLINE_S = 5.0  # a 4-token request on the tiny model takes ~0.05 s alone


class StreamReader(threading.Thread):
    """Reads one streaming completion in the background: when each event came, and when it ended."""

    def __init__(self, server: ServerProcess, body: dict) -> None:
        super().__init__(daemon=True)
        self.server, self.body = server, body
        self.start_time = time.monotonic()
        self.event_times: list[float] = []
        self.status: int | None = None
        self.hang_up = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", f"{self.server.url}/v1/completions", json={"model": MODEL, **self.body}) as response:
            self.status = response.status_code
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.event_times.append(time.monotonic())
                if self.hang_up.is_set():
                    return  # leaving the block closes the connection: the server aborts the request

    @property
    def first_event(self) -> float | None:
        return self.event_times[0] if self.event_times else None


def first_token_time(server: ServerProcess, prompt, max_tokens: int = 4) -> float:
    """Client-side TTFT of one streaming completion (logprobs make every token a chunk, even one whose
    bytes do not decode to text yet)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 1}
    start = time.monotonic()
    ttft = None
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if ttft is None and line.startswith("data: {") and json.loads(line[6:])["choices"]:
                ttft = time.monotonic() - start
    assert ttft is not None
    return ttft


class Probe(threading.Thread):
    """A short streaming request sent at `when` (time.monotonic()); its client-side TTFT."""

    def __init__(self, server: ServerProcess, when: float) -> None:
        super().__init__(daemon=True)
        self.server, self.when = server, when
        self.sent = self.ttft = float("nan")

    def run(self) -> None:
        time.sleep(max(0.0, self.when - time.monotonic()))
        self.sent = time.monotonic()
        self.ttft = first_token_time(self.server, [5, 6, 7, 8])


# --- 3. one request took the pool ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_pool(chat_model_dir) -> Iterator[ServerProcess]:  # noqa: F811
    with start_server(chat_model_dir, "--max-blocks-per-request", "100000", num_blocks=64) as process:
        yield process


def test_reproduction_3_a_pool_hostage_does_not_starve_short_requests(small_pool):
    hog = StreamReader(small_pool, {**HOSTAGE, "stream": True})
    hog.start()
    deadline = time.monotonic() + 60
    while metric_value(small_pool.url, "kvserve_num_preemptions_total") == 0:  # its samples fill the pool
        assert time.monotonic() < deadline and hog.is_alive(), "the big group never filled the pool"
        time.sleep(0.05)
    assert hog.status == 200
    hog_events_before = len(hog.event_times)
    latencies = []
    for index in range(5):
        start = time.monotonic()
        response = httpx.post(f"{small_pool.url}/v1/completions", timeout=SHORT_DEADLINE_S * 4, json={
            "model": MODEL, "prompt": f"Hello {index}", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        latencies.append(time.monotonic() - start)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
    try:
        assert hog.is_alive(), "the big group ended early: nothing was contended"
        assert max(latencies) < SHORT_DEADLINE_S, latencies
        assert len(hog.event_times) > hog_events_before, "the big group stopped progressing"
    finally:
        hog.hang_up.set()
        hog.join(timeout=30)
    assert wait_until_drained(small_pool.url)["used"] == 0


# --- 4. a long prefill blocked newcomers -----------------------------------------------------------------

LONG_PROMPT = [7 + i % 300 for i in range(8191)]
BUDGET = 512  # --max-num-batched-tokens: the long prompt prefills in 16 chunks


@pytest.fixture(scope="module")
def long_context(tmp_path_factory) -> Iterator[ServerProcess]:
    """A wider model with an 8k context, so the 8,191-token prefill takes seconds on a CPU."""
    model_dir = make_chat_model_dir(tmp_path_factory.mktemp("8k") / MODEL, max_position_embeddings=8192,
                                    hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    with start_server(model_dir, "--max-num-batched-tokens", str(BUDGET), "--prefix-cache", "off",
                      num_blocks=600) as process:
        yield process


def test_reproduction_4_short_ttft_beside_an_8k_prefill(long_context):
    first_token_time(long_context, [5, 6, 7, 8])  # warm-up
    solo = statistics.median(first_token_time(long_context, [5, 6, 7, 8]) for _ in range(5))
    alone = first_token_time(long_context, LONG_PROMPT, max_tokens=1)
    # Chunk times grow linearly with the context, so the longest (the last) is at most twice the mean.
    step = 2 * alone / -(-len(LONG_PROMPT) // BUDGET)
    long_request = StreamReader(long_context, {"prompt": LONG_PROMPT, "max_tokens": 1, "stream": True})
    long_request.start()
    probes = [Probe(long_context, long_request.start_time + fraction * alone) for fraction in (0.15, 0.4, 0.65)]
    for probe in probes:  # short requests sent while the long prompt prefills, each on its own
        probe.start()
    for thread in (long_request, *probes):
        thread.join(timeout=120)
    assert long_request.status == 200 and long_request.first_event is not None
    assert all(probe.sent < long_request.first_event for probe in probes), "the prefill ended before the probes"
    beside = [probe.ttft for probe in probes]
    bound = 2 * solo + step
    assert statistics.median(beside) <= bound, (beside, solo, step, alone)
    assert wait_until_drained(long_context.url)["used"] == 0
