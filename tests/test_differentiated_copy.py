"""The train step differentiates the matrices cast at use in the compute copy's dtype (`train.state.
differentiated_copy`) instead of through an fp32 upcast of the whole model, which held 33 GB per device in
the hero's forward. Claim: the same gradients, since those matrices' weight gradients come back in the
compute dtype either way. Checked in bf16 with remat on one device (local path, unrolled as `tiny` runs)
and on the 8-device EP mesh with FSDP weights gathered at use (scanned as the hero runs, and unrolled).

Measured: bit-identical in the local and scanned EP cases. Unrolled on EP with the gathered weights, XLA
compiles the two programs differently: its excess-precision rewrites (`xla_allow_excess_precision`, on by
default) may drop an f32 -> bf16 -> f32 round trip in one program and not in the other, and its partitioning
of the dots differs. There the loss moved by 1.7e-5 (relative) and gradients by at most 0.019 of their
leaf's largest entry: five bf16 roundings.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from moejax.config import ParallelConfig
from moejax.model.transformer import Transformer, model_loss
from moejax.parallel.backends import layer_weights, moe_backend
from moejax.parallel.mesh import BATCH_SPEC, make_mesh, param_shardings
from moejax.train.state import CAST_AT_USE_LEAVES, compute_copy, differentiated_copy
from tests.helpers import toy_batch, toy_model

BF16_ROUNDING = 2.0 ** -8
LOSS_RTOL = BF16_ROUNDING  # one rounding of the loss (measured 1.7e-5)
GRAD_ATOL_OF_MAX = 8 * BF16_ROUNDING  # per leaf, as a fraction of its largest entry (measured <= 0.019)


def _grads(compute, batch, cfg, routed, weights, scan, differentiate):
    loss = lambda p: model_loss(p, batch, cfg, routed, remat=True, scan_layers=scan, layer_weights=weights)[0]
    value, grads = jax.jit(jax.value_and_grad(loss))(differentiate(compute))
    return value, jax.tree.map(lambda g: g.astype(jnp.float32), grads)


@pytest.mark.parametrize("ep, scan", [(False, False), (True, True), (True, False)],
                         ids=["local_unrolled", "ep_expert8_scanned", "ep_expert8_unrolled"])
def test_gradients_equal_the_whole_fp32_upcast(ep, scan):
    cfg = toy_model(n_layers=2, n_experts=8, compute_dtype="bfloat16")
    compute = compute_copy(Transformer.init(cfg, jax.random.key(0)), jnp.bfloat16)
    batch = toy_batch(cfg, batch=8, seq=16)
    routed, weights = moe_backend(ParallelConfig(), make_mesh(ParallelConfig())), None
    if ep:
        par = ParallelConfig(expert=8, cf_send=4.0, cf_recv=4.0)
        mesh = make_mesh(par)
        routed, weights = moe_backend(par, mesh), layer_weights(mesh)
        compute = jax.device_put(compute, param_shardings(compute, mesh))
        batch = jax.device_put(batch, NamedSharding(mesh, BATCH_SPEC))
    upcast_all = lambda c: jax.tree.map(lambda x: x.astype(jnp.float32), c)
    want_loss, want = _grads(compute, batch, cfg, routed, weights, scan, upcast_all)
    loss, got = _grads(compute, batch, cfg, routed, weights, scan, differentiated_copy)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=LOSS_RTOL)
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    assert {getattr(p[-1], "name", None) for p, _ in flat} >= CAST_AT_USE_LEAVES  # every listed field exists
    for (path, a), b in zip(flat, jax.tree.leaves(want)):
        assert a.dtype == jnp.float32
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=GRAD_ATOL_OF_MAX * np.abs(b).max(),
                                   err_msg=jax.tree_util.keystr(path))
    kept = differentiated_copy(compute)
    assert kept.blocks.moe.w_gate.dtype == jnp.bfloat16 and kept.blocks.moe.router.dtype == jnp.float32
