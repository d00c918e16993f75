# Two commands do all the set-up on a fresh machine: `make demo` and `make test`. Each creates .venv
# with Python 3.12 (pyenv resolves python3.12 through .python-version) and installs the package into it.
PYTHON ?= python3.12
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: demo test clean

demo: $(STAMP)
	$(VENV)/bin/python examples/decode.py

test: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8 $$XLA_FLAGS" JAX_PLATFORMS=cpu \
	$(VENV)/bin/python -m pytest -q -n 2 tests

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $(STAMP)

clean:
	rm -rf $(VENV)
