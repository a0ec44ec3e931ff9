"""Device traces of chosen training steps: `moejax train --profile START:STOP`.

Why in the trainer and not only in `bench/`: a run's own step (its mesh, data, context phase, optimizer state
on the host or not) is what a user needs to see when it is slow, and the benches time other shapes.

jax's profiler runs from the start of step START's loop body to the end of step STOP - 1's (steps counted from
0, as metrics.jsonl and the progress bar count them): the step, its logging, and an evaluation that falls in
the window. The first step a process runs compiles, so START should come after it. The
profiler runs without its Python tracer: with it, a compiling step alone makes millions of events, and jax's
Perfetto export keeps only the first 1,000,000 (a restart's trace then ended mid-step). Each process writes its
own trace under RUN_DIR/profile/process_<i>/ (jax names the file by host name, so processes sharing a host
would otherwise overwrite each other): `plugins/profile/<time>/<host>.xplane.pb` for TensorBoard's profile
plugin or XProf, and `<host>.trace.json.gz` for ui.perfetto.dev. Each step is a `StepTraceAnnotation`, so the
viewers split the trace by step. A restart inside the window traces from its first step; a run that has passed
the window (or finished) traces nothing and says so; a failure or preemption inside the window still writes
what was traced; a profiler that can't start or a trace that can't be written is one line, and training goes on.
On GPUs process 0 then prints the window's longest kernels, per device and step (`top_ops_lines`, from the
Perfetto trace's GPU lanes; `bench/bench_gpu.py` reads its traces with the same `event_totals`). Not on CPU:
XLA:CPU runs its dots asynchronously on its threads, so per-op events there mislead (docs/LOG.md, ninth
session); not on TPU, whose trace rows this has not been checked against.
"""

from __future__ import annotations

import collections
import gzip
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax

from moejax.config import ConfigError, first_line

PROFILE_DIR = "profile"  # under the run directory (`run_dir.RUN_DIRS`: --overwrite removes it)
_WINDOW = re.compile(r"([0-9]{1,9}):([0-9]{1,9})")  # ASCII digits; a bound int() takes without a limit error
TOP_OPS = 10  # GPU kernels listed after a trace is written
MAX_SUMMARY_BYTES = 256 << 20  # a larger trace is left to the viewers: reading it would stall the run
Totals = tuple[collections.Counter, collections.Counter]  # a trace's (total ms, count) by event name


@dataclass(frozen=True)
class ProfileWindow:
    """Steps start .. stop - 1 of the run."""

    start: int
    stop: int


def parse_window(text: str, steps: int) -> ProfileWindow:
    """`--profile`'s START:STOP, checked against the run's `steps`; a ConfigError (one line) otherwise."""
    m = _WINDOW.fullmatch(text.strip())  # "" too: `--profile ''` is a mistake, not "no profile"
    if m is None or int(m[1]) >= int(m[2]):
        raise ConfigError(f"--profile {text!r}: expected START:STOP, the steps START .. STOP-1 with "
                          "0 <= START < STOP (e.g. 3:6; the first step compiles)")
    window = ProfileWindow(int(m[1]), int(m[2]))
    if window.start >= steps:
        raise ConfigError(f"--profile {text!r} starts at step {window.start}, but the run has {steps} steps "
                          f"(0 .. {steps - 1})")
    return window


def trace_dir(run_dir: Path, process_index: int | str) -> Path:
    return Path(run_dir) / PROFILE_DIR / f"process_{process_index}"


def _newest_trace(trace_dir: Path) -> Path | None:
    files = sorted(Path(trace_dir).rglob("*.trace.json.gz"))  # <time>/ directories sort in time order
    return files[-1] if files else None


def _lanes(events: list[dict]) -> dict[int, str]:
    """Perfetto's process lanes: pid -> name ("/device:GPU:0", "/host:CPU", ...)."""
    return {e["pid"]: e.get("args", {}).get("name", "") for e in events
            if e.get("ph") == "M" and e.get("name") == "process_name"}


def _read_events(path: Path) -> list[dict]:
    with gzip.open(path) as f:
        return json.load(f).get("traceEvents", [])


def _sum_events(events: list[dict], keep: Callable[[int], bool]) -> Totals:
    """(total ms, count) by name of the complete events on the lanes `keep` accepts."""
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and "dur" in e and keep(e["pid"]):
            total[e["name"]] += e["dur"] / 1e3
            count[e["name"]] += 1
    return total, count


def event_totals(trace_dir: Path) -> Totals:
    """(total ms, count) by event name on the device lanes of the newest Perfetto trace under trace_dir, summed
    over the devices; on the host lanes where the backend records no device lane (CPU)."""
    path = _newest_trace(trace_dir)
    if path is None:
        return collections.Counter(), collections.Counter()
    events = _read_events(path)
    device = {pid for pid, name in _lanes(events).items() if "/device:" in name and "CPU" not in name.upper()}
    return _sum_events(events, lambda pid: not device or pid in device)


def top_ops_lines(trace_dir: Path, steps: int, n: int = TOP_OPS) -> list[str]:
    """The n GPU kernels that took the most time in the newest trace, in ms and calls per device and step (the
    mean over the process's GPUs), one line each; [] without GPU lanes or for a trace over MAX_SUMMARY_BYTES."""
    path = _newest_trace(trace_dir)
    if path is None or path.stat().st_size > MAX_SUMMARY_BYTES:
        return []
    events = _read_events(path)
    gpus = {pid for pid, name in _lanes(events).items() if "/device:GPU:" in name}
    total, count = _sum_events(events, gpus.__contains__)
    if not total:
        return []
    per = len(gpus) * steps  # kernels per device and step
    head = (f"  GPU time {sum(total.values()) / per:.2f} ms a step per device (mean of {len(gpus)}, streams "
            "summed); the longest kernels (ms, calls):")
    return [head] + [f"  {ms / per:9.3f} ms  x{count[name] / per:<6.4g} {name[:100]}"
                     for name, ms in total.most_common(n)]


def start_trace(out_dir: str) -> None:
    """jax's profiler without its Python tracer (see the module's docstring)."""
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    jax.profiler.start_trace(out_dir, profiler_options=options)


class StepProfiler:
    """Starts jax's profiler at the window's first step and stops it after its last (or at `close`)."""

    def __init__(self, window: ProfileWindow | None, out_dir: Path, first_step: int, total_steps: int, *,
                 say: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
                 warn: Callable[[str], None] | None = None, summarize: bool = False,
                 start: Callable[[str], None] = start_trace, stop: Callable[[], None] = jax.profiler.stop_trace,
                 where: str = ""):
        """`say`: progress lines (process 0's); `warn`: failures (every process's; default `say`).
        `summarize`: list the longest GPU kernels after the trace is written (process 0 on a GPU).
        `where`: how the closing line names the traces (default out_dir; a multi-process run's process 0
        names every process's directory)."""
        self.window, self.out_dir = window, Path(out_dir)
        self._say, self._warn, self._summarize = say, warn or say, summarize
        self._where = where or str(self.out_dir)
        self._start, self._stop = start, stop
        self.tracing, self._annotation = False, None
        if window is None:
            return
        if first_step >= total_steps:
            say(f"moejax: --profile {window.start}:{window.stop}: the run has already finished "
                f"({total_steps} steps); nothing traced")
        elif first_step >= window.stop:
            say(f"moejax: --profile {window.start}:{window.stop}: this run resumes at step {first_step}, "
                "after the window; nothing traced")

    def begin(self, step: int) -> None:
        """At the top of a step's loop body: the trace starts before the window's first step."""
        w = self.window
        if w is not None and w.start <= step < w.stop and not self.tracing:
            self._begin(step)
        if self.tracing:
            self._annotation = jax.profiler.StepTraceAnnotation("train", step_num=step)
            self._annotation.__enter__()

    def end(self, step: int) -> None:
        """Once a step's work, logging and evaluation are done: the trace is written after the window's last step
        (so that no step's throughput includes writing it)."""
        if not self.tracing:
            return
        self._end_annotation()
        self._last = step
        if step + 1 == self.window.stop:
            self._finish()

    def _end_annotation(self) -> None:
        if self._annotation is not None:
            self._annotation.__exit__(None, None, None)
            self._annotation = None

    def close(self) -> None:
        """At the end of the loop, normal or not: a trace still running (the run ended, failed or was preempted
        inside the window) is written with the steps it holds. Never raises: the run's own outcome stands."""
        if self.tracing:
            self._end_annotation()  # a step that raised: its annotation ends here
            self._finish()

    def _begin(self, step: int) -> None:
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._start(str(self.out_dir))
        except Exception as e:  # noqa: BLE001 -- e.g. a profiler already running here: train on, untraced
            self._warn(f"moejax: --profile: could not start jax's profiler in {self.out_dir}: {first_line(e)}; "
                       "training on without a trace")
            self.window = None
            return
        self.tracing, self._first, self._last = True, step, None

    def _finish(self) -> None:
        self.tracing = False
        try:
            self._stop()
        except Exception as e:  # noqa: BLE001 -- a failed write must not hide the run's outcome or its exception
            self._warn(f"moejax: --profile: writing the trace to {self.out_dir} failed: {first_line(e)}")
            return
        steps = (f"steps {self._first} .. {self._last}" if self._last is not None
                 else f"step {self._first}, which did not finish")
        self._say(f"moejax: profile of {steps} in {self._where} "
                  "(TensorBoard's profile plugin, or its *.trace.json.gz in ui.perfetto.dev)")
        if not self._summarize or self._last is None:
            return
        try:
            lines = top_ops_lines(self.out_dir, self._last - self._first + 1)
        except Exception as e:  # noqa: BLE001 -- an unreadable trace (EOFError, zlib.error, ...): viewers may open it
            lines = [f"  (its kernel summary could not be read: {first_line(e)})"]
        for line in lines:
            self._say(line)
