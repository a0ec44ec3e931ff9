"""The mesh vocabulary: axis names, the PartitionSpecs, and how meshes are made (STYLE rule 3).

Axes are fixed: (replica_dcn, data, expert, model). All PartitionSpecs of the package are named here:
- BATCH_SPEC: tokens / batch dim 0 over (replica_dcn, data, expert);
- EXPERTS_SPEC: routed expert weights [E, ., .] over `expert` (stacked [L, E, ., .] in `param_spec`),
  replicated over replica_dcn and data;
- every other matrix: FSDP over (data, expert) on its largest divisible non-layer dim, replicated over
  replica_dcn (racks hold full replicas; only gradients cross the data-centre network);
- REPLICATED: scalars, router bias, counters.
One axis type: every mesh (concrete or abstract) has `Auto` axes, so jit propagates shardings through the
single-device model math (STYLE rule 2) and GSPMD partitions global ops such as the QB histogram and the
per-matrix optimizer norms; the one manual region is the transport's `shard_map`.
"""

from __future__ import annotations

import math
from dataclasses import replace

import jax
import numpy as np
from jax.sharding import AbstractDevice, AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from moejax.config import ConfigError, ParallelConfig

MESH_AXES = ("replica_dcn", "data", "expert", "model")
BATCH_AXES = ("replica_dcn", "data", "expert")  # the batch (and so the tokens) is split over these
EXPERT_AXIS = "expert"
FSDP_AXES = ("data", "expert")

BATCH_SPEC = PartitionSpec(BATCH_AXES)
EXPERTS_SPEC = PartitionSpec(EXPERT_AXIS)
REPLICATED = PartitionSpec()
ROUTED_EXPERT_FIELDS = ("w_gate", "w_up", "w_down")
_AXIS_TYPES = (AxisType.Auto,) * len(MESH_AXES)


def parse_mesh(text: str) -> dict[str, int]:
    """`replica_dcn=1,data=2,expert=4,model=1` -> dict; omitted axes are 1."""
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in MESH_AXES or not (value.isascii() and value.isdigit()) or int(value) < 1:
            raise ConfigError(f"--mesh item {item!r} is not AXIS=N with AXIS one of {', '.join(MESH_AXES)} and N >= 1")
        if name in out:
            raise ConfigError(f"--mesh {text!r} gives {name} twice ({out[name]} and {value})")
        out[name] = int(value)
    if not out:  # `--mesh "$MESH"` with MESH unset: say so, rather than train on the default layout
        raise ConfigError(f"--mesh {text!r} names no axis: give AXIS=N items ({', '.join(MESH_AXES)}), or leave "
                          "--mesh out for the default layout")
    return out


def default_data_parallel(cfg, n_devices: int):
    """A run laid out on one device, given no --mesh: every one of `n_devices` as data parallel (data=N), rather
    than one GPU of eight. Presets with their own mesh (ladder rungs, hero) keep it. `train` (the job's devices)
    and `plan` (the cluster's) both lay a run out this way."""
    if cfg.parallel.n_devices != 1 or n_devices == 1:
        return cfg
    if cfg.train.batch_size % n_devices:
        raise ConfigError(f"no --mesh: the default trains data-parallel on all {n_devices} devices, but "
                          f"train.batch_size ({cfg.train.batch_size}) is not divisible by {n_devices}; pass --mesh "
                          f"data=K (K divides it) or a batch size divisible by {n_devices}")
    return replace(cfg, parallel=replace(cfg.parallel, data=n_devices))


def mesh_overrides(mesh: str | None) -> list[str]:
    """`--mesh data=2,expert=4` as `parallel.*` overrides (omitted axes = 1), applied with the `--set` ones
    in one step, so the layout is validated once, with the final mesh (e.g. context-parallel degrees)."""
    if mesh is None:
        return []
    axes = {**{name: 1 for name in MESH_AXES}, **parse_mesh(mesh)}
    return [f"parallel.{k}={v}" for k, v in axes.items()]


def make_mesh(p: ParallelConfig, devices=None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    if p.n_devices > len(devices):
        raise ConfigError(f"mesh {dict(zip(MESH_AXES, p.mesh_shape))} needs {p.n_devices} devices, "
                          f"but only {len(devices)} are present")
    grid = np.asarray(devices[: p.n_devices]).reshape(p.mesh_shape)
    return Mesh(grid, MESH_AXES, axis_types=_AXIS_TYPES)


def abstract_mesh(p: ParallelConfig, device: AbstractDevice | None = None) -> AbstractMesh:
    """The mesh of `p` without devices: for lowering layouts larger than this machine (the 704-device hero).
    `device`: the accelerator it stands for (kernel lowerings read its kind, e.g. Triton's target GPU)."""
    return AbstractMesh(p.mesh_shape, MESH_AXES, axis_types=_AXIS_TYPES, abstract_device=device)


def param_spec(path, shape: tuple[int, ...], mesh: Mesh) -> P:
    name = path[-1].name if hasattr(path[-1], "name") else str(path[-1])
    in_blocks = any(getattr(k, "name", None) == "blocks" for k in path)
    if name in ROUTED_EXPERT_FIELDS:
        return PartitionSpec(None, EXPERT_AXIS) if in_blocks else EXPERTS_SPEC
    fsdp = math.prod(mesh.shape[a] for a in FSDP_AXES)
    first = 1 if in_blocks else 0  # never shard the scanned layer axis
    if fsdp == 1 or len(shape) - first < 2:  # vectors (gains, biases) stay replicated
        return REPLICATED
    dims = sorted(range(first, len(shape)), key=lambda i: -shape[i])
    for i in dims:
        if shape[i] % fsdp == 0 and shape[i] >= fsdp:
            spec = [None] * len(shape)
            spec[i] = FSDP_AXES
            return PartitionSpec(*spec)
    return REPLICATED


def param_shardings(params, mesh: Mesh):
    return jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, param_spec(path, x.shape, mesh)),
                                            params)


def batch_sharding(mesh) -> NamedSharding:
    return NamedSharding(mesh, BATCH_SPEC)


def batch_shards(mesh: Mesh) -> int:
    """How many pieces the batch (and so the tokens) is split into on `mesh`."""
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


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
