"""Preemption and exact resume through the real CLI: N steps straight == N/2 + SIGTERM + resume, bitwise."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from moejax.checkpoint import list_checkpoints, restore
from moejax.preemption import EXIT_PREEMPTED
from moejax.config import RunConfig
from moejax.train.optimizer import make_optimizer
from moejax.train.state import init_state
from tests.helpers import subprocess_xla_flags

ARGS = ["--preset", "tiny", "--steps", "8", "--no-progress", "--peak-flops", "1e11",
        "--set", "model.n_layers=2", "--set", "train.batch_size=4", "--set", "train.seq_len=64",
        "--set", "train.eval_every=0", "--set", "train.eval_batches=1"]


def train(run_dir, fault_at=0):
    env = {**os.environ, "WANDB_MODE": "disabled", "XLA_FLAGS": subprocess_xla_flags(), "MOEJAX_FAULT_SIGTERM_AT_STEP": str(fault_at)}
    return subprocess.run([sys.executable, "-m", "moejax.cli", "train", "--run-dir", str(run_dir), *ARGS],
                          capture_output=True, text=True, env=env, timeout=600)


def final_state(run_dir):
    cfg = RunConfig.from_dict(json.loads((run_dir / "config.json").read_text()))
    state = init_state(cfg, make_optimizer(cfg)[0], jax.random.key(0))
    newest = [c for c in list_checkpoints(run_dir) if c.complete][-1]
    return restore(newest.path, state)


def test_sigterm_then_resume_is_bit_identical(tmp_path):
    straight, broken = tmp_path / "straight", tmp_path / "broken"
    r = train(straight)
    assert r.returncode == 0, r.stderr
    r = train(broken, fault_at=4)
    assert r.returncode == EXIT_PREEMPTED, r.stderr
    assert "preempted after step 4" in r.stderr
    assert [c.step for c in list_checkpoints(broken) if c.complete] == [4]
    r = train(broken)  # the same command resumes
    assert r.returncode == 0, r.stderr

    rows = lambda d: [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    a, b = rows(straight), rows(broken)
    assert [x["step"] for x in b] == list(range(8))  # each step logged once
    for key in ("train/loss", "train/grad_norm", "train/param_norm", "eval/loss"):
        assert [x.get(key) for x in a] == [x.get(key) for x in b], key
    # The resumed run's summary covers the whole run (issue 13 item 9), not only steps 4..7.
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (straight, broken))
    assert sb["steps"] == sa["steps"] == 8 and sb["first_step"] == 0
    assert sb["first_loss"] == sa["first_loss"] == b[0]["train/loss"] and sb["last_loss"] == sa["last_loss"]
    assert sb["wall_seconds"] > b[3]["time/wall_seconds"] > 0  # earlier segments' time included
    (sa, ma), (sb, mb) = final_state(straight), final_state(broken)
    assert ma["step"] == mb["step"] == 8
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow  # tests/test_export.py covers --init-from RUN_DIR in-process on the session's tiny run
def test_init_from_starts_a_new_run_at_step_zero(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    assert train(src).returncode == 0
    env = {**os.environ, "WANDB_MODE": "disabled", "XLA_FLAGS": subprocess_xla_flags()}
    r = subprocess.run([sys.executable, "-m", "moejax.cli", "train", "--run-dir", str(dst), "--init-from", str(src),
                        *[a if a != "8" else "2" for a in ARGS]], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in (dst / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0
    src_rows = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["train/loss"] < src_rows[0]["train/loss"] - 0.5  # starts from trained weights, not from init
