"""Server settings beyond the engine's: served names, keys, chat template, CORS, logging (vLLM's flags).

The flags themselves are defined once in cli.py (`add_server_flags`); `ServerOptions` is what they
become, checked here so a bad value fails before the slow model load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jinja2

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
STATS_LOG_INTERVAL_S = 10.0
DEFAULT_MAX_QUEUE = 256
GRACEFUL_SHUTDOWN_S = 30.0


@dataclass(frozen=True, slots=True)
class ServerOptions:
    """`served_model_names` empty: the engine's model name. `api_keys` are operator keys (full access,
    single-tenant namespace), beside the tenant key file. `allowed_origins` empty: no CORS headers."""

    served_model_names: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    chat_template: str | None = None
    log_level: str = "info"
    allowed_origins: tuple[str, ...] = ()
    stats_log_interval: float = STATS_LOG_INTERVAL_S
    dashboard: bool | None = None  # None: on with API keys or on a loopback host
    role: str = "mixed"  # --role (server/roles.py)
    prefill_flush_timeout: float = 2.0
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path) of each `--lora-modules name=path`

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        if any(not name.strip() for name in self.served_model_names):
            raise ValueError("served_model_name: names must be non-empty")
        if len(set(self.served_model_names)) != len(self.served_model_names):
            raise ValueError(f"served_model_name: duplicate names in {list(self.served_model_names)}")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names) or set(names) & set(self.served_model_names):
            raise ValueError(f"lora_modules: adapter names must be unique and differ from the served names: {names}")
        if self.stats_log_interval < 0:
            raise ValueError(f"stats_log_interval must be >= 0, got {self.stats_log_interval}")

    def model_names(self, engine_model_name: str) -> tuple[str, ...]:
        """The names requests may use; the first is the one reported (and the metrics' label)."""
        return self.served_model_names or (engine_model_name,)


def resolve_chat_template(value: str) -> str:
    """`--chat-template`: a file's contents, or the value itself when it is inline Jinja; the template
    must compile. ValueError otherwise (as vLLM: a path that does not exist and is not a template)."""
    path = Path(value)
    looks_inline = any(mark in value for mark in ("{{", "{%"))
    if not looks_inline:
        try:
            value = path.read_text(encoding="utf-8")
        except OSError as err:
            raise ValueError(f"chat_template: {value!r} is neither a readable file nor a Jinja template: "
                             f"{err}") from err
    try:
        jinja2.Environment().parse(value)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"chat_template: invalid Jinja at line {err.lineno}: {err.message}") from err
    return value


def parse_lora_modules(values: list[str]) -> tuple[tuple[str, str], ...]:
    """`--lora-modules name=path ...` -> ((name, path), ...); ValueError naming a malformed entry."""
    modules = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora_modules: expected name=path, got {value!r}")
        modules.append((name.strip(), path.strip()))
    return tuple(modules)
