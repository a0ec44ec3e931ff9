"""Where parallelism enters the model: the routed-expert backends and the attention kernel, bound to a mesh.

Every backend has the `RoutedFn` signature of `moejax.model.moe.layer` and returns (y_TZ fp32, DropStats):
- "local": the dropless path (grouped GEMMs over rows sorted by expert); on a mesh with several batch
  shards, each shard routes its own tokens (`routed_local_data_parallel`);
- "ep": the pooled-wave fixed all-to-all transport over the `expert` mesh axis (SPEC §3).
`parallel.moe_backend="auto"` picks "ep" when the expert axis is larger than 1, else "local".
A new backend is one entry in BACKENDS.
`attention_kernel(mesh)`: the flash kernel (used when `MOEJAX_ATTENTION` resolves to gpu_kernel) on each
batch shard's own rows under shard_map; a Pallas kernel is a custom call that GSPMD cannot partition.
`layer_weights(mesh)`: a layer's weights at use, FSDP's all-gather made explicit.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable

import jax
from jax.sharding import Mesh, NamedSharding

from moejax.config import ConfigError, ParallelConfig
from moejax.model import kernel_choice
from moejax.model.attention import KernelFn, flash_kernel
from moejax.model.kernel_choice import ATTENTION, GROUPED, kernel_impl
from moejax.model.moe.layer import DropStats, RoutedFn, routed_local_with_stats
from moejax.model.transformer import WeightsFn
from moejax.parallel.expert_parallel import routed_expert_parallel
from moejax.parallel.mesh import BATCH_AXES, BATCH_SPEC, FSDP_AXES, REPLICATED, ROUTED_EXPERT_FIELDS, batch_shards


def routed_local_data_parallel(z_TZ, expert_TK, weight_TK, mask_T, w_gate_EZF, w_up_EZF, w_down_EFZ, *,
                               mesh: Mesh) -> tuple[jax.Array, DropStats]:
    """The dropless local path on each batch shard's own tokens (shard_map over BATCH_AXES), every shard
    with all experts' weights (gathered from their FSDP / expert shards first, as for any FSDP layer);
    global DropStats. Left to GSPMD, the layout's argsort over the sharded tokens makes every device gather
    every token and run all of the grouped GEMMs (measured: the tiny preset on data=8 ran the full 47-block
    GEMMs on each of the 8 devices)."""

    check = kernel_choice.vma_checked(GROUPED)

    def body(z_TZ, expert_TK, weight_TK, mask_T, *w):
        # Weights varying over the batch axes: each shard's weight gradient is its own (the grouped GEMM's
        # custom VJP returns it so), and the transpose of this cast sums them over the shards (unchecked,
        # shard_map's own transpose does).
        if check:
            w = [jax.lax.pcast(a, BATCH_AXES, to="varying") for a in w]
        y_TZ, drops = routed_local_with_stats(z_TZ, expert_TK, weight_TK, mask_T, *w)
        return y_TZ, DropStats(*(jax.lax.psum(c, BATCH_AXES) for c in drops))

    tok = BATCH_SPEC
    fn = jax.shard_map(body, mesh=mesh, in_specs=(tok, tok, tok, tok, REPLICATED, REPLICATED, REPLICATED),
                       out_specs=(tok, REPLICATED), check_vma=check)
    return fn(z_TZ, expert_TK, weight_TK, mask_T, w_gate_EZF, w_up_EZF, w_down_EFZ)


def local_backend(mesh: Mesh) -> RoutedFn:
    """The dropless local path for `mesh`: per batch shard when there are several."""
    if batch_shards(mesh) == 1:
        return routed_local_with_stats
    return partial(routed_local_data_parallel, mesh=mesh)


def flash_per_batch_shard(q, k, v, segment_ids, scale: float, window: int | None, *, mesh: Mesh):
    """`flash_kernel` on each batch shard's rows (q/k/v/segment_ids sharded on the batch dim over
    BATCH_AXES; attention never mixes rows, and nothing here is a weight, so no collective either way)."""
    body = lambda q, k, v, s: flash_kernel(q, k, v, s, scale, window)
    return jax.shard_map(body, mesh=mesh, in_specs=(BATCH_SPEC,) * 4, out_specs=BATCH_SPEC,
                         check_vma=kernel_choice.vma_checked(ATTENTION))(q, k, v, segment_ids)


def attention_kernel(mesh: Mesh) -> KernelFn:
    """The attention kernel for `mesh`: per batch shard when there are several (replicated over `model`,
    which shards nothing; a custom call left to GSPMD would run replicated over all devices)."""
    if batch_shards(mesh) == 1:
        return flash_kernel
    return partial(flash_per_batch_shard, mesh=mesh)


def layer_weights(mesh: Mesh) -> WeightsFn | None:
    """One layer's weights as it uses them on `mesh`: every FSDP-sharded matrix all-gathered (inside the layer
    loop, so one layer's at a time), the routed experts left on `expert` for the transport. Left to itself,
    GSPMD resolved the clash of batch-sharded tokens and FSDP-sharded weights (both over `expert`) by
    moving the tokens instead: at the hero's mesh every dense layer ran on the whole rack's tokens, 64 x the
    device's own, and XLA's GPU memory plan came to 1.58 TB per device (docs/LOG.md 2026-12-01, fourth
    session). None when nothing is FSDP-sharded."""
    if math.prod(mesh.shape[a] for a in FSDP_AXES) == 1:
        return None
    gathered = NamedSharding(mesh, REPLICATED)

    def at_use(path, w):
        name = getattr(path[-1], "name", str(path[-1]))
        return w if name in ROUTED_EXPERT_FIELDS else jax.lax.with_sharding_constraint(w, gathered)

    return lambda blk: jax.tree_util.tree_map_with_path(at_use, blk)


BACKENDS: dict[str, Callable[[ParallelConfig, Mesh], RoutedFn]] = {
    "local": lambda p, mesh: local_backend(mesh),
    "ep": lambda p, mesh: partial(routed_expert_parallel, mesh=mesh, waves=p.waves, cf_send=p.cf_send,
                                  cf_recv=p.cf_recv),
}


def moe_backend(p: ParallelConfig, mesh: Mesh) -> RoutedFn:
    """The routed-expert implementation the run's parallel config asks for, bound to `mesh`."""
    name = p.resolved_backend
    if name not in BACKENDS:
        raise ConfigError(f"parallel.moe_backend ({p.moe_backend!r}) must be 'auto' or one of {', '.join(BACKENDS)}")
    return BACKENDS[name](p, mesh)
