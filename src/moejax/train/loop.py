"""The training loop: run directory, data, state, jitted step, eval, metrics, summary.

Writes into RUN_DIR: `config.json` (the resolved RunConfig), `run_info.json` (git SHA, library versions,
device topology, derived numbers), `metrics.jsonl` (one object per step), `summary.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
from tqdm import tqdm

from moejax import accounting
from moejax.config import ParallelConfig, RunConfig
from moejax.data.pipeline import make_data
from moejax.export import init_params_from_export, is_export
from moejax.metrics import MetricsWriter, to_py
from moejax.model.moe.layer import routed_local_with_stats
from moejax.parallel.expert_parallel import routed_expert_parallel
from moejax.parallel.mesh import batch_sharding, make_mesh
from moejax.perf import measure_matmul_peak
from moejax.checkpoint import (EXIT_PREEMPTED, CheckpointError, CheckpointManager, PreemptionGuard, list_checkpoints,
                               restore)
from moejax.train.heuristic import optimizer_heuristic
from moejax.train.optimizer import hero_optimizer
from moejax.train.schedule import warmup_linear_decay
from moejax.train.state import TrainState, init_state
from moejax.train.step import Offload, make_eval_step, make_train_step


class RunError(RuntimeError):
    """A user-facing problem with the run directory or the run itself (one line, exit 2)."""


class Preempted(RuntimeError):
    """SIGTERM/SIGINT: the current step finished and a temporary checkpoint was written."""

    exit_code = EXIT_PREEMPTED


@dataclass(frozen=True)
class RunOptions:
    overwrite: bool = False
    wandb: str = "offline"
    wandb_project: str = "moejax"
    wandb_run_name: str = ""  # default: the run directory's name
    peak_flops: float = 0.0  # 0: measure this machine's fp32 matmul peak at start
    progress: bool = True
    remat: bool = False
    init_from: str = ""  # a checkpoint dir (a run dir: its newest; or an export dir) whose weights start a *new* run


def make_optimizer(cfg: RunConfig):
    """(optimizer, {group: lr schedule}). `adam`: optax Adam on every leaf at train.learning_rate.
    `hero`: MuonH/AdamH/Adam (SPEC §4) with the fitted heuristic for the lrs, eps and beta2 from
    (total tokens, width, tokens per batch); AdamH (LM head) runs at the Adam peak."""
    t = cfg.train
    sched = lambda peak: warmup_linear_decay(peak, t.steps, t.warmup_fraction, t.min_lr_fraction)
    if t.optimizer == "hero":
        hp = optimizer_heuristic(total_tokens=t.total_tokens, width=cfg.model.d_model, batch_tokens=t.tokens_per_step)
        opt = hero_optimizer(adam_lr=hp.adam_lr, muonh_lr=hp.muonh_lr, b1=hp.beta1, b2=hp.beta2, eps=hp.eps,
                             total_steps=t.steps, warmup_fraction=t.warmup_fraction, min_lr_fraction=t.min_lr_fraction)
        return opt, {"muonh": sched(hp.muonh_lr), "adam": sched(hp.adam_lr)}
    return optax.adam(sched(t.learning_rate), b1=t.b1, b2=t.b2, eps=t.eps), {"adam": sched(t.learning_rate)}


def _primary() -> bool:
    return jax.process_index() == 0


def prepare_run_dir(run_dir: Path, cfg: RunConfig, overwrite: bool, primary: bool = True) -> bool:
    """Create the run dir and its config.json; True when it already holds this run (resume).
    Only the primary process writes; the others only read what is there."""
    cfg_path = run_dir / "config.json"
    if not primary:
        return cfg_path.exists() and not overwrite
    if cfg_path.exists() and not overwrite:
        try:
            old = json.loads(cfg_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise RunError(f"run dir {run_dir} has an unreadable config.json ({e}); pass --overwrite to replace it")
        # The mesh may change between restarts (checkpoints reshard on load); the model and schedule may not.
        diff = _first_difference({k: v for k, v in old.items() if k != "parallel"},
                                 {k: v for k, v in cfg.to_dict().items() if k != "parallel"})
        if diff:
            raise RunError(f"run dir {run_dir} already holds a different run ({diff}); "
                           "choose another --run-dir or pass --overwrite")
        _atomic_write(cfg_path, cfg.to_json())  # records the mesh this restart runs on
        return True
    if run_dir.exists() and overwrite:
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _atomic_write(cfg_path, cfg.to_json())
    except OSError as e:
        raise RunError(f"cannot write to run dir {run_dir}: {e.strerror or e}") from None
    return False


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
    """Train (or resume) the run in `run_dir`; returns the summary. Raises RunError/ConfigError for user
    errors, Preempted after SIGTERM/SIGINT (a temporary checkpoint is then on disk)."""
    run_dir = Path(run_dir)
    make_mesh(cfg.parallel)  # fail on a mesh larger than the machine before any data work
    if opts.init_from and not Path(opts.init_from).is_dir():
        raise RunError(f"--init-from {opts.init_from}: no such checkpoint or run directory")
    data = make_data(cfg, process_index=jax.process_index(), process_count=jax.process_count())
    try:
        resuming = prepare_run_dir(run_dir, cfg, opts.overwrite, primary=_primary())
        peak = opts.peak_flops or measure_matmul_peak()
        if _primary():
            info = {**run_info(cfg, peak), "data": data.describe()}
            _atomic_write(run_dir / "run_info.json", json.dumps(info, indent=2))
        return _train_loop(cfg, run_dir, opts, data, resuming, peak)
    except CheckpointError as e:  # e.g. the disk filled up mid-run: one line, the last good checkpoint stays
        raise RunError(str(e)) from None
    finally:
        data.close()


@dataclass
class _Session:
    """Everything the step loop needs, built once per (re)start."""

    state: TrainState
    step_fn: Callable
    eval_fns: dict[str, Callable]
    to_global: Callable  # this process's numpy rows -> a global array sharded over the batch axes
    ckpt: CheckpointManager
    bytes_per_token: jax.Array  # [V] UTF-8 bytes per id, for bits per byte


def _setup(cfg: RunConfig, run_dir: Path, opts: RunOptions, resuming: bool, data) -> _Session:
    m, t = cfg.model, cfg.train
    optimizer, lr_fns = make_optimizer(cfg)
    try:
        ckpt = CheckpointManager(run_dir, permanent_every=t.checkpoint_every,
                                 temporary_every_s=60.0 * t.temp_checkpoint_minutes,
                                 model_config=dataclasses.asdict(m), run_config=cfg.to_dict())
    except CheckpointError as e:
        raise RunError(str(e)) from None
    mesh = make_mesh(cfg.parallel)
    state = init_state(cfg, optimizer, jax.random.key(t.seed), mesh)
    state = _initial_state(state, ckpt, resuming, opts.init_from, optimizer, dataclasses.asdict(m))
    state, offload = place_state(state, t.opt_state_memory)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    routed = routed_backend(cfg.parallel, mesh)
    batch_sh = batch_sharding(mesh)
    step_fn = jax.jit(make_train_step(m, optimizer, lr_fns, routed, remat=opts.remat or t.remat, offload=offload),
                      donate_argnums=0, in_shardings=(state_sh, batch_sh),
                      out_shardings=(state_sh, NamedSharding(mesh, P())))  # metrics replicated: any host reads them
    eval_fns = {"eval/": jax.jit(make_eval_step(m, routed))}
    if cfg.parallel.use_ep:  # the same weights on the local path: nothing dropped (SPEC §5)
        eval_fns["eval_dropless/"] = jax.jit(make_eval_step(m))
    return _Session(state, step_fn, eval_fns, lambda b: jax.make_array_from_process_local_data(batch_sh, b), ckpt,
                    jnp.asarray(data.bytes_per_token))


def _eval_metrics(s: _Session, data, n_batches: int) -> dict:
    params = s.state.compute  # device-resident, router bias included, as the train step saw it
    out = {}
    for prefix, fn in s.eval_fns.items():
        out.update(evaluate(fn, params, data.eval, n_batches, s.bytes_per_token, prefix, s.to_global))
    return out


def _train_loop(cfg: RunConfig, run_dir: Path, opts: RunOptions, data, resuming: bool, peak: float) -> dict:
    t = cfg.train
    s = _setup(cfg, run_dir, opts, resuming, data)
    start = int(s.state.step)
    if start:
        _truncate_metrics(run_dir, start)
    writer = MetricsWriter(run_dir, wandb_mode=opts.wandb, project=opts.wandb_project,
                           run_name=opts.wandb_run_name or run_dir.name, config=cfg.to_dict(), primary=_primary())
    fault_at = int(os.environ.get("MOEJAX_FAULT_SIGTERM_AT_STEP", "0"))
    bar = tqdm(total=t.steps, initial=start, disable=not opts.progress, desc=f"train {cfg.name}", unit="step",
               dynamic_ncols=True)
    history, t_start = [], time.perf_counter()
    try:
        with PreemptionGuard() as guard:
            for step in range(start, t.steps):
                t0 = time.perf_counter()
                s.state, metrics = s.step_fn(s.state, s.to_global(data.train.batch(step)))
                metrics = {k: to_py(v) for k, v in jax.device_get(metrics).items()}
                _check_finite(step, metrics, run_dir)
                metrics.update(_throughput(cfg, data.train.seq_len_at(step), time.perf_counter() - t0, peak))
                last = step + 1 == t.steps
                if last or (t.eval_every and (step + 1) % t.eval_every == 0):
                    metrics.update(_eval_metrics(s, data, t.eval_batches))
                if step % t.log_every == 0 or last:
                    writer.log(step, metrics)
                history.append(metrics)
                bar.set_postfix(loss=f"{metrics['train/loss']:.3f}",
                                tok_s=f"{metrics['throughput/tokens_per_second']:.0f}",
                                drop=f"{metrics['moe/drop_fraction']:.3f}")
                bar.update(1)
                if step + 1 == fault_at:  # fault injection for the preemption tests: a real SIGTERM
                    os.kill(os.getpid(), signal.SIGTERM)
                if guard.stop_requested():
                    s.ckpt.save(step + 1, s.state, kind="temporary", extra_metadata={"data_step": step + 1})
                    s.ckpt.wait()
                    raise Preempted(f"preempted after step {step + 1}; checkpoint saved in {run_dir}; "
                                    "run the same command again to resume")
                if not last and (kind := s.ckpt.should_save(step + 1)):
                    s.ckpt.save(step + 1, s.state, kind=kind, extra_metadata={"data_step": step + 1})
            s.ckpt.save(int(s.state.step), s.state, kind="final", extra_metadata={"data_step": int(s.state.step)})
    finally:
        bar.close()
        writer.close()
        s.ckpt.close()
    if not history:  # the run had already finished: report it again
        return json.loads((run_dir / "summary.json").read_text())
    summary = summarize(history, time.perf_counter() - t_start, cfg)
    if _primary():
        _atomic_write(run_dir / "summary.json", json.dumps(summary, indent=2))
    return summary


def _throughput(cfg: RunConfig, seq_len: int, seconds: float, peak: float) -> dict:
    tokens = cfg.train.tokens_per_step
    flops = 3.0 * accounting.fwd_flops_per_token(cfg.model, seq_len) * tokens
    return {"throughput/step_time": seconds, "throughput/tokens_per_second": tokens / seconds,
            "throughput/mfu": flops / seconds / peak, "data/seq_len": seq_len}


def _initial_state(state: TrainState, ckpt: CheckpointManager, resuming: bool, init_from: str, optimizer,
                   model_cfg: dict) -> TrainState:
    """Resume from this run's newest complete checkpoint, or start a new run from another run's weights."""
    try:
        if resuming:
            restored = ckpt.restore_latest(state)
            if restored is not None:
                return restored[0]
        if init_from:
            src = Path(init_from)
            if is_export(src):  # `moejax export` output: weights + router bias, no optimizer state
                params, qb_bias = init_params_from_export(src, state.params, state.qb_bias, model_cfg)
            else:
                if (src / "checkpoints").is_dir():
                    complete = [c for c in list_checkpoints(src) if c.complete]
                    if not complete:
                        raise RunError(f"--init-from {src}: no complete checkpoint in {src / 'checkpoints'}")
                    src = complete[-1].path
                elif not src.is_dir():
                    raise RunError(f"--init-from {src}: no such checkpoint or run directory")
                loaded, _ = restore(src, state, model_config=model_cfg)
                params, qb_bias = loaded.params, loaded.qb_bias
            compute = jax.tree.map(lambda p, c: p.astype(c.dtype), params, state.compute)
            return TrainState(step=state.step, params=params, compute=compute, opt_state=optimizer.init(params),
                              qb_bias=qb_bias, rng=state.rng)
    except CheckpointError as e:
        raise RunError(str(e)) from None
    return state


def _truncate_metrics(run_dir: Path, start: int) -> None:
    """Drop rows of steps that will be re-run after a resume, so metrics.jsonl has each step once."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < start]
        _atomic_write(path, "".join(r + "\n" for r in rows))


def evaluate(eval_fn, params, data, n_batches: int, bpt, prefix: str, to_global=lambda b: b) -> dict:
    """Held-out loss and bits per byte over the first `n_batches` eval batches (always the same ones)."""
    ce, toks, nbytes, drops = 0.0, 0.0, 0.0, []
    for i in range(n_batches):
        out = jax.device_get(eval_fn(params, to_global(data.batch(i)), bpt))
        ce, toks, nbytes = ce + float(out["ce_sum"]), toks + float(out["tokens"]), nbytes + float(out["bytes"])
        drops.append(float(out["moe/drop_fraction"]))
    return {f"{prefix}loss": ce / max(toks, 1.0), f"{prefix}bpb": ce / np.log(2.0) / max(nbytes, 1.0),
            f"{prefix}drop_fraction": float(np.mean(drops))}


def place_state(state: TrainState, memory: str) -> tuple[TrainState, Offload | None]:
    """Keep fp32 master weights + optimizer state in `pinned_host` memory when asked (SPEC §4)."""
    if memory == "device":
        return state, None
    dev = lambda tree: jax.tree.map(lambda x: x.sharding.with_memory_kind("device"), tree)
    host = lambda tree: jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), tree)
    offload = Offload(params_device=dev(state.params), opt_device=dev(state.opt_state),
                      params_host=host(state.params), opt_host=host(state.opt_state))
    state = dataclasses.replace(state, params=jax.device_put(state.params, offload.params_host),
                                opt_state=jax.device_put(state.opt_state, offload.opt_host))
    return state, offload


def routed_backend(p: ParallelConfig, mesh):
    """The MoE path is configuration: pooled-wave EP when the expert axis is used, else local dropless."""
    if not p.use_ep:
        return routed_local_with_stats
    return functools.partial(routed_expert_parallel, mesh=mesh, waves=p.waves, cf_send=p.cf_send, cf_recv=p.cf_recv)


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
    for key in ("eval/loss", "eval/bpb", "eval_dropless/loss", "eval_dropless/bpb"):
        if key in history[-1]:
            out[key] = history[-1][key]
    return out
