# The two Quickstart commands: `make demo` and `make test`. Both install what they need first.
# `make lint` runs ruff and mypy (CI runs it before the tests).
PYTEST_ARGS ?=

.PHONY: setup demo test test-unit lint down
setup:
	@bash scripts/bootstrap.sh

demo: setup
	@.venv/bin/streams dev up
	@.venv/bin/streams topics apply >/dev/null
	@.venv/bin/streams demo

lint: setup
	@.venv/bin/ruff check streams tests
	@.venv/bin/mypy

test-unit: setup
	@.venv/bin/python -m pytest -m "not integration" $(PYTEST_ARGS)

test: setup
	@.venv/bin/streams dev up
	@.venv/bin/python -m pytest $(PYTEST_ARGS)

down:
	@.venv/bin/streams dev down
