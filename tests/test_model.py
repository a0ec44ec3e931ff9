"""The whole model: local MoE path = dense reference (loss and all gradients), documents never leak,
layers are scanned (program size independent of depth), the z-loss holds the logit scale down (SPEC §6)."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from moejax.config import RunConfig, TrainConfig
from moejax.model.moe.layer import DropStats, routed_local_with_stats
from moejax.model.moe.reference import routed_reference
from moejax.model.transformer import Transformer, forward, model_loss
from moejax.parallel.mesh import make_mesh
from moejax.train.optimizer import make_optimizer
from moejax.train.state import init_state
from moejax.train.step import make_train_step
from tests.helpers import toy_batch, toy_model

FP32_RTOL = 1e-4  # whole-model fp32: many reductions, reordered sums between the two MoE paths
FP32_ATOL = 1e-5
LEAK_ATOL = 1e-6  # masked positions contribute exact zeros; a leak through a random tap moves outputs by O(0.1)


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


def with_random_conv_taps(params: Transformer, key) -> Transformer:
    """Non-identity taps at all three SConv sites (k, attention output, MoE output): with the identity init
    a conv that reads across a document boundary would still add nothing."""
    ka, kb, kc = jax.random.split(key, 3)
    taps = lambda k, x: jax.random.normal(k, x.shape, x.dtype)
    blocks = params.blocks
    attn = replace(blocks.attn, conv_k=taps(ka, blocks.attn.conv_k), conv_out=taps(kb, blocks.attn.conv_out))
    moe = replace(blocks.moe, conv_out=taps(kc, blocks.moe.conv_out))
    return replace(params, blocks=replace(blocks, attn=attn, moe=moe))


def test_documents_do_not_leak_through_the_whole_model():
    """Changing document 1 of a packed row must not change any output of document 2, which follows it: causal
    attention (local window 6 and global) and the causal SConv taps could both read document 1 without the
    segment masks. Checked to fail with either mask removed (attention's block_mask, or sconv's same_doc)."""
    cfg = toy_model(n_layers=2)  # layer 0 local, layer 1 global
    params = with_random_conv_taps(Transformer.init(cfg, jax.random.key(1)), jax.random.key(2))
    batch = toy_batch(cfg, batch=1, doc_lens=((7, 9),))
    run = lambda tokens: forward(params, tokens, batch["segment_ids"], batch["positions"], cfg)[0]
    base = run(batch["tokens"])
    out = run(batch["tokens"].at[0, :7].set((batch["tokens"][0, :7] + 5) % cfg.vocab_size))
    assert not np.allclose(out[0, :7], base[0, :7], atol=LEAK_ATOL)  # document 1 did change
    np.testing.assert_allclose(out[0, 7:], base[0, 7:], atol=LEAK_ATOL)


def test_layers_are_scanned():
    def n_eqns(layers):
        cfg = toy_model(n_layers=layers)
        params = jax.eval_shape(lambda k: Transformer.init(cfg, k), jax.random.key(0))
        batch = toy_batch(cfg)
        return len(jax.make_jaxpr(lambda p: model_loss(p, batch, cfg))(params).jaxpr.eqns)

    assert n_eqns(4) == n_eqns(12)


def test_remat_and_unrolled_layers_do_not_change_values():
    cfg = toy_model(n_layers=2)  # layer 1 is global, layer 0 local: the unrolled loop takes both branches
    params = Transformer.init(cfg, jax.random.key(2))
    batch = toy_batch(cfg)
    f = lambda remat, scan: jax.jit(jax.value_and_grad(
        lambda p: model_loss(p, batch, cfg, remat=remat, scan_layers=scan)[0]))(params)
    v0, g0 = f(False, True)
    for remat, scan in ((True, True), (False, False), (True, False)):
        v, g = f(remat, scan)
        np.testing.assert_allclose(v, v0, rtol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g0)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_compute_runs_and_tracks_fp32():
    cfg = toy_model(n_layers=2)
    params = Transformer.init(cfg, jax.random.key(3))
    batch = toy_batch(cfg)
    l32 = model_loss(params, batch, cfg)[0]
    l16 = model_loss(params, batch, replace(cfg, compute_dtype="bfloat16"))[0]
    assert l16.dtype == jnp.float32
    np.testing.assert_allclose(l16, l32, rtol=2e-2)  # bf16 activations, fp32 loss


# SPEC §6 pitfall "grad-norm growth at long horizons without the logit z-loss", on a real (tiny) run: plain Adam
# at a high lr memorising 4 batches drives the logit scale (mean logsumexp^2) up ~8.6x in 30 steps. The
# recipe's 1e-4 needs far longer horizons to show (measured: 2-12% lower lse^2 at 40 steps, seed-dependent),
# so the test uses Z_LOSS_STRONG to show the mechanism robustly in few steps. (Under the hero optimizer the
# AdamH hyperball keeps the head's norm fixed and lse^2 barely moves: 19.19 vs 19.16 after 60 steps.)
Z_LOSS_STRONG = 1e-2
HIGH_LR, Z_STEPS = 0.05, 30
LSE_GROWTH_WITHOUT = 3.0  # lse^2 grows at least this much over the run without z-loss (measured 8.6x)
LSE_RATIO_WITH = 0.5  # with z-loss, final lse^2 at most this fraction of the run without (measured 0.34)


def _lse_sq_trajectory(z_loss_weight: float) -> list[float]:
    cfg = RunConfig(model=toy_model(n_layers=1, z_loss_weight=z_loss_weight),
                    train=TrainConfig(seq_len=16, batch_size=8, steps=Z_STEPS, optimizer="adam", learning_rate=HIGH_LR,
                                      warmup_fraction=0.0, min_lr_fraction=1.0))
    tx, lr_fns = make_optimizer(cfg)
    state = init_state(cfg, tx, jax.random.key(0), make_mesh(cfg.parallel))
    step = jax.jit(make_train_step(cfg.model, tx, lr_fns, remat=False))
    batches = [toy_batch(cfg.model, batch=8, seq=16, seed=i) for i in range(4)]
    out = []
    for i in range(Z_STEPS):
        state, metrics = step(state, batches[i % 4])
        out.append(float(metrics["train/z_loss"]))  # mean lse^2 of this step's logits, whatever the weight
    return out


def test_z_loss_holds_down_the_logit_scale_under_a_high_lr():
    without, with_z = _lse_sq_trajectory(0.0), _lse_sq_trajectory(Z_LOSS_STRONG)
    assert without[0] == with_z[0]  # same start: only the z-loss term differs
    assert without[-1] > LSE_GROWTH_WITHOUT * without[0], without
    assert with_z[-1] < LSE_RATIO_WITH * without[-1], (with_z[-1], without[-1])
