# The two commands of the quick start. Each installs what it needs on first use.
.PHONY: setup demo test lint

setup:
	@bash scripts/setup.sh

demo: setup
	.venv/bin/art demo

test:
	@bash scripts/setup.sh --dev
	.venv/bin/python -m pytest -q

lint:
	@bash scripts/setup.sh --dev
	.venv/bin/ruff check .
