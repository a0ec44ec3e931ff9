"""The training loop: run directory, data, state, jitted step, eval, metrics, summary.

Writes into RUN_DIR: `config.json` (the resolved RunConfig), `run_info.json` (git SHA, library versions,
device topology, derived numbers), `metrics.jsonl` (one object per step), `summary.json`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from moejax import accounting
from moejax.config import ConfigError, RunConfig
from moejax.data.default import bible_store
from moejax.data.loader import Batcher
from moejax.data.tokenizer import bytes_per_token
from moejax.metrics import MetricsWriter, to_py
from moejax.perf import measure_matmul_peak
from moejax.train.state import init_state
from moejax.train.step import make_eval_step, make_train_step


class RunError(RuntimeError):
    """A user-facing problem with the run directory or the run itself (one line, exit 2)."""


@dataclass(frozen=True)
class RunOptions:
    overwrite: bool = False
    wandb: str = "offline"
    wandb_project: str = "moejax"
    peak_flops: float = 0.0  # 0: measure this machine's fp32 matmul peak at start
    progress: bool = True
    remat: bool = False


def lr_schedule(cfg: RunConfig, peak: float):
    """Linear warmup over warmup_fraction of the steps, then linear decay to min_lr_fraction * peak."""
    t = cfg.train
    warm = max(1, int(round(t.warmup_fraction * t.steps)))
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, warm),
         optax.linear_schedule(peak, peak * t.min_lr_fraction, max(1, t.steps - warm))], [warm])


def make_optimizer(cfg: RunConfig):
    t = cfg.train
    if t.optimizer != "adam":
        raise ConfigError(f"train.optimizer {t.optimizer!r} is not available in this build (use 'adam')")
    lr = lr_schedule(cfg, t.learning_rate)
    return optax.adam(lr, b1=t.b1, b2=t.b2, eps=t.eps), lr


def prepare_run_dir(run_dir: Path, cfg: RunConfig, overwrite: bool) -> None:
    cfg_path = run_dir / "config.json"
    if cfg_path.exists() and not overwrite:
        try:
            old = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RunError(f"run dir {run_dir} has an unreadable config.json ({e}); pass --overwrite to replace it")
        diff = _first_difference(old, cfg.to_dict())
        if diff:
            raise RunError(f"run dir {run_dir} already holds a different run ({diff}); "
                           "choose another --run-dir or pass --overwrite")
        raise RunError(f"run dir {run_dir} already holds this run; pass --overwrite to start it again")
    if run_dir.exists() and overwrite:
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(cfg_path, cfg.to_json())
    except OSError as e:
        raise RunError(f"cannot write to run dir {run_dir}: {e.strerror or e}") from None


def _first_difference(old: dict, new: dict, prefix: str = "") -> str:
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            d = _first_difference(a, b, f"{prefix}{key}.")
            if d:
                return d
        elif a != b:
            return f"{prefix}{key}: {a!r} there, {b!r} now"
    return ""


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def run_info(cfg: RunConfig, peak: float) -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("jax", "jaxlib", "optax", "orbax-checkpoint", "numpy", "tokenizers")}
    return {"git_sha": sha, "python": sys.version.split()[0], "versions": versions,
            "devices": [str(d) for d in jax.devices()], "process_count": jax.process_count(),
            "peak_flops": peak, "accounting": accounting.summary(cfg, exact=True)}


def train(cfg: RunConfig, run_dir: Path, opts: RunOptions = RunOptions()) -> dict:
    run_dir = Path(run_dir)
    prepare_run_dir(run_dir, cfg, opts.overwrite)
    m, t = cfg.model, cfg.train
    store, tok = bible_store(m.vocab_size)
    if tok.get_vocab_size() > m.vocab_size:
        raise RunError(f"tokenizer has {tok.get_vocab_size()} ids but model.vocab_size is {m.vocab_size}")
    train_data = Batcher(store, t.seq_len, t.batch_size, t.seed, "train")
    eval_data = Batcher(store, t.seq_len, t.batch_size, t.seed, "eval")
    bpt = jnp.asarray(bytes_per_token(tok, m.vocab_size))

    peak = opts.peak_flops or measure_matmul_peak()
    _atomic_write(run_dir / "run_info.json", json.dumps(run_info(cfg, peak), indent=2))
    flops_per_step = 3.0 * accounting.fwd_flops_per_token(m, t.seq_len) * t.tokens_per_step

    optimizer, lr_fn = make_optimizer(cfg)
    state = init_state(cfg, optimizer, jax.random.key(t.seed))
    step_fn = jax.jit(make_train_step(m, optimizer, lr_fn, remat=opts.remat), donate_argnums=0)
    eval_fn = jax.jit(make_eval_step(m))

    writer = MetricsWriter(run_dir, wandb_mode=opts.wandb, project=opts.wandb_project, run_name=run_dir.name,
                           config=cfg.to_dict())
    bar = tqdm(total=t.steps, disable=not opts.progress, desc=f"train {cfg.name}", unit="step", dynamic_ncols=True)
    history, t_start = [], time.perf_counter()
    try:
        for step in range(int(state.step), t.steps):
            t0 = time.perf_counter()
            state, metrics = step_fn(state, train_data.batch(step))
            metrics = {k: to_py(v) for k, v in jax.device_get(metrics).items()}
            dt = time.perf_counter() - t0
            _check_finite(step, metrics, run_dir)
            metrics.update({"throughput/step_time": dt, "throughput/tokens_per_second": t.tokens_per_step / dt,
                            "throughput/mfu": flops_per_step / dt / peak})
            last = step + 1 == t.steps
            if last or (t.eval_every and (step + 1) % t.eval_every == 0):
                metrics.update(evaluate(eval_fn, state.params, eval_data, t.eval_batches, bpt, "eval/"))
            if step % t.log_every == 0 or last:
                writer.log(step, metrics)
            history.append(metrics)
            bar.set_postfix(loss=f"{metrics['train/loss']:.3f}", tok_s=f"{metrics['throughput/tokens_per_second']:.0f}",
                            drop=f"{metrics['moe/drop_fraction']:.3f}")
            bar.update(1)
    finally:
        bar.close()
        writer.close()
    summary = summarize(history, time.perf_counter() - t_start, cfg)
    _atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def evaluate(eval_fn, params, data: Batcher, n_batches: int, bpt, prefix: str) -> dict:
    ce, toks, nbytes = 0.0, 0.0, 0.0
    for i in range(n_batches):
        out = jax.device_get(eval_fn(params, data.batch(i), bpt))
        ce, toks, nbytes = ce + float(out["ce_sum"]), toks + float(out["tokens"]), nbytes + float(out["bytes"])
    return {f"{prefix}loss": ce / max(toks, 1.0), f"{prefix}bpb": ce / np.log(2.0) / max(nbytes, 1.0)}


def _check_finite(step: int, metrics: dict, run_dir: Path) -> None:
    for key in ("train/loss", "train/grad_norm"):
        v = metrics[key]
        if isinstance(v, str) or not np.isfinite(v):
            _atomic_write(run_dir / "nonfinite.json", json.dumps({"step": step, **metrics}, default=str))
            raise RunError(f"non-finite {key} ({v}) at step {step}; metrics written to {run_dir / 'nonfinite.json'}")


def summarize(history: list[dict], wall: float, cfg: RunConfig) -> dict:
    steady = history[min(2, len(history) - 1):]  # skip the compile-dominated first steps
    tps = float(np.median([h["throughput/tokens_per_second"] for h in steady]))
    out = {"preset": cfg.name, "steps": len(history), "first_loss": history[0]["train/loss"],
           "last_loss": history[-1]["train/loss"], "tokens_per_second": tps,
           "mfu": float(np.median([h["throughput/mfu"] for h in steady])), "wall_seconds": wall,
           "drop_fraction": history[-1]["moe/drop_fraction"]}
    for key in ("eval/loss", "eval/bpb"):
        if key in history[-1]:
            out[key] = history[-1][key]
    return out
