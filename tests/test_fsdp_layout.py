"""FSDP keeps every token on its own device: with the batch and the FSDP-sharded weights on the same mesh
axis (`expert` on EP meshes, `data` on data-parallel ones), each layer's weights are all-gathered at use
(`parallel.backends.layer_weights`) and no dense layer runs on other devices' tokens.

Left to GSPMD, the clash was resolved the other way: the tokens were all-gathered, each device computing on
the whole mesh's tokens (a slice of the features each). At the hero's mesh that put 64 x a device's tokens
in every dense layer and 1.58 TB in XLA's GPU memory plan per device (docs/LOG.md 2026-12-01, fourth
session). Checked here in the compiled per-device program of the CPU's 8 devices: no activation spans the
global token count.
"""

import re
from dataclasses import replace

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding

from moejax.config import ParallelConfig
from moejax.parallel.backends import attention_kernel, layer_weights, moe_backend
from moejax.parallel.mesh import BATCH_SPEC, REPLICATED, make_mesh
from moejax.presets import TINY
from moejax.train.optimizer import make_optimizer
from moejax.train.state import init_state
from moejax.train.step import make_train_step
from tests.helpers import loop_steps, toy_batch, toy_model

BATCH, SEQ = 24, 40  # 960 tokens, 120 per device: sizes no other dimension of the toy model has


def _global_token_arrays(cfg, mesh, weights) -> int:
    """Activations in the compiled per-device train step that span the global batch or token count: float
    arrays [global tokens (or batch, seq), ..., width] with a model width last (d_model 32, or 16: latent,
    expert and shared widths). (QB's global quantiles legitimately gather [tokens, k+1] ids and margins.)"""
    optimizer, lr_fns = make_optimizer(cfg)
    state = init_state(cfg, optimizer, jax.random.key(0), mesh)
    batch = jax.device_put(toy_batch(cfg.model, batch=BATCH, seq=SEQ), NamedSharding(mesh, BATCH_SPEC))
    step = make_train_step(cfg.model, optimizer, lr_fns, moe_backend(cfg.parallel, mesh), remat=True,
                           scan_layers=True, attention_kernel=attention_kernel(mesh), layer_weights=weights)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    text = jax.jit(step, in_shardings=(state_sh, batch["tokens"].sharding),
                   out_shardings=(state_sh, NamedSharding(mesh, REPLICATED))).lower(state, batch).compile().as_text()
    return _count_global_token_arrays(text, cfg.model)


def _count_global_token_arrays(compiled_text: str, model) -> int:
    widths = f"{model.d_model}|{model.latent_width}"
    return len(re.findall(rf"(?:f32|bf16)\[(?:{BATCH},{SEQ}|{BATCH * SEQ})(?:,\d+)*,(?:{widths})\]", compiled_text))


@pytest.mark.parametrize("axes", [dict(expert=8), dict(data=8)], ids=["ep_expert8", "local_data8"])
def test_every_layer_computes_on_the_devices_own_tokens(axes):
    model = toy_model(n_layers=2, window=12)
    cfg = replace(TINY, model=model, parallel=ParallelConfig(**axes),
                  train=replace(TINY.train, batch_size=BATCH, seq_len=SEQ, optimizer="adam"))
    mesh = make_mesh(cfg.parallel)
    weights = layer_weights(mesh)
    assert weights is not None  # FSDP over 8 devices
    assert _global_token_arrays(cfg, mesh, weights) == 0
    if axes == dict(expert=8):  # without the gather, GSPMD moves the tokens (the check sees it)
        assert _global_token_arrays(cfg, mesh, None) > 0


def test_the_loops_eval_step_computes_on_the_devices_own_tokens():
    """The loop's eval step keeps the tokens on their devices too. (Without `layer_weights` GSPMD still gathers
    the weights for a forward alone, here with 62 all-gathers instead of 44; only the train step's backward
    turned the clash around, so this holds either way and guards the eval step's layout, not the gather.)"""
    model = toy_model(n_layers=2, window=12)
    _, state, batch, _, eval_fns = loop_steps(model, ParallelConfig(expert=8), BATCH, SEQ)
    bpt = jnp.ones((model.vocab_size,), jnp.int32)
    text = eval_fns["eval/"].lower(state.compute, batch, bpt).compile().as_text()
    assert _count_global_token_arrays(text, model) == 0


def test_gather_from_two_fsdp_shards_up_and_none_without_fsdp():
    assert layer_weights(make_mesh(ParallelConfig(data=1))) is None
    for axes in (dict(data=2), dict(expert=2)):  # the smallest FSDP meshes gather too
        assert layer_weights(make_mesh(ParallelConfig(**axes))) is not None, axes
