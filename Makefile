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

# Two pytest-xdist workers (each takes whole files, so a file's tests share its compiled steps): the suite is
# compile-bound and one process keeps about one core busy. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(PY) bench/bench_train_step.py

clean:
	rm -rf $(VENV) runs
