"""The train state: one frozen pytree that round-trips through checkpoints unchanged, and where it lives.

`params` are the fp32 master weights (with the optimizer state, in host memory when
`opt_state_memory=pinned_host`); `compute` is their copy in the model's compute dtype, always in device
memory, which the forward and backward read (SPEC §4: the device holds the bf16 compute copy).
The QB router bias is a model leaf (`params.blocks.moe.router_bias`) with one owner: the train step
writes next step's bias into it (SPEC §2); the optimizer never touches it, and the compute copy keeps it
in fp32 so training and eval route with the same bias. `rng` is raw uint32 key data so the state is
plain arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from moejax.config import ModelConfig
from moejax.model.layers import pytree_dataclass
from moejax.model.transformer import Transformer
from moejax.parallel.mesh import REPLICATED, ROUTED_EXPERT_FIELDS, mirror_shardings, param_shardings
from moejax.train import reuse
from moejax.xla_flags import init_compiler_options

FP32_LEAVES = frozenset({"router_bias"})  # kept in fp32 in the compute copy: routing decisions are fp32
# The routed experts' matrices: the model reads them only as `w.astype(compute dtype)`, once per layer,
# through the grouped GEMM or the transport, whose weight gradients come back in the weight's dtype; their
# cross-device sums (the EP shard_map's, the local backend's) were in that dtype already. Differentiated
# through an fp32 upcast, their gradient is that compute-dtype value upcast. So the train step
# differentiates them in the compute copy as they are and upcasts the gradient (the same values), and the
# fp32 copy of the expert stacks, 32.6 GB per device in the hero's forward (XLA's GPU plan, docs/LOG.md
# 2026-12-01, fifth session), is never made. Every other leaf is upcast as before: the FSDP-gathered
# matrices so that their gradients are reduce-scattered in fp32 (in bf16 beside fp32 ones, XLA's GPU
# reduce-scatter combiner made a mixed-precision op its verifier refused), the fp32-computed ones (norms,
# router, embedding, LM head, SConv) so that their gradients are accumulated in fp32.
CAST_AT_USE_LEAVES = frozenset(ROUTED_EXPERT_FIELDS)


@pytree_dataclass
class TrainState:
    step: jax.Array  # int32 scalar
    params: Transformer  # fp32 master weights
    compute: Transformer  # the master in compute dtype (router bias fp32), on device
    opt_state: Any
    rng: jax.Array  # uint32 key data


def compute_copy(params: Transformer, dtype) -> Transformer:
    """A new array per leaf, also where the dtype does not change (fp32 compute, the router bias): the
    state is donated to the step, and one buffer may not be donated twice."""
    def cast(path, p):
        to = jnp.float32 if getattr(path[-1], "name", None) in FP32_LEAVES else dtype
        return jnp.array(p, dtype=to, copy=True)

    return jax.tree_util.tree_map_with_path(cast, params)


def differentiated_copy(compute: Transformer) -> Transformer:
    """What the train step differentiates: the compute copy with every leaf upcast to fp32 but the
    CAST_AT_USE_LEAVES, whose gradients the step upcasts after the backward."""
    def leaf(path, c):
        return c if getattr(path[-1], "name", None) in CAST_AT_USE_LEAVES else c.astype(jnp.float32)

    return jax.tree_util.tree_map_with_path(leaf, compute)


def initializer(model: ModelConfig):
    """key -> fresh parameters: one function object per model config, since jax keeps a function's trace and
    executable. The next run of the config in this process initialises without tracing or compiling again
    (`train.reuse`), and the run's parameter count (`run_dir.run_info`) shares the run's trace."""
    return reuse.reused(("init", model), lambda: functools.partial(Transformer.init, model))


def init_state(cfg, optimizer, key, mesh=None) -> TrainState:
    """Fresh state; with a mesh, parameters are created sharded (never materialised whole on one device)
    and the optimizer state inherits their shardings."""
    dtype = jnp.dtype(cfg.model.compute_dtype)
    init = initializer(cfg.model)
    if mesh is None:
        params = init(key)
        opt_state = optimizer.init(params)
        compute = compute_copy(params, dtype)
        put = lambda x: x
    else:
        abstract = jax.eval_shape(init, key)
        params_sh = param_shardings(abstract, mesh)
        options = init_compiler_options(mesh.devices.flat[0].platform)  # -O1 on CPU: the same bits, sooner
        params = jax.jit(init, out_shardings=params_sh, compiler_options=options)(key)
        opt_state = init_opt_state(optimizer, params, mesh)
        cast = reuse.reused(("cast", dtype), lambda: functools.partial(compute_copy, dtype=dtype))
        compute = jax.jit(cast, out_shardings=params_sh)(params)
        put = lambda x: jax.device_put(x, NamedSharding(mesh, REPLICATED))
    return TrainState(step=put(jnp.zeros((), jnp.int32)), params=params, compute=compute, opt_state=opt_state,
                      rng=put(jax.random.key_data(jax.random.fold_in(key, 1))))


def init_opt_state(optimizer, params, mesh=None):
    """The optimizer's fresh state for these (placed) parameters; on a mesh each leaf mirrors its parameter's
    sharding and the rest is replicated (optax alone would put its step counts on one device)."""
    if mesh is None:
        return optimizer.init(params)
    abstract = jax.eval_shape(lambda p: p, params)
    params_sh = jax.tree.map(lambda x: x.sharding, params)
    opt_sh = mirror_shardings(jax.eval_shape(optimizer.init, abstract), abstract, params_sh, mesh)
    return jax.jit(optimizer.init, out_shardings=opt_sh)(params)


@pytree_dataclass  # a pytree of shardings, so that a step's key (`train.reuse`) can hold it
class Offload:
    """Where the fp32 master weights and optimizer state live between steps (SPEC §4 pinned host).

    Each field is a sharding pytree; `host` ones carry memory_kind="pinned_host". Inside the jitted step
    they are moved to device memory for the update only (the forward/backward read the compute copy),
    then back to host.
    """

    params_device: object
    opt_device: object
    params_host: object
    opt_host: object


def place_state(state: TrainState, memory: str) -> tuple[TrainState, Offload | None]:
    """Keep fp32 master weights + optimizer state in `pinned_host` memory when asked (SPEC §4)."""
    if memory == "device":
        return state, None
    dev = lambda tree: jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), tree)
    host = lambda tree: jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), tree)
    offload = Offload(params_device=dev(state.params), opt_device=dev(state.opt_state),
                      params_host=host(state.params), opt_host=host(state.opt_state))
    state = dataclasses.replace(state, params=jax.device_put(state.params, offload.params_host),
                                opt_state=jax.device_put(state.opt_state, offload.opt_host))
    return state, offload
