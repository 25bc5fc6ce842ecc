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
	ruff format python tests bench scripts
	ruff check --fix python tests bench scripts
	cargo fmt --all

.PHONY: build-dev
build-dev: ## quick (unoptimised) build of the extension into python/pdproxy, for iterating on Rust
	cargo build -p pdproxy --features python --profile quick
	cp target/quick/lib_pdproxy.so python/pdproxy/_pdproxy.abi3.so

.PHONY: lint-python
lint-python: ## ruff (check, format), mypy strict, no Any in public signatures, stubtest (the stub against the built module)
	ruff check python tests bench scripts
	ruff format --check python tests bench scripts
	$(PYTHON) -m mypy
	$(PYTHON) scripts/check_public_any.py
	cd /tmp && $(PYTHON) -m mypy.stubtest pdproxy._pdproxy --allowlist $(CURDIR)/.mypy-stubtest-allowlist

.PHONY: lint-rust
lint-rust: ## rustfmt, clippy (pedantic; warnings are errors), and no circle among the crate's modules
	cargo fmt --all --check
	$(PYTHON) scripts/module_graph.py
	cargo clippy --quiet --workspace --all-targets --all-features -- -D warnings

.PHONY: lint
lint: lint-python lint-rust ## every linter

.PHONY: test
# Tests wait on sockets and processes far more than they compute: three at a time keep two cores
# busy (pytest-xdist), and each starts its own servers on free ports.
TEST_WORKERS ?= 3

test: ## the Python suite: pytest against real processes, TEST_WORKERS at a time (arguments: PYTEST_ARGS=...)
	$(PYTHON) -m pytest -n $(TEST_WORKERS) --ignore=tests/bench $(PYTEST_ARGS)

.PHONY: test-bench
test-bench: ## the benchmark tooling's own tests (bench/fleet.py, the locustfile), apart from the product's
	$(PYTHON) -m pytest -n 2 tests/bench

.PHONY: test-real
test-real: ## the real-engine tier: real vLLM servers on this machine's CPUs (scripts/real_engine.sh sets them up)
	PYTHON=$(PYTHON) scripts/real_engine.sh
	$(PYTHON) -m pytest tests/real -m real_engine --timeout 1200 $(PYTEST_ARGS)

.PHONY: test-debug
test-debug: ## the Python suite against a debug-checked build of the extension (overflow checks, debug assertions)
	cargo build --quiet -p pdproxy --features python --profile checked
	rm -rf target/checked-python && mkdir -p target/checked-python/pdproxy
	cp -r python/pdproxy/. target/checked-python/pdproxy/
	cp target/checked/lib_pdproxy.so target/checked-python/pdproxy/_pdproxy.abi3.so
	PYTHONPATH=$(CURDIR)/target/checked-python $(PYTHON) -m pytest -n $(TEST_WORKERS) --ignore=tests/bench $(PYTEST_ARGS)

.PHONY: msrv
# What users build (the extension, the load generator); the tests' dev-dependencies (proptest)
# ask for a newer Rust than the crate does.
msrv: ## the crate checked with the oldest Rust it declares (rust-version in Cargo.toml; rustup installs it)
	rustup toolchain install $(MSRV) --profile minimal
	cargo +$(MSRV) check --quiet --workspace --all-features
MSRV := $(shell sed -n 's/^rust-version = "\(.*\)"/\1/p' Cargo.toml)

.PHONY: test-rust
test-rust: ## the cargo tests (no Python): the data plane's, and the load generator's
	cargo test --quiet --workspace

.PHONY: fresh-test
fresh-test: ## the README's test command on a fresh clone: system packages, pip install ".[test]", pytest, cargo test
	PYTHON=$(PYTHON) scripts/test.sh

.PHONY: wheel
wheel: ## the manylinux abi3 wheel users install without Rust, into dist/ (checked: auditwheel, a clean venv serves --demo)
	PYTHON=$(PYTHON) scripts/wheel.sh dist

.PHONY: screenshot
screenshot: ## regenerate docs/dashboard.png (the dashboard's browser test, at 1400 px, writes it)
	SCREENSHOT_TO=docs/dashboard.png $(PYTHON) -m pytest -q tests/observability/test_dashboard.py

.PHONY: bench
bench: ## run every benchmark scenario and refresh bench/README.md
	$(PYTHON) bench/run.py --write-readme

.PHONY: all
all: lint test test-rust ## lint, then both test suites
