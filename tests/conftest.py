"""Test setup: force 8 CPU host devices *before* jax is imported, so expert-parallel code really runs."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("WANDB_MODE", "disabled")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_sessionstart(session):
    n = len(jax.devices())
    if n < 8:
        raise RuntimeError(f"tests need 8 forced CPU devices, jax sees {n}; was jax imported before conftest?")
