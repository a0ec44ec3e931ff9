"""Device traces of chosen training steps: `moejax train --profile START:STOP`.

Why in the trainer and not only in `bench/`: a run's own step (its mesh, data, context phase, optimizer state
on the host or not) is what a user needs to see when it is slow, and the benches time other shapes.

jax's profiler runs from before step START to after step STOP - 1 (steps counted from 0, as metrics.jsonl
and the progress bar count them; the first step a process runs compiles, so START should come after it). Each
process writes its own trace under RUN_DIR/profile/process_<i>/ (jax names the file by host name, so
processes sharing a host would otherwise overwrite each other): `plugins/profile/<time>/<host>.xplane.pb` for
TensorBoard's profile plugin or XProf, and `<host>.trace.json.gz` for ui.perfetto.dev. Each step is a
`StepTraceAnnotation`, so the viewers split the trace by step. An evaluation that falls inside the window is
traced too. A restart inside the window traces from its first step; a window the run has already passed
traces nothing (one line says so); a failure or preemption inside the window still writes what was traced.
On a GPU or TPU the trainer then prints the window's longest device ops a step (`top_ops_lines`, from the
Perfetto trace; `bench/bench_gpu.py` reads its traces with the same `event_totals`). Not on CPU: XLA:CPU runs
its dots asynchronously on its threads, so per-op events there mislead (docs/LOG.md, ninth session).
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import jax

from moejax.config import ConfigError

PROFILE_DIR = "profile"  # under the run directory (`run_dir.RUN_DIRS`: --overwrite removes it)
_WINDOW = re.compile(r"(\d+):(\d+)")
TOP_OPS = 10  # device ops listed after a trace is written
MAX_SUMMARY_BYTES = 256 << 20  # a larger trace is left to the viewers: reading it would stall the run
Totals = tuple[collections.Counter, collections.Counter]  # a trace's (total ms, count) by event name


@dataclass(frozen=True)
class ProfileWindow:
    """Steps start .. stop - 1 of the run."""

    start: int
    stop: int


def parse_window(text: str, steps: int) -> ProfileWindow:
    """`--profile`'s START:STOP, checked against the run's `steps`; a ConfigError (one line) otherwise."""
    m = _WINDOW.fullmatch(text.strip())
    if m is None or int(m[1]) >= int(m[2]):
        raise ConfigError(f"--profile {text!r}: expected START:STOP, the steps START .. STOP-1 with "
                          "0 <= START < STOP (e.g. 3:6; the first step compiles)")
    window = ProfileWindow(int(m[1]), int(m[2]))
    if window.start >= steps:
        raise ConfigError(f"--profile {text!r} starts at step {window.start}, but the run has {steps} steps "
                          f"(0 .. {steps - 1})")
    return window


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def trace_dir(run_dir: Path, process_index: int | str) -> Path:
    return Path(run_dir) / PROFILE_DIR / f"process_{process_index}"


def event_totals(trace_dir: Path, device_only: bool = False) -> Totals:
    """(total ms, count) by event name on the device lanes of the newest Perfetto trace under trace_dir; on
    the host lanes where the backend records no device lane (CPU), or nothing there with `device_only`."""
    total, count = collections.Counter(), collections.Counter()
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"))  # <time>/ directories sort in time order
    if not files:
        return total, count
    with gzip.open(files[-1]) as f:
        events = json.load(f).get("traceEvents", [])
    lanes = {e["pid"]: e.get("args", {}).get("name", "") for e in events if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    device = {pid for pid, name in lanes.items() if "/device:" in name and "CPU" not in name.upper()}
    if device_only and not device:
        return total, count
    for e in events:
        if e.get("ph") == "X" and "dur" in e and (not device or e["pid"] in device):
            total[e["name"]] += e["dur"] / 1e3
            count[e["name"]] += 1
    return total, count


def top_ops_lines(trace_dir: Path, steps: int, n: int = TOP_OPS) -> list[str]:
    """The n device ops (kernels) that took the most time a step in the newest trace, one line each; [] on a
    host without device lanes (XLA:CPU's ops run asynchronously on its threads, so their events mislead:
    docs/LOG.md, ninth session) or for a trace over MAX_SUMMARY_BYTES."""
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"))
    if not files or files[-1].stat().st_size > MAX_SUMMARY_BYTES:
        return []
    total, count = event_totals(trace_dir, device_only=True)
    if not total:
        return []
    all_ms = sum(total.values()) / steps
    return ([f"  device time {all_ms:.2f} ms a step; the longest ops (ms a step, calls a step):"]
            + [f"  {ms / steps:9.3f} ms  x{count[name] // steps:<4d} {name[:100]}" for name, ms in total.most_common(n)])


class StepProfiler:
    """Starts jax's profiler before the window's first step and stops it after its last (or at `close`)."""

    def __init__(self, window: ProfileWindow | None, out_dir: Path, first_step: int,
                 say: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
                 start: Callable[[str], None] = jax.profiler.start_trace,
                 stop: Callable[[], None] = jax.profiler.stop_trace, where: str = ""):
        """`where`: how the closing line names the traces (default: out_dir; a multi-process run's process 0
        names every process's directory)."""
        self.window, self.out_dir, self._say = window, Path(out_dir), say
        self._where = where or str(self.out_dir)
        self._start, self._stop = start, stop
        self.tracing = False
        if window is not None and first_step >= window.stop:
            say(f"moejax: --profile {window.start}:{window.stop}: this run resumes at step {first_step}, "
                "after the window; nothing traced")

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one train step (its call and the device_get of its metrics, so the device work is done)."""
        w = self.window
        if w is None or not w.start <= step < w.stop:
            yield
            return
        if not self.tracing:
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                self._start(str(self.out_dir))
            except Exception as e:  # e.g. a profiler already running in this process: train on, untraced
                self._say(f"moejax: --profile: could not start jax's profiler in {self.out_dir}: {_first_line(e)}; "
                          "training on without a trace")
                self.window = None
                yield
                return
            self.tracing, self._first, self._last = True, step, None
        with jax.profiler.StepTraceAnnotation("train", step_num=step):
            yield
        self._last = step
        if step + 1 == w.stop:
            self._finish()

    def close(self) -> None:
        """At the end of the loop, normal or not: a trace still running (the run ended, failed or was preempted
        inside the window) is written with the steps it holds."""
        if self.tracing:
            self._finish()

    def _finish(self) -> None:
        self.tracing = False
        try:
            self._stop()
        except Exception as e:  # a failed write must not hide the run's own outcome (or its exception)
            self._say(f"moejax: --profile: writing the trace to {self.out_dir} failed: {_first_line(e)}")
            return
        steps = (f"steps {self._first} .. {self._last}" if self._last is not None
                 else f"step {self._first}, which did not finish")
        self._say(f"moejax: profile of {steps} in {self._where} "
                  "(TensorBoard's profile plugin, or its *.trace.json.gz in ui.perfetto.dev)")
        if self._last is None:
            return
        try:
            lines = top_ops_lines(self.out_dir, self._last - self._first + 1)
        except (OSError, ValueError, KeyError, TypeError) as e:  # an unreadable trace: the viewers may still open it
            lines = [f"  (its summary could not be read: {_first_line(e)})"]
        for line in lines:
            self._say(line)
