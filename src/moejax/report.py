"""`moejax report RUN_DIR [--out DIR] [--layer I]`: PNG plots of a run's `metrics.jsonl`.

One figure per topic (loss, drops, learning rate, throughput, grad norm, expert load), each drawn from
whichever of its keys the run logged: a run without eval, without EP drops or without router loads just
gets fewer curves or files. Series are plotted against the step of the rows that carry them, so sparse
keys (eval every N steps, `log_every` > 1) need no alignment. Non-finite values, which `metrics.py`
writes as strings ("nan", "inf"), are left out of the curves.

The expert-load heat map shows load / mean load over experts at each step that logged the loads (every
`train.load_log_every` steps and the last; 1 = a fair share), on a diverging scale centred on 1, for every
layer (one panel each) or the one given by `--layer`; each column spans halfway to its neighbours.
Matplotlib runs on the Agg backend: no display is needed.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from moejax.config import ConfigError
from moejax.metrics import metric_lines

# (file stem, title, panels); a panel is (y label, log y, ((metric key, legend label), ...)).
FIGURES = (
    ("loss", "loss", (("loss (nats/token)", False, (
        ("train/loss", "train (CE + z-loss)"), ("train/cross_entropy_loss", "train CE"),
        ("eval/loss", "eval"), ("eval_dropless/loss", "eval dropless"))),)),
    ("drops", "MoE dropped assignments", (("fraction of valid assignments", False, (
        ("moe/drop_fraction", "total"), ("moe/sender_drop_fraction", "sender"),
        ("moe/receiver_drop_fraction", "receiver"), ("eval/drop_fraction", "eval total"))),)),
    ("learning_rate", "learning rate", (("learning rate", False, (("train/learning_rate", "lr"),)),)),
    ("throughput", "throughput", (("MFU", False, (("throughput/mfu", "MFU"),)),
                                  ("tokens / s", False, (("throughput/tokens_per_second", "tokens/s"),)))),
    ("grad_norm", "gradient norm", (("global grad norm", True, (("train/grad_norm", "grad norm"),)),)),
)
LOAD_KEY = "train/router/load"
OVERFLOW_KEY = re.compile(r"^train/router/layer_(\d+)/capacity_overflow_rate$")  # the reference's name


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_rows(run_dir: Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl (a torn last line, as a crash leaves it, is dropped); a missing,
    empty or malformed file is a ConfigError."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"no metrics.jsonl in {run_dir} (is it a run directory?)")
    rows = []
    for i, line in metric_lines(path):
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{path} line {i} is not JSON ({getattr(e, 'msg', e)})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path} line {i} is not a JSON object")
        rows.append(row)
    if not rows:
        raise ConfigError(f"{path} is empty: the run logged no steps")
    return rows


def _step(row: dict, i: int) -> int | None:
    """The row's step (its index when it has none); None when the step itself is damaged."""
    step = row.get("step", i)
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def series(rows: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows where `key` is a finite scalar (row index when a row has no step); rows
    whose step or value is damaged (not a number) are left out, as a torn line is."""
    steps, values = [], []
    for i, row in enumerate(rows):
        v, step = row.get(key), _step(row, i)
        if step is None or isinstance(v, bool) or not isinstance(v, (int, float, str)):
            continue
        try:
            v = float(v)
        except (ValueError, OverflowError):  # "abc", or an integer past float's range
            continue
        if math.isfinite(v):
            steps.append(step)
            values.append(v)
    return np.asarray(steps), np.asarray(values)


def overflow_keys(rows: list[dict]) -> list[str]:
    """The per-layer `train/router/layer_i/capacity_overflow_rate` keys of the rows, in layer order."""
    keys = {k for row in rows for k in row if OVERFLOW_KEY.match(k)}
    return sorted(keys, key=lambda k: int(OVERFLOW_KEY.match(k).group(1)))


def plot_lines(rows: list[dict], stem: str, title: str, panels, out_dir: Path) -> Path | None:
    """One figure of stacked panels sharing the step axis; None when none of its keys were logged."""
    drawn = [(ylabel, logy, [(label, *series(rows, key)) for key, label in curves]) for ylabel, logy, curves in panels]
    drawn = [(ylabel, logy, [c for c in curves if len(c[1])]) for ylabel, logy, curves in drawn]
    drawn = [p for p in drawn if p[2]]
    if not drawn:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(drawn), 1, figsize=(8, 3.2 * len(drawn) + 0.6), sharex=True, squeeze=False,
                             layout="constrained")
    for ax, (ylabel, logy, curves) in zip(axes[:, 0], drawn):
        for label, x, y in curves:
            sparse = len(x) < 0.2 * len(rows)  # eval points: markers, or a few dots would vanish
            ax.plot(x, y, label=label, marker="o" if sparse else None, markersize=4, linewidth=1.2)
        if logy and all((y > 0).all() for _, _, y in curves):
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(curves) > 1:
            ax.legend(fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title)
    return _save(fig, out_dir / f"{stem}.png")


def plot_overflow(rows: list[dict], out_dir: Path) -> Path | None:
    """Per-layer dropped fraction (`train/router/layer_i/capacity_overflow_rate`), one curve per layer."""
    keys = overflow_keys(rows)
    curves = [(f"layer_{OVERFLOW_KEY.match(key).group(1)}", key) for key in keys]
    return plot_lines(rows, "drops_per_layer", "MoE dropped fraction per layer",
                      (("fraction of valid assignments", False, tuple((k, lbl) for lbl, k in curves)),), out_dir)


def load_matrix(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(steps [S], load / mean load over experts [L, E, S]) from the rows that logged a full [L][E] load."""
    steps, loads = [], []
    for i, row in enumerate(rows):
        v, step = row.get(LOAD_KEY), _step(row, i)
        if not isinstance(v, list) or step is None:
            continue
        try:
            a = np.asarray(v, dtype=np.float64)
        except (ValueError, TypeError, OverflowError):  # ragged, or not numbers: a damaged row
            continue
        if a.ndim == 1:  # a single layer logged as [E]
            a = a[None]
        if a.ndim != 2 or a.size == 0 or (loads and a.shape != loads[0].shape):
            continue
        steps.append(step)
        loads.append(a)
    if not loads:
        return np.zeros(0), np.zeros((0, 0, 0))
    load_SLE = np.stack(loads)
    mean_SL1 = load_SLE.mean(axis=-1, keepdims=True)
    rel_SLE = np.divide(load_SLE, mean_SL1, out=np.ones_like(load_SLE), where=mean_SL1 > 0)
    return np.asarray(steps), rel_SLE.transpose(1, 2, 0)


def step_edges(steps: np.ndarray) -> np.ndarray:
    """Column edges for loads logged at these steps: halfway between neighbours, so columns keep their
    place when loads are logged every N steps plus the last step (uneven spacing)."""
    s = np.asarray(steps, dtype=np.float64)
    if len(s) == 1:
        return np.array([s[0] - 0.5, s[0] + 0.5])
    mid = (s[1:] + s[:-1]) / 2.0
    return np.concatenate([[2.0 * s[0] - mid[0]], mid, [2.0 * s[-1] - mid[-1]]])


def plot_load(rows: list[dict], out_dir: Path, layer: int | None) -> Path | None:
    steps, rel_LES = load_matrix(rows)
    if not len(steps):
        return None
    n_layers = rel_LES.shape[0]
    if layer is not None and not 0 <= layer < n_layers:
        raise ConfigError(f"--layer {layer} is out of range: the run logged loads of {n_layers} layers")
    layers = [layer] if layer is not None else list(range(n_layers))
    plt = _plt()
    from matplotlib.colors import TwoSlopeNorm

    vmax = max(2.0, float(np.nanmax(rel_LES[layers])))  # symmetric-ish room above 1 even when balanced
    norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=vmax)
    x_edges, e_edges = step_edges(steps), np.arange(rel_LES.shape[1] + 1) - 0.5
    fig, axes = plt.subplots(len(layers), 1, figsize=(9, min(2.2 * len(layers), 40) + 1.0), sharex=True,
                             squeeze=False, layout="constrained")
    for ax, i in zip(axes[:, 0], layers):
        im = ax.pcolormesh(x_edges, e_edges, rel_LES[i], cmap="RdBu_r", norm=norm, shading="flat")
        ax.set_ylim(e_edges[-1], e_edges[0])  # expert 0 on top
        ax.set_ylabel(f"layer {i}\nexpert")
        ax.yaxis.set_major_locator(plt.MaxNLocator(integer=True))  # expert ids, not fractions
    axes[-1, 0].set_xlabel("step")
    fig.colorbar(im, ax=axes[:, 0].tolist(), label="load / mean load", shrink=0.9)
    fig.suptitle("expert load (tokens routed / mean over experts)")
    return _save(fig, out_dir / ("expert_load.png" if layer is None else f"expert_load_layer{layer}.png"))


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def write_report(run_dir: Path, out_dir: Path | None = None, layer: int | None = None) -> list[Path]:
    """Draw every plot the metrics allow into out_dir (default RUN_DIR/report); the files written."""
    run_dir = Path(run_dir)
    rows = load_rows(run_dir)
    out_dir = Path(out_dir) if out_dir is not None else run_dir / "report"
    created = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create report dir {out_dir}: {e.strerror or e}") from None
    written: list[Path] = []
    try:
        for stem, title, panels in FIGURES:
            written.append(plot_lines(rows, stem, title, panels, out_dir))
        written.append(plot_overflow(rows, out_dir))  # one at a time: a plot that raises must not lose
        written.append(plot_load(rows, out_dir, layer))  # the path of the one drawn before it (unlinked below)
        written = [p for p in written if p is not None]
        if not written:
            raise ConfigError(f"{run_dir / 'metrics.jsonl'} has none of the plotted metrics "
                              f"(e.g. train/loss, moe/drop_fraction, {LOAD_KEY})")
    except BaseException:  # a failed report leaves nothing: no half set of plots, no empty dir
        for p in written:
            if p is not None:
                p.unlink(missing_ok=True)
        if created:
            try:
                out_dir.rmdir()  # only when empty: nothing but what this call wrote is removed
            except OSError:
                pass
        raise
    return written


def _cmd_report(args) -> int:
    for path in write_report(Path(args.run_dir), Path(args.out) if args.out else None, args.layer):
        print(path)
    return 0


def register(sub) -> None:
    """Add the `report` subparser to the `moejax` command."""
    r = sub.add_parser("report", help="PNG plots of a run's metrics.jsonl (loss, drops, lr, MFU, expert load)")
    r.add_argument("run_dir")
    r.add_argument("--out", help="output directory (default: RUN_DIR/report)")
    r.add_argument("--layer", type=int, help="expert-load heat map of this layer only (default: all layers)")
    r.set_defaults(fn=_cmd_report)
