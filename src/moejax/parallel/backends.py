"""The routed-expert backends, chosen in one place.

Every backend has the `RoutedFn` signature of `moejax.model.moe.layer` and returns (y_TZ fp32, DropStats):
- "local": the dropless single-device path (grouped GEMMs over rows sorted by expert);
- "ep": the pooled-wave fixed all-to-all transport over the `expert` mesh axis (SPEC §3).
`parallel.moe_backend="auto"` picks "ep" when the expert axis is larger than 1, else "local".
A new backend is one entry in BACKENDS.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from jax.sharding import Mesh

from moejax.config import ConfigError, ParallelConfig
from moejax.model.moe.layer import RoutedFn, routed_local_with_stats
from moejax.parallel.expert_parallel import routed_expert_parallel

BACKENDS: dict[str, Callable[[ParallelConfig, Mesh], RoutedFn]] = {
    "local": lambda p, mesh: routed_local_with_stats,
    "ep": lambda p, mesh: partial(routed_expert_parallel, mesh=mesh, waves=p.waves, cf_send=p.cf_send,
                                  cf_recv=p.cf_recv),
}


def moe_backend(p: ParallelConfig, mesh: Mesh) -> RoutedFn:
    """The routed-expert implementation the run's parallel config asks for, bound to `mesh`."""
    name = p.resolved_backend
    if name not in BACKENDS:
        raise ConfigError(f"parallel.moe_backend ({p.moe_backend!r}) must be 'auto' or one of {', '.join(BACKENDS)}")
    return BACKENDS[name](p, mesh)
