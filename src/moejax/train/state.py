"""The train state: one frozen pytree that round-trips through checkpoints unchanged.

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
    opt_state: Any
    qb_bias: jax.Array  # [L, E] pending router bias
    rng: jax.Array  # uint32 key data


def init_state(cfg, optimizer, key) -> TrainState:
    params = Transformer.init(cfg.model, key)
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params),
                      qb_bias=jnp.zeros((cfg.model.n_layers, cfg.model.n_experts), jnp.float32),
                      rng=jax.random.key_data(jax.random.fold_in(key, 1)))
