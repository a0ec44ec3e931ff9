"""The optimizer's Newton-Schulz GPU kernel (`train.ns_gpu`, through the Pallas interpreter on CPU): the fused
GEMM + add against an fp32 reference, and the whole MuonH direction against the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.kernel_choice import NEWTON_SCHULZ, chosen
from moejax.train import ns_gpu
from moejax.train.optimizer import NS_COEFFS, _ns_kernel, newton_schulz

SMALL = ns_gpu.NsTiles(bm=16, bp=32, bk=16)  # several tiles and contraction chunks at test sizes
# One bf16 rounding of the fp32 result (2^-8 relative), with fp32 accumulation order as slack.
BF16_ONE_ROUNDING = 2 ** -8
# Relative (Frobenius) error of 5 bf16 Newton-Schulz steps against the fp32 polynomial: measured at most
# 1.5% for the kernel path and 8% for the XLA path at these shapes (docs/LOG.md, eighteenth session).
NS_KERNEL_REL_ERR = 0.03
NS_XLA_REL_ERR = 0.12


def test_matmul_add_equals_fp32_reference_rounded_once():
    ka, kb, kc = jax.random.split(jax.random.key(0), 3)
    a = jax.random.normal(ka, (3, 32, 48), jnp.float32).astype(jnp.bfloat16)
    b = jax.random.normal(kb, (3, 48, 64), jnp.float32).astype(jnp.bfloat16)
    c = jax.random.normal(kc, (3, 32, 64), jnp.float32).astype(jnp.bfloat16)
    out = jax.jit(lambda a, b, c: ns_gpu.matmul_add(a, b, c, -4.775, 2.0315, SMALL, interpret=True))(a, b, c)
    f32 = lambda t: np.asarray(t, np.float32)
    ref = -4.775 * np.einsum("nmk,nkp->nmp", f32(a), f32(b)) + 2.0315 * f32(c)
    assert out.dtype == jnp.bfloat16 and out.shape == (3, 32, 64)
    np.testing.assert_allclose(f32(out), ref, rtol=BF16_ONE_ROUNDING, atol=BF16_ONE_ROUNDING * np.abs(ref).max())


@pytest.mark.parametrize("with_add", [False, True])
def test_gram_add_equals_fp32_reference_rounded_once_and_is_exactly_symmetric(with_add):
    """alpha a a^T (+ beta c) from the upper tiles only (3 x 3 tiles of 16 at M = 48), the lower ones their
    transposes: the fp32 reference rounded once, and bitwise symmetric."""
    kx, kc = jax.random.split(jax.random.key(4))
    a = jax.random.normal(kx, (3, 48, 80), jnp.float32).astype(jnp.bfloat16)
    c = jax.random.normal(kc, (3, 48, 48), jnp.float32)
    c = ((c + jnp.swapaxes(c, 1, 2)) / 2).astype(jnp.bfloat16) if with_add else None
    alpha, beta = (-4.775, 2.0315) if with_add else (1.0, 0.0)
    out = jax.jit(lambda a, c: ns_gpu.gram_add(a, c, alpha, beta, SMALL, interpret=True))(a, c)
    f32 = lambda t: np.asarray(t, np.float32)
    ref = alpha * np.einsum("nik,njk->nij", f32(a), f32(a)) + (beta * f32(c) if with_add else 0.0)
    assert out.dtype == jnp.bfloat16 and out.shape == (3, 48, 48)
    np.testing.assert_allclose(f32(out), ref, rtol=BF16_ONE_ROUNDING, atol=BF16_ONE_ROUNDING * np.abs(ref).max())
    np.testing.assert_array_equal(f32(out), np.swapaxes(f32(out), 1, 2))


def test_shapes_the_kernel_cannot_take_are_an_error():
    assert ns_gpu.shape_problem(512, 512, 512) is None and ns_gpu.shape_problem(96, 96, 3072) is None
    assert "width 24" in ns_gpu.shape_problem(24, 24, 64)
    x = jnp.zeros((2, 24, 24), jnp.bfloat16)
    with pytest.raises(ValueError, match="width 24 has no tile"):
        ns_gpu.matmul_add(x, x, x, 1.0, 1.0, interpret=True)
    with pytest.raises(ValueError, match="don't match"):
        ns_gpu.matmul_add(x, x[:, :16], x, 1.0, 1.0, interpret=True)
    with pytest.raises(ValueError, match="width 24 has no tile"):
        ns_gpu.gram_add(x, None, 1.0, 0.0, interpret=True)
    y = jnp.zeros((2, 32, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"can't be added to the Gram of bfloat16\[2, 32, 64\]"):
        ns_gpu.gram_add(y, y, 1.0, 1.0, interpret=True)


def _newton_schulz_fp32(x):
    """The same quintic polynomial, every product and sum in fp32: what both bf16 paths approximate."""
    a, b, c = NS_COEFFS
    mm = lambda p, q: jnp.einsum("...ij,...jk->...ik", p, q, precision="highest")
    x = x / (jnp.linalg.norm(x, axis=(-2, -1), keepdims=True) + 1e-7)
    tall = x.shape[-2] > x.shape[-1]
    x = jnp.swapaxes(x, -1, -2) if tall else x
    for _ in range(5):
        g = mm(x, jnp.swapaxes(x, -1, -2))
        x = a * x + mm(b * g + c * mm(g, g), x)
    return jnp.swapaxes(x, -1, -2) if tall else x


@pytest.mark.parametrize("shape", [(2, 3, 64, 64), (96, 32)])  # an expert stack; a tall matrix (transposed)
def test_newton_schulz_with_the_kernel_is_closer_to_fp32_than_xla(shape):
    """The kernel rounds each polynomial GEMM + add once; XLA rounds the GEMM to bf16 before its add. Against
    the fp32 polynomial the kernel path measured 1.2-1.5% relative error, the XLA path 4.5-8%: after 5 bf16
    iterations the two paths differ by about the XLA path's own error, so each is held to the fp32 one."""
    x = jax.random.normal(jax.random.key(1), shape, jnp.float32)
    ref = _newton_schulz_fp32(x)
    xla = jax.jit(newton_schulz)(x)
    out = jax.jit(lambda x: newton_schulz(x, kernel=dict(tiles=SMALL, interpret=True)))(x)
    assert out.shape == shape and out.dtype == jnp.float32
    err = lambda o: float(jnp.linalg.norm(o - ref) / jnp.linalg.norm(ref))
    assert err(out) < NS_KERNEL_REL_ERR and err(out) < err(xla) < NS_XLA_REL_ERR, (err(out), err(xla))


def test_kernel_choice_one_device_by_default_or_when_chosen(monkeypatch):
    """The default kernel on a GPU runs only in single-device runs (GSPMD would replicate it over sharded
    expert stacks); MOEJAX_NS=gpu_kernel chooses it anywhere; a shape without tiles keeps XLA."""
    from moejax.model import kernel_choice

    u = jnp.zeros((4, 64, 128))
    monkeypatch.delenv(NEWTON_SCHULZ[0], raising=False)
    assert _ns_kernel(u, one_device=True) is None  # CPU: XLA by default
    monkeypatch.setattr(kernel_choice.jax, "default_backend", lambda: "gpu")
    assert _ns_kernel(u, one_device=True) == {"interpret": False}
    assert _ns_kernel(u, one_device=False) is None
    assert _ns_kernel(jnp.zeros((24, 64)), one_device=True) is None
    monkeypatch.undo()
    with chosen(NEWTON_SCHULZ[0], "gpu_kernel"):
        assert _ns_kernel(u, one_device=False) == {"interpret": True}  # chosen off GPU: interpreted
    with chosen(NEWTON_SCHULZ[0], "xla"):
        assert _ns_kernel(u, one_device=True) is None
    assert NS_COEFFS == (3.4445, -4.7750, 2.0315)
