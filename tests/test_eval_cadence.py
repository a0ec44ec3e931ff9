"""The eval cadence (SPEC §5): an eval of the initial weights when asked (the hero: at step 0), then every
`train.eval_every` steps and at the end, on `train.eval_batch_size` sequences per eval batch."""

import json

import jax
import jax.numpy as jnp
import pytest

from moejax.config import apply_overrides
from moejax.data.pipeline import make_data
from moejax.parallel.mesh import make_mesh
from moejax.presets import preset
from moejax.train.loop import RunOptions, evaluate, train
from moejax.train.optimizer import make_optimizer
from moejax.train.state import init_state
from moejax.train.step import make_eval_step

OPTS = RunOptions(wandb="disabled", progress=False, peak_flops=1e11)
SAME_PROGRAM_RTOL = 1e-6  # the loop's eval and this one run the same jitted eval step on the same weights


def test_eval_at_start_every_n_and_at_the_end(tmp_path):
    cfg = apply_overrides(preset("tiny"), ["model.n_layers=2", "train.batch_size=8", "train.seq_len=64",
                                           "train.steps=3", "train.eval_every=2", "train.eval_at_start=true",
                                           "train.eval_batch_size=4", "train.eval_batches=1"])
    train(cfg, tmp_path / "run", OPTS)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 0, 1, 2]
    assert set(rows[0]) == {"step", "eval/loss", "eval/bpb", "eval/drop_fraction"}  # the initial weights' row
    assert ["eval/loss" in r for r in rows[1:]] == [False, True, True]  # after 2 steps, and at the end

    with make_data(cfg) as data:
        assert data.eval.batch(0)["tokens"].shape == (4, 64)  # eval_batch_size sequences, not the train batch
        state = init_state(cfg, make_optimizer(cfg)[0], jax.random.key(cfg.train.seed), make_mesh(cfg.parallel))
        eval_step = make_eval_step(cfg.model, scan_layers=cfg.train.scan_layers)  # as the loop builds it
        initial = evaluate(jax.jit(eval_step), state.compute, data.eval, 1,
                           jnp.asarray(data.bytes_per_token), "eval/")
    assert rows[0]["eval/loss"] == pytest.approx(initial["eval/loss"], rel=SAME_PROGRAM_RTOL)
    assert rows[-1]["eval/loss"] < rows[0]["eval/loss"]  # and the later evals see trained weights


def test_no_evaluation_is_one_setting():
    """train.eval_batches=0 turns evaluation off, whatever the cadence says (the tiny preset evaluates every 100
    steps, the hero also at start). The loop then evaluates nowhere and compiles no eval step: test_alarms'
    runs, with eval_every=5 and eval_at_start=true, have no eval row and no eval key."""
    from moejax.config import ConfigError

    for name in ("tiny", "hero"):
        assert apply_overrides(preset(name), ["train.eval_batches=0"]).train.eval_batches == 0
    # Nor do the eval rows have to divide over the batch shards then (tiny's 4 shards with data=2, expert=2).
    bad_rows = ["parallel.data=2", "parallel.expert=2", "train.eval_batch_size=6"]
    with pytest.raises(ConfigError, match=r"eval_batch_size \(6\) is not divisible by the batch shards"):
        apply_overrides(preset("tiny"), bad_rows)
    assert apply_overrides(preset("tiny"), [*bad_rows, "train.eval_batches=0"]).train.eval_batch_size == 6
    with pytest.raises(ConfigError, match=r"eval_batches \(-1\) must be >= 0"):
        apply_overrides(preset("tiny"), ["train.eval_batches=-1"])
