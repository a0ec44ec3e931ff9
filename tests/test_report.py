"""`moejax report`: PNGs from a synthetic metrics.jsonl, skipped keys, and one-line user errors."""

import json

import numpy as np
import pytest

from moejax.cli import main
from moejax.report import load_matrix, load_rows, overflow_keys, series, step_edges
from moejax.train.step import moe_metrics

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
MIN_PNG_BYTES = 5_000  # a blank 800x400 canvas alone compresses to ~3 kB; real plots are well above
ALL_FILES = {"loss.png", "drops.png", "learning_rate.png", "throughput.png", "grad_norm.png",
             "drops_per_layer.png", "expert_load.png"}


def router_row(layers: int, experts: int) -> dict:
    """Router metrics under the names the train step really writes (`moe_metrics`), so a renamed key there
    that report.py does not follow loses a figure here."""
    stats = {"valid": np.full(layers, 100), "sender_dropped": np.arange(layers), "receiver_dropped": np.ones(layers),
             "load": np.ones((layers, experts)), "entropy": np.zeros(layers), "load_balancing_loss": np.ones(layers),
             "router_z_loss": np.ones(layers), "max_over_mean_load": np.ones(layers)}
    return {k: float(v) for k, v in moe_metrics(stats, layers).items() if k.startswith("train/router/")}


def synthetic_rows(steps: int = 12, layers: int = 2, experts: int = 4) -> list[dict]:
    rng = np.random.default_rng(0)
    router = router_row(layers, experts)
    rows = []
    for s in range(steps):
        load = rng.integers(50, 150, size=(layers, experts)).astype(float)
        row = {"step": s, "train/loss": 7.0 - 0.2 * s, "train/cross_entropy_loss": 6.9 - 0.2 * s,
               "moe/drop_fraction": 0.05 / (s + 1), "moe/sender_drop_fraction": 0.03 / (s + 1),
               "moe/receiver_drop_fraction": 0.02 / (s + 1), "train/learning_rate": 1e-3 * min(1, s / 3),
               "throughput/mfu": 0.1, "throughput/tokens_per_second": 2000.0 + s,
               "train/grad_norm": "nan" if s == 5 else 1.0 / (s + 1), "train/router/load": load.tolist(),
               **router}
        if s % 4 == 3:
            row.update({"eval/loss": 6.5 - 0.2 * s, "eval_dropless/loss": 6.4 - 0.2 * s})
        rows.append(row)
    return rows


def write_metrics(run_dir, rows) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def assert_png(path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, path
    assert len(data) > MIN_PNG_BYTES, (path, len(data))


def test_report_writes_every_plot_and_lists_them(tmp_path, capsys):
    run = tmp_path / "run"
    write_metrics(run, synthetic_rows())
    assert main(["report", str(run)]) == 0
    printed = capsys.readouterr().out.split()
    assert {p.split("/")[-1] for p in printed} == ALL_FILES
    assert {p.name for p in (run / "report").iterdir()} == ALL_FILES
    for name in ALL_FILES:
        assert_png(run / "report" / name)


def test_missing_keys_are_skipped_and_out_dir_honoured(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "elsewhere"
    rows = [{"step": s, "train/loss": 5.0 - 0.1 * s, "train/learning_rate": 1e-3} for s in range(5)]
    write_metrics(run, rows)
    assert main(["report", str(run), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"loss.png", "learning_rate.png"}
    assert not (run / "report").exists()
    assert len(capsys.readouterr().out.splitlines()) == 2


def test_single_layer_heat_map(tmp_path, capsys):
    run = tmp_path / "run"
    write_metrics(run, synthetic_rows())
    assert main(["report", str(run), "--layer", "1"]) == 0
    assert_png(run / "report" / "expert_load_layer1.png")
    assert not (run / "report" / "expert_load.png").exists()


@pytest.mark.parametrize("content, words", [
    (None, "no metrics.jsonl in"),
    ("", "is empty"),
    ("\n\n", "is empty"),
    ('{"step": 0}\n{oops\n', "line 2 is not JSON"),
    ('{"step": 0, "train/tokens": 5}\n', "none of the plotted metrics"),
])
def test_user_errors_are_one_line_exit_2(content, words, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    assert main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_layer_out_of_range_is_a_user_error(tmp_path, capsys):
    run = tmp_path / "run"
    write_metrics(run, synthetic_rows(layers=2))
    assert main(["report", str(run), "--layer", "2"]) == 2
    assert "--layer 2 is out of range" in capsys.readouterr().err


def test_series_skips_non_finite_and_absent_values(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, synthetic_rows())
    steps, values = series(load_rows(run), "train/grad_norm")
    assert 5 not in steps and len(steps) == 11 and np.isfinite(values).all()
    steps, _ = series(load_rows(run), "eval/loss")
    assert steps.tolist() == [3, 7, 11]


def test_load_matrix_is_normalised_by_the_mean_over_experts():
    rows = [{"step": 0, "train/router/load": [[1.0, 3.0], [2.0, 2.0]]},
            {"step": 1},
            {"step": 2, "train/router/load": [[0.0, 0.0], [4.0, 0.0]]}]
    steps, rel_LES = load_matrix(rows)
    assert steps.tolist() == [0, 2]
    np.testing.assert_allclose(rel_LES[:, :, 0], [[0.5, 1.5], [1.0, 1.0]])
    np.testing.assert_allclose(rel_LES[:, :, 1], [[1.0, 1.0], [2.0, 0.0]])  # an idle layer reads as balanced


def test_damaged_rows_are_left_out_like_a_torn_line(tmp_path, capsys):
    """Hand-edited or damaged rows of metrics.jsonl (moejax's own file): a bad step, a value past float's range,
    a ragged, empty or non-numeric load. Each was a traceback inside numpy or matplotlib; now those rows are
    skipped and the rest is drawn."""
    damaged = [{"step": None, "train/loss": 1.0, "train/router/load": [[1.0, 2.0]]},
               {"step": "7", "train/loss": 1.0},
               {"step": 1, "train/loss": 10 ** 400, "train/router/load": [[1.0], [2.0, 3.0]]},
               {"step": 2, "train/router/load": [["a", "b"]]},
               {"step": 3, "train/router/load": []},
               {"step": 4, "train/router/load": [1.0, 2.0]},  # one layer's [E]: fine
               {"step": 5, "train/loss": 2.0, "train/router/load": [[3.0, 1.0]]}]
    assert series(damaged, "train/loss")[0].tolist() == [5]
    steps, rel_LES = load_matrix(damaged)
    assert steps.tolist() == [4, 5] and rel_LES.shape == (1, 2, 2)
    run = tmp_path / "run"
    write_metrics(run, damaged)
    assert main(["report", str(run)]) == 0, capsys.readouterr().err
    assert_png(run / "report" / "expert_load.png")


def test_overflow_keys_are_the_train_step_names_in_layer_order():
    keys = overflow_keys([router_row(layers=12, experts=4)])  # layer_10 sorts after layer_9, not after layer_1
    assert keys == [f"train/router/layer_{i}/capacity_overflow_rate" for i in range(12)]


def test_sparse_loads_every_n_steps_plus_the_last(tmp_path, capsys):
    """Loads logged every 5 steps and at the last step (train.load_log_every): the heat map still draws,
    with columns placed at the steps that logged them."""
    rows = synthetic_rows(steps=23)
    for r in rows:
        if r["step"] % 5 and r["step"] != 22:
            del r["train/router/load"]
    run = tmp_path / "run"
    write_metrics(run, rows)
    steps, rel_LES = load_matrix(load_rows(run))
    assert steps.tolist() == [0, 5, 10, 15, 20, 22] and rel_LES.shape == (2, 4, 6)
    np.testing.assert_allclose(step_edges(steps), [-2.5, 2.5, 7.5, 12.5, 17.5, 21.0, 23.0])
    np.testing.assert_allclose(step_edges(np.array([7])), [6.5, 7.5])
    assert main(["report", str(run), "--layer", "1"]) == 0
    assert_png(run / "report" / "expert_load_layer1.png")
