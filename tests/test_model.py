"""The whole model: local MoE path = dense reference (loss and all gradients), documents never leak,
layers are scanned (program size independent of depth)."""

import jax
import jax.numpy as jnp
import numpy as np

from moejax.model.moe.layer import DropStats, routed_local_with_stats
from moejax.model.moe.reference import routed_reference
from moejax.model.transformer import Transformer, model_loss
from tests.helpers import toy_batch, toy_model

FP32_RTOL = 1e-4  # whole-model fp32: many reductions, reordered sums between the two MoE paths
FP32_ATOL = 1e-5


def reference_routed(z, ids, w, mask, wg, wu, wd):
    y = routed_reference(z, ids, w, mask, wg, wu, wd)
    valid = jnp.sum(mask).astype(jnp.int32) * ids.shape[1]
    zero = jnp.zeros((), jnp.int32)
    return y, DropStats(valid=valid, kept=valid, sender_dropped=zero, receiver_dropped=zero, padding_skipped=zero)


def test_model_local_path_equals_reference_loss_and_grads():
    cfg = toy_model()
    params = Transformer.init(cfg, jax.random.key(0))
    batch = toy_batch(cfg, doc_lens=((5, 9), (16,)))  # row 0 ends in padding
    g = lambda routed: jax.value_and_grad(lambda p: model_loss(p, batch, cfg, routed)[0])(params)
    v_loc, g_loc = g(routed_local_with_stats)
    v_ref, g_ref = g(reference_routed)
    np.testing.assert_allclose(v_loc, v_ref, rtol=FP32_RTOL)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_loc)[0], jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=FP32_RTOL, atol=FP32_ATOL, err_msg=jax.tree_util.keystr(path))
    assert float(jnp.abs(g_loc.blocks.moe.w_gate).sum()) > 0  # experts really receive gradient
    assert float(jnp.abs(g_loc.blocks.moe.router).sum()) > 0  # and the router, through the combine weights


def test_documents_do_not_leak_through_the_whole_model():
    """Changing document 2 of a packed row must not change any output or loss term of document 1."""
    cfg = toy_model(n_layers=2)
    params = Transformer.init(cfg, jax.random.key(1))
    batch = toy_batch(cfg, batch=1, doc_lens=((7, 9),))
    from moejax.model.transformer import forward

    run = lambda b: forward(params, b["tokens"], b["segment_ids"], b["positions"], cfg)[0]
    base = run(batch)
    tokens2 = batch["tokens"].at[0, 7:].set((batch["tokens"][0, 7:] + 5) % cfg.vocab_size)
    out = run({**batch, "tokens": tokens2})
    np.testing.assert_allclose(out[0, :7], base[0, :7], atol=FP32_ATOL)
    assert not np.allclose(out[0, 7:], base[0, 7:], atol=FP32_ATOL)


def test_layers_are_scanned():
    def n_eqns(layers):
        cfg = toy_model(n_layers=layers)
        params = jax.eval_shape(lambda k: Transformer.init(cfg, k), jax.random.key(0))
        batch = toy_batch(cfg)
        return len(jax.make_jaxpr(lambda p: model_loss(p, batch, cfg))(params).jaxpr.eqns)

    assert n_eqns(4) == n_eqns(12)


def test_remat_does_not_change_values():
    cfg = toy_model(n_layers=2)
    params = Transformer.init(cfg, jax.random.key(2))
    batch = toy_batch(cfg)
    f = lambda remat: jax.value_and_grad(lambda p: model_loss(p, batch, cfg, remat=remat)[0])(params)
    (v1, g1), (v2, g2) = f(True), f(False)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_compute_runs_and_tracks_fp32():
    cfg = toy_model(n_layers=2)
    params = Transformer.init(cfg, jax.random.key(3))
    batch = toy_batch(cfg)
    l32 = model_loss(params, batch, cfg)[0]
    from dataclasses import replace

    l16 = model_loss(params, batch, replace(cfg, compute_dtype="bfloat16"))[0]
    assert l16.dtype == jnp.float32
    np.testing.assert_allclose(l16, l32, rtol=2e-2)  # bf16 activations, fp32 loss
