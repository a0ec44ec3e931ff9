"""Machine peak measurement for MFU: the best observed fp32 (or bf16) matmul throughput of device 0."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp


def measure_matmul_peak(n: int = 1024, dtype=jnp.float32, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` n x n x n matmuls (compiled once, result blocked on)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best
