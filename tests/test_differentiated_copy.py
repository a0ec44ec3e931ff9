"""The train step differentiates the routed experts' matrices in the compute copy's dtype (`train.state.
differentiated_copy`) instead of through an fp32 upcast of the whole model, which held 33 GB per device in
the hero's forward. Claim: the same gradients, to the bit, since those matrices' weight gradients come back
in the compute dtype either way. Checked in bf16 with remat on one device (local path, unrolled as `tiny`
runs) and on the 8-device EP mesh with FSDP weights gathered at use (scanned as the hero runs, and unrolled).

(With every matrix cast at use left in bf16, the FSDP-gathered ones too, the unrolled EP case differed by
up to five bf16 roundings, their gradients were reduce-scattered in bf16, and XLA's GPU compiler refused the
data-parallel step: docs/LOG.md 2026-12-01, fifth session.)
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
    assert float(loss) == float(want_loss)
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    assert {getattr(p[-1], "name", None) for p, _ in flat} >= CAST_AT_USE_LEAVES  # every listed field exists
    for (path, a), b in zip(flat, jax.tree.leaves(want)):
        assert a.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    kept = differentiated_copy(compute)
    assert kept.blocks.moe.w_gate.dtype == jnp.bfloat16 and kept.blocks.moe.router.dtype == jnp.float32
