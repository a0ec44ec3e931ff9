"""The CPU micro-ladder: the ladder rule at toy widths, every rung a real training run (SPEC §5).

Rungs are `presets.TINY` with the width varied; everything else follows the production rule:
- layers, heads: MICRO_SHAPES (head dim 16 = TINY's, so H = d/16; layers ~ d/32 as TINY's 4 at d 128);
- KV heads local H/4, global max(1, H/8), expert = latent = shared width d/2 (`presets.ladder_shape`);
- 16 experts top-2, vocab 2048, batch 16 x 128 tokens (TINY's);
- steps = max(MICRO_MIN_STEPS, round(MICRO_TOKENS_PER_ACTIVE_PARAM * N_active / tokens per step)).
  The production 791 tokens per active parameter would need ~26,000 steps at d 96 (hours on a laptop),
  so the micro-ladder uses 6 tokens per active parameter (791 / ~130): the five rungs then take
  54…648 steps, 1,471 steps in all (wall time: docs/LOG.md).
  The ratio is the same at every rung, so the rungs stay compute-proportional like the real ladder.
- the full recipe: optimizer "hero" (MuonH/AdamH/Adam with the SPEC §4 heuristic), QB router bias,
  local (dropless) MoE path since one CPU device has no expert axis.

Results land in DIR/results.csv, one row per rung, read back from each rung's metrics.jsonl and
summary.json; rungs already in results.csv are skipped (resumable), and a rung killed mid-run resumes
from its own checkpoints through `train`.
"""

from __future__ import annotations

import csv
import json
import math
import time
from dataclasses import replace
from pathlib import Path

from moejax import accounting
from moejax.config import ConfigError, RunConfig
from moejax.presets import TINY, ladder_shape

MICRO_SHAPES = {32: (2, 2), 48: (2, 3), 64: (2, 4), 80: (3, 5), 96: (3, 6)}  # d -> (layers, heads)
MICRO_TOKENS_PER_ACTIVE_PARAM = 6
MICRO_MIN_STEPS = 20

RESULT_FIELDS = ("name", "width", "layers", "active_params", "total_params", "steps", "tokens", "flops",
                 "final_loss", "eval_loss", "drop_fraction", "max_grad_norm", "final_grad_norm",
                 "tokens_per_s", "mfu", "wall_s", "status")


def micro_rung(d_model: int, steps: int | None = None) -> RunConfig:
    """The micro rung at width d (optionally with the step count overridden, for tests)."""
    if d_model not in MICRO_SHAPES:
        raise ConfigError(f"no micro-ladder rung at width {d_model} (known: {sorted(MICRO_SHAPES)})")
    n_layers, n_heads = MICRO_SHAPES[d_model]
    model = ladder_shape(TINY.model, d_model, n_layers, n_heads)
    train = replace(TINY.train, optimizer="hero", eval_every=0, temp_checkpoint_minutes=1e6)
    if steps is None:
        steps = max(MICRO_MIN_STEPS,
                    round(MICRO_TOKENS_PER_ACTIVE_PARAM * accounting.active_params(model) / train.tokens_per_step))
    # Only the final checkpoint (permanent ones every `steps`): the rungs are minutes long.
    train = replace(train, steps=steps, checkpoint_every=steps)
    return RunConfig(name=f"micro-d{d_model}", model=model, train=train, parallel=TINY.parallel)


def read_results(out: Path) -> list[dict]:
    path = Path(out) / "results.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows, header = list(reader), reader.fieldnames or []
    missing = [k for k in RESULT_FIELDS if k not in header]
    if missing:
        raise ConfigError(f"{path} lacks the column(s) {', '.join(missing)}; it is not a `moejax ladder run` results "
                          "file, or it was edited")
    def number(line: int, key: str, value) -> float:
        try:
            return float(value)
        except (TypeError, ValueError):  # a short row gives None
            raise ConfigError(f"{path} line {line}: {key} is {value!r}, not a number") from None

    return [{k: (r[k] if k in ("name", "status") else number(line, k, r[k])) for k in RESULT_FIELDS}
            for line, r in enumerate(rows, start=2)]


def _append_result(out: Path, row: dict) -> None:
    path = Path(out) / "results.csv"
    new = not path.exists()
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=RESULT_FIELDS)
        if new:
            w.writeheader()
        w.writerow(row)


def _finite(v) -> float:
    try:
        x = float(v)
    except (TypeError, ValueError):  # metrics.jsonl writes non-finite numbers as strings ("nan")
        return math.nan
    return x


def result_row(cfg: RunConfig, run_dir: Path, status: str, wall: float) -> dict:
    """One results.csv row from a rung's metrics.jsonl (+ summary.json when the run finished)."""
    from moejax.metrics import read_metrics

    m, t = cfg.model, cfg.train
    rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    grads = [_finite(r["train/grad_norm"]) for r in rows if "train/grad_norm" in r]  # not eval-only rows
    last = rows[-1] if rows else {}
    return {
        "name": cfg.name, "width": m.d_model, "layers": m.n_layers,
        "active_params": accounting.active_params(m), "total_params": accounting.total_params(m),
        "steps": t.steps, "tokens": t.total_tokens,
        "flops": accounting.train_flops(m, t.seq_len, t.total_tokens),
        "final_loss": _finite(last.get("train/loss")), "eval_loss": _finite(last.get("eval/loss")),
        "drop_fraction": _finite(last.get("moe/drop_fraction")),
        "max_grad_norm": max(grads) if grads and all(map(math.isfinite, grads)) else math.nan,
        "final_grad_norm": grads[-1] if grads else math.nan,
        "tokens_per_s": _finite(summary.get("tokens_per_second")), "mfu": _finite(summary.get("mfu")),
        "wall_s": wall, "status": status,
    }


def run_micro_ladder(out: Path, widths=None, steps: int | None = None, log=print) -> list[dict]:
    """Train every micro rung not yet in OUT/results.csv; returns all rows."""
    from moejax.perf import measure_matmul_peak
    from moejax.train.loop import RunError, RunOptions, train

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    widths = sorted(MICRO_SHAPES) if widths is None else list(dict.fromkeys(widths))  # each width once
    done = {int(r["width"]) for r in read_results(out)}
    peak = measure_matmul_peak()  # one peak for every rung, so their MFUs compare
    for d in widths:
        cfg = micro_rung(d, steps)
        if d in done:
            log(f"{cfg.name}: already in {out / 'results.csv'}, skipped")
            continue
        log(f"{cfg.name}: {cfg.train.steps} steps, {accounting.active_params(cfg.model):,} active params")
        run_dir, t0, status = out / cfg.name, time.perf_counter(), "ok"
        try:
            train(cfg, run_dir, RunOptions(wandb="disabled", progress=False, peak_flops=peak))
        except RunError as e:  # non-finite loss/grad: keep the rung as a diverged data point
            if "non-finite" not in str(e):
                raise
            status = "nonfinite"
            log(f"{cfg.name}: {e}")
        row = result_row(cfg, run_dir, status, time.perf_counter() - t0)
        _append_result(out, row)
        log(f"{cfg.name}: loss {row['final_loss']:.4f} eval {row['eval_loss']:.4f} "
            f"in {row['wall_s']:.0f} s ({row['tokens_per_s']:,.0f} tok/s)")
    return read_results(out)
