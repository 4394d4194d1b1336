# Two commands on a fresh machine: `make demo` (a real 2-process training run) and `make test` (the test suite).
# Both create .venv and install what they need; requirements/ci.txt pins the CPU torch wheel.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup system-deps demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml requirements/ci.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q -r requirements/ci.txt
	$(PY) -m pip install -q -c requirements/ci.txt -e ".[dev]"
	touch $@

# redis-server for the Redis cache backend tests, iproute2 for the network benchmark (both Debian packages).
system-deps:
	@if ! command -v redis-server >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server iproute2 >/dev/null; \
		else echo "note: install redis-server and iproute2 to run every test (they are skipped otherwise)"; fi; \
	fi

demo: setup
	$(PY) -m bagua.distributed.launch --nproc_per_node=2 examples/digits.py

test: setup system-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: setup system-deps
	$(PY) -m bagua.benchmarks.network

clean:
	rm -rf $(VENV) .pytest_cache
