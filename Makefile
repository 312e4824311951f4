# The two Quickstart commands: `make demo` and `make test`. Both install what they need first.
PYTEST_ARGS ?=

.PHONY: setup demo test down
setup:
	@bash scripts/bootstrap.sh

demo: setup
	@.venv/bin/streams dev up
	@.venv/bin/streams topics apply >/dev/null
	@.venv/bin/streams demo

test: setup
	@.venv/bin/streams dev up
	@.venv/bin/python -m pytest $(PYTEST_ARGS)

down:
	@.venv/bin/streams dev down
