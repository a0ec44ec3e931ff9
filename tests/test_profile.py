"""`moejax train --profile START:STOP` (`moejax.train.profile`): which steps the trace holds, across restarts and
failures, and the one-line errors. The CLI's short training run (tests/test_cli.py) checks the trace files."""

import gzip
import json

import pytest

from moejax.config import ConfigError
from moejax.train.profile import ProfileWindow, StepProfiler, parse_window, top_ops_lines


class FakeTracer:
    def __init__(self):
        self.calls, self.lines = [], []

    def profiler(self, window, first_step, tmp_path, fail_stop=False):
        def stop():
            self.calls.append("stop")
            if fail_stop:
                raise OSError("No space left on device\nmore detail")
        return StepProfiler(window, tmp_path / "trace", first_step, say=self.lines.append,
                            start=lambda d: self.calls.append(("start", d)), stop=stop)


def run_steps(prof, calls, steps, fail_at=None):
    """The loop's use: each step inside `prof.step`, `close` in a finally; records which steps ran traced."""
    try:
        for step in steps:
            with prof.step(step):
                calls.append(("step", step, prof.tracing))
                if step == fail_at:
                    raise RuntimeError("step failed")
    finally:
        prof.close()


def test_window_traces_its_steps_only(tmp_path):
    t = FakeTracer()
    run_steps(t.profiler(ProfileWindow(2, 4), 0, tmp_path), t.calls, range(6))
    assert t.calls == [("step", 0, False), ("step", 1, False), ("start", str(tmp_path / "trace")),
                       ("step", 2, True), ("step", 3, True), "stop", ("step", 4, False), ("step", 5, False)]
    assert (tmp_path / "trace").is_dir()
    assert len(t.lines) == 1 and f"profile of steps 2 .. 3 in {tmp_path / 'trace'} (" in t.lines[0]
    lines = []  # a multi-process run's process 0 names every process's directory
    run_steps(StepProfiler(ProfileWindow(0, 1), tmp_path / "p0", 0, say=lines.append, start=lambda d: None,
                           stop=lambda: None, where="run/profile/process_*"), [], range(1))
    assert "profile of steps 0 .. 0 in run/profile/process_* (" in lines[0]


def test_a_restart_inside_the_window_traces_from_its_first_step(tmp_path):
    t = FakeTracer()
    run_steps(t.profiler(ProfileWindow(2, 6), 4, tmp_path), t.calls, range(4, 8))
    assert [c for c in t.calls if not isinstance(c, tuple) or c[0] != "step"] == [("start", str(tmp_path / "trace")), "stop"]
    assert [c[1] for c in t.calls if isinstance(c, tuple) and c[0] == "step" and c[2]] == [4, 5]
    assert "steps 4 .. 5" in t.lines[0]


def test_a_restart_after_the_window_traces_nothing_and_says_so(tmp_path):
    t = FakeTracer()
    run_steps(t.profiler(ProfileWindow(2, 4), 10, tmp_path), t.calls, range(10, 12))
    assert all(c[0] == "step" and not c[2] for c in t.calls)
    assert len(t.lines) == 1 and "resumes at step 10, after the window; nothing traced" in t.lines[0]


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


def test_a_trace_that_cannot_be_written_is_one_line_not_an_error(tmp_path):
    t = FakeTracer()
    run_steps(t.profiler(ProfileWindow(0, 1), 0, tmp_path, fail_stop=True), t.calls, range(2))
    assert t.lines == [f"moejax: --profile: writing the trace to {tmp_path / 'trace'} failed: No space left on device"]


def test_a_profiler_that_cannot_start_is_one_line_and_the_run_goes_on(tmp_path):
    t = FakeTracer()

    def busy(path):
        raise RuntimeError("Profiler is already running.\ndetail")
    prof = StepProfiler(ProfileWindow(1, 3), tmp_path / "trace", 0, say=t.lines.append, start=busy,
                        stop=lambda: t.calls.append("stop"))
    run_steps(prof, t.calls, range(4))
    assert [c[1] for c in t.calls if c[0] == "step"] == [0, 1, 2, 3] and "stop" not in t.calls
    assert t.lines == [f"moejax: --profile: could not start jax's profiler in {tmp_path / 'trace'}: "
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
                                         ("a:b", "expected START:STOP"),
                                         ("10:12", "starts at step 10, but the run has 10 steps (0 .. 9)")])
def test_bad_window_is_a_config_error(text, words):
    with pytest.raises(ConfigError, match="^--profile ") as e:
        parse_window(text, steps=10)
    assert words in str(e.value) and "\n" not in str(e.value)


def write_trace(path, events):
    path.mkdir(parents=True)
    with gzip.open(path / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_top_ops_are_the_device_lanes_longest_per_step(tmp_path):
    lanes = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
             {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    kernels = [{"ph": "X", "pid": 1, "name": "gemm", "dur": 3000}, {"ph": "X", "pid": 1, "name": "gemm", "dur": 1000},
               {"ph": "X", "pid": 1, "name": "flash", "dur": 1000}, {"ph": "X", "pid": 2, "name": "python", "dur": 9e6}]
    write_trace(tmp_path / "old" / "2026_01_01_00_00_00", lanes + [{"ph": "X", "pid": 1, "name": "stale", "dur": 1e9}])
    write_trace(tmp_path / "old" / "2026_01_01_00_00_01", lanes + kernels)  # the newest trace is read
    lines = top_ops_lines(tmp_path / "old", steps=2)
    assert lines[0] == "  device time 2.50 ms a step; the longest ops (ms a step, calls a step):"
    assert lines[1].split() == ["2.000", "ms", "x1", "gemm"] and lines[2].split() == ["0.500", "ms", "x0", "flash"]
    assert len(lines) == 3  # the host lane's events are not device time
    write_trace(tmp_path / "cpu" / "t", [lanes[1], {"ph": "X", "pid": 2, "name": "fusion", "dur": 5}])
    assert top_ops_lines(tmp_path / "cpu", steps=1) == []  # XLA:CPU: no device lane, no list
    assert top_ops_lines(tmp_path / "none", steps=1) == []
