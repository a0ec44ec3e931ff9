"""The host side of a train step: bounded logging, whole-run totals for the summary, routing-health alarms.

Dimensions: L layers, E routed experts.

Per step the loop hands over the step's scalars and its [L, E] expert loads. A row goes to metrics.jsonl
every `train.log_every` steps, at the last step, and at any step that raised or cleared an alarm; the
loads ride along only every `train.load_log_every` steps (and at the last), since at hero shape they are
~230 KB of JSON per row. Nothing kept in memory grows with the step count: the summary comes from
running totals (`RunTotals`) — first and last values, a bounded window of throughput for the median,
alarm counts with their first and last line — and a resumed run rebuilds them from the rows already in
metrics.jsonl, so `summary.json` describes the whole run, not only the last segment.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections import deque
from typing import Callable, Iterable

import numpy as np

from moejax.config import RunConfig
from moejax.metrics import MetricsWriter, to_py
from moejax.train.alarms import LOAD_KEY, ROW_KEY, Alarm, Alarms, alarm_fields

THROUGHPUT_WINDOW = 1024  # the summary's tokens/s and MFU: median over the most recent this-many steady steps
COMPILE_STEPS = 2  # the first steps of every (re)start are compile-dominated: left out of the throughput
WALL_KEY = "time/wall_seconds"  # seconds of training so far, summed over restarts
SEGMENT_KEY = "time/segment_step"  # steps this process ran before this one: 0 at the start and at every restart
EVAL_KEY = "eval/loss"  # in a row: an evaluation ran at that step
LAST_KEYS = ("train/loss", "moe/drop_fraction", EVAL_KEY, "eval/bpb", "eval_dropless/loss", "eval_dropless/bpb")


def _finite(v) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


class RunTotals:
    """What the summary needs, in O(1) memory however long the run: fed one row (a step's metrics) at a time."""

    def __init__(self):
        self.first_step: int | None = None
        self.first_loss = None
        self.last_step: int | None = None
        self.last_train_step: int | None = None  # the latest row with training metrics (not an eval-only one)
        self.last: dict = {}  # LAST_KEYS -> the latest value logged
        self.eval_step: int | None = None  # the row of the latest eval (earlier than the last step if a later
        # segment ran with train.eval_batches=0)
        self.tokens_per_second: deque[float] = deque(maxlen=THROUGHPUT_WINDOW)
        self.mfu: deque[float] = deque(maxlen=THROUGHPUT_WINDOW)
        self.wall_before = 0.0  # seconds spent in earlier segments of this run
        self.alarms: dict[str, dict] = {}  # kind -> {"count", "first", "last"} (lines of raised alarms)

    def add(self, step: int, row: dict, steady: bool = True) -> None:
        if self.first_step is None and "train/loss" in row:  # not step 0's eval-only row (eval_at_start)
            self.first_step, self.first_loss = step, row["train/loss"]
        self.last_step = step
        if "train/loss" in row:
            self.last_train_step = step
        self.last.update({k: row[k] for k in LAST_KEYS if k in row})
        if EVAL_KEY in row:
            self.eval_step = step
        if steady and (tps := _finite(row.get("throughput/tokens_per_second"))) is not None:
            self.tokens_per_second.append(tps)
            if (mfu := _finite(row.get("throughput/mfu"))) is not None:
                self.mfu.append(mfu)
        for d in row.get(ROW_KEY, ()):
            self.add_alarm(Alarm.from_dict(d))

    def add_alarm(self, a: Alarm) -> None:
        if a.cleared:
            return
        entry = self.alarms.setdefault(a.kind, {"count": 0, "first": a.line()})
        entry["count"] += 1
        entry["last"] = a.line()

    @classmethod
    def from_rows(cls, rows: Iterable[dict]) -> "RunTotals":
        """Totals of the steps already in metrics.jsonl (a resumed run's earlier segments), read one row at
        a time: an iterator keeps this O(1) in memory too."""
        totals = cls()
        for row in rows:
            totals.add_row(row)
        return totals

    def add_row(self, row: dict) -> None:
        """A row as metrics.jsonl has it (its "step" included), from an earlier segment of the run."""
        # a row of a restart's first steps is compile-dominated too; rows of runs before SEGMENT_KEY existed know
        # only the run's own start
        since_start = _finite(row.get(SEGMENT_KEY, row["step"]))
        self.add(int(row["step"]), row, steady=since_start is not None and since_start >= COMPILE_STEPS)
        if (wall := _finite(row.get(WALL_KEY))) is not None:
            self.wall_before = wall

    def summary(self, name: str, steps: int, wall_seconds: float) -> dict:
        out = {"preset": name, "steps": steps, "first_step": self.first_step, "first_loss": self.first_loss,
               "last_loss": self.last.get("train/loss"),
               "tokens_per_second": statistics.median(self.tokens_per_second) if self.tokens_per_second else 0.0,
               "mfu": statistics.median(self.mfu) if self.mfu else 0.0, "wall_seconds": wall_seconds,
               "drop_fraction": self.last.get("moe/drop_fraction"), "alarms": self.alarms}
        out.update({k: self.last[k] for k in LAST_KEYS[2:] if k in self.last})
        if self.eval_step is not None:
            out["eval_step"] = self.eval_step
        return out


def print_alarm(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(f"moejax: {line}", file=sys.stderr)  # above the progress bar, not through it


class StepLog:
    """One run segment's logging: alarms, rows to the writer, running totals. `check` runs before the
    finiteness check (so a non-finite grad norm is still reported), `record` once the row is complete."""

    def __init__(self, cfg: RunConfig, writer: MetricsWriter, totals: RunTotals,
                 emit: Callable[[str], None] = print_alarm):
        self.train = cfg.train
        self.alarms = Alarms(cfg.alarms)
        self.writer, self.totals, self.emit = writer, totals, emit
        self._t0, self._steps = time.perf_counter(), 0

    def check(self, step: int, metrics: dict, load_LE) -> list[Alarm]:
        """Evaluate the alarms on this step's metrics; print each raised/cleared one and add it to the row."""
        alarms = self.alarms.check(step, metrics, load_LE)
        for a in alarms:
            self.emit(a.line())
        metrics.update(alarm_fields(alarms))
        return alarms

    def _clock(self) -> dict:
        return {WALL_KEY: self.totals.wall_before + time.perf_counter() - self._t0, SEGMENT_KEY: self._steps}

    def _with_load(self, step: int, metrics: dict, load_LE, last: bool) -> dict:
        t = self.train
        due = load_LE is not None and t.load_log_every > 0 and (last or step % t.load_log_every == 0)
        return {**metrics, LOAD_KEY: np.asarray(load_LE)} if due else metrics

    def final_row(self, step: int, metrics: dict, load_LE) -> dict:
        """The last step's row as `record` would write it now, as JSON values: what the final checkpoint keeps
        of it, since that row is written only after the last step's evaluation."""
        row = self._with_load(step, {**metrics, **self._clock()}, load_LE, last=True)
        return {k: to_py(v) for k, v in row.items()}

    def record(self, step: int, metrics: dict, load_LE, last: bool = False) -> None:
        """Add the step to the totals and write its row if one is due (`metrics` gains the wall clock)."""
        metrics.update(self._clock())
        self.totals.add(step, metrics, steady=self._steps >= COMPILE_STEPS)
        self._steps += 1
        row = self._with_load(step, metrics, load_LE, last)
        # Alarm and eval rows are written whatever log_every says (an eval every 25 steps, rows every 10).
        if LOAD_KEY in row or last or step % self.train.log_every == 0 or ROW_KEY in metrics or EVAL_KEY in metrics:
            self.writer.log(step, row)

    def summary(self, name: str, steps: int) -> dict:
        wall = self.totals.wall_before + time.perf_counter() - self._t0
        return self.totals.summary(name, steps, wall)
