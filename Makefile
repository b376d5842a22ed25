# Everyday commands; .ci/run uses these targets. Run `make help` for the list.
# The Python targets use .venv (made by the README's test command, or `make venv`).

PY ?= .venv/bin/python
PIP ?= .venv/bin/pip
FUZZ_SECONDS ?= 20
# Lower bounds as in the `docs` extra of pyproject.toml (keep them in step).
DOCS_DEPS = "mkdocs>=1.6" "mkdocs-material>=9.5" "mkdocstrings[python]>=0.29"

.PHONY: help venv test test-python lint lint-rust lint-python typecheck docs docs-deps bench bench-smoke fuzz wheels clean

help:
	@echo "make venv         .venv with the package (editable) and the test dependencies"
	@echo "make test         cargo test -p keyop-core, then pytest (tests/, README.md, docs/)"
	@echo "make test-python  pytest only"
	@echo "make lint         lint-rust + lint-python"
	@echo "make lint-rust    cargo fmt --check, cargo clippy and cargo doc -D warnings"
	@echo "make lint-python  ruff (pydocstyle included), mypy.stubtest of the extension"
	@echo "make typecheck    README/docs python blocks under basedpyright --strict and mypy --strict"
	@echo "make docs         mkdocs build --strict into site/"
	@echo "make bench        the benchmark suite, quick (keyop-messenger bench --quick)"
	@echo "make bench-smoke  the pytest-benchmark suite once, untimed (as CI)"
	@echo "make fuzz         every cargo-fuzz target for FUZZ_SECONDS (default 20) each"
	@echo "make wheels       the release wheel of this machine into target/wheels/"

venv:
	python3 -m venv .venv && $(PIP) install -e '.[test]'

test:
	cargo test -p keyop-core
	$(PY) -m pytest

test-python:
	$(PY) -m pytest

lint: lint-rust lint-python

lint-rust:
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --locked -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --locked

lint-python:
	$(PY) -m ruff check python tests benches examples conftest.py
	$(PY) -m mypy.stubtest keyop_messenger._core

typecheck:
	$(PY) tests/typecheck_docs.py

docs-deps:
	$(PIP) install -q $(DOCS_DEPS)

docs:
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

bench:
	$(PY) -m keyop_messenger bench --quick

bench-smoke:
	$(PIP) install -q "pytest-benchmark>=5"
	$(PY) -m pytest benches -q -p no:cacheprovider --benchmark-disable

fuzz:
	FUZZ_SECONDS=$(FUZZ_SECONDS) bash .ci/fuzz

wheels:
	rm -rf target/wheels
	$(PY) -m maturin build --release --locked --out target/wheels

clean:
	rm -rf site target/wheels
