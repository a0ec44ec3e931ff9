"""Training with expert parallelism on 8 forced CPU devices: tracks the single-device run, pinned-host state
matches device state exactly, a preempted EP run resumes bit-identically, and its checkpoint reshards."""

import json
from dataclasses import replace

import jax
import numpy as np
import pytest

from moejax.checkpoint import list_checkpoints, restore
from moejax.config import apply_overrides, ParallelConfig
from moejax.presets import preset
from moejax.parallel.mesh import make_mesh
from moejax.train.loop import Preempted, RunOptions, train
from moejax.train.optimizer import make_optimizer
from moejax.train.run_dir import RunError, prepare_run_dir
from moejax.train.state import init_state

OPTS = RunOptions(wandb="disabled", progress=False, peak_flops=1e11)
# EP vs local, per step, in fp32 with capacity factors that drop nothing: the same math up to the order of
# reductions (sharded matmul/grad sums, psum'd QB statistics), amplified by the bf16 Newton-Schulz of later
# updates. Measured on CPU: 6e-8 at steps 0-1, growing to 2.6e-6 at step 4; a step moves the loss by 1e-3 to
# 2e-2, so a wrong combine weight, a lost assignment or a mis-sharded gradient shows up within a step.
NO_DROP_CF = 8.0
EP_LOSS_RTOL = 2e-5


def small(steps=5, eval_batches=1, **parallel):
    cfg = apply_overrides(preset("tiny"), ["model.n_layers=2", "train.batch_size=8", "train.seq_len=64",
                                           f"train.steps={steps}", "train.eval_every=0",
                                           f"train.eval_batches={eval_batches}"])
    return replace(cfg, parallel=ParallelConfig(**parallel))


def ep4():
    """The pinned-host and preemption tests' config: 4 steps on data=2 x expert=4, no eval (not compared)."""
    return small(steps=4, eval_batches=0, data=2, expert=4)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One uninterrupted device-state run of `ep4()`, the reference of both tests below."""
    run = tmp_path_factory.mktemp("ep4") / "straight"
    train(ep4(), run, OPTS)
    return run


def small_fp32_no_drop(**parallel):
    cfg = apply_overrides(small(), ["model.compute_dtype=float32"])
    return replace(cfg, parallel=ParallelConfig(**parallel, cf_send=NO_DROP_CF, cf_recv=NO_DROP_CF))


def losses(run_dir):
    return [json.loads(line)["train/loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_ep_run_equals_single_device_per_step(tmp_path):
    train(small_fp32_no_drop(), tmp_path / "one", OPTS)
    summary = train(small_fp32_no_drop(data=2, expert=4), tmp_path / "ep", OPTS)
    a, b = losses(tmp_path / "one"), losses(tmp_path / "ep")
    assert len(a) == len(b) == 5 and a[-1] < a[0]
    for step, (x, y) in enumerate(zip(a, b)):
        assert y == pytest.approx(x, rel=EP_LOSS_RTOL), (step, x, y)
    assert "eval_dropless/loss" in summary  # the dropless eval runs the same weights on the local path
    assert summary["eval/loss"] == pytest.approx(summary["eval_dropless/loss"], rel=EP_LOSS_RTOL)
    rows = [json.loads(line) for line in (tmp_path / "ep" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["moe/drop_fraction"] == 0.0 for r in rows)  # so the comparison above is EP vs local, nothing else


def test_pinned_host_state_equals_device_state(tmp_path, straight):
    cfg = ep4()
    train(replace(cfg, train=replace(cfg.train, opt_state_memory="pinned_host")), tmp_path / "host", OPTS)
    assert losses(straight) == losses(tmp_path / "host")
    mesh = make_mesh(cfg.parallel)
    target = init_state(cfg, make_optimizer(cfg)[0], jax.random.key(0), mesh)
    (sa, _), (sb, _) = (restore(list_checkpoints(d)[-1].path, target) for d in (straight, tmp_path / "host"))
    for x, y in zip(jax.tree.leaves(sa), jax.tree.leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_preempted_ep_run_resumes_bit_identically_and_reshards(tmp_path, monkeypatch, straight):
    cfg = ep4()
    run = tmp_path / "run"
    monkeypatch.setenv("MOEJAX_FAULT_SIGTERM_AT_STEP", "2")
    with pytest.raises(Preempted):
        train(cfg, run, OPTS)
    monkeypatch.delenv("MOEJAX_FAULT_SIGTERM_AT_STEP")
    ckpt = [c for c in list_checkpoints(run) if c.complete][-1]
    assert ckpt.step == 2
    saved, _ = restore(ckpt.path, init_state(cfg, make_optimizer(cfg)[0], jax.random.key(0), make_mesh(cfg.parallel)))

    # The step-2 checkpoint restores bit-identically onto expert=8 and onto a single device (checked before
    # the resume: a temporary checkpoint is deleted once a newer one completes).
    for par in (ParallelConfig(expert=8), ParallelConfig()):
        other = replace(cfg, parallel=par)
        got, meta = restore(ckpt.path, init_state(other, make_optimizer(other)[0], jax.random.key(1), make_mesh(par)))
        assert meta["step"] == 2
        for x, y in zip(jax.tree.leaves(saved), jax.tree.leaves(got)):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    train(cfg, run, OPTS)  # the same call resumes on the same 8-device EP mesh: bit-identical
    assert losses(run) == losses(straight)
    target = init_state(cfg, make_optimizer(cfg)[0], jax.random.key(0), make_mesh(cfg.parallel))
    (a, _), (b, _) = (restore(list_checkpoints(d)[-1].path, target) for d in (straight, run))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_run_dir_accepts_a_new_mesh_but_not_a_new_model(tmp_path):
    run = tmp_path / "run"
    cfg = small(data=2, expert=4)
    assert prepare_run_dir(run, cfg, overwrite=False) is False
    assert prepare_run_dir(run, replace(cfg, parallel=ParallelConfig(expert=8)), overwrite=False) is True
    assert json.loads((run / "config.json").read_text())["parallel"]["expert"] == 8
    with pytest.raises(RunError, match=r"already holds a different run \(model.n_layers: 2 there, 3 now\)"):
        prepare_run_dir(run, apply_overrides(cfg, ["model.n_layers=3"]), overwrite=False)
