"""The dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright).

A server over the tiny chat model gets a shared-prefix workload; the page must draw block counts equal
to /metrics, the shared prefix as one node whose reference count is the number of requests holding it,
and, for a tenant key, only that tenant's nodes. Screenshots land in the test's tmp dir (and in
$KVSERVE_DASHBOARD_SCREENSHOT when set: that is how docs/dashboard.png is made).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from kvserve.server.launcher import ServerProcess
from test_server_support import make_chat_model_dir, start_server, wait_until_drained

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
BLOCK = 16
SHARED = [random.Random(1).randrange(3, 380) for _ in range(4 * BLOCK)]  # four whole blocks
KEYS_TOML = """
[keys]
"sk-alice" = "alice"
"sk-bob" = "bob"
"sk-ops" = { tenant = "ops", admin = true }
"""
BOB_TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun. " * 3

if CHROMIUM is None:  # loud: the reason shows in pytest's summary (-ra)
    pytest.skip("DASHBOARD BROWSER TEST SKIPPED: no `chromium` binary (run `make install`, which "
                "apt-installs Debian's chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="DASHBOARD BROWSER TEST SKIPPED: pip install playwright")


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory) -> Path:
    """The tiny chat model with room for long generations: the workload must outlive a few page frames."""
    return make_chat_model_dir(tmp_path_factory.mktemp("long-chat") / "tiny-chat", max_position_embeddings=8192)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


def tail(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 380) for _ in range(BLOCK + 5)]


@contextmanager
def running(url: str, prompts: list, headers: dict | None = None, max_tokens: int = 8000) -> Iterator[None]:
    """Stream long completions in background threads; leaving the block closes them (the server aborts)."""
    stop = threading.Event()
    errors: list[str] = []

    def stream(prompt) -> None:
        body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as response:
            if response.status_code != 200:
                errors.append(f"{response.status_code}: {response.read()!r}")
            for line in response.iter_lines():
                if stop.is_set():
                    return
                if line == "data: [DONE]":
                    errors.append("a request finished before the checks were done")

    threads = [threading.Thread(target=stream, args=(prompt,), daemon=True) for prompt in prompts]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors, errors


def open_dashboard(browser, server: ServerProcess, key: str | None = None):
    page = browser.new_page(viewport={"width": 1100, "height": 1300})
    page.goto(f"{server.url}/dashboard" + (f"#key={key}" if key else ""))
    return page


def wait_frames(page, more_than: int, timeout_s: float = 15) -> int:
    page.wait_for_function(f"Number(document.body.dataset.frames) > {more_than}", timeout=timeout_s * 1000)
    return int(page.evaluate("document.body.dataset.frames"))


def nodes_drawn(page) -> list[dict]:
    return page.evaluate("""[...document.querySelectorAll('#icicle rect.node')].map(r => ({
        id: r.dataset.id, kind: r.dataset.kind, tokens: Number(r.dataset.tokens), start: Number(r.dataset.start),
        refs: r.dataset.refs === '' ? null : Number(r.dataset.refs), namespace: JSON.parse(r.dataset.namespace)}))""")


def counts_drawn(page) -> dict[str, int]:
    return {name: int(page.inner_text(f"#count-{name}")) for name in ("free", "cached", "used", "shared")}


def screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    target = os.environ.get("KVSERVE_DASHBOARD_SCREENSHOT")
    if target and name == "dashboard-admin-tenants":
        shutil.copy(path, target)
    return path


def shared_prefix_nodes(page, refs: int, namespace: list[str]) -> list[dict]:
    return [node for node in nodes_drawn(page) if node["kind"] == "run" and node["start"] == 0
            and node["namespace"] == namespace and node["tokens"] == len(SHARED) and node["refs"] == refs]


def test_page_draws_the_pool_and_the_shared_prefix(long_model_dir, browser, tmp_path):
    with start_server(long_model_dir, num_blocks=2048) as server:
        page = open_dashboard(browser, server)
        wait_frames(page, 0)
        assert page.inner_text("#viewer") == "admin: whole cache"
        num_holders = 3
        with running(server.url, [SHARED + tail(seed) for seed in range(num_holders)]):
            # The three requests hold the prefix together: one node, three references.
            page.wait_for_function(
                "[...document.querySelectorAll('#icicle rect.node')].some(r => r.dataset.start === '0' && "
                f"r.dataset.tokens === '{len(SHARED)}' && r.dataset.refs === '{num_holders}')", timeout=60_000)
            page.click("#pause")
            frames = int(page.evaluate("document.body.dataset.frames"))
            assert len(shared_prefix_nodes(page, num_holders, [])) == 1
            starts_at_zero = [n for n in nodes_drawn(page) if n["kind"] == "run" and n["start"] == 0]
            assert len(starts_at_zero) == 1, starts_at_zero  # not three copies of the prefix
            drawn, sent = counts_drawn(page), page.evaluate("window.kvDashboard.drawn.pool")
            assert drawn == {name: sent[name] for name in drawn}
            assert drawn["shared"] >= len(SHARED) // BLOCK and sum(drawn[k] for k in ("free", "cached", "used")) == 2048
            text = page.evaluate("window.kvDashboard.drawn.tree.nodes.find(n => n.start_tokens === 0 && "
                                 "n.kind === 'run').text")
            assert isinstance(text, str) and text  # an admin sees the node's first tokens decoded
            screenshot(page, tmp_path, "dashboard-admin-live")
            time.sleep(1.5)
            assert int(page.evaluate("document.body.dataset.frames")) == frames  # paused: nothing redrawn
            page.click("#pause")
        metrics = wait_until_drained(server.url)
        frames = wait_frames(page, int(page.evaluate("document.body.dataset.frames")) + 1)
        wait_frames(page, frames)  # a frame drawn entirely after the drain
        drawn = counts_drawn(page)
        assert drawn == {"free": metrics["free"], "cached": metrics["cached"], "used": metrics["used"],
                         "shared": 0}, (drawn, metrics)
        assert drawn["cached"] > len(SHARED) // BLOCK  # the workload's blocks stayed cached
        series = page.evaluate("window.kvDashboard.drawn.series")
        assert len(series["time"]) >= 2 and max(series["running"]) >= 1 and max(series["computed_tps"]) > 0
        screenshot(page, tmp_path, "dashboard-admin-idle")
        page.close()


def test_a_tenant_sees_only_its_own_namespace(long_model_dir, browser, tmp_path):
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS_TOML)
    alice = {"Authorization": "Bearer sk-alice"}
    bob = {"Authorization": "Bearer sk-bob"}
    with start_server(long_model_dir, "--api-keys", str(keys), num_blocks=2048) as server:
        tenant_page = open_dashboard(browser, server, key="sk-alice")
        admin_page = open_dashboard(browser, server, key="sk-ops")
        wait_frames(tenant_page, 0)
        wait_frames(admin_page, 0)
        with running(server.url, [BOB_TEXT], headers=bob), \
                running(server.url, [SHARED + tail(seed) for seed in range(2)], headers=alice):
            tenant_page.wait_for_function(
                "[...document.querySelectorAll('#icicle rect.node')].some(r => r.dataset.start === '0' && "
                f"r.dataset.tokens === '{len(SHARED)}' && r.dataset.refs === '2')", timeout=60_000)
            admin_page.wait_for_function(
                "[...document.querySelectorAll('#icicle rect.node')].some(r => r.dataset.namespace.includes('bob'))",
                timeout=30_000)
            if os.environ.get("KVSERVE_DASHBOARD_SCREENSHOT"):
                time.sleep(6)  # the picture for docs/: a few seconds of time series
            tenant_page.click("#pause")
            admin_page.click("#pause")
            admin_page.hover("#icicle rect.node[data-kind='run'][data-start='0'][data-namespace*='alice']")
            mine = tenant_page.evaluate("window.kvDashboard.drawn")
            everything = admin_page.evaluate("window.kvDashboard.drawn")
            screenshot(tenant_page, tmp_path, "dashboard-tenant")
            screenshot(admin_page, tmp_path, "dashboard-admin-tenants")
        assert tenant_page.inner_text("#viewer") == "tenant alice: own namespace"
        assert len(shared_prefix_nodes(tenant_page, 2, ["alice", ""])) == 1
        assert {tuple(node["namespace"]) for node in nodes_drawn(tenant_page)} == {("alice", "")}
        # bob's words reach the admin's page and never alice's
        bob_words = "quick brown fox"
        assert any(bob_words in (node.get("text") or "") for node in everything["tree"]["nodes"])
        assert bob_words not in json.dumps(mine) and bob_words not in tenant_page.content()
        assert all(row["namespace"][0] == "alice" for row in mine["requests"]["running"])
        assert mine["series"] is None and mine["stats"] is None and mine["pool"]["free"] is None
        assert mine["pool"]["hidden"] > 0 and int(tenant_page.inner_text("#count-hidden")) == mine["pool"]["hidden"]
        assert httpx.get(f"{server.url}/v1/cache/snapshot", headers=bob).json()["viewer"]["tenant"] == "bob"
        assert httpx.get(f"{server.url}/v1/cache/snapshot").status_code == 401
        tenant_page.close()
        admin_page.close()
