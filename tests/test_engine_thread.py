"""One thread for the engine's OpenMP work (kvserve/openmp.py): `AsyncEngine.spawn` builds the engine on the
thread that steps it, serves like an engine built elsewhere, and hands a failed build to the caller;
`serial_thread` keeps a helper thread's torch ops on that thread (the tiers' loaders, the server's pools)
and leaves every other thread's count alone."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from kvserve.config import EngineConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import SamplingParams
from kvserve.openmp import serial_thread
from kvserve.serving.async_engine import AsyncEngine
from kvserve.tiers.codec import BlockCodec
from kvserve.tiers.host import HostStore
from kvserve.tiers.offload import OffloadPolicy
from kvserve.tiers.store import model_fingerprint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 9, 14, 3, 27, 8, 11]


def build_on_record(model_dir, threads: list[threading.Thread]):
    def build() -> LLMEngine:
        threads.append(threading.current_thread())
        return LLMEngine(EngineConfig(model=str(model_dir), num_blocks=64), progress=False)

    return build


async def tokens_of(engine: AsyncEngine, request_id: str) -> list[int]:
    final = None
    async for output in engine.generate(list(PROMPT), GREEDY, request_id):
        final = output
    return list(final.token_ids)


def test_spawn_builds_and_steps_on_one_thread_with_the_same_tokens(tiny_model_dir):
    built_on: list[threading.Thread] = []
    spawned = AsyncEngine.spawn(build_on_record(tiny_model_dir, built_on))
    elsewhere = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64), progress=False))
    elsewhere.start()
    try:
        assert spawned.is_alive and built_on[0] is not threading.main_thread()

        async def run() -> tuple[threading.Thread, list[int], list[int]]:
            stepping = await spawned.call(lambda _: threading.current_thread())
            return stepping, await tokens_of(spawned, "a"), await tokens_of(elsewhere, "b")

        stepping, ours, theirs = asyncio.run(run())
        assert stepping is built_on[0]
        assert ours == theirs and len(ours) == GREEDY.max_tokens
        spawned.start()  # already stepping on its own thread: nothing to start
    finally:
        spawned.shutdown()
        elsewhere.shutdown()
    assert not spawned.is_alive and not built_on[0].is_alive()


def test_spawn_reraises_a_failed_build_and_leaves_no_thread():
    before = set(threading.enumerate())

    def build() -> LLMEngine:
        raise ValueError("no such model: nowhere")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine.spawn(build, name="kvserve-engine-test")
    for thread in set(threading.enumerate()) - before:
        thread.join(5)
        assert not thread.is_alive(), thread.name


def in_thread(fn):
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_serial_thread_runs_that_threads_ops_alone_and_no_one_elses():
    before = torch.get_num_threads()
    assert in_thread(lambda: (serial_thread(), torch.get_num_threads())) == (True, 1)
    assert torch.get_num_threads() == before  # the caller's (and the engine's) count is untouched
    if before > 1:
        assert in_thread(torch.get_num_threads) == before  # a thread that did not ask keeps torch's count


def test_tier_loads_run_on_serial_threads():
    codec = BlockCodec.for_pool(torch.zeros(2, 2, 4, 4, 2, 8))
    policy = OffloadPolicy(codec, model_fingerprint(kv_dtype="float32", block_size=4, config={}),
                           host=HostStore(4 * codec.payload_bytes))
    assert policy._loader.submit(torch.get_num_threads).result() == 1


def test_an_engine_built_on_another_thread_is_named_in_the_log(tiny_model_dir, caplog):
    built_here = AsyncEngine(LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64), progress=False))
    spawned = AsyncEngine.spawn(build_on_record(tiny_model_dir, []))
    with caplog.at_level("WARNING", logger="kvserve.engine.step_threads"):
        built_here.start()
        asyncio.run(tokens_of(built_here, "x"))
        asyncio.run(tokens_of(spawned, "y"))
    built_here.shutdown()
    spawned.shutdown()
    warned = [r for r in caplog.records if "built on another thread" in r.getMessage()]
    assert len(warned) == (1 if torch.get_num_threads() > 1 else 0)


def test_each_new_stepping_thread_is_named_once(tiny_model_dir, caplog):
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), num_blocks=64), progress=False)

    def steps(tag: str) -> None:
        engine.add(engine.make_request(list(PROMPT), GREEDY, request_id=tag))
        while engine.has_unfinished_requests():
            engine.step()

    with caplog.at_level("WARNING", logger="kvserve.engine.step_threads"):
        steps("main")  # the thread that built it: nothing to say
        in_thread(lambda: (steps("other-1"), steps("other-2")))  # one warning for that thread
        steps("main-again")  # back on the builder: nothing
    warned = [r for r in caplog.records if "built on another thread" in r.getMessage()]
    assert len(warned) == (1 if torch.get_num_threads() > 1 else 0)
