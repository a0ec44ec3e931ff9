"""Block rematerialisation keeps the transport's all-to-all results (issue 11 item 3): the EP gradient with
remat on equals the one without, and the backward reruns no collective. With `train.remat_saves` keeping
less (the hero keeps nothing: the kept results would not fit), the backward reruns the rest and the
gradient is the same."""

import jax
import numpy as np
import pytest

from moejax.config import ALL_TO_ALLS_PER_WAVE, ParallelConfig
from moejax.model.transformer import Transformer, model_loss
from moejax.parallel.backends import moe_backend
from moejax.parallel.mesh import BATCH_SPEC, make_mesh, param_shardings
from tests.helpers import toy_batch, toy_model

REMAT_GRAD_ATOL = 1e-6  # fp32: remat recomputes the same ops; only fusion may reorder a sum
WAVES = 3


def _setup():
    cfg = toy_model(n_layers=2, n_experts=8)
    mesh = make_mesh(ParallelConfig(expert=8, cf_send=4.0, cf_recv=4.0, waves=WAVES))
    routed = moe_backend(ParallelConfig(expert=8, cf_send=4.0, cf_recv=4.0, waves=WAVES), mesh)
    params = Transformer.init(cfg, jax.random.key(0))
    params = jax.device_put(params, param_shardings(params, mesh))
    batch = toy_batch(cfg, batch=8, seq=16)
    batch = jax.device_put(batch, jax.sharding.NamedSharding(mesh, BATCH_SPEC))
    return cfg, routed, params, batch


def _grad_fn(cfg, routed, remat):
    return jax.jit(jax.grad(lambda p, b: model_loss(p, b, cfg, routed, remat=remat)[0]))


@pytest.mark.parametrize("experts", ["xla", "gpu_kernel"], ids=["capacity_einsums", "grouped_kernels"])
def test_remat_keeps_transport_results_and_gradients(experts, monkeypatch):
    """Also with the expert MLPs on the grouped kernels (MOEJAX_EP_GROUPED; interpreted here), whose own
    checkpoint sits between the kept dispatch and return."""
    monkeypatch.setenv("MOEJAX_EP_GROUPED", experts)
    cfg, routed, params, batch = _setup()
    grads, counts = {}, {}
    for remat in (True, False):
        fn = _grad_fn(cfg, routed, remat)
        # The collectives moejax emits itself (before XLA adds its own resharding): W waves x (dispatch,
        # return) x (forward, backward) = 12 per scanned layer body; remat must not rerun the forward ones.
        counts[remat] = fn.lower(params, batch).as_text().count("stablehlo.all_to_all")
        grads[remat] = fn(params, batch)
    assert counts[True] == counts[False] == WAVES * 2 * 2, counts
    for a, b in zip(jax.tree.leaves(grads[True]), jax.tree.leaves(grads[False])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=REMAT_GRAD_ATOL)


@pytest.mark.parametrize("saves", ["dispatch", "nothing"])
def test_remat_keeping_less_reruns_the_rest_of_the_transport(saves):
    cfg, routed, params, batch = _setup()
    fn = _grad_fn(cfg, routed, saves)
    count = fn.lower(params, batch).as_text().count("stablehlo.all_to_all")
    assert count == WAVES * ALL_TO_ALLS_PER_WAVE[saves] == WAVES * {"dispatch": 5, "nothing": 6}[saves]
    if saves == "nothing":  # the values stay those of the step without remat
        want = _grad_fn(cfg, routed, False)(params, batch)
        for a, b in zip(jax.tree.leaves(fn(params, batch)), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=REMAT_GRAD_ATOL)
