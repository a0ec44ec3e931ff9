"""Routing-health alarms on synthetic metric streams: each kind is raised once when its condition has held
long enough, stays quiet while it lasts, and clears when it goes; plus config validation and the row format."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest

from moejax.config import AlarmConfig, ConfigError, RunConfig, apply_overrides
from moejax.train.alarms import Alarm, Alarms, alarm_fields, fitted_rise

L, E = 2, 8
BALANCED_LE = np.full((L, E), 10.0)


def collapsed(layer=1, expert=5, share=50.0):
    load = BALANCED_LE.copy()
    load[layer, expert] = share
    return load


def run(alarms, stream, start=0):
    """Feed (metrics, load) pairs from `start`; returns {step: [alarm lines]} of the steps that had any."""
    out = {}
    for step, (metrics, load) in enumerate(stream, start):
        got = alarms.check(step, metrics, load)
        if got:
            out[step] = [a.line() for a in got]
    return out


def cfg(**kw):
    return AlarmConfig(**{"every": 1, "patience": 3, "window": 5, **kw})


def test_collapse_needs_patience_consecutive_checks_then_clears():
    a = Alarms(cfg(collapse_ratio=3.0))  # collapsed(): 50 / mean(10*7 + 50)/8 = 3.33
    stream = [({}, BALANCED_LE), ({}, collapsed()), ({}, collapsed()), ({}, BALANCED_LE)]  # 2 < patience
    stream += [({}, collapsed())] * 5 + [({}, BALANCED_LE)]
    got = run(a, stream)
    assert sorted(got) == [6, 9]
    assert got[6] == ["alarm collapse raised at step 6, layer 1, expert 5: max/mean expert load 3.33 >= 3 for 3 "
                      "checks (expert 5 takes 41.7% of the layer's assignments)"]
    assert got[9] == ["alarm collapse cleared at step 9, layer 1: max/mean expert load 1.00 < 3"]
    assert a.active == set()


def test_checks_run_every_n_steps_only():
    a = Alarms(cfg(every=5, collapse_ratio=3.0))
    # Collapsed on every step except the checks at 0, 5, 10: never three bad checks in a row.
    stream = [({}, BALANCED_LE if s % 5 == 0 else collapsed()) for s in range(12)]
    assert run(a, stream) == {}
    stream = [({}, collapsed()) for _ in range(12)]  # checks at 0, 5, 10 -> raised at 10
    assert list(run(Alarms(cfg(every=5, collapse_ratio=3.0)), stream)) == [10]


def test_dead_experts_one_line_per_layer_and_back():
    a = Alarms(cfg())
    dead = BALANCED_LE.copy()
    dead[0, [2, 6]] = 0.0
    got = run(a, [({}, dead)] * 4 + [({}, BALANCED_LE)])
    assert got[2] == ["alarm dead_expert raised at step 2, layer 0, expert 2: 2 expert(s) at load/mean <= 0.01 "
                      "for 3 checks (lowest 0): 2, 6"]
    assert a.active == set() and got[4] == ["alarm dead_expert cleared at step 4, layer 0, expert 2: "
                                            "2 expert(s) back above load/mean 0.01: 2, 6"]
    assert sorted(got) == [2, 4]


def test_drop_above_threshold_then_clear():
    a = Alarms(cfg(drop_max=0.1))
    stream = [({"moe/drop_fraction": v}, None) for v in (0.02, 0.2, 0.2, 0.2, 0.2, 0.02)]
    got = run(a, stream)
    assert got == {3: ["alarm drop raised at step 3: drop fraction 0.2000 >= 0.1 for 3 checks"],
                   5: ["alarm drop cleared at step 5: drop fraction 0.0200 < 0.1, fitted rise -0.1440 < 0.03"]}


def test_drop_rising_steadily_over_the_window():
    a = Alarms(cfg(drop_max=0.5, drop_rise=0.03))
    rising = [0.01, 0.02, 0.03, 0.045, 0.05]  # fitted rise 0.042 over 5 checks, every value under drop_max
    flat = [0.05] * 5
    got = run(a, [({"moe/drop_fraction": v}, None) for v in rising + flat])
    assert got[4] == ["alarm drop raised at step 4: drop fraction rising: 0.0100 -> 0.0500 over the last 5 checks "
                      "(fitted rise 0.0420 >= 0.03)"]
    assert sorted(got) == [4, 6] and "cleared" in got[6][0]  # the fitted line flattens as the ramp leaves


def test_bias_drift_unbounded_growth_and_absolute_cap():
    grow = [{"train/router/bias_range": 2.0 ** i, "train/router/bias_range_layer": 3} for i in range(5)]
    flat = [{"train/router/bias_range": 16.0, "train/router/bias_range_layer": 3}] * 5
    got = run(Alarms(cfg(bias_range_max=100.0)), [(m, None) for m in grow + flat])
    assert got[4] == ["alarm bias_drift raised at step 4, layer 3: router-bias range growing: 1 -> 16 over the last "
                      "5 checks (fitted rise 14.4 >= 1 x mean 6.2)"]
    assert sorted(got) == [4, 7] and "cleared" in got[7][0]  # [8, 16, 16, 16, 16]: rise 6.4 < mean 14.4
    got = run(Alarms(cfg(bias_range_max=10.0)), [({"train/router/bias_range": v}, None) for v in (1.0, 12.0, 1.0)])
    assert got[1] == ["alarm bias_drift raised at step 1: router-bias range 12 >= 10"] and "cleared" in got[2][0]


def test_a_noisy_steady_qb_bias_and_drop_raise_nothing():
    rng = np.random.default_rng(0)
    stream = [({"train/router/bias_range": 1.0 + 0.1 * rng.standard_normal(),
                "moe/drop_fraction": 0.03 + 0.005 * rng.standard_normal(),
                "train/grad_norm": 1.0 + 0.3 * rng.random()}, BALANCED_LE * rng.uniform(0.7, 1.3, (L, E)))
              for _ in range(500)]
    assert run(Alarms(AlarmConfig(every=1)), stream) == {}


def test_grad_norm_spike_and_non_finite():
    a = Alarms(cfg(grad_spike=10.0))
    norms = [1.0, 1.2, 50.0, 0.9, 1.1, 1.0, 50.0, 1.0, "nan", 1.0]  # no spike test before 5 finite values
    got = run(a, [({"train/grad_norm": g}, None) for g in norms])
    assert got == {6: ["alarm grad_norm raised at step 6: grad norm 50 >= 10 x the median 1.1 of the last 5 steps"],
                   7: ["alarm grad_norm cleared at step 7: grad norm 1 back under 10 x the median 1.1"],
                   8: ["alarm grad_norm raised at step 8: grad norm is nan"],
                   9: ["alarm grad_norm cleared at step 9: grad norm 1 back under 10 x the median 1"]}


def test_disabled_alarms_stay_silent():
    stream = [({"train/grad_norm": "nan", "moe/drop_fraction": 1.0}, collapsed())] * 10
    assert run(Alarms(cfg(enabled=False, collapse_ratio=2.0)), stream) == {}


def test_row_fields_round_trip_through_json():
    raised = Alarm("grad_norm", 8, math.nan, math.inf, "grad norm is nan")
    cleared = Alarm("collapse", 8, 1.0, 3.0, "ok", layer=1, cleared=True)
    worst = [Alarm("dead_expert", 8, v, 0.01, "x", layer=i, expert=0) for i, v in enumerate((0.005, 0.0))]
    row = json.loads(json.dumps(alarm_fields([raised, cleared, *worst])))  # strict JSON: no NaN, no Infinity
    assert row["alarm/grad_norm"] != row["alarm/grad_norm"] and row["alarm/dead_expert"] == 0.0
    assert "alarm/collapse" not in row  # a cleared alarm is listed, not counted
    back = [Alarm.from_dict(d) for d in row["alarms"]]
    assert [b.line() for b in back] == [x.line() for x in (raised, cleared, *worst)]
    assert alarm_fields([]) == {}


def test_bias_range_metric_is_the_widest_layer():
    import jax.numpy as jnp

    from moejax.train.step import bias_range_metrics

    out = bias_range_metrics(jnp.array([[0.5, 0.5, 0.5], [0.0, 1.0, -2.0], [0.0, 2.5, 0.0]]))
    assert float(out["train/router/bias_range"]) == 3.0 and int(out["train/router/bias_range_layer"]) == 1


def test_fitted_rise():
    assert fitted_rise([1.0, 2.0, 3.0, 4.0]) == pytest.approx(3.0)
    assert fitted_rise([5.0, 5.0, 5.0]) == 0.0 and fitted_rise([1.0]) == 0.0


@pytest.mark.parametrize("override, words", [
    ("alarms.every=0", "every (0) must be positive"),
    ("alarms.window=2", "alarms.window (2) must be >= 3"),
    ("alarms.collapse_ratio=1", "alarms.collapse_ratio (1.0) must be > 1"),
    ("alarms.dead_load=1.5", "alarms.dead_load (1.5) must be in [0, 1)"),
    ("alarms.grad_spike=0.5", "alarms.grad_spike (0.5) must be > 1"),
    ("train.load_log_every=-1", "load_log_every (-1) must be >= 0"),
])
def test_bad_thresholds_are_config_errors(override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        apply_overrides(RunConfig(), [override])


def test_old_config_json_without_alarms_still_loads():
    d = RunConfig().to_dict()
    del d["alarms"], d["train"]["load_log_every"]
    assert RunConfig.from_dict(d) == RunConfig()
    cfg = apply_overrides(RunConfig(), ["alarms.collapse_ratio=2.5", "alarms.enabled=false"])
    assert RunConfig.from_dict(json.loads(cfg.to_json())) == cfg



def test_a_run_dir_from_before_alarms_resumes_and_thresholds_may_change(tmp_path):
    from moejax.presets import preset
    from moejax.train.run_dir import RunError, prepare_run_dir

    run, cfg = tmp_path / "run", preset("tiny")
    assert prepare_run_dir(run, cfg, overwrite=False) is False
    old = json.loads((run / "config.json").read_text())
    del old["alarms"], old["train"]["load_log_every"]  # as written before this change
    (run / "config.json").write_text(json.dumps(old))
    assert prepare_run_dir(run, cfg, overwrite=False) is True  # the new fields are taken as this run's
    assert prepare_run_dir(run, apply_overrides(cfg, ["alarms.collapse_ratio=2"]), overwrite=False) is True
    old["train"]["no_such_field"] = 1  # a field only the old file has still counts
    (run / "config.json").write_text(json.dumps(old))
    with pytest.raises(RunError, match="train.no_such_field: 1 there, '<missing>' now"):
        prepare_run_dir(run, cfg, overwrite=False)
    assert prepare_run_dir(run, cfg, overwrite=True) is False
    with pytest.raises(RunError, match="train.load_log_every: 5 there, 7 now"):
        prepare_run_dir(run, apply_overrides(cfg, ["train.load_log_every=7"]), overwrite=False)


# ---- a real tiny EP run (8 forced CPU devices, data=2 x expert=4) ---------------------------------------
# 16 experts top-2, 1,024 tokens per step (128 assignments per expert per layer at a fair share). Measured
# (docs/LOG.md 2026-11-30): with QB the per-layer max/mean load stays <= 1.61 after step 0 (1.84 at step
# 0, before any bias); without it, Adam at 3e-3 pulls the routers apart: 2.29 by step 4, 2.46-2.95 on steps
# 5-9. 2.2 for 3 consecutive checks sits between the two.
COLLAPSE_RATIO_TINY = 2.2
EP_STEPS = 10


def tiny_ep_run(tmp_path, qb: bool) -> tuple[dict, list[dict]]:
    from moejax.config import ParallelConfig
    from moejax.metrics import read_metrics
    from moejax.presets import preset
    from moejax.train.loop import RunOptions, train

    cfg = apply_overrides(preset("tiny"), [
        "model.n_layers=2", "train.batch_size=16", "train.seq_len=64", f"train.steps={EP_STEPS}",
        "train.eval_every=5", "train.eval_at_start=true", "train.eval_batches=0",  # eval_batches=0: no eval at all
        "train.optimizer=adam", "train.learning_rate=0.003",
        "train.warmup_fraction=0", f"model.qb={str(qb).lower()}", "alarms.every=1", "alarms.patience=3",
        f"alarms.collapse_ratio={COLLAPSE_RATIO_TINY}"])
    cfg = replace(cfg, parallel=ParallelConfig(data=2, expert=4))
    run = tmp_path / f"qb_{qb}"
    summary = train(cfg, run, RunOptions(wandb="disabled", progress=False, peak_flops=1e11))
    return summary, read_metrics(run)


def test_ep_run_without_qb_raises_collapse_and_with_qb_none(tmp_path, capsys):
    off, off_rows = tiny_ep_run(tmp_path, qb=False)
    assert "collapse" in off["alarms"], off["alarms"]
    raised = [a for r in off_rows for a in r.get("alarms", []) if a["kind"] == "collapse"]
    assert raised and all(a["value"] >= COLLAPSE_RATIO_TINY and a["layer"] in (0, 1) for a in raised)
    assert all(r["train/router/bias_range"] == 0.0 for r in off_rows)  # no QB: the bias never moves
    assert "alarm collapse raised at step" in capsys.readouterr().err
    assert [r["step"] for r in off_rows] == list(range(EP_STEPS))  # eval_batches=0: no eval-only row of step 0,
    assert not any(k.startswith("eval") for r in off_rows for k in r) and "eval/loss" not in off  # no eval keys

    on, on_rows = tiny_ep_run(tmp_path, qb=True)
    assert on["alarms"] == {}, on["alarms"]
    assert not any("alarms" in r for r in on_rows)
    assert all(r["train/router/bias_range"] > 0.0 for r in on_rows)  # QB sets a bias from step 0 on
    loads = [np.asarray(r["train/router/load"]) for r in on_rows if r["step"] > 0 and "train/router/load" in r]
    assert len(loads) == 2  # tiny logs the loads every 5 steps and at the last: steps 5 and 9
    assert max((x.max(-1) / x.mean(-1)).max() for x in loads) < COLLAPSE_RATIO_TINY
