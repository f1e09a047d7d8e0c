"""The engine's shape: no import cycle inside engine/, small files, invariants checked on the live
engine after every step, forks that respect max_num_seqs, and one set of documented flags."""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import os
from pathlib import Path

import pytest

from conftest import assert_pool_drained, random_prompts
from kvserve import LLM, BeamSearchParams, SamplingParams
from kvserve.kv.block_allocator import BlockAllocator
from kvserve.prefix.base import NoPrefixCache

SRC = Path(__file__).resolve().parents[1] / "src"
ENGINE = SRC / "kvserve" / "engine"
MAX_FILE_LINES = 400


# --- imports and sizes ---------------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Every module in `known` that `path` imports anywhere (TYPE_CHECKING blocks and functions too)."""
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name in known)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_inside_engine():
    files = sorted(ENGINE.rglob("*.py"))
    known = {module_name(path) for path in files}
    graph = {module_name(path): imported_modules(path, known) - {module_name(path)} for path in files}
    assert "kvserve.engine.groups.base" in graph["kvserve.engine.groups.parallel"]  # the walk sees imports
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_no_source_file_over_400_lines():
    sizes = {str(path.relative_to(SRC)): len(path.read_text().splitlines()) for path in SRC.rglob("*.py")}
    assert not {name: n for name, n in sizes.items() if n > MAX_FILE_LINES}


def test_no_benchmark_script_shadows_an_installed_package():
    """`python benchmarks/X.py` puts benchmarks/ first on sys.path, so a script named like an installed package
    is what `import that_package` finds, for the script and every library it loads: benchmarks/kernels.py hid
    HF's `kernels`, which transformers 5.25 imports, and every benchmark beside transformers failed to start."""
    installed = set(importlib.metadata.packages_distributions())
    scripts = {path.stem for path in (SRC.parent / "benchmarks").glob("*.py")}
    assert "torch" in installed  # the listing sees this environment's packages
    assert not scripts & installed


# --- invariants on the live engine --------------------------------------------------------------------


def test_the_suite_runs_with_debug_checks(tiny_model_dir):
    assert os.environ.get("KVSERVE_DEBUG_CHECKS") == "1"  # set by conftest for every test and server
    assert LLM(str(tiny_model_dir), progress=False, num_blocks=32).engine.debug_checks


def test_a_corrupted_pool_fails_the_next_step(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), progress=False, num_blocks=32).engine
    engine.add_request(list(range(3, 40)), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()
    held = engine.scheduler.running[0].block_table[0]
    engine.block_manager.allocator.incref(held)  # a reference nobody holds
    with pytest.raises(AssertionError, match=f"block {held}"):
        engine.step()


def test_no_prefix_cache_checks_its_accounting():
    allocator = BlockAllocator(4)
    cache = NoPrefixCache(allocator, 16)
    (block,) = allocator.allocate(1)
    cache.check_invariants()
    allocator.decref(block)  # dropped without going back to the free list: leaked
    with pytest.raises(AssertionError, match="leaked"):
        cache.check_invariants()


# --- forks beyond max_num_seqs --------------------------------------------------------------------------


def test_forks_beyond_max_num_seqs_wait_and_match_the_unconstrained_run(tiny_model_dir):
    prompt = random_prompts(1, 40, 40, seed=11)[0]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, n=5, ignore_eos=True)
    free = LLM(str(tiny_model_dir), progress=False, num_blocks=128)
    tight = LLM(str(tiny_model_dir), progress=False, num_blocks=128, max_num_seqs=2)
    expected = [c.token_ids for c in free.generate([prompt], params)[0].outputs]
    assert [c.token_ids for c in tight.generate([prompt], params)[0].outputs] == expected
    beams = BeamSearchParams(4, max_tokens=6)
    expected_beams = [c.token_ids for c in free.beam_search([prompt], 4, 6)[0].outputs]
    tight.engine.add_request(prompt, beams, request_id="beam")
    while tight.engine.has_unfinished_requests():
        outputs = tight.engine.step()
        assert len(tight.engine.scheduler.running) <= 2
    assert [c.token_ids for c in outputs[0].outputs] == expected_beams
    assert_pool_drained(tight.engine)


# --- flags -----------------------------------------------------------------------------------------------


def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.option_strings[-1]: action for action in parser._actions
            if action.option_strings and action.dest != "help"}


def test_both_server_entry_points_take_the_same_documented_flags(capsys):
    from kvserve.cli import build_parser
    from kvserve.server.__main__ import main as server_main

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for parser in subparsers.choices.values():
        assert issubclass(parser.formatter_class, argparse.ArgumentDefaultsHelpFormatter)
        for flag, action in option_actions(parser).items():
            assert action.help, f"{parser.prog} {flag} has no help"
        help_text = " ".join(parser.format_help().split())
        assert help_text.count("(default:") >= len(option_actions(parser)) - 1, parser.prog  # --version
    # `python -m kvserve.server` is `kvserve serve`: the same parser, so the same help.
    with pytest.raises(SystemExit):
        server_main(["serve", "--help"])
    server_help = capsys.readouterr().out
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert capsys.readouterr().out == server_help
