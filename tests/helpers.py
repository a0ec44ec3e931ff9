"""Small shared fixtures for tests: a toy config exercising every hero feature, and random batches."""

import importlib
import os
import sys
from dataclasses import replace
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from moejax.xla_flags import without_forced_host_devices
from moejax.presets import HERO_MODEL


def toy_model(**kw):
    base = dict(vocab_size=64, d_model=32, n_layers=4, n_heads=4, head_dim=8, n_kv_heads=2, n_kv_heads_global=1,
                window=6, rope_dim=4, gated_norm_rank=4, n_experts=8, top_k=2, expert_width=16, latent_width=16,
                n_shared=2, shared_width=16, compute_dtype="float32")
    base.update(kw)
    return replace(HERO_MODEL, **base)


def toy_batch(cfg, batch=2, seq=16, seed=0, doc_lens=((5, 11), (16,))):
    """Packed rows: doc_lens[b] lists document lengths of row b (0-padding after them if short)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    seg = np.zeros((batch, seq + 1), np.int32)
    pos = np.zeros((batch, seq + 1), np.int32)
    for b in range(batch):
        lens = doc_lens[b % len(doc_lens)]
        start = 0
        for i, n in enumerate(lens):
            seg[b, start:start + n] = i + 1
            pos[b, start:start + n] = np.arange(n)
            start += n
        if start <= seq:  # the extra target position continues the last document
            seg[b, start:] = seg[b, start - 1] if start == seq else 0
    return {"tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
            "segment_ids": jnp.asarray(seg[:, :-1]), "positions": jnp.asarray(pos[:, :-1]),
            "loss_mask": jnp.asarray((seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0))}


def all_eqns(jaxpr) -> list:
    """Every equation of a jaxpr, those of its sub-jaxprs (scans, conds, custom VJPs, remat, shard_map) too."""
    out = []
    for e in jaxpr.eqns:
        out.append(e)
        for sub in jax.extend.core.jaxprs_in_params(e.params):
            out += all_eqns(sub)
    return out


def rand_tree_like(tree, key, scale=0.1):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(treedef, [scale * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves)])


def subprocess_xla_flags() -> str:
    """conftest's XLA_FLAGS without the forced device count (a CLI subprocess forces as many host devices as
    its --mesh needs): the rest (-O0) keeps the subprocesses' compiles as fast as the in-process ones."""
    return without_forced_host_devices(os.environ.get("XLA_FLAGS", ""))


def loop_steps(model, parallel, batch_size: int, seq_len: int):
    """The train loop's own jitted steps (`loop.step_functions`, remat off, unrolled, Adam) for `model` on the
    mesh of `parallel`: (cfg, state, a batch placed on the mesh, phase -> train step, {prefix: eval step})."""
    from jax.sharding import NamedSharding

    from moejax.parallel.mesh import BATCH_SPEC, make_mesh
    from moejax.presets import TINY
    from moejax.train.loop import step_functions
    from moejax.train.optimizer import make_optimizer
    from moejax.train.state import init_state

    cfg = replace(TINY, model=model, parallel=parallel,
                  train=replace(TINY.train, batch_size=batch_size, seq_len=seq_len, remat=False, scan_layers=False,
                                optimizer="adam"))
    mesh = make_mesh(cfg.parallel)
    optimizer, lr_fns = make_optimizer(cfg)
    state = init_state(cfg, optimizer, jax.random.key(0), mesh)
    batch = jax.device_put(toy_batch(model, batch=batch_size, seq=seq_len), NamedSharding(mesh, BATCH_SPEC))
    step_fn, eval_fns = step_functions(cfg, mesh, optimizer, lr_fns, jax.tree.map(lambda x: x.sharding, state),
                                       None, remat=False)
    return cfg, state, batch, step_fn, eval_fns


def bench_module(name: str):
    """A script of bench/ (not a package) imported as a module, with bench/ on sys.path while it imports, as
    `python bench/<name>.py` has it, so that its imports of sibling scripts resolve."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)
