"""Routing-health alarms: cheap host-side checks over the metrics a train step already returns.

Dimensions: L layers, E routed experts, W the trend window (`AlarmConfig.window`).

Nothing here touches a device. `Alarms.check(step, metrics, load_LE)` reads the step's host scalars
(drop fraction, router-bias range, grad norm) and its [L, E] expert loads (assignments routed to each
expert). Routing checks run every `every` steps and count in checks; the grad-norm check runs every step,
since a spike lasts one step. State is fixed for the whole run, O(L*E + W): counters of consecutive bad
checks per layer / per expert and fixed-length deques — nothing grows with the step count.

An alarm is raised once when its condition starts to hold and cleared (one line too) when a check finds it
gone, so a collapse that lasts 10,000 steps is one line, not 1,000. The kinds:

  collapse     a layer's max/mean expert load >= collapse_ratio for `patience` consecutive checks
  dead_expert  experts with load/mean load <= dead_load for `patience` consecutive checks (one alarm per layer)
  drop         drop fraction >= drop_max for `patience` checks, or rising across a full window: the least-
               squares line through the last W checks rises by >= drop_rise
  bias_drift   router-bias range (max over layers of max - min over experts) >= bias_range_max, or rising
               across a full window by >= bias_growth x the window's mean (QB bias growing without bound)
  grad_norm    non-finite, or >= grad_spike x the median of the last W finite grad norms (full window only)

A fitted line rather than first-vs-last makes the trend tests robust to one noisy check at either end.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np

from moejax.config import AlarmConfig

KINDS = ("collapse", "dead_expert", "drop", "bias_drift", "grad_norm")
LOAD_KEY = "train/router/load"
DROP_KEY = "moe/drop_fraction"
BIAS_KEY = "train/router/bias_range"
BIAS_LAYER_KEY = "train/router/bias_range_layer"
GRAD_KEY = "train/grad_norm"
ROW_KEY = "alarms"  # metrics.jsonl: the step's raised/cleared alarms in full (a list: W&B skips it)
MAX_LISTED = 12  # expert ids spelled out in one dead-expert line


@dataclass(frozen=True)
class Alarm:
    kind: str  # one of KINDS
    step: int
    value: float  # the offending number: max/mean load, load/mean, drop fraction, bias range, grad norm
    threshold: float
    message: str  # the numbers, in words
    layer: int | None = None
    expert: int | None = None
    cleared: bool = False  # False: raised at this step; True: its condition no longer holds

    def line(self) -> str:
        where = "".join(f", {n} {v}" for n, v in (("layer", self.layer), ("expert", self.expert)) if v is not None)
        return f"alarm {self.kind} {'cleared' if self.cleared else 'raised'} at step {self.step}{where}: {self.message}"

    def to_dict(self) -> dict:
        d = asdict(self)
        for k in ("value", "threshold"):  # JSON has no NaN or Infinity: strings, as metrics.py writes them
            d[k] = d[k] if math.isfinite(d[k]) else str(d[k])
        return d

    @staticmethod
    def from_dict(d: dict) -> "Alarm":
        return Alarm(**{**d, "value": float(d["value"]), "threshold": float(d["threshold"])})


def alarm_fields(alarms: list[Alarm]) -> dict:
    """Row entries for a step's alarms: `alarm/<kind>` = the worst raised value (a W&B scalar) and the
    full list under ROW_KEY. Nothing when no alarm was raised or cleared."""
    if not alarms:
        return {}
    out: dict = {ROW_KEY: [a.to_dict() for a in alarms]}
    for a in alarms:
        if a.cleared:
            continue
        key = f"alarm/{a.kind}"
        worse = min if a.kind == "dead_expert" else max  # a dead expert is worse the lower its load
        out[key] = a.value if key not in out or math.isnan(a.value) else worse(out[key], a.value)
    return out


def fitted_rise(values) -> float:
    """Rise across the window of the least-squares line through `values` (slope x (n - 1)). Plain Python:
    W is small and this runs at every check, where numpy's per-call overhead would dominate."""
    n = len(values)
    if n < 2:
        return 0.0
    x_mean, y_mean = (n - 1) / 2.0, sum(values) / n
    cov = sum((i - x_mean) * (y - y_mean) for i, y in enumerate(values))
    return cov / (n * (n * n - 1) / 12.0) * (n - 1)  # sum((i - x_mean)^2) = n (n^2 - 1) / 12


def _number(v) -> float | None:
    """A metric as a float (metrics.py writes non-finite values as "nan"/"inf" strings); None if absent."""
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _ids(ids) -> str:
    shown = ", ".join(str(int(i)) for i in ids[:MAX_LISTED])
    return shown + (f" (+{len(ids) - MAX_LISTED} more)" if len(ids) > MAX_LISTED else "")


class Alarms:
    """The alarm state of one run (restarts begin afresh: an alarm still true is raised again)."""

    def __init__(self, cfg: AlarmConfig):
        self.cfg = cfg
        self._shape: tuple[int, int] | None = None
        self._collapse_run_L = self._collapse_on_L = None
        self._dead_run_LE = self._dead_on_LE = None
        self._drop_W: deque[float] = deque(maxlen=cfg.window)
        self._high_drop_run, self._drop_on = 0, False
        self._bias_W: deque[float] = deque(maxlen=cfg.window)
        self._bias_on = False
        self._grad_W: deque[float] = deque(maxlen=cfg.window)
        self._grad_on = False

    @property
    def active(self) -> set[tuple]:
        """(kind, layer, expert) of every alarm raised and not cleared."""
        out = {(k, None, None) for k, on in (("drop", self._drop_on), ("bias_drift", self._bias_on),
                                             ("grad_norm", self._grad_on)) if on}
        if self._shape is not None:
            out |= {("collapse", int(i), None) for i in np.flatnonzero(self._collapse_on_L)}
            out |= {("dead_expert", int(i), int(e)) for i, e in zip(*np.nonzero(self._dead_on_LE))}
        return out

    def check(self, step: int, metrics: dict, load_LE=None) -> list[Alarm]:
        """The alarms raised or cleared at this step; `load_LE` is the step's [L, E] expert load."""
        if not self.cfg.enabled:
            return []
        out = self._grad(step, _number(metrics.get(GRAD_KEY)))
        if step % self.cfg.every:
            return out
        if load_LE is not None:
            load_LE = np.asarray(load_LE)
            load_LE = load_LE[None] if load_LE.ndim == 1 else load_LE
            self._reset_shape(load_LE.shape)
            mean_L = load_LE.sum(axis=-1) / load_LE.shape[-1]  # in the load dtype: ample for a ratio
            out += self._collapse(step, load_LE, mean_L) + self._dead(step, load_LE, mean_L)
        if (drop := _number(metrics.get(DROP_KEY))) is not None and math.isfinite(drop):
            out += self._drop(step, drop)
        if (bias := _number(metrics.get(BIAS_KEY))) is not None and math.isfinite(bias):
            out += self._bias(step, bias, metrics.get(BIAS_LAYER_KEY))
        return out

    def _reset_shape(self, shape: tuple[int, int]) -> None:
        if self._shape == shape:
            return
        self._shape = shape
        self._collapse_run_L, self._collapse_on_L = np.zeros(shape[0], np.int64), np.zeros(shape[0], bool)
        self._dead_run_LE, self._dead_on_LE = np.zeros(shape, np.int64), np.zeros(shape, bool)

    def _collapse(self, step: int, load_LE: np.ndarray, mean_L: np.ndarray) -> list[Alarm]:
        c = self.cfg
        ratio_L = np.divide(load_LE.max(axis=-1), mean_L, out=np.ones_like(mean_L), where=mean_L > 0)
        bad_L = ratio_L >= c.collapse_ratio
        self._collapse_run_L = np.where(bad_L, self._collapse_run_L + 1, 0)
        new_L = (self._collapse_run_L >= c.patience) & ~self._collapse_on_L
        out = []
        for i in np.flatnonzero(new_L):
            e = int(np.argmax(load_LE[i]))
            share = load_LE[i, e] / max(load_LE[i].sum(), 1e-30)
            out.append(Alarm("collapse", step, float(ratio_L[i]), c.collapse_ratio,
                             f"max/mean expert load {ratio_L[i]:.2f} >= {c.collapse_ratio:g} for {c.patience} "
                             f"checks (expert {e} takes {share:.1%} of the layer's assignments)", int(i), e))
        for i in np.flatnonzero(self._collapse_on_L & ~bad_L):
            out.append(Alarm("collapse", step, float(ratio_L[i]), c.collapse_ratio,
                             f"max/mean expert load {ratio_L[i]:.2f} < {c.collapse_ratio:g}", int(i), cleared=True))
        self._collapse_on_L = (self._collapse_on_L | new_L) & bad_L
        return out

    def _dead(self, step: int, load_LE: np.ndarray, mean_L: np.ndarray) -> list[Alarm]:
        c = self.cfg
        bad_LE = (load_LE <= c.dead_load * mean_L[:, None]) & (mean_L > 0)[:, None]  # no [L, E] division
        if not bad_LE.any() and not self._dead_on_LE.any():  # the usual case, kept cheap at [48, 384]
            self._dead_run_LE.fill(0)
            return []
        rel_LE = load_LE / np.where(mean_L > 0, mean_L, 1.0)[:, None]
        self._dead_run_LE = np.where(bad_LE, self._dead_run_LE + 1, 0)
        new_LE = (self._dead_run_LE >= c.patience) & ~self._dead_on_LE
        back_LE = self._dead_on_LE & ~bad_LE
        out = []
        for i in np.flatnonzero(new_LE.any(axis=-1)):
            ids = np.flatnonzero(new_LE[i])
            worst = int(ids[np.argmin(rel_LE[i, ids])])
            out.append(Alarm("dead_expert", step, float(rel_LE[i, worst]), c.dead_load,
                             f"{len(ids)} expert(s) at load/mean <= {c.dead_load:g} for {c.patience} checks "
                             f"(lowest {rel_LE[i, worst]:.3g}): {_ids(ids)}", int(i), worst))
        for i in np.flatnonzero(back_LE.any(axis=-1)):
            ids = np.flatnonzero(back_LE[i])
            out.append(Alarm("dead_expert", step, float(rel_LE[i, ids].min()), c.dead_load,
                             f"{len(ids)} expert(s) back above load/mean {c.dead_load:g}: {_ids(ids)}", int(i),
                             int(ids[0]), cleared=True))
        self._dead_on_LE = (self._dead_on_LE | new_LE) & bad_LE
        return out

    def _drop(self, step: int, drop: float) -> list[Alarm]:
        c = self.cfg
        self._drop_W.append(drop)
        self._high_drop_run = self._high_drop_run + 1 if drop >= c.drop_max else 0
        rise = fitted_rise(self._drop_W) if len(self._drop_W) == c.window else 0.0
        high, rising = self._high_drop_run >= c.patience, rise >= c.drop_rise
        if (high or rising) and not self._drop_on:
            self._drop_on = True
            if high:
                return [Alarm("drop", step, drop, c.drop_max,
                              f"drop fraction {drop:.4f} >= {c.drop_max:g} for {c.patience} checks")]
            return [Alarm("drop", step, drop, c.drop_rise,
                          f"drop fraction rising: {self._drop_W[0]:.4f} -> {drop:.4f} over the last {c.window} "
                          f"checks (fitted rise {rise:.4f} >= {c.drop_rise:g})")]
        if self._drop_on and not (high or rising):
            self._drop_on = False
            return [Alarm("drop", step, drop, c.drop_max, f"drop fraction {drop:.4f} < {c.drop_max:g}, fitted "
                                                          f"rise {rise:.4f} < {c.drop_rise:g}", cleared=True)]
        return []

    def _bias(self, step: int, bias: float, layer) -> list[Alarm]:
        c = self.cfg
        self._bias_W.append(bias)
        layer = None if _number(layer) is None else int(_number(layer))
        full = len(self._bias_W) == c.window
        mean = sum(self._bias_W) / len(self._bias_W)
        rise = fitted_rise(self._bias_W) if full else 0.0
        high, growing = bias >= c.bias_range_max, full and mean > 0 and rise >= c.bias_growth * mean
        if (high or growing) and not self._bias_on:
            self._bias_on = True
            if high:
                return [Alarm("bias_drift", step, bias, c.bias_range_max,
                              f"router-bias range {bias:.3g} >= {c.bias_range_max:g}", layer)]
            return [Alarm("bias_drift", step, bias, c.bias_growth,
                          f"router-bias range growing: {self._bias_W[0]:.3g} -> {bias:.3g} over the last {c.window} "
                          f"checks (fitted rise {rise:.3g} >= {c.bias_growth:g} x mean {mean:.3g})", layer)]
        if self._bias_on and not (high or growing):
            self._bias_on = False
            return [Alarm("bias_drift", step, bias, c.bias_range_max,
                          f"router-bias range {bias:.3g} < {c.bias_range_max:g}, fitted rise {rise:.3g} < "
                          f"{c.bias_growth:g} x mean {mean:.3g}", layer, cleared=True)]
        return []

    def _grad(self, step: int, g: float | None) -> list[Alarm]:
        if g is None:
            return []
        c = self.cfg
        full = len(self._grad_W) == c.window
        # The median only when the window's minimum says a spike is possible: this runs every step.
        maybe = full and math.isfinite(g) and g >= c.grad_spike * min(self._grad_W)
        median = statistics.median(self._grad_W) if maybe or (self._grad_on and full) else math.nan
        spike = maybe and g >= c.grad_spike * median
        out = []
        if not math.isfinite(g) and not self._grad_on:
            out.append(Alarm("grad_norm", step, g, math.inf, f"grad norm is {g}"))
        elif spike and not self._grad_on:
            out.append(Alarm("grad_norm", step, g, c.grad_spike,
                             f"grad norm {g:.4g} >= {c.grad_spike:g} x the median {median:.4g} of the last "
                             f"{c.window} steps"))
        elif self._grad_on and math.isfinite(g) and not spike:
            under = f"under {c.grad_spike:g} x the median {median:.4g}" if full else "finite"
            out.append(Alarm("grad_norm", step, g, c.grad_spike, f"grad norm {g:.4g} back {under}", cleared=True))
        self._grad_on = not math.isfinite(g) or spike
        if math.isfinite(g):  # a spike enters the median too: a lasting level shift stops alarming
            self._grad_W.append(g)
        return out
