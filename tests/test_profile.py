"""`moejax train --profile START:STOP` (`moejax.train.profile`): which steps the trace holds, across restarts and
failures, the kernel list, and the one-line errors. The CLI's short training run (tests/test_cli.py) checks the
trace files the loop writes."""

import gzip
import json

import pytest

from moejax.config import ConfigError
from moejax.train.profile import ProfileWindow, StepProfiler, event_totals, parse_window, top_ops_lines


class FakeTracer:
    """Records the profiler's start and stop calls and the lines it says (`lines`) or warns (`warnings`)."""

    def __init__(self):
        self.calls, self.lines, self.warnings = [], [], []

    def profiler(self, window, first_step, tmp_path, total_steps=100, fail_stop=False, fail_start=False,
                 summarize=False, where=""):
        def start(path):
            if fail_start:
                raise RuntimeError("Profiler is already running.\nmore detail")
            self.calls.append(("start", path))

        def stop():
            self.calls.append("stop")
            if fail_stop:
                raise OSError("No space left on device\nmore detail")
        return StepProfiler(window, tmp_path / "trace", first_step, total_steps, say=self.lines.append,
                            warn=self.warnings.append, summarize=summarize, start=start, stop=stop, where=where)


def run_steps(prof, calls, steps, fail_at=None):
    """The loop's use: `begin` and `end` around each step's body, `close` in a finally."""
    try:
        for step in steps:
            prof.begin(step)
            calls.append(("step", step, prof.tracing))
            if step == fail_at:
                raise RuntimeError("step failed")
            prof.end(step)
    finally:
        prof.close()


def test_window_traces_its_steps_only(tmp_path):
    t = FakeTracer()
    run_steps(t.profiler(ProfileWindow(2, 4), 0, tmp_path), t.calls, range(6))
    assert t.calls == [("step", 0, False), ("step", 1, False), ("start", str(tmp_path / "trace")),
                       ("step", 2, True), ("step", 3, True), "stop", ("step", 4, False), ("step", 5, False)]
    assert (tmp_path / "trace").is_dir()
    assert len(t.lines) == 1 and f"profile of steps 2 .. 3 in {tmp_path / 'trace'} (" in t.lines[0]
    t = FakeTracer()  # a multi-process run's process 0 names every process's directory
    run_steps(t.profiler(ProfileWindow(0, 1), 0, tmp_path, where="run/profile/process_*"), t.calls, range(1))
    assert "profile of steps 0 .. 0 in run/profile/process_* (" in t.lines[0]


def test_a_restart_inside_the_window_traces_from_its_first_step(tmp_path):
    t = FakeTracer()
    run_steps(t.profiler(ProfileWindow(2, 6), 4, tmp_path), t.calls, range(4, 8))
    assert [c for c in t.calls if c[0] != "step"] == [("start", str(tmp_path / "trace")), "stop"]
    assert [c[1] for c in t.calls if c[0] == "step" and c[2]] == [4, 5]
    assert "steps 4 .. 5" in t.lines[0]


@pytest.mark.parametrize("window, first, total, words", [
    (ProfileWindow(2, 4), 10, 100, "this run resumes at step 10, after the window"),
    (ProfileWindow(2, 20), 4, 4, "the run has already finished (4 steps)"),  # a finished run run again
    (ProfileWindow(2, 4), 10, 10, "the run has already finished (10 steps)")])
def test_a_run_past_the_window_traces_nothing_and_says_so(window, first, total, words, tmp_path):
    t = FakeTracer()
    run_steps(t.profiler(window, first, tmp_path, total), t.calls, range(first, total))
    assert all(c[0] == "step" and not c[2] for c in t.calls)
    assert len(t.lines) == 1 and words in t.lines[0] and t.lines[0].endswith("nothing traced")


def test_a_run_that_ends_or_fails_inside_the_window_still_writes_its_trace(tmp_path):
    t = FakeTracer()  # the run's last step comes before STOP
    run_steps(t.profiler(ProfileWindow(1, 100), 0, tmp_path), t.calls, range(3))
    assert t.calls[-1] == "stop" and "steps 1 .. 2" in t.lines[0]
    t = FakeTracer()  # a step raises (a preemption, a lost peer): the trace is written, the error goes on
    with pytest.raises(RuntimeError, match="step failed"):
        run_steps(t.profiler(ProfileWindow(1, 100), 0, tmp_path), t.calls, range(5), fail_at=2)
    assert t.calls[-1] == "stop" and "steps 1 .. 1" in t.lines[0]
    t = FakeTracer()  # the first traced step fails
    with pytest.raises(RuntimeError):
        run_steps(t.profiler(ProfileWindow(2, 4), 0, tmp_path), t.calls, range(5), fail_at=2)
    assert "step 2, which did not finish" in t.lines[0]


def test_a_trace_that_cannot_be_written_is_one_warning_not_an_error(tmp_path):
    t = FakeTracer()
    run_steps(t.profiler(ProfileWindow(0, 1), 0, tmp_path, fail_stop=True), t.calls, range(2))
    assert t.warnings == [f"moejax: --profile: writing the trace to {tmp_path / 'trace'} failed: "
                          "No space left on device"] and not t.lines


def test_a_profiler_that_cannot_start_is_one_warning_and_the_run_goes_on(tmp_path):
    t = FakeTracer()
    with pytest.raises(RuntimeError, match="step failed") as e:  # the step's own error, not chained to the profiler's
        run_steps(t.profiler(ProfileWindow(1, 3), 0, tmp_path, fail_start=True), t.calls, range(4), fail_at=2)
    assert e.value.__context__ is None
    assert [c[1] for c in t.calls if c[0] == "step"] == [0, 1, 2] and "stop" not in t.calls
    assert t.warnings == [f"moejax: --profile: could not start jax's profiler in {tmp_path / 'trace'}: "
                          "Profiler is already running.; training on without a trace"]


def test_no_window_traces_nothing(tmp_path):
    t = FakeTracer()
    run_steps(t.profiler(None, 0, tmp_path), t.calls, range(3))
    assert all(c[0] == "step" and not c[2] for c in t.calls) and not t.lines
    assert not (tmp_path / "trace").exists()


@pytest.mark.parametrize("text, window", [("3:6", ProfileWindow(3, 6)), (" 0:1 ", ProfileWindow(0, 1)),
                                          ("9:500", ProfileWindow(9, 500))])
def test_window_parses(text, window):
    assert parse_window(text, steps=10) == window


@pytest.mark.parametrize("text, words", [("3", "expected START:STOP"), ("6:3", "0 <= START < STOP"),
                                         ("4:4", "expected START:STOP"), ("-1:3", "expected START:STOP"),
                                         ("a:b", "expected START:STOP"), ("", "expected START:STOP"),
                                         ("\u0663:\u0666", "expected START:STOP"),  # Arabic-Indic digits
                                         ("0:" + "9" * 5000, "expected START:STOP"),  # beyond int()'s digit limit
                                         ("10:12", "starts at step 10, but the run has 10 steps (0 .. 9)")])
def test_bad_window_is_a_config_error(text, words):
    with pytest.raises(ConfigError, match="^--profile ") as e:
        parse_window(text, steps=10)
    assert words in str(e.value) and "\n" not in str(e.value)


def write_trace(path, events):
    path.mkdir(parents=True)
    with gzip.open(path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


LANES = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
         {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "/device:GPU:1"}},
         {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]


def test_top_kernels_are_per_gpu_and_step_from_the_newest_trace(tmp_path):
    kernels = [{"ph": "X", "pid": pid, "name": "gemm", "dur": 3000} for pid in (1, 3)]  # one a step on each GPU
    kernels += [{"ph": "X", "pid": pid, "name": "gemm", "dur": 1000} for pid in (1, 3)]
    kernels += [{"ph": "X", "pid": 1, "name": "flash", "dur": 2000},  # one call in 2 steps, on GPU 0 only
                {"ph": "X", "pid": 2, "name": "python", "dur": 9e6}]  # host: not GPU time
    write_trace(tmp_path / "t" / "2026_01_01_00_00_00", LANES + [{"ph": "X", "pid": 1, "name": "stale", "dur": 1e9}])
    write_trace(tmp_path / "t" / "2026_01_01_00_00_01", LANES + kernels)  # the newest trace is read
    lines = top_ops_lines(tmp_path / "t", steps=2)
    assert lines[0].startswith("  GPU time 2.50 ms a step per device (mean of 2,")
    assert lines[1].split() == ["2.000", "ms", "x1", "gemm"] and lines[2].split() == ["0.500", "ms", "x0.25", "flash"]
    assert len(lines) == 3
    total, count = event_totals(tmp_path / "t")  # the bench's totals: every device lane summed
    assert total == {"gemm": 8.0, "flash": 2.0} and count == {"gemm": 4, "flash": 1}


def test_no_kernel_list_without_gpu_lanes_or_for_a_broken_trace(tmp_path):
    write_trace(tmp_path / "cpu" / "t", [LANES[2], {"ph": "X", "pid": 2, "name": "fusion", "dur": 5}])
    assert top_ops_lines(tmp_path / "cpu", steps=1) == []  # XLA:CPU: no device lane, no list
    assert top_ops_lines(tmp_path / "none", steps=1) == []
    t = FakeTracer()  # a truncated trace (EOFError from gzip): one line, the run goes on
    prof = t.profiler(ProfileWindow(0, 1), 0, tmp_path, summarize=True)
    (tmp_path / "trace" / "x").mkdir(parents=True)
    (tmp_path / "trace" / "x" / "h.trace.json.gz").write_bytes(gzip.compress(b'{"traceEvents": [1, 2')[:-8])
    run_steps(prof, t.calls, range(1))
    assert t.lines[-1].startswith("  (its kernel summary could not be read: ")
