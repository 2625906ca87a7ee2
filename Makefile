# The two commands of the quick start. Each installs what it needs on first use.
.PHONY: setup demo test test-all unit lint docs

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/art demo

# everything but the long `nightly` runs (CI); test-all adds them
test:
	@bash scripts/setup.sh --dev
	.venv/bin/python -m pytest -q --durations=40 -m "not nightly"
	.venv/bin/mkdocs build --strict --quiet -d .venv/site

test-all:
	@bash scripts/setup.sh --dev
	.venv/bin/python -m pytest -q --durations=40
	.venv/bin/mkdocs build --strict --quiet -d .venv/site

# the fast set: no vLLM engine, no extra processes (tests/unit, without the `slow` ones)
unit:
	@bash scripts/setup.sh --dev
	.venv/bin/python -m pytest -q tests/unit -m "not slow"

lint:
	@bash scripts/setup.sh --dev
	.venv/bin/ruff check .

docs:
	@bash scripts/setup.sh --dev
	.venv/bin/mkdocs serve
