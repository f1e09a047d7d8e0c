"""The command line: `kvserve generate` prints a completion; bad flags give a clear error and exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import build_parser, engine_config_from_args, main
from test_server_support import make_chat_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model_dir(tmp_path_factory.mktemp("cli-model"))


def test_generate_prints_the_greedy_completion(model_dir, capsys):
    assert main(["generate", "hello there", "--model", str(model_dir), "--max-tokens", "6",
                 "--ignore-eos", "--num-blocks", "64"]) == 0
    printed = capsys.readouterr().out.rstrip("\n")
    llm = LLM(str(model_dir), progress=False, num_blocks=64)
    expected = llm.generate(["hello there"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert printed == expected.text


def test_generate_chat_uses_the_template(model_dir, capsys):
    assert main(["generate", "hi", "--chat", "--model", str(model_dir), "--max-tokens", "3", "--stats"]) == 0
    assert "used_blocks" in capsys.readouterr().err


def test_bad_values_exit_2_with_message(model_dir, capsys):
    assert main(["generate", "hi", "--model", str(model_dir), "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "no-such-model"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_engine_flags_map_to_config():
    args = build_parser().parse_args(["serve", "--block-size", "32", "--kv-cache-memory", "1GiB",
                                      "--prefix-cache", "hash", "--schedule-policy", "lpm"])
    config = engine_config_from_args(args)
    assert (config.block_size, config.kv_cache_memory, config.prefix_cache, config.schedule_policy) == (
        32, 1024**3, "hash", "lpm")
