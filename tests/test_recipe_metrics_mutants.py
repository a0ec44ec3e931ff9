"""Metrics, evaluation, alarms, summary and report (SPEC §5) against numbers computed here from their definitions.

Each test kills one or more mutants of a metrics audit that the rest of the suite let through: aggregates of
the per-layer router metrics, the router's token entropy and load ratio, the step's learning rate / grad norm /
param norm, the held-out loss and bits per byte, the summary's running totals, the grad-norm alarm's window,
the report's keys, and the W&B / metrics.jsonl sinks.
"""

import dataclasses
import json
import math
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import metrics as metrics_mod
from moejax.config import AlarmConfig, ParallelConfig, RunConfig, TrainConfig
from moejax.metrics import MetricsWriter, read_metrics
from moejax.model.moe.router import route, router_stats
from moejax.model.transformer import Transformer, model_loss
from moejax.report import FIGURES
from moejax.train.alarms import Alarms
from moejax.train.loop import _throughput, evaluate
from moejax.train.monitor import COMPILE_STEPS, SEGMENT_KEY, RunTotals, StepLog
from moejax.train.optimizer import make_optimizer
from moejax.train.state import differentiated_copy, init_state
from moejax.train.step import make_eval_step, make_train_step, moe_metrics
from tests.helpers import loop_steps, toy_batch, toy_model

FP32_RTOL = 1e-5  # fp32 reductions over a few hundred terms against float64
NORM_RTOL = 1e-5  # a global norm over ~10^4 fp32 values against float64


# ---- per-layer router metrics and their aggregates --------------------------------------------------------
def test_router_metric_aggregates_are_layer_means_and_the_worst_load_ratio():
    """`train/router/load_balancing_loss` and `router_z_loss` are means over layers (the reference dashboard's
    layer-averaged curves), `max_over_mean_load` the worst layer's: distinct values per layer so a sum, a max
    or a mean in the wrong place shows."""
    lb_L, z_L, ratio_L = np.array([1.0, 4.0, 1.5]), np.array([0.5, 1.5, 4.0]), np.array([1.2, 3.0, 2.0])
    layers = {"valid": np.full(3, 100), "sender_dropped": np.zeros(3, int), "receiver_dropped": np.zeros(3, int),
              "load": np.ones((3, 4)), "entropy": np.zeros(3), "load_balancing_loss": lb_L, "router_z_loss": z_L,
              "max_over_mean_load": ratio_L}
    m = {k: float(v) for k, v in moe_metrics(layers, 3).items()}
    np.testing.assert_allclose(m["train/router/load_balancing_loss"], lb_L.mean(), rtol=FP32_RTOL)
    np.testing.assert_allclose(m["train/router/router_z_loss"], z_L.mean(), rtol=FP32_RTOL)
    np.testing.assert_allclose(m["train/router/max_over_mean_load"], ratio_L.max(), rtol=FP32_RTOL)


def test_router_token_entropy_and_load_ratio_count_valid_tokens_only_in_nats():
    """router_stats: the per-token entropy of softmax(logits) in nats averaged over *valid* tokens, and the
    max / mean expert load over the valid tokens' K assignments (float64 here, from the logits)."""
    rng = np.random.default_rng(7)
    n_tok, d, n_exp, k, n_valid = 40, 16, 8, 2, 25
    m = jnp.asarray(rng.normal(size=(n_tok, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(d, n_exp)), jnp.float32)
    r = route(m, w, jnp.zeros((n_exp,)), top_k=k, combine_scale=2.5)
    mask = np.arange(n_tok) < n_valid
    stats = router_stats(r, jnp.asarray(mask))

    logits = (np.asarray(m, np.float64) @ np.asarray(w, np.float64))[mask]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    entropy = -(p * np.log(p)).sum(1).mean()
    chosen = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    load = np.bincount(chosen.ravel(), minlength=n_exp).astype(float)
    np.testing.assert_allclose(stats["entropy"], entropy, rtol=FP32_RTOL)
    np.testing.assert_allclose(stats["load"], load)
    np.testing.assert_allclose(stats["max_over_mean_load"], load.max() / load.mean(), rtol=FP32_RTOL)


# ---- the train step's logged scalars ------------------------------------------------------------------------
STEP_AT = 3  # inside the warmup (10 of 100 steps): lr(3) != lr(4), so a step off by one shows
STEPS, WARMUP = 100, 0.1


@pytest.fixture(scope="module")
def one_step():
    """One jitted train step (toy model, no QB: the router bias stays 0 so the param norm is the params') at
    state.step = STEP_AT, with the hero optimizer's two lr groups (muonh first, as make_optimizer builds them)."""
    model = toy_model(n_layers=2, qb=False)
    cfg = RunConfig(model=model, train=TrainConfig(seq_len=16, batch_size=2, steps=STEPS, optimizer="adam",
                                                   learning_rate=1e-2, warmup_fraction=WARMUP))
    # Adam without warmup applies a non-zero update at its own count 0 (the step counter is set ahead below);
    # the logged lrs come from the hero's two warmed-up schedules, passed to the step separately.
    tx, _ = make_optimizer(replace(cfg, train=replace(cfg.train, warmup_fraction=0.0)))
    _, lr_fns = make_optimizer(replace(cfg, train=replace(cfg.train, optimizer="hero")))
    assert list(lr_fns) == ["muonh", "adam"]
    state = init_state(cfg, tx, jax.random.key(0))
    state = dataclasses.replace(state, step=jnp.asarray(STEP_AT, state.step.dtype))
    before = jax.tree.map(np.asarray, state.params)
    batch = toy_batch(model, batch=2, seq=16)
    new_state, metrics = jax.jit(make_train_step(model, tx, lr_fns, remat=False))(state, batch)
    return model, state, before, batch, lr_fns, new_state, {k: np.asarray(v) for k, v in metrics.items()}


def _norm64(tree) -> float:
    return math.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in jax.tree.leaves(tree)))


def test_step_logs_the_first_groups_learning_rate_of_this_step(one_step):
    """`train/learning_rate` is the matrices' (muonh, first) group's lr at the step being taken, and each
    group's lr is logged under its name: not the next step's lr, not the Adam group's."""
    _, _, _, _, lr_fns, _, m = one_step
    lr = {g: float(fn(STEP_AT)) for g, fn in lr_fns.items()}
    assert lr["muonh"] != float(lr_fns["muonh"](STEP_AT + 1)) and lr["muonh"] != lr["adam"]  # discriminating
    np.testing.assert_allclose(m["train/learning_rate"], lr["muonh"], rtol=FP32_RTOL)
    for g in lr_fns:
        np.testing.assert_allclose(m[f"train/learning_rate/{g}"], lr[g], rtol=FP32_RTOL)


def test_step_grad_norm_is_the_raw_gradients_and_param_norm_the_new_weights(one_step):
    """`train/grad_norm`: the global norm of the loss gradient itself (recomputed here with jax.grad, norm in
    float64), not of the optimizer's update; `train/param_norm`: of *all* updated weights, not the old ones
    nor a subset."""
    model, state, before, batch, _, new_state, m = one_step
    grads = jax.grad(lambda p: model_loss(p, batch, model, remat=False)[0])(differentiated_copy(state.compute))
    np.testing.assert_allclose(m["train/grad_norm"], _norm64(grads), rtol=NORM_RTOL)
    after = _norm64(new_state.params)
    assert abs(after - _norm64(before)) > 100 * NORM_RTOL * after  # the step moved the norm: discriminating
    np.testing.assert_allclose(m["train/param_norm"], after, rtol=NORM_RTOL)


# ---- evaluation ----------------------------------------------------------------------------------------------
class _Batches:
    """Stands in for the eval data: batch(i) is just i (the fake eval step below looks its numbers up)."""

    def batch(self, i):
        return i


def test_evaluate_pools_tokens_and_bytes_over_batches():
    """Held-out loss = sum of CE over sum of tokens (per token, not per batch); bits per byte = the same CE sum
    in bits over the sum of UTF-8 bytes; every batch read once. Batches with different token counts and
    bytes-per-token make a per-batch mean, a token count in place of bytes or nats in place of bits show."""
    ce_sum, tokens, nbytes = [30.0, 10.0, 50.0], [10.0, 2.0, 20.0], [40.0, 3.0, 90.0]
    # Dropped over valid routing assignments, pooled (SPEC §3): batch 1 is mostly padding (few valid), so the
    # mean of the per-batch fractions (0.1, 0.5, 0.2 -> 0.267) is not the pooled 0.16.
    dropped, valid = [8.0, 4.0, 32.0], [80.0, 8.0, 160.0]
    fn = lambda params, i, bpt: {"ce_sum": ce_sum[i], "tokens": tokens[i], "bytes": nbytes[i],
                                 "dropped": dropped[i], "valid": valid[i]}
    out = evaluate(fn, None, _Batches(), 3, None, "eval/")
    np.testing.assert_allclose(out["eval/loss"], sum(ce_sum) / sum(tokens), rtol=1e-12)
    np.testing.assert_allclose(out["eval/bpb"], sum(ce_sum) / math.log(2.0) / sum(nbytes), rtol=1e-12)
    np.testing.assert_allclose(out["eval/drop_fraction"], sum(dropped) / sum(valid), rtol=1e-12)


def test_eval_step_counts_the_bytes_of_the_scored_targets():
    """The eval step's byte count is sum of bytes_per_token[target] over positions the loss scores (loss_mask),
    so bpb matches its CE: padding and document ends carry no bytes, and inputs are not the targets."""
    model = toy_model(n_layers=1)
    batch = toy_batch(model, batch=2, seq=16, doc_lens=((5, 7), (16,)))  # padding and a document boundary
    bpt = np.random.default_rng(3).integers(1, 5, model.vocab_size).astype(np.int32)
    params = Transformer.init(model, jax.random.key(0))
    out = jax.jit(make_eval_step(model))(params, batch, jnp.asarray(bpt))
    mask, targets = np.asarray(batch["loss_mask"]), np.asarray(batch["targets"])
    assert mask.sum() < mask.size  # the mask really excludes positions
    assert float(out["bytes"]) == float(bpt[targets][mask].sum())
    assert float(out["tokens"]) == float(mask.sum())
    # The counts `evaluate` pools are those of the batch's own drop fraction.
    assert float(out["dropped"]) / float(out["valid"]) == pytest.approx(float(out["moe/drop_fraction"]), rel=1e-6)


def test_dropless_eval_drops_nothing_where_the_capacity_path_drops():
    """SPEC §5: the dropless eval runs the same weights on the local path. At a capacity factor that drops on
    the EP transport, `eval/` reports drops and `eval_dropless/` none (the loop's own jitted eval steps)."""
    model = toy_model(n_layers=2)
    par = ParallelConfig(expert=8, cf_send=0.5, cf_recv=0.5)
    cfg, state, batch, _, eval_fns = loop_steps(model, par, batch_size=8, seq_len=16)
    bpt = jnp.ones((model.vocab_size,), jnp.int32)
    ep = eval_fns["eval/"](state.compute, batch, bpt)
    local = eval_fns["eval_dropless/"](state.compute, batch, bpt)
    assert float(ep["moe/drop_fraction"]) > 0.0
    assert float(local["moe/drop_fraction"]) == 0.0


# ---- summary totals -----------------------------------------------------------------------------------------
def _rows():
    """Rows of a 6-step segment: evals at steps 2 and 5, throughput rising every step, wall clock rising."""
    rows = []
    for s in range(6):
        r = {"step": s, "train/loss": 7.0 - 0.1 * s, "throughput/tokens_per_second": 100.0 * (s + 1),
             "throughput/mfu": 0.01 * (s + 1) ** 2, "time/wall_seconds": 10.0 * (s + 1)}
        if s in (2, 5):
            r.update({"eval/loss": 6.0 - s, "eval/bpb": 2.0 - 0.1 * s, "eval_dropless/loss": 5.9 - s,
                      "eval_dropless/bpb": 1.9 - 0.1 * s})
        rows.append(r)
    return rows


def test_summary_rebuilt_from_rows_reports_the_latest_eval_wall_and_steady_median():
    """RunTotals.from_rows (a resume's earlier segments): the latest eval (and its step) of each eval key, the
    last row's wall clock, and medians of tokens/s and MFU over the steady steps only (the first COMPILE_STEPS
    steps of a run are compile-dominated)."""
    rows = _rows()
    s = RunTotals.from_rows(rows).summary("x", 6, 0.0)
    assert (s["eval/loss"], s["eval/bpb"], s["eval_dropless/loss"], s["eval_dropless/bpb"], s["eval_step"]) == \
        (rows[5]["eval/loss"], rows[5]["eval/bpb"], rows[5]["eval_dropless/loss"], rows[5]["eval_dropless/bpb"], 5)
    assert RunTotals.from_rows(rows).wall_before == rows[-1]["time/wall_seconds"]
    steady = rows[COMPILE_STEPS:]
    assert s["tokens_per_second"] == np.median([r["throughput/tokens_per_second"] for r in steady])
    assert s["mfu"] == pytest.approx(np.median([r["throughput/mfu"] for r in steady]), rel=1e-12)


def test_a_restarts_first_steps_are_left_out_of_the_throughput(tmp_path):
    """StepLog of a resumed segment (steps 10..15): its own first COMPILE_STEPS steps compile again, so their
    tokens/s (slow) stay out of the median, whatever their global step number."""
    cfg = replace(RunConfig(), train=replace(TrainConfig(), log_every=1, load_log_every=0),
                  alarms=AlarmConfig(enabled=False))
    writer = MetricsWriter(tmp_path, wandb_mode="disabled")
    log = StepLog(cfg, writer, RunTotals(), emit=lambda line: None)
    tps = [1.0, 2.0, 1000.0, 1010.0, 1020.0, 1030.0]
    for i, step in enumerate(range(10, 16)):
        m = {"train/loss": 5.0, "throughput/tokens_per_second": tps[i], "throughput/mfu": tps[i] / 1e4}
        log.record(step, m, None, last=i == len(tps) - 1)
    writer.close()
    s = log.summary("x", 16)
    assert s["tokens_per_second"] == np.median(tps[COMPILE_STEPS:])
    assert s["mfu"] == pytest.approx(np.median(tps[COMPILE_STEPS:]) / 1e4, rel=1e-12)
    rows = list(read_metrics(tmp_path))
    assert [r[SEGMENT_KEY] for r in rows] == list(range(len(tps)))


def test_a_restarts_first_steps_are_left_out_of_the_rebuilt_throughput_too():
    """RunTotals.from_rows over two segments (a resume at step 6): the second segment's first COMPILE_STEPS rows
    (slow: it compiled again) stay out of the median, as they do while it runs; they used to count, since only
    the run's own first steps were known (docs/LOG.md, thirty-seventh session). Rows written before SEGMENT_KEY
    existed still leave out the run's first steps."""
    tps = [1.0, 2.0, 100.0, 110.0, 120.0, 130.0, 3.0, 4.0, 140.0, 150.0, 160.0, 170.0]
    rows = [{"step": s, "train/loss": 5.0, "throughput/tokens_per_second": t, "throughput/mfu": t / 1e4,
             SEGMENT_KEY: s % 6} for s, t in enumerate(tps)]
    steady = [t for s, t in enumerate(tps) if s % 6 >= COMPILE_STEPS]
    assert RunTotals.from_rows(rows).summary("x", 12, 0.0)["tokens_per_second"] == np.median(steady)
    old = [{k: v for k, v in r.items() if k != SEGMENT_KEY} for r in rows]
    assert RunTotals.from_rows(old).summary("x", 12, 0.0)["tokens_per_second"] == np.median(tps[COMPILE_STEPS:])


# ---- grad-norm alarm ---------------------------------------------------------------------------------------
def test_a_lasting_grad_norm_level_shift_alarms_once_then_clears():
    """A spike enters the window (alarms.py): when the grad norm moves to a new level and stays there, the alarm
    is raised once and cleared once the window's median has caught up, instead of staying raised for ever."""
    window, spike = 5, 10.0
    a = Alarms(AlarmConfig(every=1, window=window, grad_spike=spike))
    norms = [1.0] * window + [50.0] * (2 * window)
    lines = [x.line() for step, g in enumerate(norms) for x in a.check(step, {"train/grad_norm": g})]
    assert len(lines) == 2, lines
    assert "raised at step 5" in lines[0] and "cleared at step" in lines[1]
    assert a.active == set()


# ---- report -------------------------------------------------------------------------------------------------
def test_every_report_curve_reads_a_key_the_run_writes(one_step):
    """The report plots keys by name: each must be one a run really writes (the train step's metrics, the
    loop's throughput, both evals), or its curve silently never appears."""
    *_, m = one_step
    fake = lambda params, i, bpt: {"ce_sum": 1.0, "tokens": 1.0, "bytes": 1.0, "dropped": 0.0, "valid": 1.0}
    written = set(m) | set(_throughput(RunConfig(), 4096, 1.0, 1e12))
    for prefix in ("eval/", "eval_dropless/"):
        written |= set(evaluate(fake, None, _Batches(), 1, None, prefix))
    plotted = {key for _, _, panels in FIGURES for _, _, curves in panels for key, _ in curves}
    assert plotted <= written, plotted - written


# ---- sinks --------------------------------------------------------------------------------------------------
def test_metrics_rows_are_strict_json_and_wandb_gets_the_step(tmp_path, monkeypatch):
    """metrics.jsonl holds strict JSON (a non-finite value as a string, never NaN/Infinity), and W&B (offline)
    gets each row's scalars at that row's step, the list-valued entries (loads, alarms) left out."""
    logged = []

    class FakeRun:
        def log(self, data, step=None):
            logged.append((step, data))

        def finish(self):
            pass

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(metrics_mod, "_wandb_init", lambda **kw: FakeRun())
    writer = MetricsWriter(tmp_path, wandb_mode="offline")
    # the step's scalars arrive as numpy scalars (jax.device_get): a diverged grad norm is np.float32 NaN
    writer.log(7, {"train/loss": 2.5, "train/grad_norm": np.float32("nan"), "train/router/load": np.ones((2, 3))})
    writer.close()

    def no_constants(c):
        raise AssertionError(f"non-JSON constant {c} in metrics.jsonl")

    line = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(line, parse_constant=no_constants)
    assert row["train/grad_norm"] == "nan" and read_metrics(tmp_path)[0]["step"] == 7
    assert len(logged) == 1 and logged[0][0] == 7
    assert set(logged[0][1]) == {"step", "train/loss", "train/grad_norm"}


def test_every_restart_logs_to_the_runs_one_wandb_run(tmp_path, monkeypatch):
    """Each restart of a preempted run opened a new W&B run (resume="allow" without an id): a live run's
    dashboard split into one run per segment. The id is made once and kept in RUN_DIR/wandb (which --overwrite
    clears); a resumed W&B run that already holds the steps a restart redoes gets only the new ones."""
    from moejax.metrics import WANDB_ID_FILE
    from moejax.train.run_dir import clear_run_dir

    inits, logged = [], []

    class ResumedRun:
        step = 5  # W&B's next step of a resumed run (online): it already holds steps 0-4

        def log(self, data, step=None):
            logged.append(step)

        def finish(self):
            pass

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setattr(metrics_mod, "_wandb_init", lambda **kw: inits.append(kw) or ResumedRun())
    run, other = tmp_path / "run", tmp_path / "other"
    for d in (run, run, other):
        d.mkdir(exist_ok=True)
        MetricsWriter(d, wandb_mode="offline").close()
    ids = [kw["id"] for kw in inits]
    assert ids[0] == ids[1] != ids[2] and (run / "wandb" / WANDB_ID_FILE).read_text().strip() == ids[0]
    writer = MetricsWriter(run, wandb_mode="offline")
    for step in range(3, 8):  # a restart from the checkpoint at step 3
        writer.log(step, {"train/loss": 1.0})
    writer.close()
    assert logged == [5, 6, 7] and [r["step"] for r in read_metrics(run)] == [3, 4, 5, 6, 7]
    (run / "config.json").write_text(json.dumps({"model": {}, "train": {}, "parallel": {}}))
    clear_run_dir(run)  # --overwrite: a new run, a new W&B run
    MetricsWriter(run, wandb_mode="offline").close()
    assert inits[-1]["id"] not in ids
