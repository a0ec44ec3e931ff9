"""One tiny micro-ladder rung end to end (3 steps): results.csv row, resume skips it, fit/plan CLI."""

import csv
import math

from moejax.cli import main
from moejax.ladder.micro import RESULT_FIELDS, read_results, run_micro_ladder


def test_one_rung_end_to_end_and_resume(tmp_path, capsys):
    log = []
    rows = run_micro_ladder(tmp_path, widths=[32], steps=3, log=log.append)
    assert len(rows) == 1
    with open(tmp_path / "results.csv") as f:
        assert tuple(csv.DictReader(f).fieldnames) == RESULT_FIELDS
    r = rows[0]
    assert r["name"] == "micro-d32" and r["width"] == 32 and r["steps"] == 3 and r["status"] == "ok"
    assert r["tokens"] == 3 * 16 * 128 and r["flops"] > 0 and r["active_params"] == 18_432
    for key in ("final_loss", "eval_loss", "max_grad_norm", "tokens_per_s", "mfu"):
        assert math.isfinite(r[key]) and r[key] > 0, key
    assert r["drop_fraction"] == 0.0  # local dropless path
    # Resumable: the rung is in results.csv, so a second run trains nothing.
    log.clear()
    assert len(run_micro_ladder(tmp_path, widths=[32], steps=3, log=log.append)) == 1
    assert any("skipped" in line for line in log)
    assert len(read_results(tmp_path)) == 1
    # Fit needs 3 rungs: with one it says so in one line and exits 2, writing nothing.
    capsys.readouterr()
    assert main(["ladder", "fit", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "ladder fit needs >= 3 usable rungs" in err and "has 1" in err and err.count("\n") == 1
    assert not (tmp_path / "loss_vs_compute.png").exists()


def test_ladder_cli_errors(tmp_path, capsys):
    assert main(["ladder", "fit", str(tmp_path)]) == 2
    assert "no results.csv" in capsys.readouterr().err
    assert main(["ladder", "run", "--scale", "gpu", "--out", str(tmp_path)]) == 2
    assert main(["ladder", "run", "--out", str(tmp_path), "--widths", "33"]) == 2
    assert "no micro-ladder rung at width 33" in capsys.readouterr().err
    assert main(["ladder", "plan"]) == 0
    assert "0.423%" in capsys.readouterr().out
