"""The train state: one frozen pytree that round-trips through checkpoints unchanged.

`params` are the fp32 master weights (with the optimizer state, in host memory when
`opt_state_memory=pinned_host`); `compute` is their copy in the model's compute dtype, always in device
memory, which the forward and backward read (SPEC §4: the device holds the bf16 compute copy).
`qb_bias` is the quantile-balancing router bias computed from this step's routing, applied at the start
of the next step (SPEC §2); `rng` is raw uint32 key data so the state is plain arrays.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from moejax.model.layers import pytree_dataclass
from moejax.model.transformer import Transformer


@pytree_dataclass
class TrainState:
    step: jax.Array  # int32 scalar
    params: Transformer  # fp32 master weights
    compute: Transformer  # the master in compute dtype, on device
    opt_state: Any
    qb_bias: jax.Array  # [L, E] pending router bias
    rng: jax.Array  # uint32 key data


def compute_copy(params: Transformer, dtype) -> Transformer:
    return jax.tree.map(lambda p: p.astype(dtype), params)


def init_state(cfg, optimizer, key, mesh=None) -> TrainState:
    """Fresh state; with a mesh, parameters are created sharded (never materialised whole on one device)
    and the optimizer state inherits their shardings."""
    from jax.sharding import NamedSharding, PartitionSpec

    from moejax.parallel.mesh import mirror_shardings, param_shardings

    dtype = jnp.dtype(cfg.model.compute_dtype)
    if mesh is None:
        params = Transformer.init(cfg.model, key)
        opt_state = optimizer.init(params)
        compute = compute_copy(params, dtype)
        put = lambda x: x
    else:
        abstract = jax.eval_shape(lambda k: Transformer.init(cfg.model, k), key)
        params_sh = param_shardings(abstract, mesh)
        params = jax.jit(lambda k: Transformer.init(cfg.model, k), out_shardings=params_sh)(key)
        opt_sh = mirror_shardings(jax.eval_shape(optimizer.init, abstract), abstract, params_sh, mesh)
        opt_state = jax.jit(optimizer.init, out_shardings=opt_sh)(params)
        compute = jax.jit(lambda p: compute_copy(p, dtype), out_shardings=params_sh)(params)
        put = lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec()))
    return TrainState(step=put(jnp.zeros((), jnp.int32)), params=params, compute=compute, opt_state=opt_state,
                      qb_bias=put(jnp.zeros((cfg.model.n_layers, cfg.model.n_experts), jnp.float32)),
                      rng=put(jax.random.key_data(jax.random.fold_in(key, 1))))
