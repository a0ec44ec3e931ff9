"""Test setup: force 8 CPU host devices *before* jax is imported, so expert-parallel code really runs."""

import atexit
import os
import shutil
import tempfile
from importlib.metadata import version

# The suite's shapes are tiny, so compiling dominates its time. LLVM at -O0 cuts a compile by about a third
# (measured: a 30 s model test takes 20 s); XLA's older loop emitters instead of its MLIR fusion emitters cut
# what is left by almost half (the tiny EP train step: 14.2 -> 7.8 s, the same losses; docs/LOG.md
# 2026-12-01). That flag is gone from jaxlib 0.11 (the GPU machine's), whose XLA aborts on an unknown flag.
# Both sides of every comparison are compiled alike, and the CLI subprocesses inherit the flags. Benchmarks
# (bench/) never run with them.
# Not set: --xla_allow_excess_precision=false. XLA (default on) may drop a bf16 rounding inside one jit when a
# convert back to fp32 follows, so a test of bf16 rounding (a dtype bug) can pass jitted on CPU and still fail
# on a GPU: such tests run op by op or jit with compiler_options={"xla_allow_excess_precision": False}. The
# suite passes with the flag too (604 tests, docs/LOG.md 2026-12-05, twenty-seventh session).
_LOOP_EMITTERS = tuple(map(int, version("jaxlib").split(".")[:2])) < (0, 11)  # read before jax is imported
_FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0",
          *(["--xla_cpu_use_fusion_emitters=false"] if _LOOP_EMITTERS else []))
_have = os.environ.get("XLA_FLAGS", "").split()  # pytest-xdist workers inherit the controller's: add once
os.environ["XLA_FLAGS"] = " ".join(_have + [f for f in _FLAGS if f not in _have])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")
# One persistent compilation cache per test session, inherited by the CLI subprocesses and by pytest-xdist's
# workers (spawned after this ran in the controller): the many tiny runs that compile the same step (resume,
# init-from, fault injection) compile it once. Per session, so a test never reads a stale entry from another
# checkout, and the user's ~/.cache is left alone; whoever made the directory removes it.
if "MOEJAX_TEST_JAX_CACHE" not in os.environ:
    os.environ["MOEJAX_TEST_JAX_CACHE"] = tempfile.mkdtemp(prefix="moejax-test-jax-cache-")
    atexit.register(shutil.rmtree, os.environ["MOEJAX_TEST_JAX_CACHE"], ignore_errors=True)
os.environ["JAX_COMPILATION_CACHE_DIR"] = os.environ["MOEJAX_TEST_JAX_CACHE"]
# In-process runs of one config share their jitted steps across a worker's tests (`moejax.train.reuse`): a test
# that patches code the steps trace (no key holds it) calls `reuse.clear()` first, as tests/test_reuse.py does.

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_sessionstart(session):
    n = len(jax.devices())
    if n < 8:
        raise RuntimeError(f"tests need 8 forced CPU devices, jax sees {n}; was jax imported before conftest?")
