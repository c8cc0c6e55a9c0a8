# Two commands on a fresh machine: `make install` then `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# The combination checked in ../shared/FIELD-NOTES.md (late 2026). Pinned here, not in
# pyproject.toml, so that `pip install tpurun` on Kaggle or Colab keeps the image's own builds.
PINS   := tensorflow-cpu==2.21.0 keras==3.15.1 jax==0.10.2

.PHONY: install test test-fast lint format bench quickstart clean

install: $(BIN)/tpurun

$(BIN)/tpurun: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(PINS) -e '.[dev,export,viz]'
	@$(BIN)/tpurun --version

test: install
	$(BIN)/python -m pytest -q -ra

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

lint: install
	$(BIN)/ruff check tpurun tests benchmarks configs
	$(BIN)/ruff format --check tpurun tests benchmarks configs

format: install
	$(BIN)/ruff check --fix tpurun tests benchmarks configs
	$(BIN)/ruff format tpurun tests benchmarks configs

quickstart: install
	$(BIN)/tpurun train configs/quickstart.yaml

bench: install
	$(BIN)/python benchmarks/runner_overhead.py

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache *.egg-info
