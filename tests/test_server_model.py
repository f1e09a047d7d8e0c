"""The real default model behind the HTTP server (marked `model`; a few seconds of decoding)."""

from __future__ import annotations

import openai
import pytest

from kvserve.server.launcher import launch_server

pytestmark = pytest.mark.model


def test_smollm2_chat_over_http_reuses_the_system_prompt():
    with launch_server(["--model", "smollm2-135m", "--kv-cache-memory", "256MiB"]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)
        system = {"role": "system", "content": "You are a concise assistant. Answer in one short sentence."}

        def ask(question: str):
            return client.chat.completions.create(
                model="smollm2-135m", messages=[system, {"role": "user", "content": question}],
                max_tokens=8, temperature=0,
            )

        first, second = ask("What is the capital of France?"), ask("What colour is the sky?")
        assert "Paris" in first.choices[0].message.content
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert second.usage.prompt_tokens_details.cached_tokens >= 16  # the shared system prompt
        assert server.terminate() == 0
