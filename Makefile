# pdproxy developer entry point. `make help` lists the targets.
.DEFAULT_GOAL := all
PYTHON ?= python3

.PHONY: help
help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

.PHONY: install
install: ## build the extension (release) and install pdproxy with its test and dev tools
	$(PYTHON) -m pip install -e ".[dev]"

.PHONY: format
format: ## format Python and Rust
	ruff format python tests bench
	ruff check --fix python tests bench
	cargo fmt --all

.PHONY: lint
lint: ## ruff, mypy, stubtest (stubs against the built module), rustfmt and clippy (warnings are errors)
	ruff check python tests bench
	ruff format --check python tests bench
	$(PYTHON) -m mypy
	cd /tmp && $(PYTHON) -m mypy.stubtest pdproxy._pdproxy --allowlist $(CURDIR)/.mypy-stubtest-allowlist
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --all-features -- -D warnings

.PHONY: test
test: ## the whole test suite: pytest (real processes) and the data plane's cargo tests
	$(PYTHON) -m pytest
	cargo test

.PHONY: fresh-test
fresh-test: ## the README's test command on a fresh clone: system packages, pip install ".[test]", pytest, cargo test
	PYTHON=$(PYTHON) scripts/test.sh

.PHONY: bench
bench: ## run every benchmark scenario and refresh bench/README.md
	$(PYTHON) bench/run.py --write-readme

.PHONY: all
all: lint test ## lint, then test
