# Two commands on a fresh machine: `make install` then `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
# A second environment, without tpurun or TensorFlow, for the IPython kernel the notebook test
# (tests/display/test_notebook.py) runs: a user's notebook kernel is rarely tpurun's own Python.
KERNEL_VENV := .venv-kernel
# The combination checked in ../shared/FIELD-NOTES.md (late 2026). Pinned here, not in
# pyproject.toml, so that `pip install tpurun` on Kaggle or Colab keeps the image's own builds.
PINS   := tensorflow-cpu==2.21.0 keras==3.15.1 jax==0.10.2
# A third environment WITHOUT TensorFlow, as on Colab's TPU runtimes and JAX-only GPU images: tpurun
# with JAX and its core dependencies (no hub extra: keras-hub requires tensorflow-text). The
# JAX-path tests run there too (`make test`), so that training without TensorFlow stays proven.
JAX_VENV := .venv-jax
JAX_PINS := keras==3.15.1 jax==0.10.2
# A fourth, for checking `tpurun export --format huggingface` with the real client: transformers
# on PyTorch, loading the export in a fresh process as a user's serving code would
# (tests/infer/test_hf_export.py). Kept apart so that torch never enters the training environments.
# torch==2.13.0 is the CPU build this kind of machine keeps on disk (pip's find-links): 1.2 GB and
# about 45 s in all here; a version pip must download is a CUDA build of several GB.
HF_VENV := .venv-hf
HF_PINS := torch==2.13.0 transformers==5.24.0 safetensors sentencepiece protobuf

.PHONY: install test test-fast lint format docs bench quickstart clean

install: $(BIN)/tpurun $(KERNEL_VENV)/.installed $(JAX_VENV)/.installed $(HF_VENV)/.installed

$(BIN)/tpurun: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(PINS) -e '.[dev,export,viz,docs,hub,sharded,tensorflow,trackers]'
	@$(BIN)/tpurun --version

# ipykernel exports MPLBACKEND=module://matplotlib_inline.backend_inline, which only this
# environment can import: the case tpurun meets in a real notebook. ipykernel (which requires
# matplotlib-inline) stays out of .venv so that case stays real; the test's second kernel runs
# .venv's Python with ipykernel taken from here.
$(KERNEL_VENV)/.installed:
	$(PYTHON) -m venv $(KERNEL_VENV)
	$(KERNEL_VENV)/bin/pip install --quiet --upgrade pip
	$(KERNEL_VENV)/bin/pip install --quiet ipykernel matplotlib-inline
	@touch $@

$(JAX_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(JAX_VENV)
	$(JAX_VENV)/bin/pip install --quiet --upgrade pip
	$(JAX_VENV)/bin/pip install --quiet $(JAX_PINS) -e '.[dev,export,viz,sharded]'
	# keras-hub without its tensorflow-text requirement (it imports without it): a preset on
	# token ids trains here, and a preset whose tokenizer needs tf-text is refused as it should be.
	$(JAX_VENV)/bin/pip install --quiet --no-deps keras-hub==0.32.0
	$(JAX_VENV)/bin/pip install --quiet sentencepiece regex tokenizers
	@if $(JAX_VENV)/bin/python -c "import tensorflow" 2>/dev/null; then \
		echo "$(JAX_VENV) has TensorFlow: a dependency pulled it in"; exit 1; fi
	@touch $@

$(HF_VENV)/.installed:
	$(PYTHON) -m venv $(HF_VENV)
	$(HF_VENV)/bin/pip install --quiet --upgrade pip
	$(HF_VENV)/bin/pip install --quiet $(HF_PINS)
	@touch $@

# Three worker processes, each taking whole test files (--dist loadfile: a module's fixtures, such
# as a trained run several tests read, are made once). Many tests wait on a subprocess or on one
# Python thread: on 2 cores, two workers kept the CPU 83% busy and three 96% (the suite in 15:15
# with three, 28.8 CPU-minutes; 23:47 with two before the last cuts). Each worker holds 8 simulated
# devices and its subprocesses: on a larger machine, `make test TEST_WORKERS=6` (or auto);
# TEST_WORKERS=0 runs in this process. The files with the most slow tests go first
# (tests/conftest.py), not xdist's most-tests-first, which left a file of a few long tests running
# alone at the end.
TEST_WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The JAX path's own unit tests again in .venv-jax, where TensorFlow is absent (the ones comparing
# with TensorFlow skip there): the reader, the events writer, gs:// through gcsfs, one device's
# compiles, the optimizer's state split. The commands themselves run there from the main suite: tests/test_without_tensorflow.py
# uses .venv-jax's console script for every command.
JAX_TESTS := tests/data/test_native_records.py tests/data/test_native_pipeline.py \
	tests/data/test_native_fast_parse.py tests/data/test_native_recycle.py tests/observe/test_tensorboard_events.py \
	tests/storage/test_storage_remote.py tests/storage/test_gcs_fileio.py \
	tests/runtime/test_one_accelerator.py tests/runtime/test_optimizer_split.py

test: install
	$(PYTEST) -q -ra --durations=15
	$(JAX_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -q -ra $(JAX_TESTS)

test-fast: install
	$(PYTEST) -q -m "not slow"

lint: install
	$(BIN)/ruff check tpurun tests benchmarks configs
	$(BIN)/ruff format --check tpurun tests benchmarks configs

format: install
	$(BIN)/ruff check --fix tpurun tests benchmarks configs
	$(BIN)/ruff format tpurun tests benchmarks configs

quickstart: install
	$(BIN)/tpurun train configs/quickstart.yaml

# Checks and builds the site; regenerates nothing: a stale config reference or a broken link fails.
docs: install
	$(BIN)/python -m tpurun.config.reference --check docs/config-reference.md
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir build/site

bench: install
	$(BIN)/python benchmarks/runner_overhead.py

clean:
	rm -rf $(VENV) $(KERNEL_VENV) $(JAX_VENV) $(HF_VENV) runs .pytest_cache .ruff_cache *.egg-info
