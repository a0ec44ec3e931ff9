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


def _results(path, rows):
    """results.csv with RESULT_FIELDS and these rows (dicts of some fields; the rest a plausible default)."""
    base = {k: "1.0" for k in RESULT_FIELDS}
    with open(path / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
        w.writeheader()
        for i, r in enumerate(rows):
            w.writerow({**base, "name": f"micro-d{32 + 16 * i}", "status": "ok", "flops": str(10.0 ** (12 + i)),
                        "final_loss": str(4.0 - 0.3 * i), "eval_loss": str(4.1 - 0.3 * i), **r})


def test_ladder_fit_bad_results_are_one_line(tmp_path, capsys):
    """Found by a CLI sweep (docs/LOG.md 2026-12-04, twenty-fourth session): an edited results.csv, a NaN in the
    fitted loss column and an infinite target were tracebacks or nonsense; each is one line, exit 2, or left out."""
    _results(tmp_path, [{}, {"final_loss": "abc"}, {}])
    assert main(["ladder", "fit", str(tmp_path), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "results.csv line 3: final_loss is 'abc', not a number" in err and err.count("\n") == 1
    (tmp_path / "results.csv").write_text("name,flops\nmicro-d32,1e12\n")
    assert main(["ladder", "fit", str(tmp_path), "--no-plots"]) == 2
    assert "lacks the column(s)" in capsys.readouterr().err
    # a rung with a NaN eval loss is left out of an eval-loss fit (its final loss is finite), not fitted
    _results(tmp_path, [{}, {"eval_loss": "nan"}, {}, {}])
    assert main(["ladder", "fit", str(tmp_path), "--loss", "eval_loss", "--no-plots"]) == 0
    assert "ladder fit: 3 of 4 rungs on eval_loss" in capsys.readouterr().out
    assert main(["ladder", "fit", str(tmp_path), "--target-flops", "inf", "--no-plots"]) == 2
    assert "must be positive and finite" in capsys.readouterr().err


def test_ladder_run_out_a_file_is_one_line(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["ladder", "run", "--out", str(tmp_path / "afile"), "--widths", "32", "--steps", "2"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
