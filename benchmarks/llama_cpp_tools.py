"""llama.cpp's own tools as kvserve's peers: llama-batched-bench, llama-server and llama-perplexity.

llama-cpp-python (the `bench` extra) runs batch requests one at a time, so llama.cpp's real batched paths
(its batched decode, its server's continuous batching over parallel slots) were never measured against
kvserve. This module builds those tools from the llama.cpp source that llama-cpp-python's sdist vendors
(same version as the installed bindings, so the same llama.cpp), CPU only, native ISA, into the
git-ignored cache benchmarks/.llama.cpp/, and wraps them for benchmarks/native_kernels.py and perplexity.py.

    python benchmarks/llama_cpp_tools.py          # build (skipped if built), then llama-batched-bench 1/8/32
    python benchmarks/llama_cpp_tools.py --build  # only build

Benchmark-only: nothing in `make test` needs it. Building takes 10-20 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".llama.cpp"
TARGETS = ("llama-batched-bench", "llama-perplexity", "llama-server")  # the small ones first


def log(message: str) -> None:
    print(f"[llama.cpp tools] {message}", flush=True)


def bindings_version() -> str:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError as exc:
        raise SystemExit("llama-cpp-python is not installed: `pip install -e .[bench]`") from exc


def _cmake() -> str:
    """cmake from PATH or the venv (the `bench` extra installs it); pip-install it if neither."""
    local = Path(sys.executable).parent / "cmake"
    found = shutil.which("cmake")
    if found:
        return found
    if local.exists():
        return str(local)
    log("cmake missing: pip install cmake")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "cmake"], check=True)
    return str(local)


def source_dir(version: str) -> Path:
    """llama.cpp's source as vendored by the llama-cpp-python sdist of `version` (downloaded once)."""
    root = CACHE / f"llama_cpp_python-{version}"
    source = root / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").exists():
        return source
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"llama_cpp_python-{version}.tar.gz"
    if not archive.exists():
        log(f"downloading the llama-cpp-python {version} sdist")
        # only llama-cpp-python as an sdist; pip builds its metadata with its backend's wheels
        subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-binary",
                        "llama-cpp-python", "--no-deps", "-d", str(CACHE)], check=False)
        if not archive.exists():
            raise SystemExit(f"pip download left no {archive}")
    log(f"extracting {archive.name}")
    with tarfile.open(archive) as tar:
        tar.extractall(CACHE, filter="data")
    if not (source / "CMakeLists.txt").exists():
        raise SystemExit(f"{archive} has no vendor/llama.cpp/CMakeLists.txt")
    return source


def build_dir(version: str, avx2: bool | None = None) -> Path:
    """Where the tools of `version` are built: the AVX2 build with `avx2` (None: as KVSERVE_ISA says)."""
    if forced_avx2() if avx2 is None else avx2:
        return CACHE / f"build-{version}-avx2"
    return CACHE / (f"build-{version}-noamx" if has_amx() else f"build-{version}")


def built(avx2: bool | None = None) -> bool:
    """Whether every tool is built (for callers that should not start a 10-20 minute build)."""
    try:
        return all((build_dir(bindings_version(), avx2) / "bin" / name).exists() for name in TARGETS)
    except SystemExit:
        return False


def tool(name: str, avx2: bool | None = None) -> Path:
    """The path of a built tool; builds everything first if it is missing (not the AVX2 build: `--build`
    with KVSERVE_ISA=avx2 makes that one)."""
    path = build_dir(bindings_version(), avx2) / "bin" / name
    if avx2 and not path.exists():
        raise SystemExit(f"{path} is not built: KVSERVE_ISA=avx2 python benchmarks/llama_cpp_tools.py --build")
    if not path.exists():
        build(targets=(name,))
    return path


# llama.cpp 0.3.36 (llama-cpp-python's) built with -march=native on a CPU with AMX compiles its AMX backend,
# which segfaulted in ggml_backend_amx_mul_mat on the first batch of the default Q4_1 model (Intel Xeon with
# AMX-INT8/BF16, 2026-12-01): there the peers are built for the same ISA without it -- AVX-512 with VNNI and
# BF16, llama.cpp's fastest path that runs. The same flags go into CMAKE_ARGS for llama-cpp-python (below).
NO_AMX_ARGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
               "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
               "-DGGML_AMX_BF16=OFF")


# KVSERVE_ISA=avx2 (kvserve's narrower path, forced) builds the peers for AVX2 / FMA too, into their own
# directory: on an AVX-512 machine that pairs the two AVX2 paths, as an AVX2-only CPU would run them.
AVX2_ARGS = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
             "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_BF16=OFF")


def forced_avx2() -> bool:
    from kvserve.kernels.ops import ISA_ENV

    return os.environ.get(ISA_ENV) == "avx2"


def has_amx() -> bool:
    from kvserve.kernels.native import cpu_flags

    return "amx_int8" in cpu_flags()


def isa_args() -> tuple[str, ...]:
    """-march=native, except on a CPU with AMX (see NO_AMX_ARGS). For llama-cpp-python on such a CPU:
    CMAKE_ARGS="$(python benchmarks/llama_cpp_tools.py --cmake-args)" pip install --force-reinstall --no-deps
    --no-cache-dir --no-binary llama-cpp-python llama-cpp-python==<version> (without --no-cache-dir pip reuses
    the wheel it built before, AMX and all)."""
    if forced_avx2():
        return AVX2_ARGS
    return NO_AMX_ARGS if has_amx() else ("-DGGML_NATIVE=ON",)


def build(jobs: int = 2, targets: tuple[str, ...] = TARGETS) -> Path:
    """Configure and build only `targets` (CPU, native ISA but AMX, Release); idempotent."""
    version = bindings_version()
    out = build_dir(version)
    if all((out / "bin" / name).exists() for name in targets):
        log(f"already built in {out.relative_to(HERE.parent)}")
        return out
    source = source_dir(version)
    cmake = _cmake()
    if not (out / "CMakeCache.txt").exists():
        log(f"configuring (CPU only, {' '.join(isa_args())}, Release)")
        subprocess.run([cmake, "-S", str(source), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release",
                        *isa_args(), "-DGGML_CUDA=OFF", "-DGGML_METAL=OFF", "-DGGML_VULKAN=OFF",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                        "-DBUILD_SHARED_LIBS=OFF"], check=True)
    for name in targets:
        if (out / "bin" / name).exists():
            continue
        log(f"building {name} (-j{jobs})")
        start = time.perf_counter()
        subprocess.run([cmake, "--build", str(out), "--target", name, f"-j{jobs}"], check=True)
        log(f"{name} built in {time.perf_counter() - start:.0f} s")
    return out


@dataclass(slots=True)
class BatchedBench:
    """One llama-batched-bench row: `batch` sequences, each `prompt` tokens then `generated` tokens."""

    prompt: int
    generated: int
    batch: int
    prefill_seconds: float
    prefill_tok_s: float  # S_PP
    decode_seconds: float
    decode_tok_s: float  # S_TG: generated tokens / decode time
    total_seconds: float

    @property
    def generated_per_wall_s(self) -> float:
        """Generated tokens / (prefill + decode) time: how native_kernels.py counts its batch figures."""
        return self.batch * self.generated / self.total_seconds


def batched_bench(model: Path, prompt: int, generated: int, batches: list[int], threads: int = 2,
                  avx2: bool | None = None) -> list[BatchedBench]:
    """llama-batched-bench at each batch size (separate prompts per sequence, as real requests have)."""
    context = max(batches) * (prompt + generated) + 64
    command = [str(tool("llama-batched-bench", avx2)), "-m", str(model), "-c", str(context), "-b", "2048", "-ub", "512",
               "-npp", str(prompt), "-ntg", str(generated), "-npl", ",".join(map(str, batches)),
               "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    log(" ".join(command[1:]))
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({result.returncode}): {result.stderr[-2000:]}")
    rows = [json.loads(line) for line in (result.stdout + result.stderr).splitlines() if line.startswith("{")]
    if len(rows) != len(batches):
        raise RuntimeError(f"llama-batched-bench printed {len(rows)} rows for {len(batches)} batch sizes")
    return [BatchedBench(prompt=row["pp"], generated=row["tg"], batch=row["pl"], prefill_seconds=row["t_pp"],
                         prefill_tok_s=row["speed_pp"], decode_seconds=row["t_tg"], decode_tok_s=row["speed_tg"],
                         total_seconds=row["t"]) for row in rows]


def perplexity(model: Path, text: Path, ctx: int, chunks: int, threads: int = 2) -> tuple[float, float]:
    """llama-perplexity's final estimate (PPL, its ±) over `chunks` chunks of `ctx` tokens of `text`."""
    command = [str(tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
               "--chunks", str(chunks), "-t", str(threads), "-tb", str(threads)]
    log(" ".join(command[1:]))
    result = subprocess.run(command, capture_output=True, text=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", result.stdout + result.stderr)
    if result.returncode != 0 or not found:
        raise RuntimeError(f"llama-perplexity failed ({result.returncode}): {result.stderr[-2000:]}")
    return float(found.group(1)), float(found.group(2))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class Server:
    """A running llama-server on loopback."""

    url: str
    process: subprocess.Popen

    def completion(self, prompt: list[int], new: int, timeout: float = 900) -> dict:
        """POST /completion with token ids; greedy, EOS ignored, its prompt cache on."""
        body = json.dumps({"prompt": prompt, "n_predict": new, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
                           "cache_prompt": True, "stream": False}).encode()
        request = urllib.request.Request(f"{self.url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())


@contextmanager
def server(model: Path, slots: int, ctx_per_slot: int, threads: int = 2, ready_s: float = 120,
           avx2: bool | None = None) -> Iterator[Server]:
    """llama-server with `slots` parallel slots of `ctx_per_slot` tokens each, continuous batching on."""
    port = free_port()
    command = [str(tool("llama-server", avx2)), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "--parallel", str(slots), "-c", str(slots * ctx_per_slot), "--cont-batching", "-t", str(threads),
               "-tb", str(threads), "--no-webui"]
    log(" ".join(command[1:]))
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited ({process.returncode}): {process.stderr.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready after {ready_s:.0f} s")
            time.sleep(0.25)
        yield Server(url, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", action="store_true", help="only build the tools")
    parser.add_argument("--cmake-args", action="store_true",
                        help="print the ISA flags for this CPU (CMAKE_ARGS for llama-cpp-python) and exit")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=96, help="prompt tokens per sequence")
    parser.add_argument("--generated", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.cmake_args:
        print(" ".join(isa_args()))
        return
    build(args.jobs)
    if args.build:
        return
    sys.path.insert(0, str(HERE.parent / "src"))
    from kvserve.model.registry import resolve_model

    for row in batched_bench(resolve_model("smollm2-135m"), args.prompt, args.generated, [1, 8, 32], args.threads):
        print(f"batch {row.batch:3d}: prefill {row.prefill_tok_s:8.1f} tok/s, decode {row.decode_tok_s:8.1f} tok/s, "
              f"generated/wall {row.generated_per_wall_s:8.1f} tok/s", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    main()
