"""Machine peak for MFU: the measured matmul throughput of one device, times the devices of the job.

MFU is model FLOPs per second over the *whole job's* peak, so it reads the same per device whatever the
job size. The per-device peak is measured at start: a bf16 matmul on GPU/TPU (the dtype the model trains
in), fp32 on CPU (bf16 is no faster there). Forced host "devices" on CPU (`--xla_force_host_platform_
device_count`) share one process's cores, so a CPU job's peak is the measured one times the process
count, not times the device count. The peak matmul compiles with XLA's defaults, not the steps' options
(`xla_flags.step_compiler_options`): on CPU the default YNNPACK dot reaches the higher 1024^3 rate of the two
(docs/LOG.md, 2026-12-02, eighth session), so MFU is not flattered by the choice.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


PEAK_REPEATS = 20  # `job_peak`'s readings


def measure_matmul_peak(n: int = 1024, dtype=jnp.float32, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` n x n x n matmuls on device 0 (compiled once, result blocked on)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    return 2.0 * n**3 / _fastest(lambda: f(a, b).block_until_ready(), repeats)


def _fastest(call, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def job_peak(per_device: float = 0.0) -> dict:
    """The peak MFU is measured against, and how it was obtained (logged in run_info.json).

    `per_device` > 0 overrides the measurement (FLOP/s of one accelerator, or of one process on CPU).
    """
    platform = jax.default_backend()
    on_cpu = platform == "cpu"
    dtype = jnp.float32 if on_cpu else jnp.bfloat16
    units = jax.process_count() if on_cpu else jax.device_count()
    if per_device <= 0:
        # 8192^3 bf16 saturates an H100/H200 (JAX reaches ~650-700 TFLOP/s there); 1024^3 fp32 a CPU.
        # The fastest of 20 (~0.2 s on CPU): a start-up reading taken while other work ran read low and lifted
        # the run's MFU (188 against the bench's 216 GFLOP/s once, docs/LOG.md 2026-12-05).
        per_device = measure_matmul_peak(1024 if on_cpu else 8192, dtype, repeats=PEAK_REPEATS)
        source = f"measured: {jnp.dtype(dtype).name} matmul on {jax.devices()[0].device_kind}"
    else:
        source = "--peak-flops"
    return {"peak_flops": per_device * units, "peak_flops_per_unit": per_device, "peak_units": units,
            "peak_unit": "process (CPU: host devices share its cores)" if on_cpu else "device",
            "peak_source": source, "platform": platform}


def measure_bandwidth(n: int = 1 << 24, repeats: int = 7) -> float:
    """Bytes/s of the fastest of `repeats` elementwise passes x + 1 over n fp32 values on device 0, in place
    (read n, write n; 64 MiB by default, past the caches): the memory bandwidth a fused elementwise kernel
    gets, for `moejax.roofline`. In place, since a fresh output buffer on CPU would time the kernel's page
    faults (2 cores here: ~28 GB/s in place, 4-12 GB/s into fresh buffers)."""
    f = jax.jit(lambda v: v + 1.0, donate_argnums=0)
    buf = [f(jnp.zeros((n,), jnp.float32)).block_until_ready()]  # each call donates the last one's output

    def step():
        buf[0] = f(buf[0]).block_until_ready()

    return 2.0 * 4 * n / _fastest(step, repeats)
