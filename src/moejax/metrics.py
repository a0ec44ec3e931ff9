"""Metric sinks: `metrics.jsonl` always, W&B (offline by default), and a console progress bar.

Names are W&B-compatible (`train/loss`, `moe/drop_fraction`, `throughput/mfu`, ...). W&B runs in
offline mode unless `--wandb online` (or WANDB_MODE) says otherwise; `WANDB_MODE=disabled` turns it off.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np


class MetricsWriter:
    """Writes on the primary process only (multi-host runs log once); elsewhere every call is a no-op."""

    def __init__(self, run_dir: Path, *, wandb_mode: str = "offline", project: str = "moejax",
                 run_name: str | None = None, config: dict | None = None, primary: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self._f = open(self.path, "a", encoding="utf-8") if primary else None
        self._wandb = None
        mode = os.environ.get("WANDB_MODE", wandb_mode)
        if primary and mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=project, name=run_name, dir=str(run_dir), mode=mode,
                                     config=config, resume="allow", reinit="finish_previous")

    def log(self, step: int, metrics: dict) -> None:
        if self._f is None:
            return
        row = {"step": int(step), **{k: to_py(v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in row.items() if not isinstance(v, list)}, step=int(step))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._wandb is not None:
            self._wandb.finish()


def to_py(v):
    if type(v) in (int, float, str):  # already a JSON scalar (most of a row): skip numpy
        return v if type(v) is not float or math.isfinite(v) else str(v)
    a = np.asarray(v)
    if a.ndim == 0:
        x = a.item()
        return x if not isinstance(x, float) or math.isfinite(x) else str(x)
    return a.tolist()


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
