"""MFU's peak is the whole job's: per device on accelerators, per process on CPU (issue 11 item 4)."""

import jax
import jax.numpy as jnp

from moejax.perf import job_peak
from tests.helpers import bench_module


def test_cpu_peak_counts_processes_not_forced_host_devices():
    assert jax.device_count() == 8  # tests force 8 host devices; they share this one process's cores
    p = job_peak(1e11)
    assert p["platform"] == "cpu" and p["peak_units"] == jax.process_count() == 1
    assert p["peak_flops"] == 1e11 and p["peak_source"] == "--peak-flops"


def test_measured_peak_is_positive_and_labelled():
    p = job_peak()
    assert p["peak_flops"] > 1e8 and p["peak_source"].startswith("measured: float32 matmul")


def _costly_line(x, w):
    return jnp.tanh(x @ w).sum()


def test_profile_attribution_names_the_source_line():
    """bench/profile_step.py charges each compiled op to the Python line that emitted it."""
    profile_step = bench_module("profile_step")
    x = jnp.ones((8, 16), jnp.float32)
    hlo = jax.jit(_costly_line).lower(x, x.T).compile().as_text()
    frames, ops = profile_step.source_frames(hlo)
    line = _costly_line.__code__.co_firstlineno + 1
    dots = [n for n, op in ops.items() if op.endswith("dot_general")]
    assert dots and all(frames[n][0] == f"_costly_line:{line}" for n in dots)


def test_gpu_bench_names_a_kernels_source_line():
    """bench/bench_gpu.py's kernel list: a device kernel named after its fusion ('.' and '-' as '_', as XLA:GPU
    names them; CPU traces keep the name) maps to the Python line that emitted the instruction."""
    bench_gpu = bench_module("bench_gpu")
    x = jnp.ones((8, 16), jnp.float32)
    hlo = jax.jit(_costly_line).lower(x, x.T).compile().as_text()
    line = f"_costly_line:{_costly_line.__code__.co_firstlineno + 1}"
    name = next(n for n, op in bench_gpu.roofline.source_frames(hlo)[1].items() if op.endswith("dot_general"))
    assert bench_gpu.kernel_source(name, hlo).startswith(line)
    assert bench_gpu.kernel_source(name.replace(".", "_").replace("-", "_"), hlo).startswith(line)
    assert bench_gpu.kernel_source("sm90_xmma_gemm_bf16", hlo) == ""
