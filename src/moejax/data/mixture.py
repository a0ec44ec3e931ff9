"""Which source and which window every row of every step reads: a pure function of (seed, step).

Notable choices:
  * **Rows per source are apportioned, not sampled.** Within a span of constant weights, the first T rows
    go to sources by Sainte-Laguë (Webster) apportionment of T: source k's j-th row has priority
    (2j+1)/W_k and rows are the T smallest priorities (ties by source index). It is house-monotone, so
    the rows of step s are the difference of two apportionments, computed in O(K) exact integer
    arithmetic for any s — no counters to carry, exact resume, and proportions within one row of ideal
    at every step (random sampling would be off by ~sqrt(T)).
  * **A plan of spans.** Weights change at the cooldown switch (SPEC §5, ~80% of steps), at every
    context-length change, and when a source reaches its epoch cap (it leaves the mixture; the others'
    weights are renormalised). The plan is computed once from the config in O(spans * K log steps) and
    fails early if every source runs dry before the last step.
  * **Windows, not documents.** A source's train tokens are cut into windows of seq_len + 1 tokens at
    multiples of seq_len; epoch e visits them in a keyed pseudo-random order (a Feistel bijection with
    cycle walking, so no permutation of billions of windows is ever materialised). Progress is kept in
    epochs (a float) across a length change, so the epoch in progress at a switch is approximate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from moejax.config import ConfigError

WEIGHT_QUANTUM = 1_000_000  # weights become integers so apportionment is exact


def integer_weights(weights: list[float]) -> list[int]:
    total = sum(weights)
    return [max(1, round(WEIGHT_QUANTUM * w / total)) for w in weights]


def apportion(total: int, w: list[int]) -> list[int]:
    """Sainte-Laguë seats of `total` rows for integer weights `w`: the `total` smallest (2j+1)/w_k."""
    ws = sum(w)
    seats = [(2 * total * wk + ws) // (2 * ws) for wk in w]  # every event with priority <= 2*total/ws
    while sum(seats) > total:  # drop the largest last priority (ties: the higher index goes first)
        seats[_extreme(seats, w, last=True)] -= 1
    while sum(seats) < total:  # add the smallest next priority (ties: the lower index goes first)
        seats[_extreme(seats, w, last=False)] += 1
    return seats


def _extreme(seats: list[int], w: list[int], last: bool) -> int:
    """Index of the largest last priority (last=True) or the smallest next one, compared exactly."""
    best, best_num = -1, 0
    for i, wi in enumerate(w):
        if last and not seats[i]:
            continue
        num = 2 * seats[i] - 1 if last else 2 * seats[i] + 1
        if best < 0:
            best, best_num = i, num
            continue
        lhs, rhs = num * w[best], best_num * wi  # num/wi vs best_num/w[best]
        if (lhs > rhs or (lhs == rhs and last)) if last else lhs < rhs:
            best, best_num = i, num
    return best


@dataclass(frozen=True)
class Span:
    """Steps [start, stop) with constant sources, weights and sequence length."""

    start: int
    stop: int
    seq_len: int
    batch_size: int
    sources: tuple[int, ...]  # indices into the mixture's source list
    weights: tuple[int, ...]  # integer weights, aligned with `sources`
    first_window: tuple[int, ...]  # per active source: its window counter at `start` (at this seq_len)

    def rows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source index, window counter) of each row of `step`, rows in priority order (interleaved)."""
        t0 = (step - self.start) * self.batch_size
        a0, a1 = apportion(t0, list(self.weights)), apportion(t0 + self.batch_size, list(self.weights))
        src, ctr, prio = [], [], []
        for k, w, base, lo, hi in zip(self.sources, self.weights, self.first_window, a0, a1):
            j = np.arange(lo, hi, dtype=np.int64)
            src.append(np.full(len(j), k, np.int64)), ctr.append(base + j), prio.append((2 * j + 1) / w)
        src, ctr, prio = np.concatenate(src), np.concatenate(ctr), np.concatenate(prio)
        order = np.lexsort((src, prio))
        return src[order], ctr[order]


def build_plan(n_windows, weights_by_phase, caps, boundaries, total_steps: int, names: list[str]) -> list[Span]:
    """Spans covering [0, total_steps).

    n_windows(k, seq_len) -> windows per epoch of source k; weights_by_phase: [(start_step, {k: weight})];
    caps: {k: max epochs}; boundaries: [(start_step, seq_len, batch_size)] of the context schedule.
    """
    cuts = sorted({0, *(s for s, _ in weights_by_phase), *(s for s, _, _ in boundaries)} - {total_steps})
    cuts = [c for c in cuts if c < total_steps] + [total_steps]
    epochs = {k: 0.0 for _, w in weights_by_phase for k in w}
    exhausted: set[int] = set()
    spans: list[Span] = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        phase = max((p for p in weights_by_phase if p[0] <= lo), key=lambda p: p[0])[1]
        _, seq_len, bsz = max((b for b in boundaries if b[0] <= lo), key=lambda b: b[0])
        start = lo
        while start < hi:
            active = [k for k in sorted(phase) if k not in exhausted]
            if not active:
                raise ConfigError(f"every source reaches its data.max_epochs cap by step {start} of {total_steps} "
                                  f"(caps: {', '.join(f'{names[k]}={c:g}' for k, c in sorted(caps.items()))}); "
                                  "raise the caps or add data")
            w = integer_weights([phase[k] for k in active])
            first = [math.ceil(epochs[k] * n_windows(k, seq_len) - 1e-9) for k in active]
            stop, gone = hi, None
            for i, k in enumerate(active):
                if k in caps:
                    s = _first_step_over(caps[k] * n_windows(k, seq_len) - first[i], i, w, bsz, start, stop)
                    if s < stop:
                        stop, gone = s, k
            span = Span(start, stop, seq_len, bsz, tuple(active), tuple(w), tuple(first))
            if stop > start:
                spans.append(span)
            seats = apportion((stop - start) * bsz, w)
            for i, k in enumerate(active):
                epochs[k] = (first[i] + seats[i]) / n_windows(k, seq_len)
            if gone is not None:
                exhausted.add(gone)
            start = stop
    return spans


def _first_step_over(budget: float, i: int, w: list[int], bsz: int, start: int, stop: int) -> int:
    """First step in [start, stop) whose rows would take source i past `budget` windows; `stop` if none."""
    def over(s):
        return apportion((s + 1 - start) * bsz, w)[i] > budget

    if not over(stop - 1):
        return stop
    lo, hi = start, stop - 1  # over(hi) is True
    while lo < hi:
        mid = (lo + hi) // 2
        if over(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


# ---- keyed bijection on [0, n): the window order of one epoch ----------------------------------------
_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    """splitmix64 finaliser of x ^ key (uint64, wrapping)."""
    with np.errstate(over="ignore"):
        z = (x ^ key) + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def permute(i: np.ndarray, n: int, key: tuple[int, ...], rounds: int = 4) -> np.ndarray:
    """The image of indices `i` (< n) under a pseudo-random bijection of [0, n) chosen by `key`."""
    half = max(1, math.ceil(math.log2(max(n, 2)) / 2))
    mask = np.uint64((1 << half) - 1)
    keys = np.random.default_rng(list(key)).integers(0, 2**63, size=rounds, dtype=np.uint64)
    x = np.asarray(i, np.uint64)
    todo = np.ones(x.shape, bool)
    while todo.any():  # cycle walking: re-apply until the value lands inside [0, n)
        left, right = x[todo] >> np.uint64(half), x[todo] & mask
        for k in keys:
            left, right = right, left ^ (_mix(right, k) & mask)
        x[todo] = (left << np.uint64(half)) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)
