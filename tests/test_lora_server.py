"""LoRA over HTTP: `--lora-modules`, `model: <adapter>`, load / unload at run time, errors, /v1/models."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import httpx
import pytest

from kvserve import LLM, LoRARequest, SamplingParams
from kvserve.server.launcher import ServerProcess
from lora_util import make_peft_adapter
from test_server_support import chat_model_dir, start_server  # noqa: F401

MODEL = "tiny-chat"
KEYS_TOML = """
[keys]
"sk-alice" = "alice"
"sk-ops" = { tenant = "ops", admin = true }
"""
ADMIN = {"Authorization": "Bearer sk-ops"}
ALICE = {"Authorization": "Bearer sk-alice"}
PROMPT = list(range(20, 61))  # 41 tokens: 2 full blocks of 16


@pytest.fixture(scope="module")
def adapters(chat_model_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("server-adapters")
    return {
        "sql": make_peft_adapter(chat_model_dir, root / "sql", seed=1, rank=4),
        "poem": make_peft_adapter(chat_model_dir, root / "poem", seed=2, rank=8, targets=("q_proj", "v_proj")),
        "big": make_peft_adapter(chat_model_dir, root / "big", seed=3, rank=16),
    }


@pytest.fixture(scope="module")
def lora_server(chat_model_dir, adapters, tmp_path_factory) -> Iterator[ServerProcess]:  # noqa: F811
    keys = tmp_path_factory.mktemp("keys") / "keys.toml"
    keys.write_text(KEYS_TOML)
    with start_server(chat_model_dir, "--api-keys", str(keys), "--lora-modules", f"sql={adapters['sql']}",
                      "--max-lora-rank", "8", "--max-loras", "2") as process:
        yield process


def _complete(server, model: str, headers=ALICE) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)


def test_adapter_served_equals_offline_and_keys_the_cache(lora_server, chat_model_dir, adapters):  # noqa: F811
    models = httpx.get(f"{lora_server.url}/v1/models", headers=ALICE).json()["data"]
    assert [(m["id"], m["parent"]) for m in models] == [(MODEL, None), ("sql", MODEL)]
    assert models[1]["root"] == str(adapters["sql"])
    offline = LLM(str(chat_model_dir), progress=False, num_blocks=64, enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    want_lora = offline.generate([PROMPT], params, lora_request=LoRARequest("sql", 1, str(adapters["sql"])))[0]
    want_base = offline.generate([PROMPT], params)[0]
    assert want_lora.text != want_base.text
    first = _complete(lora_server, "sql").json()
    assert first["choices"][0]["text"] == want_lora.text and first["model"] == "sql"
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    base = _complete(lora_server, MODEL).json()
    assert base["choices"][0]["text"] == want_base.text
    assert base["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the adapter's blocks are not the base's
    again = _complete(lora_server, "sql").json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_unknown_adapter_is_404(lora_server):
    response = _complete(lora_server, "nope")
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    unload = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=ADMIN)
    assert unload.status_code == 404


def test_load_and_unload_at_run_time(lora_server, adapters, tmp_path):
    url = lora_server.url
    body = {"lora_name": "poem", "lora_path": str(adapters["poem"])}
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=ALICE).status_code == 403  # admin only
    bad = [
        ({"lora_name": "big", "lora_path": str(adapters["big"])}, "rank 16"),
        ({"lora_name": "gone", "lora_path": str(tmp_path / "nowhere")}, "not a directory"),
        ({"lora_name": MODEL, "lora_path": str(adapters["poem"])}, "already in use"),
    ]
    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapters["poem"], corrupt)
    (corrupt / "adapter_model.safetensors").write_bytes(b"garbage")
    bad.append(({"lora_name": "corrupt", "lora_path": str(corrupt)}, "corrupt"))
    for bad_body, words in bad:
        response = httpx.post(f"{url}/v1/load_lora_adapter", json=bad_body, headers=ADMIN)
        assert response.status_code == 400 and words in response.json()["error"]["message"], response.text
    ids = [m["id"] for m in httpx.get(f"{url}/v1/models", headers=ALICE).json()["data"]]
    assert ids == [MODEL, "sql"]  # nothing loaded by the failures
    assert httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=ADMIN).status_code == 200
    assert _complete(lora_server, "poem").status_code == 200
    assert _complete(lora_server, "sql").status_code == 200  # two adapters through two slots
    unload = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "poem"}, headers=ADMIN)
    assert unload.status_code == 200
    assert _complete(lora_server, "poem").status_code == 404
