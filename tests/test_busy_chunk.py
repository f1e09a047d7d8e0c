"""Busy chunking (`engine/busy_chunk.py`, `--long-prefill-busy-tokens`): while the server has had requests
at once within the last seconds, a prompt computing at least 512 tokens computes at most 96 a step (the CPU
default), alone or beside others; a server used one request at a time, a short prompt, or the setting at 0
keeps the usual rule (a prompt alone whole, beside others at the long-prefill threshold). Chunking never
changes an output."""

from __future__ import annotations

import pytest

from conftest import assert_pool_drained
from kvserve.config import EngineConfig
from kvserve.engine.busy_chunk import BUSY_CHUNK_TOKENS, BUSY_MEMORY_S, BUSY_MIN_UNCACHED, BusyChunking
from kvserve.engine.engine import LLMEngine
from kvserve.engine.params import SamplingParams
from test_server_support import make_chat_model_dir

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
LONG = [7 + i % 300 for i in range(1100)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_chat_model_dir(tmp_path_factory.mktemp("busy") / "tiny-4k", max_position_embeddings=4096)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rule():
    clock = Clock()
    busy = BusyChunking(96, clock=clock)
    assert busy.chunk(1072, 1072) == 1072  # never contended: whole
    busy.note(False)
    assert busy.chunk(1072, 1072) == 1072
    busy.note(True)
    assert busy.chunk(1072, 1072) == 96
    assert busy.chunk(1072, 50) == 50  # what remains is under a chunk
    assert busy.chunk(BUSY_MIN_UNCACHED - 1, 400) == 400  # a short prompt is never split alone
    clock.now += BUSY_MEMORY_S
    assert busy.chunk(1072, 1072) == 96  # still within the memory
    clock.now += 0.01
    assert busy.chunk(1072, 1072) == 1072  # quiet for longer: whole again
    off = BusyChunking(0, clock=clock)
    off.note(True)
    assert off.chunk(1072, 1072) == 1072


def make_engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), num_blocks=512, **kwargs), progress=False)


def run_all(engine: LLMEngine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] = list(output.token_ids)  # cumulative: the latest is the whole output
    return tokens


def contend(engine: LLMEngine) -> None:
    """Two requests at once, run to the end: the server has been busy."""
    engine.add_request([5, 6, 7], GREEDY, request_id="a")
    engine.add_request([5, 6, 8], GREEDY, request_id="b")
    run_all(engine)


def first_step_tokens(engine: LLMEngine, prompt: list[int], request_id: str = "lone") -> int:
    """Prompt tokens the lone request's first step computes (the step is then run, so the engine moves on)."""
    engine.add_request(prompt, SamplingParams(max_tokens=1), request_id=request_id)
    tokens = engine.scheduler.schedule().num_tokens
    engine.abort_request(request_id)
    assert_pool_drained(engine)
    return tokens


def test_a_lone_long_prompt_is_chunked_only_while_busy(model_dir):
    engine = make_engine(model_dir)
    assert engine.scheduler.busy.tokens == BUSY_CHUNK_TOKENS  # the CPU default
    budget = engine.config.max_num_batched_tokens
    assert first_step_tokens(engine, LONG, "fresh") == min(len(LONG), budget)  # one request at a time so far
    contend(engine)
    assert first_step_tokens(engine, LONG, "busy") == BUSY_CHUNK_TOKENS
    assert first_step_tokens(engine, LONG[:400], "short") == 400  # under 512 tokens: whole
    clock = Clock()
    engine.scheduler.busy.clock = clock
    engine.scheduler.busy.contended_at = clock.now - BUSY_MEMORY_S - 1  # quiet for longer than the memory
    assert first_step_tokens(engine, LONG, "quiet") == min(len(LONG), budget)


def long_chunk_beside_another(engine: LLMEngine) -> int:
    engine.add_request([5, 6, 7], GREEDY, request_id="short")
    engine.step()  # its prompt computed: it decodes beside the long one
    engine.add_request(LONG, GREEDY, request_id="long")
    output = engine.scheduler.schedule()
    chunk = next(item.num_new_tokens for item in output.scheduled if item.request.request_id == "long")
    engine.abort_request("short")
    engine.abort_request("long")
    assert_pool_drained(engine)
    return chunk


def test_beside_others_the_smaller_chunk(model_dir):
    threshold = make_engine(model_dir).scheduler.long_prefill_token_threshold
    assert threshold > BUSY_CHUNK_TOKENS  # 163 at 4k context
    assert long_chunk_beside_another(make_engine(model_dir)) == BUSY_CHUNK_TOKENS
    assert long_chunk_beside_another(make_engine(model_dir, long_prefill_busy_tokens=0)) == threshold


def test_off(model_dir):
    engine = make_engine(model_dir, long_prefill_busy_tokens=0)
    contend(engine)
    assert first_step_tokens(engine, LONG) == min(len(LONG), engine.config.max_num_batched_tokens)


def test_a_newcomer_runs_beside_the_chunks_and_outputs_are_unchanged(model_dir):
    """A busy server's lone long prompt in chunks; a short request arriving after its first chunk gets its
    first token the next step, in a step of its own; both outputs equal a server's that never chunks alone."""
    outputs = {}
    for setting in (0, None):
        engine = make_engine(model_dir, long_prefill_busy_tokens=setting)
        contend(engine)
        engine.add_request(LONG, GREEDY, request_id="long")
        steps = [engine.step()]
        engine.add_request([9, 10, 11], GREEDY, request_id="short")
        steps.append(engine.step())
        if setting is None:
            assert [(o.request_id, len(o.token_ids)) for o in steps[0]] == []  # a 96-token chunk: no token yet
            assert [o.request_id for o in steps[1] if o.token_ids] == ["short"]
        outputs[setting] = run_all(engine)
        assert_pool_drained(engine)
    assert outputs[None]["long"] == outputs[0]["long"] and len(outputs[0]["long"]) == 4
    assert outputs[None]["short"] == outputs[0]["short"]


def test_a_negative_setting_names_the_field():
    with pytest.raises(ValueError, match="long_prefill_busy_tokens"):
        EngineConfig(long_prefill_busy_tokens=-1)


def test_defaults_on_a_cpu_only():
    """96 on a CPU; off on a GPU (a long prompt's step is short there) and offline (`LLM`: no newcomer
    arrives while a batch runs); an explicit value wins; the serve flag reaches the config."""
    import argparse

    from kvserve.cli import add_engine_flags, engine_config_from_args
    from kvserve.engine.setup import make_busy_chunking
    from kvserve.engine_args import engine_config

    assert make_busy_chunking(EngineConfig()).tokens == BUSY_CHUNK_TOKENS
    assert make_busy_chunking(EngineConfig(device="cuda")).tokens == 0
    assert make_busy_chunking(EngineConfig(device="cuda", long_prefill_busy_tokens=64)).tokens == 64
    assert engine_config("smollm2-135m", {}).long_prefill_busy_tokens == 0
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config_from_args(parser.parse_args([])).long_prefill_busy_tokens is None  # the default above
    args = parser.parse_args(["--long-prefill-busy-tokens", "0"])
    assert engine_config_from_args(args).long_prefill_busy_tokens == 0
