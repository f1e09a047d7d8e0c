"""Settings from a YAML file (`--config FILE`) and `KVSERVE_*` environment variables, over argparse.

The flags are defined once, as argparse actions (cli.py); this module only supplies other sources
for the same actions, so nothing is declared twice. A YAML key or an environment variable names a
flag by its destination (`max_num_seqs`, `KVSERVE_MAX_NUM_SEQS`; YAML also takes `max-num-seqs`) and
is converted and checked exactly as the flag's own value would be. Precedence, highest first:
command line, environment, config file, built-in default -- as vLLM's `--config` and pydantic-settings.

    # serve.yaml
    model: smollm2-135m
    served-model-name: [smol, default]
    max_num_seqs: 32
    api-key: [sk-one, sk-two]

Unknown YAML keys are an error naming the key; unknown `KVSERVE_*` variables are ignored (the
environment is shared with other tools).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ENV_PREFIX = "KVSERVE_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_SKIPPED = ("help", "version", "config")  # destinations never read from a file or the environment


class SettingsError(ValueError):
    """A config-file key or environment variable that does not name a flag or has a bad value."""


def settable_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's actions by destination (positionals included), minus help/version/config."""
    return {action.dest: action for action in parser._actions
            if action.dest not in _SKIPPED and action.dest is not argparse.SUPPRESS}


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A YAML mapping of settings; SettingsError if unreadable or not a mapping."""
    import yaml

    try:
        document = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise SettingsError(f"cannot read config file {path}: {err}") from err
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise SettingsError(f"config file {path}: expected a mapping of setting: value")
    return document


def defaults_from_sources(
    parser: argparse.ArgumentParser, file_values: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, Any]:
    """Converted values for the parser's actions: the config file's, overridden by the environment's."""
    actions = settable_actions(parser)
    values: dict[str, Any] = {}
    for key, raw in file_values.items():
        dest = str(key).replace("-", "_")
        if dest not in actions:
            raise SettingsError(f"config file: unknown setting {key!r} (see --help)")
        values[dest] = _convert(actions[dest], raw, f"config file setting {key!r}")
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        dest = name[len(ENV_PREFIX):].lower()
        if dest in actions:
            values[dest] = _convert(actions[dest], _split_env(actions[dest], raw), f"environment variable {name}")
    return values


def apply_sources(
    parser: argparse.ArgumentParser, argv: Sequence[str], environ: Mapping[str, str] | None = None
) -> None:
    """Make the config file named by `--config` in `argv`, and the environment, the parser's defaults."""
    environ = os.environ if environ is None else environ
    probe = argparse.ArgumentParser(add_help=False)
    probe.add_argument("--config", default=environ.get(f"{ENV_PREFIX}CONFIG"))
    known, _ = probe.parse_known_args(list(argv))
    file_values = load_yaml(known.config) if known.config else {}
    parser.set_defaults(**defaults_from_sources(parser, file_values, environ))


def _split_env(action: argparse.Action, raw: str) -> Any:
    if _takes_list(action):
        return [item for item in raw.replace(",", " ").split() if item]
    return raw


def _takes_list(action: argparse.Action) -> bool:
    return action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction | argparse._ExtendAction)


def _convert(action: argparse.Action, raw: Any, source: str) -> Any:
    """`raw` as the action would have stored it from the command line, or SettingsError."""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return _boolean(raw, source)
    if _takes_list(action):
        items = raw if isinstance(raw, list) else [raw]
        return [_scalar(action, item, source) for item in items]
    if isinstance(raw, list | dict):
        raise SettingsError(f"{source}: expected a single value, got {raw!r}")
    return _scalar(action, raw, source)


def _scalar(action: argparse.Action, raw: Any, source: str) -> Any:
    if raw is None:
        return None
    try:
        value = action.type(raw if isinstance(raw, str) else str(raw)) if action.type else str(raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
        raise SettingsError(f"{source}: invalid value {raw!r}: {err}") from err
    if action.choices is not None and value not in action.choices:
        raise SettingsError(f"{source}: {value!r} is not one of {list(action.choices)}")
    return value


def _boolean(raw: Any, source: str) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise SettingsError(f"{source}: expected true or false, got {raw!r}")
