# The two commands of the README: `make demo` and `make test`. Both set up
# .venv themselves (Python 3.11+, pip), so they work on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN_STAMP := $(VENV)/.installed-run
SOURCES := pyproject.toml constraints-dev.txt service/_frame.c service/schedule/_grid.c proto/_codec.c
DATA := data
SAMPLE := $(DATA)/sample
DEMO_ROWS ?= 200000

.PHONY: setup lock redis-server chromium demo test lint typecheck unit docs bench bench-full clean

# Everything the tests, the benchmarks and the examples use (torch among them).
$(STAMP): $(SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]' -c constraints-dev.txt
	touch $(STAMP) $(RUN_STAMP)

# What ladle itself needs (no torch, no test tools): all `make demo` installs on a fresh machine.
$(RUN_STAMP): $(SOURCES)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[server]' -c constraints-dev.txt
	touch $(RUN_STAMP)

setup: $(STAMP)

# After upgrading a dependency in .venv on purpose (pip install --upgrade NAME, then make test):
# record the environment's versions as the ones make setup installs.
lock:
	{ grep '^#' constraints-dev.txt; $(BIN)/python -m pip freeze --exclude-editable \
		| sed 's/^torch==\([^+]*\)+cpu$$/torch==\1/'; } > constraints-dev.txt.new
	mv constraints-dev.txt.new constraints-dev.txt

# The tests and benchmarks start their own redis-server processes on free ports.
redis-server:
	@command -v redis-server >/dev/null || { \
		echo "redis-server is missing: installing it with apt-get"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

# The page's browser test drives Debian's headless Chromium through chromedriver.
chromium:
	@{ command -v chromium >/dev/null && command -v chromedriver >/dev/null; } || { \
		echo "chromium or chromedriver is missing: installing them with apt-get"; \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver; }

# The whole system on this machine: a production-like sample dataset (made
# once), the plan beside a random shuffle, then a server and 4 trainer
# processes reading one epoch through BatchClient, with the exact-once check.
demo: $(RUN_STAMP)
	test -d $(SAMPLE) || $(BIN)/ladle make-dataset $(SAMPLE) --rows $(DEMO_ROWS) --seed 0
	$(BIN)/ladle plan $(SAMPLE) --world-size 8 --compare random --simulate-loss
	$(BIN)/ladle demo $(SAMPLE) --world-size 4

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: setup
	$(BIN)/mypy

# Two pytest workers: most integration tests wait on the processes they start (servers, Redis,
# trainers), so two halve the suite's time on a 2-core machine (13.5 -> 8.2 min there, measured).
TEST_WORKERS ?= 2

unit: setup redis-server chromium
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --durations=15

# The references made from the code: docs/cli.md checked current, every flag the pages cite in a
# `ladle` command checked to exist, and the API reference (pdoc, warnings as errors) in build/docs/api.
docs: setup
	$(BIN)/python docs/build.py --check --out build/docs

# Everything CI runs: lint, types, the references, the whole test suite (hypothesis in its
# short CI profile when CI=true).
test: lint typecheck docs unit

bench: setup redis-server
	$(BIN)/python -m benchmarks.run

bench-full: setup redis-server
	$(BIN)/python -m benchmarks.run --full

clean:
	rm -rf $(VENV) $(DATA) build *.egg-info .mypy_cache .pytest_cache .ruff_cache .hypothesis
