"""The dropless local backend on a data-parallel mesh: each batch shard routes its own tokens (shard_map
over the batch axes) and gives the single-device path's values, gradients and global DropStats; the GPU
kernels (interpreted here) run per batch shard the same way."""

from __future__ import annotations

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from moejax.config import ParallelConfig
from moejax.model.attention import flash_kernel
from moejax.model.moe.grouped import default_block
from moejax.model.moe.layer import routed_local_with_stats
from moejax.model.transformer import Transformer, model_loss
from moejax.parallel.backends import attention_kernel, local_backend
from moejax.parallel.mesh import BATCH_SPEC, REPLICATED, make_mesh
from tests.helpers import loop_steps, toy_batch, toy_model

RTOL_FP32 = 1e-5
ATOL_FP32 = 1e-5
T, Z, F, E, K = 512, 16, 32, 8, 2  # 64 tokens per shard on 8 devices


def _problem(seed=0):
    rng = np.random.default_rng(seed)
    z = jnp.asarray(rng.normal(size=(T, Z)), jnp.float32)
    expert = jnp.asarray(np.stack([rng.choice(E, K, replace=False) for _ in range(T)]), jnp.int32)
    weight = jnp.asarray(rng.uniform(0.1, 1.0, size=(T, K)), jnp.float32)
    mask = jnp.asarray(rng.uniform(size=T) > 0.1)
    ws = [jnp.asarray(0.3 * rng.normal(size=s), jnp.float32) for s in [(E, Z, F), (E, Z, F), (E, F, Z)]]
    return z, expert, weight, mask, ws


def _value_stats_grads(routed, args):
    z, expert, weight, mask, ws = args

    def loss(z, weight, *w):
        y, drops = routed(z, expert, weight, mask, *w)
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=jnp.float32).reshape(y.shape))), (y, drops)

    (_, (y, drops)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(z, weight, *ws)
    return y, drops, grads


@pytest.mark.parametrize("axes", [dict(data=8), dict(replica_dcn=2, data=4)], ids=["data8", "dcn2_data4"])
def test_data_parallel_local_equals_single_device(axes):
    mesh = make_mesh(ParallelConfig(**axes))
    args = _problem()
    want = _value_stats_grads(routed_local_with_stats, args)
    z, expert, weight, mask, ws = args
    tok, rep = NamedSharding(mesh, BATCH_SPEC), NamedSharding(mesh, REPLICATED)
    placed = (*jax.device_put((z, expert, weight, mask), tok), jax.device_put(ws, rep))
    routed = local_backend(mesh)
    got = _value_stats_grads(routed, placed)
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL_FP32, atol=ATOL_FP32, err_msg="y")
    assert [int(c) for c in got[1]] == [int(c) for c in want[1]], "global DropStats"
    assert int(got[1].valid) == int(jnp.sum(mask)) * K
    for name, a, b in zip(["z", "weight", "w_gate", "w_up", "w_down"], got[2], want[2]):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32, err_msg=f"grad {name}")

    # Each device runs the grouped GEMM on its own 64 tokens' blocks, not on all 512 tokens'.
    hlo = jax.jit(lambda z, e, w, m, *ws: routed(z, e, w, m, *ws)[0]).lower(*placed[:4], *placed[4]).compile().as_text()
    rows = T // 8 * K
    b = default_block(rows, E)
    blocks = (rows + E * (b - 1)) // b
    assert re.search(rf"f32\[{blocks},{b},{F}\]", hlo), "per-shard block GEMM not found"
    full_b = default_block(T * K, E)
    assert not re.search(rf"f32\[{(T * K + E * (full_b - 1)) // full_b},{full_b},{F}\]", hlo), "global blocks on a device"


def test_one_shard_is_the_plain_local_path():
    assert local_backend(make_mesh(ParallelConfig())) is routed_local_with_stats


def _pallas_calls(jaxpr, inside: bool = False) -> dict[bool, int]:
    """Pallas calls in a jaxpr (recursing into every sub-jaxpr), by whether they sit inside a shard_map."""
    found = {False: 0, True: 0}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found[inside] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    for where, n in _pallas_calls(sub, inside or eqn.primitive.name == "shard_map").items():
                        found[where] += n
    return found


def test_model_with_both_kernels_per_batch_shard_equals_xla(monkeypatch):
    """The whole model on data=8 with both GPU kernels chosen (through the Pallas interpreter, each under
    the batch shards' shard_map: `attention_kernel`, `local_backend`) gives the single-device XLA path's
    loss, gradients and DropStats, and every kernel call sits inside a shard_map. Pallas needs its outputs'
    varying axes under shard_map (`pallas_util.out_like`); before that, any multi-GPU run with a kernel
    failed at trace time."""
    model = toy_model(n_layers=2, window=12)  # one local, one global layer; 1 row of 32 per device
    batch = toy_batch(model, batch=8, seq=32, doc_lens=((10, 22), (32,), (5, 5, 22)))
    drops = ("valid", "kept", "sender_dropped", "receiver_dropped")

    def loss_and_grads(routed, kernel, params, batch):
        def fn(p):
            loss, aux = model_loss(p, batch, model, routed, remat=False, scan_layers=False, attention_kernel=kernel)
            return loss, {k: aux["layers"][k] for k in drops}

        grad_fn = jax.value_and_grad(fn, has_aux=True)
        return jax.jit(grad_fn)(params), _pallas_calls(jax.make_jaxpr(grad_fn)(params).jaxpr)

    params = Transformer.init(model, jax.random.key(3))
    monkeypatch.setenv("MOEJAX_ATTENTION", "xla")
    monkeypatch.setenv("MOEJAX_GROUPED", "xla")
    want, kernels = loss_and_grads(routed_local_with_stats, flash_kernel, params, batch)
    assert kernels == {False: 0, True: 0}

    mesh = make_mesh(ParallelConfig(data=8))
    monkeypatch.setenv("MOEJAX_ATTENTION", "gpu_kernel")
    monkeypatch.setenv("MOEJAX_GROUPED", "gpu_kernel")
    placed_params = jax.device_put(params, NamedSharding(mesh, REPLICATED))
    placed_batch = jax.device_put(batch, NamedSharding(mesh, BATCH_SPEC))
    got, kernels = loss_and_grads(local_backend(mesh), attention_kernel(mesh), placed_params, placed_batch)
    # attention fwd, dq, dkv; 2 expert matmuls' (gate and up as one; the down projection with the activation)
    # fwd, dx, dw: all per shard, none left to GSPMD
    assert kernels == {False: 0, True: model.n_layers * (3 + 2 * 3)}
    (loss_k, stats_k), grads_k = got
    (loss_x, stats_x), grads_x = want
    np.testing.assert_allclose(loss_k, loss_x, rtol=RTOL_FP32)
    for k in drops:
        np.testing.assert_array_equal(stats_k[k], stats_x[k], err_msg=k)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads_k), jax.tree.leaves(grads_x)):
        np.testing.assert_allclose(a, b, rtol=RTOL_FP32, atol=ATOL_FP32, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("axes", [dict(data=8), dict(expert=8)], ids=["local_data8", "ep_expert8"])
def test_the_loops_steps_run_every_kernel_per_batch_shard(axes, monkeypatch):
    """The train loop's own jitted steps (`loop.step_functions`) on 8 devices with both kernels chosen: every
    kernel call sits inside a batch-shard shard_map, none is left to GSPMD (which would run it replicated,
    every device on the whole batch). Per layer: training, attention fwd + dq + dkv and, on the local path,
    2 expert matmuls (gate and up as one, the down projection with the activation) x fwd + dx + dw;
    evaluation, the forwards (eval_dropless: the local path)."""
    monkeypatch.setenv("MOEJAX_ATTENTION", "gpu_kernel")
    monkeypatch.setenv("MOEJAX_GROUPED", "gpu_kernel")
    model = toy_model(n_layers=2, window=12)
    cfg, state, batch, step_fn, eval_fns = loop_steps(model, ParallelConfig(**axes), batch_size=8, seq_len=32)
    local = cfg.parallel.resolved_backend == "local"
    train = _pallas_calls(step_fn(cfg.phases[0]).trace(state, batch).jaxpr.jaxpr)  # top level: compiler_options
    assert train == {False: 0, True: model.n_layers * (3 + (6 if local else 0))}
    bytes_per_token = jnp.ones((model.vocab_size,), jnp.float32)
    want_eval = {"eval/": 1 + (2 if local else 0), "eval_dropless/": 1 + 2}
    assert set(eval_fns) == ({"eval/"} if local else {"eval/", "eval_dropless/"})
    for prefix, fn in eval_fns.items():
        calls = _pallas_calls(fn.trace(state.compute, batch, bytes_per_token).jaxpr.jaxpr)
        assert calls == {False: 0, True: model.n_layers * want_eval[prefix]}, prefix
