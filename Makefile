# Two commands: `make demo` and `make test`. Both bootstrap .venv from pinned versions first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
AOT_STAMP := $(VENV)/cuda-aot/.installed

.PHONY: demo test bench clean venv cuda-aot

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

# The CUDA compile kit (moejax.cuda_aot: XLA's GPU compiler, Triton and ptxas without a GPU; ~220 MB to
# download, 573 MB installed), for the tests and `moejax plan --compile` only, so `make demo` doesn't download
# it. Installed apart from the venv's site-packages: importable there, every jax start would try to open a CUDA
# backend.
cuda-aot: $(AOT_STAMP)

$(AOT_STAMP): $(STAMP) requirements-cuda-aot.lock
	$(PY) -m pip install --quiet --no-deps --upgrade --target $(VENV)/cuda-aot -r requirements-cuda-aot.lock
	touch $(AOT_STAMP)

demo: $(STAMP)
	@# train's JSON summary (also in runs/demo/summary.json) is left out: `moejax summary` prints it as text
	$(VENV)/bin/moejax train --preset tiny --run-dir runs/demo --steps 300 --overwrite >/dev/null
	$(VENV)/bin/moejax summary runs/demo

# Two pytest-xdist workers (each takes whole files, so a file's tests share its compiled steps): the suite is
# compile-bound and one process keeps about one core busy. TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 2

test: $(STAMP) $(AOT_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

bench: $(STAMP)
	$(PY) bench/bench_train_step.py

clean:
	rm -rf $(VENV) runs
