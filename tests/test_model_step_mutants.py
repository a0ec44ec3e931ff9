"""What lies between the model block, the transport and the run loop: the LM head and loss plumbing of
`model.transformer`, the train / eval steps of `train.step`. Each test kills one or more mutants of a mutation
audit (transformer.py, step.py, backends.py) that the rest of the suite let through: the optimizer handed
fp32 gradients, the logged bias range / cross-entropy / token count being the step's own, QB off leaving the
router bias alone, the step's remat and unrolled layers really in its program (no lax.cond per layer), the
eval step's CE sum without the z-loss and its drop count with both sides, the streamed LM head used by
`model_loss`, the embedding in the compute dtype, and the chunked logsumexp stable across chunks."""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from moejax.config import ParallelConfig, RunConfig, TrainConfig
from moejax.model.transformer import Transformer, chunked_lse, embed, forward, lm_loss, model_loss
from moejax.train.optimizer import make_optimizer
from moejax.train.state import differentiated_copy, init_state
from moejax.train.step import make_eval_step, make_train_step
from tests.helpers import all_eqns, loop_steps, toy_batch, toy_model
from tests.test_layers import CHUNKED_HEAD_ATOL, CHUNKED_HEAD_RTOL, _loss_inputs, _reference_loss
from tests.test_recipe_block_mutants import SPEC_Z_LOSS
from tests.test_recipe_metrics_mutants import FP32_RTOL

SEQ, BATCH = 16, 2


def _state_and_step(model, remat=False, scan_layers=False, optimizer=None, abstract=False):
    cfg = RunConfig(model=model, train=TrainConfig(seq_len=SEQ, batch_size=BATCH, steps=10, optimizer="adam",
                                                   learning_rate=1e-2, warmup_fraction=0.0))
    tx, lr_fns = make_optimizer(cfg)
    tx = optimizer(tx) if optimizer else tx
    make = lambda: init_state(cfg, tx, jax.random.key(0))
    state = jax.eval_shape(make) if abstract else make()
    return state, make_train_step(model, tx, lr_fns, remat=remat, scan_layers=scan_layers)


# ---- the train step's gradient, metrics and router bias ------------------------------------------------------
def test_the_optimizer_gets_fp32_gradients_under_bf16_compute():
    """The step upcasts every gradient to fp32 before the update (the routed experts are differentiated in the
    compute dtype, `differentiated_copy`): the optimizer's moments and the fp32 master must not see bf16."""
    seen = []

    def recording(tx):
        def update(grads, state, params=None):
            seen.append(jax.tree.map(lambda g: g.dtype, grads))
            return tx.update(grads, state, params)
        return optax.GradientTransformation(tx.init, update)

    model = toy_model(n_layers=1, compute_dtype="bfloat16")
    state, step = _state_and_step(model, optimizer=recording, abstract=True)
    jax.eval_shape(step, state, toy_batch(model, batch=BATCH, seq=SEQ))
    dtypes = jax.tree.leaves(seen[-1])
    differentiated = jax.tree.leaves(jax.eval_shape(differentiated_copy, state.compute))
    assert jnp.dtype(jnp.bfloat16) in [x.dtype for x in differentiated], "nothing differentiated in bf16"
    assert all(d == jnp.float32 for d in dtypes), dtypes


@pytest.fixture(scope="module")
def qb_step():
    """One jitted step from init (router bias 0) of a 2-layer toy model with QB, and its inputs."""
    model = toy_model(n_layers=2)
    state, step = _state_and_step(model)
    batch = toy_batch(model, batch=BATCH, seq=SEQ, doc_lens=((5, 8), (16,)))  # padding and a document end
    new_state, metrics = jax.jit(step)(state, batch)
    return model, state, batch, new_state, {k: np.asarray(v) for k, v in metrics.items()}


def test_logged_bias_range_is_the_new_bias_the_next_step_routes_with(qb_step):
    """`train/router/bias_range(_layer)` describe the bias this step wrote (QB drift shows there first), not the
    one it routed with (0 at init)."""
    _, state, _, new_state, m = qb_step
    assert float(jnp.max(jnp.abs(state.params.blocks.moe.router_bias))) == 0.0
    bias = np.asarray(new_state.params.blocks.moe.router_bias, np.float64)
    range_L = bias.max(-1) - bias.min(-1)
    assert range_L.max() > 0 and range_L[0] != range_L[1]
    np.testing.assert_allclose(m["train/router/bias_range"], range_L.max(), rtol=FP32_RTOL)
    assert int(m["train/router/bias_range_layer"]) == int(np.argmax(range_L))


def test_logged_cross_entropy_and_tokens_are_the_losss_parts(qb_step):
    """`train/cross_entropy_loss` is the CE alone (not the optimised loss with the z-loss), `train/tokens` the
    number of scored targets (loss_mask), both of the step's own forward."""
    model, state, batch, _, m = qb_step
    _, aux = jax.jit(lambda p: model_loss(p, batch, model, remat=False, scan_layers=False))(
        differentiated_copy(state.compute))
    ce, z = float(aux["cross_entropy_loss"]), float(aux["z_loss"])
    assert SPEC_Z_LOSS * z > 10 * FP32_RTOL * ce  # the z-loss term is visible at this tolerance
    np.testing.assert_allclose(m["train/cross_entropy_loss"], ce, rtol=FP32_RTOL)
    np.testing.assert_allclose(m["train/loss"], ce + SPEC_Z_LOSS * z, rtol=FP32_RTOL)
    mask = np.asarray(batch["loss_mask"])
    assert mask.sum() < mask.size
    assert float(m["train/tokens"]) == float(mask.sum())


def test_without_qb_the_step_leaves_the_router_bias_alone():
    """model.qb = False: no QB hook, so the router bias stays 0 (master and compute copy) after a step."""
    model = toy_model(n_layers=2, qb=False)
    state, step = _state_and_step(model)
    new_state, _ = jax.jit(step)(state, toy_batch(model, batch=BATCH, seq=SEQ))
    for tree in (new_state.params, new_state.compute):
        np.testing.assert_array_equal(np.asarray(tree.blocks.moe.router_bias), 0.0)


# ---- the step's program: remat and unrolled layers -------------------------------------------------------------
N_LAYERS_PROGRAM = 3  # a scan length nothing else in the toy step has
REMAT_PRIMITIVES = ("checkpoint", "remat2")  # jax.checkpoint's primitive, by jax version


def _step_eqns(remat, scan_layers):
    model = toy_model(n_layers=N_LAYERS_PROGRAM)
    state, step = _state_and_step(model, remat=remat, scan_layers=scan_layers, abstract=True)
    return all_eqns(jax.make_jaxpr(step)(state, toy_batch(model, batch=BATCH, seq=SEQ)).jaxpr)


def _layer_scans(eqns):
    return [e for e in eqns if e.primitive.name == "scan" and e.params["length"] == N_LAYERS_PROGRAM]


def test_train_step_rematerialises_unrolled_layers_with_a_static_layer_kind():
    """make_train_step(remat=True, scan_layers=False): every block under jax.checkpoint, the layers unrolled
    (no layer scan), and each block's `is_global` static, so no lax.cond picks the attention kind per layer.
    Scanned, the layer scan and its cond are there (the checks can fail)."""
    unrolled = _step_eqns(remat=True, scan_layers=False)
    assert sum(e.primitive.name in REMAT_PRIMITIVES for e in unrolled) == N_LAYERS_PROGRAM
    assert not _layer_scans(unrolled)
    assert not [e for e in unrolled if e.primitive.name == "cond"]
    scanned = _step_eqns(remat=True, scan_layers=True)
    assert len(_layer_scans(scanned)) == 2  # forward and backward
    assert [e for e in scanned if e.primitive.name == "cond"]
    assert not [e for e in _step_eqns(remat=False, scan_layers=False) if e.primitive.name in REMAT_PRIMITIVES]


# ---- the eval step -----------------------------------------------------------------------------------------------
def test_eval_step_sums_cross_entropy_without_the_z_loss_and_follows_scan_layers():
    """`ce_sum` is CE x scored tokens (eval/loss and bpb are cross-entropy, SPEC §5), not the optimised loss;
    built unrolled, the eval step has no layer scan."""
    model = toy_model(n_layers=N_LAYERS_PROGRAM)
    params = Transformer.init(model, jax.random.key(1))
    batch = toy_batch(model, batch=BATCH, seq=SEQ)
    bpt = jnp.ones((model.vocab_size,), jnp.int32)
    out = jax.jit(make_eval_step(model, scan_layers=False))(params, batch, bpt)
    _, aux = model_loss(params, batch, model, remat=False)
    tokens = float(np.asarray(batch["loss_mask"]).sum())
    assert SPEC_Z_LOSS * float(aux["z_loss"]) > 10 * FP32_RTOL * float(aux["cross_entropy_loss"])
    np.testing.assert_allclose(out["ce_sum"], float(aux["cross_entropy_loss"]) * tokens, rtol=FP32_RTOL)
    assert float(out["tokens"]) == tokens
    unrolled = all_eqns(jax.make_jaxpr(make_eval_step(model, scan_layers=False))(params, batch, bpt).jaxpr)
    scanned = all_eqns(jax.make_jaxpr(make_eval_step(model, scan_layers=True))(params, batch, bpt).jaxpr)
    assert not _layer_scans(unrolled) and _layer_scans(scanned)


@pytest.mark.parametrize("cf_send, cf_recv, side", [(8.0, 0.5, "receiver"), (0.5, 8.0, "sender")])
def test_eval_step_counts_sender_and_receiver_drops(cf_send, cf_recv, side):
    """The eval step's `dropped` (pooled by `evaluate` into eval/drop_fraction) counts both kinds of drop:
    on the EP mesh, with only the receiver's (or only the sender's) capacity binding, it is that side's
    count and matches the step's own drop fraction."""
    model = toy_model(n_layers=2)
    _, state, batch, _, eval_fns = loop_steps(model, ParallelConfig(expert=8, cf_send=cf_send, cf_recv=cf_recv),
                                              batch_size=8, seq_len=SEQ)
    out = {k: float(v) for k, v in eval_fns["eval/"](state.compute, batch, jnp.ones((model.vocab_size,),
                                                                                       jnp.int32)).items()}
    other = "sender" if side == "receiver" else "receiver"
    assert out[f"moe/{side}_drop_fraction"] > 0.0 and out[f"moe/{other}_drop_fraction"] == 0.0
    np.testing.assert_allclose(out["dropped"], out[f"moe/{side}_drop_fraction"] * out["valid"], rtol=FP32_RTOL)
    np.testing.assert_allclose(out["dropped"] / out["valid"], out["moe/drop_fraction"], rtol=FP32_RTOL)


# ---- the model's LM head and embedding ----------------------------------------------------------------------------
VOCAB_BLOCK = 16
STREAM_ROWS = 3  # 48 tokens: no other dimension of the toy model (d_model 32, V 64)


def test_model_loss_streams_the_lm_head_over_the_configs_vocab_blocks():
    """model.loss_vocab_block > 0 (the ladder's and hero's): `model_loss`'s value and gradient never hold the
    [T, V] fp32 logits, only [T, block] pieces, and the loss is the one-dot head's."""
    model = toy_model(n_layers=1, loss_vocab_block=VOCAB_BLOCK)
    params = Transformer.init(model, jax.random.key(2))
    batch = toy_batch(model, batch=STREAM_ROWS, seq=SEQ)
    grad = jax.value_and_grad(lambda p, m: model_loss(p, batch, m, remat=False)[0])
    tokens = STREAM_ROWS * SEQ
    shapes = {tuple(v.aval.shape) for e in all_eqns(jax.make_jaxpr(lambda p: grad(p, model))(params).jaxpr)
              for v in e.outvars if hasattr(v.aval, "shape") and v.aval.dtype == jnp.float32}
    assert (tokens, VOCAB_BLOCK) in shapes and (tokens, model.vocab_size) not in shapes
    np.testing.assert_allclose(grad(params, model)[0], grad(params, replace(model, loss_vocab_block=0))[0],
                               rtol=CHUNKED_HEAD_RTOL)


def test_embedding_and_forward_run_in_the_compute_dtype():
    """bf16 compute: the embedding lookup is cast to bf16 before its norm, so the residual stream (and the
    final hidden states the LM head reads) stay bf16; an fp32 embedding would carry fp32 through every layer."""
    model = toy_model(n_layers=1, compute_dtype="bfloat16")
    params = Transformer.init(model, jax.random.key(3))
    batch = toy_batch(model, batch=BATCH, seq=SEQ)
    assert embed(params, batch["tokens"], model).dtype == jnp.bfloat16
    shape = jax.eval_shape(lambda p: forward(p, batch["tokens"], batch["segment_ids"], batch["positions"], model,
                                             remat=False)[0], params)
    assert shape.dtype == jnp.bfloat16


# Logits of the first vocab chunk near -LOGIT_SPREAD, of the second near +LOGIT_SPREAD: exp of their
# difference overflows fp32 (max ~88) unless each chunk is shifted by the global max.
LOGIT_SPREAD = 80.0


def test_chunked_logsumexp_shifts_by_the_max_over_every_chunk():
    """`chunked_lse` with the largest logits in a later chunk than the first: the logsumexp and target logit of
    a float64 reference, finite."""
    rng = np.random.default_rng(5)
    t_n, d, chunk = 6, 4, 8
    h = np.abs(rng.normal(size=(t_n, d))) + 0.5
    w = np.concatenate([-np.ones((d, chunk)), np.ones((d, chunk))], axis=1) * (LOGIT_SPREAD / (d * 1.5))
    w = w + 0.01 * rng.normal(size=w.shape)
    t = np.array([0, 7, 8, 15, 3, 12])
    lse, target = chunked_lse(jnp.asarray(h, jnp.float32), jnp.asarray(w, jnp.float32), jnp.asarray(t), chunk)
    logits = np.asarray(jnp.asarray(h, jnp.float32), np.float64) @ np.asarray(jnp.asarray(w, jnp.float32), np.float64)
    top = logits.max(-1)
    assert np.min(top - logits[:, :chunk].max(-1)) > 88.0  # the first chunk's max would overflow exp
    lse_ref = top + np.log(np.exp(logits - top[:, None]).sum(-1))
    np.testing.assert_allclose(lse, lse_ref, rtol=CHUNKED_HEAD_RTOL)
    np.testing.assert_allclose(target, logits[np.arange(t_n), t], rtol=CHUNKED_HEAD_RTOL)


# Logits near 0 (head scale 0.1): each of the 50 columns adds ~1/50 of the softmax sum, so one padding column
# counted (logit 0, from the zero-padded last block) would move the loss by ~2%, far above the tolerance. At
# the large scales of test_layers' streamed tests such a column is lost below fp32 rounding.
SMALL_LOGIT_SCALE = 0.1


def test_streamed_lm_head_leaves_out_the_padding_columns_of_its_last_block():
    """V = 50 in blocks of 16: the last block holds 2 real columns and 14 zero padding columns, all masked."""
    h, head, t, mask = _loss_inputs(SMALL_LOGIT_SCALE)
    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1))(h, head)
    v, g = grad(lambda h, w: lm_loss(h, w, t, mask, 1e-4, vocab_block=16)["loss"])
    v_ref, g_ref = grad(lambda h, w: _reference_loss(h, w, t, mask))
    np.testing.assert_allclose(v, v_ref, rtol=CHUNKED_HEAD_RTOL)
    for a, b in zip(g, g_ref):
        np.testing.assert_allclose(a, b, rtol=CHUNKED_HEAD_RTOL, atol=CHUNKED_HEAD_ATOL)

