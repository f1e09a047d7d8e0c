"""The dashboard's routes in-process (FastAPI TestClient over a real tiny engine): on/off, the snapshot
endpoint's JSON, parameter checks, and the engine-thread capture running while requests decode."""

from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import SamplingParams
from kvserve.server.app import build_app
from kvserve.server.dashboard.snapshot import SnapshotLimits, capture
from kvserve.serving.async_engine import AsyncEngine
from test_server_support import chat_model_dir  # noqa: F401

PREFIX = list(range(10, 10 + 48))  # three blocks


def make_engine(model_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_blocks=64), progress=False)


@pytest.fixture
def client(chat_model_dir):  # noqa: F811
    app = build_app(AsyncEngine(make_engine(chat_model_dir)), "tiny-chat", None, 16, dashboard=True)
    with TestClient(app) as test_client:
        yield test_client


def test_off_means_404_naming_the_flag(chat_model_dir):  # noqa: F811
    app = build_app(AsyncEngine(make_engine(chat_model_dir)), "tiny-chat", None, 16, dashboard=False)
    with TestClient(app) as off:
        for path in ("/dashboard", "/dashboard/app.js", "/v1/cache/snapshot", "/v1/cache/stream"):
            response = off.get(path)
            assert response.status_code == 404 and "--dashboard" in response.json()["error"]["message"]


def test_page_and_its_files_are_served(client):
    page = client.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<canvas id="block-map"' in page.text
    assert "EventSource" not in client.get("/dashboard/app.js").text  # fetch-based: keys go in a header
    assert client.get("/dashboard/style.css").status_code == 200
    assert client.get("/dashboard/secret.py").status_code == 404


def test_snapshot_matches_the_engine_after_a_shared_prefix_workload(client):
    for tail in ([200, 201, 202], [300, 301, 302, 303]):
        body = {"model": "tiny-chat", "prompt": PREFIX + tail, "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
    snapshot = client.get("/v1/cache/snapshot").json()
    stats = snapshot["stats"]
    pool = snapshot["pool"]
    assert (pool["free"], pool["cached"], pool["used"]) == (
        stats["free_blocks"], stats["cached_blocks"], stats["used_blocks"])
    assert len(pool["map"]) == pool["num_blocks"] == 64 and pool["map"].count("c") == pool["cached"]
    runs = [node for node in snapshot["tree"]["nodes"] if node["kind"] == "run"]
    top = [node for node in runs if node["start_tokens"] == 0]
    assert len(top) == 1 and top[0]["tokens"] == len(PREFIX) and top[0]["refs"] == 0
    assert isinstance(top[0]["text"], str) and top[0]["age_s"] >= 0
    assert snapshot["viewer"] == {"tenant": None, "admin": True} and snapshot["cost_ms"]["capture"] > 0
    small = client.get("/v1/cache/snapshot", params={"top": 1, "block_map": "false"}).json()
    assert small["pool"]["map"] is None
    assert [node["kind"] for node in small["tree"]["nodes"]].count("run") == 1


@pytest.mark.parametrize("query", ["top=0", "top=99999", "max_waiting=-1", "block_map=maybe"])
def test_bad_parameters_are_400s(client, query):
    response = client.get(f"/v1/cache/snapshot?{query}")
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] or response.json()["error"]["message"]


def test_capture_between_steps_sees_running_requests(chat_model_dir):  # noqa: F811
    engine = AsyncEngine(make_engine(chat_model_dir))
    engine.start()
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def run() -> list:
        streams = [engine.generate(PREFIX + [350 + i], params, f"r{i}").__aiter__() for i in range(2)]
        for stream in streams:
            await stream.__anext__()  # both are running now
        raw = await engine.call(lambda e: capture(e, SnapshotLimits()))
        for stream in streams:
            await stream.aclose()  # aborts
        return raw

    try:
        raw = asyncio.run(run())
    finally:
        engine.shutdown()
    assert sorted(row.request_id for row in raw.running) == ["r0", "r1"]
    assert all(row.computed_tokens >= len(PREFIX) and row.status == "running" for row in raw.running)
    assert raw.stats["used_blocks"] == sum(1 for count in raw.ref_counts if count > 0)
