"""Token drops of the pooled-wave transport at fixed weights: the drops-vs-context curve (SPEC §5, §6).

The seed names token dropping as the main long-context constraint (~7% at 4K rising to ~40% at 65K before
pooled waves) and SPEC §6 says capacity tuned at 4K does not transfer: at fixed tokens per step a longer
context means fewer sequences, so fewer distinct documents per shard, and tokens of one document route
alike. This module measures that with trained weights: one forward pass (no update) of a packed batch
through the EP transport at a given capacity factor, reading the DropStats the transport already reports.
`bench/bench_drops_context.py` sweeps context lengths x capacity factors with it.

Dimensions as in the package legend: L layers, E experts, B sequences, S positions.

Notable choices:
- The forward is the eval step's (`model_loss`, no remat) on whatever weights it is given (the bench
  passes the fp32 upcast of the compute copy, as the train step's forward reads it); counts are the
  transport's own psum'd DropStats, summed over layers, so fractions equal `moe/drop_fraction` and its
  sender / receiver split as training logs them (tests/test_drop_curve.py ties the two).
- Each call also returns the QB bias this batch implies (the training step's `qb_hook`), so a caller can
  let QB re-settle at a new context with the weights frozen: training writes the bias of step i into
  step i + 1, which is what `with_router_bias(params, previous["qb_bias"])` reproduces.
- Documents per shard are counted from the segment ids the loader packs: distinct (row, segment) pairs
  in the rows each batch shard holds (rows are split contiguously over the batch axes); a document cut
  by a window boundary counts in every row it reaches.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from moejax.config import ModelConfig
from moejax.model.transformer import Transformer, model_loss
from moejax.parallel.backends import attention_kernel
from moejax.parallel.expert_parallel import routed_expert_parallel
from moejax.parallel.mesh import REPLICATED, batch_sharding
from moejax.train.step import qb_hook, with_router_bias

MODEL_INPUTS = ("tokens", "targets", "segment_ids", "positions", "loss_mask")


@dataclass(frozen=True)
class DropCounts:
    """Assignment counts of one forward pass, per layer (int lists of length L), and its loss."""

    valid: tuple[int, ...]
    kept: tuple[int, ...]
    sender_dropped: tuple[int, ...]
    receiver_dropped: tuple[int, ...]
    cross_entropy: float

    def __post_init__(self):
        for i, (v, k, s, r) in enumerate(zip(self.valid, self.kept, self.sender_dropped, self.receiver_dropped)):
            if k + s + r != v:  # SPEC §3.7: exact, or the transport's accounting is broken
                raise ValueError(f"layer {i}: kept ({k}) + sender ({s}) + receiver ({r}) dropped != valid ({v})")

    def fraction(self, which: str) -> float:
        """'sender', 'receiver' or 'total' dropped over valid assignments, all layers pooled."""
        n = {"sender": sum(self.sender_dropped), "receiver": sum(self.receiver_dropped),
             "total": sum(self.sender_dropped) + sum(self.receiver_dropped)}[which]
        return n / max(sum(self.valid), 1)

    def layer_fractions(self) -> list[float]:
        return [(s + r) / max(v, 1) for v, s, r in zip(self.valid, self.sender_dropped, self.receiver_dropped)]


def documents_per_shard(segment_ids: np.ndarray, n_shards: int) -> np.ndarray:
    """[n_shards] distinct (row, document) pairs among the rows each batch shard holds (segment 0 = padding)."""
    seg = np.asarray(segment_ids)
    if seg.shape[0] % n_shards:
        raise ValueError(f"rows ({seg.shape[0]}) are not divisible by the batch shards ({n_shards})")
    per_row = np.array([len(np.unique(r[r > 0])) for r in seg])
    return per_row.reshape(n_shards, -1).sum(axis=1)


def make_drop_measure(cfg: ModelConfig, mesh: Mesh, *, cf_send: float, cf_recv: float, waves: int = 3):
    """jit of (params, batch) -> (per-layer DropStats counts, CE, next QB bias [L, E]) on the EP transport.

    `params`: model weights (e.g. `weights.load_run`'s compute copy, or its fp32 upcast); `batch`: the
    loader's numpy dict.
    """
    routed = partial(routed_expert_parallel, mesh=mesh, waves=waves, cf_send=cf_send, cf_recv=cf_recv)
    hook, kernel = qb_hook(cfg), attention_kernel(mesh)

    def measure(params: Transformer, batch: dict):
        _, aux = model_loss(params, batch, cfg, routed, hook, remat=False, attention_kernel=kernel)
        layers = aux["layers"]
        counts = {k: layers[k] for k in ("valid", "kept", "sender_dropped", "receiver_dropped")}
        return counts, aux["cross_entropy_loss"], layers["qb_bias"]

    in_sh = (NamedSharding(mesh, REPLICATED), batch_sharding(mesh))
    return jax.jit(measure, in_shardings=in_sh)


def measure_drops(fn, params: Transformer, batch: dict[str, np.ndarray]) -> tuple[DropCounts, jax.Array]:
    """Run a `make_drop_measure` function on one batch: (DropCounts, the QB bias this batch implies)."""
    counts, ce, bias = fn(params, {k: batch[k] for k in MODEL_INPUTS})
    counts = jax.device_get(counts)
    as_tuple = lambda k: tuple(int(x) for x in np.asarray(counts[k]))
    return DropCounts(as_tuple("valid"), as_tuple("kept"), as_tuple("sender_dropped"), as_tuple("receiver_dropped"),
                      float(ce)), bias


def replicate(params: Transformer, mesh: Mesh) -> Transformer:
    """Weights on every device of `mesh` (the tiny model is small; the transport slices the experts)."""
    return jax.device_put(params, NamedSharding(mesh, REPLICATED))


def set_router_bias(params: Transformer, bias_LE: jax.Array) -> Transformer:
    """`params` routing with `bias_LE` (fp32), e.g. the QB bias a previous batch implied."""
    return with_router_bias(params, jnp.asarray(bias_LE, jnp.float32))


def smallest_cf(cfs: list[float], drops: list[float], target: float) -> float | None:
    """The smallest capacity factor whose drop fraction is <= target, and every larger one's too (a
    non-monotone blip below target at a small cf does not count); None if even the largest misses."""
    best = None
    for cf, d in sorted(zip(cfs, drops), reverse=True):
        if d > target:
            break
        best = cf
    return best
