# specserve — the two commands are `make run` and `make test`; everything else supports them.
SHELL := /bin/bash
PY_BOOT ?= $(shell command -v python3.11 || echo $$HOME/.pyenv/versions/3.11.7/bin/python3.11)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)
MODELS_DIR ?= models
export PYTHONUNBUFFERED := 1
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: setup models test test-unit bench lint run demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PY_BOOT) -m venv $(VENV)
	@# torch first, pinned to the local CPU wheel: any other spec pulls gigabytes of CUDA.
	@$(PY) -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
		|| $(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	@rm -f $(VENV)/.installed-*
	@touch $@

models: setup
	$(PY) -m specserve.cli models build --out $(MODELS_DIR)

test: setup
	$(PY) -m pytest -q tests

test-unit: setup
	$(PY) -m pytest -q tests/unit

bench: setup models
	$(PY) bench/bench_engine.py --models $(MODELS_DIR) --out bench/results

lint: setup
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy src/specserve

# Until the distributed stack lands, `make run` shows the in-process engine.
run: setup models demo

demo:
	$(PY) -m specserve.cli demo --models $(MODELS_DIR)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache
