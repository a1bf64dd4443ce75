# The quick start is two commands on a fresh machine:
#   make run    sets up .venv and runs `fleetsched run examples/quickstart.toml` (embedded sim backend)
#   make test   sets up .venv, the CPU vLLM (.venv-vllm + a generated tiny model) and Redis,
#               then runs every test
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test setup setup-vllm setup-redis bench clean

# setup.py compiles these with mypyc (the list is fleetsched/_native.py's COMPILED): after a
# change to one, `make setup` builds them again.
COMPILED_SOURCES := fleetsched/backends/sim/_engine.py fleetsched/backends/sim/_kv_cache.py fleetsched/policies/fair_queue.py

# A Python that is not found is named, with how to pick another (3.11 or later). A venv that
# failed half-way (Debian's python3.11 without python3.11-venv leaves bin/python but no pip) is
# removed, so that the next `make` makes it again instead of calling its missing pip.
$(BIN)/fleetsched: pyproject.toml setup.py $(COMPILED_SOURCES)
	@command -v $(PYTHON) >/dev/null || { echo "make: $(PYTHON) not found: fleetsched needs Python 3.11 or later; name yours with e.g. make run PYTHON=python3.12" >&2; exit 1; }
	[ -x $(BIN)/python ] || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

setup: $(BIN)/fleetsched

run: setup
	$(BIN)/fleetsched run examples/quickstart.toml

setup-vllm:
	scripts/setup-vllm.sh

# The gateway's shared-state tests start a real Redis on loopback (Debian's redis-server).
setup-redis:
	command -v redis-server >/dev/null || (apt-get update -qq && apt-get install -y -qq redis-server)

test: setup setup-vllm setup-redis
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/fleetsched bench overhead
	$(BIN)/fleetsched bench allocator

clean:
	rm -rf $(VENV) .venv-vllm .cache .pytest_cache .hypothesis
