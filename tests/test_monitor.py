"""Bounded metrics: 100,000 logged steps at hero shape keep Python memory flat and write per-expert loads
only every `load_log_every` steps; the summary's totals survive a restart and describe the whole run."""

import json
import tracemalloc
from dataclasses import replace

import numpy as np

from moejax.cli import main
from moejax.config import AlarmConfig, RunConfig, TrainConfig
from moejax.metrics import MetricsWriter, read_metrics
from moejax.train.alarms import LOAD_KEY
from moejax.train.monitor import THROUGHPUT_WINDOW, RunTotals, StepLog

HERO_L, HERO_E = 48, 384
N_STEPS = 100_000
LOAD_EVERY = 1_000
MEMORY_GROWTH_BYTES = 64 * 1024  # steps 10k..100k may not add more than this to the traced heap
OLD_ROW_BYTES = 200_000  # a hero row with its [48 x 384] load (~230 KB measured in issue 15): the old per-step cost


def config(**train):
    return replace(RunConfig(), train=replace(TrainConfig(), **train), alarms=AlarmConfig(every=10))


def step_metrics(step, rng_value):
    return {"train/loss": 7.0 - step * 1e-5, "train/grad_norm": 1.0 + 0.1 * rng_value, "moe/drop_fraction": 0.03,
            "train/router/bias_range": 1.0, "train/router/bias_range_layer": 0, "train/learning_rate": 1e-3,
            "throughput/tokens_per_second": 1000.0 + step % 7, "throughput/mfu": 0.2, "data/seq_len": 4096}


def test_100k_steps_keep_memory_flat_and_the_file_small(tmp_path):
    cfg = config(log_every=1, load_log_every=LOAD_EVERY, steps=N_STEPS)
    rng = np.random.default_rng(0)
    loads = [rng.integers(900, 1100, (HERO_L, HERO_E)).astype(np.float32) for _ in range(4)]  # balanced
    noise = rng.random(64)
    writer = MetricsWriter(tmp_path, wandb_mode="disabled")
    log = StepLog(cfg, writer, RunTotals(), emit=lambda line: None)
    tracemalloc.start()
    try:
        for step in range(N_STEPS):
            metrics = step_metrics(step, noise[step % 64])
            log.check(step, metrics, loads[step % 4])
            log.record(step, metrics, loads[step % 4], last=step == N_STEPS - 1)
            if step == 10_000:
                at_10k = tracemalloc.get_traced_memory()[0]
        at_end = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        writer.close()
    summary = log.summary("synthetic", N_STEPS)
    assert at_end - at_10k < MEMORY_GROWTH_BYTES, (at_10k, at_end)
    assert summary["steps"] == N_STEPS and summary["first_loss"] == 7.0 and summary["alarms"] == {}
    assert summary["tokens_per_second"] == 1003.0  # the median over the last THROUGHPUT_WINDOW steps
    assert len(log.totals.tokens_per_second) == THROUGHPUT_WINDOW

    size = (tmp_path / "metrics.jsonl").stat().st_size
    load_steps, load_bytes = [], 0
    with open(tmp_path / "metrics.jsonl") as f:
        for line in f:
            if LOAD_KEY in line:
                load_steps.append(json.loads(line)["step"])
                load_bytes += len(line)
    assert load_steps == [*range(0, N_STEPS, LOAD_EVERY), N_STEPS - 1]  # and the last step
    load_row = len(json.dumps(loads[0].tolist()))
    assert load_bytes < len(load_steps) * (load_row + 1000)  # a load row: the [L, E] list and the scalars
    scalar_row = len(json.dumps({"step": N_STEPS, **step_metrics(1, 0.5), "time/wall_seconds": 1e4 / 3}))
    assert (size - load_bytes) / (N_STEPS - len(load_steps)) < 1.5 * scalar_row  # other rows: scalars only
    assert size / N_STEPS < OLD_ROW_BYTES / 50  # > 50x smaller per step than one load per row
    print(f"\n100k hero-shape steps: traced heap {at_10k / 1e3:.1f} kB at step 10k, {at_end / 1e3:.1f} kB at 100k; "
          f"metrics.jsonl {size / 1e6:.1f} MB = {size / N_STEPS:.0f} B/step ({load_row / 1e3:.0f} KB per load row)")


def test_load_every_zero_never_logs_loads_and_rows_follow_log_every(tmp_path):
    writer = MetricsWriter(tmp_path, wandb_mode="disabled")
    log = StepLog(config(log_every=3, load_log_every=0), writer, RunTotals(), emit=lambda line: None)
    for step in range(8):
        m = step_metrics(step, 0.0)
        log.check(step, m, np.ones((2, 4)))
        log.record(step, m, np.ones((2, 4)), last=step == 7)
    writer.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 3, 6, 7] and not any(LOAD_KEY in r for r in rows)


def test_alarm_steps_are_always_written(tmp_path):
    writer = MetricsWriter(tmp_path, wandb_mode="disabled")
    cfg = replace(config(log_every=100, load_log_every=100), alarms=AlarmConfig(every=1, window=3))
    lines = []
    log = StepLog(cfg, writer, RunTotals(), emit=lines.append)
    for step, g in enumerate([1.0, 1.0, 1.0, 40.0, 1.0]):
        m = {**step_metrics(step, 0.0), "train/grad_norm": g}
        log.check(step, m, None)
        log.record(step, m, None)
    writer.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 3, 4]  # step 0 by log_every, 3 raised, 4 cleared
    assert rows[1]["alarm/grad_norm"] == 40.0 and rows[1]["alarms"][0]["kind"] == "grad_norm"
    assert lines == [a["kind"] and f"alarm grad_norm {s} at step {st}: " + a["message"]
                     for st, s, a in ((3, "raised", rows[1]["alarms"][0]), (4, "cleared", rows[2]["alarms"][0]))]


def test_summary_after_a_restart_covers_the_whole_run(tmp_path, capsys):
    """Two segments (steps 0-5, then 6-9 after a 'resume'): the second rebuilds its totals from the rows. The
    first evaluated at its last step, the second not at all (train.eval_batches=0): the summary says where
    its eval comes from."""
    cfg = replace(config(log_every=2, load_log_every=0), alarms=AlarmConfig(every=1, window=3))
    grads = [1.0, 1.0, 1.0, 40.0, 1.0, 1.0, 1.0, 1.0, 1.0, 60.0]  # a restart refills the window
    writer = MetricsWriter(tmp_path, wandb_mode="disabled")
    first = StepLog(cfg, writer, RunTotals(), emit=lambda line: None)
    for step in range(6):
        m = {**step_metrics(step, 0.0), "train/grad_norm": grads[step]}
        if step == 5:
            m.update({"eval/loss": 5.5, "eval/bpb": 2.25})
        first.check(step, m, None)
        first.record(step, m, None)
    writer.close()

    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 2, 3, 4, 5]  # 3: its alarm; 5: its eval
    totals = RunTotals.from_rows(read_metrics(tmp_path))
    writer = MetricsWriter(tmp_path, wandb_mode="disabled")
    second = StepLog(cfg, writer, totals, emit=lambda line: None)
    for step in range(6, 10):
        m = {**step_metrics(step, 0.0), "train/grad_norm": grads[step]}
        second.check(step, m, None)
        second.record(step, m, None, last=step == 9)
    writer.close()
    s = second.summary("x", 10)
    assert (s["steps"], s["first_step"], s["first_loss"], s["last_loss"]) == (10, 0, 7.0, 7.0 - 9e-5)
    assert s["wall_seconds"] >= totals.wall_before > 0
    assert s["alarms"]["grad_norm"]["count"] == 2
    assert "at step 3:" in s["alarms"]["grad_norm"]["first"] and "at step 9:" in s["alarms"]["grad_norm"]["last"]
    assert (s["eval/loss"], s["eval/bpb"], s["eval_step"]) == (5.5, 2.25, 5)
    (tmp_path / "summary.json").write_text(json.dumps(s))
    assert main(["summary", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "eval loss   5.500   eval bits/byte 2.250   (step 5's row; later steps were not evaluated)" in out


def test_totals_rebuilt_from_rows_skip_the_eval_only_row_of_step_0():
    """With train.eval_at_start (the hero's) metrics.jsonl opens with an eval-only row for step 0: a resumed or
    rebuilt summary took its missing train loss as the first loss (null), and `moejax summary` raised."""
    rows = [{"step": 0, "eval/loss": 9.0, "eval/bpb": 3.0}, {"step": 0, "train/loss": 8.0},
            {"step": 1, "train/loss": 7.5}]
    totals = RunTotals.from_rows(rows)
    assert (totals.first_step, totals.first_loss, totals.last_step, totals.last["train/loss"]) == (0, 8.0, 1, 7.5)
