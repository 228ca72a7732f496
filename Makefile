# The two set-up commands of the README. Each creates .venv when missing, installs the
# package with the extras it needs, then runs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[dev,examples,flower]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/dppvi demo

# one worker per core, each test file in one worker (its module fixtures built once, its tests in order)
test: $(STAMP)
	$(BIN)/python -m pytest -q -ra -n auto --dist loadfile

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n auto --dist loadfile

bench: $(STAMP)
	$(BIN)/dppvi bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
