# The front door: `make test` and `make run` set themselves up on first use.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup test run bench clean

setup:
	@bash scripts/setup.sh

test: setup
	@$(PY) -m tests.runner

clean:
	rm -rf $(VENV) .test-reports tfhybrid/custom_ops/_tfhybrid_ops.so
