"""The dropless local MoE path equals the dense reference (values and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.moe.experts import expert_mlp_grouped, routed_local
from moejax.model.moe.reference import routed_reference

FP32_RTOL = 1e-5
FP32_ATOL = 1e-5


def _inputs(seed, T=48, K=2, E=8, Z=12, F=20, skew=None):
    ks = jax.random.split(jax.random.key(seed), 6)
    z = jax.random.normal(ks[0], (T, Z))
    if skew is None:
        ids = jax.random.randint(ks[1], (T, K), 0, E)
    else:  # unequal loads and empty experts: only experts in `skew` are ever chosen
        ids = jnp.asarray(np.random.default_rng(seed).choice(skew, size=(T, K)), jnp.int32)
    w = jax.random.uniform(ks[2], (T, K))
    wg = 0.3 * jax.random.normal(ks[3], (E, Z, F))
    wu = 0.3 * jax.random.normal(ks[4], (E, Z, F))
    wd = 0.3 * jax.random.normal(ks[5], (E, F, Z))
    return z, ids, w, wg, wu, wd


@pytest.mark.parametrize("skew", [None, [0, 3, 3, 3, 5]], ids=["uniform", "unequal_and_empty"])
def test_local_equals_reference_values_and_grads(skew):
    z, ids, w, wg, wu, wd = _inputs(0, skew=skew)
    mask = jnp.arange(z.shape[0]) < 40  # the last 8 tokens are padding

    def loss(fn, z, w, wg, wu, wd):
        y = fn(z, ids, w, mask, wg, wu, wd)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape)))

    args = (z, w, wg, wu, wd)
    v_loc, g_loc = jax.value_and_grad(lambda *a: loss(routed_local, *a), argnums=range(5))(*args)
    v_ref, g_ref = jax.value_and_grad(lambda *a: loss(routed_reference, *a), argnums=range(5))(*args)
    np.testing.assert_allclose(v_loc, v_ref, rtol=FP32_RTOL, atol=FP32_ATOL)
    for a, b in zip(g_loc, g_ref):
        np.testing.assert_allclose(a, b, rtol=FP32_RTOL, atol=FP32_ATOL)
    y = routed_local(z, ids, w, mask, wg, wu, wd)
    assert np.all(np.asarray(y[40:]) == 0.0), "padding tokens must get no routed output"


def test_grouped_gemm_weight_grads_unaligned_groups():
    """SPEC §6 pitfall: grouped-GEMM weight gradients on random, unaligned group sizes vs per-group fp32."""
    rng = np.random.default_rng(1)
    E, Z, F = 5, 7, 9
    sizes = np.array([0, 13, 1, 29, 6])  # includes an empty group and odd offsets
    x = jnp.asarray(rng.normal(size=(sizes.sum(), Z)), jnp.float32)
    ws = [jnp.asarray(rng.normal(size=s), jnp.float32) * 0.3 for s in [(E, Z, F), (E, Z, F), (E, F, Z)]]
    ct = jnp.asarray(rng.normal(size=(sizes.sum(), Z)), jnp.float32)

    def grouped(x, wg, wu, wd):
        return jnp.sum(expert_mlp_grouped(x, jnp.asarray(sizes, jnp.int32), wg, wu, wd) * ct)

    def per_group(x, wg, wu, wd):
        out, start = 0.0, 0
        for e, n in enumerate(sizes):
            xs = x[start:start + n]
            h = jax.nn.silu(xs @ wg[e]) * (xs @ wu[e])
            out = out + jnp.sum((h @ wd[e]) * ct[start:start + n])
            start += n
        return out

    g1 = jax.grad(grouped, argnums=(0, 1, 2, 3))(x, *ws)
    g2 = jax.grad(per_group, argnums=(0, 1, 2, 3))(x, *ws)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, rtol=FP32_RTOL, atol=FP32_ATOL)
