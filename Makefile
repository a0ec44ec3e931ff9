# Two commands: `make demo` and `make test`. Both bootstrap .venv from pinned versions first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean venv

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/moejax train --preset tiny --run-dir runs/demo --steps 300 --overwrite
	$(VENV)/bin/moejax summary runs/demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/bench_train_step.py

clean:
	rm -rf $(VENV) runs
