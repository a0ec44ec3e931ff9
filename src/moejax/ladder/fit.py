"""Loss-vs-compute fit, projection and anomaly flags for a ladder (SPEC §5: the ladder projects the
hero's loss and watches grad norms and drop rates as scale grows).

Fit: L(C) = E + A * C^(-alpha) by least squares. For fixed alpha the model is linear in (E, A), so the
fit is a 1-D search over alpha (log grid, then golden-section refinement) with an exact linear solve
inside (numpy only; scipy is not a dependency). C is normalised by its geometric mean for conditioning.

Anomaly flags (each a one-line string naming the rung and the numbers):
- nonfinite: a rung's status is not ok or its loss is not finite (divergence);
- not_decreasing: a larger-compute rung has a higher (or equal) loss than a smaller one;
- off_trend: |loss - fit| > OFF_TREND_REL * fit, the fit made *without* that rung (leave-one-out, so a
  bad rung cannot pull the curve onto itself); worst rung first, removed, repeated while >= 4 remain;
- grad_norm_growth: max grad norm of the largest rung > GRAD_GROWTH_FACTOR x that of the smallest;
- drop_growth: drop fraction rises monotonically with scale by more than DROP_GROWTH_ABS overall;
and of the fit itself:
- fit_at_bound: alpha ends within 1% of its search range's edge, so the rungs do not pin a power law down;
- negative_floor: E < 0, a loss floor no cross-entropy can have.
Both mean the projection is not to be trusted (e.g. rungs trained for a few steps: losses still linear in
log C, a CLI sweep's 3-step ladder gave alpha = 0.001 and E = -60).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

OFF_TREND_REL = 0.02
GRAD_GROWTH_FACTOR = 3.0
DROP_GROWTH_ABS = 0.01
_ALPHA_RANGE = (1e-3, 3.0)


@dataclass(frozen=True)
class PowerLawFit:
    E: float
    A: float
    alpha: float
    rmse: float

    def __call__(self, c):
        return self.E + self.A * np.asarray(c, dtype=np.float64) ** (-self.alpha)


def _solve_linear(x: np.ndarray, loss: np.ndarray, alpha: float) -> tuple[float, float, float]:
    """(E, a, sse) minimising sum (E + a*x^-alpha - loss)^2 for fixed alpha."""
    basis = np.stack([np.ones_like(x), x ** (-alpha)], axis=1)
    (e, a), *_ = np.linalg.lstsq(basis, loss, rcond=None)
    return float(e), float(a), float(np.sum((basis @ np.array([e, a]) - loss) ** 2))


def fit_power_law(compute, loss) -> PowerLawFit:
    c, y = np.asarray(compute, np.float64), np.asarray(loss, np.float64)
    if c.shape != y.shape or c.size < 3:
        raise ValueError(f"need >= 3 (compute, loss) points of equal length, got {c.size} and {y.size}")
    if not (np.all(np.isfinite(c)) and np.all(np.isfinite(y)) and np.all(c > 0)):
        raise ValueError("compute must be positive and finite, loss finite")
    c0 = math.exp(float(np.mean(np.log(c))))
    x = c / c0
    sse = lambda al: _solve_linear(x, y, al)[2]
    grid = np.geomspace(*_ALPHA_RANGE, 400)
    i = int(np.argmin([sse(a) for a in grid]))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    g = (math.sqrt(5) - 1) / 2
    for _ in range(100):  # golden-section search on the bracket around the best grid point
        m1, m2 = hi - g * (hi - lo), lo + g * (hi - lo)
        if sse(m1) < sse(m2):
            hi = m2
        else:
            lo = m1
    alpha = (lo + hi) / 2
    e, a, s = _solve_linear(x, y, alpha)
    return PowerLawFit(E=e, A=a * c0 ** alpha, alpha=alpha, rmse=math.sqrt(s / c.size))


def usable(r: dict, loss_key: str = "final_loss") -> bool:
    """A rung the fit takes: trained to the end (status ok) with a finite loss in `loss_key`."""
    return r.get("status", "ok") == "ok" and math.isfinite(float(r.get(loss_key, math.nan)))


def _off_trend(good: list[dict], loss_key: str) -> list[str]:
    """Leave-one-out outliers, worst first: flag the rung farthest from the other rungs' fit if it is beyond
    the tolerance, drop it, repeat while >= 4 rungs remain (so one bad rung cannot make a good endpoint
    look off-trend through the extrapolated fit)."""
    flags, pool = [], list(good)
    while len(pool) >= 4:
        devs = []
        for i, r in enumerate(pool):
            rest = pool[:i] + pool[i + 1:]
            fit = fit_power_law([float(q["flops"]) for q in rest], [float(q[loss_key]) for q in rest])
            pred = float(fit(float(r["flops"])))
            devs.append(((float(r[loss_key]) - pred) / abs(pred), pred, r))
        dev, pred, r = max(devs, key=lambda x: abs(x[0]))
        if abs(dev) <= OFF_TREND_REL:
            break
        flags.append(f"off_trend: {r['name']} loss {float(r[loss_key]):.4f} vs {pred:.4f} from the other rungs' "
                     f"fit ({100 * dev:+.1f}%, tolerance {100 * OFF_TREND_REL:.0f}%)")
        pool.remove(r)
    return flags


def anomalies(rows: list[dict], loss_key: str = "final_loss") -> list[str]:
    """Flags for a ladder's result rows (keys: name, flops, final_loss, max_grad_norm, drop_fraction, status)."""
    rows = sorted(rows, key=lambda r: float(r["flops"]))
    flags = [f"nonfinite: {r['name']} diverged or has a non-finite loss ({r.get('status')}, loss {r[loss_key]})"
             for r in rows if not usable(r, loss_key)]
    good = [r for r in rows if usable(r, loss_key)]
    for a, b in zip(good, good[1:]):
        if float(b[loss_key]) >= float(a[loss_key]):
            flags.append(f"not_decreasing: {b['name']} loss {float(b[loss_key]):.4f} >= {a['name']} "
                         f"{float(a[loss_key]):.4f} with {float(b['flops']) / float(a['flops']):.2f}x the compute")
    flags += _off_trend(good, loss_key)
    grads = [(r["name"], float(r["max_grad_norm"])) for r in rows if "max_grad_norm" in r]
    if len(grads) >= 2 and all(math.isfinite(g) and g > 0 for _, g in grads):
        (n0, g0), (n1, g1) = grads[0], grads[-1]
        if g1 > GRAD_GROWTH_FACTOR * g0:
            flags.append(f"grad_norm_growth: max grad norm {g1:.3g} at {n1} is {g1 / g0:.1f}x that at {n0} "
                         f"({g0:.3g}; threshold {GRAD_GROWTH_FACTOR:g}x)")
    drops = [float(r["drop_fraction"]) for r in rows if "drop_fraction" in r]
    if len(drops) >= 2 and all(map(math.isfinite, drops)):
        if all(b > a for a, b in zip(drops, drops[1:])) and drops[-1] - drops[0] > DROP_GROWTH_ABS:
            flags.append(f"drop_growth: drop fraction rises with scale from {100 * drops[0]:.2f}% "
                         f"({rows[0]['name']}) to {100 * drops[-1]:.2f}% ({rows[-1]['name']})")
    return flags


def fit_ladder(rows: list[dict], target_flops: float, loss_key: str = "final_loss") -> dict:
    good = sorted((r for r in rows if usable(r, loss_key)), key=lambda r: float(r["flops"]))
    out = {"n_rungs": len(rows), "n_fitted": len(good), "target_flops": target_flops,
           "anomalies": anomalies(rows, loss_key), "loss_key": loss_key}
    if len(good) >= 3:
        fit = fit_power_law([float(r["flops"]) for r in good], [float(r[loss_key]) for r in good])
        out.update(E=fit.E, A=fit.A, alpha=fit.alpha, rmse=fit.rmse, projected_loss=float(fit(target_flops)),
                   extrapolation=target_flops / float(good[-1]["flops"]))
        lo, hi = _ALPHA_RANGE
        if fit.alpha < 1.01 * lo or fit.alpha > 0.99 * hi:
            out["anomalies"].append(f"fit_at_bound: alpha {fit.alpha:.4g} is at the edge of its search range "
                                    f"[{lo:g}, {hi:g}]: the rungs do not pin a power law down")
        if fit.E < 0:
            out["anomalies"].append(f"negative_floor: fitted loss floor E = {fit.E:.4g} < 0: the projection "
                                    "is not to be trusted")
    return out


def format_fit(res: dict) -> str:
    lines = [f"ladder fit: {res['n_fitted']} of {res['n_rungs']} rungs on {res['loss_key']}"]
    if "alpha" in res:
        lines.append(f"  L(C) = E + A*C^-alpha   E = {res['E']:.4f}  A = {res['A']:.4g}  alpha = {res['alpha']:.4f}"
                     f"  (rmse {res['rmse']:.4f})")
        lines.append(f"  projected loss at C = {res['target_flops']:.4g} FLOPs: {res['projected_loss']:.4f} "
                     f"({res['extrapolation']:.3g}x the largest fitted rung's compute)")
    else:
        lines.append("  fewer than 3 usable rungs: no fit")
    lines += [f"  ANOMALY {a}" for a in res["anomalies"]] or ["  no anomalies"]
    return "\n".join(lines)


def plot_ladder(rows: list[dict], res: dict, out_dir, run_dirs: dict | None = None) -> list[str]:
    """PNG plots: loss vs compute with the fit and its projection, grad norm and drop fraction vs compute,
    and loss curves (from each rung's metrics.jsonl) when run dirs are given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from pathlib import Path

    out_dir = Path(out_dir)
    rows = sorted(rows, key=lambda r: float(r["flops"]))
    c = np.array([float(r["flops"]) for r in rows])
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.scatter(c, [float(r[res["loss_key"]]) for r in rows], label="rungs", zorder=3)
    if "alpha" in res:
        fit = PowerLawFit(res["E"], res["A"], res["alpha"], res["rmse"])
        cs = np.geomspace(c.min(), max(c.max(), res["target_flops"]), 200)
        ax.plot(cs, fit(cs), label=f"E + A C^-{res['alpha']:.3f}")
        ax.scatter([res["target_flops"]], [res["projected_loss"]], marker="*", s=120, label="projection")
    ax.set(xscale="log", xlabel="training FLOPs", ylabel=res["loss_key"], title="loss vs compute")
    ax.legend()
    written.append(_save(fig, out_dir / "loss_vs_compute.png"))

    for key, name in (("max_grad_norm", "grad_norm_vs_compute.png"), ("drop_fraction", "drop_vs_compute.png")):
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(c, [float(r[key]) for r in rows], marker="o")
        ax.set(xscale="log", xlabel="training FLOPs", ylabel=key, title=f"{key} vs compute")
        written.append(_save(fig, out_dir / name))

    if run_dirs:
        from moejax.metrics import read_metrics

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, d in run_dirs.items():
            if (Path(d) / "metrics.jsonl").exists():
                m = read_metrics(d)
                ax.plot([r["step"] for r in m], [float(r["train/loss"]) for r in m], label=name, lw=0.8)
        ax.set(xlabel="step", ylabel="train/loss", title="loss curves")
        ax.legend()
        written.append(_save(fig, out_dir / "loss_curves.png"))
    return written


def _save(fig, path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return str(path)
