"""Failure stays with its request: fault injection on the tiny model (issue 8, item 1).

A fault is injected for one request id (the model runner, the sampler, a group's decision, the
detokenizer): that request ends with an error, every other request's greedy output equals a run
without the fault, and every block comes back (KVSERVE_DEBUG_CHECKS=1 checks the pool each step). A
fault outside any request's work propagates out of `step()`; the async engine then fails every open
stream and calls its death callback.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import kvserve.engine.engine as engine_module
from conftest import assert_pool_drained, random_prompts
from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.failures import MAX_ALL_FAILED_STEPS, EngineLoopError
from kvserve.engine.groups.beam_search import BeamGroup
from kvserve.engine.groups.parallel import ParallelGroup
from kvserve.engine.params import BeamSearchParams, SamplingParams
from kvserve.server.launcher import free_port
from kvserve.serving.async_engine import AsyncEngine, EngineDeadError, RequestFailedError
from test_server_support import chat_model_dir, wait_until_drained  # noqa: F401 - a fixture

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BAD = "bad"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return random_prompts(5, 3, 40, seed=3)


def make_engine(model_dir, **kwargs) -> LLMEngine:
    kwargs.setdefault("num_blocks", 128)
    return LLMEngine(EngineConfig(model=str(model_dir), **kwargs), progress=False)


def run_all(engine: LLMEngine) -> dict[str, object]:
    finals = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    return finals


def submit(engine: LLMEngine, prompts, bad_params=GREEDY) -> None:
    for index, prompt in enumerate(prompts[1:]):
        engine.add_request(prompt, GREEDY, request_id=f"ok-{index}")
    engine.add_request(prompts[0], bad_params, request_id=BAD)


@pytest.fixture(scope="module")
def clean_outputs(tiny_model_dir, prompts) -> dict[str, list[int]]:
    engine = make_engine(tiny_model_dir)
    submit(engine, prompts)
    return {rid: out.token_ids for rid, out in run_all(engine).items()}


def _raise_for_bad(requests) -> None:
    if any(request.group_id == BAD for request in requests):
        raise RuntimeError("injected fault")


def inject_runner(engine: LLMEngine, monkeypatch) -> None:
    run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda items: (_raise_for_bad([i.request for i in items]),
                                                             run(items))[1])


def inject_sampler(engine: LLMEngine, monkeypatch) -> None:
    sample = engine_module.sample
    monkeypatch.setattr(engine_module, "sample", lambda logits, reqs: (_raise_for_bad(reqs), sample(logits, reqs))[1])


def inject_detokenizer(engine: LLMEngine, monkeypatch) -> None:
    append = engine_module.append_sampled_token

    def faulty(request, *args):
        reason = append(request, *args)
        if request.group_id == BAD and request.num_output_tokens == 3:  # fails mid-generation
            raise RuntimeError("injected fault")
        return reason
    monkeypatch.setattr(engine_module, "append_sampled_token", faulty)


def inject_group(group_class, monkeypatch) -> None:
    """The group's decision raises once its root has two tokens (a slots class: patch the class)."""
    decide = group_class.decide

    def faulty_decide(self, rows, logits):
        decisions = decide(self, rows, logits)
        if self.request_id == BAD and self.root.num_output_tokens >= 2:
            raise RuntimeError("injected fault")
        return decisions
    monkeypatch.setattr(group_class, "decide", faulty_decide)


INJECTORS = {"runner": inject_runner, "sampler": inject_sampler, "detokenizer": inject_detokenizer}


@pytest.mark.parametrize("where", sorted(INJECTORS))
def test_fault_fails_only_its_request(tiny_model_dir, prompts, clean_outputs, monkeypatch, where, caplog):
    engine = make_engine(tiny_model_dir)
    INJECTORS[where](engine, monkeypatch)
    submit(engine, prompts)
    finals = run_all(engine)
    bad = finals.pop(BAD)
    assert bad.finished and bad.finish_reason == "error"
    assert bad.error == f"internal error while generating (request id {BAD})"
    assert "injected fault" not in bad.error  # details only in the log
    assert "injected fault" in caplog.text
    assert {rid: out.token_ids for rid, out in finals.items()} == {
        rid: ids for rid, ids in clean_outputs.items() if rid != BAD}
    assert all(out.error is None and out.finish_reason == "length" for out in finals.values())
    assert_pool_drained(engine)
    assert not engine.groups


@pytest.mark.parametrize(("group_class", "params"), [
    (ParallelGroup, SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=5, ignore_eos=True)),
    (BeamGroup, BeamSearchParams(beam_width=3, max_tokens=12)),
], ids=["parallel", "beams"])
def test_group_fault_aborts_every_member(tiny_model_dir, prompts, clean_outputs, monkeypatch, group_class, params):
    engine = make_engine(tiny_model_dir)
    inject_group(group_class, monkeypatch)
    submit(engine, prompts, bad_params=params)
    finals = run_all(engine)
    assert finals.pop(BAD).finish_reason == "error"
    assert {rid: out.token_ids for rid, out in finals.items()} == {
        rid: ids for rid, ids in clean_outputs.items() if rid != BAD}
    assert_pool_drained(engine)


def test_engine_serves_on_after_a_failure(tiny_model_dir, prompts, clean_outputs, monkeypatch):
    engine = make_engine(tiny_model_dir)
    inject_runner(engine, monkeypatch)
    engine.add_request(prompts[0], GREEDY, request_id=BAD)
    assert run_all(engine)[BAD].finish_reason == "error"
    engine.add_request(prompts[1], GREEDY, request_id="ok-0")
    assert run_all(engine)["ok-0"].token_ids == clean_outputs["ok-0"]
    assert_pool_drained(engine)


def test_broken_forward_for_everyone_stops_the_engine(tiny_model_dir, prompts, monkeypatch):
    engine = make_engine(tiny_model_dir)
    monkeypatch.setattr(engine.runner, "run", lambda items: 1 / 0)
    for index in range(MAX_ALL_FAILED_STEPS):  # each alone in its step: every group fails, step after step
        engine.add_request(prompts[index % len(prompts)], GREEDY, request_id=f"r{index}")
        if index < MAX_ALL_FAILED_STEPS - 1:
            assert engine.step()[0].finish_reason == "error"
    with pytest.raises(EngineLoopError):
        engine.step()


def test_async_engine_reports_request_error_and_engine_death(tiny_model_dir, prompts, clean_outputs, monkeypatch):
    engine = make_engine(tiny_model_dir)
    inject_runner(engine, monkeypatch)
    deaths: list[BaseException] = []
    async_engine = AsyncEngine(engine, on_death=deaths.append)
    async_engine.start()

    async def one(request_id: str, prompt: list[int]) -> list[int]:
        tokens: list[int] = []
        async for output in async_engine.generate(prompt, GREEDY, request_id):
            tokens = output.token_ids
        return tokens

    async def scenario() -> None:
        results = await asyncio.gather(one(BAD, prompts[0]), one("ok-0", prompts[1]), return_exceptions=True)
        assert isinstance(results[0], RequestFailedError) and BAD in str(results[0])
        assert results[1] == clean_outputs["ok-0"]
        assert async_engine.is_alive and not deaths
        # A fault outside any request's work: the loop dies, open streams fail, the callback fires.
        monkeypatch.setattr(engine.scheduler, "schedule", lambda: 1 / 0)
        with pytest.raises(EngineDeadError) as info:
            await one("ok-1", prompts[2])
        assert "ZeroDivisionError" not in str(info.value)  # details only in the log
        assert not async_engine.is_alive and isinstance(deaths[0], ZeroDivisionError)

    try:
        asyncio.run(scenario())
    finally:
        async_engine.shutdown()


# --- the same through a real server subprocess --------------------------------------------------

POISON = [7, 7, 7, 7, 7]  # a prompt starting with these fails in the forward: one request's fault
FATAL = [9, 9, 9, 9, 9]  # ... makes scheduling raise: the engine loop's fault
FAULTY_SERVER = f"""
import sys
import kvserve.engine.model_runner as model_runner
import kvserve.engine.scheduler as scheduler

run, schedule = model_runner.ModelRunner.run, scheduler.Scheduler.schedule

def faulty_run(self, scheduled):
    if any(item.request.prompt_token_ids[:5] == {POISON} for item in scheduled):
        raise RuntimeError("injected forward fault")
    return run(self, scheduled)

def faulty_schedule(self):
    if any(request.prompt_token_ids[:5] == {FATAL} for request in self.waiting):
        raise RuntimeError("injected scheduler fault")
    return schedule(self)

model_runner.ModelRunner.run, scheduler.Scheduler.schedule = faulty_run, faulty_schedule
from kvserve.cli import main
sys.exit(main(["serve", *sys.argv[1:]]))
"""


@pytest.fixture
def faulty_server(tmp_path, chat_model_dir):  # noqa: F811 - the fixture imported above
    script = tmp_path / "faulty_server.py"
    script.write_text(FAULTY_SERVER)
    port = free_port()
    log = open(tmp_path / "server.log", "w")  # noqa: SIM115 - closed below
    process = subprocess.Popen(
        [sys.executable, str(script), "--model", str(chat_model_dir), "--num-blocks", "128",
         "--host", "127.0.0.1", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            assert process.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        yield url, process, tmp_path / "server.log"
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(30)
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _complete(url: str, prompt: list[int], stream: bool = False) -> httpx.Response:
    body = {"model": "tiny-chat", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_server_answers_500_for_the_failed_request_and_exits_1_when_the_loop_dies(faulty_server):
    url, process, log_path = faulty_server
    good = [11, 12, 13, 14, 15, 16]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_complete, url, POISON + [20, 21]), pool.submit(_complete, url, good),
                   pool.submit(_complete, url, POISON + [22], True), pool.submit(_complete, url, good[::-1])]
        bad, ok, bad_stream, ok_reversed = (future.result() for future in futures)
    assert bad.status_code == 500, bad.text
    error = bad.json()["error"]
    assert error["type"] == "internal_error"
    assert error["message"].startswith("internal error while generating (request id ")
    assert "injected" not in bad.text and "Traceback" not in bad.text  # details only in the log
    assert bad_stream.status_code == 200 and '"type": "internal_error"' in bad_stream.text
    assert bad_stream.text.rstrip().endswith("data: [DONE]")
    assert ok.status_code == 200 and ok_reversed.status_code == 200
    assert ok.json()["choices"][0]["text"] == _complete(url, good).json()["choices"][0]["text"]  # as alone
    wait_until_drained(url)
    assert _healthy(url)
    assert "injected forward fault" in log_path.read_text()
    # The engine loop itself fails: the request gets 503, the process exits 1 (a supervisor restarts it).
    fatal = _complete(url, FATAL)
    assert fatal.status_code == 503 and "injected" not in fatal.text
    assert process.wait(60) == 1
    assert "injected scheduler fault" in log_path.read_text()
