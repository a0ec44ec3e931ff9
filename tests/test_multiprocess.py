"""Multi-controller launch: 2 processes x 4 CPU devices on 127.0.0.1 give the same loss trace as one
process with 8 devices (same mesh data=2, expert=4; each process feeds only its own batch rows)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import subprocess_xla_flags

ARGS = ["train", "--preset", "tiny", "--steps", "3", "--no-progress", "--peak-flops", "1e11",
        "--mesh", "data=2,expert=4", "--set", "model.n_layers=1", "--set", "train.batch_size=8",
        "--set", "train.seq_len=32", "--set", "train.eval_every=0", "--set", "train.eval_batches=1",
        "--set", "train.optimizer=adam"]
TRACE_RTOL = 1e-5  # gloo all-reduces may sum in another order than the in-process CPU collectives


def _env():
    """The suite's compile flags (LLVM -O0, loop emitters) without its forced device count: each CLI process
    forces as many host devices as its share of the mesh. (At -O0 with the MLIR fusion emitters the traces once
    differed by 1.27e-5; with the loop emitters they agree to ~1e-7, as at XLA's default -O2, which compiles
    three times slower: docs/LOG.md 2026-12-02, ninth session.)"""
    return {**os.environ, "WANDB_MODE": "disabled", "XLA_FLAGS": subprocess_xla_flags()}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir):
    """The train loss of every step, then the end's eval losses (capacity path, and dropless on the local path:
    each process feeds its own eval rows)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows] + [rows[-1]["eval/loss"], rows[-1]["eval_dropless/loss"]]


def _pair(run_dir, *extra):
    """The two commands of one 2-process run on a fresh local port."""
    port = _free_port()
    return [[*ARGS, *extra, "--run-dir", str(run_dir), "--coordinator", f"127.0.0.1:{port}", "--num-processes",
             "2", "--process-id", str(i), "--dist-timeout", "120"] for i in range(2)]


def _start(cmds, envs=None):
    """Start each command as `moejax` with the suite's environment plus its own (`envs`: one dict each)."""
    envs = envs or [{}] * len(cmds)
    return [subprocess.Popen([sys.executable, "-m", "moejax.cli", *args], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env={**_env(), **env})
            for args, env in zip(cmds, envs)]


def test_two_processes_match_one_process(tmp_path):
    """The one-process reference runs alongside the two processes (the three are compile-bound)."""
    procs = _start([[*ARGS, "--run-dir", str(tmp_path / "one")], *_pair(tmp_path / "two")])
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=TRACE_RTOL)


def test_one_process_signalled_both_save_and_resume_to_the_same_trace(tmp_path):
    """SIGTERM to process 1 alone after step 1: the OR-reduced stop flag makes both save step 1 and exit 75; the
    same two commands resume to the one-process trace, each step logged once. The resumed process 1 is signalled
    again in the last step: the run has finished, so it ends as usual (final checkpoint, summary, exit 0), not 75
    with nothing a rerun could resume (it would stop at "no summary.json"). The reference runs alongside."""
    from moejax.checkpoint import list_checkpoints
    from moejax.preemption import EXIT_PREEMPTED

    run = tmp_path / "two"
    two = _pair(run)

    def launch(cmds, envs):
        procs = _start(cmds, envs)
        errs = [p.communicate(timeout=600)[1] for p in procs]
        return [(p.returncode, err) for p, err in zip(procs, errs)]

    signal_after = lambda step: {"MOEJAX_FAULT_SIGTERM_AT_STEP": str(step)}
    ref, *first = launch([[*ARGS, "--run-dir", str(tmp_path / "one")], *two], [{}, {}, signal_after(1)])
    assert ref[0] == 0, ref[1][-3000:]
    for rc, err in first:
        assert rc == EXIT_PREEMPTED, err[-3000:]
        assert f"moejax: preempted after step 1; checkpoint saved in {run}" in err and "Traceback" not in err
    assert [(c.step, c.complete) for c in list_checkpoints(run)] == [(1, True)]
    assert json.loads((list_checkpoints(run)[0].path / "metadata.json").read_text())["kind"] == "temporary"

    second = launch(two, [{}, signal_after(3)])
    for rc, err in second:
        assert rc == 0, err[-3000:]
    assert f"moejax: resuming {run} at step 1 of 3" in second[0][1]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    np.testing.assert_allclose(_losses(run), _losses(tmp_path / "one"), rtol=TRACE_RTOL)
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert [(c.step, c.complete) for c in list_checkpoints(run)] == [(3, True)]  # the temporary one superseded


@pytest.mark.parametrize("save", [1, 3])
def test_a_killed_process_ends_the_other_at_once_in_one_line_with_75(save, tmp_path):
    """kill -9 of process 1 just after it issued step `save`'s checkpoint (1: mid-run, a step follows; 3: the
    final one, no step follows), while process 0's part of the save waits for the dead peer. Process 0 exits 75
    (a launcher requeues; the same commands resume) with one line, in ~10 s: not after orbax's barrier (~90 s)
    and jax's heartbeat timeout (100 s), with a "checkpoint save failed" line and a C++ abort."""
    import time

    from moejax.preemption import EXIT_PREEMPTED

    procs = _start(_pair(tmp_path / "run", "--set", "train.checkpoint_every=1"),
                   [{}, {"MOEJAX_FAULT_KILL": f"saving:{save}"}])
    procs[1].communicate(timeout=600)
    killed = time.monotonic()
    err = procs[0].communicate(timeout=600)[1]
    assert procs[1].returncode == -9
    assert procs[0].returncode == EXIT_PREEMPTED, err[-3000:]
    assert time.monotonic() - killed < 50, "process 0 outlived its peer by jax's heartbeat timeout"
    last = err.strip().splitlines()[-1]
    assert last.startswith("moejax: error: process 0 of 2: a collective failed, another process is gone (")
    assert "Traceback" not in err and "checkpoint save failed" not in err


def _held(run_dir):
    """Another trainer's lock on `run_dir`, held for the test (a process of its own: flock is per open file)."""
    run_dir.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import fcntl, os, sys
fd = os.open({str(run_dir / ".lock")!r}, os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, b"PID 1 on host elsewhere")
print("held", flush=True)
sys.stdin.read()
"""], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


@pytest.mark.parametrize("case", ["seed", "run_dir", "locked"])
def test_processes_started_apart_stop_together_in_one_line(case, tmp_path):
    """Processes with different seeds failed in a 51-line jax assertion; with different run dirs (or a second
    job on the first one's coordinator port) they trained, then hung at the first checkpoint; on a run dir
    another job held, process 0 stopped and process 1 exited 75 after ~30 s, which a launcher requeues forever.
    Now each process ends at start-up, exit 2, with the same line (`job_start`), and nothing is written."""
    run = tmp_path / "run"
    cmds = _pair(run)
    holder = None
    if case == "seed":
        cmds[1] += ["--set", "train.seed=7"]
        want = ("process 1 was not started with process 0's command: train.seed is 0 on process 0, 7 on process 1; "
                "start every process of the job with the same command")
    elif case == "run_dir":
        cmds[1][cmds[1].index("--run-dir") + 1] = str(tmp_path / "other")
        want = f"process 1 does not see the run dir process 0 locked: --run-dir is {run} on process 0 (host "
    else:
        holder = _held(run)
        want = f"run dir {run} is in use by PID 1 on host elsewhere"
    try:
        procs = _start(cmds)
        errs = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        if holder is not None:
            holder.communicate("")
    lasts = [err.strip().splitlines()[-1] for err in errs]
    assert [p.returncode for p in procs] == [2, 2], errs
    assert lasts[0].startswith(f"moejax: error: {want}"), lasts
    peer_says = "process 0 stopped while the job started: " if case == "locked" else ""
    assert lasts[1] == lasts[0].replace("moejax: error: ", f"moejax: error: {peer_says}"), lasts
    assert "Traceback" not in errs[0] + errs[1]
    assert [p.name for p in tmp_path.iterdir()] == (["run"] if case == "locked" else [])  # the holder's dir
    assert not (run / "config.json").exists()


def test_a_lost_peer_is_recognised_however_jax_raises_it(monkeypatch):
    """A peer killed while the final checkpoint committed reached the survivor as a plain ValueError from
    multihost_utils' gloo allgather (the commit vote), which `lost_peer` didn't recognise: a traceback, then a
    100 s hang and a C++ abort instead of exit 75 in one line (found by a fuzzer, docs/LOG.md thirty-fifth
    session). Also under a cleanup's error; other errors are not a lost peer."""
    import jax

    from moejax.checkpoint import lost_peer

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    gloo = ValueError("UNKNOWN: Gloo AllGather failed: [external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
                      "[127.0.0.1]:33711: Connection reset by peer")
    assert "another process is gone (UNKNOWN: Gloo AllGather failed" in lost_peer(gloo)
    cleanup = RuntimeError("close failed")
    cleanup.__context__ = gloo
    assert lost_peer(cleanup) is not None
    assert lost_peer(ValueError("bad shape")) is None and lost_peer(OSError("Connection reset by peer")) is None


def test_a_process_signalled_while_starting_ends_both_with_75(tmp_path):
    """SIGTERM to process 1 during set-up: it exits 75 at once (nothing to save); process 0's set-up collective
    then times out (gloo: 30 s) and it exits 75 too, in one line, having let its peer through jax's shutdown
    barrier (a quick exit of process 0, the coordinator's host, had aborted process 1: rc 134)."""
    from moejax.preemption import EXIT_PREEMPTED

    procs = _start(_pair(tmp_path / "run"), [{}, {"MOEJAX_FAULT_SIGTERM_BEFORE_STEP": "1"}])
    errs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [EXIT_PREEMPTED, EXIT_PREEMPTED], errs
    assert errs[0].strip().splitlines()[-1].startswith("moejax: error: process 0 of 2: a collective failed")
    assert errs[1].strip().splitlines()[-1].startswith("moejax: preempted (SIGTERM) before the first step")
    assert "Traceback" not in errs[0] + errs[1]


def test_unreachable_coordinator_is_a_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moejax.cli", *ARGS, "--run-dir", str(tmp_path / "x"),
                        "--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2", "--process-id", "1",
                        "--dist-timeout", "5"], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("moejax: error: coordinator 127.0.0.1:") and "did not answer within 5s" in lines[-1]
    waiting = [ln for ln in lines if ln.startswith("moejax: waiting for the coordinator at 127.0.0.1:")]
    assert waiting and "Connection refused" in waiting[0], lines  # said while waiting, not only at the end
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


def test_a_peer_that_never_joins_ends_in_one_line_naming_it(tmp_path):
    """Process 0 of 2 alone: a waiting line, then exit 2 with one line (not an XLA abort, rc 134)."""
    port = _free_port()
    r = subprocess.run([sys.executable, "-m", "moejax.cli", *ARGS, "--run-dir", str(tmp_path / "x"),
                        "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0",
                        "--dist-timeout", "6"], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert any(ln.startswith(f"moejax: waiting for all processes to join the coordinator at 127.0.0.1:{port}")
               for ln in lines), lines
    assert lines[-1].startswith("moejax: error: distributed start-up timed out after 6s: process 1 never joined "
                                f"the coordinator this process (0 of 2) hosts at 127.0.0.1:{port}")
    assert not (tmp_path / "x").exists()


def test_launcher_environment_fills_unset_flags(monkeypatch):
    from moejax.cli import _distributed_from_env, build_parser

    args = build_parser().parse_args(["train", "--run-dir", "x"])
    monkeypatch.setenv("SLURM_PROCID", "3")
    _distributed_from_env(args)
    assert args.coordinator is None and args.process_id is None  # no coordinator named: stays single-process
    monkeypatch.setenv("MASTER_ADDR", "node0")
    monkeypatch.setenv("MASTER_PORT", "8476")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    _distributed_from_env(args)
    assert (args.coordinator, args.num_processes, args.process_id) == ("node0:8476", 4, 3)
    args = build_parser().parse_args(["train", "--run-dir", "x", "--process-id", "1"])
    _distributed_from_env(args)
    assert args.process_id == 1  # flags win


def test_sigterm_while_waiting_for_the_coordinator_exits_75(tmp_path):
    """A job preempted while its hosts start up is requeued (75), not counted as killed (143)."""
    import signal

    p = subprocess.Popen([sys.executable, "-m", "moejax.cli", *ARGS, "--run-dir", str(tmp_path / "x"),
                          "--coordinator", f"127.0.0.1:{_free_port()}", "--num-processes", "2", "--process-id", "1",
                          "--dist-timeout", "120"], stderr=subprocess.PIPE, text=True, env=_env())
    first = p.stderr.readline()  # the first "waiting for the coordinator" line: it is inside the wait now
    assert first.startswith("moejax: waiting for the coordinator at 127.0.0.1:"), first
    p.send_signal(signal.SIGTERM)
    err = p.communicate(timeout=60)[1]
    assert p.returncode == 75, err[-2000:]
    assert "moejax: preempted (SIGTERM) while starting; nothing to save" in err and "Traceback" not in err


def test_process_0_refuses_a_port_another_coordinator_answers_on(tmp_path):
    """gRPC binds with SO_REUSEPORT, so a second job's process 0 on a live coordinator's port started a second
    coordinator and waited out --dist-timeout while the jobs' processes joined either one. Now it stops at once."""
    with socket.socket() as live:  # a listener as gRPC opens one
        live.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        live.bind(("127.0.0.1", 0))
        live.listen()
        port = live.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "moejax.cli", *ARGS, "--run-dir", str(tmp_path / "x"),
                            "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0",
                            "--dist-timeout", "60"], capture_output=True, text=True, env=_env(), timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (f"moejax: error: --coordinator 127.0.0.1:{port}: something already "
                                                 "answers on that port (another job's coordinator?); give this job "
                                                 "a free port")
    assert not (tmp_path / "x").exists()


PEER_THAT_JOINS_AND_STOPS = """
import sys, time
import jax
jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=1)
jax.devices()  # the job's device exchange: process 0's backend waits for it
print("joined", flush=True)
time.sleep(600)
"""


def test_a_peer_lost_during_the_start_up_agreement_ends_process_0_in_bounded_time(tmp_path):
    """Process 1 joins the job, then dies (kill -9) before the agreement: process 0 names it after --dist-timeout
    and leaves. It used to wait in jax's shutdown barrier for jax's 100 s heartbeat, then abort (rc -6) with a
    C++ stack trace (found by a fuzzer, docs/LOG.md thirty-sixth session)."""
    import time

    port = _free_port()
    p0 = subprocess.Popen([sys.executable, "-m", "moejax.cli", *ARGS, "--run-dir", str(tmp_path / "x"),
                           "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0",
                           "--dist-timeout", "8"], stderr=subprocess.PIPE, text=True, env=_env())
    p1 = subprocess.Popen([sys.executable, "-c", PEER_THAT_JOINS_AND_STOPS, f"127.0.0.1:{port}"],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          env={**_env(), "JAX_PLATFORMS": "cpu",
                               "XLA_FLAGS": f"{_env()['XLA_FLAGS']} --xla_force_host_platform_device_count=4"})
    try:
        assert p1.stdout.readline() == "joined\n"
    finally:
        p1.kill()
    lost = time.monotonic()
    err = p0.communicate(timeout=120)[1]
    assert p0.returncode == 2, err[-2000:]
    assert time.monotonic() - lost < 40, "process 0 waited for jax's heartbeat"
    assert err.strip().splitlines()[-1] == ("moejax: error: process 1 did not reach the start-up's 'command' step "
                                            "within 8s (--dist-timeout); is every process running the same command?")
    assert "Traceback" not in err and "Check failure" not in err


def test_sigterm_while_the_job_forms_ends_process_0_in_bounded_time(tmp_path):
    """SIGTERM to process 0 while it waits in jax.distributed's start-up, process 1 joining after it: process 0
    printed its preempted line and then hung in jax's shutdown barrier, waiting for a process 1 that was itself
    stuck in the device exchange waiting for process 0 (found by a fuzzer, docs/LOG.md thirty-sixth session). Now
    process 0 exits 75 within the shutdown grace, and process 1 ends once it is gone."""
    import signal
    import time

    port = _free_port()
    cmds = [[*ARGS, "--run-dir", str(tmp_path / "x"), "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", str(i), "--dist-timeout", "9"] for i in range(2)]
    p0 = subprocess.Popen([sys.executable, "-m", "moejax.cli", *cmds[0]], stderr=subprocess.PIPE, text=True,
                          env=_env())
    line = p0.stderr.readline()  # every 3 s while it waits for process 1 inside jax.distributed.initialize
    assert line.startswith("moejax: waiting for all processes to join the coordinator"), line
    p0.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    p1 = subprocess.Popen([sys.executable, "-m", "moejax.cli", *cmds[1]], stderr=subprocess.PIPE, text=True,
                          env=_env())
    err0 = p0.communicate(timeout=120)[1]
    assert p0.returncode == 75, err0[-2000:]
    assert time.monotonic() - signalled < 40, "process 0 stayed in jax's shutdown barrier"
    assert "moejax: preempted (SIGTERM) while starting" in err0 and "Traceback" not in err0
    p1.communicate(timeout=120)  # it ends (with jax's abort when its coordinator went away mid-exchange)
    assert not (tmp_path / "x").exists()
