# Two commands, each doing the whole setup on a fresh machine:
#   make run   - set up, then generate text with the default model
#   make test  - set up, lint and type-check, then run the test suite (make test-fast: its unit tier)
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: run test test-fast lint setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	# NOTE: torch is pinned first so pip takes the local CPU wheel, never a CUDA build.
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.*"
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: setup
	$(BIN)/python -m funcspec.cli run-default

# NOTE: one pytest worker per core (-n auto): the tests pin torch to one thread each, and most of the
# suite's time is inductor compiling graphs, one process at a time. Tests go out one at a time to the
# worker that is free (--dist load --maxschedchunk 1), so a few long compiles never queue behind each other
# on one worker; under --dist worksteal (pytest-xdist 3.8) one worker was seen to stop a minute in while
# the other ran the rest alone, doubling the run
test: setup lint
	@start=$$(date +%s); $(BIN)/python -m pytest -x -n auto --dist load --maxschedchunk 1 -p no:cacheprovider \
		tests; rc=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s (pytest exit status $$rc)"; exit $$rc

# ruff, then mypy (both configured in pyproject.toml); make test runs them before the suite
lint: setup
	$(BIN)/ruff check funcspec
	$(BIN)/mypy

# the unit tier: no engine, no compile (under a minute)
test-fast: setup
	$(BIN)/python -m pytest -x -p no:cacheprovider tests/unit

clean:
	rm -rf $(VENV)
