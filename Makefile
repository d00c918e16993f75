# Two commands do all the set-up on a fresh machine: `make demo` and `make test`. Each creates .venv
# with Python 3.12 (pyenv resolves python3.12 through .python-version) and installs the package into
# it: `make demo` the package alone, `make test` with its test extra (pytest, the notebook's chex,
# triton for the CPU lowering tests), at the versions of constraints.txt, the lent GPU's.
PYTHON ?= python3.12
VENV := .venv
BASE := $(VENV)/.installed-base
STAMP := $(VENV)/.installed

.PHONY: demo test clean

demo: $(BASE)
	$(VENV)/bin/moe-front-demo

test: $(STAMP)
	XLA_FLAGS="--xla_force_host_platform_device_count=8 $$XLA_FLAGS" JAX_PLATFORMS=cpu \
	$(VENV)/bin/python -m pytest -q -n 2 tests

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip

$(BASE): pyproject.toml constraints.txt | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e .
	touch $@

# The test extra includes the package itself: its stamp stands for the demo's too.
$(STAMP): pyproject.toml constraints.txt | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(BASE) $@

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
