"""The dropless local MoE path equals the dense reference (values and gradients)."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.model.layers import swiglu
from moejax.model.moe.experts import routed_local
from moejax.model.moe.layer import MoE, moe_mix
from moejax.model.moe.reference import routed_reference
from tests.helpers import toy_model

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


def test_moe_layer_adds_each_shared_expert_and_runs_without_any():
    """`moe_mix` with 2 shared experts minus the same layer with none (n_shared = 0, the branch that skips
    them) is the sum of the two SwiGLUs, each with its own weights."""
    cfg2 = toy_model()
    cfg0 = replace(cfg2, n_shared=0)
    p2 = MoE.init(cfg2, jax.random.key(1))
    p0 = replace(p2, shared_gate=p2.shared_gate[:0], shared_up=p2.shared_up[:0], shared_down=p2.shared_down[:0])
    m = jax.random.normal(jax.random.key(2), (2, 8, cfg2.d_model))
    seg = jnp.ones((2, 8), jnp.int32)
    y2, _ = moe_mix(p2, m, seg, cfg2)
    y0, _ = moe_mix(p0, m, seg, cfg0)
    m_TD = m.reshape(-1, cfg2.d_model)
    shared = sum(swiglu(m_TD, p2.shared_gate[u], p2.shared_up[u], p2.shared_down[u]) for u in range(2))
    np.testing.assert_allclose((y2 - y0).reshape(-1, cfg2.d_model), shared, rtol=FP32_RTOL, atol=FP32_ATOL)
    assert float(jnp.max(jnp.abs(shared))) > 1e-3  # the shared experts contribute something to compare
