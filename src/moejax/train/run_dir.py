"""The run directory: what the trainer reads and writes outside checkpoints.

RUN_DIR holds `config.json` (the resolved RunConfig), `run_info.json` (git SHA, library versions, device
topology, derived numbers), `metrics.jsonl` (one object per step), `summary.json`, and `checkpoints/`
(moejax.checkpoint). Every file is published with `fsio.atomic_write`; only the primary process writes.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax

from moejax import accounting
from moejax.config import RunConfig
from moejax.diffs import first_difference
from moejax.fsio import atomic_write
from moejax.model.transformer import param_count

LIBRARIES = ("jax", "jaxlib", "optax", "orbax-checkpoint", "numpy", "tokenizers")


class RunError(RuntimeError):
    """A user-facing problem with the run directory or the run itself (one line, exit 2)."""


def prepare_run_dir(run_dir: Path, cfg: RunConfig, overwrite: bool, primary: bool = True) -> bool:
    """Create the run dir and its config.json; True when it already holds this run (resume).
    Only the primary process writes; the others only read what is there."""
    cfg_path = run_dir / "config.json"
    if not primary:
        return cfg_path.exists() and not overwrite
    if cfg_path.exists() and not overwrite:
        try:
            old = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RunError(f"run dir {run_dir} has an unreadable config.json ({e}); pass --overwrite to replace it")
        new = cfg.to_dict()
        diff = first_difference(_comparable(_with_new_fields(old, new)), _comparable(new))
        if diff:
            raise RunError(f"run dir {run_dir} already holds a different run ({diff}); "
                           "choose another --run-dir or pass --overwrite")
        atomic_write(cfg_path, cfg.to_json())  # records the mesh this restart runs on
        return True
    if run_dir.exists() and overwrite:
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(cfg_path, cfg.to_json())
    except OSError as e:
        raise RunError(f"cannot write to run dir {run_dir}: {e.strerror or e}") from None
    return False


# The mesh may change between restarts (checkpoints reshard on load), and so may the alarm thresholds
# (monitoring only); the model, data and schedule may not.
RESTART_MAY_CHANGE = ("parallel", "alarms")


def _comparable(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in RESTART_MAY_CHANGE}


def _with_new_fields(old: dict, new: dict) -> dict:
    """`old` with the fields it predates taken from `new`: a setting that did not exist when the run was
    started (a config.json from an older moejax) cannot differ from it. Fields only `old` has still count."""
    out = {**{k: v for k, v in new.items() if k not in old}, **old}
    for k, v in new.items():
        if isinstance(v, dict) and isinstance(old.get(k), dict):
            out[k] = _with_new_fields(old[k], v)
    return out


def run_info(cfg: RunConfig, peak: float) -> dict:
    """What reproduces the run from its log (STYLE rule 10)."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return {"git_sha": sha, "python": sys.version.split()[0],
            "versions": {p: importlib.metadata.version(p) for p in LIBRARIES},
            "devices": [str(d) for d in jax.devices()], "process_count": jax.process_count(),
            "peak_flops": peak, "accounting": accounting.summary(cfg, param_count(cfg.model))}


def write_json(path: Path, obj: dict, **kw) -> None:
    atomic_write(path, json.dumps(obj, indent=2, **kw))


def truncate_metrics(run_dir: Path, start: int) -> None:
    """Drop rows of steps that will be re-run after a resume, so metrics.jsonl has each step once."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < start]
        atomic_write(path, "".join(r + "\n" for r in rows))


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())
