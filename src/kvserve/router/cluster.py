"""N `python -m kvserve.server` workers on this machine, on free ports (what `kvserve cluster` and the
router tests and benchmark start). Workers load their models in parallel; all are stopped together."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvserve.config import EngineConfig
from kvserve.server.launcher import ServerProcess, free_port, launch_server


def engine_argv(config: EngineConfig) -> list[str]:
    """The engine flags that recreate `config` (every field is a flag of the same name)."""
    argv: list[str] = []
    for name in EngineConfig.field_names():
        value = getattr(config, name)
        flag = "--" + name.replace("_", "-")
        if value is None or value is False:
            continue
        argv += [flag] if value is True else [flag, str(value)]
    return argv


@dataclass(slots=True)
class Cluster:
    workers: list[ServerProcess]

    @property
    def urls(self) -> list[str]:
        return [worker.url for worker in self.workers]

    @classmethod
    def start(cls, engine: EngineConfig, replicas: int, host: str = "127.0.0.1", api_keys: str | None = None,
              kv_events: bool = False, extra_args: Sequence[str] = ()) -> Cluster:
        return cls.start_args(engine_argv(engine), replicas, host, api_keys, kv_events, extra_args)

    @classmethod
    def start_args(cls, argv: Sequence[str], replicas: int, host: str = "127.0.0.1", api_keys: str | None = None,
                   kv_events: bool = False, extra_args: Sequence[str] = ()) -> Cluster:
        if replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {replicas}")
        common = [*argv, *extra_args, *(["--api-keys", api_keys] if api_keys else [])]
        argvs = [[*common, *worker_events_argv(host)] if kv_events else common for _ in range(replicas)]
        with ThreadPoolExecutor(replicas) as pool:
            futures = [pool.submit(launch_server, args, host) for args in argvs]
        started = [future.result() for future in futures if future.exception() is None]
        errors = [future.exception() for future in futures if future.exception() is not None]
        if errors:
            for worker in started:
                worker.terminate(timeout=10)
            raise RuntimeError(f"{len(errors)} of {replicas} workers failed to start: {errors[0]}")
        return cls(started)

    def stop(self) -> None:
        for worker in self.workers:
            worker.terminate()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def worker_events_argv(host: str) -> list[str]:
    return ["--kv-events-endpoint", f"tcp://{host}:{free_port(host)}",
            "--kv-events-replay-endpoint", f"tcp://{host}:{free_port(host)}"]
