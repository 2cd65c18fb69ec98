# Two commands on a fresh machine: `make demo` and `make test` (README).
# Both create .venv with pinned dependencies first.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := PYTHONSAFEPATH=1 $(VENV)/bin/python
# torch: the CPU build where no GPU is visible (never pull CUDA torch there).
TORCH_PIN := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 'torch==2.13.0' || echo 'torch==2.13.0+cpu')

.PHONY: venv install tools test demo lint fmt clean bench-peers

$(VENV)/.stamp-deps: requirements.txt requirements-dev.txt pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade "pip==25.3"
	$(VENV)/bin/python -m pip install -q "$(TORCH_PIN)"
	$(VENV)/bin/python -m pip install -q -r requirements.txt -r requirements-dev.txt "setuptools==84.2.1" "wheel==0.48.0"
	touch $@

# Strict editable mode links every file at install time, so re-run it each
# time (a few seconds) to pick up new modules.
install: $(VENV)/.stamp-deps
	$(VENV)/bin/python -m pip install -q --no-deps --no-build-isolation -e . --config-settings editable_mode=strict

# promtool (rule tests) and prometheus (the local stack's --prometheus, the
# dashboard e2e test): Debian's prometheus package, installed when missing.
tools:
	@command -v promtool >/dev/null 2>&1 || { echo "installing Debian's prometheus package (promtool, prometheus)"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# 1: `make lint` (and so `make test`) also fails on code `ruff format` would change.
FORMAT_CHECK ?= 1

lint: install
	$(VENV)/bin/ruff check .
ifeq ($(FORMAT_CHECK),1)
	$(VENV)/bin/ruff format --check .
endif

fmt: install
	$(VENV)/bin/ruff format .

# e2e first: its files are the longest, and the two workers end together when the short ones come last.
test: install tools lint
	$(PY) -m mypy -p kvserving
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile e2e tests

demo: install
	$(PY) -m kvserving.cli demo

# The Rust routers bench/gateway_overhead.py compares the gateway with, and
# py-spy; bench extras, kept out of requirements.txt and `make test`.
bench-peers: install
	$(VENV)/bin/python -m pip install -q -r bench/requirements-peers.txt

clean:
	rm -rf $(VENV) build *.egg-info
