"""Crashes and bad luck through the real CLI, on a 2-layer tiny model: no NaN checkpoint, SIGTERM before the
first step exits 75 and one in or after the last step lets the run finish, a full disk while checkpointing is
one line at once, a finished run killed before its summary is rebuilt and can be extended,
and three kills (mid-save, mid-metrics-write, mid-step) resume to the uninterrupted run's exact trace.

Every run shares one persistent XLA compilation cache and, where it can, one config (plain Adam, whose step
compiles faster than the hero optimizer's, and 8 steps: the schedule's length is a constant of the
compiled step), so three compilations serve every run here."""

import json
import os
import re
import subprocess
import sys

import pytest

from moejax.checkpoint import list_checkpoints
from moejax.preemption import EXIT_PREEMPTED
from tests.helpers import bench_module

SMALL = ["--preset", "tiny", "--no-progress", "--peak-flops", "1e11", "--wandb", "disabled",
         "--set", "model.n_layers=2", "--set", "train.batch_size=4", "--set", "train.seq_len=32",
         "--set", "train.eval_every=0", "--set", "train.eval_batches=0",
         "--set", "train.temp_checkpoint_minutes=100000", "--set", "train.optimizer=adam"]
ADAM = ["--set", "train.optimizer=adam"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla-cache")


ENTRY = "import sys; from moejax.entry import main; sys.argv = ['moejax', *sys.argv[1:]]; sys.exit(main())"


def train(cache, run_dir, *args, fault_env=None, fsize_kib=None, command=False):
    """`python -m moejax.cli train ...`; `command`: as the `moejax` console script (`moejax.entry`) runs it."""
    env = bench_module("fault_injection").env(cache)
    env.update(fault_env or {})
    cli = ["-c", ENTRY] if command else ["-m", "moejax.cli"]
    cmd = [sys.executable, *cli, "train", "--run-dir", str(run_dir), *SMALL, *args]
    if fsize_kib:  # RLIMIT_FSIZE via the shell (no preexec_fn: forking this multithreaded process is unsafe)
        cmd = ["bash", "-c", f'ulimit -f {fsize_kib} && exec "$@"', "bash", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)


def _steps(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_three_kills_resume_to_the_exact_uninterrupted_run(tmp_path, cache):
    bench = bench_module("fault_injection")
    (tmp_path / "xla-cache").symlink_to(cache)
    faults = [("save", "save:4"), ("metrics", "metrics:5"), ("step", "step:6")]  # 8 steps, a checkpoint every 2
    res = bench.run_campaign(tmp_path, n_kills=3, steps=8, every=2, faults=faults, log=lambda s: None, extra=ADAM)
    assert res["kills"] == 3 and res["attempts"] == 4, res["log"]  # every fault hit, then one clean resume
    assert res["steps_logged_once_in_order"] and res["duplicate_steps"] == 0
    assert res["trace_bitwise_equal"] and res["states_bitwise_equal"]
    assert res["checkpoints_faulted"] == [2, 4, 6, 8] and res["no_checkpoint_lost"], res


def test_finished_run_killed_before_its_summary_then_extended(tmp_path, cache):
    """A kill after the final checkpoint but before summary.json (a node lost at the very end): the requeued
    command rebuilds the summary from metrics.jsonl and exits 0; without the last step's row it can't, and
    says so in one line. A larger --steps then extends the run."""
    run = tmp_path / "run"
    r = train(cache, run, "--steps", "5", "--set", "train.checkpoint_every=2",
              fault_env={"MOEJAX_FAULT_KILL": "summary:5"})
    assert r.returncode == -9, r.stderr[-2000:]
    assert not (run / "summary.json").exists()
    assert [c.step for c in list_checkpoints(run) if c.complete] == [2, 4, 5]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    r = train(cache, run, "--steps", "5", "--set", "train.checkpoint_every=2")
    assert r.returncode == 0 and r.stderr == f"moejax: {run / 'summary.json'} was missing; rebuilt from metrics.jsonl\n"
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["first_loss"], summary["last_loss"]) == (5, rows[0]["train/loss"],
                                                                                rows[-1]["train/loss"])
    assert summary["wall_seconds"] == rows[-1]["time/wall_seconds"]

    (run / "summary.json").unlink()  # and the last step's row torn off: nothing to rebuild from
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:-1]))
    r = train(cache, run, "--steps", "5", "--set", "train.checkpoint_every=2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no summary.json in" in r.stderr, r.stderr[-2000:]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    final = run / "checkpoints" / "step_00000005"
    inode = final.stat().st_ino
    r = train(cache, run, "--steps", "8", "--set", "train.checkpoint_every=2")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "extending" in r.stderr and "from 5 to 8 steps" in r.stderr and f"resuming {run} at step 5 of 8" in r.stderr
    assert _steps(run) == list(range(8))
    assert final.stat().st_ino == inode  # the rerun of the finished run did not rewrite its final checkpoint
    assert [c.step for c in list_checkpoints(run) if c.complete] == [2, 4, 5, 6, 8]


def test_sigterm_before_the_first_step_exits_75(tmp_path, cache):
    run = tmp_path / "run"
    r = train(cache, run, "--steps", "8", fault_env={"MOEJAX_FAULT_SIGTERM_BEFORE_STEP": "1"})
    assert r.returncode == EXIT_PREEMPTED, r.stderr[-2000:]
    assert "preempted (SIGTERM) before the first step; nothing new to save" in r.stderr
    assert list_checkpoints(run) == [] and not (run / ".lock").exists()


def test_sigterm_while_the_command_imports_jax_exits_75(tmp_path, cache):
    """The `moejax` command's import of the CLI (jax, ~1 s) came before any handler: a SIGTERM there exited 143,
    which a launcher that requeues on 75 would not requeue (found by a fuzzer, docs/LOG.md thirty-fifth session)."""
    env = {**bench_module("fault_injection").env(cache), "MOEJAX_FAULT_SIGTERM_AT_IMPORT": "1"}
    r = subprocess.run([sys.executable, "-c", ENTRY, "train", "--run-dir", str(tmp_path / "run"), *SMALL],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == EXIT_PREEMPTED, (r.returncode, r.stderr[-2000:])
    assert r.stderr.strip() == "moejax: preempted (SIGTERM) while starting; nothing to save; run the same command again"
    assert not (tmp_path / "run").exists()


def test_sigterm_that_an_extension_import_reraises_is_still_a_preemption(tmp_path, monkeypatch, capsys):
    """A SIGTERM landing inside `import tensorstore` (reached through the CLI's `moejax.checkpoint` import) came out
    as that import's ImportError: a traceback and exit 1, not 75 (found by a fuzzer, docs/LOG.md thirty-sixth
    session). Whatever the handler's exception turned into, a signal while starting is a preemption."""
    import signal

    from moejax import cli

    def import_interrupted(args):
        try:
            cli._raise_preempted(signal.SIGTERM, None)  # what the handler does when the signal lands
        except cli._PreemptedWhileStarting:
            raise ImportError("initialization failed") from None  # what the extension module made of it

    monkeypatch.setattr(cli, "_preempted_by", None)
    monkeypatch.setattr(cli, "_cmd_train", import_interrupted)
    assert cli.main(["train", "--run-dir", str(tmp_path / "run")]) == EXIT_PREEMPTED
    assert capsys.readouterr().err.strip() == ("moejax: preempted (SIGTERM) while starting; nothing to save; run the "
                                               "same command again")
    monkeypatch.setattr(cli, "_preempted_by", None)
    monkeypatch.setattr(cli, "_cmd_train", lambda args: (_ for _ in ()).throw(ImportError("a real one")))
    with pytest.raises(ImportError, match="a real one"):  # without a signal, an error is not a preemption
        cli.main(["train", "--run-dir", str(tmp_path / "run")])


def test_sigterm_in_the_last_step_or_after_it_lets_the_run_finish(tmp_path, cache):
    """The run's work is done: a SIGTERM in the last step, or while the final checkpoint commits, ends it as
    usual (final checkpoint, summary, exit 0). It used to exit 75 with no summary, which no rerun could finish
    ("no summary.json"), or to abandon the final checkpoint half-written."""
    for name, env in [("last", {"MOEJAX_FAULT_SIGTERM_AT_STEP": "5"}), ("end", {"MOEJAX_FAULT_SIGTERM_AT_END": "1"})]:
        run = tmp_path / name
        r = train(cache, run, "--steps", "5", fault_env=env)
        assert r.returncode == 0 and "preempted" not in r.stderr, (name, r.stderr[-2000:])
        assert json.loads((run / "summary.json").read_text())["steps"] == 5
        assert [(c.step, c.complete) for c in list_checkpoints(run)] == [(5, True)]
        assert train(cache, run, "--steps", "5").returncode == 0


def test_full_disk_while_checkpointing_is_one_line(tmp_path, cache):
    run = tmp_path / "run"
    # RLIMIT_FSIZE: writes past 2 MB fail with EFBIG, like a full disk: the checkpoint's arrays (~5 MB) fail,
    # small files (config, metrics) and the compilation cache (< 1 MB per entry) do not.
    r = train(cache, run, "--steps", "8", "--set", "train.checkpoint_every=2", fsize_kib=2048)
    assert r.returncode == 2, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, f"{len(lines)} lines: {r.stderr[-3000:]}"
    assert lines[0].startswith("moejax: error: checkpoint save failed") and "File too large" in lines[0]
    # Stopped early: by the next save at the latest. That the next step's poll reports it, without
    # waiting for a save, is tested in test_checkpoint (the failure's latency here depends on the load).
    assert max(_steps(run)) <= 3
    assert [c.step for c in list_checkpoints(run) if c.complete] == []


def test_a_truncated_checkpoint_is_one_warning_and_the_run_resumes_before_it(tmp_path, cache):
    """A data file cut short behind an intact COMMITTED marker (a copy or a disk that lost its tail): the
    resume falls back to the checkpoint before it with one `moejax: warning:` line naming the array and why,
    where it printed ~30 asyncio tracebacks and tensorstore specs (docs/LOG.md, thirty-seventh session)."""
    run = tmp_path / "run"
    r = train(cache, run, "--steps", "8", "--set", "train.checkpoint_every=2", fault_env={"MOEJAX_FAULT_KILL": "step:6"})
    assert r.returncode == -9 and [c.step for c in list_checkpoints(run) if c.complete] == [2, 4], r.stderr[-2000:]
    data = (run / "checkpoints" / "step_00000004" / "state").glob("ocdbt.process_*/d/*")
    big = max(data, key=lambda f: f.stat().st_size)
    os.truncate(big, big.stat().st_size // 2)
    r = train(cache, run, "--steps", "8", "--set", "train.checkpoint_every=2", command=True)
    assert r.returncode == 0, r.stderr[-3000:]
    warning, resuming = r.stderr.splitlines()  # and nothing else
    assert warning.startswith("moejax: warning: checkpoint unusable, falling back to an older one: ")
    assert "step_00000004: restore failed" in warning and "OUT_OF_RANGE" in warning and " ... " not in warning
    assert resuming == f"moejax: resuming {run} at step 2 of 8"
    assert _steps(run) == list(range(8))  # the rows of steps 2-5 that the resume redid are written once


def test_nan_weights_are_never_committed(tmp_path, cache):
    run = tmp_path / "run"
    r = train(cache, run, "--steps", "8", "--set", "train.learning_rate=1e30",
              "--set", "train.checkpoint_every=1", "--set", "train.warmup_fraction=0")
    assert r.returncode == 2, r.stderr[-2000:]
    assert re.search(r"non-finite train/(update|param)_norm \((inf|nan)\) at step 0", r.stderr), r.stderr[-2000:]
    assert "nothing of this step was saved" in r.stderr
    assert [c.step for c in list_checkpoints(run) if c.complete] == []
    assert (run / "nonfinite.json").exists() and not (run / "metrics.jsonl").read_text()


def test_a_kill_in_the_last_steps_evaluation_loses_no_step(tmp_path, cache):
    """The final checkpoint is saved before the last step's evaluation (the hero's is 4 batches of 704 sequences
    on both MoE paths, longer than some preemption notices): a kill in that evaluation, its checkpoint committed,
    leaves no last row and no summary. The same command evaluates the checkpoint and writes the row (its training
    part from the checkpoint's metadata) and the summary: the uninterrupted run's values, timings aside."""
    args = ["--steps", "5", "--set", "train.eval_batches=1", "--set", "train.checkpoint_every=2"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert train(cache, straight, *args).returncode == 0
    r = train(cache, cut, *args, fault_env={"MOEJAX_FAULT_KILL": "final_eval:5"})
    assert r.returncode == -9, r.stderr[-2000:]
    assert [c.step for c in list_checkpoints(cut) if c.complete] == [2, 4, 5]
    assert _steps(cut) == [0, 1, 2, 3] and not (cut / "summary.json").exists()
    r = train(cache, cut, *args)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.splitlines() == [
        f"moejax: {cut}: its last step's evaluation was cut short; the final checkpoint is evaluated and step 4's "
        "row written", f"moejax: {cut / 'summary.json'} was missing; rebuilt from metrics.jsonl"]
    untimed = lambda d: [{k: v for k, v in json.loads(line).items() if not k.startswith(("throughput/", "time/"))}
                         for line in (d / "metrics.jsonl").read_text().splitlines()]
    assert untimed(cut) == untimed(straight) and "eval/loss" in untimed(cut)[-1]
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (straight, cut))
    for key in ("steps", "first_loss", "last_loss", "eval/loss", "eval/bpb", "eval_step", "drop_fraction"):
        assert sb[key] == sa[key], key
