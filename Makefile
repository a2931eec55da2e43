# Two commands from a clean clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.streamckpt-installed

.PHONY: venv azurite demo test test-slow test-gpu test-all gpu-wheels wheel docs clean-venv

venv: $(STAMP)

# Azurite (the Azure Blob emulator of the az:// tests) from the npm registry into
# ~/.cache/streamckpt, once per machine (about a minute); without node/npm it says so
# and the az:// tests skip.
azurite: venv
	$(BIN)/python -m streamckpt.testing.azureserver --install

# Re-installs when pyproject.toml changes. torch is installed first and pinned:
# the CPU wheel lies on this machine's disk, an unpinned torch pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip check
	touch $(STAMP)

demo: venv
	$(BIN)/streamckpt demo

# The default suite (pyproject's addopts deselect `slow`). pytest's exit status is make's:
# a run that collects no test exits 5 and fails, as a suite that tests nothing must.
test: venv azurite
	$(BIN)/python -m pytest -q

# Only the slow tests (long fault injections, the harness's own hang checks).
test-slow: venv azurite
	$(BIN)/python -m pytest -q -m slow

# Only the GPU tests (skipped without CUDA; -rs prints why).
test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu -rs

# Everything: the default suite, the slow tests and (with CUDA) the GPU tests.
test-all: venv azurite
	$(BIN)/python -m pytest -q -m "slow or not slow"

# Wheels of what the lent GPU machine's image lacks (cp312), into the git-ignored .whl/, fetched here:
# that machine reaches no registry. benchmarks/gpu_check.sh installs them there (issue 26).
gpu-wheels:
	bash benchmarks/gpu_wheels.sh --python-version 3.12 --dest .whl

# The wheel to install elsewhere (not on PyPI yet): dist/streamckpt-<version>-py3-none-any.whl.
wheel: venv
	$(BIN)/pip wheel --no-deps --no-build-isolation -w dist .

# The docs site (mkdocs + material, from the test extra): README.md as its index, docs/ as its
# pages, into the git-ignored site/; --strict fails on a broken link or anchor.
docs: venv
	$(BIN)/mkdocs build --strict --site-dir site

clean-venv:
	rm -rf $(VENV)
