"""Compile the native kernels into a per-user cache, keyed by a digest of the sources and flags.

The library is a plain C ABI (ctypes, no Python headers or torch headers), so it builds in seconds with
nothing but g++: `make install` runs ``python -m kvserve.kernels.build`` once, and a process that finds
no library builds it on first use. The compile writes to a temporary name and renames, so concurrent
builders never load a half-written file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")


def sources() -> list[Path]:
    """Every source the library is compiled from (kernels.cpp includes the headers): all of csrc, so a new
    header can never be left out of the digest (a stale library would load)."""
    return sorted(path for pattern in ("*.cpp", "*.h") for path in CSRC.glob(pattern))

# -ffp-contract=off: dequantization must round d*q and +m separately, exactly as gguf's numpy reader.
FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off", "-Wno-maybe-uninitialized")


def cache_dir() -> Path:
    """Where built libraries live: $KVSERVE_KERNELS_CACHE, else $XDG_CACHE_HOME/kvserve/kernels."""
    if override := os.environ.get("KVSERVE_KERNELS_CACHE"):
        return Path(override)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvserve" / "kernels"


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (install g++, e.g. apt-get install -y g++)")
    return cxx


def library_path(cxx: str | None = None) -> Path:
    """The cache path for the current sources, flags and compiler."""
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join((cxx or compiler(), *FLAGS)).encode())
    return cache_dir() / f"libkvkernels-{digest.hexdigest()[:16]}.so"


def build(force: bool = False) -> Path:
    """Build (unless already cached) and return the library's path; RuntimeError with g++'s output."""
    cxx = compiler()
    target = library_path(cxx)
    if target.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so.tmp", delete=False) as tmp:
        tmp_path = Path(tmp.name)
    command = [cxx, *FLAGS, "-o", str(tmp_path), str(CSRC / "kernels.cpp")]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"building native kernels failed ({' '.join(command)}):\n{result.stderr[-4000:]}")
        os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)
    return target


def main() -> int:
    try:
        print(f"native kernels: {build(force='--force' in sys.argv)}")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        # Not fatal for installation: kvserve falls back to its torch kernels and says so when it starts.
        print(f"native kernels not built: {err}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
