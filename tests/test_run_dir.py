"""The run directory never loses a user's data: --overwrite only deletes what moejax wrote (and only in a
moejax run), one trainer per run dir (flock), torn metrics lines, unreadable summaries, extending a run."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest

from moejax.cli import main
from moejax.config import apply_overrides
from moejax.metrics import read_metrics
from moejax.presets import preset
from moejax.report import load_rows, write_report
from moejax.train.run_dir import (SUMMARY_KEYS, RunError, RunLock, clear_run_dir, prepare_run_dir, read_summary,
                                  truncate_metrics)
from tests.helpers import subprocess_xla_flags

CFG = apply_overrides(preset("tiny"), ["model.n_layers=2", "train.steps=6"])


def _row(step, **kw):
    return json.dumps({"step": step, "train/loss": 5.0 - 0.1 * step, **kw}) + "\n"


def _fake_run(run_dir, steps=4):
    """What a run leaves: config, run_info, metrics, summary, a checkpoint, wandb files, a profile, temp files."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(CFG.to_json())
    (run_dir / "run_info.json").write_text(json.dumps({"accounting": {}}))
    (run_dir / "metrics.jsonl").write_text("".join(_row(s) for s in range(steps)))
    (run_dir / "summary.json").write_text("{}")
    (run_dir / f".metrics.jsonl.tmp-{os.getpid()}").write_text("partial")
    for d in ("checkpoints/step_00000002/state", "wandb/offline-run", "profile/process_0/plugins/profile/t"):
        (run_dir / d).mkdir(parents=True)
    (run_dir / "checkpoints/step_00000002/COMMITTED").write_text("2\n")


# ---- --overwrite ---------------------------------------------------------------------------------------
def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    junk = tmp_path / "junk"
    (junk / "precious").mkdir(parents=True)
    (junk / "precious" / "thesis.tex").write_text("years of work")
    (junk / "config.json").write_text('{"not": "moejax"}')  # a config.json alone does not make it a run
    with pytest.raises(RunError, match=r"--overwrite refused: .*junk is not a moejax run .*config.json, precious"):
        prepare_run_dir(junk, CFG, overwrite=True)
    assert (junk / "precious" / "thesis.tex").read_text() == "years of work"
    assert json.loads((junk / "config.json").read_text()) == {"not": "moejax"}


def test_a_config_json_that_is_not_a_runs_is_refused_without_offering_overwrite(tmp_path):
    """An export's dir (its config.json says `format: moejax-export/1`) as --run-dir: one line that says so,
    not a suggestion of --overwrite, which would then refuse it too."""
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text('{"format": "moejax-export/1", "model": {}}')
    with pytest.raises(RunError, match=r"holds a config.json that is not a moejax run's") as err:
        prepare_run_dir(export, CFG, overwrite=False)
    assert "--overwrite" not in str(err.value)
    assert json.loads((export / "config.json").read_text())["format"] == "moejax-export/1"


@pytest.mark.parametrize("left", ["checkpoints", "metrics.jsonl"])
def test_a_run_without_its_config_json_is_not_started_over_in_place(left, tmp_path):
    """A run dir whose config.json is lost (or checkpoints restored without it) was taken for a new run: it
    trained from step 0 into the old checkpoints and metrics, no --overwrite asked (found by a fuzzer, docs/LOG.md
    thirty-fifth session). Now one line, nothing touched; --overwrite still starts it over."""
    run = tmp_path / "run"
    _fake_run(run)
    (run / "config.json").unlink()
    if left == "metrics.jsonl":
        shutil.rmtree(run / "checkpoints")
    before = sorted(p.name for p in run.iterdir())
    with pytest.raises(RunError, match=r"holds a run's checkpoints or metrics but no config.json: restore"):
        prepare_run_dir(run, CFG, overwrite=False)
    assert sorted(p.name for p in run.iterdir()) == before
    assert prepare_run_dir(run, CFG, overwrite=True) is False and (run / "config.json").exists()


def test_overwrite_removes_only_what_moejax_wrote(tmp_path, capsys):
    run = tmp_path / "run"
    _fake_run(run)
    (run / "notes.txt").write_text("mine")
    (run / "mine").mkdir()
    assert prepare_run_dir(run, CFG, overwrite=True) is False
    assert sorted(p.name for p in run.iterdir()) == ["config.json", "mine", "notes.txt"]
    assert (run / "notes.txt").read_text() == "mine"
    assert "--overwrite kept 2 entries moejax did not write" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert clear_run_dir(empty) == []  # empty: fine


def test_overwrite_via_cli_touches_nothing_when_refused(tmp_path, capsys):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "thesis.tex").write_text("x")
    assert main(["train", "--run-dir", str(junk), "--overwrite", "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--overwrite refused" in err and err.count("moejax: error:") == 1 and "Traceback" not in err
    assert sorted(p.name for p in junk.iterdir()) == ["thesis.tex"]  # not even the lock file is left


# ---- the lock ------------------------------------------------------------------------------------------
def test_second_lock_names_the_holder_and_release_frees_it(tmp_path):
    run = tmp_path / "run"
    first = RunLock(run).acquire()
    assert (run / ".lock").read_text() == f"PID {os.getpid()} on host {socket.gethostname()}\n"
    with pytest.raises(RunError, match=rf"in use by PID {os.getpid()} on host {socket.gethostname()}"):
        RunLock(run).acquire()
    first.release()
    assert not run.exists()  # it created the dir and nothing else was written: nothing left
    (run).mkdir()
    (run / ".lock").write_text("PID 1 on host gone\n")  # stale file of a killed run: no lock held on it
    with RunLock(run):
        assert (run / ".lock").read_text().startswith(f"PID {os.getpid()}")
    assert run.exists() and not (run / ".lock").exists()


def test_a_second_trainer_exits_2_at_once_naming_the_holder(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    with RunLock(run):
        r = subprocess.run([sys.executable, "-m", "moejax.cli", "train", "--run-dir", str(run), "--steps", "1",
                            "--no-progress", "--set", "model.n_layers=2"], capture_output=True, text=True,
                           env={**os.environ, "WANDB_MODE": "disabled", "XLA_FLAGS": subprocess_xla_flags()}, timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"is in use by PID {os.getpid()} on host {socket.gethostname()}" in r.stderr
    assert r.stderr.count("\n") == 1 and sorted(p.name for p in run.iterdir()) == []


# ---- metrics.jsonl -------------------------------------------------------------------------------------
def test_truncate_drops_rerun_steps_and_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_row(s) for s in range(8)) + _row(8)[:17])  # a crash mid-write of step 8
    truncate_metrics(tmp_path, 5)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2, 3, 4]
    truncate_metrics(tmp_path, 0)  # a crash before the first checkpoint: every row runs again
    assert path.read_text() == ""


def test_truncate_streams_and_leaves_a_clean_file_alone(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(_row(s) for s in range(5)))
    inode = path.stat().st_ino
    monkeypatch.setattr(type(path), "read_text", lambda *a, **k: pytest.fail("read whole"))
    monkeypatch.setattr(type(path), "read_bytes", lambda *a, **k: pytest.fail("read whole"))
    truncate_metrics(tmp_path, 5)  # nothing to drop: not rewritten
    assert path.stat().st_ino == inode
    truncate_metrics(tmp_path, 3)
    monkeypatch.undo()
    assert path.stat().st_ino != inode and path.read_text() == "".join(_row(s) for s in range(3))
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left


def test_readers_drop_a_torn_last_line_but_not_a_bad_middle_one(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(_row(0) + _row(1) + '{"step": 2, "train/lo')
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1]
    assert [r["step"] for r in load_rows(tmp_path)] == [0, 1]
    assert main(["report", str(tmp_path)]) == 0
    path.write_text(_row(0) + "garbage\n" + _row(2))
    with pytest.raises(Exception, match="line 2 is not JSON"):
        load_rows(tmp_path)


def test_failed_report_leaves_no_report_dir(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "other": 1}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "none of the plotted metrics" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()
    (tmp_path / "metrics.jsonl").write_text(_row(0, **{"train/router/load": [[1.0, 2.0]]}))
    with pytest.raises(Exception, match="--layer 5 is out of range"):
        write_report(tmp_path, layer=5)
    assert not (tmp_path / "report").exists()  # the loss plot drawn before the error is gone too


# ---- summary.json --------------------------------------------------------------------------------------
def test_summary_of_a_run_extended_but_not_finished_says_so(tmp_path, capsys):
    """A finished 4-step run extended to 6 and preempted keeps the 4-step summary.json: `summary` printed it as
    the run's, no notice (found by a fuzzer, docs/LOG.md thirty-fifth session). Now one line saying so."""
    _fake_run(tmp_path / "run")
    summary = {k: 1 for k in SUMMARY_KEYS} | {"preset": "tiny", "steps": 4}
    (tmp_path / "run" / "summary.json").write_text(json.dumps(summary))
    assert CFG.train.steps == 6  # _fake_run's config.json
    with pytest.raises(RunError, match="is from when the run had 4 steps; it now has 6 and has not finished them"):
        read_summary(tmp_path / "run")
    assert main(["summary", str(tmp_path / "run")]) == 2 and capsys.readouterr().err.count("\n") == 1
    (tmp_path / "run" / "config.json").write_text(apply_overrides(CFG, ["train.steps=4"]).to_json())
    assert read_summary(tmp_path / "run")["steps"] == 4


@pytest.mark.parametrize("content, words", [
    (None, "no summary.json in"),
    ("", "is empty, truncated or not a JSON object"),
    ('{"preset": "tiny", "steps": 3, "first_lo', "is empty, truncated or not a JSON object"),
    ('{"preset": "tiny"}', "lacks steps, first_loss"),
    # moejax's own file, edited or damaged: each was a traceback in `moejax summary`
    (dict(first_loss="x"), "summary.json: first_loss is 'x', not a number"),
    (dict(steps=None), "summary.json: steps is None, not an integer"),
    (dict(mfu={}), "summary.json: mfu is {}, not a number"),
    (dict(tokens_per_second="fast"), "summary.json: tokens_per_second is 'fast', not a number"),
    (dict(eval_step=None), "summary.json: eval_step is None, not an integer"),
    ({"eval/loss": 3.0}, "summary.json: it has one of eval/loss and eval/bpb without the other"),
    (dict(alarms=[]), "summary.json: its alarms are not {kind: {count, first, last}}"),
    (dict(alarms={"spike": {"count": 2, "first": "x"}}), "its alarms are not {kind: {count, first, last}}"),
])
def test_summary_of_a_missing_or_broken_file_is_one_line(content, words, tmp_path, capsys):
    if isinstance(content, dict):  # a whole summary with these fields changed
        content = json.dumps({"preset": "tiny", "steps": 3, "first_loss": 9.0, "last_loss": 7.0,
                              "tokens_per_second": 100.0, "mfu": 0.1, "wall_seconds": 5.0, "drop_fraction": 0.0,
                              "alarms": {}, **content})
    if content is not None:
        (tmp_path / "summary.json").write_text(content)
    with pytest.raises(RunError, match=words):
        read_summary(tmp_path)
    assert main(["summary", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


# ---- resuming with other settings ----------------------------------------------------------------------
def test_a_run_may_be_extended_but_not_shortened(tmp_path, capsys):
    run = tmp_path / "run"
    _fake_run(run)
    longer = apply_overrides(preset("tiny"), ["model.n_layers=2", "train.steps=10"])
    assert prepare_run_dir(run, longer, overwrite=False) is True
    err = capsys.readouterr().err
    assert "extending" in err and "from 6 to 10 steps" in err and "change from the step it resumes at on" in err
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 10
    with pytest.raises(RunError, match=r"train.steps: 10 there, 4 now.*not shortened"):
        prepare_run_dir(run, apply_overrides(preset("tiny"), ["model.n_layers=2", "train.steps=4"]), overwrite=False)
    with pytest.raises(RunError, match=r"different run \(train.seed: 0 there, 1 now\)"):
        prepare_run_dir(run, apply_overrides(longer, ["train.seed=1"]), overwrite=False)


def test_a_change_of_steps_is_checked_against_what_the_newest_checkpoint_was_saved_under(tmp_path, capsys):
    """An extension stopped before it saved a step can be taken back: a shortening is refused only below the
    train.steps the newest complete checkpoint was saved under (its metadata's `train_steps`), or when that
    metadata doesn't say (an older checkpoint: refused, as before)."""
    run = tmp_path / "run"
    _fake_run(run)  # 6 steps, a complete checkpoint at step 2
    steps = lambda n: apply_overrides(CFG, [f"train.steps={n}"])
    meta = run / "checkpoints" / "step_00000002" / "metadata.json"
    meta.write_text(json.dumps({"step": 2, "train_steps": 6}))
    assert prepare_run_dir(run, steps(10), overwrite=False) is True  # an extension, stopped before a save
    capsys.readouterr()
    assert prepare_run_dir(run, steps(6), overwrite=False) is True
    assert capsys.readouterr().err == (f"moejax: {run} was set to 10 steps but saved no checkpoint under that; "
                                       "it runs 6 steps now\n")
    assert json.loads((run / "config.json").read_text())["train"]["steps"] == 6
    prepare_run_dir(run, steps(10), overwrite=False)
    capsys.readouterr()
    assert prepare_run_dir(run, steps(8), overwrite=False) is True  # shorter than 10, an extension of 6
    err = capsys.readouterr().err
    assert "was set to 10 steps but saved no checkpoint" in err and "extending" in err and "from 6 to 8 steps" in err
    with pytest.raises(RunError, match=r"train.steps: 8 there, 5 now.*not shortened"):
        prepare_run_dir(run, steps(5), overwrite=False)
    for saved in ({"step": 2, "train_steps": 8}, {"step": 2}, {"step": 2, "train_steps": True}):
        meta.write_text(json.dumps(saved))  # saved under 8; or not recorded: refused
        with pytest.raises(RunError, match=r"train.steps: 8 there, 6 now.*not shortened"):
            prepare_run_dir(run, steps(6), overwrite=False)
    meta.write_text("{")  # unreadable: refused
    with pytest.raises(RunError, match="not shortened"):
        prepare_run_dir(run, steps(6), overwrite=False)
    (run / "checkpoints" / "step_00000002" / "COMMITTED").unlink()  # no complete checkpoint: a restart starts over
    capsys.readouterr()
    assert prepare_run_dir(run, steps(3), overwrite=False) is True
    assert "was set to 8 steps but saved no checkpoint under that; it runs 3 steps now" in capsys.readouterr().err


def test_a_run_may_change_how_the_step_is_laid_out(tmp_path):
    run = tmp_path / "run"
    _fake_run(run)
    relaid = apply_overrides(CFG, ["train.remat=true", "train.scan_layers=true"])  # same math, other program
    assert prepare_run_dir(run, relaid, overwrite=False) is True
    saved = json.loads((run / "config.json").read_text())["train"]
    assert saved["remat"] is True and saved["scan_layers"] is True


def test_a_resume_needs_the_data_it_trained_on(tmp_path):
    """A store prepared again at the same path (other tokenizer, other ids) is refused on resume, config.json
    left as it was; the same store moved elsewhere resumes. A CLI sweep found resumes going on with another
    tokenizer's ids (docs/LOG.md 2026-12-04, twenty-fourth session)."""
    run = tmp_path / "run"
    _fake_run(run)
    trained = {"path": "stores/a", "tokenizer": "bpe:512", "vocab_size": 401, "identity": "a" * 64}
    (run / "run_info.json").write_text(json.dumps({"data": trained}))
    before = (run / "config.json").read_text()
    other = {**trained, "tokenizer": "bpe:300", "vocab_size": 300, "identity": "b" * 64}
    with pytest.raises(RunError, match=r"trained on other data: stores/a \(bpe:512, 401 ids, identity a{12}\) then, "
                                       r"stores/a \(bpe:300, 300 ids, identity b{12}\) now"):
        prepare_run_dir(run, CFG, overwrite=False, data=other)
    assert (run / "config.json").read_text() == before
    moved = apply_overrides(CFG, ["data.store=/elsewhere/a", "data.prefetch=0"])  # same tokens, another place
    assert prepare_run_dir(run, moved, overwrite=False, data={**trained, "path": "/elsewhere/a"}) is True
    (run / "run_info.json").write_text(json.dumps({"data": {"path": "stores/a"}}))  # recorded before identities:
    assert prepare_run_dir(run, moved, overwrite=False, data=other) is True  # not checked, and the path compared
    with pytest.raises(RunError, match=r"data.store: '/elsewhere/a' there, 'stores/b' now"):
        prepare_run_dir(run, apply_overrides(CFG, ["data.store=stores/b"]), overwrite=False, data=other)


def test_a_checkpoint_with_non_finite_weights_is_unusable():
    from types import SimpleNamespace

    import jax.numpy as jnp

    from moejax.train.loop import unusable_state

    ok = SimpleNamespace(params={"w": jnp.ones((3,)), "step": jnp.int32(4)})
    assert unusable_state(ok, {"finite": True}) is None and unusable_state(ok, {}) is None
    assert "non-finite" in unusable_state(SimpleNamespace(params={"w": jnp.array([1.0, jnp.inf])}), {})
    assert "non-finite" in unusable_state(ok, {"finite": False})  # its metadata says so: not even looked at
