"""A multi-process job's start-up agreement (`moejax.train.job_start`): the processes compare their commands,
the run dir and the data before anything is written, and stop together with one line.

The exchanges run here over an in-memory stand-in for jax's coordination-service key-value store, one thread
per process (the real store, in real processes, is `tests/test_multiprocess.py`'s)."""

import signal
import threading

import pytest

from moejax.preemption import PreemptionSignal
from moejax.train.job_start import JobStart, PeerPreempted, PeerStopped
from moejax.train.run_dir import RunError, RunLock


class KeyValueStore:
    """The two calls JobStart makes of jax's DistributedRuntimeClient, with its semantics: a key is written
    once (ALREADY_EXISTS after), a directory read lists the keys under a prefix."""

    def __init__(self):
        self._kv, self._lock = {}, threading.Lock()

    def key_value_set(self, key: str, value: str) -> None:
        with self._lock:
            if key in self._kv:
                raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
            self._kv[key] = value

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        with self._lock:
            return [(k, v) for k, v in self._kv.items() if k.startswith(prefix)]


def _job(fns, timeout_s=20.0):
    """Run fns[i](JobStart of process i) on a thread each, over one store; each one's result or exception."""
    store, out = KeyValueStore(), [None] * len(fns)

    def run(i):
        start = JobStart(timeout_s, client=store, index=i, count=len(fns), start=0)
        try:
            out[i] = fns[i](start)
        except BaseException as e:  # noqa: BLE001 -- the test compares what each process raised
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a process is still waiting"
    return out


CONFIG = {"train": {"seed": 0, "steps": 10}, "model": {"d_model": 64}}
OPTIONS = {"overwrite": False, "init_from": ""}


def _command(config=CONFIG, options=OPTIONS, run_dir="run"):
    def fn(start):
        start.same_command(run_dir, config, options)
        return start.token
    return fn


def test_the_same_command_everywhere_agrees_on_process_0s_token():
    tokens = _job([_command()] * 3)
    assert all(isinstance(t, str) for t in tokens), tokens
    assert len(set(tokens)) == 1  # each process made its own; process 0's is the job's


@pytest.mark.parametrize("config, options, words", [
    ({**CONFIG, "train": {"seed": 7, "steps": 10}}, OPTIONS, "train.seed is 0 on process 0, 7 on process 2"),
    ({**CONFIG, "model": {"d_model": 64, "extra": 1}}, OPTIONS, "model.extra is '<missing>' on process 0, 1 on "
                                                                "process 2"),
    (CONFIG, {**OPTIONS, "overwrite": True}, "--overwrite is False on process 0, True on process 2"),
    (CONFIG, {**OPTIONS, "init_from": "x"}, "--init-from is '' on process 0, 'x' on process 2"),
])
def test_another_command_on_one_process_stops_every_process_with_the_same_line(config, options, words):
    out = _job([_command(), _command(), _command(config, options)])
    assert all(isinstance(e, RunError) for e in out), out
    assert len({str(e) for e in out}) == 1
    assert str(out[0]) == (f"process 2 was not started with process 0's command: {words}; start every process "
                           "of the job with the same command")


def _locked_start(run_dirs, lock_token=None):
    """Each process agrees on the command, process 0 locks its run dir (with `lock_token`, default the job's),
    then all check they see it."""
    def fn_of(i):
        def fn(start):
            start.same_command(run_dirs[i], CONFIG, OPTIONS)
            lock = RunLock(run_dirs[i]).acquire(job=lock_token or start.token) if start.index == 0 else None
            try:
                start.same_run_dir(run_dirs[i])
                return "ok"
            finally:
                if lock is not None:
                    lock.release()
        return fn
    return _job([fn_of(i) for i in range(len(run_dirs))])


def test_processes_that_see_the_run_dir_process_0_locked_go_on(tmp_path):
    assert _locked_start([tmp_path / "run"] * 3) == ["ok"] * 3


def test_a_process_in_another_run_dir_stops_every_process(tmp_path):
    """Another --run-dir (or the same path on a host's own disk): it would have trained, then hung at the first
    checkpoint's commit."""
    out = _locked_start([tmp_path / "run", tmp_path / "run", tmp_path / "elsewhere"])
    assert all(isinstance(e, RunError) for e in out), out
    assert len({str(e) for e in out}) == 1
    assert str(out[0]).startswith(f"process 2 does not see the run dir process 0 locked: --run-dir is "
                                  f"{tmp_path / 'run'} on process 0 (host ")
    assert f"and {tmp_path / 'elsewhere'} on process 2 (host " in str(out[0])
    assert not (tmp_path / "elsewhere").exists()  # only read: nothing created there


def test_a_lock_of_another_job_in_the_same_dir_is_not_this_jobs(tmp_path):
    out = _locked_start([tmp_path / "run"] * 2, lock_token="another-job")
    assert all(isinstance(e, RunError) and "process 0 does not see the run dir" in str(e) for e in out), out


def test_a_process_that_stops_while_starting_stops_the_others_with_its_line(tmp_path):
    """Process 0 refused a locked run dir: its peers used to wait in the first collective, then exit 75,
    which a launcher requeues forever. Now every process ends with exit 2 and process 0's line."""
    run = tmp_path / "run"
    holder = RunLock(run).acquire()  # another trainer

    def fn(start):
        with start.failures_published():
            start.same_command(run, CONFIG, OPTIONS)
            if start.index == 0:
                RunLock(run).acquire(job=start.token)
            start.same_run_dir(run)

    try:
        out = _job([fn] * 3)
    finally:
        holder.release()
    assert type(out[0]) is RunError and str(out[0]).startswith(f"run dir {run} is in use by PID ")
    for e in out[1:]:
        assert isinstance(e, PeerStopped) and isinstance(e, RunError)  # exit 2: not requeued
        assert str(e) == f"process 0 stopped while the job started: {out[0]}"


def test_a_process_preempted_while_starting_ends_the_others_as_preempted():
    """A signal on process 1 while it waits: its peers stop at once as preempted (exit 75, requeued), not after
    the timeout."""
    def fn(start):
        with start.failures_published():
            start.same_command("run", CONFIG, OPTIONS)
            if start.index == 1:
                raise PreemptionSignal(signal.SIGTERM)  # what PreemptionGuard's handler raises in the wait
            start.from_primary("resuming", True)
            start.exchange("never", None)

    out = _job([fn] * 3, timeout_s=30.0)
    assert isinstance(out[1], PreemptionSignal)
    for i in (0, 2):
        assert isinstance(out[i], PeerPreempted), out
        assert str(out[i]) == "process 1 was preempted (SIGTERM) while the job started"


def test_a_process_that_never_comes_is_named_after_the_timeout(capsys):
    def fn(start):
        if start.index == 2:
            return "gone"
        start.same_command("run", CONFIG, OPTIONS)

    out = _job([fn] * 3, timeout_s=0.5)
    assert out[2] == "gone"
    for e in out[:2]:
        assert isinstance(e, RunError) and str(e) == ("process 2 did not reach the start-up's 'command' step "
                                                      "within 0.5s (--dist-timeout); is every process running the "
                                                      "same command?"), out


def test_processes_take_process_0s_answer_and_compare_their_data():
    def fn(start):
        resuming = start.from_primary("resuming", start.index == 0)  # only process 0 reads the run dir
        start.same_data("abc")
        return resuming

    assert _job([fn] * 3) == [True, True, True]

    def other_data(start):
        start.same_data("abc" if start.index != 1 else "def")

    out = _job([other_data] * 3)
    assert all(isinstance(e, RunError) for e in out)
    assert str(out[2]) == ("process 1's data store holds other tokens than process 0's (identity def… vs abc…); "
                           "give every process the same data.store")


def test_one_process_exchanges_nothing(tmp_path):
    start = JobStart(1.0)  # this suite runs one process: no client is looked up
    start.same_command(tmp_path / "run", CONFIG, OPTIONS)
    start.same_run_dir(tmp_path / "run")  # no lock file needed: nobody else to see it
    assert start.exchange("x", 1) == [1] and start.from_primary("y", 2) == 2
    start.same_data("abc")


def test_a_job_token_that_cant_be_written_fails_the_lock_and_frees_it(tmp_path, monkeypatch):
    """The peers must read the token in `.lock`: a full disk there is a one-line error, not "does not see the
    run dir" on every process. A lone run still goes on without the holder's name (it only informs)."""
    import errno

    from moejax.train import run_dir as run_dir_module

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_dir_module.os, "pwrite", full)
    with pytest.raises(RunError, match=r"^cannot write to run dir .*: No space left on device \(.*\.lock\)$"):
        RunLock(tmp_path / "run").acquire(job="abc")
    assert not (tmp_path / "run").exists()  # released, and the dir it made removed
    RunLock(tmp_path / "run").acquire().release()
