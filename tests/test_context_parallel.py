"""Context parallelism (issue 14) on the 8 forced CPU devices: the same batch laid out as 1, 2 or 4 chunks per
sequence, each chunk on its own device, gives the same loss and gradients. The batch has documents that
cross chunk boundaries, local windows that straddle them (and one wider than a chunk: a two-hop halo), a
global layer reading every earlier chunk, SConv taps across the boundary and next-token targets across it.
"""

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from moejax.config import ParallelConfig
from moejax.data.loader import chunk_rows
from moejax.model.layers import front_extend
from moejax.model.transformer import Transformer, model_loss
from moejax.parallel.backends import moe_backend
from moejax.parallel.mesh import REPLICATED, batch_sharding, make_mesh, param_shardings
from tests.helpers import toy_batch, toy_model

# CP vs no CP in fp32: the same math over the same tokens; only the order of reductions differs (the
# per-device partial sums of weight gradients, the loss mean). Measured: loss 1e-7, grads < 1e-6 relative.
CP_RTOL_FP32 = 2e-5
CP_ATOL_FP32 = 2e-6
NO_DROP_CF = 16.0  # P and R above any possible load at these shapes: EP drops nothing, so it equals dropless
SEQ, N_SEQS = 32, 2
# documents crossing the chunk boundaries 8/16/24 (c=4) and 16 (c=2); row 1 ends in padding
DOC_LENS = ((5, 11, 10, 6), (13, 12))


def _run(cfg, batch, context: int):
    """Loss, grads and drop count with `context` chunks per sequence, one chunk per device (EP mesh)."""
    rows = N_SEQS * context
    par = ParallelConfig(expert=rows, cf_send=NO_DROP_CF, cf_recv=NO_DROP_CF)
    mesh = make_mesh(par)
    params = Transformer.init(cfg, jax.random.key(0))
    params = jax.device_put(params, param_shardings(params, mesh))
    chunks = jax.device_put(chunk_rows(batch, context), batch_sharding(mesh))
    routed = moe_backend(par, mesh)

    def f(p, b):
        (loss, aux), grads = jax.value_and_grad(lambda p: model_loss(p, b, cfg, routed, remat=False, context=context),
                                                has_aux=True)(p)
        dropped = jnp.sum(aux["layers"]["sender_dropped"] + aux["layers"]["receiver_dropped"])
        return loss, grads, dropped, aux["tokens"]

    loss, grads, dropped, tokens = jax.jit(f, out_shardings=NamedSharding(mesh, REPLICATED))(params, chunks)
    return float(loss), jax.device_get(grads), int(dropped), float(tokens)


def test_context_parallel_loss_and_grads_equal():
    # window 12: its 11-key halo is one hop at c=2 (chunks of 16) and two hops at c=4 (chunks of 8)
    cfg = toy_model(window=12, n_layers=2)  # layer 0 local, layer 1 (the last) global
    batch = {k: np.asarray(v) for k, v in toy_batch(cfg, N_SEQS, SEQ, seed=3, doc_lens=DOC_LENS).items()}
    want_loss, want_grads, dropped, tokens = _run(cfg, batch, 1)
    assert dropped == 0 and tokens == batch["loss_mask"].sum()
    for context in (2, 4):
        loss, grads, dropped, _ = _run(cfg, batch, context)
        assert dropped == 0
        np.testing.assert_allclose(loss, want_loss, rtol=CP_RTOL_FP32, err_msg=f"loss, context {context}")
        for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(grads)[0], jax.tree.leaves(want_grads)):
            np.testing.assert_allclose(g, w, rtol=CP_RTOL_FP32, atol=CP_ATOL_FP32,
                                       err_msg=f"d{jax.tree_util.keystr(path)}, context {context}")


def test_front_extend_reads_only_its_own_sequence():
    a = jnp.arange(4 * 3).reshape(4, 3)  # 2 sequences x 2 chunks of 3
    got = np.asarray(front_extend(a, 4, 2, -1))
    np.testing.assert_array_equal(got, [[-1, -1, -1, -1, 0, 1, 2], [-1, 0, 1, 2, 3, 4, 5],
                                        [-1, -1, -1, -1, 6, 7, 8], [-1, 6, 7, 8, 9, 10, 11]])
    np.testing.assert_array_equal(front_extend(a, 2, 1, 0), np.pad(np.asarray(a), ((0, 0), (2, 0))))


def test_halo_is_a_collective_permute_not_a_gather():
    """Under jit on a sharded row axis, the roll of a chunk's tail lowers to a collective-permute."""
    mesh = make_mesh(ParallelConfig(expert=8))
    x = jax.device_put(jnp.zeros((8, 16, 4)), batch_sharding(mesh))
    hlo = jax.jit(lambda x: front_extend(x, 3, 4, 0.0)).lower(x).compile().as_text()
    assert "collective-permute" in hlo and "all-gather" not in hlo
