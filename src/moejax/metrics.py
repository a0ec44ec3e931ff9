"""Metric sinks: `metrics.jsonl` always, W&B (offline by default), and a console progress bar.

Names are W&B-compatible (`train/loss`, `moe/drop_fraction`, `throughput/mfu`, ...). W&B runs in
offline mode unless `--wandb online` (or WANDB_MODE) says otherwise; `WANDB_MODE=disabled` turns it off.

metrics.jsonl is appended one whole line per write, so a crash (or a full disk) can tear only the last
line; every reader (`metric_lines`) drops a torn last line, and a resume rewrites the file without it.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from pathlib import Path
from typing import Iterator

import numpy as np

from moejax import faults
from moejax.fsio import atomic_write
from moejax.config import ConfigError, first_line


class MetricsWriter:
    """Writes on the primary process only (multi-host runs log once); elsewhere every call is a no-op."""

    def __init__(self, run_dir: Path, *, wandb_mode: str = "offline", project: str = "moejax",
                 run_name: str | None = None, config: dict | None = None, primary: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        # Unbuffered: a write that fails (a full disk) leaves nothing queued for close() to fail on again.
        self._f = open(self.path, "ab", buffering=0) if primary else None
        self._wandb = None
        mode = os.environ.get("WANDB_MODE", wandb_mode)
        if primary and mode != "disabled":
            self._wandb = _wandb_init(project=project, name=run_name, dir=str(run_dir), mode=mode, config=config,
                                      id=wandb_run_id(run_dir))

    def log(self, step: int, metrics: dict) -> None:
        if self._f is None:
            return
        row = {"step": int(step), **{k: to_py(v) for k, v in metrics.items()}}
        line = (json.dumps(row) + "\n").encode()
        if faults.kill_at("metrics", step):  # a torn last line, as a crash mid-write leaves it
            self._f.write(line[: len(line) // 2])
            self._f.flush()
            faults.kill_now()
        _write_all(self._f, line)  # one whole line: only a crash (or a full disk) inside it tears a line
        # A resumed W&B run (online) starts at the step after the last it holds: the steps a restart redoes since
        # its checkpoint (the same values) are already there, and W&B would refuse each with a warning line.
        if self._wandb is not None and int(step) >= getattr(self._wandb, "step", 0):
            self._wandb.log({k: v for k, v in row.items() if not isinstance(v, list)}, step=int(step))

    def sync(self) -> None:
        """Make the rows written so far durable (fsync): called before each checkpoint, so a checkpoint that
        survives a lost node (on NFS too) never covers rows that did not."""
        if self._f is not None:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
        if self._wandb is not None:
            self._wandb.finish()


def _write_all(f, data: bytes) -> None:
    """All of `data` to the unbuffered file f (a raw write may take only part of it)."""
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def check_wandb(mode: str) -> None:
    """Before a run starts: `online` (here or in WANDB_MODE) without an API key is one ConfigError line."""
    if os.environ.get("WANDB_MODE", mode) == "online" and not _wandb_has_key():
        raise ConfigError("--wandb online needs a W&B API key (run `wandb login` or set WANDB_API_KEY); "
                          "or use --wandb offline and `wandb sync` later")


WANDB_ID_FILE = "moejax-run-id"  # in RUN_DIR/wandb/, which --overwrite clears with the rest of the run


def wandb_run_id(run_dir: Path) -> str:
    """The run's W&B id, made at its start and kept in its run dir: every restart of a preempted run logs to the
    same W&B run (resume="allow"), not a new one each time."""
    path = Path(run_dir) / "wandb" / WANDB_ID_FILE
    try:
        run_id = path.read_text().strip()
    except OSError:
        run_id = ""
    if not re.fullmatch(r"[a-z0-9]{8,64}", run_id):
        run_id = secrets.token_hex(8)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, run_id + "\n")
    return run_id


def _wandb_init(**kw):
    """wandb.init with its failures (no API key for `online`, no network) as one line."""
    import wandb

    check_wandb(kw["mode"])
    try:
        return wandb.init(resume="allow", reinit="finish_previous", **kw)
    except Exception as e:  # wandb raises its own error types with multi-line text
        raise ConfigError(f"W&B ({kw['mode']}) failed to start: {first_line(e)}") from None


def _wandb_has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1].split("/")[0]
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def to_py(v):
    if type(v) in (int, float, str):  # already a JSON scalar (most of a row): skip numpy
        return v if type(v) is not float or math.isfinite(v) else str(v)
    a = np.asarray(v)
    if a.ndim == 0:
        x = a.item()
        return x if not isinstance(x, float) or math.isfinite(x) else str(x)
    return a.tolist()


def metric_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, line with its newline) of a metrics.jsonl, streamed, blank lines skipped. A last line
    without its newline is torn (a crash or a full disk mid-write) and dropped unless it is whole JSON."""
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if not line.endswith(b"\n"):  # only the last line can lack its newline
                if is_json_object(line):
                    yield i, line + b"\n"
                return
            if line.strip():
                yield i, line


def is_json_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def read_metrics(run_dir: Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl (a torn last line dropped); a malformed earlier line is a ConfigError."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for i, line in metric_lines(path):
        try:
            rows.append(json.loads(line))
        except ValueError as e:
            raise ConfigError(f"{path} line {i} is not JSON ({getattr(e, 'msg', e)})") from None
    return rows
