"""Build the tiers an engine asked for: settings in, an `OffloadPolicy` (or None: every tier off) out."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.tiers.codec import BlockCodec
from kvserve.tiers.disk import DiskStore
from kvserve.tiers.host import HostStore
from kvserve.tiers.offload import OffloadPolicy
from kvserve.tiers.store import ModelFingerprint, file_digest, model_fingerprint

_WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin")


@dataclass(slots=True)
class TierSettings:
    """Which tiers to build; 0 bytes / None turns a tier off."""

    host_bytes: int = 0
    disk_dir: str | None = None
    disk_bytes: int = 0
    remote_url: str | None = None
    remote_ttl_s: float | None = None
    remote_timeout_s: float = 0.5

    @property
    def any(self) -> bool:
        return self.host_bytes > 0 or self.disk_dir is not None or self.remote_url is not None

    @property
    def persistent(self) -> bool:
        """Whether blocks outlive this process (disk) or leave it (remote): keys must then name the weights."""
        return self.disk_dir is not None or self.remote_url is not None


def make_offload_policy(
    settings: TierSettings, pool_tensor: torch.Tensor, fingerprint: ModelFingerprint
) -> OffloadPolicy | None:
    if not settings.any:
        return None
    host = HostStore(settings.host_bytes) if settings.host_bytes > 0 else None
    disk = DiskStore(settings.disk_dir, settings.disk_bytes) if settings.disk_dir is not None else None
    remote = None
    if settings.remote_url is not None:
        from kvserve.tiers.redis import RedisStore  # the redis client is ~0.07 s to import: only when used

        remote = RedisStore(settings.remote_url, ttl_s=settings.remote_ttl_s, timeout_s=settings.remote_timeout_s)
    return OffloadPolicy(BlockCodec.for_pool(pool_tensor), fingerprint, host=host, disk=disk, remote=remote)


def weights_digest(path: str | Path) -> str:
    """SHA-256 over the weight files at `path` (a GGUF file or a model directory), names included."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES)
    combined = hashlib.sha256()
    for file in files:
        combined.update(file.name.encode() + b"\0" + file_digest(file).encode())
    return combined.hexdigest()


def engine_fingerprint(
    *, model_config: Mapping[str, Any], tensor_shapes: Mapping[str, Sequence[int]], kv_dtype: torch.dtype,
    block_size: int, weights_path: str | Path | None,
) -> ModelFingerprint:
    """Weights digest when `weights_path` is given (disk/remote tiers: blocks outlive or leave the
    process), else config + tensor shapes (host only: the process's own weights)."""
    digest = weights_digest(weights_path) if weights_path is not None else None
    return model_fingerprint(
        kv_dtype=str(kv_dtype).removeprefix("torch."), block_size=block_size, weights_digest=digest,
        config=dict(model_config), tensor_shapes=tensor_shapes,
    )
