"""Mutation-audit tests of the run loop and its infrastructure (train.loop, run_dir, monitor, schedule, step,
fsio, compile_cache, perf, hostmem, the CLI's start): each fails on one or more realistic slips the rest of the
suite let through. Some repeat, in this process, fault scenarios that test_faults checks through subprocesses.

Two real tiny runs (tests/tiny_run.TRAIN_ARGS, plus one eval batch at start and at the end) are trained in
this process: a 2-step base, then copies of it rerun as finished and extended to 3 steps; the rest are unit
tests without a compile."""

import errno
import json
import os
import re
import shutil
import signal
import time
from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import cli, entry, fsio, hostmem, perf
from moejax.checkpoint import CheckpointManager
from moejax.cli import _resolve, build_parser, main
from moejax.compile_cache import enable_compile_cache
from moejax.config import ConfigError, ParallelConfig, RunConfig, apply_overrides
from moejax.data.tokenizer import cache_dir
from moejax.metrics import MetricsWriter
from moejax.model.transformer import Transformer
from moejax.parallel.mesh import make_mesh
from moejax.presets import TINY, preset
from moejax.train.loop import RunError, _check_finite, evaluate
from moejax.train.monitor import WALL_KEY, RunTotals, StepLog
from moejax.train.optimizer import make_optimizer
from moejax.train.run_dir import clear_run_dir, truncate_metrics
from moejax.train.schedule import warmup_linear_decay, warmup_steps_for
from moejax.train.state import compute_copy, init_state, place_state
from tests.helpers import loop_steps, toy_model
from tests.test_checkpoint import steps_on_disk
from tests.tiny_run import TRAIN_ARGS

# The base run: 2 steps (checkpoints after steps 1 and 2), an eval-only row of step 0 and an eval at the end.
EVAL_ARGS = ["--set", "train.eval_batches=1", "--set", "train.eval_at_start=true", "--set", "train.eval_every=0",
             "--set", "train.temp_checkpoint_minutes=100000"]
BASE_ARGS = [*TRAIN_ARGS, *EVAL_ARGS]  # TRAIN_ARGS: --steps 2, checkpoint_every=1, adam, eval_batches=0 (overridden)


def _rows(run: Path) -> list[dict]:
    """Every line of metrics.jsonl, strictly (`metrics.read_metrics` would drop a torn last line)."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    run = tmp_path_factory.mktemp("loop_base") / "run"
    assert main(["train", "--run-dir", str(run), *BASE_ARGS]) == 0
    return run


def _copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def test_base_run_rows_and_the_learning_rate_of_each_step(base):
    """Rows: step 0's eval-only row, then steps 0 and 1, the last with an eval. The logged learning rate is
    the one the step used: warmup (1 step of 2 at tiny's 5%) starts at 0, so step 0's is 0 and step 1's the peak."""
    rows = _rows(base)
    assert [r["step"] for r in rows] == [0, 0, 1]
    assert set(rows[0]) == {"step", "eval/loss", "eval/bpb", "eval/drop_fraction"}
    assert "eval/loss" not in rows[1] and "eval/loss" in rows[2]
    cfg = RunConfig.from_dict(json.loads((base / "config.json").read_text()))
    lr = make_optimizer(cfg)[1]["adam"]
    assert rows[1]["train/learning_rate"] == 0.0 == float(lr(0))
    assert rows[2]["train/learning_rate"] == pytest.approx(float(lr(1))) and float(lr(1)) > 0
    assert rows[2]["train/learning_rate/adam"] == rows[2]["train/learning_rate"]
    assert steps_on_disk(base) == [1, 2]


def test_a_rerun_of_a_finished_run_changes_nothing_and_a_missing_summary_needs_the_last_row(base, tmp_path, capsys):
    """The same command after the run finished: exit 0, the final checkpoint not rewritten (same inode), no
    eval-only row appended, summary.json and metrics.jsonl byte for byte the same. Without summary.json and the
    last step's row (a kill in the last step's evaluation) the final checkpoint's metadata gives the row's
    training part and its weights the evaluation: the row comes back, timings aside. A final checkpoint without
    that record (saved by an older build) leaves nothing to rebuild the summary from: one-line error, exit 2."""
    run = _copy(base, tmp_path)
    final = run / "checkpoints" / "step_00000002"
    inode = final.stat().st_ino
    summary, metrics = (run / "summary.json").read_bytes(), (run / "metrics.jsonl").read_bytes()
    assert main(["train", "--run-dir", str(run), *BASE_ARGS]) == 0
    assert final.stat().st_ino == inode
    assert (run / "summary.json").read_bytes() == summary
    assert (run / "metrics.jsonl").read_bytes() == metrics
    assert steps_on_disk(run) == [1, 2]

    untimed = lambda line: {k: v for k, v in json.loads(line).items() if not k.startswith(("throughput/", "time/"))}
    lines = metrics.decode().splitlines(keepends=True)
    for old_build in (False, True):
        (run / "summary.json").unlink()
        (run / "metrics.jsonl").write_text("".join(lines[:-1]))  # the last step's row lost
        if old_build:
            meta = json.loads((final / "metadata.json").read_text())
            (final / "metadata.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "final_row"}))
        capsys.readouterr()
        assert main(["train", "--run-dir", str(run), *BASE_ARGS]) == (2 if old_build else 0)
        if old_build:
            assert "no summary.json in" in capsys.readouterr().err
            assert not (run / "summary.json").exists()
        else:
            assert "its last step's evaluation was cut short" in capsys.readouterr().err
            assert [untimed(x) for x in (run / "metrics.jsonl").read_text().splitlines()] == [untimed(x) for x in lines]
            assert json.loads((run / "summary.json").read_text())["eval/loss"] == json.loads(summary)["eval/loss"]


def test_a_run_extended_from_a_final_checkpoint_whose_row_is_owed_writes_that_row_first(base, tmp_path, capsys):
    """Killed in its last step's evaluation, then extended (a larger --steps): the owed row of step 1 comes back
    before step 2's, each step logged once, and the extension's summary covers it."""
    run = _copy(base, tmp_path)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "summary.json").unlink()
    (run / "metrics.jsonl").write_text("".join(lines[:-1]))
    assert main(["train", "--run-dir", str(run), *BASE_ARGS, "--steps", "3"]) == 0
    assert "its last step's evaluation was cut short; the final checkpoint is evaluated and step 1's row" in \
        capsys.readouterr().err
    rows = _rows(run)
    assert [r["step"] for r in rows] == [json.loads(line)["step"] for line in lines] + [2]  # step 0: eval, train
    assert rows[-2]["train/loss"] == json.loads(lines[-1])["train/loss"] and "eval/loss" in rows[-2]
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["steps"], summary["first_loss"], summary["last_loss"]) == (3, rows[1]["train/loss"],
                                                                                rows[-1]["train/loss"])


def test_a_one_step_run_owes_its_row_though_step_0_has_an_eval_only_row(tmp_path, capsys):
    """train.eval_at_start writes an eval-only row of step 0 before step 0's own: with 1 step, a kill in its
    evaluation leaves that row, which is not the owed one. The rerun writes step 0's row, and the summary comes
    from it (not first/last loss None and the initial weights' eval)."""
    run = tmp_path / "run"
    args = [*BASE_ARGS, "--steps", "1"]
    assert main(["train", "--run-dir", str(run), *args]) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    (run / "metrics.jsonl").write_text(lines[0])  # step 0's eval-only row
    assert main(["train", "--run-dir", str(run), *args]) == 0
    assert "step 0's row written" in capsys.readouterr().err
    again = json.loads((run / "summary.json").read_text())
    for key in ("first_loss", "last_loss", "eval/loss", "eval_step"):
        assert again[key] == summary[key] is not None, key


def test_extending_falls_back_past_a_non_finite_checkpoint_drops_stale_rows_and_finishes_despite_sigterm(
        base, tmp_path, monkeypatch, capsys):
    """Extend the run from 2 to 3 steps with (a) its newest checkpoint marked non-finite (an older build could
    write one): the resume falls back to step 1; (b) a stale row of step 2 and a torn line after the rows;
    (c) a SIGTERM in the last step, which must let the run finish (final checkpoint, summary, exit 0).
    Each checkpoint is written after the rows it covers are synced."""
    run = _copy(base, tmp_path)
    meta_path = run / "checkpoints" / "step_00000002" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["finite"] = False
    meta_path.write_text(json.dumps(meta))
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "train/loss": 123.0}) + "\n" + '{"step": 3, "train/lo')

    events = []
    real_sync, real_save = MetricsWriter.sync, CheckpointManager.save
    monkeypatch.setattr(MetricsWriter, "sync", lambda self: (events.append("sync"), real_sync(self))[1])
    monkeypatch.setattr(CheckpointManager, "save",
                        lambda self, step, *a, **k: (events.append(("save", step, k.get("kind"))),
                                                     real_save(self, step, *a, **k))[1])
    monkeypatch.setenv("MOEJAX_FAULT_SIGTERM_AT_STEP", "3")
    capsys.readouterr()
    rc = main(["train", "--run-dir", str(run), *BASE_ARGS, "--steps", "3"])
    err = capsys.readouterr().err
    assert rc == 0 and "preempted" not in err, err
    assert f"resuming {run} at step 1 of 3" in err, err

    rows = _rows(run)
    assert [r["step"] for r in rows] == [0, 0, 1, 2], "each step once, one eval-only row, no stale row"
    assert 123.0 not in [r.get("train/loss") for r in rows]
    assert "eval/loss" in rows[-1]
    assert steps_on_disk(run) == [1, 2, 3]
    for step in (2, 3):
        m = json.loads((run / "checkpoints" / f"step_{step:08d}" / "metadata.json").read_text())
        assert m["step"] == m["data_step"] == step and m["finite"] is True
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["first_loss"] == rows[1]["train/loss"]
    saves = [e for e in events if e != "sync"]
    assert [(s, k) for _, s, k in saves] == [(2, "permanent"), (3, "final")]
    for i, e in enumerate(events):
        if e != "sync":
            assert i > 0 and events[i - 1] == "sync", events


def test_an_extension_stopped_before_it_saved_a_step_can_be_taken_back(base, tmp_path, monkeypatch, capsys):
    """`--steps 4` on the finished 2-step run, preempted before its first step (or a mistyped --steps stopped at
    once), left config.json at 4 for good: the finished run's own command was refused as a shortening and
    `summary` called the run unfinished. Each checkpoint records the train.steps it was saved under, and none
    was saved under 4: the finished run's command works again, exit 0, summary and checkpoints untouched."""
    run = _copy(base, tmp_path)
    meta = lambda step: json.loads((run / "checkpoints" / f"step_{step:08d}" / "metadata.json").read_text())
    assert [meta(1)["train_steps"], meta(2)["train_steps"]] == [2, 2]
    summary, final = (run / "summary.json").read_bytes(), (run / "checkpoints" / "step_00000002").stat().st_ino
    monkeypatch.setenv("MOEJAX_FAULT_SIGTERM_BEFORE_STEP", "1")
    assert main(["train", "--run-dir", str(run), *BASE_ARGS, "--steps", "4"]) == 75
    monkeypatch.delenv("MOEJAX_FAULT_SIGTERM_BEFORE_STEP")
    assert main(["summary", str(run)]) == 2  # "has not finished them"
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), *BASE_ARGS]) == 0
    assert (f"moejax: {run} was set to 4 steps but saved no checkpoint under that; it runs 2 steps now"
            in capsys.readouterr().err)
    assert (run / "summary.json").read_bytes() == summary and main(["summary", str(run)]) == 0
    assert steps_on_disk(run) == [1, 2] and (run / "checkpoints" / "step_00000002").stat().st_ino == final


# ---- the loop's pieces, without a run ------------------------------------------------------------------
def test_a_non_finite_metric_stops_the_step_and_is_written(tmp_path):
    ok = {"train/loss": 1.0, "train/grad_norm": 2.0, "train/update_norm": 0.1, "train/param_norm": 3.0}
    _check_finite(0, ok, tmp_path)
    assert not (tmp_path / "nonfinite.json").exists()
    for key in ("train/loss", "train/grad_norm", "train/update_norm", "train/param_norm"):
        for bad in (float("nan"), float("inf")):
            with pytest.raises(RunError, match=f"non-finite {key}"):
                _check_finite(7, {**ok, key: bad}, tmp_path)
            assert json.loads((tmp_path / "nonfinite.json").read_text())["step"] == 7


def test_the_loops_train_step_donates_the_state():
    """The state is donated to the jitted step (its memory reused for the new state)."""
    cfg, state, batch, step_fn, _ = loop_steps(toy_model(n_layers=1), ParallelConfig(), 2, 16)
    lowered = step_fn(cfg.phases[0]).lower(state, batch)
    state_info, batch_info = lowered.args_info[0]
    assert all(a.donated for a in jax.tree.leaves(state_info))
    assert not any(a.donated for a in jax.tree.leaves(batch_info))


# ---- the summary's throughput and wall clock ------------------------------------------------------------
def _cfg():
    return apply_overrides(preset("tiny"), ["model.n_layers=2", "train.log_every=1", "train.load_log_every=0"])


def _row(step, tps, wall=None):
    row = {"step": step, "train/loss": 5.0, "throughput/tokens_per_second": tps, "throughput/mfu": tps / 1000}
    if wall is not None:
        row["time/wall_seconds"] = wall
    return row


def test_totals_from_rows_leave_out_the_first_steps_and_keep_the_last_wall():
    totals = RunTotals.from_rows([_row(0, 1.0, 10.0), _row(1, 2.0, 20.0), _row(2, 100.0, 30.0), _row(3, 300.0, 40.0)])
    assert list(totals.tokens_per_second) == [100.0, 300.0]  # steps 0 and 1 compile
    assert list(totals.mfu) == [0.1, 0.3]
    assert totals.wall_before == 40.0


def test_a_restarted_segment_leaves_out_its_own_first_steps_and_adds_the_earlier_wall(tmp_path):
    """After a restart at step 10 the segment's first two steps compile again: they don't count, whatever
    their step numbers; the rows' wall clock continues from the earlier segments'."""
    totals = RunTotals.from_rows([_row(s, 50.0, 100.0 + s) for s in range(10)])
    writer = MetricsWriter(tmp_path, wandb_mode="disabled")
    log = StepLog(_cfg(), writer, totals, emit=lambda line: None)
    recorded = []
    for step, tps in ((10, 1.0), (11, 2.0), (12, 1000.0), (13, 1000.0)):
        m = _row(step, tps)
        log.record(step, m, None, last=step == 13)
        recorded.append(m[WALL_KEY])
    writer.close()
    assert list(totals.tokens_per_second) == [50.0] * 8 + [1000.0, 1000.0]
    assert all(w >= 109.0 for w in recorded)
    s = log.summary("x", 14)
    assert s["tokens_per_second"] == 50.0 and s["wall_seconds"] >= 109.0


# ---- schedule -------------------------------------------------------------------------------------------
def test_warmup_boundaries():
    assert warmup_steps_for(100, 0.001) == 1  # a positive fraction warms up at least one step
    assert warmup_steps_for(100, 0.0) == 0
    no_warmup = warmup_linear_decay(1.0, 10, warmup_fraction=0.0, min_lr_fraction=0.1)
    assert float(no_warmup(0)) == 1.0  # no warmup: the first step runs at the peak
    np.testing.assert_allclose(float(no_warmup(10)), 0.1, rtol=1e-6)
    one = warmup_linear_decay(1.0, 10, warmup_fraction=0.001, min_lr_fraction=0.1)
    assert float(one(0)) == 0.0 and float(one(1)) == 1.0
    np.testing.assert_allclose(float(one(10)), 0.1, rtol=1e-6)  # floor reached exactly at total_steps
    with pytest.raises(ValueError, match="warmup_fraction"):
        warmup_linear_decay(1.0, 10, warmup_fraction=1.0)


# ---- atomic writes --------------------------------------------------------------------------------------
def test_atomic_write_fsyncs_the_data_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        events.append(("fsync", "dir" if os.path.isdir(target) else "file", Path(target).name))
        real_fsync(fd)

    def rename(src, dst):
        events.append(("replace", Path(src).name, Path(dst).name))
        real_replace(src, dst)

    monkeypatch.setattr(fsio.os, "fsync", fsync)
    monkeypatch.setattr(fsio.os, "replace", rename)
    target = tmp_path / "summary.json"
    target.write_text("old")
    fsio.atomic_write(target, "new")
    tmp = fsio.temp_name(target).name
    assert tmp.startswith(".summary.json.tmp-")
    assert events == [("fsync", "file", tmp), ("replace", tmp, "summary.json"), ("fsync", "dir", tmp_path.name)]
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


# ---- compile cache --------------------------------------------------------------------------------------
def test_compile_cache_default_dir_and_a_set_one_wins(monkeypatch, tmp_path):
    was = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        enable_compile_cache()
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
        jax.config.update("jax_compilation_cache_dir", None)
        enable_compile_cache()
        assert jax.config.jax_compilation_cache_dir == str(cache_dir() / "jax")
    finally:
        jax.config.update("jax_compilation_cache_dir", was)


# ---- MFU's peak -----------------------------------------------------------------------------------------
def test_gpu_peak_is_per_device_times_devices(monkeypatch):
    monkeypatch.setattr(perf.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(perf.jax, "device_count", lambda: 8)
    monkeypatch.setattr(perf.jax, "process_count", lambda: 2)
    p = perf.job_peak(1e15)
    assert (p["peak_flops"], p["peak_units"], p["peak_unit"], p["platform"]) == (8e15, 8, "device", "gpu")
    seen = {}
    monkeypatch.setattr(perf, "measure_matmul_peak",
                        lambda n, dtype, repeats: seen.update(n=n, dtype=dtype, repeats=repeats) or 1e14)
    p = perf.job_peak()
    assert p["peak_flops"] == 8e14 and seen == {"n": 8192, "dtype": jax.numpy.bfloat16, "repeats": 20}
    monkeypatch.setattr(perf.jax, "default_backend", lambda: "cpu")
    p = perf.job_peak()
    assert p["peak_flops"] == 2e14 and seen == {"n": 1024, "dtype": jax.numpy.float32, "repeats": 20}


def test_matmul_peak_counts_two_flops_per_multiply_add_and_takes_the_fastest(monkeypatch):
    monkeypatch.setattr(perf, "_fastest", lambda call, repeats: 0.5)
    assert perf.measure_matmul_peak(n=8) == 2.0 * 8**3 / 0.5
    monkeypatch.undo()
    clock = iter([0.0, 3.0, 10.0, 11.0, 20.0, 22.0])  # calls of 3 s, 1 s, 2 s
    monkeypatch.setattr(perf.time, "perf_counter", lambda: next(clock))
    assert perf._fastest(lambda: None, 3) == 1.0


# ---- run dir --------------------------------------------------------------------------------------------
def test_overwrite_deletes_moejaxs_temp_files_but_not_a_users_look_alike(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(apply_overrides(preset("tiny"), ["model.n_layers=2"]).to_json())
    (run / ".metrics.jsonl.tmp-99").write_text("moejax's")
    (run / ".thesis.tex.tmp-99").write_text("an editor's swap file")
    assert clear_run_dir(run) == [".thesis.tex.tmp-99"]
    assert sorted(p.name for p in run.iterdir()) == [".thesis.tex.tmp-99"]


# ---- host memory and the console script -----------------------------------------------------------------
def test_glibc_2_35_is_the_first_with_the_tunable(monkeypatch):
    monkeypatch.setattr(hostmem.sys, "platform", "linux")
    monkeypatch.setattr(hostmem, "_thp_mode", lambda: "madvise")
    monkeypatch.setattr(hostmem, "_glibc_version", lambda: (2, 35))
    monkeypatch.setattr(hostmem, "_find_tcmalloc", lambda: None)
    assert hostmem.host_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"


@pytest.mark.parametrize("argv0", ["", "-"])
def test_a_program_typed_in_or_read_from_stdin_is_not_re_executed(argv0, monkeypatch):
    monkeypatch.setattr(hostmem, "host_env", lambda environ: {**environ, hostmem.EXECUTED: "1"})
    monkeypatch.setattr(hostmem.sys, "orig_argv", [hostmem.sys.executable, argv0], raising=False)
    monkeypatch.setattr(hostmem.sys, "argv", [argv0])
    monkeypatch.setattr(hostmem.os, "execve", lambda *a: pytest.fail(f"re-executed {a[1]}"))
    hostmem.exec_with_host_memory()  # returns: nothing to run again


def test_the_console_script_sets_up_host_memory_before_the_cli(monkeypatch):
    calls = []
    monkeypatch.setattr(entry, "exec_with_host_memory", lambda: calls.append("hostmem"))
    monkeypatch.setattr(cli, "main", lambda: calls.append("cli") or 0)
    assert entry.main() == 0 and calls == ["hostmem", "cli"]


def test_the_console_script_prints_moejaxs_warnings_as_its_other_lines(monkeypatch, capsys):
    """A resume's fallback warning printed as `WARNING:moejax.checkpoint:...` (the root handler absl installs) where
    every other message reads `moejax: warning: ...`; for the command's duration only, so in-process callers
    (caplog at the root) see the records as before."""
    import logging

    before = (list(logging.getLogger("moejax").handlers), logging.getLogger("moejax").propagate)
    monkeypatch.setattr(entry, "exec_with_host_memory", lambda: None)
    monkeypatch.setattr(cli, "main", lambda: logging.getLogger("moejax.checkpoint").warning("fell back: %s", 7) or 0)
    assert entry.main() == 0
    assert capsys.readouterr().err == "moejax: warning: fell back: 7\n"
    assert (list(logging.getLogger("moejax").handlers), logging.getLogger("moejax").propagate) == before


# ---- the CLI's exit codes -------------------------------------------------------------------------------
def test_sigterm_on_a_permanent_step_keeps_its_checkpoint_permanent(base, tmp_path, monkeypatch, capsys):
    """A preemption after a step that is due a permanent checkpoint (checkpoint_every=1: every step) saves it as
    permanent: saved as temporary, it was deleted once the resumed run saved a newer one (found by a fuzzer,
    docs/LOG.md thirty-fifth session)."""
    run = _copy(base, tmp_path)
    monkeypatch.setenv("MOEJAX_FAULT_SIGTERM_AT_STEP", "3")
    assert main(["train", "--run-dir", str(run), *BASE_ARGS, "--steps", "4"]) == 75
    meta = json.loads((run / "checkpoints" / "step_00000003" / "metadata.json").read_text())
    assert meta["kind"] == "permanent" and not meta["temporary"]
    monkeypatch.delenv("MOEJAX_FAULT_SIGTERM_AT_STEP")
    assert main(["train", "--run-dir", str(run), *BASE_ARGS, "--steps", "4"]) == 0
    assert steps_on_disk(run) == [1, 2, 3, 4]
    capsys.readouterr()


def test_a_preemption_skips_the_evaluation_due_after_its_step_but_not_the_last(tmp_path, monkeypatch, capsys):
    """A SIGTERM during a step after which an evaluation is due (train.eval_every=1): the save comes first and
    that evaluation is skipped (a preemption's grace period is for the save; the hero's evaluation is 4 batches
    of 704 sequences on both MoE paths). The resumed run evaluates again, and in the last step a signal skips
    nothing: the summary reports that evaluation."""
    run = tmp_path / "run"
    args = [*TRAIN_ARGS, "--steps", "3", "--set", "train.eval_every=1", "--set", "train.eval_batches=1"]
    monkeypatch.setenv("MOEJAX_FAULT_SIGTERM_AT_STEP", "2")
    capsys.readouterr()
    assert main(["train", "--run-dir", str(run), *args]) == 75
    line = (rf"moejax: preempted after step 2 \(its evaluation skipped\); checkpoint saved in {re.escape(str(run))}, "
            r"\d+\.\d s after the SIGTERM; run the same command again to resume\n")  # the grace period it needed
    assert re.search(line, capsys.readouterr().err)
    assert [("eval/loss" in r, r["step"]) for r in _rows(run)] == [(True, 0), (False, 1)]
    monkeypatch.setenv("MOEJAX_FAULT_SIGTERM_AT_STEP", "3")
    # the final checkpoint, issued before the last step's evaluation, commits before its first batch once a
    # signal is in: then a kill when the grace period runs out loses no step
    events, real_wait = [], CheckpointManager.wait
    monkeypatch.setattr(CheckpointManager, "wait", lambda self: (events.append("wait"), real_wait(self))[1])
    spy = lambda fn, *a, **k: evaluate(lambda *b: (events.append("batch"), fn(*b))[1], *a, **k)
    monkeypatch.setattr("moejax.train.loop.evaluate", spy)
    assert main(["train", "--run-dir", str(run), *args]) == 0
    assert events[:2] == ["wait", "batch"], events
    assert [("eval/loss" in r, r["step"]) for r in _rows(run)] == [(True, 0), (False, 1), (True, 2)]
    assert json.loads((run / "summary.json").read_text())["eval/loss"] == _rows(run)[-1]["eval/loss"]


def test_a_non_finite_grad_norm_is_an_alarm_line_before_the_run_stops(tmp_path, capsys):
    """The grad_norm alarm's non-finite branch (StepLog.check) must run before the finiteness check stops the run;
    the order had flipped, so it never fired in training (found by a fuzzer, docs/LOG.md thirty-fifth session)."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *TRAIN_ARGS, "--set", "model.init_scale=1e30"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"alarm grad_norm raised at step 0: grad norm is (nan|inf)", err), err
    assert err.index("alarm grad_norm") < err.index("moejax: error: non-finite")


def test_a_run_dir_that_fills_up_or_is_broken_is_one_line(base, tmp_path, monkeypatch, capsys):
    """A full disk while metrics.jsonl is written mid-run, or a metrics.jsonl that is a directory, was a traceback
    (exit 1; found by a fuzzer, docs/LOG.md thirty-fifth session): now one line, exit 2, the checkpoints kept."""
    run = _copy(base, tmp_path)
    real_log = MetricsWriter.log

    def full_at_step_2(self, step, metrics):
        if step == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
        return real_log(self, step, metrics)

    monkeypatch.setattr(MetricsWriter, "log", full_at_step_2)
    assert main(["train", "--run-dir", str(run), *BASE_ARGS, "--steps", "4"]) == 2
    err = _error_line(capsys.readouterr().err)
    assert "cannot write to run dir" in err and "No space left on device" in err and "metrics.jsonl" in err, err
    assert steps_on_disk(run) == [1, 2]
    monkeypatch.undo()
    broken = _copy(base, tmp_path / "b")
    (broken / "metrics.jsonl").unlink()
    (broken / "metrics.jsonl").mkdir()
    assert main(["train", "--run-dir", str(broken), *BASE_ARGS, "--steps", "3"]) == 2
    err = _error_line(capsys.readouterr().err)
    assert "cannot write to run dir" in err and "Is a directory" in err, err


def _error_line(err: str) -> str:
    """The one error line of a failed command's stderr (beside its info lines), no traceback."""
    errors = [line for line in err.splitlines() if line.startswith("moejax: error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def test_sigterm_while_train_is_starting_exits_75_and_restores_the_handler(monkeypatch, capsys):
    """Before the trainer's own guard (imports, config, waiting for the coordinator): nothing to save, exit 75
    (the launcher requeues), not 143; the caller's SIGTERM handler is back afterwards."""
    def starting(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        pytest.fail("SIGTERM did not interrupt the start")

    def callers(signum, frame):  # never the default (it would end pytest): fail the test instead
        raise AssertionError("SIGTERM reached the caller's handler: main set none while starting")

    monkeypatch.setattr(cli, "_cmd_train", starting)
    before = signal.signal(signal.SIGTERM, callers)
    try:
        assert main(["train", "--run-dir", "unused"]) == 75
        assert "preempted (SIGTERM) while starting; nothing to save" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) is callers
    finally:
        signal.signal(signal.SIGTERM, before)


def test_steps_zero_is_a_user_error_not_the_presets_steps():
    """`--steps 0` is refused (config validation), not silently replaced by the preset's steps. Checked on the
    resolved config, without training (a mutant that ignores it would otherwise train tiny's 300 steps)."""
    resolve = lambda *extra: _resolve(build_parser().parse_args(["train", "--run-dir", "x", *extra]))
    assert resolve("--steps", "7").train.steps == 7
    with pytest.raises(ConfigError, match="steps"):
        resolve("--steps", "0")


# ---- evaluation, metrics.jsonl's torn line, the state's placement ---------------------------------------
def test_evaluate_pools_sums_and_reports_bits_per_byte():
    outs = [{"ce_sum": 20.0, "tokens": 10.0, "bytes": 40.0, "dropped": 1.0, "valid": 10.0},
            {"ce_sum": 10.0, "tokens": 10.0, "bytes": 20.0, "dropped": 0.0, "valid": 30.0}]

    class Batches:
        def batch(self, i):
            return i

    got = evaluate(lambda params, i, bpt: outs[i], None, Batches(), 2, None, "eval/")
    assert got["eval/loss"] == pytest.approx(30.0 / 20.0)
    assert got["eval/bpb"] == pytest.approx(30.0 / np.log(2.0) / 60.0)
    assert got["eval/drop_fraction"] == pytest.approx(1.0 / 40.0)


def test_evaluate_stops_between_batches_when_told():
    """A preemption during an evaluation: `stop` is asked before every batch, and once it says so the
    evaluation is abandoned (None) without running another batch."""
    ran, asked = [], []

    class Batches:
        def batch(self, i):
            return i

    def fn(params, i, bpt):
        ran.append(i)
        return dict.fromkeys(("ce_sum", "tokens", "bytes", "dropped", "valid"), 1.0)

    stop = lambda: (asked.append(len(ran)), len(asked) == 3)[1]  # says stop before the third batch
    assert evaluate(fn, None, Batches(), 4, None, "eval/", stop=stop) is None
    assert ran == [0, 1] and asked == [0, 1, 2]
    assert evaluate(fn, None, Batches(), 2, None, "eval/", stop=lambda: False)["eval/loss"] == 1.0


def test_truncate_drops_a_torn_row_of_a_kept_step_and_completes_a_whole_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": s, "train/loss": 1.0}) + "\n" for s in range(4))
    path.write_text(rows + '{"step": 4, "train/lo')  # killed mid-write of step 4's row; resume at 6
    truncate_metrics(tmp_path, 6)
    assert path.read_text() == rows
    path.write_text(rows + json.dumps({"step": 4, "train/loss": 1.0}))  # whole, only its newline missing
    truncate_metrics(tmp_path, 6)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert path.read_text().endswith("\n")


def test_the_compute_copy_keeps_the_router_bias_in_fp32():
    params = Transformer.init(toy_model(n_layers=1), jax.random.key(0))
    compute = compute_copy(params, jnp.bfloat16)
    assert compute.blocks.moe.router_bias.dtype == jnp.float32
    others = [x.dtype for p, x in jax.tree_util.tree_leaves_with_path(compute)
              if getattr(p[-1], "name", None) != "router_bias"]
    assert others and all(d == jnp.bfloat16 for d in others)


def test_pinned_host_placement_moves_master_and_optimizer_state_only():
    """SPEC §4: fp32 master weights and optimizer state in pinned host memory, the compute copy on device."""
    cfg = replace(TINY, model=toy_model(n_layers=1), parallel=ParallelConfig(),
                  train=replace(TINY.train, optimizer="adam"))
    state = init_state(cfg, make_optimizer(cfg)[0], jax.random.key(0), make_mesh(cfg.parallel))
    kinds = lambda tree: {x.sharding.memory_kind for x in jax.tree.leaves(tree)}
    assert place_state(state, "device") == (state, None)
    placed, offload = place_state(state, "pinned_host")
    assert kinds(placed.params) == kinds(placed.opt_state) == {"pinned_host"}
    assert kinds(placed.compute) == {"device"}
    assert {s.memory_kind for s in jax.tree.leaves(offload.params_device)} == {"device"}
    assert {s.memory_kind for s in jax.tree.leaves(offload.opt_host)} == {"pinned_host"}
