"""The drops-vs-context measurement (`moejax.drop_curve`, bench/bench_drops_context.py) on a toy model.

Its counts must be the transport's: the fractions equal the eval step's `moe/*drop_fraction` metrics for
the same weights and batch, kept + sender + receiver = valid per layer, nothing is dropped at a capacity
factor whose buffers cannot overflow, and drops appear as cf shrinks.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.config import ParallelConfig
from moejax.drop_curve import (DropCounts, documents_per_shard, make_drop_measure, measure_drops, replicate,
                               set_router_bias, smallest_cf)
from moejax.model.transformer import Transformer
from moejax.parallel.expert_parallel import routed_expert_parallel
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.train.step import make_eval_step
from tests.helpers import toy_batch, toy_model

BIG_CF = 8.0  # P reaches its cap ceil(A/W) and R exceeds every row that can arrive: nothing can drop
MID_CF = 0.8  # drops on both sides (sender and receiver) for this toy batch
SMALL_CF = 0.5


@pytest.fixture(scope="module")
def setup():
    cfg = toy_model(n_layers=2)
    mesh = make_mesh(ParallelConfig(expert=8))
    params = replicate(Transformer.init(cfg, jax.random.key(1)), mesh)
    batch = {k: np.asarray(v) for k, v in toy_batch(cfg, batch=8, seq=16, doc_lens=((5, 11), (16,), (3, 3, 10)))
             .items()}
    fns = {cf: make_drop_measure(cfg, mesh, cf_send=cf, cf_recv=cf) for cf in (SMALL_CF, MID_CF, BIG_CF)}
    return cfg, mesh, params, batch, fns


def test_drops_vanish_at_large_cf_and_grow_as_cf_shrinks(setup):
    cfg, mesh, params, batch, fns = setup
    fractions = {}
    for cf, fn in fns.items():
        counts, _ = measure_drops(fn, params, batch)
        assert counts.valid == (8 * 16 * cfg.top_k,) * cfg.n_layers  # no padding in these rows
        fractions[cf] = counts.fraction("total")
        assert fractions[cf] == pytest.approx(counts.fraction("sender") + counts.fraction("receiver"))
    assert fractions[BIG_CF] == 0.0
    assert fractions[SMALL_CF] > fractions[MID_CF] > 0.0, fractions


def test_counts_match_the_eval_steps_drop_metrics(setup):
    """Same weights, batch and transport: the measurement reads exactly what training logs."""
    cfg, mesh, params, batch, fns = setup
    cf = MID_CF
    counts, bias = measure_drops(fns[cf], params, batch)
    routed = partial(routed_expert_parallel, mesh=mesh, waves=3, cf_send=cf, cf_recv=cf)
    sharded = {k: jax.device_put(v, batch_sharding(mesh)) for k, v in batch.items()}
    metrics = jax.jit(make_eval_step(cfg, routed))(params, sharded, jnp.ones((cfg.vocab_size,), jnp.int32))
    assert counts.fraction("sender") > 0 and counts.fraction("receiver") > 0  # both paths are exercised
    assert float(metrics["moe/drop_fraction"]) == pytest.approx(counts.fraction("total"), abs=1e-7)
    assert float(metrics["moe/sender_drop_fraction"]) == pytest.approx(counts.fraction("sender"), abs=1e-7)
    assert float(metrics["moe/receiver_drop_fraction"]) == pytest.approx(counts.fraction("receiver"), abs=1e-7)
    for i, f in enumerate(counts.layer_fractions()):
        assert float(metrics[f"train/router/layer_{i}/capacity_overflow_rate"]) == pytest.approx(f, abs=1e-7)
    assert float(metrics["ce_sum"] / metrics["tokens"]) == pytest.approx(counts.cross_entropy, rel=1e-5)
    assert bias.shape == (cfg.n_layers, cfg.n_experts)
    moved = set_router_bias(params, bias)  # QB re-settled on this batch: routing changes, accounting holds
    assert not np.allclose(np.asarray(moved.blocks.moe.router_bias), np.asarray(params.blocks.moe.router_bias))
    assert sum(measure_drops(fns[cf], moved, batch)[0].valid) == sum(counts.valid)


def test_broken_accounting_is_refused():
    with pytest.raises(ValueError, match="layer 1"):
        DropCounts(valid=(8, 8), kept=(6, 5), sender_dropped=(1, 1), receiver_dropped=(1, 1), cross_entropy=0.0)


def test_documents_per_shard():
    seg = np.array([[1, 1, 2, 2], [1, 1, 1, 1], [1, 2, 3, 0], [0, 0, 0, 0]])
    np.testing.assert_array_equal(documents_per_shard(seg, 2), [3, 3])  # padding (0) is no document
    np.testing.assert_array_equal(documents_per_shard(seg, 4), [2, 1, 3, 0])
    with pytest.raises(ValueError, match="not divisible"):
        documents_per_shard(seg, 3)


def test_smallest_cf_needs_every_larger_cf_under_target():
    cfs = [1.0, 1.15, 1.25, 1.5, 2.0]
    assert smallest_cf(cfs, [0.10, 0.05, 0.02, 0.01, 0.0], 0.03) == 1.25
    assert smallest_cf(cfs, [0.02, 0.05, 0.02, 0.01, 0.0], 0.03) == 1.25  # a lucky blip at 1.0 does not count
    assert smallest_cf(cfs, [0.2, 0.1, 0.08, 0.05, 0.04], 0.03) is None
    assert smallest_cf(list(reversed(cfs)), [0.0, 0.01, 0.02, 0.05, 0.10], 0.03) == 1.25  # order-free
