"""The trained model of a run directory: its config, a checkpoint, the model weights alone, its tokenizer.

Used by `moejax generate` and `moejax export`. Notable choices:
- Only the needed part of the train state is read (orbax partial restore of `compute` or `params`): the
  optimizer state (2x the fp32 master under Adam) never leaves the disk.
- The router bias is the model's fp32 `router_bias` leaf (the compute copy keeps it in fp32 too): the QB
  bias the next train step would have routed with.
- The checkpoint's recorded model config must equal the run's config.json (else one line naming the field).
- The tokenizer is rebuilt the way the data pipeline built it (`data.pipeline.run_tokenizer`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from moejax.checkpoint import (MARKER, METADATA, STATE, CheckpointError, IncompatibleCheckpointError, check_checksums,
                               check_compatible, list_checkpoints, one_line, reading, with_empty, without_empty)
from moejax.config import ConfigError, RunConfig
from moejax.model.transformer import Transformer
from moejax.train.state import compute_copy


class WeightsError(ConfigError):
    """A run dir, checkpoint or export that cannot be used; the message is one line (exit 2)."""


@dataclass(frozen=True)
class Loaded:
    cfg: RunConfig
    params: Transformer  # with the trained (QB) router bias in fp32
    step: int
    path: Path  # the checkpoint's step dir


def run_config(run_dir: Path) -> RunConfig:
    path = Path(run_dir) / "config.json"
    if not path.is_file():
        raise WeightsError(f"{run_dir} is not a run directory (no config.json)")
    try:
        return RunConfig.from_dict(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        raise WeightsError(f"{path} is not a valid run config ({type(e).__name__}: {e})") from None


def choose_checkpoints(run_dir: Path, step: int | None) -> list[Path]:
    """Complete step dirs to try, newest first; only `step`'s when it is given."""
    complete = [c for c in list_checkpoints(run_dir) if c.complete]
    if step is None:
        if not complete:
            raise WeightsError(f"no complete checkpoint in {Path(run_dir) / 'checkpoints'}")
        return [c.path for c in reversed(complete)]
    match = [c.path for c in complete if c.step == step]
    if not match:
        have = ", ".join(str(c.step) for c in complete) or "none"
        raise WeightsError(f"no complete checkpoint at step {step} in {run_dir} (complete steps: {have})")
    return match


def restore_weights(step_dir: Path, cfg: RunConfig, which: str = "compute") -> Transformer:
    """`which` ("compute": compute-dtype copy with the fp32 router bias, "params": fp32 master) on the
    default device. Raises CheckpointError (one line) when the checkpoint cannot be used."""
    step_dir = Path(step_dir).absolute()  # orbax needs absolute paths
    if not (step_dir / MARKER).is_file():
        raise CheckpointError(f"{step_dir}: incomplete checkpoint (no {MARKER} marker)")
    try:
        meta = json.loads((step_dir / METADATA).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{step_dir}: unreadable {METADATA}: {one_line(e)}") from None
    if "model_config" in meta:
        check_compatible(meta["model_config"], dataclasses.asdict(cfg.model))
    model = jax.eval_shape(lambda k: Transformer.init(cfg.model, k), jax.random.key(0))
    if which == "compute":
        model = jax.eval_shape(lambda m: compute_copy(m, jnp.dtype(cfg.model.compute_dtype)), model)
    dev = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=dev), {which: model})
    saved = without_empty(target)  # zero-size arrays (model.n_shared=0) were never saved: put back below
    args = ocp.args.PyTreeRestore(item=saved, restore_args=ocp.checkpoint_utils.construct_restore_args(saved),
                                  partial_restore=True)
    with reading(step_dir):
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
            out = ckptr.restore(step_dir / STATE, args=args)
    check_checksums(step_dir, meta, out)  # the leaves read, named as in the whole state ("params/…")
    return with_empty(target, out)[which]


def load_run(run_dir: str | Path, step: int | None = None, which: str = "compute") -> Loaded:
    """The run's config and the newest (or `step`'s) complete checkpoint that restores; older ones are
    tried after a one-line warning each (as training's resume does)."""
    run_dir = Path(run_dir)
    cfg = run_config(run_dir)
    tried, paths = [], choose_checkpoints(run_dir, step)
    for k, path in enumerate(paths):
        try:
            params = restore_weights(path, cfg, which)
        except IncompatibleCheckpointError as e:  # never a reason to fall back: every checkpoint shares it
            raise WeightsError(f"{path}: {e}") from None
        except CheckpointError as e:
            tried.append(str(e))
            if k + 1 < len(paths):  # the last one's reason is in the error below
                print(f"moejax: warning: {e}; trying an older checkpoint", file=sys.stderr)
            continue
        return Loaded(cfg, params, int(path.name.split("_")[1]), path)
    if step is not None:  # the one asked for: nothing older is tried
        raise WeightsError(tried[0])
    raise WeightsError(f"no usable checkpoint in {run_dir / 'checkpoints'}; tried: " + " | ".join(tried))
