"""The device mesh with the fixed axes (replica_dcn, data, expert, model) and the sharding rules.

All PartitionSpecs live here (STYLE rule 3):
- tokens / batch: dim 0 over (replica_dcn, data, expert);
- routed expert weights [L, E, ., .]: E over `expert`, replicated over replica_dcn and data;
- every other matrix: FSDP over (data, expert) on its largest divisible non-layer dim, replicated over
  replica_dcn (racks hold full replicas; only gradients cross the data-centre network);
- scalars, router bias, QB bias, counters: replicated.
Axes are `Auto` so jit propagates shardings through single-device model math (STYLE rule 2); the one
manual region is the transport's `shard_map`.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax.config import BATCH_AXES, MESH_AXES, ConfigError, ParallelConfig

BATCH_SPEC = P(BATCH_AXES)
REPLICATED = P()
FSDP_AXES = ("data", "expert")
ROUTED_EXPERT_FIELDS = ("w_gate", "w_up", "w_down")


def make_mesh(p: ParallelConfig, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    if p.n_devices > len(devices):
        raise ConfigError(f"mesh {dict(zip(MESH_AXES, p.mesh_shape))} needs {p.n_devices} devices, "
                          f"but only {len(devices)} are present")
    grid = np.asarray(devices[: p.n_devices]).reshape(p.mesh_shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def param_spec(path, shape: tuple[int, ...], mesh: Mesh) -> P:
    name = path[-1].name if hasattr(path[-1], "name") else str(path[-1])
    in_blocks = any(getattr(k, "name", None) == "blocks" for k in path)
    if name in ROUTED_EXPERT_FIELDS:
        return P(None, "expert") if in_blocks else P("expert")
    fsdp = math.prod(mesh.shape[a] for a in FSDP_AXES)
    first = 1 if in_blocks else 0  # never shard the scanned layer axis
    if fsdp == 1 or len(shape) - first < 2:  # vectors (gains, biases) stay replicated
        return REPLICATED
    dims = sorted(range(first, len(shape)), key=lambda i: -shape[i])
    for i in dims:
        if shape[i] % fsdp == 0 and shape[i] >= fsdp:
            spec = [None] * len(shape)
            spec[i] = FSDP_AXES
            return P(*spec)
    return REPLICATED


def param_shardings(params, mesh: Mesh):
    return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, param_spec(path, x.shape, mesh)),
                                            params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, BATCH_SPEC)


def mirror_shardings(tree, params, params_sharding, mesh: Mesh):
    """Shardings for a pytree that mirrors parameters (optimizer moments): each leaf takes the sharding of
    the parameter whose path is the longest suffix of its own path with the same shape; anything else
    (counts, scalars) is replicated."""
    by_path = {jax.tree_util.keystr(path): (x.shape, sh) for (path, x), sh in
               zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(params_sharding))}

    def pick(path, x):
        key = jax.tree_util.keystr(path)
        best = max((p for p in by_path if key.endswith(p) and by_path[p][0] == x.shape), key=len, default=None)
        return by_path[best][1] if best else NamedSharding(mesh, REPLICATED)

    return jax.tree_util.tree_map_with_path(pick, tree)


def under_gspmd(fn, like: jax.Array, *args, out_spec: P | None = None):
    """fn(*args) with GSPMD choosing every intermediate sharding, also on Explicit mesh axes (where a
    scatter from sharded indices or a product of differently sharded arrays fails at trace time).
    The output is sharded like `like`, or by `out_spec`. With no Explicit axes it is just fn(*args)."""
    mesh = jax.sharding.get_abstract_mesh()
    sharding = getattr(jax.typeof(like), "sharding", None)
    if mesh.empty:  # no mesh context: take the mesh the (explicitly typed) array carries, if any
        mesh = getattr(sharding, "mesh", mesh)
    explicit = tuple(name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit)
    if not explicit:
        return fn(*args)
    with jax.sharding.use_abstract_mesh(mesh):
        return jax.sharding.auto_axes(fn, axes=explicit, out_sharding=out_spec if out_spec is not None
                                      else sharding.spec)(*args)
