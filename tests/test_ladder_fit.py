"""The L(C) fit recovers known exponents; anomaly flags fire on synthetic bad rungs."""

import math

import numpy as np
import pytest

from moejax.ladder.fit import anomalies, fit_ladder, fit_power_law, plot_ladder

E, A, ALPHA = 1.8, 420.0, 0.12
FIT_REL_TOL = 1e-3  # noise-free points: the 1-D search + exact linear solve is essentially exact
NOISY_ALPHA_TOL = 0.01


def clean_rows(n=5, **kw):
    cs = np.geomspace(1e15, 1e19, n)
    return [{"name": f"r{i}", "flops": c, "final_loss": E + A * c ** -ALPHA, "max_grad_norm": 1.0 + 0.1 * i,
             "drop_fraction": 0.01, "status": "ok", **kw} for i, c in enumerate(cs)]


def test_fit_recovers_known_law():
    rows = clean_rows(6)
    fit = fit_power_law([r["flops"] for r in rows], [r["final_loss"] for r in rows])
    assert fit.alpha == pytest.approx(ALPHA, rel=FIT_REL_TOL)
    assert fit.E == pytest.approx(E, rel=FIT_REL_TOL)
    assert fit.A == pytest.approx(A, rel=10 * FIT_REL_TOL)
    assert float(fit(2.7e24)) == pytest.approx(E + A * 2.7e24 ** -ALPHA, rel=FIT_REL_TOL)


@pytest.mark.parametrize("alpha,e", [(0.05, 0.5), (0.3, 3.0), (0.6, 0.0)])
def test_fit_recovers_other_exponents_with_noise(alpha, e):
    rng = np.random.default_rng(0)
    c = np.geomspace(1e12, 1e16, 8)
    y = e + 50.0 * c ** -alpha * (1 + 1e-4 * rng.standard_normal(c.size))
    assert fit_power_law(c, y).alpha == pytest.approx(alpha, abs=NOISY_ALPHA_TOL)


def test_fit_needs_three_points():
    with pytest.raises(ValueError, match=">= 3"):
        fit_power_law([1e15, 1e16], [3.0, 2.9])


def test_clean_ladder_has_no_flags_and_projects():
    res = fit_ladder(clean_rows(), 2.7e24)
    assert res["anomalies"] == []
    assert res["projected_loss"] == pytest.approx(E + A * 2.7e24 ** -ALPHA, rel=FIT_REL_TOL)


def test_off_trend_rung_is_flagged():
    rows = clean_rows()
    rows[2]["final_loss"] *= 1.05
    flags = anomalies(rows)
    assert any(f.startswith("off_trend: r2") for f in flags)
    assert not any(f.startswith("off_trend: r0") for f in flags)


def test_not_decreasing_and_nonfinite():
    rows = clean_rows()
    rows[3]["final_loss"] = rows[2]["final_loss"] + 0.01
    rows[4].update(final_loss=math.nan, status="nonfinite")
    flags = anomalies(rows)
    assert any(f.startswith("not_decreasing: r3") for f in flags)
    assert any(f.startswith("nonfinite: r4") for f in flags)
    assert fit_ladder(rows, 1e20)["n_fitted"] == 4


def test_grad_norm_growth_and_drop_growth():
    rows = clean_rows()
    for i, r in enumerate(rows):
        r["max_grad_norm"] = 1.0 * 2 ** i  # 16x from the smallest to the largest rung
        r["drop_fraction"] = 0.01 + 0.01 * i
    flags = anomalies(rows)
    assert any(f.startswith("grad_norm_growth") and "16.0x" in f for f in flags)
    assert any(f.startswith("drop_growth") and "5.00%" in f for f in flags)


def test_plots_are_written(tmp_path):
    rows = clean_rows()
    paths = plot_ladder(rows, fit_ladder(rows, 1e21), tmp_path)
    assert len(paths) == 3 and all((tmp_path / p.split("/")[-1]).stat().st_size > 1000 for p in paths)


def test_a_fit_that_pins_nothing_down_is_flagged():
    """Losses linear in log C (rungs trained a few steps, as a CLI sweep's were) drive alpha to its search bound
    and E below zero: both are flagged, so the projection is not taken at face value."""
    rows = [{"name": f"r{i}", "flops": 10.0 ** (12 + i), "final_loss": 5.0 - 0.3 * i, "status": "ok"}
            for i in range(4)]
    flags = fit_ladder(rows, 1e24)["anomalies"]
    assert any(f.startswith("fit_at_bound: alpha") for f in flags), flags
    assert any(f.startswith("negative_floor: fitted loss floor E = -") for f in flags), flags
    assert not [f for f in fit_ladder(clean_rows(6), 1e24)["anomalies"] if "bound" in f or "floor" in f]
