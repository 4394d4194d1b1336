# Two commands on a fresh machine: `make demo` (a real 2-process training run) and `make test` (the test suite).
# Both create .venv and install what they need; requirements/ci.txt pins the CPU torch wheel.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup system-deps demo test bench clean

setup: $(VENV)/.installed-dev

# One stamp per extra set: `make demo` installs bagua[examples] (torch, numpy, tqdm, lmdb, scikit-learn), `make test`
# bagua[dev] (every extra and pytest). pip prints each package as it goes: the torch wheel alone is ~200 MB.
$(VENV)/.installed-%: pyproject.toml requirements/ci.txt
	@test -x $(PY) || python3 -m venv $(VENV)
	@echo "== installing torch (CPU build) and bagua[$*] into $(VENV)"
	$(PY) -m pip install --progress-bar on -r requirements/ci.txt
	$(PY) -m pip install --progress-bar on -c requirements/ci.txt -e ".[$*]"
	touch $@

# redis-server for the Redis cache backend tests, iproute2 for the network benchmark, OpenSSH for the baguarun-over-ssh
# test (all Debian packages). openssh-server is installed only where package scripts may not start services
# (policy-rc.d says no, as in containers): elsewhere it would start an sshd listening on port 22.
system-deps:
	@pkgs=""; \
	command -v redis-server >/dev/null 2>&1 || pkgs="$$pkgs redis-server"; \
	command -v ip >/dev/null 2>&1 || pkgs="$$pkgs iproute2"; \
	command -v ssh >/dev/null 2>&1 || pkgs="$$pkgs openssh-client"; \
	if ! test -x /usr/sbin/sshd; then \
		if /usr/sbin/policy-rc.d ssh start >/dev/null 2>&1; [ $$? = 101 ]; then pkgs="$$pkgs openssh-server"; \
		else echo "note: install openssh-server to run the baguarun ssh test (skipped otherwise)"; fi; \
	fi; \
	if [ -n "$$pkgs" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$pkgs >/dev/null; \
		else echo "note: install$$pkgs to run every test (the tests that need them are skipped otherwise)"; fi; \
	fi

demo: $(VENV)/.installed-examples
	$(PY) -m bagua.distributed.launch --nproc_per_node=2 examples/digits.py

test: setup system-deps
	$(PY) -m pytest -q --durations=30 $(PYTEST_ARGS)

bench: setup system-deps
	$(PY) -m benchmarks.network

clean:
	rm -rf $(VENV) .pytest_cache
