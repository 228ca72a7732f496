# The two set-up commands of the README. Each creates .venv when missing, installs the
# package with the extras it needs, then runs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# `make docs` installs its own extra (and the optional ones autodoc imports) with its own stamp,
# so `make test` never needs the docs extra.
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: demo test test-fast bench docs clean

# one recipe for both environments' stamps, each with its extras
$(STAMP): EXTRAS = dev,examples,flower
$(DOCS_STAMP): EXTRAS = docs,examples,flower
$(STAMP) $(DOCS_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e ".[$(EXTRAS)]"
	touch $@

demo: $(STAMP)
	$(BIN)/dppvi demo

# one worker per core, each test file in one worker (its module fixtures built once, its tests in order); the 25
# slowest tests listed at the end (the suite's time: README.md)
test: $(STAMP)
	$(BIN)/python -m pytest -q -ra -n auto --dist loadfile --durations=25

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" -n auto --dist loadfile

bench: $(STAMP)
	$(BIN)/dppvi bench

# the API reference and the chapters, into docs/_build/html; any warning fails the build
docs: $(DOCS_STAMP)
	JAX_PLATFORMS=cpu $(BIN)/python -m sphinx -b html -W --keep-going docs docs/_build/html

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info docs/_build
